//! The I/O threads that drive data streams.
//!
//! Each I/O thread runs its own current-thread tokio runtime, and every data stream (a client
//! stream's sender and receiver, or a served stream) lives on one of them for its whole life,
//! assigned round-robin. Control work (handshakes, accepting, awaiting outcomes) stays on the
//! caller's runtime.
//!
//! A stream pinned to one thread blocks and wakes like a thread blocked on its socket (what
//! iperf3 does) and never migrates between runtime workers, while the number of threads stays
//! bounded however many peers and streams there are. Why not the caller's multi-thread runtime,
//! as measured: `docs/performance.md`.

use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A lazily started, fixed set of I/O threads, or the caller's runtime. Dropping it stops the
/// threads (tasks still on them are dropped, which closes their sockets).
#[derive(Debug)]
pub(crate) struct IoPool {
    /// 0: no threads of its own; tasks go to the caller's runtime (`tokio::spawn`).
    size: usize,
    name: &'static str,
    workers: Mutex<Vec<Worker>>,
    next: AtomicUsize,
}

#[derive(Debug)]
struct Worker {
    handle: Handle,
    stop: Option<oneshot::Sender<()>>,
}

impl IoPool {
    /// A pool of `size` threads (`Some(0)`: one per available core), none started yet; `None`:
    /// no threads, tasks run on the caller's runtime.
    pub(crate) fn new(size: Option<usize>, name: &'static str) -> Self {
        let size = match size {
            None => 0,
            Some(0) => std::thread::available_parallelism().map_or(1, |n| n.get()),
            Some(n) => n,
        };
        Self {
            size: size.min(256),
            name,
            workers: Mutex::new(Vec::new()),
            next: AtomicUsize::new(0),
        }
    }

    /// Runs `fut` on the next I/O thread (round-robin), starting that thread on first use, or
    /// on the caller's runtime (which must exist) for a pool without threads. Sockets must be
    /// registered with the runtime from inside `fut` (`TcpStream::from_std`).
    pub(crate) fn spawn<F>(&self, fut: F) -> std::io::Result<JoinHandle<F::Output>>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        if self.size == 0 {
            let handle = Handle::try_current().map_err(std::io::Error::other)?;
            return Ok(handle.spawn(fut));
        }
        let handle = self.pick()?;
        Ok(handle.spawn(fut))
    }

    /// The runtime of the next I/O thread (a pool with threads).
    fn pick(&self) -> std::io::Result<Handle> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.size;
        let mut workers = self
            .workers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while workers.len() <= i {
            let index = workers.len();
            workers.push(start(self.name, index)?);
        }
        Ok(workers[i].handle.clone())
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        let workers = self
            .workers
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for w in workers.iter_mut() {
            if let Some(stop) = w.stop.take() {
                let _ = stop.send(());
            }
        }
    }
}

fn start(name: &str, index: usize) -> std::io::Result<Worker> {
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<std::io::Result<Handle>>(1);
    std::thread::Builder::new()
        .name(format!("{name}{index}"))
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(rt.handle().clone()));
            // Until the pool is dropped (a dropped sender ends the wait too); dropping the
            // runtime then drops every task still on it.
            let _ = rt.block_on(stop_rx);
        })?;
    let handle = ready_rx
        .recv()
        .map_err(|_| std::io::Error::other("an I/O thread ended before starting its runtime"))??;
    Ok(Worker {
        handle,
        stop: Some(stop_tx),
    })
}

/// Aborts a task on an I/O thread when dropped (the task serving a connection whose owner went
/// away).
#[derive(Debug)]
pub(crate) struct AbortOnDrop<T>(pub(crate) JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_over_lazily_started_threads() {
        let pool = IoPool::new(Some(2), "ferry-test-io");
        let names: Vec<String> = (0..4)
            .map(|_| {
                let h = pool
                    .spawn(async { std::thread::current().name().map(str::to_owned) })
                    .unwrap();
                block_on(h).unwrap().unwrap()
            })
            .collect();
        assert_eq!(
            names,
            [
                "ferry-test-io0",
                "ferry-test-io1",
                "ferry-test-io0",
                "ferry-test-io1"
            ]
        );
    }

    #[test]
    fn dropping_the_pool_drops_its_tasks() {
        let pool = IoPool::new(Some(1), "ferry-test-drop");
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        struct Guard(std::sync::mpsc::Sender<()>);
        impl Drop for Guard {
            fn drop(&mut self) {
                let _ = self.0.send(());
            }
        }
        let g = Guard(tx);
        pool.spawn(async move {
            let _g = g;
            std::future::pending::<()>().await
        })
        .unwrap();
        drop(pool);
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .expect("the task was dropped with the pool");
    }

    #[test]
    fn without_threads_tasks_run_on_the_callers_runtime() {
        let pool = IoPool::new(None, "unused");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let caller = std::thread::current().id();
        let ran_on = rt.block_on(async {
            pool.spawn(async { std::thread::current().id() })
                .unwrap()
                .await
        });
        assert_eq!(ran_on.unwrap(), caller);
        assert!(pool.spawn(async {}).is_err(), "no runtime outside one");
    }

    fn block_on<T>(h: JoinHandle<T>) -> Result<T, tokio::task::JoinError> {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(h)
    }
}

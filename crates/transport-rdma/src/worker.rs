//! A channel's worker thread: it owns the channel's queue pairs (in its [`Pump`]), takes
//! requests and rebuilt queue pairs from the channel, posts and busy-polls.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use ferry_core::{Op, Outcome, RequestControl};

use crate::pump::{OpKeys, Pump};
use crate::verbs::QpVerbs;

/// What a channel hands its worker.
pub(crate) enum Job {
    /// Runs a request; its outcome goes to `done`.
    Run {
        ops: Arc<[Op]>,
        control: Arc<RequestControl>,
        keys: Vec<OpKeys>,
        done: tokio::sync::oneshot::Sender<Outcome>,
    },
    /// A fresh, connected queue pair for channel rail `rail` (a heal).
    Rebuild { rail: usize, qp: Box<dyn QpVerbs> },
    /// Closes the channel: what is outstanding is flushed, then the worker exits.
    Close,
}

/// The worker's loop: takes jobs, steps the pump, publishes whether the channel is alive, and
/// spins, yields, then naps while there is nothing to do.
pub(crate) fn worker(mut pump: Pump, rx: mpsc::Receiver<Job>, alive: Arc<AtomicBool>) {
    let mut closing = false;
    let mut idle_spins: u32 = 0;
    let take = |job: Job, pump: &mut Pump, closing: &mut bool| match job {
        Job::Run {
            ops,
            control,
            keys,
            done,
        } => pump.add(
            ops,
            control,
            keys,
            Box::new(move |o| {
                let _ = done.send(o);
            }),
        ),
        Job::Rebuild { rail, qp } => pump.rebuild(rail, qp),
        Job::Close => {
            pump.close();
            *closing = true;
        }
    };
    loop {
        if pump.idle() {
            if closing {
                break;
            }
            match rx.recv() {
                Ok(job) => take(job, &mut pump, &mut closing),
                Err(_) => {
                    pump.close();
                    closing = true;
                }
            }
        }
        loop {
            match rx.try_recv() {
                Ok(job) => take(job, &mut pump, &mut closing),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    if !closing {
                        pump.close();
                        closing = true;
                    }
                    break;
                }
            }
        }
        let progressed = pump.step();
        alive.store(pump.alive() && !closing, Ordering::Release);
        if progressed {
            idle_spins = 0;
        } else {
            idle_spins = idle_spins.saturating_add(1);
            if idle_spins > 20_000 {
                std::thread::sleep(Duration::from_micros(50));
            } else if idle_spins > 32 {
                std::thread::yield_now();
            }
        }
    }
    alive.store(false, Ordering::Release);
    tracing::debug!("RDMA channel worker done");
}

//! The client side: a channel of several data streams to one peer incarnation.
//!
//! Each stream has a sender task (writes request headers and WRITE payloads straight from
//! registered memory) and a receiver task (reads responses and READ payloads straight into
//! registered memory), both on the stream's I/O thread (`pool.rs`). Chunks are striped over the streams round-robin; each stream keeps at most
//! `depth` chunks in flight. Responses on a stream come back in request order, so the receiver
//! matches them with a FIFO of in-flight chunks (and checks the sequence number).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use ferry_core::wire::{DATA_REQUEST_LEN, DATA_RESPONSE_LEN, DataRequest, DataResponse};
use ferry_core::{
    BoxFuture, Channel, FailureKind, Op, OpKind, Outcome, RequestControl, TransportKind,
};
use tokio::net::TcpStream;
use tokio::sync::{Notify, mpsc};
use tracing::debug;

use crate::io::{RawRange, recv_buf, recv_exact, send_all, shutdown, shutdown_std};
use crate::pool::IoPool;

/// Payloads up to this size are staged with their header and sent in one call.
const SMALL: usize = 16 << 10;

/// One request being executed.
#[derive(Debug)]
struct ReqShared {
    ops: Arc<[Op]>,
    control: Arc<RequestControl>,
    /// Chunks handed to streams and not resolved yet, plus one held by the poster.
    outstanding: AtomicUsize,
    done: Notify,
}

impl ReqShared {
    fn resolve_one(&self) {
        if self.outstanding.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.done.notify_one();
        }
    }
}

#[derive(Debug)]
struct Job {
    req: Arc<ReqShared>,
    op: usize,
    /// Offset of the chunk within the op.
    at: u64,
    len: u64,
}

#[derive(Debug)]
struct InFlight {
    job: Job,
    seq: u32,
}

#[derive(Debug)]
struct StreamSlot {
    jobs: mpsc::Sender<Job>,
    dead: Arc<AtomicBool>,
    /// A duplicate of the stream's descriptor, to shut it down from any thread.
    socket: std::net::TcpStream,
}

/// A data channel to one peer over TCP.
#[derive(Debug)]
pub struct TcpChannel {
    peer: SocketAddr,
    streams: Vec<StreamSlot>,
    next: AtomicUsize,
    chunk: u64,
    closed: AtomicBool,
    /// Keeps the I/O threads of the streams running while the channel lives.
    _pool: Arc<IoPool>,
}

impl TcpChannel {
    /// Moves each stream to an I/O thread of `pool`, where its sender and receiver tasks run.
    pub(crate) fn new(
        peer: SocketAddr,
        sockets: Vec<TcpStream>,
        chunk: u64,
        depth: usize,
        pool: &Arc<IoPool>,
    ) -> std::io::Result<Self> {
        let depth = depth.max(1);
        let mut streams = Vec::with_capacity(sockets.len());
        for (i, s) in sockets.into_iter().enumerate() {
            // Out of the caller's reactor, into the I/O thread's; a duplicate descriptor stays
            // here to shut the socket down from any thread.
            let std_socket = s.into_std()?;
            let control = std_socket.try_clone()?;
            let dead = Arc::new(AtomicBool::new(false));
            let (jobs_tx, jobs_rx) = mpsc::channel(depth);
            let (fly_tx, fly_rx) = mpsc::channel(depth);
            let d = dead.clone();
            pool.spawn(async move {
                let socket = match TcpStream::from_std(std_socket) {
                    Ok(s) => Arc::new(s),
                    Err(e) => {
                        debug!(%peer, stream = i, error = %e, "registering the stream failed");
                        d.store(true, Ordering::Release);
                        return;
                    }
                };
                tokio::spawn(receiver(socket.clone(), d.clone(), fly_rx, peer, i));
                sender(socket, d, jobs_rx, fly_tx, peer, i).await;
            })?;
            streams.push(StreamSlot {
                jobs: jobs_tx,
                dead,
                socket: control,
            });
        }
        Ok(Self {
            peer,
            streams,
            next: AtomicUsize::new(0),
            chunk: chunk.max(1),
            closed: AtomicBool::new(false),
            _pool: pool.clone(),
        })
    }
}

impl Channel for TcpChannel {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn execute(&self, ops: Arc<[Op]>, control: Arc<RequestControl>) -> BoxFuture<'static, Outcome> {
        // The future must be 'static: take what it needs from `self` now.
        let slots: Vec<(mpsc::Sender<Job>, Arc<AtomicBool>)> = self
            .streams
            .iter()
            .map(|s| (s.jobs.clone(), s.dead.clone()))
            .collect();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let chunk = self.chunk;
        let closed = self.closed.load(Ordering::Acquire);
        Box::pin(async move {
            let req = Arc::new(ReqShared {
                ops: ops.clone(),
                control: control.clone(),
                outstanding: AtomicUsize::new(1),
                done: Notify::new(),
            });
            let mut rr = start;
            'ops: for (i, op) in ops.iter().enumerate() {
                let chunks = op.len.div_ceil(chunk).max(1);
                let Ok(chunks32) = u32::try_from(chunks) else {
                    control.with_ledger(|l| l.not_posted(i, FailureKind::Local, None));
                    break;
                };
                control.with_ledger(|l| l.plan(i, chunks32));
                for c in 0..chunks {
                    if control.should_stop_posting() {
                        break 'ops;
                    }
                    let at = c * chunk;
                    let len = chunk.min(op.len - at);
                    let mut job = Job {
                        req: req.clone(),
                        op: i,
                        at,
                        len,
                    };
                    loop {
                        let live: Option<&(mpsc::Sender<Job>, Arc<AtomicBool>)> = if closed {
                            None
                        } else {
                            (0..slots.len())
                                .map(|k| &slots[(rr + k) % slots.len()])
                                .find(|s| !s.1.load(Ordering::Acquire))
                        };
                        rr = rr.wrapping_add(1);
                        let Some((tx, _)) = live else {
                            control.with_ledger(|l| l.not_posted(i, FailureKind::PeerLost, None));
                            break 'ops;
                        };
                        req.outstanding.fetch_add(1, Ordering::AcqRel);
                        match tx.send(job).await {
                            Ok(()) => break,
                            Err(mpsc::error::SendError(j)) => {
                                // That stream's sender task is gone: try another.
                                req.outstanding.fetch_sub(1, Ordering::AcqRel);
                                job = j;
                            }
                        }
                    }
                }
            }
            if req.outstanding.fetch_sub(1, Ordering::AcqRel) != 1 {
                req.done.notified().await;
            }
            control.outcome(true)
        })
    }

    fn is_alive(&self) -> bool {
        !self.closed.load(Ordering::Acquire)
            && self.streams.iter().any(|s| !s.dead.load(Ordering::Acquire))
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        for s in &self.streams {
            s.dead.store(true, Ordering::Release);
            shutdown_std(&s.socket);
        }
        debug!(peer = %self.peer, "channel closed");
    }
}

impl Drop for TcpChannel {
    fn drop(&mut self) {
        for s in &self.streams {
            shutdown_std(&s.socket);
        }
    }
}

fn fail_unposted(job: Job) {
    job.req
        .control
        .with_ledger(|l| l.not_posted(job.op, FailureKind::PeerLost, None));
    job.req.resolve_one();
}

fn fail_lost(job: Job, native: Option<i32>) {
    job.req
        .control
        .with_ledger(|l| l.lost(job.op, FailureKind::PeerLost, native));
    job.req.resolve_one();
}

async fn sender(
    socket: Arc<TcpStream>,
    dead: Arc<AtomicBool>,
    mut jobs: mpsc::Receiver<Job>,
    fly: mpsc::Sender<InFlight>,
    peer: SocketAddr,
    index: usize,
) {
    let seq = AtomicU32::new(0);
    let mut head = [0u8; DATA_REQUEST_LEN];
    let mut stage = vec![0u8; DATA_REQUEST_LEN + SMALL];
    while let Some(job) = jobs.recv().await {
        if dead.load(Ordering::Acquire) {
            fail_unposted(job);
            continue;
        }
        let Ok(permit) = fly.reserve().await else {
            dead.store(true, Ordering::Release);
            fail_unposted(job);
            continue;
        };
        let op = &job.req.ops[job.op];
        let s = seq.fetch_add(1, Ordering::Relaxed);
        let req = DataRequest {
            kind: op.kind,
            seq: s,
            token: op.token,
            offset: op.remote_offset + job.at,
            len: job.len,
            ack_slack: 0,
        };
        req.encode(&mut head);
        let local_at = op.local_offset + job.at;
        let body = RawRange {
            addr: op.local.as_ptr() as usize + local_at as usize,
            len: job.len as usize,
        };
        let is_write = op.kind == OpKind::Write;
        let small_write = is_write && body.len <= SMALL;
        if small_write {
            stage[..DATA_REQUEST_LEN].copy_from_slice(&head);
            let dst = &mut stage[DATA_REQUEST_LEN..DATA_REQUEST_LEN + body.len];
            if op.local.read_at(local_at, dst).is_err() {
                job.req
                    .control
                    .with_ledger(|l| l.not_posted(job.op, FailureKind::Local, None));
                job.req.resolve_one();
                continue;
            }
        }
        let local_len_ok = op.local.check(local_at, job.len).is_ok();
        if !local_len_ok {
            job.req
                .control
                .with_ledger(|l| l.not_posted(job.op, FailureKind::Local, None));
            job.req.resolve_one();
            continue;
        }
        job.req.control.with_ledger(|l| l.posted(job.op));
        let total = DATA_REQUEST_LEN + body.len;
        permit.send(InFlight { job, seq: s });
        let res = if small_write {
            crate::io::send_buf(&socket, &stage[..total]).await
        } else if is_write {
            // SAFETY: the range was bounds-checked against the region just above; the request
            // owns it until drained and keeps the region alive (the in-flight job holds an Arc).
            unsafe { send_all(&socket, &head, body).await }
        } else {
            crate::io::send_buf(&socket, &head).await
        };
        if let Err(e) = res {
            debug!(%peer, stream = index, error = %e, "send failed; stream closed");
            dead.store(true, Ordering::Release);
            // Wake the receiver: it fails everything in flight on this stream as lost.
            shutdown(&socket);
        }
    }
}

async fn receiver(
    socket: Arc<TcpStream>,
    dead: Arc<AtomicBool>,
    mut fly: mpsc::Receiver<InFlight>,
    peer: SocketAddr,
    index: usize,
) {
    let mut head = [0u8; DATA_RESPONSE_LEN];
    while let Some(f) = fly.recv().await {
        if let Err(e) = recv_buf(&socket, &mut head).await {
            debug!(%peer, stream = index, error = %e, "receive failed; stream closed");
            fail_lost(f.job, e.raw_os_error());
            break;
        }
        let resp = match DataResponse::decode(&head) {
            Ok(r) if r.seq == f.seq => r,
            other => {
                debug!(%peer, stream = index, ?other, "bad response; stream closed");
                fail_lost(f.job, None);
                break;
            }
        };
        let job = f.job;
        let op = &job.req.ops[job.op];
        if let Some(status) = resp.refused {
            job.req.control.with_ledger(|l| l.refused(job.op, status));
            job.req.resolve_one();
            continue;
        }
        if op.kind == OpKind::Read {
            if resp.len != job.len {
                fail_lost(job, None);
                break;
            }
            let at = op.local_offset + job.at;
            if op.local.check(at, job.len).is_err() {
                fail_lost(job, None);
                break;
            }
            let dst = RawRange {
                addr: op.local.as_ptr() as usize + at as usize,
                len: job.len as usize,
            };
            // SAFETY: bounds-checked above; the request owns the range until drained, keeps the
            // region alive through the job's Arc, and no Rust reference to it exists (raw recv).
            if let Err(e) = unsafe { recv_exact(&socket, dst).await } {
                debug!(%peer, stream = index, error = %e, "receive failed; stream closed");
                fail_lost(job, e.raw_os_error());
                break;
            }
        }
        job.req.control.with_ledger(|l| l.acked(job.op));
        job.req.resolve_one();
    }
    dead.store(true, Ordering::Release);
    shutdown(&socket);
    fly.close();
    while let Some(f) = fly.recv().await {
        fail_lost(f.job, None);
    }
}

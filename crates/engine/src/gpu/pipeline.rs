//! The client's staging pipeline: a request's device ops cut into chunks of one pool buffer,
//! each moved by a lane's copies and a host sub-request on the peer's channel.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use ferry_core::{Error, FailureKind, Op, OpKind, Outcome, RemoteEffect, RequestControl};
use ferry_cuda::CudaError;

use ferry_core::BoxFuture;
use ferry_registry::Registry;

use super::config::Staging;
use super::pool::{GpuState, StagingPool};
use crate::request::{Local as StagedLocal, StagedOp};

/// How the pipeline runs host ops on the request's peer: one sub-request to its end (drained),
/// reconnecting and replaying as the peer's policy allows until the deadline, if any.
pub(crate) type HostRunner = Arc<
    dyn Fn(
            Arc<[Op]>,
            Arc<RequestControl>,
            Option<tokio::time::Instant>,
        ) -> BoxFuture<'static, Outcome>
        + Send
        + Sync,
>;

/// Checks the staging policy and returns the pool for `ops` (the caller saw a device op): the
/// pool of the first device op's GPU. Device ops of a batch on another GPU are staged through
/// it too, by that GPU's own blocking copies (correct, not overlapped on streams): a batch per
/// GPU moves fastest.
/// `rdma` is the registry when RDMA is on (the pool's buffers are then registered with it).
pub(crate) fn prepare(
    gpu: Option<&GpuState>,
    rdma: Option<&Registry>,
    ops: &[StagedOp],
) -> Result<Arc<StagingPool>, Error> {
    let Some(state) = gpu else {
        return Err(Error::Unavailable {
            library: "ferry cuda".into(),
            reason: "GPU support is off in this engine".into(),
        });
    };
    if state.config.staging == Staging::Never {
        return Err(Error::InvalidRequest {
            reason: "staging: never, and no direct route serves GPU memory on this peer's \
                     transport (TCP and io_uring move host memory only; over RDMA every GPU \
                     op of the batch needs a registration whose GPUDirect route is dmabuf or \
                     peermem): allow staging (auto), register with a GPUDirect route, or use \
                     host memory"
                .into(),
        });
    }
    let device = ops
        .iter()
        .find_map(|o| match &o.local {
            StagedLocal::Device(m, ..) => Some(m.device().clone()),
            StagedLocal::Host(_) => None,
        })
        .ok_or_else(|| Error::InvalidRequest {
            reason: "no GPU op to stage".into(),
        })?;
    state.pool(&device, rdma)
}

/// One piece of the pipeline: a host op whole, or one buffer's worth of a device op.
#[derive(Clone, Copy)]
struct Piece {
    op: usize,
    offset: u64,
    len: u64,
}

/// The pieces of a staged request, in order, handed out to its workers one at a time.
struct Cursor {
    op: usize,
    offset: u64,
}

/// What the workers of one staged request share.
struct Pipeline {
    host: HostRunner,
    ops: Arc<[StagedOp]>,
    control: Arc<RequestControl>,
    pool: Arc<StagingPool>,
    gpu: Arc<GpuState>,
    deadline: Option<tokio::time::Instant>,
    cursor: Mutex<Cursor>,
}

impl Pipeline {
    /// The next piece to post, unless the request stopped or every piece was handed out.
    fn next(&self) -> Option<Piece> {
        if self.control.should_stop_posting() {
            return None;
        }
        let chunk = self.pool.buffer_size as u64;
        let mut c = self.cursor.lock().unwrap_or_else(PoisonError::into_inner);
        let op = self.ops.get(c.op)?;
        let piece = match op.local {
            StagedLocal::Host(_) => Piece {
                op: c.op,
                offset: 0,
                len: op.len,
            },
            StagedLocal::Device(..) => Piece {
                op: c.op,
                offset: c.offset,
                len: chunk.min(op.len - c.offset),
            },
        };
        c.offset += piece.len;
        if matches!(op.local, StagedLocal::Host(_)) || c.offset >= op.len {
            c.op += 1;
            c.offset = 0;
        }
        Some(piece)
    }
}

/// Runs a request whose ops include device memory: host ops go through the channel as they are,
/// device ops through the pool's lanes (a pinned buffer and a copy stream each), at most one
/// piece per lane in flight. Each piece is a sub-request on the peer's channel that reconnects and
/// replays after a lost connection as any request does (a READ piece always; a WRITE piece under
/// `replay_writes`), bounded by the request's `timeout`. Every piece is recorded in `control`'s
/// ledger, so the outcome's prefix, failure and remote effect follow the same rules as any
/// request's.
///
/// Allocations are per request (its workers), not per chunk: a chunk borrows a lane, and its
/// sub-request costs what any one-op request costs (its op, its ledger, the channel's future).
pub(crate) async fn run(
    host: HostRunner,
    ops: Arc<[StagedOp]>,
    control: Arc<RequestControl>,
    pool: Arc<StagingPool>,
    gpu: Arc<GpuState>,
    timeout: Option<std::time::Duration>,
) -> Outcome {
    let chunk = pool.buffer_size as u64;
    control.with_ledger(|l| {
        for (i, op) in ops.iter().enumerate() {
            let n = match op.local {
                StagedLocal::Host(_) => 1,
                StagedLocal::Device(..) => op.len.div_ceil(chunk).max(1),
            };
            l.plan(i, n as u32);
        }
    });
    let pipeline = Arc::new(Pipeline {
        deadline: timeout.map(|t| tokio::time::Instant::now() + t),
        host,
        ops,
        control,
        pool,
        gpu,
        cursor: Mutex::new(Cursor { op: 0, offset: 0 }),
    });
    // As many workers as lanes, each a task of its own (so that one's completion is handled
    // while another's is polled, on another runtime thread); each takes the next piece when its
    // last one drained.
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..pipeline.pool.buffers {
        let p = pipeline.clone();
        workers.spawn(async move { worker(&p).await });
    }
    while workers.join_next().await.is_some() {}
    pipeline.control.outcome(true)
}

async fn worker(p: &Pipeline) {
    while let Some(piece) = p.next() {
        run_piece(p, piece).await;
    }
}

async fn run_piece(p: &Pipeline, piece: Piece) {
    let op = &p.ops[piece.op];
    let state = &*p.gpu;
    let counters = &state.counters;
    let control = &p.control;
    let mem = match &op.local {
        StagedLocal::Host(region) => {
            let host = Op {
                kind: op.kind,
                local: region.clone(),
                local_offset: op.local_offset,
                token: op.token,
                remote_offset: op.remote_offset,
                len: op.len,
            };
            let o = execute(p, host).await;
            record(control, piece.op, &o);
            return;
        }
        StagedLocal::Device(m, ..) => m,
    };
    let Some(mut guard) = p.pool.take().await else {
        control.with_ledger(|l| l.not_posted(piece.op, FailureKind::Local, None));
        return;
    };
    let lane = guard.lane();
    let n = piece.len as usize;
    let at = op.local_offset + piece.offset;
    let host = Op {
        kind: op.kind,
        local: lane.buf.clone(),
        local_offset: 0,
        token: op.token,
        remote_offset: op.remote_offset + piece.offset,
        len: piece.len,
    };
    let to_host = match op.kind {
        OpKind::Write => true,
        OpKind::Read => false,
        // A checksum answers into host memory (`Peer::checksum`); it is never staged.
        OpKind::Checksum => {
            control.with_ledger(|l| l.not_posted(piece.op, FailureKind::Local, None));
            return;
        }
    };
    let copied = |r: Result<(), Option<CudaError>>, t0: Instant| {
        counters
            .copy_wait_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        counters.copies.fetch_add(1, Ordering::Relaxed);
        r.map_err(|e| {
            counters.copy_failures.fetch_add(1, Ordering::Relaxed);
            let code = e.as_ref().and_then(CudaError::code);
            match e {
                Some(e) => tracing::warn!(error = %e, "staging copy failed"),
                None => tracing::warn!("staging copy failed: its lane's thread is gone"),
            }
            code
        })
    };
    if to_host {
        let t0 = Instant::now();
        if let Err(code) = copied(lane.copy(mem, at, n, true).await, t0) {
            // Nothing of this chunk was sent.
            control.with_ledger(|l| l.not_posted(piece.op, FailureKind::Local, code));
            return;
        }
        let o = execute(p, host).await;
        if o.is_success() {
            counters
                .staged_bytes
                .fetch_add(piece.len, Ordering::Relaxed);
        }
        record(control, piece.op, &o);
    } else {
        let o = execute(p, host).await;
        if !o.is_success() {
            record(control, piece.op, &o);
            return;
        }
        let t0 = Instant::now();
        match copied(lane.copy(mem, at, n, false).await, t0) {
            Ok(()) => {
                counters
                    .staged_bytes
                    .fetch_add(piece.len, Ordering::Relaxed);
                record(control, piece.op, &o);
            }
            Err(code) => control.with_ledger(|l| l.not_posted(piece.op, FailureKind::Local, code)),
        }
    }
    drop(guard);
}

/// Runs one host op as a sub-request on the peer's channel to its end (drained), reconnecting
/// and replaying as the peer's policy allows until the request's deadline; a cancel of the
/// request stops it too (no further chunk, no replay).
async fn execute(p: &Pipeline, op: Op) -> Outcome {
    let ops: Arc<[Op]> = Arc::from([op]);
    let control = Arc::new(RequestControl::part_of(&p.control, &ops));
    (p.host)(ops, control, p.deadline).await
}

/// Folds a piece's outcome into the request's ledger: complete (posted and acknowledged), or
/// failed with its kind; a failed WRITE piece that may have reached remote memory counts as
/// posted and lost (uncertain).
fn record(control: &RequestControl, op: usize, o: &Outcome) {
    control.with_ledger(|l| match o.failure {
        None => {
            l.posted(op);
            l.acked(op);
        }
        Some(f) => {
            if o.remote_effect == RemoteEffect::None {
                l.not_posted(op, f.kind, f.native_status);
            } else {
                l.posted(op);
                l.lost(op, f.kind, f.native_status);
            }
        }
    });
}

//! The outcome of a request, and the ledger transports fill in while they move its chunks.
//!
//! A transport splits each op of a request into chunks and reports every chunk to the request's
//! [`RequestControl`] as it is posted, acknowledged, refused by the remote side or lost with the
//! connection. The [`Outcome`] is then computed from those facts alone, so it never reports a byte
//! as complete that was not acknowledged, and it can be taken early (on timeout or cancel) while
//! chunks are still in flight.

use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::op::{Op, OpKind};

/// Why the remote side refused a chunk. These are also the data-plane status codes on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RemoteStatus {
    /// The token is unknown (never published, or retired: the two are indistinguishable).
    UnknownSegment,
    /// The range falls outside the segment.
    OutOfBounds,
    /// The segment does not grant the access right the op needs.
    AccessDenied,
    /// The data stream was opened against an epoch the peer no longer has.
    StaleEpoch,
    /// The peer could not parse the request.
    Malformed,
}

impl fmt::Display for RemoteStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RemoteStatus::UnknownSegment => "unknown segment",
            RemoteStatus::OutOfBounds => "out of bounds",
            RemoteStatus::AccessDenied => "access denied",
            RemoteStatus::StaleEpoch => "stale epoch",
            RemoteStatus::Malformed => "malformed request",
        })
    }
}

/// The kind of the first failure of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureKind {
    /// The request's deadline passed (logical: in-flight chunks may still complete).
    Timeout,
    /// The user cancelled the request (logical, as for a timeout).
    Cancelled,
    /// The connection to the peer broke.
    PeerLost,
    /// The remote side refused the op; no byte of the refused chunk moved.
    Remote(RemoteStatus),
    /// A local error (the transport could not post the op).
    Local,
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailureKind::Timeout => f.write_str("timeout"),
            FailureKind::Cancelled => f.write_str("cancelled"),
            FailureKind::PeerLost => f.write_str("peer lost"),
            FailureKind::Remote(s) => write!(f, "remote refused: {s}"),
            FailureKind::Local => f.write_str("local error"),
        }
    }
}

/// The first failed op of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failure {
    /// Index of the op in the request (equal to `completed_ops` of the outcome).
    pub op_index: usize,
    /// What went wrong.
    pub kind: FailureKind,
    /// The native status (errno, verbs work-completion status) where there is one.
    pub native_status: Option<i32>,
}

/// What the failed and later WRITEs of a request may have done to remote memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum RemoteEffect {
    /// No byte of them reached remote memory (or there are none).
    #[default]
    None,
    /// Some of their bytes certainly reached remote memory (acknowledged chunks), none is in doubt.
    Certain,
    /// Some of their bytes may have changed remote memory: a chunk was sent and never acknowledged.
    Uncertain,
}

/// The outcome of one request (ARCHITECTURE.md section 5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// How many ops, from the start, are known complete.
    pub completed_ops: usize,
    /// The bytes of those ops.
    pub completed_bytes: u64,
    /// The first failure, if the request did not complete.
    pub failure: Option<Failure>,
    /// What the failed and later WRITEs may have done remotely.
    pub remote_effect: RemoteEffect,
    /// Whether the local side has physically finished with the buffers.
    pub drained: bool,
}

impl Outcome {
    /// Whether every op completed.
    pub fn is_success(&self) -> bool {
        self.failure.is_none()
    }
}

#[derive(Clone, Debug)]
struct OpEntry {
    kind: OpKind,
    len: u64,
    /// Chunks planned; `None` until the transport plans the op.
    total: Option<u32>,
    posted: u32,
    acked: u32,
    refused: u32,
    failure: Option<(FailureKind, Option<i32>)>,
}

/// Per-request chunk accounting (see the module docs).
#[derive(Debug)]
pub struct Ledger {
    ops: Vec<OpEntry>,
    any_failure: bool,
}

impl Ledger {
    /// A ledger for `ops`, nothing planned yet.
    pub fn new(ops: &[Op]) -> Self {
        Self::with_shape(ops.iter().map(|o| (o.kind, o.len)))
    }

    /// A ledger for ops of these kinds and lengths (a request whose ops are not all host
    /// memory: the engine's staging of GPU memory keeps the user's ops' ledger this way).
    pub fn with_shape(shape: impl IntoIterator<Item = (OpKind, u64)>) -> Self {
        Self {
            ops: shape
                .into_iter()
                .map(|(kind, len)| OpEntry {
                    kind,
                    len,
                    total: None,
                    posted: 0,
                    acked: 0,
                    refused: 0,
                    failure: None,
                })
                .collect(),
            any_failure: false,
        }
    }

    fn entry(&mut self, op: usize) -> Option<&mut OpEntry> {
        self.ops.get_mut(op)
    }

    fn fail(&mut self, op: usize, kind: FailureKind, native: Option<i32>) {
        if let Some(e) = self.ops.get_mut(op) {
            if e.failure.is_none() {
                e.failure = Some((kind, native));
            }
            self.any_failure = true;
        }
    }

    /// The transport will move op `op` in `chunks` chunks.
    pub fn plan(&mut self, op: usize, chunks: u32) {
        if let Some(e) = self.entry(op) {
            e.total = Some(chunks);
        }
    }

    /// A chunk of `op` was handed to the wire (it may now have an effect).
    pub fn posted(&mut self, op: usize) {
        if let Some(e) = self.entry(op) {
            e.posted += 1;
        }
    }

    /// A chunk of `op` was acknowledged as complete.
    pub fn acked(&mut self, op: usize) {
        if let Some(e) = self.entry(op) {
            e.acked += 1;
        }
    }

    /// A posted chunk of `op` was refused by the remote side; it moved no byte.
    pub fn refused(&mut self, op: usize, status: RemoteStatus) {
        if let Some(e) = self.entry(op) {
            e.refused += 1;
            self.fail(op, FailureKind::Remote(status), None);
        }
    }

    /// A posted chunk of `op` will never be acknowledged (its effect stays unknown).
    pub fn lost(&mut self, op: usize, kind: FailureKind, native: Option<i32>) {
        self.fail(op, kind, native);
    }

    /// `op` failed before (some of) its chunks were posted; those have no effect.
    pub fn not_posted(&mut self, op: usize, kind: FailureKind, native: Option<i32>) {
        self.fail(op, kind, native);
    }

    /// Whether any op has a recorded failure (transports stop posting then).
    pub fn has_failure(&self) -> bool {
        self.any_failure
    }

    fn complete(e: &OpEntry) -> bool {
        e.failure.is_none() && e.total.is_some_and(|t| e.acked >= t)
    }

    /// The outcome so far of a request that may still be running: as [`Ledger::outcome`] (not
    /// drained), except that ops merely not finished yet are no failure. A final outcome counts
    /// them as `Local`, since a request that ended leaves none unresolved unless something went
    /// wrong without a word; a progress report would then show a failure for every request in
    /// flight.
    pub fn progress(&self, stopped: Option<FailureKind>) -> Outcome {
        let mut o = self.outcome(stopped, false);
        if stopped.is_none() && !self.any_failure {
            o.failure = None;
        }
        o
    }

    /// The outcome from the facts so far. `stopped` is the logical end (timeout, cancel) when the
    /// request ended before its chunks did; `drained` says whether they all did.
    pub fn outcome(&self, stopped: Option<FailureKind>, drained: bool) -> Outcome {
        let completed_ops = self.ops.iter().take_while(|e| Self::complete(e)).count();
        let completed_bytes = self.ops[..completed_ops].iter().map(|e| e.len).sum();
        let failure = if completed_ops == self.ops.len() {
            None
        } else {
            let e = &self.ops[completed_ops];
            let (kind, native) = e
                .failure
                .or_else(|| stopped.map(|k| (k, None)))
                .or_else(|| self.ops[completed_ops..].iter().find_map(|e| e.failure))
                .unwrap_or((FailureKind::Local, None));
            Some(Failure {
                op_index: completed_ops,
                kind,
                native_status: native,
            })
        };
        let mut remote_effect = RemoteEffect::None;
        for e in self.ops[completed_ops..]
            .iter()
            .filter(|e| e.kind == OpKind::Write)
        {
            let in_doubt = e.posted.saturating_sub(e.acked + e.refused);
            if in_doubt > 0 {
                remote_effect = RemoteEffect::Uncertain;
                break;
            }
            if e.acked > 0 {
                remote_effect = RemoteEffect::Certain;
            }
        }
        Outcome {
            completed_ops,
            completed_bytes,
            failure,
            remote_effect,
            drained,
        }
    }
}

const RUNNING: u8 = 0;
const CANCELLED: u8 = 1;
const TIMED_OUT: u8 = 2;

/// Shared between the submitter of a request and the transport that runs it: the logical stop
/// flag and the ledger.
#[derive(Debug)]
pub struct RequestControl {
    stop: AtomicU8,
    ledger: Mutex<Ledger>,
}

impl RequestControl {
    /// A running request over `ops`.
    pub fn new(ops: &[Op]) -> Self {
        Self::with_ledger_of(Ledger::new(ops))
    }

    /// A running request over ops of these kinds and lengths (see [`Ledger::with_shape`]).
    pub fn with_shape(shape: impl IntoIterator<Item = (OpKind, u64)>) -> Self {
        Self::with_ledger_of(Ledger::with_shape(shape))
    }

    fn with_ledger_of(ledger: Ledger) -> Self {
        Self {
            stop: AtomicU8::new(RUNNING),
            ledger: Mutex::new(ledger),
        }
    }

    /// Ends the request logically: transports post no further chunk. The first stop wins.
    pub fn stop(&self, why: FailureKind) {
        let code = match why {
            FailureKind::Timeout => TIMED_OUT,
            _ => CANCELLED,
        };
        let _ = self
            .stop
            .compare_exchange(RUNNING, code, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Why the request was stopped, if it was.
    pub fn stopped(&self) -> Option<FailureKind> {
        match self.stop.load(Ordering::Acquire) {
            CANCELLED => Some(FailureKind::Cancelled),
            TIMED_OUT => Some(FailureKind::Timeout),
            _ => None,
        }
    }

    /// Runs `f` on the ledger. A poisoned lock still yields the ledger: its counters are plain
    /// integers that a panic elsewhere cannot leave inconsistent.
    pub fn with_ledger<R>(&self, f: impl FnOnce(&mut Ledger) -> R) -> R {
        let mut guard = match self.ledger.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        f(&mut guard)
    }

    /// Whether the transport should post no further chunk (stopped, or a failure recorded).
    pub fn should_stop_posting(&self) -> bool {
        self.stopped().is_some() || self.with_ledger(|l| l.has_failure())
    }

    /// The outcome now.
    pub fn outcome(&self, drained: bool) -> Outcome {
        let stopped = self.stopped();
        self.with_ledger(|l| l.outcome(stopped, drained))
    }

    /// The outcome so far of a request that may still be running (see [`Ledger::progress`]).
    pub fn progress(&self) -> Outcome {
        let stopped = self.stopped();
        self.with_ledger(|l| l.progress(stopped))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::SegmentToken;
    use crate::memory::MemoryRegion;
    use std::sync::Arc;

    fn ops(kinds: &[OpKind]) -> Vec<Op> {
        let r = Arc::new(MemoryRegion::from_vec(vec![0; 64]));
        kinds
            .iter()
            .map(|&kind| Op {
                kind,
                local: r.clone(),
                local_offset: 0,
                token: SegmentToken(1),
                remote_offset: 0,
                len: 10,
            })
            .collect()
    }

    #[test]
    fn all_acked_is_success() {
        let ops = ops(&[OpKind::Write, OpKind::Read]);
        let c = RequestControl::new(&ops);
        c.with_ledger(|l| {
            for i in 0..2 {
                l.plan(i, 2);
                l.posted(i);
                l.posted(i);
                l.acked(i);
                l.acked(i);
            }
        });
        let o = c.outcome(true);
        assert!(o.is_success());
        assert_eq!((o.completed_ops, o.completed_bytes), (2, 20));
        assert_eq!(o.remote_effect, RemoteEffect::None);
    }

    /// A request in flight reports its prefix and no failure; the same facts as a final
    /// outcome name the unresolved op as a `Local` failure, and a progress report of a stopped
    /// or failed request names the real one.
    #[test]
    fn progress_of_a_running_request_shows_no_failure() {
        let ops = ops(&[OpKind::Write, OpKind::Write]);
        let c = RequestControl::new(&ops);
        c.with_ledger(|l| {
            l.plan(0, 1);
            l.posted(0);
            l.acked(0);
            l.plan(1, 2);
            l.posted(1);
        });
        let p = c.progress();
        assert_eq!((p.completed_ops, p.completed_bytes), (1, 10));
        assert_eq!(p.failure, None);
        assert_eq!(p.remote_effect, RemoteEffect::Uncertain);
        assert!(!p.drained);
        let f = c.outcome(true).failure.map(|f| f.kind);
        assert_eq!(f, Some(FailureKind::Local));
        c.with_ledger(|l| l.lost(1, FailureKind::PeerLost, None));
        assert_eq!(
            c.progress().failure.map(|f| f.kind),
            Some(FailureKind::PeerLost)
        );
        let c = RequestControl::new(&ops);
        c.stop(FailureKind::Timeout);
        assert_eq!(
            c.progress().failure.map(|f| f.kind),
            Some(FailureKind::Timeout)
        );
    }

    #[test]
    fn lost_write_is_uncertain_and_prefix_exact() {
        let ops = ops(&[OpKind::Write, OpKind::Write, OpKind::Write]);
        let c = RequestControl::new(&ops);
        c.with_ledger(|l| {
            l.plan(0, 1);
            l.posted(0);
            l.acked(0);
            l.plan(1, 2);
            l.posted(1);
            l.posted(1);
            l.acked(1);
            l.lost(1, FailureKind::PeerLost, Some(104));
            // op 2 acked although op 1 failed: still not part of the prefix.
            l.plan(2, 1);
            l.posted(2);
            l.acked(2);
        });
        let o = c.outcome(true);
        assert_eq!((o.completed_ops, o.completed_bytes), (1, 10));
        assert_eq!(
            o.failure,
            Some(Failure {
                op_index: 1,
                kind: FailureKind::PeerLost,
                native_status: Some(104)
            })
        );
        assert_eq!(o.remote_effect, RemoteEffect::Uncertain);
    }

    #[test]
    fn refused_write_has_no_effect_and_acked_later_write_is_certain() {
        let ops = ops(&[OpKind::Write, OpKind::Write]);
        let c = RequestControl::new(&ops);
        c.with_ledger(|l| {
            l.plan(0, 1);
            l.posted(0);
            l.refused(0, RemoteStatus::AccessDenied);
        });
        let o = c.outcome(true);
        assert_eq!(o.remote_effect, RemoteEffect::None);
        assert_eq!(
            o.failure.map(|f| f.kind),
            Some(FailureKind::Remote(RemoteStatus::AccessDenied))
        );
        c.with_ledger(|l| {
            l.plan(1, 1);
            l.posted(1);
            l.acked(1);
        });
        assert_eq!(c.outcome(true).remote_effect, RemoteEffect::Certain);
    }

    #[test]
    fn timeout_snapshot_while_in_flight() {
        let ops = ops(&[OpKind::Read, OpKind::Write]);
        let c = RequestControl::new(&ops);
        c.with_ledger(|l| {
            l.plan(0, 1);
            l.posted(0);
            l.acked(0);
            l.plan(1, 1);
            l.posted(1);
        });
        c.stop(FailureKind::Timeout);
        c.stop(FailureKind::Cancelled);
        assert!(c.should_stop_posting());
        let o = c.outcome(false);
        assert_eq!(o.completed_ops, 1);
        assert_eq!(o.failure.map(|f| f.kind), Some(FailureKind::Timeout));
        assert_eq!(o.remote_effect, RemoteEffect::Uncertain);
        assert!(!o.drained);
    }

    #[test]
    fn out_of_range_indices_are_ignored() {
        let ops = ops(&[OpKind::Read]);
        let c = RequestControl::new(&ops);
        c.with_ledger(|l| {
            l.plan(7, 1);
            l.posted(7);
            l.acked(7);
        });
        assert!(!c.outcome(true).is_success());
    }
}

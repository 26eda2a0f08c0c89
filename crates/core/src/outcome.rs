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

/// The outcome of one request (docs/architecture.md section 5).
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
    /// An earlier attempt (before a replay) left chunks of it in doubt.
    doubt_before: bool,
    /// An earlier attempt had chunks of it acknowledged.
    acked_before: bool,
}

impl OpEntry {
    /// Whether any chunk of it was ever handed to the wire, in this attempt or an earlier one.
    fn ever_posted(&self) -> bool {
        self.posted > 0 || self.doubt_before || self.acked_before
    }
}

/// Per-request chunk accounting (see the module docs).
///
/// A request whose connection was lost can be run again in part (a replay, see
/// [`Ledger::replay_plan`]): while a replay runs, the ledger is viewed through the replayed ops'
/// indices ([`Ledger::rearm`]), so the transport reports chunks of op `i` of the replay and the
/// ledger records them for the request's op `view[i]`.
#[derive(Debug)]
pub struct Ledger {
    ops: Vec<OpEntry>,
    any_failure: bool,
    /// While a replay runs: the request's index of each replayed op.
    view: Option<Vec<usize>>,
}

/// What a request whose attempt ended may run again ([`Ledger::replay_plan`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayPlan {
    /// The request's indices of the ops to run again, in order: every unfinished op from the
    /// first one not complete up to the first that may not be replayed.
    pub ops: Vec<usize>,
    /// How many of them are replays proper (they had chunks posted before); the others were never
    /// posted and simply run now.
    pub replayed: usize,
    /// Bytes of the replays proper (whole ops: the ledger counts chunks, not which ones).
    pub replayed_bytes: u64,
    /// The first op left out because it is a WRITE that had chunks posted and the policy does
    /// not allow replaying WRITEs (it keeps its `PeerLost` failure and its remote effect).
    pub held_back: Option<usize>,
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
                    doubt_before: false,
                    acked_before: false,
                })
                .collect(),
            any_failure: false,
            view: None,
        }
    }

    /// The request's index of the transport's op `op` (through the view of a replay).
    fn index(&self, op: usize) -> Option<usize> {
        match &self.view {
            Some(v) => v.get(op).copied(),
            None => Some(op),
        }
    }

    fn entry(&mut self, op: usize) -> Option<&mut OpEntry> {
        let i = self.index(op)?;
        self.ops.get_mut(i)
    }

    fn fail(&mut self, op: usize, kind: FailureKind, native: Option<i32>) {
        let Some(op) = self.index(op) else { return };
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

    /// Whether any op has a recorded failure (transports stop posting then). While a replay
    /// runs, only the replayed ops count: a failure left from before (an op held back) does not
    /// stop the replay.
    pub fn has_failure(&self) -> bool {
        self.any_failure
    }

    /// After an attempt of the request ended (every chunk resolved), what may run again on a
    /// fresh connection to the same peer incarnation: `None` unless the first op not complete
    /// failed with `PeerLost` (or was never finished because another op did). From that op on,
    /// each op not complete is taken, up to the first that may not run again: one that failed
    /// otherwise (refused, local error, timeout, cancel), or a WRITE that had chunks posted when
    /// `replay_writes` is false (its bytes may have reached the peer: running it again is
    /// not idempotent if someone else wrote there since). READs and CHECKSUMs are idempotent.
    /// Ops complete beyond the prefix are not run again.
    pub fn replay_plan(&self, replay_writes: bool) -> Option<ReplayPlan> {
        let first = self.ops.iter().position(|e| !Self::complete(e))?;
        let lost = |e: &OpEntry| matches!(e.failure, Some((FailureKind::PeerLost, _)));
        if !self.ops[first..].iter().any(lost) {
            return None;
        }
        let mut plan = ReplayPlan {
            ops: Vec::new(),
            replayed: 0,
            replayed_bytes: 0,
            held_back: None,
        };
        for (i, e) in self.ops.iter().enumerate().skip(first) {
            if Self::complete(e) {
                continue;
            }
            match e.failure {
                None | Some((FailureKind::PeerLost, _)) => {}
                Some(_) => break,
            }
            if e.ever_posted() && e.kind == OpKind::Write && !replay_writes {
                plan.held_back = Some(i);
                break;
            }
            if e.ever_posted() {
                plan.replayed += 1;
                plan.replayed_bytes += e.len;
            }
            plan.ops.push(i);
        }
        if plan.ops.is_empty() {
            None
        } else {
            Some(plan)
        }
    }

    /// Starts a replay of `ops` (the request's indices, from [`Ledger::replay_plan`]): their
    /// entries are reset as if never planned, and until [`Ledger::end_replay`] the transport's op
    /// `i` is the request's op `ops[i]`. The replay's own failures are the only ones that stop
    /// posting.
    pub fn rearm(&mut self, ops: &[usize]) {
        for &i in ops {
            if let Some(e) = self.ops.get_mut(i) {
                e.doubt_before |= e.posted > e.acked + e.refused;
                e.acked_before |= e.acked > 0;
                e.total = None;
                e.posted = 0;
                e.acked = 0;
                e.refused = 0;
                e.failure = None;
            }
        }
        self.view = Some(ops.to_vec());
        self.any_failure = false;
    }

    /// Ends the view of a replay ([`Ledger::rearm`]): indices are the request's again, and any
    /// failure recorded counts.
    pub fn end_replay(&mut self) {
        self.view = None;
        self.any_failure = self.ops.iter().any(|e| e.failure.is_some());
    }

    /// The replay of `ops` could not run (the peer came back as a new incarnation, or did not
    /// come back): each of them not complete fails with `kind` in place of the `PeerLost` it
    /// had. Their counts stay, so a WRITE's remote effect stays what it was.
    pub fn give_up(&mut self, ops: &[usize], kind: FailureKind, native: Option<i32>) {
        for &i in ops {
            if let Some(e) = self.ops.get_mut(i)
                && !Self::complete(e)
            {
                e.failure = Some((kind, native));
                self.any_failure = true;
            }
        }
    }

    /// A stopped request whose channel the engine closed to end it (its deadline or a cancel
    /// passed with chunks still in flight): every op not complete whose failure is none or the
    /// `PeerLost` the close caused takes `kind` (`Timeout`, `Cancelled`) instead; a failure
    /// recorded for another reason (a refusal, a local error) stays. Counts stay, so a WRITE's
    /// remote effect stays what it was.
    pub fn closed_under_stop(&mut self, kind: FailureKind) {
        for e in &mut self.ops {
            if !Self::complete(e) && matches!(e.failure, None | Some((FailureKind::PeerLost, _))) {
                e.failure = Some((kind, None));
                self.any_failure = true;
            }
        }
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
            if in_doubt > 0 || e.doubt_before {
                remote_effect = RemoteEffect::Uncertain;
                break;
            }
            if e.acked > 0 || e.acked_before {
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
    /// The request this one is a part of: stopping it stops this one too.
    parent: Option<std::sync::Arc<RequestControl>>,
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

    /// A running request over `ops` that is part of `parent` (one piece of a staged request):
    /// it has its own ledger, and it is stopped whenever `parent` is (its own stop does not
    /// stop `parent`).
    pub fn part_of(parent: &std::sync::Arc<RequestControl>, ops: &[Op]) -> Self {
        Self {
            parent: Some(parent.clone()),
            ..Self::new(ops)
        }
    }

    fn with_ledger_of(ledger: Ledger) -> Self {
        Self {
            stop: AtomicU8::new(RUNNING),
            ledger: Mutex::new(ledger),
            parent: None,
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

    /// Why the request (or the request it is part of) was stopped, if it was.
    pub fn stopped(&self) -> Option<FailureKind> {
        match self.stop.load(Ordering::Acquire) {
            CANCELLED => Some(FailureKind::Cancelled),
            TIMED_OUT => Some(FailureKind::Timeout),
            _ => self.parent.as_ref().and_then(|p| p.stopped()),
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

    fn ops_of(kinds: &[OpKind]) -> Vec<Op> {
        ops(kinds)
    }

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

    /// A request the engine closed its channel under at its deadline: the ops the close lost
    /// (and those never resolved) take the stop's kind, a refusal stays, and a WRITE posted and
    /// not acknowledged stays in doubt.
    #[test]
    fn a_close_under_a_stop_keeps_the_stop_and_other_failures() {
        let ops = ops(&[OpKind::Read, OpKind::Write, OpKind::Read]);
        let c = RequestControl::new(&ops);
        c.stop(FailureKind::Timeout);
        c.with_ledger(|l| {
            l.plan(0, 1);
            l.posted(0);
            l.acked(0);
            l.plan(1, 1);
            l.posted(1);
            l.lost(1, FailureKind::PeerLost, Some(104));
            l.plan(2, 1);
            l.posted(2);
            l.refused(2, RemoteStatus::OutOfBounds);
            l.closed_under_stop(FailureKind::Timeout);
        });
        let o = c.outcome(true);
        assert_eq!(o.completed_ops, 1);
        let f = o.failure.expect("failed");
        assert_eq!(
            (f.op_index, f.kind, f.native_status),
            (1, FailureKind::Timeout, None)
        );
        assert_eq!(o.remote_effect, RemoteEffect::Uncertain);
        c.with_ledger(|l| {
            assert_eq!(
                l.ops[2].failure,
                Some((FailureKind::Remote(RemoteStatus::OutOfBounds), None))
            );
        });
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

    /// A lost READ among complete ops: the replay takes the unfinished ops from the first not
    /// complete, runs them through the view, and the outcome is then a success.
    #[test]
    fn lost_reads_are_replayed_through_a_view() {
        let ops = ops(&[OpKind::Read, OpKind::Read, OpKind::Read, OpKind::Read]);
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
            // op 2 finished on another stream; op 3 was never posted.
            l.plan(2, 1);
            l.posted(2);
            l.acked(2);
        });
        assert_eq!(c.outcome(true).completed_ops, 1);
        assert_eq!(
            c.with_ledger(|l| l.replay_plan(true)),
            c.with_ledger(|l| l.replay_plan(false))
        );
        let plan = c.with_ledger(|l| l.replay_plan(false)).expect("a plan");
        assert_eq!(
            plan,
            ReplayPlan {
                ops: vec![1, 3],
                replayed: 1,
                replayed_bytes: 10,
                held_back: None
            }
        );
        c.with_ledger(|l| l.rearm(&plan.ops));
        assert!(!c.should_stop_posting());
        assert_eq!(c.progress().failure, None);
        c.with_ledger(|l| {
            for i in 0..2 {
                l.plan(i, 1);
                l.posted(i);
                l.acked(i);
            }
            // Beyond the view: ignored.
            l.acked(2);
            l.end_replay();
        });
        let o = c.outcome(true);
        assert!(o.is_success(), "{o:?}");
        assert_eq!((o.completed_ops, o.completed_bytes), (4, 40));
        assert_eq!(c.with_ledger(|l| l.replay_plan(true)), None);
    }

    /// A WRITE with a lost chunk is held back unless the policy allows replaying WRITEs; a WRITE
    /// never posted runs either way; ops behind a held-back WRITE are not run.
    #[test]
    fn posted_writes_wait_for_the_policy() {
        let ops = ops(&[OpKind::Read, OpKind::Write, OpKind::Read]);
        let c = RequestControl::new(&ops);
        c.with_ledger(|l| {
            l.plan(0, 1);
            l.posted(0);
            l.lost(0, FailureKind::PeerLost, None);
            l.plan(1, 2);
            l.posted(1);
            l.lost(1, FailureKind::PeerLost, None);
        });
        let held = c.with_ledger(|l| l.replay_plan(false)).expect("a plan");
        assert_eq!((held.ops, held.held_back), (vec![0], Some(1)));
        let all = c.with_ledger(|l| l.replay_plan(true)).expect("a plan");
        assert_eq!(
            (all.ops, all.replayed, all.held_back),
            (vec![0, 1, 2], 2, None)
        );
        // Only the READ is replayed, and completes; the WRITE keeps its failure and doubt.
        c.with_ledger(|l| {
            l.rearm(&[0]);
            l.plan(0, 1);
            l.posted(0);
            l.acked(0);
            l.end_replay();
        });
        let o = c.outcome(true);
        assert_eq!(o.completed_ops, 1);
        assert_eq!(o.failure.map(|f| f.kind), Some(FailureKind::PeerLost));
        assert_eq!(o.remote_effect, RemoteEffect::Uncertain);
        // A WRITE never posted is no replay.
        let ops = ops_of(&[OpKind::Read, OpKind::Write]);
        let c = RequestControl::new(&ops);
        c.with_ledger(|l| {
            l.plan(0, 1);
            l.posted(0);
            l.lost(0, FailureKind::PeerLost, None);
            l.not_posted(1, FailureKind::PeerLost, None);
        });
        let p = c.with_ledger(|l| l.replay_plan(false)).expect("a plan");
        assert_eq!((p.ops, p.replayed, p.held_back), (vec![0, 1], 1, None));
    }

    /// A replayed WRITE whose replay is lost again, or given up, stays uncertain: the first
    /// attempt's lost chunk may have landed.
    #[test]
    fn a_replayed_write_keeps_the_doubt_of_its_first_attempt() {
        let ops = ops(&[OpKind::Write]);
        let c = RequestControl::new(&ops);
        c.with_ledger(|l| {
            l.plan(0, 2);
            l.posted(0);
            l.acked(0);
            l.posted(0);
            l.lost(0, FailureKind::PeerLost, None);
            let plan = l.replay_plan(true).expect("a plan");
            l.rearm(&plan.ops);
            l.end_replay();
            l.give_up(
                &plan.ops,
                FailureKind::Remote(RemoteStatus::StaleEpoch),
                None,
            );
        });
        let o = c.outcome(true);
        assert_eq!(
            o.failure.map(|f| f.kind),
            Some(FailureKind::Remote(RemoteStatus::StaleEpoch))
        );
        assert_eq!(o.remote_effect, RemoteEffect::Uncertain);
        // Acked chunks only, before: certain.
        let c = RequestControl::new(&ops);
        c.with_ledger(|l| {
            l.plan(0, 2);
            l.posted(0);
            l.acked(0);
            l.not_posted(0, FailureKind::PeerLost, None);
            let plan = l.replay_plan(true).expect("a plan");
            l.rearm(&plan.ops);
            l.end_replay();
        });
        assert_eq!(c.outcome(true).remote_effect, RemoteEffect::Certain);
    }

    /// Refusals, local errors and stops are final: nothing is replayed.
    #[test]
    fn only_lost_connections_are_replayed() {
        let ops = ops(&[OpKind::Read, OpKind::Read]);
        for kind in [
            FailureKind::Remote(RemoteStatus::OutOfBounds),
            FailureKind::Local,
            FailureKind::Timeout,
        ] {
            let c = RequestControl::new(&ops);
            c.with_ledger(|l| {
                l.plan(0, 1);
                l.posted(0);
                l.lost(0, kind, None);
                l.plan(1, 1);
                l.posted(1);
                l.lost(1, FailureKind::PeerLost, None);
            });
            assert_eq!(c.with_ledger(|l| l.replay_plan(true)), None, "{kind}");
        }
        let c = RequestControl::new(&ops);
        assert_eq!(c.with_ledger(|l| l.replay_plan(true)), None, "nothing lost");
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

    #[test]
    fn a_part_stops_with_its_request_but_not_the_other_way() {
        let ops = ops_of(&[OpKind::Read]);
        let parent = Arc::new(RequestControl::new(&ops));
        let part = RequestControl::part_of(&parent, &ops);
        assert_eq!(part.stopped(), None);
        part.stop(FailureKind::Timeout);
        assert_eq!(part.stopped(), Some(FailureKind::Timeout));
        assert_eq!(parent.stopped(), None, "a part's stop is its own");
        let other = RequestControl::part_of(&parent, &ops);
        parent.stop(FailureKind::Cancelled);
        assert_eq!(other.stopped(), Some(FailureKind::Cancelled));
        assert!(other.should_stop_posting());
        // Its own first stop still names its own reason.
        assert_eq!(part.stopped(), Some(FailureKind::Timeout));
    }
}

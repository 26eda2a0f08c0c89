//! The data path of one channel, free of native calls: requests are cut into chunks, striped over
//! the rails, posted as chained work requests (a bounded number in flight per queue pair, every
//! `signal_every`-th one and the last of each chain signalled), and completions are folded into
//! each request's [`RequestControl`] ledger.
//!
//! Folding rules (RC completes in order per queue pair):
//! - a completion for work request `w` resolves every earlier outstanding one on that QP: as
//!   acknowledged while the QP is healthy, as flushed (lost) once it has failed;
//! - the first error completion on a QP fails that QP: it is moved to ERR explicitly, and its
//!   later work requests complete as flushed, which leaves their WRITEs `Uncertain`;
//! - the unsignalled work requests before an error completion are, by the verbs ordering rule,
//!   complete; a request never *succeeds* on that inference alone: where the chunk may be
//!   replayed (below) it is, and counted in [`RailCounters::unproven`]; where it may not, the
//!   request fails anyway and the inference only sets how long its completed prefix is;
//! - `IBV_WC_REM_ACCESS_ERR` is a refusal (the responder checks key and bounds before placing a
//!   byte); retry-exceeded errors mean the peer is lost, and so do a QP operation error
//!   (`IBV_WC_LOC_QP_OP_ERR`: the pump's work requests are well formed by construction, and
//!   soft-RoCE completes one it could not transmit with it) and any local error completion
//!   read while the rail's port is not ACTIVE; other local errors fail their op as `Local`;
//! - a request resolves (with `drained: true`) only when none of its work requests is still
//!   outstanding, so a failed QP is flushed before its buffers are declared free.
//!
//! Replay (docs/architecture.md section 5, multi-rail): a chunk whose work request completes with a
//! transport error (above: retry or RNR retry exceeded, a QP operation error, a local error on
//! a port that went down) or is flushed off a failed queue pair was never
//! acknowledged. When it is a READ (idempotent), or a WRITE and [`PumpLimits::replay_writes`]
//! allows it, and its request has not failed or stopped, and another healthy rail can carry the
//! op, the chunk is queued again and re-posted on that rail instead of being lost. It keeps its
//! single `posted` in the request's ledger (a WRITE re-posted and then lost again stays in
//! doubt; one never re-posted is lost with its original status), and counts as complete only
//! when the replay is acknowledged. A refused chunk (remote access error) is never replayed.
//! Later chunks stripe over the remaining rails while the failed rail is down.
//!
//! Healing (docs/architecture.md section 5, rails that heal): a failed rail's queue pair is torn
//! down (destroyed, never reused) as soon as none of its work requests is outstanding. A fresh
//! queue pair, connected by a new handshake with the peer, is handed over with
//! [`Pump::rebuild`]; it replaces the torn-down one once the old one is gone, and the rail
//! rejoins the striping at once, within requests already running. Both steps are counted
//! ([`RailCounters::torn_down`], [`RailCounters::rebuilds`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferry_core::{FailureKind, Op, OpKind, Outcome, RemoteStatus, RequestControl};

use crate::verbs::{
    Completion, PostError, QpVerbs, SendWr, Transition, WC_FLUSH, WC_LOC_QP_OP, WC_REM_ACCESS,
    WC_RETRY_EXC, WC_RNR_RETRY_EXC, WC_SUCCESS, WrKind,
};

/// The keys one op uses on one rail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Keys {
    /// Local key of an MR covering the local range on the rail's context.
    pub(crate) lkey: u32,
    /// Remote address of the segment's offset 0 on the peer.
    pub(crate) remote_base: u64,
    /// The peer's remote key for the segment on the paired context.
    pub(crate) rkey: u32,
}

/// Per op: the keys for each rail (`None`: that rail cannot carry it), or why no rail can.
pub(crate) type OpKeys = Result<Vec<Option<Keys>>, FailureKind>;

/// Declares the counters of a rail once: [`RailCounters`] (atomics, written by the channel's
/// worker as it runs) and [`RailStats`] (plain numbers, a channel's or a transport's sum of them,
/// with the rail's name), and the sum of one into the other, field by field from the one list.
macro_rules! rail_counters {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        /// Counters of one rail, readable while the channel runs.
        #[derive(Debug, Default)]
        pub struct RailCounters {
            $($(#[$doc])* pub $name: AtomicU64,)*
            /// Whether the rail is down now: failed, and not yet rebuilt.
            pub down: AtomicBool,
            /// Test-only: move this rail's queue pair to ERR at the next step that finds work
            /// outstanding on it, behind the data path's back (as a failing link would).
            #[cfg(feature = "__fault-injection")]
            pub(crate) inject_failure: std::sync::atomic::AtomicBool,
        }

        /// Counters of one rail of one channel, or summed over a transport's channels
        /// ([`RdmaTransport::rail_stats`](crate::RdmaTransport::rail_stats)).
        #[derive(Clone, Debug, PartialEq, Eq, Default)]
        #[non_exhaustive]
        pub struct RailStats {
            /// `device:port` of the local rail.
            pub rail: String,
            $($(#[$doc])* pub $name: u64,)*
            /// Channels on which this rail is down now (failed, not yet rebuilt).
            pub down: u64,
        }

        impl RailStats {
            /// Adds what `k` counted so far (a channel whose rail is down counts one).
            pub(crate) fn add(&mut self, k: &RailCounters) {
                $(self.$name += k.$name.load(std::sync::atomic::Ordering::Relaxed);)*
                self.down += u64::from(k.down.load(std::sync::atomic::Ordering::Relaxed));
            }
        }
    };
}

rail_counters! {
    /// Bytes acknowledged.
    bytes,
    /// Work requests acknowledged.
    work_requests,
    /// Work requests posted.
    posted,
    /// Error completions (flushes not counted).
    errors,
    /// Flushed work requests.
    flushed,
    /// Unsignalled work requests before an error completion, replayed on another rail rather
    /// than counted acknowledged on the ordering rule alone.
    unproven,
    /// Chunks of a failed rail that this rail re-posted (replays it carried).
    replayed,
    /// Bytes of those replayed chunks.
    replayed_bytes,
    /// Failed queue pairs of this rail destroyed once flushed (never reused).
    torn_down,
    /// Times this rail rejoined a channel on a fresh queue pair after a failure.
    rebuilds,
}

/// Limits of the data path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PumpLimits {
    /// Largest chunk one work request moves.
    pub(crate) chunk: u64,
    /// Work requests outstanding per queue pair (its send queue depth).
    pub(crate) depth: usize,
    /// Signal at least every this many work requests.
    pub(crate) signal_every: usize,
    /// How long a failed queue pair may take to flush its outstanding work requests; past it
    /// they are given up as lost and their requests resolve with `drained: false`.
    pub(crate) flush_timeout: Duration,
    /// Whether unacknowledged WRITE chunks of a failed rail may be replayed on another rail
    /// (READs always may).
    pub(crate) replay_writes: bool,
}

struct Entry {
    wr_id: u64,
    req: u64,
    op: usize,
    /// Offset of the chunk in its op.
    off: u64,
    len: u64,
    /// Whether this posting is a replay of a chunk lost on another rail.
    replay: bool,
    /// Whether the ledger already counts a posting of this chunk (a replay of a chunk that
    /// was on the wire): then this posting is not counted again.
    counted: bool,
}

/// A chunk waiting to be re-posted on a healthy rail.
struct Replay {
    op: usize,
    off: u64,
    len: u64,
    /// How it failed on its rail, should it never be re-posted.
    kind: FailureKind,
    native: Option<i32>,
    /// Whether it was on the wire (its effect unknown) rather than refused by `ibv_post_send`.
    counted: bool,
}

/// What a torn-down rail holds in place of its destroyed queue pair: nothing can be posted on it
/// and nothing completes (the pump neither posts to nor polls a rail that is down).
struct Retired;

impl QpVerbs for Retired {
    fn qp_num(&self) -> u32 {
        0
    }
    fn modify(&self, _: &Transition) -> std::io::Result<()> {
        Ok(())
    }
    fn post_send(&self, _: &[SendWr]) -> Result<(), PostError> {
        Err(PostError {
            posted: 0,
            errno: libc::ENOTCONN,
        })
    }
    fn poll(&self, _: usize) -> Result<Vec<Completion>, i32> {
        Ok(Vec::new())
    }
    fn link_up(&self) -> bool {
        true
    }
}

/// One rail as the pump drives it.
pub(crate) struct Rail {
    pub(crate) qp: Box<dyn QpVerbs>,
    pub(crate) name: String,
    pub(crate) counters: Arc<RailCounters>,
    outstanding: VecDeque<Entry>,
    failed: Option<FailureKind>,
    failed_at: Option<Instant>,
    /// Whether the failed queue pair was destroyed (`qp` is then [`Retired`]).
    torn_down: bool,
    unsignaled: usize,
}

impl Rail {
    pub(crate) fn new(qp: Box<dyn QpVerbs>, name: String, counters: Arc<RailCounters>) -> Self {
        Self {
            qp,
            name,
            counters,
            outstanding: VecDeque::new(),
            failed: None,
            failed_at: None,
            torn_down: false,
            unsignaled: 0,
        }
    }

    fn usable(&self) -> bool {
        self.failed.is_none()
    }

    /// Fails the rail: moves its QP to ERR so outstanding work flushes.
    fn fail(&mut self, kind: FailureKind) {
        if self.failed.is_some() {
            return;
        }
        self.failed = Some(kind);
        self.failed_at = Some(Instant::now());
        self.counters.down.store(true, Ordering::Release);
        if let Err(e) = self.qp.modify(&Transition::Error) {
            tracing::warn!(rail = %self.name, error = %e, "moving the queue pair to ERR failed");
        }
        tracing::info!(rail = %self.name, kind = %kind, outstanding = self.outstanding.len(),
            "rail failed; flushing");
    }
}

/// Called once with the request's outcome.
pub(crate) type Done = Box<dyn FnOnce(Outcome) + Send>;

struct Active {
    id: u64,
    ops: Arc<[Op]>,
    control: Arc<RequestControl>,
    keys: Vec<OpKeys>,
    next_op: usize,
    next_off: u64,
    planned: bool,
    exhausted: bool,
    in_flight: usize,
    undrained: bool,
    /// Chunks lost on a failed rail, waiting to be re-posted.
    replays: VecDeque<Replay>,
    done: Option<Done>,
}

impl Active {
    fn local_addr(&self, op: usize, off: u64) -> u64 {
        let o = &self.ops[op];
        o.local.as_ptr() as u64 + o.local_offset + off
    }

    /// The work request moving `len` bytes at `off` of op `op` with `keys`.
    fn work_request(&self, wr_id: u64, op: usize, off: u64, len: u64, keys: Keys) -> SendWr {
        let o = &self.ops[op];
        SendWr {
            wr_id,
            kind: match o.kind {
                OpKind::Write => WrKind::Write,
                // A CHECKSUM never gets here: `RdmaChannel::execute` refuses it before posting.
                OpKind::Read | OpKind::Checksum => WrKind::Read,
            },
            local_addr: self.local_addr(op, off),
            len: u32::try_from(len).unwrap_or(u32::MAX),
            lkey: keys.lkey,
            remote_addr: keys
                .remote_base
                .wrapping_add(o.remote_offset)
                .wrapping_add(off),
            rkey: keys.rkey,
            signaled: false,
        }
    }

    /// The queued replays will not be posted (the request stopped or failed, or no rail is
    /// left): they are lost with the status they were lost with on their rail.
    fn abandon_replays(&mut self) -> bool {
        if self.replays.is_empty() {
            return false;
        }
        let replays = std::mem::take(&mut self.replays);
        self.control.with_ledger(|l| {
            for c in &replays {
                if c.counted {
                    l.lost(c.op, c.kind, c.native);
                } else {
                    l.not_posted(c.op, c.kind, c.native);
                }
            }
        });
        true
    }
}

/// The data path of one channel.
pub(crate) struct Pump {
    rails: Vec<Rail>,
    limits: PumpLimits,
    active: Vec<Active>,
    next_wr: u64,
    next_req: u64,
    /// The rail the next chunk tries first: round-robin across requests, so that many small
    /// requests spread over the rails as one large op does.
    rr: usize,
    /// Fresh queue pairs waiting for their rail's failed one to be torn down.
    rebuilds: Vec<(usize, Box<dyn QpVerbs>)>,
    /// Set by [`close`](Self::close): nothing is rebuilt any more.
    closing: bool,
}

/// What an error completion's `status` says failed, where `link_up` asks whether the rail's
/// port is ACTIVE now (asked only for a local error). A QP operation error is the transport's:
/// the pump posts only work requests that are well formed by construction (one SGE, within
/// the QP's depth and the chunk size), and soft-RoCE completes one it could not transmit (no
/// route while the link is down) with it. Any other local error on a port that is down now
/// is the link's too.
fn classify(status: u32, link_up: impl FnOnce() -> bool) -> FailureKind {
    match status {
        WC_REM_ACCESS => FailureKind::Remote(RemoteStatus::AccessDenied),
        WC_RETRY_EXC | WC_RNR_RETRY_EXC | WC_FLUSH | WC_LOC_QP_OP => FailureKind::PeerLost,
        _ if !link_up() => FailureKind::PeerLost,
        _ => FailureKind::Local,
    }
}

impl Pump {
    pub(crate) fn new(rails: Vec<Rail>, limits: PumpLimits) -> Self {
        Self {
            rails,
            limits: PumpLimits {
                chunk: limits.chunk.max(1),
                depth: limits.depth.max(1),
                signal_every: limits.signal_every.max(1),
                flush_timeout: limits.flush_timeout,
                replay_writes: limits.replay_writes,
            },
            active: Vec::new(),
            next_wr: 1,
            next_req: 1,
            rr: 0,
            rebuilds: Vec::new(),
            closing: false,
        }
    }

    /// Whether any rail can still carry work.
    pub(crate) fn alive(&self) -> bool {
        self.rails.iter().any(Rail::usable)
    }

    /// Whether nothing is pending (no request, no outstanding work request).
    pub(crate) fn idle(&self) -> bool {
        self.active.is_empty() && self.rails.iter().all(|r| r.outstanding.is_empty())
    }

    /// Adds a request; `keys[i]` are op `i`'s keys per rail.
    pub(crate) fn add(
        &mut self,
        ops: Arc<[Op]>,
        control: Arc<RequestControl>,
        keys: Vec<OpKeys>,
        done: Done,
    ) {
        let id = self.next_req;
        self.next_req += 1;
        self.active.push(Active {
            id,
            ops,
            control,
            keys,
            next_op: 0,
            next_off: 0,
            planned: false,
            exhausted: false,
            in_flight: 0,
            undrained: false,
            replays: VecDeque::new(),
            done: Some(done),
        });
    }

    /// Fails every rail (the channel closes): outstanding work flushes, nothing new is posted.
    pub(crate) fn close(&mut self) {
        self.closing = true;
        self.rebuilds.clear();
        for r in &mut self.rails {
            r.fail(FailureKind::PeerLost);
            // A closed channel's rails are not down (nothing will heal them), only closed.
            r.counters.down.store(false, Ordering::Release);
        }
    }

    /// Posts what fits, folds what completed, resolves finished requests. Returns whether
    /// anything happened.
    pub(crate) fn step(&mut self) -> bool {
        self.step_at(Instant::now())
    }

    /// [`step`](Self::step) at time `now`.
    pub(crate) fn step_at(&mut self, now: Instant) -> bool {
        let mut progress = self.post();
        #[cfg(feature = "__fault-injection")]
        self.inject_failures();
        progress |= self.poll();
        progress |= self.give_up_flushes(now);
        progress |= self.heal();
        progress |= self.finish();
        progress
    }

    /// Hands rail `rail` a fresh queue pair, connected to the peer by a new handshake. It
    /// replaces the rail's failed queue pair once that one is torn down (at once if it already
    /// is); the rail then carries work again. Dropped (destroyed) when the rail has not failed
    /// (nothing to replace), when there is no such rail, or once the pump is closing.
    pub(crate) fn rebuild(&mut self, rail: usize, qp: Box<dyn QpVerbs>) {
        let Some(r) = self.rails.get(rail) else {
            tracing::warn!(
                rail,
                "rebuild for a rail this channel does not have; dropped"
            );
            return;
        };
        if self.closing || r.failed.is_none() {
            tracing::info!(rail = %r.name, closing = self.closing,
                "rebuild not needed (the rail is healthy or the channel closes); dropped");
            return;
        }
        self.rebuilds.retain(|(i, _)| *i != rail);
        self.rebuilds.push((rail, qp));
    }

    /// Tears down the failed queue pairs that have nothing outstanding any more, and puts the
    /// waiting fresh ones in their place.
    fn heal(&mut self) -> bool {
        let mut progress = false;
        for rail in &mut self.rails {
            if rail.failed.is_none() || rail.torn_down || !rail.outstanding.is_empty() {
                continue;
            }
            drop(std::mem::replace(&mut rail.qp, Box::new(Retired)));
            rail.torn_down = true;
            if !self.closing {
                rail.counters.torn_down.fetch_add(1, Ordering::Relaxed);
                tracing::info!(rail = %rail.name, "failed queue pair torn down");
            }
            progress = true;
        }
        let mut k = 0;
        while k < self.rebuilds.len() {
            let r = self.rebuilds[k].0;
            if !self.rails[r].torn_down {
                k += 1;
                continue;
            }
            let (_, qp) = self.rebuilds.swap_remove(k);
            let rail = &mut self.rails[r];
            tracing::info!(rail = %rail.name,
                "rail rebuilt on a fresh queue pair; it rejoins the channel");
            rail.qp = qp;
            rail.failed = None;
            rail.failed_at = None;
            rail.torn_down = false;
            rail.unsignaled = 0;
            rail.counters.rebuilds.fetch_add(1, Ordering::Relaxed);
            rail.counters.down.store(false, Ordering::Release);
            progress = true;
        }
        progress
    }

    fn post(&mut self) -> bool {
        let batches = self.batches();
        self.post_batches(batches)
    }

    /// The work requests to post now, per rail: replays first, then each request's next chunks,
    /// round-robin over the rails that can carry them and have room.
    fn batches(&mut self) -> Vec<Vec<(SendWr, Entry)>> {
        let n = self.rails.len();
        let mut batches: Vec<Vec<(SendWr, Entry)>> = (0..n).map(|_| Vec::new()).collect();
        let chunk = self.limits.chunk;
        let depth = self.limits.depth;
        for req in &mut self.active {
            if !req.replays.is_empty() && req.control.should_stop_posting() {
                req.abandon_replays();
            }
            while let Some(c) = req.replays.front() {
                let Ok(rail_keys) = &req.keys[c.op] else {
                    req.abandon_replays();
                    break;
                };
                let carriers = |r: usize| {
                    self.rails[r].usable() && rail_keys.get(r).is_some_and(Option::is_some)
                };
                if !(0..n).any(carriers) {
                    req.abandon_replays();
                    break;
                }
                let pick = (0..n).map(|k| (self.rr + k) % n).find(|&r| {
                    carriers(r) && self.rails[r].outstanding.len() + batches[r].len() < depth
                });
                let Some(r) = pick else { break };
                let Some(keys) = rail_keys[r] else { break };
                let (op, off, len, counted) = (c.op, c.off, c.len, c.counted);
                req.replays.pop_front();
                let wr = req.work_request(self.next_wr, op, off, len, keys);
                batches[r].push((
                    wr,
                    Entry {
                        wr_id: self.next_wr,
                        req: req.id,
                        op,
                        off,
                        len,
                        replay: true,
                        counted,
                    },
                ));
                self.next_wr += 1;
                req.in_flight += 1;
                self.rr = (r + 1) % n;
            }
            while !req.exhausted {
                if req.next_op >= req.ops.len() || req.control.should_stop_posting() {
                    req.exhausted = true;
                    break;
                }
                let i = req.next_op;
                let op = &req.ops[i];
                let rail_keys = match &req.keys[i] {
                    Ok(k) => k,
                    Err(kind) => {
                        req.control.with_ledger(|l| l.not_posted(i, *kind, None));
                        req.exhausted = true;
                        break;
                    }
                };
                if !req.planned {
                    let chunks = op.len.div_ceil(chunk);
                    let chunks = u32::try_from(chunks).unwrap_or(u32::MAX);
                    req.control.with_ledger(|l| l.plan(i, chunks));
                    req.planned = true;
                    if chunks == 0 {
                        req.next_op += 1;
                        req.next_off = 0;
                        req.planned = false;
                        continue;
                    }
                }
                // A rail that is healthy, has keys for this op and room in its send queue.
                let carriers = |r: usize| {
                    self.rails[r].usable() && rail_keys.get(r).is_some_and(Option::is_some)
                };
                if !(0..n).any(carriers) {
                    req.control
                        .with_ledger(|l| l.not_posted(i, FailureKind::PeerLost, None));
                    req.exhausted = true;
                    break;
                }
                let pick = (0..n).map(|k| (self.rr + k) % n).find(|&r| {
                    carriers(r) && self.rails[r].outstanding.len() + batches[r].len() < depth
                });
                let Some(r) = pick else { break };
                let Some(keys) = rail_keys[r] else { break };
                let len = (op.len - req.next_off).min(chunk);
                let wr = req.work_request(self.next_wr, i, req.next_off, len, keys);
                batches[r].push((
                    wr,
                    Entry {
                        wr_id: self.next_wr,
                        req: req.id,
                        op: i,
                        off: req.next_off,
                        len,
                        replay: false,
                        counted: false,
                    },
                ));
                self.next_wr += 1;
                req.in_flight += 1;
                self.rr = (r + 1) % n;
                req.next_off += len;
                if req.next_off >= op.len {
                    req.next_op += 1;
                    req.next_off = 0;
                    req.planned = false;
                }
            }
        }
        batches
    }

    /// Posts each rail's batch as one chain, signalling every `signal_every`-th and the last;
    /// what a provider refuses is replayed on another rail or fails locally.
    fn post_batches(&mut self, batches: Vec<Vec<(SendWr, Entry)>>) -> bool {
        let n = self.rails.len();
        let mut progress = false;
        for (r, mut batch) in batches.into_iter().enumerate() {
            if batch.is_empty() {
                continue;
            }
            progress = true;
            let rail = &mut self.rails[r];
            let last = batch.len() - 1;
            for (k, (wr, _)) in batch.iter_mut().enumerate() {
                rail.unsignaled += 1;
                if k == last || rail.unsignaled >= self.limits.signal_every {
                    wr.signaled = true;
                    rail.unsignaled = 0;
                }
            }
            let wrs: Vec<SendWr> = batch.iter().map(|(w, _)| *w).collect();
            let (posted, err) = match rail.qp.post_send(&wrs) {
                Ok(()) => (batch.len(), None),
                Err(e) => (e.posted.min(batch.len()), Some(e.errno)),
            };
            let mut rest = batch.split_off(posted);
            for (_, e) in batch {
                if e.replay {
                    rail.counters.replayed.fetch_add(1, Ordering::Relaxed);
                    rail.counters
                        .replayed_bytes
                        .fetch_add(e.len, Ordering::Relaxed);
                }
                // A replay of a chunk that was on the wire: its first posting is still the one
                // the ledger counts.
                if !e.counted
                    && let Some(req) = self.active.iter().find(|a| a.id == e.req)
                {
                    req.control.with_ledger(|l| l.posted(e.op));
                }
                rail.counters.posted.fetch_add(1, Ordering::Relaxed);
                rail.outstanding.push_back(e);
            }
            if let Some(errno) = err {
                tracing::warn!(rail = %rail.name, errno, posted, refused = rest.len(),
                    "ibv_post_send refused part of a chain");
                // Refused chunks never reached the wire: another healthy rail of the channel
                // may carry them (whatever their kind), else they fail locally.
                let others: Vec<bool> = (0..n).map(|j| j != r && self.rails[j].usable()).collect();
                for (_, e) in rest.drain(..) {
                    if let Some(req) = self.active.iter_mut().find(|a| a.id == e.req) {
                        req.in_flight -= 1;
                        let carrier = req.keys[e.op]
                            .as_ref()
                            .is_ok_and(|k| k.iter().zip(&others).any(|(k, &ok)| ok && k.is_some()));
                        if carrier && !req.control.should_stop_posting() {
                            req.replays.push_back(Replay {
                                op: e.op,
                                off: e.off,
                                len: e.len,
                                kind: FailureKind::Local,
                                native: Some(errno),
                                counted: e.counted,
                            });
                        } else if e.counted {
                            req.control
                                .with_ledger(|l| l.lost(e.op, FailureKind::Local, Some(errno)));
                        } else {
                            req.control.with_ledger(|l| {
                                l.not_posted(e.op, FailureKind::Local, Some(errno))
                            });
                        }
                    }
                }
                let rail = &mut self.rails[r];
                // The chain's tail may be unsignalled: flush the QP so everything posted completes.
                rail.fail(FailureKind::Local);
            }
        }
        progress
    }

    /// Test-only: the rails asked to break while they have work outstanding go to ERR; the pump
    /// learns of it from their flushed completions only.
    #[cfg(feature = "__fault-injection")]
    fn inject_failures(&mut self) {
        for rail in &mut self.rails {
            if rail.outstanding.is_empty()
                || !rail.counters.inject_failure.swap(false, Ordering::AcqRel)
            {
                continue;
            }
            tracing::warn!(rail = %rail.name, outstanding = rail.outstanding.len(),
                "fault injection: moving the queue pair to ERR");
            if let Err(e) = rail.qp.modify(&Transition::Error) {
                tracing::warn!(rail = %rail.name, error = %e, "fault injection failed");
            }
        }
    }

    /// Outstanding work of a rail that failed more than `flush_timeout` ago and never flushed:
    /// lost, and its requests are not drained (the NIC may still touch their buffers).
    fn give_up_flushes(&mut self, now: Instant) -> bool {
        let mut progress = false;
        for rail in &mut self.rails {
            let Some(at) = rail.failed_at else { continue };
            if rail.outstanding.is_empty()
                || now.saturating_duration_since(at) < self.limits.flush_timeout
            {
                continue;
            }
            tracing::error!(rail = %rail.name, outstanding = rail.outstanding.len(),
                "the failed queue pair did not flush in time; its buffers are not declared drained");
            progress = true;
            for e in rail.outstanding.drain(..) {
                if let Some(req) = self.active.iter_mut().find(|a| a.id == e.req) {
                    req.control
                        .with_ledger(|l| l.lost(e.op, FailureKind::PeerLost, None));
                    req.in_flight -= 1;
                    req.undrained = true;
                }
            }
        }
        progress
    }

    fn poll(&mut self) -> bool {
        let mut progress = false;
        for r in 0..self.rails.len() {
            if self.rails[r].outstanding.is_empty() {
                continue;
            }
            match self.rails[r].qp.poll(32) {
                Ok(cs) => {
                    for c in cs {
                        progress = true;
                        self.complete(r, c);
                    }
                }
                Err(errno) => {
                    // Completions can no longer be read: nothing on this rail can be proven
                    // finished, so its requests resolve undrained.
                    tracing::error!(rail = %self.rails[r].name, errno, "ibv_poll_cq failed");
                    progress = true;
                    let rail = &mut self.rails[r];
                    rail.fail(FailureKind::Local);
                    for e in rail.outstanding.drain(..) {
                        if let Some(req) = self.active.iter_mut().find(|a| a.id == e.req) {
                            req.control
                                .with_ledger(|l| l.lost(e.op, FailureKind::Local, Some(errno)));
                            req.in_flight -= 1;
                            req.undrained = true;
                        }
                    }
                }
            }
        }
        progress
    }

    fn complete(&mut self, r: usize, c: Completion) {
        // The other rails that can take over this rail's lost chunks (only rail `r` changes
        // below). Nothing is replayed off a success on a healthy rail: no list is made then.
        let may_replay = c.status != WC_SUCCESS || !self.rails[r].usable();
        let healthy: Vec<bool> = if may_replay {
            self.rails
                .iter()
                .enumerate()
                .map(|(j, x)| j != r && x.usable())
                .collect()
        } else {
            Vec::new()
        };
        let replay_writes = self.limits.replay_writes;
        let rail = &mut self.rails[r];
        if !rail.outstanding.iter().any(|e| e.wr_id == c.wr_id) {
            tracing::warn!(rail = %rail.name, wr_id = c.wr_id, "completion for an unknown work request");
            return;
        }
        while let Some(e) = rail.outstanding.pop_front() {
            let hit = e.wr_id == c.wr_id;
            let status = if hit {
                c.status
            } else if rail.failed.is_some() {
                WC_FLUSH
            } else {
                WC_SUCCESS
            };
            let Some(req) = self.active.iter_mut().find(|a| a.id == e.req) else {
                if hit {
                    break;
                }
                continue;
            };
            req.in_flight -= 1;
            // A chunk this rail lost to a transport failure, replayed on another rail when its
            // kind and the policy allow it and a healthy rail can carry its op.
            let replay = |req: &mut Active, status: u32| {
                let op = &req.ops[e.op];
                let allowed = op.kind == OpKind::Read || replay_writes;
                let carrier = req.keys[e.op]
                    .as_ref()
                    .is_ok_and(|k| k.iter().zip(&healthy).any(|(k, &ok)| ok && k.is_some()));
                if !allowed || !carrier || req.control.should_stop_posting() {
                    return false;
                }
                req.replays.push_back(Replay {
                    op: e.op,
                    off: e.off,
                    len: e.len,
                    kind: FailureKind::PeerLost,
                    native: Some(status as i32),
                    counted: true,
                });
                true
            };
            match status {
                // Unsignalled before an error completion: verbs says it completed, but a success
                // this request would report must not rest on that inference; replayed where it
                // can be (decisions.md, "An error completion proves nothing before it").
                WC_SUCCESS if !hit && c.status != WC_SUCCESS && replay(req, c.status) => {
                    rail.counters.unproven.fetch_add(1, Ordering::Relaxed);
                }
                WC_SUCCESS => {
                    rail.counters.bytes.fetch_add(e.len, Ordering::Relaxed);
                    rail.counters.work_requests.fetch_add(1, Ordering::Relaxed);
                    req.control.with_ledger(|l| l.acked(e.op));
                }
                WC_FLUSH => {
                    rail.counters.flushed.fetch_add(1, Ordering::Relaxed);
                    if !replay(req, WC_FLUSH) {
                        req.control.with_ledger(|l| {
                            l.lost(e.op, FailureKind::PeerLost, Some(WC_FLUSH as i32))
                        });
                    }
                    // A flush on a QP we did not fail ourselves: it is broken.
                    rail.fail(FailureKind::PeerLost);
                }
                other => {
                    rail.counters.errors.fetch_add(1, Ordering::Relaxed);
                    let kind = classify(other, || rail.qp.link_up());
                    tracing::info!(rail = %rail.name, status = other, vendor_err = c.vendor_err,
                        op = e.op, kind = %kind, "work completion error");
                    let replayed = kind == FailureKind::PeerLost && replay(req, other);
                    if !replayed {
                        req.control.with_ledger(|l| match kind {
                            FailureKind::Remote(s) => l.refused(e.op, s),
                            k => l.lost(e.op, k, Some(other as i32)),
                        });
                    }
                    rail.fail(kind);
                }
            }
            if hit {
                break;
            }
        }
    }

    fn finish(&mut self) -> bool {
        let mut progress = false;
        let mut k = 0;
        while k < self.active.len() {
            let a = &mut self.active[k];
            if (!a.exhausted || !a.replays.is_empty()) && a.control.should_stop_posting() {
                a.exhausted = true;
                progress |= a.abandon_replays();
            }
            if a.exhausted && a.in_flight == 0 && a.replays.is_empty() {
                let a = self.active.remove(k);
                let outcome = a.control.outcome(!a.undrained);
                if let Some(done) = a.done {
                    done(outcome);
                }
                progress = true;
            } else {
                k += 1;
            }
        }
        progress
    }
}

#[cfg(test)]
mod tests;

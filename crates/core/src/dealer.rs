//! How a channel's chunks reach its data streams: dealt to the streams in turn, taken by a
//! stream with nothing to do, handed on by a stream that ends. A plain data structure (the
//! transports guard it with their own lock and wake their own stream threads or tasks).
//!
//! Dealing in turn keeps each buffer of a closed loop of requests (a benchmark, a ring of
//! staging buffers) on one stream, and so on one core; a stream with nothing in flight takes
//! the oldest chunk of the longest other queue, so no stream runs dry while another has work
//! queued. Why one queue per stream and not one shared queue, with the traces and figures:
//! `docs/performance.md`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use crate::op::{Op, OpKind};
use crate::outcome::{FailureKind, RequestControl};
use crate::stream::{Chunk, ChunkOwner, Work};
use crate::wire::{MAX_CHUNK, MAX_PIECES};

/// The chunks of one channel not yet taken by its streams, one queue per stream.
#[derive(Debug)]
pub struct Dealer<J> {
    jobs: Vec<VecDeque<J>>,
    taking: Vec<bool>,
    next: usize,
    closed: bool,
}

impl<J> Dealer<J> {
    /// A dealer for `streams` streams, all taking jobs.
    pub fn new(streams: usize) -> Self {
        Self {
            jobs: (0..streams).map(|_| VecDeque::new()).collect(),
            taking: vec![true; streams],
            next: 0,
            closed: false,
        }
    }

    /// Deals `job` to the next stream (in turn) still taking jobs and returns its index;
    /// `Err(job)` if no stream is left.
    pub fn deal(&mut self, job: J) -> Result<usize, J> {
        let n = self.jobs.len();
        for k in 0..n {
            let i = (self.next + k) % n;
            if self.taking[i] {
                self.next = i + 1;
                self.jobs[i].push_back(job);
                return Ok(i);
            }
        }
        Err(job)
    }

    /// The next job for stream `i`: its own oldest, else, when `idle` (nothing in flight), the
    /// oldest of the longest other queue. `None`: nothing for it now.
    pub fn take(&mut self, i: usize, idle: bool) -> Option<J> {
        if let Some(j) = self.jobs.get_mut(i).and_then(VecDeque::pop_front) {
            return Some(j);
        }
        if !idle {
            return None;
        }
        let k = (0..self.jobs.len())
            .filter(|&k| k != i && !self.jobs[k].is_empty())
            .max_by_key(|&k| self.jobs[k].len())?;
        self.jobs[k].pop_front()
    }

    /// Stream `i` stops taking jobs: what was dealt to it is dealt to the others (their indices
    /// are added to `woken`); returns what no stream is left to take. Leaving twice does nothing.
    pub fn leave(&mut self, i: usize, woken: &mut StreamSet) -> Vec<J> {
        let mut orphans = Vec::new();
        if !self.taking.get(i).copied().unwrap_or(false) {
            return orphans;
        }
        self.taking[i] = false;
        for job in std::mem::take(&mut self.jobs[i]) {
            match self.deal(job) {
                Ok(k) => woken.add(k),
                Err(job) => orphans.push(job),
            }
        }
        orphans
    }

    /// Jobs dealt and not taken yet, over all streams.
    pub fn queued(&self) -> usize {
        self.jobs.iter().map(VecDeque::len).sum()
    }

    /// Marks the channel gone: its streams end once nothing is queued for them.
    pub fn close(&mut self) {
        self.closed = true;
    }

    /// Whether [`Dealer::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.closed
    }
}

/// Plans each op of a request in `control`'s ledger and deals its chunks (at most `chunk` bytes
/// each) through `dealer`, one op under one lock so that the first chunks move while later ops
/// are dealt. `job(op, at, len)` makes (and counts) a job; `undealt` takes back one that no
/// stream was left to take; `wake` gets the streams each op's chunks went to, after the lock is
/// released. Stops at the first op that cannot be planned (`Local`), once the request should
/// stop posting, or once no stream is left (or `closed`: the channel is closed), in which case
/// that op is `PeerLost`, never posted. The senders check the stop flag again before posting.
#[allow(clippy::too_many_arguments)]
pub fn deal_ops<J>(
    dealer: &Mutex<Dealer<J>>,
    ops: &[Op],
    control: &RequestControl,
    chunk: u64,
    closed: bool,
    job: impl FnMut(usize, u64, u64) -> J,
    undealt: impl FnMut(J),
    wake: impl FnMut(StreamSet),
) {
    deal(
        dealer, ops, control, chunk, closed, job, None, undealt, wake,
    );
}

/// Deals the ops of request `req` (its [`ChunkOwner::ops`], planned in its
/// [`ChunkOwner::control`]) to a channel's streams as [`Work`]: with a `group` budget (a peer of
/// protocol version 3), runs of small ops as vectored requests of at most that many bytes
/// ([`deal_ops_grouped`]), other ops in chunks of at most `chunk` bytes ([`deal_ops`]).
/// `count(n)` is called before each job of `n` chunks is made: the request's count of chunks
/// still to resolve. A job no stream was left to take is resolved at once ([`Work::skipped`]:
/// [`ChunkOwner::chunk_done`] once per chunk), so every counted chunk is resolved exactly once;
/// the caller holds a count of its own while this runs, so none of these is the last. `wake`
/// gets the streams each op's jobs went to, as [`deal_ops`] says; `closed` too.
pub fn deal_request<R: ChunkOwner>(
    dealer: &Mutex<Dealer<Work<R>>>,
    req: &Arc<R>,
    chunk: u64,
    group: Option<u64>,
    closed: bool,
    count: impl Fn(usize),
    wake: impl FnMut(StreamSet),
) {
    let ops = req.ops();
    let control = req.control();
    let one = |op, at, len| {
        count(1);
        Work::One(Chunk {
            req: req.clone(),
            op,
            at,
            len,
        })
    };
    if let Some(budget) = group {
        deal_ops_grouped(
            dealer,
            ops,
            control,
            chunk,
            budget,
            closed,
            one,
            |members| {
                count(members.len());
                Work::Pieces(
                    members
                        .iter()
                        .map(|&op| Chunk {
                            req: req.clone(),
                            op,
                            at: 0,
                            len: ops[op].len,
                        })
                        .collect(),
                )
            },
            Work::skipped,
            wake,
        );
    } else {
        deal_ops(
            dealer,
            ops,
            control,
            chunk,
            closed,
            one,
            Work::skipped,
            wake,
        );
    }
}

/// Requests whose one chunk, header and payload together, is at most this many bytes may be
/// written by the submitting thread itself while a stream is idle ([`direct_op`]), instead of
/// being dealt: one non-blocking send, no hand-over to the stream's thread or task.
pub const DIRECT_MAX: usize = 16 << 10;

/// The op of a request that may be sent directly ([`DIRECT_MAX`]): a request of one op that is
/// one chunk (`chunk`: the channel's chunk size; a CHECKSUM is always one) whose request header
/// and payload (a WRITE's bytes; a READ or CHECKSUM request carries none) fit in
/// [`DIRECT_MAX`]. The driver still sends it only while a stream is idle.
pub fn direct_op(ops: &[Op], chunk: u64) -> Option<&Op> {
    let [op] = ops else {
        return None;
    };
    let one_chunk = op.kind == OpKind::Checksum || op.len <= chunk;
    let payload = if op.kind == OpKind::Write { op.len } else { 0 };
    (one_chunk && payload <= (DIRECT_MAX - crate::wire::DATA_REQUEST_LEN) as u64).then_some(op)
}

/// Whether `op` may travel as a piece of a vectored request with the byte budget `budget`: a
/// READ or WRITE of at most an eighth of the budget. Small ops gain from sharing a request;
/// larger ones already amortise theirs, and keep their own acknowledgment (an op that shares a
/// request completes only with the whole request, so an op stalled at the peer would hold back
/// the completion of the ops grouped with it).
pub fn is_piece(op: &Op, budget: u64) -> bool {
    op.kind != OpKind::Checksum && op.len <= budget.min(MAX_CHUNK) / 8
}

/// [`deal_ops`] for a peer that takes vectored requests (protocol version 3): runs of
/// consecutive small ops of one kind ([`is_piece`]) are grouped, whole, into one job of at most
/// `budget` bytes (at most [`MAX_CHUNK`]) and [`MAX_PIECES`] ops, made by `group(ops)` (it
/// counts one chunk per op); each of their ops is planned as one chunk. A run of one is an
/// ordinary `job`; other ops are chunked as [`deal_ops`] does.
#[allow(clippy::too_many_arguments)]
pub fn deal_ops_grouped<J>(
    dealer: &Mutex<Dealer<J>>,
    ops: &[Op],
    control: &RequestControl,
    chunk: u64,
    budget: u64,
    closed: bool,
    job: impl FnMut(usize, u64, u64) -> J,
    mut group: impl FnMut(&[usize]) -> J,
    undealt: impl FnMut(J),
    wake: impl FnMut(StreamSet),
) {
    deal(
        dealer,
        ops,
        control,
        chunk,
        closed,
        job,
        Some((budget, &mut group)),
        undealt,
        wake,
    );
}

type Grouper<'a, J> = (u64, &'a mut dyn FnMut(&[usize]) -> J);

#[allow(clippy::too_many_arguments)]
fn deal<J>(
    dealer: &Mutex<Dealer<J>>,
    ops: &[Op],
    control: &RequestControl,
    chunk: u64,
    closed: bool,
    mut job: impl FnMut(usize, u64, u64) -> J,
    mut grouper: Option<Grouper<'_, J>>,
    mut undealt: impl FnMut(J),
    mut wake: impl FnMut(StreamSet),
) {
    let chunk = chunk.max(1);
    let mut i = 0;
    let mut members: Vec<usize> = Vec::new();
    while i < ops.len() {
        let op = &ops[i];
        // A run of small ops of one kind, for one vectored request.
        members.clear();
        if let Some((budget, _)) = &grouper
            && is_piece(op, *budget)
        {
            let budget = (*budget).min(MAX_CHUNK);
            let mut bytes = 0u64;
            let mut j = i;
            while j < ops.len()
                && j - i < MAX_PIECES as usize
                && ops[j].kind == op.kind
                && is_piece(&ops[j], budget)
                && bytes + ops[j].len <= budget
            {
                bytes += ops[j].len;
                j += 1;
            }
            // Filled only for a run worth grouping: a lone op allocates nothing here.
            if j - i > 1 {
                members.extend(i..j);
            }
        }
        if members.len() > 1 {
            control.with_ledger(|l| {
                for &k in &members {
                    l.plan(k, 1);
                }
            });
            let mut dealt = StreamSet::default();
            let mut lost = closed;
            if !closed && !control.should_stop_posting() {
                let mut d = dealer.lock().unwrap_or_else(PoisonError::into_inner);
                let made = match &mut grouper {
                    Some((_, g)) => g(&members),
                    None => break,
                };
                match d.deal(made) {
                    Ok(k) => dealt.add(k),
                    Err(j) => {
                        undealt(j);
                        lost = true;
                    }
                }
            }
            if !dealt.is_empty() {
                wake(dealt);
            }
            if lost {
                control.with_ledger(|l| l.not_posted(i, FailureKind::PeerLost, None));
            }
            if lost || control.should_stop_posting() {
                return;
            }
            i += members.len();
            continue;
        }
        // A CHECKSUM is one chunk however long its range: the peer hashes the whole of it.
        let chunk = if op.kind == OpKind::Checksum {
            op.len.max(1)
        } else {
            chunk
        };
        let chunks = op.len.div_ceil(chunk).max(1);
        let Ok(chunks32) = u32::try_from(chunks) else {
            control.with_ledger(|l| l.not_posted(i, FailureKind::Local, None));
            return;
        };
        control.with_ledger(|l| l.plan(i, chunks32));
        let mut dealt = StreamSet::default();
        let mut lost = closed;
        if !closed {
            let mut d = dealer.lock().unwrap_or_else(PoisonError::into_inner);
            for c in 0..chunks {
                if control.should_stop_posting() {
                    break;
                }
                let at = c * chunk;
                match d.deal(job(i, at, chunk.min(op.len - at))) {
                    Ok(k) => dealt.add(k),
                    Err(j) => {
                        undealt(j);
                        lost = true;
                        break;
                    }
                }
            }
        }
        if !dealt.is_empty() {
            wake(dealt);
        }
        if lost {
            control.with_ledger(|l| l.not_posted(i, FailureKind::PeerLost, None));
        }
        if lost || control.should_stop_posting() {
            return;
        }
        i += 1;
    }
}

/// A set of stream indices without allocating: the first 64 by bit, any further one as "all
/// beyond 64".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamSet {
    mask: u64,
    beyond: bool,
}

impl StreamSet {
    /// Adds stream `i`.
    pub fn add(&mut self, i: usize) {
        match u32::try_from(i).ok().and_then(|s| 1u64.checked_shl(s)) {
            Some(bit) => self.mask |= bit,
            None => self.beyond = true,
        }
    }

    /// Whether stream `i` is in the set (any stream from 64 on, once one of them was added).
    pub fn contains(&self, i: usize) -> bool {
        if i < 64 {
            self.mask & (1 << i) != 0
        } else {
            self.beyond
        }
    }

    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.mask == 0 && !self.beyond
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::{DIRECT_MAX, Dealer, StreamSet, deal_ops, deal_ops_grouped, direct_op};
    use crate::ids::SegmentToken;
    use crate::memory::MemoryRegion;
    use crate::op::{Op, OpKind};
    use crate::outcome::{FailureKind, RemoteEffect, RequestControl};

    fn writes(lens: &[u64]) -> Vec<Op> {
        let r = Arc::new(MemoryRegion::from_vec(vec![0; 64]));
        lens.iter()
            .map(|&len| Op {
                kind: OpKind::Write,
                local: r.clone(),
                local_offset: 0,
                token: SegmentToken(1),
                remote_offset: 0,
                len,
            })
            .collect()
    }

    /// Deals `ops` in chunks of 1000 over `dealer`: the jobs made (op, at, len), the jobs taken
    /// back, and the stream sets woken.
    type Dealt = (Vec<(usize, u64, u64)>, usize, Vec<StreamSet>);

    fn run(
        dealer: &Mutex<Dealer<(usize, u64, u64)>>,
        ops: &[Op],
        c: &RequestControl,
        closed: bool,
    ) -> Dealt {
        let mut made = Vec::new();
        let mut back = 0;
        let mut woken = Vec::new();
        deal_ops(
            dealer,
            ops,
            c,
            1000,
            closed,
            |op, at, len| {
                made.push((op, at, len));
                (op, at, len)
            },
            |_| back += 1,
            |set| woken.push(set),
        );
        (made, back, woken)
    }

    /// Only a request of one op of one chunk whose request fits in `DIRECT_MAX` (payload
    /// counted for a WRITE only) may be sent directly.
    #[test]
    fn direct_op_takes_one_small_chunk() {
        let r = Arc::new(MemoryRegion::alloc_zeroed(1 << 20, 4096).unwrap());
        let op = |kind, len| Op {
            kind,
            local: r.clone(),
            local_offset: 0,
            token: SegmentToken(1),
            remote_offset: 0,
            len,
        };
        let most = (DIRECT_MAX - crate::wire::DATA_REQUEST_LEN) as u64;
        assert!(direct_op(&[op(OpKind::Write, most)], 1 << 20).is_some());
        assert!(direct_op(&[op(OpKind::Write, most + 1)], 1 << 20).is_none());
        assert!(direct_op(&[op(OpKind::Read, 1 << 20)], 1 << 20).is_some());
        assert!(
            direct_op(&[op(OpKind::Read, (1 << 20) + 1)], 1 << 20).is_none(),
            "two chunks"
        );
        assert!(
            direct_op(&[op(OpKind::Write, 64)], 32).is_none(),
            "two chunks"
        );
        assert!(direct_op(&[op(OpKind::Checksum, 8 << 20)], 1 << 20).is_some());
        assert!(direct_op(&[op(OpKind::Write, 64), op(OpKind::Write, 64)], 1 << 20).is_none());
        assert!(direct_op(&[], 1 << 20).is_none());
    }

    /// Each op is planned and its chunks dealt in turn (the tail chunk short, an empty op one
    /// chunk); each op's streams are woken once.
    #[test]
    fn deal_ops_plans_each_op_and_deals_its_chunks_in_turn() {
        let dealer = Mutex::new(Dealer::new(2));
        let ops = writes(&[2500, 0]);
        let c = RequestControl::new(&ops);
        let (made, back, woken) = run(&dealer, &ops, &c, false);
        assert_eq!(
            made,
            [(0, 0, 1000), (0, 1000, 1000), (0, 2000, 500), (1, 0, 0)]
        );
        assert_eq!(back, 0);
        assert_eq!(woken.len(), 2);
        assert!(woken[0].contains(0) && woken[0].contains(1));
        assert!(woken[1].contains(1) && !woken[1].contains(0));
        let d = dealer.lock().unwrap();
        assert_eq!(d.jobs[0].len(), 2);
        assert_eq!(d.jobs[1].len(), 2);
    }

    /// A closed channel deals nothing and the first op is never posted (`PeerLost`, no
    /// effect); with no stream left, the job made is taken back and the op is `PeerLost`; a
    /// stopped request deals nothing more.
    #[test]
    fn deal_ops_stops_on_a_closed_channel_a_channel_without_streams_or_a_stop() {
        let ops = writes(&[1500, 10]);
        let dealer = Mutex::new(Dealer::new(1));
        let c = RequestControl::new(&ops);
        let (made, _, woken) = run(&dealer, &ops, &c, true);
        assert!(made.is_empty() && woken.is_empty());
        let o = c.outcome(true);
        assert_eq!(
            o.failure.map(|f| (f.op_index, f.kind)),
            Some((0, FailureKind::PeerLost))
        );
        assert_eq!(o.remote_effect, RemoteEffect::None);

        let mut none = StreamSet::default();
        assert!(dealer.lock().unwrap().leave(0, &mut none).is_empty());
        let c = RequestControl::new(&ops);
        let (made, back, _) = run(&dealer, &ops, &c, false);
        assert_eq!((made.len(), back), (1, 1));
        assert_eq!(
            c.outcome(true).failure.map(|f| f.kind),
            Some(FailureKind::PeerLost)
        );

        let dealer = Mutex::new(Dealer::new(1));
        let c = RequestControl::new(&ops);
        c.stop(FailureKind::Cancelled);
        let (made, _, _) = run(&dealer, &ops, &c, false);
        assert!(made.is_empty());
    }

    fn deal(d: &mut Dealer<u32>, jobs: impl IntoIterator<Item = u32>) -> Vec<usize> {
        jobs.into_iter().map(|j| d.deal(j).unwrap()).collect()
    }

    /// Chunks go to the streams in turn (each stream's in order), skipping a stream that left;
    /// what was dealt to it goes to the others, and once none is left nothing is dealt and what
    /// was queued comes back to be failed.
    #[test]
    fn chunks_are_dealt_in_turn_and_a_leaving_stream_hands_its_own_on() {
        let mut d = Dealer::new(3);
        assert_eq!(deal(&mut d, 0..5), [0, 1, 2, 0, 1]);
        let mut woken = StreamSet::default();
        assert!(d.leave(0, &mut woken).is_empty());
        assert!(!d.taking[0] && d.taking[1]);
        assert!(d.jobs[0].is_empty());
        // Jobs 0 and 3 went on in turn, after job 4 (stream 1): to 2, then 1.
        assert_eq!(d.jobs[1], [1, 4, 3]);
        assert_eq!(d.jobs[2], [2, 0]);
        assert!(woken.contains(1) && woken.contains(2) && !woken.contains(0));
        assert_eq!(deal(&mut d, [5, 6]), [2, 1]);
        let mut again = StreamSet::default();
        assert!(
            d.leave(0, &mut again).is_empty(),
            "leaving twice hands on nothing"
        );
        assert!(again.is_empty());
        assert!(d.leave(1, &mut woken).is_empty());
        let mut orphans = d.leave(2, &mut woken);
        orphans.sort_unstable();
        assert_eq!(orphans, [0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(d.deal(7), Err(7));
    }

    /// A stream takes its own chunks first; with nothing in flight (idle) and nothing of its
    /// own it takes the oldest chunk of the longest other queue, and never while busy.
    #[test]
    fn an_idle_stream_takes_the_oldest_chunk_of_the_longest_other_queue() {
        let mut d = Dealer::new(3);
        deal(&mut d, 0..4); // 0: [0, 3], 1: [1], 2: [2]
        assert_eq!(d.take(1, false), Some(1));
        assert_eq!(d.take(1, false), None, "busy: no other stream's chunk");
        assert_eq!(d.take(1, true), Some(0), "idle: the longest queue's oldest");
        assert_eq!(d.take(1, true), Some(2));
        assert_eq!(d.take(0, false), Some(3));
        assert_eq!(d.take(0, true), None);
        assert_eq!(d.take(7, true), None, "no such stream");
        assert!(!d.is_closed());
        d.close();
        assert!(d.is_closed());
    }

    #[test]
    fn stream_sets_hold_the_first_64_by_bit_and_the_rest_as_one() {
        let mut s = StreamSet::default();
        assert!(s.is_empty());
        s.add(0);
        s.add(63);
        assert!(s.contains(0) && s.contains(63) && !s.contains(1) && !s.contains(64));
        s.add(100);
        assert!(s.contains(64) && s.contains(100) && !s.is_empty());
    }

    /// With a group budget, runs of small ops of one kind become one job each, of at most the
    /// budget's bytes; a change of kind, a CHECKSUM or a large op ends a run; a run of one is an
    /// ordinary job; large ops are chunked as without a budget; every grouped op is planned as
    /// one chunk.
    #[test]
    fn grouped_dealing_makes_vectored_jobs_by_budget_and_kind() {
        let r = Arc::new(MemoryRegion::from_vec(vec![0; 64]));
        let op = |kind, len| Op {
            kind,
            local: r.clone(),
            local_offset: 0,
            token: SegmentToken(1),
            remote_offset: 0,
            len,
        };
        let (w, rd, ck) = (OpKind::Write, OpKind::Read, OpKind::Checksum);
        let mut ops: Vec<Op> = (0..8).map(|_| op(w, 200)).collect(); // the budget, exactly
        ops.extend([
            op(w, 150), // over the budget with the eight before: a new run (of one)
            op(rd, 10), // another kind: a new run (of one, a CHECKSUM follows)
            op(ck, 10),
            op(w, 2500), // large: chunked
            op(w, 1),
            op(w, 1),
            op(w, 201), // over an eighth of the budget: not a piece
        ]);
        let c = RequestControl::new(&ops);
        let dealer = Mutex::new(Dealer::new(1));
        let mut jobs: Vec<Vec<(usize, u64, u64)>> = Vec::new();
        deal_ops_grouped(
            &dealer,
            &ops,
            &c,
            1000,
            1600,
            false,
            |op, at, len| vec![(op, at, len)],
            |members| members.iter().map(|&m| (m, 0, u64::MAX)).collect(),
            |_| {},
            |_| {},
        );
        while let Some(j) = dealer.lock().unwrap().take(0, false) {
            jobs.push(j);
        }
        let shape: Vec<Vec<usize>> = jobs
            .iter()
            .map(|j| j.iter().map(|x| x.0).collect())
            .collect();
        assert_eq!(
            shape,
            vec![
                (0..8).collect::<Vec<_>>(),
                vec![8],
                vec![9],
                vec![10],
                vec![11],
                vec![11],
                vec![11],
                vec![12, 13],
                vec![14],
            ]
        );
        // A single op of a run of one is an ordinary chunk (its own length).
        assert_eq!(jobs[1], vec![(8, 0, 150)]);
        assert_eq!(jobs[6], vec![(11, 2000, 500)]);
        assert!(super::is_piece(&ops[0], 1600));
        assert!(!super::is_piece(&ops[10], 1600));
        assert!(!super::is_piece(&ops[14], 1600));
    }

    /// A request that counts its chunks still to resolve, as the transports' requests do.
    struct Counted {
        ops: Arc<[Op]>,
        control: RequestControl,
        left: std::sync::atomic::AtomicUsize,
    }

    impl crate::stream::ChunkOwner for Counted {
        fn ops(&self) -> &[Op] {
            &self.ops
        }
        fn control(&self) -> &RequestControl {
            &self.control
        }
        fn chunk_done(&self) {
            self.left
                .fetch_sub(1, std::sync::atomic::Ordering::SeqCst)
                .checked_sub(1)
                .expect("a chunk resolved twice");
        }
    }

    fn counted(ops: Vec<Op>) -> Arc<Counted> {
        let ops: Arc<[Op]> = ops.into();
        Arc::new(Counted {
            control: RequestControl::new(&ops),
            ops,
            // The caller's own count.
            left: 1.into(),
        })
    }

    fn left(req: &Counted) -> usize {
        req.left.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// `deal_request` counts every chunk it deals (one per chunk, one per piece of a vectored
    /// job) and resolves at once, exactly once, what no stream was left to take: the count is
    /// back to the caller's own, and the op is `PeerLost`.
    #[test]
    fn deal_request_counts_each_chunk_and_resolves_what_no_stream_takes() {
        use super::deal_request;
        let count = |req: &Arc<Counted>| {
            let req = req.clone();
            move |n| {
                req.left.fetch_add(n, std::sync::atomic::Ordering::SeqCst);
            }
        };
        // Chunks of 1000: three for the first op, one for the second.
        let req = counted(writes(&[2500, 10]));
        let dealer = Mutex::new(Dealer::new(2));
        deal_request(&dealer, &req, 1000, None, false, count(&req), |_| {});
        assert_eq!(left(&req), 1 + 4);
        assert_eq!(dealer.lock().unwrap().queued(), 4);
        // Grouped: the three small WRITEs are one job of three pieces, the large one chunked.
        let req = counted(writes(&[10, 20, 30, 2500]));
        let dealer = Mutex::new(Dealer::new(1));
        deal_request(&dealer, &req, 1000, Some(1000), false, count(&req), |_| {});
        assert_eq!(left(&req), 1 + 3 + 3);
        assert_eq!(dealer.lock().unwrap().queued(), 1 + 3);
        // No stream left: the job made is counted and resolved once, the op is lost.
        for group in [None, Some(1000)] {
            let req = counted(writes(&[10, 20]));
            let dealer = Mutex::new(Dealer::new(1));
            dealer.lock().unwrap().leave(0, &mut StreamSet::default());
            deal_request(&dealer, &req, 1000, group, false, count(&req), |_| {});
            assert_eq!(
                left(&req),
                1,
                "group {group:?}: the count is the caller's again"
            );
            let o = req.control.outcome(true);
            assert_eq!(
                o.failure.map(|f| (f.op_index, f.kind)),
                Some((0, FailureKind::PeerLost))
            );
        }
    }
}

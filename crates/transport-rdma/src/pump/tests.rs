//! Unit tests of the pump, over mocked and fake queue pairs.

use super::*;
use crate::verbs::{MockQpVerbs, PostError, WC_RETRY_EXC};
use ferry_core::{MemoryRegion, RemoteEffect, SegmentToken};
use ferry_verbs_sys::ffi;
use mockall::Sequence;
use std::sync::Mutex;

const K: Keys = Keys {
    lkey: 0x11,
    remote_base: 0x1000_0000,
    rkey: 0x22,
};

fn ops(kinds: &[(OpKind, u64)]) -> Arc<[Op]> {
    let r = Arc::new(MemoryRegion::from_vec(vec![0; 1 << 16]));
    kinds
        .iter()
        .map(|&(kind, len)| Op {
            kind,
            local: r.clone(),
            local_offset: 0,
            token: SegmentToken(1),
            remote_offset: 0,
            len,
        })
        .collect()
}

fn limits(depth: usize) -> PumpLimits {
    PumpLimits {
        chunk: 100,
        depth,
        signal_every: 2,
        flush_timeout: Duration::from_secs(10),
        replay_writes: false,
    }
}

type Slot = Arc<Mutex<Option<Outcome>>>;

fn add(p: &mut Pump, ops: Arc<[Op]>, rails: usize) -> (Arc<RequestControl>, Slot) {
    let control = Arc::new(RequestControl::new(&ops));
    let keys = ops.iter().map(|_| Ok(vec![Some(K); rails])).collect();
    let slot: Slot = Arc::default();
    let s = slot.clone();
    p.add(
        ops,
        control.clone(),
        keys,
        Box::new(move |o| *s.lock().unwrap() = Some(o)),
    );
    (control, slot)
}

fn rail(qp: MockQpVerbs) -> Rail {
    Rail::new(Box::new(qp), "mock:1".into(), Arc::default())
}

fn ok(wr_id: u64) -> Completion {
    Completion {
        wr_id,
        status: WC_SUCCESS,
        vendor_err: 0,
    }
}

fn status(wr_id: u64, status: u32) -> Completion {
    Completion {
        wr_id,
        status,
        vendor_err: 0,
    }
}

#[test]
fn a_chain_is_posted_with_batched_signals_and_one_completion_acks_it() {
    let mut qp = MockQpVerbs::new();
    qp.expect_post_send()
        .withf(|w| {
            // 250 + 100 bytes: chunks of 100, 100, 50 then 100; every 2nd and the last signalled.
            w.len() == 4
                && w.iter().map(|x| x.len).collect::<Vec<_>>() == [100, 100, 50, 100]
                && w.iter().map(|x| x.signaled).collect::<Vec<_>>() == [false, true, false, true]
                && w[1].remote_addr == K.remote_base + 100
                && w[3].kind == WrKind::Read
                && w.iter().all(|x| x.lkey == K.lkey && x.rkey == K.rkey)
        })
        .times(1)
        .returning(|_| Ok(()));
    qp.expect_poll().times(1).returning(|_| Ok(vec![ok(4)]));
    let mut p = Pump::new(vec![rail(qp)], limits(16));
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Write, 250), (OpKind::Read, 100)]), 1);
    assert!(p.step());
    let o = slot.lock().unwrap().take().expect("resolved");
    assert!(o.is_success() && o.drained, "{o:?}");
    assert_eq!((o.completed_ops, o.completed_bytes), (2, 350));
    assert!(p.idle());
}

#[test]
fn an_error_mid_chain_makes_later_writes_uncertain_and_drains_after_the_flush() {
    let mut qp = MockQpVerbs::new();
    let mut seq = Sequence::new();
    qp.expect_post_send()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|w| {
            assert_eq!(w.len(), 4);
            Ok(())
        });
    // wr 2 fails (so wr 1 completed); wr 3 and 4 are still on the wire.
    qp.expect_poll()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(vec![status(2, WC_RETRY_EXC)]));
    qp.expect_modify()
        .withf(|t| *t == Transition::Error)
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(()));
    // Not flushed yet: the request must not resolve.
    qp.expect_poll()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(vec![]));
    qp.expect_poll()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(vec![status(4, WC_FLUSH)]));
    let mut p = Pump::new(vec![rail(qp)], limits(16));
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Write, 10); 4]), 1);
    p.step();
    assert!(slot.lock().unwrap().is_none(), "resolved before the flush");
    p.step();
    assert!(slot.lock().unwrap().is_none(), "resolved before the flush");
    p.step();
    let o = slot
        .lock()
        .unwrap()
        .take()
        .expect("resolved after the flush");
    assert_eq!((o.completed_ops, o.completed_bytes), (1, 10));
    let f = o.failure.unwrap();
    assert_eq!(f.op_index, 1);
    assert_eq!(f.kind, FailureKind::PeerLost);
    assert_eq!(f.native_status, Some(WC_RETRY_EXC as i32));
    assert_eq!(o.remote_effect, RemoteEffect::Uncertain);
    assert!(o.drained);
    assert!(!p.alive());
}

#[test]
fn a_remote_access_error_is_a_refusal_with_no_effect() {
    let mut qp = MockQpVerbs::new();
    qp.expect_post_send().returning(|_| Ok(()));
    qp.expect_poll()
        .times(1)
        .returning(|_| Ok(vec![status(1, WC_REM_ACCESS)]));
    qp.expect_modify().times(1).returning(|_| Ok(()));
    let mut p = Pump::new(vec![rail(qp)], limits(16));
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Write, 10)]), 1);
    p.step();
    let o = slot.lock().unwrap().take().expect("resolved");
    assert_eq!(
        o.failure.map(|f| f.kind),
        Some(FailureKind::Remote(RemoteStatus::AccessDenied))
    );
    assert_eq!(o.remote_effect, RemoteEffect::None);
    assert_eq!(o.completed_ops, 0);
}

#[test]
fn large_ops_stripe_over_rails_and_in_flight_is_bounded() {
    let posted = Arc::new(Mutex::new(Vec::<(usize, Vec<u64>)>::new()));
    let mut rails = Vec::new();
    for r in 0..2 {
        let mut qp = MockQpVerbs::new();
        let log = posted.clone();
        let pending = Arc::new(Mutex::new(Vec::<u64>::new()));
        let p2 = pending.clone();
        qp.expect_post_send().returning(move |w| {
            assert!(w.len() <= 2, "more than the depth in flight");
            log.lock()
                .unwrap()
                .push((r, w.iter().map(|x| x.wr_id).collect()));
            p2.lock()
                .unwrap()
                .extend(w.iter().filter(|x| x.signaled).map(|x| x.wr_id));
            Ok(())
        });
        qp.expect_poll()
            .returning(move |_| Ok(pending.lock().unwrap().drain(..).map(ok).collect()));
        rails.push(rail(qp));
    }
    let mut p = Pump::new(rails, limits(2));
    // one op of 1000 bytes: 10 chunks over 2 rails of depth 2
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Write, 1000)]), 2);
    for _ in 0..20 {
        if slot.lock().unwrap().is_some() {
            break;
        }
        p.step();
    }
    let o = slot.lock().unwrap().take().expect("resolved");
    assert!(o.is_success(), "{o:?}");
    let log = posted.lock().unwrap();
    let per_rail = |r| {
        log.iter()
            .filter(|(x, _)| *x == r)
            .map(|(_, w)| w.len())
            .sum::<usize>()
    };
    assert_eq!((per_rail(0), per_rail(1)), (5, 5));
    assert_eq!(p.rails[0].counters.bytes.load(Ordering::Relaxed), 500);
}

#[test]
fn a_partial_post_fails_the_rest_locally_and_flushes() {
    let mut qp = MockQpVerbs::new();
    qp.expect_post_send().returning(|_| {
        Err(PostError {
            posted: 1,
            errno: libc::ENOMEM,
        })
    });
    qp.expect_modify().times(1).returning(|_| Ok(()));
    qp.expect_poll()
        .returning(|_| Ok(vec![status(1, WC_FLUSH)]));
    let mut p = Pump::new(vec![rail(qp)], limits(16));
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Write, 10), (OpKind::Write, 10)]), 1);
    p.step();
    let o = slot.lock().unwrap().take().expect("resolved");
    assert_eq!(o.completed_ops, 0);
    assert_eq!(o.remote_effect, RemoteEffect::Uncertain);
    assert!(o.drained);
}

#[test]
fn ops_without_keys_fail_before_posting() {
    let mut qp = MockQpVerbs::new();
    qp.expect_post_send().never();
    let mut p = Pump::new(vec![rail(qp)], limits(16));
    let ops = ops(&[(OpKind::Read, 10)]);
    let control = Arc::new(RequestControl::new(&ops));
    let slot: Slot = Arc::default();
    let s = slot.clone();
    p.add(
        ops,
        control,
        vec![Err(FailureKind::Remote(RemoteStatus::UnknownSegment))],
        Box::new(move |o| *s.lock().unwrap() = Some(o)),
    );
    p.step();
    let o = slot.lock().unwrap().take().expect("resolved");
    assert_eq!(
        o.failure.map(|f| f.kind),
        Some(FailureKind::Remote(RemoteStatus::UnknownSegment))
    );
    assert_eq!(o.remote_effect, RemoteEffect::None);
}

#[test]
fn a_stopped_request_posts_nothing_more_but_waits_for_what_is_out() {
    let mut qp = MockQpVerbs::new();
    let mut seq = Sequence::new();
    qp.expect_post_send()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|w| {
            assert_eq!(w.len(), 2);
            Ok(())
        });
    qp.expect_poll()
        .times(2)
        .in_sequence(&mut seq)
        .returning(|_| Ok(vec![]));
    qp.expect_poll()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(vec![ok(2)]));
    let mut p = Pump::new(vec![rail(qp)], limits(2));
    let (c, slot) = add(&mut p, ops(&[(OpKind::Write, 10); 5]), 1);
    p.step();
    c.stop(FailureKind::Cancelled);
    p.step();
    assert!(slot.lock().unwrap().is_none());
    p.step();
    let o = slot.lock().unwrap().take().expect("resolved");
    assert_eq!(o.completed_ops, 2);
    assert_eq!(o.failure.map(|f| f.kind), Some(FailureKind::Cancelled));
    assert!(o.drained);
}

#[test]
fn a_failed_queue_pair_that_never_flushes_resolves_undrained_after_the_timeout() {
    let mut qp = MockQpVerbs::new();
    qp.expect_post_send().returning(|_| Ok(()));
    let mut seq = Sequence::new();
    qp.expect_poll()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(vec![status(1, WC_RETRY_EXC)]));
    qp.expect_poll().returning(|_| Ok(vec![]));
    qp.expect_modify().times(1).returning(|_| Ok(()));
    let mut p = Pump::new(vec![rail(qp)], limits(16));
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Write, 10); 3]), 1);
    let t0 = Instant::now();
    p.step_at(t0);
    p.step_at(t0 + Duration::from_secs(9));
    assert!(
        slot.lock().unwrap().is_none(),
        "gave up before the flush timeout"
    );
    p.step_at(t0 + Duration::from_secs(11));
    let o = slot
        .lock()
        .unwrap()
        .take()
        .expect("resolved after the flush timeout");
    assert_eq!(o.completed_ops, 0);
    assert_eq!(o.remote_effect, RemoteEffect::Uncertain);
    assert!(!o.drained, "never flushed, so never drained");
}

#[test]
fn single_chunk_requests_alternate_rails() {
    let mut rails = Vec::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    for r in 0..2 {
        let mut qp = MockQpVerbs::new();
        let seen = seen.clone();
        qp.expect_post_send().returning(move |w| {
            seen.lock().unwrap().push((r, w.len()));
            Ok(())
        });
        qp.expect_poll().returning(|_| Ok(vec![]));
        rails.push(rail(qp));
    }
    let mut p = Pump::new(rails, limits(16));
    for _ in 0..4 {
        add(&mut p, ops(&[(OpKind::Write, 100)]), 2);
    }
    p.step();
    let mut seen = seen.lock().unwrap().clone();
    seen.sort();
    assert_eq!(seen, vec![(0, 2), (1, 2)]);
}

/// A queue pair that acknowledges what is posted (up to the last signalled work request of
/// each poll), except that its `fail_at`-th work request (in posting order) completes with
/// `status`; after that, or once moved to ERR, everything outstanding flushes (one
/// completion each, as verbs reports errors whether signalled or not). `ibv_post_send`
/// refuses the work requests from the `refuse_from`-th on.
#[derive(Default)]
struct FakeQp {
    posted: Vec<SendWr>,
    completed: usize,
    fail_at: Option<(usize, u32)>,
    refuse_from: Option<usize>,
    broken: bool,
    /// Completes nothing while set (a flush that has not come back yet).
    hold: bool,
    /// The port is not ACTIVE (what `link_up` answers).
    link_down: bool,
}

impl FakeQp {
    fn post(&mut self, w: &[SendWr]) -> Result<(), PostError> {
        let room = self
            .refuse_from
            .map_or(w.len(), |n| n.saturating_sub(self.posted.len()));
        self.posted.extend_from_slice(&w[..room.min(w.len())]);
        if room < w.len() {
            return Err(PostError {
                posted: room,
                errno: libc::ENOMEM,
            });
        }
        Ok(())
    }

    fn poll(&mut self) -> Vec<Completion> {
        let rest = self.completed..self.posted.len();
        if rest.is_empty() || self.hold {
            return vec![];
        }
        if self.broken {
            self.completed = self.posted.len();
            return self.posted[rest]
                .iter()
                .map(|w| status(w.wr_id, WC_FLUSH))
                .collect();
        }
        if let Some((i, st)) = self.fail_at
            && rest.contains(&i)
        {
            self.broken = true;
            self.completed = i + 1;
            return vec![status(self.posted[i].wr_id, st)];
        }
        match rest.clone().rev().find(|&i| self.posted[i].signaled) {
            Some(i) => {
                self.completed = i + 1;
                vec![ok(self.posted[i].wr_id)]
            }
            None => vec![],
        }
    }
}

fn fake_rail(fail_at: Option<(usize, u32)>) -> (Rail, Arc<Mutex<FakeQp>>) {
    fake_rail_with(FakeQp {
        fail_at,
        ..FakeQp::default()
    })
}

fn fake_rail_with(fake: FakeQp) -> (Rail, Arc<Mutex<FakeQp>>) {
    let state = Arc::new(Mutex::new(fake));
    let mut qp = MockQpVerbs::new();
    let s = state.clone();
    qp.expect_post_send()
        .returning(move |w| s.lock().unwrap().post(w));
    let s = state.clone();
    qp.expect_poll()
        .returning(move |_| Ok(s.lock().unwrap().poll()));
    let s = state.clone();
    qp.expect_modify()
        .withf(|t| *t == Transition::Error)
        .returning(move |_| {
            s.lock().unwrap().broken = true;
            Ok(())
        });
    let s = state.clone();
    qp.expect_link_up()
        .returning(move || !s.lock().unwrap().link_down);
    (rail(qp), state)
}

fn run(p: &mut Pump, slot: &Slot) -> Outcome {
    for _ in 0..100 {
        if let Some(o) = slot.lock().unwrap().take() {
            return o;
        }
        p.step();
    }
    panic!("the request did not resolve");
}

fn counter(p: &Pump, r: usize, f: impl Fn(&RailCounters) -> &AtomicU64) -> u64 {
    f(&p.rails[r].counters).load(Ordering::Relaxed)
}

/// Two rails; rail 1's second work request fails with `status`. One op of `kind`, 1000
/// bytes in 10 chunks of 100 (5 per rail).
fn two_rails_one_failing(
    kind: OpKind,
    status: u32,
    replay_writes: bool,
) -> (Pump, Outcome, Arc<Mutex<FakeQp>>) {
    let (r0, _) = fake_rail(None);
    let (r1, s1) = fake_rail(Some((1, status)));
    let mut p = Pump::new(
        vec![r0, r1],
        PumpLimits {
            replay_writes,
            ..limits(16)
        },
    );
    let (_c, slot) = add(&mut p, ops(&[(kind, 1000)]), 2);
    let o = run(&mut p, &slot);
    (p, o, s1)
}

#[test]
fn reads_lost_on_a_failed_rail_are_replayed_on_the_other_and_the_dead_rail_is_skipped() {
    let (mut p, o, s1) = two_rails_one_failing(OpKind::Read, WC_RETRY_EXC, false);
    assert!(o.is_success() && o.drained, "{o:?}");
    assert_eq!((o.completed_ops, o.completed_bytes), (1, 1000));
    // Rail 1 carried 5 chunks: the first (unsignalled, before the error: complete by the
    // ordering rule, but not seen acknowledged), the failed one and the 3 flushed after it
    // were all replayed on rail 0.
    assert_eq!(counter(&p, 1, |c| &c.bytes), 0);
    assert_eq!(counter(&p, 1, |c| &c.errors), 1);
    assert_eq!(counter(&p, 1, |c| &c.flushed), 3);
    assert_eq!(counter(&p, 1, |c| &c.unproven), 1);
    assert_eq!(counter(&p, 0, |c| &c.replayed), 5);
    assert_eq!(counter(&p, 0, |c| &c.replayed_bytes), 500);
    assert_eq!(counter(&p, 0, |c| &c.bytes), 1000);
    assert_eq!(counter(&p, 1, |c| &c.replayed), 0);
    assert!(p.alive(), "rail 0 is still healthy");
    // The next request stripes over rail 0 only.
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Read, 400)]), 2);
    let o = run(&mut p, &slot);
    assert!(o.is_success(), "{o:?}");
    assert_eq!(
        s1.lock().unwrap().posted.len(),
        5,
        "the dead rail got new work"
    );
    assert_eq!(counter(&p, 0, |c| &c.bytes), 1400);
}

#[test]
fn replays_cover_exactly_the_lost_chunks() {
    let (r0, s0) = fake_rail(None);
    let (r1, s1) = fake_rail(Some((1, WC_RETRY_EXC)));
    let mut p = Pump::new(vec![r0, r1], limits(16));
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Read, 1000)]), 2);
    assert!(run(&mut p, &slot).is_success());
    // Everything rail 1 carried: the failed chunk, the flushed ones after it and the
    // unsignalled one before it, which no completion acknowledged.
    let mut lost: Vec<(u64, u64, u32)> = s1.lock().unwrap().posted[..]
        .iter()
        .map(|w| (w.local_addr, w.remote_addr, w.len))
        .collect();
    let mut replayed: Vec<(u64, u64, u32)> = s0.lock().unwrap().posted[5..]
        .iter()
        .map(|w| {
            assert_eq!(w.kind, WrKind::Read);
            (w.local_addr, w.remote_addr, w.len)
        })
        .collect();
    lost.sort_unstable();
    replayed.sort_unstable();
    assert_eq!(lost, replayed);
}

#[test]
fn writes_lost_on_a_failed_rail_stay_uncertain_unless_the_policy_allows_replay() {
    let (p, o, _) = two_rails_one_failing(OpKind::Write, WC_RETRY_EXC, false);
    assert_eq!((o.completed_ops, o.completed_bytes), (0, 0));
    let f = o.failure.expect("failed");
    assert_eq!(f.kind, FailureKind::PeerLost);
    assert_eq!(o.remote_effect, RemoteEffect::Uncertain);
    assert!(o.drained);
    assert_eq!(counter(&p, 0, |c| &c.replayed), 0);

    let (p, o, _) = two_rails_one_failing(OpKind::Write, WC_RETRY_EXC, true);
    assert!(o.is_success() && o.drained, "{o:?}");
    assert_eq!(o.completed_bytes, 1000);
    assert_eq!(counter(&p, 0, |c| &c.replayed), 5);
    assert_eq!(counter(&p, 0, |c| &c.replayed_bytes), 500);
}

/// Two rails; rail 1's second work request fails with local error `status` while its port
/// is `down` or not. One READ of 1000 bytes in 10 chunks of 100.
fn a_local_error_on_rail_1(status: u32, down: bool) -> (Pump, Outcome) {
    let (r0, _) = fake_rail(None);
    let (r1, _) = fake_rail_with(FakeQp {
        fail_at: Some((1, status)),
        link_down: down,
        ..FakeQp::default()
    });
    let mut p = Pump::new(vec![r0, r1], limits(16));
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Read, 1000)]), 2);
    let o = run(&mut p, &slot);
    (p, o)
}

#[test]
fn a_local_error_on_a_port_that_is_down_is_the_links_and_is_replayed() {
    let (p, o) = a_local_error_on_rail_1(ffi::IBV_WC_LOC_PROT_ERR, true);
    assert!(o.is_success() && o.drained, "{o:?}");
    assert_eq!(counter(&p, 1, |c| &c.errors), 1);
    assert_eq!(counter(&p, 0, |c| &c.replayed), 5);
    assert_eq!(counter(&p, 0, |c| &c.bytes), 1000);
}

#[test]
fn a_qp_operation_error_is_the_transports_and_is_replayed_even_on_a_port_that_is_up() {
    let (p, o) = a_local_error_on_rail_1(WC_LOC_QP_OP, false);
    assert!(o.is_success() && o.drained, "{o:?}");
    assert_eq!(counter(&p, 0, |c| &c.replayed), 5);
}

#[test]
fn a_local_error_on_a_port_that_is_up_fails_its_op_locally() {
    let (p, o) = a_local_error_on_rail_1(ffi::IBV_WC_LOC_PROT_ERR, false);
    let f = o.failure.expect("failed");
    assert_eq!(f.kind, FailureKind::Local);
    assert_eq!(f.native_status, Some(ffi::IBV_WC_LOC_PROT_ERR as i32));
    assert_eq!(counter(&p, 0, |c| &c.replayed), 0);
}

#[test]
fn a_qp_operation_error_on_the_only_rail_leaves_the_read_to_a_reconnect() {
    let (r, _) = fake_rail_with(FakeQp {
        fail_at: Some((1, WC_LOC_QP_OP)),
        link_down: false,
        ..FakeQp::default()
    });
    let mut p = Pump::new(vec![r], limits(16));
    let (c, slot) = add(&mut p, ops(&[(OpKind::Read, 1000)]), 1);
    let o = run(&mut p, &slot);
    assert_eq!(o.failure.map(|f| f.kind), Some(FailureKind::PeerLost));
    assert!(!p.alive());
    // The engine replays what a reconnect may carry: the READ is in the plan.
    let plan = c
        .with_ledger(|l| l.replay_plan(false))
        .expect("a replay plan");
    assert_eq!(plan.ops, vec![0]);
}

#[test]
fn a_remote_access_error_is_not_replayed() {
    let (p, o, _) = two_rails_one_failing(OpKind::Read, WC_REM_ACCESS, false);
    assert_eq!(
        o.failure.map(|f| f.kind),
        Some(FailureKind::Remote(RemoteStatus::AccessDenied))
    );
    assert_eq!(o.completed_ops, 0);
    assert!(o.drained);
    assert_eq!(counter(&p, 0, |c| &c.replayed), 0);
    // Nothing beyond the first posting went to rail 0.
    assert_eq!(counter(&p, 0, |c| &c.posted), 5);
}

#[test]
fn when_every_rail_fails_the_request_is_lost_with_the_prefix_seen_acknowledged() {
    // op 0 (200 bytes): wr 1 on rail 0, wr 2 on rail 1, neither signalled.
    // op 1 (800 bytes): wr 3, 5, 7, 9 on rail 0 and 4, 6, 8, 10 on rail 1. Rail 0 fails at
    // wr 5: wr 1 and 3 before it were never seen acknowledged, so they are queued for rail 1
    // with wr 5 and its flushed successors; then rail 1 fails at wr 4 (wr 2 before it is
    // acknowledged only by the ordering rule, and no rail is left to replay it on): nothing
    // is left. No op was seen complete.
    let (r0, _) = fake_rail(Some((2, WC_RETRY_EXC)));
    let (r1, _) = fake_rail(Some((1, WC_RETRY_EXC)));
    let mut p = Pump::new(vec![r0, r1], limits(16));
    let (c, slot) = add(&mut p, ops(&[(OpKind::Read, 200), (OpKind::Read, 800)]), 2);
    let o = run(&mut p, &slot);
    assert_eq!((o.completed_ops, o.completed_bytes), (0, 0));
    let f = o.failure.expect("failed");
    assert_eq!((f.op_index, f.kind), (0, FailureKind::PeerLost));
    assert_eq!(f.native_status, Some(WC_RETRY_EXC as i32));
    assert_eq!(o.remote_effect, RemoteEffect::None);
    assert!(o.drained);
    assert!(!p.alive());
    assert!(p.idle());
    // wr 5's queued replay was dropped as lost: the outcome is final, not waiting on it.
    assert_eq!(c.outcome(true), o);
}

#[test]
fn a_cancelled_request_drops_its_queued_replays_as_lost() {
    let (r0, _) = fake_rail(None);
    let (r1, _) = fake_rail(Some((0, WC_RETRY_EXC)));
    let mut p = Pump::new(vec![r0, r1], limits(16));
    let (c, slot) = add(&mut p, ops(&[(OpKind::Read, 200)]), 2);
    // Step 1 posts both chunks; rail 0 acks its chunk, rail 1 fails its own: replay queued.
    p.step();
    assert!(slot.lock().unwrap().is_none());
    c.stop(FailureKind::Cancelled);
    let o = run(&mut p, &slot);
    assert_eq!(o.completed_ops, 0);
    assert_eq!(counter(&p, 0, |c| &c.replayed), 0);
    assert!(o.drained);
    assert!(p.idle());
}

#[test]
fn chunks_refused_by_post_send_move_to_a_healthy_rail_even_writes() {
    // Rail 1 takes 2 of its 5 work requests, refuses the rest, and is flushed: its 3
    // refused chunks never reached the wire and move to rail 0 whatever their kind; its 2
    // posted READ chunks flush and are replayed.
    let (r0, _) = fake_rail(None);
    let (r1, s1) = fake_rail_with(FakeQp {
        refuse_from: Some(2),
        ..FakeQp::default()
    });
    let mut p = Pump::new(vec![r0, r1], limits(16));
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Read, 1000)]), 2);
    let o = run(&mut p, &slot);
    assert!(o.is_success() && o.drained, "{o:?}");
    assert_eq!(s1.lock().unwrap().posted.len(), 2);
    assert_eq!(counter(&p, 0, |c| &c.replayed), 5);
    assert_eq!(counter(&p, 0, |c| &c.bytes), 1000);

    // WRITEs, replay not allowed: chunks refused before reaching the wire still move (they
    // have had no effect), and the request completes.
    let (r0, _) = fake_rail(None);
    let (r1, s1) = fake_rail_with(FakeQp {
        refuse_from: Some(0),
        ..FakeQp::default()
    });
    let mut p = Pump::new(vec![r0, r1], limits(16));
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Write, 1000)]), 2);
    let o = run(&mut p, &slot);
    assert!(o.is_success() && o.drained, "{o:?}");
    assert!(s1.lock().unwrap().posted.is_empty());
    assert_eq!(counter(&p, 0, |c| &c.replayed), 5);
    assert!(!p.rails[1].usable(), "the refusing rail is dead");
}

/// The rail state machine of a port flap: rail 1 fails mid-READ (its chunks are replayed on
/// rail 0), its queue pair is torn down once flushed (destroyed: the fake's state is no
/// longer held by anyone but the test), a fresh one handed over by a new handshake replaces
/// it, and the rest of the same request stripes over both rails again. The old queue pair
/// never sees another work request.
#[test]
fn a_failed_rail_is_torn_down_then_rebuilt_and_carries_the_rest_of_the_running_request() {
    let (r0, _) = fake_rail(None);
    let (r1, old) = fake_rail(Some((1, WC_RETRY_EXC)));
    let mut p = Pump::new(vec![r0, r1], limits(2));
    // 4000 bytes in 40 chunks of 100, at most 2 outstanding per rail.
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Read, 4000)]), 2);
    p.step();
    // Rail 1 failed at its second work request and was flushed: it is down and torn down.
    assert!(!p.rails[1].usable());
    assert!(p.rails[1].counters.down.load(Ordering::Acquire));
    assert_eq!(counter(&p, 1, |c| &c.torn_down), 1);
    assert_eq!(
        Arc::strong_count(&old),
        1,
        "the failed queue pair was not destroyed"
    );
    let old_posted = old.lock().unwrap().posted.len();
    assert!(
        slot.lock().unwrap().is_none(),
        "the request is still running"
    );
    let (fresh_rail, fresh) = fake_rail(None);
    p.rebuild(1, fresh_rail.qp);
    let o = run(&mut p, &slot);
    assert!(o.is_success() && o.drained, "{o:?}");
    assert_eq!((o.completed_ops, o.completed_bytes), (1, 4000));
    assert_eq!(counter(&p, 1, |c| &c.rebuilds), 1);
    assert!(!p.rails[1].counters.down.load(Ordering::Acquire));
    assert!(p.rails[1].usable());
    // The healed rail carried part of the same request; the old queue pair nothing more.
    let healed = fresh.lock().unwrap().posted.len();
    assert!(healed > 0, "the rebuilt rail carried nothing");
    assert_eq!(old.lock().unwrap().posted.len(), old_posted);
    assert_eq!(
        counter(&p, 0, |c| &c.bytes) + counter(&p, 1, |c| &c.bytes),
        4000
    );
    // The failed chunk and the unsignalled one before it.
    assert_eq!(counter(&p, 0, |c| &c.replayed), 2);
    // And the next request stripes over both.
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Read, 400)]), 2);
    assert!(run(&mut p, &slot).is_success());
    assert_eq!(fresh.lock().unwrap().posted.len(), healed + 2);
}

/// A fresh queue pair replaces a failed one only after the flush (the old one is never
/// reused alongside it), is dropped for a healthy rail, and nothing is rebuilt once the
/// channel closes.
#[test]
fn a_rebuild_waits_for_the_flush_and_is_dropped_when_not_needed_or_closing() {
    // Rail 0's queue pair fails while its flush has not come back yet.
    let (r0, s0) = fake_rail(None);
    let mut p = Pump::new(vec![r0], limits(4));
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Read, 400)]), 1);
    s0.lock().unwrap().hold = true;
    p.step();
    p.rails[0].fail(FailureKind::PeerLost);
    let (fresh_rail, fresh) = fake_rail(None);
    p.rebuild(0, fresh_rail.qp);
    p.step();
    assert_eq!(p.rails[0].outstanding.len(), 4);
    assert_eq!(counter(&p, 0, |c| &c.torn_down), 0);
    assert_eq!(counter(&p, 0, |c| &c.rebuilds), 0);
    assert!(!p.alive());
    // The flush arrives: the chunks are lost (no other rail), the queue pair is torn down
    // and the fresh one takes its place, in one step.
    s0.lock().unwrap().hold = false;
    let o = run(&mut p, &slot);
    assert_eq!(o.failure.map(|f| f.kind), Some(FailureKind::PeerLost));
    assert!(o.drained, "{o:?}");
    assert_eq!(counter(&p, 0, |c| &c.torn_down), 1);
    assert_eq!(counter(&p, 0, |c| &c.rebuilds), 1);
    assert_eq!(Arc::strong_count(&s0), 1);
    assert!(p.alive());
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Read, 200)]), 1);
    assert!(run(&mut p, &slot).is_success());
    assert_eq!(fresh.lock().unwrap().posted.len(), 2);

    // A healthy rail keeps its queue pair; the offered one is destroyed.
    let (spare, spare_state) = fake_rail(None);
    p.rebuild(0, spare.qp);
    p.step();
    assert_eq!(Arc::strong_count(&spare_state), 1);
    assert_eq!(counter(&p, 0, |c| &c.rebuilds), 1);

    // Closing: the rail fails for good (neither down nor counted as torn down: closed), a
    // late rebuild is dropped.
    p.close();
    p.step();
    assert!(!p.rails[0].counters.down.load(Ordering::Acquire));
    assert_eq!(counter(&p, 0, |c| &c.torn_down), 1);
    let (late, late_state) = fake_rail(None);
    p.rebuild(0, late.qp);
    p.step();
    assert_eq!(Arc::strong_count(&late_state), 1);
    assert!(!p.alive());
    assert_eq!(counter(&p, 0, |c| &c.rebuilds), 1);
}

#[cfg(feature = "__fault-injection")]
#[test]
fn an_injected_rail_failure_is_learnt_from_the_flushes_and_replayed() {
    let (r0, _) = fake_rail(None);
    let (r1, s1) = fake_rail(None);
    let mut p = Pump::new(vec![r0, r1], limits(16));
    p.rails[1]
        .counters
        .inject_failure
        .store(true, Ordering::Relaxed);
    let (_c, slot) = add(&mut p, ops(&[(OpKind::Read, 1000)]), 2);
    let o = run(&mut p, &slot);
    assert!(o.is_success() && o.drained, "{o:?}");
    assert!(
        s1.lock().unwrap().broken,
        "the queue pair was not moved to ERR"
    );
    assert_eq!(counter(&p, 1, |c| &c.flushed), 5);
    assert_eq!(counter(&p, 0, |c| &c.replayed), 5);
    assert_eq!(counter(&p, 0, |c| &c.bytes), 1000);
    assert!(p.alive());
}

//! Reconnect and replay: a request whose connection to its peer was lost is run again, in part,
//! on a fresh connection to the same peer incarnation (docs/architecture.md §5).
//!
//! What may run again is decided by the ledger ([`Ledger::replay_plan`](ferry_core::Ledger::replay_plan),
//! no I/O): unfinished READs and CHECKSUMs, and WRITEs only under
//! [`ReconnectPolicy::replay_writes`]. This module drives it: it waits for the attempt to drain,
//! gets a channel that can carry the replay (the same one while some of its streams live, else a
//! reconnect), and runs the replayed ops through the ledger's view so the request's outcome stays
//! exact. One reconnect per peer is in flight at a time, shared by every request waiting on it;
//! its attempts are spaced by a jittered [`Backoff`], and they stop at the request's deadline.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use ferry_core::backoff::Backoff;
use std::future::Future;
use std::task::Poll;

use ferry_core::{
    BoxFuture, Channel, Epoch, Error, FailureKind, Op, Outcome, PeerId, RemoteStatus,
    RequestControl, SegmentDesc,
};
use tokio::time::Instant;

use crate::counters::RouteCounters;

/// What reconnects a peer: a new channel to the same incarnation (the engine that connected it).
pub(crate) trait Reopen: Send + Sync {
    /// A channel to `peer`'s address, refused with `StaleEpoch` when another incarnation answers.
    fn reopen<'a>(
        self: Arc<Self>,
        peer: &'a PeerInner,
    ) -> BoxFuture<'a, Result<Arc<dyn Channel>, Error>>;

    /// Rebuilds the failed rails of `peer`'s current channel whose ports are back
    /// ([`Channel::heal_offer`]): a new handshake with the same incarnation carrying only their
    /// fresh endpoints, then [`Channel::heal`]. How many rails rejoined (0: nothing to heal).
    fn heal<'a>(self: Arc<Self>, peer: &'a PeerInner) -> BoxFuture<'a, Result<usize, Error>>;
}

/// How often a peer's RDMA channel is asked whether a failed rail's port is back.
const HEAL_POLL: Duration = Duration::from_millis(200);
/// The longest wait between heal attempts after failed ones.
const HEAL_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Watches `peer`'s channel for rails to heal (RDMA), for as long as the peer is open and held:
/// every [`HEAL_POLL`], and after a failed heal (a handshake refused or timed out) up to
/// [`HEAL_BACKOFF_MAX`] apart. A heal waits for a reconnect in flight and the reverse, so the two
/// never build queue pairs for the same peer at once. Holds the peer only while healing.
pub(crate) fn watch_rails(peer: &Arc<PeerInner>) -> tokio::task::JoinHandle<()> {
    let weak = Arc::downgrade(peer);
    tokio::spawn(async move {
        let mut wait = HEAL_POLL;
        loop {
            tokio::time::sleep(wait).await;
            let Some(peer) = weak.upgrade() else { break };
            if peer.closed.load(Ordering::Acquire) {
                break;
            }
            let Some(engine) = peer.engine.upgrade() else {
                break;
            };
            let _recovery = peer.recovery.lock().await;
            match engine.heal(&peer).await {
                Ok(0) => wait = HEAL_POLL,
                Ok(n) => {
                    tracing::info!(peer = %peer.addr, rails = n, "RDMA rails healed");
                    wait = HEAL_POLL;
                }
                Err(e) => {
                    wait = (wait * 2).min(HEAL_BACKOFF_MAX);
                    tracing::warn!(peer = %peer.addr, error = %e, retry_in = ?wait,
                        "healing RDMA rails failed");
                }
            }
        }
        tracing::debug!("rail watch ended");
    })
}

/// One connected peer incarnation, shared by its [`Peer`] handles and its segments.
pub(crate) struct PeerInner {
    pub(crate) addr: SocketAddr,
    pub(crate) id: PeerId,
    pub(crate) epoch: Epoch,
    pub(crate) segments: Vec<SegmentDesc>,
    /// The protocol version both ends speak (the newest in both ranges).
    pub(crate) version: u16,
    /// The channel its requests take now (replaced at a reconnect).
    pub(crate) link: Mutex<Link>,
    /// The reconnect in flight, one at a time.
    pub(crate) recovery: tokio::sync::Mutex<Recovery>,
    /// The engine, to reconnect through (a peer does not keep its engine alive).
    pub(crate) engine: Weak<dyn Reopen>,
    pub(crate) policy: ReconnectPolicy,
    /// [`Peer::close`] was called: no reconnect.
    pub(crate) closed: AtomicBool,
    pub(crate) counters: Arc<RouteCounters>,
}

impl PeerInner {
    /// The generation of the current channel, and the channel.
    pub(crate) fn link(&self) -> (u64, Arc<dyn Channel>) {
        let link = self.link.lock().unwrap_or_else(PoisonError::into_inner);
        (link.generation, link.channel.clone())
    }

    /// The current channel.
    pub(crate) fn channel(&self) -> Arc<dyn Channel> {
        self.link().1
    }

    /// A peer over `channel` with `segments` and no engine behind it (so no reconnect), for
    /// unit tests.
    #[cfg(test)]
    pub(crate) fn for_test(
        channel: Arc<dyn Channel>,
        segments: Vec<SegmentDesc>,
        counters: Arc<RouteCounters>,
    ) -> Self {
        Self {
            addr: SocketAddr::from(([127, 0, 0, 1], 9)),
            id: PeerId(1),
            epoch: Epoch(1),
            segments,
            version: 2,
            link: Mutex::new(Link {
                generation: 0,
                channel,
            }),
            recovery: Default::default(),
            engine: Weak::<Detached>::new(),
            policy: ReconnectPolicy::default(),
            closed: Default::default(),
            counters,
        }
    }
}

/// No engine: what a peer made for a unit test reconnects through (never, as it is never alive).
#[cfg(test)]
struct Detached;

#[cfg(test)]
impl Reopen for Detached {
    fn reopen<'a>(
        self: Arc<Self>,
        _peer: &'a PeerInner,
    ) -> BoxFuture<'a, Result<Arc<dyn Channel>, Error>> {
        unreachable!("a detached peer has no engine to upgrade")
    }

    fn heal<'a>(self: Arc<Self>, _peer: &'a PeerInner) -> BoxFuture<'a, Result<usize, Error>> {
        unreachable!("a detached peer has no engine to upgrade")
    }
}

/// What an engine does when the connection to a peer incarnation is lost: how often it
/// reconnects, how long it waits between attempts, and whether WRITEs are replayed. Set with
/// [`EngineBuilder::reconnect`](crate::EngineBuilder::reconnect).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReconnectPolicy {
    /// Reconnect attempts for one loss before the peer is given up (its waiting requests keep
    /// their `PeerLost` failure); also how many replays in a row may make no progress. 0: never
    /// reconnect nor replay (a lost connection fails its requests, as without this policy).
    pub attempts: u32,
    /// The first attempt waits up to this long (full jitter: a random time from zero).
    pub backoff_base: Duration,
    /// No attempt waits longer than this.
    pub backoff_max: Duration,
    /// Replay WRITEs that had bytes sent before the loss. Off by default: such a WRITE may have
    /// changed remote memory, and writing it again overwrites whatever was written there since
    /// (the request ends with `PeerLost` and an `Uncertain` remote effect instead). READs and
    /// CHECKSUMs are always replayed; a WRITE never sent is simply run.
    pub replay_writes: bool,
}

impl Default for ReconnectPolicy {
    /// 5 attempts, waits from up to 50 ms growing to at most 2 s, WRITEs not replayed. Each
    /// attempt is bounded by the engine's connect timeout, so a peer that never comes back is
    /// given up within about five connect timeouts plus 3 s (sooner where it refuses at once).
    fn default() -> Self {
        Self {
            attempts: 5,
            backoff_base: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            replay_writes: false,
        }
    }
}

/// A peer's connection state shared by its requests: which channel carries them now.
#[derive(Debug)]
pub(crate) struct Link {
    /// Bumped at each reconnect: a request that lost generation `g` and finds another needs no
    /// reconnect of its own.
    pub(crate) generation: u64,
    pub(crate) channel: Arc<dyn Channel>,
}

/// The reconnect in flight for a peer (one at a time).
#[derive(Debug, Default)]
pub(crate) struct Recovery {
    /// The last reconnect given up: the generation it tried to replace, why, and when. The
    /// requests that lost that generation and were already waiting fail the same way without
    /// trying again; a request that comes later tries afresh.
    gave_up: Option<(u64, FailureKind, Instant)>,
}

/// Why a replay cannot run.
enum NoChannel {
    /// The request stopped, its deadline passed, or the peer was closed: the outcome stands.
    Stopped,
    /// The reconnect was given up for this reason.
    GaveUp(FailureKind),
}

/// Runs `ops` on `peer`'s channel; if the connection is lost, reconnects and replays what the
/// policy allows, until the request completes, fails for good, or its `deadline` passes. Resolves
/// once every chunk of every attempt is resolved (`drained`).
pub(crate) fn run(
    peer: Arc<PeerInner>,
    ops: Arc<[Op]>,
    control: Arc<RequestControl>,
    deadline: Option<Instant>,
) -> impl Future<Output = Outcome> + Send + 'static {
    let (generation, channel) = peer.link();
    // Posted now, not when the future is first polled.
    let first = channel.execute(ops.clone(), control.clone());
    run_on(peer, ops, control, deadline, generation, channel, first)
}

/// The rest of [`run`]: waits for the first attempt, then recovers and replays.
async fn run_on(
    peer: Arc<PeerInner>,
    ops: Arc<[Op]>,
    control: Arc<RequestControl>,
    deadline: Option<Instant>,
    mut generation: u64,
    channel: Arc<dyn Channel>,
    first: BoxFuture<'static, Outcome>,
) -> Outcome {
    let mut outcome = until(first, &channel, &control, deadline).await;
    let policy = peer.policy;
    let mut fruitless = 0u32;
    // Spaces replays that completed nothing (a channel whose streams are still dying).
    let mut again = Backoff::random(policy.backoff_base, policy.backoff_max);
    loop {
        if outcome.failure.is_none() || policy.attempts == 0 || stop_if_late(&control, deadline) {
            return outcome;
        }
        let Some(plan) = control.with_ledger(|l| l.replay_plan(policy.replay_writes)) else {
            return outcome;
        };
        if fruitless >= policy.attempts {
            tracing::warn!(peer = %peer.addr, replays = fruitless,
                "replays make no progress; giving the request up");
            return outcome;
        }
        if fruitless > 0 && !sleep_unless_late(again.next_delay(), &control, deadline).await {
            return control.outcome(true);
        }
        let channel = match recover(&peer, generation, &control, deadline).await {
            Ok((g, c)) => {
                generation = g;
                c
            }
            Err(NoChannel::Stopped) => return control.outcome(true),
            Err(NoChannel::GaveUp(kind)) => {
                control.with_ledger(|l| l.give_up(&plan.ops, kind, None));
                return control.outcome(true);
            }
        };
        if stop_if_late(&control, deadline) {
            return control.outcome(true);
        }
        if plan.replayed > 0 {
            peer.counters
                .replays
                .fetch_add(plan.replayed as u64, Ordering::Relaxed);
            peer.counters
                .replayed_bytes
                .fetch_add(plan.replayed_bytes, Ordering::Relaxed);
        }
        tracing::info!(peer = %peer.addr, ops = plan.ops.len(), replayed = plan.replayed,
            bytes = plan.replayed_bytes, held_back = ?plan.held_back, "replaying a lost request");
        let before = outcome.completed_ops;
        control.with_ledger(|l| l.rearm(&plan.ops));
        let sub: Arc<[Op]> = plan.ops.iter().map(|&i| ops[i].clone()).collect();
        execute_until(&channel, sub, &control, deadline).await;
        control.with_ledger(|l| l.end_replay());
        outcome = control.outcome(true);
        if outcome.completed_ops > before {
            fruitless = 0;
        } else {
            fruitless += 1;
        }
    }
}

/// Runs `ops` on `channel`; at `deadline` the request is stopped (a timeout: nothing more is
/// posted), and what was posted still resolves before this returns (see [`until`]).
async fn execute_until(
    channel: &Arc<dyn Channel>,
    ops: Arc<[Op]>,
    control: &Arc<RequestControl>,
    deadline: Option<Instant>,
) -> Outcome {
    until(
        channel.execute(ops, control.clone()),
        channel,
        control,
        deadline,
    )
    .await
}

/// How long the chunks still in flight when a request is stopped (its deadline, a cancel) get
/// to resolve on their own before [`until`] closes the channel under them.
pub(crate) const QUIESCE_GRACE: Duration = Duration::from_millis(250);
/// How often a running request looks whether its owner stopped it (a cancel).
const STOP_POLL: Duration = Duration::from_millis(100);

/// Waits for `run` (an attempt of a request on `channel`), stopping the
/// request as a timeout at `deadline`. Once the request is stopped (at its deadline, or by a
/// cancel, seen within [`STOP_POLL`]), what it has in flight gets [`QUIESCE_GRACE`] to resolve;
/// past it the channel is closed, which ends every chunk in flight on it: a transport resolves
/// a chunk only once it can no longer touch the chunk's buffer (on TCP and io_uring, the
/// streams are shut down both ways, so no further byte of a READ is received into the caller's
/// memory and no further byte of a WRITE is sent). So a frozen peer holds a stopped request
/// for the grace, not until the kernel gives the connection up. The ops the close ended keep
/// the stop as their failure (`Timeout`, `Cancelled`), not `PeerLost`; their counts stay, so a
/// WRITE's remote effect says whether its bytes may have landed. The channel's other requests
/// are lost with it (and replayed as the policy allows); the next request reconnects.
async fn until(
    run: BoxFuture<'static, Outcome>,
    channel: &Arc<dyn Channel>,
    control: &Arc<RequestControl>,
    deadline: Option<Instant>,
) -> Outcome {
    tokio::pin!(run);
    // An attempt that ends at its first poll (a small request whose task spun for its answers)
    // registers no timer: one registered where the runtime's timer sleeps with none unparks it
    // (a system call, a thread woken) per request.
    let first = std::future::poll_fn(|cx| Poll::Ready(run.as_mut().poll(cx))).await;
    if let Poll::Ready(o) = first {
        return o;
    }
    let mut poll = tokio::time::interval_at(Instant::now() + STOP_POLL, STOP_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let late = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(late);
    loop {
        tokio::select! {
            o = &mut run => return o,
            _ = &mut late => {
                control.stop(FailureKind::Timeout);
                break;
            }
            _ = poll.tick() => {
                if control.stopped().is_some() {
                    break;
                }
            }
        }
    }
    if let Ok(o) = tokio::time::timeout(QUIESCE_GRACE, &mut run).await {
        return o;
    }
    let why = control.stopped().unwrap_or(FailureKind::Timeout);
    tracing::info!(kind = %channel.kind(), stopped = %why,
        "a stopped request still has chunks in flight past the grace: closing its channel");
    channel.close();
    run.await;
    control.with_ledger(|l| l.closed_under_stop(why));
    control.outcome(true)
}

/// Whether the request is over: stopped by its owner, or past its deadline (then stopped here
/// as a timeout, as awaiting its handle would).
fn stop_if_late(control: &RequestControl, deadline: Option<Instant>) -> bool {
    if deadline.is_some_and(|d| Instant::now() >= d) {
        control.stop(FailureKind::Timeout);
    }
    control.stopped().is_some()
}

/// A channel to run a replay on, for a request that lost generation `lost`: the current one if
/// another request reconnected meanwhile or some of its streams still live, else a reconnect
/// (one per peer at a time; the others wait for it and share its result).
async fn recover(
    peer: &Arc<PeerInner>,
    lost: u64,
    control: &RequestControl,
    deadline: Option<Instant>,
) -> Result<(u64, Arc<dyn Channel>), NoChannel> {
    let asked = Instant::now();
    let mut recovery = match deadline {
        Some(d) => match tokio::time::timeout_at(d, peer.recovery.lock()).await {
            Ok(g) => g,
            Err(_) => {
                control.stop(FailureKind::Timeout);
                return Err(NoChannel::Stopped);
            }
        },
        None => peer.recovery.lock().await,
    };
    if peer.closed.load(Ordering::Acquire) {
        return Err(NoChannel::Stopped);
    }
    let (generation, channel) = peer.link();
    if generation != lost || channel.is_alive() {
        return Ok((generation, channel));
    }
    if let Some((g, why, at)) = recovery.gave_up
        && g == lost
        && asked <= at
    {
        return Err(NoChannel::GaveUp(why));
    }
    let Some(engine) = peer.engine.upgrade() else {
        return Err(NoChannel::Stopped);
    };
    let policy = peer.policy;
    let mut backoff = Backoff::random(policy.backoff_base, policy.backoff_max);
    let mut last: Option<Error> = None;
    while backoff.attempts() < policy.attempts {
        let wait = backoff.next_delay();
        if !sleep_unless_late(wait, control, deadline).await {
            return Err(NoChannel::Stopped);
        }
        peer.counters
            .reconnect_attempts
            .fetch_add(1, Ordering::Relaxed);
        let reopen = engine.clone().reopen(peer);
        let result = match deadline {
            Some(d) => match tokio::time::timeout_at(d, reopen).await {
                Ok(r) => r,
                Err(_) => {
                    control.stop(FailureKind::Timeout);
                    return Err(NoChannel::Stopped);
                }
            },
            None => reopen.await,
        };
        match result {
            Ok(channel) => {
                let mut link = peer.link.lock().unwrap_or_else(PoisonError::into_inner);
                link.generation += 1;
                link.channel = channel.clone();
                peer.counters.reconnects.fetch_add(1, Ordering::Relaxed);
                tracing::info!(peer = %peer.addr, attempt = backoff.attempts(),
                    generation = link.generation, "reconnected");
                return Ok((link.generation, channel));
            }
            Err(e @ Error::StaleEpoch { .. }) => {
                tracing::warn!(peer = %peer.addr, error = %e,
                    "the peer came back as a new incarnation: nothing is replayed into it");
                let why = FailureKind::Remote(RemoteStatus::StaleEpoch);
                recovery.gave_up = Some((lost, why, Instant::now()));
                peer.counters
                    .reconnect_failures
                    .fetch_add(1, Ordering::Relaxed);
                return Err(NoChannel::GaveUp(why));
            }
            Err(e) => {
                tracing::debug!(peer = %peer.addr, attempt = backoff.attempts(), error = %e,
                    "reconnect attempt failed");
                last = Some(e);
            }
        }
    }
    tracing::warn!(peer = %peer.addr, attempts = backoff.attempts(),
        last_error = ?last.map(|e| e.to_string()), "reconnect given up");
    recovery.gave_up = Some((lost, FailureKind::PeerLost, Instant::now()));
    peer.counters
        .reconnect_failures
        .fetch_add(1, Ordering::Relaxed);
    Err(NoChannel::GaveUp(FailureKind::PeerLost))
}

/// Sleeps `wait`, unless the request stops or its deadline comes first (checked every 50 ms for
/// a stop); whether it slept the whole time.
async fn sleep_unless_late(
    wait: Duration,
    control: &RequestControl,
    deadline: Option<Instant>,
) -> bool {
    let until = Instant::now() + wait;
    loop {
        if stop_if_late(control, deadline) {
            return false;
        }
        let now = Instant::now();
        if now >= until {
            return true;
        }
        let mut next = until.min(now + Duration::from_millis(50));
        if let Some(d) = deadline {
            next = next.min(d);
        }
        tokio::time::sleep_until(next).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::transport::MockChannel;

    /// An engine whose heals answer from a script (then `Ok(0)`), at the (virtual) times asked.
    struct Healer {
        script: Mutex<Vec<Result<usize, Error>>>,
        asked: Mutex<Vec<Instant>>,
    }

    impl Reopen for Healer {
        fn reopen<'a>(
            self: Arc<Self>,
            _peer: &'a PeerInner,
        ) -> BoxFuture<'a, Result<Arc<dyn Channel>, Error>> {
            unreachable!("the rail watch never reconnects")
        }

        fn heal<'a>(self: Arc<Self>, _peer: &'a PeerInner) -> BoxFuture<'a, Result<usize, Error>> {
            self.asked.lock().unwrap().push(Instant::now());
            let mut script = self.script.lock().unwrap();
            let r = if script.is_empty() {
                Ok(0)
            } else {
                script.remove(0)
            };
            Box::pin(async move { r })
        }
    }

    fn peer(engine: &Arc<Healer>) -> Arc<PeerInner> {
        let mut p = PeerInner::for_test(
            Arc::new(MockChannel::new()),
            Vec::new(),
            Arc::new(RouteCounters::default()),
        );
        p.engine = Arc::downgrade(engine) as Weak<dyn Reopen>;
        Arc::new(p)
    }

    /// The watch asks every poll, backs off after failed heals (doubling, bounded) and polls
    /// again at the normal pace after a success; it ends when the peer is dropped.
    #[tokio::test(start_paused = true)]
    async fn the_rail_watch_polls_backs_off_after_failures_and_ends_with_its_peer() {
        let refused = || Error::NoRoute {
            peer: "127.0.0.1:9".into(),
            reason: "refused".into(),
        };
        let engine = Arc::new(Healer {
            script: Mutex::new(vec![Ok(0), Err(refused()), Err(refused()), Ok(1)]),
            asked: Mutex::default(),
        });
        let p = peer(&engine);
        let watch = watch_rails(&p);
        while engine.asked.lock().unwrap().len() < 6 {
            tokio::time::sleep(HEAL_POLL).await;
        }
        let asked = engine.asked.lock().unwrap().clone();
        let gaps: Vec<Duration> = asked.windows(2).map(|w| w[1] - w[0]).collect();
        // ok(0) -> poll; refused -> 400 ms; refused -> 800 ms; healed -> poll; nothing -> poll.
        assert_eq!(
            gaps[..5],
            [
                HEAL_POLL,
                HEAL_POLL * 2,
                HEAL_POLL * 4,
                HEAL_POLL,
                HEAL_POLL
            ],
            "{gaps:?}"
        );
        drop(p);
        watch.await.expect("the watch ended cleanly");
    }

    /// A channel whose peer is frozen: what it is given resolves only once it is closed (each
    /// op then lost, as a transport fails what was in flight on a stream shut down), and the
    /// WRITEs were posted (their bytes may have landed).
    #[derive(Debug, Default)]
    struct Frozen {
        closed: Arc<tokio::sync::Notify>,
        closes: std::sync::atomic::AtomicUsize,
    }

    impl Channel for Frozen {
        fn kind(&self) -> ferry_core::TransportKind {
            ferry_core::TransportKind::Tcp
        }

        fn execute(
            &self,
            ops: Arc<[Op]>,
            control: Arc<RequestControl>,
        ) -> BoxFuture<'static, Outcome> {
            control.with_ledger(|l| {
                for i in 0..ops.len() {
                    l.plan(i, 1);
                    l.posted(i);
                }
            });
            let closed = self.closed.clone();
            Box::pin(async move {
                closed.notified().await;
                control.with_ledger(|l| {
                    for i in 0..ops.len() {
                        l.lost(i, FailureKind::PeerLost, None);
                    }
                });
                control.outcome(true)
            })
        }

        fn is_alive(&self) -> bool {
            self.closes.load(Ordering::Acquire) == 0
        }

        fn close(&self) {
            self.closes.fetch_add(1, Ordering::AcqRel);
            self.closed.notify_one();
        }
    }

    fn writes(n: usize) -> Vec<Op> {
        let region = Arc::new(ferry_core::MemoryRegion::from_vec(vec![0; 64]));
        (0..n)
            .map(|i| Op {
                kind: ferry_core::OpKind::Write,
                local: region.clone(),
                local_offset: 0,
                token: ferry_core::SegmentToken(1),
                remote_offset: i as u64 * 8,
                len: 8,
            })
            .collect()
    }

    /// A frozen peer holds a request past its deadline only for the grace: the channel is
    /// closed then, the request drains, and it ends as a `Timeout` whose WRITEs may have
    /// landed, not as the `PeerLost` of the close.
    #[tokio::test(start_paused = true)]
    async fn a_frozen_peer_is_closed_under_a_request_at_its_deadline_plus_the_grace() {
        let frozen = Arc::new(Frozen::default());
        let p = Arc::new(PeerInner::for_test(
            frozen.clone(),
            Vec::new(),
            Arc::new(RouteCounters::default()),
        ));
        let ops = writes(3);
        let control = Arc::new(RequestControl::new(&ops));
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_secs(5);
        let o = tokio::time::timeout(
            Duration::from_secs(60),
            run(p, ops.into(), control, Some(deadline)),
        )
        .await
        .expect("the frozen peer held the request past its deadline");
        assert_eq!(t0.elapsed(), Duration::from_secs(5) + QUIESCE_GRACE);
        assert_eq!(frozen.closes.load(Ordering::Acquire), 1);
        assert!(o.drained);
        assert_eq!(o.completed_ops, 0);
        assert_eq!(o.failure.map(|f| f.kind), Some(FailureKind::Timeout));
        assert_eq!(o.remote_effect, ferry_core::RemoteEffect::Uncertain);
    }

    /// A cancel of a request without a deadline is seen within the poll, and the frozen
    /// channel is closed after the grace: the request ends `Cancelled` and drained.
    #[tokio::test(start_paused = true)]
    async fn a_cancelled_request_on_a_frozen_peer_ends_after_the_grace() {
        let frozen = Arc::new(Frozen::default());
        let p = Arc::new(PeerInner::for_test(
            frozen.clone(),
            Vec::new(),
            Arc::new(RouteCounters::default()),
        ));
        let ops = writes(2);
        let control = Arc::new(RequestControl::new(&ops));
        let c = control.clone();
        let t0 = Instant::now();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            c.stop(FailureKind::Cancelled);
        });
        let o = tokio::time::timeout(Duration::from_secs(60), run(p, ops.into(), control, None))
            .await
            .expect("the frozen peer held the cancelled request");
        assert!(t0.elapsed() <= Duration::from_secs(1) + STOP_POLL + QUIESCE_GRACE);
        assert_eq!(frozen.closes.load(Ordering::Acquire), 1);
        assert!(o.drained);
        assert_eq!(o.failure.map(|f| f.kind), Some(FailureKind::Cancelled));
    }

    /// A request that ends within the grace after its deadline keeps its channel.
    #[tokio::test(start_paused = true)]
    async fn a_request_that_resolves_within_the_grace_keeps_its_channel() {
        let frozen = Arc::new(Frozen::default());
        let p = Arc::new(PeerInner::for_test(
            frozen.clone(),
            Vec::new(),
            Arc::new(RouteCounters::default()),
        ));
        let ops = writes(1);
        let control = Arc::new(RequestControl::new(&ops));
        let wake = frozen.closed.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2) + QUIESCE_GRACE / 2).await;
            wake.notify_one();
        });
        let o = run(
            p,
            ops.into(),
            control,
            Some(Instant::now() + Duration::from_secs(2)),
        )
        .await;
        assert_eq!(frozen.closes.load(Ordering::Acquire), 0);
        assert!(o.drained);
    }

    /// A closed peer is watched no more, though it is still held.
    #[tokio::test(start_paused = true)]
    async fn the_rail_watch_ends_when_its_peer_is_closed() {
        let engine = Arc::new(Healer {
            script: Mutex::default(),
            asked: Mutex::default(),
        });
        let p = peer(&engine);
        let watch = watch_rails(&p);
        while engine.asked.lock().unwrap().is_empty() {
            tokio::time::sleep(HEAL_POLL).await;
        }
        p.closed.store(true, Ordering::Release);
        watch.await.expect("the watch ended cleanly");
        let asked = engine.asked.lock().unwrap().len();
        assert!(Arc::strong_count(&p) == 1);
        tokio::time::sleep(HEAL_POLL * 10).await;
        assert_eq!(engine.asked.lock().unwrap().len(), asked);
    }
}

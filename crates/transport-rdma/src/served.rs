//! The queue pairs this side serves, one set per peer incarnation: which to keep, which to
//! replace, which to release. No I/O of its own: the queue pairs are anything that can be
//! [`Probe`]d (the real ones post a zero-length RDMA WRITE; tests use fakes), and time is passed
//! in.
//!
//! Rules:
//! - A set belongs to one incarnation `(peer id, epoch)`. An offer from an incarnation that holds
//!   a set puts its queue pairs in that set (a heal, or a reconnect): it never adds a set. Per
//!   rail of the peer, a set keeps at most [`ServedLimits::per_rail`] queue pairs (one per
//!   channel the incarnation holds); past it the rail's dead queue pair goes first, then its
//!   unproven one, then its oldest: the other rails are never touched.
//! - A set is released when its incarnation is gone: once a newer epoch of the same peer id
//!   (and key name) has a set that is proven (a probe of it answered), the older epochs' sets
//!   are released at the next [`sweep`](ServedTable::sweep) and their offers refused as stale;
//!   and a queue pair whose probe fails or stays unanswered past [`ServedLimits::dead_after`]
//!   is released at the next sweep (its set with it once it holds none). An offer naming a
//!   newer epoch releases nothing by itself: peer ids are public, and without keys (or under
//!   one fleet key) anyone may claim another's id with a later epoch; only a peer that connects
//!   the queue pairs offered to it proves the newer start.
//! - Admitting a new set past a limit releases what is not a proven channel: dead sets first
//!   (the sweep's work), then idle ones (not proven for a while), and past the total the
//!   unproven sets (never answered a probe yet) of whichever name (or the unauthenticated
//!   peers, as one) holds the most. A proven set is never released to make room, nor a set of
//!   the name asking (its own unproven sets included): the newcomer is refused instead.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ferry_core::{Epoch, PeerId};

/// A peer incarnation: who and which start of it.
pub(crate) type Incarnation = (PeerId, Epoch);

/// What the table asks of a served queue pair.
pub(crate) trait Probe: Send {
    /// Posts one probe (the real queue pair: a signalled zero-length RDMA WRITE, which the
    /// peer's queue pair acknowledges while it exists). `false`: it could not be posted.
    fn post_probe(&self) -> bool;
    /// The outstanding probe's answer: `Some(true)` acknowledged, `Some(false)` failed (the queue
    /// pair is in the error state), `None` not yet.
    fn probe_answer(&self) -> Option<bool>;
}

/// The limits on served sets (see [`RdmaConfig::max_served`](crate::RdmaConfig::max_served)
/// and the per-name ones).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ServedLimits {
    /// Sets kept in all.
    pub(crate) total: usize,
    /// Sets kept per authenticated key name.
    pub(crate) per_name: usize,
    /// Queue pairs kept per authenticated key name, over all its sets.
    pub(crate) qps_per_name: usize,
    /// Queue pairs kept per rail of one incarnation's set.
    pub(crate) per_rail: usize,
    /// How often a queue pair is probed.
    pub(crate) probe_every: Duration,
    /// A probe unanswered this long counts as failed (the dead-peer timeout).
    pub(crate) dead_after: Duration,
}

/// How a queue pair (or a set) stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Health {
    /// Its probe failed or went unanswered: released at the next sweep.
    Dead,
    /// Proven once, but not lately (its probes could not be posted).
    Idle,
    /// Never proven yet: the peer may still be connecting, or never will (a forged offer).
    Unproven,
    /// Its probe was answered lately: a channel uses it.
    Proven,
}

/// Why an offer got no queue pairs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The key name holds its limit of proven or unproven sets (or queue pairs).
    NameFull { sets: usize, qps: usize },
    /// Every set is proven, or unproven and of a name holding fewer than the most.
    Full { sets: usize },
    /// A newer epoch of the same peer id holds a proven set: this offer is from a start that is
    /// gone.
    Stale { newer: Epoch },
}

/// What an admitted offer did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Admitted {
    /// A new set for a new incarnation.
    NewSet,
    /// Queue pairs added to (or replacing ones in) the incarnation's set.
    Joined,
}

struct Entry<Q> {
    /// The peer's rail index the queue pair serves.
    rail: u16,
    qp: Q,
    born: Instant,
    proven: Option<Instant>,
    probing: Option<Instant>,
    dead: bool,
}

impl<Q> Entry<Q> {
    fn health(&self, now: Instant, limits: &ServedLimits) -> Health {
        if self.dead {
            return Health::Dead;
        }
        match self.proven {
            None => Health::Unproven,
            Some(at)
                if now.saturating_duration_since(at) <= limits.probe_every + limits.dead_after =>
            {
                Health::Proven
            }
            Some(_) => Health::Idle,
        }
    }
}

struct Set<Q> {
    peer: Incarnation,
    /// The key name the peer proved, if any: what the set is charged to.
    name: Option<String>,
    qps: Vec<Entry<Q>>,
}

impl<Q> Set<Q> {
    /// Whether a probe of one of its (live) queue pairs was ever answered: its incarnation
    /// connected them.
    fn proven_once(&self) -> bool {
        self.qps.iter().any(|e| !e.dead && e.proven.is_some())
    }

    /// The best health of its queue pairs (a set with one proven rail is a live channel).
    fn health(&self, now: Instant, limits: &ServedLimits) -> Health {
        self.qps
            .iter()
            .map(|e| e.health(now, limits))
            .max()
            .unwrap_or(Health::Dead)
    }
}

/// The served sets, oldest first.
pub(crate) struct ServedTable<Q> {
    sets: VecDeque<Set<Q>>,
    limits: ServedLimits,
}

impl<Q: Probe> ServedTable<Q> {
    pub(crate) fn new(limits: ServedLimits) -> Self {
        Self {
            sets: VecDeque::new(),
            limits,
        }
    }

    /// Sets held now.
    pub(crate) fn sets(&self) -> usize {
        self.sets.len()
    }

    /// Queue pairs held now.
    pub(crate) fn qps(&self) -> usize {
        self.sets.iter().map(|s| s.qps.len()).sum()
    }

    /// The health of `peer`'s set, if it holds one.
    #[cfg(test)]
    pub(crate) fn health_of(&self, peer: Incarnation, now: Instant) -> Option<Health> {
        self.sets
            .iter()
            .find(|s| s.peer == peer)
            .map(|s| s.health(now, &self.limits))
    }

    /// Takes `qps` (each serving the peer's rail it names) for incarnation `peer` proven under
    /// `name`. On a refusal the queue pairs are dropped (destroyed) before this returns.
    pub(crate) fn admit(
        &mut self,
        peer: Incarnation,
        name: Option<&str>,
        qps: Vec<(u16, Q)>,
        now: Instant,
    ) -> Result<Admitted, Refused> {
        // A newer start of the same peer, proven: this start is gone. An unproven one may be
        // anyone's claim; the older start keeps its set and its heals until the newer proves.
        if let Some(newer) = self
            .sets
            .iter()
            .filter(|s| {
                s.peer.0 == peer.0
                    && s.name.as_deref() == name
                    && s.peer.1 > peer.1
                    && s.proven_once()
            })
            .map(|s| s.peer.1)
            .max()
        {
            return Err(Refused::Stale { newer });
        }
        let entries = qps.into_iter().map(|(rail, qp)| Entry {
            rail,
            qp,
            born: now,
            proven: None,
            probing: None,
            dead: false,
        });
        // The incarnation's set under the same name: another name claiming the incarnation (peer
        // ids are not secret) gets a set of its own, charged to it, and touches nothing of this.
        if let Some(i) = self
            .sets
            .iter()
            .position(|s| s.peer == peer && s.name.as_deref() == name)
        {
            let limits = self.limits;
            let set = &mut self.sets[i];
            for e in entries {
                replace_in_rail(set, e, now, &limits);
            }
            return Ok(Admitted::Joined);
        }
        let entries: Vec<Entry<Q>> = entries.collect();
        self.make_room(name, entries.len(), now)?;
        self.sets.push_back(Set {
            peer,
            name: name.map(str::to_owned),
            qps: entries,
        });
        Ok(Admitted::NewSet)
    }

    /// Releases every set of `peer` (all its epochs when `epoch` is `None`). How many went.
    pub(crate) fn release(&mut self, peer: PeerId, epoch: Option<Epoch>) -> usize {
        let before = self.sets.len();
        self.sets
            .retain(|s| !(s.peer.0 == peer && epoch.is_none_or(|e| e == s.peer.1)));
        before - self.sets.len()
    }

    /// Reads the answers to outstanding probes, posts the probes that are due, and releases
    /// the dead queue pairs (and the sets left with none). Returns (queue pairs, sets) released.
    pub(crate) fn sweep(&mut self, now: Instant) -> (usize, usize) {
        let limits = self.limits;
        let mut qps = 0;
        for set in &mut self.sets {
            for e in &mut set.qps {
                probe_step(e, now, &limits);
            }
            let before = set.qps.len();
            set.qps.retain(|e| !e.dead);
            qps += before - set.qps.len();
        }
        let before = self.sets.len();
        self.sets.retain(|s| !s.qps.is_empty());
        // A newer start proven: the older starts of the same peer id (and name) are gone.
        let proven: Vec<(PeerId, Option<String>, Epoch)> = self
            .sets
            .iter()
            .filter(|s| s.proven_once())
            .map(|s| (s.peer.0, s.name.clone(), s.peer.1))
            .collect();
        self.sets.retain(|s| {
            let superseded = proven
                .iter()
                .any(|(id, name, epoch)| *id == s.peer.0 && *name == s.name && *epoch > s.peer.1);
            if superseded {
                qps += s.qps.len();
            }
            !superseded
        });
        (qps, before - self.sets.len())
    }

    /// Releases what must go before a new set of `qps` queue pairs charged to `name` joins, or
    /// refuses it (see the module's rules).
    fn make_room(&mut self, name: Option<&str>, qps: usize, now: Instant) -> Result<(), Refused> {
        let limits = self.limits;
        // Dead sets go first, whoever they are charged to.
        self.sets.retain(|s| s.health(now, &limits) != Health::Dead);
        if name.is_some() {
            loop {
                let (sets, held) = self
                    .sets
                    .iter()
                    .filter(|s| s.name.as_deref() == name)
                    .fold((0, 0), |(n, q), s| (n + 1, q + s.qps.len()));
                if sets < limits.per_name.max(1) && held + qps <= limits.qps_per_name {
                    break;
                }
                // The name's own idle sets, oldest first; never its proven or unproven ones.
                let idle = self.sets.iter().position(|s| {
                    s.name.as_deref() == name && s.health(now, &limits) == Health::Idle
                });
                match idle {
                    Some(i) => drop(self.sets.remove(i)),
                    None => return Err(Refused::NameFull { sets, qps: held }),
                }
            }
        }
        while self.sets.len() >= limits.total.max(1) {
            if let Some(i) = self
                .sets
                .iter()
                .position(|s| s.health(now, &limits) == Health::Idle)
            {
                drop(self.sets.remove(i));
                continue;
            }
            // The oldest unproven set of whichever name (or the unauthenticated peers) holds the
            // most sets among those that may give way: never the asking name's own (the
            // unauthenticated peers do push one another out).
            let held =
                |n: Option<&str>| self.sets.iter().filter(|s| s.name.as_deref() == n).count();
            let eligible = |s: &Set<Q>| {
                s.health(now, &limits) == Health::Unproven
                    && (name.is_none() || s.name.as_deref() != name)
            };
            let most = self
                .sets
                .iter()
                .filter(|s| eligible(s))
                .map(|s| held(s.name.as_deref()))
                .max();
            let victim = most.and_then(|most| {
                self.sets
                    .iter()
                    .position(|s| eligible(s) && held(s.name.as_deref()) == most)
            });
            match victim {
                Some(i) => drop(self.sets.remove(i)),
                None => {
                    return Err(Refused::Full {
                        sets: self.sets.len(),
                    });
                }
            }
        }
        Ok(())
    }
}

/// Puts `e` in its set, first releasing the queue pair of its rail that goes when the rail
/// holds its limit: the dead one, else the unproven or idle one, else the oldest.
fn replace_in_rail<Q>(set: &mut Set<Q>, e: Entry<Q>, now: Instant, limits: &ServedLimits) {
    let same: Vec<usize> = (0..set.qps.len())
        .filter(|&i| set.qps[i].rail == e.rail)
        .collect();
    if same.len() >= limits.per_rail.max(1) {
        // Lowest health first; among equals the oldest (lowest index).
        if let Some(&i) = same
            .iter()
            .min_by_key(|&&i| (set.qps[i].health(now, limits), set.qps[i].born))
        {
            set.qps.remove(i);
        }
    }
    set.qps.push(e);
}

/// One step of a queue pair's probing: read the answer, or declare it dead past the timeout,
/// or post the next probe when one is due.
fn probe_step<Q: Probe>(e: &mut Entry<Q>, now: Instant, limits: &ServedLimits) {
    if e.dead {
        return;
    }
    if let Some(since) = e.probing {
        match e.qp.probe_answer() {
            Some(true) => {
                e.proven = Some(now);
                e.probing = None;
            }
            Some(false) => e.dead = true,
            None if now.saturating_duration_since(since) >= limits.dead_after => e.dead = true,
            None => {}
        }
        return;
    }
    let last = e.proven.unwrap_or(e.born);
    if now.saturating_duration_since(last) >= limits.probe_every && e.qp.post_probe() {
        e.probing = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::*;

    /// A queue pair whose peer is there (`alive`) or gone; `destroyed` is set when the table
    /// drops it.
    struct FakeQp {
        alive: Arc<AtomicBool>,
        destroyed: Arc<AtomicBool>,
        posted: AtomicBool,
        drops: Arc<AtomicUsize>,
    }

    impl Probe for FakeQp {
        fn post_probe(&self) -> bool {
            self.posted.store(true, Ordering::Relaxed);
            true
        }
        fn probe_answer(&self) -> Option<bool> {
            self.posted
                .swap(false, Ordering::Relaxed)
                .then(|| self.alive.load(Ordering::Relaxed))
        }
    }

    impl Drop for FakeQp {
        fn drop(&mut self) {
            self.destroyed.store(true, Ordering::Relaxed);
            self.drops.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The peer's side of one fake queue pair: whether its peer is alive, whether the table
    /// destroyed it.
    #[derive(Clone)]
    struct Handle {
        alive: Arc<AtomicBool>,
        destroyed: Arc<AtomicBool>,
    }

    impl Handle {
        fn destroyed(&self) -> bool {
            self.destroyed.load(Ordering::Relaxed)
        }
        fn peer_gone(&self) {
            self.alive.store(false, Ordering::Relaxed);
        }
    }

    #[derive(Default)]
    struct Fakes {
        drops: Arc<AtomicUsize>,
    }

    impl Fakes {
        fn qp(&self) -> (FakeQp, Handle) {
            let h = Handle {
                alive: Arc::new(AtomicBool::new(true)),
                destroyed: Arc::new(AtomicBool::new(false)),
            };
            let qp = FakeQp {
                alive: h.alive.clone(),
                destroyed: h.destroyed.clone(),
                posted: AtomicBool::new(false),
                drops: self.drops.clone(),
            };
            (qp, h)
        }

        /// Queue pairs for the peer's `rails`, and their handles.
        fn rails(&self, rails: &[u16]) -> (Vec<(u16, FakeQp)>, Vec<Handle>) {
            rails
                .iter()
                .map(|&r| {
                    let (qp, h) = self.qp();
                    ((r, qp), h)
                })
                .unzip()
        }
    }

    const LIMITS: ServedLimits = ServedLimits {
        total: 256,
        per_name: 32,
        qps_per_name: 128,
        per_rail: 4,
        probe_every: Duration::from_secs(5),
        dead_after: Duration::from_secs(10),
    };

    fn inc(n: u128) -> Incarnation {
        (PeerId(n), Epoch(1))
    }

    /// Sweeps twice, `probe_every` apart, from `at`: due probes are posted, then answered.
    /// Returns the clock after.
    fn prove(t: &mut ServedTable<FakeQp>, at: Instant) -> Instant {
        let later = at + LIMITS.probe_every;
        t.sweep(later);
        let after = later + Duration::from_millis(1);
        t.sweep(after);
        after
    }

    /// 40 heals of one rail of one channel: each adds no set, each replaces the rail's failed
    /// queue pair (released once its probe fails), and the channel's other rails stay up.
    #[test]
    fn forty_heals_of_one_channel_keep_its_other_rails_up() {
        let fakes = Fakes::default();
        let mut t = ServedTable::new(LIMITS);
        let now = Instant::now();
        let (qps, handles) = fakes.rails(&[0, 1, 2]);
        assert_eq!(
            t.admit(inc(1), Some("fleet"), qps, now),
            Ok(Admitted::NewSet)
        );
        let mut now = prove(&mut t, now);
        let mut failed = handles[1].clone();
        for _ in 0..40 {
            // The peer tears its failed rail down; the server's probe fails at the next sweep.
            failed.peer_gone();
            now = prove(&mut t, now);
            assert!(
                failed.destroyed(),
                "the failed rail's queue pair is released"
            );
            let (qp, h) = fakes.qp();
            assert_eq!(
                t.admit(inc(1), Some("fleet"), vec![(1, qp)], now),
                Ok(Admitted::Joined)
            );
            failed = h;
            now = prove(&mut t, now);
        }
        assert_eq!((t.sets(), t.qps()), (1, 3));
        assert!(!handles[0].destroyed() && !handles[2].destroyed());
        assert_eq!(t.health_of(inc(1), now), Some(Health::Proven));
        assert_eq!(fakes.drops.load(Ordering::Relaxed), 40);
    }

    /// Heals arriving faster than the probes can tell the replaced queue pair is dead: the
    /// rail keeps at most `per_rail` (the oldest goes), the other rails and the set count stay.
    #[test]
    fn heals_faster_than_the_probes_stay_within_the_rail() {
        let fakes = Fakes::default();
        let mut t = ServedTable::new(LIMITS);
        let now = Instant::now();
        let (qps, handles) = fakes.rails(&[0, 1]);
        t.admit(inc(1), None, qps, now).expect("admitted");
        let now = prove(&mut t, now);
        let mut heals = Vec::new();
        for _ in 0..40 {
            let (qp, h) = fakes.qp();
            assert_eq!(
                t.admit(inc(1), None, vec![(1, qp)], now),
                Ok(Admitted::Joined)
            );
            heals.push(h);
        }
        assert_eq!((t.sets(), t.qps()), (1, 1 + LIMITS.per_rail));
        // The original rail 1 was proven, the heals were not: the oldest unproven heal goes
        // each time, so the proven queue pair (perhaps another channel's) and the newest heals
        // are kept, and rail 0 is never touched.
        assert!(!handles[0].destroyed() && !handles[1].destroyed());
        assert!(
            heals
                .iter()
                .rev()
                .take(LIMITS.per_rail - 1)
                .all(|h| !h.destroyed())
        );
        assert_eq!(
            fakes.drops.load(Ordering::Relaxed),
            40 + 1 - LIMITS.per_rail
        );
    }

    /// 300 peers under one key name against a cap of 32: the 32 admitted channels are never torn
    /// down (the rest are refused), and once some of them are gone, newcomers take their place.
    #[test]
    fn three_hundred_peers_under_one_key_never_tear_down_a_live_channel() {
        let fakes = Fakes::default();
        let mut t = ServedTable::new(LIMITS);
        let mut now = Instant::now();
        let mut live = Vec::new();
        let mut refused = 0;
        for n in 0..300u128 {
            let (qps, handles) = fakes.rails(&[0, 1]);
            match t.admit(inc(n), Some("fleet"), qps, now) {
                Ok(Admitted::NewSet) => live.push((n, handles)),
                Ok(other) => panic!("{other:?}"),
                Err(Refused::NameFull { sets, .. }) => {
                    assert_eq!(sets, LIMITS.per_name);
                    refused += 1;
                }
                Err(e) => panic!("{e:?}"),
            }
            if n % 10 == 0 {
                now = prove(&mut t, now);
            }
        }
        assert_eq!(
            (live.len(), refused),
            (LIMITS.per_name, 300 - LIMITS.per_name)
        );
        assert!(live.iter().flat_map(|(_, h)| h).all(|h| !h.destroyed()));
        // Five of them close (their queue pairs are gone): their sets are released and five
        // newcomers get in, still without touching the others.
        for (_, hs) in &live[..5] {
            hs.iter().for_each(Handle::peer_gone);
        }
        now = prove(&mut t, now);
        assert!(live[..5].iter().flat_map(|(_, h)| h).all(Handle::destroyed));
        for n in 1000..1005u128 {
            let (qps, _) = fakes.rails(&[0, 1]);
            assert_eq!(
                t.admit(inc(n), Some("fleet"), qps, now),
                Ok(Admitted::NewSet)
            );
        }
        assert!(
            live[5..]
                .iter()
                .flat_map(|(_, h)| h)
                .all(|h| !h.destroyed())
        );
        assert_eq!(t.sets(), LIMITS.per_name);
    }

    /// Past the total, a flood of unproven unauthenticated sets gives way to a key holder, and
    /// proven channels stay; when every set is proven, the newcomer is refused.
    #[test]
    fn past_the_total_only_the_largest_groups_unproven_sets_give_way() {
        let limits = ServedLimits { total: 8, ..LIMITS };
        let fakes = Fakes::default();
        let mut t = ServedTable::new(limits);
        let now = Instant::now();
        let (qps, bob) = fakes.rails(&[0]);
        t.admit(inc(1), Some("bob"), qps, now).expect("bob");
        let now = prove(&mut t, now);
        let mut flood = Vec::new();
        for n in 100..120u128 {
            let (qps, h) = fakes.rails(&[0]);
            t.admit(inc(n), None, qps, now)
                .expect("the flood pushes itself out");
            flood.extend(h);
        }
        let (qps, carol) = fakes.rails(&[0]);
        assert_eq!(
            t.admit(inc(2), Some("carol"), qps, now),
            Ok(Admitted::NewSet)
        );
        assert!(!bob[0].destroyed() && !carol[0].destroyed());
        assert_eq!(t.sets(), limits.total);
        // A name holding the most sets (proven) still gets room from the unauthenticated
        // peers' unproven ones, never from its own.
        let mut t2 = ServedTable::new(ServedLimits { total: 6, ..LIMITS });
        let mut carols = Vec::new();
        for n in 0..4u128 {
            let (qps, h) = fakes.rails(&[0]);
            t2.admit(inc(200 + n), Some("carol"), qps, now)
                .expect("carol");
            carols.extend(h);
        }
        let later = prove(&mut t2, now);
        for n in 0..2u128 {
            let (qps, _) = fakes.rails(&[0]);
            t2.admit(inc(300 + n), None, qps, later)
                .expect("a stranger");
        }
        let (qps, _) = fakes.rails(&[0]);
        assert_eq!(
            t2.admit(inc(250), Some("carol"), qps, later),
            Ok(Admitted::NewSet)
        );
        assert!(carols.iter().all(|h| !h.destroyed()));
        // Every set proven: nothing gives way.
        let now = prove(&mut t, now);
        let (qps, dave) = fakes.rails(&[0]);
        assert!(matches!(
            t.admit(inc(3), Some("dave"), qps, now),
            Err(Refused::Full { sets: 8 })
        ));
        assert!(
            dave[0].destroyed(),
            "a refused offer's queue pairs are released"
        );
        assert!(!bob[0].destroyed() && !carol[0].destroyed());
    }

    /// A newer epoch of the same peer releases the older epoch's set once the newer set is
    /// proven; an offer from the older one afterwards is stale. Another name's peer with the
    /// same id touches nothing.
    #[test]
    fn a_new_epoch_releases_the_old_incarnation() {
        let fakes = Fakes::default();
        let mut t = ServedTable::new(LIMITS);
        let now = Instant::now();
        let id = PeerId(7);
        let (qps, old) = fakes.rails(&[0, 1]);
        t.admit((id, Epoch(10)), Some("bob"), qps, now)
            .expect("old");
        let (qps, other) = fakes.rails(&[0]);
        t.admit((id, Epoch(11)), Some("eve"), qps, now)
            .expect("eve");
        let now = prove(&mut t, now);
        assert!(
            old.iter().all(|h| !h.destroyed()),
            "another name cannot release bob's"
        );
        let (qps, new) = fakes.rails(&[0, 1]);
        assert_eq!(
            t.admit((id, Epoch(12)), Some("bob"), qps, now),
            Ok(Admitted::NewSet)
        );
        assert!(
            old.iter().all(|h| !h.destroyed()),
            "not before it is proven"
        );
        let now = prove(&mut t, now);
        assert!(old.iter().all(Handle::destroyed));
        let (qps, _) = fakes.rails(&[0]);
        assert_eq!(
            t.admit((id, Epoch(10)), Some("bob"), qps, now),
            Err(Refused::Stale { newer: Epoch(12) })
        );
        assert!(new.iter().chain(&other).all(|h| !h.destroyed()));
        // Eve claiming bob's incarnation gets a set of her own (her older epoch's goes once it
        // is proven): bob's rails are untouched even past the per-rail bound.
        for _ in 0..2 * LIMITS.per_rail {
            let (qps, _) = fakes.rails(&[0]);
            t.admit((id, Epoch(12)), Some("eve"), qps, now)
                .expect("eve's own set");
        }
        prove(&mut t, now);
        assert!(new.iter().all(|h| !h.destroyed()) && other[0].destroyed());
        assert_eq!(t.release(id, Some(Epoch(12))), 2, "bob's and eve's");
        assert!(new.iter().all(Handle::destroyed));
    }

    /// Keyless (or under one fleet key) anyone may send a hello naming a victim's public peer
    /// id with a later epoch. Its offer releases none of the victim's proven queue pairs, nor
    /// makes the victim's heals stale; when its queue pairs are never connected (its probes
    /// fail or stay unanswered) it is released and the victim's set stays. A real restart
    /// that proves its set then releases the old one.
    #[test]
    fn a_claimed_later_epoch_releases_nothing_until_its_set_is_proven() {
        for name in [None, Some("fleet")] {
            let fakes = Fakes::default();
            let mut t = ServedTable::new(LIMITS);
            let now = Instant::now();
            let id = PeerId(7);
            let (qps, victim) = fakes.rails(&[0, 1]);
            t.admit((id, Epoch(10)), name, qps, now).expect("victim");
            let now = prove(&mut t, now);
            assert_eq!(t.health_of((id, Epoch(10)), now), Some(Health::Proven));

            // The forger's offer: admitted (it may be a real restart), releasing nothing.
            let (qps, forged) = fakes.rails(&[0, 1]);
            assert_eq!(
                t.admit((id, Epoch(11)), name, qps, now),
                Ok(Admitted::NewSet)
            );
            assert!(
                victim.iter().all(|h| !h.destroyed()),
                "{name:?}: a claimed later epoch released the victim's proven queue pairs"
            );
            // The victim's heal still joins its own set.
            let (qp, heal) = fakes.qp();
            assert_eq!(
                t.admit((id, Epoch(10)), name, vec![(1, qp)], now),
                Ok(Admitted::Joined),
                "{name:?}"
            );
            // The forger never connects the queue pairs it was offered: its probes fail.
            forged.iter().for_each(Handle::peer_gone);
            let now = prove(&mut t, now);
            assert!(forged.iter().all(Handle::destroyed), "{name:?}");
            assert_eq!(t.health_of((id, Epoch(11)), now), None);
            assert!(
                victim.iter().chain([&heal]).all(|h| !h.destroyed()),
                "{name:?}"
            );
            assert_eq!(t.health_of((id, Epoch(10)), now), Some(Health::Proven));

            // A real restart (it connects its queue pairs): proven, then the old start goes.
            let (qps, restart) = fakes.rails(&[0, 1]);
            t.admit((id, Epoch(12)), name, qps, now).expect("restart");
            let now = prove(&mut t, now);
            assert!(
                victim.iter().chain([&heal]).all(Handle::destroyed),
                "{name:?}"
            );
            assert!(restart.iter().all(|h| !h.destroyed()), "{name:?}");
            assert_eq!((t.sets(), t.qps()), (1, 2), "{name:?}");
            let (qps, _) = fakes.rails(&[0]);
            assert_eq!(
                t.admit((id, Epoch(10)), name, qps, now),
                Err(Refused::Stale { newer: Epoch(12) }),
                "{name:?}"
            );
        }
    }

    /// A probe never answered counts as failed once the dead-peer timeout passed; a set whose
    /// probes cannot be posted turns idle and gives way to its name's newcomer.
    #[test]
    fn the_dead_peer_timeout_and_idle_sets() {
        struct Mute;
        impl Probe for Mute {
            fn post_probe(&self) -> bool {
                true
            }
            fn probe_answer(&self) -> Option<bool> {
                None
            }
        }
        let mut t = ServedTable::new(LIMITS);
        let now = Instant::now();
        t.admit(inc(1), None, vec![(0, Mute)], now)
            .expect("admitted");
        t.sweep(now + LIMITS.probe_every);
        assert_eq!(t.sets(), 1);
        t.sweep(now + LIMITS.probe_every + LIMITS.dead_after);
        assert_eq!(t.sets(), 0, "unanswered past the timeout: released");

        struct Stuck(AtomicBool);
        impl Probe for Stuck {
            fn post_probe(&self) -> bool {
                !self.0.swap(true, Ordering::Relaxed)
            }
            fn probe_answer(&self) -> Option<bool> {
                Some(true)
            }
        }
        let limits = ServedLimits {
            per_name: 1,
            ..LIMITS
        };
        let mut t = ServedTable::new(limits);
        let q = || vec![(0, Stuck(AtomicBool::new(false)))];
        t.admit(inc(1), Some("a"), q(), now).expect("first");
        let now = now + limits.probe_every;
        t.sweep(now);
        t.sweep(now);
        assert_eq!(t.health_of(inc(1), now), Some(Health::Proven));
        assert!(matches!(
            t.admit(inc(2), Some("a"), q(), now),
            Err(Refused::NameFull { .. })
        ));
        // No probe can be posted any more: proven once, idle past the window.
        let later = now + limits.probe_every + limits.dead_after + Duration::from_secs(1);
        t.sweep(later);
        assert_eq!(t.health_of(inc(1), later), Some(Health::Idle));
        assert_eq!(t.admit(inc(2), Some("a"), q(), later), Ok(Admitted::NewSet));
        assert_eq!(t.health_of(inc(1), later), None);
    }
}

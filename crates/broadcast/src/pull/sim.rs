//! A simulated fleet that drives a [`Pull`] on a simulated clock, with no sockets: a source
//! and relays of scripted behaviour (good, dead, silent, corrupting, of another epoch or
//! version, unattachable, leaving the list, finished before it is attached, leaving after it
//! finished), each command answered as the driver would, and
//! the module's contract checked at every step. The proptest in `tests.rs` runs it on random
//! fleets.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashSet};
use std::time::{Duration, Instant};

use super::{Command, Config, Event, Outcome, Pull};
use crate::error::BroadcastError;
use crate::plan::{Member, Role};

/// How a simulated holder behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// Verifies a chunk every `per_chunk` ticks, advertises it, serves it intact.
    Good { per_chunk: u32 },
    /// Advertises everything; every READ from it fails.
    Dead,
    /// Advertises everything; no READ from it ever finishes (until it is given up).
    Silent,
    /// Advertises everything; serves bytes whose hash does not match.
    Corrupt,
    /// Answers progress for another source epoch.
    OtherEpoch,
    /// Answers progress for another version.
    OtherVersion,
    /// Cannot be attached.
    Unattachable,
    /// Good (one chunk a tick), and drops off the list at this tick.
    Leaves { at: u32 },
    /// Its progress poll fails at once.
    PollFails,
    /// Finished before it is attached: its poller answers once (done), and before the
    /// attachment's end comes in (as the driver's may), then never again.
    Finished,
    /// Finished before it is attached (as [`Kind::Finished`]), serves a chunk a tick, and
    /// leaves at tick `at`: its READs from then on never finish (until it is given up), and
    /// the pull learns it left `by` its control connection closing or its list.
    FinishedLeaves { at: u32, by: Leaving },
}

/// How a pull learns that a holder left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Leaving {
    /// Its control connection closes ([`Event::Left`]).
    Link,
    /// The member list no longer names it.
    List,
}

/// The fleet: the source (good, or dying at a tick: every READ from it fails from then and it
/// answers no more), the relays, and the pull's settings.
#[derive(Clone, Debug)]
pub(super) struct Fleet {
    pub(super) chunks: usize,
    pub(super) stripes: usize,
    pub(super) window: usize,
    pub(super) relay: bool,
    pub(super) verify_at_rest: bool,
    /// The source dies at this tick.
    pub(super) source_dies: Option<u32>,
    pub(super) relays: Vec<Kind>,
    /// Chunks the check at rest finds changed (the first check only).
    pub(super) bad_at_rest: Vec<usize>,
}

/// How a simulated pull ended.
#[derive(Debug)]
pub(super) struct Ended {
    pub(super) result: Result<(), BroadcastError>,
    pub(super) pull: Pull,
    /// Ids given up, in order.
    pub(super) given_up: Vec<String>,
    /// Why each was given up, and at which tick, in the same order.
    pub(super) why: Vec<(super::GiveUp, u32)>,
    /// Ticks the pull took.
    pub(super) ticks: u32,
    /// Fetches asked, per holder id.
    pub(super) fetches: BTreeMap<String, u64>,
}

pub(super) const TICK: Duration = Duration::from_millis(100);
pub(super) const STALL: Duration = Duration::from_secs(1);
/// Ticks after which a pull is taken for hung.
const LIMIT: u32 = 20_000;
const EPOCH: u64 = 7;
const VERSION: u64 = 3;

pub(super) fn member(id: &str, role: Role, order: u64) -> Member {
    Member {
        id: id.into(),
        epoch: 1,
        source_epoch: EPOCH,
        data_addr: format!("10.0.0.{order}:7000"),
        ctl_addr: String::new(),
        role,
        progress: 0,
        done: false,
        order,
        version: VERSION,
        rate: 0,
        number: None,
        identity: None,
    }
}

impl Fleet {
    pub(super) fn config(&self) -> Config {
        Config {
            name: "w".into(),
            version: VERSION,
            source_epoch: EPOCH,
            me: "me".into(),
            chunk_lens: vec![1000; self.chunks],
            stripes: if self.relay { self.stripes.max(1) } else { 1 },
            window: self.window,
            relay: self.relay,
            straggler: 0.0,
            stall_after: STALL,
            heartbeat: TICK,
            verify_at_rest: self.verify_at_rest,
        }
    }

    fn members(&self) -> Vec<Member> {
        let mut v = vec![member("src", Role::Source, 0)];
        for i in 0..self.relays.len() {
            v.push(member(&format!("r{i}"), Role::Receiver, i as u64 + 1));
        }
        v.push(member("me", Role::Receiver, 1000));
        v
    }

    fn kind(&self, id: &str) -> Option<Kind> {
        let i: usize = id.strip_prefix('r')?.parse().ok()?;
        self.relays.get(i).copied()
    }

    /// Chunks relay `k` verified by tick `t` (a prefix).
    fn prefix(&self, k: Kind, t: u32) -> u64 {
        let n = self.chunks as u64;
        match k {
            Kind::Good { per_chunk } => n.min(u64::from(t / per_chunk.max(1))),
            Kind::Leaves { .. } => n.min(u64::from(t)),
            _ => n,
        }
    }

    /// Runs the pull to its end, checking the contract at every command; panics where a rule
    /// is broken.
    pub(super) fn run(&self) -> Ended {
        Sim::new(self).run()
    }
}

/// What finishes later.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Later {
    Fetch {
        chunk: usize,
        holder: String,
        generation: u64,
    },
}

struct Sim<'a> {
    fleet: &'a Fleet,
    pull: Pull,
    t0: Instant,
    tick: u32,
    /// Fetches to finish: `(tick, seq)`.
    queue: BinaryHeap<Reverse<(u32, u64, Later)>>,
    seq: u64,
    /// Attached holders, by id: their generation as the pull reports it (counted here too).
    attached: BTreeMap<String, u64>,
    generations: u64,
    given_up: Vec<String>,
    why: Vec<(super::GiveUp, u32)>,
    /// What each holder advertised to the pull: `(prefix, done)`.
    advertised: BTreeMap<String, (u64, bool)>,
    /// Fetches asked and not answered, per holder: the window's count.
    out: u64,
    checked: bool,
    fetches: BTreeMap<String, u64>,
    left: HashSet<String>,
    /// Members whose attachment failed.
    refused: HashSet<String>,
}

impl<'a> Sim<'a> {
    fn new(fleet: &'a Fleet) -> Self {
        let t0 = Instant::now();
        Self {
            fleet,
            pull: Pull::new(fleet.config(), fleet.members(), t0),
            t0,
            tick: 0,
            queue: BinaryHeap::new(),
            seq: 0,
            attached: BTreeMap::new(),
            generations: 0,
            given_up: Vec::new(),
            why: Vec::new(),
            advertised: BTreeMap::new(),
            out: 0,
            checked: false,
            fetches: BTreeMap::new(),
            left: HashSet::new(),
            refused: HashSet::new(),
        }
    }

    fn now(&self) -> Instant {
        self.t0 + TICK * self.tick
    }

    fn source_dead(&self) -> bool {
        self.fleet.source_dies.is_some_and(|t| self.tick >= t)
    }

    fn handle(&mut self, ev: Event) -> Result<(), BroadcastError> {
        let now = self.now();
        self.pull.handle(now, ev)
    }

    fn run(mut self) -> Ended {
        let result = self.run_inner();
        Ended {
            result,
            pull: self.pull,
            given_up: self.given_up,
            why: self.why,
            ticks: self.tick,
            fetches: self.fetches,
        }
    }

    fn run_inner(&mut self) -> Result<(), BroadcastError> {
        loop {
            if self.drain()? {
                assert_eq!(self.out, 0, "done with fetches in flight");
                assert!(self.pull.have().is_done(), "done without every chunk");
                return Ok(());
            }
            assert!(self.tick < LIMIT, "the pull hung: {:?}", self.pull);
            // What finishes now, then the clock.
            let due = matches!(self.queue.peek(), Some(Reverse((t, _, _))) if *t <= self.tick);
            if due {
                let Some(Reverse((
                    _,
                    _,
                    Later::Fetch {
                        chunk,
                        holder,
                        generation,
                    },
                ))) = self.queue.pop()
                else {
                    continue;
                };
                self.finish(chunk, holder, generation)?;
                continue;
            }
            self.tick += 1;
            self.progress()?;
            self.handle(Event::Wake)?;
        }
    }

    /// A fetch from `holder` finishes as its kind has it.
    fn finish(
        &mut self,
        chunk: usize,
        holder: String,
        generation: u64,
    ) -> Result<(), BroadcastError> {
        let from_source = holder == "src";
        let closed = self.given_up.contains(&holder);
        let gone = (from_source && self.source_dead()) || self.left.contains(&holder);
        if gone && !closed {
            // A stopped source, or a holder that left, answers nothing: its READs hang until
            // it is given up.
            self.queue.push(Reverse((
                u32::MAX,
                self.seq,
                Later::Fetch {
                    chunk,
                    holder,
                    generation,
                },
            )));
            return Ok(());
        }
        self.out -= 1;
        let outcome = if closed {
            // Given up: its data path was closed, so what was in flight fails.
            Outcome::ReadFailed("closed".into())
        } else if from_source {
            Outcome::Verified
        } else {
            match self.fleet.kind(&holder) {
                Some(Kind::Dead) => Outcome::ReadFailed("connection reset".into()),
                Some(Kind::Corrupt) => Outcome::Mismatch,
                _ => Outcome::Verified,
            }
        };
        self.handle(Event::Fetched {
            chunk,
            from: holder,
            generation,
            from_source,
            outcome,
        })
    }

    /// Each attached relay's long poll answers (and the member list, when a relay leaves).
    fn progress(&mut self) -> Result<(), BroadcastError> {
        let mut list_changed = false;
        let mut closed = Vec::new();
        for (i, &k) in self.fleet.relays.iter().enumerate() {
            let id = format!("r{i}");
            match k {
                Kind::Leaves { at } if self.tick == at => {
                    self.left.insert(id);
                    list_changed = true;
                }
                Kind::FinishedLeaves { at, by } if self.tick == at => {
                    self.left.insert(id.clone());
                    match by {
                        Leaving::List => list_changed = true,
                        Leaving::Link if self.attached.contains_key(&id) => closed.push(id),
                        Leaving::Link => {}
                    }
                }
                _ => {}
            }
        }
        for id in closed {
            self.handle(Event::Left {
                id,
                reason: "its control connection closed".into(),
            })?;
        }
        if list_changed {
            let list = self
                .fleet
                .members()
                .into_iter()
                .filter(|m| !self.left.contains(&m.id))
                .collect();
            self.handle(Event::Members { list, beat: true })?;
        }
        let ids: Vec<String> = self.attached.keys().cloned().collect();
        for id in ids {
            if id == "src" {
                continue;
            }
            let Some(k) = self.fleet.kind(&id) else {
                continue;
            };
            if matches!(k, Kind::Finished | Kind::FinishedLeaves { .. }) {
                // Its poller said it once, when it was attached.
                continue;
            }
            let prefix = self.fleet.prefix(k, self.tick);
            let done = prefix == self.fleet.chunks as u64;
            let (source_epoch, version) = match k {
                Kind::OtherEpoch => (EPOCH + 1, VERSION),
                Kind::OtherVersion => (EPOCH, VERSION + 1),
                _ => (EPOCH, VERSION),
            };
            if k == Kind::PollFails {
                self.handle(Event::PollFailed {
                    id,
                    reason: "closed".into(),
                })?;
                continue;
            }
            if source_epoch == EPOCH && version == VERSION {
                self.advertised.insert(id.clone(), (prefix, done));
            }
            self.handle(Event::Progress {
                id,
                source_epoch,
                prefix,
                done,
                version,
                count: prefix,
                stripes: Vec::new(),
            })?;
        }
        Ok(())
    }

    /// Carries out the pull's commands as a driver would, checking each. Returns whether the
    /// pull is done.
    fn drain(&mut self) -> Result<bool, BroadcastError> {
        let mut n = 0u32;
        while let Some(cmd) = self.pull.poll(self.now())? {
            n += 1;
            assert!(n < 100_000, "the pull asks without end: {cmd:?}");
            match cmd {
                Command::Done => return Ok(true),
                Command::Attach(m) => {
                    assert!(
                        !self.given_up.contains(&m.id) && !self.refused.contains(&m.id),
                        "{} attached again after it was given up or refused",
                        m.id
                    );
                    assert!(
                        !self.attached.contains_key(&m.id),
                        "{} attached twice",
                        m.id
                    );
                    assert_ne!(m.id, "me", "attached itself");
                    let kind = self.fleet.kind(&m.id);
                    let fails = match kind {
                        Some(Kind::Unattachable) => true,
                        _ => (m.id == "src" && self.source_dead()) || self.left.contains(&m.id),
                    };
                    if fails {
                        self.refused.insert(m.id.clone());
                        self.handle(Event::AttachFailed("refused".into()))?;
                    } else {
                        if matches!(kind, Some(Kind::Finished | Kind::FinishedLeaves { .. })) {
                            // Its poller's one answer, before the attachment's end.
                            let n = self.fleet.chunks as u64;
                            self.advertised.insert(m.id.clone(), (n, true));
                            self.handle(Event::Progress {
                                id: m.id.clone(),
                                source_epoch: EPOCH,
                                prefix: n,
                                done: true,
                                version: VERSION,
                                count: n,
                                stripes: Vec::new(),
                            })?;
                        }
                        self.generations += 1;
                        self.attached.insert(m.id.clone(), self.generations);
                        self.handle(Event::Attached)?;
                    }
                }
                Command::Fetch {
                    chunk,
                    holder,
                    generation,
                } => self.fetch(chunk, holder, generation),
                Command::GiveUp { id, why, .. } => {
                    assert!(!self.given_up.contains(&id), "{id} given up twice");
                    self.why.push((why, self.tick));
                    assert!(
                        self.attached.remove(&id).is_some(),
                        "{id} given up while not attached"
                    );
                    self.given_up.push(id.clone());
                    // Its data path closes: what is in flight from it fails at once.
                    let mut kept = BinaryHeap::new();
                    for Reverse((t, s, l)) in std::mem::take(&mut self.queue) {
                        let Later::Fetch { holder, .. } = &l;
                        if *holder == id {
                            kept.push(Reverse((self.tick, s, l)));
                        } else {
                            kept.push(Reverse((t, s, l)));
                        }
                    }
                    self.queue = kept;
                }
                Command::Detach(id) => {
                    assert!(self.attached.remove(&id).is_some(), "{id} detached twice");
                    self.advertised.remove(&id);
                }
                Command::CheckAtRest => {
                    assert!(!self.checked, "checked at rest twice");
                    assert_eq!(self.out, 0, "checked at rest with fetches in flight");
                    self.checked = true;
                    let bad = self.fleet.bad_at_rest.clone();
                    self.handle(Event::AtRest { bad })?;
                }
                Command::Heartbeat | Command::Publish => {}
            }
        }
        Ok(false)
    }

    fn fetch(&mut self, chunk: usize, holder: String, generation: u64) {
        let g = self.attached.get(&holder);
        assert!(
            g.is_some(),
            "chunk {chunk} fetched from {holder}, not attached"
        );
        assert_eq!(
            g,
            Some(&generation),
            "fetch from {holder} of another attachment"
        );
        assert!(chunk < self.fleet.chunks, "chunk {chunk} out of range");
        assert!(
            !self.pull.have().has(chunk),
            "chunk {chunk} fetched again once verified"
        );
        if holder != "src" {
            let (prefix, done) = self.advertised.get(&holder).copied().unwrap_or((0, false));
            assert!(
                done || (chunk as u64) < prefix,
                "chunk {chunk} fetched from {holder}, which advertised {prefix} (done: {done})"
            );
        }
        self.out += 1;
        // The window, and one re-fetch after a mismatch beside it.
        assert!(
            self.out <= self.fleet.window.max(1) as u64 + 1,
            "{} fetches in flight for a window of {}",
            self.out,
            self.fleet.window
        );
        *self.fetches.entry(holder.clone()).or_default() += 1;
        let silent = self.fleet.kind(&holder) == Some(Kind::Silent)
            || (holder == "src" && self.source_dead());
        let at = if silent { u32::MAX } else { self.tick + 1 };
        self.seq += 1;
        self.queue.push(Reverse((
            at,
            self.seq,
            Later::Fetch {
                chunk,
                holder,
                generation,
            },
        )));
    }
}

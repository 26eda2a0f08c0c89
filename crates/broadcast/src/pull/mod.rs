//! A receiver's decisions, with no I/O: [`Pull`] takes [`Event`]s in (a chunk fetched, a
//! holder's progress, a poll that failed, the member list, the time it asked to be woken at) and hands
//! [`Command`]s out (attach a holder, fetch a chunk from it, give a holder up, check the chunks
//! at rest, heartbeat, publish the progress). The receiver ([`Receiver`](crate::Receiver)) is
//! its driver: it carries the commands out over sockets and feeds back what came of them.
//! Time is passed in (`now`), so the rules run the same under a simulated clock
//! (`pull::sim`, the tests) as under the real one.
//!
//! Contract (what the driver may rely on):
//! - a chunk is fetched only from a holder attached and not given up, that advertised it as
//!   verified (the source holds every chunk), at most [`Config::window`] in flight at a time
//!   (a re-fetch after a mismatch excepted);
//! - a holder is given up at most once per attachment ([`Command::GiveUp`]), and a holder given
//!   up is never attached again in this pull;
//! - a relay that served a chunk whose hash does not match is given up at once; the chunk is
//!   fetched again from the source, three times at most;
//! - a holder of another source epoch or version is given up; the source found at another
//!   epoch ends the pull ([`BroadcastError::SourceRestarted`]);
//! - a holder that left (its control connection closed, [`Event::Left`], or it is no longer
//!   on a list that was read) is given up as soon as that is known, whether or not it is still
//!   a stripe's parent: its fetches in flight fail ([`Command::GiveUp`] closes its data path)
//!   and go to the holders of the plan made again, never waiting [`Config::stall_after`];
//! - what the driver reports of the member being attached before its [`Event::Attached`] (its
//!   poller may answer first: a finished holder answers once, at once) is kept and taken in
//!   when it is attached, never dropped;
//! - [`Command::Done`] comes once every chunk is verified (and, with
//!   [`Config::verify_at_rest`], checked at rest once), with nothing in flight;
//! - [`Pull::next_wake`] names when the pull next needs [`Event::Wake`]: the heartbeat
//!   ([`Config::heartbeat`]), the moment a holder it waits on counts as stalled, a parent gone
//!   from the list (at once), the end of its patience with no holder. A driver that sends
//!   [`Event::Wake`] then (and asks again after every event) misses no deadline, and wakes for
//!   nothing else.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::error::BroadcastError;
use crate::plan::{Have, Member, Role, stripe_holders};

pub(crate) use watch::{Seen, stalled};
use watch::{Watch, watch};

mod watch;

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;

/// What a pull is given when it starts.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    /// The broadcast, for errors.
    pub(crate) name: String,
    /// The version pulled.
    pub(crate) version: u64,
    /// The source epoch every chunk must come from.
    pub(crate) source_epoch: u64,
    /// This member's id (never its own holder).
    pub(crate) me: String,
    /// Each chunk's length, in manifest order.
    pub(crate) chunk_lens: Vec<u64>,
    /// Stripes of the plan (`1`: the chain, or from the source only).
    pub(crate) stripes: usize,
    /// Chunks in flight at most.
    pub(crate) window: usize,
    /// Whether to fetch from other receivers (else from the source only).
    pub(crate) relay: bool,
    /// The straggler threshold of the plan.
    pub(crate) straggler: f64,
    /// How long a holder the pull waits on may send nothing.
    pub(crate) stall_after: Duration,
    /// How often this member's entry is renewed and its progress published
    /// ([`Command::Heartbeat`], [`Command::Publish`]).
    pub(crate) heartbeat: Duration,
    /// Whether every chunk is checked once more at rest before the pull is done.
    pub(crate) verify_at_rest: bool,
}

/// What came of a fetch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Its BLAKE3 matched the manifest's.
    Verified,
    /// It landed, and its BLAKE3 did not match.
    Mismatch,
    /// A READ failed (or could not be submitted).
    ReadFailed(String),
}

/// What the driver tells the pull.
#[derive(Clone, Debug)]
pub(crate) enum Event {
    /// A fetch ([`Command::Fetch`]) finished.
    Fetched {
        chunk: usize,
        from: String,
        /// The holder's attachment the fetch was asked of ([`Command::Fetch::generation`]).
        generation: u64,
        from_source: bool,
        outcome: Outcome,
    },
    /// A fetch could not be started (a pull into files with no landing slot free).
    NotStarted {
        chunk: usize,
        from: String,
        generation: u64,
    },
    /// The member of the last [`Command::Attach`] is attached.
    Attached,
    /// The member of the last [`Command::Attach`] could not be attached.
    AttachFailed(String),
    /// A holder's progress, as its control service answered.
    Progress {
        id: String,
        source_epoch: u64,
        prefix: u64,
        done: bool,
        version: u64,
        count: u64,
        stripes: Vec<u64>,
    },
    /// A holder's control service stopped answering progress.
    PollFailed { id: String, reason: String },
    /// A finished holder's control connection, kept open once it was done, closed: it left
    /// the broadcast (`reason`: how the connection ended).
    Left { id: String, reason: String },
    /// The member list, read at a heartbeat (`beat`) or between them.
    Members { list: Vec<Member>, beat: bool },
    /// The source epoch discovery answered a heartbeat with.
    SourceEpoch(u64),
    /// The time [`Pull::next_wake`] named came (a wake at any other time is harmless).
    Wake,
    /// The check at rest ([`Command::CheckAtRest`]) found these chunks changed.
    AtRest { bad: Vec<usize> },
}

impl Event {
    /// The holder a poller's report is about (`Progress`, `PollFailed`, `Left`).
    fn holder(&self) -> Option<&str> {
        match self {
            Event::Progress { id, .. } | Event::PollFailed { id, .. } | Event::Left { id, .. } => {
                Some(id)
            }
            _ => None,
        }
    }
}

/// What the pull asks of the driver.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Command {
    /// Attach this member as a holder; answer [`Event::Attached`] or
    /// [`Event::AttachFailed`] when the attachment ends. Other events may come meanwhile (the
    /// fetches in flight, the holders' progress, this member's own progress included, the
    /// list, wakes); the pull issues no other command until the answer, and never a second
    /// attachment.
    Attach(Member),
    /// Fetch `chunk` from holder `holder` (attached), reporting `generation` back.
    Fetch {
        chunk: usize,
        holder: String,
        generation: u64,
    },
    /// Give holder `id` up: close its data path (its fetches in flight fail at once) and drop
    /// it. `parent`: it was a stripe's parent.
    GiveUp {
        id: String,
        why: GiveUp,
        parent: bool,
    },
    /// Drop holder `id`, no longer fetched from (not given up: it may be attached again).
    Detach(String),
    /// Check every chunk at rest; answer [`Event::AtRest`].
    CheckAtRest,
    /// Renew this member's entry with the pull's progress.
    Heartbeat,
    /// Publish the pull's progress (the snapshot, then the advertisement).
    Publish,
    /// Every chunk is verified: the pull is complete.
    Done,
}

/// Why a holder was given up.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum GiveUp {
    /// A READ from it failed.
    ReadFailed(String),
    /// Its control service stopped answering progress.
    PollFailed(String),
    /// It sent nothing for this long while chunks were requested from it (`in_flight` of
    /// them), or while this receiver waited on its advertisement (`0`).
    Stalled { after: Duration, in_flight: usize },
    /// It dropped off the member list (it left, or its lease expired).
    Unlisted,
    /// It left the broadcast: its control connection closed once it was done.
    Left(String),
    /// It served this chunk with bytes whose hash does not match.
    Corrupt(usize),
    /// It answers for another version (it moved on).
    OtherVersion(u64),
    /// It holds chunks of another source epoch.
    OtherEpoch(u64),
    /// It could not be attached.
    Attach(String),
}

impl std::fmt::Display for GiveUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GiveUp::ReadFailed(r) => write!(f, "failed a READ ({r})"),
            GiveUp::PollFailed(r) => write!(f, "stopped answering ({r})"),
            GiveUp::Stalled {
                after,
                in_flight: 0,
            } => write!(
                f,
                "advertised nothing new for {:.1} s while this receiver waited on it",
                after.as_secs_f64()
            ),
            GiveUp::Stalled {
                after,
                in_flight: 1,
            } => write!(
                f,
                "sent nothing for {:.1} s while a chunk was requested from it",
                after.as_secs_f64()
            ),
            GiveUp::Stalled { after, in_flight } => write!(
                f,
                "sent nothing for {:.1} s while {in_flight} chunks were requested from it",
                after.as_secs_f64()
            ),
            GiveUp::Unlisted => write!(f, "dropped off the member list"),
            GiveUp::Left(r) => write!(f, "left the broadcast ({r})"),
            GiveUp::Corrupt(c) => {
                write!(f, "served chunk {c} with bytes whose hash does not match")
            }
            GiveUp::OtherVersion(v) => write!(f, "moved on to version {v}"),
            GiveUp::OtherEpoch(e) => write!(f, "holds chunks of another source epoch ({e})"),
            GiveUp::Attach(r) => write!(f, "could not be attached ({r})"),
        }
    }
}

/// A member, for messages: `the source 127.0.0.1:7501 (id ...)`, `relay 10.0.0.3:7501 (id ...)`.
pub(crate) fn describe(m: &Member) -> String {
    match m.role {
        Role::Source => format!("the source {} (id {})", m.data_addr, m.id),
        Role::Receiver => format!("relay {} (id {})", m.data_addr, m.id),
    }
}

/// What a pull counted, for its summary.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tally {
    pub(crate) bytes_from_source: u64,
    pub(crate) bytes_from_relays: u64,
    /// `fetch_mismatches + at_rest_mismatches`.
    pub(crate) refetched: u64,
    pub(crate) fetch_mismatches: u64,
    pub(crate) at_rest_mismatches: u64,
    /// Relays that served a chunk whose hash did not match, each once.
    pub(crate) corrupt_holders: Vec<String>,
    /// Stripe parents given up.
    pub(crate) parents_given_up: u64,
    /// Holders given up for their silence ([`GiveUp::Stalled`]).
    pub(crate) stalled: u64,
    /// Holders given up because they left ([`GiveUp::Left`], [`GiveUp::Unlisted`]).
    pub(crate) left: u64,
    /// Holders attached, in order.
    pub(crate) holders: Vec<String>,
}

/// A receiver's pull of one version, as decisions: see the module's contract.
#[derive(Debug)]
pub(crate) struct Pull {
    cfg: Config,
    have: Have,
    /// Bytes of the chunks `have` holds verified.
    verified_bytes: u64,
    /// The member list as last read (never empty: the source found at join until one is read).
    members: Vec<Member>,
    /// Every holder attached (the parents of the stripes, and the source for re-fetches).
    holders: HashMap<String, Seen>,
    /// Per stripe: the holder it is fetched from.
    assigned: Vec<Option<String>>,
    /// Members given up (never attached again in this pull), the source included.
    avoid: HashSet<String>,
    /// Whether the plan must be made again.
    replan: bool,
    /// The last holder given up, and why.
    last: Option<(String, GiveUp)>,
    /// The source, when it was given up, and why.
    source_given_up: Option<(String, GiveUp)>,
    /// Why the stripes have no holder, when none could be attached.
    no_holder: String,
    /// Attachments so far (each holder's [`Seen::generation`]).
    generations: u64,
    /// The member being attached ([`Command::Attach`] out, its answer not in yet).
    attaching: Option<Member>,
    /// What the driver reported of the member being attached before it was: taken in, in
    /// order, once it is ([`Event::Attached`]); dropped if it cannot be.
    early: Vec<Event>,
    /// Chunks to fetch again from the source once it is attached.
    refetch: Vec<usize>,
    /// Since when no stripe has a holder.
    orphaned: Option<Instant>,
    /// When the next heartbeat is due.
    next_beat: Instant,
    /// When the member list was last taken (a parent missing from it is given up at once).
    listed_at: Instant,
    /// Fetches out ([`Command::Fetch`] without its [`Event::Fetched`] yet).
    in_flight: usize,
    /// The next stripe the window deals a chunk to.
    rr: usize,
    /// Mismatches per chunk.
    bad_tries: HashMap<usize, u32>,
    /// A fetch found no landing slot: no other starts until one finishes.
    no_slot: bool,
    held: bool,
    hold_check: bool,
    final_check_done: bool,
    /// The check at rest is out ([`Command::CheckAtRest`] without its [`Event::AtRest`]).
    checking: bool,
    finished: bool,
    /// Whether the state changed since the last [`step`](Self::step).
    dirty: bool,
    tally: Tally,
    out: VecDeque<Command>,
}

impl Pull {
    /// A pull of `cfg`, started at `now`, on the member list `members` (the source found at
    /// join, if none was read); its first command attaches the plan's holders, and its first
    /// heartbeat is due at once.
    pub(crate) fn new(cfg: Config, members: Vec<Member>, now: Instant) -> Self {
        let d = cfg.stripes.max(1);
        Self {
            have: Have::striped(cfg.chunk_lens.len(), d),
            assigned: vec![None; d],
            cfg,
            verified_bytes: 0,
            members,
            holders: HashMap::new(),
            avoid: HashSet::new(),
            replan: true,
            last: None,
            source_given_up: None,
            no_holder: String::from("no holder listed"),
            generations: 0,
            attaching: None,
            early: Vec::new(),
            refetch: Vec::new(),
            orphaned: None,
            next_beat: now,
            listed_at: now,
            in_flight: 0,
            rr: 0,
            bad_tries: HashMap::new(),
            no_slot: false,
            held: false,
            hold_check: false,
            final_check_done: false,
            checking: false,
            finished: false,
            dirty: true,
            tally: Tally::default(),
            out: VecDeque::new(),
        }
    }

    /// The chunks verified.
    pub(crate) fn have(&self) -> &Have {
        &self.have
    }

    /// Bytes of the chunks verified.
    pub(crate) fn verified_bytes(&self) -> u64 {
        self.verified_bytes
    }

    /// The other members listed that this pull has not given up on (the source included):
    /// those it may fetch from. A member that left, or whose lease ran out, is not listed; one
    /// still listed but given up (dead, stalled, unattachable) is not counted either.
    pub(crate) fn peers(&self) -> usize {
        self.members
            .iter()
            .filter(|m| m.id != self.cfg.me && !self.avoid.contains(&m.id))
            .count()
    }

    /// The holder this pull waits on that has been quiet the longest (`the source ADDR`,
    /// `relay ADDR`), and for how long, once that is at least a second (half of
    /// [`Config::stall_after`], if less): what a progress display names as stalled before the
    /// holder is given up (the same clock as [`stalled`]).
    pub(crate) fn waiting_on(&self, now: Instant) -> Option<(String, Duration)> {
        let floor = (self.cfg.stall_after / 2).min(Duration::from_secs(1));
        self.holders
            .iter()
            .filter_map(
                |(id, h)| match watch(id, h, &self.assigned, &self.have, &self.members)? {
                    Watch::Silent { since, .. } | Watch::Waiting { since } => {
                        Some((h, now.saturating_duration_since(since)))
                    }
                    Watch::Unlisted => None,
                },
            )
            .filter(|(_, quiet)| *quiet >= floor)
            .max_by_key(|(_, quiet)| *quiet)
            .map(|(h, quiet)| {
                let who = match h.member.role {
                    Role::Source => format!("the source {}", h.member.data_addr),
                    Role::Receiver => format!("relay {}", h.member.data_addr),
                };
                (who, quiet)
            })
    }

    /// What the pull counted.
    pub(crate) fn tally(&self) -> &Tally {
        &self.tally
    }

    /// The data addresses of the stripes' parents, each once, comma-separated.
    pub(crate) fn parents(&self) -> String {
        let mut v: Vec<&str> = Vec::new();
        for id in self.assigned.iter().flatten() {
            if let Some(h) = self.holders.get(id)
                && !v.contains(&h.member.data_addr.as_str())
            {
                v.push(&h.member.data_addr);
            }
        }
        v.join(",")
    }

    /// When the pull next needs [`Event::Wake`]: the earliest of the next heartbeat, the
    /// moment a holder it watches counts as stalled, a parent gone from the list (the time the
    /// list was taken: at once) and, with no stripe's holder, the end of its patience. `None`
    /// once it is done. An instant already past means now; the answer changes only with an
    /// event, so ask again after each.
    pub(crate) fn next_wake(&self) -> Option<Instant> {
        if self.finished {
            return None;
        }
        let stall = self.cfg.stall_after;
        let holders = self.holders.iter().filter_map(|(id, h)| {
            match watch(id, h, &self.assigned, &self.have, &self.members)? {
                Watch::Unlisted | Watch::Silent { unlisted: true, .. } => Some(self.listed_at),
                Watch::Silent { since, .. } | Watch::Waiting { since } => Some(since + stall),
            }
        });
        // What step() checks of an orphaned pull, when it checks it.
        let orphaned = self
            .orphaned
            .filter(|_| self.attaching.is_none() && !self.checking)
            .map(|since| since + stall * 10);
        holders.chain(orphaned).chain([self.next_beat]).min()
    }

    /// The process itself did not run for `gap` (stopped with SIGSTOP and resumed, or
    /// starved), as its driver saw by a wake that came that late: no holder is blamed for it.
    /// Every clock of silence the pull keeps (each holder's, and an orphaned pull's patience)
    /// moves forward by `gap`.
    pub(crate) fn paused(&mut self, gap: Duration) {
        for h in self.holders.values_mut() {
            h.heard += gap;
            h.advanced += gap;
        }
        if let Some(since) = &mut self.orphaned {
            *since += gap;
        }
        self.dirty = true;
    }

    /// Tests: while `held`, the pull starts no fetch (a relay held halfway).
    pub(crate) fn hold_fetches(&mut self, held: bool) {
        self.held = held;
        self.dirty = true;
    }

    /// Tests: while `held`, the pull keeps its check at rest (and so its end) back.
    pub(crate) fn hold_check(&mut self, held: bool) {
        self.hold_check = held;
        self.dirty = true;
    }

    /// The next command, or `None` until the next event.
    pub(crate) fn poll(&mut self, now: Instant) -> Result<Option<Command>, BroadcastError> {
        if self.out.is_empty() && self.dirty {
            self.dirty = false;
            self.step(now)?;
        }
        Ok(self.out.pop_front())
    }

    /// Takes event `ev`, which happened at `now`. Errs when the pull cannot go on.
    pub(crate) fn handle(&mut self, now: Instant, ev: Event) -> Result<(), BroadcastError> {
        self.dirty = true;
        // What a holder's poller reports before its attachment's end came in is kept, and
        // taken in at `Event::Attached`.
        if ev.holder().is_some_and(|id| self.is_attaching(id)) {
            self.early.push(ev);
            return Ok(());
        }
        match ev {
            Event::Fetched {
                chunk,
                from,
                generation,
                from_source,
                outcome,
            } => self.fetched(now, chunk, &from, generation, from_source, outcome)?,
            Event::NotStarted {
                chunk,
                from,
                generation,
            } => {
                self.finished_fetch(now, &from, generation);
                self.have.released(chunk);
                self.no_slot = true;
            }
            Event::Attached => self.attached(now)?,
            Event::AttachFailed(reason) => self.attach_failed(reason),
            Event::Progress {
                id,
                source_epoch,
                prefix,
                done,
                version,
                count,
                stripes,
            } => {
                let Some(p) = self.holders.get_mut(&id) else {
                    return Ok(());
                };
                if p.member.role != Role::Source && version != self.cfg.version {
                    // It moved on to another version: its memory no longer holds ours.
                    self.give_up(&id, GiveUp::OtherVersion(version));
                } else if source_epoch != self.cfg.source_epoch {
                    if p.member.role == Role::Source {
                        return Err(self.restarted(source_epoch));
                    }
                    self.give_up(&id, GiveUp::OtherEpoch(source_epoch));
                } else {
                    p.update(prefix, count, stripes, done, now);
                }
            }
            Event::PollFailed { id, reason } => {
                if self.is_relay(&id) {
                    self.give_up(&id, GiveUp::PollFailed(reason));
                }
            }
            Event::Left { id, reason } => {
                if self.is_relay(&id) {
                    self.give_up(&id, GiveUp::Left(reason));
                }
            }
            Event::Members { list, beat } => {
                // Early relists replan only when someone joined or left; each heartbeat's
                // list (its rates) always does.
                if beat || list.len() != self.members.len() {
                    self.replan = true;
                }
                self.members = list;
                self.listed_at = now;
            }
            Event::SourceEpoch(found) if found != self.cfg.source_epoch => {
                return Err(self.restarted(found));
            }
            Event::SourceEpoch(_) => {}
            Event::Wake => {
                let beat = now >= self.next_beat;
                if beat {
                    self.next_beat = now + self.cfg.heartbeat;
                    self.out.push_back(Command::Heartbeat);
                }
                // A holder that sent nothing for `stall_after` while the pull waits on it, the
                // source as much as a relay, and a parent gone from the list are given up.
                let out = stalled(
                    self.holders.iter().map(|(id, h)| (id.as_str(), h)),
                    &self.assigned,
                    &self.have,
                    &self.members,
                    self.cfg.stall_after,
                    now,
                );
                for (id, why) in out {
                    self.give_up(&id, why);
                }
                if beat {
                    self.out.push_back(Command::Publish);
                }
            }
            Event::AtRest { bad } => {
                self.checking = false;
                for i in bad {
                    let Some(&len) = self.cfg.chunk_lens.get(i) else {
                        continue;
                    };
                    tracing::warn!(chunk = i, "chunk corrupt at rest; fetching it again");
                    self.tally.refetched += 1;
                    self.tally.at_rest_mismatches += 1;
                    if self.have.has(i) {
                        self.verified_bytes -= len;
                    }
                    self.have.lost(i);
                }
            }
        }
        Ok(())
    }

    /// Whether `id` is the member being attached, its answer not in yet.
    fn is_attaching(&self, id: &str) -> bool {
        self.attaching.as_ref().is_some_and(|m| m.id == id)
    }

    /// Whether `id` is an attached holder other than the source (whose control connection
    /// closing or failing is left to its READs, its epoch and the list).
    fn is_relay(&self, id: &str) -> bool {
        self.holders
            .get(id)
            .is_some_and(|p| p.member.role != Role::Source)
    }

    /// A fetch from `from` (attachment `generation`) finished at `now`.
    fn finished_fetch(&mut self, now: Instant, from: &str, generation: u64) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if let Some(h) = self.holders.get_mut(from)
            && h.generation == generation
        {
            h.in_flight = h.in_flight.saturating_sub(1);
            h.heard = now;
        }
    }

    fn fetched(
        &mut self,
        now: Instant,
        chunk: usize,
        from: &str,
        generation: u64,
        from_source: bool,
        outcome: Outcome,
    ) -> Result<(), BroadcastError> {
        self.finished_fetch(now, from, generation);
        self.no_slot = false;
        let Some(&len) = self.cfg.chunk_lens.get(chunk) else {
            return Ok(());
        };
        match outcome {
            Outcome::Verified => {
                self.count_bytes(from_source, len);
                if self.have.verified(chunk) {
                    self.verified_bytes += len;
                }
            }
            Outcome::Mismatch => {
                self.count_bytes(from_source, len);
                self.mismatch(now, chunk, from, from_source)?;
            }
            Outcome::ReadFailed(reason) => {
                self.have.released(chunk);
                if self
                    .holders
                    .get(from)
                    .is_some_and(|h| h.generation == generation)
                {
                    self.give_up(from, GiveUp::ReadFailed(reason));
                }
            }
        }
        self.out.push_back(Command::Publish);
        Ok(())
    }

    fn count_bytes(&mut self, from_source: bool, len: u64) {
        if from_source {
            self.tally.bytes_from_source += len;
        } else {
            self.tally.bytes_from_relays += len;
        }
    }

    /// `chunk` from `from` did not match its hash: a relay is given up; the chunk is fetched
    /// again from the source (attached first if it is not).
    fn mismatch(
        &mut self,
        now: Instant,
        chunk: usize,
        from: &str,
        from_source: bool,
    ) -> Result<(), BroadcastError> {
        self.tally.refetched += 1;
        self.tally.fetch_mismatches += 1;
        let tries = self.bad_tries.entry(chunk).or_default();
        *tries += 1;
        let tries = *tries;
        tracing::warn!(
            chunk,
            from,
            tries,
            "BLAKE3 mismatch; fetching the chunk from another holder"
        );
        if !from_source {
            // A relay served bytes that are not the source's: report it and take nothing
            // more from it.
            if !self.tally.corrupt_holders.iter().any(|h| h == from) {
                self.tally.corrupt_holders.push(from.to_owned());
            }
            self.avoid.insert(from.to_owned());
            self.give_up(from, GiveUp::Corrupt(chunk));
        }
        if tries > 3 {
            return Err(BroadcastError::NoHolder {
                name: self.cfg.name.clone(),
                chunk,
                reason: "checksum mismatch from every holder tried".into(),
            });
        }
        // The source holds every chunk: fetch it from there (the chunk stays marked in flight
        // meanwhile).
        match self.source_in() {
            // Another member is being attached (this event came meanwhile): the chunk goes
            // back to be dealt again once that attachment is answered.
            Some(s)
                if !self.holders.contains_key(&s.id)
                    && self.attaching.as_ref().is_some_and(|a| a.id != s.id) =>
            {
                self.have.released(chunk);
            }
            Some(s) if !self.holders.contains_key(&s.id) => {
                self.refetch.push(chunk);
                if self.attaching.is_none() {
                    self.attach(s);
                }
            }
            Some(s) => {
                if !self.fetch_from(now, &s.id, chunk) {
                    self.have.released(chunk);
                }
            }
            None => self.have.released(chunk),
        }
        Ok(())
    }

    /// Asks the driver to attach `m`; nothing else is decided until it answers. Only with no
    /// attachment pending.
    fn attach(&mut self, m: Member) {
        debug_assert!(self.attaching.is_none(), "a second attachment");
        self.out.push_back(Command::Attach(m.clone()));
        self.attaching = Some(m);
    }

    fn attached(&mut self, now: Instant) -> Result<(), BroadcastError> {
        let Some(m) = self.attaching.take() else {
            return Ok(());
        };
        self.generations += 1;
        let mut seen = Seen::new(m.clone(), self.cfg.chunk_lens.len() as u64, now);
        seen.generation = self.generations;
        self.tally.holders.push(m.id.clone());
        self.holders.insert(m.id.clone(), seen);
        for chunk in std::mem::take(&mut self.refetch) {
            if !self.fetch_from(now, &m.id, chunk) {
                self.have.released(chunk);
            }
        }
        // What its poller said meanwhile (a finished holder says it once: dropped, the pull
        // would wait on it for stall_after).
        for ev in std::mem::take(&mut self.early) {
            self.handle(now, ev)?;
        }
        Ok(())
    }

    /// The member being attached could not be: it is never tried again in this pull.
    fn attach_failed(&mut self, reason: String) {
        let Some(m) = self.attaching.take() else {
            return;
        };
        self.early.clear();
        let who = describe(&m);
        tracing::warn!(holder = %who, error = %reason, "cannot attach");
        self.no_holder = format!("{who}: {reason}");
        self.avoid.insert(m.id.clone());
        let why = GiveUp::Attach(reason);
        if m.role == Role::Source {
            self.source_given_up = Some((who.clone(), why.clone()));
        }
        self.last = Some((who, why));
        for chunk in std::mem::take(&mut self.refetch) {
            self.have.released(chunk);
        }
        // A relay that cannot be attached moves to the edge: plan again.
        self.replan = true;
    }

    /// Gives up holder `id` for `why`, once (a holder no longer attached is left as it is): it
    /// is never attached again in this pull (the source neither: a pull whose other holders
    /// cannot serve what is missing then fails, naming it); the plan is made again. Returns
    /// whether it was attached.
    fn give_up(&mut self, id: &str, why: GiveUp) -> bool {
        let Some(h) = self.holders.remove(id) else {
            return false;
        };
        let who = describe(&h.member);
        tracing::warn!(holder = %who, reason = %why, "giving up holder");
        self.avoid.insert(id.to_owned());
        let parent = self.assigned.iter().any(|a| a.as_deref() == Some(id));
        if parent {
            self.tally.parents_given_up += 1;
        }
        match why {
            GiveUp::Stalled { .. } => self.tally.stalled += 1,
            GiveUp::Left(_) | GiveUp::Unlisted => self.tally.left += 1,
            _ => {}
        }
        if h.member.role == Role::Source {
            self.source_given_up = Some((who.clone(), why.clone()));
        }
        self.out.push_back(Command::GiveUp {
            id: id.to_owned(),
            why: why.clone(),
            parent,
        });
        self.last = Some((who, why));
        self.replan = true;
        true
    }

    /// Starts a fetch of `chunk` from attached holder `id`. Returns whether it is attached.
    fn fetch_from(&mut self, now: Instant, id: &str, chunk: usize) -> bool {
        let Some(h) = self.holders.get_mut(id) else {
            return false;
        };
        if h.in_flight == 0 {
            // The holder's silence is counted from the first chunk asked of it.
            h.heard = now;
        }
        h.in_flight += 1;
        self.in_flight += 1;
        self.out.push_back(Command::Fetch {
            chunk,
            holder: id.to_owned(),
            generation: h.generation,
        });
        true
    }

    /// The error of a source found at epoch `found`.
    fn restarted(&self, found: u64) -> BroadcastError {
        BroadcastError::SourceRestarted {
            name: self.cfg.name.clone(),
            had: self.cfg.source_epoch,
            found,
        }
    }

    /// The source of this pull's epoch as listed, unless it was given up.
    fn source_in(&self) -> Option<Member> {
        self.members
            .iter()
            .find(|m| {
                m.role == Role::Source
                    && m.source_epoch == self.cfg.source_epoch
                    && !self.avoid.contains(&m.id)
            })
            .cloned()
    }

    /// Decides what comes next: the check at rest or the end, the plan, the window's fetches.
    fn step(&mut self, now: Instant) -> Result<(), BroadcastError> {
        if self.attaching.is_some() || self.checking || self.finished {
            return Ok(());
        }
        if self.have.is_done() && self.in_flight == 0 && !self.hold_check {
            if self.final_check_done || !self.cfg.verify_at_rest {
                self.finished = true;
                self.out.push_back(Command::Done);
                return Ok(());
            }
            self.final_check_done = true;
            self.checking = true;
            self.out.push_back(Command::CheckAtRest);
            return Ok(());
        }
        if self.replan {
            self.replan = false;
            if !self.plan() {
                // Waiting on an attachment.
                return Ok(());
            }
        }
        if self.assigned.iter().all(Option::is_none) && self.in_flight == 0 {
            let since = *self.orphaned.get_or_insert(now);
            // The source was given up (it stalled, died, or cannot be attached) and no one
            // else serves what is missing: nothing will come; say who and what.
            if self.source_given_up.is_some()
                || now.saturating_duration_since(since) >= self.cfg.stall_after * 10
            {
                return Err(self.stopped());
            }
        } else {
            self.orphaned = None;
        }
        if !self.held {
            self.fill(now);
        }
        Ok(())
    }

    /// Starts fetches up to the window, dealt over the stripes in turn.
    fn fill(&mut self, now: Instant) {
        let d = self.assigned.len();
        let mut idle = 0;
        while !self.no_slot && self.in_flight < self.cfg.window.max(1) && idle < d {
            let s = self.rr % d;
            self.rr = self.rr.wrapping_add(1);
            let Some(id) = self.assigned[s].clone() else {
                idle += 1;
                continue;
            };
            let Some(h) = self.holders.get(&id) else {
                idle += 1;
                continue;
            };
            match self.have.next_in_stripe(s, |c| h.holds(c)) {
                Some(i) => {
                    idle = 0;
                    self.fetch_from(now, &id, i);
                }
                None => idle += 1,
            }
        }
    }

    /// Takes a holder for every stripe from the plan ([`stripe_holders`]) on the list, less
    /// those given up: asks to attach the first one not attached yet (returns `false`: the plan
    /// is made again once it answers), drops the relays no stripe is fetched from any more and
    /// none has a fetch in flight (the source is kept for re-fetches).
    fn plan(&mut self) -> bool {
        let d = self.assigned.len();
        // A source given up is not listed to the plan: the stripes it would serve have no
        // holder (stripe_holders keeps relays given up at the edge itself).
        let listed: Vec<Member> = self
            .members
            .iter()
            .filter(|m| m.role != Role::Source || !self.avoid.contains(&m.id))
            .cloned()
            .collect();
        let want: Vec<Option<Member>> = if self.cfg.relay {
            stripe_holders(
                &listed,
                &self.cfg.me,
                self.cfg.source_epoch,
                self.cfg.version,
                &self.avoid,
                d,
                self.cfg.straggler,
            )
            .into_iter()
            .map(|m| m.cloned())
            .collect()
        } else {
            vec![self.source_in(); d]
        };
        // The source given up (relaying): a stripe it would serve goes to the receiver of this
        // version that holds the most (done first), which advertises what it has of every
        // stripe; one that does not advance is given up in turn, and then the next.
        let fallback = (self.cfg.relay && self.source_given_up.is_some())
            .then(|| {
                listed
                    .iter()
                    .filter(|m| {
                        m.role == Role::Receiver
                            && m.id != self.cfg.me
                            && m.source_epoch == self.cfg.source_epoch
                            && m.version == self.cfg.version
                            && !m.data_addr.is_empty()
                            && !self.avoid.contains(&m.id)
                    })
                    .max_by_key(|m| (m.done, m.progress))
                    .cloned()
            })
            .flatten();
        for (s, w) in want.into_iter().enumerate() {
            let Some(m) = w.or_else(|| fallback.clone()) else {
                self.assigned[s] = None;
                continue;
            };
            if self.avoid.contains(&m.id) {
                self.assigned[s] = None;
                continue;
            }
            if !self.holders.contains_key(&m.id) {
                self.assigned[s] = None;
                self.replan = true;
                self.attach(m);
                return false;
            }
            if self.assigned[s].as_deref() != Some(m.id.as_str()) {
                tracing::debug!(stripe = s, holder = %m.id, "stripe parent");
            }
            self.assigned[s] = Some(m.id);
        }
        let dropped: Vec<String> = self
            .holders
            .iter()
            .filter(|(id, h)| {
                // One with fetches in flight is kept until they end (or it is given up as
                // stalled): dropped, a silent holder's fetches would hold their chunks forever.
                h.member.role != Role::Source
                    && h.in_flight == 0
                    && !self
                        .assigned
                        .iter()
                        .any(|a| a.as_deref() == Some(id.as_str()))
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in dropped {
            self.holders.remove(&id);
            self.out.push_back(Command::Detach(id));
        }
        true
    }

    /// The error of a pull that cannot go on: the source (or the last holder) given up, and
    /// what was verified; or, when none was given up, why no holder could be attached.
    fn stopped(&self) -> BroadcastError {
        match self.source_given_up.as_ref().or(self.last.as_ref()) {
            Some((holder, why)) => BroadcastError::Stalled {
                name: self.cfg.name.clone(),
                version: self.cfg.version,
                holder: holder.clone(),
                reason: why.to_string(),
                verified: self.have.count(),
                chunks: self.have.len() as u64,
                bytes: self.verified_bytes,
                total: self.cfg.chunk_lens.iter().sum(),
            },
            None => BroadcastError::NoHolder {
                name: self.cfg.name.clone(),
                chunk: (0..self.have.len())
                    .find(|&i| !self.have.has(i))
                    .unwrap_or(0),
                reason: self.no_holder.clone(),
            },
        }
    }
}

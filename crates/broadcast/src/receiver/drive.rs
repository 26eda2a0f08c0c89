//! The driver of a receiver's [`Pull`]: carries its commands out over the engine, the control
//! connections and discovery, and turns what happens into its events.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};

use crate::discovery::Discovery;
use crate::error::BroadcastError;
use crate::plan::{Have, Member};
use crate::pull::{Command, Config as PullConfig, Event, Outcome, Pull};

use super::link::{Attacher, Fetched, Link};
use super::{Receiver, Summary, unix_now};

/// Waits for `n` to be notified (never, if `None`).
async fn notified(n: &Option<Arc<tokio::sync::Notify>>) {
    match n {
        Some(n) => n.notified().await,
        None => std::future::pending().await,
    }
}

/// Resolves at `at` ([`Pull::next_wake`]); never, for `None`.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// What the driver holds beside its [`Pull`] while a pull runs.
pub(super) struct Drive {
    /// The data paths of the holders attached, by id.
    links: HashMap<String, Link>,
    /// The fetches in flight.
    set: JoinSet<Fetched>,
    /// When the first chunk was requested.
    first_request: Option<Instant>,
    /// This member's entry, renewed by the discovery task.
    me_tx: watch::Sender<Member>,
    /// Where the holders' progress pollers report.
    polls: mpsc::UnboundedSender<Event>,
    /// What an attachment needs.
    attacher: Attacher,
    /// The attachment running ([`Command::Attach`]; at most one), answered when it ends.
    attaching: Option<JoinHandle<Attachment>>,
}

/// An attachment's end: the member, and its data path or why not.
type Attachment = (Member, Result<Link, BroadcastError>);

impl Drop for Drive {
    fn drop(&mut self) {
        if let Some(a) = &self.attaching {
            a.abort();
        }
    }
}

/// Resolves when the attachment running ends (never, with none), which it then clears.
async fn attachment(
    running: &mut Option<JoinHandle<Attachment>>,
) -> Result<Attachment, tokio::task::JoinError> {
    let ended = match running.as_mut() {
        Some(task) => task.await,
        None => std::future::pending().await,
    };
    *running = None;
    ended
}

/// What the discovery task ([`watch_discovery`]) reports.
enum Listed {
    /// The member list, read at a heartbeat (`beat`) or, early in the pull, between them.
    Members { list: Vec<Member>, beat: bool },
    /// The source epoch the backend answered a heartbeat with.
    SourceEpoch(u64),
}

/// Aborts a task when dropped (whichever way the pull ends).
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Renews this member's entry (the latest `me`) every `heartbeat` and reads the member list
/// after each renewal, and, for the first [`EARLY`] of a relayed pull, every [`EARLY_RELIST`]
/// besides. Runs beside the pull, so a backend that does not answer (a stopped source keeps
/// the embedded list: each call waits out its timeout) never holds up fetching or the checks
/// that give up stalled holders. A renewal or listing that fails is skipped: the holders'
/// epochs still guard against mixing, and the list stays the last one read.
fn watch_discovery(
    discovery: Arc<dyn Discovery>,
    me: watch::Receiver<Member>,
    heartbeat: Duration,
    relay: bool,
) -> (JoinHandle<()>, mpsc::UnboundedReceiver<Listed>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        let start = Instant::now();
        let mut next_beat = start + heartbeat;
        loop {
            let now = Instant::now();
            let wake = if relay && now.duration_since(start) < EARLY {
                next_beat.min(now + EARLY_RELIST.min(heartbeat))
            } else {
                next_beat
            };
            tokio::time::sleep_until(wake.into()).await;
            let beat = Instant::now() >= next_beat;
            if beat {
                next_beat = Instant::now() + heartbeat;
                let m = me.borrow().clone();
                match discovery.update(&m).await {
                    Ok(Some(found)) => {
                        if tx.send(Listed::SourceEpoch(found)).is_err() {
                            return;
                        }
                    }
                    Ok(None) => {}
                    Err(e) => tracing::debug!(error = %e, "heartbeat failed"),
                }
            }
            match discovery.members().await {
                Ok(list) => {
                    if tx.send(Listed::Members { list, beat }).is_err() {
                        return;
                    }
                }
                Err(e) => tracing::debug!(error = %e, "listing members failed"),
            }
        }
    });
    (task, rx)
}

/// For this long after a pull starts, the member list is reread (and the plan made again)
/// every [`EARLY_RELIST`], not only every heartbeat: the members of a fleet join within
/// moments of each other, and until a member lists the others it takes the stripes whose
/// groups it does not know yet from the source itself.
const EARLY: Duration = Duration::from_secs(2);

const EARLY_RELIST: Duration = Duration::from_millis(50);

/// A wake this late means the receiver's own process did not run (SIGSTOP, then SIGCONT):
/// its holders' silence meanwhile is not theirs ([`Pull::paused`]).
const PAUSED: Duration = Duration::from_secs(1);

impl Receiver {
    /// This member's entry as it stands: its progress, and its download rate since
    /// `first_request` (once a second has passed: before, too few chunks to tell a straggler).
    /// Handed to the discovery task ([`watch_discovery`]), which renews it.
    pub(super) fn beat(
        &mut self,
        have: &Have,
        first_request: Option<Instant>,
        me: &watch::Sender<Member>,
    ) {
        self.member.progress = have.count();
        if let Some(t) = first_request
            && !self.member.done
            && t.elapsed() >= Duration::from_secs(1)
        {
            let bytes = self.advert.verified_bytes();
            self.member.rate = (bytes as f64 / t.elapsed().as_secs_f64()) as u64;
        }
        self.member.done = have.is_done();
        let _ = me.send(self.member.clone());
    }

    /// Renews this member's entry now (the pull's end: its last progress, done).
    pub(super) async fn heartbeat_now(&self) -> Result<(), BroadcastError> {
        match self.discovery.update(&self.member).await {
            Ok(Some(found)) if found != self.origin.epoch => {
                Err(self.origin.restarted(&self.manifest.name, found))
            }
            Ok(_) => Ok(()),
            Err(e) => {
                tracing::debug!(error = %e, "heartbeat failed");
                Ok(())
            }
        }
    }

    /// Updates the snapshot, reports the pull to the engine, then updates what the control
    /// service advertises ([`Advert`](super::Advert): in that order).
    pub(super) fn publish(
        &self,
        have: &Have,
        bytes: u64,
        refetched: u64,
        peers: usize,
        parent: &str,
        stalled: Option<(String, Duration)>,
    ) {
        self.advert.snapshot(have, |s| {
            s.bytes = bytes;
            s.refetched = refetched;
            s.peers = peers;
            s.parent = parent.to_owned();
            s.stalled = stalled;
        });
        self.engine.report_broadcast(ferry::BroadcastDescription {
            role: "receiver".into(),
            name: self.manifest.name.clone(),
            version: self.manifest.version,
            bytes,
            total_bytes: self.manifest.total_bytes(),
            refetched,
            peers: peers as u64,
            done: have.is_done(),
        });
        self.advert.advertise(have);
    }

    /// The pull's settings, as its decisions ([`Pull`]) take them.
    pub(super) fn pull_config(&self) -> PullConfig {
        PullConfig {
            name: self.manifest.name.clone(),
            version: self.manifest.version,
            source_epoch: self.origin.epoch,
            me: self.member.id.clone(),
            chunk_lens: self.manifest.chunks.iter().map(|c| c.len).collect(),
            stripes: if self.opts.relay {
                self.opts.stripes.max(1)
            } else {
                1
            },
            window: self.opts.window.max(1),
            relay: self.opts.relay,
            straggler: self.opts.straggler,
            stall_after: self.opts.stall_after,
            heartbeat: self.opts.heartbeat,
            verify_at_rest: self.opts.verify_at_rest,
        }
    }

    /// Drives a [`Pull`]: carries its commands out ([`drain`](Self::drain)) and feeds it what
    /// happened (fetches finished, the member list, holders' progress, and the time it asked
    /// to be woken at: [`Pull::next_wake`]).
    pub(super) async fn run_inner(&mut self) -> Result<Summary, BroadcastError> {
        let started = Instant::now();
        let (polls, mut poll_rx) = mpsc::unbounded_channel();
        // A list that cannot be read now (a source that stopped since it answered the
        // manifest) leaves the source found then: it is attached, and given up if it stalls.
        let members = match self.discovery.members().await {
            Ok(m) if !m.is_empty() => m,
            _ => vec![self.origin.listed.clone()],
        };
        let mut pull = Pull::new(self.pull_config(), members, Instant::now());
        // Discovery runs beside the pull: a backend that stops answering (a stopped source
        // keeps the embedded list) never holds up fetching or the stall checks.
        let (me_tx, me_rx) = watch::channel(self.member.clone());
        let (listed, mut listed_rx) = watch_discovery(
            self.discovery.clone(),
            me_rx,
            self.opts.heartbeat,
            self.opts.relay,
        );
        let listing = AbortOnDrop(listed);
        let mut d = Drive {
            links: HashMap::new(),
            set: JoinSet::new(),
            first_request: None,
            me_tx,
            polls,
            attacher: self.attacher(),
            attaching: None,
        };
        let mut hooks = self.hooks.clone();
        if hooks.hold_final_check.is_some() {
            pull.hold_check(true);
        }
        let mut held: Option<Arc<tokio::sync::Notify>> = None;
        while !self.drain(&mut pull, &mut d).await? {
            let wake = pull.next_wake();
            let ev = tokio::select! {
                () = notified(&hooks.hold_final_check), if hooks.hold_final_check.is_some() => {
                    hooks.hold_final_check = None;
                    pull.hold_check(false);
                    continue;
                }
                () = notified(&held), if held.is_some() => {
                    held = None;
                    pull.hold_fetches(false);
                    continue;
                }
                Some(joined) = d.set.join_next() => {
                    let Ok(f) = joined else { continue };
                    self.fetched_event(f)?
                }
                Some(l) = listed_rx.recv() => match l {
                    Listed::SourceEpoch(found) => Event::SourceEpoch(found),
                    Listed::Members { list, beat } => Event::Members { list, beat },
                },
                Some(ev) = poll_rx.recv() => ev,
                ended = attachment(&mut d.attaching) => match ended {
                    Ok((m, Ok(link))) => {
                        d.links.insert(m.id.clone(), link);
                        Event::Attached
                    }
                    Ok((_, Err(e @ BroadcastError::SourceRestarted { .. }))) => return Err(e),
                    Ok((_, Err(e))) => Event::AttachFailed(e.to_string()),
                    Err(e) => Event::AttachFailed(format!("the attachment's task failed: {e}")),
                },
                () = sleep_until(wake) => {
                    // Woken this late: this process did not run meanwhile (stopped and
                    // resumed), and its holders are not to blame for the silence.
                    if let Some(at) = wake {
                        let late = Instant::now().saturating_duration_since(at);
                        if late >= PAUSED {
                            pull.paused(late);
                        }
                    }
                    Event::Wake
                }
            };
            let verified = match &ev {
                Event::Fetched {
                    chunk,
                    outcome: Outcome::Verified,
                    ..
                } => Some(*chunk),
                _ => None,
            };
            pull.handle(Instant::now(), ev)?;
            if let Some(chunk) = verified {
                let now = unix_now();
                self.timeline.first_verified.get_or_insert(now);
                self.timeline.last_verified = Some(now);
                // Tests only: what the hooks inject, before anything more is published.
                if hooks.corrupt_after_verify == Some(chunk) {
                    hooks.corrupt_after_verify = None;
                    self.corrupt(chunk);
                }
                if let Some((after, release)) = &hooks.hold_after
                    && pull.have().count() == *after
                {
                    held = Some(release.clone());
                    pull.hold_fetches(true);
                }
            }
        }
        let t = pull.tally();
        let mut sum = Summary {
            name: self.manifest.name.clone(),
            version: self.manifest.version,
            source_epoch: self.origin.epoch,
            bytes: self.manifest.total_bytes(),
            chunks: self.manifest.chunks.len() as u64,
            refetched_chunks: t.refetched,
            fetch_mismatches: t.fetch_mismatches,
            at_rest_mismatches: t.at_rest_mismatches,
            corrupt_holders: t.corrupt_holders.clone(),
            bytes_from_source: t.bytes_from_source,
            bytes_from_relays: t.bytes_from_relays,
            parents_given_up: t.parents_given_up,
            holders_stalled: t.stalled,
            holders_left: t.left,
            holders: t.holders.clone(),
            ..Default::default()
        };
        sum.seconds = started.elapsed().as_secs_f64();
        self.timeline.done = Some(unix_now());
        sum.timeline = self.timeline.clone();
        sum.bytes_copied = self.payload.copied.load(Ordering::Relaxed);
        sum.gb_per_s = sum.bytes as f64 / sum.seconds.max(1e-9) / 1e9;
        self.publish(
            pull.have(),
            pull.verified_bytes(),
            sum.refetched_chunks,
            pull.peers(),
            "",
            None,
        );
        self.beat(pull.have(), d.first_request, &d.me_tx);
        drop(listing);
        self.heartbeat_now().await?;
        tracing::info!(name = %sum.name, seconds = sum.seconds, refetched = sum.refetched_chunks,
            from_source = sum.bytes_from_source, from_relays = sum.bytes_from_relays, "pull complete");
        Ok(sum)
    }

    /// What a finished fetch task tells the pull; a chunk that could not be written to its
    /// file ends the pull.
    pub(super) fn fetched_event(&self, f: Fetched) -> Result<Event, BroadcastError> {
        if let Some(e) = f.write_failed {
            let c = self.manifest.chunks[f.chunk];
            let file = self
                .payload
                .files
                .as_ref()
                .map(|l| l.segs[c.segment as usize].tmp.display().to_string());
            return Err(BroadcastError::io(
                format!("writing chunk {} to {}", f.chunk, file.unwrap_or_default()),
                e,
            ));
        }
        Ok(Event::Fetched {
            chunk: f.chunk,
            from: f.from,
            generation: f.generation,
            from_source: f.from_source,
            outcome: match f.result {
                Ok(true) => Outcome::Verified,
                Ok(false) => Outcome::Mismatch,
                Err(reason) => Outcome::ReadFailed(reason),
            },
        })
    }

    /// Tests only ([`TestHooks::corrupt_after_verify`](super::TestHooks::corrupt_after_verify)): flips one byte of verified chunk `i`
    /// where it lies (a relay that corrupts what it serves).
    pub(super) fn corrupt(&self, i: usize) {
        let pieces = self.payload.pieces(&self.manifest.chunks[i]);
        if let Some((slice, at, _)) = pieces.first() {
            let mut b = [0u8; 1];
            let _ = slice.read(*at, &mut b);
            let _ = slice.write(*at, &[b[0] ^ 0xff]);
        }
        tracing::warn!(chunk = i, "test hook: corrupted a verified chunk");
    }

    /// Carries out the pull's commands until it has none; the check at rest is answered
    /// before the next, an attachment when it ends (an event of [`run_inner`](Self::run_inner)'s
    /// loop). Returns whether the pull is done.
    pub(super) async fn drain(
        &mut self,
        pull: &mut Pull,
        d: &mut Drive,
    ) -> Result<bool, BroadcastError> {
        while let Some(cmd) = pull.poll(Instant::now())? {
            match cmd {
                Command::Done => return Ok(true),
                Command::Attach(m) => {
                    // Runs beside the pull; its end is an event (`attachment`).
                    let (a, polls) = (d.attacher.clone(), d.polls.clone());
                    d.attaching = Some(tokio::spawn(async move {
                        let r = a.attach_within(&m, &polls).await;
                        (m, r)
                    }));
                }
                Command::Fetch {
                    chunk,
                    holder,
                    generation,
                } => {
                    let link = d.links.get(&holder);
                    if link.is_some_and(|l| self.fetch(&mut d.set, l, &holder, generation, chunk)) {
                        d.first_request.get_or_insert_with(Instant::now);
                        self.timeline.first_request.get_or_insert_with(unix_now);
                    } else {
                        // No landing slot free (a pull into files): next time.
                        let ev = Event::NotStarted {
                            chunk,
                            from: holder,
                            generation,
                        };
                        pull.handle(Instant::now(), ev)?;
                    }
                }
                Command::GiveUp { id, parent, .. } => {
                    // Its chunks in flight fail at once, so none lands later.
                    if let Some(link) = d.links.remove(&id) {
                        link.peer.close();
                    }
                    if parent {
                        self.timeline.parent_given_up.get_or_insert_with(unix_now);
                    }
                }
                Command::Detach(id) => {
                    d.links.remove(&id);
                }
                Command::CheckAtRest => {
                    let bad = self.payload.check_at_rest(&self.manifest.chunks);
                    pull.handle(Instant::now(), Event::AtRest { bad })?;
                }
                Command::Heartbeat => self.beat(pull.have(), d.first_request, &d.me_tx),
                Command::Publish => self.publish(
                    pull.have(),
                    pull.verified_bytes(),
                    pull.tally().refetched,
                    pull.peers(),
                    &pull.parents(),
                    pull.waiting_on(Instant::now()),
                ),
            }
        }
        Ok(false)
    }
}

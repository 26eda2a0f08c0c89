//! A receiver: fetches the manifest's chunks of one version from its parent in the chain
//! ([`plan`](crate::plan)), verifies each against the manifest's BLAKE3, and serves what it
//! verified to the member after it. It pulls into buffers of its own ([`Receiver::join`]) or
//! into the caller's destinations ([`Receiver::join_into`]: in place, or staged and then
//! committed), and serves from wherever the chunks landed ([`layout`](crate::layout)).
//!
//! What it decides (which holder to fetch each chunk from, when to give one up, re-fetch,
//! replan) is [`Pull`](crate::pull::Pull)'s, a state machine with no I/O; this module is its
//! driver ([`drive`]): it joins ([`join`]), attaches holders and fetches from them ([`link`]).
//!
//! Contract:
//! - a chunk is fetched by Ferry READs straight into where it lands here (one per piece where
//!   the holder's layout and this receiver's meet), then verified over those pieces against the
//!   manifest's BLAKE3; only verified chunks count, and only the verified prefix is advertised
//!   (never more than [`Snapshot::chunks`] verified), so a member never fetches from it a chunk
//!   it has not verified;
//! - with [`ReceiverOptions::expect_manifest`], a manifest whose digest differs is refused
//!   before anything is allocated ([`BroadcastError::ManifestDigest`]), so every chunk hash,
//!   and so every byte, is bound to the source whoever relays it; a manifest declaring more
//!   than [`ReceiverOptions::max_bytes`] is refused there too;
//! - destinations are matched with the published tensors by name and size (and dtype and
//!   shape, where [`Destinations::kinds`](crate::Destinations::kinds) says them), one published tensor to a destination,
//!   before anything is registered, listed or moved ([`BroadcastError::Mismatch`]);
//! - it takes chunks only from the source and from receivers of its own version, and gives up
//!   a parent that answers for another version;
//! - in place, a pull that fails after its first READ is [`BroadcastError::Torn`]; staged, the
//!   live tensors change only in [`Receiver::commit`];
//! - unless [`ReceiverOptions::verify_at_rest`] is off, every chunk is checked once more at
//!   rest before the pull reports done, and one that changed is fetched again;
//! - a chunk whose hash does not match when fetched is counted ([`Summary::fetch_mismatches`],
//!   apart from those found at rest, [`Summary::at_rest_mismatches`]) and fetched again from
//!   the source (or, if the source served it, the source once more, three times at most); the
//!   relay that served it is reported ([`Summary::corrupt_holders`], a warning) and given up
//!   for the rest of the pull;
//! - a parent that fails a READ, stops answering, or whose prefix does not advance for
//!   `stall_after` while this receiver waits on it is given up: its data path is closed (its
//!   chunks in flight fail at once, so none lands later) and the next holder in the plan is
//!   taken; chunks already verified are kept and never fetched again;
//! - everything is tied to one source epoch: a holder of another is never used, and if the
//!   source itself shows another epoch (it restarted) the pull fails with
//!   [`BroadcastError::SourceRestarted`] instead of mixing chunks of two versions.

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ferry::{DataPlane, TransferEngine};
use serde::Serialize;
use tokio::sync::watch;

use crate::control::{self, Progress};
use crate::discovery::Discovery;
use crate::error::BroadcastError;
use crate::manifest::{Digest, Manifest};
use crate::plan::{Have, Member, Role};

mod drive;
mod join;
mod link;
mod payload;

use payload::Payload;

/// How a receiver runs.
#[derive(Clone, Debug)]
pub struct ReceiverOptions {
    /// The IP its Ferry listener and control service listen on (any free ports). `None`: the
    /// IP it reaches the source from, which the other members can reach too.
    pub listen_ip: Option<IpAddr>,
    /// Which data plane carries the chunks: `Tcp` or `Uring` alone; `Auto` also reaches and
    /// serves members on this host by the same-host plane. (With
    /// [`join_into`](Receiver::join_into) the caller's engine decides.)
    pub data_plane: DataPlane,
    /// Chunks in flight, over all stripes.
    pub window: usize,
    /// Stripes of the relay plan ([`plan::stripe_holders`](crate::plan::stripe_holders)): the
    /// chunks are dealt into this many stripes, each carried down its own tree of this
    /// degree, so that every member uploads about what it downloads and the depth is about
    /// `log` of the fleet; `1` is the chain in join order. Members with different values
    /// still fetch from each other (each advertises its own stripes' prefixes), but only the
    /// same value gives every member the same plan.
    pub stripes: usize,
    /// A member whose listed download rate is below this fraction of the median is a
    /// straggler: a leaf of every tree, serving no one, its children moved to others
    /// (`0`: none is).
    pub straggler: f64,
    /// A parent whose verified prefix does not advance for this long while this receiver waits
    /// on it is given up.
    pub stall_after: Duration,
    /// How often the receiver renews its entry (progress) and rereads the member list.
    pub heartbeat: Duration,
    /// Whether to fetch from other receivers (the striped plan). `false`: from the source
    /// only, as a point-to-point pull would (the baseline `cargo xtask bench broadcast`
    /// compares with). It still serves what it verified.
    pub relay: bool,
    /// The version to pull (`None`: the newest the source publishes).
    pub version: Option<u64>,
    /// Whether to check every chunk once more at rest before reporting done (a chunk whose
    /// memory changed after it was verified is fetched again; the check is the cheaper
    /// CRC-32C of memory already verified against BLAKE3, read where it lies where the CPU has
    /// a CRC-32C instruction, else copied out). `false` saves that second read of the payload
    /// (and, without the instruction, its copy); every chunk is still verified as it lands, and
    /// the children verify what they read from this receiver.
    pub verify_at_rest: bool,
    /// The manifest's digest ([`Manifest::digest`]), given out of band (`ferry publish`
    /// prints it): any other manifest is refused before anything is allocated for it. `None`:
    /// the manifest is taken from the source as it answers (its chunk hashes still catch any
    /// relay that alters a chunk, but not an impostor source).
    pub expect_manifest: Option<Digest>,
    /// Most payload bytes accepted from a manifest (`None`: [`MAX_TOTAL_BYTES`](crate::manifest::MAX_TOTAL_BYTES)); checked
    /// before anything is allocated.
    pub max_bytes: Option<u64>,
    /// The broadcast's keys: this receiver proves the first on every control connection (and
    /// refuses members that cannot), its control service answers only connections that prove
    /// one, and the engine [`join`](Receiver::join) builds serves chunks only to peers that
    /// prove one (the data plane's own authentication). With [`join_into`](Receiver::join_into)
    /// the caller's engine must be keyed by the caller. Give the [`Embedded`](crate::Embedded)
    /// discovery the same keys ([`Embedded::with_keys`](crate::Embedded::with_keys)).
    pub keys: Option<ferry::Keyring>,
}

impl Default for ReceiverOptions {
    fn default() -> Self {
        Self {
            listen_ip: None,
            data_plane: DataPlane::Auto,
            window: 8,
            stripes: DEFAULT_STRIPES,
            straggler: 0.5,
            stall_after: Duration::from_secs(3),
            heartbeat: Duration::from_millis(500),
            relay: true,
            version: None,
            verify_at_rest: true,
            expect_manifest: None,
            max_bytes: None,
            keys: None,
        }
    }
}

/// Faults and holds the tests inject into a pull (feature `__test-hooks`:
/// `Receiver::set_test_hooks`); the driver turns each into what its [`Pull`](crate::pull::Pull) is told.
#[derive(Clone, Debug, Default)]
#[cfg_attr(not(feature = "__test-hooks"), allow(unreachable_pub, dead_code))]
pub struct TestHooks {
    /// After verifying this chunk, flip one byte of it in the buffer the others read from (a
    /// relay that corrupts what it serves). Its own check at rest finds it again.
    pub corrupt_after_verify: Option<usize>,
    /// Stop fetching (but keep serving and heartbeating) after this many chunks are verified,
    /// until this is notified (a pull held halfway, or a stalled relay if it never is).
    pub hold_after: Option<(u64, Arc<tokio::sync::Notify>)>,
    /// Once every chunk is verified, keep serving what it holds, as it is, and run the check at
    /// rest only after this is notified (a corrupting relay stays corrupt until the test has
    /// seen another receiver catch it).
    pub hold_final_check: Option<Arc<tokio::sync::Notify>>,
}

/// [`ReceiverOptions::stripes`] unless set.
pub const DEFAULT_STRIPES: usize = 2;

/// What a finished pull did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    /// The broadcast's name.
    pub name: String,
    /// Its version.
    pub version: u64,
    /// The source epoch every chunk came from.
    pub source_epoch: u64,
    /// Payload bytes (all segments).
    pub bytes: u64,
    /// Seconds from the first fetch to the last chunk verified.
    pub seconds: f64,
    /// `bytes / seconds`, in GB/s (10^9).
    pub gb_per_s: f64,
    /// Chunks in the manifest.
    pub chunks: u64,
    /// Chunks whose hash did not match and that were fetched again: `fetch_mismatches +
    /// at_rest_mismatches`.
    pub refetched_chunks: u64,
    /// Chunks whose BLAKE3 did not match the manifest's as they were fetched (a holder served
    /// other bytes).
    pub fetch_mismatches: u64,
    /// Chunks verified when fetched whose bytes here had changed by the check at rest.
    pub at_rest_mismatches: u64,
    /// Members that served a chunk whose hash did not match (each once), given up on.
    pub corrupt_holders: Vec<String>,
    /// Bytes received from the source (verified or not).
    pub bytes_from_source: u64,
    /// Bytes received from other receivers (verified or not).
    pub bytes_from_relays: u64,
    /// Parents given up on (dead, stalled, other epoch).
    pub parents_given_up: u64,
    /// Holders given up for their silence: nothing from them for
    /// [`ReceiverOptions::stall_after`] while this receiver waited on them.
    pub holders_stalled: u64,
    /// Holders given up because they left while this receiver still had them attached (their
    /// control connection closed, or the member list no longer named them): re-planned at
    /// once, not waited on.
    pub holders_left: u64,
    /// Ids of the members it fetched from, in order.
    pub holders: Vec<String>,
    /// Bytes the CPU copied during the pull (see [`Receiver::bytes_copied`]).
    pub bytes_copied: u64,
    /// When each step of this member's pull happened.
    pub timeline: Timeline,
}

/// When each step of a member's pull happened, in seconds since the Unix epoch (the wall
/// clock, so that the members of one machine, or of machines with synchronised clocks, line up
/// hop by hop: `cargo xtask bench broadcast` prints them). `None`: not reached.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Timeline {
    /// The process started (set by the caller: `ferry pull` sets it when the command starts).
    pub process_start: Option<f64>,
    /// [`Receiver::join`] or [`Receiver::join_into`] was called.
    pub join_start: Option<f64>,
    /// The manifest was received and checked.
    pub manifest: Option<f64>,
    /// The member was listed (its buffers registered, its control service up).
    pub joined: Option<f64>,
    /// The first chunk was requested.
    pub first_request: Option<f64>,
    /// The first chunk was verified.
    pub first_verified: Option<f64>,
    /// The last chunk was verified.
    pub last_verified: Option<f64>,
    /// [`Receiver::run`] returned: every chunk verified, at rest too.
    pub done: Option<f64>,
    /// A stripe's parent was first given up (dead, stalled, corrupting, of another version).
    pub parent_given_up: Option<f64>,
}

/// The wall clock now, in seconds since the Unix epoch.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Where a pull stands, for progress displays.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Bytes verified.
    pub bytes: u64,
    /// Chunks verified. What the member advertises to others (its verified prefix) never
    /// exceeds it: the snapshot is updated before the advertisement.
    pub chunks: u64,
    /// Payload bytes.
    pub total: u64,
    /// Chunks re-fetched after a checksum mismatch.
    pub refetched: u64,
    /// The other members listed (the source included) that this pull has not given up on:
    /// those it may fetch from.
    pub peers: usize,
    /// The data addresses of the stripes' current parents, each once, comma-separated (empty
    /// before the first is attached, and once done).
    pub parent: String,
    /// The holder the pull waits on that has sent nothing for at least a second (`the source
    /// ADDR`, `relay ADDR`) and for how long: a stall, named before the holder is given up
    /// (at [`ReceiverOptions::stall_after`]). `None` while chunks come.
    pub stalled: Option<(String, Duration)>,
    /// Whether every chunk is verified.
    pub done: bool,
}

/// A receiver that joined a broadcast: its engine and buffers are set up and registered, its
/// control service runs and it is listed. [`run`](Self::run) fetches.
pub struct Receiver {
    // Field order is drop order (after `Drop` shut an engine of its own down): what it
    // publishes, its control service among it, goes before where the payload lands.
    engine: TransferEngine,
    /// Whether the engine is this receiver's own (shut down with it) or the caller's.
    owns_engine: bool,
    discovery: Arc<dyn Discovery>,
    manifest: Manifest,
    /// The source it pulls from.
    origin: Origin,
    member: Member,
    opts: ReceiverOptions,
    timeline: Timeline,
    /// What it publishes as the pull goes.
    advert: Advert,
    /// Where the payload lands.
    payload: Payload,
    /// What the tests inject (none, unless feature `__test-hooks`).
    hooks: TestHooks,
}

/// The source as this receiver pulled from it: the incarnation that answered the manifest.
#[derive(Clone, Debug)]
struct Origin {
    /// The source epoch every chunk comes from: a holder of another is never used.
    epoch: u64,
    /// The source's IP, which members listed with an unspecified IP are reached at.
    ip: IpAddr,
    /// Its record as listed when the manifest was fetched (the plan's source until a list is
    /// read).
    listed: Member,
}

impl Origin {
    /// The error of the source of broadcast `name` found at epoch `found` (not this one's).
    fn restarted(&self, name: &str, found: u64) -> BroadcastError {
        BroadcastError::SourceRestarted {
            name: name.to_owned(),
            had: self.epoch,
            found,
        }
    }
}

/// What a receiver publishes as its pull goes: the [`Snapshot`] its caller follows
/// ([`Receiver::progress`]) and the [`Progress`] its control service advertises to the other
/// members, always in that order, so that an advertised prefix is never ahead of the
/// snapshot's verified chunks.
struct Advert {
    /// What the control service advertises.
    progress_tx: watch::Sender<Progress>,
    /// What the caller follows.
    snapshot_tx: watch::Sender<Snapshot>,
    /// Held for its drop: the control listener closes with the member.
    _ctl: control::Service,
}

impl Advert {
    /// Bytes verified, as last published.
    fn verified_bytes(&self) -> u64 {
        self.snapshot_tx.borrow().bytes
    }

    /// Updates the snapshot: `have`'s count of verified chunks and whether that is all of them,
    /// and what `set` sets; the first half of a publication.
    fn snapshot(&self, have: &Have, set: impl FnOnce(&mut Snapshot)) {
        self.snapshot_tx.send_modify(|s| {
            s.chunks = have.count();
            s.done = have.is_done();
            set(s);
        });
    }

    /// Advertises `have` through the control service; the second half of a publication, after
    /// [`snapshot`](Self::snapshot).
    fn advertise(&self, have: &Have) {
        let _ = self.progress_tx.send(Progress {
            prefix: have.prefix(),
            done: have.is_done(),
            count: have.count(),
            stripes: have.stripe_prefixes().to_vec(),
        });
    }
}

impl std::fmt::Debug for Receiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiver")
            .field("name", &self.manifest.name)
            .field("member", &self.member)
            .finish_non_exhaustive()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        if self.owns_engine {
            self.engine.shutdown();
        }
    }
}

/// How long [`Receiver::leave`] waits for discovery to answer.
const LEAVE_WITHIN: Duration = Duration::from_secs(1);

/// How often [`Receiver::linger`] rereads the member list: every [`LINGER_PER_MEMBER`] per
/// member listed, within [`LINGER_MIN`] and [`LINGER_MAX`], and at least every heartbeat. The
/// last receiver to finish is waited on by every other for up to one of these (the caller, a
/// Python pull, returns only then: every update pays it), while a fleet's rereads come to at most
/// one list per [`LINGER_PER_MEMBER`] at its source (small fleets), or each member's one per
/// [`LINGER_MAX`] (large ones).
fn linger_every(listed: usize, heartbeat: Duration) -> Duration {
    let per = LINGER_PER_MEMBER.saturating_mul(u32::try_from(listed).unwrap_or(u32::MAX));
    per.clamp(LINGER_MIN, LINGER_MAX).min(heartbeat)
}

const LINGER_PER_MEMBER: Duration = Duration::from_millis(2);
const LINGER_MIN: Duration = Duration::from_millis(10);
const LINGER_MAX: Duration = Duration::from_millis(100);

impl Receiver {
    /// Tests only: the faults and holds [`run`](Self::run) injects.
    #[cfg(feature = "__test-hooks")]
    pub fn set_test_hooks(&mut self, hooks: TestHooks) {
        self.hooks = hooks;
    }

    /// The manifest being pulled.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// This member's entry.
    pub fn member(&self) -> &Member {
        &self.member
    }

    /// The engine it pulls and relays on (its own, or the caller's with
    /// [`join_into`](Self::join_into)).
    pub fn engine(&self) -> &TransferEngine {
        &self.engine
    }

    /// Follows the pull's progress.
    pub fn progress(&self) -> watch::Receiver<Snapshot> {
        self.advert.snapshot_tx.subscribe()
    }

    /// The bytes of segment `i` as held now (a copy).
    pub fn segment_bytes(&self, i: usize) -> Option<Vec<u8>> {
        let seg = self.manifest.segments.get(i)?;
        self.payload.segment_bytes(i, seg.len)
    }

    /// The version pulled.
    pub fn version(&self) -> u64 {
        self.manifest.version
    }

    /// Bytes the CPU copied so far (counted, not timed): host memory copied out in pieces to
    /// be hashed (each chunk with BLAKE3 when it lands; at rest only where the CPU cannot
    /// compute CRC-32C over the memory in place) and, staged, the commit's copy. Divided by the payload: the copies per byte received, besides the data plane's
    /// own (the kernel's socket copy on TCP and io_uring).
    pub fn bytes_copied(&self) -> u64 {
        self.payload.copied.load(Ordering::Relaxed)
    }

    /// The destination tensors, by their local names.
    pub fn tensors(&self) -> &[String] {
        &self.payload.tensors
    }

    /// Staged mode: copies every tensor from its staging slice into its live one, after a
    /// [`run`](Self::run) that verified every chunk; returns the bytes copied. Until it is
    /// called the live tensors are untouched. Refused before the pull completed, and in place.
    /// The chunks are not verified again (the pull verified each as it landed and, with
    /// [`ReceiverOptions::verify_at_rest`], once more at rest); host to host each byte is
    /// copied once, directly, in pieces spread over half the CPUs (one to four threads). A copy that fails
    /// part way (a GPU copy the driver refused) leaves the live tensors partly written.
    pub fn commit(&self) -> Result<u64, BroadcastError> {
        let bytes = self.payload.commit(&self.manifest)?;
        tracing::info!(name = %self.manifest.name, version = self.manifest.version, bytes, "staged version committed");
        Ok(bytes)
    }

    /// Writes each segment to `dir/<segment name>` (as published), never through a symlink:
    /// each file is written to a new file beside it (created exclusively, which no symlink
    /// satisfies) and renamed over the name, which replaces a symlink there rather than the
    /// file it points to. Segment names are plain file names (checked with the manifest). The
    /// bytes are copied out of where they landed 1 MiB at a time (never a copy of a whole
    /// segment in memory).
    ///
    /// Pulling into files ([`join_to_dir`](Self::join_to_dir)), only once the pull completed:
    /// into its own directory, each temporary file is flushed to disk and renamed into place
    /// (it goes on being served to children from there); into another, copied the same way.
    ///
    /// The renames are one commit: every file is complete and flushed under its hidden name
    /// first, then a journal (`.ferry-commit.PID`) is written, the files renamed, and the
    /// journal removed. A process killed before the journal leaves the directory untouched
    /// (its hidden files aside); one killed after leaves the journal, and the next pull into
    /// the directory finishes the renames before anything else, and removes every hidden file
    /// of a killed pull. A reader that sees no `.ferry-commit.*` file sees a whole directory.
    pub fn write_to(&self, dir: &Path) -> Result<(), BroadcastError> {
        self.payload.write_to(&self.manifest, dir)
    }

    /// Fetches every chunk, verifying each, then checks every chunk once more at rest (a chunk
    /// corrupted after its verification is fetched again). Returns what it did. The receiver
    /// keeps serving afterwards until dropped (see [`linger`](Self::linger)).
    ///
    /// A pull in place into the caller's destinations that fails after its first READ is
    /// [`BroadcastError::Torn`]: the destinations hold neither their old version nor this one.
    pub async fn run(&mut self) -> Result<Summary, BroadcastError> {
        match self.run_inner().await {
            Ok(sum) => {
                self.payload.complete = true;
                Ok(sum)
            }
            Err(e) => Err(self.failed(e)),
        }
    }

    /// Why a pull stopped, as the caller should see it: `cause` itself, or, when the pull was
    /// in place into the caller's destinations and a READ into them had started,
    /// [`BroadcastError::Torn`] with `cause`. For a caller that abandons [`run`](Self::run)
    /// (a timeout) as much as for `run`'s own errors.
    pub fn failed(&self, cause: BroadcastError) -> BroadcastError {
        if !self.payload.tears() || matches!(cause, BroadcastError::Torn { .. }) {
            return cause;
        }
        tracing::warn!(name = %self.manifest.name, version = self.manifest.version,
            tensors = self.payload.tensors.len(), error = %cause, "pull in place failed: destinations torn");
        BroadcastError::Torn {
            name: self.manifest.name.clone(),
            version: self.manifest.version,
            tensors: self.payload.tensors.clone(),
            cause: Box::new(cause),
        }
    }

    /// Keeps serving (and heartbeating) after [`run`](Self::run) while another receiver of
    /// its source epoch and version has not finished, at most `max`; the list is read again
    /// every 2 ms per member listed, within 10 and 100 ms (or every heartbeat, if shorter),
    /// and the entry renewed every heartbeat. Every unfinished one, not only those
    /// that joined later: in the striped plan a member may be the parent of one that joined
    /// before it (a leaf of its tree), and a departure hands its children to others.
    pub async fn linger(&mut self, max: Duration) {
        let deadline = Instant::now() + max;
        let mut next_beat = Instant::now();
        while Instant::now() < deadline {
            let Ok(members) = self.discovery.members().await else {
                break;
            };
            let waiting = members.iter().any(|m| {
                m.role == Role::Receiver
                    && m.id != self.member.id
                    && !m.done
                    && m.source_epoch == self.origin.epoch
                    && m.version == self.manifest.version
            });
            if !waiting {
                break;
            }
            if Instant::now() >= next_beat {
                let _ = self.discovery.update(&self.member).await;
                next_beat = Instant::now() + self.opts.heartbeat;
            }
            // Checked more often than the heartbeat: the caller waits on this to return.
            tokio::time::sleep(linger_every(members.len(), self.opts.heartbeat)).await;
        }
    }

    /// Leaves the member list and stops serving, at once. A receiver that completed its pull
    /// reported itself done before [`run`](Self::run) returned, and the embedded tracker
    /// records the entry as last listed when it leaves, so its source sees it finished, not
    /// gone. A member that had it attached as a holder sees its control connection close and
    /// re-plans then, or, at the latest, when its list no longer names it (never waiting
    /// [`ReceiverOptions::stall_after`] for it). Discovery is given 1 s to answer (a stopped
    /// source's tracker would hold the caller for its whole timeout); unanswered, the entry's
    /// lease runs out instead.
    pub async fn leave(self) {
        self.leave_handle().leave().await;
        drop(self);
    }

    /// A way off the member list that outlives the receiver: for a caller that may abandon
    /// the pull (drop [`run`](Self::run)'s future and the receiver, as `ferry pull` does when
    /// interrupted) and should still leave the list at once, rather than stay listed (and
    /// planned as a parent by the other members) until its lease runs out.
    pub fn leave_handle(&self) -> LeaveHandle {
        LeaveHandle {
            discovery: self.discovery.clone(),
            id: self.member.id.clone(),
        }
    }
}

/// Takes a receiver off the member list ([`Receiver::leave_handle`]).
#[derive(Clone)]
pub struct LeaveHandle {
    discovery: Arc<dyn Discovery>,
    id: String,
}

impl std::fmt::Debug for LeaveHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaveHandle")
            .field("member", &self.id)
            .finish_non_exhaustive()
    }
}

impl LeaveHandle {
    /// Deregisters the member, giving discovery 1 s to answer (a stopped source's tracker
    /// would hold the caller for its whole timeout); unanswered, the entry's lease runs out
    /// instead. The source says at once that it left unfinished, and the other members drop
    /// it from their plans at their next list. Leaving twice is harmless.
    pub async fn leave(&self) {
        let gone = self.discovery.deregister(&self.id);
        if tokio::time::timeout(LEAVE_WITHIN, gone).await.is_err() {
            tracing::info!(member = %self.id, "discovery did not answer the leave; the entry's lease runs out instead");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small fleet's lingering members reread the list every 10 ms (the last to finish is
    /// not waited on for 100 ms), a large one's every 100 ms (its source is not asked more
    /// than before), and never less often than the heartbeat.
    #[test]
    fn lingering_members_reread_the_list_as_often_as_the_fleet_allows() {
        let beat = Duration::from_millis(500);
        let ms = Duration::from_millis;
        assert_eq!(linger_every(5, beat), ms(10));
        assert_eq!(linger_every(20, beat), ms(40));
        assert_eq!(linger_every(4096, beat), ms(100));
        assert_eq!(linger_every(usize::MAX, beat), ms(100));
        assert_eq!(linger_every(5, ms(5)), ms(5));
    }
}

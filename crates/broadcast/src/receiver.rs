//! A receiver: fetches the manifest's chunks of one version from its parent in the chain
//! ([`plan`](crate::plan)), verifies each against the manifest's BLAKE3, and serves what it
//! verified to the member after it. It pulls into buffers of its own ([`Receiver::join`]) or
//! into the caller's destinations ([`Receiver::join_into`]: in place, or staged and then
//! committed), and serves from wherever the chunks landed ([`layout`](crate::layout)).
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
//!   shape, where [`Destinations::kinds`] says them), one published tensor to a destination,
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

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferry::{
    Access, Batch, DataPlane, MemoryRegion, Peer, Registration, RemoteSegment, TransferEngine,
};
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};

use crate::control::{self, CtlClient, CtlState, Progress, Reply, Request};
use crate::discovery::Discovery;
use crate::error::BroadcastError;
use crate::landing::{Landing, LandingFile, crc_of_file, land, partial_name, room_for};
use crate::layout::{self, LocalExtents, Slice};
use crate::manifest::{Digest, MAX_TOTAL_BYTES, Manifest};
use crate::plan::{Have, Member, Role};
use crate::pull::{Command, Config as PullConfig, Event, Outcome, Pull};

/// How a receiver runs.
#[derive(Clone, Debug)]
pub struct ReceiverOptions {
    /// The IP its Ferry listener and control service listen on (any free ports). `None`: the
    /// IP it reaches the source from, which the other members can reach too.
    pub listen_ip: Option<IpAddr>,
    /// Which data plane carries the chunks.
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
    /// Most payload bytes accepted from a manifest (`None`: [`MAX_TOTAL_BYTES`]); checked
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
/// [`Receiver::set_test_hooks`]); the driver turns each into what its [`Pull`] is told.
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

/// Waits for `n` to be notified (never, if `None`).
async fn notified(n: &Option<Arc<tokio::sync::Notify>>) {
    match n {
        Some(n) => n.notified().await,
        None => std::future::pending().await,
    }
}

/// What the driver holds beside its [`Pull`] while a pull runs.
struct Drive {
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
    /// Members listed.
    pub peers: usize,
    /// The data addresses of the stripes' current parents, each once, comma-separated.
    pub parent: String,
    /// Whether every chunk is verified.
    pub done: bool,
}

/// An attached holder's data path: what fetches read from. What it advertised and every
/// decision about it are [`Pull`]'s.
struct Link {
    peer: Peer,
    from_source: bool,
    /// Per segment: `(offset in the segment, offset in the remote segment, remote segment)`.
    segs: Vec<Vec<(u64, u64, RemoteSegment)>>,
    /// `segs` as `(offset in the segment, length)`.
    ranges: Vec<Vec<(u64, u64)>>,
    poll: JoinHandle<()>,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.poll.abort();
    }
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

/// What a fetch task reports.
struct Fetched {
    chunk: usize,
    from: String,
    /// The holder's attachment the fetch was asked of ([`Command::Fetch`]).
    generation: u64,
    from_source: bool,
    /// `Ok(true)`: verified; `Ok(false)`: BLAKE3 mismatch; `Err`: the READ failed.
    result: Result<bool, String>,
    /// Pulling into files: the verified chunk could not be written to its file.
    write_failed: Option<std::io::Error>,
}

/// A receiver that joined a broadcast: its engine and buffers are set up and registered, its
/// control service runs and it is listed. [`run`](Self::run) fetches.
pub struct Receiver {
    engine: TransferEngine,
    /// Whether the engine is this receiver's own (shut down with it) or the caller's.
    owns_engine: bool,
    discovery: Arc<dyn Discovery>,
    manifest: Manifest,
    source_epoch: u64,
    source_ip: IpAddr,
    /// Where each segment lands: this receiver's buffers, the caller's destinations or their
    /// staging slices, and scratch for bytes no destination takes.
    layout: Vec<LocalExtents>,
    /// `layout` as `(offset in the segment, length)`.
    ranges: Vec<Vec<(u64, u64)>>,
    /// Buffers this receiver allocated (whole segments, or scratch).
    _own: Vec<Registration>,
    /// Staged: `(tensor, staging, live)` for [`commit`](Self::commit).
    staged: Option<Vec<(String, Slice, Slice)>>,
    /// The destination tensors (local names).
    tensors: Vec<String>,
    /// Whether a READ into the destinations was started.
    touched: std::sync::atomic::AtomicBool,
    /// Bytes the CPU copied: host memory copied out to be hashed, and commits.
    copied: Arc<AtomicU64>,
    /// Whether [`run`](Self::run) verified every chunk.
    pulled: bool,
    timeline: Timeline,
    member: Member,
    opts: ReceiverOptions,
    progress_tx: watch::Sender<Progress>,
    snapshot_tx: watch::Sender<Snapshot>,
    /// Held for its drop: the control listener closes with the member.
    _ctl: control::Service,
    /// A pull into a directory ([`join_to_dir`](Self::join_to_dir)): where the chunks go.
    files: Option<Landing>,
    /// When the completed pull was reported done to discovery.
    reported_done: Option<Instant>,
    /// What the tests inject (none, unless feature `__test-hooks`).
    hooks: TestHooks,
    /// The source as listed when the manifest was fetched (the plan's source until a list
    /// is read).
    source: Member,
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

fn control_err(addr: &str, reason: impl Into<String>) -> BroadcastError {
    BroadcastError::Control {
        addr: addr.to_owned(),
        reason: reason.into(),
    }
}

/// An address with an unspecified IP (a member that listens on all interfaces) made reachable
/// with `ip`.
fn reachable(addr: &str, ip: IpAddr) -> String {
    match addr.parse::<SocketAddr>() {
        Ok(a) if a.ip().is_unspecified() => SocketAddr::new(ip, a.port()).to_string(),
        _ => addr.to_owned(),
    }
}

/// Finds the source of `name` through `discovery` and fetches the manifest of `version`
/// (`None`: the newest). Returns it, the source epoch, the source's IP and this end's IP.
async fn manifest_from_source(
    discovery: &Arc<dyn Discovery>,
    wanted: Option<&str>,
    opts: &ReceiverOptions,
) -> Result<(Manifest, u64, IpAddr, IpAddr, Member), BroadcastError> {
    let version = opts.version;
    let name = wanted.unwrap_or("(any)");
    let timeout = Duration::from_secs(5);
    let source = discovery
        .members()
        .await?
        .into_iter()
        .find(|m| m.role == Role::Source)
        .ok_or_else(|| BroadcastError::NoSource {
            name: name.to_owned(),
            discovery: discovery.describe(),
        })?;
    let mut ctl = CtlClient::connect_keyed(&source.ctl_addr, timeout, opts.keys.as_ref()).await?;
    let source_ip = match source.ctl_addr.parse::<SocketAddr>() {
        Ok(a) if !a.ip().is_unspecified() => a.ip(),
        _ => ctl.local_addr().ip(),
    };
    let (manifest, source_epoch) = match ctl.call(&Request::Manifest { version }, timeout).await? {
        Reply::Manifest {
            manifest,
            source_epoch,
        } => (manifest, source_epoch),
        _ => return Err(control_err(&source.ctl_addr, "answered with no manifest")),
    };
    if let Some(expected) = opts.expect_manifest {
        let found = manifest.digest();
        if found != expected {
            return Err(BroadcastError::ManifestDigest {
                source_addr: source.ctl_addr.clone(),
                expected,
                found,
            });
        }
    }
    let limit = opts
        .max_bytes
        .unwrap_or(MAX_TOTAL_BYTES)
        .min(MAX_TOTAL_BYTES);
    if manifest.total_bytes() > limit {
        return Err(BroadcastError::ManifestFrom {
            addr: source.ctl_addr.clone(),
            source: crate::manifest::ManifestError::TooManyBytes {
                declared: manifest.total_bytes(),
                limit,
            },
        });
    }
    if wanted.is_some_and(|n| n != manifest.name) {
        return Err(control_err(
            &source.ctl_addr,
            format!("publishes {:?}, not {name:?}", manifest.name),
        ));
    }
    if version.is_some_and(|v| v != manifest.version) {
        return Err(control_err(
            &source.ctl_addr,
            format!(
                "answered version {} of {name:?} for version {}",
                manifest.version,
                version.unwrap_or_default()
            ),
        ));
    }
    Ok((
        manifest,
        source_epoch,
        source_ip,
        ctl.local_addr().ip(),
        source,
    ))
}

/// How long [`Receiver::leave`] waits for discovery to answer.
const LEAVE_WITHIN: Duration = Duration::from_secs(1);

/// How long a finished receiver stays listed, done, at least ([`Receiver::leave`]).
const FINISHED_LISTED: Duration = Duration::from_millis(250);

/// How often [`Receiver::linger`] rereads the member list at most.
const LINGER_CHECK: Duration = Duration::from_millis(100);

/// For this long after a pull starts, the member list is reread (and the plan made again)
/// every [`EARLY_RELIST`], not only every heartbeat: the members of a fleet join within
/// moments of each other, and until a member lists the others it takes the stripes whose
/// groups it does not know yet from the source itself.
const EARLY: Duration = Duration::from_secs(2);
const EARLY_RELIST: Duration = Duration::from_millis(50);

/// Registration names of scratch buffers are unique within the process.
static SCRATCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Allocates and registers `len` zeroed bytes of host memory on `engine` as `name`; a
/// failed allocation is an error, never an abort.
fn alloc(engine: &TransferEngine, len: u64, name: &str) -> Result<Registration, BroadcastError> {
    alloc_for(engine, len, name, Access::REMOTE_READ)
}

/// [`alloc`] with `access` (landing slots hold unverified bytes: served to no one).
fn alloc_for(
    engine: &TransferEngine,
    len: u64,
    name: &str,
    access: Access,
) -> Result<Registration, BroadcastError> {
    let n = usize::try_from(len).map_err(|_| {
        BroadcastError::io(
            format!("segment {name:?}"),
            std::io::Error::other("longer than this machine's address space"),
        )
    })?;
    // Aligned to 16, not to a page: the allocator then takes zeroed memory from the kernel
    // (calloc, fresh pages) instead of writing zeros over every page first, which cost each
    // receiver a pass over its whole payload before joining (0.1 to 1.5 s per 128 MiB with
    // several receivers starting on one machine: the timeline's manifest-to-joined step).
    let region = MemoryRegion::alloc_zeroed(n, 16).map_err(|e| {
        BroadcastError::io(
            format!("allocating {len} bytes for {name:?}"),
            std::io::Error::other(e.to_string()),
        )
    })?;
    Ok(engine.register(region, access, name)?)
}

/// What joining sets up, before the control service starts.
struct Joined {
    engine: TransferEngine,
    owns_engine: bool,
    manifest: Manifest,
    source_epoch: u64,
    source_ip: IpAddr,
    ip: IpAddr,
    layout: Vec<LocalExtents>,
    own: Vec<Registration>,
    staged: Option<Vec<(String, Slice, Slice)>>,
    tensors: Vec<String>,
    timeline: Timeline,
    files: Option<Landing>,
    source: Member,
}

impl Receiver {
    /// Joins the broadcast `name` (`None`: whatever the source listed publishes) through
    /// `discovery`: finds its source, fetches the manifest (of [`ReceiverOptions::version`]),
    /// allocates and registers one buffer per segment on an engine of its own, starts its
    /// control service and lists itself.
    pub async fn join(
        discovery: Arc<dyn Discovery>,
        name: Option<&str>,
        opts: ReceiverOptions,
    ) -> Result<Self, BroadcastError> {
        let join_start = unix_now();
        let (manifest, source_epoch, source_ip, local_ip, source) =
            manifest_from_source(&discovery, name, &opts).await?;
        let timeline = Timeline {
            join_start: Some(join_start),
            manifest: Some(unix_now()),
            ..Default::default()
        };
        let ip = opts.listen_ip.unwrap_or(local_ip);
        let mut builder = TransferEngine::builder()
            .data_plane(opts.data_plane)
            .listen(SocketAddr::new(ip, 0));
        if let Some(k) = &opts.keys {
            builder = builder.auth_keyring(k.clone());
        }
        let engine = builder.build()?;
        let mut own = Vec::with_capacity(manifest.segments.len());
        let mut layout = Vec::with_capacity(manifest.segments.len());
        for seg in &manifest.segments {
            let reg = alloc(&engine, seg.len, &seg.name)?;
            layout.push(if seg.len == 0 {
                Vec::new()
            } else {
                vec![(0, Slice::whole(&reg, &seg.name))]
            });
            own.push(reg);
        }
        let j = Joined {
            engine,
            owns_engine: true,
            manifest,
            source_epoch,
            source_ip,
            ip,
            layout,
            own,
            staged: None,
            tensors: Vec::new(),
            timeline,
            files: None,
            source,
        };
        Self::start(j, discovery, opts).await
    }

    /// Joins the broadcast `name` to pull it into the directory `dir`, each segment into the
    /// file of its name (as [`join`](Self::join) then [`write_to`](Self::write_to) would, but
    /// never holding the payload in memory). Before anything is allocated or listed, `dir` is
    /// made if missing and must have room for the payload (`statvfs`: the blocks free to
    /// this user). Each segment is written, chunk by chunk as it is verified, into a hidden
    /// temporary file beside its name (`.NAME.ferry-partial.PID`, the payload's length from
    /// the start), which children read relayed chunks from; [`write_to`](Self::write_to)`(dir)`
    /// renames them into place once the pull is complete, and a receiver dropped before that
    /// removes them. Memory: [`ReceiverOptions::window`] chunk-sized landing slots (and as many
    /// copies of a chunk being written), whatever the payload's size.
    pub async fn join_to_dir(
        discovery: Arc<dyn Discovery>,
        name: Option<&str>,
        dir: &Path,
        opts: ReceiverOptions,
    ) -> Result<Self, BroadcastError> {
        let join_start = unix_now();
        let (manifest, source_epoch, source_ip, local_ip, source) =
            manifest_from_source(&discovery, name, &opts).await?;
        let timeline = Timeline {
            join_start: Some(join_start),
            manifest: Some(unix_now()),
            ..Default::default()
        };
        room_for(dir, manifest.total_bytes())?;
        let ip = opts.listen_ip.unwrap_or(local_ip);
        let mut builder = TransferEngine::builder()
            .data_plane(opts.data_plane)
            .listen(SocketAddr::new(ip, 0));
        if let Some(k) = &opts.keys {
            builder = builder.auth_keyring(k.clone());
        }
        let engine = builder.build()?;
        let mut landing = Landing {
            dir: dir.to_owned(),
            segs: Vec::with_capacity(manifest.segments.len()),
            slots: Vec::new(),
            free: Arc::default(),
            renamed: std::sync::atomic::AtomicBool::new(false),
        };
        // Nothing of this pull is left behind if it fails: the files made so far are removed
        // when `landing` drops.
        for seg in &manifest.segments {
            let tmp = partial_name(dir, &seg.name);
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&tmp)
                .map_err(|e| BroadcastError::io(format!("creating {}", tmp.display()), e))?;
            let file = Arc::new(file);
            landing.segs.push(LandingFile {
                file: file.clone(),
                tmp: tmp.clone(),
                reg: None,
            });
            file.set_len(seg.len)
                .map_err(|e| BroadcastError::io(format!("sizing {}", tmp.display()), e))?;
            if seg.len > 0 {
                let reg = engine.publish_file_named(&tmp, Access::REMOTE_READ, &seg.name)?;
                if let Some(last) = landing.segs.last_mut() {
                    last.reg = Some(reg);
                }
            }
        }
        let chunk = manifest.chunks.iter().map(|c| c.len).max().unwrap_or(0);
        let slots = opts.window.max(1) as u64;
        let mut own = Vec::new();
        if chunk > 0 {
            let k = SCRATCH.fetch_add(1, Ordering::Relaxed);
            let reg_name = format!("{}.v{}.landing.{k}", manifest.name, manifest.version);
            let reg = alloc_for(&engine, slots * chunk, &reg_name, Access::LOCAL)?;
            let whole = Slice::whole(&reg, &reg_name);
            landing.slots = (0..slots).map(|i| whole.sub(i * chunk, chunk)).collect();
            *landing
                .free
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                (0..slots as usize).rev().collect();
            own.push(reg);
        }
        let layout = vec![Vec::new(); manifest.segments.len()];
        let j = Joined {
            engine,
            owns_engine: true,
            manifest,
            source_epoch,
            source_ip,
            ip,
            layout,
            own,
            staged: None,
            tensors: Vec::new(),
            timeline,
            files: Some(landing),
            source,
        };
        Self::start(j, discovery, opts).await
    }

    /// Joins the broadcast `name` to pull it into `dests`: slices of registrations of
    /// `engine` (the caller's; it must listen for this receiver to relay, and it is not shut
    /// down with the receiver). Before any byte moves, every published tensor is matched by
    /// name (after [`Destinations::rename`]) and size with a destination; a missing, extra
    /// (unless [`Destinations::subset`]) or differently sized tensor is one
    /// [`BroadcastError::Mismatch`] listing them all. Bytes no destination takes (a
    /// `.safetensors` header, a tensor left out) land in a scratch buffer of this receiver's.
    /// Chunks are relayed onward from where they landed.
    ///
    /// In place ([`Destinations::staging`] `None`) the pull writes the live tensors: a pull that
    /// fails after its first READ is [`BroadcastError::Torn`]. Staged, it writes the staging
    /// slices, and [`commit`](Self::commit) copies them into the live ones; a failed pull
    /// leaves the live tensors untouched.
    pub async fn join_into(
        engine: &TransferEngine,
        discovery: Arc<dyn Discovery>,
        name: Option<&str>,
        dests: Destinations,
        opts: ReceiverOptions,
    ) -> Result<Self, BroadcastError> {
        let join_start = unix_now();
        let (manifest, source_epoch, source_ip, local_ip, source) =
            manifest_from_source(&discovery, name, &opts).await?;
        let timeline = Timeline {
            join_start: Some(join_start),
            manifest: Some(unix_now()),
            ..Default::default()
        };
        let matched = match_tensors(&manifest, &dests)?;
        // Where each tensor of `into` lands: itself, or its staging (matched by name above).
        let target: Vec<Slice> = match &dests.staging {
            None => dests.into.iter().map(|(_, s)| s.clone()).collect(),
            Some(st) => {
                let by_name: HashMap<&str, &Slice> =
                    st.iter().map(|(n, s)| (n.as_str(), s)).collect();
                dests
                    .into
                    .iter()
                    .map(|(n, s)| by_name.get(n.as_str()).map_or(s, |st| *st).clone())
                    .collect()
            }
        };
        // Per segment: the taken entries, in offset order, where they land.
        let mut taken: Vec<Vec<(u64, Slice)>> = vec![Vec::new(); manifest.segments.len()];
        for &(e, d) in &matched {
            let entry = &manifest.entries[e];
            let shard = dests.shards.get(&dests.into[d].0).copied().unwrap_or(0);
            if !target[d].is_empty() {
                taken[entry.segment as usize].push((entry.offset + shard, target[d].clone()));
            }
        }
        for (si, t) in taken.iter_mut().enumerate() {
            t.sort_by_key(|(at, _)| *at);
            if let Some(w) = t.windows(2).find(|w| w[0].0 + w[0].1.len() > w[1].0) {
                return Err(BroadcastError::Mismatch {
                    name: manifest.name.clone(),
                    version: manifest.version,
                    problems: vec![format!(
                        "tensors at {} and {} of segment {:?} overlap: they cannot both be received in place",
                        w[0].0, w[1].0, manifest.segments[si].name
                    )],
                });
            }
        }
        let (gap_total, gaps) = layout::gaps(&manifest, &taken);
        let mut own = Vec::new();
        let scratch = if gap_total > 0 {
            let k = SCRATCH.fetch_add(1, Ordering::Relaxed);
            let reg_name = format!("{}.v{}.scratch.{k}", manifest.name, manifest.version);
            let reg = alloc(engine, gap_total, &reg_name)?;
            let whole = Slice::whole(&reg, &reg_name);
            own.push(reg);
            Some(whole)
        } else {
            None
        };
        let mut layout = Vec::with_capacity(manifest.segments.len());
        let mut packed = 0u64;
        for (t, g) in taken.into_iter().zip(gaps) {
            let mut ext: LocalExtents = t;
            if let Some(scratch) = &scratch {
                for (at, len) in g {
                    ext.push((at, scratch.sub(packed, len)));
                    packed += len;
                }
            }
            ext.sort_by_key(|(at, _)| *at);
            layout.push(ext);
        }
        let tensors: Vec<String> = matched
            .iter()
            .map(|&(_, d)| dests.into[d].0.clone())
            .collect();
        let staged = dests.staging.as_ref().map(|_| {
            matched
                .iter()
                .map(|&(_, d)| {
                    let (n, live) = &dests.into[d];
                    (n.clone(), target[d].clone(), live.clone())
                })
                .collect()
        });
        let ip = match engine.local_addr() {
            Some(a) if !a.ip().is_unspecified() => a.ip(),
            _ => opts.listen_ip.unwrap_or(local_ip),
        };
        let j = Joined {
            engine: engine.clone(),
            owns_engine: false,
            manifest,
            source_epoch,
            source_ip,
            ip,
            layout,
            own,
            staged,
            tensors,
            timeline,
            files: None,
            source,
        };
        Self::start(j, discovery, opts).await
    }

    async fn start(
        j: Joined,
        discovery: Arc<dyn Discovery>,
        opts: ReceiverOptions,
    ) -> Result<Self, BroadcastError> {
        let Joined {
            engine,
            owns_engine,
            manifest,
            source_epoch,
            source_ip,
            ip,
            layout,
            own,
            staged,
            tensors,
            mut timeline,
            files,
            source,
        } = j;
        let ranges = layout
            .iter()
            .map(|seg| seg.iter().map(|(at, s)| (*at, s.len())).collect())
            .collect();
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .await
            .map_err(|e| BroadcastError::io(format!("control listener on {ip}"), e))?;
        let ctl_addr = listener
            .local_addr()
            .map_err(|e| BroadcastError::io("control listener address", e))?;
        let (progress_tx, progress) = watch::channel(Progress::default());
        let state = Arc::new(CtlState {
            source_epoch,
            manifests: std::sync::Mutex::new(Vec::new()),
            source_layouts: std::sync::Mutex::new(Default::default()),
            version: manifest.version,
            // A pull into files serves each segment whole from its file, under its own name.
            layout: Some(if files.is_some() {
                layout::identity(&manifest)
            } else {
                layout::to_wire(&layout)
            }),
            progress,
            tracker: None,
            auth: opts.keys.clone().map(|k| {
                (
                    ferry::core_types::auth::ServerAuth::new(k),
                    engine.peer_id(),
                    engine.epoch(),
                )
            }),
        });
        let ctl = control::Service::start(listener, state);
        let data_addr = engine
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let member = Member {
            id: engine.peer_id().to_string(),
            epoch: engine.epoch().0,
            source_epoch,
            data_addr: data_addr.clone(),
            ctl_addr: ctl_addr.to_string(),
            role: Role::Receiver,
            progress: 0,
            done: manifest.chunks.is_empty(),
            order: 0,
            version: manifest.version,
            rate: 0,
            number: None,
        };
        if let Some(found) = discovery.register(&member).await?
            && found != source_epoch
        {
            return Err(BroadcastError::SourceRestarted {
                name: manifest.name.clone(),
                had: source_epoch,
                found,
            });
        }
        timeline.joined = Some(unix_now());
        let total = manifest.total_bytes();
        let (snapshot_tx, _) = watch::channel(Snapshot {
            total,
            ..Default::default()
        });
        let name = manifest.name.clone();
        tracing::info!(name, version = manifest.version, id = %member.id, %data_addr, %ctl_addr, source_epoch,
            chunks = manifest.chunks.len(), bytes = total, staged = staged.is_some(), "receiver joined");
        Ok(Self {
            engine,
            owns_engine,
            discovery,
            manifest,
            source_epoch,
            source_ip,
            layout,
            ranges,
            _own: own,
            staged,
            tensors,
            touched: std::sync::atomic::AtomicBool::new(false),
            copied: Arc::new(AtomicU64::new(0)),
            pulled: false,
            timeline,
            member,
            opts,
            progress_tx,
            snapshot_tx,
            _ctl: ctl,
            files,
            reported_done: None,
            hooks: TestHooks::default(),
            source,
        })
    }

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

    /// Follows the pull's progress.
    pub fn progress(&self) -> watch::Receiver<Snapshot> {
        self.snapshot_tx.subscribe()
    }

    /// The bytes of segment `i` as held now (a copy).
    pub fn segment_bytes(&self, i: usize) -> Option<Vec<u8>> {
        let seg = self.manifest.segments.get(i)?;
        let mut v = vec![0u8; usize::try_from(seg.len).ok()?];
        if let Some(l) = &self.files {
            use std::os::unix::fs::FileExt;
            l.segs.get(i)?.file.read_exact_at(&mut v, 0).ok()?;
            return Some(v);
        }
        for (at, slice) in &self.layout[i] {
            let dst = v.get_mut(*at as usize..(*at + slice.len()) as usize)?;
            slice.read(0, dst).ok()?;
        }
        Some(v)
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
        self.copied.load(Ordering::Relaxed)
    }

    /// The destination tensors, by their local names.
    pub fn tensors(&self) -> &[String] {
        &self.tensors
    }

    /// Staged mode: copies every tensor from its staging slice into its live one, after a
    /// [`run`](Self::run) that verified every chunk; returns the bytes copied. Until it is
    /// called the live tensors are untouched. Refused before the pull completed, and in place.
    /// The chunks are not verified again (the pull verified each as it landed and, with
    /// [`ReceiverOptions::verify_at_rest`], once more at rest); host to host each byte is
    /// copied once, directly, in pieces spread over half the CPUs (one to four threads). A copy that fails
    /// part way (a GPU copy the driver refused) leaves the live tensors partly written.
    pub fn commit(&self) -> Result<u64, BroadcastError> {
        let refuse = |reason: &str| BroadcastError::Commit {
            name: self.manifest.name.clone(),
            version: self.manifest.version,
            reason: reason.to_owned(),
        };
        let Some(staged) = &self.staged else {
            return Err(refuse("the pull was in place: there is nothing to commit"));
        };
        if !self.pulled {
            return Err(refuse("the pull has not completed"));
        }
        // Half the CPUs, one to four: the rest stay with the application and the relaying.
        let threads = std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).clamp(1, 4));
        let cpu = layout::copy_all(staged, threads, layout::COPY_PIECE)
            .map_err(|e| refuse(&format!("copying tensor {e}")))?;
        self.copied.fetch_add(cpu, Ordering::Relaxed);
        let bytes: u64 = staged.iter().map(|(_, _, live)| live.len()).sum();
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
    pub fn write_to(&self, dir: &Path) -> Result<(), BroadcastError> {
        if let Some(l) = &self.files {
            return self.rename_into(l, dir);
        }
        std::fs::create_dir_all(dir)
            .map_err(|e| BroadcastError::io(format!("creating {}", dir.display()), e))?;
        for (i, seg) in self.manifest.segments.iter().enumerate() {
            let path = dir.join(&seg.name);
            let tmp = dir.join(format!(
                ".{}.ferry-partial.{}",
                seg.name,
                std::process::id()
            ));
            let written = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .and_then(|f| self.write_segment(i, f))
                .and_then(|()| std::fs::rename(&tmp, &path));
            if let Err(e) = written {
                let _ = std::fs::remove_file(&tmp);
                return Err(BroadcastError::io(format!("writing {}", path.display()), e));
            }
        }
        Ok(())
    }

    /// Pulling into files, after a complete pull: each temporary file flushed and renamed into
    /// `dir` (its own directory), or copied there beside its name and renamed.
    fn rename_into(&self, l: &Landing, dir: &Path) -> Result<(), BroadcastError> {
        if !self.pulled {
            return Err(BroadcastError::io(
                format!("writing {}", dir.display()),
                std::io::Error::other("the pull has not completed: its files stay temporary"),
            ));
        }
        let same = std::fs::canonicalize(dir).ok() == std::fs::canonicalize(&l.dir).ok();
        if !same {
            std::fs::create_dir_all(dir)
                .map_err(|e| BroadcastError::io(format!("creating {}", dir.display()), e))?;
        }
        for (seg, f) in self.manifest.segments.iter().zip(&l.segs) {
            let path = dir.join(&seg.name);
            let done = if same {
                f.file
                    .sync_data()
                    .and_then(|()| std::fs::rename(&f.tmp, &path))
            } else {
                // From the file held open (renamed or not), never through a symlink there.
                let tmp = partial_name(dir, &seg.name);
                let copied = (|| {
                    use std::io::Seek;
                    let mut from = f.file.try_clone()?;
                    from.seek(std::io::SeekFrom::Start(0))?;
                    let mut to = std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .open(&tmp)?;
                    std::io::copy(&mut from, &mut to)?;
                    to.sync_data()?;
                    std::fs::rename(&tmp, &path)
                })();
                if copied.is_err() {
                    let _ = std::fs::remove_file(&tmp);
                }
                copied
            };
            done.map_err(|e| BroadcastError::io(format!("writing {}", path.display()), e))?;
        }
        if same {
            l.renamed.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Writes segment `i`, extent by extent in offset order, 1 MiB at a time.
    fn write_segment(&self, i: usize, file: std::fs::File) -> std::io::Result<()> {
        use std::io::Write;
        const PIECE: u64 = 1 << 20;
        let mut out = std::io::BufWriter::with_capacity(PIECE as usize, file);
        let mut buf = Vec::new();
        for (_, slice) in &self.layout[i] {
            let mut at = 0;
            while at < slice.len() {
                let n = PIECE.min(slice.len() - at);
                buf.resize(n as usize, 0);
                slice.read(at, &mut buf).map_err(std::io::Error::other)?;
                out.write_all(&buf)?;
                at += n;
            }
        }
        out.flush()
    }

    /// This member's entry as it stands: its progress, and its download rate since
    /// `first_request` (once a second has passed: before, too few chunks to tell a straggler).
    /// Handed to the discovery task ([`watch_discovery`]), which renews it.
    fn beat(&mut self, have: &Have, first_request: Option<Instant>, me: &watch::Sender<Member>) {
        self.member.progress = have.count();
        if let Some(t) = first_request
            && !self.member.done
            && t.elapsed() >= Duration::from_secs(1)
        {
            let bytes = self.snapshot_tx.borrow().bytes;
            self.member.rate = (bytes as f64 / t.elapsed().as_secs_f64()) as u64;
        }
        self.member.done = have.is_done();
        let _ = me.send(self.member.clone());
    }

    /// Renews this member's entry now (the pull's end: its last progress, done).
    async fn heartbeat_now(&self) -> Result<(), BroadcastError> {
        match self.discovery.update(&self.member).await {
            Ok(Some(found)) if found != self.source_epoch => Err(self.restarted(found)),
            Ok(_) => Ok(()),
            Err(e) => {
                tracing::debug!(error = %e, "heartbeat failed");
                Ok(())
            }
        }
    }

    /// The error of a source found at epoch `found`.
    fn restarted(&self, found: u64) -> BroadcastError {
        BroadcastError::SourceRestarted {
            name: self.manifest.name.clone(),
            had: self.source_epoch,
            found,
        }
    }

    /// Connects to `m` as a holder and starts following its progress.
    async fn attach(
        &self,
        m: &Member,
        polls: &mpsc::UnboundedSender<Event>,
    ) -> Result<Link, BroadcastError> {
        let data_addr = reachable(&m.data_addr, self.source_ip);
        let ctl_addr = reachable(&m.ctl_addr, self.source_ip);
        let peer = match self.engine.connect(data_addr.as_str()).await {
            Ok(p) => p,
            Err(ferry::Error::StaleEpoch { found, .. }) if m.role == Role::Source => {
                return Err(BroadcastError::SourceRestarted {
                    name: self.manifest.name.clone(),
                    had: self.source_epoch,
                    found: found.0,
                });
            }
            Err(e) => return Err(e.into()),
        };
        if m.role == Role::Source && peer.epoch().0 != self.source_epoch {
            return Err(BroadcastError::SourceRestarted {
                name: self.manifest.name.clone(),
                had: self.source_epoch,
                found: peer.epoch().0,
            });
        }
        let keys = self.opts.keys.as_ref();
        let mut ctl = CtlClient::connect_keyed(&ctl_addr, Duration::from_secs(3), keys).await?;
        let version = self.manifest.version;
        let wire = if m.role == Role::Source {
            let asked = Request::Layout {
                version: Some(version),
            };
            match ctl.call(&asked, Duration::from_secs(3)).await {
                Ok(Reply::Layout {
                    version: v,
                    segments,
                    ..
                }) if v == version => segments,
                Ok(_) => {
                    return Err(control_err(
                        &ctl_addr,
                        format!("answered layout of version {version} with another"),
                    ));
                }
                Err(e) => {
                    // A source from before layouts (it closed the connection on the request):
                    // every segment under its own name.
                    tracing::debug!(error = %e, "source gave no layout; taking the identity");
                    ctl = CtlClient::connect_keyed(&ctl_addr, Duration::from_secs(3), keys).await?;
                    layout::identity(&self.manifest)
                }
            }
        } else {
            match ctl
                .call(&Request::Layout { version: None }, Duration::from_secs(3))
                .await?
            {
                Reply::Layout {
                    version, segments, ..
                } if version == self.manifest.version => segments,
                Reply::Layout { version, .. } => {
                    return Err(control_err(
                        &ctl_addr,
                        format!("holds version {version}, not {}", self.manifest.version),
                    ));
                }
                _ => {
                    return Err(control_err(
                        &ctl_addr,
                        "answered layout with something else",
                    ));
                }
            }
        };
        layout::check(&self.manifest, &wire).map_err(|e| control_err(&ctl_addr, e))?;
        let mut resolved: HashMap<String, RemoteSegment> = HashMap::new();
        let mut segs = Vec::with_capacity(wire.len());
        let mut ranges = Vec::with_capacity(wire.len());
        for ext in wire {
            let mut v = Vec::with_capacity(ext.len());
            let mut r = Vec::with_capacity(ext.len());
            for e in ext {
                let seg = match resolved.get(&e.segment) {
                    Some(s) => s.clone(),
                    None => {
                        let s = peer.segment(&e.segment)?;
                        resolved.insert(e.segment.clone(), s.clone());
                        s
                    }
                };
                if e.offset + e.len > seg.len() {
                    return Err(control_err(
                        &data_addr,
                        format!(
                            "segment {:?} has {} bytes, the layout names {} at {}",
                            e.segment,
                            seg.len(),
                            e.len,
                            e.offset
                        ),
                    ));
                }
                r.push((e.seg_offset, e.len));
                v.push((e.seg_offset, e.offset, seg));
            }
            segs.push(v);
            ranges.push(r);
        }
        let id = m.id.clone();
        let tx = polls.clone();
        let stall = self.opts.stall_after;
        let poll = tokio::spawn(async move {
            let mut after = 0u64;
            let mut after_count = 0u64;
            let wait = stall.min(Duration::from_secs(2));
            loop {
                let req = Request::Progress {
                    after,
                    wait_ms: wait.as_millis() as u64,
                    after_count: Some(after_count),
                };
                match ctl.call(&req, wait + Duration::from_secs(2)).await {
                    Ok(Reply::Progress {
                        source_epoch,
                        prefix,
                        done,
                        version,
                        count,
                        stripes,
                    }) => {
                        after = prefix;
                        after_count = count;
                        let msg = Event::Progress {
                            id: id.clone(),
                            source_epoch,
                            prefix,
                            done,
                            version,
                            count,
                            stripes,
                        };
                        if tx.send(msg).is_err() || done {
                            return;
                        }
                    }
                    Ok(_) => {
                        let _ = tx.send(Event::PollFailed {
                            id,
                            reason: "answered progress with something else".into(),
                        });
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(Event::PollFailed {
                            id,
                            reason: e.to_string(),
                        });
                        return;
                    }
                }
            }
        });
        tracing::info!(holder = %m.id, %data_addr, role = ?m.role, "attached");
        Ok(Link {
            peer,
            from_source: m.role == Role::Source,
            segs,
            ranges,
            poll,
        })
    }

    /// The pieces of chunk `i` as held here: `(slice, offset in it, length)`, in order.
    fn local_pieces(&self, i: usize) -> Vec<(Slice, u64, u64)> {
        let c = self.manifest.chunks[i];
        let seg = c.segment as usize;
        let r = &self.ranges[seg];
        layout::pieces(r, r, c.offset, c.len)
            .into_iter()
            .map(|(li, _, at, n)| {
                let (start, slice) = &self.layout[seg][li];
                (slice.clone(), at - start, n)
            })
            .collect()
    }

    /// Starts the READs of chunk `i` from `h` (one per piece where `h`'s extents and this
    /// receiver's meet) into where it lands here, then its verification over those pieces;
    /// pulling into files, into a free landing slot, verified there and written to its file.
    /// Returns whether it started (a pull into files with no slot free starts nothing).
    fn fetch(
        &self,
        set: &mut JoinSet<Fetched>,
        h: &Link,
        from: &str,
        generation: u64,
        i: usize,
    ) -> bool {
        let c = self.manifest.chunks[i];
        let seg = c.segment as usize;
        // Pulling into files: the chunk lands in a slot of its own.
        let slot = match &self.files {
            None => None,
            Some(l) => match l
                .free
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .pop()
            {
                Some(k) => Some((
                    k,
                    l.slots[k].clone(),
                    l.free.clone(),
                    l.segs[seg].file.clone(),
                )),
                None => return false,
            },
        };
        let mut batch = Batch::new();
        let mut covered = 0;
        match &slot {
            None => {
                for (li, ri, at, n) in
                    layout::pieces(&self.ranges[seg], &h.ranges[seg], c.offset, c.len)
                {
                    let (lstart, slice) = &self.layout[seg][li];
                    let (rstart, roff, remote) = &h.segs[seg][ri];
                    batch.push(
                        ferry::OpKind::Read,
                        slice.memory(),
                        slice.offset() + (at - lstart),
                        remote,
                        roff + (at - rstart),
                        n,
                    );
                    covered += n;
                }
            }
            Some((_, slice, _, _)) => {
                for (_, ri, at, n) in
                    layout::pieces(&[(c.offset, c.len)], &h.ranges[seg], c.offset, c.len)
                {
                    let (rstart, roff, remote) = &h.segs[seg][ri];
                    batch.push(
                        ferry::OpKind::Read,
                        slice.memory(),
                        slice.offset() + (at - c.offset),
                        remote,
                        roff + (at - rstart),
                        n,
                    );
                    covered += n;
                }
            }
        }
        let pieces = if slot.is_some() {
            Vec::new()
        } else {
            self.local_pieces(i)
        };
        let copied = self.copied.clone();
        let from = from.to_owned();
        let from_source = h.from_source;
        let submitted = if covered == c.len {
            self.touched.store(true, Ordering::Relaxed);
            self.engine.submit(batch).map_err(|e| e.to_string())
        } else {
            Err(format!(
                "the layouts cover {covered} of the chunk's {} bytes",
                c.len
            ))
        };
        set.spawn(async move {
            let mut write_failed = None;
            let result = match submitted {
                Err(e) => Err(e),
                Ok(handle) => {
                    // Wait for the buffers to be free, not just the logical outcome: a chunk
                    // given up on must not land later over one fetched elsewhere.
                    let outcome = handle.drained().await;
                    match (outcome.failure, &slot) {
                        (Some(f), _) => Err(format!("READ failed: {}", f.kind)),
                        (None, None) => {
                            Ok(blake3_of(&pieces, &copied).is_ok_and(|h| h == c.blake3))
                        }
                        (None, Some((_, slice, _, file))) => match land(slice, &c, file, &copied) {
                            Ok(v) => Ok(v),
                            Err(e) => {
                                write_failed = Some(e);
                                Ok(false)
                            }
                        },
                    }
                }
            };
            if let Some((k, _, free, _)) = slot {
                free.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(k);
            }
            Fetched {
                chunk: i,
                from,
                generation,
                from_source,
                result,
                write_failed,
            }
        });
        true
    }

    /// Updates the snapshot, then what the control service advertises (in that order: an
    /// advertised prefix is never ahead of the snapshot's verified chunks).
    fn publish(&self, have: &Have, bytes: u64, refetched: u64, peers: usize, parent: &str) {
        self.snapshot_tx.send_modify(|s| {
            s.bytes = bytes;
            s.chunks = have.count();
            s.refetched = refetched;
            s.peers = peers;
            s.parent = parent.to_owned();
            s.done = have.is_done();
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
        let _ = self.progress_tx.send(Progress {
            prefix: have.prefix(),
            done: have.is_done(),
            count: have.count(),
            stripes: have.stripe_prefixes().to_vec(),
        });
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
                self.pulled = true;
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
        if self.staged.is_some()
            || self.tensors.is_empty()
            || !self.touched.load(Ordering::Relaxed)
            || matches!(cause, BroadcastError::Torn { .. })
        {
            return cause;
        }
        tracing::warn!(name = %self.manifest.name, version = self.manifest.version,
            tensors = self.tensors.len(), error = %cause, "pull in place failed: destinations torn");
        BroadcastError::Torn {
            name: self.manifest.name.clone(),
            version: self.manifest.version,
            tensors: self.tensors.clone(),
            cause: Box::new(cause),
        }
    }

    /// The pull's settings, as its decisions ([`Pull`]) take them.
    fn pull_config(&self) -> PullConfig {
        PullConfig {
            name: self.manifest.name.clone(),
            version: self.manifest.version,
            source_epoch: self.source_epoch,
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
            verify_at_rest: self.opts.verify_at_rest,
        }
    }

    /// Drives a [`Pull`]: carries its commands out ([`drain`](Self::drain)) and feeds it what
    /// happened (fetches finished, the member list, holders' progress, the clock).
    async fn run_inner(&mut self) -> Result<Summary, BroadcastError> {
        let started = Instant::now();
        let (polls, mut poll_rx) = mpsc::unbounded_channel();
        // A list that cannot be read now (a source that stopped since it answered the
        // manifest) leaves the source found then: it is attached, and given up if it stalls.
        let members = match self.discovery.members().await {
            Ok(m) if !m.is_empty() => m,
            _ => vec![self.source.clone()],
        };
        let mut pull = Pull::new(self.pull_config(), members);
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
        let mut tick = tokio::time::interval(self.opts.heartbeat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut d = Drive {
            links: HashMap::new(),
            set: JoinSet::new(),
            first_request: None,
            me_tx,
            polls,
        };
        let mut hooks = self.hooks.clone();
        if hooks.hold_final_check.is_some() {
            pull.handle(Instant::now(), Event::HoldCheck)?;
        }
        let mut held: Option<Arc<tokio::sync::Notify>> = None;
        while !self.drain(&mut pull, &mut d).await? {
            let ev = tokio::select! {
                () = notified(&hooks.hold_final_check), if hooks.hold_final_check.is_some() => {
                    hooks.hold_final_check = None;
                    Event::ReleaseCheck
                }
                () = notified(&held), if held.is_some() => {
                    held = None;
                    Event::ResumeFetches
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
                _ = tick.tick() => Event::Tick,
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
                    pull.handle(Instant::now(), Event::HoldFetches)?;
                }
            }
        }
        let t = pull.tally();
        let mut sum = Summary {
            name: self.manifest.name.clone(),
            version: self.manifest.version,
            source_epoch: self.source_epoch,
            bytes: self.manifest.total_bytes(),
            chunks: self.manifest.chunks.len() as u64,
            refetched_chunks: t.refetched,
            fetch_mismatches: t.fetch_mismatches,
            at_rest_mismatches: t.at_rest_mismatches,
            corrupt_holders: t.corrupt_holders.clone(),
            bytes_from_source: t.bytes_from_source,
            bytes_from_relays: t.bytes_from_relays,
            parents_given_up: t.parents_given_up,
            holders: t.holders.clone(),
            ..Default::default()
        };
        sum.seconds = started.elapsed().as_secs_f64();
        self.timeline.done = Some(unix_now());
        sum.timeline = self.timeline.clone();
        sum.bytes_copied = self.copied.load(Ordering::Relaxed);
        sum.gb_per_s = sum.bytes as f64 / sum.seconds.max(1e-9) / 1e9;
        self.publish(
            pull.have(),
            pull.verified_bytes(),
            sum.refetched_chunks,
            pull.peers(),
            "",
        );
        self.beat(pull.have(), d.first_request, &d.me_tx);
        drop(listing);
        self.heartbeat_now().await?;
        self.reported_done = Some(Instant::now());
        tracing::info!(name = %sum.name, seconds = sum.seconds, refetched = sum.refetched_chunks,
            from_source = sum.bytes_from_source, from_relays = sum.bytes_from_relays, "pull complete");
        Ok(sum)
    }

    /// What a finished fetch task tells the pull; a chunk that could not be written to its
    /// file ends the pull.
    fn fetched_event(&self, f: Fetched) -> Result<Event, BroadcastError> {
        if let Some(e) = f.write_failed {
            let c = self.manifest.chunks[f.chunk];
            let file = self
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

    /// Tests only ([`TestHooks::corrupt_after_verify`]): flips one byte of verified chunk `i`
    /// where it lies (a relay that corrupts what it serves).
    fn corrupt(&self, i: usize) {
        if let Some((slice, at, _)) = self.local_pieces(i).first() {
            let mut b = [0u8; 1];
            let _ = slice.read(*at, &mut b);
            let _ = slice.write(*at, &[b[0] ^ 0xff]);
        }
        tracing::warn!(chunk = i, "test hook: corrupted a verified chunk");
    }

    /// Carries out the pull's commands until it has none; an attachment and the check at rest
    /// are answered before the next. Returns whether the pull is done.
    async fn drain(&mut self, pull: &mut Pull, d: &mut Drive) -> Result<bool, BroadcastError> {
        while let Some(cmd) = pull.poll(Instant::now())? {
            match cmd {
                Command::Done => return Ok(true),
                Command::Attach(m) => {
                    let ev = match self.attach_within(&m, &d.polls).await {
                        Ok(link) => {
                            d.links.insert(m.id.clone(), link);
                            Event::Attached
                        }
                        Err(e @ BroadcastError::SourceRestarted { .. }) => return Err(e),
                        Err(e) => Event::AttachFailed(e.to_string()),
                    };
                    pull.handle(Instant::now(), ev)?;
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
                    let bad = self.check_at_rest();
                    pull.handle(Instant::now(), Event::AtRest { bad })?;
                }
                Command::Heartbeat => self.beat(pull.have(), d.first_request, &d.me_tx),
                Command::Publish => self.publish(
                    pull.have(),
                    pull.verified_bytes(),
                    pull.tally().refetched,
                    pull.peers(),
                    &pull.parents(),
                ),
            }
        }
        Ok(false)
    }

    /// The chunks whose CRC-32C at rest is not the manifest's.
    fn check_at_rest(&self) -> Vec<usize> {
        let mut buf = Vec::new();
        let mut bad = Vec::new();
        for (i, c) in self.manifest.chunks.iter().enumerate() {
            let crc = match &self.files {
                None => crc_of(&self.local_pieces(i), &self.copied).ok(),
                Some(l) => crc_of_file(
                    &l.segs[c.segment as usize].file,
                    c.offset,
                    c.len,
                    &mut buf,
                    &self.copied,
                )
                .ok(),
            };
            if crc != Some(c.crc32c) {
                bad.push(i);
            }
        }
        bad
    }

    /// Attaches `m` (within `stall_after` and 2 s more: a member that does not answer its
    /// handshake is not waited on longer than one that stalls).
    async fn attach_within(
        &self,
        m: &Member,
        polls: &mpsc::UnboundedSender<Event>,
    ) -> Result<Link, BroadcastError> {
        let limit = self.opts.stall_after + Duration::from_secs(2);
        match tokio::time::timeout(limit, self.attach(m, polls)).await {
            Ok(r) => r,
            Err(_) => Err(control_err(
                &m.data_addr,
                format!("did not answer within {:.1} s", limit.as_secs_f64()),
            )),
        }
    }

    /// Keeps serving (and heartbeating) after [`run`](Self::run) while another receiver of
    /// its source epoch and version has not finished, at most `max`; the list is read again
    /// every 100 ms (or every heartbeat, if shorter). Every unfinished one, not only those
    /// that joined later: in the striped plan a member may be the parent of one that joined
    /// before it (a leaf of its tree), and a departure hands its children to others.
    pub async fn linger(&mut self, max: Duration) {
        let deadline = Instant::now() + max;
        while Instant::now() < deadline {
            let Ok(members) = self.discovery.members().await else {
                break;
            };
            let waiting = members.iter().any(|m| {
                m.role == Role::Receiver
                    && m.id != self.member.id
                    && !m.done
                    && m.source_epoch == self.source_epoch
                    && m.version == self.manifest.version
            });
            if !waiting {
                break;
            }
            let _ = self.discovery.update(&self.member).await;
            // Checked more often than the heartbeat: the caller waits on this to return.
            tokio::time::sleep(self.opts.heartbeat.min(LINGER_CHECK)).await;
        }
    }

    /// Leaves the member list and stops serving. A receiver that completed its pull stays
    /// listed, done, until 250 ms after it reported done (serving meanwhile), so
    /// that the source, which looks at its list every 100 ms, sees it finished rather than
    /// gone unfinished. Discovery is given 1 s to answer (a stopped source's
    /// tracker would hold the caller for its whole timeout); unanswered, the entry's lease runs
    /// out instead.
    pub async fn leave(self) {
        if let Some(t) = self.reported_done {
            tokio::time::sleep_until((t + FINISHED_LISTED).into()).await;
        }
        let gone = self.discovery.deregister(&self.member.id);
        if tokio::time::timeout(LEAVE_WITHIN, gone).await.is_err() {
            tracing::info!(member = %self.member.id, "discovery did not answer the leave; the entry's lease runs out instead");
        }
        drop(self);
    }
}

/// BLAKE3 of `pieces` (`(slice, offset in it, length)`) in order, adding the bytes of host
/// memory the CPU copied out to hash them to `copied`.
fn blake3_of(pieces: &[(Slice, u64, u64)], copied: &AtomicU64) -> Result<Digest, String> {
    let mut h = blake3::Hasher::new();
    for (slice, at, n) in pieces {
        slice.blake3_update(&mut h, *at, *n)?;
        if slice.is_host() {
            copied.fetch_add(*n, Ordering::Relaxed);
        }
    }
    Ok(h.finalize().into())
}

/// CRC-32C of `pieces` (`(slice, offset in it, length)`) in order, adding the bytes of host
/// memory the CPU copied out to hash them to `copied` (none where it reads them in place).
fn crc_of(pieces: &[(Slice, u64, u64)], copied: &AtomicU64) -> Result<u32, String> {
    let mut crc = 0;
    for (slice, at, n) in pieces {
        let (c, cpu) = slice.crc_append(crc, *at, *n)?;
        crc = c;
        copied.fetch_add(cpu, Ordering::Relaxed);
    }
    Ok(crc)
}

/// Up to 16 of `v`, quoted, and how many more (a hostile manifest may name a million).
fn names<S: AsRef<str>>(v: &[S]) -> String {
    let mut s = v
        .iter()
        .take(16)
        .map(|n| format!("{:?}", n.as_ref()))
        .collect::<Vec<_>>()
        .join(", ");
    if v.len() > 16 {
        s.push_str(&format!(" and {} more", v.len() - 16));
    }
    s
}

/// Where a receiver pulls into: see [`Receiver::join_into`].
#[derive(Clone, Debug, Default)]
pub struct Destinations {
    /// The live tensors: local name and where its bytes go.
    pub into: Vec<(String, Slice)>,
    /// Staged mode: the staging slice of each tensor of `into` (the same names and sizes). The
    /// pull lands here, and [`Receiver::commit`] copies it into `into`.
    pub staging: Option<Vec<(String, Slice)>>,
    /// Published name to local name, for tensors whose names differ.
    pub rename: HashMap<String, String>,
    /// Whether published tensors `into` does not name are left out (their bytes still travel,
    /// into scratch memory, verified and relayed) rather than refused.
    pub subset: bool,
    /// Shards: a destination named here takes only its own length of the published tensor,
    /// from this byte offset in it (a tensor-parallel rank's rows of a row-major tensor). The
    /// rest of the tensor travels into scratch memory, verified and relayed.
    pub shards: HashMap<String, u64>,
    /// What a destination holds, where the caller knows it (Python's arrays do): its dtype and
    /// shape are checked against the published entry's before anything moves (the shape not
    /// for shards). A side that does not say is not compared.
    pub kinds: HashMap<String, TensorKind>,
}

/// A tensor's dtype (safetensors' names: `F32`, `BF16`, ...) and shape, each where known.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TensorKind {
    /// The dtype.
    pub dtype: Option<String>,
    /// The shape.
    pub shape: Option<Vec<u64>>,
}

/// Matches the manifest's entries with `d` by name and size: `(entry, index in into)` for each
/// tensor taken, or one [`BroadcastError::Mismatch`] listing every problem. `staging`, when
/// given, is reordered to `into`'s order.
fn match_tensors(m: &Manifest, d: &Destinations) -> Result<Vec<(usize, usize)>, BroadcastError> {
    let mut problems = Vec::new();
    let mut index: HashMap<&str, usize> = HashMap::new();
    for (i, (n, _)) in d.into.iter().enumerate() {
        if index.insert(n.as_str(), i).is_some() {
            problems.push(format!("destination {n:?} is named twice"));
        }
    }
    if let Some(st) = &d.staging {
        let staged: HashMap<&str, &Slice> = st.iter().map(|(n, s)| (n.as_str(), s)).collect();
        for (n, live) in &d.into {
            match staged.get(n.as_str()) {
                None => problems.push(format!("tensor {n:?} has no staging")),
                Some(s) if s.len() != live.len() => problems.push(format!(
                    "tensor {n:?}: staging of {} bytes for a tensor of {}",
                    s.len(),
                    live.len()
                )),
                Some(_) => {}
            }
        }
        if st.len() != d.into.len() {
            problems.push(format!(
                "{} staging slices for {} tensors",
                st.len(),
                d.into.len()
            ));
        }
    }
    let mut published = std::collections::HashSet::new();
    for e in &m.entries {
        if !published.insert(e.name.as_str()) {
            problems.push(format!("tensor {:?} is published twice", e.name));
        }
    }
    let mut matched = Vec::new();
    let mut used: Vec<Option<&str>> = vec![None; d.into.len()];
    let mut extra = Vec::new();
    for (e, entry) in m.entries.iter().enumerate() {
        let local = d.rename.get(&entry.name).unwrap_or(&entry.name);
        match index.get(local.as_str()) {
            Some(&i) => {
                if let Some(first) = used[i].replace(entry.name.as_str()) {
                    problems.push(format!(
                        "destination {local:?} would take two published tensors, {first:?} and \
                         {:?}",
                        entry.name
                    ));
                    continue;
                }
                if let Some(k) = d.kinds.get(local) {
                    if let (Some(want), Some(got)) = (&entry.dtype, &k.dtype)
                        && want != got
                    {
                        problems.push(format!(
                            "tensor {local:?}: published as {want}, destination is {got}"
                        ));
                        continue;
                    }
                    if let (Some(want), Some(got), false) =
                        (&entry.shape, &k.shape, d.shards.contains_key(local))
                        && want != got
                    {
                        problems.push(format!(
                            "tensor {local:?}: published with shape {want:?}, destination has {got:?}"
                        ));
                        continue;
                    }
                }
                let have = d.into[i].1.len();
                match d.shards.get(local) {
                    None if have != entry.len => problems.push(format!(
                        "tensor {local:?}: published with {} bytes, destination has {have}",
                        entry.len
                    )),
                    Some(&at) if at.checked_add(have).is_none_or(|end| end > entry.len) => problems
                        .push(format!(
                            "tensor {local:?}: a shard of {have} bytes at {at} does not fit the \
                             {} bytes published",
                            entry.len
                        )),
                    _ => matched.push((e, i)),
                }
            }
            None if d.subset => {}
            None => extra.push(local.clone()),
        }
    }
    if !extra.is_empty() {
        problems.push(format!("published but not received: {}", names(&extra)));
    }
    let missing: Vec<&str> = d
        .into
        .iter()
        .zip(&used)
        .filter(|(_, u)| u.is_none())
        .map(|((n, _), _)| n.as_str())
        .collect();
    if !missing.is_empty() {
        problems.push(format!("not published: {}", names(&missing)));
    }
    if problems.is_empty() {
        Ok(matched)
    } else {
        Err(BroadcastError::Mismatch {
            name: m.name.clone(),
            version: m.version,
            problems,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{Chunk, Entry, Segment};

    fn manifest(entries: &[(&str, u64, u64)]) -> Manifest {
        Manifest {
            name: "w".into(),
            version: 3,
            chunk_size: 4096,
            segments: vec![Segment {
                name: "s".into(),
                len: 4096,
            }],
            entries: entries
                .iter()
                .map(|&(name, offset, len)| Entry {
                    name: name.into(),
                    len,
                    dtype: None,
                    shape: None,
                    segment: 0,
                    offset,
                })
                .collect(),
            chunks: vec![Chunk {
                segment: 0,
                offset: 0,
                len: 4096,
                crc32c: 0,
                blake3: Digest::default(),
            }],
        }
    }

    #[test]
    fn every_mismatch_is_listed_once_and_a_name_published_twice_is_refused() {
        let engine = TransferEngine::builder()
            .data_plane(DataPlane::Tcp)
            .build()
            .unwrap();
        let reg = engine
            .register(MemoryRegion::from_vec(vec![0; 4096]), Access::LOCAL, "d")
            .unwrap();
        let at = |off, len| Slice::new(&reg, "d", off, len).unwrap();
        let m = manifest(&[("a", 0, 100), ("b", 100, 100), ("c", 200, 100)]);
        let d = Destinations {
            into: vec![
                ("a".into(), at(0, 100)),
                ("b".into(), at(100, 50)),
                ("z".into(), at(200, 8)),
            ],
            ..Default::default()
        };
        let Err(BroadcastError::Mismatch {
            problems, version, ..
        }) = match_tensors(&m, &d)
        else {
            panic!("expected a mismatch");
        };
        assert_eq!(version, 3);
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(
            problems
                .iter()
                .any(|p| p.contains("\"b\"") && p.contains("50"))
        );
        assert!(problems.iter().any(|p| p.contains("\"c\"")));
        assert!(problems.iter().any(|p| p.contains("\"z\"")));
        // A manifest of many tensors none of which is received: the message stays short.
        let many: Vec<(String, u64, u64)> = (0..1000).map(|i| (format!("t{i}"), i, 1)).collect();
        let many: Vec<(&str, u64, u64)> =
            many.iter().map(|(n, o, l)| (n.as_str(), *o, *l)).collect();
        let Err(e) = match_tensors(&manifest(&many), &Destinations::default()) else {
            panic!("expected a mismatch");
        };
        assert!(e.to_string().contains("and 984 more"), "{e}");
        assert!(e.to_string().len() < 1000);
        // A hostile manifest naming one tensor twice is refused, not written twice.
        let m = manifest(&[("a", 0, 100), ("a", 100, 100)]);
        let d = Destinations {
            into: vec![("a".into(), at(0, 100))],
            ..Default::default()
        };
        assert!(matches!(
            match_tensors(&m, &d),
            Err(BroadcastError::Mismatch { problems, .. }) if problems[0].contains("twice")
        ));
        // Two published tensors renamed into one destination: refused, not written twice.
        let m = manifest(&[("a", 0, 100), ("b", 100, 100)]);
        let d = Destinations {
            into: vec![("x".into(), at(0, 100))],
            rename: [("a".into(), "x".into()), ("b".into(), "x".into())].into(),
            ..Default::default()
        };
        assert!(matches!(
            match_tensors(&m, &d),
            Err(BroadcastError::Mismatch { problems, .. }) if problems.iter().any(|p| p.contains("two published"))
        ));
        // The same bytes under another dtype or shape: refused where the destination says.
        let mut m = manifest(&[("a", 0, 16)]);
        m.entries[0].dtype = Some("BF16".into());
        m.entries[0].shape = Some(vec![8]);
        let kind = |dtype: &str, shape: Vec<u64>| TensorKind {
            dtype: Some(dtype.into()),
            shape: Some(shape),
        };
        let with = |k: TensorKind| Destinations {
            into: vec![("a".into(), at(0, 16))],
            kinds: [("a".into(), k)].into(),
            ..Default::default()
        };
        let refused = |d: &Destinations, what: &str| {
            matches!(match_tensors(&m, d),
                Err(BroadcastError::Mismatch { problems, .. }) if problems[0].contains(what))
        };
        assert!(refused(
            &with(kind("F32", vec![4])),
            "published as BF16, destination is F32"
        ));
        assert!(refused(&with(kind("BF16", vec![2, 4])), "shape"));
        assert!(match_tensors(&m, &with(kind("BF16", vec![8]))).is_ok());
        assert!(match_tensors(&m, &with(TensorKind::default())).is_ok());
        // Staging must match `into` name for name and size.
        let m = manifest(&[("a", 0, 100)]);
        let d = Destinations {
            into: vec![("a".into(), at(0, 100))],
            staging: Some(vec![("a".into(), at(100, 99))]),
            ..Default::default()
        };
        assert!(matches!(
            match_tensors(&m, &d),
            Err(BroadcastError::Mismatch { problems, .. }) if problems[0].contains("staging")
        ));
    }
}

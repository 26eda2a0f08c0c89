//! The source: publishes the manifest's files as Ferry file segments, or serves named tensors
//! from registrations of the caller's own engine (no copy: the registrations are the
//! segments); serves the manifests of the versions it keeps and (embedded discovery) the
//! membership list on its control service, and lists itself in the discovery backend it is
//! given.
//!
//! Versions: [`Source::publish`] adds version v+1 while v is still pulled or relayed. The source
//! keeps the newest [`SourceOptions::keep_versions`] manifests and serves each from the memory
//! it was built from, so v stays servable as long as the caller leaves v's registrations
//! unchanged (v+1 in other registrations). A receiver asks for a version by number, and
//! every chunk it takes is checked against that version's BLAKE3. A source of files withdraws
//! a version whose files changed on disk (see [`Source::publish_files`]).
//!
//! A watcher follows the embedded tracker's list and reports receivers joining, finishing,
//! coming off the list unfinished (a leave, or a lease run out) and coming back
//! ([`SourceEvent`], [`Source::subscribe`]; logged while no one subscribes).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{Access, DataPlane, FileRegistration, TransferEngine};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::control::{self, CtlState, Departure, Progress, Tracker};
use crate::discovery::Discovery;
use crate::error::BroadcastError;
use crate::layout::Tensor;
use crate::manifest::{Manifest, ManifestError};
use crate::plan::{Member, Role};

/// How a source runs.
#[derive(Clone, Debug)]
pub struct SourceOptions {
    /// Where the control service listens (the address receivers are given). Its IP should be
    /// one receivers reach; the Ferry listener takes the same IP and any free port.
    pub listen: SocketAddr,
    /// Which data plane serves the files: `Tcp` or `Uring` alone; `Auto` also serves peers on
    /// this host by the same-host plane. (With [`Source::start_tensors`] the caller's engine
    /// decides.)
    pub data_plane: DataPlane,
    /// How long a member stays listed by the embedded tracker without a heartbeat.
    pub lease: Duration,
    /// How many versions' manifests are kept and served (at least 1).
    pub keep_versions: usize,
    /// The broadcast's keys: the control service answers only connections that prove one
    /// (join, heartbeat, leave, members, manifest, progress, layout: everything), and the
    /// engine [`start`](Source::start) builds serves the files only to peers that prove one.
    /// With [`start_tensors`](Source::start_tensors) the caller's engine must be keyed by the
    /// caller.
    pub keys: Option<ferry::Keyring>,
}

impl Default for SourceOptions {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            data_plane: DataPlane::Auto,
            lease: Duration::from_secs(3),
            keep_versions: 2,
            keys: None,
        }
    }
}

/// A running source. Dropping it stops serving.
#[derive(Debug)]
pub struct Source {
    engine: TransferEngine,
    /// Whether the engine is this source's own (shut down with it) or the caller's.
    owns_engine: bool,
    /// Whether it publishes files (else tensors of the caller's engine).
    from_files: bool,
    /// The file segments of each version kept, with what each file was when published.
    files: Arc<KeptFiles>,
    /// The newest version published (served, or withdrawn): the next must be above it.
    newest: std::sync::Mutex<Manifest>,
    /// What happened to receivers and versions, for whoever follows ([`subscribe`](Self::subscribe)).
    events: tokio::sync::broadcast::Sender<SourceEvent>,
    /// Follows the members (joined, finished, left) and, for a source of files, whether the
    /// kept versions' files changed on disk.
    watcher: JoinHandle<()>,
    state: Arc<CtlState>,
    keep_versions: usize,
    ctl_addr: SocketAddr,
    member: Member,
    tracker: Arc<Tracker>,
    discovery: Option<Arc<dyn Discovery>>,
    /// Held for its drop: the control listener closes with the member.
    _ctl: control::Service,
    keepalive: Option<JoinHandle<()>>,
}

/// The file segments of each version kept, with what each file was when published.
type KeptFiles = std::sync::Mutex<Vec<(u64, Vec<Published>)>>;

/// A published file, and what it was when published: a version is served only while each of
/// its files has the length and modification time it had then.
#[derive(Debug)]
struct Published {
    reg: FileRegistration,
    stamp: Stamp,
}

/// A file's length and modification time, read from the descriptor served (so a file replaced
/// by a rename, whose old inode the source still serves, has not changed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    len: u64,
    modified: Option<std::time::SystemTime>,
}

impl Stamp {
    fn of(reg: &FileRegistration) -> std::io::Result<Self> {
        let fd = reg.file().write_fd().try_clone_to_owned()?;
        let meta = std::fs::File::from(fd).metadata()?;
        Ok(Self {
            len: meta.len(),
            modified: meta.modified().ok(),
        })
    }
}

/// What a source reports to whoever follows it ([`Source::subscribe`]); logged while no one does.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SourceEvent {
    /// A receiver joined (listed by the embedded tracker).
    Joined {
        /// Its id.
        id: String,
        /// Its data address.
        addr: String,
        /// The version it pulls.
        version: u64,
    },
    /// A receiver verified every chunk.
    Finished {
        /// Its id.
        id: String,
        /// Its data address.
        addr: String,
        /// The version it pulled.
        version: u64,
    },
    /// A receiver came off the list unfinished: it left (its pull failed or was interrupted),
    /// or no heartbeat came within its lease (killed, stopped, cut off). Either way it is out
    /// of every member's plan from the next list read.
    Failed {
        /// Its id.
        id: String,
        /// Its data address.
        addr: String,
        /// The version it pulled.
        version: u64,
        /// Chunks it had verified.
        progress: u64,
        /// How it came off the list.
        how: Departure,
    },
    /// A receiver whose lease had run out heartbeated again (it was stopped and resumed, or
    /// cut off and reconnected): it is listed again, under the same entry.
    Returned {
        /// Its id.
        id: String,
        /// Its data address.
        addr: String,
        /// The version it pulls.
        version: u64,
        /// How long it was off the list.
        after: Duration,
    },
    /// A version was withdrawn because a file of it changed on disk since it was published:
    /// pulls of it would fail verification, so it is no longer offered.
    Withdrawn {
        /// The version.
        version: u64,
        /// The file that changed.
        file: String,
        /// What changed.
        change: String,
    },
}

impl std::fmt::Display for SourceEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SourceEvent::Joined { id, addr, version } => {
                write!(
                    f,
                    "receiver {addr} (id {id}) joined, pulling version {version}"
                )
            }
            SourceEvent::Finished { id, addr, version } => {
                write!(f, "receiver {addr} (id {id}) finished version {version}")
            }
            SourceEvent::Failed {
                id,
                addr,
                version,
                progress,
                how: Departure::Left,
            } => write!(
                f,
                "receiver {addr} (id {id}) left before finishing version {version} ({progress} \
                 chunks verified): its pull was interrupted or failed"
            ),
            SourceEvent::Failed {
                id,
                addr,
                version,
                progress,
                ..
            } => write!(
                f,
                "receiver {addr} (id {id}) went silent before finishing version {version} \
                 ({progress} chunks verified at its last report): no heartbeat within its \
                 lease, so it is out of the plan (listed again if it comes back)"
            ),
            SourceEvent::Returned {
                id,
                addr,
                version,
                after,
            } => write!(
                f,
                "receiver {addr} (id {id}) is back after {:.1} s off the list, pulling version \
                 {version}",
                after.as_secs_f64()
            ),
            SourceEvent::Withdrawn {
                version,
                file,
                change,
            } => write!(
                f,
                "version {version} withdrawn: {file} changed on disk since it was published \
                 ({change}); pulls of it would fail verification"
            ),
        }
    }
}

/// How often the watcher reads the member list and the files' stamps.
const WATCH_EVERY: Duration = Duration::from_millis(100);

impl Source {
    /// Publishes `files` (the manifest's segments, in order; each must still have the length
    /// the manifest says) and starts serving. With `discovery` (etcd), the source also lists
    /// itself there; its embedded tracker answers receivers given its address either way.
    pub async fn start(
        manifest: Manifest,
        files: &[PathBuf],
        opts: SourceOptions,
        discovery: Option<Arc<dyn Discovery>>,
    ) -> Result<Self, BroadcastError> {
        manifest.validate()?;
        if files.len() != manifest.segments.len() {
            return Err(ManifestError::Invalid(format!(
                "{} files for {} segments",
                files.len(),
                manifest.segments.len()
            ))
            .into());
        }
        let listener = TcpListener::bind(opts.listen)
            .await
            .map_err(|e| BroadcastError::io(format!("listening on {}", opts.listen), e))?;
        let ctl_addr = listener
            .local_addr()
            .map_err(|e| BroadcastError::io("control listener address", e))?;
        let mut builder = TransferEngine::builder()
            .data_plane(opts.data_plane)
            // An explicit network plane is served alone; `Auto` adds the same-host plane.
            .same_host(opts.data_plane == DataPlane::Auto)
            .listen(SocketAddr::new(ctl_addr.ip(), 0));
        if let Some(k) = &opts.keys {
            builder = builder.auth_keyring(k.clone());
        }
        let engine = builder.build()?;
        let regs = Self::register_files(&engine, &manifest, files, None)?;
        Self::serve(engine, true, regs, manifest, listener, opts, discovery).await
    }

    /// Serves `tensors` (slices of registrations of `engine`, the caller's, which must listen)
    /// as version `version` of the broadcast `name`, with no copy: each registration a tensor
    /// names is a segment, read by receivers where it lies. The caller keeps the
    /// registrations published (dropping one unpublishes it) and their bytes unchanged while
    /// the version is served; the manifest's checksums are computed from them now. The
    /// engine is not shut down with the source.
    pub async fn start_tensors(
        engine: &TransferEngine,
        name: &str,
        version: u64,
        tensors: &[Tensor],
        chunk_size: u64,
        opts: SourceOptions,
        discovery: Option<Arc<dyn Discovery>>,
    ) -> Result<Self, BroadcastError> {
        let manifest = Manifest::from_tensors(name, version, tensors, chunk_size)?;
        if engine.local_addr().is_none() {
            return Err(BroadcastError::io(
                format!("publishing {name:?}"),
                std::io::Error::other("the engine does not listen: build it with listen(addr)"),
            ));
        }
        let listener = TcpListener::bind(opts.listen)
            .await
            .map_err(|e| BroadcastError::io(format!("listening on {}", opts.listen), e))?;
        Self::serve(
            engine.clone(),
            false,
            Vec::new(),
            manifest,
            listener,
            opts,
            discovery,
        )
        .await
    }

    /// Publishes version `version` of the same broadcast from `tensors` (slices of
    /// registrations of the source's engine; see [`start_tensors`](Self::start_tensors)) and
    /// returns its manifest. Receivers pulling an older version go on being served it while it
    /// is among the [`SourceOptions::keep_versions`] newest. Refused: a version not above the
    /// newest, a source of files.
    pub fn publish(
        &self,
        version: u64,
        tensors: &[Tensor],
        chunk_size: Option<u64>,
    ) -> Result<Manifest, BroadcastError> {
        let newest = self.next_version_of(false, version)?;
        let m = Manifest::from_tensors(
            &newest.name,
            version,
            tensors,
            chunk_size.unwrap_or(newest.chunk_size),
        )?;
        let mut ms = self
            .state
            .manifests
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        ms.push(m.clone());
        drop(ms);
        *lock(&self.newest) = m.clone();
        self.prune();
        self.report(&m, false);
        tracing::info!(name = %m.name, version, bytes = m.total_bytes(),
            kept = ?self.versions(), "source publishing a new version");
        Ok(m)
    }

    /// Publishes `files` as version `version` of the same broadcast (a source of files), and
    /// returns its manifest (read from the files now: blocking). Each file is served under a
    /// name of that version, so the segments of the versions kept do not collide; the source
    /// tells receivers where each version's segments are. A kept version whose files changed
    /// on disk since it was published (overwritten in place: their length or modification
    /// time, read from the descriptor served) is withdrawn first, with one warning and a
    /// [`SourceEvent::Withdrawn`], as the source's watcher also does every 250 ms: its chunks
    /// would fail verification at every receiver. A file replaced by a rename leaves the
    /// version served (the source still holds the old file). Refused: a version not above the
    /// newest published, a source of tensors.
    pub fn publish_files(
        &self,
        version: u64,
        files: &[PathBuf],
        chunk_size: Option<u64>,
    ) -> Result<Manifest, BroadcastError> {
        let newest = self.next_version_of(true, version)?;
        // The versions kept whose files were overwritten in place go first: the new version
        // is most often just that.
        withdraw_changed(&self.files, &self.state, &self.events);
        let m = Manifest::build(
            &newest.name,
            version,
            files,
            chunk_size.unwrap_or(newest.chunk_size),
        )?;
        let regs = Self::register_files(&self.engine, &m, files, Some(version))?;
        let layout = m
            .segments
            .iter()
            .map(|s| {
                if s.len == 0 {
                    Vec::new()
                } else {
                    vec![crate::layout::Extent {
                        seg_offset: 0,
                        len: s.len,
                        segment: versioned(&s.name, version),
                        offset: 0,
                    }]
                }
            })
            .collect();
        lock(&self.files).push((version, published(regs)?));
        lock(&self.state.source_layouts).insert(version, layout);
        lock(&self.state.manifests).push(m.clone());
        *lock(&self.newest) = m.clone();
        self.prune();
        self.report(&m, false);
        tracing::info!(name = %m.name, version, bytes = m.total_bytes(),
            kept = ?self.versions(), "source publishing a new version of its files");
        Ok(m)
    }

    /// The newest manifest, if `version` may follow it from a source of files (`files`) or of
    /// tensors: the source's kind must match, and the version must be above the newest.
    fn next_version_of(&self, files: bool, version: u64) -> Result<Manifest, BroadcastError> {
        let newest = lock(&self.newest).clone();
        if self.from_files != files {
            let (kind, call) = if self.from_files {
                ("files", "publish_files")
            } else {
                ("memory", "publish")
            };
            return Err(ManifestError::Invalid(format!(
                "{:?} is published from {kind}: publish its next version with {call}",
                newest.name
            ))
            .into());
        }
        if version <= newest.version {
            return Err(ManifestError::Invalid(format!(
                "version {version} of {:?} is not above the newest published, {}",
                newest.name, newest.version
            ))
            .into());
        }
        Ok(newest)
    }

    /// Drops the versions beyond the newest `keep_versions`.
    fn prune(&self) {
        let mut ms = lock(&self.state.manifests);
        let drop_n = ms.len().saturating_sub(self.keep_versions);
        let dropped: Vec<Manifest> = ms.drain(..drop_n).collect();
        drop(ms);
        for m in &dropped {
            self.report(m, true);
        }
        let gone: Vec<u64> = dropped.iter().map(|m| m.version).collect();
        lock(&self.state.source_layouts).retain(|v, _| !gone.contains(v));
        lock(&self.files).retain(|(v, _)| !gone.contains(v));
    }

    /// The versions served now, oldest first.
    pub fn versions(&self) -> Vec<u64> {
        self.state
            .manifests
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|m| m.version)
            .collect()
    }

    /// Publishes `files` as the segments of `manifest`: under the segments' names, or with
    /// `version`, under names of that version.
    fn register_files(
        engine: &TransferEngine,
        manifest: &Manifest,
        files: &[PathBuf],
        version: Option<u64>,
    ) -> Result<Vec<FileRegistration>, BroadcastError> {
        let mut regs = Vec::with_capacity(files.len());
        for (path, seg) in files.iter().zip(&manifest.segments) {
            let name = match version {
                Some(v) => versioned(&seg.name, v),
                None => seg.name.clone(),
            };
            let reg = engine.publish_file_named(path, Access::REMOTE_READ, &name)?;
            if reg.len() != seg.len {
                return Err(ManifestError::Invalid(format!(
                    "{} has {} bytes now, the manifest says {}",
                    path.display(),
                    reg.len(),
                    seg.len
                ))
                .into());
            }
            regs.push(reg);
        }
        Ok(regs)
    }

    async fn serve(
        engine: TransferEngine,
        owns_engine: bool,
        regs: Vec<FileRegistration>,
        manifest: Manifest,
        listener: TcpListener,
        opts: SourceOptions,
        discovery: Option<Arc<dyn Discovery>>,
    ) -> Result<Self, BroadcastError> {
        let ctl_addr = listener
            .local_addr()
            .map_err(|e| BroadcastError::io("control listener address", e))?;
        let data_addr = engine
            .local_addr()
            .ok_or_else(|| BroadcastError::io("data listener", std::io::Error::other("none")))?;
        let source_epoch = engine.epoch().0;
        let chunks = manifest.chunks.len() as u64;
        let member = Member {
            id: engine.peer_id().to_string(),
            epoch: source_epoch,
            source_epoch,
            data_addr: data_addr.to_string(),
            ctl_addr: ctl_addr.to_string(),
            role: Role::Source,
            progress: chunks,
            done: true,
            order: 0,
            version: manifest.version,
            rate: 0,
            number: None,
            identity: Some(engine.server_identity().to_string()),
        };
        let tracker = Arc::new(Tracker::new(member.clone(), opts.lease));
        let (_tx, progress) = watch::channel(Progress {
            prefix: chunks,
            done: true,
            count: chunks,
            stripes: Vec::new(),
        });
        let state = Arc::new(CtlState {
            source_epoch,
            manifests: std::sync::Mutex::new(vec![manifest.clone()]),
            source_layouts: std::sync::Mutex::new(Default::default()),
            version: manifest.version,
            layout: None,
            progress,
            tracker: Some(tracker.clone()),
            auth: opts.keys.clone().map(|k| {
                (
                    ferry::core_types::auth::ServerAuth::new(k),
                    engine.peer_id(),
                    engine.epoch(),
                )
            }),
        });
        let ctl = control::Service::start(listener, state.clone());
        let mut keepalive = None;
        if let Some(d) = &discovery {
            d.register(&member).await?;
            let (d, m) = (d.clone(), member.clone());
            keepalive = Some(tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    if let Err(e) = d.update(&m).await {
                        tracing::warn!(error = %e, "source: discovery update failed");
                    }
                }
            }));
        }
        tracing::info!(name = %manifest.name, version = manifest.version, %ctl_addr, %data_addr,
            epoch = source_epoch, bytes = manifest.total_bytes(), "source publishing");
        let files = Arc::new(std::sync::Mutex::new(vec![(
            manifest.version,
            published(regs)?,
        )]));
        let (events, _) = tokio::sync::broadcast::channel(1024);
        let watcher = tokio::spawn(watch(
            tracker.clone(),
            files.clone(),
            state.clone(),
            events.clone(),
        ));
        let source = Self {
            engine,
            owns_engine,
            // Sources of files run an engine of their own; sources of tensors, the caller's.
            from_files: owns_engine,
            files,
            newest: std::sync::Mutex::new(manifest.clone()),
            events,
            watcher,
            state,
            keep_versions: opts.keep_versions.max(1),
            ctl_addr,
            member,
            tracker,
            discovery,
            _ctl: ctl,
            keepalive,
        };
        source.report(&manifest, false);
        Ok(source)
    }

    /// Reports version `m` on the engine (`describe()`, the `ferry_broadcast_*` metrics).
    fn report(&self, m: &Manifest, done: bool) {
        let total = m.total_bytes();
        self.engine.report_broadcast(ferry::BroadcastDescription {
            role: "source".into(),
            name: m.name.clone(),
            version: m.version,
            bytes: total,
            total_bytes: total,
            refetched: 0,
            peers: self.tracker.members(Instant::now()).len() as u64,
            done,
        });
    }

    /// The control address receivers are given.
    pub fn ctl_addr(&self) -> SocketAddr {
        self.ctl_addr
    }

    /// The Ferry address the files are served on.
    pub fn data_addr(&self) -> Option<SocketAddr> {
        self.engine.local_addr()
    }

    /// The source epoch (its engine's): receivers refuse chunks of any other.
    pub fn epoch(&self) -> u64 {
        self.member.epoch
    }

    /// The manifest of the newest version published.
    /// When every version kept was withdrawn (its files changed on disk), the newest published.
    pub fn manifest(&self) -> Manifest {
        lock(&self.state.manifests)
            .last()
            .cloned()
            .unwrap_or_else(|| lock(&self.newest).clone())
    }

    /// The engine serving the files (its `describe()` has the counters).
    pub fn engine(&self) -> &TransferEngine {
        &self.engine
    }

    /// Follows what happens to the broadcast from now on: receivers joining, finishing, coming
    /// off the list unfinished (left, or silent past their lease) and coming back, and versions
    /// withdrawn because their files changed on disk. While no one follows, each is logged
    /// instead (joins, returns and finishes at info, the rest as warnings); while someone
    /// does, reporting them is theirs (`ferry publish` prints each once).
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<SourceEvent> {
        self.events.subscribe()
    }

    /// The members the embedded tracker lists now (the source first).
    pub fn members(&self) -> Vec<Member> {
        self.tracker.members(Instant::now())
    }

    /// Stops serving and leaves the discovery backend.
    pub async fn stop(self) {
        if let Some(d) = &self.discovery {
            let _ = d.deregister(&self.member.id).await;
        }
        drop(self);
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        if let Some(k) = &self.keepalive {
            k.abort();
        }
        self.watcher.abort();
        let kept: Vec<Manifest> = lock(&self.state.manifests).clone();
        for m in &kept {
            self.report(m, true);
        }
        if self.owns_engine {
            self.engine.shutdown();
        }
    }
}

/// The name a segment of `version` is served under when files are published again: a segment
/// name has no `/`, so it never collides with the first version's names.
fn versioned(segment: &str, version: u64) -> String {
    format!("v{version}/{segment}")
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// `regs` with their stamps now.
fn published(regs: Vec<FileRegistration>) -> Result<Vec<Published>, BroadcastError> {
    regs.into_iter()
        .map(|reg| {
            let stamp = Stamp::of(&reg).map_err(|e| {
                BroadcastError::io(format!("reading {}", reg.file().path().display()), e)
            })?;
            Ok(Published { reg, stamp })
        })
        .collect()
}

/// Withdraws every kept version one of whose files changed on disk since it was published (its
/// length or modification time, read from the descriptor served): its manifest, layout and file
/// segments go, with one warning naming the file and the change. Before a receiver reads
/// other bytes under its chunk hashes, which it would take for corruption.
fn withdraw_changed(
    files: &KeptFiles,
    state: &CtlState,
    events: &tokio::sync::broadcast::Sender<SourceEvent>,
) {
    let mut changed = Vec::new();
    for (version, regs) in lock(files).iter() {
        for p in regs {
            let now = Stamp::of(&p.reg);
            if now.as_ref().is_ok_and(|n| *n == p.stamp) {
                continue;
            }
            let change = match now {
                Err(e) => format!("cannot be read: {e}"),
                Ok(n) if n.len != p.stamp.len => {
                    format!("{} bytes when published, {} now", p.stamp.len, n.len)
                }
                Ok(_) => "modified since".to_owned(),
            };
            changed.push(SourceEvent::Withdrawn {
                version: *version,
                file: p.reg.file().path().display().to_string(),
                change,
            });
            break;
        }
    }
    if changed.is_empty() {
        return;
    }
    let gone: Vec<u64> = changed
        .iter()
        .filter_map(|e| match e {
            SourceEvent::Withdrawn { version, .. } => Some(*version),
            _ => None,
        })
        .collect();
    lock(&state.manifests).retain(|m| !gone.contains(&m.version));
    lock(&state.source_layouts).retain(|v, _| !gone.contains(v));
    lock(files).retain(|(v, _)| !gone.contains(v));
    let served: Vec<u64> = lock(&state.manifests).iter().map(|m| m.version).collect();
    for e in changed {
        // Logged only where no one follows the events (they report it themselves).
        if events.receiver_count() == 0 {
            tracing::warn!(versions_served = ?served, "{e}");
        }
        let _ = events.send(e);
    }
}

/// The source's watcher: every [`WATCH_EVERY`], the receivers the tracker lists and those that
/// came off it since ([`Membership`]), and the kept versions' files. Each event goes to the
/// subscribers; while there are none, it is logged instead (so a program that prints them, as
/// `ferry publish` does, shows each once).
async fn watch(
    tracker: Arc<Tracker>,
    files: Arc<KeptFiles>,
    state: Arc<CtlState>,
    events: tokio::sync::broadcast::Sender<SourceEvent>,
) {
    let mut membership = Membership::default();
    loop {
        tokio::time::sleep(WATCH_EVERY).await;
        withdraw_changed(&files, &state, &events);
        let now = Instant::now();
        let listed = tracker.members(now);
        let departed = tracker.departures(now);
        for e in membership.step(listed, departed, now) {
            if events.receiver_count() == 0 {
                match e {
                    SourceEvent::Failed { .. } => tracing::warn!("{e}"),
                    _ => tracing::info!("{e}"),
                }
            }
            let _ = events.send(e);
        }
    }
}

/// Most receivers [`Membership`] remembers as gone silent (to say when one comes back).
const MAX_LAPSED: usize = 4096;

/// What the watcher knows of the receivers between two looks: those listed, and those whose
/// lease ran out (and when), so that one that heartbeats again is said to be back rather than
/// to have joined. No I/O: [`step`](Self::step) returns what changed.
#[derive(Debug, Default)]
struct Membership {
    known: std::collections::HashMap<String, Member>,
    lapsed: std::collections::HashMap<String, Instant>,
}

impl Membership {
    /// What changed at `now`, given the receivers listed (`listed`; the source is ignored) and
    /// those that came off the list since the last step (`departed`, as the tracker last
    /// listed each, and how): each that joined or came back, each that finished (seen done
    /// while listed or when it left), and each that came off unfinished, once.
    fn step(
        &mut self,
        listed: Vec<Member>,
        departed: Vec<(Member, Departure)>,
        now: Instant,
    ) -> Vec<SourceEvent> {
        let listed: std::collections::HashMap<String, Member> = listed
            .into_iter()
            .filter(|m| m.role == Role::Receiver)
            .map(|m| (m.id.clone(), m))
            .collect();
        let mut said = Vec::new();
        let mut known = std::mem::take(&mut self.known);
        // Those that came off the list: seen finished, or gone unfinished.
        for (m, how) in departed {
            // Listed again with the same version: back already (a lease renewed between two
            // looks), nothing changed. With another version it is the same engine pulling the
            // next one (a Python receiver's id is its engine's): this one still ended.
            let back = listed.get(&m.id).is_some_and(|l| l.version == m.version);
            if m.role != Role::Receiver || back {
                continue;
            }
            let before = known.remove(&m.id);
            if before.is_none() {
                said.push(joined(&m));
            }
            if m.done {
                if !before.is_some_and(|b| b.done) {
                    said.push(finished(&m));
                }
                continue;
            }
            if how == Departure::Lapsed {
                if self.lapsed.len() >= MAX_LAPSED {
                    self.lapsed.clear();
                }
                self.lapsed.insert(m.id.clone(), now);
            }
            said.push(gone(m, how));
        }
        // Listed before and not now, with no departure recorded (not expected): gone silent.
        for (id, m) in &known {
            if !listed.contains_key(id) && !m.done {
                said.push(gone(m.clone(), Departure::Lapsed));
            }
        }
        for (id, m) in &listed {
            match known.get(id) {
                None => match self.lapsed.remove(id) {
                    Some(at) => said.push(SourceEvent::Returned {
                        id: id.clone(),
                        addr: m.data_addr.clone(),
                        version: m.version,
                        after: now.saturating_duration_since(at),
                    }),
                    None => said.push(joined(m)),
                },
                Some(b) if m.done && !b.done => said.push(finished(m)),
                Some(_) => {}
            }
            if m.done && !known.contains_key(id) {
                said.push(finished(m));
            }
        }
        self.known = listed;
        said
    }
}

fn joined(m: &Member) -> SourceEvent {
    SourceEvent::Joined {
        id: m.id.clone(),
        addr: m.data_addr.clone(),
        version: m.version,
    }
}

fn finished(m: &Member) -> SourceEvent {
    SourceEvent::Finished {
        id: m.id.clone(),
        addr: m.data_addr.clone(),
        version: m.version,
    }
}

fn gone(m: Member, how: Departure) -> SourceEvent {
    SourceEvent::Failed {
        id: m.id,
        addr: m.data_addr,
        version: m.version,
        progress: m.progress,
        how,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn receiver(id: &str, done: bool, progress: u64) -> (String, Member) {
        let m = Member {
            id: id.into(),
            epoch: 1,
            source_epoch: 1,
            data_addr: format!("10.0.0.1:{}", id.len()),
            ctl_addr: String::new(),
            role: Role::Receiver,
            progress,
            done,
            order: 0,
            version: 2,
            rate: 0,
            number: None,
            identity: None,
        };
        (id.to_owned(), m)
    }

    fn said(events: &[SourceEvent]) -> Vec<String> {
        let mut v: Vec<String> = events
            .iter()
            .map(|e| match e {
                SourceEvent::Joined { id, .. } => format!("joined {id}"),
                SourceEvent::Finished { id, .. } => format!("finished {id}"),
                SourceEvent::Failed {
                    id, progress, how, ..
                } => format!("{how:?} {id} at {progress}"),
                SourceEvent::Returned { id, .. } => format!("back {id}"),
                other => format!("{other:?}"),
            })
            .collect();
        v.sort();
        v
    }

    #[test]
    fn the_watcher_reports_joins_finishes_and_members_gone_unfinished_once() {
        let t0 = Instant::now();
        let mut w = Membership::default();
        let first = [
            receiver("stays", false, 1),
            receiver("finishes", false, 3),
            receiver("dies", false, 4),
            receiver("quits", false, 5),
            receiver("left_done", true, 8),
        ];
        w.step(first.iter().map(|(_, m)| m.clone()).collect(), vec![], t0);
        let listed = [
            receiver("stays", false, 2),
            receiver("finishes", true, 8),
            receiver("new", false, 0),
        ];
        let departed = vec![
            (receiver("dies", false, 4).1, Departure::Lapsed),
            (receiver("quits", false, 6).1, Departure::Left),
            (receiver("left_done", true, 8).1, Departure::Left),
            // Joined and finished between two looks: both said.
            (receiver("new_done", true, 8).1, Departure::Left),
        ];
        let events = w.step(
            listed.iter().map(|(_, m)| m.clone()).collect(),
            departed,
            t0,
        );
        assert_eq!(
            said(&events),
            [
                "Lapsed dies at 4",
                "Left quits at 6",
                "finished finishes",
                "finished new_done",
                "joined new",
                "joined new_done",
            ]
        );
        // Nothing changed: nothing said.
        let again = w.step(listed.iter().map(|(_, m)| m.clone()).collect(), vec![], t0);
        assert!(again.is_empty(), "{again:?}");
    }

    #[test]
    fn a_receiver_stopped_past_its_lease_and_resumed_is_silent_then_back_never_joined_twice() {
        let t0 = Instant::now();
        let mut w = Membership::default();
        let a = receiver("a", false, 3).1;
        assert_eq!(said(&w.step(vec![a.clone()], vec![], t0)), ["joined a"]);
        // Stopped (SIGSTOP): its lease runs out.
        let gone = w.step(vec![], vec![(a.clone(), Departure::Lapsed)], t0);
        assert_eq!(said(&gone), ["Lapsed a at 3"]);
        assert!(gone[0].to_string().contains("went silent"), "{}", gone[0]);
        // Resumed: its heartbeat lists it again.
        let back = w.step(vec![a.clone()], vec![], t0 + Duration::from_secs(5));
        assert_eq!(said(&back), ["back a"]);
        assert!(
            back[0].to_string().contains("is back after 5.0 s"),
            "{}",
            back[0]
        );
        // It finishes, and leaves done.
        let mut done = a.clone();
        done.done = true;
        let end = w.step(vec![], vec![(done, Departure::Left)], t0);
        assert_eq!(said(&end), ["finished a"]);
        // A lease that ran out and was renewed between two looks says nothing.
        let b = receiver("b", false, 1).1;
        w.step(vec![b.clone()], vec![], t0);
        let blip = w.step(vec![b.clone()], vec![(b, Departure::Lapsed)], t0);
        assert!(blip.is_empty(), "{blip:?}");
    }

    /// One engine pulls version after version under one id (a Python receiver, each bucket),
    /// and leaves each the moment it is done: its finish of one version and its join of the
    /// next, seen in the same look, are both said.
    #[test]
    fn a_member_that_finishes_one_version_and_joins_the_next_between_two_looks_finished_it() {
        let t0 = Instant::now();
        let mut w = Membership::default();
        let v2 = receiver("a", false, 3).1;
        assert_eq!(said(&w.step(vec![v2.clone()], vec![], t0)), ["joined a"]);
        let mut done = v2.clone();
        done.done = true;
        let mut v3 = receiver("a", false, 0).1;
        v3.version = 3;
        let events = w.step(vec![v3.clone()], vec![(done, Departure::Left)], t0);
        assert_eq!(said(&events), ["finished a", "joined a"]);
        let versions: Vec<u64> = events
            .iter()
            .map(|e| match e {
                SourceEvent::Finished { version, .. } | SourceEvent::Joined { version, .. } => {
                    *version
                }
                other => panic!("{other:?}"),
            })
            .collect();
        assert!(
            versions.contains(&2) && versions.contains(&3),
            "{versions:?}"
        );
    }
}

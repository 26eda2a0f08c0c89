//! Joining a broadcast: the manifest from the source, where each segment lands (buffers of
//! the receiver's own, the caller's destinations, or files), the control service, the listing.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use ferry::{Access, DataPlane, MemoryRegion, Registration, TransferEngine};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::control::{self, CtlClient, CtlState, Progress, Reply, Request};
use crate::discovery::Discovery;
use crate::error::BroadcastError;
use crate::landing::{Landing, LandingFile, partial_name, recover_dir, room_for};
use crate::layout::{self, LocalExtents, Slice};
use crate::manifest::{MAX_TOTAL_BYTES, Manifest};
use crate::plan::{Member, Role};

use super::payload::Payload;
use super::{Advert, Origin, Receiver, ReceiverOptions, Snapshot, TestHooks, Timeline, unix_now};
use crate::destinations::{Destinations, match_tensors};

pub(super) fn control_err(addr: &str, reason: impl Into<String>) -> BroadcastError {
    BroadcastError::Control {
        addr: addr.to_owned(),
        reason: reason.into(),
    }
}

/// An address with an unspecified IP (a member that listens on all interfaces) made reachable
/// with `ip`.
pub(super) fn reachable(addr: &str, ip: IpAddr) -> String {
    match addr.parse::<SocketAddr>() {
        Ok(a) if a.ip().is_unspecified() => SocketAddr::new(ip, a.port()).to_string(),
        _ => addr.to_owned(),
    }
}

/// What a source answered a joining receiver.
struct Answered {
    manifest: Manifest,
    /// The source that answered.
    origin: Origin,
    /// This end's IP on the connection to the source.
    local_ip: IpAddr,
    /// When the join started and the manifest was checked.
    timeline: Timeline,
}

/// Finds the source of `name` through `discovery` and fetches the manifest of `version`
/// (`None`: the newest). Every source record listed is tried in turn until one answers as
/// asked (a list anyone may write can hold a record of a stranger, or a stale one, before the
/// source's own); when none does, the last one's refusal is the error.
async fn manifest_from_source(
    discovery: &Arc<dyn Discovery>,
    wanted: Option<&str>,
    opts: &ReceiverOptions,
) -> Result<Answered, BroadcastError> {
    let join_start = unix_now();
    crate::discovery::require_bound(
        discovery.listing(),
        &discovery.describe(),
        opts.keys.is_some(),
        opts.expect_manifest.is_some(),
    )?;
    let listed = discovery.members().await?;
    let mut refused = None;
    for source in listed.iter().filter(|m| m.role == Role::Source) {
        match manifest_from(source, &listed, wanted, opts).await {
            Ok((manifest, origin, local_ip)) => {
                let timeline = Timeline {
                    join_start: Some(join_start),
                    manifest: Some(unix_now()),
                    ..Default::default()
                };
                return Ok(Answered {
                    manifest,
                    origin,
                    local_ip,
                    timeline,
                });
            }
            Err(e) => {
                tracing::warn!(source = %source.ctl_addr, error = %e,
                    "a listed source did not answer as asked; trying the next");
                refused = Some(e);
            }
        }
    }
    Err(refused.unwrap_or_else(|| BroadcastError::NoSource {
        name: wanted.unwrap_or("(any)").to_owned(),
        discovery: discovery.describe(),
    }))
}

/// Fetches the manifest from the source `source` names (one record of `listed`) and checks it
/// answers as asked: its incarnation listed, the expected digest, a size within the limit, the
/// name and version wanted. Returns the manifest, the source, and this end's IP.
async fn manifest_from(
    source: &Member,
    listed: &[Member],
    wanted: Option<&str>,
    opts: &ReceiverOptions,
) -> Result<(Manifest, Origin, IpAddr), BroadcastError> {
    let version = opts.version;
    let name = wanted.unwrap_or("(any)");
    let timeout = Duration::from_secs(5);
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
    // The record taken names the incarnation that answered (not a stale record of a source
    // restarted on the same address, nor one listing another's control service).
    let source = crate::discovery::answered_by(listed, &source.ctl_addr, source_epoch)?;
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
    let origin = Origin {
        epoch: source_epoch,
        ip: source_ip,
        listed: source,
    };
    Ok((manifest, origin, ctl.local_addr().ip()))
}

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
    Ok(engine.register(lazily_zeroed(n, name)?, access, name)?)
}

/// A buffer of `len` bytes of this receiver's own for `manifest`'s pull (`what`: `scratch`,
/// `landing`), registered with `access` on `engine` under a name no other in the process has
/// (`NAME.vVERSION.WHAT.K`), and the slice of all of it.
fn own_buffer(
    engine: &TransferEngine,
    manifest: &Manifest,
    what: &str,
    len: u64,
    access: Access,
) -> Result<(Registration, Slice), BroadcastError> {
    let k = SCRATCH.fetch_add(1, Ordering::Relaxed);
    let reg_name = format!("{}.v{}.{what}.{k}", manifest.name, manifest.version);
    let reg = alloc_for(engine, len, &reg_name, access)?;
    let whole = Slice::whole(&reg, &reg_name);
    Ok((reg, whole))
}

/// `n` zeroed bytes the kernel zeroes page by page as they are first written (`calloc`: fresh
/// pages, small ones), not up front: the pull's receives fault them in as the chunks land, so
/// no pass over the whole payload (and no compaction for huge pages) comes before joining.
/// [`MemoryRegion::alloc_zeroed`] writes zeros over huge pages first, which cost each receiver
/// of `cargo xtask bench broadcast` about 0.4 s of CPU per 256 MiB before its first chunk
/// (zeroing, faults, huge-page compaction; eight receivers on one machine: 12 to 24 s from
/// manifest to joined), for nothing here: a chunk overwrites its bytes before it is advertised.
///
/// A refused allocation is an error, never an abort: the size is first reserved fallibly
/// (`try_reserve_exact`, released at once), and only then taken zeroed. Past that, as for any
/// allocation under overcommit, a page the kernel cannot find later is the OOM killer's.
fn lazily_zeroed(n: usize, name: &str) -> Result<MemoryRegion, BroadcastError> {
    let mut probe: Vec<u8> = Vec::new();
    probe.try_reserve_exact(n).map_err(|e| {
        BroadcastError::io(
            format!("allocating {n} bytes for {name:?}"),
            std::io::Error::other(e.to_string()),
        )
    })?;
    drop(probe);
    Ok(MemoryRegion::from_vec(vec![0u8; n]))
}

/// An engine of the receiver's own ([`Receiver::join`], [`Receiver::join_to_dir`]): on
/// [`ReceiverOptions::data_plane`] alone, or with the same-host plane for `Auto`, listening on
/// `ip` (any free port), keyed with [`ReceiverOptions::keys`] when given.
fn own_engine(opts: &ReceiverOptions, ip: IpAddr) -> Result<TransferEngine, BroadcastError> {
    let mut builder = TransferEngine::builder()
        .data_plane(opts.data_plane)
        // An explicit network plane is used alone; `Auto` adds the same-host plane.
        .same_host(opts.data_plane == DataPlane::Auto)
        .listen(SocketAddr::new(ip, 0));
    if let Some(k) = &opts.keys {
        builder = builder.auth_keyring(k.clone());
    }
    Ok(builder.build()?)
}

/// What joining sets up, before the control service starts.
struct Joined {
    engine: TransferEngine,
    owns_engine: bool,
    /// The manifest, its source, and the timeline so far.
    answered: Answered,
    /// The IP its control service listens on.
    ip: IpAddr,
    payload: Payload,
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
        let answered = manifest_from_source(&discovery, name, &opts).await?;
        let manifest = &answered.manifest;
        let ip = opts.listen_ip.unwrap_or(answered.local_ip);
        let engine = own_engine(&opts, ip)?;
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
            answered,
            ip,
            payload: Payload::new(layout, own, None, Vec::new(), None),
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
        let answered = manifest_from_source(&discovery, name, &opts).await?;
        let manifest = &answered.manifest;
        // A pull killed in this directory before: its commit finished, its hidden files gone
        // (they would count against the room, and nothing else removes them).
        recover_dir(dir)?;
        room_for(dir, manifest.total_bytes())?;
        let ip = opts.listen_ip.unwrap_or(answered.local_ip);
        let engine = own_engine(&opts, ip)?;
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
            let (reg, whole) =
                own_buffer(&engine, manifest, "landing", slots * chunk, Access::LOCAL)?;
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
            answered,
            ip,
            payload: Payload::new(layout, own, None, Vec::new(), Some(landing)),
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
        let answered = manifest_from_source(&discovery, name, &opts).await?;
        let manifest = &answered.manifest;
        let matched = match_tensors(manifest, &dests)?;
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
        let (gap_total, gaps) = layout::gaps(manifest, &taken);
        let mut own = Vec::new();
        let scratch = if gap_total > 0 {
            let (reg, whole) =
                own_buffer(engine, manifest, "scratch", gap_total, Access::REMOTE_READ)?;
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
            _ => opts.listen_ip.unwrap_or(answered.local_ip),
        };
        let j = Joined {
            engine: engine.clone(),
            owns_engine: false,
            answered,
            ip,
            payload: Payload::new(layout, own, staged, tensors, None),
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
            answered:
                Answered {
                    manifest,
                    origin,
                    mut timeline,
                    ..
                },
            ip,
            payload,
        } = j;
        let source_epoch = origin.epoch;
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
            layout: Some(if payload.files.is_some() {
                layout::identity(&manifest)
            } else {
                layout::to_wire(&payload.layout)
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
            identity: Some(engine.server_identity().to_string()),
        };
        if let Some(found) = discovery.register(&member).await?
            && found != source_epoch
        {
            return Err(origin.restarted(&manifest.name, found));
        }
        timeline.joined = Some(unix_now());
        let total = manifest.total_bytes();
        let (snapshot_tx, _) = watch::channel(Snapshot {
            total,
            ..Default::default()
        });
        let name = manifest.name.clone();
        tracing::info!(name, version = manifest.version, id = %member.id, %data_addr, %ctl_addr, source_epoch,
            chunks = manifest.chunks.len(), bytes = total, staged = payload.is_staged(), "receiver joined");
        Ok(Self {
            engine,
            owns_engine,
            discovery,
            manifest,
            origin,
            member,
            opts,
            timeline,
            advert: Advert {
                progress_tx,
                snapshot_tx,
                _ctl: ctl,
            },
            payload,
            hooks: TestHooks::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::lazily_zeroed;

    /// Resident bytes of the mappings of this process that meet `addr..addr + len`
    /// (`/proc/self/smaps`; advice such as `MADV_HUGEPAGE` splits one allocation into several).
    fn resident(addr: usize, len: usize) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("reading smaps");
        let (mut inside, mut total, mut seen) = (false, 0, false);
        for line in smaps.lines() {
            let head = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = head.split_once('-')
                && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            {
                inside = a < addr + len && addr < b;
                seen |= inside;
            } else if inside && let Some(kb) = line.strip_prefix("Rss:") {
                let kb = kb.trim().trim_end_matches("kB").trim();
                total += kb.parse::<u64>().expect("Rss in kB") << 10;
            }
        }
        assert!(seen, "no mapping holds {addr:#x}");
        total
    }

    #[test]
    fn a_receivers_buffer_is_not_written_before_its_chunks_land() {
        // 64 MiB: past the allocator's mmap threshold, so the buffer is a mapping of its own.
        let len = 64 << 20;
        let region = lazily_zeroed(len, "w").unwrap();
        let rss = resident(region.as_ptr() as usize, len);
        assert!(
            rss < 8 << 20,
            "{rss} of {len} bytes resident right after allocating: zeroed up front"
        );
        let mut b = [0xffu8; 4096];
        region.read_at(len as u64 - 4096, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0), "fresh bytes read as zeros");
    }

    #[test]
    fn a_buffer_the_machine_cannot_hold_is_an_error_not_an_abort() {
        let err = lazily_zeroed(usize::MAX / 2, "w").map(|_| ()).unwrap_err();
        assert!(err.to_string().contains("\"w\""), "{err}");
    }
}

//! The source: publishes the manifest's files as Ferry file segments, serves the manifest and
//! (embedded discovery) the membership list on its control service, and lists itself in the
//! discovery backend it is given.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::{Access, DataPlane, FileRegistration, TransferEngine};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::control::{self, CtlState, Progress, Tracker};
use crate::discovery::Discovery;
use crate::error::BroadcastError;
use crate::manifest::{Manifest, ManifestError};
use crate::plan::{Member, Role};

/// How a source runs.
#[derive(Clone, Debug)]
pub struct SourceOptions {
    /// Where the control service listens (the address receivers are given). Its IP should be
    /// one receivers reach; the Ferry listener takes the same IP and any free port.
    pub listen: SocketAddr,
    /// Which data plane serves the files.
    pub data_plane: DataPlane,
    /// How long a member stays listed by the embedded tracker without a heartbeat.
    pub lease: Duration,
}

impl Default for SourceOptions {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            data_plane: DataPlane::Auto,
            lease: Duration::from_secs(3),
        }
    }
}

/// A running source. Dropping it stops serving.
#[derive(Debug)]
pub struct Source {
    engine: TransferEngine,
    _files: Vec<FileRegistration>,
    manifest: Manifest,
    ctl_addr: SocketAddr,
    member: Member,
    tracker: Arc<Tracker>,
    discovery: Option<Arc<dyn Discovery>>,
    /// Held for its drop: the control listener closes with the member.
    _ctl: control::Service,
    keepalive: Option<JoinHandle<()>>,
}

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
        let engine = TransferEngine::builder()
            .data_plane(opts.data_plane)
            .listen(SocketAddr::new(ctl_addr.ip(), 0))
            .build()?;
        let mut regs = Vec::with_capacity(files.len());
        for (path, seg) in files.iter().zip(&manifest.segments) {
            let reg = engine.publish_file_named(path, Access::REMOTE_READ, &seg.name)?;
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
        };
        let tracker = Arc::new(Tracker::new(member.clone(), opts.lease));
        let (_tx, progress) = watch::channel(Progress {
            prefix: chunks,
            done: true,
        });
        let state = Arc::new(CtlState {
            source_epoch,
            manifest: Some(manifest.clone()),
            progress,
            tracker: Some(tracker.clone()),
        });
        let ctl = control::Service::start(listener, state);
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
        Ok(Self {
            engine,
            _files: regs,
            manifest,
            ctl_addr,
            member,
            tracker,
            discovery,
            _ctl: ctl,
            keepalive,
        })
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

    /// The manifest published.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The engine serving the files (its `describe()` has the counters).
    pub fn engine(&self) -> &TransferEngine {
        &self.engine
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
        self.engine.shutdown();
    }
}

//! The RDMA [`Transport`]: its rails, counters, served-set sweeper, and the handshake's
//! offer / accept / open (done in [`crate::admission`]).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use ferry_core::{
    BoxFuture, Channel, Epoch, PeerId, PeerInfo, Transport, TransportKind, TransportOffer,
};
use ferry_verbs_sys::Verbs;

use crate::admission;
use crate::backend::RdmaBackend;
use crate::config::RdmaConfig;
use crate::error::{RdmaError, error_chain};
use crate::native::Faults;
use crate::pump::RailStats;
use crate::rails::open_rail;
use crate::served::ServedTable;
use crate::shared::Shared;

/// How often the sweeper reads probe answers, posts due probes and releases dead sets.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// RDMA reliable-connected queue pairs over the selected rails. Cheap to clone.
#[derive(Clone)]
pub struct RdmaTransport {
    shared: Arc<Shared>,
}

impl fmt::Debug for RdmaTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaTransport")
            .field("rails", &self.rail_names())
            .finish()
    }
}

impl RdmaTransport {
    /// Loads libibverbs, selects the rails (see [`RdmaConfig`]) and opens them.
    pub fn open(config: RdmaConfig) -> Result<Self, RdmaError> {
        let verbs = match &config.library {
            Some(p) => Verbs::load_from(p),
            None => Verbs::load(),
        }
        .map_err(|e| RdmaError::LoadLibrary {
            library: e
                .library()
                .unwrap_or(ferry_verbs_sys::IBVERBS_LIBRARY)
                .to_owned(),
            reason: error_chain(&e),
        })?;
        let specs = config.resolve(&verbs)?;
        let faults = Faults::default();
        let mut devices = HashMap::new();
        let mut rails = Vec::with_capacity(specs.len());
        for r in &specs {
            rails.push(open_rail(
                &verbs,
                &r.spec,
                r.paused,
                &mut devices,
                &config,
                &faults,
            )?);
        }
        drop(devices);
        let shared = Arc::new(Shared {
            pending: Mutex::default(),
            served: Mutex::new(ServedTable::new(admission::served_limits(&config))),
            mrs: Mutex::default(),
            next_mr: AtomicU64::new(1),
            channels: Mutex::default(),
            rails,
            config,
            faults,
        });
        start_sweeper(&shared);
        Ok(Self { shared })
    }

    /// The registration backend for the registry (one context per rail, in rail order).
    pub fn backend(&self) -> RdmaBackend {
        RdmaBackend {
            shared: self.shared.clone(),
        }
    }

    /// `device:port` of each rail, in rail (context) order.
    pub fn rail_names(&self) -> Vec<String> {
        self.shared.rails.iter().map(|r| r.name.clone()).collect()
    }

    /// Counters per rail, summed over this transport's live channels.
    pub fn rail_stats(&self) -> Vec<RailStats> {
        let mut out: Vec<RailStats> = self
            .shared
            .rails
            .iter()
            .map(|r| RailStats {
                rail: r.name.clone(),
                ..RailStats::default()
            })
            .collect();
        let mut chans = self
            .shared
            .channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        chans.retain(|w| w.strong_count() > 0);
        for c in chans.iter().filter_map(Weak::upgrade) {
            for (name, k) in &c.rails {
                if let Some(s) = out.iter_mut().find(|s| &s.rail == name) {
                    s.add(k);
                }
            }
        }
        out
    }

    /// Test-only (feature `__fault-injection`): breaks local rail `rail` (an index into
    /// [`rail_names`](Self::rail_names)) on every live channel, as a failing link would: each
    /// channel's worker moves that rail's queue pair to ERR at its next step with work
    /// outstanding on it, and learns of the failure only from the flushed completions. Returns
    /// how many channel rails were marked.
    #[cfg(feature = "__fault-injection")]
    pub fn inject_rail_failure(&self, rail: usize) -> usize {
        let Some(name) = self.shared.rails.get(rail).map(|r| r.name.as_str()) else {
            return 0;
        };
        let mut chans = self
            .shared
            .channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        chans.retain(|w| w.strong_count() > 0);
        let mut marked = 0;
        for c in chans.iter().filter_map(Weak::upgrade) {
            for (n, k) in &c.rails {
                if n == name {
                    k.inject_failure
                        .store(true, std::sync::atomic::Ordering::Release);
                    marked += 1;
                }
            }
        }
        marked
    }

    /// `Err(Unquiesced)` when a native destroy failed (the objects are kept).
    pub fn check(&self) -> Result<(), ferry_core::Error> {
        self.shared.faults.check()
    }

    /// Releases the queue pairs kept for serving `peer` (all its incarnations when `epoch` is
    /// `None`).
    pub fn release_peer(&self, peer: PeerId, epoch: Option<Epoch>) {
        self.shared
            .served
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .release(peer, epoch);
    }
}

/// Starts the thread that sweeps `shared`'s served sets every [`SWEEP_EVERY`] (probes, dead-peer
/// timeout, release) for as long as the transport lives. Without it, served sets would be
/// swept only when a handshake comes.
fn start_sweeper(shared: &Arc<Shared>) {
    let weak = Arc::downgrade(shared);
    let spawned = std::thread::Builder::new()
        .name("ferry-rdma-sweep".into())
        .spawn(move || sweeper(weak));
    if let Err(e) = spawned {
        tracing::warn!(error = %e,
            "cannot start the RDMA sweeper: served queue pairs are swept at handshakes only");
    }
}

fn sweeper(shared: Weak<Shared>) {
    loop {
        std::thread::sleep(SWEEP_EVERY);
        let Some(shared) = shared.upgrade() else {
            break;
        };
        let mut served = shared.served.lock().unwrap_or_else(PoisonError::into_inner);
        let (qps, sets) = served.sweep(Instant::now());
        if qps > 0 {
            tracing::info!(
                qps,
                sets,
                left = served.sets(),
                qps_left = served.qps(),
                "served RDMA queue pairs released: their peer is gone"
            );
        }
    }
}

impl Transport for RdmaTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn offer(&self) -> TransportOffer {
        match admission::offer(&self.shared) {
            Ok(rails) => TransportOffer::Rdma { rails },
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "cannot create RDMA queue pairs to offer");
                TransportOffer::Rdma { rails: Vec::new() }
            }
        }
    }

    fn accept(&self, peer: &PeerInfo) -> Result<TransportOffer, ferry_core::Error> {
        admission::accept(&self.shared, peer)
            .map(|rails| TransportOffer::Rdma { rails })
            .map_err(ferry_core::Error::from)
    }

    fn open(
        &self,
        peer: PeerInfo,
    ) -> BoxFuture<'static, Result<Arc<dyn Channel>, ferry_core::Error>> {
        let r = admission::open(&self.shared, &peer)
            .map(|c| Arc::new(c) as Arc<dyn Channel>)
            .map_err(ferry_core::Error::from);
        Box::pin(async move { r })
    }
}

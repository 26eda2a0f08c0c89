//! Route choice: which transport carries the portable data plane (chosen once, at build), which
//! transport each peer is opened over (at connect), and the counters kept per route.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

use ferry_core::wire::TransportOffer;
use ferry_core::{Error, Transport, TransportKind};
use ferry_transport_tcp::TcpTransport;
#[cfg(feature = "uring")]
use ferry_transport_uring::{Preference, UringProbe, UringTransport};

use crate::config::DataPlaneConfig;
use crate::counters::{Latencies, RouteCounters};
use crate::describe::RouteDescription;

/// Which transport carries the portable data plane (the one every host has, beside RDMA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DataPlane {
    /// io_uring where the kernel supports the opcodes it needs (probed at build), TCP otherwise;
    /// the reason is reported in [`Description::data_plane`](crate::Description::data_plane).
    /// The builder's default.
    #[default]
    Auto,
    /// io_uring, or an error naming what the kernel lacks.
    Uring,
    /// The tokio TCP transport.
    Tcp,
}

impl DataPlane {
    /// Parses `auto`, `uring` or `tcp`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Self::Auto),
            "uring" | "io_uring" => Some(Self::Uring),
            "tcp" => Some(Self::Tcp),
            _ => None,
        }
    }
}

/// The portable data plane of an engine: its transports, which one was chosen, and why.
pub(crate) struct PortablePlane {
    /// `Tcp` or `Uring`.
    pub(crate) kind: TransportKind,
    /// Why (reported by `describe`).
    pub(crate) reason: String,
    /// The io_uring transport, when it was chosen.
    #[cfg(feature = "uring")]
    pub(crate) uring: Option<UringTransport>,
    /// The TCP transport, offered beside io_uring too: the wire is the same, so TCP-only peers
    /// still meet us (our io_uring channel takes their TCP offers).
    pub(crate) tcp: TcpTransport,
}

/// Chooses the portable data plane for `pref` (on `probe`, or on a probe of this kernel when
/// none is given and io_uring may be chosen) and builds its transports from `config`. A forced
/// io_uring that cannot be used is `Unavailable`, naming what is missing.
pub(crate) fn open_data_plane(
    pref: DataPlane,
    #[cfg(feature = "uring")] probe: Option<&UringProbe>,
    config: &DataPlaneConfig,
) -> Result<PortablePlane, Error> {
    const FORCED_TCP: &str = "tcp forced by configuration";
    let tcp = TcpTransport::new(config.tcp());
    #[cfg(feature = "uring")]
    {
        let pref = match pref {
            DataPlane::Auto => Preference::Auto,
            DataPlane::Uring => Preference::Uring,
            DataPlane::Tcp => Preference::Tcp,
        };
        let probed;
        let probe = match probe {
            Some(p) => p,
            None if pref == Preference::Tcp => {
                return Ok(PortablePlane {
                    kind: TransportKind::Tcp,
                    reason: FORCED_TCP.into(),
                    uring: None,
                    tcp,
                });
            }
            None => {
                probed = ferry_transport_uring::probe_kernel();
                &probed
            }
        };
        let chosen =
            ferry_transport_uring::select(probe, pref).map_err(|e| Error::Unavailable {
                library: "io_uring".into(),
                reason: format!("io_uring was forced but cannot be used: {e}"),
            })?;
        let uring = match chosen.kind {
            TransportKind::Uring => Some(UringTransport::with_probe(config.uring(), probe)?),
            _ => None,
        };
        Ok(PortablePlane {
            kind: chosen.kind,
            reason: chosen.reason,
            uring,
            tcp,
        })
    }
    #[cfg(not(feature = "uring"))]
    {
        let reason = match pref {
            DataPlane::Uring => {
                return Err(Error::Unavailable {
                    library: "io_uring".into(),
                    reason: "io_uring was forced but this build lacks the `uring` feature".into(),
                });
            }
            DataPlane::Tcp => FORCED_TCP,
            DataPlane::Auto => "fell back to tcp: this build lacks the `uring` feature",
        };
        Ok(PortablePlane {
            kind: TransportKind::Tcp,
            reason: reason.into(),
            tcp,
        })
    }
}

/// The transport a peer is opened over, and the offer of the peer's it answers.
pub(crate) struct Pick {
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) offer: TransportOffer,
}

/// Picks the first of `ours` (in order of preference), other than `skip`, that the peer at
/// `addr` offers. Our io_uring channel speaks the TCP transport's wire, so it takes a TCP offer
/// too. `NoRoute` when nothing matches.
pub(crate) fn pick(
    ours: &[Arc<dyn Transport>],
    offers: &[TransportOffer],
    addr: SocketAddr,
    skip: Option<TransportKind>,
) -> Result<Pick, Error> {
    let offered = |kind: TransportKind| {
        offers
            .iter()
            .find(|o| TransportKind::of_offer(o) == Some(kind))
    };
    for t in ours {
        let kind = t.kind();
        if Some(kind) == skip {
            continue;
        }
        let offer = offered(kind).or_else(|| {
            (kind == TransportKind::Uring)
                .then(|| offered(TransportKind::Tcp))
                .flatten()
        });
        let Some(offer) = offer else { continue };
        return Ok(Pick {
            transport: t.clone(),
            offer: offer.clone(),
        });
    }
    Err(Error::NoRoute {
        peer: addr.to_string(),
        reason: format!(
            "we offer {:?}, the peer {:?}",
            ours.iter().map(|t| t.kind().name()).collect::<Vec<_>>(),
            offers
        ),
    })
}

/// Counters per route (a peer address and the transport its requests take), in the order
/// routes were first used, and the engine's latency histograms they all feed.
#[derive(Debug, Default)]
pub(crate) struct Routes {
    routes: Mutex<Vec<(String, TransportKind, Arc<RouteCounters>)>>,
    latencies: Arc<Latencies>,
}

impl Routes {
    /// The counters of the route to `peer` over `kind` (made on first use).
    pub(crate) fn counters(&self, peer: String, kind: TransportKind) -> Arc<RouteCounters> {
        let mut routes = self.routes.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, _, c)) = routes.iter().find(|(p, k, _)| *p == peer && *k == kind) {
            return c.clone();
        }
        let c = Arc::new(RouteCounters::new(self.latencies.clone()));
        routes.push((peer, kind, c.clone()));
        c
    }

    /// Every route's counters now.
    pub(crate) fn snapshot(&self) -> Vec<RouteDescription> {
        self.routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(p, k, c)| c.snapshot(p.clone(), *k))
            .collect()
    }

    /// The engine's latency histograms.
    pub(crate) fn latencies(&self) -> &Latencies {
        &self.latencies
    }
}

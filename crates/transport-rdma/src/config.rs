//! Which ports carry traffic, and the limits of the data path.

use std::path::PathBuf;
use std::time::Duration;

use ferry_topology::{LinkLayer, Selector, Topology, VerbsDevices};
use ferry_verbs_sys::Verbs;

use crate::error::{RdmaError, error_chain};
use crate::qp::QpTiming;

/// One rail: a device port and the GID index its traffic uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RailSpec {
    /// Verbs device name (`mlx5_0`, `rxe0`).
    pub device: String,
    /// Port number (1-based).
    pub port: u8,
    /// GID index on that port.
    pub gid_index: u32,
}

impl RailSpec {
    /// A rail on `device` port `port` with GID index `gid_index`.
    pub fn new(device: impl Into<String>, port: u8, gid_index: u32) -> Self {
        Self {
            device: device.into(),
            port,
            gid_index,
        }
    }
}

/// A rail discovery chose, and whether its port is down (a paused rail: registrations still get
/// copies on it, traffic does not use it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Resolved {
    pub(crate) spec: RailSpec,
    pub(crate) paused: bool,
}

/// The rails of `topo`: every usable port, plus (paused) the ports that the filters keep but that
/// are down, on devices the filters keep. Pinned selections never include paused ports (a pin is
/// strict: `Topology` already refused a pinned port that is down).
fn rails_from(topo: &Topology, selector: &Selector) -> Vec<Resolved> {
    let pinned = selector.device_pin.is_some();
    let mut rails = Vec::new();
    for nic in &topo.nics {
        let kept = nic.usable
            || (!pinned
                && nic
                    .reason
                    .as_deref()
                    .is_some_and(|r| r.starts_with("no usable port"))
                && selector.device_exclusion(nic.id, &nic.name).is_none());
        if !kept {
            continue;
        }
        for p in &nic.ports {
            let paused = !p.usable;
            if paused
                && (pinned
                    || p.state.is_active()
                    || selector.port_exclusion(&nic.name, p.port).is_some()
                    || !matches!(p.link_layer, LinkLayer::InfiniBand | LinkLayer::Ethernet))
            {
                continue;
            }
            let Ok(port) = u8::try_from(p.port) else {
                continue;
            };
            let gid_index = match (selector.gid_pin, p.gid_index) {
                (Some(pin), _) => pin,
                (None, Some(g)) => g,
                (None, None) => 0,
            };
            rails.push(Resolved {
                spec: RailSpec::new(nic.name.clone(), port, gid_index),
                paused,
            });
        }
    }
    rails
}

/// Configuration of the RDMA transport.
///
/// [`RdmaConfig::default`] discovers: every usable port of every device that libibverbs lists
/// (joined with sysfs by `ferry-topology`), with the GID the link layer calls for (RoCE v2
/// IPv4-mapped first), narrowed by [`selector`](Self::selector). [`RdmaConfig::new`] pins one
/// device, port 1 and GID index 0, strictly: a pinned port that is down is an error.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RdmaConfig {
    /// Filters and pins (NCCL_IB_HCA syntax, whitelist, blacklist, device/port/GID pins, mask).
    pub selector: Selector,
    /// Explicit rails; when nonempty, discovery is skipped and each is used as given (strict).
    pub rails: Vec<RailSpec>,
    /// The sysfs root discovery reads (default `/sys`).
    pub sysfs_root: PathBuf,
    /// The libibverbs to load (default: the process-wide one, `$FERRY_IBVERBS_LIB` honoured).
    pub library: Option<PathBuf>,
    /// Largest chunk one work request moves (default 1 MiB); larger ops are split and striped.
    pub chunk_size: u64,
    /// Work requests in flight per queue pair (default 64; capped by the device).
    pub depth: u32,
    /// Signal a completion at least every this many work requests (default 16).
    pub signal_every: u32,
    /// Timeouts and retries of the queue pairs.
    pub timing: QpTiming,
    /// How long a failed queue pair may take to flush (default 30 s); past it, its outstanding
    /// work is lost and its requests resolve with `drained: false`.
    pub flush_timeout: Duration,
    /// Queue-pair sets kept for peers this side serves (default 256), one per peer incarnation
    /// (a heal or reconnect of that incarnation joins its set). Sets whose peer is gone (their
    /// probes fail or go unanswered) are released; past the limit, idle sets go, then the
    /// unproven sets (no probe answered yet) of the key name (or of the unauthenticated peers)
    /// that holds the most. A set proven in use is never released to make room: the newcomer
    /// is refused instead.
    pub max_served: usize,
    /// Queue-pair sets kept per authenticated key name (default 32): past it, the name's idle
    /// sets go; its sets in use or being opened never do (the newcomer is refused). Peers that
    /// proved no key are bounded by `max_served` alone.
    pub max_served_per_name: usize,
    /// Queue pairs kept per authenticated key name, over all its sets (default 128): a hello
    /// offering more rails than this is refused, and a new set past it is admitted as one past
    /// `max_served_per_name` is.
    pub max_qps_per_name: usize,
    /// Whether the unacknowledged WRITE chunks of a rail that failed may be replayed on another
    /// rail of the channel (default `false`: they stay `Uncertain` and the request fails).
    /// Unacknowledged READ chunks are always replayed when a healthy rail is left (READs are
    /// idempotent); a remote access error is never replayed. Replays are counted per rail
    /// ([`RailStats::replayed`](crate::RailStats::replayed)).
    pub replay_writes: bool,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            selector: Selector::default(),
            rails: Vec::new(),
            sysfs_root: PathBuf::from("/sys"),
            library: None,
            chunk_size: 1 << 20,
            depth: 64,
            signal_every: 16,
            timing: QpTiming::default(),
            flush_timeout: Duration::from_secs(30),
            max_served: 256,
            max_served_per_name: 32,
            max_qps_per_name: 128,
            replay_writes: false,
        }
    }
}

impl RdmaConfig {
    /// Pins `device`, port 1, GID index 0 (strict: no fallback when it is unusable).
    pub fn new(device: impl Into<String>) -> Self {
        let mut c = Self::default();
        c.selector.device_pin = Some(device.into());
        c.selector.port_pin = Some(1);
        c.selector.gid_pin = Some(0);
        c
    }

    /// Uses exactly these rails (no discovery).
    pub fn with_rails(rails: Vec<RailSpec>) -> Self {
        Self {
            rails,
            ..Self::default()
        }
    }

    /// Replaces the selector.
    pub fn selector(mut self, selector: Selector) -> Self {
        self.selector = selector;
        self
    }

    /// Sets the chunk size.
    pub fn chunk_size(mut self, bytes: u64) -> Self {
        self.chunk_size = bytes;
        self
    }

    /// Sets the work requests in flight per queue pair.
    pub fn depth(mut self, n: u32) -> Self {
        self.depth = n;
        self
    }

    /// Sets whether WRITE chunks of a failed rail may be replayed on another rail (see
    /// [`replay_writes`](Self::replay_writes)).
    pub fn replay_writes(mut self, allow: bool) -> Self {
        self.replay_writes = allow;
        self
    }

    /// The rails to open: the explicit ones (strict), or what discovery and the selector leave.
    pub(crate) fn resolve(&self, verbs: &Verbs) -> Result<Vec<Resolved>, RdmaError> {
        if !self.rails.is_empty() {
            return Ok(self
                .rails
                .iter()
                .map(|spec| Resolved {
                    spec: spec.clone(),
                    paused: false,
                })
                .collect());
        }
        let devices = verbs.devices().map_err(|e| RdmaError::Select {
            reason: format!(
                "no RDMA devices found: ibv_get_device_list: {}",
                error_chain(&e)
            ),
        })?;
        if devices.is_empty() {
            return Err(RdmaError::Select {
                reason: "no RDMA devices found: libibverbs lists none (load a driver, e.g. \
                         `rdma link add rxe0 type rxe netdev eth0` for soft-RoCE)"
                    .into(),
            });
        }
        let names: Vec<String> = devices.iter().map(|d| d.name.clone()).collect();
        let topo = Topology::discover(
            &self.sysfs_root,
            &VerbsDevices::from_names(names.clone()),
            &self.selector,
        )
        .map_err(|e| RdmaError::Select {
            reason: error_chain(&e),
        })?;
        let rails = rails_from(&topo, &self.selector);
        if !rails.iter().any(|r| !r.paused) {
            let why: Vec<String> = topo
                .nics
                .iter()
                .map(|n| {
                    format!(
                        "{}: {}",
                        n.name,
                        n.reason.as_deref().unwrap_or("no usable port")
                    )
                })
                .collect();
            return Err(RdmaError::Select {
                reason: format!(
                    "no usable RDMA port among [{}] ({})",
                    names.join(", "),
                    why.join("; ")
                ),
            });
        }
        Ok(rails)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_pins_port_one_and_gid_zero() {
        let c = RdmaConfig::new("mlx5_0");
        assert_eq!(c.selector.device_pin.as_deref(), Some("mlx5_0"));
        assert_eq!(
            (c.selector.port_pin, c.selector.gid_pin),
            (Some(1), Some(0))
        );
        assert!(c.rails.is_empty());
        let d = RdmaConfig::default();
        assert_eq!(d.selector, Selector::default());
    }

    fn topo(ports: &[(&str, u32, bool, Option<&str>)]) -> Topology {
        use ferry_topology::{Nic, NicPort, PortState};
        let mut nics: Vec<Nic> = Vec::new();
        for &(name, port, active, reason) in ports {
            if !nics.iter().any(|n| n.name == name) {
                nics.push(Nic {
                    id: nics.len(),
                    name: name.into(),
                    pci: None,
                    numa_node: None,
                    usable: true,
                    reason: None,
                    ports: Vec::new(),
                });
            }
            let nic = nics.iter_mut().find(|n| n.name == name).unwrap();
            let reason = reason
                .map(str::to_owned)
                .or_else(|| (!active).then(|| "port state DOWN is not ACTIVE".to_owned()));
            nic.ports.push(NicPort {
                port,
                state: PortState::parse(if active { "4: ACTIVE" } else { "1: DOWN" }),
                phys_state: None,
                link_layer: LinkLayer::Ethernet,
                rate: None,
                netdev: None,
                mtu: None,
                gids: Vec::new(),
                gid_index: Some(3),
                usable: reason.is_none(),
                reason,
            });
        }
        for n in &mut nics {
            if n.ports.iter().all(|p| !p.usable) {
                n.usable = false;
                n.reason = Some("no usable port (...)".into());
            }
        }
        Topology {
            nics,
            gpus: Vec::new(),
            assignment: Vec::new(),
            verbs_only: Vec::new(),
            verbs_unavailable: None,
            pci_devices: 0,
            numa_nodes: Vec::new(),
        }
    }

    #[test]
    fn down_ports_the_filters_keep_are_paused_rails() {
        let t = topo(&[
            ("mlx5_0", 1, true, None),
            ("mlx5_0", 2, false, None),
            ("mlx5_1", 1, false, None),
            ("mlx5_2", 1, true, Some("excluded by HCA filter \"mlx5_0\"")),
        ]);
        let got: Vec<(String, u8, bool)> = rails_from(&t, &Selector::default())
            .into_iter()
            .map(|r| (r.spec.device, r.spec.port, r.paused))
            .collect();
        assert_eq!(
            got,
            vec![
                ("mlx5_0".to_owned(), 1, false),
                ("mlx5_0".to_owned(), 2, true),
                ("mlx5_1".to_owned(), 1, true),
            ]
        );
        // A blacklisted device contributes no paused rail; a pin never yields one.
        let sel = Selector {
            blacklist: vec!["mlx5_1".into()],
            ..Selector::default()
        };
        assert!(
            rails_from(&t, &sel)
                .iter()
                .all(|r| r.spec.device != "mlx5_1")
        );
        let sel = Selector {
            device_pin: Some("mlx5_0".into()),
            ..Selector::default()
        };
        assert!(rails_from(&t, &sel).iter().all(|r| !r.paused));
    }

    #[test]
    fn no_devices_is_the_actionable_error() {
        let verbs = match Verbs::load() {
            Ok(v) => v,
            Err(e) => {
                ferry_tests::require_or_skip(
                    ferry_tests::IBVERBS,
                    format!("libibverbs not loadable here: {e}"),
                );
                return;
            }
        };
        match verbs.devices() {
            Ok(d) if d.is_empty() => {}
            other => {
                eprintln!("skip: this machine lists RDMA devices ({other:?})");
                return;
            }
        }
        let err = RdmaConfig::default().resolve(&verbs).unwrap_err();
        assert!(err.to_string().contains("no RDMA devices found"), "{err}");
    }
}

//! Which ports carry traffic, and the limits of the data path.

use std::path::PathBuf;
use std::time::Duration;

use topology::{Selector, Topology, VerbsDevices};
use verbs_sys::Verbs;

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
    /// Queue-pair sets kept for peers this side serves (oldest destroyed beyond; default 256).
    pub max_served: usize,
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

    /// The rails to open: the explicit ones, or what discovery and the selector leave.
    pub(crate) fn resolve(&self, verbs: &Verbs) -> Result<Vec<RailSpec>, RdmaError> {
        if !self.rails.is_empty() {
            return Ok(self.rails.clone());
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
        let mut rails = Vec::new();
        for nic in topo.usable_nics() {
            for p in nic.ports.iter().filter(|p| p.usable) {
                let Ok(port) = u8::try_from(p.port) else {
                    continue;
                };
                let gid_index = match (self.selector.gid_pin, p.gid_index) {
                    (Some(pin), _) => pin,
                    (None, Some(g)) => g,
                    (None, None) => 0,
                };
                rails.push(RailSpec::new(nic.name.clone(), port, gid_index));
            }
        }
        if rails.is_empty() {
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

    #[test]
    fn no_devices_is_the_actionable_error() {
        let verbs = match Verbs::load() {
            Ok(v) => v,
            Err(e) => {
                eprintln!("skip: libibverbs not loadable here: {e}");
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

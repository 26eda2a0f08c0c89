//! Reading the machine model from a sysfs root.
//!
//! Only files real sysfs has are read, and every one of them may be missing or unreadable: that
//! leaves the corresponding field `None` (or the entry out) and is logged at debug level.

use std::cmp::Ordering;
use std::fs;
use std::path::{Component, Path, PathBuf};

use crate::error::TopologyError;
use crate::pci::{PciAddress, PciDevice};
use crate::rdma::{Gid, GidType, LinkLayer, NetDevice, PortState, RdmaDevice, RdmaPort, parse_gid};

/// One NUMA node (`devices/system/node/node<N>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaNode {
    /// The node number.
    pub id: u32,
    /// `cpulist`, if readable.
    pub cpulist: Option<String>,
}

/// Everything read from one sysfs root: the raw model, before verbs and filters are applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    /// The root the model was read from (as given).
    pub root: PathBuf,
    /// Every entry of `bus/pci/devices` whose name is a PCI address, in bus order.
    pub pci_devices: Vec<PciDevice>,
    /// Every `devices/system/node/node<N>`, by id.
    pub numa_nodes: Vec<NumaNode>,
    /// Every entry of `class/infiniband`, in natural name order (`mlx5_2` before `mlx5_10`).
    pub rdma_devices: Vec<RdmaDevice>,
    /// Every entry of `class/net`, in natural name order.
    pub net_devices: Vec<NetDevice>,
}

impl Machine {
    /// Reads the model from `root` (normally `/sys`).
    ///
    /// Fails only when `root` itself cannot be resolved or listed; anything missing below it
    /// just leaves that part of the model empty.
    pub fn read(root: impl AsRef<Path>) -> Result<Machine, TopologyError> {
        let root = root.as_ref();
        let canonical_root = fs::canonicalize(root).map_err(|source| TopologyError::ReadSysfs {
            path: root.to_path_buf(),
            source,
        })?;
        fs::read_dir(&canonical_root).map_err(|source| TopologyError::ReadSysfs {
            path: root.to_path_buf(),
            source,
        })?;
        let pci_devices = read_pci(&canonical_root);
        let numa_nodes = read_numa(&canonical_root);
        let net_devices = read_net(&canonical_root);
        let rdma_devices = read_rdma(&canonical_root, &net_devices);
        Ok(Machine {
            root: root.to_path_buf(),
            pci_devices,
            numa_nodes,
            rdma_devices,
            net_devices,
        })
    }

    /// The PCI device at `address`, if sysfs listed it.
    pub fn pci(&self, address: PciAddress) -> Option<&PciDevice> {
        self.pci_devices
            .binary_search_by(|d| d.address.cmp(&address))
            .ok()
            .and_then(|i| self.pci_devices.get(i))
    }

    /// The GPUs (see [`PciDevice::is_gpu`]), in bus order.
    pub fn gpus(&self) -> impl Iterator<Item = &PciDevice> {
        self.pci_devices.iter().filter(|d| d.is_gpu())
    }

    /// The NUMA node of a PCI device: its own `numa_node`, else the nearest bridge above it that
    /// knows, else node `n` when the machine has exactly one node `n`. `None` means unknown.
    pub fn effective_numa_node(&self, address: PciAddress) -> Option<u32> {
        let dev = self.pci(address)?;
        if let Some(n) = dev.numa_node {
            return Some(n);
        }
        for parent in dev.parents.iter().rev() {
            if let Some(n) = self.pci(*parent).and_then(|p| p.numa_node) {
                return Some(n);
            }
        }
        match self.numa_nodes.as_slice() {
            [only] => Some(only.id),
            _ => None,
        }
    }
}

/// Orders names so that numeric runs compare as numbers (`mlx5_2` < `mlx5_10`).
pub fn natural_cmp(a: &str, b: &str) -> Ordering {
    fn chunks(s: &str) -> Vec<(bool, &str)> {
        let mut out = Vec::new();
        let mut start = 0;
        let bytes = s.as_bytes();
        for i in 1..=bytes.len() {
            let boundary =
                i == bytes.len() || bytes[i].is_ascii_digit() != bytes[i - 1].is_ascii_digit();
            if boundary {
                if let Some(chunk) = s.get(start..i) {
                    out.push((bytes[start].is_ascii_digit(), chunk));
                }
                start = i;
            }
        }
        out
    }
    let (ca, cb) = (chunks(a), chunks(b));
    for (x, y) in ca.iter().zip(cb.iter()) {
        let ord = match (x, y) {
            ((true, xs), (true, ys)) => {
                let (xt, yt) = (xs.trim_start_matches('0'), ys.trim_start_matches('0'));
                xt.len().cmp(&yt.len()).then_with(|| xt.cmp(yt))
            }
            ((_, xs), (_, ys)) => xs.cmp(ys),
        };
        if ord != Ordering::Equal {
            return ord;
        }
    }
    ca.len().cmp(&cb.len()).then_with(|| a.cmp(b))
}

fn read_trimmed(path: &Path) -> Option<String> {
    match fs::read_to_string(path) {
        Ok(s) => Some(s.trim().to_owned()),
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "sysfs attribute not readable");
            None
        }
    }
}

fn read_hex(path: &Path) -> Option<u32> {
    let text = read_trimmed(path)?;
    let digits = text.strip_prefix("0x").unwrap_or(&text);
    u32::from_str_radix(digits, 16).ok()
}

fn read_u32(path: &Path) -> Option<u32> {
    read_trimmed(path)?.parse().ok()
}

/// Directory entry names under `dir`, sorted naturally; empty when `dir` is missing.
fn list_dir(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = match fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().into_string().ok())
            .collect(),
        Err(e) => {
            tracing::debug!(path = %dir.display(), error = %e, "sysfs directory not listable");
            Vec::new()
        }
    };
    names.sort_by(|a, b| natural_cmp(a, b));
    names
}

fn components(path: &Path) -> Vec<String> {
    path.components()
        .filter_map(|c| match c {
            Component::Normal(s) => s.to_str().map(str::to_owned),
            _ => None,
        })
        .collect()
}

/// The last PCI address among the components of the resolved `link`.
fn pci_of_link(link: &Path) -> Option<PciAddress> {
    let resolved = fs::canonicalize(link).ok()?;
    components(&resolved)
        .iter()
        .rev()
        .find_map(|c| c.parse::<PciAddress>().ok())
}

fn read_pci(root: &Path) -> Vec<PciDevice> {
    let dir = root.join("bus/pci/devices");
    let mut out = Vec::new();
    for name in list_dir(&dir) {
        let Ok(address) = name.parse::<PciAddress>() else {
            tracing::debug!(entry = %name, "bus/pci/devices entry is not a PCI address");
            continue;
        };
        let entry = dir.join(&name);
        let (host_bridge, parents) = match fs::canonicalize(&entry) {
            Ok(resolved) => hierarchy(&resolved, address),
            Err(e) => {
                tracing::debug!(path = %entry.display(), error = %e, "PCI link not resolvable");
                (None, Vec::new())
            }
        };
        let numa_node = read_trimmed(&entry.join("numa_node"))
            .and_then(|s| s.parse::<i64>().ok())
            .and_then(|n| u32::try_from(n).ok());
        out.push(PciDevice {
            address,
            host_bridge,
            parents,
            class: read_hex(&entry.join("class")),
            vendor: read_hex(&entry.join("vendor")).and_then(|v| u16::try_from(v).ok()),
            device_id: read_hex(&entry.join("device")).and_then(|v| u16::try_from(v).ok()),
            numa_node,
            local_cpulist: read_trimmed(&entry.join("local_cpulist")),
        });
    }
    out.sort_by_key(|d| d.address);
    out
}

/// Splits a resolved device path `.../devices/pci0000:00/0000:00:01.0/0000:01:00.0` into its
/// host bridge (`pci0000:00`, the component before the first PCI address) and the bridges between
/// it and the device (every PCI address before the device's own; components that are not PCI
/// addresses, such as a VMD domain's `pci10000:e0`, are skipped).
fn hierarchy(resolved: &Path, address: PciAddress) -> (Option<String>, Vec<PciAddress>) {
    let comps = components(resolved);
    let Some(first) = comps.iter().position(|c| c.parse::<PciAddress>().is_ok()) else {
        return (None, Vec::new());
    };
    let host_bridge = first.checked_sub(1).and_then(|i| comps.get(i)).cloned();
    let mut chain: Vec<PciAddress> = comps
        .get(first..)
        .unwrap_or_default()
        .iter()
        .filter_map(|c| c.parse::<PciAddress>().ok())
        .collect();
    if chain.last() == Some(&address) {
        chain.pop();
    }
    (host_bridge, chain)
}

fn read_numa(root: &Path) -> Vec<NumaNode> {
    let dir = root.join("devices/system/node");
    let mut out: Vec<NumaNode> = list_dir(&dir)
        .into_iter()
        .filter_map(|name| {
            let id = name.strip_prefix("node")?.parse::<u32>().ok()?;
            Some(NumaNode {
                id,
                cpulist: read_trimmed(&dir.join(&name).join("cpulist")),
            })
        })
        .collect();
    out.sort_by_key(|n| n.id);
    out
}

fn read_net(root: &Path) -> Vec<NetDevice> {
    let dir = root.join("class/net");
    list_dir(&dir)
        .into_iter()
        .map(|name| {
            let entry = dir.join(&name);
            NetDevice {
                pci: pci_of_link(&entry.join("device")),
                mtu: read_u32(&entry.join("mtu")),
                operstate: read_trimmed(&entry.join("operstate")),
                name,
            }
        })
        .collect()
}

fn read_rdma(root: &Path, nets: &[NetDevice]) -> Vec<RdmaDevice> {
    let dir = root.join("class/infiniband");
    let net_dir = root.join("class/net");
    list_dir(&dir)
        .into_iter()
        .map(|name| {
            let entry = dir.join(&name);
            let pci = pci_of_link(&entry.join("device"));
            let ports_dir = entry.join("ports");
            let ports = list_dir(&ports_dir)
                .into_iter()
                .filter_map(|p| {
                    let port = p.parse::<u32>().ok()?;
                    Some(read_port(&ports_dir.join(&p), port, pci, nets, &net_dir))
                })
                .collect();
            RdmaDevice {
                node_guid: read_trimmed(&entry.join("node_guid")),
                name,
                pci,
                ports,
            }
        })
        .collect()
}

fn read_port(
    dir: &Path,
    port: u32,
    pci: Option<PciAddress>,
    nets: &[NetDevice],
    net_dir: &Path,
) -> RdmaPort {
    let mut gids = Vec::new();
    let gid_dir = dir.join("gids");
    for idx in list_dir(&gid_dir) {
        let Ok(index) = idx.parse::<u32>() else {
            continue;
        };
        let Some(text) = read_trimmed(&gid_dir.join(&idx)) else {
            continue;
        };
        let Some(addr) = parse_gid(&text) else {
            continue;
        };
        let gid_type = read_trimmed(&dir.join("gid_attrs/types").join(&idx))
            .map(|t| GidType::parse(&t))
            .unwrap_or_else(|| GidType::Other("unknown".into()));
        let ndev = read_trimmed(&dir.join("gid_attrs/ndevs").join(&idx)).filter(|s| !s.is_empty());
        gids.push(Gid {
            index,
            gid: text,
            addr,
            gid_type,
            ndev,
        });
    }
    let netdev = gids.iter().find_map(|g| g.ndev.clone()).or_else(|| {
        let same_pci: Vec<&NetDevice> = nets
            .iter()
            .filter(|n| pci.is_some() && n.pci == pci)
            .collect();
        let by_dev_port = same_pci.iter().find(|n| {
            read_u32(&net_dir.join(&n.name).join("dev_port")) == Some(port.saturating_sub(1))
        });
        by_dev_port.or(same_pci.first()).map(|n| n.name.clone())
    });
    let mtu = netdev
        .as_ref()
        .and_then(|n| nets.iter().find(|d| &d.name == n))
        .and_then(|d| d.mtu);
    RdmaPort {
        port,
        state: read_trimmed(&dir.join("state"))
            .map(|s| PortState::parse(&s))
            .unwrap_or_else(|| PortState::Other("unknown".into())),
        phys_state: read_trimmed(&dir.join("phys_state")),
        link_layer: read_trimmed(&dir.join("link_layer"))
            .map(|s| LinkLayer::parse(&s))
            .unwrap_or_else(|| LinkLayer::Other("unknown".into())),
        rate: read_trimmed(&dir.join("rate")),
        gids,
        netdev,
        mtu,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn natural_order() {
        let mut v = vec!["mlx5_10", "mlx5_2", "mlx5_1", "ib0", "mlx4_0"];
        v.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(v, ["ib0", "mlx4_0", "mlx5_1", "mlx5_2", "mlx5_10"]);
    }

    #[test]
    fn splits_hierarchy() {
        let p = Path::new("/sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:00.0");
        let a: PciAddress = "0000:19:00.0".parse().unwrap();
        let (hb, parents) = hierarchy(p, a);
        assert_eq!(hb.as_deref(), Some("pci0000:17"));
        assert_eq!(
            parents,
            vec![
                "0000:17:01.0".parse().unwrap(),
                "0000:18:00.0".parse::<PciAddress>().unwrap()
            ]
        );
    }

    #[test]
    fn vmd_domain_keeps_every_bridge() {
        let p = Path::new(
            "/sys/devices/pci0000:00/0000:00:0e.0/pci10000:e0/10000:e0:06.0/10000:e1:00.0",
        );
        let a: PciAddress = "10000:e1:00.0".parse().unwrap();
        let (hb, parents) = hierarchy(p, a);
        assert_eq!(hb.as_deref(), Some("pci0000:00"));
        assert_eq!(parents.len(), 2);
    }

    #[test]
    fn missing_root_is_an_error() {
        let err = Machine::read("/nonexistent/ferry-sysfs").unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/ferry-sysfs"),
            "{err}"
        );
    }
}

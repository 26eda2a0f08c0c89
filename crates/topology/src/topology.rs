//! The machine joined with the verbs device list and the user's filters: NICs with their
//! usability, GPUs with their distance to every NIC, and the GPU-to-NIC assignment.

use std::path::Path;

use serde::Serialize;

use crate::distance::{DistanceClass, distance};
use crate::error::TopologyError;
use crate::filter::Selector;
use crate::pci::PciAddress;
use crate::rdma::{Gid, GidType, LinkLayer, PortState, RdmaPort};
use crate::sysfs::Machine;

/// The device names `ibv_get_device_list` returned.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VerbsDevices {
    /// The names, in the order verbs returned them.
    pub names: Vec<String>,
    /// Why the list is empty because verbs could not be asked (e.g. `libibverbs.so.1` missing).
    pub unavailable: Option<String>,
}

impl VerbsDevices {
    /// A list given explicitly (e.g. `--ib-devices`), with verbs assumed available.
    pub fn from_names<I, S>(names: I) -> VerbsDevices
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        VerbsDevices {
            names: names.into_iter().map(Into::into).collect(),
            unavailable: None,
        }
    }
}

/// The reason a NIC that sysfs lists is unusable because verbs did not return it.
pub const NOT_IN_VERBS: &str = "listed in sysfs but not returned by ibv_get_device_list";

/// One port of a [`Nic`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NicPort {
    /// The port number.
    pub port: u32,
    /// The logical state.
    pub state: PortState,
    /// The physical state as sysfs writes it.
    pub phys_state: Option<String>,
    /// The link layer.
    pub link_layer: LinkLayer,
    /// The link rate as sysfs writes it.
    pub rate: Option<String>,
    /// The net device behind the port.
    pub netdev: Option<String>,
    /// The net device's MTU.
    pub mtu: Option<u32>,
    /// The non-zero GIDs.
    pub gids: Vec<Gid>,
    /// The GID index traffic would use: the pinned one, else for RoCE a RoCE v2 IPv4-mapped GID
    /// first, then any RoCE v2, then any IPv4-mapped, then the lowest index; for InfiniBand the
    /// lowest index.
    pub gid_index: Option<u32>,
    /// Whether the port itself can carry traffic (state, link layer, GID, port filters); traffic
    /// also needs the NIC to be usable.
    pub usable: bool,
    /// Why not, when it cannot.
    pub reason: Option<String>,
}

/// One RDMA NIC: an entry of `/sys/class/infiniband`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Nic {
    /// The topology NIC id: the index in natural name order of every sysfs RDMA device, usable
    /// or not, so ids do not move when a NIC is filtered out or fails to open.
    pub id: usize,
    /// The device name.
    pub name: String,
    /// The PCI function, if the device has one.
    pub pci: Option<PciAddress>,
    /// The NUMA node ([`Machine::effective_numa_node`]); `null` when unknown.
    pub numa_node: Option<u32>,
    /// Whether any traffic may use this NIC.
    pub usable: bool,
    /// Why not, when it may not.
    pub reason: Option<String>,
    /// The ports.
    pub ports: Vec<NicPort>,
}

/// A NIC as seen from one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuNic {
    /// The NIC id.
    pub id: usize,
    /// The NIC name.
    pub name: String,
    /// The distance class.
    pub class: DistanceClass,
    /// Whether the NIC is usable.
    pub usable: bool,
}

/// One GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gpu {
    /// The GPU id: the index in PCI bus order among GPUs.
    pub id: usize,
    /// The PCI function.
    pub pci: PciAddress,
    /// The PCI vendor id.
    pub vendor: Option<u16>,
    /// The PCI device id.
    pub device: Option<u16>,
    /// The NUMA node; `null` when unknown.
    pub numa_node: Option<u32>,
    /// Every NIC that has a PCI function, in NIC id order, with its distance class.
    pub nics: Vec<GpuNic>,
}

/// The NICs serving one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Assignment {
    /// The GPU id.
    pub gpu: usize,
    /// The names of the NICs assigned to it (empty when no NIC is usable).
    pub nics: Vec<String>,
    /// Their NIC ids, in the same order.
    pub nic_ids: Vec<usize>,
    /// The distance class of the assigned NICs (all share it); `null` when none.
    pub class: Option<DistanceClass>,
}

/// The joined view of a machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Topology {
    /// Every sysfs RDMA device, by id.
    pub nics: Vec<Nic>,
    /// Every GPU, in PCI bus order.
    pub gpus: Vec<Gpu>,
    /// One entry per GPU, in GPU order.
    pub assignment: Vec<Assignment>,
    /// Devices verbs returned that sysfs does not list (no locality is known for them).
    pub verbs_only: Vec<String>,
    /// Why verbs could not be asked, when it could not.
    pub verbs_unavailable: Option<String>,
    /// How many PCI functions sysfs lists.
    pub pci_devices: usize,
    /// The NUMA node ids sysfs lists.
    pub numa_nodes: Vec<u32>,
}

fn choose_gid(port: &RdmaPort) -> Option<u32> {
    let rank = |g: &Gid| match (port.link_layer == LinkLayer::Ethernet, &g.gid_type) {
        (true, GidType::RoceV2) if g.is_ipv4_mapped() => 0,
        (true, GidType::RoceV2) => 1,
        (true, _) if g.is_ipv4_mapped() => 2,
        _ => 3,
    };
    port.gids
        .iter()
        .min_by_key(|g| (rank(g), g.index))
        .map(|g| g.index)
}

/// Why a port cannot carry traffic by itself (before filters).
fn port_defect(port: &RdmaPort) -> Option<String> {
    if !port.state.is_active() {
        let phys = port
            .phys_state
            .as_deref()
            .map(|p| format!(" (phys_state {p})"))
            .unwrap_or_default();
        return Some(format!("port state {} is not ACTIVE{phys}", port.state));
    }
    match port.link_layer {
        LinkLayer::InfiniBand => None,
        LinkLayer::Ethernet if port.gids.is_empty() => {
            Some("RoCE port has no usable GID (every GID entry is zero or unreadable)".to_owned())
        }
        LinkLayer::Ethernet => None,
        LinkLayer::Other(ref l) => Some(format!(
            "link layer {l:?} is neither InfiniBand nor Ethernet"
        )),
    }
}

impl Topology {
    /// Reads `root` and builds the view.
    pub fn discover(
        root: impl AsRef<Path>,
        verbs: &VerbsDevices,
        selector: &Selector,
    ) -> Result<Topology, TopologyError> {
        let machine = Machine::read(root)?;
        Topology::build(&machine, verbs, selector)
    }

    /// Joins `machine` with the verbs list and the selector, checks the pins, and assigns NICs
    /// to GPUs.
    pub fn build(
        machine: &Machine,
        verbs: &VerbsDevices,
        selector: &Selector,
    ) -> Result<Topology, TopologyError> {
        if selector.device_pin.is_none() {
            if selector.port_pin.is_some() {
                return Err(TopologyError::PinWithoutDevice { what: "port" });
            }
            if selector.gid_pin.is_some() {
                return Err(TopologyError::PinWithoutDevice { what: "GID" });
            }
        }
        for ignored in selector.ignored_settings(machine.rdma_devices.len()) {
            tracing::warn!("{ignored}");
        }
        let mut nics: Vec<Nic> = machine
            .rdma_devices
            .iter()
            .enumerate()
            .map(|(id, dev)| {
                let ports: Vec<NicPort> = dev
                    .ports
                    .iter()
                    .map(|p| {
                        let reason =
                            port_defect(p).or_else(|| selector.port_exclusion(&dev.name, p.port));
                        NicPort {
                            port: p.port,
                            state: p.state.clone(),
                            phys_state: p.phys_state.clone(),
                            link_layer: p.link_layer.clone(),
                            rate: p.rate.clone(),
                            netdev: p.netdev.clone(),
                            mtu: p.mtu,
                            gids: p.gids.clone(),
                            gid_index: choose_gid(p),
                            usable: reason.is_none(),
                            reason,
                        }
                    })
                    .collect();
                let reason = if !verbs.names.iter().any(|n| n == &dev.name) {
                    Some(match &verbs.unavailable {
                        Some(why) => format!("{NOT_IN_VERBS} (verbs unavailable: {why})"),
                        None => NOT_IN_VERBS.to_owned(),
                    })
                } else if let Some(why) = selector.device_exclusion(id, &dev.name) {
                    Some(why)
                } else if ports.is_empty() {
                    Some("no ports listed in sysfs".to_owned())
                } else if ports.iter().all(|p| !p.usable) {
                    let each: Vec<String> = ports
                        .iter()
                        .map(|p| format!("port {}: {}", p.port, p.reason.as_deref().unwrap_or("")))
                        .collect();
                    Some(format!("no usable port ({})", each.join("; ")))
                } else {
                    None
                };
                Nic {
                    id,
                    name: dev.name.clone(),
                    pci: dev.pci,
                    numa_node: dev.pci.and_then(|a| machine.effective_numa_node(a)),
                    usable: reason.is_none(),
                    reason,
                    ports,
                }
            })
            .collect();

        apply_pins(&mut nics, verbs, selector)?;

        let verbs_only: Vec<String> = verbs
            .names
            .iter()
            .filter(|n| !nics.iter().any(|nic| &nic.name == *n))
            .cloned()
            .collect();
        for name in &verbs_only {
            tracing::warn!(device = %name, "verbs returned a device that sysfs does not list");
        }

        let gpus: Vec<Gpu> = machine
            .gpus()
            .enumerate()
            .map(|(id, dev)| Gpu {
                id,
                pci: dev.address,
                vendor: dev.vendor,
                device: dev.device_id,
                numa_node: machine.effective_numa_node(dev.address),
                nics: nics
                    .iter()
                    .filter_map(|nic| {
                        Some(GpuNic {
                            id: nic.id,
                            name: nic.name.clone(),
                            class: distance(machine, dev.address, nic.pci?),
                            usable: nic.usable,
                        })
                    })
                    .collect(),
            })
            .collect();
        let assignment = assign(&gpus, &nics);

        Ok(Topology {
            nics,
            gpus,
            assignment,
            verbs_only,
            verbs_unavailable: verbs.unavailable.clone(),
            pci_devices: machine.pci_devices.len(),
            numa_nodes: machine.numa_nodes.iter().map(|n| n.id).collect(),
        })
    }

    /// The usable NICs.
    pub fn usable_nics(&self) -> impl Iterator<Item = &Nic> {
        self.nics.iter().filter(|n| n.usable)
    }

    /// The NIC named `name`.
    pub fn nic(&self, name: &str) -> Option<&Nic> {
        self.nics.iter().find(|n| n.name == name)
    }

    /// The distance class between GPU `gpu` and NIC `nic` (ids), if both exist and the NIC has
    /// a PCI function.
    pub fn class(&self, gpu: usize, nic: usize) -> Option<DistanceClass> {
        self.gpus
            .get(gpu)?
            .nics
            .iter()
            .find(|n| n.id == nic)
            .map(|n| n.class)
    }

    /// The names of the NICs assigned to GPU `gpu`.
    pub fn assigned(&self, gpu: usize) -> Vec<&str> {
        self.assignment
            .get(gpu)
            .map(|a| a.nics.iter().map(String::as_str).collect())
            .unwrap_or_default()
    }
}

fn apply_pins(
    nics: &mut [Nic],
    verbs: &VerbsDevices,
    selector: &Selector,
) -> Result<(), TopologyError> {
    let Some(pin) = &selector.device_pin else {
        return Ok(());
    };
    let Some(nic) = nics.iter_mut().find(|n| &n.name == pin) else {
        let reason = if verbs.names.iter().any(|n| n == pin) {
            "returned by ibv_get_device_list but absent from sysfs".to_owned()
        } else {
            "no such device in sysfs or in ibv_get_device_list".to_owned()
        };
        return Err(TopologyError::PinDevice {
            device: pin.clone(),
            reason,
        });
    };
    let device_level = if !verbs.names.iter().any(|n| n == pin) {
        nic.reason.clone()
    } else {
        selector.device_exclusion(nic.id, &nic.name)
    };
    if let Some(reason) = device_level {
        return Err(TopologyError::PinDevice {
            device: pin.clone(),
            reason,
        });
    }
    let port_no =
        match selector.port_pin {
            Some(p) => {
                let port = nic.ports.iter().find(|x| x.port == p).ok_or_else(|| {
                    TopologyError::PinPort {
                        device: pin.clone(),
                        port: p,
                        reason: "no such port in sysfs".to_owned(),
                    }
                })?;
                if let Some(reason) = &port.reason {
                    return Err(TopologyError::PinPort {
                        device: pin.clone(),
                        port: p,
                        reason: reason.clone(),
                    });
                }
                Some(p)
            }
            None => nic.ports.iter().find(|x| x.usable).map(|x| x.port),
        };
    if let Some(reason) = &nic.reason {
        return Err(TopologyError::PinDevice {
            device: pin.clone(),
            reason: reason.clone(),
        });
    }
    if let (Some(index), Some(port_no)) = (selector.gid_pin, port_no)
        && let Some(port) = nic.ports.iter_mut().find(|x| x.port == port_no)
    {
        if !port.gids.iter().any(|g| g.index == index) {
            return Err(TopologyError::PinGid {
                device: pin.clone(),
                port: port_no,
                index,
                reason: "the GID entry is unset (all zero) or missing".to_owned(),
            });
        }
        port.gid_index = Some(index);
    }
    Ok(())
}

/// Assigns usable NICs to GPUs.
///
/// Each GPU's candidates are the usable NICs at its nearest class. GPUs are visited most
/// constrained first (nearest class, then fewest candidates, then GPU id). In the first round
/// every GPU takes its least-loaded candidate (ties by NIC id), so GPUs sharing the same nearest
/// NICs spread over them. Then, round after round, each GPU takes one more candidate that no GPU
/// has yet, until none is left: spare NICs are shared out evenly, and no GPU gets a second NIC
/// while a NIC it could use sits idle.
fn assign(gpus: &[Gpu], nics: &[Nic]) -> Vec<Assignment> {
    let usable = |id: usize| nics.get(id).is_some_and(|n| n.usable);
    let candidates: Vec<(Option<DistanceClass>, Vec<usize>)> = gpus
        .iter()
        .map(|g| {
            let best = g
                .nics
                .iter()
                .filter(|n| usable(n.id))
                .map(|n| n.class)
                .min();
            let ids = g
                .nics
                .iter()
                .filter(|n| usable(n.id) && Some(n.class) == best)
                .map(|n| n.id)
                .collect();
            (best, ids)
        })
        .collect();
    let mut order: Vec<usize> = (0..gpus.len()).collect();
    order.sort_by_key(|&g| candidates.get(g).map(|(best, ids)| (*best, ids.len(), g)));
    let mut load = vec![0usize; nics.len()];
    let mut chosen: Vec<Vec<usize>> = vec![Vec::new(); gpus.len()];
    for (g, cands) in order
        .iter()
        .filter_map(|&g| Some((g, &candidates.get(g)?.1)))
    {
        if let Some(&pick) = cands
            .iter()
            .min_by_key(|&&id| (load.get(id).copied().unwrap_or(usize::MAX), id))
            && let (Some(l), Some(c)) = (load.get_mut(pick), chosen.get_mut(g))
        {
            *l += 1;
            c.push(pick);
        }
    }
    loop {
        let mut progressed = false;
        for (g, cands) in order
            .iter()
            .filter_map(|&g| Some((g, &candidates.get(g)?.1)))
        {
            if let Some(&pick) = cands.iter().find(|&&id| load.get(id) == Some(&0))
                && let (Some(l), Some(c)) = (load.get_mut(pick), chosen.get_mut(g))
            {
                *l += 1;
                c.push(pick);
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    gpus.iter()
        .zip(chosen)
        .zip(candidates)
        .map(|((gpu, mut ids), (best, _))| {
            ids.sort_unstable();
            Assignment {
                gpu: gpu.id,
                nics: ids
                    .iter()
                    .filter_map(|&id| nics.get(id).map(|n| n.name.clone()))
                    .collect(),
                nic_ids: ids,
                class: best,
            }
        })
        .collect()
}

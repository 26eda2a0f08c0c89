//! GPU-NIC distance classes, named as `nvidia-smi topo -m` names them.
//!
//! # How each class is derived from sysfs
//!
//! The resolved `bus/pci/devices/<addr>` link of a device is
//! `devices/<host bridge>/<root port>/<bridge>/.../<addr>`. The component right before the first
//! PCI address is the host bridge (root complex, e.g. `pci0000:17`); the PCI addresses between it
//! and the device are the bridges above the device (the root port first). For two devices A and
//! B:
//!
//! - different host bridges (or a link that does not resolve): **NODE** when both have the same
//!   known NUMA node ([`Machine::effective_numa_node`]: the device's `numa_node`, else the nearest
//!   bridge's, else the only node of a one-node machine), otherwise **SYS**. An unknown node on a
//!   machine with several nodes counts as SYS: nothing proves the pair shares a socket.
//! - same host bridge, no bridge in common (each hangs from its own root port): **PHB**.
//! - same host bridge, with a lowest common bridge L: let `a` and `b` be the number of bridges
//!   strictly between L and each device. `a <= 1 && b <= 1` means both sit on downstream ports
//!   of the switch whose upstream port is L (or directly below L): **PIX**, one switch. Anything
//!   deeper crosses several switches below the host bridge: **PXB**.

use std::fmt;

use serde::{Serialize, Serializer};

use crate::pci::PciAddress;
use crate::sysfs::Machine;

/// How far apart two PCI devices are, nearest first (the `Ord` order is nearest first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DistanceClass {
    /// Same PCIe switch: at most one switch between the two.
    Pix,
    /// Several PCIe switches, without crossing the host bridge.
    Pxb,
    /// Through the same host bridge (root complex).
    Phb,
    /// Across host bridges within one NUMA node.
    Node,
    /// Across NUMA nodes (the SMP interconnect between sockets).
    Sys,
}

impl DistanceClass {
    /// The `nvidia-smi topo -m` name.
    pub fn as_str(self) -> &'static str {
        match self {
            DistanceClass::Pix => "PIX",
            DistanceClass::Pxb => "PXB",
            DistanceClass::Phb => "PHB",
            DistanceClass::Node => "NODE",
            DistanceClass::Sys => "SYS",
        }
    }
}

impl fmt::Display for DistanceClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for DistanceClass {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// The distance class between two PCI devices of `machine` (see the module docs).
/// A device sysfs does not list is SYS from everything.
pub fn distance(machine: &Machine, a: PciAddress, b: PciAddress) -> DistanceClass {
    let (Some(da), Some(db)) = (machine.pci(a), machine.pci(b)) else {
        return DistanceClass::Sys;
    };
    let same_bridge = matches!((&da.host_bridge, &db.host_bridge), (Some(x), Some(y)) if x == y);
    if !same_bridge {
        return match (
            machine.effective_numa_node(a),
            machine.effective_numa_node(b),
        ) {
            (Some(x), Some(y)) if x == y => DistanceClass::Node,
            _ => DistanceClass::Sys,
        };
    }
    let common = da
        .parents
        .iter()
        .zip(db.parents.iter())
        .take_while(|(x, y)| x == y)
        .count();
    if common == 0 {
        return DistanceClass::Phb;
    }
    let below_a = da.parents.len() - common;
    let below_b = db.parents.len() - common;
    if below_a <= 1 && below_b <= 1 {
        DistanceClass::Pix
    } else {
        DistanceClass::Pxb
    }
}

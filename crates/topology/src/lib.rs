//! sysfs PCI/NUMA/NIC/GPU discovery, GPU-NIC distance classes, NIC assignment and
//! NCCL_IB_HCA-style filters.
//!
//! The contract: everything is read from a sysfs root given as a path (`/sys`, or a fixture
//! directory in tests), and the list of RDMA devices that count is given by the caller (what
//! `ibv_get_device_list` returned). The crate loads no native library and never panics on what
//! it reads.
//!
//! - [`Machine::read`] reads the raw model: PCI functions with their bridges and host bridge,
//!   NUMA nodes, RDMA devices with ports and GIDs, net devices.
//! - [`Topology::build`] joins it with a [`VerbsDevices`] list and a [`Selector`]: every NIC
//!   gets a stable id, a usable flag and a reason; every GPU gets a [`DistanceClass`] to every
//!   NIC; and the usable NICs are assigned to GPUs.
//! - [`Topology::to_json`] and [`Topology::render_table`] render it.
#![forbid(unsafe_code)]

mod distance;
mod error;
mod filter;
mod pci;
mod rdma;
mod report;
mod sysfs;
mod topology;

pub use distance::{DistanceClass, distance};
pub use error::TopologyError;
pub use filter::{HcaEntry, HcaFilter, Selector};
pub use pci::{
    CLASS_3D, CLASS_DISPLAY_OTHER, CLASS_PCI_BRIDGE, CLASS_VGA, PciAddress, PciAddressParseError,
    PciDevice, VENDOR_AMD, VENDOR_INTEL, VENDOR_NVIDIA,
};
pub use rdma::{Gid, GidType, LinkLayer, NetDevice, PortState, RdmaDevice, RdmaPort, parse_gid};
pub use sysfs::{Machine, NumaNode, natural_cmp};
pub use topology::{Assignment, Gpu, GpuNic, NOT_IN_VERBS, Nic, NicPort, Topology, VerbsDevices};

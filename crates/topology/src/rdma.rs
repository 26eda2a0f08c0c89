//! RDMA devices, ports and GIDs as `/sys/class/infiniband` describes them.

use std::fmt;
use std::net::Ipv6Addr;

use serde::{Serialize, Serializer};

use crate::pci::PciAddress;

/// A port's logical state, from `ports/N/state` (`"4: ACTIVE"`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PortState {
    /// `1: DOWN`.
    Down,
    /// `2: INIT`.
    Init,
    /// `3: ARMED`.
    Armed,
    /// `4: ACTIVE`.
    Active,
    /// `5: ACTIVE_DEFER`.
    ActiveDefer,
    /// Anything else, or a missing file (the raw text, or `"unknown"`).
    Other(String),
}

impl PortState {
    /// Parses the kernel's `state` text (`"<code>: <NAME>"`).
    pub fn parse(text: &str) -> PortState {
        let t = text.trim();
        let code = t.split(':').next().map(str::trim);
        match code {
            Some("1") => PortState::Down,
            Some("2") => PortState::Init,
            Some("3") => PortState::Armed,
            Some("4") => PortState::Active,
            Some("5") => PortState::ActiveDefer,
            _ => PortState::Other(t.to_owned()),
        }
    }

    /// Whether traffic can flow.
    pub fn is_active(&self) -> bool {
        matches!(self, PortState::Active)
    }

    /// The kernel's name for the state.
    pub fn as_str(&self) -> &str {
        match self {
            PortState::Down => "DOWN",
            PortState::Init => "INIT",
            PortState::Armed => "ARMED",
            PortState::Active => "ACTIVE",
            PortState::ActiveDefer => "ACTIVE_DEFER",
            PortState::Other(s) => s,
        }
    }
}

impl fmt::Display for PortState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for PortState {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// A port's link layer, from `ports/N/link_layer`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LinkLayer {
    /// `InfiniBand`.
    InfiniBand,
    /// `Ethernet` (RoCE).
    Ethernet,
    /// Anything else, or a missing file (the raw text, or `"unknown"`).
    Other(String),
}

impl LinkLayer {
    /// Parses the kernel's `link_layer` text.
    pub fn parse(text: &str) -> LinkLayer {
        match text.trim() {
            "InfiniBand" => LinkLayer::InfiniBand,
            "Ethernet" => LinkLayer::Ethernet,
            other => LinkLayer::Other(other.to_owned()),
        }
    }

    /// The kernel's name for the link layer.
    pub fn as_str(&self) -> &str {
        match self {
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Ethernet => "Ethernet",
            LinkLayer::Other(s) => s,
        }
    }
}

impl fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for LinkLayer {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// A GID's type, from `ports/N/gid_attrs/types/I`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GidType {
    /// `IB/RoCE v1`: InfiniBand GIDs and RoCE v1 GIDs.
    IbRoceV1,
    /// `RoCE v2`.
    RoceV2,
    /// Anything else, or unreadable (the raw text, or `"unknown"`).
    Other(String),
}

impl GidType {
    /// Parses the kernel's GID type text.
    pub fn parse(text: &str) -> GidType {
        match text.trim() {
            "IB/RoCE v1" => GidType::IbRoceV1,
            "RoCE v2" => GidType::RoceV2,
            other => GidType::Other(other.to_owned()),
        }
    }

    /// The kernel's name for the type.
    pub fn as_str(&self) -> &str {
        match self {
            GidType::IbRoceV1 => "IB/RoCE v1",
            GidType::RoceV2 => "RoCE v2",
            GidType::Other(s) => s,
        }
    }
}

impl Serialize for GidType {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// One non-zero entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gid {
    /// The table index (`gids/<index>`).
    pub index: u32,
    /// The GID, printed as sysfs prints it (eight groups of four hex digits).
    pub gid: String,
    /// The parsed value.
    #[serde(skip)]
    pub addr: Ipv6Addr,
    /// `gid_attrs/types/<index>`.
    #[serde(rename = "type")]
    pub gid_type: GidType,
    /// `gid_attrs/ndevs/<index>`: the net device behind the GID (RoCE), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ndev: Option<String>,
}

impl Gid {
    /// Whether the GID is an IPv4-mapped address (`::ffff:a.b.c.d`).
    pub fn is_ipv4_mapped(&self) -> bool {
        self.addr.to_ipv4_mapped().is_some()
    }
}

/// Parses a sysfs GID (`fe80:0000:...`); `None` for unparsable text or the all-zero (unset) GID.
pub fn parse_gid(text: &str) -> Option<Ipv6Addr> {
    let addr: Ipv6Addr = text.trim().parse().ok()?;
    (!addr.is_unspecified()).then_some(addr)
}

/// One port of an RDMA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaPort {
    /// The port number (the `ports/<N>` directory name).
    pub port: u32,
    /// `state`.
    pub state: PortState,
    /// `phys_state` as written (e.g. `5: LinkUp`), if readable.
    pub phys_state: Option<String>,
    /// `link_layer`.
    pub link_layer: LinkLayer,
    /// `rate` as written (e.g. `400 Gb/sec (4X NDR)`), if readable.
    pub rate: Option<String>,
    /// The non-zero GIDs, by index.
    pub gids: Vec<Gid>,
    /// The net device behind the port: the first GID's `ndev`, else the one net device of the
    /// same PCI function (IPoIB or the Ethernet interface).
    pub netdev: Option<String>,
    /// The MTU of `netdev`, from `/sys/class/net/<netdev>/mtu`.
    pub mtu: Option<u32>,
}

/// One entry of `/sys/class/infiniband`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaDevice {
    /// The device name (`mlx5_0`).
    pub name: String,
    /// The PCI function behind it (resolved `device` link), if it has one.
    pub pci: Option<PciAddress>,
    /// `node_guid`, if readable.
    pub node_guid: Option<String>,
    /// Ports in port-number order.
    pub ports: Vec<RdmaPort>,
}

/// One entry of `/sys/class/net`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetDevice {
    /// Interface name.
    pub name: String,
    /// The PCI function behind it (resolved `device` link), if any.
    pub pci: Option<PciAddress>,
    /// `mtu`, if readable.
    pub mtu: Option<u32>,
    /// `operstate` (e.g. `up`), if readable.
    pub operstate: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kernel_texts() {
        assert_eq!(PortState::parse("4: ACTIVE\n"), PortState::Active);
        assert_eq!(PortState::parse("1: DOWN"), PortState::Down);
        assert_eq!(
            PortState::parse("garbage"),
            PortState::Other("garbage".into())
        );
        assert_eq!(LinkLayer::parse("InfiniBand\n"), LinkLayer::InfiniBand);
        assert_eq!(LinkLayer::parse("Ethernet"), LinkLayer::Ethernet);
        assert_eq!(LinkLayer::parse("OPA"), LinkLayer::Other("OPA".into()));
        assert_eq!(GidType::parse("RoCE v2\n"), GidType::RoceV2);
        assert_eq!(GidType::parse("IB/RoCE v1"), GidType::IbRoceV1);
    }

    #[test]
    fn zero_gid_is_unset() {
        assert!(parse_gid("0000:0000:0000:0000:0000:0000:0000:0000").is_none());
        assert!(parse_gid("not a gid").is_none());
        let g = parse_gid("0000:0000:0000:0000:0000:ffff:0a00:0001\n").unwrap();
        assert_eq!(
            g.to_ipv4_mapped(),
            Some(std::net::Ipv4Addr::new(10, 0, 0, 1))
        );
    }
}

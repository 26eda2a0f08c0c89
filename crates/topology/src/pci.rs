//! PCI addresses and the PCI devices read from sysfs.

use std::fmt;
use std::str::FromStr;

use serde::{Serialize, Serializer};

/// A PCI address in sysfs form, `DDDD:BB:DD.F` (domain, bus, device, function).
///
/// Ordering is bus order: domain, then bus, then device, then function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    /// PCI domain (segment), 16 bits in practice; sysfs may print more digits.
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device (slot) number, 0..=31.
    pub device: u8,
    /// Function number, 0..=7.
    pub function: u8,
}

/// The reason a string is not a PCI address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciAddressParseError {
    /// The rejected text.
    pub text: String,
}

impl fmt::Display for PciAddressParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not a PCI address of the form DDDD:BB:DD.F",
            self.text
        )
    }
}

impl std::error::Error for PciAddressParseError {}

impl FromStr for PciAddress {
    type Err = PciAddressParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || PciAddressParseError { text: s.to_owned() };
        let (rest, function) = s.rsplit_once('.').ok_or_else(err)?;
        let mut parts = rest.split(':');
        let (Some(domain), Some(bus), Some(device), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(err());
        };
        let hex = |t: &str, max_len: usize| -> Option<u32> {
            if t.is_empty() || t.len() > max_len || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            u32::from_str_radix(t, 16).ok()
        };
        let domain = hex(domain, 8).ok_or_else(err)?;
        let bus = hex(bus, 2).ok_or_else(err)?;
        let device = hex(device, 2).filter(|d| *d < 32).ok_or_else(err)?;
        let function = hex(function, 1).filter(|f| *f < 8).ok_or_else(err)?;
        Ok(PciAddress {
            domain,
            bus: u8::try_from(bus).map_err(|_| err())?,
            device: u8::try_from(device).map_err(|_| err())?,
            function: u8::try_from(function).map_err(|_| err())?,
        })
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl Serialize for PciAddress {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// PCI class code `0x0300`: VGA-compatible display controller.
pub const CLASS_VGA: u32 = 0x0300;
/// PCI class code `0x0302`: 3D controller (data-centre GPUs without display output).
pub const CLASS_3D: u32 = 0x0302;
/// PCI class code `0x0380`: other display controller.
pub const CLASS_DISPLAY_OTHER: u32 = 0x0380;
/// PCI class code `0x0604`: PCI-to-PCI bridge (root ports, switch ports).
pub const CLASS_PCI_BRIDGE: u32 = 0x0604;
/// PCI vendor id of NVIDIA.
pub const VENDOR_NVIDIA: u16 = 0x10de;
/// PCI vendor id of AMD/ATI graphics.
pub const VENDOR_AMD: u16 = 0x1002;
/// PCI vendor id of Intel.
pub const VENDOR_INTEL: u16 = 0x8086;

/// One PCI function as sysfs describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciDevice {
    /// The function's address (the name of its `/sys/bus/pci/devices` entry).
    pub address: PciAddress,
    /// The host bridge (root complex) it hangs from: the path component right above the first
    /// PCI address in its resolved sysfs path, e.g. `pci0000:00`. `None` when the link could not
    /// be resolved.
    pub host_bridge: Option<String>,
    /// The PCI bridges above the device, from the root port down to its direct parent.
    pub parents: Vec<PciAddress>,
    /// The 24-bit class code from `class` (e.g. `0x030200`), if readable.
    pub class: Option<u32>,
    /// `vendor`, if readable.
    pub vendor: Option<u16>,
    /// `device`, if readable.
    pub device_id: Option<u16>,
    /// `numa_node`; `None` when the file is missing or says `-1` (unknown).
    pub numa_node: Option<u32>,
    /// `local_cpulist` as written by the kernel (e.g. `0-23,48-71`).
    pub local_cpulist: Option<String>,
}

impl PciDevice {
    /// The 16-bit base class and subclass (`class >> 8`), e.g. `0x0302`.
    pub fn class_code(&self) -> Option<u32> {
        self.class.map(|c| c >> 8)
    }

    /// Whether this function is a PCI-to-PCI bridge.
    pub fn is_bridge(&self) -> bool {
        self.class_code() == Some(CLASS_PCI_BRIDGE)
    }

    /// Whether this function is a GPU: NVIDIA VGA or 3D controllers, any vendor's 3D controller or
    /// "other display controller", and AMD or Intel VGA controllers. VGA controllers of other
    /// vendors (BMC graphics such as ASPEED, emulated VGA in virtual machines) are not GPUs.
    pub fn is_gpu(&self) -> bool {
        matches!(
            (self.class_code(), self.vendor),
            (Some(CLASS_3D | CLASS_DISPLAY_OTHER), _)
                | (
                    Some(CLASS_VGA),
                    Some(VENDOR_NVIDIA | VENDOR_AMD | VENDOR_INTEL)
                )
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_addresses() {
        let a: PciAddress = "0000:1a:00.1".parse().unwrap();
        assert_eq!(
            a,
            PciAddress {
                domain: 0,
                bus: 0x1a,
                device: 0,
                function: 1
            }
        );
        assert_eq!(a.to_string(), "0000:1a:00.1");
        let b: PciAddress = "10000:00:02.0".parse().unwrap();
        assert_eq!(b.domain, 0x10000);
        assert!(a < b);
    }

    #[test]
    fn rejects_non_addresses() {
        for s in [
            "",
            "pci0000:00",
            "0000:00:00",
            "0000:00:20.0",
            "0000:00:00.8",
            "0000:000:00.0",
            "0000:00:00.0.0",
            "zz00:00:00.0",
            "0000:00:00.0:1",
        ] {
            assert!(s.parse::<PciAddress>().is_err(), "{s} accepted");
        }
    }
}

//! Device enumeration: one `ibv_get_device_list`, owned results, the list always freed.

use std::ffi::CStr;
use std::io;
use std::os::raw::c_int;
use std::ptr::NonNull;

use crate::error::VerbsError;
use crate::loader::Verbs;
use crate::sys::{self, ibv_context, ibv_device};

/// What a verbs device is, from `ibv_device::node_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NodeType {
    /// A channel adapter (HCA): InfiniBand or RoCE NICs.
    Ca,
    /// An InfiniBand switch.
    Switch,
    /// An InfiniBand router.
    Router,
    /// An iWARP RDMA NIC.
    Rnic,
    /// A Cisco usNIC.
    Usnic,
    /// A Cisco usNIC over UDP.
    UsnicUdp,
    /// Unspecified by the provider.
    Unspecified,
    /// A value this version does not know (including `IBV_NODE_UNKNOWN`).
    Unknown(i32),
}

impl NodeType {
    /// Maps the raw `ibv_node_type`.
    pub fn from_raw(raw: i32) -> Self {
        match raw {
            sys::IBV_NODE_CA => Self::Ca,
            sys::IBV_NODE_SWITCH => Self::Switch,
            sys::IBV_NODE_ROUTER => Self::Router,
            sys::IBV_NODE_RNIC => Self::Rnic,
            sys::IBV_NODE_USNIC => Self::Usnic,
            sys::IBV_NODE_USNIC_UDP => Self::UsnicUdp,
            sys::IBV_NODE_UNSPECIFIED => Self::Unspecified,
            other => Self::Unknown(other),
        }
    }
}

/// The transport a verbs device speaks, from `ibv_device::transport_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TransportType {
    /// InfiniBand transport (also RoCE, whose link layer is Ethernet).
    Ib,
    /// iWARP.
    Iwarp,
    /// Cisco usNIC.
    Usnic,
    /// Cisco usNIC over UDP.
    UsnicUdp,
    /// Unspecified by the provider.
    Unspecified,
    /// A value this version does not know (including `IBV_TRANSPORT_UNKNOWN`).
    Unknown(i32),
}

impl TransportType {
    /// Maps the raw `ibv_transport_type`.
    pub fn from_raw(raw: i32) -> Self {
        match raw {
            sys::IBV_TRANSPORT_IB => Self::Ib,
            sys::IBV_TRANSPORT_IWARP => Self::Iwarp,
            sys::IBV_TRANSPORT_USNIC => Self::Usnic,
            sys::IBV_TRANSPORT_USNIC_UDP => Self::UsnicUdp,
            sys::IBV_TRANSPORT_UNSPECIFIED => Self::Unspecified,
            other => Self::Unknown(other),
        }
    }
}

/// One verbs device as `ibv_get_device_list` reported it, owned (valid after the list is freed).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct DeviceInfo {
    /// The device name, e.g. `mlx5_0` or `rxe0`.
    pub name: String,
    /// The node GUID in host byte order (`ibv_get_device_guid` returns it big-endian).
    pub guid: u64,
    /// The node type.
    pub node_type: NodeType,
    /// The transport.
    pub transport_type: TransportType,
}

impl DeviceInfo {
    /// Builds a record (for mocks and tests in other crates; the struct is `#[non_exhaustive]`).
    pub fn new(
        name: impl Into<String>,
        guid: u64,
        node_type: NodeType,
        transport_type: TransportType,
    ) -> Self {
        Self {
            name: name.into(),
            guid,
            node_type,
            transport_type,
        }
    }

    /// The GUID as `ibv_devinfo` prints it: four groups of four hex digits joined by `:`.
    pub fn guid_string(&self) -> String {
        let g = self.guid;
        format!(
            "{:04x}:{:04x}:{:04x}:{:04x}",
            (g >> 48) & 0xffff,
            (g >> 32) & 0xffff,
            (g >> 16) & 0xffff,
            g & 0xffff
        )
    }
}

/// A device list from `ibv_get_device_list`, freed on drop (every return path, panics too).
struct DeviceList<'a> {
    verbs: &'a Verbs,
    list: NonNull<*mut ibv_device>,
    len: usize,
}

impl DeviceList<'_> {
    fn get(verbs: &Verbs) -> Result<DeviceList<'_>, VerbsError> {
        let mut num: c_int = 0;
        // SAFETY: `num` is a valid out-pointer; the export has this signature.
        let list = unsafe { (verbs.required().get_device_list)(&mut num) };
        match NonNull::new(list) {
            Some(list) => Ok(DeviceList {
                verbs,
                list,
                len: usize::try_from(num).unwrap_or(0),
            }),
            None => {
                let source = io::Error::last_os_error();
                Err(VerbsError::Verb {
                    verb: "ibv_get_device_list",
                    device: "<all devices>".to_owned(),
                    source,
                })
            }
        }
    }

    /// The device pointers (non-null entries before the terminating NULL).
    fn devices(&self) -> impl Iterator<Item = NonNull<ibv_device>> + '_ {
        (0..self.len).filter_map(move |i| {
            // SAFETY: libibverbs returned an array of `len` device pointers (plus a NULL).
            NonNull::new(unsafe { *self.list.as_ptr().add(i) })
        })
    }
}

impl Drop for DeviceList<'_> {
    fn drop(&mut self) {
        // SAFETY: the list came from `ibv_get_device_list` of this library and is freed once.
        unsafe { (self.verbs.required().free_device_list)(self.list.as_ptr()) };
    }
}

/// The name of a device, from its embedded `name` array.
///
/// # Safety
/// `dev` must point to a live `ibv_device`.
pub(crate) unsafe fn device_name(dev: *const ibv_device) -> String {
    // SAFETY: the caller guarantees `dev` is live; `name` is a fixed array we bound below.
    let bytes = unsafe { &(*dev).name };
    let bytes: &[u8] = &bytes.map(|c| c.to_ne_bytes()[0]);
    match CStr::from_bytes_until_nul(bytes) {
        Ok(name) => name.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(bytes).into_owned(),
    }
}

impl Verbs {
    /// Enumerates the verbs devices: one `ibv_get_device_list`, name, GUID, node type and
    /// transport of each, the list freed before returning (also on error). No devices is `Ok`
    /// with an empty list.
    pub fn devices(&self) -> Result<Vec<DeviceInfo>, VerbsError> {
        let list = match DeviceList::get(self) {
            Ok(list) => list,
            // rdma-core reports "no kernel verbs support" (no devices at all) as ENOSYS.
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                tracing::debug!(error = %e, "no kernel verbs support: no RDMA devices");
                return Ok(Vec::new());
            }
            Err(e) => return Err(e),
        };
        let devices = list
            .devices()
            .map(|dev| {
                let p = dev.as_ptr();
                // SAFETY: `p` is a live device from the list, which is still allocated.
                let (node, transport) = unsafe { ((*p).node_type, (*p).transport_type) };
                // SAFETY: as above; the export returns the device's NUL-terminated name or NULL.
                let name = unsafe {
                    let c = (self.required().get_device_name)(p);
                    if c.is_null() {
                        device_name(p)
                    } else {
                        CStr::from_ptr(c).to_string_lossy().into_owned()
                    }
                };
                // SAFETY: as above; the export takes a device of this library.
                let guid = u64::from_be(unsafe { (self.required().get_device_guid)(p) });
                DeviceInfo {
                    name,
                    guid,
                    node_type: NodeType::from_raw(node),
                    transport_type: TransportType::from_raw(transport),
                }
            })
            .collect();
        drop(list);
        Ok(devices)
    }

    /// Opens the device called `name` (`ibv_open_device`), listing devices once to find it.
    /// Close the context with [`Verbs::close_device`].
    pub fn open_device(&self, name: &str) -> Result<NonNull<ibv_context>, VerbsError> {
        let list = DeviceList::get(self).map_err(|e| match e {
            VerbsError::Verb { source, .. } => VerbsError::Verb {
                verb: "ibv_get_device_list",
                device: name.to_owned(),
                source,
            },
            other => other,
        })?;
        // SAFETY: every pointer yielded is a live device of the still-allocated list.
        let found = list
            .devices()
            .find(|d| unsafe { device_name(d.as_ptr()) } == name);
        let Some(dev) = found else {
            return Err(VerbsError::Verb {
                verb: "ibv_open_device",
                device: name.to_owned(),
                source: io::Error::new(io::ErrorKind::NotFound, "no such verbs device"),
            });
        };
        // SAFETY: `dev` is a live device; opening it before freeing the list is the documented
        // order (the context keeps its own reference to the device).
        let ctx = unsafe { (self.required().open_device)(dev.as_ptr()) };
        let result = NonNull::new(ctx).ok_or_else(|| VerbsError::Verb {
            verb: "ibv_open_device",
            device: name.to_owned(),
            source: io::Error::last_os_error(),
        });
        drop(list);
        result
    }
}

/// Enumerates the devices of the process-wide libibverbs ([`Verbs::load`]).
///
/// A load failure is returned as the loader's error; the discovery layer turns it into
/// "no RDMA devices".
pub fn devices() -> Result<Vec<DeviceInfo>, VerbsError> {
    Verbs::load()?.devices()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guid_prints_like_ibv_devinfo() {
        let d = DeviceInfo::new(
            "mlx5_0",
            0x0c42_a103_00b2_c3d4,
            NodeType::Ca,
            TransportType::Ib,
        );
        assert_eq!(d.guid_string(), "0c42:a103:00b2:c3d4");
    }

    #[test]
    fn raw_types_map_and_keep_unknown_values() {
        assert_eq!(NodeType::from_raw(1), NodeType::Ca);
        assert_eq!(NodeType::from_raw(4), NodeType::Rnic);
        assert_eq!(NodeType::from_raw(-1), NodeType::Unknown(-1));
        assert_eq!(TransportType::from_raw(0), TransportType::Ib);
        assert_eq!(TransportType::from_raw(1), TransportType::Iwarp);
        assert_eq!(TransportType::from_raw(42), TransportType::Unknown(42));
    }
}

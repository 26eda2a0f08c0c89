//! Device memory registered with the engine: published to peers (served through the servers'
//! staging path) and, on a GPUDirect route, registered on the RDMA NICs nearest its GPU.

use std::fmt;
use std::sync::{Arc, PoisonError};

use ferry_core::{Access, MemoryRegion, SegmentDesc, SegmentToken};
use ferry_cuda::{DeviceMemory, RouteChoice};

use super::GpuState;
use crate::serve::RegistryTable;

/// Device memory registered with the engine (and published to peers when `access` grants them
/// anything). Ops on it are staged through pinned host memory; dropping it unpublishes it.
pub struct GpuRegistration {
    pub(crate) memory: Arc<DeviceMemory>,
    pub(crate) token: SegmentToken,
    pub(crate) name: String,
    pub(crate) access: Access,
    pub(crate) route: RouteChoice,
    /// The GPUDirect RDMA registration (route `dmabuf` or `peermem`): the device region and its
    /// registry entry (the MRs on the NICs nearest the GPU, published with their remote keys).
    pub(crate) direct: Option<Direct>,
    /// The memory as a CUDA IPC region (where the driver exports it): what a same-host peer's
    /// plane is given when its channel takes CUDA IPC.
    pub(crate) ipc: Option<Arc<MemoryRegion>>,
    pub(crate) table: Arc<RegistryTable>,
    pub(crate) gpu: Arc<GpuState>,
}

/// A GPU registration made with the RDMA NICs.
pub(crate) struct Direct {
    /// The device memory as a region placed on its device (only RDMA ops get it).
    pub(crate) region: Arc<MemoryRegion>,
    /// Dropping it retires the MRs (after the last lease).
    pub(crate) registration: ferry_registry::Registration,
}

impl Direct {
    /// The rails (`device:port`) its MRs are on.
    pub(crate) fn rails(&self) -> Vec<String> {
        self.registration
            .lease()
            .contexts()
            .iter()
            .map(|c| c.name.clone())
            .collect()
    }
}

impl fmt::Debug for GpuRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuRegistration")
            .field("name", &self.name)
            .field("token", &self.token)
            .field("memory", &self.memory)
            .field("route", &self.route)
            .finish()
    }
}

impl GpuRegistration {
    /// The token peers address it by.
    pub fn token(&self) -> SegmentToken {
        self.token
    }

    /// The device memory.
    pub fn memory(&self) -> &Arc<DeviceMemory> {
        &self.memory
    }

    /// Its length.
    pub fn len(&self) -> u64 {
        self.memory.len() as u64
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.memory.is_empty()
    }

    /// The GPUDirect route chosen for it (before registering) and why.
    pub fn route(&self) -> &RouteChoice {
        &self.route
    }

    /// The RDMA rails (`device:port`) it is registered on: empty unless the route is `dmabuf`
    /// or `peermem`.
    pub fn nics(&self) -> Vec<String> {
        self.direct.as_ref().map_or_else(Vec::new, Direct::rails)
    }

    /// The descriptor peers see (with the remote keys of its MRs when it is registered with
    /// RDMA NICs).
    pub fn desc(&self) -> SegmentDesc {
        match &self.direct {
            Some(d) => crate::serve::describe_lease(&d.registration.lease()),
            None => SegmentDesc {
                name: self.name.clone(),
                token: self.token,
                len: self.len(),
                access: self.access,
                remote_keys: Vec::new(),
            },
        }
    }
}

impl Drop for GpuRegistration {
    fn drop(&mut self) {
        // The registry entry (GPUDirect: listed with its remote keys) goes first, then the
        // device-copy source and any restriction (`RegistryTable::retire`).
        let direct = self.direct.take();
        self.table.retire(self.token, || drop(direct));
        self.gpu
            .registrations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|(t, _)| *t != self.token);
    }
}

impl crate::request::LocalMemory for GpuRegistration {
    fn local_ref(&self) -> crate::request::LocalRef {
        crate::request::LocalRef(crate::request::Local::Device(
            self.memory.clone(),
            self.direct.as_ref().map(|d| d.region.clone()),
            self.ipc.clone(),
        ))
    }
}

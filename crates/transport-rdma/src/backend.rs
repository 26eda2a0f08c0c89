//! Registration through the registry: one context per rail, one MR per copy.
//!
//! This module touches raw registered memory (it hands a region's address to `ibv_reg_mr`, or a
//! device region's dma-buf to `ibv_reg_dmabuf_mr`), so it holds the `unsafe` blocks of
//! registration. GPU memory (a region placed on a device) takes the route its placement names:
//! peermem registers the device address with `ibv_reg_mr`, dma-buf registers the exported
//! dma-buf with `ibv_reg_dmabuf_mr` addressed by the device address, so peers address both
//! kinds the same way (the segment's base is the device address).

use std::fmt;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use ferry_core::{Access, DeviceNative, DevicePlacement, MemoryRegion, Placement};
use ferry_registry::{ContextId, ContextInfo, NativeError, NativeHandle, RegistrationBackend};
use ferry_verbs_sys::{VerbsError, ffi};

use crate::shared::{Registered, Shared};

/// The registry's view of the RDMA transport: one context per rail (in rail order, named
/// `device:port`), one `ibv_reg_mr` per copy. The local copy gets `LOCAL_WRITE`; the remote copy
/// adds `REMOTE_READ` / `REMOTE_WRITE` as the range's access grants.
#[derive(Clone)]
pub struct RdmaBackend {
    pub(crate) shared: Arc<Shared>,
}

impl fmt::Debug for RdmaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaBackend")
            .field(
                "contexts",
                &self
                    .shared
                    .rails
                    .iter()
                    .map(|r| &r.name)
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// `ibv_access_flags` for a copy with `access`.
pub(crate) fn mr_access(access: Access) -> u32 {
    let mut flags = ffi::IBV_ACCESS_LOCAL_WRITE;
    if access.contains(Access::REMOTE_READ) {
        flags |= ffi::IBV_ACCESS_REMOTE_READ;
    }
    if access.contains(Access::REMOTE_WRITE) {
        flags |= ffi::IBV_ACCESS_REMOTE_WRITE;
    }
    flags
}

fn native(device: &str, call: &'static str, e: VerbsError) -> NativeError {
    let source = match e {
        VerbsError::Verb { source, .. } => source,
        other => io::Error::other(other.to_string()),
    };
    NativeError::new(device, call, source)
}

impl RegistrationBackend for RdmaBackend {
    fn contexts(&self) -> Vec<ContextInfo> {
        self.shared
            .rails
            .iter()
            .enumerate()
            .map(|(i, r)| ContextInfo {
                id: ContextId(u32::try_from(i).unwrap_or(u32::MAX)),
                name: r.name.clone(),
                paused: !r.active,
            })
            .collect()
    }

    fn register_copy(
        &self,
        context: ContextId,
        region: &MemoryRegion,
        access: Access,
    ) -> Result<NativeHandle, NativeError> {
        let Some(rail) = usize::try_from(context.0)
            .ok()
            .and_then(|i| self.shared.rails.get(i))
        else {
            return Err(NativeError::new(
                format!("{context}"),
                "ibv_reg_mr",
                io::Error::new(io::ErrorKind::NotFound, "no such RDMA context"),
            ));
        };
        let addr = region.as_ptr();
        let len = region.len();
        let (mr, route) = match region.placement() {
            Placement::Device(DevicePlacement {
                native: DeviceNative::Dmabuf { fd, offset },
                ..
            }) => {
                // SAFETY: the region keeps its dma-buf fd open (an `Arc<OwnedFd>` in its
                // placement) and the registry keeps the region alive until it calls
                // `destroy_copy` for this handle, which deregisters the MR first.
                let mr = unsafe {
                    rail.pd.reg_dmabuf_mr(
                        *offset,
                        len,
                        addr as u64,
                        fd.as_raw_fd(),
                        mr_access(access),
                    )
                }
                .map_err(|e| native(&rail.name, "ibv_reg_dmabuf_mr", e))?;
                (mr, "dmabuf")
            }
            Placement::Device(DevicePlacement {
                native: DeviceNative::CudaIpc { .. },
                ..
            }) => {
                return Err(NativeError::new(
                    &rail.name,
                    "ibv_reg_mr",
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        "a CUDA IPC region is for the same-host plane only, never a NIC",
                    ),
                ));
            }
            // peermem: `ibv_reg_mr` on the device address; the peer-memory client in the kernel
            // resolves it to the GPU's pages.
            Placement::Device(_) => {
                // SAFETY: the registry keeps the region (an `Arc<MemoryRegion>`) alive until it
                // calls `destroy_copy` for this handle, which deregisters the MR first; the
                // region's keepalive holds the device allocation, which never moves.
                let mr = unsafe { rail.pd.reg_mr(addr, len, mr_access(access)) }
                    .map_err(|e| native(&rail.name, "ibv_reg_mr (peermem, GPU memory)", e))?;
                (mr, "peermem")
            }
            // Host memory.
            _ => {
                // SAFETY: the registry keeps the region (an `Arc<MemoryRegion>`, whose bytes never
                // move) alive until it calls `destroy_copy` for this handle, which deregisters
                // the MR first.
                let mr = unsafe { rail.pd.reg_mr(addr, len, mr_access(access)) }
                    .map_err(|e| native(&rail.name, "ibv_reg_mr", e))?;
                (mr, "host")
            }
        };
        let id = self.shared.next_mr.fetch_add(1, Ordering::Relaxed);
        let handle = NativeHandle {
            id,
            lkey: mr.lkey(),
            rkey: if access.is_remote() { mr.rkey() } else { 0 },
        };
        tracing::debug!(rail = %rail.name, len, %access, route, lkey = handle.lkey,
            rkey = handle.rkey, "memory registered");
        self.shared
            .mrs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .by_id
            .insert(
                id,
                Registered {
                    context: context.0,
                    addr: addr as u64,
                    len: len as u64,
                    mr,
                },
            );
        Ok(handle)
    }

    fn destroy_copy(&self, context: ContextId, handle: NativeHandle) -> Result<(), NativeError> {
        let name = usize::try_from(context.0)
            .ok()
            .and_then(|i| self.shared.rails.get(i))
            .map_or_else(|| context.to_string(), |r| r.name.clone());
        let reg = self
            .shared
            .mrs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .by_id
            .remove(&handle.id);
        match reg {
            Some(r) => r.mr.destroy().map_err(|e| native(&name, "ibv_dereg_mr", e)),
            None => Err(NativeError::new(
                name,
                "ibv_dereg_mr",
                io::Error::new(io::ErrorKind::NotFound, "unknown memory region handle"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_flags_per_copy() {
        let local = ffi::IBV_ACCESS_LOCAL_WRITE;
        assert_eq!(mr_access(Access::LOCAL), local);
        assert_eq!(
            mr_access(Access::REMOTE_READ),
            local | ffi::IBV_ACCESS_REMOTE_READ
        );
        assert_eq!(
            mr_access(Access::REMOTE_READ | Access::REMOTE_WRITE),
            local | ffi::IBV_ACCESS_REMOTE_READ | ffi::IBV_ACCESS_REMOTE_WRITE
        );
    }
}

//! The engine's GPU memory: allocating and registering device memory (staged through host
//! memory, or on a GPUDirect route with the RDMA NICs nearest its GPU) and loading files into it.

use std::sync::{Arc, PoisonError};

use ferry_core::{Access, Error, SegmentToken};
use ferry_cuda::{Cuda, CudaError, DeviceMemory, DeviceSegment, GpuDirectSetting, RouteChoice};

use crate::describe::GpuRegistrationDescription;
use crate::gpu::{Direct, GpuRegistration, GpuState, choose_nics, rail_device};

impl crate::TransferEngine {
    fn gpu_state(&self) -> Result<&Arc<GpuState>, Error> {
        self.inner.gpu.as_ref().ok_or_else(|| Error::Unavailable {
            library: "ferry cuda".into(),
            reason: "GPU support is off in this engine".into(),
        })
    }

    /// The CUDA driver this engine uses (the builder's, or the system's `libcuda.so.1` loaded
    /// on first use; `Unavailable("libcuda.so.1: <loader's reason>")` without one).
    pub fn cuda(&self) -> Result<Cuda, Error> {
        self.gpu_state()?.cuda()
    }

    /// Allocates `len` bytes on GPU `ordinal` (freed when the registration and every request
    /// using it are gone) and registers them (see [`register_gpu`](Self::register_gpu)).
    pub fn alloc_gpu(
        &self,
        ordinal: u32,
        len: usize,
        access: Access,
        name: &str,
    ) -> Result<GpuRegistration, Error> {
        let mem = self
            .cuda()?
            .device(ordinal)
            .and_then(|d| d.alloc(len))
            .map_err(Error::from)?;
        self.register_gpu(mem, access, name)
    }

    /// Registers device memory (allocated by [`ferry_cuda::Device::alloc`] or wrapped with
    /// [`ferry_cuda::Device::wrap`]) under `name`. The GPUDirect route is decided first, from the
    /// `gpu_direct_registration` setting and what the machine offers; an explicit route that
    /// cannot work is an error naming what is missing, and nothing falls back silently.
    ///
    /// With route `dmabuf` or `peermem` (an engine with the RDMA transport) the memory is
    /// registered with the NICs nearest its GPU (the topology's assignment by PCI distance):
    /// through the registry like host memory, so budgets, fan-out and retirement are the same,
    /// and with remote access it is published with its remote keys, so RDMA peers READ and
    /// WRITE it one-sided. A registration that fails there (a NIC that refuses dma-buf MRs, a
    /// peer-memory client that cannot resolve the address) is an error naming the device and
    /// the native errno. Peers on the TCP or io_uring data plane are served by device copies
    /// through the server's staging buffer, whatever the route.
    pub fn register_gpu(
        &self,
        memory: impl Into<Arc<DeviceMemory>>,
        access: Access,
        name: &str,
    ) -> Result<GpuRegistration, Error> {
        let memory = memory.into();
        self.inner
            .published
            .table
            .publish_named(name, access.is_remote(), || {
                self.register_gpu_unchecked(memory, access, name)
            })
    }

    /// Like [`register_gpu`](Self::register_gpu), but published only to the peers that prove
    /// one of the key names in `peers`, as [`register_to`](Self::register_to) publishes host
    /// memory: no other peer lists it, and on TCP and io_uring an op naming its token is refused
    /// as an unknown segment. The same refusals as `register_to` (no keys, no name).
    pub fn register_gpu_to(
        &self,
        memory: impl Into<Arc<DeviceMemory>>,
        access: Access,
        name: &str,
        peers: &[&str],
    ) -> Result<GpuRegistration, Error> {
        let audience = self.audience(peers)?;
        let memory = memory.into();
        self.inner.published.table.publish_restricted(audience, || {
            let reg = self.register_gpu(memory, access, name)?;
            Ok((reg.token(), reg))
        })
    }

    fn register_gpu_unchecked(
        &self,
        memory: Arc<DeviceMemory>,
        access: Access,
        name: &str,
    ) -> Result<GpuRegistration, Error> {
        let state = self.gpu_state()?;
        let _span = tracing::info_span!(
            "register_gpu",
            name,
            len = memory.len(),
            device = memory.location().ordinal
        )
        .entered();
        let route = self.choose_route(state, &memory)?;
        let (direct, nic_choice) = if route.route == ferry_cuda::GpuRoute::Off {
            (None, String::new())
        } else {
            let (d, why) = self.register_direct(state, &memory, &route, access, name)?;
            (Some(d), why)
        };
        let token = direct
            .as_ref()
            .map_or_else(SegmentToken::random, |d| d.registration.token());
        let served_by_staging = access.is_remote() && self.inner.planes.data_plane.is_some();
        if access.is_remote() && direct.is_none() && !served_by_staging {
            return Err(Error::Unavailable {
                library: "GPU segments".into(),
                reason: "publishing GPU memory needs a portable data plane (io_uring or \
                         TCP) to serve it by staging, or a GPUDirect RDMA route, and this \
                         engine has neither"
                    .into(),
            });
        }
        if served_by_staging {
            self.inner.published.table.add_file(
                token,
                name.to_owned(),
                memory.len() as u64,
                access,
                Arc::new(DeviceSegment::new(memory.clone(), access)),
            );
        }
        let nics: Vec<String> = direct.as_ref().map_or_else(Vec::new, Direct::rails);
        let served = match (access.is_remote(), &direct, served_by_staging) {
            (false, _, _) => "local only".to_owned(),
            (true, Some(_), true) => format!(
                "published; RDMA peers reach it one-sided through {} ({}); TCP and io_uring \
                 peers' ops staged through the server's host buffer",
                nics.join(", "),
                route.route
            ),
            (true, Some(_), false) => format!(
                "published; RDMA peers reach it one-sided through {} ({})",
                nics.join(", "),
                route.route
            ),
            (true, None, _) => {
                "published; peers' ops staged through the server's host buffer".to_owned()
            }
        };
        let desc = GpuRegistrationDescription {
            name: name.to_owned(),
            len: memory.len() as u64,
            device: memory.location().ordinal,
            pci_bus_id: memory.location().pci_bus_id.clone(),
            route: route.clone(),
            nics,
            nic_choice,
            served,
        };
        state
            .registrations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((token, desc));
        tracing::info!(%token, route = %route.route, why = %route.why, "GPU memory registered");
        // Granted by CUDA IPC to same-host peers whose channel takes it (none where the driver
        // cannot export this memory: the plane stages it then).
        let ipc = if memory.device().cuda().has_ipc() {
            match memory.ipc_region() {
                Ok(r) => Some(Arc::new(r)),
                Err(e) => {
                    tracing::debug!(error = %e, "no CUDA IPC handle for this GPU memory; \
                        same-host peers' ops on it are staged");
                    None
                }
            }
        } else {
            None
        };
        Ok(GpuRegistration {
            memory,
            token,
            name: name.to_owned(),
            access,
            route,
            direct,
            ipc,
            table: self.inner.published.table.clone(),
            gpu: state.clone(),
        })
    }

    /// Registers `memory` with the RDMA NICs nearest its GPU by `route` (dma-buf or peermem),
    /// through the registry. Returns the registration and why those NICs.
    #[cfg(feature = "rdma")]
    fn register_direct(
        &self,
        state: &GpuState,
        memory: &Arc<DeviceMemory>,
        route: &RouteChoice,
        access: Access,
        name: &str,
    ) -> Result<(Direct, String), Error> {
        let Some(rdma) = &self.inner.planes.rdma else {
            return Err(Error::InvalidRequest {
                reason: format!(
                    "gpu_direct_registration chose {} but this engine has no RDMA transport",
                    route.route
                ),
            });
        };
        let rails = rdma.rail_names();
        let devices: Vec<String> = rails.iter().map(|r| rail_device(r).to_owned()).collect();
        let topo = ferry_topology::Topology::discover(
            &state.config.sysfs_root,
            &ferry_topology::VerbsDevices::from_names(devices),
            &ferry_topology::Selector::default(),
        );
        let choice = choose_nics(&rails, topo.as_ref().ok(), &memory.location().pci_bus_id);
        let region = Arc::new(memory.nic_region(route.route).map_err(Error::from)?);
        let contexts: Vec<ferry_registry::ContextId> = choice
            .rails
            .iter()
            .map(|&i| ferry_registry::ContextId(i as u32))
            .collect();
        let registration = self
            .inner
            .published
            .registry
            .register_on(name, region.clone(), access, &contexts)
            .map_err(Error::from)?;
        tracing::info!(route = %route.route, nics = ?choice.names(&rails), why = %choice.why,
            "GPU memory registered with RDMA NICs");
        Ok((
            Direct {
                region,
                registration,
            },
            choice.why,
        ))
    }

    /// Without the `rdma` feature no route but `off` is ever chosen.
    #[cfg(not(feature = "rdma"))]
    fn register_direct(
        &self,
        _state: &GpuState,
        _memory: &Arc<DeviceMemory>,
        route: &RouteChoice,
        _access: Access,
        _name: &str,
    ) -> Result<(Direct, String), Error> {
        Err(Error::InvalidRequest {
            reason: format!(
                "gpu_direct_registration chose {} but this build has no RDMA transport",
                route.route
            ),
        })
    }

    /// Decides the GPUDirect route before anything is registered.
    fn choose_route(&self, state: &GpuState, memory: &DeviceMemory) -> Result<RouteChoice, Error> {
        let setting = state.config.gpu_direct;
        let rdma = self
            .inner
            .planes
            .transports
            .iter()
            .any(|t| t.kind() == ferry_core::TransportKind::Rdma);
        if setting == GpuDirectSetting::Off {
            return ferry_cuda::route::choose(setting, &Default::default())
                .map_err(|e| Error::from(CudaError::from(e)));
        }
        if !rdma {
            // No NIC would see the memory: only staging can move it.
            return match setting {
                GpuDirectSetting::Auto => Ok(RouteChoice {
                    route: ferry_cuda::GpuRoute::Off,
                    why: "auto: no RDMA transport in this engine; GPU memory is staged over the \
                          portable data plane"
                        .into(),
                }),
                explicit => Err(Error::InvalidRequest {
                    reason: format!(
                        "gpu_direct_registration = {explicit} cannot work here: missing an RDMA \
                         transport in this engine (enable RDMA, or use auto/off to stage)"
                    ),
                }),
            };
        }
        let facts = ferry_cuda::RouteFacts {
            cuda_dmabuf_export: memory.device().cuda().has_dmabuf_export(),
            device_dmabuf: memory.device().info().dmabuf_supported,
            ibv_reg_dmabuf_mr: ferry_verbs_sys::Verbs::load()
                .map(|v| v.capabilities().reg_dmabuf_mr)
                .unwrap_or(false),
            peermem_version_file: ferry_cuda::peermem_version(&state.config.sysfs_root)
                .map(|(p, _)| p.display().to_string()),
        };
        ferry_cuda::route::choose(setting, &facts).map_err(|e| Error::from(CudaError::from(e)))
    }

    /// Loads `len` bytes of the file at `path` from `file_offset` into `dst` at `offset`: by
    /// cuFile (GPUDirect Storage) when `libcufile.so.0` loads and the file system supports it,
    /// else by the compatibility path (positioned reads into pinned buffers, then host-to-device
    /// copies, pipelined). Which path ran is returned and shown by `describe()`. Blocking.
    pub fn read_file_into_gpu(
        &self,
        dst: &GpuRegistration,
        offset: u64,
        path: impl AsRef<std::path::Path>,
        file_offset: u64,
        len: u64,
    ) -> Result<ferry_cuda::FileLoad, Error> {
        let state = self.gpu_state()?;
        let path = path.as_ref();
        let _span =
            tracing::info_span!("read_file_into_gpu", path = %path.display(), len).entered();
        let load = ferry_cuda::cufile::read_file_into(
            &dst.memory,
            offset,
            path,
            file_offset,
            len,
            state.config.gds,
        )
        .map_err(|e| match e {
            CudaError::Io { what, source } => Error::Io {
                op: "read_file_into_gpu",
                target: what,
                source,
            },
            e => Error::from(e),
        })?;
        tracing::info!(path = %load.path, bytes = load.bytes, "file loaded into GPU memory");
        *state
            .last_file_path
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(load.path.to_string());
        Ok(load)
    }
}

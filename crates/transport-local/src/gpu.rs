//! GPU buffers on the same-host plane: CUDA IPC (feature `cuda`).
//!
//! A client whose buffer is device memory grants it as an [`IpcRef`] (the IPC handle of its
//! allocation and the buffer's range there) in place of a host address; the server opens the
//! handle in a device context of its own, caches it for the stream's next requests and copies
//! with the driver between the opened memory and its checked segment range, synchronized before
//! it answers:
//!
//! | the server's segment | the client's buffer | the copy |
//! |---|---|---|
//! | GPU memory (a `DeviceSegment`) | GPU | `cuMemcpyDtoDAsync_v2`, on the segment's GPU |
//! | host memory | GPU | `cuMemcpyHtoDAsync_v2` / `DtoHAsync_v2` into / out of the opened handle, on GPU 0 |
//! | a file | GPU | the file through the stream's host stage, then one driver copy |
//!
//! Every case is one copy of the bytes between the two processes: none goes through the socket
//! or a host bounce of the client's. Opened handles belong to the stream and are closed when it
//! ends, which it does when the client leaves (its pidfd is checked before each request).

use std::io;
use std::sync::Arc;

use ferry_core::{FileSource, MemoryRegion};
use ferry_cuda::ipc::IPC_REF_LEN as REF_LEN;
use ferry_cuda::{CopyStream, Cuda, CudaError, DeviceSegment, IpcImports, IpcRef};

use crate::CudaSource;
use crate::wire::IPC_REF_LEN;

const _: () = assert!(
    REF_LEN == IPC_REF_LEN,
    "the wire's grant is ferry-cuda's IpcRef"
);

/// Where the server finds the CUDA driver for CUDA IPC streams (asked at each attach).
#[derive(Clone, Debug)]
pub(crate) struct ServerGpu(Option<CudaSource>);

/// `cuda` if it can serve CUDA IPC, else why not.
fn usable(cuda: Option<&Cuda>) -> Result<Cuda, String> {
    match cuda {
        None => Err("no CUDA driver loaded in this engine".into()),
        Some(c) if !c.has_ipc() => Err(format!(
            "the CUDA driver {} has no CUDA IPC entry points",
            c.library()
        )),
        Some(c) if c.devices().is_empty() => Err("the CUDA driver lists no GPU".into()),
        Some(c) => Ok(c.clone()),
    }
}

impl ServerGpu {
    /// From the transport's settings.
    pub(crate) fn new(cuda: Option<CudaSource>) -> Self {
        Self(cuda)
    }

    /// A stream's CUDA IPC state, or why this server takes no CUDA IPC stream.
    pub(crate) fn served(&self) -> Result<Served, String> {
        usable(self.0.as_ref().and_then(CudaSource::get).as_ref()).map(|cuda| Served {
            cuda,
            lanes: Vec::new(),
        })
    }
}

/// Whether a client with `cuda` asks for CUDA IPC streams, or why not.
pub(crate) fn client_offers(cuda: Option<&Cuda>) -> Result<(), String> {
    usable(cuda).map(|_| ())
}

/// One device's opened handles and copy stream.
struct Lane {
    ordinal: u32,
    imports: IpcImports,
    stream: CopyStream,
}

/// A CUDA IPC stream's state on the server: opened handles per device (closed on drop, when the
/// stream ends).
pub(crate) struct Served {
    cuda: Cuda,
    lanes: Vec<Lane>,
}

fn err(e: CudaError) -> io::Error {
    io::Error::other(e)
}

impl Served {
    fn lane(&mut self, ordinal: u32) -> io::Result<&mut Lane> {
        if let Some(i) = self.lanes.iter().position(|l| l.ordinal == ordinal) {
            return Ok(&mut self.lanes[i]);
        }
        let device = self.cuda.device(ordinal).map_err(err)?;
        let stream = device.copy_stream().map_err(err)?;
        self.lanes.push(Lane {
            ordinal,
            imports: IpcImports::new(&device),
            stream,
        });
        let last = self.lanes.len() - 1;
        Ok(&mut self.lanes[last])
    }

    /// A WRITE into host memory: the client's granted buffer into `region` at `at`.
    pub(crate) fn write_region(
        &mut self,
        grant: &[u8; IPC_REF_LEN],
        region: &MemoryRegion,
        at: u64,
        len: usize,
    ) -> io::Result<()> {
        let lane = self.lane(0)?;
        let src = lane
            .imports
            .resolve(&IpcRef::decode(grant), 0, len)
            .map_err(err)?;
        lane.stream
            .copy_imported_to_region(&src, region, at)
            .map_err(err)
    }

    /// A READ of host memory: `region` at `at` into the client's granted buffer.
    pub(crate) fn read_region(
        &mut self,
        grant: &[u8; IPC_REF_LEN],
        region: &MemoryRegion,
        at: u64,
        len: usize,
    ) -> io::Result<()> {
        let lane = self.lane(0)?;
        let dst = lane
            .imports
            .resolve(&IpcRef::decode(grant), 0, len)
            .map_err(err)?;
        lane.stream
            .copy_region_to_imported(region, at, &dst)
            .map_err(err)
    }

    /// A READ of a file segment into the client's granted buffer: device to device when the
    /// segment is GPU memory, else the file through `stage`.
    pub(crate) fn read_file(
        &mut self,
        grant: &[u8; IPC_REF_LEN],
        file: &Arc<dyn FileSource>,
        at: u64,
        len: usize,
        stage: &mut Vec<u8>,
    ) -> io::Result<()> {
        let r = IpcRef::decode(grant);
        if let Some(seg) = (&**file as &dyn std::any::Any).downcast_ref::<DeviceSegment>() {
            let lane = self.lane(seg.memory().location().ordinal)?;
            let dst = lane.imports.resolve(&r, 0, len).map_err(err)?;
            return lane
                .stream
                .copy_to_imported(seg.memory(), at, &dst)
                .map_err(err);
        }
        stage.resize(len, 0);
        file.read_exact_at(at, stage)?;
        let lane = self.lane(0)?;
        let dst = lane.imports.resolve(&r, 0, len).map_err(err)?;
        lane.stream.copy_host_to_imported(stage, &dst).map_err(err)
    }

    /// A WRITE of the client's granted buffer into a file segment: device to device when the
    /// segment is GPU memory, else through `stage` into the file.
    pub(crate) fn write_file(
        &mut self,
        grant: &[u8; IPC_REF_LEN],
        file: &Arc<dyn FileSource>,
        at: u64,
        len: usize,
        stage: &mut Vec<u8>,
    ) -> io::Result<()> {
        let r = IpcRef::decode(grant);
        if let Some(seg) = (&**file as &dyn std::any::Any).downcast_ref::<DeviceSegment>() {
            let lane = self.lane(seg.memory().location().ordinal)?;
            let src = lane.imports.resolve(&r, 0, len).map_err(err)?;
            return lane
                .stream
                .copy_from_imported(seg.memory(), at, &src)
                .map_err(err);
        }
        stage.resize(len, 0);
        let lane = self.lane(0)?;
        let src = lane.imports.resolve(&r, 0, len).map_err(err)?;
        lane.stream
            .copy_imported_to_host(&src, stage)
            .map_err(err)?;
        file.write_all_at(at, stage)
    }
}

/// The grant of `region`'s `at..at+len`, when it is a CUDA IPC region.
pub(crate) fn grant_of(region: &MemoryRegion, at: u64, len: u64) -> Option<[u8; IPC_REF_LEN]> {
    IpcRef::of_region(region, at, len).map(|r| r.encode())
}

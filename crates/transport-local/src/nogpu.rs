//! GPU buffers on the same-host plane without the `cuda` feature: no CUDA IPC, so a server
//! refuses every CUDA IPC stream and a client never asks for one (GPU buffers are staged through
//! host memory by the engine, as on TCP).

use std::io;
use std::sync::Arc;

use ferry_core::{FileSource, MemoryRegion};

use crate::wire::IPC_REF_LEN;

const WHY: &str = "this build of Ferry has no CUDA support (feature `cuda`)";

/// What the server has for CUDA IPC: nothing.
#[derive(Clone, Debug)]
pub(crate) struct ServerGpu;

impl ServerGpu {
    /// Why this server takes no CUDA IPC stream.
    pub(crate) fn served(&self) -> Result<Served, String> {
        Err(WHY.into())
    }
}

/// The client side's route for GPU buffers: none.
pub(crate) fn client_offers() -> Result<(), String> {
    Err(WHY.into())
}

/// Never made: no stream is served with CUDA IPC without the feature.
pub(crate) enum Served {}

impl Served {
    pub(crate) fn write_region(
        &mut self,
        _: &[u8; IPC_REF_LEN],
        _: &MemoryRegion,
        _: u64,
        _: usize,
    ) -> io::Result<()> {
        match *self {}
    }

    pub(crate) fn read_region(
        &mut self,
        _: &[u8; IPC_REF_LEN],
        _: &MemoryRegion,
        _: u64,
        _: usize,
    ) -> io::Result<()> {
        match *self {}
    }

    pub(crate) fn read_file(
        &mut self,
        _: &[u8; IPC_REF_LEN],
        _: &Arc<dyn FileSource>,
        _: u64,
        _: usize,
        _: &mut Vec<u8>,
    ) -> io::Result<()> {
        match *self {}
    }

    pub(crate) fn write_file(
        &mut self,
        _: &[u8; IPC_REF_LEN],
        _: &Arc<dyn FileSource>,
        _: u64,
        _: usize,
        _: &mut Vec<u8>,
    ) -> io::Result<()> {
        match *self {}
    }
}

/// No region is a CUDA IPC one without the feature.
pub(crate) fn grant_of(_: &MemoryRegion, _: u64, _: u64) -> Option<[u8; IPC_REF_LEN]> {
    None
}

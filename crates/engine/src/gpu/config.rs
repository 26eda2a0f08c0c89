//! The builder's GPU settings: the staging policy and the staging pool's size.

use ferry_cuda::{Cuda, GpuDirectSetting};

/// Whether device memory may move through host memory when no direct route serves it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Staging {
    /// Stage through pinned host buffers where no direct route serves the op (TCP, io_uring,
    /// RDMA with `gpu_direct_registration = off`).
    #[default]
    Auto,
    /// Never stage: an op on device memory without a direct route is refused before anything
    /// moves.
    Never,
}

impl std::str::FromStr for Staging {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Staging::Auto),
            "never" => Ok(Staging::Never),
            _ => Err(format!("staging is auto or never, not {s:?}")),
        }
    }
}

/// The builder's GPU settings.
#[derive(Clone, Debug)]
pub(crate) struct GpuConfig {
    pub(crate) cuda: Option<Cuda>,
    pub(crate) staging: Staging,
    pub(crate) gpu_direct: GpuDirectSetting,
    pub(crate) buffers: usize,
    pub(crate) buffer_size: usize,
    pub(crate) gds: bool,
    /// Where the peermem version files and the PCI topology are read (`/sys`).
    pub(crate) sysfs_root: std::path::PathBuf,
}

/// Staging buffers by default: 4 of 4 MiB per GPU that stages (16 MiB pinned each, allocated on
/// first use).
pub const STAGING_BUFFERS: usize = 4;
/// The default staging buffer (and chunk) size.
pub const STAGING_BUFFER_SIZE: usize = 4 << 20;

impl Default for GpuConfig {
    fn default() -> Self {
        Self {
            cuda: None,
            staging: Staging::Auto,
            gpu_direct: GpuDirectSetting::Auto,
            buffers: STAGING_BUFFERS,
            buffer_size: STAGING_BUFFER_SIZE,
            gds: true,
            sysfs_root: "/sys".into(),
        }
    }
}

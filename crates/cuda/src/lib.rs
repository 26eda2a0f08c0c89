//! CUDA-side capability probes for Ferry, all resolved at run time so that Ferry builds and runs on
//! machines without an NVIDIA driver:
//!
//! - the CUDA driver (`libcuda.so.1`): loads it, reads the driver version (no GPU needed), and
//!   reports whether the dma-buf export entry point (`cuMemGetHandleForAddressRange`) exists;
//! - cuFile (`libcufile.so.0`, GPUDirect Storage): loads it and checks its entry points;
//! - nvidia-peermem: the three version files that prove a peer-memory client is loaded.
//!
//! It also drives the driver for GPU memory ([`Cuda`], [`Device`], [`DeviceMemory`],
//! [`PinnedBuffer`], [`DeviceSegment`]), decides the GPUDirect RDMA route ([`route`]) and loads
//! files into device memory ([`cufile`]), and lets two processes on one host copy device memory
//! device to device by CUDA IPC ([`ipc`]). The driver is reached through a narrow trait,
//! [`driver::Driver`], implemented by a table of entry points loaded with libloading (see
//! [`driver`] for why not cudarc).
//!
//! A missing library is [`CudaError::Unavailable`] naming the library and carrying the loader's
//! reason; nothing here panics. The override environment variables `FERRY_LIBCUDA` and
//! `FERRY_LIBCUFILE` point the loader at another build (tests use them to load Ferry's fake
//! driver; a build never loads it by itself, and a loaded fake says so in a warning).
#![deny(unsafe_op_in_unsafe_fn)]

pub mod cufile;
mod device;
pub mod driver;
pub mod ipc;
pub mod route;

pub use cufile::{FileLoad, FilePath};
pub use device::{
    CopyStream, Cuda, Device, DeviceInfo, DeviceLocation, DeviceMemory, DeviceSegment, PinnedBuffer,
};
pub use ipc::{Imported, IpcImports, IpcRef};
pub use route::{GpuDirectSetting, GpuRoute, RouteChoice, RouteError, RouteFacts};

use std::ffi::{OsStr, OsString, c_int};
use std::path::{Path, PathBuf};

/// The CUDA driver library's soname.
pub const LIBCUDA: &str = "libcuda.so.1";
/// cuFile's soname.
pub const LIBCUFILE: &str = "libcufile.so.0";

/// The files whose presence shows that a GPU peer-memory client is loaded (MLNX_OFED `nv_peer_mem`
/// or NVIDIA `nvidia_peermem`). A module directory alone is not enough.
pub const PEERMEM_VERSION_PATHS: [&str; 3] = [
    "kernel/mm/memory_peers/nv_mem/version",
    "kernel/mm/memory_peers/nv_mem_nc/version",
    "module/nvidia_peermem/version",
];

/// Errors of the CUDA probes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The library could not be loaded, or lacks an export it must have.
    #[error("{library}: {reason}")]
    Unavailable {
        /// The library (soname or the override path).
        library: String,
        /// The dynamic loader's reason, or the missing export.
        reason: String,
    },
    /// A driver call returned an error code.
    #[error("{library}: {call} failed with CUresult {code} {name}")]
    Call {
        /// The library.
        library: String,
        /// The entry point.
        call: &'static str,
        /// The CUresult / status code.
        code: i32,
        /// The code's name (`cuGetErrorName`), where the driver gives one.
        name: String,
    },
    /// A driver call on one device failed.
    #[error("GPU {device}: {source}")]
    OnDevice {
        /// The device ordinal.
        device: u32,
        /// The failed call.
        #[source]
        source: Box<CudaError>,
    },
    /// No device has that ordinal.
    #[error("{library}: no GPU {ordinal} (the driver lists {count})")]
    NoDevice {
        /// The library.
        library: String,
        /// The ordinal asked for.
        ordinal: u32,
        /// How many devices the driver lists.
        count: usize,
    },
    /// The device's primary context could not be retained (remembered: it is made once).
    #[error("GPU {device}: retaining the primary context failed: {reason}")]
    Context {
        /// The device ordinal.
        device: u32,
        /// The driver's error.
        reason: String,
    },
    /// Memory offered as device memory is not what the driver says it is (host or managed
    /// memory, or a range running past its allocation).
    #[error("{library}: {what}")]
    NotDeviceMemory {
        /// The library that was asked (`cuPointerGetAttribute`).
        library: String,
        /// What the driver said, with the address and length.
        what: String,
    },
    /// A range falls outside the device memory or host buffer.
    #[error("{0}")]
    OutOfBounds(#[source] ferry_core::OutOfBounds),
    /// File I/O of `read_file_into` failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// An explicit GPUDirect route cannot work here.
    #[error(transparent)]
    Route(#[from] route::RouteError),
}

/// A driver error as ferry-core's error: an absent driver is `Unavailable`, a route that cannot
/// work or memory that is not the device's is `InvalidRequest`, a range past the end of GPU
/// memory is a local `OutOfBounds`, and every other failure is `Register` ("GPU memory") with
/// this error as its source.
impl From<CudaError> for ferry_core::Error {
    fn from(e: CudaError) -> Self {
        use ferry_core::Error;
        match e {
            CudaError::Unavailable { library, reason } => Error::Unavailable { library, reason },
            CudaError::Route(r) => Error::InvalidRequest {
                reason: r.to_string(),
            },
            e @ CudaError::NotDeviceMemory { .. } => Error::InvalidRequest {
                reason: e.to_string(),
            },
            CudaError::OutOfBounds(source) => Error::OutOfBounds {
                side: "local",
                source,
            },
            other => Error::Register {
                name: "GPU memory".into(),
                source: Box::new(other),
            },
        }
    }
}

impl CudaError {
    /// This error, as it happened on device `device`.
    pub fn on_device(self, device: u32) -> Self {
        match self {
            e @ (CudaError::OnDevice { .. }
            | CudaError::NoDevice { .. }
            | CudaError::Context { .. }) => e,
            e => CudaError::OnDevice {
                device,
                source: Box::new(e),
            },
        }
    }

    /// The native code (CUresult), if a driver call failed.
    pub fn code(&self) -> Option<i32> {
        match self {
            CudaError::Call { code, .. } => Some(*code),
            CudaError::OnDevice { source, .. } => source.code(),
            _ => None,
        }
    }
}

/// What the CUDA driver probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverInfo {
    /// The library loaded (soname or override path).
    pub library: String,
    /// The driver's CUDA version as `major.minor` (from `cuDriverGetVersion`).
    pub version: String,
    /// Whether `cuMemGetHandleForAddressRange` (dma-buf export, CUDA 11.7+) is exported.
    pub dmabuf_export: bool,
}

/// What the cuFile probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CuFileInfo {
    /// The library loaded.
    pub library: String,
}

pub(crate) fn library_name(env: &str, default: &str) -> OsString {
    std::env::var_os(env)
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| OsString::from(default))
}

pub(crate) fn open(name: &OsStr) -> Result<libloading::Library, CudaError> {
    // SAFETY: loading runs the library's initialisers. The CUDA driver and cuFile are system
    // libraries designed to be dlopen'ed (cudarc and every CUDA runtime load them this way).
    unsafe { libloading::Library::new(name) }.map_err(|e| CudaError::Unavailable {
        library: name.to_string_lossy().into_owned(),
        reason: strip_library(&name.to_string_lossy(), loader_reason(&e)),
    })
}

/// Removes a leading `"<library>: "` from a loader message, so the library is named once.
fn strip_library(library: &str, reason: String) -> String {
    match reason
        .strip_prefix(library)
        .and_then(|r| r.strip_prefix(": "))
    {
        Some(rest) => rest.to_owned(),
        None => reason,
    }
}

/// The loader's reason without libloading's own prefix.
pub(crate) fn loader_reason(e: &libloading::Error) -> String {
    match e {
        libloading::Error::DlOpen { desc } | libloading::Error::DlSym { desc } => {
            format!("{desc:?}").trim_matches('"').to_owned()
        }
        other => other.to_string(),
    }
}

pub(crate) fn has_symbol(lib: &libloading::Library, name: &[u8]) -> bool {
    // SAFETY: the symbol is only looked up, never called, so its type does not matter.
    unsafe { lib.get::<*const ()>(name) }.is_ok()
}

/// Loads the CUDA driver and reads its version. Needs no GPU: `cuDriverGetVersion` works without
/// `cuInit`.
pub fn probe_driver() -> Result<DriverInfo, CudaError> {
    let name = library_name("FERRY_LIBCUDA", LIBCUDA);
    let library = name.to_string_lossy().into_owned();
    let lib = open(&name)?;
    type DriverGetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
    // SAFETY: `cuDriverGetVersion` has this signature in every CUDA driver (cuda.h:
    // `CUresult cuDriverGetVersion(int *driverVersion)`).
    let get_version =
        unsafe { lib.get::<DriverGetVersion>(b"cuDriverGetVersion\0") }.map_err(|e| {
            CudaError::Unavailable {
                library: library.clone(),
                reason: format!("missing export cuDriverGetVersion ({})", loader_reason(&e)),
            }
        })?;
    let mut v: c_int = 0;
    // SAFETY: the pointer refers to a live, writable c_int; the function only writes it.
    let code = unsafe { get_version(&mut v) };
    if code != 0 {
        return Err(CudaError::Call {
            library,
            call: "cuDriverGetVersion",
            code,
            name: String::new(),
        });
    }
    Ok(DriverInfo {
        dmabuf_export: has_symbol(&lib, b"cuMemGetHandleForAddressRange\0"),
        version: format!("{}.{}", v / 1000, (v % 1000) / 10),
        library,
    })
}

/// Loads cuFile and checks its driver entry points.
pub fn probe_cufile() -> Result<CuFileInfo, CudaError> {
    let name = library_name("FERRY_LIBCUFILE", LIBCUFILE);
    let library = name.to_string_lossy().into_owned();
    let lib = open(&name)?;
    for sym in ["cuFileDriverOpen", "cuFileHandleRegister", "cuFileRead"] {
        let mut cname = sym.as_bytes().to_vec();
        cname.push(0);
        if !has_symbol(&lib, &cname) {
            return Err(CudaError::Unavailable {
                library,
                reason: format!("missing export {sym}"),
            });
        }
    }
    Ok(CuFileInfo { library })
}

/// The first peer-memory version file that exists under `sysfs_root`, with its contents.
pub fn peermem_version(sysfs_root: &Path) -> Option<(PathBuf, String)> {
    PEERMEM_VERSION_PATHS.iter().find_map(|rel| {
        let p = sysfs_root.join(rel);
        std::fs::read_to_string(&p)
            .ok()
            .map(|v| (p, v.trim().to_owned()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peermem_needs_a_version_file_not_a_directory() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("module/nvidia_peermem")).unwrap();
        assert_eq!(
            peermem_version(d.path()),
            None,
            "a module directory alone is not enough"
        );
        std::fs::write(d.path().join("module/nvidia_peermem/version"), "550.54\n").unwrap();
        let (p, v) = peermem_version(d.path()).unwrap();
        assert!(p.ends_with("module/nvidia_peermem/version"));
        assert_eq!(v, "550.54");
        std::fs::create_dir_all(d.path().join("kernel/mm/memory_peers/nv_mem")).unwrap();
        std::fs::write(
            d.path().join("kernel/mm/memory_peers/nv_mem/version"),
            "1.2\n",
        )
        .unwrap();
        assert_eq!(peermem_version(d.path()).unwrap().1, "1.2");
    }

    #[test]
    fn loader_reason_has_no_libloading_prefix() {
        let e = open(OsStr::new("/nonexistent/libcuda.so.1")).unwrap_err();
        let s = e.to_string();
        assert!(s.starts_with("/nonexistent/libcuda.so.1: "), "{s}");
        assert!(s.contains("No such file"), "{s}");
        assert!(!s.contains("DlOpen"), "{s}");
        assert_eq!(
            s.matches("libcuda.so.1").count(),
            1,
            "library named once: {s}"
        );
    }

    #[test]
    fn driver_probe_reports_the_machine_truthfully() {
        // Whatever this machine has, the probe must agree with the loader about libcuda.so.1.
        let direct = open(OsStr::new(LIBCUDA)).is_ok();
        if std::env::var_os("FERRY_LIBCUDA").is_some() {
            eprintln!("skip: FERRY_LIBCUDA overrides the library under test");
            return;
        }
        match probe_driver() {
            Ok(info) => {
                assert!(direct);
                assert!(info.version.contains('.'), "{info:?}");
            }
            Err(CudaError::Unavailable { library, reason }) => {
                assert!(
                    !direct,
                    "loader can open {LIBCUDA} but probe said: {reason}"
                );
                assert_eq!(library, LIBCUDA);
            }
            Err(e) => panic!("unexpected: {e}"),
        }
    }
}

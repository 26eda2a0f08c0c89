//! GPUDirect Storage: reading a file straight into device memory with cuFile
//! (`libcufile.so.0`, loaded at run time), and the compatibility path that every machine has:
//! positioned reads into pinned host buffers, then host-to-device copies, pipelined.
//!
//! [`read_file_into`] says which path ran ([`FileLoad`]); it never changes path silently.

use std::ffi::{c_int, c_void};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::mpsc;

use crate::CudaError;
use crate::device::DeviceMemory;

/// `CUfileError_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct CuFileError {
    err: c_int,
    cu_err: c_int,
}

/// `CUfileDescr_t` with an fd handle (`CU_FILE_HANDLE_TYPE_OPAQUE_FD`).
#[repr(C)]
struct CuFileDescr {
    kind: c_int,
    handle: usize,
    fs_ops: *const c_void,
}

const HANDLE_TYPE_OPAQUE_FD: c_int = 1;

type FnDriverOpen = unsafe extern "C" fn() -> CuFileError;
type FnHandleRegister = unsafe extern "C" fn(*mut *mut c_void, *mut CuFileDescr) -> CuFileError;
type FnHandleDeregister = unsafe extern "C" fn(*mut c_void);
type FnRead = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, i64, i64) -> isize;

/// Which path loaded the file.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "path", rename_all = "lowercase")]
pub enum FilePath {
    /// cuFile (GPUDirect Storage): the file system DMA'd straight into device memory.
    Gds,
    /// Positioned reads into pinned host memory, then host-to-device copies; `why` says why
    /// GDS did not run.
    Compat {
        /// Why not GDS.
        why: String,
    },
}

impl std::fmt::Display for FilePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FilePath::Gds => f.write_str("gds"),
            FilePath::Compat { why } => write!(f, "compat ({why})"),
        }
    }
}

/// The result of [`read_file_into`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FileLoad {
    /// Bytes loaded.
    pub bytes: u64,
    /// Which path ran.
    pub path: FilePath,
}

/// The compatibility path's pinned buffers: how many, and how large.
pub const COMPAT_BUFFERS: usize = 3;
/// The compatibility path's chunk size.
pub const COMPAT_CHUNK: usize = 4 << 20;

/// Loads `len` bytes of the file at `path` from `file_offset` into `dst` at `offset`: with cuFile
/// when `libcufile.so.0` (or `FERRY_LIBCUFILE`) loads and registers the file, otherwise by the
/// compatibility path. `gds: false` skips cuFile, as does a CUDA driver loaded from another
/// library than `libcuda.so.1` (`FERRY_LIBCUDA`; see [`driver_mismatch`]). Blocking.
pub fn read_file_into(
    dst: &DeviceMemory,
    offset: u64,
    path: &Path,
    file_offset: u64,
    len: u64,
    gds: bool,
) -> Result<FileLoad, CudaError> {
    ferry_core::check_range(offset, len, dst.len() as u64).map_err(CudaError::OutOfBounds)?;
    let why = if gds {
        match read_gds(dst, offset, path, file_offset, len) {
            Ok(bytes) => {
                return Ok(FileLoad {
                    bytes,
                    path: FilePath::Gds,
                });
            }
            Err(why) => why,
        }
    } else {
        "GDS not requested".to_owned()
    };
    tracing::info!(path = %path.display(), %why, "read_file_into: compatibility path");
    let bytes = read_compat(dst, offset, path, file_offset, len)?;
    Ok(FileLoad {
        bytes,
        path: FilePath::Compat { why },
    })
}

/// Why cuFile cannot run beside the CUDA driver this process loaded from `cuda_library`, if it
/// cannot: cuFile opens the driver itself, by the name `libcuda.so.1`, so it can only work with
/// the driver of that name. With another (a build pointed elsewhere by `FERRY_LIBCUDA`, such as
/// the tests' fake driver) its `cuFileDriverOpen` finds no driver, and NVIDIA's libcufile then
/// spins in it for ever rather than failing; so it is not called.
pub fn driver_mismatch(cuda_library: &std::ffi::OsStr) -> Option<String> {
    (cuda_library != std::ffi::OsStr::new(crate::LIBCUDA)).then(|| {
        format!(
            "cuFile uses the CUDA driver {}, but this process's is {} (FERRY_LIBCUDA)",
            crate::LIBCUDA,
            cuda_library.to_string_lossy()
        )
    })
}

/// cuFile; `Err` carries why it could not run (the caller takes the compatibility path before
/// any byte moved, and says so). A failure after cuFile started is also reported this way: the
/// compatibility path then rewrites the whole range.
fn read_gds(
    dst: &DeviceMemory,
    offset: u64,
    path: &Path,
    file_offset: u64,
    len: u64,
) -> Result<u64, String> {
    if let Some(why) = driver_mismatch(&crate::library_name("FERRY_LIBCUDA", crate::LIBCUDA)) {
        return Err(why);
    }
    let name = crate::library_name("FERRY_LIBCUFILE", crate::LIBCUFILE);
    let lib = crate::open(&name).map_err(|e| e.to_string())?;
    // SAFETY: the aliases are the signatures in cufile.h; the pointers are used while `lib` lives.
    let (open, register, deregister, read) = unsafe {
        let open = lib.get::<FnDriverOpen>(b"cuFileDriverOpen\0");
        let register = lib.get::<FnHandleRegister>(b"cuFileHandleRegister\0");
        let deregister = lib.get::<FnHandleDeregister>(b"cuFileHandleDeregister\0");
        let read = lib.get::<FnRead>(b"cuFileRead\0");
        match (open, register, deregister, read) {
            (Ok(a), Ok(b), Ok(c), Ok(d)) => (*a, *b, *c, *d),
            _ => {
                return Err(format!(
                    "{}: missing cuFile entry points",
                    name.to_string_lossy()
                ));
            }
        }
    };
    dst.device()
        .cuda()
        .device(dst.location().ordinal)
        .map_err(|e| e.to_string())?;
    // SAFETY: no arguments; opens the cuFile driver (idempotent).
    let e = unsafe { open() };
    if e.err != 0 {
        return Err(format!(
            "cuFileDriverOpen failed: error {} (CUresult {})",
            e.err, e.cu_err
        ));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| format!("open {} with O_DIRECT: {e}", path.display()))?;
    let mut descr = CuFileDescr {
        kind: HANDLE_TYPE_OPAQUE_FD,
        handle: file.as_raw_fd() as u32 as usize,
        fs_ops: std::ptr::null(),
    };
    let mut handle: *mut c_void = std::ptr::null_mut();
    // SAFETY: `descr` and `handle` are live for the call; the fd stays open until deregistered.
    let e = unsafe { register(&mut handle, &mut descr) };
    if e.err != 0 {
        return Err(format!(
            "cuFileHandleRegister refused {} (error {}: the file system does not support GDS?)",
            path.display(),
            e.err
        ));
    }
    let mut done = 0u64;
    let mut result = Ok(());
    while done < len {
        let n = (len - done).min(1 << 30) as usize;
        // SAFETY: the device range `ptr+offset+done..+n` was bounds-checked by the caller; the
        // handle is registered.
        let got = unsafe {
            read(
                handle,
                dst.device_ptr() as *mut c_void,
                n,
                (file_offset + done) as i64,
                (offset + done) as i64,
            )
        };
        if got <= 0 {
            result = Err(format!(
                "cuFileRead returned {got} at file offset {}",
                file_offset + done
            ));
            break;
        }
        done += got as u64;
    }
    // SAFETY: `handle` was registered above and is deregistered once.
    unsafe { deregister(handle) };
    drop(file);
    result.map(|_| done)
}

/// Positioned reads into pinned buffers on this thread, host-to-device copies on another:
/// chunk k's copy overlaps chunk k+1's read. Buffers are allocated once per call.
fn read_compat(
    dst: &DeviceMemory,
    offset: u64,
    path: &Path,
    file_offset: u64,
    len: u64,
) -> Result<u64, CudaError> {
    let file = File::open(path).map_err(|e| CudaError::Io {
        what: format!("open {}", path.display()),
        source: e,
    })?;
    let chunk = COMPAT_CHUNK.min(len.max(1) as usize);
    let mut buffers = Vec::with_capacity(COMPAT_BUFFERS);
    for _ in 0..COMPAT_BUFFERS {
        buffers.push(dst.device().alloc_pinned(chunk)?.into_region());
    }
    let (free_tx, free_rx) = mpsc::channel();
    for b in buffers {
        let _ = free_tx.send(b);
    }
    let (full_tx, full_rx) =
        mpsc::sync_channel::<(ferry_core::MemoryRegion, u64, usize)>(COMPAT_BUFFERS);
    std::thread::scope(|s| {
        let copier = s.spawn(move || -> Result<(), CudaError> {
            for (buf, at, n) in full_rx {
                dst.copy_from_region(offset + at, &buf, 0, n)?;
                let _ = free_tx.send(buf);
            }
            Ok(())
        });
        let mut at = 0u64;
        let mut read_result = Ok(());
        while at < len {
            let n = (len - at).min(chunk as u64) as usize;
            let Ok(buf) = free_rx.recv() else { break };
            // SAFETY: the pipeline owns `buf` exclusively until it is sent to the copier.
            let slice = unsafe { buf.slice_mut(0, n) }.map_err(CudaError::OutOfBounds);
            let r = slice.and_then(|sl| {
                file.read_exact_at(sl, file_offset + at)
                    .map_err(|e| CudaError::Io {
                        what: format!("read {} at {}", path.display(), file_offset + at),
                        source: e,
                    })
            });
            if let Err(e) = r {
                read_result = Err(e);
                break;
            }
            if full_tx.send((buf, at, n)).is_err() {
                break;
            }
            at += n as u64;
        }
        drop(full_tx);
        let copied = copier.join().unwrap_or_else(|_| {
            Err(CudaError::Io {
                what: "the copy thread".into(),
                source: std::io::Error::other("panicked"),
            })
        });
        read_result.and(copied).map(|_| len)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cuFile is tried only beside the driver it loads itself: a process whose driver came from
    /// elsewhere (the tests' fake, any `FERRY_LIBCUDA`) takes the compatibility path, saying why.
    #[test]
    fn cufile_runs_only_beside_the_driver_it_loads_itself() {
        assert_eq!(driver_mismatch(std::ffi::OsStr::new("libcuda.so.1")), None);
        let why = driver_mismatch(std::ffi::OsStr::new("/tmp/fake/libcuda.so.1"))
            .expect("another driver library is a mismatch");
        assert!(
            why.contains("/tmp/fake/libcuda.so.1") && why.contains("FERRY_LIBCUDA"),
            "{why}"
        );
    }
}

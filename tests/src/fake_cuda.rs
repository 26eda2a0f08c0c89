//! Ferry's fake CUDA driver for tests: `fake-cuda/fake_cuda.c` compiled with `cc` into a
//! directory under the system's temporary directory, once per process and variant, and loaded
//! in place of `libcuda.so.1` by path (`FERRY_LIBCUDA` or `Cuda::open`). See the C file for what
//! it fakes and which failures a test can switch on ([`FakeCuda::fail`]).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use crate::require::{TOOLS, require_or_skip};

const SOURCE: &str = include_str!("../fake-cuda/fake_cuda.c");

/// Which fake to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FakeVariant {
    /// Every entry point, dma-buf export included.
    Full,
    /// Without `cuMemGetHandleForAddressRange` (a driver older than 11.7), no dma-buf support.
    NoDmabuf,
    /// Every entry point, with device pointers that are plain (untagged, page-aligned) host
    /// memory, so a NIC's `ibv_reg_mr` on them works as `nvidia_peermem` makes it work on a GPU:
    /// the soft-RoCE tests of the peermem route.
    HostPointers,
}

impl FakeVariant {
    /// The variant's directory name (and the name under `FERRY_FAKE_CUDA_PREBUILT`).
    pub fn tag(self) -> &'static str {
        match self {
            FakeVariant::Full => "full",
            FakeVariant::NoDmabuf => "nodmabuf",
            FakeVariant::HostPointers => "hostptr",
        }
    }

    /// Every variant.
    pub const ALL: [FakeVariant; 3] = [Self::Full, Self::NoDmabuf, Self::HostPointers];
}

/// A built fake driver, with its control entry points loaded.
#[derive(Debug)]
pub struct FakeCuda {
    path: PathBuf,
    lib: libloading::Library,
}

impl FakeCuda {
    /// The library's path (give it to `Cuda::open` or `FERRY_LIBCUDA`).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Makes every call of `call` fail after `after` successful ones, until [`reset`](Self::reset).
    pub fn fail(&self, call: &str, after: i64) {
        let c = std::ffi::CString::new(call).expect("entry point names have no NUL");
        // SAFETY: the fake defines `void ferry_fake_cuda_fail(const char *, long)`.
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn(*const std::ffi::c_char, i64)>(
                    b"ferry_fake_cuda_fail\0",
                )
                .expect("fake exports ferry_fake_cuda_fail");
            f(c.as_ptr(), after);
        }
    }

    /// Switches every failure off, and the copy delay and hold (releasing a held copy); restarts
    /// [`max_copies_in_flight`](Self::max_copies_in_flight).
    pub fn reset(&self) {
        // SAFETY: the fake defines `void ferry_fake_cuda_reset(void)`.
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn()>(b"ferry_fake_cuda_reset\0")
                .expect("fake exports ferry_fake_cuda_reset");
            f();
        }
    }

    /// Calls one of the fake's `void name(long)` switches.
    fn switch(&self, name: &[u8], arg: i64) {
        // SAFETY: the fake defines each switch as `void name(long)`.
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn(i64)>(name)
                .expect("fake exports its switches");
            f(arg);
        }
    }

    /// Makes each copy on a stream (`cuMemcpyDtoHAsync_v2`, `cuMemcpyHtoDAsync_v2`) sleep this
    /// long before it copies, until [`reset`](Self::reset) (which also clears what
    /// `FERRY_FAKE_CUDA_COPY_DELAY_US` set at `cuInit`). Slows copies so that overlapping ones
    /// show in [`max_copies_in_flight`](Self::max_copies_in_flight); not a timing assertion.
    pub fn copy_delay(&self, delay: std::time::Duration) {
        let us = i64::try_from(delay.as_micros()).unwrap_or(i64::MAX);
        self.switch(b"ferry_fake_cuda_copy_delay_us\0", us);
    }

    /// The most copies on a stream that ran at once (on different threads) since
    /// [`reset`](Self::reset) (counted from those running at the reset).
    pub fn max_copies_in_flight(&self) -> i64 {
        self.counter(b"ferry_fake_cuda_max_copies_in_flight\0")
    }

    /// Makes the `nth` copy on a stream from now (0: the next) wait, counted in flight and before
    /// it copies anything, until [`release`](Self::release) or [`reset`](Self::reset): a test
    /// sees what else moves while one copy has not finished.
    pub fn hold_copy(&self, nth: i64) {
        self.switch(b"ferry_fake_cuda_hold_copy\0", nth);
    }

    /// Lets a copy held by [`hold_copy`](Self::hold_copy) go on, and holds no further one.
    pub fn release(&self) {
        // SAFETY: the fake defines `void ferry_fake_cuda_release(void)`.
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn()>(b"ferry_fake_cuda_release\0")
                .expect("fake exports ferry_fake_cuda_release");
            f();
        }
    }

    /// Whether a copy held by [`hold_copy`](Self::hold_copy) waits now.
    pub fn held(&self) -> bool {
        self.counter(b"ferry_fake_cuda_held\0") != 0
    }

    fn counter(&self, name: &[u8]) -> i64 {
        // SAFETY: the fake defines each counter as `long name(void)`.
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn() -> i64>(name)
                .expect("fake exports its counters");
            f()
        }
    }

    /// Device allocations not freed yet.
    pub fn live_device_allocs(&self) -> i64 {
        self.counter(b"ferry_fake_cuda_live_device_allocs\0")
    }

    /// Pinned host allocations not freed yet.
    pub fn live_host_allocs(&self) -> i64 {
        self.counter(b"ferry_fake_cuda_live_host_allocs\0")
    }

    /// Primary contexts retained and not released.
    pub fn retained_contexts(&self) -> i64 {
        self.counter(b"ferry_fake_cuda_retained_contexts\0")
    }

    /// Copies done so far (those on a stream count when they finished).
    pub fn copies(&self) -> i64 {
        self.counter(b"ferry_fake_cuda_copies\0")
    }

    /// Sets the number of GPUs the fake lists to drivers opened from now on (it starts at
    /// `FERRY_FAKE_CUDA_DEVICES`, default 1; `reset` leaves it).
    pub fn set_devices(&self, n: i32) {
        // SAFETY: the fake defines `void ferry_fake_cuda_set_devices(int)`.
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn(i32)>(b"ferry_fake_cuda_set_devices\0")
                .expect("fake exports ferry_fake_cuda_set_devices");
            f(n);
        }
    }

    /// Streams created and not destroyed.
    pub fn live_streams(&self) -> i64 {
        self.counter(b"ferry_fake_cuda_live_streams\0")
    }

    /// CUDA IPC handles opened in this process and not closed (each open counts).
    pub fn live_ipc_imports(&self) -> i64 {
        self.counter(b"ferry_fake_cuda_live_ipc_imports\0")
    }

    /// Whether `cuIpcOpenMemHandle_v2` opens a handle this process exported (the real driver
    /// refuses it, as the fake does by default): for tests of both ends in one process.
    /// [`reset`](Self::reset) leaves it.
    pub fn ipc_same_process(&self, allow: bool) {
        self.switch(b"ferry_fake_cuda_ipc_same_process\0", i64::from(allow));
    }
}

/// Compiles the fake of `variant` into `dir/libcuda.so.1` with `cc`, and returns that path.
/// `cargo xtask soft-roce` prebuilds every variant this way for the guest, which has no compiler.
pub fn build_into(variant: FakeVariant, dir: &Path) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    let src = dir.join("fake_cuda.c");
    std::fs::write(&src, SOURCE).map_err(|e| format!("write {}: {e}", src.display()))?;
    let out = dir.join("libcuda.so.1");
    let mut cmd = Command::new("cc");
    cmd.args(["-shared", "-fPIC", "-O1", "-pthread", "-o"])
        .arg(&out)
        .arg(&src);
    match variant {
        FakeVariant::Full => {}
        FakeVariant::NoDmabuf => {
            cmd.arg("-DFAKE_NO_DMABUF");
        }
        FakeVariant::HostPointers => {
            cmd.arg("-DFAKE_HOST_POINTERS");
        }
    }
    let status = cmd.output().map_err(|e| format!("cc not runnable: {e}"))?;
    if !status.status.success() {
        return Err(format!(
            "cc failed: {}",
            String::from_utf8_lossy(&status.stderr)
        ));
    }
    Ok(out)
}

/// The environment variable naming a directory of prebuilt fakes (`<dir>/<tag>/libcuda.so.1`,
/// as [`build_into`] makes them): used instead of compiling, where no compiler is (the
/// soft-RoCE guest).
pub const PREBUILT_ENV: &str = "FERRY_FAKE_CUDA_PREBUILT";

fn build(variant: FakeVariant) -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os(PREBUILT_ENV).filter(|d| !d.is_empty()) {
        let path = Path::new(&dir).join(variant.tag()).join("libcuda.so.1");
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!("{PREBUILT_ENV}: no {}", path.display()))
        };
    }
    // One directory per process and variant: a fake's globals (failures, counters) belong to the
    // test binary that loaded it.
    let dir = std::env::temp_dir().join(format!(
        "ferry-fake-cuda-{}-{}",
        std::process::id(),
        variant.tag()
    ));
    build_into(variant, &dir)
}

/// The fake driver of `variant`, built once per process. `None` (after the `FERRY_REQUIRE_TOOLS`
/// gate: a failure where it is `1`, else a printed skip) when `cc` cannot build it.
pub fn fake_cuda(variant: FakeVariant) -> Option<&'static FakeCuda> {
    static FULL: OnceLock<Result<FakeCuda, String>> = OnceLock::new();
    static NO_DMABUF: OnceLock<Result<FakeCuda, String>> = OnceLock::new();
    static HOST_POINTERS: OnceLock<Result<FakeCuda, String>> = OnceLock::new();
    let cell = match variant {
        FakeVariant::Full => &FULL,
        FakeVariant::NoDmabuf => &NO_DMABUF,
        FakeVariant::HostPointers => &HOST_POINTERS,
    };
    let r = cell.get_or_init(|| {
        let path = build(variant)?;
        // SAFETY: the fake's initialisers are C's defaults; it was just built from our source.
        let lib = unsafe { libloading::Library::new(&path) }.map_err(|e| e.to_string())?;
        Ok(FakeCuda { path, lib })
    });
    match r {
        Ok(f) => Some(f),
        Err(why) => {
            require_or_skip(TOOLS, format!("cannot build the fake CUDA driver: {why}"));
            None
        }
    }
}

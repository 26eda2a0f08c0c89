//! CUDA IPC against Ferry's fake driver: a process's device memory granted to another and copied
//! by it, device to device and between host and device, in one process (the fake's
//! same-process switch) and across two (this test binary run again as the granting child).
//! The fake's switches are process-wide, so these tests take one lock.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::{Mutex, MutexGuard};

use ferry_core::MemoryRegion;
use ferry_cuda::driver::IpcMemHandle;
use ferry_cuda::ipc::IPC_REF_LEN;
use ferry_cuda::{Cuda, CudaError, IpcImports, IpcRef};
use ferry_tests::{FakeVariant, fake_cuda};

static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn device_to_device_host_to_device_and_back_in_one_process() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    fake.ipc_same_process(true);
    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    assert!(cuda.has_ipc());
    let dev = cuda.device(0).unwrap();
    let before = fake.live_ipc_imports();

    // The granting side: a buffer 4096 bytes into its allocation (the handle is the base's).
    let whole = dev.alloc(3 * 4096).unwrap();
    // SAFETY: 4096..12288 lies in `whole`, which outlives `theirs` (dropped at the end).
    let theirs = unsafe { dev.wrap(whole.device_ptr() + 4096, 8192, Box::new(())) };
    let r = theirs.ipc_ref().unwrap();
    assert_eq!((r.offset, r.len), (4096, 8192));
    assert_eq!(IpcRef::decode(&r.encode()), r);

    // The copying side: its own device memory and host memory.
    let ours = dev.alloc(8192).unwrap();
    let data = pattern(8192, 7);
    ours.copy_from_host(0, &data).unwrap();
    let imports = IpcImports::new(&dev);
    let stream = dev.copy_stream().unwrap();

    // GPU -> GPU (ours into theirs), in two parts.
    let a = imports.resolve(&r, 0, 4096).unwrap();
    let b = imports.resolve(&r, 4096, 4096).unwrap();
    stream.copy_to_imported(&ours, 0, &a).unwrap();
    stream.copy_to_imported(&ours, 4096, &b).unwrap();
    assert_eq!(imports.open_handles(), 1, "one allocation, one open");
    assert_eq!(fake.live_ipc_imports(), before + 1);
    let mut back = vec![0u8; 8192];
    theirs.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, data, "the bytes landed in the granting side's memory");

    // GPU -> host: theirs into a host region of ours.
    let host = MemoryRegion::alloc_zeroed(8192, 4096).unwrap();
    let all = imports.resolve(&r, 0, 8192).unwrap();
    stream.copy_imported_to_region(&all, &host, 0).unwrap();
    let mut got = vec![0u8; 8192];
    host.read_at(0, &mut got).unwrap();
    assert_eq!(got, data);

    // host -> GPU: a host region of ours into theirs.
    let other = pattern(8192, 99);
    host.write_at(0, &other).unwrap();
    stream.copy_region_to_imported(&host, 0, &all).unwrap();
    theirs.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, other);

    // GPU <- GPU: theirs into ours.
    stream.copy_from_imported(&ours, 0, &all).unwrap();
    ours.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back, other);

    // Past the granted buffer: refused before any mapping is touched.
    assert!(matches!(
        imports.resolve(&r, 4096, 8192),
        Err(CudaError::OutOfBounds(_))
    ));
    // A buffer the handle's allocation does not hold (a forged offset): refused.
    let forged = IpcRef {
        offset: 3 * 4096,
        ..r
    };
    assert!(matches!(
        imports.resolve(&forged, 0, 4096),
        Err(CudaError::OutOfBounds(_))
    ));
    drop((a, b, all));
    drop(imports);
    assert_eq!(
        fake.live_ipc_imports(),
        before,
        "dropping the imports closed the handle"
    );
    fake.ipc_same_process(false);
}

#[test]
fn forged_and_own_handles_are_refused() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    let dev = cuda.device(0).unwrap();
    let mem = dev.alloc(4096).unwrap();
    let r = mem.ipc_ref().unwrap();
    let imports = IpcImports::new(&dev);
    let before = fake.live_ipc_imports();
    // The real driver refuses a process's own handle, and so does the fake by default.
    let e = imports.resolve(&r, 0, 16).unwrap_err();
    assert!(e.to_string().contains("CUDA_ERROR_INVALID_CONTEXT"), "{e}");
    // Random bytes, and a real handle with one byte changed: refused by the driver.
    fake.ipc_same_process(true);
    let garbage = IpcRef {
        handle: IpcMemHandle([0x5a; 64]),
        ..r
    };
    let e = imports.resolve(&garbage, 0, 16).unwrap_err();
    assert!(e.to_string().contains("CUDA_ERROR_INVALID_HANDLE"), "{e}");
    let mut bytes = r.handle.0;
    bytes[24] ^= 1; // the serial
    let tampered = IpcRef {
        handle: IpcMemHandle(bytes),
        ..r
    };
    let e = imports.resolve(&tampered, 0, 16).unwrap_err();
    assert!(e.to_string().contains("CUDA_ERROR_INVALID_HANDLE"), "{e}");
    assert_eq!(imports.open_handles(), 0);
    assert_eq!(fake.live_ipc_imports(), before, "nothing was mapped");
    fake.ipc_same_process(false);
}

/// The line of `/proc/self/maps` that holds `addr`: the mapping, its offset, device, inode and
/// backing (what says whether the pages behind an address are still the same object).
fn mapping_of(addr: u64) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .find(|l| {
            let range = l.split(' ').next().unwrap_or("");
            let (a, b) = range.split_once('-').unwrap_or(("", ""));
            let (a, b) = (
                u64::from_str_radix(a, 16).unwrap_or(u64::MAX),
                u64::from_str_radix(b, 16).unwrap_or(0),
            );
            a <= addr && addr < b
        })
        .unwrap_or_else(|| panic!("no mapping holds {addr:#x}"))
        .to_owned()
}

/// Exporting device memory never moves it: a NIC registered on its pages before the export (the
/// peermem route registers at allocation, the engine exports right after) must still see the
/// pages the process copies to. The fake with host pointers, where a device address is the
/// host address of its pages, shows the mapping unchanged across `cuIpcGetMemHandle`.
#[test]
fn exporting_device_memory_leaves_it_where_it_is() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::HostPointers) else {
        return;
    };
    fake.reset();
    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    let dev = cuda.device(0).unwrap();
    let mem = dev.alloc(3 * 4096 + 5).unwrap();
    let before = mapping_of(mem.device_ptr());
    let r = mem.ipc_ref().unwrap();
    assert_eq!((r.offset, r.len), (0, 3 * 4096 + 5));
    assert_eq!(
        mapping_of(mem.device_ptr()),
        before,
        "the export replaced the pages behind the allocation"
    );
}

#[test]
fn a_driver_without_ipc_is_unavailable() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    // A driver that lost an IPC entry point: built from the fake with it renamed.
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fake-cuda/fake_cuda.c"),
    )
    .unwrap()
    .replace(
        "CUresult cuIpcCloseMemHandle(",
        "CUresult notCuIpcCloseMemHandle(",
    );
    std::fs::write(dir.path().join("f.c"), src).unwrap();
    let lib = dir.path().join("libcuda.so.1");
    let ok = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-pthread", "-o"])
        .arg(&lib)
        .arg(dir.path().join("f.c"))
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skip: cc cannot build the variant");
        return;
    }
    let cuda = Cuda::open(lib.as_os_str()).unwrap();
    assert!(!cuda.has_ipc());
    let dev = cuda.device(0).unwrap();
    let mem = dev.alloc(64).unwrap();
    match mem.ipc_ref() {
        Err(CudaError::OnDevice { source, .. }) => match *source {
            CudaError::Unavailable { reason, .. } => {
                assert!(reason.contains("CUDA IPC"), "{reason}")
            }
            other => panic!("{other}"),
        },
        other => panic!("{other:?}"),
    }
}

/// The granting child of the two-process test (run only as that child): allocates device
/// memory, fills it, prints its `IpcRef`, then on each line of stdin prints a digest of what the
/// memory holds now, until stdin ends.
#[test]
fn ipc_child_process() {
    let Some(lib) = std::env::var_os("FERRY_IPC_TEST_CHILD") else {
        return;
    };
    let cuda = Cuda::open(&lib).unwrap();
    let dev = cuda.device(0).unwrap();
    let mem = dev.alloc(1 << 16).unwrap();
    mem.copy_from_host(0, &pattern(1 << 16, 3)).unwrap();
    let r = mem.ipc_ref().unwrap();
    println!("\nREF {}", hex(&r.encode()));
    let mut line = String::new();
    let stdin = std::io::stdin();
    while stdin.lock().read_line(&mut line).is_ok_and(|n| n > 0) {
        line.clear();
        let mut now = vec![0u8; 1 << 16];
        mem.copy_to_host(0, &mut now).unwrap();
        println!("\nHAS {}", hex(&now[..64]));
    }
}

#[test]
fn two_processes_copy_device_to_device_and_a_leaver_s_handle_is_refused() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "ipc_child_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("FERRY_IPC_TEST_CHILD", fake.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut next = |tag: &str| loop {
        let mut l = String::new();
        assert!(out.read_line(&mut l).unwrap() > 0, "the child ended early");
        if let Some(rest) = l.trim().strip_prefix(tag) {
            return unhex(rest.trim());
        }
    };
    let raw: [u8; IPC_REF_LEN] = next("REF ").try_into().unwrap();
    let r = IpcRef::decode(&raw);
    assert_eq!(r.len, 1 << 16);

    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    let dev = cuda.device(0).unwrap();
    let imports = IpcImports::new(&dev);
    let stream = dev.copy_stream().unwrap();
    let before = fake.live_ipc_imports();
    // Their memory into ours: the child's pattern.
    let ours = dev.alloc(1 << 16).unwrap();
    let theirs = imports.resolve(&r, 0, 1 << 16).unwrap();
    stream.copy_from_imported(&ours, 0, &theirs).unwrap();
    let mut got = vec![0u8; 1 << 16];
    ours.copy_to_host(0, &mut got).unwrap();
    assert_eq!(got, pattern(1 << 16, 3));
    // Ours into theirs: the child sees it.
    ours.copy_from_host(0, &pattern(1 << 16, 200)).unwrap();
    stream.copy_to_imported(&ours, 0, &theirs).unwrap();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "look").unwrap();
    assert_eq!(next("HAS "), pattern(64, 200));
    drop(theirs);
    assert_eq!(fake.live_ipc_imports(), before + 1);
    drop(imports);
    assert_eq!(fake.live_ipc_imports(), before, "closed with the imports");

    // The child leaves: a fresh open of its handle is refused, nothing mapped.
    drop(stdin);
    assert!(child.wait().unwrap().success());
    let fresh = IpcImports::new(&dev);
    let e = fresh.resolve(&r, 0, 16).unwrap_err();
    assert!(e.to_string().contains("CUDA_ERROR_INVALID_HANDLE"), "{e}");
    assert_eq!(fake.live_ipc_imports(), before);
}

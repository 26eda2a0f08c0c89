//! ferry-cuda against Ferry's fake CUDA driver (host memory behind the libcuda entry points).
//! The fake's failure switches are process-wide, so these tests take one lock.

use std::ffi::OsStr;
use std::sync::{Arc, Mutex, MutexGuard};

use ferry_core::{Access, FileSource, OpKind, RemoteStatus};
use ferry_cuda::{Cuda, CudaError, DeviceSegment};
use ferry_tests::{FakeVariant, fake_cuda};

static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn devices_memory_and_copies() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    assert!(cuda.is_fake());
    assert_eq!(cuda.version().unwrap(), "12.4");
    let devs = cuda.devices();
    assert_eq!(devs.len(), 1);
    assert_eq!(devs[0].location.pci_bus_id, "0000:17:00.0");
    assert!(devs[0].name.contains("Fake"));
    assert!(devs[0].dmabuf_supported);
    let before = fake.retained_contexts();
    let d0 = cuda.device(0).unwrap();
    let _again = cuda.device(0).unwrap();
    assert_eq!(
        fake.retained_contexts(),
        before + 1,
        "one primary context, retained once"
    );

    let live = fake.live_device_allocs();
    let mem = d0.alloc(10_000).unwrap();
    assert_eq!(fake.live_device_allocs(), live + 1);
    let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    mem.copy_from_host(0, &data).unwrap();
    let mut back = vec![0u8; 100];
    mem.copy_to_host(9_900, &mut back).unwrap();
    assert_eq!(back, &data[9_900..]);
    assert!(matches!(
        mem.copy_to_host(9_950, &mut back),
        Err(CudaError::OutOfBounds(_))
    ));
    // The device address is not a host address (the fake tags it; dereferencing would fault).
    assert_ne!(mem.device_ptr() & (1 << 62), 0);
    assert!(mem.dmabuf_fd().is_ok());

    let host = fake.live_host_allocs();
    let pinned = d0.alloc_pinned(4096).unwrap().into_region();
    assert_eq!(fake.live_host_allocs(), host + 1);
    mem.copy_to_region(0, &pinned, 0, 4096).unwrap();
    let mut out = vec![0u8; 4096];
    pinned.read_at(0, &mut out).unwrap();
    assert_eq!(out, &data[..4096]);
    drop(pinned);
    assert_eq!(fake.live_host_allocs(), host, "pinned memory freed on drop");

    // Served as a segment: access first, then bounds, then copies.
    let seg = DeviceSegment::new(Arc::new(mem), Access::REMOTE_READ);
    assert_eq!(seg.check(OpKind::Read, 10, 20), Ok(10));
    assert_eq!(
        seg.check(OpKind::Write, 0, 1),
        Err(RemoteStatus::AccessDenied)
    );
    assert_eq!(
        seg.check(OpKind::Read, 9_999, 2),
        Err(RemoteStatus::OutOfBounds)
    );
    let streams = fake.live_streams();
    let mut b = [0u8; 3];
    seg.read_exact_at(1, &mut b).unwrap();
    assert_eq!(&b, &data[1..4]);
    seg.read_exact_at(2, &mut b).unwrap();
    assert_eq!(&b, &data[2..5]);
    assert_eq!(
        fake.live_streams(),
        streams + 1,
        "served on a copy stream, kept for the next call"
    );
    fake.fail("cuMemcpyDtoHAsync_v2", 0);
    let e = seg.read_exact_at(0, &mut b).unwrap_err().to_string();
    fake.reset();
    assert!(e.contains("cuMemcpyDtoHAsync_v2"), "{e}");
    drop(seg);
    assert_eq!(fake.live_streams(), streams, "its streams go with it");
    assert_eq!(
        fake.live_device_allocs(),
        live,
        "device memory freed on drop"
    );
    assert!(cuda.device(3).unwrap_err().to_string().contains("no GPU 3"));
    drop((d0, _again, cuda));
    assert_eq!(
        fake.retained_contexts(),
        before,
        "context released with the last handle"
    );
}

#[test]
fn failures_carry_the_call_the_code_and_the_device() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    let d0 = cuda.device(0).unwrap();
    fake.fail("cuMemAlloc_v2", 0);
    let e = d0.alloc(1 << 20).unwrap_err();
    fake.reset();
    let text = e.to_string();
    assert!(text.starts_with("GPU 0: "), "{text}");
    assert!(text.contains("cuMemAlloc_v2"), "{text}");
    assert!(text.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{text}");
    assert!(text.contains("libcuda.so.1"), "{text}");
    assert_eq!(e.code(), Some(2));

    let mem = d0.alloc(64).unwrap();
    fake.fail("cuMemcpyDtoH_v2", 0);
    let e = mem.copy_to_host(0, &mut [0u8; 8]).unwrap_err();
    fake.reset();
    assert!(e.to_string().contains("cuMemcpyDtoH_v2"), "{e}");
}

#[test]
fn a_driver_without_dmabuf_export_says_so() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::NoDmabuf) else {
        return;
    };
    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    assert!(!cuda.has_dmabuf_export());
    assert!(!cuda.devices()[0].dmabuf_supported);
    let mem = cuda.device(0).unwrap().alloc(64).unwrap();
    let e = mem.dmabuf_fd().unwrap_err().to_string();
    assert!(e.contains("cuMemGetHandleForAddressRange"), "{e}");
}

#[test]
fn no_libcuda_at_all_is_unavailable_not_a_panic() {
    let e = Cuda::open(OsStr::new("/nonexistent/libcuda.so.1")).unwrap_err();
    match &e {
        CudaError::Unavailable { library, reason } => {
            assert_eq!(library, "/nonexistent/libcuda.so.1");
            assert!(reason.contains("No such file"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // And the system's libcuda.so.1, which this machine may lack: an error or a driver, never a
    // panic.
    if std::env::var_os("FERRY_LIBCUDA").is_none() {
        match Cuda::load() {
            Ok(c) => assert!(!c.is_fake()),
            Err(e) => assert!(e.to_string().starts_with("libcuda.so.1: "), "{e}"),
        }
    }
}

#[test]
fn a_library_missing_a_required_entry_point_is_unavailable() {
    // libc loads but exports no CUDA entry point.
    let e = Cuda::open(OsStr::new("libc.so.6")).unwrap_err().to_string();
    assert!(e.starts_with("libc.so.6: missing export cuInit"), "{e}");
}

#[test]
fn file_into_device_memory_by_the_compat_path() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shard.bin");
    let len = ferry_cuda::cufile::COMPAT_CHUNK * 2 + 12_345;
    let data: Vec<u8> = (0..len).map(|i| (i * 7 % 256) as u8).collect();
    std::fs::write(&path, &data).unwrap();
    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    let mem = cuda.device(0).unwrap().alloc(len + 100).unwrap();
    let host = fake.live_host_allocs();
    // No libcufile here (or GDS refused): the compatibility path runs and says why.
    let load = ferry_cuda::cufile::read_file_into(&mem, 100, &path, 0, len as u64, true).unwrap();
    assert_eq!(load.bytes, len as u64);
    match &load.path {
        ferry_cuda::FilePath::Compat { why } => assert!(!why.is_empty()),
        ferry_cuda::FilePath::Gds => eprintln!("GDS ran (libcufile present)"),
    }
    let mut back = vec![0u8; len];
    mem.copy_to_host(100, &mut back).unwrap();
    assert!(back == data, "bytes differ");
    assert_eq!(fake.live_host_allocs(), host, "pinned buffers freed");

    // A copy failing midway is an error, and leaves nothing pinned.
    fake.fail("cuMemcpyHtoD_v2", 1);
    let e = ferry_cuda::cufile::read_file_into(&mem, 0, &path, 0, len as u64, false).unwrap_err();
    fake.reset();
    assert!(e.to_string().contains("cuMemcpyHtoD_v2"), "{e}");
    assert_eq!(
        fake.live_host_allocs(),
        host,
        "pinned buffers freed after a failure"
    );
}

#[test]
fn copies_on_a_stream_from_any_thread_and_their_failures() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    let d0 = cuda.device(0).unwrap();
    let streams = fake.live_streams();
    let copies = fake.copies();
    let stream = d0.copy_stream().unwrap();
    assert_eq!(fake.live_streams(), streams + 1);
    let mem = d0.alloc(10_000).unwrap();
    let host = Arc::new(d0.alloc_pinned(4096).unwrap().into_region());
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 13 % 251) as u8).collect();
    // SAFETY: the region is ours alone here, 4096 bytes long.
    unsafe { std::ptr::copy_nonoverlapping(pattern.as_ptr(), host.as_ptr(), 4096) };
    // Made on this thread, used on another (the staging lanes do): each copy makes the device's
    // context current on its own thread.
    let (stream, mem, host) = std::thread::scope(|s| {
        s.spawn(move || {
            stream.copy_from_region(&mem, 5000, &host, 0, 4096).unwrap();
            // SAFETY: as above.
            unsafe { std::ptr::write_bytes(host.as_ptr(), 0, 4096) };
            stream.copy_to_region(&mem, 5000, &host, 0, 4096).unwrap();
            (stream, mem, host)
        })
        .join()
        .unwrap()
    });
    // SAFETY: the region is 4096 bytes and no copy is in flight.
    let back = unsafe { std::slice::from_raw_parts(host.as_ptr(), 4096) };
    assert!(
        back == pattern.as_slice(),
        "bytes differ after a round trip"
    );
    assert_eq!(fake.copies(), copies + 2, "both copies went to the driver");

    // Out of bounds is refused before the driver sees it.
    let e = stream
        .copy_to_region(&mem, 9000, &host, 0, 4096)
        .unwrap_err();
    assert!(matches!(e, CudaError::OutOfBounds(_)), "{e:?}");

    for call in [
        "cuMemcpyDtoHAsync_v2",
        "cuMemcpyHtoDAsync_v2",
        "cuStreamSynchronize",
    ] {
        fake.fail(call, 0);
        let e = if call == "cuMemcpyHtoDAsync_v2" {
            stream.copy_from_region(&mem, 0, &host, 0, 64)
        } else {
            stream.copy_to_region(&mem, 0, &host, 0, 64)
        }
        .unwrap_err();
        fake.reset();
        let text = e.to_string();
        assert!(text.starts_with("GPU 0: "), "{text}");
        assert!(text.contains(call), "{call}: {text}");
    }
    fake.fail("cuStreamCreate", 0);
    let e = d0.copy_stream().unwrap_err().to_string();
    fake.reset();
    assert!(e.contains("cuStreamCreate"), "{e}");
    drop(stream);
    assert_eq!(
        fake.live_streams(),
        streams,
        "the stream is destroyed on drop"
    );
}

/// The fake's pipeline switches, which the staging tests rely on: a held copy waits (counted in
/// flight) until released while another stream's copy runs; the most in flight is counted and
/// restarted by reset; a delay only slows copies down.
#[test]
fn copies_on_streams_can_be_held_delayed_and_counted_in_flight() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    let d0 = cuda.device(0).unwrap();
    let (s1, s2) = (d0.copy_stream().unwrap(), d0.copy_stream().unwrap());
    let mem = d0.alloc(8192).unwrap();
    let (h1, h2) = (
        Arc::new(d0.alloc_pinned(4096).unwrap().into_region()),
        Arc::new(d0.alloc_pinned(4096).unwrap().into_region()),
    );
    // One at a time: never more than one in flight.
    s1.copy_to_region(&mem, 0, &h1, 0, 4096).unwrap();
    s2.copy_to_region(&mem, 4096, &h2, 0, 4096).unwrap();
    assert_eq!(fake.max_copies_in_flight(), 1);

    fake.reset();
    let copies = fake.copies();
    fake.hold_copy(0);
    /// Releases the held copy should an assertion fail (the scope would wait for it forever).
    struct ResetOnDrop(&'static ferry_tests::FakeCuda);
    impl Drop for ResetOnDrop {
        fn drop(&mut self) {
            self.0.reset();
        }
    }
    std::thread::scope(|s| {
        let _reset = ResetOnDrop(fake);
        let held = s.spawn(|| s1.copy_from_region(&mem, 0, &h1, 0, 4096));
        while !fake.held() {
            std::thread::yield_now();
        }
        // Another stream's copy runs to its end while the held one waits.
        s2.copy_to_region(&mem, 4096, &h2, 0, 4096).unwrap();
        assert!(fake.held());
        assert_eq!(fake.copies(), copies + 1, "only the unheld copy finished");
        assert_eq!(fake.max_copies_in_flight(), 2);
        fake.release();
        held.join().unwrap().unwrap();
    });
    assert!(!fake.held());
    assert_eq!(fake.copies(), copies + 2);
    fake.reset();
    assert_eq!(fake.max_copies_in_flight(), 0, "restarted by reset");

    fake.copy_delay(std::time::Duration::from_millis(1));
    s1.copy_to_region(&mem, 0, &h1, 0, 4096).unwrap();
    fake.reset();
    assert_eq!(fake.max_copies_in_flight(), 0);
    assert_eq!(fake.copies(), copies + 3);
}

#[test]
fn wrapping_asks_the_driver_where_the_memory_is() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    let mem = Arc::new(cuda.device(0).unwrap().alloc(8192).unwrap());
    let owner = || -> Box<dyn std::any::Any + Send + Sync> { Box::new(mem.clone()) };
    // SAFETY: `mem` is a live allocation that the owner keeps alive.
    let inner = unsafe { cuda.wrap_located(mem.device_ptr() + 100, 4000, owner()) }.unwrap();
    assert_eq!(inner.location().ordinal, 0);
    assert_eq!(inner.len(), 4000);
    inner.copy_from_host(0, b"located").unwrap();
    let mut back = [0u8; 7];
    mem.copy_to_host(100, &mut back).unwrap();
    assert_eq!(&back, b"located");

    // SAFETY: as above (and the call is refused).
    let e = unsafe { cuda.wrap_located(mem.device_ptr() + 100, 8192, owner()) }.unwrap_err();
    assert!(matches!(e, CudaError::NotDeviceMemory { .. }), "{e:?}");
    let e = e.to_string();
    assert!(
        e.contains("runs past its allocation") && e.contains("libcuda"),
        "{e}"
    );
    // SAFETY: as above (and the call is refused).
    let e = unsafe { cuda.wrap_located(mem.device_ptr() + 9000, 1, owner()) }
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cuPointerGetAttribute") && e.contains("CUDA_ERROR_INVALID_VALUE"),
        "{e}"
    );
}

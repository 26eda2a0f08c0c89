//! GPU memory over the TCP and io_uring data planes, against Ferry's fake CUDA driver (host
//! memory behind the libcuda entry points; device addresses fault if dereferenced as host
//! memory). The fake's failure switches are process-wide: the tests take one lock.
#![cfg(feature = "cuda")]

use ferry::cuda::{Cuda, GpuDirectSetting, GpuRoute};
use ferry::{
    Access, Batch, DataPlane, FailureKind, GpuRegistration, MemoryRegion, Registration, Staging,
    TransferEngine,
};
use ferry_tests::{FakeCuda, FakeVariant, URING, fake_cuda, require_or_skip};

static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// For the tests outside a runtime.
fn lock() -> tokio::sync::MutexGuard<'static, ()> {
    LOCK.blocking_lock()
}

/// Small buffers, so that a few MiB make many chunks in flight.
const BUF: usize = 64 << 10;
const BUFFERS: usize = 3;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
        .collect()
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100000001b3)
    })
}

fn engine(fake: &FakeCuda, plane: DataPlane, listen: bool) -> TransferEngine {
    engine_with_lanes(fake, plane, listen, BUFFERS)
}

/// An engine whose staging pool has `lanes` lanes of `BUF` bytes.
fn engine_with_lanes(
    fake: &FakeCuda,
    plane: DataPlane,
    listen: bool,
    lanes: usize,
) -> TransferEngine {
    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    let mut b = TransferEngine::builder()
        .same_host(false)
        .data_plane(plane)
        .cuda(cuda)
        .staging_buffers(lanes, BUF)
        .chunk_size(32 << 10);
    if listen {
        b = b.listen("127.0.0.1:0".parse().unwrap());
    }
    b.build().unwrap()
}

fn gpu_bytes(r: &GpuRegistration, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    r.memory().copy_to_host(off, &mut v).unwrap();
    v
}

fn host_reg(e: &TransferEngine, len: usize, access: Access, name: &str) -> Registration {
    e.register(MemoryRegion::alloc_zeroed(len, 4096).unwrap(), access, name)
        .unwrap()
}

fn plane_or_skip(plane: DataPlane) -> bool {
    if plane == DataPlane::Uring
        && let Some(why) = ferry::probe_kernel().unusable_reason()
    {
        require_or_skip(URING, format!("io_uring unusable here: {why}"));
        return false;
    }
    true
}

async fn every_direction(plane: DataPlane) {
    let _g = LOCK.lock().await;
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    if !plane_or_skip(plane) {
        return;
    }
    fake.reset();
    let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let server = engine(fake, plane, true);
    let client = engine(fake, plane, false);
    // Not a multiple of the staging buffer, nor of the wire chunk.
    let len = 5 * BUF + 12_345;
    let g = server.alloc_gpu(0, len + 100, rw, "g").unwrap();
    let h = host_reg(&server, len + 100, rw, "h");
    let mine = client
        .alloc_gpu(0, len + 100, Access::LOCAL, "mine")
        .unwrap();
    let host = host_reg(&client, len + 100, Access::LOCAL, "host");
    let peer = client.connect(server.local_addr().unwrap()).await.unwrap();
    let (rg, rh) = (peer.segment("g").unwrap(), peer.segment("h").unwrap());

    // GPU to GPU (WRITE), then GPU from GPU (READ) into another offset.
    let data = pattern(len, 1);
    mine.memory().copy_from_host(0, &data).unwrap();
    let o = client
        .submit(Batch::new().write(&mine, 0, &rg, 7, len as u64))
        .unwrap()
        .await;
    assert!(o.is_success(), "{o:?}");
    assert_eq!(fnv(&gpu_bytes(&g, 7, len)), fnv(&data), "GPU to GPU write");
    let o = client
        .submit(Batch::new().read(&mine, 50, &rg, 7, len as u64))
        .unwrap()
        .await;
    assert!(o.is_success(), "{o:?}");
    assert!(gpu_bytes(&mine, 50, len) == data, "GPU from GPU read");

    // GPU to host and host from... : client GPU -> server host, then server host -> client GPU.
    let data = pattern(len, 2);
    mine.memory().copy_from_host(0, &data).unwrap();
    let o = client
        .submit(Batch::new().write(&mine, 0, &rh, 0, len as u64))
        .unwrap()
        .await;
    assert!(o.is_success(), "{o:?}");
    let mut on_host = vec![0; len];
    h.region().read_at(0, &mut on_host).unwrap();
    assert!(on_host == data, "GPU to host write");
    let o = client
        .submit(Batch::new().read(&mine, 100, &rh, 0, len as u64))
        .unwrap()
        .await;
    assert!(o.is_success(), "{o:?}");
    assert!(gpu_bytes(&mine, 100, len) == data, "GPU from host read");

    // Host to GPU (WRITE), then host and GPU ops mixed in one batch (ops of one request may
    // overlap in flight, so the READs come after the WRITE's request).
    let data = pattern(len, 3);
    host.region().write_at(0, &data).unwrap();
    let o = client
        .submit(Batch::new().write(&host, 0, &rg, 0, len as u64))
        .unwrap()
        .await;
    assert!(o.is_success(), "{o:?}");
    assert!(gpu_bytes(&g, 0, len) == data, "host to GPU write");
    let o = client
        .submit(
            Batch::new()
                .read(&host, len as u64 - 1000, &rg, 0, 1000)
                .read(&mine, 0, &rg, 0, len as u64)
                .write(&mine, 0, &rh, 0, 10),
        )
        .unwrap()
        .await;
    assert!(o.is_success(), "{o:?}");
    assert_eq!(o.completed_ops, 3);
    assert!(
        gpu_bytes(&mine, 0, len) == data,
        "GPU read in a mixed batch"
    );

    let d = client.describe();
    let s = d.staging.unwrap();
    assert_eq!(s.buffers, BUFFERS);
    assert_eq!(s.buffers_in_use, 0, "nothing held after the requests");
    assert!(s.staged_bytes >= 5 * len as u64, "{s:?}");
    assert!(s.copies > 0);
    assert_eq!(d.gpu_registrations.len(), 1);
    assert_eq!(d.gpu_registrations[0].pci_bus_id, "0000:17:00.0");
    assert_eq!(d.gpu_registrations[0].route.route, GpuRoute::Off);
    let sd = server.describe();
    assert!(sd.published.iter().any(|p| p.name == "g"), "{sd:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_moves_the_right_bytes_over_tcp() {
    every_direction(DataPlane::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_moves_the_right_bytes_over_uring() {
    every_direction(DataPlane::Uring).await;
}

/// Resets the fake when dropped, releasing a held copy even when an assertion failed (a lane's
/// thread held in the driver would keep the engine's drop from returning).
struct ResetOnDrop(&'static FakeCuda);

impl Drop for ResetOnDrop {
    fn drop(&mut self) {
        self.0.reset();
    }
}

/// Lanes of the client's pool in the pipeline tests, and the chunks of their ops.
const LANES: usize = 4;
const CHUNKS: usize = 12;

/// Staged WRITEs and READs of `CHUNKS` chunks (the last one short) between client GPU memory
/// and server host memory (so only the client's lanes copy), with each copy slowed down by the
/// fake: with `LANES` lanes the copies of different chunks run at once (the fake saw two or more
/// in flight), with one lane never (exactly one): the count means what it says.
async fn copies_overlap(plane: DataPlane) {
    let _g = LOCK.lock().await;
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    if !plane_or_skip(plane) {
        return;
    }
    let _reset = ResetOnDrop(fake);
    fake.reset();
    let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let server = engine(fake, plane, true);
    let len = (CHUNKS - 1) * BUF + 4321;
    let h = host_reg(&server, len, rw, "h");
    let delay = std::time::Duration::from_millis(20);
    let mut seen = Vec::new();
    for lanes in [LANES, 1] {
        let client = engine_with_lanes(fake, plane, false, lanes);
        let mine = client.alloc_gpu(0, len, Access::LOCAL, "mine").unwrap();
        let peer = client.connect(server.local_addr().unwrap()).await.unwrap();
        let rh = peer.segment("h").unwrap();
        let data = pattern(len, lanes as u8);
        mine.memory().copy_from_host(0, &data).unwrap();

        fake.reset();
        fake.copy_delay(delay);
        let o = client
            .submit(Batch::new().write(&mine, 0, &rh, 0, len as u64))
            .unwrap()
            .await;
        let write = fake.max_copies_in_flight();
        fake.reset();
        assert!(o.is_success(), "{lanes} lanes: {o:?}");
        let mut on_host = vec![0; len];
        h.region().read_at(0, &mut on_host).unwrap();
        assert!(on_host == data, "{lanes} lanes: staged write");

        mine.memory().copy_from_host(0, &vec![0; len]).unwrap();
        fake.copy_delay(delay);
        let o = client
            .submit(Batch::new().read(&mine, 0, &rh, 0, len as u64))
            .unwrap()
            .await;
        let read = fake.max_copies_in_flight();
        fake.reset();
        assert!(o.is_success(), "{lanes} lanes: {o:?}");
        assert!(
            gpu_bytes(&mine, 0, len) == data,
            "{lanes} lanes: staged read"
        );
        let s = client.describe().staging.unwrap();
        assert_eq!(s.buffers, lanes);
        assert_eq!(s.copies, 2 * CHUNKS as u64, "one copy per chunk each way");
        seen.push((lanes, write, read));
    }
    eprintln!("(lanes, most copies in flight in a write, in a read): {seen:?}");
    let [(_, w4, r4), (_, w1, r1)] = seen[..] else {
        unreachable!()
    };
    assert!(
        w4 >= 2,
        "{LANES} lanes: a write's copies never overlapped: {seen:?}"
    );
    assert!(
        r4 >= 2,
        "{LANES} lanes: a read's copies never overlapped: {seen:?}"
    );
    assert_eq!(
        (w1, r1),
        (1, 1),
        "one lane runs one copy at a time: {seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_of_different_chunks_overlap_tcp() {
    copies_overlap(DataPlane::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_of_different_chunks_overlap_uring() {
    copies_overlap(DataPlane::Uring).await;
}

/// Polls `done` until it holds; panics with `what` after a generous bound (a liveness bound so
/// that a broken pipeline fails instead of hanging, not a timing assertion).
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !done() {
        assert!(std::time::Instant::now() < give_up, "never: {what}");
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

/// The wire overlaps copies, shown without timing: the fake holds one chunk's copy, and the
/// other chunks still move. A WRITE's other chunks reach the peer's memory (copied, sent and
/// received while that copy has not finished); a READ's other chunks are received and copied to
/// the device while it has not. One lane, or chunks posted one after another, would wait.
async fn the_wire_moves_while_a_copy_is_held(plane: DataPlane) {
    let _g = LOCK.lock().await;
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    if !plane_or_skip(plane) {
        return;
    }
    let _reset = ResetOnDrop(fake);
    fake.reset();
    let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let server = engine(fake, plane, true);
    let client = engine_with_lanes(fake, plane, false, LANES);
    let len = CHUNKS * BUF;
    let h = host_reg(&server, len, rw, "h");
    let mine = client.alloc_gpu(0, len, Access::LOCAL, "mine").unwrap();
    let peer = client.connect(server.local_addr().unwrap()).await.unwrap();
    let rh = peer.segment("h").unwrap();
    let data = pattern(len, 7);
    mine.memory().copy_from_host(0, &data).unwrap();
    let arrived = || {
        let mut on_host = vec![0; len];
        h.region().read_at(0, &mut on_host).unwrap();
        on_host
            .chunks(BUF)
            .zip(data.chunks(BUF))
            .filter(|(a, b)| a == b)
            .count()
    };

    // WRITE: chunk copies to host, then sends; one copy waits in the driver.
    let copies = fake.copies();
    fake.hold_copy(0);
    let handle = client
        .submit(Batch::new().write(&mine, 0, &rh, 0, len as u64))
        .unwrap();
    eventually("a write's copy held", || fake.held()).await;
    eventually("every other chunk of a write on the peer", || {
        arrived() == CHUNKS - 1
    })
    .await;
    assert!(fake.held(), "still held");
    assert_eq!(fake.copies(), copies + CHUNKS as i64 - 1);
    fake.release();
    let o = handle.await;
    assert!(o.is_success(), "{o:?}");
    assert_eq!(arrived(), CHUNKS, "the held chunk too, once released");

    // READ: chunks are received, then copied to the device; one copy waits in the driver.
    mine.memory().copy_from_host(0, &vec![0; len]).unwrap();
    let copies = fake.copies();
    fake.hold_copy(0);
    let handle = client
        .submit(Batch::new().read(&mine, 0, &rh, 0, len as u64))
        .unwrap();
    eventually("a read's copy held", || fake.held()).await;
    eventually("every other chunk of a read received and copied", || {
        fake.copies() == copies + CHUNKS as i64 - 1
    })
    .await;
    assert!(fake.held(), "still held");
    fake.release();
    let o = handle.await;
    assert!(o.is_success(), "{o:?}");
    assert!(gpu_bytes(&mine, 0, len) == data, "staged read");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wire_moves_while_a_copy_is_held_tcp() {
    the_wire_moves_while_a_copy_is_held(DataPlane::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wire_moves_while_a_copy_is_held_uring() {
    the_wire_moves_while_a_copy_is_held(DataPlane::Uring).await;
}

/// A batch of a host op and two GPU ops whose `call` fails at its third use: WRITEs when `write`.
async fn copy_failure(plane: DataPlane, call: &str, write: bool) {
    let _g = LOCK.lock().await;
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    if !plane_or_skip(plane) {
        return;
    }
    fake.reset();
    let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let server = engine(fake, plane, true);
    let client = engine(fake, plane, false);
    let len = 8 * BUF + 5;
    let _h = host_reg(&server, 2 * len, rw, "h");
    let mine = client.alloc_gpu(0, len, Access::LOCAL, "mine").unwrap();
    let host = host_reg(&client, len, Access::LOCAL, "host");
    let peer = client.connect(server.local_addr().unwrap()).await.unwrap();
    let rh = peer.segment("h").unwrap();
    // Warm the pool, so that what is pinned afterwards can be compared.
    let o = client
        .submit(Batch::new().write(&mine, 0, &rh, 0, 10))
        .unwrap()
        .await;
    assert!(o.is_success());
    let pinned = fake.live_host_allocs();

    // Op 0 on host memory, op 1 on the GPU (its third copy fails), op 2 on the GPU.
    fake.fail(call, 2);
    let batch = if write {
        Batch::new()
            .write(&host, 0, &rh, 0, 100)
            .write(&mine, 0, &rh, 0, len as u64)
            .write(&mine, 0, &rh, len as u64, 10)
    } else {
        Batch::new()
            .read(&host, 0, &rh, 0, 100)
            .read(&mine, 0, &rh, 0, len as u64)
            .read(&mine, 0, &rh, 0, 10)
    };
    let handle = client.submit(batch).unwrap();
    let drained = handle.drained();
    let o = handle.await;
    fake.reset();
    assert_eq!(o.completed_ops, 1, "{o:?}");
    assert_eq!(o.completed_bytes, 100);
    let f = o.failure.expect("the copy failure");
    assert_eq!(f.op_index, 1);
    assert_eq!(f.kind, FailureKind::Local);
    assert_eq!(f.native_status, Some(999), "the driver's CUresult");
    let o = drained.await;
    assert!(o.drained);
    let s = client.describe().staging.unwrap();
    assert_eq!(s.buffers_in_use, 0, "nothing held by the failed request");
    assert!(s.copy_failures >= 1);
    assert_eq!(
        fake.live_host_allocs(),
        pinned,
        "nothing pinned beyond the pool"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_to_host_copy_failing_midway_gives_the_prefix_tcp() {
    copy_failure(DataPlane::Tcp, "cuMemcpyDtoHAsync_v2", true).await;
}

/// A copy whose enqueue succeeded but whose stream reports the failure when synchronized.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_failing_at_stream_synchronize_gives_the_prefix_tcp() {
    copy_failure(DataPlane::Tcp, "cuStreamSynchronize", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_to_device_copy_failing_midway_gives_the_prefix_uring() {
    copy_failure(DataPlane::Uring, "cuMemcpyHtoDAsync_v2", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_never_refuses_gpu_ops_before_anything_moves() {
    let _g = LOCK.lock().await;
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let server = engine(fake, DataPlane::Tcp, true);
    let h = host_reg(&server, 4096, Access::REMOTE_WRITE, "h");
    let client = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Tcp)
        .cuda(Cuda::open(fake.path().as_os_str()).unwrap())
        .staging(Staging::Never)
        .build()
        .unwrap();
    let mine = client.alloc_gpu(0, 4096, Access::LOCAL, "mine").unwrap();
    let peer = client.connect(server.local_addr().unwrap()).await.unwrap();
    let e = client
        .submit(Batch::new().write(&mine, 0, &peer.segment("h").unwrap(), 0, 10))
        .unwrap_err()
        .to_string();
    assert!(e.contains("staging: never"), "{e}");
    assert!(e.contains("no direct route"), "{e}");
    drop(h);
}

#[test]
fn route_choice_in_an_engine_without_rdma() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    for setting in GpuDirectSetting::ALL {
        let e = TransferEngine::builder()
            .same_host(false)
            .data_plane(DataPlane::Tcp)
            .cuda(Cuda::open(fake.path().as_os_str()).unwrap())
            .gpu_direct_registration(setting)
            .build()
            .unwrap();
        let r = e.alloc_gpu(0, 4096, Access::LOCAL, "x");
        match setting {
            GpuDirectSetting::Auto | GpuDirectSetting::Off => {
                let r = r.unwrap();
                assert_eq!(r.route().route, GpuRoute::Off);
                assert!(!r.route().why.is_empty());
            }
            explicit => {
                let e = r.unwrap_err().to_string();
                assert!(e.contains(explicit.name()), "{e}");
                assert!(e.contains("missing an RDMA transport"), "{e}");
            }
        }
    }
}

#[test]
fn without_libcuda_gpu_calls_are_unavailable() {
    if std::env::var_os("FERRY_LIBCUDA").is_some() || Cuda::load().is_ok() {
        eprintln!("skip: this machine has a CUDA driver");
        return;
    }
    let e = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Tcp)
        .build()
        .unwrap();
    let err = e
        .alloc_gpu(0, 4096, Access::LOCAL, "x")
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("libcuda.so.1 unavailable: "), "{err}");
    // Host memory still works in the same engine.
    host_reg(&e, 4096, Access::LOCAL, "host");
}

#[test]
fn a_file_loads_into_gpu_memory_and_says_which_path() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let e = engine(fake, DataPlane::Tcp, false);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.bin");
    let data = pattern(3 << 20, 9);
    std::fs::write(&path, &data).unwrap();
    let g = e.alloc_gpu(0, data.len(), Access::LOCAL, "w").unwrap();
    let load = e
        .read_file_into_gpu(&g, 0, &path, 0, data.len() as u64)
        .unwrap();
    assert_eq!(load.bytes, data.len() as u64);
    assert!(gpu_bytes(&g, 0, data.len()) == data);
    // Past the end of the GPU memory: out of bounds, before anything is read.
    let past = e
        .read_file_into_gpu(&g, 1, &path, 0, data.len() as u64)
        .unwrap_err();
    assert!(
        matches!(past, ferry::Error::OutOfBounds { side: "local", .. }),
        "{past:?}"
    );
    let shown = e.describe().staging.unwrap().last_file_path.unwrap();
    assert_eq!(shown, load.path.to_string());
    assert!(
        shown.starts_with("gds") || shown.starts_with("compat ("),
        "{shown}"
    );
}

/// Two GPUs stage through a pool each (pinned buffers and copy streams of their own device):
/// the bytes of both move right, the second GPU's first request makes its pool, and a batch with
/// ops on both GPUs still moves right (the second GPU's ops through the first pool, by its own
/// blocking copies).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_gpu_stages_through_its_own_pool() {
    let _g = LOCK.lock().await;
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    // Two GPUs while this test runs (the fake checks ordinals on every call), one again after.
    struct TwoGpus(&'static FakeCuda);
    impl Drop for TwoGpus {
        fn drop(&mut self) {
            self.0.set_devices(1);
        }
    }
    fake.set_devices(2);
    let _two = TwoGpus(fake);
    let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let server = engine(fake, DataPlane::Tcp, true);
    let client = engine(fake, DataPlane::Tcp, false);
    let len = 3 * BUF + 77;
    let h = host_reg(&server, 2 * len, rw, "h");
    let peer = client.connect(server.local_addr().unwrap()).await.unwrap();
    let rh = peer.segment("h").unwrap();
    let streams = fake.live_streams();
    let g0 = client.alloc_gpu(0, len, Access::LOCAL, "g0").unwrap();
    let g1 = client.alloc_gpu(1, len, Access::LOCAL, "g1").unwrap();
    let (d0, d1) = (pattern(len, 10), pattern(len, 11));
    g0.memory().copy_from_host(0, &d0).unwrap();
    g1.memory().copy_from_host(0, &d1).unwrap();

    let o = client
        .submit(Batch::new().write(&g1, 0, &rh, len as u64, len as u64))
        .unwrap()
        .await;
    assert!(o.is_success(), "{o:?}");
    assert_eq!(client.describe().staging.unwrap().buffers, BUFFERS);
    let o = client
        .submit(Batch::new().write(&g0, 0, &rh, 0, len as u64))
        .unwrap()
        .await;
    assert!(o.is_success(), "{o:?}");
    let s = client.describe().staging.unwrap();
    assert_eq!(s.buffers, 2 * BUFFERS, "a pool per GPU: {s:?}");
    assert_eq!(
        fake.live_streams(),
        streams + 2 * BUFFERS as i64,
        "each lane has a stream"
    );
    let mut on_host = vec![0u8; 2 * len];
    h.region().read_at(0, &mut on_host).unwrap();
    assert!(on_host[..len] == d0[..] && on_host[len..] == d1[..]);

    // One batch over both GPUs, read back crosswise.
    let o = client
        .submit(
            Batch::new()
                .read(&g0, 0, &rh, len as u64, len as u64)
                .read(&g1, 0, &rh, 0, len as u64),
        )
        .unwrap()
        .await;
    assert!(o.is_success(), "{o:?}");
    assert!(gpu_bytes(&g0, 0, len) == d1 && gpu_bytes(&g1, 0, len) == d0);
    drop((g0, g1, peer, client));
    assert_eq!(
        fake.live_streams(),
        streams,
        "the pools' streams go with the engine"
    );
}

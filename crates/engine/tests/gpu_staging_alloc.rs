//! What a staged chunk allocates, against Ferry's fake CUDA driver over loopback TCP: a counting
//! global allocator measures staged WRITEs and READs of a few and of many chunks, and one-op host
//! requests, in the same process. Per chunk, staging may cost what a one-op sub-request costs
//! (its op, its ledger, the channel's future), less than a one-op request, and no buffer. One test in this file: the
//! allocator's counters are process-wide.
#![cfg(feature = "cuda")]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use ferry::cuda::Cuda;
use ferry::{Access, Batch, DataPlane, MemoryRegion, TransferEngine};
use ferry_tests::{FakeVariant, fake_cuda};

/// Counts allocations (`realloc` counts as one, of its new size) and the bytes they asked for.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

fn counted(size: usize) {
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    BYTES.fetch_add(size as u64, Ordering::Relaxed);
}

// SAFETY: every call goes to `System` with the caller's arguments; counting allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        counted(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        counted(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        counted(new_size);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The staging buffer (a chunk), the lanes, and the two sizes compared, in chunks.
const CHUNK: usize = 64 << 10;
const LANES: usize = 4;
const FEW: usize = 2;
const MANY: usize = 34;

/// Allocations and bytes allocated (by every thread: the runtime's, the server's, the lanes')
/// while `f` ran; the least of three runs, so that another thread's stray allocation does not
/// count.
async fn least_of_three<F: AsyncFnMut()>(mut f: F) -> (u64, u64) {
    let mut least = (u64::MAX, u64::MAX);
    for _ in 0..3 {
        let (a, b) = (ALLOCS.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst));
        f().await;
        let (a, b) = (
            ALLOCS.load(Ordering::SeqCst) - a,
            BYTES.load(Ordering::SeqCst) - b,
        );
        least = (least.0.min(a), least.1.min(b));
    }
    least
}

/// Per unit, from a measure of `FEW` and one of `MANY` units: the slope, so that what a request
/// costs whatever its size (its handle, its workers, its task) does not count.
fn per_unit(few: (u64, u64), many: (u64, u64)) -> (f64, f64) {
    let n = (MANY - FEW) as f64;
    (
        (many.0 as f64 - few.0 as f64) / n,
        (many.1 as f64 - few.1 as f64) / n,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_chunk_allocates_less_than_a_one_op_request() {
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let len = MANY * CHUNK;
    let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let engine = |listen: bool| {
        let mut b = TransferEngine::builder()
            .same_host(false)
            .data_plane(DataPlane::Tcp)
            .cuda(Cuda::open(fake.path().as_os_str()).unwrap())
            .staging_buffers(LANES, CHUNK);
        if listen {
            b = b.listen("127.0.0.1:0".parse().unwrap());
        }
        b.build().unwrap()
    };
    let server = engine(true);
    let client = engine(false);
    let _h = server
        .register(MemoryRegion::alloc_zeroed(len, 4096).unwrap(), rw, "h")
        .unwrap();
    let host = client
        .register(
            MemoryRegion::alloc_zeroed(CHUNK, 4096).unwrap(),
            Access::LOCAL,
            "host",
        )
        .unwrap();
    let mine = client.alloc_gpu(0, len, Access::LOCAL, "mine").unwrap();
    let peer = client.connect(server.local_addr().unwrap()).await.unwrap();
    let rh = peer.segment("h").unwrap();

    let staged_write = async |chunks: usize| {
        let o = client
            .submit(Batch::new().write(&mine, 0, &rh, 0, (chunks * CHUNK) as u64))
            .unwrap()
            .await;
        assert!(o.is_success(), "{o:?}");
    };
    let staged_read = async |chunks: usize| {
        let o = client
            .submit(Batch::new().read(&mine, 0, &rh, 0, (chunks * CHUNK) as u64))
            .unwrap()
            .await;
        assert!(o.is_success(), "{o:?}");
    };
    // `requests` one-op host requests of a chunk each, one after another.
    let host_writes = async |requests: usize| {
        for i in 0..requests {
            let o = client
                .submit(Batch::new().write(&host, 0, &rh, (i * CHUNK) as u64, CHUNK as u64))
                .unwrap()
                .await;
            assert!(o.is_success(), "{o:?}");
        }
    };
    let host_reads = async |requests: usize| {
        for i in 0..requests {
            let o = client
                .submit(Batch::new().read(&host, 0, &rh, (i * CHUNK) as u64, CHUNK as u64))
                .unwrap()
                .await;
            assert!(o.is_success(), "{o:?}");
        }
    };

    // Warm up: the pool, the connection's streams, the server's and the runtime's buffers.
    for _ in 0..2 {
        staged_write(MANY).await;
        staged_read(MANY).await;
        host_writes(MANY).await;
        host_reads(MANY).await;
    }
    assert_eq!(client.describe().staging.unwrap().buffers, LANES);

    let sw = per_unit(
        least_of_three(async || staged_write(FEW).await).await,
        least_of_three(async || staged_write(MANY).await).await,
    );
    let sr = per_unit(
        least_of_three(async || staged_read(FEW).await).await,
        least_of_three(async || staged_read(MANY).await).await,
    );
    let hw = per_unit(
        least_of_three(async || host_writes(FEW).await).await,
        least_of_three(async || host_writes(MANY).await).await,
    );
    let hr = per_unit(
        least_of_three(async || host_reads(FEW).await).await,
        least_of_three(async || host_reads(MANY).await).await,
    );
    eprintln!("per unit ({FEW} vs {MANY} units of {CHUNK} bytes, {LANES} lanes, loopback TCP):");
    eprintln!("  what                          allocations  bytes");
    for (what, (a, b)) in [
        ("staged WRITE, per chunk", sw),
        ("staged READ, per chunk", sr),
        ("one-op host WRITE request", hw),
        ("one-op host READ request", hr),
    ] {
        eprintln!("  {what:<28} {a:>12.1}  {b:>8.0}");
    }

    // No buffer per chunk: a chunk's bytes stay in the lane's pinned buffer.
    for (what, (_, bytes)) in [("write", sw), ("read", sr)] {
        assert!(
            bytes < (CHUNK / 8) as f64,
            "a staged {what} allocates {bytes} bytes per chunk of {CHUNK}"
        );
    }
    // A chunk is a one-op sub-request on the channel (its op list, its control and ledger, the
    // channel's shared state and boxed future): a one-op request makes each of those too, and
    // its own batch, boxed future, task and handle besides (10 allocations at this writing), so
    // a chunk allocates fewer times than a one-op request. What a staged request does per chunk
    // where a one-op request does it once (its handle re-registers its waiter after a wake-up,
    // and a staged request is woken as its pieces finish) is under one allocation per chunk.
    // This catches a chunk costing a whole request; a box or a task more per chunk stays under
    // it (the table shows it).
    for (what, staged, host) in [("write", sw.0, hw.0), ("read", sr.0, hr.0)] {
        assert!(
            staged < host,
            "a staged {what} allocates {staged} times per chunk; a one-op host {what} request {host}"
        );
    }
}

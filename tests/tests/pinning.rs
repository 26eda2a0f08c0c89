//! Where the io_uring server's threads run for a loopback client (its own test binary: it reads
//! every thread of the process, which no other test may add to meanwhile).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use ferry_core::{MemoryRegion, OpKind, SegmentToken, Transport};
use ferry_transport_uring::{UringConfig, UringTransport};

/// The CPUs each of this process's threads named `comm` (as the kernel keeps it, 15 bytes) may
/// run on, one list per thread.
fn threads_named(comm_want: &str) -> Vec<String> {
    let mut out = Vec::new();
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim() != comm_want {
            continue;
        }
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        if let Some(l) = status.lines().find(|l| l.starts_with("Cpus_allowed_list:")) {
            out.push(l["Cpus_allowed_list:".len()..].trim().to_owned());
        }
    }
    out.sort();
    out
}

/// The CPUs each of this process's stream-serving threads ("ferry-uring-conn") may run on.
fn serving_threads() -> Vec<String> {
    threads_named("ferry-uring-con")
}

/// Waits up to 10 s for `want` to hold of the serving threads' CPU lists.
fn settle(what: &str, want: impl Fn(&[String]) -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let now = serving_threads();
        if want(&now) {
            return;
        }
        assert!(Instant::now() < end, "{what}: serving threads on {now:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A one-stream loopback client's serving thread is left to the scheduler. With two streams,
/// each serving thread is pinned to a core of its own: stream 1's when it attaches, stream 0's
/// (which started unpinned: the server could not tell that more would follow) at its next
/// request once stream 1 attached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_loopback_streams_are_served_one_core_each() {
    if !uring_usable() {
        return;
    }
    let allowed = {
        let all = std::fs::read_to_string("/proc/self/status").unwrap();
        all.lines()
            .find(|l| l.starts_with("Cpus_allowed_list:"))
            .map(|l| l["Cpus_allowed_list:".len()..].trim().to_owned())
            .unwrap()
    };
    // One CPU is a list without ranges or commas ("3").
    if !allowed.contains([',', '-']) {
        ferry_tests::require_or_skip(
            ferry_tests::CPUS,
            format!("this process may run on one CPU only ({allowed}): nothing to pin apart"),
        );
        return;
    }
    // The server with a thread per served stream (its fixed set of rings is pinned at its
    // start, below).
    let server_config = UringConfig {
        event_loop: false,
        ..UringConfig::default()
    };
    assert!(server_config.pin_loopback_streams);
    let h = serve_uring(&Arc::new(Table::default()), server_config, None);
    let addr = h.local_addr();
    let buf = Arc::new(MemoryRegion::alloc_zeroed(4096, 64).unwrap());
    // A request to an unknown segment is refused, but its header is served like any other.
    let ask = || vec![op(OpKind::Write, &buf, 0, SegmentToken(77), 0, 100)];

    for streams in [1, 2] {
        let t = UringTransport::new(UringConfig {
            streams,
            ..UringConfig::default()
        })
        .unwrap();
        let offer = t.offer();
        let peer = tokio::task::spawn_blocking(move || peer_info(addr, offer))
            .await
            .unwrap();
        let ch = t.open(peer).await.unwrap();
        // Enough requests that both streams (dealt in turn) serve at least one.
        for _ in 0..4 {
            let o = run(&ch, ask()).await;
            assert!(o.failure.is_some(), "unknown segment: {o:?}");
        }
        if streams == 1 {
            settle("one stream", |t| t.len() == 1 && t[0] == allowed);
        } else {
            settle("two streams", |t| {
                t.len() == 2 && t[0] != t[1] && t.iter().all(|c| c.parse::<usize>().is_ok())
            });
        }
        drop(ch);
        settle("channel dropped", |t| t.is_empty());
    }
    drop(h);

    // The default server's rings ("ferry-uring-ring0", "...1") each run on a CPU of their own
    // from the start, where a loopback client's stream of the same index is served.
    let rings = serve_uring(
        &Arc::new(Table::default()),
        UringConfig {
            server_rings: 2,
            ..UringConfig::default()
        },
        None,
    );
    assert_eq!(rings.rings(), 2);
    let ring_cpus = threads_named("ferry-uring-rin");
    assert_eq!(ring_cpus.len(), 2, "ring threads on {ring_cpus:?}");
    assert!(
        ring_cpus[0] != ring_cpus[1] && ring_cpus.iter().all(|c| c.parse::<usize>().is_ok()),
        "ring threads on {ring_cpus:?}"
    );
}

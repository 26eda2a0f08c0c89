//! Where the io_uring server's threads run for a loopback client (its own test binary: it reads
//! every thread of the process, which no other test may add to meanwhile).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use ferry_core::{MemoryRegion, OpKind, SegmentToken, Transport};
use ferry_transport_uring::{UringConfig, UringTransport};

/// The CPUs each of this process's threads whose name (as the kernel keeps it, 15 bytes) starts
/// with `prefix` may run on, one list per thread, sorted.
fn threads_named(prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !comm.trim().starts_with(prefix) {
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

/// Waits up to 10 s for `want` to hold of the CPU lists of the threads named `comm...`.
fn settle(comm: &str, what: &str, want: impl Fn(&[String]) -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let now = threads_named(comm);
        if want(&now) {
            return;
        }
        assert!(Instant::now() < end, "{what}: {comm} threads on {now:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The server's rings and the client's start unpinned and stay so for a one-stream loopback
/// client; once a loopback client's second stream attaches, each server ring runs on a CPU of its
/// own, and that client's rings are pinned the same way (its stream `i` on its ring `i`, on the
/// server's ring `i`'s CPU), so both ends of a flow share a core.
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
    let config = UringConfig {
        server_rings: 2,
        ..UringConfig::default()
    };
    assert!(config.pin_loopback_streams);
    let h = serve_uring(&Arc::new(Table::default()), config);
    assert_eq!(h.rings(), 2);
    // "ferry-uring-ring0", "...1" as the kernel keeps them (15 bytes).
    let unpinned = vec![allowed.clone(), allowed.clone()];
    assert_eq!(
        threads_named("ferry-uring-rin"),
        unpinned,
        "rings at the start"
    );
    let addr = h.local_addr();
    let buf = Arc::new(MemoryRegion::alloc_zeroed(4096, 64).unwrap());
    // A request to an unknown segment is refused, but its header is served like any other.
    let ask = || vec![op(OpKind::Write, &buf, 0, SegmentToken(77), 0, 100)];
    // One stream: served (its attach handed to a ring before its request is answered), and
    // nothing is pinned.
    let one = UringTransport::new(UringConfig::default()).unwrap();
    let offer = one.offer();
    let peer = tokio::task::spawn_blocking(move || peer_info(addr, offer))
        .await
        .unwrap();
    let ch1 = one.open(peer).await.unwrap();
    let o = run(&ch1, ask()).await;
    assert!(o.failure.is_some(), "unknown segment: {o:?}");
    let one_rings = std::thread::available_parallelism().unwrap().get();
    assert_eq!(
        threads_named("ferry-uring-cr"),
        vec![allowed.clone(); one_rings],
        "a one-stream client's rings"
    );
    assert_eq!(
        threads_named("ferry-uring-rin"),
        unpinned,
        "one-stream client"
    );
    drop(ch1);
    drop(one);
    settle("ferry-uring-cr", "one-stream client dropped", |t| {
        t.is_empty()
    });
    let t = UringTransport::new(UringConfig {
        streams: 2,
        client_rings: 2,
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
    // Each server ring on a CPU of its own, once the second stream attached.
    settle("ferry-uring-rin", "two-stream client", |r| {
        r.len() == 2 && r[0] != r[1] && r.iter().all(|c| c.parse::<usize>().is_ok())
    });
    let rings = threads_named("ferry-uring-rin");
    // "ferry-uring-cr0", "...cr1": the client's rings, on the server rings' CPUs.
    let want = rings.clone();
    settle("ferry-uring-cr", "two client rings", |t| t == want);
    drop(ch);
    // The client's rings stay with its transport, and end with it.
    assert_eq!(threads_named("ferry-uring-cr"), want);
    drop(t);
    settle("ferry-uring-cr", "transport dropped", |t| t.is_empty());
    // The rings stay where they are.
    assert_eq!(threads_named("ferry-uring-rin"), rings);
}

//! One source and several receivers in one process over loopback, with embedded discovery:
//! every receiver ends with the published bytes; a relay that corrupts a chunk is caught; a
//! late joiner catches up; a restarted source is refused.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ferry::DataPlane;
use ferry_broadcast::{
    BroadcastError, Digest, Embedded, Manifest, ManifestError, Receiver, ReceiverOptions, Source,
    SourceOptions, TestHooks,
};

mod common;
use common::logs;

fn payload(len: usize, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect()
}

fn files(dir: &std::path::Path) -> (Vec<PathBuf>, Vec<Vec<u8>>) {
    let a = payload(3 << 20, 1);
    let b = payload((1 << 20) + 4097, 2);
    let pa = dir.join("a.bin");
    let pb = dir.join("b.bin");
    std::fs::write(&pa, &a).unwrap();
    std::fs::write(&pb, &b).unwrap();
    (vec![pa, pb], vec![a, b])
}

fn opts() -> ReceiverOptions {
    logs();
    ReceiverOptions {
        data_plane: DataPlane::Tcp,
        stall_after: Duration::from_secs(2),
        heartbeat: Duration::from_millis(100),
        // The plans here are fixed by join order: no member is taken for a straggler
        // because a loaded machine slowed it.
        straggler: 0.0,
        ..Default::default()
    }
}

async fn source(paths: &[PathBuf]) -> Source {
    let m = Manifest::build("w", 1, paths, 256 << 10).unwrap();
    Source::start(
        m,
        paths,
        SourceOptions {
            data_plane: DataPlane::Tcp,
            ..Default::default()
        },
        None,
    )
    .await
    .unwrap()
}

/// Three receivers in join order, the first of which corrupts chunk `corrupt` after verifying
/// it and keeps it corrupt until the others are done, each pulling with `stripes`; then a
/// late joiner. Returns the three summaries (in join order) and the first one's id.
async fn three_with_a_corrupting_first(
    stripes: usize,
    corrupt: usize,
) -> (Vec<ferry_broadcast::Summary>, String) {
    let dir = tempfile::tempdir().unwrap();
    let (paths, want) = files(dir.path());
    let src = source(&paths).await;
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    let mut rs = Vec::new();
    let release = Arc::new(tokio::sync::Notify::new());
    for k in 0..3 {
        let mut o = opts();
        o.stripes = stripes;
        // Nothing here is about stalls: on a loaded machine a relay's first chunk may take
        // longer than the default, and a child that gave up its corrupting parent as stalled
        // would never read the corruption this test is about.
        o.stall_after = Duration::from_secs(60);
        let mut r = Receiver::join(disc.clone(), Some("w"), o).await.unwrap();
        if k == 0 {
            r.set_test_hooks(TestHooks {
                corrupt_after_verify: Some(corrupt),
                hold_final_check: Some(release.clone()),
                ..Default::default()
            });
        }
        rs.push(r);
    }
    let first_id = rs[0].member().id.clone();
    let mut tasks = Vec::new();
    for mut r in rs {
        tasks.push(tokio::spawn(async move {
            let s = r.run().await;
            r.linger(Duration::from_secs(10)).await;
            (r, s)
        }));
    }
    let first = tasks.remove(0);
    let mut done = Vec::new();
    for t in tasks {
        done.push(t.await.unwrap());
    }
    // Only now may the first receiver find and mend its corrupted chunk at rest.
    release.notify_one();
    done.insert(0, first.await.unwrap());
    let mut sums = Vec::new();
    for (r, s) in done {
        let s = s.unwrap();
        for (i, w) in want.iter().enumerate() {
            assert!(r.segment_bytes(i).unwrap() == *w, "segment {i} differs");
        }
        sums.push(s);
    }
    // A late joiner catches up from whoever holds the chunks.
    let mut o = opts();
    o.stripes = stripes;
    let mut late = Receiver::join(disc.clone(), Some("w"), o).await.unwrap();
    let s = late.run().await.unwrap();
    assert_eq!(late.segment_bytes(0).unwrap(), want[0]);
    assert_eq!(s.refetched_chunks, 0);
    late.write_to(&dir.path().join("out")).unwrap();
    assert_eq!(
        std::fs::read(dir.path().join("out/b.bin")).unwrap(),
        want[1]
    );
    (sums, first_id)
}

/// The chain (one stripe): the first relay corrupts chunk 2, and the second, whose parent it
/// is, must catch it; the third, the second's child, never sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receivers_relay_verify_and_route_around_a_corrupting_relay() {
    let (sums, first_id) = three_with_a_corrupting_first(1, 2).await;
    let total: u64 = (3 << 20) + (1 << 20) + 4097;
    // The first receiver re-fetched its own corrupted chunk at rest; the second found the
    // mismatch in what the first served when it fetched it (not at rest: a receiver that took
    // a fetched chunk as verified without checking it would relay it onward before that),
    // fetched it again from the source, and reported and gave up the first.
    assert_eq!(sums[0].at_rest_mismatches, 1, "{:?}", sums[0]);
    assert_eq!(sums[0].fetch_mismatches, 0, "{:?}", sums[0]);
    assert_eq!(sums[1].fetch_mismatches, 1, "{:?}", sums[1]);
    assert_eq!(sums[1].at_rest_mismatches, 0, "{:?}", sums[1]);
    assert_eq!(sums[1].corrupt_holders, [first_id], "{:?}", sums[1]);
    assert!(sums[1].bytes_from_source >= 256 << 10, "{:?}", sums[1]);
    // The third never saw a corrupt chunk: its parent only ever advertised verified ones.
    assert_eq!(sums[2].refetched_chunks, 0, "{:?}", sums[2]);
    // Relaying: the later receivers took (nearly) everything from relays.
    assert_eq!(sums[0].bytes_from_source, total + 256 * 1024);
    assert!(sums[2].bytes_from_relays >= total, "{:?}", sums[2]);
}

/// Two stripes (groups {first, third} and {second}): the first is the root of stripe 0 and
/// the third its child there, the second a leaf under the third. The first corrupts chunk 2
/// (stripe 0): the third catches it as it fetches it, fetches it again from the source,
/// reports the first and moves it to the edge (becoming stripe 0's root itself); the second,
/// which takes stripe 0 from the third, never sees a corrupt chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn striped_receivers_catch_a_corrupting_relay_in_its_stripe_and_its_grandchild_never_sees_it()
{
    let (sums, first_id) = three_with_a_corrupting_first(2, 2).await;
    let total: u64 = (3 << 20) + (1 << 20) + 4097;
    assert_eq!(sums[0].at_rest_mismatches, 1, "{:?}", sums[0]);
    assert_eq!(sums[0].fetch_mismatches, 0, "{:?}", sums[0]);
    assert_eq!(sums[2].fetch_mismatches, 1, "{:?}", sums[2]);
    assert_eq!(sums[2].at_rest_mismatches, 0, "{:?}", sums[2]);
    assert_eq!(sums[2].corrupt_holders, [first_id], "{:?}", sums[2]);
    assert!(sums[2].bytes_from_source >= 256 << 10, "{:?}", sums[2]);
    assert_eq!(sums[1].refetched_chunks, 0, "{:?}", sums[1]);
    // Striped: each took part from the source (its own root stripe, or a re-fetch) and part
    // from relays, and the source sent about one payload to the three together.
    for s in &sums[1..] {
        assert!(s.bytes_from_relays > 0, "{s:?}");
    }
    let egress: u64 = sums.iter().map(|s| s.bytes_from_source).sum();
    assert!(
        egress <= total + (3 << 20),
        "the source sent {egress} for {total}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_source_is_refused_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (paths, _) = files(dir.path());
    let src = source(&paths).await;
    let addr = src.ctl_addr();
    let disc = Arc::new(Embedded::new(addr));
    let mut o = opts();
    // Fetch a few chunks, then fetch nothing more until the source has restarted (the hold is
    // never released: the restart ends the pull).
    o.window = 1;
    let mut r = Receiver::join(disc.clone(), Some("w"), o).await.unwrap();
    r.set_test_hooks(TestHooks {
        hold_after: Some((3, Arc::new(tokio::sync::Notify::new()))),
        ..Default::default()
    });
    let mut progress = r.progress();
    let run = tokio::spawn(async move { r.run().await });
    progress
        .wait_for(|s| s.bytes >= 3 * (256 << 10))
        .await
        .unwrap();
    // Once drop returns, the control listener is closed, so its address binds again at once.
    drop(src);
    // The same control address, a new engine and so a new epoch.
    let m = Manifest::build("w", 1, &paths, 256 << 10).unwrap();
    let _again = Source::start(
        m,
        &paths,
        SourceOptions {
            listen: addr,
            data_plane: DataPlane::Tcp,
            ..Default::default()
        },
        None,
    )
    .await
    .unwrap();
    match run.await.unwrap() {
        Err(e @ BroadcastError::SourceRestarted { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("restarted") && msg.contains("refusing to mix"),
                "{msg}"
            );
        }
        other => panic!("expected SourceRestarted, got {other:?}"),
    }
}

/// Asks the control service at `addr` how many of `chunks` chunks the member advertises (its
/// prefix, and each stripe's prefix), waiting up to `wait_ms` for it to verify more than
/// `after`.
async fn advertised(addr: &str, after: u64, wait_ms: u64, chunks: u64) -> u64 {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{{\"op\":\"progress\",\"after\":{after},\"after_count\":{after},\"wait_ms\":{wait_ms}}}\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut line = String::new();
    tokio::io::BufReader::new(s)
        .read_line(&mut line)
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    let prefix = v["prefix"].as_u64().unwrap();
    let stripes: Vec<u64> = v["stripes"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
        .unwrap_or_default();
    let d = stripes.len() as u64;
    (0..chunks)
        .filter(|&c| c < prefix || (d > 0 && c / d < stripes[(c % d) as usize]))
        .count() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_never_advertises_a_chunk_it_has_not_verified() {
    never_advertises_unverified(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_striped_relay_never_advertises_a_chunk_it_has_not_verified() {
    never_advertises_unverified(2).await;
}

/// A relay and its child pulling with `stripes` (with 2, the relay is the root of stripe 0
/// and the child's parent there).
async fn never_advertises_unverified(stripes: usize) {
    let dir = tempfile::tempdir().unwrap();
    let (paths, want) = files(dir.path());
    let src = source(&paths).await;
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    // The relay fetches one chunk at a time and holds after 5 verified, until released.
    let k = 5u64;
    let release = Arc::new(tokio::sync::Notify::new());
    let mut o = opts();
    o.window = 1;
    o.stripes = stripes;
    o.stall_after = Duration::from_secs(60);
    let mut relay = Receiver::join(disc.clone(), Some("w"), o).await.unwrap();
    relay.set_test_hooks(TestHooks {
        hold_after: Some((k, release.clone())),
        ..Default::default()
    });
    let relay_ctl = relay.member().ctl_addr.clone();
    let mut relay_progress = relay.progress();
    let mut o = opts();
    o.stripes = stripes;
    o.stall_after = Duration::from_secs(60);
    let mut child = Receiver::join(disc.clone(), Some("w"), o).await.unwrap();
    let relay_task = tokio::spawn(async move {
        let s = relay.run().await;
        relay.linger(Duration::from_secs(10)).await;
        (relay, s)
    });
    let child_task = tokio::spawn(async move { (child.run().await, child) });
    relay_progress.wait_for(|s| s.chunks >= k).await.unwrap();
    // Held with exactly k verified: what it advertises, now and while it waits, is at most k
    // (a long poll past k is answered only if the prefix passes k).
    assert_eq!(relay_progress.borrow().chunks, k);
    let chunks = src.manifest().chunks.len() as u64;
    let ad = advertised(&relay_ctl, k, 300, chunks).await;
    assert!(ad <= k, "advertises {ad} chunks with {k} verified");
    assert_eq!(relay_progress.borrow().chunks, k, "the relay was held");
    // While it runs on, every answer is at most what its snapshot says it verified (the
    // snapshot is updated before the advertisement).
    release.notify_one();
    let mut after = 0;
    loop {
        let ad = advertised(&relay_ctl, after, 2000, chunks).await;
        let verified = relay_progress.borrow().chunks;
        assert!(
            ad <= verified,
            "advertises {ad} chunks with {verified} verified"
        );
        if ad == chunks {
            break;
        }
        after = ad;
    }
    let (s, _child) = child_task.await.unwrap();
    let s = s.unwrap();
    // The child took everything from the relay and never fetched a chunk that failed its hash
    // (which it would have, had the relay advertised one it had not verified).
    assert_eq!(s.fetch_mismatches, 0, "{s:?}");
    if stripes == 1 {
        assert_eq!(s.bytes_from_source, 0, "{s:?}");
    } else {
        // Stripe 1 from the source (whose root the child is), stripe 0 from the relay.
        assert!(s.bytes_from_relays > 0, "{s:?}");
    }
    let (relay, rs) = relay_task.await.unwrap();
    assert_eq!(rs.unwrap().refetched_chunks, 0);
    assert_eq!(relay.segment_bytes(1).unwrap(), want[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_manifest_expected_is_pulled() {
    let dir = tempfile::tempdir().unwrap();
    let (paths, want) = files(dir.path());
    let src = source(&paths).await;
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    let mut o = opts();
    let other = Digest::of(b"another publisher's manifest");
    o.expect_manifest = Some(other);
    match Receiver::join(disc.clone(), Some("w"), o).await {
        Err(e @ BroadcastError::ManifestDigest { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&other.to_string()), "{msg}");
            assert!(msg.contains(&src.manifest().digest().to_string()), "{msg}");
        }
        other => panic!("expected ManifestDigest, got {other:?}"),
    }
    // Refused before joining: the tracker lists the source alone.
    assert_eq!(src.members().len(), 1);
    let mut o = opts();
    o.expect_manifest = Some(src.manifest().digest());
    let mut r = Receiver::join(disc.clone(), Some("w"), o).await.unwrap();
    r.run().await.unwrap();
    assert_eq!(r.segment_bytes(0).unwrap(), want[0]);
    // A symlink in the output directory is replaced, never written through.
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"keep me").unwrap();
    std::os::unix::fs::symlink(&victim, out.join("a.bin")).unwrap();
    r.write_to(&out).unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
    assert!(
        !std::fs::symlink_metadata(out.join("a.bin"))
            .unwrap()
            .is_symlink()
    );
    assert_eq!(std::fs::read(out.join("a.bin")).unwrap(), want[0]);
    assert_eq!(
        std::fs::read_dir(&out).unwrap().count(),
        2,
        "no partial file left"
    );
}

/// A control service that lists itself as the source and answers `manifest` with `manifest`
/// (raw JSON), whatever it is asked.
async fn hostile_source(manifest: serde_json::Value) -> std::net::SocketAddr {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let manifest = manifest.clone();
            tokio::spawn(async move {
                let (r, mut w) = s.into_split();
                let mut lines = tokio::io::BufReader::new(r).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let req: serde_json::Value = serde_json::from_str(&line).unwrap();
                    let reply = match req["op"].as_str() {
                        Some("members") => {
                            serde_json::json!({"reply": "members", "source_epoch": 1,
                            "members": [{"id": "s", "epoch": 1, "source_epoch": 1,
                                "data_addr": addr.to_string(), "ctl_addr": addr.to_string(),
                                "role": "source", "progress": 0, "done": true, "order": 0, "version": 1}]})
                        }
                        Some("manifest") => {
                            serde_json::json!({"reply": "manifest", "source_epoch": 1, "manifest": manifest})
                        }
                        _ => serde_json::json!({"reply": "ok", "source_epoch": 1}),
                    };
                    let mut out = serde_json::to_vec(&reply).unwrap();
                    out.push(b'\n');
                    if w.write_all(&out).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_declaring_2_pow_48_bytes_is_refused_before_allocation() {
    // A manifest that adds up except for its size: one segment of 2^48 bytes (64 MiB chunks
    // would need 4 Mi chunks; the size is refused before the tiling is looked at).
    let manifest = serde_json::json!({"name": "w", "version": 1, "chunk_size": 64u64 << 20,
        "segments": [{"name": "huge", "len": 1u64 << 48}],
        "entries": [], "chunks": []});
    let addr = hostile_source(manifest).await;
    let disc = Arc::new(Embedded::new(addr));
    match Receiver::join(disc, Some("w"), opts()).await {
        Err(BroadcastError::ManifestFrom {
            addr: from,
            source: ManifestError::TooManyBytes { declared, .. },
        }) => {
            assert_eq!(declared, 1 << 48);
            assert_eq!(from, addr.to_string());
        }
        other => panic!("expected TooManyBytes, got {other:?}"),
    }
    // A receiver's own lower limit is checked as early.
    let m = Manifest::build("w", 1, &files(tempfile::tempdir().unwrap().path()).0, 4096).unwrap();
    let addr = hostile_source(serde_json::to_value(&m).unwrap()).await;
    let mut o = opts();
    o.max_bytes = Some(1 << 20);
    match Receiver::join(Arc::new(Embedded::new(addr)), Some("w"), o).await {
        Err(BroadcastError::ManifestFrom {
            source: ManifestError::TooManyBytes { limit, .. },
            ..
        }) => assert_eq!(limit, 1 << 20),
        other => panic!("expected TooManyBytes, got {other:?}"),
    }
}

//! One source and several receivers in one process over loopback, with embedded discovery:
//! every receiver ends with the published bytes; a relay that corrupts a chunk is caught; a
//! late joiner catches up; a restarted source is refused.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ferry::DataPlane;
use ferry_broadcast::{
    BroadcastError, Embedded, Manifest, Receiver, ReceiverOptions, Source, SourceOptions,
};

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

fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

fn opts() -> ReceiverOptions {
    logs();
    ReceiverOptions {
        data_plane: DataPlane::Tcp,
        stall_after: Duration::from_secs(2),
        heartbeat: Duration::from_millis(100),
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receivers_relay_verify_and_route_around_a_corrupting_relay() {
    let dir = tempfile::tempdir().unwrap();
    let (paths, want) = files(dir.path());
    let src = source(&paths).await;
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    let mut rs = Vec::new();
    let release = Arc::new(tokio::sync::Notify::new());
    for k in 0..3 {
        let mut o = opts();
        if k == 0 {
            // The first relay corrupts chunk 2 after verifying it, and keeps it corrupt until the
            // others are done: the second, whose parent it is, must catch it.
            o.corrupt_after_verify = Some(2);
            o.hold_final_check = Some(release.clone());
        }
        rs.push(Receiver::join(disc.clone(), Some("w"), o).await.unwrap());
    }
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
    // The first receiver re-fetched its own corrupted chunk at rest; the second found the
    // mismatch in what the first served.
    assert!(sums[0].refetched_chunks >= 1, "{:?}", sums[0]);
    assert!(sums[1].refetched_chunks >= 1, "{:?}", sums[1]);
    // Relaying: the later receivers took (nearly) everything from relays.
    let total: u64 = want.iter().map(|w| w.len() as u64).sum();
    assert_eq!(sums[0].bytes_from_source, total + 256 * 1024);
    assert!(sums[2].bytes_from_relays >= total, "{:?}", sums[2]);
    // A late joiner catches up from whoever holds the chunks.
    let mut late = Receiver::join(disc.clone(), Some("w"), opts())
        .await
        .unwrap();
    let s = late.run().await.unwrap();
    assert_eq!(late.segment_bytes(0).unwrap(), want[0]);
    assert_eq!(s.refetched_chunks, 0);
    late.write_to(&dir.path().join("out")).unwrap();
    assert_eq!(
        std::fs::read(dir.path().join("out/b.bin")).unwrap(),
        want[1]
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
    // Fetch a few chunks, then fetch nothing more until the source has restarted (the pause
    // outlasts the test: the restart ends the pull, not the pause).
    o.pause_after = Some((3, Duration::from_secs(3600)));
    o.window = 1;
    let mut r = Receiver::join(disc.clone(), Some("w"), o).await.unwrap();
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

//! Pulls into directories ([`Receiver::join_to_dir`]): chunks are written to temporary files as
//! they are verified, relayed to other receivers from those files, and renamed into place only
//! once the pull completed; a pull that fails, or is dropped, leaves nothing behind; a
//! directory without room is refused before anything moves.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ferry::DataPlane;
use ferry_broadcast::{
    BroadcastError, Embedded, Manifest, Receiver, ReceiverOptions, Source, SourceOptions, TestHooks,
};

const CHUNK: u64 = 256 << 10;

fn payload(len: usize, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect()
}

fn files(dir: &Path) -> (Vec<PathBuf>, Vec<Vec<u8>>) {
    let a = payload(3 << 20, 1);
    let b = payload((1 << 20) + 4097, 2);
    let pa = dir.join("a.bin");
    let pb = dir.join("b.bin");
    std::fs::write(&pa, &a).unwrap();
    std::fs::write(&pb, &b).unwrap();
    (vec![pa, pb], vec![a, b])
}

fn opts() -> ReceiverOptions {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    ReceiverOptions {
        data_plane: DataPlane::Tcp,
        heartbeat: Duration::from_millis(100),
        straggler: 0.0,
        // Nothing here is about stalls: a loaded machine must not make a relay look stalled.
        stall_after: Duration::from_secs(60),
        ..Default::default()
    }
}

async fn source(paths: &[PathBuf]) -> Source {
    let m = Manifest::build("w", 1, paths, CHUNK).unwrap();
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

/// The names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|r| {
            r.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_into_directories_relay_from_their_files_and_rename_them_when_complete() {
    let dir = tempfile::tempdir().unwrap();
    let (paths, want) = files(dir.path());
    let src = source(&paths).await;
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    // A chain (one stripe): the second and third receivers fetch from the one before, which
    // serves what it wrote to its files.
    let mut rs = Vec::new();
    for k in 0..3 {
        let mut o = opts();
        o.stripes = 1;
        let into = dir.path().join(format!("r{k}"));
        let r = Receiver::join_to_dir(disc.clone(), Some("w"), &into, o)
            .await
            .unwrap();
        // Until the pull completes, only hidden temporary files.
        assert!(
            listing(&into).iter().all(|n| n.contains(".ferry-partial.")),
            "{:?}",
            listing(&into)
        );
        rs.push((r, into));
    }
    let mut tasks = Vec::new();
    for (mut r, into) in rs {
        tasks.push(tokio::spawn(async move {
            let s = r.run().await.unwrap();
            r.write_to(&into).unwrap();
            r.linger(Duration::from_secs(10)).await;
            (r, into, s)
        }));
    }
    let mut relayed = 0;
    for t in tasks {
        let (r, into, s) = t.await.unwrap();
        assert_eq!(listing(&into), vec!["a.bin", "b.bin"]);
        for (p, w) in paths.iter().zip(&want) {
            let name = p.file_name().unwrap();
            assert!(std::fs::read(into.join(name)).unwrap() == *w, "{name:?}");
        }
        assert_eq!(r.segment_bytes(1).unwrap(), want[1]);
        relayed += s.bytes_from_relays;
        // Into another directory too: copied from the files, renamed into place.
        let other = into.with_extension("copy");
        r.write_to(&other).unwrap();
        assert_eq!(std::fs::read(other.join("a.bin")).unwrap(), want[0]);
        assert_eq!(listing(&other), vec!["a.bin", "b.bin"]);
        r.leave().await;
    }
    assert!(relayed > 0, "no chunk was relayed from a receiver's files");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_or_dropped_pull_into_a_directory_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (paths, _) = files(dir.path());
    let src = source(&paths).await;
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    // Dropped before it ran: its temporary files go with it.
    let into = dir.path().join("dropped");
    let r = Receiver::join_to_dir(disc.clone(), Some("w"), &into, opts())
        .await
        .unwrap();
    assert_eq!(listing(&into).len(), 2);
    drop(r);
    assert_eq!(listing(&into), Vec::<String>::new());

    // Failed halfway (the source goes away): refused to rename, then nothing left.
    let into = dir.path().join("failed");
    let hold = Arc::new(tokio::sync::Notify::new());
    let mut o = opts();
    o.stall_after = Duration::from_secs(2);
    let mut r = Receiver::join_to_dir(disc.clone(), Some("w"), &into, o)
        .await
        .unwrap();
    r.set_test_hooks(TestHooks {
        hold_after: Some((3, hold.clone())),
        ..Default::default()
    });
    let mut progress = r.progress();
    let run = tokio::spawn(async move {
        let s = r.run().await;
        (r, s)
    });
    progress.wait_for(|s| s.chunks >= 3).await.unwrap();
    drop(src);
    hold.notify_one();
    let (r, s) = run.await.unwrap();
    assert!(s.is_err(), "{s:?}");
    assert!(r.write_to(&into).is_err(), "renamed an incomplete pull");
    assert!(!into.join("a.bin").exists());
    drop(r);
    assert_eq!(listing(&into), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_without_room_is_refused_before_anything_moves() {
    let dir = tempfile::tempdir().unwrap();
    let (paths, _) = files(dir.path());
    let src = source(&paths).await;
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    // /proc has no free blocks.
    let err = Receiver::join_to_dir(disc, Some("w"), Path::new("/proc"), opts())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, BroadcastError::Io { source, .. } if source.kind() == std::io::ErrorKind::StorageFull),
        "{err}"
    );
    assert!(err.to_string().contains("needs"), "{err}");
    assert!(src.members().len() == 1, "it joined: {:?}", src.members());
}

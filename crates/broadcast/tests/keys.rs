//! A keyed broadcast: every control request is authenticated (the engine's challenge-response),
//! a member renews, moves and removes only its own entry, and chunks are served only to key
//! holders. Strangers, impostors and wrong keys are each refused.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ferry::{DataPlane, Keyring, TransferEngine};
use ferry_broadcast::{
    BroadcastError, Discovery, Embedded, Manifest, Member, Receiver, ReceiverOptions, Role, Source,
    SourceOptions,
};

fn keys(byte: u8) -> Keyring {
    Keyring::single("fleet", &[byte; 32]).unwrap()
}

fn files(dir: &std::path::Path) -> (Vec<PathBuf>, Vec<u8>) {
    let a: Vec<u8> = (0..(2 << 20) + 77)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    let pa = dir.join("a.bin");
    std::fs::write(&pa, &a).unwrap();
    (vec![pa], a)
}

fn opts(k: Option<Keyring>) -> ReceiverOptions {
    ReceiverOptions {
        data_plane: DataPlane::Tcp,
        heartbeat: Duration::from_millis(100),
        keys: k,
        ..Default::default()
    }
}

async fn keyed_source(paths: &[PathBuf]) -> Source {
    let m = Manifest::build("w", 1, paths, 256 << 10).unwrap();
    Source::start(
        m,
        paths,
        SourceOptions {
            data_plane: DataPlane::Tcp,
            keys: Some(keys(7)),
            ..Default::default()
        },
        None,
    )
    .await
    .unwrap()
}

/// Sends one raw request line to `addr` and returns the answer.
async fn raw(addr: &str, line: &str) -> serde_json::Value {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("{line}\n").as_bytes()).await.unwrap();
    let mut out = String::new();
    tokio::io::BufReader::new(s)
        .read_line(&mut out)
        .await
        .unwrap();
    serde_json::from_str(&out).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_key_members_pull_and_without_it_nothing_is_answered() {
    let dir = tempfile::tempdir().unwrap();
    let (paths, want) = files(dir.path());
    let src = keyed_source(&paths).await;
    let ctl = src.ctl_addr();

    // No key, a wrong key: refused with a clear error before anything is listed.
    let plain = Arc::new(Embedded::new(ctl));
    let e = Receiver::join(plain, Some("w"), opts(None))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("unauthenticated"), "{e}");
    let wrong = Arc::new(Embedded::with_keys(ctl, keys(8)));
    let e = Receiver::join(wrong, Some("w"), opts(Some(keys(8))))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("could not prove"), "{e}");
    assert_eq!(src.members().len(), 1, "nothing listed");

    // With it: two members pull, the second from the first.
    let disc = Arc::new(Embedded::with_keys(ctl, keys(7)));
    let mut a = Receiver::join(disc.clone(), Some("w"), opts(Some(keys(7))))
        .await
        .unwrap();
    let mut b = Receiver::join(disc.clone(), Some("w"), opts(Some(keys(7))))
        .await
        .unwrap();
    let a_member = a.member().clone();
    let ta = tokio::spawn(async move {
        let s = a.run().await;
        a.linger(Duration::from_secs(10)).await;
        (a, s)
    });
    let sb = b.run().await.unwrap();
    let (a, sa) = ta.await.unwrap();
    sa.unwrap();
    assert_eq!(b.segment_bytes(0).unwrap(), want);
    assert!(sb.bytes_from_relays > 0, "{sb:?}");

    // A stranger (no key) is answered nothing, by the source or by a receiver: no join, no
    // heartbeat as a member, no leave of one, no list, no manifest, no progress.
    let victim = serde_json::to_string(&a_member).unwrap();
    for req in [
        format!(r#"{{"op":"join","member":{victim}}}"#),
        format!(r#"{{"op":"heartbeat","member":{victim}}}"#),
        format!(r#"{{"op":"leave","id":"{}"}}"#, a_member.id),
        r#"{"op":"members"}"#.to_owned(),
        r#"{"op":"manifest"}"#.to_owned(),
    ] {
        let r = raw(&ctl.to_string(), &req).await;
        assert_eq!(r["reply"], "error", "{req}: {r}");
        assert!(
            r["message"].as_str().unwrap().contains("unauthenticated"),
            "{r}"
        );
    }
    let r = raw(
        &a_member.ctl_addr,
        r#"{"op":"progress","after":0,"wait_ms":0}"#,
    )
    .await;
    assert_eq!(r["reply"], "error", "{r}");
    assert!(src.members().iter().any(|m| m.id == a_member.id));

    // A key holder cannot act as another member: heartbeat under its id (moving its
    // address), join again as it, make it leave, or join as the source.
    let other = Embedded::with_keys(ctl, keys(7));
    let mut moved = a_member.clone();
    moved.data_addr = "10.9.9.9:1".into();
    assert!(other.update(&moved).await.is_err());
    assert!(other.register(&moved).await.is_err());
    assert!(other.deregister(&a_member.id).await.is_err());
    let mut fake_source: Member = a_member.clone();
    fake_source.id = "impostor".into();
    fake_source.role = Role::Source;
    assert!(other.register(&fake_source).await.is_err());
    let listed = src.members();
    let entry = listed.iter().find(|m| m.id == a_member.id).unwrap();
    assert_eq!(entry.data_addr, a_member.data_addr);
    assert!(!listed.iter().any(|m| m.id == "impostor"));

    // Chunks are served only to key holders: a keyless engine sees no segment of a receiver.
    let stranger = TransferEngine::builder()
        .data_plane(DataPlane::Tcp)
        .build()
        .unwrap();
    if let Ok(peer) = stranger.connect(a_member.data_addr.as_str()).await {
        assert!(peer.segment("a.bin").is_err(), "a stranger sees a segment");
    }
    stranger.shutdown();

    // The member itself leaves.
    a.leave().await;
    assert!(!src.members().iter().any(|m| m.id == a_member.id));
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_receiver_refuses_a_source_that_cannot_prove_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let (paths, _) = files(dir.path());
    let m = Manifest::build("w", 1, &paths, 256 << 10).unwrap();
    let open = Source::start(
        m,
        &paths,
        SourceOptions {
            data_plane: DataPlane::Tcp,
            ..Default::default()
        },
        None,
    )
    .await
    .unwrap();
    let disc = Arc::new(Embedded::with_keys(open.ctl_addr(), keys(7)));
    match Receiver::join(disc, Some("w"), opts(Some(keys(7)))).await {
        Err(e @ BroadcastError::Control { .. }) => {
            assert!(e.to_string().contains("takes no key"), "{e}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

//! Whom a discovery list vouches for (issue 40): a list anyone may write (etcd, or a backend
//! that does not say) is refused without keys or an expected digest, before it is read; a
//! member record whose data plane is served by another peer than it names is refused, and
//! that server serves nothing. And an explicit data plane leaves the same-host plane off.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ferry::DataPlane;
use ferry_broadcast::discovery::BoxFuture;
use ferry_broadcast::{
    BroadcastError, Discovery, Embedded, Manifest, Member, Receiver, ReceiverOptions, Source,
    SourceOptions,
};

fn payload(len: usize, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect()
}

fn file(dir: &std::path::Path) -> (PathBuf, Vec<u8>) {
    let want = payload((2 << 20) + 333, 7);
    let path = dir.join("w.bin");
    std::fs::write(&path, &want).unwrap();
    (path, want)
}

fn opts() -> ReceiverOptions {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    ReceiverOptions {
        data_plane: DataPlane::Tcp,
        stall_after: Duration::from_secs(2),
        heartbeat: Duration::from_millis(100),
        ..Default::default()
    }
}

async fn source(path: &PathBuf, plane: DataPlane) -> Source {
    let m = Manifest::build("w", 1, std::slice::from_ref(path), 256 << 10).unwrap();
    Source::start(
        m,
        std::slice::from_ref(path),
        SourceOptions {
            data_plane: plane,
            ..Default::default()
        },
        None,
    )
    .await
    .unwrap()
}

/// The embedded list of a source, as a backend that does not say whom it vouches for (so, as
/// open as etcd), with the data address of the member `rewrite.0` rewritten to `rewrite.1`
/// where given (a record pointing at someone else's server), and the records `first` listed
/// before its own (another source's: a stranger's, or one left by an earlier publisher, as
/// anyone who may write an open list can arrange). Counts the reads of the list.
#[derive(Debug)]
struct Rewritten {
    inner: Embedded,
    rewrite: Option<(String, String)>,
    /// The member whose record's server identity is replaced, and the identity put there.
    identity: Option<(String, String)>,
    first: Vec<Member>,
    reads: AtomicU64,
}

impl Rewritten {
    fn new(inner: Embedded) -> Self {
        Self {
            inner,
            rewrite: None,
            identity: None,
            first: Vec::new(),
            reads: AtomicU64::new(0),
        }
    }
}

impl Discovery for Rewritten {
    fn register<'a>(
        &'a self,
        me: &'a Member,
    ) -> BoxFuture<'a, Result<Option<u64>, BroadcastError>> {
        self.inner.register(me)
    }

    fn update<'a>(&'a self, me: &'a Member) -> BoxFuture<'a, Result<Option<u64>, BroadcastError>> {
        self.inner.update(me)
    }

    fn members(&self) -> BoxFuture<'_, Result<Vec<Member>, BroadcastError>> {
        Box::pin(async move {
            self.reads.fetch_add(1, Ordering::Relaxed);
            let mut v = self.first.clone();
            v.extend(self.inner.members().await?);
            if let Some((id, addr)) = &self.rewrite {
                for m in v.iter_mut().filter(|m| m.id == *id) {
                    m.data_addr = addr.clone();
                }
            }
            if let Some((id, identity)) = &self.identity {
                for m in v.iter_mut().filter(|m| m.id == *id) {
                    m.identity = Some(identity.clone());
                }
            }
            Ok(v)
        })
    }

    fn deregister<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), BroadcastError>> {
        self.inner.deregister(id)
    }

    fn describe(&self) -> String {
        format!("rewritten {}", self.inner.describe())
    }
}

fn served_bytes(src: &Source) -> u64 {
    src.engine()
        .describe()
        .served
        .map_or(0, |s| s.accepted.iter().map(|t| t.bytes).sum())
}

/// An open list, neither keys nor a digest: refused naming both ways to bind the manifest,
/// before the list is read; with the digest the same list is pulled from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_list_without_keys_or_a_digest_is_refused_before_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let (path, want) = file(dir.path());
    let src = source(&path, DataPlane::Tcp).await;
    let disc = Arc::new(Rewritten::new(Embedded::new(src.ctl_addr())));
    match Receiver::join(disc.clone(), Some("w"), opts()).await {
        Err(e @ BroadcastError::UnboundSource { .. }) => {
            let msg = e.to_string();
            for named in ["rewritten embedded", "--expect-manifest", "--auth-key-file"] {
                assert!(msg.contains(named), "{named:?} not in: {msg}");
            }
        }
        other => panic!("expected UnboundSource, got {other:?}"),
    }
    assert_eq!(disc.reads.load(Ordering::Relaxed), 0, "the list was read");
    assert_eq!(src.members().len(), 1, "refused before joining");
    let mut o = opts();
    o.expect_manifest = Some(src.manifest().digest());
    let mut r = Receiver::join(disc, Some("w"), o).await.unwrap();
    r.run().await.unwrap();
    assert_eq!(r.segment_bytes(0).unwrap(), want);
}

/// A relay's record names its id and epoch, and its own control service (which advertises
/// what it verified), but lists the data address of another server: a mirror publishing the
/// very same manifest and segment names, which the digest cannot tell apart. The handshake
/// there answers another peer, so the relay is given up and the source serves the chunks
/// instead; the mirror serves nothing. (Before, the relay's chunks were read from the
/// mirror.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_pointing_at_another_server_is_refused_and_that_server_serves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (path, want) = file(dir.path());
    let src = source(&path, DataPlane::Tcp).await;
    let mirror = source(&path, DataPlane::Tcp).await;
    assert_eq!(src.manifest().digest(), mirror.manifest().digest());
    // A chain: the second receiver's parent is the first.
    let chain = || ReceiverOptions {
        stripes: 1,
        straggler: 0.0,
        expect_manifest: Some(src.manifest().digest()),
        ..opts()
    };
    let mut first = Receiver::join(Arc::new(Embedded::new(src.ctl_addr())), Some("w"), chain())
        .await
        .unwrap();
    first.run().await.unwrap();
    let from_source = served_bytes(&src);
    let disc = Arc::new(Rewritten {
        rewrite: Some((
            first.member().id.clone(),
            mirror.data_addr().unwrap().to_string(),
        )),
        ..Rewritten::new(Embedded::new(src.ctl_addr()))
    });
    let mut second = Receiver::join(disc, Some("w"), chain()).await.unwrap();
    let sum = second.run().await.unwrap();
    assert_eq!(second.segment_bytes(0).unwrap(), want);
    assert_eq!(served_bytes(&mirror), 0, "the other server served chunks");
    assert!(!sum.holders.contains(&first.member().id), "{sum:?}");
    assert_eq!(sum.bytes_from_relays, 0, "{sum:?}");
    assert!(served_bytes(&src) >= from_source + want.len() as u64);
    first.leave().await;
    second.leave().await;
}

/// Keyed, a member record names the server identity its engine proves (issue 46, S3): a
/// record whose identity is another's (the source's) gets its relay refused at the handshake,
/// though the server there holds the broadcast's key and is the incarnation the record names;
/// the chunks come from the source, and that relay serves nothing. Untouched, the same chain
/// reads from the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_record_naming_another_server_identity_is_refused_at_the_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let (path, want) = file(dir.path());
    let key = || ferry::Keyring::parse("w 000102030405060708090a0b0c0d0e0f").unwrap();
    let m = Manifest::build("w", 1, std::slice::from_ref(&path), 256 << 10).unwrap();
    let src = Source::start(
        m,
        std::slice::from_ref(&path),
        SourceOptions {
            data_plane: DataPlane::Tcp,
            keys: Some(key()),
            ..Default::default()
        },
        None,
    )
    .await
    .unwrap();
    let chain = || ReceiverOptions {
        stripes: 1,
        straggler: 0.0,
        keys: Some(key()),
        ..opts()
    };
    let mut first = Receiver::join(
        Arc::new(Embedded::with_keys(src.ctl_addr(), key())),
        Some("w"),
        chain(),
    )
    .await
    .unwrap();
    first.run().await.unwrap();
    let relay_served = |r: &Receiver| {
        r.engine()
            .describe()
            .served
            .map_or(0, |s| s.accepted.iter().map(|t| t.bytes).sum::<u64>())
    };
    assert_eq!(
        first.member().identity,
        Some(first.engine().server_identity().to_string())
    );
    let disc = Arc::new(Rewritten {
        identity: Some((
            first.member().id.clone(),
            src.engine().server_identity().to_string(),
        )),
        ..Rewritten::new(Embedded::with_keys(src.ctl_addr(), key()))
    });
    let mut second = Receiver::join(disc, Some("w"), chain()).await.unwrap();
    let sum = second.run().await.unwrap();
    assert_eq!(second.segment_bytes(0).unwrap(), want);
    assert!(!sum.holders.contains(&first.member().id), "{sum:?}");
    assert_eq!(sum.bytes_from_relays, 0, "{sum:?}");
    assert_eq!(relay_served(&first), 0, "the relay served chunks");
    // The record as it is: the next receiver reads from the relay.
    let mut third = Receiver::join(
        Arc::new(Embedded::with_keys(src.ctl_addr(), key())),
        Some("w"),
        chain(),
    )
    .await
    .unwrap();
    let sum = third.run().await.unwrap();
    assert_eq!(third.segment_bytes(0).unwrap(), want);
    assert!(sum.bytes_from_relays > 0, "{sum:?}");
    first.leave().await;
    second.leave().await;
    third.leave().await;
}

/// `DataPlane::Tcp` (as `--transport tcp`): the source's and the receiver's engines have no
/// same-host plane, and every route the receiver took is TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_explicit_data_plane_leaves_the_same_host_plane_off() {
    let dir = tempfile::tempdir().unwrap();
    let (path, want) = file(dir.path());
    let src = source(&path, DataPlane::Tcp).await;
    let same_host = src.engine().describe().same_host;
    assert!(same_host.starts_with("off"), "source: {same_host}");
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    let mut r = Receiver::join(disc, Some("w"), opts()).await.unwrap();
    r.run().await.unwrap();
    assert_eq!(r.segment_bytes(0).unwrap(), want);
    let d = r.engine().describe();
    assert!(d.same_host.starts_with("off"), "receiver: {}", d.same_host);
    assert!(!d.routes.is_empty());
    for route in &d.routes {
        assert_eq!(route.transport, "tcp", "{route:?}");
    }
}

/// A source record listed before the wanted source's, whose source answers another manifest
/// than the one expected, is passed over: the pull takes the next source record and lands the
/// wanted bytes; with only that record listed, its refusal (the digest) is the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_source_record_gives_way_to_the_next_one() {
    let dir = tempfile::tempdir().unwrap();
    let (path, want) = file(dir.path());
    let src = source(&path, DataPlane::Tcp).await;
    let other_dir = tempfile::tempdir().unwrap();
    let other_path = other_dir.path().join("w.bin");
    std::fs::write(&other_path, payload(1 << 20, 99)).unwrap();
    let decoy = source(&other_path, DataPlane::Tcp).await;
    assert_ne!(decoy.manifest().digest(), src.manifest().digest());
    let mut o = opts();
    o.expect_manifest = Some(src.manifest().digest());

    let only_decoy = Arc::new(Rewritten::new(Embedded::new(decoy.ctl_addr())));
    match Receiver::join(only_decoy, Some("w"), o.clone()).await {
        Err(BroadcastError::ManifestDigest { .. }) => {}
        other => panic!("expected the decoy's digest refused, got {other:?}"),
    }

    let disc = Arc::new(Rewritten {
        first: decoy.members(),
        ..Rewritten::new(Embedded::new(src.ctl_addr()))
    });
    let mut r = Receiver::join(disc, Some("w"), o).await.unwrap();
    r.run().await.unwrap();
    assert_eq!(r.segment_bytes(0).unwrap(), want);
    assert_eq!(served_bytes(&decoy), 0, "the decoy served bytes");
}

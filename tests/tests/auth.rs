//! Authenticated peers, end to end over loopback, on both portable data planes (the io_uring
//! cases skip, saying why, where the kernel refuses io_uring; `FERRY_REQUIRE_URING=1` fails them
//! instead): a peer without the key learns no segment name and moves no byte, a wrong key is a
//! clear error on both sides, a stranger cannot attach a data stream (no proof, a forged one, a
//! replayed one), and a segment published to named peers is invisible and unreachable to the
//! others.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use ferry::core_types::auth::{ClientAuth, Keyring};
use ferry::core_types::wire::{
    AuthAttach, ControlFrame, DATA_REQUEST_LEN, DataRequest, Hello, SUPPORTED_VERSIONS,
    StreamAttach, TransportOffer,
};
use ferry::{
    Access, Batch, DataPlane, Epoch, Error, FailureKind, MemoryRegion, OpKind, PeerId,
    RemoteEffect, RemoteStatus, SegmentDesc, TransferEngine,
};
use ferry_tests::{URING, require_or_skip};

const ALICE: &str = "alice 000102030405060708090a0b0c0d0e0f";
const ALICE_WRONG: &str = "alice f00102030405060708090a0b0c0d0e0f";
const BOB: &str = "bob 101112131415161718191a1b1c1d1e1f";
const LEN: usize = 64 << 10;

fn keyring(text: &str) -> Keyring {
    Keyring::parse(text).expect("test keyring")
}

/// The planes to run: TCP always, io_uring where the kernel allows it (else the skip is said).
fn planes() -> Vec<DataPlane> {
    #[cfg_attr(not(feature = "uring"), allow(unused_mut))]
    let mut v = vec![DataPlane::Tcp];
    #[cfg(feature = "uring")]
    match ferry::probe_kernel().unusable_reason() {
        None => v.push(DataPlane::Uring),
        Some(why) => require_or_skip(URING, format!("io_uring unusable here: {why}")),
    }
    #[cfg(not(feature = "uring"))]
    require_or_skip(URING, "built without the uring feature");
    v
}

/// A server on `plane` with keys `keys` (or none), publishing `open` to everyone and `secret`
/// to bob only (where it has keys), both filled with 0x5a.
struct Server {
    engine: TransferEngine,
    open: ferry::Registration,
    secret: Option<ferry::Registration>,
}

impl Server {
    fn start(plane: DataPlane, keys: Option<&str>) -> Result<Self> {
        Self::start_with(plane, keys, |b| b)
    }

    fn start_with(
        plane: DataPlane,
        keys: Option<&str>,
        tune: impl FnOnce(ferry::EngineBuilder) -> ferry::EngineBuilder,
    ) -> Result<Self> {
        let mut b = tune(
            TransferEngine::builder()
                .same_host(false)
                .listen("127.0.0.1:0".parse()?)
                .data_plane(plane)
                .streams(2)
                .no_auth(),
        );
        if let Some(k) = keys {
            b = b.auth_keyring(keyring(k));
        }
        let engine = b.build()?;
        let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
        let region = || -> Result<MemoryRegion> {
            let r = MemoryRegion::alloc_zeroed(LEN, 4096)?;
            r.write_at(0, &vec![0x5a; LEN])?;
            Ok(r)
        };
        let open = engine.register(region()?, rw, "open")?;
        let secret = match keys {
            Some(_) => Some(engine.register_to(region()?, rw, "secret", &["bob"])?),
            None => None,
        };
        Ok(Self {
            engine,
            open,
            secret,
        })
    }

    fn addr(&self) -> SocketAddr {
        self.engine.local_addr().expect("listening")
    }

    fn untouched(&self, reg: &ferry::Registration) -> Result<bool> {
        let mut buf = vec![0u8; LEN];
        reg.region().read_at(0, &mut buf)?;
        Ok(buf.iter().all(|&b| b == 0x5a))
    }
}

fn client(plane: DataPlane, keys: Option<&str>) -> Result<TransferEngine> {
    let b = TransferEngine::builder()
        .same_host(false)
        .data_plane(plane)
        .streams(2)
        .no_auth();
    Ok(match keys {
        Some(k) => b.auth_keyring(keyring(k)),
        None => b,
    }
    .build()?)
}

fn local(engine: &TransferEngine, fill: u8) -> Result<ferry::Registration> {
    let r = MemoryRegion::alloc_zeroed(LEN, 4096)?;
    r.write_at(0, &vec![fill; LEN])?;
    Ok(engine.register(r, Access::LOCAL, "local")?)
}

// ---------------------------------------------------------------- raw frames, as a stranger

fn send(s: &mut TcpStream, f: &ControlFrame) -> Result<()> {
    let mut buf = Vec::new();
    f.encode(1, &mut buf)?;
    s.write_all(&buf)?;
    Ok(())
}

fn recv(s: &mut TcpStream) -> Result<ControlFrame> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some((f, _)) = ControlFrame::decode(&buf)? {
            return Ok(f);
        }
        let n = match s.read(&mut chunk) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => r?,
        };
        if n == 0 {
            bail!("closed before a whole frame ({} bytes)", buf.len());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn stranger(addr: SocketAddr) -> Result<TcpStream> {
    let s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    Ok(s)
}

/// Attaches a data stream with `frame` and, if the server accepts it, sends a WRITE of 0xee
/// over all of segment `token`. Returns the server's answer to the attach.
fn attach_and_write(addr: SocketAddr, frame: ControlFrame, token: u64) -> Result<ControlFrame> {
    let mut s = stranger(addr)?;
    send(&mut s, &frame)?;
    let answer = recv(&mut s)?;
    let mut head = [0u8; DATA_REQUEST_LEN];
    DataRequest {
        kind: OpKind::Write,
        seq: 0,
        token: ferry::SegmentToken(token),
        offset: 0,
        len: LEN as u64,
        ack_slack: 0,
    }
    .encode(&mut head);
    // Whatever the server said, try: a refused stream must not take the bytes.
    let _ = s.write_all(&head);
    let _ = s.write_all(&vec![0xee; LEN]);
    let mut rest = [0u8; 16];
    let _ = s.read(&mut rest);
    Ok(answer)
}

fn plain_hello() -> Hello {
    Hello {
        versions: SUPPORTED_VERSIONS,
        peer_id: PeerId::random(),
        epoch: Epoch::fresh(),
        transports: vec![TransportOffer::Tcp {
            streams: 1,
            port: 0,
        }],
        segments: vec![],
    }
}

fn is_refusal(f: &ControlFrame) -> bool {
    matches!(f, ControlFrame::Reject(_))
}

// ---------------------------------------------------------------- the cases

/// A peer without the key: the engine's connect is refused with "authentication required"; a
/// raw hello gets a refusal that lists nothing; a raw data stream (right epoch, a token that
/// leaked) is refused, and the segment keeps its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_the_key_learns_no_name_and_moves_no_byte() -> Result<()> {
    for plane in planes() {
        let server = Server::start(plane, Some(ALICE))?;
        let e = client(plane, None)?
            .connect(server.addr())
            .await
            .err()
            .context("a keyless client connected")?;
        assert!(
            matches!(&e, Error::HandshakeRefused { reason, .. } if reason.contains("authentication required")),
            "{plane:?}: {e}"
        );
        let mut s = stranger(server.addr())?;
        send(&mut s, &ControlFrame::Hello(plain_hello()))?;
        let ControlFrame::Reject(r) = recv(&mut s)? else {
            bail!("{plane:?}: a plain hello was answered with something else than a refusal")
        };
        assert!(!r.message.contains("open") && !r.message.contains("secret"));
        // The refusal names the server's epoch (as a stale-epoch refusal would): enough to
        // forge a plain attach, which must be refused anyway.
        let attach = StreamAttach {
            peer_id: PeerId::random(),
            epoch: Epoch::fresh(),
            server_epoch: r.epoch,
            transport: 1,
            stream_index: 0,
        };
        let token = server.open.token().0;
        let answer = attach_and_write(server.addr(), ControlFrame::StreamAttach(attach), token)?;
        assert!(is_refusal(&answer), "{plane:?}: {answer:?}");
        assert!(server.untouched(&server.open)?, "{plane:?}: bytes moved");
    }
    Ok(())
}

/// A wrong key under a known name: the client says the server could not prove the key; a
/// client that skips that check and sends a forged proof is refused by the server. A client
/// with a key meets a keyless server: a clear error too, and a keyless client meets it as ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_or_a_one_sided_key_is_a_clear_error() -> Result<()> {
    for plane in planes() {
        let server = Server::start(plane, Some(ALICE))?;
        let e = client(plane, Some(ALICE_WRONG))?
            .connect(server.addr())
            .await
            .err()
            .context("a wrong key connected")?;
        assert!(
            matches!(&e, Error::Authentication { reason, .. } if reason.contains("could not prove")),
            "{plane:?}: {e}"
        );
        let e = client(plane, Some(BOB))?
            .connect(server.addr())
            .await
            .err()
            .context("an unknown key name connected")?;
        assert!(
            matches!(&e, Error::Authentication { reason, .. } if reason.contains("not in this server's keyring")),
            "{plane:?}: {e}"
        );
        // The server's side: a forged proof.
        let mut s = stranger(server.addr())?;
        let hello = plain_hello();
        let (first, _) =
            ClientAuth::start(&keyring(ALICE_WRONG), hello.peer_id, hello.epoch, [7; 32]);
        send(&mut s, &first)?;
        let ControlFrame::AuthChallenge(_) = recv(&mut s)? else {
            bail!("no challenge")
        };
        send(
            &mut s,
            &ControlFrame::AuthProof(ferry::core_types::wire::AuthProof { mac: [0; 32] }),
        )?;
        send(&mut s, &ControlFrame::Hello(hello))?;
        let answer = recv(&mut s)?;
        assert!(
            matches!(&answer, ControlFrame::Reject(r) if r.message.contains("does not match")),
            "{plane:?}: {answer:?}"
        );

        let keyless = Server::start(plane, None)?;
        let e = client(plane, Some(ALICE))?
            .connect(keyless.addr())
            .await
            .err()
            .context("a keyed client accepted a keyless server")?;
        assert!(
            matches!(&e, Error::Authentication { reason, .. } if reason.contains("no authentication key")),
            "{plane:?}: {e}"
        );
        client(plane, None)?.connect(keyless.addr()).await?;
    }
    Ok(())
}

/// With the key, bytes move both ways on both planes, and a data stream is bound to its
/// session: a stranger who replays the client's attach, or forges one for a session it saw,
/// is refused and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_key_bytes_move_and_streams_are_bound_to_the_session() -> Result<()> {
    for plane in planes() {
        let server = Server::start(plane, Some(&format!("{ALICE}\n{BOB}")))?;
        let engine = client(plane, Some(ALICE))?;
        let peer = engine.connect(server.addr()).await?;
        let open = peer.segment("open")?;
        let src = local(&engine, 0x11)?;
        let o = engine
            .submit(Batch::new().write(&src, 0, &open, 0, LEN as u64))?
            .await;
        assert!(o.is_success(), "{plane:?}: {o:?}");
        let back = local(&engine, 0)?;
        let o = engine
            .submit(Batch::new().read(&back, 0, &open, 0, LEN as u64))?
            .await;
        assert!(o.is_success(), "{plane:?}: {o:?}");
        let mut got = vec![0u8; LEN];
        back.region().read_at(0, &mut got)?;
        assert!(got.iter().all(|&b| b == 0x11), "{plane:?}: wrong bytes");
        server.open.region().write_at(0, &vec![0x5a; LEN])?;

        // A session of our own, to replay and forge its attaches.
        let hello = plain_hello();
        let (_, session) = ferry_transport_tcp::handshake_with(
            server.addr(),
            &hello,
            Some(&keyring(ALICE)),
            Duration::from_secs(10),
        )
        .await?;
        let session = session.context("no session")?;
        let attach = StreamAttach {
            peer_id: hello.peer_id,
            epoch: hello.epoch,
            server_epoch: server.engine.epoch(),
            transport: 1,
            stream_index: 0,
        };
        let frame = session.attach(attach);
        let ControlFrame::AuthAttach(good) = frame else {
            bail!("not an authenticated attach")
        };
        let token = server.open.token().0;
        let forged = AuthAttach {
            mac: [0x42; 32],
            ..good
        };
        let answer = attach_and_write(server.addr(), ControlFrame::AuthAttach(forged), token)?;
        assert!(is_refusal(&answer), "{plane:?}: forged: {answer:?}");
        let other = AuthAttach {
            attach: StreamAttach {
                peer_id: PeerId::random(),
                ..attach
            },
            ..good
        };
        let answer = attach_and_write(server.addr(), ControlFrame::AuthAttach(other), token)?;
        assert!(is_refusal(&answer), "{plane:?}: another peer: {answer:?}");
        assert!(server.untouched(&server.open)?, "{plane:?}: bytes moved");
        // The genuine attach is accepted once; its replay is refused.
        let answer = attach_and_write(server.addr(), ControlFrame::AuthAttach(good), 0)?;
        assert!(
            matches!(answer, ControlFrame::StreamAccept),
            "{plane:?}: {answer:?}"
        );
        let answer = attach_and_write(server.addr(), ControlFrame::AuthAttach(good), token)?;
        assert!(is_refusal(&answer), "{plane:?}: replay: {answer:?}");
        assert!(server.untouched(&server.open)?, "{plane:?}: bytes moved");
    }
    Ok(())
}

/// A segment published to bob: alice (authenticated) neither sees it listed nor reaches it
/// with its token (a READ and a WRITE are refused as for an unknown token, nothing moves);
/// bob does both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_segment_published_to_named_peers_is_invisible_to_others() -> Result<()> {
    for plane in planes() {
        let server = Server::start(plane, Some(&format!("{ALICE}\n{BOB}")))?;
        let secret = server.secret.as_ref().context("no secret")?;

        let bob = client(plane, Some(BOB))?;
        let bob_peer = bob.connect(server.addr()).await?;
        let seen = bob_peer.segment("secret")?;
        let back = local(&bob, 0)?;
        let o = bob
            .submit(Batch::new().read(&back, 0, &seen, 0, LEN as u64))?
            .await;
        assert!(o.is_success(), "{plane:?}: {o:?}");

        let alice = client(plane, Some(ALICE))?;
        let peer = alice.connect(server.addr()).await?;
        peer.segment("open")?;
        assert!(
            matches!(
                peer.segment("secret"),
                Err(Error::UnknownSegmentName { .. })
            ),
            "{plane:?}: alice sees bob's segment"
        );
        // The token leaked (from bob's listing): alice forges a descriptor.
        let forged = peer.segment_from_descriptor(SegmentDesc {
            name: "forged".into(),
            token: secret.token(),
            len: LEN as u64,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            remote_keys: vec![],
        });
        let probe = local(&alice, 0)?;
        let o = alice
            .submit(Batch::new().read(&probe, 0, &forged, 0, LEN as u64))?
            .await;
        assert_eq!(
            o.failure.as_ref().map(|f| f.kind),
            Some(FailureKind::Remote(RemoteStatus::UnknownSegment)),
            "{plane:?}: {o:?}"
        );
        let mut got = vec![0u8; LEN];
        probe.region().read_at(0, &mut got)?;
        assert!(got.iter().all(|&b| b == 0), "{plane:?}: bytes leaked");
        let src = local(&alice, 0xee)?;
        let o = alice
            .submit(Batch::new().write(&src, 0, &forged, 0, LEN as u64))?
            .await;
        assert_eq!(
            o.failure.as_ref().map(|f| f.kind),
            Some(FailureKind::Remote(RemoteStatus::UnknownSegment)),
            "{plane:?}: {o:?}"
        );
        assert_eq!(o.remote_effect, RemoteEffect::None);
        assert!(server.untouched(secret)?, "{plane:?}: alice wrote");
    }
    Ok(())
}

/// Ops per scattered batch, and bytes per op: small enough that the client groups them into
/// vectored requests (piece tables).
const SCATTERED: u64 = 64;
const PIECE: u64 = 512;

/// A scattered batch (64 READs, then 64 WRITEs, of 512 bytes each, one per KiB) from `engine`
/// to `target`: the READ's outcome, the bytes it read, and the WRITE's outcome.
async fn scattered(
    engine: &TransferEngine,
    target: &ferry::RemoteSegment,
) -> Result<(ferry::Outcome, Vec<u8>, ferry::Outcome)> {
    let probe = local(engine, 0)?;
    let mut reads = Batch::new();
    for i in 0..SCATTERED {
        reads = reads.read(&probe, i * PIECE, target, 2 * i * PIECE, PIECE);
    }
    let read = engine.submit(reads)?.await;
    let mut got = vec![0u8; LEN];
    probe.region().read_at(0, &mut got)?;
    let src = local(engine, 0xee)?;
    let mut writes = Batch::new();
    for i in 0..SCATTERED {
        writes = writes.write(&src, i * PIECE, target, 2 * i * PIECE, PIECE);
    }
    let write = engine.submit(writes)?.await;
    Ok((read, got, write))
}

/// A segment published to bob, reached by alice with a leaked token through scattered batches
/// (vectored requests, one piece table each): every piece is refused as an unknown segment on
/// both planes, no byte is read or written; bob's own scattered batches succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scattered_batches_cannot_reach_a_segment_published_to_others() -> Result<()> {
    fn served_tables(engine: &TransferEngine) -> Result<u64> {
        Ok(engine
            .describe()
            .served
            .context("a listener counts")?
            .tables)
    }
    for plane in planes() {
        let server = Server::start(plane, Some(&format!("{ALICE}\n{BOB}")))?;
        let secret = server.secret.as_ref().context("no secret")?;

        let alice = client(plane, Some(ALICE))?;
        let peer = alice.connect(server.addr()).await?;
        let forged = peer.segment_from_descriptor(SegmentDesc {
            name: "forged".into(),
            token: secret.token(),
            len: LEN as u64,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            remote_keys: vec![],
        });
        let tables_before = served_tables(&server.engine)?;
        let (read, got, write) = scattered(&alice, &forged).await?;
        // The refusals came piece by piece, through piece tables (a READ's and a WRITE's), not
        // as single ops: the test stays one of vectored requests.
        ensure!(
            served_tables(&server.engine)? >= tables_before + 2,
            "{plane:?}: the scattered batches sent no piece table"
        );
        let unknown = Some(FailureKind::Remote(RemoteStatus::UnknownSegment));
        assert_eq!(
            read.failure.as_ref().map(|f| f.kind),
            unknown,
            "{plane:?}: {read:?}"
        );
        assert!(got.iter().all(|&b| b == 0), "{plane:?}: bytes leaked");
        assert_eq!(
            write.failure.as_ref().map(|f| f.kind),
            unknown,
            "{plane:?}: {write:?}"
        );
        assert_eq!(write.remote_effect, RemoteEffect::None, "{plane:?}");
        assert!(server.untouched(secret)?, "{plane:?}: alice wrote");

        // The same batches from bob pass: the refusal above is the view, not the batch.
        let bob = client(plane, Some(BOB))?;
        let bob_peer = bob.connect(server.addr()).await?;
        let (read, got, write) = scattered(&bob, &bob_peer.segment("secret")?).await?;
        assert!(read.is_success(), "{plane:?}: {read:?}");
        assert!(
            got[..(SCATTERED * PIECE) as usize]
                .iter()
                .all(|&b| b == 0x5a),
            "{plane:?}: bob read wrong bytes"
        );
        assert!(write.is_success(), "{plane:?}: {write:?}");
        assert!(
            !server.untouched(secret)?,
            "{plane:?}: bob's writes did not land"
        );
    }
    Ok(())
}

/// Keys are checked when the engine is built: a missing file and a short key are typed errors
/// naming the file, without the key's bytes.
#[test]
fn bad_key_files_are_refused_when_building() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("missing.keys");
    let e = TransferEngine::builder()
        .same_host(false)
        .auth_key_file(&missing)
        .build()
        .err()
        .context("built with a missing key file")?;
    assert!(
        matches!(&e, Error::AuthKey { source_name, .. } if source_name.contains("missing.keys")),
        "{e}"
    );
    let short = dir.path().join("short.keys");
    std::fs::write(&short, "alice 0001020304050607\n")?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&short, std::fs::Permissions::from_mode(0o600))?;
    let e = TransferEngine::builder()
        .same_host(false)
        .auth_key_file(&short)
        .build()
        .err()
        .context("built with a short key")?;
    let text = e.to_string();
    assert!(
        text.contains("short.keys") && text.contains("at least 16"),
        "{text}"
    );
    assert!(!text.contains("0001020304050607"), "{text}");
    let e = TransferEngine::builder()
        .same_host(false)
        .auth_key("alice", b"short")
        .build()
        .err()
        .context("built with a short key")?;
    assert!(matches!(e, Error::AuthKey { .. }), "{e}");
    // A key file group or others may read is refused, naming the file and the way out, unless
    // allowed; a good key in it then works.
    let open = dir.path().join("open.keys");
    std::fs::write(&open, format!("{ALICE}\n"))?;
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644))?;
    let e = TransferEngine::builder()
        .same_host(false)
        .auth_key_file(&open)
        .build()
        .err()
        .context("built with a key file others may read")?;
    let text = e.to_string();
    assert!(
        matches!(&e, Error::AuthKey { .. })
            && text.contains("open.keys")
            && text.contains("644")
            && text.contains("allow-open-key-file"),
        "{text}"
    );
    assert!(!text.contains("0a0b0c0d"), "{text}");
    TransferEngine::builder()
        .same_host(false)
        .auth_key_file(&open)
        .allow_open_key_file(true)
        .build()?;
    // Publishing to named peers needs keys.
    let engine = TransferEngine::builder()
        .same_host(false)
        .no_auth()
        .build()?;
    let r = MemoryRegion::alloc_zeroed(4096, 4096)?;
    assert!(matches!(
        engine.register_to(r, Access::REMOTE_READ, "x", &["bob"]),
        Err(Error::InvalidRequest { .. })
    ));
    Ok(())
}

/// Data streams are capped per key name (`max_streams_per_key`), on every plane the listener
/// serves (TCP, io_uring; the same-host plane, whose streams count under the same cap): a
/// second client of alice's, past the cap her first one's streams fill, is refused at its
/// attach with `TooManyStreams`; bob, another key name, still connects and moves bytes; and
/// alice's first channel goes on working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_past_the_cap_of_a_key_name_are_refused_on_every_plane() -> Result<()> {
    let mut cases: Vec<(DataPlane, bool)> = planes().into_iter().map(|p| (p, false)).collect();
    cases.push((DataPlane::Tcp, true));
    for (plane, same_host) in cases {
        let server = Server::start_with(plane, Some(&format!("{ALICE}\n{BOB}")), |b| {
            b.same_host(same_host).max_streams_per_key(2)
        })?;
        let connect = |keys: &str| -> Result<TransferEngine> {
            Ok(TransferEngine::builder()
                .same_host(same_host)
                .data_plane(plane)
                .streams(2)
                .no_auth()
                .auth_keyring(keyring(keys))
                .build()?)
        };
        let alice = connect(ALICE)?;
        let alice_peer = alice.connect(server.addr()).await?;
        let dst_alice = local(&alice, 0)?;
        let o = alice
            .submit(Batch::new().read(&dst_alice, 0, &alice_peer.segment("open")?, 0, LEN as u64))?
            .await;
        ensure!(o.is_success(), "{plane:?} same_host={same_host}: {o:?}");
        if same_host {
            ensure!(
                alice
                    .describe()
                    .routes
                    .iter()
                    .any(|r| r.transport == "local"),
                "alice is not on the same-host plane: {:?}",
                alice.describe().routes
            );
        }
        let again = connect(ALICE)?;
        match again.connect(server.addr()).await {
            Err(Error::TooManyStreams { reason, .. }) => ensure!(
                reason.contains("\"alice\""),
                "{plane:?} same_host={same_host}: the refusal names no key: {reason}"
            ),
            other => {
                bail!("{plane:?} same_host={same_host}: alice's streams past the cap: {other:?}")
            }
        }
        let bob = connect(BOB)?;
        let bob_peer = bob.connect(server.addr()).await?;
        let dst = local(&bob, 0)?;
        let o = bob
            .submit(Batch::new().read(&dst, 0, &bob_peer.segment("open")?, 0, LEN as u64))?
            .await;
        ensure!(
            o.is_success(),
            "{plane:?} same_host={same_host}: bob: {o:?}"
        );
        let o = alice
            .submit(Batch::new().read(&dst_alice, 0, &alice_peer.segment("open")?, 0, LEN as u64))?
            .await;
        ensure!(
            o.is_success(),
            "{plane:?} same_host={same_host}: alice after: {o:?}"
        );
    }
    Ok(())
}

/// A client that names the server it expects (issue 46, S3). Two servers hold alice's key;
/// alice pairs an address with server A's identity. At server B's address (a redirected
/// record) B proves alice's key but not A's identity: refused with `ServerIdentity` naming the
/// address and the identity expected, and nothing of B's is read or written; the address stays
/// paired (a later plain connect to it is refused too). At A's address the bytes move. A client
/// that names nothing connects to B as before. Keyless, an expected identity is refused
/// before anything is sent. The identity comes from a key file (refused when group or others
/// may read it) and `describe()` shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_holder_cannot_answer_for_the_server_a_client_names() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let key = ferry::IdentityKey::generate();
    let file = dir.path().join("identity.key");
    std::fs::write(&file, format!("# server A\n{}\n", key.to_file_text()))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644))?;
    let e = Server::start_with(DataPlane::Tcp, Some(ALICE), |b| b.identity_key_file(&file))
        .err()
        .context("built with an identity key file others may read")?;
    let text = format!("{e:#}");
    assert!(
        text.contains("identity.key") && text.contains("644"),
        "{text}"
    );
    assert!(!text.contains(&key.to_file_text()[..16]), "{text}");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600))?;
    for plane in planes() {
        let a = Server::start_with(plane, Some(ALICE), |b| b.identity_key_file(&file))?;
        let b = Server::start(plane, Some(ALICE))?;
        let expected = a.engine.server_identity();
        assert_eq!(expected, key.public());
        assert_eq!(a.engine.describe().server_identity, expected.to_string());
        assert_ne!(b.engine.server_identity(), expected);

        let alice = client(plane, Some(ALICE))?;
        let e = alice
            .connect_expecting(b.addr(), expected)
            .await
            .err()
            .context("server B answered for server A")?;
        assert!(
            matches!(&e, Error::ServerIdentity { addr, expected: x, reason }
                if *addr == b.addr().to_string() && *x == expected.to_string()
                    && reason.contains(&b.engine.server_identity().to_string())),
            "{plane:?}: {e}"
        );
        let e = alice
            .connect(b.addr())
            .await
            .err()
            .context("the pairing was forgotten")?;
        assert!(matches!(e, Error::ServerIdentity { .. }), "{plane:?}: {e}");
        assert!(b.untouched(&b.open)?, "{plane:?}: server B's bytes changed");

        let peer = alice.connect_expecting(a.addr(), expected).await?;
        let back = local(&alice, 0)?;
        let o = alice
            .submit(Batch::new().read(&back, 0, &peer.segment("open")?, 0, LEN as u64))?
            .await;
        assert!(o.is_success(), "{plane:?}: {o:?}");
        let mut got = vec![0u8; LEN];
        back.region().read_at(0, &mut got)?;
        assert!(got.iter().all(|&b| b == 0x5a), "{plane:?}: wrong bytes");
        alice.notify(&peer, "alice", b"done").await?;

        // Naming nothing, the handshake is the one it was: any holder of the key answers.
        let plain = client(plane, Some(ALICE))?;
        plain.connect(b.addr()).await?;
        let keyless = client(plane, None)?;
        let e = keyless
            .connect_expecting(a.addr(), expected)
            .await
            .err()
            .context("a keyless client was told an identity was proven")?;
        assert!(matches!(e, Error::InvalidRequest { .. }), "{plane:?}: {e}");
    }
    Ok(())
}

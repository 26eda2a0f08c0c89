//! The pre-proof gate of a keyed control service, over real loopback sockets: what a stranger
//! can cost before proving a key, and that a wrong or skipped proof gets nothing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry::core_types::auth::{ClientAuth, ServerAuth, nonce};
use ferry::core_types::wire::ControlFrame;
use ferry::{Epoch, HandshakeLimits, Keyring, PeerId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::messages::{MAX_PREAUTH_REQUEST, MAX_REQUEST};
use super::proven::ProvenLimits;
use super::*;
use crate::manifest::Digest;
use crate::plan::{Member, Role};

const KEYS: &str = "alice 000102030405060708090a0b0c0d0e0f";

/// A source's control service with `KEYS` (a tracker, no manifest) under `limits`.
async fn service(limits: HandshakeLimits) -> (Service, String) {
    service_with(limits, Some(KEYS)).await
}

/// The same with `keys` (or none).
async fn service_with(limits: HandshakeLimits, keys: Option<&str>) -> (Service, String) {
    service_proven(limits, ProvenLimits::default(), keys).await
}

/// The same with `proven` after the proof.
async fn service_proven(
    limits: HandshakeLimits,
    proven: ProvenLimits,
    keys: Option<&str>,
) -> (Service, String) {
    let (_tx, progress) = watch::channel(Progress::default());
    let source = Member {
        id: "src".into(),
        epoch: 1,
        source_epoch: 7,
        data_addr: String::new(),
        ctl_addr: String::new(),
        role: Role::Source,
        progress: 0,
        done: false,
        order: 0,
        version: 1,
        rate: 0,
        number: None,
        identity: None,
    };
    let state = Arc::new(CtlState {
        source_epoch: 7,
        manifests: Mutex::new(Vec::new()),
        version: 1,
        layout: None,
        source_layouts: Mutex::new(HashMap::new()),
        progress,
        tracker: Some(Arc::new(Tracker::new(source, Duration::from_secs(60)))),
        auth: keys.map(|k| {
            (
                ServerAuth::new(Keyring::parse(k).unwrap()),
                PeerId(3),
                Epoch(4),
            )
        }),
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    (Service::start_with(listener, state, limits, proven), addr)
}

fn limits(timeout: Duration, max_pending: usize) -> HandshakeLimits {
    HandshakeLimits {
        timeout,
        max_pending,
    }
}

/// Sends `line` and reads the answer line (`None`: the service closed the connection).
async fn ask(s: &mut TcpStream, line: &str) -> Option<String> {
    s.write_all(format!("{line}\n").as_bytes()).await.ok()?;
    let mut got = Vec::new();
    let mut b = [0u8; 1];
    loop {
        match s.read(&mut b).await {
            Ok(0) | Err(_) => return None,
            Ok(_) if b[0] == b'\n' => return Some(String::from_utf8_lossy(&got).into_owned()),
            Ok(_) => got.push(b[0]),
        }
    }
}

/// Whether the service closed `s` (reads to the end; bounded so a bug fails, not hangs).
async fn closed(s: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    matches!(
        tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut rest)).await,
        Ok(Ok(_)) | Ok(Err(_))
    )
}

/// The client's first step with `KEYS` as JSON, and the client state to answer with.
fn hello() -> (String, ClientAuth) {
    let keys = Keyring::parse(KEYS).unwrap();
    let (first, client) = ClientAuth::start(&keys, PeerId(1), Epoch(2), nonce());
    let ControlFrame::AuthHello(h) = first else {
        panic!("no hello")
    };
    let req = Request::AuthHello {
        name: h.name,
        peer_id: format!("{:032x}", h.peer_id.0),
        epoch: h.epoch.0,
        nonce: Digest(h.nonce),
    };
    (serde_json::to_string(&req).unwrap(), client)
}

#[tokio::test]
async fn a_wrong_proof_gets_nothing_and_closes_the_connection() {
    let (_svc, addr) = service(HandshakeLimits::default()).await;
    let mut s = TcpStream::connect(&addr).await.unwrap();
    let (hello, _client) = hello();
    let challenge = ask(&mut s, &hello).await.unwrap();
    assert!(challenge.contains("auth_challenge"), "{challenge}");
    let bad = serde_json::to_string(&Request::AuthProof {
        mac: Digest([7; 32]),
    })
    .unwrap();
    let answer = ask(&mut s, &bad).await.unwrap();
    assert!(answer.contains("error"), "{answer}");
    assert!(closed(&mut s).await);
}

#[tokio::test]
async fn a_skipped_proof_gets_nothing() {
    let (_svc, addr) = service(HandshakeLimits::default()).await;
    let mut s = TcpStream::connect(&addr).await.unwrap();
    let (hello, _client) = hello();
    assert!(
        ask(&mut s, &hello)
            .await
            .unwrap()
            .contains("auth_challenge")
    );
    let answer = ask(&mut s, r#"{"op":"members"}"#).await.unwrap();
    assert!(
        answer.contains("error") && !answer.contains("src"),
        "{answer}"
    );
    assert!(closed(&mut s).await);
    // Nor is anything answered without even a hello.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    let answer = ask(&mut s, r#"{"op":"members"}"#).await.unwrap();
    assert!(answer.contains("unauthenticated"), "{answer}");
}

#[tokio::test]
async fn before_the_proof_lines_are_short_and_time_is_bounded() {
    let (_svc, addr) = service(limits(Duration::from_millis(300), 16)).await;
    // A line over the pre-proof limit (the proven limit is 64 KiB): closed unanswered.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    let long = format!(
        "{{\"op\":\"members\",\"x\":\"{}\"}}",
        "a".repeat(2 * MAX_PREAUTH_REQUEST)
    );
    assert_eq!(ask(&mut s, &long).await, None);
    // Silence: closed at the deadline.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    assert!(closed(&mut s).await);
    // A challenged connection that never proves: closed at the deadline too.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    let (hello, _client) = hello();
    assert!(
        ask(&mut s, &hello)
            .await
            .unwrap()
            .contains("auth_challenge")
    );
    assert!(closed(&mut s).await);
}

/// Past the cap the oldest connection not yet proven is closed to make room (the gate evicts):
/// strangers that arrived first cannot keep a key holder out, and a proven connection no longer
/// counts against the cap.
#[tokio::test]
async fn past_the_cap_the_oldest_unproven_connection_makes_room_and_a_proven_one_stays() {
    // A deadline no test waits for: a closed connection below was evicted, not timed out.
    let (_svc, addr) = service(limits(Duration::from_secs(600), 2)).await;
    let mut a = TcpStream::connect(&addr).await.unwrap();
    let mut b = TcpStream::connect(&addr).await.unwrap();
    let _c = TcpStream::connect(&addr).await.unwrap();
    assert!(closed(&mut a).await, "the oldest made room for the third");
    // Both places held by strangers: a key holder gets in at its first try (b makes room).
    let keys = Keyring::parse(KEYS).unwrap();
    let mut client = CtlClient::connect_keyed(&addr, Duration::from_secs(5), Some(&keys))
        .await
        .expect("a client proving its key got in past the cap");
    assert!(
        closed(&mut b).await,
        "the oldest stranger made room for the key holder"
    );
    // Proven, it holds no place: strangers filling both again do not end it.
    let _d = TcpStream::connect(&addr).await.unwrap();
    let _e = TcpStream::connect(&addr).await.unwrap();
    let members = client
        .call(&Request::Members, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(matches!(members, Reply::Members { .. }), "{members:?}");
}

#[tokio::test]
async fn an_answer_that_outlasts_the_deadline_is_still_given() {
    // Keyless: the first request passes the gate, so its long poll may take longer than
    // the pre-proof deadline.
    let (_svc, addr) = service_with(limits(Duration::from_millis(100), 4), None).await;
    let mut s = TcpStream::connect(&addr).await.unwrap();
    let answer = ask(&mut s, r#"{"op":"progress","after":0,"wait_ms":600}"#)
        .await
        .expect("answered");
    assert!(answer.contains("progress"), "{answer}");
    assert!(
        ask(&mut s, r#"{"op":"members"}"#)
            .await
            .unwrap()
            .contains("members")
    );
}

/// Proves `KEYS` on the raw connection `s`, as a client would (one JSON line each way).
async fn prove(s: &mut TcpStream) {
    let (hello, client) = hello();
    let challenge = ask(s, &hello).await.expect("challenged");
    let Ok(Reply::AuthChallenge {
        peer_id,
        epoch,
        nonce: server_nonce,
        mac,
    }) = serde_json::from_str::<Reply>(&challenge)
    else {
        panic!("not a challenge: {challenge}")
    };
    let challenge = ControlFrame::AuthChallenge(ferry::core_types::wire::AuthChallenge {
        peer_id: PeerId(u128::from_str_radix(&peer_id, 16).unwrap()),
        epoch: Epoch(epoch),
        nonce: server_nonce.0,
        mac: mac.0,
    });
    let (proof, _) = client
        .on_reply(s.peer_addr().unwrap(), challenge)
        .expect("the member proved the key");
    let ControlFrame::AuthProof(p) = proof else {
        panic!("no proof")
    };
    let proof = serde_json::to_string(&Request::AuthProof { mac: Digest(p.mac) }).unwrap();
    let answer = ask(s, &proof).await.expect("proof answered");
    assert!(answer.contains("\"ok\""), "{answer}");
}

/// A `members` request padded with spaces to `len` bytes (valid JSON whatever the length).
fn members_line(len: usize) -> String {
    let head = r#"{"op":"members"}"#;
    format!("{head}{}", " ".repeat(len.saturating_sub(head.len())))
}

/// A hello then an all-zero proof: refused, and the connection is closed without answering the
/// request sent right behind the proof.
#[tokio::test]
async fn an_all_zero_proof_is_refused_and_nothing_after_it_is_answered() {
    let (_svc, addr) = service(HandshakeLimits::default()).await;
    let mut s = TcpStream::connect(&addr).await.unwrap();
    let (hello, _client) = hello();
    assert!(
        ask(&mut s, &hello)
            .await
            .unwrap()
            .contains("auth_challenge")
    );
    let zero = serde_json::to_string(&Request::AuthProof {
        mac: Digest([0; 32]),
    })
    .unwrap();
    // The proof and a request behind it in one write: the request must find the connection
    // closed, not proven.
    s.write_all(format!("{zero}\n{{\"op\":\"members\"}}\n").as_bytes())
        .await
        .unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut rest))
        .await
        .expect("the connection was closed")
        .ok();
    let rest = String::from_utf8_lossy(&rest);
    let lines: Vec<&str> = rest.lines().collect();
    assert_eq!(lines.len(), 1, "one answer, to the proof only: {rest}");
    assert!(
        lines[0].contains("error") && !rest.contains("members"),
        "{rest}"
    );
}

/// A request without a proof (none begun, or only challenged) is refused and closed; so is a
/// proof without a challenge.
#[tokio::test]
async fn a_request_without_a_proof_is_refused_and_closed() {
    let (_svc, addr) = service(HandshakeLimits::default()).await;
    for req in [r#"{"op":"members"}"#, r#"{"op":"manifest"}"#] {
        // No hello at all.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        let answer = ask(&mut s, req).await.expect("refused with an answer");
        assert!(answer.contains("unauthenticated"), "{answer}");
        assert!(closed(&mut s).await);
        // Challenged, never proven.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        let (hello, _client) = hello();
        assert!(
            ask(&mut s, &hello)
                .await
                .unwrap()
                .contains("auth_challenge")
        );
        let answer = ask(&mut s, req).await.expect("refused with an answer");
        assert!(
            answer.contains("unauthenticated") && !answer.contains("src"),
            "{answer}"
        );
        assert!(closed(&mut s).await);
    }
    let mut s = TcpStream::connect(&addr).await.unwrap();
    let proof = serde_json::to_string(&Request::AuthProof {
        mac: Digest([0; 32]),
    })
    .unwrap();
    let answer = ask(&mut s, &proof).await.expect("refused with an answer");
    assert!(answer.contains("out of order"), "{answer}");
    assert!(closed(&mut s).await);
    // And a connection that proves its key is answered: the refusals above are the key's.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    prove(&mut s).await;
    let answer = ask(&mut s, r#"{"op":"members"}"#).await.unwrap();
    assert!(answer.contains("src"), "{answer}");
}

/// Request lines: at most 1 KiB before the proof (a line just under it is read, and refused
/// for being unauthenticated), 64 KiB after it (a line just under is answered, one over is
/// closed unanswered), and a keyless member's lines are held to 64 KiB from the first.
#[tokio::test]
async fn request_lines_are_capped_at_1_kib_before_the_proof_and_64_kib_after() {
    let (_svc, addr) = service(HandshakeLimits::default()).await;
    let mut s = TcpStream::connect(&addr).await.unwrap();
    let answer = ask(&mut s, &members_line(MAX_PREAUTH_REQUEST - 8))
        .await
        .expect("a line under the pre-proof limit is read");
    assert!(answer.contains("unauthenticated"), "{answer}");
    for len in [2 * MAX_PREAUTH_REQUEST, MAX_REQUEST + 1024] {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        assert_eq!(ask(&mut s, &members_line(len)).await, None, "{len} bytes");
    }
    let mut s = TcpStream::connect(&addr).await.unwrap();
    prove(&mut s).await;
    let answer = ask(&mut s, &members_line(MAX_REQUEST - 8))
        .await
        .expect("a proven line under 64 KiB is answered");
    assert!(answer.contains("src"), "{answer}");
    assert_eq!(ask(&mut s, &members_line(MAX_REQUEST + 1024)).await, None);

    let (_open, addr) = service_with(HandshakeLimits::default(), None).await;
    let mut s = TcpStream::connect(&addr).await.unwrap();
    assert_eq!(ask(&mut s, &members_line(MAX_REQUEST + 1024)).await, None);
    let mut s = TcpStream::connect(&addr).await.unwrap();
    let answer = ask(&mut s, &members_line(MAX_REQUEST - 8)).await.unwrap();
    assert!(answer.contains("src"), "{answer}");
    assert_eq!(ask(&mut s, &members_line(MAX_REQUEST + 1024)).await, None);
}

/// A connection to `addr` from the loopback address `from`.
async fn connect_from(addr: &str, from: [u8; 4]) -> TcpStream {
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.bind(std::net::SocketAddr::from((from, 0))).unwrap();
    s.connect(addr.parse().unwrap()).await.unwrap()
}

/// After the proof (keyless: once its first request is answered) a connection is closed when it
/// waits longer than the idle timeout for its next request; the time its answer takes (a long
/// poll longer than the timeout) does not count, and a key holder proven long ago is answered
/// as long as it keeps asking.
#[tokio::test]
async fn a_proven_connection_idle_past_the_timeout_is_closed() {
    let proven = ProvenLimits {
        idle: Duration::from_millis(300),
        ..ProvenLimits::default()
    };
    for keys in [None, Some(KEYS)] {
        let (_svc, addr) = service_proven(HandshakeLimits::default(), proven, keys).await;
        let mut s = TcpStream::connect(&addr).await.unwrap();
        if keys.is_some() {
            prove(&mut s).await;
        }
        let answer = ask(&mut s, r#"{"op":"progress","after":0,"wait_ms":900}"#)
            .await
            .expect("a long poll past the idle timeout is answered");
        assert!(answer.contains("progress"), "{keys:?}: {answer}");
        let answer = ask(&mut s, r#"{"op":"members"}"#).await.expect("answered");
        assert!(answer.contains("src"), "{keys:?}: {answer}");
        // Then silence: closed at the idle timeout (`closed` waits far longer).
        let t0 = std::time::Instant::now();
        assert!(
            closed(&mut s).await,
            "{keys:?}: an idle proven connection stays open"
        );
        assert!(t0.elapsed() < Duration::from_secs(10), "{keys:?}");
    }
}

/// Proven connections are capped per key (keyless: per source address): past the cap the
/// key's connection that has waited longest for its peer is closed to make room, another
/// source's are untouched, and past the total the source holding the most gives way.
#[tokio::test]
async fn past_the_cap_the_idlest_proven_connection_of_the_key_makes_room() {
    let proven = ProvenLimits {
        per_key: 2,
        total: 3,
        ..ProvenLimits::default()
    };
    let (_svc, addr) = service_proven(HandshakeLimits::default(), proven, None).await;
    let members = r#"{"op":"members"}"#;
    let mut other = connect_from(&addr, [127, 0, 0, 2]).await;
    assert!(ask(&mut other, members).await.unwrap().contains("src"));
    let mut a = connect_from(&addr, [127, 0, 0, 1]).await;
    let mut b = connect_from(&addr, [127, 0, 0, 1]).await;
    for s in [&mut a, &mut b] {
        assert!(ask(s, members).await.unwrap().contains("src"));
    }
    // `a` asks again: `b` has waited longest of the source's.
    assert!(ask(&mut a, members).await.unwrap().contains("src"));
    let mut c = connect_from(&addr, [127, 0, 0, 1]).await;
    assert!(ask(&mut c, members).await.unwrap().contains("src"));
    assert!(closed(&mut b).await, "the idlest of the source made room");
    for s in [&mut a, &mut c, &mut other] {
        assert!(ask(s, members).await.unwrap().contains("src"));
    }
    // The total (3) reached: a third source's newcomer takes from the source holding the most
    // (127.0.0.1, whose idlest is now `a`), not from 127.0.0.2.
    let mut d = connect_from(&addr, [127, 0, 0, 3]).await;
    assert!(ask(&mut d, members).await.unwrap().contains("src"));
    assert!(
        closed(&mut a).await,
        "the busiest source's idlest made room"
    );
    for s in [&mut c, &mut other, &mut d] {
        assert!(ask(s, members).await.unwrap().contains("src"));
    }

    // Keyed: charged to the key name proven, whatever the address.
    let (_svc, addr) = service_proven(HandshakeLimits::default(), proven, Some(KEYS)).await;
    let mut x = connect_from(&addr, [127, 0, 0, 1]).await;
    let mut y = connect_from(&addr, [127, 0, 0, 2]).await;
    prove(&mut x).await;
    prove(&mut y).await;
    let mut z = connect_from(&addr, [127, 0, 0, 3]).await;
    prove(&mut z).await;
    assert!(closed(&mut x).await, "the key's idlest made room");
    for s in [&mut y, &mut z] {
        assert!(ask(s, members).await.unwrap().contains("src"));
    }
}

/// A client holding a connection with nothing asked sees the member close it the moment its
/// service stops ([`CtlClient::closed`]: how a receiver learns a finished holder left), and
/// not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_connection_ends_when_the_members_service_stops_and_not_before() {
    let (svc, addr) = service_with(HandshakeLimits::default(), None).await;
    let mut c = CtlClient::connect(&addr, Duration::from_secs(5))
        .await
        .unwrap();
    let req = Request::Progress {
        after: 0,
        wait_ms: 0,
        after_count: Some(0),
    };
    assert!(matches!(
        c.call(&req, Duration::from_secs(5)).await.unwrap(),
        Reply::Progress { .. }
    ));
    // Served and idle: not closed (polled once, it is pending).
    let mut held = std::pin::pin!(c.closed());
    let pending =
        std::future::poll_fn(|cx| std::task::Poll::Ready(held.as_mut().poll(cx).is_pending()))
            .await;
    assert!(
        pending,
        "the connection ended while its member still served"
    );
    drop(svc);
    let ended = tokio::time::timeout(Duration::from_secs(10), held).await;
    assert!(
        matches!(ended, Ok(Ok(()))),
        "the member's service stopped and the connection did not end: {ended:?}"
    );
}

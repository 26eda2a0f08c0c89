//! What a keyed listener allows a connection before its key is proven, on both portable data
//! planes (the io_uring cases skip, saying why, where the kernel refuses io_uring;
//! `FERRY_REQUIRE_URING=1` fails them instead): a frame larger than authentication needs is
//! refused from its header, connections past the cap of pending handshakes are closed at once
//! and counted (the newest refused, or the oldest evicted where the gate evicts), idle
//! connections cost no thread each, a client that trickles its hello is closed
//! at the handshake deadline, a client that proved its key moves bytes all the while, and a key
//! holder that arrives while strangers hold every place gets in once they reach the deadline.
//!
//! One test function runs it all: it counts this process's threads, which other tests running
//! beside it in the same binary would disturb.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use ferry::core_types::auth::Keyring;
use ferry::core_types::wire::{CONTROL_HEADER_LEN, ControlFrame, MAX_PREAUTH_BODY};
use ferry::{Access, Batch, DataPlane, MemoryRegion, TransferEngine};
use ferry_tests::{URING, require_or_skip};

const ALICE: &str = "alice 000102030405060708090a0b0c0d0e0f";
const LEN: usize = 64 << 10;
/// The cap on pending handshakes the servers here run with, and the connections of a flood.
const CAP: usize = 32;
const FLOOD: usize = 160;
/// Limit on waiting for an event that must come (a failure past it, never a pace).
const PATIENCE: Duration = Duration::from_secs(60);

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

fn server(plane: DataPlane, timeout: Duration) -> Result<(TransferEngine, ferry::Registration)> {
    let engine = TransferEngine::builder()
        .same_host(false)
        .listen("127.0.0.1:0".parse()?)
        .data_plane(plane)
        .auth_keyring(Keyring::parse(ALICE)?)
        .handshake_timeout(timeout)
        .max_pending_handshakes(CAP)
        .build()?;
    let r = MemoryRegion::alloc_zeroed(LEN, 4096)?;
    let reg = engine.register(r, Access::REMOTE_READ | Access::REMOTE_WRITE, "open")?;
    Ok((engine, reg))
}

fn threads() -> Result<usize> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .context("no Threads line in /proc/self/status")?;
    Ok(line.trim().parse()?)
}

fn handshakes(engine: &TransferEngine) -> Result<ferry::HandshakeDescription> {
    engine
        .describe()
        .handshakes
        .context("a listening engine describes no handshakes")
}

/// Waits until `cond` holds, checking after each short pause; fails past [`PATIENCE`].
fn wait_for(what: &str, mut cond: impl FnMut() -> Result<bool>) -> Result<()> {
    let start = Instant::now();
    while !cond()? {
        ensure!(
            start.elapsed() < PATIENCE,
            "{what}: not within {PATIENCE:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(())
}

/// Reads until the peer closes (a read of 0 or a reset); fails past [`PATIENCE`] or on bytes.
fn wait_closed(s: &mut TcpStream) -> Result<()> {
    s.set_read_timeout(Some(PATIENCE))?;
    let mut b = [0u8; 64];
    loop {
        return match s.read(&mut b) {
            Ok(0) => Ok(()),
            Ok(n) => bail!("the server sent {n} bytes instead of closing"),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(()),
            Err(e) => Err(e).context("waiting for the server to close"),
        };
    }
}

/// A WRITE then a READ of the whole segment from a client that proved its key.
async fn moves_bytes(client: &TransferEngine, peer: &ferry::Peer, fill: u8) -> Result<()> {
    let open = peer.segment("open")?;
    let src = MemoryRegion::alloc_zeroed(LEN, 4096)?;
    src.write_at(0, &vec![fill; LEN])?;
    let src = client.register(src, Access::LOCAL, "src")?;
    let back = client.register(
        MemoryRegion::alloc_zeroed(LEN, 4096)?,
        Access::LOCAL,
        "back",
    )?;
    let o = client
        .submit(Batch::new().write(&src, 0, &open, 0, LEN as u64))?
        .await;
    ensure!(o.is_success(), "write: {o:?}");
    let o = client
        .submit(Batch::new().read(&back, 0, &open, 0, LEN as u64))?
        .await;
    ensure!(o.is_success(), "read: {o:?}");
    let mut got = vec![0u8; LEN];
    back.region().read_at(0, &mut got)?;
    ensure!(got.iter().all(|&b| b == fill), "wrong bytes read back");
    Ok(())
}

/// The header of a frame of kind `kind` announcing `body_len` bytes.
fn header(kind: &ControlFrame, body_len: u32) -> Result<[u8; CONTROL_HEADER_LEN]> {
    let mut buf = Vec::new();
    kind.encode(1, &mut buf)?;
    let mut head: [u8; CONTROL_HEADER_LEN] = buf[..CONTROL_HEADER_LEN].try_into()?;
    head[8..12].copy_from_slice(&body_len.to_le_bytes());
    Ok(head)
}

fn an_auth_hello() -> ControlFrame {
    ControlFrame::AuthHello(ferry::core_types::wire::AuthHello {
        name: "alice".into(),
        peer_id: ferry::PeerId::random(),
        epoch: ferry::Epoch::fresh(),
        nonce: [0; 32],
    })
}

async fn on_plane(plane: DataPlane) -> Result<()> {
    // Long enough that no connection of the flood reaches it while the flood is measured.
    let (engine, _reg) = server(plane, Duration::from_secs(30))?;
    let addr: SocketAddr = engine.local_addr().context("listening")?;
    let client = TransferEngine::builder()
        .same_host(false)
        .data_plane(plane)
        .auth_keyring(Keyring::parse(ALICE)?)
        .build()?;
    let peer = client.connect(addr).await?;
    moves_bytes(&client, &peer, 0x11).await?;

    // A header announcing more than authentication needs: refused from the header alone (the
    // body is never sent; a server that waited for it would answer nothing).
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(PATIENCE))?;
    s.write_all(&header(&an_auth_hello(), MAX_PREAUTH_BODY + 1)?)?;
    let mut reply = Vec::new();
    s.read_to_end(&mut reply)?;
    let (frame, _) = ControlFrame::decode(&reply)?.context("no whole frame before the close")?;
    ensure!(
        matches!(&frame, ControlFrame::Reject(r) if r.message.contains("authentication required")),
        "{plane:?}: {frame:?}"
    );

    // A flood of idle connections: CAP of them wait in their handshake, the others are closed
    // at once; no connection costs a thread; the authenticated client moves bytes meanwhile.
    wait_for("the probe's connection to end", || {
        Ok(handshakes(&engine)?.pending == 0)
    })?;
    let before = threads()?;
    // Closed past the cap: the newest at once (a gate that refuses) or the oldest pending
    // (one that evicts, as the TCP listener's does); either way, one per connection past it.
    let closed = |h: &ferry::HandshakeDescription| h.refused + h.evicted;
    let closed_before = closed(&handshakes(&engine)?);
    let flood: Vec<TcpStream> = (0..FLOOD)
        .map(|_| TcpStream::connect(addr))
        .collect::<std::io::Result<_>>()?;
    let excess = (FLOOD - CAP) as u64;
    wait_for("the excess connections to be closed", || {
        Ok(closed(&handshakes(&engine)?) - closed_before >= excess)
    })?;
    let h = handshakes(&engine)?;
    ensure!(
        h.pending == CAP as u64 && closed(&h) - closed_before == excess,
        "{plane:?}: {h:?}"
    );
    let during = threads()?;
    ensure!(
        during <= before + 2,
        "{plane:?}: {FLOOD} idle connections took the process from {before} to {during} threads"
    );
    moves_bytes(&client, &peer, 0x22).await?;
    drop(flood);
    wait_for("the flood's connections to end", || {
        Ok(handshakes(&engine)?.pending == 0)
    })?;

    // A client that trickles its hello, a byte at a time, is closed at the deadline.
    let timeout = Duration::from_secs(1);
    let (engine, _reg) = server(plane, timeout)?;
    let addr = engine.local_addr().context("listening")?;
    let mut hello = Vec::new();
    an_auth_hello().encode(1, &mut hello)?;
    let mut s = TcpStream::connect(addr)?;
    let start = Instant::now();
    let trickle = {
        let mut s = s.try_clone()?;
        std::thread::spawn(move || {
            for b in hello {
                if s.write_all(&[b]).is_err() {
                    return;
                }
                // The trickle's pace: well inside the deadline, so only the whole
                // handshake's deadline can end it.
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    wait_closed(&mut s)?;
    let took = start.elapsed();
    ensure!(
        took >= timeout,
        "{plane:?}: closed after {took:?}, before the deadline"
    );
    ensure!(
        handshakes(&engine)?.timed_out == 1,
        "{plane:?}: {:?}",
        handshakes(&engine)?
    );
    trickle
        .join()
        .map_err(|_| anyhow::anyhow!("trickle panicked"))?;

    // A key holder arriving while strangers hold every place gets in: where the gate evicts,
    // at once (the oldest stranger makes room); where it refuses, it tries again until the
    // strangers reach their deadline and the places free. (A deadline
    // long enough that the key holder's first try surely meets the full cap.)
    let (engine, _reg) = server(plane, Duration::from_secs(3))?;
    let addr = engine.local_addr().context("listening")?;
    let flood: Vec<TcpStream> = (0..CAP)
        .map(|_| TcpStream::connect(addr))
        .collect::<std::io::Result<_>>()?;
    wait_for("the flood to hold every place", || {
        Ok(handshakes(&engine)?.pending == CAP as u64)
    })?;
    let closed_before = closed(&handshakes(&engine)?);
    let late = TransferEngine::builder()
        .same_host(false)
        .data_plane(plane)
        .auth_keyring(Keyring::parse(ALICE)?)
        .connect_timeout(PATIENCE)
        .build()?;
    let peer = late.connect(addr).await?;
    ensure!(
        closed(&handshakes(&engine)?) > closed_before,
        "{plane:?}: the key holder was never refused nor made room for, so this tested nothing"
    );
    moves_bytes(&late, &peer, 0x33).await?;
    drop(flood);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_authentication_a_connection_is_bounded() -> Result<()> {
    for plane in planes() {
        on_plane(plane)
            .await
            .with_context(|| format!("{plane:?}"))?;
    }
    Ok(())
}

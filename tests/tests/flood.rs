//! A keyed TCP listener under a flood of idle connections, far more than its cap on connections
//! before their proof: a key holder still gets in, and moves bytes, every time. Past the cap the
//! listener closes the oldest pending connection of the source holding the most
//! (`HandshakeGate::admit_evicting`), so connections that arrived first and sit cannot keep a
//! newer one out; a client whose connection is closed before an answer tries again.
//!
//! Two floods: one from another source address (127.0.0.2: the listener's victims are always
//! the flood's), and one from the key holder's own address, paced, whose victims are the oldest
//! (the key holder's connection is the newest while it proves its key).
//!
//! The io_uring listener is covered by the same flood from another address. Both ends keep to
//! the network planes (`same_host(false)`): the gate on the TCP listener is what is tested.

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use ferry::core_types::auth::Keyring;
use ferry::{Access, Batch, DataPlane, MemoryRegion, TransferEngine};

const ALICE: &str = "alice 000102030405060708090a0b0c0d0e0f";
const LEN: usize = 64 << 10;
/// The cap on pending handshakes the server runs with.
const CAP: usize = 32;
/// The flood's first burst of idle connections.
const BURST: usize = 1500;
/// Idle connections a flood opens in all (and holds open to its end).
const TOTAL: usize = 4000;
/// Key holders that must all get in during a flood.
const RUNS: usize = 10;
/// Limit on waiting for an event that must come (a failure past it, never a pace).
const PATIENCE: Duration = Duration::from_secs(60);
/// A key holder's connect timeout: well under the listener's handshake deadline, so that only
/// a place made for it (never a flood connection's deadline) lets it in.
const KEY_HOLDER_PATIENCE: Duration = Duration::from_secs(20);

/// Raises this process's soft limit on descriptors to what the floods need (the hard limit
/// allowing), or fails saying why.
fn raise_fd_limit(need: u64) -> Result<()> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for getrlimit to fill.
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    ensure!(got == 0, "getrlimit: {}", std::io::Error::last_os_error());
    if lim.rlim_cur < need {
        lim.rlim_cur = need.min(lim.rlim_max);
        // SAFETY: `lim` is a valid rlimit within the hard limit.
        let set = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
        ensure!(set == 0, "setrlimit: {}", std::io::Error::last_os_error());
    }
    ensure!(
        lim.rlim_cur >= need,
        "the floods need {need} descriptors; the hard limit allows {}",
        lim.rlim_max
    );
    Ok(())
}

/// A flood of idle connections to `addr` from `from` on its own thread: `burst` at once, then
/// one every `pace` until [`TOTAL`], all held open until `stop`. Counts what it opened.
fn flood(
    addr: SocketAddr,
    from: IpAddr,
    burst: usize,
    pace: Duration,
    stop: Arc<AtomicBool>,
    opened: Arc<AtomicUsize>,
) -> std::thread::JoinHandle<Result<()>> {
    std::thread::spawn(move || -> Result<()> {
        let mut held = Vec::with_capacity(TOTAL);
        let open = || -> Result<TcpStream> {
            let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
            s.bind(&SocketAddr::new(from, 0).into())
                .with_context(|| format!("binding {from}"))?;
            s.connect(&addr.into())?;
            Ok(s.into())
        };
        while !stop.load(Ordering::Relaxed) && held.len() < TOTAL {
            held.push(open()?);
            opened.fetch_add(1, Ordering::Relaxed);
            if held.len() >= burst {
                // The flood's pace after its burst.
                std::thread::sleep(pace);
            }
        }
        // Held open, idle, until the test ends.
        while !stop.load(Ordering::Relaxed) {
            std::thread::park_timeout(Duration::from_millis(50));
        }
        drop(held);
        Ok(())
    })
}

fn server(metrics: bool, plane: DataPlane) -> Result<(TransferEngine, ferry::Registration)> {
    let mut b = TransferEngine::builder()
        .same_host(false)
        .listen("127.0.0.1:0".parse()?)
        .data_plane(plane)
        .auth_keyring(Keyring::parse(ALICE)?)
        // No flood connection reaches its deadline during the test: only eviction frees a place.
        .handshake_timeout(PATIENCE)
        .max_pending_handshakes(CAP);
    if metrics {
        b = b.metrics("127.0.0.1:0".parse()?);
    }
    let engine = b.build()?;
    let r = MemoryRegion::alloc_zeroed(LEN, 4096)?;
    let reg = engine.register(r, Access::REMOTE_READ | Access::REMOTE_WRITE, "open")?;
    Ok((engine, reg))
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

/// A fresh key holder on `plane` connects to `addr` and moves a WRITE then a READ of the whole
/// segment.
async fn key_holder_moves_bytes(addr: SocketAddr, plane: DataPlane, fill: u8) -> Result<()> {
    let client = TransferEngine::builder()
        .same_host(false)
        .data_plane(plane)
        .auth_keyring(Keyring::parse(ALICE)?)
        .connect_timeout(KEY_HOLDER_PATIENCE)
        .build()?;
    let peer = client.connect(addr).await.context("connect")?;
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

/// Runs [`RUNS`] key holders one after another while a flood from `from` goes on.
async fn key_holders_during_a_flood(
    plane: DataPlane,
    from: IpAddr,
    burst: usize,
    pace: Duration,
) -> Result<()> {
    let (engine, _reg) = server(false, plane)?;
    let addr = engine.local_addr().context("listening")?;
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicUsize::new(0));
    let flooding = flood(addr, from, burst, pace, stop.clone(), opened.clone());
    // The burst has filled every place and pushed the rest out before any key holder comes.
    let full = (burst - CAP) as u64;
    let res = async {
        wait_for("the burst to be closed past the cap", || {
            let h = handshakes(&engine)?;
            Ok(h.refused + h.evicted >= full)
        })?;
        for run in 0..RUNS {
            // The client speaks the listener's plane: both retry an attach closed unanswered.
            key_holder_moves_bytes(addr, plane, run as u8 + 1)
                .await
                .with_context(|| format!("key holder {} of {RUNS}", run + 1))?;
        }
        Ok::<_, anyhow::Error>(())
    }
    .await;
    stop.store(true, Ordering::Relaxed);
    flooding
        .join()
        .map_err(|_| anyhow::anyhow!("the flood panicked"))??;
    res?;
    let h = handshakes(&engine)?;
    ensure!(
        h.pending <= CAP as u64 && h.refused == 0,
        "flood from {from}: {h:?}"
    );
    ensure!(
        opened.load(Ordering::Relaxed) > burst,
        "the flood went on while the key holders came"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_holder_gets_in_ten_times_out_of_ten_during_a_flood() -> Result<()> {
    raise_fd_limit((TOTAL + 1024) as u64)?;
    // From another address, at full pace after the burst of 1,500.
    key_holders_during_a_flood(
        DataPlane::Tcp,
        [127, 0, 0, 2].into(),
        BURST,
        Duration::from_millis(1),
    )
    .await
    .context("flood from 127.0.0.2")?;
    // From the key holder's own address: its connection is the newest while it proves its key.
    key_holders_during_a_flood(
        DataPlane::Tcp,
        [127, 0, 0, 1].into(),
        BURST,
        Duration::from_millis(5),
    )
    .await
    .context("flood from 127.0.0.1")?;
    Ok(())
}

/// The io_uring listener's gate evicts as the TCP listener's does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_holder_gets_into_the_io_uring_listener_during_a_flood() -> Result<()> {
    if let Some(why) = ferry::probe_kernel().unusable_reason() {
        ferry_tests::require_or_skip(ferry_tests::URING, format!("io_uring unusable here: {why}"));
        return Ok(());
    }
    raise_fd_limit((TOTAL + 1024) as u64)?;
    key_holders_during_a_flood(
        DataPlane::Uring,
        [127, 0, 0, 2].into(),
        BURST,
        Duration::from_millis(1),
    )
    .await
    .context("flood from 127.0.0.2 against io_uring")?;
    Ok(())
}

/// A GET of `/metrics` at `addr`: the status line.
fn scrape(addr: SocketAddr) -> Result<String> {
    use std::io::{Read, Write};
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(PATIENCE))?;
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n")?;
    let mut all = String::new();
    s.read_to_string(&mut all)?;
    Ok(all.lines().next().unwrap_or_default().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_against_the_metrics_endpoint_leaves_scrapes_answered() -> Result<()> {
    raise_fd_limit((TOTAL + 1024) as u64)?;
    let (engine, _reg) = server(true, DataPlane::Tcp)?;
    let metrics = engine.metrics_addr().context("serves metrics")?;
    for from in [[127, 0, 0, 2], [127, 0, 0, 1]] {
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(AtomicUsize::new(0));
        let flooding = flood(
            metrics,
            from.into(),
            BURST,
            Duration::from_millis(2),
            stop.clone(),
            opened.clone(),
        );
        let res = tokio::task::spawn_blocking(move || -> Result<()> {
            wait_for("the burst", || Ok(opened.load(Ordering::Relaxed) >= BURST))?;
            for run in 0..RUNS {
                let status = scrape(metrics).with_context(|| format!("scrape {}", run + 1))?;
                ensure!(status == "HTTP/1.1 200 OK", "scrape {}: {status}", run + 1);
            }
            Ok(())
        })
        .await?;
        stop.store(true, Ordering::Relaxed);
        flooding
            .join()
            .map_err(|_| anyhow::anyhow!("the flood panicked"))??;
        res.with_context(|| format!("flood from {from:?}"))?;
    }
    Ok(())
}

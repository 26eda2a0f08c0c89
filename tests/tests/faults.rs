//! The fault suite: every fault, on every portable data plane, between two engines.
//!
//! A [`FaultProxy`] sits between a client engine and a server engine in this process (cut at byte
//! N, stall shorter and longer than the deadline, trickle, reset, half-close, each in the
//! direction the data flows), and real processes are killed (this binary re-run as the server,
//! or as a client, by `fault_child`). For each case the suite checks, and records as a row of
//! the table `cargo xtask faults` writes to docs/faults.md ([`FaultRow`]):
//!
//! - **outcome right**: the outcome's prefix is consistent (`completed_bytes` are the first
//!   `completed_ops` ops, the failure names the next op); every byte of a completed READ op is the
//!   source's, and no byte anywhere is neither old nor new; after a WRITE, completed ops hold the
//!   new bytes in the server's memory and the failed and later ops agree with `remote_effect`
//!   (`None`: not one new byte; `Certain`: some; `Uncertain`: either); and a second client on a
//!   clean path is served afterwards. The suite asserts success only where nothing stops it (a
//!   stall shorter than the deadline): elsewhere it checks the prefix and its bytes, so it stays
//!   right when the engine reconnects and replays (a replayed request may complete).
//! - **ended by deadline**: the request's outcome came within its deadline and a grace for a
//!   loaded machine ([`DEADLINE`], [`GRACE`]); for a killed client, the server let go of what it
//!   held within that time.
//! - **nothing leaked**: the request drained (the transport gave its buffers back); after the
//!   peers closed, this process's threads and descriptors returned to the baseline taken with
//!   the server idle (within [`SETTLE`]); the server's registration then retired at once (no
//!   lease left); client registrations retired too.
//!
//! The cases run one at a time (threads and descriptors are counted for the whole process).

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use ferry::{
    Access, Batch, DataPlane, MemoryRegion, OpKind, Outcome, Peer, Registration, RemoteEffect,
    TransferEngine,
};
use ferry_tests::proxy::{Dir, Fault, FaultProxy, Scope};
use ferry_tests::{Census, FaultRow, URING, pattern, require_or_skip, settle, thread_names};

/// One op of a proxied request.
const OP: u64 = 256 << 10;
/// Ops per proxied request.
const OPS: u64 = 8;
/// A proxied request's bytes.
const REQ: u64 = OP * OPS;
/// Ops of the requests a killed process leaves behind (1 MiB each).
const BIG_OPS: u64 = 32;
const BIG_OP: u64 = 1 << 20;
/// Where a fault acts: past this many bytes of a data stream's direction (each of the two
/// streams carries about half of a request), so that part of the request moved.
const AFTER: u64 = 600 << 10;
/// Pattern seeds: the READ source, the WRITE payload, the clean peer's.
const SRC: u64 = 0x5eed_0001;
const DST: u64 = 0x5eed_0002;
const CLEAN: u64 = 0x5eed_0003;
/// Every request's deadline.
const DEADLINE: Duration = Duration::from_secs(3);
/// What a loaded machine may add to it.
const GRACE: Duration = Duration::from_secs(3);
/// How long closed peers' threads and descriptors may take to go.
const SETTLE: Duration = Duration::from_secs(15);

/// The server's segment `data`: `[0, REQ)` holds pattern SRC (the READ source), `[REQ, 2 REQ)`
/// the inverse of DST (the WRITE target), `[2 REQ, 2 REQ + OP)` is the clean peer's.
const DATA: u64 = 2 * REQ + OP;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether the case running now (cases run one at a time, [`serial`]) is the same-host plane's:
/// its engines take process-to-process copies, with TCP beside them.
static SAME_HOST: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The data plane named `name` (`local`: the same-host plane, TCP beside it), or `None` (the
/// reason printed) where it cannot run here.
#[track_caller]
fn plane(name: &str) -> Option<DataPlane> {
    SAME_HOST.store(name == "local", std::sync::atomic::Ordering::SeqCst);
    match name {
        "tcp" | "local" => Some(DataPlane::Tcp),
        _ => match ferry::probe_kernel().unusable_reason() {
            Some(why) => {
                require_or_skip(URING, format!("io_uring unusable here: {why}"));
                None
            }
            None => Some(DataPlane::Uring),
        },
    }
}

/// This process's figures, less the test harness's own threads (one per case it has started,
/// waiting on [`serial`] or running: they come and go with the queue, not with Ferry).
fn census() -> Result<Census> {
    let mut c = Census::of_self()?;
    let names = thread_names();
    let harness = names
        .iter()
        .filter(|n| {
            n.starts_with("tcp::")
                || n.starts_with("uring::")
                || n.starts_with("local::")
                || *n == "fault_child"
        })
        .count();
    c.threads = (names.len() - harness) as u64;
    Ok(c)
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        // Blocking-pool threads would otherwise linger 10 s and read as a leak.
        .thread_keep_alive(Duration::from_millis(50))
        .enable_all()
        .build()?;
    // A new worker thread bears its parent's name (a case's) until it names itself: let both
    // get there before anything is counted.
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(200)).await });
    Ok(rt)
}

fn engine(plane: DataPlane, listen: bool) -> Result<TransferEngine> {
    let mut b = TransferEngine::builder()
        .same_host(SAME_HOST.load(std::sync::atomic::Ordering::SeqCst))
        .data_plane(plane)
        .streams(2);
    if listen {
        b = b.listen("127.0.0.1:0".parse()?);
    }
    Ok(b.build()?)
}

fn region(len: u64, seed: u64, offset: u64, inverse: bool) -> Result<MemoryRegion> {
    let r = MemoryRegion::alloc_zeroed(len as usize, 4096)?;
    let mut b = vec![0u8; len as usize];
    if inverse {
        pattern::fill_inverse(&mut b, seed, offset);
    } else {
        pattern::fill(&mut b, seed, offset);
    }
    r.write_at(0, &b)?;
    Ok(r)
}

fn bytes(r: &MemoryRegion, at: u64, len: u64) -> Result<Vec<u8>> {
    let mut b = vec![0u8; len as usize];
    r.read_at(at, &mut b)?;
    Ok(b)
}

/// The server of a case: an engine publishing `data` (and `big` of `BIG_OPS` MiB, the inverse
/// of DST, where a killed client writes).
struct Server {
    engine: TransferEngine,
    data: Option<Registration>,
    big: Option<Registration>,
}

impl Server {
    fn start(plane: DataPlane) -> Result<Self> {
        let engine = engine(plane, true)?;
        let data = region(DATA, SRC, 0, false)?;
        let mut target = vec![0u8; REQ as usize];
        pattern::fill_inverse(&mut target, DST, REQ);
        data.write_at(REQ, &target)?;
        let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
        let data = engine.register(data, rw, "data")?;
        let big = engine.register(region(BIG_OPS * BIG_OP, DST, 0, true)?, rw, "big")?;
        Ok(Self {
            engine,
            data: Some(data),
            big: Some(big),
        })
    }

    fn addr(&self) -> Result<SocketAddr> {
        self.engine
            .local_addr()
            .context("the server listens nowhere")
    }

    /// Retires both registrations and waits for the registry to let them go (no lease left).
    fn retire(&mut self) -> Result<bool> {
        for r in [self.data.take(), self.big.take()].into_iter().flatten() {
            r.retire()?;
        }
        let t = Instant::now();
        while self.engine.describe().registrations > 0 {
            if t.elapsed() > SETTLE {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(true)
    }
}

/// A clean peer (straight to the server): WRITEs pattern CLEAN into its range, READs it back
/// and checks it. `Ok(false)` when it was not served right.
async fn clean_peer(plane: DataPlane, addr: SocketAddr) -> Result<bool> {
    let client = engine(plane, false)?;
    let peer = client.connect(addr).await?;
    let data = peer.segment("data")?;
    let src = client.register(region(OP, CLEAN, 0, false)?, Access::LOCAL, "clean-src")?;
    let dst = client.register(region(OP, CLEAN, 0, true)?, Access::LOCAL, "clean-dst")?;
    let batch = Batch::new().timeout(DEADLINE);
    let w = client
        .submit(batch.write(&src, 0, &data, 2 * REQ, OP))?
        .await;
    let r = client
        .submit(
            Batch::new()
                .timeout(DEADLINE)
                .read(&dst, 0, &data, 2 * REQ, OP),
        )?
        .await;
    let ok = w.is_success()
        && r.is_success()
        && pattern::first_mismatch(&bytes(dst.region(), 0, OP)?, CLEAN, 0).is_none();
    peer.close();
    src.retire()?;
    dst.retire()?;
    Ok(ok && client.describe().registrations == 0)
}

/// Takes the baseline: a clean peer first (lazily started threads of the server exist from then
/// on), then the process's figures once it has gone.
async fn baseline(plane: DataPlane, server: &Server) -> Result<Census> {
    ensure!(
        clean_peer(plane, server.addr()?).await?,
        "the clean peer was not served before any fault"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    census()
}

/// What one request did.
struct Ran {
    outcome: Option<Outcome>,
    elapsed: Duration,
    drained: bool,
}

impl Ran {
    fn by_deadline(&self) -> bool {
        self.outcome.is_some() && self.elapsed <= DEADLINE + GRACE
    }
}

/// Submits `batch`, waits for its outcome (a hang is cut off after the deadline and a long
/// wait), then calls `release` (ends what holds the connection: the proxy's stall) and waits
/// for the drain.
async fn run(client: &TransferEngine, batch: Batch, release: impl FnOnce()) -> Result<Ran> {
    let t = Instant::now();
    let handle = client.submit(batch)?;
    let canceller = handle.canceller();
    let drained = handle.drained();
    let outcome = tokio::time::timeout(DEADLINE + Duration::from_secs(20), handle)
        .await
        .ok();
    let elapsed = t.elapsed();
    if outcome.is_none() {
        canceller.cancel();
    }
    release();
    let drained = tokio::time::timeout(SETTLE, drained).await.is_ok();
    Ok(Ran {
        outcome,
        elapsed,
        drained,
    })
}

/// Whether the outcome's own accounting holds: the completed prefix's bytes, the failure at the
/// op after it, success only with every op.
fn prefix_consistent(o: &Outcome, op: u64, ops: u64) -> bool {
    o.completed_bytes == o.completed_ops as u64 * op
        && match o.failure {
            None => o.completed_ops as u64 == ops && o.remote_effect == RemoteEffect::None,
            Some(f) => f.op_index == o.completed_ops && (o.completed_ops as u64) < ops,
        }
}

/// A READ's local bytes (which held the inverse of SRC): every completed op the source's, and no
/// byte anywhere neither.
fn read_right(o: &Outcome, local: &MemoryRegion, op: u64, ops: u64) -> Result<bool> {
    let done = o.completed_ops as u64 * op;
    let all = bytes(local, 0, op * ops)?;
    let head = pattern::mix(&all[..done as usize], SRC, 0);
    let tail = pattern::mix(&all[done as usize..], SRC, done);
    Ok(head.new == done && head.corrupt_at.is_none() && tail.corrupt_at.is_none())
}

/// A WRITE's effect in the server's memory at `at` (which held the inverse of DST): completed ops
/// new, the rest as `remote_effect` says, no byte neither.
fn write_right(o: &Outcome, remote: &MemoryRegion, at: u64, op: u64, ops: u64) -> Result<bool> {
    let done = o.completed_ops as u64 * op;
    let all = bytes(remote, at, op * ops)?;
    let head = pattern::mix(&all[..done as usize], DST, at);
    let tail = pattern::mix(&all[done as usize..], DST, at + done);
    let effect_true = match o.remote_effect {
        RemoteEffect::None => tail.new == 0,
        RemoteEffect::Certain => tail.new > 0,
        RemoteEffect::Uncertain => true,
    };
    Ok(head.new == done && head.corrupt_at.is_none() && tail.corrupt_at.is_none() && effect_true)
}

fn describe(o: &Option<Outcome>, ops: u64) -> String {
    match o {
        None => "no outcome (hung)".into(),
        Some(o) => match o.failure {
            None => format!("{ops}/{ops} ops done"),
            Some(f) => format!(
                "{}/{ops} ops, {}, effect {:?}",
                o.completed_ops, f.kind, o.remote_effect
            ),
        },
    }
}

/// The direction a request's data flows in.
fn data_dir(kind: OpKind) -> Dir {
    match kind {
        OpKind::Read => Dir::ToClient,
        _ => Dir::ToTarget,
    }
}

/// A proxied fault on `plane_name`: a READ, then a WRITE, each from a fresh client engine
/// through the proxy with `fault` in the data's direction; then a clean peer; then the leak
/// checks. `must_succeed`: nothing stops the request (a short stall).
fn proxied(plane_name: &str, name: &str, fault: Fault, must_succeed: bool) -> Result<()> {
    let _one = serial();
    let Some(plane) = plane(plane_name) else {
        return Ok(());
    };
    let rt = runtime()?;
    let _in_rt = rt.enter();
    let mut server = Server::start(plane)?;
    let base = rt.block_on(baseline(plane, &server))?;
    let proxy = Arc::new(FaultProxy::start(server.addr()?)?);
    let data_region = server.data.as_ref().context("data")?.region().clone();
    let (mut right, mut by_deadline, mut drained, mut notes) = (true, true, true, Vec::new());
    let mut clients = Vec::new();
    for kind in [OpKind::Read, OpKind::Write] {
        let client = engine(plane, false)?;
        let peer: Peer = rt.block_on(client.connect(proxy.addr()))?;
        let data = peer.segment("data")?;
        let (local, at) = match kind {
            OpKind::Read => (region(REQ, SRC, 0, true)?, 0),
            _ => (region(REQ, DST, REQ, false)?, REQ),
        };
        let local = client.register(local, Access::LOCAL, "local")?;
        let mut batch = Batch::new().timeout(DEADLINE);
        for i in 0..OPS {
            batch.push(kind, &local, i * OP, &data, at + i * OP, OP);
        }
        let rule = proxy.inject(Scope::All, data_dir(kind), fault);
        let p = proxy.clone();
        let ran = rt.block_on(run(&client, batch, move || {
            p.remove(rule);
            p.kill_all();
        }))?;
        by_deadline &= ran.by_deadline();
        drained &= ran.drained;
        notes.push(format!(
            "{}: {}",
            if kind == OpKind::Read {
                "READ"
            } else {
                "WRITE"
            },
            describe(&ran.outcome, OPS)
        ));
        match &ran.outcome {
            None => right = false,
            Some(o) => {
                right &= prefix_consistent(o, OP, OPS) && (!must_succeed || o.is_success());
                if kind == OpKind::Read {
                    right &= read_right(o, local.region(), OP, OPS)?;
                }
            }
        }
        clients.push((client, peer, local, kind, ran.outcome));
    }
    let served = rt.block_on(clean_peer(plane, server.addr()?))?;
    right &= served;
    // Close every client, then count.
    let mut writes = Vec::new();
    for (client, peer, local, kind, outcome) in clients {
        peer.close();
        local.retire()?;
        drained &= client.describe().registrations == 0;
        if let (OpKind::Write, Some(o)) = (kind, outcome) {
            writes.push(o);
        }
    }
    drop(proxy);
    let (now, back) = settle(base, SETTLE, census)?;
    // Served streams are gone: the server's memory holds all the WRITE did.
    for o in &writes {
        right &= write_right(o, &data_region, REQ, OP, OPS)?;
    }
    let retired = server.retire()?;
    drop(server);
    let row = FaultRow {
        fault: name.into(),
        plane: plane_name.into(),
        outcome_right: right,
        by_deadline,
        nothing_leaked: back && retired && drained,
        note: format!(
            "{}; clean peer {}; {} vs baseline {}{}",
            notes.join("; "),
            if served { "served" } else { "NOT served" },
            now,
            base,
            if drained {
                ""
            } else {
                "; a request did not drain"
            }
        ),
    };
    finish(row)
}

fn finish(row: FaultRow) -> Result<()> {
    eprintln!("{row:?}");
    row.record()?;
    ensure!(row.passed(), "fault case failed: {row:?}");
    Ok(())
}

// ---------------------------------------------------------------- processes

/// This binary re-run as the child of a process case (`FERRY_FAULT_CHILD`: `server` or `client`).
fn spawn_child(kind: &str, plane: &str, addr: Option<SocketAddr>) -> Result<(Child, String)> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["--exact", "fault_child", "--nocapture", "--test-threads=1"])
        .env("FERRY_FAULT_CHILD", kind)
        .env("FERRY_FAULT_PLANE", plane)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    if let Some(a) = addr {
        cmd.env("FERRY_FAULT_ADDR", a.to_string());
    }
    let mut child = cmd.spawn()?;
    let stdout = child.stdout.take().context("child stdout")?;
    // Read on a thread, so that a child that never gets ready fails the case instead of hanging.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // libtest may print "test fault_child ... " on the same line first.
            if let Some((_, l)) = line.split_once("READY ") {
                let _ = tx.send(l.trim().to_owned());
                break;
            }
        }
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(line) => Ok((child, line)),
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("the {kind} child was not ready within a minute ({e})")
        }
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on the pid of a child we spawned and have not reaped; no memory involved.
    unsafe {
        libc::kill(child.id() as i32, sig);
    }
}

/// The child side: `server` publishes `big` (pattern SRC) and prints `READY addr`, then serves
/// until killed or stdin closes; `client` connects to `FERRY_FAULT_ADDR`, prints `READY` after
/// its first WRITE of `big` completed, and keeps WRITEing it, the new bytes and the old in turn,
/// until killed.
#[test]
fn fault_child() -> Result<()> {
    let Ok(kind) = std::env::var("FERRY_FAULT_CHILD") else {
        return Ok(());
    };
    let plane = plane(&std::env::var("FERRY_FAULT_PLANE")?).context("plane")?;
    let rt = runtime()?;
    let _in_rt = rt.enter();
    rt.block_on(async {
        if kind == "server" {
            let e = engine(plane, true)?;
            let _big = e.register(
                region(BIG_OPS * BIG_OP, SRC, 0, false)?,
                Access::REMOTE_READ,
                "big",
            )?;
            println!("READY {}", e.local_addr().context("no address")?);
            std::io::stdout().flush()?;
            tokio::task::spawn_blocking(|| {
                let _ = std::io::stdin().lines().count();
            })
            .await?;
            return Ok(());
        }
        let addr: SocketAddr = std::env::var("FERRY_FAULT_ADDR")?.parse()?;
        let e = engine(plane, false)?;
        let peer = e.connect(addr).await?;
        let big = peer.segment("big")?;
        // The new bytes and the old in turn, so that the server's memory is a mixture when the
        // kill lands, and any other byte is corruption.
        let new = e.register(
            region(BIG_OPS * BIG_OP, DST, 0, false)?,
            Access::LOCAL,
            "new",
        )?;
        let old = e.register(
            region(BIG_OPS * BIG_OP, DST, 0, true)?,
            Access::LOCAL,
            "old",
        )?;
        for n in 0.. {
            let local = if n % 2 == 0 { &new } else { &old };
            let mut batch = Batch::new();
            for i in 0..BIG_OPS {
                batch.push(OpKind::Write, local, i * BIG_OP, &big, i * BIG_OP, BIG_OP);
            }
            let o = e.submit(batch)?.await;
            ensure!(o.is_success(), "the child's WRITE failed: {o:?}");
            if n == 0 {
                println!("READY writing");
                std::io::stdout().flush()?;
            }
        }
        Ok(())
    })
}

/// The server process is killed (stopped first, so that the kill lands mid-request) while a
/// READ of `BIG_OPS` MiB from it runs: the prefix is right, the request ends by its deadline, and
/// the client process gets back to its baseline once the engine is dropped.
fn server_killed(plane_name: &str) -> Result<()> {
    let _one = serial();
    let Some(plane) = plane(plane_name) else {
        return Ok(());
    };
    let rt = runtime()?;
    let _in_rt = rt.enter();
    let base = census()?;
    let base_threads = thread_names();
    let (mut child, addr) = spawn_child("server", plane_name, None)?;
    let addr: SocketAddr = addr.parse()?;
    let client = engine(plane, false)?;
    let peer = rt.block_on(client.connect(addr))?;
    ensure!(
        (plane_name == "local") == (peer.transport() == ferry::TransportKind::Local),
        "the {plane_name} case runs over {}",
        peer.transport()
    );
    let big = peer.segment("big")?;
    let local = client.register(region(BIG_OPS * BIG_OP, SRC, 0, true)?, Access::LOCAL, "l")?;
    let mut batch = Batch::new().timeout(DEADLINE);
    for i in 0..BIG_OPS {
        batch.push(OpKind::Read, &local, i * BIG_OP, &big, i * BIG_OP, BIG_OP);
    }
    let t = Instant::now();
    let handle = client.submit(batch)?;
    while handle.progress().completed_ops == 0 && t.elapsed() < DEADLINE {
        std::thread::sleep(Duration::from_micros(200));
    }
    signal(&child, libc::SIGSTOP);
    let at_kill = handle.progress().completed_ops;
    child.kill()?;
    child.wait()?;
    let drained = handle.drained();
    let outcome = rt.block_on(async {
        tokio::time::timeout(DEADLINE + Duration::from_secs(20), handle)
            .await
            .ok()
    });
    let elapsed = t.elapsed();
    let drained = rt.block_on(tokio::time::timeout(SETTLE, drained)).is_ok();
    let ran = Ran {
        outcome,
        elapsed,
        drained,
    };
    let right = match &ran.outcome {
        // Ops may still complete after the kill: what the server had sent before SIGSTOP sits
        // in the sockets' buffers and arrives anyway. Right is: a prefix (a success only with
        // every op completed), every completed op's bytes correct, and nothing completed lost.
        Some(o) => {
            prefix_consistent(o, BIG_OP, BIG_OPS)
                && read_right(o, local.region(), BIG_OP, BIG_OPS)?
                && o.completed_ops >= at_kill
        }
        None => false,
    };
    peer.close();
    local.retire()?;
    let retired = client.describe().registrations == 0;
    // The segment handle holds the peer's channel: all must go before counting.
    drop((big, peer, client));
    let (now, back) = settle(base, SETTLE, census)?;
    finish(FaultRow {
        fault: "server process killed".into(),
        plane: plane_name.into(),
        outcome_right: right,
        by_deadline: ran.by_deadline(),
        nothing_leaked: back && retired && ran.drained,
        note: format!(
            "READ: {} ({at_kill} done when it was stopped); no server left to serve others; \
             client process {now} vs baseline {base}{}",
            describe(&ran.outcome, BIG_OPS),
            if back {
                String::new()
            } else {
                format!(" (threads {:?}, before {base_threads:?})", thread_names())
            }
        ),
    })
}

/// A client process is killed while it WRITEs `BIG_OPS` MiB in a loop: the server lets go of
/// everything it held (its memory holds only old or new bytes, its registration retires, its
/// threads and descriptors come back), and serves a clean peer.
fn client_killed(plane_name: &str) -> Result<()> {
    let _one = serial();
    let Some(plane) = plane(plane_name) else {
        return Ok(());
    };
    let rt = runtime()?;
    let _in_rt = rt.enter();
    let mut server = Server::start(plane)?;
    let base = rt.block_on(baseline(plane, &server))?;
    let big = server.big.as_ref().context("big")?.region().clone();
    let (mut child, _) = spawn_child("client", plane_name, Some(server.addr()?))?;
    std::thread::sleep(Duration::from_millis(20));
    child.kill()?;
    child.wait()?;
    let t = Instant::now();
    let (now, back) = settle(base, SETTLE, census)?;
    let released = t.elapsed();
    let served = rt.block_on(clean_peer(plane, server.addr()?))?;
    let m = pattern::mix(&bytes(&big, 0, BIG_OPS * BIG_OP)?, DST, 0);
    let retired = server.retire()?;
    drop(server);
    finish(FaultRow {
        fault: "client process killed mid-WRITE".into(),
        plane: plane_name.into(),
        outcome_right: served && m.corrupt_at.is_none(),
        by_deadline: back && released <= DEADLINE + GRACE,
        nothing_leaked: back && retired,
        note: format!(
            "server memory: {} new, {} old bytes, {}; released in {:.1}s; clean peer {}; \
             {now} vs baseline {base}",
            m.new,
            m.old,
            if m.corrupt_at.is_none() {
                "none corrupt"
            } else {
                "CORRUPT"
            },
            released.as_secs_f64(),
            if served { "served" } else { "NOT served" }
        ),
    })
}

// ---------------------------------------------------------------- the cases

/// Each case as a test on each data plane: `tcp::cut`, `uring::cut`, ...
macro_rules! cases {
    ($($test:ident => $body:expr;)*) => {
        mod tcp {
            use super::*;
            $(#[test] fn $test() -> Result<()> { ($body)("tcp") })*
        }
        mod uring {
            use super::*;
            $(#[test] fn $test() -> Result<()> { ($body)("uring") })*
        }
    };
}

cases! {
    cut => |p| proxied(p, "cut at byte N", Fault::Cut { after: AFTER }, false);
    reset => |p| proxied(p, "reset at byte N", Fault::Reset { after: AFTER }, false);
    half_close => |p| proxied(p, "half-close at byte N", Fault::HalfClose { after: AFTER }, false);
    stall_short => |p| proxied(
        p,
        "stall 1 s (deadline 3 s)",
        Fault::Stall { after: AFTER, duration: Some(Duration::from_secs(1)) },
        true,
    );
    stall_long => |p| proxied(
        p,
        "stall past the deadline",
        Fault::Stall { after: AFTER, duration: None },
        false,
    );
    trickle => |p| proxied(p, "trickle at 64 KiB/s", Fault::Trickle { bytes_per_sec: 64 << 10 }, false);
    server_process_killed => server_killed;
    client_process_killed => client_killed;
}

/// The process cases on the same-host plane (the link faults need a proxy in the path, which
/// process-to-process copies do not take).
mod local {
    use super::*;

    #[test]
    fn server_process_killed() -> Result<()> {
        server_killed("local")
    }

    #[test]
    fn client_process_killed() -> Result<()> {
        client_killed("local")
    }
}

//! Two processes over loopback: this test binary re-runs itself as the serving child
//! (`child_server` / `child_trap_server`, active only with `FERRY_TEST_CHILD` set).
//!
//! The key cases run over each portable data plane pairing: TCP to TCP, io_uring to io_uring,
//! and both mixed directions (the child serves with `FERRY_TEST_DATA_PLANE`), plus file
//! segments published by an io_uring child and READ by TCP and io_uring clients.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use ferry::core_types::wire::{SUPPORTED_VERSIONS, TransportOffer, VersionRange};
use ferry::core_types::{SegmentLease, SegmentTable};
use ferry::{
    Access, Batch, DataPlane, Epoch, Error, FailureKind, MemoryRegion, PeerId, RemoteEffect,
    RemoteStatus, SegmentDesc, SegmentToken, TransferEngine, TransportKind,
};
use ferry_tests::{Netns, URING, require_or_skip};

mod common;

const BIG: usize = (256 << 20) + 64;

// ---------------------------------------------------------------- the child side

/// Child: an engine serving segments named in `FERRY_TEST_SEGMENTS` (`name=size:access,...`,
/// access `r`, `w` or `rw`) and file segments in `FERRY_TEST_FILES` (`name=path:access,...`), on
/// `FERRY_TEST_LISTEN` (default 127.0.0.1:0), with the data plane `FERRY_TEST_DATA_PLANE`
/// (default tcp), speaking `FERRY_TEST_VERSIONS` (`min-max`). Prints `LISTEN addr`; reads
/// `retire NAME` lines on stdin and answers `RETIRED NAME`; exits on EOF.
#[test]
fn child_server() -> Result<()> {
    if std::env::var("FERRY_TEST_CHILD").as_deref() != Ok("server") {
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listen: SocketAddr = std::env::var("FERRY_TEST_LISTEN")
            .unwrap_or_else(|_| "127.0.0.1:0".into())
            .parse()?;
        let mut b = TransferEngine::builder()
            .same_host(false)
            .listen(listen)
            .streams(4)
            .data_plane(env_data_plane()?);
        if let Ok(v) = std::env::var("FERRY_TEST_VERSIONS") {
            let (a, z) = v.split_once('-').context("versions")?;
            b = b.protocol_versions(VersionRange {
                min: a.parse()?,
                max: z.parse()?,
            });
        }
        let engine = b.build()?;
        let mut regs = Vec::new();
        for spec in std::env::var("FERRY_TEST_SEGMENTS")
            .unwrap_or_default()
            .split(',')
            .filter(|s| !s.is_empty())
        {
            let (name, rest) = spec.split_once('=').context("segment spec")?;
            let (size, acc) = rest.split_once(':').context("segment spec")?;
            let access = parse_access(acc);
            let region = MemoryRegion::alloc_zeroed(size.parse()?, 4096)?;
            regs.push((name.to_owned(), engine.register(region, access, name)?));
        }
        let _files = publish_files(&engine)?;
        println!(
            "LISTEN {}",
            engine.local_addr().context("no listen address")?
        );
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        // Serve until stdin closes.
        while let Some(line) = rx.recv().await {
            if let Some(name) = line.strip_prefix("retire ") {
                let pos = regs.iter().position(|(n, _)| n == name);
                if let Some(i) = pos {
                    regs.remove(i).1.retire()?;
                }
                println!("RETIRED {name}");
            }
        }
        Ok(())
    })
}

/// Publishes the file segments of `FERRY_TEST_FILES` (`name=path:access,...`).
#[cfg_attr(not(feature = "uring"), allow(clippy::never_loop, unused_mut))]
fn publish_files(engine: &TransferEngine) -> Result<Vec<Box<dyn std::any::Any>>> {
    let mut files: Vec<Box<dyn std::any::Any>> = Vec::new();
    for spec in std::env::var("FERRY_TEST_FILES")
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
    {
        let (name, rest) = spec.split_once('=').context("file spec")?;
        let (path, acc) = rest.rsplit_once(':').context("file spec")?;
        let access = parse_access(acc);
        #[cfg(feature = "uring")]
        files.push(Box::new(engine.publish_file_named(path, access, name)?));
        #[cfg(not(feature = "uring"))]
        bail!("file segment {name}={path} ({access}) needs the uring feature for {engine:?}");
    }
    Ok(files)
}

fn parse_access(acc: &str) -> Access {
    match acc {
        "r" => Access::REMOTE_READ,
        "w" => Access::REMOTE_WRITE,
        _ => Access::REMOTE_READ | Access::REMOTE_WRITE,
    }
}

/// The child's data plane (`FERRY_TEST_DATA_PLANE`, default tcp).
fn env_data_plane() -> Result<DataPlane> {
    let v = std::env::var("FERRY_TEST_DATA_PLANE").unwrap_or_else(|_| "tcp".into());
    DataPlane::parse(&v).with_context(|| format!("FERRY_TEST_DATA_PLANE={v}"))
}

#[derive(Debug)]
struct TrapTable {
    ok: (SegmentToken, Arc<MemoryRegion>),
    trap: SegmentToken,
}

impl SegmentTable for TrapTable {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        if token == self.trap {
            // Stall forever: the parent kills this process while the chunk is in flight.
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        (token == self.ok.0).then(|| SegmentLease {
            region: self.ok.1.clone(),
            base: 0,
            len: self.ok.1.len() as u64,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            guard: None,
        })
    }
    fn published(&self) -> Vec<SegmentDesc> {
        [("ok", self.ok.0), ("trap", self.trap)]
            .into_iter()
            .map(|(name, token)| SegmentDesc {
                name: name.into(),
                token,
                len: 1 << 20,
                access: Access::REMOTE_READ | Access::REMOTE_WRITE,
                remote_keys: vec![],
            })
            .collect()
    }
}

/// Child: a raw server (the TCP transport's, or the io_uring one with
/// `FERRY_TEST_DATA_PLANE=uring`) whose `trap` segment stalls the stream that touches it.
#[test]
fn child_trap_server() -> Result<()> {
    if std::env::var("FERRY_TEST_CHILD").as_deref() != Ok("trap") {
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let table = Arc::new(TrapTable {
            ok: (
                SegmentToken::random(),
                Arc::new(MemoryRegion::alloc_zeroed(1 << 20, 4096)?),
            ),
            trap: SegmentToken::random(),
        });
        let responder = Arc::new(common::Responder {
            id: PeerId::random(),
            epoch: Epoch::fresh(),
            versions: SUPPORTED_VERSIONS,
            table: table.clone(),
            offer: TransportOffer::Tcp {
                streams: 1,
                port: 0,
            },
        });
        let addr = "127.0.0.1:0".parse()?;
        let _h: Box<dyn std::any::Any> = if env_data_plane()? == DataPlane::Uring {
            #[cfg(feature = "uring")]
            {
                let server = ferry_transport_uring::UringServer::bind(addr)?;
                println!("LISTEN {}", server.local_addr());
                Box::new(server.serve(
                    table,
                    responder,
                    ferry_transport_uring::UringConfig::default(),
                )?)
            }
            #[cfg(not(feature = "uring"))]
            bail!("a uring trap server needs the uring feature")
        } else {
            let server = ferry_transport_tcp::TcpServer::bind(addr)?;
            println!("LISTEN {}", server.local_addr());
            Box::new(server.serve(table, responder, ferry_transport_tcp::TcpConfig::default()))
        };
        tokio::task::spawn_blocking(|| for _ in std::io::stdin().lock().lines() {}).await?;
        Ok(())
    })
}

// ---------------------------------------------------------------- the parent side

struct ChildProc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
    addr: SocketAddr,
}

impl ChildProc {
    fn spawn(kind: &str, envs: &[(&str, &str)]) -> Result<Self> {
        Self::spawn_in(None, kind, envs)
    }

    /// As [`ChildProc::spawn`], inside the network namespace `netns` if given.
    fn spawn_in(netns: Option<&Netns>, kind: &str, envs: &[(&str, &str)]) -> Result<Self> {
        let test = match kind {
            "trap" => "child_trap_server",
            _ => "child_server",
        };
        let exe = std::env::current_exe()?;
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &ns.name]).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env("FERRY_TEST_CHILD", kind)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn()?;
        let stdin = child.stdin.take();
        let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
        let addr = loop {
            let line = lines.next().context("child exited before listening")??;
            // libtest may print "test child_server ... " on the same line first.
            if let Some((_, a)) = line.split_once("LISTEN ") {
                break a.trim().parse()?;
            }
        };
        Ok(Self {
            child,
            stdin,
            lines,
            addr,
        })
    }

    fn command(&mut self, cmd: &str, expect: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().context("stdin")?;
        writeln!(stdin, "{cmd}")?;
        stdin.flush()?;
        for line in self.lines.by_ref() {
            if line?.contains(expect) {
                return Ok(());
            }
        }
        bail!("child exited before answering {cmd:?}")
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        self.stdin.take();
        self.kill();
    }
}

fn fill(r: &MemoryRegion, seed: u64) -> Result<()> {
    let mut x = seed | 1;
    let mut buf = vec![0u8; r.len()];
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
    r.write_at(0, &buf)?;
    Ok(())
}

fn bytes(r: &MemoryRegion, at: u64, len: u64) -> Result<Vec<u8>> {
    let mut v = vec![0u8; len as usize];
    r.read_at(at, &mut v)?;
    Ok(v)
}

fn client(plane: DataPlane) -> Result<TransferEngine> {
    Ok(TransferEngine::builder()
        .same_host(false)
        .streams(2)
        .data_plane(plane)
        .build()?)
}

fn plane_env(plane: DataPlane) -> &'static str {
    match plane {
        DataPlane::Uring => "uring",
        _ => "tcp",
    }
}

/// Whether io_uring tests must skip here (prints why; fails the test instead with
/// `FERRY_REQUIRE_URING=1`).
#[track_caller]
fn uring_unusable() -> bool {
    #[cfg(feature = "uring")]
    {
        match ferry::probe_kernel().unusable_reason() {
            Some(why) => {
                require_or_skip(URING, format!("io_uring unusable here: {why}"));
                true
            }
            None => false,
        }
    }
    #[cfg(not(feature = "uring"))]
    {
        require_or_skip(URING, "built without the uring feature");
        true
    }
}

/// Runs `case(client, server)` with io_uring on both ends and in each mixed direction (skipped,
/// with the reason printed, where io_uring is unusable).
async fn in_every_uring_pairing<F, Fut>(case: F) -> Result<()>
where
    F: Fn(DataPlane, DataPlane) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    if uring_unusable() {
        return Ok(());
    }
    for (c, s) in [
        (DataPlane::Uring, DataPlane::Uring),
        (DataPlane::Uring, DataPlane::Tcp),
        (DataPlane::Tcp, DataPlane::Uring),
    ] {
        case(c, s)
            .await
            .with_context(|| format!("client {c:?}, server {s:?}"))?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_then_read_back_many_sizes() -> Result<()> {
    round_trip(DataPlane::Tcp, DataPlane::Tcp, u64::MAX).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uring_to_uring_write_then_read_back_many_sizes() -> Result<()> {
    if uring_unusable() {
        return Ok(());
    }
    round_trip(DataPlane::Uring, DataPlane::Uring, u64::MAX).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uring_client_tcp_server_write_then_read_back() -> Result<()> {
    if uring_unusable() {
        return Ok(());
    }
    round_trip(DataPlane::Uring, DataPlane::Tcp, 17 << 20).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_client_uring_server_write_then_read_back() -> Result<()> {
    if uring_unusable() {
        return Ok(());
    }
    round_trip(DataPlane::Tcp, DataPlane::Uring, 17 << 20).await
}

/// WRITE then READ back random data at the sizes and offsets up to `max` bytes, `client` engine
/// against a child serving with `server`.
async fn round_trip(client_plane: DataPlane, server: DataPlane, max: u64) -> Result<()> {
    round_trip_via(None, client_plane, server, max).await
}

/// [`round_trip`] with the child in the namespace `net` if given (reached over its veth link).
async fn round_trip_via(
    net: Option<&Netns>,
    client_plane: DataPlane,
    server: DataPlane,
    max: u64,
) -> Result<()> {
    let size = BIG.min(usize::try_from(max)?.saturating_add(1 << 20));
    let listen = net.map(|n| format!("{}:0", n.peer));
    let mut envs = vec![
        ("FERRY_TEST_SEGMENTS", format!("data={size}:rw")),
        ("FERRY_TEST_DATA_PLANE", plane_env(server).to_owned()),
    ];
    envs.extend(listen.map(|l| ("FERRY_TEST_LISTEN", l)));
    let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let child = ChildProc::spawn_in(net, "server", &envs)?;
    let engine = client(client_plane)?;
    let peer = engine.connect(child.addr).await?;
    let remote = peer.segment("data")?;
    assert_eq!(remote.len(), size as u64);
    let src = engine.register(
        MemoryRegion::alloc_zeroed(size, 4096)?,
        Access::LOCAL,
        "src",
    )?;
    let dst = engine.register(
        MemoryRegion::alloc_zeroed(size, 4096)?,
        Access::LOCAL,
        "dst",
    )?;
    fill(src.region(), 0x5eed)?;
    let cases: &[(u64, u64, u64)] = &[
        (0, 0, 1),
        (1, 3, 2),
        (5, 4093, 4095),
        (13, 7, 4097),
        (4095, 1, 65_537),
        (3, 12_345, (1 << 20) + 3),
        (7, 999_999, (16 << 20) + 5),
        (17, 29, (256 << 20) - 13),
    ];
    for &(lo, ro, len) in cases.iter().filter(|c| c.2 <= max) {
        let o = engine
            .submit(Batch::new().write(&src, lo, &remote, ro, len))?
            .await;
        assert!(o.is_success(), "write {len}: {o:?}");
        assert_eq!((o.completed_ops, o.completed_bytes), (1, len));
        let h = engine.submit(Batch::new().read(&dst, lo + 1, &remote, ro, len))?;
        let drained = h.drained();
        let o = h.await;
        assert!(o.is_success(), "read {len}: {o:?}");
        assert!(drained.await.drained);
        assert!(
            bytes(dst.region(), lo + 1, len)? == bytes(src.region(), lo, len)?,
            "bytes differ after a round trip of {len} bytes at {lo}/{ro}"
        );
    }
    // A batch of many small ops, mixed directions.
    let mut b = Batch::new();
    for i in 0..64u64 {
        b = b.write(&src, i * 1000, &remote, i * 3001, 999 + i);
    }
    let o = engine.submit(b)?.await;
    assert!(o.is_success() && o.completed_ops == 64, "{o:?}");
    let d = engine.describe();
    let route = &d.routes[0];
    assert_eq!(route.transport, plane_env(client_plane));
    assert_eq!(
        peer.transport(),
        match client_plane {
            DataPlane::Uring => TransportKind::Uring,
            _ => TransportKind::Tcp,
        }
    );
    assert!(route.ops >= 17 && route.errors == 0, "{route:?}");
    if client_plane == DataPlane::Uring {
        let io = d
            .data_plane_io
            .context("no io_uring counters in describe()")?;
        let zc = io_counter(&io, "zc sends")?;
        if net.is_none() {
            // Loopback WRITEs go by page reference (SEND_ZC would be copied by the kernel).
            assert_eq!(zc, 0, "{io}");
        } else if io.contains("SEND_ZC on") {
            // Over a network WRITE payloads go out with SEND_ZC, and every request drained
            // above waited for its notifications.
            assert!(zc > 0, "{io}");
            assert_eq!(io_counter(&io, "notifications")?, zc, "{io}");
        }
    }
    Ok(())
}

/// The number after `name` in a `describe()` counter line (`..., zc sends 12, ...`).
fn io_counter(line: &str, name: &str) -> Result<u64> {
    let at = line
        .find(name)
        .with_context(|| format!("no {name:?} in {line:?}"))?;
    let digits: String = line[at + name.len()..]
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .with_context(|| format!("no count after {name:?} in {line:?}"))
}

/// Every data plane pairing across a veth link into a namespace of the test's own: 1500-byte
/// segments and a peer that is not loopback (so the io_uring client takes its network settings:
/// SEND_ZC, the half-window hold rule, no splice, no pinning). Sizes up to 17 MiB, compared
/// byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_pairing_over_a_veth_link() -> Result<()> {
    let Some(ns) = Netns::create()? else {
        return Ok(());
    };
    let mut pairs = vec![(DataPlane::Tcp, DataPlane::Tcp)];
    if !uring_unusable() {
        pairs.extend([
            (DataPlane::Uring, DataPlane::Uring),
            (DataPlane::Uring, DataPlane::Tcp),
            (DataPlane::Tcp, DataPlane::Uring),
        ]);
    }
    for (c, s) in pairs {
        round_trip_via(Some(&ns), c, s, 17 << 20)
            .await
            .with_context(|| format!("client {c:?}, server {s:?}, over veth"))?;
    }
    Ok(())
}

/// The data planes this machine has (TCP, and io_uring where usable; the reason is printed
/// where not).
fn planes_here() -> Vec<DataPlane> {
    let mut planes = vec![DataPlane::Tcp];
    if !uring_unusable() {
        planes.push(DataPlane::Uring);
    }
    planes
}

/// A link test's setup: a child serving a `len`-byte segment `data` from inside `ns` with the
/// data plane `plane`, and a client engine (two streams, dead peers given up after `dead`)
/// connected to it across the veth link, with a source region of random bytes.
struct AcrossLink {
    child: ChildProc,
    engine: TransferEngine,
    peer: ferry::Peer,
    remote: ferry::RemoteSegment,
    src: ferry::Registration,
    len: u64,
}

impl AcrossLink {
    async fn new(ns: &Netns, plane: DataPlane, len: u64, dead: Duration) -> Result<Self> {
        let child = ChildProc::spawn_in(
            Some(ns),
            "server",
            &[
                ("FERRY_TEST_SEGMENTS", &format!("data={len}:rw")),
                ("FERRY_TEST_DATA_PLANE", plane_env(plane)),
                ("FERRY_TEST_LISTEN", &format!("{}:0", ns.peer)),
            ],
        )?;
        let engine = TransferEngine::builder()
            .same_host(false)
            .streams(2)
            .data_plane(plane)
            .dead_peer_after(Some(dead))
            .connect_timeout(Duration::from_secs(3))
            .build()?;
        let peer = engine.connect(child.addr).await?;
        let remote = peer.segment("data")?;
        let src = engine.register(
            MemoryRegion::alloc_zeroed(len as usize, 4096)?,
            Access::LOCAL,
            "src",
        )?;
        fill(src.region(), len ^ 0xf1a9)?;
        Ok(Self {
            child,
            engine,
            peer,
            remote,
            src,
            len,
        })
    }

    /// READs `remote` whole into a fresh region and says whether it equals the source.
    async fn reads_back_the_source(&self, remote: &ferry::RemoteSegment) -> Result<bool> {
        let dst = self.engine.register(
            MemoryRegion::alloc_zeroed(self.len as usize, 4096)?,
            Access::LOCAL,
            "dst",
        )?;
        let o = self
            .engine
            .submit(Batch::new().read(&dst, 0, remote, 0, self.len))?
            .await;
        anyhow::ensure!(o.is_success(), "read back: {o:?}");
        Ok(bytes(dst.region(), 0, self.len)? == bytes(self.src.region(), 0, self.len)?)
    }
}

/// The link goes down for a second under a 32 MiB WRITE and comes back well inside the
/// dead-peer limit: TCP retransmits, the request succeeds, and the bytes read back are the
/// bytes written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_flap_inside_the_dead_peer_limit_loses_nothing() -> Result<()> {
    let Some(ns) = Netns::create()? else {
        return Ok(());
    };
    for plane in planes_here() {
        let t = AcrossLink::new(&ns, plane, 32 << 20, Duration::from_secs(20)).await?;
        ns.set_link(false)?;
        let h = tokio::spawn(
            t.engine
                .submit(Batch::new().write(&t.src, 0, &t.remote, 0, t.len))?
                .into_future(),
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            !h.is_finished(),
            "{plane:?}: the WRITE ended with the link down"
        );
        ns.set_link(true)?;
        let o = tokio::time::timeout(Duration::from_secs(60), h)
            .await
            .with_context(|| {
                format!("{plane:?}: the WRITE never ended after the link came back")
            })??;
        assert!(o.is_success(), "{plane:?}: {o:?}");
        assert!(
            t.reads_back_the_source(&t.remote).await?,
            "{plane:?}: bytes differ after the flap"
        );
    }
    Ok(())
}

/// The link is cut for good under a WRITE: after the dead-peer limit the request fails as
/// PeerLost with an uncertain remote effect, and `drained` resolves, which for the io_uring
/// client means the kernel gave back every zero-copy send (each one's notification counted).
/// Without the limit the chunks would sit in flight for the kernel's quarter of an hour (and
/// the WRITE, its bytes maybe landed, is not replayed by default). Once the link is back, the
/// next request reconnects the dead channel to the same incarnation, and connecting again moves
/// bytes too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_link_is_given_up_after_the_dead_peer_limit_and_drains() -> Result<()> {
    let Some(ns) = Netns::create()? else {
        return Ok(());
    };
    for plane in planes_here() {
        let dead = Duration::from_secs(2);
        let mut t = AcrossLink::new(&ns, plane, 16 << 20, dead).await?;
        let (engine, src, remote) = (&t.engine, &t.src, &t.remote);
        // One WRITE that moves, so the streams are up and the route is known.
        let o = engine
            .submit(Batch::new().write(src, 0, remote, 0, 1 << 20))?
            .await;
        assert!(o.is_success(), "{plane:?}: {o:?}");
        ns.set_link(false)?;
        let t0 = std::time::Instant::now();
        let h = engine.submit(Batch::new().write(src, 0, remote, 0, t.len))?;
        let drained = tokio::spawn(h.drained());
        let o = tokio::time::timeout(Duration::from_secs(20), h)
            .await
            .with_context(|| format!("{plane:?}: a dead peer was never given up"))?;
        let took = t0.elapsed();
        let f = o.failure.with_context(|| format!("{plane:?}: {o:?}"))?;
        assert_eq!(f.kind, FailureKind::PeerLost, "{plane:?}: {o:?}");
        assert_eq!(o.remote_effect, RemoteEffect::Uncertain, "{plane:?}: {o:?}");
        assert!(
            took >= dead,
            "{plane:?}: given up after {took:?}, before the limit"
        );
        let last = tokio::time::timeout(Duration::from_secs(20), drained)
            .await
            .with_context(|| format!("{plane:?}: never drained after the stream died"))??;
        assert!(last.drained, "{plane:?}: {last:?}");
        if plane == DataPlane::Uring {
            let io = engine
                .describe()
                .data_plane_io
                .context("no io_uring counters")?;
            if io.contains("SEND_ZC on") {
                let zc = io_counter(&io, "zc sends")?;
                assert!(zc > 0, "{io}");
                assert_eq!(io_counter(&io, "notifications")?, zc, "{io}");
            }
        }
        ns.set_link(true)?;
        assert!(
            !t.peer.is_alive(),
            "{plane:?}: the channel outlived its streams"
        );
        // The next request reconnects to the same incarnation (its WRITE was never sent, so it
        // simply runs there).
        let o = tokio::time::timeout(
            Duration::from_secs(30),
            engine
                .submit(Batch::new().write(src, 0, remote, 0, 4096))?
                .into_future(),
        )
        .await
        .with_context(|| format!("{plane:?}: a request on a dead channel hung"))?;
        assert!(o.is_success(), "{plane:?}: {o:?}");
        assert!(t.peer.is_alive(), "{plane:?}: not reconnected");
        let reconnects: u64 = engine.describe().routes.iter().map(|r| r.reconnects).sum();
        assert!(reconnects >= 1, "{plane:?}: {:?}", engine.describe().routes);
        let again = engine.connect(t.child.addr).await?;
        assert!(again.is_alive());
        let remote = again.segment("data")?;
        let o = engine
            .submit(Batch::new().write(src, 0, &remote, 0, t.len))?
            .await;
        assert!(o.is_success(), "{plane:?} after reconnecting: {o:?}");
        assert!(
            t.reads_back_the_source(&remote).await?,
            "{plane:?}: bytes differ after reconnecting"
        );
        t.child.kill();
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_each_have_their_own_error_and_move_nothing() -> Result<()> {
    refusals(DataPlane::Tcp, DataPlane::Tcp).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uring_refusals_in_every_pairing() -> Result<()> {
    in_every_uring_pairing(refusals).await
}

async fn refusals(client_plane: DataPlane, server: DataPlane) -> Result<()> {
    let mut child = ChildProc::spawn(
        "server",
        &[
            ("FERRY_TEST_SEGMENTS", "ro=4096:r,rw=8192:rw,gone=4096:rw"),
            ("FERRY_TEST_DATA_PLANE", plane_env(server)),
        ],
    )?;
    let engine = client(client_plane)?;
    let peer = engine.connect(child.addr).await?;
    let ro = peer.segment("ro")?;
    let rw = peer.segment("rw")?;
    let gone = peer.segment("gone")?;
    assert!(matches!(
        peer.segment("nope"),
        Err(Error::UnknownSegmentName { .. })
    ));
    let src = engine.register(
        MemoryRegion::alloc_zeroed(8192, 4096)?,
        Access::LOCAL,
        "src",
    )?;
    fill(src.region(), 9)?;
    let probe = engine.register(MemoryRegion::alloc_zeroed(8192, 4096)?, Access::LOCAL, "p")?;

    // Checked before anything moves: out of bounds (remote and local) and access rights.
    assert!(matches!(
        engine.submit(Batch::new().write(&src, 0, &rw, 8000, 200)),
        Err(Error::OutOfBounds { side: "remote", .. })
    ));
    assert!(matches!(
        engine.submit(Batch::new().write(&src, 8000, &rw, 0, 200)),
        Err(Error::OutOfBounds { side: "local", .. })
    ));
    assert!(matches!(
        engine.submit(Batch::new().write(&src, 0, &ro, 0, 10)),
        Err(Error::AccessDenied { .. })
    ));

    // Refused by the server: a token it never published, a descriptor that lies about bounds
    // or access, and a retired segment.
    let forged = |token, len, access| {
        peer.segment_from_descriptor(SegmentDesc {
            name: "forged".into(),
            token,
            len,
            access,
            remote_keys: vec![],
        })
    };
    child.command("retire gone", "RETIRED gone")?;
    let cases = [
        (
            forged(SegmentToken::random(), 4096, Access::REMOTE_WRITE),
            RemoteStatus::UnknownSegment,
        ),
        (
            forged(ro.desc().token, 4096, Access::REMOTE_WRITE),
            RemoteStatus::AccessDenied,
        ),
        (
            forged(rw.desc().token, 1 << 20, Access::REMOTE_WRITE),
            RemoteStatus::OutOfBounds,
        ),
        (gone.clone(), RemoteStatus::UnknownSegment),
    ];
    for (seg, status) in cases {
        let off = if status == RemoteStatus::OutOfBounds {
            8000
        } else {
            0
        };
        let o = engine
            .submit(Batch::new().write(&src, 0, &seg, off, 1000))?
            .await;
        let f = o.failure.context("expected a failure")?;
        assert_eq!(f.kind, FailureKind::Remote(status), "{o:?}");
        assert_eq!(o.completed_ops, 0);
        assert_eq!(o.remote_effect, RemoteEffect::None);
    }
    // Nothing moved: every segment still reads back as zeros.
    for seg in [&ro, &rw] {
        let len = seg.len();
        let o = engine
            .submit(Batch::new().read(&probe, 0, seg, 0, len))?
            .await;
        assert!(o.is_success(), "{o:?}");
        assert!(bytes(probe.region(), 0, len)?.iter().all(|&b| b == 0));
    }
    let o = engine
        .submit(Batch::new().read(&probe, 0, &gone, 0, 10))?
        .await;
    assert_eq!(
        o.failure.map(|f| f.kind),
        Some(FailureKind::Remote(RemoteStatus::UnknownSegment))
    );
    assert!(engine.describe().routes[0].errors >= 5);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_mismatch_is_refused_before_admission() -> Result<()> {
    let child = ChildProc::spawn(
        "server",
        &[
            ("FERRY_TEST_SEGMENTS", "x=4096:rw"),
            ("FERRY_TEST_VERSIONS", "40-41"),
        ],
    )?;
    let engine = client(DataPlane::Tcp)?;
    match engine.connect(child.addr).await {
        Err(Error::ProtocolMismatch { local, remote, .. }) => {
            assert_eq!(local, SUPPORTED_VERSIONS);
            assert_eq!(remote, VersionRange { min: 40, max: 41 });
        }
        other => bail!("expected ProtocolMismatch, got {other:?}"),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_source_is_refused_until_reresolved() -> Result<()> {
    let mut first = ChildProc::spawn("server", &[("FERRY_TEST_SEGMENTS", "x=4096:rw")])?;
    let addr = first.addr;
    let engine = client(DataPlane::Tcp)?;
    let old = engine.connect(addr).await?;
    let old_seg = old.segment("x")?;
    first.kill();
    let _second = ChildProc::spawn(
        "server",
        &[
            ("FERRY_TEST_SEGMENTS", "x=4096:rw"),
            ("FERRY_TEST_LISTEN", &addr.to_string()),
        ],
    )?;
    match engine.connect(addr).await {
        Err(Error::StaleEpoch { known, found, .. }) => {
            assert_eq!(known, old.epoch());
            assert_ne!(found, old.epoch());
        }
        other => bail!("expected StaleEpoch, got {other:?}"),
    }
    // The old incarnation's descriptors never reach the new process: the request's reconnect
    // finds the new epoch and fails it with StaleEpoch.
    let src = engine.register(MemoryRegion::alloc_zeroed(4096, 4096)?, Access::LOCAL, "s")?;
    for _ in 0..2000 {
        if !old.is_alive() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(!old.is_alive(), "the old channel outlived its server");
    let o = engine
        .submit(Batch::new().write(&src, 0, &old_seg, 0, 100))?
        .await;
    assert_eq!(
        o.failure.map(|f| f.kind),
        Some(FailureKind::Remote(RemoteStatus::StaleEpoch)),
        "{o:?}"
    );
    assert_eq!(o.remote_effect, RemoteEffect::None, "{o:?}");
    let new = engine.reresolve(addr).await?;
    assert_ne!(new.epoch(), old.epoch());
    let o = engine
        .submit(Batch::new().write(&src, 0, &new.segment("x")?, 0, 100))?
        .await;
    assert!(o.is_success(), "{o:?}");
    Ok(())
}

/// The trap child's batch: two ops that complete, one that stalls, one more after it.
fn trap_batch(src: &ferry::Registration, peer: &ferry::Peer) -> Result<Batch> {
    let ok = peer.segment("ok")?;
    let trap = peer.segment("trap")?;
    Ok(Batch::new()
        .write(src, 0, &ok, 0, 4096)
        .write(src, 4096, &ok, 4096, 300_000)
        .write(src, 0, &trap, 0, 65_536)
        .write(src, 0, &ok, 0, 100))
}

async fn wait_prefix(h: &ferry::RequestHandle, n: usize) {
    for _ in 0..2000 {
        if h.progress().completed_ops >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_killed_mid_write_is_uncertain_with_exact_prefix() -> Result<()> {
    killed_mid_write(DataPlane::Tcp, DataPlane::Tcp).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uring_peer_killed_mid_write_in_every_pairing() -> Result<()> {
    in_every_uring_pairing(killed_mid_write).await
}

async fn killed_mid_write(client_plane: DataPlane, server: DataPlane) -> Result<()> {
    let mut child = ChildProc::spawn("trap", &[("FERRY_TEST_DATA_PLANE", plane_env(server))])?;
    let engine = TransferEngine::builder()
        .same_host(false)
        .data_plane(client_plane)
        .build()?;
    let peer = engine.connect(child.addr).await?;
    let src = engine.register(
        MemoryRegion::alloc_zeroed(1 << 20, 4096)?,
        Access::LOCAL,
        "s",
    )?;
    let h = engine.submit(trap_batch(&src, &peer)?)?;
    wait_prefix(&h, 2).await;
    child.kill();
    let o = h.await;
    assert_eq!(o.completed_ops, 2, "{o:?}");
    assert_eq!(o.completed_bytes, 4096 + 300_000);
    let f = o.failure.context("expected a failure")?;
    assert_eq!((f.op_index, f.kind), (2, FailureKind::PeerLost));
    assert_eq!(o.remote_effect, RemoteEffect::Uncertain);
    assert!(o.drained);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_and_cancel_end_the_request_but_drained_waits() -> Result<()> {
    for cancel in [false, true] {
        let mut child = ChildProc::spawn("trap", &[])?;
        let engine = TransferEngine::builder()
            .same_host(false)
            .data_plane(DataPlane::Tcp)
            .build()?;
        let peer = engine.connect(child.addr).await?;
        let src = engine.register(
            MemoryRegion::alloc_zeroed(1 << 20, 4096)?,
            Access::LOCAL,
            "s",
        )?;
        let mut batch = trap_batch(&src, &peer)?;
        if !cancel {
            // Long enough that the trap chunk is surely posted first (waited for below), so
            // the deadline ends a request whose WRITE the server holds.
            batch = batch.timeout(Duration::from_secs(5));
        }
        let h = engine.submit(batch)?;
        wait_prefix(&h, 2).await;
        // The trap chunk posted and unacknowledged: in the server's hands.
        for _ in 0..2000 {
            if h.progress().remote_effect == RemoteEffect::Uncertain {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            h.progress().remote_effect,
            RemoteEffect::Uncertain,
            "the trap chunk was never posted: {:?}",
            h.progress()
        );
        let drained = tokio::spawn(h.drained());
        if cancel {
            h.cancel();
        }
        let o = h.await;
        let want = if cancel {
            FailureKind::Cancelled
        } else {
            FailureKind::Timeout
        };
        assert_eq!(
            o.failure.map(|f| (f.op_index, f.kind)),
            Some((2, want)),
            "{o:?}"
        );
        assert_eq!(o.completed_ops, 2);
        assert_eq!(o.remote_effect, RemoteEffect::Uncertain);
        assert!(!o.drained);
        // The trap chunk is still in the server's hands: the buffers are not free.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !drained.is_finished(),
            "drained before the stalled chunk ended"
        );
        child.kill();
        let last = tokio::time::timeout(Duration::from_secs(30), drained).await??;
        assert!(last.drained);
        assert_eq!(last.completed_ops, 2);
        assert_eq!(last.remote_effect, RemoteEffect::Uncertain);
    }
    Ok(())
}

/// A file segment published by an io_uring child and by a TCP child (positioned reads), READ by
/// TCP and io_uring clients: random contents, unaligned offsets and lengths, aligned ones
/// (O_DIRECT on io_uring), and the tail of a file whose size is not a multiple of 4096, compared
/// byte for byte.
#[cfg(feature = "uring")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_segment_read_across_processes() -> Result<()> {
    let uring = !uring_unusable();
    let len: u64 = (3 << 20) + 1234;
    let file = MemoryRegion::alloc_zeroed(len as usize, 4096)?;
    fill(&file, 0xf17e)?;
    let data = bytes(&file, 0, len)?;
    let path = std::env::temp_dir().join(format!("ferry-two-process-file-{}", std::process::id()));
    std::fs::write(&path, &data)?;
    let servers: &[&str] = if uring { &["uring", "tcp"] } else { &["tcp"] };
    let clients: &[DataPlane] = if uring {
        &[DataPlane::Tcp, DataPlane::Uring]
    } else {
        &[DataPlane::Tcp]
    };
    let result = async {
        for &served in servers {
            let child = ChildProc::spawn(
                "server",
                &[
                    ("FERRY_TEST_FILES", &format!("shard={}:r", path.display())),
                    ("FERRY_TEST_DATA_PLANE", served),
                ],
            )?;
            let tail_block = len / 4096 * 4096;
            let cases: &[(u64, u64, u64)] = &[
                (0, 0, len),
                (1, 1, 4095),
                (4096, 4096, 1 << 20),
                (3, 8191, (2 << 20) + 17),
                (5, len - 4000, 4000),
                (0, len - 1, 1),
                (8192, tail_block, len - tail_block),
                (7, tail_block - 3, len - tail_block + 3),
                (0, len - (1 << 20) - 3, (1 << 20) + 3),
            ];
            for &plane in clients {
                let engine = client(plane)?;
                let peer = engine.connect(child.addr).await?;
                let seg = peer.segment("shard")?;
                assert_eq!((seg.len(), seg.access()), (len, Access::REMOTE_READ));
                let dst = engine.register(
                    MemoryRegion::alloc_zeroed(len as usize + 8192, 4096)?,
                    Access::LOCAL,
                    "dst",
                )?;
                for &(lo, fo, n) in cases {
                    dst.region().write_at(lo, &vec![0u8; n as usize])?;
                    let o = engine
                        .submit(Batch::new().read(&dst, lo, &seg, fo, n))?
                        .await;
                    assert!(
                        o.is_success(),
                        "{served} server, {plane:?} read {n} at {fo}: {o:?}"
                    );
                    assert!(
                        bytes(dst.region(), lo, n)? == data[fo as usize..(fo + n) as usize],
                        "{served} server, {plane:?}: bytes differ reading {n} at {fo} into {lo}"
                    );
                }
                // Read-only: a WRITE is refused before anything moves.
                assert!(matches!(
                    engine.submit(Batch::new().write(&dst, 0, &seg, 0, 10)),
                    Err(Error::AccessDenied { .. })
                ));
            }
        }
        anyhow::Ok(())
    }
    .await;
    let _ = std::fs::remove_file(&path);
    result
}

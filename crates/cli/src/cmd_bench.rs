//! `ferry bench`: measure READ or WRITE throughput and op latency against a peer, or on loopback
//! against a server this process starts itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::failure::{RequestFailed, UnknownSegment};
use crate::histogram::Histogram;
use crate::out::{Goal, Meter, ProgressMode, say};
use crate::parse::{self, DeadPeer, IoThreads, SocketBuffer};
use crate::stop::{Signal, Stopped};
use anyhow::{Context, Result, bail};
use ferry::{Access, Batch, DataPlane, MemoryRegion, TransferEngine, TransportKind};

/// Arguments of `ferry bench`.
#[derive(clap::Args, Debug)]
pub(crate) struct BenchArgs {
    /// The `ferry serve` peer (HOST:PORT). Without it, a server starts in this process on
    /// loopback.
    #[arg(value_parser = parse::peer_addr)]
    peer: Option<String>,
    /// Put the local buffer on GPU N (staged through pinned host memory over TCP and io_uring);
    /// on loopback the server's segment goes on GPU N too. After the run a checksummed round
    /// trip verifies the bytes.
    #[arg(long, value_name = "N")]
    gpu: Option<u32>,
    /// The peer's segment to use (loopback: created with this name); a plain `ferry serve`
    /// publishes `bench`.
    #[arg(long, default_value = "bench")]
    segment: String,
    /// Transport: tcp, uring (io_uring, an error where the kernel cannot), rdma, local (the
    /// same-host plane: process-to-process copies, an error where it is not taken), or auto (the
    /// engine's choice: the same-host plane for a peer on this host, else io_uring where the
    /// kernel supports it, TCP otherwise). The report's `transport` says what ran.
    #[arg(long, default_value = "auto", value_parser = ["auto", "tcp", "uring", "rdma", "local"])]
    transport: String,
    /// RDMA devices and ports to use, in NCCL_IB_HCA syntax (`mlx5_0,mlx5_1:1`, `^mlx5_2`,
    /// `=rxe1`); default: every usable port.
    #[arg(long, value_name = "FILTER")]
    rdma_hca: Option<String>,
    /// Direction: read (peer to us) or write (us to peer).
    #[arg(long, default_value = "write", value_parser = ["read", "write"])]
    op: String,
    /// Bytes per op (suffixes: KiB, MiB, GiB, KB, MB, GB).
    #[arg(long, default_value = "1MiB", value_parser = parse::nonzero_size)]
    op_size: u64,
    /// Total bytes to move, rounded up to whole requests (`--op-size` times `--batch`), at
    /// least one request [default: 4GiB, unless --duration is given].
    #[arg(long, value_parser = parse::nonzero_size, conflicts_with = "duration")]
    total: Option<u64>,
    /// Run this long instead of moving a byte count (`10s`, `1.5s`, `500ms`).
    #[arg(long, value_parser = parse::positive_duration)]
    duration: Option<Duration>,
    /// TCP streams per peer (1 to 64).
    #[arg(long, default_value = "1", value_parser = parse::streams)]
    streams: usize,
    /// Ops in flight (with `--batch`: requests in flight).
    #[arg(long, default_value = "8", value_parser = parse::count)]
    depth: usize,
    /// Ops per request: each submit carries this many ops of `--op-size` (a KV-cache batch is
    /// 1024 blocks of 32 KiB); latencies, and `ops_per_s` in the report, are per request.
    #[arg(long, default_value = "1", value_parser = parse::count)]
    batch: usize,
    /// Put each op at a random op-aligned offset of the remote segment and of a local buffer
    /// as large as the segment (blocks scattered over a paged cache), instead of cycling
    /// through slots.
    #[arg(long)]
    scatter: bool,
    /// Largest chunk an op is split into on TCP and io_uring (one data-plane request and one
    /// acknowledgment each); 1 byte to 64 MiB.
    #[arg(long, default_value = "1MiB", value_parser = parse::chunk_size)]
    chunk_size: u64,
    /// Socket buffer size to request (4KiB to 1GiB), or `auto` for kernel autotuning.
    #[arg(long, default_value = "4MiB", value_parser = parse::socket_buffer)]
    socket_buffer: SocketBuffer,
    /// Loopback only: size of the segment the in-process server publishes [default: op size
    /// times depth; at least one op per stream, so that each stream has its own buffer on each
    /// side, as one iperf3 process per stream has].
    #[arg(long, value_parser = parse::nonzero_size)]
    segment_size: Option<u64>,
    /// Worker threads of this process's runtime [default: one per core].
    #[arg(long, value_parser = parse::count)]
    threads: Option<usize>,
    /// Loopback only: worker threads of the in-process server's own runtime [default: one per
    /// stream, as one iperf3 server process per stream has its own thread].
    #[arg(long, value_parser = parse::count)]
    server_threads: Option<usize>,
    /// TCP data plane: I/O threads per engine (`auto`: one per core), or `caller` to run the
    /// streams on this process's runtime (lower latency for small ops, less bulk throughput).
    #[arg(long, default_value = "auto", value_parser = parse::io_threads)]
    io_threads: IoThreads,
    /// io_uring data plane: the task awaiting a small WRITE or READ sent directly on an idle
    /// stream reads its response itself (through the runtime's reactor) instead of being woken
    /// by the stream's ring (`false`: the ring reads every response).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    uring_caller_receives: bool,
    /// Give a TCP or io_uring data stream up when its sent data goes unacknowledged (or an
    /// idle one's keepalive probes go unanswered) this long (1s to a day), or `off` for the
    /// kernel's defaults (about 15 minutes).
    #[arg(long, default_value = "30s", value_parser = parse::dead_peer)]
    dead_peer_after: DeadPeer,
    /// Print one JSON object instead of the human summary.
    #[arg(long)]
    json: bool,
    /// Progress while it runs: `auto` (a bar on a terminal, else lines), `bar`, `lines` (one
    /// line on stderr every `--progress-every`: bytes, rate, ETA) or `none`.
    #[arg(long, value_enum, default_value = "auto", hide_possible_values = true)]
    progress: ProgressMode,
    /// With progress lines: one every this long (at most 10s).
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = crate::out::progress_every)]
    progress_every: Duration,
    /// After the run, move each of the first buffers once more and compare the CRC-32C the
    /// peer computes over its side (a CHECKSUM request, protocol version 2) with the local
    /// bytes' (`verified_bytes` in the report); a mismatch fails the bench. Host buffers only
    /// (`--gpu` checks its own round trip).
    #[arg(long, conflicts_with = "gpu")]
    verify: bool,
    /// Authenticate with the keyring file F (lines of `name hexkey`): this client proves its
    /// first key to the peer (on loopback the in-process server requires the same file). Without
    /// it, the file named by FERRY_AUTH_KEY_FILE, if set.
    #[arg(long, value_name = "F")]
    auth_key_file: Option<std::path::PathBuf>,
    /// Read the key file even where group or others may access it (a warning is logged);
    /// without it such a file is refused. `FERRY_ALLOW_OPEN_KEY_FILE=1` does the same.
    #[arg(long)]
    allow_open_key_file: bool,
}

/// The RDMA configuration for `--rdma-hca` (discovery narrowed by the filter).
pub(crate) fn rdma_config(hca: Option<&str>) -> Result<ferry::RdmaConfig> {
    let mut config = ferry::RdmaConfig::default();
    if let Some(hca) = hca {
        let selector = ferry::topology::Selector::from_hca(hca)
            .with_context(|| format!("--rdma-hca {hca:?}"))?;
        config = config.selector(selector);
    }
    Ok(config)
}

/// The measured result.
#[derive(Debug)]
struct Report {
    /// With `--gpu`: the checksummed round trip's summary.
    verified: Option<String>,
    transport: String,
    op: String,
    op_bytes: u64,
    total_bytes: u64,
    seconds: f64,
    gb_per_s: f64,
    ops_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    streams: usize,
    depth: usize,
    peer: String,
    /// Bytes checked against the peer's CRC-32C (`--verify`).
    verified_bytes: Option<u64>,
    /// Ops replayed and channels reopened after lost connections (the engine's `describe()`).
    replays: u64,
    reconnects: u64,
}

/// What a run has done so far, kept when it fails.
#[derive(Debug, Default)]
struct Progress {
    /// Bytes of completed ops.
    bytes: AtomicU64,
    /// Completed ops.
    ops: AtomicU64,
    /// Failed requests whose WRITEs may have changed remote memory (sent, never acknowledged).
    uncertain_writes: AtomicU64,
    /// Ops replayed after lost connections.
    replays: AtomicU64,
    /// Channels reopened after lost connections.
    reconnects: AtomicU64,
    /// Attempts to reopen them, successful or not.
    reconnect_attempts: AtomicU64,
}

impl Progress {
    /// The facts, as JSON fields (beside `error`, for `--json`).
    fn facts(&self) -> serde_json::Map<String, serde_json::Value> {
        let get = |a: &AtomicU64| serde_json::Value::from(a.load(Ordering::Relaxed));
        [
            ("bytes_moved", get(&self.bytes)),
            ("ops_completed", get(&self.ops)),
            ("uncertain_writes", get(&self.uncertain_writes)),
            ("replays", get(&self.replays)),
            ("reconnects", get(&self.reconnects)),
            ("reconnect_attempts", get(&self.reconnect_attempts)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }
}

/// The in-process loopback server: its own thread and runtime, like a separate process would
/// have, so that its work does not queue behind the client's tasks.
struct LoopbackServer {
    addr: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LoopbackServer {
    #[allow(clippy::too_many_arguments)]
    fn start(
        kinds: &[TransportKind],
        plane: DataPlane,
        tcp: (usize, Option<usize>, Option<usize>),
        seg_len: u64,
        name: String,
        server_threads: usize,
        gpu: Option<u32>,
        auth: (Option<std::path::PathBuf>, bool),
    ) -> Result<Self> {
        let (auth_key_file, allow_open_key_file) = auth;
        let kinds = kinds.to_vec();
        let same_host = kinds.contains(&TransportKind::Local);
        let (streams, socket_buffer, io_threads) = tcp;
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("ferry-bench-server".into())
            .spawn(move || {
                let run = || -> Result<()> {
                    let rt = tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(server_threads.max(1))
                        .enable_all()
                        .build()
                        .context("starting the server runtime")?;
                    rt.block_on(async {
                        let mut server = TransferEngine::builder()
                            .listen("127.0.0.1:0".parse()?)
                            .transports(&kinds)
                            .same_host(same_host)
                            .data_plane(plane)
                            .streams(streams)
                            .socket_buffer(socket_buffer)
                            .io_threads(io_threads);
                        if let Some(f) = auth_key_file {
                            server = server.auth_key_file(f);
                        }
                        server = server.allow_open_key_file(allow_open_key_file);
                        let server = server.build()?;
                        let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
                        let mut _gpu_reg = None;
                        let mut _reg = None;
                        match gpu {
                            Some(n) => {
                                let reg = server
                                    .alloc_gpu(n, seg_len as usize, rw, &name)
                                    .with_context(|| format!("--gpu {n}"))?;
                                reg.memory()
                                    .copy_from_host(0, &pseudo_random(seg_len as usize))?;
                                _gpu_reg = Some(reg);
                            }
                            None => {
                                let region =
                                    MemoryRegion::alloc_zeroed(seg_len as usize, ferry::PAGE_ALIGN)
                                        .context("the loopback server's segment")?;
                                // READs take their payload from here: real bytes, not the zero
                                // page.
                                region.write_at(0, &pseudo_random(region.len()))?;
                                _reg = Some(server.register(region, rw, &name)?);
                            }
                        }
                        let addr = server
                            .local_addr()
                            .context("loopback server has no address")?;
                        let _ = ready_tx.send(Ok(addr));
                        let _ = stop_rx.await;
                        Ok(())
                    })
                };
                if let Err(e) = run() {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .context("starting the loopback server thread")?;
        let addr = ready_rx
            .recv()
            .context("the loopback server thread ended")??;
        Ok(Self {
            addr,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }
}

impl Drop for LoopbackServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Refuses a buffer larger than this machine's memory (twice that, as the bench fills it from
/// a second buffer of random bytes), naming the flags that sized it.
fn fits_in_memory(what: &str, bytes: u64, flags: &str) -> Result<()> {
    if let Some(total) = parse::memory_total()
        && bytes.saturating_mul(2) > total
    {
        bail!(
            "{what} would need {bytes} bytes ({flags}), and filling it as much again: more than \
             this machine's {total} bytes of memory; lower those flags"
        );
    }
    Ok(())
}

/// Runs `ferry bench`.
pub(crate) fn run(args: BenchArgs) -> Result<()> {
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.threads {
        rt.worker_threads(n.max(1));
    }
    let rt = rt
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let progress = Arc::new(Progress::default());
    let started = Instant::now();
    let ran = rt.block_on(async {
        let stop = crate::stop::listen()?;
        tokio::select! {
            r = bench(&args, &progress) => r.map(Ok),
            signal = stop => Ok(Err(signal)),
        }
    });
    let report = match ran {
        Ok(Ok(r)) => r,
        Ok(Err(signal)) => {
            drop(rt);
            return Err(stopped(&args, &progress, started.elapsed(), signal));
        }
        Err(e) => {
            let facts = progress.facts();
            let l = |k: &str| facts.get(k).cloned().unwrap_or_default();
            let done = format!(
                "before failing: {} bytes moved in {} ops; {} reconnects of {} attempts, {} ops \
                 replayed; {} requests with WRITEs of uncertain effect",
                l("bytes_moved"),
                l("ops_completed"),
                l("reconnects"),
                l("reconnect_attempts"),
                l("replays"),
                l("uncertain_writes")
            );
            let started = progress.ops.load(Ordering::Relaxed) > 0
                || progress.reconnect_attempts.load(Ordering::Relaxed) > 0;
            return Err(crate::failure::report(
                e,
                crate::failure::Server::Serve,
                args.json,
                facts,
                started.then_some(done),
            ));
        }
    };
    if args.json {
        let r = &report;
        let obj = serde_json::json!({
            "transport": r.transport,
            "op": r.op,
            "op_bytes": r.op_bytes,
            "total_bytes": r.total_bytes,
            "seconds": r.seconds,
            "gb_per_s": r.gb_per_s,
            "ops_per_s": r.ops_per_s,
            "p50_us": r.p50_us,
            "p99_us": r.p99_us,
            "streams": r.streams,
            "depth": r.depth,
            "peer": r.peer,
            "gpu_verified": r.verified,
            "verified_bytes": r.verified_bytes,
            "replays": r.replays,
            "reconnects": r.reconnects,
        });
        say(format_args!("{obj}"));
    } else {
        say(format_args!(
            "{} {} {} B ops over {}: {:.3} GB/s, {:.0} ops/s, p50 {:.0} us, p99 {:.0} us \
             ({} bytes in {:.3} s, {} stream{}, depth {})",
            report.transport,
            report.op,
            report.op_bytes,
            report.peer,
            report.gb_per_s,
            report.ops_per_s,
            report.p50_us,
            report.p99_us,
            report.total_bytes,
            report.seconds,
            report.streams,
            if report.streams == 1 { "" } else { "s" },
            report.depth
        ));
        if let Some(v) = &report.verified {
            say(format_args!("{v}"));
        }
        if let Some(v) = report.verified_bytes {
            say(format_args!(
                "verified {v} bytes: the peer's CRC-32C matches ours"
            ));
        }
        if report.replays > 0 || report.reconnects > 0 {
            say(format_args!(
                "lost connections: {} reconnects, {} ops replayed",
                report.reconnects, report.replays
            ));
        }
    }
    Ok(())
}

/// A run `signal` stopped after `took`: prints what moved (one JSON object under `--json`) and
/// returns [`Stopped`].
fn stopped(args: &BenchArgs, progress: &Progress, took: Duration, signal: Signal) -> anyhow::Error {
    let moved = progress.bytes.load(Ordering::Relaxed);
    let secs = took.as_secs_f64();
    if args.json {
        let mut obj = progress.facts();
        obj.insert("stopped_by".into(), signal.name().into());
        obj.insert("seconds".into(), secs.into());
        obj.insert(
            "gb_per_s".into(),
            (moved as f64 / secs.max(1e-9) / 1e9).into(),
        );
        say(format_args!("{}", serde_json::Value::Object(obj)));
    } else {
        say(format_args!(
            "stopped by {}: {} bytes ({}) moved in {} ops over {secs:.3} s ({:.3} GB/s)",
            signal.name(),
            moved,
            crate::out::bytes(moved),
            progress.ops.load(Ordering::Relaxed),
            moved as f64 / secs.max(1e-9) / 1e9
        ));
    }
    Stopped(signal).into()
}

/// FNV-1a over `b` (the verification checksum).
fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// With `--gpu N`: WRITEs a known pattern from GPU memory into the remote segment, READs it back
/// into other GPU memory, and compares checksums. Returns a summary, or an error on a mismatch.
async fn verify_gpu(
    engine: &TransferEngine,
    gpu: u32,
    remote: &ferry::RemoteSegment,
    op_size: u64,
) -> Result<String> {
    let len = op_size.min(remote.len()) as usize;
    let src = engine.alloc_gpu(gpu, len, Access::LOCAL, "bench-verify-src")?;
    let dst = engine.alloc_gpu(gpu, len, Access::LOCAL, "bench-verify-dst")?;
    let pattern: Vec<u8> = pseudo_random(len + 8)[8..].to_vec();
    src.memory().copy_from_host(0, &pattern)?;
    let o = engine
        .submit(Batch::new().write(&src, 0, remote, 0, len as u64))?
        .await;
    if let Some(f) = o.failure {
        bail!("verification WRITE failed: {}", f.kind);
    }
    let o = engine
        .submit(Batch::new().read(&dst, 0, remote, 0, len as u64))?
        .await;
    if let Some(f) = o.failure {
        bail!("verification READ failed: {}", f.kind);
    }
    let mut back = vec![0u8; len];
    dst.memory().copy_to_host(0, &mut back)?;
    let (want, got) = (fnv1a(&pattern), fnv1a(&back));
    if want != got {
        bail!("GPU round trip corrupted the bytes: checksum {got:016x}, expected {want:016x}");
    }
    let staging = engine
        .describe()
        .staging
        .map(|s| {
            format!(
                "; staged {} bytes, {} us waiting on copies",
                s.staged_bytes, s.copy_wait_us
            )
        })
        .unwrap_or_default();
    let cuda = engine.cuda()?;
    Ok(format!(
        "gpu {gpu} ({}{}): verified {len} bytes GPU -> peer -> GPU, checksum {got:016x}{staging}",
        cuda.devices()
            .get(gpu as usize)
            .map(|d| d.name.clone())
            .unwrap_or_default(),
        if cuda.is_fake() { ", FAKE driver" } else { "" },
    ))
}

async fn bench(args: &BenchArgs, progress: &Arc<Progress>) -> Result<Report> {
    let (kinds, plane) = match args.transport.as_str() {
        "auto" | "local" => (
            vec![TransportKind::Local, TransportKind::Tcp],
            DataPlane::Auto,
        ),
        "tcp" => (vec![TransportKind::Tcp], DataPlane::Tcp),
        "uring" => (vec![TransportKind::Tcp], DataPlane::Uring),
        "rdma" => (vec![TransportKind::Rdma], DataPlane::Tcp),
        other => {
            bail!("transport {other:?} is not available (use tcp, uring, rdma or auto)")
        }
    };
    let (depth, streams) = (args.depth, args.streams);
    let batch = args.batch as u64;
    let request_bytes = args
        .op_size
        .checked_mul(batch)
        .with_context(|| format!("--op-size {} × --batch {batch} overflows", args.op_size))?;
    if let Some(t) = args.total.filter(|&t| t < request_bytes) {
        bail!(
            "--total {t} is less than one request: --op-size {} × --batch {batch} = \
             {request_bytes} bytes",
            args.op_size
        );
    }
    // Loopback: our own server, with a segment large enough for every op in flight, and one op
    // per stream at least (ops go to the streams in turn and cycle through the segment's op
    // slots, so with one slot per stream the streams do not share buffers).
    let seg_len = match args.segment_size {
        Some(n) => n.max(args.op_size.saturating_mul(streams as u64)),
        None => args.op_size.saturating_mul(depth.max(streams) as u64),
    };
    if args.peer.is_none() {
        let flags = match args.segment_size {
            Some(_) => "--segment-size (at least --op-size × --streams)".to_owned(),
            None => format!(
                "--op-size {} × {} {}",
                args.op_size,
                if depth >= streams {
                    "--depth"
                } else {
                    "--streams"
                },
                depth.max(streams)
            ),
        };
        fits_in_memory("the loopback server's segment", seg_len, &flags)?;
    }
    let socket_buffer = args.socket_buffer.0;
    let (_server, addr) = match &args.peer {
        Some(p) => (None, p.clone()),
        None => {
            let server = LoopbackServer::start(
                &kinds,
                plane,
                (streams, socket_buffer, args.io_threads.0),
                seg_len,
                args.segment.clone(),
                args.server_threads.unwrap_or(streams),
                args.gpu,
                (args.auth_key_file.clone(), args.allow_open_key_file),
            )?;
            let addr = server.addr.to_string();
            (Some(server), addr)
        }
    };
    let mut builder = TransferEngine::builder()
        .transports(&kinds)
        .same_host(kinds.contains(&TransportKind::Local))
        .data_plane(plane)
        .streams(streams)
        .depth(depth.max(2))
        .chunk_size(args.chunk_size)
        .socket_buffer(socket_buffer)
        .io_threads(args.io_threads.0)
        .uring_caller_receives(args.uring_caller_receives)
        .dead_peer_after(args.dead_peer_after.0);
    if kinds.contains(&TransportKind::Rdma) {
        builder = builder.rdma(rdma_config(args.rdma_hca.as_deref())?);
    }
    if let Some(f) = &args.auth_key_file {
        builder = builder.auth_key_file(f);
    }
    builder = builder.allow_open_key_file(args.allow_open_key_file);
    let engine = builder.build()?;
    let result = measure(args, &engine, &addr, (depth, streams), progress).await;
    // Kept for a failure too: what reconnecting did.
    let routes = engine.describe().routes;
    progress
        .replays
        .store(routes.iter().map(|r| r.replays).sum(), Ordering::Relaxed);
    progress
        .reconnects
        .store(routes.iter().map(|r| r.reconnects).sum(), Ordering::Relaxed);
    progress.reconnect_attempts.store(
        routes.iter().map(|r| r.reconnect_attempts).sum(),
        Ordering::Relaxed,
    );
    let mut report = result?;
    report.replays = progress.replays.load(Ordering::Relaxed);
    report.reconnects = progress.reconnects.load(Ordering::Relaxed);
    Ok(report)
}

/// The measured part of `bench`: connect, move, verify.
async fn measure(
    args: &BenchArgs,
    engine: &TransferEngine,
    addr: &str,
    (depth, streams): (usize, usize),
    progress: &Arc<Progress>,
) -> Result<Report> {
    let (peer, remote) = connect_peer(args, engine, addr).await?;
    let slots_in_remote = (remote.len() / args.op_size).max(1);
    let batch = args.batch as u64;
    // Local buffers cycle through no more memory than the remote segment, for READs and WRITEs
    // alike (iperf3 reuses one `-l` buffer on each side): with a 1 MiB segment both ends stay
    // cache-warm, as they do for iperf3. Concurrent READs may land in the same local slot; the
    // bench never looks at the bytes, and no Rust reference to registered memory exists.
    let local_slots = if args.scatter {
        slots_in_remote
    } else {
        slots_in_remote.min(depth as u64 * batch)
    };
    let (local, host_region) = local_buffer(args, engine, local_slots, depth)?;
    let total = match (args.total, args.duration) {
        (Some(t), _) => Some(t),
        (None, Some(_)) => None,
        (None, None) => Some(4 << 30),
    };
    let deadline = args.duration;
    let ops_budget = total.map(|t| t.div_ceil(args.op_size).max(batch));
    let claimed = Arc::new(AtomicU64::new(0));
    let moved = progress.clone();

    let goal = match (total, deadline) {
        (Some(t), _) => Goal::Bytes(ops_budget.map_or(t, |b| b * args.op_size)),
        (None, Some(d)) => Goal::Time(d),
        (None, None) => Goal::Bytes(0),
    };
    let mut meter = Meter::new(args.progress, args.progress_every, args.json, "bench", goal);

    let start = Instant::now();
    let mut workers = tokio::task::JoinSet::<Result<Histogram>>::new();
    for _ in 0..depth {
        workers.spawn(
            Worker {
                engine: engine.clone(),
                local: local.clone(),
                remote: remote.clone(),
                claimed: claimed.clone(),
                moved: moved.clone(),
                start,
                op_size: args.op_size,
                batch,
                scatter: args.scatter,
                is_read: args.op == "read",
                local_slots,
                slots_in_remote,
                ops_budget,
                deadline,
            }
            .run(),
        );
    }
    let mut lat = Histogram::default();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            res = workers.join_next() => match res {
                Some(res) => lat.merge(&res.context("bench worker")??),
                None => break,
            },
            _ = tick.tick() => meter.update(moved.bytes.load(Ordering::Relaxed), None, None),
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    meter.finish();
    let total_bytes = moved.bytes.load(Ordering::Relaxed);
    let verified = match args.gpu {
        Some(n) => Some(verify_gpu(engine, n, &remote, args.op_size).await?),
        None => None,
    };
    let verified_bytes = if args.verify {
        let slots = slots_in_remote.min(local_slots);
        Some(
            verify_slots(
                args,
                engine,
                &peer,
                (&local, host_region.as_ref()),
                &remote,
                slots,
            )
            .await?,
        )
    } else {
        None
    };
    Ok(Report {
        verified,
        verified_bytes,
        replays: 0,
        reconnects: 0,
        transport: peer.transport().name().to_owned(),
        op: args.op.clone(),
        op_bytes: args.op_size,
        total_bytes,
        seconds,
        gb_per_s: total_bytes as f64 / seconds / 1e9,
        ops_per_s: lat.len() as f64 / seconds,
        p50_us: lat.percentile(0.50),
        p99_us: lat.percentile(0.99),
        streams,
        depth,
        peer: args.peer.clone().unwrap_or_else(|| "loopback".into()),
    })
}

/// The bench's local buffer: memory the workers' ops use from or into.
type LocalBuffer = Arc<dyn ferry::LocalMemory + Send + Sync>;

/// Connects to `addr` (a listener that answers but is not Ferry is said so) and finds the
/// bench's segment there. Fails when `--transport local` did not get the same-host plane (with
/// the reason the engine recorded), when the segment is not published (listing those that
/// are), or when it is smaller than one op.
async fn connect_peer(
    args: &BenchArgs,
    engine: &TransferEngine,
    addr: &str,
) -> Result<(ferry::Peer, ferry::RemoteSegment)> {
    let peer = tokio::select! {
        peer = engine.connect(addr) => peer.with_context(|| format!("connecting to {addr}"))?,
        what = crate::probe::not_ferry(addr, crate::probe::LATE) => {
            return Err(crate::failure::NotFerry { addr: addr.to_owned(), what }.into());
        }
    };
    if args.transport == "local" && peer.transport() != ferry::TransportKind::Local {
        let why = engine
            .describe()
            .routes
            .iter()
            .find_map(|r| r.same_host.clone())
            .unwrap_or_else(|| "no reason recorded".into());
        bail!("--transport local: the same-host plane was not taken to {addr}: {why}");
    }
    let remote = peer.segment(&args.segment).map_err(|source| {
        let mut published: Vec<String> = peer.segments().iter().map(|s| s.name.clone()).collect();
        published.sort();
        UnknownSegment { source, published }
    })?;
    if remote.len() < args.op_size {
        bail!(
            "segment {:?} has {} bytes, fewer than one op of {}",
            args.segment,
            remote.len(),
            args.op_size
        );
    }
    Ok((peer, remote))
}

/// Allocates and registers the local buffer of `local_slots` ops: GPU memory with `--gpu`,
/// else host memory (checked to fit first; returned a second time, as a region, for
/// `--verify`), filled with pseudo-random bytes either way.
fn local_buffer(
    args: &BenchArgs,
    engine: &TransferEngine,
    local_slots: u64,
    depth: usize,
) -> Result<(LocalBuffer, Option<Arc<MemoryRegion>>)> {
    let batch = args.batch;
    let local_len = args.op_size.saturating_mul(local_slots);
    let local_flags = format!(
        "--op-size {} × {local_slots} slots (--depth {depth} × --batch {batch}{})",
        args.op_size,
        if args.scatter {
            ", or with --scatter the peer's segment"
        } else {
            ", at most the peer's segment"
        }
    );
    if args.gpu.is_none() {
        fits_in_memory("the local buffer", local_len, &local_flags)?;
    }
    let local_len = usize::try_from(local_len)
        .with_context(|| format!("the local buffer of {local_len} bytes ({local_flags})"))?;
    Ok(match args.gpu {
        Some(n) => {
            let reg = engine
                .alloc_gpu(n, local_len, Access::LOCAL, "bench-local")
                .with_context(|| format!("--gpu {n}"))?;
            reg.memory().copy_from_host(0, &pseudo_random(local_len))?;
            (Arc::new(reg), None)
        }
        None => {
            let local_mem = MemoryRegion::alloc_zeroed(local_len, ferry::PAGE_ALIGN)
                .with_context(|| format!("the local buffer ({local_flags})"))?;
            // Random bytes, as iperf3 -Z sends a file of random data: memory that was never
            // written is the kernel's shared zero page, which no real payload is.
            local_mem.write_at(0, &pseudo_random(local_mem.len()))?;
            let reg = engine.register(local_mem, Access::LOCAL, "bench-local")?;
            let region = reg.region().clone();
            (Arc::new(reg), Some(region))
        }
    })
}

/// One bench worker: claims `batch` ops at a time from the shared count until the op budget is
/// spent or the deadline passes, submits them as one batch, and counts what moved in `moved`.
struct Worker {
    engine: TransferEngine,
    local: LocalBuffer,
    remote: ferry::RemoteSegment,
    claimed: Arc<AtomicU64>,
    moved: Arc<Progress>,
    start: Instant,
    op_size: u64,
    batch: u64,
    /// Random slots on both sides, else slot `k` of each.
    scatter: bool,
    is_read: bool,
    local_slots: u64,
    slots_in_remote: u64,
    ops_budget: Option<u64>,
    deadline: Option<Duration>,
}

impl Worker {
    /// Runs to the end of the budget or the deadline: the latencies of its batches, or the
    /// first failed batch as [`RequestFailed`] (its completed part counted first).
    async fn run(self) -> Result<Histogram> {
        let Worker {
            engine,
            local,
            remote,
            claimed,
            moved,
            start,
            op_size,
            batch,
            scatter,
            is_read,
            local_slots,
            slots_in_remote,
            ops_budget,
            deadline,
        } = self;
        let mut lat = Histogram::default();
        let mut rng = 0x2545_f491_4f6c_dd1du64 ^ (start.elapsed().as_nanos() as u64);
        loop {
            let n = claimed.fetch_add(batch, Ordering::Relaxed);
            if ops_budget.is_some_and(|b| n + batch > b)
                || deadline.is_some_and(|d| start.elapsed() >= d)
            {
                break;
            }
            let mut ops = Batch::new();
            for k in n..n + batch {
                let (local_off, remote_off) = if scatter {
                    let l = xorshift(&mut rng) % local_slots;
                    (
                        l * op_size,
                        (xorshift(&mut rng) % slots_in_remote) * op_size,
                    )
                } else {
                    ((k % local_slots) * op_size, (k % slots_in_remote) * op_size)
                };
                ops = if is_read {
                    ops.read(&local, local_off, &remote, remote_off, op_size)
                } else {
                    ops.write(&local, local_off, &remote, remote_off, op_size)
                };
            }
            let t0 = Instant::now();
            let outcome = engine.submit(ops)?.await;
            if let Some(f) = outcome.failure {
                moved
                    .bytes
                    .fetch_add(outcome.completed_bytes, Ordering::Relaxed);
                moved
                    .ops
                    .fetch_add(outcome.completed_ops as u64, Ordering::Relaxed);
                if outcome.remote_effect == ferry::RemoteEffect::Uncertain {
                    moved.uncertain_writes.fetch_add(1, Ordering::Relaxed);
                }
                return Err(RequestFailed {
                    request: n,
                    failure: f,
                }
                .into());
            }
            lat.record(t0.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
            moved.bytes.fetch_add(op_size * batch, Ordering::Relaxed);
            moved.ops.fetch_add(batch, Ordering::Relaxed);
        }
        Ok(lat)
    }
}

/// `--verify`: moves each of the first `slots` ops once more, alone, and compares the peer's
/// CRC-32C of the remote range with ours of the local one (the host buffer: `--verify`
/// conflicts with `--gpu`). The bytes checked, or the first op that failed or differed.
async fn verify_slots(
    args: &BenchArgs,
    engine: &TransferEngine,
    peer: &ferry::Peer,
    (local, host_region): (&LocalBuffer, Option<&Arc<MemoryRegion>>),
    remote: &ferry::RemoteSegment,
    slots: u64,
) -> Result<u64> {
    let is_read = args.op == "read";
    let mut checked = 0u64;
    for k in 0..slots {
        let off = k * args.op_size;
        let batch = if is_read {
            Batch::new().read(local, off, remote, off, args.op_size)
        } else {
            Batch::new().write(local, off, remote, off, args.op_size)
        };
        let outcome = engine.submit(batch)?.await;
        if let Some(f) = outcome.failure {
            bail!("verification op {k} failed: {}", f.kind);
        }
        let theirs = peer
            .checksum(remote, off, args.op_size)
            .await
            .context("asking the peer for a checksum")?;
        let region = host_region.context("--verify needs a host buffer")?;
        let ours = ferry::checksum::crc32c_region(region, off, args.op_size)?;
        if theirs != ours {
            bail!(
                "verification failed: {} bytes at {off}: the peer's CRC-32C is {theirs:#010x}, \
                 ours {ours:#010x}",
                args.op_size
            );
        }
        checked += args.op_size;
    }
    Ok(checked)
}

/// The next xorshift64 number of `state` (not zero).
fn xorshift(state: &mut u64) -> u64 {
    let mut x = (*state).max(1);
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    x
}

/// `len` bytes of xorshift64 output (fast, and incompressible enough for a benchmark).
fn pseudo_random(len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

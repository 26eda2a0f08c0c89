//! Loopback benchmark of the io_uring transport. Prints one JSON object per run. `cargo xtask
//! bench uring` builds it and runs its `file` mode against fio; `net` is the transport alone on
//! loopback, under `ferry bench --transport uring`.
//!
//! ```text
//! uring_bench net  [--op write|read] [--op-size BYTES] [--total BYTES] [--streams N]
//!                  [--depth N] [--zc auto|always|never] [--splice on|off] [--segment BYTES]
//! uring_bench file --path FILE [--qd N] [--streams N] [--op-size BYTES]
//!                  (local read_file_into at queue depth N, then remote READs of a file segment)
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry_core::wire::{Hello, Reject, SUPPORTED_VERSIONS, TransportOffer};
use ferry_core::{
    Access, Channel, Epoch, HandshakeResponder, MemoryRegion, Op, OpKind, PeerId, PeerInfo,
    RequestControl, SegmentDesc, SegmentLease, SegmentTable, SegmentToken, Transport,
};
use ferry_file::FileSegment;
use ferry_transport_uring::{
    UringConfig, UringServer, UringTransport, ZeroCopy, block_on, handshake, read_file_into,
};

#[derive(Debug, Default)]
struct Table {
    mem: Mutex<HashMap<SegmentToken, Arc<MemoryRegion>>>,
    files: Mutex<HashMap<SegmentToken, Arc<FileSegment>>>,
}

impl SegmentTable for Table {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        let g = self.mem.lock().ok()?;
        g.get(&token).map(|r| SegmentLease {
            region: r.clone(),
            base: 0,
            len: r.len() as u64,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            guard: None,
        })
    }
    fn published(&self) -> Vec<SegmentDesc> {
        Vec::new()
    }
    fn file(&self, token: SegmentToken) -> Option<Arc<dyn ferry_core::FileSource>> {
        let f = self.files.lock().ok()?.get(&token).cloned()?;
        Some(f as Arc<dyn ferry_core::FileSource>)
    }
}

#[derive(Debug)]
struct Responder {
    id: PeerId,
    epoch: Epoch,
    offer: TransportOffer,
}

impl HandshakeResponder for Responder {
    fn peer_id(&self) -> PeerId {
        self.id
    }
    fn epoch(&self) -> Epoch {
        self.epoch
    }
    fn respond(
        &self,
        _hello: &Hello,
        _from: SocketAddr,
        _peer: Option<&str>,
    ) -> Result<Hello, Reject> {
        Ok(Hello {
            versions: SUPPORTED_VERSIONS,
            peer_id: self.id,
            epoch: self.epoch,
            transports: vec![self.offer.clone()],
            segments: vec![],
        })
    }
}

fn size(s: &str) -> Result<u64> {
    let s = s.trim();
    let (num, mul) = if let Some(n) = s.strip_suffix("GiB") {
        (n, 1u64 << 30)
    } else if let Some(n) = s.strip_suffix("MiB") {
        (n, 1 << 20)
    } else if let Some(n) = s.strip_suffix("KiB") {
        (n, 1 << 10)
    } else {
        (s, 1)
    };
    Ok(num
        .trim()
        .parse::<u64>()
        .with_context(|| format!("size {s:?}"))?
        * mul)
}

struct Args(HashMap<String, String>);

impl Args {
    fn get(&self, k: &str, default: &str) -> String {
        self.0.get(k).cloned().unwrap_or_else(|| default.to_owned())
    }
}

fn parse(args: &[String]) -> Result<Args> {
    let mut m = HashMap::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let Some(k) = a.strip_prefix("--") else {
            bail!("unexpected argument {a:?}");
        };
        let v = it.next().with_context(|| format!("--{k} needs a value"))?;
        m.insert(k.to_owned(), v.clone());
    }
    Ok(Args(m))
}

fn connect(
    server: SocketAddr,
    streams: usize,
    depth: usize,
    (zc, splice): (ZeroCopy, bool),
    chunk: u64,
) -> Result<(UringTransport, Arc<dyn Channel>)> {
    let t = UringTransport::new(UringConfig {
        streams,
        depth,
        zero_copy: zc,
        splice_loopback: splice,
        register_buffers: std::env::var_os("URING_BENCH_NO_REGISTER").is_none(),
        chunk_size: chunk,
        ..UringConfig::default()
    })?;
    let hello = Hello {
        versions: SUPPORTED_VERSIONS,
        peer_id: PeerId::random(),
        epoch: Epoch::fresh(),
        transports: vec![t.offer()],
        segments: vec![],
    };
    let reply = handshake(server, &hello, Duration::from_secs(10))?;
    let peer = PeerInfo {
        addr: server,
        local_id: hello.peer_id,
        local_epoch: hello.epoch,
        remote_id: reply.peer_id,
        remote_epoch: reply.epoch,
        offer: reply.transports[0].clone(),
        segments: vec![],
        session: None,
        key_name: None,
        version: ferry_core::wire::SUPPORTED_VERSIONS.max,
    };
    let ch = block_on(t.open(peer))?;
    Ok((t, ch))
}

/// Moves `total` bytes in ops of `op_size`, batches of `batch` ops, two batches in flight.
fn pump(
    ch: &Arc<dyn Channel>,
    kind: OpKind,
    local: &Arc<MemoryRegion>,
    token: SegmentToken,
    remote_len: u64,
    op_size: u64,
    total: u64,
) -> Result<f64> {
    let nops = total / op_size;
    let slots = (remote_len / op_size).max(1);
    let batch = 16u64;
    let start = Instant::now();
    let mut pending = std::collections::VecDeque::new();
    let mut i = 0u64;
    while i < nops || !pending.is_empty() {
        while i < nops && pending.len() < 2 {
            let n = batch.min(nops - i);
            let ops: Arc<[Op]> = (i..i + n)
                .map(|k| {
                    let at = (k % slots) * op_size;
                    Op {
                        kind,
                        local: local.clone(),
                        local_offset: at.min(local.len() as u64 - op_size),
                        token,
                        remote_offset: at,
                        len: op_size,
                    }
                })
                .collect();
            let control = Arc::new(RequestControl::new(&ops));
            pending.push_back(ch.execute(ops, control));
            i += n;
        }
        if let Some(f) = pending.pop_front() {
            let o = block_on(f);
            if !o.is_success() {
                bail!("request failed: {o:?}");
            }
        }
    }
    Ok(start.elapsed().as_secs_f64())
}

fn serve(table: Arc<Table>) -> Result<ferry_transport_uring::UringServerHandle> {
    let t = UringTransport::new(UringConfig::default())?;
    let server = UringServer::bind("127.0.0.1:0".parse()?)?;
    let responder = Arc::new(Responder {
        id: PeerId::random(),
        epoch: Epoch::fresh(),
        offer: t.offer(),
    });
    Ok(server.serve(table, responder, t.config().clone())?)
}

fn net(a: &Args) -> Result<()> {
    let op_size = size(&a.get("op-size", "1MiB"))?;
    let total = size(&a.get("total", "4GiB"))?;
    let streams: usize = a.get("streams", "1").parse()?;
    let depth: usize = a.get("depth", "8").parse()?;
    let kind = match a.get("op", "write").as_str() {
        "write" => OpKind::Write,
        "read" => OpKind::Read,
        o => bail!("--op {o}: write or read"),
    };
    let zc = match a.get("zc", "auto").as_str() {
        "auto" => ZeroCopy::Auto,
        "always" => ZeroCopy::Always,
        "never" => ZeroCopy::Never,
        o => bail!("--zc {o}: auto, always or never"),
    };
    // Remote segment and local buffer size: ops cycle through it (iperf3 reuses one buffer of
    // its `-l` length; a larger segment measures cache-cold memory as a real transfer sees it).
    let splice = match a.get("splice", "on").as_str() {
        "on" => true,
        "off" => false,
        o => bail!("--splice {o}: on or off"),
    };
    let seg_len = size(&a.get("segment", "256MiB"))?.max(op_size);
    let table = Arc::new(Table::default());
    let remote = Arc::new(MemoryRegion::alloc_zeroed(seg_len as usize, 4096)?);
    let token = SegmentToken::random();
    table
        .mem
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .insert(token, remote);
    let server = serve(table)?;
    let (t, ch) = connect(
        server.local_addr(),
        streams,
        depth,
        (zc, splice),
        op_size.min(1 << 20),
    )?;
    let local = Arc::new(MemoryRegion::alloc_zeroed(seg_len as usize, 4096)?);
    local.write_at(0, &vec![0x5a; seg_len as usize])?;
    // Warm up (connections, page faults), then measure.
    pump(
        &ch,
        kind,
        &local,
        token,
        seg_len,
        op_size,
        (64u64 << 20).min(total),
    )?;
    let secs = pump(&ch, kind, &local, token, seg_len, op_size, total)?;
    let moved = total / op_size * op_size;
    let s = t.stats();
    println!(
        "{{\"transport\":\"uring\",\"op\":\"{}\",\"op_bytes\":{op_size},\"total_bytes\":{moved},\"streams\":{streams},\"seconds\":{secs:.4},\"gb_per_s\":{:.4},\"zero_copy\":{},\"splice\":{},\"zc_sends\":{},\"spliced_sends\":{},\"fixed_sends\":{},\"copy_sends\":{},\"short_sends\":{},\"server_short_sends\":{}}}",
        kind,
        moved as f64 / secs / 1e9,
        t.config().zero_copy_enabled(),
        splice,
        s.zc_sends.load(Ordering::Relaxed),
        s.spliced_sends.load(Ordering::Relaxed),
        s.fixed_sends.load(Ordering::Relaxed),
        s.copy_sends.load(Ordering::Relaxed),
        s.short_sends.load(Ordering::Relaxed),
        server.stats().short_sends.load(Ordering::Relaxed),
    );
    Ok(())
}

/// Bytes this process has read from storage (page-cache hits excluded): O_DIRECT reads show up.
fn disk_read_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("read_bytes:").map(|v| v.trim().parse().ok()))
                .flatten()
        })
        .unwrap_or(0)
}

fn file(a: &Args) -> Result<()> {
    let path = PathBuf::from(a.get("path", ""));
    let qd: usize = a.get("qd", "32").parse()?;
    let streams: usize = a.get("streams", "4").parse()?;
    let op_size = size(&a.get("op-size", "1MiB"))?;
    let len = std::fs::metadata(&path)
        .with_context(|| format!("--path {}", path.display()))?
        .len();
    let region = Arc::new(MemoryRegion::alloc_zeroed(len as usize, 4096)?);
    let disk0 = disk_read_bytes();
    let start = Instant::now();
    read_file_into(&region, 0, &path, 0, len, qd)?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{{\"mode\":\"read_file_into\",\"bytes\":{len},\"qd\":{qd},\"seconds\":{secs:.4},\"gb_per_s\":{:.4},\"storage_read_bytes\":{}}}",
        len as f64 / secs / 1e9,
        disk_read_bytes() - disk0
    );
    let table = Arc::new(Table::default());
    let token = SegmentToken::random();
    table
        .files
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .insert(
            token,
            Arc::new(FileSegment::open(&path, Access::REMOTE_READ)?),
        );
    let server = serve(table)?;
    let (_t, ch) = connect(
        server.local_addr(),
        streams,
        8,
        (ZeroCopy::Auto, false),
        op_size,
    )?;
    let total = len / op_size * op_size;
    let disk0 = disk_read_bytes();
    let secs = pump(&ch, OpKind::Read, &region, token, len, op_size, total)?;
    println!(
        "{{\"mode\":\"file_segment_read\",\"bytes\":{total},\"streams\":{streams},\"seconds\":{secs:.4},\"gb_per_s\":{:.4},\"storage_read_bytes\":{}}}",
        total as f64 / secs / 1e9,
        disk_read_bytes() - disk0
    );
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(mode) = args.first() else {
        bail!("usage: uring_bench net|file [--flag value]...");
    };
    let a = parse(&args[1..])?;
    match mode.as_str() {
        "net" => net(&a),
        "file" => file(&a),
        m => bail!("unknown mode {m:?}: net or file"),
    }
}

//! `ferry serve`: publish named segments and serve them until stopped.

use std::collections::HashMap;
use std::net::SocketAddr;

use anyhow::{Context, Result, bail};
use ferry::{
    Access, DataPlane, FileRegistration, GpuRegistration, MemoryRegion, Registration,
    TransferEngine,
};

use crate::cmd_bench::rdma_config;
use crate::out::say;
use crate::parse::{self, DeadPeer, IoThreads};
use crate::stop::Stopped;

/// Arguments of `ferry serve`.
#[derive(clap::Args, Debug)]
pub(crate) struct ServeArgs {
    /// Address to listen on: HOST:PORT (`0.0.0.0:7400`, `localhost:0` for any free port).
    #[arg(long, default_value = DEFAULT_LISTEN, value_parser = parse::listen_addr)]
    listen: SocketAddr,
    /// A segment to publish: NAME=SIZE (generated data, e.g. `weights=1GiB`), NAME=SIZE@gpuN
    /// (generated data in GPU N's memory: registered with the NICs nearest it for RDMA peers
    /// when a GPUDirect route exists, served by staging through host memory otherwise), or
    /// NAME=@PATH (a file's bytes loaded into memory). Repeatable; names are unique. Without
    /// any `--segment`, `--file` or `--file-rw`, a segment `bench=64MiB` is published, the one
    /// `ferry bench HOST:PORT` uses.
    #[arg(long = "segment", value_name = "NAME=SIZE|NAME=SIZE@gpuN|NAME=@PATH")]
    segments: Vec<String>,
    /// A file segment to publish without loading it: NAME=PATH, served read-only, by io_uring
    /// reads (O_DIRECT where a request's alignment allows) or, on the TCP data plane, by
    /// positioned reads. Repeatable.
    #[arg(long = "file", value_name = "NAME=PATH")]
    files: Vec<String>,
    /// A file segment peers may also WRITE: NAME=PATH, as `--file`, plus writes at positions
    /// inside the file (a WRITE past its end is refused: the file never grows). Repeatable.
    #[arg(
        long = "file-rw",
        value_name = "NAME=PATH",
        conflicts_with = "read_only"
    )]
    writable_files: Vec<String>,
    /// Publish every segment read-only (default: generated segments read+write, files read-only).
    #[arg(long)]
    read_only: bool,
    /// Data streams accepted per peer and used per connection (1 to 64).
    #[arg(long, default_value = "4", value_parser = parse::streams)]
    streams: usize,
    /// Transports to serve: tcp, uring (the io_uring server, which TCP clients reach too; an
    /// error where the kernel cannot), rdma (RDMA required, plus the engine's choice of io_uring
    /// or TCP), or auto (io_uring where the kernel supports it, else TCP, plus RDMA when this
    /// machine has a usable RDMA port).
    #[arg(long, default_value = "auto", value_parser = ["auto", "tcp", "uring", "rdma"])]
    transport: String,
    /// RDMA devices and ports to serve on, in NCCL_IB_HCA syntax; default: every usable port.
    #[arg(long, value_name = "FILTER")]
    rdma_hca: Option<String>,
    /// TCP data plane: I/O threads serving the data streams (`auto`: one per core), or `caller`
    /// to serve them on this process's runtime.
    #[arg(long, default_value = "auto", value_parser = parse::io_threads)]
    io_threads: IoThreads,
    /// Give a TCP or io_uring data stream up when its sent data goes unacknowledged (or an
    /// idle one's keepalive probes go unanswered) this long (1s to a day), or `off` for the
    /// kernel's defaults (about 15 minutes).
    #[arg(long, default_value = "30s", value_parser = parse::dead_peer)]
    dead_peer_after: DeadPeer,
    /// Serve only peers that prove a key of the keyring file F (lines of `name hexkey`, each key
    /// at least 16 bytes); the key's name is the peer's identity for `--publish-to`. Without it,
    /// the file named by FERRY_AUTH_KEY_FILE, if set; with neither, anyone who can reach the
    /// address is served (a warning says so on an address other than loopback).
    #[arg(long, value_name = "F")]
    auth_key_file: Option<std::path::PathBuf>,
    /// Read the key file even where group or others may access it (a warning is logged);
    /// without it such a file is refused. `FERRY_ALLOW_OPEN_KEY_FILE=1` does the same.
    #[arg(long)]
    allow_open_key_file: bool,
    /// Publish the segment or file segment NAME only to the authenticated peers named (key
    /// names of the keyring): NAME=PEER[,PEER...]. Repeatable. Others neither see it listed nor
    /// reach it.
    #[arg(long = "publish-to", value_name = "NAME=PEER[,PEER]")]
    publish_to: Vec<String>,
    /// Serve Prometheus metrics over HTTP on ADDR: HOST:PORT (`GET /metrics`, e.g.
    /// 127.0.0.1:9400; port 0 picks a free one, printed at start), or a bare PORT for
    /// 127.0.0.1:PORT. Anyone who can reach ADDR reads them: keep it on loopback or a
    /// management network.
    #[arg(long, value_name = "ADDR", value_parser = parse::metrics_addr)]
    metrics: Option<SocketAddr>,
    /// When stopped (SIGINT, SIGTERM), print what was served as one JSON object.
    #[arg(long)]
    json: bool,
}

/// The address `serve` listens on by default (its port is the one a HOST alone means).
pub(crate) const DEFAULT_LISTEN: &str = "0.0.0.0:7400";
/// The segment a plain `ferry serve` publishes, which `ferry bench`'s `--segment` names by default.
pub(crate) const DEFAULT_SEGMENT: (&str, &str) = ("bench", "64MiB");

/// Checks what can be checked before anything starts: every spec parses, no name is given
/// twice, every `--publish-to` names a segment and has keys to name peers by.
fn check_specs(args: &ServeArgs) -> Result<()> {
    let mut seen: HashMap<&str, String> = HashMap::new();
    let specs = args
        .segments
        .iter()
        .map(|s| ("--segment", s))
        .chain(args.files.iter().map(|s| ("--file", s)))
        .chain(args.writable_files.iter().map(|s| ("--file-rw", s)));
    for (flag, spec) in specs {
        let (name, what) = spec
            .split_once('=')
            .filter(|(n, w)| !n.is_empty() && !w.is_empty())
            .with_context(|| {
                let form = if flag == "--segment" {
                    "NAME=SIZE, NAME=SIZE@gpuN or NAME=@PATH"
                } else {
                    "NAME=PATH"
                };
                format!("{flag} {spec:?}: expected {form}")
            })?;
        if flag == "--segment" && gpu_segment(spec)?.is_none() && !what.starts_with('@') {
            parse::nonzero_size(what).with_context(|| format!("--segment {spec:?}"))?;
        }
        match (flag, what.strip_prefix('@')) {
            ("--segment", Some(path)) => readable_file(flag, spec, path)?,
            ("--segment", None) => {}
            _ => readable_file(flag, spec, what)?,
        }
        if let Some(first) = seen.insert(name, format!("{flag} {spec}")) {
            bail!(
                "{flag} {spec}: the name {name:?} is already given ({first}); segment names are \
                 unique per server"
            );
        }
    }
    if !args.publish_to.is_empty()
        && args.auth_key_file.is_none()
        && std::env::var_os(ferry::AUTH_KEY_FILE_ENV).is_none_or(|v| v.is_empty())
    {
        bail!(
            "--publish-to needs --auth-key-file (or {}): peers are named by the keys they prove",
            ferry::AUTH_KEY_FILE_ENV
        );
    }
    for name in audiences(&args.publish_to)?.keys() {
        if !seen.contains_key(name.as_str()) {
            bail!("--publish-to {name}: no --segment or --file of that name");
        }
    }
    Ok(())
}

/// Refuses, before anything starts, a `PATH` of `spec` that is not a regular file this process
/// can read (a directory, a missing or unreadable file): serving it could only fail later.
fn readable_file(flag: &str, spec: &str, path: &str) -> Result<()> {
    let meta = std::fs::metadata(path).with_context(|| format!("{flag} {spec:?}: {path}"))?;
    if meta.is_dir() {
        bail!(
            "{flag} {spec:?}: {path} is a directory; a segment is one file (`ferry publish DIR` \
             broadcasts a directory's files)"
        );
    }
    if !meta.is_file() {
        bail!("{flag} {spec:?}: {path} is not a regular file");
    }
    std::fs::File::open(path).with_context(|| format!("{flag} {spec:?}: cannot read {path}"))?;
    Ok(())
}

/// `--publish-to` specs as segment name → key names.
fn audiences(specs: &[String]) -> Result<Audiences> {
    let mut out = HashMap::new();
    for spec in specs {
        let (name, peers) = spec
            .split_once('=')
            .filter(|(n, p)| !n.is_empty() && !p.is_empty())
            .with_context(|| format!("--publish-to {spec:?}: expected NAME=PEER[,PEER]"))?;
        let peers: Vec<String> = peers
            .split(',')
            .filter(|p| !p.is_empty())
            .map(str::to_owned)
            .collect();
        out.insert(name.to_owned(), peers);
    }
    Ok(out)
}

/// Fills `region` with a deterministic pattern (so that readers can check what they got).
pub(crate) fn fill_pattern(region: &MemoryRegion) -> Result<()> {
    let mut buf = vec![0u8; (1 << 20).min(region.len())];
    let mut at = 0u64;
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    while (at as usize) < region.len() {
        let n = buf.len().min(region.len() - at as usize);
        for chunk in buf[..n].chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
        }
        region.write_at(at, &buf[..n])?;
        at += n as u64;
    }
    Ok(())
}

fn load_segment(spec: &str, read_only: bool) -> Result<(String, MemoryRegion, Access)> {
    let (name, what) = spec
        .split_once('=')
        .with_context(|| format!("--segment {spec:?}: expected NAME=SIZE or NAME=@PATH"))?;
    if name.is_empty() {
        bail!("--segment {spec:?}: empty name");
    }
    if let Some(path) = what.strip_prefix('@') {
        let bytes = std::fs::read(path).with_context(|| format!("reading {path}"))?;
        return Ok((
            name.into(),
            MemoryRegion::from_vec(bytes),
            Access::REMOTE_READ,
        ));
    }
    let size = parse::nonzero_size(what).with_context(|| format!("--segment {spec:?}"))?;
    let region = MemoryRegion::alloc_zeroed(size as usize, ferry::PAGE_ALIGN)
        .with_context(|| format!("allocating {size} bytes for segment {name:?}"))?;
    fill_pattern(&region)?;
    let access = if read_only {
        Access::REMOTE_READ
    } else {
        Access::REMOTE_READ | Access::REMOTE_WRITE
    };
    Ok((name.into(), region, access))
}

/// Runs `ferry serve`.
pub(crate) fn run(args: ServeArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    rt.block_on(async move {
        // From the start: a signal while starting stops the server once it is up.
        let stop = crate::stop::listen()?;
        check_specs(&args)?;
        let audiences = audiences(&args.publish_to)?;
        // The address first (`ferry serve | head -1`), once every segment is published: what
        // is said while starting follows it.
        let starting = crate::out::Held::start();
        let engine = build_engine(&args)?;
        let description = engine.describe();
        say(format_args!(
            "transports: {}",
            description.transports.join(", ")
        ));
        if let Some(dp) = &description.data_plane {
            say(format_args!("data plane: {dp}"));
        }
        if let Some(m) = engine.metrics_addr() {
            say(format_args!("metrics on http://{m}/metrics"));
        }
        let (held, gpu_held) = publish_segments(&engine, &args, &audiences)?;
        let files = publish_files(&engine, &args, &audiences)?;
        let addr = engine.local_addr().context("the engine has no listener")?;
        let started = starting.release();
        say(format_args!("listening on {addr}"));
        for line in &started {
            say(format_args!("{line}"));
        }
        say(format_args!("serving until stopped (SIGINT, SIGTERM)"));
        let signal = stop.await;
        engine.shutdown();
        drop(files);
        drop(held);
        drop(gpu_held);
        served(&engine.describe(), args.json, signal);
        Err(Stopped(signal).into())
    })
}

/// Who each `--publish-to` segment is published to, by segment name.
type Audiences = HashMap<String, Vec<String>>;

/// The engine `args` ask for: the chosen data plane (`auto` adds the same-host plane), the key
/// file and metrics endpoint, and RDMA when `--transport rdma` (an error when unavailable) or
/// `auto` (left out, said in one line, when the machine has none or it fails; an error that is
/// not about RDMA, such as a key file or the listen address, fails the whole start).
fn build_engine(args: &ServeArgs) -> Result<TransferEngine> {
    let plane = match args.transport.as_str() {
        "tcp" => DataPlane::Tcp,
        "uring" => DataPlane::Uring,
        _ => DataPlane::Auto,
    };
    let mut builder = TransferEngine::builder()
        .listen(args.listen)
        .streams(args.streams)
        .io_threads(args.io_threads.0)
        .dead_peer_after(args.dead_peer_after.0)
        // An explicit network plane is served alone; `auto` adds the same-host plane.
        .same_host(args.transport == "auto")
        .data_plane(plane);
    if let Some(f) = &args.auth_key_file {
        builder = builder.auth_key_file(f);
    }
    builder = builder.allow_open_key_file(args.allow_open_key_file);
    if let Some(addr) = args.metrics {
        builder = builder.metrics(addr);
    }
    Ok(match args.transport.as_str() {
        "tcp" | "uring" => builder.build()?,
        "rdma" => builder
            .rdma(rdma_config(args.rdma_hca.as_deref())?)
            .build()?,
        _ => match builder
            .clone()
            .rdma(rdma_config(args.rdma_hca.as_deref())?)
            .build()
        {
            Ok(engine) => engine,
            // No RDMA on this machine: the common case, said in one calm line.
            Err(ferry::Error::Unavailable { .. }) => {
                say(format_args!("RDMA: none here (`ferry doctor` says why)"));
                builder.build()?
            }
            // Not about RDMA (a key file, the listen address): the same without RDMA
            // fails the same way, and says so.
            Err(e @ (ferry::Error::AuthKey { .. } | ferry::Error::Io { .. })) => {
                return Err(e.into());
            }
            Err(e) => {
                eprintln!("ferry serve: RDMA not served: {e}");
                builder.build()?
            }
        },
    })
}

/// Publishes every `--segment` (or, with no `--segment`, `--file` nor `--file-rw`, the default
/// segment `ferry bench` uses), each to its `--publish-to` audience or to every peer, and says
/// each in one line. The registrations are held by the caller until it stops serving.
fn publish_segments(
    engine: &TransferEngine,
    args: &ServeArgs,
    audiences: &Audiences,
) -> Result<(Vec<Registration>, Vec<GpuRegistration>)> {
    let mut held = Vec::new();
    let mut gpu_held = Vec::new();
    let default_segment;
    let segments =
        if args.segments.is_empty() && args.files.is_empty() && args.writable_files.is_empty() {
            default_segment = [format!("{}={}", DEFAULT_SEGMENT.0, DEFAULT_SEGMENT.1)];
            say(format_args!(
                "no --segment or --file given: publishing {} for `ferry bench`",
                default_segment[0]
            ));
            &default_segment[..]
        } else {
            &args.segments[..]
        };
    for spec in segments {
        if let Some((name, size, ordinal)) = gpu_segment(spec)? {
            if audiences.contains_key(&name) {
                bail!("--publish-to {name}: GPU segments are published to every peer");
            }
            gpu_held.push(publish_gpu_segment(
                engine,
                spec,
                &name,
                size,
                ordinal,
                args.read_only,
            )?);
            continue;
        }
        let (name, region, access) = load_segment(spec, args.read_only)?;
        let len = region.len();
        match audiences.get(&name) {
            Some(peers) => {
                let peers: Vec<&str> = peers.iter().map(String::as_str).collect();
                held.push(
                    engine
                        .register_to(region, access, &name, &peers)
                        .with_context(|| format!("--publish-to {name}"))?,
                );
                say(format_args!(
                    "segment {name}: {len} bytes, {access}, to {}",
                    peers.join(",")
                ));
            }
            None => {
                held.push(engine.register(region, access, &name)?);
                say(format_args!("segment {name}: {len} bytes, {access}"));
            }
        }
    }
    Ok((held, gpu_held))
}

/// Allocates `--segment spec` (`name`, `size` bytes on GPU `ordinal`), fills it with the
/// generated pattern and says where it lives and how it is routed.
fn publish_gpu_segment(
    engine: &TransferEngine,
    spec: &str,
    name: &str,
    size: u64,
    ordinal: u32,
    read_only: bool,
) -> Result<GpuRegistration> {
    let access = if read_only {
        Access::REMOTE_READ
    } else {
        Access::REMOTE_READ | Access::REMOTE_WRITE
    };
    let reg = engine
        .alloc_gpu(ordinal, size as usize, access, name)
        .with_context(|| format!("--segment {spec:?}"))?;
    let pattern = MemoryRegion::alloc_zeroed(size as usize, ferry::PAGE_ALIGN)?;
    fill_pattern(&pattern)?;
    let mut bytes = vec![0u8; size as usize];
    pattern.read_at(0, &mut bytes)?;
    reg.memory().copy_from_host(0, &bytes)?;
    let loc = reg.memory().location();
    let nics = reg.nics();
    let nics = if nics.is_empty() {
        String::new()
    } else {
        format!("; NICs {}", nics.join(", "))
    };
    say(format_args!(
        "segment {name}: {size} bytes on GPU {} ({}), {access}; route {} ({}){nics}",
        loc.ordinal,
        loc.pci_bus_id,
        reg.route().route,
        reg.route().why
    ));
    Ok(reg)
}

/// Publishes every `--file` (read-only) and `--file-rw` (read and write) NAME=PATH, each to its
/// `--publish-to` audience or to every peer, and says each in one line.
fn publish_files(
    engine: &TransferEngine,
    args: &ServeArgs,
    audiences: &Audiences,
) -> Result<Vec<FileRegistration>> {
    let mut files = Vec::new();
    let specs = args
        .files
        .iter()
        .map(|s| ("--file", s, Access::REMOTE_READ))
        .chain(
            args.writable_files
                .iter()
                .map(|s| ("--file-rw", s, Access::REMOTE_READ | Access::REMOTE_WRITE)),
        );
    for (flag, spec, access) in specs {
        let (name, path) = spec
            .split_once('=')
            .filter(|(n, p)| !n.is_empty() && !p.is_empty())
            .with_context(|| format!("{flag} {spec:?}: expected NAME=PATH"))?;
        let file = match audiences.get(name) {
            Some(peers) => {
                let peers: Vec<&str> = peers.iter().map(String::as_str).collect();
                engine.publish_file_to(path, access, name, &peers)
            }
            None => engine.publish_file_named(path, access, name),
        }
        .with_context(|| format!("{flag} {spec:?}"))?;
        say(format_args!(
            "file segment {name}: {} bytes of {path}, {access}",
            file.len()
        ));
        files.push(file);
    }
    Ok(files)
}

/// What a server `signal` stopped served: one line (one JSON object under `--json`) with the
/// requests and bytes accepted from peers and the requests refused.
fn served(d: &ferry::Description, json: bool, signal: crate::stop::Signal) {
    let (mut ops, mut bytes) = (0u64, 0u64);
    let mut refused = 0u64;
    if let Some(s) = &d.served {
        for t in &s.accepted {
            ops += t.ops;
            bytes += t.bytes;
        }
        refused = s.refused.iter().map(|(_, n)| n).sum();
    }
    if json {
        say(format_args!(
            "{}",
            serde_json::json!({
                "stopped_by": signal.name(),
                "ops_served": ops,
                "bytes_served": bytes,
                "refused": refused,
            })
        ));
    } else {
        say(format_args!(
            "stopped by {}: served {ops} ops, {bytes} bytes ({}); refused {refused}",
            signal.name(),
            crate::out::bytes(bytes)
        ));
    }
}

/// `NAME=SIZE@gpuN`: the name, the size and the GPU ordinal; `None` for other specs.
fn gpu_segment(spec: &str) -> Result<Option<(String, u64, u32)>> {
    let Some((name, what)) = spec.split_once('=') else {
        return Ok(None);
    };
    let Some((size, gpu)) = what.rsplit_once("@gpu") else {
        return Ok(None);
    };
    if size.is_empty() || name.is_empty() {
        bail!("--segment {spec:?}: expected NAME=SIZE@gpuN");
    }
    let ordinal = gpu
        .parse::<u32>()
        .with_context(|| format!("--segment {spec:?}: GPU ordinal {gpu:?}"))?;
    let size = parse::nonzero_size(size).with_context(|| format!("--segment {spec:?}"))?;
    Ok(Some((name.to_owned(), size, ordinal)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_segment_specs() {
        assert_eq!(
            gpu_segment("w=4MiB@gpu1").unwrap(),
            Some(("w".into(), 4 << 20, 1))
        );
        assert_eq!(gpu_segment("w=4MiB").unwrap(), None);
        assert_eq!(gpu_segment("w=@/tmp/x").unwrap(), None);
        assert!(gpu_segment("w=4MiB@gpux").is_err());
        assert!(gpu_segment("=4MiB@gpu0").is_err());
    }
}

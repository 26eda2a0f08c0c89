//! `ferry publish` and `ferry pull`: weight broadcast (`ferry-broadcast`).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use ferry::DataPlane;
use ferry_broadcast::{
    Discovery, Embedded, Manifest, Receiver, ReceiverOptions, Source, SourceOptions,
};

use crate::out::{Goal, Meter, ProgressMode, say};
use crate::parse;
use crate::stop::Stopped;

/// Arguments of `ferry publish`. On SIGHUP it reads the files again and publishes them as the
/// next version, without restarting (the version before stays served while it is among the
/// two newest, as long as its files are unchanged: a version whose files changed on disk,
/// overwritten in place, is withdrawn with a warning; replace files by renaming to keep the
/// version before served). It prints a line when a receiver joins, finishes or leaves
/// unfinished.
#[derive(clap::Args, Debug)]
pub(crate) struct PublishArgs {
    /// The files to publish (a `.safetensors` file is listed tensor by tensor); a directory
    /// stands for the files directly in it (a checkpoint directory).
    #[arg(required = true, value_name = "FILE|DIR")]
    files: Vec<PathBuf>,
    /// The broadcast's name.
    #[arg(long)]
    name: String,
    /// The broadcast's version (receivers never mix two). Not `--version`, which prints
    /// ferry's own.
    #[arg(long, value_name = "N", default_value_t = 1)]
    weights_version: u64,
    /// Control address receivers are given (`ferry pull ADDR`); the Ferry listener takes the
    /// same IP and any free port.
    #[arg(long, default_value = "0.0.0.0:7500")]
    listen: SocketAddr,
    /// Also list the source in this etcd (`http://HOST:PORT`), for `ferry pull
    /// etcd://HOST:PORT/NAME` (needs a build with the `etcd` feature).
    #[arg(long, value_name = "URL")]
    etcd: Option<String>,
    /// Chunk size (the unit of transfer and verification), 4KiB to 64MiB.
    #[arg(long, default_value = "1MiB", value_parser = publish_chunk_size)]
    chunk_size: u64,
    /// Read the files into host memory first and serve them from there, as a trainer serves
    /// its tensors (each file one tensor, named after it; no file reads while serving). On
    /// SIGHUP the files are read into new memory as the next version. A receiver pulling into
    /// a directory writes each as FILE.vN (the memory's registration).
    #[arg(long)]
    from_memory: bool,
    /// Data plane: auto (peers on this host by the same-host plane, others by io_uring where
    /// the kernel can, else TCP), or tcp or uring alone.
    #[arg(long, default_value = "auto", value_parser = ["auto", "tcp", "uring"])]
    transport: String,
    /// Stop after this long (`90s`, `10m`; default: until interrupted).
    #[arg(long, value_name = "DURATION", value_parser = parse::positive_duration)]
    serve_for: Option<Duration>,
    /// Authenticate the broadcast with the keyring file F (lines of `name hexkey`): every
    /// control request (join, heartbeat, leave, manifest, progress) and every chunk is served
    /// only to members that prove a key of it. Without it, the file named by
    /// FERRY_AUTH_KEY_FILE, if set; with neither, anyone who reaches the address is served.
    #[arg(long, value_name = "F")]
    auth_key_file: Option<PathBuf>,
    /// Read the key file even where group or others may access it (a warning is logged);
    /// without it such a file is refused. `FERRY_ALLOW_OPEN_KEY_FILE=1` does the same.
    #[arg(long)]
    allow_open_key_file: bool,
}

/// Arguments of `ferry pull`.
#[derive(clap::Args, Debug)]
pub(crate) struct PullArgs {
    /// The source's control address (HOST:PORT), or `etcd://HOST:PORT/NAME`. From etcd, where
    /// anyone who can write etcd may list a source, give `--auth-key-file` or
    /// `--expect-manifest` too: without either the pull is refused.
    from: String,
    /// Directory the files are written to (as published): checked first (it can be made and
    /// written, and has room for the payload), then each chunk is written as it is verified
    /// into a hidden temporary file, renamed into place when the pull completes (memory: a
    /// window of chunks, whatever the payload).
    #[arg(long)]
    into: Option<PathBuf>,
    /// Keep the pull in memory and write no file (every chunk is still verified; a check of a
    /// source, or a benchmark of the transfer alone).
    #[arg(long, conflicts_with = "into")]
    in_memory: bool,
    /// IP to serve relayed chunks on [default: the one this host reaches the source from].
    #[arg(long)]
    listen: Option<IpAddr>,
    /// Data plane: auto (peers on this host by the same-host plane, others by io_uring where
    /// the kernel can, else TCP), or tcp or uring alone.
    #[arg(long, default_value = "auto", value_parser = ["auto", "tcp", "uring"])]
    transport: String,
    /// Chunks in flight.
    #[arg(long, default_value = "8", value_parser = parse::count)]
    window: usize,
    /// Give up a holder, the source too, that sends nothing this long while chunks are asked
    /// of it, or a parent that advertises nothing new (`3s`, `500ms`); the pull goes on from
    /// others, or fails naming it.
    #[arg(long, value_name = "DURATION", default_value = "3s", value_parser = parse::positive_duration)]
    stall_after: Duration,
    /// After finishing, keep serving while other receivers of the version are unfinished, at
    /// most this long (`30s`, as Python's `pull`; `0` not at all).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse::duration)]
    linger: Duration,
    /// Progress while it pulls: `auto` (a bar on a terminal, else lines), `bar`, `lines` (one
    /// line on stderr every `--progress-every`: bytes, rate, peers, ETA) or `none`.
    #[arg(long, value_enum, default_value = "auto", hide_possible_values = true)]
    progress: ProgressMode,
    /// With progress lines: one every this long (at most 10s).
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = crate::out::progress_every)]
    progress_every: Duration,
    /// Fetch from the source only, never from other receivers (a point-to-point pull: the
    /// baseline the relayed pull is measured against).
    #[arg(long)]
    no_relay: bool,
    /// Stripes of the relay plan: the chunks go down this many trees of this degree, so each
    /// member uploads about what it downloads; 1 is a chain in join order. Every receiver of
    /// one broadcast should use the same.
    #[arg(long, value_name = "N", default_value_t = ferry_broadcast::DEFAULT_STRIPES, value_parser = parse::count)]
    stripes: usize,
    /// Print one JSON summary instead of the progress bar and human summary (with
    /// `timeline`: when the command started, joined, got the manifest, requested and verified
    /// its first chunk, verified its last and was done, in seconds since the Unix epoch).
    #[arg(long)]
    json: bool,
    /// Pull this version of the weights [default: the newest the source publishes]. Not
    /// `--version`, which prints ferry's own.
    #[arg(long, value_name = "N")]
    weights_version: Option<u64>,
    /// Refuse any manifest but the one of this digest (64 hex digits, as `ferry publish`
    /// prints it): binds every chunk's hash, and so every byte, to that publisher.
    #[arg(long, value_name = "DIGEST", value_parser = digest)]
    expect_manifest: Option<ferry_broadcast::Digest>,
    /// Authenticate the broadcast with the keyring file F (lines of `name hexkey`): every
    /// control request (join, heartbeat, leave, manifest, progress) and every chunk is served
    /// only to members that prove a key of it. Without it, the file named by
    /// FERRY_AUTH_KEY_FILE, if set; with neither, anyone who reaches the address is served.
    #[arg(long, value_name = "F")]
    auth_key_file: Option<PathBuf>,
    /// Read the key file even where group or others may access it (a warning is logged);
    /// without it such a file is refused. `FERRY_ALLOW_OPEN_KEY_FILE=1` does the same.
    #[arg(long)]
    allow_open_key_file: bool,
}

/// `--into DIR`, checked before anything is pulled: it can be made (if missing) and a file can
/// be created in it. What the check made is removed again, so a pull refused later leaves
/// nothing behind; a bad directory fails at once rather than after the pull.
fn writable_dir(dir: &std::path::Path) -> Result<()> {
    // The first missing ancestor (or DIR itself): what the check makes, and removes.
    let made = dir
        .ancestors()
        .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
        .last()
        .map(std::path::Path::to_path_buf);
    let check = || -> Result<()> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--into {}: cannot make the directory", dir.display()))?;
        let probe = dir.join(format!(".ferry-probe.{}", std::process::id()));
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&probe)
            .with_context(|| format!("--into {}: cannot write there", dir.display()))?;
        let _ = std::fs::remove_file(&probe);
        Ok(())
    };
    let checked = check();
    if let Some(made) = made {
        let _ = std::fs::remove_dir_all(made);
    }
    checked
}

/// The broadcast's keyring: `--auth-key-file`, else the file FERRY_AUTH_KEY_FILE names (empty
/// means unset), else none.
fn keys(file: Option<&PathBuf>, allow_open: bool) -> Result<Option<ferry::Keyring>> {
    let path = file.cloned().or_else(|| {
        std::env::var_os(ferry::AUTH_KEY_FILE_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    });
    let allow_open =
        allow_open || std::env::var(ferry::ALLOW_OPEN_KEY_FILE_ENV).is_ok_and(|v| v == "1");
    path.map(|p| ferry::load_keyring(&p, allow_open))
        .transpose()
        .context("reading the broadcast's key file")
}

/// `pull --expect-manifest`: 64 hex digits.
fn digest(s: &str) -> Result<ferry_broadcast::Digest> {
    ferry_broadcast::Digest::from_hex(s.trim())
        .with_context(|| format!("{s:?} is not a manifest digest (64 hex digits)"))
}

/// `publish --chunk-size`: a size in the manifest's range.
fn publish_chunk_size(s: &str) -> Result<u64> {
    let (lo, hi) = ferry_broadcast::manifest::CHUNK_SIZE_RANGE;
    match parse::size(s)? {
        n if (lo..=hi).contains(&n) => Ok(n),
        _ => bail!("must be {} KiB to {} MiB", lo >> 10, hi >> 20),
    }
}

fn plane(s: &str) -> DataPlane {
    match s {
        "tcp" => DataPlane::Tcp,
        "uring" => DataPlane::Uring,
        _ => DataPlane::Auto,
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")
}

#[cfg(feature = "etcd")]
async fn etcd(url: &str, name: &str) -> Result<Arc<dyn Discovery>> {
    let d = ferry_broadcast::Etcd::connect(url, name, Duration::from_secs(3)).await?;
    Ok(Arc::new(d))
}

#[cfg(not(feature = "etcd"))]
async fn etcd(url: &str, _name: &str) -> Result<Arc<dyn Discovery>> {
    bail!(
        "etcd discovery ({url}) needs a ferry built with the etcd feature: \
         `cargo build --release -p ferry-engine-cli --features etcd` (its client needs protoc, \
         Debian's protobuf-compiler)"
    )
}

/// The files to publish: each FILE as given, each DIR as the files directly in it, by name (a
/// checkpoint directory). A directory inside a DIR is refused: pulled files land side by side,
/// named after their file names.
fn expand_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for path in paths {
        let meta =
            std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
        if !meta.is_dir() {
            files.push(path.clone());
            continue;
        }
        let mut inside = Vec::new();
        for entry in
            std::fs::read_dir(path).with_context(|| format!("listing {}", path.display()))?
        {
            let entry = entry.with_context(|| format!("listing {}", path.display()))?;
            let p = entry.path();
            if p.is_dir() {
                bail!(
                    "{} is a directory inside {}: publish DIR takes the files directly in it \
                     (give {} as a DIR of its own if its file names differ)",
                    p.display(),
                    path.display(),
                    p.display()
                );
            }
            inside.push(p);
        }
        if inside.is_empty() {
            bail!(
                "{} is an empty directory: nothing to publish",
                path.display()
            );
        }
        inside.sort();
        files.extend(inside);
    }
    Ok(files)
}

pub(crate) fn publish(args: PublishArgs) -> Result<()> {
    let files = expand_files(&args.files)?;
    let keys = keys(args.auth_key_file.as_ref(), args.allow_open_key_file)?;
    runtime()?.block_on(async {
        let signal = crate::stop::listen()?;
        let discovery = match &args.etcd {
            Some(url) => Some(etcd(url, &args.name).await?),
            None => None,
        };
        let opts = SourceOptions {
            listen: args.listen,
            data_plane: plane(&args.transport),
            keys: keys.clone(),
            ..Default::default()
        };
        // From memory: the engine the tensors are registered with, and each kept version's
        // registrations (dropped once the source no longer serves that version).
        let mut in_memory = None;
        let src = if args.from_memory {
            let mut builder = ferry::TransferEngine::builder()
                .data_plane(opts.data_plane)
                // An explicit network plane is served alone; `auto` adds the same-host plane.
                .same_host(args.transport == "auto")
                .listen(SocketAddr::new(args.listen.ip(), 0));
            if let Some(k) = &keys {
                builder = builder.auth_keyring(k.clone());
            }
            let engine = builder.build()?;
            let (regs, tensors) = load_into_memory(&engine, &files, args.weights_version)?;
            let src = Source::start_tensors(
                &engine,
                &args.name,
                args.weights_version,
                &tensors,
                args.chunk_size,
                opts,
                discovery,
            )
            .await?;
            in_memory = Some((engine, vec![(args.weights_version, regs)]));
            src
        } else {
            let manifest =
                Manifest::build(&args.name, args.weights_version, &files, args.chunk_size)
                    .context("building the manifest")?;
            Source::start(manifest, &files, opts, discovery).await?
        };
        let m = src.manifest();
        say(format_args!(
            "publishing {:?} version {} (epoch {}): {} files, {} bytes in {} chunks, {} entries",
            m.name,
            m.version,
            src.epoch(),
            m.segments.len(),
            m.total_bytes(),
            m.chunks.len(),
            m.entries.len()
        ));
        say(format_args!(
            "control {} data {}; receivers: ferry pull {} --into DIR --expect-manifest {}",
            src.ctl_addr(),
            src.data_addr().map(|a| a.to_string()).unwrap_or_default(),
            src.ctl_addr(),
            m.digest()
        ));
        if let Some(url) = &args.etcd {
            let host = url.trim_start_matches("http://").trim_end_matches('/');
            say(format_args!(
                "or, through etcd: ferry pull etcd://{host}/{} --into DIR --expect-manifest {}",
                m.name,
                m.digest()
            ));
        }
        let stop = async {
            match args.serve_for {
                Some(d) => tokio::select! {
                    () = tokio::time::sleep(d) => None,
                    s = signal => Some(s),
                },
                None => Some(signal.await),
            }
        };
        tokio::pin!(stop);
        let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .context("listening for SIGHUP")?;
        let mut version = args.weights_version;
        let mut events = src.subscribe();
        let stopped_by = loop {
            tokio::select! {
                s = &mut stop => break s,
                Ok(e) = events.recv() => say(format_args!("{e}")),
                Some(()) = hangup.recv() => {
                    version += 1;
                    // Reads every file once, to checksum it (and, from memory, into memory).
                    let published = tokio::task::block_in_place(|| match &mut in_memory {
                        Some((engine, kept)) => {
                            let (regs, tensors) = load_into_memory(engine, &files, version)?;
                            let m = src.publish(version, &tensors, Some(args.chunk_size))?;
                            kept.push((version, regs));
                            let served = src.versions();
                            kept.retain(|(v, _)| served.contains(v));
                            anyhow::Ok(m)
                        }
                        None => Ok(src.publish_files(version, &files, Some(args.chunk_size))?),
                    });
                    match published {
                        Ok(m) => say(format_args!(
                            "publishing {:?} version {version}: {} files, {} bytes in {} chunks \
                             (versions served: {:?}); manifest {}",
                            m.name,
                            m.segments.len(),
                            m.total_bytes(),
                            m.chunks.len(),
                            src.versions(),
                            m.digest()
                        )),
                        Err(e) => {
                            version -= 1;
                            eprintln!("ferry publish: version {} not published: {e}", version + 1);
                        }
                    }
                }
            }
        };
        let served = src
            .engine()
            .describe()
            .served
            .map_or(0, |s| s.accepted.iter().map(|t| t.bytes).sum::<u64>());
        let members = src.members().len();
        src.stop().await;
        if let Some((engine, kept)) = in_memory {
            drop(kept);
            engine.shutdown();
        }
        match stopped_by {
            None => Ok(()),
            Some(signal) => {
                say(format_args!(
                    "stopped by {}: served {served} bytes ({}); {members} member{}",
                    signal.name(),
                    crate::out::bytes(served),
                    if members == 1 { "" } else { "s" }
                ));
                Err(Stopped(signal).into())
            }
        }
    })
}

/// `publish --from-memory`: each file read into host memory registered with `engine` (as
/// `<file name>.v<version>`, remote read only) and offered as one tensor named after the file.
fn load_into_memory(
    engine: &ferry::TransferEngine,
    files: &[PathBuf],
    version: u64,
) -> Result<(Vec<ferry::Registration>, Vec<ferry_broadcast::Tensor>)> {
    let mut regs = Vec::with_capacity(files.len());
    let mut tensors = Vec::with_capacity(files.len());
    for file in files {
        let name = file
            .file_name()
            .and_then(|n| n.to_str())
            .with_context(|| format!("{}: not a file name in UTF-8", file.display()))?;
        let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
        let seg = format!("{name}.v{version}");
        let reg = engine
            .register(
                ferry::MemoryRegion::from_vec(bytes),
                ferry::Access::REMOTE_READ,
                &seg,
            )
            .with_context(|| format!("registering {}", file.display()))?;
        tensors.push(ferry_broadcast::Tensor {
            name: name.to_owned(),
            slice: ferry_broadcast::Slice::whole(&reg, &seg),
            dtype: None,
            shape: None,
        });
        regs.push(reg);
    }
    Ok((regs, tensors))
}

pub(crate) fn pull(args: PullArgs) -> Result<()> {
    if args.into.is_none() && !args.in_memory {
        use clap::CommandFactory;
        crate::Cli::command()
            .error(
                clap::error::ErrorKind::MissingRequiredArgument,
                "say where the pull goes: --into DIR (write its files there) or --in-memory \
                 (keep it in memory only: a check of a source, or a benchmark)",
            )
            .exit();
    }
    let started = ferry_broadcast::unix_now();
    let last = std::sync::Mutex::new(None::<ferry_broadcast::Snapshot>);
    let result = pull_inner(&args, &last, started);
    result.map_err(|e| {
        let mut facts = serde_json::Map::new();
        let snap = last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        facts.insert("from".into(), args.from.clone().into());
        facts.insert("bytes".into(), snap.as_ref().map_or(0, |s| s.bytes).into());
        facts.insert("total_bytes".into(), snap.as_ref().map(|s| s.total).into());
        facts.insert(
            "refetched_chunks".into(),
            snap.as_ref().map_or(0, |s| s.refetched).into(),
        );
        if let Some(Stopped(signal)) = e.downcast_ref::<Stopped>() {
            facts.insert("stopped_by".into(), signal.name().into());
            if args.json {
                say(format_args!("{}", serde_json::Value::Object(facts)));
            } else {
                let (b, t) = snap.as_ref().map_or((0, 0), |s| (s.bytes, s.total));
                say(format_args!(
                    "stopped by {}: {b} of {t} bytes pulled",
                    signal.name()
                ));
            }
            return e;
        }
        let done = snap.as_ref().map(|s| {
            format!(
                "before failing: {} of {} bytes pulled, {} chunks re-fetched",
                s.bytes, s.total, s.refetched
            )
        });
        crate::failure::report(e, crate::failure::Server::Publish, args.json, facts, done)
    })
}

/// Where `ferry pull` finds the broadcast: etcd (`etcd://HOST:PORT/NAME`, refused unless keys or
/// an expected digest bind the source it lists) or the source's control address (the embedded
/// discovery), and the broadcast's name where the address does not imply it.
async fn discovery_of(
    args: &PullArgs,
    keys: Option<&ferry::Keyring>,
) -> Result<(Arc<dyn Discovery>, Option<String>)> {
    Ok(match args.from.strip_prefix("etcd://") {
        Some(rest) => {
            let Some((host, name)) = rest.split_once('/') else {
                bail!("etcd://HOST:PORT/NAME, not {:?}", args.from);
            };
            // Refused before etcd is asked anything: what etcd lists proves nothing.
            ferry_broadcast::discovery::require_bound(
                ferry_broadcast::Listing::Open,
                &format!("etcd http://{host}"),
                keys.is_some(),
                args.expect_manifest.is_some(),
            )?;
            (
                etcd(&format!("http://{host}"), name).await?,
                Some(name.to_owned()),
            )
        }
        None => {
            if !parse::has_port(&args.from) {
                bail!(
                    "{:?} has no port: give HOST:PORT, as `ferry publish` prints it \
                     (its control port is 7500 unless --listen says otherwise)",
                    args.from
                );
            }
            let addr: SocketAddr = tokio::net::lookup_host(&args.from)
                .await
                .with_context(|| format!("resolving {}", args.from))?
                .next()
                .with_context(|| format!("{} resolves to nothing", args.from))?;
            let d = match keys {
                Some(k) => Embedded::with_keys(addr, k.clone()),
                None => Embedded::new(addr),
            };
            (Arc::new(d), None)
        }
    })
}

/// Where a pull fetches from and what it re-fetched, for its progress line (`None` before the
/// first parent is attached and nothing was re-fetched).
fn pull_note(s: &ferry_broadcast::Snapshot) -> Option<String> {
    let mut parts = Vec::new();
    if !s.parent.is_empty() {
        parts.push(format!("from {}", s.parent));
    }
    if s.refetched > 0 {
        parts.push(format!("{} re-fetched", s.refetched));
    }
    (!parts.is_empty()).then(|| parts.join(", "))
}

fn pull_inner(
    args: &PullArgs,
    last: &std::sync::Mutex<Option<ferry_broadcast::Snapshot>>,
    started: f64,
) -> Result<()> {
    if let Some(dir) = &args.into {
        writable_dir(dir)?;
    }
    let keys = keys(args.auth_key_file.as_ref(), args.allow_open_key_file)?;
    let rt = runtime()?;
    let stop = rt.block_on(async { crate::stop::listen() })?;
    // Set once the summary is printed: the pull succeeded, and a signal after it (while it
    // lingers or leaves) ends the command with that success, not as a stop.
    let finished = std::sync::atomic::AtomicBool::new(false);
    // The receiver's way off the member list: a pull stopped by a signal leaves it at once, so
    // that the publisher and the other receivers drop it from their plans now, not when its
    // lease runs out (they would try to attach it meanwhile, and count it as a peer).
    let leave = std::sync::Mutex::new(None::<ferry_broadcast::LeaveHandle>);
    let pulled = async {
        let (discovery, name) = discovery_of(args, keys.as_ref()).await?;
        // The embedded source names the broadcast in its manifest.
        let opts = ReceiverOptions {
            listen_ip: args.listen,
            data_plane: plane(&args.transport),
            window: args.window,
            stall_after: args.stall_after,
            relay: !args.no_relay,
            stripes: args.stripes,
            version: args.weights_version,
            expect_manifest: args.expect_manifest,
            keys,
            ..Default::default()
        };
        // Into a directory, the chunks are written to (temporary) files as they are verified:
        // the payload is never held in memory.
        let mut r = match &args.into {
            Some(dir) => Receiver::join_to_dir(discovery, name.as_deref(), dir, opts).await?,
            None => Receiver::join(discovery, name.as_deref(), opts).await?,
        };
        *leave
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(r.leave_handle());
        let goal = Goal::Bytes(r.manifest().total_bytes());
        let mut meter = Meter::new(args.progress, args.progress_every, args.json, "pull", goal);
        let rx = r.progress();
        // The last snapshot is kept for the report of a failure or a stop.
        let keep = |meter: &mut Meter| {
            let s = rx.borrow().clone();
            meter.stalled_on(s.stalled.clone());
            meter.update(s.bytes, Some(s.peers), pull_note(&s).as_deref());
            *last
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(s);
        };
        let summary = {
            let run = r.run();
            tokio::pin!(run);
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tokio::select! {
                    res = &mut run => break res,
                    _ = tick.tick() => keep(&mut meter),
                }
            }
        };
        keep(&mut meter);
        meter.finish();
        let mut summary = summary?;
        summary.timeline.process_start = Some(started);
        let written = match &args.into {
            Some(dir) => {
                r.write_to(dir)?;
                format!("written to {}", dir.display())
            }
            None => "kept in memory only (--in-memory)".to_owned(),
        };
        if args.json {
            say(format_args!("{}", serde_json::to_string(&summary)?));
        } else {
            say(format_args!(
                "{:?} v{}: {} bytes in {:.3} s ({:.3} GB/s), verified; {} chunks re-fetched; \
                 {} bytes from the source, {} from relays; {}",
                summary.name,
                summary.version,
                summary.bytes,
                summary.seconds,
                summary.gb_per_s,
                summary.refetched_chunks,
                summary.bytes_from_source,
                summary.bytes_from_relays,
                written
            ));
        }
        finished.store(true, std::sync::atomic::Ordering::Release);
        r.linger(args.linger).await;
        r.leave().await;
        Ok(())
    };
    rt.block_on(async {
        let ended = tokio::select! {
            r = pulled => Ok(r),
            signal = stop => Err(signal),
        };
        // The pull is dropped (its receiver stopped serving): its entry goes too, whether it
        // failed or was stopped (a pull that completed left already; leaving twice is
        // harmless).
        let handle = leave
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(h) = handle {
            h.leave().await;
        }
        match ended {
            Ok(r) => r,
            Err(_) if finished.load(std::sync::atomic::Ordering::Acquire) => Ok(()),
            Err(signal) => Err(Stopped(signal).into()),
        }
    })
}

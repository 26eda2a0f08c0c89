//! `ferry publish` and `ferry pull`: weight broadcast (`ferry-broadcast`).

use std::io::IsTerminal;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use ferry::DataPlane;
use ferry_broadcast::{
    Discovery, Embedded, Manifest, Receiver, ReceiverOptions, Source, SourceOptions,
};

use crate::cmd_bench::parse_size;

/// Arguments of `ferry publish`. On SIGHUP it reads the files again and publishes them as the
/// next version, without restarting (the version before stays served while it is among the
/// two newest, as long as its files are unchanged: write the next checkpoint in place and
/// pulls of the old version fail verification instead of mixing).
#[derive(clap::Args, Debug)]
pub(crate) struct PublishArgs {
    /// The files to publish (a `.safetensors` file is listed tensor by tensor).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// The broadcast's name.
    #[arg(long)]
    name: String,
    /// Its version (receivers never mix two).
    #[arg(long, default_value_t = 1)]
    version: u64,
    /// Control address receivers are given (`ferry pull ADDR`); the Ferry listener takes the
    /// same IP and any free port.
    #[arg(long, default_value = "0.0.0.0:7500")]
    listen: SocketAddr,
    /// Also list the source in this etcd (`http://HOST:PORT`), for `ferry pull
    /// etcd://HOST:PORT/NAME` (needs a build with the `etcd` feature).
    #[arg(long, value_name = "URL")]
    etcd: Option<String>,
    /// Chunk size (the unit of transfer and verification).
    #[arg(long, default_value = "1MiB", value_parser = parse_size)]
    chunk_size: u64,
    /// Data plane: auto, tcp or uring.
    #[arg(long, default_value = "auto", value_parser = ["auto", "tcp", "uring"])]
    transport: String,
    /// Stop after this many seconds (default: until interrupted).
    #[arg(long, value_name = "SECS")]
    serve_for: Option<f64>,
}

/// Arguments of `ferry pull`.
#[derive(clap::Args, Debug)]
pub(crate) struct PullArgs {
    /// The source's control address (HOST:PORT), or `etcd://HOST:PORT/NAME`.
    from: String,
    /// Directory the files are written to (as published).
    #[arg(long)]
    into: PathBuf,
    /// IP to serve relayed chunks on [default: the one this host reaches the source from].
    #[arg(long)]
    listen: Option<IpAddr>,
    /// Data plane: auto, tcp or uring.
    #[arg(long, default_value = "auto", value_parser = ["auto", "tcp", "uring"])]
    transport: String,
    /// Chunks in flight.
    #[arg(long, default_value_t = 8)]
    window: usize,
    /// Give up a parent whose progress stalls this many seconds.
    #[arg(long, default_value_t = 3.0)]
    stall_after: f64,
    /// After finishing, keep serving while members that joined later are unfinished, at most
    /// this many seconds.
    #[arg(long, default_value_t = 60.0)]
    linger: f64,
    /// Fetch from the source only, never from other receivers (a point-to-point pull: the
    /// baseline the relayed pull is measured against).
    #[arg(long)]
    no_relay: bool,
    /// Print one JSON summary instead of the progress bar and human summary.
    #[arg(long)]
    json: bool,
    /// Pull this version [default: the newest the source publishes].
    #[arg(long, value_name = "N")]
    version: Option<u64>,
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

pub(crate) fn publish(args: PublishArgs) -> Result<()> {
    let manifest = Manifest::build(&args.name, args.version, &args.files, args.chunk_size)
        .context("building the manifest")?;
    runtime()?.block_on(async {
        let discovery = match &args.etcd {
            Some(url) => Some(etcd(url, &args.name).await?),
            None => None,
        };
        let src = Source::start(
            manifest,
            &args.files,
            SourceOptions {
                listen: args.listen,
                data_plane: plane(&args.transport),
                ..Default::default()
            },
            discovery,
        )
        .await?;
        let m = src.manifest();
        println!(
            "publishing {:?} version {} (epoch {}): {} files, {} bytes in {} chunks, {} entries",
            m.name,
            m.version,
            src.epoch(),
            m.segments.len(),
            m.total_bytes(),
            m.chunks.len(),
            m.entries.len()
        );
        println!(
            "control {} data {}; receivers: ferry pull {} --into DIR",
            src.ctl_addr(),
            src.data_addr().map(|a| a.to_string()).unwrap_or_default(),
            src.ctl_addr()
        );
        let stop = async {
            match args.serve_for {
                Some(s) => tokio::time::sleep(Duration::from_secs_f64(s.max(0.0))).await,
                None => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        };
        tokio::pin!(stop);
        let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .context("listening for SIGHUP")?;
        let mut version = args.version;
        loop {
            tokio::select! {
                () = &mut stop => break,
                Some(()) = hangup.recv() => {
                    version += 1;
                    // Reads every file once, to checksum it.
                    match tokio::task::block_in_place(|| src.publish_files(version, &args.files, Some(args.chunk_size))) {
                        Ok(m) => println!(
                            "publishing {:?} version {version}: {} files, {} bytes in {} chunks \
                             (versions served: {:?})",
                            m.name,
                            m.segments.len(),
                            m.total_bytes(),
                            m.chunks.len(),
                            src.versions()
                        ),
                        Err(e) => {
                            version -= 1;
                            eprintln!("ferry publish: version {} not published: {e}", version + 1);
                        }
                    }
                }
            }
        }
        src.stop().await;
        Ok(())
    })
}

pub(crate) fn pull(args: PullArgs) -> Result<()> {
    runtime()?.block_on(async {
        let (discovery, name): (Arc<dyn Discovery>, Option<String>) =
            match args.from.strip_prefix("etcd://") {
                Some(rest) => {
                    let Some((host, name)) = rest.split_once('/') else {
                        bail!("etcd://HOST:PORT/NAME, not {:?}", args.from);
                    };
                    (
                        etcd(&format!("http://{host}"), name).await?,
                        Some(name.to_owned()),
                    )
                }
                None => {
                    let addr: SocketAddr = tokio::net::lookup_host(&args.from)
                        .await
                        .with_context(|| format!("resolving {}", args.from))?
                        .next()
                        .with_context(|| format!("{} resolves to nothing", args.from))?;
                    (Arc::new(Embedded::new(addr)), None)
                }
            };
        // The embedded source names the broadcast in its manifest.
        let mut r = Receiver::join(
            discovery,
            name.as_deref(),
            ReceiverOptions {
                listen_ip: args.listen,
                data_plane: plane(&args.transport),
                window: args.window.max(1),
                stall_after: Duration::from_secs_f64(args.stall_after.max(0.1)),
                relay: !args.no_relay,
                version: args.version,
                ..Default::default()
            },
        )
        .await?;
        let bar = (!args.json && std::io::stderr().is_terminal()).then(|| {
            let bar = indicatif::ProgressBar::new(r.manifest().total_bytes());
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} \
                     {binary_bytes_per_sec} ETA {eta} {msg}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar
        });
        let ticker = bar.clone().map(|bar| {
            let mut rx = r.progress();
            tokio::spawn(async move {
                while rx.changed().await.is_ok() {
                    let s = rx.borrow_and_update().clone();
                    bar.set_position(s.bytes);
                    bar.set_message(format!(
                        "peers {} from {} re-fetched {}",
                        s.peers, s.parent, s.refetched
                    ));
                }
            })
        });
        let summary = r.run().await;
        if let Some(t) = ticker {
            t.abort();
        }
        if let Some(b) = &bar {
            b.finish_and_clear();
        }
        let summary = summary?;
        r.write_to(&args.into)?;
        if args.json {
            println!("{}", serde_json::to_string(&summary)?);
        } else {
            println!(
                "{:?} v{}: {} bytes in {:.3} s ({:.3} GB/s), verified; {} chunks re-fetched; \
                 {} bytes from the source, {} from relays; written to {}",
                summary.name,
                summary.version,
                summary.bytes,
                summary.seconds,
                summary.gb_per_s,
                summary.refetched_chunks,
                summary.bytes_from_source,
                summary.bytes_from_relays,
                args.into.display()
            );
        }
        r.linger(Duration::from_secs_f64(args.linger.max(0.0)))
            .await;
        r.leave().await;
        Ok(())
    })
}

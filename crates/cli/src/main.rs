//! The `ferry` command: `doctor` (what this machine can do), `topology` (which NIC serves which
//! GPU), `serve` (publish segments), `bench` (measure transfers), `publish` and `pull` (weight
//! broadcast), `metadata-server` (Mooncake's HTTP metadata server), `completions` (shell
//! completion scripts).
//!
//! Exit codes: 0 on success (`doctor` too, since it is a report, unless `--require` names what
//! is missing), 1 when a command fails, 2 for bad arguments, 130 when SIGINT (Ctrl-C) and 143
//! when SIGTERM stopped `bench`, `pull`, `publish` or `serve` (each prints what it did first).

mod cmd_bench;
mod cmd_broadcast;
mod cmd_doctor;
mod cmd_metadata;
mod cmd_serve;
mod cmd_topology;
mod failure;
mod histogram;
mod metadata;
mod out;
mod parse;
mod probe;
mod stop;
mod version;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "ferry",
    version,
    about = "Ferry: move bytes between registered memory over RDMA, io_uring or TCP"
)]
struct Cli {
    /// More log output (-v info, -vv debug, -vvv trace); RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the capability matrix: build features, libibverbs, RDMA devices, topology, io_uring,
    /// CUDA, cuFile, peermem, dma-buf.
    Doctor(cmd_doctor::DoctorArgs),
    /// Show which NIC serves which GPU: NICs with their ports and GIDs, the GPU x NIC distance
    /// classes (PIX, PXB, PHB, NODE, SYS) and the assignment.
    Topology(cmd_topology::TopologyArgs),
    /// Publish named segments (generated data or a file's bytes) and serve them until stopped.
    Serve(cmd_serve::ServeArgs),
    /// Measure READ/WRITE throughput and latency against a `ferry serve` peer, or on loopback
    /// against a server started in this process when no peer is given.
    Bench(cmd_bench::BenchArgs),
    /// Publish files for a weight broadcast: receivers pull them chunk by chunk, relaying
    /// verified chunks to each other, so that the source sends each byte about once.
    Publish(cmd_broadcast::PublishArgs),
    /// Pull a broadcast (from the source's address, or etcd://HOST:PORT/NAME) into a directory
    /// (or memory only), verifying every chunk and relaying it to the members after this one.
    Pull(cmd_broadcast::PullArgs),
    /// Serve Mooncake's HTTP metadata protocol (`GET`/`PUT`/`DELETE /metadata?key=K`, `GET
    /// /health`): a drop-in for `mooncake_http_metadata_server`, for Mooncake transfer engines
    /// given `http://HOST:PORT/metadata`. Keys live in memory until stopped (SIGINT, SIGTERM).
    MetadataServer(cmd_metadata::MetadataServerArgs),
    /// Print a shell completion script: `ferry completions bash > /etc/bash_completion.d/ferry`,
    /// `ferry completions zsh > ~/.zfunc/_ferry`, `ferry completions fish >
    /// ~/.config/fish/completions/ferry.fish`.
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// Colour only on a terminal, and never with NO_COLOR set (to anything but empty).
fn colour() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

fn init_tracing(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour())
        .init();
}

fn main() -> std::process::ExitCode {
    let version: &'static str = version::LONG.as_str();
    let matches = Cli::command().version(version).get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    init_tracing(cli.verbose);
    let result = match cli.command {
        Command::Doctor(args) => cmd_doctor::run(&args),
        Command::Topology(args) => cmd_topology::run(args),
        Command::Serve(args) => cmd_serve::run(args),
        Command::Bench(args) => cmd_bench::run(args),
        Command::Publish(args) => cmd_broadcast::publish(args),
        Command::Pull(args) => cmd_broadcast::pull(args),
        Command::MetadataServer(args) => cmd_metadata::run(args),
        Command::Completions { shell } => {
            // Into a buffer first: clap_complete panics on a write error (`| head`).
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "ferry", &mut script);
            std::io::Write::write_all(&mut std::io::stdout().lock(), &script).map_err(Into::into)
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            // The reader went away (`ferry doctor | head`): not an error of ours.
            std::process::ExitCode::SUCCESS
        }
        Err(e) if e.downcast_ref::<stop::Stopped>().is_some() => {
            // The command printed what it did; the status says which signal stopped it.
            let code = e
                .downcast_ref::<stop::Stopped>()
                .map_or(1, |s| s.0.exit_code());
            std::process::ExitCode::from(code)
        }
        Err(e) if e.downcast_ref::<failure::Reported>().is_some() => {
            std::process::ExitCode::FAILURE
        }
        Err(e) => {
            failure::Failure::of(&e, failure::Server::Serve).print();
            std::process::ExitCode::FAILURE
        }
    }
}

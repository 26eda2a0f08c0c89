//! `ferry doctor`: a verdict (what works here, and the command to try next), this build's
//! version, then the capability matrix as a table; or all of it as `--json`. `--require` turns
//! the report into a check a script can branch on.

use std::io::Write;
use std::path::PathBuf;

use anyhow::bail;
use ferry::capabilities::{Capabilities, ProbeOptions, probe};

use crate::version;

/// A capability `--require` can ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Need {
    /// The TCP data plane (always there).
    Tcp,
    /// The io_uring data plane (also `io_uring`, `io-uring`).
    #[value(alias = "io_uring", alias = "io-uring")]
    Uring,
    /// RDMA: built in, libibverbs loads and lists a device.
    Rdma,
    /// A GPU the CUDA driver lists.
    Gpu,
}

impl Need {
    fn name(self) -> &'static str {
        match self {
            Need::Tcp => "tcp",
            Need::Uring => "uring",
            Need::Rdma => "rdma",
            Need::Gpu => "gpu",
        }
    }

    fn met(self, caps: &Capabilities) -> bool {
        match self {
            Need::Gpu => !caps.summary.gpus.is_empty(),
            other => caps.summary.transports.contains(&other.name()),
        }
    }
}

/// Arguments of `ferry doctor`.
#[derive(clap::Args, Debug)]
pub(crate) struct DoctorArgs {
    /// Print one JSON object: `verdict`, `version`, `commit`, `features`, `protocol_versions`
    /// (`min`, `max`), `summary` (`transports`, `rdma_devices`, `gpus`, `uring_opcodes`) and
    /// `checks` (`[{"name", "status", "detail", "hint"}]`).
    #[arg(long)]
    json: bool,
    /// Root of the sysfs tree to inspect.
    #[arg(long, value_name = "DIR", default_value = "/sys")]
    sysfs_root: PathBuf,
    /// Exit 1 unless each of these works here (comma-separated: tcp, uring or io_uring, rdma,
    /// gpu); the report is printed either way.
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = need)]
    require: Vec<Need>,
}

/// One `--require` entry: a name of [`Need`] (or an alias), spaces around it allowed
/// (`--require "tcp, uring"`).
fn need(s: &str) -> anyhow::Result<Need> {
    <Need as clap::ValueEnum>::from_str(s.trim(), true)
        .map_err(|_| anyhow::anyhow!("{:?} is none of tcp, uring (io_uring), rdma, gpu", s.trim()))
}

/// The first line: what is usable here, what is not, and the command to try next.
fn verdict(caps: &Capabilities) -> String {
    let s = &caps.summary;
    let mut usable: Vec<String> = s
        .transports
        .iter()
        .map(|t| match *t {
            "uring" => "io_uring".to_owned(),
            other => other.to_owned(),
        })
        .collect();
    let mut missing = Vec::new();
    if !s.transports.contains(&"uring") {
        missing.push("no io_uring");
    }
    if !s.transports.contains(&"rdma") {
        missing.push("no RDMA");
    }
    let next = if s.gpus.is_empty() {
        missing.push("no GPU");
        "ferry bench".to_owned()
    } else {
        usable.push(format!(
            "{} GPU{}",
            s.gpus.len(),
            if s.gpus.len() == 1 { "" } else { "s" }
        ));
        "ferry bench --gpu 0".to_owned()
    };
    let mut line = format!("usable here: {}", usable.join(", "));
    if !missing.is_empty() {
        line.push_str("; ");
        line.push_str(&missing.join("; "));
    }
    line.push_str(&format!(
        "; try `{next}` (a loopback transfer), then `ferry serve` on one host and `ferry bench HOST:7400` on another"
    ));
    line
}

pub(crate) fn run(args: &DoctorArgs) -> anyhow::Result<()> {
    let caps = probe(&ProbeOptions {
        sysfs_root: args.sysfs_root.clone(),
    });
    let verdict = verdict(&caps);
    let mut out = std::io::stdout().lock();
    if args.json {
        let v = ferry::SUPPORTED_VERSIONS;
        let obj = serde_json::json!({
            "verdict": verdict,
            "version": version::VERSION,
            "commit": version::COMMIT,
            "features": version::features(),
            "protocol_versions": { "min": v.min, "max": v.max },
            "summary": caps.summary,
            "checks": caps.checks,
        });
        serde_json::to_writer_pretty(&mut out, &obj)?;
        writeln!(out)?;
    } else {
        writeln!(out, "{verdict}")?;
        writeln!(out, "ferry {}", version::LONG.as_str())?;
        writeln!(out)?;
        write_table(&mut out, &caps)?;
    }
    out.flush()?;
    let missing: Vec<&str> = args
        .require
        .iter()
        .filter(|n| !n.met(&caps))
        .map(|n| n.name())
        .collect();
    if !missing.is_empty() {
        bail!(
            "--require: not usable here: {} (the rows above say why)",
            missing.join(", ")
        );
    }
    Ok(())
}

fn write_table(out: &mut impl Write, caps: &Capabilities) -> std::io::Result<()> {
    let name_w = caps
        .checks
        .iter()
        .map(|c| c.name.len())
        .max()
        .unwrap_or(5)
        .max(5);
    writeln!(out, "{:<name_w$}  {:<11}  detail", "check", "status")?;
    for c in &caps.checks {
        writeln!(
            out,
            "{:<name_w$}  {:<11}  {}",
            c.name,
            c.status.as_str(),
            c.detail
        )?;
        if !c.hint.is_empty() {
            writeln!(out, "{:<name_w$}  {:<11}  hint: {}", "", "", c.hint)?;
        }
    }
    Ok(())
}

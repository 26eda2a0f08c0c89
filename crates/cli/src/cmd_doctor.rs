//! `ferry doctor`: the capability matrix as a table, or `--json`.

use ferry::capabilities::{Capabilities, ProbeOptions, probe};
use std::io::Write;
use std::path::PathBuf;

/// Arguments of `ferry doctor`.
#[derive(clap::Args, Debug)]
pub(crate) struct DoctorArgs {
    /// Print one JSON object `{"checks": [{"name", "status", "detail", "hint"}]}`.
    #[arg(long)]
    json: bool,
    /// Root of the sysfs tree to inspect.
    #[arg(long, value_name = "DIR", default_value = "/sys")]
    sysfs_root: PathBuf,
}

pub(crate) fn run(args: &DoctorArgs) -> anyhow::Result<()> {
    let caps = probe(&ProbeOptions {
        sysfs_root: args.sysfs_root.clone(),
    });
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &caps)?;
        writeln!(out)?;
    } else {
        write_table(&mut out, &caps)?;
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

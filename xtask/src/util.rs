//! Small helpers shared by the tasks: the project root, running commands loudly, installing a
//! missing tool, running `ferry bench`, and the number and JSON parsing the tasks share.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root (the parent of `xtask/`).
pub(crate) fn project_root() -> PathBuf {
    let dir = env!("CARGO_MANIFEST_DIR");
    Path::new(dir)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Cargo's target directory for this workspace, as cargo itself reports it (`cargo metadata`),
/// so `CARGO_TARGET_DIR`, `build.target-dir` and the default `./target` all work. Asked once.
pub(crate) fn target_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        target_dir_of(&mut cargo()).unwrap_or_else(|e| {
            eprintln!("xtask: cargo metadata failed ({e:#}); assuming ./target");
            project_root().join("target")
        })
    })
    .clone()
}

/// What `cargo metadata` run as `cmd` (a `cargo()` with its environment) says the target
/// directory is.
fn target_dir_of(cmd: &mut Command) -> Result<PathBuf> {
    let out = cmd
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .output()
        .context("running cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    json_str(&text, "target_directory", 0)
        .map(PathBuf::from)
        .context("no target_directory in cargo metadata's output")
}

/// A binary of the release profile in [`target_dir`].
pub(crate) fn release_bin(name: &str) -> PathBuf {
    target_dir().join("release").join(name)
}

/// The cargo that runs us (so the pinned toolchain is used throughout).
pub(crate) fn cargo() -> Command {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(project_root());
    cmd
}

/// Runs `cmd`, echoing it first; fails with the command line if it exits non-zero.
pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    let line = format!("{cmd:?}");
    eprintln!("$ {line}");
    let status = cmd.status().with_context(|| format!("spawning {line}"))?;
    if !status.success() {
        bail!("command failed ({status}): {line}");
    }
    Ok(())
}

/// Whether `prog` is on PATH.
pub(crate) fn have(prog: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(prog).is_file()))
}

/// Whether this process runs as root (effective uid 0).
pub(crate) fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(2))
            .is_some_and(|euid| euid == "0")
    })
}

/// Installs `package` with apt-get (through sudo where present) unless `tool` is on PATH already.
pub(crate) fn ensure_tool(tool: &str, package: &str) -> Result<()> {
    if have(tool) {
        return Ok(());
    }
    eprintln!("{tool} missing: installing {package} with apt-get");
    let sudo = have("sudo");
    let apt = |args: &[&str]| {
        let mut c = if sudo {
            let mut c = Command::new("sudo");
            c.arg("apt-get");
            c
        } else {
            Command::new("apt-get")
        };
        c.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        c
    };
    run(&mut apt(&["update", "-q"]))?;
    run(&mut apt(&["install", "-y", "-q", package]))?;
    if !have(tool) {
        bail!("{tool} still missing after apt-get install {package}");
    }
    Ok(())
}

/// Runs the release binary `target/release/ferry` (built beforehand) as `ferry bench --json ARGS`
/// and returns the number `key` of the JSON object it prints. Fails with its stdout and stderr
/// when it exits non-zero, and with its stdout when `key` is not there.
pub(crate) fn ferry_bench_json(args: &[&str], key: &str) -> Result<f64> {
    ferry_bench_json_of(&release_bin("ferry"), args, key)
}

/// [`ferry_bench_json`] with the `ferry` binary at `bin` (another build, for A/B runs).
pub(crate) fn ferry_bench_json_of(bin: &std::path::Path, args: &[&str], key: &str) -> Result<f64> {
    let out = Command::new(bin)
        .args(["bench", "--json"])
        .args(args)
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "ferry bench failed: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    json_num(&text, key, 0).with_context(|| format!("no {key} in {text:?}"))
}

/// Parses `--total BYTES` and `--repeat N` (at least 1), the options of the side-by-side benches,
/// with their defaults; any other option is an error that prints `usage`.
pub(crate) fn total_and_repeat(
    args: &[String],
    mut total: u64,
    mut repeat: usize,
    usage: &str,
) -> Result<(u64, usize)> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--total" => total = size(it.next().context("--total needs a value")?)?,
            "--repeat" => {
                repeat = it
                    .next()
                    .context("--repeat needs a value")?
                    .parse()
                    .context("--repeat")?
            }
            other => {
                eprintln!("{usage}");
                bail!("unknown option {other}")
            }
        }
    }
    Ok((total, repeat.max(1)))
}

/// A byte size with an optional binary suffix: `4096`, `64KiB`, `1MiB`, `4GiB`.
pub(crate) fn size(s: &str) -> Result<u64> {
    let units = [
        ("GiB", 1u64 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("", 1),
    ];
    for (suffix, mul) in units {
        if let Some(n) = s.strip_suffix(suffix) {
            return n
                .trim()
                .parse::<u64>()
                .with_context(|| format!("size {s:?}"))?
                .checked_mul(mul)
                .with_context(|| format!("size {s:?} overflows"));
        }
    }
    bail!("size {s:?}")
}

/// The text just after the colon of the first `"key"` at or after `from` in a JSON text, with
/// leading whitespace skipped; `None` when there is no such key or no colon after it. xtask has
/// no JSON parser: this reads the flat, trusted output of cargo, iperf3, fio and ferry, where the
/// first `"key"` at or after `from` is the member wanted.
fn json_value<'a>(text: &'a str, key: &str, from: usize) -> Option<&'a str> {
    let pat = format!("\"{key}\"");
    let at = text.get(from..)?.find(&pat)? + from + pat.len();
    Some(text.get(at..)?.trim_start().strip_prefix(':')?.trim_start())
}

/// The number after `"key":` at or after `from` in a JSON text (see [`json_value`]).
pub(crate) fn json_num(text: &str, key: &str, from: usize) -> Option<f64> {
    let rest = json_value(text, key, from)?;
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E')))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// The string after `"key":` at or after `from` in a JSON text (see [`json_value`]), with the
/// escapes `\n` and `\t` undone and any other escaped character taken as itself (`\"`, `\\`,
/// `\/`); `None` when the value is not a string (`null`, say) or is not terminated.
pub(crate) fn json_str(text: &str, key: &str, from: usize) -> Option<String> {
    let mut chars = json_value(text, key, from)?.strip_prefix('"')?.chars();
    let mut out = String::new();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(out),
            '\\' => match chars.next()? {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                other => out.push(other),
            },
            c => out.push(c),
        }
    }
    None
}

/// The boolean after `"key":` at or after `from` in a JSON text (see [`json_value`]).
pub(crate) fn json_bool(text: &str, key: &str, from: usize) -> Option<bool> {
    let rest = json_value(text, key, from)?;
    if rest.starts_with("true") {
        Some(true)
    } else if rest.starts_with("false") {
        Some(false)
    } else {
        None
    }
}

/// A table cell of per-round ratios: `median [lowest-highest]`, e.g. `1.013 [0.92-1.10]`.
pub(crate) fn median_and_range(v: &[f64]) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(0.0, f64::max);
    format!("{:.3} [{lo:.2}-{hi:.2}]", median(v))
}

/// The median of `v` (the mean of the middle two for an even count; NaN when empty).
pub(crate) fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ratio_cell_is_the_median_and_the_range() {
        assert_eq!(median_and_range(&[1.1, 0.9, 1.0]), "1.000 [0.90-1.10]");
    }

    #[test]
    fn the_target_directory_is_cargos_with_or_without_cargo_target_dir() {
        let mut plain = cargo();
        plain.env_remove("CARGO_TARGET_DIR");
        let default = target_dir_of(&mut plain).unwrap();
        // `.cargo/config.toml` sets no target-dir, so the default is ./target.
        assert_eq!(default, project_root().join("target"));
        let elsewhere = std::env::temp_dir().join("ferry-xtask-target-dir-test");
        let mut set = cargo();
        set.env("CARGO_TARGET_DIR", &elsewhere);
        assert_eq!(target_dir_of(&mut set).unwrap(), elsewhere);
    }

    #[test]
    fn no_task_builds_a_path_into_target_by_hand() {
        // Every output path comes from `target_dir()`; a path joined by hand under `target` would
        // ignore CARGO_TARGET_DIR again (how `cargo xtask soak` lost its binary).
        let needle = ["join(\"target", "/"].concat();
        let mut stack = vec![project_root().join("xtask/src")];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    let text = std::fs::read_to_string(&p).unwrap();
                    assert!(
                        !text.contains(&needle),
                        "{} builds a target path by hand",
                        p.display()
                    );
                }
            }
        }
    }

    #[test]
    fn sizes_json_and_medians() {
        assert_eq!(size("4GiB").unwrap(), 4 << 30);
        assert_eq!(size("64KiB").unwrap(), 64 << 10);
        assert_eq!(size("12").unwrap(), 12);
        assert!(size("x").is_err());
        assert!(size("99999999999GiB").is_err());
        let t = r#"{"end":{"sum_sent":{"bytes":5},"sum_received":{"seconds": 2.5,"bytes":10}}}"#;
        let at = t.find("\"sum_received\"").unwrap();
        assert_eq!(json_num(t, "bytes", at), Some(10.0));
        assert_eq!(json_num(t, "seconds", at), Some(2.5));
        assert_eq!(json_num(t, "nope", 0), None);
        assert_eq!(
            json_num(r#"{"gb_per_s": 1.5e-2,"x":1}"#, "gb_per_s", 0),
            Some(0.015)
        );
        assert_eq!(json_num(r#"{"gb_per_s":null}"#, "gb_per_s", 0), None);
        assert_eq!(
            json_str(r#"{"a":"x\"y\\z"}"#, "a", 0).as_deref(),
            Some("x\"y\\z")
        );
        assert_eq!(
            json_str(r#"{"a" : "l1\nl2"}"#, "a", 0).as_deref(),
            Some("l1\nl2")
        );
        assert_eq!(json_str(r#"{"a":null}"#, "a", 0), None);
        assert_eq!(json_str(r#"{"a":"open"#, "a", 0), None);
        let p = r#"{"target":{"name":"t","test":true},"profile":{"test":false}}"#;
        assert_eq!(
            json_str(p, "name", p.find("\"target\"").unwrap()).as_deref(),
            Some("t")
        );
        assert_eq!(json_bool(p, "test", 0), Some(true));
        assert_eq!(
            json_bool(p, "test", p.find("\"profile\"").unwrap()),
            Some(false)
        );
        assert_eq!(json_bool(p, "name", 0), None);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}

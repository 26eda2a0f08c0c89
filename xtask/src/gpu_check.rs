//! `cargo xtask gpu-check --out DIR`: everything about GPU memory that needs a real GPU, in one
//! command that fits in 10 minutes on one H200 with 16 cores: a release build, `ferry doctor`,
//! the `#[ignore]`d real-driver tests (raw cuMemcpy rates and a staging lane's, a checksummed GPU
//! round trip over TCP and io_uring, a file loaded into GPU memory saying GDS or compat),
//! loopback `ferry bench --gpu 0` over TCP and io_uring beside host-to-host runs, GPU memory
//! registered with the RDMA NICs (GPUDirect, route `auto`) and moved over loopback RDMA when a
//! verbs device is present (one `rdma: none: ...` line saying why when there is none), GPU memory
//! to GPU memory between two processes on the same-host plane by CUDA IPC (a `same-host cuda
//! ipc: unavailable: ...` line saying why where the plane does not take it), one table
//! of GB/s, and that table as JSON in DIR/gpu-check.json. Without a GPU it fails at once, saying
//! what is missing. A data plane the machine cannot run (io_uring under gVisor) is a row that says
//! why, not a failure.
//!
//! The GPU machine this project is lent has no Rust toolchain and reaches nothing, so the check
//! travels prebuilt:
//! - `gpu-check --bundle DIR` (here): release builds of `ferry`, the real-driver test binary and
//!   this xtask, stripped, into DIR with a `run.sh`;
//! - `DIR/run.sh OUT` (there; `$OUT` when no argument): `xtask gpu-check --prebuilt DIR --out OUT`,
//!   the same steps with the bundle's binaries instead of cargo.
//!
//! `--allow-fake` runs the whole check against the driver `FERRY_LIBCUDA` names (Ferry's fake):
//! a dry run of the steps, whose table says FAKE and whose figures are no GPU's.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util::{cargo, ferry_bench_json_of};

fn has_gpu() -> Result<(), String> {
    if let Some(p) = std::env::var_os("FERRY_LIBCUDA") {
        return Err(format!(
            "FERRY_LIBCUDA={} is set: gpu-check measures the real driver; unset it (or \
             --allow-fake for a dry run)",
            p.to_string_lossy()
        ));
    }
    let smi = Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .is_ok_and(|o| o.status.success() && !o.stdout.is_empty());
    if smi {
        return Ok(());
    }
    let ldconfig = Command::new("ldconfig").arg("-p").output();
    let has_lib = ldconfig
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("libcuda.so.1"))
        .unwrap_or(false)
        || [
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            "/usr/lib64/libcuda.so.1",
            "/usr/local/nvidia/lib64/libcuda.so.1",
        ]
        .iter()
        .any(|p| std::path::Path::new(p).exists());
    if !has_lib {
        return Err("libcuda.so.1 not found and nvidia-smi lists no GPU (no NVIDIA driver)".into());
    }
    if !std::path::Path::new("/dev/nvidiactl").exists() {
        return Err("/dev/nvidiactl missing and nvidia-smi lists no GPU".into());
    }
    Ok(())
}

/// The `GPUCHECK key=value` facts the real-driver tests print, wherever on a line they start:
/// `--nocapture` prints a test's first line after its `test name ... ` header.
fn facts_of(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| l.find("GPUCHECK ").map(|at| &l[at + "GPUCHECK ".len()..]))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// The cargo command (after `cargo`) that builds and runs the real-driver GPU tests.
const GPU_TESTS: [&str; 6] = [
    "test",
    "--release",
    "-p",
    "ferry-engine",
    "--test",
    "gpu_real",
];

const USAGE: &str = "usage: gpu-check --out DIR [--allow-fake] | gpu-check --bundle DIR | \
                     gpu-check --prebuilt BUNDLE --out DIR [--allow-fake]";

/// Release builds of `ferry`, the real-driver GPU tests and this xtask, stripped, into `dir`
/// with a `run.sh` that runs the check from them (for a machine without cargo).
fn bundle(dir: &std::path::Path) -> Result<()> {
    crate::util::run(cargo().args([
        "build",
        "--release",
        "-p",
        "ferry-engine-cli",
        "-p",
        "xtask",
    ]))?;
    let built = crate::soft_roce::artifacts::cargo_json(&[&GPU_TESTS[..], &["--no-run"]].concat())?
        .map_err(|e| anyhow::anyhow!("building the GPU tests failed: {e}"))?;
    let tests = crate::soft_roce::artifacts::parse_artifacts(&built, true)
        .into_iter()
        .find(|a| a.label.ends_with(":gpu_real"))
        .map(|a| a.executable)
        .context("cargo named no executable for the gpu_real tests")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let release = crate::util::target_dir().join("release");
    for (from, name) in [
        (release.join("ferry"), "ferry"),
        (release.join("xtask"), "xtask"),
        (tests, "gpu_real"),
    ] {
        let to = dir.join(name);
        std::fs::copy(&from, &to)
            .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        if crate::util::have("strip") {
            crate::util::run(Command::new("strip").arg("--strip-debug").arg(&to))?;
        }
    }
    let script = dir.join("run.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\n\
         # Ferry's GPU check from prebuilt binaries (made by `cargo xtask gpu-check --bundle`).\n\
         # Usage: run.sh [OUT] (default $OUT): writes OUT/gpu-check.json and prints the table.\n\
         set -e\n\
         here=$(cd \"$(dirname \"$0\")\" && pwd)\n\
         out=${1:-${OUT:?name a directory for the JSON}}\n\
         # Where driver images put libcuda.so.1 when ld.so.conf does not name it.\n\
         export LD_LIBRARY_PATH=\"${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/nvidia/lib64\"\n\
         exec \"$here/xtask\" gpu-check --prebuilt \"$here\" --out \"$out\" $FERRY_GPU_CHECK_ARGS\n",
    )
    .with_context(|| format!("writing {}", script.display()))?;
    let mut perms = std::fs::metadata(&script)?.permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&script, perms)?;
    let mut total = 0u64;
    for e in std::fs::read_dir(dir)? {
        total += e?.metadata()?.len();
    }
    println!(
        "bundle in {} ({:.1} MiB): run it on the GPU machine as `{}/run.sh` (it writes \
         $OUT/gpu-check.json), carrying that folder",
        dir.display(),
        total as f64 / (1 << 20) as f64,
        dir.display()
    );
    Ok(())
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut out: Option<PathBuf> = None;
    let mut prebuilt: Option<PathBuf> = None;
    let mut allow_fake = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => out = it.next().map(PathBuf::from),
            "--prebuilt" => prebuilt = it.next().map(PathBuf::from),
            "--bundle" => {
                let dir = it.next().context(USAGE)?;
                return bundle(std::path::Path::new(dir));
            }
            "--allow-fake" => allow_fake = true,
            other => bail!("gpu-check: unknown argument {other:?} ({USAGE})"),
        }
    }
    let out = out.context("gpu-check: name a directory for the JSON with --out DIR")?;
    if allow_fake {
        let fake = std::env::var_os("FERRY_LIBCUDA")
            .context("--allow-fake: set FERRY_LIBCUDA to Ferry's fake driver")?;
        println!(
            "gpu-check DRY RUN against {} (FAKE driver): the steps run, the figures are no GPU's",
            fake.to_string_lossy()
        );
    } else if let Err(why) = has_gpu() {
        bail!("gpu-check needs an NVIDIA GPU and its driver: {why}");
    }
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let (ferry, facts) = doctor_and_driver_tests(prebuilt.as_deref(), allow_fake)?;
    let (rows, failed) = bench_rows(&ferry)?;
    let table = table_of(allow_fake, &facts, &rows, &failed)?;
    print!("{table}");
    let json = json_of(allow_fake, &facts, &rows, &failed);
    let path = out.join("gpu-check.json");
    std::fs::write(&path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

/// Builds `ferry` and the real-driver tests (or takes them from the `prebuilt` bundle), prints
/// `ferry doctor`'s report and runs the tests: the `ferry` binary, and the facts they printed.
fn doctor_and_driver_tests(
    prebuilt: Option<&std::path::Path>,
    allow_fake: bool,
) -> Result<(PathBuf, Vec<(String, String)>)> {
    let (ferry, mut tests) = match prebuilt {
        Some(dir) => (dir.join("ferry"), Command::new(dir.join("gpu_real"))),
        None => {
            crate::util::run(cargo().args(["build", "--release", "-p", "ferry-engine-cli"]))?;
            let mut t = cargo();
            t.args(GPU_TESTS).arg("--");
            (crate::util::release_bin("ferry"), t)
        }
    };
    // The doctor's report is for the log; a row it marks missing (no RDMA here) is no failure.
    match Command::new(&ferry).arg("doctor").status() {
        Ok(s) if s.success() => {}
        Ok(s) => println!("ferry doctor exited with {s} (continuing)"),
        Err(e) => bail!("running {}: {e}", ferry.display()),
    }
    // The file test writes 512 MiB: into scratch space, never into the folder that comes back.
    let scratch = std::env::temp_dir().join("ferry-gpu-check");
    std::fs::create_dir_all(&scratch)?;
    if allow_fake {
        // The fake's device memory is host memory: the CUDA IPC check moves less of it.
        tests.env("FERRY_GPU_CHECK_IPC_MIB", "64");
    }
    let tests = tests
        .args(["--ignored", "--nocapture", "--test-threads", "1"])
        .env("FERRY_REQUIRE_GPU", "1")
        .env("FERRY_GPU_CHECK_DIR", &scratch)
        .output()
        .context("running the GPU tests")?;
    let text = String::from_utf8_lossy(&tests.stdout).into_owned();
    print!("{text}");
    eprint!("{}", String::from_utf8_lossy(&tests.stderr));
    if !tests.status.success() {
        bail!("the real-driver GPU tests failed");
    }
    Ok((ferry, facts_of(&text)))
}

/// A fact the real-driver tests printed, or `n/a`.
fn fact(facts: &[(String, String)], k: &str) -> String {
    facts
        .iter()
        .find(|(key, _)| key == k)
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| "n/a".into())
}

/// `(row, GB/s)`: the `ferry bench` rows measured.
type Rows = Vec<(String, f64)>;

/// `(row, why)`: the `ferry bench` rows the kernel refused.
type NotRun = Vec<(String, String)>;

/// Loopback `ferry bench` host-to-host and staged gpu-to-gpu over TCP and io_uring: the GB/s
/// rows, and the io_uring rows the kernel refused with the reason.
fn bench_rows(ferry: &std::path::Path) -> Result<(Rows, NotRun)> {
    let total = "8GiB";
    let mut rows = Rows::new();
    let mut failed = NotRun::new();
    for transport in ["tcp", "uring"] {
        for (label, gpu) in [("host-to-host", false), ("gpu-to-gpu (staged)", true)] {
            let mut a = vec![
                "--transport",
                transport,
                "--total",
                total,
                "--op-size",
                "4MiB",
            ];
            a.extend(["--streams", "2", "--op", "write"]);
            if gpu {
                a.extend(["--gpu", "0"]);
            }
            match ferry_bench_json_of(ferry, &a, "gb_per_s") {
                Ok(gbps) => rows.push((format!("{transport} {label}"), gbps)),
                // io_uring where the kernel refuses it (gVisor): a row saying why.
                Err(e) if transport == "uring" => {
                    let why = format!("{e:#}");
                    let why = why.lines().last().unwrap_or_default().to_owned();
                    println!("uring {label}: not run: {why}");
                    failed.push((format!("{transport} {label}"), why));
                }
                Err(e) => return Err(e.context(format!("ferry bench {a:?}"))),
            }
        }
    }
    Ok((rows, failed))
}

/// The staged gpu-to-gpu rate over the host-to-host rate on transport `t` (0 without both).
fn ratio(rows: &[(String, f64)], t: &str) -> f64 {
    let h = rows.iter().find(|(k, _)| k == &format!("{t} host-to-host"));
    let g = rows
        .iter()
        .find(|(k, _)| k == &format!("{t} gpu-to-gpu (staged)"));
    match (h, g) {
        (Some((_, h)), Some((_, g))) if *h > 0.0 => g / h,
        _ => 0.0,
    }
}

/// The table of GB/s and facts, as printed.
fn table_of(
    allow_fake: bool,
    facts: &[(String, String)],
    rows: &[(String, f64)],
    failed: &[(String, String)],
) -> Result<String> {
    let fact = |k: &str| fact(facts, k);
    let ratio = |t: &str| ratio(rows, t);
    let mut table = String::new();
    if allow_fake {
        writeln!(table, "FAKE DRIVER (dry run): no figure below is a GPU's")?;
    }
    writeln!(table, "{:<34} {:>10}", "what", "GB/s")?;
    for (k, v) in rows {
        writeln!(table, "{k:<34} {v:>10.3}")?;
    }
    for (k, why) in failed {
        writeln!(table, "{k:<34} {:>10}  ({why})", "not run")?;
    }
    writeln!(
        table,
        "{:<34} {:>10}",
        "raw cuMemcpy host-to-device",
        fact("raw_h2d_gbps")
    )?;
    writeln!(
        table,
        "{:<34} {:>10}",
        "raw cuMemcpy device-to-host",
        fact("raw_d2h_gbps")
    )?;
    writeln!(
        table,
        "{:<34} {:>10}",
        "staging lane h2d (4 MiB, stream)",
        fact("lane_h2d_gbps")
    )?;
    writeln!(
        table,
        "{:<34} {:>10}",
        "staging lane d2h (4 MiB, stream)",
        fact("lane_d2h_gbps")
    )?;
    writeln!(
        table,
        "{:<34} {:>10}",
        "read_file_into GPU",
        fact("file_gbps")
    )?;
    writeln!(table, "file path: {}", fact("file_path"))?;
    writeln!(
        table,
        "{:<34} {:>10}",
        "gpu-to-gpu RDMA WRITE (GPUDirect)",
        fact("rdma_write_gbps")
    )?;
    writeln!(table, "rdma: {}", fact("rdma"))?;
    writeln!(
        table,
        "{:<34} {:>10}",
        "same-host gpu-to-gpu WRITE (CUDA IPC)",
        fact("same_host_ipc_write_gbps")
    )?;
    writeln!(
        table,
        "{:<34} {:>10}",
        "same-host gpu-to-gpu READ (CUDA IPC)",
        fact("same_host_ipc_read_gbps")
    )?;
    writeln!(table, "same-host cuda ipc: {}", fact("same_host_ipc"))?;
    writeln!(
        table,
        "rdma route: {}; NICs: {}",
        fact("rdma_route"),
        fact("rdma_nics")
    )?;
    writeln!(
        table,
        "gpu/host ratio: tcp {:.2}, uring {:.2} (target: tcp at least 0.80)",
        ratio("tcp"),
        ratio("uring")
    )?;
    Ok(table)
}

/// The same as JSON, for DIR/gpu-check.json.
fn json_of(
    allow_fake: bool,
    facts: &[(String, String)],
    rows: &[(String, f64)],
    failed: &[(String, String)],
) -> String {
    let fact = |k: &str| fact(facts, k);
    let ratio = |t: &str| ratio(rows, t);
    let mut json = format!("{{\"fake\":{allow_fake},\"not_run\":{{");
    for (i, (k, why)) in failed.iter().enumerate() {
        let _ = write!(json, "{}\"{k}\":{why:?}", if i > 0 { "," } else { "" });
    }
    json.push_str("},\"rows\":{");
    for (i, (k, v)) in rows.iter().enumerate() {
        let _ = write!(json, "{}\"{k}\":{v}", if i > 0 { "," } else { "" });
    }
    let _ = write!(
        json,
        "}},\"raw_h2d_gbps\":\"{}\",\"raw_d2h_gbps\":\"{}\",\"lane_h2d_gbps\":\"{}\",\"lane_d2h_gbps\":\"{}\",\"file_gbps\":\"{}\",\"file_path\":{:?},\"rdma\":{:?},\"rdma_route\":{:?},\"rdma_write_gbps\":\"{}\",\"same_host_ipc\":{:?},\"same_host_ipc_write_gbps\":\"{}\",\"same_host_ipc_read_gbps\":\"{}\",\"ratio_tcp\":{},\"ratio_uring\":{}}}",
        fact("raw_h2d_gbps"),
        fact("raw_d2h_gbps"),
        fact("lane_h2d_gbps"),
        fact("lane_d2h_gbps"),
        fact("file_gbps"),
        fact("file_path"),
        fact("rdma"),
        fact("rdma_route"),
        fact("rdma_write_gbps"),
        fact("same_host_ipc"),
        fact("same_host_ipc_write_gbps"),
        fact("same_host_ipc_read_gbps"),
        ratio("tcp"),
        ratio("uring")
    );
    json
}

#[cfg(test)]
mod tests {
    use super::facts_of;

    #[test]
    fn facts_are_read_wherever_a_line_has_them() {
        let text = "running 2 tests\n\
                    test raw_copy_rates ... GPUCHECK raw_h2d_gbps=5.195\n\
                    GPUCHECK raw_d2h_gbps=6.303\n\
                    ok\n\
                    test real_file_load ... GPUCHECK file_path=compat (no libcufile: x=y)\n\
                    not a fact = 3\n";
        let f = facts_of(text);
        assert_eq!(
            f,
            [
                ("raw_h2d_gbps".to_owned(), "5.195".to_owned()),
                ("raw_d2h_gbps".to_owned(), "6.303".to_owned()),
                (
                    "file_path".to_owned(),
                    "compat (no libcufile: x=y)".to_owned()
                ),
            ]
        );
    }
}

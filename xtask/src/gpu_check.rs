//! `cargo xtask gpu-check --out DIR`: everything about GPU memory that needs a real GPU, in one
//! command that fits in 10 minutes on one H200 with 16 cores: a release build, `ferry doctor`,
//! the `#[ignore]`d real-driver tests (raw cuMemcpy rates, a checksummed GPU round trip over TCP
//! and io_uring, a file loaded into GPU memory saying GDS or compat), loopback `ferry bench
//! --gpu 0` over TCP and io_uring beside host-to-host runs, GPU memory registered with the RDMA
//! NICs (GPUDirect, route `auto`) and moved over loopback RDMA when a verbs device is present
//! (one `rdma: none: ...` line saying why when there is none), one table of GB/s, and that table
//! as JSON in DIR/gpu-check.json. Without a GPU it fails at once, saying what is missing.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util::{cargo, ferry_bench_json_of, project_root};

fn has_gpu() -> Result<(), String> {
    if let Some(p) = std::env::var_os("FERRY_LIBCUDA") {
        return Err(format!(
            "FERRY_LIBCUDA={} is set: gpu-check measures the real driver; unset it",
            p.to_string_lossy()
        ));
    }
    let ldconfig = Command::new("ldconfig").arg("-p").output();
    let has_lib = ldconfig
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("libcuda.so.1"))
        .unwrap_or(false)
        || [
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            "/usr/lib64/libcuda.so.1",
        ]
        .iter()
        .any(|p| std::path::Path::new(p).exists());
    if !has_lib {
        return Err("libcuda.so.1 not found (no NVIDIA driver on this machine)".into());
    }
    if !std::path::Path::new("/dev/nvidiactl").exists() {
        return Err("/dev/nvidiactl missing (no GPU device nodes)".into());
    }
    Ok(())
}

pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut out: Option<PathBuf> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => out = it.next().map(PathBuf::from),
            other => bail!("gpu-check: unknown argument {other:?} (usage: gpu-check --out DIR)"),
        }
    }
    let out = out.context("gpu-check: name a directory for the JSON with --out DIR")?;
    if let Err(why) = has_gpu() {
        bail!("gpu-check needs an NVIDIA GPU and its driver: {why}");
    }
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let root = project_root();
    crate::util::run(cargo().args(["build", "--release", "-p", "ferry-cli"]))?;
    let ferry = root.join("target/release/ferry");
    crate::util::run(Command::new(&ferry).arg("doctor"))?;

    let tests = cargo()
        .args([
            "test",
            "--release",
            "-p",
            "ferry",
            "--test",
            "gpu_real",
            "--",
        ])
        .args(["--ignored", "--nocapture", "--test-threads", "1"])
        .env("FERRY_REQUIRE_GPU", "1")
        .env("FERRY_GPU_CHECK_DIR", &out)
        .output()
        .context("running the GPU tests")?;
    let text = String::from_utf8_lossy(&tests.stdout).into_owned();
    print!("{text}");
    eprint!("{}", String::from_utf8_lossy(&tests.stderr));
    if !tests.status.success() {
        bail!("the real-driver GPU tests failed");
    }
    let facts: Vec<(String, String)> = text
        .lines()
        .filter_map(|l| l.strip_prefix("GPUCHECK "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let fact = |k: &str| {
        facts
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| "n/a".into())
    };

    let total = "8GiB";
    let mut rows: Vec<(String, f64)> = Vec::new();
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
            let gbps = ferry_bench_json_of(&ferry, &a, "gb_per_s")
                .with_context(|| format!("ferry bench {a:?}"))?;
            rows.push((format!("{transport} {label}"), gbps));
        }
    }
    let mut table = String::new();
    writeln!(table, "{:<34} {:>10}", "what", "GB/s")?;
    for (k, v) in &rows {
        writeln!(table, "{k:<34} {v:>10.3}")?;
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
        "rdma route: {}; NICs: {}",
        fact("rdma_route"),
        fact("rdma_nics")
    )?;
    let ratio = |t: &str| {
        let h = rows.iter().find(|(k, _)| k == &format!("{t} host-to-host"));
        let g = rows
            .iter()
            .find(|(k, _)| k == &format!("{t} gpu-to-gpu (staged)"));
        match (h, g) {
            (Some((_, h)), Some((_, g))) if *h > 0.0 => g / h,
            _ => 0.0,
        }
    };
    writeln!(
        table,
        "gpu/host ratio: tcp {:.2}, uring {:.2} (target: tcp at least 0.80)",
        ratio("tcp"),
        ratio("uring")
    )?;
    print!("{table}");
    let mut json = String::from("{\"rows\":{");
    for (i, (k, v)) in rows.iter().enumerate() {
        let _ = write!(json, "{}\"{k}\":{v}", if i > 0 { "," } else { "" });
    }
    let _ = write!(
        json,
        "}},\"raw_h2d_gbps\":\"{}\",\"raw_d2h_gbps\":\"{}\",\"lane_h2d_gbps\":\"{}\",\"lane_d2h_gbps\":\"{}\",\"file_gbps\":\"{}\",\"file_path\":{:?},\"rdma\":{:?},\"rdma_route\":{:?},\"rdma_write_gbps\":\"{}\",\"ratio_tcp\":{},\"ratio_uring\":{}}}",
        fact("raw_h2d_gbps"),
        fact("raw_d2h_gbps"),
        fact("lane_h2d_gbps"),
        fact("lane_d2h_gbps"),
        fact("file_gbps"),
        fact("file_path"),
        fact("rdma"),
        fact("rdma_route"),
        fact("rdma_write_gbps"),
        ratio("tcp"),
        ratio("uring")
    );
    let path = out.join("gpu-check.json");
    std::fs::write(&path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

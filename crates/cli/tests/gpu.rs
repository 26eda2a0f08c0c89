//! `ferry bench --gpu`, `ferry serve --segment NAME=SIZE@gpuN` and `ferry doctor`'s GPU row,
//! against Ferry's fake CUDA driver (`FERRY_LIBCUDA`), and without any driver.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use anyhow::{Result, bail};
use ferry_tests::{FakeVariant, fake_cuda};

fn ferry(fake: Option<&std::path::Path>) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    match fake {
        Some(p) => c.env("FERRY_LIBCUDA", p),
        None => c.env_remove("FERRY_LIBCUDA"),
    };
    c
}

#[test]
fn loopback_bench_on_gpu_0_moves_and_verifies_bytes() -> Result<()> {
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return Ok(());
    };
    for (op, transport) in [("write", "tcp"), ("read", "tcp"), ("write", "auto")] {
        let out = ferry(Some(fake.path()))
            .args(["bench", "--gpu", "0", "--op", op, "--transport", transport])
            .args(["--total", "6MiB", "--op-size", "1536KiB", "--json"])
            .output()?;
        if !out.status.success() {
            bail!(
                "ferry bench --gpu 0 failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(v["total_bytes"].as_u64(), Some(6 << 20), "{v}");
        let verified = v["gpu_verified"].as_str().unwrap_or_default();
        assert!(verified.contains("verified 1572864 bytes"), "{v}");
        assert!(verified.contains("FAKE driver"), "{v}");
        assert!(verified.contains("staged"), "{v}");
    }
    Ok(())
}

#[test]
fn bench_on_a_gpu_the_driver_lacks_names_it() -> Result<()> {
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return Ok(());
    };
    let out = ferry(Some(fake.path()))
        .args([
            "bench",
            "--gpu",
            "5",
            "--total",
            "1MiB",
            "--transport",
            "tcp",
        ])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no GPU 5"), "{err}");
    Ok(())
}

#[test]
fn bench_gpu_without_libcuda_says_libcuda_is_unavailable() -> Result<()> {
    if ferry_cuda_present() {
        eprintln!("skip: this machine has libcuda.so.1");
        return Ok(());
    }
    let out = ferry(None)
        .args([
            "bench",
            "--gpu",
            "0",
            "--total",
            "1MiB",
            "--transport",
            "tcp",
        ])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("libcuda.so.1 unavailable: "), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    Ok(())
}

fn ferry_cuda_present() -> bool {
    ferry::cuda::Cuda::open(std::ffi::OsStr::new("libcuda.so.1")).is_ok()
}

#[test]
fn doctor_lists_the_gpus_and_the_auto_route() -> Result<()> {
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return Ok(());
    };
    let out = ferry(Some(fake.path()))
        .args(["doctor", "--json"])
        .output()?;
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let row = v["checks"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "gpus"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(row["status"], "ok", "{v}");
    let detail = row["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("GPU 0 Ferry Fake GPU 0 at 0000:17:00.0, 81920 MiB"),
        "{detail}"
    );
    assert!(detail.contains("auto route: "), "{detail}");
    assert!(detail.contains("FAKE driver"), "{detail}");
    Ok(())
}

#[test]
fn serve_publishes_a_segment_in_gpu_memory() -> Result<()> {
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return Ok(());
    };
    let mut child = ferry(Some(fake.path()))
        .args(["serve", "--listen", "127.0.0.1:0", "--transport", "tcp"])
        .args(["--segment", "w=3MiB@gpu0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().expect("piped");
    let mut lines = BufReader::new(stdout).lines();
    let mut addr = None;
    let mut seg = None;
    for line in lines.by_ref() {
        let line = line?;
        if line.starts_with("segment w:") {
            seg = Some(line.clone());
        }
        if let Some(a) = line.strip_prefix("listening on ") {
            addr = Some(a.to_owned());
        }
        // The address comes first, what was said while starting after it.
        if line.starts_with("serving until stopped") {
            break;
        }
    }
    let result = (|| -> Result<()> {
        let seg = seg.unwrap_or_default();
        assert!(
            seg.contains("3145728 bytes on GPU 0 (0000:17:00.0)"),
            "{seg}"
        );
        assert!(seg.contains("route off"), "{seg}");
        let Some(addr) = addr else {
            bail!("no address printed")
        };
        // A GPU client against the GPU segment, over the wire.
        let out = ferry(Some(fake.path()))
            .args([
                "bench",
                &addr,
                "--segment",
                "w",
                "--gpu",
                "0",
                "--transport",
                "tcp",
            ])
            .args([
                "--total",
                "4MiB",
                "--op-size",
                "1MiB",
                "--op",
                "read",
                "--json",
            ])
            .output()?;
        if !out.status.success() {
            bail!(
                "bench against serve failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert!(
            v["gpu_verified"]
                .as_str()
                .unwrap_or_default()
                .contains("verified"),
            "{v}"
        );
        Ok(())
    })();
    let _ = child.kill();
    let _ = child.wait();
    result
}

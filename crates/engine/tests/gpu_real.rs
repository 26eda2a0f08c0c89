//! GPU tests against the real driver (`#[ignore]`d: `cargo xtask gpu-check` runs them on a
//! machine with a GPU). Each prints `GPUCHECK key=value` lines that gpu-check collects. They fail
//! when no driver or GPU is found, unless `FERRY_REQUIRE_GPU=0`.
#![cfg(feature = "cuda")]

use std::time::Instant;

use ferry::cuda::Cuda;
use ferry::{Access, Batch, DataPlane, TransferEngine};

fn cuda_or_skip() -> Option<Cuda> {
    match Cuda::load() {
        Ok(c) if !c.devices().is_empty() => Some(c),
        other => {
            let why = match other {
                Ok(c) => format!("{} lists no GPU", c.library()),
                Err(e) => e.to_string(),
            };
            ferry_tests::require_unless_allowed("FERRY_REQUIRE_GPU", format!("no GPU: {why}"));
            None
        }
    }
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[2])
        .collect()
}

#[test]
#[ignore = "needs a GPU (cargo xtask gpu-check)"]
fn raw_copy_rates() {
    let Some(cuda) = cuda_or_skip() else { return };
    let dev = cuda.device(0).unwrap();
    let len = 256 << 20;
    let mem = dev.alloc(len).unwrap();
    let host = dev.alloc_pinned(len).unwrap().into_region();
    let reps = 8;
    let t = Instant::now();
    for _ in 0..reps {
        mem.copy_from_region(0, &host, 0, len).unwrap();
    }
    let h2d = (reps * len) as f64 / t.elapsed().as_secs_f64() / 1e9;
    let t = Instant::now();
    for _ in 0..reps {
        mem.copy_to_region(0, &host, 0, len).unwrap();
    }
    let d2h = (reps * len) as f64 / t.elapsed().as_secs_f64() / 1e9;
    println!("GPUCHECK raw_h2d_gbps={h2d:.3}");
    println!("GPUCHECK raw_d2h_gbps={d2h:.3}");
    // What one staging lane sees: 4 MiB pieces on one non-blocking stream, each synchronized.
    let stream = dev.copy_stream().unwrap();
    let piece = 4 << 20;
    let t = Instant::now();
    for _ in 0..reps {
        for at in (0..len).step_by(piece) {
            stream
                .copy_from_region(&mem, at as u64, &host, at as u64, piece)
                .unwrap();
        }
    }
    let lane_h2d = (reps * len) as f64 / t.elapsed().as_secs_f64() / 1e9;
    let t = Instant::now();
    for _ in 0..reps {
        for at in (0..len).step_by(piece) {
            stream
                .copy_to_region(&mem, at as u64, &host, at as u64, piece)
                .unwrap();
        }
    }
    let lane_d2h = (reps * len) as f64 / t.elapsed().as_secs_f64() / 1e9;
    println!("GPUCHECK lane_h2d_gbps={lane_h2d:.3}");
    println!("GPUCHECK lane_d2h_gbps={lane_d2h:.3}");
}

#[test]
#[ignore = "needs a GPU (cargo xtask gpu-check)"]
fn real_gpu_round_trip_over_both_planes() {
    let Some(cuda) = cuda_or_skip() else { return };
    let rt = tokio::runtime::Runtime::new().unwrap();
    for plane in [DataPlane::Tcp, DataPlane::Uring] {
        if plane == DataPlane::Uring && !ferry::probe_kernel().usable() {
            println!("GPUCHECK roundtrip_uring=skipped (io_uring unusable)");
            continue;
        }
        rt.block_on(async {
            let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
            let mk = |listen: bool| {
                let mut b = TransferEngine::builder()
                    .same_host(false)
                    .data_plane(plane)
                    .cuda(cuda.clone());
                if listen {
                    b = b.listen("127.0.0.1:0".parse().unwrap());
                }
                b.build().unwrap()
            };
            let (server, client) = (mk(true), mk(false));
            let len = (64 << 20) + 4097;
            let remote_gpu = server.alloc_gpu(0, len, rw, "g").unwrap();
            let a = client.alloc_gpu(0, len, Access::LOCAL, "a").unwrap();
            let b = client.alloc_gpu(0, len, Access::LOCAL, "b").unwrap();
            let data = pattern(len);
            a.memory().copy_from_host(0, &data).unwrap();
            let peer = client.connect(server.local_addr().unwrap()).await.unwrap();
            let seg = peer.segment("g").unwrap();
            let o = client
                .submit(Batch::new().write(&a, 0, &seg, 0, len as u64))
                .unwrap()
                .await;
            assert!(o.is_success(), "{o:?}");
            let o = client
                .submit(Batch::new().read(&b, 0, &seg, 0, len as u64))
                .unwrap()
                .await;
            assert!(o.is_success(), "{o:?}");
            let mut back = vec![0; len];
            b.memory().copy_to_host(0, &mut back).unwrap();
            assert!(
                back == data,
                "bytes differ after the GPU round trip over {plane:?}"
            );
            let mut on_server = vec![0; len];
            remote_gpu.memory().copy_to_host(0, &mut on_server).unwrap();
            assert!(on_server == data);
            println!("GPUCHECK roundtrip_{plane:?}=ok checksum-verified {len} bytes");
        });
    }
}

#[test]
#[ignore = "needs a GPU (cargo xtask gpu-check)"]
fn real_file_load() {
    let Some(cuda) = cuda_or_skip() else { return };
    let dir = std::env::var_os("FERRY_GPU_CHECK_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let path = dir.join("ferry-gpu-check-file.bin");
    let len = 512 << 20;
    std::fs::write(&path, pattern(len)).unwrap();
    let e = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Tcp)
        .cuda(cuda)
        .build()
        .unwrap();
    let g = e.alloc_gpu(0, len, Access::LOCAL, "f").unwrap();
    let t = Instant::now();
    let load = e.read_file_into_gpu(&g, 0, &path, 0, len as u64).unwrap();
    let gbps = len as f64 / t.elapsed().as_secs_f64() / 1e9;
    let mut back = vec![0; 4096];
    g.memory()
        .copy_to_host((len - 4096) as u64, &mut back)
        .unwrap();
    assert!(back == pattern(len)[len - 4096..]);
    let _ = std::fs::remove_file(&path);
    println!("GPUCHECK file_path={}", load.path);
    println!("GPUCHECK file_gbps={gbps:.3}");
}

/// GPU memory registered with the RDMA NICs (GPUDirect, route `auto`) and moved one-sided over
/// loopback RDMA, checksummed. A machine without a verbs device (or none usable) prints one
/// `GPUCHECK rdma=none: <why>` line and passes: the GPU machine may have no NIC.
#[test]
#[ignore = "needs a GPU (cargo xtask gpu-check)"]
fn real_gpu_over_rdma() {
    let Some(cuda) = cuda_or_skip() else { return };
    let listing = ferry::rdma_devices::enumerate_verbs_devices();
    if listing.devices.is_empty() {
        let why = listing
            .unavailable
            .unwrap_or_else(|| "libibverbs lists no device".into());
        println!(
            "GPUCHECK rdma=none: no verbs device ({why}); the GPUDirect RDMA route was not exercised"
        );
        return;
    }
    let mk = |listen: bool| {
        let mut b = TransferEngine::builder()
            .same_host(false)
            .rdma(ferry::RdmaConfig::default())
            .cuda(cuda.clone());
        if listen {
            b = b.listen("127.0.0.1:0".parse().unwrap());
        }
        b.build()
    };
    let (server, client) = match (mk(true), mk(false)) {
        (Ok(s), Ok(c)) => (s, c),
        (Err(e), _) | (_, Err(e)) => {
            println!("GPUCHECK rdma=none: verbs devices listed but no usable rail ({e})");
            return;
        }
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
        let len = (256 << 20) + 4097;
        let remote_gpu = server.alloc_gpu(0, len, rw, "g").unwrap();
        let route = remote_gpu.route().clone();
        println!("GPUCHECK rdma_route={} ({})", route.route, route.why);
        println!("GPUCHECK rdma_nics={}", remote_gpu.nics().join(","));
        let a = client.alloc_gpu(0, len, Access::LOCAL, "a").unwrap();
        let b = client.alloc_gpu(0, len, Access::LOCAL, "b").unwrap();
        let data = pattern(len);
        a.memory().copy_from_host(0, &data).unwrap();
        let peer = client.connect(server.local_addr().unwrap()).await.unwrap();
        println!("GPUCHECK rdma_transport={}", peer.transport());
        let seg = peer.segment("g").unwrap();
        let t = Instant::now();
        let o = client
            .submit(Batch::new().write(&a, 0, &seg, 0, len as u64))
            .unwrap()
            .await;
        let secs = t.elapsed().as_secs_f64();
        assert!(o.is_success(), "{o:?}");
        let o = client
            .submit(Batch::new().read(&b, 0, &seg, 0, len as u64))
            .unwrap()
            .await;
        assert!(o.is_success(), "{o:?}");
        let mut back = vec![0; len];
        b.memory().copy_to_host(0, &mut back).unwrap();
        assert!(
            back == data,
            "bytes differ after the GPU round trip over RDMA"
        );
        let staged = client.describe().staging.map_or(0, |s| s.staged_bytes);
        println!(
            "GPUCHECK rdma=ok checksum-verified {len} bytes, route {}, {staged} bytes staged",
            route.route
        );
        println!("GPUCHECK rdma_write_gbps={:.3}", len as f64 / secs / 1e9);
    });
}

/// The server of [`same_host_gpu_to_gpu_by_cuda_ipc`], run as a child process (this binary
/// again; a no-op otherwise): publishes `ipc_len()` bytes of GPU memory, prints its address and, on each
/// line of stdin, a checksum of that memory; ends with stdin.
#[test]
#[ignore = "needs a GPU (cargo xtask gpu-check)"]
fn same_host_ipc_server_child() {
    if std::env::var_os("FERRY_GPU_CHECK_IPC_CHILD").is_none() {
        return;
    }
    let cuda = Cuda::load().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _guard = rt.enter();
    let server = TransferEngine::builder()
        .same_host(true)
        .data_plane(DataPlane::Tcp)
        .cuda(cuda)
        .listen("127.0.0.1:0".parse().unwrap())
        .build()
        .unwrap();
    let g = server
        .alloc_gpu(
            0,
            ipc_len(),
            Access::REMOTE_READ | Access::REMOTE_WRITE,
            "g",
        )
        .unwrap();
    println!("\nADDR {}", server.local_addr().unwrap());
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
        let mut now = vec![0u8; ipc_len()];
        g.memory().copy_to_host(0, &mut now).unwrap();
        println!("\nSUM {}", checksum(&now));
        line.clear();
    }
}

/// Bytes of each op of the CUDA IPC check: 1 GiB, or `FERRY_GPU_CHECK_IPC_MIB` MiB (a dry run
/// against the fake driver, whose device memory is host memory, takes less).
fn ipc_len() -> usize {
    std::env::var("FERRY_GPU_CHECK_IPC_MIB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(1 << 30, |m| m << 20)
}

fn checksum(b: &[u8]) -> u64 {
    b.chunks(8).fold(0u64, |h, c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        h.rotate_left(5) ^ u64::from_le_bytes(w)
    })
}

/// Same host, two processes: GPU memory to GPU memory over the same-host plane, granted by CUDA
/// IPC and copied device to device by the server (`GPUCHECK same_host_ipc_*`). Where the plane
/// does not take CUDA IPC here (the route says why) it prints that as the row and passes; wrong
/// bytes fail.
#[test]
#[ignore = "needs a GPU (cargo xtask gpu-check)"]
fn same_host_gpu_to_gpu_by_cuda_ipc() {
    use std::io::{BufRead, BufReader, Write};

    let Some(cuda) = cuda_or_skip() else { return };
    let unavailable = |why: &str| {
        let why = why.replace('\n', " ");
        println!("GPUCHECK same_host_ipc=unavailable: {why}");
    };
    if !cuda.has_ipc() {
        return unavailable("the driver has no CUDA IPC entry points");
    }
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "same_host_ipc_server_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("FERRY_GPU_CHECK_IPC_CHILD", "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return unavailable(&format!("cannot start the server process: {e}")),
    };
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut next = |tag: &str| -> Option<String> {
        loop {
            let mut l = String::new();
            if out.read_line(&mut l).ok()? == 0 {
                return None;
            }
            if let Some(rest) = l.trim().strip_prefix(tag) {
                return Some(rest.trim().to_owned());
            }
        }
    };
    let Some(addr) = next("ADDR ").and_then(|a| a.parse::<std::net::SocketAddr>().ok()) else {
        let _ = child.kill();
        let _ = child.wait();
        return unavailable("the server process ended before serving");
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let result = rt.block_on(async {
        let client = TransferEngine::builder()
            .same_host(true)
            .data_plane(DataPlane::Tcp)
            .cuda(cuda.clone())
            .build()
            .map_err(|e| e.to_string())?;
        let mine = client
            .alloc_gpu(0, ipc_len(), Access::LOCAL, "mine")
            .map_err(|e| e.to_string())?;
        let data = pattern(ipc_len());
        mine.memory().copy_from_host(0, &data).unwrap();
        let peer = client.connect(addr).await.map_err(|e| e.to_string())?;
        let seg = peer.segment("g").map_err(|e| e.to_string())?;
        let d = client.describe();
        let route = d
            .routes
            .first()
            .map(|r| (r.transport.clone(), r.gpu.clone()));
        match &route {
            Some((t, Some(g))) if t == "local" && g == "cuda-ipc" => {}
            other => {
                return Err(format!(
                    "the route is {other:?}, not the same-host plane with cuda-ipc"
                ));
            }
        }
        let reps = 8;
        let mut rates = Vec::new();
        for kind in ["write", "read"] {
            let t = Instant::now();
            for _ in 0..reps {
                let batch = if kind == "write" {
                    Batch::new().write(&mine, 0, &seg, 0, ipc_len() as u64)
                } else {
                    Batch::new().read(&mine, 0, &seg, 0, ipc_len() as u64)
                };
                let o = client.submit(batch).map_err(|e| e.to_string())?.await;
                assert!(o.is_success(), "{kind}: {o:?}");
            }
            rates.push((
                kind,
                (reps * ipc_len()) as f64 / t.elapsed().as_secs_f64() / 1e9,
            ));
        }
        let staged = client.describe().staging.map_or(0, |s| s.staged_bytes);
        Ok::<_, String>((rates, staged, checksum(&data)))
    });
    let (rates, staged, sum) = match result {
        Ok(r) => r,
        Err(why) => {
            let _ = child.kill();
            let _ = child.wait();
            return unavailable(&why);
        }
    };
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "sum").unwrap();
    let theirs = next("SUM ");
    drop(stdin);
    let _ = child.wait();
    assert_eq!(
        theirs.as_deref(),
        Some(sum.to_string().as_str()),
        "the server's GPU memory holds other bytes than were written"
    );
    assert_eq!(staged, 0, "nothing may go through the staging pool");
    for (kind, gbps) in rates {
        println!("GPUCHECK same_host_ipc_{kind}_gbps={gbps:.3}");
    }
    println!(
        "GPUCHECK same_host_ipc=ok checksum-verified, two processes, {} MiB ops, nothing staged",
        ipc_len() >> 20
    );
}

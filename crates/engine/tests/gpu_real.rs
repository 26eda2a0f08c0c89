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

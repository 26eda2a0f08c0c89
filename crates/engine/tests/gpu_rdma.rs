//! GPU memory registered with RDMA NICs (GPUDirect), against Ferry's fake CUDA driver on real
//! verbs devices (soft-RoCE in `cargo xtask soft-roce`).
//!
//! - peermem: the fake built with host-pointer device memory ([`FakeVariant::HostPointers`]), so
//!   `ibv_reg_mr` on its device addresses works on rxe as `nvidia_peermem` makes it work on a
//!   GPU, and a peermem version file in a temporary sysfs root (`gpu_sysfs_root`). A GPU segment
//!   is then READ and WRITTEN one-sided, checksums compared, nothing staged.
//! - dma-buf: the fake's export hands out a file that is not a dma-buf, and rxe refuses dma-buf
//!   MRs anyway: the registration must fail with a typed error naming the device, the verb and
//!   the native errno, never panic and never fall back to staging.
//!
//! `#[ignore]`d: run with `--include-ignored` and `FERRY_RDMA_TEST_DEVICES=rxe0,rxe1
//! FERRY_RDMA_TEST_GIDS=<gid index of each>`. Unset, the tests fail (with
//! `FERRY_REQUIRE_RDMA=0` they print why and skip). The guest has no compiler: it finds the
//! fakes prebuilt by the host under `FERRY_FAKE_CUDA_PREBUILT`.
#![cfg(all(feature = "rdma", feature = "cuda"))]

use std::error::Error as _;

use anyhow::{Context, Result, ensure};
use ferry::cuda::{Cuda, GpuDirectSetting, GpuRoute};
use ferry::{Access, Batch, MemoryRegion, RailSpec, RdmaConfig, TransferEngine, TransportKind};
use ferry_tests::{FakeCuda, FakeVariant, fake_cuda};

fn rails() -> Option<(RailSpec, RailSpec)> {
    let Ok(devs) = std::env::var("FERRY_RDMA_TEST_DEVICES") else {
        ferry_tests::require_unless_allowed(
            ferry_tests::RDMA,
            "FERRY_RDMA_TEST_DEVICES is unset (run `cargo xtask soft-roce`)",
        );
        return None;
    };
    let gids: Vec<u32> = std::env::var("FERRY_RDMA_TEST_GIDS")
        .unwrap_or_default()
        .split(',')
        .map(|g| g.trim().parse().unwrap_or(0))
        .collect();
    let names: Vec<&str> = devs
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let listed: Vec<String> = ferry::rdma_devices::enumerate_verbs_devices()
        .devices
        .into_iter()
        .map(|d| d.name)
        .collect();
    for n in &names {
        assert!(
            listed.iter().any(|l| l == n),
            "FERRY_RDMA_TEST_DEVICES names {n}, but libibverbs lists only {listed:?}"
        );
    }
    let spec = |i: usize| {
        let i = i.min(names.len() - 1);
        RailSpec::new(names[i], 1, gids.get(i).copied().unwrap_or(0))
    };
    Some((spec(0), spec(1)))
}

/// The rail's name as the engine reports it (`rxe0:1`).
fn rail_name(r: &RailSpec) -> String {
    format!("{}:{}", r.device, r.port)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
        .collect()
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100000001b3)
    })
}

/// A sysfs root holding only `module/nvidia_peermem/version`.
fn peermem_root() -> Result<tempfile::TempDir> {
    let d = tempfile::tempdir()?;
    std::fs::create_dir_all(d.path().join("module/nvidia_peermem"))?;
    std::fs::write(d.path().join("module/nvidia_peermem/version"), "0.0-test\n")?;
    Ok(d)
}

fn engine(
    fake: &FakeCuda,
    rail: RailSpec,
    setting: GpuDirectSetting,
    sysfs: &std::path::Path,
    listen: bool,
) -> Result<TransferEngine> {
    let mut b = TransferEngine::builder()
        .same_host(false)
        .rdma(RdmaConfig::with_rails(vec![rail]).chunk_size(256 << 10))
        .cuda(Cuda::open(fake.path().as_os_str())?)
        .gpu_direct_registration(setting)
        .gpu_sysfs_root(sysfs);
    if listen {
        b = b.listen("127.0.0.1:0".parse()?);
    }
    Ok(b.build()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs RDMA devices: FERRY_RDMA_TEST_DEVICES (cargo xtask soft-roce)"]
async fn a_gpu_segment_is_read_and_written_one_sided_over_peermem() -> Result<()> {
    let Some((s, c)) = rails() else { return Ok(()) };
    // With RDMA devices named, the fake must be there (prebuilt in the guest): no vacuous pass.
    let fake = fake_cuda(FakeVariant::HostPointers).context("the fake CUDA driver is missing")?;
    let sysfs = peermem_root()?;
    const LEN: usize = (3 << 20) + 4099; // not a multiple of the chunk
    let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;

    let server = engine(
        fake,
        s.clone(),
        GpuDirectSetting::Peermem,
        sysfs.path(),
        true,
    )?;
    let target = server.alloc_gpu(0, LEN, rw, "g")?;
    ensure!(
        target.route().route == GpuRoute::Peermem,
        "{:?}",
        target.route()
    );
    ensure!(
        target.nics() == [rail_name(&s)],
        "server NICs {:?}",
        target.nics()
    );
    let d = server.describe();
    let g = &d.gpu_registrations[0];
    ensure!(
        g.route.route == GpuRoute::Peermem && g.route.why.contains("nvidia_peermem"),
        "{g:?}"
    );
    ensure!(
        g.nics == [rail_name(&s)] && !g.nic_choice.is_empty(),
        "{g:?}"
    );
    println!("{d}");
    let addr = server.local_addr().context("no listener")?;

    let client = engine(
        fake,
        c.clone(),
        GpuDirectSetting::Peermem,
        sysfs.path(),
        false,
    )?;
    let src = client.alloc_gpu(0, LEN, Access::LOCAL, "src")?;
    let dst = client.alloc_gpu(0, LEN, Access::LOCAL, "dst")?;
    ensure!(
        src.nics() == [rail_name(&c)],
        "client NICs {:?}",
        src.nics()
    );
    let data = pattern(LEN, 0x5a);
    src.memory().copy_from_host(0, &data)?;
    let peer = client.connect(addr).await?;
    ensure!(
        peer.transport() == TransportKind::Rdma,
        "route is {}",
        peer.transport()
    );
    let seg = peer.segment("g")?;
    ensure!(
        !seg.desc().remote_keys.is_empty(),
        "no remote keys for the GPU segment"
    );
    ensure!(
        seg.desc().remote_keys[0].addr == target.memory().device_ptr(),
        "peers address the segment by its device address"
    );

    // GPU to GPU WRITE, then READ back into another GPU buffer.
    let o = client
        .submit(Batch::new().write(&src, 0, &seg, 0, LEN as u64))?
        .await;
    ensure!(o.is_success() && o.drained, "WRITE: {o:?}");
    let mut got = vec![0; LEN];
    target.memory().copy_to_host(0, &mut got)?;
    ensure!(fnv(&got) == fnv(&data), "WRITE: server GPU bytes differ");
    let o = client
        .submit(Batch::new().read(&dst, 0, &seg, 0, LEN as u64))?
        .await;
    ensure!(o.is_success() && o.drained, "READ: {o:?}");
    let mut back = vec![0; LEN];
    dst.memory().copy_to_host(0, &mut back)?;
    ensure!(fnv(&back) == fnv(&data), "READ: client GPU bytes differ");

    // Host memory to the GPU segment and back, at odd offsets.
    let host = client.register(
        MemoryRegion::from_vec(pattern(LEN, 0x33)),
        Access::LOCAL,
        "host",
    )?;
    let o = client
        .submit(Batch::new().write(&host, 7, &seg, 11, 100_003))?
        .await;
    ensure!(o.is_success(), "host WRITE: {o:?}");
    let mut got = vec![0; 100_003];
    target.memory().copy_to_host(11, &mut got)?;
    ensure!(
        got == pattern(LEN, 0x33)[7..7 + 100_003],
        "host WRITE: bytes differ"
    );

    let staged = client.describe().staging.map_or(0, |s| s.staged_bytes);
    ensure!(
        staged == 0,
        "GPU ops over RDMA peermem must not be staged ({staged} bytes were)"
    );
    let rail_bytes: u64 = client.describe().rails.iter().map(|r| r.bytes).sum();
    ensure!(
        rail_bytes >= 2 * LEN as u64,
        "rails carried {rail_bytes} bytes"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs RDMA devices: FERRY_RDMA_TEST_DEVICES (cargo xtask soft-roce)"]
async fn a_dmabuf_registration_the_nic_refuses_is_a_typed_error() -> Result<()> {
    let Some((s, _)) = rails() else { return Ok(()) };
    let fake = fake_cuda(FakeVariant::Full).context("the fake CUDA driver is missing")?;
    let empty = tempfile::tempdir()?;
    for setting in [GpuDirectSetting::Dmabuf, GpuDirectSetting::Auto] {
        let e = engine(fake, s.clone(), setting, empty.path(), false)?;
        let err = match e.alloc_gpu(0, 1 << 20, Access::REMOTE_READ, "g") {
            Ok(r) => anyhow::bail!(
                "{setting}: rxe registered a non-dma-buf fd: {:?}",
                r.route()
            ),
            Err(err) => err,
        };
        let mut text = err.to_string();
        let mut errno = None;
        let mut cur: Option<&dyn std::error::Error> = err.source();
        while let Some(e) = cur {
            text.push_str(&format!(": {e}"));
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                errno = errno.or(io.raw_os_error());
            }
            cur = e.source();
        }
        println!("{setting}: {text}");
        if text.contains("optional export `ibv_reg_dmabuf_mr` is absent")
            || text.contains("missing ibv_reg_dmabuf_mr")
        {
            // This libibverbs predates dma-buf MRs: the route is refused before registering.
            ensure!(setting == GpuDirectSetting::Dmabuf, "{setting}: {text}");
            continue;
        }
        ensure!(
            text.contains("ibv_reg_dmabuf_mr"),
            "{setting}: names no verb: {text}"
        );
        ensure!(
            text.contains(&rail_name(&s)),
            "{setting}: names no device: {text}"
        );
        ensure!(
            errno.is_some(),
            "{setting}: carries no native errno: {text}"
        );
        // Nothing was left registered or staged.
        let d = e.describe();
        ensure!(
            d.gpu_registrations.is_empty() && d.registrations == 0,
            "{d:?}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs RDMA devices: FERRY_RDMA_TEST_DEVICES (cargo xtask soft-roce)"]
async fn with_route_off_gpu_memory_is_staged_over_rdma() -> Result<()> {
    let Some((s, c)) = rails() else { return Ok(()) };
    let fake = fake_cuda(FakeVariant::Full).context("the fake CUDA driver is missing")?;
    let empty = tempfile::tempdir()?;
    const LEN: usize = (1 << 20) + 513;
    let server = TransferEngine::builder()
        .same_host(false)
        .listen("127.0.0.1:0".parse()?)
        .rdma(RdmaConfig::with_rails(vec![s]).chunk_size(256 << 10))
        .build()?;
    let target = std::sync::Arc::new(MemoryRegion::from_vec(vec![0; LEN]));
    let _seg = server.register(
        target.clone(),
        Access::REMOTE_READ | Access::REMOTE_WRITE,
        "h",
    )?;
    let client = engine(fake, c, GpuDirectSetting::Off, empty.path(), false)?;
    let src = client.alloc_gpu(0, LEN, Access::LOCAL, "src")?;
    let dst = client.alloc_gpu(0, LEN, Access::LOCAL, "dst")?;
    ensure!(
        src.route().route == GpuRoute::Off && src.nics().is_empty(),
        "{:?}",
        src.route()
    );
    let data = pattern(LEN, 0x77);
    src.memory().copy_from_host(0, &data)?;
    let peer = client
        .connect(server.local_addr().context("no listener")?)
        .await?;
    ensure!(
        peer.transport() == TransportKind::Rdma,
        "route is {}",
        peer.transport()
    );
    let seg = peer.segment("h")?;
    let o = client
        .submit(Batch::new().write(&src, 0, &seg, 0, LEN as u64))?
        .await;
    ensure!(o.is_success() && o.drained, "staged WRITE: {o:?}");
    let mut got = vec![0; LEN];
    target.read_at(0, &mut got)?;
    ensure!(fnv(&got) == fnv(&data), "staged WRITE: bytes differ");
    let o = client
        .submit(Batch::new().read(&dst, 0, &seg, 0, LEN as u64))?
        .await;
    ensure!(o.is_success() && o.drained, "staged READ: {o:?}");
    let mut back = vec![0; LEN];
    dst.memory().copy_to_host(0, &mut back)?;
    ensure!(fnv(&back) == fnv(&data), "staged READ: bytes differ");
    let st = client
        .describe()
        .staging
        .context("no staging description")?;
    ensure!(st.staged_bytes == 2 * LEN as u64, "{st:?}");
    ensure!(st.buffers_in_use == 0, "{st:?}");
    Ok(())
}

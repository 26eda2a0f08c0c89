//! GPU memory on the same-host plane, against Ferry's fake CUDA driver: between two processes
//! (this test, the client, and a child server: this binary run again) GPU buffers move by CUDA
//! IPC, device to device, with nothing staged; within one process (the driver refuses a
//! process's own IPC handles) they take the host stage, and the route says why.
#![cfg(feature = "cuda")]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};

use ferry::cuda::Cuda;
use ferry::{Access, Batch, DataPlane, TransferEngine};
use ferry_tests::{FakeCuda, FakeVariant, fake_cuda};

static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const LEN: usize = 3 << 20;

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

fn engine(lib: &std::path::Path, listen: bool) -> TransferEngine {
    let cuda = Cuda::open(lib.as_os_str()).unwrap();
    let mut b = TransferEngine::builder()
        .same_host(true)
        .data_plane(DataPlane::Tcp)
        .cuda(cuda)
        .chunk_size(1 << 20);
    if listen {
        b = b.listen("127.0.0.1:0".parse().unwrap());
    }
    b.build().unwrap()
}

/// The child server: publishes GPU memory `g`, prints its address, then answers each line of
/// stdin with `FNV <hash of g>` (or fills `g` with a seed's pattern on `fill <seed>`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_child() {
    let Some(lib) = std::env::var_os("FERRY_GPU_SAME_HOST_CHILD") else {
        return;
    };
    let server = engine(lib.as_ref(), true);
    let g = server
        .alloc_gpu(0, LEN, Access::REMOTE_READ | Access::REMOTE_WRITE, "g")
        .unwrap();
    println!("\nADDR {}", server.local_addr().unwrap());
    let lines = tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        let stdin = std::io::stdin();
        let mut line = String::new();
        while stdin.lock().read_line(&mut line).is_ok_and(|n| n > 0) {
            out.push(line.trim().to_owned());
            if let Some(seed) = line.trim().strip_prefix("fill ") {
                g.memory()
                    .copy_from_host(0, &pattern(LEN, seed.parse().unwrap()))
                    .unwrap();
            }
            let mut now = vec![0u8; LEN];
            g.memory().copy_to_host(0, &mut now).unwrap();
            println!("\nFNV {}", fnv(&now));
            line.clear();
        }
        out
    });
    lines.await.unwrap();
    drop(server);
}

struct ChildServer {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl ChildServer {
    fn spawn(fake: &FakeCuda) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["server_child", "--exact", "--nocapture", "--test-threads=1"])
            .env("FERRY_GPU_SAME_HOST_CHILD", fake.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        Self { child, out }
    }

    fn line(&mut self, tag: &str) -> String {
        loop {
            let mut l = String::new();
            assert!(
                self.out.read_line(&mut l).unwrap() > 0,
                "the child ended early"
            );
            if let Some(rest) = l.trim().strip_prefix(tag) {
                return rest.trim().to_owned();
            }
        }
    }

    fn ask(&mut self, cmd: &str) -> u64 {
        writeln!(self.child.stdin.as_mut().unwrap(), "{cmd}").unwrap();
        self.line("FNV ").parse().unwrap()
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_to_gpu_between_processes_by_cuda_ipc_with_nothing_staged() {
    let _g = LOCK.lock().await;
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let mut server = ChildServer::spawn(fake);
    let addr: std::net::SocketAddr = server.line("ADDR ").parse().unwrap();
    let client = engine(fake.path(), false);
    let mine = client.alloc_gpu(0, LEN, Access::LOCAL, "mine").unwrap();
    let peer = client.connect(addr).await.unwrap();
    let g = peer.segment("g").unwrap();
    let d = client.describe();
    assert_eq!(d.routes.len(), 1);
    assert_eq!(d.routes[0].transport, "local", "{d}");
    assert_eq!(d.routes[0].gpu.as_deref(), Some("cuda-ipc"), "{d}");

    // GPU to GPU (WRITE): the child's memory holds our bytes.
    let data = pattern(LEN, 5);
    mine.memory().copy_from_host(0, &data).unwrap();
    let o = client
        .submit(Batch::new().write(&mine, 0, &g, 0, LEN as u64))
        .unwrap()
        .await;
    assert!(o.is_success(), "{o:?}");
    assert_eq!(server.ask("look"), fnv(&data), "GPU to GPU write");
    // GPU from GPU (READ).
    let theirs = pattern(LEN, 9);
    assert_eq!(server.ask("fill 9"), fnv(&theirs));
    let o = client
        .submit(Batch::new().read(&mine, 0, &g, 0, LEN as u64))
        .unwrap()
        .await;
    assert!(o.is_success(), "{o:?}");
    let mut got = vec![0u8; LEN];
    mine.memory().copy_to_host(0, &mut got).unwrap();
    assert!(got == theirs, "GPU from GPU read");

    let d = client.describe();
    let staged = d.staging.as_ref().map_or(0, |s| s.staged_bytes);
    assert_eq!(staged, 0, "nothing went through the staging pool: {d}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_one_process_gpu_buffers_take_the_host_stage_and_the_route_says_why() {
    let _g = LOCK.lock().await;
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let server = engine(fake.path(), true);
    let client = engine(fake.path(), false);
    let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let g = server.alloc_gpu(0, LEN, rw, "g").unwrap();
    let mine = client.alloc_gpu(0, LEN, Access::LOCAL, "mine").unwrap();
    let peer = client.connect(server.local_addr().unwrap()).await.unwrap();
    let rg = peer.segment("g").unwrap();
    let d = client.describe();
    assert_eq!(d.routes[0].transport, "local", "{d}");
    let gpu = d.routes[0].gpu.clone().unwrap_or_default();
    assert!(
        gpu.starts_with("host stage (") && gpu.contains("this process"),
        "{gpu}"
    );
    let data = pattern(LEN, 3);
    mine.memory().copy_from_host(0, &data).unwrap();
    let o = client
        .submit(Batch::new().write(&mine, 0, &rg, 0, LEN as u64))
        .unwrap()
        .await;
    assert!(o.is_success(), "{o:?}");
    let mut got = vec![0u8; LEN];
    g.memory().copy_to_host(0, &mut got).unwrap();
    assert!(got == data);
    let staged = client.describe().staging.map_or(0, |s| s.staged_bytes);
    assert!(staged >= LEN as u64, "staged: {staged}");
}

//! GPU buffers on the same-host plane by CUDA IPC, against Ferry's fake CUDA driver, between two
//! processes (the driver refuses a process's own handles): this test process serves a GPU
//! segment and a host segment; a child (this binary run again) is the client whose buffers are
//! GPU memory. Bytes land GPU to GPU, host to GPU and GPU to host; a client that dies has its
//! handles closed; a server without CUDA IPC is refused cleanly and the channel says why.

mod common;
use common::Responder;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferry_core::wire::{SUPPORTED_VERSIONS, TransportOffer};
use ferry_core::{
    Access, Channel, Epoch, FileSource, MemoryRegion, Op, OpKind, PeerId, PeerInfo, RequestControl,
    SegmentDesc, SegmentLease, SegmentTable, SegmentToken,
};
use ferry_cuda::{Cuda, DeviceSegment};
use ferry_tests::{FakeVariant, fake_cuda};
use ferry_transport_local::{CudaSource, GpuRoute, LocalConfig, LocalServerHandle, LocalTransport};

const LEN: usize = 1 << 20;
const HOST: SegmentToken = SegmentToken(1);
const GPU: SegmentToken = SegmentToken(2);

static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 7 + i / 251) as u8).wrapping_add(seed))
        .collect()
}

/// A host segment (token 1) and a GPU segment (token 2), both readable and writable.
#[derive(Debug)]
struct Table {
    host: Arc<MemoryRegion>,
    gpu: Arc<DeviceSegment>,
}

impl SegmentTable for Table {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        (token == HOST).then(|| SegmentLease {
            region: self.host.clone(),
            base: 0,
            len: LEN as u64,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            guard: None,
        })
    }
    fn published(&self) -> Vec<SegmentDesc> {
        Vec::new()
    }
    fn file(&self, token: SegmentToken) -> Option<Arc<dyn FileSource>> {
        (token == GPU).then(|| self.gpu.clone() as Arc<dyn FileSource>)
    }
}

struct Served {
    table: Arc<Table>,
    handle: Arc<LocalServerHandle>,
    epoch: Epoch,
    _transport: LocalTransport,
}

fn serve(cuda: Option<Cuda>) -> Served {
    let dev = cuda
        .clone()
        .unwrap_or_else(|| {
            Cuda::open(fake_cuda(FakeVariant::Full).unwrap().path().as_os_str()).unwrap()
        })
        .device(0)
        .unwrap();
    let mem = Arc::new(dev.alloc(LEN).unwrap());
    let table = Arc::new(Table {
        host: Arc::new(MemoryRegion::alloc_zeroed(LEN, 4096).unwrap()),
        gpu: Arc::new(DeviceSegment::new(
            mem,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        )),
    });
    let epoch = Epoch::fresh();
    let transport = LocalTransport::new(LocalConfig {
        cuda: cuda.map(CudaSource::fixed),
        ..LocalConfig::default()
    });
    let handle = transport
        .serve(table.clone(), Arc::new(Responder(epoch)))
        .unwrap();
    Served {
        table,
        handle,
        epoch,
        _transport: transport,
    }
}

/// The child client: connects to the server its environment names, prints the channel's GPU
/// route, then runs the line commands of its stdin with a GPU buffer of its own, answering each
/// with `DONE <ok>`: `write <token> <seed>` (fills its buffer with the seed's pattern and WRITEs
/// it), `read <token> <seed>` (READs into its buffer and checks the seed's pattern there).
#[test]
fn client_child() {
    let Ok(spec) = std::env::var("FERRY_LOCAL_IPC_CHILD") else {
        return;
    };
    let mut it = spec.split(' ');
    let mut next = || it.next().unwrap().to_owned();
    let (lib, pid, socket, epoch) = (next(), next(), next(), next());
    let cuda = Cuda::open(lib.as_ref()).unwrap();
    let mem = Arc::new(cuda.device(0).unwrap().alloc(LEN).unwrap());
    let region = Arc::new(mem.ipc_region().unwrap());
    let transport = LocalTransport::new(LocalConfig {
        cuda: Some(CudaSource::fixed(cuda)),
        ..LocalConfig::default()
    });
    let peer = PeerInfo {
        addr: "127.0.0.1:1".parse().unwrap(),
        local_id: PeerId::random(),
        local_epoch: Epoch::fresh(),
        remote_id: PeerId(7),
        remote_epoch: Epoch(epoch.parse().unwrap()),
        offer: TransportOffer::Local {
            boot_id: [0; 16],
            pid: pid.parse().unwrap(),
            streams: 2,
            socket,
        },
        segments: Vec::new(),
        session: None,
        key_name: None,
        version: SUPPORTED_VERSIONS.max,
    };
    let channel = transport.connect_channel(&peer).unwrap();
    println!("\nROUTE {}", channel.gpu_route());
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let stdin = std::io::stdin();
    let mut line = String::new();
    while stdin.lock().read_line(&mut line).is_ok_and(|n| n > 0) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let (kind, token, seed) = (
            words[0],
            SegmentToken(words[1].parse().unwrap()),
            words[2].parse::<u8>().unwrap(),
        );
        let kind = if kind == "write" {
            mem.copy_from_host(0, &pattern(LEN, seed)).unwrap();
            OpKind::Write
        } else {
            mem.copy_from_host(0, &vec![0; LEN]).unwrap();
            OpKind::Read
        };
        // Two ops of half the buffer each: the second at an offset in the allocation.
        let ops: Arc<[Op]> = (0..2)
            .map(|i| Op {
                kind,
                local: region.clone(),
                local_offset: (i * LEN / 2) as u64,
                token,
                remote_offset: (i * LEN / 2) as u64,
                len: (LEN / 2) as u64,
            })
            .collect();
        let control = Arc::new(RequestControl::new(&ops));
        let outcome = rt.block_on(channel.execute(ops, control));
        let mut ok = outcome.is_success();
        if ok && kind == OpKind::Read {
            let mut got = vec![0u8; LEN];
            mem.copy_to_host(0, &mut got).unwrap();
            ok = got == pattern(LEN, seed);
        }
        println!("\nDONE {ok} {outcome:?}");
        line.clear();
    }
}

struct ChildClient {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl ChildClient {
    fn spawn(lib: &std::path::Path, s: &Served) -> Self {
        let spec = format!(
            "{} {} {} {}",
            lib.display(),
            std::process::id(),
            s.handle.name(),
            s.epoch.0
        );
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["client_child", "--exact", "--nocapture", "--test-threads=1"])
            .env("FERRY_LOCAL_IPC_CHILD", spec)
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

    fn run(&mut self, cmd: &str) -> String {
        writeln!(self.child.stdin.as_mut().unwrap(), "{cmd}").unwrap();
        self.line("DONE ")
    }
}

impl Drop for ChildClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits for `cond` (each look a few milliseconds apart), failing after a generous deadline:
/// the wait is for an event, not a timing.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < until, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn gpu_buffers_move_by_cuda_ipc_and_a_dead_client_s_handles_are_closed() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    let s = serve(Some(cuda));
    let imports = fake.live_ipc_imports();
    let copies = fake.copies();
    let mut client = ChildClient::spawn(fake.path(), &s);
    assert_eq!(client.line("ROUTE "), "cuda-ipc");

    // GPU -> GPU: the client's GPU buffer into the GPU segment.
    assert!(client.run("write 2 11").starts_with("true"));
    let mut got = vec![0u8; LEN];
    s.table.gpu.memory().copy_to_host(0, &mut got).unwrap();
    assert!(
        got == pattern(LEN, 11),
        "the GPU segment holds the client's bytes"
    );
    // GPU -> host: into the host segment.
    assert!(client.run("write 1 22").starts_with("true"));
    s.table.host.read_at(0, &mut got).unwrap();
    assert!(
        got == pattern(LEN, 22),
        "the host segment holds the client's bytes"
    );
    // host -> GPU and GPU -> GPU the other way: READs into the client's GPU buffer.
    s.table.host.write_at(0, &pattern(LEN, 33)).unwrap();
    assert!(client.run("read 1 33").starts_with("true"));
    s.table
        .gpu
        .memory()
        .copy_from_host(0, &pattern(LEN, 44))
        .unwrap();
    assert!(client.run("read 2 44").starts_with("true"));
    assert!(
        fake.copies() >= copies + 8,
        "every chunk was one driver copy, no socket payload"
    );
    assert!(
        fake.live_ipc_imports() > imports,
        "the server keeps the client's handles open between requests"
    );

    // The client dies: its streams end and their handles are closed.
    client.child.kill().unwrap();
    client.child.wait().unwrap();
    wait_for("the dead client's streams end", || s.handle.streams() == 0);
    assert_eq!(fake.live_ipc_imports(), imports, "every handle was closed");
}

#[test]
fn a_server_without_cuda_ipc_is_refused_cleanly_and_gpu_buffers_are_not_sent() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let s = serve(None);
    let mut client = ChildClient::spawn(fake.path(), &s);
    let route = client.line("ROUTE ");
    assert!(
        route.starts_with("host stage (the peer refused CUDA IPC: no CUDA IPC here:"),
        "{route}"
    );
    // A GPU buffer on that channel fails on this side; nothing is sent.
    let done = client.run("write 2 5");
    assert!(
        done.starts_with("false") && done.contains("Local"),
        "{done}"
    );
    let mut got = vec![0u8; LEN];
    s.table.gpu.memory().copy_to_host(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0), "nothing reached the segment");
}

#[test]
fn the_same_process_takes_the_host_stage() {
    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    let s = serve(Some(cuda.clone()));
    let transport = LocalTransport::new(LocalConfig {
        cuda: Some(CudaSource::fixed(cuda)),
        ..LocalConfig::default()
    });
    let peer = PeerInfo {
        addr: "127.0.0.1:1".parse().unwrap(),
        local_id: PeerId::random(),
        local_epoch: Epoch::fresh(),
        remote_id: PeerId(7),
        remote_epoch: s.epoch,
        offer: TransportOffer::Local {
            boot_id: [0; 16],
            pid: std::process::id(),
            streams: 1,
            socket: s.handle.name().to_owned(),
        },
        segments: Vec::new(),
        session: None,
        key_name: None,
        version: SUPPORTED_VERSIONS.max,
    };
    let channel = transport.connect_channel(&peer).unwrap();
    assert!(
        matches!(channel.gpu_route(), GpuRoute::HostStage(why) if why.contains("this process")),
        "{}",
        channel.gpu_route()
    );
}

#[test]
fn a_forged_grant_is_refused_and_nothing_is_mapped_or_copied() {
    use ferry_core::wire::{ControlFrame, DATA_REQUEST_LEN, DataRequest, StreamAttach};
    use ferry_transport_local::wire::{CUDA_IPC_CODE, IPC_MARK, IPC_REF_LEN, PROBE_OK};
    use std::io::Read;
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};

    let _g = lock();
    let Some(fake) = fake_cuda(FakeVariant::Full) else {
        return;
    };
    fake.reset();
    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    let s = serve(Some(cuda));
    let imports = fake.live_ipc_imports();
    let unix = "127.0.0.1:0".parse().unwrap();
    // A raw client: attaches as a CUDA IPC stream (accepted: this server has CUDA IPC) and
    // passes the probe.
    let addr = UnixAddr::from_abstract_name(s.handle.name().as_bytes()).unwrap();
    let mut sock = UnixStream::connect_addr(&addr).unwrap();
    let attach = ControlFrame::StreamAttach(StreamAttach {
        peer_id: PeerId(1),
        epoch: Epoch::fresh(),
        server_epoch: s.epoch,
        transport: CUDA_IPC_CODE,
        stream_index: 0,
    });
    ferry_net::write_frame(&mut sock, unix, &attach).unwrap();
    let reply = ferry_net::read_frame(&mut sock, unix).unwrap();
    assert!(matches!(reply, ControlFrame::StreamAccept), "{reply:?}");
    let canary = Box::new(0x0123_4567_89ab_cdef_u64);
    sock.write_all(&((&raw const *canary) as usize as u64).to_le_bytes())
        .unwrap();
    let mut answer = [0u8; 9];
    sock.read_exact(&mut answer).unwrap();
    assert_eq!(answer[0], PROBE_OK);
    // A WRITE into the host segment whose grant is made up.
    let mut req = [0u8; DATA_REQUEST_LEN];
    DataRequest {
        kind: OpKind::Write,
        seq: 0,
        token: HOST,
        offset: 0,
        len: 4096,
        ack_slack: 0,
    }
    .encode(&mut req);
    let mut grant = [0x5au8; IPC_REF_LEN];
    grant[64..72].copy_from_slice(&0u64.to_le_bytes());
    grant[72..].copy_from_slice(&4096u64.to_le_bytes());
    sock.write_all(&req).unwrap();
    sock.write_all(&IPC_MARK.to_le_bytes()).unwrap();
    sock.write_all(&grant).unwrap();
    // The server ends the stream without an answer.
    let mut rest = Vec::new();
    let _ = sock.read_to_end(&mut rest);
    assert!(rest.is_empty(), "no answer to a forged grant");
    assert_eq!(fake.live_ipc_imports(), imports, "nothing was mapped");
    let mut got = vec![0u8; LEN];
    s.table.host.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&b| b == 0), "nothing was copied");
}

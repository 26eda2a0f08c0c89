//! The same-host plane's round trip below the engine: one process serves a 1 MiB segment and
//! opens a channel to itself (ring streams, or socket streams with `FERRY_SAME_HOST_RING=off`),
//! then awaits `N` WRITEs of `SIZE` bytes one at a time on a current-thread runtime and prints
//! p50 and p99 in microseconds. Run it under `perf stat -e raw_syscalls:sys_enter,context-switches`
//! to count what a round trip costs (docs/performance.md, issue 50).
//!
//! `cargo run --release -p ferry-transport-local --example ring_latency -- [N] [SIZE]`

use std::sync::Arc;
use std::time::Instant;

use ferry_core::wire::{Hello, Reject, TransportOffer, VECTORED_VERSION};
use ferry_core::{
    Access, Channel, Epoch, HandshakeResponder, MemoryRegion, Op, OpKind, PeerId, PeerInfo,
    RequestControl, SegmentDesc, SegmentLease, SegmentTable, SegmentToken,
};
use ferry_net::HandshakeLimits;
use ferry_transport_local::{LocalConfig, LocalServer, LocalTransport};

#[derive(Debug)]
struct Responder(Epoch);

impl HandshakeResponder for Responder {
    fn peer_id(&self) -> PeerId {
        PeerId(7)
    }
    fn epoch(&self) -> Epoch {
        self.0
    }
    fn respond(
        &self,
        _: &Hello,
        _: std::net::SocketAddr,
        _: Option<&str>,
    ) -> Result<Hello, Reject> {
        Err(Reject {
            reason: ferry_core::wire::RejectReason::Refused,
            versions: ferry_core::wire::SUPPORTED_VERSIONS,
            epoch: self.0,
            message: "attaches only".into(),
        })
    }
}

#[derive(Debug)]
struct Table(Arc<MemoryRegion>);

impl SegmentTable for Table {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        (token == SegmentToken(1)).then(|| SegmentLease {
            region: self.0.clone(),
            base: 0,
            len: 1 << 20,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            guard: None,
        })
    }
    fn published(&self) -> Vec<SegmentDesc> {
        Vec::new()
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let size: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(64);
    let epoch = Epoch::fresh();
    let segment = Arc::new(MemoryRegion::alloc_zeroed(1 << 20, 4096).expect("segment"));
    let h = LocalServer::bind()
        .expect("bind")
        .serve(
            Arc::new(Table(segment)),
            Arc::new(Responder(epoch)),
            HandshakeLimits::default(),
            16,
        )
        .expect("serve");
    let peer = PeerInfo {
        addr: "127.0.0.1:1".parse().expect("addr"),
        local_id: PeerId(1),
        local_epoch: Epoch::fresh(),
        remote_id: PeerId(7),
        remote_epoch: epoch,
        offer: TransportOffer::Local {
            boot_id: [0; 16],
            pid: std::process::id(),
            streams: 1,
            socket: h.name().to_owned(),
        },
        segments: Vec::new(),
        session: None,
        key_name: None,
        version: VECTORED_VERSION,
    };
    let transport = LocalTransport::new(LocalConfig {
        streams: 1,
        ..LocalConfig::default()
    });
    let ch = transport.connect_channel(&peer).expect("channel");
    let local = Arc::new(MemoryRegion::alloc_zeroed(1 << 20, 4096).expect("local"));
    let ops: Arc<[Op]> = vec![Op {
        kind: OpKind::Write,
        local,
        local_offset: 0,
        token: SegmentToken(1),
        remote_offset: 0,
        len: size,
    }]
    .into();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let mut lat = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        let t = Instant::now();
        let o = rt.block_on(ch.execute(ops.clone(), Arc::new(RequestControl::new(&ops))));
        assert!(o.failure.is_none(), "{o:?}");
        if i >= n / 10 {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    lat.sort_by(f64::total_cmp);
    println!(
        "{{\"ring_streams\":{},\"ops\":{n},\"size\":{size},\"p50_us\":{:.2},\"p99_us\":{:.2}}}",
        ch.ring_streams(),
        lat[lat.len() / 2],
        lat[lat.len() * 99 / 100]
    );
}

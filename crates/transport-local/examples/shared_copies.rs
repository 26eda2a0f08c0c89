//! Shared registrations against the owner's copies and memcpy (issue 50): one process serves a
//! 64 MiB segment allocated shareable (`MemoryRegion::alloc_shareable`) and opens two channels
//! to itself, one that maps it and copies one-sidedly, one with shared registrations off (the
//! owner copies: what every same-host copy was before), and compares, in alternating rounds:
//! requests of 16 READs or WRITEs of 64 KiB and of 64 of 1 MiB, waited one after another (GB/s),
//! one core's memcpy of the same blocks, and one 4 KiB WRITE awaited at a time (p50, us).
//! Prints one JSON line per case with medians over the rounds (docs/performance.md).
//!
//! `cargo run --release -p ferry-transport-local --example shared_copies -- [ROUNDS] [BYTES]`

use std::sync::Arc;
use std::time::Instant;

use ferry_core::wire::{Hello, Reject, TransportOffer, VECTORED_VERSION};
use ferry_core::{
    Access, Channel, Epoch, HandshakeResponder, MemoryRegion, Op, OpKind, PeerId, PeerInfo,
    RequestControl, SegmentDesc, SegmentLease, SegmentTable, SegmentToken,
};
use ferry_net::HandshakeLimits;
use ferry_transport_local::{LocalChannel, LocalConfig, LocalServer, LocalTransport};

/// Bytes of the segment and of the local buffer: 64 blocks of 1 MiB.
const SPAN: usize = 64 << 20;

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

/// Token 1: the shareable segment; token 2: the same bytes in plain memory (what memory Ferry
/// allocated was before: anonymous, huge pages advised), served by the owner's copies only.
#[derive(Debug)]
struct Table(Arc<MemoryRegion>, Arc<MemoryRegion>);

impl SegmentTable for Table {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        let region = match token.0 {
            1 => &self.0,
            2 => &self.1,
            _ => return None,
        };
        Some(SegmentLease {
            region: region.clone(),
            base: 0,
            len: SPAN as u64,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            guard: None,
        })
    }
    fn published(&self) -> Vec<SegmentDesc> {
        Vec::new()
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `"median [min-max]"` of the rounds.
fn spread(v: &[f64]) -> String {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    format!("{:.2} [{:.2}-{:.2}]", v[v.len() / 2], v[0], v[v.len() - 1])
}

/// Per round, `a / b`.
fn ratios(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x / y).collect()
}

/// GB/s of requests of `blocks` ops of `block` bytes, waited one after another, `bytes` in all.
fn rate(
    ch: &LocalChannel,
    token: SegmentToken,
    local: &Arc<MemoryRegion>,
    kind: OpKind,
    case: (u64, u64),
    bytes: u64,
) -> f64 {
    let (block, blocks) = case;
    let ops: Arc<[Op]> = (0..blocks)
        .map(|i| Op {
            kind,
            local: local.clone(),
            local_offset: i * block,
            token,
            remote_offset: i * block,
            len: block,
        })
        .collect::<Vec<_>>()
        .into();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let run = || {
        let o = rt.block_on(ch.execute(ops.clone(), Arc::new(RequestControl::new(&ops))));
        assert!(o.failure.is_none(), "{o:?}");
    };
    run();
    let n = (bytes / (block * blocks)).max(1);
    let t = Instant::now();
    for _ in 0..n {
        run();
    }
    (n * block * blocks) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// GB/s of one core's memcpy of the same blocks between two buffers of `SPAN` bytes.
fn memcpy(case: (u64, u64), bytes: u64) -> f64 {
    let (block, blocks) = case;
    let src = MemoryRegion::alloc_zeroed(SPAN, 4096).expect("src");
    let dst = MemoryRegion::alloc_zeroed(SPAN, 4096).expect("dst");
    let copy = || {
        for i in 0..blocks {
            dst.copy_from_region(i * block, &src, i * block, block)
                .expect("copy");
        }
    };
    copy();
    let n = (bytes / (block * blocks)).max(1);
    let t = Instant::now();
    for _ in 0..n {
        copy();
    }
    (n * block * blocks) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// p50 in microseconds of `n` 4 KiB WRITEs awaited one at a time.
fn small(ch: &LocalChannel, token: SegmentToken, local: &Arc<MemoryRegion>, n: usize) -> f64 {
    let ops: Arc<[Op]> = vec![Op {
        kind: OpKind::Write,
        local: local.clone(),
        local_offset: 0,
        token,
        remote_offset: 0,
        len: 4096,
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
    median(lat)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(3);
    let bytes: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1 << 30);
    let epoch = Epoch::fresh();
    let segment = Arc::new(MemoryRegion::alloc_shareable(SPAN).expect("a memfd"));
    let h = LocalServer::bind()
        .expect("bind")
        .serve(
            Arc::new(Table(
                segment,
                Arc::new(MemoryRegion::alloc_zeroed(SPAN, 4096).expect("plain")),
            )),
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
            streams: 2,
            socket: h.name().to_owned(),
        },
        segments: Vec::new(),
        session: None,
        key_name: None,
        version: VECTORED_VERSION,
    };
    let open = |shared: bool| {
        LocalTransport::new(LocalConfig {
            shared,
            ..LocalConfig::default()
        })
        .connect_channel(&peer)
        .expect("channel")
    };
    let (one, owner) = (open(true), open(false));
    assert!(
        matches!(one.map_shared(SegmentToken(1)), Some(Ok(_))),
        "not granted"
    );
    let local = Arc::new(MemoryRegion::alloc_zeroed(SPAN, 4096).expect("local"));
    let cases = [
        ("READ", OpKind::Read, (64u64 << 10, 16u64)),
        ("WRITE", OpKind::Write, (64 << 10, 16)),
        ("READ", OpKind::Read, (1 << 20, 64)),
        ("WRITE", OpKind::Write, (1 << 20, 64)),
    ];
    let (shared, plain) = (SegmentToken(1), SegmentToken(2));
    // rates[case][side]: one-sided on the memfd, the owner's copies of plain memory (before),
    // the owner's copies of the memfd (a peer that cannot map it), memcpy.
    let mut rates = vec![[Vec::new(), Vec::new(), Vec::new(), Vec::new()]; cases.len()];
    let mut lat = [Vec::new(), Vec::new(), Vec::new()];
    for round in 0..rounds {
        for side in (0..4).map(|s| (s + round) % 4) {
            for (c, (_, kind, case)) in cases.iter().enumerate() {
                let r = match side {
                    0 => rate(&one, shared, &local, *kind, *case, bytes),
                    1 => rate(&owner, plain, &local, *kind, *case, bytes),
                    2 => rate(&owner, shared, &local, *kind, *case, bytes),
                    _ => memcpy(*case, bytes),
                };
                rates[c][side].push(r);
            }
            match side {
                0 => lat[0].push(small(&one, shared, &local, 20_000)),
                1 => lat[1].push(small(&owner, plain, &local, 20_000)),
                2 => lat[2].push(small(&owner, shared, &local, 20_000)),
                _ => {}
            }
        }
    }
    for (c, (name, _, (block, blocks))) in cases.iter().enumerate() {
        let [a, b, o, m] = &rates[c];
        println!(
            "{{\"case\":\"{name} {blocks} x {} KiB\",\"one_sided_gbps\":\"{}\",\"owner_plain_gbps\":\"{}\",\"owner_memfd_gbps\":\"{}\",\"memcpy_gbps\":\"{}\",\"one_sided_per_memcpy\":\"{}\",\"one_sided_per_owner_plain\":\"{}\"}}",
            block >> 10,
            spread(a),
            spread(b),
            spread(o),
            spread(m),
            spread(&ratios(a, m)),
            spread(&ratios(a, b)),
        );
    }
    let [a, b, o] = &lat;
    println!(
        "{{\"case\":\"WRITE 1 x 4 KiB, awaited\",\"one_sided_p50_us\":\"{}\",\"owner_plain_p50_us\":\"{}\",\"owner_memfd_p50_us\":\"{}\",\"owner_plain_per_one_sided\":\"{}\",\"one_sided_ops\":{}}}",
        spread(a),
        spread(b),
        spread(o),
        spread(&ratios(b, a)),
        one.shared_use().map_or(0, |u| u.1)
    );
}

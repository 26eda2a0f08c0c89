//! Criterion benches of the frame codec: handshake encode/decode and data-plane headers.
#![allow(missing_docs)]

use criterion::{Criterion, black_box, criterion_group, criterion_main};
use ferry_core::wire::{
    ControlFrame, DATA_REQUEST_LEN, DataRequest, Hello, SUPPORTED_VERSIONS, TransportOffer,
};
use ferry_core::{Access, Epoch, OpKind, PeerId, SegmentDesc, SegmentToken};

fn hello(segments: usize) -> Hello {
    Hello {
        versions: SUPPORTED_VERSIONS,
        peer_id: PeerId(7),
        epoch: Epoch(9),
        transports: vec![TransportOffer::Tcp {
            streams: 2,
            port: 0,
        }],
        segments: (0..segments)
            .map(|i| SegmentDesc {
                name: format!("segment-{i}"),
                token: SegmentToken(i as u64 + 1),
                len: 1 << 30,
                access: Access::REMOTE_READ | Access::REMOTE_WRITE,
                remote_keys: vec![],
            })
            .collect(),
    }
}

fn bench(c: &mut Criterion) {
    let frame = ControlFrame::Hello(hello(1000));
    let mut buf = Vec::with_capacity(1 << 20);
    c.bench_function("hello_1000_segments_encode", |b| {
        b.iter(|| {
            buf.clear();
            black_box(&frame).encode(1, &mut buf).ok();
        })
    });
    let mut encoded = Vec::new();
    frame.encode(1, &mut encoded).ok();
    c.bench_function("hello_1000_segments_decode", |b| {
        b.iter(|| ControlFrame::decode(black_box(&encoded)))
    });
    let req = DataRequest {
        kind: OpKind::Write,
        seq: 1,
        token: SegmentToken(3),
        offset: 4096,
        len: 1 << 20,
        ack_slack: 0,
    };
    let mut h = [0u8; DATA_REQUEST_LEN];
    c.bench_function("data_request_encode_decode", |b| {
        b.iter(|| {
            black_box(&req).encode(&mut h);
            DataRequest::decode(black_box(&h))
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! Two processes over loopback: this test binary re-runs itself as a uring server child
//! (`FERRY_URING_CHILD=1`), publishes a read-write segment there, and the parent moves random data
//! to it and back with a uring and a TCP client; then kills the child mid-WRITE.

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use common::*;
use ferry_core::{
    Access, Channel, Epoch, FailureKind, MemoryRegion, OpKind, PeerId, RemoteEffect, SegmentToken,
    Transport,
};
use ferry_transport_uring::{UringConfig, UringServer, UringTransport, ZeroCopy, block_on};

const SEG: usize = 64 << 20;

/// Runs as the server when this binary is started as the child (else does nothing).
#[test]
fn child_server() {
    if std::env::var_os("FERRY_URING_CHILD").is_none() {
        return;
    }
    let t = UringTransport::new(UringConfig::default()).unwrap();
    let table = Arc::new(Table::default());
    let (tok, _region) = publish(
        &table,
        "seg",
        SEG,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
    );
    let server = UringServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = server.local_addr();
    let responder = Arc::new(Responder {
        id: PeerId::random(),
        epoch: Epoch::fresh(),
        versions: ferry_core::wire::SUPPORTED_VERSIONS,
        table: table.clone(),
        offer: t.offer(),
    });
    let _h = server.serve(table, responder, t.config().clone()).unwrap();
    println!("LISTEN {addr} {}", tok.0);
    loop {
        std::thread::park();
    }
}

struct ChildServer {
    child: Child,
    addr: SocketAddr,
    token: SegmentToken,
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_server() -> ChildServer {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_server", "--nocapture", "--test-threads=1"])
        .env("FERRY_URING_CHILD", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    let line = loop {
        let l = lines
            .next()
            .expect("child exited before listening")
            .unwrap();
        // libtest prints "test child_server ... " before the test's own output.
        if let Some(i) = l.find("LISTEN ") {
            break l[i..].to_owned();
        }
    };
    let mut parts = line.split_whitespace().skip(1);
    let addr = parts.next().unwrap().parse().unwrap();
    let token = SegmentToken(parts.next().unwrap().parse().unwrap());
    ChildServer { child, addr, token }
}

fn open(addr: SocketAddr, uring: bool, zc: ZeroCopy, chunk: u64) -> Arc<dyn Channel> {
    let t: Arc<dyn Transport> = if uring {
        Arc::new(
            UringTransport::new(UringConfig {
                streams: 2,
                chunk_size: chunk,
                zero_copy: zc,
                splice_loopback: zc == ZeroCopy::Auto,
                ..UringConfig::default()
            })
            .unwrap(),
        )
    } else {
        Arc::new(ferry_transport_tcp::TcpTransport::new(
            ferry_transport_tcp::TcpConfig {
                streams: 2,
                chunk_size: chunk,
                ..ferry_transport_tcp::TcpConfig::default()
            },
        ))
    };
    let peer = peer_info(addr, t.offer());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // The TCP transport's tasks need a runtime that outlives the channel: leak it for the test.
    let ch = rt.block_on(t.open(peer)).unwrap();
    std::mem::forget(rt);
    ch
}

#[test]
fn write_then_read_back_random_data_across_processes() {
    if std::env::var_os("FERRY_URING_CHILD").is_some() || !uring_usable() {
        return;
    }
    let server = spawn_server();
    let src = Arc::new(MemoryRegion::alloc_zeroed(SEG, 4096).unwrap());
    fill(&src, 99);
    let dst = Arc::new(MemoryRegion::alloc_zeroed(SEG, 4096).unwrap());
    for (uring, zc) in [
        (true, ZeroCopy::Auto),
        (true, ZeroCopy::Always),
        (true, ZeroCopy::Never),
        (false, ZeroCopy::Never),
    ] {
        let ch = open(server.addr, uring, zc, 1 << 20);
        for &(lo, ro, len) in &[
            (0u64, 0u64, 1u64),
            (1, 7, 4095),
            (4097, 3, 1 << 20),
            (11, 65_537, 5_000_001),
            (3, 1, (SEG - 8) as u64),
        ] {
            let o = block_on(run(
                &ch,
                vec![op(OpKind::Write, &src, lo, server.token, ro, len)],
            ));
            assert!(o.is_success() && o.drained, "uring {uring} {zc:?}: {o:?}");
            dst.write_at(0, &vec![0u8; SEG]).unwrap();
            let o = block_on(run(
                &ch,
                vec![op(OpKind::Read, &dst, lo + 2, server.token, ro, len)],
            ));
            assert!(o.is_success() && o.drained, "uring {uring} {zc:?}: {o:?}");
            assert!(
                bytes(&dst, lo + 2, len as usize) == bytes(&src, lo, len as usize),
                "uring {uring} {zc:?}: {lo} {ro} {len}"
            );
        }
    }
}

#[test]
fn peer_killed_mid_write_is_uncertain_with_the_right_prefix() {
    if std::env::var_os("FERRY_URING_CHILD").is_some() || !uring_usable() {
        return;
    }
    for zc in [ZeroCopy::Auto, ZeroCopy::Always, ZeroCopy::Never] {
        let mut server = spawn_server();
        let ch = open(server.addr, true, zc, 64 << 10);
        let src = Arc::new(MemoryRegion::alloc_zeroed(SEG, 4096).unwrap());
        let ops = vec![
            op(OpKind::Write, &src, 0, server.token, 0, 4096),
            op(OpKind::Write, &src, 0, server.token, 0, SEG as u64),
            op(OpKind::Write, &src, 0, server.token, 0, SEG as u64),
            op(OpKind::Write, &src, 0, server.token, 0, SEG as u64),
        ];
        let ops: Arc<[ferry_core::Op]> = ops.into();
        let control = Arc::new(ferry_core::RequestControl::new(&ops));
        let fut = ch.execute(ops, control.clone());
        // Kill the server once the first op is acknowledged and more is on the wire.
        while control.outcome(false).completed_ops < 1 {
            std::thread::yield_now();
        }
        server.child.kill().unwrap();
        let o = block_on(fut);
        assert!(o.drained);
        assert!(o.completed_ops >= 1 && o.completed_ops < 4, "{zc:?}: {o:?}");
        let f = o
            .failure
            .expect("the request cannot succeed with the peer killed");
        assert_eq!(f.kind, FailureKind::PeerLost, "{zc:?}: {o:?}");
        assert_eq!(o.remote_effect, RemoteEffect::Uncertain, "{zc:?}: {o:?}");
        assert_eq!(
            o.completed_bytes,
            4096 + (o.completed_ops as u64 - 1) * SEG as u64
        );
    }
}

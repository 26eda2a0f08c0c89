//! A peer that goes away while loopback WRITE payloads are being spliced must not raise SIGPIPE
//! at the process: splice(2) has no MSG_NOSIGNAL. Its own test binary, because it restores the
//! default SIGPIPE action (terminate), which Rust's runtime otherwise ignores for every test.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;

use common::*;
use ferry_core::{
    Access, Channel, Epoch, FailureKind, MemoryRegion, OpKind, PeerId, RequestControl, Transport,
};
use ferry_transport_uring::{UringConfig, UringServer, UringTransport, block_on};

const SEG: usize = 64 << 20;

#[test]
fn a_peer_gone_mid_splice_fails_the_request_without_killing_the_process() {
    if !uring_usable() {
        return;
    }
    let client = UringTransport::new(UringConfig::default()).unwrap();
    if !client.config().kernel_splice {
        ferry_tests::require_or_skip(
            ferry_tests::URING,
            "the kernel lacks io_uring SPLICE, so loopback WRITEs are not spliced",
        );
        return;
    }
    // SAFETY: restoring the default action of SIGPIPE; this binary holds only this test.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    for round in 0..5 {
        let table = Arc::new(Table::default());
        let (token, _dst) = publish(&table, "dst", SEG, Access::REMOTE_WRITE);
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let server = UringServer::bind(addr).unwrap();
        let addr = server.local_addr();
        let responder = Arc::new(Responder {
            id: PeerId::random(),
            epoch: Epoch::fresh(),
            versions: ferry_core::wire::SUPPORTED_VERSIONS,
            table: table.clone(),
            offer: client.offer(),
        });
        let handle = server
            .serve(table.clone(), responder, client.config().clone())
            .unwrap();
        let ch: Arc<dyn Channel> = Arc::new(
            client
                .connect_channel_blocking(peer_info(addr, client.offer()))
                .unwrap(),
        );
        let src = Arc::new(MemoryRegion::alloc_zeroed(SEG, 4096).unwrap());
        let ops: Vec<_> = (0..8)
            .map(|_| op(OpKind::Write, &src, 0, token, 0, SEG as u64))
            .collect();
        let ops: Arc<[ferry_core::Op]> = ops.into();
        let control = Arc::new(RequestControl::new(&ops));
        let fut = ch.execute(ops, control.clone());
        // Stop the server once payload is on the wire: its end closes with bytes unread.
        while control.outcome(false).completed_ops < 1 {
            std::thread::yield_now();
        }
        handle.shutdown();
        let o = block_on(fut);
        assert!(o.drained, "round {round}: {o:?}");
        let f = o
            .failure
            .expect("the request cannot succeed with the server gone");
        assert_eq!(f.kind, FailureKind::PeerLost, "round {round}: {o:?}");
        assert!(o.completed_ops < 8, "round {round}: {o:?}");
    }
}

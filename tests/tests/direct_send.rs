//! The io_uring client's direct sends: a request of one small chunk submitted while a stream is
//! idle is written by the submitting thread itself (no hand-over to the stream's thread), and
//! whatever the kernel does not take at once is sent by the stream's thread before anything
//! else. Both must keep each stream's requests in sequence order and their bytes whole, whoever
//! sends them; the io_uring server checks the order (a request out of sequence closes the
//! stream) and the bytes are compared at the end.
//!
//! With `UringConfig::caller_receives` the task that awaits a small WRITE or READ sent directly
//! reads its response (and a READ's payload) itself; the stream's ring takes the reading over
//! when it takes a later request or when the response waits unread for a tick, and gets it back
//! when that task's future is dropped or the stream ends.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::*;
use ferry_core::wire::{
    ControlFrame, DATA_REQUEST_LEN, DATA_RESPONSE_LEN, DataRequest, DataResponse,
    SUPPORTED_VERSIONS, TransportOffer,
};
use ferry_core::{
    Access, Channel, Epoch, MemoryRegion, Op, OpKind, PeerId, PeerInfo, RequestControl,
    SegmentToken, Transport,
};
use ferry_transport_uring::{UringConfig, UringTransport};

/// A one-stream io_uring channel (with `config`) to an io_uring server (with `server`) that
/// publishes `len` bytes; returns the channel, its transport and the server's segment.
async fn setup(
    config: UringConfig,
    server: UringConfig,
    len: usize,
) -> (
    Arc<dyn Channel>,
    Arc<UringTransport>,
    ferry_core::SegmentToken,
    Arc<MemoryRegion>,
    ferry_transport_uring::UringServerHandle,
) {
    let table = Arc::new(Table::default());
    let (tok, remote) = publish(
        &table,
        "seg",
        len,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
    );
    let handle = serve_uring(&table, server);
    let addr = handle.local_addr();
    let t = Arc::new(UringTransport::new(config).unwrap());
    let offer = t.offer();
    let peer = tokio::task::spawn_blocking(move || peer_info(addr, offer))
        .await
        .unwrap();
    let ch = t.open(peer).await.unwrap();
    (ch, t, tok, remote, handle)
}

/// Many tasks submit small WRITEs and READs to one stream at once: some go out from their
/// submitters, some through the stream's thread, and every one completes with its bytes where
/// they belong; with the awaiting tasks reading their WRITEs' responses and without.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_submitters_keep_one_streams_order() {
    if !uring_usable() {
        return;
    }
    for caller_receives in [false, true] {
        concurrent_submitters(caller_receives).await;
    }
}

async fn concurrent_submitters(caller_receives: bool) {
    const TASKS: u64 = 8;
    const EACH: u64 = 200;
    const OP: u64 = 64;
    let len = (TASKS * EACH * OP) as usize;
    let config = UringConfig {
        streams: 1,
        depth: 4,
        caller_receives,
        ..UringConfig::default()
    };
    let (ch, t, tok, remote, _server) = setup(config.clone(), config, len).await;
    let src = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
    fill(&src, 7);
    let back = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
    let mut tasks = Vec::new();
    for k in 0..TASKS {
        let (ch, src, back) = (ch.clone(), src.clone(), back.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..EACH {
                let at = (k * EACH + i) * OP;
                let w = run(&ch, vec![op(OpKind::Write, &src, at, tok, at, OP)]).await;
                assert!(w.is_success() && w.drained, "write {k}/{i}: {w:?}");
                let r = run(&ch, vec![op(OpKind::Read, &back, at, tok, at, OP)]).await;
                assert!(r.is_success() && r.drained, "read {k}/{i}: {r:?}");
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert!(
        ch.is_alive(),
        "a request out of order would have closed the stream"
    );
    assert!(
        bytes(&remote, 0, len) == bytes(&src, 0, len),
        "remote bytes differ"
    );
    assert!(
        bytes(&back, 0, len) == bytes(&src, 0, len),
        "bytes read back differ"
    );
    let direct = t.stats().direct_sends.load(Ordering::Relaxed);
    assert!(direct > 0, "no request was sent by its submitter");
    // With the switch on, how many responses the awaiting tasks read themselves depends on
    // how the tasks interleave (the stream thread takes the reading over whenever it takes a
    // dealt request); `small_requests_on_an_idle_stream_are_completed_by_the_awaiting_task`
    // counts them where nothing competes.
    if !caller_receives {
        let caller = t.stats().caller_receives.load(Ordering::Relaxed);
        assert_eq!(
            caller, 0,
            "a response was read by its task with the switch off"
        );
    }
}

/// One WRITE request of `len` bytes at `at` (both sides), not yet awaited.
fn write_at(
    ch: &Arc<dyn Channel>,
    src: &Arc<MemoryRegion>,
    tok: SegmentToken,
    at: u64,
    len: u64,
) -> ferry_core::BoxFuture<'static, ferry_core::Outcome> {
    request(ch, OpKind::Write, src, tok, at, len)
}

/// One request of one op of `kind` and `len` bytes at `at` (both sides), not yet awaited.
fn request(
    ch: &Arc<dyn Channel>,
    kind: OpKind,
    local: &Arc<MemoryRegion>,
    tok: SegmentToken,
    at: u64,
    len: u64,
) -> ferry_core::BoxFuture<'static, ferry_core::Outcome> {
    let ops: Arc<[Op]> = vec![op(kind, local, at, tok, at, len)].into();
    let control = Arc::new(RequestControl::new(&ops));
    ch.execute(ops, control)
}

/// 64-byte WRITEs at `at` until one's response was read by the task awaiting it (for at most
/// 60 s): the stream's thread, which such a round trip does not wake, then sleeps on its ring,
/// so the next small request on the stream is sent directly. (While the thread has not gone
/// back to its wait, after the channel opened or after a response it read, a submitter deals
/// its request instead; on a loaded machine that can last many round trips, so each try first
/// lets the thread run.)
async fn settle(
    ch: &Arc<dyn Channel>,
    t: &UringTransport,
    src: &Arc<MemoryRegion>,
    tok: SegmentToken,
    at: u64,
) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut tries = 0u32;
    while std::time::Instant::now() < deadline {
        let o = write_at(ch, src, tok, at, 64).await;
        assert!(o.is_success(), "{o:?}");
        tries += 1;
        if t.stats().caller_receives.load(Ordering::Relaxed) > 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    panic!("no response of {tries} in 60 s was read by the task awaiting it");
}

/// Readers relieved so far: handed back, or taken over by the ring's tick.
fn relieved(s: &ferry_transport_uring::IoStats) -> u64 {
    s.caller_handbacks.load(Ordering::Relaxed) + s.caller_takeovers.load(Ordering::Relaxed)
}

/// A small request made by `make` that went out from its submitter, its task the stream's
/// reader: the stream is settled first, and a request made while the stream's ring held the
/// stream's lock (its tick, say) is dealt instead, so it is awaited and another made. Returns
/// it with the readers relieved and the responses read by their tasks just before it.
async fn direct_request(
    ch: &Arc<dyn Channel>,
    t: &UringTransport,
    src: &Arc<MemoryRegion>,
    tok: SegmentToken,
    make: impl Fn() -> ferry_core::BoxFuture<'static, ferry_core::Outcome>,
) -> (
    ferry_core::BoxFuture<'static, ferry_core::Outcome>,
    u64,
    u64,
) {
    for _ in 0..100 {
        settle(ch, t, src, tok, 0).await;
        let s = t.stats();
        let (sent, before, read) = (
            s.direct_sends.load(Ordering::Relaxed),
            relieved(s),
            s.caller_receives.load(Ordering::Relaxed),
        );
        let f = make();
        if s.direct_sends.load(Ordering::Relaxed) == sent + 1 {
            return (f, before, read);
        }
        let o = f.await;
        assert!(o.is_success(), "{o:?}");
    }
    panic!("no request of 100 went out from its submitter");
}

/// Round trips one at a time on an idle stream, WRITEs then READs: every response is read by
/// the task awaiting it (a READ's payload too), none by the stream's thread, and the bytes land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_requests_on_an_idle_stream_are_completed_by_the_awaiting_task() {
    if !uring_usable() {
        return;
    }
    const N: u64 = 50;
    const OP: u64 = 64;
    let config = UringConfig {
        streams: 1,
        caller_receives: true,
        ..UringConfig::default()
    };
    const BIG: usize = 64 << 10;
    let (ch, t, tok, remote, _server) = setup(config.clone(), config, BIG).await;
    let src = Arc::new(MemoryRegion::alloc_zeroed((N * OP) as usize, 4096).unwrap());
    fill(&src, 5);
    for i in 0..N {
        let o = write_at(&ch, &src, tok, i * OP, OP).await;
        assert!(o.is_success() && o.drained, "write {i}: {o:?}");
    }
    let back = Arc::new(MemoryRegion::alloc_zeroed((N * OP) as usize, 4096).unwrap());
    for i in 0..N {
        let o = request(&ch, OpKind::Read, &back, tok, i * OP, OP).await;
        assert!(o.is_success() && o.drained, "read {i}: {o:?}");
    }
    // Every request sent directly (all but, at most, those racing the stream's ring's first
    // look at the queue) had its response read by its own task, or (a task not run within a
    // tick, on a loaded machine) by the ring's takeover.
    let s = t.stats();
    let direct = s.direct_sends.load(Ordering::Relaxed);
    assert!(direct > N, "{direct} of {} sent directly", 2 * N);
    let read = |s: &ferry_transport_uring::IoStats| {
        s.caller_receives.load(Ordering::Relaxed) + s.caller_takeovers.load(Ordering::Relaxed)
    };
    assert_eq!(read(s), direct);
    assert_eq!(s.caller_handbacks.load(Ordering::Relaxed), 0);
    assert!(bytes(&remote, 0, (N * OP) as usize) == bytes(&src, 0, (N * OP) as usize));
    assert!(bytes(&back, 0, (N * OP) as usize) == bytes(&src, 0, (N * OP) as usize));
    // A READ of more than 16 KiB is read by the stream's thread (in one wait, not in pieces).
    let big = Arc::new(MemoryRegion::alloc_zeroed(BIG, 4096).unwrap());
    let o = request(&ch, OpKind::Read, &big, tok, 0, BIG as u64).await;
    assert!(o.is_success() && o.drained, "{o:?}");
    assert_eq!(read(s), direct);
    assert!(bytes(&big, 0, BIG) == bytes(&remote, 0, BIG));
    // Off, the stream's thread reads every response.
    let off = UringConfig {
        streams: 1,
        caller_receives: false,
        ..UringConfig::default()
    };
    let (ch, t, tok, _remote, _server) = setup(off.clone(), off, OP as usize).await;
    let o = write_at(&ch, &src, tok, 0, OP).await;
    assert!(o.is_success(), "{o:?}");
    assert_eq!(t.stats().caller_receives.load(Ordering::Relaxed), 0);
}

/// The default (`caller_receives` on) on a runtime built without I/O: the first direct
/// request finds it out (the reactor's registration panics, caught and not printed) and hands
/// its response to the stream's ring; the runtime is remembered, so later requests are read by
/// the ring from the start, not handed back one by one. Every request completes.
#[test]
fn a_runtime_without_io_has_its_responses_read_by_the_ring() {
    if !uring_usable() {
        return;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        const N: u64 = 20;
        const OP: u64 = 64;
        let config = UringConfig {
            streams: 1,
            ..UringConfig::default()
        };
        assert!(config.caller_receives, "on by default");
        let (ch, t, tok, remote, _server) = setup(config.clone(), config, (N * OP) as usize).await;
        let src = Arc::new(MemoryRegion::alloc_zeroed((N * OP) as usize, 4096).unwrap());
        fill(&src, 3);
        for i in 0..N {
            let o = write_at(&ch, &src, tok, i * OP, OP).await;
            assert!(o.is_success() && o.drained, "write {i}: {o:?}");
        }
        let s = t.stats();
        assert_eq!(s.caller_receives.load(Ordering::Relaxed), 0);
        // Requests sent directly (the stream idle, its ring back in its wait), each of which
        // would have been handed back had the runtime not been remembered.
        let direct = s.direct_sends.load(Ordering::Relaxed);
        let handed = s.caller_handbacks.load(Ordering::Relaxed);
        assert!(direct >= 2, "{direct} of {N} sent directly");
        assert!(
            handed <= 1,
            "{handed} of {direct} sent directly handed back"
        );
        assert!(bytes(&remote, 0, (N * OP) as usize) == bytes(&src, 0, (N * OP) as usize));
    });
}

/// A direct WRITE (then READ) whose future is not polled while a later request on the same
/// stream is awaited (one thread runs both): the stream's thread takes the reading over, so the
/// later one completes, and so does the first when it is awaited at last.
#[tokio::test(flavor = "current_thread")]
async fn a_later_request_takes_the_reading_over_from_a_direct_request_not_awaited() {
    if !uring_usable() {
        return;
    }
    for kind in [OpKind::Write, OpKind::Read] {
        takeover(kind).await;
    }
}

async fn takeover(kind: OpKind) {
    const OP: u64 = 64;
    let config = UringConfig {
        streams: 1,
        caller_receives: true,
        ..UringConfig::default()
    };
    let (ch, t, tok, remote, _server) = setup(config.clone(), config, 2 * OP as usize).await;
    let src = Arc::new(MemoryRegion::alloc_zeroed(2 * OP as usize, 4096).unwrap());
    fill(&src, 9);
    let back = Arc::new(MemoryRegion::alloc_zeroed(OP as usize, 4096).unwrap());
    let (first, before, read) = direct_request(&ch, &t, &src, tok, || match kind {
        OpKind::Read => request(&ch, kind, &back, tok, 0, OP),
        _ => write_at(&ch, &src, tok, 0, OP),
    })
    .await;
    let second = write_at(&ch, &src, tok, OP, OP);
    let limit = std::time::Duration::from_secs(20);
    let o = tokio::time::timeout(limit, second)
        .await
        .expect("the later request waits on the first one's reader");
    assert!(o.is_success() && o.drained, "second: {o:?}");
    let o = tokio::time::timeout(limit, first).await.expect("first");
    assert!(o.is_success() && o.drained, "first: {o:?}");
    let s = t.stats();
    // The later request took the reading over, or (a slow machine) the ring's tick did first.
    assert_eq!(relieved(s), before + 1);
    assert_eq!(s.caller_receives.load(Ordering::Relaxed), read);
    assert!(ch.is_alive());
    assert!(bytes(&remote, 0, 2 * OP as usize) == bytes(&src, 0, 2 * OP as usize));
    if kind == OpKind::Read {
        assert!(bytes(&back, 0, OP as usize) == bytes(&src, 0, OP as usize));
    }
}

/// A direct WRITE (then READ) whose future is dropped before it read its response hands the
/// reading back to the stream's thread, which reads it (a READ's payload into place); the
/// stream goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_direct_request_hands_its_response_back_to_the_stream_thread() {
    if !uring_usable() {
        return;
    }
    for kind in [OpKind::Write, OpKind::Read] {
        dropped(kind).await;
    }
}

async fn dropped(kind: OpKind) {
    const OP: u64 = 64;
    let config = UringConfig {
        streams: 1,
        caller_receives: true,
        ..UringConfig::default()
    };
    let (ch, t, tok, remote, _server) = setup(config.clone(), config, 2 * OP as usize).await;
    let src = Arc::new(MemoryRegion::alloc_zeroed(2 * OP as usize, 4096).unwrap());
    fill(&src, 4);
    let back = Arc::new(MemoryRegion::alloc_zeroed(OP as usize, 4096).unwrap());
    let (first, before, _) = direct_request(&ch, &t, &src, tok, || match kind {
        OpKind::Read => request(&ch, kind, &back, tok, 0, OP),
        _ => write_at(&ch, &src, tok, 0, OP),
    })
    .await;
    drop(first);
    // Handed back at the drop, unless (a slow machine) the ring's tick took it over first.
    assert_eq!(relieved(t.stats()), before + 1);
    let limit = std::time::Duration::from_secs(20);
    let o = tokio::time::timeout(limit, write_at(&ch, &src, tok, OP, OP))
        .await
        .expect("the stream serves on");
    assert!(o.is_success() && o.drained, "{o:?}");
    assert!(ch.is_alive());
    assert!(bytes(&remote, 0, 2 * OP as usize) == bytes(&src, 0, 2 * OP as usize));
    // Responses come in order: the dropped READ's landed before the later request's.
    if kind == OpKind::Read {
        assert!(bytes(&back, 0, OP as usize) == bytes(&src, 0, OP as usize));
    }
}

/// A direct WRITE (then READ) whose future is never polled still completes: its response waits
/// unread for a tick, then the stream's ring reads it (a READ's payload into place); the future,
/// polled at last, is ready at once.
#[tokio::test(flavor = "current_thread")]
async fn a_direct_request_never_polled_is_completed_by_the_ring() {
    if !uring_usable() {
        return;
    }
    for kind in [OpKind::Write, OpKind::Read] {
        never_polled(kind).await;
    }
}

async fn never_polled(kind: OpKind) {
    const OP: u64 = 64;
    let config = UringConfig {
        streams: 1,
        caller_receives: true,
        ..UringConfig::default()
    };
    let (ch, t, tok, remote, _server) = setup(config.clone(), config, OP as usize).await;
    let src = Arc::new(MemoryRegion::alloc_zeroed(OP as usize, 4096).unwrap());
    fill(&src, 6);
    let back = Arc::new(MemoryRegion::alloc_zeroed(OP as usize, 4096).unwrap());
    let (mut first, before, _) = direct_request(&ch, &t, &src, tok, || match kind {
        OpKind::Read => request(&ch, kind, &back, tok, 0, OP),
        _ => write_at(&ch, &src, tok, 0, OP),
    })
    .await;
    // Nothing polls the request on this (only) thread: wait for the ring to take it.
    let end = std::time::Instant::now() + std::time::Duration::from_secs(20);
    // (Nothing is dropped or polled, so the one reader relieved is taken over.)
    while relieved(t.stats()) == before {
        assert!(
            std::time::Instant::now() < end,
            "the ring never read the unread response"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    // The ring reads the response it took over; the future, polled, is then ready.
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let o = loop {
        if let std::task::Poll::Ready(o) = first.as_mut().poll(&mut cx) {
            break o;
        }
        assert!(
            std::time::Instant::now() < end,
            "taken over by the ring, yet the request never completed"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    };
    assert!(o.is_success() && o.drained, "{o:?}");
    assert!(ch.is_alive());
    assert!(bytes(&remote, 0, OP as usize) == bytes(&src, 0, OP as usize));
    if kind == OpKind::Read {
        assert!(bytes(&back, 0, OP as usize) == bytes(&src, 0, OP as usize));
    }
}

/// Accepts one stream on `l`, answering its attach.
fn accept_stream(l: &TcpListener) -> std::net::TcpStream {
    let (mut s, _) = l.accept().unwrap();
    let mut head = [0u8; ferry_core::wire::CONTROL_HEADER_LEN];
    s.read_exact(&mut head).unwrap();
    let h = ferry_core::wire::ControlHeader::decode(&head).unwrap();
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).unwrap();
    let mut out = Vec::new();
    ControlFrame::StreamAccept
        .encode(SUPPORTED_VERSIONS.max, &mut out)
        .unwrap();
    s.write_all(&out).unwrap();
    s
}

/// A direct send the kernel takes only in part (the peer reads nothing yet and both socket
/// buffers are as small as the kernel allows): the stream's thread sends the rest, and the
/// peer sees that request whole and then the next one, in sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_send_the_kernel_takes_in_part_is_finished_by_the_stream_thread() {
    if !uring_usable() {
        return;
    }
    const OP: usize = (16 << 10) - DATA_REQUEST_LEN;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let small: libc::c_int = 1;
    // SAFETY: setting an int socket option on a listener we own; accepted sockets inherit it.
    let rc = unsafe {
        libc::setsockopt(
            l.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&small as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
    let addr = l.local_addr().unwrap();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let src = Arc::new(MemoryRegion::alloc_zeroed(2 * OP, 4096).unwrap());
    fill(&src, 3);
    let expect = bytes(&src, 0, 2 * OP);
    let server = std::thread::spawn(move || {
        let mut s = accept_stream(&l);
        let mut seqs = Vec::new();
        for k in 0..2usize {
            // Nothing is read before the client's first send returned.
            if k == 0 {
                go_rx.recv().unwrap();
            }
            let mut h = [0u8; DATA_REQUEST_LEN];
            s.read_exact(&mut h).unwrap();
            let r = DataRequest::decode(&h).unwrap();
            let mut payload = vec![0u8; r.len as usize];
            s.read_exact(&mut payload).unwrap();
            assert!(
                payload == expect[k * OP..(k + 1) * OP],
                "payload {k} differs"
            );
            let mut b = [0u8; DATA_RESPONSE_LEN];
            DataResponse {
                seq: r.seq,
                refused: None,
                len: 0,
                also_acks: 0,
            }
            .encode(&mut b);
            s.write_all(&b).unwrap();
            seqs.push(r.seq);
        }
        // The stream stays open until the client looked at it.
        done_rx.recv().unwrap();
        seqs
    });
    let t = UringTransport::new(UringConfig {
        streams: 1,
        depth: 4,
        socket_buffer: Some(1),
        ..UringConfig::default()
    })
    .unwrap();
    let ch = t
        .open(PeerInfo {
            addr,
            local_id: PeerId::random(),
            local_epoch: Epoch::fresh(),
            remote_id: PeerId::random(),
            remote_epoch: Epoch(1),
            offer: TransportOffer::Tcp {
                streams: 1,
                port: 0,
            },
            segments: vec![],
            session: None,
            key_name: None,
            version: ferry_core::wire::SUPPORTED_VERSIONS.max,
        })
        .await
        .unwrap();
    for k in 0..2u64 {
        let ops: Arc<[Op]> = vec![op(
            OpKind::Write,
            &src,
            k * OP as u64,
            SegmentToken(9),
            0,
            OP as u64,
        )]
        .into();
        let control = Arc::new(RequestControl::new(&ops));
        // The send happens in `execute`, before the future is polled.
        let fut = ch.execute(ops, control);
        if k == 0 {
            let s = t.stats();
            assert_eq!(
                s.direct_sends.load(Ordering::Relaxed),
                1,
                "not sent directly"
            );
            assert_eq!(
                s.direct_tails.load(Ordering::Relaxed),
                1,
                "the kernel took {OP} bytes at once"
            );
            go_tx.send(()).unwrap();
        }
        let o = fut.await;
        assert!(o.is_success() && o.drained, "write {k}: {o:?}");
    }
    assert!(ch.is_alive());
    done_tx.send(()).unwrap();
    assert_eq!(server.join().unwrap(), [0, 1]);
}

/// The peer closes the stream instead of answering a WRITE whose response the awaiting task
/// reads: the request fails (it does not hang) and the channel is seen dead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_closes_instead_of_answering_a_direct_write_fails_it() {
    if !uring_usable() {
        return;
    }
    const OP: u64 = 64;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let mut s = accept_stream(&l);
        loop {
            let mut h = [0u8; DATA_REQUEST_LEN];
            s.read_exact(&mut h).unwrap();
            let r = DataRequest::decode(&h).unwrap();
            let mut payload = vec![0u8; r.len as usize];
            s.read_exact(&mut payload).unwrap();
            if r.len != OP {
                // Closed without a response.
                return;
            }
            let mut b = [0u8; DATA_RESPONSE_LEN];
            DataResponse {
                seq: r.seq,
                refused: None,
                len: 0,
                also_acks: 0,
            }
            .encode(&mut b);
            s.write_all(&b).unwrap();
        }
    });
    let t = UringTransport::new(UringConfig {
        streams: 1,
        caller_receives: true,
        ..UringConfig::default()
    })
    .unwrap();
    let ch = t
        .open(PeerInfo {
            addr,
            local_id: PeerId::random(),
            local_epoch: Epoch::fresh(),
            remote_id: PeerId::random(),
            remote_epoch: Epoch(1),
            offer: TransportOffer::Tcp {
                streams: 1,
                port: 0,
            },
            segments: vec![],
            session: None,
            key_name: None,
            version: ferry_core::wire::SUPPORTED_VERSIONS.max,
        })
        .await
        .unwrap();
    let src = Arc::new(MemoryRegion::alloc_zeroed(2 * OP as usize, 4096).unwrap());
    settle(&ch, &t, &src, SegmentToken(9), 0).await;
    let sent = t.stats().direct_sends.load(Ordering::Relaxed);
    let fut = write_at(&ch, &src, SegmentToken(9), 0, 2 * OP);
    assert_eq!(t.stats().direct_sends.load(Ordering::Relaxed), sent + 1);
    let o = tokio::time::timeout(std::time::Duration::from_secs(20), fut)
        .await
        .expect("a closed stream's request hangs");
    assert!(!o.is_success(), "{o:?}");
    server.join().unwrap();
    // The stream's thread marks the stream dead before it fails what was in flight.
    assert!(
        !ch.is_alive(),
        "the channel is still alive after its stream ended"
    );
    assert_eq!(t.stats().caller_handbacks.load(Ordering::Relaxed), 1);
}

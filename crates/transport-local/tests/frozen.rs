//! A stopped (`SIGSTOP`) same-host server and a channel closed under its requests: the
//! requests end after the close's grace, and when the server runs again it copies nothing into
//! this process, neither the READ it had checked before it stopped (its file source stops the
//! server between the check and the copy) nor the READs it had not read yet: the channel
//! revoked copies into this process (it is not dumpable) before it gave the streams up, until
//! the server ended them. The channel runs on the request/answer ring (the default), and small
//! READs whose bytes would come inline through it land nothing either.
//! Alone in its binary: the revocation is the whole process's. The server is this binary run
//! again (`FERRY_TEST_CHILD=local-frozen-server`).

mod common;
use common::{Responder, peer_at};

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_core::{
    Access, Channel, Epoch, MemoryRegion, Op, OpKind, RequestControl, SegmentDesc, SegmentLease,
    SegmentTable, SegmentToken,
};
use ferry_net::HandshakeLimits;
use ferry_transport_local::{LocalConfig, LocalServer, LocalTransport};

const LEN: usize = 4 << 20;
const TOKEN: SegmentToken = SegmentToken(1);
/// A file segment whose first read stops the whole server (`SIGSTOP` to itself), then fills.
const STOPPING: SegmentToken = SegmentToken(2);

#[derive(Debug, Default)]
struct StopOnce(std::sync::atomic::AtomicBool);

impl ferry_core::FileSource for StopOnce {
    fn check(&self, _: OpKind, offset: u64, _: u64) -> Result<u64, ferry_core::RemoteStatus> {
        Ok(offset)
    }
    fn read_exact_at(&self, _: u64, buf: &mut [u8]) -> std::io::Result<()> {
        if !self.0.swap(true, std::sync::atomic::Ordering::AcqRel) {
            // SAFETY: raise(3) with a valid signal: the process stops here, between the
            // server's check of the request and its copy, until it is continued.
            unsafe { libc::raise(libc::SIGSTOP) };
        }
        buf.fill(0xcd);
        Ok(())
    }
    fn write_all_at(&self, _: u64, _: &[u8]) -> std::io::Result<()> {
        Ok(())
    }
}

#[derive(Debug)]
struct Table(Arc<MemoryRegion>, Arc<StopOnce>);

impl SegmentTable for Table {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        (token == TOKEN).then(|| SegmentLease {
            region: self.0.clone(),
            base: 0,
            len: LEN as u64,
            access: Access::REMOTE_READ,
            guard: None,
        })
    }
    fn published(&self) -> Vec<SegmentDesc> {
        Vec::new()
    }
    fn file(&self, token: SegmentToken) -> Option<Arc<dyn ferry_core::FileSource>> {
        (token == STOPPING).then(|| self.1.clone() as Arc<dyn ferry_core::FileSource>)
    }
}

/// Child: serves `LEN` bytes of 0xab, prints `SERVE name epoch`, waits to be killed.
#[test]
fn child_local_frozen_server() {
    if std::env::var("FERRY_TEST_CHILD").as_deref() != Ok("local-frozen-server") {
        return;
    }
    let region = Arc::new(MemoryRegion::from_vec(vec![0xab; LEN]));
    let epoch = Epoch::fresh();
    let h = LocalServer::bind()
        .unwrap()
        .serve(
            Arc::new(Table(region, Arc::default())),
            Arc::new(Responder(epoch)),
            HandshakeLimits::default(),
            16,
        )
        .unwrap();
    println!("SERVE {} {}", h.name(), epoch.0);
    loop {
        std::thread::park();
    }
}

/// Kills the child however the test ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        // SAFETY: kill(2) of a child we own; a stopped child is continued so that it can die.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGCONT) };
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_server_copies_nothing_after_a_close_gave_its_requests_up() {
    let mut child = Child(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_local_frozen_server",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("FERRY_TEST_CHILD", "local-frozen-server")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let pid = child.0.id();
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    let (socket, epoch) = loop {
        let line = lines.next().expect("the child ended first").unwrap();
        if let Some((_, rest)) = line.split_once("SERVE ") {
            let (name, epoch) = rest.trim().split_once(' ').unwrap();
            break (name.to_owned(), Epoch(epoch.parse().unwrap()));
        }
    };
    let peer = peer_at(&socket, pid, epoch, 2);
    let transport = LocalTransport::new(LocalConfig::default());
    let ch = transport.connect_channel(&peer).unwrap();

    // One READ of the stopping file, alone on its stream first: the server checks it, then
    // stops itself before its copy (waitpid reports the stop: the event waited for).
    let local = Arc::new(MemoryRegion::alloc_zeroed(LEN, 4096).unwrap());
    let read = |token, at: u64, len: u64| Op {
        kind: OpKind::Read,
        local: local.clone(),
        local_offset: at,
        token,
        remote_offset: at,
        len,
    };
    let first: Arc<[Op]> = vec![read(STOPPING, 0, 64 << 10)].into();
    let first = ch.execute(first.clone(), Arc::new(RequestControl::new(&first)));
    // SAFETY: waitpid(2) of a child we own; `status` is valid for the write.
    let stopped = unsafe {
        let mut status = 0;
        let r = libc::waitpid(pid as i32, &mut status, libc::WUNTRACED);
        r == pid as i32 && libc::WIFSTOPPED(status)
    };
    assert!(stopped, "the server did not stop");

    // Then READs of the whole memory segment in 64 KiB ops: their requests wait, unread, in
    // the server's sockets.
    let ops: Arc<[Op]> = (0..(LEN / (64 << 10)) as u64)
        .map(|i| read(TOKEN, i * (64 << 10), 64 << 10))
        .collect::<Vec<_>>()
        .into();
    let control = Arc::new(RequestControl::new(&ops));
    let fut = ch.execute(ops, control);
    // And small READs, whose bytes come inline through the ring (no copy into this process
    // by the server at all): the client must not land a late one either.
    let small = Arc::new(MemoryRegion::alloc_zeroed(64 << 10, 4096).unwrap());
    let inline_ops: Arc<[Op]> = (0..16u64)
        .map(|i| Op {
            kind: OpKind::Read,
            local: small.clone(),
            local_offset: i * 4096,
            token: TOKEN,
            remote_offset: i * 4096,
            len: 4096,
        })
        .collect::<Vec<_>>()
        .into();
    let inline_fut = ch.execute(
        inline_ops.clone(),
        Arc::new(RequestControl::new(&inline_ops)),
    );
    let t0 = Instant::now();
    ch.close();
    let o = tokio::time::timeout(Duration::from_secs(60), fut)
        .await
        .expect("a stopped server held the closed channel's requests");
    let f = tokio::time::timeout(Duration::from_secs(60), first)
        .await
        .expect("a stopped server held the closed channel's first READ");
    assert!(f.failure.is_some(), "{f:?}");
    println!(
        "the closed channel's requests ended after {:?}",
        t0.elapsed()
    );
    assert!(o.failure.is_some(), "{o:?}");
    assert_eq!(o.completed_ops, 0, "{o:?}");
    let i = tokio::time::timeout(Duration::from_secs(60), inline_fut)
        .await
        .expect("a stopped server held the closed channel's small READs");
    assert_eq!(i.completed_ops, 0, "{i:?}");
    let mut got = vec![0u8; LEN];
    local.read_at(0, &mut got).unwrap();
    assert!(
        got.iter().all(|b| *b == 0),
        "bytes landed from a stopped server"
    );
    assert_eq!(ferry_transport_local::probe().revoked, 1);

    // The server runs again: the READs it finds are refused; it ends its streams, and then the
    // revocation ends (the event waited for).
    // SAFETY: kill(2) of a child we own.
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    let until = Instant::now() + Duration::from_secs(60);
    while ferry_transport_local::probe().revoked != 0 {
        assert!(Instant::now() < until, "the server never ended its streams");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    local.read_at(0, &mut got).unwrap();
    let landed = got.iter().filter(|b| **b != 0).count();
    assert_eq!(landed, 0, "{landed} bytes landed after the requests ended");
    let mut got = vec![0u8; 64 << 10];
    small.read_at(0, &mut got).unwrap();
    let landed = got.iter().filter(|b| **b != 0).count();
    assert_eq!(
        landed, 0,
        "{landed} inline bytes landed after the requests ended"
    );
    // SAFETY: PR_GET_DUMPABLE takes no pointer.
    assert_eq!(unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) }, 1);
}

//! A frozen same-host server (`SIGSTOP`) under a request with a deadline: the request ends
//! by its deadline plus a second, drained, and nothing lands in the caller's buffer afterwards,
//! checked after the server runs again (it then finds the READs it had not read yet, and its
//! copies into this process are refused: the client revoked them before it gave the streams
//! up). Alone in its binary: the revocation is the whole process's (it is not dumpable while
//! the server holds its streams), which other tests' same-host servers would see. The test
//! binary re-runs itself as the server (`FERRY_TEST_CHILD=same-host-frozen`).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ferry::{Access, Batch, DataPlane, FailureKind, MemoryRegion, TransferEngine, TransportKind};

const LEN: usize = 8 << 20;
const DEADLINE: Duration = Duration::from_secs(2);

fn engine(listen: bool) -> Result<TransferEngine> {
    let mut b = TransferEngine::builder()
        .data_plane(DataPlane::Tcp)
        .no_auth();
    if listen {
        b = b.listen("127.0.0.1:0".parse()?);
    }
    Ok(b.build()?)
}

/// Child: serves `LEN` bytes of 0xab named `src`, prints `LISTEN addr`, waits to be killed.
#[test]
fn child_frozen_server() -> Result<()> {
    if std::env::var("FERRY_TEST_CHILD").as_deref() != Ok("same-host-frozen") {
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let engine = engine(true)?;
        let _reg = engine.register(
            MemoryRegion::from_vec(vec![0xab; LEN]),
            Access::REMOTE_READ,
            "src",
        )?;
        println!("LISTEN {}", engine.local_addr().context("listens")?);
        loop {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
    })
}

/// Kills the child however the test ends.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        // SAFETY: kill(2) of a child we own; a stopped child is continued so it can die.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGCONT) };
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) of a child we own.
    assert_eq!(unsafe { libc::kill(child.0.id() as i32, sig) }, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_server_never_writes_into_a_buffer_after_its_deadline() -> Result<()> {
    let mut child = Child(
        Command::new(std::env::current_exe()?)
            .args([
                "--exact",
                "child_frozen_server",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("FERRY_TEST_CHILD", "same-host-frozen")
            .stdout(Stdio::piped())
            .spawn()?,
    );
    let mut lines = BufReader::new(child.0.stdout.take().context("stdout")?).lines();
    let addr = loop {
        let line = lines.next().context("the child ended before listening")??;
        if let Some((_, a)) = line.split_once("LISTEN ") {
            break a.trim().parse::<std::net::SocketAddr>()?;
        }
    };
    let client = engine(false)?;
    let peer = client.connect(addr).await?;
    assert_eq!(peer.transport(), TransportKind::Local);
    let seg = peer.segment("src")?;
    let local = client.register(MemoryRegion::alloc_zeroed(LEN, 4096)?, Access::LOCAL, "dst")?;

    // The server stops; the stop is the event (waitpid reports it).
    signal(&child, libc::SIGSTOP);
    let mut status = 0;
    // SAFETY: waitpid on a child we own; `status` is valid for the write.
    let r = unsafe { libc::waitpid(child.0.id() as i32, &mut status, libc::WUNTRACED) };
    assert_eq!(r, child.0.id() as i32);
    assert!(libc::WIFSTOPPED(status));

    // READs of the whole segment, in small ops: their requests wait, unread, in the server's
    // socket (and the client's outbox), for a server that is not running.
    let mut b = Batch::new().timeout(DEADLINE);
    for i in 0..(LEN / (64 << 10)) {
        let at = (i * (64 << 10)) as u64;
        b = b.read(&local, at, &seg, at, 64 << 10);
    }
    let t0 = Instant::now();
    let handle = client.submit(b)?;
    // Drained: the transport has finished with every buffer (what the Mooncake and NIXL
    // layers wait for before they return).
    let drained = handle.drained();
    let o = tokio::time::timeout(Duration::from_secs(60), drained)
        .await
        .context("the frozen server held the request")?;
    let took = t0.elapsed();
    println!("a frozen server's request ended after {took:?} (deadline {DEADLINE:?})");
    assert_eq!(
        o.failure.map(|f| f.kind),
        Some(FailureKind::Timeout),
        "{o:?}"
    );
    assert!(o.drained, "{o:?}");
    assert!(
        took < DEADLINE + Duration::from_secs(1),
        "the request ended {took:?} after it was submitted, past its deadline and a second"
    );
    let mut after = vec![0u8; LEN];
    local.region().read_at(0, &mut after)?;
    assert!(
        after.iter().all(|b| *b == 0),
        "bytes landed while the server was stopped"
    );
    assert!(
        client.describe().same_host.contains("revoked"),
        "{}",
        client.describe().same_host
    );

    // The server runs again: it reads the READs left in its socket, and its copies are refused.
    // It ends its streams; then the revocation ends (the event waited for).
    signal(&child, libc::SIGCONT);
    let until = Instant::now() + Duration::from_secs(60);
    while client.describe().same_host.contains("revoked") {
        assert!(Instant::now() < until, "the server never ended its streams");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    local.region().read_at(0, &mut after)?;
    let landed = after.iter().filter(|b| **b != 0).count();
    assert_eq!(landed, 0, "{landed} bytes landed after the request ended");
    Ok(())
}

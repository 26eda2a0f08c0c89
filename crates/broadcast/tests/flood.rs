//! A keyless publisher under a flood of control connections that each sent one request and
//! went idle (issue 46, S7): with the descriptor limit most hosts start a process with (1024),
//! 1,500 such connections, held open, do not keep it from serving pulls. The flood runs in a
//! child process (this test binary again, running `flood_helper_process`), so that its own
//! descriptors are not the publisher's; the pulls come from the flood's own address, so they
//! are charged to the same source as the flood and get in only by the flood's connections
//! giving way.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::DataPlane;
use ferry_broadcast::{Embedded, Manifest, Receiver, ReceiverOptions, Source, SourceOptions};

/// Connections the flood opens, each sending one request, and holds.
const FLOOD: usize = 1500;
/// The publisher's descriptor limit (the usual default soft limit).
const PUBLISHER_NOFILE: u64 = 1024;
/// Limit on waiting for an event that must come (a failure past it, never a pace).
const PATIENCE: Duration = Duration::from_secs(30);
/// Pulls that must each land every byte while the flood is held.
const PULLS: usize = 3;
/// The environment variable that makes `flood_helper_process` flood the address it names.
const CHILD_ENV: &str = "FERRY_TEST_CONTROL_FLOOD_ADDR";

/// Sets this process's soft limit on descriptors to `want` (within the hard limit).
fn set_fd_limit(want: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid rlimit for getrlimit to fill.
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    assert_eq!(got, 0, "getrlimit: {}", std::io::Error::last_os_error());
    lim.rlim_cur = want.min(lim.rlim_max);
    // SAFETY: `lim` is a valid rlimit within the hard limit.
    let set = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    assert_eq!(set, 0, "setrlimit: {}", std::io::Error::last_os_error());
    lim.rlim_cur
}

fn files(dir: &std::path::Path) -> (Vec<PathBuf>, Vec<u8>) {
    let a: Vec<u8> = (0..(1 << 20) + 77)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    let pa = dir.join("a.bin");
    std::fs::write(&pa, &a).unwrap();
    (vec![pa], a)
}

/// The flood, in the child process: opens [`FLOOD`] connections to the address in
/// [`CHILD_ENV`], sends one `manifest` request on each, reads each answer (or finds the
/// connection closed; past [`PATIENCE`] in all it stops waiting to connect or for answers),
/// prints what it found, and holds every connection open until its stdin closes. Run only by
/// the test below.
#[test]
#[ignore = "the flood's child process, run by a_publisher_keeps_serving_pulls_under_1500_idle_control_connections"]
fn flood_helper_process() {
    let addr: SocketAddr = std::env::var(CHILD_ENV)
        .expect("run by the flood test")
        .parse()
        .unwrap();
    set_fd_limit(FLOOD as u64 + 512);
    let until = Instant::now() + PATIENCE;
    let left = || {
        until
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    let mut held = Vec::with_capacity(FLOOD);
    let (mut answered, mut closed, mut silent, mut unconnected) = (0, 0, 0, 0);
    for _ in 0..FLOOD {
        // A publisher out of descriptors accepts nothing: its backlog fills and connecting
        // waits; past the deadline the rest are counted, not waited for.
        match TcpStream::connect_timeout(&addr, left()) {
            Ok(mut s) => {
                if s.write_all(b"{\"op\":\"manifest\"}\n").is_ok() {
                    held.push(s);
                } else {
                    closed += 1;
                }
            }
            Err(_) => unconnected += 1,
        }
    }
    for s in &mut held {
        s.set_read_timeout(Some(left())).unwrap();
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        loop {
            match s.read(&mut b) {
                Ok(0) => {
                    closed += 1;
                    break;
                }
                Ok(_) if b[0] == b'\n' => {
                    answered += 1;
                    break;
                }
                Ok(_) => line.push(b[0]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    silent += 1;
                    break;
                }
                Err(_) => {
                    closed += 1;
                    break;
                }
            }
        }
    }
    println!("FLOOD answered={answered} closed={closed} silent={silent} unconnected={unconnected}");
    std::io::stdout().flush().unwrap();
    // Held, idle, until the test is done with them.
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_keeps_serving_pulls_under_1500_idle_control_connections() {
    assert_eq!(set_fd_limit(PUBLISHER_NOFILE), PUBLISHER_NOFILE);
    let dir = tempfile::tempdir().unwrap();
    let (paths, want) = files(dir.path());
    let m = Manifest::build("w", 1, &paths, 256 << 10).unwrap();
    let src = Source::start(
        m,
        &paths,
        SourceOptions {
            data_plane: DataPlane::Tcp,
            ..Default::default()
        },
        None,
    )
    .await
    .unwrap();
    let ctl = src.ctl_addr();

    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "flood_helper_process",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, ctl.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    // The child's report: every connection sent its request and was answered or closed. Its
    // output is read to the end (the harness writes after the report).
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            // The harness may have begun the line ("test flood_helper_process ... ").
            if let Some(at) = l.find("FLOOD ") {
                let _ = tx.send(l[at..].to_owned());
            }
        }
    });
    let report = tokio::task::spawn_blocking(move || rx.recv_timeout(2 * PATIENCE))
        .await
        .unwrap()
        .expect("the flood reported");
    let count = |what: &str| -> usize {
        report
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{what}=")))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{report}"))
    };
    let (answered, closed) = (count("answered"), count("closed"));
    let (silent, unconnected) = (count("silent"), count("unconnected"));
    assert_eq!(answered + closed + silent + unconnected, FLOOD, "{report}");
    assert!(
        answered > 256,
        "the flood's connections passed the pre-proof gate: {report}"
    );

    // Pulls from the flood's own address while it holds its connections.
    for run in 0..PULLS {
        let disc = Arc::new(Embedded::new(ctl));
        let opts = ReceiverOptions {
            data_plane: DataPlane::Tcp,
            heartbeat: Duration::from_millis(100),
            relay: false,
            ..Default::default()
        };
        let pull = async {
            let mut r = Receiver::join(disc, Some("w"), opts).await?;
            r.run().await?;
            Ok::<_, ferry_broadcast::BroadcastError>(r.segment_bytes(0).unwrap())
        };
        let got = tokio::time::timeout(PATIENCE, pull)
            .await
            .unwrap_or_else(|_| panic!("pull {run}: not within {PATIENCE:?} ({report})"))
            .unwrap_or_else(|e| panic!("pull {run} under the flood failed: {e} ({report})"));
        assert!(got == want, "pull {run}: the bytes differ");
    }

    drop(child.stdin.take());
    let status = child.wait().unwrap();
    reader.join().unwrap();
    assert!(status.success(), "the flood's process: {status}");
    src.stop().await;
}

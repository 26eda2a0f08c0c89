//! `ferry pull etcd://…` refuses to pull unbound, and `--transport tcp` on `ferry publish` and
//! `ferry pull` keeps the same-host plane off, as on `ferry serve` (issue 40).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

fn ferry() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.env_remove("FERRY_AUTH_KEY_FILE")
        .env_remove("FERRY_SAME_HOST")
        .env("NO_COLOR", "1");
    c
}

/// What the same-host plane logs when it starts serving (at debug).
const SERVING: &str = "same-host plane serving";

/// Without keys or a digest, a pull from etcd is refused before etcd is asked anything (none
/// listens at the address given), naming both flags that would allow it.
#[test]
fn an_etcd_pull_without_a_key_or_a_digest_is_refused_naming_the_flags() {
    let o = ferry()
        .args([
            "pull",
            "etcd://127.0.0.1:1/w",
            "--in-memory",
            "--linger",
            "0",
        ])
        .output()
        .expect("run pull");
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    for named in [
        "--expect-manifest",
        "--auth-key-file",
        "etcd http://127.0.0.1:1",
    ] {
        assert!(err.contains(named), "{named:?} not in: {err}");
    }
}

/// `ferry publish DIR --transport T` with its log (same-host plane at debug) in `log`; returns
/// the process and the printed pull command's address and digest.
fn publish(src: &Path, transport: &str, log: &Path) -> (Child, String, String) {
    let mut publish = ferry()
        .arg("publish")
        .arg(src)
        .args([
            "--name",
            "p",
            "--listen",
            "127.0.0.1:0",
            "--chunk-size",
            "4KiB",
        ])
        .args(["--transport", transport])
        .env("RUST_LOG", "warn,ferry_transport_local=debug")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).expect("log file"))
        .spawn()
        .expect("spawn publish");
    let out = BufReader::new(publish.stdout.take().expect("stdout"));
    for line in out.lines() {
        let line = line.expect("read publish's stdout");
        if let Some(rest) = line.split_once("ferry pull ").map(|(_, r)| r) {
            let ctl = rest.split_whitespace().next().expect("address").to_owned();
            let digest = rest
                .split_once("--expect-manifest ")
                .map(|(_, d)| d.trim().to_owned())
                .expect("digest");
            return (publish, ctl, digest);
        }
    }
    let _ = publish.kill();
    let _ = publish.wait();
    panic!("publish printed no pull command");
}

/// Each end's log, with `--transport tcp` and with `auto`: only `auto` starts the same-host
/// plane.
#[test]
fn transport_tcp_keeps_the_same_host_plane_off_on_publish_and_pull() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path().join("src");
    std::fs::create_dir(&src).expect("mkdir");
    std::fs::write(src.join("a.bin"), vec![5u8; 40_000]).expect("write");
    for transport in ["tcp", "auto"] {
        let log = dir.path().join(format!("publish-{transport}.log"));
        let (mut p, ctl, digest) = publish(&src, transport, &log);
        let pulled = ferry()
            .args(["pull", &ctl, "--in-memory", "--linger", "0"])
            .args(["--transport", transport, "--expect-manifest", &digest])
            .env("RUST_LOG", "warn,ferry_transport_local=debug")
            .output()
            .expect("run pull");
        let _ = p.kill();
        let _ = p.wait();
        assert!(pulled.status.success(), "{pulled:?}");
        let published = std::fs::read_to_string(&log).expect("read the log");
        let pull_log = String::from_utf8_lossy(&pulled.stderr);
        // With `auto` the plane is tried: serving, or a warning why its socket was not made.
        let tried = |log: &str| log.contains(SERVING) || log.contains("same-host plane not served");
        let on = transport == "auto";
        assert_eq!(
            tried(&published),
            on,
            "publish --transport {transport}: {published}"
        );
        assert_eq!(
            tried(&pull_log),
            on,
            "pull --transport {transport}: {pull_log}"
        );
    }
}

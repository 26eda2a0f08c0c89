//! `ferry serve --auth-key-file` and `ferry bench --auth-key-file` as a user runs them, over
//! 127.0.0.1: a client with the key moves bytes, one without it or with a wrong one gets a clear
//! error (and the server logs the refusal), `--publish-to` hides a segment from other key names,
//! and serving without a key on an address other than loopback warns.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};

const ALICE: &str = "alice 000102030405060708090a0b0c0d0e0f";
const ALICE_WRONG: &str = "alice f00102030405060708090a0b0c0d0e0f";
const BOB: &str = "bob 101112131415161718191a1b1c1d1e1f";

fn key_file(dir: &Path, name: &str, text: &str) -> Result<PathBuf> {
    let p = dir.join(name);
    std::fs::write(&p, format!("{text}\n"))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(p)
}

/// A running `ferry serve`; its stderr is collected by a thread.
struct Serve {
    child: Child,
    addr: String,
    stderr: std::thread::JoinHandle<String>,
}

impl Serve {
    fn start(args: &[&str]) -> Result<Self> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .arg("serve")
            .args(["--transport", "tcp", "--io-threads", "caller"])
            .args(args)
            .env_remove("FERRY_AUTH_KEY_FILE")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().context("stdout")?;
        let mut err = child.stderr.take().context("stderr")?;
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        let mut addr = None;
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            if let Some(a) = line.strip_prefix("listening on ") {
                addr = Some(a.trim().to_owned());
                break;
            }
        }
        let Some(addr) = addr else {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "ferry serve {args:?} did not listen: {}",
                stderr.join().unwrap_or_default()
            );
        };
        Ok(Self {
            child,
            addr,
            stderr,
        })
    }

    /// Stops the server and returns what it logged.
    fn stop(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stderr.join().unwrap_or_default()
    }
}

/// Runs `ferry bench ARGS --json`: its report, or its stderr as the error.
fn bench(args: &[&str]) -> Result<serde_json::Value, String> {
    bench_with(args, None)
}

/// `ferry bench` with `FERRY_ALLOW_OPEN_KEY_FILE` set to `allow_open`, or unset.
fn bench_with(args: &[&str], allow_open: Option<&str>) -> Result<serde_json::Value, String> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferry"));
    cmd.arg("bench")
        .args(["--transport", "tcp", "--total", "4MiB", "--op-size", "1MiB"])
        .args(args)
        .arg("--json")
        .env_remove("FERRY_AUTH_KEY_FILE")
        .env_remove("FERRY_ALLOW_OPEN_KEY_FILE");
    if let Some(v) = allow_open {
        cmd.env("FERRY_ALLOW_OPEN_KEY_FILE", v);
    }
    let out = cmd.output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
}

fn moved(v: &serde_json::Value) -> u64 {
    v["total_bytes"].as_u64().unwrap_or(0)
}

#[test]
fn serve_and_bench_with_auth_key_files() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let server_keys = key_file(dir.path(), "server.keys", &format!("{ALICE}\n{BOB}"))?;
    let alice = key_file(dir.path(), "alice.key", ALICE)?;
    let bob = key_file(dir.path(), "bob.key", BOB)?;
    let wrong = key_file(dir.path(), "wrong.key", ALICE_WRONG)?;
    let s = |p: &PathBuf| p.to_str().map(str::to_owned).context("path");
    let (server_keys, alice, bob, wrong) = (s(&server_keys)?, s(&alice)?, s(&bob)?, s(&wrong)?);

    let server = Serve::start(&[
        "--listen",
        "127.0.0.1:0",
        "--auth-key-file",
        &server_keys,
        "--segment",
        "open=4MiB",
        "--segment",
        "secret=4MiB",
        "--publish-to",
        "secret=bob",
    ])?;
    let addr = server.addr.clone();
    let with = |key: &str, segment: &str, op: &str| {
        bench(&[
            &addr,
            "--auth-key-file",
            key,
            "--segment",
            segment,
            "--op",
            op,
        ])
    };
    let results = (|| -> Result<()> {
        // With the key: bytes move both ways.
        for op in ["read", "write"] {
            let v = with(&alice, "open", op).map_err(anyhow::Error::msg)?;
            assert_eq!(moved(&v), 4 << 20, "{v}");
        }
        // Without it: refused, nothing listed.
        let e = bench(&[&addr, "--segment", "open"])
            .err()
            .context("no key ran")?;
        assert!(e.contains("authentication required"), "{e}");
        // A wrong key: the client says so.
        let e = with(&wrong, "open", "read")
            .err()
            .context("a wrong key ran")?;
        assert!(
            e.contains("authentication") && e.contains("could not prove"),
            "{e}"
        );
        // bob's segment: invisible to alice, there for bob.
        let e = with(&alice, "secret", "read")
            .err()
            .context("alice reached bob's segment")?;
        assert!(e.contains("no segment named \"secret\""), "{e}");
        let v = with(&bob, "secret", "read").map_err(anyhow::Error::msg)?;
        assert_eq!(moved(&v), 4 << 20, "{v}");
        Ok(())
    })();
    let log = server.stop();
    results?;
    // The server logged the refusals, and never a key.
    assert!(log.contains("plain hello refused"), "{log}");
    for key in [ALICE, BOB, ALICE_WRONG] {
        let hex = key.split_once(' ').map(|(_, h)| h).unwrap_or(key);
        assert!(!log.contains(hex), "a key in the log: {log}");
    }
    Ok(())
}

#[test]
fn bench_on_loopback_with_a_key_file_and_bad_files() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let alice = key_file(dir.path(), "alice.key", ALICE)?;
    let alice = alice.to_str().context("path")?;
    let v = bench(&["--auth-key-file", alice]).map_err(anyhow::Error::msg)?;
    assert_eq!(moved(&v), 4 << 20, "{v}");
    let missing = dir.path().join("nope.key");
    let e = bench(&["--auth-key-file", missing.to_str().context("path")?])
        .err()
        .context("ran with a missing key file")?;
    assert!(e.contains("nope.key") && e.contains("cannot read"), "{e}");
    let short = key_file(dir.path(), "short.key", "alice 00010203")?;
    let e = bench(&["--auth-key-file", short.to_str().context("path")?])
        .err()
        .context("ran with a short key")?;
    assert!(e.contains("short.key") && e.contains("at least 16"), "{e}");
    // A key file group or others may read: refused, unless the flag or the variable allows it.
    let open = key_file(dir.path(), "open.key", ALICE)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o640))?;
    }
    let open = open.to_str().context("path")?;
    let e = bench(&["--auth-key-file", open])
        .err()
        .context("ran with a key file group may read")?;
    assert!(
        e.contains("open.key") && e.contains("640") && e.contains("--allow-open-key-file"),
        "{e}"
    );
    assert!(!e.contains("0a0b0c0d"), "{e}");
    let v =
        bench(&["--auth-key-file", open, "--allow-open-key-file"]).map_err(anyhow::Error::msg)?;
    assert_eq!(moved(&v), 4 << 20, "{v}");
    let v = bench_with(&["--auth-key-file", open], Some("1")).map_err(anyhow::Error::msg)?;
    assert_eq!(moved(&v), 4 << 20, "{v}");
    Ok(())
}

/// Without a key, serving on an address other than loopback warns that anyone can connect;
/// on loopback, or with a key, it does not.
#[test]
fn serving_openly_off_loopback_warns() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let keys = key_file(dir.path(), "k", ALICE)?;
    let keys = keys.to_str().context("path")?;
    for (listen, key, warns) in [
        ("0.0.0.0:0", None, true),
        ("127.0.0.1:0", None, false),
        ("0.0.0.0:0", Some(keys), false),
    ] {
        let mut args = vec!["--listen", listen, "--segment", "x=4KiB"];
        if let Some(k) = key {
            args.extend(["--auth-key-file", k]);
        }
        // The warning is logged before the listener's address is printed, and stop() reads
        // the log to its end.
        let log = Serve::start(&args)?.stop();
        assert_eq!(
            log.contains("serving without authentication"),
            warns,
            "{listen} key {key:?}: {log}"
        );
    }
    Ok(())
}

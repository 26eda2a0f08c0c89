//! Every bad value a flag can take is refused where it is parsed, before anything starts, with
//! the flag's name and what it takes: exit 2 for what clap refuses alone, exit 1 for values that
//! are wrong together (`--total` against `--op-size`) or against the machine (memory).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn ferry() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.env_remove("FERRY_AUTH_KEY_FILE").env("NO_COLOR", "1");
    c
}

/// Runs `ferry ARGS`, expects exit `code` and each of `want` in stderr; returns stderr.
fn refused(args: &[&str], code: i32, want: &[&str]) -> String {
    let out = ferry().args(args).output().expect("run ferry");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "ferry {args:?}: {err}");
    for w in want {
        assert!(err.contains(w), "ferry {args:?}: want {w:?} in: {err}");
    }
    assert!(out.stdout.is_empty(), "ferry {args:?} printed: {out:?}");
    err
}

#[test]
fn zero_and_negative_counts_name_the_flag() {
    for flag in [
        "--depth",
        "--streams",
        "--batch",
        "--threads",
        "--server-threads",
    ] {
        refused(
            &["bench", flag, "0"],
            2,
            &[&format!("'{flag} <"), "must be at least 1"],
        );
        refused(
            &["bench", &format!("{flag}=-1")],
            2,
            &[&format!("'{flag} <"), "not negative"],
        );
    }
    refused(
        &["bench", "--streams", "65"],
        2,
        &["'--streams <", "at most 64"],
    );
    refused(&["serve", "--streams", "0"], 2, &["'--streams <"]);
    refused(
        &["pull", "127.0.0.1:1", "--into", "x", "--window", "0"],
        2,
        &["'--window <", "must be at least 1"],
    );
}

#[test]
fn sizes_refuse_what_no_one_means() {
    refused(
        &["bench", "--chunk-size", "0"],
        2,
        &["'--chunk-size <", "at least 1 byte"],
    );
    refused(
        &["bench", "--chunk-size", "1GiB"],
        2,
        &["'--chunk-size <", "at most 64 MiB"],
    );
    refused(
        &["publish", "Cargo.toml", "--name", "n", "--chunk-size", "0"],
        2,
        &["'--chunk-size <", "4 KiB to 64 MiB"],
    );
    refused(
        &["bench", "--op-size", "0"],
        2,
        &["'--op-size <", "at least 1 byte"],
    );
    refused(
        &["bench", "--op-size", "1.5"],
        2,
        &["whole number of bytes"],
    );
    refused(&["bench", "--op-size", "2EiB"], 2, &["unknown size unit"]);
    refused(
        &["bench", "--total", "99999999999GiB"],
        2,
        &["more than 1 EiB"],
    );
    refused(&["bench", "--op-size=-4KiB"], 2, &["cannot be negative"]);
    refused(
        &["bench", "--socket-buffer", "0"],
        2,
        &["'--socket-buffer <", "auto or 4KiB to 1GiB"],
    );
    refused(
        &["serve", "--segment", "s=0"],
        1,
        &["--segment \"s=0\"", "at least 1 byte"],
    );
}

#[test]
fn a_total_below_one_request_is_refused() {
    refused(
        &["bench", "--total", "1"],
        1,
        &["--total 1 is less than one request", "--op-size 1048576"],
    );
    refused(
        &["bench", "--total", "1MiB", "--batch", "4"],
        1,
        &["--op-size 1048576 × --batch 4 = 4194304 bytes"],
    );
}

#[test]
fn an_allocation_too_large_names_the_flags() {
    // 1000 TiB: more than any machine this runs on.
    refused(
        &["bench", "--op-size", "1TiB", "--depth", "1000"],
        1,
        &["--op-size 1099511627776 × --depth 1000", "this machine's"],
    );
}

#[test]
fn durations_take_one_syntax_everywhere() {
    refused(
        &["bench", "--duration", "0"],
        2,
        &["'--duration <", "longer than zero"],
    );
    refused(
        &["bench", "--duration", "soon"],
        2,
        &["'--duration <", "e.g. 10s"],
    );
    refused(
        &["bench", "--dead-peer-after", "500ms"],
        2,
        &["1s to 86400s"],
    );
    refused(
        &["pull", "127.0.0.1:1", "--into", "x", "--stall-after", "0"],
        2,
        &["'--stall-after <"],
    );
    refused(
        &["publish", "Cargo.toml", "--name", "n", "--serve-for=-1s"],
        2,
        &["'--serve-for <"],
    );
    // `--duration 300ms` is a duration, as `--dead-peer-after 30s` is.
    let out = ferry()
        .args([
            "bench",
            "--duration",
            "300ms",
            "--op-size",
            "64KiB",
            "--json",
        ])
        .output()
        .expect("run ferry bench");
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert!(v["seconds"].as_f64().is_some_and(|s| s >= 0.3), "{v}");
}

#[test]
fn segment_names_are_unique_per_server() {
    refused(
        &["serve", "--segment", "s=1MiB", "--segment", "s=2MiB"],
        1,
        &["--segment s=2MiB: the name \"s\" is already given (--segment s=1MiB)"],
    );
    refused(
        &["serve", "--segment", "s=1MiB", "--file", "s=Cargo.toml"],
        1,
        &["--file s=Cargo.toml: the name \"s\" is already given"],
    );
}

#[test]
fn publish_to_without_a_key_names_the_flag() {
    let err = refused(
        &["serve", "--segment", "s=1MiB", "--publish-to", "s=alice"],
        1,
        &["--publish-to needs --auth-key-file (or FERRY_AUTH_KEY_FILE)"],
    );
    assert!(!err.contains("EngineBuilder"), "{err}");
}

#[test]
fn serve_listens_on_a_host_name_and_says_what_a_missing_port_means() {
    refused(
        &["serve", "--listen", "localhost"],
        2,
        &["'--listen <", "no port: give HOST:PORT"],
    );
    let mut child = ferry()
        .args(["serve", "--listen", "localhost:0", "--transport", "tcp"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn ferry serve");
    let stdout = child.stdout.take().expect("stdout");
    let mut listening = None;
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("read serve's stdout");
        if let Some(a) = line.strip_prefix("listening on ") {
            listening = Some(a.to_owned());
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let addr = listening.expect("serve printed its address");
    let addr: std::net::SocketAddr = addr.parse().expect("an address");
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{addr}");
}

#[test]
fn a_pull_into_a_directory_it_cannot_write_fails_before_it_starts() {
    // No publisher listens on port 9: a refusal naming the directory, not the connection,
    // shows the directory was checked first.
    let out = ferry()
        .args([
            "pull",
            "127.0.0.1:9",
            "--into",
            "/proc/ferry-cannot-be-made",
        ])
        .output()
        .expect("run ferry");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--into /proc/ferry-cannot-be-made"), "{err}");
    assert!(!err.contains("refused"), "{err}");
    // A directory that does not exist yet is checked by making it, and removed again: a pull
    // that fails leaves nothing behind.
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("new").join("deeper");
    let out = ferry()
        .args(["pull", "127.0.0.1:9", "--into"])
        .arg(&dir)
        .output()
        .expect("run ferry");
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(std::fs::read_dir(tmp.path()).expect("read dir").count(), 0);
}

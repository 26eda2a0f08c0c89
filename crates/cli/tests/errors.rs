//! Failures say what happened once, what to do next, and what was done before; under `--json`
//! they are one JSON object on stdout with a non-zero exit.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};

fn ferry() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.env_remove("FERRY_AUTH_KEY_FILE").env("NO_COLOR", "1");
    c
}

/// A `ferry serve` on a free loopback port, and its address.
struct Serve {
    child: Child,
    addr: String,
}

impl Serve {
    fn start(args: &[&str]) -> Self {
        let mut child = ferry()
            .args(["serve", "--listen", "127.0.0.1:0", "--transport", "tcp"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn ferry serve");
        let out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut addr = None;
        for line in out.lines() {
            let line = line.expect("read serve's stdout");
            if let Some(a) = line.strip_prefix("listening on ") {
                addr = Some(a.to_owned());
                break;
            }
        }
        Self {
            child,
            addr: addr.expect("serve printed its address"),
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port nothing listens on: one the kernel gave us, closed again.
fn closed_port() -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let a = l.local_addr().expect("addr");
    drop(l);
    a.to_string()
}

fn json_failure(out: &std::process::Output) -> serde_json::Value {
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().count(), 1, "one JSON object: {text}");
    serde_json::from_str(&text).expect("JSON")
}

#[test]
fn a_refused_connection_says_it_once_and_asks_for_ferry_serve() {
    let addr = closed_port();
    let out = ferry().args(["bench", &addr]).output().expect("run bench");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("Connection refused").count(), 1, "{err}");
    assert!(
        err.contains("hint: nothing listens there: is `ferry serve` running"),
        "{err}"
    );

    let out = ferry()
        .args(["bench", &addr, "--json"])
        .output()
        .expect("run bench");
    let v = json_failure(&out);
    assert_eq!(v["error"]["kind"], "connection_refused", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains(&addr));
    assert!(v["error"]["hint"].is_string(), "{v}");
    assert_eq!(v["bytes_moved"], 0, "{v}");
    assert_eq!(v["ops_completed"], 0, "{v}");

    let out = ferry()
        .args(["pull", &addr, "--into", "unused", "--json"])
        .output()
        .expect("run pull");
    let v = json_failure(&out);
    assert_eq!(v["error"]["kind"], "connection_refused", "{v}");
    assert!(
        v["error"]["hint"]
            .as_str()
            .unwrap()
            .contains("`ferry publish`"),
        "{v}"
    );
}

#[test]
fn an_address_without_a_port_says_which_port() {
    let out = ferry().args(["bench", "localhost"]).output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("'[PEER]': no port: give HOST:PORT"), "{err}");
    assert!(err.contains("port 7400"), "{err}");
    let out = ferry()
        .args(["pull", "localhost", "--into", "unused"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("has no port: give HOST:PORT"), "{err}");
    assert!(!err.contains("invalid socket address"), "{err}");
}

/// A listener that answers every connection with `reply` and then waits for the peer to go.
fn impostor(reply: &'static [u8]) -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            let _ = c.write_all(reply);
            let mut sink = Vec::new();
            let _ = c.read_to_end(&mut sink);
        }
    });
    addr
}

#[test]
fn a_peer_that_is_not_ferry_is_named() {
    for (reply, kind) in [
        (&b"HTTP/1.1 400 Bad Request\r\n\r\n"[..], "an HTTP server"),
        (
            &[0x16, 0x03, 0x03, 0x00, 0x40, 2, 0, 0, 0x3c, 3, 3, 0][..],
            "a TLS server",
        ),
    ] {
        let addr = impostor(reply);
        let out = ferry()
            .args(["bench", &addr, "--json"])
            .output()
            .expect("run bench");
        let v = json_failure(&out);
        assert_eq!(v["error"]["kind"], "not_ferry", "{v}");
        let hint = v["error"]["hint"].as_str().unwrap();
        assert!(hint.contains(kind), "{hint}");
        assert!(hint.contains("not `ferry serve`"), "{hint}");
    }
}

#[test]
fn bench_works_against_a_plain_serve_and_lists_segments_it_lacks() {
    let plain = Serve::start(&[]);
    let out = ferry()
        .args(["bench", &plain.addr, "--total", "4MiB", "--json"])
        .output()
        .expect("run bench");
    assert!(out.status.success(), "{out:?}");

    let named = Serve::start(&["--segment", "w=1MiB", "--segment", "kv=2MiB"]);
    let out = ferry()
        .args(["bench", &named.addr])
        .output()
        .expect("run bench");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no segment named \"bench\"; it publishes kv, w"),
        "{err}"
    );
    assert!(
        err.contains("hint: name one the peer publishes with --segment NAME"),
        "{err}"
    );
}

#[test]
fn a_bench_whose_server_dies_reports_what_it_did() {
    let mut serve = Serve::start(&["--segment", "w=4MiB"]);
    let mut bench = ferry()
        .args(["-v", "bench", &serve.addr, "--segment", "w"])
        .args(["--op-size", "64KiB", "--duration", "1h", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn bench");
    // Once the bench is connected, the server goes.
    let mut err = BufReader::new(bench.stderr.take().expect("stderr"));
    let mut line = String::new();
    while err.read_line(&mut line).expect("read bench's stderr") > 0 {
        if line.contains("connected") {
            break;
        }
        line.clear();
    }
    assert!(line.contains("connected"), "bench never connected");
    let _ = serve.child.kill();
    let _ = serve.child.wait();
    let mut rest = String::new();
    let _ = err.read_to_string(&mut rest);
    let out = bench.wait_with_output().expect("bench ends");
    let v = json_failure(&out);
    let kind = v["error"]["kind"].as_str().unwrap();
    assert!(
        ["peer_lost", "connection_refused"].contains(&kind),
        "{v}\n{rest}"
    );
    for key in [
        "bytes_moved",
        "ops_completed",
        "reconnect_attempts",
        "reconnects",
        "replays",
        "uncertain_writes",
    ] {
        assert!(v[key].is_u64(), "{key} in {v}");
    }
}

#[test]
fn no_colour_on_a_redirected_stderr() {
    // stderr is a pipe here: the log lines come without ANSI escapes, NO_COLOR or not.
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .env_remove("NO_COLOR")
        .env_remove("FERRY_AUTH_KEY_FILE")
        .args(["-v", "bench", "--total", "1MiB", "--json"])
        .output()
        .expect("run bench");
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("INFO"), "log lines expected: {err}");
    assert!(
        !err.contains('\u{1b}'),
        "ANSI escapes in a redirected stderr: {err:?}"
    );
}

/// An HTTP server as they are: it answers once the request's `end` came (`"\r\n\r\n"` for a
/// request head, `"\n"` for a request line), and never speaks first.
fn http_server(end: &'static [u8]) -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    std::thread::spawn(move || {
        for mut c in l.incoming().flatten() {
            std::thread::spawn(move || {
                let mut got = Vec::new();
                let mut buf = [0u8; 512];
                while !got.windows(end.len()).any(|w| w == end) {
                    match c.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = c.write_all(b"HTTP/1.0 400 Bad Request\r\n\r\n");
            });
        }
    });
    addr
}

#[test]
fn bench_against_an_http_server_says_so_long_before_the_handshake_deadline() {
    let addr = http_server(b"\r\n\r\n");
    let started = std::time::Instant::now();
    let out = ferry()
        .args(["bench", &addr, "--json"])
        .output()
        .expect("run bench");
    let took = started.elapsed();
    let v = json_failure(&out);
    assert_eq!(v["error"]["kind"], "not_ferry", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("an HTTP server"),
        "{v}"
    );
    assert!(v["error"]["hint"].as_str().unwrap().contains("7400"), "{v}");
    // Not the handshake's deadline (10 s): the port was asked what it is.
    assert!(took < std::time::Duration::from_secs(5), "{took:?}");
}

#[test]
fn pull_names_the_port_it_reached_when_it_is_no_control_port() {
    // An HTTP server answers the control request's line.
    let addr = http_server(b"\n");
    let out = ferry()
        .args(["pull", &addr, "--in-memory", "--json"])
        .output()
        .expect("run pull");
    let v = json_failure(&out);
    assert_eq!(v["error"]["kind"], "not_ferry", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("an HTTP server answered, not a `ferry publish` control port"),
        "{msg}"
    );
    // A Ferry engine's port (`ferry serve`'s) closes the connection at the first request.
    let serve = Serve::start(&[]);
    let out = ferry()
        .args(["pull", &serve.addr, "--in-memory", "--json"])
        .output()
        .expect("run pull");
    let v = json_failure(&out);
    assert_eq!(v["error"]["kind"], "not_ferry", "{v}");
    assert!(
        v["error"]["hint"]
            .as_str()
            .unwrap()
            .contains("after `control`"),
        "{v}"
    );
}

#[test]
fn serve_refuses_a_directory_or_an_unreadable_file_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path().display().to_string();
    let missing = dir.path().join("missing").display().to_string();
    for (args, want) in [
        (
            vec!["--file".to_owned(), format!("f={d}")],
            "is a directory",
        ),
        (
            vec!["--file-rw".to_owned(), format!("f={d}")],
            "is a directory",
        ),
        (
            vec!["--segment".to_owned(), format!("s=@{d}")],
            "is a directory",
        ),
        (
            vec!["--file".to_owned(), format!("f={missing}")],
            "No such file",
        ),
    ] {
        let out = ferry()
            .args(["serve", "--listen", "127.0.0.1:0", "--transport", "tcp"])
            .args(&args)
            .output()
            .expect("run serve");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains(want) && err.contains(&args[0]),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn bench_against_a_publishers_control_port_names_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("w.bin");
    std::fs::write(&file, vec![1u8; 4096]).expect("write");
    let mut publisher = ferry()
        .args([
            "publish",
            "--name",
            "w",
            "--listen",
            "127.0.0.1:0",
            "--transport",
            "tcp",
        ])
        .arg(&file)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn publish");
    let out = BufReader::new(publisher.stdout.take().expect("stdout"));
    let ctl = out
        .lines()
        .map_while(Result::ok)
        .find_map(|l| {
            l.strip_prefix("control ")
                .and_then(|r| r.split_whitespace().next())
                .map(str::to_owned)
        })
        .expect("publish printed its control address");
    let out = ferry()
        .args(["bench", &ctl, "--json"])
        .output()
        .expect("run bench");
    let _ = publisher.kill();
    let _ = publisher.wait();
    let v = json_failure(&out);
    assert_eq!(v["error"]["kind"], "not_ferry", "{v}");
    // Named by the probe (the message) or by the JSON line it answered the hello with (the
    // hint), whichever came first.
    let said = format!("{} {}", v["error"]["message"], v["error"]["hint"]);
    assert!(said.contains("a `ferry publish` control port"), "{said}");
}

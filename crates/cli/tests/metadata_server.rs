//! `ferry metadata-server` as Mooncake's clients use it (libcurl: `GET`/`PUT`/`DELETE
//! /metadata?key=K` with the key escaped by `curl_easy_escape`, one kept-alive connection per
//! thread, `Expect: 100-continue` before a large PUT body), spoken by hand over a TcpStream;
//! and as Ferry's engines use it (`Ferry-Owner-Token`), under the floods of issue 46.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// A test fails rather than hangs when an answer never comes.
const READ_TIMEOUT: Duration = Duration::from_secs(60);
/// The server's limits, as documented.
const MAX_BODY: usize = 4 << 20;
const MAX_HEAD: usize = 16 << 10;
const MAX_CONNECTIONS: usize = 256;
const MAX_BYTES: usize = 128 << 20;

/// A `ferry metadata-server` on a free loopback port; killed when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start() -> Result<Self> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["metadata-server", "--listen", "127.0.0.1:0"])
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .spawn()
            .context("spawn ferry metadata-server")?;
        let stdout = child.stdout.take().context("stdout")?;
        let mut server = Self {
            child,
            addr: String::new(),
        };
        for line in BufReader::new(stdout).lines() {
            if let Some(a) = line?.strip_prefix("metadata server listening on ") {
                server.addr = a.trim().to_owned();
                return Ok(server);
            }
        }
        bail!(
            "ferry metadata-server ended without printing its address: {:?}",
            server.child.wait()
        )
    }

    fn connect(&self) -> Result<Client> {
        let stream = TcpStream::connect(&self.addr)?;
        stream.set_read_timeout(Some(READ_TIMEOUT))?;
        Ok(Client {
            reader: BufReader::new(stream.try_clone()?),
            stream,
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Client {
    stream: TcpStream,
    reader: BufReader<TcpStream>,
}

#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A request as libcurl writes one.
fn request(method: &str, target: &str, extra: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!("{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n{extra}");
    if !body.is_empty() || method == "PUT" {
        r.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    r.push_str("\r\n");
    let mut r = r.into_bytes();
    r.extend_from_slice(body);
    r
}

impl Client {
    fn send(&mut self, bytes: &[u8]) -> Result<()> {
        Ok(self.stream.write_all(bytes)?)
    }

    /// One request and its answer.
    fn call(&mut self, method: &str, target: &str, body: &[u8]) -> Result<Answer> {
        self.send(&request(method, target, "", body))?;
        self.answer(method == "HEAD")
    }

    /// One request with owner token `token` and its answer.
    fn call_as(&mut self, token: &str, method: &str, target: &str, body: &[u8]) -> Result<Answer> {
        let extra = format!("Ferry-Owner-Token: {token}\r\n");
        self.send(&request(method, target, &extra, body))?;
        self.answer(false)
    }

    fn line(&mut self) -> Result<String> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            bail!("the server closed the connection");
        }
        line.strip_suffix("\r\n")
            .map(str::to_owned)
            .with_context(|| format!("line without CRLF: {line:?}"))
    }

    /// Reads one answer (a HEAD request's has no body).
    fn answer(&mut self, head_only: bool) -> Result<Answer> {
        let status_line = self.line()?;
        let status = status_line
            .strip_prefix("HTTP/1.1 ")
            .and_then(|s| s.get(..3))
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("status line {status_line:?}"))?;
        let mut headers = Vec::new();
        loop {
            let line = self.line()?;
            if line.is_empty() {
                break;
            }
            let (n, v) = line.split_once(':').context("header")?;
            headers.push((n.to_owned(), v.trim().to_owned()));
        }
        let mut answer = Answer {
            status,
            headers,
            body: Vec::new(),
        };
        let len: usize = answer
            .header("content-length")
            .context("Content-Length")?
            .parse()?;
        if !head_only {
            answer.body = vec![0; len];
            self.reader.read_exact(&mut answer.body)?;
        }
        Ok(answer)
    }

    /// Whether the server closed the connection (after anything it sent was read).
    fn closed(&mut self) -> bool {
        let mut rest = Vec::new();
        match self.reader.read_to_end(&mut rest) {
            Ok(_) => rest.is_empty(),
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

#[test]
fn put_get_delete_on_one_kept_alive_connection() -> Result<()> {
    let server = Server::start()?;
    let mut c = server.connect()?;
    // As `curl_easy_escape("mooncake/ram/10.0.0.1:12345")` writes it.
    let key = "/metadata?key=mooncake%2Fram%2F10.0.0.1%3A12345";
    let value = br#"{"name":"10.0.0.1:12345","protocol":"tcp","buffers":[]}"#;

    let a = c.call("GET", key, b"")?;
    assert_eq!((a.status, a.text().as_str()), (404, "metadata not found"));
    let a = c.call("PUT", key, value)?;
    assert_eq!((a.status, a.text().as_str()), (200, "metadata updated"));
    assert_eq!(a.header("connection"), None, "kept alive");
    let a = c.call("GET", key, b"")?;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("content-type"), Some("application/json"));
    assert_eq!(a.body, value);
    // The same key written otherwise.
    let a = c.call("GET", "/metadata?key=mooncake/ram/10.0.0.1:12345", b"")?;
    assert_eq!(a.body, value);

    // Another connection sees it.
    let mut other = server.connect()?;
    assert_eq!(other.call("GET", key, b"")?.body, value);

    let a = c.call("DELETE", key, b"")?;
    assert_eq!((a.status, a.text().as_str()), (200, "metadata deleted"));
    let a = c.call("DELETE", key, b"")?;
    assert_eq!((a.status, a.text().as_str()), (404, "metadata not found"));
    assert_eq!(other.call("GET", key, b"")?.status, 404);
    Ok(())
}

#[test]
fn pipelined_requests_are_answered_in_order() -> Result<()> {
    let server = Server::start()?;
    let mut c = server.connect()?;
    let mut batch = request("PUT", "/metadata?key=a", "", b"1");
    batch.extend(request("PUT", "/metadata?key=b", "", b"22"));
    batch.extend(request("GET", "/metadata?key=a", "", b""));
    batch.extend(request(
        "GET",
        "/metadata?key=b",
        "Connection: close\r\n",
        b"",
    ));
    c.send(&batch)?;
    assert_eq!(c.answer(false)?.status, 200);
    assert_eq!(c.answer(false)?.status, 200);
    assert_eq!(c.answer(false)?.body, b"1");
    let last = c.answer(false)?;
    assert_eq!(last.body, b"22");
    assert_eq!(last.header("connection"), Some("close"));
    assert!(c.closed(), "closed after `Connection: close`");
    Ok(())
}

#[test]
fn expect_100_continue_is_answered_before_the_body() -> Result<()> {
    let server = Server::start()?;
    let mut c = server.connect()?;
    // Larger than libcurl's threshold for sending `Expect: 100-continue` (1 MiB), and than
    // what the server writes with its head in one piece.
    let value: Vec<u8> = (0..(3 << 20) / 2).map(|i| b'a' + (i % 26) as u8).collect();
    let head = format!(
        "PUT /metadata?key=big HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nExpect: 100-continue\r\n\r\n",
        value.len()
    );
    c.send(head.as_bytes())?;
    assert_eq!(c.line()?, "HTTP/1.1 100 Continue");
    assert_eq!(c.line()?, "");
    c.send(&value)?;
    let a = c.answer(false)?;
    assert_eq!((a.status, a.text().as_str()), (200, "metadata updated"));
    let a = c.call("GET", "/metadata?key=big", b"")?;
    assert_eq!(a.status, 200);
    assert!(a.body == value, "the value comes back whole");
    Ok(())
}

#[test]
fn refusals_keep_the_connection() -> Result<()> {
    let server = Server::start()?;
    let mut c = server.connect()?;
    for target in ["/metadata", "/metadata?key=", "/metadata?other=1"] {
        let a = c.call("GET", target, b"")?;
        assert_eq!(
            (a.status, a.text().as_str()),
            (400, "Missing key parameter")
        );
    }
    assert_eq!(c.call("PUT", "/metadata?key=%zz", b"x")?.status, 400);
    assert_eq!(c.call("GET", "/other?key=a", b"")?.status, 404);
    let a = c.call("POST", "/metadata?key=a", b"{}")?;
    assert_eq!(a.status, 405);
    assert_eq!(a.header("allow"), Some("GET, PUT, DELETE"));
    let a = c.call("HEAD", "/metadata?key=a", b"")?;
    assert_eq!(a.status, 405);
    let a = c.call("GET", "/health", b"")?;
    assert_eq!((a.status, a.text().as_str()), (200, "OK"));
    Ok(())
}

#[test]
fn rpc_meta_keys_are_claimed_once() -> Result<()> {
    let server = Server::start()?;
    let mut c = server.connect()?;
    let key = "/metadata?key=mooncake%2Frpc_meta%2F10.0.0.1%3A12384";
    let mine = br#"{"ip_or_host_name":"10.0.0.1","rpc_port":15228}"#;
    let theirs = br#"{"ip_or_host_name":"10.0.0.1","rpc_port":16000}"#;
    assert_eq!(c.call("PUT", key, mine)?.text(), "metadata updated");
    let a = c.call("PUT", key, mine)?;
    assert_eq!((a.status, a.text().as_str()), (200, "metadata unchanged"));
    let a = c.call("PUT", key, theirs)?;
    assert_eq!(
        (a.status, a.text().as_str()),
        (400, "Duplicate rpc_meta key not allowed")
    );
    assert_eq!(c.call("GET", key, b"")?.body, mine);
    Ok(())
}

#[test]
fn a_body_past_the_limit_is_413_unread() -> Result<()> {
    let server = Server::start()?;
    for expect in ["Expect: 100-continue\r\n", ""] {
        let mut c = server.connect()?;
        let head = format!(
            "PUT /metadata?key=k HTTP/1.1\r\nHost: x\r\n{expect}Content-Length: {}\r\n\r\n",
            MAX_BODY + 1
        );
        c.send(head.as_bytes())?;
        let a = c.answer(false)?;
        assert_eq!(a.status, 413, "{a:?}");
        assert_eq!(a.header("connection"), Some("close"));
        assert!(c.closed());
    }
    // Nothing was stored.
    assert_eq!(
        server
            .connect()?
            .call("GET", "/metadata?key=k", b"")?
            .status,
        404
    );
    Ok(())
}

#[test]
fn malformed_requests_are_answered_and_closed() -> Result<()> {
    let server = Server::start()?;
    let mut huge = b"GET /metadata?key=k HTTP/1.1\r\nX: ".to_vec();
    huge.resize(MAX_HEAD + 1, b'a');
    let cases: [(&[u8], u16); 4] = [
        (&huge, 431),
        (b"GET /metadata?key=k HTTP/1.1\r\nNo colon\r\n\r\n", 400),
        (
            b"PUT /metadata?key=k HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
            501,
        ),
        (b"GET /metadata?key=k HTTP/3\r\n\r\n", 505),
    ];
    for (raw, status) in cases {
        let mut c = server.connect()?;
        c.send(raw)?;
        let a = c.answer(false)?;
        assert_eq!(a.status, status, "{a:?}");
        assert!(c.closed());
    }
    Ok(())
}

/// Issue 46: 256 idle connections locked every engine out. Past the cap the oldest connection
/// of the source holding the most makes room, so a client arriving after 300 idle ones (from
/// the same address, the worst case) still gets its answers.
#[test]
fn idle_connections_past_the_cap_give_way_to_a_real_client() -> Result<()> {
    let server = Server::start()?;
    let mut held = Vec::new();
    for _ in 0..MAX_CONNECTIONS + 44 {
        held.push(server.connect()?);
    }
    let mut engine = server.connect()?;
    let key = "/metadata?key=mooncake%2Fferry%2Fdecode";
    let a = engine.call_as("decode-0123456789abcdef", "PUT", key, b"{}")?;
    assert_eq!((a.status, a.text().as_str()), (200, "metadata updated"));
    assert_eq!(engine.call("GET", key, b"")?.body, b"{}");
    // The oldest idle ones were closed to make room; the newest are served.
    assert!(held[0].closed(), "the oldest idle connection was closed");
    let last = held.len() - 1;
    assert_eq!(held[last].call("GET", "/health", b"")?.status, 200);
    Ok(())
}

/// Issue 46: a stranger's PUT over an engine's record returned 200. A record PUT with a
/// `Ferry-Owner-Token` is replaced and deleted only with it; reads stay open.
#[test]
fn a_strangers_overwrite_and_delete_of_an_owned_record_are_refused() -> Result<()> {
    let server = Server::start()?;
    let key = "/metadata?key=mooncake%2Fferry%2Fprefill";
    let owner = "prefill-7c1f0d2e9a4b4f3c8d6e";
    let mut victim = server.connect()?;
    let mine = br#"{"ferry_addr":"10.0.0.1:7400","name":"prefill"}"#;
    assert_eq!(victim.call_as(owner, "PUT", key, mine)?.status, 200);

    let mut stranger = server.connect()?;
    let theirs = br#"{"ferry_addr":"10.6.6.6:7400","name":"prefill"}"#;
    for a in [
        stranger.call("PUT", key, theirs)?,
        stranger.call_as("stranger-0123456789abcdef", "PUT", key, theirs)?,
        stranger.call("DELETE", key, b"")?,
        stranger.call_as("stranger-0123456789abcdef", "DELETE", key, b"")?,
    ] {
        assert_eq!(
            (a.status, a.text().as_str()),
            (
                403,
                "metadata owned by another client: its Ferry-Owner-Token is required"
            )
        );
    }
    assert_eq!(
        stranger.call("GET", key, b"")?.body,
        mine,
        "read by all, unchanged"
    );

    // Its owner replaces and deletes it.
    let moved = br#"{"ferry_addr":"10.0.0.1:7401","name":"prefill"}"#;
    assert_eq!(victim.call_as(owner, "PUT", key, moved)?.status, 200);
    assert_eq!(stranger.call("GET", key, b"")?.body, moved);
    assert_eq!(victim.call_as(owner, "DELETE", key, b"")?.status, 200);
    assert_eq!(stranger.call("GET", key, b"")?.status, 404);

    // A client that knows no token (Mooncake's) keeps Mooncake's protocol.
    let ram = "/metadata?key=mooncake%2Fram%2F10.0.0.2%3A12345";
    assert_eq!(stranger.call("PUT", ram, b"1")?.status, 200);
    assert_eq!(victim.call("PUT", ram, b"2")?.status, 200);
    assert_eq!(stranger.call("DELETE", ram, b"")?.status, 200);
    Ok(())
}

/// The server's resident memory in bytes (`VmRSS`).
fn rss(pid: u32) -> Result<usize> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .context("VmRSS")?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()?;
    Ok(kib << 10)
}

/// Issue 46: 12 PUTs of 64 MiB took the server from 14 MB to 801 MB. A record is at most
/// 4 MiB (past it 413, unread), and the store at most 128 MiB of keys and values (past it 507,
/// nothing stored): a flood of the largest records is refused when the store is full, the
/// memory stays bounded, and an engine's record (KiB) still fits.
#[test]
fn a_size_flood_is_refused_and_memory_stays_bounded() -> Result<()> {
    let server = Server::start()?;
    let mut c = server.connect()?;
    for i in 0..12 {
        let head = format!(
            "PUT /metadata?key=huge{i} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
            64 << 20
        );
        let mut c = server.connect()?;
        c.send(head.as_bytes())?;
        let a = c.answer(false)?;
        assert_eq!(
            (a.status, a.text().as_str()),
            (413, "request body too large: a record is at most 4 MiB\n")
        );
    }
    let value = vec![b'v'; MAX_BODY];
    let mut stored = 0;
    let full = loop {
        let a = c.call("PUT", &format!("/metadata?key=flood{stored:03}"), &value)?;
        if a.status != 200 {
            break a;
        }
        stored += 1;
        assert!(
            stored <= MAX_BYTES / MAX_BODY,
            "{stored} records of 4 MiB stored"
        );
    };
    assert_eq!(
        (full.status, full.text().as_str()),
        (507, "metadata store full: no room for this record's bytes")
    );
    // 128 MiB hold 31 records of 4 MiB and their keys, not 32.
    assert_eq!(stored, MAX_BYTES / MAX_BODY - 1);
    let rss = rss(server.child.id())?;
    assert!(
        rss < MAX_BYTES + (64 << 20),
        "the server holds {} MiB",
        rss >> 20
    );
    let record = "/metadata?key=mooncake%2Fferry%2Fdecode";
    assert_eq!(
        c.call_as("decode-0123456789abcdef", "PUT", record, &[b'r'; 4096])?
            .status,
        200
    );
    assert_eq!(c.call("GET", "/metadata?key=flood000", b"")?.body, value);
    Ok(())
}

/// Listening off loopback warns on stderr (the log), before the address is printed; on
/// loopback it does not.
#[test]
fn listening_off_loopback_warns() -> Result<()> {
    for (listen, warns) in [("0.0.0.0:0", true), ("127.0.0.1:0", false)] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["metadata-server", "--listen", listen])
            .env("NO_COLOR", "1")
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("spawn ferry metadata-server")?;
        let mut stdout = BufReader::new(child.stdout.take().context("stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        assert!(
            line.starts_with("metadata server listening on "),
            "{line:?}"
        );
        child.kill()?;
        child.wait()?;
        let mut log = String::new();
        child
            .stderr
            .take()
            .context("stderr")?
            .read_to_string(&mut log)?;
        assert_eq!(
            log.contains("metadata server listening on an address other than loopback"),
            warns,
            "{listen}: {log:?}"
        );
    }
    Ok(())
}

#[test]
fn sigterm_stops_it_cleanly() -> Result<()> {
    let mut server = Server::start()?;
    let status = Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()?;
    assert!(status.success());
    let exit = server.child.wait()?;
    // As every command stopped by a signal: 128 + 15 (what it held is printed, issue 51).
    assert_eq!(exit.code(), Some(143), "{exit:?}");
    Ok(())
}

//! `ferry metadata-server` as Mooncake's clients use it (libcurl: `GET`/`PUT`/`DELETE
//! /metadata?key=K` with the key escaped by `curl_easy_escape`, one kept-alive connection per
//! thread, `Expect: 100-continue` before a large PUT body), spoken by hand over a TcpStream.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// A test fails rather than hangs when an answer never comes.
const READ_TIMEOUT: Duration = Duration::from_secs(60);
/// The server's limits, as documented.
const MAX_BODY: usize = 64 << 20;
const MAX_HEAD: usize = 16 << 10;
const MAX_CONNECTIONS: usize = 256;

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

#[test]
fn connections_past_the_cap_are_closed_at_once() -> Result<()> {
    let server = Server::start()?;
    let mut held = Vec::new();
    for _ in 0..MAX_CONNECTIONS {
        held.push(server.connect()?);
    }
    // Accepted in order: this one finds every slot taken.
    let mut extra = server.connect()?;
    assert!(extra.closed(), "connection {} closed", MAX_CONNECTIONS + 1);
    // The ones held are served.
    let a = held[0].call("GET", "/health", b"")?;
    assert_eq!(a.status, 200);
    let last = held.len() - 1;
    assert_eq!(held[last].call("GET", "/health", b"")?.status, 200);
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
    assert!(exit.success(), "{exit:?}");
    Ok(())
}

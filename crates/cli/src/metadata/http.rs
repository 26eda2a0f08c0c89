//! The HTTP/1.1 side of the metadata server, IO-free: a connection's state machine ([`Conn`])
//! that takes the bytes a socket read and says what to do next ([`Next`]), and the
//! [`Response`] it writes.
//!
//! What it accepts: `METHOD SP TARGET SP HTTP/1.x` and its header lines (CRLF or bare LF line
//! ends, empty lines before the request line skipped), a body framed by `Content-Length` (none
//! without it), `Expect: 100-continue` (answered before the body is read), requests pipelined
//! or one after another on a kept-alive connection (HTTP/1.1 unless `Connection: close`;
//! HTTP/1.0 closes after each answer). Of the other headers only [`OWNER_TOKEN`] is read.
//!
//! What it refuses, answering once and closing: a malformed head (400), a head past
//! [`MAX_HEAD`] (431), a body past [`MAX_BODY`] (413, before any of it is read), any
//! `Transfer-Encoding` (501: no Mooncake client sends chunked bodies), a version other than
//! 1.0 or 1.1 (505), two different [`OWNER_TOKEN`]s (400), a request begun but not finished
//! when the driver's deadline passes (408).

use std::sync::Arc;

/// The longest request head (request line, header lines and the empty line ending them).
pub(crate) const MAX_HEAD: usize = 16 << 10;
/// The largest request body, and so the largest record: Mooncake's records (segment
/// descriptors, RPC addresses) and Ferry's are KiB; a body past it is refused before it is read.
pub(crate) const MAX_BODY: usize = 4 << 20;

/// The header that carries a record's owner token (`Ferry-Owner-Token: SECRET`): see
/// [`super::store`].
pub(crate) const OWNER_TOKEN: &str = "ferry-owner-token";

/// `HTTP/1.1 100 Continue`: what a client sending `Expect: 100-continue` waits for.
pub(crate) const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// An answer: status, content type, body; [`Response::encode`] writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Response {
    /// The status code (200, 404...).
    pub(crate) status: u16,
    /// The `Content-Type`.
    pub(crate) content_type: &'static str,
    /// The `Allow` header of a 405: the methods the resource takes.
    pub(crate) allow: Option<&'static str>,
    /// The body.
    pub(crate) body: Body,
}

/// A response body: a fixed text, or stored bytes shared with the store (not copied).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Body {
    /// A fixed message.
    Text(&'static str),
    /// A stored value.
    Bytes(Arc<Vec<u8>>),
}

impl Body {
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            Body::Text(t) => t.as_bytes(),
            Body::Bytes(b) => b,
        }
    }
}

impl Response {
    /// A `text/plain` answer.
    pub(crate) fn text(status: u16, text: &'static str) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            allow: None,
            body: Body::Text(text),
        }
    }

    /// The status line and headers, which the body follows (except in the answer to a HEAD
    /// request, whose `Content-Length` is still the body's). `close` adds `Connection: close`.
    pub(crate) fn encode_head(&self, close: bool) -> Vec<u8> {
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n",
            self.status,
            reason(self.status),
            self.content_type,
            self.body.as_bytes().len()
        );
        if let Some(allow) = self.allow {
            out.push_str("Allow: ");
            out.push_str(allow);
            out.push_str("\r\n");
        }
        if close {
            out.push_str("Connection: close\r\n");
        }
        out.push_str("\r\n");
        out.into_bytes()
    }
}

/// The reason phrase of the statuses this server sends.
fn reason(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        501 => "Not Implemented",
        505 => "HTTP Version Not Supported",
        507 => "Insufficient Storage",
        _ => "",
    }
}

/// A complete request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    /// The method, as sent (methods are case-sensitive).
    pub(crate) method: String,
    /// The request target, as sent (`/metadata?key=...`).
    pub(crate) target: String,
    /// The body (empty without `Content-Length`).
    pub(crate) body: Vec<u8>,
    /// Whether the connection stays open after the answer.
    pub(crate) keep_alive: bool,
    /// The [`OWNER_TOKEN`] header's value (trimmed), if sent.
    pub(crate) owner_token: Option<Vec<u8>>,
}

impl Request {
    /// Whether the answer carries no body (a HEAD request's).
    pub(crate) fn head_only(&self) -> bool {
        self.method == "HEAD"
    }
}

/// What the driver does next.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Read more bytes and [`Conn::feed`] them.
    Read,
    /// Write [`CONTINUE`], then read the body.
    Continue,
    /// Answer this request (and close after it unless it keeps the connection alive).
    Request(Request),
    /// Write this answer and close: the connection cannot go on.
    Reject(Response),
}

/// The parsed head of a request whose body is still to come.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Head {
    method: String,
    target: String,
    keep_alive: bool,
    content_length: usize,
    expect_continue: bool,
    owner_token: Option<Vec<u8>>,
}

/// One connection's requests, from the bytes read to complete requests. Bytes past a request
/// stay for the next (pipelining).
#[derive(Debug, Default)]
pub(crate) struct Conn {
    buf: Vec<u8>,
    /// The request whose body is being read, and whether `100 Continue` went out for it.
    body_of: Option<(Head, bool)>,
}

impl Conn {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Takes bytes the socket read.
    pub(crate) fn feed(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Whether the next bytes are a request head (else a body): the driver's deadline differs.
    pub(crate) fn reading_head(&self) -> bool {
        self.body_of.is_none()
    }

    /// What to answer when the driver's deadline passes: nothing on an idle connection (it is
    /// just closed), 408 when a request was begun.
    pub(crate) fn timed_out(&self) -> Option<Response> {
        (self.body_of.is_some() || !self.buf.is_empty())
            .then(|| Response::text(408, "request not received in time\n"))
    }

    /// What to do with the bytes fed so far.
    pub(crate) fn poll(&mut self) -> Next {
        if self.body_of.is_none() {
            match parse_head(&self.buf) {
                Err(rejected) => return Next::Reject(rejected),
                Ok(None) if self.buf.len() > MAX_HEAD => {
                    return Next::Reject(Response::text(431, "request head too large\n"));
                }
                Ok(None) => return Next::Read,
                Ok(Some((head, consumed))) => {
                    self.buf.drain(..consumed);
                    if head.content_length > MAX_BODY {
                        return Next::Reject(Response::text(
                            413,
                            "request body too large: a record is at most 4 MiB\n",
                        ));
                    }
                    self.body_of = Some((head, false));
                }
            }
        }
        let Some((head, continued)) = &mut self.body_of else {
            return Next::Read;
        };
        let len = head.content_length;
        if self.buf.len() >= len {
            let rest = self.buf.split_off(len);
            let body = std::mem::replace(&mut self.buf, rest);
            let Some((head, _)) = self.body_of.take() else {
                return Next::Read;
            };
            return Next::Request(Request {
                method: head.method,
                target: head.target,
                body,
                keep_alive: head.keep_alive,
                owner_token: head.owner_token,
            });
        }
        if head.expect_continue && !*continued {
            *continued = true;
            return Next::Continue;
        }
        Next::Read
    }
}

fn bad(text: &'static str) -> Response {
    Response::text(400, text)
}

/// Whether `b` may be in a token (a method or a header name).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The head at the start of `buf` and the bytes it takes (leading empty lines included), `None`
/// while it is incomplete.
fn parse_head(buf: &[u8]) -> Result<Option<(Head, usize)>, Response> {
    let mut pos = 0;
    let mut lines: Vec<&[u8]> = Vec::new();
    let end = loop {
        let Some(nl) = buf[pos..].iter().position(|b| *b == b'\n') else {
            return Ok(None);
        };
        let line = &buf[pos..pos + nl];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        pos += nl + 1;
        if pos > MAX_HEAD {
            return Err(Response::text(431, "request head too large\n"));
        }
        if line.is_empty() {
            if lines.is_empty() {
                continue; // empty lines before the request line
            }
            break pos;
        }
        lines.push(line);
    };
    let (request_line, fields) = lines
        .split_first()
        .ok_or_else(|| bad("no request line\n"))?;
    let mut words = request_line.split(|b| *b == b' ');
    let (Some(method), Some(target), Some(version), None) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return Err(bad("malformed request line\n"));
    };
    if method.is_empty() || !method.iter().all(|b| is_tchar(*b)) {
        return Err(bad("malformed method\n"));
    }
    if target.is_empty() || !target.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(bad("malformed request target\n"));
    }
    let http11 = match version {
        b"HTTP/1.1" => true,
        b"HTTP/1.0" => false,
        v if v.starts_with(b"HTTP/") => {
            return Err(Response::text(505, "HTTP/1.1 or HTTP/1.0 only\n"));
        }
        _ => return Err(bad("malformed HTTP version\n")),
    };
    let mut content_length: Option<u64> = None;
    let mut close = !http11;
    let mut expect_continue = false;
    let mut owner_token: Option<&[u8]> = None;
    for field in fields {
        if field.starts_with(b" ") || field.starts_with(b"\t") {
            return Err(bad("folded header lines are not accepted\n"));
        }
        let colon = field
            .iter()
            .position(|b| *b == b':')
            .ok_or_else(|| bad("header line without a colon\n"))?;
        let (name, value) = (&field[..colon], &field[colon + 1..]);
        if name.is_empty() || !name.iter().all(|b| is_tchar(*b)) {
            return Err(bad("malformed header name\n"));
        }
        if value.iter().any(|b| matches!(b, b'\r' | b'\0')) {
            return Err(bad("malformed header value\n"));
        }
        let value = value.trim_ascii();
        if name.eq_ignore_ascii_case(b"content-length") {
            if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
                return Err(bad("malformed Content-Length\n"));
            }
            // All digits: parsing fails only past u64, which is past MAX_BODY too.
            let n = std::str::from_utf8(value)
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(u64::MAX);
            if content_length.is_some_and(|first| first != n) {
                return Err(bad("conflicting Content-Length headers\n"));
            }
            content_length = Some(n);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            return Err(Response::text(
                501,
                "Transfer-Encoding is not supported: send a Content-Length\n",
            ));
        } else if name.eq_ignore_ascii_case(b"connection") {
            for token in value.split(|b| *b == b',') {
                if token.trim_ascii().eq_ignore_ascii_case(b"close") {
                    close = true;
                }
            }
        } else if name.eq_ignore_ascii_case(b"expect") {
            expect_continue = http11 && value.eq_ignore_ascii_case(b"100-continue");
        } else if name.eq_ignore_ascii_case(OWNER_TOKEN.as_bytes()) {
            if owner_token.is_some_and(|first| first != value) {
                return Err(bad("conflicting Ferry-Owner-Token headers\n"));
            }
            owner_token = Some(value);
        }
    }
    let content_length = usize::try_from(content_length.unwrap_or(0)).unwrap_or(usize::MAX);
    // Checked as ASCII above.
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    Ok(Some((
        Head {
            method: text(method),
            target: text(target),
            keep_alive: !close,
            content_length,
            expect_continue,
            owner_token: owner_token.map(<[u8]>::to_vec),
        },
        end,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: &str, target: &str, body: &[u8], keep_alive: bool) -> Next {
        Next::Request(Request {
            method: method.into(),
            target: target.into(),
            body: body.to_vec(),
            keep_alive,
            owner_token: None,
        })
    }

    fn status(next: Next) -> u16 {
        match next {
            Next::Reject(r) => r.status,
            other => panic!("expected a rejection, got {other:?}"),
        }
    }

    fn fed(bytes: &[u8]) -> Conn {
        let mut c = Conn::new();
        c.feed(bytes);
        c
    }

    #[test]
    fn a_get_without_a_body() {
        let mut c = fed(b"GET /metadata?key=a HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(c.poll(), request("GET", "/metadata?key=a", b"", true));
        assert_eq!(c.poll(), Next::Read);
        assert!(c.reading_head() && c.timed_out().is_none());
    }

    #[test]
    fn a_head_split_byte_by_byte() {
        let raw = b"PUT /metadata?key=a HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc";
        let mut c = Conn::new();
        for (i, b) in raw.iter().enumerate() {
            c.feed(&[*b]);
            let next = c.poll();
            if i + 1 < raw.len() {
                assert_eq!(next, Next::Read, "after {i} bytes");
                assert!(
                    c.timed_out().is_some(),
                    "a begun request times out with 408"
                );
            } else {
                assert_eq!(next, request("PUT", "/metadata?key=a", b"abc", true));
            }
        }
    }

    #[test]
    fn pipelined_requests_come_out_one_by_one() {
        let mut c = fed(
            b"PUT /m HTTP/1.1\r\nContent-Length: 2\r\n\r\nxyGET /n HTTP/1.1\r\n\r\nDELETE /o HTTP/1.1\r\nConnection: close\r\n\r\n",
        );
        assert_eq!(c.poll(), request("PUT", "/m", b"xy", true));
        assert_eq!(c.poll(), request("GET", "/n", b"", true));
        assert_eq!(c.poll(), request("DELETE", "/o", b"", false));
        assert_eq!(c.poll(), Next::Read);
    }

    #[test]
    fn bare_line_feeds_and_leading_empty_lines() {
        let mut c = fed(b"\r\n\nGET /a HTTP/1.1\nX: y\n\n");
        assert_eq!(c.poll(), request("GET", "/a", b"", true));
    }

    #[test]
    fn http10_and_connection_close_end_the_connection() {
        assert_eq!(
            fed(b"GET /a HTTP/1.0\r\n\r\n").poll(),
            request("GET", "/a", b"", false)
        );
        assert_eq!(
            fed(b"GET /a HTTP/1.1\r\nConnection: keep-alive, Close\r\n\r\n").poll(),
            request("GET", "/a", b"", false)
        );
    }

    #[test]
    fn expect_continue_is_answered_once_before_the_body() {
        let mut c = fed(b"PUT /a HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n");
        assert_eq!(c.poll(), Next::Continue);
        assert!(!c.reading_head());
        assert_eq!(c.poll(), Next::Read);
        c.feed(b"ab");
        assert_eq!(c.poll(), Next::Read);
        c.feed(b"cd");
        assert_eq!(c.poll(), request("PUT", "/a", b"abcd", true));
    }

    #[test]
    fn expect_continue_is_not_sent_when_the_body_is_here() {
        let mut c = fed(b"PUT /a HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\nz");
        assert_eq!(c.poll(), request("PUT", "/a", b"z", true));
        // Nor for an empty body, nor over HTTP/1.0.
        let mut c = fed(b"PUT /a HTTP/1.1\r\nExpect: 100-continue\r\n\r\n");
        assert_eq!(c.poll(), request("PUT", "/a", b"", true));
        let mut c = fed(b"PUT /a HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n");
        assert_eq!(c.poll(), Next::Read);
    }

    #[test]
    fn a_body_too_large_is_refused_before_it_is_read() {
        let head = format!(
            "PUT /a HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY + 1
        );
        assert_eq!(status(fed(head.as_bytes()).poll()), 413);
        let huge = b"PUT /a HTTP/1.1\r\nContent-Length: 99999999999999999999999999\r\n\r\n";
        assert_eq!(status(fed(huge).poll()), 413);
        let head = format!("PUT /a HTTP/1.1\r\nContent-Length: {MAX_BODY}\r\n\r\n");
        assert_eq!(fed(head.as_bytes()).poll(), Next::Read);
    }

    #[test]
    fn an_oversize_head_is_refused() {
        // Unfinished and already past the limit.
        let mut raw = b"GET /a HTTP/1.1\r\nX: ".to_vec();
        raw.resize(MAX_HEAD + 1, b'a');
        assert_eq!(status(fed(&raw).poll()), 431);
        // Complete, but its end is past the limit.
        let mut raw = b"GET /a HTTP/1.1\r\nX: ".to_vec();
        raw.resize(MAX_HEAD, b'a');
        raw.extend_from_slice(b"\r\n\r\n");
        assert_eq!(status(fed(&raw).poll()), 431);
        // Empty lines count too.
        assert_eq!(status(fed(&b"\r\n".repeat(MAX_HEAD)).poll()), 431);
        // Up to the limit is fine.
        let mut raw = b"GET /a HTTP/1.1\r\nX: ".to_vec();
        raw.resize(MAX_HEAD - 4, b'a');
        raw.extend_from_slice(b"\r\n\r\n");
        assert!(matches!(fed(&raw).poll(), Next::Request(_)));
    }

    #[test]
    fn malformed_heads_are_400() {
        for raw in [
            &b"GET /a\r\n\r\n"[..],
            b"GET  /a HTTP/1.1\r\n\r\n",
            b"GET /a HTTP/1.1 x\r\n\r\n",
            b"G(T /a HTTP/1.1\r\n\r\n",
            b"GET /\xff HTTP/1.1\r\n\r\n",
            b"GET /a FTP/1.1\r\n\r\n",
            b"GET /a HTTP/1.1\r\nNoColon\r\n\r\n",
            b"GET /a HTTP/1.1\r\nBad Name: x\r\n\r\n",
            b"GET /a HTTP/1.1\r\n: x\r\n\r\n",
            b"GET /a HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",
            b"GET /a HTTP/1.1\r\nX: a\rb\r\n\r\n",
            b"PUT /a HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            b"PUT /a HTTP/1.1\r\nContent-Length: +1\r\n\r\n",
            b"PUT /a HTTP/1.1\r\nContent-Length: 1, 1\r\n\r\n",
            b"PUT /a HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            b"PUT /a HTTP/1.1\r\nContent-Length:\r\n\r\n",
        ] {
            assert_eq!(
                status(fed(raw).poll()),
                400,
                "{:?}",
                String::from_utf8_lossy(raw)
            );
        }
        // The same Content-Length twice is one.
        let mut c = fed(b"PUT /a HTTP/1.1\r\nContent-Length: 1\r\ncontent-length:  1 \r\n\r\nq");
        assert_eq!(c.poll(), request("PUT", "/a", b"q", true));
    }

    #[test]
    fn the_owner_token_header_is_read_once() {
        let mut c =
            fed(b"PUT /a HTTP/1.1\r\nferry-OWNER-token:  s3cret \r\nContent-Length: 1\r\n\r\nz");
        let Next::Request(r) = c.poll() else {
            panic!("a request")
        };
        assert_eq!(r.owner_token.as_deref(), Some(&b"s3cret"[..]));
        // The same value twice is one; two values are refused.
        let raw = b"DELETE /a HTTP/1.1\r\nFerry-Owner-Token: x\r\nFerry-Owner-Token: x\r\n\r\n";
        assert!(
            matches!(fed(raw).poll(), Next::Request(r) if r.owner_token.as_deref() == Some(b"x"))
        );
        let raw = b"DELETE /a HTTP/1.1\r\nFerry-Owner-Token: x\r\nFerry-Owner-Token: y\r\n\r\n";
        assert_eq!(status(fed(raw).poll()), 400);
    }

    #[test]
    fn chunked_bodies_and_other_versions_are_refused() {
        let raw = b"PUT /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n";
        assert_eq!(status(fed(raw).poll()), 501);
        assert_eq!(status(fed(b"GET /a HTTP/2.0\r\n\r\n").poll()), 505);
    }

    #[test]
    fn responses_encode_their_length_and_close() {
        let r = Response::text(404, "metadata not found");
        let head = String::from_utf8(r.encode_head(false)).unwrap();
        assert_eq!(
            head,
            "HTTP/1.1 404 Not Found\r\nContent-Type: text/plain; charset=utf-8\r\n\
             Content-Length: 18\r\n\r\n"
        );
        let mut r = Response::text(405, "x");
        r.allow = Some("GET, PUT, DELETE");
        let head = String::from_utf8(r.encode_head(true)).unwrap();
        assert!(head.contains("\r\nAllow: GET, PUT, DELETE\r\nConnection: close\r\n\r\n"));
        assert!(head.starts_with("HTTP/1.1 405 Method Not Allowed\r\n"));
    }
}

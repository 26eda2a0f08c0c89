//! Control frames over blocking sockets: the handshake and the attach of data streams. The
//! bytes are exactly those of the TCP transport (`ferry_core::wire`).

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use ferry_core::Error;
use ferry_core::wire::{ControlFrame, Hello, StreamAttach};

pub(crate) use ferry_net::{read_frame, tune, write_frame};

fn connect(
    addr: SocketAddr,
    timeout: Duration,
    buffer: Option<usize>,
    dead_peer: Option<Duration>,
) -> Result<TcpStream, Error> {
    let stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| {
        if e.kind() == std::io::ErrorKind::TimedOut {
            Error::Timeout {
                what: "TCP connect",
                after: timeout,
            }
        } else {
            Error::io("connect to", addr.to_string(), e)
        }
    })?;
    tune(&stream, buffer, dead_peer);
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    Ok(stream)
}

/// Client side of the handshake over a blocking socket: sends `hello` to `addr` and returns the
/// server's hello. Same bytes and errors as the TCP transport's `handshake`.
pub fn handshake(addr: SocketAddr, hello: &Hello, timeout: Duration) -> Result<Hello, Error> {
    let mut stream = connect(addr, timeout, None, None)?;
    write_frame(&mut stream, addr, &ControlFrame::Hello(hello.clone()))?;
    let reply = read_frame(&mut stream, addr).map_err(|e| timed_out(e, "handshake", timeout))?;
    ferry_core::handshake::hello_reply(addr, hello, reply)
}

fn timed_out(e: Error, what: &'static str, after: Duration) -> Error {
    match &e {
        Error::PeerLost {
            source: Some(io), ..
        } if matches!(
            io.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) =>
        {
            Error::Timeout { what, after }
        }
        _ => e,
    }
}

/// Opens one data stream and attaches it (with `frame`: the attach, or its authenticated form)
/// to the server incarnation `attach.server_epoch`. A server at its cap of connections before
/// their proof closes one before answering (its oldest, when it evicts): a connection closed
/// before an answer is tried again, with jittered backoff (20 ms doubling to 500 ms), until
/// `timeout`, as the TCP client does; any other error ends it at once.
pub(crate) fn attach(
    addr: SocketAddr,
    attach: StreamAttach,
    frame: ControlFrame,
    timeout: Duration,
    buffer: Option<usize>,
    dead_peer: Option<Duration>,
) -> Result<TcpStream, Error> {
    let deadline = Instant::now() + timeout;
    let mut backoff = ferry_core::backoff::Backoff::random(RETRY_FIRST, RETRY_MAX);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout {
                what: "data stream attach",
                after: timeout,
            });
        }
        match attach_once(addr, attach, &frame, left, buffer, dead_peer) {
            Err(e @ Error::PeerLost { .. }) => {
                let wait = backoff.next_delay();
                if Instant::now() + wait >= deadline {
                    return Err(e);
                }
                tracing::debug!(%addr, ?wait, error = %e,
                    "data stream attach closed before an answer; retrying");
                std::thread::sleep(wait);
            }
            other => return other,
        }
    }
}

/// The first wait before an attach is tried again, and the longest.
const RETRY_FIRST: Duration = Duration::from_millis(20);
const RETRY_MAX: Duration = Duration::from_millis(500);

fn attach_once(
    addr: SocketAddr,
    attach: StreamAttach,
    frame: &ControlFrame,
    timeout: Duration,
    buffer: Option<usize>,
    dead_peer: Option<Duration>,
) -> Result<TcpStream, Error> {
    let mut stream = connect(addr, timeout, buffer, dead_peer)?;
    write_frame(&mut stream, addr, frame)?;
    let reply =
        read_frame(&mut stream, addr).map_err(|e| timed_out(e, "data stream attach", timeout))?;
    ferry_core::handshake::attach_reply(addr, &attach, reply)?;
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(None);
    Ok(stream)
}

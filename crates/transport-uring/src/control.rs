//! Control frames over blocking sockets: the handshake and the attach of data streams. The
//! bytes are exactly those of the TCP transport (`ferry_core::wire`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use ferry_core::Error;
use ferry_core::wire::{
    CONTROL_HEADER_LEN, ControlFrame, ControlHeader, Hello, SUPPORTED_VERSIONS, StreamAttach,
};

pub(crate) fn lost(peer: SocketAddr, during: &'static str, e: std::io::Error) -> Error {
    Error::PeerLost {
        peer: peer.to_string(),
        during,
        source: Some(e),
    }
}

/// Reads one control frame; the body length is checked before the body is allocated.
pub(crate) fn read_frame(stream: &mut TcpStream, peer: SocketAddr) -> Result<ControlFrame, Error> {
    let mut head = [0u8; CONTROL_HEADER_LEN];
    stream
        .read_exact(&mut head)
        .map_err(|e| lost(peer, "handshake", e))?;
    let header = ControlHeader::decode(&head).map_err(|source| Error::Malformed {
        peer: peer.to_string(),
        source,
    })?;
    let mut body = vec![0u8; header.body_len as usize];
    stream
        .read_exact(&mut body)
        .map_err(|e| lost(peer, "handshake", e))?;
    ControlFrame::decode_body(&header, &body).map_err(|source| Error::Malformed {
        peer: peer.to_string(),
        source,
    })
}

/// Writes one control frame.
pub(crate) fn write_frame(
    stream: &mut TcpStream,
    peer: SocketAddr,
    frame: &ControlFrame,
) -> Result<(), Error> {
    let mut buf = Vec::new();
    frame
        .encode(SUPPORTED_VERSIONS.max, &mut buf)
        .map_err(|e| Error::InvalidRequest {
            reason: e.to_string(),
        })?;
    stream
        .write_all(&buf)
        .map_err(|e| lost(peer, "handshake", e))
}

fn sysctl(path: &str) -> usize {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Nagle off, socket buffers of `size` where the kernel's maximum allows, and dead-peer
/// detection (as the TCP transport does): with `dead_peer` set, the kernel gives up on the
/// connection once sent data has gone unacknowledged that long (`TCP_USER_TIMEOUT`), and an idle
/// connection is probed from half that time on (keepalive), so a peer that vanished without a
/// word (host down, cable cut) ends the stream with `ETIMEDOUT` instead of leaving its chunks
/// in flight forever; the kernel then drops the sends' page references too.
pub(crate) fn tune(stream: &TcpStream, size: Option<usize>, dead_peer: Option<Duration>) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "TCP_NODELAY");
    }
    let sock = socket2::SockRef::from(stream);
    if let Some(after) = dead_peer {
        if let Err(e) = sock.set_tcp_user_timeout(Some(after)) {
            tracing::debug!(error = %e, ?after, "TCP_USER_TIMEOUT");
        }
        let keepalive = socket2::TcpKeepalive::new()
            .with_time((after / 2).max(Duration::from_secs(1)))
            .with_interval((after / 10).max(Duration::from_secs(1)))
            .with_retries(5);
        if let Err(e) = sock.set_tcp_keepalive(&keepalive) {
            tracing::debug!(error = %e, ?after, "SO_KEEPALIVE");
        }
    }
    let Some(size) = size else { return };
    if size <= sysctl("/proc/sys/net/core/wmem_max")
        && let Err(e) = sock.set_send_buffer_size(size)
    {
        tracing::debug!(error = %e, size, "SO_SNDBUF");
    }
    if size <= sysctl("/proc/sys/net/core/rmem_max")
        && let Err(e) = sock.set_recv_buffer_size(size)
    {
        tracing::debug!(error = %e, size, "SO_RCVBUF");
    }
}

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

/// Opens one data stream and attaches it to the server incarnation `attach.server_epoch`.
pub(crate) fn attach(
    addr: SocketAddr,
    attach: StreamAttach,
    timeout: Duration,
    buffer: Option<usize>,
    dead_peer: Option<Duration>,
) -> Result<TcpStream, Error> {
    let mut stream = connect(addr, timeout, buffer, dead_peer)?;
    write_frame(&mut stream, addr, &ControlFrame::StreamAttach(attach))?;
    let reply =
        read_frame(&mut stream, addr).map_err(|e| timed_out(e, "data stream attach", timeout))?;
    ferry_core::handshake::attach_reply(addr, &attach, reply)?;
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(None);
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `tune` arms dead-peer detection as asked (user timeout, keepalive from half of it) and
    /// leaves the kernel's defaults alone without it.
    #[test]
    fn tune_sets_the_dead_peer_limit() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        tune(&a, None, Some(Duration::from_secs(8)));
        tune(&b, None, None);
        let (sa, sb) = (socket2::SockRef::from(&a), socket2::SockRef::from(&b));
        assert_eq!(sa.tcp_user_timeout().unwrap(), Some(Duration::from_secs(8)));
        assert!(sa.keepalive().unwrap());
        assert_eq!(sa.keepalive_time().unwrap(), Duration::from_secs(4));
        assert_eq!(sb.tcp_user_timeout().unwrap(), None);
        assert!(!sb.keepalive().unwrap());
    }
}

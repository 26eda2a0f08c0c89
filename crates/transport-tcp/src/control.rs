//! Control frames over a TCP stream: the handshake and the attach of data streams.

use std::net::SocketAddr;
use std::time::Duration;

use ferry_core::Error;
use ferry_core::wire::{
    CONTROL_HEADER_LEN, ControlFrame, ControlHeader, Hello, SUPPORTED_VERSIONS, StreamAttach,
};
use tokio::net::TcpStream;

use crate::io::{recv_buf, send_buf, tune};

/// Reads one control frame. The body length is checked before the body is allocated.
pub(crate) async fn read_frame(
    stream: &TcpStream,
    peer: SocketAddr,
) -> Result<ControlFrame, Error> {
    let mut head = [0u8; CONTROL_HEADER_LEN];
    recv_buf(stream, &mut head)
        .await
        .map_err(|e| lost(peer, "handshake", e))?;
    let header = ControlHeader::decode(&head).map_err(|source| Error::Malformed {
        peer: peer.to_string(),
        source,
    })?;
    let mut body = vec![0u8; header.body_len as usize];
    recv_buf(stream, &mut body)
        .await
        .map_err(|e| lost(peer, "handshake", e))?;
    ControlFrame::decode_body(&header, &body).map_err(|source| Error::Malformed {
        peer: peer.to_string(),
        source,
    })
}

/// Writes one control frame.
pub(crate) async fn write_frame(
    stream: &TcpStream,
    peer: SocketAddr,
    frame: &ControlFrame,
) -> Result<(), Error> {
    let mut buf = Vec::new();
    frame
        .encode(SUPPORTED_VERSIONS.max, &mut buf)
        .map_err(|e| Error::InvalidRequest {
            reason: e.to_string(),
        })?;
    send_buf(stream, &buf)
        .await
        .map_err(|e| lost(peer, "handshake", e))
}

pub(crate) fn lost(peer: SocketAddr, during: &'static str, e: std::io::Error) -> Error {
    Error::PeerLost {
        peer: peer.to_string(),
        during,
        source: Some(e),
    }
}

pub(crate) async fn connect(
    addr: SocketAddr,
    timeout: Duration,
    buffer: Option<usize>,
    dead_peer: Option<Duration>,
) -> Result<TcpStream, Error> {
    let stream = tokio::time::timeout(timeout, TcpStream::connect(addr))
        .await
        .map_err(|_| Error::Timeout {
            what: "TCP connect",
            after: timeout,
        })?
        .map_err(|e| Error::io("connect to", addr.to_string(), e))?;
    tune(&stream, buffer, dead_peer);
    Ok(stream)
}

/// Client side of the handshake: sends `hello` to `addr` and returns the server's hello.
///
/// A server that shares no protocol version with `hello.versions` gives
/// [`Error::ProtocolMismatch`] with both ranges; nothing is admitted then.
pub async fn handshake(addr: SocketAddr, hello: &Hello, timeout: Duration) -> Result<Hello, Error> {
    let run = async {
        let stream = connect(addr, timeout, None, None).await?;
        write_frame(&stream, addr, &ControlFrame::Hello(hello.clone())).await?;
        let reply = read_frame(&stream, addr).await?;
        ferry_core::handshake::hello_reply(addr, hello, reply)
    };
    tokio::time::timeout(timeout, run)
        .await
        .map_err(|_| Error::Timeout {
            what: "handshake",
            after: timeout,
        })?
}

/// Opens one data stream and attaches it to the server incarnation `attach.server_epoch`.
pub(crate) async fn attach(
    addr: SocketAddr,
    attach: StreamAttach,
    timeout: Duration,
    buffer: Option<usize>,
    dead_peer: Option<Duration>,
) -> Result<TcpStream, Error> {
    let run = async {
        let stream = connect(addr, timeout, buffer, dead_peer).await?;
        write_frame(&stream, addr, &ControlFrame::StreamAttach(attach)).await?;
        let reply = read_frame(&stream, addr).await?;
        ferry_core::handshake::attach_reply(addr, &attach, reply)?;
        Ok(stream)
    };
    tokio::time::timeout(timeout, run)
        .await
        .map_err(|_| Error::Timeout {
            what: "data stream attach",
            after: timeout,
        })?
}

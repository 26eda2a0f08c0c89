//! Control frames over a TCP stream: the handshake and the attach of data streams.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::Error;
use ferry_core::auth::{ClientAuth, Keyring, Session};
use ferry_core::identity::ServerIdentity;
use ferry_core::wire::{
    CONTROL_HEADER_LEN, ControlFrame, ControlHeader, Hello, Notify, StreamAttach,
};
pub(crate) use ferry_net::lost;
use ferry_net::tune;
use tokio::net::TcpStream;

use crate::io::{recv_buf, send_buf};

/// Reads one control frame. The body length is checked before the body is allocated.
pub(crate) async fn read_frame(
    stream: &TcpStream,
    peer: SocketAddr,
) -> Result<ControlFrame, Error> {
    let header = read_header(stream, peer).await?;
    read_body(stream, peer, &header).await
}

/// Reads and checks a control frame's header (its body length against `MAX_CONTROL_BODY`).
pub(crate) async fn read_header(
    stream: &TcpStream,
    peer: SocketAddr,
) -> Result<ControlHeader, Error> {
    let mut head = [0u8; CONTROL_HEADER_LEN];
    recv_buf(stream, &mut head)
        .await
        .map_err(|e| lost(peer, "handshake", e))?;
    ferry_net::decode_header(&head, peer)
}

/// Reads the body of the frame `header` announced.
pub(crate) async fn read_body(
    stream: &TcpStream,
    peer: SocketAddr,
    header: &ControlHeader,
) -> Result<ControlFrame, Error> {
    let mut body = vec![0u8; header.body_len as usize];
    recv_buf(stream, &mut body)
        .await
        .map_err(|e| lost(peer, "handshake", e))?;
    ferry_net::decode_body(header, &body, peer)
}

/// Writes one control frame.
pub(crate) async fn write_frame(
    stream: &TcpStream,
    peer: SocketAddr,
    frame: &ControlFrame,
) -> Result<(), Error> {
    send_buf(stream, &ferry_net::encode_frame(frame)?)
        .await
        .map_err(|e| lost(peer, "handshake", e))
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
    Ok(handshake_with(addr, hello, None, timeout).await?.0)
}

/// Client side of the handshake, authenticated with the first key of `keyring` where one is
/// given (see [`ferry_core::auth`]): the server's hello and the session its data streams attach
/// with. [`Error::Authentication`] when either side cannot prove the key or the server has
/// none; a server that requires a key refuses a plain hello ([`Error::HandshakeRefused`]).
pub async fn handshake_with(
    addr: SocketAddr,
    hello: &Hello,
    keyring: Option<&Keyring>,
    timeout: Duration,
) -> Result<(Hello, Option<Arc<Session>>), Error> {
    handshake_expecting(addr, hello, keyring, None, timeout).await
}

/// As [`handshake_with`], and where `expect` names a server identity, the server must prove it
/// too (see [`ferry_core::identity`]): [`Error::ServerIdentity`] when it proves another or
/// none. An identity is proven only in an authenticated handshake: without a keyring an
/// expected identity is [`Error::InvalidRequest`], before anything is sent.
pub async fn handshake_expecting(
    addr: SocketAddr,
    hello: &Hello,
    keyring: Option<&Keyring>,
    expect: Option<ServerIdentity>,
    timeout: Duration,
) -> Result<(Hello, Option<Arc<Session>>), Error> {
    needs_keys(addr, keyring, expect)?;
    let run = || async {
        let stream = connect(addr, timeout, None, None).await?;
        let Some(keyring) = keyring else {
            write_frame(&stream, addr, &ControlFrame::Hello(hello.clone())).await?;
            let reply = read_frame(&stream, addr).await?;
            return Ok((
                ferry_core::handshake::hello_reply(addr, hello, reply)?,
                None,
            ));
        };
        let (first, client) = ClientAuth::start_expecting(
            keyring,
            hello.peer_id,
            hello.epoch,
            ferry_core::auth::nonce(),
            expect,
        );
        write_frame(&stream, addr, &first).await?;
        let reply = read_frame(&stream, addr).await?;
        let (proof, session) = client.on_reply(addr, reply)?;
        // The proof and the hello go out together: one round trip more than a plain handshake.
        let mut both = ferry_net::encode_frame(&proof)?;
        both.extend_from_slice(&ferry_net::encode_frame(&ControlFrame::Hello(
            hello.clone(),
        ))?);
        send_buf(&stream, &both)
            .await
            .map_err(|e| lost(addr, "handshake", e))?;
        let reply = read_frame(&stream, addr).await?;
        let server = ferry_core::handshake::hello_reply(addr, hello, reply)?;
        session.check_server(addr, server.peer_id, server.epoch)?;
        Ok((server, Some(Arc::new(session))))
    };
    retrying(addr, timeout, "handshake", run).await
}

/// An expected server identity without keys: refused before connecting (it is proven only in
/// an authenticated handshake).
fn needs_keys(
    addr: SocketAddr,
    keyring: Option<&Keyring>,
    expect: Option<ServerIdentity>,
) -> Result<(), Error> {
    match (keyring, expect) {
        (None, Some(expected)) => Err(Error::InvalidRequest {
            reason: format!(
                "the server at {addr} is expected to be {expected}, and a server identity is \
                 proven only in an authenticated handshake: give this engine a key file \
                 (EngineBuilder::auth_key_file, FERRY_AUTH_KEY_FILE)"
            ),
        }),
        _ => Ok(()),
    }
}

/// Runs `attempt` (one connection and its handshake) until it ends otherwise than by the
/// server closing the connection before answering, or `timeout` passes. A server at its cap
/// of connections before their proof makes room by closing its oldest (or, with a gate that
/// does not evict, the newest at once), and its places free as the others end or reach their
/// deadline: under a flood of strangers, a client retries, with jittered backoff (20 ms
/// doubling to 500 ms), instead of failing at the first refusal. Any other error ends it at
/// once.
async fn retrying<T, F, Fut>(
    addr: SocketAddr,
    timeout: Duration,
    what: &'static str,
    mut attempt: F,
) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut backoff = ferry_core::backoff::Backoff::random(RETRY_FIRST, RETRY_MAX);
    loop {
        match tokio::time::timeout_at(deadline, attempt()).await {
            Err(_) => {
                return Err(Error::Timeout {
                    what,
                    after: timeout,
                });
            }
            Ok(Err(e @ Error::PeerLost { .. })) => {
                let wait = backoff.next_delay();
                if tokio::time::Instant::now() + wait >= deadline {
                    return Err(e);
                }
                tracing::debug!(%addr, ?wait, error = %e, "{what} closed before an answer; retrying");
                tokio::time::sleep(wait).await;
            }
            Ok(other) => return other,
        }
    }
}

/// The first wait before a handshake is tried again, and the longest.
const RETRY_FIRST: Duration = Duration::from_millis(20);
const RETRY_MAX: Duration = Duration::from_millis(500);

/// Client side of a notification: sends `notify` to `addr` (authenticated with the first key
/// of `keyring` where one is given, as [`handshake_with`]) and returns once the server has it
/// in its inbox. The errors are [`ferry_core::handshake::notify_reply`]'s, a lost connection,
/// and a timeout after `timeout`.
pub async fn notify_with(
    addr: SocketAddr,
    notify: &Notify,
    keyring: Option<&Keyring>,
    timeout: Duration,
) -> Result<(), Error> {
    notify_expecting(addr, notify, keyring, None, timeout).await
}

/// As [`notify_with`], to the server identity `expect` where one is named (as
/// [`handshake_expecting`]): the message is sent only once the server proved it.
pub async fn notify_expecting(
    addr: SocketAddr,
    notify: &Notify,
    keyring: Option<&Keyring>,
    expect: Option<ServerIdentity>,
    timeout: Duration,
) -> Result<(), Error> {
    needs_keys(addr, keyring, expect)?;
    let run = || async {
        let stream = connect(addr, timeout, None, None).await?;
        let frame = ControlFrame::Notify(notify.clone());
        let Some(keyring) = keyring else {
            write_frame(&stream, addr, &frame).await?;
            let reply = read_frame(&stream, addr).await?;
            return ferry_core::handshake::notify_reply(addr, notify.to_epoch, reply);
        };
        let (first, client) = ClientAuth::start_expecting(
            keyring,
            notify.peer_id,
            notify.epoch,
            ferry_core::auth::nonce(),
            expect,
        );
        write_frame(&stream, addr, &first).await?;
        let reply = read_frame(&stream, addr).await?;
        let (proof, _session) = client.on_reply(addr, reply)?;
        let mut both = ferry_net::encode_frame(&proof)?;
        both.extend_from_slice(&ferry_net::encode_frame(&frame)?);
        send_buf(&stream, &both)
            .await
            .map_err(|e| lost(addr, "notification", e))?;
        let reply = read_frame(&stream, addr).await?;
        ferry_core::handshake::notify_reply(addr, notify.to_epoch, reply)
    };
    retrying(addr, timeout, "notification", run).await
}

/// Opens one data stream and attaches it (with `frame`: the attach, or its authenticated form)
/// to the server incarnation `attach.server_epoch`.
pub(crate) async fn attach(
    addr: SocketAddr,
    attach: StreamAttach,
    frame: ControlFrame,
    timeout: Duration,
    buffer: Option<usize>,
    dead_peer: Option<Duration>,
) -> Result<TcpStream, Error> {
    // A server at its cap of connections before their handshake closes one before answering
    // (the newest, or the oldest when it evicts): tried again like a handshake.
    let run = || async {
        let stream = connect(addr, timeout, buffer, dead_peer).await?;
        write_frame(&stream, addr, &frame).await?;
        let reply = read_frame(&stream, addr).await?;
        ferry_core::handshake::attach_reply(addr, &attach, reply)?;
        Ok(stream)
    };
    retrying(addr, timeout, "data stream attach", run).await
}

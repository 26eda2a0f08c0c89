//! The thin tokio driver: accepts connections (at most [`MAX_CONNECTIONS`], through an
//! evicting [`HandshakeGate`]), reads into each one's [`Conn`], writes what it says, and passes
//! complete requests to the shared [`Store`]. Every decision is in [`super::http`] and
//! [`super::store`]; here are only the deadlines and the connection cap.

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry::{HandshakeGate, HandshakeLimits};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use super::http::{CONTINUE, Conn, Next, Response};
use super::store::Store;

/// Connections served at once. Past it the oldest connection of the source address holding
/// the most is closed to make room for the newcomer (the evicting [`HandshakeGate`] Ferry's
/// other listeners use), so idle connections, however many, cannot keep an engine out.
pub(crate) const MAX_CONNECTIONS: usize = 256;
/// How long a request head may take to arrive, whole (counted from the previous answer on a
/// kept-alive connection, so it is also how long an idle connection stays open).
pub(crate) const HEAD_DEADLINE: Duration = Duration::from_secs(10);
/// How long a body being read, or an answer being written, may go without progress.
pub(crate) const IDLE: Duration = Duration::from_secs(10);
/// Bytes read per socket read.
const READ_CHUNK: usize = 64 << 10;
/// Bodies at most this long are written with their head in one write.
const COALESCE: usize = 16 << 10;
/// After a refusal, how long the request's unread bytes are drained before closing, so that the
/// client reads the answer rather than a reset.
const LINGER: Duration = Duration::from_secs(1);

/// What the driver allows a connection: [`MAX_CONNECTIONS`], [`HEAD_DEADLINE`] and [`IDLE`]
/// by default (tests shorten the deadlines).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Connections at once; past it the oldest of the busiest source makes room.
    pub(crate) max_connections: usize,
    /// How long a request head may take to arrive, whole.
    pub(crate) head_deadline: Duration,
    /// How long a body or an answer may go without progress.
    pub(crate) idle: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: MAX_CONNECTIONS,
            head_deadline: HEAD_DEADLINE,
            idle: IDLE,
        }
    }
}

/// Serves `listener` (bound to `addr`) from `store` within `limits` until the future is
/// dropped.
pub(crate) async fn serve(
    listener: TcpListener,
    addr: SocketAddr,
    store: Arc<Mutex<Store>>,
    limits: Limits,
) {
    let gate = HandshakeGate::new(HandshakeLimits {
        timeout: limits.head_deadline,
        max_pending: limits.max_connections,
    });
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            // Reap finished connection tasks so the set stays small.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let (stream, from) = match accepted {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(%addr, error = %e, "metadata server: accept failed");
                // A full file table clears as connections close.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // A connection holds its place for its whole life: on a kept-alive one the next request
        // is as unproven as the first.
        let Some(slot) = gate.admit_evicting(stream.as_fd(), from.ip()) else {
            tracing::debug!(%from, "metadata server: too many connections; closed");
            continue;
        };
        let store = store.clone();
        connections.spawn(async move {
            if let Err(e) = connection(stream, &store, limits).await {
                tracing::debug!(%from, error = %e, "metadata server: connection ended");
            }
            drop(slot);
        });
    }
}

/// Serves one connection's requests until it closes, errs or misses a deadline.
async fn connection(
    mut stream: TcpStream,
    store: &Mutex<Store>,
    limits: Limits,
) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let idle = limits.idle;
    let mut conn = Conn::new();
    let mut chunk = vec![0u8; READ_CHUNK];
    // A deadline for the whole head, however its bytes are spread: not reset by a read.
    let mut head_deadline = Instant::now() + limits.head_deadline;
    loop {
        match conn.poll() {
            Next::Read => {
                let deadline = if conn.reading_head() {
                    head_deadline
                } else {
                    Instant::now() + idle
                };
                match tokio::time::timeout_at(deadline, stream.read(&mut chunk)).await {
                    Ok(Ok(0)) => return Ok(()),
                    Ok(Ok(n)) => conn.feed(&chunk[..n]),
                    Ok(Err(e)) => return Err(e),
                    Err(_) => {
                        return match conn.timed_out() {
                            Some(r) => refuse(&mut stream, &r, &mut chunk, idle).await,
                            None => Ok(()),
                        };
                    }
                }
            }
            Next::Continue => write_all(&mut stream, CONTINUE, idle).await?,
            Next::Request(req) => {
                let head_only = req.head_only();
                let response = {
                    let mut store = store.lock().unwrap_or_else(|p| p.into_inner());
                    let r = store.handle(
                        &req.method,
                        &req.target,
                        req.owner_token.as_deref(),
                        req.body,
                    );
                    tracing::debug!(
                        method = %req.method,
                        target = %req.target,
                        status = r.status,
                        entries = store.len(),
                        bytes = store.bytes(),
                        "metadata request"
                    );
                    r
                };
                write_response(&mut stream, &response, !req.keep_alive, head_only, idle).await?;
                if !req.keep_alive {
                    return stream.shutdown().await;
                }
                head_deadline = Instant::now() + limits.head_deadline;
            }
            Next::Reject(r) => {
                tracing::debug!(status = r.status, "metadata server: request refused");
                return refuse(&mut stream, &r, &mut chunk, idle).await;
            }
        }
    }
}

/// Answers `r` and closes, draining what the client still sends for a moment: closing with
/// unread bytes would reset the connection, and the answer with it.
async fn refuse(
    stream: &mut TcpStream,
    r: &Response,
    chunk: &mut [u8],
    idle: Duration,
) -> std::io::Result<()> {
    write_response(stream, r, true, false, idle).await?;
    stream.shutdown().await?;
    let drain = async { while stream.read(chunk).await.is_ok_and(|n| n > 0) {} };
    let _ = tokio::time::timeout(LINGER, drain).await;
    Ok(())
}

async fn write_response(
    stream: &mut TcpStream,
    r: &Response,
    close: bool,
    head_only: bool,
    idle: Duration,
) -> std::io::Result<()> {
    let mut out = r.encode_head(close);
    let body = if head_only {
        &[][..]
    } else {
        r.body.as_bytes()
    };
    if body.len() <= COALESCE {
        out.extend_from_slice(body);
        write_all(stream, &out, idle).await
    } else {
        write_all(stream, &out, idle).await?;
        write_all(stream, body, idle).await
    }
}

/// Writes `bytes`, giving up when a piece of [`READ_CHUNK`] bytes takes longer than `idle`:
/// a client that stops reading does not hold its connection forever.
async fn write_all(stream: &mut TcpStream, bytes: &[u8], idle: Duration) -> std::io::Result<()> {
    for piece in bytes.chunks(READ_CHUNK) {
        tokio::time::timeout(idle, stream.write_all(piece))
            .await
            .map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::TimedOut, "client not reading")
            })??;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::store;

    /// A server on a free loopback port with `limits`, served until the test's runtime ends.
    async fn start(limits: Limits) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let store = Arc::new(Mutex::new(Store::new(store::Limits::default())));
        tokio::spawn(serve(listener, addr, store, limits));
        addr
    }

    /// A client trickling its request head a byte at a time, each byte well within any idle
    /// timeout, gets 408 at the head's deadline: the deadline is for the whole head, not
    /// renewed by each read. (Turned into an idle timeout, the trickle would be served forever.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_head_trickled_a_byte_at_a_time_gets_408_at_the_deadline() {
        let deadline = Duration::from_secs(1);
        let addr = start(Limits {
            head_deadline: deadline,
            idle: Duration::from_secs(600),
            ..Limits::default()
        })
        .await;
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let begun = Instant::now();
        stream
            .write_all(b"GET /metadata?key=")
            .await
            .expect("write");
        let (mut reader, mut writer) = stream.into_split();
        // One byte every tenth of the deadline, until the answer comes or four deadlines pass.
        let trickle = tokio::spawn(async move {
            let mut tick = tokio::time::interval(deadline / 10);
            while begun.elapsed() < deadline * 4 {
                tick.tick().await;
                if writer.write_all(b"a").await.is_err() {
                    break; // the server closed
                }
            }
            writer
        });
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        let head = loop {
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                break Some(String::from_utf8_lossy(&got[..end]).into_owned());
            }
            let read = tokio::time::timeout_at(begun + deadline * 4, reader.read(&mut buf));
            match read.await {
                Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
                Ok(_) => break None,
                Err(_) => panic!(
                    "no answer {:?} into a trickled head with a deadline of {deadline:?}: the \
                     deadline was renewed by each byte",
                    begun.elapsed()
                ),
            }
        };
        let took = begun.elapsed();
        trickle.abort();
        let head = head.expect("an answer before the close");
        assert!(head.starts_with("HTTP/1.1 408 "), "{head}");
        assert!(
            took >= deadline,
            "answered after {took:?}, before the deadline"
        );
    }
}

//! The thin tokio driver: accepts connections (at most [`MAX_CONNECTIONS`]), reads into each
//! one's [`Conn`], writes what it says, and passes complete requests to the shared [`Store`].
//! Every decision is in [`super::http`] and [`super::store`]; here are only the deadlines.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use super::http::{CONTINUE, Conn, Next, Response};
use super::store::Store;

/// Connections served at once; one past it is closed at once.
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

/// Serves `listener` (bound to `addr`) from `store` until the future is dropped.
pub(crate) async fn serve(listener: TcpListener, addr: SocketAddr, store: Arc<Mutex<Store>>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
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
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(%from, "metadata server: {MAX_CONNECTIONS} connections open; closed");
            continue;
        };
        let store = store.clone();
        connections.spawn(async move {
            if let Err(e) = connection(stream, &store).await {
                tracing::debug!(%from, error = %e, "metadata server: connection ended");
            }
            drop(slot);
        });
    }
}

/// Serves one connection's requests until it closes, errs or misses a deadline.
async fn connection(mut stream: TcpStream, store: &Mutex<Store>) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut conn = Conn::new();
    let mut chunk = vec![0u8; READ_CHUNK];
    let mut head_deadline = Instant::now() + HEAD_DEADLINE;
    loop {
        match conn.poll() {
            Next::Read => {
                let deadline = if conn.reading_head() {
                    head_deadline
                } else {
                    Instant::now() + IDLE
                };
                match tokio::time::timeout_at(deadline, stream.read(&mut chunk)).await {
                    Ok(Ok(0)) => return Ok(()),
                    Ok(Ok(n)) => conn.feed(&chunk[..n]),
                    Ok(Err(e)) => return Err(e),
                    Err(_) => {
                        if let Some(r) = conn.timed_out() {
                            write_response(&mut stream, &r, true, false).await?;
                        }
                        return Ok(());
                    }
                }
            }
            Next::Continue => write_all(&mut stream, CONTINUE).await?,
            Next::Request(req) => {
                let head_only = req.head_only();
                let response = {
                    let mut store = store.lock().unwrap_or_else(|p| p.into_inner());
                    let r = store.handle(&req.method, &req.target, req.body);
                    tracing::debug!(
                        method = %req.method,
                        target = %req.target,
                        status = r.status,
                        entries = store.len(),
                        "metadata request"
                    );
                    r
                };
                write_response(&mut stream, &response, !req.keep_alive, head_only).await?;
                if !req.keep_alive {
                    return stream.shutdown().await;
                }
                head_deadline = Instant::now() + HEAD_DEADLINE;
            }
            Next::Reject(r) => {
                tracing::debug!(status = r.status, "metadata server: request refused");
                write_response(&mut stream, &r, true, false).await?;
                stream.shutdown().await?;
                // Drain what the client still sends for a moment: closing with unread bytes
                // would reset the connection, and the answer with it.
                let drain = async { while stream.read(&mut chunk).await.is_ok_and(|n| n > 0) {} };
                let _ = tokio::time::timeout(LINGER, drain).await;
                return Ok(());
            }
        }
    }
}

async fn write_response(
    stream: &mut TcpStream,
    r: &Response,
    close: bool,
    head_only: bool,
) -> std::io::Result<()> {
    let mut out = r.encode_head(close);
    let body = if head_only {
        &[][..]
    } else {
        r.body.as_bytes()
    };
    if body.len() <= COALESCE {
        out.extend_from_slice(body);
        write_all(stream, &out).await
    } else {
        write_all(stream, &out).await?;
        write_all(stream, body).await
    }
}

/// Writes `bytes`, giving up when a piece of [`READ_CHUNK`] bytes takes longer than [`IDLE`]:
/// a client that stops reading does not hold its connection forever.
async fn write_all(stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    for piece in bytes.chunks(READ_CHUNK) {
        tokio::time::timeout(IDLE, stream.write_all(piece))
            .await
            .map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::TimedOut, "client not reading")
            })??;
    }
    Ok(())
}

//! Telling a port that is not Ferry's from a slow Ferry peer, quickly. Ferry's client speaks
//! first and an HTTP server waits for a request's end, so against an HTTP server (a web
//! server, Ferry's own metrics port) a handshake would only time out. [`not_ferry`] asks the
//! way HTTP servers answer at once, and only once the handshake is late: a Ferry server takes
//! the request as a stranger's bad frame and closes it, so a Ferry peer is never mistaken.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long a handshake may go unanswered before the port is asked whether it is HTTP.
pub(crate) const LATE: Duration = Duration::from_millis(500);

/// What answered at `addr`, when it is not a Ferry engine: after `after`, sends an HTTP
/// request and resolves with a description if an HTTP reply (or a broadcast control
/// service's JSON refusal) comes back within a second. Never resolves
/// otherwise (a Ferry peer, a silent port): race it against the handshake.
pub(crate) async fn not_ferry(addr: &str, after: Duration) -> String {
    tokio::time::sleep(after).await;
    let asked = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(b"GET / HTTP/1.0\r\n\r\n").await.ok()?;
        let mut head = [0u8; 16];
        let n = s.read(&mut head).await.ok()?;
        let head = &head[..n];
        if head.starts_with(b"HTTP/") {
            Some("an HTTP server (it answered an HTTP request; Ferry's metrics port does too)")
        } else if head.starts_with(b"{\"reply\"") {
            Some("a `ferry publish` control port (`ferry pull ADDR` reads it)")
        } else {
            None
        }
        .map(str::to_owned)
    };
    match tokio::time::timeout(Duration::from_secs(1), asked).await {
        Ok(Some(what)) => what,
        _ => std::future::pending().await,
    }
}

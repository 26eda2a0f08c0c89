//! A connection to a member's control service, keyed or not.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use ferry::core_types::auth::{ClientAuth, nonce};
use ferry::core_types::wire::{AuthChallenge, ControlFrame};
use ferry::{Epoch, Keyring, PeerId};

use crate::error::BroadcastError;
use crate::manifest::Digest;

use super::messages::{MAX_LINE, Reply, Request, read_line};
use super::proven::ProvenLimits;

/// One connection to a member's control service.
#[derive(Debug)]
pub(crate) struct CtlClient {
    addr: String,
    r: BufReader<tokio::net::tcp::OwnedReadHalf>,
    w: tokio::net::tcp::OwnedWriteHalf,
    local: SocketAddr,
    /// When its last answer came (or it connected).
    last: Instant,
}

impl CtlClient {
    /// Connects within `timeout` and, with `keys`, proves the first key (and checks the
    /// member's proof) before anything else: a member that cannot prove it is an error
    /// (`ferry::Error::Authentication`, or the member's refusal).
    pub(crate) async fn connect_keyed(
        addr: &str,
        timeout: Duration,
        keys: Option<&Keyring>,
    ) -> Result<Self, BroadcastError> {
        let mut c = Self::connect(addr, timeout).await?;
        if let Some(k) = keys {
            c.authenticate(k, timeout).await?;
        }
        Ok(c)
    }

    /// The engine's challenge-response, client side, over this connection.
    async fn authenticate(
        &mut self,
        keys: &Keyring,
        timeout: Duration,
    ) -> Result<(), BroadcastError> {
        let addr = self.addr.clone();
        let err = |reason: &str| BroadcastError::Control {
            addr: addr.clone(),
            reason: reason.to_owned(),
        };
        let (hello, client) = ClientAuth::start(keys, PeerId::random(), Epoch::fresh(), nonce());
        let ControlFrame::AuthHello(h) = hello else {
            return Err(err("the handshake did not start with a hello"));
        };
        let req = Request::AuthHello {
            name: h.name,
            peer_id: format!("{:032x}", h.peer_id.0),
            epoch: h.epoch.0,
            nonce: Digest(h.nonce),
        };
        let Reply::AuthChallenge {
            peer_id,
            epoch,
            nonce: server_nonce,
            mac,
        } = self.call(&req, timeout).await?
        else {
            return Err(err("answered auth_hello with something else"));
        };
        let peer_id = u128::from_str_radix(&peer_id, 16)
            .map_err(|_| err("auth_challenge: the peer id is not hex"))?;
        let peer = addr.parse().unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
        let challenge = ControlFrame::AuthChallenge(AuthChallenge {
            peer_id: PeerId(peer_id),
            epoch: Epoch(epoch),
            nonce: server_nonce.0,
            mac: mac.0,
        });
        let (proof, _session) = client.on_reply(peer, challenge)?;
        let ControlFrame::AuthProof(p) = proof else {
            return Err(err("the handshake ended without a proof"));
        };
        match self
            .call(&Request::AuthProof { mac: Digest(p.mac) }, timeout)
            .await?
        {
            Reply::Ok { .. } => Ok(()),
            _ => Err(err("answered auth_proof with something else")),
        }
    }

    /// Connects within `timeout`, with no key.
    pub(crate) async fn connect(addr: &str, timeout: Duration) -> Result<Self, BroadcastError> {
        let err = |reason: String| BroadcastError::Control {
            addr: addr.to_owned(),
            reason,
        };
        let stream = tokio::time::timeout(timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| err(format!("connect timed out after {timeout:?}")))?
            .map_err(|e| err(format!("connect: {e}")))?;
        let _ = stream.set_nodelay(true);
        let local = stream.local_addr().map_err(|e| err(e.to_string()))?;
        let (r, w) = stream.into_split();
        Ok(Self {
            addr: addr.to_owned(),
            r: BufReader::new(r),
            w,
            local,
            last: Instant::now(),
        })
    }

    /// Whether it has been idle for half the idle timeout a member closes proven connections
    /// at (by default): better opened again than found closed by the next request.
    pub(crate) fn stale(&self) -> bool {
        self.last.elapsed() >= ProvenLimits::default().idle / 2
    }

    /// This end's address (the address the member sees us from).
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Resolves when the member ends the connection, nothing being asked of it: `Ok` when it
    /// closed it, `Err` when it failed or sent what was not asked for. Cancel-safe (it only
    /// waits for the connection to become readable, consuming nothing).
    pub(crate) async fn closed(&mut self) -> std::io::Result<()> {
        use tokio::io::AsyncBufReadExt;
        if self.r.fill_buf().await?.is_empty() {
            Ok(())
        } else {
            Err(std::io::Error::other("it sent what was not asked for"))
        }
    }

    /// Sends `req` and reads the answer within `timeout`; an `error` answer is an error.
    pub(crate) async fn call(
        &mut self,
        req: &Request,
        timeout: Duration,
    ) -> Result<Reply, BroadcastError> {
        let addr = self.addr.clone();
        let err = |reason: String| BroadcastError::Control {
            addr: addr.clone(),
            reason,
        };
        let mut line = serde_json::to_vec(req).map_err(|e| err(e.to_string()))?;
        line.push(b'\n');
        let exchange = async {
            self.w.write_all(&line).await?;
            read_line(&mut self.r, MAX_LINE).await
        };
        let answer = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| err(format!("no answer within {timeout:?}")))?
            .map_err(|e| err(e.to_string()))?
            .ok_or_else(|| err("connection closed".into()))?;
        self.last = Instant::now();
        let reply: Reply = serde_json::from_slice(&answer)
            .map_err(|e| err(format!("{} ({e})", not_control(&answer))))?;
        match reply {
            Reply::Error { message } => Err(err(message)),
            Reply::Manifest {
                manifest,
                source_epoch,
            } => match manifest.validate() {
                Err(source) => Err(BroadcastError::ManifestFrom { addr, source }),
                Ok(()) => Ok(Reply::Manifest {
                    source_epoch,
                    manifest,
                }),
            },
            r => Ok(r),
        }
    }
}

/// What answered a control request with something that is not a control reply, in words a
/// user can act on: the port is another service's.
pub(crate) fn not_control(answer: &[u8]) -> &'static str {
    let html = answer.trim_ascii_start().first() == Some(&b'<');
    if answer.starts_with(b"HTTP/") || html {
        "an HTTP server answered, not a `ferry publish` control port (Ferry's metrics port \
         answers HTTP too; the control port is 7500 unless --listen says otherwise)"
    } else if answer.starts_with(b"FRRY") {
        "a Ferry engine's data port answered, not a `ferry publish` control port (pull from \
         the address `ferry publish` prints after `control`; 7500 unless --listen says otherwise)"
    } else {
        "not a `ferry publish` control port (bad answer)"
    }
}

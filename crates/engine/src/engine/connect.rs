//! Connecting: the handshake with a peer's address, the data path over the first transport both
//! ends offer, and the reconnect of a lost peer incarnation (the engine's side of
//! [`Reopen`](crate::reconnect::Reopen)).

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex, PoisonError};

use ferry_core::wire::Hello;
use ferry_core::{Error, PeerInfo, SegmentDesc, SegmentTable, TransportKind};
use tracing::Instrument;

use super::{TransferEngine, resolve};
use crate::peer::Peer;
use crate::reconnect::{Link, PeerInner};
use crate::route::{self, Pick};

impl TransferEngine {
    fn hello(&self) -> Hello {
        Hello {
            versions: self.inner.identity.versions,
            peer_id: self.inner.identity.id,
            epoch: self.inner.identity.epoch,
            transports: self
                .inner
                .planes
                .transports
                .iter()
                .map(|t| t.offer())
                .collect(),
            // Only what every peer may see: the server is not authenticated to a name here.
            segments: self.inner.published.table.published_to(None),
        }
    }

    /// Connects to the engine serving `addr`: handshake, then the data path over the first
    /// transport both ends offer. A peer with no common protocol version is refused with
    /// `ProtocolMismatch`; an address whose epoch differs from the one this engine met there
    /// first is refused with `StaleEpoch` (use [`reresolve`](Self::reresolve) to adopt it).
    pub async fn connect(&self, addr: impl ToSocketAddrs) -> Result<Peer, Error> {
        let addr = resolve(addr)?;
        let span = tracing::info_span!("connect", %addr);
        self.connect_inner(addr).instrument(span).await
    }

    /// Connects to the engine serving `addr` as [`connect`](Self::connect) does, and pairs the
    /// address with the server identity `identity`: this handshake and every later one with
    /// `addr` (reconnects, heals, listings, notifications, plain `connect`s) must be answered
    /// by the holder of that identity's signing key, or fail with [`Error::ServerIdentity`]
    /// naming the address, before anything but the handshake is sent. So a server that holds
    /// this engine's key but is not the one named (under per-peer keyrings, any server that
    /// holds it) cannot stand in for it at a redirected address. A later call for the same
    /// address replaces the pairing. The identity is proven in authenticated handshakes only:
    /// without keys this is [`Error::InvalidRequest`].
    pub async fn connect_expecting(
        &self,
        addr: impl ToSocketAddrs,
        identity: ferry_core::identity::ServerIdentity,
    ) -> Result<Peer, Error> {
        let addr = self.expect_server(addr, identity)?;
        let span = tracing::info_span!("connect", %addr, expect = %identity);
        self.connect_inner(addr).instrument(span).await
    }

    /// Pairs `addr` with the server identity `identity` without connecting: every handshake
    /// with it from now on (the next [`connect`](Self::connect), and layers that connect by
    /// address, such as [`crate::raw`]'s) must prove it, as for
    /// [`connect_expecting`](Self::connect_expecting). The address resolved; without keys,
    /// [`Error::InvalidRequest`] (an identity is proven in authenticated handshakes only).
    pub fn expect_server(
        &self,
        addr: impl ToSocketAddrs,
        identity: ferry_core::identity::ServerIdentity,
    ) -> Result<SocketAddr, Error> {
        let addr = resolve(addr)?;
        if self.inner.identity.keyring.is_none() {
            return Err(Error::InvalidRequest {
                reason: format!(
                    "the server at {addr} is expected to be {identity}, and a server identity \
                     is proven only in an authenticated handshake: give this engine a key file \
                     (EngineBuilder::auth_key_file, FERRY_AUTH_KEY_FILE)"
                ),
            });
        }
        self.inner
            .peers
            .expected
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(addr, identity);
        Ok(addr)
    }

    /// The public identity this engine proves as a server (to clients that name it, in
    /// authenticated handshakes): from its identity key file, else generated for this process.
    pub fn server_identity(&self) -> ferry_core::identity::ServerIdentity {
        self.inner.identity.signing.public()
    }

    /// The server identity `addr` must prove, if the application named one.
    fn expected(&self, addr: SocketAddr) -> Option<ferry_core::identity::ServerIdentity> {
        self.inner
            .peers
            .expected
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&addr)
            .copied()
    }

    /// Forgets the epoch known for `addr` and connects afresh, adopting whatever incarnation
    /// serves it now. Descriptors of the old incarnation stay refused.
    pub async fn reresolve(&self, addr: impl ToSocketAddrs) -> Result<Peer, Error> {
        let addr = resolve(addr)?;
        self.inner
            .peers
            .known
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&addr);
        tracing::info!(%addr, "re-resolving peer");
        self.connect(addr).await
    }

    /// What `peer` publishes to this engine now: a handshake with the same address that offers
    /// no transport (so the peer opens nothing for it), checked to be answered by the same
    /// incarnation (`StaleEpoch` otherwise). [`Peer::segments`] is the listing at connection
    /// time; layers that name remote memory by address ([`crate::raw`]) call this when an
    /// address lies in none of them, since the peer may have registered more since.
    pub async fn list_segments(&self, peer: &Peer) -> Result<Vec<SegmentDesc>, Error> {
        let inner = &peer.inner;
        let hello = Hello {
            transports: Vec::new(),
            ..self.hello()
        };
        let span = tracing::debug_span!("list segments", addr = %inner.addr);
        let (server, _) = ferry_transport_tcp::handshake_expecting(
            inner.addr,
            &hello,
            self.inner.identity.keyring.as_ref(),
            self.expected(inner.addr),
            self.inner.peers.connect_timeout,
        )
        .instrument(span)
        .await?;
        if server.epoch != inner.epoch || server.peer_id != inner.id {
            return Err(Error::StaleEpoch {
                addr: inner.addr.to_string(),
                known: inner.epoch,
                found: server.epoch,
            });
        }
        Ok(server.segments)
    }

    /// Sends `message` to `peer`'s inbox under the name `name` (this engine's name for itself:
    /// an agent's name, say), authenticated like a handshake, and returns once the peer holds it
    /// (see [`crate::inbox`]). Call it after the transfer the message speaks of completed: it
    /// then never arrives before that transfer's bytes. `StaleEpoch` when another incarnation
    /// serves the peer's address now; `HandshakeRefused` when its inbox, or this sender's share
    /// of it, is full; a peer built before notifications existed closes the connection
    /// (`PeerLost`, once the retries a connection closed before its answer gets have run out at
    /// the connect timeout). At most
    /// [`MAX_NOTIFY_LEN`](ferry_core::wire::MAX_NOTIFY_LEN) bytes, a name of at most
    /// [`MAX_NOTIFY_NAME`](ferry_core::wire::MAX_NOTIFY_NAME).
    pub async fn notify(&self, peer: &Peer, name: &str, message: &[u8]) -> Result<(), Error> {
        use ferry_core::wire::{MAX_NOTIFY_LEN, MAX_NOTIFY_NAME};
        if message.len() > MAX_NOTIFY_LEN || name.len() > MAX_NOTIFY_NAME {
            return Err(Error::InvalidRequest {
                reason: format!(
                    "a notification carries at most {MAX_NOTIFY_LEN} bytes and a name of at \
                     most {MAX_NOTIFY_NAME} (this one: {} bytes, a name of {})",
                    message.len(),
                    name.len()
                ),
            });
        }
        let notify = ferry_core::wire::Notify {
            peer_id: self.inner.identity.id,
            epoch: self.inner.identity.epoch,
            to_epoch: peer.inner.epoch,
            name: name.to_owned(),
            message: message.to_vec(),
        };
        let span = tracing::debug_span!("notify", addr = %peer.inner.addr, len = message.len());
        ferry_transport_tcp::notify_expecting(
            peer.inner.addr,
            &notify,
            self.inner.identity.keyring.as_ref(),
            self.expected(peer.inner.addr),
            self.inner.peers.connect_timeout,
        )
        .instrument(span)
        .await
    }

    /// The notifications peers sent this engine since the last call, oldest first.
    pub fn take_notifications(&self) -> Vec<crate::inbox::Notification> {
        self.inner.serving.inbox.take()
    }

    async fn connect_inner(&self, addr: SocketAddr) -> Result<Peer, Error> {
        let known = |server: &Hello| {
            let mut known = self
                .inner
                .peers
                .known
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            match known.get(&addr) {
                Some((_, e)) if *e != server.epoch => Err(Error::StaleEpoch {
                    addr: addr.to_string(),
                    known: *e,
                    found: server.epoch,
                }),
                Some(_) => Ok(()),
                None => {
                    known.insert(addr, (server.peer_id, server.epoch));
                    Ok(())
                }
            }
        };
        let (server, version, channel, why_not_local) = self.open_channel(addr, known).await?;
        let counters = self
            .inner
            .peers
            .routes
            .counters(addr.to_string(), channel.kind());
        if let Some(why) = why_not_local {
            counters.same_host_not_taken(why);
        }
        counters.gpu_route(channel.gpu_route());
        counters.channel(&channel);
        tracing::info!(peer = %server.peer_id, epoch = %server.epoch, transport = %channel.kind(),
            segments = server.segments.len(), "connected");
        let rails = channel.kind() == TransportKind::Rdma;
        let peer = Peer {
            inner: Arc::new(PeerInner {
                addr,
                id: server.peer_id,
                epoch: server.epoch,
                segments: server.segments,
                version,
                link: Mutex::new(Link {
                    generation: 0,
                    channel,
                }),
                recovery: Default::default(),
                engine: Arc::downgrade(&self.inner)
                    as std::sync::Weak<dyn crate::reconnect::Reopen>,
                policy: self.inner.peers.reconnect,
                closed: Default::default(),
                counters,
            }),
        };
        if rails {
            crate::reconnect::watch_rails(&peer.inner);
        }
        Ok(peer)
    }

    /// A fresh channel to the incarnation `peer` was connected to (reconnect): the same
    /// handshake and route choice as [`connect`](Self::connect), refused with `StaleEpoch` if
    /// the address now answers with another epoch.
    pub(crate) async fn reopen(
        &self,
        peer: &PeerInner,
    ) -> Result<Arc<dyn ferry_core::Channel>, Error> {
        let same = |server: &Hello| {
            if server.epoch == peer.epoch && server.peer_id == peer.id {
                Ok(())
            } else {
                Err(Error::StaleEpoch {
                    addr: peer.addr.to_string(),
                    known: peer.epoch,
                    found: server.epoch,
                })
            }
        };
        let span = tracing::info_span!("reconnect", addr = %peer.addr);
        let (_, _, channel, _) = self.open_channel(peer.addr, same).instrument(span).await?;
        Ok(channel)
    }

    /// Rebuilds the failed rails of `peer`'s current channel whose ports are back: a handshake
    /// offering only their fresh endpoints ([`Channel::heal_offer`](ferry_core::Channel::heal_offer)),
    /// which the same incarnation must answer (else `StaleEpoch`, and the fresh endpoints are
    /// torn down), then [`Channel::heal`](ferry_core::Channel::heal). How many rails rejoined.
    pub(crate) async fn heal(&self, peer: &PeerInner) -> Result<usize, Error> {
        let channel = peer.channel();
        let Some(offer) = channel.heal_offer() else {
            return Ok(0);
        };
        let span = tracing::info_span!("heal", addr = %peer.addr);
        let hello = Hello {
            versions: self.inner.identity.versions,
            peer_id: self.inner.identity.id,
            epoch: self.inner.identity.epoch,
            transports: vec![offer],
            segments: self.inner.published.table.published_to(None),
        };
        let (server, session) = ferry_transport_tcp::handshake_expecting(
            peer.addr,
            &hello,
            self.inner.identity.keyring.as_ref(),
            self.expected(peer.addr),
            self.inner.peers.connect_timeout,
        )
        .instrument(span)
        .await?;
        let kind = channel.kind();
        let Some(answer) = server
            .transports
            .iter()
            .find(|o| TransportKind::of_offer(o) == Some(kind))
        else {
            return Err(Error::NoRoute {
                peer: peer.addr.to_string(),
                reason: format!("the peer did not answer the {kind} rails offered to heal"),
            });
        };
        channel.heal(PeerInfo {
            addr: peer.addr,
            local_id: self.inner.identity.id,
            local_epoch: self.inner.identity.epoch,
            remote_id: server.peer_id,
            remote_epoch: server.epoch,
            offer: answer.clone(),
            segments: server.segments.clone(),
            session,
            key_name: None,
            version: peer.version,
        })
    }

    /// Handshake with `addr`, `check` of its answer, then the data path over the first transport
    /// both ends offer: the peer's hello, the protocol version spoken, the channel, and why the
    /// same-host plane was not taken (where this engine has it). A same-host plane that the
    /// peer answered but that cannot be opened (the copy probe refused, the socket unreachable)
    /// gives way to the next transport both ends offer.
    async fn open_channel(
        &self,
        addr: SocketAddr,
        check: impl FnOnce(&Hello) -> Result<(), Error>,
    ) -> Result<(Hello, u16, Arc<dyn ferry_core::Channel>, Option<String>), Error> {
        let hello = self.hello();
        let (server, session) = ferry_transport_tcp::handshake_expecting(
            addr,
            &hello,
            self.inner.identity.keyring.as_ref(),
            self.expected(addr),
            self.inner.peers.connect_timeout,
        )
        .await?;
        // The server answered, so the ranges meet (it refuses otherwise); 1 if it were lax.
        let version = self
            .inner
            .identity
            .versions
            .common(server.versions)
            .unwrap_or(1);
        check(&server)?;
        let ours = &self.inner.planes.transports;
        let Pick { transport, offer } = route::pick(ours, &server.transports, addr, None)?;
        let info = PeerInfo {
            addr,
            local_id: self.inner.identity.id,
            local_epoch: self.inner.identity.epoch,
            remote_id: server.peer_id,
            remote_epoch: server.epoch,
            offer,
            segments: server.segments.clone(),
            session,
            key_name: None,
            version,
        };
        if transport.kind() != TransportKind::Local {
            let why = self.inner.planes.local.as_ref().map(|_| {
                "the peer did not offer it (another host, or it serves no same-host socket)"
                    .to_owned()
            });
            let channel = transport.open(info).await?;
            return Ok((server, version, channel, why));
        }
        let refused = match transport.open(info.clone()).await {
            Ok(channel) => return Ok((server, version, channel, None)),
            Err(e) => e,
        };
        tracing::info!(%addr, error = %refused,
            "same-host plane refused; this peer is reached over the network planes");
        let Pick { transport, offer } =
            route::pick(ours, &server.transports, addr, Some(TransportKind::Local))?;
        let channel = transport.open(PeerInfo { offer, ..info }).await?;
        Ok((server, version, channel, Some(refused.to_string())))
    }
}

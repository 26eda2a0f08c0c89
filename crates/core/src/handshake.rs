//! The control handshake, without I/O: what a server answers, and what its answer means.
//!
//! Every transport that speaks Ferry's wire sends a [`Hello`] (or a [`StreamAttach`]) and reads
//! one [`ControlFrame`] back; these functions decide the server's answer and turn that frame into
//! the client's result, so that the TCP and io_uring transports (and any other) give the same
//! answers and errors for the same bytes.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::auth::PendingProof;
use crate::error::Error;
use crate::ids::Epoch;
use crate::stream::ServerStream;
use crate::transport::{HandshakeResponder, PeerInfo, PeerView, SegmentTable};
use crate::wire::{
    ControlFrame, ControlHeader, Hello, MAX_CONTROL_BODY, MAX_PREAUTH_BODY, Notify, Reject,
    RejectReason, SUPPORTED_VERSIONS, StreamAttach, TransportOffer, WireError,
};

/// The server's answer to a peer's hello from `from` (authenticated as `peer`, if at all): our
/// hello, or the responder's refusal.
pub fn answer_hello(
    responder: &dyn HandshakeResponder,
    hello: &Hello,
    from: SocketAddr,
    peer: Option<&str>,
) -> ControlFrame {
    match responder.respond(hello, from, peer) {
        Ok(h) => ControlFrame::HelloAck(h),
        Err(r) => ControlFrame::Reject(r),
    }
}

/// What a server does next on a control connection (see [`ServerConversation`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum ServerStep {
    /// Send this frame, then read the next one.
    Reply(ControlFrame),
    /// Read the next frame without answering.
    Read,
    /// Send this frame, then close the connection.
    Close(ControlFrame),
    /// A data stream is accepted: send [`ControlFrame::StreamAccept`] and serve its requests
    /// with `stream`, which resolves every op and piece through the peer's view of the
    /// published segments (an authenticated peer sees only what is published to its key name).
    Stream {
        /// The attach.
        attach: StreamAttach,
        /// The stream's protocol state, bound to what the peer may see.
        stream: ServerStream,
    },
    /// A frame that has no place here: close without answering.
    Fail(Error),
}

#[derive(Debug)]
enum Conversation {
    Start,
    /// Challenge sent; the client's proof comes next.
    Challenged(PendingProof),
    /// Proof checked; the client's hello comes next (read before a refusal is sent, so that
    /// the client reads the refusal rather than a reset).
    Proven(Result<Arc<str>, Reject>, (crate::PeerId, Epoch)),
    Done,
}

/// The server's side of one control connection, without I/O: fed each frame the peer sends,
/// it says what to send back and when the connection becomes a data stream. Both servers (TCP,
/// io_uring) drive it, so they answer the same bytes the same way.
///
/// Without authentication ([`HandshakeResponder::auth`] is `None`) a connection is one
/// [`Hello`] (answered) or one [`StreamAttach`] (served), as always, and an authentication
/// frame is refused with [`RejectReason::Unauthenticated`]. With it, a plain hello or attach is
/// refused, and a handshake is `AuthHello` → challenge, `AuthProof` + `Hello` → `HelloAck`
/// listing what is published to the proven key name; a stream is an `AuthAttach` whose proof
/// [`ServerAuth::check_attach`](crate::auth::ServerAuth::check_attach) accepts, served from
/// that name's view of the table.
#[derive(Debug)]
pub struct ServerConversation {
    responder: Arc<dyn HandshakeResponder>,
    table: Arc<dyn SegmentTable>,
    from: SocketAddr,
    state: Conversation,
}

impl ServerConversation {
    /// A conversation with the peer at `from`, served from `table` as `responder` decides.
    pub fn new(
        responder: Arc<dyn HandshakeResponder>,
        table: Arc<dyn SegmentTable>,
        from: SocketAddr,
    ) -> Self {
        Self {
            responder,
            table,
            from,
            state: Conversation::Start,
        }
    }

    fn refused(&self, message: String) -> ServerStep {
        tracing::warn!(from = %self.from, %message, "authentication refused");
        ServerStep::Close(ControlFrame::Reject(Reject {
            reason: RejectReason::Unauthenticated,
            versions: SUPPORTED_VERSIONS,
            epoch: self.responder.epoch(),
            message,
        }))
    }

    /// A place for one more data stream under `key` (the proven key name; `None` without keys)
    /// below the responder's [`StreamCap`](crate::stream_cap::StreamCap), or the refusal to send
    /// ([`RejectReason::TooManyStreams`]) when it holds the cap's worth.
    fn admit_stream(
        &mut self,
        key: Option<Arc<str>>,
    ) -> Result<Option<crate::stream_cap::StreamPermit>, Box<ServerStep>> {
        let Some(cap) = self.responder.stream_cap() else {
            return Ok(None);
        };
        match cap.admit(key) {
            Ok(permit) => Ok(Some(permit)),
            Err(full) => {
                self.state = Conversation::Done;
                tracing::warn!(from = %self.from, error = %full, "data stream refused");
                Err(Box::new(ServerStep::Close(ControlFrame::Reject(Reject {
                    reason: RejectReason::TooManyStreams,
                    versions: SUPPORTED_VERSIONS,
                    epoch: self.responder.epoch(),
                    message: format!("{full} ({} per key name)", cap.per_key()),
                }))))
            }
        }
    }

    /// The largest body the peer's next frame may have: [`MAX_PREAUTH_BODY`] on a server that
    /// requires authentication until the peer has proven its key, [`MAX_CONTROL_BODY`] after
    /// (its hello) and on a server without keys (which serves whoever connects).
    pub fn body_limit(&self) -> u32 {
        let proven = matches!(self.state, Conversation::Proven(Ok(_), _));
        if self.responder.auth().is_some() && !proven {
            MAX_PREAUTH_BODY
        } else {
            MAX_CONTROL_BODY
        }
    }

    /// Checks the header of the peer's next frame before its body is read: `None` when the
    /// body may be read (then [`on_frame`](Self::on_frame)), else the step to take instead
    /// (a refusal, then close; the body is never read), for a body over
    /// [`body_limit`](Self::body_limit).
    pub fn on_header(&mut self, header: &ControlHeader) -> Option<ServerStep> {
        let limit = self.body_limit();
        if header.body_len <= limit {
            return None;
        }
        self.state = Conversation::Done;
        tracing::warn!(from = %self.from, len = header.body_len, limit,
            "control frame too large before authentication; closing");
        Some(ServerStep::Close(ControlFrame::Reject(Reject {
            reason: RejectReason::Refused,
            versions: SUPPORTED_VERSIONS,
            epoch: self.responder.epoch(),
            message: format!(
                "authentication required: this server reads at most {limit} bytes of a frame \
                 before a peer proves its key, and this one has {}",
                header.body_len
            ),
        })))
    }

    /// The answer to a notification from the peer (authenticated as `peer`, if at all):
    /// `StaleEpoch` when it is meant for another incarnation, else what the responder says.
    fn answer_notify(&self, n: &Notify, peer: Option<&str>) -> ControlFrame {
        let epoch = self.responder.epoch();
        if n.to_epoch != epoch {
            return ControlFrame::Reject(Reject {
                reason: RejectReason::StaleEpoch,
                versions: SUPPORTED_VERSIONS,
                epoch,
                message: format!(
                    "notification for epoch {} but this server has epoch {epoch}",
                    n.to_epoch
                ),
            });
        }
        match self.responder.notify(n, self.from, peer) {
            Ok(()) => ControlFrame::NotifyAck,
            Err(r) => ControlFrame::Reject(r),
        }
    }

    /// The answer to an [`AuthHello`](crate::wire::AuthHello) (`identified`: sent as
    /// `AuthHelloIdentified`, so signed with the server's identity where it has one).
    fn challenge(
        &mut self,
        auth: Option<Arc<crate::auth::ServerAuth>>,
        h: &crate::wire::AuthHello,
        identified: bool,
    ) -> ServerStep {
        let Some(auth) = auth else {
            return self.refused(
                "this server has no authentication key and serves any peer: connect without a \
                 key"
                .into(),
            );
        };
        let challenge = if identified {
            crate::auth::ServerAuth::challenge_identified
        } else {
            crate::auth::ServerAuth::challenge
        };
        match challenge(
            &auth,
            h,
            self.responder.peer_id(),
            self.responder.epoch(),
            crate::auth::nonce(),
        ) {
            Ok((challenge, pending)) => {
                self.state = Conversation::Challenged(pending);
                ServerStep::Reply(challenge)
            }
            Err(r) => self.refused(r.message),
        }
    }

    /// The next step after the peer sent `frame`.
    pub fn on_frame(&mut self, frame: ControlFrame) -> ServerStep {
        let from = self.from;
        let auth = self.responder.auth();
        let state = std::mem::replace(&mut self.state, Conversation::Done);
        match (state, frame) {
            (Conversation::Start, ControlFrame::Hello(hello)) => {
                if auth.is_some() {
                    tracing::warn!(%from, peer = %hello.peer_id,
                        "plain hello refused: this server requires authentication");
                    return ServerStep::Close(ControlFrame::Reject(Reject {
                        reason: RejectReason::Refused,
                        versions: SUPPORTED_VERSIONS,
                        epoch: self.responder.epoch(),
                        message: "authentication required: this server only serves peers that \
                                  prove its key (give the client a key file)"
                            .into(),
                    }));
                }
                ServerStep::Close(answer_hello(&*self.responder, &hello, from, None))
            }
            (Conversation::Start, ControlFrame::Notify(n)) => {
                if auth.is_some() {
                    tracing::warn!(%from, peer = %n.peer_id,
                        "plain notification refused: this server requires authentication");
                    return ServerStep::Close(ControlFrame::Reject(Reject {
                        reason: RejectReason::Refused,
                        versions: SUPPORTED_VERSIONS,
                        epoch: self.responder.epoch(),
                        message: "authentication required: this server only takes \
                                  notifications from peers that prove its key"
                            .into(),
                    }));
                }
                ServerStep::Close(self.answer_notify(&n, None))
            }
            (Conversation::Start, ControlFrame::StreamAttach(a)) => {
                let answer = answer_attach(&a, self.responder.epoch());
                if !matches!(answer, ControlFrame::StreamAccept) {
                    return ServerStep::Close(answer);
                }
                if auth.is_some() {
                    return self.refused(
                        "data stream refused: this server requires an authenticated session".into(),
                    );
                }
                let permit = match self.admit_stream(None) {
                    Ok(p) => p,
                    Err(step) => return *step,
                };
                ServerStep::Stream {
                    attach: a,
                    stream: ServerStream::new(self.table.clone())
                        .counting(self.responder.serve_stats())
                        .holding(permit),
                }
            }
            (Conversation::Start, ControlFrame::AuthHello(h)) => self.challenge(auth, &h, false),
            (Conversation::Start, ControlFrame::AuthHelloIdentified(h)) => {
                self.challenge(auth, &h, true)
            }
            (Conversation::Challenged(pending), ControlFrame::AuthProof(p)) => {
                let client = pending.client();
                let proven = match auth {
                    Some(auth) => auth.verify(pending, &p),
                    None => Err(Reject {
                        reason: RejectReason::Unauthenticated,
                        versions: SUPPORTED_VERSIONS,
                        epoch: self.responder.epoch(),
                        message: "authentication is off".into(),
                    }),
                };
                self.state = Conversation::Proven(proven, client);
                ServerStep::Read
            }
            (Conversation::Proven(proven, client), ControlFrame::Hello(hello)) => match proven {
                Err(r) => self.refused(r.message),
                Ok(_) if (hello.peer_id, hello.epoch) != client => self.refused(format!(
                    "the hello names peer {} epoch {}, the authenticated one peer {} epoch {}",
                    hello.peer_id, hello.epoch, client.0, client.1
                )),
                Ok(name) => {
                    tracing::info!(%from, peer = %hello.peer_id, key = %name, "peer authenticated");
                    ServerStep::Close(answer_hello(&*self.responder, &hello, from, Some(&name)))
                }
            },
            (Conversation::Proven(proven, client), ControlFrame::Notify(n)) => match proven {
                Err(r) => self.refused(r.message),
                Ok(_) if (n.peer_id, n.epoch) != client => self.refused(format!(
                    "the notification names peer {} epoch {}, the authenticated one peer {} \
                     epoch {}",
                    n.peer_id, n.epoch, client.0, client.1
                )),
                Ok(name) => ServerStep::Close(self.answer_notify(&n, Some(&name))),
            },
            (Conversation::Start, ControlFrame::AuthAttach(a)) => {
                let answer = answer_attach(&a.attach, self.responder.epoch());
                if !matches!(answer, ControlFrame::StreamAccept) {
                    return ServerStep::Close(answer);
                }
                let Some(auth) = auth else {
                    return self.refused(
                        "data stream refused: this server has no authentication key".into(),
                    );
                };
                let name = match auth.check_attach(&a, self.responder.epoch()) {
                    Ok(name) => name,
                    Err(r) => return self.refused(r.message),
                };
                let permit = match self.admit_stream(Some(name.clone())) {
                    Ok(p) => p,
                    Err(step) => return *step,
                };
                ServerStep::Stream {
                    attach: a.attach,
                    stream: ServerStream::new(Arc::new(PeerView::new(self.table.clone(), name)))
                        .counting(self.responder.serve_stats())
                        .holding(permit),
                }
            }
            (state, other) => {
                let expected = match state {
                    Conversation::Start => {
                        "hello, stream-attach, notify, auth-hello or auth-attach"
                    }
                    Conversation::Challenged(_) => "auth-proof",
                    Conversation::Proven(..) => "hello or notify",
                    Conversation::Done => "nothing more",
                };
                ServerStep::Fail(unexpected(from, &other, expected))
            }
        }
    }
}

/// The server's answer to a data-stream attach: accepted if the stream is meant for this
/// incarnation (`epoch`), else a `StaleEpoch` refusal naming both epochs.
pub fn answer_attach(attach: &StreamAttach, epoch: Epoch) -> ControlFrame {
    if attach.server_epoch == epoch {
        return ControlFrame::StreamAccept;
    }
    ControlFrame::Reject(Reject {
        reason: RejectReason::StaleEpoch,
        versions: SUPPORTED_VERSIONS,
        epoch,
        message: format!(
            "stream for epoch {} but this server has epoch {epoch}",
            attach.server_epoch
        ),
    })
}

/// Where a client of a TCP-compatible data plane (TCP or io_uring: one wire) attaches its
/// streams to `peer`: the address (the handshake's, with the offered port if one is named) and
/// how many streams the peer takes (at least 1); `NoRoute` if it offers no such data plane.
pub fn stream_endpoint(peer: &PeerInfo) -> Result<(SocketAddr, usize), Error> {
    let (streams, port) = match peer.offer {
        TransportOffer::Tcp { streams, port } | TransportOffer::Uring { streams, port, .. } => {
            (usize::from(streams).max(1), port)
        }
        _ => {
            return Err(Error::NoRoute {
                peer: peer.addr.to_string(),
                reason: "the peer offers no TCP-compatible data plane".into(),
            });
        }
    };
    let addr = if port == 0 {
        peer.addr
    } else {
        SocketAddr::new(peer.addr.ip(), port)
    };
    Ok((addr, streams))
}

/// The attach of stream `index` of a channel to `peer`, by a client of data plane `transport`
/// (an offer code).
pub fn stream_attach(peer: &PeerInfo, index: u16, transport: u16) -> StreamAttach {
    StreamAttach {
        peer_id: peer.local_id,
        epoch: peer.local_epoch,
        server_epoch: peer.remote_epoch,
        transport,
        stream_index: index,
    }
}

/// The frame that attaches `attach` to `peer`: a plain [`StreamAttach`], or with the proof of
/// the peer's authenticated session where it has one.
pub fn attach_frame(peer: &PeerInfo, attach: StreamAttach) -> ControlFrame {
    match &peer.session {
        Some(s) => s.attach(attach),
        None => ControlFrame::StreamAttach(attach),
    }
}

/// What the server's reply to our `ours` hello means: its hello, `ProtocolMismatch` (with both
/// ranges, before anything is admitted), `HandshakeRefused`, or `Malformed` for any other frame.
pub fn hello_reply(peer: SocketAddr, ours: &Hello, reply: ControlFrame) -> Result<Hello, Error> {
    match reply {
        ControlFrame::HelloAck(server) => {
            if ours.versions.common(server.versions).is_none() {
                return Err(Error::ProtocolMismatch {
                    peer: peer.to_string(),
                    local: ours.versions,
                    remote: server.versions,
                });
            }
            Ok(server)
        }
        ControlFrame::Reject(r) if r.reason == RejectReason::Unauthenticated => {
            Err(Error::Authentication {
                peer: peer.to_string(),
                reason: r.message,
            })
        }
        ControlFrame::Reject(r) if r.reason == RejectReason::ProtocolMismatch => {
            Err(Error::ProtocolMismatch {
                peer: peer.to_string(),
                local: ours.versions,
                remote: r.versions,
            })
        }
        ControlFrame::Reject(r) => Err(Error::HandshakeRefused {
            peer: peer.to_string(),
            reason: r.message,
        }),
        other => Err(unexpected(peer, &other, "hello-ack")),
    }
}

/// What the server's reply to a notification means: delivered, `StaleEpoch` (another
/// incarnation serves there now), `Authentication`, `HandshakeRefused` (the inbox is full, or
/// the server takes none), or `Malformed` for any other frame.
pub fn notify_reply(peer: SocketAddr, known: Epoch, reply: ControlFrame) -> Result<(), Error> {
    accepted(peer, known, reply, "notify-ack", |f| {
        matches!(f, ControlFrame::NotifyAck)
    })
}

/// What the server's reply to a data-stream `attach` means: accepted, `StaleEpoch` (the server
/// is another incarnation than the one the stream was meant for), `HandshakeRefused`, or
/// `Malformed` for any other frame.
pub fn attach_reply(
    peer: SocketAddr,
    attach: &StreamAttach,
    reply: ControlFrame,
) -> Result<(), Error> {
    accepted(peer, attach.server_epoch, reply, "stream-accept", |f| {
        matches!(f, ControlFrame::StreamAccept)
    })
}

/// `reply` to a request meant for incarnation `known`: `Ok` when `is_accept` takes it, else
/// what its refusal says (`StaleEpoch`, `Authentication`, `HandshakeRefused`), or `Malformed`
/// naming the `expected` frame.
fn accepted(
    peer: SocketAddr,
    known: Epoch,
    reply: ControlFrame,
    expected: &'static str,
    is_accept: impl Fn(&ControlFrame) -> bool,
) -> Result<(), Error> {
    if is_accept(&reply) {
        return Ok(());
    }
    match reply {
        ControlFrame::Reject(r) if r.reason == RejectReason::StaleEpoch => Err(Error::StaleEpoch {
            addr: peer.to_string(),
            known,
            found: r.epoch,
        }),
        ControlFrame::Reject(r) if r.reason == RejectReason::Unauthenticated => {
            Err(Error::Authentication {
                peer: peer.to_string(),
                reason: r.message,
            })
        }
        ControlFrame::Reject(r) if r.reason == RejectReason::TooManyStreams => {
            Err(Error::TooManyStreams {
                peer: peer.to_string(),
                reason: r.message,
            })
        }
        ControlFrame::Reject(r) => Err(Error::HandshakeRefused {
            peer: peer.to_string(),
            reason: r.message,
        }),
        other => Err(unexpected(peer, &other, expected)),
    }
}

fn unexpected(peer: SocketAddr, found: &ControlFrame, expected: &'static str) -> Error {
    Error::Malformed {
        peer: peer.to_string(),
        source: WireError::Unexpected {
            found: found.name(),
            expected,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Epoch, PeerId};
    use crate::wire::{Reject, VersionRange};

    fn peer() -> SocketAddr {
        "127.0.0.1:7400".parse().unwrap()
    }

    fn hello(min: u16, max: u16) -> Hello {
        Hello {
            versions: VersionRange { min, max },
            peer_id: PeerId(1),
            epoch: Epoch(2),
            transports: vec![],
            segments: vec![],
        }
    }

    fn reject(reason: RejectReason, versions: VersionRange, epoch: u64) -> ControlFrame {
        ControlFrame::Reject(Reject {
            reason,
            versions,
            epoch: Epoch(epoch),
            message: "go away".into(),
        })
    }

    /// Streams attach at the handshake's address, or at the port the offer names, and a peer
    /// takes at least one stream; a peer with no TCP-compatible offer is no route.
    #[test]
    fn the_stream_endpoint_follows_the_offer() {
        let info = |offer| PeerInfo {
            addr: peer(),
            local_id: PeerId(1),
            local_epoch: Epoch(2),
            remote_id: PeerId(3),
            remote_epoch: Epoch(4),
            offer,
            segments: vec![],
            session: None,
            key_name: None,
            version: crate::wire::SUPPORTED_VERSIONS.max,
        };
        let (addr, n) = stream_endpoint(&info(TransportOffer::Tcp {
            streams: 0,
            port: 0,
        }))
        .unwrap();
        assert_eq!((addr, n), (peer(), 1));
        let (addr, n) = stream_endpoint(&info(TransportOffer::Uring {
            streams: 4,
            port: 9100,
            zero_copy: false,
        }))
        .unwrap();
        assert_eq!((addr, n), ("127.0.0.1:9100".parse().unwrap(), 4));
        let a = stream_attach(
            &info(TransportOffer::Tcp {
                streams: 1,
                port: 0,
            }),
            3,
            7,
        );
        assert_eq!(
            (
                a.peer_id,
                a.epoch,
                a.server_epoch,
                a.transport,
                a.stream_index
            ),
            (PeerId(1), Epoch(2), Epoch(4), 7, 3)
        );
    }

    /// Only a `StaleEpoch` refusal of an attach means another incarnation; any other refusal
    /// is the server's reason.
    #[test]
    fn an_attach_refused_for_another_reason_is_not_stale() {
        let attach = StreamAttach {
            peer_id: PeerId(1),
            epoch: Epoch(2),
            server_epoch: Epoch(7),
            transport: 0,
            stream_index: 0,
        };
        let e = attach_reply(
            peer(),
            &attach,
            reject(
                RejectReason::ProtocolMismatch,
                VersionRange { min: 1, max: 1 },
                7,
            ),
        )
        .unwrap_err();
        assert!(matches!(e, Error::HandshakeRefused { .. }), "{e:?}");
    }

    #[test]
    fn an_attach_for_another_incarnation_is_refused_with_both_epochs() {
        let attach = StreamAttach {
            peer_id: PeerId(1),
            epoch: Epoch(2),
            server_epoch: Epoch(7),
            transport: 0,
            stream_index: 0,
        };
        assert!(matches!(
            answer_attach(&attach, Epoch(7)),
            ControlFrame::StreamAccept
        ));
        let answer = answer_attach(&attach, Epoch(8));
        let ControlFrame::Reject(r) = &answer else {
            panic!("accepted a stale attach")
        };
        assert_eq!((r.reason, r.epoch), (RejectReason::StaleEpoch, Epoch(8)));
        let e = attach_reply(peer(), &attach, answer).unwrap_err();
        assert!(
            matches!(e, Error::StaleEpoch { known, found, .. } if known == Epoch(7) && found == Epoch(8)),
            "{e:?}"
        );
    }

    #[test]
    fn hello_ack_with_a_common_version_is_the_servers_hello() {
        let server = hello(1, 3);
        let got = hello_reply(peer(), &hello(1, 1), ControlFrame::HelloAck(server.clone()));
        assert_eq!(got.unwrap(), server);
    }

    #[test]
    fn no_common_version_is_a_mismatch_naming_both_ranges() {
        let ours = hello(1, 1);
        let e = hello_reply(peer(), &ours, ControlFrame::HelloAck(hello(2, 3))).unwrap_err();
        assert!(
            matches!(e, Error::ProtocolMismatch { local, remote, .. }
                if local == ours.versions && remote == VersionRange { min: 2, max: 3 }),
            "{e:?}"
        );
        let theirs = VersionRange { min: 5, max: 6 };
        let e = hello_reply(
            peer(),
            &ours,
            reject(RejectReason::ProtocolMismatch, theirs, 0),
        )
        .unwrap_err();
        assert!(
            matches!(e, Error::ProtocolMismatch { remote, .. } if remote == theirs),
            "{e:?}"
        );
    }

    #[test]
    fn other_refusals_and_frames() {
        let any = VersionRange { min: 1, max: 1 };
        let e = hello_reply(
            peer(),
            &hello(1, 1),
            reject(RejectReason::StaleEpoch, any, 9),
        )
        .unwrap_err();
        assert!(matches!(e, Error::HandshakeRefused { ref reason, .. } if reason == "go away"));
        let e = hello_reply(peer(), &hello(1, 1), ControlFrame::StreamAccept).unwrap_err();
        assert!(matches!(e, Error::Malformed { .. }), "{e:?}");
    }

    #[test]
    fn attach_replies() {
        let attach = StreamAttach {
            peer_id: PeerId(1),
            epoch: Epoch(2),
            server_epoch: Epoch(3),
            transport: 1,
            stream_index: 0,
        };
        assert!(attach_reply(peer(), &attach, ControlFrame::StreamAccept).is_ok());
        let any = VersionRange { min: 1, max: 1 };
        let e =
            attach_reply(peer(), &attach, reject(RejectReason::StaleEpoch, any, 4)).unwrap_err();
        assert!(
            matches!(e, Error::StaleEpoch { known, found, .. } if known == Epoch(3) && found == Epoch(4)),
            "{e:?}"
        );
        let e = attach_reply(peer(), &attach, ControlFrame::HelloAck(hello(1, 1))).unwrap_err();
        assert!(matches!(e, Error::Malformed { .. }), "{e:?}");
    }

    mod conversation {
        use super::*;
        use crate::auth::{ClientAuth, Keyring, ServerAuth};
        use crate::ids::{Access, PeerId, SegmentToken};
        use crate::op::{OpKind, SegmentDesc};
        use crate::outcome::RemoteStatus;
        use crate::transport::{MockHandshakeResponder, SegmentLease};
        use crate::wire::{AuthAttach, VersionRange};
        use proptest::prelude::*;

        const ALICE: &str = "alice 000102030405060708090a0b0c0d0e0f";
        const BOB: &str = "bob 101112131415161718191a1b1c1d1e1f";

        /// Token 1 is published to everyone, token 2 to bob only.
        #[derive(Debug)]
        struct Table;

        fn desc(token: u64) -> SegmentDesc {
            SegmentDesc {
                name: format!("s{token}"),
                token: SegmentToken(token),
                len: 8,
                access: Access::REMOTE_READ,
                remote_keys: vec![],
            }
        }

        impl SegmentTable for Table {
            fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
                (token.0 == 1 || token.0 == 2).then(|| SegmentLease {
                    region: Arc::new(crate::MemoryRegion::from_vec(vec![0; 8])),
                    base: 0,
                    len: 8,
                    access: Access::REMOTE_READ,
                    guard: None,
                })
            }
            fn published(&self) -> Vec<SegmentDesc> {
                vec![desc(1), desc(2)]
            }
            fn visible_to(&self, token: SegmentToken, peer: Option<&str>) -> bool {
                token.0 != 2 || peer == Some("bob")
            }
            fn published_to(&self, peer: Option<&str>) -> Vec<SegmentDesc> {
                self.published()
                    .into_iter()
                    .filter(|d| self.visible_to(d.token, peer))
                    .collect()
            }
        }

        /// A responder with `keys` (or none) that answers a hello with the segments published
        /// to the proven name, and must not be asked to answer when `answers` is false.
        fn responder(keys: Option<&str>, answers: bool) -> Arc<dyn HandshakeResponder> {
            let mut r = MockHandshakeResponder::new();
            r.expect_peer_id().return_const(PeerId(3));
            r.expect_epoch().return_const(Epoch(4));
            let auth = keys.map(|k| Arc::new(ServerAuth::new(Keyring::parse(k).unwrap())));
            r.expect_auth().returning(move || auth.clone());
            r.expect_serve_stats().returning(|| None);
            r.expect_stream_cap().returning(|| None);
            if answers {
                r.expect_respond().returning(|h, _, peer| {
                    Ok(Hello {
                        segments: Table.published_to(peer),
                        peer_id: PeerId(3),
                        epoch: Epoch(4),
                        ..h.clone()
                    })
                });
            } else {
                r.expect_respond().never();
            }
            Arc::new(r)
        }

        fn talk(r: &Arc<dyn HandshakeResponder>) -> ServerConversation {
            ServerConversation::new(r.clone(), Arc::new(Table), peer())
        }

        fn client_hello() -> Hello {
            hello(1, 2)
        }

        fn notify(to_epoch: u64) -> ControlFrame {
            ControlFrame::Notify(Notify {
                peer_id: PeerId(1),
                epoch: Epoch(2),
                to_epoch: Epoch(to_epoch),
                name: "agent".into(),
                message: b"done".to_vec(),
            })
        }

        /// The key names the notifications a responder took came with, in order.
        type Taken = Arc<std::sync::Mutex<Vec<Option<String>>>>;

        /// A responder that takes notifications, recording the key name each came with.
        fn inbox(keys: Option<&str>) -> (Arc<dyn HandshakeResponder>, Taken) {
            let mut r = MockHandshakeResponder::new();
            r.expect_peer_id().return_const(PeerId(3));
            r.expect_epoch().return_const(Epoch(4));
            let auth = keys.map(|k| Arc::new(ServerAuth::new(Keyring::parse(k).unwrap())));
            r.expect_auth().returning(move || auth.clone());
            r.expect_serve_stats().returning(|| None);
            r.expect_stream_cap().returning(|| None);
            r.expect_respond().never();
            let got = Arc::new(std::sync::Mutex::new(Vec::new()));
            let g = got.clone();
            r.expect_notify().returning(move |n, _, peer| {
                assert_eq!(n.message, b"done");
                g.lock().unwrap().push(peer.map(str::to_owned));
                Ok(())
            });
            (Arc::new(r), got)
        }

        #[test]
        fn a_notification_is_delivered_once_for_this_incarnation_only() {
            let (r, got) = inbox(None);
            let step = talk(&r).on_frame(notify(4));
            assert!(
                matches!(step, ServerStep::Close(ControlFrame::NotifyAck)),
                "{step:?}"
            );
            let step = talk(&r).on_frame(notify(5));
            let ServerStep::Close(ControlFrame::Reject(rj)) = step else {
                panic!("{step:?}")
            };
            assert_eq!(rj.reason, RejectReason::StaleEpoch);
            assert!(matches!(
                notify_reply(peer(), Epoch(5), ControlFrame::Reject(rj)),
                Err(Error::StaleEpoch { .. })
            ));
            assert_eq!(*got.lock().unwrap(), vec![None]);
        }

        /// A conversation in which peer `id` (epoch 2) proved alice's key.
        fn proven(r: &Arc<dyn HandshakeResponder>, id: PeerId) -> ServerConversation {
            let mut server = talk(r);
            let keys = Keyring::parse(ALICE).unwrap();
            let (first, client) = ClientAuth::start(&keys, id, Epoch(2), [1; 32]);
            let challenge = match server.on_frame(first) {
                ServerStep::Reply(f) => f,
                other => panic!("{other:?}"),
            };
            let (proof, _) = client.on_reply(peer(), challenge).unwrap();
            assert!(matches!(server.on_frame(proof), ServerStep::Read));
            server
        }

        #[test]
        fn a_keyed_server_takes_notifications_only_after_the_proof() {
            let (r, got) = inbox(Some(ALICE));
            // Plain: refused, nothing delivered.
            let step = talk(&r).on_frame(notify(4));
            assert!(
                matches!(step, ServerStep::Close(ControlFrame::Reject(_))),
                "{step:?}"
            );
            // After alice's proof: delivered under her name.
            let mut server = proven(&r, PeerId(1));
            let step = server.on_frame(notify(4));
            assert!(
                matches!(step, ServerStep::Close(ControlFrame::NotifyAck)),
                "{step:?}"
            );
            // A proof by one peer does not carry another's notification.
            let mut server = proven(&r, PeerId(9));
            assert!(matches!(
                server.on_frame(notify(4)),
                ServerStep::Close(ControlFrame::Reject(_))
            ));
            assert_eq!(*got.lock().unwrap(), vec![Some("alice".to_owned())]);
        }

        /// Runs the client's side of an authenticated handshake with `keys` against `server`:
        /// the server's last step and, if it got that far, the client's session.
        fn authenticate(
            keys: &str,
            server: &mut ServerConversation,
        ) -> Result<(ServerStep, crate::auth::Session), Error> {
            let ours = client_hello();
            let (first, client) = ClientAuth::start(
                &Keyring::parse(keys).unwrap(),
                ours.peer_id,
                ours.epoch,
                [1; 32],
            );
            let challenge = match server.on_frame(first) {
                ServerStep::Reply(f) | ServerStep::Close(f) => f,
                other => panic!("{other:?}"),
            };
            let (proof, session) = client.on_reply(peer(), challenge)?;
            assert!(matches!(server.on_frame(proof), ServerStep::Read));
            Ok((server.on_frame(ControlFrame::Hello(ours)), session))
        }

        /// What `stream` answers for `token`: a single READ of the whole segment, then a
        /// vectored READ of it in four 2-byte pieces; `None` where accepted, else the refusal.
        fn served(
            stream: &mut ServerStream,
            token: u64,
        ) -> (Option<RemoteStatus>, Option<RemoteStatus>) {
            use crate::stream::Action;
            use crate::wire::{
                DATA_REQUEST_LEN, DataRequest, Piece, ResponseHead, VectoredRequest,
            };
            let token = SegmentToken(token);
            let mut head = [0u8; DATA_REQUEST_LEN];
            DataRequest {
                kind: OpKind::Read,
                seq: 1,
                token,
                offset: 0,
                len: 8,
                ack_slack: 0,
            }
            .encode(&mut head);
            let single = match stream.on_request(&head) {
                Action::ReadMemory { .. } => None,
                Action::Refuse { status, .. } => Some(status),
                other => panic!("{other:?}"),
            };
            let req = VectoredRequest {
                kind: OpKind::Read,
                seq: 2,
                pieces: 4,
                total: 8,
            };
            req.encode(&mut head);
            let Action::Table { req } = stream.on_request(&head) else {
                panic!("not a table")
            };
            let mut table = Vec::new();
            for i in 0..4 {
                Piece {
                    token,
                    offset: i * 2,
                    len: 2,
                }
                .encode(&mut table);
            }
            let Action::Vectored {
                targets, response, ..
            } = stream.on_table(&req, &table)
            else {
                panic!("not served as a vectored request")
            };
            let Ok(ResponseHead::Vectored(r)) = ResponseHead::decode(&response) else {
                panic!("not a vectored response")
            };
            assert_eq!(r.done as usize, targets.len());
            let vectored = match r.refused {
                None => {
                    assert_eq!(r.done, 4);
                    None
                }
                Some(status) => {
                    assert_eq!(r.done, 0, "a piece of a refused segment was accepted");
                    Some(status)
                }
            };
            (single, vectored)
        }

        fn closed_with(step: ServerStep) -> ControlFrame {
            match step {
                ServerStep::Close(f) => f,
                other => panic!("expected a close, got {other:?}"),
            }
        }

        /// The conversation signs its challenge for a client that names the server it expects
        /// (and only for it), and that client goes on to the hello; a keyless server refuses
        /// it as it refuses any authenticating client.
        #[test]
        fn an_identified_hello_is_answered_with_the_servers_identity() {
            use crate::identity::IdentityKey;
            let identity = IdentityKey::from_seed(&[5; 32]);
            let mut r = MockHandshakeResponder::new();
            r.expect_peer_id().return_const(PeerId(3));
            r.expect_epoch().return_const(Epoch(4));
            let auth = Arc::new(
                ServerAuth::new(Keyring::parse(ALICE).unwrap()).with_identity(identity.clone()),
            );
            r.expect_auth().returning(move || Some(auth.clone()));
            r.expect_serve_stats().returning(|| None);
            r.expect_stream_cap().returning(|| None);
            r.expect_respond().returning(|h, _, _| {
                Ok(Hello {
                    peer_id: PeerId(3),
                    epoch: Epoch(4),
                    ..h.clone()
                })
            });
            let r: Arc<dyn HandshakeResponder> = Arc::new(r);
            let keys = Keyring::parse(ALICE).unwrap();
            let ours = client_hello();
            for expect in [Some(identity.public()), None] {
                let mut server = talk(&r);
                let (first, client) =
                    ClientAuth::start_expecting(&keys, ours.peer_id, ours.epoch, [1; 32], expect);
                let ServerStep::Reply(challenge) = server.on_frame(first) else {
                    panic!()
                };
                assert_eq!(
                    matches!(challenge, ControlFrame::SignedChallenge(_)),
                    expect.is_some()
                );
                let (proof, _) = client.on_reply(peer(), challenge).unwrap();
                assert!(matches!(server.on_frame(proof), ServerStep::Read));
                let answer = closed_with(server.on_frame(ControlFrame::Hello(ours.clone())));
                assert!(matches!(answer, ControlFrame::HelloAck(_)), "{answer:?}");
            }
            let keyless = responder(None, false);
            let (first, client) = ClientAuth::start_expecting(
                &keys,
                ours.peer_id,
                ours.epoch,
                [1; 32],
                Some(identity.public()),
            );
            let answer = closed_with(talk(&keyless).on_frame(first));
            let e = client.on_reply(peer(), answer).unwrap_err();
            assert!(matches!(e, Error::Authentication { .. }), "{e}");
        }

        #[test]
        fn a_keyed_server_refuses_a_plain_hello_before_listing_anything() {
            let r = responder(Some(ALICE), false);
            let answer = closed_with(talk(&r).on_frame(ControlFrame::Hello(client_hello())));
            let e = hello_reply(peer(), &client_hello(), answer).unwrap_err();
            assert!(
                matches!(&e, Error::HandshakeRefused { reason, .. } if reason.contains("authentication required")),
                "{e}"
            );
        }

        fn header_of(frame: &ControlFrame) -> ControlHeader {
            let mut buf = Vec::new();
            frame.encode(SUPPORTED_VERSIONS.max, &mut buf).unwrap();
            let head: [u8; crate::wire::CONTROL_HEADER_LEN] =
                buf[..crate::wire::CONTROL_HEADER_LEN].try_into().unwrap();
            ControlHeader::decode(&head).unwrap()
        }

        /// Before a peer proves its key, a keyed server reads at most `MAX_PREAUTH_BODY` bytes
        /// of a frame (every authentication frame fits, with the longest key name); a larger
        /// one is refused from its header alone. After the proof, and on a keyless server, the
        /// whole control limit applies.
        #[test]
        fn frames_before_the_proof_are_capped_to_what_authentication_needs() {
            let longest = AuthAttach {
                attach: attach(),
                session: [0; 32],
                counter: u64::MAX,
                mac: [0; 32],
            };
            let auth_hello = ControlFrame::AuthHello(crate::wire::AuthHello {
                name: "n".repeat(crate::wire::MAX_AUTH_NAME),
                peer_id: PeerId(1),
                epoch: Epoch(2),
                nonce: [0; 32],
            });
            let proof = ControlFrame::AuthProof(crate::wire::AuthProof { mac: [0; 32] });
            for f in [&auth_hello, &proof, &ControlFrame::AuthAttach(longest)] {
                assert!(header_of(f).body_len <= MAX_PREAUTH_BODY, "{f:?}");
            }
            let big = ControlHeader {
                version: SUPPORTED_VERSIONS.max,
                kind: header_of(&ControlFrame::Hello(client_hello())).kind,
                body_len: MAX_PREAUTH_BODY + 1,
            };

            let r = responder(Some(ALICE), true);
            let mut t = talk(&r);
            assert_eq!(t.body_limit(), MAX_PREAUTH_BODY);
            let step = t
                .on_header(&big)
                .expect("a large first frame was let through");
            let e = hello_reply(peer(), &client_hello(), closed_with(step)).unwrap_err();
            assert!(
                matches!(&e, Error::HandshakeRefused { reason, .. } if reason.contains("authentication required")),
                "{e}"
            );
            // Nothing more is read on that connection.
            assert!(matches!(
                t.on_frame(auth_hello.clone()),
                ServerStep::Fail(_)
            ));

            // Challenged, and after a forged proof: still capped.
            let mut t = talk(&r);
            let (first, _) = ClientAuth::start(
                &Keyring::parse(ALICE).unwrap(),
                PeerId(1),
                Epoch(2),
                [1; 32],
            );
            assert!(t.on_header(&header_of(&first)).is_none());
            assert!(matches!(t.on_frame(first), ServerStep::Reply(_)));
            assert_eq!(t.body_limit(), MAX_PREAUTH_BODY);
            assert!(t.on_header(&big).is_some());
            let mut t = talk(&r);
            let (first, _) = ClientAuth::start(
                &Keyring::parse(ALICE).unwrap(),
                PeerId(1),
                Epoch(2),
                [1; 32],
            );
            t.on_frame(first);
            t.on_frame(proof);
            assert_eq!(
                t.body_limit(),
                MAX_PREAUTH_BODY,
                "a forged proof lifted the cap"
            );

            // Proven: the hello may be as large as any control frame.
            let mut t = talk(&r);
            let ours = client_hello();
            let (first, client) = ClientAuth::start(
                &Keyring::parse(ALICE).unwrap(),
                ours.peer_id,
                ours.epoch,
                [1; 32],
            );
            let ServerStep::Reply(challenge) = t.on_frame(first) else {
                panic!()
            };
            let (proof, _) = client.on_reply(peer(), challenge).unwrap();
            t.on_frame(proof);
            assert_eq!(t.body_limit(), MAX_CONTROL_BODY);
            assert!(t.on_header(&big).is_none());

            // A keyless server serves whoever connects: the control limit.
            let r = responder(None, true);
            let mut t = talk(&r);
            assert_eq!(t.body_limit(), MAX_CONTROL_BODY);
            assert!(t.on_header(&big).is_none());
        }

        #[test]
        fn a_keyless_server_refuses_an_authenticating_client_clearly() {
            let r = responder(None, false);
            let e = authenticate(ALICE, &mut talk(&r))
                .err()
                .unwrap_or_else(|| panic!("a keyless server challenged"));
            assert!(
                matches!(&e, Error::Authentication { reason, .. } if reason.contains("no authentication key")),
                "{e}"
            );
            // A keyless server serves plain peers as before (what is published to everyone).
            let r = responder(None, true);
            let answer = closed_with(talk(&r).on_frame(ControlFrame::Hello(client_hello())));
            assert_eq!(
                hello_reply(peer(), &client_hello(), answer)
                    .unwrap()
                    .segments
                    .len(),
                1
            );
        }

        #[test]
        fn an_authenticated_peer_sees_what_is_published_to_its_name() {
            for (keys, expect) in [(ALICE, vec![1]), (BOB, vec![1, 2])] {
                let r = responder(Some(&format!("{ALICE}\n{BOB}")), true);
                let (step, _) = authenticate(keys, &mut talk(&r)).unwrap();
                let server = hello_reply(peer(), &client_hello(), closed_with(step)).unwrap();
                let tokens: Vec<u64> = server.segments.iter().map(|d| d.token.0).collect();
                assert_eq!(tokens, expect, "{keys}");
            }
        }

        #[test]
        fn a_wrong_key_is_refused_and_nothing_is_listed() {
            let r = responder(Some(ALICE), false);
            let wrong = "alice ffffffffffffffffffffffffffffffff";
            let e = authenticate(wrong, &mut talk(&r)).err().unwrap();
            assert!(matches!(e, Error::Authentication { .. }), "{e}");
            // A client that ignores the server's failed proof and sends a forged one.
            let mut t = talk(&r);
            let (first, _) = ClientAuth::start(
                &Keyring::parse(wrong).unwrap(),
                PeerId(1),
                Epoch(2),
                [1; 32],
            );
            assert!(matches!(t.on_frame(first), ServerStep::Reply(_)));
            let forged = ControlFrame::AuthProof(crate::wire::AuthProof { mac: [0; 32] });
            assert!(matches!(t.on_frame(forged), ServerStep::Read));
            let answer = closed_with(t.on_frame(ControlFrame::Hello(client_hello())));
            let e = hello_reply(peer(), &client_hello(), answer).unwrap_err();
            assert!(matches!(e, Error::Authentication { .. }), "{e}");
        }

        #[test]
        fn a_proven_client_cannot_switch_identity_in_its_hello() {
            let r = responder(Some(ALICE), false);
            let mut t = talk(&r);
            let ours = client_hello();
            let (first, client) = ClientAuth::start(
                &Keyring::parse(ALICE).unwrap(),
                ours.peer_id,
                ours.epoch,
                [1; 32],
            );
            let ServerStep::Reply(challenge) = t.on_frame(first) else {
                panic!()
            };
            let (proof, _) = client.on_reply(peer(), challenge).unwrap();
            t.on_frame(proof);
            let other = Hello {
                peer_id: PeerId(77),
                ..ours
            };
            let answer = closed_with(t.on_frame(ControlFrame::Hello(other)));
            assert!(
                matches!(answer, ControlFrame::Reject(r) if r.reason == RejectReason::Unauthenticated)
            );
        }

        fn attach() -> StreamAttach {
            StreamAttach {
                peer_id: PeerId(1),
                epoch: Epoch(2),
                server_epoch: Epoch(4),
                transport: 1,
                stream_index: 0,
            }
        }

        #[test]
        fn streams_attach_only_with_the_sessions_proof() {
            let r = responder(Some(&format!("{ALICE}\n{BOB}")), true);
            let (_, session) = authenticate(ALICE, &mut talk(&r)).unwrap();
            // Plain attach: refused.
            let answer = closed_with(talk(&r).on_frame(ControlFrame::StreamAttach(attach())));
            let e = attach_reply(peer(), &attach(), answer).unwrap_err();
            assert!(matches!(e, Error::Authentication { .. }), "{e}");
            // Forged proof: refused.
            let ControlFrame::AuthAttach(good) = session.attach(attach()) else {
                panic!()
            };
            let forged = AuthAttach {
                mac: [9; 32],
                ..good
            };
            let answer = closed_with(talk(&r).on_frame(ControlFrame::AuthAttach(forged)));
            assert!(attach_reply(peer(), &attach(), answer).is_err());
            // For another incarnation: stale, whatever the proof.
            let stale = AuthAttach {
                attach: StreamAttach {
                    server_epoch: Epoch(9),
                    ..attach()
                },
                ..good
            };
            let answer = closed_with(talk(&r).on_frame(ControlFrame::AuthAttach(stale)));
            assert!(matches!(
                attach_reply(peer(), &stale.attach, answer),
                Err(Error::StaleEpoch { .. })
            ));
            // The real one: served from alice's view (token 2 is bob's), for single ops and
            // piece tables alike.
            let ServerStep::Stream { mut stream, .. } =
                talk(&r).on_frame(ControlFrame::AuthAttach(good))
            else {
                panic!("refused the session's own attach")
            };
            assert_eq!(served(&mut stream, 1), (None, None));
            let unknown = Some(RemoteStatus::UnknownSegment);
            assert_eq!(served(&mut stream, 2), (unknown, unknown));
            // And once only.
            let answer = closed_with(talk(&r).on_frame(ControlFrame::AuthAttach(good)));
            assert!(attach_reply(peer(), &attach(), answer).is_err());
        }

        /// A responder like [`responder`] whose streams are capped at `cap` per key name.
        fn capped(
            keys: Option<&str>,
            cap: &Arc<crate::stream_cap::StreamCap>,
        ) -> Arc<dyn HandshakeResponder> {
            let mut r = MockHandshakeResponder::new();
            r.expect_peer_id().return_const(PeerId(3));
            r.expect_epoch().return_const(Epoch(4));
            let auth = keys.map(|k| Arc::new(ServerAuth::new(Keyring::parse(k).unwrap())));
            r.expect_auth().returning(move || auth.clone());
            r.expect_serve_stats().returning(|| None);
            let cap = cap.clone();
            r.expect_stream_cap().returning(move || Some(cap.clone()));
            r.expect_respond().returning(|h, _, _| Ok(h.clone()));
            Arc::new(r)
        }

        /// An attached stream's proven key name counts against the cap: past it, the next
        /// attach of that name (a valid proof) is refused with `TooManyStreams`, which the
        /// client names; another name still attaches; a stream that ends frees its place.
        /// Without keys, every peer counts as one name. A refused proof takes no place.
        #[test]
        fn streams_past_the_cap_of_their_key_name_are_refused_and_named() {
            let cap = crate::stream_cap::StreamCap::new(2);
            let r = capped(Some(&format!("{ALICE}\n{BOB}")), &cap);
            let (_, alice) = authenticate(ALICE, &mut talk(&r)).unwrap();
            let (_, bob) = authenticate(BOB, &mut talk(&r)).unwrap();
            let attach_as = |session: &crate::auth::Session, index: u16| {
                talk(&r).on_frame(session.attach(StreamAttach {
                    stream_index: index,
                    ..attach()
                }))
            };
            let mut held = Vec::new();
            for i in 0..2 {
                let step = attach_as(&alice, i);
                let ServerStep::Stream { stream, .. } = step else {
                    panic!("alice's stream {i} refused: {step:?}")
                };
                held.push(stream);
            }
            let answer = closed_with(attach_as(&alice, 2));
            let e = attach_reply(peer(), &attach(), answer).unwrap_err();
            assert!(
                matches!(&e, Error::TooManyStreams { reason, .. } if reason.contains("\"alice\"")),
                "{e}"
            );
            // A forged proof is refused as before, and takes no place.
            let ControlFrame::AuthAttach(good) = bob.attach(attach()) else {
                panic!()
            };
            let forged = AuthAttach {
                mac: [9; 32],
                ..good
            };
            let answer = closed_with(talk(&r).on_frame(ControlFrame::AuthAttach(forged)));
            assert!(matches!(
                attach_reply(peer(), &attach(), answer),
                Err(Error::Authentication { .. })
            ));
            assert_eq!(cap.held(Some("bob")), 0);
            assert!(matches!(
                talk(&r).on_frame(ControlFrame::AuthAttach(good)),
                ServerStep::Stream { .. }
            ));
            held.pop();
            assert!(matches!(attach_as(&alice, 3), ServerStep::Stream { .. }));

            let cap = crate::stream_cap::StreamCap::new(1);
            let r = capped(None, &cap);
            let step = talk(&r).on_frame(ControlFrame::StreamAttach(attach()));
            let ServerStep::Stream { stream, .. } = step else {
                panic!("{step:?}")
            };
            let answer = closed_with(talk(&r).on_frame(ControlFrame::StreamAttach(attach())));
            assert!(matches!(
                attach_reply(peer(), &attach(), answer),
                Err(Error::TooManyStreams { .. })
            ));
            drop(stream);
            assert!(matches!(
                talk(&r).on_frame(ControlFrame::StreamAttach(attach())),
                ServerStep::Stream { .. }
            ));
        }

        #[test]
        fn a_keyless_server_refuses_an_authenticated_attach_and_serves_plain_ones() {
            let r = responder(None, false);
            let a = AuthAttach {
                attach: attach(),
                session: [0; 32],
                counter: 0,
                mac: [0; 32],
            };
            let answer = closed_with(talk(&r).on_frame(ControlFrame::AuthAttach(a)));
            assert!(matches!(
                attach_reply(peer(), &attach(), answer),
                Err(Error::Authentication { .. })
            ));
            let step = talk(&r).on_frame(ControlFrame::StreamAttach(attach()));
            let ServerStep::Stream { mut stream, .. } = step else {
                panic!("{step:?}")
            };
            assert_eq!(served(&mut stream, 2), (None, None));
        }

        fn arb_frame() -> impl Strategy<Value = ControlFrame> {
            let any_range = VersionRange { min: 1, max: 2 };
            prop_oneof![
                Just(ControlFrame::Hello(hello(1, 2))),
                Just(ControlFrame::StreamAttach(attach())),
                Just(ControlFrame::StreamAccept),
                Just(ControlFrame::Reject(Reject {
                    reason: RejectReason::Refused,
                    versions: any_range,
                    epoch: Epoch(1),
                    message: String::new(),
                })),
                (any::<u8>(), any::<[u8; 32]>()).prop_map(|(n, nonce)| {
                    ControlFrame::AuthHello(crate::wire::AuthHello {
                        name: if n % 2 == 0 {
                            "alice".into()
                        } else {
                            format!("x{n}")
                        },
                        peer_id: PeerId(1),
                        epoch: Epoch(2),
                        nonce,
                    })
                }),
                any::<[u8; 32]>()
                    .prop_map(|mac| ControlFrame::AuthProof(crate::wire::AuthProof { mac })),
                (any::<[u8; 32]>(), any::<u64>(), any::<[u8; 32]>()).prop_map(
                    |(session, counter, mac)| ControlFrame::AuthAttach(AuthAttach {
                        attach: attach(),
                        session,
                        counter,
                        mac,
                    })
                ),
            ]
        }

        proptest! {
            /// Any sequence of frames, to a server with or without keys, ends the conversation
            /// (a close or a failure) without a panic, and never reaches a data stream or a
            /// listing on a keyed server without the key.
            #[test]
            fn fuzz_the_server_conversation_never_panics(frames in proptest::collection::vec(arb_frame(), 1..6), keyed in any::<bool>()) {
                let r = responder(keyed.then_some(ALICE), !keyed);
                let mut t = talk(&r);
                for f in frames {
                    match t.on_frame(f) {
                        ServerStep::Reply(_) | ServerStep::Read => continue,
                        ServerStep::Stream { .. } => {
                            prop_assert!(!keyed, "a stranger attached to a keyed server");
                            break;
                        }
                        ServerStep::Close(f) => {
                            prop_assert!(!keyed || !matches!(f, ControlFrame::HelloAck(_)));
                            break;
                        }
                        _ => break,
                    }
                }
            }
        }
    }
}

//! The control handshake, without I/O: what a server answers, and what its answer means.
//!
//! Every transport that speaks Ferry's wire sends a [`Hello`] (or a [`StreamAttach`]) and reads
//! one [`ControlFrame`] back; these functions decide the server's answer and turn that frame into
//! the client's result, so that the TCP and io_uring transports (and any other) give the same
//! answers and errors for the same bytes.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::auth::{PeerView, PendingProof};
use crate::error::Error;
use crate::ids::Epoch;
use crate::transport::{HandshakeResponder, PeerInfo, SegmentTable};
use crate::wire::{
    ControlFrame, Hello, Reject, RejectReason, SUPPORTED_VERSIONS, StreamAttach, TransportOffer,
    WireError,
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
    /// from `table` (the peer's view of the published segments).
    Stream {
        /// The attach.
        attach: StreamAttach,
        /// What the stream may see.
        table: Arc<dyn SegmentTable>,
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
                ServerStep::Stream {
                    attach: a,
                    table: self.table.clone(),
                }
            }
            (Conversation::Start, ControlFrame::AuthHello(h)) => {
                let Some(auth) = auth else {
                    return self.refused(
                        "this server has no authentication key and serves any peer: connect \
                         without a key"
                            .into(),
                    );
                };
                match auth.challenge(
                    &h,
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
                match auth.check_attach(&a, self.responder.epoch()) {
                    Ok(name) => ServerStep::Stream {
                        attach: a.attach,
                        table: Arc::new(PeerView::new(self.table.clone(), name)),
                    },
                    Err(r) => self.refused(r.message),
                }
            }
            (state, other) => {
                let expected = match state {
                    Conversation::Start => "hello, stream-attach, auth-hello or auth-attach",
                    Conversation::Challenged(_) => "auth-proof",
                    Conversation::Proven(..) => "hello",
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

/// What the server's reply to a data-stream `attach` means: accepted, `StaleEpoch` (the server
/// is another incarnation than the one the stream was meant for), `HandshakeRefused`, or
/// `Malformed` for any other frame.
pub fn attach_reply(
    peer: SocketAddr,
    attach: &StreamAttach,
    reply: ControlFrame,
) -> Result<(), Error> {
    match reply {
        ControlFrame::StreamAccept => Ok(()),
        ControlFrame::Reject(r) if r.reason == RejectReason::StaleEpoch => Err(Error::StaleEpoch {
            addr: peer.to_string(),
            known: attach.server_epoch,
            found: r.epoch,
        }),
        ControlFrame::Reject(r) if r.reason == RejectReason::Unauthenticated => {
            Err(Error::Authentication {
                peer: peer.to_string(),
                reason: r.message,
            })
        }
        ControlFrame::Reject(r) => Err(Error::HandshakeRefused {
            peer: peer.to_string(),
            reason: r.message,
        }),
        other => Err(unexpected(peer, &other, "stream-accept")),
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
}

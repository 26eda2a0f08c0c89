//! The control handshake, without I/O: what a server answers, and what its answer means.
//!
//! Every transport that speaks Ferry's wire sends a [`Hello`] (or a [`StreamAttach`]) and reads
//! one [`ControlFrame`] back; these functions decide the server's answer and turn that frame into
//! the client's result, so that the TCP and io_uring transports (and any other) give the same
//! answers and errors for the same bytes.

use std::net::SocketAddr;

use crate::error::Error;
use crate::ids::Epoch;
use crate::transport::{HandshakeResponder, PeerInfo};
use crate::wire::{
    ControlFrame, Hello, Reject, RejectReason, SUPPORTED_VERSIONS, StreamAttach, TransportOffer,
    WireError,
};

/// The server's answer to a peer's hello from `from`: our hello, or the responder's refusal.
pub fn answer_hello(
    responder: &dyn HandshakeResponder,
    hello: &Hello,
    from: SocketAddr,
) -> ControlFrame {
    match responder.respond(hello, from) {
        Ok(h) => ControlFrame::HelloAck(h),
        Err(r) => ControlFrame::Reject(r),
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
}

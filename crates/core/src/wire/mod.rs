//! The wire: control frames (handshake, stream attach) and the fixed data-plane headers.
//!
//! Control frames are `magic(4) | version u16 | kind u8 | flags u8 | body_len u32 | body`, all
//! integers little-endian. The decoder checks every length against what is left of the input and
//! against fixed limits before it allocates, and returns [`WireError`] (never panics) on any input.
//!
//! Data streams carry fixed-size headers: a [`DataRequest`] (32 bytes, followed by the payload for a
//! WRITE) and a [`DataResponse`] (16 bytes, followed by the payload for an accepted READ). The TCP
//! and io_uring transports speak exactly this and interoperate.
//!
//! The folder follows the wire's concerns: control frames (`control`), transport offers
//! (`offer`), data-plane headers (`data`), their errors (`error`), and the byte reader and
//! writers they share (`codec`). Every public item is re-exported here, so
//! `ferry_core::wire::NAME` is the one path.

use std::fmt;

mod codec;
mod control;
mod data;
mod error;
mod offer;

pub use control::{
    AuthAttach, AuthChallenge, AuthHello, AuthProof, ControlFrame, ControlHeader, Hello, Notify,
    Reject, RejectReason, SignedChallenge, StreamAttach,
};
pub use data::{
    DataRequest, DataResponse, Piece, RequestHead, ResponseHead, VectoredRequest, VectoredResponse,
    decode_pieces,
};
pub use error::{EncodeError, WireError};
pub use offer::{MAX_LOCAL_SOCKET, RdmaEndpoint, TransportOffer};

/// Magic bytes that open every control frame.
pub const MAGIC: [u8; 4] = *b"FRRY";
/// The protocol versions this build speaks. Version 2 adds the CHECKSUM data request
/// ([`OpKind::Checksum`](crate::OpKind::Checksum)); frames and the other data requests are unchanged, so a version-1 peer
/// is spoken to in version 1 and is never sent a CHECKSUM (the facade refuses it locally).
/// Version 3 adds vectored requests ([`VectoredRequest`]); an older peer gets one request per
/// chunk, as before.
pub const SUPPORTED_VERSIONS: VersionRange = VersionRange { min: 1, max: 3 };
/// The first protocol version with the CHECKSUM data request.
pub const CHECKSUM_VERSION: u16 = 2;
/// The first protocol version with vectored requests ([`VectoredRequest`]).
pub const VECTORED_VERSION: u16 = 3;
/// Largest number of pieces in one vectored request.
pub const MAX_PIECES: u32 = 1024;
/// Size of one piece in a vectored request's piece table.
pub const PIECE_LEN: usize = 24;
/// Size of a control frame header.
pub const CONTROL_HEADER_LEN: usize = 12;
/// Largest control frame body accepted.
pub const MAX_CONTROL_BODY: u32 = 16 << 20;
/// Largest control frame body a server that requires authentication reads before the peer has
/// proven its key: an [`AuthHello`], [`AuthProof`] or [`AuthAttach`] is under 200 bytes (see
/// [`ServerConversation::body_limit`](crate::handshake::ServerConversation::body_limit)).
pub const MAX_PREAUTH_BODY: u32 = 1024;
/// Largest number of segments in one handshake.
pub const MAX_SEGMENTS: usize = 65_536;
/// Largest segment name, in bytes.
pub const MAX_NAME_LEN: usize = 1024;
/// Largest number of transport offers in one handshake.
pub const MAX_TRANSPORTS: usize = 16;
/// Largest number of RDMA rails in one offer.
pub const MAX_RAILS: usize = 64;
/// Largest number of remote keys per segment.
pub const MAX_KEYS: usize = 256;
/// Largest refusal message, in bytes.
pub const MAX_MESSAGE_LEN: usize = 4096;

/// The largest message a [`Notify`] carries.
pub const MAX_NOTIFY_LEN: usize = 64 << 10;

/// The longest sender name a [`Notify`] carries.
pub const MAX_NOTIFY_NAME: usize = 255;
/// Largest payload of one data-plane chunk.
pub const MAX_CHUNK: u64 = 64 << 20;
/// Size of a data request header.
pub const DATA_REQUEST_LEN: usize = 32;
/// Size of a data response header.
pub const DATA_RESPONSE_LEN: usize = 16;
/// Size of an authentication nonce.
pub const AUTH_NONCE_LEN: usize = 32;
/// Size of an authentication MAC (HMAC-SHA256).
pub const AUTH_MAC_LEN: usize = 32;
/// Size of a server's public identity (an Ed25519 public key). The identity frames
/// ([`ControlFrame::AuthHelloIdentified`], [`ControlFrame::SignedChallenge`]) are new kinds,
/// sent only by a client that names the server it expects and only in answer to one: peers
/// that never do speak exactly as before, and a server older than them refuses the unknown
/// kind (it cannot prove an identity), so the protocol version range is unchanged.
pub const IDENTITY_LEN: usize = 32;
/// Size of a server's signature over a handshake transcript (Ed25519).
pub const SIGNATURE_LEN: usize = 64;
/// Largest key name an authenticating peer may claim, in bytes.
pub const MAX_AUTH_NAME: usize = 64;

/// An inclusive range of protocol versions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VersionRange {
    /// Oldest version spoken.
    pub min: u16,
    /// Newest version spoken.
    pub max: u16,
}

impl VersionRange {
    /// The newest version both ranges contain.
    pub fn common(self, other: VersionRange) -> Option<u16> {
        let lo = self.min.max(other.min);
        let hi = self.max.min(other.max);
        (lo <= hi && self.min <= self.max && other.min <= other.max).then_some(hi)
    }
}

impl fmt::Display for VersionRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..={}", self.min, self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::control::K_HELLO;
    use super::*;
    use crate::ids::{Access, Epoch, PeerId, SegmentToken};
    use crate::op::{OpKind, RemoteKey, SegmentDesc};
    use crate::outcome::RemoteStatus;
    use proptest::prelude::*;

    fn sample_hello() -> Hello {
        Hello {
            versions: SUPPORTED_VERSIONS,
            peer_id: PeerId(0x1234),
            epoch: Epoch(99),
            transports: vec![
                TransportOffer::Tcp {
                    streams: 2,
                    port: 0,
                },
                TransportOffer::Rdma {
                    rails: vec![RdmaEndpoint {
                        rail: 0,
                        port_num: 1,
                        mtu: 5,
                        lid: 0,
                        gid: [7; 16],
                        qpn: 0x11,
                        psn: 0x22,
                    }],
                },
                TransportOffer::Unknown {
                    code: 77,
                    body: vec![1, 2, 3],
                },
            ],
            segments: vec![SegmentDesc {
                name: "weights".into(),
                token: SegmentToken(5),
                len: 1 << 30,
                access: Access::REMOTE_READ,
                remote_keys: vec![RemoteKey {
                    context: 0,
                    addr: 0xdead_0000,
                    rkey: 42,
                }],
            }],
        }
    }

    fn roundtrip(f: &ControlFrame) -> ControlFrame {
        let mut buf = Vec::new();
        f.encode(1, &mut buf).unwrap();
        let (back, used) = ControlFrame::decode(&buf).unwrap().unwrap();
        assert_eq!(used, buf.len());
        back
    }

    #[test]
    fn hello_roundtrips_and_every_prefix_is_incomplete() {
        let f = ControlFrame::Hello(sample_hello());
        assert_eq!(roundtrip(&f), f);
        let mut buf = Vec::new();
        f.encode(1, &mut buf).unwrap();
        for cut in 0..buf.len() {
            assert_eq!(ControlFrame::decode(&buf[..cut]), Ok(None), "cut {cut}");
        }
    }

    #[test]
    fn bad_magic_and_huge_body_are_refused_before_allocation() {
        let mut h = [0u8; CONTROL_HEADER_LEN];
        h[..4].copy_from_slice(b"XXXX");
        assert!(matches!(
            ControlHeader::decode(&h),
            Err(WireError::BadMagic(_))
        ));
        h[..4].copy_from_slice(&MAGIC);
        h[6] = K_HELLO;
        h[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            ControlHeader::decode(&h),
            Err(WireError::TooLarge { .. })
        ));
    }

    #[test]
    fn huge_counts_are_refused() {
        let mut body = Vec::new();
        sample_hello().encode_body(&mut body).unwrap();
        // segment count claims 60000 segments with only one present
        let mut f = Vec::new();
        ControlFrame::Hello(Hello {
            segments: vec![],
            transports: vec![],
            ..sample_hello()
        })
        .encode(1, &mut f)
        .unwrap();
        let n = f.len();
        f[n - 4..].copy_from_slice(&60_000u32.to_le_bytes());
        // Refused at the count, against the bytes left, before any room is made for the
        // records (a decoder that trusted the count would fail later, at the first record).
        assert!(matches!(
            ControlFrame::decode(&f),
            Err(WireError::Truncated {
                field: "segment count",
                ..
            })
        ));
        f[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            ControlFrame::decode(&f),
            Err(WireError::TooLarge { .. })
        ));
    }

    #[test]
    fn reject_attach_accept_roundtrip() {
        for f in [
            ControlFrame::Reject(Reject {
                reason: RejectReason::ProtocolMismatch,
                versions: VersionRange { min: 3, max: 4 },
                epoch: Epoch(1),
                message: "no".into(),
            }),
            ControlFrame::StreamAttach(StreamAttach {
                peer_id: PeerId(1),
                epoch: Epoch(2),
                server_epoch: Epoch(3),
                transport: 1,
                stream_index: 4,
            }),
            ControlFrame::StreamAccept,
        ] {
            assert_eq!(roundtrip(&f), f);
        }
    }

    #[test]
    fn data_headers_roundtrip_and_check_length() {
        let req = DataRequest {
            kind: OpKind::Write,
            seq: 9,
            token: SegmentToken(3),
            offset: 17,
            len: 1 << 20,
            ack_slack: 3,
        };
        let mut b = [0u8; DATA_REQUEST_LEN];
        req.encode(&mut b);
        assert_eq!(DataRequest::decode(&b), Ok(req));
        b[24..32].copy_from_slice(&(MAX_CHUNK + 1).to_le_bytes());
        assert!(DataRequest::decode(&b).is_err());
        // A CHECKSUM names a range to hash, not a payload: any length.
        let sum = DataRequest {
            kind: OpKind::Checksum,
            len: 1 << 40,
            ack_slack: 0,
            ..req
        };
        sum.encode(&mut b);
        assert_eq!(DataRequest::decode(&b), Ok(sum));
        let resp = DataResponse {
            seq: 9,
            refused: Some(RemoteStatus::AccessDenied),
            len: 0,
            also_acks: 2,
        };
        let mut b = [0u8; DATA_RESPONSE_LEN];
        resp.encode(&mut b);
        assert_eq!(DataResponse::decode(&b), Ok(resp));
    }

    #[test]
    fn vectored_headers_roundtrip_and_check_counts() {
        let req = VectoredRequest {
            kind: OpKind::Read,
            seq: 5,
            pieces: 3,
            total: 96,
        };
        let mut b = [0u8; DATA_REQUEST_LEN];
        req.encode(&mut b);
        assert_eq!(RequestHead::decode(&b), Ok(RequestHead::Vectored(req)));
        // An older peer's decoder refuses the op code (it is never sent one).
        assert!(DataRequest::decode(&b).is_err());
        for pieces in [0, MAX_PIECES + 1] {
            VectoredRequest { pieces, ..req }.encode(&mut b);
            assert!(RequestHead::decode(&b).is_err());
        }
        let resp = VectoredResponse {
            seq: 5,
            refused: Some(RemoteStatus::AccessDenied),
            done: 2,
            len: 64,
        };
        let mut b = [0u8; DATA_RESPONSE_LEN];
        resp.encode(&mut b);
        assert_eq!(ResponseHead::decode(&b), Ok(ResponseHead::Vectored(resp)));
        assert!(DataResponse::decode(&b).is_err());
        VectoredResponse {
            done: MAX_PIECES + 1,
            ..resp
        }
        .encode(&mut b);
        assert!(ResponseHead::decode(&b).is_err());
        // A count larger than the bytes is refused before allocation.
        let liar = VectoredRequest {
            pieces: MAX_PIECES,
            ..req
        };
        assert!(matches!(
            decode_pieces(&liar, &[0u8; PIECE_LEN]),
            Err(WireError::Truncated { .. })
        ));
    }

    #[test]
    fn version_ranges() {
        let a = VersionRange { min: 1, max: 3 };
        assert_eq!(a.common(VersionRange { min: 2, max: 5 }), Some(3));
        assert_eq!(a.common(VersionRange { min: 4, max: 5 }), None);
        assert_eq!(a.common(VersionRange { min: 3, max: 1 }), None);
    }

    fn arb_offer() -> impl Strategy<Value = TransportOffer> {
        prop_oneof![
            (any::<u16>(), any::<u16>())
                .prop_map(|(streams, port)| TransportOffer::Tcp { streams, port }),
            (any::<u16>(), any::<u16>(), any::<bool>()).prop_map(|(streams, port, zero_copy)| {
                TransportOffer::Uring {
                    streams,
                    port,
                    zero_copy,
                }
            }),
            proptest::collection::vec(
                (
                    any::<u16>(),
                    any::<u8>(),
                    any::<u8>(),
                    any::<u16>(),
                    any::<[u8; 16]>(),
                    any::<u32>(),
                    any::<u32>()
                ),
                0..4
            )
            .prop_map(|v| TransportOffer::Rdma {
                rails: v
                    .into_iter()
                    .map(|(rail, port_num, mtu, lid, gid, qpn, psn)| RdmaEndpoint {
                        rail,
                        port_num,
                        mtu,
                        lid,
                        gid,
                        qpn,
                        psn
                    })
                    .collect()
            }),
            (
                any::<[u8; 16]>(),
                any::<u32>(),
                any::<u16>(),
                "[a-z0-9/-]{0,107}"
            )
                .prop_map(|(boot_id, pid, streams, socket)| TransportOffer::Local {
                    boot_id,
                    pid,
                    streams,
                    socket,
                }),
            (100u16.., proptest::collection::vec(any::<u8>(), 0..16))
                .prop_map(|(code, body)| TransportOffer::Unknown { code, body }),
        ]
    }

    fn arb_segment() -> impl Strategy<Value = SegmentDesc> {
        (
            "[a-z0-9/._-]{0,24}",
            any::<u64>(),
            any::<u64>(),
            0u8..4,
            proptest::collection::vec((any::<u32>(), any::<u64>(), any::<u32>()), 0..3),
        )
            .prop_map(|(name, token, len, access, keys)| SegmentDesc {
                name,
                token: SegmentToken(token),
                len,
                access: Access::from_bits_truncate(access),
                remote_keys: keys
                    .into_iter()
                    .map(|(context, addr, rkey)| RemoteKey {
                        context,
                        addr,
                        rkey,
                    })
                    .collect(),
            })
    }

    fn arb_hello() -> impl Strategy<Value = Hello> {
        (
            any::<u16>(),
            any::<u16>(),
            any::<u128>(),
            any::<u64>(),
            proptest::collection::vec(arb_offer(), 0..5),
            proptest::collection::vec(arb_segment(), 0..5),
        )
            .prop_map(|(min, max, id, epoch, transports, segments)| Hello {
                versions: VersionRange { min, max },
                peer_id: PeerId(id),
                epoch: Epoch(epoch),
                transports,
                segments,
            })
    }

    fn arb_attach() -> impl Strategy<Value = StreamAttach> {
        (
            any::<u128>(),
            any::<u64>(),
            any::<u64>(),
            any::<u16>(),
            any::<u16>(),
        )
            .prop_map(
                |(id, epoch, server_epoch, transport, stream_index)| StreamAttach {
                    peer_id: PeerId(id),
                    epoch: Epoch(epoch),
                    server_epoch: Epoch(server_epoch),
                    transport,
                    stream_index,
                },
            )
    }

    fn arb_auth_frame() -> impl Strategy<Value = ControlFrame> {
        prop_oneof![
            (
                "[A-Za-z0-9._@:-]{0,64}",
                any::<u128>(),
                any::<u64>(),
                any::<[u8; 32]>()
            )
                .prop_map(|(name, id, epoch, nonce)| ControlFrame::AuthHello(
                    AuthHello {
                        name,
                        peer_id: PeerId(id),
                        epoch: Epoch(epoch),
                        nonce,
                    }
                )),
            (
                any::<u128>(),
                any::<u64>(),
                any::<[u8; 32]>(),
                any::<[u8; 32]>()
            )
                .prop_map(|(id, epoch, nonce, mac)| ControlFrame::AuthChallenge(
                    AuthChallenge {
                        peer_id: PeerId(id),
                        epoch: Epoch(epoch),
                        nonce,
                        mac,
                    }
                )),
            any::<[u8; 32]>().prop_map(|mac| ControlFrame::AuthProof(AuthProof { mac })),
            (
                arb_attach(),
                any::<[u8; 32]>(),
                any::<u64>(),
                any::<[u8; 32]>()
            )
                .prop_map(|(attach, session, counter, mac)| ControlFrame::AuthAttach(
                    AuthAttach {
                        attach,
                        session,
                        counter,
                        mac,
                    }
                )),
            (
                any::<u128>(),
                any::<u64>(),
                any::<u64>(),
                "[a-z0-9:._-]{0,40}",
                proptest::collection::vec(any::<u8>(), 0..512)
            )
                .prop_map(|(id, epoch, to, name, message)| ControlFrame::Notify(
                    Notify {
                        peer_id: PeerId(id),
                        epoch: Epoch(epoch),
                        to_epoch: Epoch(to),
                        name,
                        message,
                    }
                )),
            Just(ControlFrame::NotifyAck),
            ("[A-Za-z0-9._@:-]{1,64}", any::<u128>(), any::<[u8; 32]>()).prop_map(
                |(name, id, nonce)| ControlFrame::AuthHelloIdentified(AuthHello {
                    name,
                    peer_id: PeerId(id),
                    epoch: Epoch(7),
                    nonce,
                })
            ),
            (
                any::<u128>(),
                any::<[u8; 32]>(),
                any::<[u8; 32]>(),
                any::<[u8; 32]>(),
                any::<[u8; 32]>()
            )
                .prop_map(|(id, nonce, mac, identity, half)| {
                    ControlFrame::SignedChallenge(SignedChallenge {
                        challenge: AuthChallenge {
                            peer_id: PeerId(id),
                            epoch: Epoch(9),
                            nonce,
                            mac,
                        },
                        identity,
                        signature: [half, mac].concat().try_into().unwrap(),
                    })
                }),
        ]
    }

    #[test]
    fn auth_frames_roundtrip_and_refuse_long_names() {
        let hello = ControlFrame::AuthHello(AuthHello {
            name: "alice".into(),
            peer_id: PeerId(1),
            epoch: Epoch(2),
            nonce: [3; 32],
        });
        assert_eq!(roundtrip(&hello), hello);
        let mut buf = Vec::new();
        hello.encode(1, &mut buf).unwrap();
        for cut in 0..buf.len() {
            assert_eq!(ControlFrame::decode(&buf[..cut]), Ok(None), "cut {cut}");
        }
        // A name length past the limit is refused at the count.
        buf[CONTROL_HEADER_LEN] = (MAX_AUTH_NAME + 1) as u8;
        assert!(matches!(
            ControlFrame::decode(&buf),
            Err(WireError::TooLarge { .. })
        ));
        let long = ControlFrame::AuthHello(AuthHello {
            name: "a".repeat(MAX_AUTH_NAME + 1),
            peer_id: PeerId(1),
            epoch: Epoch(2),
            nonce: [3; 32],
        });
        assert!(long.encode(1, &mut Vec::new()).is_err());
        let reject = ControlFrame::Reject(Reject {
            reason: RejectReason::Unauthenticated,
            versions: SUPPORTED_VERSIONS,
            epoch: Epoch(1),
            message: "no".into(),
        });
        assert_eq!(roundtrip(&reject), reject);
        // A proof with a byte missing or one too many is refused, not misread.
        let mut buf = Vec::new();
        ControlFrame::AuthProof(AuthProof { mac: [7; 32] })
            .encode(1, &mut buf)
            .unwrap();
        buf[8] -= 1;
        assert!(ControlFrame::decode(&buf[..buf.len() - 1]).is_err());
        buf[8] += 2;
        buf.push(0);
        buf.push(0);
        assert!(ControlFrame::decode(&buf[..buf.len() - 1]).is_err());
    }

    proptest! {
        #[test]
        fn any_auth_frame_roundtrips(f in arb_auth_frame()) {
            prop_assert_eq!(roundtrip(&f), f);
        }

        #[test]
        fn mutated_auth_frames_never_panics(f in arb_auth_frame(), flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8), cut in any::<usize>()) {
            let mut buf = Vec::new();
            f.encode(1, &mut buf).unwrap();
            for (at, v) in flips {
                let i = at % buf.len();
                buf[i] ^= v;
            }
            let cut = cut % (buf.len() + 1);
            let _ = ControlFrame::decode(&buf[..cut]);
            let _ = ControlFrame::decode(&buf);
        }

        #[test]
        fn any_hello_roundtrips(h in arb_hello(), ack in any::<bool>()) {
            let f = if ack { ControlFrame::HelloAck(h) } else { ControlFrame::Hello(h) };
            prop_assert_eq!(roundtrip(&f), f);
        }

        #[test]
        fn decoder_never_panics_on_garbage(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = ControlFrame::decode(&bytes);
            let mut with_magic = MAGIC.to_vec();
            with_magic.extend_from_slice(&bytes);
            let _ = ControlFrame::decode(&with_magic);
            if let Some(h) = bytes.first_chunk::<DATA_REQUEST_LEN>() {
                let _ = DataRequest::decode(h);
                if let Ok(RequestHead::Vectored(v)) = RequestHead::decode(h) {
                    let _ = decode_pieces(&v, &bytes[DATA_REQUEST_LEN..]);
                }
            }
            if let Some(h) = bytes.first_chunk::<DATA_RESPONSE_LEN>() {
                let _ = DataResponse::decode(h);
                let _ = ResponseHead::decode(h);
            }
        }

        /// A piece table decodes only when its count, its bytes and its lengths' sum agree,
        /// whatever count and total the header claims; it never panics and never allocates
        /// more records than the bytes hold.
        #[test]
        fn piece_tables_roundtrip_and_lies_are_refused(
            pieces in proptest::collection::vec((any::<u64>(), any::<u64>(), 0..=MAX_CHUNK), 1..40),
            count in any::<u32>(),
            total in any::<u64>(),
            cut in any::<usize>(),
        ) {
            let mut buf = Vec::new();
            let mut sum = 0u64;
            for &(t, o, l) in &pieces {
                Piece { token: SegmentToken(t), offset: o, len: l }.encode(&mut buf);
                sum = sum.saturating_add(l);
            }
            let honest = VectoredRequest { kind: OpKind::Write, seq: 9, pieces: pieces.len() as u32, total: sum };
            let decoded = decode_pieces(&honest, &buf).unwrap();
            prop_assert_eq!(decoded.len(), pieces.len());
            let liar = VectoredRequest { kind: OpKind::Read, seq: 9, pieces: count, total };
            let r = decode_pieces(&liar, &buf[..cut % (buf.len() + 1)]);
            if let Ok(p) = r {
                prop_assert_eq!(p.len() as u32, count);
                prop_assert_eq!(p.iter().map(|p| p.len).sum::<u64>(), total);
            }
            let mut h = [0u8; DATA_REQUEST_LEN];
            honest.encode(&mut h);
            if sum <= MAX_CHUNK {
                prop_assert_eq!(RequestHead::decode(&h), Ok(RequestHead::Vectored(honest)));
            } else {
                prop_assert!(RequestHead::decode(&h).is_err());
            }
        }

        #[test]
        fn mutated_hello_never_panics(h in arb_hello(), flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8), cut in any::<usize>()) {
            let mut buf = Vec::new();
            ControlFrame::Hello(h).encode(1, &mut buf).unwrap();
            for (at, v) in flips {
                let i = at % buf.len();
                buf[i] ^= v;
            }
            let cut = cut % (buf.len() + 1);
            let _ = ControlFrame::decode(&buf[..cut]);
            let _ = ControlFrame::decode(&buf);
        }
    }
}

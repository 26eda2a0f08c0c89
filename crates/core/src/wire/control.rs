//! Control frames: the handshake ([`Hello`]), its refusal, stream attaches, the authentication
//! frames and notifications, each behind a [`ControlHeader`].

use crate::ids::{Access, Epoch, PeerId, SegmentToken};
use crate::op::{RemoteKey, SegmentDesc};

use super::codec::{Reader, put_u16, put_u32, put_u64};
use super::error::{EncodeError, WireError, limit};
use super::offer::TransportOffer;
use super::{
    AUTH_MAC_LEN, AUTH_NONCE_LEN, CONTROL_HEADER_LEN, IDENTITY_LEN, MAGIC, MAX_AUTH_NAME,
    MAX_CONTROL_BODY, MAX_KEYS, MAX_MESSAGE_LEN, MAX_NAME_LEN, MAX_NOTIFY_LEN, MAX_NOTIFY_NAME,
    MAX_SEGMENTS, MAX_TRANSPORTS, SIGNATURE_LEN, VersionRange,
};

/// The handshake one side sends: who it is, what it speaks, offers and publishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Protocol versions spoken.
    pub versions: VersionRange,
    /// The sender's peer id.
    pub peer_id: PeerId,
    /// The sender's epoch.
    pub epoch: Epoch,
    /// Transports offered, with endpoints.
    pub transports: Vec<TransportOffer>,
    /// Segments published to this peer.
    pub segments: Vec<SegmentDesc>,
}

/// The server's refusal of a handshake or a stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reject {
    /// Why.
    pub reason: RejectReason,
    /// The refusing side's version range (for [`RejectReason::ProtocolMismatch`]).
    pub versions: VersionRange,
    /// The refusing side's epoch (for [`RejectReason::StaleEpoch`]).
    pub epoch: Epoch,
    /// A human-readable message.
    pub message: String,
}

/// Why a handshake or stream was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectReason {
    /// No common protocol version.
    ProtocolMismatch,
    /// The stream names an epoch the server no longer has.
    StaleEpoch,
    /// The server does not take this kind of stream or peer.
    Refused,
    /// Authentication failed or is not possible: a wrong key, an unknown key name, a missing or
    /// forged stream proof, or an authenticating peer met by a server without a key. Only sent
    /// in answer to the authentication frames (a plain [`Hello`] to a server that requires a key
    /// is answered with [`RejectReason::Refused`], which any peer understands).
    Unauthenticated,
    /// A data stream refused because its key name (or, without keys, every peer) holds as many
    /// streams attached as the server allows ([`StreamCap`](crate::stream_cap::StreamCap)).
    TooManyStreams,
}

/// The first frame of a data stream: which peer and incarnation it belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamAttach {
    /// Client's peer id.
    pub peer_id: PeerId,
    /// Client's epoch.
    pub epoch: Epoch,
    /// The server epoch the client's descriptors come from.
    pub server_epoch: Epoch,
    /// Transport code of the stream (TCP or io_uring: same data plane).
    pub transport: u16,
    /// Index of this stream among the client's streams to this server.
    pub stream_index: u16,
}

/// The first frame of an authenticating client: the key it uses (by name), who it is, and its
/// fresh nonce. The server answers with an [`AuthChallenge`] (or a refusal); see
/// [`crate::auth`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthHello {
    /// The name of the client's key in the server's keyring (at most [`MAX_AUTH_NAME`] bytes).
    pub name: String,
    /// Client's peer id.
    pub peer_id: PeerId,
    /// Client's epoch.
    pub epoch: Epoch,
    /// The client's fresh nonce.
    pub nonce: [u8; AUTH_NONCE_LEN],
}

/// The server's answer to an [`AuthHello`]: who it is, its fresh nonce, and its proof that it
/// holds the named key (a MAC over both nonces, both ids and epochs and the name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuthChallenge {
    /// Server's peer id.
    pub peer_id: PeerId,
    /// Server's epoch.
    pub epoch: Epoch,
    /// The server's fresh nonce.
    pub nonce: [u8; AUTH_NONCE_LEN],
    /// The server's proof.
    pub mac: [u8; AUTH_MAC_LEN],
}

/// The server's answer to an [`AuthHello`] sent as [`ControlFrame::AuthHelloIdentified`] (a
/// client that names the server it expects): the challenge, the server's public identity (an
/// Ed25519 key) and its signature over the handshake's transcript (see
/// [`crate::identity`]). Sent only to a client that asked for it, so a client that did not
/// never sees one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SignedChallenge {
    /// The challenge, as an unsigned one.
    pub challenge: AuthChallenge,
    /// The server's public identity.
    pub identity: [u8; IDENTITY_LEN],
    /// Its signature over the transcript (both nonces, both ids and epochs, the key name).
    pub signature: [u8; SIGNATURE_LEN],
}

/// The client's proof that it holds the key (a MAC over the same transcript, another label).
/// A [`Hello`] follows it on the same connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuthProof {
    /// The client's proof.
    pub mac: [u8; AUTH_MAC_LEN],
}

/// The first frame of a data stream of an authenticated session: the attach, the session it
/// belongs to (the server's handshake nonce: the server chose it), a counter used once per
/// session, and a MAC with the session's key over all of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuthAttach {
    /// The attach itself.
    pub attach: StreamAttach,
    /// The session (the server nonce of its handshake).
    pub session: [u8; AUTH_NONCE_LEN],
    /// Used once per session (a replayed attach is refused).
    pub counter: u64,
    /// MAC with the session key.
    pub mac: [u8; AUTH_MAC_LEN],
}

/// A short message to the server's engine, one per control connection (in place of a
/// [`Hello`]; after the [`AuthProof`] on an authenticating connection): who sends it, the
/// incarnation it is meant for, a name the sender chose (an agent's name, say) and the bytes.
/// The server answers [`ControlFrame::NotifyAck`] once the message is in its engine's inbox,
/// or a [`Reject`] (`StaleEpoch` for another incarnation, `Refused` when the inbox is full).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notify {
    /// Sender's peer id.
    pub peer_id: PeerId,
    /// Sender's epoch.
    pub epoch: Epoch,
    /// The epoch of the server incarnation it is meant for.
    pub to_epoch: Epoch,
    /// The sender's name for itself (at most [`MAX_NOTIFY_NAME`] bytes).
    pub name: String,
    /// The message (at most [`MAX_NOTIFY_LEN`] bytes).
    pub message: Vec<u8>,
}

/// A control frame.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ControlFrame {
    /// Client handshake.
    Hello(Hello),
    /// Server handshake answer.
    HelloAck(Hello),
    /// Refusal of a handshake or stream.
    Reject(Reject),
    /// Opens a data stream.
    StreamAttach(StreamAttach),
    /// Accepts a data stream.
    StreamAccept,
    /// Opens an authenticated handshake.
    AuthHello(AuthHello),
    /// The server's challenge and proof.
    AuthChallenge(AuthChallenge),
    /// The client's proof.
    AuthProof(AuthProof),
    /// Opens a data stream of an authenticated session.
    AuthAttach(AuthAttach),
    /// A message for the server's engine.
    Notify(Notify),
    /// The message is in the server's inbox.
    NotifyAck,
    /// Opens an authenticated handshake and asks the server to prove its identity too (a
    /// client that expects a given server): the body of an [`AuthHello`]. A server with an
    /// identity answers [`ControlFrame::SignedChallenge`], one without a plain challenge.
    AuthHelloIdentified(AuthHello),
    /// The server's challenge, signed with its identity.
    SignedChallenge(SignedChallenge),
}

pub(super) const K_HELLO: u8 = 1;
const K_HELLO_ACK: u8 = 2;
const K_REJECT: u8 = 3;
const K_ATTACH: u8 = 4;
const K_ACCEPT: u8 = 5;
const K_AUTH_HELLO: u8 = 6;
const K_AUTH_CHALLENGE: u8 = 7;
const K_AUTH_PROOF: u8 = 8;
const K_AUTH_ATTACH: u8 = 9;
const K_NOTIFY: u8 = 10;
const K_NOTIFY_ACK: u8 = 11;
const K_AUTH_HELLO_IDENTIFIED: u8 = 12;
const K_SIGNED_CHALLENGE: u8 = 13;

/// A decoded control frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControlHeader {
    /// The version the sender wrote the frame in.
    pub version: u16,
    /// Frame kind code.
    pub kind: u8,
    /// Body length (already checked against [`MAX_CONTROL_BODY`]).
    pub body_len: u32,
}

impl ControlHeader {
    /// Decodes and checks a header.
    pub fn decode(buf: &[u8; CONTROL_HEADER_LEN]) -> Result<Self, WireError> {
        let mut r = Reader::new(buf);
        let magic: [u8; 4] = r.array("magic")?;
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let version = r.u16("version")?;
        let kind = r.u8("kind")?;
        let _flags = r.u8("flags")?;
        let body_len = r.u32("body length")?;
        if !(K_HELLO..=K_SIGNED_CHALLENGE).contains(&kind) {
            return Err(WireError::UnknownCode {
                field: "frame kind",
                code: kind.into(),
            });
        }
        if body_len > MAX_CONTROL_BODY {
            return Err(WireError::TooLarge {
                field: "body length",
                value: body_len.into(),
                limit: MAX_CONTROL_BODY.into(),
            });
        }
        Ok(Self {
            version,
            kind,
            body_len,
        })
    }
}

impl Hello {
    pub(super) fn encode_body(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        put_u16(out, self.versions.min);
        put_u16(out, self.versions.max);
        out.extend_from_slice(&self.peer_id.0.to_le_bytes());
        put_u64(out, self.epoch.0);
        limit("transports", self.transports.len(), MAX_TRANSPORTS)?;
        put_u16(out, self.transports.len() as u16);
        for t in &self.transports {
            put_u16(out, t.code());
            let len_at = out.len();
            put_u32(out, 0);
            t.encode_body(out);
            let body_len = (out.len() - len_at - 4) as u32;
            out[len_at..len_at + 4].copy_from_slice(&body_len.to_le_bytes());
        }
        limit("segments", self.segments.len(), MAX_SEGMENTS)?;
        put_u32(out, self.segments.len() as u32);
        for s in &self.segments {
            limit("segment name", s.name.len(), MAX_NAME_LEN)?;
            limit("remote keys", s.remote_keys.len(), MAX_KEYS)?;
            put_u16(out, s.name.len() as u16);
            out.extend_from_slice(s.name.as_bytes());
            put_u64(out, s.token.0);
            put_u64(out, s.len);
            out.push(s.access.bits());
            put_u16(out, s.remote_keys.len() as u16);
            for k in &s.remote_keys {
                put_u32(out, k.context);
                put_u64(out, k.addr);
                put_u32(out, k.rkey);
            }
        }
        Ok(())
    }

    fn decode_body(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let versions = VersionRange {
            min: r.u16("version min")?,
            max: r.u16("version max")?,
        };
        let peer_id = PeerId(r.u128("peer id")?);
        let epoch = Epoch(r.u64("epoch")?);
        let raw = r.u16("transport count")?;
        let n = r.count(raw.into(), MAX_TRANSPORTS, 6, "transport count")?;
        let mut transports = Vec::with_capacity(n);
        for _ in 0..n {
            let code = r.u16("transport code")?;
            let len = r.u32("transport body length")?;
            let len = r.count(len.into(), MAX_CONTROL_BODY as usize, 1, "transport body")?;
            let body = r.take(len, "transport body")?;
            transports.push(TransportOffer::decode_body(code, body)?);
        }
        let raw = r.u32("segment count")?;
        // Smallest segment record: name len 2 + token 8 + len 8 + access 1 + key count 2.
        let n = r.count(raw.into(), MAX_SEGMENTS, 21, "segment count")?;
        let mut segments = Vec::with_capacity(n);
        for _ in 0..n {
            let name_len = r.u16("segment name length")?;
            let name_len = r.count(name_len.into(), MAX_NAME_LEN, 1, "segment name length")?;
            let name = r.string(name_len, "segment name")?;
            let token = SegmentToken(r.u64("segment token")?);
            let len = r.u64("segment length")?;
            let bits = r.u8("segment access")?;
            let access = Access::from_bits(bits).ok_or(WireError::UnknownCode {
                field: "segment access",
                code: bits.into(),
            })?;
            let raw = r.u16("remote key count")?;
            let nk = r.count(raw.into(), MAX_KEYS, 16, "remote key count")?;
            let mut remote_keys = Vec::with_capacity(nk);
            for _ in 0..nk {
                remote_keys.push(RemoteKey {
                    context: r.u32("remote key context")?,
                    addr: r.u64("remote key addr")?,
                    rkey: r.u32("remote key")?,
                });
            }
            segments.push(SegmentDesc {
                name,
                token,
                len,
                access,
                remote_keys,
            });
        }
        Ok(Self {
            versions,
            peer_id,
            epoch,
            transports,
            segments,
        })
    }
}

impl StreamAttach {
    /// The attach's fields as they are encoded (also what a stream proof covers).
    pub fn encode_body(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.peer_id.0.to_le_bytes());
        put_u64(out, self.epoch.0);
        put_u64(out, self.server_epoch.0);
        put_u16(out, self.transport);
        put_u16(out, self.stream_index);
    }

    fn decode_body(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(Self {
            peer_id: PeerId(r.u128("peer id")?),
            epoch: Epoch(r.u64("epoch")?),
            server_epoch: Epoch(r.u64("server epoch")?),
            transport: r.u16("transport")?,
            stream_index: r.u16("stream index")?,
        })
    }
}

impl AuthHello {
    fn decode_body(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let len = r.u8("key name length")?;
        let len = r.count(len.into(), MAX_AUTH_NAME, 1, "key name length")?;
        Ok(Self {
            name: r.string(len, "key name")?,
            peer_id: PeerId(r.u128("peer id")?),
            epoch: Epoch(r.u64("epoch")?),
            nonce: r.array("nonce")?,
        })
    }
}

impl AuthChallenge {
    fn encode_body(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.peer_id.0.to_le_bytes());
        put_u64(out, self.epoch.0);
        out.extend_from_slice(&self.nonce);
        out.extend_from_slice(&self.mac);
    }

    fn decode_body(r: &mut Reader<'_>) -> Result<Self, WireError> {
        Ok(Self {
            peer_id: PeerId(r.u128("peer id")?),
            epoch: Epoch(r.u64("epoch")?),
            nonce: r.array("nonce")?,
            mac: r.array("mac")?,
        })
    }
}

impl ControlFrame {
    fn kind_code(&self) -> u8 {
        match self {
            ControlFrame::Hello(_) => K_HELLO,
            ControlFrame::HelloAck(_) => K_HELLO_ACK,
            ControlFrame::Reject(_) => K_REJECT,
            ControlFrame::StreamAttach(_) => K_ATTACH,
            ControlFrame::StreamAccept => K_ACCEPT,
            ControlFrame::AuthHello(_) => K_AUTH_HELLO,
            ControlFrame::AuthChallenge(_) => K_AUTH_CHALLENGE,
            ControlFrame::AuthProof(_) => K_AUTH_PROOF,
            ControlFrame::AuthAttach(_) => K_AUTH_ATTACH,
            ControlFrame::Notify(_) => K_NOTIFY,
            ControlFrame::NotifyAck => K_NOTIFY_ACK,
            ControlFrame::AuthHelloIdentified(_) => K_AUTH_HELLO_IDENTIFIED,
            ControlFrame::SignedChallenge(_) => K_SIGNED_CHALLENGE,
        }
    }

    /// A short name of the frame kind, for errors.
    pub fn name(&self) -> &'static str {
        kind_name(self.kind_code())
    }

    /// Encodes the frame, header included, written in `version`, appending to `out`.
    pub fn encode(&self, version: u16, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let start = out.len();
        out.extend_from_slice(&MAGIC);
        put_u16(out, version);
        out.push(self.kind_code());
        out.push(0);
        put_u32(out, 0);
        match self {
            ControlFrame::Hello(h) | ControlFrame::HelloAck(h) => h.encode_body(out)?,
            ControlFrame::Reject(rj) => {
                out.push(match rj.reason {
                    RejectReason::ProtocolMismatch => 1,
                    RejectReason::StaleEpoch => 2,
                    RejectReason::Refused => 3,
                    RejectReason::Unauthenticated => 4,
                    RejectReason::TooManyStreams => 5,
                });
                put_u16(out, rj.versions.min);
                put_u16(out, rj.versions.max);
                put_u64(out, rj.epoch.0);
                let msg = truncate_utf8(&rj.message, MAX_MESSAGE_LEN);
                put_u16(out, msg.len() as u16);
                out.extend_from_slice(msg.as_bytes());
            }
            ControlFrame::StreamAttach(a) => a.encode_body(out),
            ControlFrame::StreamAccept => {}
            ControlFrame::AuthHello(h) | ControlFrame::AuthHelloIdentified(h) => {
                limit("key name", h.name.len(), MAX_AUTH_NAME)?;
                out.push(h.name.len() as u8);
                out.extend_from_slice(h.name.as_bytes());
                out.extend_from_slice(&h.peer_id.0.to_le_bytes());
                put_u64(out, h.epoch.0);
                out.extend_from_slice(&h.nonce);
            }
            ControlFrame::AuthChallenge(c) => c.encode_body(out),
            ControlFrame::SignedChallenge(s) => {
                s.challenge.encode_body(out);
                out.extend_from_slice(&s.identity);
                out.extend_from_slice(&s.signature);
            }
            ControlFrame::AuthProof(p) => out.extend_from_slice(&p.mac),
            ControlFrame::AuthAttach(a) => {
                a.attach.encode_body(out);
                out.extend_from_slice(&a.session);
                put_u64(out, a.counter);
                out.extend_from_slice(&a.mac);
            }
            ControlFrame::Notify(n) => {
                limit("notify name", n.name.len(), MAX_NOTIFY_NAME)?;
                limit("notify message", n.message.len(), MAX_NOTIFY_LEN)?;
                out.extend_from_slice(&n.peer_id.0.to_le_bytes());
                put_u64(out, n.epoch.0);
                put_u64(out, n.to_epoch.0);
                out.push(n.name.len() as u8);
                out.extend_from_slice(n.name.as_bytes());
                put_u32(out, n.message.len() as u32);
                out.extend_from_slice(&n.message);
            }
            ControlFrame::NotifyAck => {}
        }
        let body_len = out.len() - start - CONTROL_HEADER_LEN;
        limit("control body", body_len, MAX_CONTROL_BODY as usize)?;
        out[start + 8..start + 12].copy_from_slice(&(body_len as u32).to_le_bytes());
        Ok(())
    }

    /// Decodes a body whose header was decoded by [`ControlHeader::decode`].
    pub fn decode_body(header: &ControlHeader, body: &[u8]) -> Result<Self, WireError> {
        if body.len() as u64 != u64::from(header.body_len) {
            return Err(WireError::Truncated {
                field: "control body",
                needed: (header.body_len as usize).saturating_sub(body.len()),
            });
        }
        let mut r = Reader::new(body);
        let frame = match header.kind {
            K_HELLO => ControlFrame::Hello(Hello::decode_body(&mut r)?),
            K_HELLO_ACK => ControlFrame::HelloAck(Hello::decode_body(&mut r)?),
            K_REJECT => {
                let code = r.u8("reject reason")?;
                let reason = match code {
                    1 => RejectReason::ProtocolMismatch,
                    2 => RejectReason::StaleEpoch,
                    3 => RejectReason::Refused,
                    4 => RejectReason::Unauthenticated,
                    5 => RejectReason::TooManyStreams,
                    c => {
                        return Err(WireError::UnknownCode {
                            field: "reject reason",
                            code: c.into(),
                        });
                    }
                };
                let versions = VersionRange {
                    min: r.u16("version min")?,
                    max: r.u16("version max")?,
                };
                let epoch = Epoch(r.u64("epoch")?);
                let len = r.u16("message length")?;
                let len = r.count(len.into(), MAX_MESSAGE_LEN, 1, "message length")?;
                let message = String::from_utf8_lossy(r.take(len, "message")?).into_owned();
                ControlFrame::Reject(Reject {
                    reason,
                    versions,
                    epoch,
                    message,
                })
            }
            K_ATTACH => ControlFrame::StreamAttach(StreamAttach::decode_body(&mut r)?),
            K_ACCEPT => ControlFrame::StreamAccept,
            K_AUTH_HELLO => ControlFrame::AuthHello(AuthHello::decode_body(&mut r)?),
            K_AUTH_HELLO_IDENTIFIED => {
                ControlFrame::AuthHelloIdentified(AuthHello::decode_body(&mut r)?)
            }
            K_AUTH_CHALLENGE => ControlFrame::AuthChallenge(AuthChallenge::decode_body(&mut r)?),
            K_SIGNED_CHALLENGE => ControlFrame::SignedChallenge(SignedChallenge {
                challenge: AuthChallenge::decode_body(&mut r)?,
                identity: r.array("identity")?,
                signature: r.array("signature")?,
            }),
            K_AUTH_PROOF => ControlFrame::AuthProof(AuthProof {
                mac: r.array("mac")?,
            }),
            K_AUTH_ATTACH => ControlFrame::AuthAttach(AuthAttach {
                attach: StreamAttach::decode_body(&mut r)?,
                session: r.array("session")?,
                counter: r.u64("counter")?,
                mac: r.array("mac")?,
            }),
            K_NOTIFY => {
                let peer_id = PeerId(r.u128("peer id")?);
                let epoch = Epoch(r.u64("epoch")?);
                let to_epoch = Epoch(r.u64("to epoch")?);
                let len = r.u8("notify name length")?;
                let name = r.string(len.into(), "notify name")?;
                let len = r.u32("notify message length")?;
                let len = r.count(len.into(), MAX_NOTIFY_LEN, 1, "notify message length")?;
                ControlFrame::Notify(Notify {
                    peer_id,
                    epoch,
                    to_epoch,
                    name,
                    message: r.take(len, "notify message")?.to_vec(),
                })
            }
            K_NOTIFY_ACK => ControlFrame::NotifyAck,
            other => {
                return Err(WireError::UnknownCode {
                    field: "frame kind",
                    code: other.into(),
                });
            }
        };
        r.finish(kind_name(header.kind))?;
        Ok(frame)
    }

    /// Decodes one whole frame from the front of `buf`. `Ok(None)`: more bytes are needed;
    /// `Ok(Some((frame, used)))`: a frame and how many bytes it took.
    pub fn decode(buf: &[u8]) -> Result<Option<(Self, usize)>, WireError> {
        let Some(head) = buf.first_chunk::<CONTROL_HEADER_LEN>() else {
            return Ok(None);
        };
        let header = ControlHeader::decode(head)?;
        let end = CONTROL_HEADER_LEN + header.body_len as usize;
        let Some(body) = buf.get(CONTROL_HEADER_LEN..end) else {
            return Ok(None);
        };
        Ok(Some((Self::decode_body(&header, body)?, end)))
    }
}

fn kind_name(code: u8) -> &'static str {
    match code {
        K_HELLO => "hello",
        K_HELLO_ACK => "hello-ack",
        K_REJECT => "reject",
        K_ATTACH => "stream-attach",
        K_ACCEPT => "stream-accept",
        K_AUTH_HELLO => "auth-hello",
        K_AUTH_CHALLENGE => "auth-challenge",
        K_AUTH_PROOF => "auth-proof",
        K_AUTH_ATTACH => "auth-attach",
        K_NOTIFY => "notify",
        K_NOTIFY_ACK => "notify-ack",
        K_AUTH_HELLO_IDENTIFIED => "auth-hello-identified",
        K_SIGNED_CHALLENGE => "signed-challenge",
        _ => "unknown",
    }
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

//! The wire: control frames (handshake, stream attach) and the fixed data-plane headers.
//!
//! Control frames are `magic(4) | version u16 | kind u8 | flags u8 | body_len u32 | body`, all
//! integers little-endian. The decoder checks every length against what is left of the input and
//! against fixed limits before it allocates, and returns [`WireError`] (never panics) on any input.
//!
//! Data streams carry fixed-size headers: a [`DataRequest`] (32 bytes, followed by the payload for a
//! WRITE) and a [`DataResponse`] (16 bytes, followed by the payload for an accepted READ). The TCP
//! and io_uring transports speak exactly this and interoperate.

use std::fmt;

use crate::ids::{Access, Epoch, PeerId, SegmentToken};
use crate::op::{OpKind, RemoteKey, SegmentDesc};
use crate::outcome::RemoteStatus;

/// Magic bytes that open every control frame.
pub const MAGIC: [u8; 4] = *b"FRRY";
/// The protocol versions this build speaks. Version 2 adds the CHECKSUM data request
/// ([`OpKind::Checksum`]); frames and the other data requests are unchanged, so a version-1 peer
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

/// Why a frame could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The input ended inside a field.
    #[error("truncated: needed {needed} more bytes for {field}")]
    Truncated {
        /// The field being read.
        field: &'static str,
        /// Bytes missing.
        needed: usize,
    },
    /// The frame does not start with [`MAGIC`].
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// A length or count exceeds its limit.
    #[error("{field} is {value}, limit {limit}")]
    TooLarge {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The limit.
        limit: u64,
    },
    /// An enum field holds an unknown code.
    #[error("unknown {field} code {code}")]
    UnknownCode {
        /// The field.
        field: &'static str,
        /// The code.
        code: u64,
    },
    /// A name is not UTF-8.
    #[error("{field} is not UTF-8")]
    NotUtf8 {
        /// The field.
        field: &'static str,
    },
    /// Bytes were left over after the body.
    #[error("{extra} trailing bytes in a {kind} frame")]
    Trailing {
        /// The frame kind.
        kind: &'static str,
        /// Bytes left.
        extra: usize,
    },
    /// A frame arrived where another was expected.
    #[error("unexpected {found} frame, expected {expected}")]
    Unexpected {
        /// What arrived.
        found: &'static str,
        /// What was expected.
        expected: &'static str,
    },
}

/// A bounds-checked little-endian reader over a byte slice.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(WireError::Truncated {
                field,
                needed: n - self.buf.len(),
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, field)?);
        Ok(out)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, WireError> {
        Ok(self.array::<1>(field)?[0])
    }
    fn u16(&mut self, field: &'static str) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array(field)?))
    }
    fn u32(&mut self, field: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }
    fn u64(&mut self, field: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }
    fn u128(&mut self, field: &'static str) -> Result<u128, WireError> {
        Ok(u128::from_le_bytes(self.array(field)?))
    }

    /// A count bounded by `limit` and by how many records of at least `min_record` bytes the rest
    /// of the input could hold, so that `Vec::with_capacity(count)` is always safe.
    fn count(
        &mut self,
        raw: u64,
        limit: usize,
        min_record: usize,
        field: &'static str,
    ) -> Result<usize, WireError> {
        let fits = (self.buf.len() / min_record.max(1)) as u64;
        let limit = limit as u64;
        if raw > limit {
            return Err(WireError::TooLarge {
                field,
                value: raw,
                limit,
            });
        }
        if raw > fits {
            return Err(WireError::Truncated {
                field,
                needed: (raw - fits) as usize * min_record,
            });
        }
        Ok(raw as usize)
    }

    fn string(&mut self, len: usize, field: &'static str) -> Result<String, WireError> {
        let bytes = self.take(len, field)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| WireError::NotUtf8 { field })
    }

    fn finish(self, kind: &'static str) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(WireError::Trailing {
                kind,
                extra: self.buf.len(),
            })
        }
    }
}

/// The transports a peer offers, with their endpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransportOffer {
    /// The tokio TCP data plane on the control address (`port` 0) or another port.
    Tcp {
        /// Data streams the peer accepts per connection.
        streams: u16,
        /// Data port (0: the control port).
        port: u16,
    },
    /// The io_uring data plane (same wire as TCP).
    Uring {
        /// Data streams the peer accepts per connection.
        streams: u16,
        /// Data port (0: the control port).
        port: u16,
        /// Whether the peer sends with SEND_ZC.
        zero_copy: bool,
    },
    /// RDMA reliable-connected queue pairs, one endpoint per rail.
    Rdma {
        /// The rails.
        rails: Vec<RdmaEndpoint>,
    },
    /// The same-host plane (`ferry-transport-local`): the serving side copies between its
    /// published memory and the client's buffers directly, process to process. A client offers
    /// it with its boot id and pid (and no socket); a server answers only a client of its own
    /// boot id, naming the Unix socket its streams attach to.
    Local {
        /// The offering host's boot id (`/proc/sys/kernel/random/boot_id`, as 16 bytes).
        boot_id: [u8; 16],
        /// The offering process's id (checked against the socket's credentials).
        pid: u32,
        /// Data streams the peer accepts per connection (a client: 0).
        streams: u16,
        /// The abstract Unix socket name the server's streams attach to (empty in a client's
        /// offer), at most [`MAX_LOCAL_SOCKET`] bytes.
        socket: String,
    },
    /// A transport this build does not know (kept so it can be relayed or reported).
    Unknown {
        /// The transport code.
        code: u16,
        /// Its body.
        body: Vec<u8>,
    },
}

/// One RDMA rail's queue-pair endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RdmaEndpoint {
    /// The rail (context) index on the offering side.
    pub rail: u16,
    /// Port number on the device.
    pub port_num: u8,
    /// Path MTU as the verbs enum value (1 = 256 ... 5 = 4096).
    pub mtu: u8,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID (RoCE v2: IPv4-mapped or IPv6).
    pub gid: [u8; 16],
    /// Queue-pair number.
    pub qpn: u32,
    /// Initial packet sequence number.
    pub psn: u32,
}

const RDMA_ENDPOINT_LEN: usize = 2 + 1 + 1 + 2 + 16 + 4 + 4;

/// Transport codes on the wire.
const T_TCP: u16 = 1;
const T_URING: u16 = 2;
const T_RDMA: u16 = 3;
const T_LOCAL: u16 = 4;

/// The longest abstract socket name a [`TransportOffer::Local`] may carry (a Unix socket path
/// holds 108 bytes, one of them the leading zero of an abstract name).
pub const MAX_LOCAL_SOCKET: usize = 107;

impl TransportOffer {
    /// The wire code of this transport.
    pub fn code(&self) -> u16 {
        match self {
            TransportOffer::Tcp { .. } => T_TCP,
            TransportOffer::Uring { .. } => T_URING,
            TransportOffer::Rdma { .. } => T_RDMA,
            TransportOffer::Local { .. } => T_LOCAL,
            TransportOffer::Unknown { code, .. } => *code,
        }
    }

    fn encode_body(&self, out: &mut Vec<u8>) {
        match self {
            TransportOffer::Tcp { streams, port } => {
                out.extend_from_slice(&streams.to_le_bytes());
                out.extend_from_slice(&port.to_le_bytes());
            }
            TransportOffer::Uring {
                streams,
                port,
                zero_copy,
            } => {
                out.extend_from_slice(&streams.to_le_bytes());
                out.extend_from_slice(&port.to_le_bytes());
                out.push(u8::from(*zero_copy));
            }
            TransportOffer::Rdma { rails } => {
                out.extend_from_slice(&(rails.len() as u16).to_le_bytes());
                for r in rails {
                    out.extend_from_slice(&r.rail.to_le_bytes());
                    out.push(r.port_num);
                    out.push(r.mtu);
                    out.extend_from_slice(&r.lid.to_le_bytes());
                    out.extend_from_slice(&r.gid);
                    out.extend_from_slice(&r.qpn.to_le_bytes());
                    out.extend_from_slice(&r.psn.to_le_bytes());
                }
            }
            TransportOffer::Local {
                boot_id,
                pid,
                streams,
                socket,
            } => {
                out.extend_from_slice(boot_id);
                out.extend_from_slice(&pid.to_le_bytes());
                out.extend_from_slice(&streams.to_le_bytes());
                // At most MAX_LOCAL_SOCKET bytes by contract; a longer name is cut so the frame
                // still decodes (the server that made it checked it at bind).
                let name = &socket.as_bytes()[..socket.len().min(MAX_LOCAL_SOCKET)];
                out.push(name.len() as u8);
                out.extend_from_slice(name);
            }
            TransportOffer::Unknown { body, .. } => out.extend_from_slice(body),
        }
    }

    fn decode_body(code: u16, body: &[u8]) -> Result<Self, WireError> {
        let mut r = Reader::new(body);
        let offer = match code {
            T_TCP => TransportOffer::Tcp {
                streams: r.u16("tcp streams")?,
                port: r.u16("tcp port")?,
            },
            T_URING => TransportOffer::Uring {
                streams: r.u16("uring streams")?,
                port: r.u16("uring port")?,
                zero_copy: r.u8("uring zero_copy")? != 0,
            },
            T_RDMA => {
                let raw = r.u16("rdma rail count")?;
                let n = r.count(raw.into(), MAX_RAILS, RDMA_ENDPOINT_LEN, "rdma rail count")?;
                let mut rails = Vec::with_capacity(n);
                for _ in 0..n {
                    rails.push(RdmaEndpoint {
                        rail: r.u16("rdma rail")?,
                        port_num: r.u8("rdma port")?,
                        mtu: r.u8("rdma mtu")?,
                        lid: r.u16("rdma lid")?,
                        gid: r.array("rdma gid")?,
                        qpn: r.u32("rdma qpn")?,
                        psn: r.u32("rdma psn")?,
                    });
                }
                TransportOffer::Rdma { rails }
            }
            T_LOCAL => {
                let boot_id = r.array("local boot id")?;
                let pid = r.u32("local pid")?;
                let streams = r.u16("local streams")?;
                let len = usize::from(r.u8("local socket length")?);
                if len > MAX_LOCAL_SOCKET {
                    return Err(WireError::TooLarge {
                        field: "local socket name",
                        value: len as u64,
                        limit: MAX_LOCAL_SOCKET as u64,
                    });
                }
                let socket = r.string(len, "local socket name")?;
                TransportOffer::Local {
                    boot_id,
                    pid,
                    streams,
                    socket,
                }
            }
            other => {
                return Ok(TransportOffer::Unknown {
                    code: other,
                    body: body.to_vec(),
                });
            }
        };
        r.finish("transport offer")?;
        Ok(offer)
    }
}

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
}

const K_HELLO: u8 = 1;
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
        if !(K_HELLO..=K_NOTIFY_ACK).contains(&kind) {
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

fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Encoding failed because a field exceeds what the wire (and the peer's decoder) accepts.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot encode: {field} is {value}, limit {limit}")]
pub struct EncodeError {
    /// The field.
    pub field: &'static str,
    /// Its value.
    pub value: u64,
    /// The limit.
    pub limit: u64,
}

fn limit(field: &'static str, value: usize, max: usize) -> Result<(), EncodeError> {
    if value > max {
        Err(EncodeError {
            field,
            value: value as u64,
            limit: max as u64,
        })
    } else {
        Ok(())
    }
}

impl Hello {
    fn encode_body(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
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
            ControlFrame::AuthHello(h) => {
                limit("key name", h.name.len(), MAX_AUTH_NAME)?;
                out.push(h.name.len() as u8);
                out.extend_from_slice(h.name.as_bytes());
                out.extend_from_slice(&h.peer_id.0.to_le_bytes());
                put_u64(out, h.epoch.0);
                out.extend_from_slice(&h.nonce);
            }
            ControlFrame::AuthChallenge(c) => {
                out.extend_from_slice(&c.peer_id.0.to_le_bytes());
                put_u64(out, c.epoch.0);
                out.extend_from_slice(&c.nonce);
                out.extend_from_slice(&c.mac);
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
            K_AUTH_HELLO => {
                let len = r.u8("key name length")?;
                let len = r.count(len.into(), MAX_AUTH_NAME, 1, "key name length")?;
                ControlFrame::AuthHello(AuthHello {
                    name: r.string(len, "key name")?,
                    peer_id: PeerId(r.u128("peer id")?),
                    epoch: Epoch(r.u64("epoch")?),
                    nonce: r.array("nonce")?,
                })
            }
            K_AUTH_CHALLENGE => ControlFrame::AuthChallenge(AuthChallenge {
                peer_id: PeerId(r.u128("peer id")?),
                epoch: Epoch(r.u64("epoch")?),
                nonce: r.array("nonce")?,
                mac: r.array("mac")?,
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

const OP_READ: u8 = 1;
const OP_WRITE: u8 = 2;
const OP_CHECKSUM: u8 = 3;
const OP_RESPONSE: u8 = 0x81;
const OP_VREAD: u8 = 4;
const OP_VWRITE: u8 = 5;
const OP_VRESPONSE: u8 = 0x82;

/// A data-plane request header: one chunk of one op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataRequest {
    /// READ or WRITE.
    pub kind: OpKind,
    /// Sequence number of the chunk on its stream (echoed in the response).
    pub seq: u32,
    /// The segment.
    pub token: SegmentToken,
    /// Offset in the segment.
    pub offset: u64,
    /// Payload length (at most [`MAX_CHUNK`]); for a CHECKSUM, the length of the range to hash
    /// (any length: no payload moves, the answer is [`CHECKSUM_LEN`](crate::checksum::CHECKSUM_LEN)
    /// bytes).
    pub len: u64,
    /// For a WRITE: how many responses on this stream, this one's included, the server may hold
    /// back and answer with one response (see [`DataResponse::also_acks`]). 0 or 1: answer this
    /// one at once (what a peer that predates the field sends: the bytes were reserved zeros).
    pub ack_slack: u16,
}

impl DataRequest {
    /// Encodes into a fixed buffer (no allocation).
    pub fn encode(&self, out: &mut [u8; DATA_REQUEST_LEN]) {
        out[0] = match self.kind {
            OpKind::Read => OP_READ,
            OpKind::Write => OP_WRITE,
            OpKind::Checksum => OP_CHECKSUM,
        };
        out[1] = 0;
        out[2..4].copy_from_slice(&self.ack_slack.to_le_bytes());
        out[4..8].copy_from_slice(&self.seq.to_le_bytes());
        out[8..16].copy_from_slice(&self.token.0.to_le_bytes());
        out[16..24].copy_from_slice(&self.offset.to_le_bytes());
        out[24..32].copy_from_slice(&self.len.to_le_bytes());
    }

    /// Decodes and checks a header (the length against [`MAX_CHUNK`]).
    pub fn decode(buf: &[u8; DATA_REQUEST_LEN]) -> Result<Self, WireError> {
        let mut r = Reader::new(buf);
        let kind = match r.u8("op")? {
            OP_READ => OpKind::Read,
            OP_WRITE => OpKind::Write,
            OP_CHECKSUM => OpKind::Checksum,
            c => {
                return Err(WireError::UnknownCode {
                    field: "op",
                    code: c.into(),
                });
            }
        };
        let _flags = r.u8("flags")?;
        let ack_slack = r.u16("ack slack")?;
        let seq = r.u32("seq")?;
        let token = SegmentToken(r.u64("token")?);
        let offset = r.u64("offset")?;
        let len = r.u64("length")?;
        if len > MAX_CHUNK && kind != OpKind::Checksum {
            return Err(WireError::TooLarge {
                field: "chunk length",
                value: len,
                limit: MAX_CHUNK,
            });
        }
        Ok(Self {
            kind,
            seq,
            token,
            offset,
            len,
            ack_slack,
        })
    }
}

/// A data-plane response header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataResponse {
    /// The request's sequence number.
    pub seq: u32,
    /// `None` when accepted, else why it was refused (no byte moved).
    pub refused: Option<RemoteStatus>,
    /// Payload bytes that follow (an accepted READ's length, else 0).
    pub len: u64,
    /// How many WRITE chunks sent just before `seq` on this stream (`seq - also_acks` up to
    /// `seq - 1`) this response also accepts: their responses were held back, as their requests'
    /// [`DataRequest::ack_slack`] allowed. 0 from a server that holds nothing back.
    pub also_acks: u16,
}

fn status_code(s: Option<RemoteStatus>) -> u8 {
    match s {
        None => 0,
        Some(RemoteStatus::UnknownSegment) => 1,
        Some(RemoteStatus::OutOfBounds) => 2,
        Some(RemoteStatus::AccessDenied) => 3,
        Some(RemoteStatus::StaleEpoch) => 4,
        Some(RemoteStatus::Malformed) => 5,
    }
}

impl DataResponse {
    /// Encodes into a fixed buffer (no allocation).
    pub fn encode(&self, out: &mut [u8; DATA_RESPONSE_LEN]) {
        out[0] = OP_RESPONSE;
        out[1] = status_code(self.refused);
        out[2..4].copy_from_slice(&self.also_acks.to_le_bytes());
        out[4..8].copy_from_slice(&self.seq.to_le_bytes());
        out[8..16].copy_from_slice(&self.len.to_le_bytes());
    }

    /// Decodes and checks a header.
    pub fn decode(buf: &[u8; DATA_RESPONSE_LEN]) -> Result<Self, WireError> {
        let mut r = Reader::new(buf);
        let op = r.u8("op")?;
        if op != OP_RESPONSE {
            return Err(WireError::UnknownCode {
                field: "response op",
                code: op.into(),
            });
        }
        let refused = status_from_code(r.u8("status")?)?;
        let also_acks = r.u16("also acks")?;
        let seq = r.u32("seq")?;
        let len = r.u64("length")?;
        if len > MAX_CHUNK {
            return Err(WireError::TooLarge {
                field: "response length",
                value: len,
                limit: MAX_CHUNK,
            });
        }
        Ok(Self {
            seq,
            refused,
            len,
            also_acks,
        })
    }
}

/// A vectored data request header (protocol version 3): one READ or WRITE of many pieces, each
/// a (segment, offset, length), whose bytes travel as one payload in piece order.
///
/// Layout (32 bytes, the size of a [`DataRequest`]): `op u8 (4: READ, 5: WRITE) | flags u8 (0) |
/// reserved u16 | seq u32 | pieces u32 | reserved u32 | reserved u64 | total u64`. The piece
/// table follows the header: `pieces` records of [`PIECE_LEN`] bytes (`token u64 | offset u64 |
/// len u64`, see [`decode_pieces`]); a WRITE's payload of `total` bytes follows the table.
///
/// The server checks the pieces in order before it moves a byte and performs the longest prefix
/// it accepts: its [`VectoredResponse`] says how many pieces were done and why the next one was
/// refused; no piece after a refused one is touched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VectoredRequest {
    /// READ or WRITE.
    pub kind: OpKind,
    /// Sequence number on its stream (echoed in the response).
    pub seq: u32,
    /// Pieces in the table (1 to [`MAX_PIECES`]).
    pub pieces: u32,
    /// The sum of the pieces' lengths (at most [`MAX_CHUNK`]).
    pub total: u64,
}

impl VectoredRequest {
    /// Encodes into a fixed buffer (no allocation).
    pub fn encode(&self, out: &mut [u8; DATA_REQUEST_LEN]) {
        *out = [0u8; DATA_REQUEST_LEN];
        out[0] = match self.kind {
            OpKind::Write => OP_VWRITE,
            OpKind::Read | OpKind::Checksum => OP_VREAD,
        };
        out[4..8].copy_from_slice(&self.seq.to_le_bytes());
        out[8..12].copy_from_slice(&self.pieces.to_le_bytes());
        out[24..32].copy_from_slice(&self.total.to_le_bytes());
    }

    /// Bytes of the piece table that follows the header.
    pub fn table_len(&self) -> usize {
        self.pieces as usize * PIECE_LEN
    }
}

/// One piece of a vectored request: a range of a remote segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The segment.
    pub token: SegmentToken,
    /// Offset in the segment.
    pub offset: u64,
    /// Length (at most [`MAX_CHUNK`]).
    pub len: u64,
}

impl Piece {
    /// Appends the piece's table record to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        put_u64(out, self.token.0);
        put_u64(out, self.offset);
        put_u64(out, self.len);
    }
}

/// Decodes the piece table of `req` from `buf`: the count is checked against [`MAX_PIECES`] and
/// against the bytes in `buf` before anything is allocated, every length against [`MAX_CHUNK`],
/// and the lengths must add up to `req.total` exactly (no overflow); `buf` must hold nothing
/// else.
pub fn decode_pieces(req: &VectoredRequest, buf: &[u8]) -> Result<Vec<Piece>, WireError> {
    let mut r = Reader::new(buf);
    let n = r.count(
        req.pieces.into(),
        MAX_PIECES as usize,
        PIECE_LEN,
        "piece count",
    )?;
    let mut pieces = Vec::with_capacity(n);
    let mut sum = 0u64;
    for _ in 0..n {
        let p = Piece {
            token: SegmentToken(r.u64("piece token")?),
            offset: r.u64("piece offset")?,
            len: r.u64("piece length")?,
        };
        if p.len > MAX_CHUNK {
            return Err(WireError::TooLarge {
                field: "piece length",
                value: p.len,
                limit: MAX_CHUNK,
            });
        }
        sum = sum.saturating_add(p.len);
        pieces.push(p);
    }
    r.finish("piece table")?;
    if sum != req.total {
        return Err(WireError::TooLarge {
            field: "sum of piece lengths (must equal the request's total)",
            value: sum,
            limit: req.total,
        });
    }
    Ok(pieces)
}

/// A request header as it arrives: one chunk ([`DataRequest`]) or a vectored request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestHead {
    /// One chunk of one op.
    Single(DataRequest),
    /// Many pieces (protocol version 3); the piece table follows.
    Vectored(VectoredRequest),
}

impl RequestHead {
    /// Decodes and checks a header: a vectored one's piece count against [`MAX_PIECES`] (and
    /// 0) and its total against [`MAX_CHUNK`].
    pub fn decode(buf: &[u8; DATA_REQUEST_LEN]) -> Result<Self, WireError> {
        let kind = match buf[0] {
            OP_VREAD => OpKind::Read,
            OP_VWRITE => OpKind::Write,
            _ => return DataRequest::decode(buf).map(RequestHead::Single),
        };
        let mut r = Reader::new(&buf[4..]);
        let seq = r.u32("seq")?;
        let pieces = r.u32("piece count")?;
        let _reserved = r.u32("reserved")?;
        let _reserved = r.u64("reserved")?;
        let total = r.u64("total length")?;
        if pieces == 0 || pieces > MAX_PIECES {
            return Err(WireError::TooLarge {
                field: "piece count (1 up)",
                value: pieces.into(),
                limit: MAX_PIECES.into(),
            });
        }
        if total > MAX_CHUNK {
            return Err(WireError::TooLarge {
                field: "vectored length",
                value: total,
                limit: MAX_CHUNK,
            });
        }
        Ok(RequestHead::Vectored(VectoredRequest {
            kind,
            seq,
            pieces,
            total,
        }))
    }
}

/// The response to a vectored request (16 bytes): `op u8 (0x82) | status u8 | reserved u16 |
/// seq u32 | done u32 | len u32`. The first `done` pieces were performed; when `done` is less
/// than the request's piece count, `refused` says why piece `done` was refused (and no later
/// piece was touched). `len` payload bytes follow: an accepted READ's pieces, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VectoredResponse {
    /// The request's sequence number.
    pub seq: u32,
    /// Why piece `done` was refused; `None` when every piece was done.
    pub refused: Option<RemoteStatus>,
    /// Pieces performed, from the first.
    pub done: u32,
    /// Payload bytes that follow (a READ's done pieces, else 0).
    pub len: u32,
}

impl VectoredResponse {
    /// Encodes into a fixed buffer (no allocation).
    pub fn encode(&self, out: &mut [u8; DATA_RESPONSE_LEN]) {
        out[0] = OP_VRESPONSE;
        out[1] = status_code(self.refused);
        out[2..4].copy_from_slice(&[0, 0]);
        out[4..8].copy_from_slice(&self.seq.to_le_bytes());
        out[8..12].copy_from_slice(&self.done.to_le_bytes());
        out[12..16].copy_from_slice(&self.len.to_le_bytes());
    }
}

/// A response header as it arrives: to one chunk or to a vectored request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResponseHead {
    /// To one chunk.
    Single(DataResponse),
    /// To a vectored request.
    Vectored(VectoredResponse),
}

impl ResponseHead {
    /// Decodes and checks a header (lengths against [`MAX_CHUNK`], `done` against
    /// [`MAX_PIECES`]).
    pub fn decode(buf: &[u8; DATA_RESPONSE_LEN]) -> Result<Self, WireError> {
        if buf[0] != OP_VRESPONSE {
            return DataResponse::decode(buf).map(ResponseHead::Single);
        }
        let mut r = Reader::new(&buf[1..]);
        let refused = status_from_code(r.u8("status")?)?;
        let _reserved = r.u16("reserved")?;
        let seq = r.u32("seq")?;
        let done = r.u32("pieces done")?;
        let len = r.u32("length")?;
        if done > MAX_PIECES {
            return Err(WireError::TooLarge {
                field: "pieces done",
                value: done.into(),
                limit: MAX_PIECES.into(),
            });
        }
        if u64::from(len) > MAX_CHUNK {
            return Err(WireError::TooLarge {
                field: "response length",
                value: len.into(),
                limit: MAX_CHUNK,
            });
        }
        Ok(ResponseHead::Vectored(VectoredResponse {
            seq,
            refused,
            done,
            len,
        }))
    }
}

fn status_from_code(c: u8) -> Result<Option<RemoteStatus>, WireError> {
    Ok(match c {
        0 => None,
        1 => Some(RemoteStatus::UnknownSegment),
        2 => Some(RemoteStatus::OutOfBounds),
        3 => Some(RemoteStatus::AccessDenied),
        4 => Some(RemoteStatus::StaleEpoch),
        5 => Some(RemoteStatus::Malformed),
        c => {
            return Err(WireError::UnknownCode {
                field: "status",
                code: c.into(),
            });
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
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

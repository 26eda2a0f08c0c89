//! The transports a peer offers in its handshake ([`TransportOffer`]), with their endpoints.

use super::MAX_RAILS;
use super::codec::Reader;
use super::error::WireError;

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

    pub(super) fn encode_body(&self, out: &mut Vec<u8>) {
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

    pub(super) fn decode_body(code: u16, body: &[u8]) -> Result<Self, WireError> {
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

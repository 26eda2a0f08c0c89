//! The control protocol's messages: one JSON object per line, and how long a line may be.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

use crate::layout::Extent;
use crate::manifest::{Digest, MAX_MANIFEST_BYTES, Manifest};
use crate::plan::Member;

/// Longest answer a client accepts (a manifest answer is the longest).
pub(crate) const MAX_LINE: usize = MAX_MANIFEST_BYTES + (1 << 20);
/// Longest request a control service reads: requests are small (a member's entry at most).
pub(crate) const MAX_REQUEST: usize = 64 << 10;
/// Longest request a keyed control service reads before the connection proved its key (the
/// authentication requests are under 300 bytes).
pub(crate) const MAX_PREAUTH_REQUEST: usize = 1024;

/// 32 bytes as 64 hex digits on the wire (nonces, MACs, entry tokens).
pub(crate) type Hex32 = Digest;

/// A request to a member's control service.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum Request {
    Manifest {
        #[serde(default)]
        version: Option<u64>,
    },
    Progress {
        after: u64,
        wait_ms: u64,
        /// Answer once more than this many chunks are verified (or after `wait_ms`) instead
        /// of once the prefix passes `after`: a striped member's prefix may not move while
        /// its stripes do.
        #[serde(default)]
        after_count: Option<u64>,
    },
    Layout {
        #[serde(default)]
        version: Option<u64>,
    },
    Join {
        member: Member,
        /// The entry's token, to join again under an id already listed.
        #[serde(default)]
        token: Option<Hex32>,
    },
    Heartbeat {
        member: Member,
        #[serde(default)]
        token: Option<Hex32>,
    },
    Members,
    Leave {
        id: String,
        #[serde(default)]
        token: Option<Hex32>,
    },
    /// The first step of the engine's challenge-response (`AuthHello`).
    AuthHello {
        name: String,
        peer_id: String,
        epoch: u64,
        nonce: Hex32,
    },
    /// The client's proof (`AuthProof`).
    AuthProof {
        mac: Hex32,
    },
}

/// An answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub(crate) enum Reply {
    Manifest {
        source_epoch: u64,
        manifest: Manifest,
    },
    Progress {
        source_epoch: u64,
        prefix: u64,
        done: bool,
        #[serde(default)]
        version: u64,
        /// Chunks verified.
        #[serde(default)]
        count: u64,
        /// Per stripe, its verified prefix ([`Have::stripe_prefixes`](crate::plan::Have)).
        #[serde(default)]
        stripes: Vec<u64>,
    },
    Layout {
        source_epoch: u64,
        version: u64,
        segments: Vec<Vec<Extent>>,
    },
    Members {
        source_epoch: u64,
        members: Vec<Member>,
    },
    Ok {
        source_epoch: u64,
    },
    /// A join's answer: the entry's token.
    Joined {
        source_epoch: u64,
        token: Hex32,
    },
    /// The server's side of the challenge-response (`AuthChallenge`).
    AuthChallenge {
        peer_id: String,
        epoch: u64,
        nonce: Hex32,
        mac: Hex32,
    },
    Error {
        message: String,
    },
}

/// What a member's verified prefix is now (overall and per stripe), how many chunks it
/// verified, and whether it holds everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Progress {
    pub(crate) prefix: u64,
    pub(crate) done: bool,
    pub(crate) count: u64,
    pub(crate) stripes: Vec<u64>,
}

/// Reads one `\n`-terminated line of at most `limit` bytes (`None` at a clean end).
pub(crate) async fn read_line<R: AsyncRead + Unpin>(
    r: &mut BufReader<R>,
    limit: usize,
) -> std::io::Result<Option<Vec<u8>>> {
    let mut line = Vec::new();
    loop {
        let buf = r.fill_buf().await?;
        if buf.is_empty() {
            return if line.is_empty() {
                Ok(None)
            } else {
                Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "line cut short",
                ))
            };
        }
        let (take, end) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        if line.len() + take > limit + 1 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("line longer than {limit} bytes"),
            ));
        }
        line.extend_from_slice(&buf[..take]);
        r.consume(take);
        if end {
            line.pop();
            return Ok(Some(line));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn long_lines_and_garbage_are_refused() {
        let data = b"{\"op\":\"members\"}\nxxxxxxxxxx".to_vec();
        let mut r = BufReader::new(&data[..]);
        assert_eq!(
            read_line(&mut r, 100).await.unwrap().unwrap(),
            b"{\"op\":\"members\"}"
        );
        assert!(read_line(&mut r, 100).await.is_err(), "cut short");
        let long = vec![b'a'; 300];
        let mut r = BufReader::new(&long[..]);
        assert!(read_line(&mut r, 100).await.is_err());
        // A request is refused past 64 KiB, whatever it is.
        let long = vec![b' '; MAX_REQUEST + 2];
        let mut r = BufReader::new(&long[..]);
        assert!(read_line(&mut r, MAX_REQUEST).await.is_err());
        assert!(serde_json::from_slice::<Request>(b"{\"op\":\"nope\"}").is_err());
        // A request of the protocol before versions still parses.
        assert!(matches!(
            serde_json::from_slice::<Request>(b"{\"op\":\"manifest\"}"),
            Ok(Request::Manifest { version: None })
        ));
    }
}

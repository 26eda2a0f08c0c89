//! Authenticated peers, without I/O: keys and keyrings, the challenge-response both ends of a
//! control handshake run, the session a data stream proves it belongs to, and what a peer may
//! see of a table.
//!
//! **Keys.** A [`Keyring`] holds named keys (`name hexkey` lines; each key at least
//! [`MIN_KEY_LEN`] bytes). A server accepts every key of its keyring, and the name of the key a
//! client proved is that client's identity on the server (per-peer publishing names it). A
//! client uses the first key of its own keyring. Keys never go on the wire, never appear in
//! `Debug` output, and are never logged.
//!
//! **Handshake** (frames in [`crate::wire`]):
//!
//! 1. client → server: [`AuthHello`] (key name, client id and epoch, client nonce `Nc`);
//! 2. server → client: [`AuthChallenge`] (server id and epoch, server nonce `Ns`, and
//!    `HMAC(K, "server" | T)`), where the transcript `T` is the protocol label, the key name,
//!    both ids, both epochs and both nonces;
//! 3. client → server: [`AuthProof`] (`HMAC(K, "client" | T)`), then the ordinary [`Hello`](crate::wire::Hello);
//! 4. server → client: `HelloAck` with the segments published to that name, or a refusal.
//!
//! **Server identity.** The key proves only "holds the key": under per-peer keyrings every
//! server holding a client's key passes step 2. A client that names the server it expects
//! ([`ClientAuth::start_expecting`] with a [`ServerIdentity`]) opens with
//! [`ControlFrame::AuthHelloIdentified`] instead; a server with an [`IdentityKey`]
//! ([`ServerAuth::with_identity`]) answers with a [`SignedChallenge`]: the same challenge, its
//! public identity and an Ed25519 signature over `"ferry-identity-1" | T | identity`. The
//! client refuses ([`Error::ServerIdentity`]) a server that proves no identity or another
//! one. Without an expected identity the handshake is the one above, byte for byte. (The
//! session key still derives from the shared key: an expected identity stops a key holder
//! from answering in another's place, not one that relays the real server's handshake and
//! then serves the data streams itself; see `docs/security.md`.)
//!
//! Each side checks the other's MAC in constant time over a transcript holding its own fresh
//! nonce, so an old transcript replays nowhere, and the direction labels keep one side's proof
//! from being reflected as the other's. Both sides then hold the session key
//! `HMAC(K, "session" | T)`.
//!
//! **Data streams.** An authenticated client attaches each data stream with an [`AuthAttach`]:
//! the attach, the session (the server's `Ns`: the server chooses session ids, one per
//! handshake, and never replaces one), a counter and `HMAC(session key, "attach" | attach |
//! counter)`. The server keeps the recent sessions of each key name ([`Sessions`]: at most
//! [`MAX_SESSIONS_PER_NAME`] a name, the oldest of that name forgotten first, so one key holder
//! cannot evict another's) and accepts each counter below [`MAX_ATTACHES_PER_SESSION`] once per
//! session, so a stranger who knows ids and epochs, or who replays a captured attach, attaches
//! nothing, and the table's memory is bounded by the keyring's size.
//!
//! What this does not do: it does not encrypt or authenticate the payload bytes or the data
//! headers after the attach. An attacker who can read the network sees the data; one who can
//! write into established TCP connections can alter it. See `docs/architecture.md` §4.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::Error;
use crate::identity::{IdentityKey, ServerIdentity};
use crate::ids::{Epoch, PeerId};
use crate::wire::{
    AUTH_MAC_LEN, AUTH_NONCE_LEN, AuthAttach, AuthChallenge, AuthHello, AuthProof, ControlFrame,
    MAX_AUTH_NAME, Reject, RejectReason, SUPPORTED_VERSIONS, SignedChallenge, StreamAttach,
};

/// Shortest key accepted, in bytes of secret.
pub const MIN_KEY_LEN: usize = 16;
/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 1024;
/// Sessions a server remembers per key name for stream attaches; past it that name's oldest is
/// forgotten (its streams already attached keep running; new ones need a new handshake).
/// Other names' sessions are never touched.
pub const MAX_SESSIONS_PER_NAME: usize = 1024;
/// Data streams one session may attach: counters `0..MAX_ATTACHES_PER_SESSION`, each once.
pub const MAX_ATTACHES_PER_SESSION: usize = 4096;

const LABEL: &[u8] = b"ferry-auth-1";
const IDENTITY_LABEL: &[u8] = b"ferry-identity-1";

type HmacSha256 = Hmac<Sha256>;

/// A secret key. Its bytes are never shown: `Debug` prints only its length.
#[derive(Clone, PartialEq, Eq)]
pub struct Key(Box<[u8]>);

impl Key {
    /// A key from raw bytes: [`MIN_KEY_LEN`] to [`MAX_KEY_LEN`] of them.
    pub fn new(bytes: &[u8]) -> Result<Self, KeyError> {
        if bytes.len() < MIN_KEY_LEN {
            return Err(KeyError::TooShort { len: bytes.len() });
        }
        if bytes.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: bytes.len() });
        }
        Ok(Self(bytes.into()))
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC takes keys of any length: this cannot fail.
        <HmacSha256 as Mac>::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!())
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key(<{} bytes, not shown>)", self.0.len())
    }
}

/// Why a key or keyring was refused. Messages name the line, never the key's bytes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key has fewer than [`MIN_KEY_LEN`] bytes.
    #[error("the key has {len} bytes; at least {MIN_KEY_LEN} are needed")]
    TooShort {
        /// Its length.
        len: usize,
    },
    /// The key has more than [`MAX_KEY_LEN`] bytes.
    #[error("the key has {len} bytes; at most {MAX_KEY_LEN} are accepted")]
    TooLong {
        /// Its length.
        len: usize,
    },
    /// A key name is empty, too long or has characters outside `A-Za-z0-9._@:-`.
    #[error("key name {name:?} is not 1 to {MAX_AUTH_NAME} characters of A-Z a-z 0-9 . _ @ : -")]
    BadName {
        /// The name.
        name: String,
    },
    /// A line is not `name hexkey`.
    #[error("line {line}: {reason}")]
    BadLine {
        /// 1-based line number.
        line: usize,
        /// What is wrong (never the key's bytes).
        reason: String,
    },
    /// A name appears twice.
    #[error("key name {name:?} appears twice")]
    Duplicate {
        /// The name.
        name: String,
    },
    /// No key at all.
    #[error("no key (expected lines of `name hexkey`)")]
    Empty,
}

fn check_name(name: &str) -> Result<(), KeyError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_AUTH_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._@:-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(KeyError::BadName { name: name.into() })
    }
}

/// Whether `word` reads as a key: at least [`MIN_KEY_LEN`] bytes' worth of hex digits.
fn looks_like_key(word: &str) -> bool {
    word.len() >= 2 * MIN_KEY_LEN && word.bytes().all(|b| b.is_ascii_hexdigit())
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Named keys: the server accepts each; a client uses the first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keyring {
    keys: Vec<(String, Key)>,
}

impl Keyring {
    /// A keyring of one key named `name`.
    pub fn single(name: &str, key: &[u8]) -> Result<Self, KeyError> {
        check_name(name)?;
        Ok(Self {
            keys: vec![(name.to_owned(), Key::new(key)?)],
        })
    }

    /// Parses a keyring file's text: one `name hexkey` per line, blank lines and lines starting
    /// with `#` ignored, names unique, each key [`MIN_KEY_LEN`] bytes or more (twice as many
    /// hex digits).
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        let mut keys: Vec<(String, Key)> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |reason: String| KeyError::BadLine {
                line: i + 1,
                reason,
            };
            let mut words = line.split_whitespace();
            let (Some(name), Some(hex), None) = (words.next(), words.next(), words.next()) else {
                return Err(bad("expected `name hexkey`".into()));
            };
            // A key where the name belongs (a swapped `hexkey name` line): refused without
            // echoing either word, and never taken as a name (names go on the wire in clear).
            if looks_like_key(name) {
                return Err(bad(
                    "the first word looks like a key (32 or more hex digits); the line must be \
                     `name hexkey`"
                        .into(),
                ));
            }
            if check_name(name).is_err() {
                return Err(bad(format!(
                    "the name is not 1 to {MAX_AUTH_NAME} characters of A-Z a-z 0-9 . _ @ : -"
                )));
            }
            let bytes = unhex(hex).ok_or_else(|| bad("the key is not hexadecimal".into()))?;
            let key = Key::new(&bytes).map_err(|e| bad(e.to_string()))?;
            if keys.iter().any(|(n, _)| n == name) {
                return Err(KeyError::Duplicate { name: name.into() });
            }
            keys.push((name.to_owned(), key));
        }
        if keys.is_empty() {
            return Err(KeyError::Empty);
        }
        Ok(Self { keys })
    }

    /// The key a client proves: the first one, with its name.
    pub fn own(&self) -> (&str, &Key) {
        let (n, k) = &self.keys[0];
        (n, k)
    }

    /// The key named `name`.
    pub fn get(&self, name: &str) -> Option<&Key> {
        self.keys.iter().find(|(n, _)| n == name).map(|(_, k)| k)
    }

    /// The names, in file order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|(n, _)| n.as_str())
    }
}

/// What both MACs of a handshake cover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Transcript<'a> {
    name: &'a str,
    client: (PeerId, Epoch),
    client_nonce: &'a [u8; AUTH_NONCE_LEN],
    server: (PeerId, Epoch),
    server_nonce: &'a [u8; AUTH_NONCE_LEN],
}

impl Transcript<'_> {
    /// The fields, as both MACs and the identity signature cover them.
    fn fields(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(1 + self.name.len() + 2 * (16 + 8 + AUTH_NONCE_LEN));
        out.push(self.name.len() as u8);
        out.extend_from_slice(self.name.as_bytes());
        out.extend_from_slice(&self.client.0.0.to_le_bytes());
        out.extend_from_slice(&self.client.1.0.to_le_bytes());
        out.extend_from_slice(self.client_nonce);
        out.extend_from_slice(&self.server.0.0.to_le_bytes());
        out.extend_from_slice(&self.server.1.0.to_le_bytes());
        out.extend_from_slice(self.server_nonce);
        out
    }

    fn hmac(&self, key: &Key, direction: &[u8]) -> HmacSha256 {
        let mut m = key.mac();
        m.update(LABEL);
        m.update(&[direction.len() as u8]);
        m.update(direction);
        m.update(&self.fields());
        m
    }

    /// What a server's identity signs: its own label, the transcript and the identity itself
    /// (so a signature is never taken for another key's).
    fn signed(&self, identity: &ServerIdentity) -> Vec<u8> {
        let mut out = IDENTITY_LABEL.to_vec();
        out.extend_from_slice(&self.fields());
        out.extend_from_slice(&identity.to_bytes());
        out
    }

    fn mac(&self, key: &Key, direction: &[u8]) -> [u8; AUTH_MAC_LEN] {
        self.hmac(key, direction).finalize().into_bytes().into()
    }

    /// Checks `mac` in constant time (`subtle`, through `hmac`).
    fn verify(&self, key: &Key, direction: &[u8], mac: &[u8; AUTH_MAC_LEN]) -> bool {
        self.hmac(key, direction).verify_slice(mac).is_ok()
    }

    fn session_key(&self, key: &Key) -> Key {
        Key(self.mac(key, b"session").into())
    }
}

fn attach_mac(session_key: &Key, attach: &StreamAttach, counter: u64) -> HmacSha256 {
    let mut m = session_key.mac();
    m.update(LABEL);
    m.update(b"attach");
    let mut body = Vec::with_capacity(40);
    attach.encode_body(&mut body);
    m.update(&body);
    m.update(&counter.to_le_bytes());
    m
}

/// A fresh random nonce.
pub fn nonce() -> [u8; AUTH_NONCE_LEN] {
    rand::random()
}

fn refuse(epoch: Epoch, message: String) -> Reject {
    Reject {
        reason: RejectReason::Unauthenticated,
        versions: SUPPORTED_VERSIONS,
        epoch,
        message,
    }
}

// ---------------------------------------------------------------------------------------------
// Client side.

/// A client's side of one authenticated handshake, between its [`AuthHello`] and the server's
/// [`AuthChallenge`].
#[derive(Debug)]
pub struct ClientAuth {
    name: String,
    key: Key,
    id: (PeerId, Epoch),
    nonce: [u8; AUTH_NONCE_LEN],
    expect: Option<ServerIdentity>,
}

impl ClientAuth {
    /// Starts a handshake as `(id, epoch)` with the first key of `keyring` and a fresh `nonce`:
    /// the frame to send first, and the state that reads the answer.
    pub fn start(
        keyring: &Keyring,
        id: PeerId,
        epoch: Epoch,
        nonce: [u8; AUTH_NONCE_LEN],
    ) -> (ControlFrame, Self) {
        Self::start_expecting(keyring, id, epoch, nonce, None)
    }

    /// As [`start`](Self::start), and where `expect` names a server identity, the server must
    /// also prove it (its answer signed with that identity's key): the frame sent is then
    /// [`ControlFrame::AuthHelloIdentified`]. `None` is exactly [`start`](Self::start).
    pub fn start_expecting(
        keyring: &Keyring,
        id: PeerId,
        epoch: Epoch,
        nonce: [u8; AUTH_NONCE_LEN],
        expect: Option<ServerIdentity>,
    ) -> (ControlFrame, Self) {
        let (name, key) = keyring.own();
        let hello = AuthHello {
            name: name.to_owned(),
            peer_id: id,
            epoch,
            nonce,
        };
        let frame = match expect {
            None => ControlFrame::AuthHello(hello),
            Some(_) => ControlFrame::AuthHelloIdentified(hello),
        };
        (
            frame,
            Self {
                name: name.to_owned(),
                key: key.clone(),
                id: (id, epoch),
                nonce,
                expect,
            },
        )
    }

    /// What the server's answer means: its proof checked, the client's proof to send (then the
    /// [`Hello`](crate::wire::Hello)) and the session; [`Error::Authentication`] when the server refused or could
    /// not prove the key, [`Error::HandshakeRefused`] or `Malformed` otherwise.
    pub fn on_reply(
        self,
        peer: SocketAddr,
        reply: ControlFrame,
    ) -> Result<(ControlFrame, Session), Error> {
        let (c, signed) = match reply {
            ControlFrame::AuthChallenge(c) => (c, None),
            ControlFrame::SignedChallenge(s) if self.expect.is_some() => (s.challenge, Some(s)),
            ControlFrame::Reject(r) if r.reason == RejectReason::Unauthenticated => {
                return Err(Error::Authentication {
                    peer: peer.to_string(),
                    reason: r.message,
                });
            }
            ControlFrame::Reject(r) => {
                return Err(Error::HandshakeRefused {
                    peer: peer.to_string(),
                    reason: r.message,
                });
            }
            other => {
                return Err(Error::Malformed {
                    peer: peer.to_string(),
                    source: crate::wire::WireError::Unexpected {
                        found: other.name(),
                        expected: "auth-challenge",
                    },
                });
            }
        };
        let t = Transcript {
            name: &self.name,
            client: self.id,
            client_nonce: &self.nonce,
            server: (c.peer_id, c.epoch),
            server_nonce: &c.nonce,
        };
        if !t.verify(&self.key, b"server", &c.mac) {
            return Err(Error::Authentication {
                peer: peer.to_string(),
                reason: format!(
                    "the server could not prove it holds key {:?} (its key differs from ours)",
                    self.name
                ),
            });
        }
        if let Some(expected) = self.expect {
            check_identity(peer, &t, &expected, signed.as_ref())?;
        }
        let proof = ControlFrame::AuthProof(AuthProof {
            mac: t.mac(&self.key, b"client"),
        });
        let session = Session {
            key: t.session_key(&self.key),
            id: c.nonce,
            server: (c.peer_id, c.epoch),
            name: self.name.clone(),
            counter: std::sync::atomic::AtomicU64::new(0),
        };
        Ok((proof, session))
    }
}

/// Checks that the server proved `expected` over transcript `t`: its answer signed, by that
/// identity, over this very transcript (which holds the client's fresh nonce).
fn check_identity(
    peer: SocketAddr,
    t: &Transcript<'_>,
    expected: &ServerIdentity,
    signed: Option<&SignedChallenge>,
) -> Result<(), Error> {
    let refused = |reason: String| Error::ServerIdentity {
        addr: peer.to_string(),
        expected: expected.to_string(),
        reason: format!(
            "the server (peer {} epoch {}) {reason}",
            t.server.0, t.server.1
        ),
    };
    let Some(s) = signed else {
        return Err(refused(
            "proved no identity (it has none, or predates server identities)".into(),
        ));
    };
    let found = ServerIdentity::from_bytes(s.identity);
    if found != *expected {
        return Err(refused(format!("proved identity {found}")));
    }
    if !expected.verifies(&t.signed(expected), &s.signature) {
        return Err(refused(
            "named the expected identity but its signature does not verify".into(),
        ));
    }
    Ok(())
}

/// An authenticated session, client side: attaches its data streams.
#[derive(Debug)]
pub struct Session {
    key: Key,
    id: [u8; AUTH_NONCE_LEN],
    server: (PeerId, Epoch),
    name: String,
    counter: std::sync::atomic::AtomicU64,
}

impl Session {
    /// The key name this session proved.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Checks that the server's [`Hello`](crate::wire::Hello) comes from the server that
    /// answered the challenge (same id and epoch).
    pub fn check_server(&self, peer: SocketAddr, id: PeerId, epoch: Epoch) -> Result<(), Error> {
        if (id, epoch) == self.server {
            return Ok(());
        }
        Err(Error::Authentication {
            peer: peer.to_string(),
            reason: format!(
                "the server's hello names peer {id} epoch {epoch}, its challenge peer {} epoch {}",
                self.server.0, self.server.1
            ),
        })
    }

    /// The frame that attaches a data stream to this session (each call takes a new counter).
    pub fn attach(&self, attach: StreamAttach) -> ControlFrame {
        let counter = self
            .counter
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ControlFrame::AuthAttach(AuthAttach {
            attach,
            session: self.id,
            counter,
            mac: attach_mac(&self.key, &attach, counter)
                .finalize()
                .into_bytes()
                .into(),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Server side.

/// The attach counters a session has used: one bit for each of `0..MAX_ATTACHES_PER_SESSION`
/// (a fixed 512 bytes, whatever the peer sends).
struct Used(Box<[u64; MAX_ATTACHES_PER_SESSION / 64]>);

impl Used {
    fn new() -> Self {
        Self(Box::new([0; MAX_ATTACHES_PER_SESSION / 64]))
    }

    /// Marks `counter` used: `Some(true)` if it was not yet, `Some(false)` for a replay, `None`
    /// past the session's limit.
    fn take(&mut self, counter: u64) -> Option<bool> {
        let i = usize::try_from(counter)
            .ok()
            .filter(|&i| i < MAX_ATTACHES_PER_SESSION)?;
        let (word, bit) = (i / 64, 1u64 << (i % 64));
        let fresh = self.0[word] & bit == 0;
        self.0[word] |= bit;
        Some(fresh)
    }
}

struct ServerSession {
    key: Key,
    name: Arc<str>,
    client: (PeerId, Epoch),
    used: Used,
}

/// The sessions a server remembers for stream attaches, by the id the server chose (its
/// handshake nonce): at most [`MAX_SESSIONS_PER_NAME`] per key name, that name's oldest
/// forgotten first; an id already taken is never replaced.
#[derive(Default)]
pub struct Sessions {
    map: HashMap<[u8; AUTH_NONCE_LEN], ServerSession>,
    by_name: HashMap<Arc<str>, VecDeque<[u8; AUTH_NONCE_LEN]>>,
}

impl fmt::Debug for Sessions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sessions")
            .field("len", &self.map.len())
            .field("names", &self.by_name.len())
            .finish()
    }
}

impl Sessions {
    /// Remembers session `id`; `false` (and nothing changes) if `id` is taken.
    fn insert(&mut self, id: [u8; AUTH_NONCE_LEN], s: ServerSession) -> bool {
        if self.map.contains_key(&id) {
            return false;
        }
        let order = self.by_name.entry(s.name.clone()).or_default();
        order.push_back(id);
        while order.len() > MAX_SESSIONS_PER_NAME {
            if let Some(old) = order.pop_front() {
                self.map.remove(&old);
            }
        }
        self.map.insert(id, s);
        true
    }

    /// How many sessions of key name `name` are remembered.
    pub fn len_of(&self, name: &str) -> usize {
        self.by_name.get(name).map_or(0, VecDeque::len)
    }

    /// How many sessions are remembered.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// A server's authentication: its keyring and the sessions its handshakes opened. Shared by
/// every connection of one listener.
#[derive(Debug)]
pub struct ServerAuth {
    keyring: Keyring,
    identity: Option<IdentityKey>,
    sessions: Mutex<Sessions>,
}

impl ServerAuth {
    /// A server that accepts every key of `keyring`.
    pub fn new(keyring: Keyring) -> Self {
        Self {
            keyring,
            identity: None,
            sessions: Mutex::new(Sessions::default()),
        }
    }

    /// The same server, which proves `identity` to clients that ask
    /// ([`ControlFrame::AuthHelloIdentified`]).
    pub fn with_identity(self, identity: IdentityKey) -> Self {
        Self {
            identity: Some(identity),
            ..self
        }
    }

    /// The public identity this server proves, if it has one.
    pub fn identity(&self) -> Option<ServerIdentity> {
        self.identity.as_ref().map(IdentityKey::public)
    }

    /// The sessions remembered now.
    pub fn session_count(&self) -> usize {
        self.sessions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Answers a client's [`AuthHello`] as `(id, epoch)` with a fresh `nonce`: the challenge to
    /// send and the state that checks the client's proof, or the refusal (an unknown key name).
    pub fn challenge(
        &self,
        hello: &AuthHello,
        id: PeerId,
        epoch: Epoch,
        nonce: [u8; AUTH_NONCE_LEN],
    ) -> Result<(ControlFrame, PendingProof), Reject> {
        self.challenge_as(hello, id, epoch, nonce, false)
    }

    /// Answers an [`AuthHello`] that came as [`ControlFrame::AuthHelloIdentified`]: as
    /// [`challenge`](Self::challenge), signed with this server's identity where it has one (a
    /// [`ControlFrame::SignedChallenge`]); without one the plain challenge, which the client
    /// refuses.
    pub fn challenge_identified(
        &self,
        hello: &AuthHello,
        id: PeerId,
        epoch: Epoch,
        nonce: [u8; AUTH_NONCE_LEN],
    ) -> Result<(ControlFrame, PendingProof), Reject> {
        self.challenge_as(hello, id, epoch, nonce, true)
    }

    fn challenge_as(
        &self,
        hello: &AuthHello,
        id: PeerId,
        epoch: Epoch,
        nonce: [u8; AUTH_NONCE_LEN],
        identified: bool,
    ) -> Result<(ControlFrame, PendingProof), Reject> {
        let Some(key) = self.keyring.get(&hello.name) else {
            return Err(refuse(
                epoch,
                format!(
                    "authentication failed: key {:?} is not in this server's keyring",
                    hello.name
                ),
            ));
        };
        let t = Transcript {
            name: &hello.name,
            client: (hello.peer_id, hello.epoch),
            client_nonce: &hello.nonce,
            server: (id, epoch),
            server_nonce: &nonce,
        };
        let challenge = AuthChallenge {
            peer_id: id,
            epoch,
            nonce,
            mac: t.mac(key, b"server"),
        };
        let frame = match self.identity.as_ref().filter(|_| identified) {
            None => ControlFrame::AuthChallenge(challenge),
            Some(identity) => {
                let public = identity.public();
                ControlFrame::SignedChallenge(SignedChallenge {
                    challenge,
                    identity: public.to_bytes(),
                    signature: identity.sign(&t.signed(&public)),
                })
            }
        };
        Ok((
            frame,
            PendingProof {
                hello: hello.clone(),
                server: (id, epoch),
                nonce,
                key: key.clone(),
            },
        ))
    }

    /// Checks a client's [`AuthProof`] against the challenge sent: on success the session is
    /// remembered (for its data streams) and the proven key name returned.
    pub fn verify(&self, pending: PendingProof, proof: &AuthProof) -> Result<Arc<str>, Reject> {
        let t = Transcript {
            name: &pending.hello.name,
            client: (pending.hello.peer_id, pending.hello.epoch),
            client_nonce: &pending.hello.nonce,
            server: pending.server,
            server_nonce: &pending.nonce,
        };
        if !t.verify(&pending.key, b"client", &proof.mac) {
            return Err(refuse(
                pending.server.1,
                format!(
                    "authentication failed: the proof for key {:?} does not match (a different key \
                     under that name)",
                    pending.hello.name
                ),
            ));
        }
        let name: Arc<str> = pending.hello.name.as_str().into();
        let fresh = self
            .sessions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                pending.nonce,
                ServerSession {
                    key: t.session_key(&pending.key),
                    name: name.clone(),
                    client: (pending.hello.peer_id, pending.hello.epoch),
                    used: Used::new(),
                },
            );
        if !fresh {
            // The server's own fresh nonce repeated: never replace the session that holds it.
            return Err(refuse(
                pending.server.1,
                "authentication failed: the session id is taken (handshake again)".into(),
            ));
        }
        Ok(name)
    }

    /// Checks the proof of a data stream's attach (its epoch was checked first): the key name of
    /// its session, or the refusal (unknown or forgotten session, another client's ids, a forged
    /// MAC, a counter already used).
    pub fn check_attach(&self, a: &AuthAttach, epoch: Epoch) -> Result<Arc<str>, Reject> {
        let mut sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        let refused = |why: &str| refuse(epoch, format!("data stream refused: {why}"));
        let Some(s) = sessions.map.get_mut(&a.session) else {
            return Err(refused("no such authenticated session (handshake again)"));
        };
        if s.client != (a.attach.peer_id, a.attach.epoch) {
            return Err(refused("the stream names another peer than its session"));
        }
        if attach_mac(&s.key, &a.attach, a.counter)
            .verify_slice(&a.mac)
            .is_err()
        {
            return Err(refused("its proof does not match the session"));
        }
        match s.used.take(a.counter) {
            None => Err(refused("the session attached too many streams")),
            Some(false) => Err(refused("its proof was used before (a replay)")),
            Some(true) => Ok(s.name.clone()),
        }
    }
}

/// The server's state between its challenge and the client's proof.
#[derive(Debug)]
pub struct PendingProof {
    hello: AuthHello,
    server: (PeerId, Epoch),
    nonce: [u8; AUTH_NONCE_LEN],
    key: Key,
}

impl PendingProof {
    /// The client's id and epoch, as its [`AuthHello`] gave them.
    pub fn client(&self) -> (PeerId, Epoch) {
        (self.hello.peer_id, self.hello.epoch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attach_counters_are_one_bit_each_up_to_the_limit() {
        let mut used = Used::new();
        assert_eq!(used.take(0), Some(true));
        // 64 is the first bit of the second word, not bit 0 again.
        assert_eq!(used.take(64), Some(true));
        assert_eq!(used.take(64), Some(false));
        assert_eq!(used.take(0), Some(false));
        let last = MAX_ATTACHES_PER_SESSION as u64 - 1;
        assert_eq!(used.take(last), Some(true));
        assert_eq!(used.take(last + 1), None);
    }

    #[test]
    fn sessions_know_when_they_hold_none() {
        let mut sessions = Sessions::default();
        assert!(sessions.is_empty());
        let session = ServerSession {
            key: Key(vec![1; MIN_KEY_LEN].into_boxed_slice()),
            name: "alice".into(),
            client: (PeerId(1), Epoch(1)),
            used: Used::new(),
        };
        assert!(sessions.insert([7; AUTH_NONCE_LEN], session));
        assert!(!sessions.is_empty());
        assert_eq!((sessions.len(), sessions.len_of("alice")), (1, 1));
    }

    #[test]
    fn a_key_shows_its_length_and_never_its_bytes() {
        let key = Key(vec![0xab; 20].into_boxed_slice());
        let shown = format!("{key:?}");
        assert_eq!(shown, "Key(<20 bytes, not shown>)");
    }

    #[test]
    fn a_word_is_a_key_only_from_the_minimum_keys_worth_of_hex_digits() {
        assert!(!looks_like_key(&"a".repeat(2 * MIN_KEY_LEN - 2)));
        assert!(!looks_like_key(&"a".repeat(MIN_KEY_LEN + 2)));
        assert!(looks_like_key(&"a".repeat(2 * MIN_KEY_LEN)));
        assert!(!looks_like_key(&"g".repeat(2 * MIN_KEY_LEN)));
    }

    #[test]
    fn a_refusal_that_is_not_about_the_key_is_not_an_authentication_failure() {
        let reject = |reason| {
            ControlFrame::Reject(crate::wire::Reject {
                reason,
                versions: crate::wire::SUPPORTED_VERSIONS,
                epoch: Epoch(9),
                message: "no".into(),
            })
        };
        let (_, c) = ClientAuth::start(&ring(ALICE), PeerId(1), Epoch(2), [1; 32]);
        let e = c
            .on_reply(addr(), reject(RejectReason::Refused))
            .unwrap_err();
        assert!(matches!(e, Error::HandshakeRefused { .. }), "{e:?}");
        let (_, c) = ClientAuth::start(&ring(ALICE), PeerId(1), Epoch(2), [1; 32]);
        let e = c
            .on_reply(addr(), reject(RejectReason::Unauthenticated))
            .unwrap_err();
        assert!(matches!(e, Error::Authentication { .. }), "{e:?}");
    }

    fn ring(text: &str) -> Keyring {
        Keyring::parse(text).unwrap()
    }

    const ALICE: &str = "alice 000102030405060708090a0b0c0d0e0f";
    const ALICE2: &str = "alice ffffffffffffffffffffffffffffffff";
    const BOB: &str = "bob 101112131415161718191a1b1c1d1e1f2021";

    fn addr() -> SocketAddr {
        "127.0.0.1:7".parse().unwrap()
    }

    /// Runs a handshake between `client` and a server with `server`; returns the client's
    /// session and the name the server proved, or the first failure.
    fn pair(client: &Keyring, server: &ServerAuth) -> Result<(Session, Arc<str>), String> {
        let (first, c) = ClientAuth::start(client, PeerId(1), Epoch(2), [1; 32]);
        let ControlFrame::AuthHello(h) = first else {
            panic!("{first:?}")
        };
        let (challenge, pending) = server
            .challenge(&h, PeerId(3), Epoch(4), nonce())
            .map_err(|r| r.message)?;
        let (proof, session) = c.on_reply(addr(), challenge).map_err(|e| e.to_string())?;
        let ControlFrame::AuthProof(p) = proof else {
            panic!("{proof:?}")
        };
        let name = server.verify(pending, &p).map_err(|r| r.message)?;
        Ok((session, name))
    }

    fn attach(index: u16) -> StreamAttach {
        StreamAttach {
            peer_id: PeerId(1),
            epoch: Epoch(2),
            server_epoch: Epoch(4),
            transport: 1,
            stream_index: index,
        }
    }

    #[test]
    fn keyrings_parse_and_refuse_short_keys_without_showing_them() {
        let r = ring(&format!("# fleet\n\n{ALICE}\n  {BOB}  \n"));
        assert_eq!(r.names().collect::<Vec<_>>(), ["alice", "bob"]);
        assert_eq!(r.own().0, "alice");
        assert!(r.get("bob").is_some() && r.get("carol").is_none());
        assert!(!format!("{r:?}").contains("0a0b"), "{r:?}");
        let short = Keyring::parse("a 00010203").unwrap_err();
        assert!(
            matches!(&short, KeyError::BadLine { line: 1, reason } if reason.contains("at least 16")),
            "{short}"
        );
        assert!(!short.to_string().contains("00010203"));
        for bad in [
            "alice",
            "alice 0g0102030405060708090a0b0c0d0e0f",
            "alice 000102030405060708090a0b0c0d0e0",
            "al/ice 000102030405060708090a0b0c0d0e0f",
            "a b c",
        ] {
            assert!(
                matches!(Keyring::parse(bad), Err(KeyError::BadLine { .. })),
                "{bad}"
            );
        }
        assert_eq!(Keyring::parse("# nothing\n"), Err(KeyError::Empty));
        // A swapped `hexkey name` line, with a key of any length: refused, and no part of the
        // key in the error.
        for key in [
            "000102030405060708090a0b0c0d0e0f",
            &"ab".repeat(64),
            &"cd".repeat(MAX_KEY_LEN),
        ] {
            let e = Keyring::parse(&format!("# k\n{key} alice\n")).unwrap_err();
            let text = e.to_string();
            assert!(
                matches!(&e, KeyError::BadLine { line: 2, .. }) && text.contains("name hexkey"),
                "{text}"
            );
            assert!(!text.contains(&key[..8]), "the key leaked: {text}");
        }
        assert!(matches!(
            Keyring::parse(&format!("{ALICE}\n{ALICE2}")),
            Err(KeyError::Duplicate { .. })
        ));
        assert!(Keyring::single("x", &[0; 15]).is_err());
        assert!(Keyring::single("x", &[0; 16]).is_ok());
        assert!(Keyring::single("", &[0; 16]).is_err());
    }

    #[test]
    fn both_sides_prove_the_key_and_streams_attach_once() {
        let server = ServerAuth::new(ring(&format!("{ALICE}\n{BOB}")));
        let (session, name) = pair(&ring(ALICE), &server).unwrap();
        assert_eq!(&*name, "alice");
        assert_eq!(server.session_count(), 1);
        let ControlFrame::AuthAttach(a) = session.attach(attach(0)) else {
            panic!()
        };
        assert_eq!(&*server.check_attach(&a, Epoch(4)).unwrap(), "alice");
        // The same attach again is a replay.
        let e = server.check_attach(&a, Epoch(4)).unwrap_err();
        assert!(e.message.contains("replay"), "{}", e.message);
        // The next one takes a new counter.
        let ControlFrame::AuthAttach(b) = session.attach(attach(1)) else {
            panic!()
        };
        assert_ne!(a.counter, b.counter);
        assert!(server.check_attach(&b, Epoch(4)).is_ok());
        let (_, name) = pair(&ring(BOB), &server).unwrap();
        assert_eq!(&*name, "bob");
    }

    /// The server's hello must come from the server that answered the challenge.
    #[test]
    fn the_servers_hello_must_match_its_challenge() {
        let server = ServerAuth::new(ring(ALICE));
        let (session, _) = pair(&ring(ALICE), &server).unwrap();
        assert_eq!(session.name(), "alice");
        assert!(session.check_server(addr(), PeerId(3), Epoch(4)).is_ok());
        for (id, epoch) in [(PeerId(9), Epoch(4)), (PeerId(3), Epoch(9))] {
            let e = session.check_server(addr(), id, epoch).unwrap_err();
            assert!(matches!(e, Error::Authentication { .. }), "{e}");
        }
    }

    #[test]
    fn a_wrong_key_fails_on_both_sides() {
        let server = ServerAuth::new(ring(ALICE));
        // The client detects the server's wrong key first.
        let e = pair(&ring(ALICE2), &server).unwrap_err();
        assert!(e.contains("could not prove"), "{e}");
        // A client that skipped its check is still refused by the server.
        let (first, _c) = ClientAuth::start(&ring(ALICE2), PeerId(1), Epoch(2), [1; 32]);
        let ControlFrame::AuthHello(h) = first else {
            panic!()
        };
        let (_, pending) = server.challenge(&h, PeerId(3), Epoch(4), [2; 32]).unwrap();
        let forged = AuthProof { mac: [0; 32] };
        let r = server.verify(pending, &forged).unwrap_err();
        assert_eq!(r.reason, RejectReason::Unauthenticated);
        assert_eq!(server.session_count(), 0);
        // An unknown name is refused at once.
        let e = pair(&ring(BOB), &server).unwrap_err();
        assert!(e.contains("not in this server's keyring"), "{e}");
    }

    /// Every byte of every field of the transcript matters: a challenge or proof with any field
    /// changed (nonces, ids, epochs, the MAC itself) is refused, and an old transcript replayed
    /// against a fresh nonce is too.
    #[test]
    fn tampered_transcripts_are_refused() {
        let keyring = ring(ALICE);
        let server = ServerAuth::new(keyring.clone());
        let (first, _) = ClientAuth::start(&keyring, PeerId(1), Epoch(2), [1; 32]);
        let ControlFrame::AuthHello(h) = first else {
            panic!()
        };
        let (ch, _) = server.challenge(&h, PeerId(3), Epoch(4), [2; 32]).unwrap();
        let ControlFrame::AuthChallenge(good) = ch else {
            panic!()
        };
        let tamper: [fn(&mut AuthChallenge); 5] = [
            |c| c.peer_id.0 ^= 1,
            |c| c.epoch.0 ^= 1,
            |c| c.nonce[31] ^= 1,
            |c| c.mac[0] ^= 1,
            |c| c.mac[31] ^= 0x80,
        ];
        for (i, t) in tamper.iter().enumerate() {
            let mut c = good;
            t(&mut c);
            let (_, client) = ClientAuth::start(&keyring, PeerId(1), Epoch(2), [1; 32]);
            let e = client
                .on_reply(addr(), ControlFrame::AuthChallenge(c))
                .unwrap_err();
            assert!(matches!(e, Error::Authentication { .. }), "tamper {i}: {e}");
        }
        // A challenge answered to another client nonce (a replayed server transcript).
        let (_, client) = ClientAuth::start(&keyring, PeerId(1), Epoch(2), [9; 32]);
        assert!(
            client
                .on_reply(addr(), ControlFrame::AuthChallenge(good))
                .is_err()
        );
        // The client's proof replayed against a fresh server nonce.
        let (_, client) = ClientAuth::start(&keyring, PeerId(1), Epoch(2), [1; 32]);
        let (proof, _) = client
            .on_reply(addr(), ControlFrame::AuthChallenge(good))
            .unwrap();
        let ControlFrame::AuthProof(proof) = proof else {
            panic!()
        };
        let (_, fresh) = server.challenge(&h, PeerId(3), Epoch(4), [3; 32]).unwrap();
        assert!(server.verify(fresh, &proof).is_err());
        // The server's own MAC reflected as the client's proof.
        let (_, pending) = server.challenge(&h, PeerId(3), Epoch(4), [2; 32]).unwrap();
        assert!(
            server
                .verify(pending, &AuthProof { mac: good.mac })
                .is_err()
        );
        // The proof with the client claiming another id or epoch.
        for (id, ep) in [(PeerId(5), Epoch(2)), (PeerId(1), Epoch(6))] {
            let other = AuthHello {
                peer_id: id,
                epoch: ep,
                ..h.clone()
            };
            let (_, pending) = server
                .challenge(&other, PeerId(3), Epoch(4), [2; 32])
                .unwrap();
            assert!(server.verify(pending, &proof).is_err());
        }
        // Untouched, it passes.
        let (_, pending) = server.challenge(&h, PeerId(3), Epoch(4), [2; 32]).unwrap();
        assert!(server.verify(pending, &proof).is_ok());
    }

    #[test]
    fn forged_and_foreign_attaches_are_refused() {
        let server = ServerAuth::new(ring(ALICE));
        let (session, _) = pair(&ring(ALICE), &server).unwrap();
        let ControlFrame::AuthAttach(good) = session.attach(attach(0)) else {
            panic!()
        };
        let tamper: [fn(&mut AuthAttach); 6] = [
            |a| a.mac[5] ^= 1,
            |a| a.counter += 1,
            |a| a.session[0] ^= 1,
            |a| a.attach.stream_index += 1,
            |a| a.attach.peer_id.0 += 1,
            |a| a.attach.epoch.0 += 1,
        ];
        for (i, t) in tamper.iter().enumerate() {
            let mut a = good;
            t(&mut a);
            assert!(server.check_attach(&a, Epoch(4)).is_err(), "tamper {i}");
        }
        // A stranger who knows every id and epoch but not the session key.
        let stranger = AuthAttach {
            mac: [0; 32],
            ..good
        };
        assert!(server.check_attach(&stranger, Epoch(4)).is_err());
        // A session of another server (same key, other nonces) is unknown here.
        let other = ServerAuth::new(ring(ALICE));
        assert!(other.check_attach(&good, Epoch(4)).is_err());
        assert!(server.check_attach(&good, Epoch(4)).is_ok());
    }

    #[test]
    fn refusals_become_typed_client_errors() {
        let (_, c) = ClientAuth::start(&ring(ALICE), PeerId(1), Epoch(2), [1; 32]);
        let e = c
            .on_reply(
                addr(),
                ControlFrame::Reject(refuse(Epoch(1), "no key here".into())),
            )
            .unwrap_err();
        assert!(matches!(e, Error::Authentication { ref reason, .. } if reason == "no key here"));
        let (_, c) = ClientAuth::start(&ring(ALICE), PeerId(1), Epoch(2), [1; 32]);
        let e = c.on_reply(addr(), ControlFrame::StreamAccept).unwrap_err();
        assert!(matches!(e, Error::Malformed { .. }), "{e}");
    }

    fn session(name: &str) -> ServerSession {
        ServerSession {
            key: Key::new(&[0; 16]).unwrap(),
            name: name.into(),
            client: (PeerId(0), Epoch(0)),
            used: Used::new(),
        }
    }

    fn id(i: usize) -> [u8; 32] {
        let mut id = [0u8; 32];
        id[..8].copy_from_slice(&(i as u64).to_le_bytes());
        id
    }

    /// Each key name keeps at most `MAX_SESSIONS_PER_NAME` sessions, its own oldest forgotten
    /// first: a flood of handshakes under one name leaves the other names' sessions alone.
    #[test]
    fn the_session_table_is_bounded_per_name() {
        let mut s = Sessions::default();
        assert!(s.insert(id(0), session("bob")));
        for i in 1..=(MAX_SESSIONS_PER_NAME + 10) {
            assert!(s.insert(id(i), session("alice")));
        }
        assert_eq!(s.len_of("alice"), MAX_SESSIONS_PER_NAME);
        assert_eq!(s.len(), MAX_SESSIONS_PER_NAME + 1);
        assert!(s.map.contains_key(&id(0)), "bob's session was evicted");
        assert!(!s.map.contains_key(&id(1)), "alice's oldest was kept");
        assert!(s.map.contains_key(&id(MAX_SESSIONS_PER_NAME + 10)));
    }

    /// An id already taken is never replaced, by any name.
    #[test]
    fn a_session_is_never_replaced() {
        let mut s = Sessions::default();
        assert!(s.insert(id(7), session("bob")));
        assert!(!s.insert(id(7), session("alice")));
        assert_eq!(&*s.map[&id(7)].name, "bob");
        assert_eq!((s.len_of("alice"), s.len_of("bob")), (0, 1));
    }

    /// The server chooses the session id (its own nonce): a key holder that reuses another
    /// client's nonce gets a session of its own, and the first client's session keeps working.
    #[test]
    fn session_ids_are_the_servers_and_one_per_handshake() {
        let server = ServerAuth::new(ring(&format!("{ALICE}\n{BOB}")));
        let run = |keys: &str, client_nonce: [u8; 32], server_nonce: [u8; 32]| {
            let (first, c) = ClientAuth::start(&ring(keys), PeerId(1), Epoch(2), client_nonce);
            let ControlFrame::AuthHello(h) = first else {
                panic!()
            };
            let (challenge, pending) = server
                .challenge(&h, PeerId(3), Epoch(4), server_nonce)
                .unwrap();
            let (proof, session) = c.on_reply(addr(), challenge).unwrap();
            let ControlFrame::AuthProof(p) = proof else {
                panic!()
            };
            (server.verify(pending, &p), session)
        };
        let (name, alice) = run(ALICE, [1; 32], [2; 32]);
        assert_eq!(&*name.unwrap(), "alice");
        // Bob sends alice's nonce: his session gets the server's fresh nonce as its id.
        let (name, bob) = run(BOB, [1; 32], [3; 32]);
        assert_eq!(&*name.unwrap(), "bob");
        assert_eq!(server.session_count(), 2);
        let ControlFrame::AuthAttach(a) = alice.attach(attach(0)) else {
            panic!()
        };
        assert_eq!(
            a.session, [2; 32],
            "the session id is not the server's nonce"
        );
        assert_eq!(&*server.check_attach(&a, Epoch(4)).unwrap(), "alice");
        let ControlFrame::AuthAttach(b) = bob.attach(attach(0)) else {
            panic!()
        };
        assert_eq!(&*server.check_attach(&b, Epoch(4)).unwrap(), "bob");
        // A server nonce repeated (it never is: it is fresh) would not replace alice's session.
        let (refused, _) = run(BOB, [9; 32], [2; 32]);
        assert!(refused.unwrap_err().message.contains("taken"));
        let ControlFrame::AuthAttach(a) = alice.attach(attach(1)) else {
            panic!()
        };
        assert_eq!(&*server.check_attach(&a, Epoch(4)).unwrap(), "alice");
    }

    /// Runs a handshake in which the client expects `expect` (or nothing) of `server`.
    fn pair_expecting(
        client: &Keyring,
        server: &ServerAuth,
        expect: Option<ServerIdentity>,
    ) -> Result<(Session, Arc<str>), Error> {
        let (first, c) = ClientAuth::start_expecting(client, PeerId(1), Epoch(2), nonce(), expect);
        let challenge = match (&first, expect) {
            (ControlFrame::AuthHello(h), None) => server.challenge(h, PeerId(3), Epoch(4), nonce()),
            (ControlFrame::AuthHelloIdentified(h), Some(_)) => {
                server.challenge_identified(h, PeerId(3), Epoch(4), nonce())
            }
            _ => panic!("{first:?} for {expect:?}"),
        };
        let (challenge, pending) = challenge.map_err(|r| Error::Authentication {
            peer: addr().to_string(),
            reason: r.message,
        })?;
        let (proof, session) = c.on_reply(addr(), challenge)?;
        let ControlFrame::AuthProof(p) = proof else {
            panic!("{proof:?}")
        };
        let name = server
            .verify(pending, &p)
            .map_err(|r| Error::Authentication {
                peer: addr().to_string(),
                reason: r.message,
            })?;
        Ok((session, name))
    }

    /// Two servers hold alice's key; only one holds the identity alice expects. The other one
    /// passes the key's proof and is refused for its identity; a server with no identity, or
    /// one that replays the right server's signature, is refused too; the right one passes.
    #[test]
    fn a_key_holder_without_the_expected_identity_is_refused() {
        let (a_key, b_key) = (
            IdentityKey::from_seed(&[0xa; 32]),
            IdentityKey::from_seed(&[0xb; 32]),
        );
        let expected = a_key.public();
        let server_a = ServerAuth::new(ring(ALICE)).with_identity(a_key);
        let server_b = ServerAuth::new(ring(ALICE)).with_identity(b_key.clone());
        let server_none = ServerAuth::new(ring(ALICE));
        assert_eq!(server_a.identity(), Some(expected));
        let (_, name) = pair_expecting(&ring(ALICE), &server_a, Some(expected)).unwrap();
        assert_eq!(&*name, "alice");
        assert_eq!(server_a.session_count(), 1);
        for (server, why) in [
            (&server_b, b_key.public().to_string()),
            (&server_none, "proved no identity".to_owned()),
        ] {
            let e = pair_expecting(&ring(ALICE), server, Some(expected)).unwrap_err();
            let text = e.to_string();
            assert!(
                matches!(&e, Error::ServerIdentity { addr, expected: x, reason }
                    if addr == "127.0.0.1:7" && *x == expected.to_string()
                        && reason.contains(&why) && reason.contains("peer")),
                "{text}"
            );
            assert_eq!(server.session_count(), 0, "{text}");
        }
        // B names A's identity and copies a signature A made for another transcript.
        let (first, _) =
            ClientAuth::start_expecting(&ring(ALICE), PeerId(1), Epoch(2), [1; 32], Some(expected));
        let ControlFrame::AuthHelloIdentified(h) = first else {
            panic!()
        };
        let (a_answer, _) = server_a
            .challenge_identified(&h, PeerId(3), Epoch(4), [2; 32])
            .unwrap();
        let ControlFrame::SignedChallenge(a_signed) = a_answer else {
            panic!("{a_answer:?}")
        };
        let (b_answer, _) = server_b
            .challenge_identified(&h, PeerId(3), Epoch(4), [3; 32])
            .unwrap();
        let ControlFrame::SignedChallenge(b_signed) = b_answer else {
            panic!()
        };
        let forged = SignedChallenge {
            identity: a_signed.identity,
            signature: a_signed.signature,
            ..b_signed
        };
        let (_, c) =
            ClientAuth::start_expecting(&ring(ALICE), PeerId(1), Epoch(2), [1; 32], Some(expected));
        let e = c
            .on_reply(addr(), ControlFrame::SignedChallenge(forged))
            .unwrap_err();
        assert!(
            matches!(&e, Error::ServerIdentity { reason, .. } if reason.contains("does not verify")),
            "{e}"
        );
        // A's own answer, tampered anywhere, is refused; untouched, it passes.
        let tamper: [fn(&mut SignedChallenge); 3] = [
            |s| s.signature[0] ^= 1,
            |s| s.identity[0] ^= 1,
            |s| s.challenge.epoch.0 ^= 1,
        ];
        for (i, t) in tamper.iter().enumerate() {
            let mut s = a_signed;
            t(&mut s);
            let (_, c) = ClientAuth::start_expecting(
                &ring(ALICE),
                PeerId(1),
                Epoch(2),
                [1; 32],
                Some(expected),
            );
            assert!(
                c.on_reply(addr(), ControlFrame::SignedChallenge(s))
                    .is_err(),
                "tamper {i}"
            );
        }
        let (_, c) =
            ClientAuth::start_expecting(&ring(ALICE), PeerId(1), Epoch(2), [1; 32], Some(expected));
        assert!(
            c.on_reply(addr(), ControlFrame::SignedChallenge(a_signed))
                .is_ok()
        );
    }

    /// Without an expected identity the handshake is the old one, byte for byte: a plain
    /// `AuthHello`, a plain challenge even from a server with an identity, and a signed answer
    /// it did not ask for is not taken.
    #[test]
    fn without_an_expected_identity_the_handshake_is_unchanged() {
        let identity = IdentityKey::from_seed(&[0xa; 32]);
        let plain = ServerAuth::new(ring(ALICE));
        let with = ServerAuth::new(ring(ALICE)).with_identity(identity.clone());
        let (old, _) = ClientAuth::start(&ring(ALICE), PeerId(1), Epoch(2), [1; 32]);
        let (new, _) =
            ClientAuth::start_expecting(&ring(ALICE), PeerId(1), Epoch(2), [1; 32], None);
        assert_eq!(old, new);
        let ControlFrame::AuthHello(h) = &old else {
            panic!()
        };
        let (a, _) = plain.challenge(h, PeerId(3), Epoch(4), [2; 32]).unwrap();
        let (b, _) = with.challenge(h, PeerId(3), Epoch(4), [2; 32]).unwrap();
        assert_eq!(a, b);
        assert!(matches!(a, ControlFrame::AuthChallenge(_)));
        for server in [&plain, &with] {
            assert!(pair_expecting(&ring(ALICE), server, None).is_ok());
        }
        let (signed, _) = with
            .challenge_identified(h, PeerId(3), Epoch(4), [2; 32])
            .unwrap();
        let (_, c) = ClientAuth::start(&ring(ALICE), PeerId(1), Epoch(2), [1; 32]);
        let e = c.on_reply(addr(), signed).unwrap_err();
        assert!(matches!(e, Error::Malformed { .. }), "{e}");
    }

    /// Counters are accepted once each, below the session's limit, in any order.
    #[test]
    fn attach_counters_are_bounded_and_used_once() {
        let mut u = Used::new();
        assert_eq!(u.take(5), Some(true));
        assert_eq!(u.take(0), Some(true));
        assert_eq!(u.take(5), Some(false));
        let last = MAX_ATTACHES_PER_SESSION as u64 - 1;
        assert_eq!(u.take(last), Some(true));
        assert_eq!(u.take(last + 1), None);
        assert_eq!(u.take(u64::MAX), None);
    }
}

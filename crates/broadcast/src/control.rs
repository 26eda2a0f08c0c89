//! The control service every member runs beside its Ferry listener: one JSON object per line
//! over TCP, each request answered by one line.
//!
//! Requests: `manifest` (the source answers with the manifest of the version asked for, or of
//! its newest, and its epoch), `progress` (the member's verified prefix of the version it
//! holds, answered once it passes `after` or after `wait_ms`: a long poll that lets a child
//! follow its parent chunk by chunk), `layout` (where a receiver holds each segment, so that
//! a child can read its chunks from the receiver's own destinations), and, at a source running the embedded
//! discovery, `join`, `heartbeat`, `members` and `leave` (the tracker, see
//! [`discovery`](crate::discovery)). Every answer carries the answering member's source epoch.
//! Lines are capped in length before they are parsed (requests at [`MAX_REQUEST`], answers,
//! which carry manifests, at a manifest's limit); a bad line is answered with an error and
//! closes that connection.
//!
//! **Keys.** A member given a keyring authenticates every connection to its control service
//! before it answers anything on it: `auth_hello` and `auth_proof` carry the engine's own
//! challenge-response (`ferry::core_types::auth`, HMAC-SHA256 over both nonces, both ids and
//! the key name; the same code the data plane's handshake runs), and any other request before
//! the proof is refused and closes the connection. A client given a keyring refuses a member
//! that cannot prove the key.
//!
//! **Before the proof** (a keyless member: before the first request), a connection costs a
//! stranger little, through the same gate as the data planes' listeners
//! ([`ferry::HandshakeGate`], [`ferry::HandshakeLimits`]): at most `max_pending` such connections
//! at once (one accepted past them is closed at once), all of it within `timeout` of the accept
//! (else closed), and request lines of at most [`MAX_PREAUTH_REQUEST`] bytes on a keyed member.
//! Accept errors (out of descriptors) back off instead of spinning.
//!
//! **Entries are their members'.** The tracker answers a `join` with a secret token of the
//! new entry (32 random bytes); a heartbeat or a leave of that entry must carry it, and a join
//! under an id already listed must too, so no one else can renew, move or remove it. Receivers
//! only: a join claiming the source's role is refused. At most [`MAX_MEMBERS`] are listed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use ferry::core_types::auth::{ClientAuth, PendingProof, ServerAuth, nonce};
use ferry::core_types::wire::{AuthChallenge, AuthProof, ControlFrame};
use ferry::{Epoch, HandshakeGate, HandshakeLimits, HandshakeSlot, Keyring, PeerId};

use crate::error::BroadcastError;
use crate::layout::Extent;
use crate::manifest::{Digest, MAX_MANIFEST_BYTES, Manifest};
use crate::plan::{Member, Role};

/// Longest answer accepted (a manifest answer is the longest).
const MAX_LINE: usize = MAX_MANIFEST_BYTES + (1 << 20);
/// Longest request a control service reads: requests are small (a member's entry at most).
pub(crate) const MAX_REQUEST: usize = 64 << 10;
/// Longest request a keyed control service reads before the connection proved its key (the
/// authentication requests are under 300 bytes).
pub(crate) const MAX_PREAUTH_REQUEST: usize = 1024;
/// Most members the embedded tracker lists (the source included); joins past it are refused.
pub(crate) const MAX_MEMBERS: usize = 4096;

/// 32 bytes as 64 hex digits on the wire (nonces, MACs, entry tokens).
pub(crate) type Hex32 = Digest;
/// Longest wait of one progress poll.
const MAX_WAIT: Duration = Duration::from_secs(10);

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

/// The embedded discovery's membership list, kept by the source: a member is listed while its
/// heartbeats arrive within the lease.
#[derive(Debug)]
pub(crate) struct Tracker {
    lease: Duration,
    inner: Mutex<TrackerInner>,
}

#[derive(Debug, Default)]
struct TrackerInner {
    next: u64,
    /// Per version: the next [`Member::number`] to deal (a number is never dealt twice).
    numbers: HashMap<u64, u64>,
    /// Each entry, when its lease ends (never, for the source) and its token.
    members: HashMap<String, (Member, Option<Instant>, [u8; 32])>,
}

/// The next number of `version` in `numbers` (from 0), now dealt.
fn deal(numbers: &mut HashMap<u64, u64>, version: u64) -> u64 {
    let next = numbers.entry(version).or_insert(0);
    *next += 1;
    *next - 1
}

/// Whether `a` and `b` are equal, in time that does not depend on where they differ.
fn same_token(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Tracker {
    /// A list holding `source` for good.
    pub(crate) fn new(source: Member, lease: Duration) -> Self {
        let mut inner = TrackerInner {
            next: 1,
            ..Default::default()
        };
        let mut source = source;
        source.order = 0;
        // The source's token is never handed out: no request can touch its entry.
        inner
            .members
            .insert(source.id.clone(), (source, None, nonce()));
        Self {
            lease,
            inner: Mutex::new(inner),
        }
    }

    /// A join at `now`: lists `m` and returns its entry's token. Refused: a member claiming
    /// the source's role, a join under an id already listed without that entry's token, and a
    /// new entry past [`MAX_MEMBERS`].
    pub(crate) fn join(
        &self,
        m: Member,
        token: Option<[u8; 32]>,
        now: Instant,
    ) -> Result<[u8; 32], String> {
        self.renew(m, token, now, true)
    }

    /// A heartbeat at `now`: renews `m`'s entry (its order kept from its first join), which
    /// `token` must be the token of; an entry whose lease ran out is listed again under it.
    pub(crate) fn heartbeat(
        &self,
        m: Member,
        token: Option<[u8; 32]>,
        now: Instant,
    ) -> Result<(), String> {
        let Some(t) = token else {
            return Err(format!(
                "heartbeat for member {} refused: it carries no token of the entry",
                m.id
            ));
        };
        self.renew(m, Some(t), now, false).map(|_| ())
    }

    fn renew(
        &self,
        mut m: Member,
        token: Option<[u8; 32]>,
        now: Instant,
        fresh_token: bool,
    ) -> Result<[u8; 32], String> {
        if m.role == Role::Source {
            return Err(format!(
                "member {} refused: only the source itself is listed as the source",
                m.id
            ));
        }
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        g.members
            .retain(|_, (_, expires, _)| expires.is_none_or(|e| e > now));
        let g = &mut *g;
        let (order, number, token) = match g.members.get(&m.id) {
            Some((old, _, t)) => {
                if !token.is_some_and(|given| same_token(&given, t)) {
                    return Err(format!(
                        "member {} is listed already: only it may renew, move or remove its entry",
                        m.id
                    ));
                }
                // A member keeps its number while it pulls one version (whatever it sends).
                let number = match old.number {
                    Some(k) if old.version == m.version => k,
                    _ => deal(&mut g.numbers, m.version),
                };
                (old.order, number, *t)
            }
            None => {
                if g.members.len() >= MAX_MEMBERS {
                    return Err(format!(
                        "member {} refused: {MAX_MEMBERS} members are listed, the most there may be",
                        m.id
                    ));
                }
                let t = match (token, fresh_token) {
                    (Some(t), false) => t,
                    _ => nonce(),
                };
                g.next += 1;
                let number = deal(&mut g.numbers, m.version);
                (g.next - 1, number, t)
            }
        };
        m.order = order;
        m.number = Some(number);
        g.members
            .insert(m.id.clone(), (m, Some(now + self.lease), token));
        Ok(token)
    }

    /// Drops the entry `id`, if `token` is its token (an entry not listed is gone already).
    pub(crate) fn leave(&self, id: &str, token: Option<[u8; 32]>) -> Result<(), String> {
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        match g.members.get(id) {
            None => Ok(()),
            Some((_, _, t)) if token.is_some_and(|given| same_token(&given, t)) => {
                g.members.remove(id);
                Ok(())
            }
            Some(_) => Err(format!(
                "leave for member {id} refused: only it may remove its entry"
            )),
        }
    }

    /// The members whose lease has not expired at `now`, in join order.
    pub(crate) fn members(&self, now: Instant) -> Vec<Member> {
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        g.members
            .retain(|_, (_, expires, _)| expires.is_none_or(|e| e > now));
        let mut v: Vec<Member> = g.members.values().map(|(m, _, _)| m.clone()).collect();
        v.sort_by_key(|m| m.order);
        v
    }
}

/// What a control service answers from.
#[derive(Debug)]
pub(crate) struct CtlState {
    pub(crate) source_epoch: u64,
    /// At a source: the versions it publishes, oldest first.
    pub(crate) manifests: Mutex<Vec<Manifest>>,
    /// The version this member's progress and layout are of.
    pub(crate) version: u64,
    /// At a receiver: where it holds each segment.
    pub(crate) layout: Option<Vec<Vec<Extent>>>,
    /// At a source: where it holds the segments of the versions not served under their own
    /// names (files published again as a new version); the others are the identity.
    pub(crate) source_layouts: Mutex<HashMap<u64, Vec<Vec<Extent>>>>,
    pub(crate) progress: watch::Receiver<Progress>,
    pub(crate) tracker: Option<Arc<Tracker>>,
    /// With keys: the engine's server side of the challenge-response, and the id and epoch
    /// this member answers as. Every connection proves a key before anything else is answered.
    pub(crate) auth: Option<(ServerAuth, PeerId, Epoch)>,
}

/// A member's running control service. Dropping it closes its listener before `drop` returns
/// (so the address can be bound again at once, as a restarted source does) and ends its
/// connections with its task.
#[derive(Debug)]
pub(crate) struct Service {
    /// The listener, shared with the accept loop, which polls it under this lock only for the
    /// moment of one `poll_accept`; `None` once dropped.
    listener: Arc<Mutex<Option<TcpListener>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Service {
    /// Serves the control protocol on `listener`, with the data planes' default pre-proof
    /// limits. Must be called inside a tokio runtime.
    pub(crate) fn start(listener: TcpListener, state: Arc<CtlState>) -> Self {
        Self::start_with(listener, state, HandshakeLimits::default())
    }

    /// Serves the control protocol on `listener`, with `limits` before the proof.
    pub(crate) fn start_with(
        listener: TcpListener,
        state: Arc<CtlState>,
        limits: HandshakeLimits,
    ) -> Self {
        let listener = Arc::new(Mutex::new(Some(listener)));
        let gate = HandshakeGate::new(limits);
        let task = tokio::spawn(serve(listener.clone(), state, gate));
        Self { listener, task }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        // Closing the socket here, not when the runtime gets to drop the aborted task, is what
        // frees the port before `drop` returns.
        drop(lock(&self.listener).take());
        self.task.abort();
    }
}

/// Serves the control protocol until the listener is taken away or the task is aborted; its
/// connections end with it (they live in its `JoinSet`), so a stopped member answers nothing.
/// The lock of a poisoned mutex is still the data (nothing here is left half-updated).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn serve(
    listener: Arc<Mutex<Option<TcpListener>>>,
    state: Arc<CtlState>,
    gate: Arc<HandshakeGate>,
) {
    let mut conns = tokio::task::JoinSet::new();
    let fresh = || ferry::core_types::backoff::Backoff::random(ACCEPT_BACKOFF, ACCEPT_BACKOFF_MAX);
    let mut backoff = fresh();
    let accept = || {
        std::future::poll_fn(|cx| match lock(&listener).as_ref() {
            Some(l) => l.poll_accept(cx).map(Some),
            None => std::task::Poll::Ready(None),
        })
    };
    loop {
        tokio::select! {
            accepted = accept() => {
                let Some(accepted) = accepted else { return };
                let (stream, from) = match accepted {
                    Ok(a) => {
                        if backoff.attempts() > 0 {
                            backoff = fresh();
                        }
                        a
                    }
                    Err(e) => {
                        // Out of descriptors, say: wait before the next accept instead of
                        // spinning on the same error.
                        let wait = backoff.next_delay();
                        tracing::warn!(error = %e, ?wait, "control service: accept failed");
                        tokio::time::sleep(wait).await;
                        continue;
                    }
                };
                let Some(slot) = gate.admit() else {
                    tracing::debug!(%from, "control connection refused: too many before their proof");
                    continue;
                };
                let (state, gate) = (state.clone(), gate.clone());
                conns.spawn(async move {
                    if let Err(e) = serve_conn(stream, &state, slot, &gate).await {
                        tracing::debug!(%from, error = %e, "control connection ended");
                    }
                });
            }
            Some(_) = conns.join_next() => {}
        }
    }
}

/// Where a connection stands with the member's keys.
enum ConnAuth {
    /// Keyless member: everything is answered.
    Open,
    /// Keyed: nothing proven yet.
    Unproven,
    /// Keyed: challenge sent, proof awaited.
    Challenged(PendingProof),
    /// Keyed: the key of this name was proven.
    Proven,
}

fn refused(message: String) -> (Reply, bool) {
    (Reply::Error { message }, true)
}

/// The challenge-response steps, and every request before the proof: `None` for a request
/// to answer as usual.
fn authenticate(req: &Request, conn: &mut ConnAuth, state: &CtlState) -> Option<(Reply, bool)> {
    let Some((server, id, epoch)) = &state.auth else {
        return match req {
            Request::AuthHello { .. } | Request::AuthProof { .. } => Some(refused(
                "this member takes no key (it was started without one)".into(),
            )),
            _ => None,
        };
    };
    match (req, std::mem::replace(conn, ConnAuth::Unproven)) {
        (
            Request::AuthHello {
                name,
                peer_id,
                epoch: client_epoch,
                nonce: client_nonce,
            },
            ConnAuth::Unproven,
        ) => {
            let Ok(pid) = u128::from_str_radix(peer_id, 16) else {
                return Some(refused("auth_hello: the peer id is not hex".into()));
            };
            let hello = ferry::core_types::wire::AuthHello {
                name: name.clone(),
                peer_id: PeerId(pid),
                epoch: Epoch(*client_epoch),
                nonce: client_nonce.0,
            };
            match server.challenge(&hello, *id, *epoch, nonce()) {
                Ok((ControlFrame::AuthChallenge(c), pending)) => {
                    *conn = ConnAuth::Challenged(pending);
                    Some((
                        Reply::AuthChallenge {
                            peer_id: format!("{:032x}", c.peer_id.0),
                            epoch: c.epoch.0,
                            nonce: Digest(c.nonce),
                            mac: Digest(c.mac),
                        },
                        false,
                    ))
                }
                Ok(_) => Some(refused("authentication failed".into())),
                Err(r) => Some(refused(r.message)),
            }
        }
        (Request::AuthProof { mac }, ConnAuth::Challenged(pending)) => {
            match server.verify(pending, &AuthProof { mac: mac.0 }) {
                Ok(name) => {
                    tracing::debug!(key = %name, "control connection authenticated");
                    *conn = ConnAuth::Proven;
                    Some((
                        Reply::Ok {
                            source_epoch: state.source_epoch,
                        },
                        false,
                    ))
                }
                Err(r) => Some(refused(r.message)),
            }
        }
        (Request::AuthHello { .. } | Request::AuthProof { .. }, _) => {
            Some(refused("authentication out of order".into()))
        }
        (_, ConnAuth::Proven) => {
            *conn = ConnAuth::Proven;
            None
        }
        (_, _) => Some(refused(
            "unauthenticated: this broadcast is keyed; requests need its key \
             (--auth-key-file, FERRY_AUTH_KEY_FILE)"
                .into(),
        )),
    }
}

/// The first wait after an accept error, and the longest.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

async fn serve_conn(
    stream: TcpStream,
    state: &CtlState,
    slot: HandshakeSlot,
    gate: &HandshakeGate,
) -> std::io::Result<()> {
    let _ = stream.set_nodelay(true);
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    let keyed = state.auth.is_some();
    let mut conn = if keyed {
        ConnAuth::Unproven
    } else {
        ConnAuth::Open
    };
    // Until the proof (keyless: the first request), the connection holds its place at the gate
    // and runs against its deadline.
    let mut slot = Some(slot);
    let deadline = tokio::time::Instant::now() + gate.limits().timeout;
    loop {
        let line = if slot.is_some() {
            let limit = if keyed {
                MAX_PREAUTH_REQUEST
            } else {
                MAX_REQUEST
            };
            match tokio::time::timeout_at(deadline, read_line(&mut r, limit)).await {
                Ok(line) => line?,
                Err(_) => {
                    gate.note_timeout();
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no proof (or request) within the pre-authentication deadline",
                    ));
                }
            }
        } else {
            read_line(&mut r, MAX_REQUEST).await?
        };
        let Some(line) = line else { break };
        let (reply, close) = match serde_json::from_slice::<Request>(&line) {
            Ok(req) => match authenticate(&req, &mut conn, state) {
                Some(r) => r,
                None => {
                    // Answerable: proven (or keyless), so past the gate. A long poll's answer
                    // may take longer than the pre-proof deadline.
                    slot = None;
                    (answer(req, state).await, false)
                }
            },
            Err(e) => (
                Reply::Error {
                    message: format!("bad request: {e}"),
                },
                true,
            ),
        };
        let mut out = serde_json::to_vec(&reply).map_err(std::io::Error::other)?;
        out.push(b'\n');
        let write = w.write_all(&out);
        if slot.is_some() {
            // A stranger that does not read its answer is held to the deadline too.
            tokio::time::timeout_at(deadline, write)
                .await
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
        } else {
            write.await?;
        }
        if close {
            return Ok(());
        }
        if matches!(conn, ConnAuth::Proven | ConnAuth::Open) {
            slot = None;
        }
    }
    Ok(())
}

async fn answer(req: Request, state: &CtlState) -> Reply {
    let source_epoch = state.source_epoch;
    let no_tracker = || Reply::Error {
        message: "this member keeps no membership list (not a source with embedded discovery)"
            .into(),
    };
    match req {
        Request::Manifest { version } => {
            let ms = lock(&state.manifests);
            let found = match version {
                Some(v) => ms.iter().find(|m| m.version == v),
                None => ms.last(),
            };
            match (found, ms.is_empty()) {
                (Some(m), _) => Reply::Manifest {
                    source_epoch,
                    manifest: m.clone(),
                },
                (None, true) => Reply::Error {
                    message: "only the source serves the manifest".into(),
                },
                (None, false) => Reply::Error {
                    message: format!(
                        "version {} of {:?} is not published here (versions kept: {:?})",
                        version.unwrap_or_default(),
                        ms[0].name,
                        ms.iter().map(|m| m.version).collect::<Vec<_>>()
                    ),
                },
            }
        }
        Request::Layout { version } => match &state.layout {
            Some(l) => Reply::Layout {
                source_epoch,
                version: state.version,
                segments: l.clone(),
            },
            None => {
                let ms = lock(&state.manifests);
                let m = match version {
                    Some(v) => ms.iter().find(|m| m.version == v),
                    None => ms.last(),
                };
                match m {
                    Some(m) => Reply::Layout {
                        source_epoch,
                        version: m.version,
                        segments: lock(&state.source_layouts)
                            .get(&m.version)
                            .cloned()
                            .unwrap_or_else(|| crate::layout::identity(m)),
                    },
                    None => Reply::Error {
                        message: format!(
                            "version {} is not published here",
                            version.unwrap_or_default()
                        ),
                    },
                }
            }
        },
        Request::Progress {
            after,
            wait_ms,
            after_count,
        } => {
            let mut rx = state.progress.clone();
            let wait = Duration::from_millis(wait_ms).min(MAX_WAIT);
            let moved = |p: &Progress| match after_count {
                Some(n) => p.count > n || p.done,
                None => p.prefix > after || p.done,
            };
            let _ = tokio::time::timeout(wait, rx.wait_for(moved)).await;
            let p = rx.borrow().clone();
            Reply::Progress {
                source_epoch,
                prefix: p.prefix,
                done: p.done,
                version: state.version,
                count: p.count,
                stripes: p.stripes,
            }
        }
        Request::Join { member, token } => match &state.tracker {
            Some(t) if member.source_epoch == source_epoch => {
                match t.join(member, token.map(|t| t.0), Instant::now()) {
                    Ok(token) => Reply::Joined {
                        source_epoch,
                        token: Digest(token),
                    },
                    Err(message) => Reply::Error { message },
                }
            }
            // A member of another source epoch is not listed; it learns the epoch here.
            Some(_) => Reply::Ok { source_epoch },
            None => no_tracker(),
        },
        Request::Heartbeat { member, token } => match &state.tracker {
            Some(t) if member.source_epoch == source_epoch => {
                match t.heartbeat(member, token.map(|t| t.0), Instant::now()) {
                    Ok(()) => Reply::Ok { source_epoch },
                    Err(message) => Reply::Error { message },
                }
            }
            Some(_) => Reply::Ok { source_epoch },
            None => no_tracker(),
        },
        Request::Members => match &state.tracker {
            Some(t) => Reply::Members {
                source_epoch,
                members: t.members(Instant::now()),
            },
            None => no_tracker(),
        },
        Request::Leave { id, token } => match &state.tracker {
            Some(t) => match t.leave(&id, token.map(|t| t.0)) {
                Ok(()) => Reply::Ok { source_epoch },
                Err(message) => Reply::Error { message },
            },
            None => no_tracker(),
        },
        // Answered by `authenticate`.
        Request::AuthHello { .. } | Request::AuthProof { .. } => Reply::Error {
            message: "authentication out of order".into(),
        },
    }
}

/// Reads one `\n`-terminated line of at most `limit` bytes (`None` at a clean end).
async fn read_line<R: AsyncRead + Unpin>(
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

/// One connection to a member's control service.
#[derive(Debug)]
pub(crate) struct CtlClient {
    addr: String,
    r: BufReader<tokio::net::tcp::OwnedReadHalf>,
    w: tokio::net::tcp::OwnedWriteHalf,
    local: SocketAddr,
}

impl CtlClient {
    /// Connects within `timeout` and, with `keys`, proves the first key (and checks the
    /// member's proof) before anything else: a member that cannot prove it is an error
    /// (`ferry::Error::Authentication`, or the member's refusal).
    pub(crate) async fn connect_keyed(
        addr: &str,
        timeout: Duration,
        keys: Option<&Keyring>,
    ) -> Result<Self, BroadcastError> {
        let mut c = Self::connect(addr, timeout).await?;
        if let Some(k) = keys {
            c.authenticate(k, timeout).await?;
        }
        Ok(c)
    }

    /// The engine's challenge-response, client side, over this connection.
    async fn authenticate(
        &mut self,
        keys: &Keyring,
        timeout: Duration,
    ) -> Result<(), BroadcastError> {
        let addr = self.addr.clone();
        let err = |reason: &str| BroadcastError::Control {
            addr: addr.clone(),
            reason: reason.to_owned(),
        };
        let (hello, client) = ClientAuth::start(keys, PeerId::random(), Epoch::fresh(), nonce());
        let ControlFrame::AuthHello(h) = hello else {
            return Err(err("the handshake did not start with a hello"));
        };
        let req = Request::AuthHello {
            name: h.name,
            peer_id: format!("{:032x}", h.peer_id.0),
            epoch: h.epoch.0,
            nonce: Digest(h.nonce),
        };
        let Reply::AuthChallenge {
            peer_id,
            epoch,
            nonce: server_nonce,
            mac,
        } = self.call(&req, timeout).await?
        else {
            return Err(err("answered auth_hello with something else"));
        };
        let peer_id = u128::from_str_radix(&peer_id, 16)
            .map_err(|_| err("auth_challenge: the peer id is not hex"))?;
        let peer = addr.parse().unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
        let challenge = ControlFrame::AuthChallenge(AuthChallenge {
            peer_id: PeerId(peer_id),
            epoch: Epoch(epoch),
            nonce: server_nonce.0,
            mac: mac.0,
        });
        let (proof, _session) = client.on_reply(peer, challenge)?;
        let ControlFrame::AuthProof(p) = proof else {
            return Err(err("the handshake ended without a proof"));
        };
        match self
            .call(&Request::AuthProof { mac: Digest(p.mac) }, timeout)
            .await?
        {
            Reply::Ok { .. } => Ok(()),
            _ => Err(err("answered auth_proof with something else")),
        }
    }

    /// Connects within `timeout`, with no key.
    pub(crate) async fn connect(addr: &str, timeout: Duration) -> Result<Self, BroadcastError> {
        let err = |reason: String| BroadcastError::Control {
            addr: addr.to_owned(),
            reason,
        };
        let stream = tokio::time::timeout(timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| err(format!("connect timed out after {timeout:?}")))?
            .map_err(|e| err(format!("connect: {e}")))?;
        let _ = stream.set_nodelay(true);
        let local = stream.local_addr().map_err(|e| err(e.to_string()))?;
        let (r, w) = stream.into_split();
        Ok(Self {
            addr: addr.to_owned(),
            r: BufReader::new(r),
            w,
            local,
        })
    }

    /// This end's address (the address the member sees us from).
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Sends `req` and reads the answer within `timeout`; an `error` answer is an error.
    pub(crate) async fn call(
        &mut self,
        req: &Request,
        timeout: Duration,
    ) -> Result<Reply, BroadcastError> {
        let addr = self.addr.clone();
        let err = |reason: String| BroadcastError::Control {
            addr: addr.clone(),
            reason,
        };
        let mut line = serde_json::to_vec(req).map_err(|e| err(e.to_string()))?;
        line.push(b'\n');
        let exchange = async {
            self.w.write_all(&line).await?;
            read_line(&mut self.r, MAX_LINE).await
        };
        let answer = tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| err(format!("no answer within {timeout:?}")))?
            .map_err(|e| err(e.to_string()))?
            .ok_or_else(|| err("connection closed".into()))?;
        let reply: Reply = serde_json::from_slice(&answer)
            .map_err(|e| err(format!("{} ({e})", not_control(&answer))))?;
        match reply {
            Reply::Error { message } => Err(err(message)),
            Reply::Manifest {
                manifest,
                source_epoch,
            } => match manifest.validate() {
                Err(source) => Err(BroadcastError::ManifestFrom { addr, source }),
                Ok(()) => Ok(Reply::Manifest {
                    source_epoch,
                    manifest,
                }),
            },
            r => Ok(r),
        }
    }
}

/// What answered a control request with something that is not a control reply, in words a
/// user can act on: the port is another service's.
pub(crate) fn not_control(answer: &[u8]) -> &'static str {
    let html = answer.trim_ascii_start().first() == Some(&b'<');
    if answer.starts_with(b"HTTP/") || html {
        "an HTTP server answered, not a `ferry publish` control port (Ferry's metrics port \
         answers HTTP too; the control port is 7500 unless --listen says otherwise)"
    } else if answer.starts_with(b"FRRY") {
        "a Ferry engine's data port answered, not a `ferry publish` control port (pull from \
         the address `ferry publish` prints after `control`; 7500 unless --listen says otherwise)"
    } else {
        "not a `ferry publish` control port (bad answer)"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: &str, role: Role) -> Member {
        Member {
            id: id.into(),
            epoch: 1,
            source_epoch: 5,
            data_addr: String::new(),
            ctl_addr: String::new(),
            role,
            progress: 0,
            done: false,
            order: 99,
            version: 1,
            rate: 0,
            number: None,
        }
    }

    #[test]
    fn tracker_orders_by_first_join_and_expires_silent_members() {
        let t0 = Instant::now();
        let t = Tracker::new(member("s", Role::Source), Duration::from_secs(2));
        let ta = t.join(member("a", Role::Receiver), None, t0).unwrap();
        t.join(member("b", Role::Receiver), None, t0).unwrap();
        t.heartbeat(
            member("a", Role::Receiver),
            Some(ta),
            t0 + Duration::from_secs(1),
        )
        .unwrap();
        let ids = |v: Vec<Member>| v.into_iter().map(|m| (m.id, m.order)).collect::<Vec<_>>();
        assert_eq!(
            ids(t.members(t0)),
            [("s".into(), 0), ("a".into(), 1), ("b".into(), 2)]
        );
        // b's lease ran out; a heartbeated; the source never expires.
        assert_eq!(
            ids(t.members(t0 + Duration::from_millis(2500))),
            [("s".into(), 0), ("a".into(), 1)]
        );
        t.leave("a", Some(ta)).unwrap();
        assert!(t.leave("s", Some(ta)).is_err());
        assert_eq!(ids(t.members(t0)), [("s".into(), 0)]);
    }

    #[test]
    fn tracker_numbers_each_version_from_zero_and_a_member_keeps_its_number() {
        let t0 = Instant::now();
        let t = Tracker::new(member("s", Role::Source), Duration::from_secs(60));
        let mut forged = member("a", Role::Receiver);
        forged.number = Some(7); // what a member claims is not what it is dealt
        let ta = t.join(forged, None, t0).unwrap();
        let tb = t.join(member("b", Role::Receiver), None, t0).unwrap();
        let mut v2 = member("c", Role::Receiver);
        v2.version = 2;
        t.join(v2, None, t0).unwrap();
        t.join(member("d", Role::Receiver), None, t0).unwrap();
        t.leave("b", Some(tb)).unwrap();
        let mut a = member("a", Role::Receiver);
        a.number = Some(0);
        a.progress = 5;
        t.heartbeat(a, Some(ta), t0).unwrap();
        t.join(member("e", Role::Receiver), None, t0).unwrap();
        let numbers = |v: Vec<Member>| {
            v.into_iter()
                .map(|m| (m.id, m.version, m.number))
                .collect::<Vec<_>>()
        };
        // b's number is not dealt again: a and d keep theirs, e takes the next.
        assert_eq!(
            numbers(t.members(t0)),
            [
                ("s".into(), 1, None),
                ("a".into(), 1, Some(0)),
                ("c".into(), 2, Some(0)),
                ("d".into(), 1, Some(2)),
                ("e".into(), 1, Some(3)),
            ]
        );
        // A member that moves to another version is numbered in it.
        let mut a2 = member("a", Role::Receiver);
        a2.version = 2;
        t.heartbeat(a2, Some(ta), t0).unwrap();
        let a = t.members(t0).into_iter().find(|m| m.id == "a");
        assert_eq!(a.and_then(|m| m.number), Some(1));
    }

    #[test]
    fn only_a_member_renews_moves_or_removes_its_entry() {
        let t0 = Instant::now();
        let t = Tracker::new(member("s", Role::Source), Duration::from_secs(2));
        let ta = t.join(member("a", Role::Receiver), None, t0).unwrap();
        let mut moved = member("a", Role::Receiver);
        moved.data_addr = "10.0.0.66:1".into();
        // Without the token, or with another entry's: refused, the entry unchanged.
        let tb = t.join(member("b", Role::Receiver), None, t0).unwrap();
        for token in [None, Some(tb), Some([0; 32])] {
            assert!(t.heartbeat(moved.clone(), token, t0).is_err());
            assert!(t.join(moved.clone(), token, t0).is_err());
            assert!(t.leave("a", token).is_err());
        }
        let listed = t.members(t0);
        assert_eq!(listed[1].id, "a");
        assert_eq!(listed[1].data_addr, "");
        // Nobody joins as the source, or as its id.
        assert!(t.join(member("x", Role::Source), None, t0).is_err());
        assert!(t.join(member("s", Role::Receiver), None, t0).is_err());
        // With its token, the member itself does.
        t.heartbeat(moved.clone(), Some(ta), t0).unwrap();
        assert_eq!(t.members(t0)[1].data_addr, "10.0.0.66:1");
        // The list is bounded.
        for i in 0..MAX_MEMBERS {
            let _ = t.join(member(&format!("m{i}"), Role::Receiver), None, t0);
        }
        assert_eq!(t.members(t0).len(), MAX_MEMBERS);
        assert!(t.join(member("late", Role::Receiver), None, t0).is_err());
    }

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

/// The pre-proof gate of a keyed control service, over real loopback sockets: what a stranger
/// can cost before proving a key, and that a wrong or skipped proof gets nothing.
#[cfg(test)]
mod gate_tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    const KEYS: &str = "alice 000102030405060708090a0b0c0d0e0f";

    /// A source's control service with `KEYS` (a tracker, no manifest) under `limits`.
    async fn service(limits: HandshakeLimits) -> (Service, String) {
        service_with(limits, Some(KEYS)).await
    }

    /// The same with `keys` (or none).
    async fn service_with(limits: HandshakeLimits, keys: Option<&str>) -> (Service, String) {
        let (_tx, progress) = watch::channel(Progress::default());
        let source = Member {
            id: "src".into(),
            epoch: 1,
            source_epoch: 7,
            data_addr: String::new(),
            ctl_addr: String::new(),
            role: Role::Source,
            progress: 0,
            done: false,
            order: 0,
            version: 1,
            rate: 0,
            number: None,
        };
        let state = Arc::new(CtlState {
            source_epoch: 7,
            manifests: Mutex::new(Vec::new()),
            version: 1,
            layout: None,
            source_layouts: Mutex::new(HashMap::new()),
            progress,
            tracker: Some(Arc::new(Tracker::new(source, Duration::from_secs(60)))),
            auth: keys.map(|k| {
                (
                    ServerAuth::new(Keyring::parse(k).unwrap()),
                    PeerId(3),
                    Epoch(4),
                )
            }),
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        (Service::start_with(listener, state, limits), addr)
    }

    fn limits(timeout: Duration, max_pending: usize) -> HandshakeLimits {
        HandshakeLimits {
            timeout,
            max_pending,
        }
    }

    /// Sends `line` and reads the answer line (`None`: the service closed the connection).
    async fn ask(s: &mut TcpStream, line: &str) -> Option<String> {
        s.write_all(format!("{line}\n").as_bytes()).await.ok()?;
        let mut got = Vec::new();
        let mut b = [0u8; 1];
        loop {
            match s.read(&mut b).await {
                Ok(0) | Err(_) => return None,
                Ok(_) if b[0] == b'\n' => return Some(String::from_utf8_lossy(&got).into_owned()),
                Ok(_) => got.push(b[0]),
            }
        }
    }

    /// Whether the service closed `s` (reads to the end; bounded so a bug fails, not hangs).
    async fn closed(s: &mut TcpStream) -> bool {
        let mut rest = Vec::new();
        matches!(
            tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut rest)).await,
            Ok(Ok(_)) | Ok(Err(_))
        )
    }

    /// The client's first step with `KEYS` as JSON, and the client state to answer with.
    fn hello() -> (String, ClientAuth) {
        let keys = Keyring::parse(KEYS).unwrap();
        let (first, client) = ClientAuth::start(&keys, PeerId(1), Epoch(2), nonce());
        let ControlFrame::AuthHello(h) = first else {
            panic!("no hello")
        };
        let req = Request::AuthHello {
            name: h.name,
            peer_id: format!("{:032x}", h.peer_id.0),
            epoch: h.epoch.0,
            nonce: Digest(h.nonce),
        };
        (serde_json::to_string(&req).unwrap(), client)
    }

    #[tokio::test]
    async fn a_wrong_proof_gets_nothing_and_closes_the_connection() {
        let (_svc, addr) = service(HandshakeLimits::default()).await;
        let mut s = TcpStream::connect(&addr).await.unwrap();
        let (hello, _client) = hello();
        let challenge = ask(&mut s, &hello).await.unwrap();
        assert!(challenge.contains("auth_challenge"), "{challenge}");
        let bad = serde_json::to_string(&Request::AuthProof {
            mac: Digest([7; 32]),
        })
        .unwrap();
        let answer = ask(&mut s, &bad).await.unwrap();
        assert!(answer.contains("error"), "{answer}");
        assert!(closed(&mut s).await);
    }

    #[tokio::test]
    async fn a_skipped_proof_gets_nothing() {
        let (_svc, addr) = service(HandshakeLimits::default()).await;
        let mut s = TcpStream::connect(&addr).await.unwrap();
        let (hello, _client) = hello();
        assert!(
            ask(&mut s, &hello)
                .await
                .unwrap()
                .contains("auth_challenge")
        );
        let answer = ask(&mut s, r#"{"op":"members"}"#).await.unwrap();
        assert!(
            answer.contains("error") && !answer.contains("src"),
            "{answer}"
        );
        assert!(closed(&mut s).await);
        // Nor is anything answered without even a hello.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        let answer = ask(&mut s, r#"{"op":"members"}"#).await.unwrap();
        assert!(answer.contains("unauthenticated"), "{answer}");
    }

    #[tokio::test]
    async fn before_the_proof_lines_are_short_and_time_is_bounded() {
        let (_svc, addr) = service(limits(Duration::from_millis(300), 16)).await;
        // A line over the pre-proof limit (the proven limit is 64 KiB): closed unanswered.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        let long = format!(
            "{{\"op\":\"members\",\"x\":\"{}\"}}",
            "a".repeat(2 * MAX_PREAUTH_REQUEST)
        );
        assert_eq!(ask(&mut s, &long).await, None);
        // Silence: closed at the deadline.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        assert!(closed(&mut s).await);
        // A challenged connection that never proves: closed at the deadline too.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        let (hello, _client) = hello();
        assert!(
            ask(&mut s, &hello)
                .await
                .unwrap()
                .contains("auth_challenge")
        );
        assert!(closed(&mut s).await);
    }

    #[tokio::test]
    async fn past_the_cap_a_connection_is_closed_at_once_and_a_proven_one_stays() {
        // A deadline no test waits for: a closed connection below was refused, not timed out.
        let (_svc, addr) = service(limits(Duration::from_secs(600), 2)).await;
        let _a = TcpStream::connect(&addr).await.unwrap();
        let _b = TcpStream::connect(&addr).await.unwrap();
        let mut c = TcpStream::connect(&addr).await.unwrap();
        assert!(closed(&mut c).await);
        drop((_a, _b));
        // Places free again once those are gone; a client that proves its key is served, and
        // a proven connection no longer counts against the cap.
        let keys = Keyring::parse(KEYS).unwrap();
        let connect = async {
            loop {
                match CtlClient::connect_keyed(&addr, Duration::from_secs(5), Some(&keys)).await {
                    Ok(c) => break c,
                    // The service may not have seen the two close yet: wait for that, not a
                    // time (bounded below, so a service that never frees them fails the test).
                    Err(_) => tokio::task::yield_now().await,
                }
            }
        };
        let mut client = tokio::time::timeout(Duration::from_secs(20), connect)
            .await
            .expect("a client proving its key got in once the places were free");
        let _d = TcpStream::connect(&addr).await.unwrap();
        let _e = TcpStream::connect(&addr).await.unwrap();
        let members = client
            .call(&Request::Members, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(matches!(members, Reply::Members { .. }), "{members:?}");
    }

    #[tokio::test]
    async fn an_answer_that_outlasts_the_deadline_is_still_given() {
        // Keyless: the first request passes the gate, so its long poll may take longer than
        // the pre-proof deadline.
        let (_svc, addr) = service_with(limits(Duration::from_millis(100), 4), None).await;
        let mut s = TcpStream::connect(&addr).await.unwrap();
        let answer = ask(&mut s, r#"{"op":"progress","after":0,"wait_ms":600}"#)
            .await
            .expect("answered");
        assert!(answer.contains("progress"), "{answer}");
        assert!(
            ask(&mut s, r#"{"op":"members"}"#)
                .await
                .unwrap()
                .contains("members")
        );
    }
}

//! The control service: the accept loop behind the pre-authentication gate, each connection's
//! loop (charged to the proven connections' table once proven, and closed when idle), and the
//! answers.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};

use ferry::{AcceptBackoff, HandshakeGate, HandshakeLimits, HandshakeSlot};

use crate::layout::Extent;
use crate::manifest::{Digest, Manifest};

use super::auth::{ConnAuth, MemberAuth, authenticate};
use super::messages::{MAX_PREAUTH_REQUEST, MAX_REQUEST, Progress, Reply, Request, read_line};
use super::proven::{ConnKey, ProvenLimits, ProvenTable};
use super::tracker::Tracker;

/// The proven connections of one service; each handle wakes its connection to close.
type Proven = Mutex<ProvenTable<Arc<Notify>>>;

/// Longest wait of one progress poll.
const MAX_WAIT: Duration = Duration::from_secs(10);

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
    pub(crate) auth: Option<MemberAuth>,
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
    /// limits and the default ones after. Must be called inside a tokio runtime.
    pub(crate) fn start(listener: TcpListener, state: Arc<CtlState>) -> Self {
        Self::start_with(
            listener,
            state,
            HandshakeLimits::default(),
            ProvenLimits::default(),
        )
    }

    /// Serves the control protocol on `listener`, with `limits` before the proof and `proven`
    /// after it.
    pub(crate) fn start_with(
        listener: TcpListener,
        state: Arc<CtlState>,
        limits: HandshakeLimits,
        proven: ProvenLimits,
    ) -> Self {
        let listener = Arc::new(Mutex::new(Some(listener)));
        let gate = HandshakeGate::new(limits);
        let proven = Arc::new(Mutex::new(ProvenTable::new(proven)));
        let task = tokio::spawn(serve(listener.clone(), state, gate, proven));
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

/// The lock of a poisoned mutex is still the data (nothing here is left half-updated).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Serves the control protocol until the listener is taken away or the task is aborted; its
/// connections end with it (they live in its `JoinSet`), so a stopped member answers nothing.
async fn serve(
    listener: Arc<Mutex<Option<TcpListener>>>,
    state: Arc<CtlState>,
    gate: Arc<HandshakeGate>,
    proven: Arc<Proven>,
) {
    let mut conns = tokio::task::JoinSet::new();
    let mut backoff = AcceptBackoff::new();
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
                        backoff.accepted();
                        a
                    }
                    Err(e) => {
                        // Out of descriptors, say: wait before the next accept instead of
                        // spinning on the same error.
                        let wait = backoff.failed();
                        tracing::warn!(error = %e, ?wait, "control service: accept failed");
                        tokio::time::sleep(wait).await;
                        continue;
                    }
                };
                let Some(slot) = gate.admit_evicting(stream.as_fd(), from.ip()) else {
                    tracing::debug!(%from, "control connection refused: too many before their proof");
                    continue;
                };
                let (state, gate, proven) = (state.clone(), gate.clone(), proven.clone());
                conns.spawn(async move {
                    let conn = Conn { from: from.ip(), slot, gate: &gate, proven: &proven };
                    if let Err(e) = serve_conn(stream, &state, conn).await {
                        tracing::debug!(%from, error = %e, "control connection ended");
                    }
                });
            }
            Some(_) = conns.join_next() => {}
        }
    }
}

/// What one connection is served under: where it came from, its place at the gate until its
/// proof, and the table it joins once proven.
struct Conn<'a> {
    from: std::net::IpAddr,
    slot: HandshakeSlot,
    gate: &'a HandshakeGate,
    proven: &'a Proven,
}

/// A connection's place in the proven table, given back when it ends.
struct Charged<'a> {
    proven: &'a Proven,
    id: u64,
    /// Woken when the table takes it out to make room.
    evicted: Arc<Notify>,
}

impl Drop for Charged<'_> {
    fn drop(&mut self) {
        lock(self.proven).remove(self.id);
    }
}

/// Charges a connection just proven to `key`, closing the connections that give way; `Err` (the
/// refusal, in words) when it is not kept.
fn charge<'a>(proven: &'a Proven, key: ConnKey) -> Result<Charged<'a>, String> {
    let evicted = Arc::new(Notify::new());
    let (id, out) = lock(proven)
        .admit(key.clone(), evicted.clone(), Instant::now())
        .map_err(|r| r.to_string())?;
    if !out.is_empty() {
        tracing::debug!(
            ?key,
            closed = out.len(),
            "control connections closed to make room"
        );
    }
    // A permit is kept for a connection not waiting at this moment: it closes at its next wait.
    out.iter().for_each(|n| n.notify_one());
    Ok(Charged {
        proven,
        id,
        evicted,
    })
}

async fn serve_conn(stream: TcpStream, state: &CtlState, c: Conn<'_>) -> std::io::Result<()> {
    let Conn {
        from,
        slot,
        gate,
        proven,
    } = c;
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
    // and runs against its deadline; after it, its place in the proven table, and each wait for
    // a request against the idle timeout.
    let mut slot = Some(slot);
    let mut charged: Option<Charged<'_>> = None;
    let idle = lock(proven).limits().idle;
    let deadline = tokio::time::Instant::now() + gate.limits().timeout;
    loop {
        let line = if let Some(ch) = &charged {
            tokio::select! {
                line = read_line(&mut r, MAX_REQUEST) => line?,
                () = tokio::time::sleep(idle) => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "idle past the timeout of proven connections",
                    ));
                }
                () = ch.evicted.notified() => {
                    return Err(std::io::Error::other("closed to make room"));
                }
            }
        } else if slot.is_some() {
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
        if let Some(ch) = &charged
            && !lock(proven).busy(ch.id, Instant::now())
        {
            // Taken out to make room between its request and this check: unanswered.
            return Err(std::io::Error::other("closed to make room"));
        }
        let (reply, close) = match serde_json::from_slice::<Request>(&line) {
            Ok(req) => match authenticate(&req, &mut conn, state.auth.as_ref(), state.source_epoch)
            {
                Some(r) => r,
                None => {
                    // Answerable: proven (or keyless), so past the gate. A long poll's answer
                    // may take longer than the pre-proof deadline.
                    slot = None;
                    match charged_now(&mut charged, &conn, from, proven) {
                        Ok(()) => (answer(req, state).await, false),
                        Err(message) => (Reply::Error { message }, true),
                    }
                }
            },
            Err(e) => (
                Reply::Error {
                    message: format!("bad request: {e}"),
                },
                true,
            ),
        };
        // A proof just verified: charged before it is answered.
        let (reply, close) = match (&conn, close) {
            (ConnAuth::Proven(_), false) => match charged_now(&mut charged, &conn, from, proven) {
                Ok(()) => (reply, false),
                Err(message) => (Reply::Error { message }, true),
            },
            _ => (reply, close),
        };
        let mut out = serde_json::to_vec(&reply).map_err(std::io::Error::other)?;
        out.push(b'\n');
        if let Some(ch) = &charged {
            // Answered: from here it waits on its peer (to read the answer, then to ask again),
            // and may give way to a newcomer.
            lock(proven).waiting(ch.id, Instant::now());
        }
        let write = w.write_all(&out);
        let unread = || std::io::Error::new(std::io::ErrorKind::TimedOut, "answer not read");
        if slot.is_some() {
            // A stranger that does not read its answer is held to the deadline too.
            tokio::time::timeout_at(deadline, write)
                .await
                .map_err(|_| unread())??;
        } else if let Some(ch) = &charged {
            // So is a proven peer, to the idle timeout; and it may be closed to make room.
            tokio::select! {
                done = write => done?,
                () = tokio::time::sleep(idle) => return Err(unread()),
                () = ch.evicted.notified() => {
                    return Err(std::io::Error::other("closed to make room"));
                }
            }
        } else {
            tokio::time::timeout(idle, write)
                .await
                .map_err(|_| unread())??;
        }
        if close {
            return Ok(());
        }
        if matches!(conn, ConnAuth::Proven(_) | ConnAuth::Open) {
            slot = None;
        }
    }
    Ok(())
}

/// Charges the connection to its key once it is proven (keyless: at its first answerable
/// request), if not yet.
fn charged_now<'a>(
    charged: &mut Option<Charged<'a>>,
    conn: &ConnAuth,
    from: std::net::IpAddr,
    proven: &'a Proven,
) -> Result<(), String> {
    if charged.is_some() {
        return Ok(());
    }
    let key = match conn {
        ConnAuth::Proven(name) => ConnKey::Name(name.to_string()),
        ConnAuth::Open => ConnKey::Source(from),
        ConnAuth::Unproven | ConnAuth::Challenged(_) => return Ok(()),
    };
    *charged = Some(charge(proven, key)?);
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

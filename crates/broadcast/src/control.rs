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
//! Lines are capped in length before they are parsed; a bad line is answered with an error
//! and closes that connection.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::error::BroadcastError;
use crate::layout::Extent;
use crate::manifest::{MAX_MANIFEST_BYTES, Manifest};
use crate::plan::{Member, Role};

/// Longest line accepted (a manifest answer is the longest).
const MAX_LINE: usize = MAX_MANIFEST_BYTES + (1 << 20);
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
    },
    Layout {
        #[serde(default)]
        version: Option<u64>,
    },
    Join {
        member: Member,
    },
    Heartbeat {
        member: Member,
    },
    Members,
    Leave {
        id: String,
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
    Error {
        message: String,
    },
}

/// What a member's verified prefix is now, and whether it holds everything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Progress {
    pub(crate) prefix: u64,
    pub(crate) done: bool,
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
    members: HashMap<String, (Member, Option<Instant>)>,
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
        inner.members.insert(source.id.clone(), (source, None));
        Self {
            lease,
            inner: Mutex::new(inner),
        }
    }

    /// A join or a heartbeat at `now`: the member's entry (order kept from its first join).
    pub(crate) fn seen(&self, mut m: Member, now: Instant) {
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let order = match g.members.get(&m.id) {
            Some((old, _)) => old.order,
            None => {
                g.next += 1;
                g.next - 1
            }
        };
        m.order = order;
        g.members.insert(m.id.clone(), (m, Some(now + self.lease)));
    }

    /// Drops a member.
    pub(crate) fn leave(&self, id: &str) {
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        g.members
            .retain(|k, (m, _)| k != id || m.role == Role::Source);
    }

    /// The members whose lease has not expired at `now`, in join order.
    pub(crate) fn members(&self, now: Instant) -> Vec<Member> {
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        g.members
            .retain(|_, (_, expires)| expires.is_none_or(|e| e > now));
        let mut v: Vec<Member> = g.members.values().map(|(m, _)| m.clone()).collect();
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
    /// Serves the control protocol on `listener`. Must be called inside a tokio runtime.
    pub(crate) fn start(listener: TcpListener, state: Arc<CtlState>) -> Self {
        let listener = Arc::new(Mutex::new(Some(listener)));
        let task = tokio::spawn(serve(listener.clone(), state));
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

async fn serve(listener: Arc<Mutex<Option<TcpListener>>>, state: Arc<CtlState>) {
    let mut conns = tokio::task::JoinSet::new();
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
                let Ok((stream, from)) = accepted else { continue };
                let state = state.clone();
                conns.spawn(async move {
                    if let Err(e) = serve_conn(stream, &state).await {
                        tracing::debug!(%from, error = %e, "control connection ended");
                    }
                });
            }
            Some(_) = conns.join_next() => {}
        }
    }
}

async fn serve_conn(stream: TcpStream, state: &CtlState) -> std::io::Result<()> {
    let _ = stream.set_nodelay(true);
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    while let Some(line) = read_line(&mut r, MAX_LINE).await? {
        let (reply, close) = match serde_json::from_slice::<Request>(&line) {
            Ok(req) => (answer(req, state).await, false),
            Err(e) => (
                Reply::Error {
                    message: format!("bad request: {e}"),
                },
                true,
            ),
        };
        let mut out = serde_json::to_vec(&reply).map_err(std::io::Error::other)?;
        out.push(b'\n');
        w.write_all(&out).await?;
        if close {
            return Ok(());
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
        Request::Progress { after, wait_ms } => {
            let mut rx = state.progress.clone();
            let wait = Duration::from_millis(wait_ms).min(MAX_WAIT);
            let _ = tokio::time::timeout(wait, rx.wait_for(|p| p.prefix > after || p.done)).await;
            let p = *rx.borrow();
            Reply::Progress {
                source_epoch,
                prefix: p.prefix,
                done: p.done,
                version: state.version,
            }
        }
        Request::Join { member } | Request::Heartbeat { member } => match &state.tracker {
            Some(t) if member.source_epoch == source_epoch => {
                t.seen(member, Instant::now());
                Reply::Ok { source_epoch }
            }
            // A member of another source epoch is not listed; it learns the epoch here.
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
        Request::Leave { id } => match &state.tracker {
            Some(t) => {
                t.leave(&id);
                Reply::Ok { source_epoch }
            }
            None => no_tracker(),
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
    /// Connects within `timeout`.
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
        let reply: Reply =
            serde_json::from_slice(&answer).map_err(|e| err(format!("bad answer: {e}")))?;
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
        }
    }

    #[test]
    fn tracker_orders_by_first_join_and_expires_silent_members() {
        let t0 = Instant::now();
        let t = Tracker::new(member("s", Role::Source), Duration::from_secs(2));
        t.seen(member("a", Role::Receiver), t0);
        t.seen(member("b", Role::Receiver), t0);
        t.seen(member("a", Role::Receiver), t0 + Duration::from_secs(1));
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
        t.leave("a");
        t.leave("s");
        assert_eq!(ids(t.members(t0)), [("s".into(), 0)]);
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
        assert!(serde_json::from_slice::<Request>(b"{\"op\":\"nope\"}").is_err());
        // A request of the protocol before versions still parses.
        assert!(matches!(
            serde_json::from_slice::<Request>(b"{\"op\":\"manifest\"}"),
            Ok(Request::Manifest { version: None })
        ));
    }
}

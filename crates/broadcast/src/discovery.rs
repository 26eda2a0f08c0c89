//! Discovery of a broadcast's members, behind one trait (architecture section 4).
//!
//! - [`Embedded`] (the default): receivers are given the source's control address; the source
//!   keeps the membership list itself (a tracker: a member is listed while its heartbeats
//!   arrive within the lease, three seconds by default) and tells each member about the others.
//! - `Etcd` (feature `etcd`): members register `id`, `epoch`, addresses, `role` and progress
//!   under `/ferry/broadcast/<name>/members/<id>` with an etcd lease kept alive while the member
//!   runs, and watch the prefix; a member that dies stops renewing its lease, etcd deletes its
//!   key when the lease expires, and the others' plans no longer name it.
//!
//! Either way the list is what [`plan::stripe_holders`](crate::plan::stripe_holders) derives
//! each member's parents from.
//!
//! **Whom the list vouches for** ([`Discovery::listing`]). The embedded list is the source's
//! own, at the address the caller named ([`Listing::Named`]). Anyone who can write etcd lists
//! members there, a source among them ([`Listing::Open`]): a receiver takes a manifest from a
//! source such a list names only if it is bound to the publisher some other way, by the
//! broadcast's keys or by its digest given out of band ([`require_bound`]), and it checks that
//! each member's data plane is served by the peer incarnation (id and epoch) its record names
//! ([`check_incarnation`]): a record pointing at someone else's server is refused.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use tokio::sync::Mutex;

use ferry::{Epoch, Keyring, PeerId};

use crate::control::{CtlClient, Hex32, Reply, Request};
use crate::error::BroadcastError;
use crate::plan::Member;

/// A boxed future, for the object-safe [`Discovery`] trait.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where a broadcast's members find each other.
pub trait Discovery: Send + Sync + fmt::Debug + 'static {
    /// Lists `me` (under a lease, where the backend has leases). Returns the source epoch the
    /// backend's source has, where it knows one (the embedded tracker does).
    fn register<'a>(&'a self, me: &'a Member)
    -> BoxFuture<'a, Result<Option<u64>, BroadcastError>>;

    /// Updates `me`'s entry (progress) and renews its lease. Returns what `register` returns.
    fn update<'a>(&'a self, me: &'a Member) -> BoxFuture<'a, Result<Option<u64>, BroadcastError>>;

    /// The members listed now, in join order ([`Member::order`] set).
    fn members(&self) -> BoxFuture<'_, Result<Vec<Member>, BroadcastError>>;

    /// Removes `me`'s entry (a member that ends cleanly).
    fn deregister<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), BroadcastError>>;

    /// The backend, for messages (`embedded ADDR`, `etcd URL`).
    fn describe(&self) -> String;

    /// Whom the members it lists are vouched for by. Default [`Listing::Open`]: a backend
    /// that does not say is trusted no further than etcd.
    fn listing(&self) -> Listing {
        Listing::Open
    }
}

/// Who writes a discovery backend's member list, and so how far a receiver may trust the
/// source it lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Listing {
    /// The list is the source's own, at the address the caller named ([`Embedded`]): the
    /// source is whoever serves that address.
    Named,
    /// Whoever can write the backend lists members, a source among them (etcd): the source
    /// listed proves nothing until its manifest is bound ([`require_bound`]).
    Open,
}

/// Refuses, before anything is read or allocated, a pull from a source an [`Listing::Open`]
/// list names unless its manifest is bound to the publisher: `keyed` (the broadcast's keys:
/// the source's control service must prove one before it answers the manifest) or
/// `expected` (the manifest's digest, given out of band). `backend` names the list in the
/// error ([`Discovery::describe`]). [`Receiver::join`](crate::Receiver::join) and its
/// siblings apply it; a caller that builds the backend may apply it first, before
/// connecting to it.
pub fn require_bound(
    listing: Listing,
    backend: &str,
    keyed: bool,
    expected: bool,
) -> Result<(), BroadcastError> {
    match listing {
        Listing::Open if !keyed && !expected => Err(BroadcastError::UnboundSource {
            discovery: backend.to_owned(),
        }),
        _ => Ok(()),
    }
}

/// The source record among `listed` that names the incarnation whose control service at
/// `ctl_addr` answered `source_epoch`: a source's record names its epoch both as its own
/// and as its source epoch. None listed (a stale record of a source restarted on the same
/// address, or a record listing another's control service): [`BroadcastError::WrongPeer`].
pub fn answered_by(
    listed: &[Member],
    ctl_addr: &str,
    source_epoch: u64,
) -> Result<Member, BroadcastError> {
    listed
        .iter()
        .find(|m| {
            m.role == crate::plan::Role::Source
                && m.ctl_addr == ctl_addr
                && m.source_epoch == source_epoch
                && m.epoch == source_epoch
        })
        .cloned()
        .ok_or_else(|| BroadcastError::WrongPeer {
            addr: ctl_addr.to_owned(),
            named: listed
                .iter()
                .find(|m| m.role == crate::plan::Role::Source && m.ctl_addr == ctl_addr)
                .map_or_else(
                    || "a source".to_owned(),
                    |m| format!("source peer {} epoch {}", m.id, m.source_epoch),
                ),
            found: format!("a control service of source epoch {source_epoch}"),
        })
}

/// Checks that the data plane `m` names is served by the incarnation its record names:
/// the handshake there answered peer `id` and epoch `epoch` (proven by the broadcast's key
/// where the engines are keyed). A record pointing at someone else's server is refused
/// ([`BroadcastError::WrongPeer`]).
pub fn check_incarnation(m: &Member, id: PeerId, epoch: Epoch) -> Result<(), BroadcastError> {
    if id.to_string() == m.id && epoch.0 == m.epoch {
        return Ok(());
    }
    Err(BroadcastError::WrongPeer {
        addr: m.data_addr.clone(),
        named: format!("peer {} epoch {}", m.id, m.epoch),
        found: format!("peer {id} epoch {}", epoch.0),
    })
}

/// The embedded default: the source at `addr` keeps the list.
#[derive(Debug)]
pub struct Embedded {
    addr: SocketAddr,
    conn: Mutex<Option<CtlClient>>,
    timeout: Duration,
    keys: Option<Keyring>,
    /// The token of each entry listed through this value (several members of one process
    /// may share it), from the source's answer to its join: heartbeats and the leave carry it
    /// (no one else can renew, move or remove the entry).
    tokens: std::sync::Mutex<std::collections::HashMap<String, Hex32>>,
}

impl Embedded {
    /// Discovery through the source whose control service listens on `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            conn: Mutex::new(None),
            timeout: Duration::from_secs(5),
            keys: None,
            tokens: std::sync::Mutex::default(),
        }
    }

    /// The same, proving the first key of `keys` on every connection to the source (a keyed
    /// source answers nothing else) and refusing a source that cannot prove it.
    pub fn with_keys(addr: SocketAddr, keys: Keyring) -> Self {
        Self {
            keys: Some(keys),
            ..Self::new(addr)
        }
    }

    fn tokens(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Hex32>> {
        self.tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn token(&self, id: &str) -> Option<Hex32> {
        self.tokens().get(id).copied()
    }

    /// The source's control address.
    pub fn source(&self) -> SocketAddr {
        self.addr
    }

    /// One request and its answer on the kept connection (made afresh when there is none, or
    /// it is idle past half the source's timeout). The connection is taken out for the call and
    /// put back only after a whole answer: a call that fails (a restarted source listens again)
    /// or whose future is dropped midway leaves none behind, so an answer still on its way is
    /// never read as the next call's.
    async fn call(&self, req: Request) -> Result<Reply, BroadcastError> {
        let mut slot = self.conn.lock().await;
        if slot.as_ref().is_some_and(CtlClient::stale) {
            // The source closes a connection idle past its timeout.
            *slot = None;
        }
        let mut c = match slot.take() {
            Some(c) => c,
            None => {
                CtlClient::connect_keyed(&self.addr.to_string(), self.timeout, self.keys.as_ref())
                    .await?
            }
        };
        let r = c.call(&req, self.timeout).await;
        if r.is_ok() {
            *slot = Some(c);
        }
        r
    }

    fn err(&self, reason: &str) -> BroadcastError {
        BroadcastError::Discovery {
            backend: "embedded",
            reason: format!("{}: {reason}", self.addr),
        }
    }
}

fn epoch_of(r: &Reply) -> Option<u64> {
    match r {
        Reply::Ok { source_epoch }
        | Reply::Members { source_epoch, .. }
        | Reply::Progress { source_epoch, .. }
        | Reply::Layout { source_epoch, .. }
        | Reply::Manifest { source_epoch, .. }
        | Reply::Joined { source_epoch, .. } => Some(*source_epoch),
        Reply::Error { .. } | Reply::AuthChallenge { .. } => None,
    }
}

impl Discovery for Embedded {
    fn register<'a>(
        &'a self,
        me: &'a Member,
    ) -> BoxFuture<'a, Result<Option<u64>, BroadcastError>> {
        Box::pin(async move {
            let r = self
                .call(Request::Join {
                    member: me.clone(),
                    token: self.token(&me.id),
                })
                .await?;
            if let Reply::Joined { token, .. } = &r {
                self.tokens().insert(me.id.clone(), *token);
            }
            Ok(epoch_of(&r))
        })
    }

    fn update<'a>(&'a self, me: &'a Member) -> BoxFuture<'a, Result<Option<u64>, BroadcastError>> {
        Box::pin(async move {
            let r = self
                .call(Request::Heartbeat {
                    member: me.clone(),
                    token: self.token(&me.id),
                })
                .await?;
            Ok(epoch_of(&r))
        })
    }

    fn members(&self) -> BoxFuture<'_, Result<Vec<Member>, BroadcastError>> {
        Box::pin(async move {
            match self.call(Request::Members).await? {
                Reply::Members { members, .. } => Ok(members),
                _ => Err(self.err("answered members with something else")),
            }
        })
    }

    fn deregister<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), BroadcastError>> {
        Box::pin(async move {
            self.call(Request::Leave {
                id: id.to_owned(),
                token: self.token(id),
            })
            .await?;
            self.tokens().remove(id);
            Ok(())
        })
    }

    fn describe(&self) -> String {
        format!("embedded {}", self.addr)
    }

    fn listing(&self) -> Listing {
        Listing::Named
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Role;

    /// A heartbeat whose future is dropped before its answer came (a caller's select, a
    /// timeout) leaves no connection whose next read is that answer: the list asked next is
    /// answered as a list.
    #[tokio::test]
    async fn a_call_dropped_midway_leaves_no_answer_for_the_next_one() {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let release = std::sync::Arc::new(tokio::sync::Notify::new());
        let held = release.clone();
        // Each connection: every request line is answered, a heartbeat only once released.
        tokio::spawn(async move {
            loop {
                let (sock, _) = listener.accept().await.unwrap();
                let held = held.clone();
                tokio::spawn(async move {
                    let (r, mut w) = sock.into_split();
                    let mut lines = tokio::io::BufReader::new(r).lines();
                    while let Ok(Some(line)) = lines.next_line().await {
                        let answer = if line.contains("\"heartbeat\"") {
                            held.notified().await;
                            r#"{"reply":"ok","source_epoch":1}"#
                        } else {
                            r#"{"reply":"members","source_epoch":1,"members":[]}"#
                        };
                        if w.write_all(format!("{answer}\n").as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let d = Embedded::new(addr);
        let me = member("a", 1, Role::Receiver);
        let cut = tokio::time::timeout(Duration::from_millis(100), d.update(&me)).await;
        assert!(
            cut.is_err(),
            "the heartbeat was answered before it was released"
        );
        // Its answer now goes out on the connection the dropped call used.
        release.notify_one();
        let members = d
            .members()
            .await
            .expect("the list, not the heartbeat's answer");
        assert!(members.is_empty());
    }

    fn member(id: &str, epoch: u64, role: Role) -> Member {
        Member {
            id: id.into(),
            epoch,
            source_epoch: epoch,
            data_addr: "127.0.0.1:1".into(),
            ctl_addr: "127.0.0.1:2".into(),
            role,
            progress: 0,
            done: false,
            order: 0,
            version: 1,
            rate: 0,
            number: None,
            identity: None,
        }
    }

    #[test]
    fn an_open_list_needs_keys_or_a_digest_and_a_named_one_does_not() {
        let refused = require_bound(Listing::Open, "etcd http://e:2379", false, false);
        let msg = refused.expect_err("unbound").to_string();
        for named in ["etcd http://e:2379", "--expect-manifest", "--auth-key-file"] {
            assert!(msg.contains(named), "{named:?} not in: {msg}");
        }
        assert!(require_bound(Listing::Open, "etcd", true, false).is_ok());
        assert!(require_bound(Listing::Open, "etcd", false, true).is_ok());
        assert!(require_bound(Listing::Named, "embedded", false, false).is_ok());
    }

    #[test]
    fn a_record_is_taken_only_for_the_incarnation_it_names() {
        let id = PeerId(0xabc);
        let m = member(&id.to_string(), 7, Role::Receiver);
        assert!(check_incarnation(&m, id, Epoch(7)).is_ok());
        for (other, epoch) in [(PeerId(0xabd), 7), (id, 8)] {
            let e = check_incarnation(&m, other, Epoch(epoch)).expect_err("another peer");
            assert!(matches!(e, BroadcastError::WrongPeer { .. }), "{e}");
            assert!(e.to_string().contains(&format!("epoch {epoch}")), "{e}");
        }
    }

    #[test]
    fn the_source_record_taken_names_the_epoch_its_control_service_answered() {
        let stale = member("old", 5, Role::Source);
        let now = member("new", 6, Role::Source);
        let mut elsewhere = member("far", 6, Role::Source);
        elsewhere.ctl_addr = "127.0.0.1:3".into();
        let listed = [stale.clone(), elsewhere, now.clone()];
        assert_eq!(answered_by(&listed, "127.0.0.1:2", 6).unwrap(), now);
        assert_eq!(answered_by(&listed, "127.0.0.1:2", 5).unwrap(), stale);
        let e = answered_by(&listed, "127.0.0.1:2", 9).expect_err("no record names epoch 9");
        assert!(matches!(e, BroadcastError::WrongPeer { .. }), "{e}");
        // A record whose own epoch is not its source epoch names no source incarnation.
        let mut odd = member("odd", 6, Role::Source);
        odd.epoch = 4;
        assert!(answered_by(&[odd], "127.0.0.1:2", 6).is_err());
    }
}

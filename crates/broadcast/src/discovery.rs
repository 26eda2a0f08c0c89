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

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use tokio::sync::Mutex;

use ferry::Keyring;

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

    async fn call(&self, req: Request) -> Result<Reply, BroadcastError> {
        let mut conn = self.conn.lock().await;
        if conn.is_none() {
            *conn = Some(
                CtlClient::connect_keyed(&self.addr.to_string(), self.timeout, self.keys.as_ref())
                    .await?,
            );
        }
        let Some(c) = conn.as_mut() else {
            return Err(self.err("no connection"));
        };
        let r = c.call(&req, self.timeout).await;
        if r.is_err() {
            // Reconnect next time (a restarted source listens again).
            *conn = None;
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
}

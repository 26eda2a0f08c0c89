//! etcd discovery (feature `etcd`): members under `/ferry/broadcast/<name>/members/<id>`, each
//! key bound to the member's lease, the list kept current by a watch on the prefix.
//!
//! Whoever can write the prefix lists members, a source among them: the list is
//! [`Listing::Open`], so a receiver takes a manifest from the source it names only when the
//! manifest is bound to the publisher by keys or a digest given out of band
//! ([`require_bound`](crate::discovery::require_bound)), and checks that each member's data
//! plane is served by the peer its record names. What is read is bounded: at most
//! [`MAX_MEMBERS`] records (the first listed, by create revision), each at most
//! [`MAX_MEMBER_BYTES`]; the rest are ignored, counted ([`Etcd::ignored`]) and warned of.
//!
//! The connection and the member's lease are the metadata room's (`ferry_metadata`: the one
//! etcd client, also under the Python layers' records); what is here is the member list.

use std::collections::HashMap;
use std::sync::{Arc, Mutex as StdMutex, PoisonError};
use std::time::Duration;

use ferry_metadata::Lease;
use ferry_metadata::etcd_client::{
    Client, Compare, CompareOp, EventType, GetOptions, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp, WatchOptions,
};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use crate::discovery::{BoxFuture, Discovery, Listing};
use crate::error::BroadcastError;
use crate::plan::Member;

/// Members of one broadcast in etcd.
pub struct Etcd {
    endpoint: String,
    prefix: String,
    ttl: Duration,
    client: Mutex<Client>,
    lease: Mutex<Option<Lease>>,
    /// The members listed, kept by the watch task.
    cache: Arc<StdMutex<Listed>>,
    watch: StdMutex<Option<JoinHandle<()>>>,
    /// The number this member claimed at registration ([`Member::number`]), written into
    /// every put of its entry.
    number: StdMutex<Option<u64>>,
}

impl std::fmt::Debug for Etcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Etcd")
            .field("endpoint", &self.endpoint)
            .field("prefix", &self.prefix)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

fn err(reason: impl std::fmt::Display) -> BroadcastError {
    BroadcastError::Discovery {
        backend: "etcd",
        reason: reason.to_string(),
    }
}

/// Most member records one [`Etcd`] holds (as many as the embedded tracker lists): records
/// past it are ignored (and counted) until listed ones leave.
pub const MAX_MEMBERS: usize = 4096;

/// Longest member record read, in bytes of JSON (a record is about 300): a longer one is
/// ignored (and counted) unparsed.
pub const MAX_MEMBER_BYTES: usize = 4096;

/// The member records read from etcd, at most `cap`, and how many were ignored: what the
/// watch keeps (no I/O).
#[derive(Debug)]
struct Listed {
    /// key -> (create revision, member).
    members: HashMap<String, (i64, Member)>,
    cap: usize,
    ignored: u64,
}

impl Listed {
    fn new(cap: usize) -> Self {
        Self {
            members: HashMap::new(),
            cap,
            ignored: 0,
        }
    }

    /// Takes the record `value` put under `key` (created at revision `rev`): replaces the
    /// record listed under `key`, or lists a new one while fewer than `cap` are. A record
    /// past the cap, longer than [`MAX_MEMBER_BYTES`], not a member, or naming an id other
    /// than its key's last part is ignored and counted.
    fn put(&mut self, key: &[u8], rev: i64, value: &[u8]) {
        let key = String::from_utf8_lossy(key);
        let listed = self.members.contains_key(key.as_ref());
        let why = if value.len() > MAX_MEMBER_BYTES {
            Some("longer than the most a member record may be")
        } else if !listed && self.members.len() >= self.cap {
            Some("past the most members listed")
        } else {
            match serde_json::from_slice::<Member>(value) {
                // A record is its member's own key: no record can list itself as another.
                Ok(m) if key.rsplit('/').next() == Some(m.id.as_str()) => {
                    self.members.insert(key.to_string(), (rev, m));
                    None
                }
                Ok(_) => Some("a record under another member's key"),
                Err(_) => Some("not a member record"),
            }
        };
        if let Some(why) = why {
            // An ignored update of a listed key leaves no stale record behind.
            self.members.remove(key.as_ref());
            self.ignore(1, why, &key);
        }
    }

    fn delete(&mut self, key: &[u8]) {
        self.members.remove(String::from_utf8_lossy(key).as_ref());
    }

    /// Counts `n` records ignored, with a warning at the first and at every power of two.
    fn ignore(&mut self, n: u64, why: &str, key: &str) {
        let before = self.ignored;
        self.ignored = self.ignored.saturating_add(n);
        if before == 0 || before.checked_ilog2() != self.ignored.checked_ilog2() {
            tracing::warn!(
                key,
                reason = why,
                cap = self.cap,
                ignored = self.ignored,
                "etcd member record ignored"
            );
        }
    }
}

impl Etcd {
    /// Connects to the etcd at `endpoint` (`http://HOST:PORT` or `HOST:PORT`) for the
    /// broadcast `name`; members' leases last `ttl` (at least one second) without renewal.
    /// Starts the watch that keeps the member list, at most [`MAX_MEMBERS`] records.
    pub async fn connect(
        endpoint: &str,
        name: &str,
        ttl: Duration,
    ) -> Result<Self, BroadcastError> {
        Self::connect_capped(endpoint, name, ttl, MAX_MEMBERS).await
    }

    /// [`connect`](Self::connect), holding at most `max_members` records (1 to
    /// [`MAX_MEMBERS`]).
    pub async fn connect_capped(
        endpoint: &str,
        name: &str,
        ttl: Duration,
        max_members: usize,
    ) -> Result<Self, BroadcastError> {
        let client = ferry_metadata::connect(endpoint).await.map_err(err)?;
        let this = Self {
            endpoint: endpoint.to_owned(),
            prefix: format!("/ferry/broadcast/{name}/members/"),
            ttl,
            client: Mutex::new(client),
            lease: Mutex::new(None),
            cache: Arc::new(StdMutex::new(Listed::new(
                max_members.clamp(1, MAX_MEMBERS),
            ))),
            watch: StdMutex::new(None),
            number: StdMutex::new(None),
        };
        this.start_watch().await?;
        Ok(this)
    }

    /// Member records ignored so far: past the cap, too long, or not member records.
    pub fn ignored(&self) -> u64 {
        self.cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .ignored
    }

    /// Loads the list, then follows changes from the revision it was read at.
    async fn start_watch(&self) -> Result<(), BroadcastError> {
        let mut client = self.client.lock().await.clone();
        let cap = self
            .cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .cap;
        // The first `cap` records by create revision (the members that came first); the
        // count says how many more there are.
        let first = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(i64::try_from(cap).unwrap_or(i64::MAX));
        let got = self
            .bounded("get", client.get(self.prefix.as_str(), Some(first)))
            .await?;
        let revision = got.header().map_or(0, |h| h.revision());
        {
            let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
            cache.members.clear();
            for kv in got.kvs() {
                cache.put(kv.key(), kv.create_revision(), kv.value());
            }
            let more = u64::try_from(got.count())
                .unwrap_or(0)
                .saturating_sub(got.kvs().len() as u64);
            if more > 0 {
                cache.ignore(more, "past the most members listed", &self.prefix);
            }
        }
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let mut stream = self
            .bounded("watch", client.watch(self.prefix.as_str(), Some(options)))
            .await?;
        let cache = self.cache.clone();
        let task = tokio::spawn(async move {
            while let Ok(Some(resp)) = stream.message().await {
                let mut cache = cache.lock().unwrap_or_else(PoisonError::into_inner);
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    match ev.event_type() {
                        EventType::Put => cache.put(kv.key(), kv.create_revision(), kv.value()),
                        EventType::Delete => cache.delete(kv.key()),
                    }
                }
            }
            tracing::debug!("etcd watch ended");
        });
        if let Some(old) = self
            .watch
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .replace(task)
        {
            old.abort();
        }
        Ok(())
    }

    async fn put(&self, me: &Member) -> Result<(), BroadcastError> {
        let lease = self.lease.lock().await.as_ref().map(Lease::id);
        let Some(lease) = lease else {
            return Err(err("not registered"));
        };
        let mut me = me.clone();
        me.number = *self.number.lock().unwrap_or_else(PoisonError::into_inner);
        let value = serde_json::to_vec(&me).map_err(err)?;
        let mut client = self.client.lock().await.clone();
        let key = format!("{}{}", self.prefix, me.id);
        let options = PutOptions::new().with_lease(lease);
        self.bounded("put", client.put(key, value, Some(options)))
            .await?;
        Ok(())
    }

    /// The store's call `op`, waiting at most [`ferry_metadata::CALL_TIMEOUT`] for its answer
    /// (a frozen etcd is a discovery error naming the endpoint and the call, not a caller held).
    async fn bounded<T>(
        &self,
        op: &'static str,
        call: impl std::future::Future<Output = Result<T, ferry_metadata::etcd_client::Error>>,
    ) -> Result<T, BroadcastError> {
        ferry_metadata::bounded(&self.endpoint, op, ferry_metadata::CALL_TIMEOUT, call)
            .await
            .map_err(err)
    }
}

impl Etcd {
    /// Claims `me` a [`Member::number`] among the members of its source epoch and version:
    /// the first number above every one listed whose key
    /// `/ferry/broadcast/<name>/numbers/<source epoch>/<version>/<k>` a transaction creates
    /// (it fails if the key exists), bound to `lease` so the number is freed with the member.
    async fn claim(
        &self,
        client: &mut Client,
        me: &Member,
        lease: i64,
    ) -> Result<u64, BroadcastError> {
        let base = self.prefix.trim_end_matches("members/");
        let numbers = format!("{base}numbers/{}/{}/", me.source_epoch, me.version);
        let listed = {
            let cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
            cache
                .members
                .values()
                .filter(|(_, m)| m.source_epoch == me.source_epoch && m.version == me.version)
                .filter_map(|(_, m)| m.number)
                .max()
        };
        let mut k = listed.map_or(0, |k| k.saturating_add(1));
        for _ in 0..CLAIM_TRIES {
            let key = format!("{numbers}{k}");
            let txn = Txn::new()
                .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(
                    key.as_str(),
                    me.id.as_str(),
                    Some(PutOptions::new().with_lease(lease)),
                )]);
            if self.bounded("txn", client.txn(txn)).await?.succeeded() {
                return Ok(k);
            }
            k = k.saturating_add(1);
        }
        Err(err(format!(
            "no member number claimed in {CLAIM_TRIES} tries under {numbers}"
        )))
    }
}

/// Numbers a registration tries before it gives up (each taken by a member that joined
/// meanwhile).
const CLAIM_TRIES: usize = 4096;

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(t) = self
            .watch
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            t.abort();
        }
    }
}

impl Discovery for Etcd {
    fn register<'a>(
        &'a self,
        me: &'a Member,
    ) -> BoxFuture<'a, Result<Option<u64>, BroadcastError>> {
        Box::pin(async move {
            let mut client = self.client.lock().await.clone();
            let lease = Lease::grant(&mut client, &self.endpoint, self.ttl)
                .await
                .map_err(err)?;
            let id = lease.id();
            // The lease replaced (a second registration) stops being kept alive.
            drop(self.lease.lock().await.replace(lease));
            if me.role == crate::plan::Role::Receiver {
                let k = self.claim(&mut client, me, id).await?;
                *self.number.lock().unwrap_or_else(PoisonError::into_inner) = Some(k);
            }
            self.put(me).await?;
            Ok(None)
        })
    }

    fn update<'a>(&'a self, me: &'a Member) -> BoxFuture<'a, Result<Option<u64>, BroadcastError>> {
        Box::pin(async move {
            self.put(me).await?;
            Ok(None)
        })
    }

    fn members(&self) -> BoxFuture<'_, Result<Vec<Member>, BroadcastError>> {
        Box::pin(async move {
            let cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
            let mut v: Vec<Member> = cache
                .members
                .values()
                .map(|(rev, m)| {
                    let mut m = m.clone();
                    m.order = *rev as u64;
                    m
                })
                .collect();
            v.sort_by_key(|m| m.order);
            Ok(v)
        })
    }

    fn deregister<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<(), BroadcastError>> {
        Box::pin(async move {
            let lease = self.lease.lock().await.take();
            let mut client = self.client.lock().await.clone();
            self.bounded(
                "delete",
                client.delete(format!("{}{id}", self.prefix), None),
            )
            .await?;
            if let Some(lease) = lease {
                let _ = lease.revoke(&mut client, &self.endpoint).await;
            }
            Ok(())
        })
    }

    fn describe(&self) -> String {
        match self.ignored() {
            0 => format!("etcd {}", self.endpoint),
            n => format!(
                "etcd {} ({n} member records ignored: past the {} listed at most, too long, or \
                 not member records)",
                self.endpoint,
                self.cache
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .cap
            ),
        }
    }

    fn listing(&self) -> Listing {
        Listing::Open
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Role;

    fn record(id: &str) -> Vec<u8> {
        serde_json::to_vec(&Member {
            id: id.into(),
            epoch: 1,
            source_epoch: 1,
            data_addr: "127.0.0.1:1".into(),
            ctl_addr: "127.0.0.1:2".into(),
            role: Role::Receiver,
            progress: 0,
            done: false,
            order: 0,
            version: 0,
            rate: 0,
            number: None,
            identity: None,
        })
        .unwrap()
    }

    fn key(id: &str) -> Vec<u8> {
        format!("/ferry/broadcast/b/members/{id}").into_bytes()
    }

    #[test]
    fn records_past_the_cap_are_ignored_and_counted_and_a_listed_one_is_updated() {
        let mut l = Listed::new(3);
        for i in 0..10 {
            let id = format!("m{i}");
            l.put(&key(&id), i, &record(&id));
        }
        assert_eq!(l.members.len(), 3);
        assert_eq!(l.ignored, 7);
        // A listed member's update is taken at the cap.
        l.put(&key("m0"), 0, &record("m0"));
        assert_eq!((l.members.len(), l.ignored), (3, 7));
        // A member that leaves makes room for the next one put.
        l.delete(&key("m1"));
        l.put(&key("m9"), 9, &record("m9"));
        assert!(l.members.contains_key("/ferry/broadcast/b/members/m9"));
        assert_eq!((l.members.len(), l.ignored), (3, 7));
    }

    #[test]
    fn long_foreign_or_garbled_records_are_ignored_and_drop_what_their_key_listed() {
        let mut l = Listed::new(MAX_MEMBERS);
        l.put(&key("a"), 1, &record("a"));
        l.put(&key("b"), 2, &vec![b' '; MAX_MEMBER_BYTES + 1]);
        l.put(&key("c"), 3, &record("a"));
        l.put(&key("d"), 4, b"{not json");
        assert_eq!(l.members.len(), 1);
        assert_eq!(l.ignored, 3);
        // An update of a listed key that is refused leaves nothing stale listed under it.
        l.put(&key("a"), 1, b"garbage");
        assert!(l.members.is_empty());
        assert_eq!(l.ignored, 4);
    }
}

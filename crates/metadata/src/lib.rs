//! Ferry's metadata room: the one etcd client of the project.
//!
//! Records that name processes (a broadcast's members, the Mooncake layer's endpoint records,
//! NIXL agents' metadata) are kept in etcd by three layers; this crate is what each of them
//! uses to reach it: [`connect`] (one endpoint, proven to answer within a bounded wait, an error
//! naming it), [`Lease`]
//! (a lease kept alive by a task until it is dropped or revoked, so a process that dies takes
//! its records with it within the lease's time) and [`EtcdKv`] (plain records under one
//! lease). Broadcast discovery (`ferry_broadcast::Etcd`) builds its member list on
//! [`connect`] and [`Lease`]; the Python package's `EtcdKv`, which its Mooncake and NIXL
//! layers use, is [`EtcdKv`].
//!
//! It imports no crate of Ferry's: it sits beside the bottom of the map, below `broadcast`
//! and `python`, which take it behind their `etcd` feature (etcd-client's build runs `protoc`).
//! Errors are [`MetadataError`], naming the endpoint. Every call this crate makes is bounded
//! ([`CALL_TIMEOUT`], or [`EtcdKv::with_call_timeout`]): a store that stops answering (a frozen
//! or partitioned etcd) is a [`MetadataError::Timeout`], never a caller held forever; layers that
//! make calls of their own wrap them in [`bounded`]. [`etcd_client`] is re-exported for the
//! layers that speak more of etcd than records (watches, transactions).

#![warn(missing_docs)]
#![forbid(unsafe_code)]

use std::time::Duration;

pub use etcd_client;
use etcd_client::{Client, PutOptions};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

/// How long [`connect`] waits for an endpoint to answer.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one call (a get, a put, a lease grant or revoke) waits for the store's answer.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// What went wrong with a metadata store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetadataError {
    /// The store did not answer within [`CONNECT_TIMEOUT`], or refused the connection.
    #[error("etcd {endpoint}: cannot connect: {reason}")]
    Connect {
        /// The endpoint, as given.
        endpoint: String,
        /// Why.
        reason: String,
    },
    /// A call to a connected store got no answer within its bound.
    #[error("etcd {endpoint}: {op}: no answer within {after:?}")]
    Timeout {
        /// The endpoint, as given.
        endpoint: String,
        /// The call: `lease grant`, `put`, `get`, ...
        op: &'static str,
        /// The bound it waited.
        after: Duration,
    },
    /// A call to a connected store failed.
    #[error("etcd {endpoint}: {op} failed: {source}")]
    Call {
        /// The endpoint, as given.
        endpoint: String,
        /// The call: `lease grant`, `put`, `get`, ...
        op: &'static str,
        /// The client's error.
        #[source]
        source: etcd_client::Error,
    },
}

impl MetadataError {
    /// The error of the call `op` to `endpoint`.
    pub fn call(endpoint: &str, op: &'static str, source: etcd_client::Error) -> Self {
        Self::Call {
            endpoint: endpoint.to_owned(),
            op,
            source,
        }
    }
}

/// The URL of `endpoint`: `http://HOST:PORT` for a bare `HOST:PORT` (Mooncake and NIXL take
/// both), as given otherwise.
pub fn url_of(endpoint: &str) -> String {
    let e = endpoint.trim();
    if e.contains("://") {
        e.to_owned()
    } else {
        format!("http://{e}")
    }
}

/// Runs the call `op` to `endpoint`, waiting at most `within` for its answer: the store's error
/// is [`MetadataError::Call`], no answer in time [`MetadataError::Timeout`].
pub async fn bounded<T>(
    endpoint: &str,
    op: &'static str,
    within: Duration,
    call: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, MetadataError> {
    match tokio::time::timeout(within, call).await {
        Ok(r) => r.map_err(|e| MetadataError::call(endpoint, op, e)),
        Err(_) => Err(MetadataError::Timeout {
            endpoint: endpoint.to_owned(),
            op,
            after: within,
        }),
    }
}

/// Connects to the etcd at `endpoint` (`http://HOST:PORT` or `HOST:PORT`), waiting at most
/// [`CONNECT_TIMEOUT`]: [`connect_within`] with that bound.
pub async fn connect(endpoint: &str) -> Result<Client, MetadataError> {
    connect_within(endpoint, CONNECT_TIMEOUT).await
}

/// Connects to the etcd at `endpoint` and proves it answers (a status call) within `within`:
/// a dead, refusing or frozen endpoint is a [`MetadataError::Connect`] naming it here, not at
/// the first call (the client's channel connects lazily).
pub async fn connect_within(endpoint: &str, within: Duration) -> Result<Client, MetadataError> {
    let fail = |reason: String| MetadataError::Connect {
        endpoint: endpoint.to_owned(),
        reason,
    };
    let options = etcd_client::ConnectOptions::new().with_connect_timeout(within);
    let proven = async {
        let mut client = Client::connect([url_of(endpoint)], Some(options)).await?;
        client.status().await?;
        Ok::<_, etcd_client::Error>(client)
    };
    tokio::time::timeout(within, proven)
        .await
        .map_err(|_| fail(format!("no answer within {within:?}")))?
        .map_err(|e| fail(e.to_string()))
}

/// A lease and the task that keeps it alive (renewing it every third of its time) until the
/// lease is dropped (the task stops; etcd lets the lease lapse after its time) or etcd stops
/// answering (the task ends: [`alive`](Self::alive) says so).
#[derive(Debug)]
pub struct Lease {
    id: i64,
    keeper: JoinHandle<()>,
    /// How long its calls (the grant, the revoke) wait for an answer.
    within: Duration,
}

impl Lease {
    /// Grants a lease of `ttl` (at least one second) on `client` and keeps it alive; its
    /// calls wait at most [`CALL_TIMEOUT`] ([`grant_within`](Self::grant_within)).
    pub async fn grant(
        client: &mut Client,
        endpoint: &str,
        ttl: Duration,
    ) -> Result<Self, MetadataError> {
        Self::grant_within(client, endpoint, ttl, CALL_TIMEOUT).await
    }

    /// [`grant`](Self::grant), its calls (this grant, a later revoke) waiting at most `within`.
    pub async fn grant_within(
        client: &mut Client,
        endpoint: &str,
        ttl: Duration,
        within: Duration,
    ) -> Result<Self, MetadataError> {
        let ttl = ttl.as_secs().max(1) as i64;
        let id = bounded(
            endpoint,
            "lease grant",
            within,
            client.lease_grant(ttl, None),
        )
        .await?
        .id();
        let (mut keeper, mut stream) = bounded(
            endpoint,
            "lease keep-alive",
            within,
            client.lease_keep_alive(id),
        )
        .await?;
        let every = Duration::from_millis((ttl as u64 * 1000 / 3).max(200));
        let keeper = tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if keeper.keep_alive().await.is_err() {
                    break;
                }
                // A store that does not answer a renewal within a third of the lease's time
                // lets it lapse: the lease is given up (`alive` is false from then on).
                let answer = tokio::time::timeout(every, stream.message()).await;
                if !matches!(answer, Ok(Ok(Some(_)))) {
                    break;
                }
            }
            tracing::debug!(lease = id, "etcd lease keep-alive ended");
        });
        Ok(Self { id, keeper, within })
    }

    /// The lease's id, for the options of a put bound to it.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// Whether it is still kept alive (its task has not ended).
    pub fn alive(&self) -> bool {
        !self.keeper.is_finished()
    }

    /// Ends the lease now: every record bound to it goes.
    pub async fn revoke(self, client: &mut Client, endpoint: &str) -> Result<(), MetadataError> {
        self.keeper.abort();
        bounded(
            endpoint,
            "lease revoke",
            self.within,
            client.lease_revoke(self.id),
        )
        .await?;
        Ok(())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

/// Plain keys in etcd, for records other than a broadcast's members (the Mooncake layer's
/// endpoint records: docs/mooncake.md; NIXL agents' metadata: docs/nixl.md). A record put
/// with [`put_leased`](Self::put_leased) lives while this client keeps its lease alive, so a
/// process that dies takes its records with it within the lease's time.
pub struct EtcdKv {
    endpoint: String,
    ttl: Duration,
    call_timeout: Duration,
    client: Mutex<Client>,
    lease: Mutex<Option<Lease>>,
}

impl std::fmt::Debug for EtcdKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdKv")
            .field("endpoint", &self.endpoint)
            .field("ttl", &self.ttl)
            .field("call_timeout", &self.call_timeout)
            .finish_non_exhaustive()
    }
}

impl EtcdKv {
    /// Connects to the etcd at `endpoint` (`http://HOST:PORT` or `HOST:PORT`; [`connect`]);
    /// leased records last `ttl` (at least one second) without renewal. Each call waits at
    /// most [`CALL_TIMEOUT`] for its answer.
    pub async fn connect(endpoint: &str, ttl: Duration) -> Result<Self, MetadataError> {
        let client = connect(endpoint).await?;
        Ok(Self {
            endpoint: endpoint.to_owned(),
            ttl,
            call_timeout: CALL_TIMEOUT,
            client: Mutex::new(client),
            lease: Mutex::new(None),
        })
    }

    /// The same client, each of whose calls (a get, a put, a delete, the lease's grant or
    /// revoke) waits at most `within` for its answer.
    pub fn with_call_timeout(mut self, within: Duration) -> Self {
        self.call_timeout = within;
        self
    }

    /// The lease this client's records are bound to, granted (and kept alive) on first use,
    /// and again once the last one lapsed.
    async fn lease(&self) -> Result<i64, MetadataError> {
        let mut held = self.lease.lock().await;
        if let Some(l) = held.as_ref()
            && l.alive()
        {
            return Ok(l.id());
        }
        let mut client = self.client.lock().await.clone();
        let l =
            Lease::grant_within(&mut client, &self.endpoint, self.ttl, self.call_timeout).await?;
        let id = l.id();
        *held = Some(l);
        Ok(id)
    }

    /// Stores `value` under `key`, bound to this client's lease.
    pub async fn put_leased(&self, key: &str, value: Vec<u8>) -> Result<(), MetadataError> {
        let lease = self.lease().await?;
        let mut client = self.client.lock().await.clone();
        let options = PutOptions::new().with_lease(lease);
        self.bounded("put", client.put(key, value, Some(options)))
            .await?;
        Ok(())
    }

    /// The value under `key`, if any.
    pub async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetadataError> {
        let mut client = self.client.lock().await.clone();
        let got = self.bounded("get", client.get(key, None)).await?;
        Ok(got.kvs().first().map(|kv| kv.value().to_vec()))
    }

    /// Removes `key` (nothing if it is absent).
    pub async fn delete(&self, key: &str) -> Result<(), MetadataError> {
        let mut client = self.client.lock().await.clone();
        self.bounded("delete", client.delete(key, None)).await?;
        Ok(())
    }

    /// `call` bounded by this client's call timeout.
    async fn bounded<T>(
        &self,
        op: &'static str,
        call: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, MetadataError> {
        bounded(&self.endpoint, op, self.call_timeout, call).await
    }

    /// Ends the lease: every leased record of this client goes now.
    pub async fn revoke(&self) -> Result<(), MetadataError> {
        let lease = self.lease.lock().await.take();
        if let Some(lease) = lease {
            let mut client = self.client.lock().await.clone();
            lease.revoke(&mut client, &self.endpoint).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_endpoint_is_taken_over_http() {
        assert_eq!(url_of("127.0.0.1:2379"), "http://127.0.0.1:2379");
        assert_eq!(url_of(" host:1 "), "http://host:1");
        assert_eq!(url_of("https://host:1"), "https://host:1");
    }

    /// An etcd of its own on free ports, stopped (and its data removed) when dropped.
    struct Etcd {
        child: std::process::Child,
        dir: std::path::PathBuf,
        endpoint: String,
    }

    impl Drop for Etcd {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn free_port() -> u16 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    }

    /// Starts etcd, or says why not (`None`: skip), failing instead under
    /// `FERRY_REQUIRE_ETCD` (docs/environment.md).
    fn start_etcd() -> Option<Etcd> {
        let found = std::process::Command::new("etcd").arg("--version").output();
        if found.is_err() {
            assert!(
                std::env::var_os("FERRY_REQUIRE_ETCD").is_none(),
                "FERRY_REQUIRE_ETCD is set, but there is no etcd binary"
            );
            eprintln!("skipped: no etcd binary (Debian: apt-get install etcd-server)");
            return None;
        }
        let (client, peer) = (free_port(), free_port());
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let dir = std::env::temp_dir().join(format!(
            "ferry-metadata-etcd-{}-{client}",
            std::process::id()
        ));
        let child = std::process::Command::new("etcd")
            .arg("--data-dir")
            .arg(&dir)
            .args(["--name", "ferry-test", "--listen-client-urls", &url])
            .args([
                "--advertise-client-urls",
                &url,
                "--listen-peer-urls",
                &peer_url,
            ])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("ferry-test={peer_url}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let etcd = Etcd {
            child,
            dir,
            endpoint: format!("127.0.0.1:{client}"),
        };
        let t0 = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", client)).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "etcd did not listen in 20 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(etcd)
    }

    /// Records round trip under the client's lease; a revoked lease takes them at once, and
    /// a client dropped (its lease no longer kept alive) takes them within the lease's time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn leased_records_live_with_their_client() {
        let Some(etcd) = start_etcd() else { return };
        let ttl = Duration::from_secs(1);
        let kv = EtcdKv::connect(&etcd.endpoint, ttl).await.unwrap();
        kv.put_leased("/t/a", b"1".to_vec()).await.unwrap();
        kv.put_leased("/t/b", b"2".to_vec()).await.unwrap();
        assert_eq!(kv.get("/t/a").await.unwrap().as_deref(), Some(&b"1"[..]));
        kv.delete("/t/a").await.unwrap();
        assert_eq!(kv.get("/t/a").await.unwrap(), None);
        // Kept alive past its time while the client lives.
        let other = EtcdKv::connect(&etcd.endpoint, ttl).await.unwrap();
        tokio::time::sleep(ttl * 3).await;
        assert_eq!(other.get("/t/b").await.unwrap().as_deref(), Some(&b"2"[..]));
        kv.revoke().await.unwrap();
        assert_eq!(other.get("/t/b").await.unwrap(), None);
        // A record put after a revoke gets a new lease; the client's drop lets it lapse.
        kv.put_leased("/t/c", b"3".to_vec()).await.unwrap();
        drop(kv);
        let t0 = std::time::Instant::now();
        while other.get("/t/c").await.unwrap().is_some() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the record outlived its lease"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A refusing endpoint and a frozen one (a listener that accepts and never answers) fail
    /// `connect` with the endpoint named, within the bound: the client's lazy channel would
    /// otherwise hand out a client that finds out at its first call, or never.
    #[tokio::test(flavor = "current_thread")]
    async fn a_refusing_or_frozen_endpoint_fails_connect_naming_it() {
        let closed = free_port();
        let endpoint = format!("127.0.0.1:{closed}");
        let Err(err) = connect_within(&endpoint, Duration::from_secs(5)).await else {
            panic!("nothing listens there, yet connect succeeded");
        };
        assert!(
            matches!(&err, MetadataError::Connect { endpoint: e, .. } if *e == endpoint),
            "{err}"
        );
        let frozen = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = frozen.local_addr().unwrap().to_string();
        let bound = Duration::from_millis(300);
        let got = tokio::time::timeout(Duration::from_secs(30), connect_within(&endpoint, bound))
            .await
            .expect("connect_within is bounded");
        let Err(err) = got else {
            panic!("the endpoint never answers, yet connect succeeded");
        };
        assert!(
            matches!(&err, MetadataError::Connect { endpoint: e, reason } if *e == endpoint
                && reason.contains("no answer")),
            "{err}"
        );
        assert!(err.to_string().contains(&endpoint), "{err}");
    }

    /// A store that stops answering (etcd sent SIGSTOP) fails each call with `Timeout` naming
    /// the endpoint and the call, within the client's bound; once it answers again, so do the
    /// calls.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_frozen_store_times_calls_out_and_serves_them_once_it_thaws() {
        let Some(etcd) = start_etcd() else { return };
        let signal = |sig: &str| {
            let ok = std::process::Command::new("kill")
                .args([sig, &etcd.child.id().to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "kill {sig} etcd");
        };
        let kv = EtcdKv::connect(&etcd.endpoint, Duration::from_secs(10))
            .await
            .unwrap()
            .with_call_timeout(Duration::from_millis(500));
        kv.put_leased("/f/a", b"1".to_vec()).await.unwrap();
        signal("-STOP");
        let calls = async {
            let get = kv.get("/f/a").await;
            let put = kv.put_leased("/f/b", b"2".to_vec()).await;
            (get, put)
        };
        let got = tokio::time::timeout(Duration::from_secs(30), calls).await;
        signal("-CONT");
        let (get, put) = got.expect("the calls are bounded");
        for (r, op) in [(get.map(|_| ()), "get"), (put, "put")] {
            let err = r.expect_err("etcd is stopped");
            assert!(
                matches!(&err, MetadataError::Timeout { endpoint, op: o, .. }
                    if *endpoint == etcd.endpoint && *o == op),
                "{err}"
            );
        }
        // Thawed: the calls are answered again (the first may still meet the backlog).
        let t0 = std::time::Instant::now();
        loop {
            match kv.get("/f/a").await {
                Ok(v) => {
                    assert_eq!(v.as_deref(), Some(&b"1"[..]));
                    break;
                }
                Err(MetadataError::Timeout { .. }) if t0.elapsed() < Duration::from_secs(20) => {}
                Err(e) => panic!("after the thaw: {e}"),
            }
        }
    }
}

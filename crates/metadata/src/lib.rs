//! Ferry's metadata room: the one etcd client of the project.
//!
//! Records that name processes (a broadcast's members, the Mooncake layer's endpoint records,
//! NIXL agents' metadata) are kept in etcd by three layers; this crate is what each of them
//! uses to reach it: [`connect`] (one endpoint, a bounded wait, an error naming it), [`Lease`]
//! (a lease kept alive by a task until it is dropped or revoked, so a process that dies takes
//! its records with it within the lease's time) and [`EtcdKv`] (plain records under one
//! lease). Broadcast discovery (`ferry_broadcast::Etcd`) builds its member list on
//! [`connect`] and [`Lease`]; the Python package's `EtcdKv`, which its Mooncake and NIXL
//! layers use, is [`EtcdKv`].
//!
//! It imports no crate of Ferry's: it sits beside the bottom of the map, below `broadcast`
//! and `python`, which take it behind their `etcd` feature (etcd-client's build runs `protoc`).
//! Errors are [`MetadataError`], naming the endpoint. [`etcd_client`] is re-exported for the
//! layers that speak more of etcd than records (watches, transactions).

#![warn(missing_docs)]
#![forbid(unsafe_code)]

use std::time::Duration;

pub use etcd_client;
use etcd_client::{Client, PutOptions};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

/// How long [`connect`] waits for an endpoint.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

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

/// Connects to the etcd at `endpoint` (`http://HOST:PORT` or `HOST:PORT`), waiting at most
/// [`CONNECT_TIMEOUT`].
pub async fn connect(endpoint: &str) -> Result<Client, MetadataError> {
    let fail = |reason: String| MetadataError::Connect {
        endpoint: endpoint.to_owned(),
        reason,
    };
    tokio::time::timeout(CONNECT_TIMEOUT, Client::connect([url_of(endpoint)], None))
        .await
        .map_err(|_| fail(format!("no answer within {} s", CONNECT_TIMEOUT.as_secs())))?
        .map_err(|e| fail(e.to_string()))
}

/// A lease and the task that keeps it alive (renewing it every third of its time) until the
/// lease is dropped (the task stops; etcd lets the lease lapse after its time) or etcd stops
/// answering (the task ends: [`alive`](Self::alive) says so).
#[derive(Debug)]
pub struct Lease {
    id: i64,
    keeper: JoinHandle<()>,
}

impl Lease {
    /// Grants a lease of `ttl` (at least one second) on `client` and keeps it alive.
    pub async fn grant(
        client: &mut Client,
        endpoint: &str,
        ttl: Duration,
    ) -> Result<Self, MetadataError> {
        let ttl = ttl.as_secs().max(1) as i64;
        let call = |op| move |e| MetadataError::call(endpoint, op, e);
        let id = client
            .lease_grant(ttl, None)
            .await
            .map_err(call("lease grant"))?
            .id();
        let (mut keeper, mut stream) = client
            .lease_keep_alive(id)
            .await
            .map_err(call("lease keep-alive"))?;
        let every = Duration::from_millis((ttl as u64 * 1000 / 3).max(200));
        let keeper = tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if keeper.keep_alive().await.is_err() {
                    break;
                }
                if !matches!(stream.message().await, Ok(Some(_))) {
                    break;
                }
            }
            tracing::debug!(lease = id, "etcd lease keep-alive ended");
        });
        Ok(Self { id, keeper })
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
        client
            .lease_revoke(self.id)
            .await
            .map_err(|e| MetadataError::call(endpoint, "lease revoke", e))?;
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
    client: Mutex<Client>,
    lease: Mutex<Option<Lease>>,
}

impl std::fmt::Debug for EtcdKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdKv")
            .field("endpoint", &self.endpoint)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl EtcdKv {
    /// Connects to the etcd at `endpoint` (`http://HOST:PORT` or `HOST:PORT`); leased records
    /// last `ttl` (at least one second) without renewal.
    pub async fn connect(endpoint: &str, ttl: Duration) -> Result<Self, MetadataError> {
        let client = connect(endpoint).await?;
        Ok(Self {
            endpoint: endpoint.to_owned(),
            ttl,
            client: Mutex::new(client),
            lease: Mutex::new(None),
        })
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
        let l = Lease::grant(&mut client, &self.endpoint, self.ttl).await?;
        let id = l.id();
        *held = Some(l);
        Ok(id)
    }

    /// Stores `value` under `key`, bound to this client's lease.
    pub async fn put_leased(&self, key: &str, value: Vec<u8>) -> Result<(), MetadataError> {
        let lease = self.lease().await?;
        let mut client = self.client.lock().await.clone();
        client
            .put(key, value, Some(PutOptions::new().with_lease(lease)))
            .await
            .map_err(|e| MetadataError::call(&self.endpoint, "put", e))?;
        Ok(())
    }

    /// The value under `key`, if any.
    pub async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetadataError> {
        let mut client = self.client.lock().await.clone();
        let got = client
            .get(key, None)
            .await
            .map_err(|e| MetadataError::call(&self.endpoint, "get", e))?;
        Ok(got.kvs().first().map(|kv| kv.value().to_vec()))
    }

    /// Removes `key` (nothing if it is absent).
    pub async fn delete(&self, key: &str) -> Result<(), MetadataError> {
        let mut client = self.client.lock().await.clone();
        client
            .delete(key, None)
            .await
            .map_err(|e| MetadataError::call(&self.endpoint, "delete", e))?;
        Ok(())
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
}

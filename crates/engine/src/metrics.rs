//! Prometheus metrics: the counters [`TransferEngine::describe`](crate::TransferEngine::describe)
//! reports, in the Prometheus text format (version 0.0.4), served over HTTP.
//!
//! Every series is derived from one [`Description`] taken at scrape time: there is no second
//! set of counters to drift from `describe()`. `prometheus-client` encodes them (names, help,
//! label escaping, histogram buckets); a small HTTP/1.1 responder on the engine's tokio runtime
//! answers `GET /metrics` (any other path is 404) and closes each connection after its answer.
//!
//! Label cardinality is bounded: peers are labelled by address, the first
//! [`MAX_PEER_LABELS`] of them (in the order the engine first met them); later ones are summed
//! under `peer="other"`. Latency histograms are engine-wide, by op kind and size class.
//!
//! The telemetry of compatibility layers' agents in this process ([`crate::agent_telemetry`])
//! is served beside the engine's own series, under NIXL's exporter names (`agent_*`, labelled
//! by `hostname` and `agent_name`): one exposition, two naming schemes.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::Error;
use ferry_transport_tcp::{HandshakeGate, HandshakeLimits};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType::{self, Counter, Gauge};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::describe::{Description, LATENCY_BOUNDS_US};

mod agents;

/// Peers labelled by their own address; the rest are summed under `peer="other"`.
pub const MAX_PEER_LABELS: usize = 64;

/// The `Content-Type` of a scrape's answer.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Longest request head read (request line and headers).
const MAX_HEAD: usize = 8192;
/// How long a connection may take to send its request head (a scraper sends it at once).
const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a connection may take to read its answer.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Scrapes answered at once; past it, the oldest connection of the source address holding the
/// most is closed to make room (a [`HandshakeGate`] that evicts), so idle connections cannot
/// keep a scrape out.
const MAX_CONNECTIONS: usize = 16;

/// The addresses metrics are served on in this process (see [`endpoints`]).
static ENDPOINTS: std::sync::Mutex<Vec<SocketAddr>> = std::sync::Mutex::new(Vec::new());

/// The addresses the engines of this process serve their metrics on now, oldest first: a
/// layer that would open an endpoint of its own serves its series on these instead.
pub fn endpoints() -> Vec<SocketAddr> {
    ENDPOINTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

/// The HTTP listener serving an engine's metrics; dropping it stops serving.
#[derive(Debug)]
pub(crate) struct MetricsServer {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.task.abort();
        let mut live = ENDPOINTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(i) = live.iter().position(|a| *a == self.addr) {
            live.remove(i);
        }
    }
}

impl MetricsServer {
    /// Binds `addr` for serving metrics on the current tokio runtime (checked here).
    pub(crate) fn bind(addr: SocketAddr) -> Result<(tokio::net::TcpListener, SocketAddr), Error> {
        if let Err(e) = tokio::runtime::Handle::try_current() {
            return Err(Error::Unavailable {
                library: "tokio runtime".into(),
                reason: format!("EngineBuilder::build with metrics needs one: {e}"),
            });
        }
        let bind_err = |e| Error::io("bind", format!("the metrics address {addr}"), e);
        let listener = std::net::TcpListener::bind(addr).map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        let local = listener.local_addr().map_err(bind_err)?;
        let listener = tokio::net::TcpListener::from_std(listener).map_err(bind_err)?;
        Ok((listener, local))
    }

    /// Serves on `listener`, bound to `addr`, what `describe` answers: the engine's description
    /// while the engine lives (`None` once it is gone: the scrape is answered 503).
    pub(crate) fn start(
        listener: tokio::net::TcpListener,
        addr: SocketAddr,
        describe: Describe,
    ) -> Self {
        let gate = HandshakeGate::new(HandshakeLimits {
            timeout: READ_TIMEOUT,
            max_pending: MAX_CONNECTIONS,
        });
        let task = tokio::spawn(async move {
            loop {
                let (stream, from) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::debug!(%addr, error = %e, "metrics accept failed");
                        // A full file table clears as connections close.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let Some(slot) = gate.admit_evicting(stream.as_fd(), from.ip()) else {
                    tracing::debug!(%addr, %from, "metrics: too many scrapes at once; closed");
                    continue;
                };
                let describe = describe.clone();
                tokio::spawn(async move {
                    if let Err(e) = answer(stream, &*describe).await {
                        tracing::debug!(%addr, %from, error = %e, "metrics scrape failed");
                    }
                    drop(slot);
                });
            }
        });
        tracing::info!(%addr, "serving metrics");
        ENDPOINTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(addr);
        Self { addr, task }
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// What a scrape reads: the engine's description now, `None` once the engine is gone.
pub(crate) type Describe = Arc<dyn Fn() -> Option<Description> + Send + Sync>;

/// Reads one request head and answers it.
async fn answer(
    mut stream: tokio::net::TcpStream,
    describe: &(dyn Fn() -> Option<Description> + Send + Sync),
) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    let read = async {
        loop {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                return Ok::<bool, std::io::Error>(false);
            }
            head.extend_from_slice(&buf[..n]);
            if head.windows(4).any(|w| w == b"\r\n\r\n") {
                return Ok(true);
            }
            // A first line that is no HTTP request line (another protocol's client, a Ferry
            // control request sent here by mistake) is answered at once, not at the deadline.
            if let Some(eol) = head.iter().position(|b| *b == b'\n')
                && !head[..eol].windows(5).any(|w| w == b"HTTP/")
            {
                return Ok(false);
            }
            if head.len() > MAX_HEAD {
                return Ok(false);
            }
        }
    };
    let complete = match tokio::time::timeout(READ_TIMEOUT, read).await {
        Ok(r) => r?,
        Err(_) => false,
    };
    let (status, content_type, body) = if !complete {
        ("400 Bad Request", "text/plain", "bad request\n".to_owned())
    } else {
        let line = head
            .split(|b| *b == b'\r')
            .next()
            .map(String::from_utf8_lossy)
            .unwrap_or_default();
        let mut words = line.split(' ');
        match (words.next(), words.next().map(|p| p.split('?').next())) {
            (Some("GET"), Some(Some("/metrics"))) => match describe() {
                Some(description) => ("200 OK", CONTENT_TYPE, render(&description)),
                None => (
                    "503 Service Unavailable",
                    "text/plain",
                    "engine gone\n".to_owned(),
                ),
            },
            (Some("GET"), _) => (
                "404 Not Found",
                "text/plain",
                "ferry serves its metrics at /metrics\n".to_owned(),
            ),
            _ => (
                "405 Method Not Allowed",
                "text/plain",
                "GET /metrics\n".to_owned(),
            ),
        }
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    out.push_str(&body);
    let write = async {
        stream.write_all(out.as_bytes()).await?;
        stream.shutdown().await
    };
    tokio::time::timeout(WRITE_TIMEOUT, write)
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
}

/// The Prometheus text (version 0.0.4) of `d`.
pub fn render(d: &Description) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot(d.clone())));
    let mut out = String::new();
    // Writing to a String does not fail.
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry);
    out
}

/// One description, encoded at scrape time.
#[derive(Debug)]
struct Snapshot(Description);

type Labels = Vec<(&'static str, String)>;

/// A per-rail counter: name, help, and how to read it.
type RailFamily = (
    &'static str,
    &'static str,
    fn(&crate::RailDescription) -> u64,
);

/// One family: its rows, summed by label set.
struct Family {
    name: &'static str,
    help: &'static str,
    ty: MetricType,
    rows: BTreeMap<Labels, u64>,
}

impl Family {
    fn new(name: &'static str, help: &'static str, ty: MetricType) -> Self {
        Self {
            name,
            help,
            ty,
            rows: BTreeMap::new(),
        }
    }

    fn add(&mut self, labels: Labels, v: u64) -> &mut Self {
        let e = self.rows.entry(labels).or_default();
        *e = e.saturating_add(v);
        self
    }

    fn encode(&self, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        if self.rows.is_empty() {
            return Ok(());
        }
        let mut m = enc.encode_descriptor(self.name, self.help, None, self.ty)?;
        for (labels, v) in &self.rows {
            let fam = m.encode_family(labels)?;
            match self.ty {
                MetricType::Counter => ConstCounter::new(*v).encode(fam)?,
                _ => ConstGauge::new(i64::try_from(*v).unwrap_or(i64::MAX)).encode(fam)?,
            }
        }
        Ok(())
    }
}

/// A histogram of one label set.
struct Hist {
    sum: f64,
    count: u64,
    buckets: Vec<(f64, u64)>,
}

impl EncodeMetric for Hist {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> std::fmt::Result {
        encoder.encode_histogram::<Labels>(self.sum, self.count, &self.buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

fn labels<const N: usize>(pairs: [(&'static str, &str); N]) -> Labels {
    pairs.iter().map(|(k, v)| (*k, (*v).to_owned())).collect()
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let d = &self.0;
        encode_info(d, &mut enc)?;
        encode_client(d, &mut enc)?;
        encode_latency(d, &mut enc)?;
        encode_served(d, &mut enc)?;
        encode_registrations(d, &mut enc)?;
        encode_rails(d, &mut enc)?;
        encode_broadcasts(d, &mut enc)?;
        #[cfg(feature = "cuda")]
        encode_staging(d, &mut enc)?;
        agents::encode(d, &mut enc)?;
        Ok(())
    }
}

/// The engine's identity.
fn encode_info(d: &Description, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
    let mut info = Family::new(
        "ferry_engine_info",
        "The engine's identity (value 1): peer id, epoch (new at each start), data plane \
         (uring, tcp or none).",
        Gauge,
    );
    // The plane's name only: `describe()` adds why it was chosen, free text no label takes.
    let plane = d
        .data_plane
        .as_deref()
        .and_then(|p| p.split_whitespace().next())
        .unwrap_or("none");
    info.add(
        labels([
            ("peer_id", &d.peer_id),
            ("epoch", &d.epoch),
            ("data_plane", plane),
        ]),
        1,
    );
    info.encode(enc)?;
    Ok(())
}

/// The client side: per route, peers capped at `MAX_PEER_LABELS` (the rest as `other`).
fn encode_client(d: &Description, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
    let mut peers: Vec<&str> = Vec::new();
    for r in &d.routes {
        if !peers.contains(&r.peer.as_str()) {
            peers.push(&r.peer);
        }
    }
    let peer_label = |p: &str| -> String {
        match peers.iter().position(|x| *x == p) {
            Some(i) if i < MAX_PEER_LABELS => p.to_owned(),
            _ => "other".to_owned(),
        }
    };
    let mut bytes = Family::new(
        "ferry_bytes",
        "Bytes of ops this engine completed (acknowledged) as a client, by peer, transport, \
         op kind and route (direct, or staged through pinned host buffers).",
        Counter,
    );
    let mut ops = Family::new(
        "ferry_ops",
        "Ops this engine completed (acknowledged) as a client, by peer, transport, op kind \
         and route.",
        Counter,
    );
    let mut requests = Family::new(
        "ferry_requests",
        "Requests finished, by peer and transport.",
        Counter,
    );
    let mut failures = Family::new(
        "ferry_request_failures",
        "Requests that ended with a failure, by the kind of their first failure.",
        Counter,
    );
    let mut replays = Family::new(
        "ferry_replays",
        "Ops run again after a lost connection (whole ops).",
        Counter,
    );
    let mut replayed_bytes = Family::new(
        "ferry_replayed_bytes",
        "Bytes of the ops run again after a lost connection.",
        Counter,
    );
    let mut reconnects = Family::new(
        "ferry_reconnects",
        "Channels reopened to the same peer incarnation.",
        Counter,
    );
    let mut reconnect_attempts = Family::new(
        "ferry_reconnect_attempts",
        "Reconnect attempts, successful or not.",
        Counter,
    );
    let mut reconnect_failures = Family::new(
        "ferry_reconnect_failures",
        "Reconnects given up (attempts ran out, or the peer restarted).",
        Counter,
    );
    for r in &d.routes {
        let peer = peer_label(&r.peer);
        let route = || labels([("peer", &peer), ("transport", &r.transport)]);
        for t in &r.traffic {
            let l = labels([
                ("peer", &peer),
                ("transport", &r.transport),
                ("op", &t.op),
                ("route", &t.route),
            ]);
            bytes.add(l.clone(), t.bytes);
            ops.add(l, t.ops);
        }
        requests.add(route(), r.requests);
        for (kind, n) in &r.failures {
            failures.add(
                labels([("peer", &peer), ("transport", &r.transport), ("kind", kind)]),
                *n,
            );
        }
        replays.add(route(), r.replays);
        replayed_bytes.add(route(), r.replayed_bytes);
        reconnects.add(route(), r.reconnects);
        reconnect_attempts.add(route(), r.reconnect_attempts);
        reconnect_failures.add(route(), r.reconnect_failures);
    }
    for f in [
        &bytes,
        &ops,
        &requests,
        &failures,
        &replays,
        &replayed_bytes,
        &reconnects,
        &reconnect_attempts,
        &reconnect_failures,
    ] {
        f.encode(enc)?;
    }
    Ok(())
}

/// The latency histograms, by op kind and size class.
fn encode_latency(d: &Description, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
    if !d.latency.is_empty() {
        let mut m = enc.encode_descriptor(
            "ferry_request_duration_seconds",
            "Request latency from submission to the logical outcome, by op kind (or mixed) \
             and size class (the range of the request's bytes: 0-4KiB, 4KiB-64KiB, \
             64KiB-1MiB, 1MiB-16MiB, 16MiB+).",
            None,
            MetricType::Histogram,
        )?;
        for l in &d.latency {
            let mut buckets: Vec<(f64, u64)> = LATENCY_BOUNDS_US
                .iter()
                .zip(&l.buckets)
                .map(|(b, n)| (*b as f64 / 1e6, *n))
                .collect();
            buckets.push((f64::INFINITY, l.buckets.last().copied().unwrap_or(0)));
            let h = Hist {
                sum: l.sum_ns as f64 / 1e9,
                count: l.count,
                buckets,
            };
            let set = labels([("op", &l.op), ("size", &l.size)]);
            h.encode(m.encode_family(&set)?)?;
        }
    }
    Ok(())
}

/// The server side: what the listener accepted and refused, and its handshakes.
fn encode_served(d: &Description, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
    if let Some(s) = &d.served {
        let mut bytes = Family::new(
            "ferry_served_bytes",
            "Bytes of ops this engine's listener accepted, by op kind (counted when \
             checked, before they move).",
            Counter,
        );
        let mut ops = Family::new(
            "ferry_served_ops",
            "Ops this engine's listener accepted, by op kind.",
            Counter,
        );
        let mut refused = Family::new(
            "ferry_served_refusals",
            "Requests this engine's listener refused, by status.",
            Counter,
        );
        for t in &s.accepted {
            bytes.add(labels([("op", &t.op)]), t.bytes);
            ops.add(labels([("op", &t.op)]), t.ops);
        }
        for (status, n) in &s.refused {
            refused.add(labels([("status", status)]), *n);
        }
        bytes.encode(enc)?;
        ops.encode(enc)?;
        refused.encode(enc)?;
    }
    if let Some(h) = &d.handshakes {
        Family::new(
            "ferry_handshakes_pending",
            "Connections in their handshake now (before authentication).",
            Gauge,
        )
        .add(Labels::new(), h.pending)
        .encode(enc)?;
        Family::new(
            "ferry_handshakes_max_pending",
            "The cap on connections in their handshake at once.",
            Gauge,
        )
        .add(Labels::new(), h.max_pending)
        .encode(enc)?;
        Family::new(
            "ferry_handshake_refusals",
            "Connections closed before their handshake ended: past the cap on pending \
             handshakes (reason=cap), to make room for a newer one past it \
             (reason=evicted), or at the handshake deadline (reason=timeout).",
            Counter,
        )
        .add(labels([("reason", "cap")]), h.refused)
        .add(labels([("reason", "evicted")]), h.evicted)
        .add(labels([("reason", "timeout")]), h.timed_out)
        .encode(enc)?;
    }
    Ok(())
}

/// Registrations, their native copies per context, the registration cache, published segments.
fn encode_registrations(d: &Description, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
    Family::new("ferry_registrations", "Live registrations.", Gauge)
        .add(Labels::new(), d.registrations)
        .encode(enc)?;
    Family::new(
        "ferry_registered_bytes",
        "Bytes of live registrations, each range once.",
        Gauge,
    )
    .add(Labels::new(), d.registered_bytes)
    .encode(enc)?;
    Family::new(
        "ferry_registration_budget_bytes",
        "Bytes charged to the registration budget (each native copy charges its range).",
        Gauge,
    )
    .add(Labels::new(), d.budget_bytes)
    .encode(enc)?;
    Family::new(
        "ferry_registrations_unquiesced",
        "Registrations held because a native destroy failed.",
        Gauge,
    )
    .add(Labels::new(), d.unquiesced)
    .encode(enc)?;
    let mut copies = Family::new(
        "ferry_device_registrations",
        "Native registration copies (RDMA: memory regions) per registration context \
         (device:port, or host).",
        Gauge,
    );
    let mut copy_bytes = Family::new(
        "ferry_device_registered_bytes",
        "Bytes the native registration copies of each context cover.",
        Gauge,
    );
    for c in &d.contexts {
        copies.add(labels([("device", &c.name)]), c.copies);
        copy_bytes.add(labels([("device", &c.name)]), c.bytes);
    }
    copies.encode(enc)?;
    copy_bytes.encode(enc)?;
    if let Some(c) = &d.registration_cache {
        Family::new(
            "ferry_registration_cache_hits",
            "Native registration copies served by an existing copy of the same pages.",
            Counter,
        )
        .add(Labels::new(), c.hits)
        .encode(enc)?;
        Family::new(
            "ferry_registration_cache_misses",
            "Native registration copies made.",
            Counter,
        )
        .add(Labels::new(), c.misses)
        .encode(enc)?;
    }
    Family::new(
        "ferry_published_segments",
        "Segments published (memory and files).",
        Gauge,
    )
    .add(Labels::new(), d.published.len() as u64)
    .encode(enc)?;
    Ok(())
}

/// RDMA rails.
fn encode_rails(d: &Description, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
    let rail_families: [RailFamily; 9] = [
        (
            "ferry_rail_bytes",
            "Bytes acknowledged per RDMA rail.",
            |r| r.bytes,
        ),
        (
            "ferry_rail_work_requests",
            "Work requests acknowledged per RDMA rail.",
            |r| r.work_requests,
        ),
        (
            "ferry_rail_errors",
            "Error completions per RDMA rail.",
            |r| r.errors,
        ),
        (
            "ferry_rail_flushed",
            "Flushed work requests per RDMA rail.",
            |r| r.flushed,
        ),
        (
            "ferry_rail_unproven",
            "Unsignalled work requests before an error completion on this RDMA rail, replayed rather than counted acknowledged.",
            |r| r.unproven,
        ),
        (
            "ferry_rail_replays",
            "Chunks of a failed rail this rail re-posted.",
            |r| r.replayed,
        ),
        (
            "ferry_rail_replayed_bytes",
            "Bytes of the chunks this rail re-posted for a failed rail.",
            |r| r.replayed_bytes,
        ),
        (
            "ferry_rail_teardowns",
            "Failed queue pairs of this RDMA rail destroyed once flushed.",
            |r| r.torn_down,
        ),
        (
            "ferry_rail_rebuilds",
            "Times this RDMA rail rejoined a channel on a fresh queue pair after its port came back.",
            |r| r.rebuilds,
        ),
    ];
    for (name, help, get) in rail_families {
        let mut f = Family::new(name, help, Counter);
        for r in &d.rails {
            f.add(labels([("rail", &r.rail)]), get(r));
        }
        f.encode(enc)?;
    }
    let mut down = Family::new(
        "ferry_rail_down",
        "Channels on which this RDMA rail is down now (failed, not yet rebuilt).",
        Gauge,
    );
    for r in &d.rails {
        down.add(labels([("rail", &r.rail)]), r.down);
    }
    down.encode(enc)?;
    Ok(())
}

/// Broadcasts, by role, name and version (at most `MAX_BROADCASTS` of them).
fn encode_broadcasts(d: &Description, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
    type BroadcastFamily = (
        &'static str,
        &'static str,
        MetricType,
        fn(&crate::BroadcastDescription) -> u64,
    );
    let broadcast_families: [BroadcastFamily; 5] = [
        (
            "ferry_broadcast_bytes",
            "Bytes of a broadcast version verified (a receiver) or published (a source).",
            Gauge,
            |b| b.bytes,
        ),
        (
            "ferry_broadcast_size_bytes",
            "Payload bytes of a broadcast version.",
            Gauge,
            |b| b.total_bytes,
        ),
        (
            "ferry_broadcast_refetched_chunks",
            "Chunks of a broadcast version fetched again after a failed check.",
            Counter,
            |b| b.refetched,
        ),
        (
            "ferry_broadcast_members",
            "Members of a broadcast version listed.",
            Gauge,
            |b| b.peers,
        ),
        (
            "ferry_broadcast_done",
            "1 once every chunk of a broadcast version is verified (a receiver) or the source \
             stopped.",
            Gauge,
            |b| u64::from(b.done),
        ),
    ];
    for (name, help, ty, get) in broadcast_families {
        let mut f = Family::new(name, help, ty);
        for b in &d.broadcasts {
            let version = b.version.to_string();
            f.add(
                labels([("role", &b.role), ("name", &b.name), ("version", &version)]),
                get(b),
            );
        }
        f.encode(enc)?;
    }
    Ok(())
}

/// Staging of GPU memory.
#[cfg(feature = "cuda")]
fn encode_staging(d: &Description, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
    if let Some(s) = &d.staging {
        Family::new(
            "ferry_staged_bytes",
            "Bytes of GPU memory staged through pinned host buffers.",
            Counter,
        )
        .add(Labels::new(), s.staged_bytes)
        .encode(enc)?;
        Family::new(
            "ferry_staging_copies",
            "Copies between GPU memory and the staging buffers.",
            Counter,
        )
        .add(Labels::new(), s.copies)
        .encode(enc)?;
        Family::new(
            "ferry_staging_copy_failures",
            "Failed copies between GPU memory and the staging buffers.",
            Counter,
        )
        .add(Labels::new(), s.copy_failures)
        .encode(enc)?;
        Family::new(
            "ferry_staging_buffers_in_use",
            "Staging buffers in use now.",
            Gauge,
        )
        .add(Labels::new(), s.buffers_in_use as u64)
        .encode(enc)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::{Outcome, RemoteEffect, TransportKind};

    /// A description with every family filled, and two peers, latency classes, rails and
    /// broadcasts, renders to the committed exposition byte for byte (`metrics_golden.prom`
    /// beside this file): a change to any family's name, help, type, labels or order shows as a
    /// diff there. The staging families are in it, so it runs with the `cuda` feature.
    #[cfg(feature = "cuda")]
    #[tokio::test]
    async fn the_whole_exposition_is_as_committed() {
        use crate::describe::{
            CacheDescription, ContextDescription, HandshakeDescription, LatencyDescription,
            RouteDescription, ServedDescription, StagingDescription, TrafficDescription,
        };
        let engine = crate::TransferEngine::builder().build().unwrap();
        let mut d = engine.describe();
        let traffic = |op: &str, route: &str, ops, bytes| TrafficDescription {
            op: op.into(),
            route: route.into(),
            ops,
            bytes,
        };
        let route = |peer: &str, transport: &str, n: u64| RouteDescription {
            peer: peer.into(),
            transport: transport.into(),
            requests: n,
            ops: 2 * n,
            bytes: 4096 * n,
            errors: 1,
            replays: n + 1,
            replayed_bytes: 100 * n,
            reconnects: 1,
            reconnect_attempts: 3,
            reconnect_failures: 2,
            traffic: vec![
                traffic("read", "direct", n, 4096 * n),
                traffic("write", "staged", 1, 512),
            ],
            failures: vec![("peer_lost".into(), 1), ("timeout".into(), n)],
            same_host: None,
            gpu: None,
            one_sided: None,
        };
        d.peer_id = "00ff".into();
        d.epoch = "0a0b".into();
        d.data_plane = Some("tcp".into());
        d.routes = vec![
            route("10.0.0.1:7400", "tcp", 3),
            route("10.0.0.2:7400", "uring", 5),
            route("10.0.0.1:7400", "rdma", 7),
        ];
        d.latency = vec![
            LatencyDescription {
                op: "read".into(),
                size: "4KiB".into(),
                count: 4,
                sum_ns: 123_456,
                buckets: (0..=LATENCY_BOUNDS_US.len() as u64)
                    .map(|i| i.min(4))
                    .collect(),
            },
            LatencyDescription {
                op: "mixed".into(),
                size: "1MiB".into(),
                count: 1,
                sum_ns: 2_000_000_000,
                buckets: (0..=LATENCY_BOUNDS_US.len() as u64)
                    .map(|i| u64::from(i > 15))
                    .collect(),
            },
        ];
        d.served = Some(ServedDescription {
            accepted: vec![
                traffic("read", "direct", 9, 9000),
                traffic("write", "direct", 2, 20),
            ],
            refused: vec![("unknown_segment".into(), 4)],
            tables: 3,
        });
        d.handshakes = Some(HandshakeDescription {
            pending: 2,
            refused: 5,
            evicted: 7,
            timed_out: 6,
            max_pending: 64,
            timeout_ms: 5000,
        });
        d.registrations = 3;
        d.registered_bytes = 1 << 20;
        d.budget_bytes = 2 << 20;
        d.unquiesced = 1;
        d.contexts = vec![
            ContextDescription {
                name: "host".into(),
                copies: 2,
                bytes: 8192,
                fenced: false,
            },
            ContextDescription {
                name: "mlx5_0:1".into(),
                copies: 4,
                bytes: 16384,
                fenced: true,
            },
        ];
        d.registration_cache = Some(CacheDescription {
            hits: 7,
            misses: 8,
            entries: 2,
        });
        d.rails = vec![crate::RailDescription {
            rail: "mlx5_0:1".into(),
            bytes: 10,
            work_requests: 2,
            errors: 1,
            flushed: 3,
            unproven: 4,
            replayed: 5,
            replayed_bytes: 6,
            torn_down: 1,
            rebuilds: 1,
            down: 2,
        }];
        d.broadcasts = vec![crate::BroadcastDescription {
            role: "source".into(),
            name: "weights".into(),
            version: 3,
            bytes: 100,
            total_bytes: 200,
            refetched: 1,
            peers: 4,
            done: true,
        }];
        d.staging = Some(StagingDescription {
            policy: "auto".into(),
            gpu_direct_registration: "no".into(),
            buffers: 4,
            buffer_size: 1 << 20,
            buffers_in_use: 1,
            staged_bytes: 4096,
            copies: 2,
            copy_wait_us: 10,
            copy_failures: 1,
            last_file_path: None,
        });
        // A compatibility layer's agent (NIXL's names), set here: other tests make agents.
        d.agents = vec![crate::AgentDescription {
            agent: "prefill-0".into(),
            hostname: "node-1".into(),
            tx_bytes: 4096,
            rx_bytes: 512,
            tx_requests: 2,
            rx_requests: 1,
            tx_last_bytes: 1024,
            rx_last_bytes: 512,
            registered_bytes: 1 << 20,
            registered_last_bytes: 1 << 20,
            xfer_time_us: 130,
            xfer_last_us: 100,
            post_time_us: 9,
            post_last_us: 3,
            bounds_us: vec![10, 100],
            xfer_buckets: vec![0, 3, 0],
            post_buckets: vec![3, 0, 0],
            errors: vec![0, 0, 1, 2],
            ..Default::default()
        }];
        let text = render(&d);
        let golden = include_str!("metrics_golden.prom");
        if text != golden {
            let out = std::env::temp_dir().join("ferry-metrics-golden.prom");
            let _ = std::fs::write(&out, &text);
            panic!(
                "the exposition differs from crates/engine/src/metrics_golden.prom; this \
                 rendering is in {} (diff them; copy it over if the change is meant)",
                out.display()
            );
        }
    }

    /// Past `MAX_PEER_LABELS` peers, the later ones are summed under `peer="other"`: the
    /// series stay bounded and no byte is lost from the sum.
    #[tokio::test]
    async fn peers_past_the_cap_are_summed_under_other() {
        let engine = crate::TransferEngine::builder().build().unwrap();
        let extra = 6;
        let shape = crate::counters::Shape::of(
            [(ferry_core::OpKind::Read, 100)].into_iter(),
            crate::describe::Path::Direct,
        );
        for i in 0..MAX_PEER_LABELS + extra {
            let c = engine.inner.peers.routes.counters(
                format!("10.0.{}.{}:7400", i / 256, i % 256),
                TransportKind::Tcp,
            );
            let o = Outcome {
                completed_ops: 1,
                completed_bytes: 100,
                failure: None,
                remote_effect: RemoteEffect::None,
                drained: true,
            };
            c.record(&o, &shape, Duration::from_micros(30));
        }
        let text = engine.metrics_text();
        let series: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("ferry_bytes_total{"))
            .collect();
        assert_eq!(series.len(), MAX_PEER_LABELS + 1, "{text}");
        let other = series
            .iter()
            .find(|l| l.contains("peer=\"other\""))
            .expect("an other series");
        assert!(other.ends_with(&format!(" {}", 100 * extra)), "{other}");
        let count = format!(
            "ferry_request_duration_seconds_count{{op=\"read\",size=\"0-4KiB\"}} {}",
            MAX_PEER_LABELS + extra
        );
        assert!(text.contains(&count), "{text}");
    }

    /// Every rail counter of `describe()` is a series labelled by the rail, the unproven
    /// chunks (replayed rather than assumed acknowledged) among them; the text says so too.
    #[tokio::test]
    async fn rail_counters_are_served_per_rail() {
        let engine = crate::TransferEngine::builder().build().unwrap();
        let mut d = engine.describe();
        d.rails = vec![crate::RailDescription {
            rail: "mlx5_0:1".into(),
            bytes: 10,
            work_requests: 2,
            errors: 1,
            flushed: 3,
            unproven: 4,
            replayed: 5,
            replayed_bytes: 6,
            torn_down: 1,
            rebuilds: 1,
            down: 0,
        }];
        let text = render(&d);
        for (name, v) in [
            ("ferry_rail_bytes_total", 10),
            ("ferry_rail_flushed_total", 3),
            ("ferry_rail_unproven_total", 4),
            ("ferry_rail_replays_total", 5),
            ("ferry_rail_rebuilds_total", 1),
            ("ferry_rail_down", 0),
        ] {
            let line = format!("{name}{{rail=\"mlx5_0:1\"}} {v}");
            assert!(text.lines().any(|l| l == line), "no `{line}` in\n{text}");
        }
        assert!(d.to_string().contains("4 unproven chunks replayed"), "{d}");
    }

    /// A broadcast's report is served by role, name and version, and a later report of the
    /// same version replaces the earlier one's values.
    #[tokio::test]
    async fn broadcast_progress_is_served_per_name_and_version() {
        let engine = crate::TransferEngine::builder().build().unwrap();
        let report = |version, bytes, done| crate::BroadcastDescription {
            role: "receiver".into(),
            name: "weights".into(),
            version,
            bytes,
            total_bytes: 4096,
            refetched: 1,
            peers: 3,
            done,
        };
        engine.report_broadcast(report(7, 1024, false));
        engine.report_broadcast(report(7, 4096, true));
        engine.report_broadcast(report(8, 0, false));
        let text = engine.metrics_text();
        let v7 = "{role=\"receiver\",name=\"weights\",version=\"7\"}";
        let v8 = "{role=\"receiver\",name=\"weights\",version=\"8\"}";
        for line in [
            format!("ferry_broadcast_bytes{v7} 4096"),
            format!("ferry_broadcast_done{v7} 1"),
            format!("ferry_broadcast_bytes{v8} 0"),
            format!("ferry_broadcast_size_bytes{v8} 4096"),
            format!("ferry_broadcast_refetched_chunks_total{v7} 1"),
            format!("ferry_broadcast_members{v8} 3"),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from\n{text}"
            );
        }
        assert!(
            engine
                .describe()
                .to_string()
                .contains("broadcast weights v7 (receiver): 4096 of 4096 bytes, done"),
            "{}",
            engine.describe()
        );
    }
}

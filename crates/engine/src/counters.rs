//! The live counters of requests, by route (peer and transport), path, op kind and outcome;
//! [`RouteCounters::snapshot`] turns them into what `describe()` reports.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ferry_core::{OpKind, Outcome, TransportKind};

use crate::describe::Path;
use crate::describe::{
    FAILURES, LATENCY_BOUNDS_US, LatencyDescription, RouteDescription, TrafficDescription,
    failure_index,
};

/// The op kinds counted per route, in the order of [`RouteCounters`]' arrays.
const KINDS: [OpKind; 3] = [OpKind::Read, OpKind::Write, OpKind::Checksum];

fn kind_index(kind: OpKind) -> usize {
    match kind {
        OpKind::Read => 0,
        OpKind::Write => 1,
        OpKind::Checksum => 2,
    }
}

/// What a request carries, kept from submission for its counters: the kind of its ops (or
/// each op's kind and length when they differ) and its bytes.
#[derive(Clone, Debug)]
pub(crate) struct Shape {
    ops: Kinds,
    bytes: u64,
    path: Path,
}

#[derive(Clone, Debug)]
enum Kinds {
    /// Every op is of this kind.
    One(OpKind),
    /// Each op's kind and length.
    Mixed(Arc<[(OpKind, u64)]>),
}

impl Shape {
    /// The shape of ops of these kinds and lengths, moved along `path`.
    pub(crate) fn of(ops: impl Iterator<Item = (OpKind, u64)> + Clone, path: Path) -> Self {
        let mut first = None;
        let mut mixed = false;
        let mut bytes = 0u64;
        for (kind, len) in ops.clone() {
            bytes = bytes.saturating_add(len);
            match first {
                None => first = Some(kind),
                Some(k) if k != kind => mixed = true,
                Some(_) => {}
            }
        }
        let ops = match (first, mixed) {
            (_, true) => Kinds::Mixed(ops.collect()),
            (Some(k), false) => Kinds::One(k),
            (None, false) => Kinds::One(OpKind::Read),
        };
        Self { ops, bytes, path }
    }
}

/// Request latency classes by the request's bytes: at most each bound (and more than the one
/// before); the label names the range, so that an 8 MiB request reads `1MiB-16MiB`.
pub(crate) const SIZE_CLASSES: [(u64, &str); 5] = [
    (4 << 10, "0-4KiB"),
    (64 << 10, "4KiB-64KiB"),
    (1 << 20, "64KiB-1MiB"),
    (16 << 20, "1MiB-16MiB"),
    (u64::MAX, "16MiB+"),
];

/// The op label of a request's latency: its ops' kind, or `mixed`.
const LATENCY_OPS: [&str; 4] = ["read", "write", "checksum", "mixed"];

#[derive(Debug, Default)]
struct Histogram {
    /// Per bucket (not cumulative); the last one past every bound.
    buckets: [AtomicU64; LATENCY_BOUNDS_US.len() + 1],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

/// Request latencies of the whole engine (submission to the logical outcome), by op kind and
/// size class: a bounded set of series whatever the number of peers.
#[derive(Debug, Default)]
pub(crate) struct Latencies {
    by: [[Histogram; SIZE_CLASSES.len()]; LATENCY_OPS.len()],
}

impl Latencies {
    fn record(&self, shape: &Shape, took: Duration) {
        let op = match &shape.ops {
            Kinds::One(k) => kind_index(*k),
            Kinds::Mixed(_) => 3,
        };
        let size = SIZE_CLASSES
            .iter()
            .position(|(max, _)| shape.bytes <= *max)
            .unwrap_or(SIZE_CLASSES.len() - 1);
        let h = &self.by[op][size];
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let bucket = LATENCY_BOUNDS_US
            .iter()
            .position(|b| us <= *b)
            .unwrap_or(LATENCY_BOUNDS_US.len());
        h.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        h.sum_ns.fetch_add(
            u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        h.count.fetch_add(1, Ordering::Relaxed);
    }

    /// The histograms that saw a request.
    pub(crate) fn snapshot(&self) -> Vec<LatencyDescription> {
        let mut out = Vec::new();
        for (op, row) in LATENCY_OPS.iter().zip(&self.by) {
            for ((_, size), h) in SIZE_CLASSES.iter().zip(row) {
                let count = h.count.load(Ordering::Relaxed);
                if count == 0 {
                    continue;
                }
                out.push(LatencyDescription {
                    op: (*op).to_owned(),
                    size: (*size).to_owned(),
                    count,
                    sum_ns: h.sum_ns.load(Ordering::Relaxed),
                    buckets: h
                        .buckets
                        .iter()
                        .map(|b| b.load(Ordering::Relaxed))
                        .collect(),
                });
            }
        }
        out
    }
}

/// Counters of one route (peer and transport).
#[derive(Debug, Default)]
pub(crate) struct RouteCounters {
    pub(crate) requests: AtomicU64,
    pub(crate) ops: AtomicU64,
    pub(crate) bytes: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) replays: AtomicU64,
    pub(crate) replayed_bytes: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) reconnect_attempts: AtomicU64,
    pub(crate) reconnect_failures: AtomicU64,
    /// Ops and bytes completed, by path and op kind.
    by_op: [[(AtomicU64, AtomicU64); 3]; 2],
    /// Failed requests by the kind of their first failure.
    failures: [AtomicU64; FAILURES.len()],
    /// The engine's latency histograms (shared by every route).
    latencies: Arc<Latencies>,
    /// Why the same-host plane was not taken on this route.
    same_host: std::sync::Mutex<Option<String>>,
    /// How the channel moves GPU buffers, where its plane has a choice (at connect).
    gpu: std::sync::Mutex<Option<String>>,
    /// The channel opened at connect, asked what it moves one-sidedly when described.
    channel: std::sync::Mutex<Option<std::sync::Weak<dyn ferry_core::Channel>>>,
}

impl RouteCounters {
    /// Counters feeding `latencies`.
    pub(crate) fn new(latencies: Arc<Latencies>) -> Self {
        Self {
            latencies,
            ..Self::default()
        }
    }

    /// Records the outcome of a request of `shape` that took `took` from submission.
    pub(crate) fn record(&self, o: &Outcome, shape: &Shape, took: Duration) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.ops
            .fetch_add(o.completed_ops as u64, Ordering::Relaxed);
        self.bytes.fetch_add(o.completed_bytes, Ordering::Relaxed);
        let path = match shape.path {
            Path::Direct => 0,
            Path::Staged => 1,
        };
        match &shape.ops {
            Kinds::One(k) => {
                let (ops, bytes) = &self.by_op[path][kind_index(*k)];
                ops.fetch_add(o.completed_ops as u64, Ordering::Relaxed);
                bytes.fetch_add(o.completed_bytes, Ordering::Relaxed);
            }
            Kinds::Mixed(each) => {
                for (k, len) in each.iter().take(o.completed_ops) {
                    let (ops, bytes) = &self.by_op[path][kind_index(*k)];
                    ops.fetch_add(1, Ordering::Relaxed);
                    bytes.fetch_add(*len, Ordering::Relaxed);
                }
            }
        }
        if let Some(f) = o.failure {
            self.errors.fetch_add(1, Ordering::Relaxed);
            self.failures[failure_index(f.kind)].fetch_add(1, Ordering::Relaxed);
        }
        self.latencies.record(shape, took);
    }

    pub(crate) fn snapshot(&self, peer: String, transport: TransportKind) -> RouteDescription {
        let mut traffic = Vec::new();
        for (path, row) in Path::ALL.iter().zip(&self.by_op) {
            for (kind, (ops, bytes)) in KINDS.iter().zip(row) {
                let ops = ops.load(Ordering::Relaxed);
                if ops == 0 {
                    continue;
                }
                traffic.push(TrafficDescription {
                    op: kind.to_string(),
                    route: path.name().to_owned(),
                    ops,
                    bytes: bytes.load(Ordering::Relaxed),
                });
            }
        }
        let failures = FAILURES
            .iter()
            .zip(&self.failures)
            .map(|(k, n)| ((*k).to_owned(), n.load(Ordering::Relaxed)))
            .filter(|(_, n)| *n > 0)
            .collect();
        RouteDescription {
            peer,
            transport: transport.name().to_owned(),
            requests: self.requests.load(Ordering::Relaxed),
            ops: self.ops.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            replays: self.replays.load(Ordering::Relaxed),
            replayed_bytes: self.replayed_bytes.load(Ordering::Relaxed),
            reconnects: self.reconnects.load(Ordering::Relaxed),
            reconnect_attempts: self.reconnect_attempts.load(Ordering::Relaxed),
            reconnect_failures: self.reconnect_failures.load(Ordering::Relaxed),
            traffic,
            failures,
            same_host: self
                .same_host
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
            gpu: self
                .gpu
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
            one_sided: self
                .channel
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .as_ref()
                .and_then(std::sync::Weak::upgrade)
                .and_then(|c| c.one_sided()),
        }
    }

    /// Records how the route's channel moves GPU buffers (at connect).
    pub(crate) fn gpu_route(&self, route: Option<String>) {
        *self
            .gpu
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = route;
    }

    /// Records the channel opened at connect (held weakly: asked what it moves one-sidedly).
    pub(crate) fn channel(&self, channel: &Arc<dyn ferry_core::Channel>) {
        *self
            .channel
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::downgrade(channel));
    }

    /// Records why the same-host plane was not taken on this route (at connect).
    pub(crate) fn same_host_not_taken(&self, why: String) {
        *self
            .same_host
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(why);
    }
}

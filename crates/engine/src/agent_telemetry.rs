//! Telemetry of the transfer agents of a compatibility layer (NIXL's `nixl_agent` on Ferry):
//! what each agent's transfers and registrations added up to, recorded by the layer as they
//! end, and served by every metrics endpoint of the process beside the engine's own series,
//! under the names NIXL's Prometheus exporter gives them ([`crate::metrics`]).
//!
//! The set is process-wide, as NIXL's exporter registry is: an agent's series are served while
//! its [`AgentTelemetry`] lives, by whichever engine of the process serves metrics, and an
//! agent name is taken once at a time. Recording is a few relaxed atomic additions; nothing
//! is recorded on the data path itself.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use ferry_core::Error;

/// NIXL's default upper bounds of the transfer-time histograms, in microseconds (10 us to
/// 10 s; a last bucket past them).
pub const DEFAULT_BOUNDS_US: [u64; 18] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
    500_000, 1_000_000, 5_000_000, 10_000_000,
];

/// The statuses of the errors an agent counts, as NIXL's exporter labels them (`status`).
pub const ERROR_STATUSES: [&str; 12] = [
    "not_posted",
    "invalid_param",
    "backend",
    "not_found",
    "mismatch",
    "not_allowed",
    "repost_active",
    "unknown",
    "not_supported",
    "remote_disconnect",
    "canceled",
    "no_telemetry",
];

/// The live agents of this process (dead entries are pruned as agents come and go).
static AGENTS: Mutex<Vec<Weak<Counters>>> = Mutex::new(Vec::new());

/// One agent's counters.
#[derive(Debug)]
struct Counters {
    agent: String,
    hostname: String,
    bounds_us: Vec<u64>,
    /// Indexed by the `Slot`s below.
    values: [AtomicU64; SLOTS],
    /// Errors by status, in the order of [`ERROR_STATUSES`].
    errors: [AtomicU64; 12],
    /// Transfer times per bucket (not cumulative), one past the last bound.
    xfer_buckets: Vec<AtomicU64>,
    /// Post times per bucket, as `xfer_buckets`.
    post_buckets: Vec<AtomicU64>,
}

const TX_BYTES: usize = 0;
const RX_BYTES: usize = 1;
const TX_REQUESTS: usize = 2;
const RX_REQUESTS: usize = 3;
const TX_LAST: usize = 4;
const RX_LAST: usize = 5;
const REGISTERED: usize = 6;
const REGISTERED_LAST: usize = 7;
const DEREGISTERED: usize = 8;
const DEREGISTERED_LAST: usize = 9;
const XFER_US: usize = 10;
const XFER_LAST_US: usize = 11;
const POST_US: usize = 12;
const POST_LAST_US: usize = 13;
const SLOTS: usize = 14;

/// One agent's telemetry, recorded by its layer and served while this lives (dropping it
/// takes its series off every endpoint).
#[derive(Debug)]
pub struct AgentTelemetry {
    counters: Arc<Counters>,
}

impl AgentTelemetry {
    /// Takes `agent`'s name for this process and starts at zero. `bounds_us` are the upper
    /// bounds of the time histograms, strictly increasing and above zero
    /// ([`DEFAULT_BOUNDS_US`] is NIXL's default).
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] when an empty name, a name another live agent of this
    /// process holds (NIXL's exporter refuses it too), or bounds that are empty, zero or not
    /// increasing.
    pub fn register(agent: &str, hostname: &str, bounds_us: &[u64]) -> Result<Self, Error> {
        let invalid = |reason: String| Error::InvalidRequest { reason };
        if agent.is_empty() {
            return Err(invalid("agent telemetry needs an agent name".into()));
        }
        if bounds_us.is_empty() || bounds_us[0] == 0 || bounds_us.windows(2).any(|w| w[0] >= w[1]) {
            return Err(invalid(format!(
                "agent {agent:?}: histogram bounds must be strictly increasing microseconds \
                 above zero, not {bounds_us:?}"
            )));
        }
        let mut agents = AGENTS.lock().unwrap_or_else(PoisonError::into_inner);
        agents.retain(|w| w.strong_count() > 0);
        if agents
            .iter()
            .filter_map(Weak::upgrade)
            .any(|c| c.agent == agent)
        {
            return Err(invalid(format!(
                "agent {agent:?} already has telemetry in this process; each agent needs a \
                 name of its own"
            )));
        }
        let buckets = || (0..=bounds_us.len()).map(|_| AtomicU64::new(0)).collect();
        let counters = Arc::new(Counters {
            agent: agent.to_owned(),
            hostname: hostname.to_owned(),
            bounds_us: bounds_us.to_vec(),
            values: Default::default(),
            errors: Default::default(),
            xfer_buckets: buckets(),
            post_buckets: buckets(),
        });
        agents.push(Arc::downgrade(&counters));
        Ok(Self { counters })
    }

    /// A transfer request that ended: a WRITE counts as sent (`tx`), a READ as received
    /// (`rx`), with its bytes, its time from the post to its completion and the post's own
    /// time (microseconds), as NIXL counts a request once it is seen complete.
    pub fn transfer(&self, write: bool, bytes: u64, xfer_us: u64, post_us: u64) {
        let c = &*self.counters;
        let (total, requests, last) = if write {
            (TX_BYTES, TX_REQUESTS, TX_LAST)
        } else {
            (RX_BYTES, RX_REQUESTS, RX_LAST)
        };
        c.values[total].fetch_add(bytes, Relaxed);
        c.values[requests].fetch_add(1, Relaxed);
        c.values[last].store(bytes, Relaxed);
        c.values[XFER_US].fetch_add(xfer_us, Relaxed);
        c.values[XFER_LAST_US].store(xfer_us, Relaxed);
        c.values[POST_US].fetch_add(post_us, Relaxed);
        c.values[POST_LAST_US].store(post_us, Relaxed);
        c.xfer_buckets[bucket(&c.bounds_us, xfer_us)].fetch_add(1, Relaxed);
        c.post_buckets[bucket(&c.bounds_us, post_us)].fetch_add(1, Relaxed);
    }

    /// One registration call's bytes (all its descriptors).
    pub fn registered(&self, bytes: u64) {
        self.counters.values[REGISTERED].fetch_add(bytes, Relaxed);
        self.counters.values[REGISTERED_LAST].store(bytes, Relaxed);
    }

    /// One deregistration call's bytes.
    pub fn deregistered(&self, bytes: u64) {
        self.counters.values[DEREGISTERED].fetch_add(bytes, Relaxed);
        self.counters.values[DEREGISTERED_LAST].store(bytes, Relaxed);
    }

    /// One error the agent's API returned, by its status (one of [`ERROR_STATUSES`]); false,
    /// and nothing counted, for another status.
    pub fn error(&self, status: &str) -> bool {
        let Some(i) = ERROR_STATUSES.iter().position(|s| *s == status) else {
            return false;
        };
        self.counters.errors[i].fetch_add(1, Relaxed);
        true
    }

    /// What this agent has recorded so far.
    pub fn describe(&self) -> AgentDescription {
        self.counters.describe()
    }
}

impl Drop for AgentTelemetry {
    fn drop(&mut self) {
        let mut agents = AGENTS.lock().unwrap_or_else(PoisonError::into_inner);
        let me = Arc::downgrade(&self.counters);
        agents.retain(|w| w.strong_count() > 0 && !w.ptr_eq(&me));
    }
}

/// The bucket of `v`: the first bound at or above it, else the one past the last.
fn bucket(bounds: &[u64], v: u64) -> usize {
    bounds.partition_point(|b| *b < v)
}

impl Counters {
    fn describe(&self) -> AgentDescription {
        let v = |i: usize| self.values[i].load(Relaxed);
        let counts = |b: &[AtomicU64]| b.iter().map(|n| n.load(Relaxed)).collect();
        AgentDescription {
            agent: self.agent.clone(),
            hostname: self.hostname.clone(),
            tx_bytes: v(TX_BYTES),
            rx_bytes: v(RX_BYTES),
            tx_requests: v(TX_REQUESTS),
            rx_requests: v(RX_REQUESTS),
            tx_last_bytes: v(TX_LAST),
            rx_last_bytes: v(RX_LAST),
            registered_bytes: v(REGISTERED),
            registered_last_bytes: v(REGISTERED_LAST),
            deregistered_bytes: v(DEREGISTERED),
            deregistered_last_bytes: v(DEREGISTERED_LAST),
            xfer_time_us: v(XFER_US),
            xfer_last_us: v(XFER_LAST_US),
            post_time_us: v(POST_US),
            post_last_us: v(POST_LAST_US),
            bounds_us: self.bounds_us.clone(),
            xfer_buckets: counts(&self.xfer_buckets),
            post_buckets: counts(&self.post_buckets),
            errors: counts(&self.errors),
        }
    }
}

/// What the live agents of this process have recorded, in the order they were made.
pub fn snapshot() -> Vec<AgentDescription> {
    let agents = AGENTS.lock().unwrap_or_else(PoisonError::into_inner);
    agents
        .iter()
        .filter_map(Weak::upgrade)
        .map(|c| c.describe())
        .collect()
}

/// One agent's telemetry: running totals, the last request's (or registration's) values, and
/// the time histograms. Times are in microseconds.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct AgentDescription {
    /// The agent's name.
    pub agent: String,
    /// The host it runs on, as the layer names it.
    pub hostname: String,
    /// Bytes of the WRITEs completed.
    pub tx_bytes: u64,
    /// Bytes of the READs completed.
    pub rx_bytes: u64,
    /// WRITE requests completed.
    pub tx_requests: u64,
    /// READ requests completed.
    pub rx_requests: u64,
    /// Bytes of the last WRITE request.
    pub tx_last_bytes: u64,
    /// Bytes of the last READ request.
    pub rx_last_bytes: u64,
    /// Bytes registered, all calls.
    pub registered_bytes: u64,
    /// Bytes of the last registration call.
    pub registered_last_bytes: u64,
    /// Bytes deregistered, all calls.
    pub deregistered_bytes: u64,
    /// Bytes of the last deregistration call.
    pub deregistered_last_bytes: u64,
    /// Transfer times (post to completion), summed.
    pub xfer_time_us: u64,
    /// The last request's transfer time.
    pub xfer_last_us: u64,
    /// Post times, summed.
    pub post_time_us: u64,
    /// The last request's post time.
    pub post_last_us: u64,
    /// The histograms' upper bounds.
    pub bounds_us: Vec<u64>,
    /// Requests per transfer-time bucket (not cumulative), one past the last bound.
    pub xfer_buckets: Vec<u64>,
    /// Requests per post-time bucket, as `xfer_buckets`.
    pub post_buckets: Vec<u64>,
    /// Errors by status, in the order of [`ERROR_STATUSES`] (empty: none counted).
    pub errors: Vec<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Totals add up, the last values are the last call's, READs and WRITEs land on their own
    /// side, each time in the first bucket whose bound holds it, and a dropped agent's name
    /// is free again while a live one's is refused.
    #[test]
    fn an_agent_counts_its_requests_and_frees_its_name_when_dropped() {
        let t = AgentTelemetry::register("telemetry-test-a", "host", &[10, 100]).unwrap();
        t.transfer(true, 4096, 10, 3);
        t.transfer(true, 1024, 11, 200);
        t.transfer(false, 512, 1000, 0);
        t.registered(1 << 20);
        t.registered(8);
        t.deregistered(8);
        assert!(t.error("not_found") && t.error("not_found") && t.error("backend"));
        assert!(!t.error("no_such_status"));
        let d = t.describe();
        assert_eq!(d.errors[3], 2);
        assert_eq!(d.errors.iter().sum::<u64>(), 3);
        assert_eq!(
            (d.tx_bytes, d.tx_requests, d.tx_last_bytes),
            (5120, 2, 1024)
        );
        assert_eq!((d.rx_bytes, d.rx_requests, d.rx_last_bytes), (512, 1, 512));
        assert_eq!(
            (d.registered_bytes, d.registered_last_bytes),
            ((1 << 20) + 8, 8)
        );
        assert_eq!((d.deregistered_bytes, d.deregistered_last_bytes), (8, 8));
        assert_eq!((d.xfer_time_us, d.xfer_last_us), (1021, 1000));
        assert_eq!((d.post_time_us, d.post_last_us), (203, 0));
        assert_eq!(d.xfer_buckets, [1, 1, 1]);
        assert_eq!(d.post_buckets, [2, 0, 1]);
        assert!(snapshot().iter().any(|s| s == &d));
        let again = AgentTelemetry::register("telemetry-test-a", "host", &DEFAULT_BOUNDS_US);
        assert!(
            matches!(again, Err(Error::InvalidRequest { .. })),
            "{again:?}"
        );
        drop(t);
        assert!(snapshot().iter().all(|s| s.agent != "telemetry-test-a"));
        AgentTelemetry::register("telemetry-test-a", "host", &DEFAULT_BOUNDS_US).unwrap();
    }

    #[test]
    fn bounds_must_increase_from_above_zero() {
        for bad in [&[][..], &[0, 10], &[10, 10], &[100, 10]] {
            let r = AgentTelemetry::register("telemetry-test-b", "h", bad);
            assert!(
                matches!(r, Err(Error::InvalidRequest { .. })),
                "{bad:?}: {r:?}"
            );
        }
        assert!(AgentTelemetry::register("", "h", &DEFAULT_BOUNDS_US).is_err());
    }
}

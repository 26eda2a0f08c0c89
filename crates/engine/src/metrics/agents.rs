//! The telemetry of compatibility layers' agents ([`crate::agent_telemetry`]) under NIXL's
//! Prometheus exporter names and help texts (NIXL's `telemetryMetricDescriptor`), labelled by
//! `hostname` and `agent_name` as NIXL labels them.

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType::{self, Counter, Gauge};

use super::{Family, Hist, labels};
use crate::describe::Description;

/// The agents' telemetry under NIXL's Prometheus exporter names and help texts (NIXL's
/// `telemetryMetricDescriptor`): counters, last-value gauges and the time histograms (us).
pub(super) fn encode(d: &Description, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
    type Read = fn(&crate::AgentDescription) -> u64;
    let families: [(&'static str, &'static str, MetricType, Read); 15] = [
        (
            "agent_tx_bytes",
            "Number of bytes sent by the agent",
            Counter,
            |a| a.tx_bytes,
        ),
        (
            "agent_tx_last_bytes",
            "Bytes sent by the last request",
            Gauge,
            |a| a.tx_last_bytes,
        ),
        (
            "agent_rx_bytes",
            "Number of bytes received by the agent",
            Counter,
            |a| a.rx_bytes,
        ),
        (
            "agent_rx_last_bytes",
            "Bytes received by the last request",
            Gauge,
            |a| a.rx_last_bytes,
        ),
        (
            "agent_tx_requests_num",
            "Number of requests sent by the agent",
            Counter,
            |a| a.tx_requests,
        ),
        (
            "agent_rx_requests_num",
            "Number of requests received by the agent",
            Counter,
            |a| a.rx_requests,
        ),
        (
            "agent_memory_registered",
            "Cumulative memory registered",
            Counter,
            |a| a.registered_bytes,
        ),
        (
            "agent_memory_registered_last_bytes",
            "Memory registered by the last operation",
            Gauge,
            |a| a.registered_last_bytes,
        ),
        (
            "agent_memory_deregistered",
            "Cumulative memory deregistered",
            Counter,
            |a| a.deregistered_bytes,
        ),
        (
            "agent_memory_deregistered_last_bytes",
            "Memory deregistered by the last operation",
            Gauge,
            |a| a.deregistered_last_bytes,
        ),
        (
            "agent_xfer_time",
            "Cumulative sum of transfer time from start to completion",
            Counter,
            |a| a.xfer_time_us,
        ),
        (
            "agent_xfer_time",
            "Transfer time of the last request",
            Gauge,
            |a| a.xfer_last_us,
        ),
        (
            "agent_xfer_post_time",
            "Cumulative sum of time from start to posting to the back-end",
            Counter,
            |a| a.post_time_us,
        ),
        (
            "agent_xfer_post_time",
            "Post time of the last request",
            Gauge,
            |a| a.post_last_us,
        ),
        (
            "agent_telemetry_events_dropped",
            "Cumulative telemetry events dropped at the producer-side staging queue",
            Counter,
            |_| 0,
        ),
    ];
    if d.agents.is_empty() {
        return Ok(());
    }
    let who =
        |a: &crate::AgentDescription| labels([("hostname", &a.hostname), ("agent_name", &a.agent)]);
    for (name, help, ty, read) in families {
        let mut f = Family::new(name, help, ty);
        for a in &d.agents {
            f.add(who(a), read(a));
        }
        f.encode(enc)?;
    }
    let mut errors = Family::new("agent_errors", "Cumulative error count by status", Counter);
    for a in &d.agents {
        let statuses = crate::agent_telemetry::ERROR_STATUSES.iter();
        for (status, n) in statuses.zip(a.errors.iter().chain(std::iter::repeat(&0))) {
            let l = [
                ("hostname", &*a.hostname),
                ("agent_name", &a.agent),
                ("status", status),
            ];
            errors.add(labels(l), *n);
        }
    }
    errors.encode(enc)?;
    type Buckets = fn(&crate::AgentDescription) -> (&[u64], u64);
    let histograms: [(&'static str, &'static str, Buckets); 2] = [
        (
            "agent_xfer_time_us",
            "Distribution of transfer time from start to completion, in microseconds",
            |a| (&a.xfer_buckets, a.xfer_time_us),
        ),
        (
            "agent_xfer_post_time_us",
            "Distribution of time from start to posting to the back-end, in microseconds",
            |a| (&a.post_buckets, a.post_time_us),
        ),
    ];
    for (name, help, read) in histograms {
        let mut m = enc.encode_descriptor(name, help, None, MetricType::Histogram)?;
        for a in &d.agents {
            let (counts, sum) = read(a);
            let bounds = a.bounds_us.iter().map(|b| *b as f64).chain([f64::INFINITY]);
            let h = Hist {
                sum: sum as f64,
                count: counts.iter().sum(),
                buckets: bounds.zip(counts.iter().copied()).collect(),
            };
            h.encode(m.encode_family(&who(a))?)?;
        }
    }
    Ok(())
}

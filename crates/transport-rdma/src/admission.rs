//! Admission: the queue pairs a handshake offers (client), accepts (server) and opens into a
//! channel (client).
//!
//! The initiator's `offer()` creates one RC queue pair per rail (kept pending) and offers its
//! endpoints (GID, LID, QPN, PSN, MTU). The serving side's `accept()` pairs each offered rail with
//! one of its own (rail `k` with rail `k mod n`, or the next one whose GID is not the offered
//! one), creates and connects a queue pair for it (RESET→INIT→RTR→RTS), keeps it in the peer
//! incarnation's served set, and answers with its endpoints, echoing the initiator's PSNs: that
//! is how `open()` finds the pending queue pairs the answer belongs to before connecting them in
//! turn.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use ferry_core::wire::RdmaEndpoint;
use ferry_core::{PeerInfo, SegmentDesc, SegmentToken, TransportOffer};

use crate::channel::RdmaChannel;
use crate::error::RdmaError;
use crate::native::RcQp;
use crate::pump::{PumpLimits, Rail, RailCounters};
use crate::qp::{LocalPort, bring_up};
use crate::rails::{endpoint_of, live_rail, match_pending, pair_rail};
use crate::served::{Probe, Refused, ServedLimits};
use crate::shared::{ChannelStats, PendingSet, Shared};
use crate::verbs::{QpVerbs, SendWr, WC_SUCCESS, WrKind};

/// Pending queue-pair sets older than this are destroyed at the next offer.
const PENDING_TTL: Duration = Duration::from_secs(120);
/// At most this many pending sets are kept.
const MAX_PENDING: usize = 32;
/// How often a served queue pair is probed.
const PROBE_EVERY: Duration = Duration::from_secs(5);
/// A probe unanswered this long counts as failed: the dead-peer timeout (a queue pair whose
/// peer is gone fails its probe sooner, once its transport retries run out).
const DEAD_AFTER: Duration = Duration::from_secs(30);
/// Queue pairs kept per peer rail in one incarnation's served set: one per channel that
/// incarnation holds to this side at once.
const PER_RAIL: usize = 4;
/// The work-request id of a probe.
const PROBE_WR: u64 = u64::MAX;

/// The served-set limits `config` asks for.
pub(crate) fn served_limits(config: &crate::config::RdmaConfig) -> ServedLimits {
    ServedLimits {
        total: config.max_served,
        per_name: config.max_served_per_name,
        qps_per_name: config.max_qps_per_name,
        per_rail: PER_RAIL,
        probe_every: PROBE_EVERY,
        dead_after: DEAD_AFTER,
    }
}

/// A served queue pair is probed with a signalled zero-length RDMA WRITE: no memory is named
/// (the responder checks no remote key for zero bytes), the peer's queue pair acknowledges it
/// while it exists, and once it is gone the transport retries run out and the queue pair fails.
impl Probe for RcQp {
    fn post_probe(&self) -> bool {
        self.post_send(&[SendWr {
            wr_id: PROBE_WR,
            kind: WrKind::Write,
            local_addr: 0,
            len: 0,
            lkey: 0,
            remote_addr: 0,
            rkey: 0,
            signaled: true,
        }])
        .is_ok()
    }

    fn probe_answer(&self) -> Option<bool> {
        match self.poll(4) {
            Err(_) => Some(false),
            Ok(wcs) if wcs.is_empty() => None,
            Ok(wcs) => Some(wcs.iter().all(|w| w.status == WC_SUCCESS)),
        }
    }
}

/// Client side: one fresh queue pair per live rail, kept pending until the answer; their
/// endpoints for the hello.
pub(crate) fn offer(shared: &Shared) -> Result<Vec<RdmaEndpoint>, RdmaError> {
    let mut qps = Vec::with_capacity(shared.rails.len());
    let mut eps = Vec::with_capacity(shared.rails.len());
    for (i, rail) in shared.rails.iter().enumerate() {
        let Some(port) = live_rail(&shared.rails, i) else {
            continue;
        };
        let qp = rail.new_qp()?;
        let psn = rand::random::<u32>() & 0x00ff_ffff;
        eps.push(endpoint_of(i, &port, qp.qp_num(), psn));
        qps.push((i, psn, qp, port));
    }
    let mut pending = shared
        .pending
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    pending.retain(|p| p.created.elapsed() < PENDING_TTL);
    while pending.len() >= MAX_PENDING {
        pending.pop_front();
    }
    pending.push_back(PendingSet {
        created: Instant::now(),
        qps,
    });
    Ok(eps)
}

/// Serving side: queue pairs connected to the peer's offered rails, kept in the peer
/// incarnation's served set (see [`crate::served`]); our endpoints for the answer.
pub(crate) fn accept(shared: &Shared, peer: &PeerInfo) -> Result<Vec<RdmaEndpoint>, RdmaError> {
    let who = peer.addr.to_string();
    let TransportOffer::Rdma { rails: offered } = &peer.offer else {
        return Err(RdmaError::Connect {
            peer: who,
            reason: "the peer's offer is not an RDMA offer".into(),
        });
    };
    if offered.is_empty() {
        return Err(RdmaError::Connect {
            peer: who,
            reason: "the peer offers no RDMA rail: none of its ports is ACTIVE, or it could not \
                     create queue pairs (its log says which)"
                .into(),
        });
    }
    let qps_per_name = shared.config.max_qps_per_name;
    if peer.key_name.is_some() && offered.len() > qps_per_name {
        return Err(RdmaError::Connect {
            peer: who,
            reason: format!(
                "the peer offers {} rails; at most {} queue pairs are kept per key name",
                offered.len(),
                qps_per_name
            ),
        });
    }
    let active: Vec<(usize, LocalPort)> = (0..shared.rails.len())
        .filter_map(|i| Some((i, live_rail(&shared.rails, i)?)))
        .collect();
    let n = active.len();
    if n == 0 {
        return Err(RdmaError::Connect {
            peer: who,
            reason: "no local RDMA port is ACTIVE now (`ferry topology` shows each port's state)"
                .into(),
        });
    }
    let mut qps = Vec::with_capacity(offered.len());
    let mut answer = Vec::with_capacity(offered.len());
    for ep in offered {
        // Paired by the peer's rail index, not its place in the offer, so that a heal
        // offering one rail pairs it as the first handshake did.
        let k = usize::from(ep.rail);
        let (i, port) = &active[pair_rail(k, n, |j| active[j].1.gid == ep.gid)];
        let rail = &shared.rails[*i];
        let qp = rail.new_qp()?;
        bring_up(&qp, port, ep.psn, ep, &shared.config.timing, &who)?;
        answer.push(endpoint_of(*i, port, qp.qp_num(), ep.psn));
        qps.push((ep.rail, qp));
    }
    let now = Instant::now();
    let mut served = shared.served.lock().unwrap_or_else(PoisonError::into_inner);
    // The answers to probes first: what is dead now makes room before anything else.
    served.sweep(now);
    let incarnation = (peer.remote_id, peer.remote_epoch);
    match served.admit(incarnation, peer.key_name.as_deref(), qps, now) {
        Ok(how) => {
            tracing::info!(peer = %who, rails = answer.len(), ?how, sets = served.sets(),
                "RDMA queue pairs accepted");
            Ok(answer)
        }
        Err(refused) => {
            let reason = match refused {
                Refused::NameFull { sets, qps } => format!(
                    "the key name holds {sets} queue-pair sets ({qps} queue pairs), its \
                     limit, all of them channels in use or being opened"
                ),
                Refused::Full { sets } => {
                    format!("this side serves {sets} queue-pair sets, its limit, none of them idle")
                }
                Refused::Stale { newer } => {
                    format!(
                        "a newer start of this peer (epoch {newer}) holds proven queue pairs here"
                    )
                }
            };
            tracing::warn!(peer = %who, %reason, "RDMA queue pairs refused");
            Err(RdmaError::Connect { peer: who, reason })
        }
    }
}

/// Client side: connects the pending queue pairs the answer belongs to (found by the PSNs it
/// echoes) and starts the channel over them.
pub(crate) fn open(shared: &Arc<Shared>, peer: &PeerInfo) -> Result<RdmaChannel, RdmaError> {
    let who = peer.addr.to_string();
    let TransportOffer::Rdma { rails: answer } = &peer.offer else {
        return Err(RdmaError::Connect {
            peer: who,
            reason: "the peer's answer is not an RDMA offer".into(),
        });
    };
    if answer.is_empty() {
        return Err(RdmaError::Connect {
            peer: who,
            reason: "the peer answered with no RDMA rail".into(),
        });
    }
    let set = {
        let mut pending = shared
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let psns: Vec<Vec<u32>> = pending
            .iter()
            .map(|p| p.qps.iter().map(|(_, psn, _, _)| *psn).collect())
            .collect();
        match_pending(&psns, answer).and_then(|i| pending.remove(i))
    };
    let Some(set) = set else {
        return Err(RdmaError::Connect {
            peer: who,
            reason: "the peer's answer matches none of our pending queue pairs (it did not \
                     echo our PSNs, or they expired)"
                .into(),
        });
    };
    let mut rails = Vec::with_capacity(answer.len());
    let mut plan = Vec::with_capacity(answer.len());
    let mut stats = Vec::with_capacity(answer.len());
    for ((i, psn, qp, port), ep) in set.qps.into_iter().zip(answer) {
        let rail = &shared.rails[i];
        bring_up(&qp, &port, psn, ep, &shared.config.timing, &who)?;
        let counters = Arc::new(RailCounters::default());
        let name = format!("{}->{}", rail.name, ep.rail);
        stats.push((rail.name.clone(), counters.clone()));
        rails.push(Rail::new(Box::new(qp) as Box<dyn QpVerbs>, name, counters));
        plan.push((u32::try_from(i).unwrap_or(u32::MAX), u32::from(ep.rail)));
    }
    let stats = Arc::new(ChannelStats { rails: stats });
    shared
        .channels
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(Arc::downgrade(&stats));
    let segments: HashMap<SegmentToken, SegmentDesc> =
        peer.segments.iter().map(|s| (s.token, s.clone())).collect();
    let c = &shared.config;
    let limits = PumpLimits {
        chunk: c.chunk_size.clamp(1, 1 << 30),
        depth: usize::try_from(shared.rails.iter().map(|r| r.depth).min().unwrap_or(1))
            .unwrap_or(1),
        signal_every: usize::try_from(c.signal_every).unwrap_or(16),
        flush_timeout: c.flush_timeout,
        replay_writes: c.replay_writes,
    };
    tracing::info!(peer = %who, rails = plan.len(), "RDMA channel open");
    Ok(RdmaChannel::start(
        who,
        (peer.remote_id, peer.remote_epoch),
        shared.clone(),
        rails,
        plan,
        segments,
        limits,
        stats,
    ))
}

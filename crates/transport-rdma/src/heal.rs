//! Healing a rail: once a failed rail's local port is ACTIVE again, [`offer`] creates a fresh
//! queue pair for it and its endpoint, the handshake driver carries that offer to the same peer
//! incarnation in a new handshake (the peer's `accept()` puts the queue pair it makes in that
//! incarnation's served set, in place of the rail's old one), and [`connect`] connects the fresh
//! queue pair to the answer, for the channel to hand to its worker.

use ferry_core::wire::RdmaEndpoint;
use ferry_core::{PeerInfo, TransportOffer};
use std::sync::atomic::Ordering;

use crate::error::{RdmaError, error_chain};
use crate::native::RcQp;
use crate::qp::{LocalPort, bring_up};
use crate::rails::{endpoint_of, match_pending};
use crate::served::Incarnation;
use crate::shared::{ChannelStats, Shared};
use crate::verbs::QpVerbs;

/// Fresh queue pairs offered for a heal, waiting for the peer's answer: (channel rail, PSN,
/// queue pair, the port as it was when offered).
pub(crate) struct PendingHeal {
    qps: Vec<(usize, u32, RcQp, LocalPort)>,
}

/// What a heal needs of its channel.
pub(crate) struct HealCtx<'a> {
    /// The peer's address, for errors and logs.
    pub(crate) peer: &'a str,
    /// The incarnation the channel was opened to: heals connect to it only.
    pub(crate) remote: Incarnation,
    pub(crate) shared: &'a Shared,
    /// Per rail of the channel: (local context, remote context).
    pub(crate) plan: &'a [(u32, u32)],
    pub(crate) stats: &'a ChannelStats,
}

/// Whether a heal's answer comes from the incarnation the channel was opened to: a restarted
/// peer (another id or epoch) has other segments and keys, so nothing of the channel may be
/// connected to it.
fn same_incarnation(opened: Incarnation, answer: &PeerInfo) -> bool {
    opened == (answer.remote_id, answer.remote_epoch)
}

/// Fresh queue pairs, kept pending, for the channel's rails that are down while their local
/// port is ACTIVE again; their endpoints. `None` pending when no rail can heal now.
pub(crate) fn offer(
    ctx: &HealCtx<'_>,
) -> Result<(Vec<RdmaEndpoint>, Option<PendingHeal>), RdmaError> {
    let mut pending = PendingHeal { qps: Vec::new() };
    let mut eps = Vec::new();
    for (c, &(local, _)) in ctx.plan.iter().enumerate() {
        let down = ctx
            .stats
            .rails
            .get(c)
            .is_some_and(|(_, k)| k.down.load(Ordering::Acquire));
        let Some(rail) = usize::try_from(local)
            .ok()
            .and_then(|i| ctx.shared.rails.get(i))
        else {
            continue;
        };
        if !down {
            continue;
        }
        let port = match rail.live_port() {
            Ok(Some(p)) => p,
            Ok(None) => {
                tracing::debug!(peer = %ctx.peer, rail = %rail.name,
                    "rail is down and its port is not ACTIVE yet");
                continue;
            }
            Err(e) => {
                tracing::warn!(peer = %ctx.peer, error = %error_chain(&e),
                    "cannot read the port of a down rail");
                continue;
            }
        };
        let qp = rail.new_qp()?;
        let psn = rand::random::<u32>() & 0x00ff_ffff;
        eps.push(endpoint_of(local as usize, &port, qp.qp_num(), psn));
        pending.qps.push((c, psn, qp, port));
    }
    let pending = (!pending.qps.is_empty()).then_some(pending);
    Ok((eps, pending))
}

/// Connects the pending fresh queue pairs to `answer`, which must come from the channel's
/// incarnation (else `StaleEpoch`, and they are torn down) and echo their PSNs: each with the
/// channel rail it rejoins.
pub(crate) fn connect(
    ctx: &HealCtx<'_>,
    pending: Option<PendingHeal>,
    answer: &PeerInfo,
) -> Result<Vec<(usize, RcQp)>, ferry_core::Error> {
    let who = ctx.peer.to_owned();
    let Some(pending) = pending else {
        return Err(RdmaError::Connect {
            peer: who,
            reason: "no heal is pending (its offer was replaced, or never made)".into(),
        }
        .into());
    };
    if !same_incarnation(ctx.remote, answer) {
        tracing::warn!(peer = %who, known = %ctx.remote.1, found = %answer.remote_epoch,
            "the peer answered the heal as another incarnation: its fresh queue pairs are \
             torn down, nothing is connected to it");
        return Err(ferry_core::Error::StaleEpoch {
            addr: who,
            known: ctx.remote.1,
            found: answer.remote_epoch,
        });
    }
    let TransportOffer::Rdma { rails: eps } = &answer.offer else {
        return Err(RdmaError::Connect {
            peer: who,
            reason: "the peer's answer to a heal is not an RDMA offer".into(),
        }
        .into());
    };
    let psns = [pending.qps.iter().map(|(_, psn, _, _)| *psn).collect()];
    if match_pending(&psns, eps).is_none() {
        return Err(RdmaError::Connect {
            peer: who,
            reason: "the peer's answer to a heal does not echo the PSNs offered".into(),
        }
        .into());
    }
    let mut ready = Vec::with_capacity(eps.len());
    for ((c, psn, qp, port), ep) in pending.qps.into_iter().zip(eps) {
        let paired = ctx.plan[c].1;
        if u32::from(ep.rail) != paired {
            return Err(RdmaError::Connect {
                peer: who,
                reason: format!(
                    "the peer paired the healed rail with its rail {}, not {paired} as before",
                    ep.rail
                ),
            }
            .into());
        }
        bring_up(&qp, &port, psn, ep, &ctx.shared.config.timing, &who)?;
        ready.push((c, qp));
    }
    Ok(ready)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::{Epoch, PeerId};

    fn ep(psn: u32) -> RdmaEndpoint {
        RdmaEndpoint {
            rail: 0,
            port_num: 1,
            mtu: 5,
            lid: 0,
            gid: [1; 16],
            qpn: 7,
            psn,
        }
    }

    /// A heal connects only to the incarnation the channel was opened to: a peer that restarted
    /// (new epoch, or new id) gets none of the channel's rails, whatever it answers.
    #[test]
    fn a_heal_answered_by_another_incarnation_is_refused() {
        let (id, epoch) = (PeerId::random(), Epoch::fresh());
        let answer = |remote_id, remote_epoch| PeerInfo {
            addr: std::net::SocketAddr::from(([127, 0, 0, 1], 1)),
            local_id: PeerId::random(),
            local_epoch: Epoch::fresh(),
            remote_id,
            remote_epoch,
            offer: TransportOffer::Rdma { rails: vec![ep(1)] },
            segments: Vec::new(),
            session: None,
            key_name: None,
            version: 1,
        };
        assert!(same_incarnation((id, epoch), &answer(id, epoch)));
        assert!(!same_incarnation((id, epoch), &answer(id, Epoch::fresh())));
        assert!(!same_incarnation(
            (id, epoch),
            &answer(PeerId::random(), epoch)
        ));
    }
}

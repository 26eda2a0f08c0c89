//! The rails: a device port opened with its protection domain and completion channel, the port
//! as it is now, and how a peer's offered rail pairs with one of ours.

use std::collections::HashMap;
use std::sync::Arc;

use ferry_core::wire::RdmaEndpoint;
use ferry_verbs_sys::{Verbs, ffi};

use crate::config::{RailSpec, RdmaConfig};
use crate::error::{RdmaError, error_chain};
use crate::native::{CompChannel, Cq, Device, Faults, Pd, RcQp};
use crate::qp::LocalPort;

/// One opened rail: a device port with its protection domain.
pub(crate) struct RailCtx {
    pub(crate) name: String,
    pub(crate) local: LocalPort,
    pub(crate) active: bool,
    pub(crate) depth: u32,
    comp: Arc<CompChannel>,
    pub(crate) pd: Arc<Pd>,
}

impl RailCtx {
    /// A fresh queue pair (in RESET) on this rail, with a completion queue of its own.
    pub(crate) fn new_qp(&self) -> Result<RcQp, RdmaError> {
        let cq = Cq::create(&self.comp, self.depth.saturating_mul(2).max(16))?;
        RcQp::create(&self.pd, &cq, self.depth, self.local.port)
    }

    /// The port as it is now (`ibv_query_port`, `ibv_query_gid`): `None` while it is not ACTIVE.
    /// A healed rail connects with what the port says after the flap, not what it said at open.
    pub(crate) fn live_port(&self) -> Result<Option<LocalPort>, RdmaError> {
        let device = &self.pd.device;
        let query = |what, source| RdmaError::QueryPort {
            device: self.local.device.clone(),
            port: self.local.port,
            gid_index: self.local.gid_index,
            what,
            source,
        };
        let port = device
            .query_port(self.local.port)
            .map_err(|e| query("ibv_query_port", e))?;
        if !port.active {
            return Ok(None);
        }
        let gid = device
            .query_gid(self.local.port, self.local.gid_index)
            .map_err(|e| query("ibv_query_gid", e))?;
        if port.ethernet && gid == [0; 16] {
            return Ok(None);
        }
        Ok(Some(LocalPort {
            gid,
            lid: port.lid,
            active_mtu: port.active_mtu,
            ethernet: port.ethernet,
            ..self.local.clone()
        }))
    }
}

/// Rail `i`'s port now, if the rail is in use (not paused) and its port is ACTIVE: a handshake
/// offers and accepts only such rails, described as the port is now (a port that flapped may
/// come back with another GID; one that is down is left out).
pub(crate) fn live_rail(rails: &[RailCtx], i: usize) -> Option<LocalPort> {
    let rail = rails.get(i)?;
    if !rail.active {
        return None;
    }
    match rail.live_port() {
        Ok(Some(port)) => Some(port),
        Ok(None) => {
            tracing::debug!(rail = %rail.name, "left out of the handshake: its port is not ACTIVE");
            None
        }
        Err(e) => {
            tracing::warn!(rail = %rail.name, error = %error_chain(&e),
                "left out of the handshake: its port cannot be read");
            None
        }
    }
}

/// `rail`'s endpoint for the handshake, as `port` describes it.
pub(crate) fn endpoint_of(rail: usize, port: &LocalPort, qpn: u32, psn: u32) -> RdmaEndpoint {
    RdmaEndpoint {
        rail: u16::try_from(rail).unwrap_or(u16::MAX),
        port_num: port.port,
        mtu: u8::try_from(port.active_mtu).unwrap_or(1),
        lid: port.lid,
        gid: port.gid,
        qpn,
        psn,
    }
}

/// A device opened once for all its rails.
type OpenDevice = (Arc<Device>, Arc<Pd>, Arc<CompChannel>);

pub(crate) fn open_rail(
    verbs: &Verbs,
    spec: &RailSpec,
    may_be_paused: bool,
    devices: &mut HashMap<String, OpenDevice>,
    config: &RdmaConfig,
    faults: &Faults,
) -> Result<RailCtx, RdmaError> {
    let (device, pd, comp) = match devices.get(&spec.device) {
        Some(d) => d.clone(),
        None => {
            let device = Device::open(verbs, &spec.device, faults)?;
            let pd = Pd::alloc(&device)?;
            let comp = CompChannel::create(&device)?;
            devices.insert(
                spec.device.clone(),
                (device.clone(), pd.clone(), comp.clone()),
            );
            (device, pd, comp)
        }
    };
    let query = |what, source| RdmaError::QueryPort {
        device: spec.device.clone(),
        port: spec.port,
        gid_index: spec.gid_index,
        what,
        source,
    };
    let port = device
        .query_port(spec.port)
        .map_err(|e| query("ibv_query_port", e))?;
    let gid = device
        .query_gid(spec.port, spec.gid_index)
        .map_err(|e| query("ibv_query_gid", e))?;
    let (max_rd, max_wr) = device.limits().map_err(|e| query("ibv_query_device", e))?;
    let unusable = |reason: String| RdmaError::PortUnusable {
        device: spec.device.clone(),
        port: spec.port,
        gid_index: spec.gid_index,
        reason,
    };
    if !port.active && may_be_paused {
        tracing::info!(device = %spec.device, port = spec.port, state = port.state,
            "RDMA port is down: paused rail (registrations only)");
    } else if !port.active {
        return Err(unusable(format!(
            "port state {} is not ACTIVE ({})",
            port.state,
            ffi::IBV_PORT_ACTIVE
        )));
    }
    if port.active && port.ethernet && gid == [0; 16] {
        return Err(unusable(
            "the GID is all-zero (unset) on a RoCE port".into(),
        ));
    }
    let local = LocalPort {
        device: spec.device.clone(),
        port: spec.port,
        gid_index: spec.gid_index,
        gid,
        lid: port.lid,
        active_mtu: port.active_mtu,
        ethernet: port.ethernet,
        max_rd_atomic: max_rd.min(16),
    };
    tracing::info!(device = %spec.device, port = spec.port, gid_index = spec.gid_index,
        mtu = port.active_mtu, ethernet = port.ethernet, "RDMA rail opened");
    Ok(RailCtx {
        name: format!("{}:{}", spec.device, spec.port),
        local,
        active: port.active,
        depth: config.depth.clamp(1, max_wr),
        comp,
        pd,
    })
}

/// The local rail that serves the peer's `k`-th offered rail, out of `n`: rail `k mod n`, or the
/// next one whose GID differs from the peer's (`same_gid`): two engines on one host would
/// otherwise pair a device with itself and bypass the network.
pub(crate) fn pair_rail(k: usize, n: usize, same_gid: impl Fn(usize) -> bool) -> usize {
    (0..n)
        .map(|j| (k + j) % n)
        .find(|&i| !same_gid(i))
        .unwrap_or(k % n)
}

/// Which pending set (by the PSNs it offered, per rail) an answer belongs to: the serving side
/// echoes our PSNs, one endpoint per rail it accepted, in our rail order.
pub(crate) fn match_pending(pending: &[Vec<u32>], answer: &[RdmaEndpoint]) -> Option<usize> {
    pending.iter().position(|psns| {
        !answer.is_empty()
            && psns.len() >= answer.len()
            && psns.iter().zip(answer).all(|(psn, ep)| *psn == ep.psn)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offered_rails_pair_with_a_different_device_when_there_is_one() {
        // Our rails: [a, b]; the peer offers [a, b] (same host).
        let ours = ["a", "b"];
        let theirs = ["a", "b"];
        let pick = |k: usize| pair_rail(k, 2, |i| ours[i] == theirs[k]);
        assert_eq!((pick(0), pick(1)), (1, 0));
        // Different hosts: rail k mod n.
        assert_eq!(pair_rail(3, 2, |_| false), 1);
        // Only the same device: use it anyway.
        assert_eq!(pair_rail(0, 1, |_| true), 0);
    }

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

    #[test]
    fn answers_find_their_pending_queue_pairs_by_echoed_psns() {
        let pending = vec![vec![10, 11], vec![20, 21], vec![30]];
        assert_eq!(match_pending(&pending, &[ep(20), ep(21)]), Some(1));
        // The server may accept fewer rails than offered.
        assert_eq!(match_pending(&pending, &[ep(10)]), Some(0));
        assert_eq!(match_pending(&pending, &[ep(30)]), Some(2));
        assert_eq!(match_pending(&pending, &[ep(30), ep(31)]), None);
        assert_eq!(match_pending(&pending, &[ep(11)]), None);
        assert_eq!(match_pending(&pending, &[]), None);
    }
}

//! Bringing a reliable-connected queue pair from RESET to RTS against a peer's endpoint.

use ferry_core::wire::RdmaEndpoint;
use ferry_verbs_sys::ffi;

use crate::error::RdmaError;
use crate::verbs::{Grh, QpVerbs, Transition};

/// What the local end of a rail is: the port and GID traffic uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LocalPort {
    pub(crate) device: String,
    pub(crate) port: u8,
    pub(crate) gid_index: u32,
    pub(crate) gid: [u8; 16],
    pub(crate) lid: u16,
    /// `ibv_mtu` of the port (active MTU).
    pub(crate) active_mtu: u32,
    /// Ethernet link layer (RoCE): every packet carries a global route header.
    pub(crate) ethernet: bool,
    /// RDMA READs in flight per QP, either direction (bounded by the device).
    pub(crate) max_rd_atomic: u8,
}

/// Timeouts and retries of a connected queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpTiming {
    /// Local ACK timeout exponent (4.096 us * 2^timeout).
    pub timeout: u8,
    /// Transport retries before a completion error (6 by default; rxe retries forever on 7).
    pub retry_cnt: u8,
    /// Receiver-not-ready retries (7: forever).
    pub rnr_retry: u8,
    /// Minimal RNR NAK timer code.
    pub min_rnr_timer: u8,
    /// Hop limit of the global route header.
    pub hop_limit: u8,
}

impl Default for QpTiming {
    fn default() -> Self {
        Self {
            timeout: 14,
            // Not 7: soft-RoCE (rdma_rxe) treats a retry count of 7 as "retry forever", so a
            // dead peer would never fail the queue pair.
            retry_cnt: 6,
            rnr_retry: 7,
            min_rnr_timer: 12,
            hop_limit: 64,
        }
    }
}

/// The access the remote side gets on our queue pairs: one-sided READ and WRITE.
pub(crate) const QP_ACCESS: u32 =
    ffi::IBV_ACCESS_LOCAL_WRITE | ffi::IBV_ACCESS_REMOTE_WRITE | ffi::IBV_ACCESS_REMOTE_READ;

/// The largest `ibv_mtu` value (4096 bytes).
const MAX_MTU: u32 = ffi::IBV_MTU_4096;

/// The three transitions that connect `local` (with initial send PSN `local_psn`) to `remote`.
pub(crate) fn transitions(
    local: &LocalPort,
    local_psn: u32,
    remote: &RdmaEndpoint,
    timing: &QpTiming,
    peer: &str,
) -> Result<[Transition; 3], RdmaError> {
    let remote_mtu = u32::from(remote.mtu);
    if !(1..=MAX_MTU).contains(&remote_mtu) {
        return Err(RdmaError::Connect {
            peer: peer.to_owned(),
            reason: format!(
                "rail {} offers path MTU code {} (valid: 1..={MAX_MTU})",
                remote.rail, remote.mtu
            ),
        });
    }
    if local.ethernet && remote.gid == [0; 16] {
        return Err(RdmaError::Connect {
            peer: peer.to_owned(),
            reason: format!(
                "rail {} offers an all-zero GID, but {} port {} is RoCE and needs one",
                remote.rail, local.device, local.port
            ),
        });
    }
    let sgid_index = u8::try_from(local.gid_index).map_err(|_| RdmaError::PortUnusable {
        device: local.device.clone(),
        port: local.port,
        gid_index: local.gid_index,
        reason: "GID index does not fit the address vector (0..=255)".into(),
    })?;
    let global = (local.ethernet || remote.gid != [0; 16] && remote.lid == 0).then_some(Grh {
        dgid: remote.gid,
        sgid_index,
        hop_limit: timing.hop_limit,
        traffic_class: 0,
    });
    Ok([
        Transition::Init {
            port: local.port,
            pkey_index: 0,
            access: QP_ACCESS,
        },
        Transition::Rtr {
            port: local.port,
            path_mtu: local.active_mtu.clamp(1, MAX_MTU).min(remote_mtu),
            dest_qpn: remote.qpn,
            rq_psn: remote.psn & 0x00ff_ffff,
            max_dest_rd_atomic: local.max_rd_atomic,
            min_rnr_timer: timing.min_rnr_timer,
            dlid: remote.lid,
            global,
        },
        Transition::Rts {
            sq_psn: local_psn & 0x00ff_ffff,
            timeout: timing.timeout,
            retry_cnt: timing.retry_cnt,
            rnr_retry: timing.rnr_retry,
            max_rd_atomic: local.max_rd_atomic,
        },
    ])
}

/// Runs RESET->INIT->RTR->RTS on `qp`. A refused transition is an error naming the device, port,
/// GID index, queue pair and the transition.
pub(crate) fn bring_up(
    qp: &dyn QpVerbs,
    local: &LocalPort,
    local_psn: u32,
    remote: &RdmaEndpoint,
    timing: &QpTiming,
    peer: &str,
) -> Result<(), RdmaError> {
    for t in transitions(local, local_psn, remote, timing, peer)? {
        qp.modify(&t).map_err(|source| RdmaError::ModifyQp {
            device: local.device.clone(),
            port: local.port,
            gid_index: local.gid_index,
            qpn: qp.qp_num(),
            transition: t.name(),
            source,
        })?;
    }
    tracing::debug!(device = %local.device, port = local.port, qpn = qp.qp_num(),
        remote_qpn = remote.qpn, "queue pair connected (RTS)");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::error_chain;
    use crate::verbs::MockQpVerbs;
    use mockall::Sequence;
    use std::io;

    fn roce() -> LocalPort {
        LocalPort {
            device: "rxe0".into(),
            port: 1,
            gid_index: 1,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 99, 0, 1],
            lid: 0,
            active_mtu: 5,
            ethernet: true,
            max_rd_atomic: 16,
        }
    }

    fn peer_ep() -> RdmaEndpoint {
        RdmaEndpoint {
            rail: 0,
            port_num: 1,
            mtu: 3,
            lid: 0,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 99, 0, 2],
            qpn: 0x11,
            psn: 0x0a_bcde,
        }
    }

    #[test]
    fn roce_v2_goes_reset_init_rtr_rts_with_grh_and_min_mtu() {
        let mut qp = MockQpVerbs::new();
        let mut seq = Sequence::new();
        qp.expect_qp_num().return_const(0x22u32);
        qp.expect_modify()
            .withf(|t| matches!(t, Transition::Init { port: 1, pkey_index: 0, access } if *access == QP_ACCESS))
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_| Ok(()));
        qp.expect_modify()
            .withf(|t| {
                *t == Transition::Rtr {
                    port: 1,
                    path_mtu: 3,
                    dest_qpn: 0x11,
                    rq_psn: 0x0a_bcde,
                    max_dest_rd_atomic: 16,
                    min_rnr_timer: 12,
                    dlid: 0,
                    global: Some(Grh {
                        dgid: peer_ep().gid,
                        sgid_index: 1,
                        hop_limit: 64,
                        traffic_class: 0,
                    }),
                }
            })
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_| Ok(()));
        qp.expect_modify()
            .withf(|t| {
                matches!(
                    t,
                    Transition::Rts {
                        sq_psn: 0x12_3456,
                        timeout: 14,
                        retry_cnt: 6,
                        rnr_retry: 7,
                        max_rd_atomic: 16
                    }
                )
            })
            .times(1)
            .in_sequence(&mut seq)
            .returning(|_| Ok(()));
        bring_up(
            &qp,
            &roce(),
            0xff12_3456,
            &peer_ep(),
            &QpTiming::default(),
            "peer",
        )
        .unwrap();
    }

    #[test]
    fn infiniband_uses_the_lid_without_grh() {
        let mut local = roce();
        local.ethernet = false;
        local.lid = 7;
        let mut ep = peer_ep();
        ep.lid = 9;
        ep.mtu = 5;
        let ts = transitions(&local, 1, &ep, &QpTiming::default(), "p").unwrap();
        match ts[1] {
            Transition::Rtr {
                dlid,
                global,
                path_mtu,
                ..
            } => {
                assert_eq!(dlid, 9);
                assert_eq!(global, None);
                assert_eq!(path_mtu, 5);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_refused_transition_names_device_port_gid_and_transition() {
        let mut qp = MockQpVerbs::new();
        qp.expect_qp_num().return_const(0x22u32);
        qp.expect_modify().returning(|t| match t {
            Transition::Rtr { .. } => Err(io::Error::from_raw_os_error(libc::EINVAL)),
            _ => Ok(()),
        });
        let err = bring_up(&qp, &roce(), 1, &peer_ep(), &QpTiming::default(), "peer").unwrap_err();
        let text = error_chain(&err);
        for needle in [
            "rxe0",
            "port 1",
            "GID index 1",
            "INIT->RTR",
            "queue pair 34",
        ] {
            assert!(text.contains(needle), "{needle:?} missing in {text}");
        }
        assert!(matches!(
            err,
            RdmaError::ModifyQp {
                transition: "INIT->RTR",
                ..
            }
        ));
    }

    #[test]
    fn bad_offers_are_refused_before_any_transition() {
        let mut qp = MockQpVerbs::new();
        qp.expect_modify().never();
        let mut ep = peer_ep();
        ep.mtu = 9;
        let e = bring_up(&qp, &roce(), 1, &ep, &QpTiming::default(), "peer").unwrap_err();
        assert!(e.to_string().contains("MTU"), "{e}");
        let mut ep = peer_ep();
        ep.gid = [0; 16];
        let e = bring_up(&qp, &roce(), 1, &ep, &QpTiming::default(), "peer").unwrap_err();
        assert!(e.to_string().contains("all-zero GID"), "{e}");
    }
}

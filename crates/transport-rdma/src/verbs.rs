//! The verbs operations the queue-pair state machine and the data path use, as one small trait
//! over safe descriptors: the real implementation is [`crate::native::RcQp`], and unit tests use
//! mockall's `MockQpVerbs`.

use std::io;

use ferry_verbs_sys::ffi;

/// Direction of one work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WrKind {
    /// `IBV_WR_RDMA_WRITE`.
    Write,
    /// `IBV_WR_RDMA_READ`.
    Read,
}

/// One RDMA work request with one scatter/gather entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SendWr {
    pub(crate) wr_id: u64,
    pub(crate) kind: WrKind,
    pub(crate) local_addr: u64,
    pub(crate) len: u32,
    pub(crate) lkey: u32,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    pub(crate) signaled: bool,
}

/// One work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Completion {
    pub(crate) wr_id: u64,
    /// `ibv_wc_status`.
    pub(crate) status: u32,
    pub(crate) vendor_err: u32,
}

/// `ibv_post_send` refused the chain at work request `posted` (the ones before it were posted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PostError {
    pub(crate) posted: usize,
    pub(crate) errno: i32,
}

/// The global route header of a RoCE (or routed InfiniBand) address vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Grh {
    pub(crate) dgid: [u8; 16],
    pub(crate) sgid_index: u8,
    pub(crate) hop_limit: u8,
    pub(crate) traffic_class: u8,
}

/// A queue-pair state transition with the attributes it sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transition {
    /// RESET -> INIT.
    Init {
        port: u8,
        pkey_index: u16,
        /// `ibv_access_flags` the remote side may use on this QP.
        access: u32,
    },
    /// INIT -> RTR.
    Rtr {
        port: u8,
        /// `ibv_mtu`.
        path_mtu: u32,
        dest_qpn: u32,
        rq_psn: u32,
        max_dest_rd_atomic: u8,
        min_rnr_timer: u8,
        dlid: u16,
        global: Option<Grh>,
    },
    /// RTR -> RTS.
    Rts {
        sq_psn: u32,
        timeout: u8,
        retry_cnt: u8,
        rnr_retry: u8,
        max_rd_atomic: u8,
    },
    /// Any -> ERR: flushes every outstanding work request.
    Error,
}

impl Transition {
    /// The transition's name in errors.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Transition::Init { .. } => "RESET->INIT",
            Transition::Rtr { .. } => "INIT->RTR",
            Transition::Rts { .. } => "RTR->RTS",
            Transition::Error => "->ERR",
        }
    }
}

/// The verbs one reliable-connected queue pair (with its completion queue) needs.
#[cfg_attr(test, mockall::automock)]
pub(crate) trait QpVerbs: Send {
    /// The queue-pair number.
    fn qp_num(&self) -> u32;
    /// `ibv_modify_qp` for `transition`.
    fn modify(&self, transition: &Transition) -> io::Result<()>;
    /// `ibv_post_send` of `wrs` as one chain.
    fn post_send(&self, wrs: &[SendWr]) -> Result<(), PostError>;
    /// `ibv_poll_cq` for up to `max` completions; `Err(errno)` when polling failed.
    fn poll(&self, max: usize) -> Result<Vec<Completion>, i32>;
    /// Whether the QP's port is ACTIVE now (`ibv_query_port`); `true` when the query itself
    /// fails (nothing proves the link down then).
    fn link_up(&self) -> bool;
}

/// `IBV_WC_SUCCESS`.
pub(crate) const WC_SUCCESS: u32 = ffi::IBV_WC_SUCCESS;
/// `IBV_WC_WR_FLUSH_ERR`.
pub(crate) const WC_FLUSH: u32 = ffi::IBV_WC_WR_FLUSH_ERR;
/// `IBV_WC_LOC_QP_OP_ERR`.
pub(crate) const WC_LOC_QP_OP: u32 = ffi::IBV_WC_LOC_QP_OP_ERR;
/// `IBV_WC_REM_ACCESS_ERR`.
pub(crate) const WC_REM_ACCESS: u32 = ffi::IBV_WC_REM_ACCESS_ERR;
/// `IBV_WC_RETRY_EXC_ERR`.
pub(crate) const WC_RETRY_EXC: u32 = ffi::IBV_WC_RETRY_EXC_ERR;
/// `IBV_WC_RNR_RETRY_EXC_ERR`.
pub(crate) const WC_RNR_RETRY_EXC: u32 = ffi::IBV_WC_RNR_RETRY_EXC_ERR;

//! What the transport, its channels, its registration backend and its sweeper share.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use crate::config::RdmaConfig;
use crate::native::{Faults, Mr, RcQp};
use crate::pump::RailCounters;
use crate::qp::LocalPort;
use crate::rails::RailCtx;
use crate::served::ServedTable;

/// Queue pairs offered in a handshake this side started, waiting for the answer.
pub(crate) struct PendingSet {
    pub(crate) created: Instant,
    /// (rail index, PSN, QP, the port as it was when offered)
    pub(crate) qps: Vec<(usize, u32, RcQp, LocalPort)>,
}

/// The counters of one channel's rails: (local rail name, counters), in channel rail order.
pub(crate) struct ChannelStats {
    pub(crate) rails: Vec<(String, Arc<RailCounters>)>,
}

/// Native registrations made through the backend, by handle id.
#[derive(Default)]
pub(crate) struct MrTable {
    pub(crate) by_id: HashMap<u64, Registered>,
}

/// One registered copy.
pub(crate) struct Registered {
    pub(crate) context: u32,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) mr: Mr,
}

impl MrTable {
    /// The lkey of an MR on `context` covering `addr..addr+len`.
    pub(crate) fn lkey(&self, context: u32, addr: u64, len: u64) -> Option<u32> {
        let end = addr.checked_add(len)?;
        self.by_id
            .values()
            .find(|r| r.context == context && r.addr <= addr && end <= r.addr + r.len)
            .map(|r| r.mr.lkey())
    }
}

/// State shared by the transport, its channels and its registration backend. Field order is
/// drop order: queue pairs and MRs go before the rails (PDs, devices) they live on.
pub(crate) struct Shared {
    pub(crate) pending: Mutex<VecDeque<PendingSet>>,
    pub(crate) served: Mutex<ServedTable<RcQp>>,
    pub(crate) mrs: Mutex<MrTable>,
    pub(crate) next_mr: AtomicU64,
    pub(crate) channels: Mutex<Vec<Weak<ChannelStats>>>,
    pub(crate) rails: Vec<RailCtx>,
    pub(crate) config: RdmaConfig,
    pub(crate) faults: Faults,
}

//! The data path to one peer incarnation: an [`RdmaChannel`] hands requests and healed queue
//! pairs to its worker thread, which owns the queue pairs.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};

use ferry_core::wire::RdmaEndpoint;
use ferry_core::{
    BoxFuture, Channel, FailureKind, Op, OpKind, Outcome, PeerInfo, RemoteStatus, RequestControl,
    SegmentDesc, SegmentToken, TransportKind, TransportOffer,
};

use crate::error::{RdmaError, error_chain};
use crate::heal::{self, HealCtx, PendingHeal};
use crate::pump::{Keys, OpKeys, Pump, PumpLimits, Rail};
use crate::served::Incarnation;
use crate::shared::{ChannelStats, Shared};
use crate::verbs::QpVerbs;
use crate::worker::{Job, worker};

/// The data path to one peer: a worker thread that owns the queue pairs, posts and busy-polls.
pub struct RdmaChannel {
    peer: String,
    /// The peer incarnation the channel was opened to: heals connect to it only.
    remote: Incarnation,
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    alive: Arc<AtomicBool>,
    closed: AtomicBool,
    shared: Arc<Shared>,
    /// Per rail of this channel: (local context, remote context).
    plan: Vec<(u32, u32)>,
    segments: HashMap<SegmentToken, SegmentDesc>,
    stats: Arc<ChannelStats>,
    heal: Mutex<Option<PendingHeal>>,
}

impl fmt::Debug for RdmaChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaChannel")
            .field("peer", &self.peer)
            .field("rails", &self.plan)
            .field("alive", &self.alive.load(Ordering::Relaxed))
            .finish()
    }
}

impl RdmaChannel {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        peer: String,
        remote: Incarnation,
        shared: Arc<Shared>,
        rails: Vec<Rail>,
        plan: Vec<(u32, u32)>,
        segments: HashMap<SegmentToken, SegmentDesc>,
        limits: PumpLimits,
        stats: Arc<ChannelStats>,
    ) -> Self {
        let (tx, rx) = mpsc::channel();
        let alive = Arc::new(AtomicBool::new(true));
        let pump = Pump::new(rails, limits);
        let a = alive.clone();
        let spawned = std::thread::Builder::new()
            .name("ferry-rdma".into())
            .spawn(move || worker(pump, rx, a));
        let tx = match spawned {
            Ok(_) => Some(tx),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the RDMA channel worker");
                alive.store(false, Ordering::Release);
                None
            }
        };
        Self {
            peer,
            remote,
            tx: Mutex::new(tx),
            alive,
            closed: AtomicBool::new(false),
            shared,
            plan,
            segments,
            stats,
            heal: Mutex::new(None),
        }
    }

    fn heal_ctx(&self) -> HealCtx<'_> {
        HealCtx {
            peer: &self.peer,
            remote: self.remote,
            shared: &self.shared,
            plan: &self.plan,
            stats: &self.stats,
        }
    }

    /// Fresh queue pairs, kept pending, for the rails that are down while their local port is
    /// ACTIVE again; their endpoints.
    fn try_heal_offer(&self) -> Result<Vec<RdmaEndpoint>, RdmaError> {
        let (eps, pending) = heal::offer(&self.heal_ctx())?;
        *self.heal.lock().unwrap_or_else(PoisonError::into_inner) = pending;
        Ok(eps)
    }

    /// Connects the pending fresh queue pairs to `answer` and hands them to the worker.
    fn try_heal(&self, answer: &PeerInfo) -> Result<usize, ferry_core::Error> {
        let who = self.peer.clone();
        let pending = self
            .heal
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let ready = heal::connect(&self.heal_ctx(), pending, answer)?;
        let tx = self.tx.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(tx) = tx.as_ref().filter(|_| !self.closed.load(Ordering::Acquire)) else {
            return Err(RdmaError::Connect {
                peer: who,
                reason: "the channel closed during the heal".into(),
            }
            .into());
        };
        let n = ready.len();
        for (rail, qp) in ready {
            tracing::info!(peer = %who, rail = %self.stats.rails[rail].0, qpn = qp.qp_num(),
                "healed rail connected; rejoining the channel");
            let qp = Box::new(qp) as Box<dyn QpVerbs>;
            if tx.send(Job::Rebuild { rail, qp }).is_err() {
                return Err(RdmaError::Connect {
                    peer: who,
                    reason: "the channel's worker is gone".into(),
                }
                .into());
            }
        }
        // A channel whose every rail had failed comes back to life once its worker put a
        // rebuilt queue pair in place.
        Ok(n)
    }

    fn keys(&self, op: &Op) -> OpKeys {
        let Some(seg) = self.segments.get(&op.token) else {
            return Err(FailureKind::Remote(RemoteStatus::UnknownSegment));
        };
        let mrs = self
            .shared
            .mrs
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let addr = op.local.as_ptr() as u64 + op.local_offset;
        let mut any_local = false;
        let per_rail: Vec<Option<Keys>> = self
            .plan
            .iter()
            .map(|&(local, remote)| {
                let lkey = mrs.lkey(local, addr, op.len)?;
                any_local = true;
                let rk = seg.remote_keys.iter().find(|k| k.context == remote)?;
                Some(Keys {
                    lkey,
                    remote_base: rk.addr,
                    rkey: rk.rkey,
                })
            })
            .collect();
        if per_rail.iter().any(Option::is_some) {
            Ok(per_rail)
        } else if !any_local {
            tracing::warn!(peer = %self.peer, "local range is not registered on any rail");
            Err(FailureKind::Local)
        } else {
            Err(FailureKind::Remote(RemoteStatus::UnknownSegment))
        }
    }
}

impl Channel for RdmaChannel {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn execute(&self, ops: Arc<[Op]>, control: Arc<RequestControl>) -> BoxFuture<'static, Outcome> {
        // One-sided verbs cannot ask the peer to hash its memory: a CHECKSUM goes over the TCP
        // or io_uring data plane. The request fails at its first op, nothing posted.
        if ops.iter().any(|op| op.kind == OpKind::Checksum) {
            control.with_ledger(|l| l.not_posted(0, FailureKind::Local, None));
            let outcome = control.outcome(true);
            return Box::pin(async move { outcome });
        }
        let keys: Vec<OpKeys> = ops.iter().map(|op| self.keys(op)).collect();
        let (done, rx) = tokio::sync::oneshot::channel();
        let sent = {
            let tx = self.tx.lock().unwrap_or_else(PoisonError::into_inner);
            match tx.as_ref() {
                Some(tx) if self.is_alive() => tx
                    .send(Job::Run {
                        ops: ops.clone(),
                        control: control.clone(),
                        keys,
                        done,
                    })
                    .is_ok(),
                _ => false,
            }
        };
        Box::pin(async move {
            if sent && let Ok(o) = rx.await {
                return o;
            }
            // Nothing of this request was posted (or the worker is gone): it failed as lost.
            if !ops.is_empty() {
                control.with_ledger(|l| l.not_posted(0, FailureKind::PeerLost, None));
            }
            control.outcome(!sent)
        })
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.heal
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let tx = self.tx.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(tx) = tx.as_ref() {
            let _ = tx.send(Job::Close);
        }
        self.alive.store(false, Ordering::Release);
    }

    fn heal_offer(&self) -> Option<TransportOffer> {
        if self.closed.load(Ordering::Acquire) {
            return None;
        }
        match self.try_heal_offer() {
            Ok(rails) if !rails.is_empty() => Some(TransportOffer::Rdma { rails }),
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(peer = %self.peer, error = %error_chain(&e),
                    "cannot create queue pairs to heal rails");
                None
            }
        }
    }

    fn heal(&self, answer: PeerInfo) -> Result<usize, ferry_core::Error> {
        self.try_heal(&answer)
    }
}

impl Drop for RdmaChannel {
    fn drop(&mut self) {
        // Dropping the sender lets the worker flush what is outstanding and exit; it owns the
        // queue pairs and destroys them after the flush.
        self.tx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }
}

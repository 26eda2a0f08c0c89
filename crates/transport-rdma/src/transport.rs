//! The RDMA [`Transport`] and its [`Channel`].
//!
//! Connection setup rides on the control handshake. The initiator's `offer()` creates one RC
//! queue pair per rail (kept pending) and offers its endpoints (GID, LID, QPN, PSN, MTU). The
//! serving side's `accept()` pairs each offered rail with one of its own (rail `k` with rail
//! `k mod n`, or the next one whose GID is not the offered one), creates and connects a queue
//! pair for it (RESET→INIT→RTR→RTS) and answers with its endpoints, echoing the initiator's PSNs:
//! that is how `open()` finds the pending queue pairs the answer belongs to before connecting
//! them in turn.
//!
//! Healing a rail: once a failed rail's local port is ACTIVE again,
//! [`Channel::heal_offer`] creates a fresh queue pair for it and offers its endpoint, the
//! handshake driver carries that offer to the same peer incarnation in a new handshake (the peer's
//! `accept()` treats it as any offer, pairing by the offered rail index), and
//! [`Channel::heal`] connects the fresh queue pair to the answer and hands it to the channel's
//! worker, which puts it in place of the torn-down one.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use ferry_core::wire::RdmaEndpoint;
use ferry_core::{
    BoxFuture, Channel, Epoch, FailureKind, Op, OpKind, Outcome, PeerId, PeerInfo, RemoteStatus,
    RequestControl, SegmentDesc, SegmentToken, Transport, TransportKind, TransportOffer,
};
use ferry_verbs_sys::{Verbs, ffi};

use crate::backend::{MrTable, RdmaBackend};
use crate::config::{RailSpec, RdmaConfig};
use crate::error::{RdmaError, error_chain};
use crate::native::{CompChannel, Cq, Device, Faults, Pd, RcQp};
use crate::pump::{Keys, OpKeys, Pump, PumpLimits, Rail, RailCounters};
use crate::qp::{LocalPort, bring_up};
use crate::verbs::QpVerbs;

/// Pending queue-pair sets older than this are destroyed at the next offer.
const PENDING_TTL: Duration = Duration::from_secs(120);
/// At most this many pending sets are kept.
const MAX_PENDING: usize = 32;

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
    fn new_qp(&self) -> Result<RcQp, RdmaError> {
        let cq = Cq::create(&self.comp, self.depth.saturating_mul(2).max(16))?;
        RcQp::create(&self.pd, &cq, self.depth)
    }

    /// The port as it is now (`ibv_query_port`, `ibv_query_gid`): `None` while it is not ACTIVE.
    /// A healed rail connects with what the port says after the flap, not what it said at open.
    fn live_port(&self) -> Result<Option<LocalPort>, RdmaError> {
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

/// `rail`'s endpoint for the handshake, as `port` describes it.
fn endpoint_of(rail: usize, port: &LocalPort, qpn: u32, psn: u32) -> RdmaEndpoint {
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

/// Whether a heal's answer comes from the incarnation the channel was opened to: a restarted
/// peer (another id or epoch) has other segments and keys, so nothing of the channel may be
/// connected to it.
fn same_incarnation(opened: (PeerId, Epoch), answer: &PeerInfo) -> bool {
    opened == (answer.remote_id, answer.remote_epoch)
}

struct PendingSet {
    created: Instant,
    /// (rail index, PSN, QP, the port as it was when offered)
    qps: Vec<(usize, u32, RcQp, LocalPort)>,
}

struct ServedSet {
    peer: (PeerId, Epoch),
    /// The key name the peer proved, if any: what the set is charged to.
    name: Option<Arc<str>>,
    qps: Vec<RcQp>,
}

impl Charged for ServedSet {
    fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }
    fn qps(&self) -> usize {
        self.qps.len()
    }
}

/// A served set as the limits see it: whose it is and how many queue pairs it holds.
trait Charged {
    fn name(&self) -> Option<&str>;
    fn qps(&self) -> usize;
}

/// The limits on served sets (see [`RdmaConfig::max_served`] and the per-name ones).
#[derive(Clone, Copy, Debug)]
struct ServedLimits {
    total: usize,
    per_name: usize,
    qps_per_name: usize,
}

/// Removes (oldest first) the sets that must go before a set of `qps` queue pairs charged to
/// `name` joins `served`: that name's own beyond its limits, then, past the total, the oldest of
/// whichever name (or the unauthenticated peers, as one) holds the most sets. Another name's
/// set goes only when that name holds at least as many sets as any, so a flood of hellos under
/// one name cannot evict the others.
fn make_room<S: Charged>(
    served: &mut VecDeque<S>,
    name: Option<&str>,
    qps: usize,
    limits: ServedLimits,
) {
    if name.is_some() {
        loop {
            let (sets, held) = served
                .iter()
                .filter(|s| s.name() == name)
                .fold((0, 0), |(n, q), s| (n + 1, q + s.qps()));
            if sets == 0 || (sets < limits.per_name.max(1) && held + qps <= limits.qps_per_name) {
                break;
            }
            if let Some(i) = served.iter().position(|s| s.name() == name) {
                served.remove(i);
            }
        }
    }
    while served.len() >= limits.total.max(1) {
        let held = |name: Option<&str>| served.iter().filter(|s| s.name() == name).count();
        let most = served.iter().map(|s| held(s.name())).max().unwrap_or(0);
        // The oldest set of a name that holds the most.
        let Some(i) = served.iter().position(|s| held(s.name()) == most) else {
            break;
        };
        served.remove(i);
    }
}

/// State shared by the transport, its channels and its registration backend. Field order is
/// drop order: queue pairs and MRs go before the rails (PDs, devices) they live on.
pub(crate) struct Shared {
    pending: Mutex<VecDeque<PendingSet>>,
    served: Mutex<VecDeque<ServedSet>>,
    pub(crate) mrs: Mutex<MrTable>,
    pub(crate) next_mr: AtomicU64,
    channels: Mutex<Vec<Weak<ChannelStats>>>,
    pub(crate) rails: Vec<RailCtx>,
    config: RdmaConfig,
    faults: Faults,
}

/// Counters of one rail of one channel.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RailStats {
    /// `device:port` of the local rail.
    pub rail: String,
    /// Bytes acknowledged.
    pub bytes: u64,
    /// Work requests acknowledged.
    pub work_requests: u64,
    /// Work requests posted.
    pub posted: u64,
    /// Error completions.
    pub errors: u64,
    /// Flushed work requests.
    pub flushed: u64,
    /// Unsignalled work requests before an error completion, replayed on another rail rather
    /// than counted acknowledged on the ordering rule alone.
    pub unproven: u64,
    /// Chunks of a failed rail that this rail re-posted (replays it carried).
    pub replayed: u64,
    /// Bytes of those replayed chunks.
    pub replayed_bytes: u64,
    /// Failed queue pairs of this rail destroyed once flushed (never reused).
    pub torn_down: u64,
    /// Times this rail rejoined a channel on a fresh queue pair after a failure.
    pub rebuilds: u64,
    /// Channels on which this rail is down now (failed, not yet rebuilt).
    pub down: u64,
}

struct ChannelStats {
    rails: Vec<(String, Arc<RailCounters>)>,
}

/// RDMA reliable-connected queue pairs over the selected rails. Cheap to clone.
#[derive(Clone)]
pub struct RdmaTransport {
    shared: Arc<Shared>,
}

impl fmt::Debug for RdmaTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaTransport")
            .field("rails", &self.rail_names())
            .finish()
    }
}

/// A device opened once for all its rails.
type OpenDevice = (Arc<Device>, Arc<Pd>, Arc<CompChannel>);

fn open_rail(
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

impl RdmaTransport {
    /// Loads libibverbs, selects the rails (see [`RdmaConfig`]) and opens them.
    pub fn open(config: RdmaConfig) -> Result<Self, RdmaError> {
        let verbs = match &config.library {
            Some(p) => Verbs::load_from(p),
            None => Verbs::load(),
        }
        .map_err(|e| RdmaError::LoadLibrary {
            library: e
                .library()
                .unwrap_or(ferry_verbs_sys::IBVERBS_LIBRARY)
                .to_owned(),
            reason: error_chain(&e),
        })?;
        let specs = config.resolve(&verbs)?;
        let faults = Faults::default();
        let mut devices = HashMap::new();
        let mut rails = Vec::with_capacity(specs.len());
        for r in &specs {
            rails.push(open_rail(
                &verbs,
                &r.spec,
                r.paused,
                &mut devices,
                &config,
                &faults,
            )?);
        }
        drop(devices);
        Ok(Self {
            shared: Arc::new(Shared {
                pending: Mutex::default(),
                served: Mutex::default(),
                mrs: Mutex::default(),
                next_mr: AtomicU64::new(1),
                channels: Mutex::default(),
                rails,
                config,
                faults,
            }),
        })
    }

    /// The registration backend for the registry (one context per rail, in rail order).
    pub fn backend(&self) -> RdmaBackend {
        RdmaBackend {
            shared: self.shared.clone(),
        }
    }

    /// `device:port` of each rail, in rail (context) order.
    pub fn rail_names(&self) -> Vec<String> {
        self.shared.rails.iter().map(|r| r.name.clone()).collect()
    }

    /// Counters per rail, summed over this transport's live channels.
    pub fn rail_stats(&self) -> Vec<RailStats> {
        let mut out: Vec<RailStats> = self
            .shared
            .rails
            .iter()
            .map(|r| RailStats {
                rail: r.name.clone(),
                ..RailStats::default()
            })
            .collect();
        let mut chans = self
            .shared
            .channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        chans.retain(|w| w.strong_count() > 0);
        for c in chans.iter().filter_map(Weak::upgrade) {
            for (name, k) in &c.rails {
                if let Some(s) = out.iter_mut().find(|s| &s.rail == name) {
                    s.bytes += k.bytes.load(Ordering::Relaxed);
                    s.work_requests += k.work_requests.load(Ordering::Relaxed);
                    s.posted += k.posted.load(Ordering::Relaxed);
                    s.errors += k.errors.load(Ordering::Relaxed);
                    s.flushed += k.flushed.load(Ordering::Relaxed);
                    s.unproven += k.unproven.load(Ordering::Relaxed);
                    s.replayed += k.replayed.load(Ordering::Relaxed);
                    s.replayed_bytes += k.replayed_bytes.load(Ordering::Relaxed);
                    s.torn_down += k.torn_down.load(Ordering::Relaxed);
                    s.rebuilds += k.rebuilds.load(Ordering::Relaxed);
                    s.down += u64::from(k.down.load(Ordering::Relaxed));
                }
            }
        }
        out
    }

    /// Test-only (feature `__fault-injection`): breaks local rail `rail` (an index into
    /// [`rail_names`](Self::rail_names)) on every live channel, as a failing link would: each
    /// channel's worker moves that rail's queue pair to ERR at its next step with work
    /// outstanding on it, and learns of the failure only from the flushed completions. Returns
    /// how many channel rails were marked.
    #[cfg(feature = "__fault-injection")]
    pub fn inject_rail_failure(&self, rail: usize) -> usize {
        let Some(name) = self.shared.rails.get(rail).map(|r| r.name.as_str()) else {
            return 0;
        };
        let mut chans = self
            .shared
            .channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        chans.retain(|w| w.strong_count() > 0);
        let mut marked = 0;
        for c in chans.iter().filter_map(Weak::upgrade) {
            for (n, k) in &c.rails {
                if n == name {
                    k.inject_failure.store(true, Ordering::Release);
                    marked += 1;
                }
            }
        }
        marked
    }

    /// `Err(Unquiesced)` when a native destroy failed (the objects are kept).
    pub fn check(&self) -> Result<(), ferry_core::Error> {
        self.shared.faults.check()
    }

    /// Rail `i`'s port now, if the rail is in use (not paused) and its port is ACTIVE: a
    /// handshake offers and accepts only such rails, described as the port is now (a port that
    /// flapped may come back with another GID; one that is down is left out).
    fn live_rail(&self, i: usize) -> Option<LocalPort> {
        let rail = self.shared.rails.get(i)?;
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

    fn try_offer(&self) -> Result<Vec<RdmaEndpoint>, RdmaError> {
        let mut qps = Vec::with_capacity(self.shared.rails.len());
        let mut eps = Vec::with_capacity(self.shared.rails.len());
        for (i, rail) in self.shared.rails.iter().enumerate() {
            let Some(port) = self.live_rail(i) else {
                continue;
            };
            let qp = rail.new_qp()?;
            let psn = rand::random::<u32>() & 0x00ff_ffff;
            eps.push(endpoint_of(i, &port, qp.qp_num(), psn));
            qps.push((i, psn, qp, port));
        }
        let mut pending = self
            .shared
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

    fn try_accept(&self, peer: &PeerInfo) -> Result<Vec<RdmaEndpoint>, RdmaError> {
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
                reason:
                    "the peer offers no RDMA rail: none of its ports is ACTIVE, or it could not \
                         create queue pairs (its log says which)"
                        .into(),
            });
        }
        let limits = ServedLimits {
            total: self.shared.config.max_served,
            per_name: self.shared.config.max_served_per_name,
            qps_per_name: self.shared.config.max_qps_per_name,
        };
        if peer.key_name.is_some() && offered.len() > limits.qps_per_name {
            return Err(RdmaError::Connect {
                peer: who,
                reason: format!(
                    "the peer offers {} rails; at most {} queue pairs are kept per key name",
                    offered.len(),
                    limits.qps_per_name
                ),
            });
        }
        let active: Vec<(usize, LocalPort)> = (0..self.shared.rails.len())
            .filter_map(|i| Some((i, self.live_rail(i)?)))
            .collect();
        let n = active.len();
        if n == 0 {
            return Err(RdmaError::Connect {
                peer: who,
                reason:
                    "no local RDMA port is ACTIVE now (`ferry topology` shows each port's state)"
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
            let rail = &self.shared.rails[*i];
            let qp = rail.new_qp()?;
            bring_up(&qp, port, ep.psn, ep, &self.shared.config.timing, &who)?;
            answer.push(endpoint_of(*i, port, qp.qp_num(), ep.psn));
            qps.push(qp);
        }
        let mut served = self
            .shared
            .served
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Sets whose queue pairs all failed (their peer went away) are released.
        served.retain(|s| {
            !s.qps
                .iter()
                .all(|q| q.state().map_or(true, |st| st == ffi::IBV_QPS_ERR))
        });
        make_room(&mut served, peer.key_name.as_deref(), qps.len(), limits);
        served.push_back(ServedSet {
            peer: (peer.remote_id, peer.remote_epoch),
            name: peer.key_name.clone(),
            qps,
        });
        tracing::info!(peer = %who, rails = answer.len(), "RDMA queue pairs accepted");
        Ok(answer)
    }

    /// Releases the queue pairs kept for serving `peer` (all its incarnations when `epoch` is
    /// `None`).
    pub fn release_peer(&self, peer: PeerId, epoch: Option<Epoch>) {
        self.shared
            .served
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|s| !(s.peer.0 == peer && epoch.is_none_or(|e| e == s.peer.1)));
    }

    fn try_open(&self, peer: &PeerInfo) -> Result<RdmaChannel, RdmaError> {
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
            let mut pending = self
                .shared
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
            let rail = &self.shared.rails[i];
            bring_up(&qp, &port, psn, ep, &self.shared.config.timing, &who)?;
            let counters = Arc::new(RailCounters::default());
            let name = format!("{}->{}", rail.name, ep.rail);
            stats.push((rail.name.clone(), counters.clone()));
            rails.push(Rail::new(Box::new(qp) as Box<dyn QpVerbs>, name, counters));
            plan.push((u32::try_from(i).unwrap_or(u32::MAX), u32::from(ep.rail)));
        }
        let stats = Arc::new(ChannelStats { rails: stats });
        self.shared
            .channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::downgrade(&stats));
        let segments: HashMap<SegmentToken, SegmentDesc> =
            peer.segments.iter().map(|s| (s.token, s.clone())).collect();
        let c = &self.shared.config;
        let limits = PumpLimits {
            chunk: c.chunk_size.clamp(1, 1 << 30),
            depth: usize::try_from(self.shared.rails.iter().map(|r| r.depth).min().unwrap_or(1))
                .unwrap_or(1),
            signal_every: usize::try_from(c.signal_every).unwrap_or(16),
            flush_timeout: c.flush_timeout,
            replay_writes: c.replay_writes,
        };
        tracing::info!(peer = %who, rails = plan.len(), "RDMA channel open");
        Ok(RdmaChannel::start(
            who,
            (peer.remote_id, peer.remote_epoch),
            self.shared.clone(),
            rails,
            plan,
            segments,
            limits,
            stats,
        ))
    }
}

/// The local rail that serves the peer's `k`-th offered rail, out of `n`: rail `k mod n`, or the
/// next one whose GID differs from the peer's (`same_gid`): two engines on one host would
/// otherwise pair a device with itself and bypass the network.
fn pair_rail(k: usize, n: usize, same_gid: impl Fn(usize) -> bool) -> usize {
    (0..n)
        .map(|j| (k + j) % n)
        .find(|&i| !same_gid(i))
        .unwrap_or(k % n)
}

/// Which pending set (by the PSNs it offered, per rail) an answer belongs to: the serving side
/// echoes our PSNs, one endpoint per rail it accepted, in our rail order.
fn match_pending(pending: &[Vec<u32>], answer: &[RdmaEndpoint]) -> Option<usize> {
    pending.iter().position(|psns| {
        !answer.is_empty()
            && psns.len() >= answer.len()
            && psns.iter().zip(answer).all(|(psn, ep)| *psn == ep.psn)
    })
}

impl Transport for RdmaTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn offer(&self) -> TransportOffer {
        match self.try_offer() {
            Ok(rails) => TransportOffer::Rdma { rails },
            Err(e) => {
                tracing::warn!(error = %error_chain(&e), "cannot create RDMA queue pairs to offer");
                TransportOffer::Rdma { rails: Vec::new() }
            }
        }
    }

    fn accept(&self, peer: &PeerInfo) -> Result<TransportOffer, ferry_core::Error> {
        self.try_accept(peer)
            .map(|rails| TransportOffer::Rdma { rails })
            .map_err(ferry_core::Error::from)
    }

    fn open(
        &self,
        peer: PeerInfo,
    ) -> BoxFuture<'static, Result<Arc<dyn Channel>, ferry_core::Error>> {
        let r = self
            .try_open(&peer)
            .map(|c| Arc::new(c) as Arc<dyn Channel>)
            .map_err(ferry_core::Error::from);
        Box::pin(async move { r })
    }
}

enum Job {
    Run {
        ops: Arc<[Op]>,
        control: Arc<RequestControl>,
        keys: Vec<OpKeys>,
        done: tokio::sync::oneshot::Sender<Outcome>,
    },
    /// A fresh, connected queue pair for channel rail `rail` (a heal).
    Rebuild {
        rail: usize,
        qp: Box<dyn QpVerbs>,
    },
    Close,
}

/// Fresh queue pairs offered for a heal, waiting for the peer's answer: (channel rail, PSN,
/// queue pair, the port as it was when offered).
struct PendingHeal {
    qps: Vec<(usize, u32, RcQp, LocalPort)>,
}

/// The data path to one peer: a worker thread that owns the queue pairs, posts and busy-polls.
pub struct RdmaChannel {
    peer: String,
    /// The peer incarnation the channel was opened to: heals connect to it only.
    remote: (PeerId, Epoch),
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

fn worker(mut pump: Pump, rx: mpsc::Receiver<Job>, alive: Arc<AtomicBool>) {
    let mut closing = false;
    let mut idle_spins: u32 = 0;
    let take = |job: Job, pump: &mut Pump, closing: &mut bool| match job {
        Job::Run {
            ops,
            control,
            keys,
            done,
        } => pump.add(
            ops,
            control,
            keys,
            Box::new(move |o| {
                let _ = done.send(o);
            }),
        ),
        Job::Rebuild { rail, qp } => pump.rebuild(rail, qp),
        Job::Close => {
            pump.close();
            *closing = true;
        }
    };
    loop {
        if pump.idle() {
            if closing {
                break;
            }
            match rx.recv() {
                Ok(job) => take(job, &mut pump, &mut closing),
                Err(_) => {
                    pump.close();
                    closing = true;
                }
            }
        }
        loop {
            match rx.try_recv() {
                Ok(job) => take(job, &mut pump, &mut closing),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    if !closing {
                        pump.close();
                        closing = true;
                    }
                    break;
                }
            }
        }
        let progressed = pump.step();
        alive.store(pump.alive() && !closing, Ordering::Release);
        if progressed {
            idle_spins = 0;
        } else {
            idle_spins = idle_spins.saturating_add(1);
            if idle_spins > 20_000 {
                std::thread::sleep(Duration::from_micros(50));
            } else if idle_spins > 32 {
                std::thread::yield_now();
            }
        }
    }
    alive.store(false, Ordering::Release);
    tracing::debug!("RDMA channel worker done");
}

impl RdmaChannel {
    #[allow(clippy::too_many_arguments)]
    fn start(
        peer: String,
        remote: (PeerId, Epoch),
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

    /// Fresh queue pairs, kept pending, for the rails that are down while their local port is
    /// ACTIVE again; their endpoints.
    fn try_heal_offer(&self) -> Result<Vec<RdmaEndpoint>, RdmaError> {
        let mut pending = PendingHeal { qps: Vec::new() };
        let mut eps = Vec::new();
        for (c, &(local, _)) in self.plan.iter().enumerate() {
            let down = self
                .stats
                .rails
                .get(c)
                .is_some_and(|(_, k)| k.down.load(Ordering::Acquire));
            let Some(rail) = usize::try_from(local)
                .ok()
                .and_then(|i| self.shared.rails.get(i))
            else {
                continue;
            };
            if !down {
                continue;
            }
            let port = match rail.live_port() {
                Ok(Some(p)) => p,
                Ok(None) => {
                    tracing::debug!(peer = %self.peer, rail = %rail.name,
                        "rail is down and its port is not ACTIVE yet");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(peer = %self.peer, error = %error_chain(&e),
                        "cannot read the port of a down rail");
                    continue;
                }
            };
            let qp = rail.new_qp()?;
            let psn = rand::random::<u32>() & 0x00ff_ffff;
            eps.push(endpoint_of(local as usize, &port, qp.qp_num(), psn));
            pending.qps.push((c, psn, qp, port));
        }
        let mut slot = self.heal.lock().unwrap_or_else(PoisonError::into_inner);
        *slot = (!pending.qps.is_empty()).then_some(pending);
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
        let Some(pending) = pending else {
            return Err(RdmaError::Connect {
                peer: who,
                reason: "no heal is pending (its offer was replaced, or never made)".into(),
            }
            .into());
        };
        if !same_incarnation(self.remote, answer) {
            tracing::warn!(peer = %who, known = %self.remote.1, found = %answer.remote_epoch,
                "the peer answered the heal as another incarnation: its fresh queue pairs are \
                 torn down, nothing is connected to it");
            return Err(ferry_core::Error::StaleEpoch {
                addr: who,
                known: self.remote.1,
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
            let paired = self.plan[c].1;
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
            bring_up(&qp, &port, psn, ep, &self.shared.config.timing, &who)?;
            ready.push((c, qp));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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

    impl Charged for (Option<&'static str>, usize) {
        fn name(&self) -> Option<&str> {
            self.0
        }
        fn qps(&self) -> usize {
            self.1
        }
    }

    const LIMITS: ServedLimits = ServedLimits {
        total: 8,
        per_name: 3,
        qps_per_name: 5,
    };

    fn admit(
        served: &mut VecDeque<(Option<&'static str>, usize)>,
        name: Option<&'static str>,
        qps: usize,
    ) {
        make_room(served, name, qps, LIMITS);
        served.push_back((name, qps));
    }

    /// A flood of hellos under one key name evicts only that name's sets (per-name caps on sets
    /// and queue pairs), and past the total only the sets of whoever holds the most.
    #[test]
    fn one_names_hellos_cannot_evict_other_peers_sets() {
        let mut served = VecDeque::new();
        admit(&mut served, Some("bob"), 2);
        admit(&mut served, None, 1);
        for _ in 0..100 {
            admit(&mut served, Some("eve"), 1);
        }
        let of = |s: &VecDeque<(Option<&str>, usize)>, n| s.iter().filter(|x| x.0 == n).count();
        assert_eq!(of(&served, Some("eve")), LIMITS.per_name);
        assert_eq!((of(&served, Some("bob")), of(&served, None)), (1, 1));
        // Queue pairs per name: two sets of 2 fit in 5, a third of 2 pushes out the oldest.
        admit(&mut served, Some("carol"), 2);
        admit(&mut served, Some("carol"), 2);
        admit(&mut served, Some("carol"), 2);
        assert_eq!(of(&served, Some("carol")), 2);
        assert_eq!(of(&served, Some("bob")), 1);
        // Past the total (8), the name holding the most loses its oldest; bob keeps his set.
        admit(&mut served, Some("dave"), 1);
        admit(&mut served, Some("dave"), 1);
        admit(&mut served, Some("frank"), 1);
        assert!(served.len() <= LIMITS.total);
        assert_eq!(of(&served, Some("bob")), 1, "{served:?}");
        // Unauthenticated peers share the total only: many of them push out one another.
        let mut open = VecDeque::new();
        for _ in 0..20 {
            admit(&mut open, None, 4);
        }
        assert_eq!(open.len(), LIMITS.total);
    }

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

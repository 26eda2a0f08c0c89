//! RC queue pairs over verbs for Ferry: one-sided RDMA READ/WRITE, multi-rail striping.
//!
//! Contract (docs/architecture.md sections 2 to 5):
//! - [`RdmaTransport::open`] loads libibverbs (`ferry-verbs-sys`), selects rails from
//!   [`RdmaConfig`] (discovery through `ferry-topology`, or explicit [`RailSpec`]s) and opens
//!   them: one device context, protection domain and completion channel per device.
//! - Registration goes through the registry with [`RdmaTransport::backend`]: one context per
//!   rail, one MR per copy (local copy `LOCAL_WRITE`, remote copy plus the granted remote rights).
//! - Connection setup rides on the control handshake ([`ferry_core::Transport`]): GID, LID, QPN,
//!   PSN and MTU per rail; queue pairs go RESET→INIT→RTR→RTS with a global route header on RoCE
//!   and the smaller of both path MTUs. A refused transition names device, port, GID index and
//!   the transition.
//! - Data: ops are cut into chunks (`chunk_size`), striped round-robin over the rails, posted as
//!   chained WRITE/READ work requests with batched signalling and a bounded depth per queue pair,
//!   and folded into the request's outcome by a per-channel worker thread that busy-polls. An
//!   error completion fails its queue pair (moved to ERR and flushed); later WRITEs are then
//!   `Uncertain`, and a request resolves `drained` only after its work requests all completed.
//! - Multi-rail replay: when a rail's queue pair fails with a transport error (retry exceeded,
//!   flush), its unacknowledged READ chunks are re-posted on a healthy rail of the channel, and
//!   its WRITE chunks too when [`RdmaConfig::replay_writes`] allows; the rail is down for the
//!   channel until it heals (below). Remote access errors are never replayed. Replays are counted per rail
//!   ([`RailStats::replayed`], [`RailStats::replayed_bytes`]).
//! - Rails that heal: a failed rail's queue pair is torn down once flushed, never reused; when
//!   its port is ACTIVE again, `Channel::heal_offer` makes fresh queue pairs for the rails that
//!   are down, the handshake driver carries them to the same peer incarnation, and
//!   `Channel::heal` connects them (refusing another epoch) and swaps them in
//!   ([`RailStats::torn_down`], [`RailStats::rebuilds`], [`RailStats::down`]).
//! - Served queue pairs (the serving side's, which no request of ours uses): one set per peer
//!   incarnation (`served`, a table without I/O). A heal or reconnect of that incarnation joins
//!   its set (at most 4 queue pairs per peer rail); a newer epoch of the same peer releases the
//!   older one's once the newer set is proven (a probe of it answered: a hello merely naming a
//!   later epoch releases nothing); a sweeper thread probes each queue pair (a zero-length RDMA WRITE every 5 s)
//!   and releases the ones whose probe fails or stays unanswered 30 s. Past
//!   [`RdmaConfig::max_served`] or the per-name limits only dead, idle or unproven sets give
//!   way; a set proven in use never does (the newcomer is refused).
//! - Native handles never panic in `Drop`: a failed destroy is kept and reported by
//!   [`RdmaTransport::check`] as `Unquiesced`, and through the registry for MRs.
//!
//! `unsafe` code lives only in `native` (the owning handles) and `backend` (handing registered
//! memory to `ibv_reg_mr`). Modules, each importing only those below it: `transport` (the
//! [`Transport`](ferry_core::Transport)), `admission` (offer, accept, open), `channel` (with
//! `heal` and `worker`), `shared`, `served`, `rails`, `pump`, `qp`, `native`, `verbs`. Features: `__fault-injection` (test-only) adds
//! `RdmaTransport::inject_rail_failure`, which the guest tests use to break one rail mid-request.
#![deny(unsafe_op_in_unsafe_fn)]

mod admission;
mod backend;
mod channel;
mod config;
mod error;
mod heal;
mod native;
mod pump;
mod qp;
mod rails;
mod served;
mod shared;
mod transport;
mod verbs;
mod worker;

pub use backend::RdmaBackend;
pub use channel::RdmaChannel;
pub use config::{RailSpec, RdmaConfig};
pub use error::RdmaError;
pub use pump::{RailCounters, RailStats};
pub use qp::QpTiming;
pub use transport::RdmaTransport;

//! Weight broadcast over Ferry: one source to many receivers in little more than the time of
//! one, every chunk verified.
//!
//! - [`manifest`]: what a source publishes (segments, entries with dtype and shape for
//!   `.safetensors` tensors, chunks with BLAKE3 and CRC-32C), built from files and validated on
//!   receipt; its [`Digest`] binds every chunk hash to the source.
//! - [`plan`]: whom each member fetches each stripe from, derived from the membership list
//!   (the striped plan; one stripe is a chain), and a receiver's bookkeeping of verified
//!   chunks (no I/O).
//! - [`stripes`]: a relay plan that scales (striped trees of bounded depth, stragglers at the
//!   edge), a pure function of the membership and observed rates; [`sim`]: a discrete-event
//!   simulation of links on which the chain and the striped plan are compared.
//! - [`layout`]: where a member holds each segment ([`Slice`]s of its registrations, host or
//!   GPU), and the pieces a chunk moves in.
//! - `pull`: a receiver's decisions as a state machine with no I/O (events in, commands out),
//!   which [`Receiver`] drives, tested on a simulated fleet and by proptest.
//! - [`Source`] and [`Receiver`]: the roles. A source publishes files or named [`Tensor`]s of
//!   the caller's engine (no copy), several versions side by side, and withdraws a version
//!   whose files changed on disk; a receiver pulls into buffers of its own, into the caller's
//!   [`Destinations`] (in place or staged), or into files of a directory as chunks are
//!   verified ([`Receiver::join_to_dir`]: memory of a window of chunks). Receivers fetch
//!   chunks by Ferry READs from their parents (one per stripe), verify them, and serve them to
//!   their children; dead, stalled or corrupting holders are routed around (the source too: a
//!   pull that cannot go on fails naming it), and a restarted source (new epoch) is refused.
//! - [`discovery`]: the membership list behind one trait, [`Embedded`]
//!   (the source keeps it) or `Etcd` (feature `etcd`, which needs `protoc` at build time).
//!
//! This crate sits above the facade (`ferry`): it depends on no transport. The design and its
//! measurements are in `docs/architecture.md` (section 11) and `docs/broadcast.md`.
//!
//! Features: `etcd` (etcd discovery through the `etcd-client` crate).
#![forbid(unsafe_code)]

mod control;
mod destinations;
pub mod discovery;
mod error;
#[cfg(feature = "etcd")]
mod etcd;
mod hashing;
mod landing;
pub mod layout;
pub mod manifest;
pub mod plan;
mod pull;
mod receiver;
pub mod sim;
mod source;
pub mod stripes;

pub use control::Departure;
pub use destinations::{Destinations, TensorKind};
pub use discovery::{Discovery, Embedded, Listing};
pub use error::BroadcastError;
#[cfg(feature = "etcd")]
pub use etcd::{Etcd, MAX_MEMBER_BYTES, MAX_MEMBERS};
/// Plain records in etcd: the metadata room's (`ferry_metadata::EtcdKv`), named here as before.
#[cfg(feature = "etcd")]
pub use ferry_metadata::EtcdKv;
pub use layout::{Slice, Tensor};
pub use manifest::{Digest, Manifest, ManifestError};
pub use plan::{Member, Role};
#[cfg(feature = "__test-hooks")]
#[doc(hidden)]
pub use receiver::TestHooks;
pub use receiver::{
    DEFAULT_STRIPES, LeaveHandle, Receiver, ReceiverOptions, Snapshot, Summary, Timeline, unix_now,
};
pub use source::{Source, SourceEvent, SourceOptions};

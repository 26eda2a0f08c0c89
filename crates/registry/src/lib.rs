//! Registration lifecycle, per-context fan-out and budgets for Ferry.
//!
//! The registry admits host memory ranges, makes their native copies through a
//! [`RegistrationBackend`], publishes them under random unguessable [`SegmentToken`]s and retires
//! them. It is IO-free: no threads, no sleeping, no clock; native calls run on the caller's thread.
//!
//! Contract (docs/architecture.md section 3, "Registration and budgets" and "Cleanup"):
//! - **Fan-out.** Every context the backend lists gets copies, paused ones included: one per
//!   context for a local-only range, two (local and remote) for a remotely accessible one.
//! - **Budgets.** [`Budgets`] cap the aggregate count of copies and their bytes; each copy charges
//!   the full range. The whole fan-out is checked and charged before the first native call.
//!   Exceeding a budget is [`RegistryError::ResourceExhausted`] naming the budget, the request and
//!   what is held. Published registrations are never evicted; errors never switch to staging.
//! - **Failure part-way.** If copy `k` fails, copies `k-1..=0` are destroyed in reverse order and
//!   their charges released; the error names the context ([`RegistryError::Register`]).
//! - **Lifecycle.** Admitted → published (only once every copy exists) → retiring (unpublished at
//!   once: [`Registry::lookup`] answers `None` exactly as for an unknown token; holders of a
//!   [`Lease`] keep the memory and copies alive) → retired (copies destroyed in reverse order when
//!   the last lease goes). A failed destroy leaves the registration `Unquiesced`: copies, memory and
//!   charges stay held, admission on that context is fenced ([`RegistryError::Fenced`]).
//! - **Drop never panics.** Dropping a [`Registration`] retires it; errors that cannot be returned
//!   are kept for [`Registry::check`] / [`Registry::take_errors`].
//!
//! Features: `__mock` (test-only) exposes `MockRegistrationBackend`, a mockall mock of the backend.
#![forbid(unsafe_code)]

mod backend;
mod error;
mod registry;
mod shared;

#[cfg(any(test, feature = "__mock"))]
pub use backend::MockRegistrationBackend;
pub use backend::{
    ContextId, ContextInfo, HostBackend, NativeError, NativeHandle, RegistrationBackend,
};
pub use error::{AccessError, Budget, RegistryError};
pub use ferry_core::SegmentToken;
pub use registry::{
    Budgets, ContextCounters, CopyRole, Lease, NativeCopy, Registration, Registry,
    RegistryCounters, Retirement, SegmentState, UnquiescedInfo, UnquiescedRetry,
};
pub use shared::{CacheStats, SharedCopies};

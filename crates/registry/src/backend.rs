//! The native side of registration: a small object-safe trait the registry drives, and the host
//! backend used by TCP and io_uring (no native registration at all).

use std::fmt;
use std::io;

use ferry_core::{Access, MemoryRegion};

/// Identifies one registration context of a backend (RDMA: one opened device port; host: the
/// single context "host"). Stable for the life of the backend.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct ContextId(pub u32);

impl fmt::Display for ContextId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ctx{}", self.0)
    }
}

/// One context a backend can register memory on.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ContextInfo {
    /// The context's id.
    pub id: ContextId,
    /// A name for people and errors, such as `mlx5_0:1` or `host`.
    pub name: String,
    /// Whether the context is paused (port down). Paused contexts still get their copies, so a
    /// port that comes back can serve at once.
    pub paused: bool,
}

impl ContextInfo {
    /// A context that is not paused.
    pub fn new(id: ContextId, name: impl Into<String>) -> Self {
        Self {
            id,
            name: name.into(),
            paused: false,
        }
    }
}

/// The opaque result of one native registration (RDMA: one MR). The backend keeps whatever native
/// object stands behind `id`; the registry hands the same value back to destroy it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct NativeHandle {
    /// Backend-defined identity of the native object (for example an index into its own table).
    pub id: u64,
    /// Local key (RDMA lkey); zero where the backend has none.
    pub lkey: u32,
    /// Remote key (RDMA rkey); zero where the backend has none or the copy is local-only.
    pub rkey: u32,
}

/// A native call that failed, with the device it failed on.
#[derive(Debug, thiserror::Error)]
#[error("native call `{call}` on {device} failed")]
pub struct NativeError {
    /// Device (or context) name, such as `mlx5_0:1`.
    pub device: String,
    /// The native call, such as `ibv_reg_mr` or `ibv_dereg_mr`.
    pub call: &'static str,
    /// The operating system's error.
    #[source]
    pub source: io::Error,
}

impl NativeError {
    /// A native error for `call` on `device`.
    pub fn new(device: impl Into<String>, call: &'static str, source: io::Error) -> Self {
        Self {
            device: device.into(),
            call,
            source,
        }
    }
}

/// Native registration, as the registry needs it. Implemented by the RDMA transport (one context
/// per opened port, one MR per copy) and by [`HostBackend`] (TCP and io_uring).
///
/// The registry calls [`register_copy`](Self::register_copy) once per copy of its fan-out and
/// [`destroy_copy`](Self::destroy_copy) once per copy it made, in reverse order. Calls may come
/// from any thread; the registry never holds its locks across them.
#[cfg_attr(any(test, feature = "__mock"), mockall::automock)]
pub trait RegistrationBackend: Send + Sync + fmt::Debug + 'static {
    /// The contexts to register on, paused ones included, in a stable order.
    fn contexts(&self) -> Vec<ContextInfo>;

    /// Registers one native copy of the whole `region` on `context`. `access` is
    /// [`Access::LOCAL`] for the local copy and the range's remote rights for the remote copy.
    fn register_copy(
        &self,
        context: ContextId,
        region: &MemoryRegion,
        access: Access,
    ) -> Result<NativeHandle, NativeError>;

    /// Destroys a copy made by [`register_copy`](Self::register_copy) on `context`.
    fn destroy_copy(&self, context: ContextId, handle: NativeHandle) -> Result<(), NativeError>;
}

/// The backend of TCP and io_uring: one context, `host`, and no native registration. It never
/// fails; it exists so that host ranges go through the same accounting RDMA uses.
#[derive(Debug, Default, Clone, Copy)]
pub struct HostBackend;

impl HostBackend {
    /// The id of the single host context.
    pub const CONTEXT: ContextId = ContextId(0);
    /// The name of the single host context.
    pub const CONTEXT_NAME: &'static str = "host";
}

impl RegistrationBackend for HostBackend {
    fn contexts(&self) -> Vec<ContextInfo> {
        vec![ContextInfo::new(Self::CONTEXT, Self::CONTEXT_NAME)]
    }

    fn register_copy(
        &self,
        _context: ContextId,
        _region: &MemoryRegion,
        _access: Access,
    ) -> Result<NativeHandle, NativeError> {
        Ok(NativeHandle::default())
    }

    fn destroy_copy(&self, _context: ContextId, _handle: NativeHandle) -> Result<(), NativeError> {
        Ok(())
    }
}

//! Run-time loading of libibverbs with libloading: required exports resolved together,
//! optional ones as `Option`s, cached once per process, never a panic.

use std::ffi::c_void;
use std::os::raw::{c_char, c_int, c_uint};
use std::path::Path;
use std::sync::{Arc, OnceLock};

use crate::error::VerbsError;
use crate::sys::{
    _compat_ibv_port_attr, ibv_ah, ibv_ah_attr, ibv_comp_channel, ibv_context, ibv_cq, ibv_device,
    ibv_device_attr, ibv_gid, ibv_gid_entry, ibv_mr, ibv_pd, ibv_qp, ibv_qp_attr, ibv_qp_init_attr,
};

/// The soname [`Verbs::load`] opens unless [`LIBRARY_ENV`] overrides it.
pub const IBVERBS_LIBRARY: &str = "libibverbs.so.1";

/// Environment variable naming another libibverbs to load (a path or a soname).
pub const LIBRARY_ENV: &str = "FERRY_IBVERBS_LIB";

/// Declares a table of exports: a struct of function pointers plus its resolver.
macro_rules! exports {
    (
        $(#[$meta:meta])*
        struct $name:ident, $resolve:ident -> $out:ty {
            $( $field:ident = $symbol:literal : $ty:ty, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy)]
        pub(crate) struct $name {
            $( pub(crate) $field: $ty, )*
        }

        impl $name {
            /// Every symbol name in the table, in declaration order.
            pub(crate) const SYMBOLS: &'static [&'static str] = &[$($symbol),*];

            /// Resolves the whole table; see the expansion site for the `Result`/`Option` shape.
            fn $resolve(lib: &libloading::Library) -> $out {
                Self::resolve_with(|sym| lookup(lib, sym))
            }
        }
    };
}

/// Looks up one export as a raw address, or the loader's reason.
fn lookup(lib: &libloading::Library, symbol: &str) -> Result<*mut c_void, String> {
    // SAFETY: the symbol is read as an opaque data pointer and only ever transmuted to the
    // function-pointer type that `verbs.h` declares for the export of that name.
    let sym = unsafe { lib.get::<*mut c_void>(symbol.as_bytes()) };
    match sym {
        Ok(sym) if !(*sym).is_null() => Ok(*sym),
        Ok(_) => Err(format!("export `{symbol}` resolved to NULL")),
        Err(e) => Err(e.to_string()),
    }
}

exports! {
    /// The exports every Ferry RDMA path needs.
    struct Required, resolve -> Result<Required, (&'static str, String)> {
        get_device_list = "ibv_get_device_list": unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
        free_device_list = "ibv_free_device_list": unsafe extern "C" fn(*mut *mut ibv_device),
        get_device_name = "ibv_get_device_name": unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
        get_device_guid = "ibv_get_device_guid": unsafe extern "C" fn(*mut ibv_device) -> u64,
        open_device = "ibv_open_device": unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
        close_device = "ibv_close_device": unsafe extern "C" fn(*mut ibv_context) -> c_int,
        query_device = "ibv_query_device": unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int,
        query_port = "ibv_query_port": unsafe extern "C" fn(*mut ibv_context, u8, *mut _compat_ibv_port_attr) -> c_int,
        query_gid = "ibv_query_gid": unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int,
        alloc_pd = "ibv_alloc_pd": unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
        dealloc_pd = "ibv_dealloc_pd": unsafe extern "C" fn(*mut ibv_pd) -> c_int,
        reg_mr = "ibv_reg_mr": unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
        dereg_mr = "ibv_dereg_mr": unsafe extern "C" fn(*mut ibv_mr) -> c_int,
        create_comp_channel = "ibv_create_comp_channel": unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel,
        destroy_comp_channel = "ibv_destroy_comp_channel": unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
        create_cq = "ibv_create_cq": unsafe extern "C" fn(*mut ibv_context, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq,
        destroy_cq = "ibv_destroy_cq": unsafe extern "C" fn(*mut ibv_cq) -> c_int,
        get_cq_event = "ibv_get_cq_event": unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int,
        ack_cq_events = "ibv_ack_cq_events": unsafe extern "C" fn(*mut ibv_cq, c_uint),
        create_qp = "ibv_create_qp": unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
        modify_qp = "ibv_modify_qp": unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
        query_qp = "ibv_query_qp": unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int, *mut ibv_qp_init_attr) -> c_int,
        destroy_qp = "ibv_destroy_qp": unsafe extern "C" fn(*mut ibv_qp) -> c_int,
        create_ah = "ibv_create_ah": unsafe extern "C" fn(*mut ibv_pd, *mut ibv_ah_attr) -> *mut ibv_ah,
        destroy_ah = "ibv_destroy_ah": unsafe extern "C" fn(*mut ibv_ah) -> c_int,
    }
}

exports! {
    /// Exports that newer rdma-core has and older may lack; absent ones are capabilities.
    struct Optional, resolve -> Optional {
        reg_dmabuf_mr = "ibv_reg_dmabuf_mr": Option<unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr>,
        reg_mr_iova2 = "ibv_reg_mr_iova2": Option<unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, u64, c_uint) -> *mut ibv_mr>,
        query_gid_ex = "_ibv_query_gid_ex": Option<unsafe extern "C" fn(*mut ibv_context, u32, u32, *mut ibv_gid_entry, u32, usize) -> c_int>,
        query_gid_table = "_ibv_query_gid_table": Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_gid_entry, usize, u32, usize) -> isize>,
    }
}

/// Converts a resolved address to the function-pointer type of its field.
///
/// # Safety
/// `addr` must be the address of an export whose C signature is `F`.
unsafe fn as_fn<F: Copy>(addr: *mut c_void) -> F {
    const { assert!(size_of::<F>() == size_of::<*mut c_void>()) };
    // SAFETY: `F` is a (non-null) function-pointer type of pointer size, per the contract.
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&addr) }
}

impl Required {
    fn resolve_with(
        mut get: impl FnMut(&'static str) -> Result<*mut c_void, String>,
    ) -> Result<Self, (&'static str, String)> {
        // Resolve all, report the first missing one (with how many others are missing).
        let mut addrs = Vec::with_capacity(Self::SYMBOLS.len());
        let mut missing: Vec<(&'static str, String)> = Vec::new();
        for &sym in Self::SYMBOLS {
            match get(sym) {
                Ok(addr) => addrs.push(addr),
                Err(reason) => missing.push((sym, reason)),
            }
        }
        if let Some((sym, reason)) = missing.first() {
            let reason = if missing.len() > 1 {
                format!(
                    "{reason} (and {} more required exports missing)",
                    missing.len() - 1
                )
            } else {
                reason.clone()
            };
            return Err((sym, reason));
        }
        let mut it = addrs.into_iter();
        let mut next = || it.next().unwrap_or(std::ptr::null_mut());
        // SAFETY: each address was resolved from the export named in SYMBOLS at the same
        // position, whose verbs.h signature is the field's type; none is NULL (checked above).
        unsafe {
            Ok(Self {
                get_device_list: as_fn(next()),
                free_device_list: as_fn(next()),
                get_device_name: as_fn(next()),
                get_device_guid: as_fn(next()),
                open_device: as_fn(next()),
                close_device: as_fn(next()),
                query_device: as_fn(next()),
                query_port: as_fn(next()),
                query_gid: as_fn(next()),
                alloc_pd: as_fn(next()),
                dealloc_pd: as_fn(next()),
                reg_mr: as_fn(next()),
                dereg_mr: as_fn(next()),
                create_comp_channel: as_fn(next()),
                destroy_comp_channel: as_fn(next()),
                create_cq: as_fn(next()),
                destroy_cq: as_fn(next()),
                get_cq_event: as_fn(next()),
                ack_cq_events: as_fn(next()),
                create_qp: as_fn(next()),
                modify_qp: as_fn(next()),
                query_qp: as_fn(next()),
                destroy_qp: as_fn(next()),
                create_ah: as_fn(next()),
                destroy_ah: as_fn(next()),
            })
        }
    }
}

impl Optional {
    fn resolve_with(mut get: impl FnMut(&'static str) -> Result<*mut c_void, String>) -> Self {
        let mut one = |sym: &'static str| match get(sym) {
            Ok(addr) => Some(addr),
            Err(reason) => {
                tracing::debug!(symbol = sym, %reason, "optional libibverbs export absent");
                None
            }
        };
        // SAFETY: each address comes from the export of the same name, whose verbs.h signature
        // is the field's function-pointer type; `Option<fn>` of a non-null address is `Some`.
        unsafe {
            Self {
                reg_dmabuf_mr: one("ibv_reg_dmabuf_mr").map(|a| as_fn(a)),
                reg_mr_iova2: one("ibv_reg_mr_iova2").map(|a| as_fn(a)),
                query_gid_ex: one("_ibv_query_gid_ex").map(|a| as_fn(a)),
                query_gid_table: one("_ibv_query_gid_table").map(|a| as_fn(a)),
            }
        }
    }
}

/// Which optional libibverbs exports the loaded library has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Capabilities {
    /// `ibv_reg_dmabuf_mr` (rdma-core 34+): registering dma-buf memory, e.g. exported CUDA memory.
    pub reg_dmabuf_mr: bool,
    /// `ibv_reg_mr_iova2`: registration with optional access flags (relaxed ordering).
    pub reg_mr_iova2: bool,
    /// `_ibv_query_gid_ex`: one GID entry with its type (RoCE v1/v2, IB).
    pub query_gid_ex: bool,
    /// `_ibv_query_gid_table`: the whole GID table at once.
    pub query_gid_table: bool,
}

/// The loaded library: a name for messages, the export tables, and the handle that keeps the
/// tables valid. Fields drop in order; function pointers need no drop, the library goes last.
struct Loaded {
    library: String,
    required: Required,
    optional: Optional,
    _library: libloading::Library,
}

/// A loaded libibverbs. Cheap to clone: every clone (and every handle built on one) holds an
/// `Arc` of the library, so the library stays mapped while anything uses it.
#[derive(Clone)]
pub struct Verbs {
    inner: Arc<Loaded>,
}

impl std::fmt::Debug for Verbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verbs")
            .field("library", &self.inner.library)
            .field("capabilities", &self.capabilities())
            .finish()
    }
}

/// Strips a leading `"<library>: "` from a loader message so the library is named once.
fn loader_reason(library: &str, message: String) -> String {
    match message
        .strip_prefix(library)
        .and_then(|m| m.strip_prefix(": "))
    {
        Some(rest) => rest.to_owned(),
        None => message,
    }
}

impl Verbs {
    /// The process-wide libibverbs: opened on the first call and cached, success or failure.
    ///
    /// Opens `$FERRY_IBVERBS_LIB` when that is set and non-empty, else `libibverbs.so.1`.
    pub fn load() -> Result<Verbs, VerbsError> {
        static CACHE: OnceLock<Result<Verbs, VerbsError>> = OnceLock::new();
        let cached = CACHE.get_or_init(|| {
            let library = match std::env::var_os(LIBRARY_ENV) {
                Some(path) if !path.is_empty() => path,
                _ => IBVERBS_LIBRARY.into(),
            };
            Self::load_from(Path::new(&library))
        });
        match cached {
            Ok(verbs) => Ok(verbs.clone()),
            Err(e) => Err(e.duplicate()),
        }
    }

    /// Opens the libibverbs at `path` (a path or a soname), uncached: for configuration and tests.
    pub fn load_from(path: impl AsRef<Path>) -> Result<Verbs, VerbsError> {
        let path = path.as_ref();
        let library = path.display().to_string();
        // SAFETY: opening libibverbs runs its ELF initialisers, which only set up provider
        // tables; the library is a plain C library with no unsound initialisation.
        let lib = match unsafe { libloading::Library::new(path) } {
            Ok(lib) => lib,
            Err(e) => {
                let reason = loader_reason(&library, e.to_string());
                tracing::debug!(%library, %reason, "libibverbs unavailable");
                return Err(VerbsError::Unavailable { library, reason });
            }
        };
        let required = Required::resolve(&lib).map_err(|(symbol, reason)| {
            let reason = loader_reason(&library, reason);
            tracing::debug!(%library, symbol, %reason, "libibverbs lacks a required export");
            VerbsError::MissingSymbol {
                library: library.clone(),
                symbol,
                reason,
            }
        })?;
        let optional = Optional::resolve(&lib);
        tracing::debug!(%library, "libibverbs loaded");
        Ok(Verbs {
            inner: Arc::new(Loaded {
                library,
                required,
                optional,
                _library: lib,
            }),
        })
    }

    /// The name or path this library was opened from, as used in messages.
    pub fn library(&self) -> &str {
        &self.inner.library
    }

    /// Which optional exports the loaded library provides.
    pub fn capabilities(&self) -> Capabilities {
        let o = &self.inner.optional;
        Capabilities {
            reg_dmabuf_mr: o.reg_dmabuf_mr.is_some(),
            reg_mr_iova2: o.reg_mr_iova2.is_some(),
            query_gid_ex: o.query_gid_ex.is_some(),
            query_gid_table: o.query_gid_table.is_some(),
        }
    }

    /// The exports [`Verbs::load`] requires, all resolved together.
    pub const REQUIRED_EXPORTS: &'static [&'static str] = Required::SYMBOLS;

    /// The exports looked up as optional capabilities.
    pub const OPTIONAL_EXPORTS: &'static [&'static str] = Optional::SYMBOLS;

    pub(crate) fn required(&self) -> &Required {
        &self.inner.required
    }

    pub(crate) fn optional(&self) -> &Optional {
        &self.inner.optional
    }

    /// The error for an optional export this library lacks.
    pub(crate) fn unsupported(&self, symbol: &'static str) -> VerbsError {
        VerbsError::Unsupported {
            library: self.inner.library.clone(),
            symbol,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loader_reason_strips_the_library_prefix_once() {
        assert_eq!(
            loader_reason(
                "libibverbs.so.1",
                "libibverbs.so.1: cannot open shared object file: No such file or directory".into()
            ),
            "cannot open shared object file: No such file or directory"
        );
        assert_eq!(loader_reason("a.so", "other text".into()), "other text");
    }

    #[test]
    fn required_resolution_names_the_first_missing_export_and_counts_the_rest() {
        let absent = ["ibv_open_device", "ibv_create_ah"];
        let result = Required::resolve_with(|sym| {
            if absent.contains(&sym) {
                Err(format!("undefined symbol: {sym}"))
            } else {
                Ok(std::ptr::dangling_mut::<c_void>())
            }
        });
        match result {
            Err((sym, reason)) => {
                assert_eq!(sym, "ibv_open_device");
                assert!(
                    reason.contains("undefined symbol: ibv_open_device"),
                    "{reason}"
                );
                assert!(reason.contains("1 more"), "{reason}");
            }
            Ok(_) => panic!("resolution succeeded with exports missing"),
        }
    }

    #[test]
    fn optional_exports_absent_are_none_not_errors() {
        let o = Optional::resolve_with(|sym| {
            if sym == "ibv_reg_dmabuf_mr" {
                Err("undefined symbol".into())
            } else {
                Ok(std::ptr::dangling_mut::<c_void>())
            }
        });
        assert!(o.reg_dmabuf_mr.is_none());
        assert!(o.reg_mr_iova2.is_some());
        assert!(o.query_gid_ex.is_some());
        assert!(o.query_gid_table.is_some());
    }
}

//! Thin `Result`-returning wrappers over the loaded verbs. They take and return raw handles;
//! the safe, owning types live in `ferry-transport-rdma`.
//!
//! Every error names the verb and the device and carries the errno as an `io::Error`.

use std::ffi::c_void;
use std::io;
use std::mem::MaybeUninit;
use std::os::raw::{c_int, c_uint};
use std::ptr::NonNull;

use crate::device::device_name;
use crate::error::VerbsError;
use crate::inline;
use crate::loader::Verbs;
use crate::sys::{
    self, ibv_ah, ibv_ah_attr, ibv_comp_channel, ibv_context, ibv_cq, ibv_device_attr, ibv_gid,
    ibv_gid_entry, ibv_gid_type, ibv_mr, ibv_pd, ibv_port_attr, ibv_qp, ibv_qp_attr,
    ibv_qp_init_attr,
};

/// The name of the device behind a context, for error messages.
///
/// # Safety
/// `ctx` must point to a live `ibv_context`.
unsafe fn ctx_device(ctx: *const ibv_context) -> String {
    // SAFETY: the caller guarantees `ctx` is live; `device` is set by `ibv_open_device`.
    let dev = unsafe { (*ctx).device };
    if dev.is_null() {
        "<unknown device>".to_owned()
    } else {
        // SAFETY: a live context's device outlives it.
        unsafe { device_name(dev) }
    }
}

/// An errno from a verb that returns `0` or an error number (some providers return `-errno`
/// or `-1` with `errno` set; all three are handled).
fn rc_error(rc: c_int) -> io::Error {
    if rc == -1 {
        io::Error::last_os_error()
    } else {
        io::Error::from_raw_os_error(rc.saturating_abs())
    }
}

fn check(rc: c_int, verb: &'static str, device: impl FnOnce() -> String) -> Result<(), VerbsError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(VerbsError::Verb {
            verb,
            device: device(),
            source: rc_error(rc),
        })
    }
}

fn non_null<T>(
    p: *mut T,
    verb: &'static str,
    device: impl FnOnce() -> String,
) -> Result<NonNull<T>, VerbsError> {
    // Read errno before anything else can overwrite it.
    let err = io::Error::last_os_error();
    NonNull::new(p).ok_or_else(|| VerbsError::Verb {
        verb,
        device: device(),
        source: err,
    })
}

fn zeroed<T>() -> T {
    // SAFETY: only used for verbs attribute structs: plain C data, valid when all-zero.
    unsafe { MaybeUninit::<T>::zeroed().assume_init() }
}

impl Verbs {
    /// `ibv_close_device`.
    ///
    /// # Safety
    /// `ctx` must come from [`Verbs::open_device`] of this library, with every object created on
    /// it destroyed, and must not be used afterwards.
    pub unsafe fn close_device(&self, ctx: NonNull<ibv_context>) -> Result<(), VerbsError> {
        // SAFETY: the context is live until the call below (caller's contract).
        let device = unsafe { ctx_device(ctx.as_ptr()) };
        // SAFETY: the caller hands over a live context of this library.
        let rc = unsafe { (self.required().close_device)(ctx.as_ptr()) };
        check(rc, "ibv_close_device", || device)
    }

    /// `ibv_query_device`.
    ///
    /// # Safety
    /// `ctx` must be a live context of this library.
    pub unsafe fn query_device(
        &self,
        ctx: NonNull<ibv_context>,
    ) -> Result<ibv_device_attr, VerbsError> {
        let mut attr: ibv_device_attr = zeroed();
        // SAFETY: live context (caller), writable attr.
        let rc = unsafe { (self.required().query_device)(ctx.as_ptr(), &mut attr) };
        // SAFETY: live context.
        check(rc, "ibv_query_device", || unsafe {
            ctx_device(ctx.as_ptr())
        })?;
        Ok(attr)
    }

    /// `ibv_query_port` (the `verbs.h` inline: extended provider op, else the compat export).
    ///
    /// # Safety
    /// `ctx` must be a live context of this library.
    pub unsafe fn query_port(
        &self,
        ctx: NonNull<ibv_context>,
        port_num: u8,
    ) -> Result<ibv_port_attr, VerbsError> {
        let mut attr: ibv_port_attr = zeroed();
        // SAFETY: live context (caller), writable attr, this library's compat export.
        let rc = unsafe {
            inline::query_port(
                ctx.as_ptr(),
                port_num,
                &mut attr,
                self.required().query_port,
            )
        };
        check(rc, "ibv_query_port", || {
            // SAFETY: live context (caller).
            let device = unsafe { ctx_device(ctx.as_ptr()) };
            format!("{device} port {port_num}")
        })?;
        Ok(attr)
    }

    /// `ibv_query_gid`: the GID at `index` of `port_num`.
    ///
    /// # Safety
    /// `ctx` must be a live context of this library.
    pub unsafe fn query_gid(
        &self,
        ctx: NonNull<ibv_context>,
        port_num: u8,
        index: c_int,
    ) -> Result<ibv_gid, VerbsError> {
        let mut gid: ibv_gid = zeroed();
        // SAFETY: live context (caller), writable gid.
        let rc = unsafe { (self.required().query_gid)(ctx.as_ptr(), port_num, index, &mut gid) };
        check(rc, "ibv_query_gid", || {
            // SAFETY: live context (caller).
            let device = unsafe { ctx_device(ctx.as_ptr()) };
            format!("{device} port {port_num} gid {index}")
        })?;
        Ok(gid)
    }

    /// `ibv_query_gid_ex` (optional export `_ibv_query_gid_ex`): one GID entry with its type.
    /// `Unsupported` when the library lacks the export.
    ///
    /// # Safety
    /// `ctx` must be a live context of this library.
    pub unsafe fn query_gid_ex(
        &self,
        ctx: NonNull<ibv_context>,
        port_num: u32,
        index: u32,
    ) -> Result<ibv_gid_entry, VerbsError> {
        let f = self
            .optional()
            .query_gid_ex
            .ok_or_else(|| self.unsupported("_ibv_query_gid_ex"))?;
        let mut entry: ibv_gid_entry = zeroed();
        // SAFETY: live context (caller), writable entry of the size we pass.
        let rc = unsafe {
            f(
                ctx.as_ptr(),
                port_num,
                index,
                &mut entry,
                0,
                size_of::<ibv_gid_entry>(),
            )
        };
        check(rc, "ibv_query_gid_ex", || {
            // SAFETY: live context (caller).
            let device = unsafe { ctx_device(ctx.as_ptr()) };
            format!("{device} port {port_num} gid {index}")
        })?;
        Ok(entry)
    }

    /// The GID type (`IBV_GID_TYPE_IB`, `_ROCE_V1`, `_ROCE_V2`) at `index`, via the optional
    /// `_ibv_query_gid_ex`. `Ok(None)` when the library lacks that export (the caller may read
    /// sysfs `ports/N/gid_attrs/types/I` instead).
    ///
    /// # Safety
    /// `ctx` must be a live context of this library.
    pub unsafe fn query_gid_type(
        &self,
        ctx: NonNull<ibv_context>,
        port_num: u32,
        index: u32,
    ) -> Result<Option<ibv_gid_type>, VerbsError> {
        if self.optional().query_gid_ex.is_none() {
            return Ok(None);
        }
        // SAFETY: forwarded caller contract.
        let entry = unsafe { self.query_gid_ex(ctx, port_num, index) }?;
        Ok(Some(entry.gid_type))
    }

    /// `ibv_alloc_pd`.
    ///
    /// # Safety
    /// `ctx` must be a live context of this library.
    pub unsafe fn alloc_pd(
        &self,
        ctx: NonNull<ibv_context>,
    ) -> Result<NonNull<ibv_pd>, VerbsError> {
        // SAFETY: live context (caller).
        let pd = unsafe { (self.required().alloc_pd)(ctx.as_ptr()) };
        // SAFETY: live context.
        non_null(pd, "ibv_alloc_pd", || unsafe { ctx_device(ctx.as_ptr()) })
    }

    /// `ibv_dealloc_pd`.
    ///
    /// # Safety
    /// `pd` must be a live PD of this library with no objects left on it; not used afterwards.
    pub unsafe fn dealloc_pd(&self, pd: NonNull<ibv_pd>) -> Result<(), VerbsError> {
        // SAFETY: live PD and its context (caller).
        let device = unsafe { ctx_device((*pd.as_ptr()).context) };
        // SAFETY: live PD (caller).
        let rc = unsafe { (self.required().dealloc_pd)(pd.as_ptr()) };
        check(rc, "ibv_dealloc_pd", || device)
    }

    /// `ibv_reg_mr` as the `verbs.h` macro does it: the exported `ibv_reg_mr` when `access` has
    /// no optional flags, else `ibv_reg_mr_iova2` with `iova = addr` (`Unsupported` if absent).
    ///
    /// # Safety
    /// `pd` must be a live PD of this library and `addr..addr+length` memory that stays mapped
    /// until the MR is deregistered.
    pub unsafe fn reg_mr(
        &self,
        pd: NonNull<ibv_pd>,
        addr: *mut c_void,
        length: usize,
        access: c_int,
    ) -> Result<NonNull<ibv_mr>, VerbsError> {
        let optional_bits = (access as c_uint) & sys::IB_UVERBS_ACCESS_OPTIONAL_RANGE;
        let (verb, mr) = if optional_bits == 0 {
            // SAFETY: live PD and mapped range (caller).
            ("ibv_reg_mr", unsafe {
                (self.required().reg_mr)(pd.as_ptr(), addr, length, access)
            })
        } else {
            let f = self
                .optional()
                .reg_mr_iova2
                .ok_or_else(|| self.unsupported("ibv_reg_mr_iova2"))?;
            // SAFETY: live PD and mapped range (caller).
            let mr = unsafe { f(pd.as_ptr(), addr, length, addr as u64, access as c_uint) };
            ("ibv_reg_mr_iova2", mr)
        };
        // SAFETY: live PD and its context.
        non_null(mr, verb, || unsafe { ctx_device((*pd.as_ptr()).context) })
    }

    /// `ibv_reg_dmabuf_mr` (optional export): registers `length` bytes at `offset` of dma-buf
    /// `fd`, addressed as `iova`. `Unsupported` when the library lacks the export.
    ///
    /// # Safety
    /// `pd` must be a live PD of this library and `fd` a dma-buf that outlives the MR.
    pub unsafe fn reg_dmabuf_mr(
        &self,
        pd: NonNull<ibv_pd>,
        offset: u64,
        length: usize,
        iova: u64,
        fd: c_int,
        access: c_int,
    ) -> Result<NonNull<ibv_mr>, VerbsError> {
        let f = self
            .optional()
            .reg_dmabuf_mr
            .ok_or_else(|| self.unsupported("ibv_reg_dmabuf_mr"))?;
        // SAFETY: live PD and dma-buf (caller).
        let mr = unsafe { f(pd.as_ptr(), offset, length, iova, fd, access) };
        // SAFETY: live PD and its context.
        non_null(mr, "ibv_reg_dmabuf_mr", || unsafe {
            ctx_device((*pd.as_ptr()).context)
        })
    }

    /// `ibv_dereg_mr`.
    ///
    /// # Safety
    /// `mr` must be a live MR of this library with no work in flight on it; not used afterwards.
    pub unsafe fn dereg_mr(&self, mr: NonNull<ibv_mr>) -> Result<(), VerbsError> {
        // SAFETY: live MR and its context (caller).
        let device = unsafe { ctx_device((*mr.as_ptr()).context) };
        // SAFETY: live MR (caller).
        let rc = unsafe { (self.required().dereg_mr)(mr.as_ptr()) };
        check(rc, "ibv_dereg_mr", || device)
    }

    /// `ibv_create_comp_channel`.
    ///
    /// # Safety
    /// `ctx` must be a live context of this library.
    pub unsafe fn create_comp_channel(
        &self,
        ctx: NonNull<ibv_context>,
    ) -> Result<NonNull<ibv_comp_channel>, VerbsError> {
        // SAFETY: live context (caller).
        let ch = unsafe { (self.required().create_comp_channel)(ctx.as_ptr()) };
        // SAFETY: live context.
        non_null(ch, "ibv_create_comp_channel", || unsafe {
            ctx_device(ctx.as_ptr())
        })
    }

    /// `ibv_destroy_comp_channel`.
    ///
    /// # Safety
    /// `channel` must be a live channel of this library with no CQ attached; not used afterwards.
    pub unsafe fn destroy_comp_channel(
        &self,
        channel: NonNull<ibv_comp_channel>,
    ) -> Result<(), VerbsError> {
        // SAFETY: live channel and its context (caller).
        let device = unsafe { ctx_device((*channel.as_ptr()).context) };
        // SAFETY: live channel (caller).
        let rc = unsafe { (self.required().destroy_comp_channel)(channel.as_ptr()) };
        check(rc, "ibv_destroy_comp_channel", || device)
    }

    /// `ibv_create_cq` with room for `cqe` entries, optional completion `channel`.
    ///
    /// # Safety
    /// `ctx` must be a live context of this library; `channel`, when given, a live channel of it.
    pub unsafe fn create_cq(
        &self,
        ctx: NonNull<ibv_context>,
        cqe: c_int,
        cq_context: *mut c_void,
        channel: Option<NonNull<ibv_comp_channel>>,
        comp_vector: c_int,
    ) -> Result<NonNull<ibv_cq>, VerbsError> {
        let channel = channel.map_or(std::ptr::null_mut(), NonNull::as_ptr);
        // SAFETY: live context and channel (caller).
        let cq = unsafe {
            (self.required().create_cq)(ctx.as_ptr(), cqe, cq_context, channel, comp_vector)
        };
        // SAFETY: live context.
        non_null(cq, "ibv_create_cq", || unsafe { ctx_device(ctx.as_ptr()) })
    }

    /// `ibv_destroy_cq`.
    ///
    /// # Safety
    /// `cq` must be a live CQ of this library, no QP using it, all its events acked.
    pub unsafe fn destroy_cq(&self, cq: NonNull<ibv_cq>) -> Result<(), VerbsError> {
        // SAFETY: live CQ and its context (caller).
        let device = unsafe { ctx_device((*cq.as_ptr()).context) };
        // SAFETY: live CQ (caller).
        let rc = unsafe { (self.required().destroy_cq)(cq.as_ptr()) };
        check(rc, "ibv_destroy_cq", || device)
    }

    /// `ibv_get_cq_event`: blocks (unless the channel fd is non-blocking) for the next event;
    /// returns the CQ and its `cq_context`. Ack it with [`Verbs::ack_cq_events`].
    ///
    /// # Safety
    /// `channel` must be a live channel of this library.
    pub unsafe fn get_cq_event(
        &self,
        channel: NonNull<ibv_comp_channel>,
    ) -> Result<(NonNull<ibv_cq>, *mut c_void), VerbsError> {
        let mut cq: *mut ibv_cq = std::ptr::null_mut();
        let mut cq_context: *mut c_void = std::ptr::null_mut();
        // SAFETY: live channel (caller), valid out-pointers.
        let rc =
            unsafe { (self.required().get_cq_event)(channel.as_ptr(), &mut cq, &mut cq_context) };
        // SAFETY: live channel and its context.
        let device = || unsafe { ctx_device((*channel.as_ptr()).context) };
        if rc != 0 {
            // ibv_get_cq_event returns -1 and sets errno.
            return Err(VerbsError::Verb {
                verb: "ibv_get_cq_event",
                device: device(),
                source: rc_error(rc),
            });
        }
        let cq = NonNull::new(cq).ok_or_else(|| VerbsError::Verb {
            verb: "ibv_get_cq_event",
            device: device(),
            source: io::Error::new(io::ErrorKind::InvalidData, "event without a CQ"),
        })?;
        Ok((cq, cq_context))
    }

    /// `ibv_ack_cq_events`: acknowledges `nevents` events of `cq`.
    ///
    /// # Safety
    /// `cq` must be a live CQ of this library that received at least `nevents` unacked events.
    pub unsafe fn ack_cq_events(&self, cq: NonNull<ibv_cq>, nevents: c_uint) {
        // SAFETY: live CQ (caller).
        unsafe { (self.required().ack_cq_events)(cq.as_ptr(), nevents) }
    }

    /// `ibv_create_qp`. `attr.cap` is updated with the capacities actually granted.
    ///
    /// # Safety
    /// `pd` must be a live PD of this library and `attr`'s CQs (and SRQ) live objects of it.
    pub unsafe fn create_qp(
        &self,
        pd: NonNull<ibv_pd>,
        attr: &mut ibv_qp_init_attr,
    ) -> Result<NonNull<ibv_qp>, VerbsError> {
        // SAFETY: live PD and attr objects (caller).
        let qp = unsafe { (self.required().create_qp)(pd.as_ptr(), attr) };
        // SAFETY: live PD and its context.
        non_null(qp, "ibv_create_qp", || unsafe {
            ctx_device((*pd.as_ptr()).context)
        })
    }

    /// `ibv_modify_qp` with the `IBV_QP_*` attribute `mask`.
    ///
    /// # Safety
    /// `qp` must be a live QP of this library.
    pub unsafe fn modify_qp(
        &self,
        qp: NonNull<ibv_qp>,
        attr: &mut ibv_qp_attr,
        mask: c_int,
    ) -> Result<(), VerbsError> {
        // SAFETY: live QP (caller).
        let rc = unsafe { (self.required().modify_qp)(qp.as_ptr(), attr, mask) };
        check(rc, "ibv_modify_qp", || {
            // SAFETY: live QP and its context (caller).
            let (device, num) = unsafe {
                let qp = qp.as_ptr();
                (ctx_device((*qp).context), (*qp).qp_num)
            };
            format!("{device} qp {num}")
        })
    }

    /// `ibv_query_qp` for the `IBV_QP_*` attributes in `mask`.
    ///
    /// # Safety
    /// `qp` must be a live QP of this library.
    pub unsafe fn query_qp(
        &self,
        qp: NonNull<ibv_qp>,
        mask: c_int,
    ) -> Result<(ibv_qp_attr, ibv_qp_init_attr), VerbsError> {
        let mut attr: ibv_qp_attr = zeroed();
        let mut init: ibv_qp_init_attr = zeroed();
        // SAFETY: live QP (caller), writable outputs.
        let rc = unsafe { (self.required().query_qp)(qp.as_ptr(), &mut attr, mask, &mut init) };
        // SAFETY: live QP and its context.
        check(rc, "ibv_query_qp", || unsafe {
            ctx_device((*qp.as_ptr()).context)
        })?;
        Ok((attr, init))
    }

    /// `ibv_destroy_qp`.
    ///
    /// # Safety
    /// `qp` must be a live QP of this library; not used afterwards.
    pub unsafe fn destroy_qp(&self, qp: NonNull<ibv_qp>) -> Result<(), VerbsError> {
        // SAFETY: live QP and its context (caller).
        let device = unsafe { ctx_device((*qp.as_ptr()).context) };
        // SAFETY: live QP (caller).
        let rc = unsafe { (self.required().destroy_qp)(qp.as_ptr()) };
        check(rc, "ibv_destroy_qp", || device)
    }

    /// `ibv_create_ah`.
    ///
    /// # Safety
    /// `pd` must be a live PD of this library.
    pub unsafe fn create_ah(
        &self,
        pd: NonNull<ibv_pd>,
        attr: &mut ibv_ah_attr,
    ) -> Result<NonNull<ibv_ah>, VerbsError> {
        // SAFETY: live PD (caller).
        let ah = unsafe { (self.required().create_ah)(pd.as_ptr(), attr) };
        // SAFETY: live PD and its context.
        non_null(ah, "ibv_create_ah", || unsafe {
            ctx_device((*pd.as_ptr()).context)
        })
    }

    /// `ibv_destroy_ah`.
    ///
    /// # Safety
    /// `ah` must be a live AH of this library; not used afterwards.
    pub unsafe fn destroy_ah(&self, ah: NonNull<ibv_ah>) -> Result<(), VerbsError> {
        // SAFETY: live AH and its context (caller).
        let device = unsafe { ctx_device((*ah.as_ptr()).context) };
        // SAFETY: live AH (caller).
        let rc = unsafe { (self.required().destroy_ah)(ah.as_ptr()) };
        check(rc, "ibv_destroy_ah", || device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rc_error_accepts_positive_and_negative_errno() {
        assert_eq!(rc_error(libc::EINVAL).raw_os_error(), Some(libc::EINVAL));
        assert_eq!(rc_error(-libc::ENOMEM).raw_os_error(), Some(libc::ENOMEM));
    }

    #[test]
    fn check_names_the_verb_and_device() {
        let err = match check(libc::EBUSY, "ibv_destroy_qp", || "mlx5_0".to_owned()) {
            Err(e) => e,
            Ok(()) => panic!("a non-zero rc must be an error"),
        };
        let text = err.to_string();
        assert!(
            text.starts_with("ibv_destroy_qp failed on mlx5_0: "),
            "{text}"
        );
        assert_eq!(err.raw_os_error(), Some(libc::EBUSY));
    }
}

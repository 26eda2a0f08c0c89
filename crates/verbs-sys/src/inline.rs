//! Rust ports of the verbs that `verbs.h` defines `static inline`, which therefore have no
//! export to load: they call through the provider's ops table in the `ibv_context`.
//!
//! Return convention (the C one, kept so the data path stays a plain integer):
//! - [`post_send`], [`post_recv`], [`req_notify_cq`]: `0` on success, else a positive errno;
//!   `EOPNOTSUPP` when the provider leaves the op NULL.
//! - [`poll_cq`]: the number of completions written (`>= 0`), or a negative value on error;
//!   `-EOPNOTSUPP` when the provider leaves the op NULL.
//! - [`query_port`]: `0` or a positive errno, like `ibv_query_port`.

use std::os::raw::c_int;

use crate::sys::{
    _compat_ibv_port_attr, ibv_context, ibv_cq, ibv_port_attr, ibv_qp, ibv_recv_wr, ibv_send_wr,
    ibv_wc, verbs_context,
};

/// `ibv_post_send`: posts a chain of send work requests to `qp`.
///
/// # Safety
/// `qp` must point to a live QP whose `context` is a live `ibv_context`; `wr` must be a valid
/// chain of work requests (with valid SGEs) and `bad_wr` a writable pointer slot.
pub unsafe fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: the caller guarantees `qp` and its `context` are live.
    let op = unsafe { (*(*qp).context).ops.post_send };
    match op {
        // SAFETY: the provider's op for this QP, called with the caller's valid arguments.
        Some(f) => unsafe { f(qp, wr, bad_wr) },
        None => libc::EOPNOTSUPP,
    }
}

/// `ibv_post_recv`: posts a chain of receive work requests to `qp`.
///
/// # Safety
/// As for [`post_send`], with receive work requests.
pub unsafe fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: the caller guarantees `qp` and its `context` are live.
    let op = unsafe { (*(*qp).context).ops.post_recv };
    match op {
        // SAFETY: the provider's op for this QP, called with the caller's valid arguments.
        Some(f) => unsafe { f(qp, wr, bad_wr) },
        None => libc::EOPNOTSUPP,
    }
}

/// `ibv_poll_cq`: moves up to `num_entries` completions from `cq` into `wc`.
///
/// # Safety
/// `cq` must point to a live CQ whose `context` is live, and `wc` to at least `num_entries`
/// writable `ibv_wc`s.
pub unsafe fn poll_cq(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: the caller guarantees `cq` and its `context` are live.
    let op = unsafe { (*(*cq).context).ops.poll_cq };
    match op {
        // SAFETY: the provider's op for this CQ; `wc` has room for `num_entries` entries.
        Some(f) => unsafe { f(cq, num_entries, wc) },
        None => -libc::EOPNOTSUPP,
    }
}

/// `ibv_req_notify_cq`: arms `cq` so its completion channel gets the next (solicited) event.
///
/// # Safety
/// `cq` must point to a live CQ whose `context` is live.
pub unsafe fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: the caller guarantees `cq` and its `context` are live.
    let op = unsafe { (*(*cq).context).ops.req_notify_cq };
    match op {
        // SAFETY: the provider's op for this CQ.
        Some(f) => unsafe { f(cq, solicited_only) },
        None => libc::EOPNOTSUPP,
    }
}

/// The `ibv_context::abi_compat` marker of a context embedded in a `verbs_context`.
const VERBS_ABI_IS_EXTENDED: usize = usize::MAX;

/// `verbs_get_ctx_op(ctx, query_port)`: the extended context when it is one, it is large enough
/// to hold `query_port`, and the provider set that op.
///
/// # Safety
/// `ctx` must point to a live `ibv_context`.
unsafe fn extended_query_port(ctx: *mut ibv_context) -> Option<*mut verbs_context> {
    // SAFETY: the caller guarantees `ctx` is live.
    let abi = unsafe { (*ctx).abi_compat } as usize;
    if abi != VERBS_ABI_IS_EXTENDED {
        return None;
    }
    let offset = std::mem::offset_of!(verbs_context, context);
    // SAFETY: an extended context is the `context` field of a `verbs_context` (container_of).
    let vctx = unsafe { ctx.cast::<u8>().sub(offset) }.cast::<verbs_context>();
    let need = size_of::<verbs_context>() - std::mem::offset_of!(verbs_context, query_port);
    // SAFETY: `vctx` is the enclosing `verbs_context`; `sz` is its provider-set size.
    let (sz, op) = unsafe { ((*vctx).sz, (*vctx).query_port) };
    (sz >= need && op.is_some()).then_some(vctx)
}

/// `ibv_query_port` as `verbs.h` defines it (`___ibv_query_port`): the provider's extended
/// `query_port` when present, else the exported compat `ibv_query_port` (`compat`) after zeroing
/// `attr` (the compat struct is a prefix of `ibv_port_attr`).
///
/// # Safety
/// `ctx` must point to a live `ibv_context`, `attr` to a writable `ibv_port_attr`, and `compat`
/// must be the exported `ibv_query_port` of the library that opened `ctx`.
pub unsafe fn query_port(
    ctx: *mut ibv_context,
    port_num: u8,
    attr: *mut ibv_port_attr,
    compat: unsafe extern "C" fn(*mut ibv_context, u8, *mut _compat_ibv_port_attr) -> c_int,
) -> c_int {
    // SAFETY: the caller guarantees `ctx` is live.
    if let Some(vctx) = unsafe { extended_query_port(ctx) } {
        // SAFETY: `extended_query_port` checked the size and that the op is set.
        if let Some(f) = unsafe { (*vctx).query_port } {
            // SAFETY: the provider's op, with the size of the struct we pass.
            return unsafe { f(ctx, port_num, attr, size_of::<ibv_port_attr>()) };
        }
    }
    // SAFETY: `attr` is writable for a whole `ibv_port_attr`, which begins with the compat one.
    unsafe {
        std::ptr::write_bytes(attr, 0, 1);
        compat(ctx, port_num, attr.cast::<_compat_ibv_port_attr>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::MaybeUninit;
    use std::ptr;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static SENDS: AtomicUsize = AtomicUsize::new(0);
    static RECVS: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn fake_post_send(
        _qp: *mut ibv_qp,
        _wr: *mut ibv_send_wr,
        _bad: *mut *mut ibv_send_wr,
    ) -> c_int {
        SENDS.fetch_add(1, Ordering::SeqCst);
        7
    }
    unsafe extern "C" fn fake_post_recv(
        _qp: *mut ibv_qp,
        _wr: *mut ibv_recv_wr,
        _bad: *mut *mut ibv_recv_wr,
    ) -> c_int {
        RECVS.fetch_add(1, Ordering::SeqCst);
        0
    }
    unsafe extern "C" fn fake_poll_cq(_cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
        if n > 0 {
            // SAFETY: the test passes room for `n` completions.
            unsafe { (*wc).wr_id = 42 };
            1
        } else {
            0
        }
    }
    unsafe extern "C" fn fake_req_notify(_cq: *mut ibv_cq, solicited: c_int) -> c_int {
        100 + solicited
    }
    unsafe extern "C" fn fake_compat_query_port(
        _ctx: *mut ibv_context,
        port: u8,
        attr: *mut _compat_ibv_port_attr,
    ) -> c_int {
        // SAFETY: `query_port` passes a writable `ibv_port_attr` (the compat type is opaque).
        unsafe { (*attr.cast::<ibv_port_attr>()).lid = u16::from(port) };
        0
    }

    /// A zeroed context (all ops NULL), a QP and a CQ pointing at it.
    struct Fake {
        ctx: Box<ibv_context>,
        qp: Box<ibv_qp>,
        cq: Box<ibv_cq>,
    }

    fn zeroed<T>() -> Box<T> {
        // SAFETY: the verbs structs are plain C data for which all-zero bytes are valid
        // (NULL pointers, `None` function pointers, zero integers).
        Box::new(unsafe { MaybeUninit::<T>::zeroed().assume_init() })
    }

    fn fake(with_ops: bool) -> Fake {
        let mut ctx: Box<ibv_context> = zeroed();
        if with_ops {
            ctx.ops.post_send = Some(fake_post_send);
            ctx.ops.post_recv = Some(fake_post_recv);
            ctx.ops.poll_cq = Some(fake_poll_cq);
            ctx.ops.req_notify_cq = Some(fake_req_notify);
        }
        let mut qp: Box<ibv_qp> = zeroed();
        let mut cq: Box<ibv_cq> = zeroed();
        qp.context = &mut *ctx;
        cq.context = &mut *ctx;
        Fake { ctx, qp, cq }
    }

    #[test]
    fn ops_are_called_through_the_context_table() {
        let mut f = fake(true);
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        let mut bad_r: *mut ibv_recv_wr = ptr::null_mut();
        let mut wc: Box<ibv_wc> = zeroed();
        let before = SENDS.load(Ordering::SeqCst);
        // SAFETY: the fake QP/CQ point at a live fake context whose ops ignore the WR pointers.
        unsafe {
            assert_eq!(post_send(&mut *f.qp, ptr::null_mut(), &mut bad), 7);
            assert_eq!(post_recv(&mut *f.qp, ptr::null_mut(), &mut bad_r), 0);
            assert_eq!(poll_cq(&mut *f.cq, 1, &mut *wc), 1);
            assert_eq!(req_notify_cq(&mut *f.cq, 1), 101);
        }
        assert_eq!(SENDS.load(Ordering::SeqCst), before + 1);
        assert!(RECVS.load(Ordering::SeqCst) >= 1);
        assert_eq!(wc.wr_id, 42);
    }

    #[test]
    fn missing_ops_return_eopnotsupp() {
        let mut f = fake(false);
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        let mut bad_r: *mut ibv_recv_wr = ptr::null_mut();
        let mut wc: Box<ibv_wc> = zeroed();
        // SAFETY: the fake QP/CQ point at a live fake context whose ops are all NULL.
        unsafe {
            assert_eq!(
                post_send(&mut *f.qp, ptr::null_mut(), &mut bad),
                libc::EOPNOTSUPP
            );
            assert_eq!(
                post_recv(&mut *f.qp, ptr::null_mut(), &mut bad_r),
                libc::EOPNOTSUPP
            );
            assert_eq!(poll_cq(&mut *f.cq, 1, &mut *wc), -libc::EOPNOTSUPP);
            assert_eq!(req_notify_cq(&mut *f.cq, 0), libc::EOPNOTSUPP);
        }
    }

    #[test]
    fn query_port_falls_back_to_the_compat_export_on_a_plain_context() {
        let mut f = fake(false);
        let mut attr: Box<ibv_port_attr> = zeroed();
        attr.gid_tbl_len = 99; // must be zeroed by the fallback
        // SAFETY: a live fake context (abi_compat NULL, so not extended) and a writable attr.
        let rc = unsafe { query_port(&mut *f.ctx, 3, &mut *attr, fake_compat_query_port) };
        assert_eq!(rc, 0);
        assert_eq!(attr.lid, 3);
        assert_eq!(attr.gid_tbl_len, 0);
    }
}

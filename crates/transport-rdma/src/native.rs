//! Owning handles over `ferry-verbs-sys`: device context, protection domain, memory region,
//! completion channel, completion queue and RC queue pair. This is the only module with `unsafe`.
//!
//! Each handle is a `NonNull` plus an `Arc` of its parent, so a parent outlives its children;
//! fields are declared so that the native object is destroyed (in `Drop`) before the parent `Arc`
//! is released. `Drop` never panics: a failed destroy is recorded in the shared [`Faults`] and
//! the parent is leaked on purpose (destroying it would fail too, and its memory must stay
//! mapped for the NIC); [`Faults::check`] surfaces it as `Unquiesced`.

use std::ffi::c_void;
use std::io;
use std::mem::MaybeUninit;
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use ferry_verbs_sys::{Verbs, VerbsError, ffi, inline};

use crate::error::RdmaError;
use crate::verbs::{Completion, PostError, QpVerbs, SendWr, Transition, WrKind};

/// Native destroys that failed: the objects stay held and are reported as `Unquiesced`.
#[derive(Debug, Default, Clone)]
pub(crate) struct Faults(Arc<Mutex<Vec<String>>>);

impl Faults {
    pub(crate) fn record(&self, what: &str, err: &VerbsError) {
        tracing::error!(what, error = %err, "native destroy failed; object kept (unquiesced)");
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(format!("{what}: {err}"));
    }

    /// `Err(Unquiesced)` with the evidence when any destroy failed.
    pub(crate) fn check(&self) -> Result<(), ferry_core::Error> {
        let list = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if list.is_empty() {
            Ok(())
        } else {
            Err(ferry_core::Error::Unquiesced {
                what: format!("{} RDMA object(s)", list.len()),
                evidence: list.join("; "),
            })
        }
    }
}

fn zeroed<T>() -> T {
    // SAFETY: only used for verbs attribute and work-request structs: plain C data (integers,
    // raw pointers, unions of those) for which all-zero is a valid value.
    unsafe { MaybeUninit::<T>::zeroed().assume_init() }
}

/// An opened device (`ibv_context`).
pub(crate) struct Device {
    ctx: NonNull<ffi::ibv_context>,
    pub(crate) name: String,
    verbs: Verbs,
    faults: Faults,
}

// SAFETY: libibverbs contexts are thread-safe (rdma-core documents every verb as callable from
// any thread); the pointer is only dereferenced through verbs.
unsafe impl Send for Device {}
// SAFETY: as above; `Device` has no interior state of its own besides the pointer.
unsafe impl Sync for Device {}

/// What the data path needs from `ibv_query_port`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PortAttr {
    pub(crate) active: bool,
    pub(crate) state: u32,
    pub(crate) active_mtu: u32,
    pub(crate) lid: u16,
    pub(crate) ethernet: bool,
}

impl Device {
    pub(crate) fn open(verbs: &Verbs, name: &str, faults: &Faults) -> Result<Arc<Self>, RdmaError> {
        let ctx = verbs
            .open_device(name)
            .map_err(|source| RdmaError::OpenDevice {
                device: name.to_owned(),
                source,
            })?;
        Ok(Arc::new(Self {
            ctx,
            name: name.to_owned(),
            verbs: verbs.clone(),
            faults: faults.clone(),
        }))
    }

    pub(crate) fn query_port(&self, port: u8) -> Result<PortAttr, VerbsError> {
        // SAFETY: `ctx` is live for the life of `self`.
        let a = unsafe { self.verbs.query_port(self.ctx, port) }?;
        Ok(PortAttr {
            active: a.state == ffi::IBV_PORT_ACTIVE,
            state: a.state,
            active_mtu: a.active_mtu,
            lid: a.lid,
            ethernet: u32::from(a.link_layer) == ffi::IBV_LINK_LAYER_ETHERNET,
        })
    }

    pub(crate) fn query_gid(&self, port: u8, index: u32) -> Result<[u8; 16], VerbsError> {
        let index = c_int::try_from(index).unwrap_or(c_int::MAX);
        // SAFETY: `ctx` is live for the life of `self`.
        let gid = unsafe { self.verbs.query_gid(self.ctx, port, index) }?;
        // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
        Ok(unsafe { gid.raw })
    }

    /// `max_qp_rd_atom` and `max_qp_wr` of the device.
    pub(crate) fn limits(&self) -> Result<(u8, u32), VerbsError> {
        // SAFETY: `ctx` is live for the life of `self`.
        let a = unsafe { self.verbs.query_device(self.ctx) }?;
        let rd = u8::try_from(a.max_qp_rd_atom.clamp(1, 255)).unwrap_or(1);
        let wr = u32::try_from(a.max_qp_wr.max(1)).unwrap_or(1);
        Ok((rd, wr))
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every child holds an `Arc<Device>`, so none is left; `ctx` is not used again.
        if let Err(e) = unsafe { self.verbs.close_device(self.ctx) } {
            self.faults
                .record(&format!("ibv_close_device {}", self.name), &e);
        }
    }
}

/// A protection domain.
pub(crate) struct Pd {
    pd: NonNull<ffi::ibv_pd>,
    pub(crate) device: Arc<Device>,
}

// SAFETY: verbs objects are thread-safe; the pointer is only used through verbs.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    pub(crate) fn alloc(device: &Arc<Device>) -> Result<Arc<Self>, RdmaError> {
        // SAFETY: the context is live while `device` is.
        let pd =
            unsafe { device.verbs.alloc_pd(device.ctx) }.map_err(|source| RdmaError::Create {
                what: "protection domain",
                device: device.name.clone(),
                source,
            })?;
        Ok(Arc::new(Self {
            pd,
            device: device.clone(),
        }))
    }

    /// Registers `len` bytes at `addr` with `access` (`ibv_access_flags`).
    ///
    /// # Safety
    /// `addr..addr+len` must stay mapped until the returned MR is dropped or destroyed.
    pub(crate) unsafe fn reg_mr(
        self: &Arc<Self>,
        addr: *mut u8,
        len: usize,
        access: u32,
    ) -> Result<Mr, VerbsError> {
        let access = c_int::try_from(access).unwrap_or(0);
        // SAFETY: live PD; the range stays mapped (caller's contract).
        let mr = unsafe {
            self.device
                .verbs
                .reg_mr(self.pd, addr.cast::<c_void>(), len, access)
        }?;
        Ok(Mr {
            mr,
            live: true,
            pd: self.clone(),
        })
    }
}

impl Pd {
    /// Registers `len` bytes at `offset` of the dma-buf `fd`, addressed as `iova`, with `access`
    /// (`ibv_reg_dmabuf_mr`; `Unsupported` naming libibverbs and the export when it is absent).
    ///
    /// # Safety
    /// `fd` must be a dma-buf that stays open until the returned MR is dropped or destroyed.
    pub(crate) unsafe fn reg_dmabuf_mr(
        self: &Arc<Self>,
        offset: u64,
        len: usize,
        iova: u64,
        fd: c_int,
        access: u32,
    ) -> Result<Mr, VerbsError> {
        let access = c_int::try_from(access).unwrap_or(0);
        // SAFETY: live PD; the dma-buf stays open (caller's contract).
        let mr = unsafe {
            self.device
                .verbs
                .reg_dmabuf_mr(self.pd, offset, len, iova, fd, access)
        }?;
        Ok(Mr {
            mr,
            live: true,
            pd: self.clone(),
        })
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: MRs and QPs hold an `Arc<Pd>`, so none is left; not used again.
        if let Err(e) = unsafe { self.device.verbs.dealloc_pd(self.pd) } {
            self.device
                .faults
                .record(&format!("ibv_dealloc_pd on {}", self.device.name), &e);
            std::mem::forget(self.device.clone());
        }
    }
}

/// A memory region.
pub(crate) struct Mr {
    mr: NonNull<ffi::ibv_mr>,
    live: bool,
    pd: Arc<Pd>,
}

// SAFETY: verbs objects are thread-safe; keys are read-only after registration.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: the MR is live while `self` is; lkey is written once by ibv_reg_mr.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: as for `lkey`.
        unsafe { (*self.mr.as_ptr()).rkey }
    }

    /// Deregisters now, returning the error (the MR is then kept, with its PD, and recorded).
    pub(crate) fn destroy(mut self) -> Result<(), VerbsError> {
        self.live = false;
        // SAFETY: the MR is live and not used again (`live` is cleared, `self` is consumed).
        let r = unsafe { self.pd.device.verbs.dereg_mr(self.mr) };
        if r.is_err() {
            std::mem::forget(self.pd.clone());
        }
        r
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        if !self.live {
            return;
        }
        // SAFETY: the MR is live and not used again.
        if let Err(e) = unsafe { self.pd.device.verbs.dereg_mr(self.mr) } {
            self.pd
                .device
                .faults
                .record(&format!("ibv_dereg_mr on {}", self.pd.device.name), &e);
            std::mem::forget(self.pd.clone());
        }
    }
}

/// A completion channel.
pub(crate) struct CompChannel {
    ch: NonNull<ffi::ibv_comp_channel>,
    device: Arc<Device>,
}

// SAFETY: verbs objects are thread-safe.
unsafe impl Send for CompChannel {}
// SAFETY: as above.
unsafe impl Sync for CompChannel {}

impl CompChannel {
    pub(crate) fn create(device: &Arc<Device>) -> Result<Arc<Self>, RdmaError> {
        // SAFETY: live context.
        let ch = unsafe { device.verbs.create_comp_channel(device.ctx) }.map_err(|source| {
            RdmaError::Create {
                what: "completion channel",
                device: device.name.clone(),
                source,
            }
        })?;
        Ok(Arc::new(Self {
            ch,
            device: device.clone(),
        }))
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: CQs hold an `Arc<CompChannel>`, so none is attached; not used again.
        if let Err(e) = unsafe { self.device.verbs.destroy_comp_channel(self.ch) } {
            self.device.faults.record(
                &format!("ibv_destroy_comp_channel on {}", self.device.name),
                &e,
            );
            std::mem::forget(self.device.clone());
        }
    }
}

/// A completion queue attached to a completion channel.
pub(crate) struct Cq {
    cq: NonNull<ffi::ibv_cq>,
    channel: Arc<CompChannel>,
}

// SAFETY: verbs objects are thread-safe; polling happens from one thread at a time (the QP that
// owns the CQ is driven by one worker).
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Cq {
    pub(crate) fn create(channel: &Arc<CompChannel>, cqe: u32) -> Result<Arc<Self>, RdmaError> {
        let device = &channel.device;
        let cqe = c_int::try_from(cqe).unwrap_or(c_int::MAX);
        // SAFETY: live context and channel.
        let cq = unsafe {
            device
                .verbs
                .create_cq(device.ctx, cqe, std::ptr::null_mut(), Some(channel.ch), 0)
        }
        .map_err(|source| RdmaError::Create {
            what: "completion queue",
            device: device.name.clone(),
            source,
        })?;
        Ok(Arc::new(Self {
            cq,
            channel: channel.clone(),
        }))
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        let d = &self.channel.device;
        // SAFETY: QPs hold an `Arc<Cq>`, so none uses it; no event was requested or left
        // unacknowledged (the data path polls); not used again.
        if let Err(e) = unsafe { d.verbs.destroy_cq(self.cq) } {
            d.faults
                .record(&format!("ibv_destroy_cq on {}", d.name), &e);
            std::mem::forget(self.channel.clone());
        }
    }
}

/// A reliable-connected queue pair with its own CQ (send and receive).
pub(crate) struct RcQp {
    qp: NonNull<ffi::ibv_qp>,
    qpn: u32,
    cq: Arc<Cq>,
    pd: Arc<Pd>,
    /// The device port the QP is bound to (asked by [`QpVerbs::link_up`]).
    port: u8,
}

// SAFETY: verbs objects are thread-safe; one worker drives the QP at a time (`&self` methods
// only post and poll, which rdma-core serialises per queue).
unsafe impl Send for RcQp {}
// SAFETY: as above.
unsafe impl Sync for RcQp {}

impl RcQp {
    /// A QP in RESET with `depth` send work requests and one SGE each, to be bound to `port`.
    pub(crate) fn create(
        pd: &Arc<Pd>,
        cq: &Arc<Cq>,
        depth: u32,
        port: u8,
    ) -> Result<Self, RdmaError> {
        let mut attr: ffi::ibv_qp_init_attr = zeroed();
        attr.send_cq = cq.cq.as_ptr();
        attr.recv_cq = cq.cq.as_ptr();
        attr.qp_type = ffi::IBV_QPT_RC;
        attr.sq_sig_all = 0;
        attr.cap.max_send_wr = depth;
        attr.cap.max_recv_wr = 1;
        attr.cap.max_send_sge = 1;
        attr.cap.max_recv_sge = 1;
        let d = &pd.device;
        // SAFETY: live PD and CQ (held below for the QP's life).
        let qp =
            unsafe { d.verbs.create_qp(pd.pd, &mut attr) }.map_err(|source| RdmaError::Create {
                what: "queue pair",
                device: d.name.clone(),
                source,
            })?;
        // SAFETY: the QP was just created; qp_num is set by ibv_create_qp.
        let qpn = unsafe { (*qp.as_ptr()).qp_num };
        Ok(Self {
            qp,
            qpn,
            cq: cq.clone(),
            pd: pd.clone(),
            port,
        })
    }
}

fn verbs_io(e: VerbsError) -> io::Error {
    match e {
        VerbsError::Verb { source, .. } => source,
        other => io::Error::other(other.to_string()),
    }
}

impl QpVerbs for RcQp {
    fn qp_num(&self) -> u32 {
        self.qpn
    }

    fn modify(&self, t: &Transition) -> io::Result<()> {
        let mut a: ffi::ibv_qp_attr = zeroed();
        let mask = match *t {
            Transition::Init {
                port,
                pkey_index,
                access,
            } => {
                a.qp_state = ffi::IBV_QPS_INIT;
                a.port_num = port;
                a.pkey_index = pkey_index;
                a.qp_access_flags = access;
                ffi::IBV_QP_STATE
                    | ffi::IBV_QP_PKEY_INDEX
                    | ffi::IBV_QP_PORT
                    | ffi::IBV_QP_ACCESS_FLAGS
            }
            Transition::Rtr {
                port,
                path_mtu,
                dest_qpn,
                rq_psn,
                max_dest_rd_atomic,
                min_rnr_timer,
                dlid,
                global,
            } => {
                a.qp_state = ffi::IBV_QPS_RTR;
                a.path_mtu = path_mtu;
                a.dest_qp_num = dest_qpn;
                a.rq_psn = rq_psn;
                a.max_dest_rd_atomic = max_dest_rd_atomic;
                a.min_rnr_timer = min_rnr_timer;
                a.ah_attr.dlid = dlid;
                a.ah_attr.port_num = port;
                if let Some(g) = global {
                    a.ah_attr.is_global = 1;
                    a.ah_attr.grh.dgid.raw = g.dgid;
                    a.ah_attr.grh.sgid_index = g.sgid_index;
                    a.ah_attr.grh.hop_limit = g.hop_limit;
                    a.ah_attr.grh.traffic_class = g.traffic_class;
                }
                ffi::IBV_QP_STATE
                    | ffi::IBV_QP_AV
                    | ffi::IBV_QP_PATH_MTU
                    | ffi::IBV_QP_DEST_QPN
                    | ffi::IBV_QP_RQ_PSN
                    | ffi::IBV_QP_MAX_DEST_RD_ATOMIC
                    | ffi::IBV_QP_MIN_RNR_TIMER
            }
            Transition::Rts {
                sq_psn,
                timeout,
                retry_cnt,
                rnr_retry,
                max_rd_atomic,
            } => {
                a.qp_state = ffi::IBV_QPS_RTS;
                a.sq_psn = sq_psn;
                a.timeout = timeout;
                a.retry_cnt = retry_cnt;
                a.rnr_retry = rnr_retry;
                a.max_rd_atomic = max_rd_atomic;
                ffi::IBV_QP_STATE
                    | ffi::IBV_QP_SQ_PSN
                    | ffi::IBV_QP_TIMEOUT
                    | ffi::IBV_QP_RETRY_CNT
                    | ffi::IBV_QP_RNR_RETRY
                    | ffi::IBV_QP_MAX_QP_RD_ATOMIC
            }
            Transition::Error => {
                a.qp_state = ffi::IBV_QPS_ERR;
                ffi::IBV_QP_STATE
            }
        };
        let mask = c_int::try_from(mask).map_err(io::Error::other)?;
        // SAFETY: live QP; `a` is a fully initialised attribute struct for `mask`.
        unsafe { self.pd.device.verbs.modify_qp(self.qp, &mut a, mask) }.map_err(verbs_io)
    }

    fn post_send(&self, wrs: &[SendWr]) -> Result<(), PostError> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<ffi::ibv_sge> = wrs
            .iter()
            .map(|w| ffi::ibv_sge {
                addr: w.local_addr,
                length: w.len,
                lkey: w.lkey,
            })
            .collect();
        let mut chain: Vec<ffi::ibv_send_wr> = Vec::with_capacity(wrs.len());
        for (w, sge) in wrs.iter().zip(sges.iter_mut()) {
            let mut wr: ffi::ibv_send_wr = zeroed();
            wr.wr_id = w.wr_id;
            // A zero-length work request (a probe) names no memory: no SGE, since some
            // providers read an SGE of length 0 as 2 GiB.
            if w.len > 0 {
                wr.sg_list = sge;
                wr.num_sge = 1;
            }
            wr.opcode = match w.kind {
                WrKind::Write => ffi::IBV_WR_RDMA_WRITE,
                WrKind::Read => ffi::IBV_WR_RDMA_READ,
            };
            wr.send_flags = if w.signaled {
                ffi::IBV_SEND_SIGNALED
            } else {
                0
            };
            wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                remote_addr: w.remote_addr,
                rkey: w.rkey,
            };
            chain.push(wr);
        }
        let base = chain.as_mut_ptr();
        for k in 0..chain.len() - 1 {
            // SAFETY: `k + 1 < len`: both pointers are inside `chain`, which is not resized.
            chain[k].next = unsafe { base.add(k + 1) };
        }
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP; `chain` is a linked list of valid WRs whose SGEs point into `sges`,
        // both alive across the call; the local ranges are registered (lkeys) and owned by the
        // requests until they resolve.
        let rc = unsafe { inline::post_send(self.qp.as_ptr(), base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        let posted = if bad.is_null() {
            0
        } else {
            // SAFETY: `bad` points into `chain` (the provider returns the failing WR).
            usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(0)
        };
        Err(PostError { posted, errno: rc })
    }

    fn poll(&self, max: usize) -> Result<Vec<Completion>, i32> {
        let mut wcs: Vec<ffi::ibv_wc> = (0..max).map(|_| zeroed()).collect();
        let n = c_int::try_from(max).unwrap_or(c_int::MAX);
        // SAFETY: live CQ; `wcs` has room for `n` entries.
        let got = unsafe { inline::poll_cq(self.cq.cq.as_ptr(), n, wcs.as_mut_ptr()) };
        if got < 0 {
            return Err(-got);
        }
        let got = usize::try_from(got).unwrap_or(0).min(max);
        Ok(wcs[..got]
            .iter()
            .map(|w| Completion {
                wr_id: w.wr_id,
                status: w.status,
                vendor_err: w.vendor_err,
            })
            .collect())
    }

    fn link_up(&self) -> bool {
        self.pd
            .device
            .query_port(self.port)
            .map_or(true, |p| p.active)
    }
}

impl Drop for RcQp {
    fn drop(&mut self) {
        let d = &self.pd.device;
        // SAFETY: the QP is live and not used again.
        if let Err(e) = unsafe { d.verbs.destroy_qp(self.qp) } {
            d.faults
                .record(&format!("ibv_destroy_qp {} on {}", self.qpn, d.name), &e);
            std::mem::forget(self.cq.clone());
            std::mem::forget(self.pd.clone());
        }
    }
}

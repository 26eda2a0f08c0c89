//! Every wrapper against a real verbs device (hardware or soft-RoCE `rxe`).
//!
//! `#[ignore]`d: run with `FERRY_TEST_RDMA_DEVICE=<name> cargo test -p ferry-verbs-sys --test
//! hardware -- --ignored`. Fails when that variable is unset (with `FERRY_REQUIRE_RDMA=0` it prints
//! why and skips), and fails loudly when the named device is absent.

use std::ffi::c_void;
use std::os::raw::c_int;

use ferry_verbs_sys::ffi;
use ferry_verbs_sys::{Verbs, inline};

const DEVICE_ENV: &str = "FERRY_TEST_RDMA_DEVICE";

#[test]
#[ignore = "needs an RDMA device named by FERRY_TEST_RDMA_DEVICE"]
fn wrappers_round_trip_on_a_real_device() {
    let Some(name) = std::env::var_os(DEVICE_ENV) else {
        ferry_tests::require_unless_allowed(ferry_tests::RDMA, format!("{DEVICE_ENV} is not set"));
        return;
    };
    let name = name.to_string_lossy().into_owned();
    let verbs = Verbs::load().unwrap_or_else(|e| panic!("libibverbs: {e}"));
    let devices = verbs.devices().unwrap_or_else(|e| panic!("devices: {e}"));
    assert!(
        devices.iter().any(|d| d.name == name),
        "{DEVICE_ENV}={name} but the device list is {devices:?}"
    );
    let ctx = verbs.open_device(&name).unwrap_or_else(|e| panic!("{e}"));
    // SAFETY: every handle below is created on `ctx` by this library, used while live, and
    // destroyed in reverse order before the context is closed.
    unsafe {
        let dev = verbs.query_device(ctx).unwrap_or_else(|e| panic!("{e}"));
        assert!(dev.phys_port_cnt >= 1);
        let port = verbs.query_port(ctx, 1).unwrap_or_else(|e| panic!("{e}"));
        assert!(port.gid_tbl_len > 0, "port 1 has no GID table");
        let gid = verbs.query_gid(ctx, 1, 0).unwrap_or_else(|e| panic!("{e}"));
        eprintln!("port 1 state {} gid[0] {:02x?}", port.state, gid.raw);
        let gid_type = verbs
            .query_gid_type(ctx, 1, 0)
            .unwrap_or_else(|e| panic!("{e}"));
        eprintln!("gid[0] type {gid_type:?}");

        let pd = verbs.alloc_pd(ctx).unwrap_or_else(|e| panic!("{e}"));
        let mut buf = vec![0u8; 1 << 16];
        let access = (ffi::IBV_ACCESS_LOCAL_WRITE
            | ffi::IBV_ACCESS_REMOTE_WRITE
            | ffi::IBV_ACCESS_REMOTE_READ) as c_int;
        let mr = verbs
            .reg_mr(pd, buf.as_mut_ptr().cast::<c_void>(), buf.len(), access)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((*mr.as_ptr()).length, buf.len());

        let channel = verbs
            .create_comp_channel(ctx)
            .unwrap_or_else(|e| panic!("{e}"));
        let cq = verbs
            .create_cq(ctx, 16, std::ptr::null_mut(), Some(channel), 0)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(inline::req_notify_cq(cq.as_ptr(), 0), 0);
        let mut wc: ffi::ibv_wc = std::mem::zeroed();
        assert_eq!(
            inline::poll_cq(cq.as_ptr(), 1, &mut wc),
            0,
            "fresh CQ is empty"
        );

        let mut init: ffi::ibv_qp_init_attr = std::mem::zeroed();
        init.send_cq = cq.as_ptr();
        init.recv_cq = cq.as_ptr();
        init.qp_type = ffi::IBV_QPT_RC;
        init.cap.max_send_wr = 4;
        init.cap.max_recv_wr = 4;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        let qp = verbs
            .create_qp(pd, &mut init)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut attr: ffi::ibv_qp_attr = std::mem::zeroed();
        attr.qp_state = ffi::IBV_QPS_INIT;
        attr.port_num = 1;
        attr.qp_access_flags = access as u32;
        let mask = (ffi::IBV_QP_STATE
            | ffi::IBV_QP_PKEY_INDEX
            | ffi::IBV_QP_PORT
            | ffi::IBV_QP_ACCESS_FLAGS) as c_int;
        verbs
            .modify_qp(qp, &mut attr, mask)
            .unwrap_or_else(|e| panic!("{e}"));
        let (now, _) = verbs
            .query_qp(qp, ffi::IBV_QP_STATE as c_int)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(now.qp_state, ffi::IBV_QPS_INIT);

        verbs.destroy_qp(qp).unwrap_or_else(|e| panic!("{e}"));
        verbs.destroy_cq(cq).unwrap_or_else(|e| panic!("{e}"));
        verbs
            .destroy_comp_channel(channel)
            .unwrap_or_else(|e| panic!("{e}"));
        verbs.dereg_mr(mr).unwrap_or_else(|e| panic!("{e}"));
        verbs.dealloc_pd(pd).unwrap_or_else(|e| panic!("{e}"));
        verbs.close_device(ctx).unwrap_or_else(|e| panic!("{e}"));
    }
}

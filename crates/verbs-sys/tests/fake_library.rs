//! The loader against small shared objects this test builds with `cc`: one lacking a required
//! export, one complete fake whose device list the loader must enumerate once and free once,
//! and a path that does not exist.

use std::path::{Path, PathBuf};
use std::process::Command;

use ferry_verbs_sys::{NodeType, TransportType, Verbs, VerbsError};

/// The fake device list: two devices laid out like rdma-core's `struct ibv_device`.
const FAKE_DEVICES_C: &str = r#"
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
struct ibv_device { void *ops[2]; int node_type; int transport_type; char name[64];
                    char dev_name[64]; char dev_path[256]; char ibdev_path[256]; };
int fake_list_calls = 0;
int fake_free_calls = 0;
static struct ibv_device devs[2];
struct ibv_device **ibv_get_device_list(int *n) {
    fake_list_calls++;
    struct ibv_device **l = calloc(3, sizeof(*l));
    memset(devs, 0, sizeof(devs));
    strcpy(devs[0].name, "fake_mlx5_0"); devs[0].node_type = 1; devs[0].transport_type = 0;
    strcpy(devs[1].name, "fake_iw0"); devs[1].node_type = 4; devs[1].transport_type = 1;
    l[0] = &devs[0]; l[1] = &devs[1];
    if (n) *n = 2;
    return l;
}
void ibv_free_device_list(struct ibv_device **l) { fake_free_calls++; free(l); }
const char *ibv_get_device_name(struct ibv_device *d) { return d->name; }
uint64_t ibv_get_device_guid(struct ibv_device *d) {
    /* big-endian 0x0011223344556677 on a little-endian host */
    return d == &devs[0] ? 0x7766554433221100ull : 0;
}
"#;

fn cc_available() -> bool {
    Command::new("cc")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Builds `lib<name>.so` in `dir` from the fake device list plus stubs for `stubs`.
fn build_fake(dir: &Path, name: &str, stubs: &[&str]) -> PathBuf {
    let mut src = FAKE_DEVICES_C.to_owned();
    for s in stubs {
        src.push_str(&format!("void *{s}(void) {{ return 0; }}\n"));
    }
    let c = dir.join(format!("{name}.c"));
    let so = dir.join(format!("lib{name}.so"));
    std::fs::write(&c, src).expect("write C source");
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&c)
        .output()
        .expect("run cc");
    assert!(
        out.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    so
}

/// Required exports other than the four the fake device list defines.
fn other_required() -> Vec<&'static str> {
    let defined = [
        "ibv_get_device_list",
        "ibv_free_device_list",
        "ibv_get_device_name",
        "ibv_get_device_guid",
    ];
    Verbs::REQUIRED_EXPORTS
        .iter()
        .copied()
        .filter(|s| !defined.contains(s))
        .collect()
}

#[test]
fn a_path_that_does_not_exist_is_unavailable_with_the_loaders_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("libibverbs.so.1");
    let err = Verbs::load_from(&path).expect_err("loading a missing file must fail");
    let library = path.display().to_string();
    match &err {
        VerbsError::Unavailable { library: l, reason } => {
            assert_eq!(l, &library);
            assert!(
                reason.contains("No such file or directory"),
                "reason: {reason}"
            );
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let text = err.to_string();
    assert!(text.starts_with(&format!("{library}: ")), "{text}");
    assert!(err.is_load_failure());
}

#[test]
fn a_library_lacking_a_required_export_is_missing_symbol_naming_it() {
    if !cc_available() {
        ferry_tests::require_or_skip(ferry_tests::TOOLS, "no `cc` to build the fake library");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut stubs = other_required();
    stubs.retain(|s| *s != "ibv_create_qp");
    let so = build_fake(dir.path(), "partialverbs", &stubs);
    let err = Verbs::load_from(&so).expect_err("a required export is missing");
    let library = so.display().to_string();
    match &err {
        VerbsError::MissingSymbol {
            library: l,
            symbol,
            reason,
        } => {
            assert_eq!(l, &library);
            assert_eq!(*symbol, "ibv_create_qp");
            assert!(
                reason.contains("ibv_create_qp"),
                "loader's reason: {reason}"
            );
        }
        other => panic!("expected MissingSymbol, got {other:?}"),
    }
    let text = err.to_string();
    assert!(text.starts_with(&format!("{library}: ")), "{text}");
    assert!(text.contains("`ibv_create_qp`"), "{text}");
}

#[test]
fn a_complete_library_enumerates_once_frees_once_and_reports_absent_options() {
    if !cc_available() {
        ferry_tests::require_or_skip(ferry_tests::TOOLS, "no `cc` to build the fake library");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let so = build_fake(dir.path(), "fakeverbs", &other_required());
    let verbs = match Verbs::load_from(&so) {
        Ok(v) => v,
        Err(e) => panic!("complete fake failed to load: {e}"),
    };
    let caps = verbs.capabilities();
    assert!(!caps.reg_dmabuf_mr && !caps.query_gid_ex && !caps.query_gid_table);
    let devices = verbs.devices().expect("fake enumeration");
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[0].name, "fake_mlx5_0");
    assert_eq!(devices[0].guid, 0x0011_2233_4455_6677);
    assert_eq!(devices[0].node_type, NodeType::Ca);
    assert_eq!(devices[0].transport_type, TransportType::Ib);
    assert_eq!(devices[1].name, "fake_iw0");
    assert_eq!(devices[1].node_type, NodeType::Rnic);
    assert_eq!(devices[1].transport_type, TransportType::Iwarp);

    // The fake counts its calls: one list, one free.
    // SAFETY: the fake library is a plain C object with no initialisers.
    let lib = unsafe { libloading::Library::new(&so) }.expect("reopen fake");
    // SAFETY: these exported ints are the fake's counters.
    let (lists, frees) = unsafe {
        let l = lib.get::<*const i32>(b"fake_list_calls").expect("counter");
        let f = lib.get::<*const i32>(b"fake_free_calls").expect("counter");
        (**l, **f)
    };
    assert_eq!(
        (lists, frees),
        (1, 1),
        "one ibv_get_device_list, one ibv_free_device_list"
    );

    // Opening a device the fake does not have is a typed error naming it; the list is freed.
    match verbs.open_device("nope0") {
        Err(VerbsError::Verb { verb, device, .. }) => {
            assert_eq!(verb, "ibv_open_device");
            assert_eq!(device, "nope0");
        }
        other => panic!("expected a Verb error, got {other:?}"),
    }
    // SAFETY: as above.
    let (lists, frees) = unsafe {
        let l = lib.get::<*const i32>(b"fake_list_calls").expect("counter");
        let f = lib.get::<*const i32>(b"fake_free_calls").expect("counter");
        (**l, **f)
    };
    assert_eq!((lists, frees), (2, 2));
}

//! `ferry doctor` as a user runs it: the binary, its exit codes, its table and its JSON.

use std::process::Command;

fn ferry() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
}

fn doctor_json(envs: &[(&str, &str)]) -> serde_json::Value {
    let mut cmd = ferry();
    cmd.args(["doctor", "--json"]);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run ferry doctor");
    assert!(out.status.success(), "doctor must exit 0: {out:?}");
    serde_json::from_slice(&out.stdout).expect("doctor --json prints one JSON object")
}

fn row<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    v["checks"]
        .as_array()
        .expect("checks array")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no `{name}` row in {v}"))
}

#[test]
fn missing_libibverbs_is_reported_as_unavailable_with_the_loaders_reason() {
    let lib = "/nonexistent/ferry-test/libibverbs.so.1";
    let v = doctor_json(&[("FERRY_IBVERBS_LIB", lib)]);
    let l = row(&v, "libibverbs");
    assert_eq!(l["status"], "unavailable", "{l}");
    let detail = l["detail"].as_str().unwrap();
    assert!(
        detail.starts_with(&format!("{lib}: ")),
        "library named first: {detail}"
    );
    assert!(
        detail.contains("No such file"),
        "loader's reason kept: {detail}"
    );
    assert!(
        !detail.contains("DlOpen"),
        "no raw libloading error: {detail}"
    );
    assert!(!l["hint"].as_str().unwrap().is_empty());
    let d = row(&v, "rdma-devices");
    assert_eq!(d["status"], "unavailable", "{d}");
    let detail = d["detail"].as_str().unwrap();
    assert!(
        detail.starts_with(&format!("no RDMA devices found: {lib}")),
        "the actionable error, not the loader's message alone: {detail}"
    );
    // Every other row still ran.
    for name in [
        "build",
        "topology",
        "io_uring",
        "cuda-driver",
        "cufile",
        "nvidia-peermem",
        "dma-buf",
    ] {
        let r = row(&v, name);
        for key in ["status", "detail", "hint"] {
            assert!(r[key].is_string(), "{name}.{key} in {r}");
        }
    }
    assert_eq!(row(&v, "dma-buf")["status"], "unavailable");
}

#[test]
fn real_library_without_devices_says_absent() {
    let v = doctor_json(&[]);
    let l = row(&v, "libibverbs");
    if l["status"] != "ok" {
        ferry_tests::require_or_skip(
            ferry_tests::IBVERBS,
            format!("libibverbs.so.1 does not load here: {}", l["detail"]),
        );
        return;
    }
    assert!(
        l["detail"].as_str().unwrap().contains("libibverbs.so"),
        "{l}"
    );
    let d = row(&v, "rdma-devices");
    match d["status"].as_str() {
        Some("absent") => {
            assert_eq!(d["detail"], "ibv_get_device_list returned no devices");
        }
        Some("ok") => assert!(!d["detail"].as_str().unwrap().is_empty()),
        other => panic!("library loads but devices row is {other:?}: {d}"),
    }
}

#[test]
fn table_lists_every_row_and_exits_zero() {
    let out = ferry().arg("doctor").output().expect("run ferry doctor");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for name in [
        "build",
        "libibverbs",
        "rdma-devices",
        "topology",
        "io_uring",
        "cuda-driver",
        "cufile",
        "nvidia-peermem",
        "dma-buf",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(name)),
            "no {name} row in:\n{text}"
        );
    }
}

#[test]
fn bad_arguments_exit_2() {
    let out = ferry()
        .args(["doctor", "--no-such-flag"])
        .output()
        .expect("run ferry");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let out = ferry().arg("no-such-command").output().expect("run ferry");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

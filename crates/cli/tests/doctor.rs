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

#[test]
fn version_names_the_commit_the_features_and_the_protocol() {
    let out = ferry()
        .arg("--version")
        .output()
        .expect("run ferry --version");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    let rest = text
        .trim()
        .strip_prefix(&format!("ferry {} (commit ", env!("CARGO_PKG_VERSION")))
        .unwrap_or_else(|| panic!("version first: {text}"));
    let (commit, rest) = rest.split_once(';').expect("commit, then features");
    assert!(
        commit == "unknown"
            || (commit.len() == 12 && commit.chars().all(|c| c.is_ascii_hexdigit())),
        "a short commit or `unknown`: {commit:?}"
    );
    assert!(rest.contains(" features: "), "{text}");
    let v = ferry::SUPPORTED_VERSIONS;
    assert!(
        rest.contains(&format!("wire protocol {}..={}", v.min, v.max)),
        "{text}"
    );
    // `-V` says the same.
    let short = ferry().arg("-V").output().expect("run ferry -V");
    assert_eq!(String::from_utf8(short.stdout).unwrap(), text);
}

#[test]
fn doctor_opens_with_a_verdict_and_the_version() {
    let out = ferry().arg("doctor").output().expect("run ferry doctor");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    let first = lines.next().unwrap_or_default();
    assert!(first.starts_with("usable here: tcp"), "{first}");
    assert!(first.contains("try `ferry bench"), "{first}");
    let second = lines.next().unwrap_or_default();
    assert!(
        second.starts_with(&format!("ferry {} (commit ", env!("CARGO_PKG_VERSION"))),
        "{second}"
    );
    assert!(second.contains("wire protocol "), "{second}");

    let v = doctor_json(&[]);
    assert!(
        v["verdict"]
            .as_str()
            .unwrap()
            .starts_with("usable here: tcp")
    );
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
    assert!(v["commit"].is_string());
    assert!(v["features"].is_array());
    let p = ferry::SUPPORTED_VERSIONS;
    assert_eq!(v["protocol_versions"]["min"], p.min);
    assert_eq!(v["protocol_versions"]["max"], p.max);
    let s = &v["summary"];
    assert_eq!(s["transports"][0], "tcp", "{s}");
    for key in ["rdma_devices", "gpus", "uring_opcodes"] {
        assert!(s[key].is_array(), "{key} in {s}");
    }
    // The structured fields agree with the rows.
    let uring_ok = row(&v, "io_uring")["status"] == "ok";
    let has_uring = s["transports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t == "uring");
    assert_eq!(uring_ok, has_uring, "{s}");
    assert_eq!(
        uring_ok,
        !s["uring_opcodes"].as_array().unwrap().is_empty(),
        "{s}"
    );
}

#[test]
fn require_exits_1_naming_what_is_missing() {
    let out = ferry()
        .args(["doctor", "--require", "tcp"])
        .output()
        .expect("run ferry doctor");
    assert!(out.status.success(), "{out:?}");
    let v = doctor_json(&[]);
    let has = |t: &str| {
        v["summary"]["transports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x == t)
    };
    let gpus = !v["summary"]["gpus"].as_array().unwrap().is_empty();
    let missing: Vec<&str> = [
        ("uring", has("uring")),
        ("rdma", has("rdma")),
        ("gpu", gpus),
    ]
    .into_iter()
    .filter(|(_, present)| !present)
    .map(|(n, _)| n)
    .collect();
    // `io_uring` is `uring`, and spaces after the commas are fine.
    let out = ferry()
        .args(["doctor", "--require", "tcp, io_uring, rdma,gpu"])
        .output()
        .expect("run ferry doctor");
    if missing.is_empty() {
        assert!(out.status.success(), "{out:?}");
    } else {
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(
            err.contains(&format!("not usable here: {}", missing.join(", "))),
            "{err}"
        );
        // The report is printed all the same.
        assert!(
            String::from_utf8(out.stdout)
                .unwrap()
                .starts_with("usable here: ")
        );
    }
    let out = ferry()
        .args(["doctor", "--require", "warp-drive"])
        .output()
        .expect("run ferry doctor");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

#[test]
fn publish_has_no_version_flag_of_its_own() {
    // `--version` is ferry's; the broadcast's is `--weights-version`.
    let out = ferry()
        .args(["publish", "x", "--name", "n", "--version", "3"])
        .output()
        .expect("run ferry publish");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let help = ferry()
        .args(["publish", "--help"])
        .output()
        .expect("run ferry publish --help");
    assert!(
        String::from_utf8(help.stdout)
            .unwrap()
            .contains("--weights-version <N>")
    );
}

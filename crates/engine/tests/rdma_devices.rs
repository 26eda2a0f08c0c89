//! RdmaDevices through the real loader: a library path that does not exist, a library lacking a
//! required export (built with `cc`), and the system's libibverbs when installed.

use std::path::PathBuf;
use std::process::Command;

use ferry::rdma_devices::{
    RdmaDevices, RdmaDevicesError, VerbsEnumerator, enumerate_verbs_devices,
};

/// A scratch directory unique to this test process, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("ferry-discovery-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_missing_library_gives_the_actionable_error_not_the_loaders() {
    let scratch = Scratch::new("missing");
    let path = scratch.0.join("libibverbs.so.1");
    let library = path.display().to_string();
    let d = RdmaDevices::run(&VerbsEnumerator::with_library(&path));
    assert!(d.devices().is_empty(), "a missing library means no devices");
    let loader = d.unavailable().expect("the loader's reason is kept");
    assert!(loader.starts_with(&format!("{library}: ")), "{loader}");
    assert!(loader.contains("No such file or directory"), "{loader}");
    let err = d.require().expect_err("RDMA is required");
    assert!(
        matches!(err, RdmaDevicesError::LoadLibrary { .. }),
        "{err:?}"
    );
    let reason = loader
        .strip_prefix(&format!("{library}: "))
        .expect("library prefix");
    assert_eq!(
        err.to_string(),
        format!("no RDMA devices found: {library} could not be loaded: {reason}")
    );
    assert_ne!(err.to_string(), loader);
}

#[test]
fn a_library_lacking_a_required_export_names_it_in_the_actionable_error() {
    if !Command::new("cc")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        ferry_tests::require_or_skip(ferry_tests::TOOLS, "no `cc` to build the fake library");
        return;
    }
    let scratch = Scratch::new("partial");
    let c = scratch.0.join("partial.c");
    let so = scratch.0.join("libpartial.so");
    std::fs::write(
        &c,
        "void *ibv_get_device_list(int *n) { if (n) *n = 0; return 0; }\n",
    )
    .expect("write C source");
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&c)
        .output()
        .expect("run cc");
    assert!(
        out.status.success(),
        "cc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let library = so.display().to_string();
    let d = RdmaDevices::run(&VerbsEnumerator::with_library(&so));
    assert!(d.devices().is_empty());
    let text = d.require().expect_err("RDMA is required").to_string();
    let prefix = format!(
        "no RDMA devices found: {library} could not be loaded: \
         missing required export `ibv_free_device_list`: "
    );
    assert!(text.starts_with(&prefix), "{text}");
}

#[test]
fn the_real_library_with_no_devices_is_the_empty_list_error() {
    let d = RdmaDevices::run(&VerbsEnumerator::with_library("libibverbs.so.1"));
    if let Some(reason) = d.unavailable() {
        if reason.starts_with("libibverbs.so.1: ") {
            ferry_tests::require_or_skip(
                ferry_tests::IBVERBS,
                format!("libibverbs.so.1 is not installed here ({reason})"),
            );
            return;
        }
        panic!("libibverbs.so.1 loaded but enumeration failed: {reason}");
    }
    let listing = enumerate_verbs_devices();
    if d.devices().is_empty() {
        let err = d.require().expect_err("no devices");
        assert_eq!(
            err.to_string(),
            "no RDMA devices found: the device list is empty"
        );
        assert!(listing.devices.is_empty());
    } else {
        eprintln!("this machine has RDMA devices: {:?}", d.devices());
        assert_eq!(d.require().map(<[_]>::len).ok(), Some(d.devices().len()));
    }
    if std::env::var_os("FERRY_IBVERBS_LIB").is_none() {
        assert_eq!(listing.unavailable, None);
        assert_eq!(listing.devices, d.devices());
    }
}

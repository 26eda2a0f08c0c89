//! Against the system's real libibverbs (Debian's `libibverbs1`), when it is installed.

use ferry_verbs_sys::{IBVERBS_LIBRARY, Verbs, VerbsError};

#[test]
fn real_library_loads_and_enumerates_owned_devices() {
    let verbs = match Verbs::load_from(IBVERBS_LIBRARY) {
        Ok(v) => v,
        Err(e @ VerbsError::Unavailable { .. }) => {
            ferry_tests::require_or_skip(
                ferry_tests::IBVERBS,
                format!("{IBVERBS_LIBRARY} is not installed here ({e})"),
            );
            return;
        }
        Err(e) => panic!("{IBVERBS_LIBRARY} is installed but unusable: {e}"),
    };
    assert_eq!(verbs.library(), IBVERBS_LIBRARY);
    let caps = verbs.capabilities();
    eprintln!("capabilities: {caps:?}");
    let devices = match verbs.devices() {
        Ok(d) => d,
        Err(e) => panic!("enumeration failed: {e}"),
    };
    // Cross-check against the kernel's verbs devices: uverbs nodes exist iff devices do.
    let uverbs = std::fs::read_dir("/sys/class/infiniband_verbs")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with("uverbs"))
                .count()
        })
        .unwrap_or(0);
    eprintln!(
        "{} devices, {uverbs} uverbs nodes: {devices:?}",
        devices.len()
    );
    if uverbs == 0 {
        assert!(
            devices.is_empty(),
            "devices without kernel uverbs nodes: {devices:?}"
        );
    } else {
        assert!(
            !devices.is_empty(),
            "kernel has {uverbs} uverbs nodes but no devices listed"
        );
        for d in &devices {
            assert!(!d.name.is_empty());
        }
    }
    // A second enumeration gives the same answer (the list was freed and re-read cleanly).
    match verbs.devices() {
        Ok(again) => assert_eq!(again, devices),
        Err(e) => panic!("second enumeration failed: {e}"),
    }
}

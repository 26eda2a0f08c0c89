//! `FERRY_IBVERBS_LIB` overrides the library `Verbs::load` opens, and the result is cached.
//! (Its own test binary: the cache is process-wide and the environment is set before first use.)

use ferry_verbs_sys::{LIBRARY_ENV, Verbs, VerbsError};

#[test]
fn env_override_is_used_and_the_failure_is_cached() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("no-such-libibverbs.so");
    // SAFETY: this binary has a single test and no other thread reads the environment.
    unsafe { std::env::set_var(LIBRARY_ENV, &path) };
    let library = path.display().to_string();
    for _ in 0..2 {
        match Verbs::load() {
            Err(VerbsError::Unavailable { library: l, reason }) => {
                assert_eq!(l, library);
                assert!(!reason.is_empty());
            }
            other => panic!("expected Unavailable for {library}, got {other:?}"),
        }
    }
    // Cached: creating the file now does not change the answer.
    std::fs::write(&path, b"not an ELF").expect("write");
    match Verbs::load() {
        Err(VerbsError::Unavailable { reason, .. }) => {
            assert!(
                reason.contains("No such file"),
                "cached reason changed: {reason}"
            )
        }
        other => panic!("expected the cached Unavailable, got {other:?}"),
    }
}

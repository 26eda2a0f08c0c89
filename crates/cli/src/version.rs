//! What this binary is: its version, the git commit it was built from (`build.rs`), the cargo
//! features it has on, and the wire protocol versions it speaks.

use std::sync::LazyLock;

/// The crate version.
pub(crate) const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The short git commit, or `unknown` when built outside a repository.
pub(crate) const COMMIT: &str = env!("FERRY_GIT_COMMIT");

/// The enabled cargo features: the engine's (`uring`, `cuda`, `rdma`) and this crate's (`etcd`).
pub(crate) fn features() -> Vec<&'static str> {
    let mut on = ferry::capabilities::compiled_features();
    if cfg!(feature = "etcd") {
        on.push("etcd");
    }
    on
}

/// The wire protocol versions spoken, as `1..=3`.
pub(crate) fn protocol() -> String {
    let v = ferry::SUPPORTED_VERSIONS;
    format!("{}..={}", v.min, v.max)
}

/// `ferry --version`'s text after the program name.
pub(crate) static LONG: LazyLock<String> = LazyLock::new(|| {
    let features = features();
    format!(
        "{VERSION} (commit {COMMIT}; features: {}; wire protocol {})",
        if features.is_empty() {
            "none".to_owned()
        } else {
            features.join(", ")
        },
        protocol()
    )
});

//! What the broadcast crate's integration tests share: their log setup and a loopback engine.

#![allow(dead_code)] // each test binary uses its own part of this

use ferry::{DataPlane, TransferEngine};

/// Test logs, filtered by `RUST_LOG` (once per binary).
pub(crate) fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// An engine on the TCP data plane, listening on a free loopback port.
pub(crate) fn engine() -> TransferEngine {
    TransferEngine::builder()
        .data_plane(DataPlane::Tcp)
        .listen("127.0.0.1:0".parse().expect("a loopback address"))
        .build()
        .expect("a loopback engine")
}

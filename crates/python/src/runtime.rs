//! The process's tokio runtime, which every engine of the module shares: listeners, handshakes
//! and the tasks that watch requests run on it. Made on first use; it lives until the process
//! exits. A process that forks after making it must not use Ferry in the child (threads do not
//! survive `fork`): start worker processes with the `spawn` method.

use std::sync::OnceLock;

use pyo3::prelude::*;
use tokio::runtime::Runtime;

use crate::errors::{Kind, err};

static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();

/// The shared runtime, or `Unavailable` when it could not be started.
pub(crate) fn get(py: Python<'_>) -> PyResult<&'static Runtime> {
    let rt = RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .thread_name("ferry-py")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    });
    rt.as_ref().map_err(|reason| {
        err(
            py,
            Kind::Unavailable,
            format!("tokio runtime unavailable: {reason}"),
        )
    })
}

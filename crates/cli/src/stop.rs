//! How a command is stopped: SIGINT (Ctrl-C) or SIGTERM. A command that is stopped prints what
//! it did (as JSON under `--json`) and returns [`Stopped`], which `main` turns into the shell's
//! exit status for that signal: 130 for SIGINT, 143 for SIGTERM (128 + the signal's number).

use anyhow::{Context, Result};
use tokio::signal::unix::{SignalKind, signal};

/// The signal that stopped a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Signal {
    /// SIGINT: Ctrl-C.
    Int,
    /// SIGTERM: `kill`, a service manager, a container runtime.
    Term,
}

impl Signal {
    /// `SIGINT` or `SIGTERM`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Signal::Int => "SIGINT",
            Signal::Term => "SIGTERM",
        }
    }

    /// 128 + the signal's number, as a shell reports a process the signal ended.
    pub(crate) fn exit_code(self) -> u8 {
        match self {
            Signal::Int => 130,
            Signal::Term => 143,
        }
    }
}

/// The error a stopped command returns once it printed what it did: `main` exits with the
/// signal's status and prints nothing more.
#[derive(Debug, thiserror::Error)]
#[error("stopped by {}", .0.name())]
pub(crate) struct Stopped(pub(crate) Signal);

/// Listens for SIGINT and SIGTERM from now on (call it before the work starts, inside the
/// runtime): the returned future resolves with the first that arrives.
pub(crate) fn listen() -> Result<impl std::future::Future<Output = Signal>> {
    let mut int = signal(SignalKind::interrupt()).context("listening for SIGINT")?;
    let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
    Ok(async move {
        tokio::select! {
            _ = int.recv() => Signal::Int,
            _ = term.recv() => Signal::Term,
        }
    })
}

//! What the server's threads share: the switch that stops them, the connections a shutdown
//! reaches, the wake-ups of the rings, and the context every ring runs with.

use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use crate::config::UringConfig;
use crate::ring::IoStats;
use crate::ring::inbox::EventFd;

#[derive(Debug, Default)]
pub(super) struct Live {
    pub(super) stopped: AtomicBool,
    pub(super) conns: Mutex<HashMap<u64, Arc<TcpStream>>>,
    pub(super) next: AtomicU64,
    /// The eventfds that wake the server's rings, so that they see `stopped`.
    pub(super) ring_wakes: Mutex<Vec<Arc<EventFd>>>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Live {
    /// Shuts down every connection and wakes every ring, so that each sees `stopped`.
    pub(super) fn shutdown_all(&self) {
        let conns = lock(&self.conns);
        for c in conns.values() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        drop(conns);
        for w in lock(&self.ring_wakes).iter() {
            w.wake_now();
        }
    }
}

/// What every ring of the server runs with.
pub(super) struct Ctx {
    pub(super) config: UringConfig,
    pub(super) stats: Arc<IoStats>,
    pub(super) live: Arc<Live>,
}

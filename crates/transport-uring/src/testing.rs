//! What the crate's unit tests share: a table with nothing published, a responder that
//! accepts every hello (or runs a hook first), and a test run in a process of its own.

use std::net::SocketAddr;
use std::sync::Arc;

use ferry_core::wire::{Hello, Reject, SUPPORTED_VERSIONS};
use ferry_core::{Epoch, HandshakeResponder, PeerId, SegmentDesc, SegmentLease, SegmentTable};

/// A segment table with nothing in it.
#[derive(Debug, Default)]
pub(crate) struct NoSegments;

impl SegmentTable for NoSegments {
    fn resolve(&self, _token: ferry_core::SegmentToken) -> Option<SegmentLease> {
        None
    }

    fn published(&self) -> Vec<SegmentDesc> {
        Vec::new()
    }
}

/// A responder that runs `hook` on each hello, then accepts it (no transports offered).
pub(crate) struct Responder {
    pub(crate) id: PeerId,
    pub(crate) epoch: Epoch,
    pub(crate) hook: Box<dyn Fn() + Send + Sync>,
}

impl std::fmt::Debug for Responder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Responder").field("id", &self.id).finish()
    }
}

impl Responder {
    pub(crate) fn new(hook: impl Fn() + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(Self {
            id: PeerId::random(),
            epoch: Epoch::fresh(),
            hook: Box::new(hook),
        })
    }
}

impl HandshakeResponder for Responder {
    fn peer_id(&self) -> PeerId {
        self.id
    }

    fn epoch(&self) -> Epoch {
        self.epoch
    }

    fn respond(
        &self,
        _hello: &Hello,
        _from: SocketAddr,
        _peer: Option<&str>,
    ) -> Result<Hello, Reject> {
        (self.hook)();
        Ok(Hello {
            versions: SUPPORTED_VERSIONS,
            peer_id: self.id,
            epoch: self.epoch,
            transports: Vec::new(),
            segments: Vec::new(),
        })
    }
}

/// A hello from a fresh peer.
pub(crate) fn hello() -> Hello {
    Hello {
        versions: SUPPORTED_VERSIONS,
        peer_id: PeerId::random(),
        epoch: Epoch::fresh(),
        transports: Vec::new(),
        segments: Vec::new(),
    }
}

/// Runs the ignored unit test `name` (its full path, e.g. `server::tests::x`) alone in a child
/// process of this test binary, requires that it passed, and returns its stdout and stderr.
/// For a test that must own its process: its descriptors, or its first panic hook.
pub(crate) fn in_a_process_of_its_own(name: &str) -> (String, String) {
    let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", name])
        .args(["--ignored", "--nocapture", "--test-threads=1"])
        .output()
        .expect("the test binary runs");
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{said}{err}");
    assert!(said.contains("1 passed"), "{said}");
    (said, err)
}

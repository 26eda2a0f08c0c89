//! The serving side: one listener thread for control connections (handshake) and data streams;
//! every data stream is served by one of a fixed set of rings (`rings.rs`). Every request is
//! checked for token, access and bounds before any byte of a segment (memory or file) is
//! touched.

mod handshakes;
mod rings;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ferry_core::stream::ServerStream;
use ferry_core::wire::StreamAttach;
use ferry_core::{Error, FileSource, HandshakeResponder, MemoryRegion, SegmentTable};
use ferry_file::{DIRECT_ALIGN, FileSegment};
use ferry_net::{HandshakeGate, HandshakeStats};
use tracing::debug;

use crate::UringConfig;
use crate::file_ring::FileRing;
use crate::ring::IoStats;

/// A bound listener, not serving yet.
#[derive(Debug)]
pub struct UringServer {
    listener: TcpListener,
    addr: SocketAddr,
}

#[derive(Debug, Default)]
pub(crate) struct Live {
    pub(crate) stopped: AtomicBool,
    pub(crate) conns: Mutex<HashMap<u64, Arc<TcpStream>>>,
    pub(crate) next: AtomicU64,
    /// The eventfds that wake the server's rings, so that they see `stopped`.
    pub(crate) ring_wakes: Mutex<Vec<Arc<std::os::fd::OwnedFd>>>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Live {
    fn shutdown_all(&self) {
        let conns = lock(&self.conns);
        for c in conns.values() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        drop(conns);
        for w in lock(&self.ring_wakes).iter() {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a local to an eventfd the ring set keeps open.
            unsafe { libc::write(w.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }
}

/// A running server; dropping it (or [`UringServerHandle::shutdown`]) stops the listener and
/// every connection it accepted.
#[derive(Debug)]
pub struct UringServerHandle {
    addr: SocketAddr,
    live: Arc<Live>,
    /// The listener, shared with the accept thread, so that the shutdown below reaches this
    /// socket and no other, whenever that thread ended; taken by the first shutdown (the
    /// descriptor closes once the accept thread let go of it too).
    listener: Mutex<Option<Arc<TcpListener>>>,
    stats: Arc<IoStats>,
    gate: Arc<HandshakeGate>,
    rings: usize,
}

impl UringServerHandle {
    /// How many rings serve its data streams ([`UringConfig::server_rings`]).
    pub fn rings(&self) -> usize {
        self.rings
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The I/O counters of the server's rings.
    pub fn stats(&self) -> &IoStats {
        &self.stats
    }

    /// Connections in their handshake now, and those closed past the cap or the deadline.
    pub fn handshakes(&self) -> HandshakeStats {
        self.gate.stats()
    }

    /// The limits those are counted against.
    pub fn handshake_limits(&self) -> ferry_net::HandshakeLimits {
        self.gate.limits()
    }

    /// Stops serving: the listener closes and every accepted connection is shut down.
    pub fn shutdown(&self) {
        if !self.live.stopped.swap(true, Ordering::AcqRel) {
            if let Some(listener) = lock(&self.listener).take() {
                // SAFETY: the descriptor is the listener's: the `Arc` held here keeps it open
                // for the call. This stops its listening and wakes the accept thread's poll.
                unsafe { libc::shutdown(listener.as_raw_fd(), libc::SHUT_RDWR) };
            }
            self.live.shutdown_all();
        }
    }
}

impl Drop for UringServerHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// What the server's threads share.
pub(crate) struct Ctx {
    pub(crate) table: Arc<dyn SegmentTable>,
    pub(crate) responder: Arc<dyn HandshakeResponder>,
    pub(crate) config: UringConfig,
    pub(crate) stats: Arc<IoStats>,
    pub(crate) live: Arc<Live>,
    /// The fixed set of rings that serves every data stream.
    rings: std::sync::OnceLock<rings::RingSet>,
}

impl Ctx {
    /// A context whose rings are not started yet.
    pub(crate) fn new(
        table: Arc<dyn SegmentTable>,
        responder: Arc<dyn HandshakeResponder>,
        config: UringConfig,
        stats: Arc<IoStats>,
        live: Arc<Live>,
    ) -> Self {
        Self {
            table,
            responder,
            config,
            stats,
            live,
            rings: std::sync::OnceLock::new(),
        }
    }
}

impl UringServer {
    /// Binds `addr` (port 0: any; `SO_REUSEADDR` as std sets it).
    pub fn bind(addr: SocketAddr) -> Result<Self, Error> {
        let listener =
            TcpListener::bind(addr).map_err(|e| Error::io("bind", addr.to_string(), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("local address of", addr.to_string(), e))?;
        Ok(Self { listener, addr })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Starts serving `table` with the identity and policy of `responder` (same shape as the TCP
    /// transport's `TcpServer::serve`): its memory segments, and its file segments
    /// ([`SegmentTable::file`]; a [`FileSegment`] with io_uring reads and writes, O_DIRECT where a
    /// request's alignment allows, any other source with its positioned reads and writes).
    /// Needs no async runtime. One thread accepts connections and runs their handshakes
    /// (within `config.handshake`: a deadline on each, a cap on how many at once; counted in
    /// [`UringServerHandle::handshakes`]); each attached data stream gets a place on one of the
    /// server's fixed set of rings ([`UringConfig::server_rings`], started here: an error if a
    /// ring cannot be made), none a thread of its own.
    pub fn serve(
        self,
        table: Arc<dyn SegmentTable>,
        responder: Arc<dyn HandshakeResponder>,
        config: UringConfig,
    ) -> Result<UringServerHandle, Error> {
        let addr = self.addr;
        let live = Arc::new(Live::default());
        let stats = Arc::new(IoStats::default());
        let ctx = Arc::new(Ctx::new(
            table,
            responder,
            config,
            stats.clone(),
            live.clone(),
        ));
        let set = rings::RingSet::start(ctx.config.server_rings, &ctx)
            .map_err(|e| Error::io("start the serving rings of", addr.to_string(), e))?;
        let rings = set.len();
        let _ = ctx.rings.set(set);
        let listener = Arc::new(self.listener);
        // The accept thread polls it with the connections in their handshake.
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("make non-blocking the listener on", addr.to_string(), e))?;
        let accepting = listener.clone();
        let gate = HandshakeGate::new(ctx.config.handshake);
        let gate_run = gate.clone();
        std::thread::Builder::new()
            .name("ferry-uring-accept".into())
            .spawn(move || handshakes::run(accepting, ctx, gate_run))
            .map_err(|e| Error::io("spawn accept thread for", addr.to_string(), e))?;
        Ok(UringServerHandle {
            addr,
            live,
            listener: Mutex::new(Some(listener)),
            stats,
            gate,
            rings,
        })
    }
}

/// Serves a data stream whose handshake just ended (the attach accepted, its `proto` bound to
/// what the peer may see) on one of the server's rings, which answers the attach first.
pub(crate) fn attached(
    stream: TcpStream,
    from: SocketAddr,
    attach: StreamAttach,
    proto: ServerStream,
    ctx: &Arc<Ctx>,
) {
    if ctx.config.unpaced_loopback && from.ip().is_loopback() {
        crate::unpace(&stream);
    }
    match ctx.rings.get() {
        Some(rings) => rings::attached(
            rings,
            stream,
            from,
            attach.stream_index,
            proto,
            ctx.config.pin_loopback_streams,
        ),
        None => debug!(%from, "the server's rings are not started; stream closed"),
    }
}

/// File segments move through a staging buffer of at most this much per stream (a multiple of
/// `DIRECT_ALIGN`, so aligned chunks stay aligned piece by piece).
pub(crate) const FILE_PIECE: usize = 1 << 20;

/// A staging buffer for file segments, page-aligned for O_DIRECT.
pub(crate) struct Stage {
    pub(crate) region: Option<Arc<MemoryRegion>>,
}

impl Stage {
    pub(crate) fn get(&mut self, len: usize) -> std::io::Result<&Arc<MemoryRegion>> {
        let need = (len as u64).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        if self.region.as_ref().is_none_or(|r| (r.len() as u64) < need) {
            let r =
                MemoryRegion::alloc_zeroed(need.max(DIRECT_ALIGN) as usize, DIRECT_ALIGN as usize)
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
            self.region = Some(Arc::new(r));
        }
        self.region
            .as_ref()
            .ok_or_else(|| std::io::Error::other("staging buffer"))
    }
}

/// A published file as this server moves it: a [`FileSegment`] through the stream's file ring
/// (O_DIRECT where alignment allows), any other [`FileSource`] through its own positioned I/O.
pub(crate) enum FileIo {
    Segment(Arc<FileSegment>),
    Source(Arc<dyn FileSource>),
}

impl FileIo {
    pub(crate) fn new(source: Arc<dyn FileSource>) -> Self {
        let any: Arc<dyn std::any::Any + Send + Sync> = source.clone();
        match any.downcast::<FileSegment>() {
            Ok(seg) => FileIo::Segment(seg),
            Err(_) => FileIo::Source(source),
        }
    }

    /// Reads exactly `n` bytes at file offset `at` into the start of `buf`.
    pub(crate) fn read_piece(
        &self,
        ring: &mut FileRing,
        buf: &MemoryRegion,
        n: usize,
        at: u64,
    ) -> std::io::Result<()> {
        match self {
            FileIo::Segment(f) => {
                let (fd, _direct) = f.read_fd(at, n as u64, buf.as_ptr() as usize);
                // SAFETY: the staging region holds at least `n` bytes and is used only by this
                // stream's thread, which waits for the read here.
                let got = unsafe { ring.io(fd, false, buf.as_ptr(), n, at) }?;
                if got < n {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("file {} shrank under a READ", f.path().display()),
                    ));
                }
                Ok(())
            }
            FileIo::Source(f) => {
                // SAFETY: the staging region is this stream thread's alone, and no other view
                // of it is alive during the call; read straight into it, no bounce buffer.
                let piece = unsafe { buf.slice_mut(0, n) }
                    .map_err(|e| std::io::Error::other(format!("staging buffer: {e}")))?;
                f.read_exact_at(at, piece)
            }
        }
    }

    /// Writes the first `n` bytes of `buf` at file offset `at`.
    pub(crate) fn write_piece(
        &self,
        ring: &mut FileRing,
        buf: &MemoryRegion,
        n: usize,
        at: u64,
    ) -> std::io::Result<()> {
        match self {
            FileIo::Segment(f) => {
                // SAFETY: the staging region holds the `n` bytes just received and is used only
                // by this stream's thread, which waits for the write here.
                let put = unsafe { ring.io(f.write_fd(), true, buf.as_ptr(), n, at) }?;
                if put < n {
                    return Err(std::io::Error::other(format!(
                        "short write to file {}",
                        f.path().display()
                    )));
                }
                Ok(())
            }
            FileIo::Source(f) => {
                // SAFETY: the staging region is this stream thread's alone and nothing writes
                // it during the call; write straight from it, no bounce buffer.
                let piece = unsafe { buf.slice(0, n) }
                    .map_err(|e| std::io::Error::other(format!("staging buffer: {e}")))?;
                f.write_all_at(at, piece)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::net::TcpListener;
    use std::os::fd::AsRawFd;
    use std::sync::{Arc, Mutex, mpsc};
    use std::time::Duration;

    use super::UringServer;
    use crate::UringConfig;
    use crate::testing::{NoSegments, Responder, hello};

    /// Sends on its channel when the thread that holds it ends.
    struct OnExit(mpsc::Sender<()>);

    impl Drop for OnExit {
        fn drop(&mut self) {
            let _ = self.0.send(());
        }
    }

    thread_local! {
        static EXIT: RefCell<Option<OnExit>> = const { RefCell::new(None) };
    }

    /// The handle's shutdown reaches its own listener only: after the accept thread ended (a
    /// responder that panics takes it down), a socket that then took the listener's descriptor
    /// number is left alone.
    #[test]
    fn shutdown_never_touches_a_descriptor_the_accept_thread_let_go() {
        if io_uring::IoUring::new(4).is_err() {
            ferry_tests::require_or_skip(ferry_tests::URING, "the kernel refuses io_uring rings");
            return;
        }
        let (exit_tx, exit_rx) = mpsc::channel();
        let exit_tx = Mutex::new(exit_tx);
        let responder = Responder::new(move || {
            let tx = exit_tx.lock().unwrap().clone();
            EXIT.with(|e| *e.borrow_mut() = Some(OnExit(tx)));
            panic!("a responder that fails (this test's own panic)");
        });
        let server = UringServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener_fd = server.listener.as_raw_fd();
        let handle = server
            .serve(
                Arc::new(NoSegments),
                responder,
                UringConfig {
                    server_rings: 1,
                    ..UringConfig::default()
                },
            )
            .unwrap();
        let addr = handle.local_addr();
        // The hello reaches the responder, whose panic ends the accept thread.
        let answer = crate::control::handshake(addr, &hello(), Duration::from_secs(10));
        assert!(answer.is_err(), "{answer:?}");
        exit_rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the accept thread ended");
        // New sockets take the lowest free descriptors: up to the listener's number.
        let mut fresh = Vec::new();
        while fresh.len() < 4096 {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let fd = l.as_raw_fd();
            fresh.push(l);
            if fd >= listener_fd {
                break;
            }
        }
        handle.shutdown();
        for l in &fresh {
            let to = l.local_addr().unwrap();
            assert!(
                std::net::TcpStream::connect_timeout(&to, Duration::from_secs(10)).is_ok(),
                "the socket at descriptor {} (the listener's was {listener_fd}) was shut down",
                l.as_raw_fd()
            );
        }
    }
}

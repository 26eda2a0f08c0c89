//! The serving side: one listener thread for control connections (handshake) and data streams;
//! every data stream is served by one of a fixed set of rings. Every request is checked for
//! token, access and bounds before any byte of a segment (memory or file) is touched.
//!
//! Its modules, each importing only those below it:
//! - this one: [`UringServer`] and its handle, which start the rest;
//! - `handshakes`: the accept thread, every connection's handshake, an attached stream handed on;
//! - `rings`: the set of rings, a stream's hand-over to one, and each ring's thread (a
//!   [`Host`](crate::ring::host::Host) of server streams);
//! - `stream`: a stream as its ring host runs it (its turn, its operations' completions, its
//!   end);
//! - `sockio`: a stream's socket operations and their completions;
//! - `plan`: the steps a request becomes;
//! - `conn`: one stream as its ring holds it (its steps and their memory);
//! - `files` (file segments piece by piece) and `shared` (what the threads share).

mod conn;
mod files;
mod handshakes;
mod plan;
mod rings;
mod shared;
mod sockio;
mod stream;

use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use ferry_core::{Error, HandshakeResponder, SegmentTable};
use ferry_net::{HandshakeGate, HandshakeStats};

use crate::config::UringConfig;
use crate::ring::IoStats;
use handshakes::Acceptor;
use rings::RingSet;
use shared::{Ctx, Live, lock};

/// A bound listener, not serving yet.
#[derive(Debug)]
pub struct UringServer {
    listener: TcpListener,
    addr: SocketAddr,
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

impl UringServer {
    /// Binds `addr` (port 0: any) as every Ferry server listens ([`ferry_net::listen`]:
    /// `SO_REUSEADDR`, and non-blocking: the accept thread polls the listener with the
    /// connections in their handshake).
    pub fn bind(addr: SocketAddr) -> Result<Self, Error> {
        let (listener, addr) = ferry_net::listen(addr)?;
        Ok(Self { listener, addr })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Starts serving `table` with the identity and policy of `responder` (same shape as the TCP
    /// transport's `TcpServer::serve`): its memory segments, and its file segments
    /// ([`SegmentTable::file`]; a [`FileSegment`](ferry_file::FileSegment) with io_uring reads and
    /// writes, O_DIRECT where a request's alignment allows, any other source with its positioned
    /// reads and writes). Needs no async runtime. One thread accepts connections and runs their
    /// handshakes (within `config.handshake`: a deadline on each, a cap on how many at once;
    /// counted in [`UringServerHandle::handshakes`]); each attached data stream gets a place on one
    /// of the server's fixed set of rings ([`UringConfig::server_rings`], started here: an error if
    /// a ring cannot be made), none a thread of its own.
    pub fn serve(
        self,
        table: Arc<dyn SegmentTable>,
        responder: Arc<dyn HandshakeResponder>,
        config: UringConfig,
    ) -> Result<UringServerHandle, Error> {
        let addr = self.addr;
        let live = Arc::new(Live::default());
        let stats = Arc::new(IoStats::default());
        let ctx = Arc::new(Ctx {
            config,
            stats: stats.clone(),
            live: live.clone(),
        });
        let set = RingSet::start(ctx.config.server_rings, &ctx)
            .map_err(|e| Error::io("start the serving rings of", addr.to_string(), e))?;
        let rings = set.len();
        let listener = Arc::new(self.listener);
        let accepting = listener.clone();
        let gate = HandshakeGate::new(ctx.config.handshake);
        let gate_run = gate.clone();
        let acceptor = Acceptor {
            table,
            responder,
            ctx,
            rings: set,
        };
        std::thread::Builder::new()
            .name("ferry-uring-accept".into())
            .spawn(move || handshakes::run(accepting, acceptor, gate_run))
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

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::net::TcpListener;
    use std::os::fd::AsRawFd;
    use std::sync::{Arc, Mutex, mpsc};
    use std::time::Duration;

    use super::UringServer;
    use crate::config::UringConfig;
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

    /// Sends on its channel each time a warning says "accept failed".
    struct AcceptFailures(Mutex<mpsc::Sender<()>>);

    impl tracing::Subscriber for AcceptFailures {
        fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
            *meta.level() == tracing::Level::WARN
        }

        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }

        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

        fn event(&self, event: &tracing::Event<'_>) {
            struct Says(bool);
            impl tracing::field::Visit for Says {
                fn record_debug(
                    &mut self,
                    field: &tracing::field::Field,
                    value: &dyn std::fmt::Debug,
                ) {
                    if field.name() == "message" && format!("{value:?}") == "accept failed" {
                        self.0 = true;
                    }
                }
            }
            let mut says = Says(false);
            event.record(&mut says);
            if says.0 {
                let _ = self.0.lock().unwrap().send(());
            }
        }

        fn enter(&self, _: &tracing::span::Id) {}

        fn exit(&self, _: &tracing::span::Id) {}
    }

    /// A failed accept leaves the listener out of the accept thread's poll for a while, not for
    /// good: a connection whose accept failed (the process out of descriptors) is accepted and
    /// answered once descriptors are free again. Run in a process of its own
    /// ([`out_of_descriptors_in_a_process_of_its_own`]), whose descriptors it uses up.
    #[test]
    fn a_listener_accepts_again_after_a_failed_accept() {
        if io_uring::IoUring::new(4).is_err() {
            ferry_tests::require_or_skip(ferry_tests::URING, "the kernel refuses io_uring rings");
            return;
        }
        crate::testing::in_a_process_of_its_own(
            "server::tests::out_of_descriptors_in_a_process_of_its_own",
        );
    }

    #[test]
    #[ignore = "run by a_listener_accepts_again_after_a_failed_accept, in a process of its own"]
    fn out_of_descriptors_in_a_process_of_its_own() {
        // A failure past this, never a pace.
        const PATIENCE: Duration = Duration::from_secs(20);
        let (failed_tx, failed_rx) = mpsc::channel();
        tracing::subscriber::set_global_default(AcceptFailures(Mutex::new(failed_tx))).unwrap();
        let server = UringServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let handle = server
            .serve(
                Arc::new(NoSegments),
                Responder::new(|| {}),
                UringConfig {
                    server_rings: 1,
                    ..UringConfig::default()
                },
            )
            .unwrap();
        let addr = handle.local_addr();
        // Every descriptor below a soft limit of at most 1024 taken, but one for the client.
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `limit` is a valid rlimit for getrlimit to fill.
        let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
        assert_eq!(got, 0);
        limit.rlim_cur = limit.rlim_cur.min(1024);
        // SAFETY: `limit` is a valid rlimit, its soft limit within the hard one.
        let set = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
        assert_eq!(set, 0);
        let null = std::fs::File::open("/dev/null").unwrap();
        let mut ballast = Vec::new();
        loop {
            match null.try_clone() {
                Ok(f) => ballast.push(f),
                Err(e) if e.raw_os_error() == Some(libc::EMFILE) => break,
                Err(e) => panic!("dup: {e}"),
            }
        }
        ballast.pop();
        let mut client = std::net::TcpStream::connect(addr).unwrap();
        failed_rx
            .recv_timeout(PATIENCE)
            .expect("the server's accept failed");
        drop(ballast);
        client.set_read_timeout(Some(PATIENCE)).unwrap();
        let hello = hello();
        crate::control::write_frame(
            &mut client,
            addr,
            &ferry_core::wire::ControlFrame::Hello(hello.clone()),
        )
        .unwrap();
        let reply = crate::control::read_frame(&mut client, addr).expect("an answer");
        ferry_core::handshake::hello_reply(addr, &hello, reply).unwrap();
    }
}

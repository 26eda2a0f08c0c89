//! [`FaultProxy`]: a TCP proxy on loopback that forwards every connection it accepts to one target
//! and injects faults switched at runtime: cut after N bytes, stall, trickle, reset (RST),
//! half-close, and [`FaultProxy::kill_all`].
//!
//! The TCP and io_uring data planes attach their data streams to the port of the control handshake
//! (the offer's port is 0, see `ferry_core::handshake::stream_endpoint`), so one proxy in front of a
//! server carries the control connection and every data stream of a peer.
//!
//! Each accepted connection gets a connection to the target and two pump threads (one per
//! direction). A pump checks the rules before every read and every write, so a fault switched on
//! while bytes flow acts at once (within [`POLL`]). Byte thresholds (`after`) count the bytes that
//! connection forwarded in that direction since it was accepted.
//!
//! The proxy talks to loopback only: it listens on `127.0.0.1:0` and [`FaultProxy::start`] refuses
//! a target that is not a loopback address.

use std::collections::HashMap;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often a blocked pump looks at the rules and at [`FaultProxy::kill_all`] (its sockets' read
/// and write timeout).
pub const POLL: Duration = Duration::from_millis(20);

/// Bytes a pump moves per read at most.
const BUF: usize = 256 * 1024;

/// A direction of a proxied connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// From the connecting client to the target.
    ToTarget,
    /// From the target back to the client.
    ToClient,
    /// Both directions (each direction counts its own bytes).
    Both,
}

impl Dir {
    fn covers(self, d: Dir) -> bool {
        self == Dir::Both || self == d
    }
}

/// Which connections a rule acts on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Every connection, those live now and those accepted later.
    All,
    /// The connection accepted in this position (0: the first the proxy accepted).
    Nth(u64),
}

/// A fault. `after` counts the bytes a connection forwarded in the rule's direction since it was
/// accepted; 0 acts at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// After `after` bytes, close both sides (FIN to both peers).
    Cut {
        /// Bytes forwarded first.
        after: u64,
    },
    /// After `after` bytes, reset both sides: `SO_LINGER` 0, then close (RST to both peers).
    Reset {
        /// Bytes forwarded first.
        after: u64,
    },
    /// After `after` bytes, shut down writing towards the direction's receiver (it reads EOF);
    /// the other direction keeps flowing.
    HalfClose {
        /// Bytes forwarded first.
        after: u64,
    },
    /// After `after` bytes, forward nothing (and read nothing, so the sender's buffers fill) for
    /// `duration` from the moment the stall began, or until the rule is removed when `None`. The
    /// sockets stay open.
    Stall {
        /// Bytes forwarded first.
        after: u64,
        /// How long; `None` until removed.
        duration: Option<Duration>,
    },
    /// Forward at most this many bytes per second.
    Trickle {
        /// The rate, at least 1.
        bytes_per_sec: u64,
    },
}

/// Names a rule for [`FaultProxy::remove`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RuleId(u64);

/// What the proxy has seen so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyCounters {
    /// Connections accepted.
    pub accepted: u64,
    /// Connections with a pump still running.
    pub live: u64,
    /// Bytes forwarded from clients to the target.
    pub bytes_to_target: u64,
    /// Bytes forwarded from the target to clients.
    pub bytes_to_client: u64,
    /// Faults that acted (a terminal fault once per connection and direction, a stall when it
    /// began, [`FaultProxy::kill_all`] once per connection it ended).
    pub faults_fired: u64,
}

#[derive(Debug)]
struct Rule {
    id: RuleId,
    scope: Scope,
    dir: Dir,
    fault: Fault,
    /// Acts on the first (connection, direction) it triggers on only.
    once: bool,
    /// The pump a `once` rule acts on, once claimed.
    claimed: Option<(u64, Dir)>,
}

/// How a connection ends early.
const END_NONE: u8 = 0;
const END_CLOSE: u8 = 1;
const END_RESET: u8 = 2;

#[derive(Debug)]
struct Conn {
    ending: AtomicU8,
}

impl Conn {
    /// Asks both pumps to end the connection (the first request wins); whether this call asked.
    fn end(&self, how: u8) -> bool {
        self.ending
            .compare_exchange(END_NONE, how, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

#[derive(Debug, Default)]
struct Shared {
    rules: Mutex<Vec<Rule>>,
    next_rule: AtomicU64,
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    closed: AtomicBool,
    accepted: AtomicU64,
    bytes_to_target: AtomicU64,
    bytes_to_client: AtomicU64,
    faults_fired: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A pump that panicked leaves consistent data (each critical section is one push or scan).
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A fault-injecting TCP proxy on loopback. Dropping it cuts every connection and stops accepting.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    target: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl FaultProxy {
    /// Listens on `127.0.0.1:0` and forwards every connection to `target`, which must be a loopback
    /// address.
    pub fn start(target: SocketAddr) -> io::Result<FaultProxy> {
        if !target.ip().is_loopback() {
            return Err(io::Error::new(
                ErrorKind::InvalidInput,
                format!("the fault proxy forwards to loopback only, not to {target}"),
            ));
        }
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let acceptor = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("fault-proxy-accept".into())
                .spawn(move || accept_loop(listener, target, shared))?
        };
        Ok(FaultProxy {
            addr,
            target,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address connections are forwarded to.
    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// Switches a fault on; it acts until [`FaultProxy::remove`] or [`FaultProxy::clear`] (a
    /// terminal fault acts once per connection and direction, since the connection is gone).
    pub fn inject(&self, scope: Scope, dir: Dir, fault: Fault) -> RuleId {
        self.add(scope, dir, fault, false)
    }

    /// Switches a fault on for the first connection and direction it triggers on only; it is
    /// removed once it has acted (a stall when it ends).
    pub fn inject_once(&self, scope: Scope, dir: Dir, fault: Fault) -> RuleId {
        self.add(scope, dir, fault, true)
    }

    fn add(&self, scope: Scope, dir: Dir, fault: Fault, once: bool) -> RuleId {
        let id = RuleId(self.shared.next_rule.fetch_add(1, Ordering::Relaxed));
        lock(&self.shared.rules).push(Rule {
            id,
            scope,
            dir,
            fault,
            once,
            claimed: None,
        });
        id
    }

    /// Switches one fault off (a stall it caused ends).
    pub fn remove(&self, id: RuleId) {
        lock(&self.shared.rules).retain(|r| r.id != id);
    }

    /// Switches every fault off.
    pub fn clear(&self) {
        lock(&self.shared.rules).clear();
    }

    /// Resets every live connection now (RST to both peers); later connections are forwarded.
    pub fn kill_all(&self) {
        for conn in lock(&self.shared.conns).values() {
            if conn.end(END_RESET) {
                self.shared.faults_fired.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The counters now.
    pub fn counters(&self) -> ProxyCounters {
        let s = &self.shared;
        ProxyCounters {
            accepted: s.accepted.load(Ordering::Relaxed),
            live: lock(&s.conns).len() as u64,
            bytes_to_target: s.bytes_to_target.load(Ordering::Relaxed),
            bytes_to_client: s.bytes_to_client.load(Ordering::Relaxed),
            faults_fired: s.faults_fired.load(Ordering::Relaxed),
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        for conn in lock(&self.shared.conns).values() {
            conn.end(END_CLOSE);
        }
        // Wakes the accept loop, which sees `closed` and returns.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

fn accept_loop(listener: TcpListener, target: SocketAddr, shared: Arc<Shared>) {
    for client in listener.incoming() {
        if shared.closed.load(Ordering::Acquire) {
            return;
        }
        let client = match client {
            Ok(c) => c,
            Err(e) => {
                eprintln!("fault proxy: accept failed: {e}");
                continue;
            }
        };
        let index = shared.accepted.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            ending: AtomicU8::new(END_NONE),
        });
        lock(&shared.conns).insert(index, conn.clone());
        let shared2 = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("fault-proxy-{index}"))
            .spawn(move || {
                if let Err(e) = run_conn(index, client, target, conn, &shared2) {
                    eprintln!("fault proxy: connection {index}: {e}");
                    lock(&shared2.conns).remove(&index);
                }
            });
        if let Err(e) = spawned {
            eprintln!("fault proxy: no thread for connection {index}: {e}");
            lock(&shared.conns).remove(&index);
        }
    }
}

/// Connects to the target and runs both pumps (one on a thread of its own).
fn run_conn(
    index: u64,
    client: TcpStream,
    target: SocketAddr,
    conn: Arc<Conn>,
    shared: &Arc<Shared>,
) -> io::Result<()> {
    let server = TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
    for s in [&client, &server] {
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(POLL))?;
        s.set_write_timeout(Some(POLL))?;
    }
    let pumps_left = Arc::new(AtomicU8::new(2));
    let up = Pump {
        index,
        dir: Dir::ToTarget,
        src: client.try_clone()?,
        dst: server.try_clone()?,
        conn: conn.clone(),
        shared: shared.clone(),
        pumps_left: pumps_left.clone(),
    };
    let down = Pump {
        index,
        dir: Dir::ToClient,
        src: server,
        dst: client,
        conn,
        shared: shared.clone(),
        pumps_left,
    };
    std::thread::Builder::new()
        .name(format!("fault-proxy-{index}-up"))
        .spawn(move || up.run())?;
    down.run();
    Ok(())
}

struct Pump {
    index: u64,
    dir: Dir,
    src: TcpStream,
    dst: TcpStream,
    conn: Arc<Conn>,
    shared: Arc<Shared>,
    pumps_left: Arc<AtomicU8>,
}

/// What the rules say a pump does next.
enum Action {
    /// Forward at most this many bytes, sleeping as a trickle asks (bytes per second).
    Forward { max: u64, rate: Option<u64> },
    /// Forward nothing for now.
    Stall,
    /// End the connection (`END_CLOSE`, `END_RESET`).
    End(u8),
    /// Shut down writing towards the receiver, and stop this pump.
    HalfClose,
}

impl Pump {
    fn run(mut self) {
        let mut buf = vec![0u8; BUF];
        let mut pending = 0..0;
        let mut forwarded = 0u64;
        // When each stall rule began for this pump.
        let mut stalls: HashMap<RuleId, Instant> = HashMap::new();
        let ended = loop {
            match self.conn.ending.load(Ordering::Acquire) {
                END_NONE => {}
                how => break Some(how),
            }
            let (max, rate) = match self.decide(forwarded, &mut stalls) {
                Action::Forward { max, rate } => (max, rate),
                Action::Stall => {
                    std::thread::sleep(POLL);
                    continue;
                }
                Action::End(how) => {
                    if self.conn.end(how) {
                        self.shared.faults_fired.fetch_add(1, Ordering::Relaxed);
                    }
                    continue;
                }
                Action::HalfClose => {
                    self.shared.faults_fired.fetch_add(1, Ordering::Relaxed);
                    let _ = self.dst.shutdown(Shutdown::Write);
                    break None;
                }
            };
            let cap = max.min(rate.map_or(u64::MAX, |r| (r / 20).max(1))) as usize;
            if pending.is_empty() {
                match self.src.read(&mut buf[..cap.min(BUF)]) {
                    Ok(0) => {
                        // The sender finished: pass the half-close on.
                        let _ = self.dst.shutdown(Shutdown::Write);
                        break None;
                    }
                    Ok(n) => pending = 0..n,
                    Err(e) if is_timeout(&e) => continue,
                    Err(_) => {
                        self.conn.end(END_RESET);
                        continue;
                    }
                }
                // Rules may have changed while the read waited: look again before writing.
                continue;
            }
            let n = pending.len().min(cap);
            match self.dst.write(&buf[pending.start..pending.start + n]) {
                Ok(0) => {
                    self.conn.end(END_RESET);
                }
                Ok(w) => {
                    pending.start += w;
                    forwarded += w as u64;
                    let counter = match self.dir {
                        Dir::ToTarget => &self.shared.bytes_to_target,
                        _ => &self.shared.bytes_to_client,
                    };
                    counter.fetch_add(w as u64, Ordering::Relaxed);
                    if let Some(rate) = rate {
                        std::thread::sleep(Duration::from_secs_f64(w as f64 / rate as f64));
                    }
                }
                Err(e) if is_timeout(&e) => {}
                Err(_) => {
                    self.conn.end(END_RESET);
                }
            }
        };
        match ended {
            Some(END_RESET) => {
                for s in [&self.src, &self.dst] {
                    let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
                }
            }
            Some(_) => {
                for s in [&self.src, &self.dst] {
                    let _ = s.shutdown(Shutdown::Both);
                }
            }
            None => {}
        }
        if self.pumps_left.fetch_sub(1, Ordering::AcqRel) == 1 {
            lock(&self.shared.conns).remove(&self.index);
        }
        // Dropping the last descriptors closes the sockets (with RST after `SO_LINGER` 0).
    }

    fn decide(&self, forwarded: u64, stalls: &mut HashMap<RuleId, Instant>) -> Action {
        let me = (self.index, self.dir);
        let mut rules = lock(&self.shared.rules);
        let mut max = u64::MAX;
        let mut rate: Option<u64> = None;
        let mut stalled = false;
        let mut done: Vec<RuleId> = Vec::new();
        let mut action = None;
        for rule in rules.iter_mut() {
            let applies = match rule.scope {
                Scope::All => true,
                Scope::Nth(n) => n == self.index,
            } && rule.dir.covers(self.dir)
                && rule.claimed.is_none_or(|c| c == me);
            if !applies {
                continue;
            }
            let after = match rule.fault {
                Fault::Cut { after }
                | Fault::Reset { after }
                | Fault::HalfClose { after }
                | Fault::Stall { after, .. } => after,
                Fault::Trickle { .. } => 0,
            };
            if forwarded < after {
                max = max.min(after - forwarded);
                continue;
            }
            if rule.once {
                rule.claimed = Some(me);
            }
            match rule.fault {
                Fault::Cut { .. } | Fault::Reset { .. } | Fault::HalfClose { .. } => {
                    if rule.once {
                        done.push(rule.id);
                    }
                    action.get_or_insert(match rule.fault {
                        Fault::Cut { .. } => Action::End(END_CLOSE),
                        Fault::Reset { .. } => Action::End(END_RESET),
                        _ => Action::HalfClose,
                    });
                }
                Fault::Stall { duration, .. } => {
                    let began = *stalls.entry(rule.id).or_insert_with(|| {
                        self.shared.faults_fired.fetch_add(1, Ordering::Relaxed);
                        Instant::now()
                    });
                    if duration.is_none_or(|d| began.elapsed() < d) {
                        stalled = true;
                    } else if rule.once {
                        done.push(rule.id);
                    }
                }
                Fault::Trickle { bytes_per_sec } => {
                    let r = bytes_per_sec.max(1);
                    rate = Some(rate.map_or(r, |old| old.min(r)));
                }
            }
        }
        rules.retain(|r| !done.contains(&r.id));
        if let Some(action) = action {
            return action;
        }
        if stalled {
            return Action::Stall;
        }
        Action::Forward { max, rate }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
        || e.kind() == ErrorKind::Interrupted
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A target that serves each connection with `serve` on a thread of its own.
    fn target(serve: impl Fn(TcpStream) + Send + Sync + 'static) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let serve = Arc::new(serve);
        std::thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(s) = s else { return };
                let serve = serve.clone();
                std::thread::spawn(move || serve(s));
            }
        });
        addr
    }

    fn echo(mut s: TcpStream) {
        let mut buf = [0u8; 64 * 1024];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if s.write_all(&buf[..n]).is_err() {
                        return;
                    }
                }
            }
        }
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 + i / 251) as u8).collect()
    }

    /// A target that sends `pattern(len)` and closes.
    fn sender(len: usize) -> SocketAddr {
        target(move |mut s| {
            let _ = s.write_all(&pattern(len));
        })
    }

    /// Reads until EOF or an error; what came, and the error if one ended it.
    fn read_all(s: &mut TcpStream) -> (Vec<u8>, Option<io::Error>) {
        let mut got = Vec::new();
        let mut buf = [0u8; 64 * 1024];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return (got, None),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return (got, Some(e)),
            }
        }
    }

    fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn bytes_pass_unchanged_both_ways() {
        let proxy = FaultProxy::start(target(echo)).unwrap();
        let data = pattern(8 << 20);
        let mut c = TcpStream::connect(proxy.addr()).unwrap();
        let mut reader = c.try_clone().unwrap();
        let expect = data.len();
        let readback = std::thread::spawn(move || {
            let mut got = vec![0u8; expect];
            reader.read_exact(&mut got).unwrap();
            got
        });
        c.write_all(&data).unwrap();
        assert!(readback.join().unwrap() == data, "bytes changed");
        let n = proxy.counters();
        assert_eq!(n.accepted, 1);
        assert_eq!(n.bytes_to_target, data.len() as u64);
        assert_eq!(n.bytes_to_client, data.len() as u64);
        assert_eq!(n.faults_fired, 0);
        drop(c);
        wait_until("the connection to end", || proxy.counters().live == 0);
    }

    #[test]
    fn refuses_a_target_off_loopback() {
        let e = FaultProxy::start("192.0.2.1:80".parse().unwrap()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
    }

    #[test]
    fn cut_closes_after_exactly_n_bytes() {
        let proxy = FaultProxy::start(sender(1 << 20)).unwrap();
        proxy.inject(Scope::All, Dir::ToClient, Fault::Cut { after: 1000 });
        let mut c = TcpStream::connect(proxy.addr()).unwrap();
        let (got, err) = read_all(&mut c);
        assert!(err.is_none(), "a cut closes (FIN), got {err:?}");
        assert_eq!(got, pattern(1 << 20)[..1000]);
        assert_eq!(proxy.counters().faults_fired, 1);
    }

    #[test]
    fn reset_sends_rst() {
        let proxy = FaultProxy::start(sender(1 << 20)).unwrap();
        proxy.inject(Scope::All, Dir::ToClient, Fault::Reset { after: 5000 });
        let mut c = TcpStream::connect(proxy.addr()).unwrap();
        let (got, err) = read_all(&mut c);
        assert!(got.len() <= 5000);
        let err = err.expect("a reset ends with an error, not EOF");
        assert_eq!(err.kind(), ErrorKind::ConnectionReset, "{err}");
    }

    #[test]
    fn only_the_nth_connection_is_hit() {
        let proxy = FaultProxy::start(sender(100_000)).unwrap();
        proxy.inject(Scope::Nth(1), Dir::Both, Fault::Cut { after: 0 });
        let lens: Vec<usize> = (0..3)
            .map(|_| {
                let mut c = TcpStream::connect(proxy.addr()).unwrap();
                read_all(&mut c).0.len()
            })
            .collect();
        assert_eq!(lens, [100_000, 0, 100_000]);
    }

    #[test]
    fn inject_once_acts_on_one_connection() {
        let proxy = FaultProxy::start(sender(100_000)).unwrap();
        proxy.inject_once(Scope::All, Dir::ToClient, Fault::Cut { after: 10 });
        let lens: Vec<usize> = (0..2)
            .map(|_| {
                let mut c = TcpStream::connect(proxy.addr()).unwrap();
                read_all(&mut c).0.len()
            })
            .collect();
        assert_eq!(lens, [10, 100_000]);
    }

    #[test]
    fn stall_holds_bytes_until_removed() {
        let proxy = FaultProxy::start(sender(1 << 20)).unwrap();
        let stall = proxy.inject(
            Scope::All,
            Dir::ToClient,
            Fault::Stall {
                after: 1000,
                duration: None,
            },
        );
        let mut c = TcpStream::connect(proxy.addr()).unwrap();
        let mut first = vec![0u8; 1000];
        c.read_exact(&mut first).unwrap();
        // Nothing more comes while the stall holds, and the socket stays open.
        c.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut one = [0u8; 1];
        let e = c.read(&mut one).unwrap_err();
        assert!(is_timeout(&e), "{e}");
        assert_eq!(proxy.counters().live, 1);
        proxy.remove(stall);
        c.set_read_timeout(None).unwrap();
        let (rest, err) = read_all(&mut c);
        assert!(err.is_none());
        first.extend(rest);
        assert!(first == pattern(1 << 20));
    }

    #[test]
    fn a_stall_with_a_duration_ends_by_itself() {
        let proxy = FaultProxy::start(sender(1 << 20)).unwrap();
        proxy.inject(
            Scope::All,
            Dir::ToClient,
            Fault::Stall {
                after: 0,
                duration: Some(Duration::from_millis(100)),
            },
        );
        let mut c = TcpStream::connect(proxy.addr()).unwrap();
        let (got, err) = read_all(&mut c);
        assert!(err.is_none());
        assert!(got == pattern(1 << 20));
        assert_eq!(proxy.counters().faults_fired, 1);
    }

    #[test]
    fn trickle_slows_and_keeps_bytes() {
        let len = 256 * 1024;
        let proxy = FaultProxy::start(sender(len)).unwrap();
        let trickle = proxy.inject(
            Scope::All,
            Dir::ToClient,
            Fault::Trickle {
                bytes_per_sec: 64 * 1024,
            },
        );
        let mut c = TcpStream::connect(proxy.addr()).unwrap();
        let start = Instant::now();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        c.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        // At 64 KiB/s, 0.5 s moves about 32 KiB: far from all of it however slow this machine is.
        while start.elapsed() < Duration::from_millis(500) {
            match c.read(&mut buf) {
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if is_timeout(&e) => {}
                Err(e) => panic!("{e}"),
            }
        }
        assert!(got.len() < len / 2, "a trickle moved {} bytes", got.len());
        proxy.remove(trickle);
        c.set_read_timeout(None).unwrap();
        let (rest, err) = read_all(&mut c);
        assert!(err.is_none());
        got.extend(rest);
        assert!(got == pattern(len));
    }

    #[test]
    fn half_close_keeps_the_other_direction() {
        // The target answers EOF with a farewell.
        let proxy = FaultProxy::start(target(|mut s| {
            let mut buf = [0u8; 1024];
            while let Ok(n) = s.read(&mut buf) {
                if n == 0 {
                    let _ = s.write_all(b"bye");
                    return;
                }
            }
        }))
        .unwrap();
        proxy.inject(Scope::All, Dir::ToTarget, Fault::HalfClose { after: 3 });
        let mut c = TcpStream::connect(proxy.addr()).unwrap();
        c.write_all(b"hello").unwrap();
        let (got, err) = read_all(&mut c);
        assert!(err.is_none());
        assert_eq!(got, b"bye");
        assert_eq!(proxy.counters().bytes_to_target, 3);
    }

    #[test]
    fn kill_all_resets_every_live_connection() {
        let proxy = FaultProxy::start(target(echo)).unwrap();
        let mut clients: Vec<TcpStream> = (0..3)
            .map(|_| TcpStream::connect(proxy.addr()).unwrap())
            .collect();
        for c in &mut clients {
            c.write_all(b"ping").unwrap();
            let mut got = [0u8; 4];
            c.read_exact(&mut got).unwrap();
        }
        assert_eq!(proxy.counters().live, 3);
        proxy.kill_all();
        for c in &mut clients {
            let (_, err) = read_all(c);
            let err = err.expect("kill_all resets");
            assert_eq!(err.kind(), ErrorKind::ConnectionReset, "{err}");
        }
        wait_until("no live connection", || proxy.counters().live == 0);
        assert_eq!(proxy.counters().faults_fired, 3);
        // A later connection is forwarded.
        let mut c = TcpStream::connect(proxy.addr()).unwrap();
        c.write_all(b"again").unwrap();
        let mut got = [0u8; 5];
        c.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"again");
    }
}

//! A stream's request/answer ring as two byte pipes, one each way: what a stream reads and
//! writes in place of its socket once both sides mapped the ring ([`crate::ring`] is the
//! protocol, [`crate::shm`] the memory).
//!
//! - *No system call while both sides are busy.* A write copies into the ring and publishes
//!   its index; a read copies out and publishes its own. A side that finds nothing spins a
//!   while ([`Spin`], adapted to how often the bytes came during the spin), then sleeps on its
//!   futex word, which the other side's next write (or read, for a writer waiting for room)
//!   clears and wakes: only then is there a system call.
//! - *A parked reader.* A reader whose answers other threads read for it (tasks spinning for
//!   their own) parks on its futex word left clear ([`Rx::park_while`]): the writer's wake
//!   finds nothing to do, so an answer makes no system call; [`Rx::arm`] sets the word when the
//!   reader is needed again, and the end of the stream wakes it as any sleeper.
//! - *Hang-ups at once.* The stream's socket stays open beside the ring and carries nothing more;
//!   a watcher thread per stream sleeps in `poll` on it, and when the peer shuts its sending
//!   half (`eof`: nothing more will be written into the ring) or hangs up both ways or dies
//!   (`gone`), it says so to this process's ends and wakes whichever of them sleeps. A futex
//!   sleep also ends after [`BACKSTOP`] to look again, so a peer that scribbles over the futex
//!   words delays a hang-up by that at most.
//! - *An untrusted peer.* Indices that cannot be ([`crate::ring::Garbage`]) fail the call with
//!   `InvalidData`; the stream then ends.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::ring::{Layout, RING_CAP, Spin, plan_read, plan_write};
use crate::shm::{Shm, futex_wait, futex_wake};

/// The longest a futex sleep lasts before its side looks again (for a hang-up whose wake a peer
/// cleared, or a wake lost to a peer's scribbling).
pub(crate) const BACKSTOP: Duration = Duration::from_millis(100);

/// One stream's mapping of its ring, and what its watcher saw of the socket.
#[derive(Debug)]
pub(crate) struct Link {
    shm: Shm,
    /// The peer shut its sending half (or the socket failed): nothing more comes.
    eof: AtomicBool,
    /// The peer hung up both ways (or died): nothing written now is read.
    gone: AtomicBool,
}

impl Link {
    /// Both of this side's ends of the ring `shm`: `tx` writes into ring `tx`, `rx` reads ring
    /// `rx`; a watcher thread on `sock` (a clone of it) ends with the socket's hang-up.
    pub(crate) fn start(
        shm: Shm,
        sock: &UnixStream,
        tx: Layout,
        rx: Layout,
    ) -> io::Result<(Tx, Rx)> {
        let link = Arc::new(Link {
            shm,
            eof: AtomicBool::new(false),
            gone: AtomicBool::new(false),
        });
        let watched = sock.try_clone()?;
        let l = link.clone();
        std::thread::Builder::new()
            .name("ferry-local-watch".into())
            .spawn(move || l.watch(&watched, [tx, rx]))?;
        Ok((
            Tx {
                link: link.clone(),
                ring: tx,
                head: AtomicU64::new(0),
            },
            Rx {
                link,
                ring: rx,
                tail: AtomicU64::new(0),
                spin: AtomicU64::new(Spin::new().budget_ns()),
                max_spin: Spin::MAX_NS,
            },
        ))
    }

    /// Sleeps on the socket until the peer shuts its sending half, then until it hangs up,
    /// waking this side's sleepers each time.
    fn watch(&self, sock: &UnixStream, rings: [Layout; 2]) {
        let mut events = libc::POLLIN | libc::POLLRDHUP;
        loop {
            let mut p = libc::pollfd {
                fd: sock.as_raw_fd(),
                events,
                revents: 0,
            };
            // SAFETY: one valid pollfd, no timeout.
            let n = unsafe { libc::poll(&mut p, 1, -1) };
            if n < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                // The socket failed: nothing more comes either (a reader only looks at `eof`).
                self.eof.store(true, Ordering::SeqCst);
                self.gone.store(true, Ordering::SeqCst);
            }
            if p.revents & (libc::POLLIN | libc::POLLRDHUP) != 0 {
                // Nothing but the end comes on the socket once the ring is in use.
                self.eof.store(true, Ordering::SeqCst);
                events = 0;
            }
            if p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
                self.eof.store(true, Ordering::SeqCst);
                self.gone.store(true, Ordering::SeqCst);
            }
            for r in rings {
                for w in [r.reader_sleep(), r.writer_sleep()] {
                    let w = self.shm.u32_at(w);
                    w.store(0, Ordering::SeqCst);
                    futex_wake(w);
                }
            }
            if self.gone.load(Ordering::SeqCst) {
                return;
            }
        }
    }
}

fn garbage() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        "the peer wrote impossible ring indices",
    )
}

/// Wakes the other side if it sleeps on `word` (it set it before it slept).
fn wake(shm: &Shm, word: usize) {
    std::sync::atomic::fence(Ordering::SeqCst);
    let w = shm.u32_at(word);
    if w.load(Ordering::Relaxed) != 0 && w.swap(0, Ordering::SeqCst) != 0 {
        futex_wake(w);
    }
}

/// Spins on `ready` for at most `budget_ns`, then sleeps on `word` until `ready` (looking again
/// after each wake and each [`BACKSTOP`]). `None`: it came while spinning; else how long after
/// the spin began it came, the side having slept.
fn wait(shm: &Shm, word: usize, budget_ns: u64, ready: impl Fn() -> bool) -> Option<Duration> {
    let start = Instant::now();
    let budget = Duration::from_nanos(budget_ns);
    let mut i = 0u32;
    loop {
        if ready() {
            return None;
        }
        std::hint::spin_loop();
        i = i.wrapping_add(1);
        if i.is_multiple_of(64) && start.elapsed() >= budget {
            break;
        }
    }
    let w = shm.u32_at(word);
    loop {
        w.store(1, Ordering::SeqCst);
        if ready() {
            w.store(0, Ordering::Relaxed);
            return Some(start.elapsed());
        }
        futex_wait(w, 1, BACKSTOP);
        if ready() {
            return Some(start.elapsed());
        }
    }
}

/// This side's writing end of one ring.
#[derive(Debug)]
pub(crate) struct Tx {
    link: Arc<Link>,
    ring: Layout,
    /// Our index (never read back from the mapping, which the peer may scribble over).
    head: AtomicU64,
}

impl Tx {
    /// Writes what the ring takes of `bytes` now, without waiting: how much (`BrokenPipe` once
    /// the peer is gone).
    pub(crate) fn send_now(&self, bytes: &[u8]) -> io::Result<usize> {
        let link = &*self.link;
        if link.gone.load(Ordering::Acquire) {
            return Err(io::Error::from(io::ErrorKind::BrokenPipe));
        }
        let head = self.head.load(Ordering::Relaxed);
        let tail = link.shm.u64_at(self.ring.tail()).load(Ordering::Acquire);
        let plan = plan_write(head, tail, RING_CAP, bytes.len()).map_err(|_| garbage())?;
        if plan.n == 0 {
            return Ok(0);
        }
        let mut done = 0;
        for (off, len) in plan.spans {
            link.shm
                .write(self.ring.data + off, &bytes[done..done + len]);
            done += len;
        }
        let head = head.wrapping_add(plan.n as u64);
        self.head.store(head, Ordering::Relaxed);
        link.shm
            .u64_at(self.ring.head())
            .store(head, Ordering::Release);
        wake(&link.shm, self.ring.reader_sleep());
        Ok(plan.n)
    }

    /// Writes all of `bytes`, waiting for room as long as the peer reads (an error once it is
    /// gone).
    pub(crate) fn write_all(&self, bytes: &[u8]) -> io::Result<()> {
        let mut done = 0;
        while done < bytes.len() {
            let n = self.send_now(&bytes[done..])?;
            done += n;
            if n == 0 {
                let link = &*self.link;
                let head = self.head.load(Ordering::Relaxed);
                wait(&link.shm, self.ring.writer_sleep(), Spin::MIN_NS, || {
                    let tail = link.shm.u64_at(self.ring.tail()).load(Ordering::Acquire);
                    // Room, or garbage: either way the next send says so.
                    link.gone.load(Ordering::Acquire)
                        || plan_write(head, tail, RING_CAP, 1).map_or(true, |p| p.n > 0)
                });
            }
        }
        Ok(())
    }
}

/// This side's reading end of one ring.
#[derive(Debug)]
pub(crate) struct Rx {
    link: Arc<Link>,
    ring: Layout,
    /// Our index (never read back from the mapping).
    tail: AtomicU64,
    /// How long [`wait`](Self::wait) spins now, in nanoseconds.
    spin: AtomicU64,
    /// The longest it spins.
    max_spin: u64,
}

impl Rx {
    /// The same end, spinning at most `ns` before it sleeps (a thread that shares its cores
    /// with the copies it waits for should not hold one long).
    pub(crate) fn with_max_spin(mut self, ns: u64) -> Self {
        self.max_spin = ns;
        self
    }

    /// Whether a read would not wait: bytes are there (or garbage is), or the end came.
    pub(crate) fn ready(&self) -> bool {
        let head = self
            .link
            .shm
            .u64_at(self.ring.head())
            .load(Ordering::Acquire);
        head != self.tail.load(Ordering::Relaxed) || self.link.eof.load(Ordering::Acquire)
    }

    /// Reads what the ring holds into `buf` without waiting: `Ok(0)` at the end (the peer shut
    /// its sending half and everything before was read), `WouldBlock` when nothing is there.
    pub(crate) fn recv_now(&self, buf: &mut [u8]) -> io::Result<usize> {
        let link = &*self.link;
        let tail = self.tail.load(Ordering::Relaxed);
        let eof = link.eof.load(Ordering::SeqCst);
        let head = link.shm.u64_at(self.ring.head()).load(Ordering::Acquire);
        let plan = plan_read(head, tail, RING_CAP, buf.len()).map_err(|_| garbage())?;
        if plan.n == 0 {
            return match (eof, buf.is_empty()) {
                (_, true) => Ok(0),
                (true, false) => Ok(0),
                (false, false) => Err(io::Error::from(io::ErrorKind::WouldBlock)),
            };
        }
        let mut done = 0;
        for (off, len) in plan.spans {
            link.shm
                .read(self.ring.data + off, &mut buf[done..done + len]);
            done += len;
        }
        let tail = tail.wrapping_add(plan.n as u64);
        self.tail.store(tail, Ordering::Relaxed);
        link.shm
            .u64_at(self.ring.tail())
            .store(tail, Ordering::Release);
        wake(&link.shm, self.ring.writer_sleep());
        Ok(plan.n)
    }

    /// Waits until a read would not wait: spins (adaptively), then sleeps on the futex.
    pub(crate) fn wait(&self) {
        let budget = self.spin.load(Ordering::Relaxed).min(self.max_spin);
        let slept = wait(&self.link.shm, self.ring.reader_sleep(), budget, || {
            self.ready()
        });
        let mut s = Spin::from_ns(budget);
        match slept {
            Some(waited) => s.missed(u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX)),
            None => s.hit(),
        }
        self.spin.store(s.budget_ns(), Ordering::Relaxed);
    }

    /// Parks this end's reader while `idle()` says no answer needs it (the tasks awaiting
    /// them spin and read them themselves) and the end has not come: it sleeps on its futex
    /// word left clear, so the peer's writes make no system call and wake nothing. Returns
    /// once `idle()` is false or the end came (the watcher wakes it), and looks again every
    /// [`BACKSTOP`]. Whoever makes `idle()` false then calls [`arm`](Self::arm).
    pub(crate) fn park_while(&self, idle: impl Fn() -> bool) {
        let w = self.link.shm.u32_at(self.ring.reader_sleep());
        loop {
            if !idle() || self.link.eof.load(Ordering::SeqCst) {
                return;
            }
            if w.load(Ordering::SeqCst) != 0 {
                // A wake asked for by an arm whose need has ended since: withdrawn, so that
                // the peer's next write does not wake this thread (then `idle()` looked at
                // again: an arm after it set the word after making `idle()` false).
                w.store(0, Ordering::SeqCst);
                continue;
            }
            futex_wait(w, 0, BACKSTOP);
        }
    }

    /// Asks the peer's next write to wake this end's reader, parked or not (after making the
    /// reader's `idle()` false); wakes it at once when bytes or the end are there already.
    pub(crate) fn arm(&self) {
        let w = self.link.shm.u32_at(self.ring.reader_sleep());
        w.store(1, Ordering::SeqCst);
        // The word set before the ring is looked at, as the writer publishes its bytes before
        // it looks at the word (its fence in `wake`): one of the two sees the other.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.ready() && w.swap(0, Ordering::SeqCst) != 0 {
            futex_wake(w);
        }
    }

    /// Reads at least one byte into `buf`, waiting for it: `Ok(0)` only at the end.
    pub(crate) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.recv_now(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => self.wait(),
                other => return other,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::{ANSWERS, REQUESTS, SHM_LEN};
    use crate::shm::{recv_fd, send_fd};

    /// Both sides of one stream in this process: (client tx, client rx), (server tx, server
    /// rx), and the sockets (client's, server's).
    fn pair() -> ((Tx, Rx), (Tx, Rx), (UnixStream, UnixStream)) {
        let (c, s) = UnixStream::pair().unwrap();
        let (shm, fd) = Shm::create(SHM_LEN).unwrap();
        send_fd(&s, 1, Some(&fd)).unwrap();
        let (_, got) = recv_fd(&c).unwrap();
        let theirs = Shm::adopt(&got.unwrap(), SHM_LEN).unwrap();
        let client = Link::start(theirs, &c, REQUESTS, ANSWERS).unwrap();
        let server = Link::start(shm, &s, ANSWERS, REQUESTS).unwrap();
        (client, server, (c, s))
    }

    #[test]
    fn requests_and_answers_cross_both_ways_in_order_past_the_ring_s_size() {
        let ((ctx, crx), (stx, srx), _socks) = pair();
        let total = 3 * RING_CAP + 123;
        let echo = std::thread::spawn(move || {
            let mut buf = vec![0u8; 10_000];
            let mut seen = 0;
            while seen < total {
                let n = srx.read(&mut buf).unwrap();
                assert!(n > 0);
                stx.write_all(&buf[..n]).unwrap();
                seen += n;
            }
        });
        let data: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
        let mut sent = 0;
        let mut back = Vec::with_capacity(total);
        let mut buf = vec![0u8; 7777];
        while back.len() < total {
            if sent < total {
                sent += ctx.send_now(&data[sent..]).unwrap();
            }
            match crx.recv_now(&mut buf) {
                Ok(n) => back.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::hint::spin_loop(),
                Err(e) => panic!("{e}"),
            }
        }
        assert!(back == data);
        echo.join().unwrap();
    }

    #[test]
    fn a_sleeping_reader_sees_a_shut_sending_half_then_a_hang_up() {
        let ((ctx, _crx), (_stx, srx), (c, _s)) = pair();
        ctx.send_now(b"last").unwrap();
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 16];
            let n = srx.read(&mut buf).unwrap();
            assert_eq!(&buf[..n], b"last");
            // Sleeps (nothing more comes) until the socket's half is shut.
            srx.read(&mut buf).unwrap()
        });
        c.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(reader.join().unwrap(), 0);
        c.shutdown(std::net::Shutdown::Both).unwrap();
        let until = Instant::now() + Duration::from_secs(20);
        while ctx.send_now(b"x").is_ok() {
            assert!(Instant::now() < until, "the hang-up was never seen");
            std::thread::yield_now();
        }
    }

    /// Waits (at most 20 s) until `cond`.
    fn until(what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !cond() {
            assert!(Instant::now() < deadline, "never: {what}");
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_parked_reader_costs_the_writer_no_wake_until_it_is_armed() {
        let ((_ctx, crx), (stx, _srx), _socks) = pair();
        let crx = Arc::new(crx);
        let word = || {
            crx.link
                .shm
                .u32_at(ANSWERS.reader_sleep())
                .load(Ordering::SeqCst)
        };
        // An arm left from before (its request resolved since): the parked reader withdraws it.
        let needed = Arc::new(AtomicBool::new(false));
        crx.arm();
        assert_eq!(word(), 1);
        let parked = {
            let (crx, needed) = (crx.clone(), needed.clone());
            std::thread::spawn(move || crx.park_while(|| !needed.load(Ordering::SeqCst)))
        };
        until("the stale arm withdrawn", || word() == 0);
        // Answers while it is parked: no futex call on the writer's side.
        let before = crate::shm::WAKES.with(|w| w.get());
        for _ in 0..100 {
            assert_eq!(stx.send_now(b"answer").unwrap(), 6);
        }
        assert_eq!(crate::shm::WAKES.with(|w| w.get()), before);
        assert!(!parked.is_finished());
        // Needed again, with answers already there: the arm wakes it at once.
        needed.store(true, Ordering::SeqCst);
        crx.arm();
        until("the armed reader back", || parked.is_finished());
        parked.join().unwrap();
    }

    #[test]
    fn an_armed_reader_is_woken_by_the_next_write_and_a_parked_one_by_the_end() {
        let ((_ctx, crx), (stx, _srx), (_c, s)) = pair();
        let crx = Arc::new(crx);
        let needed = Arc::new(AtomicBool::new(false));
        let reader = {
            let (crx, needed) = (crx.clone(), needed.clone());
            std::thread::spawn(move || {
                crx.park_while(|| !needed.load(Ordering::SeqCst));
                // Armed and nothing there yet: it waits for the write.
                let mut buf = [0u8; 8];
                let n = crx.read(&mut buf).unwrap();
                buf[..n].to_vec()
            })
        };
        needed.store(true, Ordering::SeqCst);
        crx.arm();
        stx.write_all(b"late").unwrap();
        assert_eq!(reader.join().unwrap(), b"late");
        // Parked for good, until the peer shuts its sending half.
        needed.store(false, Ordering::SeqCst);
        let parked = {
            let crx = crx.clone();
            std::thread::spawn(move || crx.park_while(|| true))
        };
        s.shutdown(std::net::Shutdown::Write).unwrap();
        until("the end seen by the parked reader", || parked.is_finished());
        parked.join().unwrap();
    }

    #[test]
    fn garbage_indices_fail_the_read_and_the_write_instead_of_reaching_out_of_bounds() {
        let ((ctx, crx), (_stx, _srx), _socks) = pair();
        // The "server" scribbles: an answers head far past the tail, a requests tail ahead.
        let shm = &crx.link.shm;
        shm.u64_at(ANSWERS.head())
            .store(u64::MAX / 3, Ordering::Release);
        shm.u64_at(REQUESTS.tail()).store(12345, Ordering::Release);
        let e = crx.recv_now(&mut [0u8; 64]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        let e = ctx.send_now(b"hello").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    }
}

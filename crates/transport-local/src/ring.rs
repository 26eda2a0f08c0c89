//! The request/answer ring's protocol, free of I/O: where a byte ring's reader and writer may
//! copy, given the indices they see, and how long an idle side spins before it sleeps.
//!
//! A stream on the ring shares one memfd between client and server ([`Layout`]): two byte
//! rings, requests (client to server) and answers (server to client), each a data area of
//! [`RING_CAP`] bytes and a header of two free-running `u64` indices (`head`, written only by
//! the ring's writer; `tail`, written only by its reader) and two futex words (the reader
//! asleep, the writer asleep). Bytes `tail..head` (mod the capacity) are readable.
//!
//! The memfd is shared with an untrusted process: whatever it writes into the other side's
//! index is *garbage* unless `head - tail` (wrapping) is at most the capacity, and each side
//! keeps its own index privately (it never reads it back from the mapping). [`plan_read`] and
//! [`plan_write`] turn a seen index into at most two spans that lie inside the data area, or
//! [`Garbage`]; a side that sees garbage ends the stream. No index a peer writes can make a side
//! touch a byte outside the mapping.

/// Bytes of one ring's data area (a power of two).
pub(crate) const RING_CAP: usize = 256 << 10;

/// Where things lie in the shared memfd (offsets in bytes; each index and futex word on a line
/// of its own, so that the two sides do not share a cache line they both write).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Offset of the ring's header: `head` at +0, `tail` at +[`LINE`], the reader's futex word
    /// at +2 lines, the writer's at +3 lines.
    pub(crate) header: usize,
    /// Offset of its data area ([`RING_CAP`] bytes).
    pub(crate) data: usize,
}

/// A cache line (two, on machines that prefetch pairs).
pub(crate) const LINE: usize = 128;

/// The requests' ring (the client writes, the server reads).
pub(crate) const REQUESTS: Layout = Layout {
    header: 0,
    data: 4096,
};

/// The answers' ring (the server writes, the client reads).
pub(crate) const ANSWERS: Layout = Layout {
    header: 4 * LINE,
    data: 4096 + RING_CAP,
};

/// Bytes of the whole memfd.
pub(crate) const SHM_LEN: usize = 4096 + 2 * RING_CAP;

// The two headers fit the first page, apart; the data areas follow it, apart, inside the memfd.
const _: () = {
    assert!(RING_CAP.is_power_of_two());
    assert!(REQUESTS.header + 4 * LINE <= ANSWERS.header);
    assert!(ANSWERS.header + 4 * LINE <= 4096);
    assert!(REQUESTS.data >= 4096 && REQUESTS.data + RING_CAP <= ANSWERS.data);
    assert!(ANSWERS.data + RING_CAP <= SHM_LEN);
    assert!(LINE.is_multiple_of(8));
};

impl Layout {
    /// Offset of `head`.
    pub(crate) fn head(self) -> usize {
        self.header
    }
    /// Offset of `tail`.
    pub(crate) fn tail(self) -> usize {
        self.header + LINE
    }
    /// Offset of the futex word a sleeping reader waits on.
    pub(crate) fn reader_sleep(self) -> usize {
        self.header + 2 * LINE
    }
    /// Offset of the futex word a sleeping writer waits on.
    pub(crate) fn writer_sleep(self) -> usize {
        self.header + 3 * LINE
    }
}

/// The other side wrote indices no ring of this capacity can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Garbage;

/// At most two spans of the data area (offset, length) to copy, `n` bytes in all: the second
/// is empty unless the bytes wrap around the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) spans: [(usize, usize); 2],
    pub(crate) n: usize,
}

/// Bytes between `tail` and `head` in a ring of `cap` bytes, or [`Garbage`].
pub(crate) fn used(head: u64, tail: u64, cap: usize) -> Result<usize, Garbage> {
    let d = head.wrapping_sub(tail);
    if d > cap as u64 {
        return Err(Garbage);
    }
    Ok(d as usize)
}

/// The spans of `n` bytes from index `at` (`n` at most `cap`, `cap` a power of two).
fn spans(at: u64, n: usize, cap: usize) -> Plan {
    let off = (at as usize) & (cap - 1);
    let first = n.min(cap - off);
    Plan {
        spans: [(off, first), (0, n - first)],
        n,
    }
}

/// A reader whose own index is `tail` and who sees `head`: where up to `want` bytes are.
pub(crate) fn plan_read(head: u64, tail: u64, cap: usize, want: usize) -> Result<Plan, Garbage> {
    let n = used(head, tail, cap)?.min(want);
    Ok(spans(tail, n, cap))
}

/// A writer whose own index is `head` and who sees `tail`: where up to `want` bytes go.
pub(crate) fn plan_write(head: u64, tail: u64, cap: usize, want: usize) -> Result<Plan, Garbage> {
    let free = cap - used(head, tail, cap)?;
    Ok(spans(head, free.min(want), cap))
}

/// How long an idle side spins before it sleeps on its futex: adapted to what happened,
/// doubled (to `MAX_NS`) when the bytes came while it spun; when it had to sleep, grown to
/// twice the wait where the bytes came within `MAX_NS` of the spin's start (a longer spin
/// would have caught them, without the sleep and the wake-up), halved (to `MIN_NS`) where
/// they came later. A side woken by a busy peer keeps spinning; a side whose peer is idle soon
/// sleeps at once; and two sides that both slept between quick answers (each waiting out the
/// other's wake-up) spin again, instead of each halving the other's spin for good.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Spin {
    ns: u64,
}

impl Spin {
    /// Shortest spin.
    pub(crate) const MIN_NS: u64 = 500;
    /// Longest spin.
    pub(crate) const MAX_NS: u64 = 50_000;

    /// A spin of `MAX_NS / 2` to start.
    pub(crate) fn new() -> Self {
        Self {
            ns: Self::MAX_NS / 2,
        }
    }

    /// A spin of `ns` (kept within the bounds).
    pub(crate) fn from_ns(ns: u64) -> Self {
        Self {
            ns: ns.clamp(Self::MIN_NS, Self::MAX_NS),
        }
    }

    /// How long to spin now.
    pub(crate) fn budget_ns(self) -> u64 {
        self.ns
    }

    /// The bytes came while spinning.
    pub(crate) fn hit(&mut self) {
        self.ns = (self.ns * 2).min(Self::MAX_NS);
    }

    /// The spin ran out: the side slept, and what it waited for came `waited_ns` after the
    /// spin began.
    pub(crate) fn missed(&mut self, waited_ns: u64) {
        self.ns = if waited_ns <= Self::MAX_NS {
            waited_ns.saturating_mul(2).max(self.ns.saturating_mul(2))
        } else {
            self.ns / 2
        }
        .clamp(Self::MIN_NS, Self::MAX_NS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring in a plain buffer, driven only by the plans: what the shared one does.
    struct Model {
        buf: Vec<u8>,
        head: u64,
        tail: u64,
    }

    impl Model {
        fn new(cap: usize, start: u64) -> Self {
            Self {
                buf: vec![0; cap],
                head: start,
                tail: start,
            }
        }
        fn write(&mut self, bytes: &[u8]) -> usize {
            let p = plan_write(self.head, self.tail, self.buf.len(), bytes.len()).unwrap();
            let mut done = 0;
            for (off, len) in p.spans {
                self.buf[off..off + len].copy_from_slice(&bytes[done..done + len]);
                done += len;
            }
            self.head = self.head.wrapping_add(p.n as u64);
            p.n
        }
        fn read(&mut self, out: &mut [u8]) -> usize {
            let p = plan_read(self.head, self.tail, self.buf.len(), out.len()).unwrap();
            let mut done = 0;
            for (off, len) in p.spans {
                out[done..done + len].copy_from_slice(&self.buf[off..off + len]);
                done += len;
            }
            self.tail = self.tail.wrapping_add(p.n as u64);
            p.n
        }
    }

    #[test]
    fn bytes_come_out_in_order_across_the_wrap_and_the_index_overflow() {
        // Indices start just below u64::MAX: they overflow during the test.
        let mut r = Model::new(64, u64::MAX - 100);
        let mut next = 0u8;
        let mut expect = 0u8;
        for round in 0..200 {
            let chunk: Vec<u8> = (0..(round % 50) + 1)
                .map(|_| {
                    next = next.wrapping_add(1);
                    next
                })
                .collect();
            let took = r.write(&chunk);
            next = next.wrapping_sub((chunk.len() - took) as u8);
            let mut out = vec![0u8; (round % 37) + 1];
            let n = r.read(&mut out);
            for b in &out[..n] {
                expect = expect.wrapping_add(1);
                assert_eq!(*b, expect);
            }
        }
    }

    #[test]
    fn a_full_ring_takes_nothing_and_an_empty_one_gives_nothing() {
        let mut r = Model::new(16, 5);
        assert_eq!(r.read(&mut [0u8; 4]), 0);
        assert_eq!(r.write(&[1u8; 20]), 16);
        assert_eq!(r.write(&[2u8; 1]), 0);
        let mut out = [0u8; 16];
        assert_eq!(r.read(&mut out), 16);
        assert_eq!(out, [1u8; 16]);
        assert_eq!(r.read(&mut out), 0);
    }

    #[test]
    fn indices_further_apart_than_the_ring_are_garbage() {
        assert_eq!(plan_read(100, 0, 64, 8), Err(Garbage));
        // A head behind the tail: the wrapping distance is huge.
        assert_eq!(plan_read(0, 1, 64, 8), Err(Garbage));
        assert_eq!(plan_write(10, 11, 64, 8), Err(Garbage));
        assert_eq!(plan_write(u64::MAX, 0, 64, 8), Err(Garbage));
        // The largest honest distance is the capacity itself.
        assert_eq!(plan_read(64, 0, 64, 100).unwrap().n, 64);
        assert_eq!(plan_write(64, 0, 64, 100).unwrap().n, 0);
    }

    /// Whatever indices a peer writes, a plan lies inside the data area: a pseudo-random sweep
    /// over both sides' indices, near the edges and anywhere.
    #[test]
    fn no_index_a_peer_writes_plans_a_span_outside_the_ring() {
        let cap = 4096usize;
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let edges = [
            0u64,
            1,
            4095,
            4096,
            4097,
            u64::MAX,
            u64::MAX - 4096,
            1 << 63,
        ];
        for i in 0..200_000 {
            let a = if i % 3 == 0 {
                edges[(rnd() % edges.len() as u64) as usize]
            } else {
                rnd()
            };
            let b = if i % 5 == 0 {
                a.wrapping_sub(rnd() % 5000)
            } else {
                rnd()
            };
            let want = (rnd() % 10_000) as usize;
            for plan in [plan_read(a, b, cap, want), plan_write(a, b, cap, want)]
                .into_iter()
                .flatten()
            {
                let mut total = 0;
                for (off, len) in plan.spans {
                    assert!(off + len <= cap, "{a} {b}: span {off}+{len}");
                    total += len;
                }
                assert_eq!(total, plan.n);
                assert!(plan.n <= want.min(cap));
            }
        }
    }

    #[test]
    fn the_spin_grows_while_the_peer_is_busy_and_shrinks_while_it_idles() {
        let mut s = Spin::new();
        for _ in 0..20 {
            s.missed(Spin::MAX_NS + 1);
        }
        assert_eq!(s.budget_ns(), Spin::MIN_NS);
        for _ in 0..20 {
            s.hit();
        }
        assert_eq!(s.budget_ns(), Spin::MAX_NS);
    }

    /// Both sides at the shortest spin, each answer coming a wake-up (about 10 us here) after
    /// the other slept: each side's next spin covers that wait, so the pair spins again rather
    /// than each keeping the other asleep.
    #[test]
    fn a_spin_that_missed_by_a_wake_up_grows_to_cover_it() {
        let mut s = Spin::from_ns(Spin::MIN_NS);
        s.missed(10_000);
        assert_eq!(s.budget_ns(), 20_000);
        // A wait just past the spin: doubled at least.
        let mut s = Spin::from_ns(8_000);
        s.missed(8_100);
        assert_eq!(s.budget_ns(), 16_200);
        let mut s = Spin::from_ns(30_000);
        s.missed(Spin::MAX_NS);
        assert_eq!(s.budget_ns(), Spin::MAX_NS);
        // An idle peer (past the longest spin): halved.
        let mut s = Spin::from_ns(30_000);
        s.missed(Spin::MAX_NS + 1);
        assert_eq!(s.budget_ns(), 15_000);
    }
}

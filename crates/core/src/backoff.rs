//! Reconnect backoff: bounded exponential growth with full jitter, on a seeded generator (no
//! clock, no I/O: the caller sleeps).
//!
//! Attempt `n` (from 0) waits a uniformly random time in `0..=min(max, base * 2^n)` ("full
//! jitter"): when many clients lose the same server at once, their retries spread over the
//! whole window instead of arriving together at each step.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The delays before successive reconnect attempts of one peer.
#[derive(Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    attempt: u32,
    rng: StdRng,
}

impl Backoff {
    /// Delays growing from `base` (at least 1 ms) to at most `max` (at least `base`), jittered by a
    /// generator seeded with `seed` (the same seed gives the same delays).
    pub fn new(base: Duration, max: Duration, seed: u64) -> Self {
        let base = base.max(Duration::from_millis(1));
        Self {
            base,
            max: max.max(base),
            attempt: 0,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// As [`Backoff::new`], seeded at random (each client its own jitter).
    pub fn random(base: Duration, max: Duration) -> Self {
        Self::new(base, max, rand::random())
    }

    /// The longest delay attempt `n` may wait: `min(max, base * 2^n)`.
    pub fn ceiling(&self, n: u32) -> Duration {
        let factor = 1u32.checked_shl(n.min(31)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }

    /// The delay before the next attempt, and counts it.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.ceiling(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        let nanos = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(self.rng.gen_range(0..=nanos))
    }

    /// Delays handed out so far.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn delays_stay_under_a_ceiling_that_doubles_up_to_the_bound() {
        let mut b = Backoff::new(10 * MS, 1000 * MS, 7);
        let ceilings: Vec<Duration> = (0..10).map(|n| b.ceiling(n)).collect();
        assert_eq!(
            ceilings,
            [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000].map(|m| m * MS)
        );
        assert_eq!(b.ceiling(u32::MAX), 1000 * MS);
        for n in 0..200 {
            let d = b.next_delay();
            assert!(d <= b.ceiling(n), "attempt {n}: {d:?}");
        }
        assert_eq!(b.attempts(), 200);
    }

    #[test]
    fn the_same_seed_gives_the_same_delays() {
        let run = |seed| {
            let mut b = Backoff::new(5 * MS, 500 * MS, seed);
            (0..20).map(|_| b.next_delay()).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    /// Full jitter: a thousand clients that lost the same server at once spread their first
    /// retries over the whole window rather than bunching (each tenth of it gets some, none
    /// gets a third).
    #[test]
    fn a_thousand_clients_spread_their_retries() {
        let window = 100 * MS;
        let mut buckets = [0u32; 10];
        for seed in 0..1000 {
            let mut b = Backoff::new(window, window, seed);
            let d = b.next_delay();
            assert!(d <= window);
            let k = ((d.as_nanos() * 10) / (window.as_nanos() + 1)) as usize;
            buckets[k] += 1;
        }
        assert!(buckets.iter().all(|&n| n > 0 && n < 333), "{buckets:?}");
    }

    #[test]
    fn degenerate_settings_are_bounded() {
        let mut b = Backoff::new(Duration::ZERO, Duration::ZERO, 1);
        assert_eq!(b.ceiling(0), MS);
        assert!(b.next_delay() <= MS);
        let mut b = Backoff::new(Duration::from_secs(u64::MAX / 4), Duration::MAX, 1);
        for _ in 0..40 {
            b.next_delay();
        }
    }
}

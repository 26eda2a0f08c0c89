//! A fixed-size latency histogram: `ferry bench` keeps its memory flat however long it runs.
//!
//! Values below 128 (microseconds) are counted exactly; above, each power of two is split into 64
//! buckets, so a reported percentile is within 1.6% of the true value. 1,728 counters cover the
//! whole `u32` range.

/// Counts of latencies in microseconds.
#[derive(Clone, Debug)]
pub(crate) struct Histogram {
    counts: Vec<u64>,
    total: u64,
}

const EXACT: usize = 128;
const SUB: usize = 64;
const BUCKETS: usize = EXACT + 25 * SUB;

fn index(v: u32) -> usize {
    if (v as usize) < EXACT {
        return v as usize;
    }
    let log2 = 31 - v.leading_zeros() as usize; // 7..=31
    let shift = log2 - 6; // keeps the top 7 bits: 64..=127
    let top = (v >> shift) as usize;
    EXACT + (shift - 1) * SUB + (top - SUB)
}

/// The midpoint of bucket `i`.
fn value(i: usize) -> f64 {
    if i < EXACT {
        return i as f64;
    }
    let shift = (i - EXACT) / SUB + 1;
    let top = ((i - EXACT) % SUB + SUB) as f64;
    let width = (1u64 << shift) as f64;
    top * width + (width - 1.0) / 2.0
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            counts: vec![0; BUCKETS],
            total: 0,
        }
    }
}

impl Histogram {
    /// Counts one value.
    pub(crate) fn record(&mut self, v: u32) {
        self.counts[index(v)] += 1;
        self.total += 1;
    }

    /// Adds another histogram's counts.
    pub(crate) fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
    }

    /// Values counted.
    pub(crate) fn len(&self) -> u64 {
        self.total
    }

    /// The value at quantile `p` (0 to 1): the smallest bucket whose cumulative count reaches
    /// `p` of the total; 0 when empty.
    pub(crate) fn percentile(&self, p: f64) -> f64 {
        if self.total == 0 {
            return 0.0;
        }
        let want = ((self.total as f64 * p).ceil() as u64).clamp(1, self.total);
        let mut seen = 0u64;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= want {
                return value(i);
            }
        }
        value(BUCKETS - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_u32_in_order() {
        let mut last = 0;
        for v in [
            0u32,
            1,
            127,
            128,
            129,
            255,
            256,
            1000,
            65_535,
            1 << 20,
            u32::MAX,
        ] {
            let i = index(v);
            assert!(i < BUCKETS && i >= last, "{v} -> {i}");
            last = i;
            let mid = value(i);
            assert!(
                (mid - f64::from(v)).abs() <= f64::from(v) * 0.016 + 0.5,
                "{v}: bucket midpoint {mid}"
            );
        }
        assert_eq!(index(u32::MAX), BUCKETS - 1);
    }

    #[test]
    fn percentiles_of_a_known_spread() {
        let mut h = Histogram::default();
        assert_eq!(h.percentile(0.5), 0.0);
        for v in 1..=100u32 {
            h.record(v);
        }
        assert_eq!(h.len(), 100);
        assert_eq!(h.percentile(0.5), 50.0);
        assert_eq!(h.percentile(0.99), 99.0);
        let mut big = Histogram::default();
        for _ in 0..1000 {
            big.record(10_000);
        }
        h.merge(&big);
        let p99 = h.percentile(0.99);
        assert!((p99 - 10_000.0).abs() < 160.0, "{p99}");
        assert_eq!(h.len(), 1100);
    }
}

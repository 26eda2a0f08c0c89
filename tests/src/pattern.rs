//! Bytes whose every position is known: a buffer filled from a seed can be checked anywhere, so
//! a fault test or a soak can tell a byte that arrived from one that did not, and both from a
//! corrupted one. Position `p` of pattern `seed` is byte `p % 8` of `splitmix64(seed + p / 8)`;
//! the *inverse* pattern is its complement, which differs from it at every byte (what a region
//! held before a WRITE of the pattern, so that each byte after it is plainly old or new).

/// The byte at absolute position `pos` of pattern `seed`.
pub fn byte_at(seed: u64, pos: u64) -> u8 {
    word(seed, pos / 8).to_le_bytes()[(pos % 8) as usize]
}

fn word(seed: u64, index: u64) -> u64 {
    let mut z = seed.wrapping_add(index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `buf` with pattern `seed` as found at positions `offset..offset + buf.len()`.
pub fn fill(buf: &mut [u8], seed: u64, offset: u64) {
    fill_with(buf, seed, offset, 0);
}

/// Fills `buf` with the inverse of pattern `seed` (every byte complemented).
pub fn fill_inverse(buf: &mut [u8], seed: u64, offset: u64) {
    fill_with(buf, seed, offset, 0xff);
}

/// Pattern `seed` from position `offset` on, one splitmix word per 8 bytes.
fn stream(seed: u64, offset: u64) -> impl Iterator<Item = u8> {
    (offset..).scan([0u8; 8], move |w, pos| {
        if pos == offset || pos % 8 == 0 {
            *w = word(seed, pos / 8).to_le_bytes();
        }
        Some(w[(pos % 8) as usize])
    })
}

fn fill_with(buf: &mut [u8], seed: u64, offset: u64, xor: u8) {
    for (b, p) in buf.iter_mut().zip(stream(seed, offset)) {
        *b = p ^ xor;
    }
}

/// The first position (relative to `buf`) whose byte is not pattern `seed` at `offset`, if any.
pub fn first_mismatch(buf: &[u8], seed: u64, offset: u64) -> Option<usize> {
    buf.iter()
        .zip(stream(seed, offset))
        .position(|(&b, p)| b != p)
}

/// What a region holds after a WRITE of pattern `seed` into one that held its inverse.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mix {
    /// Bytes of the new pattern.
    pub new: u64,
    /// Bytes still of the inverse (old) pattern.
    pub old: u64,
    /// The first byte that is neither (corruption), relative to the buffer.
    pub corrupt_at: Option<usize>,
}

/// Counts new and old bytes of `buf` (see [`Mix`]).
pub fn mix(buf: &[u8], seed: u64, offset: u64) -> Mix {
    let mut m = Mix::default();
    for (i, (&b, want)) in buf.iter().zip(stream(seed, offset)).enumerate() {
        if b == want {
            m.new += 1;
        } else if b == !want {
            m.old += 1;
        } else if m.corrupt_at.is_none() {
            m.corrupt_at = Some(i);
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pattern_checks_anywhere_and_tells_old_new_and_corrupt_apart() {
        let mut whole = vec![0u8; 100];
        fill(&mut whole, 7, 1000);
        let mut part = vec![0u8; 13];
        fill(&mut part, 7, 1037);
        assert_eq!(&whole[37..50], &part[..]);
        assert_eq!(first_mismatch(&whole, 7, 1000), None);
        assert_eq!(first_mismatch(&whole, 8, 1000).map(|i| i < 8), Some(true));
        let mut region = vec![0u8; 64];
        fill_inverse(&mut region, 7, 0);
        fill(&mut region[..20], 7, 0);
        assert_eq!(
            mix(&region, 7, 0),
            Mix {
                new: 20,
                old: 44,
                corrupt_at: None
            }
        );
        region[30] = region[30].wrapping_add(1);
        assert_eq!(mix(&region, 7, 0).corrupt_at, Some(30));
    }
}

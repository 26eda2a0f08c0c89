//! The user data of a ring operation: one encoding for the client's and the server's rings, so
//! that no completion can be read as another kind of operation.
//!
//! - Bit 63 set: a zero-copy send; bits 0..63 are its key, from the ring's 64-bit counter
//!   (which counts one per send and never reaches 2^63).
//! - Bit 63 clear: bits 0..24 the stream's slot, bits 24..32 the operation's kind (never 0),
//!   bits 32..63 the slot's generation (31 bits, see [`next_generation`]).

/// The tag of a zero-copy send's user data.
pub(crate) const ZC: u64 = 1 << 63;
/// Bits of a slot: a ring names at most this many streams at once.
const SLOT_BITS: u32 = 24;
/// Streams one ring can name.
pub(crate) const MAX_SLOTS: usize = 1 << SLOT_BITS;
const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;
const KIND_SHIFT: u32 = SLOT_BITS;
const KIND_MASK: u64 = 0xff << KIND_SHIFT;
const GENERATION_SHIFT: u32 = 32;
/// The generations a slot counts through (31 bits).
pub(crate) const GENERATION_MASK: u32 = (1 << 31) - 1;

// The fields are disjoint, and together with the tag they cover all 64 bits.
const _: () = {
    let generation = (GENERATION_MASK as u64) << GENERATION_SHIFT;
    assert!(SLOT_MASK & KIND_MASK == 0);
    assert!((SLOT_MASK | KIND_MASK) & generation == 0);
    assert!((SLOT_MASK | KIND_MASK | generation) & ZC == 0);
    assert!(SLOT_MASK | KIND_MASK | generation | ZC == u64::MAX);
};

/// What a completion's user data names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decoded {
    /// A zero-copy send, by key.
    Zc(u64),
    /// An operation of `kind` of the stream in `slot` at `generation`.
    Op {
        kind: u8,
        slot: usize,
        generation: u32,
    },
}

/// The user data of operation `kind` (not 0) of the stream in `slot` (below [`MAX_SLOTS`])
/// at `generation` (at most [`GENERATION_MASK`]).
pub(crate) fn op(kind: u8, slot: usize, generation: u32) -> u64 {
    debug_assert!(kind != 0 && slot < MAX_SLOTS && generation <= GENERATION_MASK);
    (u64::from(generation & GENERATION_MASK) << GENERATION_SHIFT)
        | (u64::from(kind) << KIND_SHIFT)
        | (slot as u64 & SLOT_MASK)
}

/// The user data of zero-copy send `key` (below 2^63).
pub(crate) fn zc(key: u64) -> u64 {
    debug_assert!(key < ZC);
    ZC | (key & !ZC)
}

/// Reads user data made by [`op`] or [`zc`].
pub(crate) fn decode(u: u64) -> Decoded {
    if u & ZC != 0 {
        return Decoded::Zc(u & !ZC);
    }
    Decoded::Op {
        kind: ((u & KIND_MASK) >> KIND_SHIFT) as u8,
        slot: (u & SLOT_MASK) as usize,
        generation: (u >> GENERATION_SHIFT) as u32 & GENERATION_MASK,
    }
}

/// The generation after `g` (wrapping within [`GENERATION_MASK`]).
pub(crate) fn next_generation(g: u32) -> u32 {
    g.wrapping_add(1) & GENERATION_MASK
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_round_trips_at_its_extremes_and_none_reads_as_a_zero_copy_send() {
        for kind in [1u8, 2, 0x7f, 0xff] {
            for slot in [0, 1, MAX_SLOTS / 2, MAX_SLOTS - 1] {
                for generation in [0, 1, 1 << 30, (1 << 30) + 5, GENERATION_MASK] {
                    let u = op(kind, slot, generation);
                    assert_eq!(
                        decode(u),
                        Decoded::Op {
                            kind,
                            slot,
                            generation
                        },
                        "kind {kind} slot {slot} generation {generation:#x}"
                    );
                }
            }
        }
        for key in [0, 1, u64::from(u32::MAX), u64::from(u32::MAX) + 1, ZC - 1] {
            assert_eq!(decode(zc(key)), Decoded::Zc(key));
        }
    }

    #[test]
    fn generations_wrap_within_their_bits() {
        assert_eq!(next_generation(GENERATION_MASK), 0);
        assert_eq!(next_generation(5), 6);
        let u = op(1, 3, next_generation(GENERATION_MASK - 1));
        assert_eq!(u & ZC, 0);
    }
}

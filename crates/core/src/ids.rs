//! Identifiers: peers, epochs, segment tokens, and access rights.

use std::fmt;

/// The identity of one engine instance (random, 128 bits).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u128);

impl PeerId {
    /// A fresh random peer id.
    pub fn random() -> Self {
        Self(rand::random())
    }
}

impl fmt::Debug for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerId({:032x})", self.0)
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// The epoch an engine instance chose at start. A restarted process gets a new epoch, never an old
/// one, so descriptors taken from a previous incarnation are refused (`StaleEpoch`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct Epoch(pub u64);

impl Epoch {
    /// A fresh epoch: the wall clock in nanoseconds in the high bits, random low bits, so that two
    /// starts of the same process (even within one nanosecond) never share an epoch.
    pub fn fresh() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        Self((nanos & !0xffff) | u64::from(rand::random::<u16>()))
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// The token under which a published segment is visible to peers: random and unguessable. An
/// unknown token is indistinguishable from a retired one.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentToken(pub u64);

impl SegmentToken {
    /// A fresh random token (never zero).
    pub fn random() -> Self {
        loop {
            let v: u64 = rand::random();
            if v != 0 {
                return Self(v);
            }
        }
    }
}

impl fmt::Debug for SegmentToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SegmentToken({:016x})", self.0)
    }
}

impl fmt::Display for SegmentToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

bitflags::bitflags! {
    /// What peers may do to a registered range. Local access is always allowed.
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
    pub struct Access: u8 {
        /// Peers may READ the range.
        const REMOTE_READ = 0b01;
        /// Peers may WRITE the range.
        const REMOTE_WRITE = 0b10;
    }
}

impl Access {
    /// Local use only: the range is never published to peers.
    pub const LOCAL: Access = Access::empty();

    /// Whether peers can reach the range at all.
    pub fn is_remote(self) -> bool {
        !self.is_empty()
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (
            self.contains(Access::REMOTE_READ),
            self.contains(Access::REMOTE_WRITE),
        ) {
            (true, true) => f.write_str("read+write"),
            (true, false) => f.write_str("read"),
            (false, true) => f.write_str("write"),
            (false, false) => f.write_str("local"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_nonzero_and_distinct() {
        let a = SegmentToken::random();
        let b = SegmentToken::random();
        assert_ne!(a.0, 0);
        assert_ne!(a, b);
    }

    #[test]
    fn epochs_differ_between_starts() {
        assert_ne!(Epoch::fresh(), Epoch::fresh());
    }

    #[test]
    fn access_display() {
        assert_eq!(
            (Access::REMOTE_READ | Access::REMOTE_WRITE).to_string(),
            "read+write"
        );
        assert_eq!(Access::LOCAL.to_string(), "local");
        assert!(!Access::LOCAL.is_remote());
    }
}

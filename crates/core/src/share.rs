//! Shared registrations: the decisions about handing a peer on this host the memory of a
//! registration itself (a memfd it maps and copies with one-sidedly), with no I/O.
//!
//! Memory Ferry allocates may live in a memfd ([`crate::MemoryRegion::alloc_shareable`]). A
//! same-host peer that asks for it is granted the memfd of that one registration, or refused
//! and served as before (the owner copies). [`ShareState`] decides, and says what the driver
//! must do to the memfd first (seal it) and at the end (discard its bytes):
//!
//! - only a segment published to the asking peer (its view resolves the token) is granted;
//! - a segment peers may read and write is granted read-write; one they may only read is
//!   granted read-only; one they may only write is refused (a mapping cannot be write-only);
//! - the first grant fixes the memfd's mode for good. Read-only: the memfd is sealed against
//!   every future write (`F_SEAL_FUTURE_WRITE`, then `F_SEAL_SEAL`), so no descriptor of it, in
//!   any process, maps it writable again (the owner's own mapping, made before, still writes).
//!   Read-write: the seals are closed (`F_SEAL_SEAL`), so no grantee can seal the owner out. A
//!   later grant of the other mode is refused (the owner copies for that peer);
//! - once revoked (the registration's memory freed), nothing is granted, and the memfd's bytes
//!   are discarded: punched out of a read-write memfd (a late access reads zeros), zeroed
//!   through the owner's mapping in a read-only one (whose seal forbids punching). Its size
//!   never changes (sealed against shrinking and growing from the start), so a late access
//!   never faults.

use crate::Access;

/// How a registration's memfd has been handed out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ShareMode {
    /// To no one yet.
    #[default]
    Unshared,
    /// Read-only grants: sealed against every future write.
    ReadOnly,
    /// Read-write grants: its seals closed.
    ReadWrite,
}

/// What a peer is granted: the memfd mapped read-only, or read-write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grant {
    /// `PROT_READ`, on a memfd sealed against writes.
    ReadOnly,
    /// `PROT_READ | PROT_WRITE`.
    ReadWrite,
}

/// Why a peer is not given a registration's memfd (it is then served by the owner's copies).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShareRefusal {
    /// The token names nothing published to this peer (or nothing at all, or a retired one).
    #[error("no segment under that token is published to this peer")]
    NotVisible,
    /// The memory is not Ferry's own memfd (the user's memory keeps the owner's copies).
    #[error("the segment's memory is not shareable (not allocated by Ferry in a memfd)")]
    NotShareable,
    /// Peers may neither read it nor read and write it (a mapping cannot be write-only).
    #[error("peers may not read the segment (a write-only segment is not mapped)")]
    NotReadable,
    /// Granted read-only before: sealed against writes for good.
    #[error("the memory is shared read-only (sealed against writes)")]
    SealedReadOnly,
    /// Granted read-write before: a read-only grant could reopen it writable.
    #[error("the memory is shared read-write, which a read-only grant must not reach")]
    SharedWritable,
    /// The registration ended: its memory is revoked.
    #[error("the registration ended (its shared memory is revoked)")]
    Revoked,
}

impl ShareRefusal {
    /// The refusal's code on the wire (one byte; 0 is no refusal).
    pub fn code(self) -> u8 {
        match self {
            Self::NotVisible => 1,
            Self::NotShareable => 2,
            Self::NotReadable => 3,
            Self::SealedReadOnly => 4,
            Self::SharedWritable => 5,
            Self::Revoked => 6,
        }
    }

    /// The refusal a wire code names (`None`: not one).
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => Self::NotVisible,
            2 => Self::NotShareable,
            3 => Self::NotReadable,
            4 => Self::SealedReadOnly,
            5 => Self::SharedWritable,
            6 => Self::Revoked,
            _ => return None,
        })
    }
}

/// What the driver does to the memfd before it hands the descriptor out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seal {
    /// Nothing: sealed so by an earlier grant.
    Already,
    /// `F_SEAL_FUTURE_WRITE | F_SEAL_SEAL` (the first read-only grant).
    FutureWrite,
    /// `F_SEAL_SEAL` (the first read-write grant).
    Close,
}

/// What the driver does to the memfd's bytes when the registration's memory is freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Discard {
    /// Nothing: no peer ever had the descriptor.
    Nothing,
    /// Punch the bytes out (`fallocate(PUNCH_HOLE)`): allowed on a read-write memfd.
    Punch,
    /// Zero them through the owner's mapping (a read-only memfd forbids punching).
    Zero,
}

/// The share state of one registration's memfd: its mode, whether it is revoked, and the
/// grants made. The driver asks [`decide`](Self::decide), performs the seal, sends the
/// descriptor, then reports [`granted`](Self::granted); at the end, [`revoke`](Self::revoke).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShareState {
    mode: ShareMode,
    revoked: bool,
    grants: u64,
}

impl ShareState {
    /// A memfd handed to no one.
    pub fn new() -> Self {
        Self::default()
    }

    /// Its mode now.
    pub fn mode(&self) -> ShareMode {
        self.mode
    }

    /// Whether it is revoked.
    pub fn is_revoked(&self) -> bool {
        self.revoked
    }

    /// Grants made so far.
    pub fn grants(&self) -> u64 {
        self.grants
    }

    /// Whether a peer whose view resolves the segment (`visible`) and whose segment allows
    /// `access` is granted the memfd, and how; with the seal to apply first.
    pub fn decide(&self, visible: bool, access: Access) -> Result<(Grant, Seal), ShareRefusal> {
        if self.revoked {
            return Err(ShareRefusal::Revoked);
        }
        if !visible {
            return Err(ShareRefusal::NotVisible);
        }
        if !access.contains(Access::REMOTE_READ) {
            return Err(ShareRefusal::NotReadable);
        }
        let grant = if access.contains(Access::REMOTE_WRITE) {
            Grant::ReadWrite
        } else {
            Grant::ReadOnly
        };
        match (self.mode, grant) {
            (ShareMode::Unshared, Grant::ReadOnly) => Ok((grant, Seal::FutureWrite)),
            (ShareMode::Unshared, Grant::ReadWrite) => Ok((grant, Seal::Close)),
            (ShareMode::ReadOnly, Grant::ReadOnly) | (ShareMode::ReadWrite, Grant::ReadWrite) => {
                Ok((grant, Seal::Already))
            }
            (ShareMode::ReadOnly, Grant::ReadWrite) => Err(ShareRefusal::SealedReadOnly),
            (ShareMode::ReadWrite, Grant::ReadOnly) => Err(ShareRefusal::SharedWritable),
        }
    }

    /// Records a grant the driver made (after its seal held and the descriptor was sent).
    pub fn granted(&mut self, grant: Grant) {
        self.mode = match grant {
            Grant::ReadOnly => ShareMode::ReadOnly,
            Grant::ReadWrite => ShareMode::ReadWrite,
        };
        self.grants += 1;
    }

    /// Ends sharing for good (the memory is being freed): nothing is granted from now on, and
    /// the returned discard says what to do to the bytes first. A second revoke discards
    /// nothing.
    pub fn revoke(&mut self) -> Discard {
        if std::mem::replace(&mut self.revoked, true) {
            return Discard::Nothing;
        }
        match self.mode {
            ShareMode::Unshared => Discard::Nothing,
            ShareMode::ReadOnly => Discard::Zero,
            ShareMode::ReadWrite => Discard::Punch,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RW: Access = Access::REMOTE_READ.union(Access::REMOTE_WRITE);

    #[test]
    fn a_peer_that_cannot_see_the_segment_is_refused_whatever_its_access() {
        let s = ShareState::new();
        for access in [Access::REMOTE_READ, RW, Access::REMOTE_WRITE] {
            assert_eq!(s.decide(false, access), Err(ShareRefusal::NotVisible));
        }
    }

    #[test]
    fn the_grant_follows_the_segment_s_access_and_a_write_only_one_is_refused() {
        let s = ShareState::new();
        assert_eq!(
            s.decide(true, Access::REMOTE_READ),
            Ok((Grant::ReadOnly, Seal::FutureWrite))
        );
        assert_eq!(s.decide(true, RW), Ok((Grant::ReadWrite, Seal::Close)));
        assert_eq!(
            s.decide(true, Access::REMOTE_WRITE),
            Err(ShareRefusal::NotReadable)
        );
        assert_eq!(
            s.decide(true, Access::empty()),
            Err(ShareRefusal::NotReadable)
        );
    }

    #[test]
    fn the_first_grant_fixes_the_mode_and_the_other_mode_is_refused() {
        let mut ro = ShareState::new();
        ro.granted(Grant::ReadOnly);
        assert_eq!(
            ro.decide(true, Access::REMOTE_READ),
            Ok((Grant::ReadOnly, Seal::Already))
        );
        assert_eq!(ro.decide(true, RW), Err(ShareRefusal::SealedReadOnly));
        let mut rw = ShareState::new();
        rw.granted(Grant::ReadWrite);
        assert_eq!(rw.decide(true, RW), Ok((Grant::ReadWrite, Seal::Already)));
        assert_eq!(
            rw.decide(true, Access::REMOTE_READ),
            Err(ShareRefusal::SharedWritable)
        );
        assert_eq!(rw.grants(), 1);
    }

    #[test]
    fn a_revoked_memfd_is_granted_to_no_one_and_its_bytes_are_discarded_once() {
        let mut never = ShareState::new();
        assert_eq!(never.revoke(), Discard::Nothing);
        assert_eq!(
            never.decide(true, RW),
            Err(ShareRefusal::Revoked),
            "revoked before any grant"
        );
        let mut rw = ShareState::new();
        rw.granted(Grant::ReadWrite);
        assert_eq!(rw.revoke(), Discard::Punch);
        assert_eq!(rw.revoke(), Discard::Nothing);
        assert_eq!(rw.decide(true, RW), Err(ShareRefusal::Revoked));
        let mut ro = ShareState::new();
        ro.granted(Grant::ReadOnly);
        assert_eq!(
            ro.revoke(),
            Discard::Zero,
            "a sealed memfd cannot be punched"
        );
        assert!(ro.is_revoked());
        assert_eq!(
            ro.decide(true, Access::REMOTE_READ),
            Err(ShareRefusal::Revoked)
        );
    }

    #[test]
    fn refusal_codes_round_trip_and_zero_is_none() {
        for r in [
            ShareRefusal::NotVisible,
            ShareRefusal::NotShareable,
            ShareRefusal::NotReadable,
            ShareRefusal::SealedReadOnly,
            ShareRefusal::SharedWritable,
            ShareRefusal::Revoked,
        ] {
            assert_eq!(ShareRefusal::from_code(r.code()), Some(r));
            assert_ne!(r.code(), 0);
        }
        assert_eq!(ShareRefusal::from_code(0), None);
        assert_eq!(ShareRefusal::from_code(200), None);
    }
}

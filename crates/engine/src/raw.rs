//! Memory named by raw virtual address, the way Mooncake's `TransferEngine` and NIXL's agent
//! name it: the layer both compatibility APIs stand on (docs/mooncake.md).
//!
//! Those APIs register `(address, length, location)` and address remote memory by the raw
//! virtual address the peer registered. Ferry names memory by segment and offset, so:
//!
//! - a registration made through this layer is published under a name that carries its base
//!   address and location ([`segment_name`]: `raw@<hex base>/<location>`), and the peer's
//!   listing (the handshake's, or [`TransferEngine::list_segments`] later) tells an initiator
//!   every base, length and location;
//! - [`AddressMap`] maps an address range to the one entry that holds it whole, with no I/O, for
//!   the local side (the caller's registrations) and the remote side alike;
//! - [`RawPeer`] is a connected peer with its map of remote registrations; an address it does
//!   not hold is looked up again in a fresh listing once ([`RawPeer::resolve`]) before it is
//!   refused with [`Error::UnknownAddress`]. Nothing is sent for a refused range.
//!
//! What moves is an ordinary [`Batch`](crate::Batch) of the resolved segments and offsets: this
//! layer adds no copy and no step to the data path.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, RwLock};

use ferry_core::{Error, SegmentDesc};

use crate::engine::TransferEngine;
use crate::handles::RemoteSegment;
use crate::peer::Peer;

/// The prefix of the segment names this layer publishes.
pub const SEGMENT_PREFIX: &str = "raw@";

/// The segment name of raw memory at `base` in `location` (`"cpu:0"`, `"cuda:1"`; Mooncake's
/// location strings): `raw@7f12a4000000/cpu:0`.
pub fn segment_name(base: u64, location: &str) -> String {
    format!("{SEGMENT_PREFIX}{base:x}/{location}")
}

/// The base address and location a [`segment_name`] carries, or `None` for any other name.
pub fn parse_segment_name(name: &str) -> Option<(u64, &str)> {
    let rest = name.strip_prefix(SEGMENT_PREFIX)?;
    let (hex, location) = rest.split_once('/')?;
    if hex.is_empty() || hex.len() > 16 {
        return None;
    }
    let base = u64::from_str_radix(hex, 16).ok()?;
    Some((base, location))
}

/// Why an address range has no entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Miss {
    /// The range has no byte.
    ZeroLength,
    /// `addr + len` passes the end of the address space.
    Overflow,
    /// No entry holds its first byte.
    Outside,
    /// The entry holding its first byte ends before the range does.
    PastEnd {
        /// The entry's base address.
        base: u64,
        /// The entry's length.
        len: u64,
    },
}

impl Miss {
    /// Whether a later listing of the peer may hold the range (it may have registered the
    /// memory since): a range outside or past every registration, not an empty or overflowing
    /// one.
    pub fn may_be_listed_later(&self) -> bool {
        matches!(self, Miss::Outside | Miss::PastEnd { .. })
    }
}

impl std::fmt::Display for Miss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Miss::ZeroLength => f.write_str("a transfer of zero bytes"),
            Miss::Overflow => f.write_str("the range passes the end of the address space"),
            Miss::Outside => f.write_str("no registered memory holds its first byte"),
            Miss::PastEnd { base, len } => write!(
                f,
                "the range passes the end of the registration {base:#x}+{len} (which ends at {:#x})",
                base + len
            ),
        }
    }
}

/// An entry of an [`AddressMap`].
#[derive(Clone, Debug)]
pub struct Entry<T> {
    /// Its first address.
    pub base: u64,
    /// Its length in bytes (at least 1).
    pub len: u64,
    /// What it maps to.
    pub value: T,
}

/// Non-overlapping address ranges and what each maps to. No I/O; lookups are `O(log n)`.
#[derive(Clone, Debug)]
pub struct AddressMap<T> {
    by_base: BTreeMap<u64, Entry<T>>,
}

impl<T> Default for AddressMap<T> {
    fn default() -> Self {
        Self {
            by_base: BTreeMap::new(),
        }
    }
}

impl<T> AddressMap<T> {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `base..base+len`. Refused (and the map unchanged) for an empty range, one that
    /// passes the end of the address space, or one that overlaps an entry; the error names the
    /// entry it overlaps.
    pub fn insert(&mut self, base: u64, len: u64, value: T) -> Result<(), String> {
        self.check_free(base, len)?;
        self.by_base.insert(base, Entry { base, len, value });
        Ok(())
    }

    /// Whether [`insert`](Self::insert) would take `base..base+len`: the same refusals, with
    /// nothing changed.
    pub fn check_free(&self, base: u64, len: u64) -> Result<(), String> {
        if len == 0 {
            return Err(format!("{base:#x}: a registration of zero bytes"));
        }
        let Some(end) = base.checked_add(len) else {
            return Err(format!(
                "{base:#x}+{len} passes the end of the address space"
            ));
        };
        if let Some((_, before)) = self.by_base.range(..end).next_back()
            && before.base + before.len > base
        {
            return Err(format!(
                "{base:#x}+{len} overlaps the registration {:#x}+{}",
                before.base, before.len
            ));
        }
        Ok(())
    }

    /// Removes the entry whose base is `base`.
    pub fn remove(&mut self, base: u64) -> Option<Entry<T>> {
        self.by_base.remove(&base)
    }

    /// The entry holding all of `addr..addr+len`, and `addr`'s offset in it.
    pub fn lookup(&self, addr: u64, len: u64) -> Result<(&Entry<T>, u64), Miss> {
        if len == 0 {
            return Err(Miss::ZeroLength);
        }
        let end = addr.checked_add(len).ok_or(Miss::Overflow)?;
        let (_, e) = self
            .by_base
            .range(..=addr)
            .next_back()
            .ok_or(Miss::Outside)?;
        let e_end = e.base + e.len;
        if addr >= e_end {
            return Err(Miss::Outside);
        }
        if end > e_end {
            return Err(Miss::PastEnd {
                base: e.base,
                len: e.len,
            });
        }
        Ok((e, addr - e.base))
    }

    /// The entry whose base is `base`.
    pub fn get(&self, base: u64) -> Option<&Entry<T>> {
        self.by_base.get(&base)
    }

    /// The entry whose base is `base`, to change its value (its range stays).
    pub fn get_mut(&mut self, base: u64) -> Option<&mut Entry<T>> {
        self.by_base.get_mut(&base)
    }

    /// The entries in address order.
    pub fn iter(&self) -> impl Iterator<Item = &Entry<T>> {
        self.by_base.values()
    }

    /// How many entries.
    pub fn len(&self) -> usize {
        self.by_base.len()
    }

    /// Whether it has no entry.
    pub fn is_empty(&self) -> bool {
        self.by_base.is_empty()
    }
}

/// A remote registration as the peer listed it: its segment and its location string.
#[derive(Clone, Debug)]
pub struct RemoteRaw {
    /// The segment ops name.
    pub segment: RemoteSegment,
    /// Where the peer said it lies (`"cpu:0"`, `"cuda:0"`).
    pub location: String,
}

/// The raw registrations of a listing, by address (other segments are left out; two that
/// overlap, which no Ferry peer lists, keep the first).
fn map_of(peer: &Peer, listing: Vec<SegmentDesc>) -> AddressMap<RemoteRaw> {
    let mut map = AddressMap::new();
    for desc in listing {
        let Some((base, location)) = parse_segment_name(&desc.name) else {
            continue;
        };
        let location = location.to_owned();
        let len = desc.len;
        let segment = peer.segment_from_descriptor(desc);
        if let Err(reason) = map.insert(base, len, RemoteRaw { segment, location }) {
            tracing::warn!(peer = %peer.addr(), %reason, "listing names overlapping raw registrations");
        }
    }
    map
}

/// A connected peer whose memory is named by raw address.
#[derive(Debug)]
pub struct RawPeer {
    peer: Peer,
    map: RwLock<Arc<AddressMap<RemoteRaw>>>,
}

impl RawPeer {
    /// The peer, with its registrations as its handshake listed them.
    pub fn new(peer: Peer) -> Self {
        let map = map_of(&peer, peer.segments().to_vec());
        Self {
            peer,
            map: RwLock::new(Arc::new(map)),
        }
    }

    /// The connected peer.
    pub fn peer(&self) -> &Peer {
        &self.peer
    }

    /// Its registrations as last listed.
    pub fn registrations(&self) -> Arc<AddressMap<RemoteRaw>> {
        self.map
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The segment holding `addr..addr+len` and `addr`'s offset in it, from the last listing
    /// only (no I/O). The error is [`Error::UnknownAddress`] naming the peer and the reason.
    pub fn lookup(&self, addr: u64, len: u64) -> Result<(RemoteSegment, u64), Error> {
        let map = self.map.read().unwrap_or_else(PoisonError::into_inner);
        match map.lookup(addr, len) {
            Ok((e, offset)) => Ok((e.value.segment.clone(), offset)),
            Err(miss) => Err(self.unknown(addr, len, &miss)),
        }
    }

    /// Like [`lookup`](Self::lookup), but a range the last listing does not hold is looked up
    /// again in a fresh listing (the peer may have registered it since; it may also have
    /// unregistered some), once, before it is refused. Zero lengths and overflows are refused
    /// without asking.
    pub async fn resolve(
        &self,
        engine: &TransferEngine,
        addr: u64,
        len: u64,
    ) -> Result<(RemoteSegment, u64), Error> {
        let map = self.holding(engine, &[addr], &[len]).await?;
        let (e, offset) = map
            .lookup(addr, len)
            .map_err(|miss| self.unknown(addr, len, &miss))?;
        Ok((e.value.segment.clone(), offset))
    }

    /// A listing that holds every range `addrs[i]..+lens[i]`: the last one, or, where it lacks
    /// one, a fresh one (asked for once, as [`resolve`](Self::resolve) does). A batch looks its
    /// ranges up in it by reference, with one lock and no copy per range. The error names the
    /// first range no listing holds.
    pub async fn holding(
        &self,
        engine: &TransferEngine,
        addrs: &[u64],
        lens: &[u64],
    ) -> Result<Arc<AddressMap<RemoteRaw>>, Error> {
        let first_miss = |map: &AddressMap<RemoteRaw>| {
            addrs
                .iter()
                .zip(lens)
                .find_map(|(&a, &l)| map.lookup(a, l).err().map(|m| (a, l, m)))
        };
        let map = self.registrations();
        let Some((addr, len, miss)) = first_miss(&map) else {
            return Ok(map);
        };
        if !miss.may_be_listed_later() {
            return Err(self.unknown(addr, len, &miss));
        }
        self.refresh(engine).await?;
        let map = self.registrations();
        match first_miss(&map) {
            None => Ok(map),
            Some((addr, len, miss)) => Err(self.unknown(addr, len, &miss)),
        }
    }

    /// Replaces the map with the peer's listing now.
    pub async fn refresh(&self, engine: &TransferEngine) -> Result<(), Error> {
        let listing = engine.list_segments(&self.peer).await?;
        let map = map_of(&self.peer, listing);
        tracing::debug!(peer = %self.peer.addr(), registrations = map.len(), "raw registrations listed");
        *self.map.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(map);
        Ok(())
    }

    /// The error for a remote range no listing of this peer holds.
    pub fn unknown(&self, addr: u64, len: u64, miss: &Miss) -> Error {
        Error::UnknownAddress {
            side: "remote",
            peer: self.peer.addr().to_string(),
            addr,
            len,
            reason: miss.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_base_and_location_and_nothing_else_parses() {
        let n = segment_name(0x7f12_a400_0000, "cuda:1");
        assert_eq!(n, "raw@7f12a4000000/cuda:1");
        assert_eq!(parse_segment_name(&n), Some((0x7f12_a400_0000, "cuda:1")));
        assert_eq!(parse_segment_name("raw@0/cpu:0"), Some((0, "cpu:0")));
        for bad in [
            "weights",
            "raw@",
            "raw@/cpu:0",
            "raw@xyz/cpu:0",
            "raw@12",
            "raw@11112222333344445/cpu",
            "RAW@10/cpu",
        ] {
            assert_eq!(parse_segment_name(bad), None, "{bad}");
        }
    }

    fn map() -> AddressMap<&'static str> {
        let mut m = AddressMap::new();
        m.insert(0x1000, 0x1000, "a").unwrap();
        m.insert(0x3000, 0x100, "b").unwrap();
        m
    }

    #[test]
    fn a_range_resolves_to_the_entry_holding_it_whole() {
        let m = map();
        let (e, off) = m.lookup(0x1000, 1).unwrap();
        assert_eq!((e.value, off), ("a", 0));
        let (e, off) = m.lookup(0x1800, 0x800).unwrap();
        assert_eq!((e.value, off), ("a", 0x800));
        let (e, off) = m.lookup(0x30ff, 1).unwrap();
        assert_eq!((e.value, off), ("b", 0xff));
    }

    #[test]
    fn misses_say_why() {
        let m = map();
        assert_eq!(m.lookup(0x1000, 0).unwrap_err(), Miss::ZeroLength);
        assert_eq!(m.lookup(u64::MAX, 2).unwrap_err(), Miss::Overflow);
        assert_eq!(m.lookup(0xfff, 1).unwrap_err(), Miss::Outside);
        assert_eq!(m.lookup(0x2000, 1).unwrap_err(), Miss::Outside);
        assert_eq!(m.lookup(0x3100, 1).unwrap_err(), Miss::Outside);
        assert_eq!(
            m.lookup(0x1fff, 2).unwrap_err(),
            Miss::PastEnd {
                base: 0x1000,
                len: 0x1000
            }
        );
        // A range spanning two adjacent entries is not one registration's either.
        let mut m = map();
        m.insert(0x2000, 0x1000, "c").unwrap();
        assert!(matches!(m.lookup(0x1fff, 2), Err(Miss::PastEnd { .. })));
        assert!(
            Miss::PastEnd { base: 16, len: 16 }
                .to_string()
                .contains("0x20")
        );
    }

    #[test]
    fn overlaps_and_empty_ranges_are_refused_and_leave_the_map_as_it_was() {
        let mut m = map();
        for (base, len) in [
            (0x1000, 1),
            (0x0fff, 2),
            (0x1fff, 0x10),
            (0x0, 0x10000),
            (0x30ff, 1),
        ] {
            let e = m.insert(base, len, "x").unwrap_err();
            assert!(e.contains("overlaps"), "{e}");
        }
        assert!(m.insert(0x5000, 0, "x").unwrap_err().contains("zero"));
        assert!(m.insert(u64::MAX, 2, "x").unwrap_err().contains("end"));
        assert_eq!(m.len(), 2);
        // Adjacent is fine, and a removed range can be registered again.
        m.insert(0x2000, 0x1000, "c").unwrap();
        m.insert(0x0, 0x1000, "d").unwrap();
        assert_eq!(m.remove(0x1000).map(|e| e.value), Some("a"));
        assert!(m.lookup(0x1000, 1).is_err());
        m.insert(0x1000, 0x800, "e").unwrap();
        assert_eq!(
            m.iter().map(|e| e.value).collect::<Vec<_>>(),
            ["d", "e", "c", "b"]
        );
    }

    proptest::proptest! {
        /// Against a linear scan: the lookup finds exactly the entry holding the whole range.
        #[test]
        fn lookup_agrees_with_a_scan(
            entries in proptest::collection::vec((0u64..1 << 16, 1u64..1 << 10), 0..24),
            probes in proptest::collection::vec((0u64..1 << 17, 0u64..1 << 11), 1..64),
        ) {
            let mut m = AddressMap::new();
            let mut kept: Vec<(u64, u64)> = Vec::new();
            for (i, (base, len)) in entries.into_iter().enumerate() {
                let overlaps = kept.iter().any(|&(b, l)| base < b + l && b < base + len);
                proptest::prop_assert_eq!(m.insert(base, len, i).is_ok(), !overlaps);
                if !overlaps {
                    kept.push((base, len));
                }
            }
            for (addr, len) in probes {
                let scan = kept
                    .iter()
                    .find(|&&(b, l)| len > 0 && addr >= b && addr + len <= b + l);
                match (m.lookup(addr, len), scan) {
                    (Ok((e, off)), Some(&(b, _))) => {
                        proptest::prop_assert_eq!(e.base, b);
                        proptest::prop_assert_eq!(off, addr - b);
                    }
                    (Err(_), None) => {}
                    (got, want) => proptest::prop_assert!(false, "{:?} vs {:?}", got.map(|(e, o)| (e.base, o)), want),
                }
            }
        }
    }
}

//! Memory named by raw virtual address, the way Mooncake's `TransferEngine` and NIXL's agent
//! name it: the layer both compatibility APIs stand on (docs/mooncake.md).
//!
//! Those APIs register `(address, length, location)` and address remote memory by the raw
//! virtual address the peer registered. Ferry names memory by segment and offset, so:
//!
//! - a registration made through this layer is published under an opaque name that carries
//!   an id and its location, never its address ([`segment_name`]: `raw#<id>/<location>`), so
//!   a listing (the handshake's, [`TransferEngine::list_segments`], `ferry ls`) tells no one
//!   where the memory lies;
//! - the addresses go in a small index segment the publisher keeps beside them
//!   ([`index_name`]: `raw-index#<generation>`; [`encode_index`]), published to the same peers
//!   as the registrations: a peer the registrations are not published to neither lists nor
//!   reads it. A new index replaces the old one on every change (the highest generation
//!   listed is the current one);
//! - [`AddressMap`] maps an address range to the one entry that holds it whole, with no I/O, for
//!   the local side (the caller's registrations) and the remote side alike;
//! - [`RawPeer`] is a connected peer with its map of remote registrations, made from a listing
//!   and a READ of its index; an address it does not hold is looked up again in a fresh listing
//!   once ([`RawPeer::resolve`]) before it is refused with [`Error::UnknownAddress`]. Nothing is
//!   sent for a refused range.
//!
//! What moves is an ordinary [`Batch`] of the resolved segments and offsets: this
//! layer adds no copy and no step to the data path (the index is read when the map is
//! refreshed, not per transfer).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use ferry_core::{Access, Error, FailureKind, MemoryRegion, SegmentDesc};

use crate::engine::TransferEngine;
use crate::handles::RemoteSegment;
use crate::peer::Peer;
use crate::request::Batch;

/// The prefix of the segment names this layer publishes.
pub const SEGMENT_PREFIX: &str = "raw#";

/// The prefix of the name of the index segment that maps ids to addresses.
pub const INDEX_PREFIX: &str = "raw-index#";

/// An index longer than this (a header and one entry per segment a listing can hold) is
/// refused unread.
pub const MAX_INDEX_LEN: u64 = (INDEX_HEADER + INDEX_ENTRY * ferry_core::wire::MAX_SEGMENTS) as u64;

const INDEX_MAGIC: &[u8; 8] = b"FERRYRI1";
const INDEX_HEADER: usize = 12;
const INDEX_ENTRY: usize = 24;

/// A fresh id for a registration of this layer: unique in this process, and saying nothing
/// about where the memory lies.
pub fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The segment name of the raw registration `id` in `location` (`"cpu:0"`, `"cuda:1"`;
/// Mooncake's location strings): `raw#7/cpu:0`.
pub fn segment_name(id: u64, location: &str) -> String {
    format!("{SEGMENT_PREFIX}{id}/{location}")
}

/// The id and location a [`segment_name`] carries, or `None` for any other name.
pub fn parse_segment_name(name: &str) -> Option<(u64, &str)> {
    let rest = name.strip_prefix(SEGMENT_PREFIX)?;
    let (id, location) = rest.split_once('/')?;
    Some((parse_decimal(id)?, location))
}

/// The name of the index segment of generation `generation`: `raw-index#3`.
pub fn index_name(generation: u64) -> String {
    format!("{INDEX_PREFIX}{generation}")
}

/// The generation an [`index_name`] carries, or `None` for any other name.
pub fn parse_index_name(name: &str) -> Option<u64> {
    parse_decimal(name.strip_prefix(INDEX_PREFIX)?)
}

fn parse_decimal(s: &str) -> Option<u64> {
    if s.is_empty() || s.len() > 20 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// One registration in an index: its id, base address and length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexEntry {
    /// The id its [`segment_name`] carries.
    pub id: u64,
    /// Its first address.
    pub base: u64,
    /// Its length in bytes.
    pub len: u64,
}

/// The bytes of an index segment: a magic, a count, then `(id, base, len)` per entry, all
/// little-endian.
pub fn encode_index(entries: &[IndexEntry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(INDEX_HEADER + INDEX_ENTRY * entries.len());
    out.extend_from_slice(INDEX_MAGIC);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for e in entries {
        out.extend_from_slice(&e.id.to_le_bytes());
        out.extend_from_slice(&e.base.to_le_bytes());
        out.extend_from_slice(&e.len.to_le_bytes());
    }
    out
}

/// The entries of an index segment's bytes; the reason when they are not one.
pub fn decode_index(bytes: &[u8]) -> Result<Vec<IndexEntry>, String> {
    let (head, body) = bytes
        .split_at_checked(INDEX_HEADER)
        .ok_or("shorter than its header")?;
    if &head[..8] != INDEX_MAGIC {
        return Err("not a raw registrations' index (bad magic)".into());
    }
    let count = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) as usize;
    if body.len() != count.saturating_mul(INDEX_ENTRY) {
        return Err(format!("{count} entries announced in {} bytes", body.len()));
    }
    let word = |c: &[u8], i: usize| u64::from_le_bytes(c[i..i + 8].try_into().expect("8 bytes"));
    Ok(body
        .chunks_exact(INDEX_ENTRY)
        .map(|c| IndexEntry {
            id: word(c, 0),
            base: word(c, 8),
            len: word(c, 16),
        })
        .collect())
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

/// The raw registrations of a listing, by address: each `raw#` segment the index maps to a
/// base of its length (other segments are left out; two that overlap, which no Ferry peer
/// lists, keep the first).
fn map_of(peer: &Peer, listing: Vec<SegmentDesc>, index: &[IndexEntry]) -> AddressMap<RemoteRaw> {
    let by_id: HashMap<u64, &IndexEntry> = index.iter().map(|e| (e.id, e)).collect();
    let mut map = AddressMap::new();
    for desc in listing {
        let Some((id, location)) = parse_segment_name(&desc.name) else {
            continue;
        };
        // Listed before the index that maps it was published, or after one that no longer
        // does (unregistered meanwhile): not mapped until a later listing.
        let Some(entry) = by_id.get(&id).filter(|e| e.len == desc.len) else {
            continue;
        };
        let (base, len) = (entry.base, entry.len);
        let location = location.to_owned();
        let segment = peer.segment_from_descriptor(desc);
        if let Err(reason) = map.insert(base, len, RemoteRaw { segment, location }) {
            tracing::warn!(peer = %peer.addr(), %reason, "listing names overlapping raw registrations");
        }
    }
    map
}

/// The current index of a listing: the one of the highest generation.
fn current_index(listing: &[SegmentDesc]) -> Option<&SegmentDesc> {
    listing
        .iter()
        .filter_map(|d| parse_index_name(&d.name).map(|g| (g, d)))
        .max_by_key(|(g, _)| *g)
        .map(|(_, d)| d)
}

/// Reads the index segment `desc` of `peer` into memory of this engine (a local, unpublished
/// registration) and decodes it.
async fn read_index(
    engine: &TransferEngine,
    peer: &Peer,
    desc: &SegmentDesc,
) -> Result<Vec<IndexEntry>, Error> {
    let malformed = |reason: String| Error::Unavailable {
        library: "raw registrations' index".into(),
        reason: format!("{}: {reason}", peer.addr()),
    };
    if desc.len > MAX_INDEX_LEN {
        return Err(malformed(format!(
            "an index of {} bytes (at most {MAX_INDEX_LEN})",
            desc.len
        )));
    }
    if desc.len == 0 {
        return Ok(Vec::new());
    }
    let region = Arc::new(MemoryRegion::from_vec(vec![0; desc.len as usize]));
    let scratch = format!("raw-index-read#{}", next_id());
    let local = engine.register(region.clone(), Access::LOCAL, &scratch)?;
    let segment = peer.segment_from_descriptor(desc.clone());
    let handle = engine.submit(Batch::new().read(&local, 0, &segment, 0, desc.len))?;
    let drained = handle.drained();
    handle.await;
    let outcome = drained.await;
    drop(local);
    match outcome.failure.map(|f| f.kind) {
        None => {}
        Some(FailureKind::PeerLost) => {
            return Err(Error::PeerLost {
                peer: peer.addr().to_string(),
                during: "reading its raw registrations' index",
                source: None,
            });
        }
        Some(kind) => return Err(malformed(format!("reading it: {kind}"))),
    }
    let mut bytes = vec![0; desc.len as usize];
    region
        .read_at(0, &mut bytes)
        .map_err(|e| malformed(e.to_string()))?;
    decode_index(&bytes).map_err(malformed)
}

/// A connected peer whose memory is named by raw address.
#[derive(Debug)]
pub struct RawPeer {
    peer: Peer,
    map: RwLock<Arc<AddressMap<RemoteRaw>>>,
}

impl RawPeer {
    /// The peer, with no registration mapped yet: the handshake's listing names no address,
    /// so the first lookup that misses ([`holding`](Self::holding)) or a
    /// [`refresh`](Self::refresh) reads the peer's index.
    pub fn new(peer: Peer) -> Self {
        Self {
            peer,
            map: RwLock::new(Arc::new(AddressMap::new())),
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

    /// Replaces the map with the peer's listing and index now. An index replaced between the
    /// listing and its READ (the peer registered or unregistered meanwhile) is listed again
    /// once.
    pub async fn refresh(&self, engine: &TransferEngine) -> Result<(), Error> {
        let mut retried = false;
        let (listing, index) = loop {
            let listing = engine.list_segments(&self.peer).await?;
            let Some(desc) = current_index(&listing) else {
                break (listing, Vec::new());
            };
            match read_index(engine, &self.peer, desc).await {
                Ok(index) => break (listing, index),
                Err(Error::Unavailable { .. }) if !retried => retried = true,
                Err(e) => return Err(e),
            }
        };
        let map = map_of(&self.peer, listing, &index);
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
    fn names_carry_an_id_and_a_location_never_an_address() {
        let n = segment_name(7, "cuda:1");
        assert_eq!(n, "raw#7/cuda:1");
        assert_eq!(parse_segment_name(&n), Some((7, "cuda:1")));
        assert_eq!(parse_segment_name("raw#0/cpu:0"), Some((0, "cpu:0")));
        for bad in [
            "weights",
            "raw#",
            "raw#/cpu:0",
            "raw#7f/cpu:0",
            "raw#+1/cpu:0",
            "raw#12",
            "raw#123456789012345678901/cpu",
            "raw@7f12a4000000/cpu:0",
            "RAW#10/cpu",
        ] {
            assert_eq!(parse_segment_name(bad), None, "{bad}");
        }
        assert_eq!(index_name(3), "raw-index#3");
        assert_eq!(parse_index_name("raw-index#3"), Some(3));
        for bad in ["raw-index#", "raw-index#x", "raw#3/cpu:0", "raw-index#-1"] {
            assert_eq!(parse_index_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn an_index_round_trips_and_anything_else_is_refused() {
        let entries = [
            IndexEntry {
                id: 1,
                base: 0x7f12_a400_0000,
                len: 4096,
            },
            IndexEntry {
                id: u64::MAX,
                base: 0,
                len: 1,
            },
        ];
        let bytes = encode_index(&entries);
        assert_eq!(bytes.len(), INDEX_HEADER + 2 * INDEX_ENTRY);
        assert_eq!(decode_index(&bytes).unwrap(), entries);
        assert_eq!(decode_index(&encode_index(&[])).unwrap(), []);
        assert!(decode_index(&bytes[..bytes.len() - 1]).is_err());
        assert!(decode_index(&bytes[..4]).is_err());
        let mut bad = bytes.clone();
        bad[0] ^= 1;
        assert!(decode_index(&bad).unwrap_err().contains("magic"));
        let mut bad = bytes;
        bad[8] = 3;
        assert!(decode_index(&bad).unwrap_err().contains("3 entries"));
    }

    #[test]
    fn the_current_index_is_the_highest_generation_listed() {
        let desc = |name: &str| SegmentDesc {
            name: name.into(),
            token: ferry_core::SegmentToken(1),
            len: 12,
            access: Access::REMOTE_READ,
            remote_keys: Vec::new(),
        };
        let listing = [
            desc("raw-index#9"),
            desc("raw#1/cpu:0"),
            desc("raw-index#10"),
            desc("weights"),
        ];
        assert_eq!(current_index(&listing).unwrap().name, "raw-index#10");
        assert!(current_index(&listing[1..2]).is_none());
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

//! The manifest: what a source publishes for one broadcast.
//!
//! A manifest names the broadcast and its version, lists the *segments* (one per published file,
//! each served by the source as a Ferry segment of the same name and held by every receiver as
//! a registered buffer of the same name), the *entries* (what the bytes mean: a whole file, or
//! one tensor of a `.safetensors` file, with its dtype and shape) and the *chunks*: each
//! segment cut into pieces of `chunk_size` bytes (the last one shorter), each with its BLAKE3
//! digest (the proof a receiver checks every chunk against) and its CRC-32C (a cheaper check
//! of memory already verified, never the proof). Chunks are the unit of transfer, verification
//! and relaying.
//!
//! The manifest itself is bound to its source by its [`digest`](Manifest::digest) (BLAKE3 of
//! its JSON): a receiver given that digest out of band (`ferry pull --expect-manifest`) refuses
//! any other manifest, so no relay or impostor can substitute chunk hashes of its own.
//!
//! Manifests travel as JSON. [`Manifest::from_json`] refuses, with a [`ManifestError`] that says
//! what is wrong, anything over [`MAX_MANIFEST_BYTES`], that does not parse, or whose numbers do
//! not add up (chunks that do not tile their segment exactly, entries outside their segment,
//! names that are not plain file names, counts over the limits). It never panics on any input.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Largest manifest accepted, in bytes of JSON.
pub const MAX_MANIFEST_BYTES: usize = 64 << 20;
/// Most segments in one manifest.
pub const MAX_SEGMENTS: usize = 4096;
/// Most chunks in one manifest.
pub const MAX_CHUNKS: usize = 4 << 20;
/// Most entries in one manifest.
pub const MAX_ENTRIES: usize = 1 << 20;
/// Most payload bytes one manifest may declare (64 TiB), checked before anything else is:
/// receivers allocate what a manifest declares. A receiver may set a lower limit of its own
/// (`ReceiverOptions::max_bytes`).
pub const MAX_TOTAL_BYTES: u64 = 1 << 46;
/// Smallest and largest chunk size.
pub const CHUNK_SIZE_RANGE: (u64, u64) = (4096, 64 << 20);
/// The default chunk size: 1 MiB.
pub const DEFAULT_CHUNK_SIZE: u64 = 1 << 20;
/// Largest `.safetensors` header read.
const MAX_SAFETENSORS_HEADER: u64 = 100 << 20;

/// One published file, as a segment of the broadcast.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// Its name: the Ferry segment name at every holder and the file name a receiver writes
    /// (a plain file name: no `/`, not `.` or `..`, not empty).
    pub name: String,
    /// Its length in bytes.
    pub len: u64,
}

/// What some bytes of a segment are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// The entry's name (a tensor's name, or the file's).
    pub name: String,
    /// Its length in bytes.
    pub len: u64,
    /// The element type, for a tensor (`F32`, `BF16`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// The shape, for a tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<u64>>,
    /// Index of the segment it lives in.
    pub segment: u32,
    /// Its offset in that segment.
    pub offset: u64,
}

/// One unit of transfer and verification.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    /// Index of its segment.
    pub segment: u32,
    /// Offset in the segment (a multiple of the chunk size).
    pub offset: u64,
    /// Length (the chunk size, or less for a segment's last chunk).
    pub len: u64,
    /// CRC-32C of its bytes: a cheap check of memory already verified (at rest), never the
    /// proof.
    pub crc32c: u32,
    /// BLAKE3 of its bytes: what every chunk fetched is verified against.
    pub blake3: Digest,
}

/// A BLAKE3 digest (32 bytes), hex on the wire and in messages.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }

    /// Parses 64 hex digits (either case).
    pub fn from_hex(s: &str) -> Option<Self> {
        let s = s.as_bytes();
        if s.len() != 64 {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, pair) in s.chunks_exact(2).enumerate() {
            let hi = (pair[0] as char).to_digit(16)?;
            let lo = (pair[1] as char).to_digit(16)?;
            out[i] = (hi * 16 + lo) as u8;
        }
        Some(Self(out))
    }
}

impl From<blake3::Hash> for Digest {
    fn from(h: blake3::Hash) -> Self {
        Self(*h.as_bytes())
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Digest({self})")
    }
}

impl Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Digest::from_hex(&s).ok_or_else(|| serde::de::Error::custom("a digest is 64 hex digits"))
    }
}

/// What a source publishes for one broadcast.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The broadcast's name.
    pub name: String,
    /// The publisher's version of it (receivers never mix chunks of two versions).
    pub version: u64,
    /// Chunk size in bytes.
    pub chunk_size: u64,
    /// The segments, in order.
    pub segments: Vec<Segment>,
    /// The entries, in order.
    pub entries: Vec<Entry>,
    /// The chunks, segment by segment, in offset order.
    pub chunks: Vec<Chunk>,
}

/// Why a manifest, or the input it is built from, is refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManifestError {
    /// The manifest is larger than [`MAX_MANIFEST_BYTES`].
    #[error("manifest of {len} bytes exceeds the limit of {limit}")]
    TooLarge {
        /// Its size.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The manifest is not the JSON of a manifest (truncated, wrong types, missing fields).
    #[error("manifest does not parse: {0}")]
    Parse(#[from] serde_json::Error),
    /// The manifest parses but does not add up.
    #[error("invalid manifest: {0}")]
    Invalid(String),
    /// The manifest declares more payload bytes than the limit (checked before anything is
    /// allocated for them).
    #[error("manifest declares {declared} bytes, over the limit of {limit}")]
    TooManyBytes {
        /// What it declares (saturated at `u64::MAX`).
        declared: u64,
        /// The limit.
        limit: u64,
    },
    /// An input file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A `.safetensors` file's header is not valid.
    #[error("{path}: not a valid safetensors file: {reason}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

pub(crate) fn invalid(msg: impl Into<String>) -> ManifestError {
    ManifestError::Invalid(msg.into())
}

/// Whether `name` is a plain file name that can be written inside a directory.
pub fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\0')
        && name.len() <= 255
}

impl Manifest {
    /// A manifest with nothing in it yet, its chunk size checked against
    /// [`CHUNK_SIZE_RANGE`] first (a zero chunk size would cut forever).
    pub(crate) fn empty(name: &str, version: u64, chunk_size: u64) -> Result<Self, ManifestError> {
        let (lo, hi) = CHUNK_SIZE_RANGE;
        if !(lo..=hi).contains(&chunk_size) {
            return Err(invalid(format!(
                "chunk size {chunk_size} outside {lo}..={hi}"
            )));
        }
        Ok(Manifest {
            name: name.to_owned(),
            version,
            chunk_size,
            segments: Vec::new(),
            entries: Vec::new(),
            chunks: Vec::new(),
        })
    }

    /// Parses and validates a manifest (see [`validate`](Self::validate)).
    pub fn from_json(bytes: &[u8]) -> Result<Self, ManifestError> {
        if bytes.len() > MAX_MANIFEST_BYTES {
            return Err(ManifestError::TooLarge {
                len: bytes.len(),
                limit: MAX_MANIFEST_BYTES,
            });
        }
        let m: Manifest = serde_json::from_slice(bytes)?;
        m.validate()?;
        Ok(m)
    }

    /// The manifest as JSON.
    pub fn to_json(&self) -> Vec<u8> {
        // Serializing plain data with string keys cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Total bytes of all segments (saturating: a validated manifest declares at most
    /// [`MAX_TOTAL_BYTES`]).
    pub fn total_bytes(&self) -> u64 {
        self.segments
            .iter()
            .fold(0u64, |t, s| t.saturating_add(s.len))
    }

    /// The manifest's digest: BLAKE3 of its JSON ([`to_json`](Self::to_json)). It covers every
    /// chunk's hash, so a receiver given it out of band (`ferry pull --expect-manifest`)
    /// verifies every byte back to the source, whoever relays it.
    pub fn digest(&self) -> Digest {
        Digest::of(&self.to_json())
    }

    /// Checks that the numbers add up: the total bytes declared at most [`MAX_TOTAL_BYTES`]
    /// (checked first); the chunk size in [`CHUNK_SIZE_RANGE`]; counts within the limits;
    /// segment names plain, unique file names; every segment tiled exactly by its chunks, in
    /// order, each `chunk_size` long but the last; every entry inside its segment.
    pub fn validate(&self) -> Result<(), ManifestError> {
        let total = self
            .segments
            .iter()
            .try_fold(0u64, |t, s| t.checked_add(s.len))
            .filter(|&t| t <= MAX_TOTAL_BYTES);
        if total.is_none() {
            return Err(ManifestError::TooManyBytes {
                declared: self.total_bytes(),
                limit: MAX_TOTAL_BYTES,
            });
        }
        let (lo, hi) = CHUNK_SIZE_RANGE;
        if !(lo..=hi).contains(&self.chunk_size) {
            return Err(invalid(format!(
                "chunk size {} outside {lo}..={hi}",
                self.chunk_size
            )));
        }
        if self.name.is_empty() || self.name.len() > 255 {
            return Err(invalid("the broadcast name must have 1 to 255 bytes"));
        }
        if self.segments.len() > MAX_SEGMENTS
            || self.chunks.len() > MAX_CHUNKS
            || self.entries.len() > MAX_ENTRIES
        {
            return Err(invalid(format!(
                "{} segments, {} chunks, {} entries: limits {MAX_SEGMENTS}, {MAX_CHUNKS}, {MAX_ENTRIES}",
                self.segments.len(),
                self.chunks.len(),
                self.entries.len()
            )));
        }
        let mut names = HashSet::new();
        for s in &self.segments {
            if !is_plain_file_name(&s.name) {
                return Err(invalid(format!(
                    "segment name {:?} is not a plain file name",
                    s.name
                )));
            }
            if !names.insert(s.name.as_str()) {
                return Err(invalid(format!("segment name {:?} appears twice", s.name)));
            }
        }
        // Chunks tile each segment in order.
        let mut next = 0usize;
        for (si, seg) in self.segments.iter().enumerate() {
            let want = seg.len.div_ceil(self.chunk_size);
            let mut at = 0u64;
            for k in 0..want {
                let Some(c) = self.chunks.get(next) else {
                    return Err(invalid(format!(
                        "segment {:?} needs {want} chunks, the manifest ends after {k}",
                        seg.name
                    )));
                };
                let len = (seg.len - at).min(self.chunk_size);
                if c.segment as usize != si || c.offset != at || c.len != len {
                    return Err(invalid(format!(
                        "chunk {next} is segment {} offset {} length {}, expected segment {si} \
                         offset {at} length {len}",
                        c.segment, c.offset, c.len
                    )));
                }
                at += len;
                next += 1;
            }
        }
        if next != self.chunks.len() {
            return Err(invalid(format!(
                "{} chunks beyond the segments' lengths",
                self.chunks.len() - next
            )));
        }
        for e in &self.entries {
            let Some(seg) = self.segments.get(e.segment as usize) else {
                return Err(invalid(format!(
                    "entry {:?} names segment {}, there are {}",
                    e.name,
                    e.segment,
                    self.segments.len()
                )));
            };
            if e.offset.checked_add(e.len).is_none_or(|end| end > seg.len) {
                return Err(invalid(format!(
                    "entry {:?} ({} bytes at {}) lies outside segment {:?} of {} bytes",
                    e.name, e.len, e.offset, seg.name, seg.len
                )));
            }
        }
        Ok(())
    }

    /// Builds a manifest from `files`: one segment per file (named after the file; two files of
    /// the same name are refused), chunks of `chunk_size` with their CRC-32C (the files are
    /// read once, whole), and one entry per file, or one per tensor for a file whose name ends
    /// in `.safetensors` (its header read by the `safetensors` crate; a header that does not
    /// parse, or tensors outside the file, are refused).
    pub fn build(
        name: &str,
        version: u64,
        files: &[PathBuf],
        chunk_size: u64,
    ) -> Result<Self, ManifestError> {
        let mut m = Manifest::empty(name, version, chunk_size)?;
        for (si, path) in files.iter().enumerate() {
            let seg_name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_owned();
            let read_err = |source| ManifestError::Read {
                path: path.clone(),
                source,
            };
            let mut file = File::open(path).map_err(read_err)?;
            let len = file.metadata().map_err(read_err)?.len();
            let si = u32::try_from(si).map_err(|_| invalid("too many files"))?;
            if seg_name.ends_with(".safetensors") {
                m.entries
                    .extend(safetensors_entries(path, &mut file, len, si)?);
            } else {
                m.entries.push(Entry {
                    name: seg_name.clone(),
                    len,
                    dtype: None,
                    shape: None,
                    segment: si,
                    offset: 0,
                });
            }
            let mut file = File::open(path).map_err(read_err)?;
            let mut buf = vec![0u8; chunk_size.min(len.max(1)) as usize];
            let mut at = 0u64;
            while at < len {
                let n = (len - at).min(chunk_size) as usize;
                file.read_exact(&mut buf[..n]).map_err(read_err)?;
                m.chunks.push(Chunk {
                    segment: si,
                    offset: at,
                    len: n as u64,
                    crc32c: ferry::checksum::crc32c(&buf[..n]),
                    blake3: Digest::of(&buf[..n]),
                });
                at += n as u64;
            }
            m.segments.push(Segment {
                name: seg_name,
                len,
            });
        }
        m.validate()?;
        Ok(m)
    }
}

impl Manifest {
    /// The entry named `name`, if any.
    pub fn entry(&self, name: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.name == name)
    }
}

/// One entry per tensor of the `.safetensors` file at `path` (of `file_len` bytes), read from
/// its header only.
fn safetensors_entries(
    path: &Path,
    file: &mut File,
    file_len: u64,
    segment: u32,
) -> Result<Vec<Entry>, ManifestError> {
    let bad = |reason: String| ManifestError::Safetensors {
        path: path.to_owned(),
        reason,
    };
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|e| bad(format!("no header length: {e}")))?;
    let header_len = u64::from_le_bytes(n);
    if header_len > MAX_SAFETENSORS_HEADER || header_len > file_len.saturating_sub(8) {
        return Err(bad(format!(
            "header length {header_len} does not fit a file of {file_len} bytes"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .map_err(|e| bad(format!("header truncated: {e}")))?;
    let meta: safetensors::tensor::Metadata =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
    let data_start = 8 + header_len;
    let mut tensors: Vec<(String, &safetensors::tensor::TensorInfo)> =
        meta.tensors().into_iter().collect();
    tensors.sort_by_key(|(_, t)| t.data_offsets);
    let mut out = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let (s, e) = (t.data_offsets.0 as u64, t.data_offsets.1 as u64);
        if e < s || data_start.checked_add(e).is_none_or(|end| end > file_len) {
            return Err(bad(format!(
                "tensor {name:?} at {s}..{e} lies outside the file's {} data bytes",
                file_len - data_start
            )));
        }
        out.push(Entry {
            name,
            len: e - s,
            dtype: Some(format!("{:?}", t.dtype)),
            shape: Some(t.shape.iter().map(|&d| d as u64).collect()),
            segment,
            offset: data_start + s,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::Write;

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        let p = dir.join(name);
        let mut f = File::create(&p).unwrap();
        f.write_all(bytes).unwrap();
        p
    }

    fn safetensors_bytes() -> Vec<u8> {
        let header = br#"{"b":{"dtype":"F32","shape":[2],"data_offsets":[16,24]},"a":{"dtype":"BF16","shape":[2,4],"data_offsets":[0,16]},"__metadata__":{"k":"v"}}"#;
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(header);
        v.extend((0..24u8).collect::<Vec<_>>());
        v
    }

    #[test]
    fn builds_chunks_and_tensor_entries() {
        let dir = tempfile::tempdir().unwrap();
        let plain: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let a = write(dir.path(), "plain.bin", &plain);
        let st = safetensors_bytes();
        let b = write(dir.path(), "model.safetensors", &st);
        let m = Manifest::build("w", 3, &[a, b], 4096).unwrap();
        assert_eq!(m.segments.len(), 2);
        assert_eq!(m.chunks.len(), 3 + 1);
        assert_eq!(m.chunks[2].len, 10_000 - 8192);
        assert_eq!(m.chunks[0].crc32c, ferry::checksum::crc32c(&plain[..4096]));
        assert_eq!(m.chunks[0].blake3, Digest::of(&plain[..4096]));
        assert_eq!(m.chunks[1].blake3.to_string().len(), 64);
        assert_eq!(
            Digest::from_hex(&m.chunks[1].blake3.to_string()),
            Some(m.chunks[1].blake3)
        );
        assert_eq!(Digest::from_hex("zz"), None);
        assert_eq!(m.entries[0].name, "plain.bin");
        let names: Vec<&str> = m.entries[1..].iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        let a = &m.entries[1];
        assert_eq!(a.dtype.as_deref(), Some("BF16"));
        assert_eq!(a.shape.as_deref(), Some(&[2, 4][..]));
        assert_eq!(a.offset, st.len() as u64 - 24);
        assert_eq!(a.len, 16);
        let back = Manifest::from_json(&m.to_json()).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn bad_safetensors_are_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let mut st = safetensors_bytes();
        st.truncate(st.len() - 4); // tensor b now ends past the file
        let p = write(dir.path(), "cut.safetensors", &st);
        let e = Manifest::build("w", 1, &[p], 4096).unwrap_err();
        assert!(e.to_string().contains("outside"), "{e}");
        let p = write(dir.path(), "huge.safetensors", &u64::MAX.to_le_bytes());
        let e = Manifest::build("w", 1, &[p], 4096).unwrap_err();
        assert!(e.to_string().contains("header length"), "{e}");
        let p = write(dir.path(), "short.safetensors", b"abc");
        assert!(Manifest::build("w", 1, &[p], 4096).is_err());
        let mut junk = 5u64.to_le_bytes().to_vec();
        junk.extend_from_slice(b"{nope");
        let p = write(dir.path(), "junk.safetensors", &junk);
        assert!(Manifest::build("w", 1, &[p], 4096).is_err());
    }

    fn sample() -> Manifest {
        Manifest {
            name: "w".into(),
            version: 1,
            chunk_size: 4096,
            segments: vec![Segment {
                name: "a".into(),
                len: 5000,
            }],
            entries: vec![Entry {
                name: "a".into(),
                len: 5000,
                dtype: None,
                shape: None,
                segment: 0,
                offset: 0,
            }],
            chunks: vec![
                Chunk {
                    segment: 0,
                    offset: 0,
                    len: 4096,
                    crc32c: 1,
                    blake3: Digest::default(),
                },
                Chunk {
                    segment: 0,
                    offset: 4096,
                    len: 904,
                    crc32c: 2,
                    blake3: Digest::default(),
                },
            ],
        }
    }

    #[test]
    fn lying_lengths_and_names_are_refused() {
        assert!(sample().validate().is_ok());
        let mut m = sample();
        m.segments[0].len = 9000; // a chunk short
        assert!(m.validate().is_err());
        let mut m = sample();
        m.chunks[1].len = 1000; // lies about its length
        assert!(m.validate().is_err());
        let mut m = sample();
        m.entries[0].len = u64::MAX; // overflows
        assert!(m.validate().is_err());
        let mut m = sample();
        m.segments[0].name = "../etc".into();
        assert!(m.validate().is_err());
        let mut m = sample();
        m.chunk_size = 0;
        assert!(m.validate().is_err());
        let mut m = sample();
        m.chunks.push(m.chunks[1]);
        assert!(m.validate().is_err());
        assert!(matches!(
            Manifest::from_json(&vec![b' '; MAX_MANIFEST_BYTES + 1]),
            Err(ManifestError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_manifest_declaring_2_pow_48_bytes_is_refused_first() {
        // One segment of 2^48 bytes whose chunks would tile it, were the limit not checked
        // first: the refusal names the size, not the tiling.
        let mut m = sample();
        m.segments[0].len = 1 << 48;
        assert!(matches!(
            m.validate(),
            Err(ManifestError::TooManyBytes { declared, .. }) if declared == 1 << 48
        ));
        // Lengths whose sum overflows are refused the same way.
        let mut m = sample();
        m.segments.push(Segment {
            name: "b".into(),
            len: u64::MAX,
        });
        assert!(matches!(
            m.validate(),
            Err(ManifestError::TooManyBytes { .. })
        ));
        // And as JSON from a peer.
        let mut m = sample();
        m.segments[0].len = 1 << 48;
        assert!(matches!(
            Manifest::from_json(&m.to_json()),
            Err(ManifestError::TooManyBytes { .. })
        ));
    }

    #[test]
    fn the_digest_covers_every_chunk_hash() {
        let m = sample();
        let mut other = sample();
        other.chunks[1].blake3 = Digest::of(b"x");
        assert_ne!(m.digest(), other.digest());
        assert_eq!(
            m.digest(),
            Manifest::from_json(&m.to_json()).unwrap().digest()
        );
    }

    proptest! {
        /// Any truncation or byte flip of a valid manifest's JSON is parsed or refused, never a
        /// panic; what parses is valid.
        #[test]
        fn mangled_manifests_never_panic(cut in any::<usize>(), flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6)) {
            let mut j = sample().to_json();
            for (at, v) in flips {
                let i = at % j.len();
                j[i] ^= v;
            }
            let cut = cut % (j.len() + 1);
            if let Ok(m) = Manifest::from_json(&j[..cut]) {
                prop_assert!(m.validate().is_ok());
            }
        }

        /// Arbitrary numbers in the fields: refused or valid, never a panic or overflow.
        #[test]
        fn arbitrary_numbers_never_panic(len in any::<u64>(), cs in any::<u64>(), off in any::<u64>(), clen in any::<u64>(), seg in any::<u32>()) {
            let mut m = sample();
            m.segments[0].len = len;
            m.chunk_size = cs;
            m.chunks[0].offset = off;
            m.chunks[0].len = clen;
            m.chunks[0].segment = seg;
            m.entries[0].offset = off;
            m.entries[0].segment = seg;
            let _ = m.validate();
        }
    }
}

//! The byte-level pieces every frame is built from: a bounds-checked little-endian [`Reader`]
//! and the little-endian writers.

use super::error::WireError;

/// A bounds-checked little-endian reader over a byte slice.
pub(super) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    pub(super) fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(WireError::Truncated {
                field,
                needed: n - self.buf.len(),
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    pub(super) fn array<const N: usize>(
        &mut self,
        field: &'static str,
    ) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, field)?);
        Ok(out)
    }

    pub(super) fn u8(&mut self, field: &'static str) -> Result<u8, WireError> {
        Ok(self.array::<1>(field)?[0])
    }
    pub(super) fn u16(&mut self, field: &'static str) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array(field)?))
    }
    pub(super) fn u32(&mut self, field: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }
    pub(super) fn u64(&mut self, field: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }
    pub(super) fn u128(&mut self, field: &'static str) -> Result<u128, WireError> {
        Ok(u128::from_le_bytes(self.array(field)?))
    }

    /// A count bounded by `limit` and by how many records of at least `min_record` bytes the rest
    /// of the input could hold, so that `Vec::with_capacity(count)` is always safe.
    pub(super) fn count(
        &mut self,
        raw: u64,
        limit: usize,
        min_record: usize,
        field: &'static str,
    ) -> Result<usize, WireError> {
        let fits = (self.buf.len() / min_record.max(1)) as u64;
        let limit = limit as u64;
        if raw > limit {
            return Err(WireError::TooLarge {
                field,
                value: raw,
                limit,
            });
        }
        if raw > fits {
            return Err(WireError::Truncated {
                field,
                needed: (raw - fits) as usize * min_record,
            });
        }
        Ok(raw as usize)
    }

    pub(super) fn string(&mut self, len: usize, field: &'static str) -> Result<String, WireError> {
        let bytes = self.take(len, field)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| WireError::NotUtf8 { field })
    }

    pub(super) fn finish(self, kind: &'static str) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(WireError::Trailing {
                kind,
                extra: self.buf.len(),
            })
        }
    }
}

pub(super) fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}
pub(super) fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}
pub(super) fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

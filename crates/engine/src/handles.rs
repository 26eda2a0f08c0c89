//! The handles of what is registered and published: registrations of memory and files, and a
//! connected peer's segments. Each is owned by the caller; dropping a registration unpublishes it.

use std::fmt;
use std::sync::Arc;

use ferry_core::{Access, Error, MemoryRegion, SegmentDesc, SegmentToken};
use ferry_file::FileSegment;

use crate::reconnect::PeerInner;
use crate::serve::RegistryTable;

/// A registered range, owned by the caller. Dropping it (or [`retire`](Self::retire)) unpublishes
/// it at once; its memory stays alive while requests still use it.
pub struct Registration {
    pub(crate) inner: Option<ferry_registry::Registration>,
    pub(crate) table: Arc<RegistryTable>,
    pub(crate) region: Arc<MemoryRegion>,
    pub(crate) token: SegmentToken,
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("token", &self.token)
            .field("inner", &self.inner)
            .finish()
    }
}

impl Registration {
    /// The token peers address it by.
    pub fn token(&self) -> SegmentToken {
        self.token
    }

    /// The registered memory.
    pub fn region(&self) -> &Arc<MemoryRegion> {
        &self.region
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.region.len() as u64
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.region.is_empty()
    }

    /// Unpublishes the range (peers' requests are refused as for an unknown token from now on)
    /// and releases it once no request uses it.
    pub fn retire(mut self) -> Result<(), Error> {
        let _span = tracing::info_span!("retire", token = %self.token).entered();
        let inner = self.inner.take();
        self.table.retire(self.token, || match inner {
            Some(r) => r.retire().map(|_| ()).map_err(Error::from),
            None => Ok(()),
        })
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let inner = self.inner.take();
        self.table.retire(self.token, || drop(inner));
    }
}

/// A published file segment (served by either portable data plane), owned by the caller.
/// Dropping it (or [`retire`](Self::retire)) unpublishes it: later requests naming its token are
/// refused as unknown; reads already running finish on the open file.
pub struct FileRegistration {
    pub(crate) table: Arc<RegistryTable>,
    pub(crate) file: Arc<FileSegment>,
    pub(crate) token: SegmentToken,
    pub(crate) name: String,
}

impl fmt::Debug for FileRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileRegistration")
            .field("name", &self.name)
            .field("token", &self.token)
            .field("file", &self.file)
            .finish()
    }
}

impl FileRegistration {
    /// The token peers address it by.
    pub fn token(&self) -> SegmentToken {
        self.token
    }

    /// The name it is published under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The file range served.
    pub fn file(&self) -> &Arc<FileSegment> {
        &self.file
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.file.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.file.is_empty()
    }

    /// The descriptor peers see in the handshake (no remote keys: files go over the wire).
    pub fn desc(&self) -> SegmentDesc {
        SegmentDesc {
            name: self.name.clone(),
            token: self.token,
            len: self.file.len(),
            access: self.file.access(),
            remote_keys: Vec::new(),
        }
    }

    /// Unpublishes the file segment.
    pub fn retire(self) {
        drop(self);
    }
}

impl Drop for FileRegistration {
    fn drop(&mut self) {
        self.table.retire(self.token, || ());
    }
}

/// A segment published by a peer, as an op target.
#[derive(Clone)]
pub struct RemoteSegment {
    pub(crate) peer: Arc<PeerInner>,
    pub(crate) desc: SegmentDesc,
}

impl fmt::Debug for RemoteSegment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteSegment")
            .field("peer", &self.peer.addr)
            .field("desc", &self.desc)
            .finish()
    }
}

impl RemoteSegment {
    /// Its descriptor.
    pub fn desc(&self) -> &SegmentDesc {
        &self.desc
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.desc.name
    }

    /// Its length.
    pub fn len(&self) -> u64 {
        self.desc.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.desc.len == 0
    }

    /// What we may do to it.
    pub fn access(&self) -> Access {
        self.desc.access
    }
}

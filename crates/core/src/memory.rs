//! Registered memory: a range of bytes whose address stays fixed for as long as any handle to it
//! lives, so that transports (and, for RDMA, the NIC) can read and write it directly.
//!
//! Concurrency model: like any RDMA-registered buffer, a region can be written by the network while
//! the application reads it. Ferry's contract is at the level of requests: bytes a request moves
//! are defined once its outcome says so (and the buffer is reusable once `drained`). The copy
//! helpers here use raw pointer copies and never create Rust references that outlive the call, so
//! overlapping use from two threads yields unspecified bytes, not a dangling reference.

use std::alloc::Layout;
use std::any::Any;
use std::fmt;
use std::ptr::NonNull;

/// A range that falls outside a region or segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("range {offset}+{len} is out of bounds of a {size}-byte region")]
pub struct OutOfBounds {
    /// Start of the requested range.
    pub offset: u64,
    /// Length of the requested range.
    pub len: u64,
    /// Size of the region.
    pub size: u64,
}

/// Host memory could not be allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot allocate {len} bytes aligned to {align}")]
pub struct AllocError {
    /// Requested length.
    pub len: usize,
    /// Requested alignment.
    pub align: usize,
}

/// Checks that `offset..offset+len` lies inside `size` bytes, without overflow.
pub fn check_range(offset: u64, len: u64, size: u64) -> Result<(), OutOfBounds> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(OutOfBounds { offset, len, size }),
    }
}

enum Owner {
    /// Allocated here with this layout; freed on drop.
    Aligned(Layout),
    /// Memory someone else owns; dropping the box releases it (or does nothing for `'static`).
    External(#[allow(dead_code)] Box<dyn Any + Send + Sync>),
    /// A memfd mapped here ([`MemoryRegion::alloc_shareable`]); revoked and unmapped on drop.
    Memfd(SharedMemory),
}

/// Where a region's bytes live.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub enum Placement {
    /// Host memory: Ferry reads and writes it by address (every transport may use it).
    #[default]
    Host,
    /// GPU memory registered for GPUDirect RDMA, or granted by CUDA IPC: only a NIC (by DMA) or
    /// the same-host plane's server (by the driver's copies) reaches it; it has no
    /// host-addressable bytes, so the host copies here refuse it and only the transport its
    /// [`DeviceNative`] names is ever given it (the facade routes device memory elsewhere through
    /// staging).
    Device(DevicePlacement),
}

/// Where device memory lives and how a NIC registers it.
#[derive(Clone, Debug)]
pub struct DevicePlacement {
    /// The CUDA device ordinal.
    pub ordinal: u32,
    /// The device's PCI bus id, lower-case (`0000:17:00.0`).
    pub pci_bus_id: String,
    /// How the NIC registers it.
    pub native: DeviceNative,
}

/// How a NIC registers device memory (the GPUDirect route chosen for it).
#[derive(Clone, Debug)]
pub enum DeviceNative {
    /// peermem: `ibv_reg_mr` on the device address, which a peer-memory client
    /// (`nvidia_peermem`, `nv_peer_mem`) resolves.
    Peermem,
    /// dma-buf: `ibv_reg_dmabuf_mr` of `offset..offset+len` of the exported dma-buf `fd`,
    /// addressed by the device address (the iova).
    Dmabuf {
        /// The dma-buf (from `cuMemGetHandleForAddressRange`); kept open while the region lives.
        fd: std::sync::Arc<std::os::fd::OwnedFd>,
        /// The region's offset in the dma-buf.
        offset: u64,
    },
    /// CUDA IPC (same host, another process): the region is `offset..offset+len` of the device
    /// allocation whose `cuIpcGetMemHandle` handle this is. Only the same-host plane is given
    /// it (its server opens the handle and copies device to device); no NIC registers it.
    CudaIpc {
        /// The allocation's CUDA IPC handle (`CUipcMemHandle`, 64 bytes).
        handle: [u8; 64],
        /// The region's offset in that allocation.
        offset: u64,
    },
}

/// A fixed range of memory that Ferry may read and write by address: host memory, or (for
/// GPUDirect RDMA only) device memory that only a NIC reaches ([`Placement::Device`]).
pub struct MemoryRegion {
    ptr: NonNull<u8>,
    len: usize,
    placement: Placement,
    owner: Owner,
}

// SAFETY: the region owns (or keeps alive through `Owner::External`, which is `Send + Sync`) a plain
// byte range; access goes through raw copies documented in the module's concurrency model.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above; `&MemoryRegion` only hands out raw copies and addresses, never aliasing `&mut`.
unsafe impl Sync for MemoryRegion {}

/// Default alignment of regions allocated by Ferry: a page, so they suit O_DIRECT and NIC DMA.
pub const PAGE_ALIGN: usize = 4096;

/// The size of a transparent huge page on x86-64 and most arm64 kernels: the unit
/// [`MemoryRegion::alloc_zeroed`] advises.
pub const HUGE_PAGE: usize = 2 << 20;

/// Advises the whole huge pages inside `ptr..ptr+len` as transparent huge pages (Linux).
fn advise_huge_pages(ptr: NonNull<u8>, len: usize) {
    #[cfg(target_os = "linux")]
    {
        let start = (ptr.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
        let end = (ptr.as_ptr() as usize + len) & !(HUGE_PAGE - 1);
        if end > start {
            // SAFETY: `start..end` lies inside the allocation just made, which nothing else
            // references yet; MADV_HUGEPAGE changes no byte of it, only how it is backed.
            let rc = unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE)
            };
            if rc != 0 {
                tracing::debug!(error = %std::io::Error::last_os_error(),
                    "MADV_HUGEPAGE refused; the region keeps small pages");
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

impl MemoryRegion {
    /// Allocates `len` zeroed bytes aligned to `align` (a power of two). A zero-length region is
    /// allowed and has a dangling, well-aligned address. On Linux the whole huge pages inside a
    /// region of at least [`HUGE_PAGE`] bytes are advised as transparent huge pages
    /// (`MADV_HUGEPAGE`, a hint the kernel may ignore): the kernel's cross-process copies (the
    /// same-host plane) and NIC registrations then pin one page where there were 512.
    pub fn alloc_zeroed(len: usize, align: usize) -> Result<Self, AllocError> {
        let err = AllocError { len, align };
        let layout = Layout::from_size_align(len.max(1), align.max(1)).map_err(|_| err)?;
        // SAFETY: `layout` has a nonzero size (len.max(1)) and a valid power-of-two alignment.
        let raw = unsafe { std::alloc::alloc(layout) };
        let ptr = NonNull::new(raw).ok_or(err)?;
        // Advised before the zeroing touches the pages, so that fresh memory faults in as huge
        // pages (the allocator's own zeroing would fault it in as small ones first).
        advise_huge_pages(ptr, len);
        // SAFETY: `raw` is valid for writes of `layout.size()` bytes, unshared.
        unsafe { std::ptr::write_bytes(raw, 0, layout.size()) };
        Ok(Self {
            ptr,
            len,
            placement: Placement::Host,
            owner: Owner::Aligned(layout),
        })
    }

    /// Allocates `len` zeroed bytes in a memfd of its own (page-aligned, sealed against shrinking
    /// and growing), which a same-host peer may be granted for one-sided copies (see
    /// [`crate::share`] for who and how); [`shared`](Self::shared) is its share state. The
    /// memfd is never reused: when the region is dropped (its registration ended and no request
    /// holds it), sharing is revoked (the revoked word at [`SHARED_REVOKED_AT`] set, then the
    /// bytes discarded) before the mapping goes.
    pub fn alloc_shareable(len: usize) -> Result<Self, std::io::Error> {
        let shared = SharedMemory::create(len)?;
        Ok(Self {
            ptr: shared.map,
            len,
            placement: Placement::Host,
            owner: Owner::Memfd(shared),
        })
    }

    /// The memfd the region lives in, when it was allocated shareable.
    pub fn shared(&self) -> Option<&SharedMemory> {
        match &self.owner {
            Owner::Memfd(s) => Some(s),
            _ => None,
        }
    }

    /// Takes ownership of a vector's bytes (its heap buffer never moves while the region lives).
    pub fn from_vec(v: Vec<u8>) -> Self {
        let mut boxed = v.into_boxed_slice();
        let len = boxed.len();
        let ptr = NonNull::new(boxed.as_mut_ptr()).unwrap_or(NonNull::dangling());
        Self {
            ptr,
            len,
            placement: Placement::Host,
            owner: Owner::External(Box::new(boxed)),
        }
    }

    /// A region over memory that `keepalive` owns; dropping the region drops `keepalive`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes for as long as `keepalive` is alive, must
    /// not move, and must not be accessed through Rust references elsewhere while Ferry may use it.
    pub unsafe fn from_raw_parts(
        ptr: NonNull<u8>,
        len: usize,
        keepalive: Box<dyn Any + Send + Sync>,
    ) -> Self {
        Self {
            ptr,
            len,
            placement: Placement::Host,
            owner: Owner::External(keepalive),
        }
    }

    /// A region over device memory at device address `addr`, for GPUDirect RDMA registration
    /// only: its address is what a NIC is given, and the host copies of this type
    /// ([`read_at`](Self::read_at), [`write_at`](Self::write_at), the slices) refuse it as having
    /// no host bytes. Dropping the region drops `keepalive`.
    ///
    /// # Safety
    /// `addr..addr+len` must be one device allocation (or part of one) on the device `placement`
    /// names, live and unmoved for as long as `keepalive` is alive; the region must only be
    /// handed to a transport that reaches it by DMA (the RDMA transport) or, for
    /// [`DeviceNative::CudaIpc`], by the driver (the same-host plane), never one that
    /// dereferences `as_ptr()` on the host.
    pub unsafe fn device(
        addr: u64,
        len: usize,
        placement: DevicePlacement,
        keepalive: Box<dyn Any + Send + Sync>,
    ) -> Self {
        Self {
            ptr: NonNull::new(addr as usize as *mut u8).unwrap_or(NonNull::dangling()),
            len,
            placement: Placement::Device(placement),
            owner: Owner::External(keepalive),
        }
    }

    /// Where the bytes live.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Whether the bytes are host memory (every region but a [`device`](Self::device) one).
    pub fn is_host(&self) -> bool {
        matches!(self.placement, Placement::Host)
    }

    /// Checks a range for host access: a device region has no host-addressable bytes.
    fn host_check(&self, offset: u64, len: u64) -> Result<(), OutOfBounds> {
        if self.is_host() {
            self.check(offset, len)
        } else {
            Err(OutOfBounds {
                offset,
                len,
                size: 0,
            })
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The base address (for native registration and zero-copy I/O).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Checks `offset..offset+len` against this region.
    pub fn check(&self, offset: u64, len: u64) -> Result<(), OutOfBounds> {
        check_range(offset, len, self.len as u64)
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    /// A device region has no host bytes: refused as out of bounds of zero host bytes.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), OutOfBounds> {
        self.host_check(offset, dst.len() as u64)?;
        // SAFETY: the range was bounds-checked above; `dst` is a distinct Rust buffer, so the two
        // ranges cannot overlap; the region's memory is valid while `self` lives.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset as usize),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        Ok(())
    }

    /// Copies `src` into the region starting at `offset`.
    /// A device region is refused as for [`read_at`](Self::read_at).
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), OutOfBounds> {
        self.host_check(offset, src.len() as u64)?;
        // SAFETY: bounds-checked above; `src` is a distinct Rust buffer (it cannot alias the region
        // because no safe API hands out references into it); the memory is valid while `self` lives.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.ptr.as_ptr().add(offset as usize),
                src.len(),
            );
        }
        Ok(())
    }

    /// Copies `len` bytes at `src_offset` of `src` into this region at `offset`: one CPU copy
    /// per byte, with no buffer between (`memmove`, so `src` may be this region and the
    /// ranges may overlap). Both ranges are checked first; a device region on either side is
    /// refused as for [`read_at`](Self::read_at), and nothing is copied.
    pub fn copy_from_region(
        &self,
        offset: u64,
        src: &MemoryRegion,
        src_offset: u64,
        len: u64,
    ) -> Result<(), OutOfBounds> {
        src.host_check(src_offset, len)?;
        self.host_check(offset, len)?;
        // SAFETY: both ranges were bounds-checked against host regions above, so `len` fits in
        // `usize` and both lie in memory valid while `self` and `src` live; `ptr::copy` (a
        // memmove) allows the ranges to overlap; no Rust reference into either region is formed.
        unsafe {
            std::ptr::copy(
                src.ptr.as_ptr().add(src_offset as usize),
                self.ptr.as_ptr().add(offset as usize),
                len as usize,
            );
        }
        Ok(())
    }

    /// Extends `crc` (the CRC-32C of earlier bytes, as `crc32c_append` takes it) with
    /// `offset..offset+len` of this region read where it lies, with no copy: 8-byte raw reads fed
    /// straight to the CPU's CRC-32C instruction, three streams at once (joined with
    /// `crc32c_combine`). No Rust reference into the region is formed, so a concurrent transfer
    /// into the range makes the value meaningless but is not undefined behaviour (the module's
    /// concurrency model). `Ok(None)`: this CPU offers no such instruction here (x86-64 without
    /// SSE 4.2, or another architecture): copy the range out and hash the copy instead. A
    /// device region is refused as for [`read_at`](Self::read_at).
    pub fn crc32c_in_place(
        &self,
        crc: u32,
        offset: u64,
        len: u64,
    ) -> Result<Option<u32>, OutOfBounds> {
        self.host_check(offset, len)?;
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("sse4.2") {
            // SAFETY: the range was bounds-checked against this host region (so it fits in
            // `usize` and is valid while `self` lives), and SSE 4.2 was detected just above.
            return Ok(Some(unsafe {
                crc32c_sse42(crc, self.ptr.as_ptr().add(offset as usize), len as usize)
            }));
        }
        let _ = crc;
        Ok(None)
    }

    /// A shared view of `offset..offset+len`, for handing to a syscall that reads it.
    ///
    /// # Safety
    /// Nothing may write the range (locally or through the network) while the slice is alive.
    pub unsafe fn slice(&self, offset: u64, len: usize) -> Result<&[u8], OutOfBounds> {
        self.host_check(offset, len as u64)?;
        // SAFETY: bounds-checked; the caller guarantees no concurrent writes for the slice's life.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset as usize), len) })
    }

    /// An exclusive view of `offset..offset+len`, for handing to a syscall that fills it.
    ///
    /// # Safety
    /// Nothing else may read or write the range while the slice is alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: u64, len: usize) -> Result<&mut [u8], OutOfBounds> {
        self.host_check(offset, len as u64)?;
        // SAFETY: bounds-checked; the caller guarantees exclusive use of the range.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset as usize), len) })
    }
}

/// CRC-32C register update over `len` bytes at `p` (the register before the final inversion).
///
/// # Safety
/// `p..p+len` must be valid for reads; the CPU must have SSE 4.2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_update(mut reg: u64, p: *const u8, len: usize) -> u64 {
    use std::arch::x86_64::{_mm_crc32_u8, _mm_crc32_u64};
    let mut i = 0;
    while i + 8 <= len {
        // SAFETY: `i + 8 <= len`, inside the caller's valid range; unaligned raw read.
        reg = _mm_crc32_u64(reg, unsafe { p.add(i).cast::<u64>().read_unaligned() });
        i += 8;
    }
    while i < len {
        // SAFETY: `i < len`, inside the caller's valid range.
        reg = u64::from(_mm_crc32_u8(reg as u32, unsafe { p.add(i).read() }));
        i += 1;
    }
    reg
}

/// `crc32c_append(crc, bytes at p..p+len)` over raw memory: three independent streams over
/// thirds of the range (the CRC instruction's latency hidden), joined with `crc32c_combine`,
/// then the tail.
///
/// # Safety
/// `p..p+len` must be valid for reads; the CPU must have SSE 4.2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn crc32c_sse42(crc: u32, p: *const u8, len: usize) -> u32 {
    use std::arch::x86_64::_mm_crc32_u64;
    let third = len / 24 * 8;
    if third < 512 {
        // SAFETY: the caller's range, the caller's CPU.
        return !(unsafe { crc32c_update(u64::from(!crc), p, len) } as u32);
    }
    let (mut a, mut b, mut c) = (u64::from(!crc), u64::from(u32::MAX), u64::from(u32::MAX));
    // SAFETY: `3 * third <= len`: the three streams stay in the caller's range.
    let (pb, pc) = unsafe { (p.add(third), p.add(2 * third)) };
    let mut i = 0;
    while i < third {
        // SAFETY: `i + 8 <= third`, so each read lies in its stream's third of the range.
        unsafe {
            a = _mm_crc32_u64(a, p.add(i).cast::<u64>().read_unaligned());
            b = _mm_crc32_u64(b, pb.add(i).cast::<u64>().read_unaligned());
            c = _mm_crc32_u64(c, pc.add(i).cast::<u64>().read_unaligned());
        }
        i += 8;
    }
    let ab = ::crc32c::crc32c_combine(!(a as u32), !(b as u32), third);
    let abc = ::crc32c::crc32c_combine(ab, !(c as u32), third);
    // SAFETY: the tail `3 * third..len` lies in the caller's range.
    !(unsafe { crc32c_update(u64::from(!abc), p.add(3 * third), len - 3 * third) } as u32)
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if let Owner::Aligned(layout) = self.owner {
            // SAFETY: `ptr` was returned by `alloc_zeroed(layout)` and is freed exactly once here.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}

/// Bytes of a shareable memfd past its region's (rounded up to a page): the header page, where
/// the word at [`SHARED_REVOKED_AT`] says whether sharing is revoked.
pub const SHARED_HEADER: usize = 4096;

/// Offset, in a shareable memfd, of the header page: just past the region's bytes rounded up to
/// a page (the region starts at offset 0). Its first `u32` is the revoked word: 0 while the
/// registration lives, 1 from its revocation on.
pub fn shared_header_at(len: usize) -> usize {
    len.max(1).next_multiple_of(SHARED_HEADER)
}

/// The revoked word's offset in the header page.
pub const SHARED_REVOKED_AT: usize = 0;

/// The memfd of a region allocated shareable ([`MemoryRegion::alloc_shareable`]): its
/// descriptor (for the same-host plane to grant), its mapping here, and its share state
/// ([`crate::share::ShareState`], behind a lock: grants are made by serving threads, the
/// revocation by the region's drop).
pub struct SharedMemory {
    fd: std::os::fd::OwnedFd,
    map: NonNull<u8>,
    /// Bytes mapped: the region's rounded up to a page, and the header page.
    map_len: usize,
    state: std::sync::Mutex<crate::share::ShareState>,
}

impl SharedMemory {
    fn create(len: usize) -> std::io::Result<Self> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let header = shared_header_at(len);
        let map_len = header + SHARED_HEADER;
        // SAFETY: a valid C string and flags; returns a new descriptor or -1.
        let raw = unsafe {
            libc::memfd_create(
                c"ferry-shared".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the kernel just made `raw` for us; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(map_len)
            .map_err(|_| std::io::Error::other("a shareable region too large"))?;
        // SAFETY: a valid descriptor and a length.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        // SAFETY: fcntl on a valid descriptor with an int argument.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh shared mapping of the whole memfd (sealed at `map_len` bytes, so no
        // access inside it can fault); no address hint, so nothing of ours is replaced.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let map = NonNull::new(ptr.cast::<u8>()).ok_or_else(std::io::Error::last_os_error)?;
        advise_huge_pages(map, header);
        Ok(Self {
            fd,
            map,
            map_len,
            state: std::sync::Mutex::new(crate::share::ShareState::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, crate::share::ShareState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The memfd (its length: [`len`](Self::len)).
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    /// Bytes of the memfd: the region's rounded up to a page, then [`SHARED_HEADER`].
    pub fn len(&self) -> usize {
        self.map_len
    }

    /// Never true (a memfd has at least its header page); for symmetry with `len`.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The share state now.
    pub fn state(&self) -> crate::share::ShareState {
        *self.lock()
    }

    /// Decides whether a peer whose view resolves the segment (`visible`) with `access` is
    /// granted this memfd ([`crate::share::ShareState::decide`]), applies the seal that grant
    /// needs and records it; the caller then sends [`fd`](Self::fd). A seal the kernel refuses
    /// (a kernel before 5.1 has no `F_SEAL_FUTURE_WRITE`) refuses the grant as not shareable.
    pub fn grant(
        &self,
        visible: bool,
        access: crate::Access,
    ) -> Result<crate::share::Grant, crate::share::ShareRefusal> {
        use crate::share::{Seal, ShareRefusal};
        use std::os::fd::AsRawFd;
        let mut state = self.lock();
        let (grant, seal) = state.decide(visible, access)?;
        let seals = match seal {
            Seal::Already => 0,
            Seal::FutureWrite => libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL,
            Seal::Close => libc::F_SEAL_SEAL,
        };
        // SAFETY: fcntl on a valid descriptor with an int argument.
        if seals != 0 && unsafe { libc::fcntl(self.fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0
        {
            tracing::debug!(error = %std::io::Error::last_os_error(),
                "cannot seal a shareable memfd; it is not granted");
            return Err(ShareRefusal::NotShareable);
        }
        state.granted(grant);
        Ok(grant)
    }

    /// Ends sharing: the revoked word set (a peer sees it before or after its copy and fails
    /// it), then the bytes discarded as the state says (punched out, else zeroed here), so no
    /// late access of a peer reads them. The size never changes: a late access never faults.
    fn revoke(&self) {
        use crate::share::Discard;
        use std::os::fd::AsRawFd;
        let discard = self.lock().revoke();
        let header = self.map_len - SHARED_HEADER;
        // SAFETY: the header page lies inside the mapping (`header + SHARED_HEADER == map_len`),
        // 4-aligned; an atomic may alias memory another process reads or writes.
        let word = unsafe {
            &*self
                .map
                .as_ptr()
                .add(header + SHARED_REVOKED_AT)
                .cast::<std::sync::atomic::AtomicU32>()
        };
        word.store(1, std::sync::atomic::Ordering::SeqCst);
        let zero = match discard {
            Discard::Nothing => false,
            Discard::Zero => true,
            Discard::Punch => {
                // SAFETY: fallocate on a valid descriptor; the range lies inside the memfd.
                let rc = unsafe {
                    libc::fallocate(
                        self.fd.as_raw_fd(),
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                        0,
                        header as libc::off_t,
                    )
                };
                rc != 0
            }
        };
        if zero {
            // SAFETY: `map..map+header` is the region's part of the mapping, which is ours and
            // writable until unmapped below; no Rust reference into it exists (the region that
            // handed out addresses is being dropped).
            unsafe { std::ptr::write_bytes(self.map.as_ptr(), 0, header) };
        }
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        self.revoke();
        // SAFETY: the mapping made in `create`, of this length; the region that pointed into it
        // is being dropped, so nothing of ours uses it after this.
        unsafe { libc::munmap(self.map.as_ptr().cast(), self.map_len) };
    }
}

impl fmt::Debug for SharedMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedMemory")
            .field("len", &self.map_len)
            .field("state", &self.state())
            .finish()
    }
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .field("placement", &self.placement)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `VmFlags` of the mapping of this process that holds `addr` (`/proc/self/smaps`).
    #[cfg(target_os = "linux")]
    fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split(' ').next().unwrap_or("");
            if let Some((a, b)) = range.split_once('-')
                && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            {
                inside = a <= addr && addr < b;
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.trim().to_owned();
            }
        }
        panic!("no mapping holds {addr:#x}")
    }

    /// A region of several huge pages has those inside it advised as transparent huge pages
    /// (the mapping's `hg` flag).
    #[test]
    #[cfg(target_os = "linux")]
    fn a_large_region_is_advised_as_huge_pages() {
        let thp = "/sys/kernel/mm/transparent_hugepage/enabled";
        if !std::path::Path::new(thp).exists() {
            assert!(
                std::env::var_os("FERRY_REQUIRE_SYSFS").is_none(),
                "{thp} is missing (FERRY_REQUIRE_SYSFS is set)"
            );
            eprintln!("skipped: {thp} is missing (a kernel without transparent huge pages)");
            return;
        }
        let r = MemoryRegion::alloc_zeroed(8 * HUGE_PAGE, PAGE_ALIGN).unwrap();
        let inner = (r.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
        let flags = vm_flags(inner);
        assert!(flags.split(' ').any(|f| f == "hg"), "VmFlags: {flags}");
    }

    #[test]
    fn a_device_region_has_no_host_bytes() {
        let placement = DevicePlacement {
            ordinal: 0,
            pci_bus_id: "0000:17:00.0".into(),
            native: DeviceNative::Peermem,
        };
        // SAFETY: the region is never given to a transport, and its host accessors refuse it
        // before touching the (fake, non-canonical) address.
        let r = unsafe { MemoryRegion::device(1 << 62, 4096, placement, Box::new(())) };
        assert!(!r.is_host());
        assert_eq!(r.as_ptr() as u64, 1 << 62);
        assert!(r.check(0, 4096).is_ok(), "bounds are the device range's");
        let mut buf = [0u8; 8];
        assert_eq!(r.read_at(0, &mut buf).unwrap_err().size, 0);
        assert_eq!(r.write_at(0, &buf).unwrap_err().size, 0);
        // SAFETY: refused before any view is made.
        assert!(unsafe { r.slice(0, 8) }.is_err());
        // SAFETY: as above.
        assert!(unsafe { r.slice_mut(0, 8) }.is_err());
        assert!(MemoryRegion::from_vec(vec![1]).is_host());
    }

    #[test]
    fn alloc_is_aligned_and_zeroed() {
        let r = MemoryRegion::alloc_zeroed(10_000, PAGE_ALIGN).unwrap();
        assert_eq!(r.as_ptr() as usize % PAGE_ALIGN, 0);
        let mut buf = vec![1u8; 10_000];
        r.read_at(0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
    }

    #[test]
    fn write_then_read_and_bounds() {
        let r = MemoryRegion::from_vec(vec![0; 16]);
        r.write_at(3, b"abc").unwrap();
        let mut out = [0u8; 3];
        r.read_at(3, &mut out).unwrap();
        assert_eq!(&out, b"abc");
        assert_eq!(
            r.write_at(15, b"ab"),
            Err(OutOfBounds {
                offset: 15,
                len: 2,
                size: 16
            })
        );
        assert!(r.check(u64::MAX, 2).is_err());
        assert!(r.check(16, 0).is_ok());
    }

    #[test]
    fn a_region_to_region_copy_moves_the_bytes_once_and_checks_both_ranges() {
        let src = MemoryRegion::from_vec((0..64u8).collect());
        let dst = MemoryRegion::alloc_zeroed(32, PAGE_ALIGN).unwrap();
        dst.copy_from_region(4, &src, 10, 20).unwrap();
        let mut out = [0u8; 32];
        dst.read_at(0, &mut out).unwrap();
        assert_eq!(&out[..4], &[0; 4]);
        assert_eq!(out[4..24], (10..30u8).collect::<Vec<_>>()[..]);
        assert_eq!(&out[24..], &[0; 8]);
        // Out of either range: refused, nothing copied.
        assert!(dst.copy_from_region(20, &src, 0, 13).is_err());
        assert!(dst.copy_from_region(0, &src, 60, 5).is_err());
        assert!(dst.copy_from_region(0, &src, u64::MAX, 2).is_err());
        dst.read_at(0, &mut out).unwrap();
        assert_eq!(out[..4], [0; 4]);
        // Within one region, overlapping.
        src.copy_from_region(1, &src, 0, 8).unwrap();
        let mut head = [0u8; 9];
        src.read_at(0, &mut head).unwrap();
        assert_eq!(head, [0, 0, 1, 2, 3, 4, 5, 6, 7]);
        // A device region on either side has no host bytes.
        let placement = DevicePlacement {
            ordinal: 0,
            pci_bus_id: "0000:17:00.0".into(),
            native: DeviceNative::Peermem,
        };
        // SAFETY: never given to a transport; the copy refuses it before touching the address.
        let dev = unsafe { MemoryRegion::device(1 << 62, 4096, placement, Box::new(())) };
        assert!(dev.copy_from_region(0, &src, 0, 8).is_err());
        assert!(dst.copy_from_region(0, &dev, 0, 8).is_err());
    }

    #[test]
    fn a_crc_in_place_equals_the_crc_of_a_copy() {
        let bytes: Vec<u8> = (0..300_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect();
        let r = MemoryRegion::from_vec(bytes.clone());
        if r.crc32c_in_place(0, 0, 8).unwrap().is_none() {
            // No CRC instruction here: the caller copies out (covered by its own tests).
            return;
        }
        for (off, len) in [
            (0, 0),
            (0, 1),
            (3, 7),
            (5, 100),
            (1, 12_287),
            (0, 12_288),
            (7, 299_993),
            (0, 300_000),
        ] {
            for seed in [0u32, 0xdead_beef] {
                let want = ::crc32c::crc32c_append(seed, &bytes[off..off + len]);
                let got = r.crc32c_in_place(seed, off as u64, len as u64).unwrap();
                assert_eq!(got, Some(want), "{off}+{len} from {seed:#x}");
            }
        }
        assert!(r.crc32c_in_place(0, 299_999, 2).is_err());
        let placement = DevicePlacement {
            ordinal: 0,
            pci_bus_id: "0000:17:00.0".into(),
            native: DeviceNative::Peermem,
        };
        // SAFETY: never given to a transport; refused before its address is touched.
        let dev = unsafe { MemoryRegion::device(1 << 62, 4096, placement, Box::new(())) };
        assert!(dev.crc32c_in_place(0, 0, 8).is_err());
    }

    #[test]
    fn impossible_alloc_is_an_error() {
        assert!(MemoryRegion::alloc_zeroed(usize::MAX - 10, PAGE_ALIGN).is_err());
    }
}

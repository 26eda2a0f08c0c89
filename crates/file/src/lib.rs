//! File segments: a file's byte range published to peers like registered memory, and the
//! portable way to load a file range into registered memory. Nothing here needs io_uring, so
//! every data plane (TCP included) serves and reads files.
//!
//! - [`FileSegment`]: opens a file or a sub-range of it (its size now; the range must lie inside
//!   it), with write access only when [`Access::REMOTE_WRITE`](ferry_core::Access) is asked
//!   for. It implements [`ferry_core::FileSource`]: [`check`](FileSegment::check) tests access
//!   first, then bounds (a WRITE also against the file's size now, so a peer can never extend
//!   the file), and the positioned read and write name the file and range in their errors. A
//!   second O_DIRECT descriptor is opened where the filesystem offers it (tmpfs does not); drivers
//!   that do their own I/O (the io_uring transport, which recognizes a `FileSegment` by
//!   downcasting the `FileSource`) take the descriptors from [`FileSegment::read_fd`] and
//!   [`FileSegment::write_fd`].
//! - [`read_file_into`] and [`FileSegment::read_into`]: positioned reads (`pread`) of up to 1 MiB
//!   through a bounce buffer into a [`MemoryRegion`](ferry_core::MemoryRegion); a file that ends
//!   before the range does is an error, never a short count.
//!
//! Errors are [`FileError`] (which converts into [`ferry_core::Error`]). No features; Unix only
//! (positioned I/O, `O_DIRECT`).
#![forbid(unsafe_code)]

mod error;
mod segment;

pub use error::FileError;
pub use segment::{DIRECT_ALIGN, FileSegment, read_file_into};

//! The crate's error enum.

use std::io;
use std::path::PathBuf;

/// What went wrong opening, checking or reading a file. Converts into [`ferry_core::Error`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileError {
    /// A file could not be opened (or its size read).
    #[error("opening file {path}: {source}")]
    OpenFile {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Reading a file failed (a file that ended early included).
    #[error("reading file {path} at offset {offset}: {source}")]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// File offset of the failed read.
        offset: u64,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A range is outside the file, the file segment or the destination region.
    #[error("range {offset}+{len} is outside {what} of {size} bytes")]
    OutOfRange {
        /// `"file"`, `"file segment"` or `"region"`.
        what: &'static str,
        /// Start.
        offset: u64,
        /// Length.
        len: u64,
        /// Size of the thing.
        size: u64,
    },
}

impl From<FileError> for ferry_core::Error {
    fn from(e: FileError) -> Self {
        match e {
            FileError::OpenFile { path, source } => {
                ferry_core::Error::io("open file", path.display().to_string(), source)
            }
            FileError::ReadFile { path, source, .. } => {
                ferry_core::Error::io("read file", path.display().to_string(), source)
            }
            e @ FileError::OutOfRange { .. } => ferry_core::Error::InvalidRequest {
                reason: e.to_string(),
            },
        }
    }
}

//! The crate's one error type.

use std::io;

/// Everything that can go wrong loading libibverbs or calling a verb through it.
///
/// Load failures (`Unavailable`, `MissingSymbol`) carry the dynamic loader's reason as text and
/// display as `<library>: <reason>`, so the library is always named first.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// The library could not be opened at all.
    #[error("{library}: {reason}")]
    Unavailable {
        /// The library name or path that was tried.
        library: String,
        /// The dynamic loader's reason (`dlerror` text, library prefix removed).
        reason: String,
    },
    /// The library opened, but a required export is missing.
    #[error("{library}: missing required export `{symbol}`: {reason}")]
    MissingSymbol {
        /// The library name or path that was opened.
        library: String,
        /// The first required export that did not resolve.
        symbol: &'static str,
        /// The dynamic loader's reason.
        reason: String,
    },
    /// An optional export this call needs is absent from the loaded library.
    #[error("{library}: optional export `{symbol}` is absent, so this verb is unsupported")]
    Unsupported {
        /// The library name or path that was opened.
        library: String,
        /// The absent export.
        symbol: &'static str,
    },
    /// A verb returned an error.
    #[error("{verb} failed on {device}: {source}")]
    Verb {
        /// The verb, e.g. `ibv_query_port`.
        verb: &'static str,
        /// The device it was called on (or `<unknown device>`).
        device: String,
        /// The errno the verb reported.
        #[source]
        source: io::Error,
    },
}

/// The loader's error: the same enum, named for what callers of [`crate::Verbs::load`] expect.
pub type LoadError = VerbsError;

impl VerbsError {
    /// The library named by a load failure (`Unavailable`, `MissingSymbol`, `Unsupported`).
    pub fn library(&self) -> Option<&str> {
        match self {
            Self::Unavailable { library, .. }
            | Self::MissingSymbol { library, .. }
            | Self::Unsupported { library, .. } => Some(library),
            Self::Verb { .. } => None,
        }
    }

    /// Whether this error means "libibverbs could not be loaded" (library or required export
    /// missing), as opposed to a verb failing at run time.
    pub fn is_load_failure(&self) -> bool {
        matches!(self, Self::Unavailable { .. } | Self::MissingSymbol { .. })
    }

    /// The errno a failed verb reported, if this is a verb failure.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Self::Verb { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }

    /// A copy for the load cache (`io::Error` is not `Clone`; errno is kept).
    pub(crate) fn duplicate(&self) -> Self {
        match self {
            Self::Unavailable { library, reason } => Self::Unavailable {
                library: library.clone(),
                reason: reason.clone(),
            },
            Self::MissingSymbol {
                library,
                symbol,
                reason,
            } => Self::MissingSymbol {
                library: library.clone(),
                symbol,
                reason: reason.clone(),
            },
            Self::Unsupported { library, symbol } => Self::Unsupported {
                library: library.clone(),
                symbol,
            },
            Self::Verb {
                verb,
                device,
                source,
            } => Self::Verb {
                verb,
                device: device.clone(),
                source: match source.raw_os_error() {
                    Some(errno) => io::Error::from_raw_os_error(errno),
                    None => io::Error::new(source.kind(), source.to_string()),
                },
            },
        }
    }
}

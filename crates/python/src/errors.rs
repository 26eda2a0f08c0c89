//! Ferry's errors as Python exceptions: `FerryError` and one subclass per kind of
//! [`ferry::Error`], each raised with the message Rust gives (its `Display`, sources included).
//!
//! Where a kind has an obvious builtin counterpart the class derives from it too, so generic
//! handlers catch it: `Timeout` is a `TimeoutError`, `PeerLost` and `HandshakeRefused` are
//! `ConnectionError`s, `OutOfBounds`, `InvalidRequest` and `InvalidArgument` are `ValueError`s, `UnknownSegment`
//! (and `UnknownSegmentName`) are `LookupError`s, `IoError` is an `OSError`.
//!
//! The classes are made once per process with `type(name, bases, namespace)` (PyO3's
//! `create_exception!` takes a single base) and kept in a [`PyOnceLock`].

use ferry::{FailureKind, RemoteStatus};
use pyo3::exceptions::{
    PyConnectionError, PyException, PyLookupError, PyOSError, PyTimeoutError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// The exception classes, in the order of [`Kind`]'s discriminants.
static CLASSES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

/// One exception class of the hierarchy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    FerryError,
    Unavailable,
    PeerLost,
    StaleEpoch,
    ResourceExhausted,
    ProtocolMismatch,
    HandshakeRefused,
    UnknownSegment,
    UnknownSegmentName,
    OutOfBounds,
    AccessDenied,
    Timeout,
    Cancelled,
    Unquiesced,
    RegistrationError,
    Malformed,
    InvalidRequest,
    NoRoute,
    IoError,
    InvalidArgument,
    AuthenticationFailed,
    AuthKeyError,
    UnknownAddress,
}

/// Which builtin a class derives from besides its Ferry parent.
#[derive(Clone, Copy)]
enum Builtin {
    None,
    Connection,
    Lookup,
    Value,
    Timeout,
    Os,
}

/// Name, Ferry parent (`None`: `Exception`), extra builtin base, docstring.
const TABLE: &[(Kind, &str, Option<Kind>, Builtin, &str)] = &[
    (
        Kind::FerryError,
        "FerryError",
        None,
        Builtin::None,
        "Base class of every error Ferry raises. str(e) is the message the Rust engine gave.",
    ),
    (
        Kind::Unavailable,
        "Unavailable",
        Some(Kind::FerryError),
        Builtin::None,
        "A native library or kernel facility is not available (libibverbs, io_uring, ...).",
    ),
    (
        Kind::PeerLost,
        "PeerLost",
        Some(Kind::FerryError),
        Builtin::Connection,
        "The connection to the peer broke.",
    ),
    (
        Kind::StaleEpoch,
        "StaleEpoch",
        Some(Kind::FerryError),
        Builtin::None,
        "The peer at a known address restarted (new epoch); re-resolve it explicitly.",
    ),
    (
        Kind::ResourceExhausted,
        "ResourceExhausted",
        Some(Kind::FerryError),
        Builtin::None,
        "A registration budget would be exceeded; published ranges are never evicted to fit.",
    ),
    (
        Kind::ProtocolMismatch,
        "ProtocolMismatch",
        Some(Kind::FerryError),
        Builtin::None,
        "The two ends share no protocol version.",
    ),
    (
        Kind::HandshakeRefused,
        "HandshakeRefused",
        Some(Kind::FerryError),
        Builtin::Connection,
        "The peer refused the handshake.",
    ),
    (
        Kind::UnknownSegment,
        "UnknownSegment",
        Some(Kind::FerryError),
        Builtin::Lookup,
        "The peer knows no segment with that token (never published, or retired).",
    ),
    (
        Kind::UnknownSegmentName,
        "UnknownSegmentName",
        Some(Kind::UnknownSegment),
        Builtin::None,
        "The peer publishes no segment of that name.",
    ),
    (
        Kind::OutOfBounds,
        "OutOfBounds",
        Some(Kind::FerryError),
        Builtin::Value,
        "A range falls outside a local registration or a remote segment.",
    ),
    (
        Kind::AccessDenied,
        "AccessDenied",
        Some(Kind::FerryError),
        Builtin::None,
        "The segment does not grant the access right the op needs.",
    ),
    (
        Kind::Timeout,
        "Timeout",
        Some(Kind::FerryError),
        Builtin::Timeout,
        "A request, connection or handshake took longer than allowed.",
    ),
    (
        Kind::Cancelled,
        "Cancelled",
        Some(Kind::FerryError),
        Builtin::None,
        "The request was cancelled.",
    ),
    (
        Kind::Unquiesced,
        "Unquiesced",
        Some(Kind::FerryError),
        Builtin::None,
        "A native destroy failed: the objects and their budget charges stay held.",
    ),
    (
        Kind::RegistrationError,
        "RegistrationError",
        Some(Kind::FerryError),
        Builtin::None,
        "Registering a range failed for a reason other than a budget.",
    ),
    (
        Kind::Malformed,
        "Malformed",
        Some(Kind::FerryError),
        Builtin::None,
        "A frame could not be decoded (or the peer could not parse a request).",
    ),
    (
        Kind::InvalidRequest,
        "InvalidRequest",
        Some(Kind::FerryError),
        Builtin::Value,
        "The request was malformed before anything moved (empty batch, mixed peers, ...).",
    ),
    (
        Kind::NoRoute,
        "NoRoute",
        Some(Kind::FerryError),
        Builtin::None,
        "No transport is offered by both ends.",
    ),
    (
        Kind::IoError,
        "IoError",
        Some(Kind::FerryError),
        Builtin::Os,
        "An I/O operation (bind, connect, open a file, ...) failed.",
    ),
    (
        Kind::InvalidArgument,
        "InvalidArgument",
        Some(Kind::FerryError),
        Builtin::Value,
        "An argument is out of its range (a negative offset, a zero count, a bad duration); the \
         message names it.",
    ),
    (
        Kind::AuthenticationFailed,
        "AuthenticationFailed",
        Some(Kind::HandshakeRefused),
        Builtin::None,
        "Authentication with the peer failed (a key it does not accept, or one side without keys).",
    ),
    (
        Kind::AuthKeyError,
        "AuthKeyError",
        Some(Kind::FerryError),
        Builtin::None,
        "An authentication key file cannot be used (missing, unreadable, malformed); the message \
         names the file.",
    ),
    (
        Kind::UnknownAddress,
        "UnknownAddress",
        Some(Kind::FerryError),
        Builtin::Lookup,
        "A raw address range lies inside no registration of that side (Mooncake/NIXL layers).",
    ),
];

fn make_classes(py: Python<'_>) -> PyResult<Vec<Py<PyType>>> {
    let mut made: Vec<Py<PyType>> = Vec::with_capacity(TABLE.len());
    for (i, (kind, name, parent, builtin, doc)) in TABLE.iter().enumerate() {
        debug_assert_eq!(*kind as usize, i, "TABLE follows Kind's order");
        let mut bases: Vec<Bound<'_, PyType>> = Vec::new();
        match parent {
            Some(p) => bases.push(made[*p as usize].bind(py).clone()),
            None => bases.push(py.get_type::<PyException>()),
        }
        match builtin {
            Builtin::None => {}
            Builtin::Connection => bases.push(py.get_type::<PyConnectionError>()),
            Builtin::Lookup => bases.push(py.get_type::<PyLookupError>()),
            Builtin::Value => bases.push(py.get_type::<PyValueError>()),
            Builtin::Timeout => bases.push(py.get_type::<PyTimeoutError>()),
            Builtin::Os => bases.push(py.get_type::<PyOSError>()),
        }
        let ns = PyDict::new(py);
        ns.set_item("__doc__", *doc)?;
        ns.set_item("__module__", "ferry")?;
        let class = py
            .get_type::<PyType>()
            .call1((*name, PyTuple::new(py, bases)?, ns))?
            .cast_into::<PyType>()?;
        made.push(class.unbind());
    }
    Ok(made)
}

/// The class of `kind`.
pub(crate) fn class(py: Python<'_>, kind: Kind) -> PyResult<Bound<'_, PyType>> {
    let classes = CLASSES.get_or_try_init(py, || make_classes(py))?;
    Ok(classes[kind as usize].bind(py).clone())
}

/// Adds every class to the module.
pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for (kind, name, ..) in TABLE {
        m.add(*name, class(m.py(), *kind)?)?;
    }
    Ok(())
}

/// A Python exception of `kind` with `message`.
pub(crate) fn err(py: Python<'_>, kind: Kind, message: String) -> PyErr {
    match class(py, kind) {
        Ok(cls) => PyErr::from_type(cls, message),
        Err(e) => e,
    }
}

/// The class an engine error maps to.
pub(crate) fn kind_of(e: &ferry::Error) -> Kind {
    use ferry::Error as E;
    match e {
        E::StaleEpoch { .. } => Kind::StaleEpoch,
        E::ProtocolMismatch { .. } => Kind::ProtocolMismatch,
        E::UnknownSegment { .. } => Kind::UnknownSegment,
        E::UnknownSegmentName { .. } => Kind::UnknownSegmentName,
        E::OutOfBounds { .. } => Kind::OutOfBounds,
        E::AccessDenied { .. } => Kind::AccessDenied,
        E::PeerLost { .. } => Kind::PeerLost,
        E::Timeout { .. } => Kind::Timeout,
        E::Cancelled => Kind::Cancelled,
        E::Unavailable { .. } => Kind::Unavailable,
        E::ResourceExhausted { .. } => Kind::ResourceExhausted,
        E::Unquiesced { .. } => Kind::Unquiesced,
        E::Register { .. } => Kind::RegistrationError,
        E::Malformed { .. } => Kind::Malformed,
        E::HandshakeRefused { .. } | E::TooManyStreams { .. } => Kind::HandshakeRefused,
        E::InvalidRequest { .. } => Kind::InvalidRequest,
        E::NoRoute { .. } => Kind::NoRoute,
        E::Io { .. } => Kind::IoError,
        E::Authentication { .. } | E::ServerIdentity { .. } => Kind::AuthenticationFailed,
        E::AuthKey { .. } => Kind::AuthKeyError,
        E::UnknownAddress { .. } => Kind::UnknownAddress,
        // `ferry::Error` is non-exhaustive: a kind added later is still a FerryError.
        _ => Kind::FerryError,
    }
}

/// An `InvalidArgument` (a `FerryError` and a `ValueError`) with `message`, which names the
/// argument.
pub(crate) fn invalid_argument(message: impl Into<String>) -> PyErr {
    let message = message.into();
    Python::attach(|py| err(py, Kind::InvalidArgument, message))
}

/// Converts an engine error into the matching Python exception, keeping Rust's message.
pub(crate) fn to_py(py: Python<'_>, e: ferry::Error) -> PyErr {
    err(py, kind_of(&e), e.to_string())
}

/// The class a request's failure maps to (see `Outcome.raise_for_failure`).
pub(crate) fn kind_of_failure(kind: FailureKind) -> Kind {
    match kind {
        FailureKind::Timeout => Kind::Timeout,
        FailureKind::Cancelled => Kind::Cancelled,
        FailureKind::PeerLost => Kind::PeerLost,
        FailureKind::Remote(RemoteStatus::UnknownSegment) => Kind::UnknownSegment,
        FailureKind::Remote(RemoteStatus::OutOfBounds) => Kind::OutOfBounds,
        FailureKind::Remote(RemoteStatus::AccessDenied) => Kind::AccessDenied,
        FailureKind::Remote(RemoteStatus::StaleEpoch) => Kind::StaleEpoch,
        FailureKind::Remote(RemoteStatus::Malformed) => Kind::Malformed,
        _ => Kind::FerryError,
    }
}

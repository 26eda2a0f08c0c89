//! Arguments as Python passes them: access strings, seconds, offsets and lengths, and
//! serializable values handed back as plain Python objects. Every other module of the crate
//! takes these from here, so none of them needs another's.

use std::time::Duration;

use ferry::Access;
use pyo3::prelude::*;

use crate::errors::{self, Kind};

/// Parses an access string: `"local"`, `"read"`, `"write"` or `"read+write"` (also `"rw"`).
pub(crate) fn parse_access(s: &str) -> PyResult<Access> {
    Ok(match s {
        "local" | "none" => Access::LOCAL,
        "read" | "r" => Access::REMOTE_READ,
        "write" | "w" => Access::REMOTE_WRITE,
        "read+write" | "rw" | "write+read" => Access::REMOTE_READ | Access::REMOTE_WRITE,
        other => {
            return Err(errors::invalid_argument(format!(
                "access must be \"local\", \"read\", \"write\" or \"read+write\", not {other:?}"
            )));
        }
    })
}

/// An access right as Python reads it.
pub(crate) fn access_name(a: Access) -> &'static str {
    match (
        a.contains(Access::REMOTE_READ),
        a.contains(Access::REMOTE_WRITE),
    ) {
        (true, true) => "read+write",
        (true, false) => "read",
        (false, true) => "write",
        (false, false) => "local",
    }
}

/// A serializable value as plain Python objects (dicts, lists, str, int, float, bool, None).
pub(crate) fn to_plain<'py>(
    py: Python<'py>,
    value: &impl serde::Serialize,
) -> PyResult<Bound<'py, PyAny>> {
    let text = serde_json::to_string(value)
        .map_err(|e| errors::err(py, Kind::FerryError, format!("internal error: {e}")))?;
    py.import("json")?.call_method1("loads", (text,))
}

/// Seconds (a non-negative number) as a `Duration`; `what` names the argument in errors.
pub(crate) fn seconds(what: &str, v: Option<f64>) -> PyResult<Option<Duration>> {
    match v {
        None => Ok(None),
        Some(s) if (0.0..1e9).contains(&s) => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(errors::invalid_argument(format!(
            "{what} must be a number of seconds from 0 to 1e9, not {s}"
        ))),
    }
}

/// A non-negative offset or length; `what` names the argument in errors.
pub(crate) fn non_negative(what: &str, v: i64) -> PyResult<u64> {
    u64::try_from(v).map_err(|_| errors::invalid_argument(format!("{what} must be >= 0, not {v}")))
}

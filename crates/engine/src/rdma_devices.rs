//! RDMA device discovery: IO-free logic over a [`DeviceEnumerator`].
//!
//! Devices are what `ibv_get_device_list` returns (through [`VerbsEnumerator`]), never a sysfs
//! listing alone. A missing libibverbs means "no RDMA devices": [`RdmaDevices::devices`] is empty
//! and the reason is kept, so a caller that needs RDMA gets the actionable error
//! (`no RDMA devices found: libibverbs.so.1 could not be loaded: <reason>`), not the loader's.
//! The list is enumerated exactly once per [`RdmaDevices::run`], however many filters are applied
//! and however they parse.

use std::error::Error as StdError;
use std::path::PathBuf;

use ferry_verbs_sys::{DeviceInfo, LoadError, Verbs};

/// Something that lists verbs devices. The real one is [`VerbsEnumerator`]; tests use mocks.
pub trait DeviceEnumerator {
    /// Lists the devices once. A load failure is an error here; [`RdmaDevices`] turns it into
    /// "no devices" plus a reason.
    fn enumerate(&self) -> Result<Vec<DeviceInfo>, LoadError>;
}

/// The real enumerator: libibverbs loaded at run time (the process-wide `libibverbs.so.1`, or
/// `$FERRY_IBVERBS_LIB`, or an explicit library from configuration).
#[derive(Debug, Clone, Default)]
pub struct VerbsEnumerator {
    library: Option<PathBuf>,
}

impl VerbsEnumerator {
    /// Enumerates through the process-wide library ([`Verbs::load`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// Enumerates through the libibverbs at `path` (configuration override).
    pub fn with_library(path: impl Into<PathBuf>) -> Self {
        Self {
            library: Some(path.into()),
        }
    }
}

impl DeviceEnumerator for VerbsEnumerator {
    fn enumerate(&self) -> Result<Vec<DeviceInfo>, LoadError> {
        let verbs = match &self.library {
            Some(path) => Verbs::load_from(path)?,
            None => Verbs::load()?,
        };
        verbs.devices()
    }
}

/// What `ferry topology` and `ferry doctor` show: the devices, or why there are none.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VerbsListing {
    /// The enumerated devices (empty when libibverbs is unavailable).
    pub devices: Vec<DeviceInfo>,
    /// Why enumeration could not run: the loader's message, naming the library
    /// (`libibverbs.so.1: cannot open shared object file: ...`). `None` when it ran.
    pub unavailable: Option<String>,
}

/// Lists the verbs devices of this machine through the real loader, once.
pub fn enumerate_verbs_devices() -> VerbsListing {
    RdmaDevices::run(&VerbsEnumerator::new()).listing()
}

/// Why discovery found no usable RDMA device.
#[derive(Debug)]
#[non_exhaustive]
pub enum RdmaDevicesError {
    /// libibverbs (or one of its required exports) could not be loaded.
    LoadLibrary {
        /// The library that was tried, e.g. `libibverbs.so.1`.
        library: String,
        /// The loader's reason, without the library prefix.
        reason: String,
    },
    /// The library loaded but `ibv_get_device_list` failed.
    EnumerateDevices {
        /// The failed verb, device and errno.
        detail: String,
    },
    /// The library loaded and listed no device.
    EmptyDeviceList,
    /// A user filter failed (e.g. it did not parse).
    ApplyFilter {
        /// The filter's own error.
        source: Box<dyn StdError + Send + Sync>,
    },
    /// Devices exist but the filters left none of them.
    NoDeviceMatched {
        /// The names of the enumerated devices, comma-separated.
        available: String,
    },
}

// Display and Error by hand: this crate depends on `ferry-core` under the name `core`, which
// shadows libcore for `thiserror`'s `::core::` paths.
impl std::fmt::Display for RdmaDevicesError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::LoadLibrary { library, reason } => write!(
                f,
                "no RDMA devices found: {library} could not be loaded: {reason}"
            ),
            Self::EnumerateDevices { detail } => write!(f, "no RDMA devices found: {detail}"),
            Self::EmptyDeviceList => f.write_str("no RDMA devices found: the device list is empty"),
            Self::ApplyFilter { source } => write!(f, "RDMA device filter failed: {source}"),
            Self::NoDeviceMatched { available } => write!(
                f,
                "no RDMA devices found: no device matches the filters (available: {available})"
            ),
        }
    }
}

impl StdError for RdmaDevicesError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            Self::ApplyFilter { source } => Some(source.as_ref()),
            _ => None,
        }
    }
}

/// Why there are no devices, kept from the one enumeration.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Failure {
    Load { library: String, reason: String },
    Enumerate { detail: String },
}

/// One enumeration's result: the devices, or why there are none. Cheap to query repeatedly;
/// selecting and requiring never enumerate again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RdmaDevices {
    devices: Vec<DeviceInfo>,
    failure: Option<Failure>,
}

/// A user filter over the enumerated devices (e.g. an `NCCL_IB_HCA` whitelist). A filter that
/// parses to nothing should return its input unchanged (fall back to all devices).
pub type DeviceFilter<'a, E> = &'a dyn Fn(&[DeviceInfo]) -> Result<Vec<DeviceInfo>, E>;

impl RdmaDevices {
    /// Enumerates exactly once. A load failure becomes "no devices" with its reason kept.
    pub fn run(enumerator: &dyn DeviceEnumerator) -> Self {
        match enumerator.enumerate() {
            Ok(devices) => {
                tracing::debug!(count = devices.len(), "RDMA devices enumerated");
                Self {
                    devices,
                    failure: None,
                }
            }
            Err(e) => {
                let failure = match e.library() {
                    Some(library) if e.is_load_failure() => {
                        let text = e.to_string();
                        let reason = text
                            .strip_prefix(library)
                            .and_then(|r| r.strip_prefix(": "))
                            .unwrap_or(&text)
                            .to_owned();
                        Failure::Load {
                            library: library.to_owned(),
                            reason,
                        }
                    }
                    _ => Failure::Enumerate {
                        detail: e.to_string(),
                    },
                };
                tracing::debug!(error = %e, "no RDMA devices: enumeration unavailable");
                Self {
                    devices: Vec::new(),
                    failure: Some(failure),
                }
            }
        }
    }

    /// The enumerated devices; empty when libibverbs is unavailable or lists none.
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    /// Why enumeration could not run, naming the library (`libibverbs.so.1: <reason>`).
    pub fn unavailable(&self) -> Option<String> {
        self.failure.as_ref().map(|f| match f {
            Failure::Load { library, reason } => format!("{library}: {reason}"),
            Failure::Enumerate { detail } => detail.clone(),
        })
    }

    /// The listing `ferry topology` and `ferry doctor` print.
    pub fn listing(&self) -> VerbsListing {
        VerbsListing {
            devices: self.devices.clone(),
            unavailable: self.unavailable(),
        }
    }

    /// The devices, or the actionable error when there are none (for callers that need RDMA).
    pub fn require(&self) -> Result<&[DeviceInfo], RdmaDevicesError> {
        match &self.failure {
            Some(Failure::Load { library, reason }) => Err(RdmaDevicesError::LoadLibrary {
                library: library.clone(),
                reason: reason.clone(),
            }),
            Some(Failure::Enumerate { detail }) => Err(RdmaDevicesError::EnumerateDevices {
                detail: detail.clone(),
            }),
            None if self.devices.is_empty() => Err(RdmaDevicesError::EmptyDeviceList),
            None => Ok(&self.devices),
        }
    }

    /// Applies `filters` in order to the one enumerated list and returns what is left.
    /// Never enumerates again. No filters means all devices.
    pub fn select<E>(
        &self,
        filters: &[DeviceFilter<'_, E>],
    ) -> Result<Vec<DeviceInfo>, RdmaDevicesError>
    where
        E: Into<Box<dyn StdError + Send + Sync>>,
    {
        let all = self.require()?;
        let mut selected = all.to_vec();
        for filter in filters {
            selected = filter(&selected)
                .map_err(|e| RdmaDevicesError::ApplyFilter { source: e.into() })?;
        }
        if selected.is_empty() {
            let available = all
                .iter()
                .map(|d| d.name.as_str())
                .collect::<Vec<_>>()
                .join(", ");
            return Err(RdmaDevicesError::NoDeviceMatched { available });
        }
        Ok(selected)
    }
}

/// Enumerates once through `enumerator` and applies `filters`: the whole discovery step.
pub fn discover_devices<E>(
    enumerator: &dyn DeviceEnumerator,
    filters: &[DeviceFilter<'_, E>],
) -> Result<Vec<DeviceInfo>, RdmaDevicesError>
where
    E: Into<Box<dyn StdError + Send + Sync>>,
{
    RdmaDevices::run(enumerator).select(filters)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use ferry_verbs_sys::{NodeType, TransportType, VerbsError};
    use std::cell::Cell;

    /// Counts enumerations; returns a fixed answer (the capability matrix's tests use it too).
    pub(crate) struct Counting {
        pub(crate) calls: Cell<usize>,
        answer: fn() -> Result<Vec<DeviceInfo>, LoadError>,
    }

    impl Counting {
        pub(crate) fn new(answer: fn() -> Result<Vec<DeviceInfo>, LoadError>) -> Self {
            Self {
                calls: Cell::new(0),
                answer,
            }
        }
    }

    impl DeviceEnumerator for Counting {
        fn enumerate(&self) -> Result<Vec<DeviceInfo>, LoadError> {
            self.calls.set(self.calls.get() + 1);
            (self.answer)()
        }
    }

    pub(crate) fn two() -> Result<Vec<DeviceInfo>, LoadError> {
        Ok(vec![
            DeviceInfo::new("mlx5_0", 1, NodeType::Ca, TransportType::Ib),
            DeviceInfo::new("mlx5_1", 2, NodeType::Ca, TransportType::Ib),
        ])
    }

    fn none() -> Result<Vec<DeviceInfo>, LoadError> {
        Ok(Vec::new())
    }

    pub(crate) fn missing_library() -> Result<Vec<DeviceInfo>, LoadError> {
        Err(VerbsError::Unavailable {
            library: "libibverbs.so.1".into(),
            reason: "cannot open shared object file: No such file or directory".into(),
        })
    }

    /// A whitelist "parser": an empty spec parses to nothing and falls back to all devices.
    fn whitelist(spec: &'static str) -> impl Fn(&[DeviceInfo]) -> Result<Vec<DeviceInfo>, String> {
        move |devices| {
            if spec.is_empty() {
                return Ok(devices.to_vec());
            }
            if spec.contains('!') {
                return Err(format!("bad filter `{spec}`"));
            }
            Ok(devices
                .iter()
                .filter(|d| spec.split(',').any(|n| n == d.name))
                .cloned()
                .collect())
        }
    }

    #[test]
    fn enumerates_once_however_the_filters_parse() {
        let e = Counting::new(two);
        let empty = whitelist("");
        let one = whitelist("mlx5_1");
        let chosen = discover_devices::<String>(&e, &[&empty, &one]).expect("selection");
        assert_eq!(chosen.len(), 1);
        assert_eq!(chosen[0].name, "mlx5_1");
        assert_eq!(e.calls.get(), 1);
    }

    #[test]
    fn a_filter_that_parses_to_nothing_falls_back_to_all_with_one_enumeration() {
        let e = Counting::new(two);
        let empty = whitelist("");
        let chosen = discover_devices::<String>(&e, &[&empty, &empty]).expect("selection");
        assert_eq!(chosen.len(), 2);
        assert_eq!(e.calls.get(), 1);
    }

    #[test]
    fn repeated_selection_on_one_discovery_never_re_enumerates() {
        let e = Counting::new(two);
        let d = RdmaDevices::run(&e);
        let a = whitelist("mlx5_0");
        let bad = whitelist("!");
        assert!(d.select::<String>(&[&a]).is_ok());
        assert!(matches!(
            d.select::<String>(&[&bad]),
            Err(RdmaDevicesError::ApplyFilter { .. })
        ));
        assert!(d.require().is_ok());
        let _ = d.listing();
        assert_eq!(e.calls.get(), 1);
    }

    #[test]
    fn a_missing_library_is_no_devices_with_the_actionable_error() {
        let e = Counting::new(missing_library);
        let d = RdmaDevices::run(&e);
        assert!(d.devices().is_empty());
        assert_eq!(
            d.unavailable().as_deref(),
            Some("libibverbs.so.1: cannot open shared object file: No such file or directory")
        );
        let err = d.select::<String>(&[]).expect_err("no devices");
        assert_eq!(
            err.to_string(),
            "no RDMA devices found: libibverbs.so.1 could not be loaded: \
             cannot open shared object file: No such file or directory"
        );
        assert_eq!(e.calls.get(), 1);
    }

    #[test]
    fn an_empty_list_is_the_empty_list_error() {
        let d = RdmaDevices::run(&Counting::new(none));
        assert_eq!(d.unavailable(), None);
        let err = d.require().expect_err("no devices");
        assert_eq!(
            err.to_string(),
            "no RDMA devices found: the device list is empty"
        );
    }

    #[test]
    fn filters_that_leave_nothing_name_what_exists() {
        let d = RdmaDevices::run(&Counting::new(two));
        let f = whitelist("mlx5_9");
        let err = d.select::<String>(&[&f]).expect_err("nothing matches");
        assert!(
            err.to_string().contains("available: mlx5_0, mlx5_1"),
            "{err}"
        );
    }
}

//! The capability matrix: one row per independent check of what this machine can do, each with a
//! status, what was found, and what to do about it. `ferry doctor` prints it;
//! [`probe`] computes it. No check depends on another: a missing libibverbs does not hide the
//! io_uring row, and a failing check never stops the others.

use std::path::PathBuf;

use ferry_core::TransportKind;
use serde::Serialize;

use crate::rdma_devices::{DeviceEnumerator, RdmaDevices, VerbsEnumerator, VerbsListing};

/// The verdict of one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Status {
    /// Present and usable.
    Ok,
    /// The library or kernel facility could not be loaded or used.
    Unavailable,
    /// Loaded fine, but there is nothing of this kind on the machine (no devices, no module).
    Absent,
    /// The check itself failed unexpectedly (an I/O error, a native call that returned an error).
    Error,
}

impl Status {
    /// The lowercase word printed in tables and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Unavailable => "unavailable",
            Status::Absent => "absent",
            Status::Error => "error",
        }
    }
}

/// One row of the matrix.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    /// What was checked (`libibverbs`, `rdma-devices`, `io_uring`…).
    pub name: String,
    /// The verdict.
    pub status: Status,
    /// What was found: a path, a version, device names, the loader's reason.
    pub detail: String,
    /// What to do about it (empty when nothing needs doing).
    pub hint: String,
}

impl Check {
    fn new(name: &str, status: Status, detail: impl Into<String>, hint: impl Into<String>) -> Self {
        Self {
            name: name.to_owned(),
            status,
            detail: detail.into(),
            hint: hint.into(),
        }
    }
}

/// The whole matrix.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    /// What the rows add up to, as fields a script can read.
    pub summary: Summary,
    /// The rows, in a fixed order.
    pub checks: Vec<Check>,
}

/// The facts behind the rows, structured: what a script checks instead of parsing `detail`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Summary {
    /// Transports usable here: `tcp` always, `uring` when the kernel carries the io_uring data
    /// plane, `rdma` when RDMA is built in and libibverbs lists a device.
    pub transports: Vec<&'static str>,
    /// The RDMA devices libibverbs lists.
    pub rdma_devices: Vec<String>,
    /// The GPUs the CUDA driver lists.
    pub gpus: Vec<GpuSummary>,
    /// The io_uring opcodes the kernel supports (empty without io_uring).
    pub uring_opcodes: Vec<&'static str>,
}

/// One GPU of [`Summary::gpus`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct GpuSummary {
    /// The CUDA ordinal (`--gpu N`).
    pub ordinal: u32,
    /// The driver's name for it.
    pub name: String,
    /// Its PCI bus id.
    pub pci_bus_id: String,
    /// Its memory, in MiB.
    pub memory_mib: u64,
    /// Whether the driver is the test suite's fake.
    pub fake: bool,
}

impl Capabilities {
    /// The row with this name.
    pub fn get(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }
}

/// Where the probes look. The defaults are the running machine's.
#[derive(Clone, Debug)]
pub struct ProbeOptions {
    /// Root of the sysfs tree (default `/sys`).
    pub sysfs_root: PathBuf,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        Self {
            sysfs_root: PathBuf::from("/sys"),
        }
    }
}

/// Runs every check, listing the verbs devices through libibverbs ([`VerbsEnumerator`]).
pub fn probe(opts: &ProbeOptions) -> Capabilities {
    probe_with(opts, &VerbsEnumerator::new())
}

/// Runs every check, listing the verbs devices through `devices` exactly once: the
/// `rdma-devices` row and the `topology` row read the same listing.
pub fn probe_with(opts: &ProbeOptions, devices: &dyn DeviceEnumerator) -> Capabilities {
    let listing = RdmaDevices::run(devices).listing();
    let (uring, uring_opcodes) = uring_check();
    let mut summary = Summary {
        transports: vec![TransportKind::Tcp.name()],
        rdma_devices: listing.devices.iter().map(|d| d.name.clone()).collect(),
        uring_opcodes,
        ..Summary::default()
    };
    if uring.status == Status::Ok {
        summary.transports.push(TransportKind::Uring.name());
    }
    if cfg!(feature = "rdma") && !summary.rdma_devices.is_empty() {
        summary.transports.push(TransportKind::Rdma.name());
    }
    let same_host = same_host_check();
    if same_host.status == Status::Ok {
        summary.transports.push(TransportKind::Local.name());
    }
    let mut checks = vec![
        build_features(),
        libibverbs_check(),
        devices_check(&listing),
        topology_check(opts, &listing),
        uring,
        same_host,
    ];
    checks.extend(cuda_checks(opts));
    #[cfg(feature = "cuda")]
    {
        let (check, gpus) = gpus_check(opts, &listing);
        checks.push(check);
        summary.gpus = gpus;
    }
    Capabilities { summary, checks }
}

/// The cargo features of the `ferry` crate this build has on (`uring`, `cuda`, `rdma`), for
/// version reports.
pub fn compiled_features() -> Vec<&'static str> {
    let mut on = Vec::new();
    if cfg!(feature = "uring") {
        on.push("uring");
    }
    if cfg!(feature = "cuda") {
        on.push("cuda");
    }
    if cfg!(feature = "rdma") {
        on.push("rdma");
    }
    on
}

/// The transports compiled into this build (TCP always; io_uring and RDMA by feature).
fn compiled_transports() -> Vec<TransportKind> {
    let mut on = vec![TransportKind::Tcp];
    if cfg!(feature = "uring") {
        on.push(TransportKind::Uring);
    }
    if cfg!(feature = "rdma") {
        on.push(TransportKind::Rdma);
    }
    on
}

fn build_features() -> Check {
    let transports: Vec<&str> = compiled_transports()
        .into_iter()
        .map(|k| k.name())
        .collect();
    let cuda = if cfg!(feature = "cuda") { "on" } else { "off" };
    Check::new(
        "build",
        Status::Ok,
        format!(
            "ferry {} with transports: {}; cuda: {cuda}",
            env!("CARGO_PKG_VERSION"),
            transports.join(", ")
        ),
        "",
    )
}

#[cfg(not(feature = "uring"))]
fn uring_check() -> (Check, Vec<&'static str>) {
    let check = Check::new(
        "io_uring",
        Status::Unavailable,
        "not built in (feature `uring` off)",
        "rebuild with the `uring` feature",
    );
    (check, Vec::new())
}

#[cfg(feature = "uring")]
fn uring_check() -> (Check, Vec<&'static str>) {
    let p = ferry_transport_uring::probe_kernel();
    let opcodes = match &p {
        ferry_transport_uring::UringProbe::Available { opcodes } => opcodes
            .iter()
            .filter(|o| o.supported)
            .map(|o| o.name)
            .collect(),
        _ => Vec::new(),
    };
    let check = match (&p, p.unusable_reason()) {
        (ferry_transport_uring::UringProbe::Unavailable { reason }, _) => Check::new(
            "io_uring",
            Status::Unavailable,
            reason.clone(),
            "io_uring is disabled or missing (kernel < 5.6, the kernel.io_uring_disabled sysctl, or a \
             seccomp profile); Ferry uses the tokio TCP transport instead",
        ),
        (_, Some(reason)) => Check::new(
            "io_uring",
            Status::Unavailable,
            format!("{reason}; opcodes: {p}"),
            "upgrade the kernel for the io_uring data plane; Ferry falls back to the tokio TCP transport",
        ),
        (_, None) => {
            let hint = if p.supports("SEND_ZC") {
                ""
            } else {
                "SEND_ZC needs Linux 6.0+; sends will copy"
            };
            Check::new("io_uring", Status::Ok, format!("opcodes: {p}"), hint)
        }
    };
    (check, opcodes)
}

/// The `same-host` row: whether peers on this host can be reached by process-to-process
/// copies (a boot id, the copy system call allowed, what Yama lets a client grant, and serving
/// threads that can drop `CAP_SYS_PTRACE`).
fn same_host_check() -> Check {
    let p = ferry_transport_local::probe();
    let summary = p.summary();
    match (&p.boot_id, &p.copies, p.yama_scope) {
        (Err(_), _, _) | (_, Err(_), _) => Check::new(
            "same-host",
            Status::Unavailable,
            summary,
            "peers on this host use the network planes (loopback TCP or io_uring); a container \
             runtime's seccomp profile may refuse process_vm_readv",
        ),
        (Ok(_), Ok(()), Some(s)) if s >= 2 => Check::new(
            "same-host",
            Status::Unavailable,
            summary,
            "set kernel.yama.ptrace_scope to 1 or 0 (serving threads drop CAP_SYS_PTRACE, so \
             scope 2 allows no copy)",
        ),
        _ if p.serving.is_err() => Check::new(
            "same-host",
            Status::Unavailable,
            summary,
            "allow capset (a seccomp profile may refuse it), run without CAP_SYS_PTRACE, or \
             set FERRY_SAME_HOST=privileged to serve anyway",
        ),
        _ => Check::new("same-host", Status::Ok, summary, ""),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_checks(_opts: &ProbeOptions) -> Vec<Check> {
    ["cuda-driver", "cufile", "nvidia-peermem", "dma-buf"]
        .iter()
        .map(|n| {
            Check::new(
                n,
                Status::Unavailable,
                "not built in (feature `cuda` off)",
                "rebuild with the `cuda` feature",
            )
        })
        .collect()
}

#[cfg(feature = "cuda")]
fn cuda_checks(opts: &ProbeOptions) -> Vec<Check> {
    let driver = ferry_cuda::probe_driver();
    vec![
        cuda_check(&driver),
        cufile_check(),
        peermem_check(opts),
        dmabuf_check(&driver),
    ]
}

/// The GPUs the driver lists (name, PCI bus id, memory), and for each the route `auto` would
/// take with the NICs nearest it (the topology's assignment).
#[cfg(feature = "cuda")]
fn gpus_check(opts: &ProbeOptions, listing: &VerbsListing) -> (Check, Vec<GpuSummary>) {
    let cuda = match ferry_cuda::Cuda::load() {
        Ok(c) => c,
        Err(e) => {
            let check = Check::new(
                "gpus",
                Status::Unavailable,
                e.to_string(),
                "no CUDA driver: no GPU memory to register",
            );
            return (check, Vec::new());
        }
    };
    let devices = cuda.devices();
    if devices.is_empty() {
        let check = Check::new(
            "gpus",
            Status::Absent,
            format!("{} lists no GPU", cuda.library()),
            "check nvidia-smi and the device nodes (/dev/nvidia*)",
        );
        return (check, Vec::new());
    }
    let gpus = devices
        .iter()
        .map(|d| GpuSummary {
            ordinal: d.location.ordinal,
            name: d.name.clone(),
            pci_bus_id: d.location.pci_bus_id.clone(),
            memory_mib: d.total_mem >> 20,
            fake: cuda.is_fake(),
        })
        .collect();
    let verbs = ferry_topology::VerbsDevices {
        names: listing.devices.iter().map(|d| d.name.clone()).collect(),
        unavailable: listing.unavailable.clone(),
    };
    let topo = ferry_topology::Topology::discover(
        &opts.sysfs_root,
        &verbs,
        &ferry_topology::Selector::default(),
    )
    .ok();
    let ibv_dmabuf = ferry_verbs_sys::Verbs::load()
        .map(|v| v.capabilities().reg_dmabuf_mr)
        .unwrap_or(false);
    let peermem =
        ferry_cuda::peermem_version(&opts.sysfs_root).map(|(p, _)| p.display().to_string());
    let mut parts = Vec::new();
    for d in &devices {
        let facts = ferry_cuda::RouteFacts {
            cuda_dmabuf_export: cuda.has_dmabuf_export(),
            device_dmabuf: d.dmabuf_supported,
            ibv_reg_dmabuf_mr: ibv_dmabuf,
            peermem_version_file: peermem.clone(),
        };
        let route = ferry_cuda::route::choose(ferry_cuda::GpuDirectSetting::Auto, &facts)
            .map(|c| format!("{} ({})", c.route, c.why))
            .unwrap_or_else(|e| e.to_string());
        let nics = topo
            .as_ref()
            .and_then(|t| {
                t.gpus
                    .iter()
                    .find(|g| {
                        g.pci
                            .to_string()
                            .eq_ignore_ascii_case(&d.location.pci_bus_id)
                    })
                    .map(|g| t.assigned(g.id).join(","))
            })
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "none".into());
        parts.push(format!(
            "GPU {} {} at {}, {} MiB; auto route: {route}; nearest NICs: {nics}",
            d.location.ordinal,
            d.name,
            d.location.pci_bus_id,
            d.total_mem >> 20
        ));
    }
    let fake = if cuda.is_fake() {
        " [FAKE driver, tests only]"
    } else {
        ""
    };
    let check = Check::new(
        "gpus",
        Status::Ok,
        format!("{}{fake}: {}", cuda.library(), parts.join("; ")),
        "",
    );
    (check, gpus)
}

#[cfg(feature = "cuda")]
fn cuda_check(driver: &Result<ferry_cuda::DriverInfo, ferry_cuda::CudaError>) -> Check {
    match driver {
        Ok(d) => Check::new(
            "cuda-driver",
            Status::Ok,
            format!("{} loaded, CUDA driver version {}", d.library, d.version),
            "",
        ),
        Err(e @ ferry_cuda::CudaError::Unavailable { .. }) => Check::new(
            "cuda-driver",
            Status::Unavailable,
            e.to_string(),
            "no NVIDIA driver here: GPU memory cannot be registered; host memory and files work",
        ),
        Err(e) => Check::new(
            "cuda-driver",
            Status::Error,
            e.to_string(),
            "the driver is installed but failed; check nvidia-smi",
        ),
    }
}

#[cfg(feature = "cuda")]
fn cufile_check() -> Check {
    match ferry_cuda::probe_cufile() {
        Ok(info) => Check::new("cufile", Status::Ok, format!("{} loaded", info.library), ""),
        Err(e @ ferry_cuda::CudaError::Unavailable { .. }) => Check::new(
            "cufile",
            Status::Unavailable,
            e.to_string(),
            "GPUDirect Storage needs NVIDIA's cuFile (libcufile.so.0, from the CUDA toolkit's GDS packages)",
        ),
        Err(e) => Check::new("cufile", Status::Error, e.to_string(), ""),
    }
}

#[cfg(feature = "cuda")]
fn peermem_check(opts: &ProbeOptions) -> Check {
    match ferry_cuda::peermem_version(&opts.sysfs_root) {
        Some((path, version)) => Check::new(
            "nvidia-peermem",
            Status::Ok,
            format!("{} = {version}", path.display()),
            "",
        ),
        None => Check::new(
            "nvidia-peermem",
            Status::Absent,
            format!(
                "none of {} exists under {}",
                ferry_cuda::PEERMEM_VERSION_PATHS.join(", "),
                opts.sysfs_root.display()
            ),
            "for the peermem GPUDirect route load nvidia_peermem (or MLNX_OFED nv_peer_mem); \
             a module directory without a version file does not count",
        ),
    }
}

#[cfg(feature = "cuda")]
fn dmabuf_check(driver: &Result<ferry_cuda::DriverInfo, ferry_cuda::CudaError>) -> Check {
    let cuda_side = match driver {
        Ok(d) if d.dmabuf_export => Ok(format!(
            "{}: cuMemGetHandleForAddressRange present",
            d.library
        )),
        Ok(d) => Err(format!(
            "{}: cuMemGetHandleForAddressRange absent (driver {})",
            d.library, d.version
        )),
        Err(e) => Err(e.to_string()),
    };
    let verbs_side = match ferry_verbs_sys::Verbs::load() {
        Ok(v) if v.capabilities().reg_dmabuf_mr => {
            Ok(format!("{}: ibv_reg_dmabuf_mr present", v.library()))
        }
        Ok(v) => Err(format!("{}: ibv_reg_dmabuf_mr absent", v.library())),
        Err(e) => Err(e.to_string()),
    };
    match (cuda_side, verbs_side) {
        (Ok(c), Ok(v)) => Check::new("dma-buf", Status::Ok, format!("{c}; {v}"), ""),
        (c, v) => {
            let part = |r: Result<String, String>| r.unwrap_or_else(|e| e);
            Check::new(
                "dma-buf",
                Status::Unavailable,
                format!("{}; {}", part(c), part(v)),
                "the dma-buf GPUDirect route needs a CUDA 11.7+ driver exporting \
                 cuMemGetHandleForAddressRange and rdma-core 34+ with ibv_reg_dmabuf_mr",
            )
        }
    }
}

/// The file the dynamic loader actually mapped for `soname`, from `/proc/self/maps`.
fn mapped_file(soname: &str) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            std::path::Path::new(p)
                .file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f.starts_with(soname))
        })
        .map(str::to_owned)
}

fn libibverbs_check() -> Check {
    match ferry_verbs_sys::Verbs::load() {
        Ok(v) => {
            let caps = v.capabilities();
            let file = mapped_file("libibverbs.so").unwrap_or_else(|| v.library().to_owned());
            let mut optional = Vec::new();
            for (on, name) in [
                (caps.reg_dmabuf_mr, "ibv_reg_dmabuf_mr"),
                (caps.reg_mr_iova2, "ibv_reg_mr_iova2"),
                (caps.query_gid_ex, "ibv_query_gid_ex"),
                (caps.query_gid_table, "ibv_query_gid_table"),
            ] {
                optional.push(format!("{name}{}", if on { "" } else { "(absent)" }));
            }
            Check::new(
                "libibverbs",
                Status::Ok,
                format!(
                    "{} -> {file}; optional: {}",
                    v.library(),
                    optional.join(" ")
                ),
                "",
            )
        }
        Err(e) => Check::new(
            "libibverbs",
            Status::Unavailable,
            e.to_string(),
            "install the host's rdma-core runtime (Debian/Ubuntu: libibverbs1 ibverbs-providers) and \
             the provider for your NIC, or set FERRY_IBVERBS_LIB; TCP and io_uring need none of it",
        ),
    }
}

fn devices_check(listing: &VerbsListing) -> Check {
    match (&listing.unavailable, listing.devices.is_empty()) {
        (Some(reason), _) => Check::new(
            "rdma-devices",
            Status::Unavailable,
            format!("no RDMA devices found: {reason}"),
            "RDMA needs libibverbs; see the libibverbs row",
        ),
        (None, true) => Check::new(
            "rdma-devices",
            Status::Absent,
            "ibv_get_device_list returned no devices",
            "no RDMA NIC (or no provider for it): check `rdma link`, the provider package for your \
             NIC, and read/write access to /dev/infiniband/uverbs*; soft-RoCE: `rdma link add rxe0 type rxe netdev IF`",
        ),
        (None, false) => Check::new(
            "rdma-devices",
            Status::Ok,
            listing
                .devices
                .iter()
                .map(|d| {
                    format!(
                        "{} (guid {}, {:?}/{:?})",
                        d.name,
                        d.guid_string(),
                        d.node_type,
                        d.transport_type
                    )
                })
                .collect::<Vec<_>>()
                .join(", "),
            "",
        ),
    }
}

fn topology_check(opts: &ProbeOptions, listing: &VerbsListing) -> Check {
    let verbs = ferry_topology::VerbsDevices {
        names: listing.devices.iter().map(|d| d.name.clone()).collect(),
        unavailable: listing.unavailable.clone(),
    };
    match ferry_topology::Topology::discover(
        &opts.sysfs_root,
        &verbs,
        &ferry_topology::Selector::default(),
    ) {
        Ok(t) => {
            let usable = t.usable_nics().count();
            let unusable: Vec<String> = t
                .nics
                .iter()
                .filter(|n| !n.usable)
                .map(|n| {
                    format!(
                        "{} ({})",
                        n.name,
                        n.reason.as_deref().unwrap_or("not usable")
                    )
                })
                .collect();
            let mut detail = format!(
                "{} PCI devices, {} NUMA node(s), {} GPU(s), {} RDMA NIC(s) in sysfs, {usable} usable",
                t.pci_devices,
                t.numa_nodes.len(),
                t.gpus.len(),
                t.nics.len()
            );
            if !unusable.is_empty() {
                detail.push_str(&format!("; not usable: {}", unusable.join(", ")));
            }
            let hint = if t.gpus.is_empty() || usable > 0 {
                ""
            } else {
                "GPUs but no usable RDMA NIC: transfers will use TCP"
            };
            Check::new("topology", Status::Ok, detail, hint)
        }
        Err(e) => Check::new(
            "topology",
            Status::Error,
            format!("reading {}: {e}", opts.sysfs_root.display()),
            "pass --sysfs-root to inspect another tree",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma_devices::tests::{Counting, missing_library, two};

    /// A sysfs tree with two RDMA NICs, `mlx5_0` and `mlx5_1` (the topology crate's fixture).
    fn nics_only() -> ProbeOptions {
        ProbeOptions {
            sysfs_root: PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../topology/tests/fixtures/nics-only"),
        }
    }

    fn detail<'a>(caps: &'a Capabilities, name: &str) -> &'a str {
        &caps
            .get(name)
            .unwrap_or_else(|| panic!("no {name} row"))
            .detail
    }

    #[test]
    fn the_build_row_lists_every_transport_compiled_in() {
        let row = build_features();
        let listed = row
            .detail
            .split_once("with transports: ")
            .and_then(|(_, rest)| rest.split(';').next())
            .unwrap_or_default();
        let listed: Vec<&str> = listed.split(", ").collect();
        for (kind, built) in [
            (TransportKind::Tcp, true),
            (TransportKind::Uring, cfg!(feature = "uring")),
            (TransportKind::Rdma, cfg!(feature = "rdma")),
        ] {
            assert_eq!(
                listed.contains(&kind.name()),
                built,
                "{kind} in {}",
                row.detail
            );
        }
        assert!(
            !listed.contains(&"cuda"),
            "cuda is no transport: {}",
            row.detail
        );
    }

    #[test]
    fn one_probe_enumerates_the_verbs_devices_once_for_every_row() {
        let devices = Counting::new(two);
        let caps = probe_with(&nics_only(), &devices);
        assert_eq!(devices.calls.get(), 1);
        assert_eq!(caps.get("rdma-devices").map(|c| c.status), Some(Status::Ok));
        assert!(detail(&caps, "rdma-devices").contains("mlx5_1"), "{caps:?}");
        // The topology row read the same listing: both NICs are in it, so both are usable.
        assert!(detail(&caps, "topology").contains("2 usable"), "{caps:?}");
    }

    #[test]
    fn without_libibverbs_both_rows_say_so_from_one_attempt() {
        let devices = Counting::new(missing_library);
        let caps = probe_with(&nics_only(), &devices);
        assert_eq!(devices.calls.get(), 1);
        assert_eq!(
            caps.get("rdma-devices").map(|c| c.status),
            Some(Status::Unavailable)
        );
        assert!(detail(&caps, "topology").contains("0 usable"), "{caps:?}");
    }
}

//! `ferry topology`: which NIC serves which GPU, and why. A table (GPU x NIC distance classes,
//! the NICs with their usability and reasons, the assignment), or `--json`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use ferry::topology::{Selector, Topology, VerbsDevices};

/// Arguments of `ferry topology`.
#[derive(clap::Args, Debug)]
pub(crate) struct TopologyArgs {
    /// Root of the sysfs tree to read.
    #[arg(long, value_name = "DIR", default_value = "/sys")]
    pub(crate) sysfs_root: PathBuf,
    /// The RDMA devices that count, comma-separated, instead of asking libibverbs
    /// (ibv_get_device_list).
    #[arg(long, value_name = "a,b,...", value_delimiter = ',')]
    pub(crate) ib_devices: Option<Vec<String>>,
    /// NCCL_IB_HCA-style NIC filter: comma list, leading `^` excludes, leading `=` matches names
    /// exactly (else by prefix), `name:port` picks ports.
    #[arg(long, value_name = "FILTER")]
    pub(crate) hca: Option<String>,
    /// Print one JSON object `{"nics": [...], "gpus": [...], "assignment": [...]}`.
    #[arg(long)]
    pub(crate) json: bool,
}

/// The verbs device list: `--ib-devices` when given, else what libibverbs enumerates (empty,
/// with the loader's reason, when the library is missing).
fn verbs_devices(args: &TopologyArgs) -> VerbsDevices {
    match &args.ib_devices {
        Some(names) => VerbsDevices::from_names(
            names
                .iter()
                .map(|n| n.trim())
                .filter(|n| !n.is_empty())
                .map(str::to_owned),
        ),
        None => {
            let listing = ferry::rdma_devices::enumerate_verbs_devices();
            VerbsDevices {
                names: listing.devices.into_iter().map(|d| d.name).collect(),
                unavailable: listing.unavailable,
            }
        }
    }
}

pub(crate) fn run(args: TopologyArgs) -> anyhow::Result<()> {
    let selector = match &args.hca {
        Some(filter) => Selector::from_hca(filter)?,
        None => Selector::default(),
    };
    let verbs = verbs_devices(&args);
    let topology = Topology::discover(&args.sysfs_root, &verbs, &selector)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", topology.to_json()?).context("writing to stdout")?;
    } else {
        write!(out, "{}", topology.render_table()).context("writing to stdout")?;
        if let Some(next) = next_step(&topology) {
            writeln!(out, "\nnext: {next}").context("writing to stdout")?;
        }
    }
    Ok(())
}

/// What to do when the topology has nothing to assign.
fn next_step(t: &Topology) -> Option<&'static str> {
    let usable_nics = t.nics.iter().filter(|n| n.usable).count();
    match (usable_nics, t.gpus.len()) {
        (0, 0) => Some(
            "no usable RDMA NIC and no GPU here, so there is nothing to pair; TCP and io_uring need \
             neither: try `ferry bench` (loopback) or `ferry serve` + `ferry bench HOST:7400`. \
             `ferry doctor` says why RDMA or CUDA is missing.",
        ),
        (0, _) => Some(
            "GPUs but no usable RDMA NIC: GPU memory is served by staging through host memory \
             over TCP or io_uring (`ferry bench --gpu 0`); `ferry doctor` says why RDMA is \
             missing.",
        ),
        (_, 0) => Some(
            "RDMA NICs but no GPU: they serve host memory (`ferry bench --transport rdma`); GPU \
             routes need the NVIDIA driver (`ferry doctor`).",
        ),
        _ => None,
    }
}

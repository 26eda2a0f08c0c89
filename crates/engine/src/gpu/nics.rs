//! NIC choice: the RDMA rails nearest a GPU, from the sysfs topology.

#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
/// The device of a rail name (`mlx5_0:1` is on `mlx5_0`).
pub(crate) fn rail_device(rail: &str) -> &str {
    rail.rsplit_once(':').map_or(rail, |(d, _)| d)
}

#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
/// Which of the engine's rails a GPU registration is made on, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct NicChoice {
    /// Rail indices (the registry's context ids).
    pub(crate) rails: Vec<usize>,
    /// Why, in words (shown by `describe()`).
    pub(crate) why: String,
}

#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
impl NicChoice {
    pub(crate) fn names(&self, rails: &[String]) -> Vec<String> {
        self.rails
            .iter()
            .filter_map(|&i| rails.get(i).cloned())
            .collect()
    }
}

#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
/// The rails on the NICs nearest the GPU at `pci_bus_id`: the topology's assignment (same PCI
/// switch, then root complex, then NUMA node, then across sockets, load spread over GPUs). When
/// locality is unknown (no sysfs topology, the GPU not in it, no NIC assigned, or no rail on
/// the assigned NICs) every rail serves it, and `why` says so.
pub(crate) fn choose_nics(
    rails: &[String],
    topo: Option<&ferry_topology::Topology>,
    pci_bus_id: &str,
) -> NicChoice {
    let every = |why: String| NicChoice {
        rails: (0..rails.len()).collect(),
        why: format!("{why}: every rail ({})", rails.join(", ")),
    };
    let Some(topo) = topo else {
        return every("the sysfs PCI topology is unreadable, so locality is unknown".into());
    };
    let Some(gpu) = topo
        .gpus
        .iter()
        .find(|g| g.pci.to_string().eq_ignore_ascii_case(pci_bus_id))
    else {
        return every(format!(
            "GPU {pci_bus_id} is not in the sysfs PCI topology, so locality is unknown"
        ));
    };
    let Some(assigned) = topo.assignment.get(gpu.id).filter(|a| !a.nics.is_empty()) else {
        return every(format!("no usable NIC is assigned to GPU {pci_bus_id}"));
    };
    let picked: Vec<usize> = rails
        .iter()
        .enumerate()
        .filter(|(_, r)| assigned.nics.iter().any(|n| n == rail_device(r)))
        .map(|(i, _)| i)
        .collect();
    let class = assigned
        .class
        .map_or_else(|| "?".to_owned(), |c| c.as_str().to_owned());
    if picked.is_empty() {
        return every(format!(
            "the NICs nearest GPU {pci_bus_id} ({}, {class}) carry none of this engine's rails",
            assigned.nics.join(", ")
        ));
    }
    NicChoice {
        why: format!(
            "nearest GPU {pci_bus_id} by PCI distance ({class}): {}",
            picked
                .iter()
                .filter_map(|&i| rails.get(i).map(String::as_str))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        rails: picked,
    }
}

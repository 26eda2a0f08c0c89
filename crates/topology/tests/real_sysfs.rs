//! The model read from the real `/sys` of whatever machine runs the test agrees with what
//! `/sys` shows, counted here independently.

use std::fs;
use std::path::Path;

use ferry_topology::{Machine, Selector, Topology, VerbsDevices};

fn count_entries(dir: &Path, keep: impl Fn(&str) -> bool) -> usize {
    match fs::read_dir(dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_str().is_some_and(&keep))
            .count(),
        Err(_) => 0,
    }
}

#[test]
fn real_sysfs_matches_directory_counts() {
    let sys = Path::new("/sys");
    if fs::read_dir(sys).is_err() {
        ferry_tests::require_or_skip(ferry_tests::SYSFS, "/sys is not readable on this machine");
        return;
    }
    let m = Machine::read(sys).unwrap();
    let pci = count_entries(&sys.join("bus/pci/devices"), |_| true);
    let nodes = count_entries(&sys.join("devices/system/node"), |n| {
        n.strip_prefix("node")
            .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
    });
    let ib = count_entries(&sys.join("class/infiniband"), |_| true);
    let net = count_entries(&sys.join("class/net"), |_| true);
    eprintln!("/sys: {pci} PCI devices, {nodes} NUMA nodes, {ib} RDMA devices, {net} net devices");
    assert_eq!(m.pci_devices.len(), pci);
    assert_eq!(m.numa_nodes.len(), nodes);
    assert_eq!(m.rdma_devices.len(), ib);
    assert_eq!(m.net_devices.len(), net);
    // Every PCI device the model places below a bridge has that bridge in the model too.
    for d in &m.pci_devices {
        for p in &d.parents {
            assert!(
                m.pci(*p).is_some(),
                "{} has parent {} missing",
                d.address,
                p
            );
        }
        if let Some(n) = d.numa_node {
            assert!(
                m.numa_nodes.iter().any(|x| x.id == n),
                "{}: node {n}",
                d.address
            );
        }
    }
    // The joined view builds and renders on whatever is there.
    let verbs = VerbsDevices::from_names(m.rdma_devices.iter().map(|d| d.name.clone()));
    let t = Topology::build(&m, &verbs, &Selector::default()).unwrap();
    assert_eq!(t.pci_devices, pci);
    assert_eq!(t.gpus.len(), m.gpus().count());
    assert_eq!(t.assignment.len(), t.gpus.len());
    t.to_json().unwrap();
    eprintln!("{}", t.render_table());
}

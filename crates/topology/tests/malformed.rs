//! A sysfs tree with broken links, garbage and missing files: reading never fails below the
//! root and never panics, and what cannot be read is left unknown.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;

use ferry_topology::{LinkLayer, Machine, PortState, Selector, Topology, VerbsDevices};

fn write(root: &Path, rel: &str, text: &str) {
    let p = root.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, text).unwrap();
}

fn link(root: &Path, rel: &str, target: &str) {
    let p = root.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    symlink(target, p).unwrap();
}

#[test]
fn garbage_is_tolerated() {
    let tmp = tempfile::tempdir().unwrap();
    let r = tmp.path();
    // A GPU with garbage attributes, a dangling PCI link, a non-address entry.
    let gpu = "devices/pci0000:00/0000:00:01.0/0000:01:00.0";
    write(r, &format!("{gpu}/class"), "0x030200\n");
    write(r, &format!("{gpu}/vendor"), "nonsense");
    write(r, &format!("{gpu}/numa_node"), "-1\n");
    write(r, "devices/pci0000:00/0000:00:01.0/class", "0x060400");
    link(
        r,
        "bus/pci/devices/0000:01:00.0",
        &format!("../../../{gpu}"),
    );
    link(
        r,
        "bus/pci/devices/0000:00:01.0",
        "../../../devices/pci0000:00/0000:00:01.0",
    );
    link(
        r,
        "bus/pci/devices/0000:07:00.0",
        "../../../devices/pci0000:00/nowhere",
    );
    link(
        r,
        "bus/pci/devices/not-an-address",
        "../../../devices/pci0000:00",
    );
    // NUMA: one real node, junk names.
    write(r, "devices/system/node/node0/cpulist", "0-3");
    write(r, "devices/system/node/nodeX/cpulist", "0-3");
    write(r, "devices/system/node/online", "0");
    // An RDMA device whose device link dangles, with a junk port directory, a port without
    // state, a GID file with garbage and an unreadable type.
    let ib = "devices/virtual/infiniband/weird0";
    link(r, &format!("{ib}/device"), "../../../nowhere");
    write(r, &format!("{ib}/ports/1/link_layer"), "Ethernet\n");
    write(r, &format!("{ib}/ports/1/gids/0"), "zzzz");
    write(
        r,
        &format!("{ib}/ports/1/gids/1"),
        "fe80:0000:0000:0000:0000:0000:0000:0001",
    );
    fs::create_dir_all(r.join(format!("{ib}/ports/1/gid_attrs/types/1"))).unwrap();
    write(r, &format!("{ib}/ports/abc/state"), "4: ACTIVE");
    link(r, "class/infiniband/weird0", &format!("../../{ib}"));
    link(
        r,
        "class/infiniband/gone0",
        "../../devices/virtual/infiniband/gone0",
    );
    // A net device whose link dangles.
    link(r, "class/net/ghost", "../../devices/virtual/net/ghost");

    let m = Machine::read(r).unwrap();
    assert_eq!(
        m.pci_devices.len(),
        3,
        "every address-named entry, resolvable or not"
    );
    let dangling = m.pci("0000:07:00.0".parse().unwrap()).unwrap();
    assert_eq!(
        (dangling.host_bridge.as_ref(), dangling.class),
        (None, None)
    );
    let g = m.pci("0000:01:00.0".parse().unwrap()).unwrap();
    assert_eq!((g.vendor, g.numa_node), (None, None));
    assert!(g.is_gpu(), "3D controller class, any vendor");
    assert_eq!(m.numa_nodes.len(), 1);
    assert_eq!(m.effective_numa_node(g.address), Some(0));
    assert_eq!(m.rdma_devices.len(), 2);
    let weird = &m.rdma_devices[1];
    assert_eq!(weird.name, "weird0");
    assert_eq!(weird.pci, None);
    assert_eq!(weird.ports.len(), 1);
    let port = &weird.ports[0];
    assert_eq!(port.state, PortState::Other("unknown".into()));
    assert_eq!(port.link_layer, LinkLayer::Ethernet);
    assert_eq!(port.gids.len(), 1);
    assert_eq!(port.gids[0].index, 1);
    assert!(m.rdma_devices[0].ports.is_empty());
    assert_eq!(m.net_devices.len(), 1);

    let verbs = VerbsDevices::from_names(["weird0", "gone0"]);
    let t = Topology::build(&m, &verbs, &Selector::default()).unwrap();
    assert_eq!(t.gpus.len(), 1);
    assert!(
        t.gpus[0].nics.is_empty(),
        "NICs without a PCI function have no class"
    );
    assert_eq!(
        t.nic("gone0").unwrap().reason.as_deref(),
        Some("no ports listed in sysfs")
    );
    let r = t.nic("weird0").unwrap().reason.clone().unwrap();
    assert!(r.contains("state unknown is not ACTIVE"), "{r}");
    t.render_table();
    t.to_json().unwrap();
}

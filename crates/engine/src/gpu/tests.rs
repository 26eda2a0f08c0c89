use std::sync::Arc;

use ferry_core::{Access, MemoryRegion, SegmentDesc, SegmentToken};
use ferry_cuda::{Cuda, DeviceMemory};

use crate::gpu::nics::*;
use crate::reconnect::PeerInner;

/// Two GPUs, each with its own nearest NIC (what the topology crate's assignment gives on a
/// DGX-like machine; its fixtures test the assignment itself), built in memory: no I/O.
fn two_gpus() -> ferry_topology::Topology {
    let gpu = |id: usize, pci: &str| ferry_topology::Gpu {
        id,
        pci: pci.parse().unwrap(),
        vendor: None,
        device: None,
        numa_node: None,
        nics: Vec::new(),
    };
    let assigned = |gpu: usize, nic: &str, id: usize| ferry_topology::Assignment {
        gpu,
        nics: vec![nic.to_owned()],
        nic_ids: vec![id],
        class: Some(ferry_topology::DistanceClass::Pix),
    };
    ferry_topology::Topology {
        nics: Vec::new(),
        gpus: vec![gpu(0, "0000:17:00.0"), gpu(1, "0000:3d:00.0")],
        assignment: vec![assigned(0, "mlx5_0", 0), assigned(1, "mlx5_3", 3)],
        verbs_only: Vec::new(),
        verbs_unavailable: None,
        pci_devices: 0,
        numa_nodes: Vec::new(),
    }
}

fn rails(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| format!("{n}:1")).collect()
}

/// A GPU registration is made on the rails of the NICs nearest its GPU, and says why.
#[test]
fn nics_nearest_the_gpu_serve_it() {
    let t = two_gpus();
    let r = rails(&["mlx5_0", "mlx5_1", "mlx5_3", "mlx5_7"]);
    let c = choose_nics(&r, Some(&t), "0000:17:00.0");
    assert_eq!(c.rails, vec![0], "{c:?}");
    assert!(
        c.why.contains("PIX") && c.why.contains("mlx5_0:1"),
        "{}",
        c.why
    );
    // The bus id is matched whatever its case.
    let c = choose_nics(&r, Some(&t), "0000:3D:00.0");
    assert_eq!(c.names(&r), vec!["mlx5_3:1".to_owned()], "{c:?}");
}

/// Unknown locality never narrows the rails, and the reason says which fact was missing.
#[test]
fn unknown_locality_uses_every_rail_and_says_why() {
    let t = two_gpus();
    let r = rails(&["mlx5_4", "mlx5_5"]);
    let c = choose_nics(&r, None, "0000:17:00.0");
    assert_eq!(c.rails, vec![0, 1]);
    assert!(c.why.contains("unreadable"), "{}", c.why);
    let c = choose_nics(&r, Some(&t), "0000:ee:00.0");
    assert_eq!(c.rails, vec![0, 1]);
    assert!(
        c.why.contains("0000:ee:00.0 is not in the sysfs"),
        "{}",
        c.why
    );
    // GPU 0's nearest NIC is mlx5_0, which carries no rail here.
    let c = choose_nics(&r, Some(&t), "0000:17:00.0");
    assert_eq!(c.rails, vec![0, 1]);
    assert!(c.why.contains("carry none"), "{}", c.why);
    assert!(
        c.why.contains("every rail (mlx5_4:1, mlx5_5:1)"),
        "{}",
        c.why
    );
    let mut none = two_gpus();
    none.assignment[0].nics.clear();
    let c = choose_nics(&r, Some(&none), "0000:17:00.0");
    assert_eq!(c.rails, vec![0, 1]);
    assert!(c.why.contains("no usable NIC is assigned"), "{}", c.why);
}

/// Local memory that is device memory, with or without its GPUDirect region.
struct Dev(Arc<DeviceMemory>, Option<Arc<MemoryRegion>>);

impl crate::request::LocalMemory for Dev {
    fn local_ref(&self) -> crate::request::LocalRef {
        crate::request::LocalRef(crate::request::Local::Device(
            self.0.clone(),
            self.1.clone(),
            None,
        ))
    }
}

/// Host memory.
struct Host(Arc<MemoryRegion>);

impl crate::request::LocalMemory for Host {
    fn local_ref(&self) -> crate::request::LocalRef {
        crate::request::LocalRef(crate::request::Local::Host(self.0.clone()))
    }
}

fn segment(kind: ferry_core::TransportKind) -> crate::handles::RemoteSegment {
    let mut ch = ferry_core::transport::MockChannel::new();
    ch.expect_kind().return_const(kind);
    let desc = SegmentDesc {
        name: "g".into(),
        token: SegmentToken(7),
        len: 1 << 20,
        access: Access::REMOTE_READ | Access::REMOTE_WRITE,
        remote_keys: Vec::new(),
    };
    let peer = Arc::new(PeerInner::for_test(
        Arc::new(ch),
        vec![desc.clone()],
        crate::route::Routes::default().counters("p".into(), kind),
    ));
    crate::handles::RemoteSegment { peer, desc }
}

/// Device memory reaches a transport only as its GPUDirect region, only towards an RDMA
/// peer, and only when every device op of the batch has one; every other batch is staged.
#[test]
fn gpu_ops_go_to_the_nic_only_over_rdma_with_a_region() {
    use ferry_core::TransportKind::{Rdma, Tcp, Uring};
    let Some(fake) = ferry_tests::fake_cuda(ferry_tests::FakeVariant::Full) else {
        return;
    };
    let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
    let mem = Arc::new(cuda.device(0).unwrap().alloc(1 << 20).unwrap());
    let region = Arc::new(mem.nic_region(ferry_cuda::GpuRoute::Peermem).unwrap());
    assert!(!region.is_host());
    assert_eq!(region.as_ptr() as u64, mem.device_ptr());
    let with = Dev(mem.clone(), Some(region.clone()));
    let without = Dev(mem.clone(), None);
    let host = Host(Arc::new(MemoryRegion::from_vec(vec![0; 64])));
    for (kind, direct) in [(Rdma, true), (Tcp, false), (Uring, false)] {
        let seg = segment(kind);
        let (_, checked) = crate::Batch::new()
            .write(&with, 0, &seg, 0, 4096)
            .read(&host, 0, &seg, 8, 64)
            .checked()
            .unwrap();
        match checked {
            crate::request::Checked::Host(ops) => {
                assert!(direct, "{kind}: device memory given to a {kind} transport");
                assert!(Arc::ptr_eq(&ops[0].local, &region));
                assert!(ops[1].local.is_host());
            }
            crate::request::Checked::Staged(_) => assert!(!direct, "{kind}: staged"),
        }
        // A device op without a region stages the whole batch, whatever the peer.
        let (_, checked) = crate::Batch::new()
            .write(&with, 0, &seg, 0, 4096)
            .write(&without, 0, &seg, 0, 4096)
            .checked()
            .unwrap();
        assert!(
            matches!(checked, crate::request::Checked::Staged(_)),
            "{kind}"
        );
    }
}

#[test]
fn rail_names_give_their_device() {
    assert_eq!(rail_device("mlx5_0:1"), "mlx5_0");
    assert_eq!(rail_device("rxe0"), "rxe0");
}

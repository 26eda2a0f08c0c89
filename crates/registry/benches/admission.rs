//! Admission path: register then retire one range, with the host backend (TCP/io_uring) and with a
//! fake backend of four contexts (the RDMA-shaped fan-out, without native calls).
#![allow(missing_docs)]

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{Criterion, criterion_group, criterion_main};
use ferry_core::{Access, MemoryRegion};
use ferry_registry::{
    Budgets, ContextId, ContextInfo, HostBackend, NativeError, NativeHandle, RegistrationBackend,
    Registry,
};

/// Four contexts, one of them paused; registration hands out increasing ids as keys.
#[derive(Debug, Default)]
struct FourContexts {
    next: AtomicU64,
}

impl RegistrationBackend for FourContexts {
    fn contexts(&self) -> Vec<ContextInfo> {
        (0..4)
            .map(|i| ContextInfo {
                id: ContextId(i),
                name: format!("mlx5_{i}:1"),
                paused: i == 3,
            })
            .collect()
    }

    fn register_copy(
        &self,
        _context: ContextId,
        _region: &MemoryRegion,
        _access: Access,
    ) -> Result<NativeHandle, NativeError> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        Ok(NativeHandle {
            id,
            lkey: id as u32,
            rkey: id as u32 ^ 0x5a5a,
        })
    }

    fn destroy_copy(&self, _context: ContextId, _handle: NativeHandle) -> Result<(), NativeError> {
        Ok(())
    }
}

fn bench(c: &mut Criterion) {
    let region = Arc::new(MemoryRegion::from_vec(vec![0; 1 << 20]));
    let remote = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let backends: [(&str, Arc<dyn RegistrationBackend>); 2] = [
        ("host", Arc::new(HostBackend)),
        ("fake_4ctx", Arc::new(FourContexts::default())),
    ];
    let mut group = c.benchmark_group("register_retire");
    for (label, backend) in backends {
        let registry = Registry::new(backend, Budgets::default());
        for (kind, access) in [("local", Access::LOCAL), ("remote", remote)] {
            group.bench_function(format!("{label}/{kind}"), |b| {
                b.iter(|| {
                    let reg = registry
                        .register("bench", region.clone(), access)
                        .expect("register");
                    black_box(registry.lookup(reg.token()));
                    black_box(reg.retire().expect("retire"));
                })
            });
        }
        let reg = registry
            .register("bench", region.clone(), remote)
            .expect("register");
        let token = reg.token();
        group.bench_function(format!("{label}/lookup"), |b| {
            b.iter(|| black_box(registry.lookup(black_box(token))))
        });
        drop(reg);
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

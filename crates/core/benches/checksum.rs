//! CRC-32C throughput on 1 MiB chunks (the broadcast's chunk size), to compare with link rates:
//! of a slice, of a region through `crc32c_region` (what a CHECKSUM request runs: in place where
//! the CPU can, else copied out in pieces), and of a region read in place directly.
#![allow(missing_docs)]

use criterion::{Criterion, Throughput, criterion_group, criterion_main};

fn crc(c: &mut Criterion) {
    let data: Vec<u8> = (0..(1usize << 20)).map(|i| (i * 31 + 7) as u8).collect();
    let region = ferry_core::MemoryRegion::from_vec(data.clone());
    let mut g = c.benchmark_group("crc32c");
    g.throughput(Throughput::Bytes(data.len() as u64));
    g.bench_function("slice_1MiB", |b| {
        b.iter(|| ferry_core::checksum::crc32c(std::hint::black_box(&data)))
    });
    g.bench_function("region_1MiB", |b| {
        b.iter(|| ferry_core::checksum::crc32c_region(&region, 0, 1 << 20))
    });
    // Where it lies, no copy (the broadcast's check at rest).
    g.bench_function("region_in_place_1MiB", |b| {
        b.iter(|| region.crc32c_in_place(0, 0, 1 << 20))
    });
    g.finish();
}

criterion_group!(benches, crc);
criterion_main!(benches);

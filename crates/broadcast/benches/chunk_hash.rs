//! Hashing a 1 MiB chunk (the default chunk size): BLAKE3 (what every fetched chunk is
//! verified against), SHA-256 (the alternative the issue names) and CRC-32C (the cheap check at
//! rest), in one run so that their ratios compare. A core's share per 10 Gbit/s received is
//! 1.25 GB/s divided by the rate measured here.
#![allow(missing_docs)]

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use sha2::Digest as _;

fn hashes(c: &mut Criterion) {
    let data: Vec<u8> = (0..(1usize << 20)).map(|i| (i * 31 + 7) as u8).collect();
    let mut g = c.benchmark_group("chunk_1MiB");
    g.throughput(Throughput::Bytes(data.len() as u64));
    g.bench_function("blake3", |b| {
        b.iter(|| blake3::hash(std::hint::black_box(&data)))
    });
    g.bench_function("sha256", |b| {
        b.iter(|| sha2::Sha256::digest(std::hint::black_box(&data)))
    });
    g.bench_function("crc32c", |b| {
        b.iter(|| ferry::checksum::crc32c(std::hint::black_box(&data)))
    });
    g.finish();
}

criterion_group!(benches, hashes);
criterion_main!(benches);

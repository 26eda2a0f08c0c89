//! A staged commit's copy of 64 MiB of host tensors into the live ones, in alternating rounds:
//! the reference is the copy a commit made before (out to a 1 MiB bounce buffer and in again,
//! `read_at`/`write_at`), against `layout::copy_all` (one direct copy per byte) on one thread
//! in a commit's 8 MiB pieces, on one thread a whole tensor at a time (one `memmove` each,
//! which glibc may do with non-temporal stores above its threshold), and on several threads
//! (half the CPUs, two to four). Prints each round and the median of each ratio (new time /
//! reference time; below 1 is faster).
//!
//!     cargo bench -p ferry-broadcast --bench commit [-- ROUNDS]
#![allow(missing_docs)]

use std::time::Instant;

use ferry::{Access, DataPlane, MemoryRegion, TransferEngine};
use ferry_broadcast::Slice;
use ferry_broadcast::layout::{COPY_PIECE, copy_all};

const LEN: usize = 64 << 20;
/// Tensors of the payload: one large, and a few small ones as a model has.
const CUTS: [usize; 5] = [0, 48 << 20, 56 << 20, 60 << 20, LEN];

fn bounce(src: &MemoryRegion, dst: &MemoryRegion) {
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0;
    while at < LEN {
        let n = (LEN - at).min(buf.len());
        src.read_at(at as u64, &mut buf[..n]).unwrap();
        dst.write_at(at as u64, &buf[..n]).unwrap();
        at += n;
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(15);
    let e = TransferEngine::builder()
        .data_plane(DataPlane::Tcp)
        .build()
        .unwrap();
    let bytes: Vec<u8> = (0..LEN).map(|i| (i * 31 + i / 4093) as u8).collect();
    let src = e
        .register(
            MemoryRegion::from_vec(bytes),
            Access::REMOTE_READ,
            "staging",
        )
        .unwrap();
    let dst = e
        .register(
            MemoryRegion::from_vec(vec![1u8; LEN]),
            Access::REMOTE_READ,
            "live",
        )
        .unwrap();
    let pairs: Vec<(String, Slice, Slice)> = CUTS
        .windows(2)
        .enumerate()
        .map(|(i, w)| {
            let (at, n) = (w[0] as u64, (w[1] - w[0]) as u64);
            (
                format!("t{i}"),
                Slice::new(&src, "staging", at, n).unwrap(),
                Slice::new(&dst, "live", at, n).unwrap(),
            )
        })
        .collect();
    // As many as a commit would use, but at least two, so that the column compares threads.
    let threads = std::thread::available_parallelism().map_or(2, |n| (n.get() / 2).clamp(2, 4));
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "commit of {} MiB ({} tensors), {rounds} alternating rounds; {threads} threads here; load {}",
        LEN >> 20,
        pairs.len(),
        load.split_whitespace().next().unwrap_or("?")
    );
    let time = |f: &dyn Fn()| {
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64()
    };
    // Warm both regions (page faults are not the commit's).
    bounce(src.region(), dst.region());
    let (mut one, mut whole, mut many) = (Vec::new(), Vec::new(), Vec::new());
    println!(
        "round  bounce ms  direct 1 thread ms  1 thread, whole tensors ms  direct {threads} threads ms"
    );
    for r in 0..rounds {
        let b = time(&|| bounce(src.region(), dst.region()));
        let d1 = time(&|| {
            copy_all(&pairs, 1, COPY_PIECE).unwrap();
        });
        let dw = time(&|| {
            copy_all(&pairs, 1, LEN as u64).unwrap();
        });
        let dn = time(&|| {
            copy_all(&pairs, threads, COPY_PIECE).unwrap();
        });
        println!(
            "{r:>5}  {:>9.2}  {:>18.2}  {:>26.2}  {:>19.2}",
            b * 1e3,
            d1 * 1e3,
            dw * 1e3,
            dn * 1e3
        );
        one.push(d1 / b);
        whole.push(dw / b);
        many.push(dn / b);
    }
    let mut check = vec![0u8; LEN];
    dst.region().read_at(0, &mut check).unwrap();
    let mut want = vec![0u8; LEN];
    src.region().read_at(0, &mut want).unwrap();
    assert!(check == want, "the copies moved the bytes");
    println!(
        "median time / bounce: direct, 1 thread {:.2}; whole tensors {:.2}; direct, {threads} threads {:.2}",
        median(&mut one),
        median(&mut whole),
        median(&mut many)
    );
}

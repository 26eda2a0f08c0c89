//! A ring stream's reader thread while tasks spin for their own answers (issue 50): small
//! requests awaited one after another on a ring channel resolve on the awaiting task, and the
//! stream's reader thread stays parked, woken only after a request armed it (its task's spin
//! ran out: on a busy machine, often), not per answer; a request no task spins for (a bulk
//! one) still wakes it and resolves. On a channel of two ring streams, such requests keep to
//! one stream, so one server thread serves them and the other sleeps. Alone in its file: the reader threads counted are
//! this test's only.

mod common;
use common::serve_table;

use std::sync::Arc;

use ferry_core::wire::TransportOffer;
use ferry_core::{
    Access, Channel, MemoryRegion, Op, OpKind, RequestControl, SegmentDesc, SegmentLease,
    SegmentTable, SegmentToken,
};
use ferry_transport_local::{LocalConfig, LocalTransport};

const LEN: usize = 1 << 20;
const TOKEN: SegmentToken = SegmentToken(1);

#[derive(Debug)]
struct Table(Arc<MemoryRegion>);

impl SegmentTable for Table {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        (token == TOKEN).then(|| SegmentLease {
            region: self.0.clone(),
            base: 0,
            len: LEN as u64,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            guard: None,
        })
    }
    fn published(&self) -> Vec<SegmentDesc> {
        Vec::new()
    }
}

/// Voluntary context switches (sleeps) so far of this process's threads named `name`.
fn voluntary_switches_of(name: &str) -> u64 {
    let mut total = 0;
    for t in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = t.unwrap().path();
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        if comm.trim_end() != name {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
        for line in status.lines() {
            if let Some(v) = line.strip_prefix("voluntary_ctxt_switches:") {
                total += v.trim().parse::<u64>().unwrap();
            }
        }
    }
    total
}

/// Time on a CPU so far (ns) of each of this process's threads whose name starts with
/// `prefix`, by thread id.
fn cpu_ns_of(prefix: &str) -> std::collections::BTreeMap<u64, u64> {
    let mut out = std::collections::BTreeMap::new();
    for t in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = t.unwrap().path();
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        if !comm.starts_with(prefix) {
            continue;
        }
        let tid: u64 = dir.file_name().unwrap().to_str().unwrap().parse().unwrap();
        let stat = std::fs::read_to_string(dir.join("schedstat")).unwrap_or_default();
        if let Some(ns) = stat.split_whitespace().next().and_then(|v| v.parse().ok()) {
            out.insert(tid, ns);
        }
    }
    out
}

fn op(kind: OpKind, local: &Arc<MemoryRegion>, len: u64) -> Arc<[Op]> {
    vec![Op {
        kind,
        local: local.clone(),
        local_offset: 0,
        token: TOKEN,
        remote_offset: 0,
        len,
    }]
    .into()
}

#[test]
fn answers_that_tasks_spin_for_wake_no_reader_thread() {
    let segment = Arc::new(MemoryRegion::alloc_zeroed(LEN, 4096).unwrap());
    let (_h, peer) = serve_table(Arc::new(Table(segment.clone())), 1);
    let transport = LocalTransport::new(LocalConfig {
        streams: 1,
        ring: true,
        ..LocalConfig::default()
    });
    let ch = transport.connect_channel(&peer).unwrap();
    assert_eq!(ch.ring_streams(), 1);
    let local = Arc::new(MemoryRegion::from_vec(vec![0x5a; LEN]));
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let run = |ops: &Arc<[Op]>| {
        let o = rt.block_on(ch.execute(ops.clone(), Arc::new(RequestControl::new(ops))));
        assert!(o.failure.is_none(), "{o:?}");
    };
    let small = op(OpKind::Write, &local, 64);
    for _ in 0..500 {
        run(&small);
    }
    // A task's spin may run out (its server thread preempted on a busy machine): then the
    // request arms the reader, which the next answer wakes. Without an arm, an answer wakes no
    // reader: its sleeps (each a voluntary switch) follow arms, and the periodic look of a
    // parked one (every 100 ms).
    let n = 4000u64;
    let (before, armed_before, t0) = (
        voluntary_switches_of("ferry-local-rx"),
        ch.readers_armed(),
        std::time::Instant::now(),
    );
    for _ in 0..n {
        run(&small);
    }
    let woken = voluntary_switches_of("ferry-local-rx") - before;
    let armed = ch.readers_armed() - armed_before;
    let looks = 2 * (t0.elapsed().as_millis() as u64 / 100 + 1);
    println!("reader thread sleeps: {woken}, arms: {armed}, over {n} small round trips");
    // An arm costs the reader one sleep, rarely two (woken before the answer came). On a
    // machine so busy that nearly every spin runs out, arms are nearly one per round trip and
    // this cannot tell a parked reader from one woken per answer; on a quiet one it can.
    assert!(
        woken <= armed + armed / 8 + looks + 20,
        "the reader thread slept {woken} times over {n} round trips that armed it {armed} times"
    );
    // A bulk request: no task spins for it, the reader resolves it.
    let bulk = op(OpKind::Read, &local, 256 << 10);
    for _ in 0..20 {
        run(&bulk);
        run(&small);
    }
    // The READs brought the segment's bytes: the WRITEs' 64 at its start, zeroes after them.
    let mut got = [0u8; 128];
    local.read_at(0, &mut got).unwrap();
    assert_eq!(got[..64], [0x5a; 64][..]);
    assert_eq!(got[64..], [0u8; 64][..]);
    // Small requests one at a time on a channel of two ring streams keep to one of them: one
    // server thread serves (and spins for) them, the other sleeps (dealt in turn, both would
    // spin beside the task: three spinners on two cores).
    let known = cpu_ns_of("ferry-local-ser");
    let mut peer2 = peer.clone();
    if let TransportOffer::Local { streams, .. } = &mut peer2.offer {
        *streams = 2;
    }
    let transport2 = LocalTransport::new(LocalConfig {
        streams: 2,
        ring: true,
        ..LocalConfig::default()
    });
    let ch2 = transport2.connect_channel(&peer2).unwrap();
    assert_eq!(ch2.ring_streams(), 2);
    let run2 = |ops: &Arc<[Op]>| {
        let o = rt.block_on(ch2.execute(ops.clone(), Arc::new(RequestControl::new(ops))));
        assert!(o.failure.is_none(), "{o:?}");
    };
    let theirs = || {
        let mut m = cpu_ns_of("ferry-local-ser");
        m.retain(|tid, _| !known.contains_key(tid));
        m
    };
    for _ in 0..200 {
        run2(&small);
    }
    let before = theirs();
    for _ in 0..n {
        run2(&small);
    }
    let mut spent: Vec<u64> = theirs()
        .iter()
        .map(|(tid, ns)| ns - before.get(tid).copied().unwrap_or(0))
        .collect();
    spent.sort_unstable_by(|a, b| b.cmp(a));
    println!("the new server threads' CPU time over {n} small round trips: {spent:?} ns");
    assert!(spent.len() >= 2, "{spent:?}");
    assert!(
        spent[1] * 4 < spent[0],
        "two server threads served the small requests: {spent:?} ns"
    );
}

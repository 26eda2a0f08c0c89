//! Receivers that leave the moment they are done, over loopback, as the Python pull and so
//! every verl and vLLM bucket does: each receiver joins once the one before it finished (so
//! it plans finished members as its holders), relays while a later one is unfinished, then
//! leaves at once and drops its destination. No receiver is ever waited on for
//! `stall_after`, and the source sees every one finished.

use std::sync::Arc;
use std::time::Duration;

use ferry::{Access, DataPlane, MemoryRegion, Registration, TransferEngine};
use ferry_broadcast::{
    Destinations, Embedded, Receiver, ReceiverOptions, Slice, Source, SourceEvent, SourceOptions,
    Summary, Tensor,
};
use tokio::sync::Notify;

mod common;
use common::{engine, logs};

const LEN: usize = 1 << 20;
const CHUNK: u64 = 64 << 10;
const RECEIVERS: usize = 4;
const VERSIONS: u64 = 6;

fn payload(version: u64) -> Vec<u8> {
    (0..LEN)
        .map(|i| ((i as u64).wrapping_mul(2_654_435_761).wrapping_add(version) >> 13) as u8)
        .collect()
}

/// Receiver `k` of one version on engine `e`: waits for `turn` (the one before it finished),
/// joins, says so (`joined`), pulls, says it finished (`done`), waits for the next one to
/// join (`next_joined`, if any) so that it is listed, finished, while that one plans, then
/// relays while any listed receiver is unfinished and leaves at once. Returns its summary
/// and the bytes it holds.
struct Turns {
    turn: Option<Arc<Notify>>,
    joined: Arc<Notify>,
    done: Arc<Notify>,
    next_joined: Option<Arc<Notify>>,
}

async fn receiver(
    e: TransferEngine,
    addr: std::net::SocketAddr,
    v: u64,
    t: Turns,
) -> (Summary, Vec<u8>) {
    if let Some(turn) = &t.turn {
        turn.notified().await;
    }
    let seg = format!("live.v{v}");
    let reg: Registration = e
        .register(
            MemoryRegion::from_vec(vec![0u8; LEN]),
            Access::REMOTE_READ,
            &seg,
        )
        .unwrap();
    let opts = ReceiverOptions {
        version: Some(v),
        // Far above what a pull here takes: a receiver waited on would show as a holder given
        // up for its silence (the summaries' count), and the test would take that long.
        stall_after: Duration::from_secs(5),
        ..Default::default()
    };
    let disc = Arc::new(Embedded::new(addr));
    let dests = Destinations {
        into: vec![("t".into(), Slice::whole(&reg, &seg))],
        ..Default::default()
    };
    let mut r = Receiver::join_into(&e, disc, Some("w"), dests, opts)
        .await
        .unwrap();
    t.joined.notify_one();
    let sum = r.run().await.unwrap();
    t.done.notify_one();
    if let Some(next) = &t.next_joined {
        next.notified().await;
    }
    r.linger(Duration::from_secs(30)).await;
    r.leave().await;
    let mut got = vec![0u8; LEN];
    reg.region().read_at(0, &mut got).unwrap();
    // The destination goes with the pull, as the Python pull closes its registrations.
    drop(reg);
    (sum, got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receivers_that_leave_as_soon_as_they_are_done_are_never_waited_on() {
    logs();
    let pe = engine();
    let engines: Vec<TransferEngine> = (0..RECEIVERS).map(|_| engine()).collect();
    let mut kept: Vec<Registration> = Vec::new();
    let mut src: Option<Source> = None;
    let mut events = None;
    for v in 1..=VERSIONS {
        let want = payload(v);
        let seg = format!("w.v{v}");
        let reg = pe
            .register(
                MemoryRegion::from_vec(want.clone()),
                Access::REMOTE_READ,
                &seg,
            )
            .unwrap();
        let tensors = vec![Tensor {
            name: "t".into(),
            slice: Slice::whole(&reg, &seg),
            dtype: Some("U8".into()),
            shape: None,
        }];
        kept.push(reg);
        match &src {
            None => {
                let opts = SourceOptions {
                    data_plane: DataPlane::Tcp,
                    ..Default::default()
                };
                let s = Source::start_tensors(&pe, "w", v, &tensors, CHUNK, opts, None)
                    .await
                    .unwrap();
                events = Some(s.subscribe());
                src = Some(s);
            }
            Some(s) => {
                s.publish(v, &tensors, None).unwrap();
            }
        }
        let addr = src.as_ref().unwrap().ctl_addr();
        let joined: Vec<Arc<Notify>> = (0..RECEIVERS).map(|_| Arc::new(Notify::new())).collect();
        let done: Vec<Arc<Notify>> = (0..RECEIVERS).map(|_| Arc::new(Notify::new())).collect();
        let mut tasks = Vec::new();
        for (k, e) in engines.iter().enumerate() {
            let t = Turns {
                turn: k.checked_sub(1).map(|p| done[p].clone()),
                joined: joined[k].clone(),
                done: done[k].clone(),
                next_joined: joined.get(k + 1).cloned(),
            };
            tasks.push(tokio::spawn(receiver(e.clone(), addr, v, t)));
        }
        for (k, task) in tasks.into_iter().enumerate() {
            let (sum, got) = task.await.unwrap();
            assert!(got == want, "version {v}, receiver {k}: the bytes differ");
            assert_eq!(
                sum.holders_stalled, 0,
                "version {v}, receiver {k} waited stall_after on a holder: {sum:?}"
            );
        }
    }
    // The source saw every receiver of every version finish, none leave unfinished.
    let events = events.as_mut().unwrap();
    let want = RECEIVERS as u64 * VERSIONS;
    let mut finished = 0;
    while finished < want {
        let ev = tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .expect("the source said nothing more within 30 s")
            .expect("the source's events ended");
        match ev {
            SourceEvent::Finished { .. } => finished += 1,
            SourceEvent::Failed { .. } => {
                panic!("the source saw a receiver leave unfinished: {ev}")
            }
            _ => {}
        }
    }
}

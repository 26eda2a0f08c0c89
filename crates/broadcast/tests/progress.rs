//! A broadcast reports its progress on the engine it runs on, so that `describe()` and the
//! Prometheus metrics show it per name and version: the source each version it publishes, a
//! receiver the bytes it verified.

use std::sync::Arc;
use std::time::Duration;

use ferry::{Access, DataPlane, MemoryRegion};
use ferry_broadcast::{
    Destinations, Embedded, Receiver, ReceiverOptions, Slice, Source, SourceOptions, Tensor,
};

mod common;
use common::engine;

const LEN: usize = 40_000;

fn series(text: &str, name: &str, labels: &str) -> Option<u64> {
    let head = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&head))
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_shows_in_the_metrics_of_both_ends_by_name_and_version() {
    let pe = engine();
    let bytes: Vec<u8> = (0..LEN).map(|i| (i * 7 % 251) as u8).collect();
    let src_reg = pe
        .register(
            MemoryRegion::from_vec(bytes.clone()),
            Access::REMOTE_READ,
            "p.w",
        )
        .unwrap();
    let tensors = vec![Tensor {
        name: "w".into(),
        slice: Slice::whole(&src_reg, "p.w"),
        dtype: None,
        shape: None,
    }];
    let src = Source::start_tensors(
        &pe,
        "model",
        3,
        &tensors,
        4096,
        SourceOptions {
            data_plane: DataPlane::Tcp,
            ..Default::default()
        },
        None,
    )
    .await
    .unwrap();
    let source_labels = "role=\"source\",name=\"model\",version=\"3\"";
    let text = pe.metrics_text();
    assert_eq!(
        series(&text, "ferry_broadcast_size_bytes", source_labels),
        Some(LEN as u64),
        "{text}"
    );
    assert_eq!(
        series(&text, "ferry_broadcast_done", source_labels),
        Some(0)
    );

    let re = engine();
    let live = re
        .register(
            MemoryRegion::from_vec(vec![0; LEN]),
            Access::REMOTE_READ,
            "r.w",
        )
        .unwrap();
    let dests = Destinations {
        into: vec![("w".into(), Slice::whole(&live, "r.w"))],
        ..Default::default()
    };
    let opts = ReceiverOptions {
        data_plane: DataPlane::Tcp,
        heartbeat: Duration::from_millis(100),
        ..Default::default()
    };
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    let mut r = Receiver::join_into(&re, disc, Some("model"), dests, opts)
        .await
        .unwrap();
    let summary = r.run().await.unwrap();
    assert_eq!(summary.version, 3);
    let receiver_labels = "role=\"receiver\",name=\"model\",version=\"3\"";
    let text = re.metrics_text();
    assert_eq!(
        series(&text, "ferry_broadcast_bytes", receiver_labels),
        Some(LEN as u64),
        "{text}"
    );
    assert_eq!(
        series(&text, "ferry_broadcast_size_bytes", receiver_labels),
        Some(LEN as u64)
    );
    assert_eq!(
        series(&text, "ferry_broadcast_done", receiver_labels),
        Some(1)
    );
    assert!(
        re.describe()
            .to_string()
            .contains("broadcast model v3 (receiver): 40000 of 40000 bytes, done"),
        "{}",
        re.describe()
    );
    drop(r);
    drop(src);
    // A source that stopped reports its versions done.
    let text = pe.metrics_text();
    assert_eq!(
        series(&text, "ferry_broadcast_done", source_labels),
        Some(1),
        "{text}"
    );
}

//! Tensors from memory into memory, in one process over loopback: a publisher serves named
//! tensors of its own engine's registrations with no copy; receivers pull into destinations of
//! theirs (in place or staged), matched by name and size before any byte moves; versions are
//! published side by side and never mixed; a failed pull in place is reported torn, a failed
//! staged pull leaves the live tensors as they were.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ferry::{Access, DataPlane, MemoryRegion, Registration, TransferEngine};
use ferry_broadcast::{
    BroadcastError, Destinations, Embedded, Receiver, ReceiverOptions, Slice, Source,
    SourceOptions, Tensor, TestHooks,
};
use tokio::sync::Notify;

mod common;
use common::{engine, logs};

const CHUNK: u64 = 4096;

fn payload(len: usize, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect()
}

fn register(e: &TransferEngine, bytes: Vec<u8>, name: &str) -> Registration {
    e.register(MemoryRegion::from_vec(bytes), Access::REMOTE_READ, name)
        .unwrap()
}

fn read(reg: &Registration) -> Vec<u8> {
    let mut v = vec![0u8; reg.len() as usize];
    reg.region().read_at(0, &mut v).unwrap();
    v
}

/// The tensors of one version: "embed" and "norm" in one arena with a gap between them,
/// "head" in a registration of its own. Returns the registrations (to keep), the tensors and
/// each tensor's bytes.
struct Weights {
    _regs: Vec<Registration>,
    tensors: Vec<Tensor>,
    bytes: HashMap<String, Vec<u8>>,
}

fn weights(e: &TransferEngine, version: u32) -> Weights {
    let arena = payload(40_000, version);
    let head = payload(3 * CHUNK as usize + 100, 1000 + version);
    let a = register(e, arena.clone(), &format!("w.v{version}.arena"));
    let h = register(e, head.clone(), &format!("w.v{version}.head"));
    let t = |name: &str, slice: Slice| Tensor {
        name: name.into(),
        slice,
        dtype: Some("U8".into()),
        shape: None,
    };
    let tensors = vec![
        t(
            "embed",
            Slice::new(&a, &format!("w.v{version}.arena"), 0, 20_000).unwrap(),
        ),
        t(
            "norm",
            Slice::new(&a, &format!("w.v{version}.arena"), 30_000, 9_000).unwrap(),
        ),
        t("head", Slice::whole(&h, &format!("w.v{version}.head"))),
    ];
    let bytes = HashMap::from([
        ("embed".to_string(), arena[..20_000].to_vec()),
        ("norm".to_string(), arena[30_000..39_000].to_vec()),
        ("head".to_string(), head),
    ]);
    Weights {
        _regs: vec![a, h],
        tensors,
        bytes,
    }
}

/// A receiver's live tensors: one registration each, zeroed, named `prefix.name`.
struct Live {
    regs: HashMap<String, Registration>,
    dests: Vec<(String, Slice)>,
}

fn live(e: &TransferEngine, prefix: &str, sizes: &[(&str, usize)]) -> Live {
    let mut regs = HashMap::new();
    let mut dests = Vec::new();
    for (name, len) in sizes {
        let seg = format!("{prefix}.{name}");
        let r = register(e, vec![0u8; *len], &seg);
        dests.push((name.to_string(), Slice::whole(&r, &seg)));
        regs.insert(name.to_string(), r);
    }
    Live { regs, dests }
}

const SIZES: [(&str, usize); 3] = [("embed", 20_000), ("norm", 9_000), ("head", 3 * 4096 + 100)];

/// Copies per byte of the check at rest: none where this CPU computes CRC-32C over memory in
/// place (x86-64 with SSE 4.2), else one (the memory is copied out to be hashed).
fn at_rest_copies() -> u64 {
    let probe = MemoryRegion::from_vec(vec![0; 8]);
    u64::from(probe.crc32c_in_place(0, 0, 8).unwrap().is_none())
}

fn opts() -> ReceiverOptions {
    logs();
    ReceiverOptions {
        data_plane: DataPlane::Tcp,
        stall_after: Duration::from_millis(400),
        heartbeat: Duration::from_millis(100),
        ..Default::default()
    }
}

async fn publisher(e: &TransferEngine, w: &Weights) -> Source {
    Source::start_tensors(
        e,
        "w",
        1,
        &w.tensors,
        CHUNK,
        SourceOptions {
            data_plane: DataPlane::Tcp,
            ..Default::default()
        },
        None,
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensors_from_memory_land_in_place_and_are_relayed() {
    let pe = engine();
    let w = weights(&pe, 1);
    let src = publisher(&pe, &w).await;
    let m = src.manifest();
    assert_eq!(m.entries.len(), 3);
    assert_eq!(m.entry("norm").unwrap().offset, 30_000);
    assert_eq!(m.entry("head").unwrap().dtype.as_deref(), Some("U8"));
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    let mut engines = Vec::new();
    let mut lives = Vec::new();
    let mut rs = Vec::new();
    for k in 0..3 {
        let e = engine();
        let l = live(&e, &format!("r{k}"), &SIZES);
        let mut dests = Destinations {
            into: l.dests.clone(),
            ..Default::default()
        };
        if k == 2 {
            // Takes "head" under another name.
            dests.into[2].0 = "lm_head".into();
            dests.rename.insert("head".into(), "lm_head".into());
        }
        rs.push(
            Receiver::join_into(&e, disc.clone(), Some("w"), dests, opts())
                .await
                .unwrap(),
        );
        engines.push(e);
        lives.push(l);
    }
    let mut tasks = Vec::new();
    for mut r in rs {
        tasks.push(tokio::spawn(async move {
            let s = r.run().await;
            r.linger(Duration::from_secs(10)).await;
            (s, r)
        }));
    }
    let mut relayed = 0;
    for t in tasks {
        let (s, _r) = t.await.unwrap();
        let s = s.unwrap();
        assert_eq!(s.version, 1);
        assert_eq!(s.refetched_chunks, 0);
        // Counted, not timed: each byte copied out once to be hashed as it lands, and checked
        // once more at rest where it lies; the READs themselves land in place.
        assert_eq!(s.bytes_copied, (1 + at_rest_copies()) * s.bytes);
        relayed += s.bytes_from_relays;
    }
    assert!(relayed > 0, "later receivers fetch from earlier ones");
    for l in &lives {
        for (name, reg) in &l.regs {
            assert_eq!(&read(reg), &w.bytes[name], "tensor {name}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_extra_and_resized_tensors_are_one_error_before_any_byte_moves() {
    let pe = engine();
    let w = weights(&pe, 1);
    let src = publisher(&pe, &w).await;
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    let e = engine();
    // "norm" is absent (extra at the publisher), "head" has the wrong size, "bias" is not
    // published.
    let l = live(&e, "r", &[("embed", 20_000), ("head", 100), ("bias", 8)]);
    let dests = Destinations {
        into: l.dests.clone(),
        ..Default::default()
    };
    let err = Receiver::join_into(&e, disc.clone(), Some("w"), dests, opts())
        .await
        .unwrap_err();
    let BroadcastError::Mismatch { problems, .. } = &err else {
        panic!("expected a mismatch, got {err}");
    };
    assert_eq!(problems.len(), 3, "{err}");
    let msg = err.to_string();
    for name in ["\"norm\"", "\"head\"", "\"bias\""] {
        assert!(msg.contains(name), "{msg}");
    }
    for reg in l.regs.values() {
        assert!(read(reg).iter().all(|&b| b == 0), "nothing moved");
    }
    // Nobody was listed: the source's tracker has only itself.
    assert_eq!(src.members().len(), 1);
    // With `subset`, leaving "norm" out is allowed.
    let l = live(&e, "s", &[("embed", 20_000)]);
    let dests = Destinations {
        into: l.dests.clone(),
        subset: true,
        ..Default::default()
    };
    let mut r = Receiver::join_into(&e, disc.clone(), Some("w"), dests, opts())
        .await
        .unwrap();
    r.run().await.unwrap();
    assert_eq!(read(&l.regs["embed"]), w.bytes["embed"]);
    // A shard: bytes 5000..12000 of "embed" only; a shard past the tensor's end is refused.
    let l = live(&e, "t", &[("embed", 7_000)]);
    let shard = |at| Destinations {
        into: l.dests.clone(),
        subset: true,
        shards: HashMap::from([("embed".to_string(), at)]),
        ..Default::default()
    };
    let err = Receiver::join_into(&e, disc.clone(), Some("w"), shard(15_000), opts())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("does not fit"), "{err}");
    let mut r = Receiver::join_into(&e, disc.clone(), Some("w"), shard(5_000), opts())
        .await
        .unwrap();
    r.run().await.unwrap();
    assert_eq!(read(&l.regs["embed"]), w.bytes["embed"][5_000..12_000]);
    // Without the check at rest, each byte is hashed once: one copy per byte received.
    let l = live(&e, "u", &SIZES);
    let mut o = opts();
    o.verify_at_rest = false;
    let dests = Destinations {
        into: l.dests.clone(),
        ..Default::default()
    };
    let mut r = Receiver::join_into(&e, disc, Some("w"), dests, o)
        .await
        .unwrap();
    let s = r.run().await.unwrap();
    assert_eq!(s.bytes_copied, s.bytes);
    for (name, reg) in &l.regs {
        assert_eq!(&read(reg), &w.bytes[name], "tensor {name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_in_place_cut_by_a_dead_source_is_torn() {
    let pe = engine();
    let w = weights(&pe, 1);
    let src = publisher(&pe, &w).await;
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    let e = engine();
    let l = live(&e, "r", &SIZES);
    let hold = Arc::new(Notify::new());
    let mut o = opts();
    o.window = 1;
    let dests = Destinations {
        into: l.dests.clone(),
        ..Default::default()
    };
    let mut r = Receiver::join_into(&e, disc, Some("w"), dests, o)
        .await
        .unwrap();
    r.set_test_hooks(TestHooks {
        hold_after: Some((2, hold.clone())),
        ..Default::default()
    });
    let progress = r.progress();
    let run = tokio::spawn(async move { r.run().await });
    let mut progress = progress;
    progress.wait_for(|s| s.bytes >= 2 * CHUNK).await.unwrap();
    drop(src);
    pe.shutdown();
    hold.notify_one();
    let err = run.await.unwrap().unwrap_err();
    let BroadcastError::Torn {
        version, tensors, ..
    } = &err
    else {
        panic!("expected torn, got {err}");
    };
    assert_eq!(*version, 1);
    assert_eq!(tensors.len(), 3, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staged_versions_commit_when_asked_and_a_failed_one_leaves_the_live_tensors() {
    let pe = engine();
    let w1 = weights(&pe, 1);
    let src = publisher(&pe, &w1).await;
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    let e = engine();
    let l = live(&e, "live", &SIZES);
    let st = live(&e, "staging", &SIZES);
    // Version 1 in place.
    let dests = Destinations {
        into: l.dests.clone(),
        ..Default::default()
    };
    let mut r = Receiver::join_into(&e, disc.clone(), Some("w"), dests, opts())
        .await
        .unwrap();
    assert_eq!(r.run().await.unwrap().version, 1);
    r.leave().await;
    // Version 2 staged: the live tensors keep version 1 until the commit.
    let w2 = weights(&pe, 2);
    src.publish(2, &w2.tensors, None).unwrap();
    assert_eq!(src.versions(), [1, 2]);
    let staged = |o: ReceiverOptions| {
        let dests = Destinations {
            into: l.dests.clone(),
            staging: Some(st.dests.clone()),
            ..Default::default()
        };
        Receiver::join_into(&e, disc.clone(), Some("w"), dests, o)
    };
    let mut r = staged(opts()).await.unwrap();
    assert!(r.commit().is_err(), "nothing to commit before the pull");
    // Another receiver joins behind it and reads from its staging.
    let ec = engine();
    let lc = live(&ec, "child", &SIZES);
    let mut child = Receiver::join_into(
        &ec,
        disc.clone(),
        Some("w"),
        Destinations {
            into: lc.dests.clone(),
            ..Default::default()
        },
        opts(),
    )
    .await
    .unwrap();
    let child = tokio::spawn(async move { child.run().await.map(|s| (s, child)) });
    let sum = r.run().await.unwrap();
    assert_eq!(sum.version, 2);
    r.linger(Duration::from_secs(10)).await;
    let (sc, child) = child.await.unwrap().unwrap();
    assert!(sc.bytes_from_relays > 0, "the child read the staging");
    for (name, reg) in &lc.regs {
        assert_eq!(&read(reg), &w2.bytes[name], "{name} of the child");
    }
    child.leave().await;
    for (name, reg) in &l.regs {
        assert_eq!(&read(reg), &w1.bytes[name], "{name} is still version 1");
    }
    let tensors: u64 = SIZES.iter().map(|s| s.1 as u64).sum();
    assert_eq!(r.commit().unwrap(), tensors);
    // Hashing as each chunk lands (and at rest, in place) plus the commit's one direct copy.
    assert_eq!(
        r.bytes_copied(),
        (1 + at_rest_copies()) * r.manifest().total_bytes() + tensors
    );
    if at_rest_copies() == 0 {
        assert!(
            r.bytes_copied() <= 2 * r.manifest().total_bytes(),
            "2.0 staged"
        );
    }
    for (name, reg) in &l.regs {
        assert_eq!(&read(reg), &w2.bytes[name], "{name} is version 2");
    }
    r.leave().await;
    // Without the check at rest a staged pull and its commit copy each byte twice: hashed
    // once as it lands, copied once into the live tensor.
    for reg in l.regs.values() {
        reg.region()
            .write_at(0, &vec![0; reg.len() as usize])
            .unwrap();
    }
    let mut o = opts();
    o.verify_at_rest = false;
    let mut r = staged(o).await.unwrap();
    let s = r.run().await.unwrap();
    assert_eq!(s.version, 2);
    assert_eq!(r.commit().unwrap(), tensors);
    assert_eq!(r.bytes_copied(), s.bytes + tensors);
    assert!(r.bytes_copied() <= 2 * s.bytes);
    for (name, reg) in &l.regs {
        assert_eq!(&read(reg), &w2.bytes[name], "{name} is version 2 again");
    }
    r.leave().await;
    // Version 3 staged, its source killed halfway: the live tensors stay at version 2.
    let w3 = weights(&pe, 3);
    src.publish(3, &w3.tensors, None).unwrap();
    assert_eq!(src.versions(), [2, 3], "the oldest version is dropped");
    let hold = Arc::new(Notify::new());
    let mut o = opts();
    o.window = 1;
    let mut r = staged(o).await.unwrap();
    r.set_test_hooks(TestHooks {
        hold_after: Some((2, hold.clone())),
        ..Default::default()
    });
    let mut progress = r.progress();
    let run = tokio::spawn(async move {
        let res = r.run().await;
        (res, r)
    });
    progress.wait_for(|s| s.bytes >= 2 * CHUNK).await.unwrap();
    drop(src);
    pe.shutdown();
    hold.notify_one();
    let (res, r) = run.await.unwrap();
    let err = res.unwrap_err();
    assert!(
        !matches!(err, BroadcastError::Torn { .. }),
        "a staged pull is never torn: {err}"
    );
    assert!(r.commit().is_err(), "a failed pull cannot be committed");
    for (name, reg) in &l.regs {
        assert_eq!(&read(reg), &w2.bytes[name], "{name} is still version 2");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_of_the_next_version_never_takes_chunks_from_one_still_pulling_the_last() {
    let pe = engine();
    let w1 = weights(&pe, 1);
    let src = publisher(&pe, &w1).await;
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    // A pulls version 1 and is held halfway.
    let ea = engine();
    let la = live(&ea, "a", &SIZES);
    let hold = Arc::new(Notify::new());
    let mut o = opts();
    o.window = 1;
    let mut a = Receiver::join_into(
        &ea,
        disc.clone(),
        Some("w"),
        Destinations {
            into: la.dests.clone(),
            ..Default::default()
        },
        o,
    )
    .await
    .unwrap();
    a.set_test_hooks(TestHooks {
        hold_after: Some((2, hold.clone())),
        ..Default::default()
    });
    let a_id = a.member().id.clone();
    let mut pa = a.progress();
    let ta = tokio::spawn(async move {
        let s = a.run().await;
        a.linger(Duration::from_secs(10)).await;
        s
    });
    pa.wait_for(|s| s.bytes >= 2 * CHUNK).await.unwrap();
    // Version 2 is published; B and then C pull it, A still on version 1.
    let w2 = weights(&pe, 2);
    src.publish(2, &w2.tensors, None).unwrap();
    let mut pulls = Vec::new();
    let mut lives = Vec::new();
    let mut engines = Vec::new();
    for k in 0..2 {
        let e = engine();
        let l = live(&e, &format!("v2r{k}"), &SIZES);
        let mut o = opts();
        o.version = Some(2);
        let r = Receiver::join_into(
            &e,
            disc.clone(),
            Some("w"),
            Destinations {
                into: l.dests.clone(),
                ..Default::default()
            },
            o,
        )
        .await
        .unwrap();
        assert_eq!(r.version(), 2);
        pulls.push(r);
        lives.push(l);
        engines.push(e);
    }
    let mut tasks = Vec::new();
    for mut r in pulls {
        tasks.push(tokio::spawn(async move {
            let s = r.run().await;
            r.linger(Duration::from_secs(10)).await;
            s
        }));
    }
    let mut sums = Vec::new();
    for t in tasks {
        sums.push(t.await.unwrap().unwrap());
    }
    let c = &sums[1];
    assert_eq!(c.version, 2);
    assert_eq!(c.refetched_chunks, 0, "no chunk of version 1 reached C");
    assert!(
        !c.holders.contains(&a_id),
        "C never attached to A: {:?}",
        c.holders
    );
    assert!(c.bytes_from_relays > 0, "C took chunks of version 2 from B");
    for l in &lives {
        for (name, reg) in &l.regs {
            assert_eq!(&read(reg), &w2.bytes[name], "{name} at version 2");
        }
    }
    // A finishes version 1 from the source, which still keeps it.
    hold.notify_one();
    let sa = ta.await.unwrap().unwrap();
    assert_eq!(sa.version, 1);
    for (name, reg) in &la.regs {
        assert_eq!(&read(reg), &w1.bytes[name], "{name} at version 1");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensors_of_a_published_safetensors_file_land_in_place() {
    // A .safetensors file: the header travels into scratch memory, each tensor in place.
    let a = payload(10_000, 7);
    let b = payload(5_000, 8);
    let header = r#"{"a":{"dtype":"U8","shape":[10000],"data_offsets":[0,10000]},"b":{"dtype":"U8","shape":[5000],"data_offsets":[10000,15000]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(&a);
    file.extend_from_slice(&b);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    std::fs::write(&path, &file).unwrap();
    let m = ferry_broadcast::Manifest::build("st", 1, std::slice::from_ref(&path), CHUNK).unwrap();
    let src = Source::start(
        m,
        &[path],
        SourceOptions {
            data_plane: DataPlane::Tcp,
            ..Default::default()
        },
        None,
    )
    .await
    .unwrap();
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    let mut rs = Vec::new();
    let mut lives = Vec::new();
    let mut engines = Vec::new();
    for k in 0..2 {
        let e = engine();
        let l = live(&e, &format!("st{k}"), &[("a", 10_000), ("b", 5_000)]);
        let dests = Destinations {
            into: l.dests.clone(),
            ..Default::default()
        };
        rs.push(
            Receiver::join_into(&e, disc.clone(), Some("st"), dests, opts())
                .await
                .unwrap(),
        );
        lives.push(l);
        engines.push(e);
    }
    let mut tasks = Vec::new();
    for mut r in rs {
        tasks.push(tokio::spawn(async move {
            let s = r.run().await;
            r.linger(Duration::from_secs(10)).await;
            (s, r)
        }));
    }
    let mut relayed = 0;
    for t in tasks {
        let (s, r) = t.await.unwrap();
        let s = s.unwrap();
        relayed += s.bytes_from_relays;
        // The whole file is held (header in scratch), as the source publishes it.
        assert_eq!(r.segment_bytes(0).unwrap(), file);
    }
    assert!(
        relayed > 0,
        "the second receiver reads the first one's destinations"
    );
    for l in &lives {
        assert_eq!(read(&l.regs["a"]), a);
        assert_eq!(read(&l.regs["b"]), b);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_of_files_publishes_the_next_version_without_restarting() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.bin");
    let v1 = payload(5 * CHUNK as usize + 17, 1);
    std::fs::write(&path, &v1).unwrap();
    let m =
        ferry_broadcast::Manifest::build("files", 1, std::slice::from_ref(&path), CHUNK).unwrap();
    let src = Source::start(
        m,
        std::slice::from_ref(&path),
        SourceOptions {
            data_plane: DataPlane::Tcp,
            ..Default::default()
        },
        None,
    )
    .await
    .unwrap();
    let disc = Arc::new(Embedded::new(src.ctl_addr()));
    let mut r = Receiver::join(disc.clone(), Some("files"), opts())
        .await
        .unwrap();
    assert_eq!(r.run().await.unwrap().version, 1);
    assert_eq!(r.segment_bytes(0).unwrap(), v1);
    r.leave().await;
    // The trainer writes the next checkpoint to a new path; the same source publishes it.
    let path2 = dir.path().join("w2.bin");
    let v2 = payload(3 * CHUNK as usize + 5, 2);
    std::fs::write(&path2, &v2).unwrap();
    let m2 = src
        .publish_files(2, std::slice::from_ref(&path2), None)
        .unwrap();
    assert_eq!((m2.version, src.versions()), (2, vec![1, 2]));
    let pull = |version| {
        let mut o = opts();
        o.version = Some(version);
        Receiver::join(disc.clone(), Some("files"), o)
    };
    let mut r2 = pull(2).await.unwrap();
    let mut r1 = pull(1).await.unwrap();
    assert_eq!(r2.run().await.unwrap().version, 2);
    assert_eq!(r2.segment_bytes(0).unwrap(), v2);
    // Version 1 is still served, from its own file.
    assert_eq!(r1.run().await.unwrap().version, 1);
    assert_eq!(r1.segment_bytes(0).unwrap(), v1);
    // Tensors cannot be added to a source of files, nor an old version number.
    assert!(src.publish(3, &[], None).is_err());
    assert!(src.publish_files(2, &[path2], None).is_err());
}

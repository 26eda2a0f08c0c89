//! Single-process checks of the facade: budgets, validation before anything moves, runtime
//! requirements, counters.

use anyhow::Result;
use ferry::{Access, Batch, Budgets, DataPlane, Error, MemoryRegion, TransferEngine};

#[test]
fn listening_needs_a_runtime_and_says_so() {
    // The tokio TCP listener needs a runtime (the io_uring server runs its own threads).
    let r = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Tcp)
        .listen("127.0.0.1:0".parse().unwrap())
        .build();
    match r {
        Err(Error::Unavailable { library, .. }) => assert_eq!(library, "tokio runtime"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[test]
fn budgets_refuse_with_resource_exhausted_and_keep_what_is_published() -> Result<()> {
    let engine = TransferEngine::builder()
        .same_host(false)
        .budgets(Budgets {
            max_copies: 100,
            max_bytes: 3 << 20,
        })
        .build()?;
    // A remote range costs two copies on the host context (local + remote), each charging it all.
    let a = engine.register(
        MemoryRegion::alloc_zeroed(1 << 20, 4096)?,
        Access::REMOTE_READ,
        "a",
    )?;
    match engine.register(
        MemoryRegion::alloc_zeroed(1 << 20, 4096)?,
        Access::REMOTE_READ,
        "b",
    ) {
        Err(Error::ResourceExhausted {
            requested,
            held,
            limit,
            budget,
        }) => {
            assert_eq!((requested, held, limit), (2 << 20, 2 << 20, 3 << 20));
            assert!(budget.contains("\"b\""), "{budget}");
        }
        other => panic!("expected ResourceExhausted, got {other:?}"),
    }
    let d = engine.describe();
    assert_eq!(d.published.len(), 1);
    assert_eq!(d.published[0].name, "a");
    // Host registrations have no native destroy to fail: nothing unquiesced, nothing fenced.
    assert_eq!((d.unquiesced, d.fenced_contexts.len()), (0, 0));
    assert!(!d.to_string().contains("unquiesced"));
    let retry = engine.retry_unquiesced();
    assert_eq!((retry.released, retry.still_held.len()), (0, 0));
    a.retire()?;
    assert!(engine.describe().published.is_empty());
    // Room again after the retirement.
    engine.register(
        MemoryRegion::alloc_zeroed(1 << 20, 4096)?,
        Access::REMOTE_READ,
        "b",
    )?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_are_validated_before_anything_moves() -> Result<()> {
    let server = TransferEngine::builder()
        .same_host(false)
        .listen("127.0.0.1:0".parse()?)
        .build()?;
    let _seg = server.register(
        MemoryRegion::alloc_zeroed(4096, 4096)?,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
        "seg",
    )?;
    let addr = server.local_addr().unwrap();
    let client = TransferEngine::builder().same_host(false).build()?;
    let p1 = client.connect(addr).await?;
    let p2 = client.connect(addr).await?;
    assert_eq!(p1.epoch(), server.epoch());
    let local = client.register(MemoryRegion::alloc_zeroed(4096, 4096)?, Access::LOCAL, "l")?;
    assert!(matches!(
        client.submit(Batch::new()),
        Err(Error::InvalidRequest { .. })
    ));
    let mixed = Batch::new()
        .read(&local, 0, &p1.segment("seg")?, 0, 10)
        .read(&local, 0, &p2.segment("seg")?, 0, 10);
    assert!(matches!(
        client.submit(mixed),
        Err(Error::InvalidRequest { .. })
    ));
    let o = client
        .submit(Batch::new().write(&local, 0, &p1.segment("seg")?, 0, 4096))?
        .await;
    assert!(o.is_success(), "{o:?}");
    let d = client.describe();
    assert_eq!(d.routes.len(), 1);
    assert_eq!(
        (d.routes[0].ops, d.routes[0].bytes, d.routes[0].errors),
        (1, 4096, 0)
    );
    Ok(())
}

#[test]
fn a_published_name_is_unique_per_engine() -> Result<()> {
    let engine = TransferEngine::builder().same_host(false).build()?;
    let mem = || MemoryRegion::alloc_zeroed(4096, 4096);
    let first = engine.register(mem()?, Access::REMOTE_READ, "dup")?;
    let refused = |r: Result<(), Error>, what: &str| match r {
        Err(e @ Error::Register { .. }) => {
            let m = e.to_string();
            assert!(
                m.starts_with("registering \"") && m.contains("unique per engine"),
                "{what}: {m}"
            );
        }
        other => panic!("{what}: expected Register, got {other:?}"),
    };
    refused(
        engine
            .register(mem()?, Access::REMOTE_READ | Access::REMOTE_WRITE, "dup")
            .map(drop),
        "memory",
    );
    let file = tempfile::NamedTempFile::new()?;
    std::fs::write(file.path(), [7u8; 4096])?;
    refused(
        engine
            .publish_file_named(file.path(), Access::REMOTE_READ, "dup")
            .map(drop),
        "file",
    );
    // A file takes the name as memory would.
    let f = engine.publish_file_named(file.path(), Access::REMOTE_READ, "f")?;
    refused(
        engine.register(mem()?, Access::REMOTE_READ, "f").map(drop),
        "memory after a file",
    );
    drop(f);
    // Local-only registrations are not published, and take any name.
    let _local = engine.register(mem()?, Access::LOCAL, "dup")?;
    let published = engine.describe().published;
    assert_eq!(published.iter().filter(|s| s.name == "dup").count(), 1);
    // Once the first is gone (dropped, no request holding it), the name is free again.
    drop(first);
    let _again = engine.register(mem()?, Access::REMOTE_READ, "dup")?;
    let _f_again = engine.register(mem()?, Access::REMOTE_READ, "f")?;
    Ok(())
}

//! The machinery under the compatibility layers (Mooncake's `TransferEngine`, NIXL's agent),
//! end to end over loopback on both portable data planes: notifications (delivered in order,
//! authenticated like a handshake, refused without the key) and memory named by raw address
//! (a registration made after connecting is found by a fresh listing; a range past a
//! registration is refused before anything moves).

use anyhow::Result;
use ferry::core_types::auth::Keyring;
use ferry::raw::{IndexEntry, RawPeer, encode_index, index_name, next_id, segment_name};
use ferry::{Access, Batch, DataPlane, Error, MemoryRegion, TransferEngine};
use ferry_tests::{URING, require_or_skip};

const ALICE: &str = "alice 000102030405060708090a0b0c0d0e0f";
const BOB: &str = "bob 101112131415161718191a1b1c1d1e1f";

fn planes() -> Vec<DataPlane> {
    #[cfg_attr(not(feature = "uring"), allow(unused_mut))]
    let mut v = vec![DataPlane::Tcp];
    #[cfg(feature = "uring")]
    match ferry::probe_kernel().unusable_reason() {
        None => v.push(DataPlane::Uring),
        Some(why) => require_or_skip(URING, format!("io_uring unusable here: {why}")),
    }
    #[cfg(not(feature = "uring"))]
    require_or_skip(URING, "built without the uring feature");
    v
}

fn engine(plane: DataPlane, listen: bool, keys: Option<&str>) -> Result<TransferEngine> {
    let mut b = TransferEngine::builder()
        .same_host(false)
        .data_plane(plane)
        .no_auth();
    if listen {
        b = b.listen("127.0.0.1:0".parse()?);
    }
    if let Some(k) = keys {
        b = b.auth_keyring(Keyring::parse(k)?);
    }
    Ok(b.build()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_arrive_in_order_with_their_sender() -> Result<()> {
    for plane in planes() {
        let server = engine(plane, true, None)?;
        let client = engine(plane, false, None)?;
        let peer = client
            .connect(server.local_addr().expect("listens"))
            .await?;
        for i in 0..5u8 {
            client.notify(&peer, "agent-a", &[i; 3]).await?;
        }
        let got = server.take_notifications();
        assert_eq!(got.len(), 5, "{plane:?}");
        for (i, n) in got.iter().enumerate() {
            assert_eq!(n.message, vec![i as u8; 3]);
            assert_eq!(n.name, "agent-a");
            assert_eq!(n.from, client.peer_id());
            assert_eq!(n.key_name, None);
        }
        assert!(server.take_notifications().is_empty());
        // Too long to carry: refused before anything is sent.
        let big = vec![0; ferry::core_types::wire::MAX_NOTIFY_LEN + 1];
        assert!(matches!(
            client.notify(&peer, "agent-a", &big).await,
            Err(Error::InvalidRequest { .. })
        ));
        // An engine that does not listen takes none: nothing to connect to. The server's own
        // inbox is untouched by the refusal above.
        assert!(server.take_notifications().is_empty());
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_engine_takes_notifications_only_from_key_holders() -> Result<()> {
    let both = format!("{ALICE}\n{BOB}");
    for plane in planes() {
        let server = engine(plane, true, Some(&both))?;
        let alice = engine(plane, false, Some(ALICE))?;
        let peer = alice.connect(server.local_addr().expect("listens")).await?;
        alice.notify(&peer, "prefill-0", b"kv ready").await?;
        let got = server.take_notifications();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].key_name.as_deref(), Some("alice"));
        assert_eq!(got[0].message, b"kv ready");
        // A stranger without the key: its connect is refused, so is a notification from a
        // keyed peer the server does not know (its own key only).
        let stranger = engine(plane, false, None)?;
        assert!(
            stranger
                .connect(server.local_addr().expect("listens"))
                .await
                .is_err()
        );
        let carol = engine(plane, false, Some("carol 202122232425262728292a2b2c2d2e2f"))?;
        assert!(
            carol
                .connect(server.local_addr().expect("listens"))
                .await
                .is_err()
        );
        assert!(server.take_notifications().is_empty(), "{plane:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_address_registered_after_connecting_is_found_and_bounds_hold() -> Result<()> {
    for plane in planes() {
        let server = engine(plane, true, None)?;
        let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
        let first = MemoryRegion::alloc_zeroed(8192, 4096)?;
        let first_base = first.as_ptr() as u64;
        // Published as the raw layer does: an opaque name, and the address in an index.
        let first_id = next_id();
        let _r1 = server.register(first, rw, &segment_name(first_id, "cpu:0"))?;
        let mut entries = vec![IndexEntry {
            id: first_id,
            base: first_base,
            len: 8192,
        }];
        let index = |entries: &[IndexEntry]| {
            server.register(
                MemoryRegion::from_vec(encode_index(entries)),
                Access::REMOTE_READ,
                &index_name(next_id()),
            )
        };
        let _i1 = index(&entries)?;
        let client = engine(plane, false, None)?;
        let local = client.register(MemoryRegion::alloc_zeroed(8192, 4096)?, Access::LOCAL, "l")?;
        local.region().write_at(0, b"raw address")?;
        let raw = RawPeer::new(
            client
                .connect(server.local_addr().expect("listens"))
                .await?,
        );
        raw.refresh(&client).await?;
        assert_eq!(raw.registrations().len(), 1);
        // Registered after the handshake: not in the first listing, found by a fresh one.
        let late = MemoryRegion::alloc_zeroed(4096, 4096)?;
        let late_base = late.as_ptr() as u64;
        let late_region = std::sync::Arc::new(late);
        let late_id = next_id();
        let _r2 = server.register(late_region.clone(), rw, &segment_name(late_id, "cpu:0"))?;
        entries.push(IndexEntry {
            id: late_id,
            base: late_base,
            len: 4096,
        });
        let _i2 = index(&entries)?;
        assert!(matches!(
            raw.lookup(late_base + 16, 11),
            Err(Error::UnknownAddress { .. })
        ));
        let (seg, off) = raw.resolve(&client, late_base + 16, 11).await?;
        assert_eq!(off, 16);
        let outcome = client
            .submit(Batch::new().write(&local, 0, &seg, off, 11))?
            .await;
        assert!(outcome.is_success(), "{outcome:?}");
        let mut got = [0u8; 11];
        late_region.read_at(16, &mut got)?;
        assert_eq!(&got, b"raw address");
        // Past the registration's end: refused, even after asking the peer again.
        match raw.resolve(&client, late_base + 4090, 11).await {
            Err(Error::UnknownAddress { reason, side, .. }) => {
                assert_eq!(side, "remote");
                assert!(reason.contains("passes the end"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert!(raw.resolve(&client, first_base, 0).await.is_err());
    }
    Ok(())
}

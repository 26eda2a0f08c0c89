//! Prometheus metrics: `EngineBuilder::metrics` serves `describe()`'s counters over HTTP in the
//! Prometheus text format, on both data planes; the numbers are the ones the transfers made.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use anyhow::{Context, Result, bail};
use ferry::{Access, Batch, DataPlane, MemoryRegion, TransferEngine};
use ferry_tests::{URING, require_or_skip};

fn planes() -> Vec<DataPlane> {
    #[cfg(feature = "uring")]
    let unusable = ferry::probe_kernel().unusable_reason();
    #[cfg(not(feature = "uring"))]
    let unusable = Some("built without the `uring` feature".to_owned());
    match unusable {
        None => vec![DataPlane::Tcp, DataPlane::Uring],
        Some(why) => {
            require_or_skip(URING, format!("io_uring unusable here: {why}"));
            vec![DataPlane::Tcp]
        }
    }
}

/// One HTTP/1.1 GET of `path`: the status line and the body.
fn get(addr: SocketAddr, path: &str) -> Result<(String, String, String)> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: */*\r\n\r\n"
    )?;
    let mut all = String::new();
    s.read_to_string(&mut all)?;
    let (head, body) = all.split_once("\r\n\r\n").context("no end of head")?;
    let status = head.lines().next().unwrap_or_default().to_owned();
    let content_type = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Type: "))
        .unwrap_or_default()
        .to_owned();
    Ok((status, content_type, body.to_owned()))
}

/// The value of the sample whose name and labels are exactly `series` (labels in the order
/// the encoder writes them).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_shows_what_the_transfers_moved() -> Result<()> {
    const LEN: usize = 3 << 20;
    for plane in planes() {
        let server = TransferEngine::builder()
            .same_host(false)
            .data_plane(plane)
            .listen("127.0.0.1:0".parse()?)
            .metrics("127.0.0.1:0".parse()?)
            .build()?;
        let _seg = server.register(
            MemoryRegion::from_vec(vec![7u8; LEN]),
            Access::REMOTE_READ | Access::REMOTE_WRITE,
            "w",
        )?;
        let metrics = server.metrics_addr().context("metrics served")?;
        let client = TransferEngine::builder()
            .same_host(false)
            .data_plane(plane)
            .metrics("127.0.0.1:0".parse()?)
            .build()?;
        let peer = client
            .connect(server.local_addr().context("listens")?)
            .await?;
        let remote = peer.segment("w")?;
        let buf = client.register(MemoryRegion::alloc_zeroed(LEN, 4096)?, Access::LOCAL, "b")?;
        // Two READs of the whole segment, one WRITE of 4 KiB, one READ refused (out of
        // bounds is checked locally, so an unknown token is what reaches the server: none here).
        for _ in 0..2 {
            let o = client
                .submit(Batch::new().read(&buf, 0, &remote, 0, LEN as u64))?
                .await;
            assert!(o.is_success(), "{o:?}");
        }
        let o = client
            .submit(Batch::new().write(&buf, 0, &remote, 0, 4096))?
            .await;
        assert!(o.is_success(), "{o:?}");

        let (status, content_type, text) = get(metrics, "/metrics")?;
        assert_eq!(status, "HTTP/1.1 200 OK", "{text}");
        assert_eq!(content_type, ferry::metrics::CONTENT_TYPE);
        assert_eq!(
            sample(&text, "ferry_served_bytes_total{op=\"read\"}"),
            Some((2 * LEN) as f64),
            "{plane:?}: {text}"
        );
        assert_eq!(
            sample(&text, "ferry_served_ops_total{op=\"write\"}"),
            Some(1.0),
            "{text}"
        );
        assert_eq!(sample(&text, "ferry_registrations"), Some(1.0), "{text}");
        assert_eq!(
            sample(&text, "ferry_handshake_refusals_total{reason=\"cap\"}"),
            Some(0.0),
            "{text}"
        );
        assert!(
            text.contains("# TYPE ferry_served_bytes_total counter"),
            "{text}"
        );

        // The client's side: by peer, transport, op and route; the latency histogram.
        let client_text = get(client.metrics_addr().context("metrics")?, "/metrics")?.2;
        assert_eq!(client_text, client.metrics_text());
        let addr = server.local_addr().context("listens")?;
        let transport = peer.transport().to_string();
        let labels = |op: &str| {
            format!("{{peer=\"{addr}\",transport=\"{transport}\",op=\"{op}\",route=\"direct\"}}")
        };
        assert_eq!(
            sample(
                &client_text,
                &format!("ferry_bytes_total{}", labels("read"))
            ),
            Some((2 * LEN) as f64),
            "{client_text}"
        );
        assert_eq!(
            sample(&client_text, &format!("ferry_ops_total{}", labels("write"))),
            Some(1.0),
            "{client_text}"
        );
        assert_eq!(
            sample(
                &client_text,
                "ferry_request_duration_seconds_count{op=\"read\",size=\"1MiB-16MiB\"}"
            ),
            Some(2.0),
            "{client_text}"
        );
        // The data plane's name alone labels the engine's identity, not free text.
        let info = client_text
            .lines()
            .find(|l| l.starts_with("ferry_engine_info{"))
            .expect("ferry_engine_info");
        let plane = info
            .split("data_plane=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .expect("a data_plane label");
        assert!(["uring", "tcp", "none"].contains(&plane), "{info}");
        assert_eq!(
            sample(
                &client_text,
                "ferry_request_duration_seconds_bucket{le=\"+Inf\",op=\"write\",size=\"0-4KiB\"}"
            )
            .or_else(|| sample(
                &client_text,
                "ferry_request_duration_seconds_bucket{op=\"write\",size=\"0-4KiB\",le=\"+Inf\"}"
            )),
            Some(1.0),
            "{client_text}"
        );
        // Other paths and methods are refused.
        assert_eq!(get(metrics, "/")?.0, "HTTP/1.1 404 Not Found");
        let mut s = TcpStream::connect(metrics)?;
        write!(s, "POST /metrics HTTP/1.1\r\n\r\n")?;
        let mut answer = String::new();
        s.read_to_string(&mut answer)?;
        if !answer.starts_with("HTTP/1.1 405") {
            bail!("POST answered {answer:?}");
        }
    }
    Ok(())
}

/// A metrics address already in use fails the build, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_in_use_fails_the_build_naming_it() -> Result<()> {
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = taken.local_addr()?;
    let e = TransferEngine::builder()
        .same_host(false)
        .metrics(addr)
        .build()
        .expect_err("the address is taken");
    assert!(e.to_string().contains(&addr.to_string()), "{e}");
    Ok(())
}

/// A batch of READs and WRITEs is counted op by op, by kind; a request the server refuses
/// (its segment retired after the client listed it) is a client failure of kind
/// `remote_unknown_segment` and a server refusal of status `unknown_segment`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_batches_and_refusals_are_counted_by_kind() -> Result<()> {
    let server = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Tcp)
        .listen("127.0.0.1:0".parse()?)
        .build()?;
    let kept = server.register(
        MemoryRegion::from_vec(vec![1u8; 1 << 20]),
        Access::REMOTE_READ | Access::REMOTE_WRITE,
        "kept",
    )?;
    let gone = server.register(
        MemoryRegion::from_vec(vec![2u8; 4096]),
        Access::REMOTE_READ,
        "gone",
    )?;
    let client = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Tcp)
        .build()?;
    let addr = server.local_addr().context("listens")?;
    let peer = client.connect(addr).await?;
    let (k, g) = (peer.segment("kept")?, peer.segment("gone")?);
    let buf = client.register(
        MemoryRegion::alloc_zeroed(1 << 20, 4096)?,
        Access::LOCAL,
        "b",
    )?;
    let o = client
        .submit(
            Batch::new()
                .read(&buf, 0, &k, 0, 1000)
                .write(&buf, 4096, &k, 4096, 3000)
                .read(&buf, 8192, &k, 8192, 500),
        )?
        .await;
    assert!(o.is_success(), "{o:?}");
    gone.retire()?;
    let o = client
        .submit(Batch::new().read(&buf, 0, &g, 0, 4096))?
        .await;
    assert!(!o.is_success(), "a READ of a retired segment succeeded");
    drop(kept);

    let text = client.metrics_text();
    let route = |op: &str| {
        format!(
            "{{peer=\"{addr}\",transport=\"{}\",op=\"{op}\",route=\"direct\"}}",
            peer.transport()
        )
    };
    assert_eq!(
        sample(&text, &format!("ferry_bytes_total{}", route("read"))),
        Some(1500.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, &format!("ferry_ops_total{}", route("read"))),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, &format!("ferry_bytes_total{}", route("write"))),
        Some(3000.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            &format!(
                "ferry_request_failures_total{{peer=\"{addr}\",transport=\"{}\",\
                 kind=\"remote_unknown_segment\"}}",
                peer.transport()
            )
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "ferry_request_duration_seconds_count{op=\"mixed\",size=\"4KiB-64KiB\"}"
        ),
        Some(1.0),
        "{text}"
    );
    let served = server.metrics_text();
    assert_eq!(
        sample(
            &served,
            "ferry_served_refusals_total{status=\"unknown_segment\"}"
        ),
        Some(1.0),
        "{served}"
    );
    assert_eq!(
        sample(&served, "ferry_served_ops_total{op=\"read\"}"),
        Some(2.0),
        "{served}"
    );
    Ok(())
}

/// Idle connections past the cap cannot keep a scrape out: the oldest are closed unanswered to
/// make room (the endpoint's gate evicts), the newest get their `400` at the request deadline,
/// and a scrape arriving after them all is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_past_the_cap_give_way_to_a_scrape() -> Result<()> {
    let engine = TransferEngine::builder()
        .same_host(false)
        .metrics("127.0.0.1:0".parse()?)
        .build()?;
    let metrics = engine.metrics_addr().context("serves metrics")?;
    tokio::task::spawn_blocking(move || -> Result<()> {
        // Twice the endpoint's 16 places.
        let idle: Vec<TcpStream> = (0..32)
            .map(|_| TcpStream::connect(metrics))
            .collect::<std::io::Result<_>>()?;
        let (status, _, body) = get(metrics, "/metrics")?;
        assert_eq!(status, "HTTP/1.1 200 OK");
        assert!(body.contains("ferry_"), "{body}");
        // Bounded, so that a server that never closes fails the test instead of hanging it.
        let bound = Some(std::time::Duration::from_secs(20));
        let (mut evicted, mut timed_out) = (0, 0);
        for mut s in idle {
            s.set_read_timeout(bound)?;
            let mut answer = String::new();
            s.read_to_string(&mut answer)?;
            if answer.is_empty() {
                evicted += 1;
            } else {
                assert!(answer.starts_with("HTTP/1.1 400"), "{answer:?}");
                timed_out += 1;
            }
        }
        // 32 idle and one scrape through 16 places: 17 made room and the other 15 timed out
        // (more time out, fewer make room, on a server so slow the first reach the deadline
        // before the last arrive).
        assert_eq!(evicted + timed_out, 32);
        assert!(
            evicted >= 1,
            "nothing was evicted: the scrape found a free place"
        );
        Ok(())
    })
    .await??;
    Ok(())
}

/// `ferry_registered_bytes` counts each registration's range once: a 3 MiB segment and a 1 MiB
/// local buffer are 4 MiB, whatever copies the budget charges.
#[test]
fn registered_bytes_count_each_range_once() -> Result<()> {
    let engine = TransferEngine::builder().same_host(false).build()?;
    let _seg = engine.register(
        MemoryRegion::alloc_zeroed(3 << 20, 4096)?,
        Access::REMOTE_READ,
        "seg",
    )?;
    let local = engine.register(
        MemoryRegion::alloc_zeroed(1 << 20, 4096)?,
        Access::LOCAL,
        "l",
    )?;
    let d = engine.describe();
    assert_eq!(d.registered_bytes, 4 << 20, "{d}");
    assert!(d.budget_bytes >= d.registered_bytes, "{d}");
    drop(local);
    assert_eq!(engine.describe().registered_bytes, 3 << 20);
    Ok(())
}

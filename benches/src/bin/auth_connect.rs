//! What authentication costs a connect: two loopback servers in this process, one with a key
//! and one without, the same data plane and segments; rounds alternate between them, and each
//! round times `--connects` connects (the control handshake, then the data streams attached)
//! and as many bare control handshakes. Prints the p50 of each per round and the ratio of the
//! medians over rounds (keyed over plain). Run with:
//!
//! ```text
//! cargo run --release -p ferry-benches --bin auth_connect -- [--rounds N] [--connects N]
//!     [--streams N] [--plane tcp|uring]
//! ```

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry::core_types::wire::{Hello, SUPPORTED_VERSIONS, TransportOffer};
use ferry::{Access, DataPlane, Epoch, Keyring, MemoryRegion, PeerId, TransferEngine};

const KEY: &str = "bench 000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct Side {
    server: TransferEngine,
    client: TransferEngine,
    keyring: Option<Keyring>,
    _seg: ferry::Registration,
}

impl Side {
    fn new(plane: DataPlane, streams: usize, keyed: bool) -> Result<Self> {
        let keyring = keyed.then(|| Keyring::parse(KEY)).transpose()?;
        let with_key = |b: ferry::EngineBuilder| match &keyring {
            Some(k) => b.auth_keyring(k.clone()),
            None => b.no_auth(),
        };
        let server = with_key(
            TransferEngine::builder()
                .listen("127.0.0.1:0".parse()?)
                .data_plane(plane)
                .streams(streams),
        )
        .build()?;
        let seg = server.register(
            MemoryRegion::alloc_zeroed(1 << 20, 4096)?,
            Access::REMOTE_READ,
            "x",
        )?;
        let client =
            with_key(TransferEngine::builder().data_plane(plane).streams(streams)).build()?;
        Ok(Self {
            server,
            client,
            keyring,
            _seg: seg,
        })
    }

    fn addr(&self) -> Result<SocketAddr> {
        self.server.local_addr().context("no listener")
    }

    /// p50 of `n` connects, in microseconds.
    async fn connects(&self, n: usize) -> Result<f64> {
        let addr = self.addr()?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            let peer = self.client.connect(addr).await?;
            v.push(t.elapsed().as_secs_f64() * 1e6);
            drop(peer);
        }
        Ok(median(&mut v))
    }

    /// p50 of `n` control handshakes alone, in microseconds.
    async fn handshakes(&self, n: usize) -> Result<f64> {
        let addr = self.addr()?;
        let hello = Hello {
            versions: SUPPORTED_VERSIONS,
            peer_id: PeerId::random(),
            epoch: Epoch::fresh(),
            transports: vec![TransportOffer::Tcp {
                streams: 1,
                port: 0,
            }],
            segments: vec![],
        };
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            ferry_transport_tcp::handshake_with(
                addr,
                &hello,
                self.keyring.as_ref(),
                Duration::from_secs(10),
            )
            .await?;
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
        Ok(median(&mut v))
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let mut rounds = 6usize;
    let mut connects = 200usize;
    let mut streams = 1usize;
    let mut plane = DataPlane::Tcp;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--rounds" => rounds = value()?.parse()?,
            "--connects" => connects = value()?.parse()?,
            "--streams" => streams = value()?.parse()?,
            "--plane" => {
                plane = match value()?.as_str() {
                    "tcp" => DataPlane::Tcp,
                    "uring" => DataPlane::Uring,
                    other => bail!("--plane {other}: tcp or uring"),
                }
            }
            other => bail!("unknown option {other}"),
        }
    }
    let plain = Side::new(plane, streams, false)?;
    let keyed = Side::new(plane, streams, true)?;
    // Warm up both (threads, first connections).
    plain.connects(connects / 10 + 1).await?;
    keyed.connects(connects / 10 + 1).await?;
    let (mut pc, mut kc, mut ph, mut kh) = (vec![], vec![], vec![], vec![]);
    println!(
        "| round | connect plain µs | connect keyed µs | handshake plain µs | handshake keyed µs |"
    );
    println!("|---|---|---|---|---|");
    for r in 0..rounds {
        // Alternate which goes first, so neither always runs on a warmer machine.
        let (a, b) = if r % 2 == 0 {
            (&plain, &keyed)
        } else {
            (&keyed, &plain)
        };
        let (ca, ha) = (a.connects(connects).await?, a.handshakes(connects).await?);
        let (cb, hb) = (b.connects(connects).await?, b.handshakes(connects).await?);
        let ((c_plain, h_plain), (c_keyed, h_keyed)) = if r % 2 == 0 {
            ((ca, ha), (cb, hb))
        } else {
            ((cb, hb), (ca, ha))
        };
        println!("| {r} | {c_plain:.1} | {c_keyed:.1} | {h_plain:.1} | {h_keyed:.1} |");
        pc.push(c_plain);
        kc.push(c_keyed);
        ph.push(h_plain);
        kh.push(h_keyed);
    }
    let (pc, kc, ph, kh) = (
        median(&mut pc),
        median(&mut kc),
        median(&mut ph),
        median(&mut kh),
    );
    println!();
    println!(
        "| what ({plane:?}, {streams} stream(s), median of {rounds} rounds of {connects}) | plain µs | keyed µs | keyed / plain |"
    );
    println!("|---|---|---|---|");
    println!(
        "| connect (handshake + streams) | {pc:.1} | {kc:.1} | {:.2} |",
        kc / pc
    );
    println!(
        "| control handshake alone | {ph:.1} | {kh:.1} | {:.2} |",
        kh / ph
    );
    Ok(())
}

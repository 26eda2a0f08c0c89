//! The simulated fleet (`ferry_broadcast::sim`): completion time over ideal for the chain and
//! the striped trees, N = 8 to 256, uniform links and heterogeneous ones with 10% stragglers.
//!
//!     cargo run --release -p ferry-broadcast --example fleet_sim
//!
//! Links of 200 Mbit/s (25 MB/s) each way (heterogeneous: each rate uniform in +-20%), 50 us
//! latency, a 256 MiB payload in 1 MiB chunks (the shaped-namespace bench's), one member in ten
//! a straggler at a quarter of the rate. Efficiency: of the worst member, its ideal (payload
//! over its own download rate, or the source's upload if lower) over the time it held everything; among the members that are
//! not stragglers, and (last column) among the stragglers.

use std::time::Instant;

use ferry_broadcast::sim::{Link, Topology, fleet, simulate};

fn main() {
    let rate = 25e6;
    let payload = 256u64 << 20;
    let chunk = 1u64 << 20;
    let source = Link {
        up: rate,
        down: rate,
        latency: 50e-6,
    };
    let stripes = Topology::Stripes {
        d: 4,
        straggler: 0.5,
    };
    println!(
        "| N | chain, uniform | stripes d=4, uniform | chain, +-20% links, 10% stragglers | stripes d=4, +-20% links, 10% stragglers | the stragglers themselves (stripes) |"
    );
    println!("|---|---|---|---|---|---|");
    let wall = Instant::now();
    for n in [8usize, 32, 128, 256] {
        let (same, _) = fleet(n, rate, 50e-6, 0.0, 0, 1.0, 1);
        let (mixed, slow) = fleet(n, rate, 50e-6, 0.2, 10, 0.25, 7);
        // The worst member's time over its own ideal (payload / its download rate), among the
        // members that are not stragglers, and among the stragglers.
        let eff = |links: &[Link], slow: &[bool], t: Topology| {
            let o = simulate(source, links, payload, chunk, t);
            let worst = |want: bool| {
                o.done
                    .iter()
                    .zip(links)
                    .zip(slow)
                    .filter(|(_, s)| **s == want)
                    .map(|((d, l), _)| (payload as f64 / l.down.min(source.up)) / d)
                    .fold(f64::MAX, f64::min)
            };
            (
                worst(false),
                o.source_egress as f64 / payload as f64,
                worst(true),
            )
        };
        let none = vec![false; n];
        let (c, ce, _) = eff(&same, &none, Topology::Chain);
        let (s, se, _) = eff(&same, &none, stripes);
        let (ch, _, _) = eff(&mixed, &slow, Topology::Chain);
        let (sh, _, st) = eff(&mixed, &slow, stripes);
        let st = if st == f64::MAX {
            "(none)".to_string()
        } else {
            format!("{st:.2}")
        };
        println!(
            "| {n} | {c:.2} (egress {ce:.2}x) | {s:.2} (egress {se:.2}x) | {ch:.2} | {sh:.2} | {st} |"
        );
    }
    println!(
        "\n(simulated in {:.2} s of wall time)",
        wall.elapsed().as_secs_f64()
    );
}

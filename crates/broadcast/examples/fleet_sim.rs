//! The simulated fleet (`ferry_broadcast::sim`): completion time over ideal for the chain and
//! the striped trees the receivers follow, N = 8 to 256, uniform links and heterogeneous ones
//! with 10% stragglers; then the same with the costs calibrated against the shaped-namespace
//! bench (`docs/broadcast.md`).
//!
//!     cargo run --release -p ferry-broadcast --example fleet_sim [GOODPUT [PER_CHUNK_S [START_S]]]
//!
//! Links of 200 Mbit/s (25 MB/s) each way (heterogeneous: each rate uniform in +-20%), 50 us
//! latency, a 256 MiB payload in 1 MiB chunks (the shaped-namespace bench's), one member in ten
//! a straggler at a quarter of the rate. Efficiency: of the worst member, its ideal (payload
//! over its own download rate, or the source's upload if lower) over the time it held
//! everything; among the members that are not stragglers, and (last column) among the
//! stragglers. The calibrated table takes `sim::Costs` from the arguments (default: the
//! calibration in `docs/broadcast.md`). Last, with the calibrated costs, member N/2 killed at
//! half the ideal time: the chain, the receivers' numbered plan and the plan by rank it
//! replaced.

use std::time::Instant;

use ferry_broadcast::sim::{
    Costs, Departure, Link, Topology, fleet, simulate_departure, simulate_with,
};

fn main() {
    let arg = |i: usize, default: f64| {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(default)
    };
    let calibrated = Costs {
        goodput: arg(1, 0.83),
        per_chunk: arg(2, 0.003),
        start: arg(3, 0.1),
    };
    let rate = 25e6;
    let payload = 256u64 << 20;
    let chunk = 1u64 << 20;
    let source = Link {
        up: rate,
        down: rate,
        latency: 50e-6,
    };
    let stripes = |d| Topology::Stripes { d, straggler: 0.5 };
    let wall = Instant::now();
    for (title, costs) in [("links alone", Costs::NONE), ("calibrated", calibrated)] {
        println!("\n{title}: {costs:?}\n");
        println!(
            "| N | chain, uniform | stripes d=2, uniform | stripes d=4, uniform | chain, +-20% links, 10% stragglers | stripes d=2, same | stripes d=4, same | the stragglers themselves (d=4) |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for n in [1usize, 8, 16, 32, 128, 256] {
            let (same, _) = fleet(n, rate, 50e-6, 0.0, 0, 1.0, 1);
            let (mixed, slow) = fleet(n, rate, 50e-6, 0.2, 10, 0.25, 7);
            // The worst member's time over its own ideal (payload / its download rate), among
            // the members that are not stragglers, and among the stragglers.
            let eff = |links: &[Link], slow: &[bool], t: Topology| {
                let o = simulate_with(source, links, payload, chunk, t, costs);
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
            let (s2, _, _) = eff(&same, &none, stripes(2));
            let (s4, se, _) = eff(&same, &none, stripes(4));
            let (ch, _, _) = eff(&mixed, &slow, Topology::Chain);
            let (sh2, _, _) = eff(&mixed, &slow, stripes(2));
            let (sh4, _, st) = eff(&mixed, &slow, stripes(4));
            let st = if st == f64::MAX {
                "(none)".to_string()
            } else {
                format!("{st:.2}")
            };
            println!(
                "| {n} | {c:.2} (egress {ce:.2}x) | {s2:.2} | {s4:.2} (egress {se:.2}x) | {ch:.2} | {sh2:.2} | {sh4:.2} | {st} |"
            );
        }
    }
    // One member killed halfway through the ideal time (the bench's middle receiver); the
    // others plan without it `detect` seconds later.
    for detect in [0.1, 1.0] {
        println!(
            "\ncalibrated, uniform links, member N/2 killed at half the ideal time, the others \
             replanning {detect} s later: the survivors' worst efficiency (source egress, members \
             whose parent changed)\n"
        );
        println!(
            "| N | chain | stripes d=2, numbered | stripes d=2, by rank (before) | stripes d=4, numbered |"
        );
        println!("|---|---|---|---|---|");
        for n in [8usize, 32, 128, 256] {
            let (same, _) = fleet(n, rate, 50e-6, 0.0, 0, 1.0, 1);
            let ideal = payload as f64 / rate;
            let gone = Departure {
                member: n / 2,
                at: ideal / 2.0,
                detect,
            };
            let eff = |t: Topology| {
                let o =
                    simulate_departure(source, &same, payload, chunk, t, calibrated, Some(gone));
                let last = o.done.iter().copied().fold(0.0, f64::max);
                format!(
                    "{:.2} ({:.2}x, {} moved)",
                    ideal / last,
                    o.source_egress as f64 / payload as f64,
                    o.moved
                )
            };
            println!(
                "| {n} | {} | {} | {} | {} |",
                eff(Topology::Chain),
                eff(stripes(2)),
                eff(Topology::StripesByRank {
                    d: 2,
                    straggler: 0.5
                }),
                eff(stripes(4)),
            );
        }
    }
    println!(
        "\n(simulated in {:.2} s of wall time)",
        wall.elapsed().as_secs_f64()
    );
}

//! A discrete-event simulation of a broadcast over links, with no sockets and no clock: the
//! chain (each member fetching everything from the one that joined before it) or the striped
//! trees the receivers follow ([`StripePlan::numbered`], members numbered in join order) on
//! members whose links each have an upload and a download rate and a latency, so that a fleet
//! of 256 runs in well under a second; optionally with one member killed mid-broadcast
//! ([`simulate_departure`]).
//!
//! The model. Each parent-child pair of the plan is a pipe: the parent's upload rate shared
//! evenly by its children and the child's download rate by its parents (the fair share of
//! both links when every flow is busy, as in the steady state), `min(up / children, down /
//! parents)`. A member that holds chunk `c` serves it to each member whose parent it is for
//! `c`'s stripe (unless another parent is sending it already): the child learns of it one
//! latency later (the progress long poll), its READ reaches the parent one latency after that,
//! the pipe carries the chunks in the order they were asked for, and the bytes arrive one
//! latency after they leave. The source holds every chunk at time 0. The window is not
//! modelled (pipes are kept busy, as the window does when it suffices). [`simulate_with`] adds
//! what a member pays besides its links ([`Costs`]: the frames' headers, each chunk's hashing
//! and advertisement, the start-up), calibrated against the shaped-namespace bench (see
//! `docs/broadcast.md`).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::stripes::{Parent, StripePlan};

/// One member's link.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Upload rate, bytes per second.
    pub up: f64,
    /// Download rate, bytes per second.
    pub down: f64,
    /// One-way latency to any other member, seconds.
    pub latency: f64,
}

/// Which plan the members follow.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Topology {
    /// Each member fetches everything from the member before it (the source first); after a
    /// departure, from the nearest member before it still there.
    Chain,
    /// The receivers' plan, [`StripePlan::numbered`] with `d` stripes, members numbered in
    /// join order, stragglers below `straggler` times the median rate.
    Stripes {
        /// Stripes and tree degree.
        d: usize,
        /// Straggler threshold (fraction of the median rate).
        straggler: f64,
    },
    /// The plan before stable numbers, [`StripePlan::in_join_order`]: groups dealt by rank in
    /// join order, so a departure shifts every member after it (for comparison).
    StripesByRank {
        /// Stripes and tree degree.
        d: usize,
        /// Straggler threshold (fraction of the median rate).
        straggler: f64,
    },
}

/// A member that leaves mid-broadcast (killed: what it was sending is lost).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Departure {
    /// The member (index in join order).
    pub member: usize,
    /// When it dies, seconds.
    pub at: f64,
    /// How long until the others plan without it, seconds (a child's fetch failing, the
    /// others reading the list): from `at + detect` they follow the plan made without it,
    /// each member whose parent changed fetching from its new parent what it lacks.
    pub detect: f64,
}

/// What a real member pays that links alone do not: measured apart (an N = 1 run of the
/// shaped-namespace bench, the hashing bench, the timeline), then checked against the bench at
/// N = 8 (`docs/broadcast.md`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    /// Payload over wire bytes (TCP/IP and Ethernet headers in each frame a shaper counts:
    /// 1448 of 1514 bytes with timestamps), so every pipe carries `goodput` times its rate.
    pub goodput: f64,
    /// Seconds from a chunk's last byte arriving to its holder advertising it: hashing it
    /// (BLAKE3) and the progress answer reaching the children.
    pub per_chunk: f64,
    /// Seconds from the start until a member fetches (process start, manifest, join).
    pub start: f64,
}

impl Costs {
    /// Links alone: the model before calibration.
    pub const NONE: Costs = Costs {
        goodput: 1.0,
        per_chunk: 0.0,
        start: 0.0,
    };
}

/// What a simulated broadcast did.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// When each member held every chunk, seconds.
    pub done: Vec<f64>,
    /// Bytes the source sent.
    pub source_egress: u64,
    /// Members whose parent in some stripe changed when the others planned without the
    /// departed member ([`simulate_departure`]; 0 without one).
    pub moved: usize,
}

/// Simulates one broadcast of `payload` bytes in `chunk`-byte chunks from a source with link
/// `source` to `members` (in join order), each fetching per `topology`: links alone
/// ([`Costs::NONE`]).
pub fn simulate(
    source: Link,
    members: &[Link],
    payload: u64,
    chunk: u64,
    topology: Topology,
) -> Outcome {
    simulate_with(source, members, payload, chunk, topology, Costs::NONE)
}

/// [`simulate`] with what members pay besides their links ([`Costs`]).
pub fn simulate_with(
    source: Link,
    members: &[Link],
    payload: u64,
    chunk: u64,
    topology: Topology,
    costs: Costs,
) -> Outcome {
    simulate_departure(source, members, payload, chunk, topology, costs, None)
}

/// Each member's parent per stripe (index `n`: the source) under `topology`, for the members
/// not in `gone`; and the stripes.
fn parents(links: &[Link], topology: Topology, gone: Option<usize>) -> Vec<Vec<usize>> {
    let n = links.len();
    let alive: Vec<usize> = (0..n).filter(|&m| Some(m) != gone).collect();
    let rates: Vec<f64> = alive
        .iter()
        .map(|&m| links[m].up.min(links[m].down))
        .collect();
    let plan = match topology {
        Topology::Chain => {
            let mut p = vec![n; n];
            for (i, &m) in alive.iter().enumerate() {
                p[m] = if i == 0 { n } else { alive[i - 1] };
            }
            return vec![p];
        }
        Topology::Stripes { d, straggler } => {
            let numbers: Vec<u64> = alive.iter().map(|&m| m as u64).collect();
            StripePlan::numbered(&numbers, &rates, d, straggler, &[])
        }
        Topology::StripesByRank { d, straggler } => {
            StripePlan::in_join_order(&rates, d, straggler, &[])
        }
    };
    (0..plan.stripes())
        .map(|s| {
            let mut p = vec![n; n];
            for (i, &m) in alive.iter().enumerate() {
                if let Parent::Member(q) = plan.parent(s, i) {
                    p[m] = alive[q];
                }
            }
            p
        })
        .collect()
}

/// The pipes' shares under `parents`: distinct children of each member (and the source, at
/// `n`) and distinct parents of each member over all stripes.
fn degrees(parents: &[Vec<usize>], n: usize, gone: Option<usize>) -> (Vec<usize>, Vec<usize>) {
    let mut pipes = std::collections::HashSet::new();
    for per in parents {
        for (m, &p) in per.iter().enumerate() {
            if Some(m) != gone {
                pipes.insert((p, m));
            }
        }
    }
    let mut out_deg = vec![0usize; n + 1];
    let mut in_deg = vec![0usize; n];
    for &(p, ch) in &pipes {
        out_deg[p] += 1;
        in_deg[ch] += 1;
    }
    (out_deg, in_deg)
}

/// [`simulate_with`], and one member leaving as `departure` says: its done time is NaN, what
/// it was sending when it died is lost, and from `at + detect` the others follow the plan
/// made without it (a member whose parent changed fetches from the new one every chunk of
/// that stripe it lacks and no live parent is sending it).
pub fn simulate_departure(
    source: Link,
    members: &[Link],
    payload: u64,
    chunk: u64,
    topology: Topology,
    costs: Costs,
    departure: Option<Departure>,
) -> Outcome {
    let n = members.len();
    let chunks = payload.div_ceil(chunk.max(1)) as usize;
    let len_of = |c: usize| (payload - c as u64 * chunk).min(chunk) as f64;
    let dead = departure.map(|d| d.member).filter(|&m| m < n);
    let kill = departure.map_or(f64::INFINITY, |d| d.at);
    let switch = departure.map_or(f64::INFINITY, |d| d.at + d.detect.max(0.0));
    let plans = [
        parents(members, topology, None),
        parents(members, topology, dead),
    ];
    let stripes = plans[0].len();
    let mut children: Vec<Vec<Vec<Vec<usize>>>> = Vec::with_capacity(2);
    let mut degs = Vec::with_capacity(2);
    for (phase, plan) in plans.iter().enumerate() {
        let gone = if phase == 0 { None } else { dead };
        let mut per_stripe = vec![vec![Vec::new(); n + 1]; stripes];
        for (s, per) in plan.iter().enumerate() {
            for m in (0..n).filter(|&m| Some(m) != gone) {
                per_stripe[s][per[m]].push(m);
            }
        }
        children.push(per_stripe);
        degs.push(degrees(plan, n, gone));
    }
    let link = |m: usize| if m == n { source } else { members[m] };
    let mut pipe_free: std::collections::HashMap<(usize, usize), f64> =
        std::collections::HashMap::new();
    let mut held = vec![vec![false; chunks]; n];
    // Per member and chunk: the parent sending it and when it arrives.
    let mut asked: Vec<Vec<Option<(usize, f64)>>> = vec![vec![None; chunks]; n];
    let mut count = vec![0usize; n];
    let mut done = vec![0.0f64; n];
    let mut egress = 0u64;
    // Events: (time in picoseconds, member, chunk, sender); the source's are all at 0, and
    // the switch to the plan without the departed member is (switch, n + 1, 0, 0).
    let mut events: BinaryHeap<Reverse<(u64, usize, usize, usize)>> = BinaryHeap::new();
    let ps = |t: f64| (t * 1e12) as u64;
    for c in 0..chunks {
        events.push(Reverse((0, n, c, n)));
    }
    if switch.is_finite() {
        events.push(Reverse((ps(switch), n + 1, 0, 0)));
    }
    // Sends chunk `c` from `p` to `ch` no earlier than `now`, on their pipe.
    let mut send = |events: &mut BinaryHeap<Reverse<(u64, usize, usize, usize)>>,
                    asked: &mut Vec<Vec<Option<(usize, f64)>>>,
                    phase: usize,
                    now: f64,
                    p: usize,
                    ch: usize,
                    c: usize| {
        let (from, to) = (link(p), members[ch]);
        let lat = from.latency.max(to.latency);
        let len = len_of(c);
        let (out_deg, in_deg) = &degs[phase];
        let rate = costs.goodput
            * (from.up / out_deg[p].max(1) as f64).min(to.down / in_deg[ch].max(1) as f64);
        let free = pipe_free.entry((p, ch)).or_insert(costs.start);
        let start = (now + 2.0 * lat).max(*free);
        *free = start + len / rate;
        if p == n {
            egress += len as u64;
        }
        let at = *free + lat + costs.per_chunk;
        asked[ch][c] = Some((p, at));
        events.push(Reverse((ps(at), ch, c, p)));
    };
    while let Some(Reverse((t, m, c, from))) = events.pop() {
        let now = t as f64 / 1e12;
        if m == n + 1 {
            // The others plan without the departed member: whoever's parent changed asks
            // the new one for what it lacks and no live parent is sending.
            for (s, (was, now_p)) in plans[0].iter().zip(&plans[1]).enumerate() {
                for ch in (0..n).filter(|&ch| Some(ch) != dead) {
                    let q = now_p[ch];
                    if q == was[ch] {
                        continue;
                    }
                    for c in (s..chunks).step_by(stripes) {
                        let lost = asked[ch][c].is_none_or(|(p, _)| Some(p) == dead);
                        if !held[ch][c] && lost && (q == n || held[q][c]) {
                            send(&mut events, &mut asked, 1, now, q, ch, c);
                        }
                    }
                }
            }
            continue;
        }
        if dead.is_some_and(|x| (from == x || m == x) && now > kill) {
            if m < n && asked[m][c].is_some_and(|(p, _)| Some(p) == dead) {
                asked[m][c] = None;
            }
            continue;
        }
        if m < n {
            if held[m][c] {
                continue;
            }
            held[m][c] = true;
            count[m] += 1;
            if count[m] == chunks {
                done[m] = now;
            }
        }
        let phase = usize::from(now >= switch);
        for &ch in &children[phase][c % stripes][m] {
            if held[ch][c] || asked[ch][c].is_some_and(|(p, _)| Some(p) != dead) {
                continue;
            }
            send(&mut events, &mut asked, phase, now, m, ch, c);
        }
    }
    if let Some(x) = dead {
        done[x] = f64::NAN;
    }
    let moved = (0..n)
        .filter(|&m| Some(m) != dead && departure.is_some())
        .filter(|&m| (0..stripes).any(|s| plans[0][s][m] != plans[1][s][m]))
        .count();
    Outcome {
        done,
        source_egress: egress,
        moved,
    }
}

/// A deterministic fleet of `n` members around `rate` bytes/s: each link's rates uniform in
/// `rate * [1 - spread, 1 + spread]`, and members `k` with `k % every == every - 1` (one in
/// `every`; none if `every` is 0) stragglers at `slow * rate`. Returns the links and which
/// members straggle.
pub fn fleet(
    n: usize,
    rate: f64,
    latency: f64,
    spread: f64,
    every: usize,
    slow: f64,
    seed: u64,
) -> (Vec<Link>, Vec<bool>) {
    let mut x = seed | 1;
    let mut uniform = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut links = Vec::with_capacity(n);
    let mut slowed = Vec::with_capacity(n);
    for k in 0..n {
        let straggles = every > 0 && k % every == every - 1;
        let f = if straggles { slow } else { 1.0 };
        let up = rate * f * (1.0 - spread + 2.0 * spread * uniform());
        let down = rate * f * (1.0 - spread + 2.0 * spread * uniform());
        links.push(Link { up, down, latency });
        slowed.push(straggles);
    }
    (links, slowed)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: f64 = 1e6;

    fn uniform(n: usize) -> Vec<Link> {
        vec![
            Link {
                up: 25.0 * MB,
                down: 25.0 * MB,
                latency: 1e-4,
            };
            n
        ]
    }

    #[test]
    fn a_chain_costs_one_chunk_per_hop_and_the_source_sends_once() {
        let src = uniform(1)[0];
        let payload = 256u64 << 20;
        let chunk = 1u64 << 20;
        let per_chunk = chunk as f64 / (25.0 * MB);
        let ideal = payload as f64 / (25.0 * MB);
        for n in [1, 8, 64] {
            let o = simulate(src, &uniform(n), payload, chunk, Topology::Chain);
            let last = o.done.iter().copied().fold(0.0, f64::max);
            // The last member: the payload at link rate, and one chunk and three latencies
            // for each hop before it.
            let want = ideal + n as f64 * (3e-4) + (n - 1) as f64 * per_chunk;
            assert!(
                (last - want).abs() < 1e-3 + 1e-6 * want,
                "n {n}: {last} vs {want}"
            );
            assert_eq!(o.source_egress, payload);
        }
    }

    #[test]
    fn costs_add_the_start_each_chunks_advertisement_and_the_headers() {
        let src = uniform(1)[0];
        let payload = 64u64 << 20;
        let costs = Costs {
            goodput: 0.9,
            per_chunk: 0.004,
            start: 0.25,
        };
        let o = simulate_with(src, &uniform(1), payload, 1 << 20, Topology::Chain, costs);
        // The pipe starts at `start` (after the READ's two latencies), carries the payload at
        // `goodput` of the rate, and the last chunk counts one latency and its advertisement
        // later.
        let want = 0.25 + payload as f64 / (25.0 * MB * 0.9) + 1e-4 + 0.004;
        assert!((o.done[0] - want).abs() < 1e-6, "{} vs {want}", o.done[0]);
        // Per hop, a chain pays a chunk and its advertisement again.
        let o = simulate_with(src, &uniform(2), payload, 1 << 20, Topology::Chain, costs);
        let hop = (1u64 << 20) as f64 / (25.0 * MB * 0.9) + 3e-4 + 0.004;
        assert!((o.done[1] - o.done[0] - hop).abs() < 1e-3, "{:?}", o.done);
    }

    #[test]
    fn after_a_departure_every_other_member_finishes_and_the_source_still_sends_once() {
        let src = uniform(1)[0];
        let payload = 64u64 << 20;
        let ideal = payload as f64 / (25.0 * MB);
        for t in [
            Topology::Chain,
            Topology::Stripes {
                d: 2,
                straggler: 0.5,
            },
            Topology::StripesByRank {
                d: 2,
                straggler: 0.5,
            },
        ] {
            for victim in [0, 5, 31] {
                let gone = Departure {
                    member: victim,
                    at: ideal / 2.0,
                    detect: 0.1,
                };
                let o = simulate_departure(
                    src,
                    &uniform(32),
                    payload,
                    1 << 20,
                    t,
                    Costs::NONE,
                    Some(gone),
                );
                assert!(o.done[victim].is_nan());
                for (m, &d) in o.done.iter().enumerate() {
                    assert!(
                        m == victim || d > ideal * 0.99,
                        "{t:?}: member {m} done at {d}"
                    );
                }
                let last = o.done.iter().copied().fold(0.0, f64::max);
                // The lost share is fetched again: more than the ideal, never unbounded.
                assert!(
                    last < ideal * 3.0,
                    "{t:?}, victim {victim}: {last} vs {ideal}"
                );
                // The chain's first member or a stripe's root dying hands its place to another
                // member, whose missing chunks the source sends again; anyone else's children
                // take over from relays.
                if victim != 0 {
                    assert_eq!(o.source_egress, payload, "{t:?}, victim {victim}");
                }
                // Numbered, only the victim's children move (two per stripe it is inner in,
                // at most, and one in the chain); by rank, everyone after it may. The
                // highest number leaving re-deals its stripe's leaves (`StripePlan::numbered`).
                if !matches!(t, Topology::StripesByRank { .. }) && victim != 31 {
                    assert!(o.moved <= 4, "{t:?}, victim {victim}: {} moved", o.moved);
                }
            }
        }
    }

    #[test]
    fn striped_trees_send_once_from_the_source_and_stay_near_the_ideal() {
        let src = uniform(1)[0];
        let payload = 256u64 << 20;
        let ideal = payload as f64 / (25.0 * MB);
        let t = Topology::Stripes {
            d: 4,
            straggler: 0.5,
        };
        let o = simulate(src, &uniform(256), payload, 1 << 20, t);
        assert_eq!(o.source_egress, payload);
        let last = o.done.iter().copied().fold(0.0, f64::max);
        // Depth about log4(64) + 1 hops of a chunk each, and every member uploading about
        // one payload: far from the chain's 256 hops.
        assert!(last < ideal * 1.2, "{last} vs {ideal}");
        assert!(o.done.iter().all(|&d| d > 0.0));
    }
}

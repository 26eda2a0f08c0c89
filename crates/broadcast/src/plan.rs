//! The plan every member derives from the membership list, and a receiver's bookkeeping of
//! what it holds: no I/O, unit-tested.
//!
//! **The plan: striped trees dealt by stable member numbers** ([`stripe_holders`]). Discovery
//! numbers each receiver at join ([`Member::number`], dense from 0 within a version, kept
//! until it leaves). The chunks are dealt into `d` stripes, each carried down its own tree of
//! bounded depth ([`StripePlan::numbered`]), so the source sends each byte once, every member
//! uploads about what it downloads, and a straggler (by the rates the members list) serves no
//! one; with `d = 1` it is a chain by number. A member fetches each stripe from its parent in
//! that stripe's tree, and only chunks its parent has verified (the parent's verified prefix
//! of that stripe), with several chunks in flight. A member that leaves, or that a receiver
//! gives up on (dead, stalled, corrupting, of another epoch), leaves a hole at its number: only
//! its own children move, so members that read the list before and after it left agree on
//! everyone else's parents; one that joins late is numbered after everyone and catches up from
//! whoever holds its stripes. Every member derives the same plan from the same list, so no
//! coordinator is needed, and with etcd the list is etcd's.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::stripes::{Parent, StripePlan};

/// A member's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The publisher: holds every chunk.
    Source,
    /// A receiver that relays what it verified.
    Receiver,
}

/// One member of a broadcast, as discovery lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Its id (the engine's peer id).
    pub id: String,
    /// Its engine's epoch.
    pub epoch: u64,
    /// The epoch of the source whose chunks it holds (a source's own epoch): members of
    /// different source epochs never exchange chunks.
    pub source_epoch: u64,
    /// The Ferry address its segments are served on.
    pub data_addr: String,
    /// The address of its control service (progress, and the manifest at the source).
    pub ctl_addr: String,
    /// Source or receiver.
    pub role: Role,
    /// Chunks it has verified.
    pub progress: u64,
    /// Whether it holds every chunk.
    pub done: bool,
    /// Join order, assigned by discovery (the tracker's counter, or etcd's create revision).
    #[serde(default)]
    pub order: u64,
    /// The version it holds or pulls (a source: the version it started with; it serves every
    /// version it still keeps, which its `manifest` answers say). Receivers fetch only from
    /// receivers of their own version, and from the source.
    #[serde(default)]
    pub version: u64,
    /// Its download rate so far, bytes per second (`0`: not measured yet). What the striped
    /// plan finds stragglers by ([`stripe_holders`]).
    #[serde(default)]
    pub rate: u64,
    /// Its stable number among the members of its source epoch and version, assigned by
    /// discovery at join (the tracker's counter per version, or a number claimed in etcd by a
    /// transaction), dense from 0 and kept until it leaves: what the plan deals stripe groups
    /// by ([`StripePlan::numbered`]), so that a departure moves no one else. `None`: not
    /// numbered (an older member, the source), and the plan falls back to join order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub number: Option<u64>,
    /// The server identity its engine proves in keyed handshakes (64 hex digits, its public
    /// key): a keyed member connecting to its data address names it, so another key holder at
    /// that address cannot stand in for it. `None`: an older member (its incarnation is checked
    /// as before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
}

/// Whom `me` fetches each of `d` stripes from (`None`: no holder listed): the receivers of
/// `version` and source epoch `source_epoch` that serve (a data address), by their
/// [`Member::number`]s with `me` among them (after every listed number if not listed yet;
/// join order where not every one is numbered), planned by [`StripePlan::numbered`] on
/// their listed [`Member::rate`]s with stragglers below `straggler` times the median, and
/// those in `avoid` at the edge (leaves, serving no one: their children move, nobody else);
/// a stripe whose parent is the source, the source of that epoch.
pub fn stripe_holders<'a>(
    members: &'a [Member],
    me: &str,
    source_epoch: u64,
    version: u64,
    avoid: &HashSet<String>,
    d: usize,
    straggler: f64,
) -> Vec<Option<&'a Member>> {
    let d = d.max(1);
    let source = members
        .iter()
        .find(|m| m.role == Role::Source && m.source_epoch == source_epoch);
    let mut relays: Vec<&Member> = members
        .iter()
        .filter(|m| {
            m.id == me
                || (m.role == Role::Receiver
                    && m.source_epoch == source_epoch
                    && m.version == version
                    && !m.data_addr.is_empty())
        })
        .collect();
    relays.sort_by_key(|m| m.order);
    let mut rates: Vec<f64> = relays.iter().map(|m| m.rate as f64).collect();
    let mut edge: Vec<bool> = relays.iter().map(|m| avoid.contains(&m.id)).collect();
    let me_at = match relays.iter().position(|m| m.id == me) {
        Some(i) => i,
        None => {
            rates.push(0.0);
            edge.push(false);
            relays.len()
        }
    };
    let mut numbers: Vec<u64> = relays.iter().filter_map(|m| m.number).collect();
    if me_at == relays.len() {
        // Not listed yet: planned after every listed number.
        numbers.push(numbers.iter().max().map_or(0, |&k| k + 1));
    }
    let plan = StripePlan::numbered(&numbers, &rates, d, straggler, &edge);
    (0..d)
        .map(|s| match plan.parent(s, me_at) {
            Parent::Source => source,
            // Everyone straggles or was given up: the source rather than one given up.
            Parent::Member(p) if edge[p] => source,
            Parent::Member(p) => relays.get(p).copied(),
        })
        .collect()
}

/// Verified chunks of one receiver, and the next ones to fetch.
#[derive(Clone, Debug)]
pub struct Have {
    have: Vec<bool>,
    in_flight: Vec<bool>,
    count: u64,
    prefix: u64,
    /// No chunk below it is missing.
    low: usize,
    /// Per stripe `s` (chunks `c` with `c % d == s`, `d` its length): how many of its chunks
    /// from the first are all verified.
    stripe_prefix: Vec<u64>,
}

impl Have {
    /// Nothing held of `chunks` chunks (one stripe).
    pub fn new(chunks: usize) -> Self {
        Self::striped(chunks, 1)
    }

    /// Nothing held of `chunks` chunks dealt into `d` stripes (at least 1).
    pub fn striped(chunks: usize, d: usize) -> Self {
        Self {
            have: vec![false; chunks],
            in_flight: vec![false; chunks],
            count: 0,
            prefix: 0,
            low: 0,
            stripe_prefix: vec![0; d.max(1)],
        }
    }

    /// Per stripe, the length of its verified prefix: chunks `s, s + d, ..` below
    /// `s + d * prefix[s]` are all verified. What a member advertises besides
    /// [`prefix`](Self::prefix): never a chunk it has not verified.
    pub fn stripe_prefixes(&self) -> &[u64] {
        &self.stripe_prefix
    }

    /// Whether every chunk of stripe `s` is verified.
    pub fn stripe_done(&self, s: usize) -> bool {
        let d = self.stripe_prefix.len();
        (s..self.have.len()).step_by(d).all(|c| self.have[c])
    }

    /// The lowest chunk of stripe `s` neither verified nor in flight, if `can` says it may be
    /// fetched (a holder holds it; holders advertise prefixes, so the first chunk it does not
    /// hold ends the search), now marked in flight.
    pub fn next_in_stripe(&mut self, s: usize, can: impl Fn(usize) -> bool) -> Option<usize> {
        let d = self.stripe_prefix.len();
        while self.low < self.have.len() && self.have[self.low] {
            self.low += 1;
        }
        let start = self.low + (s + d - self.low % d) % d;
        let i = (start..self.have.len())
            .step_by(d)
            .find(|&i| !self.have[i] && !self.in_flight[i])?;
        if !can(i) {
            return None;
        }
        self.in_flight[i] = true;
        Some(i)
    }

    /// Whether stripe `s` has a chunk neither verified nor in flight that `can` says may be
    /// fetched (as [`next_in_stripe`](Self::next_in_stripe), without marking it).
    pub fn wants_from(&self, s: usize, can: impl Fn(usize) -> bool) -> bool {
        let d = self.stripe_prefix.len();
        (s..self.have.len())
            .step_by(d)
            .find(|&i| !self.have[i] && !self.in_flight[i])
            .is_some_and(can)
    }

    /// Chunks in the manifest.
    pub fn len(&self) -> usize {
        self.have.len()
    }

    /// Whether the manifest has no chunk.
    pub fn is_empty(&self) -> bool {
        self.have.is_empty()
    }

    /// Verified chunks.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Length of the verified prefix: chunks `0..prefix` are all verified. What a member
    /// advertises, and so all that others fetch from it.
    pub fn prefix(&self) -> u64 {
        self.prefix
    }

    /// Whether every chunk is verified.
    pub fn is_done(&self) -> bool {
        self.count as usize == self.have.len()
    }

    /// Whether chunk `i` is verified.
    pub fn has(&self, i: usize) -> bool {
        self.have.get(i).copied().unwrap_or(false)
    }

    /// The lowest chunk below `limit` neither verified nor in flight, now marked in flight.
    pub fn next_to_fetch(&mut self, limit: u64) -> Option<usize> {
        let limit = (limit as usize).min(self.have.len());
        while self.low < self.have.len() && self.have[self.low] {
            self.low += 1;
        }
        let i = (self.low.min(limit)..limit).find(|&i| !self.have[i] && !self.in_flight[i])?;
        self.in_flight[i] = true;
        Some(i)
    }

    /// Chunks in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.iter().filter(|&&f| f).count()
    }

    /// Chunk `i` was fetched and its checksum matched. Returns whether it was new (a chunk
    /// already verified is never counted twice).
    pub fn verified(&mut self, i: usize) -> bool {
        let Some(h) = self.have.get_mut(i) else {
            return false;
        };
        self.in_flight[i] = false;
        if *h {
            return false;
        }
        *h = true;
        self.count += 1;
        while (self.prefix as usize) < self.have.len() && self.have[self.prefix as usize] {
            self.prefix += 1;
        }
        let d = self.stripe_prefix.len();
        let s = i % d;
        loop {
            let next = s + d * self.stripe_prefix[s] as usize;
            if next < self.have.len() && self.have[next] {
                self.stripe_prefix[s] += 1;
            } else {
                break;
            }
        }
        true
    }

    /// Chunk `i`'s fetch failed or did not verify: it may be fetched again.
    pub fn released(&mut self, i: usize) {
        if let Some(f) = self.in_flight.get_mut(i) {
            *f = false;
        }
    }

    /// Chunk `i`, verified before, no longer holds its bytes (found corrupt at rest): fetch it
    /// again. The advertised prefix does not shrink; a member that fetches it meanwhile finds
    /// the mismatch and fetches it elsewhere.
    pub fn lost(&mut self, i: usize) {
        if let Some(h) = self.have.get_mut(i)
            && *h
        {
            *h = false;
            self.count -= 1;
            self.low = self.low.min(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(id: &str, order: u64, role: Role, epoch: u64) -> Member {
        Member {
            id: id.into(),
            epoch: 1,
            source_epoch: epoch,
            data_addr: "127.0.0.1:1".into(),
            ctl_addr: String::new(),
            role,
            progress: 0,
            done: false,
            order,
            version: 1,
            rate: 0,
            number: None,
            identity: None,
        }
    }

    #[test]
    fn one_stripe_is_a_chain_in_join_order_with_the_source_first() {
        let ms = vec![
            m("s", 0, Role::Source, 7),
            m("a", 1, Role::Receiver, 7),
            m("b", 2, Role::Receiver, 7),
            m("c", 3, Role::Receiver, 7),
            m("x", 4, Role::Receiver, 8), // another source epoch
        ];
        let none = HashSet::new();
        let one = |ms: &[Member], me: &str, epoch: u64, version: u64, avoid: &HashSet<String>| {
            stripe_holders(ms, me, epoch, version, avoid, 1, 0.5)[0].map(|m| m.id.clone())
        };
        assert_eq!(one(&ms, "a", 7, 1, &none).as_deref(), Some("s"));
        assert_eq!(one(&ms, "c", 7, 1, &none).as_deref(), Some("b"));
        let avoid: HashSet<String> = ["b".to_string()].into();
        assert_eq!(one(&ms, "c", 7, 1, &avoid).as_deref(), Some("a"));
        // Not listed yet: behind everyone.
        assert_eq!(one(&ms, "late", 7, 1, &none).as_deref(), Some("c"));
        // A source of another epoch is no holder, nor its receivers.
        assert_eq!(one(&ms, "y", 9, 1, &none), None);
        // A receiver pulling version 2 takes no receiver still holding version 1: the source
        // (which keeps both) only.
        let mut ms = ms;
        ms[3].version = 2;
        assert_eq!(one(&ms, "late2", 7, 2, &none).as_deref(), Some("c"));
        assert_eq!(one(&ms, "late1", 7, 1, &none).as_deref(), Some("b"));
        // A receiver whose engine does not listen serves nothing.
        ms[2].data_addr.clear();
        assert_eq!(one(&ms, "late1", 7, 1, &none).as_deref(), Some("a"));
    }

    #[test]
    fn stripes_of_the_plan_name_a_parent_each_and_a_straggler_moves_to_the_edge() {
        let mut ms = vec![m("s", 0, Role::Source, 7)];
        for (k, id) in ["a", "b", "c", "d", "e"].iter().enumerate() {
            ms.push(m(id, k as u64 + 1, Role::Receiver, 7));
        }
        let none = HashSet::new();
        let ids = |v: Vec<Option<&Member>>| {
            v.into_iter()
                .map(|m| m.map_or("-".to_string(), |m| m.id.clone()))
                .collect::<Vec<_>>()
        };
        // d = 1: the chain in join order.
        assert_eq!(ids(stripe_holders(&ms, "c", 7, 1, &none, 1, 0.5)), ["b"]);
        assert_eq!(ids(stripe_holders(&ms, "a", 7, 1, &none, 1, 0.5)), ["s"]);
        // d = 2: groups {a, c, e} and {b, d}; a is the root of stripe 0 and a leaf of stripe
        // 1, hung on d (b, its root, already has d as a child).
        assert_eq!(
            ids(stripe_holders(&ms, "a", 7, 1, &none, 2, 0.5)),
            ["s", "d"]
        );
        assert_eq!(ids(stripe_holders(&ms, "b", 7, 1, &none, 2, 0.5))[1], "s");
        assert_eq!(ids(stripe_holders(&ms, "c", 7, 1, &none, 2, 0.5))[0], "a");
        // Not listed yet: planned last.
        assert_eq!(ids(stripe_holders(&ms, "late", 7, 1, &none, 1, 0.5)), ["e"]);
        // b straggles: it serves no one, and c, its child in the chain, takes a instead.
        for (k, r) in ms.iter_mut().enumerate().skip(1) {
            r.rate = if k == 2 { 10 } else { 100 };
        }
        assert_eq!(ids(stripe_holders(&ms, "c", 7, 1, &none, 1, 0.5)), ["a"]);
        assert_eq!(ids(stripe_holders(&ms, "b", 7, 1, &none, 1, 0.5)), ["e"]);
        // An avoided member is planned around; another epoch's source is no holder.
        let avoid: HashSet<String> = ["a".to_string()].into();
        assert_eq!(ids(stripe_holders(&ms, "c", 7, 1, &avoid, 1, 0.5)), ["s"]);
        assert_eq!(ids(stripe_holders(&ms, "c", 8, 1, &none, 1, 0.5)), ["-"]);
    }

    #[test]
    fn have_advertises_per_stripe_prefixes_of_verified_chunks_only() {
        let mut h = Have::striped(7, 3);
        // Stripe 1 is chunks 1, 4; stripe 0 is 0, 3, 6.
        assert_eq!(h.next_in_stripe(1, |_| true), Some(1));
        assert_eq!(
            h.next_in_stripe(1, |c| c < 4),
            None,
            "the holder lacks chunk 4"
        );
        assert!(h.wants_from(1, |_| true));
        assert_eq!(h.next_in_stripe(1, |_| true), Some(4));
        assert!(!h.wants_from(1, |_| true), "both in flight");
        assert!(h.verified(4));
        assert_eq!(
            h.stripe_prefixes(),
            [0, 0, 0],
            "chunk 1 is not verified yet"
        );
        assert!(h.verified(1));
        assert_eq!(h.stripe_prefixes(), [0, 2, 0]);
        assert!(h.stripe_done(1));
        assert!(!h.stripe_done(0));
        for c in [6, 0, 3] {
            assert!(h.verified(c));
        }
        assert_eq!(h.stripe_prefixes(), [3, 2, 0]);
        assert_eq!(h.prefix(), 2);
        assert_eq!(h.next_in_stripe(2, |_| true), Some(2));
        assert_eq!(h.next_in_stripe(2, |_| true), Some(5));
    }

    #[test]
    fn have_tracks_prefix_and_never_counts_twice() {
        let mut h = Have::new(5);
        assert_eq!(h.next_to_fetch(3), Some(0));
        assert_eq!(h.next_to_fetch(3), Some(1));
        assert_eq!(h.next_to_fetch(3), Some(2));
        assert_eq!(h.next_to_fetch(3), None);
        assert!(h.verified(1));
        assert_eq!(h.prefix(), 0);
        h.released(0);
        assert_eq!(h.next_to_fetch(3), Some(0));
        assert!(h.verified(0));
        assert_eq!(h.prefix(), 2);
        assert!(!h.verified(0));
        assert_eq!(h.count(), 2);
        assert!(h.verified(2));
        assert_eq!(h.next_to_fetch(99), Some(3));
        assert!(h.verified(3));
        assert!(h.verified(4));
        assert!(h.is_done());
        h.lost(2);
        assert!(!h.is_done());
        assert_eq!(h.prefix(), 5);
        assert_eq!(
            h.next_to_fetch(5),
            Some(2),
            "a chunk lost at rest is fetched again"
        );
        assert!(!h.verified(99));
    }
}

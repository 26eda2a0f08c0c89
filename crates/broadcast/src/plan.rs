//! The plan every member derives from the membership list, and a receiver's bookkeeping of
//! what it holds: no I/O, unit-tested.
//!
//! **The plan: a chain in join order.** Members are ordered by when they joined (the source
//! first). Each receiver fetches from the nearest member before it that it has not given up on
//! (its *parent*), and only chunks its parent has verified (the parent's verified prefix), with
//! several chunks in flight. So the source sends each byte once, to the first receiver, every
//! link carries the payload once in each direction, and each member serves at most one child
//! in the steady state (degree 1). A receiver that gives up on its parent (dead, stalled, or
//! of another epoch) moves to the next member before it, the source last; one that joins late
//! takes the last member as its parent and catches up from it. Every member derives the same
//! plan from the same list, so no coordinator is needed, and with etcd the list is etcd's.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

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
}

/// The members `me` may fetch `version` from, in the order to try them: the receivers of that
/// version that joined before it (nearest first), then the source; never `me`, nor anyone in
/// `avoid`, nor a member of another source epoch, nor a receiver of another version, nor one
/// that serves nothing (no data address: its engine does not listen). A member
/// `me` does not find in `members` (not yet listed) is taken to be the last to join.
pub fn holders<'a>(
    members: &'a [Member],
    me: &str,
    source_epoch: u64,
    version: u64,
    avoid: &HashSet<String>,
) -> Vec<&'a Member> {
    let my_order = members
        .iter()
        .find(|m| m.id == me)
        .map_or(u64::MAX, |m| m.order);
    let mut before: Vec<&Member> = members
        .iter()
        .filter(|m| {
            m.id != me
                && m.role == Role::Receiver
                && m.order < my_order
                && m.source_epoch == source_epoch
                && m.version == version
                && !m.data_addr.is_empty()
                && !avoid.contains(&m.id)
        })
        .collect();
    before.sort_by_key(|m| std::cmp::Reverse(m.order));
    before.extend(
        members
            .iter()
            .filter(|m| m.role == Role::Source && m.source_epoch == source_epoch),
    );
    before
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
}

impl Have {
    /// Nothing held of `chunks` chunks.
    pub fn new(chunks: usize) -> Self {
        Self {
            have: vec![false; chunks],
            in_flight: vec![false; chunks],
            count: 0,
            prefix: 0,
            low: 0,
        }
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
        }
    }

    #[test]
    fn a_chain_in_join_order_with_the_source_last() {
        let ms = vec![
            m("s", 0, Role::Source, 7),
            m("a", 1, Role::Receiver, 7),
            m("b", 2, Role::Receiver, 7),
            m("c", 3, Role::Receiver, 7),
            m("x", 4, Role::Receiver, 8), // another source epoch
        ];
        let none = HashSet::new();
        let ids = |v: Vec<&Member>| v.into_iter().map(|m| m.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(holders(&ms, "a", 7, 1, &none)), ["s"]);
        assert_eq!(ids(holders(&ms, "c", 7, 1, &none)), ["b", "a", "s"]);
        let avoid: HashSet<String> = ["b".to_string()].into();
        assert_eq!(ids(holders(&ms, "c", 7, 1, &avoid)), ["a", "s"]);
        // Not listed yet: behind everyone.
        assert_eq!(ids(holders(&ms, "late", 7, 1, &none)), ["c", "b", "a", "s"]);
        // A source of another epoch is no holder.
        assert_eq!(ids(holders(&ms, "y", 9, 1, &none)), Vec::<String>::new());
        // A receiver pulling version 2 takes no receiver still holding version 1: the source
        // (which keeps both) only.
        let mut ms = ms;
        ms[3].version = 2;
        assert_eq!(ids(holders(&ms, "late2", 7, 2, &none)), ["c", "s"]);
        assert_eq!(ids(holders(&ms, "late1", 7, 1, &none)), ["b", "a", "s"]);
        // A receiver whose engine does not listen serves nothing.
        ms[2].data_addr.clear();
        assert_eq!(ids(holders(&ms, "late1", 7, 1, &none)), ["a", "s"]);
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

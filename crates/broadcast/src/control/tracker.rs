//! The embedded discovery's membership list, kept by a source.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use ferry::core_types::auth::nonce;

use crate::plan::{Member, Role};

/// Most members the embedded tracker lists (the source included); joins past it are refused.
pub(crate) const MAX_MEMBERS: usize = 4096;

/// Most departures kept for [`Tracker::departures`] between two reads (the oldest go first).
const MAX_DEPARTED: usize = 4096;

/// How a member came off the list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Departure {
    /// It said so: a `leave` carrying its entry's token (a pull that finished, failed or was
    /// interrupted).
    Left,
    /// No heartbeat came within its lease (a process killed, stopped or cut off); a heartbeat
    /// carrying its token lists it again.
    Lapsed,
}

/// The embedded discovery's membership list, kept by the source: a member is listed while its
/// heartbeats arrive within the lease.
#[derive(Debug)]
pub(crate) struct Tracker {
    lease: Duration,
    inner: Mutex<TrackerInner>,
}

#[derive(Debug, Default)]
struct TrackerInner {
    next: u64,
    /// Per version: the next [`Member::number`] to deal (a number is never dealt twice).
    numbers: HashMap<u64, u64>,
    /// Each entry, when its lease ends (never, for the source) and its token.
    members: HashMap<String, (Member, Option<Instant>, [u8; 32])>,
    /// The entries that came off the list since [`Tracker::departures`] last took them: each
    /// as it was last listed, and how it went.
    departed: Vec<(Member, Departure)>,
}

impl TrackerInner {
    /// Drops the entries whose lease ended by `now`, each recorded as [`Departure::Lapsed`].
    fn expire(&mut self, now: Instant) {
        let lapsed: Vec<String> = self
            .members
            .iter()
            .filter(|(_, (_, expires, _))| expires.is_some_and(|e| e <= now))
            .map(|(id, _)| id.clone())
            .collect();
        for id in lapsed {
            if let Some((m, _, _)) = self.members.remove(&id) {
                self.depart(m, Departure::Lapsed);
            }
        }
    }

    fn depart(&mut self, m: Member, how: Departure) {
        if self.departed.len() >= MAX_DEPARTED {
            self.departed.remove(0);
        }
        self.departed.push((m, how));
    }
}

/// The next number of `version` in `numbers` (from 0), now dealt.
fn deal(numbers: &mut HashMap<u64, u64>, version: u64) -> u64 {
    let next = numbers.entry(version).or_insert(0);
    *next += 1;
    *next - 1
}

/// Whether `a` and `b` are equal, in time that does not depend on where they differ.
fn same_token(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Tracker {
    /// A list holding `source` for good.
    pub(crate) fn new(source: Member, lease: Duration) -> Self {
        let mut inner = TrackerInner {
            next: 1,
            ..Default::default()
        };
        let mut source = source;
        source.order = 0;
        // The source's token is never handed out: no request can touch its entry.
        inner
            .members
            .insert(source.id.clone(), (source, None, nonce()));
        Self {
            lease,
            inner: Mutex::new(inner),
        }
    }

    /// A join at `now`: lists `m` and returns its entry's token. Refused: a member claiming
    /// the source's role, a join under an id already listed without that entry's token, and a
    /// new entry past [`MAX_MEMBERS`].
    pub(crate) fn join(
        &self,
        m: Member,
        token: Option<[u8; 32]>,
        now: Instant,
    ) -> Result<[u8; 32], String> {
        self.renew(m, token, now, true)
    }

    /// A heartbeat at `now`: renews `m`'s entry (its order kept from its first join), which
    /// `token` must be the token of; an entry whose lease ran out is listed again under it.
    pub(crate) fn heartbeat(
        &self,
        m: Member,
        token: Option<[u8; 32]>,
        now: Instant,
    ) -> Result<(), String> {
        let Some(t) = token else {
            return Err(format!(
                "heartbeat for member {} refused: it carries no token of the entry",
                m.id
            ));
        };
        self.renew(m, Some(t), now, false).map(|_| ())
    }

    fn renew(
        &self,
        mut m: Member,
        token: Option<[u8; 32]>,
        now: Instant,
        fresh_token: bool,
    ) -> Result<[u8; 32], String> {
        if m.role == Role::Source {
            return Err(format!(
                "member {} refused: only the source itself is listed as the source",
                m.id
            ));
        }
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        g.expire(now);
        let g = &mut *g;
        let (order, number, token) = match g.members.get(&m.id) {
            Some((old, _, t)) => {
                if !token.is_some_and(|given| same_token(&given, t)) {
                    return Err(format!(
                        "member {} is listed already: only it may renew, move or remove its entry",
                        m.id
                    ));
                }
                // A member keeps its number while it pulls one version (whatever it sends).
                let number = match old.number {
                    Some(k) if old.version == m.version => k,
                    _ => deal(&mut g.numbers, m.version),
                };
                (old.order, number, *t)
            }
            None => {
                if g.members.len() >= MAX_MEMBERS {
                    return Err(format!(
                        "member {} refused: {MAX_MEMBERS} members are listed, the most there may be",
                        m.id
                    ));
                }
                let t = match (token, fresh_token) {
                    (Some(t), false) => t,
                    _ => nonce(),
                };
                g.next += 1;
                let number = deal(&mut g.numbers, m.version);
                (g.next - 1, number, t)
            }
        };
        m.order = order;
        m.number = Some(number);
        g.members
            .insert(m.id.clone(), (m, Some(now + self.lease), token));
        Ok(token)
    }

    /// Drops the entry `id`, if `token` is its token (an entry not listed is gone already).
    pub(crate) fn leave(&self, id: &str, token: Option<[u8; 32]>) -> Result<(), String> {
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        match g.members.get(id) {
            None => Ok(()),
            Some((_, _, t)) if token.is_some_and(|given| same_token(&given, t)) => {
                if let Some((m, _, _)) = g.members.remove(id) {
                    g.depart(m, Departure::Left);
                }
                Ok(())
            }
            Some(_) => Err(format!(
                "leave for member {id} refused: only it may remove its entry"
            )),
        }
    }

    /// The members whose lease has not expired at `now`, in join order.
    pub(crate) fn members(&self, now: Instant) -> Vec<Member> {
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        g.expire(now);
        let mut v: Vec<Member> = g.members.values().map(|(m, _, _)| m.clone()).collect();
        v.sort_by_key(|m| m.order);
        v
    }

    /// The members that came off the list since the last call, in the order they went, each as
    /// it was last listed (so one that left done is known to have finished), and how: a leave,
    /// or a lease that ran out by `now`.
    pub(crate) fn departures(&self, now: Instant) -> Vec<(Member, Departure)> {
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        g.expire(now);
        std::mem::take(&mut g.departed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: &str, role: Role) -> Member {
        Member {
            id: id.into(),
            epoch: 1,
            source_epoch: 5,
            data_addr: String::new(),
            ctl_addr: String::new(),
            role,
            progress: 0,
            done: false,
            order: 99,
            version: 1,
            rate: 0,
            number: None,
            identity: None,
        }
    }

    #[test]
    fn tracker_orders_by_first_join_and_expires_silent_members() {
        let t0 = Instant::now();
        let t = Tracker::new(member("s", Role::Source), Duration::from_secs(2));
        let ta = t.join(member("a", Role::Receiver), None, t0).unwrap();
        t.join(member("b", Role::Receiver), None, t0).unwrap();
        t.heartbeat(
            member("a", Role::Receiver),
            Some(ta),
            t0 + Duration::from_secs(1),
        )
        .unwrap();
        let ids = |v: Vec<Member>| v.into_iter().map(|m| (m.id, m.order)).collect::<Vec<_>>();
        assert_eq!(
            ids(t.members(t0)),
            [("s".into(), 0), ("a".into(), 1), ("b".into(), 2)]
        );
        // b's lease ran out; a heartbeated; the source never expires.
        assert_eq!(
            ids(t.members(t0 + Duration::from_millis(2500))),
            [("s".into(), 0), ("a".into(), 1)]
        );
        t.leave("a", Some(ta)).unwrap();
        assert!(t.leave("s", Some(ta)).is_err());
        assert_eq!(ids(t.members(t0)), [("s".into(), 0)]);
    }

    #[test]
    fn tracker_numbers_each_version_from_zero_and_a_member_keeps_its_number() {
        let t0 = Instant::now();
        let t = Tracker::new(member("s", Role::Source), Duration::from_secs(60));
        let mut forged = member("a", Role::Receiver);
        forged.number = Some(7); // what a member claims is not what it is dealt
        let ta = t.join(forged, None, t0).unwrap();
        let tb = t.join(member("b", Role::Receiver), None, t0).unwrap();
        let mut v2 = member("c", Role::Receiver);
        v2.version = 2;
        t.join(v2, None, t0).unwrap();
        t.join(member("d", Role::Receiver), None, t0).unwrap();
        t.leave("b", Some(tb)).unwrap();
        let mut a = member("a", Role::Receiver);
        a.number = Some(0);
        a.progress = 5;
        t.heartbeat(a, Some(ta), t0).unwrap();
        t.join(member("e", Role::Receiver), None, t0).unwrap();
        let numbers = |v: Vec<Member>| {
            v.into_iter()
                .map(|m| (m.id, m.version, m.number))
                .collect::<Vec<_>>()
        };
        // b's number is not dealt again: a and d keep theirs, e takes the next.
        assert_eq!(
            numbers(t.members(t0)),
            [
                ("s".into(), 1, None),
                ("a".into(), 1, Some(0)),
                ("c".into(), 2, Some(0)),
                ("d".into(), 1, Some(2)),
                ("e".into(), 1, Some(3)),
            ]
        );
        // A member that moves to another version is numbered in it.
        let mut a2 = member("a", Role::Receiver);
        a2.version = 2;
        t.heartbeat(a2, Some(ta), t0).unwrap();
        let a = t.members(t0).into_iter().find(|m| m.id == "a");
        assert_eq!(a.and_then(|m| m.number), Some(1));
    }

    #[test]
    fn only_a_member_renews_moves_or_removes_its_entry() {
        let t0 = Instant::now();
        let t = Tracker::new(member("s", Role::Source), Duration::from_secs(2));
        let ta = t.join(member("a", Role::Receiver), None, t0).unwrap();
        let mut moved = member("a", Role::Receiver);
        moved.data_addr = "10.0.0.66:1".into();
        // Without the token, or with another entry's: refused, the entry unchanged.
        let tb = t.join(member("b", Role::Receiver), None, t0).unwrap();
        for token in [None, Some(tb), Some([0; 32])] {
            assert!(t.heartbeat(moved.clone(), token, t0).is_err());
            assert!(t.join(moved.clone(), token, t0).is_err());
            assert!(t.leave("a", token).is_err());
        }
        let listed = t.members(t0);
        assert_eq!(listed[1].id, "a");
        assert_eq!(listed[1].data_addr, "");
        // Nobody joins as the source, or as its id.
        assert!(t.join(member("x", Role::Source), None, t0).is_err());
        assert!(t.join(member("s", Role::Receiver), None, t0).is_err());
        // With its token, the member itself does.
        t.heartbeat(moved.clone(), Some(ta), t0).unwrap();
        assert_eq!(t.members(t0)[1].data_addr, "10.0.0.66:1");
        // The list is bounded.
        for i in 0..MAX_MEMBERS {
            let _ = t.join(member(&format!("m{i}"), Role::Receiver), None, t0);
        }
        assert_eq!(t.members(t0).len(), MAX_MEMBERS);
        assert!(t.join(member("late", Role::Receiver), None, t0).is_err());
    }

    #[test]
    fn departures_say_who_left_and_whose_lease_ran_out_each_once() {
        let t0 = Instant::now();
        let t = Tracker::new(member("s", Role::Source), Duration::from_secs(2));
        let ta = t.join(member("a", Role::Receiver), None, t0).unwrap();
        let mut b = member("b", Role::Receiver);
        let tb = t.join(b.clone(), None, t0).unwrap();
        b.progress = 7;
        t.heartbeat(b.clone(), Some(tb), t0).unwrap();
        t.leave("a", Some(ta)).unwrap();
        let later = t0 + Duration::from_millis(2500);
        let gone: Vec<(String, u64, Departure)> = t
            .departures(later)
            .into_iter()
            .map(|(m, how)| (m.id, m.progress, how))
            .collect();
        assert_eq!(
            gone,
            [
                ("a".into(), 0, Departure::Left),
                ("b".into(), 7, Departure::Lapsed)
            ]
        );
        assert!(t.departures(later).is_empty());
        // b heartbeats again: listed again, under its token.
        t.heartbeat(b, Some(tb), later).unwrap();
        assert_eq!(t.members(later).len(), 2);
    }
}

//! The proven control connections (keyless: those whose first request was answered), per key:
//! which to keep and which to close to make room. No I/O: time is passed in, and each
//! connection's handle (what closes it) is anything.
//!
//! Rules:
//! - A connection is charged to the key name it proved, or on a keyless member to its source
//!   address. A key holds at most [`ProvenLimits::per_key`] connections, and all keys together
//!   at most [`ProvenLimits::total`].
//! - Past a cap the connection that gives way is the least recently active of those waiting
//!   on their peer, to read an answer or send the next request (never one whose answer is
//!   being made, a long poll say): of the
//!   newcomer's own key past its cap, of the key holding the most past the total. Where every
//!   such connection is answering, the newcomer is refused instead.
//! - A connection waiting longer than [`ProvenLimits::idle`] for its peer to read an answer, or
//!   to send its next request, is closed (the service's loop keeps that deadline).

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// The limits on proven control connections.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ProvenLimits {
    /// How long a proven connection may wait for its next request before it is closed.
    pub(crate) idle: Duration,
    /// Proven connections kept per key (keyless: per source address).
    pub(crate) per_key: usize,
    /// Proven connections kept in all.
    pub(crate) total: usize,
}

impl Default for ProvenLimits {
    fn default() -> Self {
        Self {
            idle: Duration::from_secs(60),
            per_key: 256,
            total: 1024,
        }
    }
}

/// What a proven connection is charged to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ConnKey {
    /// The key name it proved.
    Name(String),
    /// Keyless: the address it came from.
    Source(IpAddr),
}

/// Why a newly proven connection was not kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Its key holds its cap, every one of them being answered.
    KeyFull { held: usize },
    /// All keys hold the total, every connection that could give way being answered.
    Full { held: usize },
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::KeyFull { held } => write!(
                f,
                "too many control connections under this key (or from this address): {held}, \
                 each being answered"
            ),
            Self::Full { held } => write!(
                f,
                "too many control connections: {held}, none waiting that could make room"
            ),
        }
    }
}

struct Conn<H> {
    key: ConnKey,
    /// When it last started or finished a request (or was proven).
    active: Instant,
    /// Its answer is being made.
    busy: bool,
    handle: H,
}

/// The proven connections, by id.
pub(crate) struct ProvenTable<H> {
    conns: HashMap<u64, Conn<H>>,
    next: u64,
    limits: ProvenLimits,
}

impl<H> ProvenTable<H> {
    pub(crate) fn new(limits: ProvenLimits) -> Self {
        Self {
            conns: HashMap::new(),
            next: 0,
            limits,
        }
    }

    pub(crate) fn limits(&self) -> ProvenLimits {
        self.limits
    }

    /// Connections held now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.conns.len()
    }

    fn held(&self, key: &ConnKey) -> usize {
        self.conns.values().filter(|c| &c.key == key).count()
    }

    /// The least recently active waiting connection among those `of` picks.
    fn idlest(&self, of: impl Fn(&ConnKey) -> bool) -> Option<u64> {
        self.conns
            .iter()
            .filter(|(_, c)| !c.busy && of(&c.key))
            .min_by_key(|(id, c)| (c.active, **id))
            .map(|(id, _)| *id)
    }

    /// Keeps a connection just proven under `key` (busy: its first answer is being made), first
    /// taking out what gives way. Returns its id and the handles of the connections taken out
    /// (to be closed), or why it is refused (nothing is taken out then).
    pub(crate) fn admit(
        &mut self,
        key: ConnKey,
        handle: H,
        now: Instant,
    ) -> Result<(u64, Vec<H>), Refused> {
        let limits = self.limits;
        let mut out = Vec::new();
        let mut victims = Vec::new();
        let held = self.held(&key);
        if held >= limits.per_key.max(1) {
            match self.idlest(|k| k == &key) {
                Some(v) => victims.push(v),
                None => return Err(Refused::KeyFull { held }),
            }
        }
        if self.conns.len() - victims.len() >= limits.total.max(1) {
            // The key holding the most (the newcomer's counted with it) gives way.
            let mut counts: HashMap<&ConnKey, usize> = HashMap::new();
            for c in self.conns.values() {
                *counts.entry(&c.key).or_default() += 1;
            }
            *counts.entry(&key).or_default() += 1;
            let most = counts
                .iter()
                .filter(|(k, _)| self.conns.values().any(|c| &c.key == **k && !c.busy))
                .map(|(_, n)| *n)
                .max();
            // (No victim yet: the table never holds more than the total, so one taken for the
            // key's cap already made room.)
            let victim = most.and_then(|most| self.idlest(|k| counts.get(k) == Some(&most)));
            match victim {
                Some(v) => victims.push(v),
                None => {
                    return Err(Refused::Full {
                        held: self.conns.len(),
                    });
                }
            }
        }
        for v in victims {
            if let Some(c) = self.conns.remove(&v) {
                out.push(c.handle);
            }
        }
        let id = self.next;
        self.next += 1;
        self.conns.insert(
            id,
            Conn {
                key,
                active: now,
                busy: true,
                handle,
            },
        );
        Ok((id, out))
    }

    /// Connection `id` read a request and answers it. `false`: it was taken out to make room
    /// (close it unanswered).
    pub(crate) fn busy(&mut self, id: u64, now: Instant) -> bool {
        match self.conns.get_mut(&id) {
            Some(c) => {
                c.busy = true;
                c.active = now;
                true
            }
            None => false,
        }
    }

    /// Connection `id` answered: it waits on its peer to read the answer and ask again.
    pub(crate) fn waiting(&mut self, id: u64, now: Instant) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.busy = false;
            c.active = now;
        }
    }

    /// Connection `id` ended.
    pub(crate) fn remove(&mut self, id: u64) {
        self.conns.remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: ProvenLimits = ProvenLimits {
        idle: Duration::from_secs(60),
        per_key: 3,
        total: 5,
    };

    fn src(last: u8) -> ConnKey {
        ConnKey::Source(IpAddr::from([127, 0, 0, last]))
    }

    /// Admits a connection that asked once and now waits; returns its id.
    fn waiting(t: &mut ProvenTable<u32>, key: ConnKey, handle: u32, now: Instant) -> u64 {
        let (id, out) = t.admit(key, handle, now).expect("admitted");
        assert!(out.is_empty());
        t.waiting(id, now);
        id
    }

    /// Past a key's cap its least recently active waiting connection gives way, never another
    /// key's, and never one being answered; with all of the key's being answered the newcomer
    /// is refused and nothing is taken out.
    #[test]
    fn past_a_keys_cap_its_idlest_waiting_connection_gives_way() {
        let mut t = ProvenTable::new(LIMITS);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let a = waiting(&mut t, src(1), 1, at(0));
        let b = waiting(&mut t, src(1), 2, at(1));
        let _c = waiting(&mut t, src(1), 3, at(2));
        let _other = waiting(&mut t, src(2), 9, at(0));
        // `a` asks again: now `b` is the idlest.
        assert!(t.busy(a, at(3)));
        t.waiting(a, at(4));
        let (d, out) = t.admit(src(1), 4, at(5)).unwrap();
        assert_eq!(
            out,
            [2],
            "the idlest of the key, not the other key's older one"
        );
        assert!(
            !t.busy(b, at(5)),
            "taken out: its next request is not answered"
        );
        t.waiting(d, at(5));
        // Every connection of the key being answered: the newcomer is refused.
        let ids: Vec<u64> = t
            .conns
            .iter()
            .filter(|(_, c)| c.key == src(1))
            .map(|(i, _)| *i)
            .collect();
        for &id in &ids {
            assert!(t.busy(id, at(6)));
        }
        assert_eq!(
            t.admit(src(1), 5, at(6)).unwrap_err(),
            Refused::KeyFull { held: 3 }
        );
        assert_eq!(t.len(), 4);
        // One answered and waiting again: it gives way.
        t.waiting(ids[0], at(7));
        let (_, out) = t.admit(src(1), 6, at(8)).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(t.len(), 4);
    }

    /// Past the total, the idlest waiting connection of the key holding the most gives way;
    /// a key under its cap whose newcomer finds the total reached takes from that key, and a
    /// connection that ends frees its place.
    #[test]
    fn past_the_total_the_key_holding_the_most_gives_way() {
        let mut t = ProvenTable::new(LIMITS);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let lone = waiting(&mut t, ConnKey::Name("alice".into()), 0, at(0));
        for i in 0..3 {
            waiting(&mut t, src(1), 10 + i, at(1 + u64::from(i)));
        }
        waiting(&mut t, src(2), 20, at(1));
        assert_eq!(t.len(), LIMITS.total);
        let (_, out) = t.admit(src(3), 30, at(9)).unwrap();
        assert_eq!(out, [10], "the oldest of the source holding the most");
        t.remove(lone);
        let (_, out) = t.admit(ConnKey::Name("bob".into()), 40, at(10)).unwrap();
        assert!(out.is_empty(), "a place freed by an end needs no victim");
        assert_eq!(t.len(), LIMITS.total);
        // Every connection being answered: nothing can give way.
        for id in t.conns.keys().copied().collect::<Vec<_>>() {
            t.busy(id, at(11));
        }
        assert_eq!(
            t.admit(src(4), 50, at(12)).unwrap_err(),
            Refused::Full { held: 5 }
        );
    }
}

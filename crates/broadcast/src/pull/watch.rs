//! What a pull knows of each holder it attached ([`Seen`]: what it advertised, the fetches
//! asked of it, when it last sent something) and, from that alone, when it gives one up
//! ([`stalled`]): silent for `stall_after` while the pull waits on it, or gone from the list.
//! No I/O; time is passed in.

use std::time::{Duration, Instant};

use super::GiveUp;
use crate::plan::{Have, Member, Role};

/// A holder as this receiver has seen it: what it advertised, the fetches asked of it, when it
/// last sent something. [`stalled`] decides from it alone.
#[derive(Clone, Debug)]
pub(crate) struct Seen {
    pub(crate) member: Member,
    pub(super) prefix: u64,
    /// Chunks it verified.
    pub(super) count: u64,
    /// Per stripe of its own, its verified prefix (empty: it advertises only `prefix`).
    pub(super) stripes: Vec<u64>,
    pub(super) done: bool,
    pub(super) advanced: Instant,
    /// Which attachment this is (a holder given up and attached again is a new one): fetches
    /// report it, so that one started from an earlier attachment is not counted against this.
    pub(super) generation: u64,
    /// Fetches from it not finished yet.
    pub(super) in_flight: usize,
    /// When it last sent something: a fetch from it finished (verified or not), or it was
    /// attached, or a fetch was started while none was in flight.
    pub(super) heard: Instant,
}

impl Seen {
    /// `m` as attached at `now`, of a manifest of `chunks` chunks: the source holds every chunk,
    /// a receiver none until it says.
    pub(super) fn new(m: Member, chunks: u64, now: Instant) -> Self {
        let source = m.role == Role::Source;
        Self {
            member: m,
            prefix: if source { chunks } else { 0 },
            count: 0,
            stripes: Vec::new(),
            done: source,
            advanced: now,
            generation: 0,
            in_flight: 0,
            heard: now,
        }
    }

    /// Whether it advertised chunk `c` (as verified).
    pub(crate) fn holds(&self, c: usize) -> bool {
        let c = c as u64;
        let d = self.stripes.len() as u64;
        self.done || c < self.prefix || (d > 0 && c / d < self.stripes[(c % d) as usize])
    }

    /// Takes its new advertisement at `now`; it advanced if it verified more or advertises more.
    pub(super) fn update(
        &mut self,
        prefix: u64,
        count: u64,
        stripes: Vec<u64>,
        done: bool,
        now: Instant,
    ) {
        let more = stripes.len() == self.stripes.len()
            && stripes.iter().zip(&self.stripes).any(|(a, b)| a > b);
        if prefix > self.prefix
            || count > self.count
            || more
            || (self.stripes.is_empty() && !stripes.is_empty())
        {
            self.advanced = now;
        }
        self.prefix = self.prefix.max(prefix);
        self.count = count;
        // A hostile holder may send any list: only its length is bounded by the reply's.
        self.stripes = stripes;
        self.done = done;
    }
}

/// Why the pull watches a holder, and from when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Watch {
    /// Chunks are requested from it (`in_flight`), and it last sent something at `since`;
    /// `unlisted`: it is also no longer listed (it left: given up at once).
    Silent {
        since: Instant,
        in_flight: usize,
        unlisted: bool,
    },
    /// It is a stripe's parent (or the source) no longer listed, nothing in flight from it:
    /// given up at once.
    Unlisted,
    /// A stripe's parent this receiver waits on for a chunk it has not advertised yet, quiet
    /// since `since`.
    Waiting { since: Instant },
}

/// What the pull watches holder `id` for (`None`: nothing; it is given up at no time while
/// things stay as they are). [`stalled`] and [`Pull::next_wake`] both read it.
pub(super) fn watch(
    id: &str,
    h: &Seen,
    assigned: &[Option<String>],
    have: &Have,
    members: &[Member],
) -> Option<Watch> {
    // An empty list is one never read: no one is taken for unlisted by it.
    let listed = members.is_empty() || members.iter().any(|m| m.id == id);
    let source = h.member.role == Role::Source;
    let stripes: Vec<usize> = (0..assigned.len())
        .filter(|&s| !source && assigned[s].as_deref() == Some(id))
        .collect();
    // The source, the stripes' parents and any holder with chunks in flight are held to the
    // list: one that left is given up at once, parent or not (a relay the plan made again
    // without it, whose fetches are still out, would otherwise be waited on for stall_after).
    let unlisted = !listed && (source || !stripes.is_empty() || h.in_flight > 0);
    if h.in_flight > 0 {
        return Some(Watch::Silent {
            since: h.heard,
            in_flight: h.in_flight,
            unlisted,
        });
    }
    if unlisted {
        return Some(Watch::Unlisted);
    }
    if source || stripes.is_empty() {
        return None;
    }
    let waiting = !h.done
        && stripes.iter().any(|&s| !have.stripe_done(s))
        && !stripes.iter().any(|&s| have.wants_from(s, |c| h.holds(c)));
    // Since it last advertised more, or last sent a chunk, whichever is later.
    waiting.then(|| Watch::Waiting {
        since: h.advanced.max(h.heard),
    })
}

/// The holders to give up at `now`: those the pull waits on that sent nothing for
/// `stall_after` (chunks requested from them, or, for a stripe's parent (`assigned`), no new
/// chunk advertised while this receiver needs one), and parents and holders with chunks in
/// flight no longer listed (the source too, when it drops off a list that was read).
pub(crate) fn stalled<'a>(
    holders: impl Iterator<Item = (&'a str, &'a Seen)>,
    assigned: &[Option<String>],
    have: &Have,
    members: &[Member],
    stall_after: Duration,
    now: Instant,
) -> Vec<(String, GiveUp)> {
    let mut out = Vec::new();
    for (id, h) in holders {
        let (since, in_flight, unlisted) = match watch(id, h, assigned, have, members) {
            None => continue,
            Some(Watch::Unlisted) => {
                out.push((id.to_owned(), GiveUp::Unlisted));
                continue;
            }
            Some(Watch::Silent {
                since,
                in_flight,
                unlisted,
            }) => (since, in_flight, unlisted),
            Some(Watch::Waiting { since }) => (since, 0, false),
        };
        let after = now.saturating_duration_since(since);
        if after >= stall_after {
            out.push((id.to_owned(), GiveUp::Stalled { after, in_flight }));
        } else if unlisted {
            out.push((id.to_owned(), GiveUp::Unlisted));
        }
    }
    out
}

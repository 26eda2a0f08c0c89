//! What the broadcasts an engine takes part in report of themselves, for `describe()` and the
//! metrics. The layers above the facade (`ferry-broadcast`) report; the engine only keeps the
//! latest report of each (role, name, version), and at most [`MAX_BROADCASTS`] of them.

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

use crate::describe::BroadcastDescription;

/// Reports kept at once; past it the oldest finished one goes (else the oldest).
pub const MAX_BROADCASTS: usize = 32;

/// The latest report of each broadcast.
#[derive(Debug, Default)]
pub(crate) struct Board {
    entries: Mutex<VecDeque<BroadcastDescription>>,
}

impl Board {
    /// Keeps `report` in place of the last one of the same role, name and version.
    pub(crate) fn report(&self, report: BroadcastDescription) {
        let mut e = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(old) = e
            .iter_mut()
            .find(|o| o.role == report.role && o.name == report.name && o.version == report.version)
        {
            *old = report;
            return;
        }
        if e.len() >= MAX_BROADCASTS {
            let gone = e.iter().position(|o| o.done).unwrap_or(0);
            e.remove(gone);
        }
        e.push_back(report);
    }

    /// Every report kept, oldest first.
    pub(crate) fn snapshot(&self) -> Vec<BroadcastDescription> {
        let e = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        e.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{Board, MAX_BROADCASTS};
    use crate::describe::BroadcastDescription;

    fn report(name: &str, version: u64, bytes: u64, done: bool) -> BroadcastDescription {
        BroadcastDescription {
            role: "receiver".into(),
            name: name.into(),
            version,
            bytes,
            total_bytes: 100,
            refetched: 0,
            peers: 1,
            done,
        }
    }

    /// A later report of the same broadcast replaces the earlier; another version is its own.
    #[test]
    fn the_latest_report_of_each_broadcast_is_kept() {
        let b = Board::default();
        b.report(report("w", 1, 10, false));
        b.report(report("w", 1, 60, false));
        b.report(report("w", 2, 5, false));
        let s = b.snapshot();
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].version, s[0].bytes), (1, 60));
        assert_eq!((s[1].version, s[1].bytes), (2, 5));
    }

    /// The board is bounded: a finished broadcast goes first, else the oldest.
    #[test]
    fn the_board_is_bounded_and_drops_finished_ones_first() {
        let b = Board::default();
        b.report(report("running", 0, 1, false));
        b.report(report("finished", 0, 100, true));
        for v in 1..MAX_BROADCASTS as u64 - 1 {
            b.report(report("w", v, 1, false));
        }
        assert_eq!(b.snapshot().len(), MAX_BROADCASTS);
        b.report(report("new", 0, 1, false));
        let s = b.snapshot();
        assert_eq!(s.len(), MAX_BROADCASTS);
        assert!(s.iter().all(|d| d.name != "finished"));
        assert_eq!(s[0].name, "running");
        b.report(report("newer", 0, 1, false));
        let s = b.snapshot();
        assert!(s.iter().all(|d| d.name != "running"));
        assert_eq!(s.last().map(|d| d.name.as_str()), Some("newer"));
    }
}

//! What commands print while they run: lines on stdout that never panic when the reader went
//! away, and progress (`--progress`) as a bar on a terminal or as lines a log keeps.
//!
//! One unit system throughout: decimal bytes and rates (kB, MB, GB, GB/s), as the summaries
//! print them.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Whether stdout's reader went away (`ferry serve | head -1`).
static STDOUT_GONE: AtomicBool = AtomicBool::new(false);

/// Lines [`say`] keeps back while a [`Held`] lives (`None`: printed at once).
static HELD: std::sync::Mutex<Option<Vec<String>>> = std::sync::Mutex::new(None);

/// While it lives, [`say`] keeps its lines back; [`release`](Self::release) hands them over
/// (to print after a line that must come first: `ferry serve`'s address), and a drop prints
/// them (a start that failed half way still says what it did).
pub(crate) struct Held(());

impl Held {
    pub(crate) fn start() -> Self {
        *HELD
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Vec::new());
        Self(())
    }

    /// Stops keeping lines back; returns those kept.
    pub(crate) fn release(self) -> Vec<String> {
        let kept = HELD
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        std::mem::forget(self);
        kept.unwrap_or_default()
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let kept = HELD
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        for line in kept.unwrap_or_default() {
            say(format_args!("{line}"));
        }
    }
}

/// Prints a line on stdout while someone reads it. A reader that went away stops the printing
/// (logged once), never the command: `println!` would panic on the broken pipe.
pub(crate) fn say(line: std::fmt::Arguments<'_>) {
    if let Some(kept) = HELD
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .as_mut()
    {
        kept.push(line.to_string());
        return;
    }
    if STDOUT_GONE.load(Ordering::Relaxed) {
        return;
    }
    let mut out = std::io::stdout().lock();
    if let Err(e) = writeln!(out, "{line}").and_then(|()| out.flush()) {
        STDOUT_GONE.store(true, Ordering::Relaxed);
        tracing::warn!(error = %e, "stdout is gone; going on without printing");
    }
}

/// `--progress`: how progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ProgressMode {
    /// A bar on a terminal (stderr), else lines.
    Auto,
    /// A bar, even where stderr is not a terminal.
    Bar,
    /// One line on stderr every `--progress-every` (bytes, rate, peers, ETA).
    Lines,
    /// Nothing.
    None,
}

/// `--progress-every`: 1 ms to 10 s (a log gets a line at least every 10 s).
pub(crate) fn progress_every(s: &str) -> anyhow::Result<Duration> {
    let d = crate::parse::positive_duration(s)?;
    if d > Duration::from_secs(10) {
        anyhow::bail!("must be at most 10s");
    }
    Ok(d)
}

/// Decimal bytes: `512 B`, `1.50 kB`, `3.21 GB`.
pub(crate) fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "kB", "MB", "GB", "TB", "PB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// A decimal rate: `2.10 GB/s`.
pub(crate) fn rate(bytes_per_s: f64) -> String {
    format!(
        "{}/s",
        bytes(if bytes_per_s.is_finite() {
            bytes_per_s.max(0.0) as u64
        } else {
            0
        })
    )
}

/// How far a run is to go: a byte count or a duration.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Goal {
    Bytes(u64),
    Time(Duration),
}

enum Shown {
    Bar(indicatif::ProgressBar),
    Lines { every: Duration, last: Instant },
    Nothing,
}

/// The rate shown is over the last this long (the rate now, not the run's average, which
/// decays slowly when the run stalls).
const RATE_OVER: Duration = Duration::from_secs(3);

/// A run whose bytes have not moved for this long is shown as stalled, in place of a rate.
const STALL_AFTER: Duration = Duration::from_secs(2);

/// The bar's width: with the text beside it, a line fits 80 columns (the text is cut to what
/// the terminal leaves; a bar line never wraps).
const BAR: &str = "{bar:18} {wide_msg}";

/// Progress of one run, shown as `--progress` says. [`update`](Self::update) it often (every
/// 100 ms); it draws or prints only when due.
pub(crate) struct Meter {
    shown: Shown,
    what: &'static str,
    goal: Goal,
    start: Instant,
    /// Bytes moved at recent updates, oldest first, over about [`RATE_OVER`].
    recent: std::collections::VecDeque<(Instant, u64)>,
    /// The bytes moved last, and since when.
    last_move: (u64, Instant),
    /// What the run waits on that has sent nothing for a while, and how long (a pull's
    /// holder), set with [`stalled_on`](Self::stalled_on).
    waiting: Option<(String, Duration)>,
}

impl Meter {
    /// `what` names the command in lines (`bench`, `pull`). `json`: auto never draws a bar
    /// then (the bar is for people; a script reading JSON gets lines on stderr).
    pub(crate) fn new(
        mode: ProgressMode,
        every: Duration,
        json: bool,
        what: &'static str,
        goal: Goal,
    ) -> Self {
        let bar = match mode {
            ProgressMode::Bar => true,
            ProgressMode::Auto => !json && std::io::stderr().is_terminal(),
            ProgressMode::Lines | ProgressMode::None => false,
        };
        let shown = if bar {
            Shown::Bar(Self::bar(goal, indicatif::ProgressDrawTarget::stderr()))
        } else if mode == ProgressMode::None {
            Shown::Nothing
        } else {
            Shown::Lines {
                every,
                // The first line at once: the run has started.
                last: Instant::now() - every,
            }
        };
        Self::showing(shown, what, goal)
    }

    fn showing(shown: Shown, what: &'static str, goal: Goal) -> Self {
        let start = Instant::now();
        Self {
            shown,
            what,
            goal,
            start,
            recent: std::collections::VecDeque::new(),
            last_move: (0, start),
            waiting: None,
        }
    }

    /// A bar of `goal` drawn to `target`: [`BAR`], its text written by [`text`](Self::text).
    fn bar(goal: Goal, target: indicatif::ProgressDrawTarget) -> indicatif::ProgressBar {
        let len = match goal {
            Goal::Bytes(n) => n,
            Goal::Time(d) => d.as_millis() as u64,
        };
        let b = indicatif::ProgressBar::with_draw_target(Some(len), target);
        b.set_style(
            indicatif::ProgressStyle::with_template(BAR)
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        b
    }

    /// Names what the run waits on that has sent nothing for `quiet` (`None`: nothing is).
    pub(crate) fn stalled_on(&mut self, waiting: Option<(String, Duration)>) {
        self.waiting = waiting;
    }

    /// Takes `moved` at `now`: the recent rate's window and when the bytes last moved.
    fn record(&mut self, moved: u64, now: Instant) {
        if moved != self.last_move.0 {
            self.last_move = (moved, now);
        }
        self.recent.push_back((now, moved));
        while self
            .recent
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > RATE_OVER)
        {
            self.recent.pop_front();
        }
    }

    /// The rate over the last [`RATE_OVER`] (since the start, while the samples kept span
    /// less than a second).
    fn rate_now(&self, moved: u64, now: Instant) -> f64 {
        let (t, b) = match self.recent.front() {
            Some(&(t, b)) if now.duration_since(t) >= Duration::from_secs(1) => (t, b),
            _ => (self.start, 0),
        };
        moved.saturating_sub(b) as f64 / now.duration_since(t).as_secs_f64().max(1e-9)
    }

    /// How long the bytes have not moved, once that is [`STALL_AFTER`] or more (a run that
    /// reached its byte goal never stalls).
    fn idle(&self, now: Instant) -> Option<Duration> {
        if let Goal::Bytes(total) = self.goal
            && self.last_move.0 >= total
        {
            return None;
        }
        let idle = now.duration_since(self.last_move.1);
        (idle >= STALL_AFTER).then_some(idle)
    }

    /// The line for `moved` bytes so far at `now` (`peers` where the run has them): bytes,
    /// the rate now or how long it has been stalled, peers and ETA.
    fn line(&self, moved: u64, peers: Option<usize>, now: Instant) -> String {
        let secs = now.duration_since(self.start).as_secs_f64();
        let speed = match self.goal {
            // Done: the run's own rate (the last seconds may have been its final check).
            Goal::Bytes(total) if moved >= total => moved as f64 / secs.max(1e-9),
            _ => self.rate_now(moved, now),
        };
        let mut line = match self.goal {
            Goal::Bytes(total) => {
                let pct = (moved as f64 * 100.0 / total.max(1) as f64).min(100.0);
                format!("{} of {} ({pct:.0}%)", bytes(moved), bytes(total))
            }
            Goal::Time(d) => format!(
                "{} in {secs:.1} s of {:.1} s",
                bytes(moved),
                d.as_secs_f64()
            ),
        };
        let idle = self.idle(now);
        match idle {
            Some(idle) => line.push_str(&format!(", stalled {:.0} s", idle.as_secs_f64())),
            None => line.push_str(&format!(", {}", rate(speed))),
        }
        if let Some(p) = peers {
            line.push_str(&format!(", {}", peer_count(p)));
        }
        let eta = match self.goal {
            Goal::Bytes(total) if moved > 0 && idle.is_none() && speed > 0.0 => {
                Some(total.saturating_sub(moved) as f64 / speed)
            }
            Goal::Time(d) => Some((d.as_secs_f64() - secs).max(0.0)),
            Goal::Bytes(_) => None,
        };
        if let Some(eta) = eta {
            line.push_str(&format!(", ETA {eta:.0} s"));
        }
        line
    }

    /// The text beside the bar: the line, shorter (bytes as `12.00/50.00 MB`), then the note;
    /// the bar's template cuts it to the terminal's width.
    fn text(&self, moved: u64, peers: Option<usize>, note: Option<&str>, now: Instant) -> String {
        let mut text = match self.goal {
            Goal::Bytes(_) => {
                let line = self.line(moved, peers, now);
                // `12.00 MB of 50.00 MB (24%), rest` as `24% 12.00 MB/50.00 MB, rest`.
                match line
                    .split_once(" (")
                    .and_then(|(b, r)| Some((b, r.split_once("), ")?)))
                {
                    Some((b, (pct, rest))) => format!("{pct} {}, {rest}", b.replace(" of ", "/")),
                    None => line,
                }
            }
            Goal::Time(_) => self.line(moved, peers, now),
        };
        if let Some(n) = note {
            text.push_str(&format!("; {n}"));
        }
        text
    }

    /// What the run waits on, or where it fetches from (`note`), as the line ends.
    fn note(&self, note: Option<&str>) -> Option<String> {
        match &self.waiting {
            Some((who, quiet)) => Some(format!(
                "waiting on {who}, silent {:.1} s",
                quiet.as_secs_f64()
            )),
            None => note.filter(|n| !n.is_empty()).map(str::to_owned),
        }
    }

    /// Shows `moved` bytes (and `peers`, and a `note` such as where a pull fetches from) if a
    /// line or a redraw is due.
    pub(crate) fn update(&mut self, moved: u64, peers: Option<usize>, note: Option<&str>) {
        let now = Instant::now();
        self.record(moved, now);
        let note = self.note(note);
        match &self.shown {
            Shown::Bar(b) => {
                match self.goal {
                    Goal::Bytes(_) => b.set_position(moved),
                    Goal::Time(d) => b.set_position(self.start.elapsed().min(d).as_millis() as u64),
                }
                b.set_message(self.text(moved, peers, note.as_deref(), now));
            }
            Shown::Lines { every, last } => {
                if last.elapsed() >= *every {
                    let mut line = self.line(moved, peers, now);
                    if let Some(n) = &note {
                        line.push_str(&format!("; {n}"));
                    }
                    eprintln!("ferry {}: {line}", self.what);
                    if let Shown::Lines { last, .. } = &mut self.shown {
                        *last = Instant::now();
                    }
                }
            }
            Shown::Nothing => {}
        }
    }

    /// Clears the bar (the summary follows).
    pub(crate) fn finish(&self) {
        if let Shown::Bar(b) = &self.shown {
            b.finish_and_clear();
        }
    }
}

/// `1 peer`, `3 peers`.
fn peer_count(p: usize) -> String {
    match p {
        1 => "1 peer".to_owned(),
        p => format!("{p} peers"),
    }
}

impl Drop for Meter {
    /// A run cut short (stopped, failed) leaves no half-drawn bar behind.
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_units_throughout() {
        assert_eq!(bytes(999), "999 B");
        assert_eq!(bytes(1_500), "1.50 kB");
        assert_eq!(bytes(4 << 30), "4.29 GB");
        assert_eq!(rate(2.1e9), "2.10 GB/s");
    }

    fn meter(goal: Goal, ago: Duration) -> Meter {
        let mut m = Meter::showing(Shown::Nothing, "pull", goal);
        m.start = Instant::now() - ago;
        m.last_move = (0, m.start);
        m
    }

    #[test]
    fn a_line_says_bytes_rate_peers_and_eta() {
        let mut m = meter(Goal::Bytes(1_000_000), Duration::from_secs(1));
        let now = Instant::now();
        m.record(500_000, now);
        let l = m.line(500_000, Some(3), now);
        assert!(l.starts_with("500.00 kB of 1.00 MB (50%), "), "{l}");
        assert!(
            l.contains("kB/s") && l.contains("3 peers") && l.contains("ETA 1 s"),
            "{l}"
        );
    }

    #[test]
    fn a_run_whose_bytes_stop_says_stalled_in_place_of_a_decaying_rate() {
        let mut m = meter(Goal::Bytes(10_000_000), Duration::from_secs(20));
        let t0 = m.start;
        for s in 0..=10u64 {
            m.record(s * 500_000, t0 + Duration::from_secs(s));
        }
        let moving = m.line(5_000_000, Some(1), t0 + Duration::from_secs(10));
        assert!(
            moving.contains("500.00 kB/s") && moving.contains("ETA 10 s"),
            "{moving}"
        );
        // Nothing more for 5 s: stalled, no rate, no ETA.
        for s in 11..=15u64 {
            m.record(5_000_000, t0 + Duration::from_secs(s));
        }
        let stuck = m.line(5_000_000, Some(1), t0 + Duration::from_secs(15));
        assert!(stuck.contains("stalled 5 s"), "{stuck}");
        assert!(!stuck.contains("/s") && !stuck.contains("ETA"), "{stuck}");
        // What the pull waits on is named.
        m.stalled_on(Some((
            "the source 127.0.0.1:7501".into(),
            Duration::from_secs(5),
        )));
        let note = m.note(Some("from 127.0.0.1:7501")).unwrap_or_default();
        assert_eq!(note, "waiting on the source 127.0.0.1:7501, silent 5.0 s");
        m.stalled_on(None);
        assert_eq!(m.note(Some("")), None, "an empty note is no note");
    }

    /// A terminal of `width` columns that keeps what is drawn on it.
    #[derive(Debug, Clone)]
    struct Term {
        width: u16,
        drawn: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    }

    impl indicatif::TermLike for Term {
        fn width(&self) -> u16 {
            self.width
        }
        fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> std::io::Result<()> {
            self.write_str(s)
        }
        fn write_str(&self, s: &str) -> std::io::Result<()> {
            if !s.is_empty() {
                self.drawn.lock().unwrap().push(s.to_owned());
            }
            Ok(())
        }
        fn clear_line(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn the_bar_fits_80_columns_with_a_bar_drawn_and_no_empty_from() {
        for goal in [
            Goal::Bytes(50_000_000_000),
            Goal::Time(Duration::from_secs(30)),
        ] {
            let term = Term {
                width: 80,
                drawn: Default::default(),
            };
            let target = indicatif::ProgressDrawTarget::term_like(Box::new(term.clone()));
            let mut m = Meter::showing(Shown::Bar(Meter::bar(goal, target)), "pull", goal);
            m.start = Instant::now() - Duration::from_secs(4);
            // The longest note a pull gives: two parents, IPv6.
            let note = "from [fd00:1234:5678:9abc::1]:45123,[fd00:1234:5678:9abc::2]:45124, \
                        3 re-fetched";
            m.update(12_345_678_901, Some(123), Some(note));
            m.update(23_456_789_012, Some(123), Some(""));
            m.stalled_on(Some((
                "relay [fd00:1234:5678:9abc::2]:45124".into(),
                Duration::from_secs(2),
            )));
            m.update(23_456_789_012, Some(123), None);
            if let Shown::Bar(b) = &m.shown {
                b.tick();
            }
            // What clears a line is blanks: the lines drawn are the rest.
            let drawn: Vec<String> = term
                .drawn
                .lock()
                .unwrap()
                .iter()
                .filter(|l| !l.trim().is_empty())
                .cloned()
                .collect();
            assert!(drawn.len() >= 3, "{drawn:?}");
            for line in &drawn {
                assert!(
                    line.chars().count() <= 80,
                    "{} columns: {line}",
                    line.chars().count()
                );
                assert!(
                    line.contains("=>") || line.starts_with('='),
                    "no bar: {line}"
                );
                assert!(!line.contains("from ,"), "{line}");
            }
        }
    }
}

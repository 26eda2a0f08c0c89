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

/// Prints a line on stdout while someone reads it. A reader that went away stops the printing
/// (logged once), never the command: `println!` would panic on the broken pipe.
pub(crate) fn say(line: std::fmt::Arguments<'_>) {
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

/// Progress of one run, shown as `--progress` says. [`update`](Self::update) it often (every
/// 100 ms); it draws or prints only when due.
pub(crate) struct Meter {
    shown: Shown,
    what: &'static str,
    goal: Goal,
    start: Instant,
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
            let len = match goal {
                Goal::Bytes(n) => n,
                Goal::Time(d) => d.as_millis() as u64,
            };
            let b = indicatif::ProgressBar::with_draw_target(
                Some(len),
                indicatif::ProgressDrawTarget::stderr(),
            );
            let template = match goal {
                Goal::Bytes(_) => {
                    "{spinner} [{elapsed_precise}] {wide_bar} {decimal_bytes}/{decimal_total_bytes} \
                     {decimal_bytes_per_sec} ETA {eta} {msg}"
                }
                // The bar fills with the time; the message says the bytes and the rate.
                Goal::Time(_) => "{spinner} [{elapsed_precise}] {wide_bar} {msg}",
            };
            b.set_style(
                indicatif::ProgressStyle::with_template(template)
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            Shown::Bar(b)
        } else if mode == ProgressMode::None {
            Shown::Nothing
        } else {
            Shown::Lines {
                every,
                // The first line at once: the run has started.
                last: Instant::now() - every,
            }
        };
        Self {
            shown,
            what,
            goal,
            start: Instant::now(),
        }
    }

    /// The line for `moved` bytes so far (`peers` where the run has them).
    fn line(&self, moved: u64, peers: Option<usize>) -> String {
        let secs = self.start.elapsed().as_secs_f64();
        let speed = moved as f64 / secs.max(1e-9);
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
        line.push_str(&format!(", {}", rate(speed)));
        match peers {
            Some(1) => line.push_str(", 1 peer"),
            Some(p) => line.push_str(&format!(", {p} peers")),
            None => {}
        }
        let eta = match self.goal {
            Goal::Bytes(total) if moved > 0 => {
                Some(total.saturating_sub(moved) as f64 / speed.max(1e-9))
            }
            Goal::Time(d) => Some((d.as_secs_f64() - secs).max(0.0)),
            Goal::Bytes(_) => None,
        };
        if let Some(eta) = eta {
            line.push_str(&format!(", ETA {eta:.0} s"));
        }
        line
    }

    /// Shows `moved` bytes (and `peers`, and a `note` such as where a pull fetches from) if a
    /// line or a redraw is due.
    pub(crate) fn update(&mut self, moved: u64, peers: Option<usize>, note: Option<&str>) {
        let mut line = self.line(moved, peers);
        if let Some(n) = note {
            line.push_str(&format!("; {n}"));
        }
        match &mut self.shown {
            Shown::Bar(b) => match self.goal {
                Goal::Bytes(_) => {
                    b.set_position(moved);
                    let peers = peers.map(|p| match p {
                        1 => "1 peer".to_owned(),
                        p => format!("{p} peers"),
                    });
                    let msg = match (peers, note) {
                        (Some(p), Some(n)) => format!("{p}; {n}"),
                        (Some(p), None) => p,
                        (None, Some(n)) => n.to_owned(),
                        (None, None) => String::new(),
                    };
                    b.set_message(msg);
                }
                Goal::Time(d) => {
                    b.set_position(self.start.elapsed().min(d).as_millis() as u64);
                    b.set_message(line);
                }
            },
            Shown::Lines { every, last } => {
                if last.elapsed() >= *every {
                    *last = Instant::now();
                    eprintln!("ferry {}: {line}", self.what);
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

    #[test]
    fn a_line_says_bytes_rate_peers_and_eta() {
        let m = Meter {
            shown: Shown::Nothing,
            what: "pull",
            goal: Goal::Bytes(1_000_000),
            start: Instant::now() - Duration::from_secs(1),
        };
        let l = m.line(500_000, Some(3));
        assert!(l.starts_with("500.00 kB of 1.00 MB (50%), "), "{l}");
        assert!(
            l.contains("kB/s") && l.contains("3 peers") && l.contains("ETA 1 s"),
            "{l}"
        );
    }
}

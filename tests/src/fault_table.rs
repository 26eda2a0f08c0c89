//! The fault suite's table: each case of `tests/tests/faults.rs` records a row (fault, data
//! plane, and its three verdicts) in the file `FERRY_FAULTS_TABLE` names, and `cargo xtask
//! faults` runs the suite and renders the rows as markdown (docs/faults.md).

use std::io::Write;

use anyhow::{Context, Result, bail};

/// The variable naming the file rows are appended to; unset, nothing is recorded.
pub const TABLE_VAR: &str = "FERRY_FAULTS_TABLE";

/// One case of the fault suite.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultRow {
    /// The fault (`cut at byte N`, `reset`, `client process killed`, ...).
    pub fault: String,
    /// The data plane (`tcp`, `uring`).
    pub plane: String,
    /// The outcome's prefix and remote effect were right, and another peer was served after it.
    pub outcome_right: bool,
    /// The request ended by its deadline.
    pub by_deadline: bool,
    /// Leases, registrations, threads and descriptors were back to their baseline.
    pub nothing_leaked: bool,
    /// What happened, in a few words (the outcome, the figures that were compared).
    pub note: String,
}

impl FaultRow {
    /// Whether every verdict holds.
    pub fn passed(&self) -> bool {
        self.outcome_right && self.by_deadline && self.nothing_leaked
    }

    /// The row as one line of the file (tab-separated; tabs and newlines in a field become
    /// spaces).
    pub fn line(&self) -> String {
        let clean = |s: &str| s.replace(['\t', '\n'], " ");
        format!(
            "{}\t{}\t{}\t{}\t{}\t{}\n",
            clean(&self.fault),
            clean(&self.plane),
            self.outcome_right,
            self.by_deadline,
            self.nothing_leaked,
            clean(&self.note)
        )
    }

    /// Appends this row to the file `FERRY_FAULTS_TABLE` names, if it is set.
    pub fn record(&self) -> Result<()> {
        let Some(path) = std::env::var_os(TABLE_VAR) else {
            return Ok(());
        };
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.to_string_lossy()))?;
        f.write_all(self.line().as_bytes())
            .with_context(|| format!("appending to {}", path.to_string_lossy()))
    }

    /// Parses the rows [`record`](Self::record) wrote.
    pub fn parse_all(text: &str) -> Result<Vec<Self>> {
        let flag = |s: &str| match s {
            "true" => Ok(true),
            "false" => Ok(false),
            other => bail!("not a verdict: {other:?}"),
        };
        text.lines()
            .filter(|l| !l.is_empty())
            .map(|l| {
                let f: Vec<&str> = l.split('\t').collect();
                let [fault, plane, o, d, n, note] = f[..] else {
                    bail!("a row needs 6 fields: {l:?}");
                };
                Ok(Self {
                    fault: fault.into(),
                    plane: plane.into(),
                    outcome_right: flag(o)?,
                    by_deadline: flag(d)?,
                    nothing_leaked: flag(n)?,
                    note: note.into(),
                })
            })
            .collect()
    }

    /// The rows as a markdown table, in the order given.
    pub fn markdown(rows: &[Self]) -> String {
        let mark = |b: bool| if b { "yes" } else { "**NO**" };
        let mut s = String::from(
            "| fault | data plane | outcome right | ended by deadline | nothing leaked | what happened |\n\
             |---|---|---|---|---|---|\n",
        );
        for r in rows {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                r.fault,
                r.plane,
                mark(r.outcome_right),
                mark(r.by_deadline),
                mark(r.nothing_leaked),
                r.note.replace('|', "/")
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_survive_the_file_and_render() {
        let row = FaultRow {
            fault: "reset".into(),
            plane: "tcp".into(),
            outcome_right: true,
            by_deadline: true,
            nothing_leaked: false,
            note: "peer lost\tafter 2 of 8 ops".into(),
        };
        let rows = FaultRow::parse_all(&row.line()).unwrap();
        assert_eq!(
            rows,
            [FaultRow {
                note: "peer lost after 2 of 8 ops".into(),
                ..row.clone()
            }]
        );
        assert!(!rows[0].passed());
        assert!(
            FaultRow::parse_all("reset\ttcp\ttrue\n").is_err(),
            "a short row"
        );
        assert!(FaultRow::parse_all(&row.line().replace("true", "yes")).is_err());
        assert!(FaultRow::markdown(&rows).contains("| reset | tcp | yes | yes | **NO** |"));
    }
}

//! Many peers against one server, and a long mixed run: `cargo xtask bench load` and `cargo xtask
//! soak` build this and run it.
//!
//! ```text
//! stress load [--plane tcp|uring] [--peers N] [--stalled N] [--seconds S] [--rounds R]
//! stress soak [--plane tcp|uring] [--seconds S] [--workers N]
//! stress idle [--plane tcp|uring] [--clients N] [--probes N]
//! stress fanout [--plane tcp|uring] [--peers N] [--streams N]
//! stress serve --plane tcp|uring     (the server child all start; commands on stdin)
//! ```
//!
//! Both run the server in a child process (this binary, `serve`), so its resident memory,
//! descriptors and threads are its own ([`ferry_tests::Census`] of the child), and put the
//! clients in this one, some of them behind a [`ferry_tests::proxy::FaultProxy`].

mod fanout;
mod idle;
mod load;
mod server;
mod soak;

use anyhow::{Context, Result, bail};
use ferry::DataPlane;

/// Options every mode takes, parsed from `--name value` pairs.
#[derive(Debug)]
struct Args {
    pairs: Vec<(String, String)>,
}

impl Args {
    fn parse(args: &[String]) -> Result<Self> {
        let mut pairs = Vec::new();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let Some(name) = a.strip_prefix("--") else {
                bail!("unexpected argument {a:?}");
            };
            let value = it.next().with_context(|| format!("{a} needs a value"))?;
            pairs.push((name.to_owned(), value.clone()));
        }
        Ok(Self { pairs })
    }

    /// The value of `--name` parsed, or `default`.
    fn get<T: std::str::FromStr>(&self, name: &str, default: T) -> Result<T>
    where
        T::Err: std::fmt::Display,
    {
        match self.pairs.iter().find(|(n, _)| n == name) {
            Some((_, v)) => v
                .parse()
                .map_err(|e| anyhow::anyhow!("--{name} {v:?}: {e}")),
            None => Ok(default),
        }
    }

    /// `--plane tcp|uring` (default tcp).
    fn plane(&self) -> Result<(DataPlane, String)> {
        let name: String = self.get("plane", "tcp".to_owned())?;
        match DataPlane::parse(&name) {
            Some(p @ (DataPlane::Tcp | DataPlane::Uring)) => Ok((p, name)),
            _ => bail!("--plane takes tcp or uring, not {name:?}"),
        }
    }

    /// Fails on any `--name` not in `known`.
    fn only(&self, known: &[&str]) -> Result<()> {
        for (n, _) in &self.pairs {
            if !known.contains(&n.as_str()) {
                bail!("unknown option --{n} (takes {})", known.join(", "));
            }
        }
        Ok(())
    }
}

/// The value at `q` (0..=1) of sorted samples (0 when there are none).
fn quantile(sorted: &[u32], q: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest = args.get(1..).unwrap_or_default();
    match args.first().map(String::as_str) {
        Some("serve") => server::serve(&Args::parse(rest)?),
        Some("load") => load::run(&Args::parse(rest)?),
        Some("idle") => idle::run(&Args::parse(rest)?),
        Some("fanout") => fanout::run(&Args::parse(rest)?),
        Some("soak") => soak::run(&Args::parse(rest)?),
        _ => bail!(
            "usage: stress load|idle|fanout|soak|serve [options] (see benches/src/bin/stress/main.rs)"
        ),
    }
}

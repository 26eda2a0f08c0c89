//! `cargo xtask bench broadcast`: one source and N receivers, each in its own network namespace,
//! every host's veth link shaped by TBF to the same rate in both directions (one bridge joins
//! them, as `shared/tools/netns/fleet.sh` does), a payload of a few hundred MiB.
//!
//! Three runs of the release `ferry` binary (`ferry publish` in host 0, `ferry pull --json` in
//! hosts 1..N, all started at once): relayed; relaying off (`--no-relay`: every receiver pulls
//! from the source); relayed with one receiver killed (SIGKILL) halfway through the ideal time.
//! For each: the time until the last surviving receiver printed its summary (after writing its
//! files), the time until it had verified every chunk in memory (its timeline's `done`; the
//! receivers all write to this one machine's disk, which a fleet does not share), the ideal time
//! (payload / link rate), efficiency = ideal / measured, the source's egress (its veth's
//! transmitted bytes) over the payload, and whether every surviving receiver's files equal the
//! payload byte for byte. After the relayed run, each receiver's timeline (`ferry pull --json`:
//! started, joined, manifest, first chunk requested and verified, last verified, done) in
//! chain order with each hop's lag behind the one before. Targets (issue 15): efficiency at least 0.8 with N = 8, source egress
//! at most 1.1x, and with a receiver killed every other one completes with efficiency at least
//! 0.6. A benchmark: it reports, it asserts nothing about time.
//!
//! With `--memory` it is memory to memory, as a trainer's weights reach inference engines: the
//! source reads the payload into host memory and serves it from there (`ferry publish
//! --from-memory`) and the receivers keep it in memory (`ferry pull --in-memory`, no file
//! written); "verified" then counts the receivers whose summary has every byte, each chunk
//! checked against the manifest's BLAKE3. The relayed run is then `--rounds R` (3) rounds, each
//! a file-to-file run and a memory-to-memory one, and reports the ratio of their efficiencies
//! (at the time the last receiver had verified every chunk in memory) per round and its median.
//!
//! Options: `--receivers N` (8), `--size BYTES` (256MiB), `--rate TC_RATE` (200mbit),
//! `--straggler TC_RATE` (also a relayed run with the middle receiver's link at that rate),
//! `--chunk-size BYTES` (1MiB, the manifest's), `--skip-baseline` (no relaying-off run), `--no-build` (use the `target/release/ferry` there
//! is), `--bin PATH` (run that `ferry` binary instead: another build, for before/after rounds),
//! `--stripes N` (passed to every `ferry pull`: the relay plan's stripes; 1 is the chain),
//! `--no-killed` (no run with a receiver killed), `--no-files` (with `--memory`: rounds of the
//! memory-to-memory run alone). Needs root, `ip` and `tc`.
//!
//! Every run also reports the CPU time (user and system, all threads, from `/proc/PID/stat`)
//! of each receiver, read after all finished while they still serve, and of the source: on a
//! shared machine CPU per byte relayed steers better than wall-clock time.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use ferry_tests::Fleet;

use crate::util::{cargo, json_num, run as run_loud, size};

/// Spawns `bin ARGS` inside host `i` of the fleet, its stdout piped.
fn spawn(fleet: &Fleet, i: usize, bin: &Path, args: &[&str]) -> Result<Child> {
    fleet
        .command(i, bin)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {} in host {i}", bin.display()))
}

/// The 1-minute load average (`/proc/loadavg`), for the report; `?` where unreadable.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// A tc rate (`200mbit`, `50mbps`, `1gbit`) in bytes per second.
fn rate_bytes(rate: &str) -> Result<f64> {
    let r = rate.to_ascii_lowercase();
    let units = [
        ("gbit", 1e9 / 8.0),
        ("mbit", 1e6 / 8.0),
        ("kbit", 1e3 / 8.0),
        ("gbps", 1e9),
        ("mbps", 1e6),
        ("kbps", 1e3),
        ("bit", 1.0 / 8.0),
    ];
    for (u, mul) in units {
        if let Some(v) = r.strip_suffix(u) {
            return Ok(v.parse::<f64>().context("rate")? * mul);
        }
    }
    bail!("rate {rate:?}: use tc units such as 200mbit")
}

fn payload(path: &Path, len: u64) -> Result<()> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut v = Vec::with_capacity(len as usize);
    while (v.len() as u64) < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len as usize);
    std::fs::write(path, v).with_context(|| format!("writing {}", path.display()))
}

struct Outcome {
    seconds: f64,
    /// From the first receiver's spawn until the last surviving one had verified every chunk
    /// in memory (its timeline's `done`), before writing its files.
    verified_seconds: f64,
    egress: u64,
    completed: usize,
    verified: usize,
    refetched: f64,
    from_relays: f64,
    /// Each surviving receiver's host and JSON summary.
    summaries: Vec<(usize, String)>,
    /// CPU seconds (user, system; all threads) of each surviving receiver, read before it
    /// was stopped, by host.
    cpu: Vec<(usize, f64, f64)>,
    /// The source's CPU seconds.
    source_cpu: f64,
}

/// The CPU seconds (user, system; every thread) process `pid` has used: fields 14 and 15 of
/// `/proc/PID/stat`, in `USER_HZ` (100 on Linux) ticks; `None` where unreadable.
fn cpu_seconds(pid: u32) -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let user = f.get(11)?.parse::<u64>().ok()?;
    let sys = f.get(12)?.parse::<u64>().ok()?;
    Some((user as f64 / 100.0, sys as f64 / 100.0))
}

/// The steps of `ferry pull --json`'s `timeline`, in order.
const STEPS: [&str; 8] = [
    "process_start",
    "join_start",
    "manifest",
    "joined",
    "first_request",
    "first_verified",
    "last_verified",
    "done",
];

/// Prints each receiver's timeline (`ferry pull --json`), in join order (the chain's), in
/// seconds from the first receiver's start, and each hop's lag behind the one before it.
fn print_timeline(summaries: &[(usize, String)]) {
    let mut rows: Vec<(usize, Vec<Option<f64>>)> = summaries
        .iter()
        .map(|(i, line)| (*i, STEPS.iter().map(|k| json_num(line, k, 0)).collect()))
        .collect();
    // Chain order: in a chain each hop verifies its first chunk after the one before it.
    rows.sort_by(|a, b| {
        a.1[5]
            .unwrap_or(f64::MAX)
            .total_cmp(&b.1[5].unwrap_or(f64::MAX))
    });
    let t0 = rows
        .iter()
        .filter_map(|(_, r)| r[0])
        .fold(f64::MAX, f64::min);
    println!(
        "  per-hop timeline (s from the first receiver's start; in order of first chunk verified, \
         the chain's order):"
    );
    println!(
        "  {:>4} {:>7} {:>7} {:>8} {:>7} {:>9} {:>9} {:>9} {:>7} {:>9}   lag: first verified, last verified",
        "host",
        "start",
        "join",
        "manifest",
        "joined",
        "1st req",
        "1st ok",
        "last ok",
        "done",
        "gave up"
    );
    let gave_up: std::collections::HashMap<usize, f64> = summaries
        .iter()
        .filter_map(|(i, l)| json_num(l, "parent_given_up", 0).map(|t| (*i, t)))
        .collect();
    let mut prev: Option<(f64, f64)> = None;
    for (i, r) in &rows {
        let cell = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.3}", v - t0));
        let lag = match (prev, r[5], r[6]) {
            (Some((pf, pl)), Some(f), Some(l)) => format!("+{:.3} +{:.3}", f - pf, l - pl),
            _ => String::new(),
        };
        println!(
            "  {:>4} {:>7} {:>7} {:>8} {:>7} {:>9} {:>9} {:>9} {:>7} {:>9}   {lag}",
            i,
            cell(r[0]),
            cell(r[1]),
            cell(r[2]),
            cell(r[3]),
            cell(r[4]),
            cell(r[5]),
            cell(r[6]),
            cell(r[7]),
            cell(gave_up.get(i).copied())
        );
        if let (Some(f), Some(l)) = (r[5], r[6]) {
            prev = Some((f, l));
        }
    }
}

/// How every run of one benchmark publishes and pulls.
struct How {
    /// The manifest's chunk size (`--chunk-size`).
    chunk: String,
    /// Memory to memory (`publish --from-memory`, `pull --in-memory`) instead of files.
    memory: bool,
    /// Passed to every `ferry pull --stripes`.
    stripes: Option<String>,
}

/// One run: source in host 0, receivers in 1..=n; `kill`: the receiver to kill and when.
#[allow(clippy::too_many_arguments)]
fn run_once(
    fleet: &Fleet,
    bin: &Path,
    file: &Path,
    work: &Path,
    relay: bool,
    kill: Option<(usize, Duration)>,
    how: &How,
) -> Result<Outcome> {
    let listen = format!("{}:7500", fleet.addr(0));
    let file_s = file.display().to_string();
    let mut publish = vec![
        "publish",
        &file_s,
        "--name",
        "bench",
        "--listen",
        &listen,
        "--transport",
        "tcp",
        "--chunk-size",
        &how.chunk,
    ];
    if how.memory {
        publish.push("--from-memory");
    }
    let mut source = spawn(fleet, 0, bin, &publish)?;
    // Wait for the source's first line (it listens then).
    let mut lines = BufReader::new(source.stdout.take().context("source stdout")?).lines();
    lines.next().context("the source printed nothing")??;
    let egress0 = fleet.tx_bytes(0)?;
    let (tx, rx) = mpsc::channel::<(usize, String, Instant)>();
    let mut receivers = Vec::new();
    let start = Instant::now();
    let start_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    for i in 1..fleet.hosts() {
        let dir = work.join(format!("out-{i}"));
        let _ = std::fs::remove_dir_all(&dir);
        let dir_s = dir.display().to_string();
        let mut args = vec!["pull", &listen, "--json", "--transport", "tcp"];
        if how.memory {
            args.push("--in-memory");
        } else {
            args.extend(["--into", &dir_s]);
        }
        args.extend(["--linger", "30"]);
        if !relay {
            args.push("--no-relay");
        }
        if let Some(d) = &how.stripes {
            args.extend(["--stripes", d.as_str()]);
        }
        let mut child = spawn(fleet, i, bin, &args)?;
        let out = child.stdout.take().context("receiver stdout")?;
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send((i, line, Instant::now()));
            }
        });
        receivers.push((i, child, dir));
    }
    drop(tx);
    let mut killed = None;
    let mut done = std::collections::HashMap::new();
    let expect = fleet.hosts() - 1 - usize::from(kill.is_some());
    let deadline = Instant::now() + Duration::from_secs(600);
    while done.len() < expect && Instant::now() < deadline {
        if let Some((k, after)) = kill
            && killed.is_none()
            && start.elapsed() >= after
            && let Some((_, c, _)) = receivers.iter_mut().find(|(i, _, _)| *i == k)
        {
            let _ = c.kill();
            killed = Some(k);
            eprintln!(
                "  killed receiver {k} at {:.1} s (timeline: {:.3})",
                start.elapsed().as_secs_f64(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64())
                    - start_unix
            );
        }
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok((i, line, at)) if line.starts_with('{') && Some(i) != killed => {
                done.insert(i, (line, at));
            }
            Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let last = done.values().map(|(_, at)| *at).max().unwrap_or(start);
    let seconds = last.duration_since(start).as_secs_f64();
    let egress = fleet.tx_bytes(0)?.saturating_sub(egress0);
    let want = std::fs::read(file)?;
    let name = file.file_name().context("payload name")?;
    let mut verified = 0;
    let (mut refetched, mut from_relays) = (0.0, 0.0);
    let summaries: Vec<(usize, String)> = done.iter().map(|(i, (l, _))| (*i, l.clone())).collect();
    let verified_seconds = summaries
        .iter()
        .filter_map(|(_, l)| json_num(l, "done", 0))
        .fold(start_unix, f64::max)
        - start_unix;
    for (i, (line, _)) in &done {
        refetched += json_num(line, "refetched_chunks", 0).unwrap_or(0.0);
        from_relays += json_num(line, "bytes_from_relays", 0).unwrap_or(0.0);
        let whole = if how.memory {
            // Nothing written: the receiver verified each chunk against the manifest's BLAKE3.
            json_num(line, "bytes", 0) == Some(want.len() as f64)
        } else {
            std::fs::read(work.join(format!("out-{i}")).join(name)).unwrap_or_default() == want
        };
        if whole {
            verified += 1;
        }
    }
    // Every survivor lingers (serving) after its summary: its CPU is read while it still runs.
    let cpu: Vec<(usize, f64, f64)> = receivers
        .iter()
        .filter(|(i, _, _)| done.contains_key(i))
        .filter_map(|(i, c, _)| cpu_seconds(c.id()).map(|(u, s)| (*i, u, s)))
        .collect();
    let source_cpu = cpu_seconds(source.id()).map_or(f64::NAN, |(u, s)| u + s);
    for (_, mut c, _) in receivers {
        let _ = c.kill();
        let _ = c.wait();
    }
    let _ = source.kill();
    let _ = source.wait();
    Ok(Outcome {
        seconds,
        verified_seconds,
        egress,
        completed: done.len(),
        verified,
        refetched,
        from_relays,
        summaries,
        cpu,
        source_cpu,
    })
}

/// What `bench broadcast` was asked for (see the module docs).
struct Args {
    n: usize,
    len: u64,
    rate: String,
    baseline: bool,
    build: bool,
    chunk: String,
    memory: bool,
    rounds: usize,
    straggler: Option<String>,
    bin: Option<PathBuf>,
    stripes: Option<String>,
    killed_run: bool,
    /// With `--memory`: no file-to-file run in each round.
    files: bool,
}

impl Args {
    fn parse(args: &[String]) -> Result<Args> {
        let mut a = Args {
            n: 8,
            len: 256 << 20,
            rate: "200mbit".to_string(),
            baseline: true,
            build: true,
            chunk: "1MiB".to_string(),
            memory: false,
            rounds: 3,
            straggler: None,
            bin: None,
            stripes: None,
            killed_run: true,
            files: true,
        };
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--receivers" => a.n = it.next().context("--receivers N")?.parse()?,
                "--size" => a.len = size(it.next().context("--size BYTES")?)?,
                "--rate" => a.rate = it.next().context("--rate RATE")?.clone(),
                "--skip-baseline" => a.baseline = false,
                "--no-build" => a.build = false,
                "--chunk-size" => a.chunk = it.next().context("--chunk-size BYTES")?.clone(),
                "--straggler" => a.straggler = Some(it.next().context("--straggler RATE")?.clone()),
                "--bin" => {
                    a.bin = Some(it.next().context("--bin PATH")?.into());
                    a.build = false;
                }
                "--stripes" => a.stripes = Some(it.next().context("--stripes N")?.clone()),
                "--no-killed" => a.killed_run = false,
                "--memory" => a.memory = true,
                "--no-files" => a.files = false,
                "--rounds" => a.rounds = it.next().context("--rounds R")?.parse()?,
                other => bail!("bench broadcast: unknown option {other:?}"),
            }
        }
        if a.n == 0 {
            bail!("--receivers must be at least 1");
        }
        if a.rounds == 0 {
            bail!("--rounds must be at least 1");
        }
        Ok(a)
    }
}

/// What every run of one benchmark shares: the fleet, the binary, the payload and its ideal time.
struct Bench<'a> {
    fleet: &'a Fleet,
    bin: &'a Path,
    file: &'a Path,
    work: &'a Path,
    how: How,
    /// Receivers.
    n: usize,
    /// The payload's length.
    len: u64,
    /// The payload's time at the link rate, in seconds.
    ideal: f64,
    /// With `memory`: a file-to-file run in each round beside the memory-to-memory one.
    files: bool,
}

impl Bench<'_> {
    /// One run (see [`run_once`]) with `how`.
    fn once(&self, relay: bool, kill: Option<(usize, Duration)>, how: &How) -> Result<Outcome> {
        run_once(self.fleet, self.bin, self.file, self.work, relay, kill, how)
    }

    /// One line for run `what`.
    fn report(&self, what: &str, o: &Outcome) {
        let (ideal, len) = (self.ideal, self.len);
        println!(
            "{what:<28} {:>7.2} s  efficiency {:.2} (verified in memory: {:.2} s, {:.2})  \
             source egress {:.2}x payload  completed {}/{} verified {}  re-fetched {}  \
             from relays {:.0} MiB",
            o.seconds,
            ideal / o.seconds.max(1e-9),
            o.verified_seconds,
            ideal / o.verified_seconds.max(1e-9),
            o.egress as f64 / len as f64,
            o.completed,
            self.n,
            o.verified,
            o.refetched,
            o.from_relays / (1u64 << 20) as f64
        );
        let mib = len as f64 / (1u64 << 20) as f64;
        let k = o.cpu.len().max(1) as f64;
        let user = o.cpu.iter().map(|c| c.1).sum::<f64>() / k;
        let sys = o.cpu.iter().map(|c| c.2).sum::<f64>() / k;
        let max = o.cpu.iter().map(|c| c.1 + c.2).fold(0.0, f64::max);
        println!(
            "  CPU: receivers mean {:.2} s (user {user:.2}, system {sys:.2}; {:.2} ms per MiB \
             received), max {max:.2} s; source {:.2} s ({:.2} ms per MiB of payload); all {:.2} s",
            user + sys,
            (user + sys) * 1e3 / mib,
            o.source_cpu,
            o.source_cpu * 1e3 / mib,
            o.source_cpu + (user + sys) * k
        );
    }

    /// `rounds` rounds of file to file (the reference, relayed) alternating with memory to
    /// memory, and the median ratio of their efficiencies.
    fn memory_rounds(&self, rounds: usize) -> Result<()> {
        let ideal = self.ideal;
        let files = How {
            chunk: self.how.chunk.clone(),
            memory: false,
            stripes: self.how.stripes.clone(),
        };
        let mut ratios = Vec::new();
        for round in 1..=rounds {
            if !self.files {
                let m = self.once(true, None, &self.how)?;
                self.report(&format!("round {round}: memory to memory"), &m);
                if round == rounds {
                    print_timeline(&m.summaries);
                }
                continue;
            }
            let f = self.once(true, None, &files)?;
            self.report(&format!("round {round}: file to file"), &f);
            let m = self.once(true, None, &self.how)?;
            self.report(&format!("round {round}: memory to memory"), &m);
            // Both at the time every chunk was verified in memory (a file receiver's writing
            // comes after, on this one machine's disk).
            let (ef, em) = (
                ideal / f.verified_seconds.max(1e-9),
                ideal / m.verified_seconds.max(1e-9),
            );
            println!(
                "  round {round}: efficiency memory {em:.2}, files {ef:.2}; memory/files {:.2} (load {})",
                em / ef,
                loadavg()
            );
            ratios.push(em / ef);
            if round == rounds {
                print_timeline(&m.summaries);
            }
        }
        if ratios.is_empty() {
            return Ok(());
        }
        ratios.sort_by(f64::total_cmp);
        println!(
            "memory/files efficiency over {rounds} alternating rounds: median {:.2}, range {:.2}-{:.2}",
            ratios[ratios.len() / 2],
            ratios[0],
            ratios[ratios.len() - 1]
        );
        Ok(())
    }

    /// A relayed run with the middle receiver's link slowed to `slow` (then back to `rate`):
    /// the others' time is what the plan should protect.
    fn straggler(&self, slow: &str, rate: &str) -> Result<()> {
        let (n, ideal) = (self.n, self.ideal);
        let host = n.div_ceil(2);
        self.fleet.reshape(host, slow)?;
        let o = self.once(true, None, &self.how)?;
        self.fleet.reshape(host, rate)?;
        self.report(&format!("relayed, receiver {host} at {slow}"), &o);
        let start = o
            .summaries
            .iter()
            .filter_map(|(_, l)| json_num(l, "process_start", 0))
            .fold(f64::MAX, f64::min);
        let others = o
            .summaries
            .iter()
            .filter(|(i, _)| *i != host)
            .filter_map(|(_, l)| json_num(l, "done", 0))
            .fold(start, f64::max)
            - start;
        println!(
            "  the {} others verified in memory in {others:.2} s from the first start: efficiency {:.2}",
            n - 1,
            ideal / others.max(1e-9)
        );
        print_timeline(&o.summaries);
        Ok(())
    }

    /// A relayed run with the middle receiver killed halfway through the ideal time.
    fn killed(&self) -> Result<()> {
        let victim = self.n.div_ceil(2);
        let kill = Some((victim, Duration::from_secs_f64(self.ideal / 2.0)));
        let killed = self.once(true, kill, &self.how)?;
        self.report(&format!("relayed, receiver {victim} killed"), &killed);
        // Where the time went: when each survivor gave up a parent (the victim, or one that
        // stalled meanwhile), against the kill.
        print_timeline(&killed.summaries);
        Ok(())
    }
}

/// Runs the benchmark (see the module docs).
pub(crate) fn run(args: &[String]) -> Result<()> {
    let args = Args::parse(args)?;
    let (n, len, rate) = (args.n, args.len, &args.rate);
    if args.build {
        run_loud(cargo().args(["build", "--release", "-p", "ferry-engine-cli"]))?;
    }
    let bin = args
        .bin
        .clone()
        .unwrap_or_else(|| crate::util::release_bin("ferry"));
    // Per process: two benches at once (two worktrees) must not write, or remove, each
    // other's files.
    let work: PathBuf =
        std::env::temp_dir().join(format!("ferry-bench-broadcast.{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let file = work.join("payload.bin");
    payload(&file, len)?;
    let fleet =
        Fleet::make(n + 1, Some(rate)).context("making the namespaces (root, ip and tc needed)")?;
    let ideal = len as f64 / rate_bytes(rate)?;
    println!(
        "broadcast: 1 source + {n} receivers, {} MiB payload in {} chunks, {}, links \
         {rate} each way (TBF), ideal {ideal:.2} s",
        len >> 20,
        args.chunk,
        if args.memory {
            "memory to memory"
        } else {
            "file to file"
        }
    );
    let bench = Bench {
        fleet: &fleet,
        bin: &bin,
        file: &file,
        work: &work,
        how: How {
            chunk: args.chunk.clone(),
            memory: args.memory,
            stripes: args.stripes.clone(),
        },
        n,
        len,
        ideal,
        files: args.files,
    };
    if args.memory {
        bench.memory_rounds(args.rounds)?;
    } else {
        let relayed = bench.once(true, None, &bench.how)?;
        bench.report("relayed", &relayed);
        print_timeline(&relayed.summaries);
    }
    if args.baseline {
        let direct = bench.once(false, None, &bench.how)?;
        bench.report("relaying off", &direct);
    }
    if let Some(slow) = &args.straggler
        && n > 1
    {
        bench.straggler(slow, rate)?;
    }
    // With one receiver there is no other to route around a killed one.
    if n > 1 && args.killed_run {
        bench.killed()?;
    }
    drop(fleet);
    let _ = std::fs::remove_dir_all(&work);
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn tc_rates() {
        assert_eq!(super::rate_bytes("200mbit").unwrap(), 25e6);
        assert_eq!(super::rate_bytes("1gbit").unwrap(), 125e6);
        assert_eq!(super::rate_bytes("50mbps").unwrap(), 50e6);
        assert!(super::rate_bytes("fast").is_err());
    }
}

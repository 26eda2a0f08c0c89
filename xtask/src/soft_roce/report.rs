//! The result log: the `@@ferry` lines `guest/suite.sh` prints (and the guest init's exit line),
//! parsed into a [`Report`] that says what failed and prints the results table, whose last line is
//! `ferry/ib_write_bw = R`.

use super::{ITERS, OP_SIZE};
use crate::util::json_num;

/// Prefix of the result lines the guest script prints.
const MARK: &str = "@@ferry ";

#[derive(Debug, Default, PartialEq)]
struct RefRate {
    tool: String,
    /// When it ran: `before-bench` or `after-bench`.
    when: String,
    /// 10^9 bytes per second.
    gb_per_s: Option<f64>,
    detail: String,
}

#[derive(Debug, Default, PartialEq)]
struct TestRun {
    name: String,
    rc: String,
    passed: u64,
    failed: u64,
    ignored: u64,
    wall_s: String,
    timeout_s: String,
}

impl TestRun {
    fn outcome(&self) -> String {
        match self.rc.as_str() {
            "0" => "ok".to_owned(),
            "124" | "137" => format!("TIMED OUT after {}s", self.timeout_s),
            rc => format!("FAILED rc={rc}"),
        }
    }
}

/// What one run of the suite did, parsed from its log and completed by [`super::suite`].
#[derive(Debug, Default)]
pub(super) struct Report {
    host: bool,
    setup: Option<String>,
    refs: Vec<RefRate>,
    cmds: Vec<(String, String)>,
    tests: Vec<TestRun>,
    /// Ok(GB/s) or Err(why it did not run).
    bench: Option<std::result::Result<f64, String>>,
    /// Packets rxe0 and rxe1 sent during the bench.
    bench_pkts: Option<String>,
    end: Option<String>,
    /// `guest-test.sh exit=N` from the guest's init.
    guest_exit: Option<String>,
    /// Whether `guest-test.sh` (host) or `run-vm.sh` (guest) exited with success.
    pub(super) run_ok: bool,
    /// Seconds the run took (guest boot included).
    pub(super) run_s: f64,
    /// Seconds the whole task took (builds included).
    pub(super) total_s: f64,
    /// Failures of the host builds.
    pub(super) broken_builds: Vec<String>,
    /// Notes of the host builds, for people.
    pub(super) notes: Vec<String>,
    /// Staged names of the test binaries, with their `package:target` labels.
    pub(super) expected_tests: Vec<(String, String)>,
}

/// The bench's bytes must have crossed rxe0/rxe1: at least one packet per 4096 bytes (the
/// largest RoCE MTU) is sent, or the bench did not run over RDMA and its rate is no RDMA rate.
fn check_rxe_packets(bytes: f64, pkts: Option<&str>) -> std::result::Result<(), String> {
    let Some(n) = pkts.and_then(|p| p.parse::<f64>().ok()) else {
        return Ok(()); // counters unreadable: nothing to check against
    };
    let least = (bytes / 4096.0).ceil();
    if n < least {
        return Err(format!(
            "ferry bench sent {n} rxe packets for {bytes} bytes, fewer than the {least} RDMA needs: not over rxe"
        ));
    }
    Ok(())
}

/// `key=value` words of a result line.
fn kv<'a>(words: &'a str, key: &str) -> Option<&'a str> {
    words
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// perftest's average bandwidth in 10^9 bytes per second; its MB is 2^20 bytes.
fn perftest_gb_per_s(bw: f64, unit: &str) -> Option<f64> {
    match unit {
        "MB/sec" => Some(bw * 1_048_576.0 / 1e9),
        "Gb/sec" => Some(bw / 8.0),
        _ => None,
    }
}

impl Report {
    /// The report of a result log; the run's other fields are left at their defaults.
    pub(super) fn parse(log: &str, host: bool) -> Report {
        let mut r = Report {
            host,
            ..Report::default()
        };
        for line in log.lines() {
            if let Some(exit) = line.strip_prefix("rxe-init: guest-test.sh exit=") {
                r.guest_exit = Some(exit.trim().to_owned());
            }
            // Anywhere in the line: output of a killed test may precede it.
            let Some(rest) = line.find(MARK).map(|p| &line[p + MARK.len()..]) else {
                continue;
            };
            let (kind, words) = rest.split_once(' ').unwrap_or((rest, ""));
            match kind {
                "setup" => r.setup = Some(words.to_owned()),
                "ref" => {
                    let tool = words.split_whitespace().next().unwrap_or("?").to_owned();
                    let rate = if kv(words, "status") == Some("ok") {
                        kv(words, "bw_avg")
                            .and_then(|v| v.parse::<f64>().ok())
                            .and_then(|bw| perftest_gb_per_s(bw, kv(words, "unit").unwrap_or("")))
                    } else {
                        None
                    };
                    let detail = match rate {
                        Some(_) => format!(
                            "{} {}, {} x {} B, {}s wall",
                            kv(words, "bw_avg").unwrap_or("?"),
                            kv(words, "unit").unwrap_or("?"),
                            kv(words, "iters").unwrap_or("?"),
                            kv(words, "bytes").unwrap_or("?"),
                            kv(words, "wall_s").unwrap_or("?")
                        ),
                        None => format!(
                            "FAILED ({})",
                            kv(words, "reason").unwrap_or("no bandwidth in its output")
                        ),
                    };
                    r.refs.push(RefRate {
                        tool,
                        when: kv(words, "when").unwrap_or("?").to_owned(),
                        gb_per_s: rate,
                        detail,
                    });
                }
                "cmd" => {
                    let sub = words.split_whitespace().next().unwrap_or("?").to_owned();
                    r.cmds
                        .push((sub, kv(words, "rc").unwrap_or("?").to_owned()));
                }
                "test" => {
                    let num = |k| kv(words, k).and_then(|v| v.parse().ok()).unwrap_or(0);
                    r.tests.push(TestRun {
                        name: words.split_whitespace().next().unwrap_or("?").to_owned(),
                        rc: kv(words, "rc").unwrap_or("?").to_owned(),
                        passed: num("passed"),
                        failed: num("failed"),
                        ignored: num("ignored"),
                        wall_s: kv(words, "wall_s").unwrap_or("?").to_owned(),
                        timeout_s: kv(words, "timeout_s").unwrap_or("?").to_owned(),
                    });
                }
                "bench" => {
                    r.bench_pkts = kv(words, "rxe_pkts").map(str::to_owned);
                    r.bench = Some(if kv(words, "status") == Some("ok") {
                        match words.find("json=").map(|p| &words[p + 5..]) {
                            Some(json) => json_num(json, "gb_per_s", 0)
                                .filter(|v| v.is_finite() && *v > 0.0)
                                .ok_or_else(|| "no gb_per_s in its --json output".to_owned())
                                .and_then(|g| {
                                    let bytes = json_num(json, "total_bytes", 0)
                                        .unwrap_or((OP_SIZE * ITERS) as f64);
                                    check_rxe_packets(bytes, kv(words, "rxe_pkts")).map(|()| g)
                                }),
                            None => Err("no --json output".to_owned()),
                        }
                    } else {
                        Err(format!(
                            "ferry bench failed: {}",
                            kv(words, "reason").unwrap_or("?")
                        ))
                    });
                }
                "end" => r.end = Some(words.to_owned()),
                _ => {}
            }
        }
        r
    }

    /// The `package:target` label of a staged test binary, or its name.
    fn label<'a>(&'a self, name: &'a str) -> &'a str {
        self.expected_tests
            .iter()
            .find(|(n, _)| n == name)
            .map_or(name, |(_, l)| l.as_str())
    }

    /// The ib_write_bw reference: the mean of its runs before and after the bench.
    fn write_rate(&self) -> Option<f64> {
        let rates: Vec<f64> = self
            .refs
            .iter()
            .filter(|r| r.tool == "ib_write_bw")
            .filter_map(|r| r.gb_per_s)
            .collect();
        (!rates.is_empty()).then(|| rates.iter().sum::<f64>() / rates.len() as f64)
    }

    /// What makes the run fail; empty when it passed.
    pub(super) fn failures(&self, require_bench: bool) -> Vec<String> {
        let mut f = self.broken_builds.clone();
        let place = if self.host { "host suite" } else { "guest" };
        if self.setup.is_none() {
            f.push(format!("{place}: rxe setup did not complete"));
        }
        if self.end.is_none() {
            f.push(format!("{place}: the suite did not finish"));
        }
        if !self.host && self.guest_exit.is_none() {
            f.push("guest: no exit status from the guest (boot failure or timeout?)".to_owned());
        }
        if !self.run_ok {
            f.push(format!("{place}: exited with failure"));
        }
        for r in &self.refs {
            if r.gb_per_s.is_none() {
                f.push(format!("{}: {}", r.tool, r.detail));
            }
        }
        for t in &self.tests {
            if t.rc != "0" {
                f.push(format!(
                    "{} ({}): {}, {} failed",
                    self.label(&t.name),
                    t.name,
                    t.outcome(),
                    t.failed
                ));
            }
        }
        for (name, label) in &self.expected_tests {
            if self.end.is_some() && !self.tests.iter().any(|t| &t.name == name) {
                f.push(format!("{label} ({name}): did not run"));
            }
        }
        if require_bench {
            match &self.bench {
                Some(Ok(_)) => {}
                Some(Err(why)) => f.push(why.clone()),
                None => f.push("ferry bench did not run".to_owned()),
            }
        }
        f
    }

    fn ratio_line(&self) -> String {
        let write = self.write_rate();
        match (&self.bench, write) {
            (Some(Ok(ferry)), Some(reference)) => {
                format!("ferry/ib_write_bw = {:.2}", ferry / reference)
            }
            (Some(Err(why)), _) => format!("ferry/ib_write_bw = n/a ({why})"),
            (None, _) => "ferry/ib_write_bw = n/a (the ferry bench did not run)".to_owned(),
            (Some(Ok(_)), None) => {
                "ferry/ib_write_bw = n/a (no ib_write_bw reference rate)".to_owned()
            }
        }
    }

    /// Prints the results table to stdout; its last line is the `ferry/ib_write_bw` ratio.
    pub(super) fn print(&self, failures: &[String]) {
        let mode = if self.host {
            "host, rdma_rxe on a veth pair"
        } else {
            "guest, QEMU TCG 2 vCPUs, rdma_rxe on a veth pair"
        };
        println!();
        println!("soft-roce results ({mode}; rxe1 -> rxe0, {OP_SIZE} B ops x {ITERS})");
        if let Some(s) = &self.setup {
            println!(
                "  {:<44} rxe0 gid[{}] {}, rxe1 gid[{}] {}; kernel {}, {} cpus",
                "setup",
                kv(s, "gids")
                    .and_then(|g| g.split(',').next())
                    .unwrap_or("?"),
                kv(s, "gid0").unwrap_or("?"),
                kv(s, "gids")
                    .and_then(|g| g.split(',').nth(1))
                    .unwrap_or("?"),
                kv(s, "gid1").unwrap_or("?"),
                kv(s, "kernel").unwrap_or("?"),
                kv(s, "cpus").unwrap_or("?")
            );
        }
        for r in &self.refs {
            let rate = r
                .gb_per_s
                .map_or_else(|| "-".to_owned(), |g| format!("{g:.4} GB/s"));
            println!(
                "  {:<44} {:<14} {}",
                format!("{} (reference, {})", r.tool, r.when),
                rate,
                r.detail
            );
        }
        for (sub, rc) in &self.cmds {
            let what = if rc == "0" {
                "ok".to_owned()
            } else {
                format!("failed rc={rc} (reported, not fatal)")
            };
            println!("  {:<44} {}", format!("ferry {sub}"), what);
        }
        for t in &self.tests {
            println!(
                "  {:<44} {:<14} {} passed, {} failed, {} ignored, {}s",
                format!("test {}", self.label(&t.name)),
                t.outcome(),
                t.passed,
                t.failed,
                t.ignored,
                t.wall_s
            );
        }
        if self.tests.is_empty() {
            println!("  {:<44} none found", "test binaries");
        }
        let bench = match &self.bench {
            Some(Ok(g)) => format!(
                "{g:.4} GB/s     {} rxe packets sent during it",
                self.bench_pkts.as_deref().unwrap_or("?")
            ),
            Some(Err(why)) => format!("- ({why})"),
            None => "- (did not run)".to_owned(),
        };
        println!(
            "  {:<44} {}",
            "ferry bench --transport rdma --op write", bench
        );
        for n in &self.notes {
            println!("  note: {n}");
        }
        println!(
            "  cycle: {:.1}s {}, {:.1}s in all",
            self.run_s,
            if self.host {
                "suite"
            } else {
                "guest boot + suite"
            },
            self.total_s
        );
        if failures.is_empty() {
            println!("soft-roce: PASSED");
        } else {
            println!("soft-roce: FAILED: {}", failures.join("; "));
        }
        println!("{}", self.ratio_line());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
noise
@@ferry setup status=ok mode=guest devices=rxe0,rxe1 gids=1,1 gid0=x gid1=y
@@ferry ref ib_write_bw when=before-bench status=ok bytes=1048576 iters=128 bw_avg=26.80 unit=MB/sec wall_s=5.1
@@ferry ref ib_read_bw status=failed reason=client-rc-1-server-rc-0
@@ferry cmd doctor rc=0
@@ferry cmd topology rc=2
@@ferry test ferry_transport_rdma-0123 rc=0 passed=5 failed=0 ignored=0 wall_s=3.2
@@ferry test ferry-99 rc=101 passed=3 failed=1 ignored=0 wall_s=1.0
@@ferry ref ib_write_bw when=after-bench status=ok bytes=1048576 iters=128 bw_avg=28.80 unit=MB/sec wall_s=5.1
@@ferry bench status=ok wall_s=6.0 rxe_pkts=33000 json={\"transport\":\"rdma\",\"op\":\"write\",\"gb_per_s\":0.0253,\"ops_per_s\":24.1}
test slow ... @@ferry test slow-1 rc=124 passed=0 failed=0 ignored=0 wall_s=300.1 timeout_s=300
@@ferry end fails=1 uptime=40.1
rxe-init: guest-test.sh exit=1
";

    #[test]
    fn parses_every_result_line() {
        let r = Report::parse(LOG, false);
        assert!(r.setup.is_some());
        assert_eq!(r.refs.len(), 3);
        assert_eq!(r.refs[0].when, "before-bench");
        let w = r.write_rate().unwrap();
        assert!(
            (w - 27.80 * 1_048_576.0 / 1e9).abs() < 1e-12,
            "mean of both runs: {w}"
        );
        assert_eq!(r.refs[1].gb_per_s, None);
        assert_eq!(
            r.cmds,
            vec![
                ("doctor".into(), "0".into()),
                ("topology".into(), "2".into())
            ]
        );
        assert_eq!(r.tests.len(), 3);
        assert_eq!(r.tests[2].outcome(), "TIMED OUT after 300s");
        assert_eq!((r.tests[1].passed, r.tests[1].failed), (3, 1));
        assert_eq!(r.bench, Some(Ok(0.0253)));
        assert_eq!(r.guest_exit.as_deref(), Some("1"));
        let line = r.ratio_line();
        assert_eq!(line, format!("ferry/ib_write_bw = {:.2}", 0.0253 / w));
    }

    #[test]
    fn failures_name_what_failed() {
        let mut r = Report::parse(LOG, false);
        r.run_ok = false;
        let f = r.failures(false);
        assert!(f.iter().any(|s| s.starts_with("ib_read_bw")), "{f:?}");
        assert!(
            f.iter()
                .any(|s| s.starts_with("ferry-99 (ferry-99): FAILED rc=101")),
            "{f:?}"
        );
        assert!(
            !f.iter().any(|s| s.contains("ferry_transport_rdma")),
            "{f:?}"
        );
    }

    #[test]
    fn a_failed_or_missing_bench_is_not_a_number() {
        let failed = LOG.replace(
            "@@ferry bench status=ok wall_s=6.0 rxe_pkts=33000 json={\"transport\":\"rdma\",\"op\":\"write\",\"gb_per_s\":0.0253,\"ops_per_s\":24.1}",
            "@@ferry bench status=failed reason=serve-printed-no-address",
        );
        let r = Report::parse(&failed, false);
        assert_eq!(
            r.ratio_line(),
            "ferry/ib_write_bw = n/a (ferry bench failed: serve-printed-no-address)"
        );
        assert!(
            r.failures(true)
                .iter()
                .any(|s| s.contains("serve-printed-no-address"))
        );
        assert!(!r.failures(false).iter().any(|s| s.contains("bench")));
        let missing: String = LOG
            .lines()
            .filter(|l| !l.contains("bench"))
            .map(|l| format!("{l}\n"))
            .collect();
        let r = Report::parse(&missing, false);
        assert!(r.ratio_line().starts_with("ferry/ib_write_bw = n/a"));
        assert!(r.failures(true).iter().any(|s| s.contains("did not run")));
    }

    #[test]
    fn an_empty_log_is_a_failed_guest() {
        let r = Report::parse("", false);
        let f = r.failures(false);
        assert!(f.iter().any(|s| s.contains("no exit status")), "{f:?}");
        assert!(f.iter().any(|s| s.contains("setup")), "{f:?}");
    }

    #[test]
    fn a_bench_that_did_not_cross_rxe_has_no_rate() {
        let over_tcp = LOG.replace("rxe_pkts=33000", "rxe_pkts=1200");
        let r = Report::parse(&over_tcp, false);
        assert!(
            matches!(&r.bench, Some(Err(why)) if why.contains("not over rxe")),
            "{:?}",
            r.bench
        );
        assert!(
            r.ratio_line()
                .starts_with("ferry/ib_write_bw = n/a (ferry bench sent 1200")
        );
        assert_eq!(check_rxe_packets(8192.0, Some("2")), Ok(()));
        assert!(check_rxe_packets(8193.0, Some("2")).is_err());
        assert_eq!(check_rxe_packets(8193.0, Some("unknown")), Ok(()));
    }

    #[test]
    fn perftest_units() {
        assert_eq!(perftest_gb_per_s(1000.0, "MB/sec"), Some(1.048576));
        assert_eq!(perftest_gb_per_s(8.0, "Gb/sec"), Some(1.0));
        assert_eq!(perftest_gb_per_s(8.0, "furlongs"), None);
    }
}

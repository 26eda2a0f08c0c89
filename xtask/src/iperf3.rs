//! The iperf3 reference the network benches share: one-off servers, clients run against them,
//! and their `-J` reports read.

use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::util::json_num;

/// Starts a one-off server, `iperf3 -s -1 -p PORT`, its output discarded: it serves one client
/// and exits. The caller gives it time to listen before a client connects (a probe connection
/// would not do: the server would take it as its one client).
pub(crate) fn server(port: u16) -> Result<Child> {
    Command::new("iperf3")
        .args(["-s", "-1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting iperf3 -s")
}

/// Runs one `iperf3 -c 127.0.0.1 -p PORT -l 1M -n BYTES -J EXTRA` client per port in `ports`, all
/// at once, each sending `bytes`, against servers already listening there. Returns the bytes the
/// servers received in all and the longest receiver's seconds; fails with the client's output when
/// one exits non-zero.
pub(crate) fn clients(ports: &[u16], bytes: u64, extra: &[&str]) -> Result<(f64, f64)> {
    let clients: Vec<_> = ports
        .iter()
        .map(|p| {
            Command::new("iperf3")
                .args(["-c", "127.0.0.1", "-p", &p.to_string(), "-l", "1M", "-J"])
                .args(["-n", &bytes.to_string()])
                .args(extra)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .context("starting iperf3 -c")
        })
        .collect::<Result<_>>()?;
    let mut received = 0.0;
    let mut slowest: f64 = 0.0;
    for c in clients {
        let out = c.wait_with_output().context("waiting for iperf3 -c")?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!(
                "iperf3 -c failed: {text} {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let (b, s) = received_in(&text)?;
        received += b;
        slowest = slowest.max(s);
    }
    Ok((received, slowest))
}

/// The bytes received and the receiver's seconds in an iperf3 `-J` client report: its
/// `end.sum_received` (the last `"sum_received"` of the text; a report has one).
pub(crate) fn received_in(report: &str) -> Result<(f64, f64)> {
    let at = report
        .rfind("\"sum_received\"")
        .context("iperf3 JSON without sum_received")?;
    let bytes = json_num(report, "bytes", at).context("iperf3 bytes")?;
    let seconds = json_num(report, "seconds", at).context("iperf3 seconds")?;
    Ok((bytes, seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_receivers_sum() {
        let t = r#"{"end":{"sum_sent":{"seconds":2,"bytes":5},"sum_received":{"seconds": 2.5,"bytes":10}}}"#;
        assert_eq!(received_in(t).unwrap(), (10.0, 2.5));
        assert!(received_in(r#"{"end":{}}"#).is_err());
    }
}

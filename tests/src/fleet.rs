//! A fleet of network namespaces joined by one bridge: hosts that reach each other directly
//! (not only the test's own namespace), each link optionally shaped by TBF in both directions.
//! The same layout as `shared/tools/netns/fleet.sh` and `cargo xtask bench broadcast`.
//!
//! Addresses are 198.19.H.(i+1)/24 (RFC 2544's benchmarking range), H from the process id, so
//! two test processes never share a subnet; they exist only inside the fleet's namespaces.
//! Dropping the value deletes every namespace of the fleet.

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result};

use crate::netns::ip;
use crate::{NETNS, require_or_skip};

/// Hosts `0..=n` in namespaces joined by a bridge (see the module docs).
#[derive(Debug)]
pub struct Fleet {
    prefix: String,
    net: u8,
    hosts: usize,
}

impl Fleet {
    /// `hosts` hosts, each link shaped to `rate` (tc units, `100mbit`) if given. `Ok(None)` (the
    /// reason printed) where namespaces cannot be made; with `FERRY_REQUIRE_NETNS=1` that fails
    /// the test instead.
    #[track_caller]
    pub fn create(hosts: usize, rate: Option<&str>) -> Result<Option<Self>> {
        match Self::make(hosts, rate) {
            Ok(f) => Ok(Some(f)),
            Err(e) => {
                require_or_skip(
                    NETNS,
                    format!("cannot make a fleet of namespaces here: {e:#}"),
                );
                Ok(None)
            }
        }
    }

    /// [`create`](Self::create) for tools that need the fleet (a bench): an error, with the
    /// failing `ip` or `tc` command, where namespaces cannot be made.
    pub fn make(hosts: usize, rate: Option<&str>) -> Result<Self> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        Self {
            prefix: format!("ffl{:x}{n}", pid & 0xf_ffff),
            net: ((pid.wrapping_mul(7).wrapping_add(n)) % 250) as u8,
            hosts: 0,
        }
        .build(hosts, rate)
    }

    fn build(mut self, hosts: usize, rate: Option<&str>) -> Result<Self> {
        let hub = format!("{}-hub", self.prefix);
        let _ = ip(&["netns", "del", &hub]);
        ip(&["netns", "add", &hub])?;
        self.hosts = 0;
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        for i in 0..hosts {
            let ns = self.name(i);
            let _ = ip(&["netns", "del", &ns]);
            ip(&["netns", "add", &ns])?;
            self.hosts = i + 1;
            let (h, p) = (format!("h{i}"), format!("p{i}"));
            ip(&[
                "link", "add", &h, "netns", &ns, "type", "veth", "peer", "name", &p, "netns", &hub,
            ])?;
            ip(&["-n", &hub, "link", "set", &p, "master", "br0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", self.addr(i)),
                "dev",
                &h,
            ])?;
            ip(&["-n", &ns, "link", "set", &h, "up"])?;
            if let Some(rate) = rate {
                for (space, dev) in [(&ns, &h), (&hub, &p)] {
                    ip(&[
                        "netns", "exec", space, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                        "rate", rate, "burst", "256kb", "latency", "50ms",
                    ])?;
                }
            }
        }
        Ok(self)
    }

    /// Shapes host `i`'s link (both ways) to `rate` instead (a straggler); the fleet must have
    /// been made with a rate.
    pub fn reshape(&self, i: usize, rate: &str) -> Result<()> {
        let hub = format!("{}-hub", self.prefix);
        let (ns, h, p) = (self.name(i), format!("h{i}"), format!("p{i}"));
        for (space, dev) in [(&ns, &h), (&hub, &p)] {
            ip(&[
                "netns", "exec", space, "tc", "qdisc", "change", "dev", dev, "root", "tbf", "rate",
                rate, "burst", "256kb", "latency", "50ms",
            ])?;
        }
        Ok(())
    }

    /// Host `i`'s namespace.
    pub fn name(&self, i: usize) -> String {
        format!("{}-{i}", self.prefix)
    }

    /// Host `i`'s address.
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(198, 19, self.net, (i + 1) as u8)
    }

    /// Hosts in the fleet.
    pub fn hosts(&self) -> usize {
        self.hosts
    }

    /// Bytes host `i` has sent on its link to the bridge.
    pub fn tx_bytes(&self, i: usize) -> Result<u64> {
        let out = self
            .command(i, "cat")
            .arg(format!("/sys/class/net/h{i}/statistics/tx_bytes"))
            .output()
            .with_context(|| format!("reading host {i}'s tx_bytes"))?;
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .with_context(|| format!("host {i}'s tx_bytes"))
    }

    /// A command running `program` inside host `i`.
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name(i)]).arg(program);
        c
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for i in 0..self.hosts {
            let _ = ip(&["netns", "del", &self.name(i)]);
        }
        let _ = ip(&["netns", "del", &format!("{}-hub", self.prefix)]);
    }
}

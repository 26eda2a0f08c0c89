//! A network namespace joined to this one by a veth pair, for tests that need a real (non-
//! loopback) network path on one machine: 1500-byte MTU segments, a peer address that is not
//! loopback (so the data planes take their network settings: SEND_ZC, no splice, no pinning,
//! the half-window hold rule), and a link that can be cut.
//!
//! Addresses come from 198.18.0.0/15 (RFC 2544, reserved for benchmarking), one /30 per pair,
//! so they never collide with a real network. Dropping the value deletes the namespace, which
//! destroys both ends of the pair.

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result, bail};

use crate::{NETNS, require_or_skip};

/// A network namespace with a veth link to this one (see the module docs).
#[derive(Debug)]
pub struct Netns {
    /// The namespace's name (for `ip netns exec`).
    pub name: String,
    /// This side's address on the link.
    pub host: Ipv4Addr,
    /// The namespace side's address.
    pub peer: Ipv4Addr,
    host_link: String,
}

/// Runs `ip ARGS`; its stderr is the error when it fails.
pub(crate) fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .with_context(|| format!("running ip {}", args.join(" ")))?;
    if !out.status.success() {
        bail!(
            "ip {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Netns {
    /// A fresh namespace with a veth link to this one, both ends up. `Ok(None)` (with the reason
    /// printed: `ip`'s own error) where namespaces cannot be made here: not root, no `ip`, or a
    /// kernel without them; with `FERRY_REQUIRE_NETNS=1` that fails the test instead
    /// ([`require_or_skip`]).
    #[track_caller]
    pub fn create() -> Result<Option<Self>> {
        match Self::try_create() {
            Ok(ns) => Ok(Some(ns)),
            Err(e) => {
                require_or_skip(
                    NETNS,
                    format!("cannot make a network namespace here: {e:#}"),
                );
                Ok(None)
            }
        }
    }

    fn try_create() -> Result<Self> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        // One /30 per (process, pair): 2^15 of them in 198.18.0.0/15.
        let slot = (pid.wrapping_mul(64).wrapping_add(n)) % (1 << 15);
        let base = u32::from(Ipv4Addr::new(198, 18, 0, 0)) + slot * 4;
        let name = format!("ferry-test-{pid}-{n}");
        // Interface names are at most 15 bytes.
        let tag = format!("{:x}{n}", pid & 0xf_ffff);
        let (host_link, ns_link) = (format!("fh{tag}"), format!("fn{tag}"));
        // A namespace left by a killed earlier run of the same pid would block the name.
        let _ = ip(&["netns", "del", &name]);
        ip(&["netns", "add", &name])?;
        let ns = Self {
            name,
            host: Ipv4Addr::from(base + 1),
            peer: Ipv4Addr::from(base + 2),
            host_link,
        };
        let cidr = |a: Ipv4Addr| format!("{a}/30");
        ip(&[
            "link",
            "add",
            &ns.host_link,
            "type",
            "veth",
            "peer",
            "name",
            &ns_link,
            "netns",
            &ns.name,
        ])?;
        ip(&["addr", "add", &cidr(ns.host), "dev", &ns.host_link])?;
        ip(&["link", "set", &ns.host_link, "up"])?;
        ns.exec_ip(&["addr", "add", &cidr(ns.peer), "dev", &ns_link])?;
        ns.exec_ip(&["link", "set", &ns_link, "up"])?;
        ns.exec_ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Runs `ip ARGS` inside the namespace.
    pub fn exec_ip(&self, args: &[&str]) -> Result<()> {
        let mut all = vec!["netns", "exec", &self.name, "ip"];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// Takes this side's end of the link down (`false`) or up again (`true`): packets in either
    /// direction are dropped while it is down, as on a cut cable.
    pub fn set_link(&self, up: bool) -> Result<()> {
        ip(&[
            "link",
            "set",
            &self.host_link,
            if up { "up" } else { "down" },
        ])
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("could not delete network namespace {}: {e:#}", self.name);
        }
    }
}

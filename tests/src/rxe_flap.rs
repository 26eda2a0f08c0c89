//! A second soft-RoCE pair on a veth link of its own, for tests that take a rail's link down and
//! up (a port flap) without touching the suite's own pair (`xtask/soft-roce/guest/
//! setup-rxe-pair.sh`: rxe0/rxe1 on va/vb).
//!
//! `rxeflap0` on veth `vfa` (10.99.1.1) and `rxeflap1` on `vfb` (10.99.1.2), routed like the
//! suite's pair (policy routing through table 100, so that their traffic crosses the veth link
//! instead of `lo`): taking `vfb` down takes both ports of this pair down, and only them. Needs
//! root, `ip` and `rdma`; `cargo xtask soft-roce` sets [`FLAP`] where it may. Removed on drop.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};

/// Set by `cargo xtask soft-roce`: this machine may create [`RxeFlapPair`] and flap its link.
pub const FLAP: &str = "FERRY_RDMA_TEST_FLAP";

/// The pair's verbs devices: index 0 on `vfa`, 1 on `vfb`.
pub const DEVICES: [&str; 2] = ["rxeflap0", "rxeflap1"];
const NETDEVS: [&str; 2] = ["vfa", "vfb"];
const ADDRS: [&str; 2] = ["10.99.1.1", "10.99.1.2"];

/// The pair while it exists; see the module docs.
#[derive(Debug)]
pub struct RxeFlapPair {
    /// The IPv4-mapped RoCE v2 GID index of each of [`DEVICES`].
    pub gids: [u32; 2],
}

fn cmd(prog: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(prog)
        .args(args)
        .output()
        .with_context(|| format!("running {prog} {}", args.join(" ")))?;
    ensure!(
        out.status.success(),
        "{prog} {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Waits (polling every 20 ms) until `ready` gives a value, at most `limit`.
pub fn wait_for<T>(what: &str, limit: Duration, mut ready: impl FnMut() -> Option<T>) -> Result<T> {
    let t0 = Instant::now();
    loop {
        if let Some(v) = ready() {
            return Ok(v);
        }
        ensure!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The port state sysfs shows for port 1 of `dev` (`4: ACTIVE`, `1: DOWN`).
pub fn port_state(dev: &str) -> String {
    std::fs::read_to_string(format!("/sys/class/infiniband/{dev}/ports/1/state"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// The index of `dev`'s IPv4-mapped RoCE v2 GID, once it is there.
fn ipv4_gid(dev: &str) -> Option<u32> {
    let dir = std::fs::read_dir(format!("/sys/class/infiniband/{dev}/ports/1/gids")).ok()?;
    dir.filter_map(Result::ok).find_map(|e| {
        let gid = std::fs::read_to_string(e.path()).ok()?;
        gid.starts_with("0000:0000:0000:0000:0000:ffff:")
            .then(|| e.file_name().to_str()?.parse().ok())?
    })
}

impl RxeFlapPair {
    /// The pair, where [`FLAP`] allows it. Without [`FLAP`]: `None`, after
    /// [`require_unless_allowed`](crate::require_unless_allowed) on
    /// [`RDMA`](crate::RDMA) (an `#[ignore]`d hardware test run without it fails unless
    /// `FERRY_REQUIRE_RDMA=0`).
    pub fn create_if_allowed() -> Result<Option<Self>> {
        if std::env::var_os(FLAP).is_none() {
            crate::require_unless_allowed(
                crate::RDMA,
                format!(
                    "{FLAP} is unset: this test creates an rxe pair on a veth link of its own \
                     and takes the link down (root, ip, rdma; `cargo xtask soft-roce` sets it)"
                ),
            );
            return Ok(None);
        }
        Self::create().map(Some)
    }

    fn create() -> Result<Self> {
        let [a, b] = NETDEVS;
        let [ia, ib] = ADDRS;
        // Leftovers of an interrupted run go first (nothing of this process holds them).
        cmd("sh", &["-c", &removal_script()])?;
        cmd("ip", &["link", "add", a, "type", "veth", "peer", "name", b])?;
        for (d, addr) in [(a, ia), (b, ib)] {
            for (knob, v) in [
                (format!("/proc/sys/net/ipv6/conf/{d}/disable_ipv6"), "1"),
                (format!("/proc/sys/net/ipv4/conf/{d}/rp_filter"), "0"),
                (format!("/proc/sys/net/ipv4/conf/{d}/accept_local"), "1"),
            ] {
                std::fs::write(&knob, v).with_context(|| format!("writing {knob}"))?;
            }
            cmd("ip", &["link", "set", d, "up", "mtu", "4500"])?;
            cmd("ip", &["addr", "add", &format!("{addr}/24"), "dev", d])?;
        }
        let (to_b, to_a) = (format!("{ib}/32"), format!("{ia}/32"));
        cmd(
            "ip",
            &["route", "add", &to_b, "dev", a, "src", ia, "table", "100"],
        )?;
        cmd(
            "ip",
            &["route", "add", &to_a, "dev", b, "src", ib, "table", "100"],
        )?;
        cmd(
            "ip",
            &["rule", "add", "pref", "12", "iif", a, "lookup", "local"],
        )?;
        cmd(
            "ip",
            &["rule", "add", "pref", "13", "iif", b, "lookup", "local"],
        )?;
        let mac = |d: &str| {
            std::fs::read_to_string(format!("/sys/class/net/{d}/address"))
                .map(|s| s.trim().to_owned())
                .with_context(|| format!("MAC of {d}"))
        };
        let (ma, mb) = (mac(a)?, mac(b)?);
        cmd(
            "ip",
            &[
                "neigh",
                "replace",
                ib,
                "lladdr",
                &mb,
                "dev",
                a,
                "nud",
                "permanent",
            ],
        )?;
        cmd(
            "ip",
            &[
                "neigh",
                "replace",
                ia,
                "lladdr",
                &ma,
                "dev",
                b,
                "nud",
                "permanent",
            ],
        )?;
        for (dev, net) in DEVICES.iter().zip(NETDEVS) {
            cmd("rdma", &["link", "add", dev, "type", "rxe", "netdev", net])?;
        }
        let mut gids = [0; 2];
        for (k, dev) in DEVICES.iter().enumerate() {
            gids[k] = wait_for(
                &format!("the IPv4-mapped GID of {dev}"),
                Duration::from_secs(20),
                || ipv4_gid(dev),
            )?;
            wait_for(&format!("{dev} ACTIVE"), Duration::from_secs(20), || {
                port_state(dev).contains("ACTIVE").then_some(())
            })?;
        }
        eprintln!("flap pair: {DEVICES:?} on {NETDEVS:?}, GID indexes {gids:?}");
        Ok(Self { gids })
    }

    /// Takes the pair's link down (`ip link set vfb down`: both ports go DOWN) or up again.
    /// Setting a device down deletes the routes through it, so coming up puts `vfb`'s route
    /// in table 100 back (else its traffic to 10.99.1.1 would be delivered through `lo`).
    pub fn set_link(&self, up: bool) -> Result<()> {
        let [_, b] = NETDEVS;
        let [ia, ib] = ADDRS;
        cmd("ip", &["link", "set", b, if up { "up" } else { "down" }])?;
        if up {
            let to_a = format!("{ia}/32");
            cmd(
                "ip",
                &[
                    "route", "replace", &to_a, "dev", b, "src", ib, "table", "100",
                ],
            )?;
        }
        Ok(())
    }
}

/// The commands that remove the pair (rules by their full selectors, so that rules of the host's
/// own are left alone); each may fail (already gone).
fn removal_script() -> String {
    let [a, b] = NETDEVS;
    let mut sh = String::new();
    for dev in DEVICES {
        sh.push_str(&format!("rdma link delete {dev} 2>/dev/null; "));
    }
    sh.push_str(&format!("ip link del {a} 2>/dev/null; "));
    sh.push_str(&format!(
        "ip rule del pref 12 iif {a} lookup local 2>/dev/null; "
    ));
    sh.push_str(&format!(
        "ip rule del pref 13 iif {b} lookup local 2>/dev/null; "
    ));
    for addr in ADDRS {
        sh.push_str(&format!("ip route del {addr}/32 table 100 2>/dev/null; "));
    }
    sh.push_str("true");
    sh
}

impl Drop for RxeFlapPair {
    /// Removes the pair. rxe cannot disassociate open contexts, so deleting a device waits (in
    /// the kernel, unkillably) until every context on it is closed, and an engine's tasks may
    /// hold its transport until the runtime ends. So the removal runs in a process of its own:
    /// waited for up to 30 s (it is done at once when nothing holds the devices), then left to
    /// finish when this process exits and its contexts close.
    fn drop(&mut self) {
        let child = Command::new("setsid")
            .args(["sh", "-c", &removal_script()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let Ok(mut child) = child else {
            eprintln!("flap pair: could not start its removal");
            return;
        };
        let done = wait_for("removing the flap pair", Duration::from_secs(30), || {
            child.try_wait().ok().flatten()
        });
        if done.is_err() {
            eprintln!("flap pair: its devices are still open; removed when this process exits");
        }
    }
}

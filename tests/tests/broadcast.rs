//! Weight broadcast across processes and network namespaces: this test binary re-runs itself
//! as a source or a receiver (`child_broadcast`, active only with `FERRY_TEST_CHILD` set),
//! each in its own host of a [`Fleet`]. Every receiver's bytes are compared with the payload.
//! The etcd cases start a real etcd (Debian's `etcd-server`) on a loopback port.

use std::io::{BufRead, BufReader, Lines};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use ferry::DataPlane;
use ferry_broadcast::{
    Embedded, Manifest, Receiver, ReceiverOptions, Source, SourceOptions, TestHooks,
};
use ferry_tests::Fleet;

const CHUNK: u64 = 256 << 10;

fn payload(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

fn env(k: &str) -> Option<String> {
    std::env::var(k).ok()
}

// ---------------------------------------------------------------- the child side

/// Child: `FERRY_TEST_CHILD=bcast-source` publishes `FERRY_BC_FILE` on `FERRY_BC_LISTEN`,
/// prints `LISTEN addr` and serves until stdin closes; `bcast-receiver` pulls from
/// `FERRY_BC_FROM` into `FERRY_BC_INTO` (corrupting chunk `FERRY_BC_CORRUPT` after verifying it,
/// if set), prints `JOINED`, then `SUMMARY {json}` or `ERROR message`, and lingers.
#[test]
fn child_broadcast() -> Result<()> {
    let role = env("FERRY_TEST_CHILD").unwrap_or_default();
    if !role.starts_with("bcast-") {
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        if role == "bcast-source" {
            let file = PathBuf::from(env("FERRY_BC_FILE").context("FERRY_BC_FILE")?);
            let m = Manifest::build("t", 1, std::slice::from_ref(&file), CHUNK)?;
            let src = Source::start(
                m,
                &[file],
                SourceOptions {
                    listen: env("FERRY_BC_LISTEN").context("FERRY_BC_LISTEN")?.parse()?,
                    data_plane: DataPlane::Tcp,
                    ..Default::default()
                },
                None,
            )
            .await?;
            println!("LISTEN {}", src.ctl_addr());
            tokio::task::spawn_blocking(|| {
                let mut s = String::new();
                while std::io::stdin().read_line(&mut s).is_ok_and(|n| n > 0) {}
            })
            .await?;
            return Ok(());
        }
        let from = env("FERRY_BC_FROM").context("FERRY_BC_FROM")?.parse()?;
        let opts = ReceiverOptions {
            data_plane: DataPlane::Tcp,
            stall_after: Duration::from_secs(2),
            heartbeat: Duration::from_millis(200),
            // The plans these tests reason about: four stripes, fixed by join order (no
            // receiver is taken for a straggler because a loaded machine slowed it).
            stripes: 4,
            straggler: 0.0,
            ..Default::default()
        };
        let mut r = match Receiver::join(Arc::new(Embedded::new(from)), Some("t"), opts).await {
            Ok(r) => r,
            Err(e) => {
                println!("ERROR {e}");
                return Ok(());
            }
        };
        r.set_test_hooks(TestHooks {
            corrupt_after_verify: env("FERRY_BC_CORRUPT").and_then(|c| c.parse().ok()),
            ..Default::default()
        });
        println!("JOINED {}", r.member().id);
        match r.run().await {
            Ok(s) => {
                r.write_to(Path::new(&env("FERRY_BC_INTO").context("FERRY_BC_INTO")?))?;
                println!("SUMMARY {}", serde_json::to_string(&s)?);
                r.linger(Duration::from_secs(20)).await;
            }
            Err(e) => println!("ERROR {e}"),
        }
        Ok(())
    })
}

// ---------------------------------------------------------------- the parent side

struct Proc {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Proc {
    fn spawn(fleet: &Fleet, host: usize, role: &str, envs: &[(&str, String)]) -> Result<Self> {
        let mut cmd = fleet.command(host, std::env::current_exe()?);
        cmd.args([
            "--exact",
            "child_broadcast",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("FERRY_TEST_CHILD", role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn()?;
        let lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
        Ok(Self { child, lines })
    }

    /// The rest of the first line that contains one of `keys`, with the key.
    fn expect(&mut self, keys: &[&str]) -> Result<(String, String)> {
        for line in self.lines.by_ref() {
            let line = line?;
            for k in keys {
                if let Some((_, rest)) = line.split_once(k) {
                    return Ok((k.to_string(), rest.trim().to_owned()));
                }
            }
        }
        bail!("child exited before printing any of {keys:?}")
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

struct Setup {
    fleet: Fleet,
    dir: tempfile::TempDir,
    file: PathBuf,
    want: Vec<u8>,
}

fn setup(hosts: usize, rate: Option<&str>, len: usize) -> Result<Option<Setup>> {
    let Some(fleet) = Fleet::create(hosts, rate)? else {
        return Ok(None);
    };
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("weights.bin");
    let want = payload(len, 0x5eed);
    std::fs::write(&file, &want)?;
    Ok(Some(Setup {
        fleet,
        dir,
        file,
        want,
    }))
}

impl Setup {
    fn source(&self) -> Result<(Proc, String)> {
        let listen = format!("{}:7500", self.fleet.addr(0));
        let mut p = Proc::spawn(
            &self.fleet,
            0,
            "bcast-source",
            &[
                ("FERRY_BC_FILE", self.file.display().to_string()),
                ("FERRY_BC_LISTEN", listen.clone()),
            ],
        )?;
        p.expect(&["LISTEN "])?;
        Ok((p, listen))
    }

    fn receiver(&self, host: usize, from: &str, corrupt: Option<usize>) -> Result<Proc> {
        let mut envs = vec![
            ("FERRY_BC_FROM", from.to_owned()),
            ("FERRY_BC_INTO", self.out(host).display().to_string()),
        ];
        if let Some(c) = corrupt {
            envs.push(("FERRY_BC_CORRUPT", c.to_string()));
        }
        let mut p = Proc::spawn(&self.fleet, host, "bcast-receiver", &envs)?;
        let (k, rest) = p.expect(&["JOINED ", "ERROR "])?;
        if k == "ERROR " {
            bail!("receiver {host} could not join: {rest}");
        }
        Ok(p)
    }

    fn out(&self, host: usize) -> PathBuf {
        self.dir.path().join(format!("out-{host}"))
    }

    /// Waits for the receiver's summary and checks its file byte for byte.
    fn finished(&self, p: &mut Proc, host: usize) -> Result<serde_json::Value> {
        let (k, rest) = p.expect(&["SUMMARY ", "ERROR "])?;
        if k == "ERROR " {
            bail!("receiver {host} failed: {rest}");
        }
        let got = std::fs::read(self.out(host).join("weights.bin"))?;
        assert!(got == self.want, "receiver {host}: bytes differ");
        Ok(serde_json::from_str(&rest)?)
    }
}

fn n(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_default()
}

#[test]
fn broadcast_across_namespaces_verifies_relays_catches_corruption_and_a_late_joiner() -> Result<()>
{
    let Some(s) = setup(5, Some("400mbit"), 24 << 20)? else {
        return Ok(());
    };
    let (_src, from) = s.source()?;
    // Joined in order, four stripes: host 1 is the root of stripe 0 (chunks 0, 4, 8, ..), from
    // which hosts 2 and 3 fetch it; host 1 corrupts chunk 4 after verifying it.
    let mut r1 = s.receiver(1, &from, Some(4))?;
    let mut r2 = s.receiver(2, &from, None)?;
    let mut r3 = s.receiver(3, &from, None)?;
    std::thread::sleep(Duration::from_millis(200));
    // A late joiner, while the others are under way.
    let mut r4 = s.receiver(4, &from, None)?;
    let s1 = s.finished(&mut r1, 1)?;
    let s2 = s.finished(&mut r2, 2)?;
    let s3 = s.finished(&mut r3, 3)?;
    let s4 = s.finished(&mut r4, 4)?;
    let total = s.want.len() as u64;
    // The corrupting relay found its own corruption at rest, its child the mismatch as it
    // fetched the chunk (not at rest), and reported and gave up the relay.
    assert!(n(&s1, "at_rest_mismatches") >= 1, "{s1}");
    assert!(n(&s2, "fetch_mismatches") >= 1, "{s2}");
    assert_eq!(
        s2["corrupt_holders"].as_array().map(Vec::len),
        Some(1),
        "{s2}"
    );
    // Striped: every receiver took part of the payload from relays, and the source sent each
    // stripe to its root. Here more than once: the receivers join one after another during a
    // pull of about a second, and the first stands in as the root of the stripes whose own
    // root has not joined yet (taking them from the source), and the rest of stripe 0 goes
    // again to its new root once host 1 is given up. The shaped-namespace bench, where all
    // start at once, measures the egress of a fleet (`docs/broadcast.md`).
    for (h, v) in [(1, &s1), (2, &s2), (3, &s3), (4, &s4)] {
        assert!(n(v, "bytes_from_relays") > 0, "host {h}: {v}");
    }
    let egress: u64 = [&s1, &s2, &s3, &s4]
        .iter()
        .map(|v| n(v, "bytes_from_source"))
        .sum();
    assert!(
        egress <= 2 * total + 4 * CHUNK,
        "the source sent {egress} for {total}: {s1}\n{s2}\n{s3}\n{s4}"
    );
    Ok(())
}

#[test]
fn a_killed_relay_is_routed_around_and_nothing_verified_is_fetched_twice() -> Result<()> {
    // Shaped so that the pull takes about three seconds.
    let Some(s) = setup(4, Some("100mbit"), 32 << 20)? else {
        return Ok(());
    };
    let (_src, from) = s.source()?;
    let mut r1 = s.receiver(1, &from, None)?;
    let mut r2 = s.receiver(2, &from, None)?;
    let mut r3 = s.receiver(3, &from, None)?;
    std::thread::sleep(Duration::from_millis(1200));
    r2.kill();
    let s1 = s.finished(&mut r1, 1)?;
    let s3 = s.finished(&mut r3, 3)?;
    // Striped, both fetched a stripe from host 2 (the root of stripe 1) and gave it up.
    assert!(n(&s1, "parents_given_up") >= 1, "{s1}");
    assert!(n(&s3, "parents_given_up") >= 1, "{s3}");
    // Every chunk verified once: what came in is the payload, nothing more.
    let total = s.want.len() as u64;
    for (h, v) in [(1, &s1), (3, &s3)] {
        let got = n(v, "bytes_from_source") + n(v, "bytes_from_relays");
        assert!(
            got <= total,
            "host {h} fetched {got} bytes for {total}: {v}"
        );
    }
    Ok(())
}

#[test]
fn a_source_restarted_mid_broadcast_is_refused_with_a_clear_message() -> Result<()> {
    let Some(s) = setup(2, Some("100mbit"), 32 << 20)? else {
        return Ok(());
    };
    let (mut src, from) = s.source()?;
    let mut r1 = s.receiver(1, &from, None)?;
    std::thread::sleep(Duration::from_millis(800));
    src.kill();
    let (_again, _) = s.source()?;
    let t0 = Instant::now();
    let (k, rest) = r1.expect(&["SUMMARY ", "ERROR "])?;
    assert_eq!(
        k, "ERROR ",
        "the pull must not complete across two epochs: {rest}"
    );
    assert!(
        rest.contains("restarted") && rest.contains("refusing to mix"),
        "{rest}"
    );
    assert!(t0.elapsed() < Duration::from_secs(20));
    Ok(())
}

// ---------------------------------------------------------------- etcd

#[cfg(feature = "etcd")]
mod etcd {
    use super::*;
    use ferry_broadcast::{Discovery, Etcd, Member, Role};
    use ferry_tests::{ETCD, require_or_skip};

    /// A real etcd on a loopback port with its data in a temporary directory.
    struct EtcdServer {
        child: Child,
        url: String,
        _dir: tempfile::TempDir,
    }

    impl Drop for EtcdServer {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    fn free_port() -> Result<u16> {
        Ok(std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port())
    }

    fn start_etcd() -> Result<Option<EtcdServer>> {
        let bin = ["etcd", "/usr/bin/etcd"].into_iter().find(|b| {
            std::process::Command::new(b)
                .arg("--version")
                .output()
                .is_ok()
        });
        let Some(bin) = bin else {
            require_or_skip(ETCD, "no etcd binary (Debian: apt-get install etcd-server)");
            return Ok(None);
        };
        let dir = tempfile::tempdir()?;
        let (client, peer) = (free_port()?, free_port()?);
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = std::process::Command::new(bin)
            .arg("--data-dir")
            .arg(dir.path())
            .args(["--name", "ferry-test"])
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("ferry-test={peer_url}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting etcd")?;
        let server = EtcdServer {
            child,
            url,
            _dir: dir,
        };
        let t0 = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", client)).is_err() {
            if t0.elapsed() > Duration::from_secs(20) {
                bail!("etcd did not listen within 20 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(Some(server))
    }

    fn member(id: &str) -> Member {
        Member {
            id: id.into(),
            epoch: 1,
            source_epoch: 9,
            data_addr: "127.0.0.1:1".into(),
            ctl_addr: "127.0.0.1:2".into(),
            role: Role::Receiver,
            progress: 0,
            done: false,
            order: 0,
            version: 0,
            rate: 0,
            number: None,
            identity: None,
        }
    }

    /// Child: registers `FERRY_BC_ID` in the etcd at `FERRY_BC_ETCD` with a 2 s lease, prints
    /// `REGISTERED`, then waits to be killed.
    #[test]
    fn child_etcd_member() -> Result<()> {
        if env("FERRY_TEST_CHILD").as_deref() != Some("etcd-member") {
            return Ok(());
        }
        let rt = tokio::runtime::Runtime::new()?;
        rt.block_on(async {
            let d = Etcd::connect(
                &env("FERRY_BC_ETCD").context("url")?,
                "t",
                Duration::from_secs(2),
            )
            .await?;
            d.register(&member(&env("FERRY_BC_ID").context("id")?))
                .await?;
            println!("REGISTERED");
            tokio::time::sleep(Duration::from_secs(120)).await;
            Ok(())
        })
    }

    async fn wait_for(d: &Etcd, what: &str, f: impl Fn(&[Member]) -> bool) -> Result<()> {
        let t0 = Instant::now();
        loop {
            if f(&d.members().await?) {
                return Ok(());
            }
            if t0.elapsed() > Duration::from_secs(15) {
                bail!("etcd: {what} did not happen within 15 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Members register under leases and see each other through the watch; a member killed
    /// without a word disappears when its lease expires, and the plan stops naming it.
    #[test]
    fn etcd_members_watch_each_other_and_a_killed_members_lease_expires() -> Result<()> {
        let Some(etcd) = start_etcd()? else {
            return Ok(());
        };
        let mut child = std::process::Command::new(std::env::current_exe()?)
            .args([
                "--exact",
                "etcd::child_etcd_member",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("FERRY_TEST_CHILD", "etcd-member")
            .env("FERRY_BC_ETCD", &etcd.url)
            .env("FERRY_BC_ID", "doomed")
            .stdout(Stdio::piped())
            .spawn()?;
        let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
        loop {
            let line = lines.next().context("member child exited")??;
            if line.contains("REGISTERED") {
                break;
            }
        }
        let rt = tokio::runtime::Runtime::new()?;
        let res = rt.block_on(async {
            let d = Etcd::connect(&etcd.url, "t", Duration::from_secs(2)).await?;
            let me = member("me");
            d.register(&me).await?;
            wait_for(&d, "both listed", |m| m.len() == 2).await?;
            let ms = d.members().await?;
            // Join order: the child registered first, and claimed the first number.
            assert_eq!(ms[0].id, "doomed");
            assert_eq!(ms[0].number, Some(0));
            assert_eq!(ms[1].number, Some(1));
            let plan =
                ferry_broadcast::plan::stripe_holders(&ms, "me", 9, 0, &Default::default(), 1, 0.5);
            assert_eq!(plan.len(), 1);
            assert_eq!(plan[0].map(|m| m.id.as_str()), Some("doomed"));
            let _ = child.kill();
            let _ = child.wait();
            let t0 = Instant::now();
            wait_for(&d, "the killed member's lease expiry", |m| {
                m.iter().all(|x| x.id != "doomed")
            })
            .await?;
            // Our own lease is kept alive meanwhile.
            let ms = d.members().await?;
            assert_eq!(ms.len(), 1, "{ms:?}");
            assert!(
                ferry_broadcast::plan::stripe_holders(&ms, "me", 9, 0, &Default::default(), 1, 0.5)
                    .iter()
                    .all(Option::is_none)
            );
            eprintln!("lease expired after {:?}", t0.elapsed());
            d.deregister("me").await?;
            wait_for(&d, "deregistration", |m| m.is_empty()).await
        });
        let _ = child.kill();
        res
    }

    /// Receivers registering at once each claim a distinct number (a transaction per claim),
    /// dense from 0; one that registers later takes the next above every number listed.
    #[test]
    fn etcd_members_registering_at_once_claim_distinct_numbers() -> Result<()> {
        let Some(etcd) = start_etcd()? else {
            return Ok(());
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()?;
        rt.block_on(async {
            let ttl = Duration::from_secs(5);
            let mut tasks = Vec::new();
            for i in 0..6 {
                let d = Etcd::connect(&etcd.url, "n", ttl).await?;
                tasks.push(tokio::spawn(async move {
                    d.register(&member(&format!("m{i}"))).await.map(|_| d)
                }));
            }
            let mut held = Vec::new();
            for t in tasks {
                held.push(t.await??);
            }
            wait_for(&held[0], "all six listed", |m| m.len() == 6).await?;
            let mut numbers: Vec<Option<u64>> =
                held[0].members().await?.iter().map(|m| m.number).collect();
            numbers.sort();
            assert_eq!(numbers, (0..6).map(Some).collect::<Vec<_>>());
            // Another version is numbered apart, from 0.
            let other = Etcd::connect(&etcd.url, "n", ttl).await?;
            let mut v1 = member("v1");
            v1.version = 1;
            other.register(&v1).await?;
            let late = Etcd::connect(&etcd.url, "n", ttl).await?;
            wait_for(&late, "seven listed", |m| m.len() == 7).await?;
            late.register(&member("late")).await?;
            wait_for(&late, "eight listed", |m| m.len() == 8).await?;
            let ms = late.members().await?;
            let number = |id: &str| ms.iter().find(|m| m.id == id).and_then(|m| m.number);
            assert_eq!(number("v1"), Some(0));
            assert_eq!(number("late"), Some(6));
            Ok(())
        })
    }

    /// An etcd that stops answering (SIGSTOP) fails a member's update with a discovery error
    /// naming the endpoint and the call, within the metadata room's call bound, instead of
    /// holding the member (and the client's lock) until it thaws; once thawed, updates work.
    #[test]
    fn a_frozen_etcd_fails_a_members_update_naming_it_and_serves_it_after_the_thaw() -> Result<()> {
        let Some(etcd) = start_etcd()? else {
            return Ok(());
        };
        let signal = |sig: &str| -> Result<()> {
            let ok = std::process::Command::new("kill")
                .args([sig, &etcd.child.id().to_string()])
                .status()?
                .success();
            ensure!(ok, "kill {sig} etcd");
            Ok(())
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        rt.block_on(async {
            let d = Etcd::connect(&etcd.url, "frozen", Duration::from_secs(30)).await?;
            let me = member("m");
            d.register(&me).await?;
            signal("-STOP")?;
            let got = tokio::time::timeout(Duration::from_secs(60), d.update(&me)).await;
            signal("-CONT")?;
            let err = got
                .context("the update was not bounded")?
                .err()
                .context("the update succeeded against a stopped etcd")?;
            let text = err.to_string();
            let endpoint = etcd.url.trim_start_matches("http://");
            ensure!(
                text.contains("put") && text.contains("no answer") && text.contains(endpoint),
                "{text}"
            );
            // Thawed: updates are answered again (the first may still meet the backlog).
            let t0 = Instant::now();
            while let Err(e) = d.update(&me).await {
                ensure!(
                    t0.elapsed() < Duration::from_secs(30),
                    "after the thaw: {e}"
                );
            }
            Ok(())
        })
    }

    /// A whole broadcast with etcd discovery: the source lists itself, receivers find it there.
    #[test]
    fn a_broadcast_over_etcd_discovery() -> Result<()> {
        let Some(etcd) = start_etcd()? else {
            return Ok(());
        };
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("w.bin");
        let want = payload(5 << 20, 3);
        std::fs::write(&file, &want)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        rt.block_on(async {
            let ttl = Duration::from_secs(2);
            let m = Manifest::build("e", 1, std::slice::from_ref(&file), CHUNK)?;
            let digest = m.digest();
            let sd: Arc<dyn Discovery> = Arc::new(Etcd::connect(&etcd.url, "e", ttl).await?);
            let src = Source::start(
                m,
                std::slice::from_ref(&file),
                SourceOptions {
                    data_plane: DataPlane::Tcp,
                    ..Default::default()
                },
                Some(sd),
            )
            .await?;
            let mut tasks = Vec::new();
            for _ in 0..3 {
                let d: Arc<dyn Discovery> = Arc::new(Etcd::connect(&etcd.url, "e", ttl).await?);
                // The watch needs a moment to list the source.
                let t0 = Instant::now();
                while !d.members().await?.iter().any(|m| m.role == Role::Source) {
                    if t0.elapsed() > Duration::from_secs(10) {
                        bail!("the source never showed up in etcd");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let opts = ReceiverOptions {
                    data_plane: DataPlane::Tcp,
                    heartbeat: Duration::from_millis(200),
                    // What etcd lists proves nothing: the manifest is bound by its digest.
                    expect_manifest: Some(digest),
                    ..Default::default()
                };
                let mut r = Receiver::join(d, Some("e"), opts).await?;
                tasks.push(tokio::spawn(async move {
                    let s = r.run().await;
                    r.linger(Duration::from_secs(10)).await;
                    (r, s)
                }));
            }
            let mut relayed = 0;
            for t in tasks {
                let (r, s) = t.await?;
                let s = s?;
                assert_eq!(r.segment_bytes(0).context("segment")?, want);
                relayed += s.bytes_from_relays;
            }
            assert!(relayed > 0, "nothing was relayed");
            src.stop().await;
            Ok(())
        })
    }

    /// Waits until `d` lists `n` sources.
    async fn sources_listed(d: &Etcd, n: usize) -> Result<Vec<Member>> {
        let t0 = Instant::now();
        loop {
            let ms = d.members().await?;
            if ms.iter().filter(|m| m.role == Role::Source).count() >= n {
                return Ok(ms);
            }
            if t0.elapsed() > Duration::from_secs(15) {
                bail!("{n} sources not listed within 15 s: {ms:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The finding of issue 40: whoever can write etcd lists a source of their own first. A
    /// receiver without keys or an expected digest is refused before it reads the list
    /// (before: it took the impostor's manifest and pulled its bytes); with the publisher's
    /// digest, the impostor's manifest is refused and the pull goes on with the next source
    /// listed, the publisher, whose bytes land; the impostor serves nothing.
    #[test]
    fn an_impostor_source_listed_first_in_etcd_is_never_pulled_from() -> Result<()> {
        let Some(etcd) = start_etcd()? else {
            return Ok(());
        };
        let dir = tempfile::tempdir()?;
        let (real, fake) = (dir.path().join("real"), dir.path().join("fake"));
        std::fs::create_dir_all(&real)?;
        std::fs::create_dir_all(&fake)?;
        let (real_file, fake_file) = (real.join("w.bin"), fake.join("w.bin"));
        std::fs::write(&real_file, payload(1 << 20, 5))?;
        std::fs::write(&fake_file, payload(1 << 20, 6))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        rt.block_on(async {
            let ttl = Duration::from_secs(3);
            let start = |file: PathBuf| {
                let url = etcd.url.clone();
                async move {
                    let m = Manifest::build("i", 1, std::slice::from_ref(&file), CHUNK)?;
                    let d: Arc<dyn Discovery> = Arc::new(Etcd::connect(&url, "i", ttl).await?);
                    let opts = SourceOptions {
                        data_plane: DataPlane::Tcp,
                        ..Default::default()
                    };
                    anyhow::Ok(Source::start(m, &[file], opts, Some(d)).await?)
                }
            };
            // The impostor lists itself first.
            let impostor = start(fake_file).await?;
            let watcher = Etcd::connect(&etcd.url, "i", ttl).await?;
            sources_listed(&watcher, 1).await?;
            let publisher = start(real_file).await?;
            let listed = sources_listed(&watcher, 2).await?;
            assert_eq!(listed[0].ctl_addr, impostor.ctl_addr().to_string());
            let join = |expect_manifest| {
                let url = etcd.url.clone();
                async move {
                    // Connecting reads the list: both sources are in it.
                    let d: Arc<dyn Discovery> = Arc::new(Etcd::connect(&url, "i", ttl).await?);
                    let opts = ReceiverOptions {
                        data_plane: DataPlane::Tcp,
                        expect_manifest,
                        ..Default::default()
                    };
                    anyhow::Ok(Receiver::join(d, Some("i"), opts).await)
                }
            };
            match join(None).await? {
                Err(e @ ferry_broadcast::BroadcastError::UnboundSource { .. }) => {
                    let msg = e.to_string();
                    assert!(msg.contains("--expect-manifest"), "{msg}");
                    assert!(msg.contains(&etcd.url), "{msg}");
                }
                Err(e) => bail!("refused for another reason: {e}"),
                Ok(_) => bail!("joined through a source etcd lists, unbound"),
            }
            let mut r = join(Some(publisher.manifest().digest())).await??;
            r.run().await?;
            anyhow::ensure!(
                r.segment_bytes(0).as_deref() == Some(&payload(1 << 20, 5)[..]),
                "the pull did not land the publisher's bytes"
            );
            drop(r);
            let served = impostor
                .engine()
                .describe()
                .served
                .map_or(0, |s| s.accepted.iter().map(|t| t.bytes).sum::<u64>());
            assert_eq!(served, 0, "the impostor served chunks");
            impostor.stop().await;
            publisher.stop().await;
            Ok(())
        })
    }

    fn record(id: &str) -> Vec<u8> {
        serde_json::to_vec(&member(id)).expect("a member serializes")
    }

    /// The member records read from etcd are capped: past the cap (records listed before the
    /// list is read, and records put after) they are ignored and counted, the first by create
    /// revision kept; a record too long, or under another member's key, is ignored too; a
    /// listed member that leaves makes room.
    #[test]
    fn etcd_member_records_past_the_cap_are_ignored_and_counted() -> Result<()> {
        let Some(etcd) = start_etcd()? else {
            return Ok(());
        };
        let rt = tokio::runtime::Runtime::new()?;
        rt.block_on(async {
            let ttl = Duration::from_secs(5);
            let kv = ferry_broadcast::EtcdKv::connect(&etcd.url, ttl).await?;
            let key = |id: &str| format!("/ferry/broadcast/c/members/{id}");
            for i in 0..6 {
                kv.put_leased(&key(&format!("m{i}")), record(&format!("m{i}")))
                    .await?;
            }
            let d = Etcd::connect_capped(&etcd.url, "c", ttl, 4).await?;
            let ids = |ms: Vec<Member>| ms.into_iter().map(|m| m.id).collect::<Vec<_>>();
            assert_eq!(ids(d.members().await?), ["m0", "m1", "m2", "m3"]);
            assert_eq!(d.ignored(), 2);
            assert!(
                d.describe().contains("2 member records ignored"),
                "{}",
                d.describe()
            );
            // Put after the list was read: through the watch.
            kv.put_leased(&key("late"), record("late")).await?;
            kv.put_leased(
                &key("m9"),
                vec![b' '; ferry_broadcast::MAX_MEMBER_BYTES + 1],
            )
            .await?;
            kv.put_leased(&key("thief"), record("m0")).await?;
            wait_until(|| d.ignored() == 5, "three more ignored").await?;
            assert_eq!(d.members().await?.len(), 4);
            // A listed member leaves: the next put takes its place.
            kv.delete(&key("m1")).await?;
            kv.put_leased(&key("late"), record("late")).await?;
            wait_for(&d, "the late member listed", |m| {
                m.iter().any(|m| m.id == "late")
            })
            .await?;
            assert_eq!(ids(d.members().await?), ["m0", "m2", "m3", "late"]);
            Ok(())
        })
    }

    async fn wait_until(f: impl Fn() -> bool, what: &str) -> Result<()> {
        let t0 = Instant::now();
        while !f() {
            if t0.elapsed() > Duration::from_secs(15) {
                bail!("etcd: {what} did not happen within 15 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }
}

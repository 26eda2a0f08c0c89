//! `ferry pull --into DIR` leaves DIR whole or untouched (issue 51): a pull killed at each step
//! of its commit (`FERRY_PULL_STOP_AT`, a test hook that aborts the process there, as a
//! `SIGKILL` would) leaves either the old files under their names and no journal, or the
//! journal (`.ferry-commit.PID`) that tells a reader the directory is mid-commit; the next pull
//! into DIR finishes or discards what it left, and no hidden file stays. A signal after a
//! pull's summary leaves it a success: exit 0 and one JSON object.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};

const FILES: [(&str, u8, usize); 3] = [
    ("config.json", 1, 3000),
    ("model-1.bin", 2, 70_000),
    ("model-2.bin", 3, 90_000),
];

fn ferry() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.env_remove("FERRY_AUTH_KEY_FILE")
        .env_remove("FERRY_PULL_STOP_AT")
        .env("NO_COLOR", "1");
    c
}

/// A publisher of FILES; its control address.
fn publish(src: &Path) -> (Child, String) {
    for (name, fill, len) in FILES {
        std::fs::write(src.join(name), vec![fill; len]).expect("write");
    }
    let mut publish = ferry()
        .arg("publish")
        .arg(src)
        .args([
            "--name",
            "ckpt",
            "--listen",
            "127.0.0.1:0",
            "--chunk-size",
            "4KiB",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn publish");
    let out = BufReader::new(publish.stdout.take().expect("stdout"));
    for line in out.lines() {
        let line = line.expect("read publish's stdout");
        if let Some(rest) = line.split_once("ferry pull ").map(|(_, r)| r) {
            let ctl = rest.split_whitespace().next().expect("address").to_owned();
            return (publish, ctl);
        }
    }
    let _ = publish.kill();
    let _ = publish.wait();
    panic!("publish printed no pull command");
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn pull(ctl: &str, dir: &Path, stop_at: Option<&str>) -> std::process::Output {
    let mut c = ferry();
    c.args(["pull", ctl, "--linger", "0", "--no-relay"])
        .arg("--into")
        .arg(dir);
    if let Some(s) = stop_at {
        c.env("FERRY_PULL_STOP_AT", s);
    }
    c.output().expect("run pull")
}

#[test]
fn a_pull_killed_at_each_step_of_its_commit_leaves_the_directory_whole_or_untouched() {
    let src = tempfile::tempdir().expect("tempdir");
    let (mut publisher, ctl) = publish(src.path());
    let steps = ["synced", "journal", "rename:1", "rename:2", "renamed"];
    for step in steps {
        let dst = tempfile::tempdir().expect("tempdir");
        // An earlier version is there, and a file of the user's.
        for (name, _, len) in FILES {
            std::fs::write(dst.path().join(name), vec![9u8; len]).expect("old");
        }
        std::fs::write(dst.path().join("notes.txt"), b"mine").expect("user's file");
        let killed = pull(&ctl, dst.path(), Some(step));
        assert!(!killed.status.success(), "{step}: {killed:?}");
        let after = names(dst.path());
        let journaled = after.iter().any(|n| n.starts_with(".ferry-commit."));
        let new = FILES
            .iter()
            .filter(|(name, fill, len)| {
                std::fs::read(dst.path().join(name)).expect("a file") == vec![*fill; *len]
            })
            .count();
        if step == "synced" {
            // Before the commit point: every final name holds the old version.
            assert!(!journaled, "{step}: {after:?}");
            assert_eq!(new, 0, "{step}: the directory was touched");
        } else {
            // After it: the journal tells a reader the directory is mid-commit.
            assert!(journaled, "{step}: no journal in {after:?}");
        }
        // The next pull into it: whole, the user's file kept, nothing hidden left.
        let again = pull(&ctl, dst.path(), None);
        assert!(again.status.success(), "{step}: {again:?}");
        for (name, fill, len) in FILES {
            assert_eq!(
                std::fs::read(dst.path().join(name)).expect("pulled"),
                vec![fill; len],
                "{step}: {name}"
            );
        }
        assert_eq!(
            names(dst.path()),
            ["config.json", "model-1.bin", "model-2.bin", "notes.txt"],
            "{step}: leftovers"
        );
    }
    let _ = publisher.kill();
    let _ = publisher.wait();
}

#[test]
fn a_signal_after_the_summary_leaves_the_pull_a_success() {
    let src = tempfile::tempdir().expect("tempdir");
    let (mut publisher, ctl) = publish(src.path());
    for sig in ["TERM", "INT"] {
        let dst = tempfile::tempdir().expect("tempdir");
        let mut child = ferry()
            .args(["pull", &ctl, "--linger", "60s", "--no-relay", "--json"])
            .arg("--into")
            .arg(dst.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn pull");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut summary = String::new();
        out.read_line(&mut summary).expect("the summary");
        let status = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(child.id().to_string())
            .status()
            .expect("kill");
        assert!(status.success());
        let mut rest = String::new();
        out.read_to_string(&mut rest).expect("the rest");
        let code = child.wait().expect("wait").code();
        assert_eq!(code, Some(0), "SIG{sig}: {summary}{rest}");
        let v: serde_json::Value = serde_json::from_str(&summary).expect("JSON");
        assert!(v.get("bytes").is_some(), "{summary}");
        assert_eq!(rest.trim(), "", "SIG{sig}: one JSON object only");
    }
    let _ = publisher.kill();
    let _ = publisher.wait();
}

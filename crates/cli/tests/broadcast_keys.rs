//! `ferry publish --auth-key-file` / `ferry pull --auth-key-file`: with the key a pull
//! completes; without it, or with another key, it fails with a clear error and writes nothing.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};

fn ferry() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.env_remove("FERRY_AUTH_KEY_FILE")
        .env_remove("FERRY_ALLOW_OPEN_KEY_FILE")
        .env("NO_COLOR", "1");
    c
}

fn key_file(dir: &Path, name: &str, byte: u8) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("fleet {}\n", format!("{byte:02x}").repeat(32))).expect("write");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    p
}

#[test]
fn a_pull_without_the_key_or_with_another_fails_and_writes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path().join("src");
    std::fs::create_dir(&src).expect("mkdir");
    std::fs::write(src.join("a.bin"), vec![3u8; 70_000]).expect("write");
    let good = key_file(dir.path(), "good.keys", 7);
    let other = key_file(dir.path(), "other.keys", 8);
    let mut publish = ferry()
        .arg("publish")
        .arg(&src)
        .args([
            "--name",
            "ckpt",
            "--listen",
            "127.0.0.1:0",
            "--chunk-size",
            "4KiB",
        ])
        .arg("--auth-key-file")
        .arg(&good)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn publish");
    let out = BufReader::new(publish.stdout.take().expect("stdout"));
    let mut ctl = None;
    for line in out.lines() {
        let line = line.expect("read publish's stdout");
        if let Some(rest) = line.split_once("ferry pull ").map(|(_, r)| r) {
            ctl = rest.split_whitespace().next().map(str::to_owned);
            break;
        }
    }
    let ctl = ctl.expect("publish printed the pull command");
    let pull = |into: &Path, key: Option<&Path>| {
        let mut c = ferry();
        c.args(["pull", &ctl, "--linger", "0", "--into"]).arg(into);
        if let Some(k) = key {
            // Through the environment, as FERRY_AUTH_KEY_FILE.
            c.env("FERRY_AUTH_KEY_FILE", k);
        }
        c.output().expect("run pull")
    };
    for (key, says) in [
        (None, "unauthenticated"),
        (Some(other.as_path()), "could not prove"),
    ] {
        let into = dir.path().join("refused");
        let o = pull(&into, key);
        assert_eq!(o.status.code(), Some(1), "{o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(says), "{err}");
        assert!(!into.exists(), "a refused pull wrote nothing");
    }
    let into = dir.path().join("pulled");
    let o = pull(&into, Some(&good));
    let _ = publish.kill();
    let _ = publish.wait();
    assert!(o.status.success(), "{o:?}");
    assert_eq!(
        std::fs::read(into.join("a.bin")).expect("pulled"),
        vec![3u8; 70_000]
    );
}

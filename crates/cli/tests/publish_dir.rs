//! `ferry publish DIR`: a checkpoint directory is published as the files directly in it.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn ferry() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.env_remove("FERRY_AUTH_KEY_FILE").env("NO_COLOR", "1");
    c
}

#[test]
fn a_directory_is_published_file_by_file_and_pulled_whole() {
    let src = tempfile::tempdir().expect("tempdir");
    std::fs::write(src.path().join("a.bin"), vec![1u8; 5000]).expect("write");
    std::fs::write(src.path().join("b.bin"), vec![2u8; 70_000]).expect("write");
    let mut publish = ferry()
        .arg("publish")
        .arg(src.path())
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
    let mut ctl = None;
    let mut digest = None;
    for line in out.lines() {
        let line = line.expect("read publish's stdout");
        if let Some(rest) = line.split_once("ferry pull ").map(|(_, r)| r) {
            ctl = rest.split_whitespace().next().map(str::to_owned);
            digest = rest
                .split_once("--expect-manifest ")
                .map(|(_, d)| d.trim().to_owned());
            break;
        }
    }
    let ctl = ctl.expect("publish printed the pull command");
    let digest = digest.expect("publish printed the manifest's digest");
    // Another digest: refused, nothing written.
    let wrong = tempfile::tempdir().expect("tempdir");
    let refused = ferry()
        .args([
            "pull",
            &ctl,
            "--linger",
            "0",
            "--expect-manifest",
            &"ab".repeat(32),
        ])
        .arg("--into")
        .arg(wrong.path().join("out"))
        .output()
        .expect("run pull");
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("not the expected"), "{err}");
    assert!(
        !wrong.path().join("out").exists(),
        "a refused pull wrote nothing"
    );
    let dst = tempfile::tempdir().expect("tempdir");
    let pulled = ferry()
        .args([
            "pull",
            &ctl,
            "--linger",
            "0",
            "--json",
            "--expect-manifest",
            &digest,
        ])
        .arg("--into")
        .arg(dst.path())
        .output()
        .expect("run pull");
    let _ = publish.kill();
    let _ = publish.wait();
    assert!(pulled.status.success(), "{pulled:?}");
    for name in ["a.bin", "b.bin"] {
        assert_eq!(
            std::fs::read(dst.path().join(name)).expect("pulled file"),
            std::fs::read(src.path().join(name)).expect("source file"),
            "{name}"
        );
    }
}

#[test]
fn a_directory_inside_a_directory_is_refused_once() {
    let src = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(src.path().join("sub")).expect("mkdir");
    let out = ferry()
        .arg("publish")
        .arg(src.path())
        .args(["--name", "ckpt"])
        .output()
        .expect("run publish");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is a directory inside"), "{err}");
    assert_eq!(err.matches("is a directory").count(), 1, "said once: {err}");
    // One line saying it, and the hint every failure ends with.
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 2, "{err}");
    assert!(lines[1].starts_with("hint: "), "{err}");
}

//! The small things of issue 51 at the command line: `ferry metadata-server` stopped by SIGINT
//! or SIGTERM says what it held and exits 130 or 143, as every other command; `ferry pull`
//! without `--into` says `--in-memory` is the other choice.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};

fn ferry() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.env_remove("FERRY_AUTH_KEY_FILE").env("NO_COLOR", "1");
    c
}

#[test]
fn metadata_server_stopped_by_a_signal_says_what_it_held_and_exits_128_plus_it() {
    for (sig, code) in [("INT", 130), ("TERM", 143)] {
        let mut child = ferry()
            .args(["metadata-server", "--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut first = String::new();
        out.read_line(&mut first).expect("its address");
        assert!(first.contains("listening on"), "{first}");
        let killed = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(child.id().to_string())
            .status()
            .expect("kill");
        assert!(killed.success());
        let mut rest = String::new();
        out.read_to_string(&mut rest).expect("the rest");
        let status = child.wait().expect("wait");
        assert_eq!(status.code(), Some(code), "SIG{sig}: {rest}");
        assert!(
            rest.contains(&format!("stopped by SIG{sig}: metadata server on "))
                && rest.contains("held 0 records"),
            "{rest}"
        );
    }
}

#[test]
fn pull_without_into_names_in_memory() {
    let out = ferry()
        .args(["pull", "127.0.0.1:7500"])
        .output()
        .expect("run pull");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--into DIR") && err.contains("--in-memory"),
        "{err}"
    );
}

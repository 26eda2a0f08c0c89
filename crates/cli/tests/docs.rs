//! The docs match the binary: the README's option tables list exactly the flags `--help` does
//! (with the same defaults), and the error texts troubleshooting.md quotes are the real ones.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

const COMMANDS: [&str; 6] = ["doctor", "topology", "serve", "bench", "publish", "pull"];

fn ferry() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.env_remove("FERRY_AUTH_KEY_FILE").env("NO_COLOR", "1");
    c
}

fn repo_file(path: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `--help`'s long flags (`--help` and the global `--verbose` aside) with their defaults.
fn help_flags(cmd: &str) -> BTreeMap<String, Option<String>> {
    let out = ferry().args([cmd, "--help"]).output().expect("run --help");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let lines: Vec<&str> = text.lines().collect();
    let mut flags = BTreeMap::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let t = t
            .strip_prefix("-h, ")
            .or(t.strip_prefix("-v, "))
            .unwrap_or(t);
        if !line.starts_with("  ") || !t.starts_with("--") {
            continue;
        }
        let flag: String = t
            .chars()
            .take_while(|c| *c == '-' || c.is_ascii_alphanumeric())
            .collect();
        if flag == "--help" || flag == "--verbose" {
            continue;
        }
        // The description is on this line (short help) or the next (long help).
        let desc = if t.trim_end().contains("  ") {
            t.to_owned()
        } else {
            lines.get(i + 1).map(|l| l.to_string()).unwrap_or_default()
        };
        let default = desc
            .split_once("[default: ")
            .and_then(|(_, r)| r.split_once(']'))
            .map(|(d, _)| d.to_owned());
        flags.insert(flag, default);
    }
    flags
}

/// The README's table for `ferry CMD`: flag → default (empty cell: none).
fn readme_flags(readme: &str, cmd: &str) -> BTreeMap<String, Option<String>> {
    let options = readme
        .split_once("## Options of each command")
        .expect("README has `## Options of each command`")
        .1;
    let heading = format!("### `ferry {cmd}`");
    let section = options
        .split_once(&heading)
        .unwrap_or_else(|| panic!("README has no {heading}"))
        .1;
    let section = section.split("\n#").next().unwrap_or_default();
    let mut flags = BTreeMap::new();
    for row in section.lines().filter(|l| l.starts_with("| `--")) {
        let cells: Vec<&str> = row.split(" | ").collect();
        let flag: String = cells[0]
            .trim_start_matches("| `")
            .chars()
            .take_while(|c| *c == '-' || c.is_ascii_alphanumeric())
            .collect();
        let default = cells
            .get(1)
            .map(|d| d.trim().trim_matches('`'))
            .filter(|d| !d.is_empty())
            .map(str::to_owned);
        assert!(
            flags.insert(flag.clone(), default).is_none(),
            "{flag} twice under {heading}"
        );
    }
    flags
}

#[test]
fn readme_option_tables_match_help() {
    let readme = repo_file("README.md");
    for cmd in COMMANDS {
        let help = help_flags(cmd);
        assert!(
            !help.is_empty(),
            "no flags parsed from `ferry {cmd} --help`"
        );
        let table = readme_flags(&readme, cmd);
        let missing: Vec<_> = help.keys().filter(|f| !table.contains_key(*f)).collect();
        let stale: Vec<_> = table.keys().filter(|f| !help.contains_key(*f)).collect();
        assert!(
            missing.is_empty() && stale.is_empty(),
            "README's `ferry {cmd}` table: missing {missing:?}, no longer in --help {stale:?}"
        );
        for (flag, default) in &help {
            assert_eq!(
                &table[flag], default,
                "README's default of `ferry {cmd} {flag}` differs from --help's"
            );
        }
    }
}

/// Whether every `…`-separated piece of `quote` appears in `real`, in order.
fn quote_matches(quote: &str, real: &str) -> bool {
    let mut rest = real;
    for piece in quote.split('…').filter(|p| !p.is_empty()) {
        match rest.find(piece) {
            Some(at) => rest = &rest[at + piece.len()..],
            None => return false,
        }
    }
    true
}

/// The backticked quotes of `doc` that start with `key`.
fn quotes<'a>(doc: &'a str, key: &str) -> Vec<&'a str> {
    doc.split('`')
        .skip(1)
        .step_by(2)
        .filter(|q| q.starts_with(key))
        .collect()
}

fn stderr_of(envs: &[(&str, &str)], args: &[&str]) -> String {
    let out = ferry()
        .envs(envs.iter().copied())
        .args(args)
        .output()
        .expect("run ferry");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn troubleshooting_quotes_the_real_messages() {
    let doc = repo_file("docs/troubleshooting.md");
    let mut cases = vec![
        (
            "libcuda.so.1 unavailable: cannot open",
            stderr_of(
                &[("FERRY_LIBCUDA", "libcuda.so.1-not-here")],
                &["bench", "--gpu", "0", "--total", "1MiB"],
            )
            .replace("libcuda.so.1-not-here: ", ""),
        ),
        (
            "libcuda.so.1 unavailable: /path/libcuda.so.1: cannot open",
            stderr_of(
                &[("FERRY_LIBCUDA", "/path/libcuda.so.1")],
                &["bench", "--gpu", "0", "--total", "1MiB"],
            ),
        ),
        (
            "libibverbs.so.1 unavailable: no RDMA devices found: libibverbs.so.1: cannot open",
            stderr_of(
                &[("FERRY_IBVERBS_LIB", "/nonexistent/libibverbs.so.1")],
                &["bench", "--transport", "rdma", "--total", "1MiB"],
            )
            .replace("/nonexistent/", ""),
        ),
    ];
    // With libibverbs and no device (this machine's case, and a CI runner's), the other text.
    let doctor = ferry().args(["doctor", "--json"]).output().expect("doctor");
    let v: serde_json::Value = serde_json::from_slice(&doctor.stdout).expect("json");
    let verbs_ok = v["checks"]
        .as_array()
        .and_then(|c| c.iter().find(|r| r["name"] == "libibverbs"))
        .is_some_and(|r| r["status"] == "ok");
    if verbs_ok
        && v["summary"]["rdma_devices"]
            .as_array()
            .is_some_and(Vec::is_empty)
    {
        cases.push((
            "ferry rdma transport unavailable: selecting RDMA devices",
            stderr_of(&[], &["bench", "--transport", "rdma", "--total", "1MiB"]),
        ));
    }
    for (key, real) in cases {
        let found = quotes(&doc, key);
        assert!(!found.is_empty(), "troubleshooting.md quotes no `{key}…`");
        assert!(
            found.iter().all(|q| quote_matches(q, &real)),
            "troubleshooting.md's {found:?} is not what ferry says: {real}"
        );
    }
}

#[test]
fn completions_for_each_shell() {
    for shell in ["bash", "zsh", "fish"] {
        let out = ferry().args(["completions", shell]).output().expect("run");
        assert!(out.status.success(), "{shell}: {out:?}");
        let script = String::from_utf8(out.stdout).expect("utf-8");
        for word in ["serve", "bench", "weights-version", "require"] {
            assert!(script.contains(word), "{shell} script lacks {word}");
        }
    }
    // The bash script parses.
    let script = ferry()
        .args(["completions", "bash"])
        .output()
        .expect("run")
        .stdout;
    let path = std::env::temp_dir().join(format!("ferry-completion-{}.bash", std::process::id()));
    std::fs::write(&path, script).expect("write");
    let check = Command::new("bash").arg("-n").arg(&path).status();
    let _ = std::fs::remove_file(&path);
    match check {
        Ok(s) => assert!(s.success(), "bash -n rejects the script"),
        Err(e) => ferry_tests::require_or_skip(ferry_tests::TOOLS, format!("no bash: {e}")),
    }
}

/// Every `FERRY_*` name in the files under `dir` (source, scripts).
fn ferry_vars(dir: &Path, found: &mut std::collections::BTreeSet<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        // Links are not followed (a venv's `lib64 -> lib` would loop).
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_symlink() {
            continue;
        }
        if kind.is_dir() {
            if !matches!(name.as_str(), "target" | ".git" | "__pycache__") {
                ferry_vars(&path, found);
            }
            continue;
        }
        let scanned = [".rs", ".py", ".sh", ".c"]
            .iter()
            .any(|e| name.ends_with(e))
            || name == "run";
        if !scanned {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        for (at, _) in text.match_indices("FERRY_") {
            let var: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            // `FERRY_REQUIRE_` alone is the prefix the helpers build names from.
            let var = var.trim_end_matches('_');
            if var.len() > "FERRY_".len() && var != "FERRY_REQUIRE" {
                found.insert(var.to_owned());
            }
        }
    }
}

#[test]
fn environment_page_lists_every_variable() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut vars = std::collections::BTreeSet::new();
    for dir in ["crates", "xtask", "tests", "benches", "examples", ".ci"] {
        ferry_vars(&root.join(dir), &mut vars);
    }
    assert!(
        vars.contains("FERRY_AUTH_KEY_FILE"),
        "the scan found {vars:?}"
    );
    let page = repo_file("docs/environment.md");
    let missing: Vec<_> = vars
        .iter()
        .filter(|v| !page.contains(&format!("`{v}`")))
        .collect();
    assert!(missing.is_empty(), "docs/environment.md lacks {missing:?}");
    for v in ["RUST_LOG", "NO_COLOR"] {
        assert!(page.contains(&format!("`{v}`")), "{v}");
    }
}

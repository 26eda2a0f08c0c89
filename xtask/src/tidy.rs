//! `cargo xtask tidy`: the docs name what the tree holds, and the sources keep to the house's
//! size limits ([`crate::sizes`]) and open with their `//!` contracts ([`crate::contracts`]).
//!
//! Every name `README.md` and `docs/*.md` put in backticks that looks like one of ours must be
//! found in the tree, and every crate under `crates/` must have its row in the layout of
//! `docs/architecture.md` (section 1). What counts as a name is chosen to avoid false alarms
//! ([`claim`]): a path with a `/` and a known extension (or two `/`, one trailing), looked up from the
//! root, under `crates/` and under each crate and its `src/`; a Rust path with `::`, a call
//! `name(…)`, or a CamelCase type name, whose every identifier must occur as a word in the
//! sources (Rust, Python, C, scripts, manifests), or as a file or folder name there (test binaries
//! and modules). Anything else in backticks (commands, values, prose, dotted Python calls, names
//! of a single word) is not checked, and nor is a fenced code block. A section another doc names
//! (`decisions.md, "io_uring on loopback"`, `[x](performance.md#soak-issue-17)`) must be a heading
//! of that doc: by the start of its title, or by its anchor. And a snake_case name a Rust comment
//! puts in backticks (a function, a test, a field) must occur in the code, comments left out, so a
//! comment does not go on citing what was renamed or removed. Names that are rightly
//! absent (a peer's API, a file of another repository, a name `decisions.md` records as removed)
//! are listed in [`ALLOWED`] with the reason. Also a test, so `cargo test -p xtask` fails on
//! drift.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::util::project_root;

/// Backticked names the docs may use although the tree does not hold them: `(doc, name, why)`.
const ALLOWED: &[(&str, &str, &str)] = &[
    (
        "docs/mooncake.md",
        "MooncakeConnector",
        "vLLM's connector, a peer's name",
    ),
    (
        "docs/mooncake.md",
        "mooncake-wheel/tests/transfer_engine_target.py",
        "a file of the Mooncake repository",
    ),
    (
        "docs/mooncake.md",
        "scripts/run_tests.sh",
        "a file of the Mooncake repository",
    ),
    (
        "docs/performance.md",
        ".gpu-bundle/run.sh",
        "made by `cargo xtask gpu-check --bundle`, git-ignored",
    ),
    (
        "docs/decisions.md",
        "UringConfig::max_threads",
        "removed; the decision records why",
    ),
    (
        "docs/decisions.md",
        "EngineBuilder::uring_max_threads",
        "removed; the decision records why",
    ),
    (
        "docs/decisions.md",
        "StreamOverflow",
        "removed; the decision records why",
    ),
    (
        "docs/decisions.md",
        "StreamServer",
        "removed; the decision records why",
    ),
    (
        "docs/decisions.md",
        "SockIo",
        "removed; the decision records why",
    ),
    (
        "docs/decisions.md",
        "SockIo::arm_hangup",
        "removed; the decision records why",
    ),
];

/// Snake_case names Rust comments may put in backticks although no code of the tree holds them:
/// `(name, why)`.
const COMMENT_ALLOWED: &[(&str, &str)] = &[
    ("io_uring_enter", "the kernel's system call"),
    ("tcp_disconnect", "the kernel's function"),
    ("ibv_post_recv", "rdma-core's static inline, ported by hand"),
    (
        "ibv_req_notify_cq",
        "rdma-core's static inline, ported by hand",
    ),
    ("curl_easy_escape", "libcurl's function"),
    ("gnu_dev_major", "glibc's function"),
    ("gnu_dev_minor", "glibc's function"),
    ("mooncake_http_metadata_server", "Mooncake's program"),
    ("log_d", "a formula (the logarithm base d)"),
    (
        "tcp_pace_kick",
        "the kernel's function (TCP pacing's timer)",
    ),
    (
        "pidfd_open",
        "the Linux system call (made through `SYS_pidfd_open`)",
    ),
];

/// Extensions a backticked path must end in to be checked as a file of the tree.
const FILE_EXTENSIONS: &[&str] = &[
    "rs", "md", "toml", "py", "pyi", "sh", "yml", "yaml", "json", "c", "h", "txt", "lock",
];

/// Where the words of the sources are read from, relative to the root.
const SOURCE_DIRS: &[&str] = &[
    "crates", "xtask", "tests", "benches", "examples", ".ci", ".github",
];

/// Extensions of the files whose words count (plus `.ci/`'s extensionless scripts).
const SOURCE_EXTENSIONS: &[&str] = &["rs", "py", "pyi", "c", "h", "sh", "toml", "yml"];

pub(crate) fn run(args: &[String]) -> Result<()> {
    if !args.is_empty() {
        bail!("usage: cargo xtask tidy");
    }
    let (checked, problems) = check(&project_root())?;
    let (files, sizes) = crate::sizes::check(&project_root())?;
    let (_, contracts) = crate::contracts::check(&project_root())?;
    if problems.is_empty() && sizes.is_empty() && contracts.is_empty() {
        eprintln!("tidy: the docs name only what the tree holds ({checked} names and paths)");
        eprintln!(
            "tidy: {files} library source files within {} lines before their tests, their \
             functions within {} lines, each opening with its `//!` contract",
            crate::sizes::MAX_FILE_LINES,
            crate::sizes::MAX_FN_LINES
        );
        return Ok(());
    }
    for p in problems.iter().chain(&sizes).chain(&contracts) {
        eprintln!("{p}");
    }
    if !problems.is_empty() {
        eprintln!(
            "tidy: {} doc problem(s); fix the doc, or, for a name rightly absent, add it to \
             ALLOWED in xtask/src/tidy.rs with the reason",
            problems.len()
        );
    }
    if !sizes.is_empty() {
        eprintln!(
            "tidy: {} size problem(s); split the file or function along its concerns, or, for a \
             table of constants, add it to ALLOWED in xtask/src/sizes.rs with the reason",
            sizes.len()
        );
    }
    if !contracts.is_empty() {
        eprintln!(
            "tidy: {} file(s) without their `//!` contract on the first line",
            contracts.len()
        );
    }
    bail!(
        "tidy: {} problem(s)",
        problems.len() + sizes.len() + contracts.len()
    )
}

/// How many backticked names and paths the docs of the tree at `root` claim, and every problem
/// found, one line each (`doc:line: ...`).
pub(crate) fn check(root: &Path) -> Result<(usize, Vec<String>)> {
    let sources = read_sources(root)?;
    let words = &sources.words;
    let mut docs = vec![root.join("README.md")];
    let mut in_docs: Vec<PathBuf> = fs::read_dir(root.join("docs"))
        .context("reading docs/")?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    in_docs.sort();
    docs.extend(in_docs);
    let mut problems = Vec::new();
    let mut checked = 0;
    for doc in &docs {
        let rel = doc
            .strip_prefix(root)
            .unwrap_or(doc)
            .to_string_lossy()
            .into_owned();
        let text = fs::read_to_string(doc).with_context(|| format!("reading {rel}"))?;
        for (line, token) in backticked(&text) {
            if ALLOWED.iter().any(|(d, t, _)| *d == rel && *t == token) {
                continue;
            }
            let claimed = claim(&token);
            checked += usize::from(claimed.is_some());
            let missing = match claimed {
                Some(Claim::Path(p)) => (!path_exists(root, &p)).then(|| "no such path".to_owned()),
                Some(Claim::Names(names)) => {
                    let absent: Vec<&str> = names
                        .iter()
                        .map(String::as_str)
                        .filter(|n| !words.contains(*n))
                        .collect();
                    (!absent.is_empty())
                        .then(|| format!("{} found nowhere in the sources", absent.join(", ")))
                }
                None => None,
            };
            if let Some(why) = missing {
                problems.push(format!("{rel}:{line}: `{token}`: {why}"));
            }
        }
    }
    for doc in &docs {
        let rel = doc
            .strip_prefix(root)
            .unwrap_or(doc)
            .to_string_lossy()
            .into_owned();
        let text = fs::read_to_string(doc).with_context(|| format!("reading {rel}"))?;
        for (line, target, title) in section_refs(&text) {
            let Some(target_doc) = doc_named(root, doc, &target) else {
                continue;
            };
            let Ok(target_text) = fs::read_to_string(&target_doc) else {
                continue;
            };
            checked += 1;
            let heads = headings(&target_text);
            let found = match &title {
                Ref::Title(t) => heads.iter().any(|h| h.starts_with(t.as_str())),
                Ref::Anchor(a) => heads.iter().any(|h| slug(h) == *a),
            };
            if !found {
                let what = match title {
                    Ref::Title(t) => format!("no section \"{t}\""),
                    Ref::Anchor(a) => format!("no heading for #{a}"),
                };
                problems.push(format!("{rel}:{line}: {target}: {what}"));
            }
        }
    }
    for (file, line, name) in &sources.comment_names {
        checked += 1;
        if !sources.code_words.contains(name) && !COMMENT_ALLOWED.iter().any(|(n, _)| n == name) {
            problems.push(format!(
                "{file}:{line}: a comment names `{name}`, found nowhere in the code"
            ));
        }
    }
    let architecture = fs::read_to_string(root.join("docs/architecture.md"))
        .context("reading docs/architecture.md")?;
    for (dir, package) in crates(root)? {
        if !layout_has_row(&architecture, &dir, &package) {
            problems.push(format!(
                "docs/architecture.md: the layout (section 1) has no row `  {dir}/  {package}` \
                 for crates/{dir}"
            ));
        }
    }
    Ok((checked, problems))
}

/// What a backticked token claims about the tree.
#[derive(Debug, PartialEq, Eq)]
enum Claim {
    /// A file or folder, relative to the root, `crates/` or a crate.
    Path(String),
    /// Identifiers that must occur in the sources.
    Names(Vec<String>),
}

/// Whether `s` is a Rust identifier.
fn is_ident(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A CamelCase type name: an upper-case start, lower-case letters, another upper-case letter
/// after the first, no underscore (so neither `FERRY_AUTH_KEY_FILE` nor `EOPNOTSUPP` nor `Engine`).
fn is_camel(s: &str) -> bool {
    is_ident(s)
        && s.starts_with(|c: char| c.is_ascii_uppercase())
        && !s.contains('_')
        && s.chars().any(|c| c.is_ascii_lowercase())
        && s.chars().skip(1).any(|c| c.is_ascii_uppercase())
}

/// What `token` claims, or `None` when it is not checked (see the module's doc).
fn claim(token: &str) -> Option<Claim> {
    // A call's arguments are not looked at, and may hold spaces.
    let bare = match token.find('(') {
        Some(at) if token.ends_with(')') => &token[..at],
        _ => token,
    };
    if bare.chars().any(char::is_whitespace) {
        return None;
    }
    if token.contains('/') {
        let odd = token.starts_with(['/', '~', '$', '-'])
            || token.contains("://")
            || token.contains("..")
            || token.contains(|c: char| "*<>{}[]=:,;|@%…?#".contains(c));
        if odd {
            return None;
        }
        let last = token.trim_end_matches('/').rsplit('/').next().unwrap_or("");
        let has_ext = last
            .rsplit_once('.')
            .is_some_and(|(stem, ext)| !stem.is_empty() && FILE_EXTENSIONS.contains(&ext));
        // A folder has a `/` inside as well: `tests/tests/`, not a key prefix such as `ram/`.
        let is_dir = token.ends_with('/')
            && token.trim_end_matches('/').contains('/')
            && !token.starts_with('.');
        return (has_ext || is_dir).then(|| Claim::Path(token.to_owned()));
    }
    // A call: `name(...)`, `Type::name(...)`: the arguments are not looked at.
    let (head, call) = match token.find('(') {
        Some(at) if token.ends_with(')') => (&token[..at], true),
        Some(_) => return None,
        None => (token, false),
    };
    if head.contains("::") {
        let segs: Vec<&str> = head.split("::").collect();
        let segs = segs.strip_prefix(&[""]).unwrap_or(&segs);
        if segs.len() >= 2 && segs.iter().all(|s| is_ident(s)) {
            return Some(Claim::Names(segs.iter().map(|s| s.to_string()).collect()));
        }
        return None;
    }
    if call && is_ident(head) && head.contains('_') {
        return Some(Claim::Names(vec![head.to_owned()]));
    }
    if !call && is_camel(head) {
        return Some(Claim::Names(vec![head.to_owned()]));
    }
    None
}

/// The backticked spans of a Markdown text outside fenced code blocks, with their line numbers
/// (a span does not cross a line).
fn backticked(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(open) = rest.find('`') {
            // A run of backticks opens a span closed by a run of the same length.
            let run = rest[open..].chars().take_while(|c| *c == '`').count();
            let after = &rest[open + run..];
            let fence = "`".repeat(run);
            let Some(close) = after.find(&fence) else {
                break;
            };
            let span = after[..close].trim();
            if !span.is_empty() {
                out.push((i + 1, span.to_owned()));
            }
            rest = &after[close + run..];
        }
    }
    out
}

/// Whether the path a doc names exists: from the root, under `crates/`, or under a crate or its
/// `src/` (docs name `client/rings.rs` inside the crate they talk about).
fn path_exists(root: &Path, path: &str) -> bool {
    let rel = Path::new(path);
    if root.join(rel).exists() || root.join("crates").join(rel).exists() {
        return true;
    }
    let Ok(entries) = fs::read_dir(root.join("crates")) else {
        return false;
    };
    entries.flatten().any(|e| {
        let c = e.path();
        c.join(rel).exists() || c.join("src").join(rel).exists()
    })
}

/// What the sources hold, as the checks read them.
#[derive(Debug, Default)]
struct Sources {
    /// Every identifier in the sources, comments included, and every source file's stem and
    /// folder name.
    words: BTreeSet<String>,
    /// The same without the words that only Rust comments hold.
    code_words: BTreeSet<String>,
    /// The snake_case names Rust comments put in backticks: `(file, line, name)`.
    comment_names: Vec<(String, usize, String)>,
}

/// Reads the sources under [`SOURCE_DIRS`] (and the root manifest).
fn read_sources(root: &Path) -> Result<Sources> {
    let mut src = Sources::default();
    let manifest = fs::read_to_string(root.join("Cargo.toml")).context("reading Cargo.toml")?;
    add_words(&manifest, &mut src.words);
    add_words(&manifest, &mut src.code_words);
    let mut stack: Vec<PathBuf> = SOURCE_DIRS.iter().map(|d| root.join(d)).collect();
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            let Ok(kind) = e.file_type() else { continue };
            if kind.is_dir() {
                if !matches!(name.as_str(), "target" | ".git" | "__pycache__" | ".venv") {
                    src.words.insert(name.clone());
                    src.code_words.insert(name);
                    stack.push(path);
                }
                continue;
            }
            let ext = path.extension().and_then(|x| x.to_str()).unwrap_or("");
            let script = path.parent().and_then(Path::file_name) == Some(".ci".as_ref());
            if !(SOURCE_EXTENSIONS.contains(&ext) || script) {
                continue;
            }
            if let Some(stem) = path.file_stem().and_then(|s| s.to_str()) {
                src.words.insert(stem.to_owned());
                src.code_words.insert(stem.to_owned());
            }
            let Ok(text) = fs::read_to_string(&path) else {
                continue;
            };
            add_words(&text, &mut src.words);
            if ext != "rs" {
                add_words(&text, &mut src.code_words);
                continue;
            }
            let rel = path
                .strip_prefix(root)
                .unwrap_or(&path)
                .to_string_lossy()
                .into_owned();
            for (i, line) in text.lines().enumerate() {
                let (code, comment) = match line.find("//") {
                    Some(at) => (&line[..at], &line[at..]),
                    None => (line, ""),
                };
                add_words(code, &mut src.code_words);
                for (_, span) in backticked(comment) {
                    if is_snake_name(&span) {
                        src.comment_names.push((rel.clone(), i + 1, span));
                    }
                }
            }
        }
    }
    Ok(src)
}

/// A snake_case name with an underscore inside, as functions, tests and fields are named (not a
/// prefix such as `fuzz_`).
fn is_snake_name(s: &str) -> bool {
    is_ident(s)
        && s.trim_end_matches('_').contains('_')
        && !s.ends_with('_')
        && s.starts_with(|c: char| c.is_ascii_lowercase())
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// How a doc names a section of another (or itself).
#[derive(Debug, PartialEq, Eq)]
enum Ref {
    /// By the start of its title, in quotes: `decisions.md, "io_uring on loopback"`.
    Title(String),
    /// By a link's anchor: `[x](performance.md#soak-issue-17)`, `[x](#soak-issue-17)`.
    Anchor(String),
}

/// The sections a Markdown text names, as `(line, doc, section)`: a `NAME.md` followed (after a
/// closing backtick or bracket, a comma or an opening parenthesis) by a quoted title, and every
/// link with an anchor. A doc of `""` is the text itself.
fn section_refs(text: &str) -> Vec<(usize, String, Ref)> {
    let mut out = Vec::new();
    let line_of = |at: usize| text[..at].matches('\n').count() + 1;
    for (at, _) in text.match_indices(".md") {
        let start = text[..at]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || "_-/".contains(c)))
            .map_or(0, |i| i + 1);
        let name = &text[start..at + 3];
        if name.len() <= 3 {
            continue;
        }
        let rest = &text[at + 3..];
        let rest = rest.trim_start_matches(['`', ']', ')']);
        // A link's target: `](performance.md)` then the title.
        let rest = match rest.strip_prefix('(') {
            Some(r) if r.starts_with(name) => r[name.len()..].trim_start_matches(')'),
            _ => rest,
        };
        let rest = rest
            .strip_prefix(',')
            .or_else(|| rest.strip_prefix(" ("))
            .unwrap_or("");
        let Some(quoted) = rest.trim_start().strip_prefix('"') else {
            continue;
        };
        let Some(end) = quoted.find('"') else {
            continue;
        };
        let title = quoted[..end]
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        if !title.is_empty() && !title.contains('`') {
            out.push((line_of(at), name.to_owned(), Ref::Title(title)));
        }
    }
    for (at, _) in text.match_indices("](") {
        let target = &text[at + 2..];
        let Some(end) = target.find(')') else {
            continue;
        };
        let target = &target[..end];
        if let Some((doc, anchor)) = target.split_once('#')
            && (doc.is_empty() || doc.ends_with(".md"))
            && !doc.contains("://")
        {
            out.push((line_of(at), doc.to_owned(), Ref::Anchor(anchor.to_owned())));
        }
    }
    out
}

/// The doc a reference in `from` names: itself for `""`, else the path from the root, beside
/// `from`, or in `docs/`; `None` for a doc the tree does not hold (another project's).
fn doc_named(root: &Path, from: &Path, name: &str) -> Option<PathBuf> {
    if name.is_empty() {
        return Some(from.to_path_buf());
    }
    let beside = from.parent().map(|d| d.join(name));
    [
        Some(root.join(name)),
        beside,
        Some(root.join("docs").join(name)),
    ]
    .into_iter()
    .flatten()
    .find(|p| p.is_file())
}

/// The headings of a Markdown text outside fenced blocks, without their `#`s and backticks.
fn headings(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced && let Some(h) = line.strip_prefix('#') {
            let h = h.trim_start_matches('#');
            if h.starts_with(' ') {
                out.push(h.trim().replace('`', ""));
            }
        }
    }
    out
}

/// A heading's anchor as GitHub makes it: lower case, spaces to `-`, every other character but
/// letters, digits, `-` and `_` dropped.
fn slug(heading: &str) -> String {
    heading
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c.to_ascii_lowercase()),
            _ => None,
        })
        .collect()
}

fn add_words(text: &str, words: &mut BTreeSet<String>) {
    for w in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        if is_ident(w) {
            words.insert(w.to_owned());
        }
    }
}

/// `(folder, package name)` of each crate under `crates/`, in folder order.
fn crates(root: &Path) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for e in fs::read_dir(root.join("crates")).context("reading crates/")? {
        let dir = e?.path();
        let Ok(manifest) = fs::read_to_string(dir.join("Cargo.toml")) else {
            continue;
        };
        let package = package_name(&manifest)
            .with_context(|| format!("no package name in {}/Cargo.toml", dir.display()))?;
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        out.push((name, package));
    }
    out.sort();
    Ok(out)
}

/// The `name` of a manifest's `[package]` table.
fn package_name(manifest: &str) -> Option<String> {
    let mut in_package = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_package = line == "[package]";
            continue;
        }
        if in_package && let Some(v) = line.strip_prefix("name") {
            let v = v.trim_start().strip_prefix('=')?.trim();
            return Some(v.trim_matches('"').to_owned());
        }
    }
    None
}

/// Whether section 1's layout block of `architecture` has a row `  dir/  package ...`.
fn layout_has_row(architecture: &str, dir: &str, package: &str) -> bool {
    let Some(start) = architecture.find("## 1. Layout") else {
        return false;
    };
    let section = &architecture[start..];
    let section = section[3..]
        .find("\n## ")
        .map_or(section, |end| &section[..end + 3]);
    let row = format!("{dir}/");
    section.lines().any(|l| {
        let mut cols = l.split_whitespace();
        cols.next() == Some(row.as_str()) && cols.next() == Some(package)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Option<Claim> {
        Some(Claim::Names(v.iter().map(|s| s.to_string()).collect()))
    }

    #[test]
    fn only_tokens_that_look_like_ours_are_claims() {
        assert_eq!(
            claim("crates/core/src/stream/mod.rs"),
            Some(Claim::Path("crates/core/src/stream/mod.rs".into()))
        );
        assert_eq!(
            claim("tests/tests/"),
            Some(Claim::Path("tests/tests/".into()))
        );
        assert_eq!(
            claim("TransferEngine::list_segments"),
            names(&["TransferEngine", "list_segments"])
        );
        assert_eq!(
            claim("Engine::connect(addr, opts)"),
            names(&["Engine", "connect"])
        );
        assert_eq!(claim("check_xfer_state()"), names(&["check_xfer_state"]));
        assert_eq!(claim("ClientStream"), names(&["ClientStream"]));
        assert_eq!(claim("::std::io"), names(&["std", "io"]));
        for not_checked in [
            "/proc/self/mountinfo",
            "~/.cache/ferry",
            "http://x/y.md",
            "ferry pull --into DIR",
            "FERRY_AUTH_KEY_FILE",
            "EOPNOTSUPP",
            "Engine",
            "engine.register(buf)",
            "len()",
            "4 KiB",
            "a/b",
            "crates/*/src",
            "x::<T>::f",
            "f(x",
            "../up.md",
            "ram/",
            ".gpu-bundle/",
        ] {
            assert_eq!(claim(not_checked), None, "{not_checked}");
        }
    }

    #[test]
    fn spans_are_read_outside_fences_with_their_lines() {
        let text = "a `one` b ``two ` x`` c\n```\n`fenced`\n```\n`three` and `unclosed\n";
        assert_eq!(
            backticked(text),
            vec![
                (1, "one".to_owned()),
                (1, "two ` x".to_owned()),
                (5, "three".to_owned())
            ]
        );
    }

    #[test]
    fn sections_named_by_title_or_anchor_are_found() {
        let text = "see `docs/perf.md`, \"One job\nqueue\" and decisions.md (\"io_uring on\") \
                    and [p](perf.md), \"The API\" and [s](#soak-issue-17) and \
                    [x](https://h/a.md#z) and `x.md` alone";
        let refs = section_refs(text);
        assert_eq!(
            refs,
            vec![
                (
                    1,
                    "docs/perf.md".to_owned(),
                    Ref::Title("One job queue".into())
                ),
                (
                    2,
                    "decisions.md".to_owned(),
                    Ref::Title("io_uring on".into())
                ),
                (2, "perf.md".to_owned(), Ref::Title("The API".into())),
                (2, "".to_owned(), Ref::Anchor("soak-issue-17".into())),
            ]
        );
        assert_eq!(
            headings("# A\n```\n# not\n```\n## Small ops (issue 18): `bench`\n#no\n"),
            vec!["A".to_owned(), "Small ops (issue 18): bench".to_owned()]
        );
        assert_eq!(
            slug("Where the io_uring server's CPU goes"),
            "where-the-io_uring-servers-cpu-goes"
        );
        assert_eq!(
            slug("Small ops (issue 18): cargo xtask bench small"),
            "small-ops-issue-18-cargo-xtask-bench-small"
        );
    }

    #[test]
    fn manifests_and_layout_rows() {
        let m = "[package]\nname = \"ferry-net\"\n[dependencies]\nname = \"no\"\n";
        assert_eq!(package_name(m).as_deref(), Some("ferry-net"));
        assert_eq!(package_name("[workspace]\nname = \"x\"\n"), None);
        let arch = "# A\n## 1. Layout\n```\ncrates/\n  net/   ferry-net   sockets\n```\n\
                    ## 2. Other\n  file/ ferry-file\n";
        assert!(layout_has_row(arch, "net", "ferry-net"));
        assert!(!layout_has_row(arch, "net", "ferry-other"));
        // A row outside section 1 does not count.
        assert!(!layout_has_row(arch, "file", "ferry-file"));
    }

    #[test]
    fn a_missing_name_or_path_is_found_in_a_tree() {
        let dir = std::env::temp_dir().join(format!("ferry-tidy-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let w = |p: &str, t: &str| {
            let p = dir.join(p);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, t).unwrap();
        };
        w("Cargo.toml", "[workspace]\n");
        w("crates/net/Cargo.toml", "[package]\nname = \"ferry-net\"\n");
        w(
            "crates/net/src/lib.rs",
            "pub struct SocketTuning;\nfn tune_socket() {}\n\
             // `tune_socket` and `fuzz_` and `Not_snake` are fine; `gone_helper` is not\n",
        );
        w(
            "crates/file/Cargo.toml",
            "[package]\nname = \"ferry-file\"\n",
        );
        w(
            "docs/architecture.md",
            "## 1. Layout\n```\n  net/  ferry-net\n```\n",
        );
        w(
            "docs/a.md",
            "`SocketTuning`, `tune_socket()`, `src/lib.rs`, `net/src/lib.rs`, \
             `crates/net/Cargo.toml`\n\n`GoneType` and `gone_fn()` and `crates/net/src/gone.rs`\n\
             architecture.md, \"1. Layout\"; architecture.md, \"2. Gone\"; [g](#nowhere)\n",
        );
        w("README.md", "`net::SocketTuning`\n");
        let (checked, problems) = check(&dir).unwrap();
        let _ = fs::remove_dir_all(&dir);
        assert_eq!(checked, 14);
        assert_eq!(
            problems,
            vec![
                "docs/a.md:3: `GoneType`: GoneType found nowhere in the sources".to_owned(),
                "docs/a.md:3: `gone_fn()`: gone_fn found nowhere in the sources".to_owned(),
                "docs/a.md:3: `crates/net/src/gone.rs`: no such path".to_owned(),
                "docs/a.md:4: architecture.md: no section \"2. Gone\"".to_owned(),
                "docs/a.md:4: : no heading for #nowhere".to_owned(),
                "crates/net/src/lib.rs:3: a comment names `gone_helper`, found nowhere in the \
                 code"
                    .to_owned(),
                "docs/architecture.md: the layout (section 1) has no row `  file/  ferry-file` \
                 for crates/file"
                    .to_owned(),
            ]
        );
    }

    #[test]
    fn the_docs_name_only_what_the_tree_holds() {
        let (checked, problems) = check(&project_root()).unwrap();
        assert!(checked > 300, "only {checked} names and paths checked");
        assert!(
            problems.is_empty(),
            "cargo xtask tidy:\n{}",
            problems.join("\n")
        );
    }
}

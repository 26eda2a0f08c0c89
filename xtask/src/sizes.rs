//! The house's size limits, checked by `cargo xtask tidy`: no library source file over
//! [`MAX_FILE_LINES`] lines before its tests, no function over [`MAX_FN_LINES`] lines.
//!
//! The library sources ([`library_sources`]) are the `.rs` files under each `crates/*/src` and
//! under `xtask/src`, less the generated bindings ([`GENERATED`]) and the files of test-only
//! modules (a `#[cfg(test)] mod NAME;` names one: its file, and its folder if it has one; as
//! `cargo xtask module-loops` reads them). A file's library part ends where its
//! inline test module starts: the first `#[cfg(test)]` whose item is a `mod NAME {`. A function
//! is found by indentation, as rustfmt lays code out: a line that declares an `fn` opens it, the
//! first line after it that ends in `{` opens its body, and the next line that is only `}` at the
//! `fn`'s own indentation closes it; its length counts every line from the `fn` to that `}`. A
//! declaration without a body (`fn f();`) and a body on one line are not counted. Exceptions go
//! in [`ALLOWED`] with the reason (a table of constants, say, or a split under way).

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::module_loops::{sources_in, test_only_files};

/// The most lines a library source file may have before its tests.
pub(crate) const MAX_FILE_LINES: usize = 1200;

/// The most lines one function may have, its signature and closing brace included.
pub(crate) const MAX_FN_LINES: usize = 150;

/// Folders of generated code, relative to the root: not held to the limits.
const GENERATED: &[&str] = &["crates/verbs-sys/src/sys"];

/// Exceptions: `(file relative to the root, the function, or "" for the file's own size, why)`.
/// An entry that no longer excuses anything is itself a problem, so the list stays true.
const ALLOWED: &[(&str, &str, &str)] = &[];

/// The source folders under `root` whose files are library sources: each crate's `src/`, and
/// xtask's (a binary, but code the house keeps to the same rules).
fn source_dirs(root: &Path) -> Result<Vec<PathBuf>> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(root.join("crates"))
        .context("reading crates/")?
        .map(|e| e.map(|e| e.path().join("src")))
        .collect::<Result<_, _>>()?;
    dirs.sort();
    dirs.push(root.join("xtask/src"));
    dirs.retain(|d| d.is_dir());
    Ok(dirs)
}

/// Every library source under `root`: its path relative to the root (with `/`), and its text.
pub(crate) fn library_sources(root: &Path) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for src in source_dirs(root)? {
        let sources = sources_in(&src)?;
        let tests = test_only_files(&sources);
        for (rel, text) in sources {
            let path = src.strip_prefix(root).unwrap_or(&src).join(&rel);
            if tests.iter().any(|t| rel.starts_with(t))
                || GENERATED.iter().any(|g| path.starts_with(g))
            {
                continue;
            }
            out.push((path.to_string_lossy().replace('\\', "/"), text));
        }
    }
    Ok(out)
}

/// How many files were checked under `root`, and every file or function over its limit that
/// [`ALLOWED`] does not excuse, one line each (`path:line: ...`).
pub(crate) fn check(root: &Path) -> Result<(usize, Vec<String>)> {
    let sources = library_sources(root)?;
    let mut problems = Vec::new();
    let mut used = vec![false; ALLOWED.len()];
    for (shown, text) in &sources {
        for p in problems_in(text, MAX_FILE_LINES, MAX_FN_LINES) {
            let allowed = ALLOWED.iter().position(|(file, name, _)| {
                file == shown
                    && match &p {
                        Problem::File { .. } => name.is_empty(),
                        Problem::Fn { name: f, .. } => f == name,
                    }
            });
            match allowed {
                Some(i) => used[i] = true,
                None => problems.push(format!("{shown}:{p}")),
            }
        }
    }
    for ((file, name, _), used) in ALLOWED.iter().zip(used) {
        if !used {
            let what = if name.is_empty() { "its size" } else { name };
            problems.push(format!(
                "xtask/src/sizes.rs: ALLOWED excuses {file} ({what}), which keeps to the limits \
                 now: remove the entry"
            ));
        }
    }
    Ok((sources.len(), problems))
}

/// A file or function over its limit.
#[derive(Debug, PartialEq, Eq)]
enum Problem {
    /// The file has `lines` lines before its tests.
    File { lines: usize },
    /// Function `name`, declared at `line` (1-based), has `lines` lines.
    Fn {
        name: String,
        line: usize,
        lines: usize,
    },
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Problem::File { lines } => write!(
                f,
                "1: {lines} lines before its tests, more than {MAX_FILE_LINES}: split it along its \
                 concerns"
            ),
            Problem::Fn { name, line, lines } => write!(
                f,
                "{line}: fn {name} has {lines} lines, more than {MAX_FN_LINES}: split it into named \
                 helpers"
            ),
        }
    }
}

/// What of one file's text is over the limits: the library part (before the inline test
/// module) against `max_file`, each function in it against `max_fn`.
fn problems_in(text: &str, max_file: usize, max_fn: usize) -> Vec<Problem> {
    let lines: Vec<&str> = text.lines().collect();
    let lib = &lines[..tests_start(&lines)];
    let mut out = Vec::new();
    if lib.len() > max_file {
        out.push(Problem::File { lines: lib.len() });
    }
    for (at, line) in lib.iter().enumerate() {
        let Some((indent, name)) = fn_decl(line) else {
            continue;
        };
        // The signature ends where the body opens (`{`), where a declaration without a body
        // ends (`;`), or on a line that holds a whole body (`{ ... }`).
        let Some(open) = (at..lib.len()).find(|&k| {
            let t = lib[k].trim_end();
            t.ends_with('{') || t.ends_with(';') || t.contains('{')
        }) else {
            continue;
        };
        if !lib[open].trim_end().ends_with('{') {
            continue;
        }
        let close = format!("{}}}", " ".repeat(indent));
        if let Some(end) = (open + 1..lib.len()).find(|&k| lib[k].trim_end() == close) {
            let n = end - at + 1;
            if n > max_fn {
                out.push(Problem::Fn {
                    name,
                    line: at + 1,
                    lines: n,
                });
            }
        }
    }
    out
}

/// The index of the line where the file's inline test module starts: its first `#[cfg(test)]`
/// whose item (after any other attributes) is a `mod NAME {`; the line count when none.
fn tests_start(lines: &[&str]) -> usize {
    (0..lines.len())
        .find(|&i| {
            lines[i].trim() == "#[cfg(test)]"
                && lines[i + 1..]
                    .iter()
                    .map(|l| l.trim())
                    .find(|l| !l.starts_with("#["))
                    .is_some_and(|item| {
                        let item = item
                            .trim_start_matches("pub(crate) ")
                            .trim_start_matches("pub ");
                        item.starts_with("mod ") && item.ends_with('{')
                    })
        })
        .unwrap_or(lines.len())
}

/// The indentation and name of the function a line declares (`pub(crate) async fn name(`).
fn fn_decl(line: &str) -> Option<(usize, String)> {
    let body = line.trim_start();
    let indent = line.len() - body.len();
    let mut rest = body;
    loop {
        let word_end = rest.find([' ', '(']).unwrap_or(rest.len());
        let word = &rest[..word_end];
        if word == "fn" {
            let name: String = rest[2..]
                .trim_start()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            return (!name.is_empty()).then_some((indent, name));
        }
        let skip = match word {
            "pub" if rest.starts_with("pub(") => rest.find(')')? + 1,
            "pub" | "const" | "async" | "unsafe" | "default" => word_end,
            "extern" => {
                // `extern "C" fn`.
                let after = rest[word_end..].trim_start();
                let abi = after.strip_prefix('"')?.find('"')? + 2;
                rest.len() - after.len() + abi
            }
            _ => return None,
        };
        rest = rest[skip..].trim_start();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A function of `body` lines between its `fn` line and its closing brace, at `indent`.
    fn function(name: &str, indent: usize, body: usize) -> String {
        let pad = " ".repeat(indent);
        let mut s =
            format!("{pad}pub(crate) async fn {name}(\n{pad}    x: u32,\n{pad}) -> u32 {{\n");
        for _ in 0..body {
            s += &format!("{pad}    let _ = x;\n");
        }
        s + &format!("{pad}}}\n")
    }

    #[test]
    fn a_long_function_or_file_fails_and_tests_do_not_count() {
        // 3 signature lines + 10 + the brace: 14 lines.
        let long = function("long", 4, 10);
        let short = function("short", 0, 9);
        let text = format!("impl X {{\n{long}}}\n{short}");
        assert_eq!(
            problems_in(&text, 100, 13),
            [Problem::Fn {
                name: "long".into(),
                line: 2,
                lines: 14
            }]
        );
        assert!(problems_in(&text, 100, 14).is_empty());
        // The file: 16 + 13 lines before its tests; what follows them is not counted.
        let tests = format!(
            "#[cfg(test)]\n#[allow(unused)]\nmod tests {{\n{}}}\n",
            function("t", 4, 50)
        );
        let with_tests = format!("{text}{tests}");
        assert_eq!(problems_in(&with_tests, 29, 14), []);
        assert_eq!(
            problems_in(&with_tests, 28, 14),
            [Problem::File { lines: 29 }]
        );
        // A `#[cfg(test)]` item that is not the test module does not end the library part.
        let gated = format!("#[cfg(test)]\nmod sim;\n{long}");
        assert_eq!(problems_in(&gated, 100, 13).len(), 1);
    }

    #[test]
    fn declarations_and_one_line_bodies_are_not_functions_to_measure() {
        assert_eq!(
            fn_decl("    pub(crate) fn run(args: &[String]) -> Result<()> {"),
            Some((4, "run".into()))
        );
        assert_eq!(
            fn_decl("pub const unsafe extern \"C\" fn cb(x: u8) {"),
            Some((0, "cb".into()))
        );
        assert_eq!(fn_decl("    // fn commented() {"), None);
        assert_eq!(fn_decl("    let f = fn_ptr;"), None);
        let text = "trait T {\n    fn f(&self);\n    fn g(&self) -> u8 { 1 }\n}\n";
        assert!(problems_in(text, 100, 1).is_empty());
    }

    /// The tree itself keeps to the limits (with the reasoned exceptions).
    #[test]
    fn the_tree_keeps_to_the_limits() {
        let (checked, problems) = check(&crate::util::project_root()).unwrap();
        assert!(checked > 50, "only {checked} files found");
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }
}

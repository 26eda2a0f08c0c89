//! Checked by `cargo xtask tidy`: every library source ([`crate::sizes::library_sources`]: each
//! crate's `src/` and xtask's, less generated bindings and test-only modules) opens with its
//! contract, a `//!` comment on its first line saying what the module is for and what it
//! promises. A file that opens with anything else (a `use`, an attribute, a blank line, a `//`
//! comment) is a problem named by its path.

use std::path::Path;

use anyhow::Result;

/// How many files were checked under `root`, and every one that does not open with its `//!`
/// contract, one line each (`path:1: ...`).
pub(crate) fn check(root: &Path) -> Result<(usize, Vec<String>)> {
    let sources = crate::sizes::library_sources(root)?;
    let problems = sources
        .iter()
        .filter(|(_, text)| !opens_with_contract(text))
        .map(|(path, _)| {
            format!(
                "{path}:1: does not open with its `//!` contract: say in a `//!` comment on its \
                 first line what the module is for and what it promises"
            )
        })
        .collect();
    Ok((sources.len(), problems))
}

/// Whether `text`'s first line is a `//!` comment with something in it.
fn opens_with_contract(text: &str) -> bool {
    text.lines()
        .next()
        .and_then(|l| l.strip_prefix("//!"))
        .is_some_and(|rest| !rest.trim().is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_opens_with_its_contract_or_is_a_problem() {
        assert!(opens_with_contract("//! The pump.\n\nuse std::fs;\n"));
        assert!(!opens_with_contract("use std::fs;\n"));
        assert!(!opens_with_contract("\n//! Late.\n"));
        assert!(!opens_with_contract("// generated, do not edit\n"));
        assert!(!opens_with_contract(
            "#![forbid(unsafe_code)]\n//! After.\n"
        ));
        assert!(!opens_with_contract("//!\n//! Blank first.\n"));
        assert!(!opens_with_contract(""));
    }

    /// A tree with a crate whose one module lacks its contract: that file, and only it, fails.
    #[test]
    fn a_file_without_its_contract_is_found_in_a_tree() {
        let root = std::env::temp_dir().join(format!("xtask-contracts-{}", std::process::id()));
        let src = root.join("crates/a/src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("lib.rs"), "//! Crate a.\n\nmod bare;\n").unwrap();
        std::fs::write(src.join("bare.rs"), "use std::fs;\n").unwrap();
        let found = check(&root);
        std::fs::remove_dir_all(&root).unwrap();
        let (checked, problems) = found.unwrap();
        assert_eq!(checked, 2);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].starts_with("crates/a/src/bare.rs:1: does not open"),
            "{problems:?}"
        );
    }

    /// The tree itself: every library file opens with its contract.
    #[test]
    fn every_library_file_opens_with_its_contract() {
        let (checked, problems) = check(&crate::util::project_root()).unwrap();
        assert!(checked > 50, "only {checked} files found");
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }
}

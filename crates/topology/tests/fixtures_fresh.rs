//! The committed fixtures are exactly what `tests/fixtures/gen.py` writes: regenerate into a
//! temporary directory and compare every file and symlink.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Debug, PartialEq, Eq)]
enum Entry {
    Dir,
    File(String),
    Link(PathBuf),
}

fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Entry>) {
    for e in fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        let rel = path.strip_prefix(root).unwrap().to_path_buf();
        let meta = fs::symlink_metadata(&path).unwrap();
        if meta.file_type().is_symlink() {
            out.insert(rel, Entry::Link(fs::read_link(&path).unwrap()));
        } else if meta.is_dir() {
            out.insert(rel, Entry::Dir);
            walk(root, &path, out);
        } else {
            out.insert(rel, Entry::File(fs::read_to_string(&path).unwrap()));
        }
    }
}

fn tree(root: &Path) -> BTreeMap<PathBuf, Entry> {
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out.retain(|p, _| !p.starts_with("gen.py") && !p.starts_with("__pycache__"));
    out
}

#[test]
fn fixtures_match_generator() {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let tmp = tempfile::tempdir().unwrap();
    let status = match Command::new("python3")
        .arg(here.join("gen.py"))
        .arg("--check")
        .arg(tmp.path())
        .status()
    {
        Ok(s) => s,
        Err(e) => {
            ferry_tests::require_or_skip(
                ferry_tests::TOOLS,
                format!("python3 is not runnable here ({e})"),
            );
            return;
        }
    };
    assert!(status.success(), "gen.py failed: {status}");
    let (committed, fresh) = (tree(&here), tree(tmp.path()));
    for (path, entry) in &fresh {
        assert_eq!(
            committed.get(path),
            Some(entry),
            "{} differs: run python3 crates/topology/tests/fixtures/gen.py",
            path.display()
        );
    }
    for path in committed.keys() {
        assert!(
            fresh.contains_key(path),
            "{} is not generated",
            path.display()
        );
    }
}

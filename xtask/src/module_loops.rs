//! `cargo xtask module-loops`: no import loop between the top-level modules of a crate.
//!
//! Inside a crate, imports point down as between crates (`docs/architecture.md`, "Layers"). This
//! check reads every `crate::` path (and the `super::` paths that leave a top-level module) in
//! the non-test code of the crates in [`CRATES`], maps each to the top-level module it names
//! (a name the crate root re-exports counts as the module it comes from), and fails on a loop,
//! naming each module of it and the names that tie one to the next. It reads tokens, not
//! meaning: a path in a string literal would count, and a `#[cfg(test)] mod tests` at the end of
//! a file is left out with everything after it.
//!
//! A module folder in [`FOLDERS`] is checked the same way, as if it were a crate of its own: its
//! `mod.rs` is the root, `crate::FOLDER::NAME` and (from its top files) `super::NAME` name its
//! modules, and any other `crate::` path leaves it.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::util::project_root;

/// The crates whose modules must not import in a loop, relative to the project root: every crate
/// with modules (`net` is one file).
pub(crate) const CRATES: &[&str] = &[
    "crates/engine/src",
    "crates/core/src",
    "crates/python/src",
    "crates/broadcast/src",
    "crates/cli/src",
    "crates/cuda/src",
    "crates/file/src",
    "crates/registry/src",
    "crates/topology/src",
    "crates/transport-tcp/src",
    "crates/verbs-sys/src",
    "crates/transport-rdma/src",
    "crates/transport-local/src",
    "crates/transport-uring/src",
];

/// Module folders whose own modules must not import in a loop either: (the folder relative to
/// the project root, its module path in its crate).
pub(crate) const FOLDERS: &[(&str, &str)] = &[
    ("crates/transport-uring/src/server", "server"),
    ("crates/transport-uring/src/client", "client"),
    ("crates/transport-uring/src/ring", "ring"),
    ("crates/core/src/wire", "wire"),
];

pub(crate) fn run(args: &[String]) -> Result<()> {
    let edges = match args {
        [] => false,
        [flag] if flag == "--edges" => true,
        _ => bail!("usage: cargo xtask module-loops [--edges]"),
    };
    let root = project_root();
    let mut failed = false;
    let units = CRATES
        .iter()
        .map(|dir| (*dir, None))
        .chain(FOLDERS.iter().map(|(dir, module)| (*dir, Some(*module))));
    for (dir, module) in units {
        let graph = match module {
            None => Graph::read(&root.join(dir))?,
            Some(module) => Graph::read_folder(&root.join(dir), module)?,
        };
        if edges {
            for (from, tos) in &graph.edges {
                for (to, names) in tos {
                    let names = names.iter().cloned().collect::<Vec<_>>().join(", ");
                    println!("{dir}: {from} -> {to} ({names})");
                }
            }
        }
        let loops = graph.loops();
        if loops.is_empty() {
            eprintln!("{dir}: {} modules, no import loop", graph.modules.len());
        } else {
            failed = true;
            eprintln!("{dir}: import loops:\n{}", loops.join("\n"));
        }
    }
    if failed {
        bail!("module import loops (see above)");
    }
    Ok(())
}

/// The imports between the top-level modules of one crate: `from -> to -> names used`.
#[derive(Debug, Default)]
pub(crate) struct Graph {
    modules: BTreeSet<String>,
    edges: BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
}

impl Graph {
    /// Reads the crate whose `lib.rs` stands in `src`.
    pub(crate) fn read(src: &Path) -> Result<Graph> {
        Ok(Graph::from_sources(&sources_in(src)?))
    }

    /// Reads the module folder `dir` (with its `mod.rs`), the crate's module `module`.
    pub(crate) fn read_folder(dir: &Path, module: &str) -> Result<Graph> {
        Ok(Graph::from_folder_sources(&sources_in(dir)?, module))
    }

    /// The graph of module folder `module` given as `path relative to the folder -> text`:
    /// `crate::module::` paths become the folder's `crate::` paths, any other `crate::` path one
    /// that names none of its modules.
    pub(crate) fn from_folder_sources(sources: &BTreeMap<PathBuf, String>, module: &str) -> Graph {
        let own = format!("crate::{module}::");
        let sources = sources
            .iter()
            .map(|(rel, text)| {
                let text = text
                    .replace(&own, "\u{1}")
                    .replace("crate::", "outside::")
                    .replace('\u{1}', "crate::");
                (rel.clone(), text)
            })
            .collect();
        Graph::from_sources(&sources)
    }

    /// The graph of a crate given as `path relative to src -> text`.
    pub(crate) fn from_sources(sources: &BTreeMap<PathBuf, String>) -> Graph {
        let mut graph = Graph::default();
        for rel in sources.keys() {
            if let Some(m) = top_module(rel) {
                graph.modules.insert(m);
            }
        }
        let tests = test_only_files(sources);
        let lib = sources
            .get(Path::new("lib.rs"))
            .or_else(|| sources.get(Path::new("main.rs")))
            .or_else(|| sources.get(Path::new("mod.rs")))
            .map(|t| code_of(t))
            .unwrap_or_default();
        let reexports = reexports(&lib, &graph.modules);
        for (rel, text) in sources {
            let Some(from) = top_module(rel) else {
                continue;
            };
            if tests.iter().any(|t| rel.starts_with(t)) {
                continue;
            }
            let nested = rel.components().count() > 1 && !rel.ends_with("mod.rs")
                || rel.components().count() > 2;
            let code = code_of(text);
            for (prefix, name, item) in paths(&code) {
                // `super::` leaves the top-level module only from its top file.
                if prefix == "super" && nested {
                    continue;
                }
                let to = if graph.modules.contains(&name) {
                    name.clone()
                } else if let Some(m) = reexports.get(&name) {
                    m.clone()
                } else {
                    continue;
                };
                if to != from {
                    let used = item.unwrap_or(name);
                    graph
                        .edges
                        .entry(from.clone())
                        .or_default()
                        .entry(to)
                        .or_default()
                        .insert(used);
                }
            }
        }
        graph
    }

    /// Each loop, as `a -> b (names) -> ... -> a`, one line per strongly connected set.
    pub(crate) fn loops(&self) -> Vec<String> {
        let mut out = Vec::new();
        for set in self.strongly_connected() {
            if set.len() < 2 {
                continue;
            }
            // Walk one cycle through the set from its first module.
            let start = set.iter().next().expect("non-empty").clone();
            let cycle = self.cycle_from(&start, &set);
            let mut line = format!(
                "  loop among {{{}}}: ",
                set.iter().cloned().collect::<Vec<_>>().join(", ")
            );
            for pair in cycle.windows(2) {
                let names = &self.edges[&pair[0]][&pair[1]];
                line += &format!(
                    "{} -> ({}) ",
                    pair[0],
                    names.iter().cloned().collect::<Vec<_>>().join(", ")
                );
            }
            line += &start;
            out.push(line);
        }
        out
    }

    fn targets(&self, m: &str) -> impl Iterator<Item = &String> {
        self.edges.get(m).into_iter().flat_map(|e| e.keys())
    }

    /// The shortest path from `start` back to itself inside `set` (breadth first).
    fn cycle_from(&self, start: &str, set: &BTreeSet<String>) -> Vec<String> {
        let mut prev: BTreeMap<String, String> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([start.to_string()]);
        while let Some(m) = queue.pop_front() {
            for t in self.targets(&m) {
                if !set.contains(t) {
                    continue;
                }
                if t == start {
                    let mut path = vec![start.to_string(), m.clone()];
                    let mut at = m.clone();
                    while let Some(p) = prev.get(&at) {
                        path.push(p.clone());
                        at = p.clone();
                    }
                    if path.last().map(String::as_str) != Some(start) {
                        path.push(start.to_string());
                    }
                    path.reverse();
                    path.dedup();
                    return path;
                }
                if !prev.contains_key(t) && t != start {
                    prev.insert(t.clone(), m.clone());
                    queue.push_back(t.clone());
                }
            }
        }
        vec![start.to_string()]
    }

    /// Tarjan's strongly connected components, in module order.
    fn strongly_connected(&self) -> Vec<BTreeSet<String>> {
        struct State<'a> {
            g: &'a Graph,
            index: BTreeMap<String, usize>,
            low: BTreeMap<String, usize>,
            stack: Vec<String>,
            on: BTreeSet<String>,
            out: Vec<BTreeSet<String>>,
        }
        fn visit(s: &mut State<'_>, v: &str) {
            let i = s.index.len();
            s.index.insert(v.to_string(), i);
            s.low.insert(v.to_string(), i);
            s.stack.push(v.to_string());
            s.on.insert(v.to_string());
            let targets: Vec<String> = s.g.targets(v).cloned().collect();
            for w in targets {
                if !s.index.contains_key(&w) {
                    visit(s, &w);
                    let lw = s.low[&w];
                    let lv = s.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if s.on.contains(&w) {
                    let iw = s.index[&w];
                    let lv = s.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if s.low[v] == s.index[v] {
                let mut set = BTreeSet::new();
                while let Some(w) = s.stack.pop() {
                    s.on.remove(&w);
                    let done = w == v;
                    set.insert(w);
                    if done {
                        break;
                    }
                }
                s.out.push(set);
            }
        }
        let mut s = State {
            g: self,
            index: BTreeMap::new(),
            low: BTreeMap::new(),
            stack: Vec::new(),
            on: BTreeSet::new(),
            out: Vec::new(),
        };
        for m in &self.modules {
            if !s.index.contains_key(m) {
                visit(&mut s, m);
            }
        }
        s.out
    }
}

/// The `.rs` files under `src`, as `path relative to src -> text`.
pub(crate) fn sources_in(src: &Path) -> Result<BTreeMap<PathBuf, String>> {
    let mut files = Vec::new();
    collect(src, &mut files)?;
    let mut sources = BTreeMap::new();
    for file in &files {
        let rel = file.strip_prefix(src).expect("under src");
        let text = fs::read_to_string(file).with_context(|| format!("{}", file.display()))?;
        sources.insert(rel.to_path_buf(), text);
    }
    Ok(sources)
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("{}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            collect(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// The top-level module a file belongs to (`None` for the crate root).
fn top_module(rel: &Path) -> Option<String> {
    let first = rel.components().next()?.as_os_str().to_str()?.to_string();
    if rel.components().count() == 1 {
        let stem = first.strip_suffix(".rs").unwrap_or(&first).to_string();
        // The crate root, a library's or a binary's (or a module folder's).
        (stem != "lib" && stem != "main" && stem != "mod").then_some(stem)
    } else {
        Some(first)
    }
}

/// The files (and folders) of the modules declared `#[cfg(test)] mod NAME;`.
pub(crate) fn test_only_files(sources: &BTreeMap<PathBuf, String>) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for (rel, text) in sources {
        let dir = match rel.file_name().and_then(|n| n.to_str()) {
            Some("lib.rs" | "mod.rs") => rel.parent().map(Path::to_path_buf).unwrap_or_default(),
            _ => rel.with_extension(""),
        };
        let mut lines = text.lines().map(str::trim).peekable();
        while let Some(line) = lines.next() {
            if line != "#[cfg(test)]" {
                continue;
            }
            let Some(next) = lines.peek() else { break };
            let decl = next
                .trim_start_matches("pub(crate) ")
                .trim_start_matches("pub ");
            if let Some(name) = decl.strip_prefix("mod ").and_then(|d| d.strip_suffix(';')) {
                out.push(dir.join(format!("{name}.rs")));
                out.push(dir.join(name));
            }
        }
    }
    out
}

/// The text of a file without comments and without its trailing `#[cfg(test)] mod tests`.
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t == "#[cfg(test)]"
            && lines
                .peek()
                .is_some_and(|n| n.trim_start().starts_with("mod tests"))
        {
            break;
        }
        let code = match t.find("//") {
            Some(0) => "",
            _ => line.split(" //").next().unwrap_or(line),
        };
        out.push_str(code);
        out.push('\n');
    }
    out
}

/// Every `crate::NAME` and `super::NAME` in `code`, with the names inside `crate::{…}` groups.
fn paths(code: &str) -> Vec<(&'static str, String, Option<String>)> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    for prefix in ["crate", "super"] {
        let needle = format!("{prefix}::");
        let mut from = 0;
        while let Some(at) = code[from..].find(&needle) {
            let start = from + at;
            from = start + needle.len();
            let before = start.checked_sub(1).map(|i| bytes[i]);
            if before
                .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b == b':')
            {
                continue;
            }
            let rest = &code[from..];
            let p = if prefix == "crate" { "crate" } else { "super" };
            if let Some(group) = rest.strip_prefix('{') {
                for name in group_heads(group) {
                    out.push((p, name, None));
                }
            } else {
                let name = ident(rest);
                if !name.is_empty() {
                    // The name used: the item after the module where there is one.
                    let after = &rest[name.len()..];
                    let item = after.strip_prefix("::").map(ident).unwrap_or_default();
                    out.push((p, name, if item.is_empty() { None } else { Some(item) }));
                }
            }
        }
    }
    out
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// The first segment of each path in a `{…}` group (the text after its `{`).
fn group_heads(group: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0usize;
    let mut at_head = true;
    let mut word = String::new();
    for c in group.chars() {
        if depth == 0 && at_head && (c.is_ascii_alphanumeric() || c == '_') {
            word.push(c);
            continue;
        }
        if !word.is_empty() {
            heads.push(std::mem::take(&mut word));
            at_head = false;
        }
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => at_head = true,
            _ => {}
        }
    }
    heads.retain(|h| h != "self");
    heads
}

/// `name -> module` for the names the crate root re-exports from its own modules.
fn reexports(lib: &str, modules: &BTreeSet<String>) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    for stmt in lib.split(';') {
        let Some(at) = stmt.find("use ") else {
            continue;
        };
        let path = stmt[at + 4..].trim();
        let head: String = path
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !modules.contains(&head) {
            continue;
        }
        let leaves = match path.find('{') {
            Some(open) => path[open + 1..].trim_end_matches('}').to_string(),
            None => path.rsplit("::").next().unwrap_or("").to_string(),
        };
        for leaf in leaves.split(',') {
            let leaf = leaf.trim();
            let name = leaf
                .rsplit(" as ")
                .next()
                .unwrap_or(leaf)
                .rsplit("::")
                .next()
                .unwrap_or("")
                .trim();
            if !name.is_empty() {
                map.entry(name.to_string()).or_insert_with(|| head.clone());
            }
        }
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(files: &[(&str, &str)]) -> Graph {
        Graph::from_sources(
            &files
                .iter()
                .map(|(p, t)| (PathBuf::from(p), t.to_string()))
                .collect(),
        )
    }

    #[test]
    fn a_loop_is_found_and_named_with_the_names_that_tie_it() {
        let g = graph(&[
            ("lib.rs", "mod a; mod b; mod c; pub use c::Thing;"),
            ("a.rs", "use crate::b::Bee;"),
            ("b.rs", "use crate::{Thing, self as _};"),
            ("c/mod.rs", "mod inner;"),
            ("c/inner.rs", "use super::x; fn f() { crate::a::go() }"),
        ]);
        let loops = g.loops();
        assert_eq!(loops.len(), 1, "{loops:?}");
        assert_eq!(
            loops[0],
            "  loop among {a, b, c}: a -> (Bee) b -> (Thing) c -> (go) a"
        );
    }

    #[test]
    fn tests_comments_macros_and_inner_super_paths_are_not_imports() {
        let g = graph(&[
            ("lib.rs", "mod a; mod b;"),
            (
                "a.rs",
                "use crate::b::B;\n// crate::b is fine\nmacro_rules! m { () => { $crate::a::X } }",
            ),
            (
                "b.rs",
                "pub(crate) struct B;\n#[cfg(test)]\nmod tests {\n    use crate::a::A;\n}",
            ),
        ]);
        assert!(g.loops().is_empty(), "{:?}", g.loops());
        assert_eq!(g.edges.len(), 1);
        let g = graph(&[
            ("lib.rs", "mod a; mod b;"),
            ("a.rs", "use crate::b::B;"),
            ("b/mod.rs", "#[cfg(test)]\nmod sim;"),
            ("b/sim.rs", "use crate::a::A;"),
        ]);
        assert!(
            g.loops().is_empty(),
            "a test-only module file is no import: {:?}",
            g.loops()
        );
        assert_eq!(g.edges.len(), 1);
    }

    #[test]
    fn a_module_folder_is_read_as_a_crate_of_its_own() {
        let files: BTreeMap<PathBuf, String> = [
            (
                "mod.rs",
                "mod a; mod b; mod c; use crate::other::X; pub(crate) use c::Cee;",
            ),
            ("a.rs", "use super::b::Bee; use crate::other::Y;"),
            ("b.rs", "use crate::server::Cee;"),
            (
                "c.rs",
                "use crate::a::Outside; fn f() { crate::server::a::go() }",
            ),
        ]
        .iter()
        .map(|(p, t)| (PathBuf::from(p), t.to_string()))
        .collect();
        let g = Graph::from_folder_sources(&files, "server");
        assert_eq!(
            g.modules.iter().cloned().collect::<Vec<_>>(),
            ["a", "b", "c"],
            "mod.rs is the folder's root"
        );
        let loops = g.loops();
        assert_eq!(loops.len(), 1, "{loops:?}");
        assert_eq!(
            loops[0], "  loop among {a, b, c}: a -> (Bee) b -> (Cee) c -> (go) a",
            "`crate::a` outside the folder is no edge; `crate::server::a` is"
        );
    }

    /// The loops of the crate in `dir`, which must have at least `modules` top-level modules
    /// (so a path gone wrong reads as a failure, not as a crate without loops).
    fn loops_of(dir: &str, modules: usize) -> Vec<String> {
        let g = Graph::read(&project_root().join(dir)).expect("read");
        assert!(g.modules.len() >= modules, "{dir}: too few modules read");
        g.loops()
    }

    #[test]
    fn the_core_has_no_module_loop() {
        let loops = loops_of("crates/core/src", 6);
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn the_engine_has_no_module_loop() {
        let loops = loops_of("crates/engine/src", 6);
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn the_python_binding_has_no_module_loop() {
        let loops = loops_of("crates/python/src", 6);
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn broadcast_has_no_module_loop() {
        let loops = loops_of("crates/broadcast/src", 6);
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn the_cli_has_no_module_loop() {
        let loops = loops_of("crates/cli/src", 6);
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn cuda_has_no_module_loop() {
        let loops = loops_of("crates/cuda/src", 4);
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn file_has_no_module_loop() {
        let loops = loops_of("crates/file/src", 2);
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn the_registry_has_no_module_loop() {
        let loops = loops_of("crates/registry/src", 4);
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn topology_has_no_module_loop() {
        let loops = loops_of("crates/topology/src", 6);
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn the_tcp_transport_has_no_module_loop() {
        let loops = loops_of("crates/transport-tcp/src", 5);
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn verbs_sys_has_no_module_loop() {
        let loops = loops_of("crates/verbs-sys/src", 5);
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn the_rdma_transport_has_no_module_loop() {
        let loops = loops_of("crates/transport-rdma/src", 10);
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn the_io_uring_transport_has_no_module_loop() {
        let loops = loops_of("crates/transport-uring/src", 8);
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn the_same_host_transport_has_no_module_loop() {
        let loops = loops_of("crates/transport-local/src", 4);
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn the_io_uring_server_has_no_module_loop() {
        let g = Graph::read_folder(&project_root().join(FOLDERS[0].0), FOLDERS[0].1).expect("read");
        assert!(g.modules.len() >= 8, "too few modules read");
        let loops = g.loops();
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn the_io_uring_client_has_no_module_loop() {
        let g = Graph::read_folder(&project_root().join(FOLDERS[1].0), FOLDERS[1].1).expect("read");
        assert!(g.modules.len() >= 5, "too few modules read");
        let loops = g.loops();
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }

    #[test]
    fn the_io_uring_ring_host_has_no_module_loop() {
        let g = Graph::read_folder(&project_root().join(FOLDERS[2].0), FOLDERS[2].1).expect("read");
        assert!(g.modules.len() >= 5, "too few modules read");
        let loops = g.loops();
        assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
    }
}

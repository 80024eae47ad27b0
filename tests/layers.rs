//! The layering of `src/` (ARCHITECTURE.md): each stage imports only itself and the stages
//! below it, and no module of a stage imports a module that imports it back (no circles).
//! Inside `src/passes/` the same holds for its parts, in the order `PASSES` gives. Read from the
//! source text: every `crate::stage::module` path and every `super::module`. And no code outside
//! `src/graph/` splices a node list by hand: `graph::patch` is the one way to edit a graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The stages of `src/`, lowest first. `text` and `error` are the base every stage uses.
const STAGES: [&str; 10] = [
    "text", "error", "io", "graph", "ce", "vocab", "passes", "jobs", "tools", "cli",
];

fn stage_rank(stage: &str) -> usize {
    STAGES
        .iter()
        .position(|s| *s == stage)
        .unwrap_or_else(|| panic!("'{stage}' is no stage of src/: add it to STAGES in order"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/graph/ranks.rs` → ["graph", "ranks"]; `src/ce/forms/mod.rs` → ["ce", "forms"].
fn module_path(file: &Path) -> Vec<String> {
    let rel = file.strip_prefix("src").unwrap();
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// The code of a file without its `#[cfg(test)]` module and comments.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Module paths a file names: `crate::a::b` → [a, b]; `super::x` → the parent's path + x.
fn imports(me: &[String], text: &str) -> BTreeSet<Vec<String>> {
    let mut out = BTreeSet::new();
    // the lowercase segments of a path, up to the first one the path does not continue after
    // (`a::b; use crate::c` is [a, b])
    let ident = |s: &str| -> Vec<String> {
        let mut path = Vec::new();
        for p in s.split("::") {
            let id: String = p
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if id.is_empty() || !id.chars().next().unwrap().is_lowercase() {
                break;
            }
            let whole = id.len() == p.len();
            path.push(id);
            if !whole {
                break;
            }
        }
        path
    };
    for (i, _) in text.match_indices("crate::") {
        let rest = &text[i + "crate::".len()..];
        // `crate::{a::b, c}`: each path of the group
        let paths = match rest.strip_prefix('{') {
            Some(group) => top_level_items(group),
            None => vec![rest],
        };
        for p in paths {
            let path = ident(p.trim_start());
            if !path.is_empty() {
                out.insert(path);
            }
        }
    }
    for (i, _) in text.match_indices("super::") {
        let path = ident(&text[i + "super::".len()..]);
        let mut full = me[..me.len().saturating_sub(1)].to_vec();
        full.extend(path);
        if !full.is_empty() {
            out.insert(full);
        }
    }
    out
}

/// The comma-separated items of a `{…}` group (its text after the `{`), up to its `}`.
fn top_level_items(group: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                items.push(&group[start..i]);
                return items;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&group[start..]);
    items
}

struct Module {
    path: Vec<String>,
    imports: BTreeSet<Vec<String>>,
}

fn modules() -> Vec<Module> {
    let mut files = Vec::new();
    rust_files(Path::new("src"), &mut files);
    files.sort();
    files
        .iter()
        .filter(|f| !f.ends_with("lib.rs"))
        .map(|f| {
            let path = module_path(f);
            let text = code(&std::fs::read_to_string(f).unwrap());
            let imports = imports(&path, &text);
            Module { path, imports }
        })
        .collect()
}

#[test]
fn no_stage_imports_a_higher_one() {
    let mut wrong = Vec::new();
    for m in modules() {
        let mine = stage_rank(&m.path[0]);
        for imp in &m.imports {
            if STAGES.contains(&imp[0].as_str()) && stage_rank(&imp[0]) > mine {
                wrong.push(format!("{} imports {}", m.path.join("::"), imp.join("::")));
            }
        }
    }
    assert!(wrong.is_empty(), "arrows back up:\n{}", wrong.join("\n"));
}

/// The folders (and single-file modules) inside `src/passes/`, lowest first: each imports only
/// itself and the ones before it. `contract` (the step graph's metadata, plain data) is below
/// every pass that describes its part of it; `pointwise_map` (a soft-cap or scale that the fused
/// head and attention apply per chunk) below both. The internal nodes of the fused head and of
/// attention sit below `grad`, whose rules differentiate them; `step` drives them all;
/// `artifacts` is the other top (ORT's training graph).
const PASSES: [&str; 13] = [
    "contract",
    "pointwise_map",
    "loss_inputs",
    "rewrite",
    "pipeline",
    "fused_head",
    "attention",
    "grad",
    "lora",
    "quantize_base",
    "recompute",
    "step",
    "artifacts",
];

fn pass_rank(part: &str) -> usize {
    PASSES
        .iter()
        .position(|s| *s == part)
        .unwrap_or_else(|| panic!("'{part}' is no part of src/passes/: add it to PASSES in order"))
}

/// The imports between the parts of `passes` that go up the order of [`PASSES`].
fn passes_importing_up(mods: &[Module]) -> Vec<String> {
    let mut wrong = Vec::new();
    // `passes` itself (its mod.rs) only declares the parts
    for m in mods
        .iter()
        .filter(|m| m.path[0] == "passes" && m.path.len() > 1)
    {
        let mine = pass_rank(&m.path[1]);
        for imp in m.imports.iter().filter(|i| i[0] == "passes" && i.len() > 1) {
            if pass_rank(&imp[1]) > mine {
                wrong.push(format!("{} imports {}", m.path.join("::"), imp.join("::")));
            }
        }
    }
    wrong
}

#[test]
fn no_part_of_passes_imports_a_higher_one() {
    // with every import going down the order (or staying inside a part), the parts of
    // `passes` cannot import each other in a circle either
    let wrong = passes_importing_up(&modules());
    assert!(
        wrong.is_empty(),
        "arrows back up inside src/passes/ (move the code down, or reorder PASSES):\n{}",
        wrong.join("\n")
    );
}

/// The modules of `passes` that name `crate::io` (files) or `crate::jobs` (what calls them).
fn passes_reaching_files(mods: &[Module]) -> Vec<String> {
    let mut wrong = Vec::new();
    for m in mods.iter().filter(|m| m.path[0] == "passes") {
        for imp in &m.imports {
            if imp[0] == "io" || imp[0] == "jobs" {
                wrong.push(format!("{} imports {}", m.path.join("::"), imp.join("::")));
            }
        }
    }
    wrong
}

#[test]
fn no_pass_reads_or_writes_files() {
    // a pass is graph → graph: loading, saving, output paths and temporary files are the
    // jobs' (src/jobs/), which call the passes
    let mut wrong = passes_reaching_files(&modules());
    let mut files = Vec::new();
    rust_files(Path::new("src/passes"), &mut files);
    for f in files {
        if code(&std::fs::read_to_string(&f).unwrap()).contains("std::fs") {
            wrong.push(format!("{} names std::fs", f.display()));
        }
    }
    assert!(
        wrong.is_empty(),
        "passes touching files (move it into src/jobs/):\n{}",
        wrong.join("\n")
    );
}

/// The module (file) an import path lands in: its longest prefix that is a module.
fn owner<'a>(imp: &[String], known: &'a BTreeSet<Vec<String>>) -> Option<&'a Vec<String>> {
    (1..=imp.len()).rev().find_map(|n| known.get(&imp[..n]))
}

#[test]
fn no_import_circles() {
    let mods = modules();
    let known: BTreeSet<Vec<String>> = mods.iter().map(|m| m.path.clone()).collect();
    // edges between modules, leaving out a module's own submodules and its parents (a mod.rs
    // declares its children and they may use what it defines)
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for m in &mods {
        for imp in &m.imports {
            let Some(to) = owner(imp, &known) else {
                continue;
            };
            let related = to.starts_with(&m.path) || m.path.starts_with(to);
            if !related {
                edges.entry(m.path.clone()).or_default().insert(to.clone());
            }
        }
    }
    // depth-first search for a back edge
    fn visit(
        n: &Vec<String>,
        edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        state: &mut BTreeMap<Vec<String>, u8>,
        stack: &mut Vec<Vec<String>>,
    ) -> Option<Vec<String>> {
        match state.get(n) {
            Some(2) => return None,
            Some(1) => {
                let start = stack.iter().position(|s| s == n).unwrap();
                let mut cycle: Vec<String> = stack[start..].iter().map(|p| p.join("::")).collect();
                cycle.push(n.join("::"));
                return Some(cycle);
            }
            _ => {}
        }
        state.insert(n.clone(), 1);
        stack.push(n.clone());
        for next in edges.get(n).into_iter().flatten() {
            if let Some(c) = visit(next, edges, state, stack) {
                return Some(c);
            }
        }
        stack.pop();
        state.insert(n.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for m in &mods {
        let mut stack = Vec::new();
        if let Some(cycle) = visit(&m.path, &edges, &mut state, &mut stack) {
            panic!("import circle: {}", cycle.join(" → "));
        }
    }
}

#[test]
fn the_op_library_knows_nothing_of_the_compiler() {
    let mut files = Vec::new();
    rust_files(Path::new("ops/src"), &mut files);
    assert!(!files.is_empty());
    for f in files {
        let text = code(&std::fs::read_to_string(&f).unwrap());
        for word in [
            "ntl_patch",
            "std::fs",
            "std::path",
            "std::env",
            "std::process",
        ] {
            assert!(
                !text.contains(word),
                "{} names {word}: the op library reads no files and knows no compiler stage",
                f.display()
            );
        }
    }
}

#[test]
fn the_detector_sees_an_arrow_back_up_and_a_circle() {
    // the checks above must be able to fail: a graph module naming a pass is caught
    let me = vec!["graph".to_string(), "index".to_string()];
    let imps = imports(
        &me,
        "use crate::passes::rewrite::X; use super::ranks::Ranks;",
    );
    assert!(imps.contains(&vec!["passes".to_string(), "rewrite".to_string()]));
    assert!(imps.contains(&vec!["graph".to_string(), "ranks".to_string()]));
    assert!(stage_rank("passes") > stage_rank("graph"));
    // and a pass naming io or a job is caught, by a path or a `use` of the stage
    let me = vec!["passes".to_string(), "step".to_string()];
    let m = Module {
        imports: imports(
            &me,
            "use crate::io::model_io::load_model; use crate::jobs;\nuse crate::{graph::GraphIndex, io::{temp, fsio}};",
        ),
        path: me,
    };
    // and a lower part of passes naming a higher one
    let me = vec![
        "passes".to_string(),
        "grad".to_string(),
        "rules".to_string(),
    ];
    let up = Module {
        imports: imports(
            &me,
            "use crate::passes::step::StepOptions; use crate::passes::fused_head;",
        ),
        path: me,
    };
    assert_eq!(
        passes_importing_up(&[up]),
        ["passes::grad::rules imports passes::step"]
    );
    assert_eq!(
        passes_reaching_files(&[m]),
        [
            "passes::step imports io",
            "passes::step imports io::model_io::load_model",
            "passes::step imports jobs",
        ]
    );
}

/// A node list changed in place: the `Vec` methods that add, remove or reorder nodes, and the
/// whole list taken, replaced or assigned. Matched on the code with its whitespace removed
/// (rustfmt breaks `graph\n.node\n.retain(` over lines). Editing one node's fields is not
/// splicing and is not matched.
const NODE_LIST_EDITS: [&str; 19] = [
    ".node.push(",
    ".node.insert(",
    ".node.extend(",
    ".node.append(",
    ".node.retain(",
    ".node.retain_mut(",
    ".node.remove(",
    ".node.swap_remove(",
    ".node.splice(",
    ".node.drain(",
    ".node.truncate(",
    ".node.clear(",
    ".node.split_off(",
    ".node.pop(",
    ".node.sort",
    ".node.reverse(",
    ".node.swap(",
    ".node.dedup",
    ".node.resize",
];

/// Where a file's code splices a node list by hand, one line per kind of edit.
fn node_list_edits(text: &str) -> Vec<String> {
    let flat: String = code(text).chars().filter(|c| !c.is_whitespace()).collect();
    let mut found: Vec<String> = NODE_LIST_EDITS
        .iter()
        .filter(|e| flat.contains(*e))
        .map(|e| e.to_string())
        .collect();
    // `.node = nodes` (not `.node == x`)
    if flat
        .match_indices(".node=")
        .any(|(i, _)| !flat[i + 6..].starts_with('='))
    {
        found.push(".node =".into());
    }
    // `std::mem::take(&mut graph.node)`, `mem::replace(&mut g.node, …)`, `mem::swap`
    for f in ["mem::take(&mut", "mem::replace(&mut", "mem::swap(&mut"] {
        for (i, _) in flat.match_indices(f) {
            let arg = &flat[i + f.len()..];
            let arg = &arg[..arg.find([')', ',']).unwrap_or(arg.len())];
            if arg.ends_with(".node") {
                found.push(format!("{f} ….node)"));
            }
        }
    }
    found
}

/// Code outside `src/graph/` that still edits a node list itself: the file, the edit, and why.
const SPLICES_OUTSIDE_GRAPH: [(&str, &str, &str); 1] = [(
    "src/passes/step/mod.rs",
    ".node =",
    "`set_nodes`: autocast returns the whole forward and backward retyped, a new list, not edits",
)];

#[test]
fn only_graph_patch_splices_nodes() {
    let mut files = Vec::new();
    rust_files(Path::new("src"), &mut files);
    files.sort();
    let mut wrong = Vec::new();
    for f in files.iter().filter(|f| !f.starts_with("src/graph")) {
        let path = f.to_string_lossy().to_string();
        let allowed: Vec<&str> = SPLICES_OUTSIDE_GRAPH
            .iter()
            .filter(|(p, _, _)| *p == path)
            .map(|(_, edit, _)| *edit)
            .collect();
        let edits = node_list_edits(&std::fs::read_to_string(f).unwrap());
        let by_hand: Vec<&String> = edits
            .iter()
            .filter(|e| !allowed.contains(&e.as_str()))
            .collect();
        if !by_hand.is_empty() {
            let by_hand: Vec<&str> = by_hand.iter().map(|e| e.as_str()).collect();
            wrong.push(format!("{path}: {}", by_hand.join(", ")));
        }
        for edit in allowed.iter().filter(|a| !edits.iter().any(|e| e == *a)) {
            wrong.push(format!(
                "{path} no longer does '{edit}': take it off SPLICES_OUTSIDE_GRAPH"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "node lists spliced outside src/graph/ (build a graph::patch::Splice and call splice):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_splice_detector_sees_hand_splices() {
    let by_hand = "let old = std::mem::take(&mut graph.node);\n\
                   graph\n    .node\n    .retain(|n| keep(n));\n\
                   model.graph.node = nodes; // a comment: graph.node.push(x)\n\
                   if g.node == other.node {}";
    assert_eq!(
        node_list_edits(by_hand),
        [".node.retain(", ".node =", "mem::take(&mut ….node)"]
    );
    assert!(node_list_edits("for n in &mut graph.node { n.name = None; }").is_empty());
    assert!(node_list_edits("b.nodes.push(n); let x = std::mem::take(&mut b.nodes);").is_empty());
}

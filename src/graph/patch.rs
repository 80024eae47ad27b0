//! The one place a graph's node list changes. A patch is a value: the nodes, initializers and
//! outputs a loss adds, and the nodes it replaces; applying it ends with a consistency check of
//! the whole graph. A [`Splice`] is its node part, which the passes that build the step graph
//! apply on their own (the graph is checked once it is whole).

use std::collections::{BTreeMap, HashSet};

use super::names::NameIds;
use super::reads::{outer_reads, rename_reads};

use crate::error::Error;
use crate::onnx::{
    GraphProto, ModelProto, NodeProto, StringStringEntryProto, TensorProto, ValueInfoProto,
};

/// Metadata key that marks a model as patched (and records the options).
pub const METADATA_KEY: &str = "ntl_patch";

#[derive(Debug, Default)]
pub struct Patch {
    /// `(index, nodes)`: the node at `index` is replaced by `nodes`, which read only tensors
    /// defined before it and write the tensors it wrote, so node order stays topological.
    pub replacements: Vec<(usize, Vec<NodeProto>)>,
    pub initializers: Vec<TensorProto>,
    /// Graph outputs appended after the existing ones.
    pub outputs: Vec<ValueInfoProto>,
    pub metadata: Vec<(String, String)>,
}

/// Node edits by position in the node list as it is: the one way nodes enter, leave or
/// move in a graph (`apply` for a model's patch, the passes for the step graph they build).
#[derive(Debug, Default)]
pub struct Splice {
    /// The node at a position is replaced by these nodes (none: it is removed).
    pub replace: BTreeMap<usize, Vec<NodeProto>>,
    /// Nodes inserted before the node at a position (before a replacement's nodes); at the
    /// node count or past it, appended.
    pub before: BTreeMap<usize, Vec<NodeProto>>,
    /// Each kept node's reads of a key, inside its subgraphs too, read the value instead
    /// (not the nodes the splice adds: they are written with the names they read).
    pub renames: std::collections::HashMap<String, String>,
}

impl Splice {
    /// `nodes` inserted before the node at `at` (`usize::MAX`: appended).
    pub fn insert(at: usize, nodes: Vec<NodeProto>) -> Splice {
        Splice {
            before: BTreeMap::from([(at, nodes)]),
            ..Default::default()
        }
    }

    /// `nodes` appended after the last node.
    pub fn append(nodes: Vec<NodeProto>) -> Splice {
        Splice::insert(usize::MAX, nodes)
    }

    /// The nodes of `graph` that `gone` picks, removed.
    pub fn remove(graph: &GraphProto, gone: impl Fn(&NodeProto) -> bool) -> Splice {
        let picked = graph.node.iter().enumerate().filter(|(_, n)| gone(n));
        Splice {
            replace: picked.map(|(i, _)| (i, Vec::new())).collect(),
            ..Default::default()
        }
    }

    /// Each node at a position replaced by its nodes.
    pub fn replace(replace: impl IntoIterator<Item = (usize, Vec<NodeProto>)>) -> Splice {
        Splice {
            replace: replace.into_iter().collect(),
            ..Default::default()
        }
    }
}

/// Each node of each body of `node` (a loop's, an `If`'s branches) that `rewrite` gives nodes
/// for, replaced by them. Returns whether any was.
pub fn rewrite_bodies(
    node: &mut NodeProto,
    mut rewrite: impl FnMut(&NodeProto) -> Option<Vec<NodeProto>>,
) -> bool {
    let mut changed = false;
    for a in &mut node.attribute {
        for g in a.g.iter_mut().chain(a.graphs.iter_mut()) {
            let replace: BTreeMap<usize, Vec<NodeProto>> = (g.node.iter().enumerate())
                .filter_map(|(at, n)| Some((at, rewrite(n)?)))
                .collect();
            changed |= !replace.is_empty();
            splice(g, Splice::replace(replace));
        }
    }
    changed
}

/// Applies `edits` to `graph`'s nodes in one pass from the first edited one (the nodes before
/// stay where they are: a loss is usually near the end of a graph of millions of nodes), so
/// any number of edits costs one walk.
pub fn splice(graph: &mut GraphProto, edits: Splice) {
    let Splice {
        mut replace,
        mut before,
        renames,
    } = edits;
    let first = if renames.is_empty() {
        let first_key = |m: &BTreeMap<usize, Vec<NodeProto>>| m.keys().next().copied();
        [first_key(&replace), first_key(&before)]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(graph.node.len())
    } else {
        0
    }
    .min(graph.node.len());
    let tail = graph.node.split_off(first);
    let added = replace
        .values()
        .chain(before.values())
        .map(Vec::len)
        .sum::<usize>();
    graph.node.reserve(tail.len() + added);
    for (i, mut node) in (first..).zip(tail) {
        if let Some(nodes) = before.remove(&i) {
            graph.node.extend(nodes);
        }
        match replace.remove(&i) {
            Some(nodes) => graph.node.extend(nodes),
            None => {
                if !renames.is_empty() {
                    rename_reads(&mut node, &renames);
                }
                graph.node.push(node)
            }
        }
    }
    for nodes in before.into_values() {
        graph.node.extend(nodes);
    }
}

pub fn apply(model: &mut ModelProto, patch: Patch) -> Result<(), Error> {
    let graph = model.graph.as_mut().expect("loaded models have a graph");
    let edits = Splice {
        replace: patch.replacements.into_iter().collect(),
        ..Default::default()
    };
    splice(graph, edits);
    graph.initializer.extend(patch.initializers);
    graph.output.extend(patch.outputs);
    model.metadata_props.extend(
        patch
            .metadata
            .into_iter()
            .map(|(k, v)| StringStringEntryProto {
                key: Some(k),
                value: Some(v),
            }),
    );
    // no declaration outlives its tensor: the value infos of tensors the graph no longer
    // defines (the outputs of replaced or removed nodes) go
    let graph = model.graph.as_ref().expect("loaded models have a graph");
    let keep: Vec<bool> = {
        let defined = defined_tensors(graph).map_err(Error::Inconsistent)?;
        let declared = graph.value_info.iter();
        declared.map(|v| defined.get(v.name()).is_some()).collect()
    };
    let mut keep = keep.into_iter();
    let graph = model.graph.as_mut().expect("loaded models have a graph");
    graph.value_info.retain(|_| keep.next().unwrap_or(true));
    Ok(())
}

/// The tensors a graph defines before its first node: inputs, initializers and sparse
/// initializers.
fn defined_before_nodes(graph: &GraphProto) -> impl Iterator<Item = &str> {
    graph
        .input
        .iter()
        .map(|v| v.name())
        .chain(graph.initializer.iter().map(|t| t.name()))
        .chain(
            graph
                .sparse_initializer
                .iter()
                .filter_map(|s| s.values.as_ref().map(|v| v.name())),
        )
}

/// Every node input is defined before use, every tensor is produced once, every graph output
/// is defined.
pub fn check_consistency(model: &ModelProto) -> Result<(), String> {
    let graph = model.graph.as_ref().expect("loaded models have a graph");
    defined_tensors(graph).map(|_| ())
}

/// The consistency check's walk: every tensor the graph defines (before its first node, and
/// the nodes' outputs); or what is inconsistent.
fn defined_tensors(graph: &GraphProto) -> Result<NameIds<'_>, String> {
    let mut defined =
        NameIds::with_capacity(graph.input.len() + graph.initializer.len() + graph.node.len());
    // per tensor number: whether a node wrote it
    let mut written = Vec::new();
    for t in defined_before_nodes(graph) {
        defined.intern(t);
    }
    written.resize(defined.len(), false);
    for node in &graph.node {
        for input in node.input.iter().filter(|i| !i.is_empty()) {
            if defined.get(input).is_none() {
                return Err(format!(
                    "node '{}' reads '{}' before it is defined",
                    node.name(),
                    input
                ));
            }
        }
        for out in node.output.iter().filter(|o| !o.is_empty()) {
            // a node may write a tensor defined before the nodes, not one another node wrote
            let t = defined.intern(out);
            written.resize(defined.len(), false);
            if std::mem::replace(&mut written[t], true) {
                return Err(format!("tensor '{out}' is produced twice"));
            }
        }
    }
    for out in &graph.output {
        if defined.get(out.name()).is_none() {
            return Err(format!("graph output '{}' is never produced", out.name()));
        }
    }
    Ok(defined)
}

/// Stable topological order: nodes keep their relative order unless an input is not yet
/// defined, in which case they wait for it (one pass for an already sorted graph).
pub fn topological_sort(graph: &mut GraphProto) {
    let mut defined: HashSet<String> = graph
        .input
        .iter()
        .map(|v| v.name().to_string())
        .chain(graph.initializer.iter().map(|t| t.name().to_string()))
        .collect();
    let mut pending = std::mem::take(&mut graph.node);
    loop {
        let before = pending.len();
        let mut waiting = Vec::new();
        for node in pending {
            let ready = node
                .input
                .iter()
                .all(|i| i.is_empty() || defined.contains(i))
                && outer_reads(&node).iter().all(|i| defined.contains(*i));
            if ready {
                defined.extend(node.output.iter().cloned());
                graph.node.push(node);
            } else {
                waiting.push(node);
            }
        }
        pending = waiting;
        if pending.is_empty() || pending.len() == before {
            // a cycle or an undefined input: keep the rest as is, the consistency check reports it
            graph.node.append(&mut pending);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::onnx::proto::SparseTensorProto;

    fn value_info(name: &str) -> ValueInfoProto {
        ValueInfoProto {
            name: Some(name.into()),
            ..Default::default()
        }
    }

    fn identity(input: &str, output: &str) -> NodeProto {
        NodeProto {
            op_type: Some("Identity".into()),
            input: vec![input.into()],
            output: vec![output.into()],
            ..Default::default()
        }
    }

    fn outputs(graph: &GraphProto) -> Vec<&str> {
        graph.node.iter().map(|n| n.output[0].as_str()).collect()
    }

    /// Insertions go before a replacement at the same position, past the end they are
    /// appended, and an empty replacement removes the node.
    #[test]
    fn splice_inserts_replaces_and_removes_in_one_walk() {
        let mut graph = GraphProto {
            node: vec![identity("x", "a"), identity("a", "b"), identity("b", "c")],
            ..Default::default()
        };
        let mut edits = Splice::replace([(1, vec![identity("a", "b")]), (2, Vec::new())]);
        edits.before.insert(1, vec![identity("x", "i")]);
        edits.before.insert(usize::MAX, vec![identity("b", "z")]);
        splice(&mut graph, edits);
        assert_eq!(outputs(&graph), ["a", "i", "b", "z"]);
        splice(&mut graph, Splice::append(vec![identity("z", "last")]));
        assert_eq!(outputs(&graph), ["a", "i", "b", "z", "last"]);
        let gone = Splice::remove(&graph, |n| n.input[0] == "z");
        splice(&mut graph, gone);
        splice(&mut graph, Splice::insert(0, vec![identity("x", "first")]));
        let gone = Splice::remove(&graph, |n| n.input[0] == "b");
        splice(&mut graph, gone);
        assert_eq!(outputs(&graph), ["first", "a", "i", "b"]);
    }

    /// Renames reach the kept nodes' inputs and their subgraphs' reads, not the nodes the
    /// splice adds.
    #[test]
    fn splice_renames_the_kept_readers_only() {
        use crate::onnx::proto::AttributeProto;
        let mut branch = identity("unused", "o");
        branch.attribute.push(AttributeProto {
            name: Some("then_branch".into()),
            g: Some(GraphProto {
                node: vec![identity("w", "inner")],
                output: vec![value_info("inner")],
                ..Default::default()
            }),
            ..Default::default()
        });
        let mut graph = GraphProto {
            node: vec![identity("w", "a"), branch],
            ..Default::default()
        };
        let edits = Splice {
            before: BTreeMap::from([(0, vec![identity("w", "wide")])]),
            renames: [("w".to_string(), "wide".to_string())].into(),
            ..Default::default()
        };
        splice(&mut graph, edits);
        assert_eq!(graph.node[0].input, ["w"]);
        assert_eq!(graph.node[1].input, ["wide"]);
        assert_eq!(outer_reads(&graph.node[2]), ["wide"]);
    }

    /// `apply` keeps the declarations of exactly what its consistency check counts as defined:
    /// a sparse initializer's value info stays, a removed node's output's goes.
    #[test]
    fn value_infos_follow_the_defined_tensors() {
        let node = |input: &str, output: &str| NodeProto {
            op_type: Some("Identity".into()),
            input: vec![input.into()],
            output: vec![output.into()],
            ..Default::default()
        };
        let mut model = ModelProto {
            graph: Some(GraphProto {
                node: vec![node("sparse", "a"), node("a", "b")],
                sparse_initializer: vec![SparseTensorProto {
                    values: Some(TensorProto {
                        name: Some("sparse".into()),
                        ..Default::default()
                    }),
                    ..Default::default()
                }],
                value_info: vec![value_info("sparse"), value_info("a"), value_info("b")],
                ..Default::default()
            }),
            ..Default::default()
        };
        let patch = Patch {
            replacements: vec![(1, vec![node("a", "c")])],
            ..Default::default()
        };
        apply(&mut model, patch).unwrap();
        let kept: Vec<&str> = model
            .graph
            .as_ref()
            .unwrap()
            .value_info
            .iter()
            .map(|v| v.name())
            .collect();
        assert_eq!(kept, ["sparse", "a"]);
    }
}

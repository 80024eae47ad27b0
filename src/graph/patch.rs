//! A patch is a value: the nodes, initializers and outputs a loss adds, and the one node it
//! replaces. Applying it is the only place the model is changed, and every application ends
//! with a consistency check of the whole graph.

use std::collections::HashSet;

use super::hash::{map_with_capacity, HashMap};

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

pub fn apply(model: &mut ModelProto, patch: Patch) -> Result<(), Error> {
    let graph = model.graph.as_mut().expect("loaded models have a graph");
    // One pass over the nodes from the first replaced one, linear in the graph (splicing each
    // replacement in turn is quadratic for graphs with many cross-entropies); the nodes before
    // stay where they are (a loss is usually near the end of a graph of millions of nodes).
    let mut replacements: std::collections::BTreeMap<usize, Vec<NodeProto>> =
        patch.replacements.into_iter().collect();
    let first = replacements.keys().next().map_or(graph.node.len(), |&i| i);
    let tail = graph.node.split_off(first.min(graph.node.len()));
    graph
        .node
        .reserve(tail.len() + replacements.values().map(Vec::len).sum::<usize>());
    for (i, node) in (first..).zip(tail) {
        match replacements.remove(&i) {
            Some(nodes) => graph.node.extend(nodes),
            None => graph.node.push(node),
        }
    }
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
        declared.map(|v| defined.contains_key(v.name())).collect()
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
/// the nodes' outputs), each mapped to whether a node produces it; or what is inconsistent.
fn defined_tensors(graph: &GraphProto) -> Result<HashMap<&str, bool>, String> {
    let mut defined =
        map_with_capacity(graph.input.len() + graph.initializer.len() + graph.node.len());
    defined.extend(defined_before_nodes(graph).map(|t| (t, false)));
    for node in &graph.node {
        for input in node.input.iter().filter(|i| !i.is_empty()) {
            if !defined.contains_key(input.as_str()) {
                return Err(format!(
                    "node '{}' reads '{}' before it is defined",
                    node.name(),
                    input
                ));
            }
        }
        for out in node.output.iter().filter(|o| !o.is_empty()) {
            // a node may write a tensor defined before the nodes, not one another node wrote
            if defined.insert(out.as_str(), true) == Some(true) {
                return Err(format!("tensor '{out}' is produced twice"));
            }
        }
    }
    for out in &graph.output {
        if !defined.contains_key(out.name()) {
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
                && outer_references(&node).iter().all(|i| defined.contains(*i));
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

/// Every name a node's subgraphs mention as an input or a body output, nested bodies included:
/// a superset of `outer_references` (a body's own names count too) for passes that only ask
/// whether some outer tensor is read in there.
pub fn names_read_by_subgraphs(node: &NodeProto) -> Vec<String> {
    let mut out = Vec::new();
    for a in &node.attribute {
        for g in a.g.iter().chain(a.graphs.iter()) {
            for n in &g.node {
                out.extend(n.input.iter().cloned());
                out.extend(names_read_by_subgraphs(n));
            }
            out.extend(g.output.iter().map(|o| o.name().to_string()));
        }
    }
    out
}

/// The enclosing graph's tensors a node's subgraphs (`Scan`, `Loop`, `If` bodies) read: names
/// their nodes use that the bodies do not define themselves.
pub fn outer_references(node: &NodeProto) -> Vec<&str> {
    fn walk<'g>(g: &'g GraphProto, outer: &mut Vec<&'g str>) {
        let own: HashSet<&str> = g
            .input
            .iter()
            .map(|v| v.name())
            .chain(g.initializer.iter().map(|t| t.name()))
            .chain(
                g.node
                    .iter()
                    .flat_map(|n| n.output.iter().map(String::as_str)),
            )
            .collect();
        for n in &g.node {
            let mut inner = Vec::new();
            for sub in n.attribute.iter().flat_map(|a| a.g.iter().chain(&a.graphs)) {
                walk(sub, &mut inner);
            }
            let used = n.input.iter().map(String::as_str).chain(inner);
            outer.extend(used.filter(|i| !i.is_empty() && !own.contains(i)));
        }
    }
    let mut outer = Vec::new();
    for sub in node
        .attribute
        .iter()
        .flat_map(|a| a.g.iter().chain(&a.graphs))
    {
        walk(sub, &mut outer);
    }
    outer
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

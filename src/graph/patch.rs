//! A patch is a value: the nodes, initializers and outputs a loss adds, and the one node it
//! replaces. Applying it is the only place the model is changed, and every application ends
//! with a consistency check of the whole graph.

use std::collections::{BTreeSet, HashSet};

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
    // One pass, linear in the graph (splicing each replacement in turn is quadratic for
    // graphs with many cross-entropies).
    let mut replacements: std::collections::BTreeMap<usize, Vec<NodeProto>> =
        patch.replacements.into_iter().collect();
    let old = std::mem::take(&mut graph.node);
    graph
        .node
        .reserve(old.len() + replacements.values().map(Vec::len).sum::<usize>());
    for (i, node) in old.into_iter().enumerate() {
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
    check_consistency(model).map_err(Error::Inconsistent)?;
    drop_stale_value_info(model);
    Ok(())
}

/// Drops the value infos of tensors the graph no longer defines (the outputs of replaced or
/// removed nodes), so no declaration outlives its tensor.
fn drop_stale_value_info(model: &mut ModelProto) {
    let graph = model.graph.as_mut().expect("loaded models have a graph");
    let defined: BTreeSet<String> = graph
        .input
        .iter()
        .map(|v| v.name().to_string())
        .chain(graph.initializer.iter().map(|t| t.name().to_string()))
        .chain(graph.node.iter().flat_map(|n| n.output.iter().cloned()))
        .collect();
    graph.value_info.retain(|v| defined.contains(v.name()));
}

/// Every node input is defined before use, every tensor is produced once, every graph output
/// is defined.
pub fn check_consistency(model: &ModelProto) -> Result<(), String> {
    let graph = model.graph.as_ref().expect("loaded models have a graph");
    let mut defined: BTreeSet<&str> = graph
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
        .collect();
    let mut produced: BTreeSet<&str> = BTreeSet::new();
    for node in &graph.node {
        for input in node.input.iter().filter(|i| !i.is_empty()) {
            if !defined.contains(input.as_str()) {
                return Err(format!(
                    "node '{}' reads '{}' before it is defined",
                    node.name(),
                    input
                ));
            }
        }
        for out in node.output.iter().filter(|o| !o.is_empty()) {
            if !produced.insert(out.as_str()) {
                return Err(format!("tensor '{out}' is produced twice"));
            }
            defined.insert(out.as_str());
        }
    }
    for out in &graph.output {
        if !defined.contains(out.name()) {
            return Err(format!("graph output '{}' is never produced", out.name()));
        }
    }
    Ok(())
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

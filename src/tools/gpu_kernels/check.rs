//! A whole model against one provider: every top-level node placed (and the nodes of their
//! `Scan`/`Loop`/`If` bodies, which the CUDA and ROCm providers run themselves), grouped into
//! the report with its notes; or the list of nodes that would not run on the provider.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::cpu_preferred::cpu_preferred_nodes;
use super::matching::{place_node, Placed, Placement};
use super::migraphx;
use super::nodes::{count_nodes, is_constant, is_ntl_node, model_opsets, node_label};
use super::report::{GpuReport, OpGroup};
use super::tables::{tables_for, Tables};
use super::target::{Target, MAX_ONNX_OPSET, ORT_VERSION};
use crate::graph::elem_types::TypeNames;
use crate::onnx::{GraphProto, ModelProto, NodeProto};
use ntl_ops::schema::canonical_domain;

/// Checks every top-level node of `model` against `target`'s kernels.
pub fn check_model(model: &ModelProto, target: Target) -> GpuReport {
    check_model_with(model, target, tables_for(target))
}

/// One node that would not run on `target`'s provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FallbackNode {
    /// Index in the top-level graph's `node` list.
    pub index: usize,
    /// The node's name (or `#index (first output)` when it has none).
    pub name: String,
    pub domain: String,
    pub op: String,
    /// The op version in effect at the model's opset, when known.
    pub version: Option<i64>,
    /// Why: a missing kernel, a refused node, a node the provider does not take, or `not
    /// checked: ...` when the op version cannot be told.
    pub reason: String,
    /// The CPU provider has a kernel for it (`false`: ORT cannot run the node at all).
    pub cpu_kernel: bool,
}

/// The top-level nodes of `model` that would not run on `target`'s provider (CPU fallbacks and
/// nodes that could not be checked), in graph order. Empty: every checked node runs on the
/// provider. Nodes ORT moves to the CPU by its own choice (GetCpuPreferredNodes) are not
/// included: they have kernels.
pub fn fallback_nodes(model: &ModelProto, target: Target) -> Vec<FallbackNode> {
    let tables = tables_for(target);
    let empty = GraphProto::default();
    let graph = model.graph.as_ref().unwrap_or(&empty);
    let placed = place_all(model, target, tables);
    let nested = match target {
        Target::Migraphx => Vec::new(),
        _ => {
            let types = TypeNames::infer(graph, &model_opsets(model), tables.schemas());
            place_nested(model, target, tables, &types)
        }
    };
    let fallback = |i: usize, node: &NodeProto, version: Option<i64>, p: &Placement| {
        let (reason, cpu_kernel) = match p {
            Placement::Fallback { why, cpu } => {
                (why.describe(target, node.op_type(), version), *cpu)
            }
            Placement::Unknown(why) => (format!("not checked: {why}"), true),
            _ => return None,
        };
        Some(FallbackNode {
            index: i,
            name: node_label(node, i),
            domain: canonical_domain(node.domain()).to_string(),
            op: node.op_type().to_string(),
            version,
            reason,
            cpu_kernel,
        })
    };
    let mut out: Vec<FallbackNode> = graph
        .node
        .iter()
        .zip(&placed)
        .enumerate()
        .filter_map(|(i, (node, (version, _, p)))| fallback(i, node, *version, p))
        .collect();
    out.extend(
        nested
            .iter()
            .filter_map(|n| fallback(n.parent, n.node, n.placed.0, &n.placed.2)),
    );
    out
}

/// The placement of every top-level node, in graph order (`Constant`s: `Folded`).
fn place_all(model: &ModelProto, target: Target, tables: &Tables) -> Vec<Placed> {
    let empty = GraphProto::default();
    let graph = model.graph.as_ref().unwrap_or(&empty);
    let opsets = model_opsets(model);
    let types = TypeNames::infer(graph, &opsets, tables.schemas());
    let local_functions: HashSet<(String, String)> = model
        .functions
        .iter()
        .map(|f| {
            (
                canonical_domain(f.domain()).to_string(),
                f.name().to_string(),
            )
        })
        .collect();
    if target == Target::Migraphx {
        return migraphx::place_graph(graph, &opsets, &types, tables, migraphx::ops());
    }
    graph
        .node
        .iter()
        .map(|node| {
            if is_constant(node) {
                (None, BTreeMap::new(), Placement::Folded)
            } else {
                place_node(node, target, &opsets, &types, tables, &local_functions)
            }
        })
        .collect()
}

/// A node inside a subgraph (a `Scan`, `Loop` or `If` body), placed as ONNX Runtime places it:
/// with the provider that runs its enclosing node (the CUDA and ROCm providers run control-flow
/// bodies themselves; only the loop bookkeeping stays on the CPU).
struct NestedPlaced<'m> {
    /// Index of the top-level node whose body holds it.
    parent: usize,
    node: &'m NodeProto,
    placed: Placed,
}

/// Every node inside the top-level nodes' subgraphs (recursively), placed with the types of
/// the enclosing graphs and its own.
fn place_nested<'m>(
    model: &'m ModelProto,
    target: Target,
    tables: &Tables,
    types: &TypeNames,
) -> Vec<NestedPlaced<'m>> {
    let Some(graph) = model.graph.as_ref() else {
        return Vec::new();
    };
    let opsets = model_opsets(model);
    let ctx = Walk {
        opsets: &opsets,
        target,
        tables,
        functions: &HashSet::new(),
    };
    let mut out = Vec::new();
    for (i, node) in graph.node.iter().enumerate() {
        for body in node
            .attribute
            .iter()
            .flat_map(|a| a.g.iter().chain(&a.graphs))
        {
            ctx.walk(body, i, types, &mut out);
        }
    }
    out
}

/// What placing a subgraph's nodes needs from its model.
struct Walk<'a> {
    opsets: &'a HashMap<String, i64>,
    target: Target,
    tables: &'a Tables,
    functions: &'a HashSet<(String, String)>,
}

impl Walk<'_> {
    fn walk<'m>(
        &self,
        g: &'m GraphProto,
        parent: usize,
        outer: &TypeNames,
        out: &mut Vec<NestedPlaced<'m>>,
    ) {
        let types = outer.inner(g, self.opsets, self.tables.schemas());
        for node in &g.node {
            let placed = if is_constant(node) {
                (None, BTreeMap::new(), Placement::Folded)
            } else {
                place_node(
                    node,
                    self.target,
                    self.opsets,
                    &types,
                    self.tables,
                    self.functions,
                )
            };
            out.push(NestedPlaced {
                parent,
                node,
                placed,
            });
            for body in node
                .attribute
                .iter()
                .flat_map(|a| a.g.iter().chain(&a.graphs))
            {
                self.walk(body, parent, &types, out);
            }
        }
    }
}

pub fn check_model_with(model: &ModelProto, target: Target, tables: &Tables) -> GpuReport {
    let empty = GraphProto::default();
    let graph = model.graph.as_ref().unwrap_or(&empty);
    let opsets = model_opsets(model);
    let types = TypeNames::infer(graph, &opsets, tables.schemas());
    let all_placed = place_all(model, target, tables);

    let mut groups: Vec<OpGroup> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut placed: Vec<Placement> = Vec::with_capacity(graph.node.len());
    let mut ntl_total = 0;
    let mut constants = 0;
    // the provider runs control-flow bodies itself: their nodes are placed like the others
    // (MIGraphX takes no Scan/Loop at all, so its bodies stay unchecked)
    let nested = match target {
        Target::Migraphx => Vec::new(),
        _ => place_nested(model, target, tables, &types),
    };
    let top = graph.node.iter().enumerate().zip(all_placed);
    let inner = nested.into_iter().map(|n| ((n.parent, n.node), n.placed));
    let top_count = graph.node.len();
    for (k, ((i, node), (version, bound, placement))) in top.chain(inner).enumerate() {
        let is_top = k < top_count;
        if is_constant(node) {
            constants += 1;
            if is_top {
                placed.push(Placement::Folded);
            }
            continue;
        }

        let ntl = is_ntl_node(node);
        ntl_total += ntl as usize;
        let types_shown: BTreeMap<String, String> = bound
            .into_iter()
            .map(|(p, t)| (p, t.unwrap_or_else(|| "?".into())))
            .collect();
        let key = format!(
            "{}\u{1}{}\u{1}{:?}\u{1}{:?}\u{1}{}",
            canonical_domain(node.domain()),
            node.op_type(),
            version,
            types_shown,
            placement_key(&placement)
        );
        let gi = *index.entry(key).or_insert_with(|| {
            groups.push(OpGroup {
                domain: canonical_domain(node.domain()).to_string(),
                op: node.op_type().to_string(),
                version,
                types: types_shown.clone(),
                placement: placement.clone(),
                nodes: Vec::new(),
                ntl_nodes: 0,
            });
            groups.len() - 1
        });
        let label = if is_top {
            node_label(node, i)
        } else {
            format!("{} (in {})", node.name(), node_label(&graph.node[i], i))
        };
        groups[gi].nodes.push(label);
        groups[gi].ntl_nodes += ntl as usize;
        if is_top {
            placed.push(placement);
        }
    }
    groups.sort_by(|a, b| (&a.domain, &a.op, a.version).cmp(&(&b.domain, &b.op, b.version)));
    let cpu_preferred = cpu_preferred_nodes(graph, &placed, &types);
    // (the nodes inside subgraphs; the CUDA and ROCm placement above covers them)
    let nested_nodes = match target {
        Target::Migraphx => count_nodes(graph) - graph.node.len(),
        _ => 0,
    };
    let mut notes = Vec::new();
    if let Some(&o) = opsets.get("ai.onnx") {
        if o > MAX_ONNX_OPSET && matches!(target, Target::Cuda119 | Target::Rocm119) {
            notes.push(format!(
                "the model's default opset {o} is newer than ONNX Runtime {ORT_VERSION} supports ({MAX_ONNX_OPSET}): it will not load"
            ));
        } else if o > MAX_ONNX_OPSET {
            notes.push(format!(
                "the model's default opset {o} is newer than the schema table (ONNX 1.16, opset {MAX_ONNX_OPSET}): op versions are taken as of opset {MAX_ONNX_OPSET}, so ops changed since are not checked exactly"
            ));
        }
    }
    if target == Target::Migraphx {
        notes.push(migraphx::NOTE.to_string());
    }
    if constants > 0 {
        notes.push(format!(
            "{constants} Constant node(s) become initializers when ONNX Runtime loads the graph (never executed, not checked)"
        ));
    }
    if nested_nodes > 0 {
        notes.push(format!(
            "{nested_nodes} node(s) inside subgraphs (If/Loop/Scan bodies) were not checked"
        ));
    }
    GpuReport {
        target,
        opsets: opsets.into_iter().collect(),
        nodes: graph.node.len(),
        ntl_nodes: ntl_total,
        groups,
        cpu_preferred,
        nested_nodes,
        notes,
    }
}

fn placement_key(p: &Placement) -> String {
    match p {
        Placement::Gpu { kernel, unchecked } => format!(
            "gpu {} {:?} {unchecked:?}",
            kernel.range(),
            kernel.class_type
        ),
        Placement::Fallback { why, cpu } => format!("fallback {why:?} {cpu}"),
        Placement::Inlined => "inlined".into(),
        Placement::Unknown(w) => format!("unknown {w}"),
        Placement::Folded => "folded".into(),
    }
}

//! One dequantisation per reading node, on the finished step graph.
//!
//! The shared chains `quantize` put at the top of the graph go; every node that reads a
//! quantised weight (the forward's linear layer, the backward's product with the weight,
//! recomputed copies) gets a copy of the chain made just before it, so the float32 weight it
//! reads is freed after that node. Layout ops and casts that read the weight alone (a
//! linear layer's `Transpose`, the backward's, autocast's cast to the compute type) join the
//! copy instead of reading a shared float tensor.
//!
//! Each NF4 copy reads its codes through `Builder::after(codes, x)` with one of the reading
//! node's activations `x` (then `Cast` to int32 for the Gather), for two reasons:
//! onnxruntime's common-subexpression elimination merges identical nodes of one input back
//! into one — whose float output would then live from the forward to the backward — and an
//! activation makes each copy's first node different; and a chain that reads stored tensors
//! alone may run at the start of the step (onnxruntime's PRIORITY_BASED order, which StepRunner
//! uses for `--recompute`, ran every chain's first nodes there: 4 bytes a weight held until its
//! reader). An earlier `CastLike(codes, x)` did the first only: onnxruntime rewrites it to a
//! `Cast` of the codes alone. With `--double-quant` the absmax' own dequantisation is part of
//! the chain, so it is copied too, its codes' Cast likewise after `x`: no float32 absmax
//! outlives its reader either. An int8/int4 copy starts with its own `DequantizeLinear` of
//! the stored codes, which onnxruntime (1.19, 1.31) does not merge (test_qlora_int.py checks the
//! optimised graph), its scales read after `x`. The codes and scales are declared graph inputs
//! (by the step), so constant folding cannot turn a chain into a float32 initializer either.

use crate::graph::patch::{splice, Splice};
use crate::graph::reads::{outer_reads, rename_reads};
use std::collections::{BTreeSet, HashMap, HashSet};

use super::rows::{self, gathered_weight, Rows};
use super::{is_chain_node, QuantizedBase};
use crate::graph::elem_types::ElemTypes;
use crate::onnx::{GraphProto, NodeProto, FLOAT, FLOAT16};

const BFLOAT16: i32 = crate::onnx::proto::tensor_proto::DataType::Bfloat16 as i32;
use ntl_ops::Builder;

/// Ops that reading the weight alone only move or retype it: they join its chain.
const JOIN_CHAIN: &[&str] = &[
    "Transpose",
    "Reshape",
    "Identity",
    "Squeeze",
    "Unsqueeze",
    "Flatten",
    "Cast",
];

/// See the module doc. `taken`: the graph's names under the prefix.
pub fn dequantize_per_use(
    graph: &mut GraphProto,
    q: &QuantizedBase,
    opset: i64,
    taken: HashSet<String>,
) {
    if q.weights.is_empty() {
        return;
    }
    let chain_tensors: HashSet<&str> = q
        .weights
        .iter()
        .flat_map(|w| w.chain.iter().map(String::as_str))
        .collect();
    let is_chain = |n: &NodeProto| is_chain_node(n, &chain_tensors);
    let producer: HashMap<String, NodeProto> = graph
        .node
        .iter()
        .filter(|n| is_chain(n))
        .map(|n| (n.output[0].clone(), n.clone()))
        .collect();
    // each weight's recipe: its chain's nodes in order
    let mut recipes: HashMap<String, Vec<NodeProto>> = HashMap::new();
    for w in &q.weights {
        if let Some(nodes) = w
            .chain
            .iter()
            .map(|t| producer.get(t).cloned())
            .collect::<Option<Vec<_>>>()
        {
            recipes.insert(w.weight.clone(), nodes);
        }
    }
    // the shared chains go: each reader gets a copy of its own
    let shared = Splice::remove(graph, is_chain);
    splice(graph, shared);
    let types = ElemTypes::infer(graph);
    let inits: HashSet<String> = graph
        .initializer
        .iter()
        .map(|t| t.name().to_string())
        .collect();
    let outputs: HashSet<String> = graph.output.iter().map(|o| o.name().to_string()).collect();
    let mut b = Builder::new(ntl_ops::names::PREFIX, opset, taken);
    // the weights a Gather or a loop body's product may read by rows (rows.rs)
    let by_rows: HashMap<&str, Rows> = q
        .weights
        .iter()
        .filter_map(|w| {
            let rows = Rows::of(q, w, recipes.get(&w.weight)?)?;
            Some((w.weight.as_str(), rows))
        })
        .collect();
    let rows_of = |name: &str| by_rows.get(name);
    // each reader of a chain's tensor replaced by its own copy of the chain and itself; a
    // node joining a chain by nothing
    let mut replace = std::collections::BTreeMap::new();
    let mut gone: BTreeSet<String> = recipes.keys().cloned().collect();
    for (at, node) in graph.node.iter().enumerate() {
        if joins_chain(node, &recipes, &outputs) {
            let mut recipe = recipes[&node.input[0]].clone();
            let out = node.output[0].clone();
            recipe.push(node.clone());
            gone.insert(out.clone());
            recipes.insert(out, recipe);
            replace.insert(at, Vec::new());
            continue;
        }
        if let Some(rows) = gathered_weight(node).and_then(rows_of) {
            rows.gather(&mut b, &node.input[1], &node.output[0]);
            replace.insert(at, b.nodes.drain(..).collect());
            continue;
        }
        let mut node = node.clone();
        let blocked = rows::block_bodies(&mut node, &rows_of, &mut b);
        let mut nodes: Vec<NodeProto> = Vec::new();
        let wanted: BTreeSet<String> = node
            .input
            .iter()
            .cloned()
            .chain(outer_reads(&node).into_iter().map(str::to_string))
            .filter(|i| recipes.contains_key(i))
            .collect();
        if !wanted.is_empty() {
            // the activation to wait for: a float one where types are known, else any
            let activations: Vec<&String> = node
                .input
                .iter()
                .filter(|n| !n.is_empty() && !recipes.contains_key(*n) && !inits.contains(*n))
                .collect();
            let like = activations
                .iter()
                .find(|n| matches!(types.get(n), Some(FLOAT | FLOAT16 | BFLOAT16)))
                .or(activations.first())
                .map(|n| n.to_string());
            let mut renames = HashMap::new();
            for t in wanted {
                let (mut copy, mine) = instantiate(&recipes[&t], like.as_deref(), &mut b);
                nodes.append(&mut copy);
                renames.insert(t, mine);
            }
            rename_reads(&mut node, &renames);
        } else if !blocked {
            continue;
        }
        nodes.push(node);
        replace.insert(at, nodes);
    }
    // the constants of the rows' views and blocks (bodies read them from here)
    graph.initializer.append(&mut b.initializers);
    splice(graph, Splice::replace(replace));
    graph.value_info.retain(|v| !gone.contains(v.name()));
}

/// A layout op or cast whose data input is a chain's tensor (and nothing else it reads).
fn joins_chain(
    node: &NodeProto,
    recipes: &HashMap<String, Vec<NodeProto>>,
    outputs: &HashSet<String>,
) -> bool {
    JOIN_CHAIN.contains(&node.op_type())
        && node.domain().is_empty()
        && node.output.len() == 1
        && !outputs.contains(&node.output[0])
        && node.input.first().is_some_and(|i| recipes.contains_key(i))
        && node.input[1..].iter().all(|i| !recipes.contains_key(i))
}

/// A fresh copy of `recipe` (fresh tensor and node names); each node of stored tensors alone
/// (the Cast of the codes or of the nested absmax codes, DequantizeLinear) reads one of them
/// through `Builder::after(stored, like)` where there is an activation to wait for.
pub(super) fn instantiate(
    recipe: &[NodeProto],
    like: Option<&str>,
    b: &mut Builder,
) -> (Vec<NodeProto>, String) {
    let mut renames: HashMap<String, String> = HashMap::new();
    let mut out = Vec::with_capacity(recipe.len() + 2);
    for template in recipe {
        let mut n = template.clone();
        let reads_stored = n.input.first().is_some_and(|i| !renames.contains_key(i));
        for i in &mut n.input {
            if let Some(r) = renames.get(i.as_str()) {
                *i = r.clone();
            }
        }
        for o in &mut n.output {
            let fresh = b.fresh("qlora/w");
            renames.insert(o.clone(), fresh.clone());
            *o = fresh;
        }
        n.name = Some(b.fresh(n.op_type()));
        // a node of stored tensors alone waits for the activation: NF4's Cast through its
        // codes, int8/int4's DequantizeLinear through its float32 scales (any runtime
        // reshapes those; not every one reshapes int4)
        let anchor = match n.op_type() {
            "Cast" => Some(0),
            "DequantizeLinear" => Some(1),
            _ => None,
        };
        if let (true, Some(i), Some(x)) = (reads_stored, anchor, like) {
            let start = b.nodes.len();
            n.input[i] = b.after(&n.input[i], x, "qlora/stored_after");
            out.extend(b.nodes.drain(start..));
        }
        out.push(n);
    }
    let last = out.last().expect("a chain has nodes").output[0].clone();
    (out, last)
}

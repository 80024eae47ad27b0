//! Frozen weights of a float16/bfloat16 export stay in their type: only trained tensors get
//! float32 master copies (`upcast.rs`).
//!
//! Before the step is built, each kept weight `W` is read through a widening `Cast` to
//! float32 (`keep_half`), so the rest of the pipeline sees the float32 graph it expects.
//! Layout ops that read the weight alone (a linear layer's `Transpose`, a `Reshape`) run on
//! the half weight, and the Cast moves behind them: the widened tensor is the one the
//! compute ops read. Then:
//! - under `--precision`, autocast reads the half tensor itself where it computes in that
//!   type (`Widened::lookup`), so no float32 copy exists at all;
//! - elsewhere, `cast_per_use` gives every reading node a Cast of its own, made just before it
//!   (so the float32 copy is freed after that node), reading `W` through
//!   `Builder::after(W, x)` with one of the node's activations `x`: onnxruntime's
//!   common-subexpression elimination merges identical Casts of one weight back into one
//!   (whose copy then lives from the forward to the backward), its constant folding turns a
//!   Cast of an initializer into a float32 initializer, and a Cast of the weight alone may run
//!   at the start of the step (PRIORITY_BASED order, StepRunner's for `--recompute`: every
//!   copy made at once). An earlier `CastLike(W, x)` became such a Cast in onnxruntime. A
//!   `Gather` (an embedding) gathers from the half table and widens the rows it took. A loop body reading a large weight in a product (the fused head's `Scan`s)
//!   reads it in blocks, each widened in the body (`blocked_reads.rs`; under `--precision`
//!   its half products too, `blocked_half.rs`); smaller ones are widened once before the loop.
//!
//! Measured with onnxruntime 1.19 and 1.31 (`ORT_ENABLE_ALL`, tests/python/test_lora_half.py):
//! a Cast (or CastLike) of a constant half initializer is folded into a float32 initializer
//! whatever reads it, so frozen weights are also declared graph inputs (initializers with a
//! default value, which onnxruntime never folds: `declare_frozen` in `step/mod.rs`); then one
//! Cast per reading node survives its optimiser.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::blocked_half::{self, HalfAlias};
use super::blocked_reads;

use crate::graph::elem_types::ElemTypes;
use crate::graph::patch::{splice, Splice};
use crate::graph::reads::{outer_reads, rename_reads};
use crate::onnx::{GraphProto, NodeProto, FLOAT};
use ntl_ops::schema::schemas;
use ntl_ops::Builder;

pub use super::widened::Widened;

/// The kept tensors, by their widened name.
#[derive(Debug, Clone, Default)]
pub struct WidenedSet {
    by_wide: HashMap<String, Widened>,
    /// The kept initializers.
    kept: HashSet<String>,
}

impl WidenedSet {
    /// The half tensor `wide` widens, where its type is `to`.
    pub fn lookup(&self, wide: &str, to: i32) -> Option<&str> {
        self.by_wide
            .get(wide)
            .filter(|w| w.half_type == to)
            .map(|w| w.half.as_str())
    }

    /// The widened tensors' names.
    pub fn wide_names(&self) -> impl Iterator<Item = &String> {
        self.by_wide.keys()
    }

    pub fn contains(&self, wide: &str) -> bool {
        self.by_wide.contains_key(wide)
    }

    /// Whether `name` is a kept (frozen, half) initializer.
    pub fn is_kept(&self, name: &str) -> bool {
        self.kept.contains(name)
    }

    pub fn is_empty(&self) -> bool {
        self.by_wide.is_empty()
    }
}

/// Ops that only move a tensor's values: run on the half weight, they keep it half.
const LAYOUT_OPS: &[&str] = &[
    "Transpose",
    "Reshape",
    "Identity",
    "Squeeze",
    "Unsqueeze",
    "Flatten",
];

fn cast(b: &mut Builder, input: &str, output: &str) -> NodeProto {
    NodeProto {
        name: Some(b.fresh("Cast")),
        op_type: Some("Cast".into()),
        input: vec![input.to_string()],
        output: vec![output.to_string()],
        attribute: vec![crate::onnx::int_attr("to", FLOAT as i64)],
        ..Default::default()
    }
}

/// `kept` (half initializers that do not train) read through widening Casts (module doc).
/// Must run before anything else reads the graph's types.
pub fn keep_half(graph: &mut GraphProto, kept: &[(String, i32)], b: &mut Builder) -> WidenedSet {
    let mut set = WidenedSet::default();
    if kept.is_empty() {
        return set;
    }
    let mut renames = HashMap::new();
    let mut casts = Vec::new();
    for (name, half_type) in kept {
        let wide = b.fresh("amp/frozen_f32");
        casts.push(cast(b, name, &wide));
        renames.insert(name.clone(), wide.clone());
        set.kept.insert(name.clone());
        set.by_wide.insert(
            wide.clone(),
            Widened {
                half: name.clone(),
                half_type: *half_type,
            },
        );
    }
    // every reader reads the widened tensor, the Casts first
    let mut widen = Splice::insert(0, casts);
    widen.renames = renames;
    splice(graph, widen);
    // layout ops on a widened weight alone run on the half tensor, widened after them
    let mut replace = BTreeMap::new();
    for (i, node) in graph.node.iter().enumerate() {
        if !is_layout_of_widened(node, &set) {
            continue;
        }
        let mut node = node.clone();
        let w = set.by_wide[&node.input[0]].clone();
        node.input[0] = w.half.clone();
        let out = node.output[0].clone();
        let half_out = b.fresh("amp/frozen_half");
        node.output[0] = half_out.clone();
        let widened = cast(b, &half_out, &out);
        replace.insert(i, vec![node, widened]);
        set.by_wide.insert(
            out,
            Widened {
                half: half_out,
                half_type: w.half_type,
            },
        );
    }
    splice(graph, Splice::replace(replace));
    drop_unread_casts(graph, &mut set);
    set
}

/// A layout op whose data input is widened (and nothing else it reads).
fn is_layout_of_widened(node: &NodeProto, set: &WidenedSet) -> bool {
    LAYOUT_OPS.contains(&node.op_type())
        && node.domain().is_empty()
        && node.output.len() == 1
        && node.input.first().is_some_and(|i| set.contains(i))
        && node.input[1..].iter().all(|i| !set.contains(i))
}

/// Every name the nodes (and their subgraphs) read.
fn read_names(nodes: &[NodeProto]) -> HashSet<String> {
    let mut read = HashSet::new();
    for n in nodes {
        read.extend(n.input.iter().cloned());
        read.extend(outer_reads(n).into_iter().map(str::to_string));
    }
    read
}

/// Widening Casts nothing reads any more (their layout op took the half tensor) go.
fn drop_unread_casts(graph: &mut GraphProto, set: &mut WidenedSet) {
    let read = read_names(&graph.node);
    let outputs: HashSet<&str> = graph.output.iter().map(|o| o.name()).collect();
    let unread: HashSet<String> = set
        .by_wide
        .keys()
        .filter(|w| !read.contains(w.as_str()) && !outputs.contains(w.as_str()))
        .cloned()
        .collect();
    let is_unread = |n: &NodeProto| {
        n.op_type() == "Cast" && n.output.len() == 1 && unread.contains(&n.output[0])
    };
    let gone = Splice::remove(graph, is_unread);
    splice(graph, gone);
    set.by_wide.retain(|w, _| !unread.contains(w));
}

/// The step graph's widening Casts made per reading node (module doc). Runs last, on the
/// finished graph.
pub fn cast_per_use(graph: &mut GraphProto, set: &WidenedSet, opset: i64, taken: HashSet<String>) {
    if set.is_empty() {
        return;
    }
    let mut set = set.clone();
    // the shared Casts go; each reader gets its own
    let is_shared =
        |n: &NodeProto| n.op_type() == "Cast" && n.output.len() == 1 && set.contains(&n.output[0]);
    let gone = Splice::remove(graph, is_shared);
    splice(graph, gone);
    let types = ElemTypes::infer(graph);
    let inits: HashSet<&str> = graph.initializer.iter().map(|t| t.name()).collect();
    let dims: HashMap<String, Vec<i64>> = graph
        .initializer
        .iter()
        .filter(|t| set.is_kept(t.name()))
        .map(|t| (t.name().to_string(), t.dims.clone()))
        .collect();
    let mut b = Builder::new(ntl_ops::names::PREFIX, opset, taken);
    // the kept weights' Identity copies in their own type (read by `--precision`'s half ops)
    let mut aliases: HashMap<String, HalfAlias> = HashMap::new();
    // each reader of a widened tensor replaced by what it becomes (its own Casts first)
    let mut replace = BTreeMap::new();
    for (at, node) in graph.node.iter().enumerate() {
        // a layout op (the backward's transposes) runs on the half tensor; its output is
        // widened where it is read
        if is_layout_of_widened(node, &set) {
            let mut node = node.clone();
            let w = set.by_wide[&node.input[0]].clone();
            let out = node.output[0].clone();
            let half_out = b.fresh("amp/frozen_half");
            node.input[0] = w.half;
            node.output[0] = half_out.clone();
            replace.insert(at, vec![node]);
            set.by_wide.insert(
                out,
                Widened {
                    half: half_out,
                    half_type: w.half_type,
                },
            );
            continue;
        }
        // a cast of the widened tensor back to its own type reads the half tensor itself
        let to = crate::onnx::attr_i(node, "to").map(|t| t as i32);
        if node.op_type() == "Cast" && node.domain().is_empty() {
            if let Some(w) = node.input.first().and_then(|i| set.by_wide.get(i)) {
                if Some(w.half_type) == to {
                    if let Some(d) = dims.get(&w.half) {
                        let alias = HalfAlias {
                            half: w.half.clone(),
                            half_type: w.half_type,
                            dims: d.clone(),
                        };
                        aliases.insert(node.output[0].clone(), alias);
                    }
                    let mut node = node.clone();
                    node.op_type = Some("Identity".into());
                    node.input[0] = w.half.clone();
                    node.attribute.clear();
                    replace.insert(at, vec![node]);
                    continue;
                }
            }
        }
        // an embedding: gather the half rows, widen them
        if node.op_type() == "Gather" && node.domain().is_empty() {
            if let Some(w) = node.input.first().and_then(|i| set.by_wide.get(i)) {
                let mut node = node.clone();
                let out = node.output[0].clone();
                let rows = b.fresh("amp/frozen_rows");
                node.input[0] = w.half.clone();
                node.output[0] = rows.clone();
                let widened = cast(&mut b, &rows, &out);
                replace.insert(at, vec![node, widened]);
                continue;
            }
        }
        // a loop body's product with a large weight reads it in blocks (blocked_reads.rs)
        let mut blocked = node.clone();
        blocked_reads::block_bodies(&mut blocked, &set.by_wide, &dims, &mut b);
        blocked_half::block_half_bodies(&mut blocked, &aliases, &mut b);
        let changed = blocked != *node;
        let node = &blocked;
        let direct: Vec<usize> = (0..node.input.len())
            .filter(|&i| set.contains(&node.input[i]))
            .collect();
        let nested: BTreeSet<String> = outer_reads(node)
            .into_iter()
            .filter(|n| set.contains(n))
            .map(str::to_string)
            .collect();
        if direct.is_empty() && nested.is_empty() {
            if changed {
                replace.insert(at, vec![node.clone()]);
            }
            continue;
        }
        // an activation of this node (computed at run time) that is float32: known so, or
        // bound to the same type as a widened input by the op's schema
        let schema = schemas().schema(node.domain(), node.op_type(), opset);
        let param = |i: usize| schema.and_then(|s| s.input_param(i));
        let widened_params: Vec<Option<String>> = direct.iter().map(|&i| param(i)).collect();
        let like = (0..node.input.len())
            .find(|&i| {
                let n = &node.input[i];
                !n.is_empty()
                    && !set.contains(n)
                    && !inits.contains(n.as_str())
                    && (types.get(n) == Some(FLOAT)
                        || param(i).is_some_and(|p| widened_params.contains(&Some(p))))
            })
            .or_else(|| {
                // any activation will do to wait for (its type unknown)
                (0..node.input.len()).find(|&i| {
                    let n = &node.input[i];
                    !n.is_empty() && !set.contains(n) && !inits.contains(n.as_str())
                })
            })
            .map(|i| node.input[i].clone());
        let mut renames = HashMap::new();
        let wanted = direct
            .iter()
            .map(|&i| node.input[i].clone())
            .chain(nested)
            .collect::<BTreeSet<_>>();
        let mut nodes = Vec::with_capacity(wanted.len() + 1);
        for wide in wanted {
            let w = &set.by_wide[&wide];
            let mine = b.fresh("amp/frozen_f32");
            let half = match &like {
                Some(x) => {
                    let start = b.nodes.len();
                    let after = b.after(&w.half, x, "amp/frozen_after");
                    nodes.extend(b.nodes.drain(start..));
                    after
                }
                None => w.half.clone(),
            };
            nodes.push(cast(&mut b, &half, &mine));
            renames.insert(wide, mine);
        }
        let mut node = node.clone();
        rename_reads(&mut node, &renames);
        nodes.push(node);
        replace.insert(at, nodes);
    }
    splice(graph, Splice::replace(replace));
    // the blocked reads' Slice bounds: outer-graph constants the loop bodies read
    graph.initializer.append(&mut b.initializers);
    graph.value_info.retain(|v| !set.contains(v.name()));
}

//! The fused, chunked LM head of the step graph: the projection to the logits, the
//! cross-entropy and the number loss's reads of the logits become one node
//! ([`node::FORWARD`]) that works over chunks of positions, so no `[N, V]` tensor exists in
//! the forward or the backward (which recomputes each chunk's logits).
//!
//! [`fuse`] runs on the patched forward graph before it is differentiated. It finds the
//! projection (`MatMul`, `Gemm` or `MatMul` + `Add`, the weight as is or a tied embedding
//! through a `Transpose`; then a pointwise map by constants, `passes::pointwise_map`), the
//! layout ops between it and the cross-entropy (reshapes, slices on position axes, the
//! transpose that puts the classes on axis 1), and what reads the logits:
//! the `SoftmaxCrossEntropyLoss` ntl-patch wrote, label smoothing's row mean (or sum) of the
//! scores' `LogSoftmax`, and the number loss's column gathers (and `--reweigh`'s full softmax).
//! Everything else that follows the cross-entropy stays as the graph wrote it; the
//! cross-entropy becomes `lse − z[label]` per position, reduced as the node reduced it.
//! [`lower::lower`] expands the node and its gradient into `Scan`s after differentiation.

pub mod lower;
pub mod node;

use std::collections::{BTreeMap, BTreeSet};

use ntl_ops::names::PREFIX;
use ntl_ops::Builder;

use crate::error::Error;
use crate::graph::patch::{apply, Patch, METADATA_KEY};
use crate::graph::shapes::{Dim, Shapes};
use crate::graph::{normalize_axis, static_rank, GraphIndex};
use crate::onnx::{
    attr, attr_i, attr_ints, default_opset, ModelProto, NodeProto, ValueInfoProto, FLOAT, INT64,
};
use crate::passes::pointwise_map::PointwiseMap;
use node::Head;

/// When the step graph fuses the LM head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Where the logits are at least [`AUTO_MIN_WIDTH`] wide and the head can be fused; a head
    /// that cannot be is left dense, with a warning.
    #[default]
    Auto,
    /// Always; a head that cannot be fused is an error.
    On,
    Off,
}

/// Vocabularies at least this wide are fused by default (every current LLM tokenizer: GPT-2's
/// 50 257, Llama's 32 000 and 128 256, Qwen's 151 936; not the small test vocabularies).
pub const AUTO_MIN_WIDTH: usize = 16384;

/// Float32 elements of one chunk's logits by default (128 MiB): positions per chunk are the
/// largest power of two that keeps `[chunk, V]` within it.
const AUTO_CHUNK_ELEMENTS: i64 = 1 << 25;

#[derive(Debug, Clone, Default)]
pub struct FusedHeadOptions {
    pub mode: Mode,
    /// Positions per chunk (None: from the width, see [`AUTO_CHUNK_ELEMENTS`]).
    pub chunk_tokens: Option<i64>,
}

/// What `fuse` did.
pub enum Outcome {
    Fused(FusedView),
    /// Left dense; the reason where the head was eligible but could not be fused.
    Dense(Option<String>),
}

/// A fused head as the step graph's metadata records it (`ntl_step.fused_head`): enough for
/// `validate` to compute the logits the graph no longer holds (`hidden · weight + bias`).
pub use crate::passes::contract::FusedHead as FusedView;

/// Positions per chunk for logits `width` wide.
pub fn auto_chunk_tokens(width: i64) -> i64 {
    let fit = (AUTO_CHUNK_ELEMENTS / width.max(1)).max(1);
    let pow2 = 1i64 << (63 - fit.leading_zeros());
    pow2.clamp(16, 4096)
}

/// Replaces the LM head, the cross-entropy and the loss's logits reads of a patched graph by
/// one [`node::FORWARD`] node, where `opts` asks for it and the graph allows it.
pub fn fuse(model: &mut ModelProto, opts: &FusedHeadOptions) -> Result<Outcome, Error> {
    let meta = patch_metadata(model)?;
    let wanted = match opts.mode {
        Mode::Off => false,
        Mode::On => true,
        Mode::Auto => meta.width >= AUTO_MIN_WIDTH as i64,
    };
    if !wanted {
        return Ok(Outcome::Dense(None));
    }
    let opset = default_opset(model).unwrap_or(ntl_ops::builder::MIN_OPSET);
    let graph = model.graph.as_ref().expect("loaded models have a graph");
    let index = GraphIndex::new(graph);
    let region = match find_region(&index, &meta) {
        Ok(r) => r,
        Err(why) if opts.mode == Mode::On => {
            return Err(Error::Usage(format!(
                "--fused-head on: the LM head cannot be fused: {why}; drop --fused-head on (the step graph then holds the [N, V] logits)"
            )))
        }
        Err(why) => return Ok(Outcome::Dense(Some(why))),
    };
    let chunk_tokens = opts
        .chunk_tokens
        .unwrap_or_else(|| auto_chunk_tokens(meta.width));
    let mut b = Builder::new(PREFIX, opset, index.taken_names(PREFIX, &[]));
    let (patch, infos, hidden, bias) = replacement(&mut b, &index, &region, &meta, chunk_tokens);
    let ce = &graph.node[region.ce];
    let view = FusedView {
        chunk_tokens,
        hidden,
        weight: region.weight.clone(),
        trans_weight: region.trans_weight,
        bias,
        labels: ce.input[1].clone(),
        class_weights: ce.input.get(2).filter(|w| !w.is_empty()).cloned(),
        logit_map: region.logit_map.steps.clone(),
    };
    let dropped: BTreeSet<String> = region.tensors.clone();
    drop(index);
    let graph = model.graph.as_mut().expect("graph");
    // graph outputs of the logits (a model's `logits` output): the step graph drops them
    graph.output.retain(|o| !dropped.contains(o.name()));
    let declared: BTreeSet<&str> = infos.iter().map(|v| v.name()).collect();
    graph
        .value_info
        .retain(|v| !dropped.contains(v.name()) && !declared.contains(v.name()));
    graph.value_info.extend(infos);
    apply(model, patch)?;
    Ok(Outcome::Fused(view))
}

/// What the patch recorded (`ntl_patch` metadata): the flat logits the number loss reads and
/// the logits width.
struct PatchMeta {
    /// The `[M, V]` view of the logits the number loss reads: the patch's `number_logits` where
    /// it has them (DEL reads the logits before a LogSoftmax), else its `flat_logits`.
    flat_logits: String,
    width: i64,
}

fn patch_metadata(model: &ModelProto) -> Result<PatchMeta, Error> {
    let text = model
        .metadata_props
        .iter()
        .find(|p| p.key() == METADATA_KEY)
        .map(|p| p.value().to_string())
        .ok_or_else(|| Error::Inconsistent("the patched graph has no ntl_patch metadata".into()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::Inconsistent(format!("ntl_patch metadata: {e}")))?;
    let view = v["number_logits"].as_str().or(v["flat_logits"].as_str());
    Ok(PatchMeta {
        flat_logits: view.unwrap_or_default().to_string(),
        width: v["vocab_width"].as_i64().unwrap_or(0),
    })
}

/// A read of the flat logits by the number loss.
enum Read {
    /// `Gather(logits, ids, axis=1)`: node index, ids.
    Columns(usize, String),
    /// `Softmax(logits, axis=1)` read only by column gathers: the softmax and (gather, ids).
    SoftmaxColumns(usize, Vec<(usize, String)>),
}

/// The nodes `fuse` replaces and what it reads.
struct Region {
    ce: usize,
    /// The number loss reads log-probabilities (a LogSoftmax before it), not logits.
    flat_log_probs: bool,
    /// Node indices of the projection and the logits' map: the producer of the logits first
    /// ([`Projection::nodes`]).
    projection: Vec<usize>,
    logit_map: PointwiseMap,
    hidden: String,
    /// The `Reshape` between a `[N, d] × [d, V]` MatMul and the bias `Add` (tf2onnx's
    /// Tensordot), replayed on `hidden` to lay the hidden states out like the logits.
    hidden_reshape: Option<usize>,
    weight: String,
    trans_weight: bool,
    /// A vector `[V]`, or `[1, .., 1, V]` (flattened before the fused node).
    bias: String,
    /// Layout ops from the logits to the cross-entropy's scores, in order, without a final
    /// class-to-axis-1 transpose: the row moves among them are replayed on the hidden states.
    scores_chain: Vec<usize>,
    /// The other layout nodes between the logits and what reads them (removed): the final
    /// transpose and the number loss's own view.
    layout: Vec<usize>,
    /// `Shape` nodes reading the logits where their classes are last.
    shape_reads: Vec<usize>,
    reads: Vec<Read>,
    /// Label smoothing's `LogSoftmax(scores, axis=1)` nodes (removed) and the
    /// `ReduceMean(·, axis=1)` nodes that read them (`ce::smooth`).
    smoothing: Vec<usize>,
    log_prob_means: Vec<usize>,
    /// Tensors that stop existing.
    tensors: BTreeSet<String>,
}

/// Ops that only move the logits (or change nothing), and the log-softmax over the classes
/// (the cross-entropy of log-probabilities is that of the logits): the class axis is checked
/// separately.
fn is_layout(op: &str) -> bool {
    matches!(
        op,
        "Identity"
            | "Cast"
            | "Reshape"
            | "Flatten"
            | "Squeeze"
            | "Unsqueeze"
            | "Slice"
            | "Transpose"
            | "LogSoftmax"
    )
}

/// Walks back from `t` through layout ops until `stop` or a non-layout producer: the tensor
/// reached and the layout nodes on the way, in forward order.
fn walk_back(index: &GraphIndex, t: &str, stop: &dyn Fn(&str) -> bool) -> (String, Vec<usize>) {
    let mut chain = Vec::new();
    let mut t = t.to_string();
    while !stop(&t) {
        match index.producer(&t) {
            Some((i, n)) if is_layout(n.op_type()) && !n.input.is_empty() => {
                chain.push(i);
                t = n.input[0].clone();
            }
            _ => break,
        }
        if chain.len() > 64 {
            break;
        }
    }
    chain.reverse();
    (t, chain)
}

fn find_region(index: &GraphIndex, meta: &PatchMeta) -> Result<Region, String> {
    let graph = index.graph;
    let (flat_root, mut flat_chain) = walk_back(index, &meta.flat_logits, &|_| false);
    // the cross-entropy ntl-patch wrote: the SoftmaxCrossEntropyLoss whose scores come from the
    // same logits as the number loss's
    let mut ces = graph.node.iter().enumerate().filter(|(_, n)| {
        n.op_type() == "SoftmaxCrossEntropyLoss"
            && n.input
                .first()
                .is_some_and(|s| walk_back(index, s, &|_| false).0 == flat_root)
    });
    let (ce, ce_node) = ces
        .next()
        .ok_or("the number loss and the cross-entropy read different logits")?;
    if ces.next().is_some() {
        return Err("two cross-entropies read the same logits".into());
    }
    let (root, scores_chain) = walk_back(index, &ce_node.input[0], &|_| false);
    let scores_tensors: BTreeSet<String> = std::iter::once(root.clone())
        .chain(
            scores_chain
                .iter()
                .map(|&i| graph.node[i].output[0].clone()),
        )
        .collect();
    // the number loss's view joins the scores' chain where it branches off
    let (joint, branch) = walk_back(index, &meta.flat_logits, &|t| scores_tensors.contains(t));
    flat_chain.retain(|i| branch.contains(i));
    // whether that view is of log-probabilities: a LogSoftmax on its way from the logits (none
    // of the scores' chain where the view branches off at the logits themselves)
    let up_to_joint = scores_chain
        .iter()
        .take_while(|&&i| joint != root && graph.node[i].output[0] != joint)
        .chain(
            scores_chain
                .iter()
                .find(|&&i| graph.node[i].output[0] == joint),
        );
    let flat_log_probs = up_to_joint
        .chain(&flat_chain)
        .any(|&i| graph.node[i].op_type() == "LogSoftmax");
    let shapes = Shapes::infer(index);
    let (class_last, final_transpose) =
        class_last_ops(index, &shapes, &root, &scores_chain, meta.width)?;
    let mut layout: Vec<usize> = final_transpose.into_iter().collect();
    layout.extend(flat_chain.iter().copied());
    let class_last_tensors: BTreeSet<String> = std::iter::once(root.clone())
        .chain(class_last.iter().map(|&i| graph.node[i].output[0].clone()))
        .collect();
    for &i in &flat_chain {
        let op = graph.node[i].op_type();
        let class_softmax =
            op == "LogSoftmax" && matches!(attr_i(&graph.node[i], "axis"), Some(-1) | Some(1));
        if !matches!(
            op,
            "Identity" | "Cast" | "Reshape" | "Flatten" | "Transpose"
        ) && !class_softmax
        {
            return Err(format!("the number loss reads the logits through {op}"));
        }
    }
    let projection = find_projection(index, &root)?;

    let mut tensors: BTreeSet<String> = scores_tensors;
    for &i in &layout {
        tensors.extend(graph.node[i].output.iter().cloned());
    }
    tensors.insert(meta.flat_logits.clone());
    let layout_set: BTreeSet<usize> = layout.iter().chain(&scores_chain).copied().collect();
    // every reader of the logits' views is one of the region's own nodes, a loss read, or a
    // Shape (answered from the hidden states' shape)
    let mut reads = Vec::new();
    let mut shape_reads = Vec::new();
    let mut smoothing = Vec::new();
    let mut log_prob_means = Vec::new();
    for t in &tensors {
        for &c in index.consumers(t) {
            if layout_set.contains(&c) || c == ce {
                continue;
            }
            let n = &graph.node[c];
            if n.op_type() == "Shape" && class_last_tensors.contains(t) {
                shape_reads.push(c);
                continue;
            }
            if *t == ce_node.input[0] {
                if let Some(means) = smoothing_means(index, c) {
                    smoothing.push(c);
                    log_prob_means.extend(means);
                    continue;
                }
            }
            if *t != meta.flat_logits {
                return Err(format!(
                    "the logits are also read by {} node '{}'",
                    n.op_type(),
                    n.name()
                ));
            }
            reads.push(loss_read(index, c)?);
        }
    }
    if let Some(lp) = ce_node.output.get(1).filter(|o| !o.is_empty()) {
        if !index.consumers(lp).is_empty() {
            return Err("the cross-entropy's log-probabilities are read by the graph".into());
        }
    }
    let Projection {
        hidden,
        hidden_reshape,
        weight,
        trans_weight,
        bias,
        nodes: projection_nodes,
        map: logit_map,
    } = projection;
    Ok(Region {
        ce,
        flat_log_probs,
        projection: projection_nodes,
        logit_map,
        hidden,
        hidden_reshape,
        weight,
        trans_weight,
        bias,
        scores_chain: class_last,
        layout,
        shape_reads,
        reads,
        smoothing,
        log_prob_means,
        tensors,
    })
}

/// Checks that the layout ops keep the classes on the last axis (a final transpose may move
/// them to axis 1 for the cross-entropy): the ops before that transpose, and the transpose if
/// there is one.
fn class_last_ops(
    index: &GraphIndex,
    shapes: &Shapes,
    root: &str,
    chain: &[usize],
    width: i64,
) -> Result<(Vec<usize>, Option<usize>), String> {
    let graph = index.graph;
    let mut rank = static_rank(index, root).ok_or("the logits' rank is unknown")?;
    for (k, &i) in chain.iter().enumerate() {
        let n = &graph.node[i];
        let last = k + 1 == chain.len();
        let out_rank = static_rank(index, &n.output[0]);
        let keeps = match n.op_type() {
            "Identity" => true,
            "Cast" => attr_i(n, "to") == Some(FLOAT as i64),
            // rows of V stay rows of V: the classes stay last and the positions in order
            "Reshape" => {
                index.static_last_dim(&n.output[0]) == Some(width)
                    || shapes
                        .get(&n.output[0])
                        .and_then(|s| s.last())
                        .is_some_and(|d| *d == Dim::Known(width))
            }
            "LogSoftmax" => normalize_axis(attr_i(n, "axis").unwrap_or(-1), rank) == Some(rank - 1),
            "Flatten" => attr_i(n, "axis").unwrap_or(1) == rank as i64 - 1,
            "Squeeze" | "Unsqueeze" => {
                let axes = n.input.get(1).and_then(|a| index.constant_i64(a));
                let r = if n.op_type() == "Unsqueeze" {
                    out_rank.unwrap_or(0)
                } else {
                    rank
                };
                axes.is_some_and(|a| {
                    a.iter()
                        .all(|&x| normalize_axis(x, r).is_some_and(|x| x + 1 < r))
                })
            }
            "Slice" => n
                .input
                .get(3)
                .and_then(|a| index.constant_i64(a))
                .is_some_and(|a| {
                    a.iter()
                        .all(|&x| normalize_axis(x, rank).is_some_and(|x| x + 1 < rank))
                }),
            "Transpose" => {
                let perm = attr_ints(n, "perm").unwrap_or_default();
                let class_to_1: Vec<i64> = std::iter::once(0)
                    .chain(std::iter::once(rank as i64 - 1))
                    .chain(1..rank as i64 - 1)
                    .collect();
                if last && rank >= 3 && perm == class_to_1 {
                    return Ok((chain[..k].to_vec(), Some(i)));
                }
                perm.len() == rank && perm.last() == Some(&(rank as i64 - 1))
            }
            _ => false,
        };
        if !keeps {
            return Err(format!(
                "{} node '{}' between the LM head and the cross-entropy moves the class axis or changes the logits",
                n.op_type(),
                n.name()
            ));
        }
        rank = out_rank.ok_or_else(|| format!("the rank after '{}' is unknown", n.name()))?;
    }
    Ok((chain.to_vec(), None))
}

/// `z = h·W (+ b)` producing the logits.
struct Projection {
    hidden: String,
    /// See [`Region::hidden_reshape`].
    hidden_reshape: Option<usize>,
    weight: String,
    /// The weight is `[V, d]` (a Gemm's `transB`, or a tied embedding read through a Transpose).
    trans_weight: bool,
    /// Empty without one.
    bias: String,
    /// The producer of the logits first (the last step of `map`, else `Add`/`Gemm`/`MatMul`),
    /// the map's other steps, the projection's (a `MatMul` under an `Add`), then an absorbed
    /// `Transpose` of the weight.
    nodes: Vec<usize>,
    /// The steps between the projection and the logits.
    map: PointwiseMap,
}

/// `z = h·W (+ b)` producing the logits: `MatMul`, `Gemm` (α = β = 1), or `MatMul` + a bias
/// `Add`, the `MatMul` possibly behind a `Reshape` (tf2onnx's Tensordot: `[N, d] × [d, V]`
/// reshaped to `[B, T, V]`).
fn find_projection(index: &GraphIndex, logits: &str) -> Result<Projection, String> {
    let graph = index.graph;
    let (map, logits, map_nodes) = PointwiseMap::find(index, logits)?;
    let (p, node) = index
        .producer(&logits)
        .ok_or("the logits are no node's output")?;
    let only_reader = |t: &str, reader: usize| index.consumers(t) == [reader];
    let rank1 = |t: &str| static_rank(index, t) == Some(1);
    // a bias that broadcasts along the classes only: [V] or [1, .., 1, V] (jax2onnx; BART's
    // `final_logits_bias`, behind a `Cast` to its own type in TorchScript's export)
    let bias_like = |t: &str| {
        let mut t = t;
        while let Some((_, n)) = index.producer(t) {
            match n.op_type() {
                "Cast" | "Identity" => t = &n.input[0],
                _ => break,
            }
        }
        rank1(t)
            || index.declared_shape(t).is_some_and(|(_, dims)| {
                dims.len() >= 2 && dims[..dims.len() - 1].iter().all(|d| *d == Some(1))
            })
    };
    let (matmul, bias, hidden_reshape) = match node.op_type() {
        "MatMul" => (p, String::new(), None),
        "Add" => {
            // (MatMul, the Reshape between it and the Add if any)
            let side = |k: usize| {
                let (i, n) = index.producer(&node.input[k])?;
                if !only_reader(&node.input[k], p) {
                    return None;
                }
                match n.op_type() {
                    "MatMul" => Some((i, None)),
                    "Reshape" => {
                        let (m, mm) = index.producer(&n.input[0])?;
                        (mm.op_type() == "MatMul"
                            && only_reader(&n.input[0], i)
                            && static_rank(index, &mm.input[0]) == Some(2))
                        .then_some((m, Some(i)))
                    }
                    _ => None,
                }
            };
            match (side(0), side(1)) {
                (Some((m, r)), _) if bias_like(&node.input[1]) => (m, node.input[1].clone(), r),
                (_, Some((m, r))) if bias_like(&node.input[0]) => (m, node.input[0].clone(), r),
                _ => return Err("the logits are an Add that is not MatMul + bias".into()),
            }
        }
        "Gemm" => {
            let one = |a: &str| attr(node, a).is_none_or(|x| x.f() == 1.0);
            if !one("alpha") || !one("beta") || attr_i(node, "transA").unwrap_or(0) != 0 {
                return Err("the LM head is a Gemm with alpha, beta or transA".into());
            }
            let bias = node.input.get(2).cloned().unwrap_or_default();
            if !bias.is_empty() && !rank1(&bias) {
                return Err("the LM head's Gemm bias is not a vector".into());
            }
            return Ok(Projection {
                hidden: node.input[0].clone(),
                hidden_reshape: None,
                weight: node.input[1].clone(),
                trans_weight: attr_i(node, "transB").unwrap_or(0) != 0,
                bias,
                nodes: [map_nodes, vec![p]].concat(),
                map,
            });
        }
        op => {
            return Err(format!(
                "the logits come from {op} node '{}', not a MatMul/Gemm projection{}",
                node.name(),
                if op == "Tanh" || op == "Mul" || op == "Div" {
                    " (after the projection the fused head takes products and quotients by constants and one Tanh)"
                } else {
                    ""
                }
            ))
        }
    };
    let mm = &graph.node[matmul];
    let (h, w) = (mm.input[0].clone(), mm.input[1].clone());
    if static_rank(index, &w) != Some(2) || static_rank(index, &h).is_none_or(|r| r < 2) {
        return Err("the LM head's MatMul is not hidden [.., d] × weight [d, V]".into());
    }
    let mut nodes = map_nodes;
    nodes.push(p);
    if matmul != p {
        nodes.push(matmul);
    }
    let mut projection = Projection {
        hidden: h,
        hidden_reshape,
        weight: w.clone(),
        trans_weight: false,
        bias,
        nodes,
        map,
    };
    // a tied embedding read through a Transpose: read the embedding itself, transposed
    if let Some((t, tn)) = index.producer(&w) {
        let perm = attr_ints(tn, "perm");
        let swaps = perm.as_deref().is_none_or(|p| p == [1, 0]);
        if tn.op_type() == "Transpose" && swaps && only_reader(&w, matmul) {
            projection.nodes.push(t);
            projection.weight = tn.input[0].clone();
            projection.trans_weight = true;
        }
    }
    Ok(projection)
}

/// A loss read of the flat logits: a column gather, or a softmax read only by column gathers.
fn loss_read(index: &GraphIndex, c: usize) -> Result<Read, String> {
    let n = &index.graph.node[c];
    let columns = |n: &NodeProto| {
        (n.op_type() == "Gather"
            && attr_i(n, "axis") == Some(1)
            && index.constant_i64(&n.input[1]).is_some())
        .then(|| n.input[1].clone())
    };
    if let Some(ids) = columns(n) {
        return Ok(Read::Columns(c, ids));
    }
    if n.op_type() == "Softmax" && matches!(attr_i(n, "axis"), Some(1) | Some(-1)) {
        let gathers: Option<Vec<(usize, String)>> = index
            .consumers(&n.output[0])
            .iter()
            .map(|&g| columns(&index.graph.node[g]).map(|ids| (g, ids)))
            .collect();
        if let Some(g) = gathers {
            return Ok(Read::SoftmaxColumns(c, g));
        }
    }
    Err(format!(
        "the number loss reads the logits through {} node '{}'",
        n.op_type(),
        n.name()
    ))
}

/// Label smoothing's read of the scores (`ce::smooth`): node `c` is `LogSoftmax(scores,
/// axis=1)` read only by `ReduceMean(·, axis=1, keepdims=0)` nodes; those nodes.
fn smoothing_means(index: &GraphIndex, c: usize) -> Option<Vec<usize>> {
    let n = &index.graph.node[c];
    if n.op_type() != "LogSoftmax" || attr_i(n, "axis") != Some(1) {
        return None;
    }
    let readers = index.consumers(&n.output[0]);
    let means: Option<Vec<usize>> = readers.iter().map(|&m| class_mean(index, m)).collect();
    means.filter(|m| !m.is_empty() && !index.is_graph_output(&n.output[0]))
}

/// `ReduceMean(x, axis=1, keepdims=0)` (label smoothing's mean log-probability) or
/// `ReduceSum(x, axis=1, keepdims=0)` (the smoothed cross-entropy forms rewrite): its index.
fn class_mean(index: &GraphIndex, c: usize) -> Option<usize> {
    let n = &index.graph.node[c];
    let axes = attr_ints(n, "axes").or_else(|| n.input.get(1).and_then(|a| index.constant_i64(a)));
    (matches!(n.op_type(), "ReduceMean" | "ReduceSum")
        && axes == Some(vec![1])
        && attr_i(n, "keepdims") == Some(0))
    .then_some(c)
}

/// The fused node and everything it replaces, as a patch; the value infos of its outputs, the
/// `[N, d]` hidden states and the `[V]` bias (or "") it reads.
fn replacement(
    b: &mut Builder,
    index: &GraphIndex,
    r: &Region,
    meta: &PatchMeta,
    chunk_tokens: i64,
) -> (Patch, Vec<ValueInfoProto>, String, String) {
    let graph = index.graph;
    let ce = &graph.node[r.ce];
    let mut replacements: BTreeMap<usize, Vec<NodeProto>> = BTreeMap::new();
    let h = hidden_like_logits(b, graph, r, meta, &mut replacements);
    let shape = b.node("Shape", &[&h], "fused/hidden_shape", vec![]);
    let d = b.slice(&shape, -1, i64::MAX, 0, "fused/hidden_width");
    let minus_one = b.const_i64("fused/minus_one", &[1], &[-1]);
    let flat_shape = b.concat(&[&minus_one, &d], 0, "fused/hidden_rows_shape");
    let hidden = b.node("Reshape", &[&h, &flat_shape], "fused/hidden_rows", vec![]);
    let labels = b.reshape(&ce.input[1], &[-1], "fused/labels");
    // a Cast even from int64: validate's tract copy makes the patch's int64 casts exact
    // (tract reads a Cast to int64 as one to its dimension type, which Scan refuses)
    let labels = b.cast(&labels, INT64, "fused/labels_i64");
    let ignore_index = attr_i(ce, "ignore_index");

    let ids = column_sets(r);
    let bias = if r.bias.is_empty() || static_rank(index, &r.bias) == Some(1) {
        r.bias.clone()
    } else {
        b.reshape(&r.bias, &[-1], "fused/bias")
    };
    let head = Head {
        hidden: hidden.clone(),
        weight: r.weight.clone(),
        trans_weight: r.trans_weight,
        bias: bias.clone(),
        labels: labels.clone(),
        ignore_index,
        ids: ids.clone(),
        id_counts: ids
            .iter()
            .map(|i| index.constant_i64(i).map_or(0, |v| v.len() as i64))
            .collect(),
        mean_logit: !r.log_prob_means.is_empty(),
        chunk_tokens,
        width: meta.width,
        logit_map: r.logit_map.clone(),
    };
    let lse = b.fresh("fused/lse");
    let label_logit = b.fresh("fused/label_logit");
    let columns: Vec<String> = ids.iter().map(|_| b.fresh("fused/columns")).collect();
    let mean = head.mean_logit.then(|| b.fresh("fused/mean_logit"));
    let mut outputs = vec![lse.clone(), label_logit.clone()];
    outputs.extend(columns.iter().cloned());
    outputs.extend(mean.iter().cloned());
    let name = b.fresh(node::FORWARD);
    b.nodes.push(head.forward_node(&name, outputs));
    let positions = "ntl/fused_positions";
    // the labels first: the backward then sees every per-position tensor as equally long and
    // reads their shape from the labels (`Shapes::shape_source`), not from the forward's
    // outputs, which would make the gradient wait for the forward (lower.rs computes both in
    // one pass where it need not)
    let mut infos = vec![
        vector_info(&labels, INT64, positions, None),
        vector_info(&lse, FLOAT, positions, None),
        vector_info(&label_logit, FLOAT, positions, None),
    ];
    if static_rank(index, &ce.input[1]) == Some(1) {
        // the cross-entropy's own flat labels are as long (label smoothing's mask reads them)
        let t = index.elem_type(&ce.input[1]).unwrap_or(INT64);
        infos.push(vector_info(&ce.input[1], t, positions, None));
    }
    for (c, i) in columns.iter().zip(&ids) {
        let k = index.constant_i64(i).map_or(0, |v| v.len() as i64);
        infos.push(vector_info(c, FLOAT, positions, Some(k)));
    }
    infos.extend(mean.iter().map(|m| vector_info(m, FLOAT, positions, None)));

    // the per-position values' shape: the labels' — read from the flat labels where they are
    // flat, whose declared length the backward then sees (it need not wait for the forward)
    let per_position_shape = match static_rank(index, &ce.input[1]) {
        Some(1) => labels.clone(),
        _ => ce.input[1].clone(),
    };
    cross_entropy(
        b,
        ce,
        &labels,
        &per_position_shape,
        ignore_index,
        &lse,
        &label_logit,
    );
    replacements.insert(r.ce, std::mem::take(&mut b.nodes));
    if let Some(mean) = mean.as_deref() {
        mean_log_probs(
            b,
            graph,
            r,
            meta,
            (mean, &lse),
            &per_position_shape,
            &mut replacements,
        );
    }
    rewire_reads(b, graph, r, (&ids, &columns), &lse, &mut replacements);
    for &i in r.projection.iter().chain(&r.layout).chain(&r.smoothing) {
        replacements.insert(i, Vec::new());
    }
    let patch = Patch {
        replacements: replacements.into_iter().collect(),
        initializers: std::mem::take(&mut b.initializers),
        outputs: Vec::new(),
        metadata: Vec::new(),
    };
    (patch, infos, hidden, bias)
}

/// The hidden states through the same row moves as the logits, each where the logits' op was
/// (into `replacements`), and the reads of the logits' shape answered from them: the hidden
/// states laid out like the class-last logits tensor.
fn hidden_like_logits(
    b: &mut Builder,
    graph: &crate::onnx::GraphProto,
    r: &Region,
    meta: &PatchMeta,
    replacements: &mut BTreeMap<usize, Vec<NodeProto>>,
) -> String {
    let mut hidden_at: BTreeMap<&str, String> = BTreeMap::new();
    let root = graph.node[r.projection[0]].output[0].as_str();
    let mut h = r.hidden.clone();
    if let Some(i) = r.hidden_reshape {
        h = replay_on_hidden(b, &graph.node[i], &h);
        replacements.insert(i, std::mem::take(&mut b.nodes));
    }
    hidden_at.insert(root, h.clone());
    for &i in &r.scores_chain {
        let n = &graph.node[i];
        if !matches!(n.op_type(), "Identity" | "Cast" | "LogSoftmax") {
            h = replay_on_hidden(b, n, &h);
        }
        hidden_at.insert(&n.output[0], h.clone());
        replacements.insert(i, std::mem::take(&mut b.nodes));
    }
    for &c in &r.shape_reads {
        let n = &graph.node[c];
        let hs = b.node(
            "Shape",
            &[&hidden_at[n.input[0].as_str()]],
            "fused/logits_shape",
            vec![],
        );
        let lead = b.slice(&hs, 0, -1, 0, "fused/logits_shape_lead");
        let v = b.const_i64("fused/width", &[1], &[meta.width]);
        let full = b.concat(&[&lead, &v], 0, "fused/logits_shape_full");
        let start = attr_i(n, "start").unwrap_or(0);
        let end = attr_i(n, "end").unwrap_or(i64::MAX);
        let out = n.output[0].as_str();
        if (start, end) == (0, i64::MAX) {
            b.node_to("Identity", &[&full], &[out], vec![]);
        } else {
            let s = b.const_i64("fused/shape_start", &[1], &[start]);
            let e = b.const_i64("fused/shape_end", &[1], &[end]);
            b.node_to("Slice", &[&full, &s, &e], &[out], vec![]);
        }
        replacements.insert(c, std::mem::take(&mut b.nodes));
    }
    h
}

/// The column sets the logits' readers take, each once, in reading order.
fn column_sets(r: &Region) -> Vec<String> {
    let mut ids: Vec<String> = Vec::new();
    for read in &r.reads {
        let sets = match read {
            Read::Columns(_, i) => vec![i.clone()],
            Read::SoftmaxColumns(_, g) => g.iter().map(|(_, i)| i.clone()).collect(),
        };
        for s in sets {
            if !ids.contains(&s) {
                ids.push(s);
            }
        }
    }
    ids
}

/// Label smoothing's mean log-probabilities from the fused node's mean logit and `lse`, in
/// place of the class reductions, shaped like the labels.
fn mean_log_probs(
    b: &mut Builder,
    graph: &crate::onnx::GraphProto,
    r: &Region,
    meta: &PatchMeta,
    (mean, lse): (&str, &str),
    per_position_shape: &str,
    replacements: &mut BTreeMap<usize, Vec<NodeProto>>,
) {
    for &m in &r.log_prob_means {
        let mut lp = b.binary("Sub", mean, lse, "fused/mean_log_prob");
        if graph.node[m].op_type() == "ReduceSum" {
            let width = b.scalar_f32("fused/width", meta.width as f32);
            lp = b.binary("Mul", &lp, &width, "fused/sum_log_prob");
        }
        let labels_shape = b.node("Shape", &[per_position_shape], "fused/labels_shape", vec![]);
        b.node_to(
            "Reshape",
            &[&lp, &labels_shape],
            &[&graph.node[m].output[0]],
            vec![],
        );
        replacements.insert(m, std::mem::take(&mut b.nodes));
    }
}

/// The logits' readers answered from the fused node's columns (`ids[k]`'s in `columns[k]`):
/// log-probabilities as column − `lse`, probabilities as their `Exp`.
fn rewire_reads(
    b: &mut Builder,
    graph: &crate::onnx::GraphProto,
    r: &Region,
    (ids, columns): (&[String], &[String]),
    lse: &str,
    replacements: &mut BTreeMap<usize, Vec<NodeProto>>,
) {
    let column_of = |i: &str| &columns[ids.iter().position(|x| x == i).expect("collected")];
    for read in &r.reads {
        match read {
            Read::Columns(g, i) => {
                let out = &graph.node[*g].output[0];
                if r.flat_log_probs {
                    let lse_col = b.unsqueeze(lse, &[1], "fused/lse_col");
                    b.node_to("Sub", &[column_of(i), &lse_col], &[out], vec![]);
                } else {
                    b.node_to("Identity", &[column_of(i)], &[out], vec![]);
                }
                replacements.insert(*g, std::mem::take(&mut b.nodes));
            }
            Read::SoftmaxColumns(s, gathers) => {
                let lse_col = b.unsqueeze(lse, &[1], "fused/lse_col");
                replacements.insert(*s, std::mem::take(&mut b.nodes));
                for (g, i) in gathers {
                    let shifted = b.binary("Sub", column_of(i), &lse_col, "fused/log_probs");
                    let out = &graph.node[*g].output[0];
                    b.node_to("Exp", &[&shifted], &[out], vec![]);
                    replacements.insert(*g, std::mem::take(&mut b.nodes));
                }
            }
        }
    }
}

/// A layout op of the logits, applied to the hidden states (`d` in place of `V`).
fn replay_on_hidden(b: &mut Builder, node: &NodeProto, h: &str) -> String {
    let mut n = node.clone();
    n.input[0] = h.to_string();
    if n.op_type() == "Reshape" {
        // the target with its last entry (V) replaced by the hidden width
        let target = &node.input[1];
        let lead = b.slice(target, 0, -1, 0, "fused/replay_lead");
        let shape = b.node("Shape", &[h], "fused/replay_shape", vec![]);
        let d = b.slice(&shape, -1, i64::MAX, 0, "fused/replay_width");
        let t = b.concat(&[&lead, &d], 0, "fused/replay_target");
        n.input[1] = t;
    }
    let out = b.fresh("fused/hidden_moved");
    n.output = vec![out.clone()];
    n.name = Some(b.fresh("fused/replay"));
    b.nodes.push(n);
    out
}

/// The cross-entropy node `ce` as `lse − z[label]` per position, masked and reduced as the
/// node's attributes say, written to its loss output (`per_position_shape`: a tensor of the
/// labels' shape, for reduction `none`).
fn cross_entropy(
    b: &mut Builder,
    ce: &NodeProto,
    labels: &str,
    per_position_shape: &str,
    ignore_index: Option<i64>,
    lse: &str,
    label_logit: &str,
) {
    let loss = b.binary("Sub", lse, label_logit, "fused/ce_per_position");
    let kept = ignore_index.map(|i| {
        let ignore = b.const_i64("fused/ignore_index", &[], &[i]);
        let ignored = b.equal(labels, &ignore, "fused/ignored");
        b.unary("Not", &ignored, "fused/kept")
    });
    let weights = ce.input.get(2).filter(|w| !w.is_empty());
    let weight = match (weights, &kept) {
        (Some(w), kept) => {
            let safe = match kept {
                Some(k) => {
                    let zero = b.const_i64("fused/zero_label", &[], &[0]);
                    b.where_(k, labels, &zero, "fused/weight_labels")
                }
                None => labels.to_string(),
            };
            let w = b.gather(w, &safe, 0, "fused/class_weight");
            Some(match kept {
                Some(k) => {
                    let kf = b.cast(k, FLOAT, "fused/kept_f");
                    b.binary("Mul", &w, &kf, "fused/position_weight")
                }
                None => w,
            })
        }
        (None, Some(k)) => Some(b.cast(k, FLOAT, "fused/position_weight")),
        (None, None) => None,
    };
    let per_position = match &weight {
        Some(w) => b.binary("Mul", &loss, w, "fused/ce_weighted"),
        None => loss,
    };
    let out = ce.output[0].as_str();
    let reduction = crate::onnx::attr_s(ce, "reduction").unwrap_or_else(|| "mean".into());
    match reduction.as_str() {
        "none" => {
            let shape = b.node("Shape", &[per_position_shape], "fused/labels_shape", vec![]);
            b.node_to("Reshape", &[&per_position, &shape], &[out], vec![]);
        }
        "sum" => {
            let s = b.reduce_sum(&per_position, &[], false, "fused/ce_sum");
            b.node_to("Identity", &[&s], &[out], vec![]);
        }
        _ => {
            let total = b.reduce_sum(&per_position, &[], false, "fused/ce_sum");
            let count = match &weight {
                Some(w) => b.reduce_sum(w, &[], false, "fused/ce_count"),
                None => {
                    let n = b.node("Size", &[&per_position], "fused/ce_positions", vec![]);
                    b.cast(&n, FLOAT, "fused/ce_count")
                }
            };
            b.node_to("Div", &[&total, &count], &[out], vec![]);
        }
    }
}

/// An `[N]` (or `[N, k]`) value info, N the symbolic dim `positions`: the backward's shapes see
/// the tensors as equally long.
fn vector_info(name: &str, elem: i32, positions: &str, k: Option<i64>) -> ValueInfoProto {
    let mut dims = vec![node::Dim::from(positions)];
    dims.extend(k.map(node::Dim::from));
    node::tensor_info(name, elem, &dims)
}

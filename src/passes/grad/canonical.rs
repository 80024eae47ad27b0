//! Forward rewrites that make exported graphs differentiable without changing any value:
//! `SequenceAt(SplitToSequence(x, split, axis), k)` with constant `split` and `k` (the dynamo
//! exporter's `torch.split`) becomes `Slice(x, start_k, end_k, axis)`, so the gradient needs no
//! sequence types; and a constant-mode `Pad` of an integer tensor (Hugging Face's label shift)
//! runs on float64 — CUDA and ROCm have Pad kernels for float types and bool only, and
//! int → double → int is exact for |v| < 2^53; and `CastLike` whose target type is known
//! becomes `Cast` (MIGraphX takes no CastLike; the dynamo exporter writes them).

use std::collections::BTreeSet;

use crate::graph::patch::{splice, Splice};
use crate::graph::GraphIndex;
use crate::onnx::{attr_i, GraphProto, NodeProto};
use ntl_ops::Builder;

/// Rewrites `graph` in place; new constants are named through `b`.
pub fn canonicalize(graph: &mut GraphProto, b: &mut Builder) {
    split_to_sequence_as_slices(graph, b);
    pad_integers_through_double(graph, b);
    cast_like_as_cast(graph);
}

fn cast_like_as_cast(graph: &mut GraphProto) {
    let types = crate::graph::elem_types::ElemTypes::infer(graph);
    for node in graph.node.iter_mut() {
        if node.op_type() != "CastLike" || node.input.len() != 2 {
            continue;
        }
        if let Some(t) = types.get(&node.input[1]) {
            node.op_type = Some("Cast".into());
            node.input.truncate(1);
            node.attribute.retain(|a| a.name() == "saturate");
            node.attribute.push(crate::onnx::int_attr("to", t as i64));
        }
    }
}

/// `SequenceAt(SplitToSequence(...))` with constant split and index → `Slice`.
pub fn split_to_sequence_as_slices(graph: &mut GraphProto, b: &mut Builder) {
    let index = GraphIndex::new(graph);
    let mut replaced: Vec<(usize, Vec<NodeProto>)> = Vec::new();
    let mut splits_used: BTreeSet<usize> = BTreeSet::new();
    for (i, node) in graph.node.iter().enumerate() {
        if node.op_type() != "SequenceAt" || node.input.len() != 2 || node.output.len() != 1 {
            continue;
        }
        let Some((si, split)) = index.producer(&node.input[0]) else {
            continue;
        };
        if split.op_type() != "SplitToSequence" || split.input.is_empty() {
            continue;
        }
        let Some(k) = index.constant_i64(&node.input[1]).filter(|v| v.len() == 1) else {
            continue;
        };
        let Some((start, end)) = bounds(&index, split, k[0]) else {
            continue;
        };
        let axis = attr_i(split, "axis").unwrap_or(0);
        let keepdims = attr_i(split, "keepdims").unwrap_or(1) != 0;
        let no_split = split.input.get(1).is_none_or(|s| s.is_empty());
        let s = b.const_i64("canon/start", &[1], &[start]);
        let e = b.const_i64("canon/end", &[1], &[end]);
        let a = b.const_i64("canon/axis", &[1], &[axis]);
        let mut nodes = Vec::new();
        let out = node.output[0].clone();
        let sliced = if no_split && !keepdims {
            b.fresh("canon/slice")
        } else {
            out.clone()
        };
        nodes.push(NodeProto {
            name: Some(b.fresh("canon/Slice")),
            op_type: Some("Slice".into()),
            input: vec![split.input[0].clone(), s, e, a.clone()],
            output: vec![sliced.clone()],
            ..Default::default()
        });
        if no_split && !keepdims {
            nodes.push(NodeProto {
                name: Some(b.fresh("canon/Squeeze")),
                op_type: Some("Squeeze".into()),
                input: vec![sliced, a],
                output: vec![out],
                ..Default::default()
            });
        }
        replaced.push((i, nodes));
        splits_used.insert(si);
    }
    if replaced.is_empty() {
        return;
    }
    // Splits whose every consumer was replaced are dead.
    let replaced_at: BTreeSet<usize> = replaced.iter().map(|(i, _)| *i).collect();
    let dead: BTreeSet<usize> = splits_used
        .into_iter()
        .filter(|&si| {
            let out = &graph.node[si].output[0];
            index.consumers(out).iter().all(|c| replaced_at.contains(c))
                && !index.is_graph_output(out)
        })
        .collect();
    let mut edits = Splice::replace(replaced);
    for i in dead {
        edits.replace.entry(i).or_default();
    }
    splice(graph, edits);
}

fn pad_integers_through_double(graph: &mut GraphProto, b: &mut Builder) {
    use crate::onnx::{DOUBLE, INT32, INT64};
    let types = crate::graph::elem_types::ElemTypes::infer(graph);
    let int_pad = |n: &NodeProto| -> Option<i32> {
        let constant = crate::onnx::attr_s(n, "mode").is_none_or(|m| m == "constant");
        let t = types.get(n.input.first()?)?;
        let int = t == INT64 || t == INT32;
        (n.op_type() == "Pad" && constant && int && n.output.len() == 1).then_some(t)
    };
    if !graph.node.iter().any(|n| int_pad(n).is_some()) {
        return;
    }
    let pending = std::mem::take(&mut b.nodes);
    let mut replace = std::collections::BTreeMap::new();
    for (i, node) in graph.node.iter().enumerate() {
        let Some(t) = int_pad(node) else {
            continue;
        };
        let mut pad = node.clone();
        pad.input[0] = b.cast(&node.input[0], DOUBLE, "canon/pad_input_f64");
        if let Some(v) = pad.input.get_mut(2).filter(|v| !v.is_empty()) {
            *v = b.cast(v, DOUBLE, "canon/pad_value_f64");
        }
        let padded = b.fresh("canon/padded_f64");
        pad.output = vec![padded.clone()];
        b.nodes.push(pad);
        b.node_to(
            "Cast",
            &[&padded],
            &[&node.output[0]],
            vec![crate::onnx::int_attr("to", t as i64)],
        );
        replace.insert(i, std::mem::take(&mut b.nodes));
    }
    splice(graph, Splice::replace(replace));
    b.nodes = pending;
}

/// `[start, end)` of chunk `k` along the split axis, from a constant `split` (chunk sizes, or
/// one chunk length) or none (chunks of 1).
fn bounds(index: &GraphIndex, split: &NodeProto, k: i64) -> Option<(i64, i64)> {
    if k < 0 {
        return None;
    }
    match split.input.get(1).filter(|s| !s.is_empty()) {
        None => Some((k, k + 1)),
        Some(s) => {
            let sizes = index.constant_i64(s)?;
            let is_scalar = index.constant_tensor(s)?.dims.is_empty();
            if is_scalar {
                let c = *sizes.first()?;
                Some((k * c, (k + 1) * c))
            } else {
                let k = usize::try_from(k).ok()?;
                if k >= sizes.len() {
                    return None;
                }
                let start: i64 = sizes[..k].iter().sum();
                Some((start, start + sizes[k]))
            }
        }
    }
}

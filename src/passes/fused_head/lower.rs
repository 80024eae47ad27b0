//! The fused head's two internal nodes expanded into standard ONNX: the positions padded to
//! `S` chunks of `C` (`S = ⌈N / chunk_tokens⌉`, `C = ⌈N / S⌉`, both read at run time), and a
//! `Scan` over the chunks. A chunk's logits `[C, V]` live only inside its iteration; the weight
//! and bias gradients accumulate in the `Scan`'s state (one `Gemm` with the accumulator as its
//! `C` input). Forward and gradient share one `Scan` where the gradient's dense part does not
//! depend on the forward ([`one_pass`]); otherwise a second `Scan` recomputes the logits.
//!
//! The bodies read the weight, the bias and the id constants from the outer graph (ONNX
//! subgraphs see the enclosing graph's tensors), so nothing of size `[d, V]` is copied per
//! iteration.

use ntl_ops::names::PREFIX;
use ntl_ops::Builder;

use super::node::{Head, BACKWARD, DOMAIN, FORWARD};
use crate::graph::GraphIndex;
use crate::onnx::proto::tensor_shape_proto::{dimension, Dimension};
use crate::onnx::proto::{type_proto, TensorShapeProto};
use crate::onnx::{
    default_opset, graph_attr, int_attr, string_attr, GraphProto, ModelProto, NodeProto, TypeProto,
    ValueInfoProto, FLOAT, INT64,
};

/// Replaces every fused node of the model's graph by its `Scan` expansion: one `Scan` for the
/// forward and the gradient together where the gradient's dense part is known before the
/// forward runs ([`one_pass`]), else a forward `Scan` and a backward one that recomputes the
/// logits.
pub fn lower(model: &mut ModelProto) {
    let opset = default_opset(model).unwrap_or(ntl_ops::builder::MIN_OPSET);
    let graph = model.graph.as_mut().expect("graph");
    if !graph.node.iter().any(super::node::is_fused) {
        return;
    }
    let mut b = Builder::new(PREFIX, opset, GraphIndex::new(graph).taken_names());
    let merged = one_pass(graph);
    let old = std::mem::take(&mut graph.node);
    let forward_nodes: Vec<NodeProto> = old
        .iter()
        .filter(|n| (n.domain(), n.op_type()) == (DOMAIN, FORWARD))
        .cloned()
        .collect();
    for node in old {
        match (node.domain(), node.op_type()) {
            (DOMAIN, FORWARD) if merged.contains(&node.output[0]) => {}
            (DOMAIN, FORWARD) => forward(&mut b, &node),
            (DOMAIN, BACKWARD) => {
                let fwd = forward_nodes
                    .iter()
                    .find(|f| node.input.contains(&f.output[0]));
                match fwd.filter(|f| merged.contains(&f.output[0])) {
                    Some(f) => forward_and_backward(&mut b, f, &node),
                    None => backward(&mut b, &node),
                }
            }
            _ => graph.node.push(node),
        }
        graph.node.append(&mut b.nodes);
    }
    graph.initializer.append(&mut b.initializers);
    if !merged.is_empty() {
        // the forward's readers now wait for the merged Scan, placed where the gradient was
        crate::graph::patch::topological_sort(graph);
    }
}

/// The forward nodes (by their first output) whose gradient can be computed with the forward in
/// one pass: the upstream gradients of the log-sum-exp, the label's logit and the row mean do
/// not depend on anything the forward computes — the loss is linear in them with label-side
/// coefficients (the cross-entropy's reduction, masks, `num_items_in_batch`, label smoothing,
/// `--combine`), which holds unless the number loss reads the log-sum-exp (`--reweigh`). The
/// columns' gradient, which depends on the forward, is added afterwards: `[N, K]`, cheap.
fn one_pass(graph: &GraphProto) -> std::collections::HashSet<String> {
    use std::collections::{HashMap, HashSet};
    let mut consumers: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, n) in graph.node.iter().enumerate() {
        for x in n.input.iter().filter(|x| !x.is_empty()) {
            consumers.entry(x.as_str()).or_default().push(i);
        }
    }
    let mut merged = HashSet::new();
    for fwd in graph
        .node
        .iter()
        .filter(|n| (n.domain(), n.op_type()) == (DOMAIN, FORWARD))
    {
        let Some(bwd) = graph.node.iter().find(|n| {
            (n.domain(), n.op_type()) == (DOMAIN, BACKWARD) && n.input.contains(&fwd.output[0])
        }) else {
            continue;
        };
        // everything computed from the forward's outputs
        let mut reached: HashSet<&str> = fwd.output.iter().map(String::as_str).collect();
        let mut stack: Vec<&str> = reached.iter().copied().collect();
        while let Some(t) = stack.pop() {
            for &c in consumers.get(t).into_iter().flatten() {
                for o in &graph.node[c].output {
                    if reached.insert(o.as_str()) {
                        stack.push(o.as_str());
                    }
                }
            }
        }
        let head = Head::of(bwd);
        let g = 4 + head.ids.len() + 1; // after the forward's lse
        let mut dense = vec![&bwd.input[g], &bwd.input[g + 1]];
        if head.mean_logit {
            dense.push(&bwd.input[g + head.forward_outputs() - 1]);
        }
        if dense.iter().all(|t| !reached.contains(t.as_str())) {
            merged.insert(fwd.output[0].clone());
        }
    }
    merged
}

/// One `Scan` for the forward and the gradient's dense part: each chunk's logits give the
/// forward's outputs and `dz = softmax·g_lse + onehot(label)·g_label + g_mean/V`, accumulated
/// into the weight's and bias's gradients and multiplied into the hidden states'. The columns'
/// gradient `g_cols` (known only after the forward's readers ran) is added after: `hᵀ·g_cols`
/// into the weight's columns, `g_cols·W[:, ids]ᵀ` into the hidden states'.
fn forward_and_backward(b: &mut Builder, fwd: &NodeProto, node: &NodeProto) {
    let head = Head::of(node);
    let n_out = head.forward_outputs();
    let at = 4 + head.ids.len() + 1;
    let g: Vec<String> = node.input[at..at + n_out].to_vec();
    let (out_h, out_w, out_b) = (&node.output[0], &node.output[1], &node.output[2]);

    let ch = chunks(b, &head.hidden, head.chunk_tokens);
    let mut scan_in = vec![
        to_chunks(b, &head.hidden, FLOAT, &ch),
        to_chunks(b, &head.labels, INT64, &ch),
        to_chunks(b, &g[0], FLOAT, &ch),
        to_chunks(b, &g[1], FLOAT, &ch),
    ];
    if head.mean_logit {
        scan_in.push(to_chunks(b, &g[n_out - 1], FLOAT, &ch));
    }
    let zero = b.scalar_f32("fused/zero", 0.0);
    let mut state_in = Vec::new();
    for (want, t) in [(out_w, &head.weight), (out_b, &head.bias)] {
        if !want.is_empty() {
            let s = b.node("Shape", &[t], "fused/acc_shape", vec![]);
            state_in.push(b.node("Expand", &[&zero, &s], "fused/acc_zeros", vec![]));
        }
    }
    let outer = std::mem::take(&mut b.nodes);

    let acc_w = (!out_w.is_empty()).then(|| b.fresh("fused/acc_w"));
    let acc_b = (!out_b.is_empty()).then(|| b.fresh("fused/acc_b"));
    let slices: Vec<String> = scan_in.iter().map(|_| b.fresh("fused/slice")).collect();
    let (h, y) = (&slices[0], &slices[1]);
    let (z, y_safe) = chunk_logits(b, &head, h, y);
    let (max, _) = b.top1(&z, "fused/row_max");
    let shifted = b.binary("Sub", &z, &max, "fused/shifted");
    let e = b.unary("Exp", &shifted, "fused/exp");
    let sum = b.reduce_sum(&e, &[1], true, "fused/exp_sum");
    let log = b.unary("Log", &sum, "fused/log_sum");
    let lse = b.binary("Add", &log, &max, "fused/lse_col");
    let lse_c = b.squeeze(&lse, &[1], "fused/lse_c");
    let y_col = b.unsqueeze(&y_safe, &[1], "fused/label_col");
    let picked = b.node(
        "GatherElements",
        &[&z, &y_col],
        "fused/picked",
        vec![int_attr("axis", 1)],
    );
    let picked = b.squeeze(&picked, &[1], "fused/label_logit_c");
    let row = vec![None];
    let mut fwd_outs: Vec<Typed> = vec![(lse_c, FLOAT, row.clone()), (picked, FLOAT, row.clone())];
    for (ids, k) in head.ids.iter().zip(&head.id_counts) {
        let cols = b.gather(&z, ids, 1, "fused/columns_c");
        fwd_outs.push((cols, FLOAT, vec![None, Some(*k)]));
    }
    if head.mean_logit {
        let mean = b.reduce("ReduceMean", &z, &[1], false, "fused/mean_c");
        fwd_outs.push((mean, FLOAT, row.clone()));
    }
    // dz = softmax·g_lse (+ g_mean/V) + onehot(label)·g_label
    let p = b.binary("Div", &e, &sum, "fused/p");
    let g_lse = b.unsqueeze(&slices[2], &[1], "fused/g_lse_col");
    let mut dz = b.binary("Mul", &p, &g_lse, "fused/dz");
    if head.mean_logit {
        let width = b.scalar_f32("fused/width", head.width as f32);
        let per_class = b.binary("Div", &slices[4], &width, "fused/g_mean_per_class");
        let col = b.unsqueeze(&per_class, &[1], "fused/g_mean_col");
        dz = b.binary("Add", &dz, &col, "fused/dz");
    }
    let g_label = b.unsqueeze(&slices[3], &[1], "fused/g_label_col");
    dz = scatter_add(b, &dz, &y_col, &g_label);
    let mut grad_outs: Vec<Typed> = Vec::new();
    if let Some(acc) = &acc_w {
        let (a, bb) = if head.trans_weight {
            (&dz, h)
        } else {
            (h, &dz)
        };
        let next = b.node(
            "Gemm",
            &[a, bb, acc],
            "fused/acc_w_next",
            vec![int_attr("transA", 1)],
        );
        grad_outs.push((next, FLOAT, vec![None, None]));
    }
    if let Some(acc) = &acc_b {
        let col_sum = b.reduce_sum(&dz, &[0], false, "fused/db_c");
        let next = b.binary("Add", acc, &col_sum, "fused/acc_b_next");
        grad_outs.push((next, FLOAT, vec![None]));
    }
    let dh = (!out_h.is_empty()).then(|| {
        b.node(
            "Gemm",
            &[&dz, &head.weight],
            "fused/dh_c",
            vec![int_attr("transB", (!head.trans_weight) as i64)],
        )
    });
    let mut ins: Vec<Typed> = Vec::new();
    ins.extend(acc_w.iter().map(|a| (a.clone(), FLOAT, vec![None, None])));
    ins.extend(acc_b.iter().map(|a| (a.clone(), FLOAT, vec![None])));
    for (k, s) in slices.iter().enumerate() {
        let (elem, dims) = match k {
            0 => (FLOAT, vec![None, None]),
            1 => (INT64, vec![None]),
            _ => (FLOAT, vec![None]),
        };
        ins.push((s.clone(), elem, dims));
    }
    // Scan outputs: the state first, then the stacked per-chunk values
    let mut outs = grad_outs;
    outs.extend(fwd_outs);
    outs.extend(dh.iter().map(|d| (d.clone(), FLOAT, vec![None, None])));
    let body_graph = body(b, &ins, &outs, "fused_head_forward_backward");

    b.nodes = outer;
    let mut inputs: Vec<&str> = state_in.iter().map(String::as_str).collect();
    inputs.extend(scan_in.iter().map(String::as_str));
    let w_dense = (!out_w.is_empty()).then(|| b.fresh("fused/w_grad_dense"));
    let b_dense = (!out_b.is_empty()).then(|| b.fresh("fused/b_grad_dense"));
    let mut outputs: Vec<String> = w_dense.iter().chain(&b_dense).cloned().collect();
    let stacked: Vec<String> = (0..n_out).map(|_| b.fresh("fused/stacked")).collect();
    outputs.extend(stacked.iter().cloned());
    let dh_stacked = dh.as_ref().map(|_| b.fresh("fused/dh_stacked"));
    outputs.extend(dh_stacked.iter().cloned());
    let refs: Vec<&str> = outputs.iter().map(String::as_str).collect();
    b.node_to(
        "Scan",
        &inputs,
        &refs,
        vec![
            graph_attr("body", body_graph),
            int_attr("num_scan_inputs", scan_in.len() as i64),
        ],
    );
    for (s, out) in stacked.iter().zip(&fwd.output) {
        from_chunks(b, s, &ch, out);
    }

    // the columns' gradients, after the forward's readers computed them
    let g_cols = &g[2..2 + head.ids.len()];
    let mut dh_total = dh_stacked.map(|s| {
        let d = b.fresh("fused/dh_dense");
        from_chunks(b, &s, &ch, &d);
        d
    });
    let mut w_total = w_dense;
    let mut b_total = b_dense;
    for (ids, gc) in head.ids.iter().zip(g_cols) {
        // the weight's columns (rows of a [V, d] weight) the ids pick
        let axis = if head.trans_weight { 0 } else { 1 };
        if let Some(w) = &w_total {
            // hᵀ·g_cols [d, K], or g_colsᵀ·h [K, d] for a [V, d] weight
            let (a, bb) = if head.trans_weight {
                (gc.as_str(), head.hidden.as_str())
            } else {
                (head.hidden.as_str(), gc.as_str())
            };
            let upd = b.node(
                "Gemm",
                &[a, bb],
                "fused/w_grad_cols",
                vec![int_attr("transA", 1)],
            );
            let idx = column_indices(b, ids, &upd, axis);
            w_total = Some(scatter_add_axis(b, w, &idx, &upd, axis));
        }
        if let Some(bias) = &b_total {
            let upd = b.reduce_sum(gc, &[0], false, "fused/b_grad_cols");
            b_total = Some(scatter_add_axis(b, bias, ids, &upd, 0));
        }
        if let Some(dh) = &dh_total {
            let w_cols = b.gather(&head.weight, ids, axis, "fused/w_cols");
            let extra = b.node(
                "Gemm",
                &[gc, &w_cols],
                "fused/dh_cols",
                vec![int_attr("transB", (!head.trans_weight) as i64)],
            );
            dh_total = Some(b.binary("Add", dh, &extra, "fused/dh"));
        }
    }
    for (total, out) in [(w_total, out_w), (b_total, out_b), (dh_total, out_h)] {
        if let Some(t) = total {
            b.node_to("Identity", &[&t], &[out], vec![]);
        }
    }
}

/// Indices for adding `upd` (`[d, K]` along axis 1, or `[K, d]` along axis 0) into a weight at
/// the columns (rows) `ids`.
fn column_indices(b: &mut Builder, ids: &str, upd: &str, axis: i64) -> String {
    let laid = b.unsqueeze(ids, &[1 - axis], "fused/ids_laid");
    let shape = b.node("Shape", &[upd], "fused/upd_shape", vec![]);
    b.node("Expand", &[&laid, &shape], "fused/ids_at", vec![])
}

/// `d += u` at `indices` along `axis` (indices distinct along it).
fn scatter_add_axis(b: &mut Builder, d: &str, indices: &str, u: &str, axis: i64) -> String {
    if b.opset() >= 16 {
        return b.node(
            "ScatterElements",
            &[d, indices, u],
            "fused/grad_cols_added",
            vec![int_attr("axis", axis), string_attr("reduction", "add")],
        );
    }
    let old = b.node(
        "GatherElements",
        &[d, indices],
        "fused/grad_old",
        vec![int_attr("axis", axis)],
    );
    let sum = b.binary("Add", &old, u, "fused/grad_new");
    b.node(
        "ScatterElements",
        &[d, indices, &sum],
        "fused/grad_cols_added",
        vec![int_attr("axis", axis)],
    )
}

/// Run-time chunking of `rows` (a tensor of `[N, ...]`): N, and the padded count and shape.
struct Chunks {
    n: String,
    pad: String,
    s: String,
    c: String,
}

fn chunks(b: &mut Builder, rows: &str, chunk_tokens: i64) -> Chunks {
    let shape = b.node("Shape", &[rows], "fused/rows_shape", vec![]);
    let n = b.slice(&shape, 0, 1, 0, "fused/n");
    let one = b.const_i64("fused/one", &[1], &[1]);
    let most = b.const_i64("fused/chunk_tokens", &[1], &[chunk_tokens]);
    let c0 = b.binary("Min", &most, &n, "fused/chunk_cap");
    let c0 = b.binary("Max", &c0, &one, "fused/chunk_cap_1");
    let ceil_div = |b: &mut Builder, a: &str, d: &str, hint: &str| {
        let d1 = b.binary("Sub", d, &one, &format!("{hint}_d1"));
        let up = b.binary("Add", a, &d1, &format!("{hint}_up"));
        let q = b.binary("Div", &up, d, &format!("{hint}_q"));
        b.binary("Max", &q, &one, hint)
    };
    let s = ceil_div(b, &n, &c0, "fused/chunks");
    let c = ceil_div(b, &n, &s, "fused/chunk_rows");
    let total = b.binary("Mul", &s, &c, "fused/padded_rows");
    let pad = b.binary("Sub", &total, &n, "fused/pad_rows");
    Chunks { n, pad, s, c }
}

/// `x` (`[N, ...]`) followed by `S·C − N` rows of zeros of its type, reshaped to
/// `[S, C, ...]`. Concat of an Expand rather than Pad: ORT's CUDA provider has no int64 Pad.
fn to_chunks(b: &mut Builder, x: &str, elem: i32, ch: &Chunks) -> String {
    let shape = b.node("Shape", &[x], "fused/chunked_shape_of", vec![]);
    let tail = b.slice(&shape, 1, i64::MAX, 0, "fused/chunked_tail");
    let pad_shape = b.concat(&[&ch.pad, &tail], 0, "fused/pad_shape");
    let zero = if elem == INT64 {
        b.const_i64("fused/pad_zero", &[], &[0])
    } else {
        b.scalar_f32("fused/pad_zero", 0.0)
    };
    let zeros = b.node("Expand", &[&zero, &pad_shape], "fused/pad_rows", vec![]);
    let padded = b.concat(&[x, &zeros], 0, "fused/padded");
    let target = b.concat(&[&ch.s, &ch.c, &tail], 0, "fused/chunked_shape");
    b.node("Reshape", &[&padded, &target], "fused/chunked", vec![])
}

/// Stacked scan outputs `[S, C, ...]` back to the first N rows `[N, ...]`.
fn from_chunks(b: &mut Builder, stacked: &str, ch: &Chunks, out: &str) {
    let shape = b.node("Shape", &[stacked], "fused/stacked_shape", vec![]);
    let tail = b.slice(&shape, 2, i64::MAX, 0, "fused/stacked_tail");
    let minus_one = b.const_i64("fused/rows", &[1], &[-1]);
    let target = b.concat(&[&minus_one, &tail], 0, "fused/unchunked_shape");
    let rows = b.node("Reshape", &[stacked, &target], "fused/unchunked", vec![]);
    let zero = b.const_i64("fused/row_zero", &[1], &[0]);
    let axis = b.const_i64("fused/row_axis", &[1], &[0]);
    b.node_to("Slice", &[&rows, &zero, &ch.n, &axis], &[out], vec![]);
}

/// A typed body input or output: rank `dims.len()`, each dim known (`Some`) or unnamed.
fn value(name: &str, elem: i32, dims: &[Option<i64>]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| Dimension {
            value: d.map(dimension::Value::DimValue),
            ..Default::default()
        })
        .collect();
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(elem),
                shape: Some(TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A Scan body of the nodes `b` holds (the caller set the outer graph's nodes aside), with
/// typed inputs and outputs.
fn body(b: &mut Builder, inputs: &[Typed], outputs: &[Typed], name: &str) -> GraphProto {
    GraphProto {
        name: Some(name.into()),
        node: std::mem::take(&mut b.nodes),
        input: inputs.iter().map(|(n, t, d)| value(n, *t, d)).collect(),
        output: outputs.iter().map(|(n, t, d)| value(n, *t, d)).collect(),
        ..Default::default()
    }
}

/// A body input or output: name, element type, dims (None: not known statically).
type Typed = (String, i32, Vec<Option<i64>>);

/// The chunk's logits `z = h·W (+ b)` `[C, V]`, and its labels with the ignore index as 0.
fn chunk_logits(b: &mut Builder, head: &Head, h: &str, y: &str) -> (String, String) {
    let mut inputs = vec![h, head.weight.as_str()];
    if !head.bias.is_empty() {
        inputs.push(&head.bias);
    }
    let z = b.node(
        "Gemm",
        &inputs,
        "fused/z",
        vec![int_attr("transB", head.trans_weight as i64)],
    );
    let y = match head.ignore_index {
        Some(i) => {
            let ignore = b.const_i64("fused/ignore", &[], &[i]);
            let zero = b.const_i64("fused/label_zero", &[], &[0]);
            let ignored = b.equal(y, &ignore, "fused/is_ignored");
            b.where_(&ignored, &zero, y, "fused/safe_label")
        }
        None => y.to_string(),
    };
    (z, y)
}

/// `FusedHeadLoss` → chunking + `Scan` computing lse, the label logit, the column sets and the
/// row mean per chunk.
fn forward(b: &mut Builder, node: &NodeProto) {
    let head = Head::of(node);
    let ch = chunks(b, &head.hidden, head.chunk_tokens);
    let h_chunks = to_chunks(b, &head.hidden, FLOAT, &ch);
    let y_chunks = to_chunks(b, &head.labels, INT64, &ch);
    let outer = std::mem::take(&mut b.nodes);

    let (h, y) = (b.fresh("fused/h_c"), b.fresh("fused/y_c"));
    let (z, y_safe) = chunk_logits(b, &head, &h, &y);
    // the row maximum by TopK: onnxruntime-rocm 1.22 has no ReduceMax for opset 20
    let (max, _) = b.top1(&z, "fused/row_max");
    let shifted = b.binary("Sub", &z, &max, "fused/shifted");
    let e = b.unary("Exp", &shifted, "fused/exp");
    let sum = b.reduce_sum(&e, &[1], true, "fused/exp_sum");
    let log = b.unary("Log", &sum, "fused/log_sum");
    let lse = b.binary("Add", &log, &max, "fused/lse_col");
    let lse = b.squeeze(&lse, &[1], "fused/lse_c");
    let y_col = b.unsqueeze(&y_safe, &[1], "fused/label_col");
    let picked = b.node(
        "GatherElements",
        &[&z, &y_col],
        "fused/picked",
        vec![int_attr("axis", 1)],
    );
    let picked = b.squeeze(&picked, &[1], "fused/label_logit_c");
    let row = vec![None];
    let mut outs: Vec<Typed> = vec![(lse, FLOAT, row.clone()), (picked, FLOAT, row.clone())];
    for (ids, k) in head.ids.iter().zip(&head.id_counts) {
        let cols = b.gather(&z, ids, 1, "fused/columns_c");
        outs.push((cols, FLOAT, vec![None, Some(*k)]));
    }
    if head.mean_logit {
        let mean = b.reduce("ReduceMean", &z, &[1], false, "fused/mean_c");
        outs.push((mean, FLOAT, row.clone()));
    }
    let ins = [(h, FLOAT, vec![None, None]), (y, INT64, row)];
    let g = body(b, &ins, &outs, "fused_head_forward");

    b.nodes = outer;
    let stacked: Vec<String> = outs.iter().map(|_| b.fresh("fused/stacked")).collect();
    let refs: Vec<&str> = stacked.iter().map(String::as_str).collect();
    b.node_to(
        "Scan",
        &[&h_chunks, &y_chunks],
        &refs,
        vec![graph_attr("body", g), int_attr("num_scan_inputs", 2)],
    );
    for (s, out) in stacked.iter().zip(&node.output) {
        from_chunks(b, s, &ch, out);
    }
}

/// `d += u` at `indices` (`[C, k]`) along axis 1: ScatterElements with reduction from opset
/// 16, else gather, add and scatter (the indices of one call are distinct within a row).
fn scatter_add(b: &mut Builder, d: &str, indices: &str, u: &str) -> String {
    let axis = int_attr("axis", 1);
    if b.opset() >= 16 {
        return b.node(
            "ScatterElements",
            &[d, indices, u],
            "fused/dz",
            vec![axis, string_attr("reduction", "add")],
        );
    }
    let old = b.node(
        "GatherElements",
        &[d, indices],
        "fused/dz_old",
        vec![axis.clone()],
    );
    let sum = b.binary("Add", &old, u, "fused/dz_new");
    b.node(
        "ScatterElements",
        &[d, indices, &sum],
        "fused/dz",
        vec![axis],
    )
}

/// `FusedHeadLossGrad` → chunking + `Scan` recomputing each chunk's logits: `dz = p·g_lse +
/// g_mean/V + scatter(g_label, label) + scatter(g_cols, ids)`, `dh = dz·Wᵀ`, and `W`'s and
/// `b`'s gradients summed in the Scan's state.
fn backward(b: &mut Builder, node: &NodeProto) {
    let head = Head::of(node);
    let fwd = head.forward_outputs();
    let grads_at = 4 + head.ids.len();
    let lse = node.input[grads_at].clone();
    let g: Vec<String> = node.input[grads_at + 1..grads_at + 1 + fwd].to_vec();
    let (out_h, out_w, out_b) = (&node.output[0], &node.output[1], &node.output[2]);

    let ch = chunks(b, &head.hidden, head.chunk_tokens);
    let mut scan_in = vec![
        to_chunks(b, &head.hidden, FLOAT, &ch),
        to_chunks(b, &head.labels, INT64, &ch),
        to_chunks(b, &lse, FLOAT, &ch),
    ];
    for t in &g {
        scan_in.push(to_chunks(b, t, FLOAT, &ch));
    }
    let mut state_in = Vec::new();
    let zero = b.scalar_f32("fused/zero", 0.0);
    for (want, t) in [(out_w, &head.weight), (out_b, &head.bias)] {
        if !want.is_empty() {
            let s = b.node("Shape", &[t], "fused/acc_shape", vec![]);
            state_in.push(b.node("Expand", &[&zero, &s], "fused/acc_zeros", vec![]));
        }
    }
    let outer = std::mem::take(&mut b.nodes);

    // the body: state (dW, db), then one slice of every scan input
    let acc_w = (!out_w.is_empty()).then(|| b.fresh("fused/acc_w"));
    let acc_b = (!out_b.is_empty()).then(|| b.fresh("fused/acc_b"));
    let slices: Vec<String> = scan_in.iter().map(|_| b.fresh("fused/slice")).collect();
    let (h, y, lse_c) = (&slices[0], &slices[1], &slices[2]);
    let gs = &slices[3..];
    let (z, y_safe) = chunk_logits(b, &head, h, y);
    let lse_col = b.unsqueeze(lse_c, &[1], "fused/lse_col");
    let shifted = b.binary("Sub", &z, &lse_col, "fused/log_p");
    let p = b.unary("Exp", &shifted, "fused/p");
    let g_lse = b.unsqueeze(&gs[0], &[1], "fused/g_lse_col");
    let mut dz = b.binary("Mul", &p, &g_lse, "fused/dz");
    if head.mean_logit {
        let width = b.scalar_f32("fused/width", head.width as f32);
        let per_class = b.binary("Div", &gs[fwd - 1], &width, "fused/g_mean_per_class");
        let col = b.unsqueeze(&per_class, &[1], "fused/g_mean_col");
        dz = b.binary("Add", &dz, &col, "fused/dz");
    }
    let y_col = b.unsqueeze(&y_safe, &[1], "fused/label_col");
    let g_label = b.unsqueeze(&gs[1], &[1], "fused/g_label_col");
    dz = scatter_add(b, &dz, &y_col, &g_label);
    for (j, ids) in head.ids.iter().enumerate() {
        let g_cols = &gs[2 + j];
        let ids_row = b.unsqueeze(ids, &[0], "fused/ids_row");
        let shape = b.node("Shape", &[g_cols], "fused/g_cols_shape", vec![]);
        let idx = b.node("Expand", &[&ids_row, &shape], "fused/ids_at", vec![]);
        dz = scatter_add(b, &dz, &idx, g_cols);
    }
    let mut outs: Vec<Typed> = Vec::new();
    if let Some(acc) = &acc_w {
        // dW = hᵀ·dz ([d, V]) or, for a weight stored [V, d], dzᵀ·h; added to the state
        let (a, bb) = if head.trans_weight {
            (&dz, h)
        } else {
            (h, &dz)
        };
        let next = b.node(
            "Gemm",
            &[a, bb, acc],
            "fused/acc_w_next",
            vec![int_attr("transA", 1)],
        );
        outs.push((next, FLOAT, vec![None, None]));
    }
    if let Some(acc) = &acc_b {
        let col_sum = b.reduce_sum(&dz, &[0], false, "fused/db_c");
        let next = b.binary("Add", acc, &col_sum, "fused/acc_b_next");
        outs.push((next, FLOAT, vec![None]));
    }
    if !out_h.is_empty() {
        let dh = b.node(
            "Gemm",
            &[&dz, &head.weight],
            "fused/dh_c",
            vec![int_attr("transB", (!head.trans_weight) as i64)],
        );
        outs.push((dh, FLOAT, vec![None, None]));
    }
    let mut ins: Vec<Typed> = Vec::new();
    ins.extend(acc_w.iter().map(|a| (a.clone(), FLOAT, vec![None, None])));
    ins.extend(acc_b.iter().map(|a| (a.clone(), FLOAT, vec![None])));
    for (k, s) in slices.iter().enumerate() {
        // h, labels, lse, then the upstream gradients in the forward outputs' order
        let (elem, dims) = match k {
            0 => (FLOAT, vec![None, None]),
            1 => (INT64, vec![None]),
            _ => match k.checked_sub(5).and_then(|j| head.id_counts.get(j)) {
                Some(&c) => (FLOAT, vec![None, Some(c)]),
                None => (FLOAT, vec![None]),
            },
        };
        ins.push((s.clone(), elem, dims));
    }
    let g = body(b, &ins, &outs, "fused_head_backward");

    b.nodes = outer;
    let mut inputs: Vec<&str> = state_in.iter().map(String::as_str).collect();
    inputs.extend(scan_in.iter().map(String::as_str));
    let mut outputs: Vec<String> = Vec::new();
    for want in [out_w, out_b] {
        if !want.is_empty() {
            outputs.push(want.clone());
        }
    }
    let dh_stacked = (!out_h.is_empty()).then(|| b.fresh("fused/dh_stacked"));
    outputs.extend(dh_stacked.iter().cloned());
    let refs: Vec<&str> = outputs.iter().map(String::as_str).collect();
    b.node_to(
        "Scan",
        &inputs,
        &refs,
        vec![
            graph_attr("body", g),
            int_attr("num_scan_inputs", scan_in.len() as i64),
        ],
    );
    if let Some(stacked) = dh_stacked {
        from_chunks(b, &stacked, &ch, out_h);
    }
}

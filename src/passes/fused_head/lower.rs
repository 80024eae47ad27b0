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
use crate::graph::patch::{splice, Splice};
use crate::graph::GraphIndex;
use crate::onnx::{
    default_opset, graph_attr, int_attr, string_attr, GraphProto, ModelProto, NodeProto, FLOAT,
    INT64,
};
use std::collections::BTreeMap;

/// Replaces every fused node of the model's graph by its `Scan` expansion: one `Scan` for the
/// forward and the gradient together where the gradient's dense part is known before the
/// forward runs ([`one_pass`]), else a forward `Scan` and a backward one that recomputes the
/// logits.
pub fn lower(model: &mut ModelProto, half: Option<i32>) {
    let opset = default_opset(model).unwrap_or(ntl_ops::builder::MIN_OPSET);
    let graph = model.graph.as_mut().expect("graph");
    if !graph.node.iter().any(super::node::is_fused) {
        return;
    }
    let mut b = Builder::new(
        PREFIX,
        opset,
        GraphIndex::new(graph).taken_names(PREFIX, &[]),
    );
    let merged = one_pass(graph);
    let forward_nodes: Vec<&NodeProto> = graph
        .node
        .iter()
        .filter(|n| (n.domain(), n.op_type()) == (DOMAIN, FORWARD))
        .collect();
    // each fused node replaced by its lowering (a merged forward by nothing: its backward
    // computes both)
    let mut replace = BTreeMap::new();
    for (i, node) in graph.node.iter().enumerate() {
        match (node.domain(), node.op_type()) {
            (DOMAIN, FORWARD) if merged.contains(&node.output[0]) => {}
            (DOMAIN, FORWARD) => forward(&mut b, node, half),
            (DOMAIN, BACKWARD) => {
                let fwd = forward_nodes
                    .iter()
                    .find(|f| node.input.contains(&f.output[0]));
                match fwd.filter(|f| merged.contains(&f.output[0])) {
                    Some(f) => forward_and_backward(&mut b, f, node, half),
                    None => backward(&mut b, node, half),
                }
            }
            _ => continue,
        }
        replace.insert(i, std::mem::take(&mut b.nodes));
    }
    splice(graph, Splice::replace(replace));
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
fn forward_and_backward(b: &mut Builder, fwd: &NodeProto, node: &NodeProto, half: Option<i32>) {
    let head = Head::of(node);
    let proj = Projection::of(b, &head, half);
    let grads = Grads::of(&head, node);
    let ch = chunks(b, &head.hidden, head.chunk_tokens);
    let mut scan_in = vec![
        to_chunks(b, &head.hidden, FLOAT, &ch),
        to_chunks(b, &head.labels, INT64, &ch),
        to_chunks(b, &grads.lse_grad, FLOAT, &ch),
        to_chunks(b, &grads.label_grad, FLOAT, &ch),
    ];
    scan_in.extend(grads.mean_grad.iter().map(|g| to_chunks(b, g, FLOAT, &ch)));
    let state_in = accumulator_zeros(b, &head, &grads);
    let outer = std::mem::take(&mut b.nodes);

    let acc = Accumulators::fresh(b, &grads);
    let slices: Vec<String> = scan_in.iter().map(|_| b.fresh("fused/slice")).collect();
    let (h, y) = (&slices[0], &slices[1]);
    let f = chunk_forward(b, &head, &proj, h, y);
    let p = b.binary("Div", &f.exp, &f.exp_sum, "fused/p");
    let g_mean = head.mean_logit.then(|| slices[4].as_str());
    let dz = dense_dz(b, &head, &p, &slices[2], &slices[3], g_mean, &f.label_col);
    let dz = head.logit_map.slope(b, &dz, f.tanh.as_deref());
    let (mut outs, dh) = accumulate(b, &head, &proj, h, &dz, &acc, grads.want_hidden());
    // the map's tanh at the columns the losses read: their gradients join after the Scan
    let tanh_cols: Vec<String> = match &f.tanh {
        Some(t) => head
            .ids
            .iter()
            .map(|ids| b.gather(t, ids, 1, "fused/tanh_cols"))
            .collect(),
        None => Vec::new(),
    };
    let mut ins = acc.typed();
    ins.extend(typed_slices(&slices, &[]));
    // Scan outputs: the state first, then the stacked per-chunk values
    outs.extend(f.outs);
    outs.extend(dh.iter().map(|d| (d.clone(), FLOAT, vec![None, None])));
    outs.extend(
        tanh_cols
            .iter()
            .zip(&head.id_counts)
            .map(|(t, &k)| (t.clone(), FLOAT, vec![None, Some(k)])),
    );
    let body_graph = body(b, &ins, &outs, "fused_head_forward_backward");

    b.nodes = outer;
    let dense = |b: &mut Builder, want: &str, hint: &str| (!want.is_empty()).then(|| b.fresh(hint));
    let mut w_total = dense(b, &grads.weight, "fused/w_grad_dense");
    let mut b_total = dense(b, &grads.bias, "fused/b_grad_dense");
    let stacked: Vec<String> = fwd
        .output
        .iter()
        .map(|_| b.fresh("fused/stacked"))
        .collect();
    let dh_stacked = dh.as_ref().map(|_| b.fresh("fused/dh_stacked"));
    let tanh_stacked: Vec<String> = tanh_cols
        .iter()
        .map(|_| b.fresh("fused/tanh_cols_stacked"))
        .collect();
    let outputs: Vec<&str> = w_total
        .iter()
        .chain(&b_total)
        .chain(&stacked)
        .chain(&dh_stacked)
        .chain(&tanh_stacked)
        .map(String::as_str)
        .collect();
    scan(b, &state_in, &scan_in, &outputs, body_graph);
    for (s, out) in stacked.iter().zip(&fwd.output) {
        from_chunks(b, s, &ch, out);
    }
    // per column set, its tanh (none without a Tanh in the map)
    let tanh_at_cols: Vec<Option<String>> = (0..head.ids.len())
        .map(|j| {
            let s = tanh_stacked.get(j)?;
            let t = b.fresh("fused/tanh_cols_dense");
            from_chunks(b, s, &ch, &t);
            Some(t)
        })
        .collect();

    // the columns' gradients, after the forward's readers computed them
    let mut dh_total = dh_stacked.map(|s| {
        let d = b.fresh("fused/dh_dense");
        from_chunks(b, &s, &ch, &d);
        d
    });
    // the weight's columns (rows of a [V, d] weight) the ids pick
    let axis = if head.trans_weight { 0 } else { 1 };
    for ((ids, gc), t) in head.ids.iter().zip(&grads.column_grads).zip(&tanh_at_cols) {
        // the columns' gradients through the logit map
        let gc = &head.logit_map.slope(b, gc, t.as_deref());
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
            let idx = ids_along(b, ids, &upd, axis);
            w_total = Some(scatter_add(b, w, &idx, &upd, axis));
        }
        if let Some(bias) = &b_total {
            let upd = b.reduce_sum(gc, &[0], false, "fused/b_grad_cols");
            b_total = Some(scatter_add(b, bias, ids, &upd, 0));
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
    let named = [
        (w_total, &grads.weight),
        (b_total, &grads.bias),
        (dh_total, &grads.hidden),
    ];
    for (total, out) in named {
        if let Some(t) = total {
            b.node_to("Identity", &[&t], &[out], vec![]);
        }
    }
}

/// The tensors of a `FusedHeadLossGrad` node: the forward's lse, the upstream gradients of the
/// forward's outputs, and which gradients it writes (empty names: not wanted).
struct Grads {
    lse: String,
    lse_grad: String,
    label_grad: String,
    column_grads: Vec<String>,
    mean_grad: Option<String>,
    hidden: String,
    weight: String,
    bias: String,
}

impl Grads {
    fn of(head: &Head, node: &NodeProto) -> Grads {
        let at = 4 + head.ids.len();
        let g = &node.input[at + 1..at + 1 + head.forward_outputs()];
        Grads {
            lse: node.input[at].clone(),
            lse_grad: g[0].clone(),
            label_grad: g[1].clone(),
            column_grads: g[2..2 + head.ids.len()].to_vec(),
            mean_grad: head.mean_logit.then(|| g[g.len() - 1].clone()),
            hidden: node.output[0].clone(),
            weight: node.output[1].clone(),
            bias: node.output[2].clone(),
        }
    }

    fn want_hidden(&self) -> bool {
        !self.hidden.is_empty()
    }
}

/// The Scan state that accumulates the weight's and bias's gradients (where wanted).
struct Accumulators {
    weight: Option<String>,
    bias: Option<String>,
}

impl Accumulators {
    fn fresh(b: &mut Builder, grads: &Grads) -> Accumulators {
        Accumulators {
            weight: (!grads.weight.is_empty()).then(|| b.fresh("fused/acc_w")),
            bias: (!grads.bias.is_empty()).then(|| b.fresh("fused/acc_b")),
        }
    }

    /// As typed body inputs.
    fn typed(&self) -> Vec<Typed> {
        let w = self
            .weight
            .iter()
            .map(|a| (a.clone(), FLOAT, vec![None, None]));
        let b = self.bias.iter().map(|a| (a.clone(), FLOAT, vec![None]));
        w.chain(b).collect()
    }
}

/// Zeros of the weight's and bias's shapes, the accumulators' initial state. The scalar 0 is
/// read at run time, `Less(s, s)` of the hidden states' sum cast to float (false even for NaN
/// or an empty sum), as `grad::Ctx::zeros` reads its from the loss: from a constant, onnxruntime
/// folds the `Expand` over the weight's static shape into a `[V, d]` initializer that the
/// session keeps for its life (536 MiB measured at the Qwen2 shape, V = 151936, d = 896).
fn accumulator_zeros(b: &mut Builder, head: &Head, grads: &Grads) -> Vec<String> {
    let mut zeros = Vec::new();
    if grads.weight.is_empty() && grads.bias.is_empty() {
        return zeros;
    }
    let sum = b.reduce_sum(&head.hidden, &[], false, "fused/hidden_sum");
    let never = b.binary("Less", &sum, &sum, "fused/never");
    let zero = b.cast(&never, FLOAT, "fused/zero");
    for (want, t) in [(&grads.weight, &head.weight), (&grads.bias, &head.bias)] {
        if !want.is_empty() {
            let s = b.node("Shape", &[t], "fused/acc_shape", vec![]);
            zeros.push(b.node("Expand", &[&zero, &s], "fused/acc_zeros", vec![]));
        }
    }
    zeros
}

/// The body's scan-input slices typed: the hidden chunk `[C, d]`, the labels `[C]` (int64),
/// then `[C]` gradients, and `[C, k]` for each count in `columns` (their position from 5 on).
fn typed_slices(slices: &[String], columns: &[i64]) -> Vec<Typed> {
    slices
        .iter()
        .enumerate()
        .map(|(k, s)| {
            let (elem, dims) = match k {
                0 => (FLOAT, vec![None, None]),
                1 => (INT64, vec![None]),
                _ => match k.checked_sub(5).and_then(|j| columns.get(j)) {
                    Some(&c) => (FLOAT, vec![None, Some(c)]),
                    None => (FLOAT, vec![None]),
                },
            };
            (s.clone(), elem, dims)
        })
        .collect()
}

/// `dz = p·g_lse (+ g_mean/V) + onehot(label)·g_label`, the gradient of a chunk's logits from
/// its softmax `p` and the upstream gradients of its positions.
fn dense_dz(
    b: &mut Builder,
    head: &Head,
    p: &str,
    g_lse: &str,
    g_label: &str,
    g_mean: Option<&str>,
    label_col: &str,
) -> String {
    let g_lse = b.unsqueeze(g_lse, &[1], "fused/g_lse_col");
    let mut dz = b.binary("Mul", p, &g_lse, "fused/dz");
    if let Some(g_mean) = g_mean {
        let width = b.scalar_f32("fused/width", head.width as f32);
        let per_class = b.binary("Div", g_mean, &width, "fused/g_mean_per_class");
        let col = b.unsqueeze(&per_class, &[1], "fused/g_mean_col");
        dz = b.binary("Add", &dz, &col, "fused/dz");
    }
    let g_label = b.unsqueeze(g_label, &[1], "fused/g_label_col");
    scatter_add(b, &dz, label_col, &g_label, 1)
}

/// The weight's and bias's next accumulators from a chunk's `dz` (typed body outputs: `dW +=
/// hᵀ·dz`, or `dzᵀ·h` for a weight stored `[V, d]`, in one `Gemm` with the accumulator as `C`;
/// `db += Σ dz`), and the chunk's hidden-state gradient `dz·Wᵀ` where wanted. Under
/// `--precision` both products run in the half type (torch autocast's backward of a half
/// linear layer) and are widened: the weight's into the float32 accumulator.
fn accumulate(
    b: &mut Builder,
    head: &Head,
    proj: &Projection,
    h: &str,
    dz: &str,
    acc: &Accumulators,
    want_hidden: bool,
) -> (Vec<Typed>, Option<String>) {
    let mut outs = Vec::new();
    let (h, dz_proj) = (proj.narrow(b, h), proj.narrow(b, dz));
    if let Some(acc) = &acc.weight {
        let (a, bb) = if head.trans_weight {
            (&dz_proj, &h)
        } else {
            (&h, &dz_proj)
        };
        let next = if proj.half.is_some() {
            let dw = proj.product(b, a, bb, true, false, "fused/dw_c");
            let dw = proj.widen(b, &dw);
            b.binary("Add", acc, &dw, "fused/acc_w_next")
        } else {
            b.node(
                "Gemm",
                &[a, bb, acc],
                "fused/acc_w_next",
                vec![int_attr("transA", 1)],
            )
        };
        outs.push((next, FLOAT, vec![None, None]));
    }
    if let Some(acc) = &acc.bias {
        let col_sum = b.reduce_sum(dz, &[0], false, "fused/db_c");
        let next = b.binary("Add", acc, &col_sum, "fused/acc_b_next");
        outs.push((next, FLOAT, vec![None]));
    }
    let dh = want_hidden.then(|| {
        let trans_b = !head.trans_weight;
        let dh = proj.product(b, &dz_proj, &proj.weight, false, trans_b, "fused/dh_c");
        proj.widen(b, &dh)
    });
    (outs, dh)
}

/// What the bodies multiply with: the head's weight and bias as they are, or under
/// `--precision` their half copies, made once per step before the `Scan` (autocast's cast
/// cache) and read by the bodies from the outer graph.
struct Projection {
    weight: String,
    bias: String,
    half: Option<i32>,
}

impl Projection {
    fn of(b: &mut Builder, head: &Head, half: Option<i32>) -> Projection {
        let Some(t) = half else {
            return Projection {
                weight: head.weight.clone(),
                bias: head.bias.clone(),
                half,
            };
        };
        let bias = if head.bias.is_empty() {
            String::new()
        } else {
            b.cast(&head.bias, t, "fused/b_half")
        };
        Projection {
            weight: b.cast(&head.weight, t, "fused/w_half"),
            bias,
            half,
        }
    }

    /// `x` in the projection's type.
    fn narrow(&self, b: &mut Builder, x: &str) -> String {
        match self.half {
            Some(t) => b.cast(x, t, "fused/half"),
            None => x.to_string(),
        }
    }

    /// `a·b` (either transposed): a `Gemm` in float32; in the half type `Transpose` + `MatMul`
    /// (tract 0.23 types a float16 `Gemm`'s expansion float32).
    fn product(
        &self,
        b: &mut Builder,
        a: &str,
        bb: &str,
        trans_a: bool,
        trans_b: bool,
        hint: &str,
    ) -> String {
        if self.half.is_none() {
            let mut attrs = vec![int_attr("transB", trans_b as i64)];
            if trans_a {
                attrs.insert(0, int_attr("transA", 1));
            }
            return b.node("Gemm", &[a, bb], hint, attrs);
        }
        let a = if trans_a {
            b.transpose(a, &[1, 0], "fused/t")
        } else {
            a.to_string()
        };
        let bb = if trans_b {
            b.transpose(bb, &[1, 0], "fused/t")
        } else {
            bb.to_string()
        };
        b.node("MatMul", &[&a, &bb], hint, vec![])
    }

    /// A product back in float32.
    fn widen(&self, b: &mut Builder, x: &str) -> String {
        match self.half {
            Some(_) => b.cast(x, FLOAT, "fused/wide"),
            None => x.to_string(),
        }
    }
}

/// The `Scan` node: `state` initial values, then the scan inputs.
/// `Scan(state…, inputs…) -> outputs` over `body` (also the blockwise attention's, `passes/attention`).
pub(crate) fn scan(
    b: &mut Builder,
    state: &[String],
    inputs: &[String],
    outputs: &[&str],
    body: GraphProto,
) {
    let all: Vec<&str> = state.iter().chain(inputs).map(String::as_str).collect();
    b.node_to(
        "Scan",
        &all,
        outputs,
        vec![
            graph_attr("body", body),
            int_attr("num_scan_inputs", inputs.len() as i64),
        ],
    );
}

/// Indices for adding `upd` (`[d, K]` along axis 1, or `[K, d]` along axis 0) into a weight at
/// the columns (rows) `ids`.
fn ids_along(b: &mut Builder, ids: &str, upd: &str, axis: i64) -> String {
    let laid = b.unsqueeze(ids, &[1 - axis], "fused/ids_laid");
    let shape = b.node("Shape", &[upd], "fused/upd_shape", vec![]);
    b.node("Expand", &[&laid, &shape], "fused/ids_at", vec![])
}

/// `d += u` at `indices` along `axis` (indices distinct along it): ScatterElements with reduction
/// from opset 16, else gather, add and scatter.
fn scatter_add(b: &mut Builder, d: &str, indices: &str, u: &str, axis: i64) -> String {
    if b.opset() >= 16 {
        return b.node(
            "ScatterElements",
            &[d, indices, u],
            "fused/added",
            vec![int_attr("axis", axis), string_attr("reduction", "add")],
        );
    }
    let old = b.node(
        "GatherElements",
        &[d, indices],
        "fused/old",
        vec![int_attr("axis", axis)],
    );
    let sum = b.binary("Add", &old, u, "fused/new");
    b.node(
        "ScatterElements",
        &[d, indices, &sum],
        "fused/added",
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

/// A Scan body of the nodes `b` holds (the caller set the outer graph's nodes aside), with
/// typed inputs and outputs.
pub(crate) fn body(b: &mut Builder, inputs: &[Typed], outputs: &[Typed], name: &str) -> GraphProto {
    let value = |(n, t, d): &Typed| super::node::tensor_info(n, *t, d);
    GraphProto {
        name: Some(name.into()),
        node: std::mem::take(&mut b.nodes),
        input: inputs.iter().map(value).collect(),
        output: outputs.iter().map(value).collect(),
        ..Default::default()
    }
}

/// A body input or output: name, element type, dims (None: not known statically).
pub(crate) type Typed = (String, i32, Vec<Option<i64>>);

/// A chunk's logits, its labels and the logit map's `tanh`.
struct ChunkLogits {
    /// `[C, V]` float32, through the graph's logit map.
    z: String,
    /// The labels with the ignore index as 0.
    y: String,
    tanh: Option<String>,
}

/// The chunk's logits `z = h·W (+ b)` `[C, V]` (float32; the product in the half type under
/// `--precision`) through the logit map, and its labels with the ignore index as 0.
fn chunk_logits(b: &mut Builder, head: &Head, proj: &Projection, h: &str, y: &str) -> ChunkLogits {
    let z = if proj.half.is_none() {
        let mut inputs = vec![h, head.weight.as_str()];
        if !head.bias.is_empty() {
            inputs.push(&head.bias);
        }
        let trans = vec![int_attr("transB", head.trans_weight as i64)];
        b.node("Gemm", &inputs, "fused/z", trans)
    } else {
        let h = proj.narrow(b, h);
        let z = proj.product(b, &h, &proj.weight, false, head.trans_weight, "fused/z");
        let z = match proj.bias.as_str() {
            "" => z,
            bias => b.binary("Add", &z, bias, "fused/z_biased"),
        };
        proj.widen(b, &z)
    };
    let y = match head.ignore_index {
        Some(i) => {
            let ignore = b.const_i64("fused/ignore", &[], &[i]);
            let zero = b.const_i64("fused/label_zero", &[], &[0]);
            let ignored = b.equal(y, &ignore, "fused/is_ignored");
            b.where_(&ignored, &zero, y, "fused/safe_label")
        }
        None => y.to_string(),
    };
    let (z, tanh) = head.logit_map.apply(b, &z);
    ChunkLogits { z, y, tanh }
}

/// What a chunk's forward computes inside a body.
struct ChunkForward {
    /// `exp(z − max)` and its row sums: the softmax without another pass over the logits.
    exp: String,
    exp_sum: String,
    /// The labels as `[C, 1]` indices (the ignore index as 0).
    label_col: String,
    /// The logit map's `tanh` of the chunk.
    tanh: Option<String>,
    /// The forward's outputs: lse, the label's logit, the column sets, the row mean.
    outs: Vec<Typed>,
}

/// A chunk's logits, their log-sum-exp (max-shifted; the row maximum by TopK: onnxruntime-rocm
/// 1.22 has no ReduceMax for opset 20), the label's logit, the column sets and the row mean.
fn chunk_forward(
    b: &mut Builder,
    head: &Head,
    proj: &Projection,
    h: &str,
    y: &str,
) -> ChunkForward {
    let ChunkLogits { z, y: y_safe, tanh } = chunk_logits(b, head, proj, h, y);
    let (max, _) = b.top1(&z, "fused/row_max");
    let shifted = b.binary("Sub", &z, &max, "fused/shifted");
    let exp = b.unary("Exp", &shifted, "fused/exp");
    let exp_sum = b.reduce_sum(&exp, &[1], true, "fused/exp_sum");
    let log = b.unary("Log", &exp_sum, "fused/log_sum");
    let lse = b.binary("Add", &log, &max, "fused/lse_col");
    let lse = b.squeeze(&lse, &[1], "fused/lse_c");
    let label_col = b.unsqueeze(&y_safe, &[1], "fused/label_col");
    let picked = b.node(
        "GatherElements",
        &[&z, &label_col],
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
        outs.push((mean, FLOAT, row));
    }
    ChunkForward {
        exp,
        exp_sum,
        label_col,
        tanh,
        outs,
    }
}

/// `FusedHeadLoss` alone → chunking + `Scan` computing lse, the label logit, the column sets
/// and the row mean per chunk.
fn forward(b: &mut Builder, node: &NodeProto, half: Option<i32>) {
    let head = Head::of(node);
    let proj = Projection::of(b, &head, half);
    let ch = chunks(b, &head.hidden, head.chunk_tokens);
    let scan_in = [
        to_chunks(b, &head.hidden, FLOAT, &ch),
        to_chunks(b, &head.labels, INT64, &ch),
    ];
    let outer = std::mem::take(&mut b.nodes);
    let (h, y) = (b.fresh("fused/h_c"), b.fresh("fused/y_c"));
    let f = chunk_forward(b, &head, &proj, &h, &y);
    let ins = typed_slices(&[h, y], &[]);
    let g = body(b, &ins, &f.outs, "fused_head_forward");
    b.nodes = outer;
    let stacked: Vec<String> = f.outs.iter().map(|_| b.fresh("fused/stacked")).collect();
    let refs: Vec<&str> = stacked.iter().map(String::as_str).collect();
    scan(b, &[], &scan_in, &refs, g);
    for (s, out) in stacked.iter().zip(&node.output) {
        from_chunks(b, s, &ch, out);
    }
}

/// `FusedHeadLossGrad` after a separate forward → chunking + `Scan` recomputing each chunk's
/// logits: `dz = p·g_lse + g_mean/V + scatter(g_label, label) + scatter(g_cols, ids)`, `dh =
/// dz·Wᵀ`, and `W`'s and `b`'s gradients summed in the Scan's state.
fn backward(b: &mut Builder, node: &NodeProto, half: Option<i32>) {
    let head = Head::of(node);
    let proj = Projection::of(b, &head, half);
    let grads = Grads::of(&head, node);
    let ch = chunks(b, &head.hidden, head.chunk_tokens);
    let upstream = [&grads.lse_grad, &grads.label_grad]
        .into_iter()
        .chain(&grads.column_grads)
        .chain(&grads.mean_grad);
    let mut scan_in = vec![
        to_chunks(b, &head.hidden, FLOAT, &ch),
        to_chunks(b, &head.labels, INT64, &ch),
        to_chunks(b, &grads.lse, FLOAT, &ch),
    ];
    for t in upstream.collect::<Vec<_>>() {
        scan_in.push(to_chunks(b, t, FLOAT, &ch));
    }
    let state_in = accumulator_zeros(b, &head, &grads);
    let outer = std::mem::take(&mut b.nodes);

    // the body: state (dW, db), then one slice of every scan input: h, labels, lse, g_lse,
    // g_label, the columns' gradients, g_mean
    let acc = Accumulators::fresh(b, &grads);
    let slices: Vec<String> = scan_in.iter().map(|_| b.fresh("fused/slice")).collect();
    let (h, y, lse_c) = (&slices[0], &slices[1], &slices[2]);
    let ChunkLogits { z, y: y_safe, tanh } = chunk_logits(b, &head, &proj, h, y);
    let lse_col = b.unsqueeze(lse_c, &[1], "fused/lse_col");
    let shifted = b.binary("Sub", &z, &lse_col, "fused/log_p");
    let p = b.unary("Exp", &shifted, "fused/p");
    let label_col = b.unsqueeze(&y_safe, &[1], "fused/label_col");
    let g_mean = head.mean_logit.then(|| slices[slices.len() - 1].as_str());
    let mut dz = dense_dz(b, &head, &p, &slices[3], &slices[4], g_mean, &label_col);
    for (j, ids) in head.ids.iter().enumerate() {
        let g_cols = &slices[5 + j];
        let idx = ids_along(b, ids, g_cols, 1);
        dz = scatter_add(b, &dz, &idx, g_cols, 1);
    }
    let dz = head.logit_map.slope(b, &dz, tanh.as_deref());
    let (mut outs, dh) = accumulate(b, &head, &proj, h, &dz, &acc, grads.want_hidden());
    outs.extend(dh.iter().map(|d| (d.clone(), FLOAT, vec![None, None])));
    let mut ins = acc.typed();
    // lse sits at position 2 of the slices: the columns' gradients start at 5
    ins.extend(typed_slices(&slices, &head.id_counts));
    let g = body(b, &ins, &outs, "fused_head_backward");

    b.nodes = outer;
    let dh_stacked = dh.as_ref().map(|_| b.fresh("fused/dh_stacked"));
    let outputs: Vec<&str> = [&grads.weight, &grads.bias]
        .into_iter()
        .filter(|o| !o.is_empty())
        .chain(&dh_stacked)
        .map(String::as_str)
        .collect();
    scan(b, &state_in, &scan_in, &outputs, g);
    if let Some(stacked) = dh_stacked {
        from_chunks(b, &stacked, &ch, &grads.hidden);
    }
}

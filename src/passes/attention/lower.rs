//! The attention's two internal nodes expanded into standard ONNX: a `Scan` over blocks of `C`
//! query rows (`C = min(block, Tq)`, `S = ⌈Tq / C⌉` blocks, both read at run time). The scan
//! inputs are each block's row numbers, clamped to the last row (`[S, C]`, one per tensor with
//! rows: the query, masks and scale with rows of their own); the body gathers those rows from the
//! outer graph, so the last block may run past `Tq`: its extra rows repeat the last and are
//! dropped (forward), or read a row of zeros as their gradient (backward). Per block only
//! `[.., C, Tk]` scores exist.
//!
//! Forward: `p = softmax(s)`, `o = p·v`. Backward: the same `p` again, `dv += pᵀ·do`,
//! `ds = p ∘ (dp − δ)` with `dp = do·vᵀ` and `δ = Σ p ∘ dp = do·o` (`centred`: one product),
//! through the masks' `Where`s (none for a fill of −∞), the soft-cap (`1 − t²`) and the scale,
//! `dq = ds·k`, `dkt += qᵀ·ds`. A scalar scale multiplies the query once instead of every
//! block's scores (and `dq` once after the blocks).
//!
//! Under `--precision` the products run in the half type (the scores, the softmax and the
//! accumulators stay float32), as torch's autocast runs eager attention. Where the masks leave
//! the block's last keys out (a causal mask), the block reads only the keys before them
//! (`key_range`).

use ntl_ops::names::PREFIX;
use ntl_ops::Builder;

use super::centred;
use super::key_range::{self, KeyCut, Keys};
use super::node::{additive_mask, row_highs, Attn, TermKind, DOMAIN, FORWARD};
use super::operands::{batch_shape, scale_op, swap_last_two};
use crate::graph::patch::{splice, Splice};
use crate::graph::GraphIndex;
use crate::onnx::{default_opset, int_attr, GraphProto, ModelProto, NodeProto};
use crate::onnx::{FLOAT, INT64};
use crate::passes::fused_head::lower::{body, scan, Typed};
use std::collections::BTreeMap;

/// Replaces every internal attention node of the model's graph by its `Scan`.
pub fn lower(model: &mut ModelProto, half: Option<i32>) {
    let opset = default_opset(model).unwrap_or(ntl_ops::builder::MIN_OPSET);
    let graph = model.graph.as_mut().expect("graph");
    if !graph.node.iter().any(super::node::is_attention) {
        return;
    }
    let mut b = Builder::new(
        PREFIX,
        opset,
        GraphIndex::new(graph).taken_names(PREFIX, &[]),
    );
    let widened = half.map(|_| widening_casts(graph)).unwrap_or_default();
    let undeclared: std::collections::HashSet<String> = graph
        .node
        .iter()
        .filter(|n| (n.domain(), n.op_type()) == (DOMAIN, FORWARD))
        .filter(|n| Attn::of(n).declared_here)
        .map(|n| n.output[0].clone())
        .collect();
    graph.value_info.retain(|v| !undeclared.contains(v.name()));
    let index = GraphIndex::new(graph);
    // each attention node replaced by its lowering
    let mut replace = BTreeMap::new();
    for (i, node) in graph.node.iter().enumerate() {
        if !super::node::is_attention(node) {
            continue;
        }
        let mut node = node.clone();
        // q, kt, v: the half tensors themselves, not the precision pass's float32 copies
        for x in node.input.iter_mut().take(3) {
            if let Some(src) = widened.get(x.as_str()) {
                *x = src.clone();
            }
        }
        match node.op_type() {
            FORWARD if Attn::of(&node).fused => super::fused::forward(&mut b, &node, half),
            FORWARD => forward(&mut b, &node, half),
            _ => {
                let fills = minus_inf_fills(&index, &Attn::of(&node));
                backward(&mut b, &node, half, &fills)
            }
        }
        replace.insert(i, std::mem::take(&mut b.nodes));
    }
    splice(graph, Splice::replace(replace));
    graph.initializer.append(&mut b.initializers);
    drop_unread_casts(graph, &widened);
}

/// The precision pass's float32 copies of half tensors (`Cast(x, to=FLOAT)` written as
/// `ntl/amp/f32…`): copy → x. The attention reads x itself and casts its blocks' operands.
fn widening_casts(graph: &GraphProto) -> std::collections::HashMap<String, String> {
    graph
        .node
        .iter()
        .filter(|n| n.op_type() == "Cast" && n.domain().is_empty())
        .filter(|n| crate::onnx::attr_i(n, "to") == Some(FLOAT as i64))
        .filter(|n| n.output[0].starts_with(&format!("{PREFIX}/amp/f32")))
        .map(|n| (n.output[0].clone(), n.input[0].clone()))
        .collect()
}

/// Removes those copies that nothing reads any more (the attention read them alone).
fn drop_unread_casts(graph: &mut GraphProto, widened: &std::collections::HashMap<String, String>) {
    if widened.is_empty() {
        return;
    }
    let mut read: std::collections::HashSet<&str> = graph
        .node
        .iter()
        .flat_map(|n| n.input.iter().map(String::as_str))
        .collect();
    read.extend(graph.output.iter().map(|o| o.name()));
    let outer: Vec<String> = graph
        .node
        .iter()
        .flat_map(|n| {
            crate::graph::reads::outer_reads(n)
                .into_iter()
                .map(str::to_string)
        })
        .collect();
    read.extend(outer.iter().map(String::as_str));
    let unread: std::collections::HashSet<String> = widened
        .keys()
        .filter(|c| !read.contains(c.as_str()))
        .cloned()
        .collect();
    let gone = Splice::remove(graph, |n| {
        n.output.len() == 1 && unread.contains(&n.output[0])
    });
    splice(graph, gone);
    graph.value_info.retain(|v| !unread.contains(v.name()));
}

/// What the outer graph prepares for a `Scan` over blocks of query rows.
struct Blocks {
    /// `[1]`: Tq.
    rows: String,
    /// `[S, C]`: the row numbers of each block, 0..S·C.
    ids: String,
    /// `[1]`: Tq − 1.
    last: String,
}

fn blocks(b: &mut Builder, a: &Attn) -> Blocks {
    let shape = b.node("Shape", &[&a.q], "attention/q_shape", vec![]);
    let r = a.q_rank as i64;
    let rows = b.slice(&shape, r - 2, r - 1, 0, "attention/rows");
    let one = b.const_i64("attention/one", &[1], &[1]);
    let most = b.const_i64("attention/block", &[1], &[a.block]);
    let c = b.binary("Min", &most, &rows, "attention/block_cap");
    let c = b.binary("Max", &c, &one, "attention/block_rows");
    let c1 = b.binary("Sub", &c, &one, "attention/block_rows_1");
    let up = b.binary("Add", &rows, &c1, "attention/rows_up");
    let s = b.binary("Div", &up, &c, "attention/blocks");
    let total = b.binary("Mul", &s, &c, "attention/padded_rows");
    let zero = b.const_i64("attention/zero", &[], &[0]);
    let step1 = b.const_i64("attention/step", &[], &[1]);
    let total = b.squeeze(&total, &[0], "attention/padded_rows_s");
    let ids = b.node(
        "Range",
        &[&zero, &total, &step1],
        "attention/row_ids",
        vec![],
    );
    let shape = b.concat(&[&s, &c], 0, "attention/blocks_shape");
    let ids = b.node("Reshape", &[&ids, &shape], "attention/block_ids", vec![]);
    let last = b.binary("Sub", &rows, &one, "attention/last_row");
    Blocks { rows, ids, last }
}

/// The scan's inputs: per clamp (a tensor's last row), the `[S, C]` row numbers clamped to it,
/// and the name each block reads them by. The bodies then do no index arithmetic: a runtime
/// places nothing of them on the host, so no block waits for a copy. They travel as float32
/// (exact below 2^24 rows) and each body casts them back: tract types integers computed from
/// shapes as dims, which a scan input cannot be.
#[derive(Default)]
struct RowInputs {
    /// (outer `[S, C]` float tensor, body input, the body's int64 cast of it), in the order
    /// they were asked for.
    inputs: Vec<(String, String, String)>,
    /// clamp (outer `[1]` tensor) → the body's int64 rows.
    by_clamp: Vec<(String, String)>,
}

impl RowInputs {
    /// The body's `[C]` row numbers of this block, clamped to `last`.
    fn clamped(&mut self, b: &mut Builder, bl: &Blocks, last: &str) -> String {
        if let Some((_, rows)) = self.by_clamp.iter().find(|(l, _)| l == last) {
            return rows.clone();
        }
        let outer = b.binary("Min", &bl.ids, last, "attention/block_rows_clamped");
        let outer = b.cast(&outer, FLOAT, "attention/block_rows_in");
        let body = b.fresh("attention/rows_in_f");
        let rows = b.fresh("attention/rows_in");
        self.inputs.push((outer, body, rows.clone()));
        self.by_clamp.push((last.to_string(), rows.clone()));
        rows
    }

    /// The body's first nodes: each input cast back to int64.
    fn cast_in_body(&self, b: &mut Builder) {
        for (_, body, rows) in &self.inputs {
            b.node_to("Cast", &[body], &[rows], vec![int_attr("to", INT64 as i64)]);
        }
    }

    fn outer(&self) -> Vec<String> {
        self.inputs.iter().map(|(o, _, _)| o.clone()).collect()
    }

    fn body(&self) -> Vec<Typed> {
        self.inputs.iter().map(|(_, n, _)| typed(n, 1)).collect()
    }
}

/// The outer tensors the bodies read: the products' operands in the compute type (the query
/// already scaled by a scalar scale), and per tensor with rows its last row index.
struct Outer {
    q: String,
    kt: String,
    v: String,
    /// The scale multiplies the query (a scalar), not each block's scores.
    scale_folded: bool,
    /// `[1]` per row-carrying tensor (name, last row), for clamping.
    last_rows: Vec<(String, String)>,
    /// The key positions, where a mask may leave keys out of a block.
    keys: Option<Keys>,
}

/// `cut_keys`: each block reads only the keys its masks leave it (`key_range`).
fn outer(b: &mut Builder, a: &Attn, half: Option<i32>, cut_keys: bool) -> Outer {
    let typed = |b: &mut Builder, x: &str| match half {
        Some(h) => b.cast(x, h, "attention/half"),
        None => x.to_string(),
    };
    let mut last_rows: Vec<(String, String)> = Vec::new();
    let mut row_tensor = |b: &mut Builder, x: &str, rank: usize| {
        if rank >= 2 && !last_rows.iter().any(|(t, _)| t == x) {
            let shape = b.node("Shape", &[x], "attention/mask_shape", vec![]);
            let r = rank as i64;
            let n = b.slice(&shape, r - 2, r - 1, 0, "attention/mask_rows");
            let one = b.const_i64("attention/one", &[1], &[1]);
            let last = b.binary("Sub", &n, &one, "attention/mask_last");
            last_rows.push((x.to_string(), last));
        }
    };
    if !a.scale.is_empty() {
        row_tensor(b, &a.scale, a.scale_rank);
    }
    for t in &a.terms {
        for (x, &r) in t.inputs.iter().zip(&t.ranks) {
            row_tensor(b, x, r);
        }
    }
    let scale_folded = !a.scale.is_empty() && a.scale_rank == 0;
    let q = if scale_folded {
        // in float32 (a half query arrives as it is): the scale itself is not rounded
        let q = match half {
            Some(_) => b.cast(&a.q, FLOAT, "attention/q_f"),
            None => a.q.clone(),
        };
        b.binary(scale_op(a), &q, &a.scale, "attention/q_scaled")
    } else {
        a.q.clone()
    };
    let keys = if cut_keys {
        key_range::keys(b, a)
    } else {
        None
    };
    Outer {
        q: typed(b, &q),
        kt: typed(b, &a.kt),
        v: typed(b, &a.v),
        scale_folded,
        last_rows,
        keys,
    }
}

/// `x`'s rows of the block (along axis rank − 2), or `x` itself where it has no rows.
fn rows_of(b: &mut Builder, rows: &BodyRows, x: &str, rank: usize) -> String {
    match rows.masks.iter().find(|(t, _)| t == x) {
        Some((_, at)) => b.gather(x, at, rank as i64 - 2, "attention/mask_block"),
        None => x.to_string(),
    }
}

/// The row numbers a body reads: the query's, and each row-carrying mask's.
struct BodyRows {
    q: String,
    masks: Vec<(String, String)>,
}

/// Asks `inputs` for the query's rows and each mask's (in the outer graph, before the body).
fn body_rows(b: &mut Builder, bl: &Blocks, o: &Outer, inputs: &mut RowInputs) -> BodyRows {
    let q = inputs.clamped(b, bl, &bl.last);
    let masks = o
        .last_rows
        .iter()
        .map(|(x, last)| (x.clone(), inputs.clamped(b, bl, last)))
        .collect();
    BodyRows { q, masks }
}

/// A block's scale (where it is not folded into the query) and masks: their rows gathered and,
/// where the masks leave keys out, cut to the block's `end` keys.
struct BlockTerms {
    scale: Option<String>,
    /// Per term of `a.terms`, its inputs.
    terms: Vec<Vec<String>>,
    /// The keys the block reads (None: all).
    cut: Option<KeyCut>,
    /// `[.., C, 1]` bool, the rows the masks fill with −∞ at every key, where such a row is
    /// zeros: in an export that zeroes the softmax's NaN rows, and under the fused forward
    /// (which zeroes them after the operator, where the export's softmax gives NaN). The
    /// masks leave the row's scores as they are (its softmax is finite), and its output (the
    /// forward) or its output's gradient (the backward) is 0, so it adds nothing to any
    /// gradient: the same values as zeroing its probabilities, at the price of passes over the
    /// masks and the block's `[.., C, d]` rows rather than over its probabilities.
    minus_inf_rows: Option<String>,
}

impl BlockTerms {
    fn of(b: &mut Builder, a: &Attn, o: &Outer, rows: &BodyRows) -> BlockTerms {
        let terms: Vec<Vec<String>> = a
            .terms
            .iter()
            .map(|t| {
                let inputs = t.inputs.iter().zip(&t.ranks);
                inputs.map(|(x, &r)| rows_of(b, rows, x, r)).collect()
            })
            .collect();
        let scale = (!a.scale.is_empty() && !o.scale_folded)
            .then(|| rows_of(b, rows, &a.scale, a.scale_rank));
        let Some(keys) = &o.keys else {
            // an export that zeroes the rows of NaN: the same rows found from the masks
            let by_rows = a.nan_to_zero && has_key_axis(a);
            let inf = by_rows.then(|| {
                let mask = additive_mask(b, a, &terms).expect("masks with a key axis");
                row_highs(b, &mask).minus_inf
            });
            let terms = match &inf {
                Some(inf) => unmask_rows(b, a, terms, inf),
                None => terms,
            };
            return BlockTerms {
                scale,
                terms,
                cut: None,
                minus_inf_rows: inf,
            };
        };
        let key_cut = key_range::block_end(b, a, &terms, keys);
        let inf = row_highs(b, &key_cut.mask).minus_inf;
        let cut = |b: &mut Builder, x: String, rank: usize| match rank {
            0 => x,
            _ => key_range::first(b, &x, &key_cut.end, -1),
        };
        let scale = scale.map(|s| cut(b, s, a.scale_rank));
        let terms = a
            .terms
            .iter()
            .zip(terms)
            .map(|(t, xs)| {
                let xs = xs.into_iter().zip(&t.ranks);
                xs.map(|(x, &r)| cut(b, x, r)).collect()
            })
            .collect();
        let terms = unmask_rows(b, a, terms, &inf);
        BlockTerms {
            scale,
            terms,
            cut: Some(key_cut),
            minus_inf_rows: Some(inf),
        }
    }

    /// `x`'s keys the block reads, along `axis`.
    fn keys(&self, b: &mut Builder, x: &str, axis: usize) -> String {
        match &self.cut {
            Some(cut) => key_range::first(b, x, &cut.end, axis as i64),
            None => x.to_string(),
        }
    }

    /// A gradient over the keys the block read, padded with zeros to all keys along `axis`.
    fn padded(&self, b: &mut Builder, g: String, rank: usize, axis: usize) -> String {
        match &self.cut {
            Some(cut) => key_range::padded(b, &g, rank, axis, cut),
            None => g,
        }
    }
}

/// Whether a mask has a key axis (only such a mask can mask a row at every key).
fn has_key_axis(a: &Attn) -> bool {
    a.terms.iter().any(|t| t.ranks.iter().any(|&r| r >= 1))
}

/// The terms with the rows of `inf` left unmasked (their first inputs: a bias 0 there, a
/// `Where`'s condition choosing the scores).
fn unmask_rows(
    b: &mut Builder,
    a: &Attn,
    mut terms: Vec<Vec<String>>,
    inf: &str,
) -> Vec<Vec<String>> {
    for (t, xs) in a.terms.iter().zip(terms.iter_mut()) {
        xs[0] = unmasked_rows(b, t.kind, &xs[0], inf);
    }
    terms
}

/// A term's first input with the rows of `inf` left unmasked.
fn unmasked_rows(b: &mut Builder, kind: TermKind, x: &str, inf: &str) -> String {
    match kind {
        TermKind::Add | TermKind::Sub => {
            let zero = b.scalar_f32("attention/row_unmasked", 0.0);
            b.where_(inf, &zero, x, "attention/bias_seen")
        }
        TermKind::Keep => b.binary("Or", x, inf, "attention/kept_seen"),
        TermKind::Fill => {
            let seen = b.unary("Not", inf, "attention/row_seen");
            b.binary("And", x, &seen, "attention/filled_seen")
        }
    }
}

/// The block's probabilities (float32) from its query rows `q_b` and keys `kt_b`: the scores
/// `q_b·kt_b`, scaled, soft-capped and masked as the export did, through the softmax. Also the
/// soft-cap's `tanh`, where there is one.
fn probabilities(
    b: &mut Builder,
    a: &Attn,
    bt: &BlockTerms,
    q_b: &str,
    kt_b: &str,
    half: bool,
) -> (String, Option<String>) {
    let mut s = b.binary("MatMul", q_b, kt_b, "attention/scores");
    if half {
        s = b.cast(&s, FLOAT, "attention/scores_f");
    }
    if let Some(sc) = &bt.scale {
        s = b.binary(scale_op(a), &s, sc, "attention/scaled");
    }
    let (mut s, tanh) = a.score_map.apply(b, &s);
    for (t, x) in a.terms.iter().zip(&bt.terms) {
        s = match t.kind {
            TermKind::Add => b.binary("Add", &s, &x[0], "attention/masked"),
            TermKind::Sub => b.binary("Sub", &s, &x[0], "attention/masked"),
            TermKind::Keep => b.where_(&x[0], &s, &x[1], "attention/masked"),
            TermKind::Fill => b.where_(&x[0], &x[1], &s, "attention/masked"),
        };
    }
    let p = b.softmax(&s, -1, "attention/probs");
    // rows of −∞ found from the masks are unmasked: their output is zeroed instead
    if !a.nan_to_zero || bt.minus_inf_rows.is_some() {
        return (p, tanh);
    }
    let nan = b.unary("IsNaN", &p, "attention/probs_nan");
    let zero = b.scalar_f32("attention/probs_zero", 0.0);
    (b.where_(&nan, &zero, &p, "attention/probs_kept"), tanh)
}

/// `x` (`[.., C, n]` per block, stacked as `[S, .., C, n]`) back to `[.., Tq, n]` in `out`.
fn unblock(b: &mut Builder, stacked: &str, rank: usize, rows: &str, out: &str) {
    let r = rank as i64;
    // [S, b.., C, n] → [b.., S, C, n]
    let mut perm: Vec<i64> = (1..=r - 2).collect();
    perm.extend([0, r - 1, r]);
    let moved = b.transpose(stacked, &perm, "attention/unblocked");
    let shape = b.node("Shape", &[&moved], "attention/unblocked_shape", vec![]);
    let batch = b.slice(&shape, 0, r - 2, 0, "attention/batch_dims");
    let tail = b.slice(&shape, r, r + 1, 0, "attention/tail_dim");
    let minus_one = b.const_i64("attention/merged", &[1], &[-1]);
    let target = b.concat(&[&batch, &minus_one, &tail], 0, "attention/merged_shape");
    let merged = b.node(
        "Reshape",
        &[&moved, &target],
        "attention/merged_rows",
        vec![],
    );
    let zero = b.const_i64("attention/row_zero", &[1], &[0]);
    let axis = b.const_i64("attention/row_axis", &[1], &[r - 2]);
    b.node_to("Slice", &[&merged, &zero, rows, &axis], &[out], vec![]);
}

/// A float32 body input or output of rank `rank`, its dims not known statically.
fn typed(name: &str, rank: usize) -> Typed {
    (name.to_string(), FLOAT, vec![None; rank])
}

fn forward(b: &mut Builder, node: &NodeProto, half: Option<i32>) {
    let a = Attn::of(node);
    let bl = blocks(b, &a);
    // every key: tract must type the blockwise forward
    let o = outer(b, &a, half, false);
    let mut inputs = RowInputs::default();
    let rows = body_rows(b, &bl, &o, &mut inputs);
    let outer_nodes = std::mem::take(&mut b.nodes);

    inputs.cast_in_body(b);
    let q_b = b.gather(&o.q, &rows.q, a.q_rank as i64 - 2, "attention/q_block");
    let bt = BlockTerms::of(b, &a, &o, &rows);
    let (p, _) = probabilities(b, &a, &bt, &q_b, &o.kt, half.is_some());
    let p = match half {
        Some(h) => b.cast(&p, h, "attention/probs_h"),
        None => p,
    };
    let mut o_b = b.binary("MatMul", &p, &o.v, "attention/out_block");
    if half.is_some() {
        o_b = b.cast(&o_b, FLOAT, "attention/out_block_f");
    }
    if let Some(inf) = &bt.minus_inf_rows {
        let zero = b.scalar_f32("attention/zero_row", 0.0);
        o_b = b.where_(inf, &zero, &o_b, "attention/out_seen");
    }
    let r = a.rank;
    let g = body(b, &inputs.body(), &[typed(&o_b, r)], "attention_forward");
    b.nodes = outer_nodes;
    let o_stack = b.fresh("attention/out_blocks");
    scan(b, &[], &inputs.outer(), &[&o_stack], g);
    unblock(b, &o_stack, r, &bl.rows, &node.output[0]);
}

/// Zeros of the batch shape followed by `x`'s last two dims.
fn accumulator(b: &mut Builder, batch: &str, x: &str, rank: usize) -> String {
    let shape = b.node("Shape", &[x], "attention/acc_of", vec![]);
    let r = rank as i64;
    let tail = b.slice(&shape, r - 2, r, 0, "attention/acc_tail");
    let target = b.concat(&[batch, &tail], 0, "attention/acc_shape");
    let zero = b.scalar_f32("attention/acc_zero", 0.0);
    b.node("Expand", &[&zero, &target], "attention/acc", vec![])
}

/// `g` (`[.., T, n]`) with a row of zeros after its last: row T reads zeros.
fn zero_row_after(b: &mut Builder, g: &str, rank: usize) -> String {
    let r = rank as i64;
    let shape = b.node("Shape", &[g], "attention/g_shape", vec![]);
    let head = b.slice(&shape, 0, r - 2, 0, "attention/g_batch");
    let tail = b.slice(&shape, r - 1, r, 0, "attention/g_width");
    let one = b.const_i64("attention/one_row", &[1], &[1]);
    let row_shape = b.concat(&[&head, &one, &tail], 0, "attention/zero_row_shape");
    let zero = b.scalar_f32("attention/zero_row_value", 0.0);
    let row = b.node("Expand", &[&zero, &row_shape], "attention/zero_row", vec![]);
    b.concat(&[g, &row], r - 2, "attention/g_padded")
}

/// Per term of `a`: a `Where` that fills the scores with the constant −∞. Its filled scores'
/// probabilities are exactly 0 (a row of −∞ at every key is unmasked, or NaN as exported), so
/// `ds = p ∘ (dp − δ)` is 0 there without the `Where`'s gradient; a finite fill (`finfo.min`)
/// spreads a row it fills at every key, whose `ds` the `Where` must zero.
fn minus_inf_fills(index: &GraphIndex, a: &Attn) -> Vec<bool> {
    a.terms
        .iter()
        .map(|t| {
            t.fill_values(index)
                .is_some_and(|v| v.iter().all(|&x| x == f64::NEG_INFINITY))
        })
        .collect()
}

/// `minus_inf`: per term, whether it fills with −∞ (`minus_inf_fills`).
fn backward(b: &mut Builder, node: &NodeProto, half: Option<i32>, minus_inf: &[bool]) {
    let a = Attn::of(node);
    let g_out = &node.input[a.forward_inputs()];
    let r = a.rank;
    let bl = blocks(b, &a);
    // tract cannot type a block's data-dependent key count; a graph with the fused forward runs
    // on onnxruntime only anyway
    let o = outer(b, &a, half, a.fused);
    let k = swap_last_two(b, &o.kt, a.kt_rank, "attention/k");
    let vt = swap_last_two(b, &o.v, a.v_rank, "attention/vt");
    let widened = centred::widen(b, &vt, a.v_rank, half);
    let batch = batch_shape(b, &a);
    let dkt0 = accumulator(b, &batch, &a.kt, a.kt_rank);
    let dv0 = accumulator(b, &batch, &a.v, a.v_rank);
    let mut inputs = RowInputs::default();
    let rows = body_rows(b, &bl, &o, &mut inputs);
    // rows past Tq carry no gradient: they read a row of zeros after the last
    let g_padded = zero_row_after(b, g_out, r);
    let g_rows = inputs.clamped(b, &bl, &bl.rows);
    let outer_nodes = std::mem::take(&mut b.nodes);
    inputs.cast_in_body(b);

    let dkt_in = b.fresh("attention/dkt_in");
    let dv_in = b.fresh("attention/dv_in");
    let q_b = b.gather(&o.q, &rows.q, a.q_rank as i64 - 2, "attention/q_block");
    let bt = BlockTerms::of(b, &a, &o, &rows);
    let kt_b = bt.keys(b, &o.kt, a.kt_rank - 1);
    let k_b = bt.keys(b, &k, a.kt_rank - 2);
    let v_b = bt.keys(b, &o.v, a.v_rank - 2);
    let vt_b = bt.keys(b, &widened.vt, a.v_rank - 1);
    let (p, tanh) = probabilities(b, &a, &bt, &q_b, &kt_b, half.is_some());
    let zero = b.scalar_f32("attention/zero_f", 0.0);
    let mut g_b = b.gather(&g_padded, &g_rows, r as i64 - 2, "attention/g_block");
    if let Some(inf) = &bt.minus_inf_rows {
        g_b = b.where_(inf, &zero, &g_b, "attention/g_seen");
    }
    let to_compute = |b: &mut Builder, x: &str| match half {
        Some(h) => b.cast(x, h, "attention/h"),
        None => x.to_string(),
    };
    let to_float = |b: &mut Builder, x: String| match half {
        Some(_) => b.cast(&x, FLOAT, "attention/f"),
        None => x,
    };
    let p_c = to_compute(b, &p);
    let g_c = to_compute(b, &g_b);
    let pt = swap_last_two(b, &p_c, r, "attention/probs_t");
    let dv_b = b.binary("MatMul", &pt, &g_c, "attention/dv_block");
    let dv_b = to_float(b, dv_b);
    let dv_b = bt.padded(b, dv_b, r, r - 2);
    let dv_out = b.binary("Add", &dv_in, &dv_b, "attention/dv_acc");
    let centred = centred::centred(b, &widened, &p_c, &v_b, &vt_b, &g_c, half);
    let mut ds = b.binary("Mul", &p, &centred, "attention/ds");
    for ((t, x), &inf) in a.terms.iter().zip(&bt.terms).zip(minus_inf).rev() {
        let cond = match t.kind {
            TermKind::Add | TermKind::Sub => continue,
            _ if inf => continue,
            _ => &x[0],
        };
        ds = match t.kind {
            TermKind::Keep => b.where_(cond, &ds, &zero, "attention/ds_kept"),
            _ => b.where_(cond, &zero, &ds, "attention/ds_kept"),
        };
    }
    ds = a.score_map.slope(b, &ds, tanh.as_deref());
    if let Some(sc) = &bt.scale {
        ds = b.binary(scale_op(&a), &ds, sc, "attention/ds_scaled");
    }
    let ds_c = to_compute(b, &ds);
    let dq_b = b.binary("MatMul", &ds_c, &k_b, "attention/dq_block");
    let dq_b = to_float(b, dq_b);
    let qt = swap_last_two(b, &q_b, a.q_rank, "attention/q_t");
    let dkt_b = b.binary("MatMul", &qt, &ds_c, "attention/dkt_block");
    let dkt_b = to_float(b, dkt_b);
    let dkt_b = bt.padded(b, dkt_b, r, r - 1);
    let dkt_out = b.binary("Add", &dkt_in, &dkt_b, "attention/dkt_acc");
    let mut body_inputs = vec![typed(&dkt_in, r), typed(&dv_in, r)];
    body_inputs.extend(inputs.body());
    let body_outputs = [typed(&dkt_out, r), typed(&dv_out, r), typed(&dq_b, r)];
    let g = body(b, &body_inputs, &body_outputs, "attention_backward");
    b.nodes = outer_nodes;
    let dq_stack = b.fresh("attention/dq_blocks");
    let (g_q, g_kt, g_v) = (&node.output[0], &node.output[1], &node.output[2]);
    scan(b, &[dkt0, dv0], &inputs.outer(), &[g_kt, g_v, &dq_stack], g);
    if o.scale_folded {
        let dq = b.fresh("attention/dq_unscaled");
        unblock(b, &dq_stack, r, &bl.rows, &dq);
        b.node_to(scale_op(&a), &[&dq, &a.scale], &[g_q], vec![]);
    } else {
        unblock(b, &dq_stack, r, &bl.rows, g_q);
    }
}

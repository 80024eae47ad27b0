//! Blockwise attention's gradient (`passes/attention`): one internal `BlockAttentionGrad` node
//! that `attention::lower` expands into a `Scan` recomputing each block's probabilities.

use ntl_ops::Builder;

use super::{g0, Grads};
use crate::error::Error;
use crate::onnx::NodeProto;
use crate::passes::attention::node::{Attn, BACKWARD, DOMAIN};
use crate::passes::grad::Ctx;

/// Gradients flow to the query, the transposed keys and the values; the scale and the masks
/// are not computed from weights (`attention::find` checks it).
pub fn inputs(_: &NodeProto) -> Vec<usize> {
    vec![0, 1, 2]
}

pub fn attention(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    wants: &[bool],
) -> Result<Grads, Error> {
    super::internal(node, DOMAIN, "blockwise attention")?;
    let g = g0(node, gy)?.to_string();
    let a = Attn::of(node);
    // the gradients in the scores' broadcast batch shape, then summed down to each input's
    let full = backward(ctx, &a, &g);
    let same = a.proven_same_batch(ctx.shapes);
    let mut gx: Grads = vec![None; node.input.len()];
    for (k, x) in [&a.q, &a.kt, &a.v].into_iter().enumerate() {
        if wants.get(k).copied().unwrap_or(false) {
            gx[k] = Some(if same {
                full[k].clone()
            } else {
                ctx.unbroadcast(&full[k], x, Some(a.rank))
            });
        }
    }
    Ok(gx)
}

/// One `BlockAttentionGrad` node for `a` and the output's gradient `g`: the gradients of q, kᵀ
/// and v in the scores' broadcast batch shape.
fn backward(ctx: &mut Ctx, a: &Attn, g: &str) -> [String; 3] {
    let full = ["grad/attention_q", "grad/attention_kt", "grad/attention_v"].map(|hint| {
        let name = ctx.b.fresh(hint);
        ctx.ranks.set(&name, a.rank);
        name
    });
    let name = ctx.b.fresh(BACKWARD);
    let outputs = [full[0].as_str(), full[1].as_str(), full[2].as_str()];
    ctx.b.nodes.push(a.backward_node(&name, g, outputs));
    full
}

/// The ONNX `Attention` operator as exported (opset 23: torch's dynamo exporter writes SDPA so)
/// keeps its forward; its gradient is the blockwise one, on the attention it computes:
/// `softmax(Q·Kᵀ·scale + causal + mask)·V` with K and V repeated over the query heads of their
/// group (GQA: query head h reads key head h ÷ (Hq / Hk)), a fully masked row giving zeros.
pub fn onnx_inputs(_: &NodeProto) -> Vec<usize> {
    vec![0, 1, 2]
}

pub fn onnx_attention(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    wants: &[bool],
) -> Result<Grads, Error> {
    use crate::onnx::{attr, attr_i};
    use crate::passes::attention::node::{Term, TermKind};
    let refuse = |why: &str| {
        Err(Error::Usage(format!(
            "Attention node '{}': {why}, which the step graph does not differentiate; export the training graph without it",
            node.name()
        )))
    };
    if !node.domain().is_empty() && node.domain() != "ai.onnx" {
        return refuse(&format!("an operator of domain '{}'", node.domain()));
    }
    let input = |i: usize| node.input.get(i).map_or("", String::as_str);
    if !(input(4).is_empty() && input(5).is_empty() && input(6).is_empty()) {
        return refuse("a key/value cache input (past_key, past_value or nonpad_kv_seqlen)");
    }
    if node.output.iter().skip(1).any(|o| !o.is_empty()) {
        return refuse("an output besides the attention (present key/value, qk_matmul_output)");
    }
    if attr(node, "softcap").is_some_and(|a| a.f() != 0.0) {
        return refuse("a softcap");
    }
    let (q, k, v, mask) = (input(0), input(1), input(2), input(3));
    let rank4 = [q, k, v].iter().all(|x| ctx.ranks.get(x) == Some(4));
    if !rank4 || attr(node, "q_num_heads").is_some() {
        return refuse("operands that are not [batch, heads, T, head_size] (3-D, heads packed)");
    }
    let g = g0(node, gy)?.to_string();
    let b = &mut *ctx.b;
    let scale = match attr(node, "scale") {
        Some(a) => b.scalar_f32("grad/attention_scale", a.f()),
        None => {
            // 1/√head_size, the operator's default
            let shape = b.node("Shape", &[q], "grad/attention_q_shape", vec![]);
            let d = b.slice(&shape, 3, 4, 0, "grad/attention_head_size");
            let d = b.cast(&d, crate::onnx::FLOAT, "grad/attention_head_size_f");
            let d = b.squeeze(&d, &[0], "grad/attention_head_size_s");
            let root = b.unary("Sqrt", &d, "grad/attention_root");
            b.unary("Reciprocal", &root, "grad/attention_scale")
        }
    };
    ctx.ranks.set(&scale, 0);
    let grouped = !ctx.shapes.same_axes(&[q, k, v], 4, 1..2);
    let (k_rep, v_rep) = if grouped {
        (repeat_heads(ctx, k, q), repeat_heads(ctx, v, q))
    } else {
        (k.to_string(), v.to_string())
    };
    let kt = ctx.b.transpose(&k_rep, &[0, 1, 3, 2], "grad/attention_kt");
    ctx.ranks.set(&kt, 4);
    let minus_inf = ctx.f32(f32::NEG_INFINITY);
    let mut terms = Vec::new();
    if attr_i(node, "is_causal") == Some(1) {
        let causal = causal_mask(ctx, q, &kt);
        terms.push(Term {
            kind: TermKind::Keep,
            inputs: vec![causal, minus_inf.clone()],
            ranks: vec![2, 0],
        });
    }
    if !mask.is_empty() {
        let r = ctx.ranks.get(mask).unwrap_or(4);
        terms.push(if ctx.types.get(mask) == Some(crate::onnx::BOOL) {
            Term {
                kind: TermKind::Keep,
                inputs: vec![mask.to_string(), minus_inf],
                ranks: vec![r, 0],
            }
        } else {
            Term {
                kind: TermKind::Add,
                inputs: vec![mask.to_string()],
                ranks: vec![r],
            }
        });
    }
    let a = Attn {
        q: q.to_string(),
        kt: kt.clone(),
        v: v_rep.clone(),
        scale,
        scale_divides: false,
        score_map: Default::default(),
        terms,
        nan_to_zero: true,
        q_rank: 4,
        kt_rank: 4,
        v_rank: 4,
        scale_rank: 0,
        rank: 4,
        block: ctx.attention_block,
        declared_here: false,
        // the forward is the operator: onnxruntime runs the graph (tract cannot type the
        // operator's output), so the backward reads only the keys the masks leave each block
        fused: true,
        same_batch: false,
    };
    let full = backward(ctx, &a, &g);
    let mut gx: Grads = vec![None; node.input.len()];
    if wants.first().copied().unwrap_or(false) {
        gx[0] = Some(ctx.unbroadcast(&full[0], q, Some(4)));
    }
    if wants.get(1).copied().unwrap_or(false) {
        let g_k = ctx.b.transpose(&full[1], &[0, 1, 3, 2], "grad/attention_k");
        ctx.ranks.set(&g_k, 4);
        let g_k = if grouped {
            sum_groups(ctx, &g_k, k)
        } else {
            g_k
        };
        gx[1] = Some(ctx.unbroadcast(&g_k, k, Some(4)));
    }
    if wants.get(2).copied().unwrap_or(false) {
        let g_v = if grouped {
            sum_groups(ctx, &full[2], v)
        } else {
            full[2].clone()
        };
        gx[2] = Some(ctx.unbroadcast(&g_v, v, Some(4)));
    }
    Ok(gx)
}

/// `x` `[B, Hk, S, d]` with each head repeated for the query heads of its group:
/// `[B, Hk, Hq/Hk, S, d]` → `[B, Hq, S, d]`.
fn repeat_heads(ctx: &mut Ctx, x: &str, q: &str) -> String {
    let b = &mut *ctx.b;
    let xs = b.node("Shape", &[x], "grad/attention_kv_shape", vec![]);
    let qs = b.node("Shape", &[q], "grad/attention_q_heads_of", vec![]);
    let hq = b.slice(&qs, 1, 2, 0, "grad/attention_q_heads");
    let batch = b.slice(&xs, 0, 1, 0, "grad/attention_kv_batch");
    let hk = b.slice(&xs, 1, 2, 0, "grad/attention_kv_heads");
    let tail = b.slice(&xs, 2, 4, 0, "grad/attention_kv_tail");
    let group = b.binary("Div", &hq, &hk, "grad/attention_group");
    let axis = b.const_i64("grad/attention_group_axis", &[1], &[2]);
    let wide = b.node("Unsqueeze", &[x, &axis], "grad/attention_kv_wide", vec![]);
    let one = b.const_i64("grad/attention_one", &[1], &[1]);
    let target = b.concat(
        &[&one, &one, &group, &one, &one],
        0,
        "grad/attention_repeat",
    );
    let repeated = b.node("Expand", &[&wide, &target], "grad/attention_kv_rep", vec![]);
    let flat = b.concat(&[&batch, &hq, &tail], 0, "grad/attention_kv_flat");
    let out = b.node("Reshape", &[&repeated, &flat], "grad/attention_kv", vec![]);
    ctx.ranks.set(&out, 4);
    out
}

/// A repeated key or value's gradient `[B', Hq, S, d]` summed over each group back to `x`'s
/// `Hk` heads.
fn sum_groups(ctx: &mut Ctx, g: &str, x: &str) -> String {
    let b = &mut *ctx.b;
    let gs = b.node("Shape", &[g], "grad/attention_g_shape", vec![]);
    let xs = b.node("Shape", &[x], "grad/attention_kv_shape", vec![]);
    let batch = b.slice(&gs, 0, 1, 0, "grad/attention_g_batch");
    let hk = b.slice(&xs, 1, 2, 0, "grad/attention_kv_heads");
    let tail = b.slice(&gs, 2, 4, 0, "grad/attention_g_tail");
    let rest = b.const_i64("grad/attention_group_rest", &[1], &[-1]);
    let grouped = b.concat(&[&batch, &hk, &rest, &tail], 0, "grad/attention_grouped");
    let g5 = b.node(
        "Reshape",
        &[g, &grouped],
        "grad/attention_g_grouped",
        vec![],
    );
    let out = b.reduce_sum(&g5, &[2], false, "grad/attention_g_summed");
    ctx.ranks.set(&out, 4);
    out
}

/// `[Tq, Tk]`: true where key j ≤ query i (the operator's upper-left causal mask).
fn causal_mask(ctx: &mut Ctx, q: &str, kt: &str) -> String {
    let b = &mut *ctx.b;
    let count = |b: &mut Builder, x: &str, axis: i64, hint: &str| {
        let s = b.node("Shape", &[x], hint, vec![]);
        let n = b.slice(&s, axis, axis + 1, 0, hint);
        b.squeeze(&n, &[0], hint)
    };
    let tq = count(b, q, 2, "grad/attention_tq");
    let tk = count(b, kt, 3, "grad/attention_tk");
    let zero = b.const_i64("grad/attention_zero", &[], &[0]);
    let step = b.const_i64("grad/attention_step", &[], &[1]);
    let rows = b.node("Range", &[&zero, &tq, &step], "grad/attention_rows", vec![]);
    let cols = b.node("Range", &[&zero, &tk, &step], "grad/attention_cols", vec![]);
    let axis = b.const_i64("grad/attention_row_axis", &[1], &[1]);
    let rows = b.node(
        "Unsqueeze",
        &[&rows, &axis],
        "grad/attention_rows_col",
        vec![],
    );
    let later = b.binary("Less", &rows, &cols, "grad/attention_future");
    let out = b.unary("Not", &later, "grad/attention_causal");
    ctx.ranks.set(&out, 2);
    out
}

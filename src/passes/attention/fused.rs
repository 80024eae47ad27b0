//! `--attention onnx`: the forward as the ONNX `Attention` operator (opset 23), which a runtime
//! may run as one fused kernel (onnxruntime's CUDA provider: flash or memory-efficient
//! attention); the backward stays the blockwise recomputation in standard ops (`lower`), since
//! the operator has no gradient. `check` says whether a recognised attention has the operator's
//! form, `forward` writes it.
//!
//! The operator computes `softmax(Q·Kᵀ·scale + mask)·V` over `[batch, heads, T, head_size]`
//! operands. The export's scalar scale multiplies the query (in float32, as the blockwise
//! forward does) and the operator's `scale` is 1; its masks become one additive float mask,
//! term by term in the graph's order: a bias is added (subtracted), and a `Where` that fills the
//! scores with −∞ or a value ≤ −1e30 (`finfo.min`) keeps the mask where it keeps the scores and
//! takes the fill value elsewhere — `s + fill` rounds to the fill value, so the scores are the
//! export's. A fill with any other value is not additive: that attention keeps the blockwise
//! forward, and the step says why. A row the mask fills at every key with one such value is
//! spread evenly by the export's softmax, and zeroed by onnxruntime's kernel (`finfo.min` is −∞
//! to it): the forward gives those rows the mean of the values (`blind_rows`).

use ntl_ops::Builder;

use super::node::{additive_mask, row_highs, Attn, RowHighs, TermKind, MASKED_AT};
use super::operands::{batch_shape, scale_op, swap_last_two};
use crate::graph::elem_types::TypeNames;
use crate::graph::shapes::Shapes;
use crate::graph::GraphIndex;
use crate::onnx::{float_attr, NodeProto, FLOAT};

/// The opset that has the `Attention` operator.
pub const MIN_OPSET: i64 = 23;

/// Whether `a` has the operator's form; Ok(same_batch) where it does, the reason where not.
/// `types`: the op schemas' types (exact where the passes' rule guesses past a second output).
pub fn check(
    a: &Attn,
    index: &GraphIndex,
    shapes: &Shapes,
    types: &TypeNames,
) -> Result<bool, String> {
    if [a.q_rank, a.kt_rank, a.v_rank, a.rank] != [4; 4] {
        return Err(format!(
            "the Attention operator takes [batch, heads, T, head_size] operands; the query, keys and values here have ranks {}, {} and {}",
            a.q_rank, a.kt_rank, a.v_rank
        ));
    }
    for x in [&a.q, &a.kt, &a.v] {
        match types.get(x) {
            Some("float") => {}
            other => {
                return Err(format!(
                    "'{x}' is of type {} where the operator is written for float32 graphs (and --precision)",
                    other.unwrap_or("unknown")
                ))
            }
        }
    }
    if !a.score_map.is_empty() {
        // the operator has `softcap`, but onnxruntime-gpu's kernel refuses it on every path
        return Err("the scores are soft-capped (onnxruntime's CUDA Attention kernel does not implement the operator's softcap)".into());
    }
    if !a.scale.is_empty() && a.scale_rank != 0 {
        return Err(format!(
            "the scores' scale '{}' has axes (the operator's scale is one number)",
            a.scale
        ));
    }
    if !a.terms.is_empty() && a.terms.iter().flat_map(|t| &t.ranks).all(|&r| r < 2) {
        return Err(
            "the masks have no row and key axes (the operator's mask has at least two)".into(),
        );
    }
    for t in &a.terms {
        if !matches!(t.kind, TermKind::Keep | TermKind::Fill) {
            continue;
        }
        match t.fill_values(index) {
            Some(v) if v.iter().all(|&x| x <= MASKED_AT) => {}
            _ => {
                return Err(format!(
                    "a Where fills the scores with '{}', not a constant of −∞ or at most −1e30 (the operator's mask adds to the scores)",
                    t.inputs[1]
                ))
            }
        }
    }
    Ok(a.proven_same_batch(shapes))
}

/// The exact types `check` reads.
pub fn types(model: &crate::onnx::ModelProto) -> TypeNames {
    let opsets: std::collections::HashMap<String, i64> = model
        .opset_import
        .iter()
        .map(|o| {
            (
                ntl_ops::schema::canonical_domain(o.domain()).to_string(),
                o.version(),
            )
        })
        .collect();
    let graph = model.graph.as_ref().expect("loaded models have a graph");
    TypeNames::infer(graph, &opsets, ntl_ops::schema::schemas())
}

/// Writes the `Attention` node (and what feeds it) for the internal forward `node`.
pub fn forward(b: &mut Builder, node: &NodeProto, half: Option<i32>) {
    let a = Attn::of(node);
    let compute = |b: &mut Builder, x: &str| match half {
        Some(h) => b.cast(x, h, "attention/half"),
        None => x.to_string(),
    };
    let q = if a.scale.is_empty() {
        a.q.clone()
    } else {
        // in float32 (a half query arrives as it is): the scale itself is not rounded
        let q = match half {
            Some(_) => b.cast(&a.q, FLOAT, "attention/q_f"),
            None => a.q.clone(),
        };
        b.binary(scale_op(&a), &q, &a.scale, "attention/q_scaled")
    };
    let mut q = compute(b, &q);
    let kt = compute(b, &a.kt);
    let mut k = swap_last_two(b, &kt, 4, "attention/k");
    let mut v = compute(b, &a.v);
    if !a.same_batch {
        // the operator does not broadcast its operands' batch and head axes
        let batch = batch_shape(b, &a);
        for x in [&mut q, &mut k, &mut v] {
            let shape = b.node("Shape", &[x], "attention/operand_shape", vec![]);
            let tail = b.slice(&shape, 2, 4, 0, "attention/operand_tail");
            let target = b.concat(&[&batch, &tail], 0, "attention/operand_target");
            *x = b.node("Expand", &[x, &target], "attention/operand", vec![]);
        }
    }
    let term_inputs: Vec<Vec<String>> = a.terms.iter().map(|t| t.inputs.clone()).collect();
    let mask = additive_mask(b, &a, &term_inputs);
    let rows = mask.as_ref().map(|m| MaskedRows::of(b, m));
    let mask = mask.map(|m| compute(b, &m));
    // no `softmax_precision`: onnxruntime's CUDA kernel refuses any (NOT_IMPLEMENTED on all
    // three of its paths), and its kernels keep a half softmax's sums in float32 anyway
    let attrs = vec![float_attr("scale", 1.0)];
    let inputs = [
        q.as_str(),
        k.as_str(),
        v.as_str(),
        mask.as_deref().unwrap_or(""),
    ];
    let inputs = if mask.is_some() {
        &inputs[..]
    } else {
        &inputs[..3]
    };
    let mut y = b.node("Attention", inputs, "attention/fused", attrs);
    if half.is_some() {
        y = b.cast(&y, FLOAT, "attention/fused_f");
    }
    if a.nan_to_zero {
        // a row with every key masked: such an export (and the blockwise forward) gives
        // zeros
        let nan = b.unary("IsNaN", &y, "attention/fused_nan");
        let zero = b.scalar_f32("attention/fused_zero", 0.0);
        y = b.where_(&nan, &zero, &y, "attention/fused_nan_zero");
    }
    if let Some(rows) = rows {
        // the export's softmax spreads such a row evenly: the mean of the values, in float32
        // (`Where` broadcasts their batch and head axes)
        let v = match half {
            Some(_) => b.cast(&a.v, FLOAT, "attention/blind_rows_v"),
            None => a.v.clone(),
        };
        let spread = b.reduce("ReduceMean", &v, &[2], true, "attention/blind_rows_values");
        y = b.where_(&rows.even, &spread, &y, "attention/blind_rows_spread");
        // a row of −∞ is zeros, as the blockwise backward takes it (onnxruntime's CPU kernel
        // gives zeros; its CUDA memory-efficient kernel caps the mask at −1e30 and spreads the
        // row, microsoft/onnxruntime#28904)
        let zero = b.scalar_f32("attention/minus_inf_row_zero", 0.0);
        y = b.where_(&rows.minus_inf, &zero, &y, "attention/minus_inf_rows_zero");
    }
    // the last node written made `y`, and nothing reads it yet: it writes the output instead
    let last = b.nodes.last_mut().expect("the Attention node at least");
    debug_assert_eq!(last.output[0], y);
    last.output[0] = node.output[0].clone();
}

/// The rows of the mask (`[.., T, 1]` bool each) the kernel may not compute as the export does.
struct MaskedRows {
    /// Rows whose every key the mask fills with one and the same value at or below −1e30. The
    /// export's softmax spreads such a row evenly over the keys (each score rounds to the fill
    /// value), where onnxruntime's `Attention` kernel gives zeros for a row of `finfo.min` (it
    /// reads that value as −∞) and, under `--precision`, for any row the half cast takes to −∞.
    /// Rows of mixed fills (`finfo.min` and −∞; different fills under `--precision`) stay the
    /// kernel's zeros: the export's weights there need a pass over the whole mask and a
    /// product with the values.
    even: String,
    /// Rows of −∞ at every key: the export's softmax gives NaN there, torch's SDPA and the ONNX
    /// specification zeros.
    minus_inf: String,
}

impl MaskedRows {
    fn of(b: &mut Builder, mask: &str) -> MaskedRows {
        let RowHighs { high, minus_inf } = row_highs(b, mask);
        let low = b.reduce("ReduceMin", mask, &[-1], true, "attention/row_mask_min");
        let even = b.binary("Equal", &high, &low, "attention/row_mask_even");
        let bound = b.scalar_f32("attention/row_masked_at", MASKED_AT as f32);
        let masked = b.binary("LessOrEqual", &high, &bound, "attention/row_masked");
        let finite = b.unary("Not", &minus_inf, "attention/row_mask_finite");
        let even_masked = b.binary("And", &even, &masked, "attention/row_blind_even");
        let even = b.binary("And", &even_masked, &finite, "attention/row_blind");
        MaskedRows { even, minus_inf }
    }
}

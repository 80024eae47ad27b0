//! Softmax, LogSoftmax, LayerNormalization and the cross-entropy losses.

use std::collections::{HashMap, HashSet};

use super::{g0, like, Grads};
use crate::error::Error;
use crate::graph::shapes::{Dim, Shapes};
use crate::onnx::{attr, attr_i, attr_s, int_attr, NodeProto, FLOAT};
use crate::passes::grad::Ctx;

/// Softmax: `dx = y ⊙ (g − Σ g ⊙ y)`; LogSoftmax: `dx = g − exp(y) ⊙ Σ g` (sums along `axis`).
/// A Softmax whose NaN rows the forward fills (see [`nan_filled`]) reads the filled output as
/// `y`: the same values in every other row, and a zero gradient for a fully masked row (whose
/// filled output is a constant) instead of NaN — torch's `_safe_softmax` backward.
pub fn softmax(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?;
    let y = node.output[0].as_str();
    let axis = attr_i(node, "axis").unwrap_or(-1);
    let gx = if node.op_type() == "Softmax" {
        let filled = ctx.nan_filled.get(y).cloned();
        let y = filled.as_deref().unwrap_or(y);
        let gyy = ctx.op("Mul", &[g, y], "grad/softmax_gy");
        let s = ctx.b.reduce_sum(&gyy, &[axis], true, "grad/softmax_sum");
        let d = ctx.op("Sub", &[g, &s], "grad/softmax_centered");
        ctx.op("Mul", &[y, &d], "grad/softmax")
    } else {
        log_softmax_vjp(ctx, g, y, axis)
    };
    like(ctx, gx, &node.input[0])
}

/// Softmax outputs `p` that the forward reads as `Where(IsNaN(p), c, p)` with a one-element `c`
/// (optimum's export zeroes fully masked rows so): `p` → the `Where`'s output. A Softmax row is
/// NaN as a whole or not at all, and the `Where` passes no gradient to its NaN elements.
pub fn nan_filled(nodes: &[NodeProto], shapes: &Shapes) -> HashMap<String, String> {
    let softmax: HashSet<&str> = nodes
        .iter()
        .filter(|n| n.op_type() == "Softmax" && matches!(n.domain(), "" | "ai.onnx"))
        .map(|n| n.output[0].as_str())
        .collect();
    let isnan: HashMap<&str, &str> = nodes
        .iter()
        .filter(|n| n.op_type() == "IsNaN" && softmax.contains(n.input[0].as_str()))
        .map(|n| (n.output[0].as_str(), n.input[0].as_str()))
        .collect();
    let one_element = |t: &str| {
        shapes
            .get(t)
            .is_some_and(|s| s.iter().all(|d| *d == Dim::Known(1)))
    };
    nodes
        .iter()
        .filter(|n| n.op_type() == "Where" && n.input.len() == 3)
        .filter(|n| isnan.get(n.input[0].as_str()) == Some(&n.input[2].as_str()))
        .filter(|n| one_element(&n.input[1]))
        .map(|n| (n.input[2].clone(), n.output[0].clone()))
        .collect()
}

fn log_softmax_vjp(ctx: &mut Ctx, g: &str, log_p: &str, axis: i64) -> String {
    let p = ctx.op("Exp", &[log_p], "grad/log_softmax_p");
    let s = ctx.b.reduce_sum(g, &[axis], true, "grad/log_softmax_sum");
    let t = ctx.op("Mul", &[&p, &s], "grad/log_softmax_t");
    ctx.op("Sub", &[g, &t], "grad/log_softmax")
}

/// LayerNormalization over the axes from `axis` on; mean and 1/σ are recomputed (the node's
/// optional outputs are not relied on).
pub fn layer_norm(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    wants: &[bool],
) -> Result<Grads, Error> {
    if gy.iter().skip(1).any(|g| g.is_some()) {
        return Err(Error::Usage(format!(
            "LayerNormalization node '{}': its Mean/InvStdDev outputs are used on the loss path; the step graph differentiates the normalised output only",
            node.name()
        )));
    }
    let g = g0(node, gy)?;
    let x = node.input[0].as_str();
    let axis = attr_i(node, "axis").unwrap_or(-1);
    let eps = attr(node, "epsilon").map(|a| a.f()).unwrap_or(1e-5);
    let axes: Vec<i64> = if axis < 0 {
        (axis..0).collect()
    } else {
        let r = ctx.rank(x, node)? as i64;
        (axis..r).collect()
    };
    let rank = ctx.ranks.get(x);
    let mean = ctx.b.reduce("ReduceMean", x, &axes, true, "grad/ln_mean");
    let xc = ctx.op("Sub", &[x, &mean], "grad/ln_centered");
    let sq = ctx.op("Mul", &[&xc, &xc], "grad/ln_sq");
    let var = ctx.b.reduce("ReduceMean", &sq, &axes, true, "grad/ln_var");
    let e = ctx.f32(eps);
    let ve = ctx.op("Add", &[&var, &e], "grad/ln_var_eps");
    let sd = ctx.op("Sqrt", &[&ve], "grad/ln_std");
    let inv = ctx.op("Reciprocal", &[&sd], "grad/ln_inv_std");
    let xhat = ctx.op("Mul", &[&xc, &inv], "grad/ln_xhat");
    let mut out = vec![None; node.input.len()];
    if wants[0] {
        let scale = node.input[1].as_str();
        let dxhat = ctx.op("Mul", &[g, scale], "grad/ln_dxhat");
        let m1 = ctx
            .b
            .reduce("ReduceMean", &dxhat, &axes, true, "grad/ln_m1");
        let prod = ctx.op("Mul", &[&dxhat, &xhat], "grad/ln_dxhat_xhat");
        let m2 = ctx.b.reduce("ReduceMean", &prod, &axes, true, "grad/ln_m2");
        let t = ctx.op("Mul", &[&xhat, &m2], "grad/ln_t");
        let d = ctx.op("Sub", &[&dxhat, &m1], "grad/ln_d");
        let d = ctx.op("Sub", &[&d, &t], "grad/ln_d2");
        out[0] = Some(ctx.op("Mul", &[&d, &inv], "grad/ln_x"));
    }
    if wants.get(1).copied().unwrap_or(false) {
        let gs = ctx.op("Mul", &[g, &xhat], "grad/ln_gscale");
        if let Some(r) = rank {
            ctx.ranks.set(&gs, r);
        }
        out[1] = Some(ctx.unbroadcast_to(&gs, &node.input[1], &node.output[0]));
    }
    if wants.get(2).copied().unwrap_or(false) {
        out[2] = Some(ctx.unbroadcast_to(g, &node.input[2], &node.output[0]));
    }
    Ok(out)
}

/// SoftmaxCrossEntropyLoss (d/dscores = (softmax − onehot)·w) and NegativeLogLikelihoodLoss
/// (d/dinput = −onehot·w), class axis 1, with class weights, `ignore_index` and every
/// reduction (`mean` divides by the summed weights of the positions not ignored).
pub fn cross_entropy(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let scores = node.input[0].as_str();
    let labels = node.input[1].as_str();
    let weights = node.input.get(2).filter(|w| !w.is_empty()).cloned();
    let reduction = attr_s(node, "reduction").unwrap_or_else(|| "mean".into());
    let ignore = attr_i(node, "ignore_index");
    let is_sce = node.op_type() == "SoftmaxCrossEntropyLoss";

    let mut result: Option<String> = None;
    if let Some(g) = gy[0].as_deref() {
        // Positions that count, and their weights.
        let (safe_labels, mask) = match ignore {
            Some(ix) => {
                let ixc = ctx.b.const_i64("grad/ignore_index", &[], &[ix]);
                let is_ignored = ctx.b.equal(labels, &ixc, "grad/ce_ignored");
                let mask = ctx.op("Not", &[&is_ignored], "grad/ce_counted");
                let zero = ctx.b.const_i64("grad/zero_label", &[], &[0]);
                let safe = ctx.b.where_(&mask, labels, &zero, "grad/ce_safe_labels");
                (safe, Some(mask))
            }
            None => (labels.to_string(), None),
        };
        let w = match (&weights, &mask) {
            (Some(wt), m) => {
                let wi = ctx.b.gather(wt, &safe_labels, 0, "grad/ce_w");
                Some(match m {
                    Some(m) => {
                        let mf = ctx.b.cast(m, FLOAT, "grad/ce_mask_f");
                        ctx.op("Mul", &[&wi, &mf], "grad/ce_w_masked")
                    }
                    None => wi,
                })
            }
            (None, Some(m)) => Some(ctx.b.cast(m, FLOAT, "grad/ce_mask_f")),
            (None, None) => None,
        };
        // Per-position coefficient of (softmax − onehot).
        let coef = match (reduction.as_str(), &w) {
            ("none", Some(w)) => ctx.op("Mul", &[g, w], "grad/ce_coef"),
            ("none", None) => g.to_string(),
            ("sum", Some(w)) => ctx.op("Mul", &[g, w], "grad/ce_coef"),
            ("sum", None) => g.to_string(),
            ("mean", Some(w)) => {
                let total = ctx.b.reduce_sum(w, &[], false, "grad/ce_weight_sum");
                let zero = ctx.f32(0.0);
                let one = ctx.f32(1.0);
                let none = ctx.b.equal(&total, &zero, "grad/ce_none_counted");
                let denom = ctx.b.where_(&none, &one, &total, "grad/ce_denominator");
                let gw = ctx.op("Mul", &[g, w], "grad/ce_gw");
                ctx.op("Div", &[&gw, &denom], "grad/ce_coef")
            }
            ("mean", None) => {
                let n = ctx.op("Size", &[labels], "grad/ce_count");
                let n = ctx.b.cast(&n, FLOAT, "grad/ce_count_f");
                ctx.op("Div", &[g, &n], "grad/ce_coef")
            }
            (r, _) => {
                return Err(Error::Usage(format!(
                    "{} node '{}' has reduction '{r}'; expected none, sum or mean",
                    node.op_type(),
                    node.name()
                )))
            }
        };
        let per_position = w.is_some() || reduction == "none";
        let coef = if per_position {
            ctx.b.unsqueeze(&coef, &[1], "grad/ce_coef_c")
        } else {
            coef
        };
        // coef·(softmax − onehot): the dense part, then −coef written at each row's label
        // (one index per row, so a plain ScatterElements; ignored rows have coef 0).
        let idx = ctx.b.unsqueeze(&safe_labels, &[1], "grad/ce_label_idx");
        let dense = if is_sce {
            let p = match node.output.get(1).filter(|o| !o.is_empty()) {
                Some(lp) => ctx.op("Exp", &[lp], "grad/ce_p"),
                None => ctx.b.softmax(scores, 1, "grad/ce_p"),
            };
            ctx.op("Mul", &[&p, &coef], "grad/ce_p_coef")
        } else {
            ctx.zeros_like(scores)
        };
        let at_label = ctx.b.node(
            "GatherElements",
            &[&dense, &idx],
            "grad/ce_at_label",
            vec![int_attr("axis", 1)],
        );
        let minus = ctx.op("Sub", &[&at_label, &coef], "grad/ce_at_label_minus_y");
        result = Some(ctx.b.node(
            "ScatterElements",
            &[&dense, &idx, &minus],
            "grad/ce_scores",
            vec![int_attr("axis", 1)],
        ));
    }
    if let Some(glp) = gy.get(1).and_then(|g| g.as_deref()) {
        if !is_sce {
            return Err(Error::Usage(format!(
                "NegativeLogLikelihoodLoss node '{}' has a second output on the loss path",
                node.name()
            )));
        }
        let lp = node.output[1].as_str();
        let extra = log_softmax_vjp(ctx, glp, lp, 1);
        result = Some(match result {
            Some(r) => ctx.op("Add", &[&r, &extra], "grad/ce_scores_all"),
            None => extra,
        });
    }
    Ok(vec![result])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{test_node as node, GraphIndex};
    use crate::onnx::{f32_tensor, GraphProto};

    /// The filled output stands for the Softmax's where the fill is one element (of any rank),
    /// and not where the fill could broadcast the `Where` past the Softmax's shape.
    #[test]
    fn nan_filled_softmax_outputs() {
        let guard = |p: &str, fill: &str, tag: &str| {
            let nan = format!("nan_{tag}");
            [
                node("Softmax", &[&format!("s_{tag}")], p, vec![]),
                node("IsNaN", &[p], &nan, vec![]),
                node("Where", &[&nan, fill, p], &format!("kept_{tag}"), vec![]),
            ]
        };
        let mut nodes: Vec<NodeProto> = Vec::new();
        nodes.extend(guard("p1", "zero", "1"));
        nodes.extend(guard("p2", "zero_1d", "2"));
        nodes.extend(guard("p3", "wide", "3"));
        let graph = GraphProto {
            node: nodes.clone(),
            initializer: vec![
                f32_tensor("zero", &[], &[0.0]),
                f32_tensor("zero_1d", &[1], &[0.0]),
                f32_tensor("wide", &[2, 1], &[0.0, 0.0]),
            ],
            ..Default::default()
        };
        let shapes = Shapes::infer(&GraphIndex::new(&graph));
        let filled = nan_filled(&nodes, &shapes);
        assert_eq!(filled.get("p1").map(String::as_str), Some("kept_1"));
        assert_eq!(filled.get("p2").map(String::as_str), Some("kept_2"));
        assert_eq!(filled.len(), 2, "{filled:?}");
    }
}

//! The Reduce* family: the output's gradient is put back over the reduced axes, times the
//! reduction's derivative (1 for sums, 1/n for means, the softmax for log-sum-exp, ...);
//! GlobalAveragePool, a mean; and CumSum, the running sum.

use super::{g0, like, Grads};
use crate::error::Error;
use crate::onnx::{attr_i, attr_ints, int_attr, NodeProto, FLOAT};
use crate::passes::grad::Ctx;

pub fn reduce(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?.to_string();
    let op = node.op_type();
    let x = node.input[0].as_str();
    let y = node.output[0].as_str();
    let keepdims = attr_i(node, "keepdims").unwrap_or(1) != 0;
    let axes_input = node.input.get(1).filter(|a| !a.is_empty()).cloned();
    let axes_attr = attr_ints(node, "axes");
    let no_axes = axes_input.is_none() && axes_attr.as_ref().is_none_or(|a| a.is_empty());
    if no_axes && attr_i(node, "noop_with_empty_axes").unwrap_or(0) != 0 {
        // no reduction: the op is its elementwise part alone
        let gx = elementwise_only(ctx, op, x, &g);
        return like(ctx, gx, x);
    }
    let axes = match (axes_input, axes_attr) {
        (Some(a), _) => Some(a),
        (None, Some(a)) if !a.is_empty() => Some(ctx.i64s(&a)),
        _ => None,
    };
    // a reduced tensor with the reduced axes back (size 1), so it broadcasts against x
    let kept = |ctx: &mut Ctx, t: &str, hint: &str| match &axes {
        Some(axes) if !keepdims => ctx.op("Unsqueeze", &[t, axes], hint),
        _ => t.to_string(),
    };
    let g = kept(ctx, &g, "grad/reduce_kept");
    let gx = match op {
        "ReduceSum" => {
            let shape = ctx.shape(x);
            ctx.op("Expand", &[&g, &shape], "grad/reduce")
        }
        "ReduceMean" => {
            let shape = ctx.shape(x);
            // how many elements each mean averaged: the product of the reduced dims, from the
            // shape (no Size: MIGraphX takes none); the means' gradients divided before they
            // are spread over the elements (one pass over the whole tensor, not two)
            let reduced = match &axes {
                Some(axes) => ctx.b.gather(&shape, axes, 0, "grad/mean_dims"),
                None => shape.clone(),
            };
            let reduced = ctx.b.cast(&reduced, FLOAT, "grad/mean_dims_f");
            let count = ctx.b.node(
                "ReduceProd",
                &[&reduced],
                "grad/mean_count",
                vec![int_attr("keepdims", 0)],
            );
            let share = ctx.op("Div", &[&g, &count], "grad/reduce_mean");
            ctx.op("Expand", &[&share, &shape], "grad/reduce")
        }
        "ReduceSumSquare" | "ReduceL1" => elementwise_only(ctx, op, x, &g),
        "ReduceL2" => {
            // x/‖x‖, and 0 where the norm is 0 (torch's subgradient)
            let norm = kept(ctx, y, "grad/l2_norm");
            let zero = ctx.f32(0.0);
            let is_zero = ctx.op("Equal", &[&norm, &zero], "grad/l2_is_zero");
            let one = ctx.f32(1.0);
            let safe = ctx.b.where_(&is_zero, &one, &norm, "grad/l2_safe");
            let unit = ctx.op("Div", &[x, &safe], "grad/l2_unit");
            let unit = ctx.b.where_(&is_zero, &zero, &unit, "grad/l2_d");
            ctx.op("Mul", &[&g, &unit], "grad/l2")
        }
        "ReduceLogSumExp" => {
            // softmax over the reduced axes: exp(x − lse)
            let lse = kept(ctx, y, "grad/lse_kept");
            let d = ctx.op("Sub", &[x, &lse], "grad/lse_shift");
            let p = ctx.op("Exp", &[&d], "grad/lse_softmax");
            ctx.op("Mul", &[&g, &p], "grad/lse")
        }
        "ReduceMax" | "ReduceMin" => {
            // shared evenly by the elements equal to the extreme, as torch.amax/amin do
            let extreme = kept(ctx, y, "grad/extreme_kept");
            let hit = ctx.op("Equal", &[x, &extreme], "grad/extreme_hit");
            let hit = ctx.b.cast(&hit, FLOAT, "grad/extreme_hit_f");
            let mut inputs = vec![hit.as_str()];
            inputs.extend(axes.as_deref());
            let ties = ctx.b.node(
                "ReduceSum",
                &inputs,
                "grad/extreme_ties",
                vec![int_attr("keepdims", 1)],
            );
            let share = ctx.op("Div", &[&hit, &ties], "grad/extreme_share");
            ctx.op("Mul", &[&g, &share], "grad/extreme")
        }
        op => unreachable!("reduce rule registered for {op}"),
    };
    like(ctx, gx, x)
}

/// The gradient of the elementwise part of a reduction (`x²`, `|x|`, or x itself), `g` already
/// broadcastable to x.
fn elementwise_only(ctx: &mut Ctx, op: &str, x: &str, g: &str) -> String {
    match op {
        "ReduceSumSquare" => {
            let two = ctx.f32(2.0);
            let d = ctx.op("Mul", &[x, &two], "grad/sum_square_d");
            ctx.op("Mul", &[g, &d], "grad/sum_square")
        }
        // with no axes to reduce, ReduceL2 is |x| too
        "ReduceL1" | "ReduceL2" => {
            let s = ctx.op("Sign", &[x], "grad/l1_sign");
            ctx.op("Mul", &[g, &s], "grad/l1")
        }
        _ => {
            let shape = ctx.shape(x);
            ctx.op("Expand", &[g, &shape], "grad/reduce")
        }
    }
}

/// CumSum(x, axis): each input reaches every later (earlier, reversed) output, so its
/// gradient is the cumulative sum of `g` the other way, with the same exclusivity.
pub fn cumsum(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?;
    let x = node.input[0].as_str();
    let axis = node.input[1].as_str();
    let reverse = attr_i(node, "reverse").unwrap_or(0) != 0;
    let attrs = vec![
        int_attr("exclusive", attr_i(node, "exclusive").unwrap_or(0)),
        int_attr("reverse", i64::from(!reverse)),
    ];
    let gx = ctx.b.node("CumSum", &[g, axis], "grad/cumsum", attrs);
    like(ctx, gx, x)
}

/// GlobalAveragePool: the mean over the spatial axes (2 and on; tf2onnx writes a Keras
/// LayerNormalization's moments with it), so `g` spreads evenly back over them.
pub fn global_average_pool(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?;
    let x = node.input[0].as_str();
    let shape = ctx.shape(x);
    let spatial = ctx.b.slice(&shape, 2, i64::MAX, 0, "grad/gap_spatial");
    let spatial = ctx.b.cast(&spatial, FLOAT, "grad/gap_spatial_f");
    let n = ctx
        .b
        .reduce("ReduceProd", &spatial, &[], false, "grad/gap_n");
    let spread = ctx.op("Expand", &[g, &shape], "grad/gap_spread");
    let gx = ctx.op("Div", &[&spread, &n], "grad/gap");
    like(ctx, gx, x)
}

/// TopK (a MoE router's choice of experts): the values' gradient goes back to the positions
/// they were taken from, zeros elsewhere (the indices of one row are distinct: no reduction).
pub fn top_k(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?;
    let x = node.input[0].as_str();
    let zeros = ctx.zeros_like(x);
    let axis = attr_i(node, "axis").unwrap_or(-1);
    let gx = ctx.b.node(
        "ScatterElements",
        &[&zeros, &node.output[1], g],
        "grad/top_k",
        vec![int_attr("axis", axis)],
    );
    like(ctx, gx, x)
}

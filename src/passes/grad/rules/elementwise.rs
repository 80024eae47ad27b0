//! Elementwise ops: arithmetic with broadcasting, unary functions, casts, selections.

use super::{g0, like, Grads};
use crate::error::Error;
use crate::onnx::{attr_i, is_float_type, NodeProto, FLOAT};
use crate::passes::grad::Ctx;

fn out_rank(ctx: &Ctx, node: &NodeProto) -> Option<usize> {
    ctx.ranks.get(&node.output[0])
}

/// Add, Sub, Mul, Div, Pow: each input's gradient, summed back to its own shape.
pub fn binary(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    wants: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?;
    let (a, b) = (node.input[0].as_str(), node.input[1].as_str());
    let y = node.output[0].as_str();
    let rank = out_rank(ctx, node);
    let mut out = vec![None, None];
    for (i, x) in [a, b].into_iter().enumerate() {
        if !wants[i] {
            continue;
        }
        let full = match (node.op_type(), i) {
            ("Add", _) | ("Sub", 0) => g.to_string(),
            ("Sub", _) => ctx.op("Neg", &[g], "grad/neg"),
            ("Mul", _) => ctx.op("Mul", &[g, if i == 0 { b } else { a }], "grad/mul"),
            ("Div", 0) => ctx.op("Div", &[g, b], "grad/div"),
            ("Div", _) => {
                // d(a/b)/db = −(a/b)/b, written without squaring b (float32 overflow)
                let gy_ = ctx.op("Mul", &[g, y], "grad/div_gy");
                let t = ctx.op("Div", &[&gy_, b], "grad/div_gyb");
                ctx.op("Neg", &[&t], "grad/div_b")
            }
            ("Pow", 0) => {
                // c·a^(c−1)
                let one = ctx.f32(1.0);
                let c1 = ctx.op("Sub", &[b, &one], "grad/pow_c1");
                let p = ctx.op("Pow", &[a, &c1], "grad/pow");
                let p = ctx.op("Mul", &[&p, b], "grad/pow_d");
                ctx.op("Mul", &[g, &p], "grad/pow_g")
            }
            _ => {
                // d(a^c)/dc = a^c·ln a
                let l = ctx.op("Log", &[a], "grad/pow_log");
                let t = ctx.op("Mul", &[y, &l], "grad/pow_exp");
                ctx.op("Mul", &[g, &t], "grad/pow_exp_g")
            }
        };
        if let Some(r) = rank {
            ctx.ranks.set(&full, r);
        }
        out[i] = Some(unbroadcast_unless_same(
            ctx,
            &full,
            x,
            [a, b][1 - i],
            y,
            rank,
        ));
    }
    Ok(out)
}

/// Skips the run-time reduction where the other operand is a scalar (no broadcast of `x`).
fn unbroadcast_unless_same(
    ctx: &mut Ctx,
    g: &str,
    x: &str,
    other: &str,
    y: &str,
    rank: Option<usize>,
) -> String {
    if ctx.ranks.get(other) == Some(0) && ctx.ranks.get(x).is_some() && ctx.ranks.get(x) == rank {
        return g.to_string();
    }
    ctx.unbroadcast_to(g, x, y)
}

/// Max/Min of two inputs: torch's convention, the larger (smaller) input takes the gradient
/// and ties split it.
pub fn max_min(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    wants: &[bool],
) -> Result<Grads, Error> {
    if node.input.len() != 2 {
        return Err(Error::Usage(format!(
            "{} node '{}' has {} inputs; the step graph differentiates Max/Min of two inputs only",
            node.op_type(),
            node.name(),
            node.input.len()
        )));
    }
    let g = g0(node, gy)?;
    let mut out = vec![None, None];
    for i in 0..2 {
        if !wants[i] {
            continue;
        }
        let (x, o) = (node.input[i].as_str(), node.input[1 - i].as_str());
        let cmp = if node.op_type() == "Max" {
            "Greater"
        } else {
            "Less"
        };
        let wins = ctx.op(cmp, &[x, o], "grad/wins");
        let wins = ctx.b.cast(&wins, FLOAT, "grad/wins_f");
        let tie = ctx.b.equal(x, o, "grad/tie");
        let tie = ctx.b.cast(&tie, FLOAT, "grad/tie_f");
        let half = ctx.f32(0.5);
        let tie = ctx.op("Mul", &[&tie, &half], "grad/tie_half");
        let share = ctx.op("Add", &[&wins, &tie], "grad/share");
        let full = ctx.op("Mul", &[g, &share], "grad/max_min");
        out[i] = Some(ctx.unbroadcast_to(&full, x, &node.output[0]));
    }
    Ok(out)
}

/// Sum of n inputs (with broadcasting).
pub fn sum(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    wants: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?.to_string();
    Ok((0..node.input.len())
        .map(|i| wants[i].then(|| ctx.unbroadcast_to(&g, &node.input[i], &node.output[0])))
        .collect())
}

pub fn unary(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?;
    let x = node.input[0].as_str();
    let y = node.output[0].as_str();
    let gx = match node.op_type() {
        "Identity" => g.to_string(),
        "Neg" => ctx.op("Neg", &[g], "grad/neg"),
        "Exp" => ctx.op("Mul", &[g, y], "grad/exp"),
        "Log" => ctx.op("Div", &[g, x], "grad/log"),
        "Sqrt" => {
            let half = ctx.f32(0.5);
            let t = ctx.op("Div", &[&half, y], "grad/sqrt_d");
            ctx.op("Mul", &[g, &t], "grad/sqrt")
        }
        "Tanh" => {
            let one = ctx.f32(1.0);
            let y2 = ctx.op("Mul", &[y, y], "grad/tanh_y2");
            let d = ctx.op("Sub", &[&one, &y2], "grad/tanh_d");
            ctx.op("Mul", &[g, &d], "grad/tanh")
        }
        "Sigmoid" => {
            let one = ctx.f32(1.0);
            let c = ctx.op("Sub", &[&one, y], "grad/sigmoid_c");
            let d = ctx.op("Mul", &[y, &c], "grad/sigmoid_d");
            ctx.op("Mul", &[g, &d], "grad/sigmoid")
        }
        "Erf" => {
            // 2/√π·exp(−x²)
            let x2 = ctx.op("Mul", &[x, x], "grad/erf_x2");
            let n = ctx.op("Neg", &[&x2], "grad/erf_nx2");
            let e = ctx.op("Exp", &[&n], "grad/erf_exp");
            let c = ctx.f32(std::f32::consts::FRAC_2_SQRT_PI);
            let d = ctx.op("Mul", &[&e, &c], "grad/erf_d");
            ctx.op("Mul", &[g, &d], "grad/erf")
        }
        "Relu" => {
            let zero = ctx.f32(0.0);
            let pos = ctx.op("Greater", &[x, &zero], "grad/relu_pos");
            ctx.b.where_(&pos, g, &zero, "grad/relu")
        }
        "Abs" => {
            let s = ctx.op("Sign", &[x], "grad/abs_sign");
            ctx.op("Mul", &[g, &s], "grad/abs")
        }
        "Reciprocal" => {
            let y2 = ctx.op("Mul", &[y, y], "grad/recip_y2");
            let t = ctx.op("Mul", &[g, &y2], "grad/recip_t");
            ctx.op("Neg", &[&t], "grad/recip")
        }
        op => unreachable!("unary rule registered for {op}"),
    };
    like(ctx, gx, x)
}

/// A cast between float types carries the gradient (cast back); a cast to an integer or
/// boolean type stops it (ONNX Runtime's rule, which NTIL's straight-through estimator uses).
pub fn cast_inputs(node: &NodeProto) -> Vec<usize> {
    let to = attr_i(node, "to").map(|t| t as i32);
    match node.op_type() {
        "Cast" if to.is_some_and(is_float_type) => vec![0],
        // CastLike's target type is its second input's: only float targets reach here with a
        // gradient (integer results never receive one).
        "CastLike" => vec![0],
        _ => vec![],
    }
}

pub fn cast(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?;
    let x = node.input[0].as_str();
    // Back to the input's type: a Cast where the type is known, else CastLike(g, x).
    let gx = match ctx.types.get(x) {
        Some(t) => ctx.b.cast(g, t, "grad/cast"),
        None => ctx.op("CastLike", &[g, x], "grad/cast"),
    };
    like(ctx, gx, x)
}

pub fn where_(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    wants: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?;
    let cond = node.input[0].as_str();
    let zero = ctx.f32(0.0);
    let mut out = vec![None, None, None];
    for i in [1, 2] {
        if !wants[i] {
            continue;
        }
        let (a, b) = if i == 1 {
            (g, zero.as_str())
        } else {
            (zero.as_str(), g)
        };
        let full = ctx.b.where_(cond, a, b, "grad/where");
        out[i] = Some(ctx.unbroadcast_to(&full, &node.input[i], &node.output[0]));
    }
    Ok(out)
}

/// Clip passes the gradient where `min ≤ x ≤ max`; the bounds get none (ONNX Runtime's stop
/// edges, which the `scaled` combination's stop-gradient relies on).
pub fn clip(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?;
    let x = node.input[0].as_str();
    let mut keep: Option<String> = None;
    for (k, cmp) in [(1, "GreaterOrEqual"), (2, "LessOrEqual")] {
        if let Some(bound) = node.input.get(k).filter(|n| !n.is_empty()) {
            let c = ctx.op(cmp, &[x, bound], "grad/clip_in");
            keep = Some(match keep {
                Some(prev) => ctx.op("And", &[&prev, &c], "grad/clip_in"),
                None => c,
            });
        }
    }
    let gx = match keep {
        Some(k) => {
            let zero = ctx.f32(0.0);
            ctx.b.where_(&k, g, &zero, "grad/clip")
        }
        None => g.to_string(),
    };
    Ok(vec![Some(gx)])
}

/// Dropout: the gradient is masked and scaled like the forward; with ratio 0 or outside
/// training mode it is the identity.
pub fn dropout(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?;
    let training = node.input.get(2).is_some_and(|n| !n.is_empty());
    let ratio_given = node.input.get(1).is_some_and(|n| !n.is_empty());
    if !training {
        return Ok(vec![Some(g.to_string())]);
    }
    let Some(mask) = node.output.get(1).filter(|m| !m.is_empty()) else {
        return Err(Error::Usage(format!(
            "Dropout node '{}' runs in training mode without a mask output; export with dropout 0 or in eval mode",
            node.name()
        )));
    };
    let m = ctx.b.cast(mask, FLOAT, "grad/dropout_mask");
    let one = ctx.f32(1.0);
    let ratio = if ratio_given {
        node.input[1].clone()
    } else {
        ctx.f32(0.5)
    };
    let keep = ctx.op("Sub", &[&one, &ratio], "grad/dropout_keep");
    let scale = ctx.op("Div", &[&m, &keep], "grad/dropout_scale");
    Ok(vec![Some(ctx.op("Mul", &[g, &scale], "grad/dropout"))])
}

//! MatMul and Gemm.

use super::{g0, Grads};
use crate::error::Error;
use crate::grad::Ctx;
use crate::onnx::{attr, attr_i, float_attr, int_attr, NodeProto};

/// `y = a·b` with numpy broadcasting over the leading (batch) axes.
pub fn matmul(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    wants: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?.to_string();
    let (a, b) = (node.input[0].clone(), node.input[1].clone());
    let (ra, rb) = (ctx.rank(&a, node)?, ctx.rank(&b, node)?);
    if ra == 0 || rb == 0 {
        return Err(Error::MalformedGraph(format!(
            "MatMul node '{}' has a scalar input (MatMul takes tensors of rank 1 or more)",
            node.name()
        )));
    }
    let mut out = vec![None, None];
    if ra == 1 && rb == 1 {
        // dot product: y is a scalar
        if wants[0] {
            out[0] = Some(ctx.op("Mul", &[&g, &b], "grad/dot_a"));
        }
        if wants[1] {
            out[1] = Some(ctx.op("Mul", &[&g, &a], "grad/dot_b"));
        }
        return Ok(out);
    }
    // Vectors become matrices ([K] → [1, K] on the left, [K, 1] on the right) and the output
    // gradient gains the axis the product dropped.
    let (a2, ra2, g2) = if ra == 1 {
        let a2 = ctx.b.unsqueeze(&a, &[0], "grad/mm_a2");
        let g2 = ctx.b.unsqueeze(&g, &[-2], "grad/mm_g2");
        ctx.ranks.set(&g2, rb);
        (a2, 2, g2)
    } else {
        (a.clone(), ra, g.clone())
    };
    let (b2, rb2, g2) = if rb == 1 {
        let b2 = ctx.b.unsqueeze(&b, &[1], "grad/mm_b2");
        let g2 = ctx.b.unsqueeze(&g2, &[-1], "grad/mm_g2");
        ctx.ranks.set(&g2, ra2);
        (b2, 2, g2)
    } else {
        (b.clone(), rb, g2)
    };
    let ry = ra2.max(rb2);
    ctx.ranks.set(&g2, ry);
    ctx.ranks.set(&a2, ra2);
    ctx.ranks.set(&b2, rb2);
    if wants[0] {
        let bt = ctx.swap_last_two(&b2, rb2);
        let full = ctx.op("MatMul", &[&g2, &bt], "grad/mm_a");
        ctx.ranks.set(&full, ry);
        // With a 2-D b, a's batch axes are the output's: nothing to sum.
        let ga = if rb2 == 2 {
            full
        } else {
            ctx.unbroadcast(&full, &a2, Some(ry))
        };
        out[0] = Some(restore(ctx, &ga, &a, ra));
    }
    if wants[1] {
        let gb = if rb2 == 2 && ra2 >= 2 {
            // A weight: sum over every batch axis at once, [K, M·…]·[M·…, N].
            let af = ctx.flatten_to_2d(&a2);
            let gf = ctx.flatten_to_2d(&g2);
            let at = ctx.b.transpose(&af, &[1, 0], "grad/mm_at");
            ctx.op("MatMul", &[&at, &gf], "grad/mm_b")
        } else {
            let at = ctx.swap_last_two(&a2, ra2);
            let full = ctx.op("MatMul", &[&at, &g2], "grad/mm_b");
            ctx.ranks.set(&full, ry);
            ctx.unbroadcast(&full, &b2, Some(ry))
        };
        out[1] = Some(restore(ctx, &gb, &b, rb));
    }
    Ok(out)
}

/// Reshapes a gradient computed for the matrix form back to a vector operand's shape.
fn restore(ctx: &mut Ctx, g: &str, x: &str, rank: usize) -> String {
    if rank != 1 {
        return g.to_string();
    }
    let s = ctx.shape(x);
    ctx.op("Reshape", &[g, &s], "grad/mm_vec")
}

/// `y = alpha·op(a)·op(b) + beta·c`.
pub fn gemm(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    wants: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?.to_string();
    let (a, b) = (node.input[0].as_str(), node.input[1].as_str());
    let alpha = attr(node, "alpha").map(|x| x.f()).unwrap_or(1.0);
    let beta = attr(node, "beta").map(|x| x.f()).unwrap_or(1.0);
    let ta = attr_i(node, "transA").unwrap_or(0);
    let tb = attr_i(node, "transB").unwrap_or(0);
    let gemm = |ctx: &mut Ctx, x: &str, y: &str, tx: i64, ty: i64| {
        ctx.b.node(
            "Gemm",
            &[x, y],
            "grad/gemm",
            vec![
                float_attr("alpha", alpha),
                int_attr("transA", tx),
                int_attr("transB", ty),
            ],
        )
    };
    let mut out = vec![None; node.input.len()];
    if wants[0] {
        out[0] = Some(if ta == 0 {
            gemm(ctx, &g, b, 0, 1 - tb)
        } else {
            gemm(ctx, b, &g, tb, 1)
        });
    }
    if wants[1] {
        out[1] = Some(if tb == 0 {
            gemm(ctx, a, &g, 1 - ta, 0)
        } else {
            gemm(ctx, &g, a, 1, ta)
        });
    }
    if wants.get(2).copied().unwrap_or(false) {
        let c = node.input[2].as_str();
        let scaled = if beta == 1.0 {
            g.clone()
        } else {
            let k = ctx.f32(beta);
            ctx.op("Mul", &[&g, &k], "grad/gemm_c")
        };
        ctx.ranks.set(&scaled, 2);
        out[2] = Some(ctx.unbroadcast_to(&scaled, c, &node.output[0]));
    }
    Ok(out)
}

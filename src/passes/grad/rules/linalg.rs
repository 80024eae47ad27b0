//! MatMul, Gemm and Einsum.

use super::{g0, Grads};
use crate::error::Error;
use crate::onnx::{attr, attr_i, float_attr, int_attr, NodeProto};
use crate::passes::grad::Ctx;

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
            if ctx.weight_grads_by_gemm {
                // Gemm's transA rather than Transpose + MatMul: onnxruntime fuses that pair
                // into a node it adds last, which its PRIORITY_BASED order (recompute graphs)
                // runs at the end of the backward, keeping every flattened activation alive
                ctx.b.node(
                    "Gemm",
                    &[&af, &gf],
                    "grad/mm_b",
                    vec![int_attr("transA", 1)],
                )
            } else {
                let at = ctx.b.transpose(&af, &[1, 0], "grad/mm_at");
                ctx.op("MatMul", &[&at, &gf], "grad/mm_b")
            }
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

/// Einsum: operand k's gradient is the einsum of the other operands and `g`, written to k's
/// subscripts; a subscript only k has (the forward summed it) is broadcast back, and an
/// ellipsis the forward broadcast is summed back to k's shape.
pub fn einsum(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    wants: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?.to_string();
    let written = attr(node, "equation")
        .map(|a| String::from_utf8_lossy(a.s()).into_owned())
        .unwrap_or_default();
    let refuse = |why: &str| {
        Error::Usage(format!(
            "Einsum node '{}' ('{written}'): {why}; the step graph differentiates einsums whose equation fits the operands and names each subscript once per operand",
            node.name()
        ))
    };
    let eq: String = written.chars().filter(|c| !c.is_whitespace()).collect();
    if eq.is_empty() {
        return Err(refuse("it has no equation"));
    }
    let (lhs, out) = match eq.split_once("->") {
        Some((l, o)) => (l.to_string(), o.to_string()),
        None => (eq.clone(), implicit_einsum_output(&eq)),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != node.input.len() {
        return Err(refuse("the equation names a different number of operands"));
    }
    for t in terms.iter().chain([&out.as_str()]) {
        let l = subscripts(t);
        let distinct: std::collections::BTreeSet<&char> = l.iter().collect();
        if distinct.len() != l.len() || l.iter().any(|c| !c.is_ascii_alphabetic()) {
            return Err(refuse(
                "a subscript repeats within one operand (or is not a letter)",
            ));
        }
        if t.matches("...").count() > 1 || t.replace("...", "").contains('.') {
            return Err(refuse("malformed ellipsis"));
        }
    }
    for (term, x) in terms.iter().zip(&node.input) {
        let letters = subscripts(term).len();
        let fits = |rank: usize| match term.contains("...") {
            true => letters <= rank,
            false => letters == rank,
        };
        if ctx.ranks.get(x).is_some_and(|r| !fits(r)) {
            return Err(refuse("the equation does not match the rank of an operand"));
        }
    }
    let mut grads = vec![None; terms.len()];
    for k in (0..terms.len()).filter(|&k| wants[k]) {
        let term = terms[k];
        let others: Vec<usize> = (0..terms.len()).filter(|&i| i != k).collect();
        let seen: std::collections::BTreeSet<char> = others
            .iter()
            .flat_map(|&i| subscripts(terms[i]))
            .chain(subscripts(&out))
            .collect();
        if term.contains("...") && !out.contains("...") {
            return Err(refuse("the forward sums over the ellipsis"));
        }
        // output axes of the subscripts only this operand has: positive before an ellipsis,
        // counted from the end after it
        let (head, tail) = term.split_once("...").unwrap_or((term, ""));
        let mut lonely: Vec<i64> = Vec::new();
        for (j, c) in head.chars().enumerate() {
            if !seen.contains(&c) {
                lonely.push(j as i64);
            }
        }
        let tail_len = tail.chars().count() as i64;
        for (j, c) in tail.chars().enumerate() {
            if !seen.contains(&c) {
                lonely.push(j as i64 - tail_len);
            }
        }
        let kept: String = term
            .chars()
            .filter(|c| *c == '.' || seen.contains(c))
            .collect();
        let mut operands: Vec<&str> = others.iter().map(|&i| terms[i]).collect();
        operands.push(&out);
        let equation = format!("{}->{kept}", operands.join(","));
        let mut inputs: Vec<&str> = others.iter().map(|&i| node.input[i].as_str()).collect();
        inputs.push(&g);
        let x = node.input[k].as_str();
        let mut gx = ctx.b.node(
            "Einsum",
            &inputs,
            "grad/einsum",
            vec![crate::onnx::string_attr("equation", &equation)],
        );
        if !lonely.is_empty() {
            let u = ctx.b.unsqueeze(&gx, &lonely, "grad/einsum_lonely");
            let shape = ctx.shape(x);
            gx = ctx.op("Expand", &[&u, &shape], "grad/einsum_expand");
        }
        if term.contains("...") {
            let rank = ctx.rank(x, node)?;
            gx = ctx.unbroadcast(&gx, x, Some(rank));
        }
        if let Some(r) = ctx.ranks.get(x) {
            ctx.ranks.set(&gx, r);
        }
        grads[k] = Some(gx);
    }
    Ok(grads)
}

/// The letters of one einsum operand, without its ellipsis.
fn subscripts(term: &str) -> Vec<char> {
    term.chars().filter(|&c| c != '.').collect()
}

/// numpy's implicit output: the ellipsis, then the subscripts used once, alphabetically.
fn implicit_einsum_output(lhs: &str) -> String {
    let all = subscripts(&lhs.replace(',', ""));
    let mut once: Vec<char> = all
        .iter()
        .copied()
        .filter(|c| all.iter().filter(|d| *d == c).count() == 1)
        .collect();
    once.sort_unstable();
    let ellipsis = if lhs.contains("...") { "..." } else { "" };
    format!("{ellipsis}{}", once.into_iter().collect::<String>())
}

#[cfg(test)]
mod tests {
    use super::implicit_einsum_output;

    #[test]
    fn implicit_output_is_numpys() {
        assert_eq!(implicit_einsum_output("ij,jk"), "ik");
        assert_eq!(implicit_einsum_output("ba,ca"), "bc");
        assert_eq!(implicit_einsum_output("...ij,...jk"), "...ik");
        assert_eq!(implicit_einsum_output("ii"), "");
    }
}

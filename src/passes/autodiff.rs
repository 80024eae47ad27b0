//! Reverse-mode differentiation of the subgraphs ntl-patch emits, for artifacts mode: given
//! the forward nodes of a number loss, emit the nodes of d(loss)/d(logits).
//!
//! Only the ops the loss builders use are supported, and only with the shapes they use them
//! with: a differentiable input of an elementwise op always has the output's shape (broadcast
//! inputs are label-side constants). The result at the logits is kept sparse where it can be:
//! a `Gather(logits, ids, axis=1)` contributes `[M, K]` values for the K gathered columns,
//! which the caller scatters into the existing cross-entropy gradient instead of building
//! another dense `[M, V]` tensor.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::Error;
use crate::onnx::{attr_i, attr_ints, int_attr, NodeProto, FLOAT};

use ntl_ops::Builder;

/// The gradient of the loss at the logits, by kind of use.
#[derive(Debug, Default)]
pub struct LogitsGradient {
    /// `(ids, values)`: `d loss / d logits[:, ids]` as `[M, K]`, one per Gather of the logits.
    pub sparse: Vec<(String, String)>,
    /// Dense `[M, V]` contributions (only from losses that read the whole row, e.g. reweigh).
    pub dense: Vec<String>,
}

/// Emits `d loss / d wrt` for the `forward` nodes, seeded with `seed` (a scalar).
pub fn differentiate(
    b: &mut Builder,
    forward: &[NodeProto],
    loss: &str,
    seed: &str,
    wrt: &str,
) -> Result<LogitsGradient, Error> {
    let live = differentiable_tensors(forward, wrt);
    let mut grads: BTreeMap<String, Vec<String>> = BTreeMap::new();
    grads.insert(loss.to_string(), vec![seed.to_string()]);
    let mut result = LogitsGradient::default();

    for node in forward.iter().rev() {
        let Some(out) = node.output.first() else {
            continue;
        };
        let Some(parts) = grads.remove(out) else {
            continue;
        };
        let g = sum(b, parts, out);
        let inputs: Vec<(usize, &str)> = differentiable_inputs(node)
            .into_iter()
            .filter_map(|i| node.input.get(i).map(|n| (i, n.as_str())))
            .filter(|(_, n)| live.contains(*n))
            .collect();
        for (i, x) in inputs {
            if x == wrt {
                match node.op_type() {
                    "Gather" => result.sparse.push((node.input[1].clone(), g.clone())),
                    "Softmax" => result.dense.push(softmax_vjp(b, node, &g)),
                    op => return Err(unsupported(op, "reads the logits directly")),
                }
                continue;
            }
            let gx = vjp(b, node, i, &g)?;
            grads.entry(x.to_string()).or_default().push(gx);
        }
    }
    Ok(result)
}

/// Tensors that depend on `wrt` through differentiable edges.
fn differentiable_tensors(forward: &[NodeProto], wrt: &str) -> BTreeSet<String> {
    let mut live = BTreeSet::from([wrt.to_string()]);
    for node in forward {
        let feeds = differentiable_inputs(node)
            .into_iter()
            .any(|i| node.input.get(i).is_some_and(|n| live.contains(n)));
        if feeds {
            live.extend(node.output.iter().cloned());
        }
    }
    live
}

/// Input positions a gradient flows through (the same stop edges as ONNX Runtime's builder).
fn differentiable_inputs(node: &NodeProto) -> Vec<usize> {
    match node.op_type() {
        "Add" | "Sub" | "Mul" | "Div" | "Max" | "Min" | "MatMul" => vec![0, 1],
        "Where" => vec![1, 2],
        "Cast" if attr_i(node, "to") == Some(FLOAT as i64) => vec![0],
        "Gather" | "Softmax" | "Abs" | "Neg" | "Log" | "Identity" | "Squeeze" | "Unsqueeze"
        | "Reshape" | "ReduceSum" | "ReduceMean" | "Pow" | "Transpose" => vec![0],
        _ => vec![],
    }
}

fn unsupported(op: &str, why: &str) -> Error {
    Error::Inconsistent(format!("artifacts mode cannot differentiate {op} ({why})"))
}

fn sum(b: &mut Builder, mut parts: Vec<String>, of: &str) -> String {
    let mut acc = parts.remove(0);
    for p in parts {
        acc = b.binary("Add", &acc, &p, &grad_name(of));
    }
    acc
}

fn grad_name(tensor: &str) -> String {
    format!("grad/{}", tensor.trim_start_matches("ntl/"))
}

/// `d loss / d input[i]` of one node, given `g = d loss / d output`.
fn vjp(b: &mut Builder, node: &NodeProto, i: usize, g: &str) -> Result<String, Error> {
    let x = node.input[i].as_str();
    let other = |k: usize| node.input[k].as_str();
    let y = node.output[0].as_str();
    let h = grad_name(x);
    Ok(match node.op_type() {
        "Add" | "Identity" | "Cast" => b.unary("Identity", g, &h),
        "Sub" if i == 0 => b.unary("Identity", g, &h),
        "Sub" | "Neg" => b.unary("Neg", g, &h),
        "Mul" => b.binary("Mul", g, other(1 - i), &h),
        "Div" if i == 0 => b.binary("Div", g, other(1), &h),
        "Div" => {
            // d(a/b)/db = −(a/b)/b
            let t = b.binary("Mul", g, y, &format!("{h}_gy"));
            let t = b.binary("Div", &t, other(1), &format!("{h}_gyb"));
            b.unary("Neg", &t, &h)
        }
        "Max" | "Min" => {
            // torch's convention: the larger (smaller) input takes the gradient, ties split it.
            let cmp = if node.op_type() == "Max" {
                "Greater"
            } else {
                "Less"
            };
            let wins = b.binary(cmp, x, other(1 - i), &format!("{h}_wins"));
            let wins = b.cast(&wins, FLOAT, &format!("{h}_wins_f"));
            let tie = b.equal(x, other(1 - i), &format!("{h}_tie"));
            let tie = b.cast(&tie, FLOAT, &format!("{h}_tie_f"));
            let half = b.scalar_f32(&format!("{h}_half"), 0.5);
            let tie = b.binary("Mul", &tie, &half, &format!("{h}_tie_half"));
            let share = b.binary("Add", &wins, &tie, &format!("{h}_share"));
            b.binary("Mul", g, &share, &h)
        }
        "Abs" => {
            let s = b.unary("Sign", x, &format!("{h}_sign"));
            b.binary("Mul", g, &s, &h)
        }
        "Log" => b.binary("Div", g, x, &h),
        "Pow" => {
            // x^c with a constant exponent c: c·x^(c−1)
            let c = other(1);
            let one = b.scalar_f32(&format!("{h}_one"), 1.0);
            let c1 = b.binary("Sub", c, &one, &format!("{h}_c1"));
            let p = b.binary("Pow", x, &c1, &format!("{h}_pow"));
            let p = b.binary("Mul", &p, c, &format!("{h}_dpow"));
            b.binary("Mul", g, &p, &h)
        }
        "Where" => {
            let zero = b.scalar_f32(&format!("{h}_zero"), 0.0);
            let (a, c) = if i == 1 {
                (g, zero.as_str())
            } else {
                (zero.as_str(), g)
            };
            b.where_(other(0), a, c, &h)
        }
        "Softmax" => softmax_vjp(b, node, g),
        "Gather" if attr_i(node, "axis") == Some(1) => {
            // Gathered columns of a dense [M, V] tensor (reweigh's full softmax): scatter back.
            let shape = b.node("Shape", &[x], &format!("{h}_shape"), vec![]);
            let zero = crate::onnx::f32_tensor("value", &[1], &[0.0]);
            let zeros = b.node(
                "ConstantOfShape",
                &[&shape],
                &format!("{h}_zeros"),
                vec![crate::onnx::tensor_attr("value", zero)],
            );
            let gshape = b.node("Shape", &[g], &format!("{h}_gshape"), vec![]);
            let idx = b.node("Expand", &[other(1), &gshape], &format!("{h}_idx"), vec![]);
            b.node(
                "ScatterElements",
                &[&zeros, &idx, g],
                &h,
                vec![int_attr("axis", 1)],
            )
        }
        "Squeeze" | "Unsqueeze" | "Reshape" => {
            let shape = b.node("Shape", &[x], &format!("{h}_shape"), vec![]);
            b.node("Reshape", &[g, &shape], &h, vec![])
        }
        "ReduceSum" | "ReduceMean" => reduce_vjp(b, node, g, &h)?,
        "MatMul" if i == 1 => {
            // y = S·x with S label-side: dx = Sᵀ·g (batched over leading dims).
            let s = other(0);
            let st = b.transpose(s, &[0, 2, 1], &format!("{h}_st"));
            b.binary("MatMul", &st, g, &h)
        }
        "Transpose" => {
            let perm = attr_ints(node, "perm").unwrap_or_default();
            let mut inverse = vec![0; perm.len()];
            for (k, &p) in perm.iter().enumerate() {
                inverse[p as usize] = k as i64;
            }
            b.transpose(g, &inverse, &h)
        }
        op => return Err(unsupported(op, "no gradient rule")),
    })
}

/// `dx = y ⊙ (g − Σ_axis g ⊙ y)` for `y = softmax(x)`.
fn softmax_vjp(b: &mut Builder, node: &NodeProto, g: &str) -> String {
    let y = node.output[0].as_str();
    let axis = attr_i(node, "axis").unwrap_or(-1);
    let h = grad_name(&node.input[0]);
    let gy = b.binary("Mul", g, y, &format!("{h}_gy"));
    let s = b.reduce_sum(&gy, &[axis], true, &format!("{h}_gy_sum"));
    let d = b.binary("Sub", g, &s, &format!("{h}_centered"));
    b.binary("Mul", y, &d, &h)
}

/// Broadcast the reduced gradient back over the reduced axes.
fn reduce_vjp(b: &mut Builder, node: &NodeProto, g: &str, h: &str) -> Result<String, Error> {
    let x = node.input[0].as_str();
    let keepdims = attr_i(node, "keepdims").unwrap_or(1) != 0;
    let axes = node.input.get(1).filter(|a| !a.is_empty());
    let g = match (keepdims, axes) {
        (true, _) | (false, None) => g.to_string(),
        (false, Some(axes)) => b.node("Unsqueeze", &[g, axes], &format!("{h}_kept"), vec![]),
    };
    let shape = b.node("Shape", &[x], &format!("{h}_shape"), vec![]);
    let mut g = b.node("Expand", &[&g, &shape], h, vec![]);
    if node.op_type() == "ReduceMean" {
        if axes.is_some() || attr_ints(node, "axes").is_some() {
            return Err(unsupported("ReduceMean", "over some axes"));
        }
        let n = b.node("Size", &[x], &format!("{h}_count"), vec![]);
        let n = b.cast(&n, FLOAT, &format!("{h}_count_f"));
        g = b.binary("Div", &g, &n, &format!("{h}_mean"));
    }
    Ok(g)
}

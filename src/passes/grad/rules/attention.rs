//! Blockwise attention's gradient (`passes/attention`): one internal `BlockAttentionGrad` node
//! that `attention::lower` expands into a `Scan` recomputing each block's probabilities.

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
    let full: Vec<String> = ["grad/attention_q", "grad/attention_kt", "grad/attention_v"]
        .iter()
        .map(|hint| {
            let name = ctx.b.fresh(hint);
            ctx.ranks.set(&name, a.rank);
            name
        })
        .collect();
    let name = ctx.b.fresh(BACKWARD);
    let outputs = [full[0].as_str(), full[1].as_str(), full[2].as_str()];
    ctx.b.nodes.push(a.backward_node(&name, &g, outputs));
    let same = same_batch(ctx, &a);
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

/// Whether the query, keys and values provably share their batch axes (nothing to sum).
fn same_batch(ctx: &Ctx, a: &Attn) -> bool {
    use crate::graph::shapes::Dim;
    let shapes = [&a.q, &a.kt, &a.v].map(|x| ctx.shapes.get(x));
    let [Some(q), Some(k), Some(v)] = shapes else {
        return false;
    };
    let r = a.rank;
    if q.len() != r || k.len() != r || v.len() != r {
        return false;
    }
    (0..r - 2).all(|i| q[i] != Dim::Unknown && q[i] == k[i] && q[i] == v[i])
}

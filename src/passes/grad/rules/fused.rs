//! The fused LM head's gradient (`passes/fused_head`): one internal `FusedHeadLossGrad` node
//! that `fused_head::lower` expands into a `Scan` recomputing each chunk's logits.

use super::Grads;
use crate::error::Error;
use crate::onnx::NodeProto;
use crate::passes::fused_head::node::{Head, BACKWARD, DOMAIN};
use crate::passes::grad::Ctx;

/// Gradients flow to the hidden states, the weight and the bias.
pub fn inputs(_: &NodeProto) -> Vec<usize> {
    vec![0, 1, 2]
}

pub fn fused_head(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    wants: &[bool],
) -> Result<Grads, Error> {
    super::internal(node, DOMAIN, "fused head")?;
    let head = Head::of(node);
    // the forward's lse, then one upstream gradient per output (zeros where none arrived)
    let mut grads = vec![node.output[0].clone()];
    // Each upstream gradient in its output's shape — [N] or [N, K], N read from the labels, not
    // from the output (so the gradients need not wait for the forward: `lower` may then compute
    // both in one pass). A gradient summed by a run-time unbroadcast has no static shape, which
    // a Scan input needs (tract refuses the body otherwise).
    let positions = ctx.shape(&head.labels);
    let cols: Vec<String> = head.id_counts.iter().map(|&k| ctx.i64s(&[k])).collect();
    for (k, g) in gy.iter().enumerate() {
        let shape = match k.checked_sub(2).and_then(|j| cols.get(j)) {
            Some(c) => ctx.b.concat(&[&positions, c], 0, "grad/fused_cols_shape"),
            None => positions.clone(),
        };
        grads.push(match g {
            Some(g) => {
                let g = ctx.op("Reshape", &[g, &shape], "grad/fused_upstream");
                ctx.b.cast(&g, crate::onnx::FLOAT, "grad/fused_upstream_f")
            }
            None => ctx.zeros(&shape),
        });
    }
    let mut outputs = Vec::new();
    for (k, (hint, rank)) in [
        ("grad/fused_hidden", 2),
        ("grad/fused_weight", 2),
        ("grad/fused_bias", 1),
    ]
    .into_iter()
    .enumerate()
    {
        let wanted = wants.get(k).copied().unwrap_or(false) && !node.input[k].is_empty();
        outputs.push(if wanted {
            let name = ctx.b.fresh(hint);
            ctx.ranks.set(&name, rank);
            name
        } else {
            String::new()
        });
    }
    let name = ctx.b.fresh(BACKWARD);
    ctx.b
        .nodes
        .push(head.backward_node(&name, grads, outputs.clone()));
    let mut gx: Grads = outputs
        .into_iter()
        .map(|o| (!o.is_empty()).then_some(o))
        .collect();
    gx.resize(node.input.len(), None);
    Ok(gx)
}

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
    if node.domain() != DOMAIN {
        return Err(Error::Inconsistent(format!(
            "node '{}' of domain '{}' is named like ntl-patch's fused head",
            node.name(),
            node.domain()
        )));
    }
    let head = Head::of(node);
    // the forward's lse, then one upstream gradient per output (zeros where none arrived)
    let mut grads = vec![node.output[0].clone()];
    for (k, g) in gy.iter().enumerate() {
        let out = &node.output[k];
        grads.push(match g {
            // in the output's own shape: a gradient summed by a run-time unbroadcast has no
            // static shape, which a Scan input needs (tract refuses the body otherwise)
            Some(g) => {
                let shape = ctx.shape(out);
                let g = ctx.op("Reshape", &[g, &shape], "grad/fused_upstream");
                ctx.b.cast(&g, crate::onnx::FLOAT, "grad/fused_upstream_f")
            }
            None => ctx.zeros_like(out),
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

//! ReduceSum and ReduceMean: the gradient is spread back over the reduced axes.

use super::{like, Grads};
use crate::error::Error;
use crate::grad::Ctx;
use crate::onnx::{attr_i, attr_ints, NodeProto, FLOAT};

pub fn reduce(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let g = gy[0].clone().expect("gradient");
    let x = node.input[0].as_str();
    let y = node.output[0].as_str();
    let keepdims = attr_i(node, "keepdims").unwrap_or(1) != 0;
    let axes_input = node.input.get(1).filter(|a| !a.is_empty()).cloned();
    let axes_attr = attr_ints(node, "axes");
    let no_axes = axes_input.is_none() && axes_attr.as_ref().is_none_or(|a| a.is_empty());
    if no_axes && attr_i(node, "noop_with_empty_axes").unwrap_or(0) != 0 {
        return Ok(vec![Some(g)]);
    }
    let kept = if keepdims || no_axes {
        g
    } else {
        let axes = match (axes_input, axes_attr) {
            (Some(a), _) => a,
            (None, Some(a)) => ctx.i64s(&a),
            (None, None) => unreachable!("no_axes handled above"),
        };
        ctx.op("Unsqueeze", &[&g, &axes], "grad/reduce_kept")
    };
    let shape = ctx.shape(x);
    let mut gx = ctx.op("Expand", &[&kept, &shape], "grad/reduce");
    if node.op_type() == "ReduceMean" {
        let nx = ctx.op("Size", &[x], "grad/mean_nx");
        let ny = ctx.op("Size", &[y], "grad/mean_ny");
        let nx = ctx.b.cast(&nx, FLOAT, "grad/mean_nx_f");
        let ny = ctx.b.cast(&ny, FLOAT, "grad/mean_ny_f");
        let count = ctx.op("Div", &[&nx, &ny], "grad/mean_count");
        gx = ctx.op("Div", &[&gx, &count], "grad/reduce_mean");
    }
    like(ctx, gx, x)
}

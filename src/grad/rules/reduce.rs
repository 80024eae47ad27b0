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
    let keepdims = attr_i(node, "keepdims").unwrap_or(1) != 0;
    let axes_input = node.input.get(1).filter(|a| !a.is_empty()).cloned();
    let axes_attr = attr_ints(node, "axes");
    let no_axes = axes_input.is_none() && axes_attr.as_ref().is_none_or(|a| a.is_empty());
    if no_axes && attr_i(node, "noop_with_empty_axes").unwrap_or(0) != 0 {
        return Ok(vec![Some(g)]);
    }
    let axes = match (axes_input, axes_attr) {
        (Some(a), _) => Some(a),
        (None, Some(a)) if !a.is_empty() => Some(ctx.i64s(&a)),
        _ => None,
    };
    let kept = match &axes {
        Some(axes) if !keepdims => ctx.op("Unsqueeze", &[&g, axes], "grad/reduce_kept"),
        _ => g,
    };
    let shape = ctx.shape(x);
    let mut gx = ctx.op("Expand", &[&kept, &shape], "grad/reduce");
    if node.op_type() == "ReduceMean" {
        // how many elements each mean averaged: the product of the reduced dims, from the shape
        // (no Size: MIGraphX takes none)
        let reduced = match &axes {
            Some(axes) => ctx.b.gather(&shape, axes, 0, "grad/mean_dims"),
            None => shape.clone(),
        };
        let reduced = ctx.b.cast(&reduced, FLOAT, "grad/mean_dims_f");
        let count = ctx.b.node(
            "ReduceProd",
            &[&reduced],
            "grad/mean_count",
            vec![crate::onnx::int_attr("keepdims", 0)],
        );
        gx = ctx.op("Div", &[&gx, &count], "grad/reduce_mean");
    }
    like(ctx, gx, x)
}

//! Layout ops: the gradient is the forward's layout change undone (reshape, transpose,
//! slice, concat, split), summed where the forward copied (expand, tile, gather).

use super::{g0, like, ranked_like, Grads};
use crate::error::Error;
use crate::onnx::{attr_i, attr_ints, int_attr, string_attr, NodeProto};
use crate::passes::grad::Ctx;

/// Reshape, Squeeze, Unsqueeze, Flatten: back to the input's shape.
pub fn reshape(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let x = node.input[0].as_str();
    let s = ctx.shape(x);
    let gx = ctx.op("Reshape", &[g0(node, gy)?, &s], "grad/reshape");
    like(ctx, gx, x)
}

pub fn transpose(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let perm = match attr_ints(node, "perm") {
        Some(p) => p,
        None => (0..ctx.rank(&node.input[0], node)? as i64).rev().collect(),
    };
    let mut inverse = vec![0i64; perm.len()];
    for (k, &p) in perm.iter().enumerate() {
        let slot = usize::try_from(p).ok().and_then(|p| inverse.get_mut(p));
        match slot {
            Some(s) => *s = k as i64,
            None => {
                return Err(Error::MalformedGraph(format!(
                    "Transpose node '{}' has an invalid perm",
                    node.name()
                )))
            }
        }
    }
    let gx = ctx.b.transpose(g0(node, gy)?, &inverse, "grad/transpose");
    ctx.ranks.set(&gx, perm.len());
    Ok(vec![Some(gx)])
}

pub fn expand(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    Ok(vec![Some(ctx.unbroadcast_to(
        g0(node, gy)?,
        &node.input[0],
        &node.output[0],
    ))])
}

/// The gradient lands where the slice read: the same Slice applied to the flat element
/// indices of the input says where, and a ScatterElements puts it there.
pub fn slice(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let x = node.input[0].as_str();
    if let Some(gx) = slice_by_pad(ctx, node, g0(node, gy)?)? {
        return like(ctx, gx, x);
    }
    let n = ctx.op("Size", &[x], "grad/slice_n");
    let zero = ctx.b.const_i64("grad/c", &[], &[0]);
    let one = ctx.b.const_i64("grad/c", &[], &[1]);
    let flat_idx = ctx.op("Range", &[&zero, &n, &one], "grad/slice_flat_idx");
    let shape = ctx.shape(x);
    let idx = ctx.op("Reshape", &[&flat_idx, &shape], "grad/slice_idx");
    let mut inputs: Vec<&str> = vec![&idx];
    inputs.extend(node.input.iter().skip(1).map(|s| s.as_str()));
    let picked = ctx.b.node("Slice", &inputs, "grad/slice_picked", vec![]);
    let minus_one = ctx.i64s(&[-1]);
    let picked = ctx.op("Reshape", &[&picked, &minus_one], "grad/slice_picked_flat");
    let g = ctx.op("Reshape", &[g0(node, gy)?, &minus_one], "grad/slice_g_flat");
    let one_d = ctx.i64s(&[1]);
    let n1 = ctx.op("Reshape", &[&n, &one_d], "grad/slice_n_1d");
    let zeros = ctx.zeros(&n1);
    let flat = ctx.b.node(
        "ScatterElements",
        &[&zeros, &picked, &g],
        "grad/slice_flat",
        vec![int_attr("axis", 0)],
    );
    let gx = ctx.op("Reshape", &[&flat, &shape], "grad/slice");
    like(ctx, gx, x)
}

/// A unit-step Slice's gradient is the output gradient padded back with zeros, `Pad(g, pads)`,
/// where the pads are constants: the bounds are constants and, on each sliced axis, either the
/// dim is known or the slice keeps the whole axis (`0:` to the end). ONNX's clamping is done
/// here. No `Size`/`Range` over run-time sizes (MIGraphX takes none), and nothing tract's shape
/// analysis cannot follow. None otherwise: the flat-index form is used then.
fn slice_by_pad(ctx: &mut Ctx, node: &NodeProto, g: &str) -> Result<Option<String>, Error> {
    use crate::graph::shapes::{Dim, SLICE_TO_THE_END};
    let known = |k: usize| -> Option<Vec<i64>> {
        ctx.shapes
            .known_ints(node.input.get(k).filter(|t| !t.is_empty())?)
    };
    let x = node.input[0].as_str();
    let (Some(r), Some(starts), Some(ends)) = (ctx.ranks.get(x), known(1), known(2)) else {
        return Ok(None);
    };
    if starts.len() != ends.len() {
        return Ok(None);
    }
    let axes: Vec<i64> = match node.input.get(3).filter(|a| !a.is_empty()) {
        None => (0..starts.len() as i64).collect(),
        Some(_) => match known(3) {
            Some(v) if v.len() == starts.len() => v
                .into_iter()
                .map(|a| if a < 0 { a + r as i64 } else { a })
                .collect(),
            _ => return Ok(None),
        },
    };
    let unit_steps = match node.input.get(4).filter(|s| !s.is_empty()) {
        None => true,
        Some(_) => known(4).is_some_and(|v| v.iter().all(|&s| s == 1)),
    };
    if !unit_steps || axes.iter().any(|&a| !(0..r as i64).contains(&a)) {
        return Ok(None);
    }
    let shape = ctx.shapes.get(x).cloned().unwrap_or_default();
    let mut pads = vec![0i64; 2 * r];
    for ((&a, &s), &e) in axes.iter().zip(&starts).zip(&ends) {
        match shape.get(a as usize) {
            Some(Dim::Known(d)) => {
                let d = *d;
                let clamp = |v: i64| (if v < 0 { v.saturating_add(d) } else { v }).clamp(0, d);
                let (s, e) = (clamp(s), clamp(e));
                let len = (e - s).max(0);
                pads[a as usize] = s;
                pads[r + a as usize] = d - s - len;
            }
            // the whole axis, whatever its size
            _ if s == 0 && e >= SLICE_TO_THE_END => {}
            _ => return Ok(None),
        }
    }
    if pads.iter().all(|&p| p == 0) {
        // the slice keeps every element (exporters write `x[:, :]` so): its gradient is `g`
        return Ok(Some(g.to_string()));
    }
    let constant = ctx.i64s(&pads);
    let padded = ctx.b.node("Pad", &[g, &constant], "grad/slice", vec![]);
    // a slice along one axis: where the input's slices tile it, their gradients are joined
    let padded_axes: Vec<usize> = (0..r)
        .filter(|&a| pads[a] != 0 || pads[r + a] != 0)
        .collect();
    if let [axis] = padded_axes[..] {
        if let Some(&Dim::Known(dim)) = shape.get(axis) {
            let part = crate::passes::grad::slice_parts::SlicePart {
                of: g.to_string(),
                axis,
                start: pads[axis],
                end: dim - pads[r + axis],
                dim,
                pads: constant,
            };
            ctx.slice_parts.record(&padded, part);
        }
    }
    Ok(Some(padded))
}

/// Each input's part of the output gradient, sliced along the concat axis.
pub fn concat(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    wants: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?.to_string();
    let axis = attr_i(node, "axis").unwrap_or(0);
    let axis_t = ctx.i64s(&[axis]);
    let mut start = ctx.i64s(&[0]);
    let mut out = vec![None; node.input.len()];
    for (i, x) in node.input.iter().enumerate() {
        let s = ctx.shape(x);
        let len = ctx.b.gather(&s, &axis_t, 0, "grad/concat_len");
        let end = ctx.op("Add", &[&start, &len], "grad/concat_end");
        if wants[i] {
            let part = ctx
                .b
                .node("Slice", &[&g, &start, &end, &axis_t], "grad/concat", vec![]);
            if let Some(r) = ctx.ranks.get(x) {
                ctx.ranks.set(&part, r);
            }
            out[i] = Some(part);
        }
        start = end;
    }
    Ok(out)
}

/// The output gradients concatenated back (zeros for outputs no gradient reached).
pub fn split(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let axis = attr_i(node, "axis").unwrap_or(0);
    let parts: Vec<String> = node
        .output
        .iter()
        .zip(gy)
        .map(|(o, g)| match g {
            Some(g) => g.clone(),
            None => ctx.zeros_like(o),
        })
        .collect();
    let refs: Vec<&str> = parts.iter().map(|s| s.as_str()).collect();
    let gx = ctx.b.concat(&refs, axis, "grad/split");
    like(ctx, gx, &node.input[0])
}

/// ScatterElements / ScatterND (a MoE layer's `index_add_` into zeros, as Mixtral's TorchScript
/// export writes it): each update's gradient is the output's where it was written
/// (GatherElements / GatherND); the data's is the output's, but 0 where an update overwrote it
/// (reduction `none`; with `add` the data passes through). `mul`, `max` and `min` have no rule.
pub fn scatter(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    wants: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?.to_string();
    let (data, idx, updates) = (&node.input[0], &node.input[1], &node.input[2]);
    let reduction = crate::onnx::attr_s(node, "reduction").unwrap_or_else(|| "none".into());
    if !matches!(reduction.as_str(), "none" | "add") {
        return Err(Error::Usage(format!(
            "{} node '{}' scatters with reduction '{reduction}': ntl-patch differentiates reduction none and add only; freeze the parameters before it with --freeze PREFIX or re-export the model without it",
            node.op_type(),
            node.name()
        )));
    }
    let elements = node.op_type() == "ScatterElements";
    let axis = || vec![int_attr("axis", attr_i(node, "axis").unwrap_or(0))];
    let attrs = || if elements { axis() } else { vec![] };
    let mut gx: Grads = vec![None; node.input.len()];
    if wants.first().copied().unwrap_or(false) {
        let g_data = if reduction == "add" {
            g.clone()
        } else {
            let zeros = ctx.zeros_like(updates);
            ctx.b.node(
                node.op_type(),
                &[&g, idx, &zeros],
                "grad/scatter_data",
                attrs(),
            )
        };
        gx[0] = Some(ranked_like(ctx, g_data, data));
    }
    if wants.get(2).copied().unwrap_or(false) {
        let gather = if elements {
            "GatherElements"
        } else {
            "GatherND"
        };
        let g_updates = ctx
            .b
            .node(gather, &[&g, idx], "grad/scatter_updates", attrs());
        gx[2] = Some(ranked_like(ctx, g_updates, updates));
    }
    Ok(gx)
}

/// Gather / GatherElements: the gradient is scattered back with addition (repeated indices
/// add up). Gather along axis a works on the data with axis a moved to the front, so an
/// embedding (a = 0) needs no transpose and its gradient costs one ScatterND over the batch's
/// rows, not a dense one-hot product. Below opset 16 (no ScatterND reduction) Gather uses a
/// one-hot MatMul, linear in the batch.
pub fn gather(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?.to_string();
    let data = node.input[0].as_str();
    let idx = node.input[1].as_str();
    let axis = attr_i(node, "axis").unwrap_or(0);
    if node.op_type() == "GatherElements" {
        if ctx.opset < 16 {
            return Err(Error::Usage(format!(
                "GatherElements node '{}': its gradient needs ScatterElements with reduction (opset >= 16); re-export with opset 16 or newer",
                node.name()
            )));
        }
        let zeros = ctx.zeros_like(data);
        let gx = ctx.b.node(
            "ScatterElements",
            &[&zeros, idx, &g],
            "grad/gather_elements",
            vec![int_attr("axis", axis), string_attr("reduction", "add")],
        );
        return Ok(vec![Some(gx)]);
    }
    let r = ctx.rank(data, node)?;
    let ri = ctx.rank(idx, node)?;
    let a = if axis < 0 { axis + r as i64 } else { axis } as usize;
    if ri == 1 && a > 0 && a < r && ctx.opset >= 16 {
        // Columns of a wider tensor (the number loss reading K of V logits): the gradient is
        // added into the tensor's other gradient where the columns are, never built dense.
        scatter_along(ctx, data, idx, g, a, r, "cols");
        return Ok(vec![None]);
    }
    if a >= r {
        return Err(Error::MalformedGraph(format!(
            "Gather node '{}' has axis {axis} for rank {r}",
            node.name()
        )));
    }
    // Move the gathered axis (data) / the index axes (gradient) to the front.
    let (data_t, g_t) = if a == 0 {
        (data.to_string(), g)
    } else {
        let mut perm: Vec<i64> = vec![a as i64];
        perm.extend((0..r as i64).filter(|&k| k != a as i64));
        let data_t = ctx.b.transpose(data, &perm, "grad/gather_data_t");
        let rg = r + ri - 1;
        let mut gperm: Vec<i64> = (a..a + ri).map(|k| k as i64).collect();
        gperm.extend((0..rg as i64).filter(|&k| k < a as i64 || k >= (a + ri) as i64));
        let g_t = ctx.b.transpose(&g, &gperm, "grad/gather_g_t");
        (data_t, g_t)
    };
    let shape_t = ctx.shape(&data_t);
    let dim = ctx.b.slice(&shape_t, 0, 1, 0, "grad/gather_dim");
    let minus_one = ctx.i64s(&[-1]);
    let flat_idx = ctx.op("Reshape", &[idx, &minus_one], "grad/gather_idx");
    // int32 indices (TensorFlow, JAX exports) meet int64 shapes below
    let flat_idx = ctx
        .b
        .cast(&flat_idx, crate::onnx::INT64, "grad/gather_idx_i64");
    // Negative indices count from the end.
    let zero = ctx.b.const_i64("grad/c", &[], &[0]);
    let neg = ctx.op("Less", &[&flat_idx, &zero], "grad/gather_neg");
    let wrapped = ctx.op("Add", &[&flat_idx, &dim], "grad/gather_wrapped");
    let flat_idx = ctx
        .b
        .where_(&neg, &wrapped, &flat_idx, "grad/gather_idx_pos");
    let rest = ctx.b.slice(&shape_t, 1, i64::MAX, 0, "grad/gather_rest");
    let gshape = ctx.b.concat(&[&minus_one, &rest], 0, "grad/gather_gshape");
    let g_flat = ctx.op("Reshape", &[&g_t, &gshape], "grad/gather_g");
    if a == 0 && ctx.opset >= 16 && ctx.sparse_rows(data) {
        // rows of a trained parameter (an embedding): added in place into its other gradient
        scatter_along(ctx, data, &flat_idx, g_flat, 0, r, "rows");
        return Ok(vec![None]);
    }
    let gx_t = if ctx.opset >= 16 {
        let zeros = ctx.zeros(&shape_t);
        let ind = ctx.b.unsqueeze(&flat_idx, &[1], "grad/gather_nd_idx");
        ctx.b.node(
            "ScatterND",
            &[&zeros, &ind, &g_flat],
            "grad/gather_scatter",
            vec![string_attr("reduction", "add")],
        )
    } else {
        let values = ctx.b.const_f32("grad/onehot_values", &[2], &[0.0, 1.0]);
        let onehot = ctx.b.node(
            "OneHot",
            &[&flat_idx, &dim, &values],
            "grad/gather_onehot",
            vec![],
        );
        let oh_t = ctx.b.transpose(&onehot, &[1, 0], "grad/gather_onehot_t");
        let n = ctx.shape(&flat_idx);
        let g2shape = ctx.b.concat(&[&n, &minus_one], 0, "grad/gather_g2shape");
        let g2 = ctx.op("Reshape", &[&g_flat, &g2shape], "grad/gather_g2");
        let prod = ctx.op("MatMul", &[&oh_t, &g2], "grad/gather_onehot_sum");
        ctx.op("Reshape", &[&prod, &shape_t], "grad/gather_dense")
    };
    let gx = if a == 0 {
        gx_t
    } else {
        let mut inverse = vec![0i64; r];
        let mut perm: Vec<i64> = vec![a as i64];
        perm.extend((0..r as i64).filter(|&k| k != a as i64));
        for (k, &p) in perm.iter().enumerate() {
            inverse[p as usize] = k as i64;
        }
        ctx.b.transpose(&gx_t, &inverse, "grad/gather")
    };
    ctx.ranks.set(&gx, r);
    Ok(vec![Some(gx)])
}

/// GatherND (batch_dims 0): the gradient is scattered back with addition.
/// Adds `updates` into `data`'s other gradient at the 1-D indices `idx` along `axis` of a
/// rank-`rank` tensor (ScatterElements with the indices broadcast to the updates' shape), so
/// that no dense gradient of `data` is built. `what` names the nodes (`grad/gather_<what>`).
fn scatter_along(
    ctx: &mut Ctx,
    data: &str,
    idx: &str,
    updates: String,
    axis: usize,
    rank: usize,
    what: &str,
) {
    let mut shape = vec![1i64; rank];
    shape[axis] = -1;
    let shape = ctx.i64s(&shape);
    let idx_b = ctx.op("Reshape", &[idx, &shape], &format!("grad/gather_{what}"));
    let gs = ctx.shape(&updates);
    let indices = ctx.op("Expand", &[&idx_b, &gs], &format!("grad/gather_{what}_idx"));
    ctx.scatter_into(
        data,
        crate::passes::grad::Scatter {
            indices,
            updates,
            axis: axis as i64,
        },
    );
}

pub fn gather_nd(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    if attr_i(node, "batch_dims").unwrap_or(0) != 0 || ctx.opset < 16 {
        return Err(Error::Usage(format!(
            "GatherND node '{}': its gradient is supported for batch_dims 0 at opset >= 16 only",
            node.name()
        )));
    }
    let zeros = ctx.zeros_like(&node.input[0]);
    let gx = ctx.b.node(
        "ScatterND",
        &[&zeros, &node.input[1], g0(node, gy)?],
        "grad/gather_nd",
        vec![string_attr("reduction", "add")],
    );
    Ok(vec![Some(gx)])
}

/// Constant-mode Pad: the gradient is the padded output's gradient with the padding cut off,
/// i.e. the same Pad with negated pads (negative pads crop).
pub fn pad(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let mode = crate::onnx::attr_s(node, "mode").unwrap_or_else(|| "constant".into());
    if mode != "constant" {
        return Err(Error::Usage(format!(
            "Pad node '{}' uses mode '{mode}'; the step graph differentiates constant padding only",
            node.name()
        )));
    }
    let pads = node
        .input
        .get(1)
        .filter(|p| !p.is_empty())
        .ok_or_else(|| Error::Usage(format!("Pad node '{}' has no pads input", node.name())))?;
    let neg = ctx.op("Neg", &[pads], "grad/pad_crop");
    let mut inputs: Vec<String> = vec![g0(node, gy)?.to_string(), neg, String::new()];
    if let Some(axes) = node.input.get(3).filter(|a| !a.is_empty()) {
        inputs.push(axes.clone());
    }
    let refs: Vec<&str> = inputs.iter().map(|s| s.as_str()).collect();
    let gx = ctx.b.node("Pad", &refs, "grad/pad", vec![]);
    like(ctx, gx, &node.input[0])
}

/// Tile(x, repeats): every copy's gradient is summed back, `g` viewed as
/// `[r0, d0, r1, d1, …]` and summed over the repeat axes.
pub fn tile(
    ctx: &mut Ctx,
    node: &NodeProto,
    gy: &[Option<String>],
    _: &[bool],
) -> Result<Grads, Error> {
    let g = g0(node, gy)?;
    let x = node.input[0].as_str();
    let repeats = node.input[1].as_str();
    let rank = ctx.rank(x, node)?;
    if rank == 0 {
        return like(ctx, g.to_string(), x);
    }
    let column = ctx.i64s(&[1]);
    let r = ctx.op("Unsqueeze", &[repeats, &column], "grad/tile_r");
    let shape = ctx.shape(x);
    let d = ctx.op("Unsqueeze", &[&shape, &column], "grad/tile_d");
    let pairs = ctx.b.concat(&[&r, &d], 1, "grad/tile_pairs");
    let flat = ctx.i64s(&[-1]);
    let view = ctx.op("Reshape", &[&pairs, &flat], "grad/tile_view");
    let gv = ctx.op("Reshape", &[g, &view], "grad/tile_g");
    let axes: Vec<i64> = (0..rank as i64).map(|i| 2 * i).collect();
    let gx = ctx.b.reduce_sum(&gv, &axes, false, "grad/tile");
    like(ctx, gx, x)
}

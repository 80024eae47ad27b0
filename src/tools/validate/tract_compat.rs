//! Rewrites of the validation copy for tract, each keeping every value: tract has no sequence
//! types (the dynamo exporter's `SplitToSequence` + `SequenceAt` become `Slice`s, as for the
//! step graph), and its shape analysis mis-sizes a `Slice` whose end is `INT64_MAX` ("to the
//! end", how exporters write `x[a:]`) on a symbolic dim, so such ends become the dim itself,
//! read from the data's shape. tract's Celu misses its factor α: spelled out in primitives.

use crate::graph::patch::{splice, Splice};
use crate::graph::shapes::{Shapes, SLICE_TO_THE_END};
use crate::graph::GraphIndex;
use crate::onnx::{GraphProto, NodeProto};
use ntl_ops::Builder;

pub fn rewrite(graph: &mut GraphProto, b: &mut Builder) {
    crate::passes::grad::canonical::split_to_sequence_as_slices(graph, b);
    slice_ends_from_shapes(graph, b);
    celu_as_primitives(graph, b);
}

/// tract 0.23 computes Celu as `max(0, x) + min(0, exp(x/α) − 1)`, without the factor α:
/// the validation copy spells out ONNX's `max(0, x) + min(0, α·(exp(x/α) − 1))`.
fn celu_as_primitives(graph: &mut GraphProto, b: &mut Builder) {
    let mut replace = std::collections::BTreeMap::new();
    for (at, node) in graph.node.iter().enumerate() {
        let (Some(x), Some(y)) = (node.input.first(), node.output.first()) else {
            continue;
        };
        if node.op_type() != "Celu" {
            continue;
        }
        let (x, y) = (x.clone(), y.clone());
        let alpha = crate::onnx::attr(node, "alpha").map_or(1.0, |a| a.f());
        let (zero, one) = (b.scalar_f32("tract/c", 0.0), b.scalar_f32("tract/c", 1.0));
        let a = b.scalar_f32("tract/celu_alpha", alpha);
        let t = b.binary("Div", &x, &a, "tract/celu_t");
        let e = b.unary("Exp", &t, "tract/celu_exp");
        let e1 = b.binary("Sub", &e, &one, "tract/celu_e1");
        let neg = b.binary("Mul", &e1, &a, "tract/celu_neg");
        let low = b.binary("Min", &neg, &zero, "tract/celu_low");
        let high = b.binary("Max", &x, &zero, "tract/celu_high");
        b.node_to("Add", &[&high, &low], &[&y], vec![]);
        replace.insert(at, std::mem::take(&mut b.nodes));
    }
    splice(graph, Splice::replace(replace));
}

fn slice_ends_from_shapes(graph: &mut GraphProto, b: &mut Builder) {
    let index = GraphIndex::new(graph);
    let shapes = Shapes::infer(&index);
    let types = crate::graph::elem_types::ElemTypes::infer(index.graph);
    let known = |t: Option<&String>| shapes.known_ints(t.filter(|t| !t.is_empty())?);
    let mut rewrites: Vec<(usize, Vec<NodeProto>)> = Vec::new();
    for (i, node) in graph.node.iter().enumerate() {
        if node.op_type() != "Slice" || node.input.len() < 3 {
            continue;
        }
        // the new ends are int64, as the starts must be
        if types.get(&node.input[1]) != Some(crate::onnx::INT64) {
            continue;
        }
        let Some(ends) =
            known(node.input.get(2)).filter(|e| e.iter().any(|&e| e >= SLICE_TO_THE_END))
        else {
            continue;
        };
        let axes = match node.input.get(3).filter(|a| !a.is_empty()) {
            Some(a) => match known(Some(a)) {
                Some(axes) if axes.len() == ends.len() => axes,
                _ => continue,
            },
            None => (0..ends.len() as i64).collect(),
        };
        let shape = b.node("Shape", &[&node.input[0]], "tract/slice_data_shape", vec![]);
        let parts: Vec<String> = ends
            .iter()
            .zip(&axes)
            .map(|(&e, &a)| {
                if e >= SLICE_TO_THE_END {
                    let end = if a == -1 { i64::MAX } else { a + 1 };
                    b.slice(&shape, a, end, 0, "tract/slice_end_dim")
                } else {
                    b.const_i64("tract/slice_end", &[1], &[e])
                }
            })
            .collect();
        let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
        let new_ends = b.concat(&refs, 0, "tract/slice_ends");
        let mut slice = node.clone();
        slice.input[2] = new_ends;
        let mut nodes = std::mem::take(&mut b.nodes);
        nodes.push(slice);
        rewrites.push((i, nodes));
    }
    if rewrites.is_empty() {
        return;
    }
    splice(graph, Splice::replace(rewrites));
}

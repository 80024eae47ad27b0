//! Half-precision exports (weights in float16 or bfloat16) made float32 before the step graph
//! is built: the float32 master copies of the weights are what trains, and the precision pass
//! then puts the half type back where autocast computes in it (`autocast.rs`).
//!
//! Every float16/bfloat16 initializer becomes float32 (the values widened exactly), every
//! Constant / ConstantOfShape value likewise, every Cast to the half type casts to float32,
//! and declared value types follow. Data inputs keep their declared type (the interface stays):
//! a half data input gets a Cast to float32 where the graph reads it.

use std::collections::HashMap;

use crate::error::Error;
use crate::graph::patch::{splice, Splice};
use crate::onnx::proto::tensor_proto::DataType;
use crate::onnx::proto::type_proto;
use crate::onnx::{GraphProto, NodeProto, TensorProto, ValueInfoProto, FLOAT};
use ntl_ops::Builder;

use crate::passes::grad;

use super::frozen_half::{self, WidenedSet};
use super::{Precision, BFLOAT16, FLOAT16};

/// Half-precision exports: refused without --precision (`precision` None); otherwise the
/// trained weights get float32 master copies (`to_float32`) and the frozen ones (by `trains`)
/// stay half, read through widening Casts (`frozen_half.rs`), so the rest of the step sees a
/// float32 model.
pub fn widen_half_export(
    graph: &mut GraphProto,
    precision: Option<Precision>,
    b: &mut Builder,
    trains: &dyn Fn(&str) -> bool,
) -> Result<WidenedSet, Error> {
    let loss = graph.output[0].name().to_string();
    let half_inits: Vec<String> = graph
        .initializer
        .iter()
        .filter(|t| is_half(t.data_type()))
        .map(|t| t.name().to_string())
        .collect();
    if half_inits.is_empty() {
        return Ok(Default::default());
    }
    let reaching = grad::reaching_loss(&graph.node, &loss, &half_inits);
    let Some((ty, example)) = weight_type(graph, &reaching) else {
        return Ok(Default::default());
    };
    if precision.is_none() {
        return Err(Error::Usage(format!(
            "the weights are {} (e.g. '{example}'): add --precision fp16 or --precision bf16 (mixed precision) or --precision fp32; step trains float32 master copies either way",
            type_name(ty)
        )));
    }
    // frozen weights (more than one value: scalars are exporter constants) stay half
    let half: std::collections::HashSet<&str> = half_inits.iter().map(String::as_str).collect();
    let kept: Vec<(String, i32)> = graph
        .initializer
        .iter()
        .filter(|t| half.contains(t.name()))
        .filter(|t| t.dims.iter().product::<i64>() > 1 && !trains(t.name()))
        .map(|t| (t.name().to_string(), t.data_type()))
        .collect();
    let widened = frozen_half::keep_half(graph, &kept, b);
    let keep: std::collections::HashSet<String> = kept.into_iter().map(|(n, _)| n).collect();
    to_float32(graph, b, &keep)?;
    Ok(widened)
}

fn is_half(t: i32) -> bool {
    t == FLOAT16 || t == BFLOAT16
}

/// The half type of the export's trainable weights: the float16/bfloat16 initializers among
/// `candidates` (initializer names on the loss path, in the order the caller found them).
fn weight_type(graph: &GraphProto, candidates: &[String]) -> Option<(i32, String)> {
    let types: HashMap<&str, i32> = graph
        .initializer
        .iter()
        .map(|t| (t.name(), t.data_type()))
        .collect();
    candidates.iter().find_map(|c| {
        types
            .get(c.as_str())
            .filter(|&&t| is_half(t))
            .map(|&t| (t, c.clone()))
    })
}

fn type_name(t: i32) -> &'static str {
    if t == BFLOAT16 {
        "bfloat16"
    } else {
        "float16"
    }
}

/// Rewrites `graph` to float32 throughout (see the module doc), except the initializers
/// named in `keep` (frozen weights kept in their type: `frozen_half.rs`).
fn to_float32(
    graph: &mut GraphProto,
    b: &mut Builder,
    keep: &std::collections::HashSet<String>,
) -> Result<(), Error> {
    let (kept, widened): (Vec<TensorProto>, Vec<TensorProto>) =
        std::mem::take(&mut graph.initializer)
            .into_iter()
            .partition(|t| keep.contains(t.name()));
    graph.initializer = widened;
    widen_body(graph)?;
    graph.initializer.extend(kept);
    // a kept tensor's declaration was widened with the rest: it is optional, drop it
    graph.value_info.retain(|v| !keep.contains(v.name()));
    // half data inputs: read through a Cast, the input itself unchanged
    let inits: std::collections::HashSet<String> = graph
        .initializer
        .iter()
        .map(|t| t.name().to_string())
        .collect();
    let mut renames: HashMap<String, String> = HashMap::new();
    let mut casts = Vec::new();
    for v in &mut graph.input {
        if keep.contains(v.name()) {
            continue;
        }
        if inits.contains(v.name()) {
            widen_value(v);
            continue;
        }
        let half = crate::onnx::value_info_shape(v).is_some_and(|(t, _)| is_half(t));
        if half {
            let wide = b.fresh("amp/input_f32");
            casts.push(NodeProto {
                name: Some(b.fresh("Cast")),
                op_type: Some("Cast".into()),
                input: vec![v.name().to_string()],
                output: vec![wide.clone()],
                attribute: vec![crate::onnx::int_attr("to", FLOAT as i64)],
                ..Default::default()
            });
            renames.insert(v.name().to_string(), wide);
        }
    }
    if !renames.is_empty() {
        // every reader reads the widened input, the Casts first
        let mut widen = Splice::insert(0, casts);
        widen.renames = renames;
        splice(graph, widen);
    }
    Ok(())
}

/// Initializers, nodes (and their subgraphs), value types and outputs, not the inputs.
fn widen_body(graph: &mut GraphProto) -> Result<(), Error> {
    for t in &mut graph.initializer {
        widen_tensor(t)?;
    }
    for node in &mut graph.node {
        widen_node(node)?;
    }
    for v in graph.value_info.iter_mut().chain(&mut graph.output) {
        widen_value(v);
    }
    Ok(())
}

fn widen_value(v: &mut ValueInfoProto) {
    if let Some(type_proto::Value::TensorType(t)) = v.r#type.as_mut().and_then(|t| t.value.as_mut())
    {
        if is_half(t.elem_type()) {
            t.elem_type = Some(FLOAT);
        }
    }
}

fn widen_node(node: &mut NodeProto) -> Result<(), Error> {
    // ops whose `to` / `dtype` attribute names the type they make
    let typed = matches!(node.domain(), "" | "ai.onnx")
        && matches!(
            node.op_type(),
            "Cast"
                | "EyeLike"
                | "RandomNormal"
                | "RandomUniform"
                | "RandomNormalLike"
                | "RandomUniformLike"
                | "Multinomial"
                | "Bernoulli"
        );
    for a in &mut node.attribute {
        if let Some(t) = a.t.as_mut() {
            widen_tensor(t)?;
        }
        let casts_to_half =
            typed && matches!(a.name(), "to" | "dtype") && a.i.is_some_and(|t| is_half(t as i32));
        if casts_to_half {
            a.i = Some(FLOAT as i64);
        }
        for g in a.g.iter_mut().chain(a.graphs.iter_mut()) {
            widen_body(g)?;
            for v in &mut g.input {
                widen_value(v);
            }
        }
    }
    Ok(())
}

/// A float16/bfloat16 tensor as float32 (exactly: both widen without rounding).
fn widen_tensor(t: &mut TensorProto) -> Result<(), Error> {
    let dt = t.data_type();
    if !is_half(dt) {
        return Ok(());
    }
    if !t.external_data.is_empty() {
        return Err(Error::Usage(format!(
            "the {} weight '{}' is stored as external data, which --precision does not widen to float32 master copies yet; export the model in float32 (external data is fine there)",
            type_name(dt),
            t.name()
        )));
    }
    let bits: Vec<u16> = match t.raw_data.as_deref().filter(|r| !r.is_empty()) {
        Some(raw) => raw
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect(),
        // float16 and bfloat16 values in int32_data hold the bits of each element
        None => t.int32_data.iter().map(|&v| v as u16).collect(),
    };
    let wide: Vec<u8> = bits
        .iter()
        .map(|&b| {
            if dt == FLOAT16 {
                half::f16::from_bits(b).to_f32()
            } else {
                half::bf16::from_bits(b).to_f32()
            }
        })
        .flat_map(f32::to_le_bytes)
        .collect();
    t.raw_data = Some(wide.into());
    t.int32_data.clear();
    t.data_type = Some(DataType::Float as i32);
    Ok(())
}

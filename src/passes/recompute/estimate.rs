//! `--recompute auto`: whether the activations the forward keeps for the backward would
//! outweigh the training state. Estimated from the shapes the graph proves, at the batch
//! size and sequence length of the graph's inputs (`--batch` / `--seq` where they are
//! symbolic).

use crate::graph::hash::HashMap;
use crate::graph::shapes::{Dim, Shapes};
use crate::graph::GraphIndex;
use crate::onnx::proto::tensor_shape_proto::dimension;
use crate::onnx::proto::type_proto;

use super::View;

/// `--batch` / `--seq`: the step's shape where the graph leaves it symbolic.
#[derive(Debug, Clone, Copy, Default)]
pub struct Hints {
    pub batch: Option<u64>,
    pub seq: Option<u64>,
}

const GIB: f64 = (1u64 << 30) as f64;

/// (recompute?, why) for the graph `view` sees.
pub(super) fn decide(
    view: &View,
    index: &GraphIndex,
    hints: &Hints,
    state_bytes: u64,
) -> (bool, String) {
    let sizes = match symbol_sizes(view, hints) {
        Ok(s) => s,
        Err(symbol) => {
            return (
                false,
                format!("off: the activations depend on the symbolic dim '{symbol}'; give the step's shape with --batch and --seq for auto to decide, or choose --recompute layers"),
            )
        }
    };
    let graph = view.graph;
    let shapes = Shapes::infer(index);
    let types = crate::graph::elem_types::ElemTypes::infer(graph);
    let mut kept: u64 = 0;
    let mut counted = std::collections::BTreeSet::new();
    for (p, n) in graph.node.iter().enumerate() {
        if view.is_forward[p] {
            continue;
        }
        for i in &n.input {
            let forward_made = index.producer(i).is_some_and(|(q, _)| view.is_forward[q]);
            if !forward_made || !view.data.contains(i) || !counted.insert(i.as_str()) {
                continue;
            }
            let elements = shapes.get(i).and_then(|s| {
                s.iter().try_fold(1u64, |acc, d| {
                    let v = match d {
                        Dim::Known(v) => u64::try_from(*v).ok()?,
                        Dim::Sym(s) => *sizes.get(s.as_str())?,
                        Dim::Unknown => return None,
                    };
                    acc.checked_mul(v)
                })
            });
            let width = types.get(i).map_or(4, element_bytes);
            kept = kept.saturating_add(elements.unwrap_or(0).saturating_mul(width));
        }
    }
    let at = match (sizes.is_empty(), hints.batch, hints.seq) {
        (true, Some(_), _) | (true, _, Some(_)) => {
            " at the graph's own (static) shape; --batch/--seq are for symbolic dims".to_string()
        }
        (true, None, None) => " at the graph's own (static) shape".to_string(),
        (false, b, t) => format!(
            " at batch {}, sequence {}",
            b.map_or("-".into(), |v| v.to_string()),
            t.map_or("-".into(), |v| v.to_string())
        ),
    };
    let (kept_h, state_h) = (human(kept), human(state_bytes));
    if kept > state_bytes {
        (true, format!("layers: the forward would keep {kept_h} of activations{at}, more than the {state_h} of parameters and optimizer state"))
    } else {
        (false, format!("off: the forward keeps {kept_h} of activations{at}, less than the {state_h} of parameters and optimizer state"))
    }
}

/// `1.25 GiB`, `3.0 MiB`, `12.0 KiB`.
fn human(bytes: u64) -> String {
    let units = [
        ("GiB", GIB),
        ("MiB", GIB / 1024.0),
        ("KiB", GIB / 1048576.0),
    ];
    let (unit, size) = units
        .iter()
        .find(|(_, size)| bytes as f64 >= *size)
        .unwrap_or(&units[2]);
    format!("{:.2} {unit}", bytes as f64 / size)
}

/// Sizes of the data inputs' symbolic dims: axis 0 is the batch, axis 1 the sequence. Err:
/// a symbol without a hint.
fn symbol_sizes<'a>(view: &'a View, hints: &Hints) -> Result<HashMap<&'a str, u64>, String> {
    let mut sizes = HashMap::default();
    for input in view
        .graph
        .input
        .iter()
        .filter(|i| view.data.contains(i.name()))
    {
        let Some(type_proto::Value::TensorType(t)) =
            input.r#type.as_ref().and_then(|t| t.value.as_ref())
        else {
            continue;
        };
        let dims = t
            .shape
            .as_ref()
            .map(|s| s.dim.as_slice())
            .unwrap_or_default();
        for (axis, d) in dims.iter().enumerate() {
            if let Some(dimension::Value::DimParam(symbol)) = &d.value {
                let hint = match axis {
                    0 => hints.batch,
                    1 => hints.seq,
                    _ => None,
                };
                match hint {
                    Some(v) => {
                        sizes.insert(symbol.as_str(), v);
                    }
                    None => return Err(symbol.clone()),
                }
            }
        }
    }
    Ok(sizes)
}

fn element_bytes(elem_type: i32) -> u64 {
    use crate::onnx::proto::tensor_proto::DataType as T;
    match T::try_from(elem_type) {
        Ok(T::Double | T::Int64 | T::Uint64 | T::Complex64) => 8,
        Ok(T::Float16 | T::Bfloat16 | T::Int16 | T::Uint16) => 2,
        Ok(T::Bool | T::Int8 | T::Uint8) => 1,
        _ => 4,
    }
}

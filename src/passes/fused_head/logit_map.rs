//! A pointwise map of the logits between the LM head's projection and the losses: products and
//! quotients by constants (Granite's `logits / logits_scaling`, Cohere's `logits * logit_scale`)
//! and at most one `Tanh` (Gemma 2's soft-cap `c·tanh(z / c)`). The fused head applies it to
//! each chunk's logits, and its derivative `k·(1 − t²)` to their gradient (`k` the constants'
//! product, `t` the `Tanh`'s output).

use ntl_ops::Builder;

use crate::graph::GraphIndex;
use crate::onnx::{attr, attr_ints, ints_attr, AttributeProto, NodeProto};
use crate::passes::contract::LogitStep;

/// The steps, in the graph's order (empty: the logits are the projection's).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogitMap {
    pub steps: Vec<LogitStep>,
}

const MUL: i64 = 1;
const DIV: i64 = 2;
const TANH: i64 = 3;

/// A node as a step of the map, and which input carries the logits: `Tanh`, `Div` by a
/// constant scalar, `Mul` by one on either side.
fn step_of(index: &GraphIndex, n: &NodeProto) -> Option<(LogitStep, usize)> {
    let constant =
        |k: usize| match crate::ce::forms::constant_numbers(index, &n.input[k]).as_deref() {
            Some(&[c]) if c.is_finite() && c != 0.0 => Some(c as f32),
            _ => None,
        };
    match n.op_type() {
        "Tanh" => Some((LogitStep::Tanh, 0)),
        "Div" => Some((LogitStep::Div(constant(1)?), 0)),
        "Mul" => [0, 1]
            .into_iter()
            .find_map(|x| Some((LogitStep::Mul(constant(1 - x)?), x))),
        _ => None,
    }
}

impl LogitMap {
    /// Walks back from `logits` through `Mul`/`Div` by a constant scalar and one `Tanh`, each
    /// read only by the next step: the map, the tensor it starts from (the projection's output)
    /// and its nodes.
    pub fn find(
        index: &GraphIndex,
        logits: &str,
    ) -> Result<(LogitMap, String, Vec<usize>), String> {
        let mut steps = Vec::new();
        let mut nodes = Vec::new();
        let mut t = logits.to_string();
        while let Some((i, n)) = index.producer(&t) {
            let Some((step, x)) = step_of(index, n) else {
                break;
            };
            if step == LogitStep::Tanh && steps.contains(&LogitStep::Tanh) {
                return Err("the logits pass through two Tanh nodes".into());
            }
            if index.consumers(&n.input[x]).len() != 1 {
                return Err(format!(
                    "the logits before {} node '{}' are read elsewhere too",
                    n.op_type(),
                    n.name()
                ));
            }
            steps.push(step);
            nodes.push(i);
            t = n.input[x].clone();
        }
        steps.reverse();
        Ok((LogitMap { steps }, t, nodes))
    }

    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// The node attributes that carry the map (none for an empty one).
    pub fn attributes(&self) -> Vec<AttributeProto> {
        if self.is_empty() {
            return Vec::new();
        }
        let (ops, values): (Vec<i64>, Vec<f32>) = self
            .steps
            .iter()
            .map(|s| match *s {
                LogitStep::Mul(c) => (MUL, c),
                LogitStep::Div(c) => (DIV, c),
                LogitStep::Tanh => (TANH, 0.0),
            })
            .unzip();
        let mut values_attr = crate::onnx::float_attr("logit_values", 0.0);
        values_attr.r#type =
            Some(crate::onnx::proto::attribute_proto::AttributeType::Floats as i32);
        values_attr.f = None;
        values_attr.floats = values;
        vec![ints_attr("logit_ops", &ops), values_attr]
    }

    /// Reads the map back from a node's attributes.
    pub fn of(node: &NodeProto) -> LogitMap {
        let ops = attr_ints(node, "logit_ops").unwrap_or_default();
        let values = attr(node, "logit_values")
            .map(|a| a.floats.clone())
            .unwrap_or_default();
        let steps = ops
            .iter()
            .zip(values.iter().chain(std::iter::repeat(&0.0)))
            .filter_map(|(&op, &c)| match op {
                MUL => Some(LogitStep::Mul(c)),
                DIV => Some(LogitStep::Div(c)),
                TANH => Some(LogitStep::Tanh),
                _ => None,
            })
            .collect();
        LogitMap { steps }
    }

    /// The mapped logits of `z`, and the `Tanh`'s output where there is one.
    pub fn apply(&self, b: &mut Builder, z: &str) -> (String, Option<String>) {
        let mut z = z.to_string();
        let mut tanh = None;
        for s in &self.steps {
            z = match *s {
                LogitStep::Mul(c) | LogitStep::Div(c) => {
                    let k = b.scalar_f32("fused/logit_map_c", c);
                    let op = if matches!(s, LogitStep::Div(_)) {
                        "Div"
                    } else {
                        "Mul"
                    };
                    b.binary(op, &z, &k, "fused/logits_mapped")
                }
                LogitStep::Tanh => {
                    let t = b.unary("Tanh", &z, "fused/logits_tanh");
                    tanh = Some(t.clone());
                    t
                }
            };
        }
        (z, tanh)
    }

    /// The gradient of the unmapped logits from `dz` of the mapped ones: `dz·k·(1 − t²)`
    /// (`dz` itself for an empty map).
    pub fn slope(&self, b: &mut Builder, dz: &str, tanh: Option<&str>) -> String {
        let mut dz = dz.to_string();
        if let Some(t) = tanh {
            let t2 = b.binary("Mul", t, t, "fused/logits_t2");
            let one = b.scalar_f32("fused/logits_one", 1.0);
            let slope = b.binary("Sub", &one, &t2, "fused/logits_slope");
            dz = b.binary("Mul", &dz, &slope, "fused/dz_unmapped");
        }
        let k: f64 = self
            .steps
            .iter()
            .map(|s| match *s {
                LogitStep::Mul(c) => c as f64,
                LogitStep::Div(c) => 1.0 / c as f64,
                LogitStep::Tanh => 1.0,
            })
            .product();
        if k as f32 == 1.0 {
            return dz;
        }
        let k = b.scalar_f32("fused/logit_map_k", k as f32);
        b.binary("Mul", &dz, &k, "fused/dz_unmapped")
    }
}

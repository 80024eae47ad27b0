//! A pointwise map of a product's output by constants and at most one `Tanh`, which the chunked
//! passes apply per chunk and differentiate through `k·(1 − t²)` (`k` the constants' product,
//! `t` the `Tanh`'s output): the LM head's logits before the losses (Gemma 2's soft-cap
//! `30·tanh(z / 30)`, Granite's `z / logits_scaling`, Cohere's `z · logit_scale`: `fused_head`)
//! and the attention's scores before the masks (Gemma 2's `50·tanh(s / 50)`: `attention`).

use ntl_ops::Builder;

use crate::graph::GraphIndex;
use crate::onnx::{attr, attr_ints, floats_attr, ints_attr, AttributeProto, NodeProto};
use crate::passes::contract::MapStep;

/// The steps, in the graph's order (empty: no map).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PointwiseMap {
    pub steps: Vec<MapStep>,
}

const MUL: i64 = 1;
const DIV: i64 = 2;
const TANH: i64 = 3;

/// A node as a step of a map, and which input carries the values: `Tanh`, `Div` by a constant
/// scalar, `Mul` by one on either side.
pub fn step_of(index: &GraphIndex, n: &NodeProto) -> Option<(MapStep, usize)> {
    let constant =
        |k: usize| match crate::ce::forms::constant_numbers(index, &n.input[k]).as_deref() {
            Some(&[c]) if c.is_finite() && c != 0.0 => Some(c as f32),
            _ => None,
        };
    match n.op_type() {
        "Tanh" => Some((MapStep::Tanh, 0)),
        "Div" => Some((MapStep::Div(constant(1)?), 0)),
        "Mul" => [0, 1]
            .into_iter()
            .find_map(|x| Some((MapStep::Mul(constant(1 - x)?), x))),
        _ => None,
    }
}

impl PointwiseMap {
    /// Walks back from the logits through `Mul`/`Div` by a constant scalar and one `Tanh`, each
    /// read only by the next step: the map, the tensor it starts from (the projection's output)
    /// and its nodes, the last step's first.
    pub fn find(
        index: &GraphIndex,
        logits: &str,
    ) -> Result<(PointwiseMap, String, Vec<usize>), String> {
        let mut steps = Vec::new();
        let mut nodes = Vec::new();
        let mut t = logits.to_string();
        while let Some((i, n)) = index.producer(&t) {
            let Some((step, x)) = step_of(index, n) else {
                break;
            };
            if step == MapStep::Tanh && steps.contains(&MapStep::Tanh) {
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
        Ok((PointwiseMap { steps }, t, nodes))
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
                MapStep::Mul(c) => (MUL, c),
                MapStep::Div(c) => (DIV, c),
                MapStep::Tanh => (TANH, 0.0),
            })
            .unzip();
        vec![
            ints_attr("map_ops", &ops),
            floats_attr("map_values", &values),
        ]
    }

    /// Reads the map back from a node's attributes.
    pub fn of(node: &NodeProto) -> PointwiseMap {
        let ops = attr_ints(node, "map_ops").unwrap_or_default();
        let values = attr(node, "map_values")
            .map(|a| a.floats.clone())
            .unwrap_or_default();
        let steps = ops
            .iter()
            .zip(values.iter().chain(std::iter::repeat(&0.0)))
            .filter_map(|(&op, &c)| match op {
                MUL => Some(MapStep::Mul(c)),
                DIV => Some(MapStep::Div(c)),
                TANH => Some(MapStep::Tanh),
                _ => None,
            })
            .collect();
        PointwiseMap { steps }
    }

    /// The map of `z`, and the `Tanh`'s output where there is one.
    pub fn apply(&self, b: &mut Builder, z: &str) -> (String, Option<String>) {
        let mut z = z.to_string();
        let mut tanh = None;
        for s in &self.steps {
            z = match s.constant() {
                Some(c) => {
                    let k = b.scalar_f32("map/c", c);
                    b.binary(s.op(), &z, &k, "map/mapped")
                }
                None => {
                    let t = b.unary(s.op(), &z, "map/tanh");
                    tanh = Some(t.clone());
                    t
                }
            };
        }
        (z, tanh)
    }

    /// The gradient before the map from `dz`, the one after it: `dz·k·(1 − t²)` (`dz` itself
    /// for an empty map).
    pub fn slope(&self, b: &mut Builder, dz: &str, tanh: Option<&str>) -> String {
        let mut dz = dz.to_string();
        if let Some(t) = tanh {
            let t2 = b.binary("Mul", t, t, "map/t2");
            let one = b.scalar_f32("map/one", 1.0);
            let slope = b.binary("Sub", &one, &t2, "map/slope");
            dz = b.binary("Mul", &dz, &slope, "map/unmapped");
        }
        let k: f64 = self.steps.iter().map(|s| s.factor()).product();
        if k as f32 == 1.0 {
            return dz;
        }
        let k = b.scalar_f32("map/k", k as f32);
        b.binary("Mul", &dz, &k, "map/unmapped")
    }
}

impl MapStep {
    /// The ONNX op that computes the step.
    pub fn op(self) -> &'static str {
        match self {
            MapStep::Mul(_) => "Mul",
            MapStep::Div(_) => "Div",
            MapStep::Tanh => "Tanh",
        }
    }

    /// The constant a product or quotient takes (none for `Tanh`).
    pub fn constant(self) -> Option<f32> {
        match self {
            MapStep::Mul(c) | MapStep::Div(c) => Some(c),
            MapStep::Tanh => None,
        }
    }

    /// The step's derivative where it is a constant (1 for `Tanh`, whose `1 − t²` is not).
    fn factor(self) -> f64 {
        match self {
            MapStep::Mul(c) => c as f64,
            MapStep::Div(c) => 1.0 / c as f64,
            MapStep::Tanh => 1.0,
        }
    }
}

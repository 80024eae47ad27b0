//! Element types followed forward through a graph: declared where the graph says so, set by
//! `Cast` and the comparison/shape ops, otherwise the type of the first typed input. Rules use it
//! to write a plain `Cast` where `CastLike` would otherwise be needed (MIGraphX takes no
//! `CastLike`).

use crate::graph::hash::HashMap;

use crate::onnx::{attr, attr_i, GraphProto, BOOL, INT32, INT64};

const UINT8: i32 = crate::onnx::proto::tensor_proto::DataType::Uint8 as i32;

#[derive(Debug, Default)]
pub struct ElemTypes(HashMap<String, i32>);

impl ElemTypes {
    pub fn infer(g: &GraphProto) -> ElemTypes {
        let mut types = HashMap::default();
        for t in &g.initializer {
            types.insert(t.name().to_string(), t.data_type());
        }
        for v in g.input.iter().chain(&g.value_info).chain(&g.output) {
            if let Some((t, _)) = crate::onnx::value_info_shape(v) {
                types.insert(v.name().to_string(), t);
            }
        }
        let mut types = ElemTypes(types);
        types.follow(&g.node);
        types
    }

    /// Follows more nodes (emitted after the graph was inferred: a backward pass) forward.
    pub fn follow(&mut self, nodes: &[crate::onnx::NodeProto]) {
        let types = &mut self.0;
        for node in nodes {
            let first_typed = || {
                node.input
                    .iter()
                    .filter(|i| !i.is_empty())
                    .find_map(|i| types.get(i).copied())
            };
            let out = match node.op_type() {
                "Cast" => attr_i(node, "to").map(|t| t as i32),
                "CastLike" => node.input.get(1).and_then(|i| types.get(i).copied()),
                "Shape" | "Size" | "NonZero" | "ArgMax" | "ArgMin" => Some(INT64),
                "Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" | "Not" | "And"
                | "Or" | "Xor" | "IsNaN" | "IsInf" => Some(BOOL),
                "Constant" => attr(node, "value")
                    .and_then(|a| a.t.as_ref())
                    .map(|t| t.data_type()),
                "Where" => node.input.get(1).and_then(|i| types.get(i).copied()),
                // ops whose output type is not their first input's
                "OneHot" => node.input.get(2).and_then(|i| types.get(i).copied()),
                "DequantizeLinear" => node.input.get(1).and_then(|i| types.get(i).copied()),
                "QuantizeLinear" => Some(
                    node.input
                        .get(2)
                        .and_then(|i| types.get(i).copied())
                        .unwrap_or(UINT8),
                ),
                "MatMulInteger" | "ConvInteger" => Some(INT32),
                "ConstantOfShape" => Some(
                    attr(node, "value")
                        .and_then(|a| a.t.as_ref())
                        .map_or(crate::onnx::FLOAT, |t| t.data_type()),
                ),
                _ => first_typed(),
            };
            if let (Some(t), Some(o)) = (out, node.output.first().filter(|o| !o.is_empty())) {
                types.entry(o.clone()).or_insert(t);
            }
        }
    }

    /// Records a tensor's type (a constant emitted after the graph was inferred).
    pub fn set(&mut self, tensor: &str, elem_type: i32) {
        self.0.insert(tensor.to_string(), elem_type);
    }

    pub fn get(&self, tensor: &str) -> Option<i32> {
        self.0.get(tensor).copied().filter(|&t| t != 0)
    }
}

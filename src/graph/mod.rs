//! Questions about a graph, asked without changing it — producers and consumers, static
//! shapes, ranks and element types followed through the nodes, what a node's subgraphs read
//! from outside ([`reads`]), the structural checks every command runs first — and [`patch`],
//! the one place a node list changes.

pub mod elem_types;
pub mod hash;
pub mod index;
pub mod names;
pub mod patch;
pub mod ranks;
pub mod reads;
pub mod shapes;
pub mod structure;

pub use index::{constant_dims, normalize_axis, static_rank, GraphIndex};

/// A node for the tests of this layer's analyses.
#[cfg(test)]
pub(crate) fn test_node(
    op: &str,
    inputs: &[&str],
    out: &str,
    attribute: Vec<crate::onnx::AttributeProto>,
) -> crate::onnx::NodeProto {
    crate::onnx::NodeProto {
        op_type: Some(op.into()),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: vec![out.into()],
        attribute,
        ..Default::default()
    }
}

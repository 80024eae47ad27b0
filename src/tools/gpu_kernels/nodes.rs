//! What the checks ask of a node or a model: its label, whether ntl-patch added it, whether
//! ORT folds it, the opsets.

use std::collections::HashMap;

use crate::onnx::{GraphProto, ModelProto, NodeProto};
use ntl_ops::schema::canonical_domain;

/// A `Constant`: ORT turns it into an initializer when it loads the graph.
pub(super) fn is_constant(node: &NodeProto) -> bool {
    node.op_type() == "Constant" && canonical_domain(node.domain()) == "ai.onnx"
}

/// The nodes of a graph and of every subgraph in it.
pub(super) fn count_nodes(g: &GraphProto) -> usize {
    g.node.len()
        + g.node
            .iter()
            .flat_map(|n| n.attribute.iter())
            .map(|a| {
                a.g.iter()
                    .chain(a.graphs.iter())
                    .map(count_nodes)
                    .sum::<usize>()
            })
            .sum::<usize>()
}

/// A node ntl-patch added: named under `ntl/`, or the cross-entropy it rewrote (output `ce_loss`).
pub fn is_ntl_node(node: &NodeProto) -> bool {
    node.name().starts_with("ntl/")
        || (node.op_type() == "SoftmaxCrossEntropyLoss"
            && node.output.first().is_some_and(|o| o == "ce_loss"))
}

/// The node's name, or `#index (first output)` when it has none.
pub(super) fn node_label(node: &NodeProto, i: usize) -> String {
    if node.name().is_empty() {
        format!("#{i} ({})", node.output.first().map_or("", |s| s.as_str()))
    } else {
        node.name().to_string()
    }
}

/// Opset per canonical domain.
pub fn model_opsets(model: &ModelProto) -> HashMap<String, i64> {
    model
        .opset_import
        .iter()
        .map(|o| (canonical_domain(o.domain()).to_string(), o.version()))
        .collect()
}

//! The fused LM head as one node while the step graph is built: `FusedHeadLoss` reads the
//! hidden states and the projection and writes what the losses need per position, so the
//! whole-model backward sees one node with explicit inputs; its gradient is one
//! `FusedHeadLossGrad` node (`grad/rules/fused.rs`). Both are internal: `lower` expands them
//! into standard ONNX (`Scan` over token chunks) before the graph is written.
//!
//! `FusedHeadLoss(h [N, d], weight, bias?, labels [N], ids_1 [K_1], …)` with `z = h·W + b`
//! (`W` = weight, or weightᵀ with `trans_weight`) through the graph's `logit_map` → `lse [N]`
//! (log-sum-exp of each row), `label_logit [N]` (`z[n, labels[n]]`, 0 where the label is the
//! ignore index), one `[N, K_j]` gather `z[:, ids_j]` per id set, and with `mean_logit` the row
//! mean `[N]`.
//!
//! `FusedHeadLossGrad(h, weight, bias?, labels, ids…, lse, g_lse, g_label_logit, g_cols…,
//! g_mean?)` → `(g_h, g_weight, g_bias?)`.

use crate::onnx::proto::tensor_shape_proto::{dimension, Dimension};
use crate::onnx::proto::{type_proto, TensorShapeProto};
use crate::onnx::{attr_i, attr_ints, int_attr, ints_attr, NodeProto, TypeProto, ValueInfoProto};

/// The internal domain of the two nodes: no runtime knows it, so an unlowered node fails loudly.
pub const DOMAIN: &str = "ntl.internal";
pub const FORWARD: &str = "FusedHeadLoss";
pub const BACKWARD: &str = "FusedHeadLossGrad";

/// What both nodes share: the tensors they read and how the head is laid out.
#[derive(Debug, Clone)]
pub struct Head {
    /// `[N, d]` hidden states, one row per position, in the cross-entropy's position order.
    pub hidden: String,
    /// `[d, V]`, or `[V, d]` with `trans_weight` (a tied embedding read without a Transpose).
    pub weight: String,
    pub trans_weight: bool,
    /// `[V]`, or empty.
    pub bias: String,
    /// `[N]` int64.
    pub labels: String,
    /// Ignore index of the labels (positions whose label logit is not read).
    pub ignore_index: Option<i64>,
    /// One `[K]` int64 constant per column set the losses read, and each K.
    pub ids: Vec<String>,
    pub id_counts: Vec<i64>,
    /// Whether the row mean of the logits is an output (label smoothing).
    pub mean_logit: bool,
    /// Positions per chunk, at most.
    pub chunk_tokens: i64,
    /// The logits width V.
    pub width: i64,
    /// What the graph does to `z` before the losses read it.
    pub logit_map: crate::passes::pointwise_map::PointwiseMap,
}

impl Head {
    fn inputs(&self) -> Vec<String> {
        let mut v = vec![
            self.hidden.clone(),
            self.weight.clone(),
            self.bias.clone(),
            self.labels.clone(),
        ];
        v.extend(self.ids.iter().cloned());
        v
    }

    fn attributes(&self) -> Vec<crate::onnx::AttributeProto> {
        let mut a = vec![
            int_attr("trans_weight", self.trans_weight as i64),
            int_attr("num_ids", self.ids.len() as i64),
            ints_attr("id_counts", &self.id_counts),
            int_attr("mean_logit", self.mean_logit as i64),
            int_attr("chunk_tokens", self.chunk_tokens),
            int_attr("width", self.width),
        ];
        if let Some(i) = self.ignore_index {
            a.push(int_attr("ignore_index", i));
        }
        a.extend(self.logit_map.attributes());
        a
    }

    /// Reads the head back from either node.
    pub fn of(node: &NodeProto) -> Head {
        let n = attr_i(node, "num_ids").unwrap_or(0) as usize;
        Head {
            hidden: node.input[0].clone(),
            weight: node.input[1].clone(),
            trans_weight: attr_i(node, "trans_weight") == Some(1),
            bias: node.input[2].clone(),
            labels: node.input[3].clone(),
            ignore_index: attr_i(node, "ignore_index"),
            ids: node.input[4..4 + n].to_vec(),
            id_counts: attr_ints(node, "id_counts").unwrap_or_default(),
            mean_logit: attr_i(node, "mean_logit") == Some(1),
            chunk_tokens: attr_i(node, "chunk_tokens").unwrap_or(256),
            width: attr_i(node, "width").unwrap_or(0),
            logit_map: crate::passes::pointwise_map::PointwiseMap::of(node),
        }
    }

    /// Number of forward outputs: lse, label logit, one per id set, and the row mean.
    pub fn forward_outputs(&self) -> usize {
        2 + self.ids.len() + self.mean_logit as usize
    }

    pub fn forward_node(&self, name: &str, outputs: Vec<String>) -> NodeProto {
        NodeProto {
            name: Some(name.to_string()),
            op_type: Some(FORWARD.into()),
            domain: Some(DOMAIN.into()),
            input: self.inputs(),
            output: outputs,
            attribute: self.attributes(),
            ..Default::default()
        }
    }

    /// `grads`: the forward's `lse` then one upstream gradient per forward output (all present:
    /// the rule fills the missing ones with zeros). `outputs`: g_h, g_weight, g_bias (or "").
    pub fn backward_node(&self, name: &str, grads: Vec<String>, outputs: Vec<String>) -> NodeProto {
        let mut input = self.inputs();
        input.extend(grads);
        NodeProto {
            name: Some(name.to_string()),
            op_type: Some(BACKWARD.into()),
            domain: Some(DOMAIN.into()),
            input,
            output: outputs,
            attribute: self.attributes(),
            ..Default::default()
        }
    }
}

/// Whether `node` is one of the two internal nodes.
pub fn is_fused(node: &NodeProto) -> bool {
    node.domain() == DOMAIN && matches!(node.op_type(), FORWARD | BACKWARD)
}

/// A typed value info: element type `elem`, one dim per entry (a number, a symbol, or unknown).
pub fn tensor_info<D: Into<Dim> + Clone>(name: &str, elem: i32, dims: &[D]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| Dimension {
            value: d.clone().into().0,
            ..Default::default()
        })
        .collect();
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(elem),
                shape: Some(TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// One dim of [`tensor_info`].
#[derive(Clone)]
pub struct Dim(Option<dimension::Value>);

impl From<Option<i64>> for Dim {
    fn from(d: Option<i64>) -> Dim {
        Dim(d.map(dimension::Value::DimValue))
    }
}

impl From<&str> for Dim {
    fn from(symbol: &str) -> Dim {
        Dim(Some(dimension::Value::DimParam(symbol.into())))
    }
}

impl From<i64> for Dim {
    fn from(d: i64) -> Dim {
        Dim(Some(dimension::Value::DimValue(d)))
    }
}

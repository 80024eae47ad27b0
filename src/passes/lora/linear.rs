//! The linear layers of an exported graph, in every spelling the exporters write, and the
//! module path PEFT knows each one by.
//!
//! A linear layer is a top-level node computing `x·Wᵀ` from a 2-D float initializer `W`:
//! - `MatMul(x, Transpose(W))` — nn.Linear through the dynamo exporter and TorchScript;
//! - `MatMul(x, W)` with `W` stored `[in, out]` — GPT-2's `Conv1D`, or TorchScript's
//!   constant-folded, pre-transposed nn.Linear weights (`onnx::MatMul_*`);
//! - `Gemm(x, W, b)` with `transB = 1` (`W` `[out, in]`) or `transB = 0` (`[in, out]`).

use std::collections::HashSet;

use crate::graph::GraphIndex;
use crate::onnx::{attr_i, attr_ints, is_float_type, NodeProto, TensorProto};

/// How the initializer stores the weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `[out, in]`, nn.Linear's own layout.
    OutIn,
    /// `[in, out]`: GPT-2's Conv1D, or a transposed copy of an nn.Linear weight.
    InOut,
}

impl Layout {
    pub fn name(self) -> &'static str {
        match self {
            Layout::OutIn => "out_in",
            Layout::InOut => "in_out",
        }
    }
}

/// Where a layer's module path came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathSource {
    /// The weight's initializer name (`<module>.weight`: the dynamo exporter, optimum).
    WeightName,
    /// TorchScript's node scope (`/model/layers.0/self_attn/q_proj/MatMul`).
    NodeScope,
}

#[derive(Debug, Clone)]
pub struct Linear {
    /// Index of the node in the graph.
    pub node: usize,
    pub weight: String,
    pub layout: Layout,
    pub in_features: i64,
    pub out_features: i64,
    /// The module path (`model.layers.0.self_attn.q_proj`), where the export kept it.
    pub module: Option<(String, PathSource)>,
}

impl Linear {
    /// The name targets match against: the module path, else the weight's name.
    pub fn key(&self) -> &str {
        self.module
            .as_ref()
            .map_or(self.weight.as_str(), |(m, _)| m.as_str())
    }

    /// PEFT's `fan_in_fan_out`: the module itself stores its weight `[in, out]` (Conv1D). A
    /// transposed copy an exporter made (an unnamed weight) belongs to an nn.Linear.
    pub fn fan_in_fan_out(&self) -> bool {
        self.layout == Layout::InOut && module_of_weight(&self.weight).is_some()
    }
}

/// Names exporters generate for weights they copied or folded: no module path in them.
fn is_generated_name(name: &str) -> bool {
    name.starts_with("onnx::") || name.starts_with("val_") || name.starts_with("_val_")
}

/// The module path a weight's name spells (`<module>.weight`), unless generated.
fn module_of_weight(name: &str) -> Option<String> {
    if is_generated_name(name) {
        return None;
    }
    name.strip_suffix(".weight")
        .filter(|m| !m.is_empty())
        .map(str::to_string)
}

/// The module path of a TorchScript node name `/a/b.0/c/Op` → `a.b.0.c`.
fn module_of_scope(node_name: &str) -> Option<String> {
    let rest = node_name.strip_prefix('/')?;
    let (scope, _op) = rest.rsplit_once('/')?;
    let parts: Vec<&str> = scope.split('/').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return None;
    }
    Some(parts.join("."))
}

/// `tensor` as a 2-D float initializer, read as is (`false`) or through a 2-D Transpose
/// (`true`).
fn weight_read<'g>(
    index: &GraphIndex<'g>,
    inits: &HashSet<&str>,
    tensor: &str,
) -> Option<(&'g TensorProto, bool)> {
    let two_d_float = |t: &&TensorProto| {
        t.dims.len() == 2 && is_float_type(t.data_type()) && t.dims[0] > 0 && t.dims[1] > 0
    };
    if let Some(t) = index.constant_tensor(tensor).filter(two_d_float) {
        return inits.contains(tensor).then_some((t, false));
    }
    let (_, producer) = index.producer(tensor)?;
    let plain_transpose = producer.op_type() == "Transpose"
        && producer.domain().is_empty()
        && attr_ints(producer, "perm").is_none_or(|p| p == [1, 0]);
    if !plain_transpose {
        return None;
    }
    let source = producer.input.first()?;
    let t = index.constant_tensor(source).filter(two_d_float)?;
    inits.contains(source.as_str()).then_some((t, true))
}

/// The linear layer `node` computes, if it is one.
fn linear_of(
    index: &GraphIndex,
    inits: &HashSet<&str>,
    gathered: &HashSet<&str>,
    i: usize,
    node: &NodeProto,
) -> Option<Linear> {
    if !node.domain().is_empty() || node.input.len() < 2 || node.output.is_empty() {
        return None;
    }
    let (t, transposed) = match node.op_type() {
        "MatMul" => weight_read(index, inits, &node.input[1])?,
        "Gemm" => {
            if attr_i(node, "transA").unwrap_or(0) != 0 {
                return None;
            }
            let (t, transposed) = weight_read(index, inits, &node.input[1])?;
            (t, transposed != (attr_i(node, "transB").unwrap_or(0) != 0))
        }
        _ => return None,
    };
    // read transposed, the stored weight is [out, in]
    let layout = if transposed {
        Layout::OutIn
    } else {
        Layout::InOut
    };
    let (in_features, out_features) = match layout {
        Layout::OutIn => (t.dims[1], t.dims[0]),
        Layout::InOut => (t.dims[0], t.dims[1]),
    };
    // The weight's name is the module's own path; TorchScript's scope lists only the modules
    // whose forward ran (OPT's causal LM calls its decoder directly: `decoder.layers.0...`
    // for `model.decoder.layers.0...`), so it is the fallback — and the only name a tied head
    // has, whose weight is the embedding's.
    let scope = || module_of_scope(node.name()).map(|m| (m, PathSource::NodeScope));
    let module = if gathered.contains(t.name()) {
        scope()
    } else {
        module_of_weight(t.name())
            .map(|m| (m, PathSource::WeightName))
            .or_else(scope)
    };
    Some(Linear {
        node: i,
        weight: t.name().to_string(),
        layout,
        in_features,
        out_features,
        module,
    })
}

/// Every linear layer of the graph's top level, in node order. A weight an embedding also
/// reads (a tied LM head) counts only where TorchScript's node scope names the head's own
/// module: its weight's name is the embedding's.
pub fn linear_layers(index: &GraphIndex) -> Vec<Linear> {
    let inits: HashSet<&str> = index.graph.initializer.iter().map(|t| t.name()).collect();
    let gathered: HashSet<&str> = index
        .graph
        .node
        .iter()
        .filter(|n| n.op_type() == "Gather" && n.domain().is_empty())
        .filter_map(|n| n.input.first().map(String::as_str))
        .collect();
    index
        .graph
        .node
        .iter()
        .enumerate()
        .filter_map(|(i, n)| linear_of(index, &inits, &gathered, i, n))
        .filter(|l| !gathered.contains(l.weight.as_str()) || l.module.is_some())
        .collect()
}

/// Every embedding table of the graph's top level as `--quantize-targets` names it: the 2-D
/// float initializer a `Gather` on axis 0 reads, `[rows, width]` taken as a linear layer's
/// `[out, in]` (its rows are what the Gather takes); its module from the weight's name, else
/// the Gather's TorchScript scope.
pub fn embedding_tables(index: &GraphIndex) -> Vec<Linear> {
    let inits: HashSet<&str> = index.graph.initializer.iter().map(|t| t.name()).collect();
    let mut seen = HashSet::new();
    let mut tables = Vec::new();
    for (i, n) in index.graph.node.iter().enumerate() {
        let axis_0 = attr_i(n, "axis").unwrap_or(0) == 0;
        if n.op_type() != "Gather" || !n.domain().is_empty() || n.input.len() != 2 || !axis_0 {
            continue;
        }
        let Some((t, false)) = weight_read(index, &inits, &n.input[0]) else {
            continue;
        };
        if !seen.insert(t.name()) {
            continue;
        }
        let module = module_of_weight(t.name())
            .map(|m| (m, PathSource::WeightName))
            .or_else(|| module_of_scope(n.name()).map(|m| (m, PathSource::NodeScope)));
        tables.push(Linear {
            node: i,
            weight: t.name().to_string(),
            layout: Layout::OutIn,
            in_features: t.dims[1],
            out_features: t.dims[0],
            module,
        });
    }
    tables
}

impl Linear {
    /// PEFT's rule: a target matches a module whose path is the target or ends in `.target`.
    /// Without a module path, the weight's name matches where one of its `.`/`/`-separated
    /// parts is the target.
    pub fn matches(&self, target: &str) -> bool {
        match &self.module {
            Some((m, _)) => m == target || m.ends_with(&format!(".{target}")),
            None => self.weight.split(['.', '/']).any(|part| part == target),
        }
    }
}

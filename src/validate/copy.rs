//! The validation copy: the patched graph, in memory, with the flat logits and labels (and the
//! CE's class weights, if any) as extra outputs, so the independent reference sees exactly the
//! values the runtime used. For runtimes without `SoftmaxCrossEntropyLoss` the CE node is
//! replaced by its primitive-op form. The model file itself is never written.

use std::collections::HashSet;

use crate::error::Error;
use crate::graph::GraphIndex;
use crate::onnx::{value_info_shape, GraphProto, ModelProto, NodeProto, ValueInfoProto, FLOAT};
use crate::rewrite::CE_OUTPUT;
use crate::validate::emit::{Emitter, Out};
use crate::validate::meta::PatchMeta;
use crate::validate::primitive_ce::{self, CeSpec};

pub struct ValidationCopy {
    pub model: ModelProto,
    /// Output names of the flat logits `[M, V]`, flat labels `[M]` and class weights.
    pub flat_logits: String,
    pub flat_labels: String,
    pub class_weights: Option<String>,
    /// The tensor the CE node reads its labels from (to find the labels graph input).
    pub ce_labels: String,
}

/// The patched CE: the `SoftmaxCrossEntropyLoss` that writes `ce_loss`.
pub fn find_ce_node(model: &ModelProto) -> Result<(usize, &NodeProto), Error> {
    let graph = model.graph.as_ref().expect("checked on load");
    graph
        .node
        .iter()
        .enumerate()
        .find(|(_, n)| n.op_type() == "SoftmaxCrossEntropyLoss" && n.output.first().map(String::as_str) == Some(CE_OUTPUT))
        .ok_or_else(|| {
            Error::Validation(format!(
                "the graph has no SoftmaxCrossEntropyLoss writing '{CE_OUTPUT}'; validate reads graphs written by ntl-patch, re-patch the original model"
            ))
        })
}

pub fn build(
    model: &ModelProto,
    meta: &PatchMeta,
    primitive_ce: bool,
) -> Result<ValidationCopy, Error> {
    let (ce_index, ce_node) = find_ce_node(model)?;
    let ce_node = ce_node.clone();
    let graph = model.graph.as_ref().expect("checked on load");
    let index = GraphIndex::new(graph);
    for t in [&meta.flat_logits, &meta.flat_labels] {
        if index.producer(t).is_none() && !index.is_graph_input(t) {
            return Err(Error::Validation(format!(
                "the metadata names tensor '{t}', which the graph does not compute; re-patch the original model"
            )));
        }
    }
    let log_prob_used = ce_node.output.get(1).is_some_and(|o| {
        !o.is_empty() && (!index.consumers(o).is_empty() || index.is_graph_output(o))
    });
    let loss_type = graph
        .output
        .iter()
        .find(|o| o.name() == CE_OUTPUT)
        .and_then(value_info_shape)
        .map(|(t, _)| t)
        .filter(|&t| t != 0)
        .unwrap_or(FLOAT);

    let mut e = Emitter::new(index.taken_names());
    // Identity outputs: a graph output may not be an initializer or an input in every runtime.
    let flat_logits = e.node(
        "Identity",
        &[&meta.flat_logits],
        vec![],
        Out::Fresh("flat_logits"),
    );
    let flat_labels = e.node(
        "Identity",
        &[&meta.flat_labels],
        vec![],
        Out::Fresh("flat_labels"),
    );
    let class_weights = ce_node
        .input
        .get(2)
        .filter(|w| !w.is_empty())
        .map(|w| e.node("Identity", &[w], vec![], Out::Fresh("class_weights")));
    let extra_nodes = std::mem::take(&mut e.nodes);

    if primitive_ce {
        primitive_ce::emit(
            &mut e,
            &CeSpec {
                node: &ce_node,
                flat_logits: &meta.flat_logits,
                flat_labels: &meta.flat_labels,
                loss_type,
                log_prob_used,
            },
        );
    }

    let mut model = model.clone();
    let graph = model.graph.as_mut().expect("checked on load");
    if primitive_ce {
        graph.node.remove(ce_index);
        graph.node.append(&mut e.nodes);
    }
    graph.node.extend(extra_nodes);
    graph.initializer.append(&mut e.initializers);
    // The replacement reads the flat tensors, which the patch computes after the CE node, so
    // it cannot simply take the node's place: restore a topological order instead.
    topological_sort(graph);
    for name in [
        Some(&flat_logits),
        Some(&flat_labels),
        class_weights.as_ref(),
    ]
    .into_iter()
    .flatten()
    {
        graph.output.push(ValueInfoProto {
            name: Some(name.clone()),
            ..Default::default()
        });
    }
    crate::patch::check_consistency(&model).map_err(|e| {
        Error::Validation(format!("internal error building the validation copy: {e}"))
    })?;
    Ok(ValidationCopy {
        model,
        flat_logits,
        flat_labels,
        class_weights,
        ce_labels: ce_node.input.get(1).cloned().unwrap_or_default(),
    })
}

/// Stable topological order: nodes keep their relative order unless an input is not yet
/// defined, in which case they wait for it (one pass for an already sorted graph).
fn topological_sort(graph: &mut GraphProto) {
    let mut defined: HashSet<String> = graph
        .input
        .iter()
        .map(|v| v.name().to_string())
        .chain(graph.initializer.iter().map(|t| t.name().to_string()))
        .collect();
    let mut pending = std::mem::take(&mut graph.node);
    loop {
        let before = pending.len();
        let mut waiting = Vec::new();
        for node in pending {
            if node
                .input
                .iter()
                .all(|i| i.is_empty() || defined.contains(i))
            {
                defined.extend(node.output.iter().cloned());
                graph.node.push(node);
            } else {
                waiting.push(node);
            }
        }
        pending = waiting;
        if pending.is_empty() || pending.len() == before {
            // a cycle or an undefined input: keep the rest as is, the consistency check reports it
            graph.node.append(&mut pending);
            return;
        }
    }
}

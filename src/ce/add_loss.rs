//! `--add-loss`: a logits-only export (optimum, or a plain `torch.onnx.export` of a language
//! model) has no loss to patch. This adds the one Hugging Face causal LMs compute — an int64
//! `labels` input of the logits' leading shape, the causal shift (labels padded with -100 on
//! the right and moved left by one, so position t is scored against token t+1), and a mean
//! `SoftmaxCrossEntropyLoss` with `ignore_index=-100` over all positions — as the graph's first
//! output `loss`. The original outputs stay. The result is an ordinary training graph: the
//! patch continues on it, and `step`, `artifacts` and ORT's `generate_artifacts(loss=None)`
//! take it unchanged.

use crate::error::Error;
use crate::graph::patch::{splice, Splice};
use crate::graph::GraphIndex;
use crate::onnx::proto::type_proto;
use crate::onnx::{
    default_opset, int_attr, is_float_type, scalar_value_info, string_attr, GraphProto, ModelProto,
    TypeProto, ValueInfoProto, INT64,
};
use ntl_ops::names::PREFIX;
use ntl_ops::Builder;

/// The name of the added labels input and loss output.
pub const LABELS: &str = "labels";
pub const LOSS: &str = "loss";
const IGNORE_INDEX: i64 = -100;

/// The graph's logits: its one float output of rank 3 whose last dim is static (the
/// vocabulary), or of rank 2 when none has rank 3.
pub fn logits_output(graph: &GraphProto) -> Result<&ValueInfoProto, Error> {
    let candidates = |rank: usize| -> Vec<&ValueInfoProto> {
        graph
            .output
            .iter()
            .filter(|o| {
                crate::onnx::value_info_shape(o).is_some_and(|(t, dims)| {
                    is_float_type(t)
                        && dims.is_some_and(|d| {
                            d.len() == rank && d.last().copied().flatten().is_some()
                        })
                })
            })
            .collect()
    };
    let mut found = candidates(3);
    if found.is_empty() {
        found = candidates(2);
    }
    match found.as_slice() {
        [one] => Ok(one),
        [] => Err(Error::Usage(
            "--add-loss needs a float graph output of shape [B, T, V] (or [N, V]) with a static vocabulary size V; export the model's logits with their shape".into(),
        )),
        many => Err(Error::Usage(format!(
            "--add-loss found {} logits-like outputs ({}); export only the logits",
            many.len(),
            many.iter().map(|o| o.name()).collect::<Vec<_>>().join(", ")
        ))),
    }
}

/// Adds `labels`, the (shifted) cross-entropy and the `loss` output. Returns a one-line notice.
pub fn add_loss(model: &mut ModelProto, shift: bool) -> Result<String, Error> {
    let opset = default_opset(model).ok_or(Error::NoOpset)?;
    let graph = model.graph.as_mut().expect("loaded models have a graph");
    let logits_vi = logits_output(graph)?.clone();
    let (elem, dims) = crate::onnx::value_info_shape(&logits_vi).expect("checked");
    let dims = dims.expect("checked");
    let rank = dims.len();
    let vocab = dims[rank - 1].expect("checked");
    let taken = GraphIndex::new(graph).taken_names(PREFIX, &[LABELS, LOSS]);
    for name in [LABELS, LOSS] {
        if taken.contains(name) {
            return Err(Error::OutputNameTaken(name.into()));
        }
    }
    let mut b = Builder::new(PREFIX, opset, taken);
    b.claim(LABELS);
    b.claim(LOSS);
    let logits = logits_vi.name().to_string();
    let shifted = shift && rank == 3;
    let labels = if shifted {
        // HF's shift: labels padded with -100 on the right, then [:, 1:]
        let shape = b.node("Shape", &[LABELS], "added_labels_shape", vec![]);
        let batch = b.slice(&shape, 0, 1, 0, "added_batch");
        let one = b.const_i64("added_one", &[1], &[1]);
        let pad_shape = b.concat(&[&batch, &one], 0, "added_pad_shape");
        let fill = b.const_i64("added_ignore", &[], &[IGNORE_INDEX]);
        let pad = b.node("Expand", &[&fill, &pad_shape], "added_pad", vec![]);
        let padded = b.concat(&[LABELS, &pad], 1, "added_padded_labels");
        b.slice(&padded, 1, i64::MAX, 1, "added_shifted_labels")
    } else {
        LABELS.to_string()
    };
    let flat_logits = b.reshape(&logits, &[-1, vocab], "added_flat_logits");
    let flat_labels = b.reshape(&labels, &[-1], "added_flat_labels");
    let log_prob = b.fresh("added_log_prob");
    b.node_to(
        "SoftmaxCrossEntropyLoss",
        &[&flat_logits, &flat_labels],
        &[LOSS, &log_prob],
        vec![
            int_attr("ignore_index", IGNORE_INDEX),
            string_attr("reduction", "mean"),
        ],
    );
    splice(graph, Splice::append(b.nodes));
    graph.initializer.extend(b.initializers);
    graph.input.push(labels_input(&logits_vi));
    graph.output.insert(0, scalar_value_info(LOSS, elem));
    Ok(format!(
        "no cross-entropy in the graph: added input '{LABELS}' {}, {}cross-entropy (ignore_index {IGNORE_INDEX}, mean) on '{logits}' as output '{LOSS}'",
        if rank == 3 { "[B, T]" } else { "[N]" },
        if shifted { "the causal shift of Hugging Face causal LMs and a " } else { "a " },
    ))
}

/// `labels`: int64 with the logits' leading dims (their symbolic names kept).
fn labels_input(logits: &ValueInfoProto) -> ValueInfoProto {
    let mut t = match logits.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => t.clone(),
        _ => type_proto::Tensor::default(),
    };
    t.elem_type = Some(INT64);
    if let Some(shape) = t.shape.as_mut() {
        shape.dim.pop();
    }
    ValueInfoProto {
        name: Some(LABELS.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(t)),
            ..Default::default()
        }),
        ..Default::default()
    }
}

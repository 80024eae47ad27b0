//! Builds the patch for one cross-entropy site: the trainable CE node, the number loss, and
//! the new total under the original loss name.

use ntl_ops::ce;
use ntl_ops::combine;
use ntl_ops::losses::{self, FlatInputs};
use ntl_ops::names::{CE_OUTPUT, NUMBER_OUTPUT, PREFIX};
use ntl_ops::numbers::NumberTokens;
use ntl_ops::options::{LossKind, LossOptions};
use ntl_ops::Builder;

use super::loss_inputs;
use crate::ce::site::{CePattern, CeSite};
use crate::error::Error;
use crate::graph::patch::{Patch, METADATA_KEY};
use crate::graph::GraphIndex;
use crate::onnx::{scalar_value_info, NodeProto, FLOAT};

/// The exact names outside the `ntl/` prefix that [`build_forward`] claims: the taken names of
/// a builder that reaches it (`GraphIndex::taken_names`).
pub const CLAIMED: [&str; 2] = [CE_OUTPUT, NUMBER_OUTPUT];

/// `others` are the graph's other cross-entropies: they are rewritten into trainable
/// `SoftmaxCrossEntropyLoss` nodes too (both outputs declared), their values unchanged.
pub fn build_patch(
    index: &GraphIndex,
    opset: i64,
    site: &CeSite,
    others: &[CeSite],
    tokens: &NumberTokens,
    opts: &LossOptions,
) -> Result<Patch, Error> {
    let mut b = Builder::new(PREFIX, opset, index.taken_names(PREFIX, &CLAIMED));

    // The node that writes the loss the graph reports, when that is not the CE's own output:
    // the end of a rescaling chain (HF Trainer's `Div(num_items_in_batch)`), the scalar a
    // per-position (`reduction='none'`) loss is reduced to, or a larger loss the CE is part of.
    let (reported_by, rescaled_by) = reported_by(index, site)?;
    let mut forward = build_forward(
        &mut b,
        index,
        site,
        tokens,
        opts,
        true,
        reported_by.is_some(),
    )?;
    // With a reported loss further on, the number loss goes there too: it may read masks the
    // graph computes after the cross-entropy.
    let number_nodes = match reported_by {
        Some(_) => forward.nodes.split_off(forward.ce_count),
        None => Vec::new(),
    };
    let mut replacements = vec![(site.node_index, std::mem::take(&mut forward.nodes))];
    let mut reported = site.loss_output.clone();
    if let Some((last, output)) = reported_by {
        // That value becomes `ce_loss`, and the number loss is added after it, so
        // `loss = reported + λ·number_loss` whatever the reduction and scaling.
        let mut node = index.graph.node[last].clone();
        let k = node.output.iter().position(|o| *o == output).unwrap_or(0);
        reported = node.output[k].clone();
        node.output[k] = CE_OUTPUT.to_string();
        let loss_type = index.elem_type(&reported).unwrap_or(forward.loss_type);
        combine::total(&mut b, opts, loss_type, &reported);
        let mut nodes = vec![node];
        nodes.extend(number_nodes);
        nodes.append(&mut b.nodes);
        replacements.push((last, nodes));
    }
    for other in others {
        let node = ce::cross_entropy_node(&mut b, &other.ce_node(), &other.loss_output);
        replacements.push((other.node_index, vec![node]));
    }
    replacements.extend(declare_layer_norm_statistics(index, &mut b));
    Ok(Patch {
        replacements,
        initializers: b.initializers,
        outputs: added_outputs(forward.loss_type),
        metadata: vec![(
            METADATA_KEY.into(),
            metadata(
                site,
                &forward.flat,
                (&forward.number_labels, forward.number_logits.as_deref()),
                tokens,
                opts,
                &reported,
                &rescaled_by,
            ),
        )],
    })
}

/// `LayerNormalization` nodes with their optional `Mean` and `InvStdDev` outputs declared: ORT
/// Training's gradient builder reads them (like `SoftmaxCrossEntropyLoss`'s `log_prob`) and
/// fails on exported graphs that leave them out. The values of the other outputs are unchanged.
fn declare_layer_norm_statistics(
    index: &GraphIndex,
    b: &mut Builder,
) -> Vec<(usize, Vec<NodeProto>)> {
    index
        .graph
        .node
        .iter()
        .enumerate()
        .filter(|(_, n)| {
            n.op_type() == "LayerNormalization"
                && matches!(n.domain(), "" | "ai.onnx")
                && (n.output.len() < 3 || n.output.iter().any(String::is_empty))
        })
        .map(|(i, n)| {
            let mut node = n.clone();
            node.output.resize(3, String::new());
            for (k, hint) in [(1, "layer_norm_mean"), (2, "layer_norm_inv_std_dev")] {
                if node.output[k].is_empty() {
                    node.output[k] = b.fresh(hint);
                }
            }
            (i, vec![node])
        })
        .collect()
}

/// A node (index) and one of its outputs.
type NodeOutput = (usize, String);

/// Where the loss the graph reports is written, when that is not the CE's own output: the
/// node and its output, and the op types on the way (for the metadata). A per-position CE
/// (`reduction='none'`) ends in the scalar `ce_reported` found; a scalar CE passes through a
/// rescaling chain (HF Trainer's `Div(num_items_in_batch)`) or, when it is no graph output
/// itself, into the first scalar graph output that depends on it (`0.5·CE + aux`).
fn reported_by(
    index: &GraphIndex,
    site: &CeSite,
) -> Result<(Option<NodeOutput>, Vec<String>), Error> {
    if site.reduction == "none" {
        let reported = site
            .reported
            .as_ref()
            .ok_or_else(|| Error::UnsupportedReduction(site.reduction.clone()))?;
        return Ok((
            Some((reported.producer, reported.output.clone())),
            reported.path.clone(),
        ));
    }
    let chain = reported_chain(index, site);
    if let Some(&last) = chain.last() {
        let ops = chain
            .iter()
            .map(|&i| index.graph.node[i].op_type().to_string())
            .collect();
        let output = index.graph.node[last].output[0].clone();
        return Ok((Some((last, output)), ops));
    }
    if index.is_graph_output(&site.loss_output) {
        return Ok((None, Vec::new()));
    }
    Ok(
        match crate::ce::reported::reported_loss(index, &site.loss_output) {
            Some(r) => (Some((r.producer, r.output)), r.path),
            None => (None, Vec::new()),
        },
    )
}

/// Ops that rescale a scalar loss on its way to the graph output.
const RESCALING: &[&str] = &["Div", "Mul", "Cast", "Identity"];

/// The nodes between the cross-entropy's loss output and the graph output that reports it,
/// when the loss only passes through rescalings (one consumer each, the loss as the first
/// operand of a Div). Empty when the CE's output is itself a graph output or anything else
/// happens to it on the way.
fn reported_chain(index: &GraphIndex, site: &CeSite) -> Vec<usize> {
    let mut chain = Vec::new();
    let mut t = site.loss_output.clone();
    for _ in 0..16 {
        if index.is_graph_output(&t) {
            return chain;
        }
        let [consumer] = index.consumers(&t) else {
            return Vec::new();
        };
        let node = &index.graph.node[*consumer];
        let ok = RESCALING.contains(&node.op_type())
            && node.output.len() == 1
            && (node.op_type() != "Div" || node.input.first() == Some(&t));
        if !ok {
            return Vec::new();
        }
        chain.push(*consumer);
        t = node.output[0].clone();
    }
    Vec::new()
}

/// The forward half of a patch: the CE node, the number loss and the total.
pub struct Forward {
    /// Nodes that replace the loss node, in order (the CE node first).
    pub nodes: Vec<NodeProto>,
    /// How many of `nodes` compute the cross-entropy (its node and label smoothing).
    pub ce_count: usize,
    pub flat: FlatInputs,
    /// The labels the number loss reads: `flat.labels` with the positions the graph's masks
    /// drop set to -100 (the same tensor where nothing is masked).
    pub number_labels: String,
    /// The `[M, V]` logits the number loss reads where they are not `flat.logits`.
    pub number_logits: Option<String>,
    /// Element type of the cross-entropy (the logits' type).
    pub loss_type: i32,
}

/// Emits the forward nodes; `peel` lets the loss read `[B, T, V]` logits before an exporter's
/// Transpose (forward mode) instead of the CE's own scores (artifacts mode needs the scores'
/// layout to add its gradient into the CE gradient).
pub fn build_forward(
    b: &mut Builder,
    index: &GraphIndex,
    site: &CeSite,
    tokens: &NumberTokens,
    opts: &LossOptions,
    peel: bool,
    combine_later: bool,
) -> Result<Forward, Error> {
    let per_position = site.reduction == "none" && site.reported.is_some();
    if !matches!(site.reduction.as_str(), "mean" | "sum") && !per_position {
        return Err(Error::UnsupportedReduction(site.reduction.clone()));
    }
    for name in [CE_OUTPUT, NUMBER_OUTPUT] {
        if !b.claim(name) {
            return Err(Error::OutputNameTaken(name.into()));
        }
    }
    // With a rescaling chain after the CE, the CE keeps its output (the chain reads it) and the
    // caller combines at the chain's end.
    let ce_out = if combine_later {
        site.loss_output.as_str()
    } else {
        CE_OUTPUT
    };
    let eps = opts.label_smoothing;
    if let (true, CePattern::Rewritten(form)) = (eps > 0.0, site.pattern) {
        if crate::ce::forms::is_smoothed(form) {
            return Err(Error::Usage(format!(
                "--label-smoothing: the graph's cross-entropy already smooths its labels ({form}); drop --label-smoothing"
            )));
        }
    }
    let ce_node = if eps > 0.0 {
        if site.weights.is_some() {
            return Err(Error::Usage(
                "--label-smoothing with class weights is not supported: drop one of them".into(),
            ));
        }
        let unsmoothed = b.fresh("ce_unsmoothed");
        let node = ce::cross_entropy_node(b, &site.ce_node(), &unsmoothed);
        let scores_type = index.elem_type(&site.scores).unwrap_or(FLOAT);
        ce::smooth(b, &site.ce_node(), scores_type, &unsmoothed, ce_out, eps);
        node
    } else {
        ce::cross_entropy_node(b, &site.ce_node(), ce_out)
    };
    // the cross-entropy's own nodes, before anything the number loss emits
    let mut ce_nodes = vec![ce_node];
    ce_nodes.append(&mut b.nodes);
    let flat = loss_inputs::flatten_inputs(b, index, site, tokens.table.width(), peel)?;
    let masks = site
        .reported
        .as_ref()
        .map_or(&[][..], |r| r.masks.as_slice());
    let number_flat = FlatInputs {
        labels: loss_inputs::masked_labels(b, index, &site.loss_output, &flat.labels, masks),
        ..flat.clone()
    };
    let mut number_flat = number_flat;
    if opts.kind.skips_ignore_index() {
        number_flat = losses::drop_ignored(b, &number_flat);
    }
    // the logits the number loss reads, where they are not `flat.logits`: DEL's BCE reads the
    // logits, not the log-probabilities a LogSoftmax + NLL cross-entropy reads
    let mut number_logits = None;
    if opts.kind == LossKind::Del {
        if let Some(raw) = loss_inputs::raw_logit_rows(b, index, site, tokens.table.width())? {
            if !peel {
                return Err(Error::Usage(
                    "--loss del reads the raw logits, and this training graph's cross-entropy reads log-probabilities (LogSoftmax before it), whose gradient artifacts mode cannot extend; patch the forward graph instead (ntl-patch MODEL, then generate_artifacts, or ntl-patch step)".into(),
                ));
            }
            number_logits = Some(raw.clone());
            number_flat.logits = raw;
        }
    }
    let seq = match opts.kind.is_sequence_level() {
        true => Some(loss_inputs::sequence_inputs(b, index, site, &number_flat)?),
        false => None,
    };
    let number = losses::number_loss(b, &number_flat, seq.as_ref(), tokens, opts);
    b.node_to("Identity", &[&number], &[NUMBER_OUTPUT], vec![]);
    let loss_type = index.elem_type(&site.logits).unwrap_or(FLOAT);
    if !combine_later {
        combine::total(b, opts, loss_type, &site.loss_output);
    }
    let ce_count = ce_nodes.len();
    let mut nodes = ce_nodes;
    nodes.append(&mut b.nodes);
    Ok(Forward {
        ce_count,
        nodes,
        number_labels: number_flat.labels,
        number_logits,
        flat,
        loss_type,
    })
}

/// The `ce_loss` and `number_loss` graph outputs.
pub fn added_outputs(loss_type: i32) -> Vec<crate::onnx::ValueInfoProto> {
    vec![
        scalar_value_info(CE_OUTPUT, loss_type),
        scalar_value_info(NUMBER_OUTPUT, FLOAT),
    ]
}

/// What `validate` needs to check a patched graph on its own: the options and the tensors the
/// number loss reads. serde_json sorts keys, so the text is deterministic.
pub fn metadata(
    site: &CeSite,
    flat: &FlatInputs,
    (number_labels, number_logits): (&str, Option<&str>),
    tokens: &NumberTokens,
    opts: &LossOptions,
    loss_output: &str,
    rescaled_by: &[String],
) -> String {
    let mut v = opts.to_json();
    let extra = serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "ce_node": site.node_name,
        "pattern": site.pattern.describe(),
        "reduction": site.reduction,
        "ignore_index": site.ignore_index,
        "flat_logits": flat.logits,
        "flat_labels": flat.labels,
        "number_labels": number_labels,
        "vocab_width": tokens.table.width(),
        "loss_output": loss_output,
        "rescaled_by": rescaled_by,
    });
    for (k, x) in extra.as_object().expect("object") {
        v[k] = x.clone();
    }
    if let Some(logits) = number_logits {
        v["number_logits"] = logits.into();
    }
    v.to_string()
}

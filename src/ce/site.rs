//! Finding the cross-entropy the number loss attaches to, in each form exporters produce.
//!
//! Every form is reduced to one description, [`CeSite`]: the scores tensor whose axis 1 is the
//! class axis, the labels, and where the scalar loss leaves the node. `LogSoftmax` +
//! `NegativeLogLikelihoodLoss` is read as a cross-entropy on the log-probabilities: softmax is
//! idempotent on log-probabilities (`softmax(log_softmax(x)) = softmax(x)`), so
//! `SoftmaxCrossEntropyLoss(log_probs)` equals the NLL and ORT can differentiate it.

use crate::graph::GraphIndex;
use crate::onnx::{attr_i, attr_s, NodeProto};

/// The exporter pattern a cross-entropy was found in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CePattern {
    /// `SoftmaxCrossEntropyLoss` (TorchScript exporter, dynamo `cross_entropy`).
    SoftmaxCrossEntropy,
    /// `NegativeLogLikelihoodLoss` on `LogSoftmax` output (dynamo `log_softmax` + `nll_loss`).
    LogSoftmaxNll,
    /// A form spelled out of primitive ops, rewritten by `ce_forms` (one of `ce_forms::FORMS`).
    Rewritten(&'static str),
}

impl CePattern {
    pub fn describe(self) -> &'static str {
        match self {
            CePattern::SoftmaxCrossEntropy => "SoftmaxCrossEntropyLoss",
            CePattern::LogSoftmaxNll => "LogSoftmax + NegativeLogLikelihoodLoss",
            CePattern::Rewritten(form) => form,
        }
    }
}

/// Everything the rewrite needs to know about one cross-entropy.
#[derive(Debug, Clone)]
pub struct CeSite {
    pub pattern: CePattern,
    /// Index of the loss node in `graph.node`.
    pub node_index: usize,
    pub node_name: String,
    /// Scores fed to the loss node, class axis 1 (`[N, C]` or `[N, C, d1, ...]`).
    pub scores: String,
    /// The tensor whose last axis carries the classes and that the scores are a layout view of
    /// (`scores` itself for rank 2; the input of the exporter's Transpose for `[B, V, T]`).
    pub logits: String,
    /// When `logits` differs from `scores`: `logits` is `[B, T, V]`-like, scores `[B, V, T]`.
    pub logits_class_last: bool,
    pub labels: String,
    pub weights: Option<String>,
    pub ignore_index: Option<i64>,
    pub reduction: String,
    /// The loss output (a scalar for reduction `mean`/`sum`).
    pub loss_output: String,
    /// The second output (`log_prob`) when the node declares one.
    pub log_prob_output: Option<String>,
    /// For reduction `none`: the scalar the graph reduces the per-position loss to, and the
    /// masks on the way (None when no scalar graph output depends on it).
    pub reported: Option<crate::ce::reported::Reported>,
}

impl CeSite {
    /// The loss node as the op library writes it back (both outputs declared).
    pub fn ce_node(&self) -> ntl_ops::ce::CeNode<'_> {
        ntl_ops::ce::CeNode {
            name: &self.node_name,
            scores: &self.scores,
            labels: &self.labels,
            weights: self.weights.as_deref(),
            ignore_index: self.ignore_index,
            reduction: &self.reduction,
            log_prob: self.log_prob_output.as_deref(),
        }
    }
}

/// All cross-entropy nodes of the main graph, in node order (malformed ones, without
/// scores, labels or a loss output, are left out: [`malformed_ce_node`] names them).
pub fn find_ce_sites(index: &GraphIndex) -> Vec<CeSite> {
    index
        .graph
        .node
        .iter()
        .enumerate()
        .filter_map(|(i, node)| match (node.domain(), node.op_type()) {
            ("" | "ai.onnx", "SoftmaxCrossEntropyLoss") => {
                let pattern = crate::ce::forms::form_of(node)
                    .map_or(CePattern::SoftmaxCrossEntropy, CePattern::Rewritten);
                site(index, i, node, pattern)
            }
            ("" | "ai.onnx", "NegativeLogLikelihoodLoss")
                if feeds_from_log_softmax(index, node) =>
            {
                site(index, i, node, CePattern::LogSoftmaxNll)
            }
            _ => None,
        })
        .collect()
}

/// A loss node without the inputs and output its op requires (ONNX: scores, labels[, weights]
/// → loss[, log_prob]), described for an error message.
pub fn malformed_ce_node(index: &GraphIndex) -> Option<String> {
    index
        .graph
        .node
        .iter()
        .filter(|n| is_ce_op(n))
        .find(|n| n.input.len() < 2 || n.input[..2].iter().any(String::is_empty) || n.output.first().is_none_or(String::is_empty))
        .map(|n| {
            format!(
                "{} node '{}' has {} input(s) and {} output(s), it needs scores and labels in and a loss out",
                n.op_type(),
                n.name(),
                n.input.len(),
                n.output.len()
            )
        })
}

/// Cross-entropy-like nodes inside subgraphs (If/Loop/Scan bodies), which are not patched.
pub fn nested_ce_nodes(index: &GraphIndex) -> Vec<String> {
    fn walk(graph: &crate::onnx::GraphProto, path: &str, found: &mut Vec<String>) {
        for node in &graph.node {
            for a in &node.attribute {
                for g in a.g.iter().chain(a.graphs.iter()) {
                    let here = format!("{path}{}/{}", node.name(), a.name());
                    for n in &g.node {
                        if is_ce_op(n) {
                            found.push(format!("{here}/{}", n.name()));
                        }
                    }
                    walk(g, &format!("{here}/"), found);
                }
            }
        }
    }
    let mut found = Vec::new();
    walk(index.graph, "", &mut found);
    found
}

fn is_ce_op(node: &NodeProto) -> bool {
    matches!(
        node.op_type(),
        "SoftmaxCrossEntropyLoss" | "NegativeLogLikelihoodLoss"
    )
}

fn feeds_from_log_softmax(index: &GraphIndex, nll: &NodeProto) -> bool {
    let mut tensor = nll.input.first().map(String::as_str).unwrap_or("");
    // Layout ops between LogSoftmax and the loss keep the values log-probabilities.
    for _ in 0..8 {
        match index.producer(tensor) {
            Some((_, n)) if n.op_type() == "LogSoftmax" => return true,
            Some((_, n)) if is_layout_op(n) => match n.input.first() {
                Some(input) => tensor = input.as_str(),
                None => return false,
            },
            _ => return false,
        }
    }
    false
}

fn is_layout_op(node: &NodeProto) -> bool {
    matches!(
        node.op_type(),
        "Reshape" | "Transpose" | "Identity" | "Squeeze" | "Unsqueeze" | "Flatten"
    )
}

fn site(index: &GraphIndex, i: usize, node: &NodeProto, pattern: CePattern) -> Option<CeSite> {
    let scores = node.input.first().filter(|s| !s.is_empty())?.clone();
    let labels = node.input.get(1).filter(|s| !s.is_empty())?.clone();
    let loss_output = node.output.first().filter(|s| !s.is_empty())?.clone();
    let (logits, logits_class_last) = class_last_source(index, &scores);
    let reduction = attr_s(node, "reduction").unwrap_or_else(|| "mean".into());
    let reported = (reduction == "none")
        .then(|| crate::ce::reported::reported_loss(index, &loss_output))
        .flatten();
    Some(CeSite {
        pattern,
        node_index: i,
        node_name: node.name().to_string(),
        scores,
        logits,
        logits_class_last,
        labels,
        weights: node.input.get(2).filter(|w| !w.is_empty()).cloned(),
        ignore_index: attr_i(node, "ignore_index"),
        reduction,
        loss_output,
        log_prob_output: node.output.get(1).filter(|o| !o.is_empty()).cloned(),
        reported,
    })
}

/// If the scores are `Transpose(x)` moving x's last axis to axis 1 (a `[B, T, V]` tensor
/// presented as `[B, V, T]`), the number loss reads x directly rather than transposing back.
fn class_last_source(index: &GraphIndex, scores: &str) -> (String, bool) {
    if let Some((_, node)) = index.producer(scores) {
        if node.op_type() == "Transpose" {
            if let Some(perm) = crate::onnx::attr_ints(node, "perm") {
                let r = perm.len() as i64;
                let mut expected = vec![0, r - 1];
                expected.extend(1..r - 1);
                match node.input.first().filter(|x| !x.is_empty()) {
                    Some(x) if r >= 3 && perm == expected => return (x.clone(), true),
                    _ => {}
                }
            }
        }
    }
    (scores.to_string(), false)
}

/// One line per site, for error messages and `inspect`.
pub fn describe_sites(sites: &[CeSite]) -> String {
    sites
        .iter()
        .map(|s| {
            format!(
                "'{}' ({}, scores '{}', labels '{}')",
                s.node_name,
                s.pattern.describe(),
                s.scores,
                s.labels
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

//! The cross-entropy half of a patch: a `SoftmaxCrossEntropyLoss` that ORT Training can
//! differentiate, and torch's label smoothing on its outputs.

use crate::onnx::{int_attr, string_attr, NodeProto, FLOAT, INT64};
use crate::Builder;

/// The cross-entropy a patch writes, as the graph's loss node reads it.
pub struct CeNode<'a> {
    /// The original node's name (empty: a fresh one).
    pub name: &'a str,
    /// Scores, class axis 1 (`[N, C]` or `[N, C, d1, ...]`).
    pub scores: &'a str,
    pub labels: &'a str,
    pub weights: Option<&'a str>,
    pub ignore_index: Option<i64>,
    /// `mean`, `sum` or `none`.
    pub reduction: &'a str,
    /// The `log_prob` output the original node declared, if any.
    pub log_prob: Option<&'a str>,
}

/// The replacement loss node: `SoftmaxCrossEntropyLoss(scores, labels[, weights])` with the
/// original attributes and BOTH outputs declared (ORT's gradient builder needs `log_prob`).
/// Its first output is renamed to `ce_loss`.
pub fn cross_entropy_node(b: &mut Builder, ce: &CeNode, ce_loss: &str) -> NodeProto {
    let log_prob = ce
        .log_prob
        .map_or_else(|| b.fresh("log_prob"), str::to_string);
    let mut inputs = vec![ce.scores.to_string(), ce.labels.to_string()];
    inputs.extend(ce.weights.map(str::to_string));
    let mut attribute = vec![string_attr("reduction", ce.reduction)];
    if let Some(ignore) = ce.ignore_index {
        attribute.push(int_attr("ignore_index", ignore));
    }
    let name = if ce.name.is_empty() {
        b.fresh("SoftmaxCrossEntropyLoss")
    } else {
        ce.name.to_string()
    };
    NodeProto {
        name: Some(name),
        op_type: Some("SoftmaxCrossEntropyLoss".into()),
        input: inputs,
        output: vec![ce_loss.to_string(), log_prob],
        attribute,
        ..Default::default()
    }
}

/// Label smoothing as torch defines it: `out = (1−ε)·loss + ε·S` with S the same reduction of
/// `−mean_c log p_c` over the positions the loss counts (not the ignore index). `loss` is the
/// node's first output; `t` is the scores' element type. The log-probabilities come from a
/// `LogSoftmax` of their own, not from the node's `log_prob` output: ONNX Runtime's gradient
/// of `SoftmaxCrossEntropyLoss` ignores whatever flows back into `log_prob`.
pub fn smooth(b: &mut Builder, ce: &CeNode, t: i32, loss: &str, out: &str, eps: f64) {
    let typed = |b: &mut Builder, hint: &str, v: f32| {
        let c = b.scalar_f32(hint, v);
        if t == FLOAT {
            c
        } else {
            b.cast(&c, t, hint)
        }
    };
    let log_prob = b.node(
        "LogSoftmax",
        &[ce.scores],
        "smooth_log_prob",
        vec![int_attr("axis", 1)],
    );
    let mean_lp = b.reduce("ReduceMean", &log_prob, &[1], false, "smooth_mean_log_prob");
    let per_position = b.unary("Neg", &mean_lp, "smooth_per_position");
    let kept = match ce.ignore_index {
        Some(ignore) => {
            let labels = b.cast(ce.labels, INT64, "smooth_labels");
            let ignore = b.const_i64("smooth_ignore_index", &[], &[ignore]);
            let ignored = b.equal(&labels, &ignore, "smooth_ignored");
            let kept = b.unary("Not", &ignored, "smooth_kept");
            Some(b.cast(&kept, t, "smooth_kept_f"))
        }
        None => None,
    };
    let masked = match &kept {
        Some(k) => b.binary("Mul", &per_position, k, "smooth_masked"),
        None => per_position,
    };
    let smoothed = match ce.reduction {
        "none" => masked,
        "sum" => b.reduce_sum(&masked, &[], false, "smooth_sum"),
        _ => match &kept {
            Some(k) => {
                let total = b.reduce_sum(&masked, &[], false, "smooth_sum");
                let count = b.reduce_sum(k, &[], false, "smooth_count");
                b.binary("Div", &total, &count, "smooth_mean")
            }
            None => b.reduce("ReduceMean", &masked, &[], false, "smooth_mean"),
        },
    };
    let keep = typed(b, "smooth_one_minus_eps", (1.0 - eps) as f32);
    let eps = typed(b, "smooth_eps", eps as f32);
    let a = b.binary("Mul", loss, &keep, "smooth_ce_part");
    let c = b.binary("Mul", &smoothed, &eps, "smooth_uniform_part");
    b.node_to("Add", &[&a, &c], &[out], vec![]);
}

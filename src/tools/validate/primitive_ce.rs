//! A `SoftmaxCrossEntropyLoss` spelled in primitive ops, for runtimes that lack it (tract):
//! LogSoftmax, GatherElements, Equal/Not/Where for the ignore index, ReduceSum/ReduceMean, Div.
//! It reads `[M, C]` logits and `[M]` labels holding the node's own inputs in class-last,
//! flattened layout (the patch's flat tensors for the patched CE, [`flatten_own_inputs`] for
//! any other), so the loss it gives is the node's.

use crate::graph::{static_rank, GraphIndex};
use crate::onnx::{attr_i, attr_s, i64_tensor, int_attr, ints_attr, NodeProto, FLOAT, INT64};
use crate::tools::validate::emit::{Emitter, Out};

pub struct CeSpec<'a> {
    /// The node being replaced (its attributes and outputs are honoured).
    pub node: &'a NodeProto,
    pub flat_logits: &'a str,
    pub flat_labels: &'a str,
    /// Element type of the node's loss output.
    pub loss_type: i32,
    /// Whether the node's `log_prob` output is read by anything.
    pub log_prob_used: bool,
}

/// Emits the replacement; the nodes write the node's outputs under the same names.
pub fn emit(e: &mut Emitter, spec: &CeSpec) {
    let node = spec.node;
    let reduction = attr_s(node, "reduction").unwrap_or_else(|| "mean".into());
    let ignore = attr_i(node, "ignore_index");
    let weights = node.input.get(2).filter(|w| !w.is_empty());

    // kept = labels != ignore; the gather index of ignored rows is clamped to 0 (any valid id)
    let (kept, index) = match ignore {
        Some(ignore) => {
            let ignore = e.constant("ignore_index", |n| i64_tensor(n, &[], &[ignore]));
            let zero = e.constant("zero_id", |n| i64_tensor(n, &[], &[0]));
            let ignored = e.node(
                "Equal",
                &[spec.flat_labels, &ignore],
                vec![],
                Out::Fresh("ignored"),
            );
            let kept = e.node("Not", &[&ignored], vec![], Out::Fresh("kept"));
            let index = e.node(
                "Where",
                &[&kept, spec.flat_labels, &zero],
                vec![],
                Out::Fresh("safe_labels"),
            );
            (Some(kept), index)
        }
        None => (None, spec.flat_labels.to_string()),
    };
    let col_shape = e.constant("col_shape", |n| i64_tensor(n, &[2], &[-1, 1]));
    let flat_shape = e.constant("flat_shape", |n| i64_tensor(n, &[1], &[-1]));
    let index_col = e.node(
        "Reshape",
        &[&index, &col_shape],
        vec![],
        Out::Fresh("label_col"),
    );
    // in the loss's type: a mixed-precision step graph's flat logits may be half while its
    // cross-entropy computes in float32 (a Cast to the same type is a no-op)
    let logits = e.node(
        "Cast",
        &[spec.flat_logits],
        vec![int_attr("to", spec.loss_type as i64)],
        Out::Fresh("ce_logits"),
    );
    let log_p = e.node(
        "LogSoftmax",
        &[&logits],
        vec![int_attr("axis", 1)],
        Out::Fresh("log_p"),
    );
    let picked = e.node(
        "GatherElements",
        &[&log_p, &index_col],
        vec![int_attr("axis", 1)],
        Out::Fresh("label_log_p_col"),
    );
    let picked = e.node(
        "Reshape",
        &[&picked, &flat_shape],
        vec![],
        Out::Fresh("label_log_p"),
    );

    // per-position weight: kept (0/1) times the class weight of the label
    let mut weight = kept.map(|k| {
        e.node(
            "Cast",
            &[&k],
            vec![int_attr("to", FLOAT as i64)],
            Out::Fresh("kept_f"),
        )
    });
    if let Some(w) = weights {
        let w = e.node(
            "Cast",
            &[w],
            vec![int_attr("to", FLOAT as i64)],
            Out::Fresh("class_weights_f"),
        );
        let wy = e.node(
            "Gather",
            &[&w, &index],
            vec![int_attr("axis", 0)],
            Out::Fresh("label_weight"),
        );
        weight = Some(match weight {
            Some(k) => e.node("Mul", &[&k, &wy], vec![], Out::Fresh("position_weight")),
            None => wy,
        });
    }
    let weighted = match &weight {
        Some(w) => e.node("Mul", &[&picked, w], vec![], Out::Fresh("weighted_log_p")),
        None => picked.clone(),
    };
    let keepdims = || vec![int_attr("keepdims", 0)];
    let loss = match (reduction.as_str(), &weight) {
        // per position, in the shape of the node's own labels
        ("none", _) => {
            let nll = e.node("Neg", &[&weighted], vec![], Out::Fresh("nll_flat"));
            let shape = e.node(
                "Shape",
                &[&node.input[1]],
                vec![],
                Out::Fresh("labels_shape"),
            );
            e.node("Reshape", &[&nll, &shape], vec![], Out::Fresh("nll"))
        }
        // with no ignore index and no class weights every position counts: the plain mean
        ("mean", None) => {
            let mean = e.node(
                "ReduceMean",
                &[&weighted],
                keepdims(),
                Out::Fresh("log_p_mean"),
            );
            e.node("Neg", &[&mean], vec![], Out::Fresh("nll_mean"))
        }
        (reduction, _) => {
            let total = e.node(
                "ReduceSum",
                &[&weighted],
                keepdims(),
                Out::Fresh("log_p_sum"),
            );
            let nll = e.node("Neg", &[&total], vec![], Out::Fresh("nll_sum"));
            match &weight {
                // mean = Σ w·nll / Σ w (w = kept · class weight)
                Some(w) if reduction == "mean" => {
                    let count = e.node(
                        "ReduceSum",
                        &[w.as_str()],
                        keepdims(),
                        Out::Fresh("weight_sum"),
                    );
                    e.node("Div", &[&nll, &count], vec![], Out::Fresh("nll_mean"))
                }
                _ => nll,
            }
        }
    };
    let out = node.output[0].as_str();
    if spec.loss_type == FLOAT {
        e.node("Identity", &[&loss], vec![], Out::Named(out));
    } else {
        e.node(
            "Cast",
            &[&loss],
            vec![int_attr("to", spec.loss_type as i64)],
            Out::Named(out),
        );
    }
    if spec.log_prob_used {
        if let Some(lp) = node.output.get(1).filter(|o| !o.is_empty()) {
            e.node(
                "LogSoftmax",
                &[&node.input[0]],
                vec![int_attr("axis", 1)],
                Out::Named(lp),
            );
        }
    }
}

/// For a CE the patch did not touch: its scores `[N, C, d1, ..]` as float32 `[N·d1·.., C]`
/// (class axis last, then flattened) and its labels as int64 `[N·d1·..]`, in matching order.
/// Also returns the element type of the node's loss. None where the scores' rank is unknown.
pub fn flatten_own_inputs(
    e: &mut Emitter,
    index: &GraphIndex,
    node: &NodeProto,
) -> Option<(String, String, i32)> {
    let scores = node.input.first()?;
    let labels = node.input.get(1)?;
    let rank = static_rank(index, scores)?;
    let elem = index.elem_type(scores).unwrap_or(FLOAT);
    let mut logits = scores.clone();
    if rank > 2 {
        let mut perm: Vec<i64> = vec![0];
        perm.extend(2..rank as i64);
        perm.push(1);
        let t = e.node(
            "Transpose",
            &[&logits],
            vec![ints_attr("perm", &perm)],
            Out::Fresh("scores_class_last"),
        );
        logits = e.node(
            "Flatten",
            &[&t],
            vec![int_attr("axis", rank as i64 - 1)],
            Out::Fresh("scores_2d"),
        );
    }
    if elem != FLOAT {
        logits = e.node(
            "Cast",
            &[&logits],
            vec![int_attr("to", FLOAT as i64)],
            Out::Fresh("scores_f32"),
        );
    }
    let label_type = index.elem_type(labels);
    let mut labels = labels.clone();
    if static_rank(index, &labels) != Some(1) {
        let flat = e.constant("labels_shape", |n| i64_tensor(n, &[1], &[-1]));
        labels = e.node(
            "Reshape",
            &[&labels, &flat],
            vec![],
            Out::Fresh("labels_1d"),
        );
    }
    if label_type.is_some_and(|t| t != INT64) {
        labels = e.node(
            "Cast",
            &[&labels],
            vec![int_attr("to", INT64 as i64)],
            Out::Fresh("labels_i64"),
        );
    }
    Some((logits, labels, elem))
}

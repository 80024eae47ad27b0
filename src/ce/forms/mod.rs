//! Cross-entropies spelled out of primitive ops — hand-written torch losses, TensorFlow/Keras via
//! tf2onnx, JAX/optax via jax2onnx — recognised by what they compute and rewritten into one
//! `SoftmaxCrossEntropyLoss(reduction='none')` before the patch runs.
//!
//! Every form is a per-position value built from logits `z` (classes on the last axis) and
//! integer labels `y`:
//! - the label's log-probability: `pick(log_softmax(z), y)`, where log_softmax is `LogSoftmax`,
//!   `Log(Softmax)`, `z − logsumexp(z)` or the max-shifted spelling, and pick is
//!   `GatherElements`/`GatherND` on the last axis or `ReduceSum(· × onehot(y))` with `OneHot`
//!   or `Equal(y, Range(V))`;
//! - the negative log-likelihood `logsumexp(z) − pick(z, y)` (optax, jax2onnx).
//!
//! The node that computes that value is replaced by `SoftmaxCrossEntropyLoss(reduction='none')`
//! (negated for the log-probability form), reshaped to the same shape, so every value the graph
//! computes stays the same, and the ops ONNX Runtime Training cannot differentiate (ReduceMax)
//! leave the gradient path. What follows (masks, sums, means, divisions) is left as it is;
//! `ce_reported` finds the reported loss and the masks on the way. Labels outside `[0, V)` pick
//! nothing in the one-hot forms (and, after counting from the end, in the gather forms), so
//! they become the ignore index.

mod match_ops;

use std::collections::BTreeSet;

use crate::error::Error;
use crate::graph::patch::{splice, Splice};
use crate::graph::GraphIndex;
use crate::onnx::{int_attr, string_attr, ModelProto, NodeProto, INT64};
use ntl_ops::names::PREFIX;
use ntl_ops::Builder;

pub use match_ops::constant_numbers;
use match_ops::{
    log_of_picked_softmax, log_softmax, log_sum_exp, pick, pick_through_moves, through_identity,
    Pick, Scalar, ValueShape,
};

/// Marks the rewritten node (its `doc_string`), followed by the form's description.
pub const MARKER: &str = "ntl-patch: cross-entropy rewritten from ";
/// The ignore index the rewritten node uses for labels that pick no class.
pub const IGNORE_INDEX: i64 = -100;

/// The forms, as `CeSite` patterns and metadata describe them.
/// Indexed `value kind × 4 + pick kind` (`Pick::kind`).
pub const FORMS: &[&str] = &[
    "log_softmax + GatherElements",
    "log_softmax + GatherND",
    "log_softmax × OneHot + ReduceSum",
    "log_softmax × Equal(labels, Range) + ReduceSum",
    "logsumexp − logits GatherElements",
    "logsumexp − logits GatherND",
    "logsumexp − logits × OneHot + ReduceSum",
    "logsumexp − logits × Equal(labels, Range) + ReduceSum",
    "log of softmax GatherElements",
    "log of softmax GatherND",
    "log of softmax × OneHot + ReduceSum",
    "log of softmax × Equal(labels, Range) + ReduceSum",
    // label-smoothed one-hots (`Smoothing`), indexed 12 + value kind × 2 + (pick kind − 2)
    "log_softmax × smoothed OneHot + ReduceSum",
    "log_softmax × smoothed Equal(labels, Range) + ReduceSum",
    "logsumexp − logits × smoothed OneHot + ReduceSum",
    "logsumexp − logits × smoothed Equal(labels, Range) + ReduceSum",
];

/// Whether a form smooths its one-hot (the graph's own label smoothing).
pub fn is_smoothed(form: &str) -> bool {
    FORMS[12..].contains(&form)
}

/// Names the `ε/V·(−Σ_c log p_c)` term a smoothed form's rewrite adds to the per-position
/// cross-entropy (under the `ntl/` prefix), so `ce_reported` follows the loss through that Add.
pub const SMOOTHING_TERM: &str = "ce_form/smoothing_term";

/// The form of a value kind (0 log-probability, 1 negative log-likelihood, 2 log of softmax)
/// and a pick, or None where that pairing does not compute a cross-entropy: a smoothed one-hot
/// inside the log (`log Σ_c h_c p_c`) is not one.
fn form(value_kind: usize, pick: &Pick) -> Option<&'static str> {
    match &pick.smoothing {
        None => Some(FORMS[value_kind * 4 + pick.kind]),
        Some(_) if value_kind < 2 && pick.kind >= 2 => {
            Some(FORMS[12 + value_kind * 2 + pick.kind - 2])
        }
        Some(_) => None,
    }
}

/// The form a rewritten node came from (one of [`FORMS`]).
pub fn form_of(node: &NodeProto) -> Option<&'static str> {
    let doc = node.doc_string.as_deref()?.strip_prefix(MARKER)?;
    FORMS.iter().copied().find(|f| *f == doc)
}

struct Core {
    /// The node computing the per-position value; it is replaced.
    root: usize,
    output: String,
    /// The value is the negative log-likelihood (else the label's log-probability).
    nll: bool,
    logits: String,
    pick: Pick,
    /// Nodes of the form besides `root`, removed when nothing else reads them.
    nodes: Vec<usize>,
    form: &'static str,
}

/// The rewrite of every recognised form in a graph, planned on its index and applied to the
/// model afterwards: a graph without any form is indexed once, by the caller, for everything.
pub struct Rewrite {
    patch: crate::graph::patch::Patch,
    /// Tensors that only the replaced forms read: removed with their producers when nothing
    /// reads them any more.
    removable: BTreeSet<String>,
    forms: Vec<&'static str>,
}

/// Whether the graph holds a recognised form (nothing is built).
pub fn found(index: &GraphIndex) -> bool {
    !find_cores(index).is_empty()
}

/// The rewrite of the forms in `index`'s graph, or None where it has none.
pub fn plan(index: &GraphIndex, opset: i64) -> Option<Rewrite> {
    let cores = find_cores(index);
    if cores.is_empty() {
        return None;
    }
    let graph = index.graph;
    let mut b = Builder::new(PREFIX, opset, index.taken_names(PREFIX, &[]));
    let mut replacements = Vec::new();
    let mut removable = BTreeSet::new();
    for core in &cores {
        emit(&mut b, index, core);
        replacements.push((core.root, std::mem::take(&mut b.nodes)));
        for &n in core.nodes.iter().filter(|&&n| n != core.root) {
            removable.extend(graph.node[n].output.iter().cloned());
        }
        // what only the replaced node read (its axes constants, ...)
        removable.extend(graph.node[core.root].input.iter().cloned());
    }
    Some(Rewrite {
        patch: crate::graph::patch::Patch {
            replacements,
            initializers: b.initializers,
            ..Default::default()
        },
        removable,
        forms: cores.iter().map(|c| c.form).collect(),
    })
}

impl Rewrite {
    /// Applies the rewrite to the model it was planned on. Returns the forms, in node order.
    pub fn apply(self, model: &mut ModelProto) -> Result<Vec<&'static str>, Error> {
        crate::graph::patch::apply(model, self.patch)?;
        // removing nodes nothing reads keeps the graph consistent
        remove_dead(model.graph.as_mut().expect("checked"), &self.removable);
        Ok(self.forms)
    }
}

fn find_cores(index: &GraphIndex) -> Vec<Core> {
    let mut cores: Vec<Core> = Vec::new();
    for (i, node) in index.graph.node.iter().enumerate() {
        let Some(out) = node.output.first().filter(|o| !o.is_empty()) else {
            continue;
        };
        let core = match node.op_type() {
            "Sub" => nll_core(index, i, node, out),
            "GatherElements" | "GatherND" | "ReduceSum" | "Squeeze" => log_prob_core(index, i, out),
            "Log" => log_of_softmax_core(index, i, out),
            _ => None,
        };
        cores.extend(core);
    }
    // a value matched inside a larger one (the gather under a Squeeze): keep the larger
    let inner: BTreeSet<usize> = cores
        .iter()
        .flat_map(|c| c.nodes.iter().copied().filter(move |&n| n != c.root))
        .collect();
    cores.retain(|c| !inner.contains(&c.root));
    cores
}

/// `pick(log_softmax(z), y)`.
fn log_prob_core(index: &GraphIndex, i: usize, out: &str) -> Option<Core> {
    let p = pick(index, out)?;
    let (z, mut nodes) = log_softmax(index, &p.source)?;
    nodes.extend(p.nodes.iter().copied());
    Some(Core {
        root: i,
        output: out.to_string(),
        nll: false,
        logits: z,
        form: form(0, &p)?,
        pick: p,
        nodes,
    })
}

/// `log(pick(softmax(z), y))`.
fn log_of_softmax_core(index: &GraphIndex, i: usize, out: &str) -> Option<Core> {
    let (z, p, nodes) = log_of_picked_softmax(index, out)?;
    Some(Core {
        root: i,
        output: out.to_string(),
        nll: false,
        logits: z,
        form: form(2, &p)?,
        pick: p,
        nodes,
    })
}

/// `logsumexp(z) − pick(z, y)`.
fn nll_core(index: &GraphIndex, i: usize, node: &NodeProto, out: &str) -> Option<Core> {
    let (a, b) = (node.input.first()?, node.input.get(1)?);
    let (z, keep, mut nodes) = log_sum_exp(index, a)?;
    let mut p = pick_through_moves(index, b)?;
    if through_identity(index, &p.source) != through_identity(index, &z) {
        return None;
    }
    // the difference is per position, shaped like the log-sum-exp
    p.shape = if keep {
        ValueShape::PositionsAndOne
    } else {
        ValueShape::Positions
    };
    nodes.extend(p.nodes.iter().copied());
    nodes.push(i);
    Some(Core {
        root: i,
        output: out.to_string(),
        nll: true,
        logits: z,
        form: form(1, &p)?,
        pick: p,
        nodes,
    })
}

/// The replacement of `core.root`: `SoftmaxCrossEntropyLoss(reduction='none')` on the logits as
/// `[M, V]` and the labels as `[M]`, reshaped to the value's shape.
fn emit(b: &mut Builder, index: &GraphIndex, core: &Core) {
    let p = &core.pick;
    let shape = b.node("Shape", &[&core.logits], "ce_form/logits_shape", vec![]);
    let width = b.slice(&shape, -1, i64::MAX, 0, "ce_form/width");
    // a constant target where the graph fixes the width, so later passes read it statically
    let target = match index.static_last_dim(&core.logits) {
        Some(v) => b.const_i64("ce_form/logits_2d_shape", &[2], &[-1, v]),
        None => {
            let minus_one = b.const_i64("ce_form/minus_one", &[1], &[-1]);
            b.concat(&[&minus_one, &width], 0, "ce_form/logits_2d_shape")
        }
    };
    let logits = b.node(
        "Reshape",
        &[&core.logits, &target],
        "ce_form/logits_2d",
        vec![],
    );

    let mut labels = b.reshape(&p.labels, &[-1], "ce_form/labels_1d");
    if index.elem_type(&p.labels) != Some(INT64) {
        labels = b.cast(&labels, INT64, "ce_form/labels_i64");
    }
    let zero = b.const_i64("ce_form/zero", &[], &[0]);
    if p.wraps {
        // negative labels count from the end, as Gather*/OneHot read them
        let negative = b.binary("Less", &labels, &zero, "ce_form/label_negative");
        let wrapped = b.binary("Add", &labels, &width, "ce_form/label_wrapped");
        labels = b.where_(&negative, &wrapped, &labels, "ce_form/label_from_end");
    }
    let above = b.binary(
        "GreaterOrEqual",
        &labels,
        &zero,
        "ce_form/label_not_negative",
    );
    let below = b.binary("Less", &labels, &width, "ce_form/label_below_width");
    let in_range = b.binary("And", &above, &below, "ce_form/label_in_range");
    let ignore = b.const_i64("ce_form/ignore_index", &[], &[IGNORE_INDEX]);
    let labels = b.where_(&in_range, &labels, &ignore, "ce_form/labels");

    let nll = b.fresh("ce_form/nll");
    let log_prob = b.fresh("ce_form/log_prob");
    let name = b.fresh("ce_form/SoftmaxCrossEntropyLoss");
    b.nodes.push(NodeProto {
        name: Some(name),
        op_type: Some("SoftmaxCrossEntropyLoss".into()),
        input: vec![logits.clone(), labels],
        output: vec![nll.clone(), log_prob],
        attribute: vec![
            string_attr("reduction", "none"),
            int_attr("ignore_index", IGNORE_INDEX),
        ],
        doc_string: Some(format!("{MARKER}{}", core.form)),
        ..Default::default()
    });

    let out_shape = match p.shape {
        ValueShape::Positions | ValueShape::PositionsAndOne => {
            b.slice(&shape, 0, -1, 0, "ce_form/positions_shape")
        }
        ValueShape::Index => b.node("Shape", &[&p.labels], "ce_form/value_shape", vec![]),
        ValueShape::IndexButLast => {
            let s = b.node("Shape", &[&p.labels], "ce_form/index_shape", vec![]);
            b.slice(&s, 0, -1, 0, "ce_form/value_shape")
        }
    };
    let out_shape = if p.shape == ValueShape::PositionsAndOne {
        let one = b.const_i64("ce_form/one", &[1], &[1]);
        b.concat(&[&out_shape, &one], 0, "ce_form/value_shape")
    } else {
        out_shape
    };
    let nll = match &p.smoothing {
        Some(s) => smoothed(b, index, &core.logits, &logits, &nll, s),
        None => nll,
    };
    let value = b.node("Reshape", &[&nll, &out_shape], "ce_form/nll_shaped", vec![]);
    let op = if core.nll { "Identity" } else { "Neg" };
    b.node_to(op, &[&value], &[&core.output], vec![]);
}

/// The smoothed cross-entropy per position from the plain one `nll` (`[M]`) and the logits
/// `[M, V]`: `keep·nll + spread·(−Σ_c log p_c)`, which is `−Σ_c (keep·onehot + spread)_c·log p_c`
/// (the ignore index's positions, whose one-hot is all zero, keep the spread term as in the
/// graph). The uniform term reads its own `LogSoftmax`, not the loss node's `log_prob`, so
/// every runtime's gradient builder differentiates it.
fn smoothed(
    b: &mut Builder,
    index: &GraphIndex,
    original_logits: &str,
    logits: &str,
    nll: &str,
    s: &match_ops::Smoothing,
) -> String {
    let ty = index
        .elem_type(original_logits)
        .unwrap_or(crate::onnx::FLOAT);
    let scalar = |b: &mut Builder, x: &Scalar, hint: &str| match x {
        Scalar::Tensor(t) => t.clone(),
        Scalar::Value(v) => b.scalar_typed(hint, *v, ty),
    };
    let keep = scalar(b, &s.keep, "ce_form/smoothing_keep");
    let spread = scalar(b, &s.spread, "ce_form/smoothing_spread");
    let log_p = b.node(
        "LogSoftmax",
        &[logits],
        "ce_form/smoothing_log_probs",
        vec![int_attr("axis", 1)],
    );
    let sum = b.reduce_sum(&log_p, &[1], false, "ce_form/smoothing_log_prob_sum");
    let uniform = b.unary("Neg", &sum, "ce_form/smoothing_uniform_nll");
    let kept = b.binary("Mul", nll, &keep, "ce_form/smoothing_kept");
    let term = b.binary("Mul", &uniform, &spread, SMOOTHING_TERM);
    b.binary("Add", &kept, &term, "ce_form/smoothed_nll")
}

/// Removes the nodes of the rewritten forms that nothing reads any more, then what only they
/// read (constants, initializers, the label one-hots), so no orphan is left behind.
fn remove_dead(graph: &mut crate::onnx::GraphProto, removable: &BTreeSet<String>) {
    let mut removable = removable.clone();
    loop {
        let read: BTreeSet<&str> = graph
            .node
            .iter()
            .flat_map(|n| n.input.iter().map(String::as_str))
            .chain(graph.output.iter().map(|o| o.name()))
            .collect();
        let dead: Vec<usize> = graph
            .node
            .iter()
            .enumerate()
            .filter(|(_, n)| {
                !n.output.is_empty()
                    && n.output.iter().all(|o| {
                        o.is_empty() || removable.contains(o) && !read.contains(o.as_str())
                    })
            })
            .map(|(i, _)| i)
            .collect();
        if dead.is_empty() {
            break;
        }
        for &i in dead.iter().rev() {
            let inputs = graph.node[i].input.iter().filter(|x| !x.is_empty());
            removable.extend(inputs.cloned());
        }
        splice(
            graph,
            Splice::replace(dead.into_iter().map(|i| (i, Vec::new()))),
        );
    }
    let read: BTreeSet<String> = graph
        .node
        .iter()
        .flat_map(|n| n.input.iter().cloned())
        .chain(graph.output.iter().map(|o| o.name().to_string()))
        .chain(graph.input.iter().map(|i| i.name().to_string()))
        .collect();
    graph
        .initializer
        .retain(|t| !removable.contains(t.name()) || read.contains(t.name()));
}

//! The validation copy: the patched graph, in memory, with the flat logits and labels, the
//! total loss tensor (and the CE's class weights, if any) as extra outputs, so the independent
//! reference sees exactly the values the runtime used. For runtimes without
//! `SoftmaxCrossEntropyLoss` every such node is replaced by its primitive-op form. NTIL's
//! random Gumbel noise is taken out (`noise`), so the copy computes the noise-0 forward. The
//! model file itself is never written.

use std::collections::HashSet;

use crate::error::Error;
use crate::graph::patch::{splice, Splice};
use crate::graph::GraphIndex;
use crate::onnx::{
    attr_i, i64_tensor, value_info_shape, GraphProto, ModelProto, NodeProto, ValueInfoProto, FLOAT,
    INT64,
};
use crate::passes::contract::StepMetadata;
use crate::passes::fused_head::FusedView;
use crate::tools::validate::emit::{Emitter, Out};
use crate::tools::validate::meta::PatchMeta;
use crate::tools::validate::noise::{self, Removed};
use crate::tools::validate::primitive_ce::{self, CeSpec};
use ntl_ops::names::{CE_OUTPUT, PREFIX};

pub struct ValidationCopy {
    pub model: ModelProto,
    /// Output names of the flat logits `[M, V]`, flat labels `[M]`, the total loss and the
    /// class weights.
    pub flat_logits: String,
    pub flat_labels: String,
    /// Output name of the number loss's labels where they differ from `flat_labels`.
    pub number_labels: Option<String>,
    /// The number loss's own logits, where they are not `flat_logits`.
    pub number_logits: Option<String>,
    pub total: String,
    pub class_weights: Option<String>,
    /// The tensor the CE node reads its labels from (to find the labels graph input).
    pub ce_labels: String,
    /// The Gumbel noise path taken out of the copy (empty when the patch draws no noise).
    pub noise_removed: Removed,
}

const SCE: &str = "SoftmaxCrossEntropyLoss";

/// The patched CE: the `SoftmaxCrossEntropyLoss` that writes `ce_loss`, or, where the graph
/// rescales the CE before reporting it (`ce_loss` is then the rescaled value), the one the
/// metadata names.
pub fn find_ce_node<'m>(
    model: &'m ModelProto,
    meta: &PatchMeta,
) -> Result<(usize, &'m NodeProto), Error> {
    let graph = model.graph.as_ref().expect("checked on load");
    // by name where ce_loss is written further on (a rescaling chain, label smoothing)
    let rescaled = !meta.rescaled_by.is_empty() || meta.label_smoothing > 0.0;
    graph
        .node
        .iter()
        .enumerate()
        .find(|(_, n)| {
            n.op_type() == SCE
                && if rescaled {
                    n.name() == meta.ce_node
                } else {
                    n.output.first().is_some_and(|o| o == CE_OUTPUT)
                }
        })
        .ok_or_else(|| {
            Error::Validation(format!(
                "the graph has no {SCE} writing '{CE_OUTPUT}'; validate reads graphs written by ntl-patch, re-patch the original model"
            ))
        })
}

/// `total` is the tensor holding the combined loss; `primitive_ce` swaps every
/// `SoftmaxCrossEntropyLoss` for its primitive-op form.
pub fn build(
    model: &ModelProto,
    meta: &PatchMeta,
    total: &str,
    primitive_ce: bool,
) -> Result<ValidationCopy, Error> {
    // a step graph with a fused LM head holds no logits and no cross-entropy node: the copy
    // computes the logits from what the fused head reads
    let fused = fused_view(model);
    let ce = match fused {
        Some(_) => None,
        None => Some(find_ce_node(model, meta)?),
    };
    let graph = model.graph.as_ref().expect("checked on load");
    let index = GraphIndex::new(graph);
    let flat_logits_source = (fused.is_none()).then_some(&meta.flat_logits);
    for t in flat_logits_source
        .into_iter()
        .chain([&meta.flat_labels])
        .chain(meta.number_labels.as_ref())
        .chain(meta.number_logits.as_ref())
    {
        if index.producer(t).is_none() && !index.is_graph_input(t) {
            return Err(Error::Validation(format!(
                "the metadata names tensor '{t}', which the graph does not compute; re-patch the original model"
            )));
        }
    }

    let mut e = Emitter::new(index.taken_names(super::emit::PREFIX, &[]));
    // Exported through Identity: a graph output may not be an initializer or an input in
    // every runtime, and the names stay ours.
    let export = |e: &mut Emitter, tensor: &str, hint: &str| {
        e.node("Identity", &[tensor], vec![], Out::Fresh(hint))
    };
    let flat_logits = match &fused {
        Some(f) => {
            let mut inputs = vec![f.hidden.as_str(), f.weight.as_str()];
            if !f.bias.is_empty() {
                inputs.push(&f.bias);
            }
            let attrs = vec![crate::onnx::int_attr("transB", f.trans_weight as i64)];
            let mut z = e.node("Gemm", &inputs, attrs, Out::Fresh("flat_logits"));
            // the steps the graph took from the projection to the logits
            for step in &f.logit_map {
                let k = step
                    .constant()
                    .map(|c| e.constant("logit_map_c", |n| crate::onnx::f32_tensor(n, &[], &[c])));
                let inputs: Vec<&str> = std::iter::once(z.as_str()).chain(k.as_deref()).collect();
                z = e.node(step.op(), &inputs, vec![], Out::Fresh("flat_logits"));
            }
            z
        }
        None => export(&mut e, &meta.flat_logits, "flat_logits"),
    };
    let flat_labels = export(&mut e, &meta.flat_labels, "flat_labels");
    let number_labels = meta
        .number_labels
        .as_ref()
        .map(|n| export(&mut e, n, "number_labels"));
    let number_logits = meta
        .number_logits
        .as_ref()
        .map(|n| export(&mut e, n, "number_logits"));
    let total_out = export(&mut e, total, "total_loss");
    let class_weights = match (&ce, &fused) {
        (Some((_, node)), _) => node.input.get(2).filter(|w| !w.is_empty()).cloned(),
        (None, Some(f)) => f.class_weights.clone(),
        (None, None) => None,
    }
    .map(|w| export(&mut e, &w, "class_weights"));
    let ce_index = ce.map(|(i, _)| i);

    let mut replaced = Vec::new();
    if primitive_ce {
        for (i, node) in graph
            .node
            .iter()
            .enumerate()
            .filter(|(_, n)| n.op_type() == SCE)
        {
            let (logits, labels, loss_type) = if Some(i) == ce_index {
                // the patched CE: the flat tensors the number loss reads hold its inputs
                (
                    meta.flat_logits.clone(),
                    meta.flat_labels.clone(),
                    ce_loss_type(graph),
                )
            } else {
                primitive_ce::flatten_own_inputs(&mut e, &index, node).ok_or_else(|| {
                    Error::Validation(format!(
                        "tract cannot run op '{SCE}' (node '{}'): the rank of its scores is unknown; validate with --runtime ort",
                        node.name()
                    ))
                })?
            };
            let log_prob_used = node.output.get(1).is_some_and(|o| {
                !o.is_empty() && (!index.consumers(o).is_empty() || index.is_graph_output(o))
            });
            let spec = CeSpec {
                node,
                flat_logits: &logits,
                flat_labels: &labels,
                loss_type,
                log_prob_used,
            };
            primitive_ce::emit(&mut e, &spec);
            replaced.push(i);
        }
    }
    let ce_labels = match (&ce, &fused) {
        (Some((_, node)), _) => node.input.get(1).cloned().unwrap_or_default(),
        (None, Some(f)) => f.labels.clone(),
        (None, None) => String::new(),
    };
    let int64_like = primitive_ce.then(|| e.fresh("int64_like"));

    let mut model = model.clone();
    let graph = model.graph.as_mut().expect("checked on load");
    if let Some(like) = &int64_like {
        if exact_int64_casts(graph, like) > 0 {
            graph.initializer.push(i64_tensor(like, &[], &[0]));
        }
    }
    let mut edits = Splice::replace(replaced.into_iter().map(|i| (i, Vec::new())));
    edits
        .before
        .insert(usize::MAX, std::mem::take(&mut e.nodes));
    splice(graph, edits);
    graph.initializer.append(&mut e.initializers);
    // The replacement reads the flat tensors, which the patch computes after the CE node, so
    // it cannot simply take the node's place: restore a topological order instead.
    crate::graph::patch::topological_sort(graph);
    if primitive_ce {
        let opset = crate::onnx::default_opset(&model).unwrap_or(ntl_ops::builder::MIN_OPSET);
        let graph = model.graph.as_mut().expect("checked on load");
        let mut b = ntl_ops::Builder::new(
            PREFIX,
            opset,
            GraphIndex::new(graph).taken_names(PREFIX, &[]),
        );
        crate::tools::validate::tract_compat::rewrite(graph, &mut b);
        graph.initializer.append(&mut b.initializers);
    }
    let graph = model.graph.as_mut().expect("checked on load");
    // NTIL with --gumbel-noise > 0: validate the deterministic forward (noise scale 0)
    let noise_removed = noise::remove_patch_noise(graph)?;
    let outputs = [&flat_logits, &flat_labels, &total_out];
    for name in outputs
        .into_iter()
        .chain(class_weights.as_ref())
        .chain(number_labels.as_ref())
        .chain(number_logits.as_ref())
    {
        graph.output.push(ValueInfoProto {
            name: Some(name.clone()),
            ..Default::default()
        });
    }
    bypass_identities(model.graph.as_mut().expect("checked on load"));
    crate::graph::patch::check_consistency(&model).map_err(|e| {
        Error::Validation(format!("internal error building the validation copy: {e}"))
    })?;
    Ok(ValidationCopy {
        model,
        flat_logits,
        flat_labels,
        number_labels,
        number_logits,
        total: total_out,
        class_weights,
        ce_labels,
        noise_removed,
    })
}

/// The fused LM head a step graph's metadata records, if any.
fn fused_view(model: &ModelProto) -> Option<FusedView> {
    StepMetadata::of(model)?.ok()?.fused_head
}

/// tract reads ONNX `Cast(to=INT64)` as a cast to its symbolic dimension type `TDim`, which
/// fits shape arithmetic but not data: `CumSum` (and others) refuse TDim tensors. The integer
/// label bookkeeping of the per-sequence losses casts to INT64 and feeds CumSum, and so do the
/// Hugging Face graphs' own position ids (`cumsum` of a mask), so for tract every such Cast —
/// the patch's (outputs under `ntl/`) and any read by a `CumSum` — becomes `CastLike(x, <int64
/// scalar>)`, the same value with a plain i64 result. The graph's other Casts are left alone.
/// Returns how many were rewritten (the caller adds the `like` scalar if any).
fn exact_int64_casts(graph: &mut GraphProto, like: &str) -> usize {
    let ours = format!("{PREFIX}/");
    let cumsum_inputs: HashSet<String> = graph
        .node
        .iter()
        .filter(|n| n.op_type() == "CumSum")
        .filter_map(|n| n.input.first().cloned())
        .collect();
    let mut rewritten = 0;
    for node in &mut graph.node {
        let to_int64 = node.op_type() == "Cast" && attr_i(node, "to") == Some(INT64 as i64);
        let data = node.output.iter().all(|o| o.starts_with(&ours))
            || node.output.iter().any(|o| cumsum_inputs.contains(o));
        if to_int64 && data {
            node.op_type = Some("CastLike".into());
            node.input.truncate(1);
            node.input.push(like.to_string());
            node.attribute.clear();
            rewritten += 1;
        }
    }
    rewritten
}

/// Element type of `ce_loss` as the graph declares it (float32 where it does not).
pub fn ce_loss_type(graph: &GraphProto) -> i32 {
    graph
        .output
        .iter()
        .find(|o| o.name() == CE_OUTPUT)
        .and_then(value_info_shape)
        .map(|(t, _)| t)
        .filter(|&t| t != 0)
        .unwrap_or(FLOAT)
}

/// Removes `Identity` nodes whose output is not a graph output, reading their input instead:
/// the values are the same, and runtimes that wire nodes one by one (tract) slow down
/// quadratically on long chains of them.
fn bypass_identities(graph: &mut GraphProto) {
    let outputs: HashSet<String> = graph.output.iter().map(|o| o.name().to_string()).collect();
    let mut edits = Splice::default();
    for (at, n) in graph.node.iter().enumerate() {
        let bypass = n.op_type() == "Identity"
            && n.input.len() == 1
            && n.output.len() == 1
            && !n.input[0].is_empty()
            && !outputs.contains(&n.output[0]);
        if bypass {
            // nodes are in topological order: the input's own source is already known
            let root = edits
                .renames
                .get(&n.input[0])
                .cloned()
                .unwrap_or_else(|| n.input[0].clone());
            edits.renames.insert(n.output[0].clone(), root);
            edits.replace.insert(at, Vec::new());
        }
    }
    // the other nodes read each bypassed output's source
    splice(graph, edits);
}

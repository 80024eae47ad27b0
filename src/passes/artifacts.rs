//! `ntl-patch artifacts DIR`: add the number loss to ONNX Runtime training artifacts
//! (`training_model.onnx`, `eval_model.onnx`, `optimizer_model.onnx`, `checkpoint`) without the
//! original forward graph.
//!
//! The training graph gets the forward nodes and their backward nodes, written by the same
//! engine as the step graph's (`crate::passes::grad`); the number loss's gradient is added into
//! the gradient ORT's `SoftmaxCrossEntropyLossGrad` produced for the scores — sparsely, with
//! ScatterElements, so no second dense `[N, V]` tensor is built. `eval_model.onnx` gets the forward nodes; the
//! optimizer model and the checkpoint are copied unchanged by the job (`crate::jobs::artifacts`).

use ntl_ops::names::{CE_OUTPUT, NUMBER_OUTPUT, PREFIX};
use ntl_ops::options::{Combine, LossOptions};
use ntl_ops::Builder;

use crate::ce::site::CeSite;
use crate::error::Error;
use crate::graph::elem_types::ElemTypes;
use crate::graph::patch::{apply, splice, Patch, Splice, METADATA_KEY};
use crate::graph::ranks::Ranks;
use crate::graph::shapes::Shapes;
use crate::graph::GraphIndex;
use crate::onnx::{default_opset, int_attr, string_attr, ModelProto};
use crate::passes::grad;
use crate::passes::pipeline::{logits_width, number_tokens, select_site};
use crate::passes::rewrite::{
    added_outputs, build_forward, build_patch, metadata, Forward, CLAIMED,
};
use crate::vocab::number_table::Vocab;

/// What the artifacts patch reads besides the graphs: the request's options, without its paths.
pub struct ArtifactsOptions<'a> {
    /// `--ce-node`: the cross-entropy to patch, by node name or loss output name.
    pub ce_node: Option<&'a str>,
    /// `--vocab-size`: the logits width where the graph leaves it symbolic.
    pub vocab_size: Option<usize>,
    pub loss: &'a LossOptions,
}

/// What [`patch_artifacts`] did, for the summary.
pub struct ArtifactsPatched {
    pub number_tokens: usize,
    pub sparse_updates: usize,
    pub dense_updates: usize,
    /// One-line warnings for stderr (number tokens left out for their size).
    pub warnings: Vec<String>,
}

/// Patches the training graph (forward and backward of the number loss) and the eval graph
/// (its forward), both checked on load.
pub fn patch_artifacts(
    training: &mut ModelProto,
    eval: &mut ModelProto,
    req: &ArtifactsOptions,
    vocab: &Vocab,
) -> Result<ArtifactsPatched, Error> {
    let (train_patch, tokens_len, grad, warnings) = {
        let target = Target::locate(training, req, vocab)?;
        let warnings: Vec<String> = target.left_out.clone().into_iter().collect();
        let (patch, grad) = training_patch(
            &target.index,
            target.opset,
            &target.site,
            &target.tokens,
            req.loss,
        )?;
        (patch, target.tokens.table.len(), grad, warnings)
    };
    let eval_patch = {
        let target = Target::locate(eval, req, vocab)?;
        build_patch(
            &target.index,
            target.opset,
            &target.site,
            &[],
            &target.tokens,
            req.loss,
        )?
    };
    apply(training, train_patch)?;
    apply(eval, eval_patch)?;
    Ok(ArtifactsPatched {
        number_tokens: tokens_len,
        sparse_updates: grad.0,
        dense_updates: grad.1,
        warnings,
    })
}

/// What a patch of one artifact graph needs: its cross-entropy, width, token ids and opset.
struct Target<'m> {
    index: GraphIndex<'m>,
    site: CeSite,
    tokens: ntl_ops::numbers::NumberTokens,
    opset: i64,
    /// The warning for number tokens left out for their size.
    left_out: Option<String>,
}

impl<'m> Target<'m> {
    fn locate(model: &'m ModelProto, req: &ArtifactsOptions, vocab: &Vocab) -> Result<Self, Error> {
        let index = GraphIndex::new(model.graph.as_ref().expect("checked on load"));
        let site = select_site(&index, req.ce_node).map_err(|e| match e {
            // artifacts mode never rewrites a cross-entropy spelled out of primitive ops
            Error::NoCrossEntropy { .. } if crate::ce::forms::found(&index) => Error::Usage(
                "the training graph's cross-entropy is written out of primitive ops, which artifacts mode cannot patch (ONNX Runtime already differentiated them); patch the forward graph (`ntl-patch MODEL`) and generate the artifacts from it, or use `ntl-patch step`".into(),
            ),
            e => e,
        })?;
        if site.reduction == "none" {
            // the graph reduces the per-position loss itself, after the CE's gradient node
            // reads it: the number loss has no place in ORT's backward there
            return Err(Error::Usage(format!(
                "cross-entropy '{}' has reduction 'none' and the graph reduces it itself, which artifacts mode cannot patch; patch the forward graph (`ntl-patch MODEL`) and generate the artifacts from it, or use `ntl-patch step`",
                crate::text::escape(&site.node_name)
            )));
        }
        let width = logits_width(&index, &site, req.vocab_size)?;
        let total_type = index
            .elem_type(&site.logits)
            .unwrap_or(ntl_ops::onnx::FLOAT);
        let (tokens, left_out) = number_tokens(vocab, req.loss, width, total_type)?;
        let opset = default_opset(model).ok_or(Error::NoOpset)?;
        Ok(Target {
            index,
            site,
            tokens,
            left_out,
            opset,
        })
    }
}

/// The training-graph patch: forward nodes in place of the loss node, and the number loss's
/// gradient added to the scores gradient right after `SoftmaxCrossEntropyLossGrad`.
fn training_patch(
    index: &GraphIndex,
    opset: i64,
    site: &CeSite,
    tokens: &ntl_ops::numbers::NumberTokens,
    opts: &LossOptions,
) -> Result<(Patch, (usize, usize)), Error> {
    let log_prob = site.log_prob_output.clone().ok_or(Error::NoLossGradient)?;
    let (grad_index, grad_node) = index
        .graph
        .node
        .iter()
        .enumerate()
        .find(|(_, n)| {
            n.op_type() == "SoftmaxCrossEntropyLossGrad" && n.input.get(1) == Some(&log_prob)
        })
        .ok_or(Error::NoLossGradient)?;
    let (Some(seed), Some(scores_grad)) = (
        grad_node.input.first().filter(|s| !s.is_empty()).cloned(),
        grad_node.output.first().filter(|s| !s.is_empty()).cloned(),
    ) else {
        return Err(Error::MalformedGraph(format!(
            "SoftmaxCrossEntropyLossGrad node '{}' has no gradient input or no output",
            grad_node.name()
        )));
    };
    let rank =
        crate::graph::static_rank(index, &site.scores).ok_or_else(|| Error::UnknownRank {
            tensor: site.scores.clone(),
        })?;
    if !(2..=3).contains(&rank) {
        return Err(Error::UnknownRank {
            tensor: site.scores.clone(),
        });
    }

    let mut b = Builder::new(PREFIX, opset, index.taken_names(PREFIX, &CLAIMED));
    if opts.label_smoothing > 0.0 {
        return Err(Error::Usage(
            "--label-smoothing applies to the cross-entropy ntl-patch writes (patch and step); in artifacts mode ONNX Runtime differentiates the graph's own: set it when exporting the model".into(),
        ));
    }
    let forward = build_forward(&mut b, index, site, tokens, opts, false, false)?;

    // d total / d number_loss: λ (add) or λ·CE/(L + 1e-10) (scaled; the factor is a constant).
    let weight = b.scalar_f32("grad_weight", opts.weight as f32);
    let mut coef = b.binary("Mul", &seed, &weight, "grad_number_seed");
    if opts.combine == Combine::Scaled {
        let eps = b.scalar_f32("grad_scale_eps", 1e-10);
        let denom = b.binary("Add", NUMBER_OUTPUT, &eps, "grad_number_eps");
        let ratio = b.binary("Div", CE_OUTPUT, &denom, "grad_ce_over_number");
        coef = b.binary("Mul", &coef, &ratio, "grad_number_seed_scaled");
    }
    let gradient = number_loss_gradient(&mut b, index, opset, &forward, &coef)?;
    let counts = (gradient.sparse.len(), gradient.dense.len());

    let ce_grad = b.fresh("ce_scores_grad");
    let mut ce_grad_node = grad_node.clone();
    ce_grad_node.output[0] = ce_grad.clone();
    let total = add_into_scores_grad(&mut b, site, rank, &ce_grad, &gradient, forward.loss_type);
    b.node_to("Identity", &[&total], &[&scores_grad], vec![]);

    let mut backward = vec![ce_grad_node];
    backward.append(&mut b.nodes);
    let patch = Patch {
        replacements: vec![(site.node_index, forward.nodes), (grad_index, backward)],
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
                &site.loss_output,
                &[],
            ),
        )],
    };
    Ok((patch, counts))
}

/// `d number_loss / d logits · coef` for the flat `[M, V]` logits the number loss reads, by the
/// whole-model engine (`grad`) over the loss's forward nodes: the gathered columns come back as
/// sparse `[M, K]` scatters, a loss that reads whole rows (`--reweigh`) as a dense part.
fn number_loss_gradient(
    b: &mut Builder,
    index: &GraphIndex,
    opset: i64,
    forward: &Forward,
    coef: &str,
) -> Result<grad::Parts, Error> {
    // ranks, shapes and types of the loss's tensors: the training graph with its nodes after it
    let mut graph = index.graph.clone();
    splice(&mut graph, Splice::append(forward.nodes.clone()));
    graph.initializer.extend(b.initializers.iter().cloned());
    let scratch = GraphIndex::new(&graph);
    let mut ranks = Ranks::infer(&scratch);
    let shapes = Shapes::infer(&scratch);
    let types = ElemTypes::infer(&graph);
    let mut ctx = grad::Ctx::new(b, &mut ranks, &shapes, &types, opset);
    grad::gradient_parts(
        &mut ctx,
        &forward.nodes,
        NUMBER_OUTPUT,
        coef,
        &forward.flat.logits,
    )
}

/// Adds the sparse `[M, K]` and dense `[M, V]` logits gradients into the scores gradient, in
/// the scores' layout (`[N, V]`, or `[B, V, T]` for rank 3).
fn add_into_scores_grad(
    b: &mut Builder,
    site: &CeSite,
    rank: usize,
    ce_grad: &str,
    gradient: &grad::Parts,
    loss_type: i32,
) -> String {
    let mut acc = ce_grad.to_string();
    let cast = |b: &mut Builder, x: &str, hint: &str| -> String {
        if loss_type == crate::onnx::FLOAT {
            x.to_string()
        } else {
            b.cast(x, loss_type, &format!("{hint}_cast"))
        }
    };
    let to_layout = |b: &mut Builder, x: &str, hint: &str| -> String {
        if rank == 2 {
            return x.to_string();
        }
        // [B·T, C] → [B, T, C] → [B, C, T]
        let shape = b.node(
            "Shape",
            &[&site.scores],
            &format!("{hint}_scores_shape"),
            vec![],
        );
        let batch = b.slice(&shape, 0, 1, 0, &format!("{hint}_batch"));
        let tail = b.const_i64(&format!("{hint}_tail"), &[1], &[-1]);
        let xs = b.node("Shape", &[x], &format!("{hint}_x_shape"), vec![]);
        let c = b.slice(&xs, 1, 2, 0, &format!("{hint}_classes"));
        let btc = b.concat(&[&batch, &tail, &c], 0, &format!("{hint}_btc"));
        let x = b.node("Reshape", &[x, &btc], &format!("{hint}_btc_grad"), vec![]);
        b.transpose(&x, &[0, 2, 1], &format!("{hint}_bct_grad"))
    };
    for (k, scatter) in gradient.sparse.iter().enumerate() {
        let hint = format!("sparse_grad_{k}");
        let values = cast(b, &scatter.updates, &hint);
        let values = to_layout(b, &values, &hint);
        let indices = to_layout(b, &scatter.indices, &format!("{hint}_indices"));
        acc = b.node(
            "ScatterElements",
            &[&acc, &indices, &values],
            &format!("{hint}_added"),
            vec![
                int_attr("axis", scatter.axis),
                string_attr("reduction", "add"),
            ],
        );
    }
    for (k, dense) in gradient.dense.iter().enumerate() {
        let hint = format!("dense_grad_{k}");
        let dense = cast(b, dense, &hint);
        let dense = to_layout(b, &dense, &hint);
        acc = b.binary("Add", &acc, &dense, &format!("{hint}_added"));
    }
    acc
}

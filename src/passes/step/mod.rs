//! `ntl-patch step`: the patched forward graph plus its whole-model backward and the
//! optimizer update, as one standard-ONNX graph that performs a training step
//! (`docs/STEP_GRAPH.md` is the contract). `--split` writes the gradient graph and the
//! update graph separately (for data-parallel training, where gradients are averaged
//! between the two).

mod copies;
mod in_place;
mod multi_tensor;
pub mod optimizer;
mod param_update;
mod parameters;
pub mod precision;
pub mod zero_state;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::PathBuf;

use crate::error::Error;
use crate::graph::elem_types::ElemTypes;
use crate::graph::patch::{splice, Splice};
use crate::graph::ranks::Ranks;
use crate::graph::shapes::Shapes;
use crate::graph::GraphIndex;
use crate::onnx::{
    default_opset, proto, GraphProto, ModelProto, TensorProto, TypeProto, ValueInfoProto, FLOAT,
    INT64,
};
use crate::passes::attention::{self, AttentionOptions};
use crate::passes::contract::{self, StepMetadata};
use crate::passes::fused_head::{self, FusedHeadOptions, FusedView, Outcome};
use crate::passes::grad::{self, Ctx};
use crate::passes::lora::{self, Adapted, LoraOptions};
use crate::passes::quantize_base::{self, per_use, QuantizeOptions, QuantizedBase, ReadExternal};
use crate::passes::recompute::{self, RecomputeOptions, StepFacts};
use ntl_ops::names::{CE_OUTPUT, NUMBER_OUTPUT, PREFIX};
use ntl_ops::Builder;
use optimizer::emit_update;
pub use optimizer::{OptimizerKind, OptimizerOptions};
use param_update::ParamUpdate;
use parameters::{Rule, Selection};
use precision::frozen_half::{self, WidenedSet};
use precision::loss_scale::{
    self, LossScaleOptions, ScaleState, SCALE_STATE, SKIP_OUTPUT, TRACKER_STATE,
};
use precision::upcast;
pub use precision::Precision;
use zero_state::ZeroState;

pub const LR_INPUT: &str = "ntl/lr";
pub const STEP_INPUT: &str = "ntl/state/step";

/// What the step graph is built with: the request's options, without its paths.
pub struct StepOptions {
    pub optimizer: OptimizerOptions,
    /// Initializer-name prefixes not to train.
    pub freeze: Vec<String>,
    /// Write a gradient graph and an update graph instead of one step graph.
    pub split: bool,
    /// `--precision`; None: not given (float32, and half-precision exports are refused).
    pub precision: Option<Precision>,
    /// fp16's dynamic loss scaling.
    pub loss_scale: LossScaleOptions,
    pub fused_head: FusedHeadOptions,
    /// `--lora-r` and friends: LoRA adapters train, the base is frozen.
    pub lora: Option<LoraOptions>,
    /// With LoRA: initializer-name prefixes of base weights to train too.
    pub train: Vec<String>,
    /// `--quantize-base` (QLoRA): the frozen linear weights stored quantised.
    pub quantize: Option<QuantizeOptions>,
    /// `--recompute`: the backward recomputes each layer's forward.
    pub recompute: RecomputeOptions,
    /// `--attention`: attention over blocks of query rows, never storing the scores.
    pub attention: AttentionOptions,
}

impl StepOptions {
    pub fn precision(&self) -> Precision {
        self.precision.unwrap_or(Precision::Fp32)
    }

    /// The options' own checks, before any file is read.
    pub fn check(&self) -> Result<(), Error> {
        check_options(&self.optimizer)?;
        if self.split && self.optimizer.update_bucket_mib != 0 {
            // DataParallel's ZeRO cuts the update graph per parameter: a bucket spans shards
            return Err(Error::Usage("--update-bucket lays out the one-graph step's update; drop it with --split (the update graph is cut per parameter for DataParallel)".into()));
        }
        if let Some(o) = &self.lora {
            o.check()?;
        } else if !self.train.is_empty() {
            return Err(Error::Usage("--train adds base weights to what LoRA trains; without --lora-r every weight trains already (use --freeze to leave some out)".into()));
        }
        if let Some(q) = &self.quantize {
            if self.lora.is_none() {
                return Err(Error::Usage("--quantize-base stores the frozen base of a LoRA step graph (QLoRA); add --lora-r R".into()));
            }
            q.check()?;
        }
        self.loss_scale.check().map_err(Error::Usage)?;
        self.attention.check()
    }
}

#[allow(clippy::neg_cmp_op_on_partial_ord)] // NaN must fail the checks too
fn check_options(o: &OptimizerOptions) -> Result<(), Error> {
    let bad = |what: &str| Err(Error::Usage(what.to_string()));
    if !(o.lr > 0.0 && o.lr.is_finite() && o.lr < 1e30) {
        return bad("--lr must be a finite number > 0 (e.g. --lr 1e-3)");
    }
    let in_unit = |b: f64| (0.0..1.0).contains(&b);
    if !in_unit(o.beta1) || !in_unit(o.beta2) {
        return bad("--beta1 and --beta2 must be in [0, 1) (torch's AdamW defaults: 0.9, 0.999)");
    }
    if !(o.eps > 0.0 && o.eps.is_finite() && (o.eps as f32) > 0.0) {
        return bad("--eps must be a finite number > 0 that float32 can hold (e.g. 1e-8)");
    }
    if !(o.weight_decay >= 0.0 && o.weight_decay.is_finite()) {
        return bad("--weight-decay must be a finite number >= 0");
    }
    if !(o.momentum >= 0.0 && o.momentum.is_finite()) {
        return bad("--momentum must be a finite number >= 0");
    }
    if o.momentum != 0.0 && o.kind == OptimizerKind::AdamW {
        return bad("--momentum is an SGD option; add --optimizer sgd or drop --momentum");
    }
    if let Some(n) = o.max_grad_norm {
        if !(n > 0.0 && n.is_finite() && n < 3e38) {
            return bad("--max-grad-norm must be a finite number > 0");
        }
    }
    if o.update_bucket_mib > 1 << 20 {
        return bad("--update-bucket is in MiB and at most 1048576 (e.g. --update-bucket 32)");
    }
    Ok(())
}

/// The step graph's build: what the summary reports, the update graph of `--split`, and the
/// optimizer state's zeros the job writes beside the graph.
pub struct Built {
    pub parameters: Vec<String>,
    pub parameter_elements: u64,
    pub frozen: Vec<String>,
    pub buffers: Vec<String>,
    pub notes: Vec<String>,
    pub warnings: Vec<String>,
    /// The update graph of `--split`.
    pub update: Option<ModelProto>,
    /// Where the optimizer state's zeros went (the step graph, or the update graph).
    pub zeros: ZeroState,
    pub fused_head_chunk_tokens: Option<i64>,
    pub lora: Option<contract::Lora>,
    pub recompute: contract::Recompute,
    pub attention: contract::Attention,
    /// QLoRA's stored codes and scales (the job may move them to a data file of their own).
    pub quantized_payloads: Vec<String>,
}

/// One stage of the step graph: it reads what earlier stages left in the context and leaves
/// what it made there.
type Stage = fn(&mut StepCtx) -> Result<(), Error>;

/// The step graph's stages, in the order they run; each one's doc says why it sits there.
const STAGES: &[Stage] = &[
    insert_lora,
    quantize_base,
    fuse_head,
    open_builder,
    widen_half_export,
    canonicalize,
    replace_attention,
    analyse_forward,
    select_parameters,
    claim_loss_scale,
    differentiate,
    autocast,
    claim_optimizer_state,
    describe,
    emit_optimizer_update,
    lower_fused_head,
    recompute_layers,
    lower_attention,
    dequantize_per_use,
    cast_frozen_half,
    mark_in_place,
];

/// Turns the patched forward model into the step graph (or the gradient graph, returning the
/// update graph as a separate model).
pub fn build(
    model: &mut ModelProto,
    req: &StepOptions,
    outputs: &[PathBuf],
    read_external: ReadExternal,
) -> Result<Built, Error> {
    let mut ctx = StepCtx::new(model, req, outputs, read_external);
    for stage in STAGES {
        stage(&mut ctx)?;
    }
    ctx.finish()
}

/// One optimizer state tensor: its input, its next value's output, dims and element type.
type StatePair = (String, String, Vec<i64>, i32);

/// The optimizer's state, named.
#[derive(Default)]
struct OptimizerState {
    /// Each parameter's update: its gradient, slots and next values.
    updates: Vec<ParamUpdate>,
    /// The step count's input and next output.
    step: (String, String),
    lr: String,
    /// Every state tensor in input order: each parameter, then its slots; the step count, then
    /// fp16's loss-scale state.
    pairs: Vec<StatePair>,
}

/// What the stages share: the request, the model being turned into the step graph, and what
/// each stage left for the later ones.
struct StepCtx<'a> {
    req: &'a StepOptions,
    outputs: &'a [PathBuf],
    /// The payloads of weights stored as external data (QLoRA quantises them).
    read_external: ReadExternal<'a>,
    model: &'a mut ModelProto,
    opset: i64,
    precision: Precision,
    warnings: Vec<String>,
    adapted: Option<Adapted>,
    /// QLoRA's quantised base weights.
    quantized: Option<QuantizedBase>,
    /// LoRA's adapter initializers (empty without LoRA).
    adapters: BTreeSet<String>,
    fused: Option<FusedView>,
    /// The step's node emitter, from `open_builder` to `emit_optimizer_update`.
    b: Option<Builder>,
    /// Frozen half weights read through widening Casts.
    widened: WidenedSet,
    attended: attention::Outcome,
    /// The finished forward's loss and what was proven about its tensors.
    loss: String,
    ranks: Ranks,
    shapes: Shapes,
    types: ElemTypes,
    selection: Selection,
    zeros: ZeroState,
    scale_state: Option<ScaleState>,
    /// Each parameter's gradient, in `selection.params`' order.
    grads: Vec<String>,
    /// Forward tensor → its gradient, as the backward emitted them.
    gradient_of: HashMap<String, String>,
    /// The forward's data inputs (graph inputs that are not initializers).
    data_inputs: Vec<String>,
    /// The forward and backward retyped by autocast.
    mixed: Option<precision::Mixed>,
    state: OptimizerState,
    /// The `ntl_step` metadata, from `describe` on; later stages add what they did.
    meta: Option<StepMetadata>,
    update: Option<ModelProto>,
}

impl<'a> StepCtx<'a> {
    fn new(
        model: &'a mut ModelProto,
        req: &'a StepOptions,
        outputs: &'a [PathBuf],
        read_external: ReadExternal<'a>,
    ) -> Self {
        StepCtx {
            req,
            outputs,
            read_external,
            opset: default_opset(model).expect("checked by the patch step"),
            model,
            precision: req.precision(),
            warnings: Vec::new(),
            adapted: None,
            quantized: None,
            adapters: BTreeSet::new(),
            fused: None,
            b: None,
            widened: WidenedSet::default(),
            attended: attention::Outcome::default(),
            loss: String::new(),
            ranks: Ranks::default(),
            shapes: Shapes::default(),
            types: ElemTypes::default(),
            selection: Selection::default(),
            zeros: ZeroState::inline(),
            scale_state: None,
            grads: Vec::new(),
            gradient_of: HashMap::new(),
            data_inputs: Vec::new(),
            mixed: None,
            state: OptimizerState::default(),
            meta: None,
            update: None,
        }
    }

    /// The metadata, once `describe` made it.
    fn meta(&mut self) -> &mut StepMetadata {
        self.meta.as_mut().expect("described before")
    }

    /// The metadata written into the step graph, checked, and what the summary reports.
    fn finish(self) -> Result<Built, Error> {
        let meta = self.meta.expect("described before");
        self.model.metadata_props.push(meta.entry());
        crate::graph::patch::check_consistency(self.model).map_err(Error::Inconsistent)?;
        let s = self.selection;
        Ok(Built {
            parameters: s.params,
            parameter_elements: s.elements,
            frozen: s.frozen,
            buffers: s.buffers,
            notes: s.notes,
            warnings: self.warnings,
            update: self.update,
            zeros: self.zeros,
            fused_head_chunk_tokens: self.fused.map(|v| v.chunk_tokens),
            lora: meta.lora,
            recompute: meta.recompute.expect("recompute_layers ran"),
            attention: meta.attention.expect("lower_attention ran"),
            quantized_payloads: self.quantized.as_ref().map_or_else(Vec::new, |q| {
                q.stored().into_iter().map(|(name, _, _)| name).collect()
            }),
        })
    }
}

fn graph(model: &ModelProto) -> &GraphProto {
    model.graph.as_ref().expect("loaded models have a graph")
}

fn graph_mut(model: &mut ModelProto) -> &mut GraphProto {
    model.graph.as_mut().expect("loaded models have a graph")
}

/// The step's builder, open between `open_builder` and `emit_optimizer_update`.
fn builder(b: &mut Option<Builder>) -> &mut Builder {
    b.as_mut().expect("the step's builder is open")
}

/// Which weights train, by `--freeze`, `--train` and LoRA (`adapters`, where it adapted).
fn train_rule<'r>(
    req: &'r StepOptions,
    adapted: Option<&Adapted>,
    adapters: &'r BTreeSet<String>,
) -> Rule<'r> {
    Rule {
        freeze: &req.freeze,
        train: &req.train,
        lora: adapted.is_some(),
        adapters,
    }
}

/// A state name, claimed exactly: the runtime feeds and reads it by this name.
fn claim(b: &mut Builder, name: String) -> Result<String, Error> {
    if b.claim(&name) {
        Ok(name)
    } else {
        Err(Error::OutputNameTaken(name))
    }
}

/// LoRA first: the fused head then finds an adapted head (if named), not a plain projection.
fn insert_lora(ctx: &mut StepCtx) -> Result<(), Error> {
    let Some(options) = &ctx.req.lora else {
        return Ok(());
    };
    let adapted = lora::insert(ctx.model, options)?;
    let unnamed: Vec<&str> = adapted
        .adapters
        .iter()
        .filter(|x| x.layer.module.is_none())
        .map(|x| x.layer.weight.as_str())
        .collect();
    if let Some(first) = unnamed.first() {
        ctx.warnings.push(format!(
            "{} adapted layer(s) have no module path in the export (e.g. '{first}', a weight the exporter renamed): their adapter files use the ONNX names, which PEFT cannot map to the model; export with do_constant_folding=False (TorchScript) or the dynamo exporter to keep the names",
            unnamed.len()
        ));
    }
    ctx.adapters = adapted.parameters();
    ctx.adapted = Some(adapted);
    Ok(())
}

/// QLoRA's base quantised right after LoRA (which finds the linear layers by their float
/// weights) and before anything analyses the graph: later stages see each weight as the
/// float32 output of a dequantisation chain, which nothing trains.
fn quantize_base(ctx: &mut StepCtx) -> Result<(), Error> {
    let Some(options) = &ctx.req.quantize else {
        return Ok(());
    };
    let q = quantize_base::quantize(ctx.model, options, ctx.read_external)?;
    if let Some(ir) = q.raised_ir {
        ctx.warnings.push(format!(
            "the model's IR version {ir} was raised to 10, the first with int4 tensors (--quantize-base int4)"
        ));
    }
    ctx.quantized = Some(q);
    Ok(())
}

/// The LM head fused into one internal node before anything differentiates the logits.
fn fuse_head(ctx: &mut StepCtx) -> Result<(), Error> {
    ctx.fused = match fused_head::fuse(ctx.model, &ctx.req.fused_head)? {
        Outcome::Fused(view) => Some(view),
        Outcome::Dense(Some(why)) => {
            ctx.warnings.push(format!(
                "the LM head is not fused, so the step graph holds the [N, V] logits: {why}"
            ));
            None
        }
        Outcome::Dense(None) => None,
    };
    Ok(())
}

/// The step's builder opens after LoRA and the fused head: it knows the names they added.
fn open_builder(ctx: &mut StepCtx) -> Result<(), Error> {
    let taken = GraphIndex::new(graph(ctx.model)).taken_names(PREFIX, &[]);
    ctx.b = Some(Builder::new(PREFIX, ctx.opset, taken));
    Ok(())
}

/// A half-precision export widened to float32 once LoRA has said what trains (frozen weights
/// stay half), before anything analyses the graph: later stages see float32.
fn widen_half_export(ctx: &mut StepCtx) -> Result<(), Error> {
    let rule = train_rule(ctx.req, ctx.adapted.as_ref(), &ctx.adapters);
    let b = builder(&mut ctx.b);
    let graph = graph_mut(ctx.model);
    ctx.widened = upcast::widen_half_export(graph, ctx.req.precision, b, &|n| rule.trains(n))?;
    Ok(())
}

/// Exporter idioms rewritten into differentiable forms; their constants join the graph now,
/// so the analysis below sees their values.
fn canonicalize(ctx: &mut StepCtx) -> Result<(), Error> {
    let b = builder(&mut ctx.b);
    let graph = graph_mut(ctx.model);
    grad::canonical::canonicalize(graph, b);
    graph.initializer.append(&mut b.initializers);
    Ok(())
}

/// Attention replaced by one internal node on the widened, canonical forward, before
/// differentiation: the node has a blockwise gradient of its own.
fn replace_attention(ctx: &mut StepCtx) -> Result<(), Error> {
    if ctx.req.attention.mode == attention::Mode::Auto && ctx.req.precision().scales_loss() {
        ctx.attended = attention::Outcome::kept(FP16_KEEPS_ATTENTION);
        return Ok(());
    }
    let graph = graph(ctx.model);
    let weights: Vec<String> = graph
        .initializer
        .iter()
        .filter(|t| {
            crate::onnx::is_float_type(t.data_type()) && t.dims.iter().product::<i64>() >= 2
        })
        .map(|t| t.name().to_string())
        .collect();
    let weight_derived = grad::depending_on(&graph.node, &weights);
    let b = builder(&mut ctx.b);
    let attended = attention::replace(ctx.model, &ctx.req.attention, b, &weight_derived)?;
    if let Some((node, why)) = attended.left.first() {
        ctx.warnings.push(format!(
            "{} attention(s) left as exported, storing their [.., T, T] scores for the backward (e.g. at Softmax node '{node}': {why})",
            attended.left.len()
        ));
    }
    if let Some((node, why)) = attended.blockwise.first() {
        ctx.warnings.push(format!(
            "--attention onnx: {} attention(s) keep the blockwise forward in standard ops (e.g. at Softmax node '{node}': {why})",
            attended.blockwise.len()
        ));
    }
    ctx.attended = attended;
    graph_mut(ctx.model).initializer.append(&mut b.initializers);
    Ok(())
}

/// Why `--attention auto` leaves fp16 step graphs' attention as exported.
const FP16_KEEPS_ATTENTION: &str = "under --precision fp16 the attention stays as exported: dynamic loss scaling skips the steps whose half products overflow, and the exported attention overflows where torch's autocast does (the blockwise one sums in other blocks and order); --attention chunked makes it blockwise";

/// Ranks, proven shapes and element types of the finished forward, for differentiation and
/// the optimizer.
fn analyse_forward(ctx: &mut StepCtx) -> Result<(), Error> {
    let graph = graph(ctx.model);
    ctx.loss = graph.output[0].name().to_string();
    let index = GraphIndex::new(graph);
    ctx.ranks = Ranks::infer(&index);
    ctx.shapes = Shapes::infer(&index);
    ctx.types = ElemTypes::infer(index.graph);
    Ok(())
}

/// The trained parameters, chosen on the finished forward (LoRA's adapters and the widened
/// weights are initializers by now).
fn select_parameters(ctx: &mut StepCtx) -> Result<(), Error> {
    let rule = train_rule(ctx.req, ctx.adapted.as_ref(), &ctx.adapters);
    let mut selection = parameters::select(graph(ctx.model), &ctx.loss, &rule, &ctx.widened)?;
    ctx.warnings.append(&mut selection.warnings);
    // weights in external data: the zero state goes to a sparse file beside the graph that
    // holds the optimizer state (the update graph with --split)
    if selection.external {
        ctx.zeros = ZeroState::beside(ctx.outputs.last().expect("one output at least"));
    }
    ctx.selection = selection;
    Ok(())
}

/// fp16's loss-scale state, claimed before differentiation: the backward is seeded with the
/// scale (a state input).
fn claim_loss_scale(ctx: &mut StepCtx) -> Result<(), Error> {
    if !ctx.precision.scales_loss() {
        return Ok(());
    }
    let b = builder(&mut ctx.b);
    let s = ScaleState {
        scale: claim(b, SCALE_STATE.to_string())?,
        tracker: claim(b, TRACKER_STATE.to_string())?,
        next_scale: claim(b, format!("{PREFIX}/next/{SCALE_STATE}"))?,
        next_tracker: claim(b, format!("{PREFIX}/next/{TRACKER_STATE}"))?,
        skipped: claim(b, SKIP_OUTPUT.to_string())?,
    };
    ctx.ranks.set(&s.scale, 0);
    ctx.scale_state = Some(s);
    Ok(())
}

/// The whole model's backward, from the loss to every trained parameter.
fn differentiate(ctx: &mut StepCtx) -> Result<(), Error> {
    let graph = graph(ctx.model);
    let b = builder(&mut ctx.b);
    let mut gctx = Ctx::new(b, &mut ctx.ranks, &ctx.shapes, &ctx.types, ctx.opset);
    gctx.weight_grads_by_gemm = ctx.precision.half_type().is_none();
    gctx.attention_block = ctx.req.attention.block.unwrap_or(attention::DEFAULT_BLOCK);
    let seed = ctx.scale_state.as_ref().map(|s| s.scale.as_str());
    ctx.grads = grad::differentiate(
        &mut gctx,
        &graph.node,
        &ctx.loss,
        &ctx.selection.params,
        seed,
    )?;
    ctx.gradient_of = std::mem::take(&mut gctx.gradient_of);
    ctx.data_inputs = data_inputs(graph);
    Ok(())
}

/// Mixed precision over the forward and backward together, before the optimizer, which
/// stays float32.
fn autocast(ctx: &mut StepCtx) -> Result<(), Error> {
    let Some(half) = ctx.precision.half_type() else {
        return Ok(());
    };
    let graph = graph(ctx.model);
    let b = builder(&mut ctx.b);
    let mut all = graph.node.clone();
    all.append(&mut b.nodes);
    let mut sinks: HashSet<String> = ctx.grads.iter().cloned().collect();
    sinks.extend([ctx.loss.clone(), CE_OUTPUT.into(), NUMBER_OUTPUT.into()]);
    let mut all_types = ElemTypes::infer(graph);
    for t in &b.initializers {
        all_types.set(t.name(), t.data_type());
    }
    all_types.follow(&all[graph.node.len()..]);
    let params = ctx.selection.params.iter().cloned().collect();
    let new_initializers = b.initializers.clone();
    let inputs = precision::Inputs {
        widened: &ctx.widened,
        graph,
        new_initializers: &new_initializers,
        params: &params,
        ranks: &ctx.ranks,
        types: &all_types,
        opset: ctx.opset,
        float32_sinks: &sinks,
    };
    ctx.mixed = Some(precision::autocast(b, all, half, &inputs));
    Ok(())
}

/// The optimizer's state names, claimed in the order the metadata lists them: each
/// parameter, then its slots; the step count; fp16's scale state last.
fn claim_optimizer_state(ctx: &mut StepCtx) -> Result<(), Error> {
    let b = builder(&mut ctx.b);
    let slots = ctx.req.optimizer.slots();
    let mut updates = Vec::new();
    let params = ctx.selection.params.iter().zip(&ctx.selection.dims);
    for ((p, dims), g) in params.zip(&ctx.grads) {
        let slot_in: Vec<String> = slots
            .iter()
            .map(|s| claim(b, format!("{PREFIX}/state/{p}/{s}")))
            .collect::<Result<_, _>>()?;
        let slot_out: Vec<String> = slot_in
            .iter()
            .map(|s| claim(b, format!("{PREFIX}/next/{s}")))
            .collect::<Result<_, _>>()?;
        updates.push(ParamUpdate {
            param: p.clone(),
            dims: dims.clone(),
            grad: g.clone(),
            next_param: claim(b, format!("{PREFIX}/next/{p}"))?,
            slots: slot_in,
            next_slots: slot_out,
        });
    }
    let step_in = claim(b, STEP_INPUT.to_string())?;
    let step_out = claim(b, format!("{PREFIX}/next/{STEP_INPUT}"))?;
    let lr = claim(b, LR_INPUT.to_string())?;

    let mut pairs: Vec<StatePair> = Vec::new();
    for (u, dims) in updates.iter().zip(&ctx.selection.dims) {
        pairs.push((u.param.clone(), u.next_param.clone(), dims.clone(), FLOAT));
        for (i, o) in u.slots.iter().zip(&u.next_slots) {
            pairs.push((i.clone(), o.clone(), dims.clone(), FLOAT));
        }
    }
    pairs.push((step_in.clone(), step_out.clone(), vec![], INT64));
    if let Some(s) = &ctx.scale_state {
        pairs.push((s.scale.clone(), s.next_scale.clone(), vec![], FLOAT));
        pairs.push((s.tracker.clone(), s.next_tracker.clone(), vec![], INT64));
    }
    ctx.state = OptimizerState {
        updates,
        step: (step_in, step_out),
        lr,
        pairs,
    };
    Ok(())
}

/// The `ntl_step` metadata, before the update is emitted: `--split` writes it into the update
/// graph as it stands then.
fn describe(ctx: &mut StepCtx) -> Result<(), Error> {
    let req = ctx.req;
    let s = &ctx.selection;
    let scale_state = ctx.scale_state.as_ref();
    ctx.meta = Some(StepMetadata {
        version: env!("CARGO_PKG_VERSION").into(),
        state: ctx
            .state
            .pairs
            .iter()
            .map(|(i, o, _, _)| (i.clone(), o.clone()))
            .collect(),
        parameters: s.params.clone(),
        frozen: s.frozen.clone(),
        buffers: s.buffers.clone(),
        optimizer: Some(optimizer_meta(&req.optimizer)),
        lr_input: ctx.state.lr.clone(),
        losses: vec![ctx.loss.clone(), CE_OUTPUT.into(), NUMBER_OUTPUT.into()],
        data_inputs: ctx.data_inputs.clone(),
        split: req.split,
        precision: ctx.precision.name().into(),
        loss_scale: scale_state.map(|_| req.loss_scale.to_meta()),
        skip_output: scale_state.map(|s| s.skipped.clone()),
        step_input: Some(ctx.state.step.0.clone()),
        loss_scale_input: scale_state.map(|s| s.scale.clone()),
        // named by the update once it is emitted
        grad_norm_sq: None,
        found_inf: None,
        fused_head: ctx.fused.clone(),
        lora: ctx
            .adapted
            .as_ref()
            .zip(req.lora.as_ref())
            .map(|(a, o)| a.to_meta(o)),
        quantize_base: ctx.quantized.as_ref().map(|q| q.to_meta()),
        recompute: None,
        attention: None,
        in_place: None,
    });
    Ok(())
}

/// The metadata's `optimizer`: torch's names.
fn optimizer_meta(o: &OptimizerOptions) -> contract::Optimizer {
    contract::Optimizer {
        name: match o.kind {
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Sgd => "sgd",
        }
        .into(),
        lr: o.lr,
        beta1: Some(o.beta1),
        beta2: Some(o.beta2),
        eps: Some(o.eps),
        weight_decay: Some(o.weight_decay),
        momentum: Some(o.momentum),
        max_grad_norm: o.max_grad_norm,
    }
}

/// The optimizer update, into the step graph or (`--split`) into an update graph of its own;
/// the forward, backward and update are then the graph's nodes and the step's builder closes.
fn emit_optimizer_update(ctx: &mut StepCtx) -> Result<(), Error> {
    if ctx.req.split {
        split_update(ctx)?;
    } else {
        inline_update(ctx)?;
    }
    ctx.b = None;
    Ok(())
}

/// `--split`: the gradients become outputs, the optimizer goes into the update graph.
fn split_update(ctx: &mut StepCtx) -> Result<(), Error> {
    let (req, state) = (ctx.req, &ctx.state);
    let b = builder(&mut ctx.b);
    let grad_names: Vec<String> = ctx
        .selection
        .params
        .iter()
        .map(|p| claim(b, format!("{PREFIX}/grad/{p}")))
        .collect::<Result<_, _>>()?;
    for (g, name) in ctx.grads.iter().zip(&grad_names) {
        b.node_to("Identity", &[g], &[name], vec![]);
    }
    ctx.update = Some(update_model(
        ctx.model,
        req,
        &state.updates,
        &grad_names,
        &state.pairs,
        (&state.step.0, &state.step.1),
        &state.lr,
        ctx.scale_state.as_ref(),
        ctx.meta.as_mut().expect("described before"),
        &mut ctx.zeros,
    )?);
    let graph = graph_mut(ctx.model);
    set_nodes(graph, ctx.mixed.take(), b);
    let dims = &ctx.selection.dims;
    let mut param_inputs: Vec<ValueInfoProto> = ctx
        .selection
        .params
        .iter()
        .zip(dims)
        .map(|(p, d)| tensor_info(p, FLOAT, d))
        .collect();
    // fp16: the gradient graph reads the current loss scale (the update graph holds it)
    if let Some(s) = &ctx.scale_state {
        param_inputs.push(tensor_info(&s.scale, FLOAT, &[]));
        graph.initializer.push(crate::onnx::f32_tensor(
            &s.scale,
            &[],
            &[req.loss_scale.init_scale as f32],
        ));
    }
    set_inputs(graph, param_inputs);
    let grad_outputs: Vec<ValueInfoProto> = grad_names
        .iter()
        .zip(dims)
        .map(|(n, d)| tensor_info(n, FLOAT, d))
        .collect();
    set_outputs(graph, &ctx.loss, grad_outputs);
    Ok(())
}

/// One step graph: the optimizer after the backward, the state as inputs and next outputs.
fn inline_update(ctx: &mut StepCtx) -> Result<(), Error> {
    let (req, state) = (ctx.req, &ctx.state);
    let b = builder(&mut ctx.b);
    let global = {
        let mut gctx = Ctx::new(b, &mut ctx.ranks, &ctx.shapes, &ctx.types, ctx.opset);
        emit_optimizer(
            &mut gctx,
            req,
            &state.updates,
            (&state.step.0, &state.step.1),
            &state.lr,
            ctx.scale_state.as_ref(),
        )
    };
    let meta = ctx.meta.as_mut().expect("described before");
    (meta.grad_norm_sq, meta.found_inf) = global;
    let graph = graph_mut(ctx.model);
    set_nodes(graph, ctx.mixed.take(), b);
    add_state_initializers(graph, &state.pairs, &mut ctx.zeros, req)?;
    graph.initializer.push(crate::onnx::f32_tensor(
        &state.lr,
        &[],
        &[req.optimizer.lr as f32],
    ));
    let mut inputs: Vec<ValueInfoProto> = state
        .pairs
        .iter()
        .map(|(i, _, d, t)| tensor_info(i, *t, d))
        .collect();
    inputs.push(tensor_info(&state.lr, FLOAT, &[]));
    set_inputs(graph, inputs);
    let mut next: Vec<ValueInfoProto> = state
        .pairs
        .iter()
        .map(|(_, o, d, t)| tensor_info(o, *t, d))
        .collect();
    next.extend(skip_output(ctx.scale_state.as_ref()));
    set_outputs(graph, &ctx.loss, next);
    Ok(())
}

/// The fused head expanded into Scans over chunks of positions once the backward is in the
/// graph: differentiation and autocast saw one node.
fn lower_fused_head(ctx: &mut StepCtx) -> Result<(), Error> {
    fused_head::lower::lower(ctx.model, ctx.precision.half_type());
    Ok(())
}

/// Each layer's forward recomputed before its backward, on the finished step graph: it
/// copies the forward nodes the backward reads.
fn recompute_layers(ctx: &mut StepCtx) -> Result<(), Error> {
    let req = ctx.req;
    let graph = graph_mut(ctx.model);
    let mut b = Builder::new(
        PREFIX,
        ctx.opset,
        GraphIndex::new(graph).taken_names(PREFIX, &[]),
    );
    let slots = req.optimizer.slots().len() as u64;
    let state_bytes = ctx.selection.elements.saturating_mul(1 + slots) * 4;
    let facts = StepFacts {
        losses: &[ctx.loss.as_str(), CE_OUTPUT, NUMBER_OUTPUT],
        data_inputs: &ctx.data_inputs,
        gradient_of: &ctx.gradient_of,
        state_bytes,
    };
    let recomputed = recompute::recompute(graph, &mut b, &req.recompute, &facts)?;
    ctx.warnings.extend(recomputed.warnings.iter().cloned());
    ctx.meta().recompute = Some(recomputed.to_meta(req.recompute.mode));
    Ok(())
}

/// The attention nodes expanded into Scans after recomputation, which copies a layer's
/// attention node like any other.
fn lower_attention(ctx: &mut StepCtx) -> Result<(), Error> {
    attention::lower::lower(ctx.model, ctx.precision.half_type());
    let attention = ctx.attended.to_meta(&ctx.req.attention);
    ctx.meta().attention = Some(attention);
    Ok(())
}

/// QLoRA's dequantisation copied per reading node, after every stage that adds readers
/// (recomputed copies, lowered Scans); the codes and scales are declared inputs.
fn dequantize_per_use(ctx: &mut StepCtx) -> Result<(), Error> {
    let Some(q) = &ctx.quantized else {
        return Ok(());
    };
    let graph = graph_mut(ctx.model);
    let taken = GraphIndex::new(graph).taken_names(PREFIX, &[]);
    per_use::dequantize_per_use(graph, q, ctx.opset, taken);
    let declared: BTreeSet<String> = graph.input.iter().map(|i| i.name().to_string()).collect();
    let infos: Vec<ValueInfoProto> = q
        .stored()
        .iter()
        .filter(|(n, _, _)| !declared.contains(n))
        .map(|(n, t, d)| tensor_info(n, *t, d))
        .collect();
    graph.input.extend(infos);
    Ok(())
}

/// Frozen half weights get one widening Cast per reading node, after every stage that adds
/// readers (recomputed copies, lowered Scans); frozen weights are then declared inputs.
fn cast_frozen_half(ctx: &mut StepCtx) -> Result<(), Error> {
    let graph = graph_mut(ctx.model);
    let taken = GraphIndex::new(graph).taken_names(PREFIX, &[]);
    frozen_half::cast_per_use(graph, &ctx.widened, ctx.opset, taken);
    declare_frozen(graph, &ctx.selection.frozen);
    Ok(())
}

/// The state inputs a runtime may update in their own memory, checked last, on the emitted
/// graph, against every reader of the state (`--split`'s update graph has its own).
fn mark_in_place(ctx: &mut StepCtx) -> Result<(), Error> {
    if ctx.update.is_some() {
        return Ok(());
    }
    // the parameters are read by the backward pass too: only the optimizer's own state
    let state = &ctx.state;
    let params: BTreeSet<&str> = state.updates.iter().map(|u| u.param.as_str()).collect();
    let candidates: Vec<(&str, &str)> = state
        .pairs
        .iter()
        .filter(|(i, _, _, _)| !params.contains(i.as_str()))
        .map(|(i, o, _, _)| (i.as_str(), o.as_str()))
        .collect();
    let in_place = in_place::in_place_inputs(graph(ctx.model), &candidates);
    ctx.meta().in_place = Some(in_place);
    Ok(())
}

/// The graph's nodes: the forward and backward (retyped by the precision pass, or as they
/// are), then what `b` emitted after them; `b`'s constants join the initializers.
fn set_nodes(graph: &mut GraphProto, mixed: Option<precision::Mixed>, b: &mut Builder) {
    if let Some(mixed) = mixed {
        mixed.retype(&mut graph.value_info);
        graph.node = mixed.nodes;
    }
    splice(graph, Splice::append(std::mem::take(&mut b.nodes)));
    graph
        .initializer
        .extend(std::mem::take(&mut b.initializers));
}

/// The update's tensors that read every gradient, which a sharded trainer computes over all
/// shards and feeds instead: the clipping's Σ‖g‖² and fp16's inf/NaN flag (the metadata's
/// `grad_norm_sq` and `found_inf`).
type GlobalTensors = (Option<String>, Option<String>);

/// The optimizer update, behind fp16's loss scaling where there is one. With
/// `--update-bucket` the small tensors are flattened into buckets first, so that the clipping's
/// norm, fp16's unscaling, inf/NaN check and skip, and the update each run once a bucket.
fn emit_optimizer(
    ctx: &mut Ctx,
    req: &StepOptions,
    params: &[ParamUpdate],
    step: (&str, &str),
    lr: &str,
    scale_state: Option<&ScaleState>,
) -> GlobalTensors {
    let runs = multi_tensor::plan(params, req.optimizer.update_bucket_mib << 20);
    let (updates, buckets) = multi_tensor::flatten(ctx, params, &runs);
    let global = match scale_state {
        Some(s) => {
            let (norm_sq, found) = loss_scale::emit_scaled_update(
                ctx,
                &req.optimizer,
                &req.loss_scale,
                &updates,
                step,
                lr,
                s,
            );
            (norm_sq, Some(found))
        }
        None => (
            emit_update(ctx, &req.optimizer, &updates, step.0, step.1, lr),
            None,
        ),
    };
    multi_tensor::unflatten(ctx, params, &updates, &buckets);
    global
}

/// fp16's `ntl/skipped` output (bool scalar), after the state outputs.
fn skip_output(scale_state: Option<&ScaleState>) -> Option<ValueInfoProto> {
    scale_state.map(|s| tensor_info(&s.skipped, loss_scale::SKIP_TYPE, &[]))
}

/// Frozen weights (more than one value) as graph inputs too, their initializers the defaults
/// (nothing to feed). onnxruntime folds what a constant initializer alone computes into new
/// initializers: the backward's `Transpose` of each frozen weight became a second, transposed
/// copy of it (2.3x the float initializers of a LoRA step graph after ORT_ENABLE_ALL,
/// measured), and a half weight's cast a float32 copy. An input is never folded, so those run
/// per step, each copy freed after its node.
fn declare_frozen(graph: &mut GraphProto, frozen: &[String]) {
    let declared: BTreeSet<&str> = graph.input.iter().map(|i| i.name()).collect();
    let by_name: std::collections::HashMap<&str, &TensorProto> =
        graph.initializer.iter().map(|t| (t.name(), t)).collect();
    let infos: Vec<ValueInfoProto> = frozen
        .iter()
        .filter(|n| !declared.contains(n.as_str()))
        .filter_map(|n| by_name.get(n.as_str()))
        .filter(|t| t.dims.iter().product::<i64>() > 1)
        .map(|t| tensor_info(t.name(), t.data_type(), &t.dims))
        .collect();
    graph.input.extend(infos);
}

/// The model's own data inputs: graph inputs that are not initializers.
fn data_inputs(graph: &GraphProto) -> Vec<String> {
    let inits: BTreeSet<&str> = graph.initializer.iter().map(|t| t.name()).collect();
    graph
        .input
        .iter()
        .filter(|i| !inits.contains(i.name()))
        .map(|i| i.name().to_string())
        .collect()
}

/// Inputs: the data inputs as they were, then `extra` (initializers that old exporters
/// list as inputs are dropped from the list: IR >= 4 does not need them there).
fn set_inputs(graph: &mut GraphProto, extra: Vec<ValueInfoProto>) {
    let inits: BTreeSet<String> = graph
        .initializer
        .iter()
        .map(|t| t.name().to_string())
        .collect();
    graph.input.retain(|i| !inits.contains(i.name()));
    graph.input.extend(extra);
}

/// Outputs: the total, `ce_loss`, `number_loss`, then `extra`.
fn set_outputs(graph: &mut GraphProto, loss: &str, extra: Vec<ValueInfoProto>) {
    let keep = [loss, CE_OUTPUT, NUMBER_OUTPUT];
    let mut outs: Vec<ValueInfoProto> = keep
        .iter()
        .filter_map(|k| graph.output.iter().find(|o| o.name() == *k).cloned())
        .collect();
    outs.extend(extra);
    graph.output = outs;
}

/// Zero moments and the step count (the parameters' initializers are already there).
fn add_state_initializers(
    graph: &mut GraphProto,
    state: &[(String, String, Vec<i64>, i32)],
    zeros: &mut ZeroState,
    req: &StepOptions,
) -> Result<(), Error> {
    let params: BTreeSet<String> = graph
        .initializer
        .iter()
        .map(|t| t.name().to_string())
        .collect();
    for (name, _, dims, t) in state {
        if params.contains(name) {
            continue;
        }
        graph
            .initializer
            .push(initial_state(name, dims, *t, zeros, req)?);
    }
    Ok(())
}

/// The initial value of a state tensor that is not a parameter: the loss scale's initial
/// scale, 0 for the counters, zeros for the optimizer moments.
fn initial_state(
    name: &str,
    dims: &[i64],
    elem_type: i32,
    zeros: &mut ZeroState,
    req: &StepOptions,
) -> Result<TensorProto, Error> {
    if name == SCALE_STATE {
        return Ok(crate::onnx::f32_tensor(
            name,
            &[],
            &[req.loss_scale.init_scale as f32],
        ));
    }
    if elem_type == INT64 {
        return Ok(crate::onnx::i64_tensor(name, &[], &[0]));
    }
    zeros.tensor(name, dims)
}

/// The update graph of `--split`: parameters, optimizer state, gradients and the learning
/// rate in; next parameters and state out.
#[allow(clippy::too_many_arguments)]
fn update_model(
    model: &ModelProto,
    req: &StepOptions,
    updates: &[ParamUpdate],
    grad_names: &[String],
    state: &[(String, String, Vec<i64>, i32)],
    step: (&str, &str),
    lr: &str,
    scale_state: Option<&ScaleState>,
    meta: &mut StepMetadata,
    zeros: &mut ZeroState,
) -> Result<ModelProto, Error> {
    let opset = default_opset(model).expect("checked");
    let taken: std::collections::HashSet<String> = state
        .iter()
        .flat_map(|(i, o, _, _)| [i.clone(), o.clone()])
        .chain(grad_names.iter().cloned())
        .chain([lr.to_string()])
        .chain(scale_state.map(|s| s.skipped.clone()))
        .collect();
    let mut b = Builder::new(PREFIX, opset, taken);
    let mut ranks = Ranks::default();
    let shapes = Shapes::default();
    let types = crate::graph::elem_types::ElemTypes::default();
    // In the update graph each gradient is an input under its `ntl/grad/<param>` name.
    let local: Vec<ParamUpdate> = updates
        .iter()
        .zip(grad_names)
        .map(|(u, g)| ParamUpdate {
            param: u.param.clone(),
            dims: u.dims.clone(),
            grad: g.clone(),
            slots: u.slots.clone(),
            next_param: u.next_param.clone(),
            next_slots: u.next_slots.clone(),
        })
        .collect();
    let global = {
        let mut ctx = Ctx::new(&mut b, &mut ranks, &shapes, &types, opset);
        emit_optimizer(&mut ctx, req, &local, step, lr, scale_state)
    };
    let mut graph = GraphProto {
        name: Some("ntl_update".into()),
        node: b.nodes,
        initializer: b.initializers,
        ..Default::default()
    };
    let params: BTreeSet<&str> = updates.iter().map(|u| u.param.as_str()).collect();
    for (name, _, dims, t) in state {
        graph.input.push(tensor_info(name, *t, dims));
        if !params.contains(name.as_str()) {
            graph
                .initializer
                .push(initial_state(name, dims, *t, zeros, req)?);
        }
    }
    for (g, (_, _, dims, _)) in grad_names
        .iter()
        .zip(state.iter().filter(|s| params.contains(s.0.as_str())))
    {
        graph.input.push(tensor_info(g, FLOAT, dims));
    }
    graph.input.push(tensor_info(lr, FLOAT, &[]));
    graph
        .initializer
        .push(crate::onnx::f32_tensor(lr, &[], &[req.optimizer.lr as f32]));
    graph.output = state
        .iter()
        .map(|(_, o, d, t)| tensor_info(o, *t, d))
        .chain(skip_output(scale_state))
        .collect();
    // only the optimizer reads the state here: every tensor may be updated in place
    let pairs: Vec<(&str, &str)> = state
        .iter()
        .map(|(i, o, _, _)| (i.as_str(), o.as_str()))
        .collect();
    // the gradient graph's metadata repeats the list; the update's own tensors are named in
    // the update graph only
    meta.in_place = Some(in_place::in_place_inputs(&graph, &pairs));
    let mut update_meta = meta.clone();
    (update_meta.grad_norm_sq, update_meta.found_inf) = global;
    let update = ModelProto {
        ir_version: model.ir_version,
        opset_import: model
            .opset_import
            .iter()
            .filter(|o| matches!(o.domain(), "" | "ai.onnx"))
            .cloned()
            .collect(),
        producer_name: Some("ntl-patch".into()),
        producer_version: Some(env!("CARGO_PKG_VERSION").into()),
        graph: Some(graph),
        metadata_props: vec![update_meta.entry()],
        ..Default::default()
    };
    crate::graph::patch::check_consistency(&update).map_err(Error::Inconsistent)?;
    Ok(update)
}

pub fn tensor_info(name: &str, elem_type: i32, dims: &[i64]) -> ValueInfoProto {
    use proto::tensor_shape_proto::{dimension, Dimension};
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(proto::type_proto::Value::TensorType(
                proto::type_proto::Tensor {
                    elem_type: Some(elem_type),
                    shape: Some(proto::TensorShapeProto {
                        dim: dims
                            .iter()
                            .map(|&d| Dimension {
                                value: Some(dimension::Value::DimValue(d)),
                                ..Default::default()
                            })
                            .collect(),
                    }),
                },
            )),
            ..Default::default()
        }),
        ..Default::default()
    }
}

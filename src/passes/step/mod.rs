//! `ntl-patch step`: the patched forward graph plus its whole-model backward and the
//! optimizer update, as one standard-ONNX graph that performs a training step
//! (`docs/STEP_GRAPH.md` is the contract). `--split` writes the gradient graph and the
//! update graph separately (for data-parallel training, where gradients are averaged
//! between the two).

mod copies;
mod in_place;
pub mod optimizer;
pub mod precision;
mod zero_state;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::error::Error;
use crate::graph::ranks::Ranks;
use crate::graph::shapes::Shapes;
use crate::graph::GraphIndex;
use crate::io::model_io::{load_model, model_dir, save_model_from};
use crate::onnx::{
    default_opset, proto, GraphProto, ModelProto, StringStringEntryProto, TensorProto, TypeProto,
    ValueInfoProto, FLOAT, INT64,
};
use crate::passes::attention::{self, AttentionOptions};
use crate::passes::fused_head::{self, FusedHeadOptions, Outcome};
use crate::passes::grad::{self, Ctx};
use crate::passes::lora::{self, Adapted, LoraOptions};
use crate::passes::pipeline::{patch_model, PatchRequest, PatchSummary};
use crate::passes::recompute::{self, RecomputeOptions, StepFacts};
use ntl_ops::names::{CE_OUTPUT, NUMBER_OUTPUT, PREFIX};
use ntl_ops::Builder;
use optimizer::{emit_update, ParamUpdate};
pub use optimizer::{OptimizerKind, OptimizerOptions};
use precision::frozen_half;
use precision::loss_scale::{
    self, LossScaleOptions, ScaleState, SCALE_STATE, SKIP_OUTPUT, TRACKER_STATE,
};
use precision::upcast;
pub use precision::Precision;
use zero_state::ZeroState;

/// Metadata key of step graphs.
pub const STEP_METADATA_KEY: &str = "ntl_step";

/// A step graph's `ntl_step` metadata: None where the model has none, an error where it is
/// not JSON.
pub fn step_metadata(model: &ModelProto) -> Option<serde_json::Result<serde_json::Value>> {
    let entry = model
        .metadata_props
        .iter()
        .find(|p| p.key() == STEP_METADATA_KEY)?;
    Some(serde_json::from_str(entry.value()))
}
pub const LR_INPUT: &str = "ntl/lr";
pub const STEP_INPUT: &str = "ntl/state/step";

/// Float initializers whose names end like these are buffers torch never trains (rotary
/// frequencies, batch-norm statistics, position ids): kept constant.
const BUFFER_SUFFIXES: &[&str] = &[
    "inv_freq",
    "running_mean",
    "running_var",
    "num_batches_tracked",
    "position_ids",
    "masked_bias",
];

pub struct StepRequest {
    pub patch: PatchRequest,
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
    /// `--recompute`: the backward recomputes each layer's forward.
    pub recompute: RecomputeOptions,
    /// `--attention`: attention over blocks of query rows, never storing the scores.
    pub attention: AttentionOptions,
}

impl StepRequest {
    pub fn precision(&self) -> Precision {
        self.precision.unwrap_or(Precision::Fp32)
    }
}

pub struct StepSummary {
    pub outputs: Vec<PathBuf>,
    pub patch: PatchSummary,
    pub parameters: Vec<String>,
    pub parameter_elements: u64,
    pub frozen: Vec<String>,
    pub buffers: Vec<String>,
    /// Things the user may want to know that change nothing (`--freeze` of a constant).
    pub notes: Vec<String>,
    pub warnings: Vec<String>,
    /// Positions per chunk where the LM head is fused.
    pub fused_head_chunk_tokens: Option<i64>,
    /// LoRA: the options and the adapted layers (the metadata's `lora`).
    pub lora: Option<serde_json::Value>,
    /// `--recompute`: what was chosen and why (the metadata's `recompute`).
    pub recompute: serde_json::Value,
    /// `--attention`: what was replaced and what was left (the metadata's `attention`).
    pub attention: serde_json::Value,
}

/// `model.onnx` → `model.step.onnx` (or `model.grad.onnx` + `model.update.onnx`).
pub fn default_outputs(model: &Path, split: bool) -> Vec<PathBuf> {
    let stem = model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let dir = model_dir(model);
    if split {
        vec![
            dir.join(format!("{stem}.grad.onnx")),
            dir.join(format!("{stem}.update.onnx")),
        ]
    } else {
        vec![dir.join(format!("{stem}.step.onnx"))]
    }
}

/// The outputs of `--split -o OUT`: `OUT` is the gradient graph, the update graph goes beside
/// it as `<OUT stem>.update.onnx`.
fn split_outputs(out: &Path) -> Vec<PathBuf> {
    let stem = out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let stem = stem.strip_suffix(".grad").unwrap_or(&stem).to_string();
    vec![
        out.to_path_buf(),
        model_dir(out).join(format!("{stem}.update.onnx")),
    ]
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
    Ok(())
}

pub fn run_step(req: &StepRequest) -> Result<StepSummary, Error> {
    check_options(&req.optimizer)?;
    if let Some(o) = &req.lora {
        o.check()?;
    } else if !req.train.is_empty() {
        return Err(Error::Usage("--train adds base weights to what LoRA trains; without --lora-r every weight trains already (use --freeze to leave some out)".into()));
    }
    req.loss_scale.check().map_err(Error::Usage)?;
    req.attention.check()?;
    let outputs = match &req.patch.output {
        Some(out) if req.split => split_outputs(out),
        Some(out) => vec![out.clone()],
        None => default_outputs(&req.patch.model, req.split),
    };
    if outputs.len() == 2 && outputs[0] == outputs[1] {
        return Err(Error::Usage("the gradient and update graphs would share a path; name the gradient graph OUT.grad.onnx with -o".into()));
    }
    let input = load_model(&req.patch.model)?;
    if input
        .metadata_props
        .iter()
        .any(|p| p.key() == STEP_METADATA_KEY)
    {
        return Err(Error::AlreadyStepGraph {
            path: req.patch.model.clone(),
        });
    }
    drop(input);
    let mut patched = patch_model(&req.patch, &outputs[0])?;
    for out in &outputs[1..] {
        if crate::io::model_io::same_file(&req.patch.model, out) {
            return Err(Error::OutputIsInput(out.clone()));
        }
        crate::io::fsio::check_output_path(out).map_err(|source| Error::Write {
            path: out.clone(),
            source,
        })?;
    }
    let built = build(&mut patched.model, req, &outputs)?;
    let summary = StepSummary {
        outputs: outputs.clone(),
        patch: patched.summary,
        parameters: built.parameters,
        parameter_elements: built.parameter_elements,
        frozen: built.frozen,
        buffers: built.buffers,
        notes: built.notes,
        warnings: built.warnings,
        fused_head_chunk_tokens: built.fused_head_chunk_tokens,
        lora: built.lora,
        recompute: built.recompute,
        attention: built.attention,
    };
    // Everything but the main graph first, removed again if a later write fails: an error
    // leaves no output at all.
    let mut written: Vec<PathBuf> = Vec::new();
    let result = (|| {
        let holder = outputs.last().expect("one output at least");
        if let Some(path) = built.zeros.write(&crate::io::model_io::model_dir(holder))? {
            written.push(path);
        }
        if let Some(update) = &built.update {
            save_model_from(update, &outputs[1], None, None)?;
            written.push(outputs[1].clone());
        }
        save_model_from(
            &patched.model,
            &outputs[0],
            Some(&patched.source),
            Some(&patched.external),
        )
    })();
    if let Err(e) = result {
        for path in written {
            let _ = std::fs::remove_file(path);
        }
        return Err(e);
    }
    Ok(summary)
}

struct Built {
    parameters: Vec<String>,
    parameter_elements: u64,
    frozen: Vec<String>,
    buffers: Vec<String>,
    notes: Vec<String>,
    warnings: Vec<String>,
    /// The update graph of `--split`.
    update: Option<ModelProto>,
    /// Where the optimizer state's zeros went (the step graph, or the update graph).
    zeros: ZeroState,
    fused_head_chunk_tokens: Option<i64>,
    lora: Option<serde_json::Value>,
    recompute: serde_json::Value,
    attention: serde_json::Value,
}

fn is_buffer_name(name: &str) -> bool {
    BUFFER_SUFFIXES.iter().any(|s| {
        name.strip_suffix(s)
            .is_some_and(|rest| rest.is_empty() || rest.ends_with(['.', '/', '_', ':']))
    })
}

/// What torch.export's graph signature says each lifted input is, as the dynamo exporter
/// records it on the value's metadata (`PARAMETER`, `BUFFER`, `CONSTANT_TENSOR`, ...).
const INPUT_KIND_KEY: &str = "pkg.torch.export.graph_signature.InputSpec.kind";

/// What the exporter recorded each lifted initializer as (`PARAMETER`, `BUFFER`, ...), where
/// it did: non-parameters are buffers such as Gemma's `embed_scale` or GPT-J's
/// `embed_positions`, or lifted constants.
fn recorded_kinds(graph: &GraphProto) -> std::collections::HashMap<&str, &str> {
    let values = graph.value_info.iter().chain(&graph.input);
    let kinds = values.map(|v| (v.name(), &v.metadata_props)).chain(
        graph
            .initializer
            .iter()
            .map(|t| (t.name(), &t.metadata_props)),
    );
    kinds
        .filter_map(|(name, props)| {
            let kind = props.iter().find(|p| p.key() == INPUT_KIND_KEY)?;
            Some((name, kind.value()))
        })
        .collect()
}

/// Whether a float initializer is a constant rather than a weight: a buffer by name, recorded
/// as a non-parameter, or a single value the exporter did not record as a parameter —
/// tf2onnx, jax2onnx and paddle2onnx store epsilons, scales and fill values (`-1`, `0`,
/// `1/√d`) as initializers, and training them would change the model's arithmetic.
fn is_constant(t: &TensorProto, kinds: &std::collections::HashMap<&str, &str>) -> bool {
    let kind = kinds.get(t.name()).copied();
    let single_value = t.dims.iter().product::<i64>() == 1;
    is_buffer_name(t.name())
        || kind.is_some_and(|k| k != "PARAMETER")
        || (single_value && kind.is_none())
}

/// Why nothing trains: weights of another float type (a half-precision or float64 export)
/// get their own fix; otherwise the weights are not initializers or all are frozen.
fn no_parameters_message(graph: &GraphProto, loss: &str) -> String {
    let other_floats: Vec<String> = graph
        .initializer
        .iter()
        .filter(|t| float_type_name(t.data_type()).is_some())
        .map(|t| t.name().to_string())
        .collect();
    let reaching = grad::reaching_loss(&graph.node, loss, &other_floats);
    let typed = reaching.first().and_then(|name| {
        let t = graph.initializer.iter().find(|t| t.name() == name)?;
        Some((name, float_type_name(t.data_type())?))
    });
    match typed {
        Some((name, ty)) => format!(
            "the weights are {ty} (e.g. '{name}'), and step trains float32 parameters (float32 optimizer state and updates); export the model in float32"
        ),
        None => "no float32 initializer reaches the loss through differentiable ops, so there is nothing to train; check the export keeps the weights as initializers (and --freeze)".into(),
    }
}

fn float_type_name(dt: i32) -> Option<&'static str> {
    use crate::onnx::proto::tensor_proto::DataType;
    match DataType::try_from(dt).ok()? {
        DataType::Float16 => Some("float16"),
        DataType::Bfloat16 => Some("bfloat16"),
        DataType::Double => Some("float64"),
        _ => None,
    }
}

/// Checks each `--freeze` prefix: one that matches only initializers step keeps constant
/// anyway (a buffer such as `inv_freq`, an exporter constant, a weight off the loss's path)
/// holds as asked and gets a note; one that matches no initializer at all is a mistake.
fn freeze_notes(
    graph: &GraphProto,
    freeze: &[String],
    trained: &[String],
) -> Result<Vec<String>, Error> {
    let mut notes = Vec::new();
    for prefix in freeze {
        if trained.iter().any(|p| p.starts_with(prefix.as_str())) {
            continue;
        }
        let user_initializers = graph
            .initializer
            .iter()
            .map(|t| t.name())
            .filter(|n| !n.starts_with(&format!("{PREFIX}/")));
        let matched: Vec<&str> = user_initializers
            .filter(|n| n.starts_with(prefix.as_str()))
            .collect();
        match matched.first() {
            Some(first) => notes.push(format!(
                "--freeze '{prefix}' matches {} initializer(s) (e.g. '{first}') that step keeps constant anyway (buffers, exporter constants, or off the loss's path): nothing more to freeze",
                matched.len()
            )),
            None => {
                return Err(Error::Usage(format!(
                    "--freeze '{prefix}' matches no trained parameter and no initializer; parameters are initializer names such as '{}'",
                    trained.first().map(String::as_str).unwrap_or("<none>")
                )))
            }
        }
    }
    Ok(notes)
}

/// Turns the patched forward model into the step graph (or the gradient graph, returning the
/// update graph as a separate model).
fn build(model: &mut ModelProto, req: &StepRequest, outputs: &[PathBuf]) -> Result<Built, Error> {
    let opset = default_opset(model).expect("checked by the patch step");
    let mut warnings = Vec::new();
    // LoRA first: the fused head then finds an adapted head (if named) no plain projection
    let adapted: Option<Adapted> = match &req.lora {
        Some(o) => Some(lora::insert(model, o)?),
        None => None,
    };
    if let Some(a) = &adapted {
        let unnamed: Vec<&str> = a
            .adapters
            .iter()
            .filter(|x| x.layer.module.is_none())
            .map(|x| x.layer.weight.as_str())
            .collect();
        if let Some(first) = unnamed.first() {
            warnings.push(format!(
                "{} adapted layer(s) have no module path in the export (e.g. '{first}', a weight the exporter renamed): their adapter files use the ONNX names, which PEFT cannot map to the model; export with do_constant_folding=False (TorchScript) or the dynamo exporter to keep the names",
                unnamed.len()
            ));
        }
    }
    let fused = match fused_head::fuse(model, &req.fused_head)? {
        Outcome::Fused(view) => Some(view),
        Outcome::Dense(Some(why)) => {
            warnings.push(format!(
                "the LM head is not fused, so the step graph holds the [N, V] logits: {why}"
            ));
            None
        }
        Outcome::Dense(None) => None,
    };
    let graph = model.graph.as_mut().expect("loaded models have a graph");
    let mut b = Builder::new(
        PREFIX,
        opset,
        GraphIndex::new(graph).taken_names(PREFIX, &[]),
    );
    let lora_params = adapted
        .as_ref()
        .map(Adapted::parameters)
        .unwrap_or_default();
    let trains = |name: &str| -> bool {
        if req.freeze.iter().any(|f| name.starts_with(f.as_str())) {
            return false;
        }
        adapted.is_none()
            || lora_params.contains(name)
            || req.train.iter().any(|t| name.starts_with(t.as_str()))
    };
    let widened = upcast::widen_half_export(graph, req.precision, &mut b, &trains)?;
    crate::passes::grad::canonical::canonicalize(graph, &mut b);
    // the rewrites' constants join the graph now, so shapes and ranks see their values
    graph.initializer.append(&mut b.initializers);
    let weights: Vec<String> = graph
        .initializer
        .iter()
        .filter(|t| {
            crate::onnx::is_float_type(t.data_type()) && t.dims.iter().product::<i64>() >= 2
        })
        .map(|t| t.name().to_string())
        .collect();
    let weight_derived = grad::depending_on(&graph.node, &weights);
    let attended = attention::replace(model, &req.attention, &mut b, &weight_derived)?;
    if let Some((node, why)) = attended.left.first() {
        warnings.push(format!(
            "{} attention(s) left as exported, storing their [.., T, T] scores for the backward (e.g. at Softmax node '{node}': {why})",
            attended.left.len()
        ));
    }
    let graph = model.graph.as_mut().expect("graph");
    graph.initializer.append(&mut b.initializers);
    let graph = &*graph;
    let loss = graph.output[0].name().to_string();
    let index = GraphIndex::new(graph);
    let mut ranks = Ranks::infer(&index);
    let shapes = Shapes::infer(&index);
    let types = crate::graph::elem_types::ElemTypes::infer(index.graph);

    let float_inits: Vec<&TensorProto> = graph
        .initializer
        .iter()
        .filter(|t| t.data_type() == FLOAT || widened.is_kept(t.name()))
        .filter(|t| !t.name().starts_with(&format!("{PREFIX}/")) || lora_params.contains(t.name()))
        .collect();
    let kinds = recorded_kinds(graph);
    let (buffer_like, candidates): (Vec<&TensorProto>, Vec<&TensorProto>) = float_inits
        .into_iter()
        .partition(|t| is_constant(t, &kinds));
    let candidate_names: Vec<String> = candidates.iter().map(|t| t.name().to_string()).collect();
    let reaching = grad::reaching_loss(&graph.node, &loss, &candidate_names);
    let buffer_names: Vec<String> = buffer_like.iter().map(|t| t.name().to_string()).collect();
    let buffers = grad::reaching_loss(&graph.node, &loss, &buffer_names);

    let notes = freeze_notes(graph, &req.freeze, &reaching)?;
    if let Some(t) = req
        .train
        .iter()
        .find(|t| !reaching.iter().any(|p| p.starts_with(t.as_str())))
    {
        return Err(Error::Usage(format!(
            "--train '{t}' matches no weight on the loss's path; weights are initializer names such as '{}'",
            reaching.iter().find(|p| !lora_params.contains(*p)).map(String::as_str).unwrap_or("<none>")
        )));
    }
    let (params, frozen): (Vec<String>, Vec<String>) =
        reaching.into_iter().partition(|p| trains(p));
    if params.is_empty() {
        return Err(Error::Usage(no_parameters_message(graph, &loss)));
    }
    let generated: Vec<&String> = params
        .iter()
        .filter(|p| p.starts_with("onnx::") || p.starts_with("val_") || p.starts_with("_val_"))
        .collect();
    if !generated.is_empty() {
        warnings.push(format!(
            "{} parameter(s) have exporter-generated names (e.g. '{}'): constant folding or the dynamo exporter's optimize=True may have copied, transposed or merged weights, which then train as separate tensors; export with do_constant_folding=False / optimize=False for training",
            generated.len(),
            generated[0]
        ));
    }
    let by_name: std::collections::HashMap<&str, &TensorProto> =
        graph.initializer.iter().map(|t| (t.name(), t)).collect();
    let trained: Vec<&TensorProto> = params
        .iter()
        .filter_map(|p| by_name.get(p.as_str()).copied())
        .collect();
    if let Some((a, b)) = copies::same_values(&trained).first() {
        warnings.push(format!(
            "parameters '{a}' and '{b}' hold the same values (a weight the exporter stored twice, e.g. folded or transposed): they train as separate tensors, so the model drifts from the framework's; re-export without constant folding (torch: optimize=False / do_constant_folding=False; tf2onnx: without its fold_constants optimizer)"
        ));
    }
    let param_dims: Vec<Vec<i64>> = params
        .iter()
        .map(|p| {
            by_name
                .get(p.as_str())
                .map(|t| t.dims.clone())
                .unwrap_or_default()
        })
        .collect();
    if let Some((p, _)) = params
        .iter()
        .zip(&param_dims)
        .find(|(_, d)| d.iter().any(|&x| x < 0))
    {
        return Err(Error::MalformedGraph(format!(
            "initializer '{p}' has a negative dimension"
        )));
    }
    // Weights in external data: the zero state goes to a sparse file beside the graph that
    // holds the optimizer state (the update graph with --split).
    let external = params
        .iter()
        .filter_map(|p| by_name.get(p.as_str()))
        .any(|t| {
            t.data_location() as i32
                == crate::onnx::proto::tensor_proto::DataLocation::External as i32
        });
    let mut zeros = if external {
        ZeroState::beside(outputs.last().expect("one output at least"))
    } else {
        ZeroState::inline()
    };
    let parameter_elements: u64 = param_dims
        .iter()
        .map(|d| d.iter().map(|&x| x as u64).product::<u64>())
        .sum();

    // State names, claimed exactly.
    let claim = |b: &mut Builder, name: String| -> Result<String, Error> {
        if b.claim(&name) {
            Ok(name)
        } else {
            Err(Error::OutputNameTaken(name))
        }
    };
    let precision = req.precision();
    // fp16: the backward is seeded with the loss scale (a state input)
    let scale_state = if precision.scales_loss() {
        Some(ScaleState {
            scale: claim(&mut b, SCALE_STATE.to_string())?,
            tracker: claim(&mut b, TRACKER_STATE.to_string())?,
            next_scale: claim(&mut b, format!("{PREFIX}/next/{SCALE_STATE}"))?,
            next_tracker: claim(&mut b, format!("{PREFIX}/next/{TRACKER_STATE}"))?,
            skipped: claim(&mut b, SKIP_OUTPUT.to_string())?,
        })
    } else {
        None
    };
    if let Some(s) = &scale_state {
        ranks.set(&s.scale, 0);
    }

    let nodes = graph.node.clone();
    let (grads, gradient_of) = {
        let mut ctx = Ctx::new(&mut b, &mut ranks, &shapes, &types, opset);
        let seed = scale_state.as_ref().map(|s| s.scale.as_str());
        let grads = grad::differentiate(&mut ctx, &nodes, &loss, &params, seed)?;
        (grads, std::mem::take(&mut ctx.gradient_of))
    };
    let forward_data_inputs = data_inputs(graph);
    // Mixed precision: forward and backward retyped together; the optimizer stays float32.
    let mixed = match precision.half_type() {
        Some(half) => {
            let mut all = nodes;
            all.append(&mut b.nodes);
            let mut sinks: std::collections::HashSet<String> = grads.iter().cloned().collect();
            sinks.extend([loss.clone(), CE_OUTPUT.into(), NUMBER_OUTPUT.into()]);
            let mut all_types = crate::graph::elem_types::ElemTypes::infer(graph);
            for t in &b.initializers {
                all_types.set(t.name(), t.data_type());
            }
            all_types.follow(&all[graph.node.len()..]);
            let param_set = params.iter().cloned().collect();
            let inputs = precision::Inputs {
                widened: &widened,
                graph,
                new_initializers: &b.initializers.clone(),
                params: &param_set,
                ranks: &ranks,
                types: &all_types,
                opset,
                float32_sinks: &sinks,
            };
            Some(precision::autocast(&mut b, all, half, &inputs))
        }
        None => None,
    };
    let slots = req.optimizer.slots();
    let mut updates = Vec::new();
    for (p, g) in params.iter().zip(&grads) {
        let slot_in: Vec<String> = slots
            .iter()
            .map(|s| claim(&mut b, format!("{PREFIX}/state/{p}/{s}")))
            .collect::<Result<_, _>>()?;
        let slot_out: Vec<String> = slot_in
            .iter()
            .map(|s| claim(&mut b, format!("{PREFIX}/next/{s}")))
            .collect::<Result<_, _>>()?;
        updates.push(ParamUpdate {
            param: p.clone(),
            grad: g.clone(),
            next_param: claim(&mut b, format!("{PREFIX}/next/{p}"))?,
            slots: slot_in,
            next_slots: slot_out,
        });
    }
    let step_in = claim(&mut b, STEP_INPUT.to_string())?;
    let step_out = claim(&mut b, format!("{PREFIX}/next/{STEP_INPUT}"))?;
    let lr = claim(&mut b, LR_INPUT.to_string())?;

    // State pairs in input order: each parameter, then its slots; the step count last.
    let mut state: Vec<(String, String, Vec<i64>, i32)> = Vec::new();
    for (u, dims) in updates.iter().zip(&param_dims) {
        state.push((u.param.clone(), u.next_param.clone(), dims.clone(), FLOAT));
        for (i, o) in u.slots.iter().zip(&u.next_slots) {
            state.push((i.clone(), o.clone(), dims.clone(), FLOAT));
        }
    }
    state.push((step_in.clone(), step_out.clone(), vec![], INT64));
    if let Some(s) = &scale_state {
        state.push((s.scale.clone(), s.next_scale.clone(), vec![], FLOAT));
        state.push((s.tracker.clone(), s.next_tracker.clone(), vec![], INT64));
    }

    let mut meta = serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "state": state.iter().map(|(i, o, _, _)| [i, o]).collect::<Vec<_>>(),
        "parameters": params,
        "frozen": frozen,
        "buffers": buffers,
        "optimizer": req.optimizer.to_json(),
        "lr_input": LR_INPUT,
        "losses": [loss, CE_OUTPUT, NUMBER_OUTPUT],
        "data_inputs": data_inputs(graph),
        "split": req.split,
        "precision": precision.name(),
        "loss_scale": scale_state.as_ref().map(|_| req.loss_scale.to_json()),
        "skip_output": scale_state.as_ref().map(|s| s.skipped.clone()),
    });
    if let Some(view) = &fused {
        meta["fused_head"] = view.to_json();
    }
    let lora_meta = adapted
        .as_ref()
        .zip(req.lora.as_ref())
        .map(|(a, o)| a.to_json(o));
    if let Some(l) = &lora_meta {
        meta["lora"] = l.clone();
    }

    let update = if req.split {
        let grad_names: Vec<String> = params
            .iter()
            .map(|p| claim(&mut b, format!("{PREFIX}/grad/{p}")))
            .collect::<Result<_, _>>()?;
        for (g, name) in grads.iter().zip(&grad_names) {
            b.node_to("Identity", &[g], &[name], vec![]);
        }
        let update = update_model(
            model,
            req,
            &updates,
            &grad_names,
            &state,
            (&step_in, &step_out),
            &lr,
            scale_state.as_ref(),
            &mut meta,
            &mut zeros,
        )?;
        let graph = model.graph.as_mut().expect("graph");
        set_nodes(graph, mixed, &mut b);
        let mut param_inputs: Vec<ValueInfoProto> = params
            .iter()
            .zip(&param_dims)
            .map(|(p, d)| tensor_info(p, FLOAT, d))
            .collect();
        // fp16: the gradient graph reads the current loss scale (the update graph holds it)
        if let Some(s) = &scale_state {
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
            .zip(&param_dims)
            .map(|(n, d)| tensor_info(n, FLOAT, d))
            .collect();
        set_outputs(graph, &loss, grad_outputs);
        Some(update)
    } else {
        let mut ctx = Ctx::new(&mut b, &mut ranks, &shapes, &types, opset);
        emit_optimizer(
            &mut ctx,
            req,
            &updates,
            (&step_in, &step_out),
            &lr,
            scale_state.as_ref(),
        );
        let graph = model.graph.as_mut().expect("graph");
        set_nodes(graph, mixed, &mut b);
        add_state_initializers(graph, &state, &mut zeros, req)?;
        graph.initializer.push(crate::onnx::f32_tensor(
            &lr,
            &[],
            &[req.optimizer.lr as f32],
        ));
        let mut inputs: Vec<ValueInfoProto> = state
            .iter()
            .map(|(i, _, d, t)| tensor_info(i, *t, d))
            .collect();
        inputs.push(tensor_info(&lr, FLOAT, &[]));
        set_inputs(graph, inputs);
        let mut next: Vec<ValueInfoProto> = state
            .iter()
            .map(|(_, o, d, t)| tensor_info(o, *t, d))
            .collect();
        next.extend(skip_output(scale_state.as_ref()));
        set_outputs(graph, &loss, next);
        None
    };
    fused_head::lower::lower(model, precision.half_type());
    let recomputed = {
        let graph = model.graph.as_mut().expect("graph");
        let mut b = Builder::new(
            PREFIX,
            opset,
            GraphIndex::new(graph).taken_names(PREFIX, &[]),
        );
        let state_bytes = parameter_elements.saturating_mul(1 + slots.len() as u64) * 4;
        let facts = StepFacts {
            losses: &[loss.as_str(), CE_OUTPUT, NUMBER_OUTPUT],
            data_inputs: &forward_data_inputs,
            gradient_of: &gradient_of,
            state_bytes,
        };
        recompute::recompute(graph, &mut b, &req.recompute, &facts)?
    };
    warnings.extend(recomputed.warnings.iter().cloned());
    let recompute_json = recomputed.to_json(req.recompute.mode);
    meta["recompute"] = recompute_json.clone();
    // after recomputation, which copies a layer's attention node like any other
    attention::lower::lower(model, precision.half_type());
    let attention_json = attended.to_json(&req.attention);
    meta["attention"] = attention_json.clone();
    {
        let graph = model.graph.as_mut().expect("graph");
        let taken = GraphIndex::new(graph).taken_names(PREFIX, &[]);
        frozen_half::cast_per_use(graph, &widened, opset, taken);
        declare_frozen(graph, &frozen);
    }
    if update.is_none() {
        // the parameters are read by the backward pass too: only the optimizer's own state
        let params: BTreeSet<&str> = updates.iter().map(|u| u.param.as_str()).collect();
        let candidates: Vec<(&str, &str)> = state
            .iter()
            .filter(|(i, _, _, _)| !params.contains(i.as_str()))
            .map(|(i, o, _, _)| (i.as_str(), o.as_str()))
            .collect();
        let graph = model.graph.as_ref().expect("graph");
        meta["in_place"] = in_place::in_place_inputs(graph, &candidates).into();
    }
    model.metadata_props.push(StringStringEntryProto {
        key: Some(STEP_METADATA_KEY.into()),
        value: Some(meta.to_string()),
    });
    crate::graph::patch::check_consistency(model).map_err(Error::Inconsistent)?;
    Ok(Built {
        parameters: params,
        parameter_elements,
        frozen,
        buffers,
        notes,
        warnings,
        update,
        zeros,
        fused_head_chunk_tokens: fused.map(|v| v.chunk_tokens),
        lora: lora_meta,
        recompute: recompute_json,
        attention: attention_json,
    })
}

/// The graph's nodes: the forward and backward (retyped by the precision pass, or as they
/// are), then what `b` emitted after them; `b`'s constants join the initializers.
fn set_nodes(graph: &mut GraphProto, mixed: Option<precision::Mixed>, b: &mut Builder) {
    if let Some(mixed) = mixed {
        mixed.retype(&mut graph.value_info);
        graph.node = mixed.nodes;
    }
    graph.node.extend(std::mem::take(&mut b.nodes));
    graph
        .initializer
        .extend(std::mem::take(&mut b.initializers));
}

/// The optimizer update, behind fp16's loss scaling where there is one.
fn emit_optimizer(
    ctx: &mut Ctx,
    req: &StepRequest,
    updates: &[ParamUpdate],
    step: (&str, &str),
    lr: &str,
    scale_state: Option<&ScaleState>,
) {
    match scale_state {
        Some(s) => loss_scale::emit_scaled_update(
            ctx,
            &req.optimizer,
            &req.loss_scale,
            updates,
            step,
            lr,
            s,
        ),
        None => emit_update(ctx, &req.optimizer, updates, step.0, step.1, lr),
    }
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
    req: &StepRequest,
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
    req: &StepRequest,
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
    req: &StepRequest,
    updates: &[ParamUpdate],
    grad_names: &[String],
    state: &[(String, String, Vec<i64>, i32)],
    step: (&str, &str),
    lr: &str,
    scale_state: Option<&ScaleState>,
    meta: &mut serde_json::Value,
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
            grad: g.clone(),
            slots: u.slots.clone(),
            next_param: u.next_param.clone(),
            next_slots: u.next_slots.clone(),
        })
        .collect();
    {
        let mut ctx = Ctx::new(&mut b, &mut ranks, &shapes, &types, opset);
        emit_optimizer(&mut ctx, req, &local, step, lr, scale_state);
    }
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
    meta["in_place"] = in_place::in_place_inputs(&graph, &pairs).into();
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
        metadata_props: vec![StringStringEntryProto {
            key: Some(STEP_METADATA_KEY.into()),
            value: Some(meta.to_string()),
        }],
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

//! `ntl-patch validate`: run a patched graph and compare its losses with an independent
//! implementation (and, optionally, recorded reference outputs).
//!
//! One pass: load → read the patch metadata → validation copy (extra outputs; primitive CE for
//! tract) → inputs (generated, or from `--reference`) → run → independent losses from the
//! runtime's own flat logits and labels → report. Modules, one job each:
//! - `meta`: the `ntl_patch` metadata; `copy` (+ `emit`, `primitive_ce`): the graph that runs;
//! - `inputs`, `testdata`, `tensor`: the values fed and read back;
//! - `tract_run`, `ort_run` (+ `ort_lib`): the runtimes;
//! - `noise`: takes NTIL's random Gumbel noise out of the copy (validation runs at noise 0);
//! - `reference` (NTL), `reference_ntil` (NTIL, EMD, number-level), `reference_del` (DIST2,
//!   DEL) and `reference_smmd` (SMMD): the independent f64 losses; `report`: the checks and
//!   their rendering.

mod copy;
mod emit;
pub mod inputs;
pub mod meta;
mod noise;
mod ort_lib;
mod ort_run;
mod primitive_ce;
pub mod reference;
pub mod reference_del;
pub mod reference_ntil;
pub mod reference_smmd;
pub mod report;
mod steps;
pub mod tensor;
pub mod testdata;
mod tract_compat;
mod tract_run;

use std::path::{Path, PathBuf};

use crate::error::Error;
use crate::graph::GraphIndex;
use crate::io::model_io::{load_model, model_dir};
use crate::jobs::patch::default_tokenizer;
use crate::onnx::ModelProto;
use crate::vocab::number_table::{NumberTable, Vocab};
use ntl_ops::names::{CE_OUTPUT, NUMBER_OUTPUT, PREFIX};

pub use ort_lib::HOW_TO_INSTALL as ORT_HOW_TO_INSTALL;
pub use report::{Against, Check, Report};

use copy::ValidationCopy;
use inputs::{ClassDim, LabelPlan, LabelStyle, Shape};
use meta::{LossSpec, PatchMeta};
use reference::{Batch, CeReduction, NtlKind};
use reference_ntil::{DigitTokens, Sequences};
use tensor::HostTensor;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    Tract,
    Ort,
}

impl Runtime {
    pub fn name(self) -> &'static str {
        match self {
            Runtime::Tract => "tract",
            Runtime::Ort => "onnxruntime",
        }
    }
}

pub struct ValidateRequest {
    pub model: PathBuf,
    pub runtime: Runtime,
    pub reference: Option<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub rtol: f64,
    pub atol: f64,
    pub batch: usize,
    pub seq: usize,
    pub seed: u64,
}

pub fn run(req: &ValidateRequest) -> Result<Report, Error> {
    if req.batch == 0 || req.seq == 0 {
        return Err(Error::Usage("--batch and --seq must be at least 1".into()));
    }
    if !(req.rtol >= 0.0 && req.atol >= 0.0 && req.rtol.is_finite() && req.atol.is_finite()) {
        return Err(Error::Usage(
            "--rtol and --atol must be finite non-negative numbers".into(),
        ));
    }
    let max = crate::io::limits::MAX_BATCH_OR_SEQ;
    if req.batch as u64 > max || req.seq as u64 > max {
        return Err(Error::Usage(format!(
            "--batch {} / --seq {} is too large (at most {max} each)",
            req.batch, req.seq
        )));
    }
    let model = load_model(&req.model)?;
    if steps::half_type(&model) == Some(crate::passes::step::precision::BFLOAT16) {
        return Err(Error::Usage(
            "a bf16 step graph (--precision bf16) runs on GPUs only: neither tract nor onnxruntime's CPU provider has bfloat16 kernels; check it with scripts/gpu/gpu-check.sh --precision, or validate the --precision fp16 or fp32 graph".into(),
        ));
    }
    crate::graph::structure::check_model(&model)?;
    // the runtimes open external data themselves: only files the checks allow
    crate::io::model_io::check_external_data(&model, &model_dir(&req.model))?;
    let meta = PatchMeta::from_model(&model)?;
    if req.reference.is_none() {
        let logits = (req.batch as u64)
            .checked_mul(req.seq as u64)
            .and_then(|n| n.checked_mul(meta.vocab_width as u64));
        if logits.is_none_or(|n| n > crate::io::limits::MAX_GENERATED_ELEMENTS) {
            return Err(Error::Usage(format!(
                "--batch {} × --seq {} × vocabulary {} logits is more than validate generates ({} values); lower --batch or --seq",
                req.batch,
                req.seq,
                meta.vocab_width,
                crate::io::limits::MAX_GENERATED_ELEMENTS
            )));
        }
    }
    let (vocab, table) = number_table(req, &meta, &model)?;
    let loss_name = total_tensor(&model, &meta)?;
    let copy = copy::build(&model, &meta, &loss_name, req.runtime == Runtime::Tract)?;
    let label_input = inputs::labels_source(
        copy.model.graph.as_ref().expect("checked on load"),
        &copy.ce_labels,
    );
    let style = match &meta.loss {
        LossSpec::Ntl(_) | LossSpec::Smmd(_) => LabelStyle::Tokens,
        LossSpec::Sequence(_) | LossSpec::Digits(_) => LabelStyle::DigitRuns {
            dot: vocab.id_of("."),
        },
    };
    let class = class_dim(&model, &meta);
    let feeds = feeds(
        req,
        &meta,
        &table,
        &copy,
        label_input.as_deref(),
        style,
        class,
    )?;

    let dir = model_dir(&req.model);
    let outputs = match req.runtime {
        Runtime::Tract => tract_run::run(&copy.model, &dir, &feeds.inputs)?,
        Runtime::Ort => ort_run::run(&copy.model, &dir, &feeds.inputs)?,
    };
    let outputs = Outputs(outputs);

    let sequences = match &meta.loss {
        LossSpec::Ntl(_) | LossSpec::Smmd(_) => None,
        LossSpec::Sequence(_) | LossSpec::Digits(_) => Some(SequenceSetup {
            batch: sequence_count(&feeds.inputs, label_input.as_deref())?,
            tokens: DigitTokens::from_vocab(&vocab).map_err(|why| {
                Error::Validation(format!(
                    "{why}; pass the model's tokenizer with --tokenizer"
                ))
            })?,
        }),
    };
    let ind = independent(&meta, &table, sequences.as_ref(), &copy, &outputs)?;
    let mut checks = Vec::new();
    let mut half_outputs = Vec::new();
    let copy_index = GraphIndex::new(copy.model.graph.as_ref().expect("built"));
    let step_half = steps::half_type(&model);
    // (report label, runtime output, independent value)
    for (name, output, expected) in [
        (loss_name.as_str(), copy.total.as_str(), ind.total),
        (CE_OUTPUT, CE_OUTPUT, ind.ce),
        (NUMBER_OUTPUT, NUMBER_OUTPUT, ind.number_loss),
    ] {
        if name == CE_OUTPUT && !meta.rescaled_by.is_empty() {
            continue; // the reported CE is the graph's own value: nothing independent to compare
        }
        let got = outputs.get(output)?.to_f64();
        let declared = copy_index.elem_type(output);
        // a mixed-precision step graph's float32 losses carry its half type's rounding
        let rtol = match half_precision_rtol(declared).or(half_precision_rtol(step_half)) {
            Some((floor, ty)) if floor > req.rtol => {
                half_outputs.push(format!("{name} ({ty})"));
                floor
            }
            _ => req.rtol,
        };
        checks.push(Check::compare(
            name,
            Against::Independent,
            &got,
            &[expected],
            rtol,
            req.atol,
        ));
    }
    checks.extend(recorded_checks(req, &model, &feeds.recorded, &outputs));
    let mut notes = Vec::new();
    if crate::passes::contract::is_step_graph(&model) {
        // Both runtimes train the tract-compatible copy (primitive-op cross-entropy).
        let tract_copy;
        let both = if req.runtime == Runtime::Tract {
            &copy.model
        } else {
            tract_copy = copy::build(&model, &meta, &loss_name, true)?;
            &tract_copy.model
        };
        let (step_checks, note) = steps::check(req, both, &dir, &feeds.inputs)?;
        checks.extend(step_checks);
        notes.push(note);
    }

    if !half_outputs.is_empty() {
        notes.push(format!(
            "{} computed in half precision by the graph: compared with a relative tolerance of 4 units in the last place of that type, the most it can hold",
            half_outputs.join(", ")
        ));
    }
    if !copy.noise_removed.is_empty() {
        notes.push(format!(
            "Gumbel noise disabled for validation: the patch draws noise (scale {}) in {} random node(s); the validation copy adds none ({} read the clean digit logits), so the forward is the deterministic argmax path (noise scale 0) that the reference computes",
            meta.gumbel_noise,
            copy.noise_removed.random_nodes.len(),
            copy.noise_removed.noisy_tensors.join(", "),
        ));
    }
    if !meta.rescaled_by.is_empty() {
        notes.push(format!(
            "the graph reports its cross-entropy through {}: ce_loss is the reported value (not recomputed), the total is checked as ce_loss + the independent number loss",
            meta.rescaled_by.join(" → ")
        ));
    }
    if let Some(s) = &sequences {
        notes.push(format!(
            "per-sequence loss: {} positions regrouped as {} sequences of {}, {} number(s)",
            ind.positions,
            s.batch,
            ind.positions / s.batch.max(1),
            ind.numbers.unwrap_or(0),
        ));
    }

    Ok(Report {
        model: req.model.clone(),
        runtime: req.runtime.name(),
        settings: format!("{}; CE reduction {}", meta.describe(), meta.reduction),
        inputs: feeds.description,
        positions: ind.positions,
        number_positions: ind.number_positions,
        ignored_positions: ind.ignored_positions,
        rtol: req.rtol,
        atol: req.atol,
        checks,
        notes,
    })
}

/// What the per-sequence references need beyond the flat tensors.
struct SequenceSetup {
    /// B: the flat `[B·T]` labels are regrouped into B sequences.
    batch: usize,
    tokens: DigitTokens,
}

/// B, the number of sequences: the first dim of the labels graph input as fed (generated or
/// recorded), the `[B, T]` tensor the graph flattens for its cross-entropy.
fn sequence_count(inputs: &[HostTensor], label_input: Option<&str>) -> Result<usize, Error> {
    let input = label_input.ok_or_else(|| {
        Error::Validation(
            "cannot find the graph input the cross-entropy's labels come from, so the sequences of the per-sequence loss are unknown; re-patch the original model".into(),
        )
    })?;
    let t = inputs.iter().find(|t| t.name == input).ok_or_else(|| {
        Error::Validation(format!("no value was fed for the labels input '{input}'"))
    })?;
    match t.shape.as_slice() {
        [b, _, ..] if *b > 0 => Ok(*b),
        shape => Err(Error::Validation(format!(
            "the labels input '{input}' has shape {shape:?}, not [B, T]; per-sequence losses need [B, T] labels"
        ))),
    }
}

/// What the runtime is fed, and what it should give (with `--reference`).
struct Feeds {
    inputs: Vec<HostTensor>,
    recorded: Vec<HostTensor>,
    description: String,
}

/// Where the patched cross-entropy's class axis is symbolic (a graph patched with
/// `--vocab-size`): its symbol, whatever its name, and the graph input axis it comes from,
/// named or not. Generated inputs get the vocabulary width there, not `--seq`, or the logits
/// would be narrower than the number table.
fn class_dim(model: &ModelProto, meta: &PatchMeta) -> ClassDim {
    let mut class = ClassDim {
        width: meta.vocab_width,
        symbol: None,
        input_axis: None,
    };
    let (Ok((_, ce)), Some(graph)) = (copy::find_ce_node(model, meta), model.graph.as_ref()) else {
        return class;
    };
    let Some(scores) = ce.input.first() else {
        return class;
    };
    let index = GraphIndex::new(graph);
    let shapes = crate::graph::shapes::Shapes::infer(&index);
    if let Some(crate::graph::shapes::Dim::Sym(name)) = shapes.get(scores).and_then(|s| s.get(1)) {
        class.symbol = Some(name.clone());
    }
    class.input_axis = inputs::input_axis(&index, scores, 1);
    class
}

fn feeds(
    req: &ValidateRequest,
    meta: &PatchMeta,
    table: &NumberTable,
    copy: &ValidationCopy,
    label_input: Option<&str>,
    style: LabelStyle,
    class: ClassDim,
) -> Result<Feeds, Error> {
    let graph = copy.model.graph.as_ref().expect("checked on load");
    let specs = inputs::feedable_inputs(graph)?;
    if let Some(dir) = &req.reference {
        let data = testdata::read_dir(dir)?;
        return Ok(Feeds {
            inputs: order_inputs(&specs, data.inputs, dir)?,
            recorded: data.outputs,
            description: format!("recorded in {}", dir.display()),
        });
    }
    let plan = label_input.map(|input| LabelPlan {
        input,
        table,
        ignore_index: meta.ignore_index,
        style,
    });
    let shape = Shape {
        batch: req.batch,
        seq: req.seq,
        class: Some(class),
    };
    Ok(Feeds {
        inputs: inputs::generate(&specs, plan.as_ref(), meta.vocab_width, &shape, req.seed)?,
        recorded: Vec::new(),
        description: format!(
            "generated (batch {}, seq {}, seed {})",
            req.batch, req.seq, req.seed
        ),
    })
}

/// The runtime's outputs, by name.
struct Outputs(Vec<HostTensor>);

impl Outputs {
    fn get(&self, name: &str) -> Result<&HostTensor, Error> {
        self.0
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| Error::Validation(format!("the runtime returned no output '{name}'")))
    }
}

/// The independent losses and label statistics.
struct Independent {
    ce: f64,
    number_loss: f64,
    total: f64,
    positions: usize,
    number_positions: usize,
    ignored_positions: usize,
    /// Per-sequence losses: the numbers (digit runs) counted.
    numbers: Option<usize>,
}

/// Computes the losses in `reference` from the very logits and labels the runtime's loss used.
fn independent(
    meta: &PatchMeta,
    table: &NumberTable,
    sequences: Option<&SequenceSetup>,
    copy: &ValidationCopy,
    outputs: &Outputs,
) -> Result<Independent, Error> {
    let logits = outputs.get(&copy.flat_logits)?.to_f64();
    let labels = outputs
        .get(&copy.flat_labels)?
        .to_i64()
        .ok_or_else(|| Error::Validation("the flat labels are not integers".into()))?;
    let batch = Batch::new(&logits, &labels, meta.vocab_width).map_err(flat_mismatch)?;
    // the number loss skips what the graph's masks drop (reported-loss forms)
    let mut number_labels = match &copy.number_labels {
        Some(n) => outputs
            .get(n)?
            .to_i64()
            .ok_or_else(|| Error::Validation("the number-loss labels are not integers".into()))?,
        None => labels.clone(),
    };
    if meta.skips_ignore_index() {
        // these losses skip the ignore index even where it is a token id
        for l in number_labels.iter_mut() {
            if Some(*l) == meta.ignore_index {
                *l = -100;
            }
        }
    }
    // DEL on log-probabilities reads the logits before the LogSoftmax
    let number_logits = match &copy.number_logits {
        Some(n) => outputs.get(n)?.to_f64(),
        None => logits.clone(),
    };
    let number_batch =
        Batch::new(&number_logits, &number_labels, meta.vocab_width).map_err(flat_mismatch)?;
    let weights = match &copy.class_weights {
        Some(w) => Some(outputs.get(w)?.to_f64()),
        None => None,
    };
    let reduction = match meta.reduction.as_str() {
        "sum" => CeReduction::Sum,
        _ => CeReduction::Mean,
    };
    let mut ce = reference::cross_entropy(
        &batch,
        meta.ignore_index,
        reduction,
        weights.as_deref(),
        meta.label_smoothing,
    )
    .map_err(flat_mismatch)?;
    if !meta.rescaled_by.is_empty() {
        // The graph rescales its cross-entropy (by inputs such as num_items_in_batch) before
        // reporting it; ce_loss is that reported value, so the total is checked against it.
        ce = outputs
            .get(CE_OUTPUT)?
            .to_f64()
            .first()
            .copied()
            .unwrap_or(f64::NAN);
    }
    // the flat rows regrouped as the per-sequence losses read them
    let regroup = |setup: &SequenceSetup| {
        Sequences::new(
            &number_logits,
            &number_labels,
            setup.batch,
            meta.vocab_width,
        )
        .map_err(flat_mismatch)
    };
    let (number_loss, number_positions, numbers) = match (&meta.loss, sequences) {
        (LossSpec::Ntl(settings), _) => {
            let ntl =
                reference::number_token_loss(&number_batch, table, settings, meta.ignore_index)
                    .map_err(flat_mismatch)?;
            (ntl.value, ntl.positions, None)
        }
        (LossSpec::Sequence(loss), Some(setup)) => {
            let seqs = regroup(setup)?;
            let v =
                reference_ntil::sequence_loss(&seqs, &setup.tokens, loss).map_err(flat_mismatch)?;
            (v.value, v.digit_positions, Some(v.numbers))
        }
        (LossSpec::Digits(loss), Some(setup)) => {
            let seqs = regroup(setup)?;
            let v = reference_del::digit_loss(&seqs, &setup.tokens, loss).map_err(flat_mismatch)?;
            (v.value, v.digit_positions, Some(v.numbers))
        }
        (LossSpec::Smmd(settings), _) => {
            let v = reference_smmd::smmd(&number_batch, table, settings).map_err(flat_mismatch)?;
            (v.value, v.positions, None)
        }
        (LossSpec::Sequence(_) | LossSpec::Digits(_), None) => {
            unreachable!("sequence setup made for sequence losses")
        }
    };
    Ok(Independent {
        ce,
        number_loss,
        total: meta.total(ce, number_loss),
        positions: labels.len(),
        number_positions,
        numbers,
        ignored_positions: labels
            .iter()
            .filter(|&&l| Some(l) == meta.ignore_index)
            .count(),
    })
}

/// One check per recorded output, matched by name (unnamed ones by the graph's output order).
fn recorded_checks(
    req: &ValidateRequest,
    model: &ModelProto,
    recorded: &[HostTensor],
    outputs: &Outputs,
) -> Vec<Check> {
    let graph = model.graph.as_ref().expect("checked on load");
    recorded
        .iter()
        .enumerate()
        .map(|(k, rec)| {
            let name = match rec.name.as_str() {
                "" => graph.output.get(k).map(|o| o.name()).unwrap_or(""),
                name => name,
            };
            match outputs.get(name) {
                Ok(t) => Check::compare(
                    name,
                    Against::Recorded,
                    &t.to_f64(),
                    &rec.to_f64(),
                    req.rtol,
                    req.atol,
                ),
                Err(_) => Check::missing(
                    name,
                    Against::Recorded,
                    "the graph has no such output".into(),
                ),
            }
        })
        .collect()
}

/// The number table, rebuilt from the tokenizer (not read from the graph), so the check does
/// not trust what the patch wrote.
fn number_table(
    req: &ValidateRequest,
    meta: &PatchMeta,
    model: &ModelProto,
) -> Result<(Vocab, NumberTable), Error> {
    let path = req
        .tokenizer
        .clone()
        .unwrap_or_else(|| default_tokenizer(&req.model));
    if !path.exists() {
        return Err(Error::TokenizerMissing(path));
    }
    let vocab = Vocab::from_file(&path)?;
    // the number set leaves out values too large for the loss, as the patch did
    let limit = match &meta.loss {
        LossSpec::Ntl(s) => {
            let kind = match s.kind {
                NtlKind::Mse => ntl_ops::options::LossKind::Mse,
                _ => ntl_ops::options::LossKind::Wasserstein,
            };
            let graph = model.graph.as_ref().expect("checked on load");
            ntl_ops::losses::ntl::value_limit(kind, meta.weight, copy::ce_loss_type(graph))
        }
        // digits 0..9 and SMMD's integers 0..max_value are always within range
        LossSpec::Sequence(_) | LossSpec::Digits(_) | LossSpec::Smmd(_) => f32::MAX as f64,
    };
    let (table, _) = vocab.number_table_within(meta.numbers, meta.vocab_width, limit)?;
    Ok((vocab, table))
}

/// The tensor holding the total: the metadata's `loss_output`, or (older patches) the first
/// tensor outside ntl-patch's `ntl/` names that is computed from both `ce_loss` and
/// `number_loss`. It need not be a graph output (a graph may add more terms after it).
fn total_tensor(model: &ModelProto, meta: &PatchMeta) -> Result<String, Error> {
    let graph = model.graph.as_ref().expect("checked on load");
    let index = GraphIndex::new(graph);
    if let Some(t) = &meta.loss_output {
        return match index.producer(t) {
            Some(_) => Ok(t.clone()),
            None => Err(Error::Validation(format!(
                "the metadata names loss output '{t}', which the graph does not compute; re-patch the original model"
            ))),
        };
    }
    let reads_both = |tensor: &str| {
        let (mut ce, mut number) = (false, false);
        let mut stack = vec![tensor.to_string()];
        let mut seen = std::collections::HashSet::new();
        while let Some(t) = stack.pop() {
            ce |= t == CE_OUTPUT;
            number |= t == NUMBER_OUTPUT;
            if let (true, Some((_, node))) = (seen.insert(t.clone()), index.producer(&t)) {
                stack.extend(node.input.iter().filter(|i| !i.is_empty()).cloned());
            }
        }
        ce && number
    };
    let ours = format!("{PREFIX}/");
    graph
        .node
        .iter()
        .flat_map(|n| n.output.iter())
        .find(|t| !t.is_empty() && !t.starts_with(&ours) && *t != NUMBER_OUTPUT && reads_both(t))
        .cloned()
        .ok_or_else(|| {
            Error::Validation(format!(
                "no tensor combines '{CE_OUTPUT}' and '{NUMBER_OUTPUT}'; re-patch the original model"
            ))
        })
}

/// Recorded inputs in the order the runtimes take them (the graph's), matched by name.
fn order_inputs(
    specs: &[inputs::InputSpec],
    recorded: Vec<HostTensor>,
    dir: &Path,
) -> Result<Vec<HostTensor>, Error> {
    let unnamed = recorded.iter().all(|t| t.name.is_empty());
    specs
        .iter()
        .enumerate()
        .map(|(k, spec)| {
            let found = if unnamed {
                recorded.get(k)
            } else {
                recorded.iter().find(|t| t.name == spec.name)
            };
            let mut t = found.cloned().ok_or_else(|| {
                Error::Validation(format!(
                    "--reference '{}' has no value for graph input '{}'",
                    dir.display(),
                    spec.name
                ))
            })?;
            t.name = spec.name.clone();
            Ok(t)
        })
        .collect()
}

fn flat_mismatch(why: String) -> Error {
    Error::Validation(format!(
        "the runtime's flat logits and labels do not fit the metadata: {why}"
    ))
}

/// The relative tolerance a half-precision output can meet against the float64 reference:
/// 4 units in its last place (the graph rounds the loss to that type).
pub(crate) fn half_precision_rtol(elem_type: Option<i32>) -> Option<(f64, &'static str)> {
    use crate::onnx::proto::tensor_proto::DataType;
    match DataType::try_from(elem_type?).ok()? {
        DataType::Float16 => Some((4.0 * 2f64.powi(-10), "float16")),
        DataType::Bfloat16 => Some((4.0 * 2f64.powi(-7), "bfloat16")),
        _ => None,
    }
}

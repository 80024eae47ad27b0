//! Which initializers a step trains: the float weights on the loss's path, less the constants
//! an exporter stores as initializers (buffers, lifted constants, single values) and what
//! `--freeze` (or LoRA, which freezes the base) leaves out.

use std::collections::{BTreeSet, HashMap};

use crate::error::Error;
use crate::onnx::{GraphProto, TensorProto, FLOAT};
use crate::passes::grad;
use ntl_ops::names::PREFIX;

use super::copies;
use super::precision::frozen_half::WidenedSet;

/// Float initializers whose names end like these are buffers torch never trains (rotary
/// frequencies, batch-norm statistics, position ids, the zero logit bias of BART and its kin):
/// kept constant.
const BUFFER_SUFFIXES: &[&str] = &[
    "inv_freq",
    "running_mean",
    "running_var",
    "num_batches_tracked",
    "position_ids",
    "masked_bias",
    "final_logits_bias",
];

/// What torch.export's graph signature says each lifted input is, as the dynamo exporter
/// records it on the value's metadata (`PARAMETER`, `BUFFER`, `CONSTANT_TENSOR`, ...).
const INPUT_KIND_KEY: &str = "pkg.torch.export.graph_signature.InputSpec.kind";

/// Which weights train: those `--freeze` leaves; with LoRA, only the adapters and the base
/// weights `--train` names.
pub struct Rule<'a> {
    /// `--freeze`'s prefixes.
    pub freeze: &'a [String],
    /// `--train`'s prefixes (LoRA only).
    pub train: &'a [String],
    /// Whether LoRA adapted the model (its base is then frozen).
    pub lora: bool,
    /// LoRA's adapter initializers (empty without LoRA).
    pub adapters: &'a BTreeSet<String>,
}

impl Rule<'_> {
    pub fn trains(&self, name: &str) -> bool {
        if self.freeze.iter().any(|f| name.starts_with(f.as_str())) {
            return false;
        }
        !self.lora
            || self.adapters.contains(name)
            || self.train.iter().any(|t| name.starts_with(t.as_str()))
    }
}

/// The parameters chosen, what stays constant, and what the user should hear about them.
#[derive(Default)]
pub struct Selection {
    /// Trained, in the order the graph declares them.
    pub params: Vec<String>,
    /// Weights on the loss's path that do not train.
    pub frozen: Vec<String>,
    /// Constants on the loss's path (buffers, exporter constants).
    pub buffers: Vec<String>,
    /// Each parameter's dims, in `params`' order.
    pub dims: Vec<Vec<i64>>,
    /// The parameters' elements, all together.
    pub elements: u64,
    /// Whether a parameter keeps its values in external data.
    pub external: bool,
    pub notes: Vec<String>,
    pub warnings: Vec<String>,
}

/// The parameters of the finished forward `graph`, whose loss is `loss`: float32 initializers
/// (and the half weights `widened` keeps) that reach the loss, are no constants, and train by
/// `rule`.
pub fn select(
    graph: &GraphProto,
    loss: &str,
    rule: &Rule,
    widened: &WidenedSet,
) -> Result<Selection, Error> {
    let float_inits: Vec<&TensorProto> = graph
        .initializer
        .iter()
        .filter(|t| t.data_type() == FLOAT || widened.is_kept(t.name()))
        .filter(|t| {
            !t.name().starts_with(&format!("{PREFIX}/")) || rule.adapters.contains(t.name())
        })
        .collect();
    let kinds = recorded_kinds(graph);
    let (buffer_like, candidates): (Vec<&TensorProto>, Vec<&TensorProto>) = float_inits
        .into_iter()
        .partition(|t| is_constant(t, &kinds));
    let candidate_names: Vec<String> = candidates.iter().map(|t| t.name().to_string()).collect();
    let reaching = grad::reaching_loss(&graph.node, loss, &candidate_names);
    let buffer_names: Vec<String> = buffer_like.iter().map(|t| t.name().to_string()).collect();
    let buffers = grad::reaching_loss(&graph.node, loss, &buffer_names);

    let notes = freeze_notes(graph, rule.freeze, &reaching)?;
    check_train(rule, &reaching)?;
    let (params, frozen): (Vec<String>, Vec<String>) =
        reaching.into_iter().partition(|p| rule.trains(p));
    if params.is_empty() {
        return Err(Error::Usage(no_parameters_message(graph, loss)));
    }
    let by_name: HashMap<&str, &TensorProto> =
        graph.initializer.iter().map(|t| (t.name(), t)).collect();
    let warnings = exporter_warnings(&params, &by_name);
    let dims: Vec<Vec<i64>> = params
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
        .zip(&dims)
        .find(|(_, d)| d.iter().any(|&x| x < 0))
    {
        return Err(Error::MalformedGraph(format!(
            "initializer '{p}' has a negative dimension"
        )));
    }
    let external = params
        .iter()
        .filter_map(|p| by_name.get(p.as_str()))
        .any(|t| {
            t.data_location() as i32
                == crate::onnx::proto::tensor_proto::DataLocation::External as i32
        });
    let elements: u64 = dims
        .iter()
        .map(|d| d.iter().map(|&x| x as u64).product::<u64>())
        .sum();
    Ok(Selection {
        params,
        frozen,
        buffers,
        dims,
        elements,
        external,
        notes,
        warnings,
    })
}

/// Each `--train` prefix must name a weight on the loss's path.
fn check_train(rule: &Rule, reaching: &[String]) -> Result<(), Error> {
    let Some(t) = rule
        .train
        .iter()
        .find(|t| !reaching.iter().any(|p| p.starts_with(t.as_str())))
    else {
        return Ok(());
    };
    Err(Error::Usage(format!(
        "--train '{t}' matches no weight on the loss's path; weights are initializer names such as '{}'",
        reaching.iter().find(|p| !rule.adapters.contains(*p)).map(String::as_str).unwrap_or("<none>")
    )))
}

/// Parameters an exporter renamed or stored twice train, but not as the framework's do.
fn exporter_warnings(params: &[String], by_name: &HashMap<&str, &TensorProto>) -> Vec<String> {
    let mut warnings = Vec::new();
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
    let trained: Vec<&TensorProto> = params
        .iter()
        .filter_map(|p| by_name.get(p.as_str()).copied())
        .collect();
    if let Some((a, b)) = copies::same_values(&trained).first() {
        warnings.push(format!(
            "parameters '{a}' and '{b}' hold the same values (a weight the exporter stored twice, e.g. folded or transposed): they train as separate tensors, so the model drifts from the framework's; re-export without constant folding (torch: optimize=False / do_constant_folding=False; tf2onnx: without its fold_constants optimizer)"
        ));
    }
    warnings
}

fn is_buffer_name(name: &str) -> bool {
    BUFFER_SUFFIXES.iter().any(|s| {
        name.strip_suffix(s)
            .is_some_and(|rest| rest.is_empty() || rest.ends_with(['.', '/', '_', ':']))
    })
}

/// What the exporter recorded each lifted initializer as (`PARAMETER`, `BUFFER`, ...), where
/// it did: non-parameters are buffers such as Gemma's `embed_scale` or GPT-J's
/// `embed_positions`, or lifted constants.
fn recorded_kinds(graph: &GraphProto) -> HashMap<&str, &str> {
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
fn is_constant(t: &TensorProto, kinds: &HashMap<&str, &str>) -> bool {
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

//! One node against a provider's kernels, the way ORT's kernel registry matches it: the op
//! version in effect, the kernels serving it, their type constraints against the node's types;
//! when none fits, the CPU provider's (or ORT inlines a function).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::tables::{Kernel, Tables};
use super::target::Target;
use crate::graph::elem_types::TypeNames;
use crate::onnx::proto::tensor_proto::DataType;
use crate::onnx::{attr_i, NodeProto};
use ntl_ops::schema::{canonical_domain, Param, Schema};

/// A node's op version (when it can be told), the type each type parameter takes, and where
/// it runs.
pub type Placed = (Option<i64>, BTreeMap<String, Option<String>>, Placement);

/// Why a node has no kernel on the target.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Missing {
    /// The provider has no kernel for the op at all.
    NoKernel,
    /// Kernels exist, but none serves this op version.
    Version { registered: Vec<String> },
    /// Kernels serve the version, but none accepts the node's type for a type parameter.
    Type {
        param: String,
        actual: String,
        accepted: Vec<String>,
    },
    /// The provider refuses the node in GetCapability (CUDA: Cast to string).
    Refused(String),
}

impl Missing {
    pub fn describe(&self, target: Target, op: &str, version: Option<i64>) -> String {
        let t = target.name();
        match self {
            Missing::NoKernel if target == Target::Migraphx => {
                format!("{op} is not in the migraphx provider's supported-op list")
            }
            Missing::NoKernel => format!("the {t} provider registers no {op} kernel"),
            Missing::Version { registered } => format!(
                "no {t} {op} kernel serves version {}; registered versions: {}",
                version.map_or("?".into(), |v| v.to_string()),
                registered.join(", ")
            ),
            Missing::Type {
                param,
                actual,
                accepted,
            } if target == Target::Migraphx => format!(
                "{param} is {actual}; the migraphx provider takes tensors of {{{}}} only",
                accepted.join(", ")
            ),
            Missing::Type {
                param,
                actual,
                accepted,
            } => format!(
                "the {t} {op} kernels take {param} in {{{}}}, not {actual}",
                accepted.join(", ")
            ),
            Missing::Refused(why) => why.clone(),
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Missing::NoKernel => "no_kernel",
            Missing::Version { .. } => "version",
            Missing::Type { .. } => "type",
            Missing::Refused(_) => "refused",
        }
    }
}

/// The outcome for one node.
#[derive(Debug, Clone)]
pub enum Placement {
    /// A kernel serves the node. `unchecked` names type parameters whose types were unknown.
    Gpu {
        kernel: Kernel,
        unchecked: Vec<String>,
    },
    /// No kernel: ORT runs the node on the CPU provider (`cpu`: the CPU provider has a kernel
    /// for it; when it has none either, the session cannot run the node at all).
    Fallback { why: Missing, cpu: bool },
    /// No kernel anywhere, but the op is a function (an ONNX function op like `CastLike`, or a
    /// model-local function): ORT replaces the node by its function body, whose ops are placed
    /// one by one (not checked here).
    Inlined,
    /// Not checked: the op version cannot be told (unknown op, domain not imported).
    Unknown(String),
    /// A `Constant`: ORT turns it into an initializer when it loads the graph; never executed.
    Folded,
}

/// The type each type parameter of `schema` takes in `node`, in ORT's order: the first present
/// input bound to the parameter, else the first present output. `None`: present but unknown.
pub(super) fn bound_types(
    node: &NodeProto,
    schema: &Schema,
    types: &TypeNames,
) -> BTreeMap<String, Option<String>> {
    let mut out: BTreeMap<String, Option<String>> = BTreeMap::new();
    let mut visit = |params: &[Param], args: &[String]| {
        for (i, p) in params.iter().enumerate() {
            if p.type_str.contains('(') || out.get(&p.type_str).is_some_and(Option::is_some) {
                continue;
            }
            // ORT checks the first actual argument of the formal parameter only
            let arg = args.get(i).filter(|a| !a.is_empty());
            if let Some(arg) = arg {
                let t = types.get(arg).map(str::to_string);
                let entry = out.entry(p.type_str.clone()).or_insert(None);
                if entry.is_none() {
                    *entry = t;
                }
            }
        }
    };
    visit(&schema.inputs, &node.input);
    visit(&schema.outputs, &node.output);
    for (param, t) in out.iter_mut() {
        if t.is_none() {
            *t = schema.fixed_type(param).map(str::to_string);
        }
    }
    out
}

/// The first kernel serving `version` whose every constraint accepts the node's types, with the
/// type parameters it could not check; else why none fits.
pub(super) fn match_kernels(
    kernels: &[Kernel],
    version: i64,
    bound: &BTreeMap<String, Option<String>>,
    have_schema: bool,
) -> Result<(Kernel, Vec<String>), Missing> {
    if kernels.is_empty() {
        return Err(Missing::NoKernel);
    }
    let serving: Vec<&Kernel> = kernels
        .iter()
        .filter(|k| k.serves_version(version))
        .collect();
    if serving.is_empty() {
        let mut registered: Vec<String> = kernels.iter().map(Kernel::range).collect();
        registered.dedup();
        return Err(Missing::Version { registered });
    }
    let mut first_mismatch: Option<(String, String)> = None;
    for k in &serving {
        let mut unchecked = Vec::new();
        let mut ok = true;
        for (param, accepted) in &k.constraints {
            let Some(accepted) = accepted else {
                unchecked.push(param.clone());
                continue;
            };
            match bound.get(param) {
                Some(Some(actual)) => {
                    if !accepted.iter().any(|a| a == actual) {
                        ok = false;
                        first_mismatch.get_or_insert((param.clone(), actual.clone()));
                        break;
                    }
                }
                Some(None) => unchecked.push(param.clone()),
                // no argument for the parameter (an absent optional input): ORT skips it; without
                // a schema the argument cannot be told
                None => {
                    if !have_schema {
                        unchecked.push(param.clone());
                    }
                }
            }
        }
        if ok {
            return Ok(((*k).clone(), unchecked));
        }
    }
    let (param, actual) = first_mismatch.expect("a serving kernel rejected the node");
    let mut accepted: Vec<String> = serving
        .iter()
        .flat_map(|k| k.constraints.iter())
        .filter(|(p, _)| *p == param)
        .flat_map(|(_, a)| a.iter().flatten().cloned())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    accepted.sort_by_key(|t| type_rank(t));
    Err(Missing::Type {
        param,
        actual,
        accepted,
    })
}

/// Matches one node against `target`'s kernels (and, when none fits, the CPU provider's).
/// `local_functions` are the model's own functions (`domain`, `name`): ORT inlines their nodes.
pub fn place_node(
    node: &NodeProto,
    target: Target,
    opsets: &HashMap<String, i64>,
    types: &TypeNames,
    tables: &Tables,
    local_functions: &HashSet<(String, String)>,
) -> Placed {
    let domain = canonical_domain(node.domain()).to_string();
    let op = node.op_type();
    let local = local_functions.contains(&(domain.clone(), op.to_string()));
    let Some(&opset) = opsets.get(&domain) else {
        return (
            None,
            BTreeMap::new(),
            Placement::Unknown(format!("the model imports no opset for domain {domain}")),
        );
    };
    let kernels = tables.kernels(target.ep(), &domain, op);
    if let Some(why) = cuda_attention_refusal(node, target, &domain, !kernels.is_empty()) {
        let why = Missing::Refused(why);
        return (
            None,
            BTreeMap::new(),
            Placement::Fallback { why, cpu: true },
        );
    }
    let Some(version) = tables.op_version(&domain, op, opset) else {
        if local && kernels.is_empty() {
            return (None, BTreeMap::new(), Placement::Inlined);
        }
        let why = if tables.knows_op(&domain, op) {
            format!("{domain} {op} does not exist at opset {opset}")
        } else if kernels.is_empty() && domain != "ai.onnx" {
            // an operator of another domain with no GPU kernel at all: no schema needed to tell
            let cpu = !tables.kernels("cpu", &domain, op).is_empty();
            return (
                None,
                BTreeMap::new(),
                Placement::Fallback {
                    why: Missing::NoKernel,
                    cpu,
                },
            );
        } else {
            format!(
                "{domain} {op} is not an operator ONNX 1.16 / ORT {} knows",
                target.ort_version()
            )
        };
        return (None, BTreeMap::new(), Placement::Unknown(why));
    };
    let schema = tables.schema(&domain, op, opset);
    let bound = schema
        .map(|s| bound_types(node, s, types))
        .unwrap_or_default();
    let refused = target.ep() == "cuda"
        && op == "Cast"
        && domain == "ai.onnx"
        && attr_i(node, "to") == Some(DataType::String as i64);
    let why = match match_kernels(kernels, version, &bound, schema.is_some()) {
        Ok(_) if refused => Missing::Refused(
            "the cuda provider refuses Cast to string (CastNeedFallbackToCPU)".into(),
        ),
        Ok((kernel, unchecked)) => {
            return (Some(version), bound, Placement::Gpu { kernel, unchecked })
        }
        Err(why) => why,
    };
    // no GPU kernel: the CPU provider takes the node, unless no provider claims it and it is a
    // function (ONNX function op or model-local function), which ORT then inlines
    // (graph_partitioner.cc InlineFunctionsAOT)
    let cpu = match_kernels(
        tables.kernels("cpu", &domain, op),
        version,
        &bound,
        schema.is_some(),
    )
    .is_ok();
    if !cpu && (local || schema.is_some_and(|s| s.function)) {
        return (Some(version), bound, Placement::Inlined);
    }
    (Some(version), bound, Placement::Fallback { why, cpu })
}

/// The ONNX `Attention` operator with an attribute onnxruntime's CUDA kernel refuses at run
/// time: `softmax_precision` or `softcap` make every one of its paths (flash, memory-efficient,
/// unfused) return NOT_IMPLEMENTED (core/providers/cuda/llm/attention.cc), so the session's run
/// fails where the node is placed on the GPU.
fn cuda_attention_refusal(
    node: &NodeProto,
    target: Target,
    domain: &str,
    has_kernel: bool,
) -> Option<String> {
    if target.ep() != "cuda" || node.op_type() != "Attention" || domain != "ai.onnx" {
        return None;
    }
    let refused: Vec<&str> = node
        .attribute
        .iter()
        .filter(|a| match a.name() {
            "softmax_precision" => a.i() != 0,
            "softcap" => a.f() != 0.0,
            _ => false,
        })
        .map(|a| a.name())
        .collect();
    (has_kernel && !refused.is_empty()).then(|| {
        format!(
            "the cuda Attention kernel returns NOT_IMPLEMENTED for {} at run time (all of its paths); drop the attribute or run the node on the CPU",
            refused.join(" and ")
        )
    })
}

/// A stable, readable order for type lists.
fn type_rank(t: &str) -> (usize, String) {
    const ORDER: [&str; 14] = [
        "float", "float16", "bfloat16", "double", "int8", "int16", "int32", "int64", "uint8",
        "uint16", "uint32", "uint64", "bool", "string",
    ];
    (
        ORDER.iter().position(|o| *o == t).unwrap_or(ORDER.len()),
        t.to_string(),
    )
}

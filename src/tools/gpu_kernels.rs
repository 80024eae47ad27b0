//! GPU readiness: does an ONNX Runtime GPU execution provider take every node of a graph, or
//! would some node fall back to the CPU? Targets ([`Target`]): `cuda` (onnxruntime-gpu 1.31.1),
//! `rocm` (onnxruntime-rocm 1.22.2), `migraphx` (onnxruntime-migraphx 1.27.1), `cuda-1.19` and
//! `rocm-1.19` (onnxruntime-training 1.19.2). [`fallback_nodes`] lists the nodes that would not
//! run on the provider.
//!
//! Committed tables, embedded at build time (`data/README.md`):
//! - `data/ort-1.19-kernels.tsv`, `data/ort-1.31.1-cuda-kernels.tsv`,
//!   `data/ort-1.22.2-rocm-kernels.tsv`: every kernel the providers (and the CPU provider) of
//!   those releases register (op, domain, version range, type constraints, CPU-memory
//!   inputs/outputs), extracted from ORT's source by `scripts/gen/gen_kernel_table.py`;
//! - `data/ort-1.27.1-migraphx-ops.tsv`: the MIGraphX provider's supported-op list (it registers
//!   no kernels; its rules are modelled in the [`migraphx`] module);
//! - `data/onnx-1.16-schemas.tsv`: the version history and type parameters of every ONNX
//!   operator up to opset 21 (ONNX 1.16.1, the ONNX that ORT 1.19.2 is built with), written by
//!   `scripts/gen/gen_onnx_schemas.py` from the onnx wheel.
//!
//! A node is matched the way ORT's kernel registry matches it (`kernel_registry.cc`):
//! 1. its op version is the latest version of the op at or below the model's opset for its
//!    domain;
//! 2. a kernel's version range fits when it STARTS at that version, or when it has an end
//!    version and spans it: an open-ended kernel registered at 13 does not serve a version-14
//!    node (ORT cannot know that version 14 did not change the op);
//! 3. for each type constraint of the kernel, the first present input (then output) that the
//!    op's schema binds to that type parameter must have one of the kernel's types.
//!
//! Besides missing kernels, the CUDA provider refuses `Cast` to string, and both providers hand
//! cheap shape arithmetic to the CPU on purpose (`GetCpuPreferredNodes`,
//! `fallback_cpu_capability.cc`): nodes whose every input comes from CPU memory (a `Shape`
//! output, a graph input, an initializer of at most 100 elements). That placement is simulated
//! and reported apart: it is not a missing kernel. ORT runs it after its own graph optimizations,
//! so on a real session the set can differ (constant folding removes shape arithmetic on static
//! shapes).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::OnceLock;

use crate::onnx::proto::tensor_proto::DataType;
use crate::onnx::proto::type_proto;
use crate::onnx::{attr, attr_i, GraphProto, ModelProto, NodeProto, TypeProto};
pub use ntl_ops::schema::{canonical_domain, Param, Schema, SCHEMA_TABLE};
use ntl_ops::schema::{tsv_rows, Schemas};

/// The ONNX Runtime Training 1.19.2 kernel table (CUDA, ROCm and CPU registrations).
pub const KERNEL_TABLE: &str = include_str!("../../data/ort-1.19-kernels.tsv");
/// onnxruntime-gpu 1.31.1: CUDA and CPU registrations.
pub const CUDA_KERNEL_TABLE: &str = include_str!("../../data/ort-1.31.1-cuda-kernels.tsv");
/// onnxruntime-rocm 1.22.2: ROCm and CPU registrations.
pub const ROCM_KERNEL_TABLE: &str = include_str!("../../data/ort-1.22.2-rocm-kernels.tsv");
/// onnxruntime-migraphx 1.27.1: the MIGraphX provider's supported-op list.
pub const MIGRAPHX_OP_TABLE: &str = include_str!("../../data/ort-1.27.1-migraphx-ops.tsv");
/// The ONNX Runtime release of the 1.19 kernel table (`cuda-1.19`, `rocm-1.19`).
pub const ORT_VERSION: &str = "1.19.2";
/// The highest default-domain opset ONNX Runtime 1.19 knows, and the newest the schema table
/// (ONNX 1.16) describes.
pub const MAX_ONNX_OPSET: i64 = 21;
/// Initializers up to this many elements count as CPU-resident for GetCpuPreferredNodes.
const SMALL_INITIALIZER: i64 = 100;

/// A GPU execution provider of one ONNX Runtime release, with its kernel (or op) table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    /// CUDAExecutionProvider of onnxruntime-gpu 1.31.1.
    Cuda,
    /// ROCMExecutionProvider of onnxruntime-rocm 1.22.2 (ORT removed the ROCm provider in 1.23).
    Rocm,
    /// MIGraphXExecutionProvider of onnxruntime-migraphx 1.27.1.
    Migraphx,
    /// CUDAExecutionProvider of onnxruntime-training 1.19.2.
    Cuda119,
    /// ROCMExecutionProvider of onnxruntime-training 1.19.2.
    Rocm119,
}

impl Target {
    /// Every target, in `--target` order.
    pub const ALL: [Target; 5] = [
        Target::Cuda,
        Target::Rocm,
        Target::Migraphx,
        Target::Cuda119,
        Target::Rocm119,
    ];

    /// The `--target` value.
    pub fn name(self) -> &'static str {
        match self {
            Target::Cuda => "cuda",
            Target::Rocm => "rocm",
            Target::Migraphx => "migraphx",
            Target::Cuda119 => "cuda-1.19",
            Target::Rocm119 => "rocm-1.19",
        }
    }

    /// The provider's name in ONNX Runtime's API.
    pub fn provider(self) -> &'static str {
        match self {
            Target::Cuda | Target::Cuda119 => "CUDAExecutionProvider",
            Target::Rocm | Target::Rocm119 => "ROCMExecutionProvider",
            Target::Migraphx => "MIGraphXExecutionProvider",
        }
    }

    /// The provider's column value in the kernel tables (`cuda`, `rocm`; `migraphx` has no
    /// kernels).
    pub fn ep(self) -> &'static str {
        match self {
            Target::Cuda | Target::Cuda119 => "cuda",
            Target::Rocm | Target::Rocm119 => "rocm",
            Target::Migraphx => "migraphx",
        }
    }

    /// The Python package whose provider the table describes.
    pub fn package(self) -> &'static str {
        match self {
            Target::Cuda => "onnxruntime-gpu",
            Target::Rocm => "onnxruntime-rocm",
            Target::Migraphx => "onnxruntime-migraphx",
            Target::Cuda119 | Target::Rocm119 => "onnxruntime-training",
        }
    }

    /// The ONNX Runtime release.
    pub fn ort_version(self) -> &'static str {
        match self {
            Target::Cuda => "1.31.1",
            Target::Rocm => "1.22.2",
            Target::Migraphx => "1.27.1",
            Target::Cuda119 | Target::Rocm119 => ORT_VERSION,
        }
    }

    /// The committed table the target is checked against.
    pub fn table_file(self) -> &'static str {
        match self {
            Target::Cuda => "data/ort-1.31.1-cuda-kernels.tsv",
            Target::Rocm => "data/ort-1.22.2-rocm-kernels.tsv",
            Target::Migraphx => "data/ort-1.27.1-migraphx-ops.tsv",
            Target::Cuda119 | Target::Rocm119 => "data/ort-1.19-kernels.tsv",
        }
    }

    pub fn parse(s: &str) -> Option<Target> {
        let s = s.to_ascii_lowercase();
        Target::ALL.into_iter().find(|t| t.name() == s)
    }
}

// ------------------------------------------------------------------------------------------
// tables

/// One registered kernel.
#[derive(Debug, Clone)]
pub struct Kernel {
    pub since: i64,
    /// Last version, `None` for an open-ended kernel.
    pub end: Option<i64>,
    /// The type in the kernel's class name (`float`, `int64_t_float_int64_t`), if any.
    pub class_type: Option<String>,
    /// Type parameter -> accepted ONNX types; `None` for a parameter whose types the generator
    /// could not resolve (not checked). Empty when the kernel declares no constraint.
    pub constraints: Vec<(String, Option<Vec<String>>)>,
    /// Inputs and outputs the kernel keeps in CPU memory.
    pub cpu_inputs: Vec<usize>,
    pub cpu_outputs: Vec<usize>,
    /// Preprocessor condition of the registration, if any.
    pub condition: Option<String>,
    /// The ORT source file that defines the kernel.
    pub source: String,
}

impl Kernel {
    /// ORT's `VerifyVersion`: exact start, or a closed range that spans the version.
    pub fn serves_version(&self, version: i64) -> bool {
        self.since == version
            || matches!(self.end, Some(end) if self.since <= version && version <= end)
    }

    /// `13` (open-ended kernels serve their start version only), `13-18`.
    pub fn range(&self) -> String {
        match self.end {
            Some(e) if e != self.since => format!("{}-{}", self.since, e),
            _ => format!("{}", self.since),
        }
    }
}

/// The embedded tables, parsed once.
pub struct Tables {
    /// (provider, domain, op) -> kernels
    kernels: HashMap<(String, String, String), Vec<Kernel>>,
    /// The ONNX operator schemas the kernels are matched against.
    schemas: Schemas,
    /// The header comment of the kernel table (version and commit).
    pub kernel_provenance: String,
}

fn parse_indices(s: &str, key: &str) -> Vec<usize> {
    s.split(';')
        .filter_map(|part| part.strip_prefix(key))
        .flat_map(|list| list.split(',').filter_map(|i| i.parse().ok()))
        .collect()
}

impl Tables {
    pub fn parse(kernel_tsv: &str, schema_tsv: &str) -> Result<Tables, String> {
        let mut kernels: HashMap<(String, String, String), Vec<Kernel>> = HashMap::new();
        let provenance: Vec<String> = kernel_tsv
            .lines()
            .filter_map(|l| l.strip_prefix('#'))
            .map(|c| c.trim().to_string())
            .collect();
        for row in tsv_rows(kernel_tsv, "provider\t", 10, "kernel") {
            let (no, f) = row?;
            if !matches!(f[0], "cuda" | "rocm" | "cpu") {
                return Err(format!("kernel table line {}: provider '{}'", no + 1, f[0]));
            }
            let num = |s: &str| {
                s.parse::<i64>()
                    .map_err(|_| format!("kernel table line {}: version '{s}'", no + 1))
            };
            let constraints = if f[6] == "-" || f[6] == "?" {
                Vec::new()
            } else {
                f[6].split(';')
                    .map(|c| {
                        let (name, types) = c.split_once('=').unwrap_or((c, "?"));
                        let types =
                            (types != "?").then(|| types.split(',').map(str::to_string).collect());
                        (name.to_string(), types)
                    })
                    .collect()
            };
            let kernel = Kernel {
                since: num(f[3])?,
                end: if f[4] == "-" { None } else { Some(num(f[4])?) },
                class_type: (f[5] != "-").then(|| f[5].to_string()),
                constraints: if f[6] == "?" {
                    vec![("?".to_string(), None)]
                } else {
                    constraints
                },
                cpu_inputs: parse_indices(f[7], "in:"),
                cpu_outputs: parse_indices(f[7], "out:"),
                condition: (f[8] != "-").then(|| f[8].to_string()),
                source: f[9].to_string(),
            };
            kernels
                .entry((f[0].to_string(), f[1].to_string(), f[2].to_string()))
                .or_default()
                .push(kernel);
        }
        let schemas = Schemas::parse(schema_tsv)?;
        Ok(Tables {
            kernels,
            schemas,
            kernel_provenance: provenance.join(" "),
        })
    }

    /// The kernels a provider (`cuda`, `rocm`, `cpu`) registers for an op (any version).
    pub fn kernels(&self, provider: &str, domain: &str, op: &str) -> &[Kernel] {
        self.kernels
            .get(&(
                provider.to_string(),
                canonical_domain(domain).to_string(),
                op.to_string(),
            ))
            .map_or(&[], Vec::as_slice)
    }

    /// The schema in effect for `op` at `opset` of its domain: the latest version <= opset.
    pub fn schema(&self, domain: &str, op: &str, opset: i64) -> Option<&Schema> {
        self.schemas.schema(domain, op, opset)
    }

    /// Whether the schema table knows the op at all (any version).
    pub fn knows_op(&self, domain: &str, op: &str) -> bool {
        self.schemas.knows_op(domain, op)
    }

    /// The version of `op` in effect at `opset`: from the ONNX schemas for ONNX domains; ORT's
    /// own operators (`com.microsoft`: contrib and training ops) all have version 1 in 1.19.
    pub fn op_version(&self, domain: &str, op: &str, opset: i64) -> Option<i64> {
        if let Some(s) = self.schema(domain, op, opset) {
            return Some(s.since);
        }
        (canonical_domain(domain) == "com.microsoft" && opset >= 1).then_some(1)
    }
}

/// The embedded ONNX Runtime 1.19.2 tables (parsed on first use).
pub fn tables() -> &'static Tables {
    tables_for(Target::Cuda119)
}

/// The embedded tables a target is checked against (parsed on first use). `migraphx` has no
/// kernel table: it gets the onnxruntime-gpu 1.31.1 table, whose CPU rows stand for the CPU
/// provider a node the MIGraphX provider does not take falls back to.
pub fn tables_for(target: Target) -> &'static Tables {
    static ORT119: OnceLock<Tables> = OnceLock::new();
    static CUDA: OnceLock<Tables> = OnceLock::new();
    static ROCM: OnceLock<Tables> = OnceLock::new();
    let (cell, text) = match target {
        Target::Cuda119 | Target::Rocm119 => (&ORT119, KERNEL_TABLE),
        Target::Cuda | Target::Migraphx => (&CUDA, CUDA_KERNEL_TABLE),
        Target::Rocm => (&ROCM, ROCM_KERNEL_TABLE),
    };
    cell.get_or_init(|| Tables::parse(text, SCHEMA_TABLE).expect("embedded kernel tables parse"))
}

// ------------------------------------------------------------------------------------------
// types

/// The ONNX name of a tensor element type (`float`, `int64`, ...).
pub fn elem_type_name(dt: i32) -> Option<&'static str> {
    let t = DataType::try_from(dt).ok()?;
    Some(match t {
        DataType::Float => "float",
        DataType::Uint8 => "uint8",
        DataType::Int8 => "int8",
        DataType::Uint16 => "uint16",
        DataType::Int16 => "int16",
        DataType::Int32 => "int32",
        DataType::Int64 => "int64",
        DataType::String => "string",
        DataType::Bool => "bool",
        DataType::Float16 => "float16",
        DataType::Double => "double",
        DataType::Uint32 => "uint32",
        DataType::Uint64 => "uint64",
        DataType::Complex64 => "complex64",
        DataType::Complex128 => "complex128",
        DataType::Bfloat16 => "bfloat16",
        DataType::Float8e4m3fn => "float8e4m3fn",
        DataType::Float8e4m3fnuz => "float8e4m3fnuz",
        DataType::Float8e5m2 => "float8e5m2",
        DataType::Float8e5m2fnuz => "float8e5m2fnuz",
        DataType::Uint4 => "uint4",
        DataType::Int4 => "int4",
        _ => return None,
    })
}

/// `float`, `seq(float)`, `opt(float)` for a declared value type.
fn type_proto_name(t: &TypeProto) -> Option<String> {
    match t.value.as_ref()? {
        type_proto::Value::TensorType(t) => elem_type_name(t.elem_type()).map(str::to_string),
        type_proto::Value::SequenceType(s) => Some(format!(
            "seq({})",
            type_proto_name(s.elem_type.as_deref()?)?
        )),
        type_proto::Value::OptionalType(o) => Some(format!(
            "opt({})",
            type_proto_name(o.elem_type.as_deref()?)?
        )),
        _ => None,
    }
}

/// Element types of the graph's tensors: declared ones (inputs, outputs, value_info,
/// initializers) and, forward through the nodes, the ones the op schemas imply (an output typed
/// `T` has the type of the first input typed `T`; `Cast` and friends read their attributes).
pub fn infer_types(
    graph: &GraphProto,
    opsets: &HashMap<String, i64>,
    tables: &Tables,
) -> HashMap<String, String> {
    infer_types_from(graph, opsets, tables, HashMap::new())
}

/// As [`infer_types`], starting from `types` (a subgraph sees its enclosing graph's tensors).
fn infer_types_from(
    graph: &GraphProto,
    opsets: &HashMap<String, i64>,
    tables: &Tables,
    mut types: HashMap<String, String>,
) -> HashMap<String, String> {
    for vi in graph
        .input
        .iter()
        .chain(&graph.output)
        .chain(&graph.value_info)
    {
        if let Some(t) = vi.r#type.as_ref().and_then(type_proto_name) {
            types.insert(vi.name().to_string(), t);
        }
    }
    for init in &graph.initializer {
        if let Some(t) = elem_type_name(init.data_type()) {
            types.insert(init.name().to_string(), t.to_string());
        }
    }
    // nodes are topologically sorted in a valid model; a few passes cover any that are not
    for _ in 0..4 {
        let mut changed = false;
        for node in &graph.node {
            let opset = opsets
                .get(canonical_domain(node.domain()))
                .copied()
                .unwrap_or(0);
            for (k, out) in node.output.iter().enumerate() {
                if out.is_empty() || types.contains_key(out) {
                    continue;
                }
                if let Some(t) = output_type(node, k, opset, &types, tables) {
                    types.insert(out.clone(), t);
                    changed = true;
                }
            }
        }
        if !changed {
            break;
        }
    }
    types
}

fn dtype_attr(node: &NodeProto, name: &str) -> Option<String> {
    attr_i(node, name)
        .and_then(|d| elem_type_name(d as i32))
        .map(str::to_string)
}

fn output_type(
    node: &NodeProto,
    k: usize,
    opset: i64,
    types: &HashMap<String, String>,
    tables: &Tables,
) -> Option<String> {
    let input_type = |i: usize| {
        node.input
            .get(i)
            .filter(|s| !s.is_empty())
            .and_then(|n| types.get(n))
            .cloned()
    };
    let domain = canonical_domain(node.domain());
    if domain == "ai.onnx" {
        match node.op_type() {
            "Cast" => return dtype_attr(node, "to"),
            "CastLike" => return input_type(1),
            "RandomUniformLike" | "RandomNormalLike" | "EyeLike" => {
                return dtype_attr(node, "dtype").or_else(|| input_type(0));
            }
            "RandomUniform" | "RandomNormal" => {
                return dtype_attr(node, "dtype").or(Some("float".into()))
            }
            "Multinomial" => return dtype_attr(node, "dtype").or(Some("int32".into())),
            "Constant" => {
                if let Some(t) = attr(node, "value").and_then(|a| a.t.as_ref()) {
                    return elem_type_name(t.data_type()).map(str::to_string);
                }
                for (name, t) in [
                    ("value_float", "float"),
                    ("value_floats", "float"),
                    ("value_int", "int64"),
                    ("value_ints", "int64"),
                    ("value_string", "string"),
                    ("value_strings", "string"),
                ] {
                    if attr(node, name).is_some() {
                        return Some(t.into());
                    }
                }
                return None;
            }
            "ConstantOfShape" => {
                return Some(
                    attr(node, "value")
                        .and_then(|a| a.t.as_ref())
                        .and_then(|t| elem_type_name(t.data_type()))
                        .unwrap_or("float")
                        .to_string(),
                );
            }
            _ => {}
        }
    }
    let schema = tables.schema(node.domain(), node.op_type(), opset)?;
    let param = schema
        .outputs
        .get(k)
        .or_else(|| schema.outputs.last().filter(|p| p.variadic))?;
    if let Some(inner) = param
        .type_str
        .strip_prefix("tensor(")
        .and_then(|s| s.strip_suffix(')'))
    {
        return Some(inner.to_string());
    }
    if let Some(t) = schema.fixed_type(&param.type_str) {
        return Some(t.to_string());
    }
    // the first present input bound to the same type parameter
    for (i, p) in schema.inputs.iter().enumerate() {
        if p.type_str != param.type_str {
            continue;
        }
        let n = if p.variadic {
            node.input.len().saturating_sub(i)
        } else {
            1
        };
        for j in i..i + n {
            if let Some(t) = input_type(j) {
                return Some(t);
            }
        }
    }
    None
}

// ------------------------------------------------------------------------------------------
// matching one node

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
fn bound_types(
    node: &NodeProto,
    schema: &Schema,
    types: &HashMap<String, String>,
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
                let t = types.get(arg).cloned();
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
fn match_kernels(
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
    types: &HashMap<String, String>,
    tables: &Tables,
    local_functions: &HashSet<(String, String)>,
) -> (Option<i64>, BTreeMap<String, Option<String>>, Placement) {
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

// ------------------------------------------------------------------------------------------
// the whole graph

/// What happens to one group of nodes: same op, version, types and outcome.
#[derive(Debug, Clone)]
pub struct OpGroup {
    pub domain: String,
    pub op: String,
    pub version: Option<i64>,
    /// Type parameter -> type (`?` when unknown).
    pub types: BTreeMap<String, String>,
    pub placement: Placement,
    pub nodes: Vec<String>,
    /// How many of `nodes` ntl-patch added.
    pub ntl_nodes: usize,
}

impl OpGroup {
    fn signature(&self) -> String {
        let version = self.version.map_or("?".into(), |v| v.to_string());
        let types: Vec<String> = self.types.iter().map(|(p, t)| format!("{p}={t}")).collect();
        if types.is_empty() {
            format!("{} v{version}", self.op_label())
        } else {
            format!("{} v{version} [{}]", self.op_label(), types.join(", "))
        }
    }

    fn op_label(&self) -> String {
        let label = if self.domain == "ai.onnx" {
            self.op.clone()
        } else {
            format!("{}:{}", self.domain, self.op)
        };
        // op types and domains come from the model: one line, no terminal controls
        crate::text::escape(&label).into_owned()
    }
}

/// The readiness of one model for one GPU provider.
#[derive(Debug, Clone)]
pub struct GpuReport {
    pub target: Target,
    pub opsets: BTreeMap<String, i64>,
    pub nodes: usize,
    pub ntl_nodes: usize,
    pub groups: Vec<OpGroup>,
    /// Nodes with a kernel that ORT's GetCpuPreferredNodes would likely still put on the CPU.
    pub cpu_preferred: Vec<String>,
    /// Nodes inside subgraphs (If/Loop/Scan bodies), not checked.
    pub nested_nodes: usize,
    pub notes: Vec<String>,
}

impl GpuReport {
    pub fn fallbacks(&self) -> impl Iterator<Item = &OpGroup> {
        self.groups
            .iter()
            .filter(|g| matches!(g.placement, Placement::Fallback { .. }))
    }

    pub fn unknown(&self) -> impl Iterator<Item = &OpGroup> {
        self.groups
            .iter()
            .filter(|g| matches!(g.placement, Placement::Unknown(_)))
    }

    /// Every checked node has a kernel on the target.
    pub fn all_on_gpu(&self) -> bool {
        self.fallbacks().next().is_none() && self.unknown().next().is_none()
    }

    pub fn verdict(&self) -> String {
        let t = self.target.name();
        let fallbacks: usize = self.fallbacks().map(|g| g.nodes.len()).sum();
        let unknown: usize = self.unknown().map(|g| g.nodes.len()).sum();
        let mgx = self.target == Target::Migraphx;
        if self.all_on_gpu() && mgx {
            "the migraphx provider takes every node".to_string()
        } else if self.all_on_gpu() {
            format!("all ops have {t} kernels")
        } else if fallbacks > 0 {
            let ops: BTreeSet<String> = self.fallbacks().map(OpGroup::op_label).collect();
            format!(
                "{fallbacks} node(s) would fall back to CPU: {} {}",
                if mgx {
                    "the migraphx provider does not take".to_string()
                } else {
                    format!("no {t} kernel for")
                },
                ops.into_iter().collect::<Vec<_>>().join(", ")
            )
        } else {
            format!("{unknown} node(s) could not be checked (see below); every other op has a {t} kernel")
        }
    }

    pub fn to_text(&self) -> String {
        let t = self.target.name();
        let what = if self.target == Target::Migraphx {
            "supported-op list and op checks"
        } else {
            "kernels"
        };
        let mut out = format!(
            "{t}: {}\n  checked against the {} {what} of {} {} ({}); {} node(s), {} added by ntl-patch\n",
            self.verdict(),
            self.target.provider(),
            self.target.package(),
            self.target.ort_version(),
            self.target.table_file(),
            self.nodes,
            self.ntl_nodes
        );
        let fallbacks: Vec<&OpGroup> = self.fallbacks().collect();
        if !fallbacks.is_empty() {
            out.push_str("  CPU fallbacks:\n");
            for g in &fallbacks {
                let Placement::Fallback { why, cpu } = &g.placement else {
                    unreachable!()
                };
                out.push_str(&format!(
                    "    {}: {}{}; {} node(s), {} added by ntl-patch: {}\n",
                    g.signature(),
                    why.describe(self.target, &g.op, g.version),
                    if *cpu {
                        ""
                    } else {
                        " (and the CPU provider has none either: ORT cannot run it)"
                    },
                    g.nodes.len(),
                    g.ntl_nodes,
                    node_list(&g.nodes)
                ));
            }
        }
        let unknown: Vec<&OpGroup> = self.unknown().collect();
        if !unknown.is_empty() {
            out.push_str("  not checked:\n");
            for g in &unknown {
                let Placement::Unknown(why) = &g.placement else {
                    unreachable!()
                };
                out.push_str(&format!(
                    "    {}: {why}; {} node(s): {}\n",
                    g.op_label(),
                    g.nodes.len(),
                    node_list(&g.nodes)
                ));
            }
        }
        let on_gpu: Vec<&OpGroup> = self
            .groups
            .iter()
            .filter(|g| matches!(g.placement, Placement::Gpu { .. }))
            .collect();
        if !on_gpu.is_empty() {
            if self.target == Target::Migraphx {
                out.push_str("  taken by migraphx (compiled by MIGraphX, any op version):\n");
            } else {
                out.push_str(&format!("  {t} kernels:\n"));
            }
            for g in on_gpu {
                let Placement::Gpu { kernel, unchecked } = &g.placement else {
                    unreachable!()
                };
                let mut extra = String::new();
                if !unchecked.is_empty() {
                    let params: Vec<&str> = unchecked
                        .iter()
                        .map(|p| {
                            if p == "?" {
                                "all parameters (unresolved in the table)"
                            } else {
                                p.as_str()
                            }
                        })
                        .collect();
                    extra.push_str(&format!("; types of {} not checked", params.join(", ")));
                }
                if let Some(c) = &kernel.condition {
                    extra.push_str(&format!("; registered only if {c}"));
                }
                let kernel = if self.target == Target::Migraphx {
                    "taken".to_string()
                } else {
                    format!("kernel {}", kernel.range())
                };
                out.push_str(&format!(
                    "    {}: {kernel}{extra}; {} node(s) ({} ntl-patch)\n",
                    g.signature(),
                    g.nodes.len(),
                    g.ntl_nodes
                ));
            }
        }
        let inlined: Vec<&OpGroup> = self
            .groups
            .iter()
            .filter(|g| matches!(g.placement, Placement::Inlined))
            .collect();
        for g in inlined {
            out.push_str(&format!(
                "  inlined by ORT (a function with no kernel on any provider; its body ops are placed instead): {}; {} node(s): {}\n",
                g.signature(),
                g.nodes.len(),
                node_list(&g.nodes)
            ));
        }
        if !self.cpu_preferred.is_empty() {
            out.push_str(&format!(
                "  likely on CPU by ORT's choice (GetCpuPreferredNodes: shape arithmetic fed from CPU memory; has a {t} kernel, not a fallback): {}\n",
                node_list(&self.cpu_preferred)
            ));
        }
        for n in &self.notes {
            out.push_str(&format!("  note: {n}\n"));
        }
        out
    }

    pub fn to_json(&self) -> serde_json::Value {
        let group = |g: &OpGroup| {
            let mut v = serde_json::json!({
                "domain": g.domain,
                "op": g.op,
                "version": g.version,
                "types": g.types,
                "nodes": g.nodes,
                "ntl_nodes": g.ntl_nodes,
            });
            match &g.placement {
                Placement::Gpu { kernel, unchecked } => {
                    v["kernel"] = serde_json::json!({
                        "since": kernel.since,
                        "end": kernel.end,
                        "class_type": kernel.class_type,
                        "condition": kernel.condition,
                        "source": kernel.source,
                    });
                    v["types_not_checked"] = serde_json::json!(unchecked);
                }
                Placement::Fallback { why, cpu } => {
                    v["cpu_kernel"] = (*cpu).into();
                    v["reason"] = why.kind().into();
                    v["detail"] = why.describe(self.target, &g.op, g.version).into();
                    if let Missing::Type {
                        param,
                        actual,
                        accepted,
                    } = why
                    {
                        v["param"] = param.clone().into();
                        v["actual"] = actual.clone().into();
                        v["accepted"] = serde_json::json!(accepted);
                    }
                    if let Missing::Version { registered } = why {
                        v["registered_versions"] = serde_json::json!(registered);
                    }
                }
                Placement::Unknown(why) => v["reason"] = why.clone().into(),
                Placement::Inlined => v["inlined"] = true.into(),
                Placement::Folded => {}
            }
            v
        };
        serde_json::json!({
            "target": self.target.name(),
            "provider": self.target.provider(),
            "onnxruntime": self.target.ort_version(),
            "package": self.target.package(),
            "table": self.target.table_file(),
            "all_ops_on_gpu": self.all_on_gpu(),
            "summary": self.verdict(),
            "nodes": self.nodes,
            "ntl_nodes": self.ntl_nodes,
            "opsets": self.opsets,
            "fallbacks": self.fallbacks().map(group).collect::<Vec<_>>(),
            "not_checked": self.unknown().map(group).collect::<Vec<_>>(),
            "gpu": self.groups.iter().filter(|g| matches!(g.placement, Placement::Gpu { .. })).map(group).collect::<Vec<_>>(),
            "inlined": self.groups.iter().filter(|g| matches!(g.placement, Placement::Inlined)).map(group).collect::<Vec<_>>(),
            "cpu_preferred": self.cpu_preferred,
            "nested_nodes_not_checked": self.nested_nodes,
            "notes": self.notes,
        })
    }
}

fn node_list(nodes: &[String]) -> String {
    const SHOWN: usize = 6;
    let mut s = nodes
        .iter()
        .take(SHOWN)
        .map(|n| crate::text::escape(n).into_owned())
        .collect::<Vec<_>>()
        .join(", ");
    if nodes.len() > SHOWN {
        s.push_str(&format!(", ... ({} more)", nodes.len() - SHOWN));
    }
    s
}

/// A node ntl-patch added: named under `ntl/`, or the cross-entropy it rewrote (output `ce_loss`).
pub fn is_ntl_node(node: &NodeProto) -> bool {
    node.name().starts_with("ntl/")
        || (node.op_type() == "SoftmaxCrossEntropyLoss"
            && node.output.first().is_some_and(|o| o == "ce_loss"))
}

fn node_label(node: &NodeProto, i: usize) -> String {
    if node.name().is_empty() {
        format!("#{i} ({})", node.output.first().map_or("", |s| s.as_str()))
    } else {
        node.name().to_string()
    }
}

/// Opset per canonical domain.
pub fn model_opsets(model: &ModelProto) -> HashMap<String, i64> {
    model
        .opset_import
        .iter()
        .map(|o| (canonical_domain(o.domain()).to_string(), o.version()))
        .collect()
}

/// Checks every top-level node of `model` against `target`'s kernels.
pub fn check_model(model: &ModelProto, target: Target) -> GpuReport {
    check_model_with(model, target, tables_for(target))
}

/// One node that would not run on `target`'s provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FallbackNode {
    /// Index in the top-level graph's `node` list.
    pub index: usize,
    /// The node's name (or `#index (first output)` when it has none).
    pub name: String,
    pub domain: String,
    pub op: String,
    /// The op version in effect at the model's opset, when known.
    pub version: Option<i64>,
    /// Why: a missing kernel, a refused node, a node the provider does not take, or `not
    /// checked: ...` when the op version cannot be told.
    pub reason: String,
    /// The CPU provider has a kernel for it (`false`: ORT cannot run the node at all).
    pub cpu_kernel: bool,
}

/// The top-level nodes of `model` that would not run on `target`'s provider (CPU fallbacks and
/// nodes that could not be checked), in graph order. Empty: every checked node runs on the
/// provider. Nodes ORT moves to the CPU by its own choice (GetCpuPreferredNodes) are not
/// included: they have kernels.
pub fn fallback_nodes(model: &ModelProto, target: Target) -> Vec<FallbackNode> {
    let tables = tables_for(target);
    let empty = GraphProto::default();
    let graph = model.graph.as_ref().unwrap_or(&empty);
    let placed = place_all(model, target, tables);
    let nested = match target {
        Target::Migraphx => Vec::new(),
        _ => {
            let types = infer_types(graph, &model_opsets(model), tables);
            place_nested(model, target, tables, &types)
        }
    };
    let fallback = |i: usize, node: &NodeProto, version: Option<i64>, p: &Placement| {
        let (reason, cpu_kernel) = match p {
            Placement::Fallback { why, cpu } => {
                (why.describe(target, node.op_type(), version), *cpu)
            }
            Placement::Unknown(why) => (format!("not checked: {why}"), true),
            _ => return None,
        };
        Some(FallbackNode {
            index: i,
            name: node_label(node, i),
            domain: canonical_domain(node.domain()).to_string(),
            op: node.op_type().to_string(),
            version,
            reason,
            cpu_kernel,
        })
    };
    let mut out: Vec<FallbackNode> = graph
        .node
        .iter()
        .zip(&placed)
        .enumerate()
        .filter_map(|(i, (node, (version, _, p)))| fallback(i, node, *version, p))
        .collect();
    out.extend(
        nested
            .iter()
            .filter_map(|n| fallback(n.parent, n.node, n.placed.0, &n.placed.2)),
    );
    out
}

type Placed = (Option<i64>, BTreeMap<String, Option<String>>, Placement);

/// The placement of every top-level node, in graph order (`Constant`s: `Folded`).
fn place_all(model: &ModelProto, target: Target, tables: &Tables) -> Vec<Placed> {
    let empty = GraphProto::default();
    let graph = model.graph.as_ref().unwrap_or(&empty);
    let opsets = model_opsets(model);
    let types = infer_types(graph, &opsets, tables);
    let local_functions: HashSet<(String, String)> = model
        .functions
        .iter()
        .map(|f| {
            (
                canonical_domain(f.domain()).to_string(),
                f.name().to_string(),
            )
        })
        .collect();
    if target == Target::Migraphx {
        return migraphx::place_graph(graph, &opsets, &types, tables, migraphx::ops());
    }
    graph
        .node
        .iter()
        .map(|node| {
            if is_constant(node) {
                (None, BTreeMap::new(), Placement::Folded)
            } else {
                place_node(node, target, &opsets, &types, tables, &local_functions)
            }
        })
        .collect()
}

/// A node inside a subgraph (a `Scan`, `Loop` or `If` body), placed as ONNX Runtime places it:
/// with the provider that runs its enclosing node (the CUDA and ROCm providers run control-flow
/// bodies themselves; only the loop bookkeeping stays on the CPU).
struct NestedPlaced<'m> {
    /// Index of the top-level node whose body holds it.
    parent: usize,
    node: &'m NodeProto,
    placed: Placed,
}

/// Every node inside the top-level nodes' subgraphs (recursively), placed with the types of
/// the enclosing graphs and its own.
fn place_nested<'m>(
    model: &'m ModelProto,
    target: Target,
    tables: &Tables,
    types: &HashMap<String, String>,
) -> Vec<NestedPlaced<'m>> {
    let Some(graph) = model.graph.as_ref() else {
        return Vec::new();
    };
    let opsets = model_opsets(model);
    let ctx = Walk {
        opsets: &opsets,
        target,
        tables,
        functions: &HashSet::new(),
    };
    let mut out = Vec::new();
    for (i, node) in graph.node.iter().enumerate() {
        for body in node
            .attribute
            .iter()
            .flat_map(|a| a.g.iter().chain(&a.graphs))
        {
            ctx.walk(body, i, types, &mut out);
        }
    }
    out
}

/// What placing a subgraph's nodes needs from its model.
struct Walk<'a> {
    opsets: &'a HashMap<String, i64>,
    target: Target,
    tables: &'a Tables,
    functions: &'a HashSet<(String, String)>,
}

impl Walk<'_> {
    fn walk<'m>(
        &self,
        g: &'m GraphProto,
        parent: usize,
        outer: &HashMap<String, String>,
        out: &mut Vec<NestedPlaced<'m>>,
    ) {
        let types = infer_types_from(g, self.opsets, self.tables, outer.clone());
        for node in &g.node {
            let placed = if is_constant(node) {
                (None, BTreeMap::new(), Placement::Folded)
            } else {
                place_node(
                    node,
                    self.target,
                    self.opsets,
                    &types,
                    self.tables,
                    self.functions,
                )
            };
            out.push(NestedPlaced {
                parent,
                node,
                placed,
            });
            for body in node
                .attribute
                .iter()
                .flat_map(|a| a.g.iter().chain(&a.graphs))
            {
                self.walk(body, parent, &types, out);
            }
        }
    }
}

pub fn check_model_with(model: &ModelProto, target: Target, tables: &Tables) -> GpuReport {
    let empty = GraphProto::default();
    let graph = model.graph.as_ref().unwrap_or(&empty);
    let opsets = model_opsets(model);
    let types = infer_types(graph, &opsets, tables);
    let all_placed = place_all(model, target, tables);

    let mut groups: Vec<OpGroup> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut placed: Vec<Placement> = Vec::with_capacity(graph.node.len());
    let mut ntl_total = 0;
    let mut constants = 0;
    // the provider runs control-flow bodies itself: their nodes are placed like the others
    // (MIGraphX takes no Scan/Loop at all, so its bodies stay unchecked)
    let nested = match target {
        Target::Migraphx => Vec::new(),
        _ => place_nested(model, target, tables, &types),
    };
    let top = graph.node.iter().enumerate().zip(all_placed);
    let inner = nested.into_iter().map(|n| ((n.parent, n.node), n.placed));
    let top_count = graph.node.len();
    for (k, ((i, node), (version, bound, placement))) in top.chain(inner).enumerate() {
        let is_top = k < top_count;
        if is_constant(node) {
            constants += 1;
            if is_top {
                placed.push(Placement::Folded);
            }
            continue;
        }

        let ntl = is_ntl_node(node);
        ntl_total += ntl as usize;
        let types_shown: BTreeMap<String, String> = bound
            .into_iter()
            .map(|(p, t)| (p, t.unwrap_or_else(|| "?".into())))
            .collect();
        let key = format!(
            "{}\u{1}{}\u{1}{:?}\u{1}{:?}\u{1}{}",
            canonical_domain(node.domain()),
            node.op_type(),
            version,
            types_shown,
            placement_key(&placement)
        );
        let gi = *index.entry(key).or_insert_with(|| {
            groups.push(OpGroup {
                domain: canonical_domain(node.domain()).to_string(),
                op: node.op_type().to_string(),
                version,
                types: types_shown.clone(),
                placement: placement.clone(),
                nodes: Vec::new(),
                ntl_nodes: 0,
            });
            groups.len() - 1
        });
        let label = if is_top {
            node_label(node, i)
        } else {
            format!("{} (in {})", node.name(), node_label(&graph.node[i], i))
        };
        groups[gi].nodes.push(label);
        groups[gi].ntl_nodes += ntl as usize;
        if is_top {
            placed.push(placement);
        }
    }
    groups.sort_by(|a, b| (&a.domain, &a.op, a.version).cmp(&(&b.domain, &b.op, b.version)));
    let cpu_preferred = cpu_preferred_nodes(graph, &placed, &types);
    // (the nodes inside subgraphs; the CUDA and ROCm placement above covers them)
    let nested_nodes = match target {
        Target::Migraphx => count_nodes(graph) - graph.node.len(),
        _ => 0,
    };
    let mut notes = Vec::new();
    if let Some(&o) = opsets.get("ai.onnx") {
        if o > MAX_ONNX_OPSET && matches!(target, Target::Cuda119 | Target::Rocm119) {
            notes.push(format!(
                "the model's default opset {o} is newer than ONNX Runtime {ORT_VERSION} supports ({MAX_ONNX_OPSET}): it will not load"
            ));
        } else if o > MAX_ONNX_OPSET {
            notes.push(format!(
                "the model's default opset {o} is newer than the schema table (ONNX 1.16, opset {MAX_ONNX_OPSET}): op versions are taken as of opset {MAX_ONNX_OPSET}, so ops changed since are not checked exactly"
            ));
        }
    }
    if target == Target::Migraphx {
        notes.push(migraphx::NOTE.to_string());
    }
    if constants > 0 {
        notes.push(format!(
            "{constants} Constant node(s) become initializers when ONNX Runtime loads the graph (never executed, not checked)"
        ));
    }
    if nested_nodes > 0 {
        notes.push(format!(
            "{nested_nodes} node(s) inside subgraphs (If/Loop/Scan bodies) were not checked"
        ));
    }
    GpuReport {
        target,
        opsets: opsets.into_iter().collect(),
        nodes: graph.node.len(),
        ntl_nodes: ntl_total,
        groups,
        cpu_preferred,
        nested_nodes,
        notes,
    }
}

fn is_constant(node: &NodeProto) -> bool {
    node.op_type() == "Constant" && canonical_domain(node.domain()) == "ai.onnx"
}

/// Elements of a Constant's value.
fn constant_size(node: &NodeProto) -> i64 {
    node.attribute
        .iter()
        .map(|a| match a.name() {
            "value" => {
                a.t.as_ref()
                    .map_or(1, |t| t.dims.iter().fold(1i64, |n, &d| n.saturating_mul(d)))
            }
            "value_floats" => a.floats.len() as i64,
            "value_ints" => a.ints.len() as i64,
            "value_strings" => a.strings.len() as i64,
            _ => 1,
        })
        .next()
        .unwrap_or(1)
}

fn count_nodes(g: &GraphProto) -> usize {
    g.node.len()
        + g.node
            .iter()
            .flat_map(|n| n.attribute.iter())
            .map(|a| {
                a.g.iter()
                    .chain(a.graphs.iter())
                    .map(count_nodes)
                    .sum::<usize>()
            })
            .sum::<usize>()
}

fn placement_key(p: &Placement) -> String {
    match p {
        Placement::Gpu { kernel, unchecked } => format!(
            "gpu {} {:?} {unchecked:?}",
            kernel.range(),
            kernel.class_type
        ),
        Placement::Fallback { why, cpu } => format!("fallback {why:?} {cpu}"),
        Placement::Inlined => "inlined".into(),
        Placement::Unknown(w) => format!("unknown {w}"),
        Placement::Folded => "folded".into(),
    }
}

/// ORT's `GetCpuPreferredNodes` (onnxruntime/core/framework/fallback_cpu_capability.cc) on the
/// graph as written: starting from the outputs GPU kernels keep in CPU memory (`Shape`, ...) and
/// the outputs of CPU-fallback nodes, a GPU-capable node moves to the CPU when every input is
/// such a CPU value, a graph input, or an initializer of at most 100 elements, no input is a
/// 16-bit or 8-bit float, and the kernel does not itself read that input from CPU memory.
fn cpu_preferred_nodes(
    graph: &GraphProto,
    placed: &[Placement],
    types: &HashMap<String, String>,
) -> Vec<String> {
    let mut consumers: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, n) in graph.node.iter().enumerate() {
        for inp in n.input.iter().filter(|s| !s.is_empty()) {
            consumers.entry(inp.as_str()).or_default().push(i);
        }
    }
    let graph_inputs: HashSet<&str> = graph.input.iter().map(|v| v.name()).collect();
    let mut small_init: HashSet<&str> = graph
        .initializer
        .iter()
        .filter(|t| t.dims.iter().fold(1i64, |n, &d| n.saturating_mul(d)) <= SMALL_INITIALIZER)
        .map(|t| t.name())
        .collect();
    // Constant nodes are initializers by the time ORT partitions the graph
    for node in graph.node.iter().filter(|n| is_constant(n)) {
        if constant_size(node) <= SMALL_INITIALIZER {
            small_init.extend(node.output.first().map(String::as_str));
        }
    }
    let mut cpu_args: HashSet<&str> = HashSet::new();
    let mut candidates: BTreeSet<usize> = BTreeSet::new();
    for (i, (node, p)) in graph.node.iter().zip(placed).enumerate() {
        let _ = i;
        if let Placement::Gpu { kernel, .. } = p {
            for &o in &kernel.cpu_outputs {
                if let Some(out) = node.output.get(o).filter(|s| !s.is_empty()) {
                    cpu_args.insert(out);
                    candidates.extend(consumers.get(out.as_str()).into_iter().flatten());
                }
            }
        }
    }
    let mut visited: HashSet<usize> = HashSet::new();
    let mut cpu_nodes: BTreeSet<usize> = BTreeSet::new();
    while let Some(cur) = candidates.pop_first() {
        if !visited.insert(cur) {
            continue;
        }
        let node = &graph.node[cur];
        let Placement::Gpu { kernel, .. } = &placed[cur] else {
            if !matches!(placed[cur], Placement::Fallback { .. }) {
                continue; // inlined, not checked: where it runs is not known here
            }
            // a CPU node: its outputs are CPU values
            for out in node.output.iter().filter(|s| !s.is_empty()) {
                cpu_args.insert(out);
                candidates.extend(consumers.get(out.as_str()).into_iter().flatten());
            }
            continue;
        };
        let mut place_in_cpu = true;
        for (i, inp) in node.input.iter().enumerate() {
            let ty = types.get(inp).map(String::as_str);
            if matches!(
                ty,
                Some(
                    "float16"
                        | "bfloat16"
                        | "float8e4m3fn"
                        | "float8e4m3fnuz"
                        | "float8e5m2"
                        | "float8e5m2fnuz"
                )
            ) {
                place_in_cpu = false;
                break;
            }
            if small_init.contains(inp.as_str()) || graph_inputs.contains(inp.as_str()) {
                continue;
            }
            if !cpu_args.contains(inp.as_str()) || kernel.cpu_inputs.contains(&i) {
                place_in_cpu = false;
                break;
            }
        }
        if place_in_cpu {
            cpu_nodes.insert(cur);
            for out in node.output.iter().filter(|s| !s.is_empty()) {
                cpu_args.insert(out);
                candidates.extend(consumers.get(out.as_str()).into_iter().flatten());
            }
        }
    }
    cpu_nodes
        .into_iter()
        .map(|i| node_label(&graph.node[i], i))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_tables_parse_and_cover_both_providers() {
        let t = tables();
        for target in [Target::Cuda119, Target::Rocm119] {
            assert!(!t.kernels(target.ep(), "", "MatMul").is_empty());
            assert!(!t
                .kernels(target.ep(), "ai.onnx", "SoftmaxCrossEntropyLoss")
                .is_empty());
        }
        assert!(t.kernel_provenance.contains("1.19.2"));
        for target in [Target::Cuda, Target::Rocm] {
            let t = tables_for(target);
            assert!(!t.kernels(target.ep(), "", "MatMul").is_empty());
            assert!(!t.kernels("cpu", "", "MatMul").is_empty());
            assert!(t.kernel_provenance.contains(target.package()));
            // the inference tables hold their provider and the CPU only
            assert!(t.kernels("cuda", "", "MatMul").is_empty() != (target == Target::Cuda));
        }
        assert!(migraphx::ops().ops.contains_key("MatMul"));
    }

    #[test]
    fn version_in_effect_is_the_latest_at_or_below_the_opset() {
        let t = tables();
        assert_eq!(t.op_version("", "ReduceMax", 17), Some(13));
        assert_eq!(t.op_version("", "ReduceMax", 18), Some(18));
        assert_eq!(t.op_version("", "ArgMax", 17), Some(13));
        assert_eq!(t.op_version("", "Softmax", 12), Some(11));
        assert_eq!(
            t.op_version("com.microsoft", "SoftmaxCrossEntropyLossGrad", 1),
            Some(1)
        );
        assert_eq!(t.op_version("", "NoSuchOp", 17), None);
    }

    #[test]
    fn open_ended_kernels_serve_only_their_start_version() {
        let k = Kernel {
            since: 13,
            end: None,
            class_type: None,
            constraints: vec![],
            cpu_inputs: vec![],
            cpu_outputs: vec![],
            condition: None,
            source: String::new(),
        };
        assert!(k.serves_version(13));
        assert!(!k.serves_version(14));
        let closed = Kernel { end: Some(15), ..k };
        assert!(
            closed.serves_version(14) && closed.serves_version(13) && !closed.serves_version(16)
        );
    }
}

// ------------------------------------------------------------------------------------------
// MIGraphX

/// The MIGraphX execution provider (onnxruntime-migraphx 1.27.1) registers no kernels: its
/// `GetCapability` (`migraphx_execution_provider.cc`) takes a node when every input and output
/// has a supported element type (`IsTypeSupported`), the op's name is on its supported-op list
/// (any version, any domain), and, for default-domain ops, `IsUnsupportedOpMode` has no objection
/// (mostly: inputs MIGraphX needs as constants, such as Reshape's shape, must be computable from
/// initializers and `Shape` outputs alone). Then, over the graph: with more than 10 unsupported
/// nodes it takes nothing; otherwise the graph is cut at the unsupported nodes and a piece is
/// handed back unless it holds an RNN or a MatMul/Gemm/Conv/... with an input of more than 300
/// elements (`SubgraphPostProcessing`). All of that is modelled here, on the graph as written
/// (node order as the topological order, declared shapes only).
pub mod migraphx {
    use super::*;
    use crate::onnx::{attr_ints, attr_s};

    /// The file the rules come from.
    pub const SOURCE: &str = "onnxruntime/core/providers/migraphx/migraphx_execution_provider.cc";

    /// Added to every migraphx report.
    pub const NOTE: &str = "migraphx: modelled on migraphx_execution_provider.cc of ORT 1.27 (supported-op list, element types, IsUnsupportedOpMode, no node taken when more than 10 are unsupported, SubgraphPostProcessing); node order is taken as the topological order and only declared shapes are known, and an op MIGraphX takes may still fail to compile (not checked)";

    /// The ops `IsUnsupportedOpMode` has a rule for, each modelled by [`unsupported_mode`]. The
    /// table's `mode_check` column must name exactly these (a test checks it).
    pub const MODE_CHECKED: [&str; 21] = [
        "ArgMax",
        "ArgMin",
        "ConstantOfShape",
        "ConvInteger",
        "Expand",
        "MatMulInteger",
        "MaxPool",
        "NonZero",
        "OneHot",
        "Pad",
        "Range",
        "ReduceSum",
        "Reshape",
        "Resize",
        "Slice",
        "Split",
        "Squeeze",
        "Tile",
        "TopK",
        "Unsqueeze",
        "Upsample",
    ];

    /// The parsed op table.
    #[derive(Debug, Clone)]
    pub struct Ops {
        /// op name -> `IsUnsupportedOpMode` has a rule for it
        pub ops: BTreeMap<String, bool>,
        /// element types `IsTypeSupported` accepts
        pub types: Vec<String>,
        /// more unsupported nodes than this and the provider takes none
        pub max_unsupported: usize,
        /// the header comment (version and commit)
        pub provenance: String,
    }

    impl Ops {
        pub fn parse(tsv: &str) -> Result<Ops, String> {
            let mut types = Vec::new();
            let mut max_unsupported = None;
            let mut provenance = Vec::new();
            for c in tsv.lines().filter_map(|l| l.strip_prefix('#')) {
                let c = c.trim();
                if let Some(t) = c.strip_prefix("types:") {
                    types = t.trim().split(',').map(str::to_string).collect();
                } else if let Some(n) = c.strip_prefix("max_unsupported_nodes:") {
                    max_unsupported = n.trim().parse().ok();
                } else {
                    provenance.push(c.to_string());
                }
            }
            let mut ops = BTreeMap::new();
            for row in tsv_rows(tsv, "op\t", 2, "migraphx") {
                let (_, f) = row?;
                ops.insert(f[0].to_string(), f[1] == "y");
            }
            if ops.is_empty() || types.is_empty() {
                return Err("migraphx table: no ops or no types".into());
            }
            Ok(Ops {
                ops,
                types,
                max_unsupported: max_unsupported
                    .ok_or("migraphx table: no max_unsupported_nodes line")?,
                provenance: provenance.join(" "),
            })
        }
    }

    /// The embedded op table (parsed on first use).
    pub fn ops() -> &'static Ops {
        static OPS: OnceLock<Ops> = OnceLock::new();
        OPS.get_or_init(|| Ops::parse(MIGRAPHX_OP_TABLE).expect("embedded migraphx table parses"))
    }

    /// What the provider's rules need to know about the graph.
    struct View<'a> {
        nodes: &'a [NodeProto],
        initializers: HashSet<&'a str>,
        inputs: HashSet<&'a str>,
        producer: HashMap<&'a str, usize>,
        /// declared shapes: `None` for a symbolic dimension
        shapes: HashMap<&'a str, Vec<Option<i64>>>,
    }

    impl<'a> View<'a> {
        fn new(graph: &'a GraphProto) -> View<'a> {
            let mut initializers: HashSet<&str> =
                graph.initializer.iter().map(|t| t.name()).collect();
            // Constant nodes are initializers by the time ORT partitions the graph
            for n in graph.node.iter().filter(|n| is_constant(n)) {
                initializers.extend(n.output.first().map(String::as_str));
            }
            let inputs = graph
                .input
                .iter()
                .map(|v| v.name())
                .filter(|n| !initializers.contains(n))
                .collect();
            let mut producer = HashMap::new();
            for (i, n) in graph.node.iter().enumerate() {
                if is_constant(n) {
                    continue;
                }
                for o in n.output.iter().filter(|o| !o.is_empty()) {
                    producer.insert(o.as_str(), i);
                }
            }
            let mut shapes = HashMap::new();
            for vi in graph
                .input
                .iter()
                .chain(&graph.output)
                .chain(&graph.value_info)
            {
                if let Some((_, Some(dims))) = crate::onnx::value_info_shape(vi) {
                    shapes.insert(vi.name(), dims);
                }
            }
            for t in &graph.initializer {
                shapes.insert(t.name(), t.dims.iter().map(|&d| Some(d)).collect());
            }
            View {
                nodes: &graph.node,
                initializers,
                inputs,
                producer,
                shapes,
            }
        }

        /// `canEvalShapeGeneral`: node `n`'s value can be computed from initializers and `Shape`
        /// outputs alone; adds the nodes used to `used`. `memo` avoids revisiting.
        fn eval_node(
            &self,
            n: usize,
            used: &mut BTreeSet<usize>,
            memo: &mut HashMap<usize, bool>,
        ) -> bool {
            if let Some(&r) = memo.get(&n) {
                return r;
            }
            memo.insert(n, false); // a cycle (invalid graph) cannot be evaluated
            let node = &self.nodes[n];
            let ok = node.op_type() == "Shape"
                || node.input.iter().all(|inp| {
                    if self.initializers.contains(inp.as_str()) {
                        return true;
                    }
                    if self.inputs.contains(inp.as_str()) {
                        return false;
                    }
                    match self.producer.get(inp.as_str()) {
                        None => false,
                        Some(&p) if self.nodes[p].op_type() == "Shape" => true,
                        Some(&p) => self.eval_node(p, used, memo),
                    }
                });
            if ok {
                used.insert(n);
            }
            memo.insert(n, ok);
            ok
        }

        /// `canEvalNodeArgument`: the node's inputs at `indices` can be computed statically;
        /// adds the nodes used to `used`.
        fn eval_args(
            &self,
            node: &NodeProto,
            indices: &[usize],
            used: &mut BTreeSet<usize>,
        ) -> bool {
            let mut memo = HashMap::new();
            indices.iter().all(|&i| {
                let name = node.input.get(i).map_or("", String::as_str);
                if self.initializers.contains(name) {
                    return true;
                }
                if self.inputs.contains(name) {
                    return false;
                }
                match self.producer.get(name) {
                    None => false,
                    Some(&p) => self.eval_node(p, used, &mut memo),
                }
            })
        }

        fn constant(&self, node: &NodeProto, indices: &[usize]) -> bool {
            self.eval_args(node, indices, &mut BTreeSet::new())
        }

        fn elements_over(&self, name: &str, limit: u64) -> bool {
            self.shapes.get(name).is_some_and(|dims| {
                dims.iter()
                    .map(|d| d.unwrap_or(1).max(0) as u64)
                    .product::<u64>()
                    > limit
            })
        }
    }

    /// `IsUnsupportedOpMode` for a default-domain node: why the provider refuses it, if it does.
    fn unsupported_mode(
        v: &View,
        node: &NodeProto,
        types: &HashMap<String, String>,
    ) -> Option<String> {
        let n_in = node.input.len();
        let first_type = || {
            node.input
                .first()
                .and_then(|i| types.get(i))
                .map(String::as_str)
        };
        let not_const = |what: &str| {
            Some(format!(
                "{what} must be computable from initializers and Shape outputs (it is not)"
            ))
        };
        match node.op_type() {
            "ArgMax" | "ArgMin" => (attr_i(node, "select_last_index").unwrap_or(0) != 0)
                .then(|| "select_last_index=1 is not supported".to_string()),
            "ConstantOfShape" if !v.constant(node, &[0]) => not_const("the shape input"),
            "ConvInteger" | "MatMulInteger"
                if first_type().is_some_and(|t| t != "int8" && t != "uint8") =>
            {
                Some("only int8 and uint8 inputs are supported".into())
            }
            "Expand" if !v.constant(node, &[1]) => not_const("the shape input"),
            "MaxPool" => {
                if node.output.len() > 1 {
                    Some("the Indices output is not supported".into())
                } else if attr_ints(node, "dilations").is_some_and(|d| d.iter().any(|&x| x != 1)) {
                    Some("dilations other than 1 are not supported".into())
                } else if attr_i(node, "storage_order").unwrap_or(0) != 0 {
                    Some("storage_order=1 is not supported".into())
                } else if first_type().is_some_and(|t| t == "int8" || t == "uint8") {
                    Some("int8 and uint8 inputs are not supported".into())
                } else {
                    None
                }
            }
            "NonZero" if !v.constant(node, &[0]) => not_const("the input"),
            "OneHot" if !v.constant(node, &[1]) => not_const("the depth input"),
            "Pad" => {
                let mode = attr_s(node, "mode").unwrap_or_else(|| "constant".into());
                if n_in >= 2 && !v.constant(node, &[1]) {
                    not_const("the pads input")
                } else if mode != "constant" && mode != "reflect" {
                    Some(format!(
                        "mode={mode} is not supported (constant and reflect are)"
                    ))
                } else if mode == "constant" && n_in == 3 && !v.constant(node, &[2]) {
                    not_const("the constant_value input")
                } else {
                    None
                }
            }
            "Range" if !v.constant(node, &(0..n_in).collect::<Vec<_>>()) => {
                not_const("every input")
            }
            "Reshape" if n_in == 2 && !v.constant(node, &[1]) => not_const("the shape input"),
            "Resize" | "Upsample" => {
                if attr_s(node, "coordinate_transformation_mode").as_deref()
                    == Some("tf_crop_and_resize")
                {
                    Some(
                        "coordinate_transformation_mode=tf_crop_and_resize is not supported".into(),
                    )
                } else if attr_s(node, "mode").as_deref() == Some("cubic") {
                    Some("mode=cubic is not supported".into())
                } else {
                    None
                }
            }
            "ReduceSum" if n_in == 2 && !v.constant(node, &[1]) => not_const("the axes input"),
            "Slice" => {
                if !v.constant(node, &(1..n_in).collect::<Vec<_>>()) {
                    return not_const("every input but the data");
                }
                let (starts, ends) = (attr_ints(node, "starts"), attr_ints(node, "ends"));
                match (starts, ends) {
                    (Some(s), Some(e)) if s.iter().zip(&e).any(|(a, b)| a > b) => {
                        Some("a start beyond its end is not supported".into())
                    }
                    _ => None,
                }
            }
            "Split" => {
                let empty_1d = node
                    .input
                    .first()
                    .and_then(|i| v.shapes.get(i.as_str()))
                    .is_some_and(|d| d.len() == 1 && d[0].unwrap_or(0) == 0);
                if empty_1d {
                    Some("a 1-D input of size 0 (or of symbolic size) is not supported".into())
                } else if n_in == 2 && !v.constant(node, &[1]) {
                    not_const("the split input")
                } else {
                    None
                }
            }
            "Tile" if !v.constant(node, &[1]) => not_const("the repeats input"),
            "TopK" if !v.constant(node, &[1]) => not_const("the K input"),
            "Squeeze" | "Unsqueeze" if n_in == 2 && !v.constant(node, &[1]) => {
                not_const("the axes input")
            }
            _ => None,
        }
    }

    /// `SubgraphPostProcessing`: whether the provider keeps a piece of the graph (node indices)
    /// or hands it back to the CPU.
    fn keeps_cluster(v: &View, cluster: &[usize]) -> bool {
        let members: HashSet<usize> = cluster.iter().copied().collect();
        for &i in cluster {
            let node = &v.nodes[i];
            if node.op_type() == "Reshape" && node.input.len() == 2 {
                let mut used = BTreeSet::new();
                if !v.eval_args(node, &[1], &mut used) || !used.iter().all(|u| members.contains(u))
                {
                    return false;
                }
            }
        }
        if cluster
            .iter()
            .any(|&i| matches!(v.nodes[i].op_type(), "RNN" | "GRU" | "LSTM"))
        {
            return true;
        }
        cluster.iter().any(|&i| {
            let node = &v.nodes[i];
            matches!(
                node.op_type(),
                "AveragePool" | "Conv" | "Gemm" | "LRN" | "MatMul" | "MaxPool"
            ) && node.input.iter().any(|inp| v.elements_over(inp, 300))
        })
    }

    fn claimed(version: Option<i64>) -> Kernel {
        Kernel {
            since: version.unwrap_or(0),
            end: version,
            class_type: None,
            constraints: Vec::new(),
            cpu_inputs: Vec::new(),
            cpu_outputs: Vec::new(),
            condition: None,
            source: SOURCE.to_string(),
        }
    }

    /// The placement of every top-level node of `graph` on the MIGraphX provider.
    pub(super) fn place_graph(
        graph: &GraphProto,
        opsets: &HashMap<String, i64>,
        types: &HashMap<String, String>,
        tables: &Tables,
        ops: &Ops,
    ) -> Vec<Placed> {
        let v = View::new(graph);
        let mut out: Vec<Placed> = Vec::with_capacity(graph.node.len());
        // per node: None = taken, Some(why) = refused
        let mut refused: Vec<Option<Missing>> = Vec::with_capacity(graph.node.len());
        for node in &graph.node {
            let domain = canonical_domain(node.domain()).to_string();
            let op = node.op_type();
            let opset = opsets.get(&domain).copied();
            let version = opset.and_then(|o| tables.op_version(&domain, op, o));
            let schema = opset.and_then(|o| tables.schema(&domain, op, o));
            let bound = schema
                .map(|s| bound_types(node, s, types))
                .unwrap_or_default();
            if is_constant(node) {
                out.push((None, bound, Placement::Folded));
                refused.push(None);
                continue;
            }
            let bad_type = node
                .input
                .iter()
                .map(|n| ("input", n))
                .chain(node.output.iter().map(|n| ("output", n)))
                .filter(|(_, n)| !n.is_empty())
                .find_map(|(kind, n)| {
                    types
                        .get(n)
                        .filter(|t| !ops.types.contains(t))
                        .map(|t| (format!("{kind} {n}"), t.clone()))
                });
            let why = if let Some((param, actual)) = bad_type {
                Some(Missing::Type {
                    param,
                    actual,
                    accepted: ops.types.clone(),
                })
            } else if !ops.ops.contains_key(op) {
                Some(Missing::NoKernel)
            } else if domain == "ai.onnx" {
                unsupported_mode(&v, node, types)
                    .map(|r| Missing::Refused(format!("migraphx: {op}: {r} (IsUnsupportedOpMode)")))
            } else {
                None
            };
            out.push((
                version,
                bound,
                Placement::Gpu {
                    kernel: claimed(version),
                    unchecked: Vec::new(),
                },
            ));
            refused.push(why);
        }
        let unsupported: Vec<usize> = (0..graph.node.len())
            .filter(|&i| refused[i].is_some())
            .collect();
        let count = unsupported.len();
        let mut handed_back: HashSet<usize> = HashSet::new();
        if count > ops.max_unsupported {
            handed_back.extend(
                (0..graph.node.len())
                    .filter(|&i| refused[i].is_none() && !is_constant(&graph.node[i])),
            );
        } else if count > 0 {
            // the pieces between unsupported nodes (a final cut closes the last one)
            let mut cluster = Vec::new();
            let cuts = refused.iter().map(Option::is_some).chain([true]);
            for (i, cut) in cuts.enumerate() {
                if !cut {
                    if !is_constant(&graph.node[i]) {
                        cluster.push(i);
                    }
                    continue;
                }
                if !cluster.is_empty() && !keeps_cluster(&v, &cluster) {
                    handed_back.extend(cluster.iter().copied());
                }
                cluster.clear();
            }
        }
        for (i, node) in graph.node.iter().enumerate() {
            let why = match refused[i].take() {
                Some(why) => why,
                None if handed_back.contains(&i) => {
                    Missing::Refused(if count > ops.max_unsupported {
                        format!("migraphx: {count} nodes of the graph are unsupported, more than {}, so the provider takes none (GetCapability)", ops.max_unsupported)
                    } else {
                        "migraphx: handed back with its partition, which holds no RNN and no MatMul/Gemm/Conv/pool/LRN with an input of more than 300 elements (SubgraphPostProcessing)".to_string()
                    })
                }
                None => continue,
            };
            let (version, bound, _) = &out[i];
            let cpu_kernels = tables.kernels("cpu", node.domain(), node.op_type());
            let cpu = match version {
                Some(ver) => match_kernels(cpu_kernels, *ver, bound, true).is_ok(),
                None => !cpu_kernels.is_empty(),
            };
            out[i].2 = Placement::Fallback { why, cpu };
        }
        out
    }
}

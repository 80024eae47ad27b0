//! Mixed precision (`ntl-patch step --precision fp16|bf16`): the step graph's forward and
//! backward computed in the half type where torch's CUDA autocast computes in it, float32
//! everywhere else.
//!
//! The pass runs on the float32 step graph (forward + backward, before the optimizer) and gives
//! every float tensor a type, node by node, as autocast would:
//! - **half ops** (autocast's lower-precision list: MatMul, Gemm, Einsum, Conv): every float
//!   input is cast to the half type and the output is half. The gradients of these ops are
//!   MatMul/Einsum nodes too, so they run in half as well; parameters are cast once per step
//!   (their float32 master copies are the state). The ONNX `Attention` operator (SDPA, on
//!   autocast's list too) likewise, its attributes as exported;
//! - **float32 ops** (autocast's float32 list: softmax, log-softmax, cross-entropy, the norms,
//!   accumulating reductions, exp/log/pow and friends): half inputs are cast to float32;
//! - **every other op** runs in the type its inputs have, with torch's promotion: all half →
//!   half; any float32 tensor among them → float32 (the half inputs cast up). A float32 scalar
//!   (a one-value constant or a rank-0 tensor) does not promote, as torch's 0-dim tensors and
//!   Python numbers do not — unless the half type cannot hold it as a normal number (`1e-12`,
//!   `-3.4e38`), where float32 is kept rather than flushing it to 0 or infinity. The bias of a
//!   MatMul (an `Add` of a MatMul output and an initializer) joins the MatMul's half type, as
//!   `F.linear`/`addmm` do under autocast;
//! - ops with subgraphs (If, Loop, Scan) and ops of other domains get float32 inputs.
//!
//! The parameter gradients and the losses are float32 at the end (a Cast where they come out
//! half). Nothing here knows about loss scaling (`loss_scale.rs`) or the optimizer, which runs
//! on float32 after this pass.

use std::collections::{HashMap, HashSet};

use crate::graph::elem_types::ElemTypes;
use crate::graph::ranks::Ranks;
use crate::onnx::proto::tensor_proto::DataType;
use crate::onnx::{attr, GraphProto, NodeProto, TensorProto, FLOAT};
use ntl_ops::schema::{schemas, Schema};
use ntl_ops::Builder;

use super::FLOAT16;

/// Autocast's lower-precision list, as ONNX ops.
pub const HALF_OPS: &[&str] = &["MatMul", "Gemm", "Einsum", "Conv", "ConvTranspose"];

/// Autocast's float32 list (CUDA), as ONNX ops: numerically sensitive ops and the reductions
/// that accumulate. Max/min reductions, ArgMax and Hardmax are exact in any type and follow
/// their input, as in torch.
pub const FLOAT32_OPS: &[&str] = &[
    "Softmax",
    "LogSoftmax",
    "SoftmaxCrossEntropyLoss",
    "NegativeLogLikelihoodLoss",
    "LayerNormalization",
    "GroupNormalization",
    "InstanceNormalization",
    "BatchNormalization",
    "LpNormalization",
    "MeanVarianceNormalization",
    "ReduceSum",
    "ReduceMean",
    "ReduceSumSquare",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceProd",
    "CumSum",
    "Exp",
    "Log",
    "Pow",
    "Reciprocal",
    "Softplus",
    "Acos",
    "Asin",
    "Acosh",
    "Asinh",
    "Atanh",
    "Cosh",
    "Sinh",
    "Tan",
];

/// Ops with no CUDA or ROCm kernel for the half type in the onnxruntime builds `inspect
/// --target cuda|rocm` models (onnxruntime-gpu 1.31.1, onnxruntime-rocm 1.22.2) at some opset
/// 13–21: they compute in float32 instead (even a half op such as bf16 Einsum), so the whole
/// step stays on the GPU. `tests/precision.rs` derives both lists from the kernel tables for
/// every ONNX operator and checks them equal.
pub const NO_GPU_FLOAT16: &[&str] = &["EyeLike", "GridSample", "Range", "RoiAlign"];
pub const NO_GPU_BFLOAT16: &[&str] = &[
    "Abs",
    "AveragePool",
    "Ceil",
    "Clip",
    "Conv",
    "ConvTranspose",
    "Cos",
    "DeformConv",
    "DepthToSpace",
    "DequantizeLinear",
    "Einsum",
    "Elu",
    "EyeLike",
    "Floor",
    "GRU",
    "Gelu",
    "GlobalAveragePool",
    "GlobalMaxPool",
    "GridSample",
    "HardSigmoid",
    "HardSwish",
    "LRN",
    "LSTM",
    "LeakyRelu",
    "MaxPool",
    "OneHot",
    "PRelu",
    "Pad",
    "RNN",
    "RandomNormal",
    "RandomNormalLike",
    "RandomUniform",
    "RandomUniformLike",
    "Range",
    "ReduceMax",
    "ReduceMin",
    "Resize",
    "RoiAlign",
    "Round",
    "Selu",
    "Shrink",
    "Sign",
    "Sin",
    "Softsign",
    "SpaceToDepth",
    "ThresholdedRelu",
    "TopK",
    "Where",
];

/// Whether `op` has no GPU kernel for `half` (see the lists above).
pub fn no_gpu_kernel(op: &str, half: i32) -> bool {
    let list = if half == FLOAT16 {
        NO_GPU_FLOAT16
    } else {
        NO_GPU_BFLOAT16
    };
    list.contains(&op)
}

/// How a node's float inputs are typed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Half,
    Float32,
    /// torch's promotion among the inputs.
    Follow,
}

fn class(node: &NodeProto, half: i32) -> Class {
    let op = node.op_type();
    let foreign = !matches!(node.domain(), "" | "ai.onnx");
    let subgraphs = node
        .attribute
        .iter()
        .any(|a| a.g.is_some() || !a.graphs.is_empty());
    let no_kernel = no_gpu_kernel(op, half);
    if foreign || subgraphs || no_kernel || FLOAT32_OPS.contains(&op) {
        Class::Float32
    } else if HALF_OPS.contains(&op) {
        Class::Half
    } else {
        Class::Follow
    }
}

/// The tensors the pass must leave float32 (parameter gradients, losses), and what it reads.
pub struct Inputs<'a> {
    /// Frozen half weights read through widening Casts (`frozen_half.rs`).
    pub widened: &'a super::frozen_half::WidenedSet,
    pub graph: &'a GraphProto,
    /// Initializers emitted since the graph was read (the backward's constants).
    pub new_initializers: &'a [TensorProto],
    /// Trained parameters: inputs at run time, never folded into constants.
    pub params: &'a HashSet<String>,
    pub ranks: &'a Ranks,
    /// Element types of the float32 graph (forward and backward).
    pub types: &'a ElemTypes,
    pub opset: i64,
    pub float32_sinks: &'a HashSet<String>,
}

/// The mixed-precision nodes, and the tensors of the float32 graph that are now half (their
/// declared value types must follow).
pub struct Mixed {
    pub nodes: Vec<NodeProto>,
    pub half: i32,
    pub half_tensors: HashSet<String>,
}

impl Mixed {
    /// Value infos of the float32 graph retyped: a tensor that became half is declared so.
    pub fn retype(&self, values: &mut [crate::onnx::ValueInfoProto]) {
        use crate::onnx::proto::type_proto::Value;
        for v in values {
            if !self.half_tensors.contains(v.name()) {
                continue;
            }
            if let Some(Value::TensorType(t)) = v.r#type.as_mut().and_then(|t| t.value.as_mut()) {
                t.elem_type = Some(self.half);
            }
        }
    }
}

/// Rewrites `nodes` (the float32 forward and backward, in order) into the mixed-precision
/// graph computing in `half` (float16 or bfloat16). New casts and constants go through `b`
/// (nodes returned in order, constants left in `b.initializers`).
pub fn autocast(b: &mut Builder, nodes: Vec<NodeProto>, half: i32, inp: &Inputs) -> Mixed {
    let mut pass = Pass::new(b, half, inp);
    for node in nodes {
        pass.node(node);
    }
    let half_tensors = pass
        .ty
        .iter()
        .filter(|(n, &t)| t == half && inp.types.get(n) == Some(FLOAT))
        .map(|(n, _)| n.clone())
        .collect();
    Mixed {
        nodes: pass.out,
        half,
        half_tensors,
    }
}

struct Pass<'a, 'b> {
    b: &'a mut Builder,
    inp: &'a Inputs<'b>,
    half: i32,
    /// The type each tensor has in the rewritten graph (float tensors and what is known).
    ty: HashMap<String, i32>,
    /// One-value float32 constants (not parameters): their value.
    scalars: HashMap<String, f32>,
    /// Float initializers (parameters too): a MatMul's bias joins its half type.
    initializers: HashSet<String>,
    /// Outputs of half ops (a following bias Add joins them).
    half_op_outputs: HashSet<String>,
    /// Memoised casts: (tensor, to type) → the cast's output.
    casts: HashMap<(String, i32), String>,
    out: Vec<NodeProto>,
}

impl<'a, 'b> Pass<'a, 'b> {
    fn new(b: &'a mut Builder, half: i32, inp: &'a Inputs<'b>) -> Self {
        let mut ty = HashMap::new();
        let mut scalars = HashMap::new();
        let mut initializers = HashSet::new();
        let inits = inp.graph.initializer.iter().chain(inp.new_initializers);
        for t in inits {
            ty.insert(t.name().to_string(), t.data_type());
            if t.data_type() == FLOAT {
                initializers.insert(t.name().to_string());
            }
            if t.data_type() == FLOAT && !inp.params.contains(t.name()) {
                if let Some(v) = single_f32(t) {
                    scalars.insert(t.name().to_string(), v);
                }
            }
        }
        // a frozen half weight is a weight: a MatMul's bias among them joins its half type
        initializers.extend(inp.widened.wide_names().cloned());
        for v in &inp.graph.input {
            if let Some((t, _)) = crate::onnx::value_info_shape(v) {
                ty.insert(v.name().to_string(), t);
            }
        }
        Pass {
            b,
            inp,
            half,
            ty,
            scalars,
            initializers,
            half_op_outputs: HashSet::new(),
            casts: HashMap::new(),
            out: Vec::new(),
        }
    }

    fn type_of(&self, tensor: &str) -> Option<i32> {
        self.ty
            .get(tensor)
            .copied()
            .or_else(|| self.inp.types.get(tensor))
    }

    fn is_float(&self, tensor: &str) -> bool {
        !tensor.is_empty()
            && matches!(self.type_of(tensor), Some(t) if t == FLOAT || t == self.half)
    }

    /// A float32 input that does not promote a half computation: a scalar the half type holds.
    fn is_weak(&self, node: &NodeProto, tensor: &str) -> bool {
        if let Some(&v) = self.scalars.get(tensor) {
            return self.representable(v);
        }
        if self.inp.ranks.get(tensor) == Some(0) && !self.inp.params.contains(tensor) {
            return true;
        }
        // a MatMul's bias: F.linear / addmm run the bias add in the half type
        node.op_type() == "Add"
            && self.initializers.contains(tensor)
            && node.input.iter().any(|i| self.half_op_outputs.contains(i))
    }

    /// Whether the half type holds `v` as a normal number (or exactly: 0, ±inf, NaN).
    fn representable(&self, v: f32) -> bool {
        let (min_normal, max) = if self.half == FLOAT16 {
            (6.103_515_6e-5_f32, 65504.0_f32)
        } else {
            (f32::MIN_POSITIVE, f32::MAX)
        };
        let a = v.abs();
        v == 0.0 || !v.is_finite() || (min_normal..=max).contains(&a)
    }

    fn node(&mut self, mut node: NodeProto) {
        let schema = schemas().schema(node.domain(), node.op_type(), self.inp.opset);
        // the operator's attributes stay as exported: onnxruntime's CUDA kernel refuses a
        // `softmax_precision`, and keeps a half softmax's sums in float32 without one
        let sdpa = is_attention_operator(&node, self.inp.opset);
        let class = match schema {
            Some(_) => class(&node, self.half),
            None if sdpa => Class::Half,
            None => Class::Float32,
        };
        // inputs by type parameter (fixed types and non-float inputs aside)
        let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
        for (i, input) in node.input.iter().enumerate() {
            if !self.is_float(input) {
                continue;
            }
            let param = schema
                .and_then(|s| s.input_param(i))
                .unwrap_or_else(|| format!("#{i}"));
            match groups.iter_mut().find(|(p, _)| *p == param) {
                Some((_, members)) => members.push(i),
                None => groups.push((param, vec![i])),
            }
        }
        let mut decided: HashMap<String, i32> = HashMap::new();
        for (param, members) in &groups {
            let t = self.decide(&node, class, members);
            for &i in members {
                node.input[i] = self.as_type(&node.input[i], t);
            }
            decided.insert(param.clone(), t);
        }
        // output types
        let mut renamed = Vec::new();
        for (j, out) in node.output.clone().iter().enumerate() {
            if out.is_empty() {
                continue;
            }
            let t = output_type(&node, schema, j, &decided)
                // the operator's outputs are of its operands' type (the schema's T1, T2)
                .or_else(|| sdpa.then(|| decided.get("#0").copied()).flatten())
                .or_else(|| self.inp.types.get(out))
                // a float op's output of an unbound type parameter (LayerNormalization's
                // statistics): float32, as everything was
                .or_else(|| (!decided.is_empty()).then_some(FLOAT));
            let Some(t) = t else { continue };
            if t == self.half && self.inp.float32_sinks.contains(out) {
                let tmp = self.b.fresh("amp/half");
                node.output[j] = tmp.clone();
                self.ty.insert(tmp.clone(), t);
                renamed.push((tmp, out.clone()));
                self.ty.insert(out.clone(), FLOAT);
            } else {
                self.ty.insert(out.clone(), t);
                if class == Class::Half && !sdpa {
                    self.half_op_outputs.insert(out.clone());
                }
            }
        }
        if node.op_type() == "Constant" {
            if let Some(v) = constant_scalar(&node) {
                self.scalars.insert(node.output[0].clone(), v);
            }
        }
        self.out.push(node);
        for (tmp, out) in renamed {
            self.emit_cast(&tmp, FLOAT, &out);
        }
    }

    /// The type a group of inputs (one type parameter) computes in.
    fn decide(&self, node: &NodeProto, class: Class, members: &[usize]) -> i32 {
        match class {
            Class::Half => self.half,
            Class::Float32 => FLOAT,
            Class::Follow => {
                let inputs = members.iter().map(|&i| node.input[i].as_str());
                let types: Vec<(&str, i32)> = inputs
                    .filter_map(|n| self.type_of(n).map(|t| (n, t)))
                    .collect();
                let any_half = types.iter().any(|&(_, t)| t == self.half);
                let strong_f32 = types
                    .iter()
                    .any(|&(n, t)| t == FLOAT && !self.is_weak(node, n));
                if any_half && !strong_f32 {
                    self.half
                } else {
                    FLOAT
                }
            }
        }
    }

    /// `tensor` in type `to`: itself, the frozen half weight it widens, a half constant made
    /// now, or a (shared) Cast.
    fn as_type(&mut self, tensor: &str, to: i32) -> String {
        if self.type_of(tensor) == Some(to) {
            return tensor.to_string();
        }
        if let Some(half) = self.inp.widened.lookup(tensor, to) {
            return half.to_string();
        }
        let key = (tensor.to_string(), to);
        if let Some(done) = self.casts.get(&key) {
            return done.clone();
        }
        let name = match self.scalars.get(tensor) {
            Some(&v) if to == self.half => {
                let name = self.b.fresh("amp/const");
                self.b.initializers.push(half_scalar(&name, to, v));
                name
            }
            _ => {
                let name = self
                    .b
                    .fresh(if to == FLOAT { "amp/f32" } else { "amp/half" });
                self.emit_cast(tensor, to, &name);
                name
            }
        };
        self.ty.insert(name.clone(), to);
        self.casts.insert(key, name.clone());
        name
    }

    fn emit_cast(&mut self, from: &str, to: i32, out: &str) {
        let name = self.b.fresh("Cast");
        self.out.push(NodeProto {
            name: Some(name),
            op_type: Some("Cast".into()),
            input: vec![from.to_string()],
            output: vec![out.to_string()],
            attribute: vec![crate::onnx::int_attr("to", to as i64)],
            ..Default::default()
        });
    }
}

/// The ONNX `Attention` operator (opset 23: torch's dynamo exporter writes SDPA so), which our
/// schema table (opset ≤ 21) does not hold. Autocast runs SDPA in the half type: Q, K, V and a
/// float mask are cast to it (onnxruntime's CUDA kernel takes a mask of Q's type or bool), the
/// output is half.
fn is_attention_operator(node: &NodeProto, opset: i64) -> bool {
    node.op_type() == "Attention" && matches!(node.domain(), "" | "ai.onnx") && opset >= 23
}

/// Output `j`'s type: the type its parameter was given by the inputs, Cast's `to`, CastLike's
/// target, or a fixed type; None where the inputs do not tell (the float32 graph's type then).
fn output_type(
    node: &NodeProto,
    schema: Option<&Schema>,
    j: usize,
    decided: &HashMap<String, i32>,
) -> Option<i32> {
    if node.op_type() == "Cast" && node.domain().is_empty() {
        return crate::onnx::attr_i(node, "to").map(|t| t as i32);
    }
    let p = schema?
        .outputs
        .get(j)
        .or_else(|| schema?.outputs.last().filter(|p| p.variadic))?;
    if let Some(&t) = decided.get(&p.type_str) {
        return Some(t);
    }
    let fixed = p
        .type_str
        .strip_prefix("tensor(")
        .and_then(|t| t.strip_suffix(')'))
        .or_else(|| schema?.fixed_type(&p.type_str))?;
    type_code(fixed)
}

/// An ONNX type name (`float`, `int64`, `bool`, ...) as its element type code.
fn type_code(name: &str) -> Option<i32> {
    let dt = match name {
        "float" => DataType::Float,
        "float16" => DataType::Float16,
        "bfloat16" => DataType::Bfloat16,
        "double" => DataType::Double,
        "bool" => DataType::Bool,
        "int64" => DataType::Int64,
        "int32" => DataType::Int32,
        "int8" => DataType::Int8,
        "uint8" => DataType::Uint8,
        "string" => DataType::String,
        _ => return None,
    };
    Some(dt as i32)
}

/// The value of a one-element float32 initializer (inline data).
fn single_f32(t: &TensorProto) -> Option<f32> {
    if t.dims.iter().product::<i64>() != 1 || !t.external_data.is_empty() {
        return None;
    }
    match t.raw_data.as_deref() {
        Some(r) if r.len() == 4 => Some(f32::from_le_bytes(r.try_into().ok()?)),
        _ => t.float_data.first().copied(),
    }
}

/// A one-value constant of the half type (rank 0).
fn half_scalar(name: &str, half: i32, v: f32) -> TensorProto {
    let bits = if half == FLOAT16 {
        half::f16::from_f32(v).to_bits()
    } else {
        half::bf16::from_f32(v).to_bits()
    };
    TensorProto {
        name: Some(name.into()),
        dims: vec![],
        data_type: Some(half),
        raw_data: Some(bits.to_le_bytes().to_vec().into()),
        ..Default::default()
    }
}

/// The value of a Constant node's one-element float32 value.
fn constant_scalar(node: &NodeProto) -> Option<f32> {
    let a = node.attribute.first()?;
    match a.name() {
        "value_float" => Some(a.f()),
        "value_floats" if a.floats.len() == 1 => Some(a.floats[0]),
        _ => {
            let t = attr(node, "value")?.t.as_ref()?;
            (t.data_type() == FLOAT).then(|| single_f32(t)).flatten()
        }
    }
}

//! The step graph's `ntl_step` metadata as one typed value: the contract between the step
//! graph and what runs it (docs/STEP_GRAPH.md). `passes::step` writes it, `tools`, `jobs` and
//! the passes that describe their own part read it through serde, and the Python package
//! mirrors it in `python/ntl_patch/_contract.py`.
//!
//! Plain data only, so every pass may import it (the lowest part of `passes`). Unknown keys
//! are ignored and every key but the five the first version wrote (`state`, `parameters`,
//! `lr_input`, `losses`, `data_inputs`) defaults, so graphs written by older and newer
//! versions load. Written through `serde_json::Value`, whose maps are sorted: the JSON keeps the key
//! order the metadata always had.

use serde::{Deserialize, Serialize};

use crate::onnx::ModelProto;

/// Metadata key of step graphs.
pub const STEP_METADATA_KEY: &str = "ntl_step";

/// The `ntl_step` metadata of a step graph, of a `--split` gradient graph and of its update
/// graph (each field's doc says which of them carry it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepMetadata {
    /// The ntl-patch version that wrote the graph.
    #[serde(default)]
    pub version: String,
    /// `[input, next output]` of every state tensor, in input order: each parameter then its
    /// optimizer slots, the step count, fp16's loss scale and growth tracker.
    pub state: Vec<(String, String)>,
    /// The trained parameters (initializer names), in the gradients' order.
    pub parameters: Vec<String>,
    /// Weights `--freeze` (or LoRA) keeps constant.
    #[serde(default)]
    pub frozen: Vec<String>,
    /// Float initializers on the loss path kept constant (buffers, exporter constants).
    #[serde(default)]
    pub buffers: Vec<String>,
    #[serde(default)]
    pub optimizer: Option<Optimizer>,
    /// The learning-rate input (float scalar, its initializer the `--lr` value).
    pub lr_input: String,
    /// The three loss outputs: the total, `ce_loss`, `number_loss`.
    pub losses: Vec<String>,
    /// The model's own data inputs.
    pub data_inputs: Vec<String>,
    /// A `--split` pair (gradient graph + update graph) rather than one step graph.
    #[serde(default)]
    pub split: bool,
    /// `fp32`, `fp16` or `bf16`.
    #[serde(default = "fp32")]
    pub precision: String,
    /// fp16's dynamic loss scaling (null otherwise).
    #[serde(default)]
    pub loss_scale: Option<LossScale>,
    /// fp16's bool output, true when a step found an inf/NaN gradient (null otherwise).
    #[serde(default)]
    pub skip_output: Option<String>,
    /// The step count's state input (int64 scalar). Absent from graphs written before it.
    #[serde(default)]
    pub step_input: Option<String>,
    /// fp16: the loss scale's state input (float32 scalar; null otherwise).
    #[serde(default)]
    pub loss_scale_input: Option<String>,
    /// `--max-grad-norm`: the tensor holding Σ‖g‖² over every gradient, which the clipping
    /// coefficient is computed from, in the graph holding the optimizer (the step graph, or
    /// the update graph of `--split`; null elsewhere). A sharded trainer feeds it the global
    /// sum.
    #[serde(default)]
    pub grad_norm_sq: Option<String>,
    /// fp16: the bool tensor that is true when any gradient holds an inf or NaN, in the graph
    /// holding the optimizer (null elsewhere). A sharded trainer feeds it the global flag.
    #[serde(default)]
    pub found_inf: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fused_head: Option<FusedHead>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<Lora>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantize_base: Option<QuantizeBase>,
    /// What `--recompute` did (the step graph and the gradient graph).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute: Option<Recompute>,
    /// What `--attention` did (the step graph and the gradient graph).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<Attention>,
    /// State inputs a runtime may overwrite with their next value (the step graph and the
    /// update graph).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_place: Option<Vec<String>>,
}

fn fp32() -> String {
    "fp32".into()
}

/// The optimizer and its options, torch's names (`ntl-patch step` writes every one; a graph
/// written by hand may leave those of the other optimizer null).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Optimizer {
    /// `adamw` or `sgd`.
    pub name: String,
    pub lr: f64,
    pub beta1: Option<f64>,
    pub beta2: Option<f64>,
    pub eps: Option<f64>,
    pub weight_decay: Option<f64>,
    pub momentum: Option<f64>,
    pub max_grad_norm: Option<f64>,
}

/// fp16's `torch.amp.GradScaler` options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossScale {
    pub init_scale: f64,
    pub growth_factor: f64,
    pub backoff_factor: f64,
    pub growth_interval: i64,
}

/// The fused LM head: what it reads, so a tool can compute the logits the graph no longer
/// holds (`Gemm(hidden, weight, bias, transB=trans_weight)`, then `logit_map`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FusedHead {
    pub chunk_tokens: i64,
    /// `[N, d]` hidden states in the cross-entropy's position order.
    pub hidden: String,
    pub weight: String,
    pub trans_weight: bool,
    /// Empty without a bias.
    pub bias: String,
    /// The cross-entropy's labels as the graph feeds them, and its class weights.
    pub labels: String,
    pub class_weights: Option<String>,
    /// What the graph did to the projection's output before the losses read it, in order
    /// (Gemma 2's soft-cap, Granite's scale): the logits are these steps of the `Gemm`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logit_map: Vec<MapStep>,
}

/// One step of a pointwise map (`passes::pointwise_map`): `z · c`, `z / c`, `tanh(z)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum MapStep {
    Mul(f32),
    Div(f32),
    Tanh,
}

/// LoRA's options as PEFT names them, and the adapted layers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lora {
    pub r: i64,
    pub lora_alpha: f64,
    pub scaling: f64,
    pub use_rslora: bool,
    pub lora_dropout: f64,
    pub target_modules: Vec<String>,
    pub init: String,
    pub seed: u64,
    pub bias: String,
    pub layers: Vec<LoraLayer>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraLayer {
    /// PEFT's module path; null where the export lost it.
    pub module: Option<String>,
    /// The base weight's initializer.
    pub weight: String,
    #[serde(rename = "lora_A")]
    pub lora_a: String,
    #[serde(rename = "lora_B")]
    pub lora_b: String,
    pub in_features: i64,
    pub out_features: i64,
    /// `out_in` (as nn.Linear) or `in_out` (stored transposed).
    pub weight_layout: String,
    pub fan_in_fan_out: bool,
}

/// QLoRA's quantised base.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantizeBase {
    pub quant_type: String,
    pub blocksize: i64,
    pub double_quant: bool,
    /// The code table (16 values for NF4; int8/int4 have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<Vec<f32>>,
    /// `double_quant`: the absmax codes' table (bitsandbytes' dynamic map, 256 values).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub absmax_code: Option<Vec<f32>>,
    /// `double_quant`: absmax codes per scale (256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub absmax_blocksize: Option<i64>,
    /// int8/int4: the largest code (127, 7); NF4 has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qmax: Option<i64>,
    pub bytes_before: u64,
    pub bytes_after: u64,
    pub layers: Vec<QuantizedLayer>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantizedLayer {
    pub weight: String,
    pub module: Option<String>,
    pub codes: String,
    /// NF4's per-block absmax (bitsandbytes' name): float32 `[blocks, 1]`, or with
    /// `double_quant` their uint8 codes `[blocks]` (as bitsandbytes' nested `QuantState.absmax`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub absmax: Option<String>,
    /// `double_quant`: the absmax codes' float32 scales `[ceil(blocks / 256), 1]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub absmax_scales: Option<String>,
    /// `double_quant`: the float32 scalar added back (the absmax' mean).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub absmax_offset: Option<String>,
    /// int8/int4's per-block scales.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scales: Option<String>,
    /// `[out, in]`.
    pub shape: [i64; 2],
    pub weight_layout: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recompute {
    pub mode: String,
    /// Blocks whose forward the backward recomputes (0: off).
    pub blocks: usize,
    pub layers: Option<String>,
    pub recomputed_nodes: usize,
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Attention {
    pub mode: String,
    pub block: i64,
    pub replaced: usize,
    pub left: Vec<LeftAttention>,
    pub reason: Option<String>,
    /// `--attention onnx`: how many forwards are the ONNX `Attention` operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fused: Option<usize>,
    /// `--attention onnx`: replaced attentions whose forward stays blockwise, and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blockwise_forward: Vec<LeftAttention>,
}

/// An attention left as exported: its Softmax node and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeftAttention {
    pub node: String,
    pub why: String,
}

impl StepMetadata {
    /// A model's `ntl_step` metadata: None where it has none, an error where it is not the
    /// contract's JSON.
    pub fn of(model: &ModelProto) -> Option<serde_json::Result<StepMetadata>> {
        let entry = model
            .metadata_props
            .iter()
            .find(|p| p.key() == STEP_METADATA_KEY)?;
        Some(serde_json::from_str(entry.value()))
    }

    /// The JSON text written into the graph: keys sorted, as `serde_json::Value` writes them.
    pub fn to_json_text(&self) -> String {
        serde_json::to_value(self)
            .expect("plain data serializes")
            .to_string()
    }

    /// The metadata entry of the graph.
    pub fn entry(&self) -> crate::onnx::StringStringEntryProto {
        crate::onnx::StringStringEntryProto {
            key: Some(STEP_METADATA_KEY.into()),
            value: Some(self.to_json_text()),
        }
    }
}

/// Whether a model carries step metadata at all (readable or not).
pub fn is_step_graph(model: &ModelProto) -> bool {
    model
        .metadata_props
        .iter()
        .any(|p| p.key() == STEP_METADATA_KEY)
}

//! QLoRA's frozen base (`ntl-patch step --lora-r R --quantize-base nf4|int8|int4`): the frozen
//! weights of the linear layers stored as bitsandbytes' NF4 codes or symmetric int8/int4 values
//! with per-block scales, and dequantised in the graph by standard ops.
//!
//! `quantize` runs right after LoRA: each chosen weight `W` (float32, or float16/bfloat16 widened
//! exactly to float32 first, as bitsandbytes' `quantize_4bit` does; stored inside the model or as
//! external data, read through the job's reader) is quantised in torch's
//! `[out, in]` order (`nf4.rs`, bit-equal to bitsandbytes 0.50's `quantize_4bit`), its
//! initializer replaced by `ntl/qlora/<W>.codes` (uint8, two codes a byte) and
//! `ntl/qlora/<W>.absmax` (float32 `[blocks, 1]`), and one shared chain of nodes at the top of
//! the graph gives back the float32 tensor named `W`:
//!
//! `Cast(codes → int32) → Gather([256, 2] byte → code-pair table) → Reshape [blocks, block]
//!  → Mul absmax → Reshape [out, in] (→ Transpose where the export stores [in, out])`
//!
//! `--double-quant` (`double_quant.rs`, bitsandbytes' `compress_statistics`) stores the absmax
//! quantised again (`<W>.absmax_codes` uint8, `<W>.absmax_scales`, `<W>.absmax_offset`), and the
//! chain starts with their dequantisation (`emit_absmax_chain`), which feeds the `Mul`.
//!
//! int8/int4 (`symmetric.rs`) store `ntl/qlora/<W>.codes` as int8/int4 `[blocks, block]` and
//! `ntl/qlora/<W>.scales` (float32 `[blocks]`), and the chain is
//!
//! `DequantizeLinear(codes, scales, axis 0) → Reshape [out, in] (→ Transpose)`
//!
//! the per-axis form, equal to opset 21's blocked one (`axis 1, block_size`) on `[out, in]`:
//! onnxruntime 1.19's QDQ propagation breaks the blocked form where a Transpose reads it
//! ("x_scale must be ceil(Di/block_size)"), and a weight that is a graph input is never fused
//! into MatMulNBits anyway.
//!
//! Either way every later stage sees the float32 graph it expects and nothing there trains. `per_use`
//! then (last, on the finished step graph) gives each reading node a copy of the chain of its
//! own, so no float copy of `W` lives from the forward to the backward.

mod double_quant;
mod nf4;
pub mod per_use;
mod rows;
mod symmetric;

use std::collections::{BTreeMap, BTreeSet, HashSet};

use crate::error::Error;
use crate::graph::patch::{splice, Splice, METADATA_KEY};
use crate::graph::GraphIndex;
use crate::onnx::{
    default_opset, int_attr, ints_attr, proto::tensor_proto::DataType, ModelProto, NodeProto,
    TensorProto, FLOAT, INT32,
};
/// The half types a weight may be exported in (widened exactly before it is quantised).
const FLOAT16: i32 = DataType::Float16 as i32;
const BFLOAT16: i32 = DataType::Bfloat16 as i32;
use crate::passes::contract;
use crate::passes::lora::linear::{embedding_tables, linear_layers, Layout, Linear};
use ntl_ops::names::PREFIX;
use ntl_ops::Builder;

pub const UINT8: i32 = DataType::Uint8 as i32;
pub const INT8: i32 = DataType::Int8 as i32;
pub const INT4: i32 = DataType::Int4 as i32;
/// The first IR version with int4 tensors.
const INT4_IR: i64 = 10;

/// `--quantize-base`: how the frozen weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// bitsandbytes' 4-bit NormalFloat.
    Nf4,
    /// Symmetric int4 blocks through DequantizeLinear (opset 21).
    Int4,
    /// Symmetric int8 blocks through DequantizeLinear (opset 13).
    Int8,
}

impl Scheme {
    pub fn name(self) -> &'static str {
        match self {
            Scheme::Nf4 => "nf4",
            Scheme::Int4 => "int4",
            Scheme::Int8 => "int8",
        }
    }

    /// The largest integer value of the symmetric schemes.
    fn qmax(self) -> Option<i8> {
        match self {
            Scheme::Nf4 => None,
            Scheme::Int4 => Some(7),
            Scheme::Int8 => Some(127),
        }
    }

    /// The stored codes' element type.
    fn codes_type(self) -> i32 {
        match self {
            Scheme::Nf4 => UINT8,
            Scheme::Int4 => INT4,
            Scheme::Int8 => INT8,
        }
    }

    /// The default opset the scheme's dequantisation needs (int4 tensors: 21).
    fn min_opset(self) -> i64 {
        match self {
            Scheme::Nf4 | Scheme::Int8 => 13,
            Scheme::Int4 => 21,
        }
    }
}

/// What the user chose.
#[derive(Debug, Clone)]
pub struct QuantizeOptions {
    pub scheme: Scheme,
    /// Values per block (bitsandbytes' `blocksize`).
    pub block: i64,
    /// `--quantize-targets`: module names (LoRA's matching); None: every linear layer but the
    /// LM head, as bitsandbytes' `load_in_4bit`.
    pub targets: Option<Vec<String>>,
    /// `--double-quant` (bitsandbytes' `compress_statistics`).
    pub double_quant: bool,
}

/// The largest block accepted (bitsandbytes' largest).
const MAX_BLOCK: i64 = 4096;

impl QuantizeOptions {
    pub fn check(&self) -> Result<(), Error> {
        let bad = |m: &str| Err(Error::Usage(m.to_string()));
        if self.block < 16 || self.block > MAX_BLOCK || self.block.count_ones() != 1 {
            return bad(
                "--quant-block must be a power of two from 16 to 4096 (bitsandbytes' default: 64)",
            );
        }
        if self.double_quant && self.scheme != Scheme::Nf4 {
            return Err(Error::Usage(format!(
                "--double-quant applies to --quantize-base nf4 only (bitsandbytes' compress_statistics); drop it for {}",
                self.scheme.name()
            )));
        }
        if let Some(t) = &self.targets {
            if t.is_empty() || t.iter().any(|s| s.trim().is_empty()) {
                return bad("--quantize-targets must name modules, comma-separated (e.g. --quantize-targets q_proj,v_proj,lm_head)");
            }
        }
        Ok(())
    }
}

/// One quantised weight.
#[derive(Debug, Clone)]
pub struct QuantizedWeight {
    /// The weight's name in the export: the chain's output.
    pub weight: String,
    pub module: Option<String>,
    pub codes: String,
    /// The per-block scales: NF4's absmax, int8/int4's `absmax / qmax`.
    pub scales: String,
    pub out_features: i64,
    pub in_features: i64,
    pub layout: Layout,
    /// Every tensor the shared chain computes, the weight last.
    pub chain: Vec<String>,
    /// `--double-quant`: the absmax are stored quantised (`scales` then names their codes, as
    /// `nested.codes`; no float32 absmax is stored).
    pub nested: Option<NestedAbsmax>,
    /// The float32 per-block factors the chain multiplies by (NF4: the stored absmax, or with
    /// `--double-quant` the chain's own dequantised absmax; int8/int4: `scales`).
    pub factors: String,
}

/// The initializers of one weight's quantised absmax (`--double-quant`, `double_quant.rs`).
#[derive(Debug, Clone)]
pub struct NestedAbsmax {
    /// uint8 `[blocks]`: one dynamic-map code per NF4 block.
    pub codes: String,
    /// float32 `[nested blocks, 1]`: one scale per 256 codes.
    pub scales: String,
    /// float32 scalar: the mean of the absmax.
    pub offset: String,
}

/// What `quantize` did.
#[derive(Debug, Clone)]
pub struct QuantizedBase {
    pub options: QuantizeOptions,
    pub weights: Vec<QuantizedWeight>,
    /// NF4's `[256, 2]` byte → code-pair table (a constant initializer).
    pub pair_table: Option<String>,
    /// The IR version the model was raised from (int4 needs 10), if it was.
    pub raised_ir: Option<i64>,
    /// Bytes of the quantised weights as the export stores them, and of their codes and scales.
    pub bytes_before: u64,
    pub bytes_after: u64,
}

impl QuantizedBase {
    /// Initializers the runtimes must not fold (declared graph inputs with defaults): the
    /// codes and scales, as (name, element type, dims).
    pub fn stored(&self) -> Vec<(String, i32, Vec<i64>)> {
        let block = self.options.block;
        let scheme = self.options.scheme;
        self.weights
            .iter()
            .flat_map(|w| {
                let n = w.out_features * w.in_features;
                let blocks = n / block;
                match (scheme, &w.nested) {
                    (Scheme::Nf4, None) => vec![
                        (w.codes.clone(), UINT8, vec![n / 2]),
                        (w.scales.clone(), FLOAT, vec![blocks, 1]),
                    ],
                    (Scheme::Nf4, Some(nested)) => vec![
                        (w.codes.clone(), UINT8, vec![n / 2]),
                        (nested.codes.clone(), UINT8, vec![blocks]),
                        (nested.scales.clone(), FLOAT, vec![nested_blocks(blocks), 1]),
                        (nested.offset.clone(), FLOAT, vec![]),
                    ],
                    (Scheme::Int4 | Scheme::Int8, _) => vec![
                        (w.codes.clone(), scheme.codes_type(), vec![blocks, block]),
                        (w.scales.clone(), FLOAT, vec![blocks]),
                    ],
                }
            })
            .collect()
    }

    /// The step graph's `quantize_base` metadata.
    pub fn to_meta(&self) -> contract::QuantizeBase {
        let layers = self
            .weights
            .iter()
            .map(|w| {
                // bitsandbytes' name where it is bitsandbytes' scheme; nested, its `absmax` is
                // the uint8 codes, as `QuantState.absmax`
                let (absmax, scales) = match (self.options.scheme, &w.nested) {
                    (Scheme::Nf4, None) => (Some(w.scales.clone()), None),
                    (Scheme::Nf4, Some(nested)) => (Some(nested.codes.clone()), None),
                    (Scheme::Int4 | Scheme::Int8, _) => (None, Some(w.scales.clone())),
                };
                contract::QuantizedLayer {
                    weight: w.weight.clone(),
                    module: w.module.clone(),
                    codes: w.codes.clone(),
                    absmax,
                    absmax_scales: w.nested.as_ref().map(|n| n.scales.clone()),
                    absmax_offset: w.nested.as_ref().map(|n| n.offset.clone()),
                    scales,
                    shape: [w.out_features, w.in_features],
                    weight_layout: w.layout.name().into(),
                }
            })
            .collect();
        let qmax = self.options.scheme.qmax().map(i64::from);
        contract::QuantizeBase {
            quant_type: self.options.scheme.name().into(),
            blocksize: self.options.block,
            double_quant: self.options.double_quant,
            code: qmax.is_none().then(|| nf4::NF4.to_vec()),
            absmax_code: self
                .options
                .double_quant
                .then(|| double_quant::dynamic_map().to_vec()),
            absmax_blocksize: self
                .options
                .double_quant
                .then_some(double_quant::NESTED_BLOCK as i64),
            qmax,
            bytes_before: self.bytes_before,
            bytes_after: self.bytes_after,
            layers,
        }
    }
}

/// The linear layers that produce the logits (the LM head): found walking back from the flat
/// logits the patch recorded through layout ops, casts and additions.
fn head_weights(index: &GraphIndex, model: &ModelProto, layers: &[Linear]) -> BTreeSet<String> {
    let flat = model
        .metadata_props
        .iter()
        .find(|p| p.key() == METADATA_KEY)
        .and_then(|p| serde_json::from_str::<serde_json::Value>(p.value()).ok())
        .and_then(|v| v["flat_logits"].as_str().map(str::to_string));
    let mut heads = BTreeSet::new();
    let Some(flat) = flat else {
        return heads;
    };
    const THROUGH: &[&str] = &[
        "Reshape",
        "Transpose",
        "Identity",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Cast",
        "Add",
    ];
    let mut seen = HashSet::new();
    let mut todo = vec![flat];
    while let Some(t) = todo.pop() {
        if !seen.insert(t.clone()) || seen.len() > 256 {
            continue;
        }
        let Some((i, n)) = index.producer(&t) else {
            continue;
        };
        if let Some(l) = layers.iter().find(|l| l.node == i) {
            heads.insert(l.weight.clone());
        } else if THROUGH.contains(&n.op_type()) && n.domain().is_empty() {
            todo.extend(n.input.iter().filter(|x| !x.is_empty()).cloned());
        }
    }
    heads
}

/// Reads the payload of a tensor stored as external data (the job's reader: passes read no
/// files).
pub type ReadExternal<'a> = &'a dyn Fn(&TensorProto) -> Result<Vec<u8>, Error>;

/// Bytes a value of a weight's element type takes (float32, float16, bfloat16).
fn value_bytes(t: &TensorProto) -> u64 {
    if t.data_type() == FLOAT {
        4
    } else {
        2
    }
}

/// A 2-D float initializer's values widened exactly to float32 (as bitsandbytes' CPU
/// `quantize_4bit` widens a half weight before it quantises), in torch's `[out, in]` order.
fn weight_values(
    t: &TensorProto,
    layer: &Linear,
    read_external: ReadExternal,
) -> Result<Vec<f32>, Error> {
    let name = t.name();
    let ty = t.data_type();
    if ty != FLOAT && ty != FLOAT16 && ty != BFLOAT16 {
        return Err(Error::Usage(format!(
            "--quantize-base: the weight '{name}' is {}, not float32, float16 or bfloat16; export the model's weights in one of those",
            crate::graph::elem_types::elem_type_name(ty).unwrap_or("of an unknown type")
        )));
    }
    let external;
    let raw = if t.data_location() as i32
        == crate::onnx::proto::tensor_proto::DataLocation::External as i32
    {
        external = read_external(t)?;
        Some(external.as_slice())
    } else {
        t.raw_data.as_deref().filter(|r| !r.is_empty())
    };
    let stored: Vec<f32> = match (raw, ty) {
        (Some(raw), FLOAT) => raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        (Some(raw), _) => raw
            .chunks_exact(2)
            .map(|c| half_to_f32(ty, u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        (None, FLOAT) => t.float_data.clone(),
        // ONNX keeps float16/bfloat16 bits in int32_data when there is no raw_data
        (None, _) => t
            .int32_data
            .iter()
            .map(|&bits| half_to_f32(ty, bits as u16))
            .collect(),
    };
    let (rows, cols) = (t.dims[0] as usize, t.dims[1] as usize);
    if stored.len() != rows * cols {
        return Err(Error::Usage(format!(
            "--quantize-base: the weight '{name}' holds {} values for dims {:?}",
            stored.len(),
            t.dims
        )));
    }
    if let Some(k) = stored.iter().position(|v| !v.is_finite()) {
        return Err(Error::Usage(format!(
            "--quantize-base: the weight '{name}' holds {} at flat index {k}; NF4 needs finite weights (fix the checkpoint)",
            stored[k]
        )));
    }
    Ok(match layer.layout {
        Layout::OutIn => stored,
        // [in, out] stored: torch's [out, in] is its transpose
        Layout::InOut => {
            let mut v = vec![0f32; stored.len()];
            for i in 0..rows {
                for o in 0..cols {
                    v[o * rows + i] = stored[i * cols + o];
                }
            }
            v
        }
    })
}

/// A float16 or bfloat16 value's bits, widened exactly.
fn half_to_f32(ty: i32, bits: u16) -> f32 {
    if ty == BFLOAT16 {
        f32::from_bits(u32::from(bits) << 16)
    } else {
        half::f16::from_bits(bits).to_f32()
    }
}

/// The layers `options` choose among `layers` (LoRA's adapters excluded) and, where
/// `--quantize-targets` names them, the embedding `tables`.
fn choose(
    index: &GraphIndex,
    model: &ModelProto,
    layers: Vec<Linear>,
    tables: Vec<Linear>,
    o: &QuantizeOptions,
) -> Result<Vec<Linear>, Error> {
    let layers: Vec<Linear> = layers
        .into_iter()
        .filter(|l| !l.weight.starts_with(&format!("{PREFIX}/")))
        .collect();
    let chosen: Vec<Linear> = match &o.targets {
        Some(targets) => {
            let candidates: Vec<Linear> = layers.into_iter().chain(tables).collect();
            for t in targets {
                if !candidates.iter().any(|l| l.matches(t.trim())) {
                    return Err(Error::Usage(format!(
                        "--quantize-targets '{}' matches no linear layer or embedding (module paths ending in '.{}'); name modules such as {}",
                        t.trim(),
                        t.trim(),
                        examples(&candidates)
                    )));
                }
            }
            candidates
                .into_iter()
                .filter(|l| targets.iter().any(|t| l.matches(t.trim())))
                .collect()
        }
        None => {
            let heads = head_weights(index, model, &layers);
            layers
                .into_iter()
                .filter(|l| !heads.contains(&l.weight))
                .collect()
        }
    };
    if chosen.is_empty() {
        return Err(Error::Usage(
            "--quantize-base found no linear layer to quantise besides the LM head; name layers with --quantize-targets".into(),
        ));
    }
    Ok(chosen)
}

fn examples(layers: &[Linear]) -> String {
    let names: BTreeSet<&str> = layers.iter().map(|l| l.key()).collect();
    let list: Vec<String> = names.iter().take(4).map(|n| format!("'{n}'")).collect();
    if list.is_empty() {
        "none found".into()
    } else {
        list.join(", ")
    }
}

/// Quantises the chosen frozen weights of `model` (see the module doc). Runs after LoRA.
pub fn quantize(
    model: &mut ModelProto,
    o: &QuantizeOptions,
    read_external: ReadExternal,
) -> Result<QuantizedBase, Error> {
    o.check()?;
    let opset = default_opset(model).expect("checked by the patch step");
    if opset < o.scheme.min_opset() {
        return Err(Error::Usage(format!(
            "--quantize-base {} needs opset {} or newer (DequantizeLinear with {} values), the model's default opset is {opset}; re-export with opset_version={} or use --quantize-base nf4",
            o.scheme.name(),
            o.scheme.min_opset(),
            o.scheme.name(),
            o.scheme.min_opset()
        )));
    }
    let graph = model.graph.as_ref().expect("loaded models have a graph");
    let index = GraphIndex::new(graph);
    let chosen = choose(
        &index,
        model,
        linear_layers(&index),
        embedding_tables(&index),
        o,
    )?;
    let mut b = Builder::new(PREFIX, opset, index.taken_names(PREFIX, &[]));
    drop(index);

    let by_name: BTreeMap<&str, &TensorProto> =
        graph.initializer.iter().map(|t| (t.name(), t)).collect();
    let block = o.block as usize;
    let table = match o.scheme {
        Scheme::Nf4 => Some(b.const_f32("qlora/nf4_pairs", &[256, 2], &nf4::pair_table())),
        Scheme::Int4 | Scheme::Int8 => None,
    };
    let dynamic_map = o
        .double_quant
        .then(|| b.const_f32("qlora/dynamic_map", &[256], &double_quant::dynamic_map()));
    let mut weights: Vec<QuantizedWeight> = Vec::new();
    let mut done: BTreeSet<String> = BTreeSet::new();
    let (mut before, mut after) = (0u64, 0u64);
    for layer in &chosen {
        if !done.insert(layer.weight.clone()) {
            continue;
        }
        let t = by_name[layer.weight.as_str()];
        let values = weight_values(t, layer, read_external)?;
        check_block(o, layer, values.len())?;
        let codes = claim(&mut b, format!("{PREFIX}/qlora/{}.codes", layer.weight))?;
        let scales_name = match o.scheme {
            Scheme::Nf4 if o.double_quant => "absmax_codes",
            Scheme::Nf4 => "absmax",
            Scheme::Int4 | Scheme::Int8 => "scales",
        };
        let scales = claim(
            &mut b,
            format!("{PREFIX}/qlora/{}.{scales_name}", layer.weight),
        )?;
        let nested = match o.double_quant {
            true => Some(NestedAbsmax {
                codes: scales.clone(),
                scales: claim(
                    &mut b,
                    format!("{PREFIX}/qlora/{}.absmax_scales", layer.weight),
                )?,
                offset: claim(
                    &mut b,
                    format!("{PREFIX}/qlora/{}.absmax_offset", layer.weight),
                )?,
            }),
            false => None,
        };
        let blocks = (values.len() / block) as i64;
        let (raw, scale_values, codes_dims, scale_dims) = match o.scheme.qmax() {
            None => {
                let q = nf4::quantize(&values, block);
                (
                    q.codes,
                    q.absmax,
                    vec![values.len() as i64 / 2],
                    vec![blocks, 1],
                )
            }
            Some(qmax) => {
                let q = symmetric::quantize(&values, block, qmax);
                let raw = match o.scheme {
                    Scheme::Int4 => symmetric::pack_int4(&q.q),
                    _ => symmetric::int8_bytes(&q.q),
                };
                (raw, q.scales, vec![blocks, o.block], vec![blocks])
            }
        };
        before += values.len() as u64 * value_bytes(t);
        after += raw.len() as u64;
        b.initializers.push(TensorProto {
            name: Some(codes.clone()),
            dims: codes_dims,
            data_type: Some(o.scheme.codes_type()),
            raw_data: Some(raw.into()),
            ..Default::default()
        });
        // the absmax the NF4 chain multiplies by: stored, or dequantised by a chain of its own
        let mut chain = Vec::new();
        let absmax = match (&nested, &dynamic_map) {
            (Some(names), Some(map)) => {
                let q = double_quant::quantize(&scale_values);
                after += q.codes.len() as u64 + (q.scales.len() as u64 + 1) * 4;
                let nested_dims = [q.scales.len() as i64, 1];
                b.initializers.push(TensorProto {
                    name: Some(names.codes.clone()),
                    dims: vec![blocks],
                    data_type: Some(UINT8),
                    raw_data: Some(q.codes.into()),
                    ..Default::default()
                });
                b.initializers.push(crate::onnx::f32_tensor(
                    &names.scales,
                    &nested_dims,
                    &q.scales,
                ));
                b.initializers
                    .push(crate::onnx::f32_tensor(&names.offset, &[], &[q.offset]));
                chain = emit_absmax_chain(&mut b, names, map, blocks);
                chain.last().expect("a chain has nodes").clone()
            }
            _ => {
                after += scale_values.len() as u64 * 4;
                b.initializers
                    .push(crate::onnx::f32_tensor(&scales, &scale_dims, &scale_values));
                scales.clone()
            }
        };
        chain.extend(match &table {
            Some(table) => emit_nf4_chain(&mut b, layer, &codes, &absmax, table, blocks, o.block),
            None => emit_dequantize_linear_chain(&mut b, layer, &codes, &scales),
        });
        weights.push(QuantizedWeight {
            weight: layer.weight.clone(),
            module: layer.module.as_ref().map(|(m, _)| m.clone()),
            codes,
            scales,
            out_features: layer.out_features,
            in_features: layer.in_features,
            layout: layer.layout,
            chain,
            nested,
            factors: absmax,
        });
    }
    let graph = model.graph.as_mut().expect("graph");
    graph.initializer.retain(|t| !done.contains(t.name()));
    graph.input.retain(|i| !done.contains(i.name()));
    graph.initializer.append(&mut b.initializers);
    splice(graph, Splice::insert(0, std::mem::take(&mut b.nodes)));
    // int4 tensors exist from IR version 10 on; older versions are raised, nothing else changes
    let ir = model.ir_version.unwrap_or(0);
    let raised_ir = (o.scheme == Scheme::Int4 && ir < INT4_IR).then(|| {
        model.ir_version = Some(INT4_IR);
        ir
    });
    Ok(QuantizedBase {
        options: o.clone(),
        weights,
        pair_table: table,
        raised_ir,
        bytes_before: before,
        bytes_after: after,
    })
}

/// The block must divide the weight: NF4's blocks run over the flattened `[out, in]` weight
/// (as bitsandbytes'), int8/int4's along each row (`in`), as DequantizeLinear's blocks do.
fn check_block(o: &QuantizeOptions, layer: &Linear, numel: usize) -> Result<(), Error> {
    let block = o.block;
    let (divides, what) = match o.scheme {
        Scheme::Nf4 => (numel.is_multiple_of(block as usize), "values"),
        Scheme::Int4 | Scheme::Int8 => (layer.in_features % block == 0, "input features"),
    };
    if divides {
        return Ok(());
    }
    let count = match o.scheme {
        Scheme::Nf4 => numel as i64,
        _ => layer.in_features,
    };
    Err(Error::Usage(format!(
        "--quant-block {block} does not divide the {count} {what} of '{}' ({} x {}); use a block size that divides every quantised weight's {what} (e.g. --quant-block 16)",
        layer.key(),
        layer.out_features,
        layer.in_features
    )))
}

/// The shared NF4 dequantisation chain of one weight, ending in the weight's own name; returns
/// every tensor it computes, the weight last.
fn emit_nf4_chain(
    b: &mut Builder,
    layer: &Linear,
    codes: &str,
    absmax: &str,
    table: &str,
    blocks: i64,
    block: i64,
) -> Vec<String> {
    let (idx, pairs) = look_up(b, codes, table, "qlora/idx", "qlora/pairs");
    let block_dims = b.const_i64("qlora/block_dims", &[2], &[blocks, block]);
    let in_blocks = b.binary("Reshape", &pairs, &block_dims, "qlora/blocks");
    let scaled = b.binary("Mul", &in_blocks, absmax, "qlora/scaled");
    let mut chain = vec![idx, pairs, in_blocks, scaled];
    finish_chain(b, layer, &mut chain);
    chain
}

/// Stored uint8 `codes` looked up in `table` (`Cast` to int32, `Gather` on axis 0); returns the
/// indices and the values.
fn look_up(
    b: &mut Builder,
    codes: &str,
    table: &str,
    idx_name: &str,
    values_name: &str,
) -> (String, String) {
    let idx = b.node(
        "Cast",
        &[codes],
        idx_name,
        vec![int_attr("to", INT32 as i64)],
    );
    let values = b.node(
        "Gather",
        &[table, &idx],
        values_name,
        vec![int_attr("axis", 0)],
    );
    (idx, values)
}

/// The blocks of 256 `--double-quant` stores `blocks` absmax codes in (the last possibly short).
fn nested_blocks(blocks: i64) -> i64 {
    (blocks as usize).div_ceil(double_quant::NESTED_BLOCK) as i64
}

/// The shared dequantisation of one weight's nested absmax (`double_quant.rs`), ending in the
/// float32 absmax `[blocks, 1]` the NF4 chain multiplies by; returns every tensor it computes:
///
/// `Cast(codes → int32) → Gather(dynamic map) (→ Pad to whole blocks of 256) → Reshape
///  [nested, 256] → Mul scales → Add offset → Reshape (→ Slice the real count) [blocks, 1]`
fn emit_absmax_chain(
    b: &mut Builder,
    nested: &NestedAbsmax,
    map: &str,
    blocks: i64,
) -> Vec<String> {
    let per_block = double_quant::NESTED_BLOCK as i64;
    let rows = nested_blocks(blocks);
    let padded = rows * per_block;
    let (idx, values) = look_up(
        b,
        &nested.codes,
        map,
        "qlora/absmax_idx",
        "qlora/absmax_values",
    );
    let mut chain = vec![idx, values.clone()];
    let mut whole = values;
    if padded > blocks {
        let pads = b.const_i64("qlora/absmax_pads", &[2], &[0, padded - blocks]);
        whole = b.binary("Pad", &whole, &pads, "qlora/absmax_padded");
        chain.push(whole.clone());
    }
    let grid_dims = b.const_i64("qlora/absmax_grid", &[2], &[rows, per_block]);
    let grid = b.binary("Reshape", &whole, &grid_dims, "qlora/absmax_grid");
    let scaled = b.binary("Mul", &grid, &nested.scales, "qlora/absmax_scaled");
    let shifted = b.binary("Add", &scaled, &nested.offset, "qlora/absmax_shifted");
    chain.extend([grid, scaled, shifted.clone()]);
    let column = b.const_i64("qlora/absmax_column", &[2], &[padded, 1]);
    let flat = b.binary("Reshape", &shifted, &column, "qlora/absmax");
    chain.push(flat.clone());
    if padded > blocks {
        let zero = b.const_i64("qlora/absmax_start", &[1], &[0]);
        let end = b.const_i64("qlora/absmax_end", &[1], &[blocks]);
        let axis = b.const_i64("qlora/absmax_axis", &[1], &[0]);
        let real = b.node(
            "Slice",
            &[&flat, &zero, &end, &axis],
            "qlora/absmax",
            vec![],
        );
        chain.push(real);
    }
    chain
}

/// The shared int8/int4 chain: DequantizeLinear per block row (`[blocks, block]`, one scale a
/// row, no zero point), then the weight's shape.
fn emit_dequantize_linear_chain(
    b: &mut Builder,
    layer: &Linear,
    codes: &str,
    scales: &str,
) -> Vec<String> {
    let dq = b.node(
        "DequantizeLinear",
        &[codes, scales],
        "qlora/dequantized",
        vec![int_attr("axis", 0)],
    );
    let mut chain = vec![dq];
    finish_chain(b, layer, &mut chain);
    chain
}

/// `[blocks, block]` float32 (the chain's last tensor) into the weight as the export stores it;
/// appends the tensors made, the weight last.
fn finish_chain(b: &mut Builder, layer: &Linear, chain: &mut Vec<String>) {
    let out_in = b.const_i64(
        "qlora/out_in",
        &[2],
        &[layer.out_features, layer.in_features],
    );
    let last = chain.last().expect("a chain has nodes").clone();
    match layer.layout {
        Layout::OutIn => {
            b.node_to("Reshape", &[&last, &out_in], &[&layer.weight], vec![]);
        }
        Layout::InOut => {
            let w = b.binary("Reshape", &last, &out_in, "qlora/out_in_w");
            b.node_to(
                "Transpose",
                &[&w],
                &[&layer.weight],
                vec![ints_attr("perm", &[1, 0])],
            );
            chain.push(w);
        }
    }
    chain.push(layer.weight.clone());
}

fn claim(b: &mut Builder, name: String) -> Result<String, Error> {
    if b.claim(&name) {
        Ok(name)
    } else {
        Err(Error::OutputNameTaken(name))
    }
}

/// Whether `node` is one of the shared chains' nodes (its output is one of their tensors).
pub(crate) fn is_chain_node(node: &NodeProto, chain: &HashSet<&str>) -> bool {
    node.output.len() == 1 && chain.contains(node.output[0].as_str())
}

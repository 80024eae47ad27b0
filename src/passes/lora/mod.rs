//! LoRA (`ntl-patch step --lora-r R`): Hugging Face PEFT's low-rank adapters inserted into the
//! exported graph's linear layers, so that only the adapters train.
//!
//! Each targeted linear layer `y = x·Wᵀ (+ b)` becomes `y + (x·Aᵀ·Bᵀ)·s`, `A` `[r, in]`,
//! `B` `[out, r]`, `s = lora_alpha / r` (rsLoRA: `lora_alpha / √r`) — PEFT's `Linear.forward`
//! without dropout. `A` starts as nn.Linear's Kaiming-uniform (a = √5: `U(±1/√in)`), `B` as
//! zeros, so the adapted model starts equal to the base. `A` and `B` are new float32
//! initializers (`ntl/lora/<module>.lora_A.weight`); the base weights stay as they are.
//! The step graph's metadata (`lora`) records each layer for the runners' PEFT files.

pub mod linear;

use std::collections::{BTreeMap, BTreeSet};

use crate::error::Error;
use crate::graph::{patch, GraphIndex};
use crate::onnx::{default_opset, ints_attr, ModelProto, NodeProto};
use crate::passes::contract;
use linear::{linear_layers, Linear};
use ntl_ops::names::PREFIX;
use ntl_ops::Builder;

/// What the user chose: PEFT's `LoraConfig` fields, and the seed of `A`'s initialisation.
#[derive(Debug, Clone)]
pub struct LoraOptions {
    pub r: i64,
    pub alpha: f64,
    /// Module names (`q_proj`); None: PEFT's default for the architecture the names show.
    pub targets: Option<Vec<String>>,
    pub use_rslora: bool,
    pub dropout: f64,
    pub seed: u64,
}

/// The largest rank accepted: far beyond any adapter anyone trains, small enough that `r`
/// times a layer's width cannot overflow.
const MAX_R: i64 = 1 << 20;

/// An adapter (`r·(in + out)` values) may be at most this many times its weight (`in·out`).
const MAX_ADAPTER_RATIO: i64 = 8;

impl LoraOptions {
    pub fn scaling(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    #[allow(clippy::neg_cmp_op_on_partial_ord)] // NaN must fail too
    pub fn check(&self) -> Result<(), Error> {
        let bad = |m: &str| Err(Error::Usage(m.to_string()));
        if !(1..=MAX_R).contains(&self.r) {
            return bad("--lora-r must be a whole number from 1 (e.g. --lora-r 16)");
        }
        if !(self.alpha > 0.0 && self.alpha.is_finite() && (self.scaling() as f32).is_normal()) {
            return bad("--lora-alpha must be a finite number > 0 (PEFT's default: 8)");
        }
        if !(self.dropout >= 0.0 && self.dropout < 1.0) {
            return bad("--lora-dropout must be in [0, 1)");
        }
        if self.dropout > 0.0 {
            return bad("--lora-dropout > 0 is not built yet (the step graph has no seed input for the dropout mask); use --lora-dropout 0");
        }
        if let Some(t) = &self.targets {
            if t.is_empty() || t.iter().any(|s| s.trim().is_empty()) {
                return bad("--lora-targets must name modules, comma-separated (e.g. --lora-targets q_proj,v_proj)");
            }
        }
        Ok(())
    }
}

/// One adapted layer (a weight may be read by several linear nodes; they share the adapter).
#[derive(Debug, Clone)]
pub struct Adapter {
    pub layer: Linear,
    pub a: String,
    pub b: String,
}

/// What `insert` did.
#[derive(Debug, Clone)]
pub struct Adapted {
    pub targets: Vec<String>,
    pub adapters: Vec<Adapter>,
    pub scaling: f64,
}

impl Adapted {
    /// The trained parameters LoRA adds.
    pub fn parameters(&self) -> BTreeSet<String> {
        self.adapters
            .iter()
            .flat_map(|a| [a.a.clone(), a.b.clone()])
            .collect()
    }

    /// The step graph's `lora` metadata (docs/STEP_GRAPH.md, read by the Python runners).
    pub fn to_meta(&self, o: &LoraOptions) -> contract::Lora {
        let layers = self
            .adapters
            .iter()
            .map(|a| {
                let l = &a.layer;
                contract::LoraLayer {
                    module: l.module.as_ref().map(|(m, _)| m.clone()),
                    weight: l.weight.clone(),
                    lora_a: a.a.clone(),
                    lora_b: a.b.clone(),
                    in_features: l.in_features,
                    out_features: l.out_features,
                    weight_layout: l.layout.name().into(),
                    fan_in_fan_out: l.fan_in_fan_out(),
                }
            })
            .collect();
        contract::Lora {
            r: o.r,
            lora_alpha: o.alpha,
            scaling: self.scaling,
            use_rslora: o.use_rslora,
            lora_dropout: o.dropout,
            target_modules: self.targets.clone(),
            init: "peft".into(),
            seed: o.seed,
            bias: "none".into(),
            layers,
        }
    }
}

/// PEFT's default targets for the architectures whose module names show them (its
/// `TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`, keyed here by the names present).
const DEFAULT_TARGETS: &[(&str, &[&str])] = &[
    ("Llama, Qwen2, Mistral, Gemma, OPT", &["q_proj", "v_proj"]),
    ("GPT-2", &["c_attn"]),
    ("GPT-NeoX, BLOOM, Falcon", &["query_key_value"]),
    ("BERT, RoBERTa", &["query", "value"]),
    ("Phi-3", &["qkv_proj"]),
];

fn default_targets(layers: &[Linear]) -> Result<Vec<String>, Error> {
    for (_, targets) in DEFAULT_TARGETS {
        if targets
            .iter()
            .all(|t| layers.iter().any(|l| l.module.is_some() && l.matches(t)))
        {
            return Ok(targets.iter().map(|t| t.to_string()).collect());
        }
    }
    Err(Error::Usage(format!(
        "the module names do not show an architecture with a PEFT default for LoRA targets (linear layers such as {}); name them with --lora-targets (e.g. --lora-targets q_proj,v_proj)",
        examples(layers)
    )))
}

/// A few linear layers' names, for errors.
fn examples(layers: &[Linear]) -> String {
    let names: BTreeSet<&str> = layers.iter().map(|l| l.key()).collect();
    if names.is_empty() {
        return "none found".into();
    }
    let mut list: Vec<String> = names.iter().take(4).map(|n| format!("'{n}'")).collect();
    if names.len() > 4 {
        list.push(format!("… {} in all", names.len()));
    }
    list.join(", ")
}

/// A target that matches a module whose weight is no linear layer's: PEFT refuses such a
/// module; so do we, naming it.
fn check_not_linear(
    model: &ModelProto,
    layers: &[Linear],
    targets: &[String],
) -> Result<(), Error> {
    let graph = model.graph.as_ref().expect("loaded models have a graph");
    let linear: BTreeSet<&str> = layers.iter().map(|l| l.weight.as_str()).collect();
    for t in &graph.initializer {
        let name = t.name();
        if linear.contains(name) || name.starts_with(&format!("{PREFIX}/")) {
            continue;
        }
        let Some(module) = name.strip_suffix(".weight") else {
            continue;
        };
        if let Some(target) = targets
            .iter()
            .find(|tg| module == tg.as_str() || module.ends_with(&format!(".{tg}")))
        {
            return Err(Error::Usage(format!(
                "--lora-targets '{target}' matches '{name}' (dims {:?}), which no linear layer reads (MatMul or Gemm with a 2-D weight); LoRA adapts linear layers: name those",
                t.dims
            )));
        }
    }
    Ok(())
}

/// The names `--lora-targets` can take in `graph`: the last part of each linear layer's
/// module path (`q_proj`), in order of first appearance.
pub fn target_names(index: &GraphIndex) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for l in linear_layers(index) {
        if let Some((m, _)) = &l.module {
            let last = m.rsplit('.').next().unwrap_or(m).to_string();
            if !names.contains(&last) {
                names.push(last);
            }
        }
    }
    names
}

/// Inserts the adapters into `model` (see the module doc).
pub fn insert(model: &mut ModelProto, o: &LoraOptions) -> Result<Adapted, Error> {
    o.check()?;
    let opset = default_opset(model).expect("checked by the patch step");
    let graph = model.graph.as_ref().expect("loaded models have a graph");
    let index = GraphIndex::new(graph);
    let layers = linear_layers(&index);
    let targets = match &o.targets {
        Some(t) => t.iter().map(|s| s.trim().to_string()).collect(),
        None => default_targets(&layers)?,
    };
    for t in &targets {
        if !layers.iter().any(|l| l.matches(t)) {
            check_not_linear(model, &layers, std::slice::from_ref(t))?;
            return Err(Error::Usage(format!(
                "--lora-targets '{t}' matches no linear layer (linear layers: {}); PEFT matches a module path ending in '.{t}'",
                examples(&layers)
            )));
        }
    }
    check_not_linear(model, &layers, &targets)?;
    let chosen: Vec<Linear> = layers
        .into_iter()
        .filter(|l| targets.iter().any(|t| l.matches(t)))
        .collect();
    // PEFT allows a rank past a layer's sides (the tests use r 64 on 16-wide layers); the
    // adapters' memory stays bounded by the weights' all the same
    let largest = |l: &Linear| {
        let (i, o) = (l.in_features as i128, l.out_features as i128);
        (MAX_ADAPTER_RATIO as i128 * i * o / (i + o)).min(MAX_R as i128) as i64
    };
    if let Some(l) = chosen.iter().find(|l| o.r > largest(l)) {
        return Err(Error::Usage(format!(
            "--lora-r {} makes the adapter of '{}' ({} -> {}) over {MAX_ADAPTER_RATIO}x the size of its weight; use --lora-r {} or less",
            o.r,
            l.key(),
            l.in_features,
            l.out_features,
            largest(l)
        )));
    }
    let mut b = Builder::new(PREFIX, opset, index.taken_names(PREFIX, &[]));
    let consumers: BTreeMap<String, Vec<usize>> = layers_outputs(&index, &chosen);
    drop(index);

    // one adapter per weight, in node order
    let mut adapters: Vec<Adapter> = Vec::new();
    let mut by_weight: BTreeMap<String, usize> = BTreeMap::new();
    let scaling = o.scaling();
    let s = b.scalar_f32("lora/scaling", scaling as f32);
    let mut after: BTreeMap<usize, Vec<NodeProto>> = BTreeMap::new();
    let mut renamed: Vec<(usize, String)> = Vec::new();
    let graph = model.graph.as_ref().expect("graph");
    for layer in chosen {
        let k = match by_weight.get(&layer.weight) {
            Some(&k) => k,
            None => {
                let key = layer.key().to_string();
                let a = claim(&mut b, format!("{PREFIX}/lora/{key}.lora_A.weight"))?;
                let bn = claim(&mut b, format!("{PREFIX}/lora/{key}.lora_B.weight"))?;
                let seed = o.seed ^ (adapters.len() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                b.initializers.push(crate::onnx::f32_tensor(
                    &a,
                    &[o.r, layer.in_features],
                    &kaiming_uniform(seed, o.r, layer.in_features),
                ));
                let zeros = vec![0f32; (layer.out_features * o.r) as usize];
                b.initializers.push(crate::onnx::f32_tensor(
                    &bn,
                    &[layer.out_features, o.r],
                    &zeros,
                ));
                by_weight.insert(layer.weight.clone(), adapters.len());
                adapters.push(Adapter {
                    layer: layer.clone(),
                    a,
                    b: bn,
                });
                adapters.len() - 1
            }
        };
        let node = &graph.node[layer.node];
        let x = node.input[0].clone();
        // PEFT adds the adapter to the base layer's output, bias included
        let end = bias_add(graph, &consumers, layer.node).unwrap_or(layer.node);
        let y = graph.node[end].output[0].clone();
        let base = b.fresh("lora/base");
        renamed.push((end, base.clone()));
        let ad = &adapters[k];
        let start = b.nodes.len();
        let at = b.node(
            "Transpose",
            &[&ad.a],
            "lora/A_t",
            vec![ints_attr("perm", &[1, 0])],
        );
        let bt = b.node(
            "Transpose",
            &[&ad.b],
            "lora/B_t",
            vec![ints_attr("perm", &[1, 0])],
        );
        let xa = b.binary("MatMul", &x, &at, "lora/xA");
        let xab = b.binary("MatMul", &xa, &bt, "lora/xAB");
        let scaled = b.binary("Mul", &xab, &s, "lora/scaled");
        b.node_to("Add", &[&base, &scaled], &[&y], vec![]);
        after.insert(end, b.nodes.drain(start..).collect());
    }
    // each adapted layer writes its base output; the adapter's Add writes the name it wrote
    let graph = model.graph.as_ref().expect("graph");
    let mut replace = BTreeMap::new();
    for (i, base) in renamed {
        let mut node = graph.node[i].clone();
        node.output[0] = base;
        let mut nodes = vec![node];
        nodes.extend(after.remove(&i).unwrap_or_default());
        replace.insert(i, nodes);
    }
    patch::splice(
        model.graph.as_mut().expect("graph"),
        patch::Splice::replace(replace),
    );
    let graph = model.graph.as_mut().expect("graph");
    graph.initializer.append(&mut b.initializers);
    Ok(Adapted {
        targets,
        adapters,
        scaling,
    })
}

/// The consumers of each chosen layer's output.
fn layers_outputs(index: &GraphIndex, chosen: &[Linear]) -> BTreeMap<String, Vec<usize>> {
    chosen
        .iter()
        .map(|l| {
            let y = &index.graph.node[l.node].output[0];
            (y.clone(), index.consumers(y).to_vec())
        })
        .collect()
}

/// The `Add` of a 1-D bias initializer that is the only reader of a MatMul's output (nn.Linear
/// through the exporters: `MatMul` + `Add`).
fn bias_add(
    graph: &crate::onnx::GraphProto,
    consumers: &BTreeMap<String, Vec<usize>>,
    node: usize,
) -> Option<usize> {
    let n = &graph.node[node];
    if n.op_type() != "MatMul" {
        return None;
    }
    let readers = consumers.get(&n.output[0])?;
    let [only] = readers.as_slice() else {
        return None;
    };
    let add = &graph.node[*only];
    if add.op_type() != "Add" || !add.domain().is_empty() || add.input.len() != 2 {
        return None;
    }
    let other = add.input.iter().find(|i| **i != n.output[0])?;
    graph
        .initializer
        .iter()
        .any(|t| t.name() == other && t.dims.len() == 1)
        .then_some(*only)
}

fn claim(b: &mut Builder, name: String) -> Result<String, Error> {
    if b.claim(&name) {
        Ok(name)
    } else {
        Err(Error::OutputNameTaken(name))
    }
}

/// nn.Linear's default initialisation of a `[rows, fan_in]` weight — Kaiming-uniform with
/// a = √5, i.e. `U(−1/√fan_in, 1/√fan_in)` — from a SplitMix64 stream (deterministic on every
/// platform; torch's generator is not reproduced, the values are read from the graph).
fn kaiming_uniform(seed: u64, rows: i64, fan_in: i64) -> Vec<f32> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    let mut state = seed;
    (0..rows * fan_in)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
            ((2.0 * u - 1.0) * bound) as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kaiming_uniform_stays_in_bounds_and_is_deterministic() {
        let a = kaiming_uniform(7, 4, 100);
        assert_eq!(a, kaiming_uniform(7, 4, 100));
        assert_ne!(a, kaiming_uniform(8, 4, 100));
        assert!(a.iter().all(|v| v.abs() <= 0.1));
        let mean = a.iter().map(|&v| v as f64).sum::<f64>() / a.len() as f64;
        let var = a.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / a.len() as f64;
        // U(±0.1) has variance 0.01/3
        assert!((var - 0.01 / 3.0).abs() < 0.001, "{var}");
    }

    #[test]
    fn scaling_is_peft_s() {
        let mut o = LoraOptions {
            r: 16,
            alpha: 8.0,
            targets: None,
            use_rslora: false,
            dropout: 0.0,
            seed: 0,
        };
        assert_eq!(o.scaling(), 0.5);
        o.use_rslora = true;
        assert_eq!(o.scaling(), 2.0);
    }
}

//! `ntl-patch inspect`: what the patcher would see in a model.

use std::path::Path;

use crate::ce::site::{find_ce_sites, nested_ce_nodes};
use crate::error::Error;
use crate::graph::GraphIndex;
use crate::io::model_io::{external_locations, load_model};
use crate::onnx::default_opset;
use crate::passes::contract::{Lora, QuantizeBase, StepMetadata};
use crate::passes::pipeline::{logits_width, site_label};
use crate::text::escape as esc;

pub fn inspect(path: &Path, json: bool) -> Result<String, Error> {
    let model = load_model(path)?;
    // the matchers walk producers: a cycle or a tensor produced twice would loop them
    crate::graph::patch::check_consistency(&model).map_err(Error::MalformedGraph)?;
    // what the patch sees: spelled-out cross-entropies rewritten first (in a copy)
    let index = GraphIndex::new(model.graph.as_ref().expect("checked on load"));
    let opset = default_opset(&model);
    let rewritten = crate::ce::forms::plan(&index, opset.unwrap_or(ntl_ops::builder::MIN_OPSET))
        .and_then(|rewrite| {
            let mut seen = model.clone();
            rewrite.apply(&mut seen).ok().map(|_| seen)
        });
    let index = match &rewritten {
        Some(seen) => GraphIndex::new(seen.graph.as_ref().expect("checked on load")),
        None => index,
    };
    let sites = find_ce_sites(&index);
    let external = external_locations(&model);
    let mut files: Vec<&str> = external.iter().map(|(_, l)| l.as_str()).collect();
    files.sort();
    files.dedup();
    let patched = crate::passes::pipeline::refuse_patched(&model, path).is_err();
    let ir = model.ir_version();
    // a LoRA step graph's adapted layers; for any other model, what --lora-targets can name
    let lora = step_lora(&model);
    let quantized = step_quantized_base(&model);
    let lora_targets = crate::passes::lora::target_names(&index);

    let site_rows: Vec<(String, String, String, String, String, Option<usize>)> = sites
        .iter()
        .map(|s| {
            (
                site_label(s),
                s.pattern.describe().to_string(),
                s.scores.clone(),
                s.labels.clone(),
                s.reduction.clone(),
                logits_width(&index, s, None).ok(),
            )
        })
        .collect();

    if json {
        let sites_json: Vec<serde_json::Value> = site_rows
            .iter()
            .map(|(n, p, sc, l, r, w)| {
                serde_json::json!({"node": n, "pattern": p, "scores": sc, "labels": l, "reduction": r, "vocab_width": w})
            })
            .collect();
        let mut v = serde_json::json!({
            "model": path.display().to_string(),
            "ir_version": ir,
            "opset": opset,
            "cross_entropy": sites_json,
            "nested_cross_entropy": nested_ce_nodes(&index),
            "external_data_tensors": external.len(),
            "external_data_files": files,
            "already_patched": patched,
            "lora": lora,
            "lora_targets": lora_targets,
        });
        if let Some(q) = &quantized {
            // only QLoRA graphs carry the key: every other model's JSON stays as it was
            v["quantize_base"] = serde_json::to_value(q).expect("plain data");
        }
        return Ok(serde_json::to_string_pretty(&v).expect("json"));
    }
    let mut out = format!(
        "model: {}\nIR version: {ir}\ndefault opset: {}\n",
        esc(&path.display().to_string()),
        opset.map_or("none".into(), |o| o.to_string())
    );
    if site_rows.is_empty() {
        out.push_str("cross-entropy: none found\n");
    }
    for (n, p, sc, l, r, w) in &site_rows {
        let (n, sc, l, r) = (esc(n), esc(sc), esc(l), esc(r));
        out.push_str(&format!(
            "cross-entropy: {n} ({p})\n  scores: {sc}\n  labels: {l}\n  reduction: {r}\n  vocab width: {}\n",
            w.map_or("symbolic (pass --vocab-size)".into(), |w| w.to_string())
        ));
    }
    for n in nested_ce_nodes(&index) {
        out.push_str(&format!(
            "cross-entropy inside a subgraph (not patched): {}\n",
            esc(&n)
        ));
    }
    out.push_str(&format!(
        "external data: {} tensor(s) in {} file(s){}\n",
        external.len(),
        files.len(),
        if files.is_empty() {
            String::new()
        } else {
            format!(": {}", esc(&files.join(", ")))
        }
    ));
    out.push_str(&format!(
        "already patched by ntl-patch: {}\n",
        if patched { "yes" } else { "no" }
    ));
    match &lora {
        Some(l) => out.push_str(&lora_text(l)),
        None if !lora_targets.is_empty() => out.push_str(&format!(
            "LoRA targets (its linear layers, for --lora-targets): {}\n",
            esc(&lora_targets.join(", "))
        )),
        None => {}
    }
    if let Some(q) = &quantized {
        out.push_str(&quantized_text(q));
    }
    Ok(out)
}

/// The `quantize_base` entry of a QLoRA step graph's metadata, if any.
fn step_quantized_base(model: &crate::onnx::ModelProto) -> Option<QuantizeBase> {
    StepMetadata::of(model)?.ok()?.quantize_base
}

/// A number as the metadata's JSON writes it (`32.0`, not `32`).
fn json_number(x: f64) -> String {
    serde_json::Value::from(x).to_string()
}

fn quantized_text(q: &QuantizeBase) -> String {
    let mut out = format!(
        "quantised base: {} in blocks of {}{}, {} layer(s), {} bytes before, {} after:\n",
        q.quant_type,
        q.blocksize,
        if q.double_quant {
            " (double quantisation)"
        } else {
            ""
        },
        q.layers.len(),
        q.bytes_before,
        q.bytes_after
    );
    for x in &q.layers {
        let module = x.module.as_deref().unwrap_or("(no module path)");
        out.push_str(&format!(
            "  {} <- {} [{} x {}]\n",
            esc(module),
            esc(&x.weight),
            x.shape[0],
            x.shape[1]
        ));
    }
    out
}

/// The `lora` entry of a step graph's metadata, if any.
fn step_lora(model: &crate::onnx::ModelProto) -> Option<Lora> {
    StepMetadata::of(model)?.ok()?.lora
}

fn lora_text(l: &Lora) -> String {
    let mut out = format!(
        "LoRA: r={} alpha={} scaling={}{}, {} adapted layer(s):\n",
        l.r,
        json_number(l.lora_alpha),
        json_number(l.scaling),
        if l.use_rslora { " (rsLoRA)" } else { "" },
        l.layers.len()
    );
    for x in &l.layers {
        let module = x.module.as_deref().unwrap_or("(no module path)");
        out.push_str(&format!(
            "  {} <- {} [{} -> {}]\n",
            esc(module),
            esc(&x.weight),
            x.in_features,
            x.out_features
        ));
    }
    out
}

/// `inspect` plus, for each GPU target, whether that ONNX Runtime release's provider takes every
/// node (`crate::tools::gpu_kernels`). JSON: the inspect object with a `gpu` array.
pub fn inspect_targets(
    path: &Path,
    json: bool,
    targets: &[crate::tools::gpu_kernels::Target],
) -> Result<String, Error> {
    let base = inspect(path, json)?;
    if targets.is_empty() {
        return Ok(base);
    }
    let model = load_model(path)?;
    let reports: Vec<_> = targets
        .iter()
        .map(|&t| crate::tools::gpu_kernels::check_model(&model, t))
        .collect();
    if json {
        let mut v: serde_json::Value = serde_json::from_str(&base).expect("inspect writes JSON");
        v["gpu"] = reports.iter().map(|r| r.to_json()).collect();
        return Ok(serde_json::to_string_pretty(&v).expect("json"));
    }
    let mut out = base;
    for r in &reports {
        out.push_str(&r.to_text());
    }
    Ok(out.trim_end().to_string())
}

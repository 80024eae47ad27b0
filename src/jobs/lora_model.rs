//! `ntl-patch lora-model MODEL --step STEP`: the inference model that runs a LoRA step graph's
//! adapters as inputs — MODEL (the export the step graph was made from, or another export of
//! the same model that keeps its names, e.g. a logits-only one) with the same adapters
//! inserted, each `A` and `B` a graph input under the step graph's parameter name. Their
//! defaults are the step graph's initial values (`B` zeros: without an adapter the model is
//! the base), so onnxruntime's `RunOptions.add_active_adapter` with an `.onnx_adapter` of the
//! trained values (the Python runners' `save_onnx_adapter`) switches adapters per request.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::error::Error;
use crate::io::model_io::{
    check_external_data, load_model, load_model_source, model_dir, plan_external_data, same_file,
    save_model_from,
};
use crate::passes::contract::{is_step_graph, StepMetadata};
use crate::passes::lora::{insert, LoraOptions};
use crate::passes::step::tensor_info;

pub struct ServingRequest {
    pub model: PathBuf,
    pub step: PathBuf,
    pub output: Option<PathBuf>,
    pub copy_external_data: bool,
}

pub struct ServingSummary {
    pub output: PathBuf,
    /// The adapter inputs (A and B of each layer), in input order.
    pub inputs: Vec<String>,
}

/// `model.onnx` → `model.lora.onnx` beside it.
pub fn default_output(model: &Path) -> PathBuf {
    let stem = model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    model_dir(model).join(format!("{stem}.lora.onnx"))
}

/// The LoRA options a step graph was written with, from its metadata.
fn step_options(step: &Path) -> Result<(LoraOptions, Vec<String>), Error> {
    let m = load_model(step)?;
    let usage = |why: &str| {
        Error::Usage(format!(
            "'{}' {why}; give the LoRA step graph (`ntl-patch step MODEL --lora-r R`)",
            step.display()
        ))
    };
    let meta = StepMetadata::of(&m)
        .ok_or_else(|| usage("is not a step graph"))?
        .map_err(|_| usage("has unreadable step metadata"))?;
    let l = meta.lora.ok_or_else(|| usage("has no LoRA adapters"))?;
    let o = LoraOptions {
        r: l.r,
        alpha: l.lora_alpha,
        targets: Some(l.target_modules),
        use_rslora: l.use_rslora,
        dropout: 0.0,
        seed: l.seed,
    };
    let names: Vec<String> = l
        .layers
        .into_iter()
        .flat_map(|x| [x.lora_a, x.lora_b])
        .collect();
    Ok((o, names))
}

pub fn run_lora_model(req: &ServingRequest) -> Result<ServingSummary, Error> {
    let output = req
        .output
        .clone()
        .unwrap_or_else(|| default_output(&req.model));
    if same_file(&req.model, &output) || same_file(&req.step, &output) {
        return Err(Error::OutputIsInput(output));
    }
    let (o, wanted) = step_options(&req.step)?;
    let (mut model, source) = load_model_source(&req.model)?;
    if is_step_graph(&model) {
        return Err(Error::Usage(format!(
            "'{}' is a step graph; give the exported model the adapters go into",
            req.model.display()
        )));
    }
    crate::graph::patch::check_consistency(&model).map_err(Error::MalformedGraph)?;
    crate::graph::structure::check_model(&model)?;
    check_external_data(&model, &model_dir(&req.model))?;
    let external = plan_external_data(&model, &req.model, &output, req.copy_external_data)?;
    let no_layer = |why: &str| {
        Error::Usage(format!(
            "'{}' has no layer for the step graph's adapter{why}; give the export the step graph was made from (or one of the same model that keeps its names)",
            req.model.display()
        ))
    };
    let adapted = insert(&mut model, &o).map_err(|e| match e {
        Error::Usage(m) => no_layer(&format!("s ({m})")),
        e => e,
    })?;
    let got: BTreeSet<String> = adapted.parameters();
    if let Some(missing) = wanted.iter().find(|n| !got.contains(*n)) {
        return Err(no_layer(&format!(" '{missing}'")));
    }
    let graph = model.graph.as_mut().expect("loaded models have a graph");
    let inputs: Vec<String> = adapted
        .adapters
        .iter()
        .flat_map(|a| [a.a.clone(), a.b.clone()])
        .collect();
    for name in &inputs {
        let t = graph
            .initializer
            .iter()
            .find(|t| t.name() == name)
            .expect("insert adds A and B as initializers");
        let info = tensor_info(name, t.data_type(), &t.dims);
        graph.input.push(info);
    }
    external.apply(&mut model);
    save_model_from(&model, &output, Some(&source), Some(&external))?;
    Ok(ServingSummary { output, inputs })
}

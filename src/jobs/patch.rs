//! The patch job, end to end: load → check → the number-loss patch (`passes::pipeline`) →
//! save.

use std::path::{Path, PathBuf};

use crate::error::Error;
use crate::io::model_io::{
    check_external_data, load_model_source, model_dir, plan_external_data, same_file,
    save_model_from, ExternalDataAction, ExternalDataPlan, ModelSource,
};
use crate::onnx::ModelProto;
use crate::passes::pipeline::{
    check_opset, patch_graph, refuse_patched, refuse_training_graph, PatchOptions,
};
use crate::vocab::number_table::Vocab;
use ntl_ops::options::LossOptions;

pub struct PatchRequest {
    pub model: PathBuf,
    pub output: Option<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub vocab_size: Option<usize>,
    pub ce_node: Option<String>,
    pub loss: LossOptions,
    /// Add a cross-entropy to a logits-only graph (`--add-loss`); it is also added, with a
    /// notice, when the graph has no cross-entropy and one logits-like output.
    pub add_loss: bool,
    /// With an added loss: the causal shift of Hugging Face causal LMs (`--no-shift` turns it off).
    pub shift: bool,
    /// Copy external data files next to an output in another folder, even where the output
    /// folder already holds them.
    pub copy_external_data: bool,
}

pub struct PatchSummary {
    pub output: PathBuf,
    pub ce_node: String,
    pub pattern: &'static str,
    pub logits_width: usize,
    pub number_tokens: usize,
    pub tokenizer: PathBuf,
    /// What became of the model's external data files.
    pub external_data: ExternalDataAction,
    /// One-line notices for stderr (e.g. a loss added to a logits-only graph).
    pub notices: Vec<String>,
    /// One-line warnings for stderr (number tokens left out for their size).
    pub warnings: Vec<String>,
}

/// `model.onnx` → `model.ntl.onnx` beside it.
pub fn default_output(model: &Path) -> PathBuf {
    let stem = model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    model_dir(model).join(format!("{stem}.ntl.onnx"))
}

/// `tokenizer.json` beside the model.
pub fn default_tokenizer(model: &Path) -> PathBuf {
    model_dir(model).join("tokenizer.json")
}

pub fn run_patch(req: &PatchRequest) -> Result<PatchSummary, Error> {
    req.loss.check().map_err(Error::Usage)?;
    let output = req
        .output
        .clone()
        .unwrap_or_else(|| default_output(&req.model));
    let patched = patch_model(req, &output)?;
    save_model_from(
        &patched.model,
        &output,
        Some(&patched.source),
        Some(&patched.external),
    )?;
    Ok(patched.summary)
}

/// A patched model in memory, with what saving it needs.
pub struct Patched {
    pub model: ModelProto,
    /// The input file: initializer payloads are copied from it on save.
    pub source: ModelSource,
    pub external: ExternalDataPlan,
    pub summary: PatchSummary,
}

/// Loads, checks and patches `req.model` for writing to `output` (not written here).
pub fn patch_model(req: &PatchRequest, output: &Path) -> Result<Patched, Error> {
    if same_file(&req.model, output) {
        return Err(Error::OutputIsInput(output.to_path_buf()));
    }
    crate::io::fsio::check_output_path(output).map_err(|source| Error::Write {
        path: output.to_path_buf(),
        source,
    })?;
    let (mut model, source) = load_model_source(&req.model)?;
    refuse_patched(&model, &req.model)?;
    refuse_training_graph(&model)?;
    check_opset(&model)?;
    crate::graph::patch::check_consistency(&model).map_err(Error::MalformedGraph)?;
    crate::graph::structure::check_model(&model)?;
    check_external_data(&model, &model_dir(&req.model))?;
    let external = plan_external_data(&model, &req.model, output, req.copy_external_data)?;

    let tokenizer = req
        .tokenizer
        .clone()
        .unwrap_or_else(|| default_tokenizer(&req.model));
    let options = PatchOptions {
        ce_node: req.ce_node.as_deref(),
        vocab_size: req.vocab_size,
        loss: &req.loss,
        add_loss: req.add_loss,
        shift: req.shift,
    };
    let done = patch_graph(&mut model, &options, || {
        if !tokenizer.exists() {
            return Err(Error::TokenizerMissing(tokenizer.clone()));
        }
        Ok(Vocab::from_file(&tokenizer)?)
    })?;
    external.apply(&mut model);
    let summary = PatchSummary {
        output: output.to_path_buf(),
        ce_node: done.ce_node,
        pattern: done.pattern,
        logits_width: done.logits_width,
        number_tokens: done.number_tokens,
        tokenizer,
        external_data: external.action,
        notices: done.notices,
        warnings: done.warnings,
    };
    Ok(Patched {
        model,
        source,
        external,
        summary,
    })
}

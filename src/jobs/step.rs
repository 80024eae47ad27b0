//! The step job: load → the patch (`jobs::patch`) → the step graph (`passes::step::build`) →
//! write the step graph (or, with `--split`, the gradient and update graphs) and the optimizer
//! state's sparse zeros file, all or nothing.

use std::path::{Path, PathBuf};

use crate::error::Error;
use crate::io::external_payloads::{read_external, write_external};
use crate::io::model_io::{load_model, model_dir, same_file, save_model_from, ExternalDataAction};
use crate::jobs::patch::{patch_model, PatchRequest, PatchSummary};
use crate::passes::contract::{self, is_step_graph};
use crate::passes::step::zero_state::SparseFile;
use crate::passes::step::{build, StepOptions};

pub struct StepRequest {
    pub patch: PatchRequest,
    pub options: StepOptions,
}

pub struct StepSummary {
    pub outputs: Vec<PathBuf>,
    pub patch: PatchSummary,
    pub parameters: Vec<String>,
    pub parameter_elements: u64,
    pub frozen: Vec<String>,
    pub buffers: Vec<String>,
    /// Things the user may want to know that change nothing (`--freeze` of a constant).
    pub notes: Vec<String>,
    pub warnings: Vec<String>,
    /// Positions per chunk where the LM head is fused.
    pub fused_head_chunk_tokens: Option<i64>,
    /// LoRA: the options and the adapted layers (the metadata's `lora`).
    pub lora: Option<contract::Lora>,
    /// `--recompute`: what was chosen and why (the metadata's `recompute`).
    pub recompute: contract::Recompute,
    /// `--attention`: what was replaced and what was left (the metadata's `attention`).
    pub attention: contract::Attention,
}

/// `model.onnx` → `model.step.onnx` (or `model.grad.onnx` + `model.update.onnx`).
pub fn default_outputs(model: &Path, split: bool) -> Vec<PathBuf> {
    let stem = model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let dir = model_dir(model);
    if split {
        vec![
            dir.join(format!("{stem}.grad.onnx")),
            dir.join(format!("{stem}.update.onnx")),
        ]
    } else {
        vec![dir.join(format!("{stem}.step.onnx"))]
    }
}

/// The outputs of `--split -o OUT`: `OUT` is the gradient graph, the update graph goes beside
/// it as `<OUT stem>.update.onnx`.
fn split_outputs(out: &Path) -> Vec<PathBuf> {
    let stem = out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let stem = stem.strip_suffix(".grad").unwrap_or(&stem).to_string();
    vec![
        out.to_path_buf(),
        model_dir(out).join(format!("{stem}.update.onnx")),
    ]
}

pub fn run_step(req: &StepRequest) -> Result<StepSummary, Error> {
    req.options.check()?;
    let outputs = match &req.patch.output {
        Some(out) if req.options.split => split_outputs(out),
        Some(out) => vec![out.clone()],
        None => default_outputs(&req.patch.model, req.options.split),
    };
    if outputs.len() == 2 && outputs[0] == outputs[1] {
        return Err(Error::Usage("the gradient and update graphs would share a path; name the gradient graph OUT.grad.onnx with -o".into()));
    }
    let input = load_model(&req.patch.model)?;
    if is_step_graph(&input) {
        return Err(Error::AlreadyStepGraph {
            path: req.patch.model.clone(),
        });
    }
    drop(input);
    let mut patched = patch_model(&req.patch, &outputs[0])?;
    for out in &outputs[1..] {
        if same_file(&req.patch.model, out) {
            return Err(Error::OutputIsInput(out.clone()));
        }
        crate::io::fsio::check_output_path(out).map_err(|source| Error::Write {
            path: out.clone(),
            source,
        })?;
    }
    let input_dir = model_dir(&req.patch.model);
    let plan = &patched.external;
    let read = |t: &crate::onnx::TensorProto| read_external(t, &input_dir, plan);
    let mut built = build(&mut patched.model, &req.options, &outputs, &read)?;
    let summary = StepSummary {
        outputs: outputs.clone(),
        patch: patched.summary,
        parameters: built.parameters,
        parameter_elements: built.parameter_elements,
        frozen: built.frozen,
        buffers: built.buffers,
        notes: built.notes,
        warnings: built.warnings,
        fused_head_chunk_tokens: built.fused_head_chunk_tokens,
        lora: built.lora,
        recompute: built.recompute,
        attention: built.attention,
    };
    // Everything but the main graph first, removed again if a later write fails: an error
    // leaves no output at all.
    let mut written: Vec<PathBuf> = Vec::new();
    let result = (|| {
        let holder = outputs.last().expect("one output at least");
        if let Some(file) = built.zeros.sparse_file() {
            written.push(write_sparse(&model_dir(holder), &file)?);
        }
        // QLoRA's codes of a model kept in external data go to a data file of their own: the
        // quantised base of a large model is more than one protobuf file may hold (2 GiB)
        if patched.external.action != ExternalDataAction::None
            && !built.quantized_payloads.is_empty()
        {
            let data = quantized_data_file(&outputs[0]);
            let names = std::mem::take(&mut built.quantized_payloads);
            if write_external(&mut patched.model, &names, &data)? {
                written.push(data);
            }
        }
        if let Some(update) = &built.update {
            save_model_from(update, &outputs[1], None, None)?;
            written.push(outputs[1].clone());
        }
        save_model_from(
            &patched.model,
            &outputs[0],
            Some(&patched.source),
            Some(&patched.external),
        )
    })();
    if let Err(e) = result {
        for path in written {
            let _ = std::fs::remove_file(path);
        }
        return Err(e);
    }
    Ok(summary)
}

/// `OUT.onnx` → `OUT.qlora.data` beside it: QLoRA's codes and scales.
fn quantized_data_file(out: &Path) -> PathBuf {
    let stem = out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    model_dir(out).join(format!("{stem}.qlora.data"))
}

/// Creates the optimizer state's zeros file in `dir`: a temporary file of the full length,
/// renamed into place. Returns its path.
fn write_sparse(dir: &Path, file: &SparseFile) -> Result<PathBuf, Error> {
    let path = dir.join(&file.name);
    let err = |source| Error::Write {
        path: path.clone(),
        source,
    };
    // registered: removed on error and on SIGINT/SIGTERM/SIGHUP (crate::io::temp)
    let tmp = crate::io::temp::TempFile::new_in(dir).map_err(err)?;
    tmp.as_file().set_len(file.len).map_err(err)?;
    tmp.as_file().sync_all().map_err(err)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::Permissions::from_mode(0o644);
        tmp.as_file().set_permissions(mode).map_err(err)?;
    }
    tmp.persist(&path).map_err(err)?;
    Ok(path)
}

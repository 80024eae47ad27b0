//! The artifacts job (`ntl-patch artifacts DIR`): the four files of ONNX Runtime training
//! artifacts opened inside DIR, the training and eval graphs patched
//! (`passes::artifacts`), the optimizer model and the checkpoint copied unchanged, all written
//! into a new folder renamed into place when complete.

use std::path::{Path, PathBuf};

use ntl_ops::options::LossOptions;

use crate::error::Error;
use crate::io::model_io::{
    check_external_data, load_model_file, model_dir, plan_external_data, save_model_from,
    ModelSource,
};
use crate::onnx::ModelProto;
use crate::passes::artifacts::{patch_artifacts, ArtifactsOptions};
use crate::passes::pipeline::{check_opset, refuse_patched};
use crate::vocab::number_table::Vocab;

pub const TRAINING: &str = "training_model.onnx";
pub const EVAL: &str = "eval_model.onnx";
pub const OPTIMIZER: &str = "optimizer_model.onnx";
pub const CHECKPOINT: &str = "checkpoint";

pub struct ArtifactsRequest {
    pub dir: PathBuf,
    pub output: Option<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub vocab_size: Option<usize>,
    pub ce_node: Option<String>,
    pub loss: LossOptions,
}

pub struct ArtifactsSummary {
    pub output: PathBuf,
    pub number_tokens: usize,
    pub sparse_updates: usize,
    pub dense_updates: usize,
    /// One-line warnings for stderr (number tokens left out for their size).
    pub warnings: Vec<String>,
}

/// `./artifacts` → `./artifacts-ntl`.
pub fn default_output(dir: &Path) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "artifacts".into());
    dir.with_file_name(format!("{name}-ntl"))
}

pub fn run_artifacts(req: &ArtifactsRequest) -> Result<ArtifactsSummary, Error> {
    req.loss.check().map_err(Error::Usage)?;
    // Opened inside the folder without following symlinks out of it; read from these
    // descriptors only, so a swapped path cannot bring an outside file into the output.
    let mut opened = Vec::new();
    for f in [TRAINING, EVAL, OPTIMIZER, CHECKPOINT] {
        let file = crate::io::fsio::open_beneath(&req.dir, Path::new(f)).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                Error::MissingArtifact {
                    dir: req.dir.clone(),
                    file: f.into(),
                }
            } else {
                Error::Read {
                    path: req.dir.join(f),
                    source,
                }
            }
        })?;
        opened.push(file);
    }
    let [training_file, eval_file, optimizer, checkpoint]: [std::fs::File; 4] =
        opened.try_into().expect("four files");
    let output = req
        .output
        .clone()
        .unwrap_or_else(|| default_output(&req.dir));
    if output.symlink_metadata().is_ok() {
        return Err(Error::OutputExists(output));
    }
    let tokenizer = req
        .tokenizer
        .clone()
        .unwrap_or_else(|| req.dir.join("tokenizer.json"));
    if !tokenizer.exists() {
        return Err(Error::TokenizerMissing(tokenizer));
    }
    let vocab = Vocab::from_file(&tokenizer)?;

    let (mut training, training_source) = load_artifact(training_file, &req.dir.join(TRAINING))?;
    let (mut eval, eval_source) = load_artifact(eval_file, &req.dir.join(EVAL))?;

    let options = ArtifactsOptions {
        ce_node: req.ce_node.as_deref(),
        vocab_size: req.vocab_size,
        loss: &req.loss,
    };
    let done = patch_artifacts(&mut training, &mut eval, &options, &vocab)?;
    write_folder(
        &req.dir,
        &output,
        [
            (TRAINING, &training, &training_source),
            (EVAL, &eval, &eval_source),
        ],
        [(OPTIMIZER, optimizer), (CHECKPOINT, checkpoint)],
    )?;
    Ok(ArtifactsSummary {
        output,
        number_tokens: done.number_tokens,
        sparse_updates: done.sparse_updates,
        dense_updates: done.dense_updates,
        warnings: done.warnings,
    })
}

/// Loads one artifact graph read-only and checks it can be patched.
fn load_artifact(file: std::fs::File, path: &Path) -> Result<(ModelProto, ModelSource), Error> {
    let (model, source) = load_model_file(file, path)?;
    refuse_patched(&model, path)?;
    check_opset(&model)?;
    crate::graph::patch::check_consistency(&model).map_err(Error::MalformedGraph)?;
    crate::graph::structure::check_model(&model)?;
    check_external_data(&model, &model_dir(path))?;
    Ok((model, source))
}

/// Writes the four artifacts into a temporary folder beside `output`, then renames it. The
/// graphs' external data files (large models) are copied along, as the folder is new.
fn write_folder(
    src: &Path,
    output: &Path,
    graphs: [(&str, &ModelProto, &ModelSource); 2],
    copies: [(&str, std::fs::File); 2],
) -> Result<(), Error> {
    let write_err = |source| Error::Write {
        path: output.to_path_buf(),
        source,
    };
    let parent = crate::io::model_io::model_dir(output);
    let tmp = crate::io::temp::TempDir::new_in(&parent).map_err(write_err)?;
    for (name, model, source) in graphs {
        let out = tmp.path().join(name);
        let external = plan_external_data(model, &src.join(name), &out, true)?;
        let mut model = model.clone();
        external.apply(&mut model);
        save_model_from(&model, &out, Some(source), Some(&external))?;
    }
    for (name, mut file) in copies {
        let mut dest = std::fs::File::create(tmp.path().join(name)).map_err(write_err)?;
        std::io::copy(&mut file, &mut dest).map_err(write_err)?;
        dest.sync_all().map_err(write_err)?;
    }
    tmp.persist(output).map_err(write_err)
}

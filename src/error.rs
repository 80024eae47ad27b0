//! Errors a user can act on: each message is one line naming the problem and the fix.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read '{path}': {source}; check the path")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("'{path}' is not an ONNX model ({reason}); pass the .onnx file your exporter wrote")]
    NotOnnx { path: PathBuf, reason: String },
    #[error("'{path}' has no graph; pass an exported ONNX model")]
    NoGraph { path: PathBuf },
    #[error("no cross-entropy found (looked for SoftmaxCrossEntropyLoss, LogSoftmax + NegativeLogLikelihoodLoss and the cross-entropies docs/EXPORTERS.md lists as written out of primitive ops{nested}); export the model with its plain loss (e.g. a module returning F.cross_entropy(...); label smoothing: export without it and pass --label-smoothing), or pass --add-loss for a logits-only export")]
    NoCrossEntropy { nested: String },
    #[error("{count} cross-entropy nodes found: {found}; choose one with --ce-node NAME")]
    SeveralCrossEntropies { count: usize, found: String },
    #[error("--ce-node '{wanted}' matches no cross-entropy; found: {found}")]
    CeNodeNotFound { wanted: String, found: String },
    #[error(
        "'{path}' is already patched by ntl-patch ({evidence}); patch the original export instead"
    )]
    AlreadyPatched { path: PathBuf, evidence: String },
    #[error("the model's default-domain opset is {found}; ntl-patch needs opset >= {min}: re-export with opset_version={min} or newer")]
    OpsetTooOld { found: i64, min: i64 },
    #[error("the model imports no default-domain opset; re-export it with a standard ONNX opset")]
    NoOpset,
    #[error("the cross-entropy uses reduction '{0}' and no scalar graph output is computed from it; ntl-patch adds the number loss to the scalar loss the graph reports: reduce the loss in the graph (mean or sum) before exporting")]
    UnsupportedReduction(String),
    #[error("cannot tell the rank of the scores tensor '{tensor}' from the graph; export with static rank (e.g. keep shape information) or flatten the logits to [N, V] before the loss")]
    UnknownRank { tensor: String },
    #[error("cannot read the logits width (vocabulary size) of '{tensor}' from the graph; pass --vocab-size V")]
    UnknownWidth { tensor: String },
    #[error("--vocab-size {given} disagrees with the logits width {found} in the graph; drop --vocab-size or pass the right value")]
    WidthMismatch { given: usize, found: usize },
    #[error("the graph already has a tensor named '{0}'; rename it in the export, ntl-patch adds that output")]
    OutputNameTaken(String),
    #[error("logits '{tensor}' have element type {elem_type}, not a float type; the number loss needs float logits")]
    NonFloatLogits { tensor: String, elem_type: i32 },
    #[error("the output path '{0}' is the input model; write elsewhere with -o OUT.onnx (inputs are never overwritten)")]
    OutputIsInput(PathBuf),
    #[error("no tokenizer given and none found at '{0}'; pass --tokenizer PATH (tokenizer.json or a one-token-per-line vocab file)")]
    TokenizerMissing(PathBuf),
    /// A tokenizer or number-table problem (`vocab::TableError`'s one line).
    #[error("{0}")]
    Table(String),
    #[error("external data location '{location}' of tensor '{tensor}' {problem}; keep external data files inside the model's folder")]
    UnsafeExternalData {
        tensor: String,
        location: String,
        problem: String,
    },
    #[error("'{path}' already exists and differs from the model's external data file of that name; remove it or write the output to another folder")]
    ExternalDataConflict { path: PathBuf },
    #[error("cannot write '{path}': {source}; check the folder exists and is writable")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the input graph is malformed: {0}; re-export the model (ONNX requires nodes with the inputs, outputs and attributes their op defines, each tensor produced once, in topological order)")]
    MalformedGraph(String),
    #[error("internal error, the patched graph is inconsistent: {0}; please report this")]
    Inconsistent(String),
    #[error("{0}")]
    Validation(String),
    #[error("{0}")]
    Usage(String),
    #[error("'{dir}' has no {file}; pass the folder generate_artifacts wrote (training_model.onnx, eval_model.onnx, optimizer_model.onnx, checkpoint)")]
    MissingArtifact { dir: PathBuf, file: String },
    #[error("'{0}' already exists; choose another output folder with -o or remove it")]
    OutputExists(PathBuf),
    #[error("the training graph has no SoftmaxCrossEntropyLossGrad for its cross-entropy, so the logits gradient cannot be found; generate the artifacts from a graph whose loss is a cross-entropy (loss=None or LossType.CrossEntropyLoss)")]
    NoLossGradient,
    #[error("cannot find the [B, T] labels that '{labels}' was flattened from; per-sequence losses (ntil, emd, number-level) need the sequence grouping: export labels as [B, T] and flatten them in the graph")]
    NoSequenceShape { labels: String },
    #[error("the model is an ONNX Runtime training graph (it has {op} nodes: its backward is already built, so a loss added to its forward would get no gradient); patch the artifacts folder with `ntl-patch artifacts DIR`, or patch the exported forward graph")]
    TrainingGraph { op: String },
    #[error("'{path}' is already a step graph written by ntl-patch step (metadata 'ntl_step'); run ntl-patch step on the original export")]
    AlreadyStepGraph { path: PathBuf },
    #[error("cannot differentiate {op} node '{node}' on the path from parameter '{param}' to the loss: ntl-patch has no gradient rule for {op}; freeze that parameter with --freeze PREFIX or re-export the model without {op}")]
    NoGradientRule {
        op: String,
        node: String,
        param: String,
    },
    #[error("'{path}' changed while ntl-patch read it (another process wrote or truncated it); run again when nothing writes it (no output written)")]
    InputChanged { path: PathBuf },
    #[error("'{path}' holds {messages} protobuf messages that would take about {estimate_mb} MiB of memory to decode, more than the {limit_mb} MiB allowed (1 GiB, or 1.2× the file size if larger); this is not an exported model")]
    DecodeTooLarge {
        path: PathBuf,
        messages: u64,
        estimate_mb: u64,
        limit_mb: u64,
    },
    #[error("--float-level needs a \".\" token in the tokenizer and it has none; drop --float-level or pass the model's tokenizer")]
    NoDotToken,
}

impl Error {
    /// The message as one line: control and bidirectional characters in names taken from the
    /// model (newlines, raw bytes, U+202E) are escaped.
    pub fn one_line(&self) -> String {
        crate::text::escape(&self.to_string()).into_owned()
    }

    /// Exit code: 1 for input and usage errors, 2 for internal ones.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Inconsistent(_) => 2,
            _ => 1,
        }
    }
}

thread_local! {
    static CATCHING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` (third-party code that may panic on odd input, such as tract), turning a panic
/// into its message. While it runs, [`panic_is_caught`] tells the binary's panic hook to stay
/// quiet.
pub fn catch_panic<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    let before = CATCHING.with(|c| c.replace(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CATCHING.with(|c| c.set(before));
    result.map_err(|p| {
        p.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into())
    })
}

/// True inside [`catch_panic`] on this thread.
pub fn panic_is_caught() -> bool {
    CATCHING.with(|c| c.get())
}

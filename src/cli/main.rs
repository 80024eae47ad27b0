//! The `ntl-patch` command line: parse, run, print, exit (0 ok, 1 input error, 2 internal;
//! `usage`).

mod usage;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use ntl_ops::options::{
    Combine, Dist2Options, LossKind, LossOptions, NtilOptions, SmmdKernel, SmmdOptions, SmmdTerms,
};
use ntl_patch::io::model_io::ExternalDataAction;
use ntl_patch::jobs::artifacts::{run_artifacts, ArtifactsRequest};
use ntl_patch::jobs::patch::{run_patch, PatchRequest};
use ntl_patch::jobs::step::{run_step, StepRequest, StepSummary};
use ntl_patch::passes::attention::{AttentionOptions, Mode as AttentionMode};
use ntl_patch::passes::fused_head::{FusedHeadOptions, Mode as FusedHeadMode};
use ntl_patch::passes::lora::LoraOptions;
use ntl_patch::passes::quantize_base::{QuantizeOptions, Scheme};
use ntl_patch::passes::recompute::{
    Hints as RecomputeHints, Mode as RecomputeMode, RecomputeOptions,
};
use ntl_patch::passes::step::precision::loss_scale::LossScaleOptions;
use ntl_patch::passes::step::{OptimizerKind, OptimizerOptions, Precision, StepOptions};
use ntl_patch::text::escape;
use ntl_patch::tools::validate::{self, Runtime, ValidateRequest};
use ntl_patch::vocab::number_table::NumberSet;

/// mimalloc: millions of small allocations for a large graph (bench/README.md, issue 26).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Splice a number-aware loss into the cross-entropy of an exported ONNX training graph
/// (loss = CE + λ·NTL), and write training steps that any ONNX runtime runs.
#[derive(Parser)]
#[command(
    name = "ntl-patch",
    version,
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    patch: PatchArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Show the cross-entropy node(s), logits/labels, vocab width, opset, IR and external data.
    Inspect {
        model: PathBuf,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Check every op against an ONNX Runtime GPU execution provider and name the nodes that
        /// would fall back to CPU (repeatable): cuda = onnxruntime-gpu 1.31.1, rocm =
        /// onnxruntime-rocm 1.22.2 (the last ROCm EP), migraphx = onnxruntime-migraphx 1.27.1,
        /// cuda-1.19 / rocm-1.19 = onnxruntime-training 1.19.2.
        #[arg(long, value_enum, value_name = "EP")]
        target: Vec<TargetArg>,
    },
    /// Run a patched graph and check its losses against an independent implementation.
    Validate(ValidateArgs),
    /// Add the number loss to ONNX Runtime training artifacts (forward and analytic backward).
    Artifacts(ArtifactsArgs),
    /// Write the inference model that takes a LoRA step graph's adapters as inputs (A and B
    /// under the step graph's names, defaults the untrained values), for onnxruntime's
    /// `.onnx_adapter` files (docs/STEP_GRAPH.md).
    LoraModel(LoraModelArgs),
    /// Write a standard-ONNX training step: patched forward, whole-model backward and the
    /// optimizer update in one graph that any ONNX runtime trains (docs/STEP_GRAPH.md).
    Step(Box<StepArgs>),
}

#[derive(Args)]
struct StepArgs {
    /// The exported ONNX training graph (its first output is the loss).
    model: PathBuf,
    #[command(flatten)]
    loss: LossArgs,
    #[command(flatten)]
    source: SourceArgs,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerArg::Adamw)]
    optimizer: OptimizerArg,
    /// Learning rate (the default value of the graph's `ntl/lr` input).
    #[arg(long, default_value_t = 1e-3, allow_negative_numbers = true)]
    lr: f64,
    /// AdamW β1.
    #[arg(long, default_value_t = 0.9, allow_negative_numbers = true)]
    beta1: f64,
    /// AdamW β2.
    #[arg(long, default_value_t = 0.999, allow_negative_numbers = true)]
    beta2: f64,
    /// AdamW ε.
    #[arg(long, default_value_t = 1e-8, allow_negative_numbers = true)]
    eps: f64,
    /// Weight decay (decoupled for AdamW, L2 for SGD, as in torch) [default: 0.01 adamw, 0 sgd].
    #[arg(long, allow_negative_numbers = true)]
    weight_decay: Option<f64>,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    momentum: f64,
    /// Clip the gradient norm over all trained parameters (torch clip_grad_norm_).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    max_grad_norm: Option<f64>,
    /// Update the trained tensors of at most MIB MiB together, in flat buckets of up to MIB MiB
    /// (torch's multi-tensor AdamW): each optimizer op runs once a bucket, not once a tensor,
    /// which saves thousands of kernel launches a step on a GPU. Same values; 0: per tensor.
    #[arg(long, value_name = "MIB", default_value_t = 0)]
    update_bucket: u64,
    /// Do not train the initializers whose names start with PREFIX (repeatable).
    #[arg(long, value_name = "PREFIX")]
    freeze: Vec<String>,
    /// Write a gradient graph (MODEL.grad.onnx) and an update graph (MODEL.update.onnx).
    #[arg(long)]
    split: bool,
    /// LoRA: train rank-R adapters of the targeted linear layers (Hugging Face PEFT's LoRA);
    /// the base weights stay frozen, in their own type.
    #[arg(long, value_name = "R", allow_negative_numbers = true)]
    lora_r: Option<i64>,
    /// LoRA's alpha: the adapters' output is scaled by alpha / R (PEFT's default 8).
    #[arg(long, value_name = "A", allow_negative_numbers = true)]
    lora_alpha: Option<f64>,
    /// LoRA: the modules to adapt, comma-separated (PEFT's target_modules, e.g. q_proj,v_proj)
    /// [default: PEFT's default for the architecture the module names show].
    #[arg(long, value_name = "NAMES")]
    lora_targets: Option<String>,
    /// LoRA: scale by alpha / sqrt(R) (rsLoRA).
    #[arg(long)]
    use_rslora: bool,
    /// LoRA: how A and B start (peft: A as nn.Linear's Kaiming-uniform, B zeros).
    #[arg(long, value_enum)]
    lora_init: Option<LoraInitArg>,
    /// LoRA: dropout on the adapters' input (only 0 for now).
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    lora_dropout: Option<f64>,
    /// Seed of LoRA's initial A.
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// With LoRA: also train the base weights whose names start with PREFIX (repeatable).
    #[arg(long, value_name = "PREFIX")]
    train: Vec<String>,
    /// QLoRA: store the frozen linear weights quantised (nf4: bitsandbytes' NF4; int8/int4:
    /// symmetric blocks through DequantizeLinear), dequantised in the graph per reading node;
    /// the adapters and optimizer stay float32.
    #[arg(long, value_enum)]
    quantize_base: Option<QuantizeArg>,
    /// QLoRA: values per quantisation block (bitsandbytes' blocksize) [default: 64].
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    quant_block: Option<i64>,
    /// QLoRA: the modules to quantise, comma-separated; may name the LM head and the
    /// embedding [default: every linear layer but the LM head, as bitsandbytes' load_in_4bit].
    #[arg(long, value_name = "NAMES")]
    quantize_targets: Option<String>,
    /// QLoRA nf4: store the blocks' absmax quantised too, as bitsandbytes'
    /// compress_statistics (8-bit codes in blocks of 256 with a float32 scale each, plus their
    /// mean): about 0.516 bytes a value instead of 0.5625 at blocks of 64.
    #[arg(long)]
    double_quant: bool,
    /// Compute the forward and backward in float16 or bfloat16 where torch's autocast does
    /// (float32 master weights and optimizer; fp16 with dynamic loss scaling) [default: fp32].
    #[arg(long, value_enum)]
    precision: Option<PrecisionArg>,
    /// fp16 loss scaling: the initial scale (torch GradScaler's init_scale) [default: 65536].
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    init_scale: Option<f64>,
    /// fp16 loss scaling: the factor after --growth-interval clean steps [default: 2].
    #[arg(long, value_name = "F", allow_negative_numbers = true)]
    growth_factor: Option<f64>,
    /// fp16 loss scaling: the factor after a skipped (inf/NaN) step [default: 0.5].
    #[arg(long, value_name = "F", allow_negative_numbers = true)]
    backoff_factor: Option<f64>,
    /// fp16 loss scaling: clean steps before the scale grows [default: 2000].
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    growth_interval: Option<i64>,
    /// Compute the LM head, cross-entropy and number loss over chunks of positions, never
    /// holding the [N, V] logits: auto = for logits at least 16384 wide, where the head allows.
    #[arg(long, value_enum, default_value_t = FusedHeadArg::Auto)]
    fused_head: FusedHeadArg,
    /// Positions per chunk of the fused head [default: as many as keep a chunk's logits within
    /// 32 Mi values (128 MiB), 16..4096].
    #[arg(long, value_name = "N")]
    head_chunk_tokens: Option<i64>,
    /// Recompute each layer's forward in the backward instead of keeping its activations
    /// (torch's gradient checkpointing): auto = where the kept activations would outweigh the
    /// parameters and optimizer state at the step's shape.
    #[arg(long, value_enum, default_value_t = RecomputeArg::Off)]
    recompute: RecomputeArg,
    /// Attention over blocks of query rows, never storing the [.., T, T] scores: the backward
    /// recomputes each block's probabilities. auto = where the exported attention is recognised
    /// (others are left as exported and listed); chunked = everywhere, an attention that cannot
    /// be is an error; onnx = as auto, the forward as the ONNX Attention operator (opset 23+,
    /// fused kernels on onnxruntime's CUDA provider); eager = as exported.
    #[arg(long, value_enum, default_value_t = AttentionArg::Auto)]
    attention: AttentionArg,
    /// Query rows per block of --attention [default: 1024].
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    attention_block: Option<i64>,
    /// --recompute auto: the batch size a step runs with, where the graph's is symbolic.
    #[arg(long, value_name = "B")]
    batch: Option<u64>,
    /// --recompute auto: the sequence length a step runs with, where the graph's is symbolic.
    #[arg(long, value_name = "T")]
    seq: Option<u64>,
    /// Output path [default: MODEL.step.onnx beside the model; with --split MODEL.grad.onnx].
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// With -o in another folder: copy the model's external data files next to the output.
    #[arg(long)]
    copy_external_data: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum PrecisionArg {
    /// float32 throughout.
    Fp32,
    /// float16 where autocast computes in it, dynamic loss scaling (GradScaler).
    Fp16,
    /// bfloat16 where autocast computes in it, no loss scaling.
    Bf16,
}

#[derive(Args)]
struct LoraModelArgs {
    /// The exported model the adapters go into (the one the step graph was made from, or an
    /// export of the same model keeping its names, e.g. logits only).
    model: PathBuf,
    /// The LoRA step graph (`ntl-patch step MODEL --lora-r R`) whose adapters to insert.
    #[arg(long, value_name = "STEP")]
    step: PathBuf,
    /// Output path [default: MODEL.lora.onnx beside the model].
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// With -o in another folder: copy the model's external data files next to the output.
    #[arg(long)]
    copy_external_data: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum LoraInitArg {
    /// A as nn.Linear's default (Kaiming-uniform, a = sqrt(5)), B zeros.
    Peft,
}

#[derive(Clone, Copy, ValueEnum)]
enum QuantizeArg {
    /// bitsandbytes' 4-bit NormalFloat (quantize_4bit, quant_type="nf4").
    Nf4,
    /// Symmetric int4 blocks through DequantizeLinear (opset 21 exports).
    Int4,
    /// Symmetric int8 blocks through DequantizeLinear (opset 13 and newer).
    Int8,
}

#[derive(Clone, Copy, ValueEnum)]
enum RecomputeArg {
    Off,
    Layers,
    Auto,
}

#[derive(Clone, Copy, ValueEnum)]
enum AttentionArg {
    Auto,
    Chunked,
    Onnx,
    Eager,
}

#[derive(Clone, Copy, ValueEnum)]
enum FusedHeadArg {
    Auto,
    On,
    Off,
}

#[derive(Clone, Copy, ValueEnum)]
enum OptimizerArg {
    /// torch.optim.AdamW (decoupled weight decay).
    Adamw,
    /// torch.optim.SGD (momentum, L2 weight decay).
    Sgd,
}

#[derive(Args)]
struct PatchArgs {
    /// The exported ONNX training graph (its first output is the loss).
    #[arg(required = true)]
    model: Option<PathBuf>,
    #[command(flatten)]
    loss: LossArgs,
    #[command(flatten)]
    source: SourceArgs,
    /// Output path [default: MODEL.ntl.onnx beside the model].
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// With -o in another folder: copy the model's external data files next to the output
    /// [default: copy only those the output folder does not already hold].
    #[arg(long)]
    copy_external_data: bool,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

/// How to read the model's cross-entropy and vocabulary, shared by both patch commands.
#[derive(Args)]
struct SourceArgs {
    /// tokenizer.json (Hugging Face) or a one-token-per-line vocab file [default: tokenizer.json beside the model, or in DIR].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Logits width, where the graph leaves it symbolic.
    #[arg(long, value_name = "V", allow_negative_numbers = true)]
    vocab_size: Option<usize>,
    /// The cross-entropy node to patch (node name or loss output), when there are several.
    #[arg(long, value_name = "NAME")]
    ce_node: Option<String>,
    /// Logits-only graph: add an int64 `labels` input and Hugging Face's causal-LM cross-entropy
    /// (ignore_index -100) as output `loss` [default: added, with a notice, when the graph has no
    /// cross-entropy and one [B, T, V] output].
    #[arg(long)]
    add_loss: bool,
    /// With an added loss on [B, T, V] logits: no causal shift (labels align with positions).
    #[arg(long)]
    no_shift: bool,
}

/// The loss and its options, shared by patching a graph and patching artifacts.
#[derive(Args)]
struct LossArgs {
    /// The number loss.
    #[arg(long, value_enum, default_value_t = LossArg::Wasserstein)]
    loss: LossArg,
    /// λ in CE + λ·L [default: 1 del, 0.1 dist2, 0.3 otherwise].
    #[arg(long, allow_negative_numbers = true)]
    weight: Option<f64>,
    /// Scale the loss by the softmax mass on number tokens (ntloss `reweigh`; off in the paper).
    #[arg(long)]
    reweigh: bool,
    /// Distances squashed onto [1, S]: ntloss squash factor S > 1 for the Wasserstein distances;
    /// SMMD's squash_factor [default: 9 smmd (1 leaves distances raw), off wasserstein].
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    squash: Option<f64>,
    /// Number tokens are exactly "0".."9" (ntloss digit_level=True) [default].
    #[arg(long, conflicts_with = "all_numbers")]
    digit_level: bool,
    /// Number tokens are all tokens Python's float() parses to a finite value.
    #[arg(long)]
    all_numbers: bool,
    /// How the loss joins CE [default: scaled for ntil/emd (the NTIL reference), add otherwise].
    #[arg(long, value_enum)]
    combine: Option<CombineArg>,
    /// NTIL/EMD: weight base for digit places, w = digit_exp^r [default: 1.2 ntil, 1.0 emd].
    #[arg(long, allow_negative_numbers = true)]
    digit_exp: Option<f64>,
    /// NTIL: weight of the relative absolute-difference term.
    #[arg(long, default_value_t = 0.2, allow_negative_numbers = true)]
    abs_alpha: f64,
    /// NTIL: weight of the order-of-magnitude term.
    #[arg(long, default_value_t = 0.2, allow_negative_numbers = true)]
    mag_alpha: f64,
    /// NTIL: weight of the digit EMD term.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    digit_alpha: f64,
    /// NTIL: Gumbel-softmax temperature.
    #[arg(long, default_value_t = 0.1, allow_negative_numbers = true)]
    gumbel_tau: f64,
    /// NTIL: Gumbel noise scale (0: deterministic, forward = argmax digits).
    #[arg(long, default_value_t = 0.01, allow_negative_numbers = true)]
    gumbel_noise: f64,
    /// number-level: a "." between digits joins one number ("12.34" -> 1234).
    #[arg(long)]
    float_level: bool,
    /// dist2: temperature τ of the target softmax(−(y−k)²/τ) over the digits [default: 1].
    #[arg(long, value_name = "τ", allow_negative_numbers = true)]
    dist2_tau: Option<f64>,
    /// smmd: number tokens are the integers 0..=N that are a token of their own [default: 999].
    #[arg(long, value_name = "N")]
    max_value: Option<u32>,
    /// smmd: distance kernel [default: gaussian].
    #[arg(long, value_enum)]
    kernel: Option<KernelArg>,
    /// smmd: kernel bandwidth σ; several average their kernels (repeatable) [default: 2].
    #[arg(long, value_name = "σ", allow_negative_numbers = true)]
    sigma: Vec<f64>,
    /// smmd: weight α of the smoothness term [default: 1/(2·mean kernel degree)].
    #[arg(long, value_name = "α", allow_negative_numbers = true)]
    smmd_alpha: Option<f64>,
    /// smmd: which terms: rᵀKr + α·rᵀ(D−K)r, rᵀKr alone, or α·rᵀ(D−K)r alone [default: smmd].
    #[arg(long, value_enum)]
    smmd_terms: Option<TermsArg>,
    /// Label smoothing ε of the cross-entropy ntl-patch writes, as torch's
    /// `F.cross_entropy(label_smoothing=ε)`: (1−ε)·CE + ε·mean over classes of −log p.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    label_smoothing: f64,
}

#[derive(Args)]
struct ArtifactsArgs {
    /// The folder generate_artifacts wrote (training_model.onnx, eval_model.onnx, optimizer_model.onnx, checkpoint).
    dir: PathBuf,
    #[command(flatten)]
    loss: LossArgs,
    #[command(flatten)]
    source: SourceArgs,
    /// Output folder [default: DIR-ntl beside DIR].
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ValidateArgs {
    /// A graph written by ntl-patch.
    model: PathBuf,
    /// Runtime that executes the graph.
    #[arg(long, value_enum, default_value_t = RuntimeArg::Tract)]
    runtime: RuntimeArg,
    /// Recorded inputs/outputs in the ONNX test-data layout (input_*.pb, output_*.pb).
    #[arg(long, value_name = "DIR")]
    reference: Option<PathBuf>,
    /// tokenizer.json or vocab file [default: tokenizer.json beside the model].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Relative tolerance.
    #[arg(long, default_value_t = 1e-5, allow_negative_numbers = true)]
    rtol: f64,
    /// Absolute tolerance.
    #[arg(long, default_value_t = 1e-6, allow_negative_numbers = true)]
    atol: f64,
    /// Batch size and sequence length of the generated inputs.
    #[arg(long, default_value_t = 2, allow_negative_numbers = true)]
    batch: usize,
    #[arg(long, default_value_t = 8, allow_negative_numbers = true)]
    seq: usize,
    /// Seed of the generated inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// A GPU execution provider of one ONNX Runtime release (`inspect --target`).
#[derive(Clone, Copy, ValueEnum)]
enum TargetArg {
    /// CUDAExecutionProvider of onnxruntime-gpu 1.31.1.
    Cuda,
    /// ROCMExecutionProvider of onnxruntime-rocm 1.22.2 (ORT removed the ROCm EP in 1.23).
    Rocm,
    /// MIGraphXExecutionProvider of onnxruntime-migraphx 1.27.1.
    Migraphx,
    /// CUDAExecutionProvider of onnxruntime-training 1.19.2.
    #[value(name = "cuda-1.19")]
    Cuda119,
    /// ROCMExecutionProvider of onnxruntime-training 1.19.2.
    #[value(name = "rocm-1.19")]
    Rocm119,
}

impl TargetArg {
    fn target(self) -> ntl_patch::tools::gpu_kernels::Target {
        use ntl_patch::tools::gpu_kernels::Target;
        match self {
            TargetArg::Cuda => Target::Cuda,
            TargetArg::Rocm => Target::Rocm,
            TargetArg::Migraphx => Target::Migraphx,
            TargetArg::Cuda119 => Target::Cuda119,
            TargetArg::Rocm119 => Target::Rocm119,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum LossArg {
    /// NTL-WAS: Σ p_j |v_j − y| (Zausinger et al., "Regress, Don't Guess", ICML 2025).
    Wasserstein,
    /// NTL-MSE: (Σ p_j v_j − y)² (same paper).
    Mse,
    /// NTL-L1: |Σ p_j v_j − y| (same paper).
    L1,
    /// NTL-Huber (δ = 1) on Σ p_j v_j − y (same paper).
    Huber,
    /// NTIL: place-weighted digit EMD + whole-number abs/magnitude terms (Fei et al., "Advancing Sequential Numerical Prediction in Autoregressive Models", ACL 2025).
    Ntil,
    /// NTIL's token-level EMD alone (the reference's EMD class).
    Emd,
    /// ntloss NumberLevelLoss: relative error of whole numbers built from expected digits.
    NumberLevel,
    /// DIST2Loss: place-weighted KL(softmax(−(y−k)²) ‖ p) over the digits (Chung et al., "Teaching Metric Distance to Discrete Autoregressive Language Models", ICLR 2026; PolyU-VCLab/DEL DIST2loss).
    Dist2,
    /// SMMD: kernel MMD + graph smoothness of p − onehot(y) over the integer tokens ("Enhancing Numerical Prediction in LLMs via Smooth MMD Alignment", ICML 2026).
    Smmd,
    /// DEL: place-weighted BCE × softmax of the digit logits (Zheng et al., "DEL: Digit Entropy Loss for Numerical Learning of Large Language Models", 2026).
    Del,
}

#[derive(Clone, Copy, ValueEnum)]
enum KernelArg {
    /// exp(−d²/(2σ²)).
    Gaussian,
    /// exp(−|d|/σ).
    Laplace,
}

#[derive(Clone, Copy, ValueEnum)]
enum TermsArg {
    /// rᵀKr + α·rᵀ(D−K)r.
    Smmd,
    /// rᵀKr.
    Mmd,
    /// α·rᵀ(D−K)r.
    Smooth,
}

#[derive(Clone, Copy, ValueEnum)]
enum CombineArg {
    /// CE + λ·L.
    Add,
    /// CE + stopgrad(CE/(L+1e-10))·λ·L: the NTIL reference's combination (value (1+λ)·CE).
    Scaled,
}

#[derive(Clone, Copy, ValueEnum)]
enum RuntimeArg {
    /// tract, embedded (pure Rust).
    Tract,
    /// ONNX Runtime, loaded at run time: ORT_DYLIB_PATH=.../libonnxruntime.so.<ver>, or
    /// NTL_PATCH_ORT_SITE=a site-packages folder holding the PyPI onnxruntime wheel.
    Ort,
}

fn main() -> ExitCode {
    ntl_patch::io::temp::install_signal_handlers();
    usage::guard(run_cli)
}

fn run_cli() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage::clap_error(e),
    };
    let result = match cli.command {
        Some(Command::Inspect {
            model,
            json,
            target,
        }) => {
            let targets: Vec<_> = target.iter().map(|t| t.target()).collect();
            ntl_patch::tools::inspect::inspect_targets(&model, json, &targets)
        }
        // validate prints its report itself: on stdout, passed or not (exit 1 when not)
        Some(Command::Validate(args)) => return run_validate(args),
        Some(Command::Artifacts(args)) => run_artifacts_cli(args),
        Some(Command::Step(args)) => run_step_cli(*args),
        Some(Command::LoraModel(args)) => run_lora_model_cli(args),
        None => run_patch_cli(cli.patch),
    };
    match result {
        Ok(text) => {
            // names from the model are escaped where they are formatted; this catches the rest
            println!("{}", ntl_patch::text::escape_json(&text));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {}", e.one_line());
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

/// Checks the loss arguments and turns them into options.
fn loss_options(args: &LossArgs) -> Result<LossOptions, ntl_patch::Error> {
    let kind = match args.loss {
        LossArg::Wasserstein => LossKind::Wasserstein,
        LossArg::Mse => LossKind::Mse,
        LossArg::L1 => LossKind::L1,
        LossArg::Huber => LossKind::Huber,
        LossArg::Ntil => LossKind::Ntil,
        LossArg::Emd => LossKind::Emd,
        LossArg::NumberLevel => LossKind::NumberLevel,
        LossArg::Dist2 => LossKind::Dist2,
        LossArg::Smmd => LossKind::Smmd,
        LossArg::Del => LossKind::Del,
    };
    let combine = match args.combine {
        Some(CombineArg::Add) => Combine::Add,
        Some(CombineArg::Scaled) => Combine::Scaled,
        None => kind.default_combine(),
    };
    let ntil = NtilOptions {
        digit_exp: args
            .digit_exp
            .unwrap_or(if kind == LossKind::Emd { 1.0 } else { 1.2 }),
        abs_alpha: args.abs_alpha,
        mag_alpha: args.mag_alpha,
        digit_alpha: args.digit_alpha,
        gumbel_tau: args.gumbel_tau,
        gumbel_noise: args.gumbel_noise,
    };
    if args.float_level && kind != LossKind::NumberLevel {
        return Err(ntl_patch::Error::Usage(
            "--float-level applies to --loss number-level only".into(),
        ));
    }
    if args.all_numbers && kind.is_sequence_level() {
        return Err(ntl_patch::Error::Usage(format!(
            "--all-numbers does not apply to --loss {}: it works on the digits 0-9",
            kind.name()
        )));
    }
    if (args.all_numbers || args.digit_level) && kind == LossKind::Smmd {
        return Err(ntl_patch::Error::Usage(
            "--all-numbers and --digit-level do not apply to --loss smmd: its number tokens are the integers 0..--max-value".into(),
        ));
    }
    if args.reweigh && matches!(kind, LossKind::Dist2 | LossKind::Smmd | LossKind::Del) {
        return Err(ntl_patch::Error::Usage(format!(
            "--reweigh applies to the NTL losses and number-level, not to --loss {}",
            kind.name()
        )));
    }
    let smmd_only = [
        (args.max_value.is_some(), "--max-value"),
        (args.kernel.is_some(), "--kernel"),
        (!args.sigma.is_empty(), "--sigma"),
        (args.smmd_alpha.is_some(), "--smmd-alpha"),
        (args.smmd_terms.is_some(), "--smmd-terms"),
    ];
    if let Some((_, flag)) = smmd_only
        .iter()
        .find(|(set, _)| *set && kind != LossKind::Smmd)
    {
        return Err(ntl_patch::Error::Usage(format!(
            "{flag} applies to --loss smmd only"
        )));
    }
    if args.dist2_tau.is_some() && kind != LossKind::Dist2 {
        return Err(ntl_patch::Error::Usage(
            "--dist2-tau applies to --loss dist2 only".into(),
        ));
    }
    let defaults = SmmdOptions::default();
    let smmd = SmmdOptions {
        max_value: args.max_value.unwrap_or(defaults.max_value),
        kernel: match args.kernel {
            None => defaults.kernel,
            Some(KernelArg::Gaussian) => SmmdKernel::Gaussian,
            Some(KernelArg::Laplace) => SmmdKernel::Laplace,
        },
        sigmas: if args.sigma.is_empty() {
            defaults.sigmas.clone()
        } else {
            args.sigma.clone()
        },
        squash: match kind {
            LossKind::Smmd => args.squash.unwrap_or(defaults.squash),
            _ => defaults.squash,
        },
        alpha: args.smmd_alpha,
        terms: match args.smmd_terms {
            None => defaults.terms,
            Some(TermsArg::Smmd) => SmmdTerms::Smmd,
            Some(TermsArg::Mmd) => SmmdTerms::Mmd,
            Some(TermsArg::Smooth) => SmmdTerms::Smooth,
        },
    };
    let options = LossOptions {
        kind,
        weight: args.weight.unwrap_or(kind.default_weight()),
        reweigh: args.reweigh,
        squash: if kind == LossKind::Smmd {
            None
        } else {
            args.squash
        },
        number_set: if kind == LossKind::Smmd {
            NumberSet::Integers {
                max: smmd.max_value,
            }
        } else if args.all_numbers {
            NumberSet::AllNumbers
        } else {
            NumberSet::DigitLevel
        },
        combine,
        ntil,
        float_level: args.float_level,
        label_smoothing: args.label_smoothing,
        dist2: Dist2Options {
            tau: args.dist2_tau.unwrap_or(Dist2Options::default().tau),
        },
        smmd,
    };
    options.check().map_err(ntl_patch::Error::Usage)?;
    Ok(options)
}

fn run_patch_cli(args: PatchArgs) -> Result<String, ntl_patch::Error> {
    let req = PatchRequest {
        model: args.model.expect("clap requires MODEL"),
        output: args.output,
        tokenizer: args.source.tokenizer,
        vocab_size: args.source.vocab_size,
        ce_node: args.source.ce_node,
        add_loss: args.source.add_loss,
        shift: !args.source.no_shift,
        copy_external_data: args.copy_external_data,
        loss: loss_options(&args.loss)?,
    };
    let s = run_patch(&req)?;
    for n in &s.notices {
        eprintln!("note: {}", escape(n));
    }
    for w in &s.warnings {
        eprintln!("warning: {}", escape(w));
    }
    Ok(if args.json {
        serde_json::json!({
            "output": s.output.display().to_string(),
            "ce_node": s.ce_node,
            "pattern": s.pattern,
            "logits_width": s.logits_width,
            "number_tokens": s.number_tokens,
            "tokenizer": s.tokenizer.display().to_string(),
            "loss": req.loss.kind.name(),
            "weight": req.loss.weight,
            "external_data": s.external_data.name(),
        })
        .to_string()
    } else {
        let external = match s.external_data {
            ExternalDataAction::Relocated => {
                "; external data locations rewritten for the output folder"
            }
            ExternalDataAction::Copied => "; external data files copied next to the output",
            _ => "",
        };
        format!(
            "wrote {} ({} on {} [{}], {} number tokens of {} logits, λ = {}){}",
            escape(&s.output.display().to_string()),
            req.loss.kind.name(),
            escape(&s.ce_node),
            s.pattern,
            s.number_tokens,
            s.logits_width,
            req.loss.weight,
            external
        )
    })
}

/// `--precision` and fp16's loss-scaling options (refused with any other precision).
fn precision_options(
    args: &StepArgs,
) -> Result<(Option<Precision>, LossScaleOptions), ntl_patch::Error> {
    let precision = args.precision.map(|p| match p {
        PrecisionArg::Fp32 => Precision::Fp32,
        PrecisionArg::Fp16 => Precision::Fp16,
        PrecisionArg::Bf16 => Precision::Bf16,
    });
    let given = args.init_scale.is_some()
        || args.growth_factor.is_some()
        || args.backoff_factor.is_some()
        || args.growth_interval.is_some();
    if given && precision != Some(Precision::Fp16) {
        return Err(ntl_patch::Error::Usage(
            "--init-scale, --growth-factor, --backoff-factor and --growth-interval set fp16's loss scaling; add --precision fp16 or drop them".into(),
        ));
    }
    let d = LossScaleOptions::default();
    Ok((
        precision,
        LossScaleOptions {
            init_scale: args.init_scale.unwrap_or(d.init_scale),
            growth_factor: args.growth_factor.unwrap_or(d.growth_factor),
            backoff_factor: args.backoff_factor.unwrap_or(d.backoff_factor),
            growth_interval: args.growth_interval.unwrap_or(d.growth_interval),
        },
    ))
}

fn run_lora_model_cli(args: LoraModelArgs) -> Result<String, ntl_patch::Error> {
    use ntl_patch::jobs::lora_model;
    let s = lora_model::run_lora_model(&lora_model::ServingRequest {
        model: args.model,
        step: args.step,
        output: args.output,
        copy_external_data: args.copy_external_data,
    })?;
    Ok(if args.json {
        serde_json::json!({"output": s.output.display().to_string(), "adapter_inputs": s.inputs})
            .to_string()
    } else {
        format!(
            "wrote {} ({} adapter inputs: A and B of {} layers)",
            s.output.display(),
            s.inputs.len(),
            s.inputs.len() / 2
        )
    })
}

/// `--quantize-base` and its options; those options without it are refused.
fn quantize_options(args: &StepArgs) -> Result<Option<QuantizeOptions>, ntl_patch::Error> {
    let Some(scheme) = args.quantize_base else {
        if args.quant_block.is_some() || args.quantize_targets.is_some() || args.double_quant {
            return Err(ntl_patch::Error::Usage(
                "--quant-block, --quantize-targets and --double-quant set up --quantize-base; add --quantize-base nf4 or drop them".into(),
            ));
        }
        return Ok(None);
    };
    Ok(Some(QuantizeOptions {
        scheme: match scheme {
            QuantizeArg::Nf4 => Scheme::Nf4,
            QuantizeArg::Int4 => Scheme::Int4,
            QuantizeArg::Int8 => Scheme::Int8,
        },
        block: args.quant_block.unwrap_or(64),
        targets: args
            .quantize_targets
            .as_ref()
            .map(|t| t.split(',').map(|s| s.trim().to_string()).collect()),
        double_quant: args.double_quant,
    }))
}

/// `--lora-*` into LoRA options; LoRA's other flags without `--lora-r` are refused.
fn lora_options(args: &StepArgs) -> Result<Option<LoraOptions>, ntl_patch::Error> {
    let Some(r) = args.lora_r else {
        let given = args.lora_alpha.is_some()
            || args.lora_targets.is_some()
            || args.use_rslora
            || args.lora_init.is_some()
            || args.lora_dropout.is_some()
            || args.seed.is_some();
        if given {
            return Err(ntl_patch::Error::Usage(
                "--lora-alpha, --lora-targets, --use-rslora, --lora-init, --lora-dropout and --seed set up LoRA; add --lora-r R or drop them".into(),
            ));
        }
        return Ok(None);
    };
    Ok(Some(LoraOptions {
        r,
        alpha: args.lora_alpha.unwrap_or(8.0),
        targets: args
            .lora_targets
            .as_ref()
            .map(|t| t.split(',').map(|s| s.trim().to_string()).collect()),
        use_rslora: args.use_rslora,
        dropout: args.lora_dropout.unwrap_or(0.0),
        seed: args.seed.unwrap_or(0),
    }))
}

fn run_step_cli(args: StepArgs) -> Result<String, ntl_patch::Error> {
    let json = args.json;
    let req = step_request(args)?;
    let s = run_step(&req)?;
    for n in s.patch.notices.iter().chain(&s.notes) {
        eprintln!("note: {}", escape(n));
    }
    for w in s.patch.warnings.iter().chain(&s.warnings) {
        eprintln!("warning: {}", escape(w));
    }
    Ok(if json {
        step_summary_json(&req, &s)
    } else {
        step_summary_text(&req, &s)
    })
}

/// The step job's request from the command line (the option checks clap cannot make).
fn step_request(args: StepArgs) -> Result<StepRequest, ntl_patch::Error> {
    let lora = lora_options(&args)?;
    let quantize = quantize_options(&args)?;
    let kind = match args.optimizer {
        OptimizerArg::Adamw => OptimizerKind::AdamW,
        OptimizerArg::Sgd => OptimizerKind::Sgd,
    };
    let (precision, loss_scale) = precision_options(&args)?;
    let recompute_mode = match args.recompute {
        RecomputeArg::Off => RecomputeMode::Off,
        RecomputeArg::Layers => RecomputeMode::Layers,
        RecomputeArg::Auto => RecomputeMode::Auto,
    };
    if recompute_mode != RecomputeMode::Auto && (args.batch.is_some() || args.seq.is_some()) {
        return Err(ntl_patch::Error::Usage(
            "--batch and --seq are the step's shape for --recompute auto; add --recompute auto or drop them".into(),
        ));
    }
    let req = StepRequest {
        patch: PatchRequest {
            model: args.model,
            output: args.output,
            tokenizer: args.source.tokenizer,
            vocab_size: args.source.vocab_size,
            ce_node: args.source.ce_node,
            add_loss: args.source.add_loss,
            shift: !args.source.no_shift,
            copy_external_data: args.copy_external_data,
            loss: loss_options(&args.loss)?,
        },
        options: StepOptions {
            optimizer: OptimizerOptions {
                kind,
                lr: args.lr,
                beta1: args.beta1,
                beta2: args.beta2,
                eps: args.eps,
                weight_decay: args.weight_decay.unwrap_or(match kind {
                    OptimizerKind::AdamW => 0.01,
                    OptimizerKind::Sgd => 0.0,
                }),
                momentum: args.momentum,
                max_grad_norm: args.max_grad_norm,
                update_bucket_mib: args.update_bucket,
            },
            freeze: args.freeze,
            lora,
            train: args.train,
            quantize,
            split: args.split,
            precision,
            loss_scale,
            fused_head: FusedHeadOptions {
                mode: match args.fused_head {
                    FusedHeadArg::Auto => FusedHeadMode::Auto,
                    FusedHeadArg::On => FusedHeadMode::On,
                    FusedHeadArg::Off => FusedHeadMode::Off,
                },
                chunk_tokens: args.head_chunk_tokens,
            },
            recompute: RecomputeOptions {
                mode: recompute_mode,
                hints: RecomputeHints {
                    batch: args.batch,
                    seq: args.seq,
                },
            },
            attention: AttentionOptions {
                mode: match args.attention {
                    AttentionArg::Auto => AttentionMode::Auto,
                    AttentionArg::Chunked => AttentionMode::Chunked,
                    AttentionArg::Onnx => AttentionMode::Onnx,
                    AttentionArg::Eager => AttentionMode::Eager,
                },
                block: args.attention_block,
            },
        },
    };
    Ok(req)
}

/// The paths the step job wrote, for printing.
fn step_outputs(s: &StepSummary) -> Vec<String> {
    s.outputs.iter().map(|o| o.display().to_string()).collect()
}

/// `step --json`'s summary object.
fn step_summary_json(req: &StepRequest, s: &StepSummary) -> String {
    serde_json::json!({
        "outputs": step_outputs(s),
        "ce_node": s.patch.ce_node,
        "pattern": s.patch.pattern,
        "loss": req.patch.loss.kind.name(),
        "weight": req.patch.loss.weight,
        "number_tokens": s.patch.number_tokens,
        "optimizer": req.options.optimizer.to_json(),
        "precision": req.options.precision().name(),
        "parameters": s.parameters,
        "parameter_elements": s.parameter_elements,
        "frozen": s.frozen,
        "buffers": s.buffers,
        "fused_head": s.fused_head_chunk_tokens.map(|c| serde_json::json!({"chunk_tokens": c})),
        "lora": s.lora,
        "recompute": s.recompute,
        "attention": s.attention,
        "warnings": s.warnings,
    })
    .to_string()
}

/// `step`'s one-line summary.
fn step_summary_text(req: &StepRequest, s: &StepSummary) -> String {
    let buffers = if s.buffers.is_empty() {
        String::new()
    } else {
        format!(
            "; kept constant (buffers, exporter constants): {}",
            s.buffers.join(", ")
        )
    };
    let frozen = if s.frozen.is_empty() {
        String::new()
    } else {
        format!("; {} frozen", s.frozen.len())
    };
    let fused = match s.fused_head_chunk_tokens {
        Some(c) => format!("; LM head fused, {c} positions per chunk"),
        None => String::new(),
    };
    let recompute = match s.recompute.blocks {
        n if n > 0 => format!("; {n} layers recomputed in the backward"),
        _ => String::new(),
    };
    let recompute = match &s.recompute.reason {
        Some(why) => format!("{recompute}; recompute {why}"),
        None => recompute,
    };
    let attention = match (s.attention.replaced, &s.attention.reason, s.attention.fused) {
        (n, _, Some(f)) if n > 0 => format!(
            "; attention: the ONNX Attention operator's forward in {f} of {n} layers, the backward blockwise"
        ),
        (n, _, None) if n > 0 => format!("; attention blockwise in {n} layers"),
        (_, Some(why), _) => format!("; {why}"),
        _ => String::new(),
    };
    let lora = match (&s.lora, &req.options.lora) {
        (Some(meta), Some(o)) => format!(
            "; LoRA r={} alpha={} on {} layers ({})",
            o.r,
            o.alpha,
            meta.layers.len(),
            meta.target_modules.join(", ")
        ),
        _ => String::new(),
    };
    format!(
        "wrote {} ({} on {}, {} parameters / {} values trained with {}{}{}{}{}{}{})",
        step_outputs(s).join(" and "),
        req.patch.loss.kind.name(),
        s.patch.ce_node,
        s.parameters.len(),
        s.parameter_elements,
        match req.options.optimizer.kind {
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Sgd => "sgd",
        },
        lora,
        frozen,
        buffers,
        fused,
        recompute,
        attention
    )
}

fn run_artifacts_cli(args: ArtifactsArgs) -> Result<String, ntl_patch::Error> {
    if args.source.add_loss || args.source.no_shift {
        return Err(ntl_patch::Error::Usage(
            "--add-loss and --no-shift apply to exported forward graphs; training artifacts already carry their loss: drop them".into(),
        ));
    }
    let req = ArtifactsRequest {
        dir: args.dir,
        output: args.output,
        tokenizer: args.source.tokenizer,
        vocab_size: args.source.vocab_size,
        ce_node: args.source.ce_node,
        loss: loss_options(&args.loss)?,
    };
    let s = run_artifacts(&req)?;
    for w in &s.warnings {
        eprintln!("warning: {}", escape(w));
    }
    Ok(if args.json {
        serde_json::json!({
            "output": s.output.display().to_string(),
            "loss": req.loss.kind.name(),
            "number_tokens": s.number_tokens,
            "sparse_gradient_updates": s.sparse_updates,
            "dense_gradient_updates": s.dense_updates,
        })
        .to_string()
    } else {
        format!(
            "wrote {} ({} spliced into the training graph with its analytic backward: {} sparse, {} dense gradient update(s); eval graph patched; optimizer and checkpoint copied)",
            escape(&s.output.display().to_string()),
            req.loss.kind.name(),
            s.sparse_updates,
            s.dense_updates
        )
    })
}

fn run_validate(args: ValidateArgs) -> ExitCode {
    let req = ValidateRequest {
        model: args.model,
        runtime: match args.runtime {
            RuntimeArg::Tract => Runtime::Tract,
            RuntimeArg::Ort => Runtime::Ort,
        },
        reference: args.reference,
        tokenizer: args.tokenizer,
        rtol: args.rtol,
        atol: args.atol,
        batch: args.batch,
        seq: args.seq,
        seed: args.seed,
    };
    let report = match validate::run(&req) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("error: {}", e.one_line());
            return ExitCode::from(e.exit_code() as u8);
        }
    };
    let text = if args.json {
        report.to_json()
    } else {
        report.to_text()
    };
    println!("{}", ntl_patch::text::escape_json(&text));
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        // exit 1 means one error line on stderr, as for every other refusal
        let mut failed: Vec<&str> = Vec::new();
        for c in report.checks.iter().filter(|c| !c.passed) {
            if !failed.contains(&c.output.as_str()) {
                failed.push(&c.output);
            }
        }
        let count = report.checks.iter().filter(|c| !c.passed).count();
        eprintln!(
            "error: validation failed: {} ({count} of {} checks disagree beyond the tolerances; the report names them)",
            escape(&failed.join(", ")),
            report.checks.len()
        );
        ExitCode::from(1)
    }
}

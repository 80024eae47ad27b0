//! The `ntl-patch` command line: parse, run, print, exit (0 ok, 1 input error, 2 internal).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use ntl_patch::number_table::NumberSet;
use ntl_patch::ops::{LossKind, LossOptions};
use ntl_patch::pipeline::{run_patch, PatchRequest};
use ntl_patch::validate::{self, Runtime, ValidateRequest};

/// Splice a number-aware loss into the cross-entropy of an exported ONNX training graph, so
/// ONNX Runtime Training trains it with CE + λ·NTL.
#[derive(Parser)]
#[command(name = "ntl-patch", version, args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
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
    },
    /// Run a patched graph and check its losses against an independent implementation.
    Validate(ValidateArgs),
}

#[derive(Args)]
struct PatchArgs {
    /// The exported ONNX training graph (its first output is the loss).
    #[arg(required = true)]
    model: Option<PathBuf>,
    /// The number loss.
    #[arg(long, value_enum, default_value_t = LossArg::Wasserstein)]
    loss: LossArg,
    /// tokenizer.json (Hugging Face) or a one-token-per-line vocab file [default: tokenizer.json beside the model].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// λ in CE + λ·NTL.
    #[arg(long, default_value_t = 0.3)]
    weight: f64,
    /// Scale the loss by the softmax mass on number tokens (ntloss `reweigh`; off in the paper).
    #[arg(long)]
    reweigh: bool,
    /// ntloss squash factor S > 1 for the Wasserstein distances.
    #[arg(long, value_name = "S")]
    squash: Option<f64>,
    /// Number tokens are exactly "0".."9" (ntloss digit_level=True) [default].
    #[arg(long, conflicts_with = "all_numbers")]
    digit_level: bool,
    /// Number tokens are all tokens Python's float() parses to a finite value.
    #[arg(long)]
    all_numbers: bool,
    /// Logits width, where the graph leaves it symbolic.
    #[arg(long, value_name = "V")]
    vocab_size: Option<usize>,
    /// The cross-entropy node to patch (node name or loss output), when there are several.
    #[arg(long, value_name = "NAME")]
    ce_node: Option<String>,
    /// Output path [default: MODEL.ntl.onnx beside the model].
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
    #[arg(long, default_value_t = 1e-5)]
    rtol: f64,
    /// Absolute tolerance.
    #[arg(long, default_value_t = 1e-6)]
    atol: f64,
    /// Batch size and sequence length of the generated inputs.
    #[arg(long, default_value_t = 2)]
    batch: usize,
    #[arg(long, default_value_t = 8)]
    seq: usize,
    /// Seed of the generated inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
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
}

#[derive(Clone, Copy, ValueEnum)]
enum RuntimeArg {
    /// tract, embedded (pure Rust).
    Tract,
    /// ONNX Runtime via libonnxruntime.so (ORT_DYLIB_PATH or the PyPI onnxruntime wheel).
    Ort,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { 1 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let result = match cli.command {
        Some(Command::Inspect { model, json }) => ntl_patch::inspect::inspect(&model, json),
        Some(Command::Validate(args)) => run_validate(args),
        None => run_patch_cli(cli.patch),
    };
    match result {
        Ok(text) => {
            println!("{text}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

fn run_patch_cli(args: PatchArgs) -> Result<String, ntl_patch::Error> {
    let kind = match args.loss {
        LossArg::Wasserstein => LossKind::Wasserstein,
        LossArg::Mse => LossKind::Mse,
        LossArg::L1 => LossKind::L1,
        LossArg::Huber => LossKind::Huber,
    };
    if let Some(s) = args.squash {
        if !(s > 1.0) || kind != LossKind::Wasserstein {
            return Err(ntl_patch::Error::Usage(
                "--squash takes a factor > 1 and applies to --loss wasserstein only".into(),
            ));
        }
    }
    if !args.weight.is_finite() {
        return Err(ntl_patch::Error::Usage("--weight must be a finite number".into()));
    }
    let req = PatchRequest {
        model: args.model.expect("clap requires MODEL"),
        output: args.output,
        tokenizer: args.tokenizer,
        vocab_size: args.vocab_size,
        ce_node: args.ce_node,
        loss: LossOptions {
            kind,
            weight: args.weight,
            reweigh: args.reweigh,
            squash: args.squash,
            number_set: if args.all_numbers { NumberSet::AllNumbers } else { NumberSet::DigitLevel },
        },
    };
    let s = run_patch(&req)?;
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
        })
        .to_string()
    } else {
        format!(
            "wrote {} ({} on {} [{}], {} number tokens of {} logits, λ = {})",
            s.output.display(),
            req.loss.kind.name(),
            s.ce_node,
            s.pattern,
            s.number_tokens,
            s.logits_width,
            req.loss.weight
        )
    })
}

fn run_validate(args: ValidateArgs) -> Result<String, ntl_patch::Error> {
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
    let report = validate::run(&req)?;
    if args.json {
        Ok(report.to_json())
    } else {
        Ok(report.to_text())
    }
    .and_then(|text| if report.passed() { Ok(text) } else { Err(ntl_patch::Error::Validation(text)) })
}

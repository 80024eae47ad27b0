#!/usr/bin/env python3
"""Real-size benchmark: the step graph (StepRunner, onnxruntime) against torch eager on the shape
of Qwen2-0.5B, in time per step, peak RSS and losses (bench/README.md, section "Real size").

    .venv/bin/python scripts/bench/bench_real_size.py --preset qwen0.5b      # 24 layers, B=1, T=128
    .venv/bin/python scripts/bench/bench_real_size.py --preset wide4         # 4 layers, B=4, T=1024
    .venv/bin/python scripts/bench/bench_real_size.py --preset small         # 2 layers, d 128: a check
    .venv/bin/python scripts/bench/bench_real_size.py --preset qwen1.5b      # LoRA r 16 vs torch + PEFT
    .venv/bin/python scripts/bench/bench_real_size.py --preset qwen1.5b --export-dtype float16
    PYTHONPATH=<bitsandbytes 0.50.2> .venv/bin/python scripts/bench/bench_real_size.py --preset qwen7b \
        --precision fp32                                                # QLoRA (issue 34), ~40 GB disk

The model: transformers' Qwen2ForCausalLM from a Qwen2Config (random weights, seed --seed, no
download): d 896, 14 query / 2 key-value heads, MLP 4864, vocab 151 936, tied embeddings, eager
attention; exported with its own loss (`labels=`) by torch's dynamo exporter (opset 18 or --opset:
23 for the `onnx` configurations' ONNX Attention operator; optimize=False, external data;
--exporter torchscript for the TorchScript exporter). The
tokenizer: a WordLevel tokenizer.json of --vocab tokens with "0".."9" at scattered ids. The
batch: random ids, labels 30 % digit tokens and 2 % -100.

Configurations (--configs, default `dense,default,torch`):
  a step configuration NAME: `ntl-patch step model.onnx --loss wasserstein --weight 0.3
         [its --step-config arguments]` trained by python/ntl_patch StepRunner on onnxruntime
         (.venv-rt: onnxruntime 1.31.1 + numpy). Built in: `dense` = `--fused-head off`,
         `default` = no extra argument; `--step-config NAME=ARGS` adds or replaces one. A
         configuration whose step graph cannot be written is reported, not fatal.
  torch  torch eager: the same Qwen2ForCausalLM (same seed, so the same weights), its own loss
         + 0.3·ntloss.NTLoss(digit_level=True) on the shifted logits, torch.optim.AdamW (the
         step graph's defaults: lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01).
  lora   (built in) `--lora-r 16 --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,
         down_proj`: PEFT's LoRA, only A and B train (LORA_ARGS below).
  peft   torch eager + Hugging Face PEFT: the same Qwen2ForCausalLM wrapped by
         peft.get_peft_model(LoraConfig(r, lora_alpha, target_modules, use_rslora) as the step
         graph named by --peft-of (default `lora`) says in its `lora` metadata), its lora_A set
         to the step graph's initial A (read from the graph's initializers by the metadata's
         names; B is zeros on both sides), torch.optim.AdamW over the LoRA parameters only (the
         step graph's defaults), loss = the model's own CE + 0.3·ntloss as `torch`.
  qlora  (built in) `lora` + `--quantize-base nf4` (qlora-dq: + `--double-quant`): the frozen
         linear weights in bitsandbytes' NF4; qlora-head: the LM head in NF4 too; qlora-all: the
         embedding as well (every frozen weight); qlora-all-rc: + --recompute layers.
  peft-nf4 `peft` with the targeted linear layers replaced by bitsandbytes' Linear4bit (NF4,
         blocks of 64, bfloat16 compute: what from_pretrained(load_in_4bit=True) makes), on its
         CPU backend; bitsandbytes must be importable (PYTHONPATH).
Preset qwen7b (issue 34): the Qwen2-7B shape (28 layers, d 3584, 28/4 heads, MLP 18 944, V 152 064,
untied head), made and exported in bfloat16 (no float32 copy: 15 GB), configurations
`qlora,peft-nf4,peft` with `peft*` taking A from `qlora`; torch trains the bfloat16 base under
bfloat16 autocast. onnxruntime's CPU provider has no bfloat16 MatMul: give the step graph
`--precision fp32` (bitsandbytes' compute dtype float32) on the CPU.
--export-dtype float16: the model is exported in float16 (Qwen2ForCausalLM.half() of the same
float32 weights; work dir <preset>-float16), the step configurations get `--precision fp16`
(--precision), and `torch` / `peft` train the float16 model under torch.autocast("cpu",
float16) with CUDA autocast's float32 list (tests/python/torch_amp.py: what `--precision fp16`
follows) and torch.amp.GradScaler("cpu") (the step graph's loss scaling defaults); PEFT keeps
its adapters float32 (autocast_adapter_dtype), as the step graph's masters. --baseline
JSON (the --json of the float32 run) adds the resident weight bytes and losses against it.
Resident weights: the step graph's initializers by kind (frozen weights = the initializers that
are not training state, a quantised base's codes and scales included; trained parameters;
optimizer state), from the graph file's TensorProto headers (no payload is read), the frozen
bytes also against the export's initializer bytes and, with --quantize-base, the quantised
layers' bytes before and after (the step's metadata).
Each run is its own process (a worker mode of this script) that loads, trains --steps steps and
reports its step times, losses and peak RSS (VmHWM, with the resident anonymous and file-backed
parts at the end): no run shares memory with another. The runs are interleaved: --rounds rounds,
each one run per configuration in a rotated order, so slow drifts of the machine's load touch
all configurations alike. Threads: --threads in torch (intra-op, 1 inter-op) and onnxruntime
(intra_op_num_threads, 1 inter-op).

--device cuda (scripts/gpu/gpu-check.sh --memory, scripts/gpu/bench_attention_gpu.sh): the same on
GPU 0, onnxruntime's CUDA provider against torch on CUDA, both workers in one environment
(--python); each run's GPU memory is the peak of the device's used memory (NVML, polled every
0.05 s by this driver, which never touches the GPU itself; nvidia-smi where NVML cannot be
loaded) while it runs, above the value before it starts (the process's whole use: CUDA
context, allocator caches; torch's own max_memory_allocated/reserved are reported beside it).
TF32 is an explicit choice (--tf32 on|off, default off): onnxruntime's CUDA provider gets
use_tf32=1|0 (its own default is 1) and torch's float32 matmuls TF32 or strict float32
(torch.backends.cuda.matmul.fp32_precision "tf32"|"ieee", allow_tf32 on torch < 2.9); each run
reports what its session / torch actually used.

Attention (issue 33): step configurations `eager` = `--attention eager` (attention as exported),
`chunked` = `--attention chunked` (blocks of query rows, never the T x T scores), `eager-rc` and
`chunked-rc` the same with `--recompute layers`; --attention-block N adds `--attention-block N`
to every step configuration whose --attention is not eager. The torch side: `torch` (eager
attention), `torch-sdpa` (attn_implementation="sdpa"), `torch-sdpa-ckpt` (SDPA +
gradient_checkpointing_enable()), `torch_ckpt` (eager + checkpointing). --precision bf16: the
step configurations get `--precision bf16`, the torch configurations run under
torch.autocast(device, dtype=torch.bfloat16) with float32 weights and AdamW (what the step
graph's bf16 follows); otherwise torch is float32 (TF32 as --tf32 says).
The summary table: per configuration the median time of the steps after --warmup steps, the
memory (GPU: used memory above the start; CPU: peak RSS), both over the baseline
(--baseline-config: a torch configuration, default `torch`; a LoRA step configuration is
compared with `peft`, one with --recompute with the baseline's checkpointing variant when it
runs: torch -> torch_ckpt, torch-sdpa -> torch-sdpa-ckpt; --baseline-config CONFIG=BASE sets
one configuration's), the losses of step 1 and the model FLOPs utilisation
MFU = (6 N B T + 12 L B T^2 d) / (step time x --peak-flops): N the model's parameters (tied
embedding once), L layers, d = heads x head_dim, B x T tokens; the attention term is
QK^T and PV, forward and backward, the causal half not taken off; recomputation is not
counted (model FLOPs, not hardware FLOPs); a LoRA run is counted as a full fine-tune (6N).
--peak-flops defaults to 989e12 (H200 / H100 SXM dense bf16), for every row (float32 too).

Memory: a real-size run needs ~20 GB (the issue measured torch at ~10 GB and the old StepRunner
at ~19 GB for qwen0.5b). The script refuses to start a run when /proc/meminfo's MemAvailable is
below --min-available-gib (presets qwen0.5b and wide4: 21, qwen1.5b: 12) or the 1-minute load
is above --max-load (presets: 1.5); --force skips both checks. While a run is in progress the
driver polls its RSS and kills it when it passes --rss-limit-gib (qwen1.5b: 20) or when
MemAvailable falls below --min-free-gib (1.0): the run is reported as killed, with the RSS it
had reached and the phase it was in (a full fine-tune of the qwen1.5b shape, `--configs
default,torch`, does not fit a 24 GiB machine; this is how that is shown without taking the
machine down).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WEIGHT = 0.3
LR = 1e-3

PRESETS = {
    # Qwen2-0.5B: 494 M parameters (tied embeddings)
    "qwen0.5b": dict(layers=24, dim=896, heads=14, kv_heads=2, mlp=4864, vocab=151936, batch=1, seq=128,
                     min_available_gib=21, max_load=1.5),
    # the same width with 4 layers and 4096 tokens per step: the logits dominate
    "wide4": dict(layers=4, dim=896, heads=14, kv_heads=2, mlp=4864, vocab=151936, batch=4, seq=1024,
                  min_available_gib=21, max_load=1.5),
    # Qwen2-1.5B: 1.54 B parameters (tied embeddings); LoRA against torch + PEFT by default
    "qwen1.5b": dict(layers=28, dim=1536, heads=12, kv_heads=2, mlp=8960, vocab=151936, batch=1, seq=256,
                     min_available_gib=12, max_load=1.5, rss_limit_gib=20, configs="lora,peft"),
    # long sequences (issue 25): the Qwen2-0.5B shape at 4096 tokens per step, recomputation
    # against torch's gradient checkpointing (`--batch 2 --seq 2048` for the other split)
    "qwen0.5b-long": dict(layers=24, dim=896, heads=14, kv_heads=2, mlp=4864, vocab=151936, batch=1,
                          seq=4096, min_available_gib=21, max_load=1.5, rss_limit_gib=20,
                          configs="recompute,torch_ckpt,default,torch"),
    # Qwen2-7B (issue 34): 7.6 B parameters, untied head, exported in bfloat16; QLoRA r 16 (NF4
    # base) against torch + PEFT on the bfloat16 base and on bitsandbytes' NF4 layers
    "qwen7b": dict(layers=28, dim=3584, heads=28, kv_heads=4, mlp=18944, vocab=152064, tied=0, batch=1,
                   seq=256, export_dtype="bfloat16", min_available_gib=20, max_load=1.5, rss_limit_gib=22,
                   configs="qlora,peft-nf4,peft", peft_of="qlora"),
    # a quick check of the script itself
    "small": dict(layers=2, dim=128, heads=4, kv_heads=2, mlp=256, vocab=4096, batch=2, seq=64,
                  min_available_gib=0, max_load=None),
}
QUANTIZE_WITH_HEAD = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"
LORA_ARGS = "--lora-r 16 --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
STEP_CONFIGS = {"dense": "--fused-head off", "default": "", "lora": LORA_ARGS,
                # issue 34: the frozen base in bitsandbytes' NF4 (blocks of 64), with double quantisation
                "qlora": f"{LORA_ARGS} --quantize-base nf4",
                "qlora-dq": f"{LORA_ARGS} --quantize-base nf4 --double-quant",
                "qlora-rc": f"{LORA_ARGS} --quantize-base nf4 --recompute layers",
                # the LM head in NF4 too (read by rows: src/passes/quantize_base/rows.rs)
                "qlora-head": f"{LORA_ARGS} --quantize-base nf4 --quantize-targets {QUANTIZE_WITH_HEAD}",
                "qlora-all": f"{LORA_ARGS} --quantize-base nf4 --quantize-targets {QUANTIZE_WITH_HEAD},embed_tokens",
                "qlora-all-rc": f"{LORA_ARGS} --quantize-base nf4 --quantize-targets {QUANTIZE_WITH_HEAD},embed_tokens --recompute layers",
                "recompute": "--recompute layers",
                # issue 33: attention as exported, or over blocks of query rows
                "eager": "--attention eager", "chunked": "--attention chunked",
                "eager-rc": "--attention eager --recompute layers",
                "chunked-rc": "--attention chunked --recompute layers",
                # the forward as the ONNX Attention operator (a fused kernel on onnxruntime-gpu): --opset 23
                "onnx": "--attention onnx", "onnx-rc": "--attention onnx --recompute layers",
                # issue 33: the optimizer update over flat buckets of 32 MiB (torch's multi-tensor AdamW)
                "chunked-mt": "--attention chunked --update-bucket 32",
                "lora-mt": f"{LORA_ARGS} --update-bucket 32"}
# torch configurations: (attn_implementation, gradient checkpointing); `peft` is eager attention
# torch_ckpt: torch with model.gradient_checkpointing_enable() (each decoder layer recomputed)
TORCH_ATTN = {"torch": ("eager", False), "torch_ckpt": ("eager", True),
              "torch-sdpa": ("sdpa", False), "torch-sdpa-ckpt": ("sdpa", True), "peft": ("eager", False),
              "peft-nf4": ("eager", False), "peft-nf4-ckpt": ("eager", True), "peft-nf4-fp32": ("eager", False)}
# torch + PEFT: the LoRA of a step graph (--peft-of); peft-nf4*: on bitsandbytes' NF4 layers
NF4_KINDS = ("peft-nf4", "peft-nf4-ckpt", "peft-nf4-fp32")
PEFT_KINDS = ("peft", *NF4_KINDS)
TORCH_KINDS = ("torch", "torch_ckpt", "torch-sdpa", "torch-sdpa-ckpt", *PEFT_KINDS)
# the checkpointing variant of a torch baseline (the reference of a step configuration with --recompute)
CKPT_OF = {"torch": "torch_ckpt", "torch-sdpa": "torch-sdpa-ckpt"}
PEAK_FLOPS = 989e12  # H200 (and H100 SXM): dense bf16 tensor-core peak, FLOP/s
PYTHONS = {"step": REPO / ".venv-rt/bin/python", "torch": REPO / ".venv/bin/python"}
# keys of a preset that are not the model's shape
RUN_KEYS = ("min_available_gib", "max_load", "rss_limit_gib", "configs", "peft_of")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    for k in ("layers", "dim", "heads", "kv_heads", "mlp", "vocab", "tied", "batch", "seq"):
        p.add_argument(f"--{k.replace('_', '-')}", type=int, help=f"override the preset's {k}")
    p.add_argument("--configs", default=None,
                   help="comma-separated: step configurations (see --step-config; built in: dense, default, "
                        "lora, recompute, eager, chunked, eager-rc, chunked-rc) and torch configurations "
                        f"({', '.join(TORCH_KINDS)}) (default: dense,default,torch; qwen1.5b: lora,peft)")
    p.add_argument("--peft-of", default=None, help="the LoRA step configuration whose r, alpha, "
                   "targets and initial A the `peft` runs take")
    p.add_argument("--export-dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="float16: export Qwen2ForCausalLM.half(); step configurations get --precision; "
                        "bfloat16: the model made in bfloat16 (no float32 copy); default: the preset's, "
                        "else float32")
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16"),
                   help="--precision of every step configuration that does not give its own "
                        "(default: fp16 with --export-dtype float16, else none)")
    p.add_argument("--baseline", help="the --json of a float32 run of the same preset: resident "
                                      "weight bytes and losses against it")
    p.add_argument("--rss-limit-gib", type=float, help="kill a run whose RSS passes this (qwen1.5b: 20)")
    p.add_argument("--min-free-gib", type=float, default=1.0,
                   help="kill a run when MemAvailable falls below this while it runs")
    p.add_argument("--step-config", action="append", default=[], metavar="NAME=ARGS",
                   help="extra `ntl-patch step` arguments of a step configuration (repeatable)")
    p.add_argument("--attention-block", type=int, metavar="N",
                   help="add `--attention-block N` (query rows per block) to every step configuration "
                        "whose --attention is not eager and that gives no block of its own")
    p.add_argument("--baseline-config", action="append", default=[], metavar="[CONFIG=]BASE",
                   help="the torch configuration every ratio is taken against (default `torch`; a LoRA "
                        "step configuration: `peft`; one with --recompute: BASE's checkpointing variant "
                        "when it runs); CONFIG=BASE sets one configuration's (repeatable)")
    p.add_argument("--tf32", choices=("on", "off"), default="off",
                   help="--device cuda: onnxruntime's CUDA provider option use_tf32 and torch's float32 "
                        "matmul precision (off: strict float32 on both sides)")
    p.add_argument("--peak-flops", type=float, default=PEAK_FLOPS,
                   help="the device's peak FLOP/s for the model FLOPs utilisation (default 989e12: "
                        "H200 dense bf16)")
    p.add_argument("--steps", type=int, default=3, help="training steps per run")
    p.add_argument("--warmup", type=int, default=1,
                   help="steps of each run left out of the step time (the median is over the rest)")
    p.add_argument("--rounds", type=int, default=3, help="runs per configuration, interleaved")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--python", help="the interpreter of every run (default: .venv-rt for the step "
                                     "runs, .venv for torch)")
    p.add_argument("--exporter", choices=("dynamo", "torchscript"), default="dynamo")
    p.add_argument("--opset", type=int, help="the export's opset (default: dynamo 18, TorchScript 17; "
                   "`--attention onnx` needs 23)")
    p.add_argument("--export-attention", choices=("eager", "sdpa"), default="eager",
                   help="the exported model's attn_implementation: sdpa at opset 23 is torch's SDPA, which "
                        "torch >= 2.9's dynamo exporter writes as the ONNX Attention operator (the step "
                        "graph keeps its forward, a fused kernel on onnxruntime-gpu)")
    p.add_argument("--bin", default=os.environ.get("NTL_PATCH_BIN", str(REPO / "target/release/ntl-patch")))
    p.add_argument("--runner-python", default=str(REPO / "python"),
                   help="folder holding the ntl_patch package the step runs import (e.g. another "
                        "checkout's python/, to compare StepRunner versions)")
    p.add_argument("--workdir", default=None, help="default: target/bench-real-size/<preset>")
    p.add_argument("--reuse", action="store_true", help="reuse the work dir's export and step graphs")
    p.add_argument("--min-available-gib", type=float, help="preset qwen0.5b/wide4: 21, small: 0")
    p.add_argument("--max-load", type=float, help="1-minute load average limit (preset default)")
    p.add_argument("--force", action="store_true", help="skip the memory and load checks")
    p.add_argument("--gpu-arena", choices=("exact", "pow2"), default="exact",
                   help="the step graph's CUDA arena: StepRunner's (grows by each request) or onnxruntime's "
                   "default (the next power of two)")
    p.add_argument("--no-cpu-arena", action="store_true",
                   help="step configurations: SessionOptions.enable_cpu_mem_arena = False")
    p.add_argument("--disable-optimizers", default="",
                   help="step configurations: onnxruntime graph optimizers to leave out, comma-separated "
                        "(InferenceSession's disabled_optimizers, e.g. ConstantFolding: a diagnostic)")
    p.add_argument("--json")
    p.add_argument("--markdown")
    p.add_argument("--seed", type=int, default=20240917)
    args = p.parse_args(argv)
    spec = dict(PRESETS[args.preset])
    for k in ("layers", "dim", "heads", "kv_heads", "mlp", "vocab", "tied", "batch", "seq"):
        if getattr(args, k) is not None:
            spec[k] = getattr(args, k)
    if args.min_available_gib is not None:
        spec["min_available_gib"] = args.min_available_gib
    if args.max_load is not None:
        spec["max_load"] = args.max_load
    if args.rss_limit_gib is not None:
        spec["rss_limit_gib"] = args.rss_limit_gib
    if args.configs is None:
        args.configs = spec.get("configs", "dense,default,torch")
    spec.pop("configs", None)
    if args.peft_of is None:
        args.peft_of = spec.get("peft_of", "lora")
    spec.pop("peft_of", None)
    if args.export_dtype is None:
        args.export_dtype = spec.get("export_dtype", "float32")
    spec.setdefault("tied", 1)
    spec["seed"] = args.seed
    spec["export_dtype"] = args.export_dtype
    if args.opset is not None:
        spec["opset"] = args.opset
    if args.export_attention != "eager":
        spec["export_attn"] = args.export_attention
    if args.precision is None and args.export_dtype == "float16":
        args.precision = "fp16"
    args.spec = spec
    args.step_configs = dict(STEP_CONFIGS)
    for item in args.step_config:
        name, sep, extra = item.partition("=")
        if not sep or not name or name in TORCH_KINDS or "," in name:
            p.error(f"--step-config wants NAME=ARGS (NAME not one of {', '.join(TORCH_KINDS)}), not {item!r}")
        args.step_configs[name] = extra
    if args.precision:
        for name, extra in args.step_configs.items():
            if "--precision" not in shlex.split(extra):
                args.step_configs[name] = f"{extra} --precision {args.precision}".strip()
    if args.attention_block is not None:
        for name, extra in args.step_configs.items():
            a = shlex.split(extra)
            if "--attention" in a and "--attention-block" not in a and \
                    a[a.index("--attention") + 1:a.index("--attention") + 2] != ["eager"]:
                args.step_configs[name] = f"{extra} --attention-block {args.attention_block}"
    args.config_list = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.config_list if c not in TORCH_KINDS and c not in args.step_configs]
    if unknown:
        p.error(f"unknown configurations {unknown}: add them with --step-config NAME=ARGS")
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} leaves none of the --steps {args.steps} to time")
    args.baseline_of = {}
    base = "torch"
    for item in args.baseline_config:
        config, sep, ref = item.rpartition("=")
        if ref not in TORCH_KINDS:
            p.error(f"--baseline-config {item!r}: the baseline must be a torch configuration "
                    f"({', '.join(TORCH_KINDS)})")
        if sep:
            args.baseline_of[config] = ref
        else:
            base = ref
    args.baseline_name = base
    if any(k in args.config_list for k in PEFT_KINDS):
        if args.peft_of not in args.step_configs or "--lora-r" not in shlex.split(args.step_configs[args.peft_of]):
            p.error(f"`peft` and `peft-nf4` take its LoRA from the step configuration --peft-of {args.peft_of!r}, "
                    f"which must be a LoRA one (--lora-r)")
        if args.peft_of not in args.config_list:  # its step graph is needed (it need not run)
            args.graph_only = [args.peft_of]
    args.graph_only = getattr(args, "graph_only", [])
    if args.workdir is None:
        suffix = "" if args.export_dtype == "float32" else f"-{args.export_dtype}"
        args.workdir = str(REPO / "target" / "bench-real-size" / (args.preset + suffix))
    return args


# ----------------------------------------------------------------------------- model and data


def qwen2(spec: dict, attn: str = "eager"):
    """Qwen2ForCausalLM with random weights (seeded), eager attention (attn: transformers'
    attn_implementation; the weights do not depend on it), no dropout."""
    import torch
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    transformers.logging.set_verbosity_error()
    cfg = Qwen2Config(vocab_size=spec["vocab"], hidden_size=spec["dim"], intermediate_size=spec["mlp"],
                      num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                      num_key_value_heads=spec["kv_heads"], tie_word_embeddings=bool(spec.get("tied", 1)),
                      max_position_embeddings=max(2048, spec["seq"], spec.get("max_seq", 0)),
                      rms_norm_eps=1e-6, rope_theta=1e6,
                      attention_dropout=0.0, attn_implementation=attn, use_cache=False,
                      bos_token_id=2, eos_token_id=3, pad_token_id=0)
    torch.manual_seed(spec["seed"])
    bf16 = spec.get("export_dtype") == "bfloat16"
    if bf16:  # made in bfloat16 (a 7B model's float32 copy would not fit): seeded as the float32 one
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen2ForCausalLM(cfg)
    finally:
        if bf16:
            torch.set_default_dtype(default)
    assert model.config._attn_implementation == attn, model.config._attn_implementation
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == bool(spec.get("tied", 1))
    if spec.get("export_dtype", "float32") == "float16":
        model = model.half()  # the float32 weights rounded: the float16 export of the same model
    return model.train()


class WithLoss:
    """forward(input_ids, labels) -> the model's own loss (Hugging Face's shifted CE)."""

    @staticmethod
    def wrap(model):
        import torch

        class M(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, labels):
                return self.inner(input_ids=input_ids, labels=labels).loss

        return M(model)


def export(spec: dict, exporter: str, path: Path) -> str:
    import torch

    sys.path.insert(0, str(REPO / "fixtures"))
    model = WithLoss.wrap(qwen2(spec, spec.get("export_attn", "eager")))
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    ids = torch.randint(4, spec["vocab"], (spec["batch"], spec["seq"]), generator=g)
    # dynamic_seq: the sequence length a symbol (scripts/bench/longest_sequence.py: one graph, any T)
    dynamic = bool(spec.get("dynamic_seq"))
    dynamic_note = ", the sequence length dynamic" if dynamic else ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            import dynamo_compat  # fixtures/: torch 2.7.1's version-converter work-around

            dynamo_compat.patch_dynamo_version_conversion()
            opset = spec.get("opset", 18)
            prog = torch.onnx.export(model, (ids, ids.clone()), dynamo=True, opset_version=opset,
                                     optimize=False, external_data=True, verbose=False,
                                     training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                                     input_names=["input_ids", "labels"], output_names=["loss"],
                                     dynamic_shapes=({1: torch.export.Dim("T", min=8, max=1 << 20)},) * 2
                                     if dynamic else None)
            prog.save(str(path), external_data=True)
            return f"dynamo (torch.onnx.export dynamo=True, opset {opset}, optimize=False, external data{dynamic_note})"
        import generate_step  # transformers' packed-sequence check does not trace

        with generate_step._NoPackedSequenceCheck():
            torch.onnx.export(model, (ids, ids.clone()), str(path), dynamo=False, opset_version=spec.get("opset", 17),
                              training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                              input_names=["input_ids", "labels"], output_names=["loss"],
                              external_data=True,
                              dynamic_axes={"input_ids": {1: "T"}, "labels": {1: "T"}} if dynamic else None)
        return (f"TorchScript (torch.onnx.export dynamo=False, opset {spec.get('opset', 17)}, external data"
                f"{dynamic_note})")


def prepare(args, work: Path) -> dict:
    sys.path.insert(0, str(REPO / "scripts" / "bench"))
    import bench_training_step as bts

    spec = args.spec
    work.mkdir(parents=True, exist_ok=True)
    meta_path = work / "meta.json"
    if args.reuse and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if {k: meta["spec"].get(k) for k in spec if k not in RUN_KEYS} != \
                {k: v for k, v in spec.items() if k not in RUN_KEYS}:
            sys.exit(f"{work}: --reuse, but its model was made with {meta['spec']}")
    else:
        vocab = bts.make_tokenizer(work / "tokenizer.json", spec["vocab"], spec["seed"])
        write_batch(work / "batch.npz", vocab, spec["batch"], spec["seq"], spec["vocab"], spec["seed"])
        for old in work.glob("model.onnx*"):
            old.unlink()
        print(f"export ({args.exporter}) ...", flush=True)
        t0 = time.perf_counter()
        # in a child process: the driver stays small while the runs measure their memory
        rc, stdout, stderr, killed, peak, _ = run_guarded(
            [sys.executable, __file__, "export", json.dumps(spec), args.exporter, str(work / "model.onnx")],
            min_free_gib=args.min_free_gib)
        if rc != 0:
            sys.exit(f"export failed: {killed or stderr.strip()[-2000:]}")
        how = stdout.strip().splitlines()[-1]
        meta = {"spec": spec, "exporter": how, "export_s": time.perf_counter() - t0, "export_peak_mib": peak,
                "step_graphs": {}}
    if "export_bytes" not in meta:
        meta["export_bytes"] = export_weights(work / "model.onnx")
    for name in [c for c in args.config_list if c not in TORCH_KINDS] + args.graph_only:
        extra = args.step_configs[name]
        done = meta["step_graphs"].get(name)
        if args.reuse and done and done.get("args") == extra and (done.get("error") or
                                                                  (work / done["path"]).exists()):
            continue
        out = work / f"model.{name}.step.onnx"
        cmd = [args.bin, "step", str(work / "model.onnx"), "--tokenizer", str(work / "tokenizer.json"),
               "--loss", "wasserstein", "--weight", str(WEIGHT), "--lr", str(LR), "-o", str(out),
               "--json", *shlex.split(extra)]
        print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        entry = {"args": extra, "path": out.name, "step_s": time.perf_counter() - t0}
        if r.returncode != 0:
            entry["error"] = (r.stderr.strip() or f"exit {r.returncode}").splitlines()[-1][:500]
            print(f"  cannot write the {name} step graph: {entry['error']}", flush=True)
        else:
            summary = json.loads(r.stdout)
            # what the step did with the export's attention (replaced, left, fused: issue 33)
            entry["attention"] = summary.get("attention")
            print(f"  attention: {json.dumps(entry['attention'])}", flush=True)
            entry["parameters"] = len(summary.get("parameters", []))
            entry["parameter_elements"] = summary.get("parameter_elements")
            entry["weights"] = resident_weights(out)
        meta["step_graphs"][name] = entry
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta


# bytes per element of TensorProto's types: FLOAT, UINT8, INT8, INT32, INT64, FLOAT16, DOUBLE,
# BFLOAT16, UINT4 and INT4 (two to a byte)
ELEMENT_BYTES = {1: 4, 2: 1, 3: 1, 6: 4, 7: 8, 10: 2, 11: 8, 16: 2, 21: 0.5, 22: 0.5}


def initializer_bytes(tensors, kind_of) -> dict:
    """Bytes of initializers by kind_of(name) and, for "frozen", by element type."""
    from ntl_patch import _onnx_decode

    out = {"frozen": 0, "parameters": 0, "optimizer": 0, "frozen_by_type": {}}
    for t in tensors:
        size = ELEMENT_BYTES.get(t.data_type)
        if size is None:
            continue
        n = size
        for d in t.dims:
            n *= d
        kind = kind_of(t.name)
        out[kind] += int(n)
        if kind == "frozen":
            ty = _onnx_decode.type_name(t.data_type)
            out["frozen_by_type"][ty] = out["frozen_by_type"].get(ty, 0) + int(n)
    return out


def resident_weights(graph: Path) -> dict:
    """Bytes of the step graph's initializers (headers only) by kind: frozen (not training state:
    the base weights, a quantised base's codes and scales, buffers), parameters (trained),
    optimizer (the rest of the state), and the frozen bytes by element type; with a quantised
    base also its bytes before and after quantisation (the step's metadata)."""
    tensors, metadata = initializer_headers(graph)
    meta = json.loads(metadata["ntl_step"])
    state = {name for name, _ in meta["state"]}
    params = set(meta["parameters"])
    out = initializer_bytes(tensors, lambda n: "parameters" if n in params else "optimizer" if n in state
                            else "frozen")
    q = meta.get("quantize_base")
    if q:
        out["quantized"] = {"before": q["bytes_before"], "after": q["bytes_after"]}
    return out


def export_weights(model: Path) -> int:
    """Bytes of the export's initializers (headers only)."""
    return initializer_bytes(initializer_headers(model)[0], lambda n: "frozen")["frozen"]


def initializer_headers(path: Path):
    """The model file's initializers (TensorProto headers, no payload read) and metadata."""
    sys.path.insert(0, str(REPO / "python"))
    from ntl_patch import _onnx_decode

    mm, buf = _onnx_decode.map_file(path)
    try:
        return _onnx_decode.initializers(buf), _onnx_decode.model_metadata(buf)
    finally:
        del buf
        mm.close()


# ----------------------------------------------------------------------------- workers


def proc_status() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) / 1024  # MiB
    return out


def phase(what: str) -> None:
    """The run's progress on stderr (the driver names the phase a killed run was in)."""
    print(f"phase: {what} (RSS {proc_status().get('VmRSS', 0):.0f} MiB)", file=sys.stderr, flush=True)


def worker(argv) -> None:
    """KIND WORKDIR STEPS THREADS DEVICE [STEP_GRAPH RUNNER_PYTHON]: one run; prints one JSON
    line. KIND: step, a torch configuration (TORCH_ATTN) or peft (STEP_GRAPH: the LoRA step
    graph whose A it copies). NTL_BENCH_TF32 (1/0) and NTL_BENCH_PRECISION (bf16: torch under
    autocast) come from the driver."""
    kind, work, steps, threads, device = argv[0], Path(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    import numpy as np

    z = np.load(os.environ.get("NTL_BENCH_BATCH") or work / "batch.npz")  # the driver's other batch
    ids, labels = z["input_ids"], z["labels"]
    t_load = time.perf_counter()
    phase("load")
    if kind in TORCH_ATTN and kind not in PEFT_KINDS:
        attn, ckpt = TORCH_ATTN[kind]
        step, extra = torch_step(work, ids, labels, threads, device, attn=attn, checkpoint=ckpt)
    elif kind in PEFT_KINDS:
        step, extra = torch_step(work, ids, labels, threads, device, lora_graph=work / argv[5],
                                 checkpoint=TORCH_ATTN[kind][1],
                                 nf4=None if kind not in NF4_KINDS else "float32" if kind == "peft-nf4-fp32"
                                 else "bfloat16")
    else:
        step, extra = runner_step(work / argv[5], Path(argv[6]), ids, labels, threads, device)
    load_s = time.perf_counter() - t_load
    mem_loaded = proc_status()
    times, cpu, losses = [], [], []
    for k in range(steps):
        phase(f"step {k + 1}")
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step())
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    print(json.dumps({"load_s": load_s, "times": times, "cpu": cpu, "losses": losses,
                      "mem": {**proc_status(), **extra.get("mem", lambda: {})(),
                              "loaded_rss": mem_loaded.get("VmRSS", 0)},
                      "skipped": extra.get("skipped", lambda: [])(),
                      "versions": extra.get("versions", {}), "info": extra.get("info", {})}), flush=True)


def runner_step(graph: Path, runner_python: Path, ids, labels, threads: int, device: str):
    if device == "cuda":  # onnxruntime-gpu loads the CUDA / cuDNN libraries torch brings (1.31.1: CUDA 13)
        import torch  # noqa: F401

        import onnxruntime as ort

        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
    import onnxruntime as ort

    disabled = [x for x in os.environ.get("NTL_BENCH_DISABLED_OPTIMIZERS", "").split(",") if x]
    if disabled:  # --disable-optimizers: every session the runner creates leaves them out
        import functools

        ort.InferenceSession = functools.partial(ort.InferenceSession, disabled_optimizers=disabled)
    sys.path.insert(0, str(runner_python))
    from ntl_patch import StepRunner

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.enable_mem_pattern = False  # StepRunner's defaults, with the threads set
    if os.environ.get("NTL_BENCH_NO_CPU_ARENA") == "1":  # --no-cpu-arena
        so.enable_cpu_mem_arena = False
    else:
        try:  # the runner's arena that grows by what is asked for (older runners: their own)
            from ntl_patch._sessions import exact_cpu_arena

            exact_cpu_arena(so)
        except ImportError:
            pass
    providers = ["CPUExecutionProvider"]
    tf32 = os.environ.get("NTL_BENCH_TF32", "0")
    if device == "cuda":  # TF32 stated, not onnxruntime's default (use_tf32=1)
        cuda = {"device_id": 0, "use_tf32": tf32}
        if os.environ.get("NTL_BENCH_GPU_ARENA") == "pow2":  # --gpu-arena pow2: onnxruntime's own default
            cuda["arena_extend_strategy"] = "kNextPowerOfTwo"
        providers.insert(0, ("CUDAExecutionProvider", cuda))
    runner = StepRunner(graph, providers=providers, session_options=so)
    want = providers[0] if isinstance(providers[0], str) else providers[0][0]
    if runner.session.get_providers()[0] != want:
        raise RuntimeError(f"the session runs on {runner.session.get_providers()}, not {want}")
    info = {"providers": runner.session.get_providers()}
    if device == "cuda":  # what the session took, as it reports it
        cuda_options = runner.session.get_provider_options().get("CUDAExecutionProvider", {})
        info["use_tf32"] = cuda_options.get("use_tf32")
        info["arena_extend_strategy"] = cuda_options.get("arena_extend_strategy")
        if str(info["use_tf32"]) != tf32:  # reported, not fatal: the table says what ran
            print(f"asked for use_tf32={tf32}, the session has {info['use_tf32']!r}", file=sys.stderr, flush=True)
    batch = dict(zip(runner.data_inputs, (ids, labels)))
    skipped = []

    def step():
        out = list(runner.step(batch))
        skipped.append(bool(getattr(runner, "last_step_skipped", False)))
        return out

    return step, {"versions": {"onnxruntime": ort.__version__}, "skipped": lambda: skipped, "info": info}


def peft_wrap(model, lora_graph: Path):
    """get_peft_model with the LoRA step graph's r, lora_alpha, targets and rsLoRA, its lora_A
    set to the graph's initial A and its lora_B to the graph's initial B (zeros)."""
    import peft
    import torch

    sys.path.insert(0, str(REPO / "python"))
    from ntl_patch import _onnx_decode

    lora = json.loads(_onnx_decode.read_metadata(lora_graph)["ntl_step"])["lora"]
    cfg = peft.LoraConfig(r=int(lora["r"]), lora_alpha=lora["lora_alpha"], target_modules=list(lora["target_modules"]),
                          use_rslora=bool(lora.get("use_rslora")), lora_dropout=0.0, bias="none",
                          task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(model, cfg)  # autocast_adapter_dtype: float32 adapters on a half base
    params = dict(pm.named_parameters())
    # the export's module is WithLoss's wrapper: its module paths start with `inner.`
    key = {(la["module"], part): f"base_model.model.{la['module'].removeprefix('inner.')}.{part}.default.weight"
           for la in lora["layers"] for part in ("lora_A", "lora_B")}
    trainable = {k for k, p in params.items() if p.requires_grad}
    if trainable != set(key.values()):
        raise RuntimeError(f"PEFT trains {sorted(trainable - set(key.values()))[:3]}, the step graph "
                           f"{sorted(set(key.values()) - trainable)[:3]}")
    names = [la[part] for la in lora["layers"] for part in ("lora_A", "lora_B")]
    initial = _onnx_decode.read_initializers(lora_graph, names)
    with torch.no_grad():
        for la in lora["layers"]:
            for part in ("lora_A", "lora_B"):
                p = params[key[(la["module"], part)]]
                v = torch.from_numpy(initial[la[part]])
                if tuple(p.shape) != tuple(v.shape):
                    raise RuntimeError(f"{la[part]}: {tuple(v.shape)} in the graph, {tuple(p.shape)} in PEFT")
                p.copy_(v.to(p.dtype))
    return pm, [p for p in pm.parameters() if p.requires_grad], lora


def torch_float32_matmul(torch, tf32: bool) -> str:
    """Sets TF32 (True) or strict float32 (False) for torch's CUDA float32 matmuls with one API
    only (torch >= 2.9 refuses a mix of fp32_precision and allow_tf32); returns what is set."""
    m = torch.backends.cuda.matmul
    if hasattr(m, "fp32_precision"):
        m.fp32_precision = "tf32" if tf32 else "ieee"
        return f"torch.backends.cuda.matmul.fp32_precision={m.fp32_precision!r}"
    m.allow_tf32 = tf32
    return f"torch.backends.cuda.matmul.allow_tf32={m.allow_tf32}"


def nf4_linears(model, targets, compute_dtype) -> int:
    """Replaces the model's linear layers named by targets (LoRA's target_modules) by
    bitsandbytes' Linear4bit (NF4, blocks of 64, no double quantisation, compute_dtype), as
    from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True)) makes them; one
    layer at a time, so the float weights go as their codes come. Returns the layers replaced."""
    import bitsandbytes as bnb
    import torch

    names = [n for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in targets]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        old = model.get_submodule(name)
        new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=old.bias is not None,
                                compute_dtype=compute_dtype, compress_statistics=False, quant_type="nf4")
        new.weight = bnb.nn.Params4bit(old.weight.data, requires_grad=False, quant_type="nf4", blocksize=64,
                                       compress_statistics=False)
        if old.bias is not None:
            new.bias = torch.nn.Parameter(old.bias.data, requires_grad=False)
        new = new.to("cpu")  # quantises
        setattr(model.get_submodule(parent), leaf, new)
        del old
    return len(names)


def torch_step(work: Path, ids, labels, threads: int, device: str, lora_graph: Path | None = None,
               checkpoint: bool = False, attn: str = "eager", nf4: str | None = None):
    import ntloss
    import torch
    from transformers import PreTrainedTokenizerFast

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    meta = json.loads((work / "meta.json").read_text())
    spec = meta["spec"]
    half = spec.get("export_dtype", "float32") == "float16"
    # a bfloat16 base trains under bfloat16 autocast (bitsandbytes' compute dtype for peft-nf4)
    bf16 = (os.environ.get("NTL_BENCH_PRECISION") == "bf16" or spec.get("export_dtype") == "bfloat16") \
        and not half and nf4 != "float32"
    info = {"attn_implementation": attn, "gradient_checkpointing": checkpoint,
            "autocast": "float16" if half else "bfloat16" if bf16 else None}
    if device == "cuda":
        info["float32_matmul"] = torch_float32_matmul(torch, os.environ.get("NTL_BENCH_TF32", "0") == "1")
        info["gpu"] = torch.cuda.get_device_name(0)
    model = qwen2(spec, attn)
    if nf4:  # QLoRA as PEFT users run it: the targeted layers in bitsandbytes' NF4
        sys.path.insert(0, str(REPO / "python"))
        from ntl_patch import _onnx_decode

        lora = json.loads(_onnx_decode.read_metadata(lora_graph)["ntl_step"])["lora"]
        info["nf4_layers"] = nf4_linears(model, set(lora["target_modules"]), getattr(torch, nf4))
        info["nf4_compute_dtype"] = nf4
        if nf4 == "float32":  # bnb_4bit_compute_dtype=float32: the rest widened too, no autocast
            for m in model.modules():  # (the step graph's --precision fp32 on a half export)
                for name, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
                    if t.dtype in (torch.bfloat16, torch.float16):
                        t.data = t.data.float()
    if lora_graph is not None:  # LoRA: the frozen base in its exported type, float32 adapters
        model, trained, _ = peft_wrap(model, lora_graph)
    else:  # full fine-tune: float32 masters of every weight (the float16 export's values)
        model = model.float()
        trained = list(model.parameters())
    model = model.to(device)
    if checkpoint:  # what Hugging Face users turn on for long sequences
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tok = PreTrainedTokenizerFast(tokenizer_file=str(work / "tokenizer.json"))
    ntl = ntloss.NTLoss(tok, vocab_size=spec["vocab"], digit_level=True, reweigh=False)
    opt = torch.optim.AdamW(trained, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    x, y = torch.from_numpy(ids).to(device), torch.from_numpy(labels).to(device)
    scaler, autocast, skipped = None, None, []
    if bf16:  # what `--precision bf16` follows: float32 weights and AdamW, bfloat16 autocast, no scaler
        autocast = lambda: torch.autocast(device, dtype=torch.bfloat16)  # noqa: E731
    if half:  # what `--precision fp16` follows: autocast with CUDA's float32 list, GradScaler
        import contextlib

        sys.path.insert(0, str(REPO / "tests" / "python"))
        import torch_amp

        scaler = torch.amp.GradScaler(device)

        @contextlib.contextmanager
        def autocast():
            with torch_amp.cuda_float32_list(), torch.autocast(device, dtype=torch.float16):
                yield

    def step():
        if bf16:
            with autocast():
                out = model(input_ids=x, labels=y)
                ce = out.loss
                number = ntl(out.logits[:, :-1, :], y[:, 1:], reduction="mean")
                total = ce + WEIGHT * number
            phase("backward")
            total.backward()
            phase("optimizer")
            opt.step()
        elif scaler is None:
            out = model(input_ids=x, labels=y)
            ce = out.loss
            number = ntl(out.logits[:, :-1, :], y[:, 1:], reduction="mean")
            total = ce + WEIGHT * number
            phase("backward")
            total.backward()
            phase("optimizer")
            opt.step()
        else:
            with autocast():
                out = model(input_ids=x, labels=y)
                ce = out.loss
                number = ntl(out.logits[:, :-1, :], y[:, 1:], reduction="mean")
                total = ce + WEIGHT * number
            before = scaler.get_scale()
            phase("backward")
            scaler.scale(total).backward()
            phase("optimizer")
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < before)
        opt.zero_grad(set_to_none=True)
        return [float(total), float(ce), float(number)]

    def mem():
        if device != "cuda":
            return {}
        return {"torch_max_allocated": torch.cuda.max_memory_allocated() / 2**20,
                "torch_max_reserved": torch.cuda.max_memory_reserved() / 2**20}

    import peft
    import transformers

    return step, {"mem": mem, "versions": {"torch": torch.__version__, "peft": peft.__version__,
                                           "transformers": transformers.__version__},
                  "skipped": lambda: skipped, "info": info}


# ----------------------------------------------------------------------------- driver


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def check_machine(args) -> None:
    if args.force:
        return
    need, max_load = args.spec["min_available_gib"], args.spec["max_load"]
    avail, load = mem_available_gib(), os.getloadavg()[0]
    if need and avail < need:
        sys.exit(f"only {avail:.1f} GiB available, this preset needs {need} GiB: run it on a quiet "
                 f"machine (or --force)")
    if max_load is not None and load > max_load:
        sys.exit(f"load average {load:.2f} is above {max_load}: the timings would be noise; wait or --force")


class Nvml:
    """GPU 0's used memory through NVML (libnvidia-ml.so.1 by ctypes: no CUDA context, no
    package); None when the library cannot be loaded."""

    _lib = None

    @classmethod
    def handle(cls):
        import ctypes

        if cls._lib is None:
            try:
                lib = ctypes.CDLL("libnvidia-ml.so.1")
                h = ctypes.c_void_p()
                if lib.nvmlInit_v2() != 0 or lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)) != 0:
                    raise OSError("nvmlInit / nvmlDeviceGetHandleByIndex failed")
                cls._lib = (lib, h)
            except (OSError, AttributeError):
                cls._lib = False
        return cls._lib or None

    @classmethod
    def used_mib(cls) -> float | None:
        import ctypes

        class Memory(ctypes.Structure):  # nvmlMemory_t
            _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

        got = cls.handle()
        if got is None:
            return None
        lib, h = got
        m = Memory()
        if lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m)) != 0:
            return None
        return m.used / 2**20


def gpu_used_mib() -> float:
    """Used memory of GPU 0 (MiB): NVML, else nvidia-smi's memory.used."""
    used = Nvml.used_mib()
    if used is not None:
        return used
    r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                       capture_output=True, text=True, timeout=30)
    return float(r.stdout.strip().splitlines()[0])


def gpu_info() -> str:
    """GPU 0's name, driver and memory, as nvidia-smi says ('' without one)."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader",
                            "-i", "0"], capture_output=True, text=True, timeout=30)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


class GpuPeak:
    """The highest used memory of GPU 0 while a run is in progress, polled every 0.05 s (NVML;
    0.2 s with nvidia-smi)."""

    def __init__(self):
        import threading

        self.base = self.peak = gpu_used_mib()
        self._every = 0.05 if Nvml.handle() else 0.2
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._stop.wait(self._every):
            self.peak = max(self.peak, gpu_used_mib())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


def proc_rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def write_batch(path: Path, vocab: dict, batch: int, seq: int, vocab_size: int, seed: int) -> None:
    """A seeded batch × seq batch (.npz): random ids, labels 30 % digit tokens and 2 % -100."""
    import numpy as np

    sys.path.insert(0, str(REPO / "scripts" / "bench"))
    import bench_training_step as bts

    ns = argparse.Namespace(batch=batch, seq=seq, vocab=vocab_size, seed=seed, digit_frac=0.3, ignore_frac=0.02)
    ids, labels = bts.make_batch(ns, [vocab[str(d)] for d in range(10)])
    np.savez(path, input_ids=ids, labels=labels)


def run_guarded(cmd, env=None, limit_gib=None, min_free_gib=1.0, timeout_s=None):
    """Runs cmd, polling its RSS every 0.25 s; kills it when its RSS passes limit_gib,
    MemAvailable falls below min_free_gib or it runs past timeout_s. (returncode, stdout, stderr,
    why killed or None, highest polled RSS MiB, wall s)."""
    import tempfile

    t0 = time.perf_counter()
    killed, peak = None, 0.0
    with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, text=True, env=env)
        while proc.poll() is None:
            rss = proc_rss_mib(proc.pid)
            peak = max(peak, rss)
            avail = mem_available_gib()
            late = timeout_s is not None and time.perf_counter() - t0 > timeout_s
            if (limit_gib and rss > limit_gib * 1024) or avail < min_free_gib or late:
                killed = (f"RSS {rss / 1024:.1f} GiB > the limit {limit_gib} GiB" if limit_gib and rss > limit_gib * 1024
                          else f"MemAvailable {avail:.1f} GiB < {min_free_gib} GiB at RSS {rss / 1024:.1f} GiB"
                          if avail < min_free_gib else f"past the time limit of {timeout_s:.0f} s")
                proc.kill()
                proc.wait()
                break
            time.sleep(0.25)
        wall = time.perf_counter() - t0
        fo.seek(0)
        fe.seek(0)
        return proc.returncode, fo.read(), fe.read(), killed, peak, wall


def run_one(args, work: Path, meta: dict, kind: str, batch: Path | None = None,
            timeout_s: float | None = None) -> dict:
    """One run of configuration `kind` in its own process (batch: another batch file than the
    work dir's; timeout_s: killed past it)."""
    check_machine(args)
    worker_kind = kind if kind in TORCH_KINDS else "step"
    python = args.python or str(PYTHONS["torch" if kind in TORCH_KINDS else "step"])
    cmd = [python, __file__, "worker", worker_kind, str(work), str(args.steps), str(args.threads), args.device]
    if kind in PEFT_KINDS:
        cmd += [meta["step_graphs"][args.peft_of]["path"]]
    elif kind not in TORCH_KINDS:
        cmd += [meta["step_graphs"][kind]["path"], args.runner_python]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONDONTWRITEBYTECODE": "1",
           "NTL_BENCH_TF32": "1" if args.tf32 == "on" else "0", "NTL_BENCH_PRECISION": args.precision or ""}
    if args.no_cpu_arena:
        env["NTL_BENCH_NO_CPU_ARENA"] = "1"
    if args.disable_optimizers:
        env["NTL_BENCH_DISABLED_OPTIMIZERS"] = args.disable_optimizers
    env["NTL_BENCH_GPU_ARENA"] = args.gpu_arena
    if batch is not None:
        env["NTL_BENCH_BATCH"] = str(batch)
    if args.device == "cuda":  # the previous run's memory may still be being released: wait (<= 10 s) for it
        idle = getattr(args, "gpu_idle_mib", None)
        if idle is None:
            idle = args.gpu_idle_mib = gpu_used_mib()
        t_wait = time.perf_counter()
        while gpu_used_mib() > idle + 256 and time.perf_counter() - t_wait < 10:
            time.sleep(0.1)
    gpu = GpuPeak() if args.device == "cuda" else None
    rc, stdout, stderr, killed, peak, wall = run_guarded(cmd, env, args.spec.get("rss_limit_gib"), args.min_free_gib,
                                                         timeout_s)
    gpu_peak = gpu.stop() if gpu else None
    gpu_base = gpu.base if gpu else None
    phases = [line for line in stderr.splitlines() if line.startswith("phase: ")]
    if killed:
        last = " → ".join(x.removeprefix("phase: ") for x in phases[-3:]) if phases else "start"
        return {"error": f"killed by the driver after {wall:.0f} s in {last}: {killed}", "killed": True,
                "wall_s": wall, "polled_peak_mib": peak, "phases": phases}
    if rc != 0:
        tail = [line for line in stderr.strip().splitlines() if not line.startswith("phase: ")][-1:] \
            or [f"exit {rc}"]
        if rc < 0:
            tail = [f"killed by signal {-rc}{' (out of memory?)' if rc == -9 else ''} in "
                    f"{phases[-1].removeprefix('phase: ') if phases else 'start'}"]
        return {"error": f"exit {rc}: {tail[0][:500]}", "wall_s": wall, "polled_peak_mib": peak,
                "phases": phases}
    out = json.loads(stdout.strip().splitlines()[-1])
    out["wall_s"] = wall
    if gpu_peak is not None:
        out["mem"]["gpu_peak"] = gpu_peak
        out["mem"]["gpu_used_before"] = gpu_base
    return out


def summarize(runs: list[dict], warmup: int = 1) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"] if runs else "not run"}
    later = [t for r in ok for t in r["times"][warmup:]] or [t for r in ok for t in r["times"]]
    cpu = [t for r in ok for t in r["cpu"][warmup:]] or [t for r in ok for t in r["cpu"]]
    hwm = [r["mem"]["VmHWM"] for r in ok]
    return {
        "runs": len(ok), "first_s": statistics.median(r["times"][0] for r in ok),
        "median_s": statistics.median(later), "min_s": min(later), "max_s": max(later),
        "cpu_s": statistics.median(cpu),
        "peak_mib": statistics.median(hwm), "peak_min_mib": min(hwm), "peak_max_mib": max(hwm),
        "anon_end_mib": statistics.median(r["mem"]["RssAnon"] for r in ok),
        "file_end_mib": statistics.median(r["mem"]["RssFile"] for r in ok),
        "losses": ok[0]["losses"], "load_s": statistics.median(r["load_s"] for r in ok),
        "skipped": ok[0].get("skipped", []),
        "loaded_rss_mib": statistics.median(r["mem"].get("loaded_rss", 0) for r in ok),
        "gpu_peak_mib": max((r["mem"].get("gpu_peak", 0) for r in ok), default=0),
        "torch_reserved_mib": max((r["mem"].get("torch_max_reserved", 0) for r in ok), default=0),
        "timed_steps": len(later), "info": ok[0].get("info", {}), "versions": ok[0].get("versions", {}),
    }


def reference(args, meta: dict, kind: str) -> str | None:
    """What a step configuration is compared with: --baseline-config CONFIG=BASE where given;
    `peft` for a LoRA step configuration; for one with --recompute the baseline's checkpointing
    variant (torch -> torch_ckpt, torch-sdpa -> torch-sdpa-ckpt) when it runs; else the
    baseline (--baseline-config, default `torch`). None for the torch configurations."""
    if kind in TORCH_KINDS:
        return None
    if kind in args.baseline_of:
        return args.baseline_of[kind]
    g = meta["step_graphs"].get(kind, {})
    a = shlex.split(g.get("args", args.step_configs.get(kind, "")))
    if "--lora-r" in a:  # QLoRA against PEFT on bitsandbytes' NF4 layers where that runs
        nf4 = "peft-nf4-ckpt" if "--recompute" in a else "peft-nf4"
        return nf4 if "--quantize-base" in a and nf4 in args.config_list else "peft"
    base = args.baseline_name
    if "--recompute" in a and a[a.index("--recompute") + 1:a.index("--recompute") + 2] != ["off"] \
            and CKPT_OF.get(base) in args.config_list:
        return CKPT_OF[base]
    return base


def baseline_of(args, meta: dict, kind: str) -> str | None:
    """The summary table's reference: reference() for a step configuration; the baseline for
    a torch configuration (--baseline-config CONFIG=BASE where given), None for the baseline
    itself."""
    if kind not in TORCH_KINDS:
        return reference(args, meta, kind)
    ref = args.baseline_of.get(kind, args.baseline_name)
    return None if ref == kind else ref


def model_params(s: dict) -> int:
    """Parameters of the Qwen2 shape: embedding V d (and the head's V d when untied); per layer
    q (d x d + bias), k and v (d x kv_heads hd + bias), o (d x d), the MLP's gate, up, down
    (3 d mlp), two RMSNorms; the final norm."""
    d, hd = s["dim"], s["dim"] // s["heads"]
    kv = s["kv_heads"] * hd
    layer = (d * d + d) + 2 * (d * kv + kv) + d * d + 3 * d * s["mlp"] + 2 * d
    return (1 if s.get("tied", 1) else 2) * s["vocab"] * d + s["layers"] * layer + d


def model_flops(s: dict) -> float:
    """Model FLOPs of one training step (forward + backward): 6 N B T + 12 L B T^2 d, d =
    heads x head_dim (the attention's QK^T and PV, 4 B T^2 d a layer forward, x3 with the
    backward; causal masking not taken off)."""
    tokens = s["batch"] * s["seq"]
    d_attn = s["heads"] * (s["dim"] // s["heads"])
    return 6 * model_params(s) * tokens + 12 * s["layers"] * s["batch"] * s["seq"] ** 2 * d_attn


def loss_diff(a: list, b: list) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for u, v in zip(a, b) for x, y in zip(u, v))


def gib(n: float) -> str:
    return f"{n / 2**30:.3f}"


def describe(args, meta: dict, kind: str) -> str:
    """What a configuration runs, in words."""
    if kind not in TORCH_KINDS:
        extra = meta["step_graphs"].get(kind, {}).get("args", args.step_configs.get(kind, ""))
        return f"step graph, `{extra}`" if extra else "step graph, no extra arguments"
    attn, ckpt = TORCH_ATTN[kind]
    what = "torch + PEFT + bitsandbytes NF4" if kind in NF4_KINDS else "torch + PEFT" if kind == "peft" \
        else "torch"
    what += ", SDPA" if attn == "sdpa" else ", eager attention"
    if ckpt:
        what += " + gradient checkpointing"
    if kind == "peft-nf4-fp32":
        what += f", {meta['spec'].get('export_dtype', 'float32')} values widened to float32, float32 compute"
    elif meta["spec"].get("export_dtype", "float32") == "float16":
        what += ", float16 weights, autocast float16 + GradScaler"
    elif meta["spec"].get("export_dtype") == "bfloat16":
        what += ", bfloat16 weights, autocast bf16"
    elif args.precision == "bf16":
        what += ", autocast bf16"
    else:
        what += ", float32"
    return what


def derive(args, meta: dict, res: dict) -> None:
    """Adds to each configuration's summary: its baseline, the memory the table shows (GPU:
    used memory above the start; CPU: peak RSS), both ratios and the model FLOPs utilisation."""
    flops = model_flops(meta["spec"])
    for kind, c in res.items():
        if "error" in c:
            continue
        c["memory_mib"] = c["gpu_peak_mib"] if args.device == "cuda" else c["peak_mib"]
        c["model_flops"] = flops
        c["mfu"] = flops / c["median_s"] / args.peak_flops
        c["losses_step1"] = c["losses"][0]
    for kind, c in res.items():
        if "error" in c:
            continue
        ref = baseline_of(args, meta, kind)
        b = res.get(ref or "", {})
        c["baseline"] = ref
        if ref and b and "error" not in b:
            c["time_ratio"] = c["median_s"] / b["median_s"]
            c["memory_ratio"] = c["memory_mib"] / b["memory_mib"] if b["memory_mib"] else None


def summary_table(args, meta: dict, res: dict) -> list[str]:
    s = meta["spec"]
    mem = "GPU memory GiB (used above the start)" if args.device == "cuda" else "peak RSS GiB"
    mfu = args.device == "cuda"
    lines = [f"| configuration | what | s/step (median of steps {args.warmup + 1}–{args.steps}) | × baseline | "
             f"{mem} | × baseline |" + (" MFU |" if mfu else "") + " losses of step 1 (total / CE / NTL) | baseline |",
             "| --- | --- | ---: | ---: | ---: | ---: |" + (" ---: |" if mfu else "") + " --- | --- |"]
    for kind in args.config_list:
        c = res.get(kind, {"error": "not run"})
        if "error" in c:
            lines.append(f"| `{kind}` | {describe(args, meta, kind)} | cannot run: {c['error']} | | | |" +
                         (" |" if mfu else "") + " | |")
            continue
        tr = f"**{c['time_ratio']:.2f}**" if c.get("time_ratio") is not None else "-"
        mr = f"**{c['memory_ratio']:.2f}**" if c.get("memory_ratio") is not None else "-"
        loss = " / ".join(f"{x:.5f}" for x in c["losses_step1"])
        lines.append(f"| `{kind}` | {describe(args, meta, kind)} | {c['median_s']:.3f} | {tr} | "
                     f"{c['memory_mib'] / 1024:.2f} | {mr} |" + (f" {100 * c['mfu']:.1f} % |" if mfu else "") +
                     f" {loss} | {('`' + c['baseline'] + '`') if c.get('baseline') else '-'} |")
    if mfu:
        lines += ["", f"MFU = (6·N·B·T + 12·L·B·T²·d) / (s/step · {args.peak_flops:.4g} FLOP/s): N = "
                  f"{model_params(s) / 1e6:.1f} M parameters (tied embedding once), L = {s['layers']}, "
                  f"d = heads·head_dim = {s['heads'] * (s['dim'] // s['heads'])}, B·T = {s['batch'] * s['seq']} tokens: "
                  f"{model_flops(s) / 1e12:.2f} TFLOP per step (attention QKᵀ and PV forward + backward, "
                  f"the causal half not taken off; recomputation not counted; LoRA counted as 6N)."]
    return lines


def markdown(args, meta: dict, res: dict, env: dict, baseline: dict | None = None) -> str:
    s = meta["spec"]
    lines = [f"Preset `{args.preset}`: Qwen2 shape, {s['layers']} layers, d {s['dim']}, {s['heads']}/"
             f"{s['kv_heads']} heads, MLP {s['mlp']}, V {s['vocab']}, "
             f"{'tied embeddings' if s.get('tied', 1) else 'untied head'}, B={s['batch']}, "
             f"T={s['seq']}; export: {meta['exporter']}, {s.get('export_dtype', 'float32')}; {args.steps} "
             f"steps per run, {args.rounds} interleaved rounds, {args.threads} threads; load average "
             f"{env['load_start']:.1f} → {env['load_end']:.1f}" + ("; step configurations without "
             "onnxruntime's CPU arena" if args.no_cpu_arena else "") + (
             f"; step configurations without onnxruntime's {args.disable_optimizers}" if args.disable_optimizers
             else "") + ".", ""]
    for name, g in meta["step_graphs"].items():
        if name not in args.config_list and name not in args.graph_only:
            continue
        extra = f"`{g['args']}`" if g["args"] else "(none)"
        if "error" in g:
            lines.append(f"- `{name}` (extra `ntl-patch step` arguments {extra}): cannot write the step "
                         f"graph: {g['error']}")
        else:
            w = g.get("weights")
            wtxt = ""
            if w:
                types = ", ".join(f"{t} {gib(b)}" for t, b in sorted(w["frozen_by_type"].items()))
                wtxt = (f"; initializers: frozen {gib(w['frozen'])} GiB ({types}), trained "
                        f"{gib(w['parameters'])} GiB, optimizer state {gib(w['optimizer'])} GiB")
                if meta.get("export_bytes"):
                    wtxt += (f"; frozen = **{w['frozen'] / meta['export_bytes']:.3f}×** the export's "
                             f"{gib(meta['export_bytes'])} GiB")
                if w.get("quantized"):
                    q = w["quantized"]
                    wtxt += (f"; the quantised layers {gib(q['before'])} → {gib(q['after'])} GiB "
                             f"(**{q['after'] / q['before']:.3f}×**)")
            lines.append(f"- `{name}` (extra arguments {extra}): {g['parameters']} trained tensors, "
                         f"{g['parameter_elements'] / 1e6:.1f} M elements; `ntl-patch step` {g['step_s']:.1f} s{wtxt}")
    if args.device == "cuda":
        tf32 = sorted({str(c.get("info", {}).get("use_tf32")) for k, c in res.items()
                       if k not in TORCH_KINDS and "error" not in c})
        arena = sorted({str(c.get("info", {}).get("arena_extend_strategy")) for k, c in res.items()
                        if k not in TORCH_KINDS and "error" not in c})
        tt = sorted({c.get("info", {}).get("float32_matmul", "?") for k, c in res.items()
                     if k in TORCH_KINDS and "error" not in c})
        ver = {}
        for c in res.values():
            ver.update(c.get("versions", {}) if "error" not in c else {})
        lines[0] = lines[0][:-1] + (f"; GPU: {env.get('gpu') or '?'}; GPU memory sampled with "
                                    f"{env.get('gpu_sampler')}; --tf32 {args.tf32}: onnxruntime CUDA provider use_tf32="
                                    f"{'/'.join(tf32) or '-'} and arena_extend_strategy {'/'.join(arena) or '-'} "
                                    f"(as the sessions report them), torch "
                                    f"{', '.join(tt) or '-'}; "
                                    + ", ".join(f"{k} {v}" for k, v in sorted(ver.items())) + ".")
    lines += [""] + summary_table(args, meta, res)
    lines += ["", f"| configuration | runs | s/step (median of steps {args.warmup + 1}+) | min – max | × ref | CPU s/step | first step s | "
              "peak RSS MiB (median, min – max) | × ref | at the end: anon / file MiB | losses (total, run 1) |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for kind in args.config_list:
        c = res.get(kind, {"error": "not run"})
        if "error" in c:
            lines.append(f"| `{kind}` | cannot run: {c['error']} | | | | | | | | | |")
            continue
        ref = res.get(reference(args, meta, kind) or "", {})
        ok = ref and "error" not in ref
        pr = f"{c['peak_mib'] / ref['peak_mib']:.2f} ({reference(args, meta, kind)})" if ok else "-"
        tr = f"{c['median_s'] / ref['median_s']:.2f}" if ok else "-"
        losses = ", ".join(f"{x[0]:.6f}" for x in c["losses"])
        if any(c.get("skipped") or []):
            losses += f" (skipped: {c['skipped']})"
        lines.append(f"| `{kind}` | {c['runs']} | {c['median_s']:.3f} | {c['min_s']:.3f} – {c['max_s']:.3f} | {tr} | "
                     f"{c['cpu_s']:.3f} | {c['first_s']:.3f} | {c['peak_mib']:.0f} ({c['peak_min_mib']:.0f} – {c['peak_max_mib']:.0f}) | "
                     f"{pr} | {c['anon_end_mib']:.0f} / {c['file_end_mib']:.0f} | {losses} |")
    if args.device == "cuda":
        lines += ["", "| configuration | GPU memory MiB (peak used memory above the start, largest run) | × baseline | "
                  "torch max_memory_reserved MiB |", "| --- | ---: | ---: | ---: |"]
        for kind in args.config_list:
            c = res.get(kind, {})
            if "error" in c or not c:
                continue
            ratio = f"{c['memory_ratio']:.2f} ({c['baseline']})" if c.get("memory_ratio") else "-"
            reserved = f"{c['torch_reserved_mib']:.0f}" if kind in TORCH_KINDS else "-"
            lines.append(f"| `{kind}` | {c['gpu_peak_mib']:.0f} | {ratio} | {reserved} |")
    pairs = [(kind, reference(args, meta, kind)) for kind in args.config_list]
    pairs += [(kind, nf4) for kind in args.config_list if "--quantize-base" in meta["step_graphs"].get(kind, {})
              .get("args", "") for nf4 in NF4_KINDS if nf4 in args.config_list and nf4 != reference(args, meta, kind)]
    for kind, refname in pairs:
        c, t = res.get(kind), res.get(refname or "")
        if not refname or not c or "error" in c or not t or "error" in t:
            continue
        lines.append(f"\n`{kind}` vs `{refname}`: largest relative difference of the three losses over "
                     f"{len(c['losses'])} steps: {loss_diff(c['losses'], t['losses']):.2e}")
    if baseline:
        bmeta, bres = baseline["meta"], baseline["summary"]
        lines.append("")
        lines.append(f"Against the {bmeta['spec'].get('export_dtype', 'float32')} export's run "
                     f"(`--baseline`):")
        for kind in args.config_list:
            c, b = res.get(kind), bres.get(kind)
            if not c or "error" in c or not b or "error" in b:
                continue
            txt = (f"- `{kind}`: losses, largest relative difference {loss_diff(c['losses'], b['losses']):.2e}; "
                   f"peak RSS {c['peak_mib']:.0f} vs {b['peak_mib']:.0f} MiB ({c['peak_mib'] / b['peak_mib']:.2f}×)")
            g, bg = meta["step_graphs"].get(kind, {}), bmeta["step_graphs"].get(kind, {})
            if g.get("weights") and bg.get("weights"):
                w, bw = g["weights"], bg["weights"]
                txt += (f"; resident weights (initializers less training state) {gib(w['frozen'])} vs "
                        f"{gib(bw['frozen'])} GiB: **{w['frozen'] / bw['frozen']:.3f}×**; with the trained "
                        f"parameters and optimizer state {gib(w['frozen'] + w['parameters'] + w['optimizer'])} vs "
                        f"{gib(bw['frozen'] + bw['parameters'] + bw['optimizer'])} GiB")
            lines.append(txt)
    return "\n".join(lines)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "export":  # export SPEC_JSON EXPORTER PATH
        print(export(json.loads(sys.argv[2]), sys.argv[3], Path(sys.argv[4])), flush=True)
        return
    args = parse_args()
    work = Path(args.workdir)
    env = {"load_start": os.getloadavg()[0]}
    check_machine(args)
    if args.device == "cuda":
        env["gpu"] = gpu_info()
        env["gpu_sampler"] = "NVML" if Nvml.handle() else "nvidia-smi"
        print(f"GPU: {env['gpu'] or '?'}; memory sampled with {env['gpu_sampler']}; --tf32 {args.tf32}; "
              f"--precision {args.precision or '(none)'}", flush=True)
    meta = prepare(args, work)
    kinds = [k for k in args.config_list if k in TORCH_KINDS or "error" not in meta["step_graphs"][k]]
    for k in PEFT_KINDS:
        if k in kinds and "error" in meta["step_graphs"][args.peft_of]:
            kinds.remove(k)
    runs: dict[str, list] = {k: [] for k in args.config_list}
    for rnd in range(args.rounds):
        order = kinds[rnd % len(kinds):] + kinds[: rnd % len(kinds)] if kinds else []
        for kind in order:
            r = run_one(args, work, meta, kind)
            runs[kind].append(r)
            what = r.get("error") or (f"{statistics.median(r['times']):.3f} s/step (steps: "
                                      f"{', '.join(f'{t:.3f}' for t in r['times'])}), peak RSS "
                                      f"{r['mem']['VmHWM']:.0f} MiB, loss {r['losses'][0][0]:.5f}")
            if "error" not in r and args.device == "cuda":
                info = r.get("info", {})
                what += (f", GPU {r['mem'].get('gpu_peak', 0):.0f} MiB above the start, " +
                         (f"use_tf32={info.get('use_tf32')}, arena {info.get('arena_extend_strategy')}"
                          if kind not in TORCH_KINDS
                          else info.get("float32_matmul", "")))
            print(f"round {rnd + 1}/{args.rounds} {kind}: {what}", flush=True)
    res = {k: summarize(v, args.warmup) for k, v in runs.items()}
    for k in args.config_list:
        if k not in TORCH_KINDS and "error" in meta["step_graphs"].get(k, {}):
            res[k] = {"error": "no step graph: " + meta["step_graphs"][k]["error"]}
        if k in PEFT_KINDS and "error" in meta["step_graphs"][args.peft_of]:
            res[k] = {"error": f"no LoRA step graph `{args.peft_of}` to copy A from"}
    env["load_end"] = os.getloadavg()[0]
    derive(args, meta, res)
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else None
    md = markdown(args, meta, res, env, baseline)
    print(md)
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    if args.json:
        options = {"device": args.device, "precision": args.precision, "tf32": args.tf32, "steps": args.steps,
                   "warmup": args.warmup, "rounds": args.rounds, "baseline": args.baseline_name,
                   "baseline_of": args.baseline_of, "peak_flops": args.peak_flops, "configs": args.config_list,
                   "step_configs": {k: v for k, v in args.step_configs.items() if k in args.config_list}}
        Path(args.json).write_text(json.dumps({"meta": meta, "env": env, "options": options, "runs": runs,
                                               "summary": res}, indent=1))


if __name__ == "__main__":
    main()

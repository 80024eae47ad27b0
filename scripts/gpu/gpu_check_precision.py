#!/usr/bin/env python3
"""GPU check of mixed-precision step graphs (`ntl-patch step --precision fp16|bf16`) against torch
autocast on the same GPU, with time and GPU memory beside the float32 step graph.

Run through `scripts/gpu/gpu-check.sh --precision`, which makes the environment (torch 2.7.1 CUDA
12.6, onnxruntime-gpu 1.22.0 (CUDA 12), numpy, transformers 5.24.0, ntloss 0.3.2). For each model
(default gpt2_ts and llama_ts: fixtures/generate_step.py's GPT-2 and Llama; --models) and each
precision (fp32, fp16, bf16):

  1. `ntl-patch step MODEL --loss wasserstein --weight 0.3 --optimizer adamw --lr 1e-3
     --precision P` writes the step graph;
  2. STEPS AdamW steps with StepRunner on CUDAExecutionProvider (use_tf32=0), on the trajectory
     batches of fixtures/reference/step/{gpt2,llama}.npz: losses, skipped steps and the loss
     scale (fp16), the median step time after 3 warm-up steps, and the GPU memory the process
     holds after the run (torch.cuda.mem_get_info before the session and after the steps; ORT's
     arena keeps its peak);
  3. the same training in torch on the same GPU: the transformers model in float32 under
     torch.autocast("cuda", dtype) with torch.amp.GradScaler("cuda") for fp16 (bf16: no
     scaler; fp32: no autocast, TF32 off), torch.optim.AdamW; its step time and
     torch.cuda.max_memory_allocated; and the float64 run skipping the steps the fp16 scaler
     skipped (the exact trajectory);
  4. comparison, as tests/python/test_precision.py on the CPU: equal skip pattern and scales;
     per-step losses within 2u relative (u = 2^-11 fp16, 2^-8 bf16; fp32: 1e-4); final
     parameters: the graph's distance to the float64 trajectory at most 1.5x torch's, graph vs
     torch at most 2x torch's (distances as a fraction of the float64 run's update).

Report: OUT/gpu-check-precision.json (+ a table on stdout). Exit 1 when a comparison fails.
Without a usable CUDA device it says so and exits 0 (--require-gpu: 2); --cpu runs the fp32 and
fp16 cases on the CPU (onnxruntime's CPU provider, torch CPU autocast with CUDA's float32 list
from tests/python/torch_amp.py): a dry run of the script, whose fp16 numbers are not float16's
(onnxruntime's CPU provider computes float16 nodes in float32; docs/STEP_GRAPH.md "Mixed precision").
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "fixtures"), str(ROOT / "tests" / "python")]
sys.dont_write_bytecode = True

WEIGHT, LR = 0.3, 1e-3
UNIT = {"fp32": 1e-4 / 2, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


def log(msg: str) -> None:
    print(f"gpu-check-precision: {msg}", flush=True)


def batches(model: str, steps: int):
    z = np.load(ROOT / "fixtures" / "reference" / "step" / f"{model.split('_')[0]}.npz")
    pool = sorted({k.split("/")[2] for k in z.files if k.startswith("traj/batch/")})
    return [(z[f"traj/batch/{pool[k % len(pool)]}/input_ids"], z[f"traj/batch/{pool[k % len(pool)]}/labels"])
            for k in range(steps)]


HEADS = {"dense": ["--fused-head", "off"], "fused": ["--fused-head", "on", "--head-chunk-tokens", "3"]}


def graph_run(bin_: str, model: str, precision: str, steps: int, device: str, tmp: Path,
              head: str = "dense", recompute: str = "off") -> dict:
    import onnxruntime as ort
    import torch
    from ntl_patch import StepRunner

    out = tmp / f"{model}.{precision}.{head}.{recompute}.step.onnx"
    cmd = [bin_, "step", str(ROOT / "fixtures" / "models" / f"{model}.onnx"), "--tokenizer",
           str(ROOT / "fixtures" / "tokenizer.json"), "--loss", "wasserstein", "--weight", str(WEIGHT),
           "--lr", str(LR), "--precision", precision, "--recompute", recompute, "-o", str(out), *HEADS[head]]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.enable_mem_pattern = False
    providers = ([("CUDAExecutionProvider", {"use_tf32": "0"})] if device == "cuda" else []) + ["CPUExecutionProvider"]
    free0 = torch.cuda.mem_get_info()[0] if device == "cuda" else None
    r = StepRunner(out, providers=providers, session_options=so)
    losses, skipped, scales, times = [], [], [], []
    for x, y in batches(model, steps):
        t = time.perf_counter()
        losses.append(r.step({"input_ids": x, "labels": y})[0])
        times.append(time.perf_counter() - t)
        skipped.append(r.last_step_skipped)
        scales.append(r.loss_scale)
    mem = (free0 - torch.cuda.mem_get_info()[0]) if device == "cuda" else None
    return {"losses": losses, "skipped": skipped, "scales": scales, "params": r.parameters(),
            "step_ms": 1e3 * float(np.median(times[3:])), "gpu_mem_bytes": mem,
            "provider": r.session.get_providers()[0]}


def torch_run(model: str, precision: str, steps: int, device: str, dtype=None, skip=None) -> dict:
    import generate_step as gs
    import torch
    import torch.nn.functional as F

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtype = dtype or torch.float32
    m = gs.model_in(gs.build_model(model.split("_")[0]), dtype).to(device)
    obj = gs.ntloss_object("wasserstein", reweigh=False, squash=None, digit_level=True)
    obj.number_values = obj.number_values.to(device=device, dtype=dtype)
    params = dict(m.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    scaler = torch.amp.GradScaler(device) if precision == "fp16" else None
    if device == "cpu" and half is not None:
        import torch_amp
        lists = torch_amp.cuda_float32_list
    else:
        import contextlib
        lists = contextlib.nullcontext
    losses, skipped, scales, times = [], [], [], []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for k, (x, y) in enumerate(batches(model, steps)):
        x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with lists(), torch.autocast(device, dtype=half or torch.float32, enabled=half is not None):
            logits = m.lm_logits(x)
            lab = gs.shifted(y)
            total = F.cross_entropy(logits.reshape(-1, gs.VOCAB).float(), lab.reshape(-1), ignore_index=-100) \
                + WEIGHT * obj(logits, lab, reduction="mean")
        if scaler is not None:
            before = scaler.get_scale()
            scaler.scale(total).backward()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < before)
            scales.append(scaler.get_scale())
        else:
            total.backward()
            if not (skip and skip[k]):
                opt.step()
            skipped.append(False)
            scales.append(None)
        losses.append(total.item())  # .item() synchronizes: the time is the step's
        times.append(time.perf_counter() - t)
    return {"losses": losses, "skipped": skipped, "scales": scales,
            "params": {k: p.detach().double().cpu().numpy() for k, p in params.items()},
            "step_ms": 1e3 * float(np.median(times[3:])),
            "gpu_mem_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}


def dist(a: dict, b: dict, start: dict) -> float:
    num = sum(float(np.sum((a[k] - b[k]) ** 2)) for k in b)
    den = sum(float(np.sum((b[k] - start[k]) ** 2)) for k in b)
    return math.sqrt(num / max(den, 1e-300))


def check(model: str, precision: str, g: dict, t: dict, exact: dict, start: dict) -> dict:
    u = UNIT[precision]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(g["losses"], t["losses"]))
    d_graph = dist({k: v.astype(np.float64) for k, v in g["params"].items()}, exact["params"], start)
    d_torch = dist(t["params"], exact["params"], start)
    d_both = dist({k: v.astype(np.float64) for k, v in g["params"].items()}, t["params"], start)
    fails = []
    if g["skipped"] != t["skipped"] or (precision == "fp16" and g["scales"] != t["scales"]):
        fails.append(f"skipped steps differ: graph {g['skipped']}, torch {t['skipped']}")
    if loss_err > 2 * u:
        fails.append(f"losses differ by {loss_err:.2e} > {2 * u:.2e}")
    if precision != "fp32" and d_graph > 1.5 * d_torch:
        fails.append(f"parameters {d_graph:.3f} from float64, torch {d_torch:.3f}")
    if precision != "fp32" and d_both > 2 * d_torch:
        fails.append(f"parameters graph vs torch {d_both:.3f} > 2x {d_torch:.3f}")
    return {"loss_err": loss_err, "d_graph": d_graph, "d_torch": d_torch, "d_both": d_both,
            "fails": fails}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", default=str(ROOT / "target" / "gpu-check"))
    ap.add_argument("--models", nargs="+", default=["gpt2_ts", "llama_ts"])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "fp16", "bf16"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--heads", nargs="+", default=["dense", "fused"], choices=sorted(HEADS),
                    help="the LM head as written (dense) and fused over chunks of 3 positions, whose "
                         "projection runs in the half type")
    ap.add_argument("--recompute", nargs="+", default=["off"], choices=["off", "layers"],
                    help="`step --recompute`: layers recomputes each decoder layer in the backward "
                         "(its copies read their inputs through the barrier, Expand in the half type)")
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU (fp32 and fp16 only)")
    ap.add_argument("--require-gpu", action="store_true")
    a = ap.parse_args()
    import onnxruntime as ort
    import torch

    device = "cpu" if a.cpu else "cuda"
    if device == "cuda" and not (torch.cuda.is_available()
                                 and "CUDAExecutionProvider" in ort.get_available_providers()):
        log("no usable CUDA device (torch.cuda.is_available() or onnxruntime's CUDA provider); "
            "nothing checked (--cpu: a dry run on the CPU)")
        return 2 if a.require_gpu else 0
    precisions = [p for p in a.precisions if not (a.cpu and p == "bf16")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report, failed = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                      "steps": a.steps, "cases": []}, False
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models:
            import generate_step as gs
            start = {k: v.detach().double().numpy() for k, v in gs.build_model(model.split("_")[0]).named_parameters()}
            torch_runs = {}  # precision -> (torch's run, the float64 run): the same for every head
            for precision, head, rc in [(p, h, r) for p in precisions for h in a.heads for r in a.recompute]:
                g = graph_run(a.bin, model, precision, a.steps, device, Path(tmp), head, rc)
                if device == "cuda" and g["provider"] != "CUDAExecutionProvider":
                    log(f"{model} {precision}: the session runs on {g['provider']}, not CUDA")
                if precision not in torch_runs:
                    t = torch_run(model, precision, a.steps, device)
                    torch_runs[precision] = t, torch_run(model, "fp32", a.steps, device, dtype=torch.float64,
                                                         skip=t["skipped"])
                t, exact = torch_runs[precision]
                c = check(model, precision, g, t, exact, start)
                if a.cpu and precision != "fp32":  # onnxruntime's CPU provider: not float16's numbers
                    c["not_checked"], c["fails"] = c["fails"], []
                failed |= bool(c["fails"])
                row = {"model": model, "precision": precision, "head": head, "recompute": rc, **c,
                       "graph": {k: g[k] for k in ("step_ms", "gpu_mem_bytes", "skipped", "scales", "losses")},
                       "torch": {k: t[k] for k in ("step_ms", "gpu_mem_bytes", "skipped", "scales", "losses")}}
                report["cases"].append(row)
                mem = lambda b: "-" if b is None else f"{b / 2**20:.0f} MiB"  # noqa: E731
                log(f"{model} {precision} {head} head recompute {rc}: graph {g['step_ms']:.1f} ms/step {mem(g['gpu_mem_bytes'])}, "
                    f"torch {t['step_ms']:.1f} ms/step {mem(t['gpu_mem_bytes'])}; losses vs torch "
                    f"{c['loss_err']:.1e}; params from float64 graph {c['d_graph']:.3f} torch "
                    f"{c['d_torch']:.3f}; skipped {sum(g['skipped'])}"
                    + ("" if not c["fails"] else " FAIL: " + "; ".join(c["fails"])))
    (out / "gpu-check-precision.json").write_text(json.dumps(report, indent=1, default=float))
    log(f"report: {out / 'gpu-check-precision.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

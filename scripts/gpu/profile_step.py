#!/usr/bin/env python3
"""Where a step graph's time goes on onnxruntime: SessionOptions.enable_profiling over a few steps,
summarised by op type (node count per step, time per step, provider) — the profile issue 33 asks for.

    python3 scripts/gpu/profile_step.py MODEL.step.onnx --batch 4 --seq 512 [--device cuda] [--steps 3]

The data inputs are random token ids below the vocabulary (labels: the ids). The first step is a
warm-up and is left out. onnxruntime's node times on the CUDA provider are host-side times of the
kernel launches unless the build traces the GPU (CUPTI): read them as "which op types dominate and
how many launches", and the wall time per step beside them; the gap between the two is time the
host spends outside nodes (copies, arena, Python).

--kernels (CUDA): the GPU's own kernel times instead, recorded by torch.profiler (CUPTI sees every
kernel the process launches, onnxruntime's included), by kernel name: what the GPU spends its time
on, against the wall time per step (the rest is the GPU waiting for the host).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("graph")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="profiled steps after one warm-up step")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--tf32", choices=("on", "off"), default="off")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--json", help="write the table here too")
    p.add_argument("--kernels", action="store_true", help="GPU kernel times by name (torch.profiler)")
    args = p.parse_args()

    if args.device == "cuda":
        import torch  # noqa: F401  (its CUDA libraries serve onnxruntime-gpu)
    import onnxruntime as ort

    if args.device == "cuda" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    sys.path.insert(0, str(REPO / "python"))
    from ntl_patch import StepRunner

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.enable_profiling = not args.kernels
    so.profile_file_prefix = str(Path(args.graph).with_suffix("")) + ".profile"
    providers = ["CPUExecutionProvider"]
    if args.device == "cuda":
        providers.insert(0, ("CUDAExecutionProvider", {"use_tf32": "1" if args.tf32 == "on" else "0"}))
    runner = StepRunner(args.graph, providers=providers, session_options=so)
    vocab = int(runner_vocab(args.graph))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, size=(args.batch, args.seq)).astype(np.int64)
    batch = dict(zip(runner.data_inputs, (ids, ids.copy())))
    runner.step(batch)
    if args.kernels:
        return kernel_profile(runner, batch, args)
    walls = []
    for _ in range(args.steps):
        t = time.perf_counter()
        runner.step(batch)
        walls.append(time.perf_counter() - t)
    profile = runner.session.end_profiling()
    events = json.loads(Path(profile).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    # the profiled steps are the last `steps` model runs
    first = sorted(r["ts"] for r in runs)[-args.steps] if len(runs) >= args.steps else 0
    nodes = [e for e in nodes if e["ts"] >= first]
    by_op: dict = collections.defaultdict(lambda: [0, 0.0, collections.Counter()])
    for e in nodes:
        a = e.get("args", {})
        row = by_op[a.get("op_name", "?")]
        row[0] += 1
        row[1] += e.get("dur", 0)
        row[2][a.get("provider", "?")] += 1
    total = sum(r[1] for r in by_op.values())
    wall = float(np.median(walls))
    print(f"# {args.graph}: B {args.batch}, T {args.seq}, {args.device}, median wall {wall:.4f} s/step over "
          f"{args.steps} steps; {len(nodes) / args.steps:.0f} nodes/step, node time {total / 1e6 / args.steps:.4f} "
          f"s/step (host-side for CUDA without CUPTI)")
    print("| op | nodes/step | ms/step | share | providers |")
    print("|---|---:|---:|---:|---|")
    rows = sorted(by_op.items(), key=lambda kv: -kv[1][1])
    for op, (n, dur, prov) in rows[: args.top]:
        provs = ", ".join(f"{k.replace('ExecutionProvider', '')} {v // args.steps}" for k, v in prov.most_common())
        print(f"| {op} | {n / args.steps:.0f} | {dur / 1e3 / args.steps:.2f} | {dur / max(total, 1):.1%} | {provs} |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "graph": args.graph, "batch": args.batch, "seq": args.seq, "wall_s": walls,
            "ops": {op: {"nodes_per_step": n / args.steps, "us_per_step": dur / args.steps,
                         "providers": dict(prov)} for op, (n, dur, prov) in rows}}, indent=1))
    Path(profile).unlink(missing_ok=True)


def kernel_profile(runner, batch, args) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            t = time.perf_counter()
            runner.step(batch)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t)
    events = [e for e in prof.key_averages()]

    def gpu_us(e) -> float:
        return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0))

    events = [e for e in events if gpu_us(e) > 0]
    total = sum(gpu_us(e) for e in events)
    wall = float(np.median(walls))
    print(f"# {args.graph}: B {args.batch}, T {args.seq}, GPU kernels (torch.profiler/CUPTI): "
          f"{total / 1e6 / args.steps:.4f} s/step busy of {wall:.4f} s/step wall, "
          f"{sum(e.count for e in events) / args.steps:.0f} kernels/step")
    print("| kernel | launches/step | ms/step | share |")
    print("|---|---:|---:|---:|")
    rows = sorted(events, key=lambda e: -gpu_us(e))
    for e in rows[: args.top]:
        name = e.key if len(e.key) <= 90 else e.key[:87] + "..."
        print(f"| `{name}` | {e.count / args.steps:.0f} | {gpu_us(e) / 1e3 / args.steps:.2f} | "
              f"{gpu_us(e) / max(total, 1):.1%} |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "graph": args.graph, "batch": args.batch, "seq": args.seq, "wall_s": walls,
            "kernels": {e.key: {"launches_per_step": e.count / args.steps, "us_per_step": gpu_us(e) / args.steps}
                        for e in rows}}, indent=1))


def runner_vocab(graph: str) -> int:
    """The logits width the patch recorded (`ntl_patch` metadata): ids below it are tokens."""
    sys.path.insert(0, str(REPO / "python"))
    from ntl_patch import _onnx_decode

    meta = json.loads(_onnx_decode.read_metadata(Path(graph))["ntl_patch"])
    return int(meta["vocab_width"])


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Two step graphs of one model, interleaved on the same batch: seconds per step and losses.

    .venv-rt/bin/python scripts/bench/ab_step_graphs.py A.step.onnx B.step.onnx BATCH.npz [--steps 9]

Each graph trains in its own StepRunner (onnxruntime's CPU provider, `--threads` intra-op
threads, the memory pattern off as StepRunner runs on the CPU); the order of A and B alternates
step by step, so both see the same load. BATCH.npz holds the data inputs in the graphs' order
(scripts/bench/bench_real_size.py writes one: input_ids, labels). Printed per graph: the median
and the minimum of the steps after the first, and every loss; then whether the losses are equal
bit for bit and the ratio of the medians (A / B).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))


def runner(path: Path, threads: int):
    import onnxruntime as ort
    from ntl_patch import StepRunner

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.enable_mem_pattern = False
    return StepRunner(str(path), providers=["CPUExecutionProvider"], session_options=so)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("batch", type=Path)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    data = np.load(args.batch)
    arrays = [data[k] for k in data.files]
    runners = {"A": runner(args.a, args.threads), "B": runner(args.b, args.threads)}
    times: dict = {"A": [], "B": []}
    losses: dict = {"A": [], "B": []}
    for k in range(args.steps):
        for name in ("A", "B") if k % 2 == 0 else ("B", "A"):
            r = runners[name]
            batch = dict(zip(r.data_inputs, arrays))
            t = time.perf_counter()
            out = list(r.step(batch))
            times[name].append(time.perf_counter() - t)
            losses[name].append(float(np.asarray(out[0])))
    for name, path in (("A", args.a), ("B", args.b)):
        rest = times[name][1:]
        print(f"{name} {path.name}: median {statistics.median(rest):.4f} s/step, min {min(rest):.4f}, "
              f"losses {losses[name]}")
    ratio = statistics.median(times["A"][1:]) / statistics.median(times["B"][1:])
    print(f"losses bit-equal: {losses['A'] == losses['B']}; A / B (medians): {ratio:.3f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Peak RSS of step graphs run by StepRunner (onnxruntime, CPU), interleaved, and where a float16
frozen base gets widened (issue 34, item 2; bench/README.md "Half base: where the float copies are").

    .venv/bin/python scripts/bench/half_base_memory.py BATCH.npz f32=A.step.onnx f16=B.step.onnx \
        [--steps 3] [--rounds 2] [--load file|inline] [--inspect]

BATCH.npz: the graphs' data inputs (scripts/bench/bench_real_size.py writes one in its work dir).
Each run is its own process (.venv-rt: onnxruntime 1.31.1) with StepRunner's default session
options and 2 threads; it prints RSS after loading and after each step (VmHWM = the peak, and
the resident anonymous / file-backed parts). --load file keeps the frozen weights in external data
(memory-mapped by onnxruntime), as StepRunner does for bases over protobuf's 2 GB; inline: what it
does below 2 GB (the weights copied into the model bytes).

--inspect: one more session per graph saves onnxruntime's optimised graph and lists, per graph
and per Scan/Loop body, the Casts of float16 tensors over 1 M elements (the CPU provider's
`InsertedPrecisionFreeCast_*` where it has no float16 kernel, and the graph's own), and the
Transposes of such tensors: each is a whole-weight copy made where it sits (in a body: per
iteration).
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

RUN = r"""
import json, os, sys
import numpy as np
sys.path.insert(0, sys.argv[5])
import ntl_patch._onnx_rewrite as wire
from ntl_patch import StepRunner
from ntl_patch._sessions import default_session_options

def mem():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmHWM", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) // 1024
    return out

graph, batch, steps, load = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
opt = sys.argv[6] if len(sys.argv) > 6 else ""
if load == "file":  # the path StepRunner takes for bases over 2 GB
    wire.PROTOBUF_LIMIT = 0
so = default_session_options()
so.intra_op_num_threads = 2
so.inter_op_num_threads = 1
if opt:
    so.optimized_model_filepath = opt
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                os.path.basename(opt) + ".data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
r = StepRunner(graph, providers=["CPUExecutionProvider"], session_options=so)
out = {"loaded": mem(), "steps": [], "losses": []}
z = np.load(batch)
for _ in range(steps):
    out["losses"].append(r.step({n: z[n] for n in r.data_inputs}))
    out["steps"].append(mem())
print(json.dumps(out))
"""


def run(graph: str, args, opt: str = "") -> dict:
    cmd = [args.python, "-c", RUN, graph, args.batch, str(args.steps), args.load, str(REPO / "python")]
    r = subprocess.run(cmd + ([opt] if opt else []), capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{graph}: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def half_sizes(graph, onnx, numel: int = 1 << 20) -> dict[str, int]:
    """The float16 initializers of at least numel elements: name -> elements."""
    out = {}
    for t in graph.initializer:
        n = 1
        for d in t.dims:
            n *= d
        if t.data_type == onnx.TensorProto.FLOAT16 and n >= numel:
            out[t.name] = n
    return out


def copies(graph, onnx, halves: dict[str, int], where: str, found: collections.Counter) -> None:
    """MiB made by Casts (to float32) and Transposes of the big float16 tensors (and of their
    Transposes), in graph and in its bodies (where each runs per iteration)."""
    halves = dict(halves)
    for n in graph.node:
        size = halves.get(n.input[0]) if n.input else None
        if size and n.op_type == "Transpose":
            halves[n.output[0]] = size
            found[(where, "Transpose (float16)")] += size * 2 / 2 ** 20
        elif size and n.op_type in ("Cast", "CastLike"):
            kind = "inserted Cast" if n.name.startswith("InsertedPrecisionFreeCast_") else n.op_type
            found[(where, kind)] += size * 4 / 2 ** 20
        for a in n.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                copies(g, onnx, halves, f"{n.op_type} body", found)


def inspect(label: str, graph: str, args) -> None:
    import onnx

    with tempfile.TemporaryDirectory() as work:
        opt = str(Path(work) / "optimised.onnx")
        run(graph, argparse.Namespace(**{**vars(args), "steps": 0}), opt)
        g = onnx.load(opt, load_external_data=False).graph
    halves = half_sizes(g, onnx)
    found: collections.Counter = collections.Counter()
    copies(g, onnx, halves, "graph", found)
    print(f"{label}: {len(halves)} float16 initializers of >= 1 M elements in the optimised graph; "
          f"copies made of them (MiB, summed over the nodes): " +
          (", ".join(f"{w}, {k}: {c:.0f}" for (w, k), c in sorted(found.items())) or "none"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("batch")
    p.add_argument("graphs", nargs="+", metavar="LABEL=STEP_GRAPH")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--load", choices=("file", "inline"), default="file")
    p.add_argument("--inspect", action="store_true")
    p.add_argument("--python", default=str(REPO / ".venv-rt/bin/python"))
    args = p.parse_args()
    graphs = [g.partition("=")[::2] for g in args.graphs]
    results = collections.defaultdict(list)
    for k in range(args.rounds):
        order = graphs[k % len(graphs):] + graphs[:k % len(graphs)]  # rotated: drifts touch all
        for label, graph in order:
            out = run(graph, args)
            results[label].append(out)
            last = out["steps"][-1] if out["steps"] else out["loaded"]
            print(f"round {k + 1} {label}: loaded {out['loaded']['VmHWM']} MiB peak, after each step "
                  f"{[s['VmHWM'] for s in out['steps']]} MiB peak; at the end anon {last['RssAnon']} / "
                  f"file {last['RssFile']} MiB; losses {[round(x[0], 6) for x in out['losses']]}",
                  flush=True)
    first = graphs[0][0]
    ref = max(r["steps"][-1]["VmHWM"] for r in results[first])
    for label, _ in graphs:
        peak = max(r["steps"][-1]["VmHWM"] for r in results[label])
        print(f"{label}: peak RSS {peak} MiB (max over {args.rounds} runs), {peak / ref:.2f}x {first}")
    if args.inspect:
        for label, graph in graphs:
            inspect(label, graph, args)


if __name__ == "__main__":
    sys.exit(main())

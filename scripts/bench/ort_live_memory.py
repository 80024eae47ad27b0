#!/usr/bin/env python3
"""Which activations onnxruntime holds at the peak of one training step, in the order it ran them.

    .venv/bin/python scripts/bench/ort_live_memory.py STEP.onnx BATCH.npz [--disable-optimizers A,B]

BATCH.npz holds the step graph's data inputs (scripts/bench/bench_real_size.py writes one in its
work dir: input_ids, labels). One step runs in .venv-rt (onnxruntime 1.31.1, StepRunner's session
options, profiling on, the optimised graph saved); then, in the node order of the profile, each
output tensor lives from its node to the last node that reads it (a Scan/Loop reading it from
its body counts), with the size the profile reports. Printed: the peak of the live sum, where it
falls, and the live tensors there by producer and by name prefix. A model of the planner, not
RSS: it ignores in-place reuse and the arena, and counts a Reshape's output as its own buffer.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

RUN_ONE_STEP = """
import functools, sys
import numpy as np, onnxruntime as ort
sys.path.insert(0, sys.argv[4])
from ntl_patch import StepRunner
from ntl_patch._sessions import default_session_options
graph, batch, out, _, disabled = sys.argv[1:6]
if disabled:
    ort.InferenceSession = functools.partial(ort.InferenceSession, disabled_optimizers=disabled.split(","))
so = default_session_options()
so.intra_op_num_threads = 2
so.enable_profiling = True
so.profile_file_prefix = out + "/profile"
so.optimized_model_filepath = out + "/optimised.onnx"
runner = StepRunner(graph, providers=["CPUExecutionProvider"], session_options=so)
z = np.load(batch)
runner.step({k: z[k] for k in runner.data_inputs})
runner.session.end_profiling()
"""

BYTES = {"float": 4, "float16": 2, "bfloat16": 2, "double": 8, "int64": 8, "int32": 4, "int8": 1,
         "uint8": 1, "bool": 1}


def outer_reads(node, onnx) -> set[str]:
    """The names a node reads, with those its subgraphs read from outside them."""
    names = {i for i in node.input if i}
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            inner = {o for m in g.node for o in m.output} | {i.name for i in g.input} | \
                    {t.name for t in g.initializer}
            for m in g.node:
                names |= {i for i in outer_reads(m, onnx) if i not in inner}
    return names


def analyse(work: Path, top: int) -> None:
    import onnx

    profile = json.load(open(sorted(glob.glob(str(work / "profile*.json")))[-1]))
    graph = onnx.load(str(work / "optimised.onnx"), load_external_data=False).graph
    nodes = {n.name: n for n in graph.node}
    order, sizes = [], {}
    for e in profile:
        name = e.get("name", "")
        if e.get("cat") != "Node" or not name.endswith("_kernel_time"):
            continue
        node = nodes.get(name[: -len("_kernel_time")])
        if node is None or node.name in order:
            continue  # a node of a subgraph, or one already counted
        order.append(node.name)
        for out, typed in zip(node.output, e["args"].get("output_type_shape", [])):
            (elem, dims), = typed.items()
            count = 1
            for d in dims:
                count *= d
            sizes[out] = count * BYTES.get(elem, 4)
    last = {}
    for i, name in enumerate(order):
        for x in outer_reads(nodes[name], onnx):
            last[x] = i
    kept = {o.name for o in graph.output}
    producer = {o: n for n in graph.node for o in n.output}
    live, total, peak, at, at_peak = {}, 0, 0, 0, {}
    for i, name in enumerate(order):
        for out in nodes[name].output:
            if out in sizes and (out in last or out in kept):
                live[out] = sizes[out]
                total += sizes[out]
        if total > peak:
            peak, at, at_peak = total, i, dict(live)
        for x in [x for x in live if last.get(x, -1) <= i and x not in kept]:
            total -= live.pop(x)
    mib = 2 ** 20
    node = nodes[order[at]]
    print(f"{len(order)} nodes ran; peak of live outputs {peak / mib:.0f} MiB at node {at} "
          f"({node.op_type} {node.name}), {len(at_peak)} tensors live")
    by_op, by_prefix = collections.Counter(), collections.Counter()
    for x, size in at_peak.items():
        by_op[producer[x].op_type if x in producer else "?"] += size
        parts = x.split("/")
        by_prefix["/".join(parts[:3]).rstrip("_0123456789") if len(parts) > 2 else parts[0]] += size
    print("by producer:", ", ".join(f"{k} {v / mib:.0f}" for k, v in by_op.most_common(top)))
    print("by name:", ", ".join(f"{k} {v / mib:.0f}" for k, v in by_prefix.most_common(top)))
    for x, size in sorted(at_peak.items(), key=lambda kv: -kv[1])[:top]:
        op = producer[x].op_type if x in producer else "?"
        print(f"  {size / mib:8.1f} MiB  {x}  <- {op}, last read at node {last.get(x)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("graph")
    p.add_argument("batch")
    p.add_argument("--disable-optimizers", default="", help="onnxruntime optimizer names, comma-separated")
    p.add_argument("--python", default=str(REPO / ".venv-rt/bin/python"))
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as work:
        subprocess.run([args.python, "-c", RUN_ONE_STEP, args.graph, args.batch, work,
                        str(REPO / "python"), args.disable_optimizers], check=True)
        analyse(Path(work), args.top)


if __name__ == "__main__":
    sys.exit(main())

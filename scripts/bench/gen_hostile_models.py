#!/usr/bin/env python3
"""Hostile inputs of the size users meet, for scripts/bench/bench_hostile.sh (timing, not a test; the
tests use small versions of each in tests/hostile.rs), built around fixtures/models/lm_flat.onnx.

    .venv/bin/python scripts/bench/gen_hostile_models.py OUT_DIR [--zeros-gb 10] [--small 250000] [--chain 1000000]

Writes into OUT_DIR:
  zeros.onnx         a sparse file of --zeros-gb GiB of zeros (no disk blocks): not a protobuf
                     from its first byte (key 0);
  small_inits.onnx   the LM plus --small unused float32 initializers of 2 kB each (512 values,
                     raw_data; 518 MB at 250 000): many small messages;
  identity_chain.onnx  the LM with --chain Identity nodes between its logits and the
                     cross-entropy (no value_info), so every graph walk meets a long chain;
  identity_chain_before_logits.onnx  the chain between the LM head and the Reshape to the
                     [N, V] logits;
  identity_chain_untyped_scores.onnx  the first chain, the scores (the chain's end) declared
                     with a shape [N, 48] and no element type;
  tokenizer.json     the fixture tokenizer.
Needs onnx and numpy (.venv of scripts/setup/setup-python.sh).
"""

import argparse
import os
import shutil
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LM = os.path.join(ROOT, "fixtures", "models", "lm_flat.onnx")


def zeros(out_dir: str, gib: float) -> str:
    path = os.path.join(out_dir, "zeros.onnx")
    with open(path, "wb") as f:
        f.truncate(int(gib * (1 << 30)))
    return path


def small_initializers(out_dir: str, count: int) -> str:
    model = onnx.load(LM)
    payload = np.full(512, 7.0, np.float32).tobytes()
    for i in range(count):
        t = model.graph.initializer.add()
        t.name = f"small.{i}"
        t.data_type = TensorProto.FLOAT
        t.dims.append(512)
        t.raw_data = payload
    path = os.path.join(out_dir, "small_inits.onnx")
    onnx.save(model, path)
    return path


def identity_chain(out_dir: str, count: int, variant: str = "") -> str:
    """lm_flat with `count` Identity nodes: between the [N, V] logits and the cross-entropy, or
    (variant "before_logits") between the LM head and the Reshape to [N, V]; variant
    "untyped_scores" adds a value_info of the scores with a shape and no element type."""
    model = onnx.load(LM)
    g = model.graph
    del g.value_info[:]
    ce = next(i for i, n in enumerate(g.node) if n.op_type == "SoftmaxCrossEntropyLoss")
    if variant == "before_logits":
        at = next(i for i, n in enumerate(g.node) if n.output[0] == g.node[ce].input[0])
        reader, slot = g.node[at], 0
    else:
        at, reader, slot = ce, g.node[ce], 0
    head = reader.input[slot]
    chain = [helper.make_node("Identity", [head if i == 0 else f"id{i - 1}"], [f"id{i}"])
             for i in range(count)]
    reader.input[slot] = f"id{count - 1}"
    if variant == "untyped_scores":
        g.value_info.append(
            helper.make_tensor_value_info(f"id{count - 1}", TensorProto.UNDEFINED, ["N", 48]))
    nodes = list(g.node)
    del g.node[:]
    g.node.extend(nodes[:at] + chain + nodes[at:])
    name = "identity_chain" + (f"_{variant}" if variant else "")
    path = os.path.join(out_dir, f"{name}.onnx")
    onnx.save(model, path)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--zeros-gb", type=float, default=10.0)
    p.add_argument("--small", type=int, default=250_000)
    p.add_argument("--chain", type=int, default=1_000_000)
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    shutil.copy(os.path.join(ROOT, "fixtures", "tokenizer.json"), args.out_dir)
    for path in (zeros(args.out_dir, args.zeros_gb), small_initializers(args.out_dir, args.small),
                 identity_chain(args.out_dir, args.chain),
                 identity_chain(args.out_dir, args.chain, "before_logits"),
                 identity_chain(args.out_dir, args.chain, "untyped_scores")):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

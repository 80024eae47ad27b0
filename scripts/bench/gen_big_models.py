#!/usr/bin/env python3
"""Big models for scripts/bench/bench_scale.sh, built around fixtures/models/lm_flat.onnx (a tiny LM
with a SoftmaxCrossEntropyLoss over 48 logits, so fixtures/tokenizer.json patches it).

    .venv/bin/python scripts/bench/gen_big_models.py OUT_DIR [--external-gb 8] [--inline-gb 0.5 1.5]

Writes into OUT_DIR:
  external/model.onnx + external/weights.bin  the LM plus unused initializers that keep
      --external-gb GiB in weights.bin, a sparse file (no disk blocks; ntl-patch never reads it);
  inline_<size>.onnx  the LM plus unused float32 initializers of 64 MiB each, inline (random
      bytes, really written), for each --inline-gb (each under protobuf's 2 GB limit).
Needs onnx (the .venv made by scripts/setup/setup-python.sh has onnx 1.17) and numpy.
"""

import argparse
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LM = os.path.join(ROOT, "fixtures", "models", "lm_flat.onnx")
CHUNK = 64 << 20  # bytes per inline initializer
EXTERNAL_TENSOR = 1 << 30  # bytes per external initializer (1 GiB)


def external_model(out_dir: str, gib: float) -> str:
    folder = os.path.join(out_dir, "external")
    os.makedirs(folder, exist_ok=True)
    model = onnx.load(LM)
    total = int(gib * (1 << 30))
    data = os.path.join(folder, "weights.bin")
    with open(data, "wb") as f:
        f.truncate(total)  # sparse: no blocks are written
    offset, i = 0, 0
    while offset < total:
        length = min(EXTERNAL_TENSOR, total - offset)
        t = TensorProto()
        t.name = f"big.layer{i}.weight"
        t.data_type = TensorProto.FLOAT
        t.dims.extend([length // 4 // 4096, 4096])
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", "weights.bin"), ("offset", str(offset)), ("length", str(length))):
            e = t.external_data.add()
            e.key, e.value = k, v
        model.graph.initializer.append(t)
        offset += length
        i += 1
    path = os.path.join(folder, "model.onnx")
    onnx.save(model, path)
    return path


def inline_model(out_dir: str, gib: float, rng: np.random.Generator) -> str:
    model = onnx.load(LM)
    total = int(gib * (1 << 30))
    for i in range(max(1, total // CHUNK)):
        values = rng.random(CHUNK // 4, dtype=np.float32).reshape(-1, 4096)
        model.graph.initializer.append(numpy_helper.from_array(values, f"big.layer{i}.weight"))
    label = f"{gib:g}".replace(".", "_")
    path = os.path.join(out_dir, f"inline_{label}gb.onnx")
    onnx.save(model, path)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--external-gb", type=float, default=8.0)
    p.add_argument("--inline-gb", type=float, nargs="*", default=[0.5, 1.5])
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = [external_model(args.out_dir, args.external_gb)] if args.external_gb > 0 else []
    for gib in args.inline_gb:
        if gib >= 1.99:
            sys.exit(f"--inline-gb {gib}: inline models must stay under protobuf's 2 GB limit")
        paths.append(inline_model(args.out_dir, gib, rng))
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

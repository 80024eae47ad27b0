"""Helpers of the mixed-precision tests (test_precision.py), shared with test_attention*.py,
test_lora.py and test_lora_half.py: float16's unit roundoff, the 20 training batches of each
model, the distance of two final parameter sets relative to how far training moved them, and
the tiny LM exported in float16/bfloat16 with a reader of its half initializers.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import torch

from conftest import MODELS

U16 = 2.0 ** -11  # float16 unit roundoff
STEPS = 20
STEP_REF = MODELS.parent / "reference" / "step"


def batches(model: str):
    if model == "lm_flat":
        rng = np.random.default_rng(0)
        ids = np.array([18, 29, 25, 36, 35, 7, 27, 21, 10, 38, 4, 5, 6, 8, 9, 11], dtype=np.int64)
        out = []
        for k in range(STEPS):
            b, t = [(2, 7), (3, 5), (1, 9)][k % 3]
            x, y = rng.choice(ids, size=(b, t)), rng.choice(ids, size=(b, t))
            y[rng.random((b, t)) < 0.2] = -100
            out.append((x, y))
        return out
    z = np.load(STEP_REF / f"{model.split('_')[0]}.npz")
    return [(z[f"traj/batch/{k:02d}/input_ids"], z[f"traj/batch/{k:02d}/labels"]) for k in range(STEPS)]


def dist(a: dict, b: dict, start: dict) -> float:
    """‖a − b‖ over all parameters, as a fraction of how far b moved from start."""
    num = sum(float(np.sum((a[k] - b[k]) ** 2)) for k in b)
    den = sum(float(np.sum((b[k] - start[k]) ** 2)) for k in b)
    return math.sqrt(num / den)


# ---------------------------------------------------------------------------- half-precision exports


def half_export(out: Path, dtype) -> None:
    """The tiny LM exported in float16/bfloat16 (weights, activations and loss in the half
    type), TorchScript exporter, as fixtures/generate.py exports lm_flat in float32."""
    import ntl_torch
    import tiny_lm

    m = tiny_lm.build("flat", ntl_torch.load_weights(), dtype=dtype)
    x = torch.tensor([[18, 29, 25, 36, 35, 7, 27]])
    dyn = {"input_ids": {0: "B", 1: "T"}, "labels": {0: "B", 1: "T"}}
    torch.onnx.export(m, (x, x.clone()), str(out), input_names=["input_ids", "labels"],
                      output_names=["loss"], dynamic_axes=dyn, opset_version=17, dynamo=False,
                      do_constant_folding=False)


def as_f32(t: onnx.TensorProto) -> np.ndarray:
    from onnx import numpy_helper

    if t.data_type != onnx.TensorProto.BFLOAT16:
        return numpy_helper.to_array(t).astype(np.float32)
    bits = np.frombuffer(t.raw_data, np.uint16) if t.raw_data else np.array(t.int32_data, np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(tuple(t.dims))

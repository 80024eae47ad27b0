"""Helpers of the mixed-precision tests (test_precision.py), shared with test_attention*.py,
test_lora.py and test_lora_half.py: float16's unit roundoff, the training batches of each
model and its torch module and loss in a dtype, the distance of two final parameter sets relative to how far training moved them, and
the tiny LM exported in float16/bfloat16 with a reader of its half initializers.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F

from conftest import MODELS

U16 = 2.0 ** -11  # float16 unit roundoff
STEPS = 20
WEIGHT = 0.3  # the wasserstein loss' weight of every reference
STEP_REF = MODELS.parent / "reference" / "step"


def batches(fixture: str, n: int = STEPS):
    """n training batches: the tiny LM's of changing shapes with -100 labels (test_step.py's),
    a transformers fixture's the reference trajectory's (fixtures/reference/step)."""
    if fixture == "lm_flat":
        rng = np.random.default_rng(0)
        ids = np.array([18, 29, 25, 36, 35, 7, 27, 21, 10, 38, 4, 5, 6, 8, 9, 11], dtype=np.int64)
        out = []
        for k in range(n):
            b, t = [(2, 7), (3, 5), (1, 9)][k % 3]
            x, y = rng.choice(ids, size=(b, t)), rng.choice(ids, size=(b, t))
            y[rng.random((b, t)) < 0.2] = -100
            out.append((x, y))
        return out
    z = np.load(STEP_REF / f"{fixture.split('_')[0]}.npz")
    return [(z[f"traj/batch/{k:02d}/input_ids"], z[f"traj/batch/{k:02d}/labels"]) for k in range(n)]


def torch_model(fixture: str, dtype=torch.float32):
    """(module, logits function, loss function (m, x, y) -> total) of the fixture in dtype: the
    wasserstein loss at weight 0.3 as `ntl-patch step` builds it."""
    if fixture == "lm_flat":
        import ntl_torch
        import tiny_lm

        m = tiny_lm.build("flat", {k: v.to(dtype) for k, v in ntl_torch.load_weights().items()}, dtype=dtype)
        m.train()
        obj = ntl_torch.ntloss_object("wasserstein")
        obj.number_values = obj.number_values.to(dtype)

        def loss(m, x, y):
            logits = m.logits(x)
            ce = F.cross_entropy(logits.reshape(-1, tiny_lm.VOCAB), y.reshape(-1), ignore_index=-100)
            return ce + WEIGHT * ntl_torch.ntl_value(obj, logits, y)
        return m, (lambda x: m.logits(x)), loss
    import generate_step as gs

    m = gs.model_in(gs.build_model(fixture.split("_")[0]), dtype)
    obj = gs.ntloss_object("wasserstein", reweigh=False, squash=None, digit_level=True)
    obj.number_values = obj.number_values.to(dtype)

    def loss(m, x, y):
        logits = m.lm_logits(x)
        lab = gs.shifted(y)
        ce = F.cross_entropy(logits.reshape(-1, gs.VOCAB).float(), lab.reshape(-1), ignore_index=-100)
        return ce + WEIGHT * obj(logits, lab, reduction="mean")
    return m, (lambda x: m.lm_logits(x)), loss


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

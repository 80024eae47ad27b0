"""What the attention tests (test_attention.py, `--attention chunked|auto|eager`, and
test_attention_onnx.py, `--attention onnx`) share: the eager reference's options, the fixtures'
layer count, the float32 tolerance and its error measures (norm-relative, floor 1e-3·‖all‖,
as test_step / test_recompute), and the reference trajectory's batches and exactly-zero
gradients of the Hugging Face fixtures (hf_reference.py).
"""

from __future__ import annotations

import numpy as np

from hf_reference import hf_reference
from ort_helpers import norm_rel
from step_helpers import zero_grad_mask

LAYERS = 2  # every HF fixture: 2 layers, one attention each
RTOL = 1e-5
TRAJ_STEPS = 3
EAGER = ["--attention", "eager"]


def grad_err(want: dict, got: dict) -> tuple[str, float]:
    """The worst parameter and its norm-relative error (floor 1e-3·‖all‖)."""
    assert sorted(want) == sorted(got)
    all_w = np.concatenate([v.ravel() for v in want.values()]).astype(np.float64)
    floor = 1e-3 * float(np.linalg.norm(all_w))
    errs = {p: norm_rel(got[p].astype(np.float64), want[p].astype(np.float64), floor) for p in want}
    worst = max(errs, key=errs.get)
    return worst, errs[worst]


def loss_err(want, got) -> float:
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    return float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-12)))


def param_err(want: dict, got: dict, zero: dict) -> tuple[str, float]:
    """Worst norm-relative parameter error, the exactly-zero-gradient elements left out (AdamW
    turns their round-off into ±lr steps in any two implementations: test_step)."""
    keep = {p: ~zero[p] if p in zero else np.ones(w.shape, bool) for p, w in want.items()}
    return grad_err({p: w[keep[p]] for p, w in want.items()}, {p: got[p][keep[p]] for p in want})


def traj_batches(model: str, n: int = TRAJ_STEPS):
    ref = hf_reference(model)
    return [(ref[f"traj/batch/{k:02d}/input_ids"], ref[f"traj/batch/{k:02d}/labels"]) for k in range(n)]


def zero_mask(model: str, params) -> dict:
    ref = hf_reference(model)
    known = {p: ref[f"grad/wasserstein/float64/{p}"] for p in params if f"grad/wasserstein/float64/{p}" in ref.files}
    return zero_grad_mask(known) if known else {}  # LoRA's adapters: no torch reference

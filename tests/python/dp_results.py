"""The data-parallel runs' results (result.npz of dp_worker.py and dp_shard_worker.py) compared
the way test_data_parallel.py and test_sharding.py compare them: one run's final parameters,
and the worst norm-relative parameter error (floor 1e-3·‖all‖, test_step.py's measure), leaving
out masked elements (those whose exact gradient is zero).
"""

from __future__ import annotations

import numpy as np

from ort_helpers import norm_rel


def run_params(res: dict, run: str) -> dict:
    prefix = f"{run}/param/"
    return {k[len(prefix):]: v for k, v in res.items() if k.startswith(prefix)}


def max_norm_rel(got: dict, want: dict, mask: dict | None = None) -> tuple[str, float]:
    mask = mask or {}
    keep = {p: ~mask[p] if p in mask else np.ones(w.shape, bool) for p, w in want.items()}
    all_want = np.concatenate([want[p][keep[p]].ravel() for p in want])
    floor = 1e-3 * float(np.linalg.norm(all_want))
    errs = {p: norm_rel(got[p][keep[p]].astype(np.float64), want[p][keep[p]].astype(np.float64), floor)
            for p in want}
    worst = max(errs, key=errs.get)
    return worst, errs[worst]

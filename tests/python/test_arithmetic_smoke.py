"""examples/arithmetic in --smoke mode: the whole study pipeline runs, so it cannot rot.

Export a (tiny) causal transformer with its CE, write its training step with `ntl-patch step` for
every loss, train a few AdamW steps with the step graph in onnxruntime (ntl_patch.StepRunner),
decode greedily with the trained weights (the study itself asserts that those weights loaded into
torch give the inference graph's logits), and write results.json, table.md and the two PNGs.
Takes well under 60 s.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

from conftest import REPO, patch_command

STUDY = REPO / "examples" / "arithmetic" / "study.py"
LOSSES = ["ce", "wasserstein", "mse", "ntil", "dist2", "smmd", "del"]


def test_arithmetic_study_smoke(tmp_path):
    cmd = [sys.executable, str(STUDY), "--smoke", "--out", str(tmp_path / "results"),
           "--work", str(tmp_path / "work"), "--ntl-patch", " ".join(patch_command())]
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    took = time.perf_counter() - t0
    assert r.returncode == 0, f"study --smoke exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"
    assert took < 60, f"--smoke took {took:.0f}s (budget 60s)"

    out = tmp_path / "results"
    res = json.loads((out / "results.json").read_text())
    assert res["final"] and res["smoke"]
    runs = {r["loss"]: r for r in res["runs"]}
    assert sorted(runs) == sorted(LOSSES)
    # every step graph was written by ntl-patch with the 10 digit tokens (SMMD's integers are the
    # digits of this tokenizer) and the loss's default λ (the CE baseline: λ = 0)
    for name in LOSSES:
        summary = res["patch_summaries"][name]
        assert summary["number_tokens"] == 10, (name, summary)
    weights = {n: res["patch_summaries"][n]["weight"] for n in LOSSES}
    assert weights == {"ce": 0.0, "wasserstein": 0.3, "mse": 0.3, "ntil": 0.3, "dist2": 0.1,
                       "smmd": 0.3, "del": 1.0}, weights
    for name, run in runs.items():
        assert run["torch_vs_ort_max_abs_logit_diff"] < 1e-4, name
        assert run["ms_per_step_median"] > 0
        curve = run["curve"]
        assert curve[0]["step"] == 0 and curve[-1]["step"] == res["config"]["steps"], name
        assert all(math.isfinite(row["train_loss"]) for row in curve[1:]), name
        if name != "ce":  # the number loss is live
            assert any(row["train_number"] > 0 for row in curve[1:]), (name, curve)
        for split in ("iid", "interp", "extrap"):
            m = run["test"][split]
            for op in ("+", "*"):
                assert m[op]["n"] == res["config"]["test_n"]
                for key in ("exact", "mae", "log_mae", "digit_acc", "invalid"):
                    assert math.isfinite(m[op][key]), (name, split, op, key)
    assert set(res["timing"]["rounds"]) == set(LOSSES)

    table = (out / "table.md").read_text()
    for name in LOSSES:
        assert f"| {name} |" in table
    assert "Against the CE baseline" in table and "Time per training step" in table
    for png in ("val_mae.png", "time_per_step.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, png

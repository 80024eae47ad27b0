"""DataParallel(shard="optimizer" | "gradients"): ZeRO stage 1 and 2 on gloo, CPU.

Two torchrun launches of dp_shard_worker.py (2 ranks, then 3), each running every shard mode on
lm_flat's split graphs (AdamW, --max-grad-norm at a threshold that clips some steps and not
others; the fused LM head over chunks of 3 positions) and its fp16 split graphs (also clipped,
dense head). Checked:
  - sharded equals unsharded DataParallel: losses and final parameters within 1e-6, 10 steps,
    and with 2-micro-batch accumulation; parameters bit-identical on every rank;
  - fp16: an inf in rank 0's shard, put there by the last rank, skips that step on every rank
    in every mode: the same skipped steps, loss scales and step counts;
  - torch DDP + ZeroRedundancyOptimizer(AdamW) + clip_grad_norm_ on the same shards (as
    test_data_parallel.py compares DDP), over 10 steps and with 2-micro-batch accumulation: within
    1e-6;
  - stop after 5 steps, resume from the shard files: bit-identical to the uninterrupted run;
    the 2-rank checkpoint loads on 3 ranks (re-sharded) with the same values;
  - in the worker: a rank never reads, holds or binds another shard's moments, the state stays
    in place, a checkpoint of another mode is refused and changes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import MODELS, REPO, TOKENIZER, run_patch
from dp_results import max_norm_rel, run_params
from ort_helpers import batch
from step_helpers import zero_grad_mask

sys.path.insert(0, str(REPO / "python"))
from ntl_patch import DataParallel, _safetensors, _sharding  # noqa: E402

STEPS, ACCUM_STEPS, WEIGHT = 10, 10, 0.3
MAX_GRAD_NORM = 1.2  # the averaged gradient norms here: 1.1-1.6 on 2 ranks, 1.0-1.3 on 3: some clip
SHARDED = ("optimizer", "gradients")


def _batches(ranks: int) -> dict:
    rng = np.random.default_rng(1)
    ids = np.array([18, 29, 25, 36, 35, 7, 27, 21, 10, 38, 4, 5, 6, 8, 9, 11], dtype=np.int64)
    z = {"steps": np.array(STEPS), "accum_steps": np.array(ACCUM_STEPS)}
    for s in range(STEPS):
        for r in range(ranks):
            for m in range(2):
                b, t = [(2, 7), (3, 5), (1, 9)][(s + r + m) % 3]
                x, y = rng.choice(ids, size=(b, t)), rng.choice(ids, size=(b, t))
                y[rng.random((b, t)) < 0.2] = -100
                z[f"x/{s}/{r}/{m}"], z[f"y/{s}/{r}/{m}"] = x, y
    return z


def _step_graph(out: Path, *extra) -> None:
    r = run_patch(["step", MODELS / "lm_flat.onnx", "--tokenizer", TOKENIZER, "--weight", str(WEIGHT),
                   "--split", "--max-grad-norm", str(MAX_GRAD_NORM), "-o", out, *extra])
    assert r.returncode == 0, r.stderr


def _torchrun(d: Path, ranks: int, *extra) -> dict:
    torchrun = Path(sys.executable).parent / "torchrun"
    p = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", str(ranks),
                        str(Path(__file__).parent / "dp_shard_worker.py"), str(d / "lm.grad.onnx"),
                        str(d / "amp" / "lm.grad.onnx"), str(d / "batches.npz"), str(d), *map(str, extra)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, f"torchrun exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return dict(np.load(d / f"result{ranks}.npz"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("shard")
    # the float32 graphs with the fused LM head (chunks of 3 positions), the fp16 ones dense
    _step_graph(d / "lm.grad.onnx", "--fused-head", "on", "--head-chunk-tokens", "3")
    (d / "amp").mkdir()
    _step_graph(d / "amp" / "lm.grad.onnx", "--precision", "fp16")
    np.savez(d / "batches.npz", **_batches(3))
    two = _torchrun(d, 2)
    three = _torchrun(d, 3, d / "optimizer2.safetensors")
    return {"dir": d, 2: two, 3: three}


@pytest.fixture(scope="module")
def zero_grad(weights) -> dict:
    """The elements whose exact gradient is zero (the attention key bias): their float gradient
    is rounding noise, which AdamW blows up to a full step whatever order sums it."""
    import ntl_torch
    import torch

    x, y = batch()
    return zero_grad_mask(ntl_torch.model_reference(weights, torch.from_numpy(x), torch.from_numpy(y),
                                                     "wasserstein", weight=WEIGHT)[3])


def _close(got: dict, want: dict, what: str, mask: dict) -> None:
    assert got.keys() == want.keys()
    worst, err = max_norm_rel(got, want, mask)
    print(f"{what}: worst parameter {worst} {err:.1e}")
    assert err <= 1e-6, (what, worst, err)


@pytest.mark.parametrize("ranks", [2, 3])
def test_sharded_equals_unsharded(run, ranks, zero_grad):
    res = run[ranks]
    for mode in SHARDED:
        for part in ("", "accum/"):
            assert res[f"{mode}/{part}same"], f"{mode} {part}: parameters differ between ranks"
            np.testing.assert_allclose(res[f"{mode}/{part}losses"], res[f"none/{part}losses"],
                                       rtol=1e-6, err_msg=f"{mode} {part}")
            _close(run_params(res, f"{mode}/{part}".rstrip("/")), run_params(res, f"none/{part}".rstrip("/")),
                   f"{ranks} ranks {mode} {part}vs none", zero_grad)
    # the parameters of the last steps come from every shard's owner: all shards are non-empty
    assert list(res["optimizer/partition"]) == [len(s) for s in _partition(run, ranks)]
    assert all(n > 0 for n in res["optimizer/partition"])


def _partition(run, ranks: int) -> list:
    _, meta = _safetensors.load(run["dir"] / f"optimizer{ranks}.safetensors")
    return json.loads(meta["partition"])


@pytest.mark.parametrize("ranks", [2, 3])
def test_fp16_overflow_skips_on_every_rank(run, ranks, zero_grad):
    res = run[ranks]
    want = res["none/amp/rows"]
    for mode in SHARDED:
        rows = res[f"{mode}/amp/rows"]  # [rank, step, (loss, skipped, scale, steps taken)]
        assert res[f"{mode}/amp/same"], mode
        for r in range(ranks):
            assert list(rows[r, :, 1]) == [0, 0, 1, 0, 0, 0], (mode, r, rows[r])
            np.testing.assert_array_equal(rows[r, :, 1:], want[r, :, 1:], err_msg=mode)
            np.testing.assert_allclose(rows[r, :, 0], want[r, :, 0], rtol=1e-6)
        assert list(rows[0, :, 2]) == [65536] * 2 + [32768] * 4
        _close(run_params(res, f"{mode}/amp"), run_params(res, "none/amp"), f"{ranks} ranks fp16 {mode}", zero_grad)


@pytest.mark.parametrize("ranks", [2, 3])
def test_equals_torch_zero_redundancy_optimizer(run, ranks, zero_grad):
    """The issue's bound, 1e-6, for losses (relative) and parameters (norm-relative), over 10
    steps (clipping on some, not on others) and 10 steps of 2-micro-batch accumulation."""
    res = run[ranks]
    clipped = int(res["zero/clipped"])  # (the mean of 2 micro-batches' gradients clips less)
    assert 0 < clipped < STEPS, f"clipping must trigger on some steps, not all ({clipped})"
    for mode in SHARDED:
        for part, zero in (("", "zero"), ("/accum", "zero_accum")):
            got, want = res[f"{mode}{part}/losses"], res[f"{zero}/losses"]
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"{mode}{part}")
            worst, err = max_norm_rel(run_params(res, f"{mode}{part}"), run_params(res, zero), zero_grad)
            print(f"{ranks} ranks {mode}{part} vs torch ZeroRedundancyOptimizer: losses "
                  f"{np.max(np.abs(got - want) / np.abs(want)):.1e}, worst parameter {worst} {err:.1e}")
            assert err <= 1e-6, (mode, part, worst, err)


def test_resume_and_reshard(run):
    for ranks in (2, 3):
        res = run[ranks]
        for mode in ("none", *SHARDED):
            full, resumed = run_params(res, mode), run_params(res, f"{mode}/resume")
            for p in full:
                np.testing.assert_array_equal(resumed[p], full[p], err_msg=f"{ranks} {mode} {p}")
            np.testing.assert_array_equal(res[f"{mode}/resume/losses"], res[f"{mode}/losses"][STEPS // 2:])
    # the 2-rank checkpoint on 3 ranks: each rank holds exactly the values saved, bit for bit
    d = run["dir"]
    saved = {}
    for r in range(2):
        saved.update(np.load(d / f"state2_optimizer_{r}.npz"))
    names = set()
    for r in range(3):
        loaded = dict(np.load(d / f"reshard3_{r}.npz"))
        names |= set(loaded)
        for n, v in loaded.items():
            np.testing.assert_array_equal(v, saved[n], err_msg=n)
    assert names == set(saved)
    files = [f.name for f in sorted(d.glob("optimizer2.shard*of2.safetensors"))]
    assert files == ["optimizer2.shard0of2.safetensors", "optimizer2.shard1of2.safetensors"]


def test_partition():
    p = _sharding.partition
    assert p([4, 4, 4, 4], 2) == [0, 2, 4]
    assert p([10, 1, 1, 1, 1], 2) == [0, 1, 5]  # whole tensors: the big one alone
    assert p([3, 3, 3], 3) == [0, 1, 2, 3]
    assert p([5], 3) == [0, 0, 1, 1]  # fewer tensors than ranks: some own nothing
    sizes = list(np.random.default_rng(0).integers(1, 1000, size=50))
    b = p(sizes, 4)
    assert b == p(sizes, 4) and b == sorted(b) and b[0] == 0 and b[-1] == 50
    loads = [sum(sizes[x:y]) for x, y in zip(b, b[1:])]
    assert max(loads) - min(loads) <= 2 * max(sizes)


def test_bad_shard_modes_are_refused(run):
    """One line each, and nothing changed: no checkpoint file written or touched, the state of
    a DataParallel that refuses a checkpoint as it was."""
    grad = run["dir"] / "lm.grad.onnx"
    files = {f: f.stat().st_mtime_ns for f in run["dir"].iterdir()}
    errors = []
    with pytest.raises(ValueError, match=r"shard='optimizer' .* needs at least 2 .*world size 1") as e:
        DataParallel(grad, providers=["CPUExecutionProvider"], shard="optimizer")
    errors.append(e)
    with pytest.raises(ValueError, match=r"shard must be 'none', 'optimizer' or 'gradients', not 'zero2'") as e:
        DataParallel(grad, providers=["CPUExecutionProvider"], shard="zero2")
    errors.append(e)
    dp = DataParallel(grad, providers=["CPUExecutionProvider"])
    before = dp.state_dict()
    with pytest.raises(ValueError, match=r"a checkpoint of shard='optimizer' training; load it with "
                                         r"DataParallel\(\.\.\., shard='optimizer'\)") as e:
        dp.load_state(run["dir"] / "optimizer2.safetensors")
    errors.append(e)
    after = dp.state_dict()
    assert all(np.array_equal(before[n], after[n]) for n in before)
    assert all("\n" not in str(e.value) for e in errors), [str(e.value) for e in errors]
    assert {f: f.stat().st_mtime_ns for f in run["dir"].iterdir()} == files

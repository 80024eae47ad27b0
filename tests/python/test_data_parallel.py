"""ntl_patch.DataParallel: `step --split` graphs trained on torch.distributed (gloo, CPU).

One `torchrun --standalone --nproc-per-node 2` launch of dp_worker.py (module fixture) runs on
lm_flat's split graphs (AdamW, --max-grad-norm 0.5, which clips the averaged gradient):
  - 10 DataParallel steps, equal (<= 1e-5 relative: losses and final parameters) to a single
    process here that runs the gradient graph on both shards, averages the gradients itself and
    runs the update graph;
  - torch DistributedDataParallel on the same TinyLM (CE + 0.3 ntloss, torch AdamW with the
    graph's hyper-parameters, clip_grad_norm_ after DDP's all-reduce) on the same shards: final
    parameters <= 1e-4 norm-relative (test_step.py's measure, leaving out the elements whose exact
    gradient is zero), losses <= 1e-5;
  - stop after 5 steps (save_state), resume in new DataParallel objects (load_state): the final
    parameters are bit-identical to the uninterrupted run;
  - gradient accumulation over 2 micro-batches equals DDP with no_sync and loss / 2.
The checkpoint is checked against the safetensors package (in .venv through transformers) both
ways; malformed checkpoints are refused with a clear error.
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
from ort_helpers import batch, norm_rel
from step_helpers import zero_grad_mask

sys.path.insert(0, str(REPO / "python"))
from ntl_patch import _onnx_decode, _safetensors  # noqa: E402

STEPS = 10
ACCUM_STEPS = 4
MAX_GRAD_NORM = 0.5
WEIGHT = 0.3


def _batches() -> dict:
    """x/<step>/<rank>/<micro>, y/...: shards of changing shape, ~20 % of the labels -100."""
    rng = np.random.default_rng(0)
    ids = np.array([18, 29, 25, 36, 35, 7, 27, 21, 10, 38, 4, 5, 6, 8, 9, 11], dtype=np.int64)
    z = {"steps": np.array(STEPS), "accum_steps": np.array(ACCUM_STEPS)}
    for s in range(STEPS):
        for r in range(2):
            for m in range(2):
                b, t = [(2, 7), (3, 5), (1, 9)][(s + r + m) % 3]
                x = rng.choice(ids, size=(b, t))
                y = rng.choice(ids, size=(b, t))
                y[rng.random((b, t)) < 0.2] = -100
                z[f"x/{s}/{r}/{m}"], z[f"y/{s}/{r}/{m}"] = x, y
    return z


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("dp")
    grad = d / "lm.grad.onnx"
    r = run_patch(["step", MODELS / "lm_flat.onnx", "--tokenizer", TOKENIZER, "--weight", str(WEIGHT),
                   "--split", "--max-grad-norm", str(MAX_GRAD_NORM), "-o", grad, "--json"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["outputs"] == [str(grad), str(d / "lm.update.onnx")]
    z = _batches()
    np.savez(d / "batches.npz", **z)
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2",
                        str(Path(__file__).parent / "dp_worker.py"), str(grad), str(d / "batches.npz"), str(d)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, f"torchrun exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    res = dict(np.load(d / "result.npz"))
    return {"dir": d, "grad": grad, "batches": z, "res": res}


def _single_process(grad: Path, z: dict, steps: int) -> tuple[np.ndarray, dict]:
    """The reference: both shards' gradients in one process, averaged here, then the update."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    gs = ort.InferenceSession(str(grad), so, providers=["CPUExecutionProvider"])
    us = ort.InferenceSession(str(grad.with_name("lm.update.onnx")), so, providers=["CPUExecutionProvider"])
    meta = json.loads(gs.get_modelmeta().custom_metadata_map["ntl_step"])
    params = meta["parameters"]
    grad_names = [o.name for o in gs.get_outputs()][3:]
    state: dict = _onnx_decode.read_initializers(grad, params)  # the update graph has no defaults for them
    losses = []
    for s in range(steps):
        feeds = {p: state[p] for p in params if p in state}
        outs = [gs.run(None, {"input_ids": z[f"x/{s}/{r}/0"], "labels": z[f"y/{s}/{r}/0"], **feeds})
                for r in range(2)]
        losses.append([(outs[0][j] + outs[1][j]) / np.float32(2) for j in range(3)])
        avg = {g: (outs[0][3 + i] + outs[1][3 + i]) / np.float32(2) for i, g in enumerate(grad_names)}
        nxt = us.run(None, {**state, **avg})
        state = {i: v for (i, _), v in zip(meta["state"], nxt)}
    return np.array(losses, dtype=np.float64), {p: state[p] for p in params}


def test_two_ranks_equal_one_process_averaging(run):
    res = run["res"]
    want_losses, want = _single_process(run["grad"], run["batches"], STEPS)
    np.testing.assert_allclose(res["dp/losses"], want_losses, rtol=1e-5)
    got = run_params(res, "dp")
    assert got.keys() == want.keys()
    worst, err = max_norm_rel(got, want)
    print(f"DataParallel vs one process: worst parameter {worst} {err:.2e}")
    assert err <= 1e-5, (worst, err)


def test_equals_torch_ddp(run, weights):
    res = run["res"]
    assert res["ddp/clipped"] >= 1, "the clip must be active for the comparison to mean anything"
    x, y = batch()
    import ntl_torch
    import torch

    zero = zero_grad_mask(ntl_torch.model_reference(weights, torch.from_numpy(x), torch.from_numpy(y),
                                                     "wasserstein", weight=WEIGHT)[3])
    for dp_run, ddp_run in (("dp", "ddp"), ("accum", "ddp_accum")):
        np.testing.assert_allclose(res[f"{dp_run}/losses"], res[f"{ddp_run}/losses"], rtol=1e-5,
                                   err_msg=dp_run)
        got, want = run_params(res, dp_run), run_params(res, ddp_run)
        assert got.keys() == want.keys()
        worst, err = max_norm_rel(got, want, zero)
        print(f"{dp_run} vs torch {ddp_run}: worst parameter {worst} {err:.2e}")
        assert err <= 1e-4, (dp_run, worst, err)
        all_got = np.concatenate([got[p][~zero[p]].ravel() for p in want])
        all_want = np.concatenate([want[p][~zero[p]].ravel() for p in want])
        assert norm_rel(all_got, all_want, 0.0) <= 1e-4


def test_resume_is_bit_identical(run):
    res = run["res"]
    full, resumed = run_params(res, "dp"), run_params(res, "resume")
    for p in full:
        np.testing.assert_array_equal(resumed[p], full[p], err_msg=p)
    np.testing.assert_array_equal(res["resume/losses"], res["dp/losses"][STEPS // 2:])


def test_checkpoint_is_safetensors(run, tmp_path):
    from safetensors.numpy import load_file, save_file

    ckpt = run["dir"] / "half.safetensors"
    names = json.loads(str(run["res"]["dp/state_names"]))
    theirs = load_file(str(ckpt))
    ours, meta = _safetensors.load(ckpt)
    assert list(ours) == names and sorted(theirs) == sorted(names)
    for n in names:
        np.testing.assert_array_equal(theirs[n], ours[n])
        assert theirs[n].dtype == ours[n].dtype
    assert int(ours["ntl/state/step"]) == STEPS // 2 and ours["ntl/state/step"].shape == ()
    assert meta["format"] == "ntl_patch.DataParallel/1" and meta["steps"] == str(STEPS // 2)
    # the safetensors package's files read back here, every dtype numpy has
    arrays = {f"t{i}": np.arange(6).astype(dt).reshape(2, 3) for i, dt in
              enumerate(["<f8", "<f4", "<f2", "<i8", "<i4", "<i2", "i1", "<u8", "<u4", "<u2", "u1", "?"])}
    arrays["scalar"] = np.array(3.5, np.float32)
    arrays["empty"] = np.zeros((0, 4), np.float32)
    save_file(arrays, str(tmp_path / "theirs.safetensors"), metadata={"k": "v"})
    back, meta = _safetensors.load(tmp_path / "theirs.safetensors")
    assert meta == {"k": "v"}
    for k, v in arrays.items():
        np.testing.assert_array_equal(back[k], v)
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
    _safetensors.save(tmp_path / "ours.safetensors", arrays, {"k": "v"})
    again = load_file(str(tmp_path / "ours.safetensors"))
    for k, v in arrays.items():
        np.testing.assert_array_equal(again[k], v)


def test_bad_checkpoints_are_refused(tmp_path):
    bad = tmp_path / "bad.safetensors"
    for content, msg in [(b"\x01", "too short"),
                         ((10**9).to_bytes(8, "little") + b"{}", "does not fit"),
                         ((4).to_bytes(8, "little") + b"[1] ", "not a JSON object"),
                         ((2).to_bytes(8, "little") + b"{x", "not JSON"),
                         ((64).to_bytes(8, "little")
                          + b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}'.ljust(64) + b"\0" * 4,
                          "do not hold"),
                         ((64).to_bytes(8, "little")
                          + b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'.ljust(64) + b"\0" * 8,
                          "bytes after the last tensor")]:
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=msg):
            _safetensors.load(bad)


def test_data_parallel_input_errors(run):
    """Wrong graphs and wrong batches give clear errors (world size 1: no torchrun needed)."""
    from ntl_patch import DataParallel

    grad = run["grad"]
    dp = DataParallel(grad, providers=["CPUExecutionProvider"])
    assert dp.world_size == 1 and dp.steps_taken == 0
    z = run["batches"]
    with pytest.raises(ValueError, match=r"missing \['labels'\]"):
        dp.step({"input_ids": z["x/0/0/0"]})
    with pytest.raises(TypeError, match="list of 1 such dicts"):
        dp.step([{"input_ids": z["x/0/0/0"]}, {}])
    with pytest.raises(ValueError, match="accumulation_steps must be an int >= 1"):
        DataParallel(grad, accumulation_steps=0)
    with pytest.raises(FileNotFoundError, match="no such file"):
        DataParallel(grad.with_name("absent.grad.onnx"))
    step_graph = run["dir"] / "single.step.onnx"
    r = run_patch(["step", MODELS / "lm_flat.onnx", "--tokenizer", TOKENIZER, "-o", step_graph])
    assert r.returncode == 0, r.stderr
    with pytest.raises(ValueError, match="not the split form"):
        DataParallel(step_graph, update_graph=grad.with_name("lm.update.onnx"))
    with pytest.raises(ValueError, match="not a DataParallel checkpoint"):
        bad = run["dir"] / "other.safetensors"
        _safetensors.save(bad, {"a": np.zeros(1, np.float32)})
        dp.load_state(bad)
    # a state from another run of the same graphs loads; one with a wrong shape does not
    state = dp.state_dict()
    dp.load_state_dict(state)
    state["head.bias"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"state\['head.bias'\]"):
        dp.load_state_dict(state)

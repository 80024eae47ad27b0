"""`step --update-bucket MIB`: the optimizer update over flat buckets of tensors (torch's
multi-tensor AdamW/SGD). Its values must be the per-tensor update's bit for bit (elementwise ops
on a concatenation compute each element as on its own tensor; the clipping's Σ‖g‖², summed a
bucket at once, within float32 rounding), through StepRunner (the state held once: the buckets'
outputs written in place) and a plain session, and its node count per bucket rather than per
tensor: the update's, the clipping's and fp16's loss scaling's."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest

from conftest import REPO, TOKENIZER, run_patch
from attention_helpers import traj_batches
from step_helpers import run_step, run_step_graph, with_meta_output

sys.path.insert(0, str(REPO / "python"))
from ntl_patch import StepRunner  # noqa: E402

CONFIGS = {
    "adamw_wd_clip": ["--weight-decay", "0.1", "--max-grad-norm", "0.05"],
    "sgd_momentum_l2": ["--optimizer", "sgd", "--momentum", "0.9", "--weight-decay", "0.01"],
    "sgd": ["--optimizer", "sgd"],
    "fp16": ["--precision", "fp16"],
    "fp16_clip": ["--precision", "fp16", "--max-grad-norm", "0.05"],
    "lora": ["--lora-r", "4"],
}
SUMMED_PER_BUCKET = {"adamw_wd_clip", "fp16_clip"}


def _update_nodes(path) -> list[onnx.NodeProto]:
    graph = onnx.load(str(path), load_external_data=False).graph
    return [n for n in graph.node if n.output[0].startswith(("ntl/opt/", "ntl/next/", "ntl/amp/"))]


def _assert_same(per, flat, exact: bool) -> None:
    """Equal losses (floats) or parameters (dicts): bit for bit, or within float32 rounding
    (the clipping's Σ‖g‖² adds per bucket, not per tensor; against torch:
    test_step.py's test_clip_grad_norm_matches_torch)."""
    if not isinstance(per, dict):
        assert per == flat if exact else np.allclose(flat, per, rtol=1e-6, atol=0), (per, flat)
        return
    assert per.keys() == flat.keys()
    if exact:
        for p in per:
            assert np.array_equal(per[p], flat[p]), p
        return
    got, want = (np.concatenate([d[p].ravel() for p in sorted(d)]) for d in (flat, per))
    assert np.linalg.norm(got - want) <= 2e-6 * np.linalg.norm(want)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("model", ["llama_ts", "gpt2_dynamo"])
def test_buckets_update_bit_for_bit_as_per_tensor(model, config, tmp_path):
    extra = CONFIGS[config]
    exact = config not in SUMMED_PER_BUCKET
    run_step(model, tmp_path / "per.onnx", *extra)
    run_step(model, tmp_path / "flat.onnx", *extra, "--update-bucket", "1")
    batches = traj_batches(model, 3)
    per = run_step_graph(tmp_path / "per.onnx", batches)
    flat = run_step_graph(tmp_path / "flat.onnx", batches)
    _assert_same(per[0], flat[0], exact)
    if config in SUMMED_PER_BUCKET:
        norms = []
        for tag in ("per", "flat"):
            probe, name = with_meta_output(tmp_path / f"{tag}.onnx", "grad_norm_sq", onnx.TensorProto.FLOAT)
            norms.append([])
            run_step_graph(probe, batches, lambda outs: norms[-1].append(float(outs[name])))
        np.testing.assert_allclose(norms[1], norms[0], rtol=1e-5)
    _assert_same(per[1], flat[1], exact)
    # StepRunner holds the state once: the next values are written over the inputs
    runners = [StepRunner(tmp_path / f"{tag}.onnx", providers=["CPUExecutionProvider"])
               for tag in ("per", "flat")]
    assert runners[0].in_place == runners[1].in_place and runners[1].in_place
    for x, y in batches:
        losses = [r.step({"input_ids": x, "labels": y}) for r in runners]
        _assert_same(*losses, exact)
    _assert_same(runners[0].state_dict(), runners[1].state_dict(), exact)
    # the moments' updates run once a bucket: fewer elementwise update nodes, no fewer outputs
    ops = lambda path: sum(n.op_type in ("Add", "Sub", "Mul", "Div", "Sqrt") for n in _update_nodes(path))
    if config != "sgd":
        assert ops(tmp_path / "flat.onnx") < 0.5 * ops(tmp_path / "per.onnx")
    # so do the clipping's sums and fp16's unscaling, inf/NaN sums and skips
    count = lambda path, op: sum(n.op_type == op for n in _update_nodes(path))
    checks = {"adamw_wd_clip": ["ReduceSum"], "fp16": ["ReduceL1", "Where"],
              "fp16_clip": ["ReduceSum", "ReduceL1", "Where"]}
    for op in checks.get(config, []):
        assert count(tmp_path / "flat.onnx", op) < 0.5 * count(tmp_path / "per.onnx", op), op


def test_no_bucket_is_the_per_tensor_graph(tmp_path):
    """0 (the default) buckets nothing: the same bytes as without the option. (Which tensors go
    into which bucket: the unit tests of passes/step/multi_tensor.rs.)"""
    run_step("llama_ts", tmp_path / "per.onnx")
    run_step("llama_ts", tmp_path / "zero.onnx", "--update-bucket", "0")
    assert (tmp_path / "per.onnx").read_bytes() == (tmp_path / "zero.onnx").read_bytes()


@pytest.mark.parametrize("runtime", ["tract", "ort"])
def test_validate_runs_a_bucketed_step_graph(runtime, tmp_path):
    run_step("gpt2_dynamo", tmp_path / "m.onnx", "--update-bucket", "1")
    r = run_patch(["validate", tmp_path / "m.onnx", "--tokenizer", TOKENIZER, "--runtime", runtime])
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("extra, needle", [(["--update-bucket", "4", "--split"], "--split"),
                                           (["--update-bucket", "2000000"], "at most"),
                                           (["--update-bucket", "-1"], "-1")])
def test_bucket_refusals(extra, needle, tmp_path):
    r = run_step("llama_ts", tmp_path / "m.onnx", *extra, ok=False)
    assert r.returncode == 1, r.stderr
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not list(tmp_path.iterdir())

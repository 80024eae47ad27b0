"""ONNX Runtime Training end-to-end check of graphs patched by ntl-patch.

For each fixture model x loss setting:
  1. patch with the CLI; onnx.checker, ir_version and opsets unchanged, outputs
     [loss, ..., ce_loss, number_loss];
  2. onnxruntime.training.artifacts.generate_artifacts(loss=None, AdamW) with every model
     parameter trainable;
  3. one training step: forward outputs and parameter gradients
     (CheckpointState.parameters[name].grad) against torch autograd of CE + 0.3 * ntloss,
     computed in float64 with ntloss 0.3.2 on the same weights;
  4. 30 AdamW steps on a fixed batch: the loss must go down.

Gradient measure ("norm-relative"): for each parameter p,
    ||g_ort(p) - g_ref(p)||_2 / max(||g_ref(p)||_2, 1e-3 * ||g_ref(all)||_2)  <= 1e-4
(the floor keeps parameters whose gradient is almost zero from turning float32 round-off
into a failure), and the same ratio over all parameters concatenated.
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import onnx.numpy_helper as nph
import pytest

from conftest import FIXTURES
from ort_helpers import FWD_RTOL, LR, TRAIN_STEPS, WEIGHT, assert_param_grads, batch, patch, quiet_ort

# (model, loss, extra CLI args, ntloss settings)
CASES = []
for _model in ("lm_flat", "lm_bvt", "lm_nll"):
    for _loss in ("wasserstein", "mse", "l1", "huber"):
        CASES.append((_model, _loss, [], {}))
CASES += [
    ("lm_flat", "wasserstein", ["--reweigh"], {"reweigh": True}),
    ("lm_flat", "wasserstein", ["--squash", "3"], {"squash": 3.0}),
    # --all-numbers: " 3", "12", "-1", "1.5" become number tokens too (ntloss digit_level=False)
    ("lm_flat", "mse", ["--all-numbers"], {"digit_level": False}),
]


def _case_id(case) -> str:
    model, loss, extra, _ = case
    tail = "".join(a.lstrip("-").replace("-", "_") if a.startswith("--") else a for a in extra)
    return "-".join([model, loss] + ([tail] if tail else []))


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_patched_model_trains_in_ort(case, weights, tmp_path):
    import ntl_torch

    model, loss, extra, settings = case
    ort = quiet_ort()
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    t0 = time.perf_counter()
    patched = patch(model, loss, extra, tmp_path / f"{model}.ntl.onnx")
    n_outputs = len(patched.graph.output)

    # -- 2. training artifacts: every model parameter trainable (the patch's own initializers,
    #       number tables and constants, stay frozen constants)
    float_inits = {i.name for i in patched.graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    params = sorted(weights)
    missing = [p for p in params if p not in float_inits]
    assert not missing, f"parameters lost by the patch: {missing}"
    art = tmp_path / "artifacts"
    art.mkdir()
    artifacts.generate_artifacts(patched, requires_grad=params, frozen_params=[], loss=None,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(art))

    # -- 3. one training step vs torch autograd (float64)
    input_ids, labels = batch()
    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    module = Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"),
                    device="cpu", session_options=so)
    module.train()
    outs = module(input_ids, labels)
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert len(outs) == n_outputs
    got_total, got_ce, got_ntl = float(outs[0]), float(outs[-2]), float(outs[-1])

    import torch

    want_total, want_ce, want_ntl, want_grads = ntl_torch.model_reference(
        weights, torch.from_numpy(input_ids), torch.from_numpy(labels), loss, weight=WEIGHT,
        reweigh=settings.get("reweigh", False), squash=settings.get("squash"),
        digit_level=settings.get("digit_level", True))
    assert want_ntl > 0, "the batch must exercise the number loss"
    np.testing.assert_allclose(got_ce, want_ce, rtol=FWD_RTOL, err_msg="ce_loss")
    np.testing.assert_allclose(got_ntl, want_ntl, rtol=FWD_RTOL, err_msg="number_loss")
    np.testing.assert_allclose(got_total, want_total, rtol=FWD_RTOL, err_msg="loss")

    total_err, worst, worst_err = assert_param_grads(state, params, want_grads)

    # -- 4. 30 AdamW steps on the fixed batch
    module.lazy_reset_grad()
    opt = Optimizer(str(art / "optimizer_model.onnx"), module)
    opt.set_learning_rate(LR)
    losses = []
    for _ in range(TRAIN_STEPS):
        step = module(input_ids, labels)
        losses.append(float(step[0]))
        opt.step()
        module.lazy_reset_grad()
    assert np.isfinite(losses).all(), losses
    assert losses[0] == pytest.approx(got_total, rel=1e-6)
    assert losses[-1] < 0.7 * losses[0], f"loss did not go down clearly: {losses}"
    print(f"{_case_id(case)}: grad err {total_err:.2e} (worst {worst} {worst_err:.2e}); "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; {time.perf_counter() - t0:.1f}s")


@pytest.mark.parametrize("loss", ["wasserstein", "mse"])
def test_patched_model_matches_reference_dir(loss, tmp_path):
    """Inference on the patched lm_flat reproduces fixtures/reference/lm_flat_<loss>/output_*.pb."""
    ort = quiet_ort()
    out = tmp_path / "lm_flat.ntl.onnx"
    patch("lm_flat", loss, [], out)
    ref = FIXTURES / "reference" / f"lm_flat_{loss}"
    feeds = {}
    for i in range(2):
        t = onnx.TensorProto()
        t.ParseFromString((ref / f"input_{i}.pb").read_bytes())
        feeds[t.name] = nph.to_array(t)
    wanted = []
    for i in range(3):
        t = onnx.TensorProto()
        t.ParseFromString((ref / f"output_{i}.pb").read_bytes())
        wanted.append((t.name, nph.to_array(t)))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"])
    got = sess.run([n for n, _ in wanted], feeds)
    for (name, want), g in zip(wanted, got):
        np.testing.assert_allclose(g, want, rtol=FWD_RTOL, err_msg=name)

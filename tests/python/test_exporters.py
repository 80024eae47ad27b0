"""Training graphs from other frameworks' exporters (fixtures/exporters/, issue 10).

Each fixture is the same tiny model (logits = head(tanh(fc(emb[input_ids])))) with one
cross-entropy idiom, exported by the framework's own exporter (tf2onnx, jax2onnx, paddle2onnx)
or written by hand in torch (TorchScript exporter); `<name>.npz` holds the reference batch and
the framework's own values (fixtures/generate_exporters.py, fixtures/README.md):
  loss   the framework's loss (float32 computation), = the unpatched graph's first output
  ntl    ntloss 0.3.2 NTLoss(digit_level=True, reweigh=False) on the framework's logits, with
         every position the cross-entropy ignores (ignore_index, ignore_class, mask 0) set to -100
  total  loss + 0.3 * ntl
  grad/<initializer>  d total / d parameter from the framework's own autodiff (float64), in the
         initializer's layout

Checks per fixture:
  - the committed files agree with each other and with ntloss / ONNX Runtime (catches stale
    fixtures; independent of ntl-patch);
  - (a) the patched forward graph: ce_loss = loss, number_loss = ntl, first output = total;
  - (b) `ntl-patch step --split`: the gradient graph's ntl/grad/<param> = grad/<param>;
  - (c) ORT Training 1.19.2 generate_artifacts(loss=None) on the patched graph: one step's
        loss and gradients, then an optimizer step, finite.
Gradient measure: norm-relative per parameter, floor 1e-3 of the whole gradient's norm (as in
test_ort_training.py), and over all parameters together.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import FIXTURES, TOKENIZER, run_patch
from ort_helpers import norm_rel, quiet_ort

EXPORTERS = FIXTURES / "exporters"
SUMMARY = json.loads((EXPORTERS / "models.json").read_text())
NAMES = list(SUMMARY["models"])
WEIGHT = 0.3
FWD_RTOL = 1e-5
GRAD_RTOL = 1e-4


def _ref(name: str) -> dict[str, np.ndarray]:
    with np.load(EXPORTERS / f"{name}.npz") as z:
        return {k: z[k] for k in z.files}


def _model_path(name: str) -> Path:
    return EXPORTERS / f"{name}.onnx"


def _feeds(model: onnx.ModelProto, ref: dict) -> dict[str, np.ndarray]:
    init = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in init]
    missing = [n for n in names if n not in ref]
    assert not missing, f"graph inputs without recorded values: {missing}"
    return {n: ref[n] for n in names}


def _scalar(x) -> float:
    a = np.asarray(x)
    assert a.size == 1, f"loss output of shape {a.shape}, expected one value"
    return float(a.reshape(()))


def _params(ref: dict) -> list[str]:
    return sorted(k[len("grad/"):] for k in ref if k.startswith("grad/"))


def _session(path: Path):
    ort = quiet_ort()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _grad_errors(got: dict[str, np.ndarray], ref: dict) -> tuple[float, dict[str, float]]:
    params = _params(ref)
    want = {p: ref[f"grad/{p}"] for p in params}
    for p in params:
        assert got[p].shape == want[p].shape, (p, got[p].shape, want[p].shape)
    all_want = np.concatenate([want[p].ravel() for p in params])
    all_got = np.concatenate([got[p].astype(np.float64).ravel() for p in params])
    floor = 1e-3 * float(np.linalg.norm(all_want))
    errs = {p: norm_rel(got[p].astype(np.float64), want[p], floor) for p in params}
    return norm_rel(all_got, all_want, 0.0), errs


def _assert_grads(got: dict[str, np.ndarray], ref: dict, what: str) -> None:
    total_err, errs = _grad_errors(got, ref)
    worst = max(errs, key=errs.get)
    print(f"{what}: gradient error {total_err:.2e} (worst {worst} {errs[worst]:.2e})")
    assert total_err <= GRAD_RTOL, f"{what}: all-parameter gradient error {total_err:.3g}; per parameter {errs}"
    assert errs[worst] <= GRAD_RTOL, f"{what}: gradient of {worst}: error {errs[worst]:.3g}; all: {errs}"


def _patch(name: str, out: Path) -> onnx.ModelProto:
    src = _model_path(name)
    r = run_patch([src, "--tokenizer", TOKENIZER, "--weight", str(WEIGHT), "-o", out])
    assert r.returncode == 0, f"ntl-patch exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert out.is_file(), "ntl-patch wrote no output file"
    before, after = onnx.load(str(src)), onnx.load(str(out))
    onnx.checker.check_model(after)
    assert after.ir_version == before.ir_version
    opsets = lambda m: {o.domain or "ai.onnx": o.version for o in m.opset_import}  # noqa: E731
    assert opsets(after) == opsets(before)
    outs = [o.name for o in after.graph.output]
    assert outs[0] == before.graph.output[0].name, outs
    assert "ce_loss" in outs and "number_loss" in outs, outs
    assert [i.name for i in after.graph.input] == [i.name for i in before.graph.input]
    return after


# ----------------------------------------------------------------------------- the fixtures themselves


@pytest.mark.parametrize("name", NAMES)
def test_fixture_is_consistent(name):
    """Recorded values agree with the committed graph (ONNX Runtime), with ntloss and with each
    other; every recorded gradient belongs to a float initializer of the same shape."""
    import torch

    import ntl_torch

    ref = _ref(name)
    info = SUMMARY["models"][name]
    model = onnx.load(str(_model_path(name)))
    feeds = _feeds(model, ref)
    assert [i["name"] for i in info["inputs"]] == list(feeds)
    got = _scalar(_session(_model_path(name)).run(None, feeds)[0])
    assert got == pytest.approx(float(ref["loss"]), rel=FWD_RTOL), "unpatched graph vs the framework's loss"
    assert float(ref["total"]) == pytest.approx(float(ref["loss"]) + WEIGHT * float(ref["ntl"]), rel=1e-12)

    logits, valid = ref["logits"], ref["valid"]
    assert logits.shape == (*feeds["input_ids"].shape, SUMMARY["vocab_size"]) and valid.shape == logits.shape[:2]
    labels = np.where(valid, ref["labels"], -100).astype(np.int64)
    obj = ntl_torch.ntloss_object("wasserstein")
    ntl = float(ntl_torch.ntl_value(obj, torch.from_numpy(logits).double(), torch.from_numpy(labels)))
    assert ntl == pytest.approx(float(ref["ntl"]), rel=1e-9)
    assert ntl > 0, "the batch must exercise the number loss"

    inits = {t.name: t for t in model.graph.initializer}
    params = _params(ref)
    assert params, "no recorded gradients"
    for p in params:
        assert p in inits, f"recorded gradient for {p}, which is no initializer"
        assert inits[p].data_type == onnx.TensorProto.FLOAT
        assert list(inits[p].dims) == list(ref[f"grad/{p}"].shape), p
    assert sorted(i["name"] for i in info["initializers"] if "parameter" in i) == params


# ----------------------------------------------------------------------------- (a) patched forward


@pytest.mark.parametrize("name", NAMES)
def test_patched_forward_matches_framework(name, tmp_path):
    ref = _ref(name)
    out = tmp_path / f"{name}.ntl.onnx"
    patched = _patch(name, out)
    sess = _session(out)
    names = [o.name for o in sess.get_outputs()]
    got = dict(zip(names, sess.run(None, _feeds(patched, ref))))
    ce, number, total = _scalar(got["ce_loss"]), _scalar(got["number_loss"]), _scalar(got[names[0]])
    print(f"{name}: ce {ce:.7f} (want {float(ref['loss']):.7f}), number {number:.7f} (want {float(ref['ntl']):.7f})")
    assert ce == pytest.approx(float(ref["loss"]), rel=FWD_RTOL), "ce_loss vs the framework's loss"
    assert number == pytest.approx(float(ref["ntl"]), rel=FWD_RTOL), "number_loss vs ntloss"
    assert total == pytest.approx(float(ref["total"]), rel=FWD_RTOL), "first output vs loss + 0.3 * ntl"


# ----------------------------------------------------------------------------- (b) ntl-patch step


# the dense LM head, and the fused one over chunks of 3 positions (tf2onnx's Tensordot head and
# jax2onnx's [1, 1, V] bias included); Keras's ignore_class selects on the logits before the
# cross-entropy, which the fused head refuses by name
HEADS = {"dense": ["--fused-head", "off"], "fused": ["--fused-head", "on", "--head-chunk-tokens", "3"]}
NOT_FUSED = {"tf_sparse_ignore"}


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("name", NAMES)
def test_step_gradients_match_framework(name, head, tmp_path):
    ref = _ref(name)
    out = tmp_path / "step.onnx"
    r = run_patch(["step", _model_path(name), "--tokenizer", TOKENIZER, "--weight", str(WEIGHT), "--split",
                   *HEADS[head], "-o", out, "--json"])
    if head == "fused" and name in NOT_FUSED:
        assert r.returncode == 1 and "the LM head cannot be fused" in r.stderr, r.stderr
        assert not out.exists()
        return
    assert r.returncode == 0, f"ntl-patch step exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert (json.loads(r.stdout)["fused_head"] is not None) == (head == "fused")
    g = onnx.load(str(out))
    assert {n.domain for n in g.graph.node} <= {"", "ai.onnx"}, "non-default domain in the gradient graph"
    sess = _session(out)
    names = [o.name for o in sess.get_outputs()]
    outs = dict(zip(names, sess.run(None, _feeds(g, ref))))
    assert _scalar(outs[names[0]]) == pytest.approx(float(ref["total"]), rel=FWD_RTOL)
    assert _scalar(outs[names[1]]) == pytest.approx(float(ref["loss"]), rel=FWD_RTOL)
    assert _scalar(outs[names[2]]) == pytest.approx(float(ref["ntl"]), rel=FWD_RTOL)
    missing = [p for p in _params(ref) if f"ntl/grad/{p}" not in outs]
    assert not missing, f"parameters without a gradient output: {missing}; outputs {names}"
    _assert_grads({p: outs[f"ntl/grad/{p}"] for p in _params(ref)}, ref, f"{name} step")


# ----------------------------------------------------------------------------- (c) ORT Training


@pytest.mark.parametrize("name", NAMES)
def test_ort_training_step(name, tmp_path):
    """paddle_ce_masked: paddle2onnx's value_info contradicts shape inference (models.json
    onnx_full_check), and generate_artifacts runs the full checker, so it fails on the exported
    graph itself unless the patched graph's value_info is consistent."""
    ref = _ref(name)
    import onnx

    try:
        onnx.checker.check_model(onnx.load(str(EXPORTERS / f"{name}.onnx")), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        # the exporter's own file already fails the checker generate_artifacts runs: not ours
        # to train in ORT Training (ntl-patch step trains it: test_step_gradients)
        pytest.xfail(f"{name}: the exported graph itself fails onnx.checker(full_check): {e}")
    patched = _patch(name, tmp_path / f"{name}.ntl.onnx")
    ort = quiet_ort()
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    params = _params(ref)
    art = tmp_path / "artifacts"
    art.mkdir()
    artifacts.generate_artifacts(patched, requires_grad=params, frozen_params=[], loss=None,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(art))
    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    module = Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"), device="cpu",
                    session_options=so)
    module.train()
    feeds = _feeds(patched, ref)
    outs = module(*feeds.values())
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss0 = _scalar(outs[0])
    assert np.isfinite(loss0)
    assert loss0 == pytest.approx(float(ref["total"]), rel=FWD_RTOL)
    _assert_grads({p: state.parameters[p].grad for p in params}, ref, f"{name} ORT Training")
    opt = Optimizer(str(art / "optimizer_model.onnx"), module)
    opt.set_learning_rate(1e-2)
    opt.step()
    module.lazy_reset_grad()
    loss1 = _scalar(module(*feeds.values())[0])
    assert np.isfinite(loss1), "loss after one AdamW step"
    print(f"{name}: ORT Training loss {loss0:.6f} -> {loss1:.6f}")

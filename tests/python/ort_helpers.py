"""ONNX Runtime (Training) helpers shared by the harness: the settings and checks of
test_ort_training.py (also used by test_ort_training_ntil.py), the fixed batch of
fixtures/reference/lm_flat_*, the quiet onnxruntime import, the norm-relative error, the
forward patch checked the same way everywhere, and ORT training artifacts of a model (from
test_artifacts.py).

Gradient measure ("norm-relative"): ||got - want||_2 / max(||want||_2, floor); see
test_ort_training.py's docstring for the floor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper as nph

from conftest import FIXTURES, MODELS, TOKENIZER, run_patch

GRAD_RTOL = 1e-4
FWD_RTOL = 1e-5
TRAIN_STEPS = 30
LR = 1e-2
WEIGHT = 0.3


def _read_pb(path: Path) -> np.ndarray:
    t = onnx.TensorProto()
    t.ParseFromString(path.read_bytes())
    return nph.to_array(t)


def batch() -> tuple[np.ndarray, np.ndarray]:
    """B=2, T=7; labels hold digits, non-digits and -100 (fixtures/reference/lm_flat_*)."""
    ref = FIXTURES / "reference" / "lm_flat_wasserstein"
    return _read_pb(ref / "input_0.pb").astype(np.int64), _read_pb(ref / "input_1.pb").astype(np.int64)


def quiet_ort():
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    return ort


def patch(model: str, loss: str, extra: list[str], out: Path) -> onnx.ModelProto:
    src = MODELS / f"{model}.onnx"
    r = run_patch([src, "--loss", loss, "--tokenizer", TOKENIZER, "--weight", str(WEIGHT), *extra,
                   "-o", out])
    assert r.returncode == 0, f"ntl-patch exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert out.is_file(), "ntl-patch wrote no output file"
    before = onnx.load(str(src))
    after = onnx.load(str(out))
    onnx.checker.check_model(after, full_check=True)
    assert after.ir_version == before.ir_version
    opsets = lambda m: {o.domain or "ai.onnx": o.version for o in m.opset_import}  # noqa: E731
    assert opsets(after) == opsets(before)
    outs = [o.name for o in after.graph.output]
    assert outs[0] == "loss" and outs[-2:] == ["ce_loss", "number_loss"], outs
    assert [i.name for i in after.graph.input] == [i.name for i in before.graph.input]
    return after


def assert_param_grads(state, params, want_grads) -> tuple[float, str, float]:
    """ORT's parameter gradients after one step against a float64 reference, norm-relative
    (see test_ort_training.py's docstring for the floor), per parameter and over all
    parameters. Returns (all-parameter error, worst parameter, its error) for the log."""
    got_grads = {}
    for name in params:
        g = state.parameters[name].grad
        assert g is not None, f"no gradient for {name}"
        assert g.shape == want_grads[name].shape, (name, g.shape, want_grads[name].shape)
        got_grads[name] = g.astype(np.float64)
    all_want = np.concatenate([want_grads[p].ravel() for p in params])
    all_got = np.concatenate([got_grads[p].ravel() for p in params])
    floor = 1e-3 * float(np.linalg.norm(all_want))
    errs = {p: norm_rel(got_grads[p], want_grads[p], floor) for p in params}
    worst = max(errs, key=errs.get)
    total_err = norm_rel(all_got, all_want, 0.0)
    assert total_err <= GRAD_RTOL, f"all-parameter gradient error {total_err:.3g}; per parameter {errs}"
    assert errs[worst] <= GRAD_RTOL, f"gradient of {worst}: error {errs[worst]:.3g}; all: {errs}"
    return total_err, worst, errs[worst]


def norm_rel(got: np.ndarray, want: np.ndarray, floor: float) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), floor, 1e-30))


# ---------------------------------------------------------------------------- ORT training artifacts


def generate_artifacts(model: onnx.ModelProto, out: Path) -> Path:
    """ORT training artifacts of `model`, every non-ntl float initializer trainable."""
    from onnxruntime.training import artifacts

    params = [t.name for t in model.graph.initializer
              if t.data_type == onnx.TensorProto.FLOAT and t.dims and not t.name.startswith("ntl/")]
    for n in model.graph.node:  # ORT's gradient builder needs SCE's log_prob output declared
        if n.op_type == "SoftmaxCrossEntropyLoss" and len(n.output) == 1:
            n.output.append(n.output[0] + "_log_prob")
    out.mkdir(parents=True, exist_ok=True)
    artifacts.generate_artifacts(model, requires_grad=params, loss=None,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=out)
    return out


def training_module(art: Path):
    from onnxruntime.training.api import CheckpointState, Module

    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"))
    return state, module

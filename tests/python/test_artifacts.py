"""Artifacts mode: `ntl-patch artifacts DIR` adds the number loss to ONNX Runtime training
artifacts, with its analytic backward spliced into the training graph.

Checked here, with the real onnxruntime-training 1.19.2:
- parameter gradients after one step equal those of artifacts ORT generates from the
  forward-patched graph (<= 1e-5 norm-relative), and torch autograd of CE + 0.3·ntloss;
- a finite-difference check of the spliced backward alone (artifacts gradient minus the
  CE-only artifacts gradient, against central differences of `number_loss` in the eval model);
- the optimizer model and checkpoint are copied unchanged; 30 AdamW steps lower the loss;
- bad input gets a one-line error and no output folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import FIXTURES, MODELS, TOKENIZER, run_patch
from logits_param import logits_model
from ort_helpers import generate_artifacts, training_module

TOL = 1e-5
WEIGHT = 0.3


def _batch():
    ids = np.array([[5, 18, 29, 25, 30, 36, 35, 7], [27, 21, 10, 38, 18, 3, 4, 29]], np.int64)
    # digits (ids 18 29 25 36 35 7 21 10 38 ...), -100, non-digits; multi-digit runs for NTIL
    labels = np.array([[18, 29, 25, 30, 36, 35, -100, 21], [21, 10, 38, 18, 25, 7, 4, 29]], np.int64)
    return ids, labels


def _step(art: Path, *inputs) -> tuple[dict, dict]:
    state, module = training_module(art)
    module.train()
    outs = module(*inputs)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    names = [o.name for o in onnx.load(art / "eval_model.onnx").graph.output]
    params = [i.name for i in onnx.load(art / "eval_model.onnx").graph.input
              if i.name in {t.name for t in onnx.load(art / "training_model.onnx").graph.input}
              and i.name not in ("input_ids", "labels")]
    grads = {p: np.asarray(state.parameters[p].grad, np.float64) for p in params}
    return dict(zip(names, (float(np.asarray(o)) for o in outs))), grads


def _norm_rel(got: dict, want: dict) -> float:
    total = np.sqrt(sum(float(np.sum(w ** 2)) for w in want.values()))
    return max(np.linalg.norm(got[k] - want[k]) / max(np.linalg.norm(want[k]), 1e-3 * total)
               for k in want)


def _artifacts(base: Path, out: Path, args: list[str]) -> Path:
    r = run_patch(["artifacts", base, "--tokenizer", TOKENIZER, "-o", out, *args])
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def base_artifacts(tmp_path_factory):
    """CE-only artifacts of each fixture model, generated once."""
    root = tmp_path_factory.mktemp("base")
    return {m: generate_artifacts(onnx.load(MODELS / f"{m}.onnx"), root / m) for m in ("lm_flat", "lm_bvt")}


LOSSES = [
    ["--loss", "wasserstein"],
    ["--loss", "wasserstein", "--squash", "3"],
    ["--loss", "mse"],
    ["--loss", "l1", "--reweigh"],
    ["--loss", "huber"],
    ["--loss", "mse", "--all-numbers"],
    ["--loss", "ntil", "--gumbel-noise", "0", "--combine", "scaled"],
    ["--loss", "ntil", "--gumbel-noise", "0", "--combine", "add"],
    ["--loss", "emd"],
    ["--loss", "number-level"],
    ["--loss", "number-level", "--float-level", "--reweigh"],
    ["--loss", "dist2"],
    ["--loss", "del"],
    ["--loss", "smmd"],
    ["--loss", "smmd", "--kernel", "laplace", "--sigma", "1", "--sigma", "4", "--smmd-terms", "smooth"],
]
CASES = [(m, a) for m in ("lm_flat", "lm_bvt") for a in LOSSES]


def _id(case):
    return case[0] + "-" + "_".join(x.lstrip("-") for x in case[1])


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_artifacts_equal_forward_patch_and_torch(case, base_artifacts, tmp_path, weights):
    model, args = case
    ids, labels = _batch()
    got_out, got = _step(_artifacts(base_artifacts[model], tmp_path / "art", args), ids, labels)

    fwd = tmp_path / "fwd.onnx"
    r = run_patch([MODELS / f"{model}.onnx", "--tokenizer", TOKENIZER, "-o", fwd, *args])
    assert r.returncode == 0, r.stderr
    want_out, want = _step(generate_artifacts(onnx.load(fwd), tmp_path / "fwd_art"), ids, labels)
    for k in ("loss", "ce_loss", "number_loss"):
        np.testing.assert_allclose(got_out[k], want_out[k], rtol=1e-6, err_msg=k)
    assert _norm_rel(got, want) <= TOL

    loss = args[1]
    if loss in ("wasserstein", "mse", "l1", "huber"):
        import torch
        import ntl_torch

        settings = dict(reweigh="--reweigh" in args, digit_level="--all-numbers" not in args,
                        squash=float(args[args.index("--squash") + 1]) if "--squash" in args else None)
        _, _, ntl, ref = ntl_torch.model_reference(weights, torch.from_numpy(ids),
                                                   torch.from_numpy(labels), loss, weight=WEIGHT,
                                                   **settings)
        np.testing.assert_allclose(got_out["number_loss"], ntl, rtol=1e-5)
        assert _norm_rel(got, {k: ref[k] for k in got}) <= TOL
    if loss in ("dist2", "del", "smmd"):
        import torch
        import dist2_smmd_del_torch

        settings = {}
        if "--kernel" in args:
            settings = {"kernel": "laplace", "sigmas": (1.0, 4.0), "terms": "smooth"}
        _, _, num, ref = dist2_smmd_del_torch.model_reference(
            weights, torch.from_numpy(ids), torch.from_numpy(labels), loss, **settings)
        np.testing.assert_allclose(got_out["number_loss"], num, rtol=1e-5)
        assert _norm_rel(got, {k: ref[k] for k in got}) <= TOL


def test_optimizer_and_checkpoint_copied_unchanged(base_artifacts, tmp_path):
    base = base_artifacts["lm_flat"]
    out = _artifacts(base, tmp_path / "art", ["--loss", "wasserstein"])
    for f in ("optimizer_model.onnx", "checkpoint"):
        assert (out / f).read_bytes() == (base / f).read_bytes(), f


@pytest.mark.parametrize("args", [["--loss", "wasserstein"],
                                  ["--loss", "ntil", "--gumbel-noise", "0.01"]])
def test_artifacts_train(args, base_artifacts, tmp_path):
    from onnxruntime.training.api import Optimizer

    art = _artifacts(base_artifacts["lm_flat"], tmp_path / "art", args)
    state, module = training_module(art)
    opt = Optimizer(str(art / "optimizer_model.onnx"), module)
    opt.set_learning_rate(1e-2)
    module.train()
    ids, labels = _batch()
    losses = []
    for _ in range(30):
        losses.append(float(np.asarray(module(ids, labels)[0])))
        opt.step()
        module.lazy_reset_grad()
    assert losses[-1] < 0.7 * losses[0], losses


def _fd_case():
    import json

    c = json.loads((FIXTURES / "reference" / "ntloss_cases.json").read_text())["cases"][0]
    logits = np.asarray(c["logits"], np.float32).reshape(c["B"], c["T"], -1)
    labels = np.asarray(c["labels"], np.int64).reshape(c["B"], c["T"])
    return logits, labels


@pytest.mark.parametrize("opset", [15, 17])
@pytest.mark.parametrize("args", [["--loss", "wasserstein"], ["--loss", "huber", "--reweigh"],
                                  ["--loss", "emd"], ["--loss", "number-level"], ["--loss", "dist2"],
                                  ["--loss", "del"], ["--loss", "smmd"]])
def test_spliced_backward_finite_differences(args, opset, tmp_path):
    """The backward ntl-patch writes, alone: (artifacts grad − CE-only grad)/λ against central
    differences of number_loss. Opset 15 exercises the ScatterElements-without-reduction path."""
    import onnxruntime as ort

    logits, labels = _fd_case()
    base = generate_artifacts(logits_model(logits, opset=opset), tmp_path / "base")
    _, ce_grad = _step(base, labels)
    art = _artifacts(base, tmp_path / "art", [*args, "--weight", "1", "--combine", "add"])
    _, total_grad = _step(art, labels)
    analytic = (total_grad["logits"] - ce_grad["logits"]).reshape(-1)

    sess = ort.InferenceSession(str(art / "eval_model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]

    def number_loss(x):
        return float(sess.run(None, {"logits": x.astype(np.float32), "labels": labels})[names.index("number_loss")])

    rng = np.random.default_rng(0)
    flat = logits.reshape(-1).astype(np.float64)
    worst = 0.0
    h = 1e-2
    picks = np.concatenate([np.flatnonzero(np.abs(analytic) > 1e-4)[:20], rng.choice(flat.size, 20, replace=False)])
    for i in picks:
        up, down = flat.copy(), flat.copy()
        up[i] += h
        down[i] -= h
        fd = (number_loss(up.reshape(logits.shape)) - number_loss(down.reshape(logits.shape))) / (2 * h)
        worst = max(worst, abs(fd - analytic[i]) / (np.abs(analytic).max()))
    assert worst < 2e-3, worst


def _fails(args: list[str], needle: str, out: Path):
    r = run_patch(["artifacts", *args, "-o", out])
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr
    assert not out.exists()


def test_artifacts_bad_input(base_artifacts, tmp_path):
    base = base_artifacts["lm_flat"]
    tok = ["--tokenizer", str(TOKENIZER)]
    # a missing file
    partial = tmp_path / "partial"
    shutil.copytree(base, partial)
    (partial / "checkpoint").unlink()
    _fails([partial, *tok], "has no checkpoint", tmp_path / "o1")
    # already patched
    patched = _artifacts(base, tmp_path / "patched", ["--loss", "mse"])
    _fails([patched, *tok], "already patched", tmp_path / "o2")
    # a loss that is not a cross-entropy
    no_ce = generate_artifacts(onnx.load(MODELS / "lm_no_ce.onnx"), tmp_path / "no_ce")
    _fails([no_ce, *tok], "no cross-entropy", tmp_path / "o3")
    # a gradient graph whose logits gradient cannot be found
    broken = tmp_path / "broken"
    shutil.copytree(base, broken)
    m = onnx.load(broken / "training_model.onnx")
    for n in m.graph.node:
        if n.op_type == "SoftmaxCrossEntropyLossGrad":
            n.op_type = "SomethingElseGrad"
    onnx.save(m, broken / "training_model.onnx")
    _fails([broken, *tok], "SoftmaxCrossEntropyLossGrad", tmp_path / "o4")
    # cross-entropies ORT differentiated in forms artifacts mode cannot splice into: spelled
    # out of primitive ops, and reduction='none' reduced by the graph itself
    exporters = FIXTURES / "exporters"
    spelled = generate_artifacts(onnx.load(exporters / "torch_gather.onnx"), tmp_path / "spelled")
    _fails([spelled, *tok], "written out of primitive ops", tmp_path / "o6")
    per_position = generate_artifacts(onnx.load(exporters / "torch_sce_none_masked.onnx"), tmp_path / "none")
    _fails([per_position, *tok], "reduction 'none'", tmp_path / "o7")
    # the output folder exists
    (tmp_path / "o5").mkdir()
    r = run_patch(["artifacts", base, *tok, "-o", tmp_path / "o5"])
    assert r.returncode == 1 and "already exists" in r.stderr


def test_artifacts_with_external_data(base_artifacts, tmp_path):
    """Artifact graphs that keep tensors in external data files: the output folder gets its own
    copies and the patched graphs hold the same tensors as when patched inline. (ORT's Module
    itself refuses shape constants stored externally, so the graphs are compared, not trained.)"""
    from onnx import numpy_helper

    base = base_artifacts["lm_flat"]
    ext = tmp_path / "ext"
    ext.mkdir()
    for f in ("optimizer_model.onnx", "checkpoint"):
        shutil.copy(base / f, ext / f)
    for f in ("training_model.onnx", "eval_model.onnx"):
        onnx.save(onnx.load(base / f), ext / f, save_as_external_data=True,
                  all_tensors_to_one_file=True, location=f + ".data", size_threshold=0)
    before = {p.name: p.read_bytes() for p in ext.iterdir()}
    out = _artifacts(ext, tmp_path / "out", ["--loss", "wasserstein"])
    inline = _artifacts(base, tmp_path / "inline", ["--loss", "wasserstein"])
    assert {p.name: p.read_bytes() for p in ext.iterdir()} == before, "input untouched"
    for f in ext.iterdir():  # every data file the graphs reference came along
        if f.suffix == ".data":
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert (out / "training_model.onnx.data").is_file()
    for f in ("training_model.onnx", "eval_model.onnx"):
        got = {t.name: numpy_helper.to_array(t) for t in onnx.load(out / f).graph.initializer}
        want = {t.name: numpy_helper.to_array(t) for t in onnx.load(inline / f).graph.initializer}
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_del_on_log_probabilities_is_refused_in_artifacts_mode(tmp_path):
    """DEL reads the raw logits; a training graph whose cross-entropy reads LogSoftmax output
    cannot take its gradient there, so artifacts mode refuses it (one line, no output) while
    the shift-invariant losses patch it."""
    from onnx import TensorProto, helper, numpy_helper

    logits, labels = _fd_case()
    b, t, v = logits.shape
    graph = helper.make_graph(
        [helper.make_node("LogSoftmax", ["logits"], ["log_probs"], axis=-1),
         helper.make_node("Reshape", ["log_probs", "shape_nv"], ["scores"]),
         helper.make_node("Reshape", ["labels", "shape_n"], ["labels_flat"]),
         helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels_flat"], ["loss"],
                          ignore_index=-100, reduction="mean")],
        "log_probs_ce", [helper.make_tensor_value_info("labels", TensorProto.INT64, [b, t])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(logits, "logits"),
         numpy_helper.from_array(np.array([-1, v], np.int64), "shape_nv"),
         numpy_helper.from_array(np.array([-1], np.int64), "shape_n")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    base = generate_artifacts(model, tmp_path / "base")
    _fails([base, "--tokenizer", str(TOKENIZER), "--loss", "del"], "reads the raw logits",
           tmp_path / "o_del")
    _, labels_grad = _step(_artifacts(base, tmp_path / "o_dist2", ["--loss", "dist2"]), labels)
    assert np.isfinite(labels_grad["logits"]).all()


@pytest.mark.parametrize("loss", ["wasserstein", "dist2", "del", "smmd"])
def test_number_gradient_is_one_sparse_update(loss, base_artifacts, tmp_path):
    """The number loss's gradient joins the CE gradient as one ScatterElements(add) of its K
    number-token columns; no dense [N, V] update."""
    import json

    r = run_patch(["artifacts", base_artifacts["lm_flat"], "--tokenizer", TOKENIZER, "--loss", loss,
                   "-o", tmp_path / "art", "--json"])
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert (summary["sparse_gradient_updates"], summary["dense_gradient_updates"]) == (1, 0), summary

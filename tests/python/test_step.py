"""`ntl-patch step`: the standard-ONNX training step against torch and ORT Training.

The step graph is run by plain `onnxruntime` (no training API), so the gradients and the
optimizer are ntl-patch's own, emitted as ONNX ops. References:
  - gradients: torch autograd of CE + 0.3·ntloss / NTIL (float64) on the same weights, via
    the `--split` gradient graph (its outputs are the parameter gradients themselves);
  - training: torch.optim.AdamW / SGD(momentum) on the tiny LM in float32, 20 steps on
    batches of changing shape (one graph, dynamic batch and sequence);
  - ORT Training 1.19.2 trained from the forward patch (generate_artifacts, AdamW), the
    trainer ntl-patch used to rely on.
Measure: norm-relative error per parameter (floor 1e-3·‖all‖, as in test_ort_training.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from conftest import MODELS, TOKENIZER, run_patch
from hf_reference import HF_MODELS, hf_reference
from ort_helpers import batch, norm_rel, quiet_ort
from step_helpers import (HEADS, STEPS, TRAJ_RTOL, assert_params_close, run_step_graph, session,
                          with_meta_output, zero_grad_mask)

WEIGHT = 0.3
GRAD_RTOL = 1e-5

GRAD_CASES = [(m, l) for m in ("lm_flat", "lm_bvt", "lm_nll")
              for l in ("wasserstein", "mse", "ntil", "dist2", "del", "smmd")]
NTIL_ARGS = ["--gumbel-noise", "0", "--combine", "add"]


def _step(model: Path, out: Path, loss: str, *extra) -> dict:
    args = [model, "--loss", loss, "--tokenizer", TOKENIZER, "--weight", str(WEIGHT), "-o", out, "--json"]
    if loss == "ntil":
        args += NTIL_ARGS
    r = run_patch(["step", *args, *extra])
    assert r.returncode == 0, f"ntl-patch step exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout)


def _reference(loss: str, weights, input_ids, labels):
    if loss in ("dist2", "del", "smmd"):
        import dist2_smmd_del_torch

        return dist2_smmd_del_torch.model_reference(weights, torch.from_numpy(input_ids),
                                                    torch.from_numpy(labels), loss, weight=WEIGHT)
    if loss == "ntil":
        import ntil_torch

        return ntil_torch.model_reference(weights, torch.from_numpy(input_ids), torch.from_numpy(labels),
                                          "ntil", "add", weight=WEIGHT, noise_scale=0.0)
    import ntl_torch

    return ntl_torch.model_reference(weights, torch.from_numpy(input_ids), torch.from_numpy(labels), loss,
                                     weight=WEIGHT)


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("model,loss", GRAD_CASES, ids=[f"{m}-{l}" for m, l in GRAD_CASES])
def test_gradient_graph_matches_torch(model, loss, head, weights, tmp_path):
    out = tmp_path / "m.grad.onnx"
    summary = _step(MODELS / f"{model}.onnx", out, loss, "--split", *HEADS[head])
    assert (summary["fused_head"] is not None) == (head == "fused")
    g = onnx.load(str(out))
    assert {n.domain for n in g.graph.node} <= {"", "ai.onnx"}, "non-default domain in the gradient graph"
    params = summary["parameters"]
    assert sorted(params) == sorted(weights), "every float initializer of the tiny LM trains"
    input_ids, labels = batch()
    outs = session(out).run(None, {"input_ids": input_ids, "labels": labels})
    total, ce, number, want = _reference(loss, weights, input_ids, labels)
    assert abs(outs[0] - total) <= 1e-5 * abs(total)
    assert abs(outs[1] - ce) <= 1e-5 * abs(ce)
    assert abs(outs[2] - number) <= 1e-5 * max(abs(number), 1e-6)
    got = dict(zip(params, outs[3:]))
    all_want = np.concatenate([want[p].ravel() for p in params])
    floor = 1e-3 * float(np.linalg.norm(all_want))
    errs = {p: norm_rel(got[p].astype(np.float64), want[p], floor) for p in params}
    worst = max(errs, key=errs.get)
    print(f"{model}/{loss}: worst parameter {worst} {errs[worst]:.2e}")
    assert errs[worst] <= GRAD_RTOL, errs


def _batches(n: int, seed: int = 0):
    """Batches of changing shape: one graph serves every batch size and sequence length."""
    rng = np.random.default_rng(seed)
    ids = np.array([18, 29, 25, 36, 35, 7, 27, 21, 10, 38, 4, 5, 6, 8, 9, 11], dtype=np.int64)
    out = []
    for k in range(n):
        b, t = [(2, 7), (3, 5), (1, 9)][k % 3]
        x = rng.choice(ids, size=(b, t))
        y = rng.choice(ids, size=(b, t))
        y[rng.random((b, t)) < 0.2] = -100
        out.append((x, y))
    return out


def _torch_run(weights, optimizer: str, batches, loss: str):
    import ntl_torch
    import tiny_lm
    from tiny_lm import VOCAB

    m = tiny_lm.build("flat", {k: v.clone() for k, v in weights.items()})
    m.train()
    params = dict(m.named_parameters())
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params.values(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(params.values(), lr=1e-2, momentum=0.9, weight_decay=0.01)
    obj = ntl_torch.ntloss_object(loss)
    losses = []
    for x, y in batches:
        logits = m.logits(torch.from_numpy(x))
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), torch.from_numpy(y).reshape(-1), ignore_index=-100)
        total = ce + WEIGHT * ntl_torch.ntl_value(obj, logits, torch.from_numpy(y))
        opt.zero_grad()
        total.backward()
        opt.step()
        losses.append(total.item())
    return losses, {k: v.detach().numpy().copy() for k, v in params.items()}


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_step_graph_trains_like_torch(optimizer, head, weights, tmp_path):
    out = tmp_path / "m.step.onnx"
    extra = ["--optimizer", optimizer, *HEADS[head]]
    extra += ["--lr", "1e-3"] if optimizer == "adamw" else ["--lr", "1e-2", "--momentum", "0.9", "--weight-decay", "0.01"]
    _step(MODELS / "lm_flat.onnx", out, "wasserstein", *extra)
    batches = _batches(STEPS)
    got_losses, got_params, meta = run_step_graph(out, batches)
    want_losses, want_params = _torch_run(weights, optimizer, batches, "wasserstein")
    np.testing.assert_allclose(got_losses, want_losses, rtol=TRAJ_RTOL)
    zero = None
    if optimizer == "adamw":
        x, y = batch()
        zero = zero_grad_mask(_reference("wasserstein", weights, x, y)[3])
    assert_params_close(got_params, want_params, zero)
    assert got_losses[-1] < got_losses[0] or optimizer == "sgd"


def test_step_graph_matches_ort_training(tmp_path):
    """The same 20 steps through ORT Training 1.19.2 (forward patch + generate_artifacts). Plain
    SGD: ORT's AdamW is the Hugging Face variant (adam_mode=1: ε added before the bias
    correction, ε = 1e-6 fixed by generate_artifacts), not torch's, so only SGD means the same
    update in both and isolates the gradients."""
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    quiet_ort()
    src = MODELS / "lm_flat.onnx"
    fwd = tmp_path / "m.ntl.onnx"
    r = run_patch([src, "--tokenizer", TOKENIZER, "--weight", str(WEIGHT), "-o", fwd])
    assert r.returncode == 0, r.stderr
    model = onnx.load(str(fwd))
    params = [t.name for t in model.graph.initializer if not t.name.startswith("ntl/")
              and t.data_type == onnx.TensorProto.FLOAT]
    art = tmp_path / "art"
    art.mkdir()
    artifacts.generate_artifacts(model, requires_grad=params, frozen_params=[], loss=None,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=str(art))
    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"))
    opt = Optimizer(str(art / "optimizer_model.onnx"), module)
    opt.set_learning_rate(1e-2)
    module.train()
    batches = _batches(STEPS, seed=1)
    ort_losses = []
    for x, y in batches:
        outs = module(x, y)
        ort_losses.append(float(outs[0]))
        opt.step()
        module.lazy_reset_grad()
    ort_params = {p: state.parameters[p].data for p in params}

    out = tmp_path / "m.step.onnx"
    _step(src, out, "wasserstein", "--optimizer", "sgd", "--lr", "1e-2")
    got_losses, got_params, _ = run_step_graph(out, batches)
    np.testing.assert_allclose(got_losses, ort_losses, rtol=TRAJ_RTOL)
    assert_params_close(got_params, ort_params)


def test_step_graph_contract(tmp_path):
    out = tmp_path / "m.step.onnx"
    _step(MODELS / "lm_flat.onnx", out, "wasserstein")
    before = onnx.load(str(MODELS / "lm_flat.onnx"))
    m = onnx.load(str(out))
    onnx.checker.check_model(m, full_check=True)
    assert m.ir_version == before.ir_version
    assert {o.domain or "ai.onnx": o.version for o in m.opset_import} == {
        o.domain or "ai.onnx": o.version for o in before.opset_import}
    assert {n.domain for n in m.graph.node} <= {"", "ai.onnx"}
    meta = json.loads({p.key: p.value for p in m.metadata_props}["ntl_step"])
    inputs = [i.name for i in m.graph.input]
    data = [i.name for i in before.graph.input]
    assert inputs[: len(data)] == data
    assert inputs[len(data):] == [i for i, _ in meta["state"]] + ["ntl/lr"]
    outputs = [o.name for o in m.graph.output]
    assert outputs == ["loss", "ce_loss", "number_loss"] + [o for _, o in meta["state"]]
    inits = {t.name for t in m.graph.initializer}
    assert all(i in inits for i in inputs[len(data):]), "every state input has its initial value"
    # symbolic batch and sequence dims stay symbolic
    dims = [d.dim_param for d in m.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [d.dim_param for d in before.graph.input[0].type.tensor_type.shape.dim]


def test_learning_rate_input(tmp_path):
    """`ntl/lr` overrides the default per step: lr 0 leaves the parameters unchanged."""
    out = tmp_path / "m.step.onnx"
    _step(MODELS / "lm_flat.onnx", out, "wasserstein", "--optimizer", "sgd", "--lr", "0.5")
    sess = session(out)
    x, y = batch()
    names = [o.name for o in sess.get_outputs()]
    outs = dict(zip(names, sess.run(None, {"input_ids": x, "labels": y, "ntl/lr": np.array(0.0, np.float32)})))
    w = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    np.testing.assert_array_equal(outs["ntl/next/head.weight"], w["head.weight"])


# ---------------------------------------------------------------- transformers GPT-2 / Llama
# Exported with their own loss (HF's shifted cross-entropy) by both torch exporters; torch
# references from fixtures/generate_step.py (fixtures/reference/step/; hf_reference.py).
HF_CASES = [(m, l) for m in HF_MODELS for l in ("wasserstein", "mse", "ntil")]


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("model,loss", HF_CASES, ids=[f"{m}-{l}" for m, l in HF_CASES])
def test_transformers_gradients_match_torch(model, loss, head, tmp_path):
    ref = hf_reference(model)
    out = tmp_path / "m.grad.onnx"
    summary = _step(MODELS / f"{model}.onnx", out, loss, "--split", *HEADS[head])
    params = summary["parameters"]
    want = {p: ref[f"grad/{loss}/float64/{p}"] for p in params}
    assert len(params) == len([k for k in ref.files if k.startswith(f"grad/{loss}/float64/")]), \
        "every torch parameter trains, nothing else"
    x, y = ref["batch/input_ids"], ref["batch/labels"]
    outs = session(out).run(None, {"input_ids": x, "labels": y})
    total, ce, number = ref[f"forward/{loss}/float64"]
    np.testing.assert_allclose(outs[:3], [total, ce, number], rtol=1e-5, atol=1e-7)
    got = dict(zip(params, outs[3:]))
    all_want = np.concatenate([want[p].ravel() for p in params])
    floor = 1e-3 * float(np.linalg.norm(all_want))
    errs = {p: norm_rel(got[p].astype(np.float64), want[p], floor) for p in params}
    worst = max(errs, key=errs.get)
    print(f"{model}/{loss}: worst parameter {worst} {errs[worst]:.2e}")
    assert errs[worst] <= GRAD_RTOL, errs


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("model", HF_MODELS)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_transformers_train_like_torch(model, optimizer, head, tmp_path):
    ref = hf_reference(model)
    out = tmp_path / "m.step.onnx"
    extra = ["--optimizer", optimizer, *HEADS[head]]
    extra += ["--lr", "1e-3"] if optimizer == "adamw" else ["--lr", "1e-2", "--momentum", "0.9", "--weight-decay", "0.01"]
    _step(MODELS / f"{model}.onnx", out, "wasserstein", *extra)
    batches = [(ref[f"traj/batch/{k:02d}/input_ids"], ref[f"traj/batch/{k:02d}/labels"]) for k in range(STEPS)]
    got_losses, got_params, _ = run_step_graph(out, batches)
    np.testing.assert_allclose(got_losses, ref[f"traj/{optimizer}/loss"][:, 0], rtol=TRAJ_RTOL)
    want = {p: ref[f"traj/{optimizer}/final/{p}"] for p in got_params}
    zero = None
    if optimizer == "adamw":
        zero = zero_grad_mask({p: ref[f"grad/wasserstein/float64/{p}"] for p in got_params})
    assert_params_close(got_params, want, zero)


@pytest.mark.parametrize("bucket", [[], ["--update-bucket", "1"]], ids=["per_tensor", "buckets"])
def test_clip_grad_norm_matches_torch(weights, bucket, tmp_path):
    """--max-grad-norm is torch.nn.utils.clip_grad_norm_ over all trained parameters (with
    --update-bucket the squares are summed a bucket at a time)."""
    import ntl_torch
    import tiny_lm
    from tiny_lm import VOCAB

    out = tmp_path / "m.step.onnx"
    _step(MODELS / "lm_flat.onnx", out, "wasserstein", "--optimizer", "sgd", "--lr", "0.1",
          "--max-grad-norm", "0.05", *bucket)
    batches = _batches(3)
    probe, norm_sq = with_meta_output(out, "grad_norm_sq", onnx.TensorProto.FLOAT)
    got_norms = []
    _, got, _ = run_step_graph(probe, batches, lambda outs: got_norms.append(float(outs[norm_sq]) ** 0.5))
    m = tiny_lm.build("flat", {k: v.clone() for k, v in weights.items()})
    params = dict(m.named_parameters())
    opt = torch.optim.SGD(params.values(), lr=0.1)
    obj = ntl_torch.ntloss_object("wasserstein")
    want_norms = []
    for x, y in batches:
        logits = m.logits(torch.from_numpy(x))
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), torch.from_numpy(y).reshape(-1), ignore_index=-100)
        total = ce + WEIGHT * ntl_torch.ntl_value(obj, logits, torch.from_numpy(y))
        opt.zero_grad()
        total.backward()
        norm = torch.nn.utils.clip_grad_norm_(params.values(), 0.05)
        assert norm > 0.05, "the clip must be active for this test to mean anything"
        want_norms.append(float(norm))
        opt.step()
    np.testing.assert_allclose(got_norms, want_norms, rtol=1e-5)
    assert_params_close(got, {k: v.detach().numpy() for k, v in params.items()})


def test_step_graph_in_onnxruntime_1_31_without_torch(weights, tmp_path):
    """The step graph trains in the maintained runtime (onnxruntime 1.31.1 in .venv-rt, which
    has neither torch nor onnx) through ntl_patch.StepRunner, like torch's AdamW."""
    import subprocess

    from conftest import REPO

    rt = subprocess.run([str(REPO / "scripts" / "setup" / "setup-runtime.sh")], capture_output=True, text=True)
    assert rt.returncode == 0, rt.stderr
    out = tmp_path / "m.step.onnx"
    _step(MODELS / "lm_flat.onnx", out, "wasserstein", "--lr", "1e-3")
    batches = _batches(STEPS)
    np.savez(tmp_path / "batches.npz", **{f"x{k}": x for k, (x, _) in enumerate(batches)},
             **{f"y{k}": y for k, (_, y) in enumerate(batches)})
    code = f"""
import sys, numpy as np, onnxruntime
sys.path.insert(0, {str(REPO / 'python')!r})
from ntl_patch import StepRunner
assert onnxruntime.__version__ == "1.31.1", onnxruntime.__version__
for banned in ("torch", "onnx"):
    try:
        __import__(banned)
        raise SystemExit(banned + " is importable")
    except ImportError:
        pass
z = np.load({str(tmp_path / 'batches.npz')!r})
r = StepRunner({str(out)!r}, providers=["CPUExecutionProvider"])
losses = [r.step({{"input_ids": z[f"x{{k}}"], "labels": z[f"y{{k}}"]}})[0] for k in range({STEPS})]
np.savez({str(tmp_path / 'rt.npz')!r}, losses=np.array(losses), **{{k.replace("/", "|"): v for k, v in r.parameters().items()}})
"""
    res = subprocess.run([str(REPO / ".venv-rt" / "bin" / "python"), "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    got = np.load(tmp_path / "rt.npz")
    want_losses, want_params = _torch_run(weights, "adamw", batches, "wasserstein")
    np.testing.assert_allclose(got["losses"], want_losses, rtol=TRAJ_RTOL)
    x, y = batch()
    zero = zero_grad_mask(_reference("wasserstein", weights, x, y)[3])
    assert_params_close({p: got[p] for p in want_params}, want_params, zero)


def test_external_data_model_keeps_weights_external(tmp_path):
    """Weights in external data stay there (referenced, never copied into the graph); the zero
    optimizer state goes to a sparse `<graph>.state.bin` beside the step graph; training gives
    the same numbers as the inline model."""
    m = onnx.load(str(MODELS / "lm_flat.onnx"))
    folder = tmp_path / "ext"
    folder.mkdir()
    onnx.save(m, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    (folder / "tokenizer.json").write_bytes(TOKENIZER.read_bytes())
    r = run_patch(["step", folder / "model.onnx"])
    assert r.returncode == 0, r.stderr
    step = folder / "model.step.onnx"
    g = onnx.load(str(step), load_external_data=False)
    locations = {e.value for t in g.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"weights.bin", "model.step.onnx.state.bin"}, locations
    meta = json.loads({p.key: p.value for p in g.metadata_props}["ntl_step"])
    float_state = [i for i, _ in meta["state"] if i != "ntl/state/step"]
    inits = {t.name: t for t in g.graph.initializer}
    assert all(inits[n].data_location == onnx.TensorProto.EXTERNAL for n in float_state), "no weights inline"
    inline = tmp_path / "inline.step.onnx"
    _step(MODELS / "lm_flat.onnx", inline, "wasserstein")
    batches = _batches(3)
    got = run_step_graph(step, batches)
    want = run_step_graph(inline, batches)
    np.testing.assert_array_equal(got[0], want[0])
    for p in want[1]:
        np.testing.assert_array_equal(got[1][p], want[1][p])


# Logits-only exports of the GPT-2 of fixtures/generate_step.py (same weights), references
# reference/step/gpt2.npz: gpt2_logits (fixtures/generate_forms.py, a plain torch.onnx.export;
# the loss is added automatically, with a notice) and gpt2_optimum (fixtures/generate_optimum.py,
# optimum-onnx 0.1.0 `main_export(task="text-generation")` with its defaults; `--add-loss`). The
# optimum graph also takes `attention_mask` and `position_ids`, and its constant folding stores
# lm_head.weight transposed under an exporter-generated name: reference/gpt2_optimum.json maps
# each initializer to its torch parameter.
LOGITS_ONLY = {"gpt2_logits": [], "gpt2_optimum": ["--add-loss"]}
LOGITS_CASES = [(m, l) for m in LOGITS_ONLY for l in ("wasserstein", "ntil")]


def _logits_only_names(model: str) -> dict[str, tuple[str, bool]]:
    """{initializer: (torch parameter, transposed)} for the initializers an exporter renamed."""
    if model != "gpt2_optimum":
        return {}
    ref = json.loads((MODELS.parent / "reference" / "gpt2_optimum.json").read_text())
    return {k: (v["parameter"], v["transposed"]) for k, v in ref["initializers"].items()}


def _logits_only_want(ref, key: str, params: list[str], names: dict) -> dict[str, np.ndarray]:
    """ref[f"{key}/<torch name>"] per graph parameter, transposed where the exporter transposed."""
    want = {}
    for p in params:
        k, transposed = names.get(p, (p, False))
        w = ref[f"{key}/{k}"]
        want[p] = w.T if transposed else w
    return want


def _logits_only_feeds(graph, input_ids, labels) -> dict[str, np.ndarray]:
    """The batch for the graph's data inputs, in input order: optimum's `attention_mask` is all
    ones (no padding, as in `model(input_ids, labels=labels)`), `position_ids` is arange(T)."""
    b, t = input_ids.shape
    known = {"input_ids": input_ids, "labels": labels, "attention_mask": np.ones((b, t), np.int64),
             "position_ids": np.tile(np.arange(t, dtype=np.int64), (b, 1))}
    return {i.name: known[i.name] for i in graph.input if i.name in known}


@pytest.mark.parametrize("model,loss", LOGITS_CASES, ids=[f"{m}-{l}" for m, l in LOGITS_CASES])
def test_logits_only_export_with_added_loss(model, loss, tmp_path):
    """A logits-only GPT-2 export gets Hugging Face's shifted causal-LM cross-entropy (added
    automatically with a notice, or by --add-loss): losses and gradients equal the same GPT-2
    exported with its own loss (torch references of fixtures/reference/step/gpt2.npz,
    `model(labels=...).loss`)."""
    ref = hf_reference("gpt2")
    names = _logits_only_names(model)
    src = MODELS / f"{model}.onnx"
    out = tmp_path / "m.grad.onnx"
    args = ["step", src, *LOGITS_ONLY[model], "--loss", loss, "--tokenizer", TOKENIZER, "--weight", str(WEIGHT),
            "-o", out, "--split", "--json"] + (NTIL_ARGS if loss == "ntil" else [])
    r = run_patch(args)
    assert r.returncode == 0, r.stderr
    assert "added input 'labels'" in r.stderr
    params = json.loads(r.stdout)["parameters"]
    key = f"grad/{loss}/float64"
    assert sorted(names.get(p, (p, False))[0] for p in params) == sorted(
        k.removeprefix(key + "/") for k in ref.files if k.startswith(key + "/")), "every torch parameter trains, nothing else"
    g = onnx.load(str(out))
    data = [i.name for i in onnx.load(str(src)).graph.input]
    assert [i.name for i in g.graph.input][:len(data) + 1] == data + ["labels"]
    x, y = ref["batch/input_ids"], ref["batch/labels"]
    outs = session(out).run(None, _logits_only_feeds(g.graph, x, y))
    np.testing.assert_allclose(outs[:3], ref[f"forward/{loss}/float64"], rtol=1e-5, atol=1e-7)
    want = _logits_only_want(ref, key, params, names)
    all_want = np.concatenate([w.ravel() for w in want.values()])
    floor = 1e-3 * float(np.linalg.norm(all_want))
    errs = {p: norm_rel(o.astype(np.float64), want[p], floor) for p, o in zip(params, outs[3:])}
    worst = max(errs, key=errs.get)
    print(f"{model}/{loss}: worst parameter {worst} {errs[worst]:.2e}")
    assert errs[worst] <= GRAD_RTOL, errs


def _left_padded_reference(x, y, mask):
    """torch float64 (total, {parameter: gradient}) of the fixture GPT-2 with `attention_mask`:
    the model of fixtures/generate_step.py (the weights optimum exported), run with SDPA (its
    eager attention turns a fully masked row into NaN in float64), CE + 0.3·NTL-WAS."""
    import generate_step

    m = generate_step.build_model("gpt2").double()
    m.config._attn_implementation = "sdpa"
    params = dict(m.named_parameters())
    x, y, mask = (torch.from_numpy(a) for a in (x, y, mask))
    logits = type(m).__mro__[1].forward(m, input_ids=x, attention_mask=mask).logits
    lab = generate_step.shifted(y)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), ignore_index=-100)
    total = ce + WEIGHT * generate_step.number_loss("wasserstein", logits, lab)
    grads = torch.autograd.grad(total, list(params.values()))
    return float(total), {k: g.numpy() for k, g in zip(params, grads)}


@pytest.mark.parametrize("attention", ["eager", "auto"])
def test_optimum_export_trains_on_left_padded_batches(attention, tmp_path):
    """optimum's GPT-2 (torch's SDPA decomposed; `Where(IsNaN(p), 0, p)` zeroes the rows that
    attend to nothing) on a left-padded batch, whose padding positions are such rows: loss and
    gradients equal torch's with the same `attention_mask`, with the attention as exported and
    blockwise. The labels ignore the padding; the first real token keeps its label, so the
    output of the last pad (zeros in torch's SDPA, and in the export) reaches the loss. Can
    fail: on the code before, the eager graph's gradients were NaN (the Softmax's gradient read
    its NaN rows); with the blockwise forward's zeroed rows left out, the losses differ."""
    ref = hf_reference("gpt2")
    names = _logits_only_names("gpt2_optimum")
    out = tmp_path / "m.grad.onnx"
    r = run_patch(["step", MODELS / "gpt2_optimum.onnx", "--add-loss", "--tokenizer", TOKENIZER, "--weight",
                   str(WEIGHT), "-o", out, "--split", "--json", "--attention", attention, "--attention-block", "3"])
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["attention"]["replaced"] == (0 if attention == "eager" else 2), summary["attention"]
    x, y = ref["batch/input_ids"], ref["batch/labels"].copy()
    mask = np.ones_like(x)
    mask[1, :3] = 0  # three pads before the second sequence
    y[1, :3] = -100
    total, grads = _left_padded_reference(x, y, mask)
    g = onnx.load(str(out))
    feeds = {**_logits_only_feeds(g.graph, x, y), "attention_mask": mask}
    outs = session(out).run(None, feeds)
    assert abs(float(outs[0]) - total) <= 1e-5 * total, (float(outs[0]), total)
    params = summary["parameters"]
    want = {}
    for p in params:
        k, transposed = names.get(p, (p, False))
        want[p] = grads[k].T if transposed else grads[k]
    floor = 1e-3 * float(np.linalg.norm(np.concatenate([w.ravel() for w in want.values()])))
    errs = {p: norm_rel(o.astype(np.float64), want[p], floor) for p, o in zip(params, outs[3:])}
    worst = max(errs, key=errs.get)
    print(f"{attention}: loss {float(outs[0]):.6f} (torch {total:.6f}), worst parameter {worst} {errs[worst]:.2e}")
    assert errs[worst] <= GRAD_RTOL, errs


def _optimum_patched(tmp_path):
    """gpt2_optimum through the patch command with --add-loss (λ = 0.3, wasserstein)."""
    src = MODELS / "gpt2_optimum.onnx"
    out = tmp_path / "m.ntl.onnx"
    r = run_patch([src, "--add-loss", "--tokenizer", TOKENIZER, "--weight", str(WEIGHT), "-o", out])
    assert r.returncode == 0, r.stderr
    return src, out, onnx.load(str(src)), onnx.load(str(out))


def test_optimum_export_patch_with_added_loss(tmp_path):
    """optimum's GPT-2 export through the patch command with --add-loss: the original inputs
    stay and `labels` follows them, `logits` is unchanged; `ce_loss` is Hugging Face's
    `model(input_ids, labels=labels).loss` and `loss` = ce + λ·NTL (reference/step/gpt2.npz)."""
    ref = hf_reference("gpt2")
    src, out, before, patched = _optimum_patched(tmp_path)
    assert [i.name for i in patched.graph.input] == [i.name for i in before.graph.input] + ["labels"]
    out_names = [o.name for o in patched.graph.output]
    assert out_names == ["loss", "logits", "ce_loss", "number_loss"], out_names
    x, y = ref["batch/input_ids"], ref["batch/labels"]
    total, ce, number = ref["forward/wasserstein/float64"]
    outs = dict(zip(out_names, session(out).run(None, _logits_only_feeds(patched.graph, x, y))))
    errs = {k: abs(float(outs[k]) - w) / abs(w) for k, w in (("ce_loss", ce), ("number_loss", number), ("loss", total))}
    print(f"gpt2_optimum patch: relative errors {errs}")
    assert max(errs.values()) <= 1e-5, errs
    logits = session(src).run(None, _logits_only_feeds(before.graph, x, y))[0]
    np.testing.assert_allclose(outs["logits"], logits, rtol=0, atol=1e-6)


def test_optimum_export_trains_in_ort_training(tmp_path):
    """ORT Training 1.19.2 `generate_artifacts(loss=None)` trains optimum's GPT-2 after
    --add-loss: the first step's losses and gradients are torch's (reference/step/gpt2.npz),
    and the loss after one AdamW step is finite. (ORT's LayerNormalization gradient reads the
    optional Mean/InvStdDev outputs the exporters leave out; ntl-patch declares them.)"""
    ort = quiet_ort()
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    ref = hf_reference("gpt2")
    names = _logits_only_names("gpt2_optimum")
    _, _, before, patched = _optimum_patched(tmp_path)
    out_names = [o.name for o in patched.graph.output]
    params = [t.name for t in before.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    assert sorted(names) == sorted(params)
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
    x, y = ref["batch/input_ids"], ref["batch/labels"]
    total, ce, _ = ref["forward/wasserstein/float64"]
    feeds = _logits_only_feeds(patched.graph, x, y)
    step = module(*feeds.values())
    loss0 = float(step[0])
    assert np.isfinite(loss0) and abs(loss0 - total) <= 1e-5 * abs(total), (loss0, total)
    assert abs(float(step[out_names.index("ce_loss")]) - ce) <= 1e-5 * abs(ce)
    want = _logits_only_want(ref, "grad/wasserstein/float64", params, names)
    all_want = np.concatenate([w.ravel() for w in want.values()])
    floor = 1e-3 * float(np.linalg.norm(all_want))
    errs = {p: norm_rel(state.parameters[p].grad.astype(np.float64), want[p], floor) for p in params}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= GRAD_RTOL, errs
    opt = Optimizer(str(art / "optimizer_model.onnx"), module)
    opt.set_learning_rate(1e-2)
    opt.step()
    module.lazy_reset_grad()
    loss1 = float(module(*feeds.values())[0])
    assert np.isfinite(loss1), "loss after one AdamW step"
    print(f"gpt2_optimum ORT Training: grad worst {worst} {errs[worst]:.2e}; loss {loss0:.6f} -> {loss1:.6f}")


def test_rescaled_loss_gets_the_number_loss_after_the_rescaling(weights, tmp_path):
    """The Hugging Face Trainer's `CE_sum / num_items_in_batch`: the number loss is added to
    the reported loss, so total = CE_sum/N + λ·NTL (not CE_sum/N + λ·NTL/N), `ce_loss` is the
    reported CE_sum/N, and the step graph's gradients are torch autograd's of that total."""
    import ntl_torch
    import tiny_lm
    from tiny_lm import VOCAB

    out = tmp_path / "m.grad.onnx"
    r = run_patch(["step", MODELS / "lm_sum_div.onnx", "--tokenizer", TOKENIZER, "--weight", str(WEIGHT),
                   "-o", out, "--split", "--json"])
    assert r.returncode == 0, r.stderr
    params = json.loads(r.stdout)["parameters"]
    x, y = batch()
    n_items = np.array(7.0, np.float32)
    outs = session(out).run(None, {"input_ids": x, "labels": y, "num_items_in_batch": n_items})

    m = tiny_lm.build("flat", {k: v.double() for k, v in weights.items()}, dtype=torch.float64)
    logits = m.logits(torch.from_numpy(x))
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), torch.from_numpy(y).reshape(-1), ignore_index=-100,
                         reduction="sum") / 7.0
    ntl = ntl_torch.ntl_value(ntl_torch.ntloss_object("wasserstein"), logits, torch.from_numpy(y))
    total = ce + WEIGHT * ntl
    np.testing.assert_allclose(outs[:3], [total.item(), ce.item(), ntl.item()], rtol=1e-5)
    ps = dict(m.named_parameters())
    want = dict(zip(ps, (g.numpy() for g in torch.autograd.grad(total, list(ps.values())))))
    all_want = np.concatenate([w.ravel() for w in want.values()])
    floor = 1e-3 * float(np.linalg.norm(all_want))
    errs = {p: norm_rel(o.astype(np.float64), want[p], floor) for p, o in zip(params, outs[3:])}
    assert max(errs.values()) <= GRAD_RTOL, errs

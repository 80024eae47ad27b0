"""`ntl-patch step --precision fp16|bf16`: mixed-precision step graphs.

float16 numerics run where float16 is real: tract (tract_step.py), whose kernels compute and
round in float16. onnxruntime 1.31's CPU provider has no float16 kernels for MatMul, Gemm, Add,
Mul, Softmax, ReduceSum and more: it runs those nodes in float32 between Casts it inserts and then
removes as Cast pairs, so there a float16 graph computes in float32 (nothing rounds, nothing
overflows: measured in test_onnxruntime_cpu_computes_fp16_in_float32).

Reference: torch autocast on the CPU with CUDA's float32 op list (torch_amp.py: CPU autocast
alone runs softmax/layer norm/exp/pow/sums in float16, CUDA's keeps them float32 as the step
graph does) + torch.amp.GradScaler("cpu") + torch.optim.AdamW, on the same weights and batches
(lm_flat with ntloss: tiny_lm + ntl_torch; GPT-2 / Llama: fixtures/generate_step.py's models and
losses, the TorchScript exports — tract cannot load the dynamo exports' step graphs at all), and
the float64 run of the same training as the exact trajectory.

Tolerances (20 AdamW steps, lr 1e-3), from float16's unit roundoff u = 2^-11 = 4.9e-4 and the
float64 run:
  - per-step losses: |graph - torch| <= 2u relative: each run rounds the matmul operands to
    float16 once (error <= u each; the losses themselves are float32 in both);
  - final parameters: the float16 runs' distance to the float64 trajectory, measured as a
    fraction of how far the float64 run moved the parameters, is the rounding error; the graph's
    may be at most 1.5x torch's (so it is as exact as torch autocast), and graph vs torch at most
    2x torch's (two independent errors of equal size differ by ~sqrt(2)x; measured 1.4x).
bf16: no CPU runtime here runs bfloat16 (ORT has no CPU kernels, tract none), so bf16 is checked
for structure only (casts where autocast puts them, types per the ONNX checker and strict shape
inference, CUDA/ROCm kernels); its numerics only by scripts/gpu/gpu-check.sh --precision.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from conftest import MODELS, TOKENIZER, run_patch
from precision_helpers import U16, as_f32, batches, dist, half_export, torch_model
from step_helpers import run_step_graph
from tract_step import TractStep

WEIGHT = 0.3
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
TRACT_MODELS = ["lm_flat", "gpt2_ts", "llama_ts"]
ALL_MODELS = ["lm_flat", "gpt2_ts", "gpt2_dynamo", "llama_ts", "llama_dynamo"]
# an initial scale far too large, a backoff that jumps 2^8 at a time and growth back up after 3
# clean steps: every scale is 2^40, 2^32, 2^24 or 2^16, far from the overflow boundary (between
# 2^16 and 2^24 for these models), so torch and the graph must skip the very same steps
OVERFLOW = dict(init_scale=2.0 ** 40, growth_factor=2.0 ** 8, backoff_factor=2.0 ** -8, growth_interval=3)


def step_graph(model: str, out: Path, precision: str, *extra) -> dict:
    args = [MODELS / f"{model}.onnx", "--tokenizer", TOKENIZER, "--loss", "wasserstein",
            "--weight", str(WEIGHT), "--precision", precision, "-o", out,  # --lr: 1e-3, ADAMW's
            "--json", *extra]
    r = run_patch(["step", *map(str, args)])
    assert r.returncode == 0, f"ntl-patch step exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout)


def scaler_args(opts: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}" + "=" + str(v) for k, v in opts.items()]


# ---------------------------------------------------------------------------- torch references

SGD_CLIP = dict(lr=1e-2, momentum=0.9, weight_decay=0.01, max_grad_norm=2.0)  # the true norms are 1.4 - 2.8: clipped on some steps only


def torch_run(model: str, dtype=torch.float32, amp: bool = False, scaler: dict | None = None,
              skip: list[bool] | None = None, sgd_clip: bool = False):
    """losses, final parameters (float64), skipped flags, scales after each step, step count.
    skip (without amp): the steps whose update is left out, as a scaler skipped them."""
    import torch_amp

    m, _, loss_fn = torch_model(model, dtype)
    params = dict(m.named_parameters())
    if sgd_clip:
        sgd = {k: v for k, v in SGD_CLIP.items() if k != "max_grad_norm"}
        opt = torch.optim.SGD(params.values(), foreach=False, **sgd)
    else:
        opt = torch.optim.AdamW(params.values(), foreach=False, **ADAMW)
    clip = (lambda: torch.nn.utils.clip_grad_norm_(params.values(), SGD_CLIP["max_grad_norm"])) \
        if sgd_clip else (lambda: None)
    gs = torch.amp.GradScaler("cpu", **(scaler or {})) if amp else None
    losses, skipped, scales = [], [], []
    for x, y in batches(model):
        opt.zero_grad(set_to_none=True)
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        if amp:
            with torch_amp.cuda_float32_list(), torch.autocast("cpu", dtype=torch.float16):
                total = loss_fn(m, x, y)
            before = gs.get_scale()
            gs.scale(total).backward()
            gs.unscale_(opt)  # clipping sees the true gradient
            clip()
            gs.step(opt)
            gs.update()
            skipped.append(gs.get_scale() < before)
            scales.append(gs.get_scale())
        else:
            total = loss_fn(m, x, y)
            total.backward()
            clip()
            if not (skip and skip[len(losses)]):
                opt.step()
        losses.append(total.item())
    steps = max((int(s.get("step", 0)) for s in opt.state.values()), default=0)
    final = {k: p.detach().double().numpy().copy() for k, p in params.items()}
    return np.array(losses), final, skipped, scales, steps


def graph_run(path: Path, model: str, tmp_path: Path):
    """The step graph trained in tract: losses, final parameters, skipped flags, scales, and
    the whole state before and after each step."""
    r = TractStep(path, tmp_path)
    losses, skipped, scales, states = [], [], [], [dict(r.state)]
    for x, y in batches(model):
        out = r.step({"input_ids": x, "labels": y})
        losses.append(float(np.ravel(out[r.outputs[0]])[0]))
        if "ntl/skipped" in out:
            skipped.append(bool(np.ravel(out["ntl/skipped"])[0]))
            scales.append(float(np.ravel(r.state["ntl/state/loss_scale"])[0]))
        states.append(dict(r.state))
    final = {p: r.state[p].astype(np.float64) for p in r.meta["parameters"]}
    return np.array(losses), final, skipped, scales, states, r.meta


# ---------------------------------------------------------------------------- fp16 numerics


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(model, kind):
        if (model, kind) not in cache:
            if kind == "float64":  # the exact trajectory, skipping what torch amp skipped
                cache[model, kind] = torch_run(model, torch.float64, skip=get(model, "amp")[2])
            elif kind == "sgd_clip64":
                cache[model, kind] = torch_run(model, torch.float64, skip=get(model, "sgd_clip")[2],
                                               sgd_clip=True)
            elif kind == "sgd_clip":
                cache[model, kind] = torch_run(model, torch.float32, amp=True, sgd_clip=True)
            elif kind == "amp":
                cache[model, kind] = torch_run(model, torch.float32, amp=True)
            else:
                cache[model, kind] = torch_run(model, torch.float32, amp=True, scaler=OVERFLOW)
        return cache[model, kind]
    return get


CASES = [(m, "adamw") for m in TRACT_MODELS] + [("lm_flat", "sgd_clip")]


@pytest.mark.parametrize("model,optimizer", CASES, ids=[f"{m}-{o}" for m, o in CASES])
def test_fp16_trains_like_torch_autocast(model, optimizer, references, tmp_path):
    """AdamW hides a missing unscale (m/√v does not see a constant factor): SGD with momentum
    and clip_grad_norm_ (on the unscaled gradient, as GradScaler.unscale_ before clipping) does not."""
    out = tmp_path / "m.step.onnx"
    extra = []
    if optimizer == "sgd_clip":
        extra = ["--optimizer", "sgd", *(f"--{k.replace('_', '-')}={v}" for k, v in SGD_CLIP.items())]
    step_graph(model, out, "fp16", *extra)
    got, got_p, got_skip, got_scale, _, meta = graph_run(out, model, tmp_path)
    assert meta["precision"] == "fp16" and meta["skip_output"] == "ntl/skipped"
    l64, p64, *_ = references(model, "float64" if optimizer == "adamw" else "sgd_clip64")
    lam, pam, am_skip, am_scale, am_steps = references(model, "amp" if optimizer == "adamw" else "sgd_clip")
    start = torch_model(model, torch.float64)[0].state_dict()
    start = {k: v.numpy() for k, v in start.items() if k in p64}
    assert got_skip == am_skip and got_scale == am_scale, (got_skip, am_skip)
    loss_err = np.max(np.abs(got - lam) / np.abs(lam))
    d_graph, d_torch, d_both = dist(got_p, p64, start), dist(pam, p64, start), dist(got_p, pam, start)
    print(f"{model}: losses vs torch amp {loss_err:.2e} (torch amp vs float64 "
          f"{np.max(np.abs(lam - l64) / np.abs(l64)):.2e}); parameters, fraction of the float64 "
          f"update: graph {d_graph:.3g}, torch amp {d_torch:.3g}, graph vs torch {d_both:.3g}")
    assert loss_err <= 2 * U16
    assert d_graph <= 1.5 * d_torch
    assert d_both <= 2 * d_torch


@pytest.mark.parametrize("model", ["lm_flat", "llama_ts"])
def test_fused_head_projects_in_float16_like_autocast(model, tmp_path):
    """The fused LM head under --precision fp16 (chunks of 3 positions): its projection reads a
    float16 copy of the weight made once per step outside the Scans (autocast's cast cache) and
    the chunk's hidden states in float16; its logits are widened to float32 before the max and
    log-sum-exp, and its two backward products (dW, dh) run in float16 too. Trained by
    StepRunner on onnxruntime (tract cannot analyse a Scan that reads the step's state inputs
    from the outer graph), against torch autocast + GradScaler with the tolerances above. A
    loss scale of 2^10 that overflows nowhere: onnxruntime's CPU provider computes float16 ops
    in float32 (see below), so it cannot overflow where torch's float16 does."""
    sys.path.insert(0, str(MODELS.parents[1] / "python"))
    from ntl_patch import StepRunner

    out = tmp_path / "m.step.onnx"
    low = dict(init_scale=2.0 ** 10, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)
    step_graph(model, out, "fp16", "--fused-head", "on", "--head-chunk-tokens", "3", *scaler_args(low))
    g = onnx.load(str(out)).graph
    scans = [n for n in g.node if n.op_type == "Scan"]
    assert scans
    half_weights = [n.output[0] for n in g.node if n.op_type == "Cast" and n.output[0].startswith("ntl/fused/w_half")]
    assert len(half_weights) == len(scans), "one float16 copy of the weight per Scan, outside it"
    for scan in scans:
        body = scan.attribute[0].g
        ops = [n.op_type for n in body.node]
        assert "Gemm" not in ops
        to = {n.output[0]: n.attribute[0].i for n in body.node if n.op_type == "Cast"}
        products = [n for n in body.node if n.op_type == "MatMul"]
        for n in products:  # both operands cast to float16 (directly or through a Transpose)
            srcs = [next((m.input[0] for m in body.node if m.output[0] == i and m.op_type == "Transpose"), i)
                    for i in n.input]
            assert all(to.get(i) == onnx.TensorProto.FLOAT16 or i in half_weights for i in srcs), n
        assert to.get(next(n.input[0] for n in body.node if n.op_type == "TopK")) == onnx.TensorProto.FLOAT

    r = StepRunner(out, providers=["CPUExecutionProvider"])
    got, skipped = [], []
    for x, y in batches(model):
        got.append(float(np.ravel(r.step({"input_ids": x, "labels": y}))[0]))
        skipped.append(r.last_step_skipped)
    got_p = {p: v.astype(np.float64) for p, v in r.parameters().items()}
    lam, pam, am_skip, *_ = torch_run(model, torch.float32, amp=True, scaler=low)
    assert not any(am_skip) and not any(skipped)
    l64, p64, *_ = torch_run(model, torch.float64)
    start = torch_model(model, torch.float64)[0].state_dict()
    start = {k: v.numpy() for k, v in start.items() if k in p64}
    loss_err = np.max(np.abs(np.array(got) - lam) / np.abs(lam))
    d_graph, d_torch, d_both = dist(got_p, p64, start), dist(pam, p64, start), dist(got_p, pam, start)
    print(f"{model} fused: losses vs torch amp {loss_err:.2e}; parameters, fraction of the float64 "
          f"update: graph {d_graph:.3g}, torch amp {d_torch:.3g}, graph vs torch {d_both:.3g}")
    assert loss_err <= 2 * U16
    assert d_graph <= 1.5 * d_torch
    assert d_both <= 2 * d_torch


@pytest.mark.parametrize("model", TRACT_MODELS)
def test_fp16_overflow_skips_like_grad_scaler(model, references, tmp_path):
    out = tmp_path / "m.step.onnx"
    step_graph(model, out, "fp16", *scaler_args(OVERFLOW))
    got, got_p, skipped, scales, states, meta = graph_run(out, model, tmp_path)
    lam, pam, am_skip, am_scale, am_steps = references(model, "overflow")
    assert meta["loss_scale"] == OVERFLOW
    assert skipped[:3] == [True] * 3 and not all(skipped[3:]), skipped
    assert any(skipped[4:]), "growth back to 2^24 overflows again"
    assert skipped == am_skip, (skipped, am_skip)
    assert scales == am_scale, (scales, am_scale)
    for k, s in enumerate(skipped):
        before, after = states[k], states[k + 1]
        for name, v in before.items():
            if name in ("ntl/state/loss_scale", "ntl/state/growth_tracker"):
                continue
            if s:  # a skipped step changes nothing: parameters, moments, step count
                assert np.array_equal(after[name], v), (k, name)
            elif name in meta["parameters"]:
                assert not np.array_equal(after[name], v), (k, name)
    assert int(np.ravel(states[-1]["ntl/state/step"])[0]) == am_steps == skipped.count(False)
    # the unskipped steps train as torch's (same tolerances as above, relative to torch's loss)
    assert np.max(np.abs(got - lam) / np.abs(lam)) <= 2 * U16


def test_losses_are_unscaled_and_gradients_scaled(tmp_path):
    """--split: the gradient graph takes the loss scale and returns scale x gradient; the
    losses are the forward's, whatever the scale."""
    import onnxruntime as ort

    out = tmp_path / "m.grad.onnx"
    step_graph("lm_flat", out, "fp16", "--split")
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x, y = batches("lm_flat")[0]
    one = sess.run(None, {"input_ids": x, "labels": y, "ntl/state/loss_scale": np.array(1.0, np.float32)})
    big = sess.run(None, {"input_ids": x, "labels": y, "ntl/state/loss_scale": np.array(1024.0, np.float32)})
    np.testing.assert_allclose(big[:3], one[:3], rtol=1e-6)
    for a, b in zip(one[3:], big[3:]):  # (float16 casts round the two differently: norm-relative)
        assert np.linalg.norm(b - 1024.0 * a) <= 1e-3 * np.linalg.norm(1024.0 * a) + 1e-6


# ---------------------------------------------------------------------------- structure (bf16 too)

HALF = {"fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}
HALF_OPS = {"MatMul", "Gemm", "Einsum"}
FLOAT32_OPS = {"Softmax", "LogSoftmax", "SoftmaxCrossEntropyLoss", "LayerNormalization", "ReduceSum",
               "ReduceMean", "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp", "CumSum",
               "Exp", "Log", "Pow", "Reciprocal"}


def _typed(path: Path) -> tuple[onnx.ModelProto, dict]:
    """The model (checked: full ONNX checker, strict shape inference with type checks) and the
    element type of every tensor."""
    m = onnx.load(str(path))
    onnx.checker.check_model(m, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=True)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.value_info, *g.input, *g.output]}
    types.update({t.name: t.data_type for t in g.initializer})
    return m, types


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("model", ALL_MODELS)
def test_casts_where_autocast_puts_them(model, precision, tmp_path):
    out = tmp_path / "m.step.onnx"
    summary = step_graph(model, out, precision)
    m, types = _typed(out)
    half = HALF[precision]
    meta = json.loads({p.key: p.value for p in m.metadata_props}["ntl_step"])
    assert meta["precision"] == precision
    float_in = lambda n: [types[i] for i in n.input if i and types.get(i) in (1, half)]  # noqa: E731
    n_half = 0
    for n in m.graph.node:
        if n.op_type in HALF_OPS:
            assert set(float_in(n)) == {half}, (n.name, float_in(n))
            n_half += 1
        elif n.op_type in FLOAT32_OPS:
            assert set(float_in(n)) <= {1}, (n.op_type, n.name, float_in(n))
    assert n_half >= 6, "forward and backward matmuls"
    params = meta["parameters"]
    # float32 masters: every state tensor, the losses and the learning rate are float32/int64
    for i, o in meta["state"]:
        assert types[i] == types[o] and types[i] in (1, 7), (i, types[i])
    for name in meta["losses"]:
        assert types[name] == 1
    # each parameter a matmul reads is cast to the half type once per step
    casts = [n for n in m.graph.node if n.op_type == "Cast" and n.input[0] in params]
    to = {}
    for n in casts:
        to.setdefault(n.input[0], []).append(n.attribute[0].i)
    assert all(len(v) == len(set(v)) for v in to.values()), to
    # the optimizer reads float32 gradients: no half tensor reaches a state output's producer
    producers = {o: n for n in m.graph.node for o in n.output}
    for _, o in meta["state"]:
        assert set(float_in(producers[o])) <= {1}, o
    assert (meta["skip_output"] is not None) == (precision == "fp16")
    assert summary["precision"] == precision


def _scaled_after_first_matmul(out: Path, form: str) -> Path:
    """llama_dynamo with its first MatMul's output times 1.0, a `Constant` written as the dynamo
    exporter writes a Python number (`value_float`) or as a one-value tensor (`value`)."""
    from onnx import helper

    m = onnx.load(str(MODELS / "llama_dynamo.onnx"))
    g = m.graph
    mm = next(n for n in g.node if n.op_type == "MatMul")
    y, scaled, c = mm.output[0], mm.output[0] + "_scaled", mm.output[0] + "_c"
    for n in g.node:
        n.input[:] = [scaled if i == y else i for i in n.input]
    value = {"value_float": 1.0} if form == "value_float" else \
        {"value": helper.make_tensor("one", onnx.TensorProto.FLOAT, [], [1.0])}
    at = list(g.node).index(mm) + 1
    g.node.insert(at, helper.make_node("Mul", [y, c], [scaled]))
    g.node.insert(at, helper.make_node("Constant", [], [c], **value))
    onnx.save(m, str(out))
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_value_float_constant_is_a_python_number(precision, tmp_path):
    """A scalar written as `Constant(value_float=…)` (the dynamo exporter's small constants) is a
    Python number to autocast, as a one-value tensor constant is: a half product times it stays
    half, and the step graph is well typed (ONNX checker, strict shape inference); under fp16
    both forms train to the same losses in onnxruntime. Can fail: before, the constant had no
    type, and the Mul read float16 and float32 (onnxruntime refused the graph)."""
    half, losses = HALF[precision], {}
    for form in ("value_float", "value"):
        src = _scaled_after_first_matmul(tmp_path / f"{form}.onnx", form)
        out = tmp_path / f"{form}.step.onnx"
        r = run_patch(["step", str(src), "--tokenizer", str(TOKENIZER), "--precision", precision, "-o", str(out)])
        assert r.returncode == 0, r.stderr
        m, types = _typed(out)
        mul = next(n for n in m.graph.node if n.output[0].endswith("_scaled"))
        assert [types.get(i) for i in mul.input] == [half, half], (form, [types.get(i) for i in mul.input])
        if precision == "fp16":
            losses[form], _, _ = run_step_graph(out, batches("llama_dynamo", 3))
    if precision == "fp16":
        assert losses["value_float"] == losses["value"], losses
        assert all(np.isfinite(losses["value"])), losses


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("model", ALL_MODELS)
def test_every_node_has_a_gpu_kernel(model, precision, tmp_path):
    """The kernel tables (onnxruntime-gpu 1.31.1 CUDA, onnxruntime-rocm 1.22.2 ROCm): every
    node of the half-precision step graph has a kernel for its types."""
    out = tmp_path / "m.step.onnx"
    step_graph(model, out, precision)
    r = run_patch(["inspect", str(out), "--target", "cuda", "--target", "rocm", "--json"])
    assert r.returncode == 0, r.stdout + r.stderr
    targets = json.loads(r.stdout)["gpu"]
    assert len(targets) == 2
    for t in targets:
        assert t["all_ops_on_gpu"] and not t["fallbacks"], t["fallbacks"][:3]


# ---------------------------------------------------------------------------- onnxruntime CPU


def test_onnxruntime_cpu_computes_fp16_in_float32(tmp_path):
    """The trap the README names: onnxruntime 1.31's CPU provider runs the float16 graph's
    MatMuls and elementwise ops in float32 (no float16 kernels; the Cast pairs it inserts around
    them are removed again), so only the graph's own Casts round: its losses sit much closer to
    the float32 graph's than real float16 (tract) does."""
    import onnxruntime as ort

    fp16, fp32 = tmp_path / "h.step.onnx", tmp_path / "f.step.onnx"
    step_graph("gpt2_ts", fp16, "fp16")
    step_graph("gpt2_ts", fp32, "fp32")
    x, y = batches("gpt2_ts")[0]
    so = ort.SessionOptions()
    so.log_severity_level = 3
    run = lambda p: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"]).run(  # noqa: E731
        None, {"input_ids": x, "labels": y})[0]
    ort16, ort32 = float(run(fp16)), float(run(fp32))
    tract16 = float(np.ravel(TractStep(fp16, tmp_path).step({"input_ids": x, "labels": y})["loss"])[0])
    print(f"gpt2 loss: ORT fp16 graph {ort16:.7f}, ORT fp32 graph {ort32:.7f}, tract fp16 {tract16:.7f}")
    assert 3 * abs(ort16 - ort32) <= abs(tract16 - ort32)


# ---------------------------------------------------------------------------- half-precision exports


@pytest.mark.parametrize("elem", ["float16", "bfloat16"])
def test_half_export_needs_precision_and_trains_from_float32_masters(elem, tmp_path):
    import onnxruntime as ort

    src = tmp_path / "half.onnx"
    half_export(src, torch.float16 if elem == "float16" else torch.bfloat16)
    r = run_patch(["step", src, "--tokenizer", TOKENIZER, "-o", tmp_path / "x.onnx"])
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert f"weights are {elem}" in r.stderr and "--precision fp16" in r.stderr, r.stderr
    assert not (tmp_path / "x.onnx").exists()

    base = ["--tokenizer", TOKENIZER, "--weight", str(WEIGHT)]
    out, ref = tmp_path / "s.step.onnx", tmp_path / "ref.step.onnx"
    assert run_patch(["step", src, *base, "--precision", "fp32", "-o", out]).returncode == 0
    assert run_patch(["step", MODELS / "lm_flat.onnx", *base, "-o", ref]).returncode == 0
    m = onnx.load(str(out))
    meta = json.loads({p.key: p.value for p in m.metadata_props}["ntl_step"])
    inits = {t.name: t for t in m.graph.initializer}
    half = {t.name: t for t in onnx.load(str(src)).graph.initializer}
    masters = {}
    for p in meta["parameters"]:  # float32 masters holding the export's values exactly
        assert inits[p].data_type == onnx.TensorProto.FLOAT
        masters[p] = as_f32(inits[p])
        np.testing.assert_array_equal(masters[p], as_f32(half[p]))
    # --precision fp32: the float32 export's step graph started from the same weights
    so = ort.SessionOptions()
    so.log_severity_level = 3
    x, y = batches("lm_flat")[0]
    got = ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": x, "labels": y})
    want = ort.InferenceSession(str(ref), so, providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": x, "labels": y, **masters})
    np.testing.assert_allclose(got[:3], want[:3], rtol=1e-6)
    # the trained float32 masters go back into the half export rounded to its type
    import sys

    sys.path.insert(0, str(MODELS.parents[1] / "python"))
    from ntl_patch import StepRunner

    runner = StepRunner(out, providers=["CPUExecutionProvider"])
    for x, y in batches("lm_flat")[:2]:
        runner.step({"input_ids": x, "labels": y})
    saved = runner.save_inference_model(src, tmp_path / "trained.onnx")
    trained = {t.name: t for t in onnx.load(str(saved)).graph.initializer}
    for p, v in runner.parameters().items():
        assert trained[p].data_type == half[p].data_type
        want = torch.from_numpy(v).to(torch.float16 if elem == "float16" else torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(as_f32(trained[p]), want)
        assert not np.array_equal(as_f32(trained[p]), as_f32(half[p])), p
    if elem == "float16":  # fp16: the float32 export's fp16 graph from the same weights, in tract
        out16, ref16 = tmp_path / "h.step.onnx", tmp_path / "r.step.onnx"
        assert run_patch(["step", src, *base, "--precision", "fp16", "-o", out16]).returncode == 0
        assert run_patch(["step", MODELS / "lm_flat.onnx", *base, "--precision", "fp16", "-o", ref16]).returncode == 0
        a, b = TractStep(out16, tmp_path), TractStep(ref16, tmp_path)
        b.state.update(masters)
        for x, y in batches("lm_flat")[:5]:
            la, lb = (float(np.ravel(r.step({"input_ids": x, "labels": y})["loss"])[0]) for r in (a, b))
            # the two exports' graphs differ in float32 op order only (measured 4e-6), far
            # below any float16 rounding (u = 4.9e-4)
            assert abs(la - lb) <= 2e-5 * abs(lb), (la, lb)


def test_precision_option_errors(tmp_path):
    src = MODELS / "lm_flat.onnx"
    cases = [
        (["--init-scale", "1024"], "add --precision fp16"),
        (["--precision", "bf16", "--growth-interval", "5"], "add --precision fp16"),
        (["--precision", "fp16", "--init-scale", "0"], "--init-scale must be"),
        (["--precision", "fp16", "--growth-factor", "1"], "--growth-factor must be"),
        (["--precision", "fp16", "--backoff-factor", "1.5"], "--backoff-factor must be"),
        (["--precision", "fp16", "--growth-interval", "0"], "--growth-interval must be"),
        (["--precision", "fp8"], "fp8"),
    ]
    for extra, needle in cases:
        r = run_patch(["step", src, "--tokenizer", TOKENIZER, "-o", tmp_path / "o.onnx", *extra])
        assert r.returncode in (1, 2) and needle in r.stderr, (extra, r.stderr)
        assert r.stderr.strip().count("\n") == 0, r.stderr
        assert not (tmp_path / "o.onnx").exists()


# ---------------------------------------------------------------------------- Python API


def test_step_runner_exposes_skips_and_scale(tmp_path):
    """StepRunner on onnxruntime (CPU): skipped steps change no state, steps_taken counts the
    applied ones (torch's optimizer step count), loss_scale follows GradScaler's schedule."""
    import sys

    sys.path.insert(0, str(MODELS.parents[1] / "python"))
    from ntl_patch import StepRunner

    out = tmp_path / "m.step.onnx"
    step_graph("lm_flat", out, "fp16", *scaler_args(OVERFLOW))
    r = StepRunner(out, providers=["CPUExecutionProvider"])
    assert r.loss_scale == 2.0 ** 40 and r.skip_output == "ntl/skipped"
    before = r.state_dict()
    rows = []
    for x, y in batches("lm_flat")[:6]:
        r.step({"input_ids": x, "labels": y})
        rows.append((r.last_step_skipped, r.loss_scale, r.steps_taken, r.skipped_steps))
        after = r.state_dict()
        for name, v in before.items():
            if r.last_step_skipped and name not in ("ntl/state/loss_scale", "ntl/state/growth_tracker"):
                assert np.array_equal(after[name], v), name
        before = after
    assert [s for s, *_ in rows[:4]] == [True, True, True, False], rows
    assert [sc for _, sc, *_ in rows[:3]] == [2.0 ** 32, 2.0 ** 24, 2.0 ** 16], rows
    skipped, applied = rows[-1][3], rows[-1][2]
    assert skipped + applied == 6 and int(before["ntl/state/step"]) == applied
    fp32 = tmp_path / "f.step.onnx"
    step_graph("lm_flat", fp32, "fp32")
    plain = StepRunner(fp32, providers=["CPUExecutionProvider"])
    assert plain.loss_scale is None and plain.skip_output is None
    plain.step({"input_ids": x, "labels": y})
    assert not plain.last_step_skipped and plain.steps_taken == 1


def test_data_parallel_inf_check_is_global(tmp_path):
    """DataParallel on fp16 --split graphs, 2 ranks (gloo): an inf in one rank's gradient skips
    the step on every rank (the update graph checks the all-reduced gradient), as DDP +
    GradScaler; the ranks stay bit-identical."""
    import os
    import subprocess
    import sys

    grad = tmp_path / "lm.grad.onnx"
    summary = step_graph("lm_flat", grad, "fp16", "--split")
    assert summary["outputs"][1].endswith("lm.update.onnx")
    torchrun = Path(sys.executable).parent / "torchrun"
    p = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2",
                        str(Path(__file__).parent / "dp_amp_worker.py"), str(grad), str(tmp_path / "r.npz")],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, f"torchrun exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    z = np.load(tmp_path / "r.npz")
    for rank in ("rank0", "rank1"):
        rows = z[rank]
        assert list(rows[:, 1]) == [0, 0, 1, 0, 0, 0], (rank, rows)
        assert list(rows[:, 2]) == [65536] * 2 + [32768] * 4, (rank, rows)
        assert list(rows[:, 3]) == [1, 2, 2, 3, 4, 5], (rank, rows)
        assert np.all(np.isfinite(rows[:, 0]))
    assert bool(z["same_params"])

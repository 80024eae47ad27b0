"""LoRA step graphs (`ntl-patch step --lora-r R`) against torch + Hugging Face PEFT 0.21.2 + ntloss.

Reference: the same torch model as the fixture (tiny_lm / fixtures/generate_step.py's GPT-2 and
Llama), wrapped by `peft.get_peft_model(model, LoraConfig(...))` with the LoRA options given to
`ntl-patch step` (defaults: PEFT's), its lora_A / lora_B set to the step graph's initial values
(read from the graph's initializers by the names in its `lora` metadata), and trained with
torch.optim.AdamW over the LoRA parameters only (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight
decay 0.01: the step graph's defaults) on CE + 0.3 * ntloss wasserstein, 10 steps, in float64
(the exact trajectory; torch's float32 run is printed beside it). The step graph runs in
ntl_patch.StepRunner (onnxruntime on the CPU). Checked:
  - losses per step within 1e-5 relative, final A and B within 1e-4 norm-relative (tiny LM,
    GPT-2 and Llama from both exporters, r = 1 / 4 / 8 / 64, rsLoRA, several target sets);
  - fp16 (`--precision fp16`, tract's float16 kernels) against torch autocast + GradScaler +
    PEFT, with the tolerances of test_precision.py;
  - the graph: only A and B train (they alone have optimizer moments), the base weights are
    constants, the resolved targets are PEFT's defaults, A is nn.Linear's Kaiming-uniform
    (bound 1/sqrt(in)) and B zeros, seeded by --seed;
  - the files: save_adapter's adapter_config.json has the keys and values of PEFT's own
    save_pretrained, its safetensors the same keys and shapes; PeftModel.from_pretrained loads
    it and gives the merged ONNX model's logits (save_inference_model: W + s·B·A) within 1e-5,
    and merge_and_unload() gives the same logits and weights; a head trained with --train is
    PEFT's modules_to_save; float16/bfloat16 exports merge in their type; a layer whose module
    path was lost is saved under its ONNX name with a warning; graphs without LoRA are refused;
    the .onnx_adapter file (onnxruntime 1.31.1 in .venv-rt) reads back and runs through
    RunOptions.add_active_adapter;
  - DataParallel (--split): one process saves the same adapter as StepRunner; two gloo ranks
    all-reduce A and B only and train as torch + PEFT on the mean of the shards' losses.
Run time: about 60 s of CPU (the two-rank check, torchrun + 2 processes importing torch, ~20 s).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from conftest import MODELS, REPO, TOKENIZER, patch_command, run_patch
from lora_helpers import (ADAMW, CASES, LOSS_RTOL, PARAM_RTOL, TRAIN, WEIGHT, batches, build_step,
                          build_step_from, fixture_arch, norm_rel, peft_config, peft_model, peft_names,
                          peft_param, step_meta, torch_train)

sys.path.insert(0, str(REPO / "python"))
from ntl_patch import StepRunner, _lora, _onnx_decode, _safetensors  # noqa: E402

import peft  # noqa: E402  (tests/python/requirements.txt pins peft 0.21.2)

FILE_RTOL = 1e-5


def _step_args(case: str) -> list[str]:
    _, r, alpha, targets, rslora = CASES[case]
    args = ["--lora-r", str(r)]
    if alpha is not None:
        args += ["--lora-alpha", repr(alpha)]
    if targets is not None:
        args += ["--lora-targets", ",".join(targets)]
    if rslora:
        args.append("--use-rslora")
    for prefix in TRAIN.get(case, ([], []))[0]:
        args += ["--train", prefix]
    return args


# ---------------------------------------------------------------------------- shared runs


class Trained:
    """One case: its step graph, trained 10 steps by StepRunner and by torch + PEFT."""

    def __init__(self, case: str, folder: Path):
        self.case, self.fixture = case, CASES[case][0]
        self.folder = folder
        self.path = folder / f"{case}.step.onnx"
        self.summary = build_step(self.fixture, self.path, *_step_args(case))
        self.meta = step_meta(self.path)
        self.lora = self.meta["lora"]
        self.initial = _onnx_decode.read_initializers(self.path, self.meta["parameters"])
        self.data = batches(self.fixture)
        self.runner = StepRunner(self.path, providers=["CPUExecutionProvider"])
        self.losses = np.array([self.runner.step({"input_ids": x, "labels": y})[0] for x, y in self.data])
        self.params = self.runner.parameters()
        # the exact trajectory (float64) is the reference; torch's float32 run for comparison
        # (and its PEFT model for the file checks): float32 round-off, which AdamW's first steps
        # turn into ±lr moves of near-zero-gradient entries, puts torch float32 itself up to
        # 2e-4 from float64 in some B (llama_dynamo's up_proj; the graph: 4e-5)
        self.want_losses, self.want_params, _ = torch_train(case, self.lora, self.initial, self.data,
                                                            torch.float64)
        self.f32_losses, self.f32_params, self.peft = torch_train(case, self.lora, self.initial, self.data)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    cache: dict[str, Trained] = {}

    def get(case: str) -> Trained:
        if case not in cache:
            cache[case] = Trained(case, tmp_path_factory.mktemp(case))
        return cache[case]
    return get


# ---------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("case", list(CASES))
def test_trains_like_peft(case, trained):
    t = trained(case)
    loss_err = float(np.max(np.abs(t.losses - t.want_losses) / np.abs(t.want_losses)))
    assert sorted(t.params) == sorted(t.want_params)
    errs = {n: norm_rel(t.params[n], t.want_params[n]) for n in t.params}
    worst = max(errs, key=errs.get)
    f32 = max(norm_rel(t.f32_params[n], t.want_params[n]) for n in errs)
    f32_loss = float(np.max(np.abs(t.f32_losses - t.want_losses) / np.abs(t.want_losses)))
    print(f"{case}: losses {t.losses[0]:.6f} -> {t.losses[-1]:.6f}; vs torch+PEFT float64: worst loss "
          f"rel {loss_err:.2e}, worst A/B norm-rel {errs[worst]:.2e} ({worst}); torch float32 vs "
          f"float64: {f32_loss:.2e}, {f32:.2e}; scaling {t.lora['scaling']}")
    assert loss_err <= LOSS_RTOL, (t.losses, t.want_losses)
    assert errs[worst] <= PARAM_RTOL, f"{worst}: {errs[worst]:.3g}"
    assert all(t.params[la["lora_B"]].any() for la in t.lora["layers"]), "a B never left zero"
    assert t.losses[-1] != t.losses[0]


@pytest.mark.parametrize("case", ["llama_ts", "gpt2_ts", "tiny", "rslora"])
def test_graph_contract(case, trained):
    """Only A and B train; the base weights are frozen constants; targets and shapes are PEFT's."""
    t = trained(case)
    fixture, r, alpha, targets, rslora = CASES[case]
    lora = t.lora
    names = _lora.lora_names(lora)
    assert sorted(t.meta["parameters"]) == sorted(names), "only A and B train"
    state_in = {i for i, _ in t.meta["state"]}
    base = {la["weight"] for la in lora["layers"]}
    assert not base & state_in, "a base weight is trained"
    moments = state_in - names - {"ntl/state/step"}
    assert moments == {f"ntl/state/{n}/{m}" for n in names for m in ("exp_avg", "exp_avg_sq")}, \
        "AdamW moments for A and B only"
    cfg = peft_config(case)
    assert sorted(lora["target_modules"]) == sorted(cfg.target_modules)
    assert lora["r"] == r and lora["use_rslora"] == rslora and lora["bias"] == "none"
    assert lora["lora_alpha"] == (alpha if alpha is not None else 8)
    assert math.isclose(lora["scaling"], lora["lora_alpha"] / (math.sqrt(r) if rslora else r), rel_tol=1e-7)
    pm_modules = {k.removeprefix("base_model.model.").removesuffix(".lora_A.default.weight")
                  for k, _ in t.peft.named_parameters() if k.endswith(".lora_A.default.weight")}
    assert {la["module"] for la in lora["layers"]} == pm_modules
    original = onnx.load(str(MODELS / f"{fixture}.onnx"))
    dims = {i.name: list(i.dims) for i in original.graph.initializer}
    params = dict(t.peft.named_parameters())
    for la in lora["layers"]:
        n_in, n_out = la["in_features"], la["out_features"]
        assert la["lora_A"] == f"ntl/lora/{la['module']}.lora_A.weight"
        assert la["lora_B"] == f"ntl/lora/{la['module']}.lora_B.weight"
        assert list(params[peft_param(la, "lora_A")].shape) == [r, n_in]
        assert list(params[peft_param(la, "lora_B")].shape) == [n_out, r]
        want_layout = "in_out" if fixture_arch(fixture) == "gpt2" else "out_in"
        assert la["weight_layout"] == want_layout and la["fan_in_fan_out"] == (want_layout == "in_out")
        assert dims[la["weight"]] == ([n_in, n_out] if want_layout == "in_out" else [n_out, n_in])


def test_peft_init_seeded(trained, tmp_path):
    """A: nn.Linear's Kaiming-uniform (a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), B: zeros, from
    --seed: the same seed gives the same A, another seed another A."""
    t = trained("r64")  # 64 x 32 values per A
    assert t.lora["init"] == "peft" and t.lora["seed"] == 0
    for la in t.lora["layers"]:
        a, b = t.initial[la["lora_A"]], t.initial[la["lora_B"]]
        assert a.dtype == np.float32 and b.dtype == np.float32
        assert not b.any(), "B starts at zero"
        bound = 1.0 / math.sqrt(la["in_features"])
        assert np.abs(a).max() <= bound * (1 + 1e-6)
        std = float(a.std())
        assert abs(std - bound / math.sqrt(3)) <= 0.1 * bound / math.sqrt(3), (std, bound)
        assert abs(float(a.mean())) <= 0.1 * bound
    again = tmp_path / "again.step.onnx"
    other = tmp_path / "other.step.onnx"
    build_step(t.fixture, again, *_step_args("r64"), "--seed", "0")
    build_step(t.fixture, other, *_step_args("r64"), "--seed", "1")
    names = sorted(t.initial)
    same = _onnx_decode.read_initializers(again, names)
    diff = _onnx_decode.read_initializers(other, names)
    for n in names:
        np.testing.assert_array_equal(same[n], t.initial[n])
        if "lora_A" in n:
            assert not np.array_equal(diff[n], t.initial[n]), n
    a = [t.initial[la["lora_A"]] for la in t.lora["layers"]]
    assert not any(np.array_equal(a[0], x) for x in a[1:]), "every layer draws its own A"


# ---------------------------------------------------------------------------- fp16

U16 = 2.0 ** -11


def _dist(a: dict, b: dict, start: dict) -> float:
    num = sum(float(np.sum((a[k] - b[k]) ** 2)) for k in b)
    den = sum(float(np.sum((b[k] - start[k]) ** 2)) for k in b)
    return math.sqrt(num / den)


def _torch_fp16(case, lora, initial, data, amp: bool, skip=None):
    import torch_amp

    dtype = torch.float32 if amp else torch.float64
    pm, m, _, loss = peft_model(case, lora, initial, dtype)
    lora_params = [p for p in pm.parameters() if p.requires_grad]
    assert all(p.dtype == dtype for p in lora_params)
    opt = torch.optim.AdamW(lora_params, foreach=False, **ADAMW)
    gs = torch.amp.GradScaler("cpu") if amp else None
    losses, skipped = [], []
    for k, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        if amp:
            with torch_amp.cuda_float32_list(), torch.autocast("cpu", dtype=torch.float16):
                total = loss(m, x, y)
            before = gs.get_scale()
            gs.scale(total).backward()
            gs.step(opt)
            gs.update()
            skipped.append(gs.get_scale() < before)
        else:
            total = loss(m, x, y)
            total.backward()
            if not (skip and skip[k]):
                opt.step()
        losses.append(total.item())
    params = dict(pm.named_parameters())
    final = {la[part]: params[peft_param(la, part)].detach().double().numpy().copy()
             for la in lora["layers"] for part in ("lora_A", "lora_B")}
    return np.array(losses), final, skipped


@pytest.mark.parametrize("case", ["tiny", "gpt2_ts"])
def test_fp16_trains_like_peft_autocast(case, tmp_path):
    """float16 numerics in tract (real float16 kernels) against torch autocast (CUDA's float32
    list) + GradScaler + PEFT; tolerances of test_precision.py: losses within 2u of torch amp,
    the final A and B as close to the float64 run as torch amp's (1.5x), graph vs torch 2x."""
    from tract_step import TractStep

    fixture = CASES[case][0]
    path = tmp_path / "fp16.step.onnx"
    build_step(fixture, path, *_step_args(case), "--precision", "fp16")
    meta = step_meta(path)
    lora = meta["lora"]
    assert sorted(meta["parameters"]) == sorted(_lora.lora_names(lora))
    initial = _onnx_decode.read_initializers(path, sorted(_lora.lora_names(lora)))
    data = batches(fixture)
    r = TractStep(path, tmp_path)
    got, got_skip = [], []
    for x, y in data:
        out = r.step({"input_ids": x, "labels": y})
        got.append(float(np.ravel(out[r.outputs[0]])[0]))
        got_skip.append(bool(np.ravel(out["ntl/skipped"])[0]))
    got = np.array(got)
    got_p = {n: r.state[n].astype(np.float64) for n in initial}
    lam, pam, am_skip = _torch_fp16(case, lora, initial, data, amp=True)
    l64, p64, _ = _torch_fp16(case, lora, initial, data, amp=False, skip=am_skip)
    start = {n: v.astype(np.float64) for n, v in initial.items()}
    assert got_skip == am_skip, (got_skip, am_skip)
    loss_err = float(np.max(np.abs(got - lam) / np.abs(lam)))
    d_graph, d_torch, d_both = _dist(got_p, p64, start), _dist(pam, p64, start), _dist(got_p, pam, start)
    print(f"{case} fp16: losses vs torch amp {loss_err:.2e} (torch amp vs float64 "
          f"{np.max(np.abs(lam - l64) / np.abs(l64)):.2e}); A/B, fraction of the float64 update: "
          f"graph {d_graph:.3g}, torch amp {d_torch:.3g}, graph vs torch {d_both:.3g}")
    assert loss_err <= 2 * U16
    assert d_graph <= 1.5 * d_torch
    assert d_both <= 2 * d_torch


# ---------------------------------------------------------------------------- files

FILE_CASES = ["gpt2_dynamo", "llama_dynamo", "gpt2_ts", "tiny", "tiny_head", "llama_head"]


def _task_type(t) -> str | None:
    """CAUSAL_LM for the transformers models; None for the tiny LM, which PEFT's causal-LM
    wrapper cannot wrap (it has no prepare_inputs_for_generation)."""
    return None if t.fixture == "lm_flat" else "CAUSAL_LM"


def base_model(fixture: str):
    """(fresh float32 base model, its logits function, its own loss (CE) function)."""
    if fixture == "lm_flat":
        import ntl_torch
        import tiny_lm

        m = tiny_lm.build("flat", ntl_torch.load_weights())
        return m, m.logits, m
    import generate_step as gs

    m = gs.model_in(gs.build_model(fixture_arch(fixture)), torch.float32)
    return m, m.lm_logits, m


def _logits_name(model: onnx.ModelProto) -> str:
    """The LM head's output (the [B, T, V] logits) of an exported training graph."""
    consumers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    frontier = [i.name for i in model.graph.initializer if i.name in ("lm_head.weight", "head.weight")]
    while frontier:
        name = frontier.pop()
        for n in consumers.get(name, []):
            if n.op_type in ("MatMul", "Gemm"):
                out = n.output[0]
                after = consumers.get(out, [])
                if len(after) == 1 and after[0].op_type == "Add" and "head.bias" in after[0].input:
                    out = after[0].output[0]  # the tiny LM's head bias
                return out
            frontier += list(n.output)
    raise AssertionError("no LM head found")


def with_logits(fixture: str, out: Path) -> Path:
    """The fixture with its logits as a second output (for comparing logits)."""
    m = onnx.load(str(MODELS / f"{fixture}.onnx"))
    name = _logits_name(m)
    m.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    onnx.save(m, str(out))
    return out


def run_onnx(path: Path, x: np.ndarray, y: np.ndarray):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    loss, logits = sess.run(None, {"input_ids": x, "labels": y})
    return float(loss), logits


def _close(got, want, rtol=FILE_RTOL) -> float:
    err = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
    scale = float(np.max(np.abs(want)))
    assert err <= rtol * scale, f"max abs error {err:.3g} > {rtol} x {scale:.3g}"
    return err / scale


@pytest.fixture(scope="module")
def peft_saved(tmp_path_factory):
    """PEFT's own save_pretrained of each file case's reference model (after training)."""
    cache = {}

    def get(t: Trained) -> Path:
        if t.case not in cache:
            d = tmp_path_factory.mktemp(f"peft_{t.case}")
            t.peft.save_pretrained(str(d))
            cache[t.case] = d
        return cache[t.case]
    return get


@pytest.mark.parametrize("case", FILE_CASES)
def test_adapter_files_are_peft_files(case, trained, peft_saved, tmp_path):
    t = trained(case)
    out = tmp_path / "adapter"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every module path is known: no warning
        t.runner.save_adapter(out, base_model_name_or_path="ntl-patch/fixtures-" + fixture_arch(t.fixture),
                              task_type=_task_type(t))
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    ours = json.loads((out / "adapter_config.json").read_text())
    ref_dir = peft_saved(t)
    theirs = json.loads((ref_dir / "adapter_config.json").read_text())
    assert sorted(ours) == sorted(theirs), (set(ours) ^ set(theirs))
    assert sorted(ours.pop("target_modules")) == sorted(theirs.pop("target_modules"))
    assert ours.pop("base_model_name_or_path") == "ntl-patch/fixtures-" + fixture_arch(t.fixture)
    theirs.pop("base_model_name_or_path")
    if t.fixture == "lm_flat":  # PEFT records a custom model's class for AutoPeftModel; unknown here
        assert theirs.pop("auto_mapping") == {"base_model_class": "TinyLM", "parent_library": "tiny_lm"}
        assert ours.pop("auto_mapping") is None
    assert ours == theirs, {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
    tensors, meta = _safetensors.load(out / "adapter_model.safetensors")
    ref_tensors, ref_meta = _safetensors.load(ref_dir / "adapter_model.safetensors")
    assert meta == ref_meta == {"format": "pt"}
    assert sorted(tensors) == sorted(ref_tensors)
    for k, v in tensors.items():
        assert v.dtype == ref_tensors[k].dtype and v.shape == ref_tensors[k].shape, k
    for name, pname in peft_names(t.lora, t.params).items():
        key = pname.replace(".default.", ".").replace(".modules_to_save.", ".")
        np.testing.assert_array_equal(tensors[key], t.params[name])
    assert ours["modules_to_save"] == (TRAIN[case][1] if case in TRAIN else None)


@pytest.mark.parametrize("case", FILE_CASES)
def test_from_pretrained_and_merged_model(case, trained, tmp_path):
    """save_adapter -> PeftModel.from_pretrained(base) gives the merged ONNX model's logits and
    loss (save_inference_model: W + s·B·A folded in); merge_and_unload() gives the same logits
    and the same weights."""
    t = trained(case)
    out = tmp_path / "adapter"
    t.runner.save_adapter(out, task_type=_task_type(t))
    original = with_logits(t.fixture, tmp_path / "original.onnx")
    merged = tmp_path / "merged.onnx"
    t.runner.save_inference_model(original, merged)
    x, y = t.data[0]

    base, base_logits, base_loss = base_model(t.fixture)
    loaded = peft.PeftModel.from_pretrained(base, str(out))
    params = dict(loaded.named_parameters())
    for name, pname in peft_names(t.lora, t.params).items():
        np.testing.assert_array_equal(params[pname].detach().numpy(), t.params[name])
    with torch.no_grad():
        want_logits = base_logits(torch.from_numpy(x)).numpy()
        want_loss = base_loss(torch.from_numpy(x), torch.from_numpy(y)).item()
    loss, logits = run_onnx(merged, x, y)
    e1 = _close(logits, want_logits)
    assert abs(loss - want_loss) <= FILE_RTOL * abs(want_loss), (loss, want_loss)

    unloaded = loaded.merge_and_unload()
    assert unloaded is base  # the LoRA layers replaced by merged ones, in place
    with torch.no_grad():
        m_logits = base_logits(torch.from_numpy(x)).numpy()
        m_loss = base_loss(torch.from_numpy(x), torch.from_numpy(y)).item()
    e2 = _close(logits, m_logits)
    assert abs(loss - m_loss) <= FILE_RTOL * abs(m_loss), (loss, m_loss)
    weights = {k: v.detach().numpy() for k, v in unloaded.state_dict().items()}
    inits = _onnx_decode.read_initializers(merged, [la["weight"] for la in t.lora["layers"]])
    before = _onnx_decode.read_initializers(original, [la["weight"] for la in t.lora["layers"]])
    for la in t.lora["layers"]:
        w = weights[la["module"] + ".weight"]
        assert not np.array_equal(inits[la["weight"]], before[la["weight"]]), "the update is folded in"
        _close(inits[la["weight"]], w, 1e-6)
    # the --train parameters trained, everything else the original's
    trained_extra = [n for n in t.params if n not in _lora.lora_names(t.lora)]
    got = _onnx_decode.read_initializers(merged, trained_extra)
    assert all(np.array_equal(got[n], t.params[n]) for n in trained_extra)
    rest = [i.name for i in onnx.load(str(original)).graph.initializer
            if i.name not in {la["weight"] for la in t.lora["layers"]} | set(trained_extra)]
    a, b = _onnx_decode.read_initializers(original, rest), _onnx_decode.read_initializers(merged, rest)
    assert all(np.array_equal(a[n], b[n]) for n in rest)
    print(f"{case}: merged ONNX vs PEFT from_pretrained logits {e1:.2e}, vs merge_and_unload {e2:.2e}")


@pytest.mark.parametrize("elem", ["float16", "bfloat16"])
def test_half_export_merges_in_its_type(elem, tmp_path):
    """A float16/bfloat16 export (the tiny LM): the frozen base stays in its type in the step
    graph, and the merged model holds W + s·B·A computed in float32 from the half W, rounded to
    the half type (as torch's .to(dtype)); every other initializer is the export's, byte for byte."""
    from precision_helpers import as_f32, half_export

    dtype = torch.float16 if elem == "float16" else torch.bfloat16
    src = tmp_path / "half.onnx"
    half_export(src, dtype)
    path = tmp_path / "half.step.onnx"
    build_step_from(src, path, "--precision", "fp32", "--lora-r", "4", "--lora-targets", "q,v")
    meta = step_meta(path)
    lora = meta["lora"]
    weights = [la["weight"] for la in lora["layers"]]
    step_inits = {t.name: t for t in onnx.load(str(path)).graph.initializer}
    code = onnx.TensorProto.FLOAT16 if elem == "float16" else onnx.TensorProto.BFLOAT16
    assert all(step_inits[w].data_type == code for w in weights), "the frozen base keeps its type"
    runner = StepRunner(path, providers=["CPUExecutionProvider"])
    for x, y in batches("lm_flat", 2):
        runner.step({"input_ids": x, "labels": y})
    params = runner.parameters()
    merged = runner.save_inference_model(src, tmp_path / "merged.onnx")
    before = {t.name: t for t in onnx.load(str(src)).graph.initializer}
    after = {t.name: t for t in onnx.load(str(merged)).graph.initializer}
    s = np.float32(lora["scaling"])
    for la in lora["layers"]:
        w = la["weight"]
        assert after[w].data_type == code
        delta = (params[la["lora_B"]] @ params[la["lora_A"]]) * s
        want = torch.from_numpy(as_f32(before[w]) + delta).to(dtype).float().numpy()
        np.testing.assert_array_equal(as_f32(after[w]), want)
        assert not np.array_equal(as_f32(after[w]), as_f32(before[w])), w
    for name, t in before.items():
        if name not in weights:
            assert after[name].SerializeToString() == t.SerializeToString(), name


def test_trained_adapted_weight_is_merged_not_saved(tmp_path):
    """--train of an adapted layer's own weight: PEFT cannot hold it (a module is a LoRA target
    or saved whole), so save_adapter leaves it out with a one-line warning naming it, and keeps
    the other trained parameter (head.bias, as modules_to_save ["head"]); the merged model holds
    the trained weight plus s·B·A."""
    path = tmp_path / "t.step.onnx"
    build_step("lm_flat", path, "--lora-r", "4", "--lora-targets", "q,v", "--train", "q.weight",
               "--train", "head.bias")
    meta = step_meta(path)
    lora = meta["lora"]
    assert sorted(meta["parameters"]) == sorted(_lora.lora_names(lora) | {"q.weight", "head.bias"})
    runner = StepRunner(path, providers=["CPUExecutionProvider"])
    for x, y in batches("lm_flat", 3):
        runner.step({"input_ids": x, "labels": y})
    params = runner.parameters()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.save_adapter(tmp_path / "adapter", task_type=None)
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and "'q.weight'" in msgs[0] and "\n" not in msgs[0], msgs
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["head"]
    tensors, _ = _safetensors.load(tmp_path / "adapter" / "adapter_model.safetensors")
    assert sorted(tensors) == sorted([f"base_model.model.{m}.{p}.weight" for m in ("q", "v") for p in ("lora_A", "lora_B")]
                                     + ["base_model.model.head.bias"])
    np.testing.assert_array_equal(tensors["base_model.model.head.bias"], params["head.bias"])
    merged = runner.save_inference_model(MODELS / "lm_flat.onnx", tmp_path / "merged.onnx")
    got = _onnx_decode.read_initializers(merged, ["q.weight", "head.bias", "v.weight"])
    orig = _onnx_decode.read_initializers(MODELS / "lm_flat.onnx", ["q.weight", "v.weight"])
    layers = {la["weight"]: la for la in lora["layers"]}
    s = np.float32(lora["scaling"])
    delta = {w: (params[la["lora_B"]] @ params[la["lora_A"]]) * s for w, la in layers.items()}
    assert not np.array_equal(params["q.weight"], orig["q.weight"])
    np.testing.assert_array_equal(got["q.weight"], params["q.weight"] + delta["q.weight"])
    np.testing.assert_array_equal(got["v.weight"], orig["v.weight"] + delta["v.weight"])
    np.testing.assert_array_equal(got["head.bias"], params["head.bias"])


def test_refuses_graph_without_lora(tmp_path):
    path = tmp_path / "plain.step.onnx"
    build_step("lm_flat", path)
    r = StepRunner(path, providers=["CPUExecutionProvider"])
    for call in (lambda: r.save_adapter(tmp_path / "a"), lambda: r.save_onnx_adapter(tmp_path / "a.onnx_adapter")):
        with pytest.raises(ValueError) as e:
            call()
        assert "not a LoRA step graph" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "a").exists() and not (tmp_path / "a.onnx_adapter").exists()


def test_python_step_wrapper_takes_lora_options(tmp_path, monkeypatch):
    import ntl_patch

    monkeypatch.setenv("NTL_PATCH_BIN", patch_command()[0])
    out = tmp_path / "w.step.onnx"
    s = ntl_patch.step(MODELS / "llama_dynamo.onnx", out=out, tokenizer=TOKENIZER, lora_r=2,
                       lora_alpha=4, lora_targets=["q_proj", "o_proj"], use_rslora=True, seed=3)
    assert s is not None
    lora = step_meta(out)["lora"]
    assert (lora["r"], lora["lora_alpha"], lora["use_rslora"], lora["seed"]) == (2, 4.0, True, 3)
    assert sorted(lora["target_modules"]) == ["o_proj", "q_proj"]
    assert math.isclose(lora["scaling"], 4 / math.sqrt(2), rel_tol=1e-7)


# ---------------------------------------------------------------------------- lost module paths


def _anonymous_weights(out: Path, renamed: dict[str, tuple[str, str | None]]) -> Path:
    """llama_dynamo with weights stored as TorchScript does when it pre-transposes them: an
    anonymous `onnx::MatMul_*` initializer [in, out] read by the MatMul directly (the Transpose
    removed). renamed: weight -> (new name, the MatMul's TorchScript scope name or None)."""
    m = onnx.load(str(MODELS / "llama_dynamo.onnx"))
    g = m.graph
    inits = {i.name: i for i in g.initializer}
    drop = []
    for name, (new, scope) in renamed.items():
        t = inits[name]
        w = onnx.numpy_helper.to_array(t)
        t.CopyFrom(onnx.numpy_helper.from_array(np.ascontiguousarray(w.T), new))
        for n in g.node:
            if n.op_type == "Transpose" and list(n.input) == [name]:
                drop.append(n)
                for c in g.node:
                    for j, i in enumerate(c.input):
                        if i == n.output[0]:
                            c.input[j] = new
                            assert c.op_type == "MatMul", c.op_type
                            if scope:
                                c.name = scope
    for n in drop:
        g.node.remove(n)
    onnx.save(m, str(out))
    return out


def test_lost_module_path_saved_under_onnx_name(tmp_path):
    """Pre-transposed anonymous weights ([in, out], `onnx::MatMul_*`): with TorchScript's node
    scope the module path is recovered (layer 0's q_proj); without (layer 1's, targeted by its
    ONNX name) the layer's adapter keys use the ONNX name and save_adapter warns once, in one
    line. The merged model folds the update in transposed, as PEFT's merge of the same A and B."""
    renamed = {"model.layers.0.self_attn.q_proj.weight": ("onnx::MatMul_901", "/model/layers.0/self_attn/q_proj/MatMul"),
               "model.layers.1.self_attn.q_proj.weight": ("onnx::MatMul_902", None)}
    src = _anonymous_weights(tmp_path / "anon.onnx", renamed)
    path = tmp_path / "anon.step.onnx"
    r = run_patch(["step", src, "--loss", "wasserstein", "--tokenizer", TOKENIZER, "--weight", str(WEIGHT),
                   "-o", path, "--json", "--lora-r", "4", "--lora-targets", "q_proj,onnx::MatMul_902"])
    assert r.returncode == 0, r.stderr
    lora = step_meta(path)["lora"]
    by_weight = {la["weight"]: la for la in lora["layers"]}
    assert sorted(by_weight) == ["onnx::MatMul_901", "onnx::MatMul_902"], sorted(by_weight)
    assert by_weight["onnx::MatMul_901"]["module"] == "model.layers.0.self_attn.q_proj"
    assert by_weight["onnx::MatMul_902"]["module"] is None
    for la in lora["layers"]:
        assert la["weight_layout"] == "in_out" and la["fan_in_fan_out"] is False
        assert (la["in_features"], la["out_features"]) == (32, 32)
    runner = StepRunner(path, providers=["CPUExecutionProvider"])
    for x, y in batches("llama_dynamo", 3):
        runner.step({"input_ids": x, "labels": y})
    params = runner.parameters()
    out = tmp_path / "adapter"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.save_adapter(out)
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and "\n" not in msgs[0] and "PEFT cannot map" in msgs[0], msgs
    assert "'onnx::MatMul_902'" in msgs[0] and "901" not in msgs[0], msgs[0]
    tensors, _ = _safetensors.load(out / "adapter_model.safetensors")
    lost, kept = by_weight["onnx::MatMul_902"], by_weight["onnx::MatMul_901"]
    assert sorted(tensors) == sorted(f"base_model.model.{m}.{p}.weight" for m in
                                     ("onnx::MatMul_902", "model.layers.0.self_attn.q_proj") for p in ("lora_A", "lora_B"))
    for la, m in ((lost, "onnx::MatMul_902"), (kept, "model.layers.0.self_attn.q_proj")):
        for part in ("lora_A", "lora_B"):
            np.testing.assert_array_equal(tensors[f"base_model.model.{m}.{part}.weight"], params[la[part]])
    merged = tmp_path / "merged.onnx"
    runner.save_inference_model(src, merged)
    got = _onnx_decode.read_initializers(merged, [v for v, _ in renamed.values()])
    import generate_step as gs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(gs.build_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    pparams = dict(pm.named_parameters())
    with torch.no_grad():
        for name, (new, _) in renamed.items():
            la = by_weight[new]
            for part in ("lora_A", "lora_B"):
                module = name.removesuffix(".weight")
                pparams[f"base_model.model.{module}.{part}.default.weight"].copy_(torch.from_numpy(params[la[part]]))
    sd = pm.merge_and_unload().state_dict()
    for name, (new, _) in renamed.items():
        assert got[new].shape == (32, 32)
        _close(got[new], sd[name].numpy().T, 1e-6)


# ---------------------------------------------------------------------------- onnxruntime adapters


def _adapter_model(lora: dict, out: Path) -> Path:
    """A model taking every A and B as inputs (with zero defaults, as onnxruntime's adapter
    models have them: overridable initializers): y_i = x_i · A_iᵀ · B_iᵀ per layer."""
    from onnx import TensorProto as T, helper as h

    nodes, inputs, outputs, inits = [], [], [], []
    for k, la in enumerate(lora["layers"]):
        r, n_in, n_out = lora["r"], la["in_features"], la["out_features"]
        inputs += [h.make_tensor_value_info(f"x{k}", T.FLOAT, ["n", n_in]),
                   h.make_tensor_value_info(la["lora_A"], T.FLOAT, [r, n_in]),
                   h.make_tensor_value_info(la["lora_B"], T.FLOAT, [n_out, r])]
        inits += [onnx.numpy_helper.from_array(np.zeros((r, n_in), np.float32), la["lora_A"]),
                  onnx.numpy_helper.from_array(np.zeros((n_out, r), np.float32), la["lora_B"])]
        nodes += [h.make_node("Gemm", [f"x{k}", la["lora_A"]], [f"h{k}"], transB=1),
                  h.make_node("Gemm", [f"h{k}", la["lora_B"]], [f"y{k}"], transB=1)]
        outputs.append(h.make_tensor_value_info(f"y{k}", T.FLOAT, ["n", n_out]))
    g = h.make_graph(nodes, "lora_inputs", inputs, outputs, initializer=inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    onnx.save(m, str(out))
    return out


def test_onnx_adapter_in_onnxruntime_1_31(trained, tmp_path):
    """save_onnx_adapter in onnxruntime 1.31.1 (.venv-rt): the file reads back with
    AdapterFormat.read_adapter (the A and B values, by name), loads as LoraAdapter and runs a
    model with those inputs through RunOptions.add_active_adapter. In .venv's onnxruntime 1.19
    (no adapter API) the call is a one-line RuntimeError."""
    import onnxruntime as ort

    t = trained("llama_ts")
    if not _lora.has_onnx_adapter_api():
        with pytest.raises(RuntimeError) as e:
            t.runner.save_onnx_adapter(tmp_path / "x.onnx_adapter")
        assert ort.__version__ in str(e.value) and "\n" not in str(e.value)
        assert not (tmp_path / "x.onnx_adapter").exists()
    rt = subprocess.run([str(REPO / "scripts" / "setup" / "setup-runtime.sh")], capture_output=True, text=True)
    assert rt.returncode == 0, rt.stderr
    model = _adapter_model(t.lora, tmp_path / "inputs.onnx")
    xs = {f"x{k}": np.random.default_rng(k).standard_normal((3, la["in_features"])).astype(np.float32)
          for k, la in enumerate(t.lora["layers"])}
    np.savez(tmp_path / "xs.npz", **xs)
    code = f"""
import sys, json, numpy as np, onnxruntime as ort
sys.path.insert(0, {str(REPO / 'python')!r})
from ntl_patch import StepRunner
z = np.load({str(tmp_path / 'xs.npz')!r})
r = StepRunner({str(t.path)!r}, providers=["CPUExecutionProvider"])
x, y = np.load({str(tmp_path / 'batch.npz')!r}).values()
r.step({{"input_ids": x, "labels": y}})
params = r.parameters()
path = r.save_onnx_adapter({str(tmp_path / 'lora.onnx_adapter')!r})
read = ort.AdapterFormat.read_adapter(str(path))
got = {{k: v.numpy() for k, v in read.get_parameters().items()}}
assert sorted(got) == sorted(params), (sorted(got), sorted(params))
assert all(np.array_equal(got[k], params[k]) for k in params)
assert read.get_adapter_version() == 1 and read.get_model_version() == 1
adapter = ort.LoraAdapter()
adapter.Load(str(path))
ro = ort.RunOptions()
ro.add_active_adapter(adapter)
sess = ort.InferenceSession({str(model)!r}, providers=["CPUExecutionProvider"])
outs = sess.run(None, dict(z), ro)
assert not any(o.any() for o in sess.run(None, dict(z))), "without the adapter: the zero defaults"
np.savez({str(tmp_path / 'out.npz')!r}, **{{f"y{{k}}": o for k, o in enumerate(outs)}},
         **{{k.replace("/", "|"): v for k, v in params.items()}})
"""
    x, y = t.data[0]
    np.savez(tmp_path / "batch.npz", x=x, y=y)
    res = subprocess.run([str(REPO / ".venv-rt" / "bin" / "python"), "-c", code], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    z = np.load(tmp_path / "out.npz")
    for k, la in enumerate(t.lora["layers"]):
        a, b = z[la["lora_A"].replace("/", "|")], z[la["lora_B"].replace("/", "|")]
        assert b.any(), "trained B"
        want = xs[f"x{k}"].astype(np.float64) @ a.T.astype(np.float64) @ b.T.astype(np.float64)
        _close(z[f"y{k}"], want, 1e-5)


# ---------------------------------------------------------------------------- DataParallel


def test_data_parallel_saves_the_same_adapter(trained, tmp_path):
    """--split LoRA graphs in DataParallel (one process): the same training as StepRunner's,
    and the same adapter files."""
    from ntl_patch import DataParallel

    t = trained("tiny")
    grad = tmp_path / "tiny.grad.onnx"
    build_step(t.fixture, grad, *_step_args("tiny"), "--split")
    dp = DataParallel(grad, providers=["CPUExecutionProvider"])
    losses = [dp.step({"input_ids": x, "labels": y})[0] for x, y in t.data]
    np.testing.assert_allclose(losses, t.losses, rtol=1e-6)
    a, b = tmp_path / "dp", tmp_path / "runner"
    dp.save_adapter(a)
    t.runner.save_adapter(b)
    assert (a / "adapter_config.json").read_text() == (b / "adapter_config.json").read_text()
    ta, _ = _safetensors.load(a / "adapter_model.safetensors")
    tb, _ = _safetensors.load(b / "adapter_model.safetensors")
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert norm_rel(ta[k], tb[k].astype(np.float64), 1e-6) <= 1e-6, k


@pytest.mark.parametrize("shard", ["none", "optimizer", "gradients"])
def test_data_parallel_two_ranks_train_only_the_adapters(shard, tmp_path):
    """Two gloo ranks (torchrun) on the tiny LM's LoRA --split graphs: the all-reduced gradient
    buffer holds A and B only; 5 steps equal torch + PEFT (float64) on the mean of the two
    shards' losses (DDP's mean of per-rank means); rank 0 writes the adapter. Also with the
    adapters' optimizer state (ZeRO-1), and their gradients too (ZeRO-2), sharded over the
    ranks."""
    import os

    case = "tiny"
    grad = tmp_path / "lm.grad.onnx"
    build_step("lm_flat", grad, *_step_args(case), "--split")
    meta = step_meta(grad)
    lora = meta["lora"]
    assert sorted(meta["parameters"]) == sorted(_lora.lora_names(lora))
    steps, data = 5, batches("lm_flat", 10)
    z = {"steps": np.array(steps)}
    for k, (x, y) in enumerate(data):
        z[f"x/{k // 2}/{k % 2}"], z[f"y/{k // 2}/{k % 2}"] = x, y
    np.savez(tmp_path / "batches.npz", **z)
    torchrun = Path(sys.executable).parent / "torchrun"
    p = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2",
                        str(Path(__file__).parent / "dp_lora_worker.py"), str(grad),
                        str(tmp_path / "batches.npz"), str(tmp_path), shard],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, f"torchrun exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    res = np.load(tmp_path / "result.npz")
    params = {k[len("param/"):].replace("|", "/"): res[k] for k in res.files if k.startswith("param/")}
    initial = _onnx_decode.read_initializers(grad, meta["parameters"])
    assert int(res["numel"]) == sum(v.size for v in initial.values()), "only A and B are all-reduced"

    pm, m, _, loss = peft_model(case, lora, initial, torch.float64)
    opt = torch.optim.AdamW([q for q in pm.parameters() if q.requires_grad], foreach=False, **ADAMW)
    want_losses = []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        total = sum(loss(m, torch.from_numpy(z[f"x/{s}/{r}"]), torch.from_numpy(z[f"y/{s}/{r}"]))
                    for r in range(2)) / 2
        total.backward()
        opt.step()
        want_losses.append(total.item())
    np.testing.assert_allclose(res["losses"][:, 0], want_losses, rtol=LOSS_RTOL)
    named = dict(pm.named_parameters())
    for name, pname in peft_names(lora, initial).items():
        assert norm_rel(params[name], named[pname].detach().numpy()) <= PARAM_RTOL, name
    tensors, _ = _safetensors.load(tmp_path / "adapter" / "adapter_model.safetensors")
    for la in lora["layers"]:
        for part in ("lora_A", "lora_B"):
            np.testing.assert_array_equal(tensors[f"base_model.model.{la['module']}.{part}.weight"], params[la[part]])
    assert sorted(q.name for q in tmp_path.iterdir() if q.name.startswith(".")) == [], "no temporaries left"


def test_served_model_runs_the_adapter_in_onnxruntime_1_31(trained, tmp_path):
    """`save_onnx_adapter(..., original_model=, out_model=)` (`ntl-patch lora-model`): the export
    with the step graph's A and B as inputs. In onnxruntime 1.31.1 (.venv-rt), with the trained
    adapter active it gives the merged model's loss (save_inference_model); without one, the
    original export's (B's default is zero)."""
    import os

    t = trained("llama_ts")
    rt = subprocess.run([str(REPO / "scripts" / "setup" / "setup-runtime.sh")], capture_output=True, text=True)
    assert rt.returncode == 0, rt.stderr
    original = MODELS / f"{t.fixture}.onnx"
    x, y = t.data[0]
    np.savez(tmp_path / "batch.npz", x=x, y=y)
    code = f"""
import sys, numpy as np, onnxruntime as ort
sys.path.insert(0, {str(REPO / 'python')!r})
from ntl_patch import StepRunner
x, y = np.load({str(tmp_path / 'batch.npz')!r}).values()
r = StepRunner({str(t.path)!r}, providers=["CPUExecutionProvider"])
for _ in range(3):
    r.step({{"input_ids": x, "labels": y}})
r.save_onnx_adapter({str(tmp_path / 'a.onnx_adapter')!r}, original_model={str(original)!r},
                    out_model={str(tmp_path / 'served.onnx')!r})
r.save_inference_model({str(original)!r}, {str(tmp_path / 'merged.onnx')!r})
so = ort.SessionOptions(); so.log_severity_level = 3
run = lambda p, ro=None: float(ort.InferenceSession(p, so, providers=["CPUExecutionProvider"]).run(
    None, {{"input_ids": x, "labels": y}}, ro)[0])
adapter = ort.LoraAdapter(); adapter.Load({str(tmp_path / 'a.onnx_adapter')!r})
ro = ort.RunOptions(); ro.add_active_adapter(adapter)
served, merged = run({str(tmp_path / 'served.onnx')!r}, ro), run({str(tmp_path / 'merged.onnx')!r})
base, plain = run({str(tmp_path / 'served.onnx')!r}), run({str(original)!r})
print(served, merged, base, plain)
assert abs(served - merged) <= 1e-5 * abs(merged), (served, merged)
assert abs(base - plain) <= 1e-6 * abs(plain), (base, plain)
assert abs(served - plain) > 1e-4 * abs(plain), "the adapter changed the loss"
"""
    env = dict(os.environ, NTL_PATCH_BIN=patch_command()[0])
    res = subprocess.run([str(REPO / ".venv-rt" / "bin" / "python"), "-c", code], capture_output=True,
                         text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    names = {i.name for i in onnx.load(str(tmp_path / "served.onnx")).graph.input}
    assert {n for la in t.lora["layers"] for n in (la["lora_A"], la["lora_B"])} <= names


def test_lora_model_refusals(trained, tmp_path):
    t = trained("llama_ts")
    for model, step, needle in [
        (MODELS / "llama_ts.onnx", MODELS / "llama_ts.onnx", "is not a step graph"),
        (t.path, t.path, "is a step graph"),
        (MODELS / "gpt2_ts.onnx", t.path, "has no layer for the step graph's adapter"),
    ]:
        r = run_patch(["lora-model", model, "--step", step, "-o", tmp_path / "out.onnx"])
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr
        assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("fixture", ["llama_dynamo", "gpt2_ts"])
def test_fused_head_gives_the_dense_heads_gradients(fixture, tmp_path):
    """A LoRA step graph with the fused LM head (chunks of 3 positions) computes the dense
    graph's losses and A/B gradients (the `--split` gradient graphs, B made non-zero)."""
    import onnxruntime as ort

    outs = {}
    for head, flags in {"dense": ["--fused-head", "off"],
                        "fused": ["--fused-head", "on", "--head-chunk-tokens", "3"]}.items():
        out = tmp_path / f"{head}.grad.onnx"
        r = run_patch(["step", MODELS / f"{fixture}.onnx", "--tokenizer", TOKENIZER, "--lora-r", "2",
                       "--split", "-o", out, "--json", *flags])
        assert r.returncode == 0, r.stderr
        params = json.loads(r.stdout)["parameters"]
        init = _onnx_decode.read_initializers(out, params)
        rng = np.random.default_rng(3)
        feeds = {p: (rng.normal(size=v.shape).astype(np.float32) * 0.1 if "lora_B" in p else v)
                 for p, v in init.items()}
        x, y = batches(fixture)[0]
        so = ort.SessionOptions()
        so.log_severity_level = 3
        res = ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"]).run(
            None, {"input_ids": x, "labels": y, **feeds})
        outs[head] = (res[:3], dict(zip(params, res[3:])))
    (dl, dg), (fl, fg) = outs["dense"], outs["fused"]
    np.testing.assert_allclose(fl, dl, rtol=1e-5)
    assert fg.keys() == dg.keys()
    for p in dg:
        err = np.linalg.norm(fg[p] - dg[p]) / max(np.linalg.norm(dg[p]), 1e-12)
        assert err <= 1e-5, (p, err)

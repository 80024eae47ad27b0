"""The LoRA harness of test_lora.py, shared with test_qlora.py and test_qlora_int.py: the cases
(fixture, r, lora_alpha, targets, rsLoRA) and their tolerances, `ntl-patch step` with the
wasserstein loss at weight 0.3, the step metadata, the training batches, and the reference:
the fixture's torch model wrapped by PEFT 0.21.2 with the step graph's initial A and B, trained
by torch.optim.AdamW with the step graph's defaults (test_lora.py's docstring has the details).
test_qlora*.py replace `torch_model` and add a case with monkeypatch, so `peft_model` looks both
up here at call time.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

from conftest import MODELS, REPO, TOKENIZER, run_patch
import precision_helpers
from precision_helpers import torch_model  # peft_model reads it here (tests replace it here)

sys.path.insert(0, str(REPO / "python"))
from ntl_patch import StepRunner, _lora, _onnx_decode  # noqa: E402

import peft  # noqa: E402  (tests/python/requirements.txt pins peft 0.21.2)

WEIGHT = 0.3
STEPS = 10
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-4
PEFT_DEFAULT_TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}
LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# case -> (fixture, r, lora_alpha (None: PEFT's 8), targets (None: the architecture default), rslora)
CASES = {
    "tiny": ("lm_flat", 4, None, ["q", "v", "fc1"], False),
    "gpt2_ts": ("gpt2_ts", 4, None, None, False),
    "gpt2_dynamo": ("gpt2_dynamo", 4, 16.0, ["c_attn", "c_proj", "c_fc"], False),
    "llama_ts": ("llama_ts", 4, None, None, False),
    "llama_dynamo": ("llama_dynamo", 8, None, LLAMA_ALL, False),
    "r1": ("llama_dynamo", 1, None, None, False),
    "r64": ("gpt2_dynamo", 64, 32.0, None, False),
    "rslora": ("llama_ts", 16, 8.0, None, True),
    "tiny_head": ("lm_flat", 4, None, ["q", "v"], False),
    "llama_head": ("llama_dynamo", 4, None, None, False),
}
# `--train` prefixes of a case, and the modules PEFT trains whole for them (modules_to_save)
TRAIN = {"tiny_head": (["head."], ["head"]), "llama_head": (["lm_head."], ["lm_head"])}


def fixture_arch(fixture: str) -> str:
    return "tiny" if fixture == "lm_flat" else fixture.split("_")[0]


def build_step(fixture: str, out: Path, *extra) -> dict:
    args = [MODELS / f"{fixture}.onnx", "--loss", "wasserstein", "--tokenizer", TOKENIZER,
            "--weight", str(WEIGHT), "-o", out, "--json", *extra]
    r = run_patch(["step", *args])
    assert r.returncode == 0, f"ntl-patch step exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout)


def build_step_from(src: Path, out: Path, *extra) -> dict:
    r = run_patch(["step", src, "--loss", "wasserstein", "--tokenizer", TOKENIZER, "--weight", str(WEIGHT),
                   "-o", out, "--json", *extra])
    assert r.returncode == 0, f"ntl-patch step exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout)


def step_meta(path: Path) -> dict:
    return json.loads(_onnx_decode.read_metadata(path)["ntl_step"])


# ---------------------------------------------------------------------------- torch + PEFT


def batches(fixture: str, n: int = STEPS):
    return precision_helpers.batches(fixture, n)


def peft_config(case: str):
    fixture, r, alpha, targets, rslora = CASES[case]
    arch = fixture_arch(fixture)
    kw = dict(r=r, target_modules=list(targets or PEFT_DEFAULT_TARGETS[arch]), use_rslora=rslora,
              fan_in_fan_out=arch == "gpt2", lora_dropout=0.0, bias="none")
    if alpha is not None:
        kw["lora_alpha"] = alpha
    if case in TRAIN:
        kw["modules_to_save"] = TRAIN[case][1]
    if arch != "tiny":
        kw["task_type"] = "CAUSAL_LM"
    return peft.LoraConfig(**kw)


def peft_param(layer: dict, part: str) -> str:
    return f"base_model.model.{layer['module']}.{part}.default.weight"


def peft_names(lora: dict, parameters) -> dict[str, str]:
    """step-graph parameter -> PEFT parameter: A and B, and the --train parameters as PEFT's
    trained copies of their modules (modules_to_save)."""
    out = {la[part]: peft_param(la, part) for la in lora["layers"] for part in ("lora_A", "lora_B")}
    for name in parameters:
        if name not in out:
            module, _, leaf = name.rpartition(".")
            out[name] = f"base_model.model.{module}.modules_to_save.default.{leaf}"
    return out


def peft_model(case: str, lora: dict, initial: dict, dtype=torch.float32):
    """The PEFT-wrapped fixture with the step graph's initial A and B (initial: every trained
    parameter of the step graph, by name)."""
    m, logits, loss = torch_model(CASES[case][0], dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fan_in_fan_out / Conv1D notices
        pm = peft.get_peft_model(m, peft_config(case))
    params = dict(pm.named_parameters())
    trainable = {k for k, p in params.items() if p.requires_grad}
    names = peft_names(lora, initial)
    want = set(names.values())
    assert trainable == want, f"PEFT trains {sorted(trainable - want)[:4]}, the step graph {sorted(want - trainable)[:4]}"
    with torch.no_grad():
        for name, pname in names.items():
            p = params[pname]
            v = torch.from_numpy(initial[name])
            assert tuple(p.shape) == tuple(v.shape), (name, p.shape, v.shape)
            if name not in _lora.lora_names(lora):  # PEFT's copy of a --train module: the base's
                np.testing.assert_array_equal(p.detach().to(v.dtype).numpy(), v.numpy())
            p.data = v.to(dtype).clone()
    return pm, m, logits, loss


def torch_train(case: str, lora: dict, initial: dict, data, dtype=torch.float32):
    pm, m, _, loss = peft_model(case, lora, initial, dtype)
    lora_params = [p for p in pm.parameters() if p.requires_grad]
    assert all(p.dtype == dtype for p in lora_params)
    opt = torch.optim.AdamW(lora_params, foreach=False, **ADAMW)
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        total = loss(m, torch.from_numpy(x), torch.from_numpy(y))
        total.backward()
        opt.step()
        losses.append(total.item())
    params = dict(pm.named_parameters())
    final = {n: params[pn].detach().double().numpy().copy() for n, pn in peft_names(lora, initial).items()}
    return np.array(losses), final, pm


def norm_rel(got, want, floor=0.0) -> float:
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), floor, 1e-30))


QLORA_LORA_CASE = {"lm_flat": "tiny", "gpt2_ts": "gpt2_ts", "gpt2_dynamo": "gpt2_ts",
                   "llama_ts": "llama_ts", "llama_dynamo": "llama_ts"}


def assert_trains_like_peft(fixture: str, path: Path, monkeypatch, label: str = "") -> None:
    """10 AdamW steps of the (quantised-base) step graph at `path` equal torch + PEFT (float64)
    from the same initial A, on the reference model `torch_model` is set to (the tests set it to
    the model with the graph's quantised weights): losses within LOSS_RTOL, A and B within
    PARAM_RTOL norm-relative."""
    meta = step_meta(path)
    lora = meta["lora"]
    initial = _onnx_decode.read_initializers(path, meta["parameters"])
    data = batches(fixture)
    runner = StepRunner(path, providers=["CPUExecutionProvider"])
    losses = np.array([runner.step({"input_ids": x, "labels": y})[0] for x, y in data])
    params = runner.parameters()
    monkeypatch.setitem(CASES, "qlora", (fixture, 4, None, CASES[QLORA_LORA_CASE[fixture]][3], False))
    want_losses, want_params, _ = torch_train("qlora", lora, initial, data, torch.float64)
    loss_err = float(np.max(np.abs(losses - want_losses) / np.abs(want_losses)))
    errs = {n: norm_rel(params[n], want_params[n]) for n in params}
    worst = max(errs, key=errs.get)
    print(f"{fixture} {label}: worst loss rel {loss_err:.2e}, worst A/B norm-rel {errs[worst]:.2e} ({worst})")
    assert loss_err <= LOSS_RTOL, (losses, want_losses)
    assert errs[worst] <= PARAM_RTOL, f"{worst}: {errs[worst]:.3g}"
    assert losses[-1] != losses[0]

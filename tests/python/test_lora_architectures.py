"""LoRA on Hugging Face architectures beyond GPT-2 and Llama, from both torch exporters:
Qwen2, Qwen3, Mistral, Phi-3, Gemma, Gemma 3, GPT-NeoX, GPT-J, OPT, BLOOM and BERT (the small
random configs of test_architectures.py, in hf_architectures.py, exported at test time with
their own loss).

`ntl-patch step --lora-r 2` with no `--lora-targets` must choose PEFT's default targets for the
architecture and the module paths PEFT knows (so the adapter files map), and compute PEFT's
model: with the step graph's initial A and a random non-zero B loaded into `get_peft_model`
(float64), the `--split` gradient graph's losses and A/B gradients equal torch autograd's of the
model's own CE + 0.3·ntloss.
"""

from __future__ import annotations

import json
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, TOKENIZER, run_patch
from hf_architectures import ARCHS, CASES, WEIGHT, batch, build, export
from ort_helpers import quiet_ort

sys.path.insert(0, str(REPO / "python"))
from ntl_patch import _onnx_decode  # noqa: E402

R = 2
# PEFT 0.21.2's defaults (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING) for these models
PEFT_DEFAULTS = {
    "qwen2": ["q_proj", "v_proj"], "qwen3": ["q_proj", "v_proj"], "mistral": ["q_proj", "v_proj"],
    "phi3": ["qkv_proj"], "gemma": ["q_proj", "v_proj"], "gemma3": ["q_proj", "v_proj"],
    "gpt_neox": ["query_key_value"], "gptj": ["q_proj", "v_proj"], "opt": ["q_proj", "v_proj"],
    "bloom": ["query_key_value"], "bert_mlm": ["query", "value"],
}


def _reference(model, base, causal, lora, a_values, b_values, ids, labels):
    """float64 PEFT: (total, ce, ntl, {step-graph parameter name: gradient})."""
    import copy

    import ntl_torch
    import peft

    m = copy.deepcopy(model).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.get_peft_model(m, peft.LoraConfig(r=R, lora_alpha=8, target_modules=lora["target_modules"]))
    params = dict(pm.named_parameters())
    names = {}
    with torch.no_grad():
        for la in lora["layers"]:
            for part, values in (("lora_A", a_values), ("lora_B", b_values)):
                pname = f"base_model.model.{la['module']}.{part}.default.weight"
                params[pname].data = torch.from_numpy(values[la[part]]).double()
                names[la[part]] = pname
    trainable = {k for k, p in params.items() if p.requires_grad}
    assert trainable == set(names.values()), sorted(trainable ^ set(names.values()))[:4]
    logits = base.forward(pm.base_model.model, input_ids=ids).logits
    y = F.pad(labels, (0, 1), value=-100)[..., 1:] if causal else labels
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
    ntl = ntl_torch.ntl_value(ntl_torch.ntloss_object("wasserstein", vocab_size=logits.shape[-1]), logits, y)
    total = ce + WEIGHT * ntl
    grads = torch.autograd.grad(total, [params[p] for p in names.values()])
    return float(total), float(ce), float(ntl), {n: g.numpy() for n, g in zip(names, grads)}


@pytest.mark.parametrize("arch,exporter", CASES, ids=[f"{a}-{e}" for a, e in CASES])
def test_lora_default_targets_compute_peft(arch, exporter, tmp_path):
    model, base = build(arch)
    src = tmp_path / "m.onnx"
    export(model, exporter, src)
    out = tmp_path / "m.grad.onnx"
    r = run_patch(["step", src, "--tokenizer", TOKENIZER, "--weight", str(WEIGHT), "--lora-r", str(R),
                   "--split", "--fused-head", "off", "-o", out, "--json"])
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    lora = summary["lora"]
    assert lora["target_modules"] == PEFT_DEFAULTS[arch], lora["target_modules"]
    a_values = _onnx_decode.read_initializers(out, [la["lora_A"] for la in lora["layers"]])
    rng = np.random.default_rng(7)
    b_values = {la["lora_B"]: (0.2 * rng.standard_normal((la["out_features"], R))).astype(np.float32)
                for la in lora["layers"]}
    ids, labels = batch()
    total, ce, ntl, want = _reference(model, base, ARCHS[arch][3], lora, a_values, b_values, ids, labels)
    sess = quiet_ort().InferenceSession(str(out), providers=["CPUExecutionProvider"])
    outs = sess.run(None, {"input_ids": ids.numpy(), "labels": labels.numpy(), **a_values, **b_values})
    for got, ref in zip(outs[:3], (total, ce, ntl)):
        assert abs(float(got) - ref) <= 1e-5 * abs(ref), (outs[:3], (total, ce, ntl))
    params = summary["parameters"]
    assert set(params) == set(want)
    floor = 1e-3 * float(np.linalg.norm(np.concatenate([w.ravel() for w in want.values()])))
    for p, g in zip(params, outs[3:]):
        err = np.linalg.norm(g.astype(np.float64) - want[p]) / max(np.linalg.norm(want[p]), floor)
        assert err <= 1e-5, (p, err)

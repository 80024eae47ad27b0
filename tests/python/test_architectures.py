"""`ntl-patch step` on Hugging Face architectures beyond the committed GPT-2 and Llama fixtures,
exported at test time by both torch exporters with their own loss (`labels=`): Qwen2, Qwen3,
Mistral, Phi-3, Gemma, Gemma 3, GPT-NeoX, GPT-J, OPT, BLOOM, and BERT's masked-LM loss
(TorchScript only: torch 2.7's torch.export fails on BERT's mask code). Small random configs,
no downloads, dropout 0.

Reference: torch autograd (float64) of the model's own cross-entropy + 0.3·ntloss on the
logits and labels it reads (shifted for the causal LMs). The `--split` gradient graph runs in
onnxruntime. Also checked: every trainable torch parameter trains (tied names aside) and the
buffers torch.export records (Gemma's `embed_scale`, GPT-J's `embed_positions`, rotary
frequencies) stay constant.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import pytest
import torch

from conftest import REPO, TOKENIZER, run_patch
from hf_architectures import ARCHS, CASES, WEIGHT, batch, build, export, reference
from ort_helpers import norm_rel, quiet_ort
from step_helpers import zero_grad_mask

GRAD_RTOL = 1e-5
ZERO_GRAD_ATOL = 2e-8  # of the norm of all gradients; measured ≤ 6.7e-9, the exported attention ≤ 1.2e-9


# the dense step graph with the attention as exported and over blocks of 3 query rows (8 positions:
# a ragged last block; passes/attention), and the fused LM head (passes/fused_head) over 5-position
# chunks: 16 positions make 4 chunks with padding, so chunk borders fall inside every sequence
VARIANTS = {
    "dense": ["--fused-head", "off", "--attention", "eager"],
    "chunked": ["--fused-head", "off", "--attention", "auto", "--attention-block", "3"],
    "fused": ["--fused-head", "on", "--head-chunk-tokens", "5"],
}


@pytest.mark.parametrize("arch,exporter", CASES, ids=[f"{a}-{e}" for a, e in CASES])
def test_architecture_gradients_match_torch(arch, exporter, tmp_path):
    _gradients_match_torch(arch, exporter, "eager", tmp_path)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_head_size_off_a_multiple_of_8_matches_torch(exporter, tmp_path, monkeypatch):
    """Qwen2 with head size 12: the blockwise backward widens the values by 8 − 12 mod 8 = 4
    columns (`passes/attention/centred.rs`), where every other case here has 16 (8 columns)."""
    monkeypatch.setitem(ARCHS, "qwen2_head12", (*ARCHS["qwen2"][:2], dict(ARCHS["qwen2"][2], hidden_size=24),
                                                ARCHS["qwen2"][3]))
    _gradients_match_torch("qwen2_head12", exporter, "eager", tmp_path)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_soft_capped_scores_and_logits_match_torch(exporter, tmp_path, monkeypatch):
    """Gemma 2: its scores are soft-capped, `50·tanh(s / 50)` between the scale and the mask,
    which the blockwise attention applies per block (and `1 − t²` in its backward), and so are
    its logits, `30·tanh(z / 30)`, which the fused head applies per chunk
    (`passes/pointwise_map.rs`); `validate` computes the logits the fused graph no longer holds
    through the same map. `--attention onnx` keeps the attention's forward blockwise
    (onnxruntime-gpu's kernel refuses the operator's `softcap`). Can fail: without the `1 − t²`
    the keys' gradients are 8.1e-4 apart; without the map `validate` fails the losses."""
    monkeypatch.setitem(ARCHS, "gemma2", ("Gemma2Config", "Gemma2ForCausalLM",
                                          dict(ARCHS["gemma3"][2], attn_logit_softcapping=50.0,
                                               final_logit_softcapping=30.0), True))
    _gradients_match_torch("gemma2", exporter, "eager", tmp_path)
    out = tmp_path / "fused.step.onnx"
    r = run_patch(["step", tmp_path / "m.onnx", "--tokenizer", TOKENIZER, "--fused-head", "on",
                   "--head-chunk-tokens", "5", "-o", out])
    assert r.returncode == 0, r.stderr
    sys.path.insert(0, str(REPO / "python"))
    from ntl_patch import _contract

    assert _contract.read(out).fused_head.logit_map == [{"Div": 30.0}, "Tanh", {"Mul": 30.0}]
    r = run_patch(["validate", out, "--tokenizer", TOKENIZER])
    assert r.returncode == 0, r.stdout + r.stderr
    if exporter == "dynamo":
        model, _ = build("gemma2")
        export(model, exporter, tmp_path / "m23.onnx", opset=23)
        r = run_patch(["step", tmp_path / "m23.onnx", "--tokenizer", TOKENIZER, "--attention", "onnx", "--json",
                       "-o", tmp_path / "m23.step.onnx"])
        assert r.returncode == 0, r.stderr
        a = json.loads(r.stdout)["attention"]
        assert a["replaced"] == 2 and a["fused"] == 0, a
        assert all("soft-capped" in x["why"] for x in a["blockwise_forward"]) and len(a["blockwise_forward"]) == 2, a


# Granite divides its logits by `logits_scaling`, Cohere multiplies them by `logit_scale` (its
# TorchScript export fails in onnxruntime itself, before ntl-patch)
SCALED_LOGITS = {
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(ARCHS["qwen2"][2], logits_scaling=4.0), True),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(ARCHS["qwen2"][2], logit_scale=0.25), True),
}
SCALED_CASES = [("granite", "torchscript"), ("granite", "dynamo"), ("cohere", "dynamo")]


@pytest.mark.parametrize("arch,exporter", SCALED_CASES, ids=[f"{a}-{e}" for a, e in SCALED_CASES])
def test_scaled_logits_fuse_the_head(arch, exporter, tmp_path, monkeypatch):
    """The logits scaled by a constant after the projection: the fused head scales each chunk
    and its gradient. Can fail: before, `--fused-head on` refused ("a logit soft-cap or scale
    is not fused")."""
    monkeypatch.setitem(ARCHS, arch, SCALED_LOGITS[arch])
    _gradients_match_torch(arch, exporter, "eager", tmp_path)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_rotary_split_in_two_matches_torch(exporter, tmp_path, monkeypatch):
    """CodeGen: its rotary sin and cos are the two outputs of one `Split`. Can fail (TorchScript's
    export): the element types the passes follow typed the second output's `Unsqueeze` as its
    int64 axes, and the gradient of the attention's float32 `Cast` was cast to int64
    (onnxruntime refused the graph)."""
    monkeypatch.setitem(ARCHS, "codegen", ("CodeGenConfig", "CodeGenForCausalLM",
                                           dict(ARCHS["gptj"][2]), True))
    _gradients_match_torch("codegen", exporter, "eager", tmp_path)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_an_encoder_decoder_matches_torch(exporter, tmp_path, monkeypatch):
    """BART, one layer each side: the encoder's bidirectional attention, the decoder's causal
    one and its cross-attention (queries of the decoder, keys and values of the encoder) made
    blockwise; the decoder reads the labels shifted right. Also: `final_logits_bias`, a buffer
    torch never trains, stays constant under TorchScript's export too (its initializers say
    nothing of buffers: the name says it), and the fused head takes it as the head's bias behind
    the `Cast` TorchScript puts before it. Can fail: before, TorchScript's step trained it (and
    `--fused-head on` refused the bias).
    The shift needs a pad id, which makes it the embeddings' `padding_idx`, a row torch never
    trains and an export does not record: cleared here, as `pad_token_id=None` does for the
    other architectures."""
    def build_unpadded(arch, build=build, **kwargs):
        model, base = build(arch, **kwargs)
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                module.padding_idx = None
        return model, base

    monkeypatch.setattr(sys.modules[__name__], "build", build_unpadded)
    bart = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
                decoder_start_token_id=2, forced_eos_token_id=None)
    monkeypatch.setitem(ARCHS, "bart", ("BartConfig", "BartForConditionalGeneration", bart, False))
    _gradients_match_torch("bart", exporter, "eager", tmp_path, attentions=3)


def test_a_mixture_of_experts_matches_torch(tmp_path, monkeypatch):
    """Mixtral, 4 experts, 2 per token: the router's `TopK` and each expert's `index_add_`
    (TorchScript writes `ScatterElements` into zeros) are differentiated (`grad/rules`), the
    attention made blockwise. TorchScript only: torch 2.7's torch.export cannot export the
    experts' data-dependent loop. Can fail: before, `step` stopped at "no gradient rule for
    ScatterElements" (and then TopK)."""
    monkeypatch.setitem(ARCHS, "mixtral", ("MixtralConfig", "MixtralForCausalLM",
                                           dict(ARCHS["qwen2"][2], num_local_experts=4, num_experts_per_tok=2),
                                           True))
    _gradients_match_torch("mixtral", "torchscript", "eager", tmp_path)


# the TorchScript exporter cannot write SDPA with grouped keys (`enable_gqa`): Qwen2 by dynamo only
SDPA_CASES = [(a, e) for a in ("qwen2", "gpt_neox", "opt") for e in ("torchscript", "dynamo")
              if (a, e) != ("qwen2", "torchscript")]


@pytest.mark.parametrize("arch,exporter", SDPA_CASES, ids=[f"{a}-{e}" for a, e in SDPA_CASES])
def test_sdpa_exports_match_torch(arch, exporter, tmp_path):
    """transformers' default attention (SDPA) as each exporter writes it (its decomposition:
    the scale split over q and k, a causal `Where` of −∞): made blockwise, gradients as
    torch's. Can fail: on the code before, every dynamo case stopped at "cannot tell the rank"
    (the decomposition's shape arithmetic reads `Constant(value_ints=…)`, which the rank
    analysis did not)."""
    _gradients_match_torch(arch, exporter, "sdpa", tmp_path)
    # under --precision the SDPA decomposition's constants (`value_float` 0 and −∞ of its causal
    # `Where`) are typed: both half step graphs pass the checker and strict shape inference
    for precision in ("bf16", "fp16"):
        out = tmp_path / f"m.{precision}.step.onnx"
        r = run_patch(["step", tmp_path / "m.onnx", "--tokenizer", TOKENIZER, "--precision", precision, "-o", out])
        assert r.returncode == 0, (precision, r.stderr)
        m = onnx.load(str(out))
        onnx.checker.check_model(m, full_check=True)
        onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=True)


def _gradients_match_torch(arch, exporter, attn, tmp_path, attentions=2):
    model, base = build(arch, attn=attn)
    src = tmp_path / "m.onnx"
    export(model, exporter, src)
    ids, labels = batch()
    total, ce, ntl, want = reference(model, base, ARCHS[arch][3], ids, labels)
    for variant, flags in VARIANTS.items():
        out = tmp_path / f"m.{variant}.grad.onnx"
        r = run_patch(["step", src, "--tokenizer", TOKENIZER, "--weight", str(WEIGHT), "--split", "-o", out,
                       "--json", *flags])
        assert r.returncode == 0, (variant, r.stderr)
        summary = json.loads(r.stdout)
        assert (summary["fused_head"] is not None) == (variant == "fused"), summary
        # every layer's attention is blockwise unless asked not to be; BLOOM's reshapes the scores
        # between its products (left as exported, with the reason)
        if arch == "bloom" and variant != "dense":
            att = summary["attention"]
            assert att["replaced"] == 0 and len(att["left"]) == 2, att
            assert "Reshape" in att["left"][0]["why"], att
        else:
            replaced = 0 if variant == "dense" else attentions
            assert summary["attention"]["replaced"] == replaced and not summary["attention"]["left"], summary
        params = summary["parameters"]
        sess = quiet_ort().InferenceSession(str(out), providers=["CPUExecutionProvider"])
        outs = sess.run(None, {"input_ids": ids.numpy(), "labels": labels.numpy()})
        for got, ref in zip(outs[:3], (total, ce, ntl)):
            assert abs(float(got) - ref) <= 1e-5 * abs(ref), (variant, outs[:3], (total, ce, ntl))
        # every parameter torch trains, under its own name (BERT's decoder bias is also
        # `cls.predictions.bias`: one tensor, two names) — and nothing else
        assert set(params) <= set(want), set(params) - set(want)
        untrained = set(want) - set(params)
        assert untrained <= {"cls.predictions.bias"}, untrained
        _assert_gradients_match(dict(zip(params, outs[3:])), want, variant)


def _assert_gradients_match(got: dict, want: dict, variant: str) -> None:
    """Norm-relative per parameter (floor 1e-3·‖all‖). An exactly zero gradient (a key bias: a
    row's softmax ignores a shift of all its scores) is float32 round-off, held to a round-off
    bound instead."""
    norm = float(np.linalg.norm(np.concatenate([want[p].ravel() for p in got])))
    got = {p: g.astype(np.float64) for p, g in got.items()}
    zero = zero_grad_mask({p: want[p] for p in got})
    round_off = max((float(np.max(np.abs(got[p][z]))) for p, z in zero.items() if z.any()), default=0.0)
    assert round_off <= ZERO_GRAD_ATOL * norm, (variant, round_off / norm)
    errs = {p: norm_rel(got[p][~zero[p]], want[p][~zero[p]], 1e-3 * norm) for p in got}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= GRAD_RTOL, (variant, worst, errs[worst])


def test_wide_vocabulary_fuses_the_head_by_default(tmp_path):
    """Qwen2 with its real vocabulary (151 936) and tied embeddings, 2 small layers: `step`
    with no flags fuses the LM head (the logits are wide), reads the tied embedding without a
    transposed copy, and its gradients equal torch's; the dense graph's equal them too."""
    model, base = build("qwen2", vocab=151936, tied=True)
    src = tmp_path / "m.onnx"
    export(model, "torchscript", src)
    ids, labels = batch()
    total, ce, ntl, want = reference(model, base, True, ids, labels)
    for variant, flags in {"auto": [], "dense": ["--fused-head", "off"]}.items():
        out = tmp_path / f"m.{variant}.grad.onnx"
        r = run_patch(["step", src, "--tokenizer", TOKENIZER, "--weight", str(WEIGHT), "--split", "-o", out,
                       "--json", *flags])
        assert r.returncode == 0, r.stderr
        summary = json.loads(r.stdout)
        if variant == "auto":
            assert summary["fused_head"] == {"chunk_tokens": 128}, summary
        params = summary["parameters"]
        sess = quiet_ort().InferenceSession(str(out), providers=["CPUExecutionProvider"])
        outs = sess.run(None, {"input_ids": ids.numpy(), "labels": labels.numpy()})
        for got, ref in zip(outs[:3], (total, ce, ntl)):
            assert abs(float(got) - ref) <= 1e-5 * abs(ref), (variant, outs[:3], (total, ce, ntl))
        assert set(params) == set(want), set(params) ^ set(want)
        _assert_gradients_match(dict(zip(params, outs[3:])), want, variant)

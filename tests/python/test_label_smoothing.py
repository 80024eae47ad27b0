"""`--label-smoothing ε`: the cross-entropy ntl-patch writes equals torch's
`F.cross_entropy(label_smoothing=ε)` (value and, through ORT Training's artifacts of the patched
graph and through the step graph, every parameter's gradient of CE_ε + λ·NTL), for a mean CE
with ignored positions and for a per-position (`reduction='none'`) CE that the graph masks and
reduces itself."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import FIXTURES, MODELS, TOKENIZER, run_patch
from ort_helpers import batch, generate_artifacts, norm_rel, quiet_ort, training_module

EPS = 0.1
WEIGHT = 0.3
V = 48


def _logits_fn(model, weights):
    """(params, logits(input_ids)) in float64: the tiny LM for lm_flat; for the exporter fixture
    its emb → fc → tanh → head, with the weights read from the graph's initializers."""
    import onnx
    import tiny_lm
    from onnx import numpy_helper

    if "exporters" not in str(model):
        m = tiny_lm.build("flat", {k: v.double() for k, v in weights.items()}, dtype=torch.float64)
        return dict(m.named_parameters()), m.logits
    graph = onnx.load(str(model)).graph
    p = {i.name: torch.from_numpy(numpy_helper.to_array(i).astype(np.float64)).requires_grad_()
         for i in graph.initializer if i.name.split(".")[0] in ("emb", "fc", "head")}

    def logits(ids):
        h = torch.tanh(p["emb.weight"][ids] @ p["fc.weight"].T + p["fc.bias"])
        return h @ p["head.weight"].T + p["head.bias"]

    return p, logits


def _torch_reference(model, weights, input_ids, labels, mask=None):
    """float64 total, CE_ε and parameter gradients (torch autograd + ntloss)."""
    import ntl_torch

    params, logits_of = _logits_fn(model, weights)
    logits = logits_of(torch.from_numpy(input_ids))
    y = torch.from_numpy(labels)
    if mask is None:
        ce = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), ignore_index=-100, label_smoothing=EPS)
        number_labels = y
    else:
        w = torch.from_numpy(mask).double().reshape(-1)
        per = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), ignore_index=-100, reduction="none",
                              label_smoothing=EPS)
        ce = (per * w).sum() / w.sum()
        number_labels = torch.where(torch.from_numpy(mask) != 0, y, torch.full_like(y, -100))
    ntl = ntl_torch.ntl_value(ntl_torch.ntloss_object("wasserstein"), logits, number_labels)
    total = ce + WEIGHT * ntl
    grads = torch.autograd.grad(total, list(params.values()))
    return float(total), float(ce), {k: g.numpy() for k, g in zip(params, grads)}


CASES = [
    ("lm_flat", MODELS / "lm_flat.onnx", False),
    ("torch_sce_none_masked", FIXTURES / "exporters" / "torch_sce_none_masked.onnx", True),
]


@pytest.mark.parametrize("name,model,masked", CASES, ids=[c[0] for c in CASES])
def test_label_smoothing_matches_torch(name, model, masked, weights, tmp_path):
    ort = quiet_ort()
    input_ids, labels = batch()
    feeds = {"input_ids": input_ids, "labels": labels}
    mask = None
    if masked:
        mask = (labels != -100).astype(np.float32)
        mask[0, 1] = 0.0  # a position the mask drops although its label is valid
        feeds["mask"] = mask

    out = tmp_path / "patched.onnx"
    r = run_patch([model, "--tokenizer", TOKENIZER, "--weight", str(WEIGHT), "--label-smoothing", str(EPS),
                   "-o", out])
    assert r.returncode == 0, r.stderr
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    got = dict(zip(names, sess.run(None, {k: v for k, v in feeds.items() if k in
                                          {i.name for i in sess.get_inputs()}})))
    total, ce, grads = _torch_reference(model, weights, input_ids, labels, mask)
    assert abs(float(got["ce_loss"]) - ce) <= 1e-5 * abs(ce)
    assert abs(float(got[names[0]]) - total) <= 1e-5 * abs(total)
    floor = 1e-3 * np.sqrt(sum(float(np.sum(g ** 2)) for g in grads.values()))

    # ORT Training differentiates the patched graph itself; its SoftmaxCrossEntropyLoss gradient
    # ignores the log_prob output, so the smoothing term must not read it
    import onnx

    patched = onnx.load(str(out))
    art = generate_artifacts(patched, tmp_path / "artifacts")
    user_inputs = [i.name for i in patched.graph.input
                   if i.name not in {t.name for t in patched.graph.initializer}]
    state, module = training_module(art)
    module.train()
    outs = module(*[feeds[n] for n in user_inputs])
    ort_total = float(np.asarray(outs[0] if isinstance(outs, (tuple, list)) else outs))
    assert abs(ort_total - total) <= 1e-5 * abs(total)
    for p, g in grads.items():
        got_grad = np.asarray(state.parameters[p].grad, np.float64)
        assert norm_rel(got_grad, g, floor) <= 1e-5, f"ORT Training gradient of {p}"

    # the step graph, with the dense LM head and the fused one (its row mean of the logits)
    for head in (["--fused-head", "off"], ["--fused-head", "on", "--head-chunk-tokens", "3"]):
        step = tmp_path / f"step_{head[1]}.onnx"
        r = run_patch(["step", model, "--tokenizer", TOKENIZER, "--weight", str(WEIGHT),
                       "--label-smoothing", str(EPS), "--split", *head, "-o", step, "--json"])
        assert r.returncode == 0, r.stderr
        grad_graph = json.loads(r.stdout)["outputs"][0]  # --split: the gradient graph first
        sess = ort.InferenceSession(grad_graph, providers=["CPUExecutionProvider"])
        outs = [o.name for o in sess.get_outputs()]
        got = dict(zip(outs, sess.run(None, {k: v for k, v in feeds.items() if k in
                                             {i.name for i in sess.get_inputs()}})))
        for p, g in grads.items():
            key = f"ntl/grad/{p}"
            assert key in got, f"no gradient output {key}: {outs}"
            assert norm_rel(got[key], g, floor) <= 1e-5, f"{head}: {p}"


def test_label_smoothing_out_of_range_is_refused(tmp_path):
    out = tmp_path / "x.onnx"
    r = run_patch([MODELS / "lm_flat.onnx", "--tokenizer", TOKENIZER, "--label-smoothing", "1.5", "-o", out])
    assert r.returncode == 1 and "--label-smoothing" in r.stderr and not out.exists()

"""Cross-entropies written by hand in torch, in the spellings each torch exporter gives them,
exported at test time: ntl-patch recognises each as a cross-entropy (not as an unknown loss),
and the step graph's losses and gradients equal torch autograd of `CE + 0.3·ntloss`
(test_op_rules.py's harness, tests/python/tiny_lm_loss.py). Covered spellings beyond the
committed fixtures: a one-hot whose depth is the logits' width read at run time
(`F.one_hot(y, V)` with `V = z.shape[-1]`), the dynamo exporter's one-hot (`Equal(y, Range)`
with cast constants) and its `x[:, 0]` (a Slice that keeps everything, then a Gather), and
`logsumexp − gather`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tiny_lm_loss import TinyLMLoss, check_gradient_graph, export


def _masked_mean(per_position, y):
    m = (y != -100).to(per_position.dtype)
    return (per_position * m).sum() / m.sum()


def onehot_width(z, y):
    onehot = F.one_hot(y.clamp(min=0), z.shape[-1]).to(z.dtype)
    return _masked_mean(-(F.log_softmax(z, -1) * onehot).sum(-1), y)


def eq_arange(z, y):
    onehot = (y.clamp(min=0)[..., None] == torch.arange(z.shape[-1])).to(z.dtype)
    return _masked_mean(-(F.log_softmax(z, -1) * onehot).sum(-1), y)


def lse_gather(z, y):
    picked = z.gather(-1, y.clamp(min=0)[..., None])[..., 0]
    return _masked_mean(torch.logsumexp(z, -1) - picked, y)


EQUAL_RANGE = "log_softmax × Equal(labels, Range) + ReduceSum"
# the form ntl-patch names, by exporter (the dynamo exporter writes F.one_hot as Equal/Range)
FORMS = {
    "onehot_width": (onehot_width, {"torchscript": "log_softmax × OneHot + ReduceSum", "dynamo": EQUAL_RANGE}),
    "eq_arange": (eq_arange, {"torchscript": EQUAL_RANGE, "dynamo": EQUAL_RANGE}),
    "lse_gather": (lse_gather, {e: "logsumexp − logits GatherElements" for e in ("torchscript", "dynamo")}),
}
CASES = [(f, e) for f in FORMS for e in ("torchscript", "dynamo")]


@pytest.mark.parametrize("form,exporter", CASES, ids=[f"{f}-{e}" for f, e in CASES])
def test_handwritten_cross_entropy(form, exporter, weights, tmp_path):
    loss, patterns = FORMS[form]
    src = tmp_path / "m.onnx"
    export(TinyLMLoss(weights, loss), exporter, src)
    summary = check_gradient_graph(src, weights, loss, tmp_path)
    assert summary["pattern"] == patterns[exporter]

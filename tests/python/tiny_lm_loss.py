"""The tiny LM under a loss written in torch (test_op_rules.py's harness, shared with
test_handwritten_ce.py): the module, its export by either torch exporter on the fixed batch
(ort_helpers.batch), torch autograd (float64) of `loss + 0.3·ntloss`, and the check of
`ntl-patch step --split`'s gradient graph in onnxruntime against it.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import numpy as np
import torch

from conftest import TOKENIZER, run_patch
from ort_helpers import batch, norm_rel, quiet_ort

WEIGHT = 0.3
GRAD_RTOL = 1e-5


class TinyLMLoss(torch.nn.Module):
    """The tiny LM's logits under a loss written in torch: `loss(logits, labels)`."""

    def __init__(self, weights, loss, dtype=torch.float32):
        super().__init__()
        import tiny_lm

        self.lm = tiny_lm.build("flat", {k: v.to(dtype) for k, v in weights.items()}, dtype=dtype)
        # a loss with parameters of its own: a copy in this dtype (its parameters are named
        # "loss.…", beside the LM's "lm.…")
        self.loss = copy.deepcopy(loss).to(dtype) if isinstance(loss, torch.nn.Module) else loss

    def forward(self, input_ids, labels):
        return self.loss(self.lm.logits(input_ids), labels)


def export(model: torch.nn.Module, exporter: str, path: Path, opset: int = 17) -> None:
    """opset: for the TorchScript exporter (the dynamo exporter writes its own)."""
    import generate

    ids, labels = (torch.from_numpy(a) for a in batch())
    if exporter == "torchscript":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (ids, labels), str(path), dynamo=False, opset_version=opset,
                              training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                              input_names=["input_ids", "labels"], output_names=["loss"],
                              dynamic_axes={"input_ids": {0: "B", 1: "T"}, "labels": {0: "B", 1: "T"}})
    else:
        generate.export_dynamo(model, path)


def torch_reference(weights, loss, input_ids, labels):
    """float64 (total, reported, ntl, {parameter: gradient of total}): `reported` is the
    model's own loss, total = reported + 0.3·ntloss (labels -100 where the loss ignores them)."""
    import ntl_torch

    m = TinyLMLoss(weights, loss, torch.float64)
    ids, y = torch.from_numpy(input_ids), torch.from_numpy(labels)
    reported = m(ids, y)
    ntl = ntl_torch.ntl_value(ntl_torch.ntloss_object("wasserstein"), m.lm.logits(ids), y)
    total = reported + WEIGHT * ntl
    params = dict(m.named_parameters())
    grads = torch.autograd.grad(total, list(params.values()))
    return float(total), float(reported), float(ntl), {k: g.numpy() for k, g in zip(params, grads)}


def check_gradient_graph(src: Path, weights, loss, tmp_path: Path) -> dict:
    """`ntl-patch step --split` of `src` against torch autograd; returns the step summary."""
    out = tmp_path / "m.grad.onnx"
    r = run_patch(["step", src, "--tokenizer", TOKENIZER, "--weight", str(WEIGHT), "--split", "-o", out,
                   "--json"])
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    params = summary["parameters"]
    input_ids, labels = batch()
    sess = quiet_ort().InferenceSession(str(out), providers=["CPUExecutionProvider"])
    outs = sess.run(None, {"input_ids": input_ids, "labels": labels})
    total, reported, ntl, want = torch_reference(weights, loss, input_ids, labels)
    # the number loss is added to what the graph reported
    assert abs(outs[1] - reported) <= 1e-5 * abs(reported)
    assert abs(outs[2] - ntl) <= 1e-5 * abs(ntl)
    assert abs(outs[0] - total) <= 1e-5 * abs(total)
    names = {p: p if p in want else f"lm.{p}" for p in params}
    assert set(names.values()) == set(want), f"trained {sorted(params)}, torch has {sorted(want)}"
    all_want = np.concatenate([want[names[p]].ravel() for p in params])
    floor = 1e-3 * float(np.linalg.norm(all_want))
    errs = {p: norm_rel(g.astype(np.float64), want[names[p]], floor) for p, g in zip(params, outs[3:])}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= GRAD_RTOL, errs
    return summary

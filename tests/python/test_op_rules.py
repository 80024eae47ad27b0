"""Gradient rules beyond the fixtures' ops, and a scalar loss reported after more arithmetic.

Each case is the tiny LM trained on `F.cross_entropy + aux(logits)`, where `aux` is a
regularizer built on one reduction (the z-loss on log-sum-exp, max/min logits, L1/L2 norms)
or on one activation, CumSum or Einsum (PRelu with a learned slope of its own), exported at test time by both torch exporters. The CE is a scalar that is not the graph's
output, so ntl-patch adds the number loss to the reported `CE + aux` (ce_loss is that value).
Reference: torch autograd (float64) of `CE + aux + 0.3·ntloss`; the `--split` gradient graph
runs in onnxruntime. ReduceSumSquare, which torch never exports, is the sum-of-squares case
with its `ReduceSum(Pow(z, 2))` replaced in the exported graph.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch
import torch.nn.functional as F

from tiny_lm_loss import TinyLMLoss, check_gradient_graph, export

AUX = {
    "z_loss": (lambda z: 1e-2 * torch.logsumexp(z, -1).pow(2).mean(), "ReduceLogSumExp"),
    "max_logit": (lambda z: 0.1 * z.amax(-1).mean(), "ReduceMax"),
    "min_logit": (lambda z: 0.1 * z.amin(-1).mean(), "ReduceMin"),
    "l2_norm": (lambda z: 0.1 * torch.linalg.vector_norm(z, dim=-1).mean(), "ReduceL2"),
    "l1_norm": (lambda z: 1e-2 * torch.linalg.vector_norm(z, ord=1, dim=-1).mean(), "ReduceL1"),
    "sum_square": (lambda z: 1e-3 * z.pow(2).sum(-1).mean(), "ReduceSumSquare"),
}
CASES = [(a, e) for a in AUX for e in ("torchscript", "dynamo")]


class PReluAux(torch.nn.Module):
    """A learned per-class PRelu slope (a parameter beside the LM's)."""

    def __init__(self):
        super().__init__()
        self.slope = torch.nn.Parameter(torch.linspace(0.05, 0.5, 48))

    def forward(self, z):
        return 0.1 * F.prelu(z.transpose(1, 2), self.slope).mean()  # channels: the classes


# Activations and other ops off the fixtures' path, as a regularizer on the logits. Each
# names the op the export must contain (torch writes some of them only under TorchScript).
ACTIVATIONS = {
    "softplus": (lambda z: 0.1 * F.softplus(z).mean(), "Softplus"),
    "elu": (lambda z: 0.1 * F.elu(z, 0.7).mean(), "Elu"),
    "celu": (lambda z: 0.1 * F.celu(z, 0.8).mean(), "Celu"),
    "selu": (lambda z: 0.1 * F.selu(z).mean(), "Selu"),
    "leaky_relu": (lambda z: 0.1 * F.leaky_relu(z, 0.2).mean(), "LeakyRelu"),
    "hardsigmoid": (lambda z: 0.1 * F.hardsigmoid(4 * z).mean(), "HardSigmoid"),  # 4z: past ±3
    "hardswish": (lambda z: 0.1 * F.hardswish(4 * z).mean(), "HardSwish"),
    "sin": (lambda z: 0.1 * torch.sin(z).mean(), "Sin"),
    "cos": (lambda z: 0.1 * torch.cos(z).mean(), "Cos"),
    "atan": (lambda z: 0.1 * torch.atan(z).mean(), "Atan"),
    "prelu": (PReluAux, "PRelu"),
    "cumsum": (lambda z: 1e-3 * torch.cumsum(z, 1).pow(2).mean(), "CumSum"),
    "einsum": (lambda z: 1e-3 * torch.einsum("btv,btv->bt", z, z).mean(), "Einsum"),
    # TorchScript at opset 20 writes the Gelu op (below 20, and the dynamo exporter: Erf or Tanh)
    # (weighted up: the two approximations' derivatives differ by at most 2e-2)
    "gelu": (lambda z: 10 * F.gelu(2 * z).mean(), "Gelu", ("torchscript",)),
    "gelu_tanh": (lambda z: 10 * F.gelu(2 * z, approximate="tanh").mean(), "Gelu", ("torchscript",)),
    # the dynamo exporter writes this pool as a ReduceMean
    "global_avg_pool": (lambda z: 0.1 * F.adaptive_avg_pool1d(z, 1).pow(2).mean(), "GlobalAveragePool",
                        ("torchscript",)),
    "tile": (lambda z: 1e-3 * (z.repeat(1, 2, 3).pow(2) * torch.linspace(0, 1, 144)).mean(), "Tile"),
    "einsum_ellipsis": (lambda z: 1e-3 * torch.einsum("...v,...v->...", z, z).mean(), "Einsum"),
    "einsum_summed": (lambda z: 1e-3 * torch.einsum("btv,v->b", z.tanh(), z[0, 0]).mean(), "Einsum"),
    # selections and scatters (a MoE layer's router and its index_add_): the data's gradient is 0
    # where an update overwrote it, the updates' is gathered back, the top values' scattered
    "scatter": (lambda z: 1e-2 * (z.scatter(2, _picks(z), z[..., :4].tanh()).pow(2) * _ramp(z)).mean(),
                "ScatterElements", ("torchscript",)),  # torch 2.7's dynamo exporter cannot write it
    "scatter_add": (lambda z: 1e-2 * (z.scatter_add(2, _picks(z), z[..., :4].tanh()).pow(2) * _ramp(z)).mean(),
                    "ScatterElements"),
    "index_put": (lambda z: 1e-2 * (z.index_put((torch.tensor([1]),), z[:1].tanh()).pow(2) * _ramp(z)).mean(),
                  "ScatterND", ("torchscript",)),
    "top_k": (lambda z: 1e-2 * torch.topk(z, 3, -1).values.pow(2).mean(), "TopK"),
}


def _picks(z):
    """Distinct classes per position (a scatter without reduction writes each once)."""
    return torch.tensor([3, 17, 5, 40]).expand(*z.shape[:2], 4)


def _ramp(z):
    """Weights that tell the classes apart (a plain mean would make overwritten and written
    positions look alike)."""
    return torch.linspace(0.5, 1.5, z.shape[-1])


def _aux_loss(aux):
    """CE + the regularizer; a module where the regularizer has parameters of its own."""
    make = ACTIVATIONS[aux][0]
    if isinstance(make, type):

        class Loss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.aux = make()

            def forward(self, z, y):
                return F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1)) + self.aux(z)

        return Loss()
    return lambda z, y: F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1)) + make(z)


def _ce_plus(aux: str):
    def loss(z, y):
        ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=-100)
        return ce + AUX[aux][0](z)

    return loss


def _as_sum_square(path: Path) -> None:
    """ReduceSum(Pow(x, 2)) → ReduceSumSquare(x): torch writes the sum of squares that way."""
    m = onnx.load(str(path))
    g = m.graph
    producers = {o: n for n in g.node for o in n.output}
    for n in g.node:
        pow_ = producers.get(n.input[0]) if n.op_type == "ReduceSum" and n.input else None
        if pow_ is not None and pow_.op_type == "Pow":
            n.op_type = "ReduceSumSquare"
            n.input[0] = pow_.input[0]
            opset = next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))
            if opset < 18 and len(n.input) > 1:
                # ReduceSumSquare takes its axes as an attribute before opset 18
                n.attribute.append(onnx.helper.make_attribute("axes", _constant(g, n.input[1]).tolist()))
                del n.input[1]
            break
    else:
        raise AssertionError("no ReduceSum(Pow) in the export")
    onnx.save(m, str(path))


def _constant(g: onnx.GraphProto, name: str) -> np.ndarray:
    for t in g.initializer:
        if t.name == name:
            return onnx.numpy_helper.to_array(t)
    node = next(n for n in g.node if n.op_type == "Constant" and n.output[0] == name)
    return onnx.numpy_helper.to_array(node.attribute[0].t)


@pytest.mark.parametrize("aux,exporter", CASES, ids=[f"{a}-{e}" for a, e in CASES])
def test_gradient_through_reduction_regularizer(aux, exporter, weights, tmp_path):
    src = tmp_path / "m.onnx"
    export(TinyLMLoss(weights, _ce_plus(aux)), exporter, src)
    if aux == "sum_square":
        _as_sum_square(src)
    op = AUX[aux][1]
    assert op in {n.op_type for n in onnx.load(str(src)).graph.node}, f"the export has no {op}"
    check_gradient_graph(src, weights, _ce_plus(aux), tmp_path)


ACT_CASES = [(a, e) for a, spec in ACTIVATIONS.items() for e in (spec[2:] or [("torchscript", "dynamo")])[0]]


@pytest.mark.parametrize("aux,exporter", ACT_CASES, ids=[f"{a}-{e}" for a, e in ACT_CASES])
def test_gradient_through_activation(aux, exporter, weights, tmp_path):
    src = tmp_path / "m.onnx"
    op = ACTIVATIONS[aux][1]
    export(TinyLMLoss(weights, _aux_loss(aux)), exporter, src, opset=20 if op == "Gelu" else 17)
    assert op in {n.op_type for n in onnx.load(str(src)).graph.node}, f"the {exporter} export has no {op}"
    check_gradient_graph(src, weights, _aux_loss(aux), tmp_path)

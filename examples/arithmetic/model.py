"""A small causal transformer (torch), exported with its cross-entropy for ONNX Runtime Training.

Token + learned position embeddings -> `layers` pre-LayerNorm blocks (multi-head causal
self-attention, GELU MLP) -> LayerNorm -> Linear head. No dropout (the graph is exported with
training=TRAINING; a Dropout would make the teacher-forced numbers noisy for no benefit at this
scale). The causal mask is additive (`scores - 1e4 * future`), as in fixtures/tiny_lm.py.

`forward(input_ids, labels) -> (loss, logits)`: the loss is
`F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)` (the TorchScript
exporter writes `Reshape` + `SoftmaxCrossEntropyLoss`, the form ntl-patch finds); `logits` is a
second graph output, so ORT Training's eval graph can be run for greedy decoding with the
module's current weights, and `export_model_for_inferencing(..., ["logits"])` gives an
inference graph.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


class LayerNorm(nn.Module):
    """LayerNorm written out (mean, variance, rsqrt). The TorchScript exporter writes nn.LayerNorm
    as one `LayerNormalization` node declaring only its first output, and ORT Training's gradient
    builder needs the other two (mean, inverse std); the primitive ops differentiate as they are."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(dim=-1, keepdim=True)
        xc = x - mu
        var = (xc * xc).mean(dim=-1, keepdim=True)
        return xc * torch.rsqrt(var + self.eps) * self.weight + self.bias


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.ln1 = LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, h: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.ln1(h)).split(d, dim=-1)
        q, k, v = (x.reshape(b, t, self.heads, hd).transpose(1, 2) for x in (q, k, v))  # [B,H,T,hd]
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hd) - 1e4 * future
        att = torch.matmul(torch.softmax(scores, dim=-1), v)  # [B,H,T,hd]
        h = h + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class ArithLM(nn.Module):
    def __init__(self, vocab: int, max_len: int, dim: int = 64, layers: int = 2, heads: int = 4,
                 hidden: int = 256):
        super().__init__()
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.ln_f = LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)
        future = (pos.unsqueeze(0) > pos.unsqueeze(1)).to(torch.float32)  # [T,T] 1 above the diagonal
        h = self.tok(input_ids) + self.pos(pos).unsqueeze(0)
        for blk in self.blocks:
            h = blk(h, future)
        return self.head(self.ln_f(h))  # [B,T,V]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        logits = self.logits(input_ids)
        loss = F.cross_entropy(logits.reshape(-1, self.vocab), labels.reshape(-1), ignore_index=-100)
        return loss, logits


def export(model: ArithLM, path: Path, example: tuple[torch.Tensor, torch.Tensor]) -> None:
    """TorchScript exporter, opset 17, training=TRAINING, no constant folding, dynamic B and T
    (as fixtures/generate.py exports its fixtures)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, example, str(path),
            dynamo=False,
            opset_version=17,
            training=torch.onnx.TrainingMode.TRAINING,
            do_constant_folding=False,
            input_names=["input_ids", "labels"],
            output_names=["loss", "logits"],
            dynamic_axes={"input_ids": {0: "B", 1: "T"}, "labels": {0: "B", 1: "T"},
                          "logits": {0: "B", 1: "T"}},
        )

"""A "logits as parameter" harness: a graph whose only trainable tensor IS the logits, so one
ONNX Runtime Training step yields d(loss)/d(logits) directly, comparable with the gradients the
reference implementations recorded (fixtures/reference/*_cases.json).

    logits (initializer [B, T, V]) -> Reshape [B*T, V] -> SoftmaxCrossEntropyLoss(ignore_index=-100)
    labels (input [B, T])          -> Reshape [B*T]    ->

With `masked=True` the cross-entropy is per position (reduction none), multiplied by a float
`mask` input [B, T] and divided by the mask's sum (a masked mean, as torch code writes it).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from conftest import TOKENIZER, run_patch


def logits_model(logits: np.ndarray, opset: int = 17, layout: str = "flat",
                 ignore_index: int = -100, masked: bool = False) -> onnx.ModelProto:
    b, t, v = logits.shape
    init = [numpy_helper.from_array(logits.astype(np.float32), "logits")]
    nodes = []
    inputs = [helper.make_tensor_value_info("labels", TensorProto.INT64, [b, t])]
    if masked:
        assert layout == "flat"
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, [b, t]))
        init += [numpy_helper.from_array(np.array([-1, v], np.int64), "shape_nv"),
                 numpy_helper.from_array(np.array([-1], np.int64), "shape_n")]
        nodes += [helper.make_node("Reshape", ["logits", "shape_nv"], ["scores"]),
                  helper.make_node("Reshape", ["labels", "shape_n"], ["labels_flat"]),
                  helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels_flat"], ["per_position"],
                                   ignore_index=ignore_index, reduction="none"),
                  helper.make_node("Reshape", ["mask", "shape_n"], ["mask_flat"]),
                  helper.make_node("Mul", ["per_position", "mask_flat"], ["masked"]),
                  helper.make_node("ReduceSum", ["masked"], ["masked_sum"], keepdims=0),
                  helper.make_node("ReduceSum", ["mask_flat"], ["mask_sum"], keepdims=0),
                  helper.make_node("Div", ["masked_sum", "mask_sum"], ["loss"])]
    elif layout == "flat":
        init += [numpy_helper.from_array(np.array([-1, v], np.int64), "shape_nv"),
                 numpy_helper.from_array(np.array([-1], np.int64), "shape_n")]
        nodes += [helper.make_node("Reshape", ["logits", "shape_nv"], ["scores"]),
                  helper.make_node("Reshape", ["labels", "shape_n"], ["labels_flat"]),
                  helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels_flat"], ["loss"],
                                   ignore_index=ignore_index, reduction="mean")]
    else:  # [B, V, T]: class axis 1
        nodes += [helper.make_node("Transpose", ["logits"], ["scores"], perm=[0, 2, 1]),
                  helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["loss"],
                                   ignore_index=ignore_index, reduction="mean")]
    graph = helper.make_graph(
        nodes, "logits_param", inputs,
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        init)
    ir = 10 if opset >= 21 else 8
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)


def ort_step(logits: np.ndarray, labels: np.ndarray, patch_args: list[str], opset: int = 17,
             layout: str = "flat", ignore_index: int = -100, mask: np.ndarray | None = None,
             tokenizer=TOKENIZER):
    """Patches the logits model with `patch_args`, takes one ORT Training step and returns
    (outputs by name, d(first output)/d(logits) as [B*T, V])."""
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src, out, art = tmp / "model.onnx", tmp / "patched.onnx", tmp / "art"
        onnx.save(logits_model(logits, opset, layout, ignore_index, mask is not None), src)
        r = run_patch([src, "--tokenizer", tokenizer, "-o", out, *patch_args])
        assert r.returncode == 0, r.stderr
        patched = onnx.load(out)
        art.mkdir()
        artifacts.generate_artifacts(patched, requires_grad=["logits"], loss=None,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=art)
        state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
        module = Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"))
        module.train()
        feeds = [labels.astype(np.int64)] + ([] if mask is None else [mask.astype(np.float32)])
        outs = module(*feeds)
        names = [o.name for o in patched.graph.output]
        grad = np.asarray(state.parameters["logits"].grad).reshape(-1, logits.shape[-1])
        return dict(zip(names, [float(np.asarray(o)) for o in outs])), grad


def rel_err(got, want, floor: float = 1e-12) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), floor))

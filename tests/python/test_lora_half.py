"""LoRA on a float16 export: the frozen base stays float16 in the step graph and in the runtime.

The tiny LM exported in float16, `step --lora-r` with `--precision fp32` (float32 compute from
the half weights) and `--precision fp16`. Reference: the same model exported in float32 from
the float16-rounded weights (so both graphs compute from the same values), with the same LoRA
options (the initial A is a function of --seed and the shapes only).
  - the frozen weights are the export's float16 initializers, byte for byte; the step graph's
    float initializers take <= 0.55x the bytes of the float32 export's;
  - onnxruntime (ORT_ENABLE_ALL) neither folds the widening casts into float32 constants nor
    merges them back into one shared float32 copy: the optimised model holds no float32 tensor
    of a frozen weight's size, and one cast per reading node stays (in the maintained runtime,
    onnxruntime 1.31, in .venv-rt, and in this environment's 1.19);
  - fp32: 3 StepRunner steps equal the float32 export's (the widening is exact);
  - fp16: the frozen weights are read in float16 directly (no cast of them at all), and 3
    steps in tract (real float16 kernels) match the float32 export's fp16 graph.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import pytest
import torch

from conftest import REPO, TOKENIZER, run_patch
from precision_helpers import batches, half_export
from tract_step import TractStep

LORA = ["--lora-r", "4", "--lora-alpha", "16", "--lora-targets", "q,v,fc1", "--weight", "0.3"]
HALF_RATIO = 0.55


def _f32_export_of_rounded(out) -> None:
    """The tiny LM exported in float32 from the float16-rounded weights (as half_export)."""
    import ntl_torch
    import tiny_lm

    w = {k: v.half().float() for k, v in ntl_torch.load_weights().items()}
    m = tiny_lm.build("flat", w)
    x = torch.tensor([[18, 29, 25, 36, 35, 7, 27]])
    dyn = {"input_ids": {0: "B", 1: "T"}, "labels": {0: "B", 1: "T"}}
    torch.onnx.export(m, (x, x.clone()), str(out), input_names=["input_ids", "labels"],
                      output_names=["loss"], dynamic_axes=dyn, opset_version=17, dynamo=False,
                      do_constant_folding=False)


def _step(src, out, precision) -> dict:
    r = run_patch(["step", src, "--tokenizer", TOKENIZER, *LORA, "--precision", precision, "-o", out,
                   "--json"])
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _meta(path) -> dict:
    m = onnx.load(str(path))
    return json.loads({p.key: p.value for p in m.metadata_props}["ntl_step"])


def _weight_bytes(path) -> int:
    """Bytes of the float initializers that are not training state (the model's weights)."""
    size = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.BFLOAT16: 2}
    state = {i for i, _ in _meta(path)["state"]}
    return sum(size[t.data_type] * int(np.prod(t.dims)) for t in onnx.load(str(path)).graph.initializer
               if t.data_type in size and t.name not in state)


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_half")
    half, wide = d / "half.onnx", d / "wide.onnx"
    half_export(half, torch.float16)
    _f32_export_of_rounded(wide)
    out = {}
    for name, src in (("half", half), ("wide", wide)):
        for p in ("fp32", "fp16"):
            out[name, p] = d / f"{name}.{p}.step.onnx"
            _step(src, out[name, p], p)
    return half, out


def test_frozen_weights_stay_float16_in_the_step_graph(graphs):
    half, out = graphs
    exported = {t.name: t for t in onnx.load(str(half)).graph.initializer}
    for p in ("fp32", "fp16"):
        meta = _meta(out["half", p])
        assert set(meta["parameters"]) == {x for l in meta["lora"]["layers"] for x in (l["lora_A"], l["lora_B"])}
        inits = {t.name: t for t in onnx.load(str(out["half", p])).graph.initializer}
        for name in meta["frozen"]:
            if int(np.prod(exported[name].dims)) > 1:
                assert inits[name].data_type == onnx.TensorProto.FLOAT16, name
                assert inits[name].raw_data == exported[name].raw_data, name
        ratio = _weight_bytes(out["half", p]) / _weight_bytes(out["wide", p])
        assert ratio <= HALF_RATIO, (p, ratio)


_OPTIMISE = """
import sys, onnxruntime as ort
so = ort.SessionOptions()
so.log_severity_level = 3
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
so.optimized_model_filepath = sys.argv[2]
ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
"""


def _optimised(path, out, python):
    """The graph onnxruntime runs, as its optimiser (ORT_ENABLE_ALL) leaves it."""
    import subprocess

    r = subprocess.run([python, "-c", _OPTIMISE, str(path), str(out)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return onnx.load(str(out)).graph


@pytest.mark.parametrize("runtime", ["1.31", "1.19"])
def test_onnxruntime_keeps_one_cast_per_use_and_folds_none(graphs, runtime, tmp_path):
    half, out = graphs
    python = str(REPO / ".venv-rt" / "bin" / "python") if runtime == "1.31" else sys.executable
    frozen = {t.name: t for t in onnx.load(str(half)).graph.initializer if int(np.prod(t.dims)) > 16}
    sizes = {int(np.prod(t.dims)) for t in frozen.values()}
    g = _optimised(out["half", "fp32"], tmp_path / "opt.onnx", python)
    folded = [t.name for t in g.initializer
              if t.data_type == onnx.TensorProto.FLOAT and int(np.prod(t.dims)) in sizes]
    assert not folded, f"float32 copies of frozen weights folded into constants: {folded}"
    # each cast feeds one node; the matrices after the first adapted layer (q, v) are read in
    # the forward and the backward: two casts each, not one shared float32 copy
    per_weight = {}
    producers = {o: n for n in g.node for o in n.output}
    readers = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    for n in g.node:
        if n.op_type not in ("Cast", "CastLike"):
            continue
        src = n.input[0]
        layout = ("Transpose", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten")
        while src not in frozen and src in producers and producers[src].op_type in layout:
            src = producers[src].input[0]  # through the layout ops on the half tensor
        if src in frozen:
            per_weight[src] = per_weight.get(src, 0) + 1
            assert readers.get(n.output[0]) == 1, (src, readers.get(n.output[0]))
    for name in ("o.weight", "fc1.weight", "fc2.weight", "head.weight"):
        assert per_weight.get(name, 0) >= 2, per_weight


@pytest.mark.parametrize("runtime", ["1.31", "1.19"])
def test_each_widening_waits_for_its_reader(graphs, runtime, tmp_path):
    """In onnxruntime's optimised graph every Cast that widens a frozen half weight (or a
    layout op of it) reads a tensor computed from the batch, so no execution order runs it
    before its reader's activation exists. A Cast of the weight alone (what onnxruntime makes
    of a `CastLike(W, x)`) ran at the start of the step in the PRIORITY_BASED order StepRunner
    uses for --recompute: every float32 copy at once."""
    half, out = graphs
    python = str(REPO / ".venv-rt" / "bin" / "python") if runtime == "1.31" else sys.executable
    frozen = {t.name for t in onnx.load(str(half)).graph.initializer if int(np.prod(t.dims)) > 16}
    g = _optimised(out["half", "fp32"], tmp_path / "opt.onnx", python)
    data, grew = set(_meta(out["half", "fp32"])["data_inputs"]), True
    while grew:  # computed from the batch
        grew = False
        for n in g.node:
            if any(i in data for i in n.input) and not set(n.output) <= data:
                data |= set(n.output)
                grew = True
    producers = {o: n for n in g.node for o in n.output}
    layout = ("Transpose", "Reshape", "Identity", "Squeeze", "Unsqueeze", "Flatten")
    widening, early = 0, []
    for n in g.node:
        if n.op_type not in ("Cast", "CastLike"):
            continue
        src = n.input[0]
        while src not in frozen and src in producers and producers[src].op_type in layout:
            src = producers[src].input[0]  # through layout ops (and the wait's Reshape)
        if src in frozen:
            widening += 1
            if n.input[0] not in data:
                early.append(n.name)
    assert widening and not early, f"widenings of the weight alone: {early[:4]} ({widening} in all)"


def _runner(path):
    sys.path.insert(0, str(REPO / "python"))
    from ntl_patch import StepRunner

    return StepRunner(path, providers=["CPUExecutionProvider"])


def test_fp32_compute_from_the_half_base_equals_the_float32_export(graphs):
    _, out = graphs
    a, b = _runner(out["half", "fp32"]), _runner(out["wide", "fp32"])
    for x, y in batches("lm_flat")[:3]:
        la, lb = a.step({"input_ids": x, "labels": y}), b.step({"input_ids": x, "labels": y})
        np.testing.assert_allclose(la, lb, rtol=1e-6)
    pa, pb = a.parameters(), b.parameters()
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_allclose(pa[k], pb[k], rtol=1e-5, atol=1e-7)


def test_fp16_reads_the_half_weights_directly_and_matches_in_tract(graphs, tmp_path):
    half, out = graphs
    frozen = {t.name for t in onnx.load(str(half)).graph.initializer if int(np.prod(t.dims)) > 1}
    g = onnx.load(str(out["half", "fp16"])).graph
    casts = [n for n in g.node if n.op_type in ("Cast", "CastLike") and n.input[0] in frozen]
    assert not casts, [(n.op_type, n.input[0]) for n in casts]
    readers = {n.op_type for n in g.node if any(i in frozen for i in n.input)}
    assert "MatMul" in readers or "Transpose" in readers, readers
    a, b = TractStep(out["half", "fp16"], tmp_path), TractStep(out["wide", "fp16"], tmp_path)
    for x, y in batches("lm_flat")[:3]:
        la, lb = (float(np.ravel(r.step({"input_ids": x, "labels": y})["loss"])[0]) for r in (a, b))
        assert abs(la - lb) <= 2e-5 * abs(lb), (la, lb)


def test_frozen_weights_in_external_data_stay_there(tmp_path):
    """A float16 export with its weights in external data: the step graph's frozen weights
    reference the same file at the same offsets (nothing copied, nothing widened), and it
    trains like the inline export's."""
    src = tmp_path / "inline.onnx"
    half_export(src, torch.float16)
    ext_dir = tmp_path / "ext"
    ext_dir.mkdir()
    m = onnx.load(str(src))
    onnx.save_model(m, str(ext_dir / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    before = sorted(p.name for p in ext_dir.iterdir())
    out = ext_dir / "model.step.onnx"
    _step(ext_dir / "model.onnx", out, "fp32")
    assert sorted(p.name for p in ext_dir.iterdir()) == sorted(before + ["model.step.onnx"])
    exported = {t.name: t for t in onnx.load(str(ext_dir / "model.onnx"), load_external_data=False).graph.initializer}
    stepped = {t.name: t for t in onnx.load(str(out), load_external_data=False).graph.initializer}
    meta = _meta(out)
    kept = [n for n in meta["frozen"] if int(np.prod(exported[n].dims)) > 1]
    assert kept
    for n in kept:
        assert stepped[n].data_type == onnx.TensorProto.FLOAT16
        assert list(stepped[n].external_data) == list(exported[n].external_data), n
    inline = tmp_path / "inline.step.onnx"
    _step(src, inline, "fp32")
    a, b = _runner(out), _runner(inline)
    for x, y in batches("lm_flat")[:2]:
        np.testing.assert_array_equal(a.step({"input_ids": x, "labels": y}), b.step({"input_ids": x, "labels": y}))

"""`ntl-patch step --recompute`: activation recomputation of the repeated blocks.

References: the same step graph without recomputation (gradients equal to 1e-6 norm-relative,
floor 1e-3·‖all‖ as test_step.py), torch autograd in float64 (fixtures/reference/step, from
fixtures/generate_step.py) and 20 AdamW steps of torch (the same file). What onnxruntime's
optimiser leaves of the recomputation is counted in the graph it writes out
(`optimized_model_filepath`), in this environment's onnxruntime (1.19) and in .venv-rt's 1.31:
the backward must read far fewer forward activations than without recomputation, at every
optimisation level — the count goes back up if a runtime could merge the copies back into the
stored forward (common-subexpression elimination) or run them in the forward.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import MODELS, TOKENIZER
from hf_reference import HF_MODELS, hf_reference
from ort_helpers import norm_rel, quiet_ort
from step_helpers import HEADS, STEPS, TRAJ_RTOL, assert_params_close, run_step, run_step_graph, zero_grad_mask

REPO = Path(__file__).resolve().parents[2]
GRAD_RTOL = 1e-6


def _grads(path: Path, x, y, optimise=True):
    ort = quiet_ort()
    so = ort.SessionOptions()
    if not optimise:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    meta = json.loads(sess.get_modelmeta().custom_metadata_map["ntl_step"])
    outs = sess.run(None, {"input_ids": x, "labels": y})
    return outs[:3], dict(zip(meta["parameters"], outs[3:]))


def _assert_same_gradients(a: dict, b: dict, rtol: float) -> None:
    all_a = np.concatenate([v.ravel() for v in a.values()]).astype(np.float64)
    floor = 1e-3 * float(np.linalg.norm(all_a))
    errs = {p: norm_rel(b[p].astype(np.float64), a[p].astype(np.float64), floor) for p in a}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= rtol, (worst, errs[worst])


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("model", HF_MODELS)
def test_gradients_equal_those_without_recomputation(model, head, tmp_path):
    ref = hf_reference(model)
    x, y = ref["batch/input_ids"], ref["batch/labels"]
    plain = run_step(model, tmp_path / "a.grad.onnx", "--split", *HEADS[head])
    summary = run_step(model, tmp_path / "b.grad.onnx", "--split", "--recompute", "layers", *HEADS[head])
    assert summary["recompute"]["blocks"] == 2 and summary["recompute"]["mode"] == "layers"
    assert summary["parameters"] == plain["parameters"]
    # the same arithmetic: equal as written (onnxruntime's optimiser off) ...
    la, ga = _grads(tmp_path / "a.grad.onnx", x, y, optimise=False)
    lb, gb = _grads(tmp_path / "b.grad.onnx", x, y, optimise=False)
    np.testing.assert_allclose(lb, la, rtol=1e-6)
    _assert_same_gradients(ga, gb, GRAD_RTOL)
    # ... and as onnxruntime runs them, where its fusions may now differ (the forward's inner
    # activations feed only the forward): within float32 rounding of each other and of torch's
    # float64 autograd, as test_step checks the graph without recomputation
    la, ga = _grads(tmp_path / "a.grad.onnx", x, y)
    lb, gb = _grads(tmp_path / "b.grad.onnx", x, y)
    np.testing.assert_allclose(lb, la, rtol=1e-6)
    _assert_same_gradients(ga, gb, 1e-5)
    want = {p: ref[f"grad/wasserstein/float64/{p}"] for p in gb}
    _assert_same_gradients(want, gb, 1e-5)


@pytest.mark.parametrize("model", HF_MODELS)
def test_trains_like_torch(model, tmp_path):
    ref = hf_reference(model)
    out = tmp_path / "m.step.onnx"
    run_step(model, out, "--recompute", "layers", "--lr", "1e-3", *HEADS["fused"])
    batches = [(ref[f"traj/batch/{k:02d}/input_ids"], ref[f"traj/batch/{k:02d}/labels"]) for k in range(STEPS)]
    losses, params, _ = run_step_graph(out, batches)
    np.testing.assert_allclose(losses, ref["traj/adamw/loss"][:, 0], rtol=TRAJ_RTOL)
    zero = zero_grad_mask({p: ref[f"grad/wasserstein/float64/{p}"] for p in params})
    assert_params_close(params, {p: ref[f"traj/adamw/final/{p}"] for p in params}, zero)


LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")
_OPTIMISE = """
import sys, onnxruntime as ort
for level in sys.argv[3:]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    so.optimized_model_filepath = sys.argv[2] + "." + level + ".onnx"
    ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
"""


def _stored_activations(path: Path, out: Path, python: str) -> dict:
    """Forward activations (float tensors computed from the batch; not shape vectors) the backward
    reads in the graph onnxruntime runs (after its optimiser at `level`): what a step keeps from
    the forward to the backward, per level. Types from onnx's shape inference of the emitted
    graph."""
    r = subprocess.run([python, "-c", _OPTIMISE, str(path), str(out), *LEVELS], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    emitted = onnx.shape_inference.infer_shapes(onnx.load(str(path))).graph
    floats = {v.name for v in emitted.value_info
              if v.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)}
    return {level: _stored(onnx.load(f"{out}.{level}.onnx").graph, floats) for level in LEVELS}


def _reads(n) -> list:
    """A node's inputs and what its subgraphs (Scan / Loop / If bodies) read from outside."""
    names = list(n.input)
    for a in n.attribute:
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            for m in sub.node:
                names.extend(_reads(m))
    return names


def _stored(g, floats: set) -> set:
    producer = {o: i for i, n in enumerate(g.node) for o in n.output}
    reads = [_reads(n) for n in g.node]
    forward, needed = set(), {o.name for o in g.output[:3]}
    for i in range(len(g.node) - 1, -1, -1):
        if any(o in needed for o in g.node[i].output):
            forward.add(i)
            needed.update(reads[i])
    data = {"input_ids", "labels"}
    for n, r in zip(g.node, reads):
        if data.intersection(r):
            data.update(n.output)
    return {x for i, r in enumerate(reads) if i not in forward for x in r
            if producer.get(x) in forward and x in data and x in floats}


@pytest.mark.parametrize("runtime", ["1.31", "1.19"])
@pytest.mark.parametrize("model", ["llama_ts", "gpt2_dynamo"])
def test_onnxruntime_neither_merges_nor_drops_the_recomputation(model, runtime, tmp_path):
    python = str(REPO / ".venv-rt" / "bin" / "python") if runtime == "1.31" else sys.executable
    run_step(model, tmp_path / "a.grad.onnx", "--split", *HEADS["fused"])
    run_step(model, tmp_path / "b.grad.onnx", "--split", "--recompute", "layers", *HEADS["fused"])
    plain_at = _stored_activations(tmp_path / "a.grad.onnx", tmp_path / "a.opt", python)
    recomputed_at = _stored_activations(tmp_path / "b.grad.onnx", tmp_path / "b.opt", python)
    for level in LEVELS:
        plain, recomputed = plain_at[level], recomputed_at[level]
        print(f"{model} onnxruntime {runtime} {level}: {len(plain)} -> {len(recomputed)} stored")
        assert len(recomputed) <= 0.5 * len(plain), (level, len(plain), len(recomputed))
        # no block's inner activation is kept: what the blocks compute stays inside them
        inner = [x for x in recomputed if "/layers.1/self_attn/" in x or "/h.1/attn/" in x]
        assert not inner, (level, inner)


_RUN_ORDER = """
import glob, json, sys
import numpy as np, onnxruntime as ort
so = ort.SessionOptions()
so.log_severity_level = 3
so.execution_order = ort.ExecutionOrder.PRIORITY_BASED  # StepRunner's, for recompute graphs
so.enable_profiling = True
so.profile_file_prefix = sys.argv[3] + "/profile"
so.optimized_model_filepath = sys.argv[3] + "/optimised.onnx"
sess = ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
z = np.load(sys.argv[2])
sess.run(None, {"input_ids": z["input_ids"], "labels": z["labels"]})
profile = json.load(open(sess.end_profiling()))
size = lambda e: sum(int(np.prod(d)) for t in e["args"].get("output_type_shape", []) for d in t.values())
print(json.dumps([[e["name"][: -len("_kernel_time")], size(e)] for e in profile
                  if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]))
"""


@pytest.mark.parametrize("bucket", [[], ["--update-bucket", "1"]], ids=["per_tensor", "buckets"])
@pytest.mark.parametrize("model", ["llama_ts", "gpt2_dynamo"])
def test_the_update_runs_after_its_gradient_in_onnxruntimes_order(model, bucket, tmp_path):
    """In the order onnxruntime 1.31 runs a recompute step graph (PRIORITY_BASED: ready nodes by
    node index), nothing of the optimizer update runs before the backward (the products that read
    only state, such as v·β2, once ran in the forward and lived, each the size of its
    parameter, until the update), and no weight gradient becomes a node onnxruntime adds
    (its Transpose + MatMul fusion made one that ran at the end of the backward, keeping every
    flattened activation alive). With `--update-bucket` the buckets' copies of the state wait
    for their gradients too."""
    ref = hf_reference(model)
    np.savez(tmp_path / "batch.npz", input_ids=ref["batch/input_ids"], labels=ref["batch/labels"])
    run_step(model, tmp_path / "m.step.onnx", "--recompute", "layers", "--weight-decay", "0.1", *bucket)
    r = subprocess.run([str(REPO / ".venv-rt" / "bin" / "python"), "-c", _RUN_ORDER,
                        str(tmp_path / "m.step.onnx"), str(tmp_path / "batch.npz"), str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    ran = dict(json.loads(r.stdout.strip().splitlines()[-1]))  # name -> elements it wrote
    graph = onnx.load(str(tmp_path / "optimised.onnx"), load_external_data=False).graph
    nodes = {n.name: n for n in graph.node}
    order = [nodes[name] for name in ran if name in nodes]
    # the backward starts with its first tensor (not a shape: PRIORITY_BASED runs those first)
    backward_at = next(i for i, n in enumerate(order) if n.output[0].startswith("ntl/grad/")
                       and n.op_type not in ("Shape", "Size") and ran[n.name] > 64)
    # scalars (the step count, the bias corrections) may run any time, and so may a bucket's
    # flattening Reshapes: onnxruntime makes a Reshape a view of its input, holding nothing
    early = [n.output[0] for n in order[:backward_at] if ran[n.name] > 1 and n.op_type != "Reshape"
             and any(o.startswith(("ntl/opt/", "ntl/next/")) for o in n.output)]
    assert not early, f"update nodes in the forward: {early[:5]}"
    # each parameter's gradient as AdamW reads it (m − g), and the node onnxruntime computes it by
    producer = {o: n for n in graph.node for o in n.output}
    grads = [n.input[0] for n in graph.node if n.output[0].startswith("ntl/opt/m_diff")]
    # a bucket's gradient is the concatenation of its members' (each flattened)
    grads = [x for g in grads for x in _bucket_members(g, producer)]
    ours = {n.name for n in onnx.load(str(tmp_path / "m.step.onnx"), load_external_data=False).graph.node}
    products = [producer[g] for g in grads if g in producer and producer[g].op_type in
                ("Gemm", "MatMul", "FusedMatMul", "FusedGemm")]
    assert len(products) >= 8, len(products)  # the layers' weights
    added = [f"{n.op_type} {n.output[0]}" for n in products if n.name not in ours]
    assert not added, f"weight gradients onnxruntime re-created: {added[:5]}"


def _bucket_members(tensor: str, producer: dict) -> list[str]:
    """The gradients a bucket's gradient concatenates (each through its flattening Reshape, in
    onnxruntime's optimised graph possibly a Reshape already folded away), or [tensor]."""
    node = producer.get(tensor)
    if node is None or node.op_type != "Concat":
        return [tensor]
    return [producer[x].input[0] if x in producer and producer[x].op_type == "Reshape" else x
            for x in node.input]


def _anonymise(src: Path, out: Path) -> None:
    """`src` with every node and every tensor but the graph's inputs and outputs renamed (n0, t0,
    ...): no name carries a layer index. The rotary buffer keeps the suffix `step` knows buffers
    by (`t7.inv_freq`), so that both graphs train the same parameters."""
    m = onnx.load(str(src))
    g = m.graph
    keep = {i.name for i in g.input} - {t.name for t in g.initializer} | {o.name for o in g.output}
    names: dict = {}

    def rename(x: str) -> str:
        suffix = ".inv_freq" if x.endswith("inv_freq") else ""
        return x if x == "" or x in keep else names.setdefault(x, f"t{len(names)}{suffix}")

    for t in g.initializer:
        t.name = rename(t.name)
    for v in list(g.input) + list(g.value_info):
        v.name = rename(v.name)
    for k, n in enumerate(g.node):
        assert not any(a.type == onnx.AttributeProto.GRAPH for a in n.attribute)
        n.name = f"n{k}"
        n.input[:] = [rename(x) for x in n.input]
        n.output[:] = [rename(x) for x in n.output]
    onnx.save(m, str(out))


@pytest.mark.parametrize("model", HF_MODELS)
def test_layers_found_from_the_graph_structure_alone(model, tmp_path):
    """An export whose names carry no layer index: the layers come from the sequence of weight
    reads that repeats once per layer, and the step keeps as few activations as with the names."""
    anonymous = tmp_path / "anonymous.onnx"
    _anonymise(MODELS / f"{model}.onnx", anonymous)
    named = run_step(model, tmp_path / "named.grad.onnx", "--split", "--recompute", "layers")
    assert not named["recompute"]["layers"].startswith("(graph structure")
    run_step(anonymous, tmp_path / "a.grad.onnx", "--split")
    s = run_step(anonymous, tmp_path / "b.grad.onnx", "--split", "--recompute", "layers")
    assert s["recompute"]["blocks"] == 2, s["recompute"]
    assert s["recompute"]["layers"].startswith("(graph structure"), s["recompute"]
    stored = {}
    for name in ("named", "a", "b"):
        emitted = onnx.shape_inference.infer_shapes(onnx.load(str(tmp_path / f"{name}.grad.onnx"))).graph
        floats = {v.name for v in emitted.value_info if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
        stored[name] = len(_stored(emitted, floats))
    print(model, stored)
    assert stored["b"] <= stored["named"] < 0.5 * stored["a"], stored
    ref = hf_reference(model)
    x, y = ref["batch/input_ids"], ref["batch/labels"]
    la, ga = _grads(tmp_path / "a.grad.onnx", x, y, optimise=False)
    lb, gb = _grads(tmp_path / "b.grad.onnx", x, y, optimise=False)
    np.testing.assert_allclose(lb, la, rtol=1e-6)
    _assert_same_gradients(ga, gb, GRAD_RTOL)


def test_with_lora_and_fp16(tmp_path):
    ref = hf_reference("llama_dynamo")
    x, y = ref["batch/input_ids"], ref["batch/labels"]
    for extra, rtol in ((["--lora-r", "4", "--lora-targets", "q_proj,v_proj,down_proj"], GRAD_RTOL),
                        (["--precision", "fp16"], 1e-3)):
        run_step("llama_dynamo", tmp_path / "a.grad.onnx", "--split", *extra)
        s = run_step("llama_dynamo", tmp_path / "b.grad.onnx", "--split", "--recompute", "layers", *extra)
        assert s["recompute"]["blocks"] == 2
        la, ga = _grads(tmp_path / "a.grad.onnx", x, y, optimise=False)
        lb, gb = _grads(tmp_path / "b.grad.onnx", x, y, optimise=False)
        np.testing.assert_allclose(lb, la, rtol=rtol)
        _assert_same_gradients(ga, gb, rtol)


def test_python_step_and_runner(tmp_path):
    sys.path.insert(0, str(REPO / "python"))
    import ntl_patch

    ref = hf_reference("gpt2_ts")
    batches = [(ref[f"traj/batch/{k:02d}/input_ids"], ref[f"traj/batch/{k:02d}/labels"]) for k in range(3)]
    losses = {}
    for mode in ("off", "layers"):
        out = tmp_path / f"{mode}.step.onnx"
        s = ntl_patch.step(MODELS / "gpt2_ts.onnx", loss="wasserstein", tokenizer=TOKENIZER, out=out,
                           recompute=mode)
        assert s["recompute"]["mode"] == mode
        runner = ntl_patch.StepRunner(out, providers=["CPUExecutionProvider"])
        losses[mode] = [runner.step({"input_ids": a, "labels": b}) for a, b in batches]
    np.testing.assert_allclose(losses["layers"], losses["off"], rtol=1e-6)


def test_auto_decides_from_the_step_shape(tmp_path):
    out = tmp_path / "m.step.onnx"
    small = run_step("llama_dynamo", out, "--recompute", "auto", "--batch", "1", "--seq", "2")
    assert small["recompute"]["blocks"] == 0
    assert small["recompute"]["reason"].startswith("off: the forward keeps"), small["recompute"]
    long = run_step("llama_dynamo", out, "--recompute", "auto", "--batch", "8", "--seq", "4096")
    assert long["recompute"]["blocks"] == 2
    assert long["recompute"]["reason"].startswith("layers: the forward would keep"), long["recompute"]
    unknown = run_step("llama_dynamo", out, "--recompute", "auto")
    assert unknown["recompute"]["blocks"] == 0 and "--batch and --seq" in unknown["recompute"]["reason"]
    # no repeated blocks: auto warns and keeps recomputation off
    r = run_step("lm_flat", out, "--recompute", "auto", ok=False)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["recompute"]["blocks"] == 0
    assert any("--recompute auto found no repeated blocks" in w for w in summary["warnings"])


def test_refusals_are_one_line_and_write_nothing(tmp_path):
    out = tmp_path / "m.step.onnx"
    r = run_step("lm_flat", out, "--recompute", "layers", ok=False)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "found no repeated blocks" in lines[0] and "layers.N" in lines[0], r.stderr
    r = run_step("llama_ts", out, "--batch", "4", ok=False)
    assert r.returncode == 1 and "--recompute auto" in r.stderr
    assert list(tmp_path.iterdir()) == []

"""QLoRA with a symmetric int8 / int4 base (`ntl-patch step --lora-r R --quantize-base int8|int4
--quant-block 16`) against numpy, onnxruntime and torch + PEFT 0.21.2.

Reference: fixtures/reference/int/*.npz, written by fixtures/generate_int.py (numpy alone: scale =
absmax / qmax per block of 16 along `in`, q = round half to even of w / scale, clipped). int4
needs opset 21, so its graphs are built from the fixtures converted to opset 21 by onnx's version
converter. Checked:
  - the stored codes and scales equal numpy's (int4 packed two a byte, low nibble first), every
    linear layer but the LM head quantised, no float copy of a quantised weight left, and the
    adversarial blocks (ties, zeros, a scale that underflows, float32's limits) written into a
    weight;
  - the DequantizeLinear of the step graph, run in onnxruntime 1.19.2 (.venv) and 1.31.1
    (.venv-rt), gives numpy's q * scale bit for bit;
  - 10 AdamW steps of StepRunner equal torch + PEFT (float64) on the model whose quantised
    weights are numpy's dequantised ones (test_lora.py's tolerances, lora_helpers.py);
  - onnxruntime's optimised graph keeps no float copy and one DequantizeLinear per reading node;
  - save_inference_model merges into the dequantised base; inspect names the scheme;
  - bad input: one line, exit 1, nothing written.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnx.version_converter
import onnxruntime as ort
import pytest
import torch

import lora_helpers as lh
from conftest import MODELS, REPO, TOKENIZER, run_patch
from step_helpers import reads_past_views

from ntl_patch import StepRunner  # noqa: E402  (lora_helpers put python/ on the path)

INT = REPO / "fixtures" / "reference" / "int"
BLOCK = 16
QMAX = {"int8": 127, "int4": 7}
ONNX_TYPE = {"int8": onnx.TensorProto.INT8, "int4": onnx.TensorProto.INT4}
HEAD = {"tiny": "head", "gpt2": "lm_head", "llama": "lm_head"}


def reference(fixture: str) -> dict[str, np.ndarray]:
    return dict(np.load(INT / f"{lh.fixture_arch(fixture)}.npz"))


def source(fixture: str, scheme: str, tmp_path: Path) -> Path:
    """The export the scheme needs: int4 the fixture converted to opset 21, int8 the fixture."""
    if scheme == "int8":
        return MODELS / f"{fixture}.onnx"
    out = tmp_path / f"{fixture}_opset21.onnx"
    if not out.exists():
        onnx.save(onnx.version_converter.convert_version(onnx.load(str(MODELS / f"{fixture}.onnx")), 21), str(out))
    return out


def build(fixture: str, scheme: str, out: Path, tmp_path: Path, src: Path | None = None, *extra) -> dict:
    targets = ["--lora-targets", "q,v,fc1"] if fixture == "lm_flat" else []
    return lh.build_step_from(src or source(fixture, scheme, tmp_path), out, "--lora-r", "4", *targets,
                              "--quantize-base", scheme, "--quant-block", str(BLOCK), *extra)


def raw_initializers(path: Path) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in onnx.load(str(path)).graph.initializer}


def stored_codes(t: onnx.TensorProto, scheme: str) -> np.ndarray:
    """The int values of a codes initializer, unpacked here (not by onnx) for int4."""
    assert t.data_type == ONNX_TYPE[scheme] and len(t.dims) == 2 and t.dims[1] == BLOCK
    raw = np.frombuffer(t.raw_data, np.uint8)
    if scheme == "int8":
        return raw.view(np.int8).reshape(tuple(t.dims))
    lo, hi = (raw & 0x0F).astype(np.int8), (raw >> 4).astype(np.int8)
    q = np.stack([lo, hi], axis=1).reshape(-1)
    return np.where(q > 7, q - 16, q).astype(np.int8).reshape(tuple(t.dims))


CODE_CASES = [("lm_flat", "int8"), ("lm_flat", "int4"), ("gpt2_ts", "int8"), ("gpt2_dynamo", "int4"),
              ("llama_ts", "int4"), ("llama_dynamo", "int8"), ("llama_dynamo", "int4")]


@pytest.mark.parametrize("fixture,scheme", CODE_CASES)
def test_codes_equal_numpy(fixture, scheme, tmp_path):
    out = tmp_path / "q.onnx"
    report = build(fixture, scheme, out, tmp_path)
    meta = lh.step_meta(out)["quantize_base"]
    ref = reference(fixture)
    inits = raw_initializers(out)
    assert meta["quant_type"] == scheme and meta["blocksize"] == BLOCK and meta["qmax"] == QMAX[scheme]
    assert "code" not in meta
    modules = {la["module"] for la in meta["layers"]}
    all_linear = {k.split("/")[0] for k in ref if not k.startswith("adversarial/")}
    assert modules == all_linear - {HEAD[lh.fixture_arch(fixture)]}, "every linear layer but the head"
    for la in meta["layers"]:
        m = la["module"]
        np.testing.assert_array_equal(stored_codes(inits[la["codes"]], scheme).reshape(-1),
                                      ref[f"{m}/{scheme}/codes"].reshape(-1), err_msg=m)
        got = onnx.numpy_helper.to_array(inits[la["scales"]])
        assert got.dtype == np.float32 and got.shape == (ref[f"{m}/{scheme}/scales"].size,)
        np.testing.assert_array_equal(got.view(np.uint32), ref[f"{m}/{scheme}/scales"].view(np.uint32), err_msg=m)
        assert la["weight"] not in inits, "the float weight is gone"
    per_value = {"int8": 1, "int4": 0.5}[scheme]
    n = sum(la["shape"][0] * la["shape"][1] for la in meta["layers"])
    assert meta["bytes_before"] == 4 * n and meta["bytes_after"] == n * per_value + 4 * n // BLOCK
    model = onnx.load(str(out))
    if scheme == "int4":  # int4 tensors need IR version 10; raised where the export is older
        assert model.ir_version >= 10
        was = onnx.load(str(source(fixture, scheme, tmp_path)), load_external_data=False).ir_version
        assert any("IR version" in w for w in report.get("warnings", [])) == (was < 10), report
    onnx.checker.check_model(model)


def test_adversarial_blocks(tmp_path):
    """Ties, zeros, negative zeros, a scale that underflows and float32's limits, written into the
    first rows of the tiny LM's q weight, quantised as numpy does."""
    m = onnx.load(str(MODELS / "lm_flat.onnx"))
    src = tmp_path / "adv.onnx"
    ref = reference("lm_flat")
    adv = ref["adversarial/weight"]  # [3, 32]
    probe = tmp_path / "probe.onnx"
    build("lm_flat", "int8", probe, tmp_path, MODELS / "lm_flat.onnx")
    layer = next(la for la in lh.step_meta(probe)["quantize_base"]["layers"] if la["module"] == "q")
    t = next(t for t in m.graph.initializer if t.name == layer["weight"])
    w = onnx.numpy_helper.to_array(t).copy()
    torch_order = w.T if layer["weight_layout"] == "in_out" else w
    rows = adv.reshape(-1, torch_order.shape[1])  # the 6 blocks of 16, row after row
    torch_order[:len(rows)] = rows
    t.CopyFrom(onnx.numpy_helper.from_array(torch_order.T if layer["weight_layout"] == "in_out" else torch_order,
                                            t.name))
    onnx.save(m, str(src))
    for scheme in QMAX:
        out = tmp_path / f"{scheme}.onnx"
        build("lm_flat", scheme, out, tmp_path, src if scheme == "int8" else _opset21(src, tmp_path))
        la = next(la for la in lh.step_meta(out)["quantize_base"]["layers"] if la["module"] == "q")
        inits = raw_initializers(out)
        codes = stored_codes(inits[la["codes"]], scheme)[:6]  # the first 6 blocks
        np.testing.assert_array_equal(codes.reshape(-1), ref[f"adversarial/{scheme}/codes"].reshape(-1))
        scales = onnx.numpy_helper.to_array(inits[la["scales"]])[:6]
        np.testing.assert_array_equal(scales.view(np.uint32), ref[f"adversarial/{scheme}/scales"].view(np.uint32))


def _opset21(src: Path, tmp_path: Path) -> Path:
    out = tmp_path / (src.stem + "_opset21.onnx")
    onnx.save(onnx.version_converter.convert_version(onnx.load(str(src)), 21), str(out))
    return out


# ---------------------------------------------------------------------------- runtimes

DQ_SCRIPT = """
import sys, numpy as np, onnxruntime as ort
s = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
outs = s.run(None, {})
np.savez(sys.argv[2], **{o.name: v for o, v in zip(s.get_outputs(), outs)})
print(ort.__version__)
"""


def dequantize_model(step: Path, out: Path) -> dict[str, str]:
    """A model of the step graph's own DequantizeLinear nodes (one per quantised weight, with
    their attributes), the codes and scales as initializers (the scales as stored, not through
    the wait for an activation), each output a graph output."""
    m = onnx.load(str(step))
    meta = json.loads({p.key: p.value for p in m.metadata_props}["ntl_step"])["quantize_base"]
    inits = {t.name: t for t in m.graph.initializer}
    produced = {o: n for n in m.graph.node for o in n.output}

    def stored(t: str) -> str:  # the scales are read after an activation: Reshape(scales, ...)
        while t not in inits and t in produced and produced[t].op_type == "Reshape":
            t = produced[t].input[0]
        return t

    nodes, outputs, used, names = [], [], [], {}
    for k, la in enumerate(meta["layers"]):
        dq = next(n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == la["codes"])
        node = onnx.NodeProto()
        node.CopyFrom(dq)
        node.input[:] = [stored(i) for i in node.input]
        node.output[0] = f"w{k}"
        nodes.append(node)
        outputs.append(onnx.helper.make_tensor_value_info(f"w{k}", onnx.TensorProto.FLOAT, [None, BLOCK]))
        used += [inits[i] for i in node.input if i]
        names[f"w{k}"] = la["module"]
    g = onnx.helper.make_graph(nodes, "dq", [], outputs, used)
    model = onnx.helper.make_model(g, opset_imports=list(m.opset_import), ir_version=m.ir_version)
    onnx.checker.check_model(model)
    onnx.save(model, str(out))
    return names


@pytest.mark.parametrize("fixture,scheme", [("lm_flat", "int8"), ("lm_flat", "int4"), ("gpt2_dynamo", "int4"),
                                            ("llama_dynamo", "int8")])
def test_onnxruntime_dequantizes_exactly(fixture, scheme, tmp_path):
    step = tmp_path / "q.onnx"
    build(fixture, scheme, step, tmp_path)
    dq = tmp_path / "dq.onnx"
    names = dequantize_model(step, dq)
    ref = reference(fixture)
    rt = subprocess.run([str(REPO / "scripts" / "setup" / "setup-runtime.sh")], capture_output=True, text=True)
    assert rt.returncode == 0, rt.stderr
    runs = {}
    s = ort.InferenceSession(str(dq), providers=["CPUExecutionProvider"])
    runs[ort.__version__] = dict(zip([o.name for o in s.get_outputs()], s.run(None, {})))
    res = subprocess.run([str(REPO / ".venv-rt" / "bin" / "python"), "-c", DQ_SCRIPT, str(dq), str(tmp_path / "rt.npz")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    runs[res.stdout.strip()] = dict(np.load(tmp_path / "rt.npz"))
    assert set(runs) == {"1.19.2", "1.31.1"}, list(runs)
    for version, got in runs.items():
        for out, module in names.items():
            want = ref[f"{module}/{scheme}/dequantized"].reshape(-1, BLOCK)
            assert got[out].dtype == np.float32
            np.testing.assert_array_equal(got[out].view(np.uint32), want.view(np.uint32),
                                          err_msg=f"onnxruntime {version}: {module}")


def dequantized_model(fixture: str, scheme: str, original, head: bool = False):
    """lora_helpers.torch_model with every quantised weight (head: the LM head too) replaced by
    numpy's dequantised one."""
    ref = reference(fixture)

    def model(fx, dtype=torch.float32):
        m, logits, loss = original(fx, dtype)
        mods = dict(m.named_modules())
        for key in ref:
            name, _, kind = key.partition("/")
            if kind != f"{scheme}/dequantized" or name == "adversarial" or (name == HEAD[lh.fixture_arch(fixture)] and not head):
                continue
            w = torch.from_numpy(ref[key])
            mod = mods[name]
            if type(mod).__name__ == "Conv1D":  # GPT-2's Conv1D stores [in, out]
                w = w.t()
            with torch.no_grad():
                mod.weight.data = w.to(dtype).contiguous()
        return m, logits, loss
    return model


TRAIN_CASES = [("lm_flat", "int8"), ("lm_flat", "int4"), ("gpt2_ts", "int8"), ("llama_dynamo", "int4")]


@pytest.mark.parametrize("fixture,scheme", TRAIN_CASES)
def test_trains_like_peft_on_dequantized_base(fixture, scheme, tmp_path, monkeypatch):
    path = tmp_path / "q.onnx"
    build(fixture, scheme, path, tmp_path)
    monkeypatch.setattr(lh, "torch_model", dequantized_model(fixture, scheme, lh.torch_model))
    lh.assert_trains_like_peft(fixture, path, monkeypatch, scheme)


def numpy_int8(w: np.ndarray) -> np.ndarray:
    """fixtures/generate_int.py's int8 round trip of an [out, in] weight: scale = absmax / 127
    per block of BLOCK along `in`, q = round half to even of w / scale, clipped."""
    blocks = w.astype(np.float32).reshape(-1, BLOCK)
    scale = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    safe = np.where(scale == 0, np.float32(1), scale)
    q = np.clip(np.round(blocks / safe), -127, 127)
    return (q * scale).astype(np.float32).reshape(w.shape)


def test_int8_embedding_and_head_train_like_peft(tmp_path, monkeypatch):
    """int8 blocks may hold the embedding and the LM head too (`--quantize-targets`): the
    embedding's Gather and the fused head's number rows take rows of the codes and scales and
    dequantise only those (rows.rs); 10 AdamW steps equal torch + PEFT on numpy's round trip of
    every quantised weight, embedding and head included."""
    fixture = "llama_dynamo"
    ref = reference(fixture)
    modules = sorted({k.split("/")[0] for k in ref if k.endswith("/int8/codes")} - {"adversarial"})
    path = tmp_path / "q.onnx"
    build(fixture, "int8", path, tmp_path, None, "--quantize-targets", ",".join(modules + ["embed_tokens"]),
          "--fused-head", "on")
    meta = lh.step_meta(path)
    layers = {la["module"]: la for la in meta["quantize_base"]["layers"]}
    g = onnx.load(str(path)).graph
    assert [op for _, op in reads_past_views(g, layers["model.embed_tokens"]["codes"])] == ["Gather"]
    head_reads = reads_past_views(g, layers["lm_head"]["codes"])
    assert ("graph", "Gather") in head_reads, f"the head's number rows dequantised whole: {head_reads}"
    embedding = onnx.numpy_helper.to_array(next(t for t in onnx.load(str(MODELS / f"{fixture}.onnx")).graph.initializer
                                                if t.name == "model.embed_tokens.weight"))
    base = dequantized_model(fixture, "int8", lh.torch_model, head=True)

    def model(fx, dtype=torch.float32):
        m, logits, loss = base(fx, dtype)
        with torch.no_grad():
            m.get_input_embeddings().weight.data = torch.from_numpy(numpy_int8(embedding)).to(dtype)
        return m, logits, loss

    monkeypatch.setattr(lh, "torch_model", model)
    lh.assert_trains_like_peft(fixture, path, monkeypatch, "int8 with the embedding and head")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_onnxruntime_keeps_no_float_copy(scheme, tmp_path):
    out = tmp_path / "q.onnx"
    build("llama_dynamo", scheme, out, tmp_path)
    meta = lh.step_meta(out)["quantize_base"]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"])
    opt = onnx.load(str(tmp_path / "opt.onnx"))
    shapes = {tuple(la["shape"]) for la in meta["layers"]} | {tuple(la["shape"][::-1]) for la in meta["layers"]}
    original = {tuple(t.dims) for t in onnx.load(str(MODELS / "llama_dynamo.onnx")).graph.initializer
                if t.name not in {la["weight"] for la in meta["layers"]}}
    float_copies = [t.name for t in opt.graph.initializer
                    if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
                    and tuple(t.dims) in shapes and tuple(t.dims) not in original]
    assert not float_copies, f"onnxruntime {ort.__version__} folded float copies: {float_copies[:4]}"
    # one dequantisation per reading node: more DequantizeLinear of the codes than weights
    codes = {la["codes"] for la in meta["layers"]}
    dqs = [n for n in opt.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in codes]
    assert len(dqs) > len(meta["layers"]), "per-use dequantisations merged"
    assert {n.input[0] for n in dqs} == codes


@pytest.mark.parametrize("fixture,scheme", [("lm_flat", "int4"), ("gpt2_ts", "int8")])
def test_merged_model_is_the_dequantised_base_plus_the_update(fixture, scheme, tmp_path):
    path = tmp_path / "q.onnx"
    build(fixture, scheme, path, tmp_path)
    meta = lh.step_meta(path)
    runner = StepRunner(path, providers=["CPUExecutionProvider"])
    for x, y in lh.batches(fixture)[:3]:
        runner.step({"input_ids": x, "labels": y})
    params = runner.parameters()
    merged = tmp_path / "merged.onnx"
    runner.save_inference_model(MODELS / f"{fixture}.onnx", merged)
    got = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(merged)).graph.initializer}
    ref = reference(fixture)
    adapters = {la["weight"]: la for la in meta["lora"]["layers"]}
    scaling = float(meta["lora"]["lora_alpha"]) / float(meta["lora"]["r"])
    for la in meta["quantize_base"]["layers"]:
        want = ref[f"{la['module']}/{scheme}/dequantized"].astype(np.float64)
        if la["weight"] in adapters:
            a, b = params[adapters[la["weight"]]["lora_A"]], params[adapters[la["weight"]]["lora_B"]]
            assert np.abs(b).max() > 0, "B trained"
            want = want + scaling * (b.astype(np.float64) @ a.astype(np.float64))
        w = got[la["weight"]].astype(np.float64)
        w = w.T if la["weight_layout"] == "in_out" else w
        np.testing.assert_allclose(w, want, rtol=0, atol=1e-6, err_msg=la["module"])


def test_inspect_names_the_scheme(tmp_path):
    out = tmp_path / "q.onnx"
    build("llama_dynamo", "int8", out, tmp_path)
    meta = lh.step_meta(out)["quantize_base"]
    r = run_patch(["inspect", out])
    assert r.returncode == 0, r.stderr
    assert f"quantised base: int8 in blocks of 16, {len(meta['layers'])} layer(s), " \
           f"{meta['bytes_before']} bytes before, {meta['bytes_after']} after:" in r.stdout
    assert json.loads(run_patch(["inspect", out, "--json"]).stdout)["quantize_base"] == meta


BAD = [
    ("llama_dynamo.onnx", ["--quantize-base", "int4"], "re-export with opset_version=21"),
    ("llama_dynamo.onnx", ["--quantize-base", "int8", "--quant-block", "64"], "does not divide the 32 input features"),
    ("llama_dynamo.onnx", ["--quantize-base", "int8", "--quant-block", "24"], "--quant-block must be a power of two"),
    ("llama_dynamo.onnx", ["--quantize-base", "int8", "--double-quant"], "--double-quant applies to --quantize-base nf4 only"),
    ("llama_dynamo.onnx", ["--quantize-base", "int8", "--quantize-targets", "nope"], "matches no linear layer"),
]


@pytest.mark.parametrize("model,args,needle", BAD)
def test_bad_input(model, args, needle, tmp_path):
    out = tmp_path / "bad.onnx"
    r = run_patch(["step", MODELS / model, "--loss", "wasserstein", "--tokenizer", TOKENIZER,
                   "-o", out, "--lora-r", "4", *args])
    assert r.returncode == 1 and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not list(tmp_path.iterdir())

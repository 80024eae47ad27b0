"""QLoRA step graphs (`ntl-patch step --lora-r R --quantize-base nf4`) against bitsandbytes 0.50.2
and torch + PEFT 0.21.2.

Reference: fixtures/reference/nf4/*.npz, written by fixtures/generate_nf4.py with bitsandbytes'
`quantize_4bit(W, blocksize=64, quant_type="nf4")` / `dequantize_4bit` on every linear weight
(torch's [out, in] order), and the same with `compress_statistics=True` (`--double-quant`, keys
`<module>/dq_*`). Checked, with and without `--double-quant`:
  - the step graph's codes and absmax (double-quant: the absmax' codes, their scales and the
    offset) are bit-equal to bitsandbytes' on the tiny LM and the GPT-2 / Llama fixtures from
    both exporters; every linear layer but the LM head is quantised and no float copy of a
    quantised weight is left among the initializers; the bytes before and after;
  - the graph's own dequantisation chain, run by onnxruntime, gives bitsandbytes' dequantised
    weights bit for bit;
  - 10 AdamW steps of StepRunner equal torch + PEFT (float64) on the model whose quantised
    weights are bitsandbytes' dequantised NF4 weights: 1e-5 relative in the losses, 1e-4
    norm-relative in A and B (test_lora.py's harness and tolerances, lora_helpers.py);
  - onnxruntime's optimised graph (ORT_ENABLE_ALL, the .venv's onnxruntime) holds no float
    initializer of a quantised weight's shape (double-quant: nor of its absmax') that the
    export did not have besides, and one dequantisation per reader;
  - bad input: one line, exit 1, nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import lora_helpers as lh
from conftest import MODELS, REPO, TOKENIZER, run_patch
from step_helpers import reads_past_views

from ntl_patch import StepRunner  # noqa: E402  (lora_helpers put python/ on the path)

NF4 = REPO / "fixtures" / "reference" / "nf4"
FIXTURES = ["lm_flat", "gpt2_ts", "gpt2_dynamo", "llama_ts", "llama_dynamo"]
HEAD = {"tiny": "head", "gpt2": "lm_head", "llama": "lm_head"}


def reference(fixture: str) -> dict[str, np.ndarray]:
    return dict(np.load(NF4 / f"{lh.fixture_arch(fixture)}.npz"))


def build(fixture: str, out: Path, *extra, dq: bool = False) -> dict:
    targets = ["--lora-targets", "q,v,fc1"] if fixture == "lm_flat" else []
    return lh.build_step(fixture, out, "--lora-r", "4", *targets, "--quantize-base", "nf4",
                         *(["--double-quant"] if dq else []), *extra)


DQ = pytest.mark.parametrize("dq", [False, True], ids=["nf4", "nf4-dq"])


def initializers(path: Path) -> dict[str, np.ndarray]:
    m = onnx.load(str(path))
    return {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}


def bits(a: np.ndarray) -> np.ndarray:
    assert a.dtype == np.float32, a.dtype
    return a.reshape(-1).view(np.uint32)


@DQ
@pytest.mark.parametrize("fixture", FIXTURES)
def test_codes_bit_equal_bitsandbytes(fixture, dq, tmp_path):
    out = tmp_path / "q.onnx"
    build(fixture, out, dq=dq)
    meta = lh.step_meta(out)["quantize_base"]
    ref = reference(fixture)
    inits = initializers(out)
    assert meta["quant_type"] == "nf4" and meta["blocksize"] == 64 and meta["double_quant"] == dq
    modules = {la["module"] for la in meta["layers"]}
    all_linear = {k.rsplit("/", 1)[0] for k in ref if not k.startswith(("adversarial/", "dq/"))}
    assert modules == all_linear - {HEAD[lh.fixture_arch(fixture)]}, "every linear layer but the head"
    after = 0
    for la in meta["layers"]:
        m = la["module"]
        np.testing.assert_array_equal(inits[la["codes"]], ref[f"{m}/codes"], err_msg=m)
        blocks = la["shape"][0] * la["shape"][1] // 64
        if dq:  # the absmax' codes (bitsandbytes' nested QuantState.absmax), scales, offset
            assert inits[la["absmax"]].dtype == np.uint8
            np.testing.assert_array_equal(inits[la["absmax"]], ref[f"{m}/dq_absmax_codes"], err_msg=m)
            np.testing.assert_array_equal(bits(inits[la["absmax_scales"]]), bits(ref[f"{m}/dq_absmax_scales"]),
                                          err_msg=m)
            assert inits[la["absmax_scales"]].shape == (-(-blocks // 256), 1)
            assert inits[la["absmax_offset"]].shape == ()
            assert bits(inits[la["absmax_offset"]]) == bits(ref[f"{m}/dq_offset"]), m
            assert not any(n.endswith(f"{la['weight']}.absmax") for n in inits), "no float32 absmax stored"
            after += blocks * 32 + blocks + 4 * -(-blocks // 256) + 4
        else:
            np.testing.assert_array_equal(bits(inits[la["absmax"]]), bits(ref[f"{m}/absmax"]), err_msg=m)
            assert "absmax_scales" not in la and "absmax_offset" not in la
            after += blocks * 32 + blocks * 4
        assert la["weight"] not in inits, "the float weight is gone"
    assert meta["bytes_after"] == after
    assert meta["bytes_before"] == sum(la["shape"][0] * la["shape"][1] * 4 for la in meta["layers"])
    if dq:
        assert meta["absmax_blocksize"] == 256
        np.testing.assert_array_equal(bits(np.asarray(meta["absmax_code"], np.float32)), bits(ref["dq/code"]))
    else:
        assert "absmax_code" not in meta and "absmax_blocksize" not in meta


def activation_waited_for(wait: onnx.NodeProto, produced: dict) -> str:
    """The activation x of `Builder::after`'s `Reshape(t, Where(Cast(Gather(Reshape(x, [-1]), [0])), s, s))`."""
    where = produced[wait.input[1]]
    assert where.op_type == "Where", where.op_type
    cast = produced[where.input[0]]
    gather = produced[cast.input[0]]
    flat = produced[gather.input[0]]
    assert (cast.op_type, gather.op_type, flat.op_type) == ("Cast", "Gather", "Reshape")
    return flat.input[0]


def chain_model(step: onnx.ModelProto, codes: str) -> tuple[onnx.ModelProto, str, bool]:
    """One per-use copy of a weight's dequantisation in the step graph, as a model: every node
    from the stored tensors to the copy's float weight, the activation it waits for (its reads
    of stored tensors go through `Reshape(t, Where(c(x), Shape(t), Shape(t)))`) a graph input.
    Returns the model, its activation input and whether the copy ends transposed (a joined
    Transpose)."""
    nodes = list(step.graph.node)
    produced = {o: n for n in nodes for o in n.output}
    readers = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    start = next(n for n in readers[codes] if n.op_type == "Reshape")
    like = activation_waited_for(start, produced)
    t, transposed = start.output[0], False
    while len(readers.get(t, [])) == 1 and readers[t][0].op_type in ("Cast", "Gather", "Reshape", "Mul", "Transpose"):
        n = readers[t][0]
        transposed ^= n.op_type == "Transpose"
        t = n.output[0]
    inits = {i.name: i for i in step.graph.initializer}
    keep, todo, used = [], [t], []
    seen = set()
    while todo:
        x = todo.pop()
        if x in seen or x == like or x not in produced:
            if x in inits and x not in seen:
                used.append(inits[x])
            seen.add(x)
            continue
        seen.add(x)
        keep.append(produced[x])
        todo.extend(i for i in produced[x].input if i)
    order = {id(n): k for k, n in enumerate(nodes)}
    keep.sort(key=lambda n: order[id(n)])
    g = onnx.helper.make_graph(keep, "chain", [onnx.helper.make_tensor_value_info(like, onnx.TensorProto.FLOAT, None)],
                               [onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None)], used)
    return onnx.helper.make_model(g, opset_imports=list(step.opset_import), ir_version=step.ir_version), like, transposed


@DQ
@pytest.mark.parametrize("fixture", ["lm_flat", "gpt2_ts", "llama_dynamo"])
def test_graph_dequantises_as_bitsandbytes(fixture, dq, tmp_path):
    """The step graph's own chain (one per-use copy a weight, run by onnxruntime) gives
    bitsandbytes' dequantised weights bit for bit: `dequantize_4bit` with the nested state for
    --double-quant, the plain one without."""
    out = tmp_path / "q.onnx"
    build(fixture, out, dq=dq)
    meta = lh.step_meta(out)["quantize_base"]
    ref = reference(fixture)
    step = onnx.load(str(out))
    for la in meta["layers"]:
        model, _, transposed = chain_model(step, la["codes"])
        if dq:
            assert sum(n.op_type == "Where" for n in model.graph.node) == 2, "the absmax' chain is per use too"
        s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        (w,) = s.run(None, {s.get_inputs()[0].name: np.zeros((1,), np.float32)})
        w = w.T if transposed else w
        want = ref[f"{la['module']}/{'dq_' if dq else ''}dequantized"]
        np.testing.assert_array_equal(bits(np.ascontiguousarray(w)), bits(want), err_msg=la["module"])


def dequantized_model(fixture: str, original, dq: bool = False, head: bool = False):
    """lora_helpers.torch_model with every quantised weight replaced by bitsandbytes' dequantised one
    (dq: dequantised with the nested state, `compress_statistics=True`; head: the LM head too)."""
    ref = reference(fixture)
    wanted = "dq_dequantized" if dq else "dequantized"

    def model(fx, dtype=torch.float32):
        m, logits, loss = original(fx, dtype)
        mods = dict(m.named_modules())
        for key in ref:
            name, _, kind = key.rpartition("/")
            if kind != wanted or (name == HEAD[lh.fixture_arch(fixture)] and not head) or name == "adversarial":
                continue
            w = torch.from_numpy(ref[key])
            mod = mods[name]
            if type(mod).__name__ == "Conv1D":  # GPT-2's Conv1D stores [in, out]
                w = w.t()
            with torch.no_grad():
                mod.weight.data = w.to(dtype).contiguous()
        return m, logits, loss
    return model


CASES = {"tiny": "lm_flat", "gpt2_ts": "gpt2_ts", "llama_dynamo": "llama_dynamo",
         "llama_ts": "llama_ts", "gpt2_dynamo": "gpt2_dynamo"}


def trains_like_peft(fixture: str, path: Path, dq: bool, monkeypatch, head: bool = False) -> None:
    """10 AdamW steps of the step graph at `path` equal torch + PEFT (float64) on the model whose
    quantised weights are bitsandbytes' dequantised ones, from the same initial A."""
    monkeypatch.setattr(lh, "torch_model", dequantized_model(fixture, lh.torch_model, dq, head))
    lh.assert_trains_like_peft(fixture, path, monkeypatch)


@pytest.mark.parametrize("case,dq", [(c, False) for c in CASES] + [(c, True) for c in ("tiny", "gpt2_ts", "llama_dynamo")],
                         ids=[c for c in CASES] + [f"{c}-dq" for c in ("tiny", "gpt2_ts", "llama_dynamo")])
def test_trains_like_peft_on_dequantized_base(case, dq, tmp_path, monkeypatch):
    fixture = CASES[case]
    path = tmp_path / "q.onnx"
    build(fixture, path, dq=dq)
    trains_like_peft(fixture, path, dq, monkeypatch)


def linear_modules(fixture: str) -> list[str]:
    """The fixture's linear layers (bitsandbytes' reference names them), the head included."""
    return sorted({k.rpartition("/")[0] for k in reference(fixture) if k.endswith("/codes")} - {"adversarial"})


def train(path: Path, fixture: str) -> tuple[np.ndarray, dict]:
    runner = StepRunner(path, providers=["CPUExecutionProvider"])
    losses = np.array([runner.step({"input_ids": x, "labels": y})[0] for x, y in lh.batches(fixture)])
    return losses, runner.parameters()


@DQ
@pytest.mark.parametrize("fixture", ["lm_flat", "llama_dynamo"])
def test_quantised_head_gathers_its_rows(fixture, dq, tmp_path):
    """With the LM head quantised too (`--quantize-targets` naming it, blocks of 16 that divide
    the fixtures' widths), the fused head's Gather of the number rows takes those rows of the
    codes and absmax and dequantises them alone, instead of a whole float copy of the head; it
    trains as the same graph with the head unfused, whose MatMuls dequantise it whole."""
    targets = ["--quantize-targets", ",".join(linear_modules(fixture)), "--quant-block", "16"]
    fused, dense = tmp_path / "fused.onnx", tmp_path / "dense.onnx"
    build(fixture, fused, *targets, "--fused-head", "on", dq=dq)
    build(fixture, dense, *targets, "--fused-head", "off", dq=dq)
    meta = lh.step_meta(fused)
    head = next(la for la in meta["quantize_base"]["layers"] if la["module"] == HEAD[lh.fixture_arch(fixture)])
    reads = [op for _, op in reads_past_views(onnx.load(str(fused)).graph, head["codes"])]
    assert reads.count("Gather") == 1, f"the number rows are not gathered from the codes: {reads}"
    (got, got_params), (want, want_params) = train(fused, fixture), train(dense, fixture)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for n in want_params:
        assert lh.norm_rel(got_params[n], want_params[n]) <= 1e-5, n


def bnb_dequantized_model(fixture: str, original, meta: dict):
    """lora_helpers.torch_model with every weight the step graph quantised (embeddings
    included) replaced by bitsandbytes' NF4 round trip at the graph's block size, from the
    fixture's own float32 weights (`bnb_quantize_nf4`, the port checked against bitsandbytes)."""
    source = initializers(MODELS / f"{fixture}.onnx")
    code = torch.tensor(meta["code"], dtype=torch.float32)
    wanted = {}
    for la in meta["layers"]:
        w = out_in(source[la["weight"]], la)
        packed, absmax = bnb_quantize_nf4(w, meta["code"], meta["blocksize"])
        q = torch.from_numpy(np.stack([packed >> 4, packed & 15], axis=1).reshape(-1).astype(np.int64))
        blocks = code[q].reshape(-1, meta["blocksize"]) * torch.from_numpy(absmax).reshape(-1, 1)
        wanted[la["module"]] = blocks.reshape(w.shape)

    def model(fx, dtype=torch.float32):
        m, logits, loss = original(fx, dtype)
        mods = dict(m.named_modules())
        for name, w in wanted.items():
            with torch.no_grad():
                mods[name].weight.data = w.to(dtype).contiguous()
        return m, logits, loss
    return model


def test_quantised_embedding_and_head_train_like_peft(tmp_path, monkeypatch):
    """`--quantize-targets` may name the embedding (and the LM head): its table is stored in
    NF4 and the embedding's Gather dequantises only the rows it takes (rows.rs). 10 AdamW steps
    equal torch + PEFT on the model whose quantised weights, embedding and head included, are
    bitsandbytes' NF4 round trip."""
    fixture = "llama_dynamo"
    path = tmp_path / "q.onnx"
    targets = ",".join(linear_modules(fixture) + ["embed_tokens"])
    build(fixture, path, "--quantize-targets", targets, "--quant-block", "16", "--fused-head", "on")
    meta = lh.step_meta(path)["quantize_base"]
    embedding = next(la for la in meta["layers"] if la["module"] == "model.embed_tokens")
    reads = [op for _, op in reads_past_views(onnx.load(str(path)).graph, embedding["codes"])]
    assert reads == ["Gather"], f"the embedding's codes are not read by rows: {reads}"
    monkeypatch.setattr(lh, "torch_model", bnb_dequantized_model(fixture, lh.torch_model, meta))
    lh.assert_trains_like_peft(fixture, path, monkeypatch)


@DQ
@pytest.mark.parametrize("fixture", ["lm_flat", "gpt2_ts", "llama_dynamo"])
def test_merged_model_is_the_dequantised_base_plus_the_update(fixture, dq, tmp_path):
    """save_inference_model on a QLoRA graph merges into the base the step trained on (bitsandbytes'
    dequantised weights, as merge_and_unload() on a 4-bit base), not into the original float one."""
    path = tmp_path / "q.onnx"
    build(fixture, path, dq=dq)
    meta = lh.step_meta(path)
    runner = StepRunner(path, providers=["CPUExecutionProvider"])
    for x, y in lh.batches(fixture)[:3]:
        runner.step({"input_ids": x, "labels": y})
    params = runner.parameters()
    merged = tmp_path / "merged.onnx"
    runner.save_inference_model(MODELS / f"{fixture}.onnx", merged)
    got = initializers(merged)
    ref = reference(fixture)
    adapters = {la["weight"]: la for la in meta["lora"]["layers"]}
    scaling = float(meta["lora"]["lora_alpha"]) / float(meta["lora"]["r"])  # no rsLoRA here
    for la in meta["quantize_base"]["layers"]:
        want = ref[f"{la['module']}/{'dq_' if dq else ''}dequantized"].astype(np.float64)  # [out, in]
        if la["weight"] in adapters:
            a, b = params[adapters[la["weight"]]["lora_A"]], params[adapters[la["weight"]]["lora_B"]]
            assert np.abs(b).max() > 0, "B trained"
            want = want + scaling * (b.astype(np.float64) @ a.astype(np.float64))
        w = got[la["weight"]].astype(np.float64)
        w = w.T if la["weight_layout"] == "in_out" else w
        np.testing.assert_allclose(w, want, rtol=0, atol=1e-6, err_msg=la["module"])


def test_data_parallel_merges_into_the_dequantised_base_too(tmp_path):
    """DataParallel (one process) on the split QLoRA graphs writes the same merged model as
    StepRunner on the whole step graph after the same steps: the base it trained on."""
    from ntl_patch import DataParallel
    whole, split = tmp_path / "whole" / "q.onnx", tmp_path / "split" / "q.onnx"
    whole.parent.mkdir()
    split.parent.mkdir()
    build("gpt2_ts", whole)
    build("gpt2_ts", split, "--split")
    runner = StepRunner(whole, providers=["CPUExecutionProvider"])
    dp = DataParallel(split, providers=["CPUExecutionProvider"])
    for x, y in lh.batches("gpt2_ts")[:2]:
        runner.step({"input_ids": x, "labels": y})
        dp.step({"input_ids": x, "labels": y})
    runner.save_inference_model(MODELS / "gpt2_ts.onnx", tmp_path / "runner.onnx")
    dp.save_inference_model(MODELS / "gpt2_ts.onnx", tmp_path / "dp.onnx")
    want, got = initializers(tmp_path / "runner.onnx"), initializers(tmp_path / "dp.onnx")
    ref = reference("gpt2_ts")
    meta = lh.step_meta(whole)["quantize_base"]
    assert want.keys() == got.keys()
    for la in meta["layers"]:
        w = got[la["weight"]]
        w = w.T if la["weight_layout"] == "in_out" else w
        # not the original float weight: the dequantised one plus the update
        assert np.abs(w - ref[f"{la['module']}/dequantized"]).max() < 1e-2, la["module"]
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6, err_msg=name)


@DQ
def test_inspect_lists_the_quantised_layers(dq, tmp_path):
    out, plain = tmp_path / "q.onnx", tmp_path / "lora.onnx"
    build("llama_dynamo", out, dq=dq)
    lh.build_step("llama_dynamo", plain, "--lora-r", "4")
    meta = lh.step_meta(out)["quantize_base"]
    r = run_patch(["inspect", out])
    assert r.returncode == 0, r.stderr
    head = f"quantised base: nf4 in blocks of 64{' (double quantisation)' if dq else ''}, " \
           f"{len(meta['layers'])} layer(s), {meta['bytes_before']} bytes before, {meta['bytes_after']} after:"
    assert head in r.stdout
    numel = sum(la["shape"][0] * la["shape"][1] for la in meta["layers"])
    blocks = [la["shape"][0] * la["shape"][1] // 64 for la in meta["layers"]]
    statistics = sum(b + 4 * -(-b // 256) + 4 for b in blocks) if dq else 4 * sum(blocks)
    assert meta["bytes_after"] == numel // 2 + statistics, "the codes and the (quantised) absmax"
    for la in meta["layers"]:
        assert f"  {la['module']} <- {la['weight']} [{la['shape'][0]} x {la['shape'][1]}]" in r.stdout
    j = json.loads(run_patch(["inspect", out, "--json"]).stdout)
    got = j["quantize_base"]  # the code tables re-printed by serde_json: equal to float32 precision
    np.testing.assert_allclose(got.pop("code"), meta.pop("code"), rtol=1e-15)
    if dq:
        np.testing.assert_allclose(got.pop("absmax_code"), meta.pop("absmax_code"), rtol=1e-15)
    assert got == meta
    assert "quantize_base" not in json.loads(run_patch(["inspect", plain, "--json"]).stdout)
    assert "quantised base" not in run_patch(["inspect", plain]).stdout


@DQ
def test_onnxruntime_keeps_no_float_copy(dq, tmp_path):
    out = tmp_path / "q.onnx"
    build("llama_dynamo", out, dq=dq)
    meta = lh.step_meta(out)["quantize_base"]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"])
    opt = onnx.load(str(tmp_path / "opt.onnx"))
    shapes = {tuple(la["shape"]) for la in meta["layers"]} | {tuple(la["shape"][::-1]) for la in meta["layers"]}
    absmax_shapes = set()
    if dq:  # a folded float32 absmax: [blocks, 1], [blocks], or padded to whole blocks of 256
        for la in meta["layers"]:
            b = la["shape"][0] * la["shape"][1] // 64
            absmax_shapes |= {(b, 1), (b,), (-(-b // 256), 256), (-(-b // 256) * 256, 1), (-(-b // 256) * 256,)}
    original = {tuple(t.dims) for t in onnx.load(str(MODELS / "llama_dynamo.onnx")).graph.initializer
                if t.name not in {la["weight"] for la in meta["layers"]}}
    float_copies = [t.name for t in opt.graph.initializer
                    if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
                    and tuple(t.dims) in shapes and tuple(t.dims) not in original]
    stored = {t.name for t in onnx.load(str(out)).graph.initializer}  # the dynamic map is [256]
    float_copies += [t.name for t in opt.graph.initializer
                     if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
                     and tuple(t.dims) in absmax_shapes and t.name not in stored]
    assert not float_copies, f"onnxruntime {ort.__version__} folded float copies: {float_copies[:4]}"
    # one dequantisation per reading node: as many Gathers from the code-pair table as readers
    gathers = [n for n in opt.graph.node if n.op_type == "Gather" and "nf4_pairs" in n.input[0]]
    assert len(gathers) > len(meta["layers"]), "per-use dequantisations merged"
    absmax_gathers = [n for n in opt.graph.node if n.op_type == "Gather" and "dynamic_map" in n.input[0]]
    assert len(absmax_gathers) == (len(gathers) if dq else 0), "one absmax dequantisation per weight's"


@pytest.mark.parametrize("extra", [[], ["--double-quant"], ["--recompute", "layers"],
                                   ["--double-quant", "--recompute", "layers"]],
                         ids=["nf4", "nf4-dq", "nf4-recompute", "nf4-dq-recompute"])
def test_dequantisation_waits_for_its_reader(extra, tmp_path):
    """In onnxruntime's optimised graph every node that reads the stored codes or scales (a
    Shape aside) also reads something computed from the batch, so no order can run a
    dequantisation before its reader's activation exists. A chain of stored tensors alone ran
    at the start of the step in the PRIORITY_BASED order StepRunner uses for --recompute: every
    weight's float32 copy at once (the Qwen2-7B shape passed 22 GiB; with the wait, 8.5 GiB)."""
    out = tmp_path / "q.onnx"
    lh.build_step("llama_dynamo", out, "--lora-r", "4", "--quantize-base", "nf4", *extra)
    meta = lh.step_meta(out)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"])
    g = onnx.load(str(tmp_path / "opt.onnx")).graph
    stored = {t for la in meta["quantize_base"]["layers"] for k, t in la.items()
              if k in ("codes", "absmax", "absmax_codes", "absmax_scales")}
    data, grew = set(meta["data_inputs"]), True
    while grew:  # computed from the batch, whatever order the file keeps
        grew = False
        for n in g.node:
            if any(i in data for i in n.input) and not set(n.output) <= data:
                data |= set(n.output)
                grew = True
    early = [f"{n.op_type} {n.name}" for n in g.node if n.op_type != "Shape"
             and any(i in stored for i in n.input) and not any(i in data for i in n.input)]
    assert stored and not early, f"onnxruntime {ort.__version__}: reads of stored tensors alone: {early[:4]}"


BAD = [
    (["--lora-r", "4", "--quantize-base", "fp8"], "invalid value"),
    (["--lora-r", "4", "--quantize-base", "nf4", "--quant-block", "48"], "--quant-block"),
    (["--lora-r", "4", "--quantize-base", "nf4", "--quant-block", "8"], "--quant-block"),
    (["--lora-r", "4", "--quantize-base", "nf4", "--quant-block", "4096"], "does not divide"),
    (["--quantize-base", "nf4"], "add --lora-r"),
    (["--lora-r", "4", "--quant-block", "64"], "--quantize-base"),
    (["--lora-r", "4", "--quantize-base", "nf4", "--quantize-targets", "nope"], "matches no linear layer"),
    (["--lora-r", "4", "--quantize-base", "int4"], "re-export with opset_version=21"),
    (["--lora-r", "4", "--double-quant"], "add --quantize-base nf4"),
]


@pytest.mark.parametrize("args,needle", BAD)
def test_bad_input(args, needle, tmp_path):
    out = tmp_path / "bad.onnx"
    r = run_patch(["step", MODELS / "llama_dynamo.onnx", "--loss", "wasserstein", "--tokenizer", TOKENIZER,
                   "-o", out, *args])
    assert r.returncode != 0 and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_patch_command_refuses_quantize_base(tmp_path):
    r = run_patch([MODELS / "lm_flat.onnx", "--tokenizer", TOKENIZER, "-o", tmp_path / "p.onnx",
                   "--quantize-base", "nf4"])
    assert r.returncode != 0 and "--quantize-base" in r.stderr
    assert not list(tmp_path.iterdir())


def bnb_quantize_nf4(w: torch.Tensor, code, block: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """bitsandbytes 0.50.2's quantize_4bit(quant_type="nf4") as its CPU backend runs it
    (backends/default/ops.py): the weight widened with `.float()` (a half weight exactly),
    per block absmax, scaled, clamped, bucketised on the midpoints of the code values, two
    codes a byte. Checked against bitsandbytes' own codes below before it is used."""
    code = torch.tensor(code, dtype=torch.float32)
    bounds = (code[:-1] + code[1:]) / 2
    a = w.reshape(-1).float().reshape(-1, block)
    absmax = a.abs().max(dim=-1)[0]
    scaled = torch.clamp(a * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    q = torch.bucketize(scaled, bounds, out_int32=True).to(torch.uint8)
    return ((q[::2] << 4) | q[1::2]).numpy(), absmax.numpy()


def out_in(w: np.ndarray, layer: dict) -> torch.Tensor:
    """A stored weight in torch's [out, in] order."""
    t = torch.from_numpy(np.array(w))
    return t if layer["weight_layout"] == "out_in" else t.T.contiguous()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_export_in_external_data(dtype, tmp_path):
    """A float16/bfloat16 export whose weights are external data (how large models are
    exported): the codes and absmax are bitsandbytes' of the half weights, the codes go to a
    data file beside the step graph (`<out>.qlora.data`), the bytes before count 2 a value, and
    StepRunner trains it."""
    from precision_helpers import as_f32, half_export

    # the port above is bitsandbytes on the float32 fixture
    out32 = tmp_path / "f32.onnx"
    build("lm_flat", out32)
    meta32 = lh.step_meta(out32)["quantize_base"]
    source32, ref = initializers(MODELS / "lm_flat.onnx"), reference("lm_flat")
    for la in meta32["layers"]:
        codes, absmax = bnb_quantize_nf4(out_in(source32[la["weight"]], la), meta32["code"])
        np.testing.assert_array_equal(codes, ref[f"{la['module']}/codes"], err_msg=la["module"])
        np.testing.assert_array_equal(bits(absmax), bits(ref[f"{la['module']}/absmax"]), err_msg=la["module"])

    inline = tmp_path / "inline.onnx"
    half_export(inline, dtype)
    half = tmp_path / "half" / "m.onnx"
    half.parent.mkdir()
    onnx.save_model(onnx.load(str(inline)), str(half), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.data", size_threshold=0)
    out = tmp_path / "out" / "q.onnx"
    out.parent.mkdir()
    lh.build_step_from(half, out, "--lora-r", "4", "--lora-targets", "q,v,fc1", "--quantize-base", "nf4",
                       "--precision", "fp32", "--copy-external-data")
    assert (out.parent / "q.qlora.data").is_file(), sorted(p.name for p in out.parent.iterdir())
    meta = lh.step_meta(out)["quantize_base"]
    stored = {t.name: t for t in onnx.load(str(half)).graph.initializer}
    inits = initializers(out)
    step = onnx.load(str(out), load_external_data=False)
    external = {t.name for t in step.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    assert meta["layers"]
    for la in meta["layers"]:
        w = out_in(as_f32(stored[la["weight"]]), la).to(dtype)  # exact: the stored half values
        codes, absmax = bnb_quantize_nf4(w, meta["code"])
        np.testing.assert_array_equal(inits[la["codes"]], codes, err_msg=la["module"])
        np.testing.assert_array_equal(bits(inits[la["absmax"]]), bits(absmax), err_msg=la["module"])
        assert {la["codes"], la["absmax"]} <= external, "the codes and absmax live in the data file"
    assert meta["bytes_before"] == sum(la["shape"][0] * la["shape"][1] * 2 for la in meta["layers"])
    runner = StepRunner(out, providers=["CPUExecutionProvider"])
    losses = [float(runner.step(dict(zip(runner.data_inputs, b)))[0]) for b in lh.batches("lm_flat", 3)]
    assert all(np.isfinite(losses)), losses

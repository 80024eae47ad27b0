"""python/ntl_patch: StepRunner runs a step graph (docs/STEP_GRAPH.md) with plain onnxruntime.

Until `ntl-patch step` writes real ones, the step graph here is hand-made with onnx.helper and
follows the contract: a linear model `pred = x·W + b`, ce_loss = mean((pred − y)²),
number_loss = mean(|pred − y|), total = ce + λ·number, analytic gradients and plain SGD, state
inputs with initializer defaults, `ntl/next/...` outputs and `ntl_step` metadata. Checked:
- 5 steps equal a numpy re-implementation, with the default lr and with step(lr=...);
- state_dict / parameters / load_state_dict (resume gives the same trajectory);
- save_inference_model: the initializers equal runner.parameters(), every other field is kept
  (protos compared with the data cleared; byte-identical when nothing changed), external data
  becomes inline, type/shape mismatches and missing initializers are refused, atomic writes;
- errors: missing/extra batch keys, wrong dtype, a graph without `ntl_step` metadata;
- the same run in .venv-rt (onnxruntime 1.31 + numpy, no torch, no onnx) gives the same losses,
  state and inference-model bytes;
- with a built `ntl-patch` that has the `step` command: a real step graph of a fixture trains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import MODELS, REPO, TOKENIZER, patch_command

sys.path.insert(0, str(REPO / "python"))
from ntl_patch import StepRunner  # noqa: E402
from ntl_patch import _onnx_decode, _onnx_rewrite  # noqa: E402

LAMBDA = 0.3
LR = 0.1
RNG = np.random.default_rng(7)
W0 = RNG.standard_normal((3, 2)).astype(np.float32)
B0 = RNG.standard_normal(2).astype(np.float32)


def _step_model(with_metadata: bool = True) -> onnx.ModelProto:
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["pred"]),
        helper.make_node("Sub", ["pred", "y"], ["diff"]),
        helper.make_node("Mul", ["diff", "diff"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["ce_loss"], keepdims=0),
        helper.make_node("Abs", ["diff"], ["absdiff"]),
        helper.make_node("ReduceMean", ["absdiff"], ["number_loss"], keepdims=0),
        helper.make_node("Mul", ["number_loss", "lambda"], ["weighted"]),
        helper.make_node("Add", ["ce_loss", "weighted"], ["loss"]),
        # d total / d pred = (2·diff + λ·sign(diff)) / numel
        helper.make_node("Shape", ["diff"], ["shape"]),
        helper.make_node("ReduceProd", ["shape"], ["numel_i"], keepdims=0),
        helper.make_node("Cast", ["numel_i"], ["numel"], to=f),
        helper.make_node("Mul", ["diff", "two"], ["d_ce"]),
        helper.make_node("Sign", ["diff"], ["sign"]),
        helper.make_node("Mul", ["sign", "lambda"], ["d_num"]),
        helper.make_node("Add", ["d_ce", "d_num"], ["d_sum"]),
        helper.make_node("Div", ["d_sum", "numel"], ["g_pred"]),
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
        helper.make_node("MatMul", ["xt", "g_pred"], ["g_W"]),
        helper.make_node("ReduceSum", ["g_pred", "axis0"], ["g_b"], keepdims=0),
        # SGD
        helper.make_node("Mul", ["g_W", "ntl/lr"], ["u_W"]),
        helper.make_node("Sub", ["W", "u_W"], ["ntl/next/W"]),
        helper.make_node("Mul", ["g_b", "ntl/lr"], ["u_b"]),
        helper.make_node("Sub", ["b", "u_b"], ["ntl/next/b"]),
        helper.make_node("Add", ["ntl/state/step", "one"], ["ntl/next/ntl/state/step"]),
    ]
    inputs = [
        helper.make_tensor_value_info("x", f, ["N", 3]),
        helper.make_tensor_value_info("y", f, ["N", 2]),
        helper.make_tensor_value_info("W", f, [3, 2]),
        helper.make_tensor_value_info("b", f, [2]),
        helper.make_tensor_value_info("ntl/state/step", TensorProto.INT64, []),
        helper.make_tensor_value_info("ntl/lr", f, []),
    ]
    outputs = [
        helper.make_tensor_value_info("loss", f, []),
        helper.make_tensor_value_info("ce_loss", f, []),
        helper.make_tensor_value_info("number_loss", f, []),
        helper.make_tensor_value_info("ntl/next/W", f, [3, 2]),
        helper.make_tensor_value_info("ntl/next/b", f, [2]),
        helper.make_tensor_value_info("ntl/next/ntl/state/step", TensorProto.INT64, []),
    ]
    inits = [
        numpy_helper.from_array(W0, "W"),
        numpy_helper.from_array(B0, "b"),
        numpy_helper.from_array(np.array(0, np.int64), "ntl/state/step"),
        numpy_helper.from_array(np.array(LR, np.float32), "ntl/lr"),
        numpy_helper.from_array(np.array(LAMBDA, np.float32), "lambda"),
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
    ]
    graph = helper.make_graph(nodes, "linear_step", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    if with_metadata:
        meta = {
            "state": [["W", "ntl/next/W"], ["b", "ntl/next/b"],
                      ["ntl/state/step", "ntl/next/ntl/state/step"]],
            "parameters": ["W", "b"], "frozen": [], "buffers": [],
            "optimizer": {"name": "sgd", "lr": LR, "beta1": None, "beta2": None, "eps": None,
                          "weight_decay": 0.0, "momentum": 0.0, "max_grad_norm": None},
            "lr_input": "ntl/lr", "losses": ["loss", "ce_loss", "number_loss"],
            "data_inputs": ["x", "y"],
        }
        helper.set_model_props(model, {"ntl_step": json.dumps(meta)})
    onnx.checker.check_model(model, full_check=True)
    return model


def _inference_model(float_data_bias: bool = True) -> onnx.ModelProto:
    """A logits-only model holding W and b (b in float_data, W with a doc_string), plus
    initializers that are no parameters and model-level fields that must survive."""
    f = TensorProto.FLOAT
    w = numpy_helper.from_array(W0, "W")
    w.doc_string = "the weight"
    if float_data_bias:
        b = helper.make_tensor("b", f, [2], B0.tolist())  # float_data, not raw_data
    else:
        b = numpy_helper.from_array(B0, "b")
    scale = numpy_helper.from_array(np.array([1.5], np.float32), "scale")
    idx = numpy_helper.from_array(np.array([1, 0], np.int64), "perm")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"], name="mm"),
             helper.make_node("Add", ["xw", "b"], ["pre"], name="add"),
             helper.make_node("Mul", ["pre", "scale"], ["scaled"], name="mul"),
             helper.make_node("Gather", ["scaled", "perm"], ["logits"], axis=1, name="swap")]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", f, ["N", 3])],
                              [helper.make_tensor_value_info("logits", f, ["N", 2])],
                              [scale, w, idx, b], doc_string="graph doc")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8,
                              producer_name="test_runner", doc_string="model doc")
    helper.set_model_props(model, {"kept": "yes"})
    onnx.checker.check_model(model)
    return model


def _batches(n: int = 5) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(11)
    return [{"x": rng.standard_normal((4, 3)).astype(np.float32),
             "y": rng.standard_normal((4, 2)).astype(np.float32)} for _ in range(n)]


def _numpy_steps(batches, lrs):
    """The reference: float64 numpy of the same losses, gradients and SGD."""
    w, b = W0.astype(np.float64), B0.astype(np.float64)
    losses = []
    for batch, lr in zip(batches, lrs):
        x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
        diff = x @ w + b - y
        ce, num = np.mean(diff ** 2), np.mean(np.abs(diff))
        losses.append((ce + LAMBDA * num, ce, num))
        g = (2 * diff + LAMBDA * np.sign(diff)) / diff.size
        w, b = w - lr * (x.T @ g), b - lr * g.sum(0)
    return losses, {"W": w, "b": b}


@pytest.fixture(scope="module")
def step_graph(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("step") / "linear.step.onnx"
    onnx.save(_step_model(), path)
    return path


def test_five_steps_match_numpy(step_graph):
    runner = StepRunner(step_graph, providers=["CPUExecutionProvider"])
    assert runner.steps_taken == 0
    init = runner.state_dict()
    np.testing.assert_array_equal(init["W"], W0)
    np.testing.assert_array_equal(init["b"], B0)
    assert init["ntl/state/step"] == 0 and init["ntl/state/step"].dtype == np.int64
    batches = _batches()
    got = [runner.step(b) for b in batches]
    want, params = _numpy_steps(batches, [LR] * 5)
    assert all(isinstance(v, float) for g in got for v in g)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert runner.steps_taken == 5
    state = runner.state_dict()
    assert state["ntl/state/step"] == 5
    for name in ("W", "b"):
        np.testing.assert_allclose(runner.parameters()[name], params[name], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(state[name], runner.parameters()[name])
    assert set(runner.parameters()) == {"W", "b"}


def test_lr_argument(step_graph):
    lrs = [0.05, 0.2, 0.0, 0.1, 0.3]
    runner = StepRunner(step_graph, providers=["CPUExecutionProvider"])
    batches = _batches()
    got = [runner.step(b, lr=lr) for b, lr in zip(batches, lrs)]
    want, params = _numpy_steps(batches, lrs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(runner.parameters()["W"], params["W"], rtol=1e-5, atol=1e-6)
    # lr only for one step: the next step without lr uses the graph's default again
    runner2 = StepRunner(step_graph, providers=["CPUExecutionProvider"])
    got2 = [runner2.step(batches[0], lr=0.3), runner2.step(batches[1])]
    want2, _ = _numpy_steps(batches[:2], [0.3, LR])
    np.testing.assert_allclose(got2, want2, rtol=1e-5, atol=1e-6)


def test_state_is_a_copy_and_resume(step_graph):
    batches = _batches(6)
    runner = StepRunner(step_graph, providers=["CPUExecutionProvider"])
    for b in batches[:3]:
        runner.step(b)
    ckpt = runner.state_dict()
    ckpt["W"][...] = 123.0  # mutating the host copy must not touch the runner's state
    assert not np.any(runner.parameters()["W"] == 123.0)
    ckpt = runner.state_dict()
    rest = [runner.step(b) for b in batches[3:]]

    resumed = StepRunner(step_graph, providers=["CPUExecutionProvider"])
    resumed.load_state_dict(ckpt)
    assert resumed.steps_taken == 3
    assert [resumed.step(b) for b in batches[3:]] == rest
    for k, v in runner.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[k], v)
    with pytest.raises(ValueError, match="missing"):
        resumed.load_state_dict({"W": ckpt["W"]})
    with pytest.raises(ValueError, match=r"state\['W'\]"):
        resumed.load_state_dict({**ckpt, "W": np.zeros((2, 3), np.float32)})


def _cleared(model: onnx.ModelProto) -> bytes:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        t.ClearField("raw_data")
        t.ClearField("float_data")
    return m.SerializeToString()


def test_save_inference_model(step_graph, tmp_path):
    original = tmp_path / "linear.onnx"
    onnx.save(_inference_model(), original)
    before = original.read_bytes()
    runner = StepRunner(step_graph, providers=["CPUExecutionProvider"])
    for b in _batches():
        runner.step(b)
    out = tmp_path / "out" / "trained.onnx"
    out.parent.mkdir()
    assert runner.save_inference_model(original, out) == out
    assert original.read_bytes() == before
    assert sorted(os.listdir(out.parent)) == ["trained.onnx"]  # no temporary file left

    trained, orig = onnx.load(out), onnx.load(original)
    onnx.checker.check_model(trained)
    inits = {t.name: t for t in trained.graph.initializer}
    for name, value in runner.parameters().items():
        assert inits[name].HasField("raw_data") and not inits[name].float_data
        np.testing.assert_array_equal(numpy_helper.to_array(inits[name]), value)
    for t in orig.graph.initializer:
        if t.name not in ("W", "b"):
            assert inits[t.name] == t
    assert inits["W"].doc_string == "the weight"
    # the wire reader decodes float_data and int64 initializers like onnx does
    got = _onnx_decode.read_initializers(original, ["b", "perm", "scale"])
    for t in orig.graph.initializer:
        if t.name in got:
            np.testing.assert_array_equal(got[t.name], numpy_helper.to_array(t))
            assert got[t.name].dtype == numpy_helper.to_array(t).dtype
    assert _cleared(trained) == _cleared(orig)
    assert [t.name for t in trained.graph.initializer] == [t.name for t in orig.graph.initializer]

    # the trained model runs and computes with the trained weights
    import onnxruntime as ort

    x = _batches(1)[0]["x"]
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    p = runner.parameters()
    want = ((x @ p["W"] + p["b"]) * 1.5)[:, [1, 0]]
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-6)


def test_save_inference_model_keeps_every_byte(step_graph, tmp_path):
    """Nothing trained and raw_data initializers: the output is the input, byte for byte; the
    step graph itself round-trips too (its raw_data W, b are rewritten in place)."""
    original = tmp_path / "linear.onnx"
    onnx.save(_inference_model(float_data_bias=False), original)
    runner = StepRunner(step_graph, providers=["CPUExecutionProvider"])
    runner.save_inference_model(original, tmp_path / "same.onnx")
    assert (tmp_path / "same.onnx").read_bytes() == original.read_bytes()
    runner.save_inference_model(step_graph, tmp_path / "same.step.onnx")
    assert (tmp_path / "same.step.onnx").read_bytes() == step_graph.read_bytes()
    # in place over the original works as well (atomic replace)
    copy = tmp_path / "copy.onnx"
    copy.write_bytes(original.read_bytes())
    runner.step(_batches(1)[0])
    runner.save_inference_model(copy, copy)
    np.testing.assert_array_equal(
        numpy_helper.to_array([t for t in onnx.load(copy).graph.initializer if t.name == "W"][0]),
        runner.parameters()["W"])


def _data_file(model_path: Path) -> dict[str, tuple[str, int, int]]:
    """name -> (location, offset, length) of each initializer in external data."""
    m = onnx.load(model_path, load_external_data=False)
    out = {}
    for t in m.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            e = {x.key: x.value for x in t.external_data}
            out[t.name] = (e["location"], int(e["offset"]), int(e["length"]))
    return out


def test_save_inference_model_external_data(step_graph, tmp_path, monkeypatch):
    """A model with external data is written with external data: `<out>.data` beside the output,
    holding the trained parameters and the original's other external initializers (so the
    output needs nothing of the original's folder); external_data=False writes one file."""
    src = tmp_path / "ext"
    src.mkdir()
    model = _inference_model(float_data_bias=False)
    onnx.save(model, src / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.data", size_threshold=0)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    runner = StepRunner(step_graph, providers=["CPUExecutionProvider"])
    runner.step(_batches(1)[0])
    params = runner.parameters()
    x = _batches(1)[0]["x"]
    want = ((x @ params["W"] + params["b"]) * 1.5)[:, [1, 0]]
    import onnxruntime as ort

    out = tmp_path / "elsewhere" / "trained.onnx"
    out.parent.mkdir()
    runner.save_inference_model(src / "m.onnx", out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["trained.onnx", "trained.onnx.data"]
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before  # the original is untouched
    ext = _data_file(out)
    assert sorted(ext) == ["W", "b", "perm", "scale"]  # every tensor the original kept outside
    for location, offset, _ in ext.values():
        assert location == "trained.onnx.data" and offset % 4096 == 0
    onnx.checker.check_model(str(out))
    trained = onnx.load(out)
    inits = {t.name: numpy_helper.to_array(t) for t in trained.graph.initializer}
    for name, value in params.items():
        np.testing.assert_array_equal(inits[name], value)
    np.testing.assert_array_equal(inits["scale"], [1.5])
    np.testing.assert_array_equal(inits["perm"], [1, 0])
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-6)
    # the wire reader reads external initializers too
    got = _onnx_decode.read_initializers(src / "m.onnx", ["W", "perm"])
    np.testing.assert_array_equal(got["W"], W0)
    np.testing.assert_array_equal(got["perm"], [1, 0])

    # one self-contained file on request
    single = tmp_path / "single.onnx"
    runner.save_inference_model(src / "m.onnx", single, external_data=False)
    assert not (tmp_path / "single.onnx.data").exists() and _data_file(single) == {}
    sess = ort.InferenceSession(single.read_bytes(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-6)

    # an inline original gets external data on request for the trained tensors of >= 1 KiB
    # (lowered here; b has 8 bytes), its other initializers staying as they are
    monkeypatch.setattr(_onnx_rewrite, "EXTERNAL_MIN_BYTES", 16)
    runner.save_inference_model(single, tmp_path / "re.onnx", external_data=True)
    assert sorted(_data_file(tmp_path / "re.onnx")) == ["W"]
    sess = ort.InferenceSession(str(tmp_path / "re.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-6)

    # too large inline: refused without external data, written with it (limit lowered here)
    monkeypatch.undo()
    big = helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["M"], ["y"])], "m", [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])],
        [numpy_helper.from_array(np.zeros((64, 64), np.float32), "M")]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(big, tmp_path / "m64.onnx")
    m = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    monkeypatch.setattr(_onnx_rewrite, "PROTOBUF_LIMIT", 10_000)
    with pytest.raises(ValueError, match="over protobuf's 2 GB limit; write it with external data"):
        _onnx_rewrite.replace_initializers(tmp_path / "m64.onnx", tmp_path / "big.onnx", {"M": m},
                                        external_data=False)
    assert not list(tmp_path.glob("big.onnx*")) and not list(tmp_path.glob(".big.onnx*"))
    _onnx_rewrite.replace_initializers(tmp_path / "m64.onnx", tmp_path / "big.onnx", {"M": m})  # auto
    monkeypatch.undo()
    assert sorted(_data_file(tmp_path / "big.onnx")) == ["M"]
    sess = ort.InferenceSession(str(tmp_path / "big.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(sess.run(None, {})[0], m)


def test_save_inference_model_above_2gb(tmp_path):
    """Trained weights of 2.25 GB in all (three [150, 1250000] float32 tensors) give a model
    protobuf could not hold inline: written as external data that onnx and onnxruntime load.
    The original is tiny on disk (its weights are a sparse file) and the values are a 5 MB random
    block broadcast, so the test costs 2.25 GB of disk for a few seconds, not of memory."""
    import onnxruntime as ort

    rows, cols = 150, 1_250_000
    src = tmp_path / "src"
    src.mkdir()
    names = ["w0", "w1", "w2"]
    nbytes = rows * cols * 4
    inits = []
    for i, name in enumerate(names):
        t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[rows, cols])
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", "w.bin"), ("offset", str(i * nbytes)), ("length", str(nbytes))):
            t.external_data.add(key=k, value=v)
        inits.append(t)
    # out = w0[r] + w1[r] + w2[r] for a row index r
    nodes = [helper.make_node("Gather", [n, "r"], [f"g{i}"], axis=0) for i, n in enumerate(names)]
    nodes += [helper.make_node("Sum", ["g0", "g1", "g2"], ["out"])]
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info("r", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, cols])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    (src / "big.onnx").write_bytes(model.SerializeToString())
    with open(src / "w.bin", "wb") as f:
        f.truncate(3 * nbytes)  # zeros, no disk blocks

    rng = np.random.default_rng(5)
    blocks = [rng.standard_normal(cols).astype(np.float32) for _ in names]
    values = {n: np.broadcast_to(b * (1 + i), (rows, cols)) for i, (n, b) in enumerate(zip(names, blocks))}
    out = tmp_path / "out" / "trained.onnx"
    out.parent.mkdir()
    try:
        with pytest.raises(ValueError, match="over protobuf's 2 GB limit"):
            _onnx_rewrite.replace_initializers(src / "big.onnx", out, values, external_data=False)
        assert not any(out.parent.iterdir())
        assert _onnx_rewrite.replace_initializers(src / "big.onnx", out, values) == names
        data = out.parent / "trained.onnx.data"
        assert sorted(p.name for p in out.parent.iterdir()) == ["trained.onnx", "trained.onnx.data"]
        assert out.stat().st_size < 10_000 and data.stat().st_size >= 3 * nbytes > 2**31
        ext = _data_file(out)
        assert [ext[n][2] for n in names] == [nbytes] * 3
        onnx.checker.check_model(str(out))  # by path: the external data is not loaded
        sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        want = sum(b * (1 + i) for i, b in enumerate(blocks))
        for r in (0, rows - 1):
            got = sess.run(None, {"r": np.array([r], np.int64)})[0]
            np.testing.assert_allclose(got[0], want, rtol=1e-6)
        del sess
        w = np.memmap(data, dtype="<f4", mode="r", offset=ext["w2"][1], shape=(rows, cols))
        np.testing.assert_array_equal(w[rows // 2], blocks[2] * 3)
        del w
    finally:
        for p in [*out.parent.iterdir(), src / "w.bin"]:
            p.unlink()


def test_save_inference_model_refuses_mismatches(step_graph, tmp_path):
    runner = StepRunner(step_graph, providers=["CPUExecutionProvider"])
    model = _inference_model(float_data_bias=False)
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(W0.T.copy(), "W"))  # shape [2, 3]
    onnx.save(model, tmp_path / "shape.onnx")
    with pytest.raises(ValueError, match=r"'W' has shape \[2, 3\].*shape mismatch"):
        runner.save_inference_model(tmp_path / "shape.onnx", tmp_path / "o.onnx")
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(W0.astype(np.float64), "W"))
    onnx.save(model, tmp_path / "type.onnx")
    with pytest.raises(ValueError, match="'W' is DOUBLE.*type mismatch"):
        runner.save_inference_model(tmp_path / "type.onnx", tmp_path / "o.onnx")
    del model.graph.initializer[1]
    onnx.save(model, tmp_path / "missing.onnx")
    with pytest.raises(ValueError, match="no initializer named 'W'"):
        runner.save_inference_model(tmp_path / "missing.onnx", tmp_path / "o.onnx")
    assert not (tmp_path / "o.onnx").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["missing.onnx", "shape.onnx", "type.onnx"]
    runner.save_inference_model(tmp_path / "missing.onnx", tmp_path / "o.onnx", strict=False)
    assert numpy_helper.to_array(onnx.load(tmp_path / "o.onnx").graph.initializer[-1]).shape == (2,)


@pytest.mark.parametrize("name", sorted(p.name for p in MODELS.glob("*.onnx")))
def test_wire_rewrite_equals_onnx(name, tmp_path):
    """On the exported fixtures, replacing every float initializer through the wire writer gives
    the bytes onnx itself serializes after setting raw_data (the fixtures are canonical)."""
    src = MODELS / name
    model = onnx.load(src)
    assert model.SerializeToString() == src.read_bytes()  # canonical input
    rng = np.random.default_rng(3)
    values = {}
    for t in model.graph.initializer:
        if t.data_type == TensorProto.FLOAT and t.name not in values:
            values[t.name] = rng.standard_normal(tuple(t.dims)).astype(np.float32)
            t.CopyFrom(numpy_helper.from_array(values[t.name], t.name))
    assert values
    assert sorted(_onnx_rewrite.replace_initializers(src, tmp_path / name, values)) == sorted(values)
    assert (tmp_path / name).read_bytes() == model.SerializeToString()


def test_batch_errors(step_graph):
    runner = StepRunner(step_graph, providers=["CPUExecutionProvider"])
    b = _batches(1)[0]
    with pytest.raises(ValueError, match=r"missing \['y'\], unexpected \[\]"):
        runner.step({"x": b["x"]})
    with pytest.raises(ValueError, match=r"unexpected \['z'\]"):
        runner.step({**b, "z": b["x"]})
    with pytest.raises(ValueError, match=r"batch\['x'\] is float64, the graph wants float32"):
        runner.step({**b, "x": b["x"].astype(np.float64)})
    assert runner.steps_taken == 0
    runner.step(b)
    assert runner.steps_taken == 1


def test_graph_without_metadata(tmp_path):
    path = tmp_path / "plain.onnx"
    onnx.save(_step_model(with_metadata=False), path)
    with pytest.raises(ValueError, match="not a step graph \\(no 'ntl_step' metadata\\)") as e:
        StepRunner(path, providers=["CPUExecutionProvider"])
    assert "\n" not in str(e.value)
    model = _step_model()
    model.metadata_props[0].value = json.dumps({"state": []})
    onnx.save(model, tmp_path / "partial.onnx")
    with pytest.raises(ValueError, match="metadata lacks parameters, lr_input"):
        StepRunner(tmp_path / "partial.onnx", providers=["CPUExecutionProvider"])


_RT_SCRIPT = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
for banned in ("torch", "onnx"):
    try:
        __import__(banned)
    except ImportError:
        pass
    else:
        sys.exit(f"{banned} is importable in the runtime env")
import onnxruntime
from ntl_patch import StepRunner
data = np.load(sys.argv[3])
runner = StepRunner(sys.argv[2], providers=["CPUExecutionProvider"])
losses = [runner.step({"x": data[f"x{i}"], "y": data[f"y{i}"]}, lr=0.1 + 0.05 * i) for i in range(5)]
np.savez(sys.argv[4], **{k.replace("/", "|"): v for k, v in runner.state_dict().items()})
runner.save_inference_model(sys.argv[5], sys.argv[6])
print(json.dumps({"losses": losses, "ort": onnxruntime.__version__, "steps": runner.steps_taken}))
"""


def test_runtime_only_env(step_graph, tmp_path):
    setup = subprocess.run([str(REPO / "scripts" / "setup" / "setup-runtime.sh")], capture_output=True,
                           text=True, timeout=900)
    assert setup.returncode == 0, setup.stderr
    batches = _batches()
    np.savez(tmp_path / "batches.npz", **{f"{k}{i}": b[k] for i, b in enumerate(batches) for k in b})
    original = tmp_path / "linear.onnx"
    onnx.save(_inference_model(), original)
    (tmp_path / "rt.py").write_text(_RT_SCRIPT)
    r = subprocess.run([str(REPO / ".venv-rt" / "bin" / "python"), "-B", str(tmp_path / "rt.py"),
                        str(REPO / "python"), str(step_graph), str(tmp_path / "batches.npz"),
                        str(tmp_path / "state.npz"), str(original), str(tmp_path / "rt.onnx")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["ort"] == "1.31.1" and result["steps"] == 5

    runner = StepRunner(step_graph, providers=["CPUExecutionProvider"])
    here = [runner.step(b, lr=0.1 + 0.05 * i) for i, b in enumerate(batches)]
    np.testing.assert_allclose(result["losses"], here, rtol=1e-6, atol=1e-7)
    state = {k.replace("|", "/"): v for k, v in np.load(tmp_path / "state.npz").items()}
    assert state.keys() == runner.state_dict().keys()
    for k, v in runner.state_dict().items():
        np.testing.assert_allclose(state[k], v, rtol=1e-6, atol=1e-7)
    runner.save_inference_model(original, tmp_path / "here.onnx")
    rt, inproc = onnx.load(tmp_path / "rt.onnx"), onnx.load(tmp_path / "here.onnx")
    assert _cleared(rt) == _cleared(inproc)
    for a, b in zip(rt.graph.initializer, inproc.graph.initializer):
        np.testing.assert_allclose(numpy_helper.to_array(a), numpy_helper.to_array(b),
                                   rtol=1e-6, atol=1e-7)


def test_real_step_graph(tmp_path):
    """A fixture's step graph from `ntl-patch step` trains under StepRunner."""
    cmd = patch_command()
    model = tmp_path / "lm_flat.onnx"
    model.write_bytes((MODELS / "lm_flat.onnx").read_bytes())
    r = subprocess.run(cmd + ["step", str(model), "--tokenizer", str(TOKENIZER)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    runner = StepRunner(tmp_path / "lm_flat.step.onnx", providers=["CPUExecutionProvider"])
    ids = np.array([[5, 18, 29, 25, 30, 36, 35, 7], [27, 21, 10, 38, 18, 3, 4, 29]], np.int64)
    labels = np.array([[18, 29, 25, 30, 36, 35, -100, 21], [21, 10, 38, 18, 25, 7, 4, 29]], np.int64)
    data = dict(zip(runner.data_inputs, (ids, labels)))
    losses = [runner.step(data) for _ in range(30)]
    assert all(np.isfinite(losses).ravel())
    assert losses[-1][0] < losses[0][0]
    runner.save_inference_model(model, tmp_path / "trained.onnx")
    inits = {t.name: t for t in onnx.load(tmp_path / "trained.onnx").graph.initializer}
    for name, value in runner.parameters().items():
        np.testing.assert_array_equal(numpy_helper.to_array(inits[name]), value)


def _lm_step_graph(folder: Path, external: bool = False, extra=()) -> Path:
    """lm_flat's step graph (AdamW) from `ntl-patch step`; external: the model's weights and
    the graph's zero moments in external data (sparse state.bin), as for a large model."""
    model = folder / "lm_flat.onnx"
    if external:
        onnx.save(onnx.load(MODELS / "lm_flat.onnx"), model, save_as_external_data=True,
                  all_tensors_to_one_file=True, location="lm_flat.data", size_threshold=0)
    else:
        model.write_bytes((MODELS / "lm_flat.onnx").read_bytes())
    r = subprocess.run(patch_command() + ["step", str(model), "--tokenizer", str(TOKENIZER), *extra],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return folder / "lm_flat.step.onnx"


_LM_IDS = np.array([[5, 18, 29, 25, 30, 36, 35, 7], [27, 21, 10, 38, 18, 3, 4, 29]], np.int64)
_LM_LABELS = np.array([[18, 29, 25, 30, 36, 35, -100, 21], [21, 10, 38, 18, 25, 7, 4, 29]], np.int64)


def test_state_lives_once(tmp_path):
    """The session holds no state initializer; the moments and the step count are updated in
    their own memory (same addresses every step); the parameters get new memory; and the
    trajectory is bit for bit the one of the same runner updating nothing in place."""
    graph = _lm_step_graph(tmp_path)
    runner = StepRunner(graph, providers=["CPUExecutionProvider"])
    state_inputs = [i for i, _ in runner.state_names]
    assert [i.name for i in runner.session.get_overridable_initializers()] == ["ntl/lr"]
    assert set(state_inputs) <= {i.name for i in runner.session.get_inputs()}
    moments = [n for n in state_inputs if n not in runner.parameter_names]
    assert runner.in_place == moments and moments[-1] == "ntl/state/step" and len(moments) == 31
    assert runner.in_place == runner.metadata["in_place"]
    data = dict(zip(runner.data_inputs, (_LM_IDS, _LM_LABELS)))
    addr = {n: v.data_ptr() for n, v in runner._training.values.items()}
    losses = [runner.step(data) for _ in range(4)]
    after = {n: v.data_ptr() for n, v in runner._training.values.items()}
    assert all(after[n] == addr[n] for n in moments)
    assert all(after[n] != addr[n] for n in runner.parameter_names)

    copy = StepRunner(graph, providers=["CPUExecutionProvider"])
    copy._training.in_place = set()  # every next value to new memory, as without `in_place`
    assert [copy.step(data) for _ in range(4)] == losses
    for name, value in copy.state_dict().items():
        np.testing.assert_array_equal(runner.state_dict()[name], value, err_msg=name)


def test_default_options_use_the_exact_cpu_arena(tmp_path):
    """Without session_options, the session opts into the process-wide CPU arena that grows by
    what is asked for (bench/README.md: 0.93x instead of 1.03x torch's peak at 0.5B); options the
    caller passes are left as they are."""
    import onnxruntime as ort

    graph = _lm_step_graph(tmp_path)
    runner = StepRunner(graph, providers=["CPUExecutionProvider"])
    key = "session.use_env_allocators"
    assert runner.session.get_session_options().get_session_config_entry(key) == "1"
    mine = ort.SessionOptions()
    other = StepRunner(graph, providers=["CPUExecutionProvider"], session_options=mine)
    with pytest.raises(RuntimeError):  # not set
        other.session.get_session_options().get_session_config_entry(key)
    data = dict(zip(runner.data_inputs, (_LM_IDS, _LM_LABELS)))
    assert [runner.step(data) for _ in range(2)] == [other.step(data) for _ in range(2)]


def test_session_folds_no_gradient_base(tmp_path):
    """The embedding Gather's gradient scatters into zeros of the embedding's shape; those zeros
    come from the loss at run time, so onnxruntime's constant folding cannot keep them as an
    initializer the size of the embedding (545 MB at Qwen2-0.5B's shape)."""
    import onnxruntime as ort

    graph = _lm_step_graph(tmp_path)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    runner = StepRunner(graph, providers=["CPUExecutionProvider"], session_options=so)
    emb = runner.state_dict()["emb.weight"].shape
    shapes = [tuple(t.dims) for t in onnx.load(tmp_path / "optimized.onnx").graph.initializer]
    assert shapes and emb not in shapes, shapes


def test_hand_made_graph_has_nothing_in_place(step_graph):
    assert StepRunner(step_graph, providers=["CPUExecutionProvider"]).in_place == []


def test_failed_step_refuses_the_half_updated_state(tmp_path):
    """A run that fails while the state is updated in place leaves the runner refusing to go on
    until a state is loaded; then it trains as if the failure had not happened."""
    runner = StepRunner(_lm_step_graph(tmp_path), providers=["CPUExecutionProvider"])
    data = dict(zip(runner.data_inputs, (_LM_IDS, _LM_LABELS)))
    runner.step(data)
    saved = runner.state_dict()
    bad = dict(zip(runner.data_inputs, (np.full_like(_LM_IDS, 10**6), _LM_LABELS)))
    with pytest.raises(Exception, match="(?i)out of|bound|range"):
        runner.step(bad)
    for call in (lambda: runner.step(data), runner.state_dict, runner.parameters,
                 lambda: runner.save_inference_model(MODELS / "lm_flat.onnx", tmp_path / "x.onnx")):
        with pytest.raises(RuntimeError, match="may be partly updated; load_state_dict"):
            call()
    runner.load_state_dict(saved)
    clean = StepRunner(tmp_path / "lm_flat.step.onnx", providers=["CPUExecutionProvider"])
    clean.load_state_dict(saved)
    assert [runner.step(data) for _ in range(2)] == [clean.step(data) for _ in range(2)]


_RT_REAL_SCRIPT = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import onnxruntime
from ntl_patch import StepRunner, _onnx_rewrite
if sys.argv[4] == "key":  # the model's external constants cannot be inlined: read from its folder
    _onnx_rewrite.PROTOBUF_LIMIT = 1000
runner = StepRunner(sys.argv[2], providers=["CPUExecutionProvider"])
_onnx_rewrite.PROTOBUF_LIMIT = 2**31 - 1
data = np.load(sys.argv[3])
batch = dict(zip(runner.data_inputs, (data["ids"], data["labels"])))
losses = [runner.step(batch) for i in range(4)]
np.savez(sys.argv[5], **{k.replace("/", "|"): v for k, v in runner.state_dict().items()})
print(json.dumps({"losses": losses, "ort": onnxruntime.__version__, "in_place": runner.in_place,
                  "inits": [i.name for i in runner.session.get_overridable_initializers()]}))
"""


def test_runtime_only_env_real_graph_with_external_data(tmp_path):
    """onnxruntime 1.31 (.venv-rt) trains a step graph whose weights and zero moments are
    external data like the in-process runner (onnxruntime 1.19 here): the state read from the
    files, the other external initializers inline in the session's bytes, or (too large to
    inline; the limit lowered) read by onnxruntime from the model's folder. The frozen embedding
    is such an initializer."""
    graph = _lm_step_graph(tmp_path, external=True, extra=("--freeze", "emb."))
    assert "emb.weight" in _data_file(graph)
    assert (tmp_path / "lm_flat.step.onnx.state.bin").exists()
    np.savez(tmp_path / "batch.npz", ids=_LM_IDS, labels=_LM_LABELS)
    (tmp_path / "rt.py").write_text(_RT_REAL_SCRIPT)
    runner = StepRunner(graph, providers=["CPUExecutionProvider"])
    here = [runner.step(dict(zip(runner.data_inputs, (_LM_IDS, _LM_LABELS)))) for _ in range(4)]
    for mode in ("inline", "key"):
        r = subprocess.run([str(REPO / ".venv-rt" / "bin" / "python"), "-B", str(tmp_path / "rt.py"),
                            str(REPO / "python"), str(graph), str(tmp_path / "batch.npz"), mode,
                            str(tmp_path / "state.npz")], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        result = json.loads(r.stdout.strip().splitlines()[-1])
        # the frozen embedding is an input with a default too (never folded into copies)
        assert result["ort"] == "1.31.1" and sorted(result["inits"]) == ["emb.weight", "ntl/lr"]
        assert result["in_place"] == runner.in_place
        np.testing.assert_allclose(result["losses"], here, rtol=1e-6, atol=1e-7)
        state = {k.replace("|", "/"): v for k, v in np.load(tmp_path / "state.npz").items()}
        assert state.keys() == runner.state_dict().keys()
        for k, v in runner.state_dict().items():
            if "k.bias" in k:  # its exact gradient is 0 (softmax ignores a shift of the keys):
                continue  # AdamW makes each runtime's rounding noise an lr-sized step
            np.testing.assert_allclose(state[k], v, rtol=1e-5, atol=1e-7, err_msg=k)


def test_tf32_is_stated_for_the_cuda_provider():
    """StepRunner / DataParallel's `tf32`: strict float32 unless asked (torch's default; onnxruntime's
    CUDA provider defaults to TF32), the caller's own `use_tf32` kept, a contradiction refused, other
    providers untouched. (Checked to fail: with `with_tf32` returning the providers as they are.)"""
    from ntl_patch._sessions import with_tf32

    cuda = "CUDAExecutionProvider"
    assert with_tf32([cuda, "CPUExecutionProvider"], None) == [(cuda, {"use_tf32": "0"}), "CPUExecutionProvider"]
    assert with_tf32([(cuda, {"device_id": 1})], True) == [(cuda, {"device_id": 1, "use_tf32": "1"})]
    assert with_tf32([(cuda, {"use_tf32": "1"})], None) == [(cuda, {"use_tf32": "1"})]
    assert with_tf32([(cuda, {"use_tf32": 0})], False) == [(cuda, {"use_tf32": 0})]
    assert with_tf32(["CPUExecutionProvider"], True) == ["CPUExecutionProvider"]
    with pytest.raises(ValueError, match="contradicts use_tf32"):
        with_tf32([(cuda, {"use_tf32": "1"})], False)


def test_gpu_arenas_grow_by_what_is_asked(step_graph, monkeypatch):
    """The trainers ask the CUDA and ROCm providers' arenas to grow by each request instead of
    onnxruntime's next power of two (up to twice the peak held), keep a caller's own choice and
    leave other providers alone; StepRunner hands the result to its session. (Checked to fail:
    with `exact_gpu_arena` returning the providers as they are.)"""
    import onnxruntime as ort

    from ntl_patch import StepRunner
    from ntl_patch._sessions import exact_gpu_arena, trainer_providers

    cuda, rocm, cpu = "CUDAExecutionProvider", "ROCMExecutionProvider", "CPUExecutionProvider"
    exact = {"arena_extend_strategy": "kSameAsRequested"}
    assert exact_gpu_arena([cuda, cpu]) == [(cuda, exact), cpu]
    assert exact_gpu_arena([(rocm, {"device_id": 1})]) == [(rocm, {"device_id": 1, **exact})]
    mine = {"arena_extend_strategy": "kNextPowerOfTwo"}
    assert exact_gpu_arena([(cuda, mine)]) == [(cuda, mine)]
    assert exact_gpu_arena([cpu, "DmlExecutionProvider"]) == [cpu, "DmlExecutionProvider"]
    assert trainer_providers([cuda], None) == [(cuda, {"use_tf32": "0", **exact})]

    # what StepRunner's session is given (the CUDA provider itself does not exist here)
    given = []
    real = ort.InferenceSession

    def recording(model, sess_options=None, providers=None, **kw):
        given.append(providers)
        return real(model, sess_options=sess_options, providers=[cpu], **kw)

    monkeypatch.setattr(ort, "InferenceSession", recording)
    StepRunner(step_graph, providers=[cuda, cpu], device="cpu")
    assert given and given[-1] == [(cuda, {"use_tf32": "0", **exact}), cpu]

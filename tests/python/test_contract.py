"""The ``ntl_step`` metadata's Python mirror (``ntl_patch._contract``) against what the binary
writes: every key of a step, gradient and update graph is a field of ``StepMetadata`` and parses
to the value written, no field is one the binary never writes, and graphs written before the
trainers' names were in the metadata still load, except where sharding needs them (a one-line
error asking to write the graphs again). The Rust side: tests/contract.rs.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import onnx
import pytest

from conftest import MODELS, REPO, TOKENIZER, run_patch

sys.path.insert(0, str(REPO / "python"))
from ntl_patch import _contract, _graph_cut, _onnx_decode, _onnx_rewrite, _sharding  # noqa: E402

# every option that adds a key: LoRA, QLoRA, fused head, recompute, blockwise attention, fp16,
# clipping; then the --split pair and a plain SGD graph
ALL = ["--lora-r", "2", "--quantize-base", "nf4", "--quant-block", "16", "--fused-head", "on",
       "--recompute", "layers", "--attention", "chunked", "--precision", "fp16",
       "--max-grad-norm", "1"]
CASES = [("gpt2_ts", ALL), ("lm_flat", ["--split", "--precision", "fp16", "--max-grad-norm", "1"]),
         ("lm_nll", ["--optimizer", "sgd"])]


@pytest.fixture(scope="module")
def graphs(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("contract")
    out = []
    for name, args in CASES:
        path = d / f"{name}.step.onnx"
        r = run_patch(["step", MODELS / f"{name}.onnx", "--tokenizer", TOKENIZER, *args, "-o", path])
        assert r.returncode == 0, r.stderr
        out += [p for p in (path, d / f"{name}.step.update.onnx") if p.exists()]
    assert len(out) == 4
    return out


def _assert_parsed_as_written(parsed, raw, where: str) -> None:
    """A parsed value against the JSON it came from: a dataclass field per key (a key the
    binary leaves out parses to None), tuples as lists."""
    if dataclasses.is_dataclass(parsed):
        assert isinstance(raw, dict), where
        names = {f.name for f in dataclasses.fields(parsed)} - {"raw"}
        assert set(raw) <= names, f"{where}: keys the contract does not parse: {set(raw) - names}"
        for name in names:
            if name in raw:
                _assert_parsed_as_written(getattr(parsed, name), raw[name], f"{where}.{name}")
            else:
                assert getattr(parsed, name) is None, f"{where}.{name}: not written, yet parsed"
    elif isinstance(parsed, (list, tuple)):
        assert isinstance(raw, list) and len(parsed) == len(raw), where
        for i, (p, r) in enumerate(zip(parsed, raw)):
            _assert_parsed_as_written(p, r, f"{where}[{i}]")
    else:
        assert parsed == raw, where


def test_every_key_written_is_parsed_to_its_value(graphs):
    fields = {f.name for f in dataclasses.fields(_contract.StepMetadata)} - {"raw"}
    seen = set()
    for path in graphs:
        meta = _contract.read(path)
        raw = json.loads(_onnx_decode.read_metadata(path)["ntl_step"])
        _assert_parsed_as_written(meta, raw, path.name)
        seen |= set(raw)
    # and the contract declares nothing the binary never writes
    assert seen == fields, fields - seen


def test_the_names_the_trainers_need(graphs):
    step, grad, update, sgd = (_contract.read(p) for p in graphs)
    for meta in (step, update):
        assert meta.grad_norm_sq and meta.found_inf and meta.skip_output
        assert meta.step_input == "ntl/state/step"
        assert meta.loss_scale_input == "ntl/state/loss_scale"
        assert meta.lora is None or meta.lora.layers[0].weight_layout in ("out_in", "in_out")
    assert step.lora.r == 2 and step.quantize_base.blocksize == 16 and step.fused_head is not None
    assert step.recomputes and step.attention.replaced > 0
    assert grad.split and grad.grad_norm_sq is None and grad.found_inf is None
    assert grad.in_place == update.in_place and grad.state == update.state
    assert (sgd.grad_norm_sq, sgd.found_inf, sgd.loss_scale_input, sgd.skip_output) == (None,) * 4
    assert sgd.optimizer.name == "sgd" and sgd.optimizer.max_grad_norm is None


def _without(path: Path, out: Path, keys) -> Path:
    """path's graph with keys taken out of its metadata: as an older version wrote it."""
    model = onnx.load(str(path))
    prop = next(p for p in model.metadata_props if p.key == "ntl_step")
    meta = json.loads(prop.value)
    for k in keys:
        meta.pop(k, None)
    prop.value = json.dumps(meta)
    onnx.save(model, str(out))
    return out


NEW_KEYS = ("step_input", "loss_scale_input", "grad_norm_sq", "found_inf")


def test_sharding_feeds_the_named_tensors_and_refuses_older_update_graphs(graphs, tmp_path):
    update = graphs[2]
    nodes = _graph_cut.nodes(_onnx_rewrite.session_model(update, []))
    contract = _contract.read(update)
    norm = _sharding.global_tensor(contract, update, "grad_norm_sq", nodes)
    found = _sharding.global_tensor(contract, update, "found_inf", nodes)
    ops = {o: n.op_type for n in nodes for o in n.outputs}
    assert (ops[norm], ops[found]) == ("Sum", "Or")
    old = _without(update, tmp_path / "old.update.onnx", NEW_KEYS)
    with pytest.raises(ValueError, match="write the graphs again with this version's `ntl-patch step --split`") as e:
        _sharding.global_tensor(_contract.read(old), old, "grad_norm_sq", nodes)
    assert "\n" not in str(e.value)


def test_older_graphs_load_by_the_documented_names(graphs, tmp_path):
    old = _contract.read(_without(graphs[0], tmp_path / "old.onnx", NEW_KEYS))
    assert old.step_input == "ntl/state/step" and old.loss_scale_input == "ntl/state/loss_scale"
    assert old.grad_norm_sq is None and old.found_inf is None
    newer = tmp_path / "newer.onnx"
    model = onnx.load(str(graphs[3]))
    prop = next(p for p in model.metadata_props if p.key == "ntl_step")
    prop.value = json.dumps({**json.loads(prop.value), "a_later_key": [1]})
    onnx.save(model, str(newer))
    assert _contract.read(newer).raw["a_later_key"] == [1]
    broken = _without(graphs[3], tmp_path / "broken.onnx", ["state", "losses"])
    with pytest.raises(ValueError, match="'ntl_step' metadata lacks state, losses"):
        _contract.read(broken)

"""The committed fixtures agree with ntloss/torch in this environment (catches stale fixtures)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx.numpy_helper as nph
import pytest
import torch
import torch.nn.functional as F

from conftest import FIXTURES

CASES = json.loads((FIXTURES / "reference" / "ntloss_cases.json").read_text())


@pytest.mark.parametrize("case", CASES["cases"], ids=[c["name"] for c in CASES["cases"]])
def test_ntloss_cases_match_ntloss(case):
    import ntl_torch

    B, T, V = case["B"], case["T"], CASES["vocab_size"]
    logits = torch.tensor(case["logits"], dtype=torch.float32).double().reshape(B, T, V)
    labels = torch.tensor(case["labels"], dtype=torch.int64).reshape(B, T)
    assert len(case["results"]) == 20
    for r in case["results"]:
        obj = ntl_torch.ntloss_object(r["loss"], r["reweigh"], r["squash"], r["digit_level"])
        x = logits.clone().requires_grad_(True)
        ntl = ntl_torch.ntl_value(obj, x, labels)
        ce = F.cross_entropy(x.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
        total = ce + CASES["weight"] * ntl
        (grad,) = torch.autograd.grad(total, x)
        what = f"{case['name']} {r['loss']} reweigh={r['reweigh']} squash={r['squash']} digit_level={r['digit_level']}"
        assert float(ntl) == pytest.approx(r["ntl"], rel=1e-12, abs=1e-12), what
        assert float(ce) == pytest.approx(r["ce"], rel=1e-12), what
        np.testing.assert_allclose(grad.reshape(B * T, V).numpy(), np.array(r["grad"]),
                                   rtol=1e-7, atol=1e-12, err_msg=what)


def test_number_tables():
    import ntl_torch

    for key, dl in (("digit_level", True), ("all_numbers", False)):
        obj = ntl_torch.ntloss_object("mse", digit_level=dl)
        want = [None if np.isnan(v) else v for v in obj.number_values.tolist()]
        assert CASES["number_values"][key] == want, key


@pytest.mark.parametrize("loss", ["wasserstein", "mse"])
def test_reference_dirs_match_torch(loss, weights):
    import ntl_torch

    d = FIXTURES / "reference" / f"lm_flat_{loss}"
    tensors = {}
    for f in sorted(d.glob("*.pb")):
        t = onnx.TensorProto()
        t.ParseFromString(f.read_bytes())
        tensors[f.stem] = (t.name, nph.to_array(t))
    assert [n for n, _ in tensors.values()] == ["input_ids", "labels", "loss", "ce_loss", "number_loss"]
    ids = torch.from_numpy(tensors["input_0"][1].copy())
    labels = torch.from_numpy(tensors["input_1"][1].copy())
    total, ce, ntl, _ = ntl_torch.model_reference(weights, ids, labels, loss)
    for key, want in (("output_0", total), ("output_1", ce), ("output_2", ntl)):
        assert tensors[key][1].dtype == np.float32 and tensors[key][1].shape == ()
        assert float(tensors[key][1]) == pytest.approx(want, rel=1e-6), key


@pytest.mark.parametrize("name", ["lm_flat", "lm_bvt", "lm_nll"])
def test_models_hold_the_saved_weights(name, weights):
    m = onnx.load(str(FIXTURES / "models" / f"{name}.onnx"))
    assert m.ir_version <= 10
    inits = {i.name: nph.to_array(i) for i in m.graph.initializer}
    assert set(inits) == set(weights)
    for k, v in weights.items():
        np.testing.assert_array_equal(inits[k], v.numpy(), err_msg=k)

"""Every recorded ntloss 0.3.2 case, through the patched graph in ONNX Runtime Training:
forward values (<= 1e-5 relative) and d(CE + 0.3·NTL)/d(logits) (<= 1e-4 norm-relative), on a
graph whose trainable parameter is the logits themselves (logits_param.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FIXTURES
from logits_param import ort_step, rel_err

CASES = json.loads((FIXTURES / "reference" / "ntloss_cases.json").read_text())


def _args(r) -> list[str]:
    args = ["--loss", r["loss"]]
    if r["reweigh"]:
        args.append("--reweigh")
    if r["squash"] is not None:
        args += ["--squash", str(r["squash"])]
    if not r["digit_level"]:
        args.append("--all-numbers")
    return args


PARAMS = [(c["name"], i) for c in CASES["cases"] for i in range(len(c["results"]))]


@pytest.mark.parametrize("case,index", PARAMS, ids=[f"{c}-{i}" for c, i in PARAMS])
def test_ntloss_case_through_ort_training(case, index):
    c = next(x for x in CASES["cases"] if x["name"] == case)
    r = c["results"][index]
    logits = np.asarray(c["logits"], np.float32).reshape(c["B"], c["T"], -1)
    labels = np.asarray(c["labels"], np.int64).reshape(c["B"], c["T"])
    outs, grad = ort_step(logits, labels, _args(r))
    scale = max(abs(r["ntl"]), 1e-6)
    assert abs(outs["number_loss"] - r["ntl"]) <= 1e-5 * scale + 1e-7, (outs, r["ntl"])
    assert abs(outs["ce_loss"] - r["ce"]) <= 1e-5 * abs(r["ce"])
    assert abs(outs["loss"] - r["total"]) <= 1e-5 * abs(r["total"])
    assert rel_err(grad, r["grad"]) <= 1e-4


@pytest.mark.parametrize("opset", [13, 15, 17, 18, 21])
@pytest.mark.parametrize("layout", ["flat", "bvt"])
def test_opsets_and_layouts(opset, layout):
    """The same case at every supported opset and both CE layouts."""
    c = CASES["cases"][0]
    r = next(x for x in c["results"] if x["loss"] == "wasserstein" and x["digit_level"]
             and not x["reweigh"] and x["squash"] is None)
    logits = np.asarray(c["logits"], np.float32).reshape(c["B"], c["T"], -1)
    labels = np.asarray(c["labels"], np.int64).reshape(c["B"], c["T"])
    outs, grad = ort_step(logits, labels, _args(r), opset=opset, layout=layout)
    assert abs(outs["number_loss"] - r["ntl"]) <= 1e-5 * abs(r["ntl"])
    assert rel_err(grad, r["grad"]) <= 1e-4

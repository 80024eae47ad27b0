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


@pytest.mark.parametrize("opset", [13, 15, 17, 18, 19, 20, 21])
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


# ---- NTIL / EMD (official xfey/NTIL code, Gumbel noise 0) and ntloss NumberLevelLoss ----

NTIL = json.loads((FIXTURES / "reference" / "ntil_cases.json").read_text())

NUMBER_LEVEL = json.loads((FIXTURES / "reference" / "number_level_cases.json").read_text())


def _case_arrays(c):
    logits = np.asarray(c["logits"], np.float32).reshape(c["B"], c["T"], -1)
    labels = np.asarray(c["labels"], np.int64).reshape(c["B"], c["T"])
    return logits, labels


def _ntil_args(r, combine: str) -> list[str]:
    args = ["--loss", r["loss"], "--combine", combine, "--digit-exp", str(r["digit_exp"]),
            "--weight", str(r["weight"])]
    if r["loss"] == "ntil":
        args += ["--abs-alpha", str(r["abs_alpha"]), "--mag-alpha", str(r["mag_alpha"]),
                 "--digit-alpha", str(r["digit_alpha"]), "--gumbel-tau", str(r["tau"]),
                 "--gumbel-noise", "0"]
    return args


NTIL_PARAMS = [(c["name"], i, combine) for c in NTIL["cases"] for i in range(len(c["results"]))
               for combine in ("scaled", "add")]


@pytest.mark.parametrize("case,index,combine", NTIL_PARAMS,
                         ids=[f"{c}-{i}-{m}" for c, i, m in NTIL_PARAMS])
def test_official_ntil_case_through_ort_training(case, index, combine):
    """Edge cases (no digits in a sequence, runs at sequence boundaries, -100 inside a run, a
    single digit, a 20-digit number, decimals) against the official code's values/gradients."""
    c = next(x for x in NTIL["cases"] if x["name"] == case)
    r = c["results"][index]
    logits, labels = _case_arrays(c)
    outs, grad = ort_step(logits, labels, _ntil_args(r, combine))
    assert abs(outs["number_loss"] - r["raw"]) <= 1e-5 * max(abs(r["raw"]), 1e-6), (outs, r["raw"])
    assert abs(outs["ce_loss"] - r["ce"]) <= 1e-5 * abs(r["ce"])
    assert abs(outs["loss"] - r[combine]) <= 1e-5 * abs(r[combine])
    assert rel_err(grad, r[f"grad_{combine}"]) <= 1e-4


NL_PARAMS = [(c["name"], i) for c in NUMBER_LEVEL["cases"] for i in range(len(c["results"]))]


@pytest.mark.parametrize("case,index", NL_PARAMS, ids=[f"{c}-{i}" for c, i in NL_PARAMS])
def test_number_level_case_through_ort_training(case, index):
    c = next(x for x in NUMBER_LEVEL["cases"] if x["name"] == case)
    r = c["results"][index]
    logits, labels = _case_arrays(c)
    args = ["--loss", "number-level", "--weight", str(r["weight"])]
    args += ["--float-level"] if r["float_level"] else []
    args += ["--reweigh"] if r["reweigh"] else []
    outs, grad = ort_step(logits, labels, args)
    assert abs(outs["number_loss"] - r["raw"]) <= 1e-5 * max(abs(r["raw"]), 1e-6), (outs, r["raw"])
    assert abs(outs["loss"] - r["total"]) <= 1e-5 * abs(r["total"])
    assert rel_err(grad, r["grad_total"]) <= 1e-4


@pytest.mark.parametrize("opset", [13, 17, 18, 19, 20, 21])
def test_ntil_and_number_level_across_opsets(opset):
    """The per-sequence losses at every opset: op forms change at 18 (ReduceMax axes), 19
    (Equal written as Not(Or(Less, Greater)) for the GPU providers)."""
    c = next(x for x in NTIL["cases"] if x["name"] == "runs")
    r = c["results"][0]
    logits, labels = _case_arrays(c)
    outs, grad = ort_step(logits, labels, _ntil_args(r, "scaled"), opset=opset)
    assert abs(outs["number_loss"] - r["raw"]) <= 1e-5 * abs(r["raw"])
    assert rel_err(grad, r["grad_scaled"]) <= 1e-4
    c = next(x for x in NUMBER_LEVEL["cases"] if x["name"] == "decimal_exact")
    r = next(x for x in c["results"] if x["float_level"] and x["reweigh"])
    logits, labels = _case_arrays(c)
    outs, grad = ort_step(logits, labels, ["--loss", "number-level", "--float-level", "--reweigh"],
                          opset=opset)
    assert abs(outs["number_loss"] - r["raw"]) <= 1e-5 * max(abs(r["raw"]), 1e-6)
    assert rel_err(grad, r["grad_total"]) <= 1e-4

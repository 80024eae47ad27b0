"""fixtures/ntil_torch.py against the OFFICIAL NTIL/EMD code's committed values, and ntloss
NumberLevelLoss against fixtures/reference/number_level_cases.json.

fixtures/reference/ntil_cases.json holds what the official code (xfey/NTIL 864abaa, run by
fixtures/generate_ntil.py with Gumbel noise 0, in float32: the only dtype it runs in) returns on
seeded logits. CI has no official code; these tests are what lets the rest of the harness use
ntil_torch (float64) as the autograd reference for `ntl-patch --loss ntil|emd`.

Tolerances: values relative 1e-5; gradients d/d(flat logits [B*T, V]) max-abs error at most
1e-5 * max|reference gradient| (the official values are float32 computations, good to ~1e-6).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import FIXTURES

import ntil_torch  # noqa: E402  (fixtures/ is on sys.path, see conftest)

VAL_RTOL = 1e-5
GRAD_RTOL = 1e-5

NTIL = json.loads((FIXTURES / "reference" / "ntil_cases.json").read_text())
NUMBER_LEVEL = json.loads((FIXTURES / "reference" / "number_level_cases.json").read_text())
DIGIT_IDS = ntil_torch.digit_token_ids()


def _inputs(case):
    logits = torch.tensor(case["logits"], dtype=torch.float32)  # [B*T, V], exact float32 values
    labels = torch.tensor(case["labels"], dtype=torch.long)  # [B, T]
    assert logits.shape == (case["B"] * case["T"], NTIL["vocab_size"])
    assert labels.shape == (case["B"], case["T"])
    return logits, labels


def _number(result, logits, labels):
    if result["loss"] == "ntil":
        return ntil_torch.ntil_loss(logits, labels, DIGIT_IDS, digit_exp=result["digit_exp"],
                                    abs_alpha=result["abs_alpha"], mag_alpha=result["mag_alpha"],
                                    digit_alpha=result["digit_alpha"], tau=result["tau"],
                                    noise_scale=0.0)
    return ntil_torch.emd_loss(logits, labels, DIGIT_IDS, digit_exp=result["digit_exp"])


def _value_and_grad(fn, logits32):
    x = logits32.double().requires_grad_(True)
    out = fn(x)
    grad = torch.autograd.grad(out, x)[0] if out.requires_grad else torch.zeros_like(x)
    return out.item(), grad.numpy()


def _check_value(got, want, what):
    if want == 0.0:
        assert got == 0.0, f"{what}: {got} (want exactly 0)"
    else:
        rel = abs(got - want) / abs(want)
        assert rel <= VAL_RTOL, f"{what}: {got} vs {want} (rel {rel:.2e})"
    return abs(got - want) / max(abs(want), 1e-30)


def _check_grad(got, want, what):
    want = np.asarray(want, dtype=np.float64)
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    if scale == 0.0:
        assert err == 0.0, f"{what}: want an all-zero gradient, max |grad| {err}"
        return 0.0
    assert err <= GRAD_RTOL * scale, f"{what}: max-abs error {err:.3g} > {GRAD_RTOL} * {scale:.3g}"
    return err / scale


NTIL_PARAMS = [(c["name"], i) for c in NTIL["cases"] for i in range(len(c["results"]))]


def _ntil_id(p):
    case = next(c for c in NTIL["cases"] if c["name"] == p[0])
    r = case["results"][p[1]]
    return f"{p[0]}-{r['loss']}-{r['name']}"


@pytest.mark.parametrize("param", NTIL_PARAMS, ids=[_ntil_id(p) for p in NTIL_PARAMS])
def test_ntil_torch_matches_official(param):
    case = next(c for c in NTIL["cases"] if c["name"] == param[0])
    r = case["results"][param[1]]
    logits, labels = _inputs(case)
    w = r["weight"]
    errs = {}

    raw, g_raw = _value_and_grad(lambda x: _number(r, x, labels), logits)
    errs["raw"] = _check_value(raw, r["raw"], "raw")
    errs["grad_raw"] = _check_grad(g_raw, r["grad_raw"], "grad_raw")
    ce, _ = _value_and_grad(lambda x: ntil_torch.ce_loss(x, labels), logits)
    _check_value(ce, r["ce"], "ce")
    for how in ntil_torch.COMBINES:
        v, g = _value_and_grad(
            lambda x: ntil_torch.combine(ntil_torch.ce_loss(x, labels), _number(r, x, labels), w, how), logits)
        errs[how] = _check_value(v, r[how], how)
        errs[f"grad_{how}"] = _check_grad(g, r[f"grad_{how}"], f"grad_{how}")
    # the official combination's value is (1 + lambda) * CE (CE alone when the number loss is 0)
    want_scaled = r["ce"] * (1.0 + w) if r["raw"] > 0 else r["ce"]
    assert r["scaled"] == pytest.approx(want_scaled, rel=1e-6)
    print(f"{_ntil_id(param)}: " + " ".join(f"{k} {v:.1e}" for k, v in errs.items()))


@pytest.mark.parametrize("case", NTIL["cases"], ids=[c["name"] for c in NTIL["cases"]])
def test_official_gradient_touches_only_digit_logits_at_digit_labels(case):
    """The committed raw gradients are zero outside the ten digit columns and outside rows whose
    label is a digit: the number term sees nothing else (and ntl-patch must not either)."""
    _, labels = _inputs(case)
    digit_rows = ntil_torch.label_digits(labels, DIGIT_IDS).reshape(-1).numpy() >= 0
    other_cols = np.ones(NTIL["vocab_size"], dtype=bool)
    other_cols[DIGIT_IDS] = False
    for r in case["results"]:
        g = np.asarray(r["grad_raw"])
        assert not g[:, other_cols].any() and not g[~digit_rows].any(), (r["loss"], r["name"])
        assert g[digit_rows][:, DIGIT_IDS].any() == bool(digit_rows.any())


def test_cases_cover_the_traps():
    """The fixture exercises what it claims to (see fixtures/README.md), and the official values
    would catch an implementation that joined runs across sequences or ignored the exact-match rule."""
    by_name = {c["name"]: c for c in NTIL["cases"]}
    assert NTIL["digit_ids"] == DIGIT_IDS and NTIL["official"]["gumbel_noise"] == 0.0

    runs = by_name["runs"]
    logits, labels = _inputs(runs)
    lay = ntil_torch.run_layout(labels, DIGIT_IDS)
    assert lay["run"][0, -1] > 0 and lay["run"][1, 0] > 0, "a run ends sequence 0 and one starts sequence 1"
    assert (labels == -100).any(-1)[1] and not lay["is_digit"][2].any(), "-100 split; sequence 2 has no digit"
    joined = ntil_torch.ntil_loss(logits.double(), labels.reshape(1, -1), DIGIT_IDS).item()
    official = next(r for r in runs["results"] if r["loss"] == "ntil" and r["name"] == "defaults")
    assert abs(joined - official["raw"]) > 1e-3 * official["raw"], "the case must tell sequences apart"

    exact = by_name["decimal_exact"]
    logits, labels = _inputs(exact)
    lay = ntil_torch.run_layout(labels, DIGIT_IDS)
    z = logits.reshape(exact["B"], exact["T"], -1)[..., DIGIT_IDS]
    argmax_ok = z.argmax(-1) == lay["digit"]
    run907 = lay["run"][1] == 1
    assert argmax_ok[1][run907].all() and run907.sum() == 3, "907 is predicted exactly (abs term 0)"
    assert not argmax_ok[lay["is_digit"]].all(), "some digits are predicted wrong"
    t = ntil_torch.ntil_terms(logits.double(), labels, DIGIT_IDS)
    assert t["n_runs"].tolist() == [2, 2]  # 12 . 34 -> two runs; 907 and 5

    twenty = by_name["twenty_digits"]
    _, labels = _inputs(twenty)
    assert ntil_torch.run_layout(labels, DIGIT_IDS)["r"].max() == 19

    none = by_name["no_digits"]
    assert all(r["raw"] == 0.0 and r["scaled"] == r["ce"] for r in none["results"])


def test_place_values_are_clamped_at_1e30():
    """A 40-digit run stays finite in float32 (10^39 would overflow): leading digits share 10^30."""
    tok_ids = DIGIT_IDS
    labels = torch.tensor([[tok_ids[9]] * 40])
    logits = torch.zeros(1, 40, NTIL["vocab_size"])
    logits[..., tok_ids[1]] = 5.0  # argmax "1" everywhere: Xhat = 111..1 (clamped places)
    lay = ntil_torch.run_layout(labels, DIGIT_IDS)
    assert lay["r"][0, 0] == 39
    place = ntil_torch.place_values(lay["r"], torch.float32)
    assert torch.isfinite(place).all() and place.max() == torch.tensor(1e30, dtype=torch.float32)
    t = ntil_torch.ntil_terms(logits, labels, DIGIT_IDS)
    assert torch.isfinite(t["abs"]).all() and torch.isfinite(t["mag"]).all()
    assert t["mag"].item() == pytest.approx(np.log(9.0), rel=1e-5)  # (9.99..e30 + 1)/(1.11..e30 + 1)


def test_gumbel_noise_changes_only_near_ties():
    """With noise_scale c the straight-through sample is argmax(z + c*g), and two of ntil_torch's
    Gumbel samples differ by at most gumbel_spread(dtype) (42.6 in float64): once every digit
    position's top-2 logit gap exceeds c * that, noise cannot change the value."""
    case = next(c for c in NTIL["cases"] if c["name"] == "decimal_exact")
    logits, labels = _inputs(case)
    x = logits.double().reshape(case["B"], case["T"], -1).clone()
    z = x[..., DIGIT_IDS]
    top2 = z.topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]
    need = 0.01 * ntil_torch.gumbel_spread(torch.float64) + 0.05
    assert 0.45 < need < 0.5
    wide = torch.where(gap < need, need - gap, torch.zeros_like(gap))  # widen every near tie
    best = z.argmax(-1)
    for b in range(case["B"]):
        for t in range(case["T"]):
            x[b, t, DIGIT_IDS[best[b, t]]] += wide[b, t]
    clean = ntil_torch.ntil_loss(x, labels, DIGIT_IDS, noise_scale=0.0).item()
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        noisy = ntil_torch.ntil_loss(x, labels, DIGIT_IDS, noise_scale=0.01, generator=g).item()
        assert noisy == pytest.approx(clean, rel=1e-12)
    # and a large noise does change it (the noise is really applied)
    values = {round(ntil_torch.ntil_loss(x, labels, DIGIT_IDS, noise_scale=5.0, generator=g).item(), 9)
              for _ in range(20)}
    assert len(values) > 1


# ----------------------------------------------------------------------------- number level

NL_PARAMS = [(c["name"], i) for c in NUMBER_LEVEL["cases"] for i in range(len(c["results"]))]


def _nl_id(p):
    case = next(c for c in NUMBER_LEVEL["cases"] if c["name"] == p[0])
    r = case["results"][p[1]]
    return f"{p[0]}-float{int(r['float_level'])}-reweigh{int(r['reweigh'])}"


@pytest.mark.parametrize("param", NL_PARAMS, ids=[_nl_id(p) for p in NL_PARAMS])
def test_number_level_cases_match_ntloss(param):
    """Consistency of the committed file with the installed ntloss 0.3.2 NumberLevelLoss."""
    assert NUMBER_LEVEL["ntloss_version"] == "0.3.2"
    case = next(c for c in NUMBER_LEVEL["cases"] if c["name"] == param[0])
    r = case["results"][param[1]]
    logits, labels = _inputs(case)
    B, T = case["B"], case["T"]
    obj = ntil_torch.number_level_object(float_level=r["float_level"], reweigh=r["reweigh"])

    def nll(x):
        return obj(x.reshape(B, T, -1), labels, reduction="mean")

    raw, _ = _value_and_grad(nll, logits)
    _check_value(raw, r["raw"], "raw")
    total, g = _value_and_grad(lambda x: ntil_torch.ce_loss(x, labels) + r["weight"] * nll(x), logits)
    _check_value(total, r["total"], "total")
    _check_grad(g, r["grad_total"], "grad_total")


def test_number_level_float_mode_differs_only_with_dots():
    by = {c["name"]: {(r["float_level"], r["reweigh"]): r["raw"] for r in c["results"]}
          for c in NUMBER_LEVEL["cases"]}
    assert by["decimal_exact"][(True, False)] != by["decimal_exact"][(False, False)]  # 12.34
    for name in ("runs", "twenty_digits", "no_digits"):
        assert by[name][(True, False)] == by[name][(False, False)], name
    assert all(v == 0.0 for v in by["no_digits"].values())

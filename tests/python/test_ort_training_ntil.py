"""ONNX Runtime Training end-to-end check of `ntl-patch --loss ntil|emd|number-level`.

Same structure as test_ort_training.py (its helpers: ort_helpers.py): for each fixture model x
setting, patch with the CLI, build AdamW training artifacts with every parameter trainable, then
  1. one training step: outputs `loss`, `ce_loss`, `number_loss` within 1e-5 (relative) and every
     parameter gradient within 1e-4 (norm-relative, as in test_ort_training.py) of torch autograd
     in float64: fixtures/ntil_torch.py for ntil/emd (checked against the official NTIL code by
     test_ntil_reference.py) and ntloss 0.3.2 NumberLevelLoss for number-level;
  2. 30 AdamW steps on the fixed batch: the loss goes down (for the official `scaled`
     combination the loss VALUE is (1 + lambda) * CE at every step, so that is checked too).
NTIL runs with --gumbel-noise 0 (forward = argmax) in those; test_ntil_default_noise_trains runs
the default noise 0.01 and compares the forward with the noise-free one, near-ties excepted.

The batch (B=3, T=11) holds multi-digit numbers, a decimal 12.5 / 15.5, prompt labels masked with
-100 and padding.
"""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ort_helpers import FWD_RTOL, LR, TRAIN_STEPS, WEIGHT, assert_param_grads, patch, quiet_ort

import ntil_torch  # noqa: E402  (fixtures/ is on sys.path, see conftest)

NTIL_OFF = {"digit_exp": 1.2, "abs_alpha": 0.2, "mag_alpha": 0.2, "digit_alpha": 1.0, "tau": 0.1,
            "noise_scale": 0.0}
NTIL_CUSTOM = {"digit_exp": 1.5, "abs_alpha": 0.5, "mag_alpha": 0.3, "digit_alpha": 0.8, "tau": 0.5,
               "noise_scale": 0.0}
NTIL_CUSTOM_CLI = ["--digit-exp", "1.5", "--abs-alpha", "0.5", "--mag-alpha", "0.3", "--digit-alpha", "0.8",
                   "--gumbel-tau", "0.5", "--gumbel-noise", "0"]

# (model, loss, extra CLI args, combine the reference uses, reference settings)
CASES = []
for _model in ("lm_flat", "lm_bvt", "lm_nll"):
    CASES += [
        (_model, "ntil", ["--combine", "scaled", "--gumbel-noise", "0"], "scaled", NTIL_OFF),
        (_model, "ntil", ["--combine", "add", "--gumbel-noise", "0"], "add", NTIL_OFF),
        (_model, "emd", ["--combine", "scaled"], "scaled", {"digit_exp": 1.0}),
        (_model, "number-level", [], "add", {"float_level": False, "reweigh": False}),
        (_model, "number-level", ["--float-level"], "add", {"float_level": True, "reweigh": False}),
    ]
# DIST2Loss, DEL, SMMD (CE + λ·L; references: fixtures/dist2_smmd_del_torch.py, checked against the
# authors' code by test_dist2_smmd_del_reference.py)
for _model in ("lm_flat", "lm_bvt", "lm_nll"):
    CASES += [(_model, loss, [], "add", {}) for loss in ("dist2", "del", "smmd")]
CASES += [
    ("lm_flat", "dist2", ["--dist2-tau", "2"], "add", {"tau": 2.0}),
    ("lm_flat", "smmd", ["--kernel", "laplace", "--sigma", "1", "--sigma", "4", "--squash", "1",
                         "--smmd-alpha", "0.5"],
     "add", {"kernel": "laplace", "sigmas": (1.0, 4.0), "squash": 1.0, "alpha": 0.5}),
]
CASES += [
    # every NTIL knob moved; no --combine: ntil defaults to scaled
    ("lm_flat", "ntil", NTIL_CUSTOM_CLI, "scaled", NTIL_CUSTOM),
    ("lm_flat", "emd", ["--combine", "add", "--digit-exp", "1.2"], "add", {"digit_exp": 1.2}),
    ("lm_flat", "number-level", ["--reweigh"], "add", {"float_level": False, "reweigh": True}),
]


def _case_id(case) -> str:
    model, loss, extra, _, _ = case
    tail = "".join(a.lstrip("-").replace("-", "_") if a.startswith("--") else a for a in extra)
    return "-".join([model, loss] + ([tail] if tail else []))


def batch() -> tuple[np.ndarray, np.ndarray]:
    """B=3, T=11 (tokens of the fixture tokenizer; labels = next token, -100 = ignore)."""
    vocab = ntil_torch.hf_tokenizer().get_vocab()
    seqs = [
        "<bos> 1 2 + 3 4 = 4 6 <eos> <pad> <pad>",
        "<bos> 1 2 . 5 + 3 = 1 5 . 5",
        "<bos> 9 0 7 times 2 is 1 8 1 4 <eos>",
    ]
    toks = np.array([[vocab[t] for t in s.split()] for s in seqs], dtype=np.int64)
    input_ids, labels = toks[:, :-1].copy(), toks[:, 1:].copy()
    labels[labels == vocab["<pad>"]] = -100
    labels[2, :6] = -100  # prompt "9 0 7 times 2 is" masked: only the answer 1814 <eos> is learned
    return input_ids, labels


def _artifacts(patched, params, tmp_path: Path):
    ort = quiet_ort()
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module

    art = tmp_path / "artifacts"
    art.mkdir()
    artifacts.generate_artifacts(patched, requires_grad=params, frozen_params=[], loss=None,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(art))
    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    module = Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"),
                    device="cpu", session_options=so)
    module.train()
    return art, state, module


def _optimizer(art: Path, module):
    from onnxruntime.training.api import Optimizer

    opt = Optimizer(str(art / "optimizer_model.onnx"), module)
    opt.set_learning_rate(LR)
    return opt


def _outputs(module, input_ids, labels, n_outputs):
    outs = module(input_ids, labels)
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert len(outs) == n_outputs
    return float(outs[0]), float(outs[-2]), float(outs[-1])


def _digit_gaps(weights, input_ids, labels) -> np.ndarray:
    """Top-2 gap of the ten digit logits at every digit-label position (float64 torch)."""
    logits = ntil_torch.model_logits(weights, torch.from_numpy(input_ids))
    digit_ids = ntil_torch.digit_token_ids()
    z = logits[..., digit_ids]
    top2 = z.topk(2, dim=-1).values
    is_digit = ntil_torch.label_digits(torch.from_numpy(labels), digit_ids) >= 0
    return (top2[..., 0] - top2[..., 1])[is_digit].numpy()


def _params(patched, weights):
    import onnx

    float_inits = {i.name for i in patched.graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    params = sorted(weights)
    missing = [p for p in params if p not in float_inits]
    assert not missing, f"parameters lost by the patch: {missing}"
    return params


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_patched_model_trains_in_ort(case, weights, tmp_path):
    model, loss, extra, how, settings = case
    t0 = time.perf_counter()
    patched = patch(model, loss, extra, tmp_path / f"{model}.ntl.onnx")
    params = _params(patched, weights)
    art, state, module = _artifacts(patched, params, tmp_path)
    input_ids, labels = batch()
    if loss == "ntil":  # float32 (ORT) and float64 (torch) must agree on every argmax
        gaps = _digit_gaps(weights, input_ids, labels)
        assert gaps.min() > 1e-4, f"the batch has a near-tie digit argmax (gap {gaps.min():.2e})"

    # -- one training step vs torch autograd (float64)
    got_total, got_ce, got_num = _outputs(module, input_ids, labels, len(patched.graph.output))
    if loss in ("dist2", "del", "smmd"):
        import dist2_smmd_del_torch

        want_total, want_ce, want_num, want_grads = dist2_smmd_del_torch.model_reference(
            weights, torch.from_numpy(input_ids), torch.from_numpy(labels), loss, WEIGHT, **settings)
    else:
        want_total, want_ce, want_num, want_grads = ntil_torch.model_reference(
            weights, torch.from_numpy(input_ids), torch.from_numpy(labels), loss, how, WEIGHT, **settings)
    assert want_num > 0, "the batch must exercise the number loss"
    np.testing.assert_allclose(got_ce, want_ce, rtol=FWD_RTOL, err_msg="ce_loss")
    np.testing.assert_allclose(got_num, want_num, rtol=FWD_RTOL, err_msg="number_loss")
    np.testing.assert_allclose(got_total, want_total, rtol=FWD_RTOL, err_msg="loss")
    if how == "scaled":
        np.testing.assert_allclose(got_total, (1 + WEIGHT) * got_ce, rtol=FWD_RTOL,
                                   err_msg="scaled: loss must be (1 + lambda) * ce_loss")

    total_err, worst, worst_err = assert_param_grads(state, params, want_grads)

    # -- 30 AdamW steps on the fixed batch
    module.lazy_reset_grad()
    opt = _optimizer(art, module)
    losses, ces, nums = [], [], []
    for _ in range(TRAIN_STEPS):
        total, ce, num = _outputs(module, input_ids, labels, len(patched.graph.output))
        losses.append(total)
        ces.append(ce)
        nums.append(num)
        opt.step()
        module.lazy_reset_grad()
    assert np.isfinite(losses).all() and np.isfinite(nums).all(), (losses, nums)
    assert losses[0] == pytest.approx(got_total, rel=1e-6)
    if how == "scaled":
        np.testing.assert_allclose(losses, (1 + WEIGHT) * np.array(ces), rtol=FWD_RTOL)
    assert losses[-1] < 0.7 * losses[0], f"loss did not go down clearly: {losses}"
    # DEL is not monotone in the prediction's confidence: its BCE reads the raw digit logits, and
    # while CE training lifts p(label digit) from 0.02 to 0.6 it rises (0.0029 -> 0.0046 in torch
    # at λ 0.3) before it falls (with λ 30 it falls by 40 % in the same 30 steps); so for DEL
    # only the total must go down here.
    if loss != "del":
        assert nums[-1] < nums[0], f"number loss did not go down: {nums}"
    print(f"{_case_id(case)}: grad err {total_err:.2e} (worst {worst} {worst_err:.2e}); "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; number {nums[0]:.4f} -> {nums[-1]:.4f}; "
          f"{time.perf_counter() - t0:.1f}s")


# ----------------------------------------------------------------------------- Gumbel noise

NOISE = 0.01  # ntl-patch's --gumbel-noise default (the official gumbel_softmax's noise_scale)
# Two Gumbel samples -ln(-ln u) with u a float32 in (0, 1) differ by less than 25
# (u >= 2^-149 gives >= -4.7, u <= 1 - 2^-24 gives <= 16.7). So the noise moves one digit logit
# relative to another by less than NOISE * 25: a digit label position is a NEAR-TIE when its
# top-2 digit logits are closer than that, and only there may the noisy argmax differ from the
# noise-free one. (u exactly 0 would give -inf and could demote any argmax: assumed not drawn.)
NEAR_TIE = NOISE * 25.0
MAX_EXACT = 4096  # enumerate the noisy values exactly up to this many; beyond, check the range


class NoiseOutcomes:
    """The values the noisy NTIL can take (float64, ntil_torch) when each near-tie position may
    pick any digit within NEAR_TIE of its top logit, independently for the abs and the mag term
    (the official code draws one sample for each).

    Per sequence b the set S_b = {digit_alpha*EMD_b + abs_alpha*abs_b(choice) + mag_alpha*mag_b(choice')}
    is enumerated; NTIL = mean_b S_b. When the product of the |S_b| exceeds MAX_EXACT (many
    near-ties, e.g. at the untrained weights) only the range [mean min S_b, mean max S_b] is
    checked -- a necessary condition, reported as such."""

    def __init__(self, weights, input_ids, labels, settings=NTIL_OFF):
        logits = ntil_torch.model_logits(weights, torch.from_numpy(input_ids))  # [B, T, V]
        lab = torch.from_numpy(labels)
        digit_ids = ntil_torch.digit_token_ids()
        s = settings
        kw = {"digit_exp": s["digit_exp"], "tau": s["tau"]}
        emd = ntil_torch.ntil_terms(logits, lab, digit_ids, **kw)["emd"]
        z = logits[..., digit_ids]
        is_digit = ntil_torch.label_digits(lab, digit_ids) >= 0
        self.n_near = 0
        self.per_seq = []
        for b in range(lab.shape[0]):
            near = []
            for t in torch.nonzero(is_digit[b]).flatten().tolist():
                cand = torch.nonzero(z[b, t] >= z[b, t].max() - NEAR_TIE).flatten().tolist()
                if len(cand) > 1:
                    near.append((t, cand))
            self.n_near += len(near)
            choices = list(itertools.product(*[c for _, c in near]))
            assert len(choices) <= 512, f"too many near-ties in sequence {b}: {near}"
            terms = set()
            for choice in choices:
                x = logits[b:b + 1].clone()
                for (t, _), d in zip(near, choice):
                    x[0, t, digit_ids[d]] = x[0, t, digit_ids].max() + 1.0  # force the argmax to d
                tb = ntil_torch.ntil_terms(x, lab[b:b + 1], digit_ids, **kw)
                terms.add((tb["abs"].item(), tb["mag"].item()))
            a = {x for x, _ in terms}
            m = {y for _, y in terms}
            self.per_seq.append(sorted({s["digit_alpha"] * emd[b].item() + s["abs_alpha"] * x
                                        + s["mag_alpha"] * y for x in a for y in m}))
        self.B = lab.shape[0]
        self.exact = math.prod(len(v) for v in self.per_seq) <= MAX_EXACT
        self.values = (sorted({sum(c) / self.B for c in itertools.product(*self.per_seq)})
                       if self.exact else None)
        self.lo = sum(v[0] for v in self.per_seq) / self.B
        self.hi = sum(v[-1] for v in self.per_seq) / self.B

    def allows(self, value: float) -> bool:
        if self.exact:
            return any(abs(value - c) <= FWD_RTOL * abs(c) for c in self.values)
        return self.lo * (1 - FWD_RTOL) <= value <= self.hi * (1 + FWD_RTOL)

    def __str__(self) -> str:
        what = f"{len(self.values)} values" if self.exact else f"range [{self.lo:.6g}, {self.hi:.6g}]"
        return f"{self.n_near} near-ties (gap < {NEAR_TIE}): {what}"


def test_noise_outcomes_cover_torch_noise(weights):
    """Self-check of NoiseOutcomes (no CLI needed): ntil_torch's own noisy NTIL, at a noise
    scale whose float64 Gumbel spread stays within NEAR_TIE, is always allowed; and with no
    near-tie the noise-free value is the only one."""
    input_ids, labels = batch()
    digit_ids = ntil_torch.digit_token_ids()
    lab = torch.from_numpy(labels)
    g = torch.Generator().manual_seed(1)
    scale = NEAR_TIE / ntil_torch.gumbel_spread(torch.float64)
    kinds = set()
    for head_scale in (1.0, 10.0, 100.0):  # many near-ties (range), a few (exact), none
        w = {k: v * head_scale if k.startswith("head") else v for k, v in weights.items()}
        out = NoiseOutcomes(w, input_ids, labels)
        kinds.add("none" if out.n_near == 0 else "exact" if out.exact else "range")
        logits = ntil_torch.model_logits(w, torch.from_numpy(input_ids))
        clean = ntil_torch.ntil_loss(logits, lab, digit_ids).item()
        assert out.allows(clean)
        if out.n_near == 0:
            assert out.exact and len(out.values) == 1
        for _ in range(10):
            v = ntil_torch.ntil_loss(logits, lab, digit_ids, noise_scale=scale, generator=g).item()
            assert out.allows(v), (v, str(out))
        print(f"head x{head_scale:g}: {out}")
    assert kinds == {"none", "exact", "range"}, kinds


def test_ntil_default_noise_trains(weights, tmp_path):
    """Default --gumbel-noise (0.01), official scaled combination: 30 AdamW steps run and lower
    the loss; at the initial and the trained weights, every noisy forward's number_loss is one of
    the values the noise-free NTIL takes when the near-tie positions pick any near-tied digit
    (exactly the noise-free value when there is no near-tie), and loss = (1 + lambda) * ce_loss."""
    model = "lm_flat"
    patched = patch(model, "ntil", [], tmp_path / f"{model}.ntl.onnx")
    params = _params(patched, weights)
    art, state, module = _artifacts(patched, params, tmp_path)
    input_ids, labels = batch()
    n_out = len(patched.graph.output)

    def check_forward(w, when, n):
        allowed = NoiseOutcomes(w, input_ids, labels)
        seen = []
        for _ in range(n):
            total, ce, num = _outputs(module, input_ids, labels, n_out)
            assert np.isfinite([total, ce, num]).all()
            np.testing.assert_allclose(total, (1 + WEIGHT) * ce, rtol=FWD_RTOL)
            assert allowed.allows(num), f"{when}: noisy number_loss {num} not allowed by {allowed}"
            seen.append(num)
        module.lazy_reset_grad()
        return allowed, seen

    at_start, seen = check_forward(weights, "initial weights", 10)
    # the noise is really drawn, afresh on every run: at the initial weights two digit positions
    # have top-2 gaps of 0.003 and 0.012, which noise 0.01 flips about 40% / 25% of the time
    # (separately for abs and mag), so 10 equal values would be a ~1e-7 event
    assert len(set(seen)) > 1, f"10 noisy forwards gave the same number_loss {seen[0]}"
    opt = _optimizer(art, module)
    losses = []
    for _ in range(TRAIN_STEPS):
        total, ce, num = _outputs(module, input_ids, labels, n_out)
        losses.append(total)
        opt.step()
        module.lazy_reset_grad()
    assert np.isfinite(losses).all(), losses
    assert losses[-1] < 0.7 * losses[0], f"loss did not go down clearly: {losses}"
    trained = {n: torch.from_numpy(np.array(state.parameters[n].data, dtype=np.float32)) for n in params}
    at_end, _ = check_forward(trained, "trained weights", 3)
    assert at_end.exact, f"trained weights: {at_end}"
    print(f"default noise: loss {losses[0]:.4f} -> {losses[-1]:.4f}; initial: {at_start} "
          f"({len(set(seen))} distinct of 10); trained: {at_end}")

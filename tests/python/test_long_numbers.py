"""Label numbers far longer than NTIL's place bounds keep the loss and its gradient finite and
right in float32, through ONNX Runtime Training (logits as the trainable parameter,
logits_param.py), against torch autograd in float64 (fixtures/ntil_torch.py, which bounds the
places as ntl-patch documents):
  - the token-level weight digit_exp**r: unbounded in the official code, inf in float32 from a
    run of 488 digits on at the default 1.2 (loss inf); its exponent is clamped where the
    weight would pass 1e30;
  - the magnitude term ln((max+1)/(min+1)): as a ratio, ORT's DivGrad formed hi/lo**2, inf from
    a 31-digit prediction against a label of zeros (NaN gradient); it is ln(max+1) - ln(min+1);
  - the abs term |X^-X|/(max+1): a 9000-digit number is 8e34 even with places clamped at 1e30,
    and DivGrad's squared (scaled) denominator overflowed and dropped a gradient term; the
    label-side scale also divides by the square root of the clamped places' count.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ntil_torch
from logits_param import ort_step, rel_err

WEIGHT = 0.3


def _vocab():
    vocab = ntil_torch.hf_tokenizer().get_vocab()
    return vocab, ntil_torch.digit_token_ids(), vocab["+"]


def _random_run(n: int) -> tuple[np.ndarray, np.ndarray]:
    """[1, n + 1]: n random digit labels, then a non-digit; random logits."""
    vocab, digits, other = _vocab()
    rng = np.random.default_rng(21)
    labels = np.empty((1, n + 1), np.int64)
    labels[0, :n] = np.asarray(digits)[rng.integers(0, 10, n)]
    labels[0, n] = other
    logits = (np.random.default_rng(7).standard_normal((1, n + 1, len(vocab))) * 3).astype(np.float32)
    return logits, labels


def _zeros_predicted_as_nines(n: int) -> tuple[np.ndarray, np.ndarray]:
    """[1, n + 2]: a run of n zeros between non-digits, the logits favouring the digit 9, so
    the predicted number is the largest and the label's is 0."""
    vocab, digits, other = _vocab()
    labels = np.full((1, n + 2), other, np.int64)
    labels[0, 1:n + 1] = digits[0]
    logits = np.random.default_rng(7).standard_normal((1, n + 2, len(vocab))).astype(np.float32)
    logits[0, :, digits[9]] += 6.0
    return logits, labels


CASES = [
    # (id, inputs, ntl-patch args, reference settings)
    ("ntil-700-digit-weights", lambda: _random_run(700), ["--loss", "ntil", "--gumbel-noise", "0"],
     dict(loss="ntil", noise_scale=0.0)),
    ("emd-700-digit-weights", lambda: _random_run(700), ["--loss", "emd", "--digit-exp", "1.2"],
     dict(loss="emd", digit_exp=1.2)),
    ("ntil-magnitude-40-zeros", lambda: _zeros_predicted_as_nines(40),
     ["--loss", "ntil", "--gumbel-noise", "0", "--digit-alpha", "0"],
     dict(loss="ntil", noise_scale=0.0, digit_alpha=0.0)),
    ("ntil-abs-9000-zeros", lambda: _zeros_predicted_as_nines(9000),
     ["--loss", "ntil", "--gumbel-noise", "0", "--digit-alpha", "0"],
     dict(loss="ntil", noise_scale=0.0, digit_alpha=0.0)),
]


@pytest.mark.parametrize("make,args,settings", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_runs_of_hundreds_and_thousands_of_digits(make, args, settings):
    logits, labels = make()
    v = logits.shape[-1]
    outs, grad = ort_step(logits, labels, [*args, "--combine", "add", "--weight", str(WEIGHT)])

    z = torch.from_numpy(logits.astype(np.float64)).requires_grad_()
    y = torch.from_numpy(labels)
    ce = F.cross_entropy(z.reshape(-1, v), y.reshape(-1), ignore_index=-100)
    settings = dict(settings)
    number = ntil_torch.number_loss(settings.pop("loss"), z, y, **settings)
    total = ce + WEIGHT * number
    (want,) = torch.autograd.grad(total, z)

    assert all(np.isfinite(x) for x in outs.values()), outs
    assert np.isfinite(grad).all()
    # float32 powers 1.2**r up to r = 379 round by about r * 2**-24 (2e-5) relative
    assert abs(outs["number_loss"] - number.item()) <= 1e-4 * abs(number.item()), (outs, number.item())
    assert abs(outs["loss"] - total.item()) <= 1e-4 * abs(total.item())
    assert rel_err(grad, want.reshape(-1, v).numpy()) <= 1e-4

"""Synthetic arithmetic task with numeric answers, character-level tokens.

Problems are `a+b=` (operands up to 3 digits) and `a*b=` (operands up to 2 digits); the model
must write the answer digits (most significant first, no leading zeros) and `<eos>`.

Operand ranges (per operation, `S` = 1000 for `+` and 100 for `*`):

| split | operands |
| --- | --- |
| train | both in [0, 0.8·S), neither in the band [0.35·S, 0.45·S), pair not held out by hash |
| `iid` (unseen pairs) | like train, but only pairs the hash holds out (never trained on) |
| `interp` | one operand in the band [0.35·S, 0.45·S), the other from the training range |
| `extrap` | one operand in [0.8·S, S), the other from the training range |

`interp` asks for values between the ones seen in training (`3xx` and `4xx` operands are seen,
350..449 never); `extrap` for operands above the training range (a hundreds digit 8 or 9 for
`+`, a tens digit 8 or 9 for `*`, never seen in an operand). Operand digit counts are drawn
uniformly (1..3 for `+`, 1..2 for `*`), then the value uniformly within that digit count.

Sequences: `a op b = answer <eos>`, one token per character; `input_ids = seq[:-1]`,
`labels = seq[1:]` with -100 on every position whose target is still part of the prompt and on
padding, so the answer digits and `<eos>` are supervised.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

PAD, EOS = "<pad>", "<eos>"
DIGITS = [str(d) for d in range(10)]
VOCAB = [PAD, EOS, *DIGITS, "+", "*", "="]
TOK = {t: i for i, t in enumerate(VOCAB)}
PAD_ID, EOS_ID, EQ_ID = TOK[PAD], TOK[EOS], TOK["="]
DIGIT_IDS = np.array([TOK[d] for d in DIGITS])
IGNORE = -100

OPS = ("+", "*")
SCALE = {"+": 1000, "*": 100}  # operands < SCALE
NDIGITS = {"+": 3, "*": 2}
SPLITS = ("iid", "interp", "extrap")


def band(op: str) -> tuple[int, int]:
    s = SCALE[op]
    return int(0.35 * s), int(0.45 * s)


def train_max(op: str) -> int:
    return int(0.8 * SCALE[op])


def answer(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a + b if op == "+" else a * b


def max_answer_digits(op: str) -> int:
    s = SCALE[op] - 1
    return len(str(s + s if op == "+" else s * s))


def held_out(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairs reserved for the `iid` test split (about 10% of all pairs), by a fixed integer hash."""
    x = (a.astype(np.uint64) * np.uint64(1009) + b.astype(np.uint64)) * np.uint64(2) + np.uint64(OPS.index(op))
    x = (x ^ (x >> np.uint64(31))) * np.uint64(0x9E3779B97F4A7C15)
    x = x ^ (x >> np.uint64(29))
    return (x % np.uint64(10)) == np.uint64(0)


def in_band(op: str, v: np.ndarray) -> np.ndarray:
    lo, hi = band(op)
    return (v >= lo) & (v < hi)


def _sample_train_operand(op: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Operands of the training range: digit count uniform, then the value uniform, band excluded."""
    out = np.empty(n, dtype=np.int64)
    todo = np.arange(n)
    while todo.size:
        d = rng.integers(1, NDIGITS[op] + 1, todo.size)
        lo = np.where(d == 1, 0, 10 ** (d - 1))
        hi = np.minimum(10 ** d, train_max(op))
        v = lo + (rng.random(todo.size) * (hi - lo)).astype(np.int64)
        ok = ~in_band(op, v)
        out[todo[ok]] = v[ok]
        todo = todo[~ok]
    return out


def sample(op: str, split: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n operand pairs (a, b) of one operation for split in train|iid|interp|extrap."""
    a_out, b_out = np.empty(0, np.int64), np.empty(0, np.int64)
    while a_out.size < n:
        m = 2 * (n - a_out.size) + 16
        a, b = _sample_train_operand(op, m, rng), _sample_train_operand(op, m, rng)
        if split in ("train", "iid"):
            h = held_out(op, a, b)
            keep = ~h if split == "train" else h
        else:
            if split == "interp":
                lo, hi = band(op)
            elif split == "extrap":
                lo, hi = train_max(op), SCALE[op]
            else:
                raise ValueError(split)
            special = rng.integers(lo, hi, m)
            first = rng.random(m) < 0.5
            a, b = np.where(first, special, a), np.where(first, b, special)
            keep = np.ones(m, bool)
        a_out = np.concatenate([a_out, a[keep]])
        b_out = np.concatenate([b_out, b[keep]])
    return a_out[:n], b_out[:n]


def encode_chars(s: str) -> list[int]:
    return [TOK[c] for c in s]


def prompt_tokens(op: str, a: int, b: int) -> list[int]:
    return encode_chars(f"{a}{op}{b}=")


def sequences(op: str, a: np.ndarray, b: np.ndarray) -> list[list[int]]:
    ans = answer(op, a, b)
    return [prompt_tokens(op, int(x), int(y)) + encode_chars(str(int(z))) + [EOS_ID]
            for x, y, z in zip(a, b, ans)]


def batch(seqs: list[list[int]], length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forcing batch: input_ids = seq[:-1], labels = seq[1:], -100 on prompt and padding."""
    t = max(len(s) for s in seqs) - 1 if length is None else length
    ids = np.full((len(seqs), t), PAD_ID, dtype=np.int64)
    lab = np.full((len(seqs), t), IGNORE, dtype=np.int64)
    for i, s in enumerate(seqs):
        n = len(s) - 1
        ids[i, :n] = s[:-1]
        q = s.index(EQ_ID)  # position of "="; its next-token target is the first answer digit
        lab[i, q:n] = s[q + 1:]
    return ids, lab


def train_batch(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Half `+`, half `*`, shuffled, padded to the longest sequence of the batch."""
    seqs = []
    for op, k in zip(OPS, (n - n // 2, n // 2)):
        a, b = sample(op, "train", k, rng)
        seqs += sequences(op, a, b)
    order = rng.permutation(len(seqs))
    return batch([seqs[i] for i in order])


def max_seq_len() -> int:
    return max(2 * NDIGITS[op] + 2 + max_answer_digits(op) + 1 for op in OPS)


def write_tokenizer(path: Path) -> None:
    """Hugging Face WordLevel tokenizer, one token per character (what ntl-patch reads)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel(dict(TOK), unk_token=PAD))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.add_special_tokens([PAD, EOS])
    tk.save(str(path), pretty=True)
    # the file must tokenize exactly as this module does
    got = Tokenizer.from_file(str(path)).encode("907*12=10884").ids
    assert got == encode_chars("907*12=10884"), got
    json.loads(path.read_text())


def decode_number(tokens: list[int]) -> tuple[int | None, str]:
    """The answer text up to <eos> (or the end) and its value: the leading digit run, None if empty."""
    text = []
    for t in tokens:
        if t == EOS_ID:
            break
        text.append(VOCAB[t] if 0 <= t < len(VOCAB) else "?")
    s = "".join(text)
    run = ""
    for c in s:
        if c.isdigit():
            run += c
        else:
            break
    return (int(run) if run else None), s

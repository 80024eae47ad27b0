#!/usr/bin/env python3
"""Benchmark one full training step (forward, backward, AdamW update) at a large logits width.

    .venv/bin/python scripts/bench/bench_training_step.py [--batch 4 --seq 512 --vocab 32000 ...]
    scripts/bench/bench_training_step.sh          # builds target/release/ntl-patch first

Question answered: what does the number loss cost per step, spliced by ntl-patch into ONNX
Runtime Training artifacts, compared with the cross-entropy alone?

Variants, all on the same model (fixtures/tiny_lm.py TinyLM, "flat" CE, widened to --vocab,
--dim, --hidden), the same weights and the same batch, timed in the same process:

  ce        ORT Training, CE only: the TorchScript export (training=TRAINING,
            do_constant_folding=False, like fixtures/generate.py) -> generate_artifacts(loss=None,
            AdamW)
  fwd       ORT Training, CE + 0.3*NTL-WAS: `ntl-patch model.onnx --loss wasserstein` (forward
            patch) -> generate_artifacts: ORT's autodiff builds the NTL backward
  art       ORT Training, CE + 0.3*NTL-WAS: `ntl-patch artifacts <ce artifacts>` (forward plus
            analytic backward spliced into the CE-only training artifacts)
  torch     torch eager: CE + 0.3*ntloss.NTLoss(digit_level=True, reweigh=False), AdamW
  torch-ce  torch eager, CE only (reference for torch's own NTL overhead)
and with --ntil (default on) the same pair for `--loss ntil --gumbel-noise 0`:
  fwd-ntil, art-ntil
and with --reweigh-variants: fwd-rw, art-rw (`--reweigh`, which needs the full-V softmax mass).

Each variant runs --warmup steps first; then --rounds rounds: in each, every ORT variant runs
--steps step(s) in a rotated order, each one between two steps of `ce` (and `torch` between two
`torch-ce` steps), so machine noise hits all variants alike. Reported: median, min, p10/p90
seconds per step, the ratio of medians to `ce`, and the median paired ratio (each step over the
mean of its two neighbouring baseline steps). With --eval-steps > 0 the eval-mode forward
(module.eval(); module(...)) of every ORT variant is timed too. With --profile-runs > 0 (default
3), each ORT training graph is then run in an InferenceSession with enable_profiling, and the
kernel time of the nodes the number loss added is reported.

Before timing, a correctness check: the first step's losses of fwd/art/torch agree, and the
parameter gradients of fwd and art agree (norm-relative).

torch and ORT use the same thread count (--threads: torch.set_num_threads, ORT
intra_op_num_threads; inter-op 1 in both).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures"
sys.path.insert(0, str(FIXTURES))
sys.dont_write_bytecode = True  # no __pycache__ in fixtures/

WEIGHT = 0.3
LR = 1e-3


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=1, help="steps per variant per round")
    p.add_argument("--eval-steps", type=int, default=0, help="eval forwards per ORT variant per round (0: off)")
    p.add_argument("--profile-runs", type=int, default=3,
                   help="per-node profile: runs of each ORT training graph in an InferenceSession (0: off)")
    p.add_argument("--digit-frac", type=float, default=0.3, help="share of labels that are digit tokens")
    p.add_argument("--ignore-frac", type=float, default=0.02, help="share of labels that are -100")
    p.add_argument("--ntil", action=argparse.BooleanOptionalAction, default=True,
                   help="also time --loss ntil --gumbel-noise 0 (fwd-ntil, art-ntil)")
    p.add_argument("--reweigh-variants", action="store_true",
                   help="also time --loss wasserstein --reweigh (fwd-rw, art-rw)")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--bin", default=os.environ.get("NTL_PATCH_BIN", str(REPO / "target/release/ntl-patch")))
    p.add_argument("--workdir", default=str(REPO / "target" / "bench-training-step"))
    p.add_argument("--json", help="write raw timings here")
    p.add_argument("--markdown", help="write the result section (Markdown) here")
    p.add_argument("--seed", type=int, default=20240917)
    return p.parse_args()


# ----------------------------------------------------------------------------- setup


def set_threads(n: int):
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass


def make_tokenizer(path: Path, vocab_size: int, seed: int) -> dict[str, int]:
    """WordLevel vocab of `vocab_size` tokens: 4 specials, "0".."9" at scattered ids (neither
    contiguous nor sorted by value), the rest "w<i>"."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<unk>", "<bos>", "<eos>"]
    rng = random.Random(seed)
    digit_ids = rng.sample(range(len(specials), vocab_size), 10)
    assert digit_ids != sorted(digit_ids)
    vocab = {t: i for i, t in enumerate(specials)}
    for d, i in enumerate(digit_ids):
        vocab[str(d)] = i
    taken = set(vocab.values())
    k = 0
    for i in range(vocab_size):
        if i not in taken:
            vocab[f"w{k}"] = i
            k += 1
    assert len(vocab) == vocab_size == len(set(vocab.values()))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens(specials)
    tk.save(str(path))
    return vocab


def make_batch(args, digit_ids: list[int]):
    import numpy as np

    rng = np.random.default_rng(args.seed)
    shape = (args.batch, args.seq)
    ids = rng.integers(0, args.vocab, shape, dtype=np.int64)
    labels = rng.integers(4, args.vocab, shape, dtype=np.int64)
    u = rng.random(shape)
    digits = np.asarray(digit_ids, np.int64)[rng.integers(0, 10, shape)]
    labels = np.where(u < args.digit_frac, digits, labels)
    labels = np.where(u > 1.0 - args.ignore_frac, -100, labels)
    return ids, labels


def export_model(args, path: Path):
    """TinyLM at the bench size, exported like fixtures/generate.py:export_torchscript."""
    import torch

    import tiny_lm

    torch.manual_seed(args.seed)
    model = tiny_lm.TinyLM(vocab=args.vocab, dim=args.dim, hidden=args.hidden, ce="flat").eval()
    g = torch.Generator().manual_seed(args.seed + 1)
    ex_ids = torch.randint(0, args.vocab, (2, 7), generator=g)
    ex_lab = torch.randint(0, args.vocab, (2, 7), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (ex_ids, ex_lab), str(path),
            dynamo=False,
            opset_version=17,
            training=torch.onnx.TrainingMode.TRAINING,
            do_constant_folding=False,
            input_names=["input_ids", "labels"],
            output_names=["loss"],
            dynamic_axes={"input_ids": {0: "B", 1: "T"}, "labels": {0: "B", 1: "T"}},
        )
    return model


def generate(model_path: Path, out: Path, params: list[str]) -> None:
    """generate_artifacts(loss=None, AdamW), every model parameter trainable.

    Declares SoftmaxCrossEntropyLoss's log_prob output where the exporter wrote only the loss
    (as tests/python/test_artifacts.py does): `ntl-patch artifacts` splices its gradient next to
    SoftmaxCrossEntropyLossGrad, which reads log_prob. The same is done for every variant, so
    the baseline graph is the one artifacts mode starts from."""
    import onnx
    from onnxruntime.training import artifacts

    m = onnx.load(str(model_path))
    for n in m.graph.node:
        if n.op_type == "SoftmaxCrossEntropyLoss" and len(n.output) == 1:
            n.output.append(n.output[0] + "_log_prob")
    out.mkdir(parents=True)
    # generate_artifacts' graph transformers log at INFO level to fd 2 whatever the Python
    # logger severity: send that to a file
    log = out.parent / f"generate-{out.name}.log"
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log, "w") as f:
        os.dup2(f.fileno(), 2)
        try:
            artifacts.generate_artifacts(m, requires_grad=params, frozen_params=[], loss=None,
                                         optimizer=artifacts.OptimType.AdamW, artifact_directory=str(out))
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def run_cli(bin_: str, argv: list) -> str:
    cmd = [bin_] + [str(a) for a in argv]
    print("  $ " + " ".join(str(c) for c in cmd).replace(str(REPO) + "/", ""), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"ntl-patch failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout.strip()


# ----------------------------------------------------------------------------- runners


class OrtVariant:
    def __init__(self, name: str, art: Path, threads: int, feeds):
        import onnxruntime as ort
        from onnxruntime.training.api import CheckpointState, Module, Optimizer

        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        self.name = name
        self.state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
        self.module = Module(str(art / "training_model.onnx"), self.state, str(art / "eval_model.onnx"),
                             device="cpu", session_options=so)
        self.opt = Optimizer(str(art / "optimizer_model.onnx"), self.module)
        self.opt.set_learning_rate(LR)
        self.feeds = feeds
        self.module.train()

    def first_step(self):
        """Forward + backward only (no update): outputs and gradients, then the update."""
        outs = self.module(*self.feeds)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        vals = [float(o) for o in outs]
        return vals

    def grads(self, names):
        import numpy as np

        return {n: np.asarray(self.state.parameters[n].grad, np.float64) for n in names}

    def finish_first(self):
        self.opt.step()
        self.module.lazy_reset_grad()

    def step(self):
        self.module(*self.feeds)
        self.opt.step()
        self.module.lazy_reset_grad()

    def eval_forward(self):
        self.module.eval()
        self.module(*self.feeds)
        self.module.train()


class TorchVariant:
    def __init__(self, name: str, model, tok_path: Path, vocab: int, feeds, ntl: bool):
        import copy

        import ntloss
        import torch
        import torch.nn.functional as F
        from transformers import PreTrainedTokenizerFast

        self.name = name
        self.F = F
        self.model = copy.deepcopy(model).train()
        self.ids, self.labels = (torch.from_numpy(f) for f in feeds)
        self.vocab = vocab
        self.ntl = None
        if ntl:
            tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_path))
            n_before = len(tok)
            self.ntl = ntloss.NTLoss(tok, vocab_size=vocab, digit_level=True, reweigh=False)
            assert len(tok) == n_before, "ntloss added tokens"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-6,
                                     weight_decay=0.0)

    def losses(self):
        logits = self.model.logits(self.ids)
        ce = self.F.cross_entropy(logits.reshape(-1, self.vocab), self.labels.reshape(-1), ignore_index=-100)
        if self.ntl is None:
            return ce, ce, None
        number = self.ntl(logits, self.labels, reduction="mean")
        return ce + WEIGHT * number, ce, number

    def first_step(self):
        total, ce, number = self.losses()
        total.backward()
        vals = [float(total), float(ce)] + ([float(number)] if number is not None else [])
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return vals

    def step(self):
        total, _, _ = self.losses()
        total.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds: all threads of this process)."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def rss_gib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def profile(art: Path, feeds, params, threads: int, runs: int, work: Path) -> dict:
    """Per-node kernel times of one training graph (forward + backward + gradient accumulation,
    no optimizer), run in a plain InferenceSession with enable_profiling (Module has no profiling
    switch). One warm-up run, then `runs` profiled runs; times are per run."""
    import collections

    import numpy as np
    import onnxruntime as ort
    from onnxruntime.training.api import CheckpointState

    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(art / "training_model.onnx"), so, providers=["CPUExecutionProvider"])
    values = {"input_ids": feeds[0], "labels": feeds[1], "lazy_reset_grad": np.array([True])}
    for p in params:
        values[p] = np.asarray(state.parameters[p].data)
        values[p + "_grad.accumulation.buffer"] = np.zeros_like(values[p])
    inputs = {i.name: values[i.name] for i in sess.get_inputs()}
    out = [sess.get_outputs()[0].name]
    sess.run(out, inputs)  # warm-up, not profiled
    so.enable_profiling = True
    so.profile_file_prefix = str(work / f"profile-{art.name}")
    sess = ort.InferenceSession(str(art / "training_model.onnx"), so, providers=["CPUExecutionProvider"])
    sess.run(out, inputs)  # warm-up of the profiled session (dropped below)
    walls = [timed(lambda: sess.run(out, inputs))[0] for _ in range(runs)]
    events = json.loads(Path(sess.end_profiling()).read_text())
    node_runs = collections.defaultdict(list)
    kinds = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            node = e["name"][: -len("_kernel_time")]
            node_runs[node].append(e["dur"])
            kinds[node] = e["args"].get("op_name", "?")
    per_node = {n: sum(d[-runs:]) / runs / 1000 for n, d in node_runs.items()}  # ms, last `runs`
    by_op = collections.Counter()
    for n, ms in per_node.items():
        by_op[kinds[n]] += ms
    return {"wall_ms": statistics.median(walls) * 1000, "per_node": per_node, "kinds": kinds,
            "top_ops": by_op.most_common(8)}


def summarize_profile(p: dict, ce_nodes: set) -> dict:
    """Adds the totals; "added" nodes are those whose name is not among the `ce` profile's nodes
    (names after ORT's graph transforms, the same in every variant for the shared part)."""
    per_node, kinds = p["per_node"], p["kinds"]
    # gradient accumulators: one per parameter in every variant, but numbered in graph order
    added = {n: ms for n, ms in per_node.items()
             if n not in ce_nodes and kinds[n] != "InPlaceAccumulatorV2"}
    p.update({
        "total_ms": sum(per_node.values()),
        "added_ms": sum(added.values()),
        "added_nodes": len(added),
        "ntl_ms": sum(ms for n, ms in per_node.items() if n.startswith("ntl/")),
        "top_added": sorted(((f"{n} ({kinds[n]})", ms) for n, ms in added.items()), key=lambda x: -x[1])[:6],
    })
    return p


def bin_info(path: str) -> str:
    try:
        st = Path(path).stat()
        return f"{Path(path).name}, built {time.strftime('%Y-%m-%d %H:%M', time.localtime(st.st_mtime))}"
    except OSError:
        return path


# ----------------------------------------------------------------------------- report


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "onnxruntime-training-cpu", "onnx", "ntloss", "numpy", "transformers", "tokenizers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "-"
    return out


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return rev + (" (src/ modified in the working tree)" if dirty else "")
    except OSError:
        return "?"


def pct(xs, q):
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


DESCR = {
    "ce": "ORT, CE only (generate_artifacts on the export)",
    "fwd": "ORT, CE+NTL-WAS: forward patch + ORT autodiff",
    "art": "ORT, CE+NTL-WAS: `ntl-patch artifacts`",
    "fwd-rw": "ORT, CE+NTL-WAS `--reweigh`: forward patch + ORT autodiff",
    "art-rw": "ORT, CE+NTL-WAS `--reweigh`: `ntl-patch artifacts`",
    "fwd-ntil": "ORT, CE+NTIL (`--gumbel-noise 0`): forward patch + ORT autodiff",
    "art-ntil": "ORT, CE+NTIL (`--gumbel-noise 0`): `ntl-patch artifacts`",
    "torch": "torch eager, CE + 0.3·ntloss.NTLoss",
    "torch-ce": "torch eager, CE only",
}


def markdown(args, res, cpu, paired, evals, profiles, checks, meta) -> str:
    base = statistics.median(res["ce"])
    lines = [
        f"Configuration: B={args.batch}, T={args.seq} (N={args.batch * args.seq} tokens/step), "
        f"V={args.vocab}, dim={args.dim}, MLP hidden={args.hidden}, one block; "
        f"{args.threads} threads in torch and ORT (torch.set_num_threads({args.threads}), ORT "
        f"intra_op_num_threads={args.threads}; inter-op 1 in both); "
        f"labels {args.digit_frac:.0%} digits, {args.ignore_frac:.0%} -100; λ={WEIGHT}; AdamW lr {LR}.",
        f"CPU: {meta['cpu']} ({meta['nproc']} logical CPUs visible; load average {meta['load']}). "
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        + f"; ntl-patch at {meta['git']} ({meta['bin']}).",
        f"Timing: {args.warmup} warm-up steps per variant, then {args.rounds} rounds; in each round "
        f"every ORT variant runs {args.steps} step(s) in a rotated order, each step between two `ce` "
        f"steps (and `torch` between two `torch-ce` steps). A step is `module(ids, labels); "
        f"optimizer.step(); module.lazy_reset_grad()` (ORT) or forward, backward, `AdamW.step()`, "
        f"`zero_grad()` (torch). Whole run {meta['total_s']:.0f} s; peak RSS {meta['rss']:.1f} GiB.",
        "",
        "| variant | steps | median s/step | min | p10 – p90 | × CE only (medians) | paired × baseline (median) | CPU s/step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, xs in res.items():
        m, c = statistics.median(xs), statistics.median(cpu[name])
        pr = paired.get(name)
        pr_txt = (f"**{statistics.median(pr):.3f}** (vs {'torch-ce' if name == 'torch' else 'ce'})"
                  if pr else "-")
        lines.append(f"| `{name}`: {DESCR[name]} | {len(xs)} | {m:.3f} | {min(xs):.3f} | "
                     f"{pct(xs, .1):.3f} – {pct(xs, .9):.3f} | {m / base:.3f} | {pr_txt} | {c:.3f} |")
    lines += ["", "× CE only: median wall time over the median of `ce` (ORT, CE only). Paired: each step "
              "over the mean of the baseline steps run just before and after it, median over the "
              "steps; this cancels load changes slower than a few seconds. CPU: process CPU time "
              "(all threads) per step."]
    if "torch" in res and "torch-ce" in res:
        lines += ["", f"torch eager's own NTL overhead: torch / torch-ce = "
                      f"{statistics.median(res['torch']) / statistics.median(res['torch-ce']):.3f}."]
    if evals:
        eb = statistics.median(evals["ce"])
        lines += ["", "Eval-mode forward only (`module.eval(); module(ids, labels)`: the eval graph, no backward, "
                  "no update), timed in the same rounds:", "",
                  "| variant | median s/forward | × CE only |", "| --- | ---: | ---: |"]
        for name, xs in evals.items():
            lines.append(f"| `{name}` | {statistics.median(xs):.3f} | {statistics.median(xs) / eb:.3f} |")
    if profiles:
        lines += ["", f"Per-node profile of each training graph (forward + backward + gradient accumulation, "
                  f"no optimizer; InferenceSession with enable_profiling, {args.threads} threads, mean of "
                  f"{args.profile_runs} runs after warm-up; run after the timed rounds). \"added nodes\": "
                  "nodes whose name is not among the `ce` profile's nodes, i.e. everything the number loss "
                  "added (forward, backward, gradient merging):", "",
                  "| variant | session.run ms | Σ node ms | added nodes: count, Σ ms | added / `ce` Σ node ms | largest added nodes (ms) |",
                  "| --- | ---: | ---: | ---: | ---: | --- |"]
        ce_total = profiles["ce"]["total_ms"]
        for name, p in profiles.items():
            top = "; ".join(f"`{n}` {ms:.1f}" for n, ms in p["top_added"][:4]) or "-"
            lines.append(f"| `{name}` | {p['wall_ms']:.0f} | {p['total_ms']:.0f} | {p['added_nodes']}, "
                         f"{p['added_ms']:.1f} | {p['added_ms'] / ce_total:.1%} | {top} |")
        p = profiles["ce"]
        lines += ["", "Where a `ce` step's node time goes (ms/run): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in p["top_ops"]) + "."]
    if checks:
        lines += ["", "Correctness check (first step, before any update):", ""]
        lines += [f"- {c}" for c in checks]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    set_threads(args.threads)
    import numpy as np
    import onnx
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    if not Path(args.bin).is_file():
        sys.exit(f"ntl-patch binary not found: {args.bin} (cargo build --release)")

    work = Path(args.workdir)
    marker = work / ".bench-training-step"
    if work.exists() and any(work.iterdir()):
        if not marker.exists():
            sys.exit(f"{work} exists and was not made by this script: choose another --workdir")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    marker.touch()
    print(f"[setup] work dir {work}", flush=True)
    # a private copy: other work may rebuild target/release while this runs
    bin_copy = work / "ntl-patch"
    shutil.copy2(args.bin, bin_copy)
    bin_desc = bin_info(args.bin)
    args.bin = str(bin_copy)
    tok = work / "tokenizer.json"
    vocab = make_tokenizer(tok, args.vocab, args.seed)
    digit_ids = [vocab[str(d)] for d in range(10)]
    feeds = make_batch(args, digit_ids)

    t0 = time.perf_counter()
    model_path = work / "model.onnx"
    torch_model = export_model(args, model_path)
    params = sorted(k for k, _ in torch_model.named_parameters())
    inits = {t.name for t in onnx.load(str(model_path)).graph.initializer}
    assert set(params) <= inits, set(params) - inits
    print(f"[setup] exported {model_path.name} ({model_path.stat().st_size / 2**20:.1f} MiB) "
          f"in {time.perf_counter() - t0:.1f}s", flush=True)

    dirs: dict[str, Path] = {}
    t0 = time.perf_counter()
    dirs["ce"] = work / "artifacts-ce"
    generate(model_path, dirs["ce"], params)
    fwd_sets = [("fwd", "art", ["--loss", "wasserstein"])]
    if args.reweigh_variants:
        fwd_sets.append(("fwd-rw", "art-rw", ["--loss", "wasserstein", "--reweigh"]))
    if args.ntil:
        fwd_sets.append(("fwd-ntil", "art-ntil", ["--loss", "ntil", "--gumbel-noise", "0"]))
    for fname, aname, loss_args in fwd_sets:
        fpath = work / f"{fname}.onnx"
        run_cli(args.bin, [model_path, *loss_args, "--weight", WEIGHT, "--tokenizer", tok, "-o", fpath])
        dirs[fname] = work / f"artifacts-{fname}"
        generate(fpath, dirs[fname], params)
        dirs[aname] = work / f"artifacts-{aname}"
        run_cli(args.bin, ["artifacts", dirs["ce"], *loss_args, "--weight", WEIGHT, "--tokenizer", tok,
                           "-o", dirs[aname]])
    print(f"[setup] artifacts in {time.perf_counter() - t0:.1f}s", flush=True)

    variants: dict = {}
    for name, d in dirs.items():
        variants[name] = OrtVariant(name, d, args.threads, feeds)
    if not args.no_torch:
        variants["torch"] = TorchVariant("torch", torch_model, tok, args.vocab, feeds, ntl=True)
        variants["torch-ce"] = TorchVariant("torch-ce", torch_model, tok, args.vocab, feeds, ntl=False)
    order = list(variants)
    print(f"[setup] {len(variants)} variants loaded; RSS {rss_gib():.1f} GiB; "
          f"{time.perf_counter() - t_start:.0f}s so far", flush=True)

    # first step of every variant: values and gradients, then its update
    checks = []
    first = {}
    grads = {}
    for name, v in variants.items():
        t = time.perf_counter()
        first[name] = v.first_step()
        if isinstance(v, OrtVariant):
            grads[name] = v.grads(params)
            v.finish_first()
        print(f"[first] {name:9s} losses {['%.6f' % x for x in first[name]]} ({time.perf_counter() - t:.2f}s)",
              flush=True)

    def norm_rel(a, b):
        tot = np.sqrt(sum(float(np.sum(x ** 2)) for x in b.values()))
        return max(np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-3 * tot) for k in b)

    for fname, aname, loss_args in fwd_sets:
        f, a = first[fname], first[aname]
        d_loss = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, f))
        checks.append(f"`{aname}` vs `{fname}` ({' '.join(loss_args)}): losses (total, ce, number) "
                      f"{', '.join('%.6f' % x for x in a)} vs {', '.join('%.6f' % x for x in f)} "
                      f"(max rel diff {d_loss:.1e}); parameter gradients norm-relative diff "
                      f"{norm_rel(grads[aname], grads[fname]):.1e}")
    checks.append(f"`ce` CE {first['ce'][0]:.6f}; `fwd` ce_loss {first['fwd'][-2]:.6f}")
    if "torch" in first:
        checks.append(f"`torch` (float32, eager) total, ce, number = "
                      f"{', '.join('%.6f' % x for x in first['torch'])}; vs `fwd` "
                      f"{', '.join('%.6f' % x for x in (first['fwd'][0], first['fwd'][-2], first['fwd'][-1]))}")
    for c in checks:
        print("[check] " + c, flush=True)

    for name, v in variants.items():
        for _ in range(max(args.warmup - 1, 0)):  # the first step above was warm-up step 1
            v.step()
    print(f"[warmup] done; RSS {rss_gib():.1f} GiB; {time.perf_counter() - t_start:.0f}s so far", flush=True)

    # Each round: the ORT variants in a rotated order, each step preceded by a step of its
    # baseline (`ce`; `torch-ce` for `torch`), so every timed step has a baseline step next to
    # it; the closing baseline step follows the last one. Paired ratio = step / mean of the
    # baseline steps just before and just after it: it cancels load changes slower than ~2 steps.
    res = {n: [] for n in order}
    cpu = {n: [] for n in order}
    paired = {n: [] for n in order if n not in ("ce", "torch-ce")}
    evals = {n: [] for n in order if isinstance(variants[n], OrtVariant)} if args.eval_steps > 0 else {}
    if evals:
        for n in evals:
            variants[n].eval_forward()  # warm the eval session
    ort_others = [n for n in order if isinstance(variants[n], OrtVariant) and n != "ce"]
    load_before = loadavg()

    def run(n):
        w, c = timed(variants[n].step)
        res[n].append(w)
        cpu[n].append(c)
        return w

    for r in range(args.rounds):
        k = r % max(len(ort_others), 1)
        rot = ort_others[k:] + ort_others[:k]
        if r % 2:
            rot = rot[::-1]
        for _ in range(args.steps):
            before = run("ce")
            for n in rot:
                w = run(n)
                after = run("ce")
                paired[n].append(w / ((before + after) / 2))
                before = after
            if "torch" in variants:
                tb = run("torch-ce")
                w = run("torch")
                ta = run("torch-ce")
                paired["torch"].append(w / ((tb + ta) / 2))
        for n in rot:
            for _ in range(args.eval_steps):
                evals[n].append(timed(variants[n].eval_forward)[0])
        if evals:
            for _ in range(args.eval_steps):
                evals["ce"].append(timed(variants["ce"].eval_forward)[0])
        base = statistics.median(res["ce"])
        print(f"[round {r + 1}/{args.rounds}] ce {base:.3f}s; paired ratios " + "  ".join(
            f"{n} {statistics.median(paired[n]):.3f}" for n in paired)
            + f"  [{time.perf_counter() - t_start:.0f}s, load {loadavg()}]", flush=True)
    load_after = loadavg()
    profiles = {}
    if args.profile_runs > 0:
        del variants, v  # free the training sessions before the profiling sessions
        import gc

        gc.collect()
        for name, d in dirs.items():
            profiles[name] = profile(d, feeds, params, args.threads, args.profile_runs, work)
        ce_nodes = set(profiles["ce"]["per_node"])
        for name, p in profiles.items():
            summarize_profile(p, ce_nodes)
            print(f"[profile] {name:9s} node time {p['total_ms']:.0f} ms/run, nodes not in `ce` "
                  f"{p['added_ms']:.1f} ms ({p['added_nodes']} nodes), ntl/ nodes {p['ntl_ms']:.1f} ms; top: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in p["top_ops"][:5]), flush=True)
        for p in profiles.values():
            del p["per_node"], p["kinds"]

    meta = {"cpu": cpu_model(), "nproc": os.cpu_count(), "versions": versions(), "git": git_rev(),
            "total_s": time.perf_counter() - t_start, "rss": rss_gib(), "bin": bin_desc,
            "load": f"{load_before} before, {load_after} after the timed rounds"}
    try:
        peak = [l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:")]
        meta["rss"] = int(peak[0].split()[1]) / 2**20
    except (OSError, IndexError):
        pass
    md_text = markdown(args, res, cpu, paired, evals, profiles, checks, meta)
    print()
    print(md_text)
    if args.markdown:
        Path(args.markdown).write_text(md_text)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "meta": meta, "steps": res, "cpu": cpu, "paired": paired, "eval": evals,
                                               "profiles": profiles,
                                               "first": first, "checks": checks}, indent=1))


if __name__ == "__main__":
    main()

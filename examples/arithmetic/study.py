"""Number-aware losses on a synthetic arithmetic task, through ntl-patch and ONNX Runtime Training.

For every seed: build the torch model (task.py, model.py) with that seed's initial weights,
export it with its cross-entropy (TorchScript, training=TRAINING, do_constant_folding=False,
dynamic B/T), then for every loss make the training graph -- plain CE (the exported graph, its
SoftmaxCrossEntropyLoss given the `log_prob` output ORT Training needs) or `ntl-patch --loss ...`
-- generate ORT training artifacts (AdamW), train with onnxruntime.training.api on CPU, and
evaluate by greedy decoding:

- during training, every --eval-every steps, on a fixed validation set of unseen pairs, with the
  module's eval graph (its second output is the logits);
- at the end, from the saved ORT checkpoint: `Module.export_model_for_inferencing(["logits"])`
  run in an onnxruntime InferenceSession, on the three test splits (task.SPLITS). The checkpoint's
  parameters are also loaded into the torch model and its logits compared with the inference
  graph's (they must agree to 1e-4), so the decoded numbers come from the trained ORT weights.

Every loss of a seed starts from the same weights and sees the same batches. After the runs, the
time per step is measured once more, interleaved: rounds of --timing-steps steps per loss,
round-robin, so a shared machine's load hits every loss alike.

    .venv/bin/python examples/arithmetic/study.py                 # the full study (results/)
    .venv/bin/python examples/arithmetic/study.py --smoke --out /tmp/smoke
    .venv/bin/python examples/arithmetic/study.py --report-only   # table and plots from results.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

import task  # noqa: E402

# name -> ntl-patch arguments (None: the plain cross-entropy baseline, not patched)
LOSSES: dict[str, list[str] | None] = {
    "ce": None,
    "wasserstein": ["--loss", "wasserstein"],
    "mse": ["--loss", "mse"],
    "ntil": ["--loss", "ntil", "--gumbel-noise", "0.01"],  # default combine for ntil: scaled
    "ntil-add": ["--loss", "ntil", "--gumbel-noise", "0.01", "--combine", "add"],
}

FULL = dict(seeds=5, steps=3000, batch=64, lr=2e-3, warmup=100, weight_decay=0.01, clip=1.0,
            eval_every=150, val_n=200, test_n=500, timing_rounds=5, timing_steps=60,
            dim=64, layers=2, heads=4, hidden=256)
SMOKE = dict(seeds=1, steps=12, batch=16, lr=2e-3, warmup=2, weight_decay=0.01, clip=1.0,
             eval_every=6, val_n=6, test_n=8, timing_rounds=1, timing_steps=4,
             dim=32, layers=1, heads=2, hidden=64)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def default_patch_bin() -> str:
    env = os.environ.get("NTL_PATCH_BIN")
    if env:
        return env
    for p in (REPO / "target" / "release" / "ntl-patch", REPO / "target" / "debug" / "ntl-patch"):
        if p.is_file():
            return str(p)
    raise SystemExit("ntl-patch binary not found: run `cargo build --release` (or set NTL_PATCH_BIN)")


def quiet_ort():
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    return ort


def session_options(threads: int):
    ort = quiet_ort()
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return so


# ----------------------------------------------------------------------------- graphs


def ce_training_graph(src: Path, dst: Path) -> None:
    """The baseline: the exported graph as it is, with its SoftmaxCrossEntropyLoss declaring the
    second (`log_prob`) output ORT Training's gradient builder needs (ntl-patch does the same)."""
    import onnx

    m = onnx.load(str(src))
    sce = [n for n in m.graph.node if n.op_type == "SoftmaxCrossEntropyLoss"]
    assert len(sce) == 1, "expected one SoftmaxCrossEntropyLoss"
    if len(sce[0].output) == 1:
        sce[0].output.append("ce_log_prob")
    onnx.checker.check_model(m, full_check=True)
    onnx.save(m, str(dst))


def patch(bin_: str, src: Path, tokenizer: Path, args: list[str], dst: Path) -> str:
    cmd = [*bin_.split(), str(src), *args, "--tokenizer", str(tokenizer), "-o", str(dst)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"ntl-patch failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    return r.stdout.strip().replace(str(REPO) + "/", "")


class native_stderr_to:
    """Send the process's stderr (fd 2: C++ logging) to a file for a while. ORT Training's
    gradient-graph builder logs every graph transformer at INFO, whatever the logger severity."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        sys.stderr.flush()
        self.saved = os.dup(2)
        self.f = open(self.path, "ab")
        os.dup2(self.f.fileno(), 2)

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.f.close()


def make_artifacts(graph: Path, out: Path, params: list[str], cfg: dict) -> None:
    import onnx
    from onnxruntime.training import artifacts, onnxblock

    quiet_ort()
    m = onnx.load(str(graph))
    outs = [o.name for o in m.graph.output]
    assert outs[:2] == ["loss", "logits"], outs
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    opt = onnxblock.optim.AdamW(weight_decay=cfg["weight_decay"],
                                clip_grad=onnxblock.optim.ClipGradNorm(cfg["clip"]))
    # loss=None: the graph's first output is the loss (keeps the CE's ignore_index)
    with native_stderr_to(out.parent / "generate_artifacts.log"):
        artifacts.generate_artifacts(m, requires_grad=params, frozen_params=[], loss=None,
                                     optimizer=opt, artifact_directory=str(out))


# ----------------------------------------------------------------------------- decoding / metrics


def greedy(logits_fn, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy decoding, batched by prompt length (absolute positions: no padding on the left)."""
    out: list[list[int] | None] = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for _, idx in sorted(by_len.items()):
        x = np.array([prompts[i] for i in idx], dtype=np.int64)
        gen = np.zeros((len(idx), 0), dtype=np.int64)
        for _ in range(max_new):
            nxt = logits_fn(x)[:, -1, :].argmax(-1).astype(np.int64)
            x = np.concatenate([x, nxt[:, None]], axis=1)
            gen = np.concatenate([gen, nxt[:, None]], axis=1)
            if (gen == task.EOS_ID).any(axis=1).all():
                break
        for j, i in enumerate(idx):
            out[i] = gen[j].tolist()
    return out  # type: ignore[return-value]


def evaluate(logits_fn, problems: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict:
    """Metrics per operation and over both: exact match, MAE and log-MAE of the decoded numbers
    (greedy), digit-token accuracy (teacher forcing), share of answers without a digit."""
    res: dict = {}
    pooled = {"exact": [], "logae": [], "digit_ok": [], "invalid": []}
    for op, (a, b) in problems.items():
        truth = task.answer(op, a, b)
        prompts = [task.prompt_tokens(op, int(x), int(y)) for x, y in zip(a, b)]
        gens = greedy(logits_fn, prompts, task.max_answer_digits(op) + 1)
        pred, exact, invalid = [], [], []
        for g, y in zip(gens, truth):
            v, text = task.decode_number(g)
            invalid.append(v is None)
            v = 0 if v is None else v
            pred.append(v)
            exact.append(text == str(int(y)) and task.EOS_ID in g)
        pred = np.array(pred, dtype=np.float64)
        truth_f = truth.astype(np.float64)
        ae = np.abs(pred - truth_f)
        logae = np.abs(np.log10(1 + pred) - np.log10(1 + truth_f))
        # teacher-forced digit accuracy
        ids, lab = task.batch(task.sequences(op, a, b))
        arg = logits_fn(ids).argmax(-1)
        dmask = np.isin(lab, task.DIGIT_IDS)
        digit_ok = (arg == lab)[dmask]
        res[op] = {"n": int(len(a)), "exact": float(np.mean(exact)), "mae": float(ae.mean()),
                   "log_mae": float(logae.mean()), "digit_acc": float(digit_ok.mean()),
                   "invalid": float(np.mean(invalid))}
        pooled["exact"] += list(exact)
        pooled["logae"] += logae.tolist()
        pooled["digit_ok"] += digit_ok.tolist()
        pooled["invalid"] += invalid
    res["all"] = {"n": len(pooled["exact"]), "exact": float(np.mean(pooled["exact"])),
                  "log_mae": float(np.mean(pooled["logae"])),
                  "digit_acc": float(np.mean(pooled["digit_ok"])),
                  "invalid": float(np.mean(pooled["invalid"]))}
    return res


def fixed_problems(split: str, n: int, seed: int) -> dict:
    rng = np.random.default_rng([seed, task.SPLITS.index(split) if split in task.SPLITS else 9])
    return {op: task.sample(op, split, n, rng) for op in task.OPS}


# ----------------------------------------------------------------------------- one run


def train_one(name: str, art: Path, seed: int, cfg: dict, val: dict, out_dir: Path,
              torch_model_fn) -> dict:
    ort = quiet_ort()
    from onnxruntime.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer

    if hasattr(ort, "set_seed"):
        ort.set_seed(seed)  # NTIL's Gumbel noise (RandomUniformLike in the graph)
    so = session_options(1)
    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"),
                    device="cpu", session_options=so)
    opt = Optimizer(str(art / "optimizer_model.onnx"), module)
    sched = LinearLRScheduler(opt, cfg["warmup"], cfg["steps"], cfg["lr"])
    rng = np.random.default_rng([seed, 1234])  # the same batches for every loss of this seed

    def eval_logits(ids: np.ndarray) -> np.ndarray:
        return module(ids, ids)[1]  # labels unused by the logits; any valid ids keep CE finite

    curve = []
    step_times: list[float] = []
    acc = {"loss": 0.0, "ce": 0.0, "number": 0.0, "n": 0}

    def validate(step: int) -> None:
        module.eval()
        m = evaluate(eval_logits, val)
        module.train()
        row = {"step": step, "mae_+": m["+"]["mae"], "mae_*": m["*"]["mae"],
               "exact": m["all"]["exact"], "log_mae": m["all"]["log_mae"],
               "digit_acc": m["all"]["digit_acc"]}
        if acc["n"]:
            row.update(train_loss=acc["loss"] / acc["n"], train_ce=acc["ce"] / acc["n"],
                       train_number=acc["number"] / acc["n"])
            acc.update(loss=0.0, ce=0.0, number=0.0, n=0)
        curve.append(row)

    module.train()
    validate(0)
    t_run = time.perf_counter()
    for step in range(1, cfg["steps"] + 1):
        ids, lab = task.train_batch(cfg["batch"], rng)
        t0 = time.perf_counter()
        outs = module(ids, lab)
        opt.step()
        sched.step()
        module.lazy_reset_grad()
        step_times.append(time.perf_counter() - t0)
        loss = float(outs[0])
        if not math.isfinite(loss):
            raise SystemExit(f"{name} seed {seed}: loss {loss} at step {step}")
        acc["loss"] += loss
        acc["ce"] += float(outs[2]) if len(outs) > 2 else loss
        acc["number"] += float(outs[3]) if len(outs) > 3 else 0.0
        acc["n"] += 1
        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
            validate(step)
    wall = time.perf_counter() - t_run

    # -- final evaluation from the saved ORT checkpoint
    ckpt = out_dir / "checkpoint"
    CheckpointState.save_checkpoint(state, str(ckpt))
    infer = out_dir / "inference.onnx"
    module.export_model_for_inferencing(str(infer), ["logits"])
    sess = ort.InferenceSession(str(infer), so, providers=["CPUExecutionProvider"])
    in_names = [i.name for i in sess.get_inputs()]

    def infer_logits(ids: np.ndarray) -> np.ndarray:
        feeds = {"input_ids": ids}
        if "labels" in in_names:
            feeds["labels"] = ids
        return sess.run(["logits"], feeds)[0]

    parity = checkpoint_parity(ckpt, torch_model_fn, infer_logits)
    tests = {split: evaluate(infer_logits, fixed_problems(split, cfg["test_n"], 777))
             for split in task.SPLITS}
    st = np.array(step_times[min(10, len(step_times) - 1):]) * 1000
    return {"loss": name, "seed": seed, "curve": curve, "test": tests,
            "ms_per_step_median": float(np.median(st)), "ms_per_step_mean": float(st.mean()),
            "train_wall_s": wall, "torch_vs_ort_max_abs_logit_diff": parity}


def checkpoint_parity(ckpt: Path, torch_model_fn, infer_logits) -> float:
    """Load the ORT checkpoint's parameters into the torch model; its logits must match the
    exported inference graph's."""
    import torch
    from onnxruntime.training.api import CheckpointState

    state = CheckpointState.load_checkpoint(str(ckpt))
    model = torch_model_fn()
    sd = model.state_dict()
    loaded = {}
    for k in sd:
        loaded[k] = torch.from_numpy(np.array(state.parameters[k].data, dtype=np.float32).reshape(sd[k].shape))
    model.load_state_dict(loaded)
    model.eval()
    rng = np.random.default_rng(5)
    ids, _ = task.train_batch(8, rng)
    with torch.no_grad():
        want = model.logits(torch.from_numpy(ids)).numpy()
    got = infer_logits(ids)
    diff = float(np.abs(got - want).max())
    assert diff < 1e-4, f"torch model with the ORT checkpoint's weights differs: {diff}"
    return diff


# ----------------------------------------------------------------------------- timing


def timing_benchmark(arts: dict[str, Path], cfg: dict, seed: int) -> dict:
    """Interleaved: `rounds` x (each loss: `steps` training steps); per loss the median step time
    of every round (the first 3 steps of a round are warm-up)."""
    ort = quiet_ort()
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    mods = {}
    for name, art in arts.items():
        state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
        module = Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"),
                        device="cpu", session_options=session_options(1))
        opt = Optimizer(str(art / "optimizer_model.onnx"), module)
        opt.set_learning_rate(cfg["lr"])
        module.train()
        mods[name] = (state, module, opt)
    rng = np.random.default_rng([seed, 99])
    batches = [task.train_batch(cfg["batch"], rng) for _ in range(cfg["timing_steps"])]
    per_round: dict[str, list[float]] = {n: [] for n in arts}
    for r in range(cfg["timing_rounds"]):
        names = list(arts) if r % 2 == 0 else list(reversed(arts))
        for name in names:
            _, module, opt = mods[name]
            ts = []
            for ids, lab in batches:
                t0 = time.perf_counter()
                module(ids, lab)
                opt.step()
                module.lazy_reset_grad()
                ts.append(time.perf_counter() - t0)
            per_round[name].append(float(np.median(ts[3:] if len(ts) > 3 else ts)) * 1000)
    return {"rounds": per_round, "batch": cfg["batch"], "steps_per_round": cfg["timing_steps"]}


# ----------------------------------------------------------------------------- main


def hardware() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import onnxruntime
    import torch

    return {"cpu": cpu, "logical_cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__, "platform": platform.platform()}


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="a few steps, one seed, tiny data and model")
    ap.add_argument("--out", type=Path, default=HERE / "results", help="results folder")
    ap.add_argument("--work", type=Path, default=None,
                    help="graphs, artifacts, checkpoints (default: OUT/../work, or OUT/work with --smoke)")
    ap.add_argument("--ntl-patch", default=None, help="ntl-patch binary (default $NTL_PATCH_BIN, "
                    "else target/release/ntl-patch, else target/debug/ntl-patch)")
    ap.add_argument("--losses", default=None, help=f"comma list of {','.join(LOSSES)} (default all)")
    ap.add_argument("--report-only", action="store_true", help="rewrite table and plots from OUT/results.json")
    for k, v in FULL.items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=None, help=f"(full: {v}, smoke: {SMOKE[k]})")
    args = ap.parse_args(argv)

    import report

    if args.report_only:
        report.write(args.out)
        return 0

    cfg = dict(SMOKE if args.smoke else FULL)
    for k in FULL:
        v = getattr(args, k)
        if v is not None:
            cfg[k] = v
    losses = list(LOSSES) if args.losses is None else args.losses.split(",")
    for name in losses:
        if name not in LOSSES:
            raise SystemExit(f"unknown loss {name!r}; choose from {', '.join(LOSSES)}")
    assert losses[0] == "ce", "ce (the baseline) must come first"
    bin_ = args.ntl_patch or default_patch_bin()
    out: Path = args.out
    work: Path = args.work or (out / "work" if args.smoke else out.parent / "work")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)

    import torch

    import model as M

    torch.set_num_threads(1)
    t_start = time.time()
    meta = {"config": cfg, "smoke": args.smoke, "losses": {n: LOSSES[n] for n in losses},
            "ntl_patch": bin_.replace(str(REPO) + "/", ""), "hardware": hardware(), "loadavg_start": loadavg(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "patch_summaries": {}}
    tokenizer = work / "tokenizer.json"
    task.write_tokenizer(tokenizer)
    val = fixed_problems("iid", cfg["val_n"], 555)
    runs: list[dict] = []
    seed_arts: dict[str, Path] = {}
    n_total = cfg["seeds"] * len(losses)

    def save(final: bool) -> None:
        meta["wall_s"] = time.time() - t_start
        meta["loadavg_end"] = loadavg()
        (out / "results.json").write_text(json.dumps({**meta, "final": final, "runs": runs}, indent=1) + "\n")

    for seed in range(cfg["seeds"]):
        torch.manual_seed(seed)
        arch = dict(vocab=len(task.VOCAB), max_len=task.max_seq_len(), dim=cfg["dim"],
                    layers=cfg["layers"], heads=cfg["heads"], hidden=cfg["hidden"])
        net = M.ArithLM(**arch)
        init = {k: v.clone() for k, v in net.state_dict().items()}
        meta["parameters"] = int(sum(p.numel() for p in net.parameters()))

        def torch_model_fn(arch=arch):
            return M.ArithLM(**arch)

        sdir = work / f"seed{seed}"
        sdir.mkdir(parents=True, exist_ok=True)
        ex = task.train_batch(2, np.random.default_rng(0))
        M.export(net, sdir / "lm.onnx", (torch.from_numpy(ex[0]), torch.from_numpy(ex[1])))
        params = list(init)
        for name in losses:
            t0 = time.time()
            rdir = sdir / name
            rdir.mkdir(parents=True, exist_ok=True)
            graph = rdir / "train_graph.onnx"
            if LOSSES[name] is None:
                ce_training_graph(sdir / "lm.onnx", graph)
            else:
                meta["patch_summaries"][name] = patch(bin_, sdir / "lm.onnx", tokenizer, LOSSES[name], graph)
            make_artifacts(graph, rdir / "artifacts", params, cfg)
            if seed == 0:
                seed_arts[name] = rdir / "artifacts"
            run = train_one(name, rdir / "artifacts", seed, cfg, val, rdir, torch_model_fn)
            runs.append(run)
            save(False)
            t = run["test"]["iid"]
            log(f"[{len(runs)}/{n_total}] seed {seed} {name:12s} {time.time() - t0:6.1f}s  "
                f"{run['ms_per_step_median']:.2f} ms/step  iid: exact + {t['+']['exact']:.3f} "
                f"* {t['*']['exact']:.3f}  MAE + {t['+']['mae']:.1f} * {t['*']['mae']:.1f}  "
                f"digit acc {t['all']['digit_acc']:.3f}")

    log("interleaved timing benchmark")
    meta["timing"] = timing_benchmark(seed_arts, cfg, 0)
    save(True)
    report.write(out)
    log(f"done in {time.time() - t_start:.0f}s: {str(out / 'table.md').replace(str(REPO) + '/', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

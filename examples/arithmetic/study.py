"""Number-aware losses on a synthetic arithmetic task, through ntl-patch's step graph in onnxruntime.

For every seed: build the torch model (task.py, model.py) with that seed's initial weights,
export it with its cross-entropy (TorchScript, training=TRAINING, do_constant_folding=False,
dynamic B/T), then for every loss write its training step with `ntl-patch step --loss ...`
(forward, the loss, the whole backward and torch's AdamW with gradient clipping in one standard
ONNX graph; the CE baseline is the same with λ = 0), train it with ntl_patch.StepRunner in a
plain onnxruntime InferenceSession on CPU, and evaluate by greedy decoding:

- during training, every --eval-every steps, on a fixed validation set of unseen pairs, with the
  exported model carrying the current weights (StepRunner.save_inference_model);
- at the end, the same with the trained weights, on the three test splits (task.SPLITS). The
  trained parameters are also loaded into the torch model and its logits compared with the
  inference graph's (they must agree to 1e-4), so the decoded numbers come from the weights the
  step graph trained.

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
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

import task  # noqa: E402

# name -> `ntl-patch step` loss arguments; every loss with its default λ and combination
LOSSES: dict[str, list[str]] = {
    # the baseline: λ = 0 gives exactly the cross-entropy's gradient (a step graph always holds a
    # number loss; its value is computed and logged, its weighted gradient is 0)
    "ce": ["--loss", "wasserstein", "--weight", "0"],
    "wasserstein": ["--loss", "wasserstein"],
    "mse": ["--loss", "mse"],
    "ntil": ["--loss", "ntil", "--gumbel-noise", "0.01"],  # default combine for ntil: scaled
    "dist2": ["--loss", "dist2"],  # λ 0.1
    "smmd": ["--loss", "smmd"],  # λ 0.3, the integer tokens are the ten digits here
    "del": ["--loss", "del"],  # λ 1 (0.01 inside the loss)
}

FULL = dict(seeds=6, steps=3000, batch=64, lr=2e-3, warmup=100, weight_decay=0.01, clip=1.0,
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


def step_graph(bin_: str, src: Path, tokenizer: Path, args: list[str], dst: Path, cfg: dict) -> dict:
    """`ntl-patch step`: the model's training step with the loss, torch's AdamW (decoupled weight
    decay) and gradient-norm clipping; returns its JSON summary."""
    cmd = [*bin_.split(), "step", str(src), *args, "--tokenizer", str(tokenizer),
           "--optimizer", "adamw", "--lr", str(cfg["lr"]), "--weight-decay", str(cfg["weight_decay"]),
           "--max-grad-norm", str(cfg["clip"]), "-o", str(dst), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise SystemExit(f"ntl-patch failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    return json.loads(r.stdout)


def runner(graph: Path):
    from ntl_patch import StepRunner

    so = session_options(1)
    so.enable_mem_pattern = False  # as StepRunner's own default
    return StepRunner(graph, providers=["CPUExecutionProvider"], session_options=so)


def learning_rate(step: int, cfg: dict) -> float:
    """Linear warm-up over `warmup` steps, then linear decay to 0 at `steps` (step counts from 1)."""
    if step <= cfg["warmup"]:
        return cfg["lr"] * step / cfg["warmup"]
    return cfg["lr"] * max(0.0, (cfg["steps"] - step) / (cfg["steps"] - cfg["warmup"]))


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


def train_one(name: str, graph: Path, model_onnx: Path, seed: int, cfg: dict, val: dict,
              out_dir: Path, torch_model_fn) -> dict:
    ort = quiet_ort()
    if hasattr(ort, "set_seed"):
        ort.set_seed(seed)  # NTIL's Gumbel noise (RandomUniformLike in the graph)
    run = runner(graph)
    rng = np.random.default_rng([seed, 1234])  # the same batches for every loss of this seed
    so = session_options(1)

    def inference(path: Path):
        """The exported model with the runner's current weights; logits from input ids."""
        run.save_inference_model(model_onnx, path)
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]

        def logits(ids: np.ndarray) -> np.ndarray:
            feeds = {"input_ids": ids}
            if "labels" in names:
                feeds["labels"] = ids  # unused by the logits; any valid ids keep the CE finite
            return sess.run(["logits"], feeds)[0]

        return logits

    curve = []
    step_times: list[float] = []
    acc = {"loss": 0.0, "ce": 0.0, "number": 0.0, "n": 0}

    def validate(step: int) -> None:
        m = evaluate(inference(out_dir / "current.onnx"), val)
        row = {"step": step, "mae_+": m["+"]["mae"], "mae_*": m["*"]["mae"],
               "exact": m["all"]["exact"], "log_mae": m["all"]["log_mae"],
               "digit_acc": m["all"]["digit_acc"]}
        if acc["n"]:
            row.update(train_loss=acc["loss"] / acc["n"], train_ce=acc["ce"] / acc["n"],
                       train_number=acc["number"] / acc["n"])
            acc.update(loss=0.0, ce=0.0, number=0.0, n=0)
        curve.append(row)

    validate(0)
    t_run = time.perf_counter()
    for step in range(1, cfg["steps"] + 1):
        ids, lab = task.train_batch(cfg["batch"], rng)
        t0 = time.perf_counter()
        loss, ce, number = run.step({"input_ids": ids, "labels": lab}, lr=learning_rate(step, cfg))
        step_times.append(time.perf_counter() - t0)
        if not math.isfinite(loss):
            raise SystemExit(f"{name} seed {seed}: loss {loss} at step {step}")
        acc["loss"] += loss
        acc["ce"] += ce
        acc["number"] += number
        acc["n"] += 1
        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
            validate(step)
    wall = time.perf_counter() - t_run

    # -- final evaluation with the trained weights
    params = run.parameters()
    np.savez(out_dir / "parameters.npz", **params)
    infer_logits = inference(out_dir / "trained.onnx")
    parity = checkpoint_parity(params, torch_model_fn, infer_logits)
    tests = {split: evaluate(infer_logits, fixed_problems(split, cfg["test_n"], 777))
             for split in task.SPLITS}
    st = np.array(step_times[min(10, len(step_times) - 1):]) * 1000
    return {"loss": name, "seed": seed, "curve": curve, "test": tests,
            "ms_per_step_median": float(np.median(st)), "ms_per_step_mean": float(st.mean()),
            "train_wall_s": wall, "torch_vs_ort_max_abs_logit_diff": parity}


def checkpoint_parity(params: dict, torch_model_fn, infer_logits) -> float:
    """Load the trained parameters into the torch model; its logits must match the inference
    graph's."""
    import torch

    model = torch_model_fn()
    sd = model.state_dict()
    loaded = {}
    for k in sd:
        loaded[k] = torch.from_numpy(np.array(params[k], dtype=np.float32).reshape(sd[k].shape))
    model.load_state_dict(loaded)
    model.eval()
    rng = np.random.default_rng(5)
    ids, _ = task.train_batch(8, rng)
    with torch.no_grad():
        want = model.logits(torch.from_numpy(ids)).numpy()
    got = infer_logits(ids)
    diff = float(np.abs(got - want).max())
    assert diff < 1e-4, f"torch model with the trained weights differs: {diff}"
    return diff


# ----------------------------------------------------------------------------- timing


def timing_benchmark(graphs: dict[str, Path], cfg: dict, seed: int) -> dict:
    """Interleaved: `rounds` x (each loss: `steps` training steps); per loss the median step time
    of every round (the first 3 steps of a round are warm-up)."""
    runs = {name: runner(g) for name, g in graphs.items()}
    rng = np.random.default_rng([seed, 99])
    batches = [task.train_batch(cfg["batch"], rng) for _ in range(cfg["timing_steps"])]
    per_round: dict[str, list[float]] = {n: [] for n in graphs}
    for r in range(cfg["timing_rounds"]):
        names = list(graphs) if r % 2 == 0 else list(reversed(graphs))
        for name in names:
            ts = []
            for ids, lab in batches:
                t0 = time.perf_counter()
                runs[name].step({"input_ids": ids, "labels": lab}, lr=cfg["lr"])
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

    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "onnxruntime_path": onnxruntime.__file__,
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
                    help="graphs and trained weights (default: OUT/../work, or OUT/work with --smoke)")
    ap.add_argument("--ntl-patch", default=None, help="ntl-patch binary (default $NTL_PATCH_BIN, "
                    "else target/release/ntl-patch, else target/debug/ntl-patch)")
    ap.add_argument("--losses", default=None, help=f"comma list of {','.join(LOSSES)} (default all)")
    ap.add_argument("--ort-site", type=Path, default=None,
                    help="a folder holding an onnxruntime package to use (e.g. a `pip install --target` "
                    "folder of onnxruntime 1.31.1), put first on sys.path")
    ap.add_argument("--report-only", action="store_true", help="rewrite table and plots from OUT/results.json")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs OUT/results.json already holds (same configuration) and do the rest")
    for k, v in FULL.items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=None, help=f"(full: {v}, smoke: {SMOKE[k]})")
    args = ap.parse_args(argv)

    if args.ort_site is not None:
        sys.path.insert(0, str(args.ort_site.resolve()))
    sys.path.insert(0, str(REPO / "python"))  # ntl_patch.StepRunner
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
    seed_graphs: dict[str, Path] = {}
    if args.resume and (out / "results.json").is_file():
        prev = json.loads((out / "results.json").read_text())
        same = {k: v for k, v in prev["config"].items() if k != "seeds"} == {
            k: v for k, v in cfg.items() if k != "seeds"}
        if not same or list(prev["losses"]) != losses:
            raise SystemExit("--resume: OUT/results.json was made with another configuration or losses")
        runs = [r for r in prev["runs"] if r["seed"] < cfg["seeds"]]
        meta["patch_summaries"] = prev["patch_summaries"]
        # the earlier parts' wall time counts; the pauses between the parts do not
        parts = prev.get("parts", [])
        own = prev["wall_s"] - sum(p["wall_s"] for p in parts)
        meta["parts"] = parts + [{"started": prev["started"], "wall_s": own, "runs_after": len(runs),
                                  "loadavg_start": prev["loadavg_start"], "loadavg_end": prev["loadavg_end"]}]
        t_start -= prev["wall_s"]
        log(f"resuming after {len(runs)} run(s)")
    done = {(r["seed"], r["loss"]) for r in runs}
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
        for name in losses:
            t0 = time.time()
            rdir = sdir / name
            rdir.mkdir(parents=True, exist_ok=True)
            graph = rdir / "lm.step.onnx"
            summary = step_graph(bin_, sdir / "lm.onnx", tokenizer, LOSSES[name], graph, cfg)
            assert sorted(summary["parameters"]) == sorted(init), "every parameter trains"
            meta["patch_summaries"][name] = {k: summary[k] for k in ("loss", "weight", "number_tokens")}
            if seed == 0:
                seed_graphs[name] = graph
            if (seed, name) in done:
                continue
            run = train_one(name, graph, sdir / "lm.onnx", seed, cfg, val, rdir, torch_model_fn)
            runs.append(run)
            save(False)
            t = run["test"]["iid"]
            log(f"[{len(runs)}/{n_total}] seed {seed} {name:12s} {time.time() - t0:6.1f}s  "
                f"{run['ms_per_step_median']:.2f} ms/step  iid: exact + {t['+']['exact']:.3f} "
                f"* {t['*']['exact']:.3f}  MAE + {t['+']['mae']:.1f} * {t['*']['mae']:.1f}  "
                f"digit acc {t['all']['digit_acc']:.3f}")

    log("interleaved timing benchmark")
    meta["timing"] = timing_benchmark(seed_graphs, cfg, 0)
    save(True)
    report.write(out)
    log(f"done in {time.time() - t_start:.0f}s: {str(out / 'table.md').replace(str(REPO) + '/', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

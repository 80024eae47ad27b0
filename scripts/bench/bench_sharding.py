#!/usr/bin/env python3
"""Memory of DataParallel's shard modes (ZeRO): per-rank peak RSS and step time of
shard="none" | "optimizer" | "gradients" on R CPU ranks (gloo), on bench_real_size.py's Qwen2
shapes (bench/README.md, section "Sharded optimizer state").

    flock /tmp/heavy.lock .venv/bin/python scripts/bench/bench_sharding.py --preset qwen0.5b
    .venv/bin/python scripts/bench/bench_sharding.py --preset small          # a check (1 min)

The model, tokenizer and batch are bench_real_size.py's (its `prepare`, same presets and
overrides, e.g. `--layers 12`); the graphs are `ntl-patch step --split --loss wasserstein
--weight 0.3 --max-grad-norm 1.0`. Each mode is one `torchrun --nproc-per-node R` run of this
script's worker (one thread per rank; every rank trains on the same batch), --rounds rounds in a
rotated order. Each rank reports:
  lifetime peak   VmHWM at the end: loading, the first step and the later steps;
  training peak   VmHWM over steps 2.. alone: reset after the first step (writing 5 to
                  /proc/self/clear_refs);
  after setup     VmRSS once DataParallel is built (the state read, no step yet);
and its step times. The per-rank state model beside it (docs/PYTHON.md): bytes per parameter
16 (none), 8 + 8/R (optimizer), 4 + 12/R (gradients) for the rank's share of the moments.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "bench"))
MODES = ("none", "optimizer", "gradients")


def status() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            out[key] = int(rest.split()[0]) / 1024  # MiB
    return out


def track_phases(dp, dist, phases: list) -> None:
    """Wraps the step's phases (the gradient graph runs, the collectives, the update graph, the
    owners' broadcasts) so that each records [VmRSS before, VmHWM during] (MiB, the largest of
    its calls) in phases[-1]: VmHWM is reset before each (the phases do not nest); what came
    between two phases is kept as "between" [0, VmHWM]."""
    def wrap(name, fn):
        def run(*a, **k):
            st = status()
            before, rec = st["VmRSS"], phases[-1].setdefault("between", [0.0, 0.0])
            rec[1] = max(rec[1], st["VmHWM"])
            Path("/proc/self/clear_refs").write_text("5")
            try:
                return fn(*a, **k)
            finally:
                rec = phases[-1].setdefault(name, [0.0, 0.0])
                rec[0], rec[1] = max(rec[0], before), max(rec[1], status()["VmHWM"])
        return run

    dp._gradient_run.accumulate = wrap("gradient graph", dp._gradient_run.accumulate)
    dp._update_run = wrap("update graph", dp._update_run)
    for op in ("all_reduce", "reduce"):
        setattr(dist, op, wrap("reduction", getattr(dist, op)))
    if dp.shard != "none":
        dp._strategy._broadcast = wrap("broadcast", dp._strategy._broadcast)


def worker(work: Path, mode: str, steps: int) -> None:
    """One rank: DataParallel(shard=mode) on work/model.grad.onnx; writes work/<mode>-<rank>.json."""
    import numpy as np
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "python"))
    from ntl_patch import DataParallel
    from ntl_patch._sessions import default_session_options

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    so = default_session_options()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    z = np.load(work / "batch.npz")
    t0 = time.perf_counter()
    dp = DataParallel(work / "model.grad.onnx", providers=["CPUExecutionProvider"], session_options=so,
                      shard=mode)
    load_s, setup = time.perf_counter() - t0, status()
    batch = dict(zip(dp.data_inputs, (z["input_ids"], z["labels"])))
    phases: list[dict] = []
    track_phases(dp, dist, phases)
    times, losses, first, hwm = [], [], {}, 0.0
    for s in range(steps):
        phases.append({})
        t0 = time.perf_counter()
        losses.append(dp.step(batch))
        times.append(time.perf_counter() - t0)
        if s == 0:
            first = status()
            first["VmHWM"] = max(first["VmHWM"], *(v[1] for v in phases[0].values()))
        else:
            hwm = max(hwm, status()["VmHWM"], *(v[1] for v in phases[-1].values()))
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    end = status()
    end["VmHWM"] = max(hwm, end["VmHWM"])
    own = sum(int(np.prod(dp._training.values[p].shape())) for p in
              (dp._strategy.shards[dp.rank] if dp.shard != "none" else dp.parameter_names))
    (work / f"{mode}-{dp.rank}.json").write_text(json.dumps({
        "rank": dp.rank, "world": dp.world_size, "load_s": load_s, "times": times, "losses": losses,
        "setup_rss": setup["VmRSS"], "lifetime_hwm": max(setup["VmHWM"], first["VmHWM"], end["VmHWM"]),
        "training_hwm": end["VmHWM"], "own_elements": own, "phases": phases}))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # as tests/python/dp_worker.py: no destroy_process_group


def write_graphs(args, work: Path, meta: dict) -> int:
    grad = work / "model.grad.onnx"
    if not (args.reuse and grad.exists() and "split_elements" in meta):
        cmd = [args.bin, "step", str(work / "model.onnx"), "--tokenizer", str(work / "tokenizer.json"),
               "--loss", "wasserstein", "--weight", "0.3", "--split", "--max-grad-norm", "1.0",
               "-o", str(grad), "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"ntl-patch step --split failed: {r.stderr.strip()[-1000:]}")
        meta["split_elements"] = json.loads(r.stdout)["parameter_elements"]
        (work / "meta.json").write_text(json.dumps(meta, indent=1))
    return int(meta["split_elements"])


def run_mode(work: Path, mode: str, ranks: int, steps: int) -> list[dict]:
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", str(ranks), __file__, "worker",
                        str(work), mode, str(steps)], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"shard={mode}: torchrun exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return [json.loads((work / f"{mode}-{k}.json").read_text()) for k in range(ranks)]


def model_gib(mode: str, elements: int, own: int) -> float:
    """ZeRO's state model of one rank (docs/PYTHON.md) with the rank's actual share `own` of the
    parameters in place of P/R: parameters 4 B each, gradients 4 (only its own with
    "gradients"), AdamW's moments 8 for its own."""
    per = {"none": 16 * elements, "optimizer": 8 * elements + 8 * own,
           "gradients": 4 * elements + 12 * own}[mode]
    return per / 2**30


def markdown(args, meta, elements: int, res: dict) -> str:
    s = meta["spec"]
    R = args.ranks
    lines = [f"Preset `{args.preset}`: Qwen2 shape, {s['layers']} layers, d {s['dim']}, V {s['vocab']}, tied "
             f"embeddings, B={s['batch']}, T={s['seq']}; {elements / 1e6:.1f} M parameters; {R} ranks "
             f"(gloo, 1 thread each), {args.steps} steps per run, {args.rounds} rounds; load "
             f"{res['load'][0]:.1f} → {res['load'][1]:.1f}.", "",
             "| shard | rank | own parameters (M) | state model GiB | after setup MiB | training peak MiB | "
             "lifetime peak MiB | × none (training / lifetime) | s/step (median of steps 2+) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = {k: res["none"][k] for k in range(R)} if "none" in res else {}
    for mode in args.modes:
        for k in range(R):
            runs = res[mode][k]
            tr = statistics.median(r["training_hwm"] for r in runs)
            life = statistics.median(r["lifetime_hwm"] for r in runs)
            setup = statistics.median(r["setup_rss"] for r in runs)
            later = [t for r in runs for t in r["times"][1:]] or [t for r in runs for t in r["times"]]
            ratio = "-"
            if base and mode != "none":
                b = base[k]
                ratio = (f"{tr / statistics.median(r['training_hwm'] for r in b):.2f} / "
                         f"{life / statistics.median(r['lifetime_hwm'] for r in b):.2f}")
            own = runs[0]["own_elements"]
            lines.append(f"| `{mode}` | {k} | {own / 1e6:.1f} | {model_gib(mode, elements, own):.2f} | "
                         f"{setup:.0f} | {tr:.0f} | {life:.0f} | {ratio} | {statistics.median(later):.2f} |")
    names = ("gradient graph", "between", "reduction", "update graph", "broadcast")
    lines += ["", "Where the peak is (steps 2+, the largest call of each phase, median over the runs): "
              "RSS before the phase → VmHWM during it, MiB.", "",
              "| shard | rank | " + " | ".join(names) + " |", "| --- | ---: |" + " ---: |" * len(names)]
    for mode in args.modes:
        for k in range(R):
            cells = []
            for name in names:
                vals = [[max(st[name][i] for st in r["phases"][1:] or r["phases"] if name in st)
                         for i in (0, 1)] for r in res[mode][k]
                        if any(name in st for st in r["phases"][1:] or r["phases"])]
                cells.append("-" if not vals else
                             (f"{statistics.median(v[1] for v in vals):.0f}" if name == "between" else
                              f"{statistics.median(v[0] for v in vals):.0f} → "
                              f"{statistics.median(v[1] for v in vals):.0f}"))
            lines.append(f"| `{mode}` | {k} | " + " | ".join(cells) + " |")
    losses = {m: res[m][0][0]["losses"] for m in args.modes}
    ref = losses[args.modes[0]]
    diff = max(abs(a - b) / max(abs(b), 1e-12) for m in args.modes for x, y in zip(losses[m], ref)
               for a, b in zip(x, y))
    lines.append(f"\nLosses of every mode within {diff:.1e} (relative) of `{args.modes[0]}`'s over "
                 f"{args.steps} steps.")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
        return
    import bench_real_size as brs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--markdown")
    p.add_argument("--json")
    argv = sys.argv[1:]
    ours, rest = p.parse_known_args(argv)
    args = brs.parse_args(rest + ["--configs", "torch"])
    args.ranks, args.modes = ours.ranks, [m for m in ours.modes.split(",") if m]
    work = Path(args.workdir)
    meta = brs.prepare(args, work)
    elements = write_graphs(args, work, meta)
    load0 = os.getloadavg()[0]
    res: dict = {m: {k: [] for k in range(args.ranks)} for m in args.modes}
    for rnd in range(args.rounds):
        order = args.modes[rnd % len(args.modes):] + args.modes[:rnd % len(args.modes)]
        for mode in order:
            for r in run_mode(work, mode, args.ranks, args.steps):
                res[mode][r["rank"]].append(r)
                print(f"round {rnd + 1} {mode} rank {r['rank']}: training peak {r['training_hwm']:.0f} MiB, "
                      f"lifetime {r['lifetime_hwm']:.0f} MiB, {statistics.median(r['times']):.2f} s/step",
                      flush=True)
    res["load"] = (load0, os.getloadavg()[0])
    md = markdown(args, meta, elements, res)
    print(md)
    if ours.markdown:
        Path(ours.markdown).write_text(md + "\n")
    if ours.json:
        Path(ours.json).write_text(json.dumps({"meta": meta, "results": res}, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The longest sequence each configuration trains at batch 1 (issue 33's row "longest bf16
sequence at B 1 with recomputation"): the step graph against torch on the same device, both
sides searched in one run, interleaved.

    # on one GPU (scripts/gpu/bench_attention_gpu.sh part S): the step graph's blockwise attention
    # with recomputation against torch + SDPA + gradient checkpointing, bfloat16
    python scripts/bench/longest_sequence.py --preset qwen0.5b --device cuda --precision bf16 \\
        --configs chunked-rc,torch-sdpa-ckpt --start 8192 --max 131072 --deadline-s 300
    # on the CPU: the same search under an RSS ceiling that stands for the device's memory
    .venv/bin/python scripts/bench/longest_sequence.py --preset small --rss-limit-gib 1 \\
        --start 1024 --max 16384

The model is exported once with the sequence length a symbol (bench_real_size.py's export with
`dynamic_seq`: the same Qwen2ForCausalLM, seeded weights), so one step graph serves every length.
Each try is one process (bench_real_size.py's worker) that loads, trains --steps steps (2: the
second holds the optimizer state beside the activations) on a batch of 1 × T and reports its time,
memory and losses. T starts at --start and doubles while every configuration still trains; a
configuration drops out at its first failure (out of memory, an error, a non-finite loss or past
--try-timeout-s). Then --refine bisection steps (multiples of --granule) narrow the gap between
each configuration's longest success and its first failure. A try that the deadline leaves no
time for is reported as not tried: the table says "at least".

The table: per configuration the longest T it trained, its step time and memory there (GPU:
the device's used memory above the start, NVML; CPU: peak RSS), the first T it did not train and
why; and at every T both sides trained, the step-1 losses against the first torch
configuration's (the graph's dynamic-length export computes what torch computes).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_real_size as brs  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(brs.PRESETS), default="small")
    p.add_argument("--configs", default="chunked-rc,torch-sdpa-ckpt",
                   help="step configurations (bench_real_size.py's, or --step-config) and torch ones")
    p.add_argument("--step-config", action="append", default=[], metavar="NAME=ARGS")
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16"))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--tf32", choices=("on", "off"), default="off")
    p.add_argument("--start", type=int, default=4096, help="the first sequence length tried")
    p.add_argument("--max", type=int, default=131072, help="no longer sequence is tried")
    p.add_argument("--refine", type=int, default=2, help="bisection steps after the doubling")
    p.add_argument("--granule", type=int, default=1024, help="bisection lengths are multiples of it")
    p.add_argument("--steps", type=int, default=2, help="training steps per try")
    p.add_argument("--try-timeout-s", type=float, default=300, help="a try past it counts as failed")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="seconds from the start after which no try starts (nor runs on)")
    p.add_argument("--export-seq", type=int, default=128, help="the export's example length")
    p.add_argument("--rss-limit-gib", type=float, help="kill a try whose RSS passes it (the CPU's ceiling)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workdir", default=None, help="default: target/bench-real-size/<preset>-longest")
    p.add_argument("--reuse", action="store_true", help="reuse the work dir's export and step graphs")
    p.add_argument("--force", action="store_true", help="skip the memory and load checks")
    p.add_argument("--bin", default=None)
    p.add_argument("--python", default=None, help="the interpreter of every try (bench_real_size.py's --python)")
    p.add_argument("--json")
    p.add_argument("--markdown")
    args = p.parse_args(argv)
    if not 8 <= args.start <= args.max:
        p.error("--start must be at least 8 and at most --max")
    forwarded = ["--preset", args.preset, "--configs", args.configs, "--device", args.device, "--tf32", args.tf32,
                 "--batch", "1", "--seq", str(args.export_seq), "--steps", str(args.steps), "--warmup", "1",
                 "--threads", str(args.threads), "--workdir", args.workdir or
                 str(brs.REPO / "target" / "bench-real-size" / f"{args.preset}-longest")]
    for flag, value in (("--precision", args.precision), ("--rss-limit-gib", args.rss_limit_gib),
                        ("--bin", args.bin), ("--python", args.python)):
        if value is not None:
            forwarded += [flag, str(value)]
    forwarded += [x for item in args.step_config for x in ("--step-config", item)]
    forwarded += ["--reuse"] * args.reuse + ["--force"] * args.force
    bench = brs.parse_args(forwarded)
    # one export for every length: T a symbol, positions up to --max
    bench.spec.update(dynamic_seq=1, max_seq=args.max)
    return args, bench


def batch_file(work: Path, meta: dict, seq: int) -> Path:
    """A seeded 1 × seq batch as bench_real_size.py makes its own."""
    path = work / f"batch-{seq}.npz"
    if not path.exists():
        vocab = json.loads((work / "tokenizer.json").read_text())["model"]["vocab"]
        spec = meta["spec"]
        brs.write_batch(path, vocab, 1, seq, spec["vocab"], spec["seed"] + seq)
    return path


def over_ceiling(r: dict, limit_gib: float | None) -> bool:
    """The driver polls RSS every 0.25 s: a try that passed the ceiling between polls has a peak
    (VmHWM) over it and did not train within it."""
    return limit_gib is not None and "error" not in r and r["mem"]["VmHWM"] > limit_gib * 1024


def trained(r: dict) -> bool:
    return "error" not in r and all(math.isfinite(x) for step in r["losses"] for x in step)


def memory_mib(r: dict, device: str) -> float:
    return r["mem"].get("gpu_peak", 0.0) if device == "cuda" else r["mem"]["VmHWM"]


def describe_try(kind: str, seq: int, r: dict, device: str) -> str:
    if "error" in r:
        return f"T {seq} {kind}: did not train: {r['error']}"
    times = ", ".join(f"{t:.3f}" for t in r["times"])
    what = f"s/step {times}, {'GPU' if device == 'cuda' else 'peak RSS'} {memory_mib(r, device):.0f} MiB"
    return f"T {seq} {kind}: {what}, losses {r['losses'][0]}" + ("" if trained(r) else " (not finite)")


class Search:
    """Every configuration's tries, T → result."""

    def __init__(self, args, bench, work: Path, meta: dict, kinds: list[str]):
        self.args, self.bench, self.work, self.meta, self.kinds = args, bench, work, meta, kinds
        self.tries: dict[str, dict[int, dict]] = {k: {} for k in kinds}
        self.t_start = time.perf_counter()
        self.cut_off: set[str] = set()

    def left_s(self) -> float:
        if self.args.deadline_s is None:
            return math.inf
        return self.args.deadline_s - (time.perf_counter() - self.t_start)

    def attempt(self, kind: str, seq: int) -> bool:
        left = self.left_s()
        if left < 5:
            self.cut_off.add(kind)
            return False
        timeout = min(self.args.try_timeout_s, left)
        r = brs.run_one(self.bench, self.work, self.meta, kind, batch_file(self.work, self.meta, seq), timeout)
        if r.get("killed") and timeout < self.args.try_timeout_s and "time limit" in r["error"]:
            self.cut_off.add(kind)  # the deadline's doing, not the configuration's
            return False
        if over_ceiling(r, self.args.rss_limit_gib):
            r["error"] = f"peak RSS {r['mem']['VmHWM'] / 1024:.2f} GiB > the ceiling {self.args.rss_limit_gib} GiB"
        self.tries[kind][seq] = r
        print(describe_try(kind, seq, r, self.args.device), flush=True)
        return trained(r)

    def longest(self, kind: str) -> int | None:
        ok = [t for t, r in self.tries[kind].items() if trained(r)]
        return max(ok) if ok else None

    def first_failure(self, kind: str) -> int | None:
        bad = [t for t, r in self.tries[kind].items() if not trained(r)]
        return min(bad) if bad else None

    def run(self) -> None:
        alive = list(self.kinds)
        seq = self.args.start
        while alive and seq <= self.args.max:  # doubling, every configuration at each length
            alive = [k for k in alive if self.attempt(k, seq)]
            seq *= 2
        g = self.args.granule
        for _ in range(self.args.refine):  # bisection between each one's longest and first failure
            for kind in self.kinds:
                lo, hi = self.longest(kind) or 0, self.first_failure(kind)
                if hi is None or kind in self.cut_off:
                    continue
                mid = (lo + hi) // 2 // g * g
                if lo < mid < hi:
                    self.attempt(kind, mid)


def table(search: Search) -> list[str]:
    args, device = search.args, search.args.device
    mem = "GPU memory MiB (above the start)" if device == "cuda" else "peak RSS MiB"
    lines = [f"| configuration | longest T trained (B 1) | s/step there | {mem} there | first T not trained | why |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for kind in search.kinds:
        best, bad = search.longest(kind), search.first_failure(kind)
        if best is None:
            cells = ["none", "", ""]
        else:
            r = search.tries[kind][best]
            at_least = "≥ " if bad is None else ""
            cells = [f"{at_least}{best}", f"{statistics.median(r['times'][1:] or r['times']):.3f}",
                     f"{memory_mib(r, device):.0f}"]
        if bad is None:
            why = "not tried: --max reached" if best is not None and best * 2 > args.max else \
                "not tried: the deadline"
            cells += ["", why]
        else:
            cells += [str(bad), search.tries[kind][bad].get("error", "a non-finite loss")[:300].replace("|", "/")]
        lines.append(f"| `{kind}` | " + " | ".join(cells) + " |")
    return lines


def loss_lines(search: Search) -> list[str]:
    """At each length every configuration trained: step 1's losses against the first torch one's."""
    ref = next((k for k in search.kinds if k in brs.TORCH_KINDS), None)
    if ref is None:
        return []
    out = []
    for seq in sorted(search.tries[ref]):
        r0 = search.tries[ref][seq]
        if not trained(r0):
            continue
        for kind in search.kinds:
            r = search.tries[kind].get(seq)
            if kind == ref or r is None or not trained(r):
                continue
            d = brs.loss_diff(r["losses"][:1], r0["losses"][:1])
            out.append(f"- T {seq}: `{kind}` step 1 losses {[round(x, 6) for x in r['losses'][0]]}, `{ref}` "
                       f"{[round(x, 6) for x in r0['losses'][0]]}: largest relative difference {d:.2e}")
    return out


def main():
    args, bench = parse_args()
    work = Path(bench.workdir)
    brs.check_machine(bench)
    env = {}
    if args.device == "cuda":
        env["gpu"] = brs.gpu_info()
    meta = brs.prepare(bench, work)
    kinds = [k for k in bench.config_list if k in brs.TORCH_KINDS or "error" not in meta["step_graphs"][k]]
    for k in bench.config_list:
        if k not in kinds:
            print(f"`{k}`: no step graph: {meta['step_graphs'][k]['error']}", flush=True)
    search = Search(args, bench, work, meta, kinds)
    search.run()
    spec = meta["spec"]
    head = (f"Longest sequence at B 1, preset `{args.preset}` ({spec['layers']} layers, d {spec['dim']}, "
            f"{spec['heads']}/{spec['kv_heads']} heads, MLP {spec['mlp']}, V {spec['vocab']}); export: "
            f"{meta['exporter']}; device {args.device}{' (' + env['gpu'] + ')' if env.get('gpu') else ''}; "
            f"--precision {args.precision or '(none)'}, --tf32 {args.tf32}; T from {args.start} doubling up to "
            f"{args.max}, {args.refine} bisection steps (multiples of {args.granule}); {args.steps} steps a try, "
            f"a try past {args.try_timeout_s:.0f} s fails"
            + (f"; RSS ceiling {args.rss_limit_gib} GiB" if args.rss_limit_gib else "")
            + f"; {time.perf_counter() - search.t_start:.0f} s of tries.")
    extra = [f"- `{k}`: `{bench.step_configs[k]}`" for k in kinds if k not in brs.TORCH_KINDS]
    md = "\n".join([head, "", *extra, "", *table(search), "", *loss_lines(search)])
    print(md, flush=True)
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "env": env, "options": vars(args),
                                               "tries": {k: {str(t): r for t, r in v.items()}
                                                         for k, v in search.tries.items()}}, indent=1))


if __name__ == "__main__":
    main()

"""Table (table.md) and plots (val_mae.png, time_per_step.png) from results.json.

    .venv/bin/python examples/arithmetic/report.py [RESULTS_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

SPLIT_TITLES = {
    "iid": "unseen pairs, training range (`iid`)",
    "interp": "interpolation: one operand in the held-out band (`interp`)",
    "extrap": "extrapolation: one operand above the training range (`extrap`)",
}
COLORS = {"ce": "#444444", "wasserstein": "#1f77b4", "mse": "#2ca02c", "ntil": "#d62728",
          "ntil-add": "#ff7f0e", "dist2": "#9467bd", "smmd": "#8c564b", "del": "#e377c2"}


def _ms(values, fmt: str, scale: float = 1.0) -> str:
    v = np.asarray(values, dtype=np.float64) * scale
    if len(v) == 1:
        return format(v[0], fmt)
    return f"{format(v.mean(), fmt)} ± {format(v.std(ddof=1), fmt)}"


def _by(runs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in runs:
        out.setdefault(r["loss"], []).append(r)
    for v in out.values():
        v.sort(key=lambda r: r["seed"])
    return out


def _metric(r: dict, split: str, key: str) -> float:
    op, m = key.split(":")
    return r["test"][split][op][m]


COLUMNS = [  # (header, key, format, scale, higher is better)
    ("exact `+`", "+:exact", ".1f", 100, True),
    ("exact `*`", "*:exact", ".1f", 100, True),
    ("MAE `+`", "+:mae", ".1f", 1, False),
    ("MAE `*`", "*:mae", ".0f", 1, False),
    ("log-MAE", "all:log_mae", ".3f", 1, False),
    ("digit acc", "all:digit_acc", ".1f", 100, True),
]


def timing_summary(res: dict) -> dict[str, dict]:
    by = _by(res["runs"])
    rounds = res.get("timing", {}).get("rounds", {})
    base_rounds = np.array(rounds.get("ce", [np.nan]))
    base_train = np.median([r["ms_per_step_median"] for r in by.get("ce", [])] or [np.nan])
    out = {}
    for name, rs in by.items():
        train = [r["ms_per_step_median"] for r in rs]
        rr = np.array(rounds.get(name, [np.nan]))
        # ratio per round (the rounds interleave the losses), then the median
        ratio = np.median(rr / base_rounds) if len(rr) == len(base_rounds) else np.nan
        out[name] = {"train_ms": train, "train_ratio": float(np.median(train) / base_train),
                     "bench_ms": rr.tolist(), "bench_ratio": float(ratio),
                     "bench_ratio_rounds": (rr / base_rounds).tolist() if len(rr) == len(base_rounds) else []}
    return out


def sign_test(k: int, n: int) -> float:
    """Two-sided sign test: the chance of k or a count as far from n/2 among n fair coin flips."""
    from math import comb

    tail = sum(comb(n, i) for i in range(0, min(k, n - k) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def verdict(rs: list[dict], base: list[dict], split: str) -> tuple[str, str]:
    """Paired by seed on log-MAE and exact match (both ops pooled)."""
    pairs = [(r, b) for r in rs for b in base if b["seed"] == r["seed"]]
    n = len(pairs)
    d_log = np.array([_metric(r, split, "all:log_mae") - _metric(b, split, "all:log_mae") for r, b in pairs])
    d_ex = np.array([_metric(r, split, "all:exact") - _metric(b, split, "all:exact") for r, b in pairs])
    better_log = int((d_log < 0).sum())
    better_ex = int((d_ex > 0).sum())
    rel = d_log.mean() / np.mean([_metric(b, split, "all:log_mae") for _, b in pairs]) * 100
    cell = (f"{rel:+.0f}% ({better_log}/{n} seeds lower, p {sign_test(better_log, n):.2f}) | "
            f"{d_ex.mean() * 100:+.1f} pp ({better_ex}/{n} seeds higher, p {sign_test(better_ex, n):.2f})")
    if n < 2:
        word = "one seed only"
    elif better_log == n and better_ex == n:
        word = "**better** (every seed, both metrics)"
    elif better_log == 0 and better_ex == 0:
        word = "**worse** (every seed, both metrics)"
    elif better_log == n or better_ex == n:
        word = "better on one metric in every seed, not both"
    elif better_log == 0 or better_ex == 0:
        word = "worse on one metric in every seed, not both"
    else:
        word = "no consistent difference"
    return cell, word


def consistent(by: dict[str, list[dict]]) -> str:
    """Per operation: exact match and MAE differences from CE that go the same way in every seed."""
    base = {r["seed"]: r for r in by["ce"]}
    found = []
    for name, rs in by.items():
        if name == "ce":
            continue
        for split in SPLIT_TITLES:
            for op in ("+", "*"):
                for m, label, fmt, scale, higher in (("exact", "exact", ".1f", 100, True),
                                                     ("mae", "MAE", ".1f", 1, False)):
                    d = np.array([_metric(r, split, f"{op}:{m}") - _metric(base[r["seed"]], split, f"{op}:{m}")
                                  for r in rs if r["seed"] in base]) * scale
                    if len(d) < 2 or not ((d > 0).all() or (d < 0).all()):
                        continue
                    good = (d > 0).all() == higher
                    unit = " pp" if m == "exact" else ""
                    found.append(f"{name} `{split}` `{op}` {label} {format(d.mean(), '+' + fmt)}{unit} "
                                 f"({'better' if good else 'worse'})")
    n = len(base)
    k = len(by) - 1
    total = k * len(SPLIT_TITLES) * 2 * 2
    head = (f"Per operation, differences from CE in the same direction in all {n} seeds (exact match, "
            f"MAE; {k} losses × {len(SPLIT_TITLES)} splits × 2 operations × 2 metrics = {total} "
            f"comparisons; if each seed were a coin flip, about {total * 2 / 2 ** n:.1f} of them would "
            "go one way in every seed by chance): ")
    return head + ("; ".join(found) if found else "none") + "."


def table(res: dict) -> str:
    by = _by(res["runs"])
    cfg = res["config"]
    n_seeds = len({r["seed"] for r in res["runs"]})
    lines = []
    lines.append(f"Mean ± standard deviation over {n_seeds} seed(s) (sample sd); test problems per "
                 f"operation and split: {cfg['test_n']}. exact = exact-match accuracy of the greedy "
                 "answer (%); MAE = mean |decoded − true| per operation; log-MAE = mean "
                 "|log10(1+decoded) − log10(1+true)| over both operations; digit acc = teacher-forced "
                 "argmax accuracy on the answer's digit tokens (%). Lower MAE / log-MAE is better.")
    lines.append("")
    for split, title in SPLIT_TITLES.items():
        lines.append(f"**{title}**")
        lines.append("")
        lines.append("| loss | " + " | ".join(c[0] for c in COLUMNS) + " |")
        lines.append("| --- |" + " ---: |" * len(COLUMNS))
        for name, rs in by.items():
            cells = [_ms([_metric(r, split, c[1]) for r in rs], c[2], c[3]) for c in COLUMNS]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    if "ce" in by and len(by) > 1:
        lines.append("**Against the CE baseline, paired by seed** (same initial weights, same batches): "
                     "change of log-MAE (relative to CE's) and of exact match (percentage points); p is "
                     "the two-sided sign test over the seeds (no correction for the many comparisons).")
        lines.append("")
        lines.append("| loss | split | log-MAE vs CE | exact match vs CE | verdict |")
        lines.append("| --- | --- | ---: | ---: | --- |")
        for name, rs in by.items():
            if name == "ce":
                continue
            for split in SPLIT_TITLES:
                cell, word = verdict(rs, by["ce"], split)
                lines.append(f"| {name} | `{split}` | {cell} | {word} |")
        lines.append("")
        lines.append(consistent(by))
        lines.append("")
    tm = timing_summary(res)
    t = res.get("timing", {})
    lines.append(f"**Time per training step** (forward + backward + AdamW: one run of the step graph "
                 f"in onnxruntime, batch {cfg['batch']}, one thread; `ce` is the step graph with λ = 0, "
                 "which still computes NTL-WAS's value). *during training*: median of each run's median step time (the runs ran at "
                 "different times under a varying background load: a rough guide only); "
                 f"*interleaved*: {len(next(iter(t.get('rounds', {'': []}).values())))} round(s) of "
                 f"{t.get('steps_per_round', '?')} steps per loss, round-robin on the same batches, "
                 "median step time per round (mean ± sd over rounds); × CE is the median over rounds of the "
                 "per-round ratio.")
    lines.append("")
    lines.append("| loss | ms/step during training | × CE | ms/step interleaved | × CE |")
    lines.append("| --- | ---: | ---: | ---: | ---: |")
    for name, s in tm.items():
        lines.append(f"| {name} | {_ms(s['train_ms'], '.2f')} | {s['train_ratio']:.2f} | "
                     f"{_ms(s['bench_ms'], '.2f')} | {s['bench_ratio']:.2f} |")
    lines.append("")
    return "\n".join(lines)


def plots(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = _by(res["runs"])
    n_seeds = len({r["seed"] for r in res["runs"]})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), dpi=110)
    panels = [("mae_+", "validation MAE, `a+b` (3-digit operands)", True),
              ("mae_*", "validation MAE, `a*b` (2-digit operands)", True),
              ("exact", "validation exact match (both operations)", False)]
    for ax, (key, title, logy) in zip(axes, panels):
        for name, rs in by.items():
            steps = np.array([row["step"] for row in rs[0]["curve"]])
            ys = np.array([[row[key] for row in r["curve"]] for r in rs])
            if key == "exact":
                ys = ys * 100
            c = COLORS.get(name)
            ax.plot(steps, ys.mean(0), label=name, color=c, lw=1.8)
            if len(rs) > 1:
                ax.fill_between(steps, ys.min(0), ys.max(0), color=c, alpha=0.15, lw=0)
        ax.set_title(title.replace("`", ""), fontsize=10)
        ax.set_xlabel("training step")
        if logy:
            ax.set_yscale("log")
            ax.set_ylabel("mean |decoded − true|")
        else:
            ax.set_ylabel("exact match (%)")
        ax.grid(alpha=0.3, which="both")
    axes[2].legend(title="loss", fontsize=9, loc="lower right")
    fig.suptitle(f"Greedy-decoded answers on {res['config']['val_n']} unseen pairs per operation "
                 f"(line: mean over {n_seeds} seed(s); band: min–max)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out / "val_mae.png")
    plt.close(fig)

    tm = timing_summary(res)
    names = list(tm)
    colors = [COLORS.get(n, "#888") for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.3), dpi=110)
    x = np.arange(len(names))
    # left: the ratio to CE, per interleaved round (the measurement), median and min-max
    rat = [np.array(tm[n]["bench_ratio_rounds"] or [np.nan]) for n in names]
    med = np.array([np.median(r) for r in rat])
    ax1.bar(x, med, 0.6, yerr=[med - [r.min() for r in rat], [r.max() for r in rat] - med], capsize=4,
            color=colors)
    for i, (m, r) in enumerate(zip(med, rat)):
        ax1.text(x[i], r.max() + 0.01, f"×{m:.2f}", ha="center", va="bottom", fontsize=10)
    ax1.axhline(1.0, color="k", lw=0.8, ls=":")
    ax1.set_xticks(x, names)
    ax1.set_ylim(0, max(1.2, float(np.nanmax([r.max() for r in rat])) * 1.15))
    ax1.set_ylabel("time per step / CE's time per step")
    ax1.set_title(f"relative to CE, interleaved rounds (median, min–max of {len(rat[0])} rounds)",
                  fontsize=10)
    ax1.grid(axis="y", alpha=0.3)
    # right: absolute milliseconds
    bench = [np.median(tm[n]["bench_ms"]) for n in names]
    train = [np.median(tm[n]["train_ms"]) for n in names]
    ax2.bar(x - 0.2, bench, 0.4, color=colors, label="interleaved rounds (median)")
    ax2.bar(x + 0.2, train, 0.4, color=colors, alpha=0.4,
            label="during the training runs (median; background load varied)")
    ax2.set_xticks(x, names)
    ax2.set_ylabel("ms per training step")
    ax2.set_title("absolute", fontsize=10)
    ax2.legend(fontsize=8, loc="lower right")
    ax2.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Step graph in onnxruntime, time per step: forward + backward + AdamW, batch "
                 f"{res['config']['batch']}, 1 thread", fontsize=11)
    fig.tight_layout()
    fig.savefig(out / "time_per_step.png")
    plt.close(fig)


def write(out: Path) -> None:
    res = json.loads((out / "results.json").read_text())
    (out / "table.md").write_text(table(res))
    plots(res, out)


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "results")

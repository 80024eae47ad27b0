#!/usr/bin/env python3
"""Benchmark one training step of the `ntl-patch step` graph against ORT Training, torch eager and
onnxsim's compile_training_loop (bench/README.md, section "Step graph").

    .venv/bin/python scripts/bench/bench_step_graph.py [--rounds 10] [--models tinylm,gpt2] [--profile]

Models (both V = 32000, labels 30 % digit tokens, 2 % -100, NTL-WAS weight 0.3):
  tinylm  fixtures/tiny_lm.py TinyLM ("flat" CE), dim 64, hidden 128, B=4, T=512 (the setting of
          scripts/bench/bench_training_step.py)
  gpt2    transformers GPT2LMHeadModel, 4 layers, d=256, 4 heads, B=8, T=256, random init,
          dropout 0, eager attention, exported with its own loss (TorchScript exporter, opset 17,
          training=TRAINING, do_constant_folding=False, dynamic B/T), as fixtures/generate_step.py

Configurations, each in its own process (scripts/bench/bench_step_graph_worker.py):
  step     `ntl-patch step model.onnx --loss wasserstein` (AdamW), onnxruntime (.venv-rt) via
           python/ntl_patch StepRunner (state stays in OrtValues between steps); at V = 32000 the
           LM head is fused (chunked) by default
  dense    the same with `--fused-head off` (the [N, V] logits held)
  step16   the same with `--precision fp16` (not in the default --configs)
  ort      `ntl-patch model.onnx --loss wasserstein` -> generate_artifacts(AdamW), ORT Training (.venv)
  torch    torch eager, CE + 0.3*ntloss.NTLoss(digit_level=True), torch.optim.AdamW (.venv)
  onnxsim  onnxsim.compile_training_loop(forward patch with static B/T, "adam") (.venv-bench)
All use lr 1e-3, betas (0.9, 0.999), eps 1e-8 and (except onnxsim's "adam") weight decay 0.01.

Every worker loads, then --warmup steps each, then --rounds rounds of one step per configuration
(rotated order), one process stepping at a time. Reported per configuration: median/min/p10-p90
s/step, the ratio of medians to `ort`, the median paired ratio (each step over the mean of the
`ort` steps of the same and the next round), CPU s/step, and the process's peak RSS (VmHWM).
--profile: the step graph's per-node kernel times (onnxruntime enable_profiling), aggregated by op
type and by node-name prefix.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "bench"))
sys.path.insert(0, str(REPO / "fixtures"))
sys.dont_write_bytecode = True

import bench_step_graph_worker as worker  # noqa: E402

PYTHONS = {"step": REPO / ".venv-rt/bin/python", "step16": REPO / ".venv-rt/bin/python",
           "dense": REPO / ".venv-rt/bin/python",
           "ort": REPO / ".venv/bin/python",
           "torch": REPO / ".venv/bin/python", "onnxsim": REPO / ".venv-bench/bin/python"}
LABELS = {
    "step": "`ntl-patch step` graph, onnxruntime 1.31.1 (StepRunner)",
    "step16": "the same with `--precision fp16` (CPU: float16 nodes run in float32)",
    "dense": "`ntl-patch step --fused-head off` graph (the dense LM head), onnxruntime 1.31.1",
    "ort": "ORT Training 1.19.2: forward patch + generate_artifacts",
    "torch": "torch eager, CE + 0.3·ntloss.NTLoss",
    "onnxsim": "onnxsim 0.8.1 `compile_training_loop`",
}
MODELS = {
    "tinylm": dict(arch="tinylm", vocab=32000, dim=64, hidden=128, batch=4, seq=512),
    "gpt2": dict(arch="gpt2", vocab=32000, dim=256, layers=4, heads=4, batch=8, seq=256, tied=False),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tinylm,gpt2")
    p.add_argument("--configs", default="step,dense,ort,torch,onnxsim")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--profile", action="store_true",
                   help="profile the step graph (5 runs after 3 warm-up) and the ORT Training graph")
    p.add_argument("--bin", default=os.environ.get("NTL_PATCH_BIN", str(REPO / "target/release/ntl-patch")))
    p.add_argument("--workdir", default=str(REPO / "target" / "bench-step-graph"))
    p.add_argument("--reuse", action="store_true", help="reuse a work dir's prepared models (meta.json)")
    p.add_argument("--json")
    p.add_argument("--markdown")
    p.add_argument("--seed", type=int, default=20240917)
    return p.parse_args()


def run_cli(bin_: str, argv: list) -> float:
    cmd = [bin_] + [str(a) for a in argv]
    print("  $ " + " ".join(cmd).replace(str(REPO) + "/", ""), flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"ntl-patch failed ({r.returncode}): {r.stderr.strip()}")
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- setup


def prepare(name: str, args, work: Path) -> dict:
    import numpy as np
    import onnx
    import torch

    import bench_training_step as bts

    spec = dict(MODELS[name], seed=args.seed)
    work.mkdir(parents=True, exist_ok=True)
    vocab = bts.make_tokenizer(work / "tokenizer.json", spec["vocab"], args.seed)
    digit_ids = [vocab[str(d)] for d in range(10)]
    ns = argparse.Namespace(batch=spec["batch"], seq=spec["seq"], vocab=spec["vocab"], seed=args.seed,
                            digit_frac=0.3, ignore_frac=0.02)
    ids, labels = bts.make_batch(ns, digit_ids)
    np.savez(work / "batch.npz", input_ids=ids, labels=labels)

    print(f"[{name}] export", flush=True)
    model = worker.build_torch_model(spec).train()
    ex_ids = torch.randint(0, spec["vocab"], (2, 7), generator=torch.Generator().manual_seed(args.seed + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if spec["arch"] == "gpt2":
            import generate_step

            guard = generate_step._NoPackedSequenceCheck()
        else:
            import contextlib

            guard = contextlib.nullcontext()
        with guard:
            torch.onnx.export(
                model, (ex_ids, ex_ids.clone()), str(work / "model.onnx"),
                dynamo=False, opset_version=17, training=torch.onnx.TrainingMode.TRAINING,
                do_constant_folding=False, input_names=["input_ids", "labels"], output_names=["loss"],
                dynamic_axes={"input_ids": {0: "B", 1: "T"}, "labels": {0: "B", 1: "T"}},
            )
    t_step = run_cli(args.bin, ["step", work / "model.onnx", "--loss", "wasserstein",
                                "-o", work / "model.step.onnx", "--json"])
    run_cli(args.bin, ["step", work / "model.onnx", "--loss", "wasserstein", "--precision", "fp16",
                       "-o", work / "model.step16.onnx"])
    run_cli(args.bin, ["step", work / "model.onnx", "--loss", "wasserstein", "--fused-head", "off",
                       "-o", work / "model.dense.step.onnx"])
    t_patch = run_cli(args.bin, [work / "model.onnx", "--loss", "wasserstein", "-o", work / "model.ntl.onnx"])
    sm = onnx.load(str(work / "model.step.onnx"), load_external_data=False)
    step_meta = json.loads({q.key: q.value for q in sm.metadata_props}["ntl_step"])
    params = step_meta["parameters"]
    print(f"[{name}] generate_artifacts ({len(params)} trained parameters)", flush=True)
    art = work / "ort-artifacts"
    if art.exists():
        import shutil

        shutil.rmtree(art)
    # ORT's LayerNormalizationGrad reads the Mean/InvStdDev outputs, which the TorchScript exporter
    # leaves undeclared (generate_artifacts then fails in GradientBuilderBase::O): declare them
    m = onnx.load(str(work / "model.ntl.onnx"))
    for n in m.graph.node:
        if n.op_type == "LayerNormalization" and len(n.output) == 1:
            n.output.extend([n.output[0] + "_mean", n.output[0] + "_inv_std_var"])
    onnx.save(m, str(work / "model.ort.ntl.onnx"))
    bts.generate(work / "model.ort.ntl.onnx", art, params)

    # onnxsim wants static shapes: the forward patch with B and T fixed
    m = onnx.load(str(work / "model.ntl.onnx"))
    for vi in m.graph.input:
        for d, v in zip(vi.type.tensor_type.shape.dim, (spec["batch"], spec["seq"])):
            d.ClearField("dim_param")
            d.dim_value = v
    onnx.save(m, str(work / "model.static.ntl.onnx"))

    nodes = len(sm.graph.node)
    import hashlib

    st = Path(args.bin).stat()
    binary = {"path": str(args.bin), "mtime": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(st.st_mtime)) + " UTC",
              "size": st.st_size,
              "step_graph_sha256": hashlib.sha256((work / "model.step.onnx").read_bytes()).hexdigest()[:16]}
    meta = dict(spec, binary=binary, parameters=params, step_nodes=nodes, step_cli_s=t_step, patch_cli_s=t_patch,
                n_params=int(sum(p.numel() for p in model.parameters())))
    (work / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


# ----------------------------------------------------------------------------- run


class Proc:
    def __init__(self, kind: str, work: Path, threads: int):
        self.kind = kind
        self.log = open(work / f"worker-{kind}.log", "w")
        self.p = subprocess.Popen([str(PYTHONS[kind]), str(REPO / "scripts/bench/bench_step_graph_worker.py"), kind,
                                   str(work), "--threads", str(threads)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.ready = None

    def reply(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            self.p.wait()
            return {"error": f"worker exited {self.p.returncode} (see worker-{self.kind}.log)"}
        return json.loads(line)

    def cmd(self, c: str) -> dict:
        self.p.stdin.write(c + "\n")
        self.p.stdin.flush()
        return self.reply()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def bench_model(name: str, args, work: Path, configs: list[str]) -> dict:
    res = {"configs": {}, "errors": {}}
    procs = {}
    for kind in configs:  # load one at a time (loading competes for the cores otherwise)
        print(f"[{name}] load {kind}", flush=True)
        pr = Proc(kind, work, args.threads)
        r = pr.reply()
        if "error" in r:
            res["errors"][kind] = r
            print(f"[{name}] {kind} cannot run: {r['error'][:400]}", flush=True)
            pr.p.wait()
            continue
        pr.ready = r
        procs[kind] = pr
    times = {k: [] for k in procs}
    cpus = {k: [] for k in procs}
    losses = {k: [] for k in procs}
    for k, pr in list(procs.items()):
        for _ in range(args.warmup):
            r = pr.cmd("step")
            if "error" in r:
                res["errors"][k] = r
                print(f"[{name}] {k} failed in warm-up: {r['error'][:400]}", flush=True)
                del procs[k]
                break
            losses[k].append(r["loss"])
    order = list(procs)
    t0 = time.perf_counter()
    for rnd in range(args.rounds):
        rot = order[rnd % len(order):] + order[: rnd % len(order)]
        for k in rot:
            if k not in procs:
                continue
            r = procs[k].cmd("step")
            if "error" in r:
                res["errors"][k] = r
                del procs[k]
                continue
            times[k].append(r["s"])
            cpus[k].append(r["cpu"])
            losses[k].append(r["loss"])
        print(f"[{name}] round {rnd + 1}/{args.rounds}: " +
              ", ".join(f"{k} {times[k][-1]:.2f}s" for k in rot if times.get(k)) +
              f"  (load {os.getloadavg()[0]:.1f})", flush=True)
    res["timed_s"] = time.perf_counter() - t0
    for k, pr in procs.items():
        q = pr.cmd("quit")
        pr.p.wait()
        ts = times[k]
        base = times.get("ort") or []
        paired = []
        if base and k != "ort":
            for i, t in enumerate(ts):
                nb = [base[j] for j in (i, i + 1) if j < len(base)]
                paired.append(t / (sum(nb) / len(nb)))
        res["configs"][k] = {
            "steps": len(ts), "median": statistics.median(ts), "min": min(ts), "p10": pct(ts, 0.1),
            "p90": pct(ts, 0.9), "cpu": statistics.median(cpus[k]), "times": ts, "losses": losses[k],
            "paired": statistics.median(paired) if paired else None, "peak_rss_mib": q["peak_rss_mib"],
            "load_s": pr.ready["load_s"], "versions": pr.ready["versions"],
        }
    return res


def profile(name: str, args, work: Path) -> dict:
    r = subprocess.run([str(PYTHONS["step"]), str(REPO / "scripts/bench/bench_step_graph_worker.py"), "profile",
                        str(work), "--threads", str(args.threads)], capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": r.stderr[-2000:]}
    p = json.loads(r.stdout.strip().splitlines()[-1])
    per_node, kinds = p["per_node"], p["kinds"]

    # Which part of the step a node belongs to, by the name of its first output in the step graph
    # (the node names are all `ntl/<Op>_<k>`; the tensors are `ntl/grad/...`, `ntl/opt/...`,
    # `ntl/next/...`). ORT renames fused nodes `<original name>/<Fusion>/...`; nodes that ORT itself
    # inserted (e.g. the function body of SoftmaxCrossEntropyLoss, which onnxruntime's inference
    # build runs as LogSoftmax + ...) have no original.
    import onnx

    g = onnx.load(str(work / "model.step.onnx"), load_external_data=False).graph
    first_out = {n.name: (n.output[0] if n.output else "") for n in g.node}

    def original(n: str):
        if n in first_out:
            return n
        best = None
        for cut in range(len(n) - 1, 0, -1):
            if n[cut] == "/" and n[:cut] in first_out:
                best = n[:cut]
                break
        return best

    def prefix(n: str) -> str:
        o = original(n)
        if o is None:
            return "inserted by ORT (function bodies, casts)"
        t = first_out[o]
        if t.startswith("ntl/grad/"):
            return "backward (ntl/grad/ tensors)"
        if t.startswith(("ntl/opt/", "ntl/next/")):
            return "optimizer (ntl/opt/, ntl/next/ tensors)"
        if t.startswith("ntl/") or o.startswith("ntl/"):
            return "number loss forward (other ntl/ tensors)"
        return "model forward (exported nodes)"

    by_op, by_prefix, cnt_op, cnt_prefix = (collections.Counter() for _ in range(4))
    by_prefix_op = collections.Counter()
    for n, ms in per_node.items():
        by_op[kinds[n]] += ms
        cnt_op[kinds[n]] += 1
        by_prefix[prefix(n)] += ms
        cnt_prefix[prefix(n)] += 1
        by_prefix_op[(prefix(n), kinds[n])] += ms
    top_nodes = sorted(per_node.items(), key=lambda x: -x[1])[:15]
    return {
        "model_run_ms": p["model_run_ms"], "walls": p["walls"], "total_ms": sum(per_node.values()),
        "nodes": len(per_node),
        "by_op": [(k, v, cnt_op[k]) for k, v in by_op.most_common(15)],
        "by_prefix": [(k, v, cnt_prefix[k]) for k, v in by_prefix.most_common()],
        "by_prefix_op": [(f"{a} / {b}", v) for (a, b), v in by_prefix_op.most_common(15)],
        "top_nodes": [(n, kinds[n], ms, first_out.get(original(n) or "", "-")) for n, ms in top_nodes],
        "profile_file": p["profile_file"],
    }


def ort_profile(args, work: Path, params) -> dict:
    """bench_training_step.py's profile of an ORT Training graph, by op type."""
    import numpy as np

    import bench_training_step as bts

    z = np.load(work / "batch.npz")
    try:
        p = bts.profile(work / "ort-artifacts", (z["input_ids"], z["labels"]), params, args.threads, 3, work)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    by_op = collections.Counter()
    cnt = collections.Counter()
    for n, ms in p["per_node"].items():
        by_op[p["kinds"][n]] += ms
        cnt[p["kinds"][n]] += 1
    return {"total_ms": sum(p["per_node"].values()), "wall_ms": p["wall_ms"], "nodes": len(p["per_node"]),
            "by_op": [(k, v, cnt[k]) for k, v in by_op.most_common(15)],
            "top_nodes": sorted(((n, p["kinds"][n], ms) for n, ms in p["per_node"].items()), key=lambda x: -x[2])[:15]}


# ----------------------------------------------------------------------------- report


def markdown(all_res: dict, args, env: dict) -> str:
    out = []
    for name, res in all_res.items():
        meta = res["meta"]
        if meta["arch"] == "tinylm":
            desc = (f"TinyLM, dim {meta['dim']}, hidden {meta['hidden']}, one block, V={meta['vocab']}, "
                    f"B={meta['batch']}×T={meta['seq']}")
        else:
            desc = (f"GPT-2, {meta['layers']} layers, d={meta['dim']}, {meta['heads']} heads, V={meta['vocab']}, "
                    f"B={meta['batch']}×T={meta['seq']}, untied lm_head")
        b = meta.get("binary", {})
        out.append(f"#### {name}: {desc} ({meta['n_params'] / 1e6:.1f} M parameters, step graph "
                   f"{meta['step_nodes']} nodes, sha256 {b.get('step_graph_sha256', '?')}…, written by "
                   f"`{b.get('path', '?')}` built {b.get('mtime', '?')})\n")
        out.append("| configuration | steps | median s/step | min | p10 – p90 | × ORT Training (medians) | "
                   "paired × ORT Training | CPU s/step | peak RSS MiB | × ORT Training RSS | loss, step 1 → last |")
        out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        ort = res["configs"].get("ort")
        for k in args.configs.split(","):
            c = res["configs"].get(k)
            if c is None:
                err = res["errors"].get(k, {}).get("error", "not run")
                out.append(f"| `{k}`: {LABELS[k]} | cannot run: {err.splitlines()[0][:600]} | | | | | | | | | |")
                continue
            rm = f"{c['median'] / ort['median']:.3f}" if ort else "-"
            rr = f"{c['peak_rss_mib'] / ort['peak_rss_mib']:.2f}" if ort else "-"
            pr = f"**{c['paired']:.3f}**" if c["paired"] is not None else "-"
            out.append(f"| `{k}`: {LABELS[k]} | {c['steps']} | {c['median']:.3f} | {c['min']:.3f} | "
                       f"{c['p10']:.3f} – {c['p90']:.3f} | {rm} | {pr} | {c['cpu']:.3f} | "
                       f"{c['peak_rss_mib']:.0f} | {rr} | {c['losses'][0]:.4f} → {c['losses'][-1]:.4f} |")
        out.append("")
        pf = res.get("profile")
        if pf and "error" not in pf:
            out.append(f"Step-graph profile ({pf['nodes']} nodes after ORT's optimizations; ms per step, "
                       f"per-node median of {len(pf['model_run_ms'])} profiled steps; Σ kernel "
                       f"{pf['total_ms']:.0f} ms, model_run median {statistics.median(pf['model_run_ms']):.0f} ms):\n")
            out.append("| part (node name prefix) | nodes | ms | share |")
            out.append("| --- | ---: | ---: | ---: |")
            for k, v, n in pf["by_prefix"]:
                out.append(f"| {k} | {n} | {v:.1f} | {100 * v / pf['total_ms']:.1f}% |")
            out.append("")
            out.append("| op type | nodes | ms | share |")
            out.append("| --- | ---: | ---: | ---: |")
            for k, v, n in pf["by_op"]:
                out.append(f"| {k} | {n} | {v:.1f} | {100 * v / pf['total_ms']:.1f}% |")
            out.append("")
            out.append("| part / op type | ms | share |")
            out.append("| --- | ---: | ---: |")
            for k, v in pf["by_prefix_op"]:
                out.append(f"| {k} | {v:.1f} | {100 * v / pf['total_ms']:.1f}% |")
            out.append("")
            out.append("| node | op | first output in the step graph | ms |")
            out.append("| --- | --- | --- | ---: |")
            for n, kind, ms, t in pf["top_nodes"]:
                out.append(f"| `{n}` | {kind} | `{t}` | {ms:.1f} |")
            out.append("")
        elif pf:
            out.append(f"Profile failed: {pf['error'][-300:]}\n")
        op = res.get("ort_profile")
        if op and "error" not in op:
            out.append(f"ORT Training graph for comparison (forward + backward + gradient accumulation, no "
                       f"optimizer; InferenceSession, {op['nodes']} nodes; Σ kernel {op['total_ms']:.0f} ms/run):\n")
            out.append("| op type | nodes | ms | share |")
            out.append("| --- | ---: | ---: | ---: |")
            for k, v, n in op["by_op"]:
                out.append(f"| {k} | {n} | {v:.1f} | {100 * v / op['total_ms']:.1f}% |")
            out.append("")
        elif op:
            out.append(f"ORT profile failed: {op['error'][-300:]}\n")
    return "\n".join(out)


def main():
    args = parse_args()
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    configs = args.configs.split(",")
    env = {"python": platform.python_version(), "load_start": os.getloadavg()}
    all_res = {}
    t_all = time.perf_counter()
    for name in args.models.split(","):
        work = root / name
        if args.reuse and (work / "meta.json").exists():
            meta = json.loads((work / "meta.json").read_text())
        else:
            meta = prepare(name, args, work)
        res = bench_model(name, args, work, configs)
        res["meta"] = meta
        if args.profile:
            print(f"[{name}] profile the step graph", flush=True)
            res["profile"] = profile(name, args, work)
            print(f"[{name}] profile the ORT Training graph (forward + backward, no optimizer)", flush=True)
            res["ort_profile"] = ort_profile(args, work, meta["parameters"])
        all_res[name] = res
    env["total_s"] = time.perf_counter() - t_all
    env["load_end"] = os.getloadavg()
    md = markdown(all_res, args, env)
    print(md)
    print(f"total {env['total_s']:.0f} s")
    if args.markdown:
        Path(args.markdown).write_text(md + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "results": all_res}, indent=1, default=str))


if __name__ == "__main__":
    main()

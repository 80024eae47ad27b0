#!/usr/bin/env python3
"""GPU check of `ntl-patch step` graphs (docs/STEP_GRAPH.md): train them with plain onnxruntime
(python/ntl_patch StepRunner) on CUDAExecutionProvider and on CPUExecutionProvider, and compare.

Run through `scripts/gpu/gpu-check.sh --step`, which makes the environment (onnxruntime-gpu 1.31.1,
numpy 2.2.6 and the CUDA / cuDNN runtime wheels that build loads; no torch, no onnx). For each
fixture x loss (default: lm_flat, gpt2_ts, gpt2_dynamo, llama_ts, llama_dynamo x wasserstein,
ntil; NTIL with --gumbel-noise 0 --combine add, since the Gumbel noise is drawn in the graph and
the CPU and CUDA generators differ):

  1. `ntl-patch step MODEL --tokenizer fixtures/tokenizer.json --loss L --weight 0.3
     --optimizer adamw --lr 1e-3` writes the step graph;
  2. `ntl-patch inspect --target cuda --json` on the step graph: the nodes the kernel tables of
     onnxruntime-gpu 1.31.1 say fall back to CPU (no kernel) or that ORT keeps on CPU on purpose
     (small shape computations, `cpu_preferred`);
  3. STEPS training steps with StepRunner (the state stays on the device between steps) on the
     CUDA provider and on the CPU provider, on the same batches: for GPT-2 / Llama the trajectory
     batches of fixtures/reference/step/{gpt2,llama}.npz (traj/batch/00..), for lm_flat seeded
     int64 batches of tokens 4..39 with some -100 labels, shapes [2,7] / [3,5] alternating;
  4. comparison: every per-step loss (total, ce, number) within --loss-rtol (relative); every final
     trained parameter within --rtol, norm-relative, with a floor of 1e-3 * the norm of all
     parameters (tests/python's measure). Elements whose gradient is zero in exact arithmetic are
     left out: there the computed gradient is pure round-off, and AdamW (m / sqrt(v)) turns any
     round-off into steps of +-lr, different on each device. Those are the elements whose float64
     reference gradient grad/wasserstein/float64/<p> in the npz is <= 1e-9 * its largest entry,
     and for lm_flat (no npz) the whole of k.bias (attention scores are shift invariant per
     query: the key bias gets no gradient). The report gives the error without that mask too;
  5. placement: the CUDA session records ORT's own node assignment
     (session.record_ep_graph_assignment_info; ORT's verbose log when that API is missing):
     the session must run on CUDAExecutionProvider with nodes assigned to it. A second,
     unoptimised session (so node names match the file) gives the nodes ORT puts on CPU; these
     are compared with what step 2 predicts (`predicted_only`, `ort_only`; Memcpy nodes aside).
     --strict-placement fails a case whose ORT CPU nodes inspect did not predict.

The CUDA session uses use_tf32=0 (ORT's CUDA provider defaults to TF32 matmuls on Ampere and
newer, ~1e-3 relative error); both use use_deterministic_compute (--no-deterministic: off). Without a usable CUDA provider (no GPU,
no driver, a driver older than the build's CUDA, a CPU-only onnxruntime) it says so and runs the
CPU side only (step, inspect, CPU training: finite losses), exit 0 (--require-gpu: exit 2).
--self-test runs the whole comparison without a GPU: the "device" run is the CPU provider with
graph optimisations off and its initial parameters changed by a relative 1e-7 (float32 round-off
size; --self-test-jitter), so the tolerances and the left-out elements meet real drift.
Report: OUT/gpu-check-step.json. Exit 1 when a comparison fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures"
TOKENIZER = FIXTURES / "tokenizer.json"
STEP_REF = FIXTURES / "reference" / "step"
MODELS = ["lm_flat", "gpt2_ts", "gpt2_dynamo", "llama_ts", "llama_dynamo"]
LOSSES = ["wasserstein", "ntil"]
EXTRA = {"ntil": ["--gumbel-noise", "0", "--combine", "add"]}
WEIGHT = 0.3
LR = 1e-3
# parameters whose gradient is zero in exact arithmetic, for fixtures without a float64 reference
STRUCTURAL_ZERO = {"lm_flat": ["k.bias"]}
ZERO_REL = 1e-9
MEMCPY = {"MemcpyToHost", "MemcpyFromHost"}

sys.path.insert(0, str(REPO / "python"))


def log(msg: str) -> None:
    print(msg, flush=True)


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=REPO, **kw)


@contextlib.contextmanager
def captured_stderr(path: Path):
    """Redirects file descriptor 2 (where ONNX Runtime's C++ logger writes) into `path`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "wb") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


# --- the CUDA provider ------------------------------------------------------------------------

PROBE = """
import sys
import onnxruntime as ort
if hasattr(ort, "preload_dlls"):
    ort.preload_dlls()
sys.path.insert(0, sys.argv[1])
path = sys.argv[2]
so = ort.SessionOptions()
so.log_severity_level = 3
s = ort.InferenceSession(path, so, providers=[("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"])
print(s.get_providers()[0])
"""


def nvidia_smi() -> dict:
    if not shutil.which("nvidia-smi"):
        return {"present": False}
    info: dict = {"present": True}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=60)
        info["gpus"] = [line.strip() for line in q.stdout.splitlines() if line.strip()]
        h = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60)
        m = re.search(r"CUDA Version:\s*([0-9.]+)", h.stdout)
        info["driver_cuda"] = m.group(1) if m else None
    except (OSError, subprocess.TimeoutExpired) as e:
        info["error"] = str(e)
    return info


def build_cuda_version(ort) -> str | None:
    try:
        from onnxruntime.capi import build_and_package_info as b
    except ImportError:
        return None
    return getattr(b, "cuda_version", None) or None


def cuda_status(ort, probe_model: Path, smi: dict) -> tuple[bool, str]:
    """Whether a CUDA session really starts, probed in a child process (a broken CUDA setup can
    abort the process; a provider that cannot load falls back to CPU with only a log line)."""
    built = build_cuda_version(ort)
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False, (f"this onnxruntime ({ort.__version__}, providers {ort.get_available_providers()}) has no "
                       "CUDAExecutionProvider (a CPU-only build: GPU_CHECK_STEP_ORT=cpu?)")
    hint = ""
    if smi.get("driver_cuda") and built:
        try:
            if float(smi["driver_cuda"]) < float(built):
                hint = (f"; the driver supports CUDA {smi['driver_cuda']} but this onnxruntime-gpu is built "
                        f"for CUDA {built}: a newer driver is needed")
        except ValueError:
            pass
    try:
        r = subprocess.run([sys.executable, "-c", PROBE, str(REPO / "python"), str(probe_model)],
                           capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return False, "the CUDA provider probe timed out" + hint
    if r.returncode == 0 and r.stdout.strip().endswith("CUDAExecutionProvider"):
        return True, f"CUDAExecutionProvider starts (onnxruntime-gpu built for CUDA {built})"
    text = re.sub(r"\x1b\[[0-9;]*m", "", r.stderr.strip() or r.stdout.strip())
    tail = " | ".join(x.strip() for x in text.splitlines()[-3:] if x.strip())
    how = f"exit {r.returncode}" if r.returncode else "ORT fell back to CPU"
    return False, (f"the CUDA provider does not start (no GPU or driver, or missing CUDA {built} / cuDNN 9 "
                   f"libraries; {how}){hint}: {tail}")


# --- inputs -----------------------------------------------------------------------------------

def family(model: str) -> str:
    return model.split("_")[0]


def make_batches(model: str, steps: int) -> tuple[list[dict], str]:
    fam = family(model)
    npz = STEP_REF / f"{fam}.npz"
    if fam in ("gpt2", "llama") and npz.is_file():
        z = np.load(npz)
        n = len({k.split("/")[2] for k in z.files if k.startswith("traj/batch/")})
        out = [{"input_ids": z[f"traj/batch/{k % n:02d}/input_ids"].astype(np.int64),
                "labels": z[f"traj/batch/{k % n:02d}/labels"].astype(np.int64)} for k in range(steps)]
        return out, f"{npz.relative_to(REPO)} traj/batch/00..{min(steps, n) - 1:02d}" + (" (cycled)" if steps > n else "")
    rng = np.random.default_rng(20260)
    out = []
    for k in range(steps):
        shape = (2, 7) if k % 2 == 0 else (3, 5)
        ids = rng.integers(4, 40, size=shape, dtype=np.int64)
        labels = ids.copy()
        labels[rng.random(shape) < 0.2] = -100
        labels[0, 0] = ids[0, 0]  # at least one counted label
        out.append({"input_ids": ids, "labels": labels})
    return out, "seeded int64 batches, tokens 4..39, ~20% labels -100, shapes [2,7]/[3,5]"


def zero_masks(model: str, params: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], str]:
    """Elements to leave out of the parameter comparison (True = left out)."""
    masks = {p: np.zeros(a.shape, dtype=bool) for p, a in params.items()}
    npz = STEP_REF / f"{family(model)}.npz"
    how = []
    if family(model) in ("gpt2", "llama") and npz.is_file():
        z = np.load(npz)
        found = 0
        for p in params:
            key = f"grad/wasserstein/float64/{p}"
            if key in z.files and z[key].shape == params[p].shape:
                g = np.abs(z[key])
                masks[p] = g <= ZERO_REL * g.max() if g.max() > 0 else np.ones(g.shape, dtype=bool)
                found += 1
        how.append(f"float64 reference gradient <= {ZERO_REL:g} x max ({npz.name}, {found}/{len(params)} parameters)")
    for p in STRUCTURAL_ZERO.get(model, []):
        if p in masks:
            masks[p][...] = True
            how.append(f"{p} (zero gradient by construction)")
    return masks, "; ".join(how) or "none"


# --- runs -------------------------------------------------------------------------------------

DETERMINISTIC = True  # --no-deterministic clears it


def session_options(ort, *, optimize: bool = True, verbose: bool = False):
    so = ort.SessionOptions()
    so.log_severity_level = 0 if verbose else 3
    so.use_deterministic_compute = DETERMINISTIC
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return so


def assignment(sess) -> dict | None:
    """ORT's node -> execution provider assignment (onnxruntime >= 1.23), or None."""
    if not hasattr(sess, "get_provider_graph_assignment_info"):
        return None
    try:
        info = sess.get_provider_graph_assignment_info()
    except Exception:  # noqa: BLE001 - not recorded / not supported: use the log
        return None
    by_ep: dict[str, list[tuple[str, str]]] = {}
    for sub in info:
        by_ep.setdefault(sub.ep_name, []).extend((n.op_type, n.name) for n in sub.get_nodes())
    return by_ep


PLACED = re.compile(r"Node\(s\) placed on \[(\w+)\]\. Number of nodes: (\d+)")
ALL_PLACED = re.compile(r"All nodes placed on \[(\w+)\]\. Number of nodes: (\d+)")
PLACED_NODE = re.compile(r"VerifyEachNodeIsAssignedToAnEp\]\s{2,}(\S+) \((.*)\)\s*$")


def log_assignment(text: str) -> dict[str, list[tuple[str, str]]]:
    """The node placements in ORT's verbose session log (VerifyEachNodeIsAssignedToAnEp)."""
    by_ep: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.splitlines():
        m = ALL_PLACED.search(line)
        if m:
            by_ep[m.group(1)] = [("?", "?")] * int(m.group(2))
            current = None
            continue
        m = PLACED.search(line)
        if m:
            current = m.group(1)
            by_ep.setdefault(current, [])
            continue
        m = PLACED_NODE.search(line)
        if m and current:
            by_ep[current].append((m.group(1), m.group(2)))
        elif "VerifyEachNodeIsAssignedToAnEp" not in line:
            current = None
    return by_ep


def summarize_assignment(by_ep: dict) -> dict:
    out = {"nodes": {ep: len(v) for ep, v in sorted(by_ep.items())}}
    cpu = [(op, n) for op, n in by_ep.get("CPUExecutionProvider", []) if op not in MEMCPY]
    ops: dict[str, int] = {}
    for op, _ in cpu:
        ops[op] = ops.get(op, 0) + 1
    out["cpu_op_types"] = dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))
    return out


def train(ort, path: Path, providers: list, batches: list[dict], *, optimize: bool = True,
          jitter: float = 0.0) -> dict:
    from ntl_patch import StepRunner

    t0 = time.perf_counter()
    runner = StepRunner(path, providers=providers, session_options=session_options(ort, optimize=optimize))
    if jitter:  # self-test: float32 round-off-sized differences in the initial parameters
        rng = np.random.default_rng(7)
        state = runner.state_dict()
        for p in runner.parameter_names:
            a = state[p]
            state[p] = (a * (1 + jitter * rng.standard_normal(a.shape))).astype(a.dtype)
        runner.load_state_dict(state)
    load_s = time.perf_counter() - t0
    losses = []
    t0 = time.perf_counter()
    for b in batches:
        losses.append(list(runner.step(b)))
    step_s = time.perf_counter() - t0
    params = {p: np.asarray(a, dtype=np.float64) for p, a in runner.parameters().items()}
    by_ep = assignment(runner.session)
    return {"losses": losses, "params": params, "providers": runner.session.get_providers(),
            "device": f"{runner.device}:{runner.device_id}", "steps_taken": runner.steps_taken,
            "assignment": summarize_assignment(by_ep) if by_ep is not None else None,
            "load_seconds": round(load_s, 3), "step_seconds": round(step_s, 3)}


def placement(ort, path: Path, providers: list, log_file: Path) -> dict:
    """ORT's placement on the unoptimised graph (node names as in the file): API and verbose log."""
    with captured_stderr(log_file):
        sess = ort.InferenceSession(str(path), session_options(ort, optimize=False, verbose=True),
                                    providers=providers)
    by_api = assignment(sess)
    by_log = log_assignment(log_file.read_text(errors="replace"))
    by_ep = by_api if by_api is not None else by_log
    cpu_nodes = sorted({n for op, n in by_ep.get("CPUExecutionProvider", []) if op not in MEMCPY})
    return {"source": "session.get_provider_graph_assignment_info" if by_api is not None else "verbose log",
            "providers": sess.get_providers(), **summarize_assignment(by_ep),
            "log_nodes": {ep: len(v) for ep, v in sorted(by_log.items())},
            "cpu_nodes": cpu_nodes}


def inspect_cuda(bin_path: str, model: Path) -> dict:
    r = run([bin_path, "inspect", model, "--target", "cuda", "--json"])
    if r.returncode != 0:
        return {"error": r.stderr.strip()}
    g = json.loads(r.stdout)["gpu"][0]
    return {
        "target": g.get("target"), "onnxruntime": g.get("onnxruntime"), "summary": g["summary"],
        "nodes": g.get("nodes"), "all_ops_on_gpu": g.get("all_ops_on_gpu"),
        "fallbacks": [{"op": f["op"], "version": f["version"], "types": f["types"], "reason": f["reason"],
                       "nodes": f["nodes"]} for f in g["fallbacks"]],
        "cpu_preferred": g["cpu_preferred"],
    }


# --- comparison -------------------------------------------------------------------------------

def norm(a: np.ndarray) -> float:
    return float(np.linalg.norm(a.ravel()))


def compare(cpu: dict, dev: dict, masks: dict, args) -> dict:
    steps = []
    ok = True
    names = ("total", "ce", "number")
    for k, (lc, ld) in enumerate(zip(cpu["losses"], dev["losses"])):
        errs = {n: abs(d - c) / max(abs(c), 1e-6) for n, c, d in zip(names, lc, ld)}
        s_ok = all(np.isfinite(ld)) and all(e <= args.loss_rtol for e in errs.values())
        ok &= s_ok
        steps.append({"step": k + 1, "cpu": lc, "device": ld, "rel_err": errs, "ok": s_ok})
    ref = cpu["params"]
    keep = {p: ~masks[p] for p in ref}
    floor = 1e-3 * norm(np.concatenate([ref[p][keep[p]] for p in ref]))
    floor_all = 1e-3 * norm(np.concatenate([ref[p].ravel() for p in ref]))
    per = {}
    worst, worst_err = None, -1.0
    for p in ref:
        d = dev["params"][p]
        err = norm(d[keep[p]] - ref[p][keep[p]]) / max(norm(ref[p][keep[p]]), floor, 1e-30) if keep[p].any() else 0.0
        err_unmasked = norm(d - ref[p]) / max(norm(ref[p]), floor_all, 1e-30)
        left_out = int(masks[p].sum())
        per[p] = {"err": err, "err_unmasked": err_unmasked, "left_out": left_out, "size": int(ref[p].size)}
        if left_out:
            per[p]["left_out_max_abs_diff"] = float(np.max(np.abs(d[masks[p]] - ref[p][masks[p]])))
        if err > worst_err:
            worst, worst_err = p, err
    p_ok = worst_err <= args.rtol and all(np.isfinite(dev["params"][p]).all() for p in ref)
    total = norm(np.concatenate([(dev["params"][p] - ref[p])[keep[p]] for p in ref])) / max(floor * 1e3, 1e-30)
    return {"ok": bool(ok and p_ok), "losses_ok": bool(ok), "params_ok": bool(p_ok), "steps": steps,
            "params": per, "worst": worst, "worst_err": worst_err, "all_params_err": total,
            "left_out": sum(v["left_out"] for v in per.values()),
            "elements": sum(v["size"] for v in per.values())}


def check_case(args, ort, model: str, loss: str, tmp: Path, mode: str) -> dict:
    """mode: "cuda" (compare with CUDA), "self-test" (compare with unoptimised CPU), "cpu" (CPU only)."""
    case = f"{model}-{loss}"
    out = tmp / case
    out.mkdir(parents=True, exist_ok=True)
    step = out / f"{model}.step.onnx"
    src = FIXTURES / "models" / f"{model}.onnx"
    result: dict = {"case": case, "ok": False}
    cmd = [args.bin, "step", src, "--tokenizer", TOKENIZER, "--loss", loss, "--weight", WEIGHT,
           *EXTRA.get(loss, []), "--optimizer", "adamw", "--lr", LR, "-o", step, "--json"]
    result["command"] = " ".join(["ntl-patch"] + [c.name if isinstance(c, Path) else str(c) for c in cmd[1:]])
    r = run(cmd)
    if r.returncode != 0:
        result["error"] = f"ntl-patch step failed: {r.stderr.strip()[-1000:]}"
        return result
    summary = json.loads(r.stdout)
    result["step_graph"] = {"parameters": len(summary["parameters"]), "parameter_elements": summary.get("parameter_elements"),
                            "warnings": summary.get("warnings"), "bytes": step.stat().st_size}
    result["inspect"] = inspect_cuda(args.bin, step)

    batches, how = make_batches(model, args.steps)
    result["batches"] = how
    t0 = time.perf_counter()
    cpu = train(ort, step, ["CPUExecutionProvider"], batches)
    result["cpu"] = {k: v for k, v in cpu.items() if k != "params"}
    result["cpu_seconds"] = round(time.perf_counter() - t0, 2)
    finite = all(np.isfinite(x).all() for x in cpu["losses"]) and all(np.isfinite(a).all() for a in cpu["params"].values())
    if not finite:
        result["error"] = f"non-finite CPU loss or parameter: losses {cpu['losses']}"
        return result
    result["cpu_loss_first_last"] = [cpu["losses"][0][0], cpu["losses"][-1][0]]
    if mode == "cpu":
        result["ok"] = True
        result["cuda"] = "skipped (no usable CUDA provider)"
        return result

    if mode == "cuda":
        providers = [("CUDAExecutionProvider", {"use_tf32": "0", "device_id": str(args.device_id)}), "CPUExecutionProvider"]
        dev = train(ort, step, providers, batches)
        want_ep = "CUDAExecutionProvider"
    else:  # self-test: CPU with graph optimisations off stands in for the device
        providers = ["CPUExecutionProvider"]
        dev = train(ort, step, providers, batches, optimize=False, jitter=args.self_test_jitter)
        want_ep = "CPUExecutionProvider"
    result["device"] = {k: v for k, v in dev.items() if k != "params"}
    masks, mask_how = zero_masks(model, cpu["params"])
    result["left_out_rule"] = mask_how
    cmp = compare(cpu, dev, masks, args)
    result["comparison"] = cmp

    # placement: the training session, and the unoptimised graph against inspect's prediction
    used = dev["providers"][0] == want_ep
    asg = dev["assignment"]
    if asg is not None:
        used &= asg["nodes"].get(want_ep, 0) > 0
    pl = placement(ort, step, providers, out / "placement.log")
    if asg is None:
        used &= pl["nodes"].get(want_ep, 0) > 0
    predicted = set(n for f in result["inspect"].get("fallbacks", []) for n in f["nodes"])
    predicted |= set(result["inspect"].get("cpu_preferred", []))
    ort_cpu = set(pl.pop("cpu_nodes"))
    pl["cpu_nodes_count"] = len(ort_cpu)
    if mode == "cuda":
        pl["predicted_only"] = sorted(predicted - ort_cpu)
        pl["ort_only"] = sorted(ort_cpu - predicted)
    result["placement"] = pl
    result["device_used"] = bool(used)
    placement_ok = not (args.strict_placement and mode == "cuda" and pl["ort_only"])
    result["ok"] = bool(cmp["ok"] and used and placement_ok)
    return result


def line(r: dict) -> str:
    if "error" in r and "comparison" not in r:
        return f"FAIL {r['case']}: {r['error']}"
    insp = r.get("inspect", {})
    fb = ", ".join(f"{f['op']} v{f['version']} ({len(f['nodes'])})" for f in insp.get("fallbacks", [])) or "none"
    pred = f"inspect --target cuda: fallbacks {fb}, cpu_preferred {len(insp.get('cpu_preferred', []))}"
    lf = r["cpu_loss_first_last"]
    if "comparison" not in r:
        return f"ok   {r['case']}: cpu only: loss {lf[0]:.5f} -> {lf[1]:.5f} ({r['cpu']['step_seconds']}s); {pred}"
    c = r["comparison"]
    worst_loss = max(max(s["rel_err"].values()) for s in c["steps"])
    pl = r["placement"]
    asg = r["device"].get("assignment") or pl
    place = f"nodes {asg['nodes']}"
    if "ort_only" in pl:
        place += f"; ORT CPU nodes (unoptimised) {pl['cpu_nodes_count']}: not predicted {len(pl['ort_only'])}, predicted but on GPU {len(pl['predicted_only'])}"
    return (f"{'ok  ' if r['ok'] else 'FAIL'} {r['case']}: params worst {c['worst']} {c['worst_err']:.1e} "
            f"(all {c['all_params_err']:.1e}, {c['left_out']}/{c['elements']} left out), losses max rel {worst_loss:.1e}; "
            f"loss {lf[0]:.4f} -> {lf[1]:.4f}; {'device used' if r['device_used'] else 'DEVICE NOT USED'} ({place}); "
            f"dev {r['device']['step_seconds']}s cpu {r['cpu']['step_seconds']}s; {pred}"
            + (f"; {r['error']}" if "error" in r else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.environ.get("NTL_PATCH_BIN", str(REPO / "target/release/ntl-patch")))
    ap.add_argument("--out", default=os.environ.get("OUT", str(REPO / "target" / "gpu-check")))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--losses", default=",".join(LOSSES))
    ap.add_argument("--steps", type=int, default=10, help="training steps on each device")
    ap.add_argument("--rtol", type=float, default=1e-4, help="final-parameter tolerance (norm-relative, per parameter)")
    ap.add_argument("--loss-rtol", type=float, default=1e-4, help="per-step loss tolerance (relative)")
    ap.add_argument("--device-id", type=int, default=0)
    ap.add_argument("--require-gpu", action="store_true", help="exit 2 when no CUDA provider starts")
    ap.add_argument("--strict-placement", action="store_true",
                    help="fail a case when ORT puts nodes on CPU that `inspect --target cuda` did not predict")
    ap.add_argument("--self-test", action="store_true",
                    help="no GPU needed: compare CPU with CPU without graph optimisations (tests this script)")
    ap.add_argument("--self-test-jitter", type=float, default=1e-7,
                    help="--self-test: relative random change of the device run's initial parameters")
    ap.add_argument("--no-deterministic", action="store_true",
                    help="leave SessionOptions.use_deterministic_compute off (default: on for both runs)")
    ap.add_argument("--keep", action="store_true", help="keep the step graphs and ORT logs under OUT/step/")
    args = ap.parse_args()
    global DETERMINISTIC
    DETERMINISTIC = not args.no_deterministic
    if not Path(args.bin).is_file():
        log(f"gpu-check-step: ntl-patch binary not found at {args.bin}; build it or set NTL_PATCH_BIN")
        return 2

    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    if hasattr(ort, "preload_dlls") and build_cuda_version(ort):
        with contextlib.redirect_stdout(sys.stderr):  # it prints what it cannot load
            ort.preload_dlls()
    smi = nvidia_smi()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keep_dir = out / "step"
    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = keep_dir if args.keep else Path(tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        if args.self_test:
            cuda, why, mode = False, f"self-test: the device run is the CPU provider without graph optimisations, initial parameters x (1 + {args.self_test_jitter:g} N(0,1))", "self-test"
        else:
            probe = tmp / "probe.step.onnx"
            r = run([args.bin, "step", FIXTURES / "models" / "lm_flat.onnx", "--tokenizer", TOKENIZER, "-o", probe])
            if r.returncode != 0:
                log(f"gpu-check-step: ntl-patch step failed on lm_flat: {r.stderr.strip()}")
                return 1
            cuda, why = cuda_status(ort, probe, smi)
            mode = "cuda" if cuda else "cpu"
        gpus = "; ".join(smi.get("gpus", [])) or ("nvidia-smi failed" if smi.get("present") else "no nvidia-smi")
        log(f"gpu-check-step: onnxruntime {ort.__version__} (CUDA build {build_cuda_version(ort) or 'none'}), "
            f"{gpus}, driver CUDA {smi.get('driver_cuda') or '-'}; {why}")
        if mode == "cpu":
            log("gpu-check-step: NO GPU CHECK: no usable CUDA provider, running the CPU side only "
                "(step graph, inspect, CPU training)")
            if args.require_gpu:
                return 2
        for model in args.models.split(","):
            for loss in args.losses.split(","):
                try:
                    r = check_case(args, ort, model, loss, tmp, mode)
                except Exception as e:  # noqa: BLE001 - one case failing must not hide the others
                    r = {"case": f"{model}-{loss}", "ok": False, "error": f"{type(e).__name__}: {e}"}
                results.append(r)
                log(line(r))
    report = {"onnxruntime": ort.__version__, "onnxruntime_cuda_build": build_cuda_version(ort),
              "mode": mode, "cuda": cuda, "cuda_status": why, "nvidia_smi": smi, "steps": args.steps,
              "lr": LR, "weight": WEIGHT, "rtol": args.rtol, "loss_rtol": args.loss_rtol,
              "left_out_threshold": ZERO_REL, "deterministic_compute": DETERMINISTIC, "strict_placement": args.strict_placement, "results": results}
    path = out / "gpu-check-step.json"
    path.write_text(json.dumps(report, indent=1, default=float))
    failed = [r["case"] for r in results if not r["ok"]]
    what = {"cuda": "CUDA vs CPU", "self-test": "self-test, CPU vs unoptimised CPU",
            "cpu": "CPU only: NO CUDA comparison was made"}[mode]
    log(f"gpu-check-step: {len(results) - len(failed)} passed, {len(failed)} failed ({what})"
        + (f": {', '.join(failed)}" if failed else "") + f"; report: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""GPU check of graphs patched by ntl-patch: train them with ONNX Runtime Training on the CUDA
execution provider and on the CPU, and compare.

Run through scripts/gpu/gpu-check.sh, which makes the environment (onnxruntime-training 1.19.2, the
CUDA 11.8 build, and the CUDA 11 / cuDNN 8 libraries it loads). For each fixture x loss:

  1. patch the fixture with the ntl-patch binary (NTIL with --gumbel-noise 0: the Gumbel noise is
     drawn in the graph, and the CPU and CUDA random generators differ);
  2. `ntl-patch inspect --target cuda-1.19 --json` on the patched model and on its training graph:
     the ops the kernel tables say fall back to CPU;
  3. training artifacts (AdamW, every fixture parameter trainable), as tests/python does;
  4. the same batch, STEPS AdamW steps, on CUDAExecutionProvider and on CPUExecutionProvider:
     the step-1 parameter gradients must agree within --rtol (norm-relative, as
     tests/python/test_ort_training.py measures), and every later step within --rtol-steps
     (the two runs drift apart by float round-off once the optimizer has moved the weights);
     the losses likewise;
  5. ORT's own account of placement: the CUDA session is created with INFO logging, and the
     nodes it reports "CUDA kernel not found in registries" for are compared with step 2;
  6. with --ort-dylib (the onnxruntime-gpu wheel's libonnxruntime.so): `ntl-patch validate
     --runtime ort` on the patched model. validate has no way to choose an execution provider: it
     runs that library on its CPU provider, so it checks the library loads and the patched graph
     validates, not CUDA; CUDA is checked through the Python API (steps 4-5).

Without a usable CUDA provider (no GPU, no driver, a CPU-only onnxruntime) it says so and runs
the CPU side only (exit 0), unless --require-gpu (exit 2). A report is written to
OUT/gpu-check.json. Exit 1 when a comparison fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures"
TOKENIZER = FIXTURES / "tokenizer.json"
MODELS = ["lm_flat", "lm_bvt", "lm_nll"]
LOSSES = ["wasserstein", "mse", "l1", "huber", "ntil", "emd", "number-level"]
EXTRA = {"ntil": ["--gumbel-noise", "0"]}
WEIGHT = 0.3
LR = 1e-2


def log(msg: str) -> None:
    print(msg, flush=True)


def read_pb(path: Path) -> np.ndarray:
    import onnx
    import onnx.numpy_helper as nph

    t = onnx.TensorProto()
    t.ParseFromString(path.read_bytes())
    return nph.to_array(t)


def batch() -> tuple[np.ndarray, np.ndarray]:
    """The reference batch the Python harness uses (B=2, T=7; digits, words and -100)."""
    ref = FIXTURES / "reference" / "lm_flat_wasserstein"
    return read_pb(ref / "input_0.pb").astype(np.int64), read_pb(ref / "input_1.pb").astype(np.int64)


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


PROBE = """
import sys
import onnxruntime as ort
from onnx import TensorProto, helper
g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
so = ort.SessionOptions()
so.log_severity_level = 3
s = ort.InferenceSession(m.SerializeToString(), so, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
print(s.get_providers()[0])
"""


def cuda_status(ort) -> tuple[bool, str]:
    """Whether a CUDA session really starts. Probed in a child process: without a GPU, ORT 1.19's
    CUDA provider can abort the process, and when it cannot load it falls back to CPU silently."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False, (f"this onnxruntime ({ort.__version__}, providers {ort.get_available_providers()}) has no "
                       "CUDAExecutionProvider; install onnxruntime-training==1.19.2 (the CUDA build)")
    try:
        r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return False, "the CUDA provider probe timed out"
    if r.returncode == 0 and r.stdout.strip().endswith("CUDAExecutionProvider"):
        return True, "CUDAExecutionProvider starts"
    tail = " | ".join(r.stderr.strip().splitlines()[-3:])
    how = f"exit {r.returncode}" if r.returncode else "ORT fell back to CPU"
    return False, ("the CUDA provider does not start (no GPU or driver, or missing CUDA 11 / cuDNN 8 libraries; "
                   f"{how}): {tail}")


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=REPO, **kw)


def inspect_cuda(bin_path: str, model: Path) -> dict:
    r = run([bin_path, "inspect", model, "--target", "cuda-1.19", "--json"])
    if r.returncode != 0:
        return {"error": r.stderr.strip()}
    g = json.loads(r.stdout)["gpu"][0]
    return {
        "summary": g["summary"],
        "fallbacks": [{"op": f["op"], "domain": f["domain"], "version": f["version"], "types": f["types"],
                       "reason": f["reason"], "nodes": f["nodes"]} for f in g["fallbacks"]],
        "cpu_preferred": g["cpu_preferred"],
    }


def norm_rel(got: np.ndarray, want: np.ndarray, floor: float) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), floor, 1e-30))


def grad_errors(got: dict, want: dict) -> tuple[float, str, float]:
    """(all-parameter error, worst parameter, its error), tests/python's measure."""
    params = sorted(want)
    all_want = np.concatenate([want[p].ravel() for p in params])
    all_got = np.concatenate([got[p].ravel() for p in params])
    floor = 1e-3 * float(np.linalg.norm(all_want))
    errs = {p: norm_rel(got[p], want[p], floor) for p in params}
    worst = max(errs, key=errs.get)
    return norm_rel(all_got, all_want, 0.0), worst, errs[worst]


def train(art: Path, device: str, params: list[str], steps: int, log_file: Path | None = None):
    """STEPS AdamW steps on the reference batch; per step (loss, ce, number, grads)."""
    import onnxruntime as ort
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    input_ids, labels = batch()
    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    so = ort.SessionOptions()
    so.log_severity_level = 1 if log_file else 3
    ctx = captured_stderr(log_file) if log_file else contextlib.nullcontext()
    history = []
    with ctx:  # the session logs at INFO level while it runs, too
        module = Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"),
                        device=device, session_options=so)
        opt = Optimizer(str(art / "optimizer_model.onnx"), module)
        opt.set_learning_rate(LR)
        module.train()
        for _ in range(steps):
            outs = module(input_ids, labels)
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            grads = {}
            for p in params:
                g = state.parameters[p].grad
                if g is None:
                    raise RuntimeError(f"no gradient for {p} on {device}")
                grads[p] = np.asarray(g, dtype=np.float64)
            history.append({"loss": float(outs[0]), "ce": float(outs[-2]), "number": float(outs[-1]),
                            "grads": grads})
            opt.step()
            module.lazy_reset_grad()
    return history


CUDA_MISSING = re.compile(r"CUDA kernel not found in registries for Op type: (\S+) node name: (.*)$")


def ort_cuda_fallbacks(log_text: str) -> list[dict]:
    seen = []
    for line in log_text.splitlines():
        m = CUDA_MISSING.search(line)
        if m:
            seen.append({"op": m.group(1), "node": m.group(2).strip()})
    return seen


def check_case(args, model: str, loss: str, tmp: Path, cuda: bool) -> dict:
    import onnx
    from onnxruntime.training import artifacts

    case = f"{model}-{loss}"
    out = tmp / case
    out.mkdir(parents=True, exist_ok=True)
    patched = out / f"{model}.ntl.onnx"
    src = FIXTURES / "models" / f"{model}.onnx"
    r = run([args.bin, src, "--loss", loss, "--tokenizer", TOKENIZER, "--weight", WEIGHT, *EXTRA.get(loss, []),
             "-o", patched])
    result: dict = {"case": case, "ok": False}
    if r.returncode != 0:
        result["error"] = f"ntl-patch failed: {r.stderr.strip()}"
        return result
    result["inspect"] = inspect_cuda(args.bin, patched)

    params = sorted(i.name for i in onnx.load(str(src)).graph.initializer if i.data_type == onnx.TensorProto.FLOAT)
    art = out / "artifacts"
    art.mkdir(exist_ok=True)
    with captured_stderr(out / "artifacts.log"):
        artifacts.generate_artifacts(onnx.load(str(patched)), requires_grad=params, frozen_params=[], loss=None,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=str(art))
    result["inspect_training_graph"] = inspect_cuda(args.bin, art / "training_model.onnx")

    t0 = time.perf_counter()
    cpu = train(art, "cpu", params, args.steps)
    result["cpu_losses"] = [h["loss"] for h in cpu]
    result["cpu_seconds"] = round(time.perf_counter() - t0, 2)
    if not all(np.isfinite(result["cpu_losses"])):
        result["error"] = f"non-finite CPU loss {result['cpu_losses']}"
        return result
    if args.ort_dylib:
        v = run([args.bin, "validate", patched, "--runtime", "ort", "--tokenizer", TOKENIZER],
                env=dict(os.environ, ORT_DYLIB_PATH=args.ort_dylib))
        result["validate_ort"] = {"exit": v.returncode, "report": (v.stdout.strip().splitlines() or [""])[-1],
                                  "stderr": v.stderr.strip()[-500:]}
        # validate has an independent reference for some losses only: that is not a failure here
        result["validate_ort"]["skipped"] = not v.stdout.strip() and "no independent reference" in v.stderr
    validate_ok = "validate_ort" not in result or result["validate_ort"]["exit"] == 0 or result["validate_ort"]["skipped"]
    if not cuda:
        result["ok"] = validate_ok
        result["cuda"] = "skipped (no usable CUDA provider)"
        return result

    t0 = time.perf_counter()
    gpu_log = out / "cuda-session.log"
    gpu = train(art, args.device, params, args.steps, log_file=gpu_log)
    result["cuda_seconds"] = round(time.perf_counter() - t0, 2)
    result["cuda_losses"] = [h["loss"] for h in gpu]
    result["ort_cuda_fallbacks"] = ort_cuda_fallbacks(gpu_log.read_text(errors="replace"))
    steps = []
    ok = True
    for k, (g, c) in enumerate(zip(gpu, cpu)):
        tol = args.rtol if k == 0 else args.rtol_steps
        total, worst, worst_err = grad_errors(g["grads"], c["grads"])
        loss_err = abs(g["loss"] - c["loss"]) / max(abs(c["loss"]), 1e-12)
        step_ok = total <= tol and worst_err <= tol and loss_err <= tol
        ok &= step_ok
        steps.append({"step": k + 1, "grad_err": total, "worst": worst, "worst_err": worst_err,
                      "loss_err": loss_err, "tol": tol, "ok": step_ok})
    result["steps"] = steps
    # what ORT reports missing vs what the kernel tables predict, by op type
    predicted = {f["op"] for f in result["inspect_training_graph"].get("fallbacks", [])}
    reported = {f["op"] for f in result["ort_cuda_fallbacks"]}
    result["placement_agrees"] = {"predicted_only": sorted(predicted - reported),
                                  "ort_only": sorted(reported - predicted)}
    ok &= validate_ok
    result["ok"] = ok
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.environ.get("NTL_PATCH_BIN", str(REPO / "target/release/ntl-patch")))
    ap.add_argument("--out", default=os.environ.get("OUT", str(REPO / "target" / "gpu-check")))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--losses", default=",".join(LOSSES))
    ap.add_argument("--steps", type=int, default=5, help="AdamW steps on each device (the first is compared strictly)")
    ap.add_argument("--rtol", type=float, default=1e-4, help="step-1 gradient and loss tolerance")
    ap.add_argument("--rtol-steps", type=float, default=1e-3, help="tolerance for steps 2..STEPS")
    ap.add_argument("--ort-dylib", default=os.environ.get("ORT_DYLIB_PATH", ""),
                    help="libonnxruntime.so for `ntl-patch validate --runtime ort` (the onnxruntime-gpu wheel's)")
    ap.add_argument("--require-gpu", action="store_true", help="exit 2 when no CUDA provider starts")
    ap.add_argument("--device", default="cuda",
                    help="the device compared with the CPU (`cpu` runs the comparison code without a GPU: a self-test)")
    args = ap.parse_args()
    if not Path(args.bin).is_file():
        log(f"gpu-check: ntl-patch binary not found at {args.bin}; build it (cargo build --release) or set NTL_PATCH_BIN")
        return 2

    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    cuda, why = cuda_status(ort) if args.device == "cuda" else (True, f"self-test: comparing device {args.device!r} with cpu")
    log(f"gpu-check: onnxruntime {ort.__version__}; {why}")
    if not cuda:
        log("gpu-check: NO GPU CHECK: running the CPU side only (patch, inspect, artifacts, CPU training"
            + (", validate" if args.ort_dylib else "") + ")")
        if args.require_gpu:
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for loss in args.losses.split(","):
                try:
                    r = check_case(args, model, loss, Path(tmp), cuda)
                except Exception as e:  # noqa: BLE001 - one case failing must not hide the others
                    r = {"case": f"{model}-{loss}", "ok": False, "error": f"{type(e).__name__}: {e}"}
                results.append(r)
                if "steps" in r:
                    s1 = r["steps"][0]
                    last = r["steps"][-1]
                    detail = (f"step-1 grad err {s1['grad_err']:.2e} (worst {s1['worst']} {s1['worst_err']:.2e}), "
                              f"step-{last['step']} {last['grad_err']:.2e}; loss {r['cuda_losses'][0]:.5f} -> "
                              f"{r['cuda_losses'][-1]:.5f}; cuda {r['cuda_seconds']}s, cpu {r['cpu_seconds']}s")
                elif "error" in r:
                    detail = r["error"]
                else:
                    detail = f"cpu only: loss {r['cpu_losses'][0]:.5f} -> {r['cpu_losses'][-1]:.5f}"
                fb = r.get("inspect", {}).get("fallbacks", [])
                fb_text = ", ".join(f"{f['op']} v{f['version']}" for f in fb) or "none"
                if "validate_ort" in r:
                    v = r["validate_ort"]
                    detail += "; validate --runtime ort: " + (
                        "no reference for this loss" if v["skipped"] else v["report"] or f"exit {v['exit']}")
                log(f"{'ok  ' if r['ok'] else 'FAIL'} {r['case']}: {detail}; inspect cuda fallbacks: {fb_text}")
                if r.get("placement_agrees") and any(r["placement_agrees"].values()):
                    log(f"     placement: inspect vs ORT's log differ: {r['placement_agrees']}")
    report = {"onnxruntime": ort.__version__, "cuda": cuda, "cuda_status": why, "steps": args.steps,
              "rtol": args.rtol, "rtol_steps": args.rtol_steps, "results": results}
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2, default=float))
    failed = [r["case"] for r in results if not r["ok"]]
    log(f"gpu-check: {len(results) - len(failed)} passed, {len(failed)} failed"
        + ("" if cuda else " (CPU only: no CUDA comparison was made)") + f"; report: {out / 'gpu-check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

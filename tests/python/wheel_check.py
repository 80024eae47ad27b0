"""Runs inside the fresh virtual environment of tests/python/test_wheel.py, where only the built
wheel, onnxruntime and numpy are installed (no torch, no onnx, no repository on sys.path).

    VENV/bin/python -I wheel_check.py CONFIG.json      # prints one JSON object

CONFIG: {"work": folder to write in, "model": lm_flat.onnx, "tokenizer": ..., "artifacts": an
ORT artifacts folder, "rust_step": a step graph from the Rust-built binary, "batches": npz}.
Every check records what happened (values, or an exception's type and message); test_wheel.py
judges them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import traceback


def caught(fn):
    """(type name, message, innermost traceback file) of what fn raises, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        tb = traceback.extract_tb(e.__traceback__)
        return {"type": type(e).__name__, "message": getattr(e, "message", str(e)), "str": str(e),
                "exit_code": getattr(e, "exit_code", None), "frame": tb[-1].filename if tb else None,
                "result_passed": (getattr(e, "result", None) or {}).get("passed")}
    return None


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    work, model, tok = cfg["work"], cfg["model"], cfg["tokenizer"]
    out: dict = {"env": {"NTL_PATCH_BIN": os.environ.get("NTL_PATCH_BIN")}}

    exe = shutil.which("ntl-patch")
    v = subprocess.run(["ntl-patch", "--version"], capture_output=True, text=True)
    out["cli"] = {"which": exe, "version": v.stdout.strip(), "rc": v.returncode}

    import numpy as np

    import ntl_patch

    out["module"] = {
        "file": ntl_patch.__file__, "version": ntl_patch.version(),
        "dist_version": importlib.metadata.version("ntl-patch"),
        "requires": importlib.metadata.requires("ntl-patch"),
        "torch_imported": "torch" in sys.modules,
        "torch_or_onnx_installed": [m for m in ("torch", "onnx") if importlib.util.find_spec(m)],
        "all": sorted(ntl_patch.__all__),
        "installed": sorted(d.metadata["Name"].lower() for d in importlib.metadata.distributions()),
    }

    w = lambda *p: os.path.join(work, *p)  # noqa: E731
    out["patch"] = ntl_patch.patch(model, out=w("p.onnx"), tokenizer=tok)
    out["step"] = ntl_patch.step(model, out=w("m.step.onnx"), tokenizer=tok, lr=1e-3)
    out["split"] = ntl_patch.step(model, w("m.grad.onnx"), "mse", tokenizer=tok, split=True,
                                  freeze=["q.", "k."], max_grad_norm=1.0, optimizer="sgd",
                                  momentum=0.9, copy_external_data=False)
    out["validate"] = ntl_patch.validate(w("p.onnx"), tokenizer=tok, runtime="tract", seed=3)
    out["inspect"] = ntl_patch.inspect(w("p.onnx"), target=["cuda", "rocm"])
    out["artifacts"] = ntl_patch.artifacts(cfg["artifacts"], out=w("art-ntl"), tokenizer=tok,
                                           loss="ntil", gumbel_noise=0)

    out["errors"] = {
        "missing_model": caught(lambda: ntl_patch.patch(w("absent.onnx"), tokenizer=tok)),
        "bad_choice": caught(lambda: ntl_patch.step(model, optimizer="adam", tokenizer=tok)),
        "refused_value": caught(lambda: ntl_patch.step(model, lr=-1.0, tokenizer=tok)),
        "validate_fails": caught(lambda: ntl_patch.validate(w("p.onnx"), tokenizer=tok, rtol=0, atol=0)),
    }
    out["bad_input"] = {
        "unknown_option": caught(lambda: ntl_patch.patch(model, learning_rate=1e-3)),
        "near_miss": caught(lambda: ntl_patch.step(model, max_grad=1.0)),
        "switch_not_bool": caught(lambda: ntl_patch.step(model, split="yes")),
        "value_not_scalar": caught(lambda: ntl_patch.patch(model, weight=[0.1, 0.2])),
        "value_is_bool": caught(lambda: ntl_patch.patch(model, weight=True)),
        "model_not_path": caught(lambda: ntl_patch.inspect(42)),
        "json_option": caught(lambda: ntl_patch.inspect(model, json=True)),
        "missing_file": caught(lambda: ntl_patch.inspect(w("nowhere.onnx"))),
    }
    out["no_torch"] = caught(lambda: ntl_patch.DataParallel(w("m.grad.onnx")))

    z = np.load(cfg["batches"])
    runs = {}
    for name, path in (("wheel", w("m.step.onnx")), ("rust", cfg["rust_step"])):
        runner = ntl_patch.StepRunner(path, providers=["CPUExecutionProvider"])
        runs[name] = [runner.step({"input_ids": z[f"x{k}"], "labels": z[f"y{k}"]})
                      for k in range(int(z["steps"]))]
    out["runner"] = runs
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""The wheel (pyproject.toml, maturin `bindings = "bin"`): built, installed into a fresh virtual
environment that gets only the wheel and its dependencies (onnxruntime + numpy, pinned by
python/requirements.txt as in .venv-rt), and used there by wheel_check.py:
  - `ntl-patch --version` from PATH is the environment's own binary, at Cargo.toml's version;
  - the package metadata: the same version, dependencies onnxruntime and numpy only, no torch;
  - every wrapper (patch, step, step --split, validate, inspect, artifacts) on the lm_flat fixture;
  - errors: NtlPatchError with the binary's one-line message and exit code; bad Python input
    (unknown option, wrong type, not a path) raises TypeError naming the option and the valid
    ones, from the wrapper's entry (no KeyError / JSONDecodeError from inside);
  - 20 StepRunner steps on the step graph the wheel's binary wrote give the same losses as on the
    graph the Rust-built binary (NTL_PATCH_BIN, target/debug) wrote, and the two graphs are
    byte-identical.
The build is `scripts/setup/build-wheel.sh --profile dev --strip`: maturin runs cargo in the same target
folder, so it reuses `cargo build`'s compilation and only relinks the binary without symbols.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from conftest import MODELS, REPO, TOKENIZER, run_patch

STEPS = 20


def _cargo_version() -> str:
    m = re.search(r'^version\s*=\s*"([^"]+)"', (REPO / "Cargo.toml").read_text(), re.M)
    assert m, "no version in Cargo.toml"
    return m.group(1)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheelhouse")
    t0 = time.monotonic()
    r = subprocess.run([str(REPO / "scripts" / "setup" / "build-wheel.sh"), "--profile", "dev", "--strip",
                        "--out", str(out)], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"build-wheel.sh exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    print(f"wheel built in {time.monotonic() - t0:.1f} s: {wheels[0].name} "
          f"({wheels[0].stat().st_size / 1e6:.1f} MB)")
    return wheels[0]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A new environment per run: the wheel and what it depends on, pinned as in .venv-rt."""
    v = tmp_path_factory.mktemp("venv") / "env"
    t0 = time.monotonic()
    subprocess.run([os.environ.get("PYTHON", "python3"), "-m", "venv", str(v)], check=True, timeout=300)
    r = subprocess.run([str(v / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                        "-q", "-c", str(REPO / "python" / "requirements.txt"), str(wheel)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"pip install of the wheel failed\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    print(f"fresh venv with the wheel in {time.monotonic() - t0:.1f} s")
    return v


@pytest.fixture(scope="module")
def check(venv, tmp_path_factory) -> dict:
    from ort_helpers import generate_artifacts

    d = tmp_path_factory.mktemp("wheel_check")
    work = d / "work"
    work.mkdir()
    model = work / "lm_flat.onnx"
    shutil.copyfile(MODELS / "lm_flat.onnx", model)
    art = generate_artifacts(onnx.load(MODELS / "lm_flat.onnx"), d / "artifacts")
    rust_step = d / "rust.step.onnx"
    r = run_patch(["step", model, "--tokenizer", TOKENIZER, "--lr", "1e-3", "-o", rust_step])
    assert r.returncode == 0, r.stderr
    rng = np.random.default_rng(5)
    ids = np.array([18, 29, 25, 36, 35, 7, 27, 21, 10, 38, 4, 5, 6, 8, 9, 11], dtype=np.int64)
    batches = {"steps": np.array(STEPS)}
    for k in range(STEPS):
        b, t = [(2, 7), (3, 5)][k % 2]
        batches[f"x{k}"] = rng.choice(ids, size=(b, t))
        y = rng.choice(ids, size=(b, t))
        y[rng.random((b, t)) < 0.2] = -100
        batches[f"y{k}"] = y
    np.savez(d / "batches.npz", **batches)
    cfg = {"work": str(work), "model": str(model), "tokenizer": str(TOKENIZER), "artifacts": str(art),
           "rust_step": str(rust_step), "batches": str(d / "batches.npz")}
    (d / "cfg.json").write_text(json.dumps(cfg))
    script = d / "wheel_check.py"  # a copy: nothing of the repository next to it on sys.path
    shutil.copyfile(Path(__file__).with_name("wheel_check.py"), script)
    env = {k: v for k, v in os.environ.items()
           if k not in ("NTL_PATCH_BIN", "PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    p = subprocess.run([str(venv / "bin" / "python"), "-I", str(script), str(d / "cfg.json")],
                       capture_output=True, text=True, timeout=900, cwd=d, env=env)
    assert p.returncode == 0, f"wheel_check.py exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["_dirs"] = {"work": work, "rust_step": rust_step, "venv": venv}
    return res


def test_binary_on_path(check):
    venv = check["_dirs"]["venv"]
    assert check["env"]["NTL_PATCH_BIN"] is None
    assert check["cli"]["which"] == str(venv / "bin" / "ntl-patch")
    assert check["cli"]["rc"] == 0 and check["cli"]["version"] == f"ntl-patch {_cargo_version()}"


def test_package_metadata(check):
    m = check["module"]
    venv = check["_dirs"]["venv"]
    assert Path(m["file"]).is_relative_to(venv), m["file"]  # the installed package, not python/
    assert m["version"] == m["dist_version"] == _cargo_version()
    assert sorted(m["requires"]) == ["numpy", "onnxruntime"]
    assert not m["torch_imported"] and m["torch_or_onnx_installed"] == []
    assert check["no_torch"]["type"] == "ImportError" and "DataParallel needs torch" in check["no_torch"]["message"]
    assert {"patch", "step", "artifacts", "validate", "inspect", "StepRunner", "DataParallel",
            "NtlPatchError"} <= set(m["all"])
    assert {"ntl-patch", "onnxruntime", "numpy"} <= set(m["installed"])
    assert not {"torch", "onnx", "onnxruntime-training", "onnxruntime-training-cpu"} & set(m["installed"])


def test_wrappers(check):
    work = check["_dirs"]["work"]
    p = check["patch"]
    assert p["output"] == str(work / "p.onnx") and (work / "p.onnx").is_file()
    assert p["loss"] == "wasserstein" and p["number_tokens"] == 10 and p["logits_width"] == 48
    s = check["step"]
    assert s["outputs"] == [str(work / "m.step.onnx")] and s["optimizer"]["lr"] == 1e-3
    assert len(s["parameters"]) == 15 and s["frozen"] == []
    sp = check["split"]
    assert sp["outputs"] == [str(work / "m.grad.onnx"), str(work / "m.update.onnx")]
    assert all(Path(o).is_file() for o in sp["outputs"])
    assert sp["loss"] == "mse" and sorted(sp["frozen"]) == ["k.bias", "k.weight", "q.bias", "q.weight"]
    assert sp["optimizer"] == {**sp["optimizer"], "name": "sgd", "momentum": 0.9, "max_grad_norm": 1.0}
    v = check["validate"]
    assert v["passed"] is True and v["runtime"] == "tract" and "seed 3" in v["inputs"]
    i = check["inspect"]
    assert [g["target"] for g in i["gpu"]] == ["cuda", "rocm"], [g.get("target") for g in i["gpu"]]
    a = check["artifacts"]
    assert a["output"] == str(work / "art-ntl") and a["loss"] == "ntil"
    assert (work / "art-ntl" / "training_model.onnx").is_file()


def test_errors(check):
    e = check["errors"]
    assert e["missing_model"]["type"] == "NtlPatchError" and e["missing_model"]["exit_code"] == 1
    assert e["missing_model"]["message"].startswith("cannot read '") and "No such file" in e["missing_model"]["message"]
    assert "\n" not in e["missing_model"]["message"]
    assert e["bad_choice"]["type"] == "NtlPatchError" and e["bad_choice"]["exit_code"] == 1
    assert "invalid value 'adam'" in e["bad_choice"]["message"]
    assert e["refused_value"]["exit_code"] == 1 and e["refused_value"]["message"].startswith("--lr must be")
    assert e["validate_fails"]["type"] == "NtlPatchError" and e["validate_fails"]["exit_code"] == 1
    assert e["validate_fails"]["message"].startswith("validation failed: loss")
    assert e["validate_fails"]["result_passed"] is False


def test_bad_python_input(check):
    b = check["bad_input"]
    for case in b.values():
        assert case is not None and case["type"] in ("TypeError", "ValueError", "NtlPatchError"), case
        assert Path(case["frame"]).name == "cli.py", case  # raised by the wrapper's own checks
    assert b["unknown_option"]["type"] == "TypeError"
    assert "unknown option 'learning_rate'" in b["unknown_option"]["message"]
    assert "valid options: " in b["unknown_option"]["message"] and "tokenizer" in b["unknown_option"]["message"]
    assert "did you mean 'max_grad_norm'?" in b["near_miss"]["message"]
    assert "'split' is a switch" in b["switch_not_bool"]["message"]
    assert "'weight' takes one value, not a list" in b["value_not_scalar"]["message"]
    assert "'weight' takes a value, not True" in b["value_is_bool"]["message"]
    assert "model must be a path" in b["model_not_path"]["message"]
    assert "always pass --json" in b["json_option"]["message"]
    assert b["missing_file"]["type"] == "NtlPatchError" and b["missing_file"]["exit_code"] == 1
    assert "nowhere.onnx" in b["missing_file"]["message"]


def test_runner_matches_rust_built_graph(check):
    work, rust = check["_dirs"]["work"], check["_dirs"]["rust_step"]
    assert (work / "m.step.onnx").read_bytes() == rust.read_bytes(), "the two binaries wrote different graphs"
    got, want = np.array(check["runner"]["wheel"]), np.array(check["runner"]["rust"])
    assert got.shape == (STEPS, 3) and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    assert got[-1, 0] < got[0, 0]


_RUNNER_SCRIPT = """
import json, sys
import numpy as np
import onnxruntime
from ntl_patch import StepRunner
graph, batches, steps = sys.argv[1], np.load(sys.argv[2]), int(sys.argv[3])
r = StepRunner(graph, providers=["CPUExecutionProvider"])
losses = [list(map(float, r.step({"input_ids": batches[f"x{k}"], "labels": batches[f"y{k}"]})))
          for k in range(steps)]
print(json.dumps({"onnxruntime": onnxruntime.__version__, "losses": losses}))
"""


def _find_python(version: str) -> str | None:
    """An interpreter of `version` that runs: on PATH, else in pyenv's versions folder."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = [shutil.which(f"python{version}")]
    candidates += sorted(str(p) for p in root.glob(f"versions/{version}.*/bin/python{version}"))
    for c in filter(None, candidates):
        if subprocess.run([c, "--version"], capture_output=True).returncode == 0:
            return c
    return None


# the other supported Pythons this machine has (docs/PYTHON.md says which were tested); found once,
# at collection, so a missing interpreter adds no test rather than a skipped one
OTHER_PYTHONS = {v: p for v in ("3.10", "3.12", "3.13", "3.14") if (p := _find_python(v))}


@pytest.mark.parametrize("version", sorted(OTHER_PYTHONS))
def test_wheel_on_other_pythons(version, wheel, check, tmp_path):
    """The same wheel on another supported Python: installs with whatever onnxruntime/numpy pip
    picks for that Python, the binary runs, and three StepRunner steps give the losses of the
    3.11 run (1e-5: onnxruntime may differ)."""
    python = OTHER_PYTHONS[version]
    v = tmp_path / "env"
    subprocess.run([python, "-m", "venv", str(v)], check=True, timeout=300)
    r = subprocess.run([str(v / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                        "-q", str(wheel)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"pip install on {version} failed\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    out = subprocess.run([str(v / "bin" / "ntl-patch"), "--version"], capture_output=True, text=True)
    assert out.stdout.strip() == f"ntl-patch {_cargo_version()}"
    steps = 3
    batches = Path(check["_dirs"]["rust_step"]).parent / "batches.npz"
    p = subprocess.run([str(v / "bin" / "python"), "-I", "-c", _RUNNER_SCRIPT,
                        str(check["_dirs"]["rust_step"]), str(batches), str(steps)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"python {version}: onnxruntime {res['onnxruntime']}")
    np.testing.assert_allclose(np.array(res["losses"]), np.array(check["runner"]["rust"])[:steps],
                               rtol=1e-5, atol=0)

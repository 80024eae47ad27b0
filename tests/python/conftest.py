"""Shared helpers for the Python harness (ONNX Runtime Training end-to-end checks of ntl-patch)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.dont_write_bytecode = True

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures"
MODELS = FIXTURES / "models"
TOKENIZER = FIXTURES / "tokenizer.json"
sys.path.insert(0, str(FIXTURES))


def patch_command() -> list[str]:
    """The ntl-patch command: $NTL_PATCH_BIN (a path, or a command line), else
    target/debug/ntl-patch under the repository root. A missing binary FAILS the tests (never
    skips them): build it first with `cargo build`."""
    raw = os.environ.get("NTL_PATCH_BIN")
    cmd = shlex.split(raw) if raw else [str(REPO / "target" / "debug" / "ntl-patch")]
    exe = cmd[0]
    if not Path(exe).is_absolute() and "/" in exe:
        exe = str(REPO / exe)
        cmd[0] = exe
    if not (Path(exe).is_file() or shutil.which(exe)):
        pytest.fail(f"ntl-patch binary not found: {exe!r} (run `cargo build`, or set NTL_PATCH_BIN)",
                    pytrace=False)
    return cmd


def run_patch(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(patch_command() + [str(a) for a in args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.fixture(scope="session")
def weights():
    import ntl_torch

    return ntl_torch.load_weights()

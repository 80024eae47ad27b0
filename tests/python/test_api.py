"""python/ntl_patch/cli.py in-process: the option table equals the binary's --help, options map
one to one onto flags, the binary is found where the wheel puts it, and failures are
NtlPatchError. (test_wheel.py runs the wrappers from an installed wheel.)"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MODELS, REPO, TOKENIZER, patch_command

sys.path.insert(0, str(REPO / "python"))
import ntl_patch  # noqa: E402
from ntl_patch import _binary, cli  # noqa: E402
from ntl_patch._options import FLAG, MULTI, OPTIONS, VALUE, flag  # noqa: E402

# flags every command has that the wrappers manage themselves
MANAGED = {"--help", "--version", "--json"}


def _help_flags(command: str) -> dict[str, str]:
    """--flag -> kind, from `ntl-patch [command] --help`."""
    args = [] if command == "patch" else [command]
    r = subprocess.run(patch_command() + args + ["--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    text = r.stdout.split("Options:", 1)[1]
    found: dict[str, str] = {}
    blocks = re.split(r"\n(?=\s{2,6}(?:-\w, )?--[a-z])", text)
    for block in blocks:
        m = re.match(r"\s*(?:-\w, )?(--[a-z0-9-]+)( <[^>]+>)?", block)
        if not m:
            continue
        kind = FLAG if m.group(2) is None else (MULTI if "(repeatable)" in block else VALUE)
        found[m.group(1)] = kind
    return found


@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_option_table_equals_help(command):
    want = {f: k for f, k in _help_flags(command).items() if f not in MANAGED}
    have = {flag(name): kind for name, kind in OPTIONS[command].items()}
    assert have == want


def test_arguments_mapping():
    args = cli.arguments("step", {"max_grad_norm": 1.0, "split": True, "reweigh": False, "squash": None,
                                  "freeze": ["emb.", "q."], "vocab_size": 48, "out": Path("/x/m.grad.onnx"),
                                  "weight": -1e-07, "lr": 3})
    assert args == ["--max-grad-norm=1.0", "--split", "--freeze=emb.", "--freeze=q.", "--vocab-size=48",
                    "--output=/x/m.grad.onnx", "--weight=-1e-07", "--lr=3"]
    assert cli.arguments("inspect", {"target": "cuda"}) == ["--target=cuda"]
    assert cli.arguments("inspect", {"target": ("cuda", "rocm")}) == ["--target=cuda", "--target=rocm"]
    import numpy as np

    assert cli.arguments("patch", {"weight": np.float32(0.5), "vocab_size": np.int64(7)}) == \
        ["--weight=0.5", "--vocab-size=7"]


@pytest.mark.parametrize("options,match", [
    ({"bogus": 1}, r"unknown option 'bogus'; valid options: abs_alpha, add_loss"),
    ({"max_grad": 1}, r"did you mean 'max_grad_norm'\?"),
    ({"output": "x"}, r"did you mean 'out'\?"),
    ({"split": 1}, r"'split' is a switch: pass True or False, not 1"),
    ({"lr": True}, r"'lr' takes a value, not True"),
    ({"lr": [1, 2]}, r"'lr' takes one value, not a list"),
    ({"freeze": {"a"}}, r"'freeze' takes one value or a list of values, not a set"),
    ({"tokenizer": object()}, r"'tokenizer' must be a str, number or path, not object"),
    ({"json": True}, r"always pass --json"),
])
def test_bad_options_raise_type_error(options, match):
    with pytest.raises(TypeError, match=match) as e:
        ntl_patch.step(MODELS / "lm_flat.onnx", **options)
    assert str(e.value).startswith("ntl_patch.step(): ")


def test_nul_in_path():
    with pytest.raises(ValueError, match="contains a NUL character"):
        ntl_patch.inspect("a\0b.onnx")


def test_binary_lookup(tmp_path, monkeypatch):
    monkeypatch.setenv("NTL_PATCH_BIN", str(tmp_path / "absent"))
    with pytest.raises(ntl_patch.NtlPatchError, match="NTL_PATCH_BIN=.* is not an executable file") as e:
        ntl_patch.inspect(MODELS / "lm_flat.onnx")
    assert e.value.exit_code is None
    # without the override: the environment's scripts folder first, then PATH
    monkeypatch.delenv("NTL_PATCH_BIN")
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    fake = scripts / "ntl-patch"
    fake.write_text("#!/bin/sh\necho 'ntl-patch 9.9.9'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(_binary, "candidates", lambda: [scripts / "ntl-patch"])
    assert _binary.find() == str(fake)
    assert ntl_patch.version() == "9.9.9"
    monkeypatch.setattr(_binary, "candidates", lambda: [tmp_path / "none" / "ntl-patch"])
    monkeypatch.setenv("PATH", str(scripts))
    assert _binary.find() == str(fake)
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    with pytest.raises(ntl_patch.NtlPatchError, match=r"not found \(looked in .* and on PATH\): install"):
        ntl_patch.version()


def test_real_scripts_folder_is_a_candidate():
    import sysconfig

    assert Path(sysconfig.get_path("scripts")) / "ntl-patch" in _binary.candidates()
    assert Path(sys.executable).parent / "ntl-patch" in _binary.candidates()


def test_failures_and_summaries(tmp_path, monkeypatch):
    monkeypatch.setenv("NTL_PATCH_BIN", patch_command()[0])
    with pytest.raises(ntl_patch.NtlPatchError) as e:
        ntl_patch.patch(MODELS / "lm_no_ce.onnx", out=tmp_path / "o.onnx", tokenizer=TOKENIZER, add_loss=False)
    assert e.value.exit_code == 1 and "\n" not in e.value.message and e.value.message
    assert str(e.value) == f"{e.value.message} (exit code 1)"
    assert not (tmp_path / "o.onnx").exists()
    # a model named like a subcommand is still the patch command's MODEL (`--` before it)
    (tmp_path / "step").write_bytes((MODELS / "lm_flat.onnx").read_bytes())
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        s = ntl_patch.patch("step", out="-odd.onnx", tokenizer=TOKENIZER)
    finally:
        os.chdir(cwd)
    assert s["output"] == "-odd.onnx" and (tmp_path / "-odd.onnx").is_file()

"""ntl-patch refuses the error fixtures: exit code 1, a one-line message on stderr, no output file."""

from __future__ import annotations

import pytest

from conftest import MODELS, TOKENIZER, run_patch


@pytest.mark.parametrize("model", ["lm_no_ce", "lm_two_ce"])
def test_error_fixture_is_refused(model, tmp_path):
    out = tmp_path / "out.onnx"
    r = run_patch([MODELS / f"{model}.onnx", "--loss", "wasserstein", "--tokenizer", TOKENIZER,
                   "-o", out])
    assert r.returncode == 1, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected a one-line message on stderr, got:\n{r.stderr}"
    assert not out.exists(), "an output file was written for a refused model"

#!/usr/bin/env bash
# Idempotent runtime-only Python environment for the step-graph runner (python/ntl_patch).
#
#   scripts/setup/setup-runtime.sh          # .venv-rt at the repository root
#
# Creates .venv-rt with `python3 -m venv` when .venv-rt/bin/python is missing, and installs the
# pinned python/requirements.txt (onnxruntime + numpy only) when the venv is new or the file
# changed since the last install (sha256 stamp in .venv-rt/.requirements.sha256). Otherwise does
# nothing. Fails if torch or onnx is importable there: this env proves the runner needs neither.
# Prints one line; pip's output goes to .venv-rt/setup-runtime.log (its tail is shown on failure).
# Env: PYTHON (default python3) picks the interpreter used to create the venv.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$root/scripts/setup/lib/pinned-venv.sh"

# this env proves the runner needs neither torch nor onnx
no_torch_or_onnx() {
  "$root/.venv-rt/bin/python" - <<'PY'
import importlib.util, sys
bad = [m for m in ("torch", "onnx") if importlib.util.find_spec(m) is not None]
sys.exit(f"setup-runtime: .venv-rt must not contain {', '.join(bad)}" if bad else 0)
PY
}
pinned_venv setup-runtime "$root/.venv-rt" "$root/python/requirements.txt" no_torch_or_onnx

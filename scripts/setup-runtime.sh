#!/usr/bin/env bash
# Idempotent runtime-only Python environment for the step-graph runner (python/ntl_patch).
#
#   scripts/setup-runtime.sh          # .venv-rt at the repository root
#
# Creates .venv-rt with `python3 -m venv` when .venv-rt/bin/python is missing, and installs the
# pinned python/requirements.txt (onnxruntime + numpy only) when the venv is new or the file
# changed since the last install (sha256 stamp in .venv-rt/.requirements.sha256). Otherwise does
# nothing. Fails if torch or onnx is importable there: this env proves the runner needs neither.
# Prints one line; pip's output goes to .venv-rt/setup-runtime.log (its tail is shown on failure).
# Env: PYTHON (default python3) picks the interpreter used to create the venv.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-rt"
req="$root/python/requirements.txt"
stamp="$venv/.requirements.sha256"
log="$venv/setup-runtime.log"
python="${PYTHON:-python3}"

want="$(sha256sum "$req" | cut -d' ' -f1)"
have="$(cat "$stamp" 2>/dev/null || true)"

created=""
if [[ ! -x "$venv/bin/python" ]]; then
  "$python" -m venv "$venv"
  created=1
fi

if [[ -z "$created" && "$want" == "$have" ]]; then
  echo "setup-runtime: .venv-rt up to date ($("$venv/bin/python" --version 2>&1), requirements ${want:0:12})"
  exit 0
fi

rm -f "$stamp"
if ! "$venv/bin/python" -m pip install --disable-pip-version-check -r "$req" >"$log" 2>&1; then
  echo "setup-runtime: pip install -r python/requirements.txt failed; last lines of $log:" >&2
  tail -n 20 "$log" >&2
  exit 1
fi
if ! "$venv/bin/python" - >>"$log" 2>&1 <<'PY'
import importlib.util, sys
bad = [m for m in ("torch", "onnx") if importlib.util.find_spec(m) is not None]
sys.exit(f"setup-runtime: .venv-rt must not contain {', '.join(bad)}" if bad else 0)
PY
then
  echo "setup-runtime: .venv-rt contains torch or onnx (it must hold onnxruntime + numpy only); see $log" >&2
  exit 1
fi
echo "$want" >"$stamp"
if [[ -n "$created" ]]; then
  echo "setup-runtime: created .venv-rt and installed python/requirements.txt (requirements ${want:0:12})"
else
  echo "setup-runtime: requirements changed; installed python/requirements.txt into .venv-rt (requirements ${want:0:12})"
fi

#!/usr/bin/env bash
# Idempotent environment for regenerating fixtures/exporters/ (fixtures/generate_exporters.py):
# TensorFlow/Keras + tf2onnx, JAX + optax + jax2onnx, Paddle + paddle2onnx. Only needed to
# regenerate those fixtures; the tests use the committed graphs and values (.venv only).
#
#   scripts/setup/setup-exporters.sh          # .venv-exporters at the repository root (~3 GB)
#
# Creates .venv-exporters with `python3.11 -m venv` when .venv-exporters/bin/python is missing and
# installs the pins below (with fixtures/exporters/constraints.txt, the full `pip freeze` of the
# environment the fixtures were made with) when the venv is new or this script or the constraints
# changed since the last install (sha256 stamp in .venv-exporters/.setup.sha256). Otherwise does
# nothing. Prints one line; pip's output goes to .venv-exporters/setup-exporters.log.
# Env: PYTHON (default python3.11) picks the interpreter; EXPORTERS_VENV the venv folder.
#
# Why two pip runs: paddle2onnx 2.1.0 declares onnx<=1.17.0 while jax2onnx 0.17.1 needs
# onnx>=1.20.1, so pip cannot install both. paddle2onnx's converter is C++ and does not use the
# onnx package for the export; the generator runs its onnxoptimizer passes itself. So paddle2onnx
# and onnxoptimizer are installed with --no-deps, with onnx 1.23.2. polygraphy (paddle2onnx's
# default post-pass, which pip-installs onnx_graphsurgeon at run time) is deliberately left out.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${EXPORTERS_VENV:-$root/.venv-exporters}"
constraints="$root/fixtures/exporters/constraints.txt"
stamp="$venv/.setup.sha256"
log="$venv/setup-exporters.log"
python="${PYTHON:-python3.11}"

MAIN=(
  tensorflow==2.21.0 keras==3.15.1 tf2onnx==1.17.0
  jax==0.10.2 jaxlib==0.10.2 optax==0.2.8 jax2onnx==0.17.1
  paddlepaddle==3.3.1
  onnx==1.23.2 numpy==2.4.6 protobuf==7.36.2
)
NODEPS=(paddle2onnx==2.1.0 onnxoptimizer==0.3.13)

want="$(cat "${BASH_SOURCE[0]}" "$constraints" | sha256sum | cut -d' ' -f1)"
have="$(cat "$stamp" 2>/dev/null || true)"

created=""
if [[ ! -x "$venv/bin/python" ]]; then
  "$python" -m venv "$venv"
  created=1
fi

if [[ -z "$created" && "$want" == "$have" ]]; then
  echo "setup-exporters: $(basename "$venv") up to date ($("$venv/bin/python" --version 2>&1), ${want:0:12})"
  exit 0
fi

pip=("$venv/bin/python" -m pip install --disable-pip-version-check)
if ! { "${pip[@]}" -c "$constraints" "${MAIN[@]}" && "${pip[@]}" --no-deps "${NODEPS[@]}"; } >"$log" 2>&1; then
  echo "setup-exporters: pip install failed; last lines of $log:" >&2
  tail -n 20 "$log" >&2
  exit 1
fi
echo "$want" >"$stamp"
echo "setup-exporters: installed the exporter pins into $(basename "$venv") (${want:0:12})"

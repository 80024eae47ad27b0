#!/usr/bin/env bash
# The ONNX Runtime C library for `ntl-patch validate --runtime ort`: the `libonnxruntime.so`
# that ships inside the PyPI `onnxruntime` wheel, installed into .venv-ort (git-ignored; kept
# apart from .venv, whose onnxruntime-training installs the same Python package name).
# Prints the library path on stdout. Idempotent.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
version="1.31.1"
target="$root/.venv-ort"
lib="$target/onnxruntime/capi/libonnxruntime.so.$version"
if [[ ! -f "$lib" ]]; then
  python3 -m pip install --disable-pip-version-check -q --no-deps --target "$target" "onnxruntime==$version" >&2
fi
[[ -f "$lib" ]] || { echo "setup-ort: $lib missing after install" >&2; exit 1; }
echo "$lib"

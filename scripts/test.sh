#!/usr/bin/env bash
# Every test: Rust unit and integration tests, then the ONNX Runtime Training end-to-end harness.
# Installs what the tests need on first use (.venv for Python, .venv-rt for the torch-free
# onnxruntime 1.31.1 environment, .venv-ort for the ORT C library; tests/python/test_wheel.py makes
# .venv-maturin through scripts/setup/build-wheel.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# Every pip install below (setup scripts, the wheel tests) skips pip's cache: on a clean machine
# it would only double the gigabytes installed.
export PIP_NO_CACHE_DIR=1

scripts/setup/setup-python.sh
scripts/setup/setup-runtime.sh   # .venv-rt: onnxruntime 1.31.1 + numpy only, for the step-graph runner tests
ORT_DYLIB_PATH="$(scripts/setup/setup-ort.sh)"
export ORT_DYLIB_PATH

cargo build --locked
cargo test --locked
NTL_PATCH_BIN="$root/target/debug/ntl-patch" .venv/bin/python -m pytest tests/python -q

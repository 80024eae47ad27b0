#!/usr/bin/env bash
# Every test: Rust unit and integration tests, then the ONNX Runtime Training end-to-end harness.
# Installs what the tests need on first use (.venv for Python, .venv-ort for the ORT C library).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

scripts/setup-python.sh
ORT_DYLIB_PATH="$(scripts/setup-ort.sh)"
export ORT_DYLIB_PATH

cargo build --locked
cargo test --locked
NTL_PATCH_BIN="$root/target/debug/ntl-patch" .venv/bin/python -m pytest tests/python -q

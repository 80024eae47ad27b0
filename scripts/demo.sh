#!/usr/bin/env bash
# The main job on the bundled fixture: patch a tiny exported causal LM with NTL-WAS, then
# validate the patched graph (tract, embedded) against the independent reference and the
# torch + ntloss recording; then write its standard-ONNX training step and train it for three
# steps in tract (validate; also in ONNX Runtime when ORT_DYLIB_PATH is set).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cargo build --release --locked
mkdir -p target/demo
cp fixtures/models/lm_flat.onnx fixtures/tokenizer.json target/demo/
rm -f target/demo/lm_flat.ntl.onnx target/demo/lm_flat.step.onnx
target/release/ntl-patch target/demo/lm_flat.onnx --loss wasserstein
target/release/ntl-patch validate target/demo/lm_flat.ntl.onnx --reference fixtures/reference/lm_flat_wasserstein
target/release/ntl-patch step target/demo/lm_flat.onnx --loss wasserstein
target/release/ntl-patch validate target/demo/lm_flat.step.onnx

#!/usr/bin/env bash
# The main job on the bundled fixture: patch a tiny exported causal LM with NTL-WAS, then
# validate the patched graph (tract, embedded) against the independent reference and the
# torch + ntloss recording.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cargo build --release --locked
mkdir -p target/demo
cp fixtures/models/lm_flat.onnx fixtures/tokenizer.json target/demo/
rm -f target/demo/lm_flat.ntl.onnx
target/release/ntl-patch target/demo/lm_flat.onnx --loss wasserstein
target/release/ntl-patch validate target/demo/lm_flat.ntl.onnx --reference fixtures/reference/lm_flat_wasserstein

#!/usr/bin/env bash
# One training step: the `ntl-patch step` graph (plain onnxruntime, .venv-rt) vs ORT Training
# artifacts of the forward patch vs torch eager vs onnxsim 0.8.1 compile_training_loop, at the
# bench_training_step.py setting and on a 4-layer GPT-2 (V=32000). See bench/README.md, section
# "Step graph". Extra arguments go to the Python script (--help), e.g. `--rounds 5`.
# Env: NTL_PATCH_BIN=path skips the release build and uses that binary.
# Writes target/bench-step-graph.{md,json}; work files stay in target/bench-step-graph/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
[ -x .venv/bin/python ] || scripts/setup/setup-python.sh
scripts/setup/setup-runtime.sh
if [ ! -x .venv-bench/bin/python ]; then
  python3 -m venv .venv-bench
fi
.venv-bench/bin/python -c 'import onnxsim, onnxruntime' 2>/dev/null ||
  .venv-bench/bin/pip install --disable-pip-version-check -q onnxsim==0.8.1 onnxruntime==1.31.1
if [ -z "${NTL_PATCH_BIN:-}" ]; then
  cargo build --release --locked --bin ntl-patch
  NTL_PATCH_BIN=target/release/ntl-patch
fi
out=target/bench-step-graph
exec .venv/bin/python scripts/bench/bench_step_graph.py --bin "$NTL_PATCH_BIN" --profile --workdir "$out" \
  --markdown "$out.md" --json "$out.json" "$@"

#!/usr/bin/env bash
# One training step at V=32000: ORT CE only vs CE+NTL (forward patch + ORT autodiff, and
# `ntl-patch artifacts`) vs torch eager. See bench/README.md. Extra arguments go to the Python
# script (--help lists them), e.g. `scripts/bench/bench_training_step.sh --reweigh-variants`.
# Writes target/bench-training-step.{md,json}; the work files stay in target/bench-training-step/.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
[ -x .venv/bin/python ] || scripts/setup/setup-python.sh
cargo build --release --locked --bin ntl-patch
out=target/bench-training-step
exec .venv/bin/python scripts/bench/bench_training_step.py --workdir "$out" \
  --markdown "$out.md" --json "$out.json" "$@"

#!/usr/bin/env bash
# The real-size benchmark (bench/README.md, "Real size"): StepRunner against torch eager on the
# shape of Qwen2-0.5B (qwen1.5b: LoRA against torch + PEFT). Builds the release binary, then runs
# scripts/bench/bench_real_size.py with the arguments given (default --preset qwen0.5b), writing
# target/bench-real-size/<preset>[-float16].{md,json}.
# A real-size preset needs ~20 GB free and a quiet machine (the script checks; --force skips).
# Env: NTL_PATCH_BIN=path skips the release build and uses that binary.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
[ -x .venv/bin/python ] || scripts/setup/setup-python.sh
scripts/setup/setup-runtime.sh
if [ -z "${NTL_PATCH_BIN:-}" ]; then
  cargo build --release --locked --bin ntl-patch
  NTL_PATCH_BIN=target/release/ntl-patch
fi
preset=qwen0.5b
name=""
prev=""
for a in "$@"; do
  [ "$prev" = "--preset" ] && preset="$a"
  [ "$prev" = "--export-dtype" ] && [ "$a" != float32 ] && name="-$a"
  prev="$a"
done
name="$preset$name"
out=target/bench-real-size
mkdir -p "$out"
exec .venv/bin/python scripts/bench/bench_real_size.py --bin "$NTL_PATCH_BIN" --preset "$preset" \
  --markdown "$out/$name.md" --json "$out/$name.json" "$@"

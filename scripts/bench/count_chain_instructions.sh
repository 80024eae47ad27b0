#!/usr/bin/env bash
# Deterministic growth check (not a test) of the Identity-chain commands of bench_hostile.sh:
# the instructions executed (valgrind callgrind, `Collected`) for `patch` and the refusal
# (`--vocab-size 7`) at N and 2N chain nodes, and their ratio. A ratio near 2.0 means the work
# grows linearly with the graph; a wall-clock ratio above that (bench_hostile.sh) then comes from
# the memory hierarchy, not from the algorithm. Wall-clock ratios on the shared 2-core machine
# move too much to tell the two apart.
#
#   scripts/bench/count_chain_instructions.sh [N]      (N default 100000; 2N runs ~1 min each in a debug build)
#
# Env: NTL_PATCH_BIN (default target/release/ntl-patch, built if missing), KEEP=1 keeps the work
# folder. Needs valgrind and the .venv of scripts/setup/setup-python.sh (onnx).
set -euo pipefail

# shellcheck source=timing_setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/timing_setup.sh"
timing_setup chain-count ""
command -v valgrind > /dev/null || { echo "needs valgrind (apt-get install valgrind)" >&2; exit 1; }
N="${1:-100000}"

count() { # MODEL ARGS... -> instructions executed
  valgrind --tool=callgrind --callgrind-out-file=/dev/null "$BIN" "$@" -o "$WORK/out.onnx" \
    2>&1 > /dev/null | sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
  rm -f "$WORK/out.onnx"
}

echo "| command | instructions at $N | at $((2 * N)) | ratio |"
echo "| --- | ---: | ---: | ---: |"
for n in "$N" "$((2 * N))"; do
  mkdir -p "$WORK/$n"
  "$PY" "$ROOT/scripts/bench/gen_hostile_models.py" "$WORK/$n" --zeros-gb 0 --small 1 --chain "$n" > /dev/null
done
for cmd in "patch" "refusal --vocab-size 7"; do
  args=()
  [ "$cmd" = patch ] || read -ra args <<< "${cmd#* }"
  a=$(count "$WORK/$N/identity_chain.onnx" "${args[@]}")
  b=$(count "$WORK/$((2 * N))/identity_chain.onnx" "${args[@]}")
  echo "| $cmd | $a | $b | $(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.3f", b / a }') |"
done

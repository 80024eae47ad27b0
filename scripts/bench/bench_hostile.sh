#!/usr/bin/env bash
# Timing benchmark (not a test) of big hostile inputs: how long ntl-patch takes to patch (or
# refuse) and to inspect each model of scripts/bench/gen_hostile_models.py. Prints a Markdown table:
# exit code, median wall time and peak RSS (/usr/bin/time) of RUNS runs.
#
#   scripts/bench/bench_hostile.sh [WORK_DIR]
#
# WORK_DIR (default: a new folder under /var/tmp) receives a 10 GiB sparse file of zeros (no
# disk blocks), a 518 MB model of 250 000 small initializers, a 1 000 000-node Identity chain
# and the outputs; it is deleted at the end unless KEEP=1. Env: RUNS (3), NTL_PATCH_BIN
# (default target/release/ntl-patch, built if missing), ZEROS_GB (10), SMALL (250000),
# CHAIN (1000000). Needs the .venv of scripts/setup/setup-python.sh (onnx).
set -euo pipefail

# shellcheck source=timing_setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/timing_setup.sh"
timing_setup hostile "${1:-}"

if [ ! -f "$WORK/identity_chain.onnx" ]; then
  echo "generating models in $WORK ..." >&2
  "$PY" "$ROOT/scripts/bench/gen_hostile_models.py" "$WORK" --zeros-gb "${ZEROS_GB:-10}" \
    --small "${SMALL:-250000}" --chain "${CHAIN:-1000000}" > /dev/null
fi

echo "| model | command | exit | median wall | peak RSS |"
echo "| --- | --- | ---: | ---: | ---: |"
for model in zeros small_inits identity_chain; do
  for cmd in patch inspect; do
    walls=()
    rss=0
    code=0
    for _ in $(seq "$RUNS"); do
      rm -f "$WORK/out.onnx"
      if [ "$cmd" = patch ]; then
        args=("$WORK/$model.onnx" -o "$WORK/out.onnx")
      else
        args=(inspect "$WORK/$model.onnx")
      fi
      start=$(date +%s%N)
      code=0
      /usr/bin/time -f "%M" -o "$WORK/rss.txt" "$BIN" "${args[@]}" > /dev/null 2> "$WORK/stderr.txt" || code=$?
      end=$(date +%s%N)
      walls+=("$(( (end - start) / 1000000 ))")
      r=$(tail -n 1 "$WORK/rss.txt")
      rss=$(( r > rss ? r : rss ))
    done
    median=$(printf '%s\n' "${walls[@]}" | sort -n | sed -n "$(( (RUNS + 1) / 2 ))p")
    echo "| $model | $cmd | $code | ${median} ms | $(( rss / 1024 )) MB |"
  done
done

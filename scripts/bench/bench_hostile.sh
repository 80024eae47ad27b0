#!/usr/bin/env bash
# Timing benchmark (not a test) of big hostile inputs: how long ntl-patch takes to patch (or
# refuse) and to inspect each model of scripts/bench/gen_hostile_models.py (the Identity chains
# also patched with --vocab-size 48 and refused with --vocab-size 7). Prints a Markdown table:
# exit code, median wall, user and system time, peak RSS (/usr/bin/time) of RUNS runs, and the
# load average after them (the CPU time per node is the figure to compare on a shared machine).
#
#   scripts/bench/bench_hostile.sh [WORK_DIR]
#
# WORK_DIR (default: a new folder under /var/tmp) receives a 10 GiB sparse file of zeros (no
# disk blocks), a 518 MB model of 250 000 small initializers, three 1 000 000-node Identity
# chains and the outputs; it is deleted at the end unless KEEP=1. Env: RUNS (3), NTL_PATCH_BIN
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

# median of RUNS values (one per line on stdin)
median() { sort -n | sed -n "$(( (RUNS + 1) / 2 ))p"; }

echo "| model | command | exit | median wall | median user | median sys | peak RSS | load |"
echo "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
for model in zeros small_inits identity_chain identity_chain_before_logits identity_chain_untyped_scores; do
  commands=(patch inspect)
  # the chains: also patched with the width given, and a refusal (a width the graph contradicts)
  case "$model" in identity_chain*) commands+=("patch --vocab-size 48" "refusal --vocab-size 7") ;; esac
  for cmd in "${commands[@]}"; do
    walls=()
    users=()
    syss=()
    rss=0
    code=0
    for _ in $(seq "$RUNS"); do
      rm -f "$WORK/out.onnx"
      case "$cmd" in
        patch) args=("$WORK/$model.onnx" -o "$WORK/out.onnx") ;;
        inspect) args=(inspect "$WORK/$model.onnx") ;;
        *) args=("$WORK/$model.onnx" -o "$WORK/out.onnx" --vocab-size "${cmd##* }") ;;
      esac
      start=$(date +%s%N)
      code=0
      /usr/bin/time -f "%M %U %S" -o "$WORK/rss.txt" "$BIN" "${args[@]}" > /dev/null 2> "$WORK/stderr.txt" || code=$?
      end=$(date +%s%N)
      walls+=("$(( (end - start) / 1000000 ))")
      read -r r u s < <(tail -n 1 "$WORK/rss.txt")
      users+=("$u")
      syss+=("$s")
      rss=$(( r > rss ? r : rss ))
    done
    wall=$(printf '%s\n' "${walls[@]}" | median)
    user=$(printf '%s\n' "${users[@]}" | median)
    sys=$(printf '%s\n' "${syss[@]}" | median)
    load=$(cut -d ' ' -f 1 /proc/loadavg)
    echo "| $model | $cmd | $code | ${wall} ms | ${user} s | ${sys} s | $(( rss / 1024 )) MB | $load |"
  done
done

#!/usr/bin/env bash
# Same input and options, same bytes: runs two ntl-patch binaries over every fixture model
# (fixtures/models, fixtures/exporters) — patch with several losses, step, step --split,
# the step graph's options one by one (precision, LoRA, recompute, fused head, attention,
# optimizer), inspect (text and JSON) — and compares exit codes, stdout, stderr and every
# output file byte for byte. A check for changes meant to keep outputs (performance and
# refactoring work), not a test.
#
#   scripts/bench/compare_outputs.sh BASE_BIN NEW_BIN [WORK_DIR]
#
# EXTRA_MODELS=DIR adds DIR/*.onnx (e.g. half-precision exports, which no fixture is:
# scripts/bench/half_variants.py makes them).
#
# Prints one line per difference and a count; exits 1 if any.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BASE="$(realpath "$1")"
NEW="$(realpath "$2")"
WORK="${3:-$(mktemp -d /tmp/ntl-compare.XXXXXX)}"
TOK="$ROOT/fixtures/tokenizer.json"

# `compare NAME ARGS...`: runs ARGS (OUT standing for an empty output folder) under both
# binaries, each into $WORK/base or $WORK/new, and compares the two folders
differences=0
runs=0
succeeded=0
compare() {
  local name="$1"
  shift
  local side
  for side in base new; do
    local bin="$BASE"
    [ "$side" = new ] && bin="$NEW"
    local dir="$WORK/$side"
    rm -rf "$dir"
    mkdir -p "$dir"
    local args=()
    local a
    for a in "$@"; do args+=("${a//OUT/$WORK/out}"); done
    rm -rf "$WORK/out"
    mkdir -p "$WORK/out"
    (cd "$WORK" && "$bin" "${args[@]}" > "$dir/stdout" 2> "$dir/stderr"; echo $? > "$dir/rc")
    cp -r "$WORK/out" "$dir/files"
  done
  runs=$((runs + 1))
  [ "$(cat "$WORK/base/rc")" = 0 ] && succeeded=$((succeeded + 1))
  if ! diff -r -q "$WORK/base" "$WORK/new" > /dev/null; then
    differences=$((differences + 1))
    echo "DIFFERENT: $name"
    diff -r -q "$WORK/base" "$WORK/new" | sed 's/^/    /'
  fi
}

models=("$ROOT"/fixtures/models/*.onnx "$ROOT"/fixtures/exporters/*.onnx)
[ -n "${EXTRA_MODELS:-}" ] && models+=("$EXTRA_MODELS"/*.onnx)
for model in "${models[@]}"; do
  m="$(basename "$model")"
  for loss in wasserstein mse ntil number-level dist2 del smmd; do
    compare "$m patch --loss $loss" "$model" --tokenizer "$TOK" --loss "$loss" -o OUT/patched.onnx
  done
  compare "$m patch --json" "$model" --tokenizer "$TOK" --json -o OUT/patched.onnx
  compare "$m step" step "$model" --tokenizer "$TOK" -o OUT/step.onnx
  compare "$m step --split" step "$model" --tokenizer "$TOK" --split -o OUT/step.onnx
  compare "$m step --lora-r 2" step "$model" --tokenizer "$TOK" --lora-r 2 -o OUT/step.onnx
  compare "$m step --precision fp16" step "$model" --tokenizer "$TOK" --precision fp16 -o OUT/step.onnx
  compare "$m step --precision bf16" step "$model" --tokenizer "$TOK" --precision bf16 -o OUT/step.onnx
  compare "$m step --precision fp32" step "$model" --tokenizer "$TOK" --precision fp32 -o OUT/step.onnx
  compare "$m step --split --precision fp16" step "$model" --tokenizer "$TOK" --split --precision fp16 -o OUT/step.onnx
  compare "$m step --lora-r 4" step "$model" --tokenizer "$TOK" --lora-r 4 -o OUT/step.onnx
  compare "$m step --lora-r 4 --precision fp16" step "$model" --tokenizer "$TOK" --lora-r 4 --precision fp16 -o OUT/step.onnx
  compare "$m step --recompute layers" step "$model" --tokenizer "$TOK" --recompute layers -o OUT/step.onnx
  compare "$m step --fused-head on" step "$model" --tokenizer "$TOK" --fused-head on -o OUT/step.onnx
  compare "$m step --attention eager" step "$model" --tokenizer "$TOK" --attention eager -o OUT/step.onnx
  compare "$m step --attention chunked --attention-block 3" step "$model" --tokenizer "$TOK" --attention chunked --attention-block 3 -o OUT/step.onnx
  compare "$m step --recompute layers --fused-head on --precision fp16" step "$model" --tokenizer "$TOK" --recompute layers --fused-head on --precision fp16 -o OUT/step.onnx
  compare "$m step --optimizer sgd --max-grad-norm 1" step "$model" --tokenizer "$TOK" --optimizer sgd --max-grad-norm 1 -o OUT/step.onnx
  compare "$m step --optimizer sgd --momentum 0.9 --split" step "$model" --tokenizer "$TOK" --optimizer sgd --momentum 0.9 --split -o OUT/step.onnx
  compare "$m inspect" inspect "$model"
  compare "$m inspect --json" inspect --json "$model"
done
echo "$runs runs compared ($succeeded exited 0 with the base binary), $differences different"
[ "$differences" = 0 ]

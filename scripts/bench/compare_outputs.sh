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
# scripts/bench/half_variants.py makes them). JOB_INPUTS=DIR (scripts/bench/job_inputs.py makes
# it) adds the file-handling paths: artifacts folders, models with external data (step's
# sparse state file, patch copying external data), lora-model, and the default output paths.
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
    # SEED=DIR: OUT starts as a copy of DIR (inputs whose outputs go beside them)
    [ -n "${SEED:-}" ] && cp -r "$SEED"/. "$WORK/out"
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
if [ -n "${JOB_INPUTS:-}" ]; then
  for art in "$JOB_INPUTS"/art/*/; do
    n="$(basename "$art")"
    a="art/$n"
    seed="$WORK/seed-art-$n"
    rm -rf "$seed" && mkdir -p "$seed" && cp -r "$art" "$seed/art"
    for loss in wasserstein mse ntil; do
      compare "$a artifacts --loss $loss" artifacts "$art" --loss "$loss" -o OUT/art-ntl
    done
    SEED="$seed" compare "$a artifacts (default output)" artifacts OUT/art --json
    SEED="$seed" compare "$a artifacts (output exists)" artifacts OUT/art -o OUT/art
  done
  for model in "$JOB_INPUTS"/ext/*.onnx; do
    m="ext/$(basename "$model")"
    d="$(dirname "$model")"
    n="$(basename "$model" .onnx)"
    seed="$WORK/seed-$n"
    rm -rf "$seed" && mkdir -p "$seed" && cp "$model" "$d/$n.data" "$TOK" "$seed/"
    compare "$m patch -o elsewhere" "$model" --tokenizer "$TOK" -o OUT/patched.onnx
    compare "$m patch --copy-external-data" "$model" --tokenizer "$TOK" --copy-external-data -o OUT/patched.onnx
    SEED="$seed" compare "$m patch (default output)" OUT/"$n.onnx" --json
    compare "$m step" step "$model" --tokenizer "$TOK" -o OUT/step.onnx
    SEED="$seed" compare "$m step beside" step OUT/"$n.onnx" -o OUT/step.onnx
    SEED="$seed" compare "$m step (default outputs)" step OUT/"$n.onnx" --json
    SEED="$seed" compare "$m step --split (default outputs)" step OUT/"$n.onnx" --split
    SEED="$seed" compare "$m step --split -o X.grad.onnx" step OUT/"$n.onnx" --split -o OUT/x.grad.onnx
    SEED="$seed" compare "$m step --split --precision fp16" step OUT/"$n.onnx" --split --precision fp16 -o OUT/s.onnx
    SEED="$seed" compare "$m step --lora-r 2" step OUT/"$n.onnx" --lora-r 2 -o OUT/step.onnx
  done
  for model in "${models[@]}"; do
    m="$(basename "$model" .onnx)"
    seed="$WORK/seed-lora-$m"
    rm -rf "$seed" && mkdir -p "$seed" && cp "$model" "$TOK" "$seed/"
    # the step graph lora-model reads, made once by the base binary
    "$BASE" step "$model" --tokenizer "$TOK" --lora-r 2 -o "$seed/$m.step.onnx" > /dev/null 2>&1
    SEED="$seed" compare "$m lora-model" lora-model OUT/"$m.onnx" --step OUT/"$m.step.onnx" -o OUT/lora.onnx
    SEED="$seed" compare "$m lora-model --json (default output)" lora-model OUT/"$m.onnx" --step OUT/"$m.step.onnx" --json
    SEED="$seed" compare "$m lora-model of the step graph" lora-model OUT/"$m.step.onnx" --step OUT/"$m.step.onnx"
    SEED="$seed" compare "$m step, default outputs" step OUT/"$m.onnx"
    SEED="$seed" compare "$m step again (already a step graph)" step OUT/"$m.step.onnx"
  done
fi
echo "$runs runs compared ($succeeded exited 0 with the base binary), $differences different"
[ "$differences" = 0 ]

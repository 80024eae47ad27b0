#!/usr/bin/env bash
# Scale benchmark (not a test): ntl-patch against `cp` of the same file and Python
# `onnx.load` + `onnx.save`, on the big models scripts/bench/gen_big_models.py makes, measured in the
# same run. Prints a Markdown table: median wall time and peak RSS (/usr/bin/time) of RUNS runs.
#
#   scripts/bench/bench_scale.sh [WORK_DIR]
#
# WORK_DIR (default: a new folder under /var/tmp) receives ~2 GB of inline models, an 8 GiB
# sparse external-data file (no disk blocks) and the outputs; it is deleted at the end unless
# KEEP=1. Env: RUNS (3), NTL_PATCH_BIN (default target/release/ntl-patch, built if missing),
# EXTERNAL_GB (8), INLINE_GB ("0.5 1.5"). Needs the .venv of scripts/setup/setup-python.sh (onnx 1.17).
# The page cache is warm (the models were just written): the numbers compare the work each tool
# does, not the disk. ntl-patch fsyncs its output before the rename; cp does not, so the
# "cp + fsync" column is given too.
set -euo pipefail

# shellcheck source=timing_setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/timing_setup.sh"
timing_setup bench "${1:-}"
TOKENIZER="$ROOT/fixtures/tokenizer.json"

echo "generating models in $WORK ..." >&2
# shellcheck disable=SC2086
"$PY" "$ROOT/scripts/bench/gen_big_models.py" "$WORK" \
  --external-gb "${EXTERNAL_GB:-8}" --inline-gb ${INLINE_GB:-0.5 1.5} > "$WORK/models.txt"

RESULTS="$WORK/results.tsv"
: > "$RESULTS"

# measure NAME TOOL OUT CMD...: runs CMD RUNS times (OUT removed before each run, outside the
# timing) and appends "NAME TOOL wall_s rss_kb" per run to $RESULTS.
measure() {
  local name="$1" tool="$2" out="$3"
  shift 3
  for _ in $(seq "$RUNS"); do
    rm -f "$out"
    local start end
    start=$(date +%s%N)
    /usr/bin/time -f "%M" -o "$WORK/rss.txt" "$@" > /dev/null 2> "$WORK/stderr.txt" || {
      echo "$tool failed on $name:" >&2
      cat "$WORK/stderr.txt" >&2
      exit 1
    }
    end=$(date +%s%N)
    printf '%s\t%s\t%s\t%s\n' "$name" "$tool" \
      "$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.4f", (b - a) / 1e9 }')" \
      "$(tail -1 "$WORK/rss.txt")" >> "$RESULTS"
  done
  rm -f "$out"
}

ONNX_ROUNDTRIP='import onnx, sys
m = onnx.load(sys.argv[1], load_external_data=False)
onnx.save(m, sys.argv[2])'

while read -r model; do
  dir="$(dirname "$model")"
  name="$(basename "$dir")/$(basename "$model")"
  name="${name#"$(basename "$WORK")/"}"
  size=$(stat -c %s "$model")
  external=0
  for f in "$dir"/*.bin; do
    [ -e "$f" ] && external=$((external + $(stat -c %s "$f")))
  done
  printf '%s\tsize\t%s\t%s\n' "$name" "$size" "$external" >> "$RESULTS"
  echo "measuring $name ..." >&2
  # outputs beside the model: external data locations stay valid
  measure "$name" ntl "$dir/bench.ntl.onnx" \
    "$BIN" "$model" --tokenizer "$TOKENIZER" -o "$dir/bench.ntl.onnx"
  measure "$name" cp "$dir/bench.cp.onnx" cp "$model" "$dir/bench.cp.onnx"
  measure "$name" cpsync "$dir/bench.cp.onnx" \
    sh -c 'cp "$1" "$2" && sync "$2"' sh "$model" "$dir/bench.cp.onnx"
  measure "$name" onnx "$dir/bench.py.onnx" "$PY" -c "$ONNX_ROUNDTRIP" "$model" "$dir/bench.py.onnx"
done < "$WORK/models.txt"

"$PY" - "$RESULTS" "$RUNS" <<'EOF'
import os, statistics, sys
from collections import defaultdict

rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1])]
runs = sys.argv[2]
size, wall, rss = {}, defaultdict(list), defaultdict(list)
order = []
for name, tool, a, b in rows:
    if tool == "size":
        size[name] = (int(a), int(b))
        order.append(name)
    else:
        wall[name, tool].append(float(a))
        rss[name, tool].append(int(b) * 1024)

def mb(n):
    return f"{n / 1e6:,.0f} MB" if n >= 1e7 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"

def sec(s):
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"

med = lambda name, tool: statistics.median(wall[name, tool])
peak = lambda name, tool: statistics.median(rss[name, tool])
load = open("/proc/loadavg").read().split()[:3]
print(f"Median of {runs} runs, warm page cache; RSS = peak resident set size (/usr/bin/time); "
      f"{os.cpu_count()} CPUs, load average {' '.join(load)} at the end.\n")
print("| model | .onnx file | external data | ntl-patch | ntl-patch RSS | cp | cp + fsync | onnx load+save | onnx RSS | ntl-patch / cp | ntl-patch / (cp + fsync) | ntl-patch RSS / file | ntl-patch / onnx |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for name in order:
    file, ext = size[name]
    n, c, cs, o = med(name, "ntl"), med(name, "cp"), med(name, "cpsync"), med(name, "onnx")
    r = peak(name, "ntl")
    print(f"| {name} | {mb(file)} | {mb(ext) + ' (sparse)' if ext else '-'} | {sec(n)} | {mb(r)} | {sec(c)} | {sec(cs)} | "
          f"{sec(o)} | {mb(peak(name, 'onnx'))} | {n / c:.2f}× | {n / cs:.2f}× | {r / file:.2f}× | {n / o:.2f}× |")
print()
for name in order:
    file, ext = size[name]
    n, r = med(name, "ntl"), peak(name, "ntl")
    if ext:
        ok = n < 0.2 and r < 64e6
        print(f"- {name}: target < 200 ms and < 64 MB RSS: {sec(n)}, {mb(r)} -> {'met' if ok else 'MISSED'}")
    else:
        ok = n <= 2 * med(name, "cp") and r <= 1.2 * file
        print(f"- {name}: target wall <= 2x cp and RSS <= 1.2x file: {n / med(name, 'cp'):.2f}x, {r / file:.2f}x -> {'met' if ok else 'MISSED'}")
EOF

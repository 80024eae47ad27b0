#!/usr/bin/env bash
# Growth of the time per node with the graph's size (issue 35): the Identity chains of
# gen_hostile_models.py at 250 k, 500 k and 1 M nodes, patched and refused (--vocab-size 7) by
# one or two binaries, interleaved, RUNS times each. Prints, per command, the smallest user
# time (the figure least disturbed by other work on a shared machine) and t(1 M)/t(500 k) in
# user time and in the median elapsed time, the median system time and the peak RSS.
#
# The control row ("touch") is no ntl-patch code: touch_memory.py writing as many fresh
# huge-page-advised bytes as the patch command's peak RSS at that size, run right after it.
# Where the commands' elapsed time grows faster than their user time, the control shows
# whether the kernel's first touch of fresh memory grows the same way on this machine.
#
#   scripts/bench/growth.sh BIN [BIN2]    (RUNS=5 by default; WORK=dir keeps the models)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
RUNS="${RUNS:-5}"
WORK="${WORK:-$(mktemp -d /tmp/ntl-growth.XXXXXX)}"
SIZES=(250000 500000 1000000)
for n in "${SIZES[@]}"; do
  if [ ! -f "$WORK/$n/identity_chain.onnx" ]; then
    mkdir -p "$WORK/$n"
    # run from the repository root: the generator and the tokenizer are found from there
    (cd "$ROOT" && "$ROOT/.venv/bin/python" - "$WORK/$n" "$n") <<'PY'
import sys
sys.path.insert(0, "scripts/bench")
import shutil, gen_hostile_models as g
shutil.copy("fixtures/tokenizer.json", sys.argv[1])
g.identity_chain(sys.argv[1], int(sys.argv[2]))
PY
  fi
done
rm -f "$WORK"/times-*
for _ in $(seq "$RUNS"); do
  for bin in "$@"; do
    tag=$(basename "$bin")
    for n in "${SIZES[@]}"; do
      m="$WORK/$n/identity_chain.onnx"
      /usr/bin/time -f "$n %U %S %e %M" -a -o "$WORK/times-$tag-patch" "$bin" "$m" -o "$WORK/out.onnx" >/dev/null 2>&1 || true
      rss_mb=$(( $(tail -1 "$WORK/times-$tag-patch" | awk '{print $5}') / 1024 ))
      echo "$n $("$ROOT/.venv/bin/python" "$ROOT/scripts/bench/touch_memory.py" "$rss_mb" --bare) $((rss_mb * 1024))" \
        >>"$WORK/times-touch-control"
      /usr/bin/time -f "$n %U %S %e %M" -a -o "$WORK/times-$tag-refusal" "$bin" "$m" -o "$WORK/out.onnx" --vocab-size 7 >/dev/null 2>&1 || true
    done
  done
done
"$ROOT/.venv/bin/python" - "$WORK" <<'PY'
import glob, os, statistics, sys

print("| binary | command | 250 k user s | 500 k user s | 1 M user s | t(1 M)/t(500 k) user"
      " | t(1 M)/t(500 k) elapsed, medians | system s 500 k / 1 M, medians | 1 M peak RSS MB |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "times-*"))):
    runs = {}
    for line in open(path):
        fields = line.split()
        if len(fields) == 5 and fields[0].isdigit():
            runs.setdefault(int(fields[0]), []).append([float(f) for f in fields[1:]])
    if not all(n in runs for n in (250000, 500000, 1000000)):
        continue
    user = {n: min(r[0] for r in rs) for n, rs in runs.items()}
    med = lambda n, i: statistics.median(r[i] for r in runs[n])
    name, command = os.path.basename(path)[len("times-"):].rsplit("-", 1)
    # the control's user time is its Python loop, not the kernel's work: not shown
    users = ([f"{user[n]:.2f}" for n in (250000, 500000, 1000000)]
             + [f"{user[1000000] / max(user[500000], 1e-9):.2f}"]) if name != "touch" else ["–"] * 4
    print(f"| {name} | {command} | {' | '.join(users)}"
          f" | {med(1000000, 2) / max(med(500000, 2), 1e-9):.2f}"
          f" | {med(500000, 1):.2f} / {med(1000000, 1):.2f}"
          f" | {max(r[3] for r in runs[1000000]) / 1024:.0f} |")
PY

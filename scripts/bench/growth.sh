#!/usr/bin/env bash
# Growth of the time per node with the graph's size (issue 35): the Identity chains of
# gen_hostile_models.py at 250 k, 500 k and 1 M nodes, patched and refused (--vocab-size 7) by
# one or two binaries, interleaved, RUNS times each; prints the smallest user time (the figure
# least disturbed by other work on a shared machine), peak RSS and t(1 M)/t(500 k).
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
      /usr/bin/time -f "$n %U %M" -a -o "$WORK/times-$tag-patch" "$bin" "$m" -o "$WORK/out.onnx" >/dev/null 2>&1 || true
      /usr/bin/time -f "$n %U %M" -a -o "$WORK/times-$tag-refusal" "$bin" "$m" -o "$WORK/out.onnx" --vocab-size 7 >/dev/null 2>&1 || true
    done
  done
done
echo "| binary | command | 250 k user s | 500 k user s | 1 M user s | t(1 M)/t(500 k) | 1 M peak RSS MB |"
echo "| --- | --- | ---: | ---: | ---: | ---: | ---: |"
for f in "$WORK"/times-*; do
  name=${f##*/times-}
  grep -E '^[0-9]+ ' "$f" | awk -v name="$name" '
    { if (!($1 in u) || $2 < u[$1]) u[$1] = $2; if ($3 > m[$1]) m[$1] = $3 }
    END { split(name, p, "-"); cmd = p[length(p)]; sub("-" cmd "$", "", name);
          printf "| %s | %s | %.2f | %.2f | %.2f | %.2f | %d |\n", name, cmd, u[250000], u[500000],
                 u[1000000], u[1000000] / u[500000], m[1000000] / 1024 }'
done

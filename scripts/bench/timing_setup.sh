# Shared set-up of the /usr/bin/time benchmarks (bench_scale.sh, bench_hostile.sh), sourced:
# `timing_setup NAME [WORK_DIR]` sets ROOT, PY (.venv's python), BIN (NTL_PATCH_BIN, default
# target/release/ntl-patch, built if missing), RUNS (default 3) and WORK (WORK_DIR, or a new
# /var/tmp/ntl-NAME.XXXXXX folder that is deleted at exit unless KEEP=1).
timing_setup() {
  ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  PY="$ROOT/.venv/bin/python"
  BIN="${NTL_PATCH_BIN:-$ROOT/target/release/ntl-patch}"
  RUNS="${RUNS:-3}"
  [ -x /usr/bin/time ] || { echo "needs /usr/bin/time (apt-get install time)" >&2; exit 1; }
  [ -x "$PY" ] || { echo "needs $PY: run scripts/setup/setup-python.sh" >&2; exit 1; }
  if [ ! -x "$BIN" ]; then
    (cd "$ROOT" && cargo build --release --bin ntl-patch >&2)
  fi
  WORK="${2:-}"
  if [ -z "$WORK" ]; then
    WORK="$(mktemp -d "/var/tmp/ntl-$1.XXXXXX")"
  fi
  mkdir -p "$WORK"
  trap 'if [ "${KEEP:-0}" != 1 ]; then rm -rf "$WORK"; fi' EXIT
}

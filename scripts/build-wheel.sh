#!/usr/bin/env bash
# Builds the ntl-patch wheel (pyproject.toml: the binary + python/ntl_patch) with the pinned maturin.
#
#   scripts/build-wheel.sh                              # release build into target/wheels/
#   scripts/build-wheel.sh --profile dev --strip --out DIR    # what tests/python/test_wheel.py runs
#
# Arguments go to `maturin build --locked`. maturin runs cargo in cargo's own target folder
# ($CARGO_TARGET_DIR or target/), so a `--profile dev` build reuses what `cargo build` compiled
# (--strip only relinks the binary). Makes .venv-maturin (python/requirements-build.txt) on first
# use, or when that file changed (sha256 stamp); pip's output goes to .venv-maturin/setup.log.
# Env: PYTHON (default python3) creates the venv.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv-maturin"
req="$root/python/requirements-build.txt"
stamp="$venv/.requirements.sha256"
want="$(sha256sum "$req" | cut -d' ' -f1)"

if [[ ! -x "$venv/bin/python" ]]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
if [[ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]]; then
  rm -f "$stamp"
  if ! "$venv/bin/python" -m pip install --disable-pip-version-check -r "$req" >"$venv/setup.log" 2>&1; then
    echo "build-wheel: pip install -r python/requirements-build.txt failed; last lines of $venv/setup.log:" >&2
    tail -n 20 "$venv/setup.log" >&2
    exit 1
  fi
  echo "$want" >"$stamp"
fi
exec "$venv/bin/maturin" build --locked "$@"

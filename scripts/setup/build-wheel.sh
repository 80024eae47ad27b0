#!/usr/bin/env bash
# Builds the ntl-patch wheel (pyproject.toml: the binary + python/ntl_patch) with the pinned maturin.
#
#   scripts/setup/build-wheel.sh                              # release build into target/wheels/
#   scripts/setup/build-wheel.sh --profile dev --strip --out DIR    # what tests/python/test_wheel.py runs
#
# Arguments go to `maturin build --locked`. maturin runs cargo in cargo's own target folder
# ($CARGO_TARGET_DIR or target/), so a `--profile dev` build reuses what `cargo build` compiled
# (--strip only relinks the binary). Makes .venv-maturin (python/requirements-build.txt) on first
# use, or when that file changed (sha256 stamp); pip's output goes to .venv-maturin/build-wheel.log.
# Env: PYTHON (default python3) creates the venv.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
venv="$root/.venv-maturin"
source "$root/scripts/setup/lib/pinned-venv.sh"
pinned_venv build-wheel "$venv" "$root/python/requirements-build.txt" >&2
exec "$venv/bin/maturin" build --locked "$@"

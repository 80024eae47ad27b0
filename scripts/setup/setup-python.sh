#!/usr/bin/env bash
# Idempotent Python environment for the ntl-patch harness (fixtures/generate.py, tests/python/).
#
#   scripts/setup/setup-python.sh          # .venv at the repository root
#
# Creates .venv with `python3 -m venv` when .venv/bin/python is missing, and installs the pinned
# tests/python/requirements.txt when the venv is new or the file changed since the last install
# (sha256 stamp in .venv/.requirements.sha256). Otherwise does nothing. Prints one line; pip's
# output goes to .venv/setup-python.log (its tail is shown on failure).
# Env: PYTHON (default python3) picks the interpreter used to create the venv.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$root/scripts/setup/lib/pinned-venv.sh"
pinned_venv setup-python "$root/.venv" "$root/tests/python/requirements.txt"

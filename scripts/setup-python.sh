#!/usr/bin/env bash
# Idempotent Python environment for the ntl-patch harness (fixtures/generate.py, tests/python/).
#
#   scripts/setup-python.sh          # .venv at the repository root
#
# Creates .venv with `python3 -m venv` when .venv/bin/python is missing, and installs the pinned
# tests/python/requirements.txt when the venv is new or the file changed since the last install
# (sha256 stamp in .venv/.requirements.sha256). Otherwise does nothing. Prints one line; pip's
# output goes to .venv/setup-python.log (its tail is shown on failure).
# Env: PYTHON (default python3) picks the interpreter used to create the venv.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
req="$root/tests/python/requirements.txt"
stamp="$venv/.requirements.sha256"
log="$venv/setup-python.log"
python="${PYTHON:-python3}"

want="$(sha256sum "$req" | cut -d' ' -f1)"
have="$(cat "$stamp" 2>/dev/null || true)"

created=""
if [[ ! -x "$venv/bin/python" ]]; then
  "$python" -m venv "$venv"
  created=1
fi

if [[ -z "$created" && "$want" == "$have" ]]; then
  echo "setup-python: .venv up to date ($("$venv/bin/python" --version 2>&1), requirements ${want:0:12})"
  exit 0
fi

if ! "$venv/bin/python" -m pip install --disable-pip-version-check -r "$req" >"$log" 2>&1; then
  echo "setup-python: pip install -r tests/python/requirements.txt failed; last lines of $log:" >&2
  tail -n 20 "$log" >&2
  exit 1
fi
echo "$want" >"$stamp"
if [[ -n "$created" ]]; then
  echo "setup-python: created .venv and installed tests/python/requirements.txt (requirements ${want:0:12})"
else
  echo "setup-python: requirements changed; installed tests/python/requirements.txt into .venv (requirements ${want:0:12})"
fi

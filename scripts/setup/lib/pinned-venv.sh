# Sourced by the setup scripts: one idempotent "virtual environment with pinned requirements".
#
#   pinned_venv TAG VENV REQUIREMENTS [CHECK]
#
# Creates VENV with `${PYTHON:-python3} -m venv` when VENV/bin/python is missing, and runs
# `pip install -r REQUIREMENTS` when the venv is new or the file changed since the last install
# (sha256 stamp in VENV/.requirements.sha256); otherwise does nothing. No pip cache: the
# wheels (torch's CUDA libraries alone are gigabytes) would be stored twice on a full disk. pip's output goes to
# VENV/TAG.log, whose tail is shown on failure (exit 1). CHECK, if given, is a command run after
# the install with the log as stdout/stderr; its failure also fails (and leaves no stamp).
# Prints one line, prefixed TAG.

pinned_venv() {
  local tag="$1" venv="$2" req="$3" check="${4:-}"
  local stamp="$venv/.requirements.sha256" log="$venv/$tag.log" rel="${3#"$root"/}"
  local want have created=""
  want="$(sha256sum "$req" | cut -d' ' -f1)"
  have="$(cat "$stamp" 2>/dev/null || true)"
  if [[ ! -x "$venv/bin/python" ]]; then
    "${PYTHON:-python3}" -m venv "$venv"
    created=1
  fi
  if [[ -z "$created" && "$want" == "$have" ]]; then
    echo "$tag: ${venv##*/} up to date ($("$venv/bin/python" --version 2>&1), requirements ${want:0:12})"
    return 0
  fi
  rm -f "$stamp"
  if ! "$venv/bin/python" -m pip install --disable-pip-version-check --no-cache-dir -r "$req" >"$log" 2>&1; then
    echo "$tag: pip install -r $rel failed; last lines of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
  if [[ -n "$check" ]] && ! $check >>"$log" 2>&1; then
    echo "$tag: the check after installing $rel failed; last lines of $log:" >&2
    tail -n 3 "$log" >&2
    exit 1
  fi
  echo "$want" >"$stamp"
  if [[ -n "$created" ]]; then
    echo "$tag: created ${venv##*/} and installed $rel (requirements ${want:0:12})"
  else
    echo "$tag: requirements changed; installed $rel into ${venv##*/} (requirements ${want:0:12})"
  fi
}

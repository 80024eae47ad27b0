#!/usr/bin/env bash
# Idempotent environment for regenerating fixtures/models/gpt2_optimum.onnx
# (fixtures/generate_optimum.py): Hugging Face optimum's ONNX exporter. Only needed to regenerate
# that fixture; the tests use the committed graph (.venv only).
#
#   scripts/setup/setup-optimum.sh          # .venv-optimum at the repository root (~5.5 GB, torch with CUDA libs)
#
# Creates .venv-optimum with `python3.11 -m venv` when .venv-optimum/bin/python is missing and
# installs the pins below when the venv is new or this script changed since the last install
# (sha256 stamp in .venv-optimum/.setup.sha256). Otherwise does nothing. Prints one line; pip's
# output goes to .venv-optimum/setup-optimum.log.
# Env: PYTHON (default python3.11) picks the interpreter; OPTIMUM_VENV the venv folder.
#
# Why a venv of its own: optimum-onnx 0.1.0 (the newest on PyPI) requires transformers<4.58 and
# optimum~=2.1.0, and does not import with transformers 5.x (`get_parameter_dtype` is gone from
# transformers.modeling_utils), while the fixtures' .venv pins transformers 5.24.0. The model is
# built and saved in .venv (generate_step.build_model, transformers 5.24.0); this venv only loads
# it and exports it. onnxruntime is needed by the exporter itself (fix_dynamic_axes runs the
# exported graph); onnx stays at 1.17.0 like .venv. torch==2.7.1 is PyPI's wheel (CUDA 12.6
# build; it runs on CPU), the same build as .venv's.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${OPTIMUM_VENV:-$root/.venv-optimum}"
stamp="$venv/.setup.sha256"
log="$venv/setup-optimum.log"
python="${PYTHON:-python3.11}"

PINS=(
  optimum-onnx==0.1.0 optimum==2.1.0
  transformers==4.57.6 tokenizers==0.22.2 huggingface_hub==0.36.2 safetensors==0.8.0
  torch==2.7.1
  onnx==1.17.0 onnxruntime==1.19.2 numpy==2.2.6 protobuf==7.36.2
)

want="$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)"
have="$(cat "$stamp" 2>/dev/null || true)"

created=""
if [[ ! -x "$venv/bin/python" ]]; then
  "$python" -m venv "$venv"
  created=1
fi

if [[ -z "$created" && "$want" == "$have" ]]; then
  echo "setup-optimum: $(basename "$venv") up to date ($("$venv/bin/python" --version 2>&1), ${want:0:12})"
  exit 0
fi

if ! "$venv/bin/python" -m pip install --disable-pip-version-check "${PINS[@]}" >"$log" 2>&1; then
  echo "setup-optimum: pip install failed; last lines of $log:" >&2
  tail -n 20 "$log" >&2
  exit 1
fi
echo "$want" >"$stamp"
echo "setup-optimum: installed the optimum pins into $(basename "$venv") (${want:0:12})"

#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU: patch every fixture with every loss, train the
# patched graphs with ONNX Runtime Training on CUDAExecutionProvider and on the CPU, and compare
# parameter gradients (step 1 within 1e-4, norm-relative; later steps within 1e-3) and losses;
# compare the ops `ntl-patch inspect --target cuda-1.19` says fall back to CPU with what ORT logs; and
# run `ntl-patch validate --runtime ort` with the onnxruntime-gpu wheel's libonnxruntime.so.
# The Python part is scripts/gpu_check.py (its docstring has the details).
#
#   scripts/gpu-check.sh [gpu_check.py options: --steps N --models lm_flat --losses ntil ...]
#
# Environment (all optional):
#   NTL_PATCH_BIN    a prebuilt ntl-patch; default: cargo build --release, target/release/ntl-patch
#   GPU_CHECK_VENV   the Python environment to make or reuse (default
#                    ~/.cache/ntl-patch-gpu-check/venv, outside the work tree); it gets
#                    onnxruntime-training==1.19.2 (the CUDA 11.8 build, not -cpu), onnx==1.17.0,
#                    numpy==2.2.6 and the CUDA 11 / cuDNN 8 libraries that build loads
#                    (nvidia-*-cu11 wheels; no system CUDA toolkit needed, only the driver)
#   GPU_CHECK_TORCH  0: leave out torch==2.7.1 and ntloss==0.3.2 (tests/python/requirements.txt;
#                    default 1). The CUDA build of onnxruntime-training imports torch in
#                    `onnxruntime.training` (its ORTModule part), so the check needs torch unless the
#                    environment already has it; the comparison itself is GPU against CPU.
#   GPU_CHECK_ORT    where the onnxruntime-gpu wheel for validate goes (default
#                    ~/.cache/ntl-patch-gpu-check/ort)
#   OUT              report folder (default target/gpu-check/): gpu-check.json
# pip reads its usual variables (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX) for offline
# machines. Without a usable GPU it says so and checks the CPU side only (exit 0; pass
# --require-gpu to make that exit 2). Exit 1 when a comparison fails.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/ntl-patch-gpu-check"
venv="${GPU_CHECK_VENV:-$cache/venv}"
ort_dir="${GPU_CHECK_ORT:-$cache/ort}"
python="${PYTHON:-python3}"
ort_gpu_version="1.31.1" # the ORT C API the `ort` crate (api-31) needs, as scripts/setup-ort.sh

say() { echo "gpu-check: $*"; }

# -- 1. Python environment
pkgs=(
  "onnxruntime-training==1.19.2"
  "onnx==1.17.0"
  "numpy==2.2.6"
  # the CUDA 11.8 / cuDNN 8 libraries libonnxruntime_providers_cuda.so of that wheel loads
  "nvidia-cuda-runtime-cu11==11.8.89"
  "nvidia-cublas-cu11==11.11.3.6"
  "nvidia-cudnn-cu11>=8.9,<9"
  "nvidia-curand-cu11==10.3.0.86"
  "nvidia-cufft-cu11==10.9.0.58"
)
if [[ "${GPU_CHECK_TORCH:-1}" == 1 ]]; then
  pkgs+=("torch==2.7.1" "ntloss==0.3.2")
fi
stamp="$venv/.gpu-check.pkgs"
want="$(printf '%s\n' "${pkgs[@]}")"
if [[ ! -x "$venv/bin/python" ]]; then
  say "creating $venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
fi
if [[ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]]; then
  say "installing ${pkgs[*]} into $venv (log: $venv/pip.log)"
  # onnxruntime-training-cpu and onnxruntime install the same `onnxruntime` package: keep one
  "$venv/bin/python" -m pip uninstall -y -q onnxruntime onnxruntime-training-cpu onnxruntime-gpu >/dev/null 2>&1 || true
  if ! "$venv/bin/python" -m pip install --disable-pip-version-check "${pkgs[@]}" >"$venv/pip.log" 2>&1; then
    tail -n 20 "$venv/pip.log" >&2
    say "pip install failed" >&2
    exit 2
  fi
  echo "$want" >"$stamp"
fi

# -- 2. the ORT C library for `ntl-patch validate --runtime ort`: from the onnxruntime-gpu wheel
dylib="$(ls "$ort_dir"/onnxruntime/capi/libonnxruntime.so.* 2>/dev/null | head -n 1 || true)"
if [[ -z "$dylib" ]]; then
  say "installing onnxruntime-gpu==$ort_gpu_version into $ort_dir"
  if "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps --target "$ort_dir" \
    "onnxruntime-gpu==$ort_gpu_version" >"$venv/pip-ort.log" 2>&1; then
    dylib="$(ls "$ort_dir"/onnxruntime/capi/libonnxruntime.so.* 2>/dev/null | head -n 1 || true)"
  else
    say "onnxruntime-gpu could not be installed (see $venv/pip-ort.log): validate --runtime ort is skipped"
  fi
fi

# -- 3. the binary
bin="${NTL_PATCH_BIN:-}"
if [[ -z "$bin" ]]; then
  if ! command -v cargo >/dev/null; then
    say "no cargo here: build ntl-patch elsewhere and set NTL_PATCH_BIN=/path/to/ntl-patch" >&2
    exit 2
  fi
  say "cargo build --release"
  cargo build --release --locked -q
  bin="$root/target/release/ntl-patch"
fi
[[ -x "$bin" ]] || { say "ntl-patch binary '$bin' is not executable" >&2; exit 2; }

# -- 4. the CUDA 11 libraries from the nvidia-* wheels, for the CUDA provider to load
libdirs="$(ls -d "$venv"/lib/python3*/site-packages/nvidia/*/lib 2>/dev/null | tr '\n' ':' || true)"
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}"
if command -v nvidia-smi >/dev/null; then
  say "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1 || echo 'nvidia-smi failed')"
else
  say "no nvidia-smi on this machine"
fi

# -- 5. the check
exec "$venv/bin/python" "$root/scripts/gpu_check.py" --bin "$bin" --ort-dylib "$dylib" \
  --out "${OUT:-$root/target/gpu-check}" "$@"

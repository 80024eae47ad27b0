#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU. Five parts, each in its own Python environment:
#
#   scripts/gpu/gpu-check.sh [gpu_check.py options: --steps N --models lm_flat --losses ntil ...]
#   scripts/gpu/gpu-check.sh --step [gpu_check_step.py options: --models gpt2_ts --losses ntil --self-test ...]
#   scripts/gpu/gpu-check.sh --dp [--cpu] [gpu_check_dp.py options: --steps N --rtol R]
#   scripts/gpu/gpu-check.sh --precision [--cpu] [gpu_check_precision.py options: --models gpt2_ts --steps N
#                                               --heads dense fused --recompute off layers]
#   scripts/gpu/gpu-check.sh --memory [bench_real_size.py options: --preset qwen0.5b --configs ...]
#
# Default (ORT Training, scripts/gpu/gpu_check.py): patch every fixture with every loss, train the
# patched graphs with ONNX Runtime Training on CUDAExecutionProvider and on the CPU, and compare
# parameter gradients (step 1 within 1e-4, norm-relative; later steps within 1e-3) and losses;
# compare the ops `ntl-patch inspect --target cuda-1.19` says fall back to CPU with what ORT logs; and
# run `ntl-patch validate --runtime ort` with the onnxruntime-gpu wheel's libonnxruntime.so.
#
# --step (the step graph, scripts/gpu/gpu_check_step.py): `ntl-patch step` (AdamW, lr 1e-3) on
# lm_flat, gpt2_ts, gpt2_dynamo, llama_ts and llama_dynamo with wasserstein and ntil (--gumbel-noise 0
# --combine add); 10 steps with python/ntl_patch StepRunner on plain onnxruntime-gpu 1.31.1 (no
# ORT Training, no torch, no onnx), on CUDAExecutionProvider (use_tf32=0) and on CPUExecutionProvider
# with the same batches (fixtures/reference/step/*.npz trajectory batches; seeded ones for
# lm_flat); every per-step loss within 1e-4 (relative) and every final parameter within 1e-4
# (norm-relative, floor 1e-3 * all), leaving out the elements whose float64 reference gradient is
# zero (there AdamW turns pure round-off into +-lr steps; lm_flat: k.bias); ORT's recorded node
# assignment (the session must run on CUDA) against `ntl-patch inspect --target cuda`'s prediction.
# Report OUT/gpu-check-step.json.
#
# --dp (ntl_patch.DataParallel, scripts/gpu/gpu_check_dp.py): needs 2 GPUs; with fewer it says so and
# exits 0 (2 with --require-gpu). `ntl-patch step --split --max-grad-norm 0.5` on lm_flat, then
# `torchrun --nproc-per-node 2`: one process per GPU, onnxruntime on CUDAExecutionProvider
# (use_tf32=0), gradients averaged by NCCL all_reduce on torch tensors sharing the OrtValues' GPU
# memory (DLPack); 10 steps, the state saved after 5 and resumed in new objects. Compared with one
# CPU process that averages both shards' gradients itself: losses and final parameters within 1e-4
# (relative; lm_flat's k.bias, whose exact gradient is zero, left out), the resumed run
# bit-identical. Report OUT/gpu-check-dp.json (+ gpu-check-dp.log). `--dp --cpu`: the same with
# gloo and the CPU provider, on any machine (a dry run of the script). Run three times: unsharded,
# then --shard optimizer and --shard gradients (ZeRO stage 1 / 2: per-shard updates, NCCL reduces
# and per-tensor broadcasts), each against the same reference (gpu-check-dp-<shard>.json).
# --precision (mixed-precision step graphs, scripts/gpu/gpu_check_precision.py): `ntl-patch step
# --precision fp32|fp16|bf16` on gpt2_ts and llama_ts (dense LM head and fused: its projection in the
# half type; with --recompute off layers also with each layer recomputed), 20 AdamW steps with StepRunner on
# CUDAExecutionProvider against torch on the same GPU (autocast + GradScaler for fp16, autocast
# for bf16, plain float32) and the float64 trajectory: equal skipped steps and scales, losses
# within 2u, parameters as close to float64 as torch's (the CPU test's criteria); the step time
# and GPU memory of each precision, graph and torch, in OUT/gpu-check-precision.json. This is
# where bf16 numerics are checked at all (no CPU runtime here runs bfloat16). `--precision
# --cpu`: a dry run on the CPU (fp32 and fp16; onnxruntime's CPU provider computes float16
# nodes in float32).
# --memory (GPU memory, scripts/bench/bench_real_size.py --device cuda): StepRunner on onnxruntime-gpu's
# CUDA provider against torch on CUDA, the same Qwen2-shaped model (random weights, dynamo export),
# CE + 0.3·NTL-WAS and AdamW, each run its own process: peak GPU memory (nvidia-smi memory.used
# above the value before the run), time per step, losses. Default `--preset qwen0.5b --configs
# dense,default,torch --rounds 2` (dense: `ntl-patch step --fused-head off`; a configuration whose
# step graph the binary cannot write is reported, not fatal). Report OUT/gpu-memory.{md,json}.
# Run the parts one after the other for the full check.
# NOTE: PyPI's onnxruntime-gpu 1.31.1 is a CUDA 13.0 build (its build_and_package_info says
# cuda_version 13.0; libonnxruntime_providers_cuda.so needs libcublas.so.13, libcudart.so.13): it
# needs an NVIDIA driver >= 580 (`nvidia-smi` shows "CUDA Version: 13.0" or newer) and gets the
# CUDA 13.0 / cuDNN 9 wheels below; with an older driver the check says the CUDA provider does
# not start and runs the CPU side only.
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
#   GPU_CHECK_STEP_VENV  --step: the environment to make or reuse (default
#                    ~/.cache/ntl-patch-gpu-check/venv-step; venv-step-cpu with GPU_CHECK_STEP_ORT=cpu);
#                    it gets onnxruntime-gpu==1.31.1, numpy==2.2.6 and nvidia-cuda-runtime,
#                    nvidia-cublas, nvidia-cuda-nvrtc, nvidia-nvjitlink (13.0), nvidia-cufft 12.0,
#                    nvidia-curand 10.4, nvidia-cudnn-cu13 9.x (2.2 GB installed; onnxruntime.preload_dlls()
#                    loads them, no LD_LIBRARY_PATH needed)
#   GPU_CHECK_STEP_ORT  --step: `gpu` (default) as above; `cpu`: plain onnxruntime==1.31.1 and
#                    numpy only, for a quick CPU-only dry run (add --self-test to exercise the
#                    comparison code without a GPU)
#   GPU_CHECK_DP_VENV  --dp: the environment to make or reuse (default ~/.cache/ntl-patch-gpu-check/venv-dp;
#                    venv-dp-cpu with --cpu); it gets torch==2.7.1 (PyPI's CUDA 12.6 build, with NCCL
#                    and the nvidia-*-cu12 libraries), onnxruntime-gpu==1.22.0 (a CUDA 12 / cuDNN 9
#                    build, so torch's CUDA 12 libraries serve both: onnxruntime.preload_dlls() loads
#                    them after `import torch`) and numpy==2.2.6; --cpu: onnxruntime==1.31.1 instead
#   GPU_CHECK_DP_ORT   --dp: the onnxruntime package spec instead of onnxruntime-gpu==1.22.0
#   GPU_CHECK_PRECISION_VENV  --precision: the environment (default ~/.cache/ntl-patch-gpu-check/
#                    venv-precision; venv-precision-cpu with --cpu): the --dp packages plus
#                    transformers==5.24.0, tokenizers==0.23.3 and ntloss==0.3.2 (the reference
#                    models and losses, tests/python/requirements.txt's pins)
#   GPU_CHECK_MEM_VENV  --memory: the environment to make or reuse (default
#                    ~/.cache/ntl-patch-gpu-check/venv-mem); it gets the --dp packages (torch 2.7.1
#                    CUDA 12.6, onnxruntime-gpu 1.22.0) and the exporter's: transformers, tokenizers,
#                    onnx, onnxscript, onnx-ir and ntloss at tests/python/requirements.txt's versions
#   OUT              report folder (default target/gpu-check/): gpu-check.json, gpu-check-step.json,
#                    gpu-check-dp.json, gpu-memory.md
# pip reads its usual variables (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX) for offline
# machines. Without a usable GPU it says so and checks the CPU side only (exit 0; pass
# --require-gpu to make that exit 2). Exit 1 when a comparison fails.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/ntl-patch-gpu-check"
venv="${GPU_CHECK_VENV:-$cache/venv}"
ort_dir="${GPU_CHECK_ORT:-$cache/ort}"
python="${PYTHON:-python3}"
ort_gpu_version="1.31.1" # the ORT C API the `ort` crate (api-31) needs, as scripts/setup/setup-ort.sh

say() { echo "gpu-check: $*"; }

# the ntl-patch binary -> $bin
find_bin() {
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
}

# make or reuse venv $1 with the packages $2... (a stamp file records what was installed)
ensure_venv() {
  local v="$1"
  shift
  local stamp="$v/.gpu-check.pkgs" want
  want="$(printf '%s\n' "$@")"
  if [[ ! -x "$v/bin/python" ]]; then
    say "creating $v"
    mkdir -p "$(dirname "$v")"
    "$python" -m venv "$v"
  fi
  if [[ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]]; then
    say "installing $* into $v (log: $v/pip.log)"
    # onnxruntime, onnxruntime-gpu and onnxruntime-training(-cpu) install the same `onnxruntime`
    # package: remove the ones not wanted here
    local other=() name
    for name in onnxruntime onnxruntime-gpu onnxruntime-training onnxruntime-training-cpu; do
      printf '%s\n' "$@" | grep -q "^$name==" || other+=("$name")
    done
    "$v/bin/python" -m pip uninstall -y -q "${other[@]}" >/dev/null 2>&1 || true
    if ! "$v/bin/python" -m pip install --disable-pip-version-check "$@" >"$v/pip.log" 2>&1; then
      tail -n 20 "$v/pip.log" >&2
      say "pip install failed" >&2
      exit 2
    fi
    echo "$want" >"$stamp"
  fi
}

# -- the step graph on plain onnxruntime-gpu (--step)
if [[ "${1:-}" == "--step" ]]; then
  shift
  case "${GPU_CHECK_STEP_ORT:-gpu}" in
    gpu)
      step_venv="${GPU_CHECK_STEP_VENV:-$cache/venv-step}"
      step_pkgs=(
        "onnxruntime-gpu==$ort_gpu_version"
        "numpy==2.2.6"
        # PyPI's onnxruntime-gpu 1.31.1 is built for CUDA 13.0 (its [cuda,cudnn] extras name these
        # packages; cuBLAS comes in through cuDNN there): the CUDA 13.0 update 2 releases, cuDNN 9
        "nvidia-cuda-runtime==13.0.96"
        "nvidia-cublas==13.1.0.3"
        "nvidia-cuda-nvrtc==13.0.88"
        "nvidia-nvjitlink==13.0.88"
        "nvidia-cufft==12.0.0.61"
        "nvidia-curand==10.4.0.35"
        "nvidia-cudnn-cu13==9.14.0.64"
      )
      ;;
    cpu)
      step_venv="${GPU_CHECK_STEP_VENV:-$cache/venv-step-cpu}"
      step_pkgs=("onnxruntime==$ort_gpu_version" "numpy==2.2.6")
      ;;
    *)
      say "GPU_CHECK_STEP_ORT must be gpu or cpu, not '${GPU_CHECK_STEP_ORT}'" >&2
      exit 2
      ;;
  esac
  ensure_venv "$step_venv" "${step_pkgs[@]}"
  find_bin
  if command -v nvidia-smi >/dev/null; then
    say "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1 || echo 'nvidia-smi failed')"
  else
    say "no nvidia-smi on this machine"
  fi
  exec "$step_venv/bin/python" "$root/scripts/gpu/gpu_check_step.py" --bin "$bin" \
    --out "${OUT:-$root/target/gpu-check}" "$@"
fi

# -- DataParallel on 2 GPUs with NCCL (--dp)
if [[ "${1:-}" == "--dp" ]]; then
  shift
  cpu="" require=""
  dp_args=()
  for a in "$@"; do
    case "$a" in
      --cpu) cpu=1; dp_args+=("$a") ;;
      --require-gpu) require=1 ;;
      *) dp_args+=("$a") ;;
    esac
  done
  if [[ -z "$cpu" ]]; then
    ngpu=0
    if command -v nvidia-smi >/dev/null; then
      ngpu="$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU ' || true)"
    fi
    if (( ngpu < 2 )); then
      say "DataParallel: the 2-process NCCL run is skipped: it needs 2 GPUs and this machine has ${ngpu} (nvidia-smi --list-gpus)"
      [[ -n "$require" ]] && exit 2
      exit 0
    fi
    say "DataParallel: $ngpu GPUs; 2 processes, NCCL"
    dp_venv="${GPU_CHECK_DP_VENV:-$cache/venv-dp}"
    dp_pkgs=("torch==2.7.1" "${GPU_CHECK_DP_ORT:-onnxruntime-gpu==1.22.0}" "numpy==2.2.6")
  else
    dp_venv="${GPU_CHECK_DP_VENV:-$cache/venv-dp-cpu}"
    dp_pkgs=("torch==2.7.1" "${GPU_CHECK_DP_ORT:-onnxruntime==$ort_gpu_version}" "numpy==2.2.6")
  fi
  ensure_venv "$dp_venv" "${dp_pkgs[@]}"
  find_bin
  # unsharded, then ZeRO stage 1 and 2 (DataParallel shard=...): each against the same reference
  status=0
  for shard in none optimizer gradients; do
    "$dp_venv/bin/python" "$root/scripts/gpu/gpu_check_dp.py" --bin "$bin" --shard "$shard" \
      --out "${OUT:-$root/target/gpu-check}" ${dp_args[@]+"${dp_args[@]}"} || { rc=$?; if (( rc > status )); then status=$rc; fi; }
  done
  exit "$status"
fi

# -- mixed-precision step graphs against torch autocast (--precision)
if [[ "${1:-}" == "--precision" ]]; then
  shift
  cpu=""
  for a in "$@"; do [[ "$a" == "--cpu" ]] && cpu=1; done
  ref_pkgs=("numpy==2.2.6" "transformers==5.24.0" "tokenizers==0.23.3" "ntloss==0.3.2")
  if [[ -z "$cpu" ]]; then
    p_venv="${GPU_CHECK_PRECISION_VENV:-$cache/venv-precision}"
    p_pkgs=("torch==2.7.1" "onnxruntime-gpu==1.22.0" "${ref_pkgs[@]}")
  else
    p_venv="${GPU_CHECK_PRECISION_VENV:-$cache/venv-precision-cpu}"
    p_pkgs=("torch==2.7.1" "onnxruntime==$ort_gpu_version" "${ref_pkgs[@]}")
  fi
  ensure_venv "$p_venv" "${p_pkgs[@]}"
  find_bin
  if command -v nvidia-smi >/dev/null; then
    say "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1 || echo 'nvidia-smi failed')"
  fi
  # onnxruntime-gpu 1.22 loads the CUDA 12 / cuDNN 9 libraries torch brings (preload_dlls)
  exec "$p_venv/bin/python" -c 'import torch, onnxruntime as o, runpy, sys
getattr(o, "preload_dlls", lambda: None)()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")' "$root/scripts/gpu/gpu_check_precision.py" --bin "$bin" \
    --out "${OUT:-$root/target/gpu-check}" "$@"
fi

# -- GPU memory of StepRunner against torch (--memory)
if [[ "${1:-}" == "--memory" ]]; then
  shift
  mem_venv="${GPU_CHECK_MEM_VENV:-$cache/venv-mem}"
  ensure_venv "$mem_venv" "torch==2.7.1" "onnxruntime-gpu==1.22.0" "numpy==2.2.6" "transformers==5.24.0" \
    "tokenizers==0.23.3" "onnx==1.17.0" "onnxscript==0.3.1" "onnx-ir==1.1.0" "ntloss==0.3.2"
  find_bin
  command -v nvidia-smi >/dev/null || { say "--memory needs nvidia-smi (an NVIDIA GPU)" >&2; exit 2; }
  say "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -n 1)"
  out="${OUT:-$root/target/gpu-check}"
  mkdir -p "$out"
  exec "$mem_venv/bin/python" "$root/scripts/bench/bench_real_size.py" --device cuda --python "$mem_venv/bin/python" \
    --bin "$bin" --preset qwen0.5b --rounds 2 --force --workdir "$out/memory" \
    --markdown "$out/gpu-memory.md" --json "$out/gpu-memory.json" "$@"
fi

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
ensure_venv "$venv" "${pkgs[@]}"

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
find_bin

# -- 4. the CUDA 11 libraries from the nvidia-* wheels, for the CUDA provider to load
libdirs="$(ls -d "$venv"/lib/python3*/site-packages/nvidia/*/lib 2>/dev/null | tr '\n' ':' || true)"
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}"
if command -v nvidia-smi >/dev/null; then
  say "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1 || echo 'nvidia-smi failed')"
else
  say "no nvidia-smi on this machine"
fi

# -- 5. the check
exec "$venv/bin/python" "$root/scripts/gpu/gpu_check.py" --bin "$bin" --ort-dylib "$dylib" \
  --out "${OUT:-$root/target/gpu-check}" "$@"

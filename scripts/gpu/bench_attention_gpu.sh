#!/usr/bin/env bash
# Issue 33's GPU benchmark, prepared for one run of at most ~9.5 minutes on one H200 (an offline
# machine with torch but no onnxruntime-gpu: /work/shared/gpu/README.md): the step graph with the
# exported attention (`--attention eager`) and with blockwise attention (`--attention chunked`)
# against torch + transformers with SDPA, at the Qwen2-0.5B shape (scripts/bench/bench_real_size.py
# --preset qwen0.5b --device cuda; CE + 0.3·NTL-WAS, AdamW, random weights, one process per run):
#
#   A  bf16, B 4, T 512:                 chunked, chunked-mt, eager, torch-sdpa (baseline torch-sdpa)
#   B  bf16, B 1, T 4096:                chunked, torch-sdpa (eager: BENCH_B_CONFIGS; measured 2026-12-04)
#      bf16 + recomputation, B 1, T 4096: chunked-rc (--recompute layers), torch-sdpa-ckpt
#   C  float32 strict, B 4, T 512:       chunked, chunked-mt, torch (eager attention) (baseline torch)
#   L  LoRA r 16, float32 strict, B 4, T 512: lora, lora-mt, peft              (baseline peft)
#      (-mt: the optimizer update over flat buckets of 32 MiB, `step --update-bucket 32`)
#   O  bf16, B 1, T 4096, exported at opset 23: onnx, onnx-rc (`--attention onnx`: the forward as the
#      ONNX Attention operator, a fused kernel in onnxruntime-gpu; its backward reads only the keys
#      the masks leave each block), torch-sdpa (B has chunked)
#   S  the longest bf16 sequence at B 1 with recomputation: chunked-rc against torch-sdpa-ckpt,
#      T from 16384 doubling to 131072, one bisection step (scripts/bench/longest_sequence.py: one
#      export with the length dynamic, a try = one process of 2 steps, a try past 90 s fails);
#      what the deadline leaves it reads "at least" (BENCH_PARTS=S: the search alone, ~5 minutes)
#   E  bf16, B 1, T 4096, the model exported with transformers' default attention (SDPA) at opset 23, which
#      torch >= 2.9's dynamo exporter writes as the ONNX Attention operator: `default` keeps that fused forward
#      (the blockwise backward, the operator in bf16 as autocast runs SDPA), torch-sdpa (the log says what the
#      export holds: `attention` in the step's summary)
#   M  B's chunked and chunked-rc again with onnxruntime's own CUDA arena (`--gpu-arena pow2`: each
#      region it adds twice the last) where StepRunner's grows by each request: what the arena holds
#   A2 A once more when the deadline leaves time for it (a second round, its own tables)
#
# --steps 5, the median over steps 3-5 (--warmup 2); --tf32 off: onnxruntime's CUDA provider gets
# use_tf32=0 and torch strict float32 matmuls (bf16 runs: the float32 rest of the graph alike).
# GPU memory: the device's used memory above the value before each run, sampled by the driver (NVML).
# The environment check also prints what the CUDA Attention kernel gives a query row whose every key
# is masked (zeros, or the mean of V as microsoft/onnxruntime#28904 reports), float32 and float16.
#
#   scripts/gpu/bench_attention_gpu.sh [PARTS_DIR ...]
#
# PARTS_DIR: folders holding the parts of /work/shared/gpu/pack_onnxruntime_gpu.sh's onnxruntime-gpu
# 1.31.1 (ortpart.NN, taken by name from all of them, and ort.sha256); default .dev/ortgpu and /tmp.
# They are joined, checked against ort.sha256 and unpacked into /tmp/site (skipped when /tmp/site
# already holds onnxruntime 1.31.1 from an earlier call); the wheels in .dev/wheels (ntloss, loguru:
# what the image lacks) are installed with `pip install --no-index --no-deps --target /tmp/site`;
# PYTHONPATH=/tmp/site. The workers `import torch` before onnxruntime and call
# onnxruntime.preload_dlls() (bench_real_size.py's runner_step): torch's CUDA 13 libraries serve both.
# The binary: .dev/ntl-patch.xz (strip + xz: ~6 MB) or .dev/ntl-patch (NTL_PATCH_BIN overrides).
#
# Env: OUT (results: logs, .md, .json; default target/gpu-bench-attention), BENCH_WORK (exports and
# step graphs, ~2-10 GB a shape; default /tmp/bench-attention), BENCH_DEADLINE_S (seconds from the
# start within which every benchmark must end, default 540: later parts get what is left and are
# killed with their workers when it runs out), BENCH_THREADS (CPU threads of torch / onnxruntime, 8),
# BENCH_ATTENTION_BLOCK (passed as --attention-block N when set), BENCH_PARTS (which of
# A P B PB C L O S E M A2 to run, default "A B C L O S E M A2" in that order: the profiles (P: scripts/gpu/profile_step.py
# on A's chunked step graph; PB: its --kernels on B's) ran on 2026-12-04 and are asked for by name),
# BENCH_A_CONFIGS / BENCH_B_CONFIGS / BENCH_O_CONFIGS / BENCH_E_CONFIGS (the configurations of parts A, B, O, E),
# BENCH_EXTRA_CONFIGS (",NAME" appended to B's) with BENCH_STEP_CONFIG (one --step-config NAME=ARGS).
# $OUT ends with summary.md, bench-attention.log and all.tgz (every table, JSON and log): the device
# tool brings back at most 8 files.
set -uo pipefail

t_start=$(date +%s)
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
out="${OUT:-$root/target/gpu-bench-attention}"
work="${BENCH_WORK:-/tmp/bench-attention}"
deadline=$((t_start + ${BENCH_DEADLINE_S:-540}))
threads="${BENCH_THREADS:-8}"
parts_to_run=" ${BENCH_PARTS:-A B C L O S E M A2} "
extra_configs="${BENCH_EXTRA_CONFIGS:-}"   # e.g. ",chunked4k": more configurations of part B
extra_args=()
[[ -n "${BENCH_STEP_CONFIG:-}" ]] && extra_args+=(--step-config "$BENCH_STEP_CONFIG")
mkdir -p "$out" "$work"
log="$out/bench-attention.log"
say() { echo "bench-attention: $*" | tee -a "$log"; }
elapsed() { echo $(($(date +%s) - t_start)); }

say "start $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 | tee -a "$log"

# -- 1. onnxruntime-gpu from its parts, the wheels the image lacks
site=/tmp/site
if python3 -c "import sys; sys.path.insert(0, '$site'); import onnxruntime as o; assert o.__version__ == '1.31.1' and o.__file__.startswith('$site')" 2>/dev/null; then
  say "onnxruntime 1.31.1 already in $site"
else
  dirs=("$@")
  [[ ${#dirs[@]} -gt 0 ]] || dirs=(.dev/ortgpu /tmp)
  declare -A part=()
  sumfile=""
  for d in "${dirs[@]}"; do
    for f in "$d"/ortpart.[0-9][0-9]; do
      [[ -f "$f" ]] && [[ -z "${part[$(basename "$f")]:-}" ]] && part[$(basename "$f")]="$f"
    done
    [[ -z "$sumfile" && -f "$d/ort.sha256" ]] && sumfile="$d/ort.sha256"
  done
  names=$(printf '%s\n' "${!part[@]}" | sort)
  say "onnxruntime-gpu parts: $(for n in $names; do echo -n "${part[$n]} ($(stat -L -c %s "${part[$n]}") B) "; done)"
  [[ -n "$sumfile" ]] || { say "no ort.sha256 in ${dirs[*]}"; exit 2; }
  [[ -n "$names" ]] || { say "no ortpart.NN in ${dirs[*]}"; exit 2; }
  for n in $names; do cat "${part[$n]}"; done > /tmp/ort.tar.xz
  want=$(awk '{print $1}' "$sumfile")
  have=$(sha256sum /tmp/ort.tar.xz | awk '{print $1}')
  if [[ "$want" != "$have" ]]; then
    say "sha256 mismatch: ort.tar.xz is $have, $sumfile says $want (a part missing or cut?)"
    exit 2
  fi
  say "sha256 ok ($have)"
  rm -rf "$site" && mkdir -p "$site" && tar xJf /tmp/ort.tar.xz -C "$site" && rm -f /tmp/ort.tar.xz
fi
if ls .dev/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --disable-pip-version-check --root-user-action=ignore --target "$site" --upgrade \
    .dev/wheels/*.whl 2>&1 | grep -v "^WARNING: Target directory" | tee -a "$log"
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

# -- 2. the binary
bin="${NTL_PATCH_BIN:-}"
if [[ -z "$bin" ]]; then
  bin=/tmp/ntl-patch
  if [[ -f .dev/ntl-patch.xz ]]; then
    xz -dc .dev/ntl-patch.xz > "$bin"
  elif [[ -f .dev/ntl-patch ]]; then
    cp .dev/ntl-patch "$bin"
  else
    say "no .dev/ntl-patch(.xz) and no NTL_PATCH_BIN"; exit 2
  fi
  chmod +x "$bin"
fi
say "$("$bin" --version 2>&1)"
if "$bin" step --help 2>/dev/null | grep -q -- "--attention"; then
  say "the binary has step --attention"
else
  say "the binary has no step --attention: the eager/chunked step configurations will be reported as not written"
fi

# -- 3. the environment: torch first, then onnxruntime-gpu, preload_dlls, a CUDA session
python3 - <<'EOF' 2>&1 | tee -a "$log" "$out/env.txt"
import sys, importlib
import torch
import onnxruntime as ort
if hasattr(ort, "preload_dlls"):
    ort.preload_dlls()
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print("onnxruntime", ort.__version__, ort.__file__, ort.get_available_providers())
for name in ("transformers", "onnx", "onnxscript", "peft", "ntloss", "numpy", "tokenizers"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:
        print(name, "missing:", type(e).__name__, e)
import onnx
from onnx import TensorProto, helper
g = helper.make_graph([helper.make_node("MatMul", ["a", "a"], ["b"])], "g",
                      [helper.make_tensor_value_info("a", TensorProto.FLOAT, [64, 64])],
                      [helper.make_tensor_value_info("b", TensorProto.FLOAT, [64, 64])])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
m.ir_version = 8
import numpy as np
s = ort.InferenceSession(m.SerializeToString(), providers=[("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"])
s.run(None, {"a": np.ones((64, 64), np.float32)})
print("CUDA session:", s.get_providers()[0], "use_tf32 =", s.get_provider_options().get("CUDAExecutionProvider", {}).get("use_tf32"))
# what the CUDA Attention kernel gives a query row whose every key is masked (row 0): zeros (as the
# step's backward and torch take it, and the step's --attention onnx forward writes after it) or
# the mean of V (microsoft/onnxruntime#28904); row 1 sees every key
for dtype, np_t in ((TensorProto.FLOAT, np.float32), (TensorProto.FLOAT16, np.float16)):
    for kind in ("bool", "-inf"):
        try:
            mt = TensorProto.BOOL if kind == "bool" else dtype
            node = helper.make_node("Attention", ["q", "k", "v", "m"], ["o"])
            g = helper.make_graph([node], "g", [helper.make_tensor_value_info(x, dtype, [1, 2, 2, 64]) for x in "qkv"]
                                  + [helper.make_tensor_value_info("m", mt, [2, 2])], [helper.make_tensor_value_info("o", dtype, None)])
            m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
            m.ir_version = 10
            s = ort.InferenceSession(m.SerializeToString(), providers=["CUDAExecutionProvider"])
            rng = np.random.default_rng(0)
            q, k, v = (rng.standard_normal((1, 2, 2, 64)).astype(np_t) for _ in range(3))
            mask = np.array([[False, False], [True, True]]) if kind == "bool" else np.array([[-np.inf] * 2, [0, 0]], np_t)
            o = s.run(None, {"q": q, "k": k, "v": v, "m": mask})[0].astype(np.float32)
            mean = v.astype(np.float32).mean(axis=2)
            print(f"Attention {np_t.__name__} {kind} mask, a row with every key masked:",
                  "zeros" if np.all(o[:, :, 0] == 0) else "mean of V" if np.allclose(o[:, :, 0], mean, atol=1e-2)
                  else "NaN" if np.isnan(o[:, :, 0]).any() else f"other {o[0, 0, 0, :3]}")
        except Exception as e:
            print(f"Attention {np_t.__name__} {kind} mask: {type(e).__name__}: {str(e)[:160]}")
EOF
say "setup done after $(elapsed) s"

# -- 4. the benchmarks
common=(--preset qwen0.5b --device cuda --python "$(command -v python3)" --bin "$bin" --force --reuse
        --threads "$threads" --steps 5 --warmup 2 --tf32 off)
[[ -n "${BENCH_ATTENTION_BLOCK:-}" ]] && common+=(--attention-block "$BENCH_ATTENTION_BLOCK")

# bench NAME ARGS...: one bench_real_size.py invocation, killed (with its workers) at the deadline
bench() {
  local name=$1
  shift
  local left=$((deadline - $(date +%s)))
  if ((left < 30)); then
    say "$name: skipped, $left s left before the deadline"
    return
  fi
  say "$name: start at $(elapsed) s, $left s left"
  # timeout signals its whole process group: the driver and the runs it started
  timeout -k 10 "$left" python3 scripts/bench/bench_real_size.py "${common[@]}" "$@" \
    --markdown "$out/$name.md" --json "$out/$name.json" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  say "$name: exit $rc after $(elapsed) s$([[ $rc == 124 ]] && echo ' (deadline: see its log for the runs it finished)')"
}

if [[ "$parts_to_run" == *" A "* ]]; then
  bench bf16-b4-t512 --batch 4 --seq 512 --precision bf16 --configs "${BENCH_A_CONFIGS:-chunked,chunked-mt,eager,torch-sdpa}" \
    --baseline-config torch-sdpa --rounds 1 --workdir "$work/b4-t512"
fi
if [[ "$parts_to_run" == *" P "* ]] && [[ -f "$work/b4-t512/model.chunked.step.onnx" ]]; then
  # where the short-sequence step's time goes (issue 33, item 2): onnxruntime's profiler by op type
  say "profile: start at $(elapsed) s"
  timeout -k 5 90 python3 scripts/gpu/profile_step.py "$work/b4-t512/model.chunked.step.onnx" --batch 4 --seq 512 \
    --device cuda --steps 3 --json "$out/profile-bf16-b4-t512.json" 2>&1 | tee "$out/profile-bf16-b4-t512.md"
  say "profile: exit ${PIPESTATUS[0]} after $(elapsed) s"
fi
if [[ "$parts_to_run" == *" B "* ]]; then
  # chunked-rc is compared with torch-sdpa-ckpt (the baseline's checkpointing variant)
  bench bf16-b1-t4096 --batch 1 --seq 4096 --precision bf16 \
    --configs "${BENCH_B_CONFIGS:-chunked,torch-sdpa,chunked-rc,torch-sdpa-ckpt}$extra_configs" \
    "${extra_args[@]}" --baseline-config torch-sdpa --rounds 1 --workdir "$work/b1-t4096"
  if [[ "$parts_to_run" == *" PB "* ]] && [[ -f "$work/b1-t4096/model.chunked.step.onnx" ]]; then
    say "kernel profile B: start at $(elapsed) s"
    timeout -k 5 90 python3 scripts/gpu/profile_step.py "$work/b1-t4096/model.chunked.step.onnx" --batch 1 \
      --seq 4096 --device cuda --steps 2 --kernels --top 25 2>&1 | tee "$out/kernels-bf16-b1-t4096.md"
    say "kernel profile B: exit ${PIPESTATUS[0]} after $(elapsed) s"
  fi
fi
if [[ "$parts_to_run" == *" C "* ]]; then
  bench fp32-b4-t512 --batch 4 --seq 512 --configs chunked,chunked-mt,torch --baseline-config torch --rounds 1 \
    --workdir "$work/b4-t512"
fi
if [[ "$parts_to_run" == *" L "* ]]; then
  bench lora-fp32-b4-t512 --batch 4 --seq 512 --configs lora,lora-mt,peft --peft-of lora --baseline-config peft \
    --rounds 1 --workdir "$work/b4-t512"
fi
if [[ "$parts_to_run" == *" O "* ]]; then
  bench bf16-b1-t4096-onnx --batch 1 --seq 4096 --precision bf16 --opset 23 \
    --configs "${BENCH_O_CONFIGS:-onnx,onnx-rc,torch-sdpa}" --baseline-config torch-sdpa --rounds 1 \
    --workdir "$work/b1-t4096-op23"
fi
if [[ "$parts_to_run" == *" S "* ]]; then
  left=$((deadline - $(date +%s)))
  if ((left < 60)); then
    say "longest: skipped, $left s left before the deadline"
  else
    say "longest: start at $(elapsed) s, $left s left"
    timeout -k 10 "$left" python3 scripts/bench/longest_sequence.py --preset qwen0.5b --device cuda --precision bf16 \
      --python "$(command -v python3)" --bin "$bin" --force --reuse --threads "$threads" --tf32 off \
      --configs chunked-rc,torch-sdpa-ckpt --start 16384 --max 131072 --refine 1 --try-timeout-s 90 \
      --deadline-s $((left - 10)) --workdir "$work/longest" --markdown "$out/longest-bf16-b1.md" \
      --json "$out/longest-bf16-b1.json" 2>&1 | tee "$out/longest-bf16-b1.log"
    say "longest: exit ${PIPESTATUS[0]} after $(elapsed) s"
  fi
fi
if [[ "$parts_to_run" == *" E "* ]]; then
  bench bf16-b1-t4096-sdpa-export --batch 1 --seq 4096 --precision bf16 --opset 23 --export-attention sdpa \
    --configs "${BENCH_E_CONFIGS:-default,torch-sdpa}" --baseline-config torch-sdpa --rounds 1 \
    --workdir "$work/b1-t4096-sdpa23"
fi
if [[ "$parts_to_run" == *" M "* ]]; then
  bench bf16-b1-t4096-pow2 --batch 1 --seq 4096 --precision bf16 --gpu-arena pow2 --configs chunked,chunked-rc \
    --rounds 1 --workdir "$work/b1-t4096"
fi
if [[ "$parts_to_run" == *" A2 "* ]] && (($(date +%s) + 100 < deadline)); then
  bench bf16-b4-t512-round2 --batch 4 --seq 512 --precision bf16 --configs torch-sdpa,eager,chunked \
    --baseline-config torch-sdpa --rounds 1 --workdir "$work/b4-t512"
fi

# -- 5. the summary tables of every part, in one file
{
  for f in bf16-b4-t512 bf16-b1-t4096 bf16-b1-t4096-pow2 fp32-b4-t512 lora-fp32-b4-t512 bf16-b1-t4096-onnx bf16-b1-t4096-sdpa-export bf16-b4-t512-round2; do
    [[ -f "$out/$f.md" ]] || continue
    echo "## $f"
    echo
    head -n 1 "$out/$f.md"
    echo
    awk '/^\| configuration \| what /{on=1} on&&/^$/{exit} on' "$out/$f.md"
    awk '/^MFU = /' "$out/$f.md"
    echo
  done
  if [[ -f "$out/longest-bf16-b1.md" ]]; then
    echo "## longest-bf16-b1"
    echo
    cat "$out/longest-bf16-b1.md"
  fi
} > "$out/summary.md"
cat "$out/summary.md"
say "done after $(elapsed) s"
(cd "$out" && tar czf /tmp/all.tgz --exclude=all.tgz . && find . -maxdepth 1 -type f ! -name summary.md \
  ! -name bench-attention.log -delete && mv /tmp/all.tgz all.tgz)

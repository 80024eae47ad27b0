#!/usr/bin/env python3
"""Extract the kernels ONNX Runtime's CUDA, ROCm (and CPU) execution providers register, from ORT's source.

Writes the tables `ntl-patch inspect --target ...` embeds (data/README.md has the exact commands and
source commits of the committed ones):

    data/ort-1.19-kernels.tsv          cuda-1.19, rocm-1.19 (onnxruntime-training 1.19.2)
    data/ort-1.31.1-cuda-kernels.tsv   cuda (onnxruntime-gpu 1.31.1)
    data/ort-1.22.2-rocm-kernels.tsv   rocm (onnxruntime-rocm 1.22.2)
    data/ort-1.27.1-migraphx-ops.tsv   migraphx (onnxruntime-migraphx 1.27.1), with --migraphx

Usage (from the repository root; needs python3 >= 3.8 and a C preprocessor, `cpp`):

    ORT_SRC=/path/to/onnxruntime scripts/gen/gen_kernel_table.py [-o data/ort-1.19-kernels.tsv]
    ORT_SRC=... scripts/gen/gen_kernel_table.py --providers cuda,cpu --build inference \
        --cuda-version 13000 --release "onnxruntime-gpu 1.31.1" -o data/ort-1.31.1-cuda-kernels.tsv
    ORT_SRC=... scripts/gen/gen_kernel_table.py --migraphx --release "onnxruntime-migraphx 1.27.1" \
        -o data/ort-1.27.1-migraphx-ops.tsv

ORT_SRC is a checkout of https://github.com/microsoft/onnxruntime at the release to describe
(the 1.19 table: tag v1.19.2, commit ffceed9d44f2f3efb9dd69fa75fea51163c91d91). Only its
C++ sources (`onnxruntime/`, `orttraining/`, `include/`, `cmake/`) are read; nothing is built.
--build inference evaluates the #if conditions for the inference wheels (no training ops: the
orttraining registration lists are skipped); --build training (default) for onnxruntime-training.

The MIGraphX provider registers no kernels: --migraphx reads its supported-op list
(`mgx_supported_ops` in GetUnsupportedNodeIndices), the ops IsUnsupportedOpMode has a rule for,
the element types IsTypeSupported accepts and GetCapability's unsupported-node limit from
onnxruntime/core/providers/migraphx/migraphx_execution_provider.cc. The rules themselves are
code, modelled in src/tools/gpu_kernels.rs (`migraphx` module).

What is read:
1. The registration lists, which say WHICH kernels exist (op, domain, version range, the type
   in the kernel class name) and under which preprocessor condition:
     cuda: onnxruntime/core/providers/cuda/cuda_execution_provider.cc,
           onnxruntime/contrib_ops/cuda/cuda_contrib_kernels.cc,
           orttraining/orttraining/training_ops/cuda/cuda_training_kernels.cc
     rocm: the same three files under .../rocm/ (rocm_execution_provider.cc, ...),
     cpu:  the same three under .../cpu/ (cpu_execution_provider.cc, ...): a node without a GPU
           kernel runs there, and ORT inlines an ONNX function op only when no provider claims it.
   Conditions are evaluated for the onnxruntime-training GPU wheels (BUILD_DEFINES below); rows
   outside that build are dropped, rows under a condition keep it in the `condition` column.
2. The kernel definitions (`ONNX_OPERATOR_*KERNEL_EX(...)` with their KernelDefBuilder), which
   say which TYPES each kernel accepts (`.TypeConstraint("T", ...)`). Registration macros are
   expanded with the system C preprocessor: every kernel .cc is preprocessed with its includes
   replaced by the preprocessor directives of the ORT headers they name (so the helper macros
   those headers define are there, and no system or CUDA header is needed), and with
   ORT's ONNX_OPERATOR_*KERNEL_EX macros replaced by markers. The markers are joined with the
   registration lists by kernel class name, exactly as ORT's linker does.
   ROCm kernels are mostly generated from the CUDA sources at build time by hipify
   (cmake/onnxruntime_rocm_hipify.cmake, tools/ci_build/amd_hipify.py): for ROCm the CUDA
   sources not in the hipify exclusion lists are read with kCudaExecutionProvider replaced by
   kRocmExecutionProvider, next to the hand-written sources under .../rocm/.

Output columns (tab-separated, one kernel per row, sorted):
    provider   cuda | rocm | cpu
    domain     ai.onnx | com.microsoft | ai.onnx.ml | org.pytorch.aten | ...
    op         operator name
    since      first opset version of the kernel
    end        last opset version, or `-` for an open-ended kernel (ORT then matches a node only
               when the node's op version EQUALS `since`: kernel_registry.cc VerifyVersion)
    class_type the type(s) in the kernel class name (`float`, `int64_t_float_int64_t`, `float,int64_t`
               for two-typed kernels) or `-`
    constraints `T=float,double;Tind=int32,int64`: each type constraint of the kernel and its
               ONNX element types (`seq(float)` for sequences, `opt(...)` for optionals); `?` when
               the expression could not be resolved (then only op and version are checked)
    cpu_memory `in:1,2;out:0`: inputs/outputs the kernel keeps in CPU memory (InputMemoryType /
               OutputMemoryType), which ORT's GetCpuPreferredNodes uses; `-` when none
    condition  preprocessor condition of the registration (`-` when unconditional)
    source     the file holding the kernel definition (relative to ORT_SRC; rocm rows from hipified
               CUDA sources name the CUDA file)
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# The configurations the tables describe (--build). Everything not named is undefined:
# DISABLE_CONTRIB_OPS, DISABLE_FLOAT8_TYPES, USE_CUDA_MINIMAL, ENABLE_CUDA_NHWC_OPS, USE_TRITON_KERNEL,
# ENABLE_TRITON, USE_MPI, _WIN32.
BUILDS = {
    # the onnxruntime-training 1.19 GPU wheels (Linux), built with --enable_training (ENABLE_TRAINING,
    # ENABLE_TRAINING_OPS, ENABLE_TRAINING_CORE, ENABLE_STRIDED_TENSORS), torch interop and ATen
    # (ORTModule), and NCCL
    "training": ("onnxruntime-training GPU wheel configuration", {
        "ENABLE_TRAINING": "1",
        "ENABLE_TRAINING_OPS": "1",
        "ENABLE_TRAINING_CORE": "1",
        "ENABLE_TRAINING_APIS": "1",
        "ENABLE_STRIDED_TENSORS": "1",
        "ENABLE_TRAINING_TORCH_INTEROP": "1",
        "ENABLE_ATEN": "1",
        "ORT_USE_NCCL": "1",
        "SHARED_PROVIDER": "1",
        "ORT_API_MANUAL_INIT": "1",
        "NDEBUG": "1",
    }),
    # the inference wheels (onnxruntime-gpu, onnxruntime-rocm): no training ops, no ATen, no NCCL
    "inference": ("inference GPU wheel configuration (onnxruntime-gpu / onnxruntime-rocm)", {
        "SHARED_PROVIDER": "1",
        "ORT_API_MANUAL_INIT": "1",
        "NDEBUG": "1",
    }),
}
BUILD_DEFINES = BUILDS["training"][1]
PROVIDER_DEFINES = {
    # --cuda-version replaces CUDA_VERSION / CUDART_VERSION (12020 for the 1.19 training wheels,
    # 13000 for onnxruntime-gpu 1.31, which is built with CUDA 13.0)
    "cuda": {"USE_CUDA": "1", "CUDA_VERSION": "12020", "CUDNN_MAJOR": "9", "CUDNN_VERSION": "90100",
             "CUDART_VERSION": "12020"},
    "rocm": {"USE_ROCM": "1", "__HIP_PLATFORM_AMD__": "1", "ROCM_VERSION": "60000",
             "HIP_VERSION": "60000000"},
    # the CPU provider is built into the core library, not as a shared provider
    "cpu": {},
}

REGISTRY_FILES = {
    "cuda": [
        "onnxruntime/core/providers/cuda/cuda_execution_provider.cc",
        "onnxruntime/contrib_ops/cuda/cuda_contrib_kernels.cc",
        "orttraining/orttraining/training_ops/cuda/cuda_training_kernels.cc",
    ],
    "rocm": [
        "onnxruntime/core/providers/rocm/rocm_execution_provider.cc",
        "onnxruntime/contrib_ops/rocm/rocm_contrib_kernels.cc",
        "orttraining/orttraining/training_ops/rocm/rocm_training_kernels.cc",
    ],
    # the CPU provider: where a node without a GPU kernel goes (and whether ORT may instead
    # inline an ONNX function op: only when no provider, the CPU included, claims it)
    "cpu": [
        "onnxruntime/core/providers/cpu/cpu_execution_provider.cc",
        "onnxruntime/contrib_ops/cpu/cpu_contrib_kernels.cc",
        "orttraining/orttraining/training_ops/cpu/cpu_training_kernels.cc",
    ],
}
# (cuda source tree, hipify exclusion list name in cmake/onnxruntime_rocm_hipify.cmake)
KERNEL_TREES = [
    ("onnxruntime/core/providers", "provider_excluded_files"),
    ("onnxruntime/contrib_ops", "contrib_ops_excluded_files"),
    ("orttraining/orttraining/training_ops", "training_ops_excluded_files"),
]
PROVIDER_CONST = {"cuda": "kCudaExecutionProvider", "rocm": "kRocmExecutionProvider", "cpu": "kCpuExecutionProvider"}

DOMAINS = {
    "kOnnxDomain": "ai.onnx",
    "kMSDomain": "com.microsoft",
    "kMLDomain": "ai.onnx.ml",
    "kPytorchAtenDomain": "org.pytorch.aten",
    "kMSInternalNHWCDomain": "com.ms.internal.nhwc",
    "kMSExperimentalDomain": "com.microsoft.experimental",
    "kMSNchwcDomain": "com.microsoft.nchwc",
    "kMSDmlDomain": "com.microsoft.dml",
}

# C++ element types -> ONNX type names
CPP_TYPES = {
    "float": "float", "double": "double", "double_t": "double", "MLFloat16": "float16",
    "BFloat16": "bfloat16", "int8_t": "int8", "int16_t": "int16", "int32_t": "int32",
    "int64_t": "int64", "uint8_t": "uint8", "uint16_t": "uint16", "uint32_t": "uint32",
    "uint64_t": "uint64", "bool": "bool", "std::string": "string", "string": "string",
    "Float8E4M3FN": "float8e4m3fn", "Float8E4M3FNUZ": "float8e4m3fnuz",
    "Float8E5M2": "float8e5m2", "Float8E5M2FNUZ": "float8e5m2fnuz",
    "Int4x2": "int4", "UInt4x2": "uint4", "Int2x4": "int2", "UInt2x4": "uint2", "Float4E2M1x2": "float4e2m1", "half": "float16", "__half": "float16",
    "nv_bfloat16": "bfloat16", "onnxruntime::MLFloat16": "float16", "onnxruntime::BFloat16": "bfloat16",
}

MARK_CLASS_MACROS = r"""
#define ONNX_OPERATOR_KERNEL_CLASS_NAME(provider, domain, ver, name) provider##_##name##_##domain##_ver##ver
#define ONNX_OPERATOR_VERSIONED_KERNEL_CLASS_NAME(provider, domain, startver, endver, name) provider##_##name##_##domain##_ver##startver##_##endver
#define ONNX_OPERATOR_TYPED_KERNEL_CLASS_NAME(provider, domain, ver, type, name) provider##_##name##_##domain##_ver##ver##_##type
#define ONNX_OPERATOR_TWO_TYPED_KERNEL_CLASS_NAME(provider, domain, ver, type1, type2, name) provider##_##name##_##domain##_ver##ver##_##type1##_##type2
#define ONNX_OPERATOR_VERSIONED_TYPED_KERNEL_CLASS_NAME(provider, domain, startver, endver, type, name) provider##_##name##_##domain##_ver##startver##_##endver##_##type
#define ONNX_OPERATOR_VERSIONED_TWO_TYPED_KERNEL_CLASS_NAME(provider, domain, startver, endver, type1, type2, name) provider##_##name##_##domain##_ver##startver##_##endver##_##type1##_##type2
"""
MARK_KERNEL_MACROS = MARK_CLASS_MACROS + r"""
#define ONNX_OPERATOR_KERNEL_EX(name, domain, ver, provider, builder, ...) \
  ORTGEN_BEGIN ONNX_OPERATOR_KERNEL_CLASS_NAME(provider, domain, ver, name) ORTGEN_BUILDER builder ORTGEN_END
#define ONNX_OPERATOR_VERSIONED_KERNEL_EX(name, domain, startver, endver, provider, builder, ...) \
  ORTGEN_BEGIN ONNX_OPERATOR_VERSIONED_KERNEL_CLASS_NAME(provider, domain, startver, endver, name) ORTGEN_BUILDER builder ORTGEN_END
#define ONNX_OPERATOR_TYPED_KERNEL_EX(name, domain, ver, type, provider, builder, ...) \
  ORTGEN_BEGIN ONNX_OPERATOR_TYPED_KERNEL_CLASS_NAME(provider, domain, ver, type, name) ORTGEN_BUILDER builder ORTGEN_END
#define ONNX_OPERATOR_TWO_TYPED_KERNEL_EX(name, domain, ver, type1, type2, provider, builder, ...) \
  ORTGEN_BEGIN ONNX_OPERATOR_TWO_TYPED_KERNEL_CLASS_NAME(provider, domain, ver, type1, type2, name) ORTGEN_BUILDER builder ORTGEN_END
#define ONNX_OPERATOR_VERSIONED_TYPED_KERNEL_EX(name, domain, startver, endver, type, provider, builder, ...) \
  ORTGEN_BEGIN ONNX_OPERATOR_VERSIONED_TYPED_KERNEL_CLASS_NAME(provider, domain, startver, endver, type, name) ORTGEN_BUILDER builder ORTGEN_END
#define ONNX_OPERATOR_VERSIONED_TWO_TYPED_KERNEL_EX(name, domain, startver, endver, type1, type2, provider, builder, ...) \
  ORTGEN_BEGIN ONNX_OPERATOR_VERSIONED_TWO_TYPED_KERNEL_CLASS_NAME(provider, domain, startver, endver, type1, type2, name) ORTGEN_BUILDER builder ORTGEN_END
"""
RESERVED = {
    "ONNX_OPERATOR_KERNEL_CLASS_NAME", "ONNX_OPERATOR_VERSIONED_KERNEL_CLASS_NAME",
    "ONNX_OPERATOR_TYPED_KERNEL_CLASS_NAME", "ONNX_OPERATOR_TWO_TYPED_KERNEL_CLASS_NAME",
    "ONNX_OPERATOR_VERSIONED_TYPED_KERNEL_CLASS_NAME", "ONNX_OPERATOR_VERSIONED_TWO_TYPED_KERNEL_CLASS_NAME",
    "ONNX_OPERATOR_KERNEL_EX", "ONNX_OPERATOR_VERSIONED_KERNEL_EX", "ONNX_OPERATOR_TYPED_KERNEL_EX",
    "ONNX_OPERATOR_TWO_TYPED_KERNEL_EX", "ONNX_OPERATOR_VERSIONED_TYPED_KERNEL_EX",
    "ONNX_OPERATOR_VERSIONED_TWO_TYPED_KERNEL_EX",
}


def log(msg: str) -> None:
    print(f"gen_kernel_table: {msg}", file=sys.stderr)


# --------------------------------------------------------------------------- text helpers

def strip_comments(text: str) -> str:
    """Removes // and /* */ comments, keeping string and char literals and line structure."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "/" and i + 1 < n and text[i + 1] == "/":
            j = text.find("\n", i)
            if j < 0:
                break
            # a // comment ending in a backslash continues onto the next line
            i = j
            continue
        if c == "/" and i + 1 < n and text[i + 1] == "*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j) or " ")
            i = j
            continue
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
            continue
        if c == "R" and text.startswith('R"', i):  # raw strings: R"delim( ... )delim"
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if m:
                end = text.find(")" + m.group(1) + '"', i)
                if end >= 0:
                    out.append(text[i:end + len(m.group(1)) + 2])
                    i = end + len(m.group(1)) + 2
                    continue
        out.append(c)
        i += 1
    return "".join(out)


def logical_lines(text: str):
    """Joins backslash-continued lines; yields (first physical line number, logical line)."""
    buf, start = [], None
    for no, line in enumerate(text.split("\n"), 1):
        if start is None:
            start = no
        if line.endswith("\\"):
            buf.append(line[:-1])
            continue
        buf.append(line)
        yield start, " ".join(buf)
        buf, start = [], None
    if buf:
        yield start, " ".join(buf)


def balanced(text: str, open_at: int) -> int:
    """Index just past the bracket that closes text[open_at] (one of ( { [ <)."""
    pairs = {"(": ")", "{": "}", "[": "]", "<": ">"}
    stack = [pairs[text[open_at]]]
    i = open_at + 1
    while i < len(text) and stack:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < len(text) and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        if c in "({[":
            stack.append(pairs[c])
        elif c == "<" and stack[-1] == ">":
            stack.append(">")
        elif c == stack[-1]:
            stack.pop()
        i += 1
    return i


def split_args(text: str) -> list[str]:
    """Splits a comma-separated argument list at depth 0."""
    args, depth, cur, i = [], 0, [], 0
    while i < len(text):
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < len(text) and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            cur.append(text[i:j + 1])
            i = j + 1
            continue
        if c in "({[<":
            depth += 1
        elif c in ")}]>":
            depth -= 1
        if c == "," and depth == 0:
            args.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    if "".join(cur).strip():
        args.append("".join(cur).strip())
    return args


# --------------------------------------------------------------------------- conditions

def eval_condition(expr: str, defines: dict[str, str]) -> bool:
    """Evaluates a preprocessor #if expression (defined(), !, &&, ||, comparisons, integers)."""
    e = re.sub(r"defined\s*\(\s*(\w+)\s*\)", lambda m: "1" if m.group(1) in defines else "0", expr)
    e = re.sub(r"defined\s+(\w+)", lambda m: "1" if m.group(1) in defines else "0", e)

    def ident(m):
        v = defines.get(m.group(0))
        return v if v not in (None, "") else ("1" if v == "" else "0")

    e = re.sub(r"\b[A-Za-z_]\w*\b", ident, e)
    e = e.replace("&&", " and ").replace("||", " or ")
    e = re.sub(r"!(?!=)", " not ", e)
    e = re.sub(r"(\d+)[uUlL]+\b", r"\1", e)
    try:
        return bool(eval(e, {"__builtins__": {}}, {}))  # noqa: S307 - arithmetic on literals only
    except Exception as err:  # pragma: no cover - reported, treated as false
        log(f"cannot evaluate #if {expr!r} ({err}); taken as false")
        return False


# --------------------------------------------------------------------------- registration lists

CLASS_RE = re.compile(
    r"BuildKernelCreateInfo<\s*(ONNX_OPERATOR_(?:VERSIONED_)?(?:(?:TWO_)?TYPED_)?KERNEL_CLASS_NAME)\s*\(")


def class_ident(provider_const, domain, since, end, types, name):
    ident = f"{provider_const}_{name}_{domain}_ver{since}"
    if end is not None:
        ident += f"_{end}"
    for t in types:
        ident += f"_{t}"
    return ident


def expand_local_macros(text: str) -> str:
    """Expands the file's own function-like macros that wrap the class-name macros
    (cuda_contrib_kernels.cc: `CUDA_MS_OP_TYPED_CLASS_NAME(ver, type, name)` and friends)."""
    macros = {}
    for _, line in logical_lines(text):
        m = re.match(r"\s*#\s*define\s+(\w+)\(([^)]*)\)\s*(.*)", line)
        if m and "_CLASS_NAME(" in m.group(3):
            macros[m.group(1)] = ([p.strip() for p in m.group(2).split(",")], m.group(3).strip())
    if not macros:
        return text
    call = re.compile(r"\b(" + "|".join(map(re.escape, macros)) + r")\s*\(")
    out, pos = [], 0
    for m in call.finditer(text):
        if m.start() < pos or re.match(r"\s*#\s*define", text[text.rfind("\n", 0, m.start()) + 1:m.start()]):
            continue
        close = balanced(text, m.end() - 1)
        params, body = macros[m.group(1)]
        args = split_args(text[m.end():close - 1])
        for p, a in zip(params, args):
            body = re.sub(rf"\b{re.escape(p)}\b", a, body)
        out.append(text[pos:m.start()])
        out.append(body)
        pos = close
    out.append(text[pos:])
    return "".join(out)


def parse_registry(path: Path, defines: dict[str, str]):
    """Yields (ident, provider_const, domain, op, since, end, types, condition) for each entry of
    the kernel function table that the build `defines` compiles."""
    text = expand_local_macros(strip_comments(path.read_text()))
    stack: list[tuple[str, bool]] = []  # (condition text, active)
    chunk: list[str] = []

    def flush():
        body = " ".join(chunk)
        chunk.clear()
        if not all(v for _, v in stack):
            return
        cond = " && ".join(c for c, _ in stack
                           if c not in ("!defined(USE_CUDA_MINIMAL)", "!defined(DISABLE_CONTRIB_OPS)")) or "-"
        for m in CLASS_RE.finditer(body):
            macro = m.group(1)
            close = balanced(body, m.end() - 1)
            args = split_args(body[m.end():close - 1])
            provider_const, domain = args[0], args[1]
            if "VERSIONED" in macro:
                since, end, rest = int(args[2]), int(args[3]), args[4:]
            else:
                since, end, rest = int(args[2]), None, args[3:]
            types, op = rest[:-1], rest[-1]
            yield (class_ident(provider_const, domain, since, end, types, op), provider_const, domain, op,
                   since, end, types, cond)

    for _, line in logical_lines(text):
        s = line.strip()
        m = re.match(r"#\s*(ifdef|ifndef|if|elif|else|endif)\b\s*(.*)", s)
        if not m:
            # class declarations (`class ONNX_OPERATOR_..._CLASS_NAME(...);`) are not registrations
            if not s.startswith("class "):
                chunk.append(s)
            continue
        yield from flush()
        kind, arg = m.group(1), m.group(2).strip()
        if kind in ("ifdef", "ifndef", "if"):
            cond = {"ifdef": f"defined({arg})", "ifndef": f"!defined({arg})", "if": arg}[kind]
            stack.append((cond, eval_condition(cond, defines)))
        elif kind == "elif":
            prev_cond, prev_val = stack.pop()
            stack.append((f"!({prev_cond}) && ({arg})", (not prev_val) and eval_condition(arg, defines)))
        elif kind == "else":
            prev_cond, prev_val = stack.pop()
            stack.append((f"!({prev_cond})", not prev_val))
        elif kind == "endif":
            stack.pop()
    yield from flush()


# --------------------------------------------------------------------------- kernel definitions

class Includer:
    """Resolves `#include "..."` against the ORT tree and returns the directives of headers."""

    def __init__(self, root: Path, provider: str):
        self.root = root
        self.provider = provider
        self.dirs = [root / "onnxruntime", root / "include" / "onnxruntime", root,
                     root / "orttraining", root / "include" / "onnxruntime" / "core" / "session",
                     root / "include" / "onnxruntime" / "core" / "common"]
        self.cache: dict[Path, str] = {}

    def resolve(self, name: str, here: Path) -> Path | None:
        names = [name]
        if self.provider == "rocm" and "cuda" in name:
            names = [name.replace("cuda", "rocm"), name]  # hipify renames cuda -> rocm in paths
        for nm in names:
            for d in [here.parent] + self.dirs:
                p = d / nm
                if p.is_file():
                    return p.resolve()
        return None

    def directives(self, path: Path, seen: set[Path]) -> str:
        """The preprocessor directives of a header, its ORT includes inlined (once per unit)."""
        if path in seen:
            return ""
        seen.add(path)
        out = []
        for _, line in logical_lines(self.text(path)):
            s = line.strip()
            if not s.startswith("#"):
                continue
            out.append(self.directive_line(s, path, seen))
        return "\n".join(out)

    def text(self, path: Path) -> str:
        if path not in self.cache:
            self.cache[path] = strip_comments(path.read_text(errors="replace"))
        return self.cache[path]

    def directive_line(self, s: str, path: Path, seen: set[Path]) -> str:
        m = re.match(r"#\s*include\s*([\"<])([^\">]+)[\">]", s)
        if m:
            target = self.resolve(m.group(2), path)
            return self.directives(target, seen) if target else ""
        m = re.match(r"#\s*(define|undef)\s+(\w+)", s)
        if m and m.group(2) in RESERVED:
            return ""
        if re.match(r"#\s*(error|warning|pragma|line)\b", s):
            return ""
        return s

    def unit(self, path: Path) -> str:
        """A .cc file with includes replaced by header directives, ready for cpp."""
        seen: set[Path] = set()
        out = []
        for _, line in logical_lines(self.text(path)):
            s = line.strip()
            out.append(self.directive_line(s, path, seen) if s.startswith("#") else line)
        return "\n".join(out)


TC_RE = re.compile(r"\.\s*TypeConstraint\s*\(")


class TypeResolver:
    """Turns the C++ expressions of TypeConstraint(...) into lists of ONNX element types."""

    def __init__(self, root: Path):
        self.lists = self.parse_type_lists(root / "onnxruntime/core/framework/element_type_lists.h")
        L = self.lists
        # DataTypeImpl::All*() helpers (onnxruntime/core/framework/data_types.cc)
        t = lambda xs: [CPP_TYPES[x] for x in xs]  # noqa: E731
        seq = lambda xs: [f"seq({CPP_TYPES[x]})" for x in xs]  # noqa: E731
        opt = lambda xs: [f"opt({CPP_TYPES[x]})" for x in xs] + [f"opt(seq({CPP_TYPES[x]}))" for x in xs]  # noqa: E731
        self.helpers = {
            "AllIEEEFloatTensorTypes": t(L["AllIeeeFloat"]),
            "AllFixedSizeTensorTypes": t(L["AllFixedSizeIRv4"]),
            "AllFixedSizeTensorTypesIRv4": t(L["AllFixedSizeIRv4"]),
            "AllFixedSizeTensorTypesIRv9": t(L["AllFixedSizeIRv9"]),
            "AllTensorTypes": t(L["AllIRv4"]),
            "AllTensorTypesIRv4": t(L["AllIRv4"]),
            "AllTensorTypesIRv9": t(L["AllIRv9"]),
            "AllTensorTypesIRv10": t(L["AllIRv10"]),
            "AllFixedSizeSequenceTensorTypes": seq(L["AllFixedSizeIRv4"]),
            "AllFixedSizeSequenceTensorTypesIRv4": seq(L["AllFixedSizeIRv4"]),
            "AllFixedSizeSequenceTensorTypesIRv9": seq(L["AllFixedSizeIRv9"]),
            "AllSequenceTensorTypes": seq(L["AllIRv4"]),
            "AllSequenceTensorTypesIRv4": seq(L["AllIRv4"]),
            "AllSequenceTensorTypesIRv9": seq(L["AllIRv9"]),
            "AllNumericTensorTypes": t(L["AllNumeric"]),
            "AllFixedSizeTensorAndSequenceTensorTypes": t(L["AllFixedSizeIRv4"]) + seq(L["AllFixedSizeIRv4"]),
            "AllFixedSizeTensorAndSequenceTensorTypesIRv4": t(L["AllFixedSizeIRv4"]) + seq(L["AllFixedSizeIRv4"]),
            "AllFixedSizeTensorAndSequenceTensorTypesIRv9": t(L["AllFixedSizeIRv9"]) + seq(L["AllFixedSizeIRv9"]),
            "AllTensorAndSequenceTensorTypes": t(L["AllIRv4"]) + seq(L["AllIRv4"]),
            "AllTensorAndSequenceTensorTypesIRv4": t(L["AllIRv4"]) + seq(L["AllIRv4"]),
            "AllTensorAndSequenceTensorTypesIRv9": t(L["AllIRv9"]) + seq(L["AllIRv9"]),
            "AllOptionalTypes": opt(L["AllIRv4"]),
            "AllOptionalTypesIRv4": opt(L["AllIRv4"]),
            "AllOptionalTypesIRv9": opt(L["AllIRv9"]),
            "AllOptionalAndTensorAndSequenceTensorTypes": opt(L["AllIRv4"]) + t(L["AllIRv4"]) + seq(L["AllIRv4"]),
            "AllOptionalAndTensorAndSequenceTensorTypesIRv4": opt(L["AllIRv4"]) + t(L["AllIRv4"]) + seq(L["AllIRv4"]),
            "AllOptionalAndTensorAndSequenceTensorTypesIRv9": opt(L["AllIRv9"]) + t(L["AllIRv9"]) + seq(L["AllIRv9"]),
            "AllTensorAndSequenceTensorAndOptionalTypes": t(L["AllIRv4"]) + seq(L["AllIRv4"]) + opt(L["AllIRv4"]),
            "AllTensorAndSequenceTensorAndOptionalTypesIRv4": t(L["AllIRv4"]) + seq(L["AllIRv4"]) + opt(L["AllIRv4"]),
            "AllTensorAndSequenceTensorAndOptionalTypesIRv9": t(L["AllIRv9"]) + seq(L["AllIRv9"]) + opt(L["AllIRv9"]),
        }

    @staticmethod
    def parse_type_lists(path: Path) -> dict[str, list[str]]:
        text = strip_comments(path.read_text())
        # keep the branch without DISABLE_FLOAT8_TYPES (float8 types are built in)
        text = re.sub(r"#else.*?#endif", "", text, flags=re.S)
        lists: dict[str, list[str]] = {}
        for m in re.finditer(r"using\s+(\w+)\s*=\s*(.*?);", text, re.S):
            name, rhs = m.group(1), " ".join(m.group(2).split())
            tl = re.fullmatch(r"TypeList<(.*)>", rhs)
            pb = re.fullmatch(r"boost::mp11::mp_push_back<\s*(\w+)\s*,(.*)>", rhs)
            if tl:
                lists[name] = [x.strip() for x in tl.group(1).split(",")]
            elif pb:
                lists[name] = lists[pb.group(1)] + [x.strip() for x in pb.group(2).split(",")]
            elif rhs in lists:
                lists[name] = list(lists[rhs])
        return lists

    def cpp_type(self, t: str) -> str | None:
        t = " ".join(t.replace("const", "").split())
        t = re.sub(r"^(::)?onnxruntime::", "", t)
        return CPP_TYPES.get(t)

    def resolve(self, expr: str, unit_text: str, depth: int = 0) -> list[str] | None:
        """The ONNX types of a TypeConstraint expression, or None when it cannot be resolved."""
        e = " ".join(expr.split())
        if depth > 4:
            return None
        out: list[str] = []
        pos = 0
        found_any = False
        patterns = [
            (r"DataTypeImpl\s*::\s*GetTensorType\s*<", "tensor"),
            (r"DataTypeImpl\s*::\s*GetSequenceTensorType\s*<", "seq"),
            (r"DataTypeImpl\s*::\s*GetType\s*<", "tensor_or_seq"),
            (r"DataTypeImpl\s*::\s*(All\w+)\s*\(\s*\)", "helper"),
            (r"BuildKernelDefConstraints\s*<", "list"),
            (r"BuildKernelDefConstraintsFromTypeList\s*<", "typelist"),
            (r"BuildKernelDefSparseConstraints\s*<", "skip"),
            (r"DataTypeImpl\s*::\s*GetOptionalType\s*<", "skip"),
        ]
        combined = re.compile("|".join(f"(?P<p{i}>{p})" for i, (p, _) in enumerate(patterns)))
        while True:
            m = combined.search(e, pos)
            if not m:
                break
            kind = next(patterns[i][1] for i in range(len(patterns)) if m.group(f"p{i}"))
            found_any = True
            if kind == "helper":
                name = re.search(r"All\w+", m.group(0)).group(0)
                if name not in self.helpers:
                    return None
                out += self.helpers[name]
                pos = m.end()
                continue
            close = balanced(e, m.end() - 1)
            inner = e[m.end():close - 1]
            pos = close
            if kind == "skip":
                return None
            if kind in ("tensor", "seq", "tensor_or_seq"):
                if kind == "tensor_or_seq" and inner.strip() in ("TensorSeq",):
                    return None
                ty = self.cpp_type(inner)
                if ty is None:
                    return None
                out.append(f"seq({ty})" if kind == "seq" else ty)
            elif kind == "list":
                for a in split_args(inner):
                    ty = self.cpp_type(a)
                    if ty is None:
                        return None
                    out.append(ty)
            elif kind == "typelist":
                name = inner.strip()
                names = self.type_list(name, unit_text)
                if names is None:
                    return None
                for a in names:
                    ty = self.cpp_type(a)
                    if ty is None:
                        return None
                    out.append(ty)
        if not found_any:
            # a local helper: `FooTypes()` or a variable, defined in the unit
            name = re.fullmatch(r"(?:[\w:]+::)?(\w+)\s*(?:\(\s*\))?", e)
            if not name:
                return None
            body = self.local_definition(name.group(1), unit_text)
            if body is None:
                return None
            return self.resolve(body, unit_text, depth + 1)
        seen, uniq = set(), []
        for t in out:
            if t not in seen:
                seen.add(t)
                uniq.append(t)
        return uniq

    def type_list(self, name: str, unit_text: str) -> list[str] | None:
        name = name.replace("element_type_lists::", "").strip()
        if name in self.lists:
            return self.lists[name]
        m = re.fullmatch(r"TypeList\s*<(.*)>", name)
        if m:
            return split_args(m.group(1))
        m = re.search(rf"using\s+{re.escape(name)}\s*=\s*(.*?);", unit_text, re.S)
        if m:
            return self.type_list(" ".join(m.group(1).split()), unit_text)
        return None

    @staticmethod
    def local_definition(name: str, unit_text: str) -> str | None:
        """The expression a local function or variable `name` returns / is initialized with."""
        m = re.search(rf"\b{re.escape(name)}\s*\(\s*\)\s*(?:const\s*)?\{{", unit_text)
        if m:
            body = unit_text[m.end() - 1:balanced(unit_text, m.end() - 1)]
            r = re.search(r"return\s+(.*?);", body, re.S)
            if r:
                return r.group(1)
            # `static std::vector<MLDataType> v = {...}; return v;` handled by the variable case
        m = re.search(rf"\b{re.escape(name)}\s*(?:=\s*|\{{)", unit_text)
        if m:
            start = m.end() - (1 if unit_text[m.end() - 1] == "{" else 0)
            end = unit_text.find(";", start)
            return unit_text[start:end] if end > 0 else None
        return None


def kernel_sources(root: Path, provider: str) -> list[tuple[Path, Path, bool]]:
    """(source file to read, file to name in the table, is hipified from CUDA) for a provider."""
    out = []
    hipify_cmake = (root / "cmake/onnxruntime_rocm_hipify.cmake").read_text() if provider == "rocm" else ""
    for tree, excl_name in KERNEL_TREES:
        own = root / tree / provider
        # .cc files, and .cu files that register kernels (ROCm's attention kernels do)
        out += [(p, p, False) for p in sorted(own.rglob("*.cc")) + sorted(own.rglob("*.cu"))]
        if provider != "rocm":
            continue
        m = re.search(rf"set\({excl_name}\s*(.*?)\)", hipify_cmake, re.S)
        patterns = re.findall(r'"([^"]+)"', m.group(1)) if m else []
        cuda_dir = root / tree / "cuda"
        for p in sorted(cuda_dir.rglob("*.cc")):
            rel = p.relative_to(cuda_dir).as_posix()
            if any(fnmatch.fnmatch(rel, pat) for pat in patterns):
                continue
            rocm_twin = root / tree / "rocm" / rel.replace("cuda", "rocm")
            if rocm_twin.is_file():
                continue  # a hand-written ROCm file of that name replaces the hipified one
            out.append((p, p, True))
    return out


def preprocess(unit: str, defines: dict[str, str], prelude: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "prelude.h"
        src = Path(tmp) / "unit.cc"
        pre.write_text(prelude)
        # the prelude's macros must win over any that slipped through: define them at the end too
        src.write_text(unit + "\n")
        args = ["cpp", "-x", "c++", "-P", "-w", "-nostdinc", "-undef", "-D__linux__=1", "-D__cplusplus=201703L",
                "-D__GNUC__=11", "-D__x86_64__=1"]
        args += [f"-D{k}={v}" for k, v in defines.items()]
        args += ["-include", str(pre), str(src)]
        r = subprocess.run(args, capture_output=True, text=True)
        if r.returncode != 0 and not r.stdout:
            raise RuntimeError(r.stderr[-2000:])
        return r.stdout


MEM_RE = re.compile(r"\.\s*(Input|Output)MemoryType\s*\(\s*OrtMemType(?:CPUInput|CPUOutput|CPU)\s*,\s*(\{[^}]*\}|\d+)\s*\)")


def memory_types(builder: str) -> str:
    """`in:1,2;out:0`: the inputs and outputs the kernel keeps in CPU memory (or `-`)."""
    ins, outs = [], []
    for m in MEM_RE.finditer(builder):
        idx = [int(x) for x in re.findall(r"\d+", m.group(2))]
        (ins if m.group(1) == "Input" else outs).extend(idx)
    parts = []
    if ins:
        parts.append("in:" + ",".join(str(i) for i in sorted(set(ins))))
    if outs:
        parts.append("out:" + ",".join(str(i) for i in sorted(set(outs))))
    return ";".join(parts) or "-"


def kernel_definitions(root: Path, provider: str, defines: dict[str, str], types: TypeResolver):
    """ident -> (constraints text, source path) for every kernel defined in the provider's sources."""
    includer = Includer(root, provider)
    found: dict[str, tuple[str, str, bool]] = {}
    for src, named, hipified in kernel_sources(root, provider):
        unit = includer.unit(src)
        if "KERNEL_EX" not in unit and "KERNEL_TYPED" not in unit and "REGISTER" not in unit:
            continue
        if hipified:
            unit = unit.replace("kCudaExecutionProvider", "kRocmExecutionProvider")
        try:
            text = preprocess(unit, defines, MARK_KERNEL_MACROS)
        except RuntimeError as err:
            log(f"cpp failed on {src.relative_to(root)}: {err}")
            continue
        plain = strip_comments(src.read_text(errors="replace"))
        pos = 0
        while True:
            b = text.find("ORTGEN_BEGIN", pos)
            if b < 0:
                break
            mid = text.find("ORTGEN_BUILDER", b)
            end = text.find("ORTGEN_END", mid)
            ident = "".join(text[b + len("ORTGEN_BEGIN"):mid].split())
            builder = text[mid + len("ORTGEN_BUILDER"):end]
            pos = end
            cons = []
            for m in TC_RE.finditer(builder):
                close = balanced(builder, m.end() - 1)
                args = split_args(builder[m.end():close - 1])
                if len(args) != 2 or not re.fullmatch(r'"\w+"', args[0]):
                    cons.append("?")
                    continue
                tys = types.resolve(args[1], text + "\n" + plain)
                cons.append(f"{args[0][1:-1]}=" + (",".join(tys) if tys else "?"))
            c = ";".join(cons) if cons else "-"
            rel = named.relative_to(root).as_posix()
            prev = found.get(ident)
            if prev and prev[3] and hipified:
                continue  # hand-written ROCm source wins
            found[ident] = (c, memory_types(builder), rel, not hipified)
    return found


def kernel_table(root: Path, providers: list[str], build: str, cuda_version: str):
    """The rows of the kernel table and how many have unresolved type constraints."""
    types = TypeResolver(root)
    rows = []
    unresolved = 0
    for provider in providers:
        defines = dict(BUILDS[build][1], **PROVIDER_DEFINES[provider])
        if provider == "cuda":
            defines["CUDA_VERSION"] = defines["CUDART_VERSION"] = cuda_version
        if provider == "cpu":
            defines.pop("SHARED_PROVIDER")
        defs = kernel_definitions(root, provider, defines, types)
        log(f"{provider}: {len(defs)} kernel definitions")
        seen = set()
        for reg in REGISTRY_FILES[provider]:
            if reg.startswith("orttraining/") and build != "training":
                continue  # training kernels are compiled into training builds only
            if not (root / reg).is_file():
                log(f"{provider}: no {reg} in this tree (skipped)")
                continue
            for ident, pconst, domain, op, since, end, tys, cond in parse_registry(root / reg, defines):
                if ident in seen:
                    continue
                seen.add(ident)
                cons, mem, src, _ = defs.get(ident, ("?", "-", reg, False))
                if ident not in defs:
                    log(f"{provider}: no definition found for {ident}")
                if "?" in cons:
                    unresolved += 1
                rows.append((provider, DOMAINS.get(domain, domain), op, str(since), "-" if end is None else str(end),
                             ",".join(tys) if tys else "-", cons, mem, cond, src))
    rows.sort(key=lambda r: (r[0], r[1], r[2], int(r[3]), r[5]))
    return rows, unresolved


# --------------------------------------------------------------------------- MIGraphX

MGX_FILE = "onnxruntime/core/providers/migraphx/migraphx_execution_provider.cc"
ONNX_ELEM = {
    "FLOAT": "float", "FLOAT16": "float16", "BFLOAT16": "bfloat16", "DOUBLE": "double", "INT4": "int4",
    "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64", "UINT4": "uint4", "UINT8": "uint8",
    "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64", "BOOL": "bool", "STRING": "string",
    "FLOAT4E2M1": "float4e2m1", "FLOAT8E4M3FN": "float8e4m3fn", "FLOAT8E4M3FNUZ": "float8e4m3fnuz",
    "FLOAT8E5M2": "float8e5m2", "FLOAT8E5M2FNUZ": "float8e5m2fnuz",
}


def migraphx_table(root: Path) -> tuple[list[tuple[str, str]], list[str], int]:
    """(op, mode-checked) rows of the MIGraphX provider's supported-op list, the element types its
    IsTypeSupported accepts, and the unsupported-node count above which it claims nothing."""
    text = strip_comments((root / MGX_FILE).read_text())

    def body_of(signature: str) -> str:
        m = re.search(signature, text)
        if not m:
            raise SystemExit(f"gen_kernel_table: {signature!r} not found in {MGX_FILE}")
        open_at = text.index("{", m.end())
        return text[open_at:balanced(text, open_at)]

    m = re.search(r"mgx_supported_ops\s*=\s*\{", text)
    if not m:
        raise SystemExit(f"gen_kernel_table: no mgx_supported_ops list in {MGX_FILE}")
    lst = text[m.end() - 1:balanced(text, m.end() - 1)]
    ops = re.findall(r'"(\w+)"', lst)
    mode = body_of(r"static\s+bool\s+IsUnsupportedOpMode\s*\(")
    checked = set(re.findall(r'optype\s*==\s*"(\w+)"', mode))
    unknown = checked - set(ops)
    if unknown:
        log(f"migraphx: mode checks for ops not in the list: {sorted(unknown)}")
    tys = body_of(r"static\s+bool\s+IsTypeSupported\s*\(")
    types = [ONNX_ELEM[t] for t in re.findall(r"TensorProto_DataType_(\w+)\s*:", tys)]
    cap = body_of(r"MIGraphXExecutionProvider::GetCapability\s*\(")
    lim = re.search(r"unsupported_nodes\.size\(\)\s*>\s*(\d+)", cap)
    limit = int(lim.group(1)) if lim else -1
    rows = sorted({(op, "y" if op in checked else "-") for op in ops})
    return rows, types, limit


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ort-src", default=os.environ.get("ORT_SRC"), help="ONNX Runtime source checkout (or ORT_SRC)")
    ap.add_argument("-o", "--output", default=str(Path(__file__).resolve().parents[2] / "data/ort-1.19-kernels.tsv"))
    ap.add_argument("--commit", default="", help="commit or tag to record in the header (default: git rev-parse HEAD)")
    ap.add_argument("--providers", default="cuda,rocm,cpu",
                    help="comma-separated providers to extract (cuda, rocm, cpu); default all three")
    ap.add_argument("--build", choices=sorted(BUILDS), default="training",
                    help="build configuration whose #if conditions are evaluated (default: training)")
    ap.add_argument("--cuda-version", default="12020", help="CUDA_VERSION / CUDART_VERSION for the cuda provider")
    ap.add_argument("--release", default="",
                    help="the released package the table stands for, when it is not VERSION_NUMBER's release")
    ap.add_argument("--migraphx", action="store_true",
                    help="write the MIGraphX provider's supported-op table instead of a kernel table")
    args = ap.parse_args()
    if not args.ort_src:
        ap.error("set ORT_SRC (or --ort-src) to an ONNX Runtime source checkout")
    root = Path(args.ort_src).resolve()
    version = (root / "VERSION_NUMBER").read_text().strip()
    commit = args.commit
    if not commit:
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = r.stdout.strip() or "unknown"
    release = f" for {args.release}" if args.release else ""
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    if args.migraphx:
        rows, types, limit = migraphx_table(root)
        header = [
            f"# ONNX Runtime {version} MIGraphX execution provider supported ops{release}, source commit {commit},",
            f"# generated by scripts/gen/gen_kernel_table.py --migraphx from {MGX_FILE}; do not edit by hand.",
            "# mode_check y: IsUnsupportedOpMode has a rule for the op (modelled in src/tools/gpu_kernels.rs).",
            "# types: " + ",".join(types),
            f"# max_unsupported_nodes: {limit}",
            "op\tmode_check",
        ]
        with open(args.output, "w") as f:
            f.write("\n".join(header) + "\n")
            for r in rows:
                f.write("\t".join(r) + "\n")
        log(f"wrote {len(rows)} MIGraphX ops to {args.output}")
        return 0
    providers = [p for p in args.providers.split(",") if p]
    for p in providers:
        if p not in REGISTRY_FILES:
            ap.error(f"unknown provider {p!r}")
    rows, unresolved = kernel_table(root, providers, args.build, args.cuda_version)
    names = {"cuda": "CUDA", "rocm": "ROCm", "cpu": "CPU"}
    plist = [names[p] for p in providers]
    pdesc = ", ".join(plist[:-1]) + " and " + plist[-1] if len(plist) > 1 else plist[0]
    header = [
        f"# ONNX Runtime {version} {pdesc} kernel registrations{release}, source commit {commit},",
        "# generated by scripts/gen/gen_kernel_table.py from ORT's source; do not edit by hand.",
        f"# build: {BUILDS[args.build][0]}, defines: " + " ".join(sorted(BUILDS[args.build][1]))
        + (f"; CUDA_VERSION={args.cuda_version}" if "cuda" in providers and args.build != "training" else ""),
        "provider\tdomain\top\tsince\tend\tclass_type\tconstraints\tcpu_memory\tcondition\tsource",
    ]
    with open(args.output, "w") as f:
        f.write("\n".join(header) + "\n")
        for r in rows:
            f.write("\t".join(r) + "\n")
    log(f"wrote {len(rows)} kernels to {args.output} ({unresolved} with unresolved type constraints)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""onnxruntime sessions of step graphs, built without the training state.

A step graph holds the initial state as initializers of its state inputs (docs/STEP_GRAPH.md).
A session built from the file would keep them for the session's whole life, beside the state the
trainer feeds: one more copy of every parameter and moment. So the trainers build the session from
the file's bytes *without* those initializers (session_without); the state itself is uploaded
by _training_state. Also here: the options every trainer session gets by default (log level,
memory pattern, the exact CPU arena), the CUDA provider's TF32 choice and the GPU providers'
exact arena (trainer_providers).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort

from . import _contract
from ._onnx_rewrite import TooLarge, session_model

# the session config key that points a model loaded from bytes at its external data (ORT >= 1.21)
_FOLDER_KEY = "session.model_external_initializers_file_folder_path"

# a session input's type (NodeArg.type, OrtValue.data_type()) -> its numpy dtype
ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16,
    "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32, "tensor(uint64)": np.uint64, "tensor(bool)": np.bool_,
}


def with_tf32(providers: list, tf32: bool | None) -> list:
    """``providers`` with the CUDA provider's ``use_tf32`` stated. onnxruntime's default is TF32
    (``use_tf32=1``) where torch's float32 matmuls are strict float32: the trainers take torch's
    default unless told (``tf32=True``) or unless the caller's CUDA options already say."""
    out = []
    for p in providers:
        name, opts = (p, {}) if isinstance(p, str) else (p[0], dict(p[1]))
        if name == "CUDAExecutionProvider":
            given = opts.get("use_tf32")
            if given is not None and tf32 is not None and str(given) != str(int(tf32)):
                raise ValueError(f"tf32={tf32} contradicts use_tf32={given!r} in the CUDA provider's "
                                 f"options; give one of them")
            if given is None:
                opts["use_tf32"] = "1" if tf32 else "0"
            out.append((name, opts))
        else:
            out.append(p)
    return out


# the providers whose device memory arena onnxruntime grows to the next power of two by default
_GPU_ARENA_PROVIDERS = ("CUDAExecutionProvider", "ROCMExecutionProvider")


def exact_gpu_arena(providers: list) -> list:
    """``providers`` with the CUDA and ROCm providers' memory arena growing by what each allocation
    asks for (``arena_extend_strategy="kSameAsRequested"``) unless their options already say how.
    onnxruntime's default, ``kNextPowerOfTwo``, doubles the size of each region it adds, so the
    device may hold up to twice what the step needs at its peak; torch's caching allocator does not
    round so. The CPU arena gets the same (exact_cpu_arena)."""
    out = []
    for p in providers:
        name, opts = (p, {}) if isinstance(p, str) else (p[0], dict(p[1]))
        if name in _GPU_ARENA_PROVIDERS:
            opts.setdefault("arena_extend_strategy", "kSameAsRequested")
            out.append((name, opts))
        else:
            out.append(p)
    return out


def trainer_providers(providers: list, tf32: bool | None) -> list:
    """The providers a trainer's session gets: TF32 stated (with_tf32), the GPU arena exact."""
    return exact_gpu_arena(with_tf32(providers, tf32))


def default_session_options() -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    # With the memory pattern, the second step plans a second full-size block that stays
    # (measured: peak RSS 1.3-1.7x lower without it, step time unchanged; bench/README.md).
    so.enable_mem_pattern = False
    exact_cpu_arena(so)
    return so


_exact_arena_registered: bool | None = None


def exact_cpu_arena(so: ort.SessionOptions) -> bool:
    """Makes the session's CPU arena grow by what each allocation asks for instead of to the next
    power of two (a process-wide arena onnxruntime shares between the sessions that opt in): on
    the Qwen2-0.5B shape the peak fell from 1.03x to 0.92x torch eager's, step time unchanged
    (bench/README.md). False where onnxruntime refuses it (an older version, or an arena the
    application registered itself); the session then keeps its own arena."""
    global _exact_arena_registered
    if _exact_arena_registered is None:
        try:
            cfg = ort.OrtArenaCfg({"arena_extend_strategy": 1})  # kSameAsRequested
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                     ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, cfg)
            _exact_arena_registered = True
        except Exception:  # noqa: BLE001 - any refusal leaves the session's own arena
            _exact_arena_registered = False
    if _exact_arena_registered:
        so.add_session_config_entry("session.use_env_allocators", "1")
    return _exact_arena_registered


def _ort_version() -> tuple[int, int]:
    try:
        major, minor = ort.__version__.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return 0, 0


def _recomputes(path: Path) -> bool:
    """Whether the step graph recomputes layers in its backward (`--recompute`): it runs in
    onnxruntime's PRIORITY_BASED order, which keeps the file's order (each layer's copy just
    before the backward of that layer). The default order runs a node when a later node first
    needs it, which interleaves the layers' copies and keeps them alive together (measured: 24
    layers at 4096 tokens, peak RSS 8.5 GB in the default order, 1.8 GB in PRIORITY_BASED;
    bench/README.md)."""
    try:
        return _contract.read(path).recomputes
    except ValueError:
        return False


def session_without(path: Path, drop, session_options, providers) -> ort.InferenceSession:
    """An InferenceSession of the graph at path that holds none of the initializers in drop.
    session_options None: default_session_options().

    The other initializers that live in external data are put inline into the bytes the session
    reads; where that would reach protobuf's 2 GB limit (large frozen weights), onnxruntime >= 1.21
    reads them from the model's folder instead (a session config entry, taken back afterwards
    from options the caller passed)."""
    so = session_options if session_options is not None else default_session_options()
    order = so.execution_order
    if _recomputes(path):
        if order == ort.ExecutionOrder.DEFAULT:
            # taken back below from options the caller passed, as the folder entry
            so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
        elif order != ort.ExecutionOrder.PRIORITY_BASED:
            warnings.warn(f"{path} recomputes its layers (--recompute): in the execution order of "
                          f"your session options onnxruntime may keep every layer's copy alive at "
                          f"once; use onnxruntime.ExecutionOrder.PRIORITY_BASED", stacklevel=3)
    try:
        return _session(path, drop, so, providers, restore=session_options is not None)
    finally:
        if session_options is not None:
            so.execution_order = order


def _session(path: Path, drop, so, providers, restore: bool) -> ort.InferenceSession:
    try:
        model = session_model(path, drop)
        return ort.InferenceSession(model, sess_options=so, providers=providers)
    except TooLarge:
        if _ort_version() < (1, 21):
            raise ValueError(f"{path}: its frozen weights and constants exceed 2 GB; loading them "
                             f"from external data without the state needs onnxruntime >= 1.21 "
                             f"(this is {ort.__version__})") from None
    model = session_model(path, drop, inline_external=False)
    try:
        previous = so.get_session_config_entry(_FOLDER_KEY)
    except RuntimeError:  # not set
        previous = ""
    so.add_session_config_entry(_FOLDER_KEY, str(path.resolve().parent))
    try:
        return ort.InferenceSession(model, sess_options=so, providers=providers)
    finally:
        if restore:  # the caller's options stay as they were
            so.add_session_config_entry(_FOLDER_KEY, previous)

"""OrtValue <-> torch.Tensor through DLPack: the same memory, no copy (CPU and GPU).

onnxruntime's C-level OrtValue (``OrtValue._ortvalue``) implements ``__dlpack__`` in every build
since 1.16; ``from_dlpack`` takes a DLPack capsule (ORT 1.19 crashes on anything else, so only a
capsule is ever passed).
"""

from __future__ import annotations

import onnxruntime as ort
from onnxruntime.capi import _pybind_state as _C


def to_torch(value: "ort.OrtValue"):
    """A torch tensor sharing the OrtValue's memory (it keeps the OrtValue's buffer alive)."""
    import torch

    return torch.from_dlpack(getattr(value, "_ortvalue", value))


def from_torch(tensor) -> "ort.OrtValue":
    """An OrtValue sharing a contiguous torch tensor's memory (it keeps the tensor alive)."""
    import torch

    if not tensor.is_contiguous():
        raise ValueError("from_torch needs a contiguous tensor")
    capsule = tensor.__dlpack__()
    return ort.OrtValue(_C.OrtValue.from_dlpack(capsule, tensor.dtype == torch.bool))

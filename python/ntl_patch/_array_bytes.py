"""Tensor bytes for the file writers (ONNX rewrites, safetensors), produced only when written."""

from __future__ import annotations

import numpy as np


class ArrayBytes:
    """The little-endian bytes of an array, produced only when written: ``load`` is called then
    (e.g. a device-to-host copy), so a model's tensors pass through memory one at a time."""

    def __init__(self, dtype, shape, load):
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(d) for d in shape)
        self.load = load
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @classmethod
    def of(cls, value) -> "ArrayBytes":
        if isinstance(value, cls):
            return value
        arr = np.asarray(value)
        return cls(arr.dtype, arr.shape, lambda: arr)

    def __len__(self) -> int:
        return self.nbytes

    def write_to(self, out, chunk_bytes: int = 1 << 26) -> None:
        arr = np.asarray(self.load())
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"tensor changed while it was written: {arr.dtype}{list(arr.shape)}, "
                             f"expected {self.dtype}{list(self.shape)}")
        little = arr.dtype.newbyteorder("<")
        if arr.ndim == 0 or arr.nbytes <= chunk_bytes:
            out.write(memoryview(np.ascontiguousarray(arr, dtype=little).reshape(-1)).cast("B"))
            return
        rows = max(1, chunk_bytes // max(1, arr[0].nbytes))  # whole leading-axis slices
        for i in range(0, arr.shape[0], rows):
            part = np.ascontiguousarray(arr[i:i + rows], dtype=little)
            out.write(memoryview(part.reshape(-1)).cast("B"))


def write_pieces(out, pieces) -> None:
    for p in pieces:
        if isinstance(p, ArrayBytes):
            p.write_to(out)
        else:
            out.write(p)

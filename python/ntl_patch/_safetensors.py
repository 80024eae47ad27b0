"""The safetensors file format, read and written with numpy (no `safetensors` dependency).

Layout: an 8-byte little-endian unsigned header length N, N bytes of UTF-8 JSON
``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__":
{str: str}}`` (padded with spaces to a multiple of 8), then the tensors' little-endian bytes, each
at its offsets relative to the end of the header, in header order, without gaps. Files written
here load with ``safetensors.numpy.load_file`` / ``safetensors.torch.load_file`` and back.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from ._array_bytes import ArrayBytes

DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
    "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
}
_CODES = {np.dtype(v): k for k, v in DTYPES.items()}
MAX_HEADER = 100_000_000  # the format's own limit


class SafetensorsError(ValueError):
    """The file is not a safetensors file this reader accepts (the message says why)."""


def save(path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Write tensors (name -> array, or an ArrayBytes whose bytes are produced while writing) and
    string metadata to path, atomically (a temporary file in the same folder, fsynced, then
    renamed)."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    values = []
    offset = 0
    for name, value in tensors.items():
        value = ArrayBytes.of(value)
        dtype = value.dtype.newbyteorder("<") if value.dtype.byteorder == ">" else value.dtype
        code = _CODES.get(dtype)
        if code is None or name == "__metadata__":
            raise SafetensorsError(f"tensor {name!r}: dtype {value.dtype} cannot be stored"
                                   if code is None else "'__metadata__' is not a tensor name")
        header[name] = {"dtype": code, "shape": list(value.shape),
                        "data_offsets": [offset, offset + value.nbytes]}
        values.append(value)
        offset += value.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    path = Path(os.fspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for value in values:
                value.write_to(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path, names=None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of a safetensors file; SafetensorsError when it is malformed. Each
    tensor is read into its own array (the file is never held in memory as a whole); names:
    read only these tensors (the others are checked, not read)."""
    path = Path(os.fspath(path))
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: too short for a safetensors file")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or 8 + n > size:
            raise SafetensorsError(f"{path}: header length {n} does not fit the file")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise SafetensorsError(f"{path}: header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")
        body = size - 8 - n
        entries = []
        for name, info in header.items():
            try:
                dtype = np.dtype(DTYPES[info["dtype"]])
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(f"{path}: tensor {name!r} has a malformed entry {info!r}") from None
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if any(d < 0 for d in shape) or not 0 <= begin <= end <= body \
                    or end - begin != count * dtype.itemsize:
                raise SafetensorsError(f"{path}: tensor {name!r}: offsets {begin}..{end} do not hold "
                                       f"{info['dtype']}{list(shape)} inside the data")
            entries.append((begin, end, name, dtype, shape))
        pos = 0
        for begin, end, name, _, _ in sorted(entries, key=lambda e: (e[0], e[1])):
            if begin != pos:
                raise SafetensorsError(f"{path}: tensor {name!r} starts at {begin}, expected {pos} "
                                       f"(overlapping or gapped data)")
            pos = end
        if pos != body:
            raise SafetensorsError(f"{path}: {body - pos} bytes after the last tensor")
        tensors: dict[str, np.ndarray] = {}
        for begin, end, name, dtype, shape in entries:
            if names is not None and name not in names:
                continue
            arr = np.empty(shape, dtype=dtype)
            f.seek(8 + n + begin)
            if end > begin and f.readinto(memoryview(arr.reshape(-1)).cast("B")) != end - begin:
                raise SafetensorsError(f"{path}: tensor {name!r} ends past the end of the file")
            tensors[name] = arr if dtype.isnative else arr.astype(dtype.newbyteorder("="))
    return tensors, {str(k): v for k, v in meta.items()}

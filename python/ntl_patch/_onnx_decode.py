"""ONNX files decoded without the `onnx` package: ``ModelProto.graph`` (field 7) →
``GraphProto.initializer`` (field 5, ``TensorProto``) to numpy arrays, and the model's
``metadata_props``. The file is memory-mapped, so a tensor is read only when asked for.

TensorProto fields used: 1 dims, 2 data_type, 4 float_data, 5 int32_data, 7 int64_data, 8 name,
9 raw_data, 10 double_data, 11 uint64_data, 13 external_data, 14 data_location.
"""

from __future__ import annotations

import errno
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ._protobuf import FIXED32, FIXED64, LEN, VARINT, Field, WireError, graph_span, iter_fields, \
    string_pair, to_int64, varints

# TensorProto.DataType -> numpy dtype (little-endian), for the types numpy has
ONNX_TO_NUMPY = {
    1: np.dtype("<f4"), 2: np.dtype("u1"), 3: np.dtype("i1"), 4: np.dtype("<u2"),
    5: np.dtype("<i2"), 6: np.dtype("<i4"), 7: np.dtype("<i8"), 9: np.dtype("?"),
    10: np.dtype("<f2"), 11: np.dtype("<f8"), 12: np.dtype("<u4"), 13: np.dtype("<u8"),
}
ONNX_TYPE_NAMES = {
    0: "UNDEFINED", 1: "FLOAT", 2: "UINT8", 3: "INT8", 4: "UINT16", 5: "INT16", 6: "INT32",
    7: "INT64", 8: "STRING", 9: "BOOL", 10: "FLOAT16", 11: "DOUBLE", 12: "UINT32", 13: "UINT64",
    14: "COMPLEX64", 15: "COMPLEX128", 16: "BFLOAT16",
}
# TensorProto fields that hold the data; all are dropped when the data is replaced by raw_data


def type_name(code: int) -> str:
    return ONNX_TYPE_NAMES.get(code, str(code))


@dataclass
class Tensor:
    """An initializer's location in the file and the fields needed to read or replace it."""

    name: str
    start: int  # TensorProto payload span in the file
    end: int
    field_start: int  # span of the whole GraphProto.initializer field (tag + length + payload)
    field_end: int
    data_type: int = 0
    dims: list[int] = field(default_factory=list)
    external: dict[str, str] | None = None  # external_data entries when data_location == EXTERNAL
    fields: list[Field] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.dims)


def parse_tensor(buf, start: int, end: int, field_start: int, field_end: int) -> Tensor:
    t = Tensor(name="", start=start, end=end, field_start=field_start, field_end=field_end)
    location = 0
    entries: dict[str, str] = {}
    for f in iter_fields(buf, start, end):
        t.fields.append(f)
        if f.number == 1:
            t.dims.extend(to_int64(v) for v in varints(buf, f))
        elif f.number == 2 and f.wire == VARINT:
            t.data_type = f.value
        elif f.number == 8 and f.wire == LEN:
            t.name = bytes(buf[f.vstart:f.end]).decode("utf-8")
        elif f.number == 13 and f.wire == LEN:
            k, v = string_pair(buf, f)
            entries[k] = v
        elif f.number == 14 and f.wire == VARINT:
            location = f.value
    if location == 1:
        t.external = entries
    return t


def initializers(buf) -> list[Tensor]:
    """Every GraphProto.initializer of the main graph, in file order."""
    g, _ = graph_span(buf)
    out = []
    for f in iter_fields(buf, g.vstart, g.end):
        if f.number == 5 and f.wire == LEN:
            out.append(parse_tensor(buf, f.vstart, f.end, f.start, f.end))
    return out


def external_path(base_dir: Path, location: str) -> Path:
    loc = Path(location)
    if loc.is_absolute() or ".." in loc.parts:
        raise ValueError(f"external data location {location!r} escapes the model's folder")
    return base_dir / loc


def model_metadata(buf) -> dict[str, str]:
    """ModelProto.metadata_props (field 14)."""
    return dict(string_pair(buf, f) for f in iter_fields(buf, 0, len(buf))
                if f.number == 14 and f.wire == LEN)


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The metadata_props of the ONNX file at path."""
    mm, buf = map_file(Path(path))
    try:
        return model_metadata(buf)
    finally:
        unmap_file(mm, buf)


def _is_hole(fd: int, offset: int, length: int) -> bool:
    """Whether file bytes [offset, offset + length) are one hole of a sparse file (all zeros,
    no disk blocks: `ntl-patch step`'s state.bin). False where the file system cannot tell."""
    if length == 0 or not hasattr(os, "SEEK_DATA"):
        return False
    try:
        return os.lseek(fd, offset, os.SEEK_DATA) >= offset + length
    except OSError as e:
        return e.errno == errno.ENXIO  # no data after offset


def tensor_to_numpy(buf, t: Tensor, base_dir: Path) -> np.ndarray:
    """Decode an initializer (raw_data, typed *_data fields or external data) to a new numpy array
    (one copy of the data; a hole of a sparse external file becomes lazily allocated zeros)."""
    dt = ONNX_TO_NUMPY.get(t.data_type)
    if dt is None:
        raise NotImplementedError(f"initializer {t.name!r}: data type {type_name(t.data_type)} is not supported")
    count = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
    if t.external is not None:
        path = external_path(base_dir, t.external.get("location", ""))
        offset = int(t.external.get("offset", 0) or 0)
        length = int(t.external.get("length", count * dt.itemsize) or count * dt.itemsize)
        if length != count * dt.itemsize:
            raise WireError(f"initializer {t.name!r}: external length {length} does not hold "
                            f"{type_name(t.data_type)}{list(t.dims)}")
        with open(path, "rb") as fh:
            if _is_hole(fh.fileno(), offset, length):
                return np.zeros(t.dims, dtype=dt.newbyteorder("="))
            arr = np.empty(count, dtype=dt)
            fh.seek(offset)
            if fh.readinto(memoryview(arr).cast("B")) != length:
                raise WireError(f"initializer {t.name!r}: {path.name} ends before offset + length")
        return _native(arr).reshape(t.dims)
    raw = [f for f in t.fields if f.number == 9 and f.wire == LEN]
    if raw:
        arr = np.frombuffer(buf[raw[-1].vstart:raw[-1].end], dtype=dt, count=count)
        return _native(arr.copy()).reshape(t.dims)
    if t.data_type == 1:
        values = _typed(buf, t, 4, "<f4")
    elif t.data_type == 11:
        values = _typed(buf, t, 10, "<f8")
    elif t.data_type == 7:
        values = [to_int64(v) for f in t.fields if f.number == 7 for v in varints(buf, f)]
    elif t.data_type in (12, 13):
        values = [v for f in t.fields if f.number == 11 for v in varints(buf, f)]
    else:  # int32_data: int32, int16, int8, uint16, uint8, bool, float16 (bit patterns)
        ints = [v & 0xFFFFFFFF for f in t.fields if f.number == 5 for v in varints(buf, f)]
        ints = np.array(ints, dtype=np.uint32).view(np.int32)
        if t.data_type == 10:
            return ints.astype(np.uint16).view(np.float16).reshape(t.dims)
        values = ints
    arr = np.asarray(values, dtype=dt.newbyteorder("="))
    if arr.size != count:
        raise WireError(f"initializer {t.name!r}: {arr.size} values for shape {t.shape}")
    return arr.reshape(t.dims)


def _native(arr: np.ndarray) -> np.ndarray:
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def _typed(buf, t: Tensor, number: int, fmt: str) -> np.ndarray:
    parts = []
    size = np.dtype(fmt).itemsize
    for f in t.fields:
        if f.number != number:
            continue
        parts.append(np.frombuffer(bytes(buf[f.vstart:f.end]), dtype=fmt))
        if f.wire not in (LEN, FIXED32 if size == 4 else FIXED64):
            raise WireError(f"initializer {t.name!r}: bad wire type for field {number}")
    return np.concatenate(parts) if parts else np.zeros(0, dtype=fmt)


def map_file(path: Path):
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            raise WireError(f"{path}: empty file, not an ONNX model")
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    return mm, memoryview(mm)


def unmap_file(mm, buf) -> None:
    # slices still referenced (e.g. by a traceback) keep the map open; the GC closes it then
    try:
        buf.release()
        mm.close()
    except BufferError:
        pass


def each_initializer(path: str | os.PathLike, names):
    """(name, numpy array) of each named initializer of the ONNX file at path, in the order of
    names, one array at a time (KeyError if one is absent)."""
    path = Path(path)
    mm, buf = map_file(path)
    try:
        found: dict[str, Tensor] = {}
        for t in initializers(buf):
            found.setdefault(t.name, t)
        absent = [n for n in names if n not in found]
        if absent:
            raise KeyError(f"{path}: no initializer named {', '.join(sorted(map(repr, absent)))}")
        for n in names:
            yield n, tensor_to_numpy(buf, found[n], path.parent)
    finally:
        unmap_file(mm, buf)


def read_initializers(path: str | os.PathLike, names) -> dict[str, np.ndarray]:
    """The named initializers of the ONNX file at path, as numpy arrays (KeyError if absent)."""
    return dict(each_initializer(path, list(names)))

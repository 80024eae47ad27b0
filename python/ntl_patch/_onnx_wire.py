"""Minimal protobuf wire-format access to ONNX files, without the `onnx` package.

Reads the initializers of ``ModelProto.graph`` (field 7) → ``GraphProto.initializer`` (field 5,
``TensorProto``) and rewrites chosen initializers' data, keeping every other byte of the file as it
is. Only the fields named below are interpreted; everything else is copied verbatim.

TensorProto fields used: 1 dims, 2 data_type, 4 float_data, 5 int32_data, 7 int64_data, 8 name,
9 raw_data, 10 double_data, 11 uint64_data, 13 external_data, 14 data_location.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# wire types
VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5

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
DATA_FIELDS = {4, 5, 6, 7, 9, 10, 11, 13, 14}
PROTOBUF_LIMIT = 2**31 - 1  # protobuf's maximum message size


class WireError(ValueError):
    """The bytes are not the protobuf the ONNX schema describes."""


def type_name(code: int) -> str:
    return ONNX_TYPE_NAMES.get(code, str(code))


# --- primitives -----------------------------------------------------------------------------------

def read_varint(buf, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than 10 bytes")


def encode_varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 two's complement, 10 bytes
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def to_int64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def key(field_no: int, wire_type: int) -> bytes:
    return encode_varint((field_no << 3) | wire_type)


@dataclass
class Field:
    number: int
    wire: int
    start: int  # first byte of the tag
    vstart: int  # first byte of the value (payload for LEN)
    end: int  # one past the last byte
    value: int = 0  # VARINT value


def iter_fields(buf, start: int, end: int):
    """Yield the top-level fields of the message in buf[start:end]."""
    pos = start
    while pos < end:
        tag_start = pos
        tag, pos = read_varint(buf, pos, end)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise WireError("field number 0")
        if wire == VARINT:
            value, npos = read_varint(buf, pos, end)
            yield Field(number, wire, tag_start, pos, npos, value)
            pos = npos
        elif wire == FIXED64:
            yield Field(number, wire, tag_start, pos, pos + 8)
            pos += 8
        elif wire == LEN:
            length, pos = read_varint(buf, pos, end)
            yield Field(number, wire, tag_start, pos, pos + length)
            pos += length
        elif wire == FIXED32:
            yield Field(number, wire, tag_start, pos, pos + 4)
            pos += 4
        else:
            raise WireError(f"unsupported wire type {wire} (groups) in field {number}")
        if pos > end:
            raise WireError(f"field {number} runs past the end of its message")


def _varints(buf, f: Field) -> list[int]:
    if f.wire == VARINT:
        return [f.value]
    if f.wire != LEN:
        raise WireError(f"field {f.number}: unexpected wire type {f.wire}")
    out, pos = [], f.vstart
    while pos < f.end:
        v, pos = read_varint(buf, pos, f.end)
        out.append(v)
    return out


# --- tensors --------------------------------------------------------------------------------------

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
            t.dims.extend(to_int64(v) for v in _varints(buf, f))
        elif f.number == 2 and f.wire == VARINT:
            t.data_type = f.value
        elif f.number == 8 and f.wire == LEN:
            t.name = bytes(buf[f.vstart:f.end]).decode("utf-8")
        elif f.number == 13 and f.wire == LEN:
            k = v = ""
            for e in iter_fields(buf, f.vstart, f.end):
                if e.wire == LEN and e.number in (1, 2):
                    s = bytes(buf[e.vstart:e.end]).decode("utf-8")
                    k, v = (s, v) if e.number == 1 else (k, s)
            entries[k] = v
        elif f.number == 14 and f.wire == VARINT:
            location = f.value
    if location == 1:
        t.external = entries
    return t


def graph_span(buf) -> tuple[Field, list[Field]]:
    """The ModelProto.graph field and all top-level ModelProto fields."""
    fields = list(iter_fields(buf, 0, len(buf)))
    graphs = [f for f in fields if f.number == 7 and f.wire == LEN]
    if len(graphs) != 1:
        raise WireError(f"expected one ModelProto.graph, found {len(graphs)}")
    return graphs[0], fields


def initializers(buf) -> list[Tensor]:
    """Every GraphProto.initializer of the main graph, in file order."""
    g, _ = graph_span(buf)
    out = []
    for f in iter_fields(buf, g.vstart, g.end):
        if f.number == 5 and f.wire == LEN:
            out.append(parse_tensor(buf, f.vstart, f.end, f.start, f.end))
    return out


def _external_path(base_dir: Path, location: str) -> Path:
    loc = Path(location)
    if loc.is_absolute() or ".." in loc.parts:
        raise ValueError(f"external data location {location!r} escapes the model's folder")
    return base_dir / loc


def tensor_to_numpy(buf, t: Tensor, base_dir: Path) -> np.ndarray:
    """Decode an initializer (raw_data, typed *_data fields or external data) to a numpy array."""
    dt = ONNX_TO_NUMPY.get(t.data_type)
    if dt is None:
        raise NotImplementedError(f"initializer {t.name!r}: data type {type_name(t.data_type)} is not supported")
    count = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
    if t.external is not None:
        path = _external_path(base_dir, t.external.get("location", ""))
        offset = int(t.external.get("offset", 0) or 0)
        length = int(t.external.get("length", count * dt.itemsize) or count * dt.itemsize)
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read(length)
        arr = np.frombuffer(data, dtype=dt, count=count)
        return arr.reshape(t.dims).astype(dt.newbyteorder("="))
    raw = [f for f in t.fields if f.number == 9 and f.wire == LEN]
    if raw:
        arr = np.frombuffer(bytes(buf[raw[-1].vstart:raw[-1].end]), dtype=dt, count=count)
        return arr.reshape(t.dims).astype(dt.newbyteorder("="))
    if t.data_type == 1:
        values = _typed(buf, t, 4, "<f4")
    elif t.data_type == 11:
        values = _typed(buf, t, 10, "<f8")
    elif t.data_type == 7:
        values = [to_int64(v) for f in t.fields if f.number == 7 for v in _varints(buf, f)]
    elif t.data_type in (12, 13):
        values = [v for f in t.fields if f.number == 11 for v in _varints(buf, f)]
    else:  # int32_data: int32, int16, int8, uint16, uint8, bool, float16 (bit patterns)
        ints = [v & 0xFFFFFFFF for f in t.fields if f.number == 5 for v in _varints(buf, f)]
        ints = np.array(ints, dtype=np.uint32).view(np.int32)
        if t.data_type == 10:
            return ints.astype(np.uint16).view(np.float16).reshape(t.dims)
        values = ints
    arr = np.asarray(values, dtype=dt.newbyteorder("="))
    if arr.size != count:
        raise WireError(f"initializer {t.name!r}: {arr.size} values for shape {t.shape}")
    return arr.reshape(t.dims)


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


def tensor_chunks(buf, t: Tensor, array: np.ndarray) -> list:
    """TensorProto payload of t with its data replaced by array as raw_data, as byte chunks (the
    array's bytes are not copied): every field except the data fields is kept in order; raw_data
    goes before the first kept field numbered > 9."""
    raw = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False)
    raw = raw.reshape(-1).view(np.uint8)
    raw_chunks = [key(9, LEN) + encode_varint(len(raw)), raw]
    out: list = []
    placed = False
    for f in t.fields:
        if f.number in DATA_FIELDS:
            continue
        if not placed and f.number > 9:
            out += raw_chunks
            placed = True
        out.append(buf[f.start:f.end])
    if not placed:
        out += raw_chunks
    return out


def encode_tensor_with_data(buf, t: Tensor, array: np.ndarray) -> bytes:
    """tensor_chunks joined."""
    return b"".join(bytes(c) for c in tensor_chunks(buf, t, array))


# --- rewriting ------------------------------------------------------------------------------------

def _to_half(t: Tensor, array: np.ndarray) -> np.ndarray:
    """A float32 master copy (`step --precision` on a float16/bfloat16 export) rounded to its
    initializer's half type (bfloat16 as its bits, round to nearest even); others unchanged."""
    if array.dtype != np.float32 or t.data_type not in (10, 16):
        return array
    if t.data_type == 10:
        return array.astype(np.float16)
    bits = np.ascontiguousarray(array).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return np.where(np.isnan(array), 0x7FC0, rounded >> 16).astype(np.uint16)


def _check(t: Tensor, array: np.ndarray) -> None:
    # bfloat16 travels as its uint16 bits (numpy has no bfloat16)
    want = ONNX_TO_NUMPY.get(t.data_type, np.dtype("<u2") if t.data_type == 16 else None)
    if want is None or np.dtype(array.dtype).newbyteorder("<") != want.newbyteorder("<"):
        raise ValueError(f"initializer {t.name!r} is {type_name(t.data_type)}{list(t.shape)}, "
                         f"the trained value is {array.dtype}{list(array.shape)}: type mismatch")
    if tuple(array.shape) != t.shape:
        raise ValueError(f"initializer {t.name!r} has shape {list(t.shape)}, the trained value "
                         f"{list(array.shape)}: shape mismatch")


def replace_initializers(src: str | os.PathLike, dst: str | os.PathLike,
                         values: dict[str, np.ndarray], strict: bool = True) -> list[str]:
    """Copy the ONNX file src to dst with the named initializers' data replaced by values
    (inline raw_data), atomically (temporary file in dst's folder + os.replace).

    Returns the replaced names. strict: every name in values must be an initializer of src.
    Initializers stored as external data become inline; NotImplementedError when the result would
    reach protobuf's 2 GB limit. Other initializers that stay external keep their relative
    locations, so dst must then be in src's folder (ValueError otherwise)."""
    src, dst = Path(src), Path(dst)
    mm, buf = _map(src)
    try:
        pieces, replaced = _plan(buf, src, dst, values, strict)
        total = sum(len(p) for p in pieces)
        if total > PROTOBUF_LIMIT:
            raise NotImplementedError(
                f"{dst}: the model with the trained parameters inline would be {total} bytes, "
                f"over protobuf's 2 GB limit; writing external data is not implemented")
        _atomic_write(dst, pieces)
        del pieces
    finally:
        _unmap(mm, buf)
    return replaced


def _map(path: Path):
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            raise WireError(f"{path}: empty file, not an ONNX model")
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    return mm, memoryview(mm)


def _unmap(mm, buf) -> None:
    # slices still referenced (e.g. by a traceback) keep the map open; the GC closes it then
    try:
        buf.release()
        mm.close()
    except BufferError:
        pass


def _plan(buf, src: Path, dst: Path, values: dict[str, np.ndarray], strict: bool):
    g, _ = graph_span(buf)
    by_name: dict[str, Tensor] = {}
    graph_fields = list(iter_fields(buf, g.vstart, g.end))
    for f in graph_fields:
        if f.number == 5 and f.wire == LEN:
            t = parse_tensor(buf, f.vstart, f.end, f.start, f.end)
            by_name.setdefault(t.name, t)
    missing = [n for n in values if n not in by_name]
    if missing and strict:
        raise ValueError(f"{src}: no initializer named {', '.join(map(repr, missing))}; "
                         f"the model must hold every trained parameter as an initializer")
    kept_external = [t.name for n, t in by_name.items() if t.external is not None and n not in values]
    if kept_external and dst.resolve().parent != src.resolve().parent:
        raise ValueError(f"{src}: initializers {kept_external[:3]} stay in external data, whose "
                         f"locations are relative to the model's folder; write the output into "
                         f"{src.resolve().parent}")
    new_chunks: dict[int, list] = {}
    replaced = []
    for name, array in values.items():
        t = by_name.get(name)
        if t is None:
            continue
        array = _to_half(t, np.asarray(array))
        _check(t, array)
        new_chunks[t.field_start] = tensor_chunks(buf, t, array)
        replaced.append(name)

    graph_pieces: list = []
    pos = g.vstart
    for f in graph_fields:
        body = new_chunks.get(f.start) if f.number == 5 else None
        if body is None:
            continue
        if f.start > pos:
            graph_pieces.append(buf[pos:f.start])
        graph_pieces += [key(5, LEN) + encode_varint(sum(len(c) for c in body)), *body]
        pos = f.end
    if g.end > pos:
        graph_pieces.append(buf[pos:g.end])
    graph_len = sum(len(p) for p in graph_pieces)
    pieces = [buf[:g.start], key(7, LEN) + encode_varint(graph_len), *graph_pieces, buf[g.end:]]
    return [p for p in pieces if len(p)], replaced


def _atomic_write(dst: Path, pieces) -> None:
    folder = dst.parent if str(dst.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{dst.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as out:
            for p in pieces:
                out.write(p)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dst)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_initializers(path: str | os.PathLike, names) -> dict[str, np.ndarray]:
    """The named initializers of the ONNX file at path, as numpy arrays (KeyError if absent)."""
    path = Path(path)
    wanted = set(names)
    mm, buf = _map(path)
    try:
        found = {}
        for t in initializers(buf):
            if t.name in wanted and t.name not in found:
                found[t.name] = tensor_to_numpy(buf, t, path.parent)
    finally:
        _unmap(mm, buf)
    absent = wanted - found.keys()
    if absent:
        raise KeyError(f"{path}: no initializer named {', '.join(sorted(map(repr, absent)))}")
    return {n: found[n] for n in names}


__all__ = ["read_initializers", "replace_initializers", "initializers", "tensor_to_numpy",
           "encode_tensor_with_data", "WireError"]

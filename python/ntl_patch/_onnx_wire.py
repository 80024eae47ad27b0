"""Minimal protobuf wire-format access to ONNX files, without the `onnx` package.

Reads the initializers of ``ModelProto.graph`` (field 7) → ``GraphProto.initializer`` (field 5,
``TensorProto``) and rewrites chosen initializers' data, keeping every other byte of the file as it
is. Only the fields named below are interpreted; everything else is copied verbatim.

TensorProto fields used: 1 dims, 2 data_type, 4 float_data, 5 int32_data, 7 int64_data, 8 name,
9 raw_data, 10 double_data, 11 uint64_data, 13 external_data, 14 data_location.
"""

from __future__ import annotations

import errno
import io
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


class TooLarge(ValueError):
    """The model would not fit protobuf's 2 GB limit as asked."""


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
            k, v = string_pair(buf, f)
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


def string_pair(buf, f: Field) -> tuple[str, str]:
    """A StringStringEntryProto (key 1, value 2)."""
    k = v = ""
    for e in iter_fields(buf, f.vstart, f.end):
        if e.wire == LEN and e.number in (1, 2):
            s = bytes(buf[e.vstart:e.end]).decode("utf-8")
            k, v = (s, v) if e.number == 1 else (k, s)
    return k, v


def model_metadata(buf) -> dict[str, str]:
    """ModelProto.metadata_props (field 14)."""
    return dict(string_pair(buf, f) for f in iter_fields(buf, 0, len(buf))
                if f.number == 14 and f.wire == LEN)


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The metadata_props of the ONNX file at path."""
    mm, buf = _map(Path(path))
    try:
        return model_metadata(buf)
    finally:
        _unmap(mm, buf)


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
        path = _external_path(base_dir, t.external.get("location", ""))
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


# --- tensor values to write -----------------------------------------------------------------------

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


def _len_field(number: int, payload_len: int) -> bytes:
    return key(number, LEN) + encode_varint(payload_len)


def _string_entry(k: str, v: str) -> bytes:
    body = _len_field(1, len(k.encode())) + k.encode() + _len_field(2, len(v.encode())) + v.encode()
    return _len_field(13, len(body)) + body


def tensor_chunks(buf, t: Tensor, value: ArrayBytes, external: tuple[str, int] | None = None) -> list:
    """TensorProto payload of t with its data replaced by value: inline as raw_data, or (external
    = (location, offset)) as external data of value.nbytes bytes at that offset. Every field
    except the data fields is kept in order; the new fields go where their numbers sort."""
    if external is None:
        new, after = [_len_field(9, len(value)), value], 9
    else:
        location, offset = external
        new = [_string_entry("location", location), _string_entry("offset", str(offset)),
               _string_entry("length", str(len(value))), key(14, VARINT) + encode_varint(1)]
        after = 14
    out: list = []
    placed = False
    for f in t.fields:
        if f.number in DATA_FIELDS:
            continue
        if not placed and f.number > after:
            out += new
            placed = True
        out.append(buf[f.start:f.end])
    if not placed:
        out += new
    return out


def encode_tensor_with_data(buf, t: Tensor, array: np.ndarray) -> bytes:
    """tensor_chunks joined (inline raw_data)."""
    out = io.BytesIO()
    _write_pieces(out, tensor_chunks(buf, t, ArrayBytes.of(array)))
    return out.getvalue()


# --- rewriting ------------------------------------------------------------------------------------

EXTERNAL_MIN_BYTES = 1024  # smaller tensors stay inline (onnx's size_threshold)
EXTERNAL_ALIGN = 4096  # offsets of external tensors: page-aligned, so runtimes can map them


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


def _as_half(t: Tensor, value: ArrayBytes) -> ArrayBytes:
    """value rounded by _to_half when it is written (float32 for a float16/bfloat16 initializer)."""
    if value.dtype != np.float32 or t.data_type not in (10, 16):
        return value
    half = np.float16 if t.data_type == 10 else np.uint16
    return ArrayBytes(half, value.shape, lambda: _to_half(t, np.asarray(value.load())))


def _check(t: Tensor, value: ArrayBytes) -> None:
    # bfloat16 travels as its uint16 bits (numpy has no bfloat16)
    want = ONNX_TO_NUMPY.get(t.data_type, np.dtype("<u2") if t.data_type == 16 else None)
    if want is None or value.dtype.newbyteorder("<") != want.newbyteorder("<"):
        raise ValueError(f"initializer {t.name!r} is {type_name(t.data_type)}{list(t.shape)}, "
                         f"the trained value is {value.dtype}{list(value.shape)}: type mismatch")
    if value.shape != t.shape:
        raise ValueError(f"initializer {t.name!r} has shape {list(t.shape)}, the trained value "
                         f"{list(value.shape)}: shape mismatch")


def replace_initializers(src: str | os.PathLike, dst: str | os.PathLike, values,
                         strict: bool = True, external_data: bool | None = None) -> list[str]:
    """Copy the ONNX file src to dst with the named initializers' data replaced by values (name ->
    numpy array or ArrayBytes), atomically. Returns the replaced names. strict: every name in
    values must be an initializer of src.

    The output is self-contained: dst alone, or dst plus its external data file
    ``<dst name>.data`` beside it (location relative to dst, no ``..``). external_data: None
    (default) writes external data when src has any or the model would not fit protobuf's 2 GB
    inline; True always; False never (ValueError when it would not fit). With external data,
    each replaced tensor of at least EXTERNAL_MIN_BYTES and every initializer src keeps in
    external data go to the data file; otherwise everything becomes inline. Both files are
    written to temporary names, fsynced and renamed into place (the data file first)."""
    src, dst = Path(src), Path(dst)
    mm, buf = _map(src)
    try:
        plan = _Plan(buf, src, values, strict)
        if external_data is None:
            external_data = plan.has_external or plan.inline_size() > PROTOBUF_LIMIT
        if not external_data and plan.inline_size() > PROTOBUF_LIMIT:
            raise TooLarge(f"{dst}: the model with every tensor inline would be "
                             f"{plan.inline_size()} bytes, over protobuf's 2 GB limit; write it "
                             f"with external data (external_data=True or None)")
        data_name = f"{dst.name}.data"
        pieces, data = plan.pieces(data_name if external_data else None)
        total = sum(len(p) for p in pieces)
        if total > PROTOBUF_LIMIT:
            raise TooLarge(f"{dst}: even with external data the model is {total} bytes, over "
                             f"protobuf's 2 GB limit")
        _atomic_write(dst, pieces, data, dst.parent / data_name)
    finally:
        _unmap(mm, buf)
    return plan.replaced


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


class _Plan:
    """Which initializers of src change and how, before anything is written."""

    def __init__(self, buf, src: Path, values, strict: bool, drop=()):
        self.buf, self.src, self.drop = buf, src, set(drop)
        self.graph, _ = graph_span(buf)
        self.graph_fields = list(iter_fields(buf, self.graph.vstart, self.graph.end))
        by_name: dict[str, Tensor] = {}
        self.tensors: dict[int, Tensor] = {}  # initializer field start -> tensor
        for f in self.graph_fields:
            if f.number == 5 and f.wire == LEN:
                t = parse_tensor(buf, f.vstart, f.end, f.start, f.end)
                self.tensors[f.start] = t
                by_name.setdefault(t.name, t)
        missing = [n for n in values if n not in by_name]
        if missing and strict:
            raise ValueError(f"{src}: no initializer named {', '.join(map(repr, missing))}; "
                             f"the model must hold every trained parameter as an initializer")
        self.new: dict[int, ArrayBytes] = {}
        self.replaced: list[str] = []
        for name in values:
            t = by_name.get(name)
            if t is None:
                continue
            value = _as_half(t, ArrayBytes.of(values[name]))
            _check(t, value)
            self.new[t.field_start] = value
            self.replaced.append(name)
        self.has_external = any(t.external is not None for t in self.tensors.values())

    def inline_size(self) -> int:
        """The file size with every initializer inline (raw_data), without encoding anything."""
        graph_len = self.graph.end - self.graph.vstart
        for start, t in self.tensors.items():
            if t.name in self.drop:
                graph_len -= t.field_end - t.field_start
                continue
            value = self.new.get(start)
            if value is None and t.external is None:
                continue  # kept byte for byte
            n = len(value) if value is not None else self._external_len(t)
            body = sum(f.end - f.start for f in t.fields if f.number not in DATA_FIELDS)
            body += len(_len_field(9, n)) + n
            graph_len += len(_len_field(5, body)) + body - (t.field_end - t.field_start)
        return self.graph.start + len(_len_field(7, graph_len)) + graph_len + len(self.buf) - self.graph.end

    @staticmethod
    def _external_len(t: Tensor) -> int:
        given = int(t.external.get("length", 0) or 0)
        if given:
            return given
        dt = ONNX_TO_NUMPY.get(t.data_type)
        count = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
        return count * (dt.itemsize if dt else 2 if t.data_type == 16 else 1)

    def _source_value(self, t: Tensor) -> ArrayBytes:
        """The bytes of an initializer src keeps in external data, read when written (any type:
        they are copied as they are)."""
        path = _external_path(self.src.parent, t.external.get("location", ""))
        offset, length = int(t.external.get("offset", 0) or 0), self._external_len(t)

        def load() -> np.ndarray:
            arr = np.empty(length, np.uint8)
            with open(path, "rb") as fh:
                fh.seek(offset)
                if fh.readinto(memoryview(arr)) != length:
                    raise WireError(f"initializer {t.name!r}: {path.name} ends before offset + length")
            return arr

        return ArrayBytes(np.uint8, (length,), load)

    def pieces(self, data_name: str | None, keep_external: bool = False):
        """(model file pieces, [(offset, ArrayBytes)] of the data file). data_name None: every
        tensor inline, except with keep_external (src's external tensors unchanged)."""
        data: list[tuple[int, ArrayBytes]] = []
        end = 0

        def place(value: ArrayBytes) -> tuple[str, int]:
            nonlocal end
            offset = -(-end // EXTERNAL_ALIGN) * EXTERNAL_ALIGN
            data.append((offset, value))
            end = offset + len(value)
            return data_name, offset

        graph_pieces: list = []
        pos = self.graph.vstart
        for f in self.graph_fields:
            t = self.tensors.get(f.start)
            if t is None:
                continue
            value = self.new.get(f.start)
            if t.name in self.drop:
                graph_pieces.append(self.buf[pos:f.start])
                pos = f.end
                continue
            if value is None and (t.external is None or keep_external):
                continue  # kept as it is
            if value is None:
                value = self._source_value(t)
            external = None
            if data_name is not None and (t.external is not None or len(value) >= EXTERNAL_MIN_BYTES):
                external = place(value)
            body = tensor_chunks(self.buf, t, value, external)
            if f.start > pos:
                graph_pieces.append(self.buf[pos:f.start])
            graph_pieces += [_len_field(5, sum(len(c) for c in body)), *body]
            pos = f.end
        if self.graph.end > pos:
            graph_pieces.append(self.buf[pos:self.graph.end])
        graph_len = sum(len(p) for p in graph_pieces)
        pieces = [self.buf[:self.graph.start], _len_field(7, graph_len), *graph_pieces,
                  self.buf[self.graph.end:]]
        return [p for p in pieces if len(p)], data


def _write_pieces(out, pieces) -> None:
    for p in pieces:
        if isinstance(p, ArrayBytes):
            p.write_to(out)
        else:
            out.write(p)


def _temp_beside(dst: Path):
    folder = dst.parent if str(dst.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{dst.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, tmp


def _atomic_write(dst: Path, pieces, data=(), data_path: Path | None = None) -> None:
    temps = []
    try:
        if data:
            fd, tmp = _temp_beside(data_path)
            temps.append((tmp, data_path))
            with os.fdopen(fd, "wb") as out:
                for offset, value in data:
                    out.seek(offset)
                    value.write_to(out)
                out.flush()
                os.fsync(out.fileno())
        fd, tmp = _temp_beside(dst)
        temps.append((tmp, dst))
        with os.fdopen(fd, "wb") as out:
            _write_pieces(out, pieces)
            out.flush()
            os.fsync(out.fileno())
        for tmp, final in temps:  # the data file first: the model never points at missing data
            os.replace(tmp, final)
    except BaseException:
        for tmp, _ in temps:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise


def session_model(path: str | os.PathLike, drop, inline_external: bool = True) -> bytes:
    """The ONNX file at path as bytes for a runtime session, without the graph initializers named
    in drop; with inline_external, the other initializers held in external data become inline
    (the bytes then load without the model's folder). ValueError when that would reach
    protobuf's 2 GB limit."""
    path = Path(path)
    mm, buf = _map(path)
    try:
        plan = _Plan(buf, path, {}, True, drop)
        if inline_external and plan.inline_size() > PROTOBUF_LIMIT:
            raise TooLarge(f"{path}: the model without its state but with its other external "
                             f"initializers inline would be {plan.inline_size()} bytes, over "
                             f"protobuf's 2 GB limit")
        pieces, _ = plan.pieces(None, keep_external=not inline_external)
        out = io.BytesIO()
        _write_pieces(out, pieces)
        del pieces
        return out.getvalue()
    finally:
        _unmap(mm, buf)


def each_initializer(path: str | os.PathLike, names):
    """(name, numpy array) of each named initializer of the ONNX file at path, in the order of
    names, one array at a time (KeyError if one is absent)."""
    path = Path(path)
    mm, buf = _map(path)
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
        _unmap(mm, buf)


def read_initializers(path: str | os.PathLike, names) -> dict[str, np.ndarray]:
    """The named initializers of the ONNX file at path, as numpy arrays (KeyError if absent)."""
    return dict(each_initializer(path, list(names)))


# --- nodes and cutting a graph ----------------------------------------------------------------

@dataclass
class Node:
    """A NodeProto's op type, inputs and outputs (GraphProto field 1; NodeProto fields 1 input,
    2 output, 4 op_type), and the span of its field in the graph."""

    op_type: str
    inputs: list[str]
    outputs: list[str]
    field: Field


def _text(buf, f: Field) -> str:
    return bytes(buf[f.vstart:f.end]).decode("utf-8")


def nodes(buf) -> list[Node]:
    """The main graph's nodes, in order."""
    g, _ = graph_span(buf)
    out = []
    for f in iter_fields(buf, g.vstart, g.end):
        if f.number == 1 and f.wire == LEN:
            parts = {1: [], 2: [], 4: []}
            for e in iter_fields(buf, f.vstart, f.end):
                if e.number in parts and e.wire == LEN:
                    parts[e.number].append(_text(buf, e))
            out.append(Node((parts[4] or [""])[0], parts[1], parts[2], f))
    return out


def _field_name(buf, f: Field) -> str:
    """The name of a ValueInfoProto (field 1) or TensorProto (field 8)."""
    number = 8 if f.number == 5 else 1
    return next((_text(buf, e) for e in iter_fields(buf, f.vstart, f.end)
                 if e.number == number and e.wire == LEN), "")


def scalar_input(name: str, elem_type: int) -> bytes:
    """A GraphProto.input field: ValueInfoProto(name, TypeProto.tensor_type(elem_type, shape []))."""
    shape = _len_field(2, 0)  # an empty TensorShapeProto: rank 0
    tensor = key(1, VARINT) + encode_varint(elem_type) + shape
    type_proto = _len_field(1, len(tensor)) + tensor
    raw = name.encode("utf-8")
    info = _len_field(1, len(raw)) + raw + _len_field(2, len(type_proto)) + type_proto
    return _len_field(11, len(info)) + info


def cut_graph(buf, outputs, feeds: dict[str, int]) -> bytes:
    """The model in buf with only the nodes that the graph outputs named in outputs need; each
    tensor in feeds (name -> element type) becomes a scalar graph input instead of being
    computed. Inputs, initializers and value infos nothing kept reads are dropped."""
    g, _ = graph_span(buf)
    outputs = set(outputs)
    need = set(outputs)
    keep: set[int] = set()
    for n in reversed(nodes(buf)):
        if n.op_type in ("If", "Loop", "Scan"):  # their bodies read names not listed as inputs
            raise ValueError(f"cannot cut a graph with a {n.op_type} node")
        if any(o in need for o in n.outputs):
            if any(o in feeds for o in n.outputs):
                raise ValueError(f"{n.outputs}: a fed tensor is produced by a node still needed")
            keep.add(n.field.start)
            need.update(i for i in n.inputs if i and i not in feeds)
    pieces: list = []
    for f in iter_fields(buf, g.vstart, g.end):
        if f.number == 1:
            kept = f.start in keep
        elif f.number in (5, 11, 13):
            kept = _field_name(buf, f) in need
        elif f.number == 12:
            kept = _field_name(buf, f) in outputs
        else:
            kept = True
        if kept:
            pieces.append(bytes(buf[f.start:f.end]))
    pieces += [scalar_input(name, t) for name, t in feeds.items()]
    graph = b"".join(pieces)
    return bytes(buf[:g.start]) + _len_field(7, len(graph)) + graph + bytes(buf[g.end:])


__all__ = ["read_initializers", "each_initializer", "replace_initializers", "initializers",
           "tensor_to_numpy", "encode_tensor_with_data", "model_metadata", "read_metadata", "TooLarge",
           "session_model", "ArrayBytes", "WireError", "nodes", "cut_graph"]

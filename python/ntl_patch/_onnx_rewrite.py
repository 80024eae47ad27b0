"""ONNX files rewritten: chosen initializers' data replaced (a trained model), or dropped (the
bytes a session loads without the training state), every other byte kept as it is. Inline or as
external data, within protobuf's 2 GB limit."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from ._array_bytes import ArrayBytes, write_pieces
from ._atomic_write import atomic_write
from ._onnx_decode import ONNX_TO_NUMPY, Tensor, external_path, map_file, parse_tensor, type_name, \
    unmap_file
from ._protobuf import LEN, VARINT, WireError, encode_varint, graph_span, iter_fields, key, len_field

DATA_FIELDS = {4, 5, 6, 7, 9, 10, 11, 13, 14}
PROTOBUF_LIMIT = 2**31 - 1  # protobuf's maximum message size


class TooLarge(ValueError):
    """The model would not fit protobuf's 2 GB limit as asked."""


def _string_entry(k: str, v: str) -> bytes:
    body = len_field(1, len(k.encode())) + k.encode() + len_field(2, len(v.encode())) + v.encode()
    return len_field(13, len(body)) + body


def tensor_chunks(buf, t: Tensor, value: ArrayBytes, external: tuple[str, int] | None = None) -> list:
    """TensorProto payload of t with its data replaced by value: inline as raw_data, or (external
    = (location, offset)) as external data of value.nbytes bytes at that offset. Every field
    except the data fields is kept in order; the new fields go where their numbers sort."""
    if external is None:
        new, after = [len_field(9, len(value)), value], 9
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
    write_pieces(out, tensor_chunks(buf, t, ArrayBytes.of(array)))
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
    mm, buf = map_file(src)
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
        atomic_write(dst, pieces, data, dst.parent / data_name)
    finally:
        unmap_file(mm, buf)
    return plan.replaced


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
            body += len(len_field(9, n)) + n
            graph_len += len(len_field(5, body)) + body - (t.field_end - t.field_start)
        return self.graph.start + len(len_field(7, graph_len)) + graph_len + len(self.buf) - self.graph.end

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
        path = external_path(self.src.parent, t.external.get("location", ""))
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
            graph_pieces += [len_field(5, sum(len(c) for c in body)), *body]
            pos = f.end
        if self.graph.end > pos:
            graph_pieces.append(self.buf[pos:self.graph.end])
        graph_len = sum(len(p) for p in graph_pieces)
        pieces = [self.buf[:self.graph.start], len_field(7, graph_len), *graph_pieces,
                  self.buf[self.graph.end:]]
        return [p for p in pieces if len(p)], data


def session_model(path: str | os.PathLike, drop, inline_external: bool = True) -> bytes:
    """The ONNX file at path as bytes for a runtime session, without the graph initializers named
    in drop; with inline_external, the other initializers held in external data become inline
    (the bytes then load without the model's folder). ValueError when that would reach
    protobuf's 2 GB limit."""
    path = Path(path)
    mm, buf = map_file(path)
    try:
        plan = _Plan(buf, path, {}, True, drop)
        if inline_external and plan.inline_size() > PROTOBUF_LIMIT:
            raise TooLarge(f"{path}: the model without its state but with its other external "
                             f"initializers inline would be {plan.inline_size()} bytes, over "
                             f"protobuf's 2 GB limit")
        pieces, _ = plan.pieces(None, keep_external=not inline_external)
        out = io.BytesIO()
        write_pieces(out, pieces)
        del pieces
        return out.getvalue()
    finally:
        unmap_file(mm, buf)

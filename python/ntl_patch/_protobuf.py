"""The protobuf wire format, as far as the ONNX files read and written here need it: fields
walked by number without the `onnx` package, so any byte not interpreted is copied as it is."""

from __future__ import annotations

from dataclasses import dataclass

# wire types
VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5


class WireError(ValueError):
    """The bytes are not the protobuf the ONNX schema describes."""


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


def varints(buf, f: Field) -> list[int]:
    if f.wire == VARINT:
        return [f.value]
    if f.wire != LEN:
        raise WireError(f"field {f.number}: unexpected wire type {f.wire}")
    out, pos = [], f.vstart
    while pos < f.end:
        v, pos = read_varint(buf, pos, f.end)
        out.append(v)
    return out


def len_field(number: int, payload_len: int) -> bytes:
    return key(number, LEN) + encode_varint(payload_len)


def text(buf, f: Field) -> str:
    return bytes(buf[f.vstart:f.end]).decode("utf-8")


def string_pair(buf, f: Field) -> tuple[str, str]:
    """A StringStringEntryProto (key 1, value 2)."""
    k = v = ""
    for e in iter_fields(buf, f.vstart, f.end):
        if e.wire == LEN and e.number in (1, 2):
            s = bytes(buf[e.vstart:e.end]).decode("utf-8")
            k, v = (s, v) if e.number == 1 else (k, s)
    return k, v


def graph_span(buf) -> tuple[Field, list[Field]]:
    """The ModelProto.graph field and all top-level ModelProto fields."""
    fields = list(iter_fields(buf, 0, len(buf)))
    graphs = [f for f in fields if f.number == 7 and f.wire == LEN]
    if len(graphs) != 1:
        raise WireError(f"expected one ModelProto.graph, found {len(graphs)}")
    return graphs[0], fields


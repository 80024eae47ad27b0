"""A graph cut to the nodes some outputs need, with chosen tensors fed as scalar inputs instead
of computed (the update graph of one rank's shard, _sharding)."""

from __future__ import annotations

from dataclasses import dataclass

from ._protobuf import LEN, VARINT, Field, encode_varint, graph_span, iter_fields, key, len_field, text


@dataclass
class Node:
    """A NodeProto's op type, inputs and outputs (GraphProto field 1; NodeProto fields 1 input,
    2 output, 4 op_type), and the span of its field in the graph."""

    op_type: str
    inputs: list[str]
    outputs: list[str]
    field: Field


def nodes(buf) -> list[Node]:
    """The main graph's nodes, in order."""
    g, _ = graph_span(buf)
    out = []
    for f in iter_fields(buf, g.vstart, g.end):
        if f.number == 1 and f.wire == LEN:
            parts = {1: [], 2: [], 4: []}
            for e in iter_fields(buf, f.vstart, f.end):
                if e.number in parts and e.wire == LEN:
                    parts[e.number].append(text(buf, e))
            out.append(Node((parts[4] or [""])[0], parts[1], parts[2], f))
    return out


def _field_name(buf, f: Field) -> str:
    """The name of a ValueInfoProto (field 1) or TensorProto (field 8)."""
    number = 8 if f.number == 5 else 1
    return next((text(buf, e) for e in iter_fields(buf, f.vstart, f.end)
                 if e.number == number and e.wire == LEN), "")


def scalar_input(name: str, elem_type: int) -> bytes:
    """A GraphProto.input field: ValueInfoProto(name, TypeProto.tensor_type(elem_type, shape []))."""
    shape = len_field(2, 0)  # an empty TensorShapeProto: rank 0
    tensor = key(1, VARINT) + encode_varint(elem_type) + shape
    type_proto = len_field(1, len(tensor)) + tensor
    raw = name.encode("utf-8")
    info = len_field(1, len(raw)) + raw + len_field(2, len(type_proto)) + type_proto
    return len_field(11, len(info)) + info


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
    return bytes(buf[:g.start]) + len_field(7, len(graph)) + graph + bytes(buf[g.end:])

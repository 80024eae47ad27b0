//! A pass over a model's protobuf bytes before decoding: how much memory would the decoded
//! model take? A message costs a few bytes on the wire but hundreds in memory (an empty
//! `AttributeProto` is 2 bytes in the file and ~400 decoded), so a small hostile file can
//! decode into gigabytes. The walk is iterative (no recursion, whatever the nesting), knows
//! which ONNX fields hold messages, and adds up each message's decoded size, strings and
//! packed arrays; initializer payloads (`raw_data`) cost nothing, as they stay slices of the
//! memory-mapped file. Malformed bytes end the walk: the decoder reports them.

use std::mem::size_of;

use prost::encoding::{decode_varint, WireType};

use crate::onnx::proto;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum M {
    Model,
    Graph,
    Node,
    Attribute,
    Tensor,
    SparseTensor,
    ValueInfo,
    Type,
    TypeTensor,
    TypeInner,
    Shape,
    Dim,
    Function,
    TrainingInfo,
    Entry,
    Small,
    Annotation,
    NodeDevice,
}

/// The message type of field `field` of a message of type `m`, where it is a message.
fn child(m: M, field: u64) -> Option<M> {
    use M::*;
    Some(match (m, field) {
        (Model, 7) => Graph,
        (Model, 8) => Small,
        (Model, 14) => Entry,
        (Model, 20) => TrainingInfo,
        (Model, 25) => Function,
        (Model, 26) => Small,
        (Graph, 1) => Node,
        (Graph, 5) => Tensor,
        (Graph, 15) => SparseTensor,
        (Graph, 11..=13) => ValueInfo,
        (Graph, 14) => Annotation,
        (Graph, 16) => Entry,
        (Node, 5) => Attribute,
        (Node, 9) => Entry,
        (Node, 10) => NodeDevice,
        (Attribute, 5 | 10) => Tensor,
        (Attribute, 6 | 11) => Graph,
        (Attribute, 22 | 23) => SparseTensor,
        (Attribute, 14 | 15) => Type,
        (Tensor, 3) => Small,
        (Tensor, 13 | 16) => Entry,
        (SparseTensor, 1 | 2) => Tensor,
        (ValueInfo, 2) => Type,
        (ValueInfo, 4) => Entry,
        (Type, 1 | 8) => TypeTensor,
        (Type, 4 | 5 | 9 | 7) => TypeInner,
        (TypeTensor, 2) => Shape,
        (TypeInner, 1 | 2) => Type,
        (Shape, 1) => Dim,
        (Function, 7) => Node,
        (Function, 11) => Attribute,
        (Function, 9) => Small,
        (Function, 12) => ValueInfo,
        (Function, 14) => Entry,
        (TrainingInfo, 1 | 2) => Graph,
        (TrainingInfo, 3 | 4) => Entry,
        (Annotation, 2) => Entry,
        (NodeDevice, 2) => Small,
        _ => return None,
    })
}

/// The decoded size of a message, with room for the growth of the Vec that holds it.
fn cost(m: M) -> u64 {
    use M::*;
    let bytes = match m {
        Model => size_of::<proto::ModelProto>(),
        Graph => size_of::<proto::GraphProto>(),
        Node => size_of::<proto::NodeProto>(),
        Attribute => size_of::<proto::AttributeProto>(),
        Tensor => size_of::<proto::TensorProto>(),
        SparseTensor => size_of::<proto::SparseTensorProto>(),
        ValueInfo => size_of::<proto::ValueInfoProto>(),
        Type | TypeInner => size_of::<proto::TypeProto>(),
        TypeTensor => size_of::<proto::type_proto::Tensor>(),
        Shape => size_of::<proto::TensorShapeProto>(),
        Dim => size_of::<proto::tensor_shape_proto::Dimension>(),
        Function => size_of::<proto::FunctionProto>(),
        TrainingInfo => size_of::<proto::TrainingInfoProto>(),
        Entry => size_of::<proto::StringStringEntryProto>(),
        Small | NodeDevice => 64,
        Annotation => size_of::<proto::TensorAnnotation>(),
    };
    2 * bytes as u64
}

/// What the walk found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    /// What decoding would allocate, about (an upper estimate).
    pub bytes: u64,
    /// Messages in the file.
    pub messages: u64,
    /// Where the walk stopped: the end, or the first bytes the decoder will refuse.
    pub walked: usize,
}

/// What decoding `bytes` as a `ModelProto` would allocate, and how many messages it holds.
/// `release(pos)` is called as the walk moves on, so the caller can give back the pages
/// behind it. The walk stops at the first key the decoder refuses (field number 0, a key
/// beyond 32 bits, a group), so bytes that are no protobuf — a file of zeros — cost what it
/// takes to see that, not a read of the whole file.
pub fn decoded_size(bytes: &[u8], release: &mut dyn FnMut(usize)) -> Estimate {
    let mut total = cost(M::Model);
    let mut messages = 1u64;
    // (message type, end offset)
    let mut stack: Vec<(M, usize)> = vec![(M::Model, bytes.len())];
    let mut pos = 0usize;
    let mut released = 0usize;
    while let Some(&(m, end)) = stack.last() {
        if pos >= end {
            stack.pop();
            continue;
        }
        if pos - released >= 64 << 20 {
            release(pos);
            released = pos;
        }
        let mut cursor = &bytes[pos..end];
        let Ok(key) = decode_varint(&mut cursor) else {
            break;
        };
        let (field, wire) = (key >> 3, key & 7);
        // prost refuses these keys: decoding stops there, and so does the estimate
        if field == 0 || key > u64::from(u32::MAX) {
            break;
        }
        let skip = match WireType::try_from(wire) {
            Ok(WireType::Varint) => match decode_varint(&mut cursor) {
                Ok(_) => 0,
                Err(_) => break,
            },
            Ok(WireType::SixtyFourBit) => 8,
            Ok(WireType::ThirtyTwoBit) => 4,
            // prost skips legacy groups field by field: walk their fields as this message's
            // (at worst an over-estimate), rather than stop counting there
            Ok(WireType::StartGroup | WireType::EndGroup) => 0,
            Ok(WireType::LengthDelimited) => match decode_varint(&mut cursor) {
                Ok(len) if len <= cursor.len() as u64 => {
                    let start = end - cursor.len();
                    match child(m, field) {
                        Some(c) => {
                            total += cost(c);
                            messages += 1;
                            pos = start;
                            stack.push((c, start + len as usize));
                            continue;
                        }
                        // raw_data stays a slice of the map; strings and packed arrays are
                        // copied (packed varints widen up to 8×: dims, int64_data)
                        None if m == M::Tensor && field == 9 => len as usize,
                        // packed float32/float64: as many bytes decoded as encoded
                        None if matches!((m, field), (M::Tensor, 4 | 10) | (M::Attribute, 7)) => {
                            total += 24 + len;
                            len as usize
                        }
                        None => {
                            total += 24 + 8 * len;
                            len as usize
                        }
                    }
                }
                _ => break,
            },
            _ => break,
        };
        if skip > cursor.len() {
            break;
        }
        pos = end - cursor.len() + skip;
    }
    Estimate {
        bytes: total,
        messages,
        walked: pos,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn many_empty_attributes_cost_far_more_than_their_bytes() {
        let node = proto::NodeProto {
            attribute: vec![proto::AttributeProto::default(); 10_000],
            ..Default::default()
        };
        let model = proto::ModelProto {
            graph: Some(proto::GraphProto {
                node: vec![node],
                ..Default::default()
            }),
            ..Default::default()
        };
        let bytes = model.encode_to_vec();
        let e = decoded_size(&bytes, &mut |_| {});
        assert_eq!(e.messages, 10_003);
        assert!(
            e.bytes > 100 * bytes.len() as u64,
            "{} for {} bytes",
            e.bytes,
            bytes.len()
        );
    }

    #[test]
    fn payloads_cost_nothing() {
        let t = proto::TensorProto {
            raw_data: Some(vec![0u8; 1 << 20].into()),
            ..Default::default()
        };
        let model = proto::ModelProto {
            graph: Some(proto::GraphProto {
                initializer: vec![t.clone(), t],
                node: vec![proto::NodeProto::default()],
                ..Default::default()
            }),
            ..Default::default()
        };
        let bytes = model.encode_to_vec();
        let e = decoded_size(&bytes, &mut |_| {});
        assert_eq!(e.messages, 5, "the walk reaches past the payloads");
        assert_eq!(e.walked, bytes.len());
        assert!(e.bytes < 10_000, "{}", e.bytes);
    }

    #[test]
    fn bytes_that_are_no_protobuf_end_the_walk_at_once() {
        // zeros: key 0 (field 0) is refused by the decoder, so the first byte is enough
        let zeros = vec![0u8; 1 << 20];
        let mut released = 0;
        let e = decoded_size(&zeros, &mut |_| released += 1);
        assert_eq!((e.walked, e.messages, released), (0, 1, 0));
        // a valid field, then a key beyond 32 bits
        let mut bytes = vec![0x08, 0x07]; // ir_version = 7
        bytes.extend([0xff, 0xff, 0xff, 0xff, 0xff, 0x01]);
        bytes.extend(vec![0u8; 4096]);
        assert_eq!(decoded_size(&bytes, &mut |_| {}).walked, 2);
    }
}

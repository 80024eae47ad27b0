//! The ONNX protobuf types (generated at build time from `proto/onnx.proto`) and the few
//! helpers every other module needs to read and write them.

#[allow(clippy::all, missing_docs)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/onnx.rs"));
}

pub use proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, StringStringEntryProto, TensorProto,
    TypeProto, ValueInfoProto,
};

use proto::attribute_proto::AttributeType;
use proto::tensor_proto::DataType;
use proto::tensor_shape_proto::dimension;
use proto::type_proto;

/// The newest IR version the vendored schema knows; newer models may carry fields we drop.
pub const SCHEMA_IR_VERSION: i64 = proto::Version::IrVersion as i64;

/// The opset version of the default ONNX domain, if the model imports it.
pub fn default_opset(model: &ModelProto) -> Option<i64> {
    model
        .opset_import
        .iter()
        .find(|o| matches!(o.domain(), "" | "ai.onnx"))
        .map(|o| o.version())
}

pub fn attr<'a>(node: &'a NodeProto, name: &str) -> Option<&'a AttributeProto> {
    node.attribute.iter().find(|a| a.name() == name)
}

pub fn attr_i(node: &NodeProto, name: &str) -> Option<i64> {
    attr(node, name).map(|a| a.i())
}

pub fn attr_s(node: &NodeProto, name: &str) -> Option<String> {
    attr(node, name).map(|a| String::from_utf8_lossy(a.s()).into_owned())
}

pub fn attr_ints(node: &NodeProto, name: &str) -> Option<Vec<i64>> {
    attr(node, name).map(|a| a.ints.clone())
}

pub fn int_attr(name: &str, value: i64) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Int as i32),
        i: Some(value),
        ..Default::default()
    }
}

pub fn ints_attr(name: &str, values: &[i64]) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Ints as i32),
        ints: values.to_vec(),
        ..Default::default()
    }
}

pub fn floats_attr(name: &str, values: &[f32]) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Floats as i32),
        floats: values.to_vec(),
        ..Default::default()
    }
}

pub fn float_attr(name: &str, value: f32) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Float as i32),
        f: Some(value),
        ..Default::default()
    }
}

pub fn string_attr(name: &str, value: &str) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::String as i32),
        s: Some(value.as_bytes().to_vec().into()),
        ..Default::default()
    }
}

pub fn graph_attr(name: &str, value: GraphProto) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Graph as i32),
        g: Some(value),
        ..Default::default()
    }
}

pub fn tensor_attr(name: &str, value: TensorProto) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Tensor as i32),
        t: Some(value),
        ..Default::default()
    }
}

pub fn f32_tensor(name: &str, dims: &[i64], data: &[f32]) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(DataType::Float as i32),
        float_data: data.to_vec(),
        ..Default::default()
    }
}

pub fn i64_tensor(name: &str, dims: &[i64], data: &[i64]) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(DataType::Int64 as i32),
        int64_data: data.to_vec(),
        ..Default::default()
    }
}

/// Element type and dims (None = symbolic or unknown) of a value's declared tensor type.
pub fn value_info_shape(vi: &ValueInfoProto) -> Option<(i32, Option<Vec<Option<i64>>>)> {
    let Some(type_proto::Value::TensorType(t)) = vi.r#type.as_ref()?.value.as_ref() else {
        return None;
    };
    let dims = t.shape.as_ref().map(|s| {
        s.dim
            .iter()
            .map(|d| match d.value {
                Some(dimension::Value::DimValue(v)) if v > 0 => Some(v),
                _ => None,
            })
            .collect()
    });
    Some((t.elem_type(), dims))
}

/// A tensor value-info with a known element type and rank-0 shape (a scalar loss).
pub fn scalar_value_info(name: &str, elem_type: i32) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(elem_type),
                shape: Some(proto::TensorShapeProto { dim: vec![] }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Data types the number losses accept as logits (they compute in float32).
pub fn is_float_type(elem_type: i32) -> bool {
    [
        DataType::Float,
        DataType::Float16,
        DataType::Bfloat16,
        DataType::Double,
    ]
    .iter()
    .any(|t| *t as i32 == elem_type)
}

pub const FLOAT: i32 = DataType::Float as i32;
pub const INT64: i32 = DataType::Int64 as i32;
pub const BOOL: i32 = DataType::Bool as i32;
pub const INT32: i32 = DataType::Int32 as i32;
pub const DOUBLE: i32 = DataType::Double as i32;
pub const FLOAT16: i32 = DataType::Float16 as i32;

//! Host tensors: the values validate feeds to a runtime and reads back, independent of any
//! runtime's own tensor type, plus decoding them from ONNX `TensorProto`s (test data files).

use crate::onnx::proto::tensor_proto::DataType;
use crate::onnx::TensorProto;

/// The element types validate handles (what language-model training graphs take and give).
#[derive(Debug, Clone, PartialEq)]
pub enum Data {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I64(Vec<i64>),
    I32(Vec<i32>),
    Bool(Vec<bool>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Data,
}

impl HostTensor {
    pub fn len(&self) -> usize {
        match &self.data {
            Data::F32(v) => v.len(),
            Data::F64(v) => v.len(),
            Data::I64(v) => v.len(),
            Data::I32(v) => v.len(),
            Data::Bool(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every element widened to f64 (the reference computes in f64).
    pub fn to_f64(&self) -> Vec<f64> {
        match &self.data {
            Data::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::F64(v) => v.clone(),
            Data::I64(v) => v.iter().map(|&x| x as f64).collect(),
            Data::I32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::Bool(v) => v.iter().map(|&x| x as u8 as f64).collect(),
        }
    }

    /// The elements as i64, for integer tensors only.
    pub fn to_i64(&self) -> Option<Vec<i64>> {
        match &self.data {
            Data::I64(v) => Some(v.clone()),
            Data::I32(v) => Some(v.iter().map(|&x| x as i64).collect()),
            _ => None,
        }
    }

    /// Decodes a tensor with inline data (typed fields or little-endian `raw_data`).
    pub fn from_proto(t: &TensorProto) -> Result<HostTensor, String> {
        if !t.external_data.is_empty() {
            return Err(format!(
                "tensor '{}' keeps its data in an external file",
                t.name()
            ));
        }
        let shape: Vec<usize> = t.dims.iter().map(|&d| d.max(0) as usize).collect();
        let raw = t.raw_data.as_deref().filter(|r| !r.is_empty());
        let data = match DataType::try_from(t.data_type()).unwrap_or(DataType::Undefined) {
            DataType::Float => Data::F32(match raw {
                Some(r) => le_chunks(r, f32::from_le_bytes),
                None => t.float_data.clone(),
            }),
            DataType::Double => Data::F64(match raw {
                Some(r) => le_chunks(r, f64::from_le_bytes),
                None => t.double_data.clone(),
            }),
            DataType::Int64 => Data::I64(match raw {
                Some(r) => le_chunks(r, i64::from_le_bytes),
                None => t.int64_data.clone(),
            }),
            DataType::Int32 => Data::I32(match raw {
                Some(r) => le_chunks(r, i32::from_le_bytes),
                None => t.int32_data.clone(),
            }),
            DataType::Bool => Data::Bool(match raw {
                Some(r) => r.iter().map(|&b| b != 0).collect(),
                None => t.int32_data.iter().map(|&b| b != 0).collect(),
            }),
            other => {
                return Err(format!(
                    "tensor '{}' has element type {}, which validate does not read",
                    t.name(),
                    other.as_str_name()
                ))
            }
        };
        let tensor = HostTensor {
            name: t.name().to_string(),
            shape,
            data,
        };
        let needed = tensor
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d));
        if needed != Some(tensor.len()) {
            return Err(format!(
                "tensor '{}' holds {} values but its shape {:?} needs {}",
                tensor.name,
                tensor.len(),
                tensor.shape,
                needed.map_or("more than can be addressed".into(), |n| n.to_string())
            ));
        }
        Ok(tensor)
    }
}

fn le_chunks<T, const N: usize>(raw: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
    raw.chunks_exact(N)
        .map(|c| f(c.try_into().expect("chunk of N bytes")))
        .collect()
}

//! The optimizer state's initial zeros. Inline for ordinary models; for models whose weights
//! live in external data (the > 2 GB case), the zeros go to one sparse file beside the graph
//! (`<graph file>.state.bin`), so the graph stays under protobuf's 2 GB limit and no buffer
//! of the model's size is ever built: the job (`crate::jobs::step`) creates the file with its
//! length set, all holes.

use std::path::Path;

use crate::error::Error;
use crate::onnx::proto::tensor_proto::DataLocation;
use crate::onnx::proto::StringStringEntryProto;
use crate::onnx::{TensorProto, FLOAT};

/// Alignment of each tensor in the state file.
const ALIGN: u64 = 4096;

pub struct ZeroState {
    /// The state file's name, relative to the graph's folder; None: inline zeros.
    location: Option<String>,
    len: u64,
}

impl ZeroState {
    pub fn inline() -> Self {
        ZeroState {
            location: None,
            len: 0,
        }
    }

    /// Zeros in `<graph file name>.state.bin` beside `graph`.
    pub fn beside(graph: &Path) -> Self {
        let name = graph
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        ZeroState {
            location: Some(format!("{name}.state.bin")),
            len: 0,
        }
    }

    /// A float32 zero tensor of `dims`.
    pub fn tensor(&mut self, name: &str, dims: &[i64]) -> Result<TensorProto, Error> {
        let n = dims.iter().try_fold(1u64, |acc, &d| {
            u64::try_from(d).ok().and_then(|d| acc.checked_mul(d))
        });
        let bytes = n
            .and_then(|n| n.checked_mul(4))
            .filter(|&b| b < (1 << 46))
            .ok_or_else(|| Error::MalformedGraph(format!("initializer '{name}' is too large")))?;
        let mut t = TensorProto {
            name: Some(name.into()),
            dims: dims.to_vec(),
            data_type: Some(FLOAT),
            ..Default::default()
        };
        match &self.location {
            None => t.raw_data = Some(vec![0u8; bytes as usize].into()),
            Some(location) => {
                let offset = self.len.div_ceil(ALIGN) * ALIGN;
                self.len = offset + bytes;
                let entry = |k: &str, v: String| StringStringEntryProto {
                    key: Some(k.into()),
                    value: Some(v),
                };
                t.data_location = Some(DataLocation::External as i32);
                t.external_data = vec![
                    entry("location", location.clone()),
                    entry("offset", offset.to_string()),
                    entry("length", bytes.to_string()),
                ];
            }
        }
        Ok(t)
    }

    /// The state file the zeros went to, if any, for the job to create beside the graph.
    pub fn sparse_file(&self) -> Option<SparseFile> {
        self.location.as_ref().map(|name| SparseFile {
            name: name.clone(),
            len: self.len,
        })
    }
}

/// A file of zeros to create: its name (in the folder of the graph that reads it) and its
/// length; all holes.
pub struct SparseFile {
    pub name: String,
    pub len: u64,
}

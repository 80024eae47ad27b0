//! Recorded inputs and outputs in the ONNX test-data layout: `input_0.pb`, `input_1.pb`, ...
//! and `output_0.pb`, ... (one serialized `TensorProto` each, in graph order, names set).

use std::path::Path;

use prost::Message;

use crate::error::Error;
use crate::onnx::TensorProto;
use crate::tools::validate::tensor::HostTensor;

pub struct TestData {
    pub inputs: Vec<HostTensor>,
    pub outputs: Vec<HostTensor>,
}

pub fn read_dir(dir: &Path) -> Result<TestData, Error> {
    if !dir.is_dir() {
        return Err(Error::Validation(format!(
            "--reference '{}' is not a folder; pass a folder with input_0.pb, output_0.pb, ...",
            dir.display()
        )));
    }
    let inputs = read_series(dir, "input")?;
    if inputs.is_empty() {
        return Err(Error::Validation(format!(
            "--reference '{}' has no input_0.pb; pass a folder in the ONNX test-data layout",
            dir.display()
        )));
    }
    let outputs = read_series(dir, "output")?;
    Ok(TestData { inputs, outputs })
}

/// `{kind}_0.pb`, `{kind}_1.pb`, ... up to the first missing index.
fn read_series(dir: &Path, kind: &str) -> Result<Vec<HostTensor>, Error> {
    let mut out = Vec::new();
    loop {
        let path = dir.join(format!("{kind}_{}.pb", out.len()));
        if path.symlink_metadata().is_err() {
            return Ok(out);
        }
        let bytes = crate::io::fsio::read_regular(&path, crate::io::limits::MAX_REFERENCE_BYTES)
            .map_err(|source| Error::Read {
                path: path.clone(),
                source,
            })?;
        let bad = |why: String| {
            Error::Validation(format!(
                "'{}' is not a readable TensorProto ({why})",
                path.display()
            ))
        };
        let proto = TensorProto::decode(bytes.as_slice()).map_err(|e| bad(e.to_string()))?;
        out.push(HostTensor::from_proto(&proto).map_err(bad)?);
    }
}

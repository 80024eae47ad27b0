//! Payloads of single tensors in external data files: read from the input's data files (what
//! QLoRA quantises), and new payloads written to a data file beside the output (QLoRA's codes
//! of a model too large for one protobuf file).

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use crate::error::Error;
use crate::io::model_io::{external_value, is_external, ExternalDataPlan};
use crate::io::temp::TempFile;
use crate::onnx::proto::tensor_proto::DataLocation;
use crate::onnx::{ModelProto, StringStringEntryProto, TensorProto};

/// Offsets of the payloads written are multiples of this (onnx's `save_model` aligns the same
/// way, so runtimes may map them).
const ALIGN: u64 = 4096;

/// The payload of external tensor `t` of a model loaded from `model_dir`, whose locations
/// `plan` has rewritten for the output (checked by `check_external_data` at load).
pub fn read_external(
    t: &TensorProto,
    model_dir: &Path,
    plan: &ExternalDataPlan,
) -> Result<Vec<u8>, Error> {
    let value = |key| external_value(t, key).ok().flatten();
    let location = plan.input_location(value("location").unwrap_or(""));
    let path = model_dir.join(location);
    let err = |source| Error::Read {
        path: path.clone(),
        source,
    };
    let number = |key| value(key).and_then(|v| v.parse::<u64>().ok());
    let mut file = crate::io::fsio::open_beneath(model_dir, Path::new(location)).map_err(err)?;
    let offset = number("offset").unwrap_or(0);
    let length = match number("length") {
        Some(l) => l,
        None => file.metadata().map_err(err)?.len().saturating_sub(offset),
    };
    file.seek(SeekFrom::Start(offset)).map_err(err)?;
    let mut bytes = vec![0u8; length as usize];
    file.read_exact(&mut bytes).map_err(err)?;
    Ok(bytes)
}

/// Moves the payloads of the initializers `names` of `model` into the data file `path`
/// (written whole to a temporary file, then put in place), each at an aligned offset; the
/// tensors then refer to it by its file name. Returns whether anything was written.
pub fn write_external(
    model: &mut ModelProto,
    names: &[String],
    path: &Path,
) -> Result<bool, Error> {
    let err = |source| Error::Write {
        path: path.to_path_buf(),
        source,
    };
    let graph = model.graph.as_mut().expect("loaded models have a graph");
    let wanted: std::collections::HashSet<&str> = names.iter().map(String::as_str).collect();
    let location = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .expect("a data file has a name");
    let dir = crate::io::model_io::model_dir(path);
    let tmp = TempFile::new_in(&dir).map_err(err)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, tmp.as_file().try_clone().map_err(err)?);
    let mut offset = 0u64;
    let mut any = false;
    for t in graph
        .initializer
        .iter_mut()
        .filter(|t| wanted.contains(t.name()) && !is_external(t))
    {
        // float32 values may sit in float_data (the builder's small tensors): their bytes are
        // the same little-endian payload
        let raw: Vec<u8> = match t.raw_data.take().filter(|r| !r.is_empty()) {
            Some(raw) => raw.to_vec(),
            None if !t.float_data.is_empty() => std::mem::take(&mut t.float_data)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            None => continue,
        };
        let pad = offset.next_multiple_of(ALIGN) - offset;
        w.write_all(&vec![0u8; pad as usize]).map_err(err)?;
        offset += pad;
        w.write_all(&raw).map_err(err)?;
        let entry = |key: &str, value: String| StringStringEntryProto {
            key: Some(key.into()),
            value: Some(value),
        };
        t.external_data = vec![
            entry("location", location.clone()),
            entry("offset", offset.to_string()),
            entry("length", raw.len().to_string()),
        ];
        t.set_data_location(DataLocation::External);
        offset += raw.len() as u64;
        any = true;
    }
    if !any {
        return Ok(false);
    }
    let file = w.into_inner().map_err(|e| err(e.into_error()))?;
    file.sync_all().map_err(err)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(std::fs::Permissions::from_mode(0o644))
            .map_err(err)?;
    }
    tmp.persist(path).map_err(err)?;
    Ok(true)
}

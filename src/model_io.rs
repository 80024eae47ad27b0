//! Loading and saving models. Loading memory-maps the file read-only and decodes in place
//! (initializer payloads stay slices of the map and are never read); saving writes a
//! temporary file in the destination folder and renames it, so a failure leaves no output.

use std::fs::File;
use std::io::Write;
use std::path::{Component, Path, PathBuf};

use bytes::Bytes;
use prost::Message;

use crate::error::Error;
use crate::onnx::proto::tensor_proto::DataLocation;
use crate::onnx::{GraphProto, ModelProto};

pub fn load_model(path: &Path) -> Result<ModelProto, Error> {
    let read_err = |source| Error::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(read_err)?;
    // SAFETY: the map is read-only; the file is never written by this process.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(read_err)?;
    let model = ModelProto::decode(Bytes::from_owner(map)).map_err(|e| Error::NotOnnx {
        path: path.to_path_buf(),
        reason: format!("protobuf decode failed: {e}"),
    })?;
    if model.graph.is_none() || model.ir_version.is_none() {
        return Err(Error::NotOnnx {
            path: path.to_path_buf(),
            reason: "no graph or IR version".into(),
        });
    }
    Ok(model)
}

/// The folder a model's relative paths (external data) are resolved against.
pub fn model_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// External-data locations of every tensor in the graph (initializers and Constant values).
pub fn external_locations(graph: &GraphProto) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let external = DataLocation::External as i32;
    let tensors = graph.initializer.iter().chain(
        graph
            .node
            .iter()
            .flat_map(|n| n.attribute.iter().filter_map(|a| a.t.as_ref())),
    );
    for t in tensors.filter(|t| t.data_location() as i32 == external) {
        let location = t
            .external_data
            .iter()
            .find(|e| e.key() == "location")
            .map(|e| e.value().to_string())
            .unwrap_or_default();
        found.push((t.name().to_string(), location));
    }
    found
}

/// Refuses external-data locations that are absolute, climb out with `..`, or resolve
/// (through symlinks) outside the model's folder.
pub fn check_external_data(graph: &GraphProto, dir: &Path) -> Result<(), Error> {
    let base = dir.canonicalize().map_err(|source| Error::Read {
        path: dir.to_path_buf(),
        source,
    })?;
    for (tensor, location) in external_locations(graph) {
        let unsafe_loc = |problem: &str| Error::UnsafeExternalData {
            tensor: tensor.clone(),
            location: location.clone(),
            problem: problem.into(),
        };
        let rel = Path::new(&location);
        if location.is_empty() {
            return Err(unsafe_loc("is empty"));
        }
        if rel.is_absolute()
            || rel
                .components()
                .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
        {
            return Err(unsafe_loc("is absolute or climbs out of the model folder"));
        }
        match dir.join(rel).canonicalize() {
            Ok(real) if real.starts_with(&base) => {}
            Ok(_) => {
                return Err(unsafe_loc(
                    "resolves (through a symlink) outside the model folder",
                ))
            }
            Err(_) => return Err(unsafe_loc("names a file that does not exist")),
        }
    }
    Ok(())
}

/// Encodes `model` and writes it atomically to `out` (temp file in the same folder, then rename).
pub fn save_model_atomic(model: &ModelProto, out: &Path) -> Result<(), Error> {
    let write_err = |source| Error::Write {
        path: out.to_path_buf(),
        source,
    };
    let dir = model_dir(out);
    let mut tmp = tempfile::Builder::new()
        .prefix(".ntl-patch-")
        .suffix(".tmp")
        .tempfile_in(&dir)
        .map_err(write_err)?;
    let bytes = model.encode_to_vec();
    tmp.write_all(&bytes).map_err(write_err)?;
    tmp.as_file().sync_all().map_err(write_err)?;
    set_readable(tmp.as_file()).map_err(write_err)?;
    tmp.persist(out).map_err(|e| write_err(e.error))?;
    Ok(())
}

#[cfg(unix)]
fn set_readable(f: &File) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    f.set_permissions(std::fs::Permissions::from_mode(0o644))
}

#[cfg(not(unix))]
fn set_readable(_: &File) -> std::io::Result<()> {
    Ok(())
}

/// True when `a` and `b` name the same file (the output would overwrite the input).
pub fn same_file(a: &Path, b: &Path) -> bool {
    let canon = |p: &Path| -> Option<PathBuf> {
        let dir = model_dir(p).canonicalize().ok()?;
        Some(dir.join(p.file_name()?))
    };
    match (canon(a), canon(b)) {
        (Some(x), Some(y)) => {
            x == y || x.canonicalize().ok() == Some(y.clone()) || y.canonicalize().ok() == Some(x)
        }
        _ => false,
    }
}

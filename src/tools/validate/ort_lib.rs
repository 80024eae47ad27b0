//! Finding ONNX Runtime's shared library for `--runtime ort` (ort is built with
//! `load-dynamic`: nothing is linked or downloaded at build time).
//!
//! Looked up in this order:
//! 1. `ORT_DYLIB_PATH`: the library file itself (ort's own convention).
//! 2. `NTL_PATCH_ORT_SITE`: a Python site-packages folder (or a `pip install --target` folder)
//!    holding the PyPI `onnxruntime` wheel; the library is `onnxruntime/capi/libonnxruntime.so.*`.

use std::path::{Path, PathBuf};

use crate::error::Error;

pub const HOW_TO_INSTALL: &str = "install it with `python3 -m pip install --target DIR onnxruntime` and set ORT_DYLIB_PATH=DIR/onnxruntime/capi/libonnxruntime.so.<version> (or NTL_PATCH_ORT_SITE=DIR)";

pub fn find_library() -> Result<PathBuf, Error> {
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(Error::Validation(format!(
                "ORT_DYLIB_PATH='{}' is not a file; point it at libonnxruntime.so.<version>, or {HOW_TO_INSTALL}",
                p.display()
            )))
        };
    }
    if let Some(site) = std::env::var_os("NTL_PATCH_ORT_SITE").filter(|p| !p.is_empty()) {
        let site = PathBuf::from(site);
        return in_site(&site).ok_or_else(|| {
            Error::Validation(format!(
                "NTL_PATCH_ORT_SITE='{}' holds no onnxruntime/capi/libonnxruntime.so*; {HOW_TO_INSTALL}",
                site.display()
            ))
        });
    }
    Err(Error::Validation(format!(
        "--runtime ort needs ONNX Runtime's shared library and none is configured; {HOW_TO_INSTALL}"
    )))
}

/// The library inside a site-packages folder (or the `capi` folder itself).
pub fn in_site(site: &Path) -> Option<PathBuf> {
    [site.join("onnxruntime").join("capi"), site.to_path_buf()]
        .iter()
        .find_map(|dir| library_in(dir))
}

fn library_in(dir: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            // libonnxruntime.so.1.31.1, libonnxruntime.1.31.1.dylib, onnxruntime.dll; not the
            // providers_shared helper
            (name.starts_with("libonnxruntime.") || name == "onnxruntime.dll")
                && (name.contains(".so") || name.ends_with(".dylib") || name.ends_with(".dll"))
        })
        .collect();
    // the longest name is the fully versioned file, not a symlink to it
    found.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    found.into_iter().next()
}

//! Loading and saving models. Loading memory-maps the file read-only and decodes in place
//! (initializer payloads stay slices of the map and are never read); saving streams the
//! encoding into a temporary file in the destination folder and renames it, so a failure
//! leaves no output and the heap never holds a copy of the weights.
//!
//! The streaming encoder writes exactly the bytes `Message::encode_to_vec` would: prost
//! encodes fields in field-number order, and the writer splits each message around the one
//! field that carries the big payload (ModelProto.graph → GraphProto.initializer →
//! TensorProto.raw_data), writing the small rest from ordinary encodings and each `raw_data`
//! as key + length + the bytes straight from the input file (`copy_file_range` through
//! `std::io::copy`), or from memory when the payload is not the input's.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Component, Path, PathBuf};

use bytes::Bytes;
use prost::encoding::{encode_key, encode_varint, WireType};
use prost::Message;

use crate::error::Error;
use crate::io::progress::Progress;
use crate::io::temp::TempFile;
use crate::onnx::proto::tensor_proto::DataLocation;
use crate::onnx::proto::SparseTensorProto;
use crate::onnx::{AttributeProto, GraphProto, ModelProto, TensorProto};

/// Field numbers the streaming encoder splits messages at (onnx.proto).
const MODEL_GRAPH: u32 = 7;
const GRAPH_NODE: u32 = 1;
const GRAPH_INITIALIZER: u32 = 5;
const TENSOR_RAW_DATA: u32 = 9;
/// `raw_data` at least this long is streamed; shorter payloads are encoded in memory.
const STREAM_MIN: usize = 4096;
/// External data files are copied in steps of this many bytes.
const COPY_STEP: u64 = 256 << 20;
/// Pages of the input map are given back (`MADV_DONTNEED`) after this many bytes are decoded
/// or written, so the map never holds more than this in this process's resident memory.
const RELEASE_STEP: u64 = 64 << 20;
/// A model may decode into at most this much memory, or 1.2× its file size if more
/// (`crate::io::prescan` estimates it before decoding).
const MIN_DECODE_LIMIT: u64 = 1 << 30;

/// The memory-mapped input a model was decoded from: payloads that are slices of it are
/// copied file-to-file on save instead of through this process's memory.
pub struct ModelSource {
    file: File,
    map: Bytes,
    path: PathBuf,
}

impl ModelSource {
    /// Drops the map's pages from this process's resident memory (they stay in the page
    /// cache and are faulted back in when read again): the map is read-only, so nothing is
    /// lost.
    fn release(&self) {
        release_pages(self.map.as_ptr(), self.map.len());
    }

    /// Where `data` sits in the input file, when it is a slice of the map.
    fn offset_of(&self, data: &[u8]) -> Option<u64> {
        let base = self.map.as_ptr() as usize;
        let start = data.as_ptr() as usize;
        // The map stays alive as long as `self.map` does, so no other memory can lie in it.
        (start >= base && start + data.len() <= base + self.map.len())
            .then(|| (start - base) as u64)
    }
}

pub fn load_model(path: &Path) -> Result<ModelProto, Error> {
    load_model_source(path).map(|(model, _)| model)
}

/// Loads a model and keeps its input map, for [`save_model_from`].
pub fn load_model_source(path: &Path) -> Result<(ModelProto, ModelSource), Error> {
    let read_err = |source| Error::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = crate::io::fsio::open_regular(path).map_err(read_err)?;
    load_model_file(file, path)
}

/// Loads a model from a file already opened (and checked to be regular) at `path`.
pub fn load_model_file(file: File, path: &Path) -> Result<(ModelProto, ModelSource), Error> {
    let read_err = |source| Error::Read {
        path: path.to_path_buf(),
        source,
    };
    let _progress = Progress::start(&format!("loading {}", path.display()), None);
    // SAFETY: the map is read-only; the file is never written by this process.
    let map = unsafe { memmap2::Mmap::map(&file) }
        .map_err(|e| read_err(crate::io::fsio::map_problem(e)))?;
    // Decoding touches only the small fields between payloads: no read-ahead around them (on a
    // cold cache each field read would otherwise pull megabytes of payload from disk).
    let _ = map.advise(memmap2::Advice::Random);
    let map = Bytes::from_owner(map);
    let estimate =
        crate::io::prescan::decoded_size(&map, &mut |pos| release_pages(map.as_ptr(), pos));
    let limit = MIN_DECODE_LIMIT.max(map.len() as u64 / 5 * 6);
    if estimate.bytes > limit {
        return Err(Error::DecodeTooLarge {
            path: path.to_path_buf(),
            messages: estimate.messages,
            estimate_mb: estimate.bytes >> 20,
            limit_mb: limit >> 20,
        });
    }
    let input = ReleasingBuf {
        inner: map.clone(),
        start: map.as_ptr(),
        len: map.len(),
        released: 0,
    };
    let model = ModelProto::decode(input).map_err(|e| Error::NotOnnx {
        path: path.to_path_buf(),
        reason: decode_reason(&e),
    })?;
    if model.graph.is_none() || model.ir_version.is_none() {
        return Err(Error::NotOnnx {
            path: path.to_path_buf(),
            reason: "no graph or IR version".into(),
        });
    }
    Ok((
        model,
        ModelSource {
            file,
            map,
            path: path.to_path_buf(),
        },
    ))
}

/// `MADV_DONTNEED` on the first `len` bytes (rounded down to pages) of a read-only map.
fn release_pages(start: *const u8, len: usize) {
    #[cfg(unix)]
    {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let len = len & !(page - 1);
        if len > 0 {
            // SAFETY: `start` is the page-aligned start of a live read-only file mapping at
            // least `len` long; dropping its pages only makes later reads fault them back in.
            unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_DONTNEED) };
        }
    }
}

/// The map as the decoder's input: as decoding moves forward, the pages behind it are given
/// back every [`RELEASE_STEP`] bytes, so decoding a model whose payloads are many small
/// tensors does not keep the whole file resident. Byte fields stay zero-copy slices.
struct ReleasingBuf {
    inner: Bytes,
    start: *const u8,
    len: usize,
    released: usize,
}

impl ReleasingBuf {
    fn moved(&mut self) {
        let pos = self.len - self.inner.len();
        if (pos - self.released) as u64 >= RELEASE_STEP {
            release_pages(self.start, pos);
            self.released = pos;
        }
    }
}

impl bytes::Buf for ReleasingBuf {
    fn remaining(&self) -> usize {
        self.inner.remaining()
    }

    fn chunk(&self) -> &[u8] {
        self.inner.chunk()
    }

    fn advance(&mut self, n: usize) {
        self.inner.advance(n);
        self.moved();
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        let b = self.inner.copy_to_bytes(len);
        self.moved();
        b
    }
}

/// A decode error in a few words. prost's text lists every enclosing field (thousands of
/// characters for deeply nested input); keep the innermost field and the description.
pub fn decode_reason(e: &prost::DecodeError) -> String {
    let text = e.to_string();
    let text = text
        .strip_prefix("failed to decode Protobuf message: ")
        .unwrap_or(&text);
    let parts: Vec<&str> = text.split(": ").collect();
    let reason = match parts.as_slice() {
        [.., field, why] if parts.len() > 2 => format!("{why} (in {field})"),
        [field, why] => format!("{why} (in {field})"),
        _ => text.to_string(),
    };
    let reason = if reason.contains("recursion limit") {
        format!("protobuf decode failed: messages nested too deeply, {reason}")
    } else {
        format!("protobuf decode failed: {reason}")
    };
    match reason.char_indices().nth(200) {
        Some((cut, _)) => format!("{}...", &reason[..cut]),
        None => reason,
    }
}

/// The folder a model's relative paths (external data) are resolved against.
pub fn model_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

// ---------------------------------------------------------------------------------------------
// Every tensor of a model: graph, subgraphs, model-local functions, training info

fn attribute_tensors<'a>(a: &'a AttributeProto, f: &mut dyn FnMut(&'a TensorProto)) {
    let sparse = |s: &'a SparseTensorProto| s.values.iter().chain(s.indices.iter());
    let sparse_tensors = a
        .sparse_tensor
        .iter()
        .chain(a.sparse_tensors.iter())
        .flat_map(sparse);
    for t in a.t.iter().chain(a.tensors.iter()).chain(sparse_tensors) {
        f(t);
    }
    for g in a.g.iter().chain(a.graphs.iter()) {
        visit_tensors(g, f);
    }
}

fn visit_tensors<'a>(graph: &'a GraphProto, f: &mut dyn FnMut(&'a TensorProto)) {
    let sparse = |s: &'a SparseTensorProto| s.values.iter().chain(s.indices.iter());
    for t in &graph.initializer {
        f(t);
    }
    for t in graph.sparse_initializer.iter().flat_map(sparse) {
        f(t);
    }
    for a in graph.node.iter().flat_map(|n| n.attribute.iter()) {
        attribute_tensors(a, f);
    }
}

/// Every tensor of the model: the graph's (initializers, sparse initializers, attributes,
/// subgraphs), the model-local functions' (node attributes and default attributes) and the
/// training-info graphs'. Nesting is bounded by the decoder's recursion limit.
pub fn visit_model_tensors<'a>(model: &'a ModelProto, f: &mut dyn FnMut(&'a TensorProto)) {
    if let Some(g) = &model.graph {
        visit_tensors(g, f);
    }
    for func in &model.functions {
        for a in func
            .node
            .iter()
            .flat_map(|n| n.attribute.iter())
            .chain(func.attribute_proto.iter())
        {
            attribute_tensors(a, f);
        }
    }
    for info in &model.training_info {
        for g in info.initialization.iter().chain(info.algorithm.iter()) {
            visit_tensors(g, f);
        }
    }
}

fn attribute_tensors_mut(a: &mut AttributeProto, f: &mut dyn FnMut(&mut TensorProto)) {
    fn sparse(s: &mut SparseTensorProto) -> impl Iterator<Item = &mut TensorProto> {
        s.values.iter_mut().chain(s.indices.iter_mut())
    }
    let sparse_tensors = a
        .sparse_tensor
        .iter_mut()
        .chain(a.sparse_tensors.iter_mut())
        .flat_map(sparse);
    for t in
        a.t.iter_mut()
            .chain(a.tensors.iter_mut())
            .chain(sparse_tensors)
    {
        f(t);
    }
    for g in a.g.iter_mut().chain(a.graphs.iter_mut()) {
        visit_tensors_mut(g, f);
    }
}

fn visit_tensors_mut(graph: &mut GraphProto, f: &mut dyn FnMut(&mut TensorProto)) {
    fn sparse(s: &mut SparseTensorProto) -> impl Iterator<Item = &mut TensorProto> {
        s.values.iter_mut().chain(s.indices.iter_mut())
    }
    for t in &mut graph.initializer {
        f(t);
    }
    for t in graph.sparse_initializer.iter_mut().flat_map(sparse) {
        f(t);
    }
    for a in graph.node.iter_mut().flat_map(|n| n.attribute.iter_mut()) {
        attribute_tensors_mut(a, f);
    }
}

fn visit_model_tensors_mut(model: &mut ModelProto, f: &mut dyn FnMut(&mut TensorProto)) {
    if let Some(g) = &mut model.graph {
        visit_tensors_mut(g, f);
    }
    for func in &mut model.functions {
        for a in func
            .node
            .iter_mut()
            .flat_map(|n| n.attribute.iter_mut())
            .chain(func.attribute_proto.iter_mut())
        {
            attribute_tensors_mut(a, f);
        }
    }
    for info in &mut model.training_info {
        for g in info
            .initialization
            .iter_mut()
            .chain(info.algorithm.iter_mut())
        {
            visit_tensors_mut(g, f);
        }
    }
}

pub fn is_external(t: &TensorProto) -> bool {
    t.data_location() as i32 == DataLocation::External as i32
}

/// The value of the one `key` entry of an external tensor's `external_data`; an error text
/// when the key is missing or repeated (onnx and ONNX Runtime read the last of repeated
/// keys, a check that read the first would check the wrong file).
pub fn external_value<'a>(t: &'a TensorProto, key: &str) -> Result<Option<&'a str>, String> {
    let mut found = t.external_data.iter().filter(|e| e.key() == key);
    let first = found.next().map(|e| e.value());
    if found.next().is_some() {
        return Err(format!("has more than one '{key}' key"));
    }
    Ok(first)
}

/// External-data locations of every tensor in the model (see [`visit_model_tensors`]);
/// a missing or repeated `location` key reads as the empty location, which
/// [`check_external_data`] refuses.
pub fn external_locations(model: &ModelProto) -> Vec<(String, String)> {
    let mut found = Vec::new();
    visit_model_tensors(model, &mut |t| {
        if is_external(t) {
            let location = external_value(t, "location")
                .ok()
                .flatten()
                .unwrap_or_default();
            found.push((t.name().to_string(), location.to_string()));
        }
    });
    found
}

/// Refuses external data that is not one plain file inside the model's folder: locations
/// that are empty, repeated, absolute, climb out with `..`, or resolve (through symlinks)
/// outside the folder; files that are not regular; `offset`/`length` that are not numbers
/// or reach past the file's end. Every tensor of the model is checked, wherever it lives.
pub fn check_external_data(model: &ModelProto, dir: &Path) -> Result<(), Error> {
    let mut problems: Vec<(String, String, String)> = Vec::new();
    visit_model_tensors(model, &mut |t| {
        if !is_external(t) || !problems.is_empty() {
            return;
        }
        let location = external_value(t, "location").ok().flatten().unwrap_or("");
        let mut fail = |why: String| {
            problems.push((t.name().to_string(), location.to_string(), why));
        };
        if let Some(key) = repeated_key(t) {
            return fail(format!("has more than one '{key}' key"));
        }
        if location.is_empty() {
            return fail("is empty or missing".into());
        }
        let file = match crate::io::fsio::open_beneath(dir, Path::new(location)) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return fail("names a file that does not exist".into())
            }
            Err(e) => return fail(open_problem(&e)),
        };
        let number = |key: &str| -> Result<Option<u64>, String> {
            match external_value(t, key)? {
                None => Ok(None),
                Some(v) => v
                    .parse::<u64>()
                    .map(Some)
                    .map_err(|_| format!("has {key} '{v}', not a non-negative integer")),
            }
        };
        let (offset, length) = match (number("offset"), number("length")) {
            (Ok(o), Ok(l)) => (o.unwrap_or(0), l),
            (Err(why), _) | (_, Err(why)) => return fail(why),
        };
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        let end = offset.checked_add(length.unwrap_or(0));
        if end.is_none_or(|end| end > size) || offset > size {
            fail(format!(
                "reaches past the end of the {size}-byte file (offset {offset}, length {})",
                length.map_or("rest".into(), |l| l.to_string())
            ));
        }
    });
    match problems.into_iter().next() {
        Some((tensor, location, problem)) => Err(Error::UnsafeExternalData {
            tensor,
            location,
            problem,
        }),
        None => Ok(()),
    }
}

/// An [`crate::io::fsio`] refusal ("it is a directory, ...") or an OS error, as the rest of a
/// sentence about a location.
fn open_problem(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.strip_prefix("it ") {
        Some(rest) => rest.to_string(),
        None => format!("cannot be opened ({text})"),
    }
}

/// A key that occurs more than once in a tensor's `external_data`.
fn repeated_key(t: &TensorProto) -> Option<String> {
    let mut seen = std::collections::BTreeSet::new();
    t.external_data
        .iter()
        .map(|e| e.key())
        .find(|k| !seen.insert(*k))
        .map(str::to_string)
}

// ---------------------------------------------------------------------------------------------
// External data when the output goes to another folder

/// What happens to the external data files when the output is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExternalDataAction {
    /// The model has no external data.
    None,
    /// The output sits beside the model: locations stay as they are.
    Kept,
    /// The output folder holds the data files (it is the model's folder or above it):
    /// locations were rewritten relative to it.
    Relocated,
    /// Some data files were (or already are, identical) copied next to the output.
    Copied,
}

impl ExternalDataAction {
    pub fn name(self) -> &'static str {
        match self {
            ExternalDataAction::None => "none",
            ExternalDataAction::Kept => "kept",
            ExternalDataAction::Relocated => "relocated",
            ExternalDataAction::Copied => "copied",
        }
    }
}

/// How a model's external data follows the output: new locations for the tensors and the
/// files to copy. Made by [`plan_external_data`] before any work, carried out by
/// [`save_model_from`].
#[derive(Debug)]
pub struct ExternalDataPlan {
    pub action: ExternalDataAction,
    /// Location as written in the model → location in the output (only those that change).
    relocate: BTreeMap<String, String>,
    /// Data files to copy, destinations not present yet.
    copies: Vec<DataCopy>,
}

/// One data file to copy: the descriptor opened when the plan was made (inside the model
/// folder), its path, and where the copy goes.
#[derive(Debug)]
struct DataCopy {
    source: File,
    from: PathBuf,
    dest: PathBuf,
}

impl ExternalDataPlan {
    fn unchanged(action: ExternalDataAction) -> Self {
        ExternalDataPlan {
            action,
            relocate: BTreeMap::new(),
            copies: Vec::new(),
        }
    }

    /// Rewrites the tensors' locations to the output's.
    pub fn apply(&self, model: &mut ModelProto) {
        if self.relocate.is_empty() {
            return;
        }
        visit_model_tensors_mut(model, &mut |t| {
            if !is_external(t) {
                return;
            }
            for e in t.external_data.iter_mut().filter(|e| e.key() == "location") {
                if let Some(new) = self.relocate.get(e.value()) {
                    e.value = Some(new.clone());
                }
            }
        });
    }

    /// The location a tensor had in the input model, given the one `apply` wrote (the
    /// input's data files are where the input model is; copies are made only on save).
    pub fn input_location<'l>(&'l self, location: &'l str) -> &'l str {
        self.relocate
            .iter()
            .find(|(_, new)| new.as_str() == location)
            .map_or(location, |(old, _)| old.as_str())
    }

    /// Bytes the plan copies.
    pub fn copy_bytes(&self) -> u64 {
        self.copies
            .iter()
            .filter_map(|c| c.source.metadata().ok())
            .map(|m| m.len())
            .sum()
    }
}

/// A checked relative location without `.` components (`./a/b.bin` → `a/b.bin`).
fn normal_location(location: &str) -> PathBuf {
    Path::new(location)
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .collect()
}

fn location_string(p: &Path) -> String {
    p.components()
        .map(|c| c.as_os_str().to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

/// Decides where the external data of a model at `model` lives for an output at `output`;
/// run [`check_external_data`] first. Beside the model nothing changes. Elsewhere, data files
/// inside the output folder (an output in the model's folder or above it) keep their place and
/// get locations relative to the output; the others (or all, with `force_copy`) are copied next
/// to the output under their own location, refusing to replace a different existing file.
/// Locations with `..` are never written: onnx (`onnx.load`, the checker, and so ORT Training's
/// `generate_artifacts`) refuses them, and so does ntl-patch's own check.
pub fn plan_external_data(
    model: &ModelProto,
    model_path: &Path,
    output: &Path,
    force_copy: bool,
) -> Result<ExternalDataPlan, Error> {
    let locations: Vec<String> = external_locations(model)
        .into_iter()
        .map(|(_, l)| l)
        .collect();
    if locations.is_empty() {
        return Ok(ExternalDataPlan::unchanged(ExternalDataAction::None));
    }
    let canon = |dir: PathBuf, write: bool| {
        dir.canonicalize().map_err(|source| {
            if write {
                Error::Write { path: dir, source }
            } else {
                Error::Read { path: dir, source }
            }
        })
    };
    let from = canon(model_dir(model_path), false)?;
    let to = canon(model_dir(output), true)?;
    // The output must not replace a data file the model (and so the output) reads.
    let target = output.file_name().map(|n| to.join(n));
    for location in &locations {
        let data = from.join(normal_location(location)).canonicalize().ok();
        if data.is_some()
            && (data == target || data == target.as_ref().and_then(|t| t.canonicalize().ok()))
        {
            return Err(Error::OutputIsInput(output.to_path_buf()));
        }
    }
    if from == to {
        return Ok(ExternalDataPlan::unchanged(ExternalDataAction::Kept));
    }
    let mut plan = ExternalDataPlan::unchanged(ExternalDataAction::Relocated);
    let mut seen = std::collections::BTreeSet::new();
    for location in locations {
        if !seen.insert(location.clone()) {
            continue;
        }
        let rel = normal_location(&location);
        let data = from.join(&rel);
        // kept in place only where the output's own check will accept the new location (a
        // hub cache blob is read from its snapshot folder, not from a folder above it)
        let reachable = |inside: &Path| crate::io::fsio::open_beneath(&to, inside).is_ok();
        match data.strip_prefix(&to) {
            Ok(inside) if !force_copy && inside.to_str().is_some() && reachable(inside) => {
                plan.relocate
                    .insert(location.clone(), location_string(inside));
            }
            _ => {
                plan.action = ExternalDataAction::Copied;
                let dest = to.join(&rel);
                if location_string(&rel) != location {
                    plan.relocate
                        .insert(location.clone(), location_string(&rel));
                }
                // Opened now, inside the model folder without following symlinks out of it;
                // the copy reads this descriptor, so a later swap of the path changes nothing.
                let source = crate::io::fsio::open_beneath(&from, &rel).map_err(|e| {
                    Error::UnsafeExternalData {
                        tensor: String::new(),
                        location: location.clone(),
                        problem: open_problem(&e),
                    }
                })?;
                if dest.symlink_metadata().is_ok() {
                    if !same_content(&data, &dest).map_err(|source| Error::Read {
                        path: dest.clone(),
                        source,
                    })? {
                        return Err(Error::ExternalDataConflict { path: dest });
                    }
                } else if !plan.copies.iter().any(|c| c.dest == dest) {
                    plan.copies.push(DataCopy {
                        source,
                        from: data,
                        dest,
                    });
                }
            }
        }
    }
    Ok(plan)
}

/// True when the files at `a` and `b` are the same file or hold the same bytes.
fn same_content(a: &Path, b: &Path) -> std::io::Result<bool> {
    let (ma, mb) = (std::fs::metadata(a)?, std::fs::metadata(b)?);
    if !mb.is_file() {
        return Ok(false);
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if ma.dev() == mb.dev() && ma.ino() == mb.ino() {
            return Ok(true);
        }
    }
    if ma.len() != mb.len() {
        return Ok(false);
    }
    let (mut fa, mut fb) = (File::open(a)?, File::open(b)?);
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let n = read_full(&mut fa, &mut ba)?;
        if read_full(&mut fb, &mut bb[..n])? != n || ba[..n] != bb[..n] {
            return Ok(false);
        }
        if n < ba.len() {
            // a's end; b has the same length
            return Ok(true);
        }
    }
}

fn read_full(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Copies each planned data file atomically (temp file beside the destination, then a rename
/// that never replaces an existing file). Returns the files created.
fn copy_external_files(
    plan: &ExternalDataPlan,
) -> Result<(Vec<PathBuf>, Vec<crate::io::temp::Tracked>), Error> {
    let mut created = Vec::new();
    let mut tracked = Vec::new();
    let progress = Progress::start("copying external data", Some(plan.copy_bytes()));
    let mut done = 0;
    let result = (|| {
        for DataCopy { source, from, dest } in &plan.copies {
            let write_err = |source| Error::Write {
                path: dest.clone(),
                source,
            };
            let dir = model_dir(dest);
            std::fs::create_dir_all(&dir).map_err(write_err)?;
            let mut tmp = TempFile::new_in(&dir).map_err(write_err)?;
            let mut input = source;
            input
                .seek(SeekFrom::Start(0))
                .map_err(|source| Error::Read {
                    path: from.clone(),
                    source,
                })?;
            loop {
                // in steps, for the progress; each is a kernel copy (copy_file_range)
                let n = std::io::copy(&mut input.take(COPY_STEP), tmp.as_file_mut())
                    .map_err(write_err)?;
                done += n;
                progress.set(done);
                if n < COPY_STEP {
                    break;
                }
            }
            tmp.as_file().sync_all().map_err(write_err)?;
            set_readable(tmp.as_file()).map_err(write_err)?;
            match tmp.persist_noclobber(dest) {
                Ok(guard) => {
                    created.push(dest.clone());
                    tracked.push(guard);
                }
                // Appeared meanwhile: fine when it holds the same bytes.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    if !same_content(from, dest).map_err(write_err)? {
                        return Err(Error::ExternalDataConflict { path: dest.clone() });
                    }
                }
                Err(e) => return Err(write_err(e)),
            }
        }
        Ok(())
    })();
    match result {
        Ok(()) => Ok((created, tracked)),
        Err(e) => {
            remove_all(&created);
            Err(e)
        }
    }
}

fn remove_all(files: &[PathBuf]) {
    for f in files {
        let _ = std::fs::remove_file(f);
    }
}

// ---------------------------------------------------------------------------------------------
// The streaming encoder

/// One piece of a model's encoding: encoded bytes, or a payload (a slice of the input map
/// where the model was loaded zero-copy).
enum Piece<'a> {
    Buf(&'a [u8]),
    Data(&'a Bytes),
}

fn header(tag: u32, len: usize, scratch: &mut Vec<u8>) {
    scratch.clear();
    encode_key(tag, WireType::LengthDelimited, scratch);
    encode_varint(len as u64, scratch);
}

/// Splits an encoded message at field `tag` (absent from it): the bytes of the fields before
/// it and after it. prost writes fields in field-number order, so the fields numbered below
/// `tag` come first; splitting at the first field numbered above keeps any order valid.
fn split_at_field(encoded: &[u8], tag: u32) -> (&[u8], &[u8]) {
    let mut rest = encoded;
    loop {
        let at = encoded.len() - rest.len();
        let mut cursor = rest;
        let Ok((field, wire_type)) = prost::encoding::decode_key(&mut cursor) else {
            return (encoded, &[]);
        };
        if field > tag {
            return encoded.split_at(at);
        }
        if prost::encoding::skip_field(wire_type, field, &mut cursor, Default::default()).is_err() {
            return (encoded, &[]);
        }
        rest = cursor;
        if rest.is_empty() {
            return (encoded, &[]);
        }
    }
}

/// Emits `model`'s encoding piece by piece, in order, without building it: the model and
/// graph "shells" (everything but the graph and the initializers) are encoded on their own,
/// each initializer one at a time. Memory stays at one tensor's encoding, whatever the
/// number of initializers.
fn emit_model(
    model: &ModelProto,
    out: &mut dyn FnMut(Piece<'_>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let Some(graph) = &model.graph else {
        return out(Piece::Buf(&model.encode_to_vec()));
    };
    // every field but the graph (listed, not `..clone()`: that would copy the whole graph)
    let shell = ModelProto {
        ir_version: model.ir_version,
        opset_import: model.opset_import.clone(),
        producer_name: model.producer_name.clone(),
        producer_version: model.producer_version.clone(),
        domain: model.domain.clone(),
        model_version: model.model_version,
        doc_string: model.doc_string.clone(),
        graph: None,
        metadata_props: model.metadata_props.clone(),
        training_info: model.training_info.clone(),
        functions: model.functions.clone(),
        configuration: model.configuration.clone(),
    }
    .encode_to_vec();
    let (before, after) = split_at_field(&shell, MODEL_GRAPH);
    let mut scratch = Vec::new();
    out(Piece::Buf(before))?;
    header(MODEL_GRAPH, graph.encoded_len(), &mut scratch);
    out(Piece::Buf(&scratch))?;
    emit_graph(graph, out)?;
    out(Piece::Buf(after))
}

fn emit_graph(
    graph: &GraphProto,
    out: &mut dyn FnMut(Piece<'_>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    // the nodes first (field 1, the lowest, comes first in prost's encoding too), encoded
    // from the graph about a megabyte at a time rather than copied into the shell below
    let mut scratch = Vec::new();
    for node in &graph.node {
        prost::encoding::message::encode(GRAPH_NODE, node, &mut scratch);
        if scratch.len() >= 1 << 20 {
            out(Piece::Buf(&scratch))?;
            scratch.clear();
        }
    }
    out(Piece::Buf(&scratch))?;
    let shell = GraphProto {
        node: Vec::new(),
        name: graph.name.clone(),
        initializer: Vec::new(),
        sparse_initializer: graph.sparse_initializer.clone(),
        doc_string: graph.doc_string.clone(),
        input: graph.input.clone(),
        output: graph.output.clone(),
        value_info: graph.value_info.clone(),
        quantization_annotation: graph.quantization_annotation.clone(),
        metadata_props: graph.metadata_props.clone(),
    }
    .encode_to_vec();
    let (before, after) = split_at_field(&shell, GRAPH_INITIALIZER);
    out(Piece::Buf(before))?;
    for t in &graph.initializer {
        header(GRAPH_INITIALIZER, t.encoded_len(), &mut scratch);
        out(Piece::Buf(&scratch))?;
        emit_tensor(t, &mut scratch, out)?;
    }
    out(Piece::Buf(after))
}

fn emit_tensor(
    t: &TensorProto,
    scratch: &mut Vec<u8>,
    out: &mut dyn FnMut(Piece<'_>) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let raw = match &t.raw_data {
        Some(raw) if raw.len() >= STREAM_MIN => raw,
        _ => {
            scratch.clear();
            t.encode(scratch).expect("a Vec grows");
            return out(Piece::Buf(scratch));
        }
    };
    let shell = TensorProto {
        raw_data: None,
        ..t.clone()
    }
    .encode_to_vec();
    let (before, after) = split_at_field(&shell, TENSOR_RAW_DATA);
    out(Piece::Buf(before))?;
    header(TENSOR_RAW_DATA, raw.len(), scratch);
    out(Piece::Buf(scratch))?;
    out(Piece::Data(raw))?;
    out(Piece::Buf(after))
}

/// Writes `model`'s protobuf encoding to `w` without building it in memory: byte for byte what
/// `model.encode_to_vec()` gives. Returns the number of bytes written.
pub fn encode_streaming(model: &ModelProto, w: &mut impl Write) -> std::io::Result<u64> {
    let mut written = 0u64;
    emit_model(model, &mut |piece| {
        let bytes: &[u8] = match piece {
            Piece::Buf(b) => b,
            Piece::Data(d) => d,
        };
        written += bytes.len() as u64;
        w.write_all(bytes)
    })?;
    check_length(model, written)?;
    Ok(written)
}

fn check_length(model: &ModelProto, written: u64) -> std::io::Result<()> {
    let expected = model.encoded_len() as u64;
    if written != expected {
        return Err(std::io::Error::other(format!(
            "internal error: streaming encoder wrote {written} bytes, the model encodes to {expected}"
        )));
    }
    Ok(())
}

/// Writes `model` to `out`, payloads from the input file where they are slices of it.
/// Returns the number of bytes written.
fn write_model(
    model: &ModelProto,
    out: &mut BufWriter<File>,
    source: Option<&ModelSource>,
    progress: &Progress,
) -> std::io::Result<u64> {
    let mut done = 0u64;
    let mut released = 0u64;
    emit_model(model, &mut |piece| {
        match piece {
            Piece::Buf(b) => {
                out.write_all(b)?;
                done += b.len() as u64;
            }
            Piece::Data(d) => {
                match source.and_then(|s| s.offset_of(d).map(|o| (s, o))) {
                    Some((s, offset)) => {
                        out.flush()?;
                        let mut input = &s.file;
                        input.seek(SeekFrom::Start(offset))?;
                        // File to file: the kernel copies (copy_file_range), the bytes never
                        // pass through this process.
                        let n = std::io::copy(&mut input.take(d.len() as u64), out.get_mut())?;
                        if n != d.len() as u64 {
                            return Err(std::io::Error::new(
                                std::io::ErrorKind::UnexpectedEof,
                                "the input model changed while it was being read",
                            ));
                        }
                    }
                    None => out.write_all(d)?,
                }
                done += d.len() as u64;
            }
        }
        progress.set(done);
        // small payloads are encoded from the map: give its pages back as we go
        if done - released >= RELEASE_STEP {
            if let Some(s) = source {
                s.release();
            }
            released = done;
        }
        Ok(())
    })?;
    out.flush()?;
    Ok(done)
}

/// Encodes `model` and writes it atomically to `out` (temp file in the same folder, then rename).
pub fn save_model_atomic(model: &ModelProto, out: &Path) -> Result<(), Error> {
    save_model_from(model, out, None, None)
}

/// Writes `model` atomically to `out`, streaming payloads from `source` (the input it was
/// loaded from) and first copying the external data files `external` plans. On error nothing
/// is left behind: no output, no copied data file.
pub fn save_model_from(
    model: &ModelProto,
    out: &Path,
    source: Option<&ModelSource>,
    external: Option<&ExternalDataPlan>,
) -> Result<(), Error> {
    let write_err = |source| Error::Write {
        path: out.to_path_buf(),
        source,
    };
    crate::io::fsio::check_output_path(out).map_err(write_err)?;
    let dir = model_dir(out);
    let tmp = TempFile::new_in(&dir).map_err(write_err)?;
    // the copies stay registered for removal on a signal until the model is in place
    let (copied, _tracked) = match external {
        Some(plan) if !plan.copies.is_empty() => copy_external_files(plan)?,
        _ => (Vec::new(), Vec::new()),
    };
    let result = (|| {
        let total = model.encoded_len() as u64;
        let progress = Progress::start(&format!("writing {}", out.display()), Some(total));
        let mut w =
            BufWriter::with_capacity(1 << 20, tmp.as_file().try_clone().map_err(write_err)?);
        let written =
            write_model(model, &mut w, source, &progress).map_err(|e| match (e, source) {
                (e, Some(s)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    Error::InputChanged {
                        path: s.path.clone(),
                    }
                }
                (e, _) => write_err(e),
            })?;
        check_length(model, written).map_err(|e| Error::Inconsistent(e.to_string()))?;
        let file = w.into_inner().map_err(|e| write_err(e.into_error()))?;
        file.sync_all().map_err(write_err)?;
        set_readable(&file).map_err(write_err)?;
        tmp.persist(out).map_err(write_err)?;
        Ok(())
    })();
    if result.is_err() {
        remove_all(&copied);
    }
    result
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_finds_the_gap() {
        let t = TensorProto {
            dims: vec![2, 3],
            data_type: Some(1),
            name: Some("w".into()),
            doc_string: Some("d".into()),
            ..Default::default()
        };
        let enc = t.encode_to_vec();
        let (before, after) = split_at_field(&enc, TENSOR_RAW_DATA);
        assert_eq!(before.len() + after.len(), enc.len());
        // doc_string (12) comes after raw_data (9)
        assert_eq!(after[0] >> 3, 12);
    }

    #[test]
    fn streaming_equals_encode_to_vec() {
        let raw = Bytes::from(vec![7u8; 3 * STREAM_MIN]);
        let t = TensorProto {
            dims: vec![3, STREAM_MIN as i64],
            data_type: Some(2),
            name: Some("big".into()),
            raw_data: Some(raw),
            doc_string: Some("after raw".into()),
            external_data: vec![],
            ..Default::default()
        };
        let small = TensorProto {
            raw_data: Some(Bytes::from_static(b"abc")),
            ..t.clone()
        };
        let model = ModelProto {
            ir_version: Some(8),
            producer_name: Some("p".into()),
            graph: Some(GraphProto {
                node: vec![
                    crate::onnx::NodeProto {
                        op_type: Some("Identity".into()),
                        input: vec!["big".into()],
                        output: vec!["y".into()],
                        ..Default::default()
                    };
                    3
                ],
                name: Some("g".into()),
                initializer: vec![t.clone(), small, t],
                doc_string: Some("graph doc".into()),
                ..Default::default()
            }),
            metadata_props: vec![crate::onnx::StringStringEntryProto {
                key: Some("k".into()),
                value: Some("v".into()),
            }],
            ..Default::default()
        };
        let mut out = Vec::new();
        let n = encode_streaming(&model, &mut out).unwrap();
        assert_eq!(n as usize, out.len());
        assert!(out == model.encode_to_vec());
    }
}

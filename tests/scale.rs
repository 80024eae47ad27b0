//! Large-model plumbing: the streaming encoder writes exactly what `encode_to_vec` would, and
//! external data stays valid (or is copied) when the output goes to another folder, while
//! locations escaping the model folder are refused. Timings live in scripts/bench/bench_scale.sh.

mod common;

use std::path::{Path, PathBuf};

use bytes::Bytes;
use common::*;
use ntl_patch::io::model_io::{
    check_external_data, encode_streaming, external_locations, load_model, load_model_source,
    model_dir, save_model_from,
};
use ntl_patch::onnx::proto::tensor_proto::DataLocation;
use ntl_patch::onnx::{ModelProto, StringStringEntryProto, TensorProto};
use prost::Message;

const FIXTURES: [&str; 5] = ["lm_flat", "lm_bvt", "lm_nll", "lm_two_ce", "lm_no_ce"];

fn streamed(m: &ModelProto) -> Vec<u8> {
    let mut out = Vec::new();
    let n = encode_streaming(m, &mut out).unwrap();
    assert_eq!(n as usize, out.len());
    out
}

/// `model` plus an unused float initializer of `bytes` bytes (streamed, not buffered).
fn with_big_initializer(mut m: ModelProto, bytes: usize) -> ModelProto {
    let payload: Vec<u8> = (0..bytes).map(|i| (i * 31 % 251) as u8).collect();
    m.graph.as_mut().unwrap().initializer.insert(
        1,
        TensorProto {
            name: Some("big.unused".into()),
            dims: vec![(bytes / 4) as i64],
            data_type: Some(ntl_patch::onnx::FLOAT),
            raw_data: Some(Bytes::from(payload)),
            doc_string: Some("a field after raw_data".into()),
            ..Default::default()
        },
    );
    m
}

#[test]
fn streaming_encoder_equals_encode_to_vec_on_fixtures() {
    let dir = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let m = load_model(&model(name)).unwrap();
        assert!(streamed(&m) == m.encode_to_vec(), "{name}: fixture");
        let big = with_big_initializer(m, 1 << 20);
        assert!(
            streamed(&big) == big.encode_to_vec(),
            "{name}: with a 1 MiB initializer"
        );
    }
    for name in MODELS {
        for loss in ["wasserstein", "ntil", "number-level"] {
            let out = patch(&model(name), dir.path(), &["--loss", loss]);
            let m = load_model(&out).unwrap();
            assert!(streamed(&m) == m.encode_to_vec(), "{name} {loss}: patched");
            assert!(
                std::fs::read(&out).unwrap() == m.encode_to_vec(),
                "{name} {loss}: file"
            );
        }
    }
}

/// Payloads that are slices of the input map are copied file to file; the bytes are the same.
#[test]
fn save_from_the_mapped_input_is_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("big.onnx");
    let big = with_big_initializer(read_model(&model("lm_flat")), 3 << 20);
    std::fs::write(&input, big.encode_to_vec()).unwrap();
    let (m, source) = load_model_source(&input).unwrap();
    let out = dir.path().join("copy.onnx");
    save_model_from(&m, &out, Some(&source), None).unwrap();
    assert!(std::fs::read(&out).unwrap() == big.encode_to_vec());
    // and a patched big model decodes to the patched graph with the payload intact
    let patched = patch(&input, dir.path(), &[]);
    let p = read_model(&patched);
    let t = &p.graph.as_ref().unwrap().initializer[1];
    assert_eq!(
        t.raw_data,
        big.graph.as_ref().unwrap().initializer[1].raw_data
    );
    let names = |m: &ModelProto| m.graph.as_ref().unwrap().node.len();
    assert!(names(&p) > names(&big));
}

// ------------------------------------------------------------------ external data

/// Writes lm_flat with its initializers in external files under `dir`: the first half in
/// `data/a.bin`, the rest in `b.bin`. Returns the model path; tokenizer.json sits beside it.
fn external_model(dir: &Path) -> PathBuf {
    let mut m = read_model(&model("lm_flat"));
    let mut blobs: [(String, Vec<u8>); 2] =
        [("data/a.bin".into(), vec![]), ("./b.bin".into(), vec![])];
    let inits = &mut m.graph.as_mut().unwrap().initializer;
    let half = inits.len() / 2;
    for (i, t) in inits.iter_mut().enumerate() {
        let (location, blob) = &mut blobs[usize::from(i >= half)];
        let bytes = t.raw_data.take().unwrap();
        let entry = |k: &str, v: String| StringStringEntryProto {
            key: Some(k.into()),
            value: Some(v),
        };
        t.external_data = vec![
            entry("location", location.clone()),
            entry("offset", blob.len().to_string()),
            entry("length", bytes.len().to_string()),
        ];
        t.data_location = Some(DataLocation::External as i32);
        blob.extend_from_slice(&bytes);
    }
    for (location, blob) in &blobs {
        let path = dir.join(location);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, blob).unwrap();
    }
    std::fs::copy(tokenizer(), dir.join("tokenizer.json")).unwrap();
    let path = dir.join("model.onnx");
    std::fs::write(&path, m.encode_to_vec()).unwrap();
    path
}

/// The bytes every external tensor of the model at `path` names, by tensor.
fn external_payloads(path: &Path) -> Vec<(String, PathBuf, Vec<u8>)> {
    let m = read_model(path);
    let g = m.graph.as_ref().unwrap();
    check_external_data(&m, &model_dir(path)).expect("locations stay inside the output folder");
    let mut out = Vec::new();
    for t in &g.initializer {
        let get = |k: &str| {
            t.external_data
                .iter()
                .find(|e| e.key() == k)
                .map(|e| e.value().to_string())
        };
        let Some(location) = get("location") else {
            continue;
        };
        let file = model_dir(path).join(&location).canonicalize().unwrap();
        let offset: usize = get("offset").unwrap().parse().unwrap();
        let length: usize = get("length").unwrap().parse().unwrap();
        let bytes = std::fs::read(&file).unwrap()[offset..offset + length].to_vec();
        out.push((t.name().to_string(), file, bytes));
    }
    out
}

fn patch_to(model: &Path, out: &Path, extra: &[&str]) -> serde_json::Value {
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let assert = bin()
        .arg(model)
        .args(extra)
        .arg("--json")
        .arg("-o")
        .arg(out)
        .assert()
        .success();
    serde_json::from_slice(&assert.get_output().stdout).unwrap()
}

fn same_bytes_as_input(input: &Path, output: &Path) {
    let (a, b) = (external_payloads(input), external_payloads(output));
    assert_eq!(a.len(), 15);
    assert_eq!(a.len(), b.len());
    for ((na, _, ba), (nb, _, bb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert!(ba == bb, "{na}: same bytes");
    }
}

#[test]
fn external_data_beside_the_model_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let m = external_model(dir.path());
    let out = dir.path().join("out.onnx");
    assert_eq!(patch_to(&m, &out, &[])["external_data"], "kept");
    let locs = external_locations(&read_model(&out));
    assert!(
        locs.iter().any(|(_, l)| l == "./b.bin"),
        "locations untouched: {locs:?}"
    );
    same_bytes_as_input(&m, &out);
}

#[test]
fn output_above_the_model_folder_gets_relative_locations() {
    let dir = tempfile::tempdir().unwrap();
    let m = external_model(&dir.path().join("model"));
    let out = dir.path().join("out.onnx");
    assert_eq!(patch_to(&m, &out, &[])["external_data"], "relocated");
    let mut locs: Vec<String> = external_locations(&read_model(&out))
        .into_iter()
        .map(|(_, l)| l)
        .collect();
    locs.dedup();
    assert_eq!(locs, ["model/data/a.bin", "model/b.bin"]);
    // the same files, not copies
    let files = |p: &Path| {
        let mut f: Vec<PathBuf> = external_payloads(p)
            .into_iter()
            .map(|(_, f, _)| f)
            .collect();
        f.dedup();
        f
    };
    assert_eq!(files(&m), files(&out));
    same_bytes_as_input(&m, &out);
    assert!(!dir.path().join("b.bin").exists(), "nothing copied");
}

#[test]
fn output_in_another_folder_gets_copies() {
    let dir = tempfile::tempdir().unwrap();
    let m = external_model(&dir.path().join("model"));
    // a sibling folder, and a folder inside the model's that does not hold the data
    for out in [
        dir.path().join("elsewhere/out.onnx"),
        dir.path().join("model/sub/out.onnx"),
    ] {
        assert_eq!(patch_to(&m, &out, &[])["external_data"], "copied");
        let o = model_dir(&out);
        assert!(o.join("data/a.bin").is_file() && o.join("b.bin").is_file());
        let locs = external_locations(&read_model(&out));
        assert!(
            locs.iter().all(|(_, l)| l == "data/a.bin" || l == "b.bin"),
            "{locs:?}"
        );
        same_bytes_as_input(&m, &out);
        assert!(external_payloads(&out)
            .iter()
            .all(|(_, f, _)| f.starts_with(o.canonicalize().unwrap())));
        // again: identical copies already there are fine
        assert_eq!(patch_to(&m, &out, &[])["external_data"], "copied");
    }
}

#[test]
fn copy_external_data_flag_copies_even_when_reachable() {
    let dir = tempfile::tempdir().unwrap();
    let m = external_model(&dir.path().join("model"));
    let out = dir.path().join("out.onnx");
    assert_eq!(
        patch_to(&m, &out, &["--copy-external-data"])["external_data"],
        "copied"
    );
    assert!(dir.path().join("data/a.bin").is_file() && dir.path().join("b.bin").is_file());
    same_bytes_as_input(&m, &out);
}

#[test]
fn a_different_existing_data_file_is_not_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let m = external_model(&dir.path().join("model"));
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("b.bin"), b"someone else's weights").unwrap();
    let out = other.join("out.onnx");
    let assert = bin().arg(&m).arg("-o").arg(&out).assert().code(1);
    let stderr = String::from_utf8_lossy(&assert.get_output().stderr).to_string();
    assert!(stderr.contains("already exists and differs"), "{stderr}");
    assert!(!out.exists(), "no output on error");
    assert_eq!(
        std::fs::read(other.join("b.bin")).unwrap(),
        b"someone else's weights"
    );
    let left: Vec<_> = std::fs::read_dir(&other)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 1, "nothing else written: {left:?}");
}

#[test]
fn the_output_never_replaces_a_data_file() {
    let dir = tempfile::tempdir().unwrap();
    let m = external_model(dir.path());
    let before = std::fs::read(dir.path().join("b.bin")).unwrap();
    bin()
        .arg(&m)
        .arg("-o")
        .arg(dir.path().join("b.bin"))
        .assert()
        .code(1);
    assert_eq!(std::fs::read(dir.path().join("b.bin")).unwrap(), before);
}

#[test]
fn the_patched_copy_validates_with_tract() {
    let dir = tempfile::tempdir().unwrap();
    let m = external_model(&dir.path().join("model"));
    let out = dir.path().join("elsewhere/out.onnx");
    patch_to(&m, &out, &[]);
    bin()
        .arg("validate")
        .arg(&out)
        .arg("--tokenizer")
        .arg(tokenizer())
        .assert()
        .success();
}

/// ONNX Runtime loads the data files of an output written to another folder (the copies).
#[test]
fn the_patched_copy_validates_with_onnx_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let m = external_model(&dir.path().join("model"));
    for out in [
        dir.path().join("elsewhere/out.onnx"),
        dir.path().join("up.onnx"),
    ] {
        patch_to(&m, &out, &[]);
        bin()
            .arg("validate")
            .arg(&out)
            .args(["--runtime", "ort", "--tokenizer"])
            .arg(tokenizer())
            .env("ORT_DYLIB_PATH", ort_library())
            .assert()
            .success();
    }
}

/// Writes a model whose first initializer lives at `location` (relative to `dir`).
/// Patches `model` to `out` expecting a refusal: exit code 1, no output; its stderr.
fn refused(model: &Path, out: &Path) -> String {
    let assert = bin()
        .arg(model)
        .arg("--tokenizer")
        .arg(tokenizer())
        .arg("-o")
        .arg(out)
        .assert()
        .code(1);
    assert!(!out.exists(), "{}: no output", model.display());
    String::from_utf8_lossy(&assert.get_output().stderr).to_string()
}

fn model_with_location(dir: &Path, location: &str) -> PathBuf {
    let mut m = read_model(&model("lm_flat"));
    let t = &mut m.graph.as_mut().unwrap().initializer[0];
    let n = t.raw_data.take().unwrap().len();
    t.external_data = vec![
        StringStringEntryProto {
            key: Some("location".into()),
            value: Some(location.into()),
        },
        StringStringEntryProto {
            key: Some("length".into()),
            value: Some(n.to_string()),
        },
    ];
    t.data_location = Some(DataLocation::External as i32);
    let path = dir.join("model.onnx");
    std::fs::write(&path, m.encode_to_vec()).unwrap();
    path
}

#[test]
fn escaping_locations_are_refused_wherever_the_output_goes() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("model");
    std::fs::create_dir_all(&dir).unwrap();
    let outside = root.path().join("outside.bin");
    std::fs::write(&outside, vec![0u8; 4096]).unwrap();
    let mut cases = vec![
        "../outside.bin".to_string(),
        outside.display().to_string(),
        "".into(),
        "data/../../outside.bin".into(),
    ];
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(&outside, dir.join("link.bin")).unwrap();
        std::os::unix::fs::symlink(root.path(), dir.join("up")).unwrap();
        cases.push("link.bin".into());
        cases.push("up/outside.bin".into());
    }
    for location in &cases {
        let m = model_with_location(&dir, location);
        for out in [
            dir.join("out.onnx"),
            root.path().join("out.onnx"),
            root.path().join("x/out.onnx"),
        ] {
            std::fs::create_dir_all(out.parent().unwrap()).unwrap();
            let stderr = refused(&m, &out);
            assert!(
                stderr.contains("external data location"),
                "{location}: {stderr}"
            );
        }
    }
    assert!(!root.path().join("x/outside.bin").exists());
}

/// Tensors inside subgraphs (an If branch's Constant) are checked too.
#[test]
fn escaping_locations_in_subgraphs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = read_model(&model("lm_flat"));
    let mut t = ntl_patch::onnx::f32_tensor("c", &[1], &[]);
    t.data_location = Some(DataLocation::External as i32);
    t.external_data = vec![StringStringEntryProto {
        key: Some("location".into()),
        value: Some("../../etc/passwd".into()),
    }];
    let branch = ntl_patch::onnx::GraphProto {
        name: Some("branch".into()),
        node: vec![ntl_patch::onnx::NodeProto {
            op_type: Some("Constant".into()),
            output: vec!["c_out".into()],
            attribute: vec![ntl_patch::onnx::tensor_attr("value", t)],
            ..Default::default()
        }],
        ..Default::default()
    };
    let g = m.graph.as_mut().unwrap();
    g.node[0].attribute.push(ntl_patch::onnx::AttributeProto {
        name: Some("then_branch".into()),
        r#type: Some(5),
        g: Some(branch),
        ..Default::default()
    });
    assert_eq!(external_locations(&m).len(), 1);
    let path = dir.path().join("model.onnx");
    std::fs::write(&path, m.encode_to_vec()).unwrap();
    let stderr = refused(&path, &dir.path().join("out.onnx"));
    assert!(
        stderr.contains("external data location '../../etc/passwd'"),
        "{stderr}"
    );
}

/// A symlink may lead out of the folder on the way as long as the file it ends at is inside
/// it (an absolute link to a file beside the model), and a model in a Hugging Face hub cache
/// snapshot reads its repository's blobs; every other target outside stays refused.
#[cfg(unix)]
#[test]
fn symlinks_ending_inside_the_folder_or_in_the_hub_cache_blobs_are_read() {
    use std::os::unix::fs::symlink;
    let root = tempfile::tempdir().unwrap();
    let root = root.path().canonicalize().unwrap();
    let payload = vec![0u8; 4096];
    let patches = |m: &Path, outs: &[PathBuf]| {
        for out in outs {
            patch_to(m, out, &["--tokenizer", tokenizer().to_str().unwrap()]);
            // the output's locations pass the same check
            check_external_data(&read_model(out), &model_dir(out)).unwrap();
            std::fs::remove_file(out).unwrap();
        }
    };

    // an absolute symlink whose target is in the same folder
    let dir = root.join("plain");
    std::fs::create_dir_all(dir.join("weights")).unwrap();
    std::fs::write(dir.join("weights/real.bin"), &payload).unwrap();
    symlink(dir.join("weights/real.bin"), dir.join("w.bin")).unwrap();
    let m = model_with_location(&dir, "w.bin");
    patches(&m, &[dir.join("out.onnx"), root.join("elsewhere/out.onnx")]);
    assert_eq!(
        std::fs::read(root.join("elsewhere/w.bin")).unwrap(),
        payload,
        "copied from the target"
    );

    // the hub cache: snapshots/<rev>/model.onnx_data -> ../../blobs/<sha256>
    let sha = "5e".repeat(32);
    let rev = "0a".repeat(20);
    let hub = |repo: &str, blob: &str, link: &str| {
        let repo = root.join("hub").join(repo);
        let snapshot = repo.join("snapshots").join(&rev);
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::write(repo.join("blobs").join(blob), &payload).unwrap();
        symlink(link, snapshot.join("model.onnx_data")).unwrap();
        (repo, model_with_location(&snapshot, "model.onnx_data"))
    };
    let (repo, m) = hub("models--org--tiny", &sha, &format!("../../blobs/{sha}"));
    patches(
        &m,
        &[
            repo.join("snapshots").join(&rev).join("out.onnx"),
            repo.join("out.onnx"), // relative location through the snapshot
            repo.join("snapshots/out.onnx"), // there the blob is outside: copied
            root.join("elsewhere/hub.onnx"),
        ],
    );

    // outside and not that layout: refused
    let another = format!("../../../models--org--other/blobs/{sha}");
    let refused_models = [
        hub("other--org--tiny", &sha, &format!("../../blobs/{sha}")).1,
        hub(
            "models--org--named",
            "weights.bin",
            "../../blobs/weights.bin",
        )
        .1,
        {
            hub("models--org--other", &sha, &format!("../../blobs/{sha}"));
            hub("models--org--thief", "unused", &another).1
        },
    ];
    for m in refused_models {
        let stderr = refused(&m, &root.join("refused.onnx"));
        assert!(
            stderr.contains("resolves (through a symlink) outside"),
            "{}: {stderr}",
            m.display()
        );
    }
}

/// Writes `lm_flat` plus an unused float initializer of `bytes` zero bytes that are a hole of
/// the file (no disk blocks): the initializer's `raw_data` is the last field of the file.
fn sparse_model(path: &Path, bytes: u64) {
    use prost::encoding::{encode_key, encode_varint, encoded_len_varint, WireType};
    let mut m = read_model(&model("lm_flat"));
    let graph = m.graph.take().unwrap().encode_to_vec();
    let header = TensorProto {
        name: Some("big.zeros".into()),
        dims: vec![(bytes / 4) as i64],
        data_type: Some(ntl_patch::onnx::FLOAT),
        ..Default::default()
    }
    .encode_to_vec();
    let raw_len = 1 + encoded_len_varint(bytes) as u64 + bytes; // field 9: key, length, bytes
    let tensor_len = header.len() as u64 + raw_len;
    let graph_len = graph.len() as u64 + 1 + encoded_len_varint(tensor_len) as u64 + tensor_len; // field 5
    let mut out = m.encode_to_vec();
    encode_key(7, WireType::LengthDelimited, &mut out); // ModelProto.graph
    encode_varint(graph_len, &mut out);
    out.extend_from_slice(&graph);
    encode_key(5, WireType::LengthDelimited, &mut out); // GraphProto.initializer
    encode_varint(tensor_len, &mut out);
    out.extend_from_slice(&header);
    encode_key(9, WireType::LengthDelimited, &mut out); // TensorProto.raw_data
    encode_varint(bytes, &mut out);
    let f = std::fs::File::create(path).unwrap();
    std::io::Write::write_all(&mut &f, &out).unwrap();
    f.set_len(out.len() as u64 + bytes).unwrap();
}

/// Name, length, modification time and (for small files) bytes of every entry of `dir`.
fn listing(dir: &Path) -> Vec<(String, u64, std::time::SystemTime, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let meta = std::fs::symlink_metadata(e.path()).unwrap();
            let bytes = if meta.len() < 1 << 20 {
                std::fs::read(e.path()).unwrap()
            } else {
                Vec::new()
            };
            let name = e.file_name().to_string_lossy().into_owned();
            (name, meta.len(), meta.modified().unwrap(), bytes)
        })
        .collect();
    v.sort();
    v
}

/// The largest file in `dir` (other than `except`) that process `pid` has open, in bytes.
fn open_file_size_in(pid: u32, dir: &Path, except: &Path) -> u64 {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    fds.flatten()
        .filter(|fd| {
            std::fs::read_link(fd.path())
                .is_ok_and(|target| target.starts_with(dir) && target != except)
        })
        .filter_map(|fd| std::fs::metadata(fd.path()).ok())
        .map(|m| m.len())
        .max()
        .unwrap_or(0)
}

/// SIGKILL during the write of a large output (a 1 GiB inline initializer, copied into the
/// output) leaves the folder exactly as it was: the output is written into an unnamed file
/// (O_TMPFILE) that only gets a name once complete, so no temporary file remains, and the
/// output it would have replaced is untouched.
#[cfg(target_os = "linux")]
#[test]
fn a_run_killed_during_a_large_write_leaves_the_folder_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("big.onnx");
    sparse_model(&input, 1 << 30);
    std::fs::copy(tokenizer(), dir.path().join("tokenizer.json")).unwrap();
    let out = dir.path().join("out.onnx");
    std::fs::write(&out, b"the previous output").unwrap();
    let before = listing(dir.path());
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("ntl-patch"))
        .arg(&input)
        .arg("-o")
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(300);
    // kill it once 64 MiB of the output are written
    while open_file_size_in(child.id(), dir.path(), &input) < 64 << 20 {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it was killed"
        );
        assert!(std::time::Instant::now() < deadline, "no output written");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert_eq!(listing(dir.path()), before);
}

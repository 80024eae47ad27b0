//! Helpers shared by the integration tests: running the binary, reading models back.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use ntl_patch::onnx::proto::tensor_proto::DataType;
use ntl_patch::onnx::proto::tensor_shape_proto::{dimension, Dimension};
use ntl_patch::onnx::proto::{type_proto, OperatorSetIdProto, TensorShapeProto};
use ntl_patch::onnx::{
    int_attr, string_attr, AttributeProto, GraphProto, ModelProto, NodeProto, TypeProto,
    ValueInfoProto,
};
use prost::Message;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixture(rel: &str) -> PathBuf {
    root().join("fixtures").join(rel)
}

pub fn tokenizer() -> PathBuf {
    fixture("tokenizer.json")
}

pub fn bin() -> Command {
    Command::cargo_bin("ntl-patch").expect("binary built")
}

/// `ntl-patch validate PATH --json ARGS`, which must exit 0: its report.
pub fn validate_report(path: &Path, args: &[&str]) -> serde_json::Value {
    let out = bin()
        .arg("validate")
        .arg(path)
        .arg("--json")
        .args(args)
        .assert()
        .success();
    serde_json::from_slice(&out.get_output().stdout).unwrap()
}

/// How many checks of a `validate --json` report ran against onnxruntime, after asserting that
/// every check passed (`what` names the case in the failure message).
pub fn passed_checks_against_onnxruntime(report: &serde_json::Value, what: &str) -> usize {
    let checks = report["checks"].as_array().expect("checks");
    assert!(
        checks.iter().all(|c| c["passed"] == true),
        "{what}: {report}"
    );
    checks
        .iter()
        .filter(|c| c["against"] == "onnxruntime")
        .count()
}

/// A step graph's `ntl_step` metadata.
pub fn step_metadata(m: &ModelProto) -> serde_json::Value {
    let v = m
        .metadata_props
        .iter()
        .find(|p| p.key() == "ntl_step")
        .expect("ntl_step metadata");
    serde_json::from_str(v.value()).unwrap()
}

pub fn read_model(path: &Path) -> ModelProto {
    ModelProto::decode(std::fs::read(path).expect("read model").as_slice()).expect("decode model")
}

/// Patches `model` with `args` into `dir/out.onnx` and returns the output path.
pub fn patch(model: &Path, dir: &Path, args: &[&str]) -> PathBuf {
    let out = dir.join("out.onnx");
    bin()
        .arg(model)
        .arg("--tokenizer")
        .arg(tokenizer())
        .args(args)
        .arg("-o")
        .arg(&out)
        .assert()
        .success();
    out
}

pub const MODELS: [&str; 3] = ["lm_flat", "lm_bvt", "lm_nll"];

pub fn model(name: &str) -> PathBuf {
    fixture(&format!("models/{name}.onnx"))
}

/// A recorded `[rows][cols]` JSON matrix of float32 values (written with 9 significant
/// digits, so rounding to float32 recovers them exactly), flattened row-major.
pub fn json_f32_matrix(m: &serde_json::Value) -> Vec<f32> {
    m.as_array()
        .unwrap()
        .iter()
        .flat_map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
        })
        .collect()
}

/// The ORT library: ORT_DYLIB_PATH, else the copy scripts/setup/setup-ort.sh installs in .venv-ort.
/// Missing is a failure, not a skip: the test script always installs it.
pub fn ort_library() -> PathBuf {
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let capi = root().join(".venv-ort/onnxruntime/capi");
    std::fs::read_dir(&capi)
        .ok()
        .and_then(|entries| {
            entries.filter_map(|e| e.ok().map(|e| e.path())).find(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("libonnxruntime.so")
            })
        })
        .unwrap_or_else(|| {
            panic!(
                "ONNX Runtime library not found: set ORT_DYLIB_PATH, or run scripts/setup/setup-ort.sh \
                 (python3 -m pip install --target .venv-ort onnxruntime==1.31.1)"
            )
        })
}

// ---- building small models in tests ----

pub fn node(op: &str, inputs: &[&str], outputs: &[&str], attrs: Vec<AttributeProto>) -> NodeProto {
    NodeProto {
        name: Some(format!("{op}_{}", outputs[0])),
        op_type: Some(op.into()),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        attribute: attrs,
        ..Default::default()
    }
}

/// A tensor value info; `None` dims are symbolic.
pub fn value(name: &str, elem: DataType, dims: &[Option<i64>]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .enumerate()
        .map(|(i, d)| Dimension {
            value: Some(match d {
                Some(v) => dimension::Value::DimValue(*v),
                None => dimension::Value::DimParam(format!("d{i}")),
            }),
            ..Default::default()
        })
        .collect();
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(elem as i32),
                shape: Some(TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub fn sce(scores: &str, labels: &str, out: &str) -> NodeProto {
    node(
        "SoftmaxCrossEntropyLoss",
        &[scores, labels],
        &[out],
        vec![
            string_attr("reduction", "mean"),
            int_attr("ignore_index", -100),
        ],
    )
}

pub fn model_proto(graph: GraphProto, opset: i64) -> ModelProto {
    ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(opset),
        }],
        graph: Some(graph),
        ..Default::default()
    }
}

/// The training graph of an artifacts folder made from `lm_flat`: the forward graph plus a
/// `SoftmaxCrossEntropyLossGrad` (as ORT's generate_artifacts writes it) with `grad_outputs`.
pub fn training_graph(grad_outputs: &[&str]) -> ModelProto {
    let mut m = read_model(&model("lm_flat"));
    let g = m.graph.as_mut().unwrap();
    let ce = g
        .node
        .iter_mut()
        .find(|n| n.op_type() == "SoftmaxCrossEntropyLoss")
        .unwrap();
    ce.output = vec!["loss".into(), "log_prob".into()];
    let labels = ce.input[1].clone();
    g.node.push(NodeProto {
        name: Some("grad".into()),
        op_type: Some("SoftmaxCrossEntropyLossGrad".into()),
        domain: Some("com.microsoft".into()),
        input: vec!["loss_grad".into(), "log_prob".into(), labels],
        output: grad_outputs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    });
    g.input.push(value("loss_grad", DataType::Float, &[]));
    m
}

/// `root/art`: an artifacts folder with `training` as its training graph, `lm_flat` as the
/// eval graph, small stand-ins for the optimizer model and checkpoint, and the tokenizer.
pub fn artifacts_folder_with(root: &Path, training: &ModelProto) -> PathBuf {
    let dir = root.join("art");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("training_model.onnx"), training.encode_to_vec()).unwrap();
    std::fs::copy(model("lm_flat"), dir.join("eval_model.onnx")).unwrap();
    std::fs::write(dir.join("optimizer_model.onnx"), b"opt").unwrap();
    std::fs::write(dir.join("checkpoint"), b"ckpt").unwrap();
    std::fs::copy(tokenizer(), dir.join("tokenizer.json")).unwrap();
    dir
}

pub fn artifacts_folder(grad_outputs: &[&str]) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    artifacts_folder_with(root.path(), &training_graph(grad_outputs));
    root
}

/// A temp folder with `model.onnx` (from `src`, optionally edited) and the fixture tokenizer.
pub fn case(src: &Path, edit: impl FnOnce(&mut ModelProto)) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.onnx");
    let mut m = read_model(src);
    edit(&mut m);
    std::fs::write(&path, m.encode_to_vec()).unwrap();
    std::fs::copy(tokenizer(), dir.path().join("tokenizer.json")).unwrap();
    (dir, path)
}

/// The names in `dir`, sorted.
pub fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

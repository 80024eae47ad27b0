//! Bad input: a one-line error naming the problem and the fix, exit code 1, no output file,
//! and the input untouched.

mod common;

use std::path::{Path, PathBuf};

use common::*;

struct Case {
    dir: tempfile::TempDir,
    model: PathBuf,
}

impl Case {
    /// A folder holding `model.onnx` (copied from `src`) and the fixture tokenizer.
    fn new(src: &Path) -> Case {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model.onnx");
        std::fs::copy(src, &model).unwrap();
        std::fs::copy(tokenizer(), dir.path().join("tokenizer.json")).unwrap();
        Case { dir, model }
    }

    fn from_bytes(bytes: &[u8]) -> Case {
        let case = Case::new(&model("lm_flat"));
        std::fs::write(&case.model, bytes).unwrap();
        case
    }

    /// Runs ntl-patch, expects failure with a message containing `needle`, and checks that
    /// nothing was written and the input is unchanged.
    fn fails(&self, args: &[&str], needle: &str) {
        let before = std::fs::read(&self.model).unwrap();
        let files_before = listing(self.dir.path());
        let out = bin().arg(&self.model).args(args).assert().code(1);
        let stderr = String::from_utf8_lossy(&out.get_output().stderr).to_string();
        assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
        assert!(stderr.starts_with("error: "), "{stderr}");
        assert!(stderr.contains(needle), "expected '{needle}' in: {stderr}");
        assert_eq!(
            std::fs::read(&self.model).unwrap(),
            before,
            "input untouched"
        );
        assert_eq!(
            listing(self.dir.path()),
            files_before,
            "no output, no temp file left"
        );
    }
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn not_onnx() {
    Case::from_bytes(b"this is not a protobuf, just text\n").fails(&[], "is not an ONNX model");
}

#[test]
fn truncated_protobuf() {
    let bytes = std::fs::read(model("lm_flat")).unwrap();
    Case::from_bytes(&bytes[..bytes.len() / 2]).fails(&[], "is not an ONNX model");
}

#[test]
fn empty_file() {
    Case::from_bytes(b"").fails(&[], "is not an ONNX model");
}

#[test]
fn no_cross_entropy() {
    Case::new(&model("lm_no_ce")).fails(&[], "no cross-entropy found");
}

#[test]
fn several_cross_entropies() {
    Case::new(&model("lm_two_ce")).fails(&[], "--ce-node");
}

#[test]
fn unknown_ce_node() {
    Case::new(&model("lm_flat")).fails(&["--ce-node", "nope"], "matches no cross-entropy");
}

#[test]
fn tokenizer_without_numbers() {
    let case = Case::new(&model("lm_flat"));
    std::fs::write(case.dir.path().join("tokenizer.json"), "a\nb\nc\n").unwrap();
    case.fails(&[], "no number token");
}

#[test]
fn tokenizer_wider_than_logits() {
    let case = Case::new(&model("lm_flat"));
    let vocab: String = (0..60)
        .map(|i| {
            if i < 10 {
                format!("{i}\n")
            } else {
                format!("w{i}\n")
            }
        })
        .collect();
    std::fs::write(case.dir.path().join("tokenizer.json"), vocab).unwrap();
    case.fails(&[], "48");
}

#[test]
fn missing_tokenizer() {
    let case = Case::new(&model("lm_flat"));
    std::fs::remove_file(case.dir.path().join("tokenizer.json")).unwrap();
    case.fails(&[], "--tokenizer");
}

#[test]
fn output_equal_to_input() {
    let case = Case::new(&model("lm_flat"));
    let m = case.model.to_str().unwrap().to_string();
    case.fails(&["-o", &m], "is the input model");
}

#[test]
fn already_patched() {
    let case = Case::new(&model("lm_flat"));
    let patched = case.dir.path().join("patched.onnx");
    bin()
        .arg(&case.model)
        .arg("-o")
        .arg(&patched)
        .assert()
        .success();
    let again = Case::new(&patched);
    again.fails(&[], "already patched");
}

#[test]
fn vocab_size_disagrees() {
    Case::new(&model("lm_flat")).fails(&["--vocab-size", "50"], "disagrees");
}

#[test]
fn bad_squash() {
    Case::new(&model("lm_flat")).fails(&["--squash", "1"], "--squash");
}

#[test]
fn unsafe_external_data() {
    use ntl_patch::onnx::proto::tensor_proto::DataLocation;
    use ntl_patch::onnx::StringStringEntryProto;
    use prost::Message;
    for location in ["../outside.bin", "/etc/passwd", "missing.bin"] {
        let mut m = read_model(&model("lm_flat"));
        let t = &mut m.graph.as_mut().unwrap().initializer[0];
        t.raw_data = None;
        t.float_data.clear();
        t.data_location = Some(DataLocation::External as i32);
        t.external_data = vec![StringStringEntryProto {
            key: Some("location".into()),
            value: Some(location.into()),
        }];
        Case::from_bytes(&m.encode_to_vec()).fails(&[], "external data location");
    }
}

#[test]
fn label_smoothing_out_of_range() {
    for eps in ["-0.1", "1.5", "nan"] {
        Case::new(&model("lm_flat")).fails(&["--label-smoothing", eps], "--label-smoothing");
    }
}

#[test]
fn label_smoothing_with_class_weights() {
    use prost::Message;
    let mut m = read_model(&model("lm_flat"));
    let g = m.graph.as_mut().unwrap();
    let sce = g
        .node
        .iter_mut()
        .find(|n| n.op_type() == "SoftmaxCrossEntropyLoss")
        .unwrap();
    sce.input.push("class_weights".into());
    g.initializer.push(ntl_patch::onnx::f32_tensor(
        "class_weights",
        &[48],
        &[1.0; 48],
    ));
    Case::from_bytes(&m.encode_to_vec()).fails(&["--label-smoothing", "0.1"], "class weights");
}

#[test]
fn label_smoothing_in_artifacts_mode() {
    let root = artifacts_folder(&["logits_grad"]);
    let dir = root.path().join("art");
    let out = bin()
        .arg("artifacts")
        .arg(&dir)
        .arg("--label-smoothing")
        .arg("0.1")
        .assert()
        .code(1);
    let stderr = String::from_utf8_lossy(&out.get_output().stderr).to_string();
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("--label-smoothing"), "{stderr}");
    assert!(!root.path().join("art-ntl").exists());
}

#[test]
fn newer_loss_options_out_of_place_or_range() {
    let case = Case::new(&model("lm_flat"));
    for (args, needle) in [
        (
            &["--kernel", "laplace"][..],
            "--kernel applies to --loss smmd only",
        ),
        (
            &["--loss", "del", "--sigma", "3"],
            "--sigma applies to --loss smmd only",
        ),
        (&["--loss", "dist2", "--smmd-alpha", "1"], "--smmd-alpha"),
        (
            &["--loss", "smmd", "--dist2-tau", "2"],
            "--dist2-tau applies to --loss dist2 only",
        ),
        (
            &["--loss", "smmd", "--all-numbers"],
            "do not apply to --loss smmd",
        ),
        (&["--loss", "dist2", "--reweigh"], "--reweigh"),
        (
            &["--loss", "dist2", "--dist2-tau", "0"],
            "--dist2-tau 0 is out of range",
        ),
        (
            &["--loss", "smmd", "--sigma", "-1"],
            "--sigma -1 is out of range",
        ),
        (
            &["--loss", "smmd", "--squash", "0.5"],
            "--squash 0.5 is out of range",
        ),
        (
            &["--loss", "smmd", "--smmd-alpha", "nan"],
            "--smmd-alpha NaN is out of range",
        ),
        (
            &["--loss", "smmd", "--max-value", "99999999"],
            "--max-value 99999999",
        ),
        (&["--loss", "del", "--squash", "3"], "--squash"),
    ] {
        case.fails(args, needle);
    }
}

#[test]
fn smmd_needs_integer_tokens() {
    // a tokenizer whose only numbers are not canonical integers ("007", " 3", "1.5")
    let case = Case::new(&model("lm_flat"));
    std::fs::write(
        case.dir.path().join("tokenizer.json"),
        "a\n007\n 3\n1.5\nb\n",
    )
    .unwrap();
    case.fails(&["--loss", "smmd"], "SMMD needs integer tokens");
    // DIST2 and DEL need the ten digits
    case.fails(&["--loss", "dist2"], "\"0\"");
    case.fails(&["--loss", "del"], "\"0\"");
}

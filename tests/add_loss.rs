//! `--add-loss`: logits-only graphs get Hugging Face's causal-LM cross-entropy (numbers are
//! checked against torch in tests/python/test_step.py); here the graph it writes and the
//! refusals.

mod common;

use common::*;

#[test]
fn logits_only_graph_gets_labels_shift_and_loss() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.onnx");
    let run = bin()
        .arg(model("gpt2_logits"))
        .arg("--tokenizer")
        .arg(tokenizer())
        .arg("-o")
        .arg(&out)
        .assert()
        .success();
    let stderr = String::from_utf8_lossy(&run.get_output().stderr).to_string();
    assert!(stderr.starts_with("note: no cross-entropy"), "{stderr}");
    let m = read_model(&out);
    let g = m.graph.as_ref().unwrap();
    let inputs: Vec<&str> = g.input.iter().map(|i| i.name()).collect();
    assert_eq!(inputs, ["input_ids", "labels"]);
    let outputs: Vec<&str> = g.output.iter().map(|o| o.name()).collect();
    assert_eq!(outputs, ["loss", "logits", "ce_loss", "number_loss"]);
    // labels keep the logits' symbolic leading dims
    let (_, dims) = ntl_patch::onnx::value_info_shape(&g.input[1]).unwrap();
    assert_eq!(dims.unwrap().len(), 2);
    let sce = g
        .node
        .iter()
        .find(|n| n.op_type() == "SoftmaxCrossEntropyLoss")
        .unwrap();
    assert_eq!(ntl_patch::onnx::attr_i(sce, "ignore_index"), Some(-100));
    assert!(
        g.node.iter().any(|n| n.name().contains("Slice")),
        "the causal shift"
    );
}

#[test]
fn no_shift_aligns_labels_with_positions() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.onnx");
    bin()
        .arg(model("gpt2_logits"))
        .args(["--add-loss", "--no-shift", "--tokenizer"])
        .arg(tokenizer())
        .arg("-o")
        .arg(&out)
        .assert()
        .success();
    let g = read_model(&out).graph.unwrap();
    assert!(!g
        .node
        .iter()
        .any(|n| n.output.iter().any(|o| o.contains("shifted"))));
}

fn fails(args: &[&str], model_name: &str, needle: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.onnx");
    let run = bin()
        .args(args)
        .arg(model(model_name))
        .arg("--tokenizer")
        .arg(tokenizer())
        .arg("-o")
        .arg(&out)
        .assert()
        .code(1);
    let stderr = String::from_utf8_lossy(&run.get_output().stderr).to_string();
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains(needle), "{stderr}");
    assert!(!out.exists());
}

#[test]
fn add_loss_refusals() {
    fails(&["--add-loss"], "lm_flat", "already has a cross-entropy");
    // lm_no_ce has a scalar output only: nothing logits-like to add a loss to
    fails(
        &["--add-loss"],
        "lm_no_ce",
        "--add-loss needs a float graph output",
    );
}

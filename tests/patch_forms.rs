//! Each cross-entropy form is found and patched into a graph ORT Training can differentiate.

mod common;

use std::collections::BTreeSet;

use common::*;
use ntl_patch::onnx::{default_opset, ModelProto};

/// Ops ORT 1.19.2 has gradient builders for (measured, see docs/LOSSES.md, "Ops on the gradient path").
const DIFFERENTIABLE: &[&str] = &[
    "Gather",
    "Softmax",
    "LogSoftmax",
    "Sub",
    "Abs",
    "Mul",
    "Add",
    "Div",
    "Pow",
    "Where",
    "ReduceSum",
    "Max",
    "Identity",
    "Reshape",
    "Transpose",
    "Cast",
    "Unsqueeze",
    "SoftmaxCrossEntropyLoss",
    "MatMul",
    "Squeeze",
    "Min",
    "Log",
    "ReduceMean",
    "Clip",
    "TopK",
    "Neg",
    "Concat",
    "Relu",
];

/// Ops whose outputs carry no gradient in ORT (booleans, indices, integer casts).
fn stops_gradient(node: &ntl_patch::onnx::NodeProto) -> bool {
    match node.op_type() {
        // OneHot: all its inputs are stop-gradient edges in ORT's gradient builder.
        "Less" | "Equal" | "Greater" | "Not" | "Or" | "ArgMax" | "OneHot" => true,
        "Cast" => ntl_patch::onnx::attr_i(node, "to") != Some(ntl_patch::onnx::FLOAT as i64),
        _ => false,
    }
}

fn check_patched(original: &ModelProto, patched: &ModelProto) {
    assert_eq!(patched.ir_version, original.ir_version, "IR version kept");
    assert_eq!(patched.opset_import, original.opset_import, "opsets kept");
    let g = patched.graph.as_ref().unwrap();
    let og = original.graph.as_ref().unwrap();
    let names: Vec<&str> = g.output.iter().map(|o| o.name()).collect();
    assert_eq!(
        names[0],
        og.output[0].name(),
        "loss output keeps name and position"
    );
    assert_eq!(&names[names.len() - 2..], ["ce_loss", "number_loss"]);
    for node in &g.node {
        assert_ne!(
            node.op_type(),
            "Split",
            "Split gives wrong gradients in ORT"
        );
        assert_ne!(
            node.op_type(),
            "NegativeLogLikelihoodLoss",
            "ORT cannot differentiate NLL"
        );
        if node.op_type() == "SoftmaxCrossEntropyLoss" {
            assert_eq!(node.output.len(), 2, "SCE declares log_prob");
        }
    }
    // Every node downstream of the logits that ntl-patch added is differentiable by ORT.
    let meta = patched
        .metadata_props
        .iter()
        .find(|p| p.key() == "ntl_patch")
        .unwrap();
    let meta: serde_json::Value = serde_json::from_str(meta.value()).unwrap();
    let mut live: BTreeSet<String> =
        BTreeSet::from([meta["flat_logits"].as_str().unwrap().to_string()]);
    for node in &g.node {
        if node.input.iter().any(|i| live.contains(i)) && !stops_gradient(node) {
            if node.name().starts_with("ntl/") {
                assert!(
                    DIFFERENTIABLE.contains(&node.op_type()),
                    "{} ({}) sits on the gradient path",
                    node.name(),
                    node.op_type()
                );
            }
            live.extend(node.output.iter().cloned());
        }
    }
    // Everything the original graph had, except the replaced loss node, is still there.
    let new_nodes: BTreeSet<&str> = g.node.iter().map(|n| n.name()).collect();
    let removed: Vec<&str> = og
        .node
        .iter()
        .map(|n| n.name())
        .filter(|n| !new_nodes.contains(n))
        .collect();
    assert!(
        removed.len() <= 1,
        "only the loss node is replaced: {removed:?}"
    );
    assert!(default_opset(patched).unwrap() >= 13);
}

#[test]
fn every_form_and_loss_patches() {
    let dir = tempfile::tempdir().unwrap();
    for name in MODELS {
        for loss in [
            "wasserstein",
            "mse",
            "l1",
            "huber",
            "ntil",
            "emd",
            "number-level",
            "dist2",
            "smmd",
            "del",
        ] {
            let out = patch(&model(name), dir.path(), &["--loss", loss]);
            check_patched(&read_model(&model(name)), &read_model(&out));
        }
    }
}

#[test]
fn options_patch() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &["--reweigh"][..],
        &["--squash", "3"],
        &["--all-numbers"],
        &[
            "--loss",
            "mse",
            "--reweigh",
            "--all-numbers",
            "--weight",
            "0.5",
        ],
        &["--loss", "ntil", "--combine", "add", "--gumbel-noise", "0"],
        &[
            "--loss",
            "ntil",
            "--combine",
            "scaled",
            "--digit-exp",
            "1.5",
        ],
        &["--loss", "emd", "--combine", "add"],
        &["--loss", "number-level", "--float-level", "--reweigh"],
        &["--loss", "wasserstein", "--combine", "scaled"],
        &["--loss", "dist2", "--dist2-tau", "0.5", "--weight", "1"],
        &["--loss", "del", "--combine", "scaled"],
        &[
            "--loss",
            "smmd",
            "--kernel",
            "laplace",
            "--sigma",
            "1",
            "--sigma",
            "3",
            "--smmd-terms",
            "smooth",
            "--smmd-alpha",
            "0.2",
            "--max-value",
            "12",
        ],
    ] {
        let out = patch(&model("lm_flat"), dir.path(), args);
        check_patched(&read_model(&model("lm_flat")), &read_model(&out));
    }
}

#[test]
fn nll_becomes_softmax_cross_entropy() {
    let dir = tempfile::tempdir().unwrap();
    let out = read_model(&patch(&model("lm_nll"), dir.path(), &[]));
    let ops: Vec<&str> = out
        .graph
        .as_ref()
        .unwrap()
        .node
        .iter()
        .map(|n| n.op_type())
        .collect();
    assert!(ops.contains(&"SoftmaxCrossEntropyLoss"));
    assert!(!ops.contains(&"NegativeLogLikelihoodLoss"));
}

#[test]
fn output_is_deterministic() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    for name in MODELS {
        let x = std::fs::read(patch(
            &model(name),
            a.path(),
            &["--loss", "huber", "--reweigh"],
        ))
        .unwrap();
        let y = std::fs::read(patch(
            &model(name),
            b.path(),
            &["--loss", "huber", "--reweigh"],
        ))
        .unwrap();
        assert!(x == y, "{name}: same input and options give the same bytes");
    }
}

#[test]
fn default_paths_beside_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("model.onnx");
    std::fs::copy(model("lm_flat"), &m).unwrap();
    std::fs::copy(tokenizer(), dir.path().join("tokenizer.json")).unwrap();
    bin()
        .arg(&m)
        .args(["--loss", "wasserstein"])
        .assert()
        .success();
    assert!(dir.path().join("model.ntl.onnx").exists());
}

#[test]
fn ce_node_selects_one_of_several() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.onnx");
    bin()
        .arg(model("lm_two_ce"))
        .arg("--tokenizer")
        .arg(tokenizer())
        .args(["--ce-node", "/SoftmaxCrossEntropyLoss_1", "-o"])
        .arg(&out)
        .assert()
        .success();
    let g = read_model(&out).graph.unwrap();
    let sces: Vec<_> = g
        .node
        .iter()
        .filter(|n| n.op_type() == "SoftmaxCrossEntropyLoss")
        .collect();
    assert_eq!(sces.len(), 2);
    assert!(
        sces.iter().all(|n| n.output.len() == 2),
        "every SCE declares log_prob"
    );
}

#[test]
fn inspect_reports_the_site() {
    let out = bin()
        .arg("inspect")
        .arg(model("lm_bvt"))
        .arg("--json")
        .assert()
        .success();
    let v: serde_json::Value = serde_json::from_slice(&out.get_output().stdout).unwrap();
    assert_eq!(v["cross_entropy"][0]["vocab_width"], 48);
    assert_eq!(v["already_patched"], false);
}

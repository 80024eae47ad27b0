//! Cross-entropies written out of primitive ops, from the exporters in `fixtures/exporters/`
//! (TensorFlow via tf2onnx, JAX via jax2onnx, Paddle via paddle2onnx, hand-written torch):
//! each is recognised, its patched graph passes `validate` in tract (the number loss against the
//! independent reference, the total against ce_loss + λ·number_loss), and look-alikes that do not
//! compute a cross-entropy are left alone. Values against the frameworks' own losses and
//! gradients: tests/python/test_exporters.py.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use ntl_patch::onnx::{ModelProto, TensorProto};
use prost::Message;

fn exporter_model(name: &str) -> PathBuf {
    fixture(&format!("exporters/{name}.onnx"))
}

/// (fixture, the form the summary names)
const FORMS: &[(&str, &str)] = &[
    (
        "tf_sparse",
        "log of softmax × Equal(labels, Range) + ReduceSum",
    ),
    (
        "tf_sparse_ignore",
        "log of softmax × Equal(labels, Range) + ReduceSum",
    ),
    (
        "tf_sparse_masked",
        "log of softmax × Equal(labels, Range) + ReduceSum",
    ),
    ("tf_categorical", "log_softmax × OneHot + ReduceSum"),
    // the width and rank only in tf2onnx's run-time Dense reshape (no value_info)
    ("tf_softmax_onehot", "log of softmax × OneHot + ReduceSum"),
    ("tf_gather_nd", "log_softmax + GatherND"),
    // Keras label_smoothing: Add(Mul(OneHot, 1 − ε), ε/V) before the product
    (
        "tf_categorical_smoothed",
        "log_softmax × smoothed OneHot + ReduceSum",
    ),
    ("jax_int", "logsumexp − logits GatherND"),
    ("jax_int_masked", "logsumexp − logits GatherND"),
    ("jax_onehot", "log_softmax × OneHot + ReduceSum"),
    // optax.smooth_labels: Mul(1 − ε, OneHot) + Div(ε, the class count read at run time)
    (
        "jax_onehot_smoothed",
        "log_softmax × smoothed OneHot + ReduceSum",
    ),
    ("torch_gather", "log_softmax + GatherElements"),
    ("torch_onehot", "log_softmax × OneHot + ReduceSum"),
    (
        "torch_eq_range",
        "log_softmax × Equal(labels, Range) + ReduceSum",
    ),
    ("torch_sce_none_masked", "SoftmaxCrossEntropyLoss"),
    // reduction='none', then Unsqueeze → Transpose → Squeeze before the mask multiplies it
    ("paddle_ce_masked", "SoftmaxCrossEntropyLoss"),
];

fn patch_json(model: &Path, dir: &Path) -> (PathBuf, serde_json::Value) {
    let out = dir.join("out.onnx");
    let o = bin()
        .arg(model)
        .arg("--tokenizer")
        .arg(tokenizer())
        .arg("--json")
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    (out, serde_json::from_slice(&o.stdout).unwrap())
}

#[test]
fn every_exporter_form_is_recognised_and_validates_in_tract() {
    for (name, form) in FORMS {
        let dir = tempfile::tempdir().unwrap();
        let (out, summary) = patch_json(&exporter_model(name), dir.path());
        assert_eq!(summary["pattern"], *form, "{name}");
        let o = bin()
            .arg("validate")
            .arg(&out)
            .arg("--tokenizer")
            .arg(tokenizer())
            .arg("--json")
            .output()
            .unwrap();
        let report: serde_json::Value = serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|_| panic!("{name}: {}", String::from_utf8_lossy(&o.stderr)));
        assert!(
            o.status.success() && report["passed"] == true,
            "{name}: {report:#}"
        );
        // nothing ONNX Runtime Training cannot differentiate is left of the form
        let m = read_model(&out);
        let ops: Vec<&str> = m
            .graph
            .as_ref()
            .unwrap()
            .node
            .iter()
            .map(|n| n.op_type())
            .collect();
        for op in ["ReduceMax", "ReduceLogSumExp"] {
            assert!(!ops.contains(&op), "{name}: {op} left in the patched graph");
        }
    }
}

/// The step graph of every exporter form runs whole on the CUDA and ROCm kernel tables and is
/// taken whole by the MIGraphX model: the masks' position bookkeeping uses no `Size`, `Range` or
/// computed `ConstantOfShape` (docs/GPU.md, "Step graphs").
#[test]
fn every_exporter_step_graph_has_no_gpu_fallback() {
    let dir = tempfile::tempdir().unwrap();
    for (name, _) in FORMS {
        let out = dir.path().join(format!("{name}.step.onnx"));
        bin()
            .arg("step")
            .arg(exporter_model(name))
            .arg("--tokenizer")
            .arg(tokenizer())
            .arg("-o")
            .arg(&out)
            .assert()
            .success();
        for target in ["cuda", "rocm", "migraphx"] {
            let o = bin()
                .arg("inspect")
                .arg(&out)
                .args(["--target", target, "--json"])
                .assert()
                .success();
            let v: serde_json::Value = serde_json::from_slice(&o.get_output().stdout).unwrap();
            let gpu = &v["gpu"][0];
            assert_eq!(
                gpu["fallbacks"].as_array().map(Vec::len),
                Some(0),
                "{name} {target}: {}",
                gpu["summary"]
            );
        }
    }
}

#[test]
fn step_trains_exactly_each_frameworks_variables() {
    // models.json names the initializers that hold a framework variable; every other float
    // initializer (tf2onnx's -1 and 0, Keras' ignore_class as a float, jax2onnx's fill values)
    // is a constant the step must not train
    let models: serde_json::Value = serde_json::from_slice(
        &std::fs::read(root().join("fixtures/exporters/models.json")).unwrap(),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    for (name, _) in FORMS {
        let mut variables: Vec<&str> = models["models"][name]["initializers"]
            .as_array()
            .unwrap_or_else(|| panic!("{name} in models.json"))
            .iter()
            .filter(|i| i.get("parameter").is_some())
            .map(|i| i["name"].as_str().unwrap())
            .collect();
        variables.sort_unstable();
        let out = dir.path().join(format!("{name}.step.onnx"));
        let o = bin()
            .arg("step")
            .arg(exporter_model(name))
            .arg("--tokenizer")
            .arg(tokenizer())
            .arg("-o")
            .arg(&out)
            .arg("--json")
            .assert()
            .success();
        let summary: serde_json::Value = serde_json::from_slice(&o.get_output().stdout).unwrap();
        let mut trained: Vec<&str> = summary["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        trained.sort_unstable();
        assert_eq!(trained, variables, "{name}");
    }
}

#[test]
fn the_rewrite_keeps_every_original_output_and_leaves_no_orphans() {
    let dir = tempfile::tempdir().unwrap();
    let (out, _) = patch_json(&exporter_model("tf_sparse"), dir.path());
    let m = read_model(&out);
    let g = m.graph.as_ref().unwrap();
    let read: std::collections::BTreeSet<&str> = g
        .node
        .iter()
        .flat_map(|n| n.input.iter().map(String::as_str))
        .collect();
    for t in &g.initializer {
        assert!(
            read.contains(t.name()),
            "initializer {} is read by nothing",
            t.name()
        );
    }
    let outputs: Vec<&str> = g.output.iter().map(|o| o.name()).collect();
    assert_eq!(outputs, ["loss", "ce_loss", "number_loss"]);
}

/// The tensor a node input names: an initializer or a Constant node's value.
fn constant_mut<'m>(m: &'m mut ModelProto, name: &str) -> &'m mut TensorProto {
    let g = m.graph.as_mut().unwrap();
    if let Some(i) = g.initializer.iter().position(|t| t.name() == name) {
        return &mut g.initializer[i];
    }
    let node = g
        .node
        .iter_mut()
        .find(|n| n.op_type() == "Constant" && n.output.first().is_some_and(|o| o == name))
        .unwrap_or_else(|| panic!("no constant {name}"));
    node.attribute[0].t.as_mut().unwrap()
}

fn input_of(m: &ModelProto, op: &str, k: usize) -> String {
    let g = m.graph.as_ref().unwrap();
    g.node.iter().find(|n| n.op_type() == op).unwrap().input[k].clone()
}

fn refused_as_no_cross_entropy(m: &ModelProto) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.onnx");
    std::fs::write(&p, m.encode_to_vec()).unwrap();
    let out = dir.path().join("out.onnx");
    let o = bin()
        .arg(&p)
        .arg("--tokenizer")
        .arg(tokenizer())
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("no cross-entropy found"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!out.exists());
}

fn set_f32(m: &mut ModelProto, name: &str, values: &[f32]) {
    let t = constant_mut(m, name);
    t.float_data.clear();
    t.raw_data = Some(values.iter().flat_map(|v| v.to_le_bytes()).collect());
}

/// Patches `m`, checks the form the summary names, and validates the result in tract.
fn recognised_as(m: &ModelProto, form: &str) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.onnx");
    std::fs::write(&p, m.encode_to_vec()).unwrap();
    let (out, summary) = patch_json(&p, dir.path());
    assert_eq!(summary["pattern"], form);
    bin()
        .arg("validate")
        .arg(&out)
        .arg("--tokenizer")
        .arg(tokenizer())
        .assert()
        .success();
}

#[test]
fn a_one_hot_smoothed_to_rows_that_do_not_sum_to_1_is_not_a_cross_entropy() {
    // OneHot values [0.1, 0.9] over 48 classes: rows sum to 5.6, not a distribution
    let mut m = read_model(&exporter_model("tf_categorical"));
    let values = input_of(&m, "OneHot", 2);
    set_f32(&mut m, &values, &[0.1, 0.9]);
    refused_as_no_cross_entropy(&m);
    // Keras' smoothing with ε/V for another V
    let mut m = read_model(&exporter_model("tf_categorical_smoothed"));
    let spread = find_add_spread(&m);
    set_f32(&mut m, &spread, &[0.1 / 40.0]);
    refused_as_no_cross_entropy(&m);
}

/// The `ε/V` constant of the Keras fixture's smoothing Add.
fn find_add_spread(m: &ModelProto) -> String {
    let g = m.graph.as_ref().unwrap();
    g.node
        .iter()
        .filter(|n| n.op_type() == "Add")
        .flat_map(|n| n.input.iter())
        .find(|i| i.contains("truediv"))
        .unwrap()
        .clone()
}

#[test]
fn equivalent_spellings_of_label_smoothing_are_recognised() {
    let eps = 0.1f32;
    // one OneHot node with values [ε/V, 1 − ε + ε/V]
    let mut m = read_model(&exporter_model("tf_categorical"));
    let values = input_of(&m, "OneHot", 2);
    set_f32(&mut m, &values, &[eps / 48.0, 1.0 - eps + eps / 48.0]);
    recognised_as(&m, "log_softmax × smoothed OneHot + ReduceSum");

    // Keras' Add(Mul(onehot, 1 − ε), ε/V) with both operand orders swapped
    let mut m = read_model(&exporter_model("tf_categorical_smoothed"));
    let spread = find_add_spread(&m);
    for n in &mut m.graph.as_mut().unwrap().node {
        let swap = (n.op_type() == "Add" && n.input.contains(&spread))
            || (n.op_type() == "Mul" && n.input.iter().any(|i| i == "one_hot:0"));
        if swap {
            n.input.swap(0, 1);
        }
    }
    recognised_as(&m, "log_softmax × smoothed OneHot + ReduceSum");

    // ε/V not folded: Div(ε, V) with V a constant
    let mut m = read_model(&exporter_model("tf_categorical_smoothed"));
    let spread = find_add_spread(&m);
    let g = m.graph.as_mut().unwrap();
    g.initializer.retain(|t| t.name() != spread);
    g.initializer
        .push(ntl_patch::onnx::f32_tensor("eps", &[], &[eps]));
    g.initializer
        .push(ntl_patch::onnx::f32_tensor("classes", &[], &[48.0]));
    g.node
        .insert(0, node("Div", &["eps", "classes"], &[&spread], vec![]));
    recognised_as(&m, "log_softmax × smoothed OneHot + ReduceSum");
}

#[test]
fn label_smoothing_twice_is_refused() {
    let m = exporter_model("tf_categorical_smoothed");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.onnx");
    let o = bin()
        .arg(&m)
        .args(["--label-smoothing", "0.1", "--tokenizer"])
        .arg(tokenizer())
        .arg("-o")
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("already smooths its labels"), "{err}");
    assert!(!out.exists());
}

#[test]
fn a_smoothed_one_hot_inside_the_log_is_not_a_cross_entropy() {
    // log Σ_c (keep·onehot + spread)_c p_c is not Σ_c (...)_c log p_c
    let mut m = read_model(&exporter_model("tf_softmax_onehot"));
    let g = m.graph.as_mut().unwrap();
    let at = g.node.iter().position(|n| n.op_type() == "OneHot").unwrap();
    let onehot = g.node[at].output[0].clone();
    g.node[at].output[0] = "raw_onehot".into();
    g.initializer
        .push(ntl_patch::onnx::f32_tensor("keep", &[], &[0.9]));
    g.initializer
        .push(ntl_patch::onnx::f32_tensor("spread", &[], &[0.1 / 48.0]));
    g.node.insert(
        at + 1,
        node("Mul", &["raw_onehot", "keep"], &["kept_onehot"], vec![]),
    );
    g.node.insert(
        at + 2,
        node("Add", &["kept_onehot", "spread"], &[&onehot], vec![]),
    );
    refused_as_no_cross_entropy(&m);
}

#[test]
fn a_class_range_that_is_not_0_to_v_is_not_a_one_hot() {
    // Equal(labels, 1..=48): each label picks the next class's log-probability
    let mut m = read_model(&exporter_model("torch_eq_range"));
    let range = input_of(&m, "Equal", 1);
    let t = constant_mut(&mut m, &range);
    let shifted: Vec<u8> = (1..=48i64).flat_map(|v| v.to_le_bytes()).collect();
    t.int64_data.clear();
    t.raw_data = Some(shifted.into());
    refused_as_no_cross_entropy(&m);
}

#[test]
fn a_log_softmax_over_another_axis_is_not_a_cross_entropy() {
    let mut m = read_model(&exporter_model("torch_gather"));
    let g = m.graph.as_mut().unwrap();
    let ls = g
        .node
        .iter_mut()
        .find(|n| n.op_type() == "LogSoftmax")
        .unwrap();
    ls.attribute = vec![ntl_patch::onnx::int_attr("axis", 1)];
    refused_as_no_cross_entropy(&m);
}

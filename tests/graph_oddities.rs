//! Graph-level oddities: CE inside a subgraph, duplicate tensor names, a graph output that is
//! also an input, symbolic widths, fp16/bf16 logits, opsets.

mod common;

use common::*;
use ntl_patch::onnx::proto::attribute_proto::AttributeType;
use ntl_patch::onnx::proto::tensor_proto::DataType;
use ntl_patch::onnx::{i64_tensor, int_attr, AttributeProto, GraphProto, ModelProto};
use prost::Message;

/// scores [N, 48] (float type `elem`) and labels [N] as inputs, SCE to `loss`.
fn flat_model(elem: DataType, width: Option<i64>, opset: i64) -> ModelProto {
    model_proto(
        GraphProto {
            name: Some("g".into()),
            node: vec![sce("scores", "labels", "loss")],
            input: vec![
                value("scores", elem, &[None, width]),
                value("labels", DataType::Int64, &[None]),
            ],
            output: vec![value("loss", elem, &[])],
            ..Default::default()
        },
        opset,
    )
}

fn write(dir: &std::path::Path, m: &ModelProto) -> std::path::PathBuf {
    let p = dir.join("model.onnx");
    std::fs::write(&p, m.encode_to_vec()).unwrap();
    p
}

fn run(m: &ModelProto, args: &[&str]) -> (std::process::Output, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), m);
    let out = bin()
        .arg(&p)
        .arg("--tokenizer")
        .arg(tokenizer())
        .args(args)
        .arg("-o")
        .arg(dir.path().join("out.onnx"))
        .output()
        .unwrap();
    (out, dir)
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn ce_inside_if_is_reported_not_patched() {
    let then_branch = GraphProto {
        name: Some("then".into()),
        node: vec![sce("scores", "labels", "inner_loss")],
        output: vec![value("inner_loss", DataType::Float, &[])],
        ..Default::default()
    };
    let else_branch = GraphProto {
        name: Some("else".into()),
        node: vec![node(
            "ReduceSum",
            &["scores"],
            &["other_loss"],
            vec![int_attr("keepdims", 0)],
        )],
        output: vec![value("other_loss", DataType::Float, &[])],
        ..Default::default()
    };
    let branch = |name: &str, g: GraphProto| AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Graph as i32),
        g: Some(g),
        ..Default::default()
    };
    let m = model_proto(
        GraphProto {
            name: Some("g".into()),
            node: vec![node(
                "If",
                &["cond"],
                &["loss"],
                vec![
                    branch("then_branch", then_branch),
                    branch("else_branch", else_branch),
                ],
            )],
            input: vec![
                value("cond", DataType::Bool, &[]),
                value("scores", DataType::Float, &[None, Some(48)]),
                value("labels", DataType::Int64, &[None]),
            ],
            output: vec![value("loss", DataType::Float, &[])],
            ..Default::default()
        },
        17,
    );
    let (out, dir) = run(&m, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("inside subgraphs"),
        "{}",
        stderr(&out)
    );
    assert!(!dir.path().join("out.onnx").exists());
}

#[test]
fn duplicate_tensor_names_are_malformed_input() {
    let mut m = flat_model(DataType::Float, Some(48), 17);
    let g = m.graph.as_mut().unwrap();
    g.node
        .insert(0, node("Identity", &["labels"], &["dup"], vec![]));
    g.node
        .insert(1, node("Identity", &["labels"], &["dup"], vec![]));
    let (out, _dir) = run(&m, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("malformed"), "{}", stderr(&out));
}

#[test]
fn graph_output_that_is_an_input() {
    let mut m = flat_model(DataType::Float, Some(48), 17);
    let g = m.graph.as_mut().unwrap();
    g.output.push(value("labels", DataType::Int64, &[None]));
    let (out, dir) = run(&m, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let g = read_model(&dir.path().join("out.onnx")).graph.unwrap();
    let names: Vec<&str> = g.output.iter().map(|o| o.name()).collect();
    assert_eq!(names, ["loss", "labels", "ce_loss", "number_loss"]);
}

#[test]
fn symbolic_width_needs_vocab_size() {
    let m = flat_model(DataType::Float, None, 17);
    let (out, _dir) = run(&m, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--vocab-size"), "{}", stderr(&out));
    let (out, _dir) = run(&m, &["--vocab-size", "48"]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn half_precision_logits_compute_in_float32() {
    for elem in [DataType::Float16, DataType::Bfloat16] {
        for loss in ["wasserstein", "ntil"] {
            let mut m = flat_model(elem, Some(48), 17);
            // NTIL needs the [B, T] labels the flat ones came from.
            let g = m.graph.as_mut().unwrap();
            g.input[1] = value("labels_bt", DataType::Int64, &[None, None]);
            g.initializer.push(i64_tensor("minus_one", &[1], &[-1]));
            g.node.insert(
                0,
                node("Reshape", &["labels_bt", "minus_one"], &["labels"], vec![]),
            );
            let (out, dir) = run(&m, &["--loss", loss]);
            assert!(out.status.success(), "{elem:?} {loss}: {}", stderr(&out));
            let g = read_model(&dir.path().join("out.onnx")).graph.unwrap();
            let casts_to_f32 = g.node.iter().any(|n| {
                n.op_type() == "Cast"
                    && n.input[0] == "scores"
                    && ntl_patch::onnx::attr_i(n, "to") == Some(DataType::Float as i64)
            });
            assert!(
                casts_to_f32,
                "{elem:?}: logits are cast to float32 for the loss"
            );
            let total = g
                .node
                .iter()
                .find(|n| n.output.first().map(String::as_str) == Some("loss"))
                .unwrap();
            assert_eq!(
                total.op_type(),
                "Cast",
                "the total is cast back to {elem:?}"
            );
        }
    }
}

#[test]
fn opsets_13_to_21_patch_and_12_is_refused() {
    for opset in 13..=21 {
        let (out, _dir) = run(&flat_model(DataType::Float, Some(48), opset), &[]);
        assert!(out.status.success(), "opset {opset}: {}", stderr(&out));
    }
    let (out, _dir) = run(&flat_model(DataType::Float, Some(48), 12), &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("opset"), "{}", stderr(&out));
}

#[test]
fn reduction_none_is_refused() {
    let mut m = flat_model(DataType::Float, Some(48), 17);
    let sce = &mut m.graph.as_mut().unwrap().node[0];
    sce.attribute = vec![ntl_patch::onnx::string_attr("reduction", "none")];
    let (out, dir) = run(&m, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("reduction 'none'"),
        "{}",
        stderr(&out)
    );
    assert!(!dir.path().join("out.onnx").exists());
}

#[test]
fn logits_width_is_read_through_a_reshape_target_behind_identity() {
    // Paddle writes Reshape(logits, Identity(Constant([-1, V]))): the width is still the graph's
    let mut m = read_model(&model("lm_flat"));
    let g = m.graph.as_mut().unwrap();
    let at = g.node.iter().position(|n| n.name() == "/Reshape").unwrap();
    let target = g.node[at].input[1].clone();
    g.node[at].input[1] = "shape_via_identity".into();
    g.node.insert(
        at,
        node("Identity", &[&target], &["shape_via_identity"], vec![]),
    );
    let (out, _dir) = run(&m, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("of 48 logits"));
}

//! The fused LM head of the step graph (`--fused-head`, docs/STEP_GRAPH.md): its `Scan`s and
//! their bodies have GPU kernels at every opset the maintained runtimes serve, a head that
//! cannot be fused is named (an error with `on`, a warning and the dense head with `auto`),
//! and `validate` trains a fused step graph in tract and ONNX Runtime alike. Values and
//! gradients against torch: tests/python/test_step.py and test_architectures.py.

mod common;

use common::*;
use ntl_patch::onnx::proto::tensor_proto::DataType as D;
use ntl_patch::onnx::{f32_tensor, i64_tensor, GraphProto};
use ntl_patch::tools::gpu_kernels::{fallback_nodes, Target};

/// hidden `[B, T, 4]` → MatMul(W `[4, V]`) + b → (`extra` op) → Reshape `[-1, V]` → SCE.
fn head_model(width: i64, opset: i64, extra: Option<&str>) -> ntl_patch::onnx::ModelProto {
    let d = 4;
    let w: Vec<f32> = (0..d * width)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 200.0)
        .collect();
    let b: Vec<f32> = (0..width)
        .map(|i| ((i * 13 % 29) as f32 - 14.0) / 100.0)
        .collect();
    let mut nodes = vec![
        node("MatMul", &["hidden", "W"], &["projected"], vec![]),
        node("Add", &["projected", "b"], &["logits"], vec![]),
    ];
    let scores_source = match extra {
        Some(op) => {
            nodes.push(node(op, &["logits"], &["capped"], vec![]));
            "capped"
        }
        None => "logits",
    };
    nodes.push(node(
        "Reshape",
        &[scores_source, "shape_nv"],
        &["scores"],
        vec![],
    ));
    nodes.push(node(
        "Reshape",
        &["labels", "shape_n"],
        &["labels_flat"],
        vec![],
    ));
    nodes.push(sce("scores", "labels_flat", "loss"));
    model_proto(
        GraphProto {
            name: Some("head".into()),
            node: nodes,
            initializer: vec![
                f32_tensor("W", &[d, width], &w),
                f32_tensor("b", &[width], &b),
                i64_tensor("shape_nv", &[2], &[-1, width]),
                i64_tensor("shape_n", &[1], &[-1]),
            ],
            input: vec![
                value("hidden", D::Float, &[None, None, Some(d)]),
                value("labels", D::Int64, &[None, None]),
            ],
            output: vec![value("loss", D::Float, &[])],
            ..Default::default()
        },
        opset,
    )
}

fn write(dir: &std::path::Path, name: &str, m: &ntl_patch::onnx::ModelProto) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, prost::Message::encode_to_vec(m)).unwrap();
    p
}

/// Every node, `Scan` bodies included, has a CUDA and a ROCm kernel.
fn assert_no_gpu_fallback(m: &ntl_patch::onnx::ModelProto, what: &str) {
    for target in [Target::Cuda, Target::Rocm] {
        let f = fallback_nodes(m, target);
        let ops: Vec<_> = f.iter().map(|n| (&n.op, &n.reason)).collect();
        assert!(f.is_empty(), "{what} on {}: {ops:?}", target.name());
    }
}

fn step(src: &std::path::Path, out: &std::path::Path, args: &[&str]) -> std::process::Output {
    bin()
        .arg("step")
        .arg(src)
        .arg("--tokenizer")
        .arg(tokenizer())
        .arg("-o")
        .arg(out)
        .args(args)
        .output()
        .unwrap()
}

/// Every loss family at every opset 13–20: the fused step graph, `Scan` bodies included, has a
/// CUDA kernel (onnxruntime-gpu 1.31.1) and a ROCm kernel (onnxruntime-rocm 1.22.2) for every
/// node.
#[test]
fn fused_step_graphs_have_gpu_kernels_at_opsets_13_to_20() {
    let tmp = tempfile::tempdir().unwrap();
    let losses: [&[&str]; 7] = [
        &["--loss", "wasserstein", "--reweigh"],
        &["--loss", "ntil"],
        &["--loss", "number-level", "--label-smoothing", "0.1"],
        &["--loss", "mse", "--combine", "scaled"],
        &["--loss", "dist2"],
        &["--loss", "del"],
        &["--loss", "smmd", "--max-value", "9"],
    ];
    for opset in 13..=20 {
        let src = write(
            tmp.path(),
            &format!("m{opset}.onnx"),
            &head_model(48, opset, None),
        );
        for (k, args) in losses.iter().enumerate() {
            let out = tmp.path().join(format!("s{opset}_{k}.onnx"));
            let mut a = vec!["--fused-head", "on", "--head-chunk-tokens", "4"];
            a.extend_from_slice(args);
            let o = step(&src, &out, &a);
            assert!(
                o.status.success(),
                "opset {opset} {args:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            let m = read_model(&out);
            let scans = m
                .graph
                .as_ref()
                .unwrap()
                .node
                .iter()
                .filter(|n| n.op_type() == "Scan")
                .count();
            // one Scan where the gradient's dense part is known before the forward (lower.rs),
            // a forward and a backward one with --reweigh (the number loss reads the lse)
            let want = if args.contains(&"--reweigh") { 2 } else { 1 };
            assert_eq!(scans, want, "opset {opset} {args:?}");
            assert_no_gpu_fallback(&m, &format!("opset {opset} {args:?}"));
        }
    }
}

/// With `--precision fp16|bf16` the fused head stays fused (its projection in float32, the
/// master weight read directly) and every node keeps a CUDA and ROCm kernel.
#[test]
fn fused_heads_under_mixed_precision_have_gpu_kernels() {
    let tmp = tempfile::tempdir().unwrap();
    let src = write(tmp.path(), "m.onnx", &head_model(48, 17, None));
    for precision in ["fp16", "bf16"] {
        let out = tmp.path().join(format!("{precision}.onnx"));
        let o = step(
            &src,
            &out,
            &["--fused-head", "on", "--precision", precision, "--json"],
        );
        assert!(
            o.status.success(),
            "{precision}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(v["fused_head"].is_object(), "{precision}: {v}");
        let m = read_model(&out);
        assert_no_gpu_fallback(&m, precision);
    }
}

/// The kernel check looks inside the `Scan` bodies: a body op without a kernel is a fallback
/// (this check must be able to fail).
#[test]
fn a_scan_body_op_without_a_kernel_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let src = write(tmp.path(), "m.onnx", &head_model(48, 17, None));
    let out = tmp.path().join("s.onnx");
    assert!(step(&src, &out, &["--fused-head", "on"]).status.success());
    let mut m = read_model(&out);
    let g = m.graph.as_mut().unwrap();
    let scan = g.node.iter_mut().find(|n| n.op_type() == "Scan").unwrap();
    let body = scan
        .attribute
        .iter_mut()
        .find_map(|a| a.g.as_mut())
        .unwrap();
    // an op no provider registers
    let first = body
        .node
        .iter_mut()
        .find(|n| n.op_type() == "Gemm")
        .unwrap();
    first.op_type = Some("NoSuchOp".into());
    let f = fallback_nodes(&m, Target::Cuda);
    assert!(
        f.iter().any(|n| n.op == "NoSuchOp"),
        "{:?}",
        f.iter().map(|n| &n.op).collect::<Vec<_>>()
    );
}

/// A head that cannot be fused (a `Relu` of the logits: no pointwise map the fused head takes,
/// where a `Tanh` is one): `--fused-head on` is one line naming the node and the way out;
/// `auto` (the logits are wide) keeps the dense head and warns, naming it.
#[test]
fn a_head_that_cannot_be_fused_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let tanh = write(tmp.path(), "tanh.onnx", &head_model(48, 17, Some("Tanh")));
    let fused = tmp.path().join("tanh.step.onnx");
    assert!(step(&tanh, &fused, &["--fused-head", "on"])
        .status
        .success());
    let src = write(
        tmp.path(),
        "capped.onnx",
        &head_model(16384, 17, Some("Relu")),
    );
    let out = tmp.path().join("s.onnx");
    let o = step(&src, &out, &["--fused-head", "on"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("Relu") && err.contains("--fused-head"),
        "{err}"
    );
    assert!(!out.exists(), "no output on error");

    let o = step(&src, &out, &["--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("warning: the LM head is not fused") && err.contains("Relu"),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["fused_head"].is_null(), "{v}");
}

/// Wide logits are fused without a flag; `--fused-head off` keeps them dense; the same input
/// and options give the same bytes.
#[test]
fn wide_logits_are_fused_by_default_and_deterministically() {
    let tmp = tempfile::tempdir().unwrap();
    let src = write(tmp.path(), "wide.onnx", &head_model(16384, 17, None));
    let (a, b, off) = (
        tmp.path().join("a.onnx"),
        tmp.path().join("b.onnx"),
        tmp.path().join("off.onnx"),
    );
    for out in [&a, &b] {
        let o = step(&src, out, &["--json"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["fused_head"]["chunk_tokens"], 2048, "{v}");
    }
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    assert!(step(&src, &off, &["--fused-head", "off"]).status.success());
    let dense = read_model(&off);
    assert!(dense
        .graph
        .as_ref()
        .unwrap()
        .node
        .iter()
        .all(|n| n.op_type() != "Scan"));
    assert!(dense
        .graph
        .as_ref()
        .unwrap()
        .node
        .iter()
        .any(|n| n.op_type() == "SoftmaxCrossEntropyLoss"));
}

/// `validate` on fused step graphs: the logits the graph does not hold are computed for the
/// reference, and three training steps in tract equal those in ONNX Runtime (needs
/// ORT_DYLIB_PATH, as scripts/test.sh sets) — the GPT-2 fixture (tied embedding, causal shift),
/// and the [B, V, T] scores of lm_bvt with label smoothing.
#[test]
fn validate_trains_fused_step_graphs_in_both_runtimes() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, extra) in [
        ("gpt2_ts", &[][..]),
        ("lm_bvt", &["--label-smoothing", "0.1"][..]),
    ] {
        let out = tmp.path().join(format!("{name}.step.onnx"));
        let mut args = vec!["--fused-head", "on", "--head-chunk-tokens", "5"];
        args.extend_from_slice(extra);
        let o = step(&model(name), &out, &args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v = bin()
            .arg("validate")
            .arg(&out)
            .arg("--tokenizer")
            .arg(tokenizer())
            .arg("--json")
            .assert()
            .success();
        let report: serde_json::Value = serde_json::from_slice(&v.get_output().stdout).unwrap();
        let checks = report["checks"].as_array().unwrap();
        // the losses against the reference, then 3 steps × 3 losses and the state against ORT
        assert_eq!(checks.len(), 3 + 3 * 3 + 1, "{name}: {report}");
        assert!(
            checks.iter().all(|c| c["passed"] == true),
            "{name}: {report}"
        );
    }
}

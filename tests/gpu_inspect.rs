//! `ntl-patch inspect --target cuda|rocm|migraphx|cuda-1.19|rocm-1.19`: every patched fixture gets
//! a GPU readiness report, and nodes the provider would not take are named (exit code 0 either
//! way). `cuda` / `rocm` / `migraphx` are onnxruntime-gpu 1.31.1, onnxruntime-rocm 1.22.2 and
//! onnxruntime-migraphx 1.27.1; `cuda-1.19` / `rocm-1.19` are onnxruntime-training 1.19.2.

mod common;

use std::collections::HashMap;

use common::*;
use ntl_patch::onnx::proto::tensor_proto::DataType;
use ntl_patch::onnx::proto::{type_proto, OperatorSetIdProto, TensorShapeProto};
use ntl_patch::onnx::{int_attr, GraphProto, ModelProto, NodeProto, TypeProto, ValueInfoProto};
use ntl_patch::tools::gpu_kernels::{
    check_model, fallback_nodes, migraphx, tables, tables_for, GpuReport, Missing, Placement,
    Target,
};

const LOSSES: [&str; 10] = [
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
];

fn inspect_json(path: &std::path::Path, targets: &[&str]) -> serde_json::Value {
    let mut cmd = bin();
    cmd.arg("inspect").arg(path).arg("--json");
    for t in targets {
        cmd.arg("--target").arg(t);
    }
    let out = cmd.output().expect("run ntl-patch");
    assert!(
        out.status.success(),
        "inspect failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("inspect --json prints JSON")
}

#[test]
fn every_patched_fixture_gets_a_cuda_and_a_rocm_report() {
    let tmp = tempfile::tempdir().unwrap();
    for model in MODELS {
        for loss in LOSSES {
            let dir = tmp.path().join(format!("{model}-{loss}"));
            std::fs::create_dir_all(&dir).unwrap();
            let out = patch(&self::model(model), &dir, &["--loss", loss]);
            let v = inspect_json(&out, &["cuda", "rocm"]);
            let gpu = v["gpu"].as_array().expect("gpu array");
            assert_eq!(gpu.len(), 2, "{model} {loss}");
            for (report, target) in gpu.iter().zip(["cuda", "rocm"]) {
                let ctx = format!("{model} {loss} {target}");
                assert_eq!(report["target"], target, "{ctx}");
                assert!(report["nodes"].as_u64().unwrap() > 0, "{ctx}");
                assert!(
                    report["ntl_nodes"].as_u64().unwrap() > 0,
                    "{ctx}: ntl-patch's nodes are recognised"
                );
                let summary = report["summary"].as_str().unwrap();
                let all = report["all_ops_on_gpu"].as_bool().unwrap();
                let fallbacks = report["fallbacks"].as_array().unwrap();
                if all {
                    assert_eq!(summary, format!("all ops have {target} kernels"), "{ctx}");
                    assert!(fallbacks.is_empty(), "{ctx}");
                } else {
                    assert!(
                        summary.contains("fall back to CPU")
                            || summary.contains("could not be checked"),
                        "{ctx}: {summary}"
                    );
                    for f in fallbacks {
                        assert!(
                            f["op"].is_string()
                                && f["reason"].is_string()
                                && !f["nodes"].as_array().unwrap().is_empty(),
                            "{ctx}: {f}"
                        );
                        assert!(
                            summary.contains(f["op"].as_str().unwrap()),
                            "{ctx}: the summary names {}",
                            f["op"]
                        );
                    }
                }
                // the trainable cross-entropy ntl-patch writes: the inference builds have no
                // kernel for it, so ORT inlines its function body (whose ops are placed instead)
                let sce = report["inlined"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|g| g["op"] == "SoftmaxCrossEntropyLoss")
                    .unwrap_or_else(|| panic!("{ctx}: SoftmaxCrossEntropyLoss not inlined"));
                assert_eq!(sce["types"]["T"], "float", "{ctx}");
                assert_eq!(sce["types"]["Tind"], "int64", "{ctx}");
                // every type of an ntl-patch node is known, so each was checked
                for g in report["gpu"].as_array().unwrap() {
                    if g["ntl_nodes"].as_u64().unwrap() > 0 && g["domain"] == "ai.onnx" {
                        assert!(
                            g["types"].as_object().unwrap().values().all(|t| t != "?"),
                            "{ctx}: unknown type in {g}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn ntl_family_runs_entirely_on_cuda_and_rocm_at_opset_17() {
    const KERNEL_TARGETS: [Target; 4] =
        [Target::Cuda, Target::Rocm, Target::Cuda119, Target::Rocm119];
    // lm_flat is opset 17: every op of NTL-WAS/MSE/L1/Huber has a CUDA and a ROCm kernel
    let tmp = tempfile::tempdir().unwrap();
    for loss in ["wasserstein", "mse", "l1", "huber"] {
        let dir = tmp.path().join(loss);
        std::fs::create_dir_all(&dir).unwrap();
        let out = patch(&model("lm_flat"), &dir, &["--loss", loss]);
        let model = read_model(&out);
        for target in KERNEL_TARGETS {
            let r = check_model(&model, target);
            let ntl_fallbacks: Vec<_> = r
                .fallbacks()
                .filter(|g| g.ntl_nodes > 0)
                .map(|g| g.op.clone())
                .collect();
            assert!(
                ntl_fallbacks.is_empty(),
                "{loss} on {}: {ntl_fallbacks:?}\n{}",
                target.name(),
                r.to_text()
            );
        }
    }
}

/// Every loss, at every opset ORT 1.19's GPU providers serve (13–20; at 21 they register no
/// kernels for Cast/Reshape/Squeeze/... at all), adds only ops with CUDA and ROCm kernels, in
/// the 1.19 tables and in the maintained runtimes' (onnxruntime-gpu 1.31.1, onnxruntime-rocm
/// 1.22.2).
#[test]
fn every_loss_runs_entirely_on_cuda_and_rocm_at_opsets_13_to_20() {
    use ntl_patch::onnx::proto::tensor_proto::DataType as D;
    let tmp = tempfile::tempdir().unwrap();
    let losses: [&[&str]; 10] = [
        &["--loss", "wasserstein", "--squash", "3", "--reweigh"],
        &["--loss", "mse"],
        &["--loss", "huber"],
        &["--loss", "ntil"],
        &["--loss", "emd", "--combine", "add"],
        &["--loss", "number-level", "--float-level", "--reweigh"],
        &["--loss", "ntil", "--combine", "add", "--gumbel-noise", "0"],
        &["--loss", "dist2"],
        &["--loss", "smmd"],
        &["--loss", "del"],
    ];
    for opset in 13..=20 {
        // logits [B, T, 48] -> Reshape -> SCE, labels [B, T] -> Reshape
        let m = common::model_proto(
            ntl_patch::onnx::GraphProto {
                name: Some("g".into()),
                node: vec![
                    common::node("Reshape", &["logits", "shape_nv"], &["scores"], vec![]),
                    common::node("Reshape", &["labels", "shape_n"], &["labels_flat"], vec![]),
                    common::sce("scores", "labels_flat", "loss"),
                ],
                initializer: vec![
                    ntl_patch::onnx::i64_tensor("shape_nv", &[2], &[-1, 48]),
                    ntl_patch::onnx::i64_tensor("shape_n", &[1], &[-1]),
                ],
                input: vec![
                    common::value("logits", D::Float, &[None, None, Some(48)]),
                    common::value("labels", D::Int64, &[None, None]),
                ],
                output: vec![common::value("loss", D::Float, &[])],
                ..Default::default()
            },
            opset,
        );
        let src = tmp.path().join(format!("m{opset}.onnx"));
        std::fs::write(&src, prost::Message::encode_to_vec(&m)).unwrap();
        for (k, args) in losses.iter().enumerate() {
            let dir = tmp.path().join(format!("o{opset}_{k}"));
            std::fs::create_dir_all(&dir).unwrap();
            let patched = read_model(&patch(&src, &dir, args));
            for target in [Target::Cuda, Target::Rocm, Target::Cuda119, Target::Rocm119] {
                let r = check_model(&patched, target);
                let ntl: Vec<_> = r
                    .fallbacks()
                    .filter(|g| g.ntl_nodes > 0)
                    .map(|g| g.op.clone())
                    .collect();
                assert!(
                    ntl.is_empty(),
                    "opset {opset} {args:?} on {}: {ntl:?}",
                    target.name()
                );
            }
        }
    }
}

#[test]
fn text_report_says_all_or_lists_fallbacks_and_exits_0() {
    let tmp = tempfile::tempdir().unwrap();
    let out = patch(&model("lm_flat"), tmp.path(), &["--loss", "wasserstein"]);
    let text = bin()
        .arg("inspect")
        .arg(&out)
        .args(["--target", "cuda"])
        .output()
        .unwrap();
    assert!(text.status.success());
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        text.contains("already patched by ntl-patch: yes"),
        "the plain inspect report comes first:\n{text}"
    );
    assert!(text.contains("cuda: all ops have cuda kernels"), "{text}");

    // a model with a known-missing kernel: ArgMax at opset 13 (ORT 1.19's CUDA and ROCm register
    // ArgMax 1-11 only; the maintained runtimes have ArgMax-13)
    let path = tmp.path().join("argmax.onnx");
    write_model(
        &path,
        &tiny_model(
            13,
            &[node("ArgMax", &["x"], &["y"], vec![int_attr("axis", 1)])],
            &[("x", DataType::Float)],
        ),
    );
    let out = bin()
        .arg("inspect")
        .arg(&path)
        .args([
            "--target",
            "cuda-1.19",
            "--target",
            "rocm-1.19",
            "--target",
            "cuda",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "exit code 0 with fallbacks too");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains(
            "cuda-1.19: 1 node(s) would fall back to CPU: no cuda-1.19 kernel for ArgMax"
        ),
        "{text}"
    );
    assert!(
        text.contains(
            "rocm-1.19: 1 node(s) would fall back to CPU: no rocm-1.19 kernel for ArgMax"
        ),
        "{text}"
    );
    assert!(
        text.contains("no cuda-1.19 ArgMax kernel serves version 13; registered versions: 1-11"),
        "{text}"
    );
    assert!(text.contains("\ncuda: all ops have cuda kernels"), "{text}");
    assert!(
        text.contains("onnxruntime-training 1.19.2 (data/ort-1.19-kernels.tsv)")
            && text.contains("onnxruntime-gpu 1.31.1 (data/ort-1.31.1-cuda-kernels.tsv)"),
        "each report names its runtime and table:\n{text}"
    );
    let v = inspect_json(&path, &["cuda-1.19", "cuda"]);
    assert_eq!(v["gpu"][0]["onnxruntime"], "1.19.2");
    assert_eq!(v["gpu"][0]["package"], "onnxruntime-training");
    assert_eq!(v["gpu"][1]["target"], "cuda");
    assert_eq!(v["gpu"][1]["onnxruntime"], "1.31.1");
    assert_eq!(v["gpu"][1]["package"], "onnxruntime-gpu");
    assert_eq!(v["gpu"][1]["all_ops_on_gpu"], true);
    let f = &v["gpu"][0]["fallbacks"][0];
    assert_eq!(f["op"], "ArgMax");
    assert_eq!(f["version"], 13);
    assert_eq!(f["reason"], "version");
    assert_eq!(f["cpu_kernel"], true);
    assert_eq!(v["gpu"][0]["all_ops_on_gpu"], false);
}

// ---- the table API on tiny models ---------------------------------------------------------

fn node(
    op: &str,
    inputs: &[&str],
    outputs: &[&str],
    attribute: Vec<ntl_patch::onnx::AttributeProto>,
) -> NodeProto {
    NodeProto {
        name: Some(format!("n_{op}_{}", outputs[0])),
        op_type: Some(op.into()),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        attribute,
        ..Default::default()
    }
}

fn tensor_input(name: &str, dt: DataType) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(dt as i32),
                shape: Some(TensorShapeProto { dim: vec![] }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn tiny_model(opset: i64, nodes: &[NodeProto], inputs: &[(&str, DataType)]) -> ModelProto {
    ModelProto {
        ir_version: Some(8),
        opset_import: vec![
            OperatorSetIdProto {
                domain: Some(String::new()),
                version: Some(opset),
            },
            OperatorSetIdProto {
                domain: Some("com.microsoft".into()),
                version: Some(1),
            },
        ],
        graph: Some(GraphProto {
            name: Some("tiny".into()),
            node: nodes.to_vec(),
            input: inputs.iter().map(|(n, t)| tensor_input(n, *t)).collect(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn write_model(path: &std::path::Path, m: &ModelProto) {
    use prost::Message;
    std::fs::write(path, m.encode_to_vec()).unwrap();
}

fn placement(r: &GpuReport, op: &str) -> Placement {
    r.groups
        .iter()
        .find(|g| g.op == op)
        .unwrap_or_else(|| panic!("no {op} in\n{}", r.to_text()))
        .placement
        .clone()
}

#[test]
fn open_ended_kernels_do_not_serve_newer_versions() {
    // ReduceMax-18: CUDA registers 18 (open-ended), ROCm stops at 13
    let m = tiny_model(
        18,
        &[node("ReduceMax", &["x"], &["y"], vec![])],
        &[("x", DataType::Float)],
    );
    assert!(matches!(
        placement(&check_model(&m, Target::Cuda119), "ReduceMax"),
        Placement::Gpu { .. }
    ));
    match placement(&check_model(&m, Target::Rocm119), "ReduceMax") {
        Placement::Fallback {
            why: Missing::Version { registered },
            cpu: true,
        } => {
            assert_eq!(
                registered.last().map(String::as_str),
                Some("13"),
                "{registered:?}"
            )
        }
        p => panic!("ReduceMax-18 on ROCm: {p:?}"),
    }
    // opset 21: Cast resolves to Cast-21; the CUDA Cast kernel registered at 19 is open-ended
    let m = tiny_model(
        21,
        &[node(
            "Cast",
            &["x"],
            &["y"],
            vec![int_attr("to", DataType::Int64 as i64)],
        )],
        &[("x", DataType::Float)],
    );
    assert!(matches!(
        placement(&check_model(&m, Target::Cuda119), "Cast"),
        Placement::Fallback {
            why: Missing::Version { .. },
            ..
        }
    ));
    // onnxruntime-gpu 1.31.1 registers Cast 21-22; onnxruntime-rocm 1.22.2 stops at 19
    assert!(matches!(
        placement(&check_model(&m, Target::Cuda), "Cast"),
        Placement::Gpu { .. }
    ));
    assert!(matches!(
        placement(&check_model(&m, Target::Rocm), "Cast"),
        Placement::Fallback {
            why: Missing::Version { .. },
            ..
        }
    ));
    let m = tiny_model(
        19,
        &[node(
            "Cast",
            &["x"],
            &["y"],
            vec![int_attr("to", DataType::Int64 as i64)],
        )],
        &[("x", DataType::Float)],
    );
    for target in [Target::Cuda, Target::Rocm, Target::Cuda119, Target::Rocm119] {
        assert!(matches!(
            placement(&check_model(&m, target), "Cast"),
            Placement::Gpu { .. }
        ));
    }
}

#[test]
fn input_types_are_checked_per_type_constraint() {
    // Equal on strings: CUDA's Equal kernels take bool/int/float types only
    let m = tiny_model(
        13,
        &[node("Equal", &["a", "b"], &["y"], vec![])],
        &[("a", DataType::String), ("b", DataType::String)],
    );
    match placement(&check_model(&m, Target::Cuda), "Equal") {
        Placement::Fallback {
            why:
                Missing::Type {
                    param,
                    actual,
                    accepted,
                },
            ..
        } => {
            assert_eq!((param.as_str(), actual.as_str()), ("T", "string"));
            assert!(
                accepted.contains(&"int64".to_string()) && accepted.contains(&"float".to_string()),
                "{accepted:?}"
            );
        }
        p => panic!("Equal(string) on CUDA: {p:?}"),
    }
    // the same op on int64 has a kernel; CumSum int64, Range int64, OneHot int64/int64/float too
    let m = tiny_model(
        14,
        &[
            node("Equal", &["i", "j"], &["e"], vec![]),
            node("CumSum", &["i", "ax"], &["c"], vec![]),
            node("Range", &["s", "l", "d"], &["r"], vec![]),
            node("OneHot", &["i", "depth", "vals"], &["o"], vec![]),
        ],
        &[
            ("i", DataType::Int64),
            ("j", DataType::Int64),
            ("ax", DataType::Int64),
            ("s", DataType::Int64),
            ("l", DataType::Int64),
            ("d", DataType::Int64),
            ("depth", DataType::Int64),
            ("vals", DataType::Float),
        ],
    );
    for target in [Target::Cuda, Target::Rocm, Target::Cuda119, Target::Rocm119] {
        let r = check_model(&m, target);
        assert!(r.all_on_gpu(), "{}", r.to_text());
    }
    // OneHot with float indices: no kernel takes T1 = float
    let m = tiny_model(
        11,
        &[node("OneHot", &["f", "depth", "vals"], &["o"], vec![])],
        &[
            ("f", DataType::Float),
            ("depth", DataType::Int64),
            ("vals", DataType::Float),
        ],
    );
    assert!(matches!(
        placement(&check_model(&m, Target::Cuda), "OneHot"),
        Placement::Fallback {
            why: Missing::Type { .. },
            ..
        }
    ));
}

#[test]
fn types_flow_through_the_graph() {
    // x:int64 -> Cast(float) -> Log: Log sees float (CUDA has no int64 Log)
    let m = tiny_model(
        13,
        &[
            node(
                "Cast",
                &["x"],
                &["f"],
                vec![int_attr("to", DataType::Float as i64)],
            ),
            node("Log", &["f"], &["p"], vec![]),
            node("Log", &["x"], &["q"], vec![]),
        ],
        &[("x", DataType::Int64)],
    );
    let r = check_model(&m, Target::Cuda);
    let log: HashMap<String, &Placement> = r
        .groups
        .iter()
        .filter(|g| g.op == "Log")
        .map(|g| (g.types["T"].clone(), &g.placement))
        .collect();
    assert!(
        matches!(log["float"], Placement::Gpu { .. }),
        "{}",
        r.to_text()
    );
    assert!(
        matches!(
            log["int64"],
            Placement::Fallback {
                why: Missing::Type { .. },
                ..
            }
        ),
        "{}",
        r.to_text()
    );
}

#[test]
fn special_cases_constants_functions_refusals_and_contrib_ops() {
    let value = ntl_patch::onnx::tensor_attr("value", ntl_patch::onnx::i64_tensor("c", &[1], &[3]));
    let m = tiny_model(
        15,
        &[
            node("Constant", &[], &["k"], vec![value]),
            // CastLike has no kernel on any provider: ORT inlines its function body
            node("CastLike", &["x", "k"], &["xl"], vec![]),
            // the CUDA Cast kernels cannot write strings (and GetCapability refuses Cast to string)
            node(
                "Cast",
                &["x"],
                &["s"],
                vec![int_attr("to", DataType::String as i64)],
            ),
            // a training op ROCm lacks
            node_in(
                "com.microsoft",
                "InPlaceAccumulatorV2",
                &["x", "x"],
                &["acc", "acc_out"],
            ),
            // an op nobody knows
            node_in("org.example", "Mystery", &["x"], &["m"]),
        ],
        &[("x", DataType::Float)],
    );
    let cuda = check_model(&m, Target::Cuda119);
    assert!(
        cuda.groups.iter().all(|g| g.op != "Constant"),
        "Constants become initializers: {}",
        cuda.to_text()
    );
    assert!(
        cuda.notes.iter().any(|n| n.contains("Constant")),
        "{:?}",
        cuda.notes
    );
    assert!(matches!(placement(&cuda, "CastLike"), Placement::Inlined));
    assert!(matches!(
        placement(&cuda, "Cast"),
        Placement::Fallback { cpu: true, .. }
    ));
    assert!(matches!(
        placement(&cuda, "InPlaceAccumulatorV2"),
        Placement::Gpu { .. }
    ));
    assert!(matches!(placement(&cuda, "Mystery"), Placement::Unknown(_)));
    // the inference builds have no training ops, on the GPU or the CPU
    let new = check_model(&m, Target::Cuda);
    assert!(matches!(
        placement(&new, "InPlaceAccumulatorV2"),
        Placement::Fallback {
            why: Missing::NoKernel,
            cpu: false
        }
    ));
    assert!(matches!(placement(&new, "CastLike"), Placement::Inlined));
    let rocm = check_model(&m, Target::Rocm119);
    assert!(matches!(
        placement(&rocm, "InPlaceAccumulatorV2"),
        Placement::Fallback {
            why: Missing::NoKernel,
            cpu: true
        }
    ));
    assert!(matches!(
        placement(&rocm, "Cast"),
        Placement::Fallback { cpu: true, .. }
    ));
    assert!(rocm
        .to_text()
        .contains("com.microsoft:InPlaceAccumulatorV2"));
}

fn node_in(domain: &str, op: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
    NodeProto {
        domain: Some(domain.into()),
        ..node(op, inputs, outputs, vec![])
    }
}

#[test]
fn every_op_ntl_patch_emits_is_in_the_tables() {
    // the schema table resolves each op's version at opsets 13..=21, and both GPU tables know it
    let t = tables();
    let ops = [
        "Gather",
        "Softmax",
        "Unsqueeze",
        "Equal",
        "Cast",
        "ReduceSum",
        "Mul",
        "Sub",
        "Abs",
        "Pow",
        "Where",
        "Less",
        "Max",
        "Min",
        "Div",
        "Add",
        "Identity",
        "Reshape",
        "Transpose",
        "Not",
        "Concat",
        "Slice",
        "Shape",
        "CumSum",
        "ReduceMax",
        "ReduceMean",
        "Range",
        "MatMul",
        "Squeeze",
        "Log",
        "Neg",
        "ArgMax",
        "OneHot",
        "RandomUniformLike",
        "Clip",
        "SoftmaxCrossEntropyLoss",
    ];
    for op in ops {
        for opset in 13..=21 {
            assert!(
                t.op_version("", op, opset).is_some(),
                "{op} at opset {opset}"
            );
        }
        for target in [Target::Cuda119, Target::Rocm119] {
            assert!(
                !t.kernels(target.ep(), "", op).is_empty(),
                "{op} on {}",
                target.name()
            );
        }
        // the inference builds have no SoftmaxCrossEntropyLoss kernel: ORT inlines it
        for target in [Target::Cuda, Target::Rocm] {
            assert_eq!(
                tables_for(target).kernels(target.ep(), "", op).is_empty(),
                op == "SoftmaxCrossEntropyLoss",
                "{op} on {}",
                target.name()
            );
        }
        assert!(migraphx::ops().ops.contains_key(op), "{op} on migraphx");
    }
}

// ---- the maintained runtimes ----------------------------------------------------------------

#[test]
fn each_target_names_its_runtime_and_table() {
    for (name, target, package, version) in [
        ("cuda", Target::Cuda, "onnxruntime-gpu", "1.31.1"),
        ("rocm", Target::Rocm, "onnxruntime-rocm", "1.22.2"),
        (
            "migraphx",
            Target::Migraphx,
            "onnxruntime-migraphx",
            "1.27.1",
        ),
        (
            "cuda-1.19",
            Target::Cuda119,
            "onnxruntime-training",
            "1.19.2",
        ),
        (
            "rocm-1.19",
            Target::Rocm119,
            "onnxruntime-training",
            "1.19.2",
        ),
    ] {
        assert_eq!(Target::parse(name), Some(target));
        assert_eq!(target.name(), name);
        assert_eq!((target.package(), target.ort_version()), (package, version));
    }
    assert!(tables_for(Target::Cuda)
        .kernel_provenance
        .contains("onnxruntime-gpu 1.31.1"));
    assert!(tables_for(Target::Rocm)
        .kernel_provenance
        .contains("onnxruntime-rocm 1.22.2"));
    assert!(migraphx::ops()
        .provenance
        .contains("onnxruntime-migraphx 1.27.1"));
}

#[test]
fn an_op_version_the_new_cuda_table_lacks_is_reported() {
    // Scatter (deprecated at 11) resolves to Scatter-11 at opset 13; CUDA registers 9-10 only
    let m = tiny_model(
        13,
        &[
            node("Scatter", &["x", "i", "u"], &["y"], vec![]),
            node("MatMul", &["x", "x"], &["z"], vec![]),
        ],
        &[
            ("x", DataType::Float),
            ("i", DataType::Int64),
            ("u", DataType::Float),
        ],
    );
    let r = check_model(&m, Target::Cuda);
    match placement(&r, "Scatter") {
        Placement::Fallback {
            why: Missing::Version { registered },
            ..
        } => assert_eq!(registered, vec!["9-10".to_string()]),
        p => panic!("Scatter-11 on CUDA 1.31: {p:?}"),
    }
    assert!(matches!(placement(&r, "MatMul"), Placement::Gpu { .. }));
    let f = fallback_nodes(&m, Target::Cuda);
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!((f[0].index, f[0].op.as_str()), (0, "Scatter"));
    assert_eq!(f[0].version, Some(11));
    assert!(f[0].reason.contains("registered versions: 9-10"), "{f:?}");
    // ROCm 1.22.2 stops at Equal-13 (open-ended): Equal-19 falls back; CUDA 1.31 has Equal-19
    let m = tiny_model(
        19,
        &[node("Equal", &["a", "b"], &["e"], vec![])],
        &[("a", DataType::Int64), ("b", DataType::Int64)],
    );
    assert!(fallback_nodes(&m, Target::Cuda).is_empty());
    let f = fallback_nodes(&m, Target::Rocm);
    assert_eq!(f.len(), 1, "{f:?}");
    assert!(
        f[0].cpu_kernel
            && f[0]
                .reason
                .contains("no rocm Equal kernel serves version 19")
    );
}

#[test]
fn softmax_cross_entropy_is_inlined_by_the_inference_builds() {
    let m = tiny_model(
        17,
        &[common::sce("s", "l", "loss")],
        &[("s", DataType::Float), ("l", DataType::Int64)],
    );
    for target in [Target::Cuda, Target::Rocm] {
        let r = check_model(&m, target);
        assert!(
            matches!(placement(&r, "SoftmaxCrossEntropyLoss"), Placement::Inlined),
            "{}",
            r.to_text()
        );
        assert!(fallback_nodes(&m, target).is_empty());
    }
    for target in [Target::Cuda119, Target::Rocm119, Target::Migraphx] {
        let r = check_model(&m, target);
        assert!(
            matches!(
                placement(&r, "SoftmaxCrossEntropyLoss"),
                Placement::Gpu { .. }
            ),
            "{}",
            r.to_text()
        );
    }
}

// ---- MIGraphX -------------------------------------------------------------------------------

fn f32_init(name: &str, dims: &[i64]) -> ntl_patch::onnx::TensorProto {
    ntl_patch::onnx::TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(DataType::Float as i32),
        float_data: vec![0.0; dims.iter().product::<i64>() as usize],
        ..Default::default()
    }
}

/// x[?, 64] @ w[64, 64] + b, then the given nodes.
fn mgx_model(opset: i64, tail: &[NodeProto], extra_inputs: &[(&str, DataType)]) -> ModelProto {
    let mut nodes = vec![
        node("MatMul", &["x", "w"], &["h"], vec![]),
        node("Add", &["h", "b"], &["hb"], vec![]),
    ];
    nodes.extend_from_slice(tail);
    let mut inputs = vec![("x", DataType::Float)];
    inputs.extend_from_slice(extra_inputs);
    let mut m = tiny_model(opset, &nodes, &inputs);
    let g = m.graph.as_mut().unwrap();
    g.initializer = vec![
        f32_init("w", &[64, 64]),
        f32_init("b", &[64]),
        ntl_patch::onnx::i64_tensor("shape", &[2], &[-1, 8]),
    ];
    m
}

#[test]
fn migraphx_takes_listed_ops_with_constant_shapes() {
    let m = mgx_model(
        17,
        &[
            node("Reshape", &["hb", "shape"], &["r"], vec![]),
            node("Softmax", &["r"], &["p"], vec![]),
            node("Shape", &["hb"], &["sh"], vec![]),
            node("ConstantOfShape", &["sh"], &["z"], vec![]),
            node("Expand", &["b", "sh"], &["bx"], vec![]),
        ],
        &[],
    );
    let r = check_model(&m, Target::Migraphx);
    assert!(r.all_on_gpu(), "{}", r.to_text());
    assert!(fallback_nodes(&m, Target::Migraphx).is_empty());
    assert!(
        r.notes.iter().any(|n| n.contains("migraphx")),
        "{:?}",
        r.notes
    );
}

#[test]
fn migraphx_refuses_runtime_shapes_unlisted_ops_and_strings_and_hands_back_small_pieces() {
    // Reshape whose shape is a graph input: IsUnsupportedOpMode refuses it; Det is not listed.
    // The MatMul piece before them stays (64x64 weights > 300 elements); the Softmax alone after
    // them is handed back (SubgraphPostProcessing).
    let m = mgx_model(
        17,
        &[
            node("Reshape", &["hb", "dyn_shape"], &["r"], vec![]),
            node("Det", &["r"], &["d"], vec![]),
            node("Softmax", &["d"], &["p"], vec![]),
        ],
        &[("dyn_shape", DataType::Int64)],
    );
    let f = fallback_nodes(&m, Target::Migraphx);
    let ops: Vec<&str> = f.iter().map(|n| n.op.as_str()).collect();
    assert_eq!(ops, ["Reshape", "Det", "Softmax"], "{f:?}");
    assert!(f[0].reason.contains("IsUnsupportedOpMode"), "{f:?}");
    assert!(f[1].reason.contains("supported-op list"), "{f:?}");
    assert!(f[2].reason.contains("SubgraphPostProcessing"), "{f:?}");
    // strings are not a MIGraphX type
    let m = mgx_model(
        17,
        &[node("Identity", &["s"], &["s2"], vec![])],
        &[("s", DataType::String)],
    );
    let f = fallback_nodes(&m, Target::Migraphx);
    assert_eq!(f.len(), 1, "{f:?}");
    assert!(f[0].reason.contains("string"), "{f:?}");
    // NonZero of a runtime tensor cannot be evaluated statically
    let m = mgx_model(17, &[node("NonZero", &["hb"], &["nz"], vec![])], &[]);
    let f = fallback_nodes(&m, Target::Migraphx);
    assert_eq!(
        f.iter().map(|n| n.op.as_str()).collect::<Vec<_>>(),
        ["NonZero"]
    );
}

#[test]
fn migraphx_takes_nothing_past_ten_unsupported_nodes() {
    let dets: Vec<NodeProto> = (0..11)
        .map(|i| node("Det", &["hb"], &[&format!("d{i}")], vec![]))
        .collect();
    let m = mgx_model(17, &dets, &[]);
    let r = check_model(&m, Target::Migraphx);
    assert!(matches!(
        placement(&r, "MatMul"),
        Placement::Fallback {
            why: Missing::Refused(_),
            ..
        }
    ));
    assert_eq!(fallback_nodes(&m, Target::Migraphx).len(), 13);
    // ten are still partitioned: the MatMul piece stays
    let m = mgx_model(17, &dets[..10], &[]);
    let r = check_model(&m, Target::Migraphx);
    assert!(
        matches!(placement(&r, "MatMul"), Placement::Gpu { .. }),
        "{}",
        r.to_text()
    );
}

#[test]
fn migraphx_rules_cover_the_ops_the_table_marks() {
    let marked: Vec<&str> = migraphx::ops()
        .ops
        .iter()
        .filter(|(_, checked)| **checked)
        .map(|(op, _)| op.as_str())
        .collect();
    let mut modelled = migraphx::MODE_CHECKED.to_vec();
    modelled.sort();
    assert_eq!(marked, modelled);
    assert_eq!(migraphx::ops().max_unsupported, 10);
    assert!(!migraphx::ops().types.contains(&"string".to_string()));
}

#[test]
fn inspect_accepts_every_target() {
    let tmp = tempfile::tempdir().unwrap();
    let out = patch(&model("lm_flat"), tmp.path(), &["--loss", "mse"]);
    let v = inspect_json(
        &out,
        &["cuda", "rocm", "migraphx", "cuda-1.19", "rocm-1.19"],
    );
    let gpu = v["gpu"].as_array().unwrap();
    let names: Vec<&str> = gpu.iter().map(|r| r["target"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["cuda", "rocm", "migraphx", "cuda-1.19", "rocm-1.19"]
    );
    assert_eq!(gpu[2]["provider"], "MIGraphXExecutionProvider");
    assert_eq!(gpu[2]["table"], "data/ort-1.27.1-migraphx-ops.tsv");
}

/// onnxruntime's CUDA `Attention` kernel refuses `softmax_precision` and `softcap` at run time on
/// every one of its paths: such a node is reported as not running on the GPU, with the reason;
/// the same node without them is not (it is only not checked: the schema table stops at opset
/// 21). Can fail: before, all three were "not checked" alike.
#[test]
fn cuda_attention_with_a_refused_attribute_is_reported() {
    let attention = |out: &str, attrs| node("Attention", &["q", "k", "v"], &[out], attrs);
    let float_attr = |name: &str, v: f32| ntl_patch::onnx::AttributeProto {
        name: Some(name.into()),
        r#type: Some(ntl_patch::onnx::proto::attribute_proto::AttributeType::Float as i32),
        f: Some(v),
        ..Default::default()
    };
    let m = tiny_model(
        23,
        &[
            attention("plain", vec![]),
            attention(
                "precise",
                vec![int_attr("softmax_precision", DataType::Float as i64)],
            ),
            attention("capped", vec![float_attr("softcap", 30.0)]),
        ],
        &[
            ("q", DataType::Float16),
            ("k", DataType::Float16),
            ("v", DataType::Float16),
        ],
    );
    let fallbacks = fallback_nodes(&m, Target::Cuda);
    let reasons: HashMap<String, String> = fallbacks
        .iter()
        .map(|f| (f.name.clone(), f.reason.clone()))
        .collect();
    for (name, attr) in [
        ("n_Attention_precise", "softmax_precision"),
        ("n_Attention_capped", "softcap"),
    ] {
        let why = reasons
            .get(name)
            .unwrap_or_else(|| panic!("{name} not reported: {reasons:?}"));
        assert!(
            why.contains("NOT_IMPLEMENTED") && why.contains(attr),
            "{why}"
        );
    }
    let plain = reasons
        .get("n_Attention_plain")
        .expect("not checked, so listed");
    assert!(plain.starts_with("not checked"), "{plain}");
    // the older CUDA build registers no Attention-23 kernel: nothing to refuse there
    let old = fallback_nodes(&m, Target::Cuda119);
    assert!(
        old.iter().all(|f| !f.reason.contains("NOT_IMPLEMENTED")),
        "{old:?}"
    );
}

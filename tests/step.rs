//! `ntl-patch step`: the step graph's structure, determinism, `--freeze`, and every refusal
//! (one line, exit 1, no file written, input untouched). Numbers are checked against torch
//! and ORT Training in tests/python/test_step.py.

mod common;

use std::path::Path;

use common::*;
use ntl_patch::onnx::proto::type_proto::Value;
use ntl_patch::onnx::FLOAT;

const DOUBLE: i32 = ntl_patch::onnx::proto::tensor_proto::DataType::Double as i32;

fn step_fails(model: &Path, args: &[&str], needle: &str) {
    let dir = model.parent().unwrap();
    let before = std::fs::read(model).unwrap();
    let files = listing(dir);
    let out = bin().arg("step").arg(model).args(args).assert().code(1);
    let stderr = String::from_utf8_lossy(&out.get_output().stderr).to_string();
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(stderr.contains(needle), "expected '{needle}' in: {stderr}");
    assert_eq!(std::fs::read(model).unwrap(), before, "input untouched");
    assert_eq!(listing(dir), files, "no output, no temp file left");
}

/// Writes `model`'s step graph beside it, then runs `validate --json` on it (three training
/// steps in tract against ONNX Runtime), which must exit 0; returns the report.
fn step_and_validate(model: &Path, args: &[&str]) -> serde_json::Value {
    bin().arg("step").arg(model).args(args).assert().success();
    validate_report(&model.with_file_name("model.step.onnx"), &[])
}

#[test]
fn step_graph_has_the_documented_interface() {
    let (dir, m) = case(&model("lm_flat"), |_| {});
    bin().arg("step").arg(&m).assert().success();
    let out = read_model(&dir.path().join("model.step.onnx"));
    let g = out.graph.as_ref().unwrap();
    assert!(g.node.iter().all(|n| matches!(n.domain(), "" | "ai.onnx")));
    let meta = step_metadata(&out);
    let state: Vec<(String, String)> = serde_json::from_value(meta["state"].clone()).unwrap();
    let inputs: Vec<&str> = g.input.iter().map(|i| i.name()).collect();
    let mut want = vec!["input_ids".to_string(), "labels".to_string()];
    want.extend(state.iter().map(|(i, _)| i.clone()));
    want.push("ntl/lr".into());
    assert_eq!(inputs, want);
    let outputs: Vec<&str> = g.output.iter().map(|o| o.name()).collect();
    let mut want = vec!["loss".to_string(), "ce_loss".into(), "number_loss".into()];
    want.extend(state.iter().map(|(_, o)| o.clone()));
    assert_eq!(outputs, want);
    // AdamW: parameter, exp_avg, exp_avg_sq per parameter, then the step count
    let params = meta["parameters"].as_array().unwrap().len();
    assert_eq!(params, 15);
    assert_eq!(state.len(), 3 * params + 1);
    assert_eq!(state.last().unwrap().0, "ntl/state/step");
    assert_eq!(meta["optimizer"]["name"], "adamw");
}

/// The number loss reads its K number-token columns of the logits; its gradient goes into the
/// logits' gradient with one ScatterElements(add) of `[M, K]` values, never as a dense `[M, V]`
/// tensor of its own.
#[test]
fn number_loss_gradients_are_one_sparse_scatter() {
    for (fixture, loss) in [
        ("lm_flat", "wasserstein"),
        ("lm_flat", "dist2"),
        ("lm_bvt", "del"),
        ("lm_nll", "del"),
        ("lm_flat", "smmd"),
    ] {
        let (dir, m) = case(&model(fixture), |_| {});
        bin()
            .arg("step")
            .arg(&m)
            .args(["--loss", loss])
            .assert()
            .success();
        let out = read_model(&dir.path().join("model.step.onnx"));
        let g = out.graph.as_ref().unwrap();
        // (the cross-entropy's own gradient writes its label column with a plain ScatterElements;
        // the embedding's gathered rows are added into its gradient with one more, on axis 0)
        let (rows, adds): (Vec<_>, Vec<_>) = g
            .node
            .iter()
            .filter(|n| n.op_type() == "ScatterElements")
            .filter(|n| {
                n.attribute
                    .iter()
                    .any(|a| a.name() == "reduction" && a.s() == b"add")
            })
            .partition(|n| n.input[1].starts_with("ntl/grad/gather_rows_idx"));
        assert_eq!(adds.len(), 1, "{fixture} {loss}");
        assert_eq!(rows.len(), 1, "{fixture} {loss}: the embedding's rows");
        // one Gather of number-token columns (axis 1) of the logits the loss reads
        let column_gathers = g
            .node
            .iter()
            .filter(|n| n.op_type() == "Gather" && n.name().starts_with("ntl/"))
            .filter(|n| n.attribute.iter().any(|a| a.name() == "axis" && a.i() == 1))
            .count();
        assert_eq!(column_gathers, 1, "{fixture} {loss}");
    }
}

#[test]
fn step_output_is_deterministic() {
    let (dir, m) = case(&model("lm_bvt"), |_| {});
    let a = dir.path().join("a.onnx");
    let b = dir.path().join("b.onnx");
    bin()
        .arg("step")
        .arg(&m)
        .arg("-o")
        .arg(&a)
        .assert()
        .success();
    bin()
        .arg("step")
        .arg(&m)
        .arg("-o")
        .arg(&b)
        .assert()
        .success();
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
}

#[test]
fn freeze_keeps_parameters_constant() {
    let (dir, m) = case(&model("lm_flat"), |_| {});
    let out = dir.path().join("f.onnx");
    bin()
        .arg("step")
        .arg(&m)
        .args(["--freeze", "emb.", "--freeze", "head.", "-o"])
        .arg(&out)
        .assert()
        .success();
    let meta = step_metadata(&read_model(&out));
    let params: Vec<String> = serde_json::from_value(meta["parameters"].clone()).unwrap();
    let frozen: Vec<String> = serde_json::from_value(meta["frozen"].clone()).unwrap();
    assert_eq!(frozen, ["emb.weight", "head.weight", "head.bias"]);
    assert_eq!(params.len(), 12);
    assert!(params.iter().all(|p| !frozen.contains(p)));
}

/// `--freeze` of what step keeps constant anyway (Llama's rotary `inv_freq` buffer) holds as
/// asked: a note, not an error; a prefix that matches no initializer at all stays an error.
#[test]
fn freezing_a_buffer_is_a_note() {
    let (dir, m) = case(&model("llama_dynamo"), |_| {});
    let out = dir.path().join("s.onnx");
    let o = bin()
        .arg("step")
        .arg(&m)
        .args(["--freeze", "model.rotary_emb.inv_freq", "--json", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(
        stderr.contains("note: --freeze 'model.rotary_emb.inv_freq' matches 1 initializer(s)"),
        "{stderr}"
    );
    let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(summary["frozen"], serde_json::json!([]));
    assert!(summary["buffers"]
        .as_array()
        .unwrap()
        .contains(&serde_json::json!("model.rotary_emb.inv_freq")));
    std::fs::remove_file(&out).unwrap();
    step_fails(
        &m,
        &["--freeze", "model.rotary_emb.no_such"],
        "matches no trained parameter and no initializer",
    );
}

#[test]
fn buffers_the_dynamo_exporter_records_are_not_trained() {
    use ntl_patch::onnx::proto::{StringStringEntryProto, ValueInfoProto};
    // torch.export's graph signature, as the dynamo exporter writes it on a value's metadata
    let kind = |name: &str, kind: &str| ValueInfoProto {
        name: Some(name.into()),
        metadata_props: vec![StringStringEntryProto {
            key: Some("pkg.torch.export.graph_signature.InputSpec.kind".into()),
            value: Some(kind.into()),
        }],
        ..Default::default()
    };
    let (dir, m) = case(&model("lm_flat"), |m| {
        let g = m.graph.as_mut().unwrap();
        g.value_info.push(kind("fc1.bias", "BUFFER"));
        g.value_info.push(kind("fc2.bias", "PARAMETER"));
    });
    let out = dir.path().join("s.onnx");
    let o = bin()
        .arg("step")
        .arg(&m)
        .arg("-o")
        .arg(&out)
        .arg("--json")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(summary["buffers"], serde_json::json!(["fc1.bias"]));
    let meta = step_metadata(&read_model(&out));
    let params: Vec<String> = serde_json::from_value(meta["parameters"].clone()).unwrap();
    assert_eq!(params.len(), 14);
    assert!(!params.contains(&"fc1.bias".to_string()));
    assert!(params.contains(&"fc2.bias".to_string()));
}

#[test]
fn split_writes_gradient_and_update_graphs() {
    let (dir, m) = case(&model("lm_nll"), |_| {});
    bin()
        .arg("step")
        .arg(&m)
        .args(["--split", "--optimizer", "sgd", "--momentum", "0.9"])
        .assert()
        .success();
    let grad = read_model(&dir.path().join("model.grad.onnx"));
    let update = read_model(&dir.path().join("model.update.onnx"));
    let g = grad.graph.as_ref().unwrap();
    let params: Vec<String> =
        serde_json::from_value(step_metadata(&grad)["parameters"].clone()).unwrap();
    let outs: Vec<&str> = g.output.iter().map(|o| o.name()).collect();
    assert_eq!(&outs[..3], ["loss", "ce_loss", "number_loss"]);
    let grads: Vec<String> = params.iter().map(|p| format!("ntl/grad/{p}")).collect();
    assert_eq!(
        &outs[3..],
        grads.iter().map(|s| s.as_str()).collect::<Vec<_>>()
    );
    let u = update.graph.as_ref().unwrap();
    let u_inputs: Vec<&str> = u.input.iter().map(|i| i.name()).collect();
    for gname in &grads {
        assert!(
            u_inputs.contains(&gname.as_str()),
            "{gname} feeds the update"
        );
    }
    assert!(u_inputs.contains(&"ntl/lr"));
}

#[test]
fn refusals_are_one_line_and_write_nothing() {
    let (_d, m) = case(&model("lm_flat"), |_| {});
    step_fails(&m, &["--lr", "0"], "--lr must be");
    step_fails(&m, &["--lr", "-1"], "--lr must be");
    step_fails(&m, &["--lr", "NaN"], "--lr must be");
    step_fails(&m, &["--lr", "inf"], "--lr must be");
    step_fails(&m, &["--beta2", "1"], "--beta1 and --beta2");
    step_fails(&m, &["--momentum", "0.9"], "SGD option");
    step_fails(&m, &["--max-grad-norm", "0"], "--max-grad-norm");
    step_fails(
        &m,
        &["--freeze", "no.such."],
        "--freeze 'no.such.' matches no",
    );
}

#[test]
fn weights_of_another_float_type_are_named() {
    // a float64 export: the same weights widened, every float value retyped
    let (_d, m) = case(&model("lm_flat"), |m| {
        let g = m.graph.as_mut().unwrap();
        for t in g.initializer.iter_mut().filter(|t| t.data_type() == FLOAT) {
            let values: Vec<f64> = if t.raw_data().is_empty() {
                t.float_data.iter().map(|&v| v as f64).collect()
            } else {
                t.raw_data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
                    .collect()
            };
            t.float_data.clear();
            t.raw_data = None;
            t.double_data = values;
            t.data_type = Some(DOUBLE);
        }
        let values = g
            .input
            .iter_mut()
            .chain(&mut g.output)
            .chain(&mut g.value_info);
        for v in values {
            if let Some(Value::TensorType(tt)) = v.r#type.as_mut().and_then(|t| t.value.as_mut()) {
                if tt.elem_type() == FLOAT {
                    tt.elem_type = Some(DOUBLE);
                }
            }
        }
    });
    step_fails(&m, &[], "the weights are float64");
}

#[test]
fn unsupported_op_on_a_parameter_path_is_named() {
    // Tanh -> Softsign: same arity, no gradient rule.
    let (_d, m) = case(&model("lm_flat"), |m| {
        let g = m.graph.as_mut().unwrap();
        let n = g.node.iter_mut().find(|n| n.op_type() == "Tanh").unwrap();
        n.op_type = Some("Softsign".into());
    });
    step_fails(&m, &[], "no gradient rule for Softsign");
}

#[test]
fn einsums_without_a_gradient_are_refused() {
    // a diagonal (a subscript twice in one operand), no equation, an equation of another rank
    for (equation, needle) in [
        (Some("bbv->bv"), "a subscript repeats within one operand"),
        (None, "it has no equation"),
        (Some("bv->bv"), "does not match the rank of an operand"),
    ] {
        let (_d, m) = case(&model("lm_flat"), |m| {
            let g = m.graph.as_mut().unwrap();
            let n = g.node.iter_mut().find(|n| n.op_type() == "Tanh").unwrap();
            n.op_type = Some("Einsum".into());
            n.attribute = equation
                .map(|e| ntl_patch::onnx::string_attr("equation", e))
                .into_iter()
                .collect();
        });
        step_fails(&m, &[], needle);
    }
}

#[test]
fn step_graphs_and_ort_training_graphs_are_refused() {
    let (dir, m) = case(&model("lm_flat"), |_| {});
    bin().arg("step").arg(&m).assert().success();
    let step = dir.path().join("model.step.onnx");
    step_fails(&step, &["-o", "again.onnx"], "already");

    let (_d, t) = case(&model("lm_flat"), |m| {
        let g = m.graph.as_mut().unwrap();
        let mut n = g.node[0].clone();
        n.op_type = Some("SoftmaxCrossEntropyLossGrad".into());
        n.domain = Some("com.microsoft".into());
        n.output = vec!["dlogits".into()];
        n.name = Some("grad_node".into());
        g.node.push(n);
    });
    step_fails(&t, &[], "ONNX Runtime training graph");
    // the plain patch command refuses it too
    let before = listing(t.parent().unwrap());
    let out = bin().arg(&t).assert().code(1);
    let stderr = String::from_utf8_lossy(&out.get_output().stderr).to_string();
    assert!(stderr.contains("ntl-patch artifacts"), "{stderr}");
    assert_eq!(listing(t.parent().unwrap()), before);
}

#[test]
fn validate_trains_a_step_graph_in_tract_like_onnxruntime() {
    // Needs ORT_DYLIB_PATH (scripts/test.sh sets it): tract's three steps are compared with
    // ONNX Runtime's, so without the library the comparison is missing and this fails.
    for (fixture, args) in [
        ("lm_flat", vec!["--loss", "wasserstein"]),
        (
            "lm_bvt",
            vec!["--loss", "mse", "--optimizer", "sgd", "--momentum", "0.9"],
        ),
        ("lm_nll", vec!["--loss", "ntil", "--max-grad-norm", "1"]),
        ("lm_flat", vec!["--loss", "dist2"]),
        ("lm_nll", vec!["--loss", "del"]),
        ("lm_bvt", vec!["--loss", "smmd"]),
    ] {
        let (_dir, m) = case(&model(fixture), |_| {});
        let report = step_and_validate(&m, &args);
        assert_eq!(
            passed_checks_against_onnxruntime(&report, fixture),
            3 * 3 + 1,
            "{fixture}: {report}"
        );
    }
}

#[test]
fn validate_trains_an_fp16_step_graph_and_refuses_bf16() {
    // tract rounds every float16 result, onnxruntime's CPU provider computes most float16 nodes
    // in float32: both run, compared within float16's tolerance (with float32's the first step
    // already differs by 2e-5); bf16 runs on neither, refused in one line
    let (dir, m) = case(&model("lm_flat"), |_| {});
    let report = step_and_validate(&m, &["--precision", "fp16"]);
    assert_eq!(
        passed_checks_against_onnxruntime(&report, "fp16"),
        3 * 3 + 1,
        "{report}"
    );
    assert!(
        report.to_string().contains("a float16 step graph"),
        "{report}"
    );
    let out = dir.path().join("bf16.step.onnx");
    bin()
        .args(["step", m.to_str().unwrap(), "--precision", "bf16", "-o"])
        .arg(&out)
        .assert()
        .success();
    let r = bin().arg("validate").arg(&out).assert().code(1);
    let err = String::from_utf8_lossy(&r.get_output().stderr).to_string();
    assert!(
        err.contains("runs on GPUs only") && err.trim().lines().count() == 1,
        "{err}"
    );
}

#[test]
fn tract_trains_a_celu_like_onnxruntime() {
    // tract 0.23's own Celu misses α: validate spells it out, so both runtimes agree
    let (_dir, m) = case(&model("lm_flat"), |m| {
        let g = m.graph.as_mut().unwrap();
        let n = g.node.iter_mut().find(|n| n.op_type() == "Tanh").unwrap();
        n.op_type = Some("Celu".into());
        n.attribute = vec![ntl_patch::onnx::float_attr("alpha", 0.5)];
    });
    let report = step_and_validate(&m, &[]);
    assert!(
        passed_checks_against_onnxruntime(&report, "celu") >= 1,
        "{report}"
    );
}

#[test]
fn parameters_holding_the_same_values_are_warned_about() {
    // k.weight a copy of q.weight: as when an exporter stores one weight twice
    let (dir, m) = case(&model("lm_flat"), |m| {
        let g = m.graph.as_mut().unwrap();
        let q = g
            .initializer
            .iter()
            .find(|t| t.name() == "q.weight")
            .unwrap()
            .clone();
        let k = g
            .initializer
            .iter_mut()
            .find(|t| t.name() == "k.weight")
            .unwrap();
        k.raw_data = q.raw_data;
        k.float_data = q.float_data;
    });
    let out = bin().arg("step").arg(&m).arg("--json").assert().success();
    let summary: serde_json::Value = serde_json::from_slice(&out.get_output().stdout).unwrap();
    let warnings = summary["warnings"].to_string();
    assert!(
        warnings.contains("'q.weight' and 'k.weight' hold the same values"),
        "{warnings}"
    );
    // the fixture itself has no copies
    let plain = bin()
        .arg("step")
        .arg(model("lm_flat"))
        .arg("--tokenizer")
        .arg(tokenizer())
        .arg("-o")
        .arg(dir.path().join("plain.step.onnx"))
        .arg("--json")
        .assert()
        .success();
    let stdout = String::from_utf8_lossy(&plain.get_output().stdout).to_string();
    assert!(!stdout.contains("hold the same values"), "{stdout}");
}

#[test]
fn a_reshape_to_a_shape_computed_like_tf2onnx_keeps_its_rank() {
    // tf2onnx's Dense on [B, T, D]: Reshape(x, Concat(ReduceProd(Gather(Shape(x), [0, 1])),
    // [D])) → MatMul, and back; the MatMul's gradient needs the reshaped rank
    let (_dir, m) = case(&model("lm_flat"), |m| {
        let g = m.graph.as_mut().unwrap();
        g.initializer
            .push(ntl_patch::onnx::i64_tensor("lead_axes", &[2], &[0, 1]));
        g.initializer
            .push(ntl_patch::onnx::i64_tensor("width", &[1], &[16]));
        let at = g
            .node
            .iter()
            .position(|n| n.name() == "/fc1/MatMul")
            .unwrap();
        let tf_reshape = [
            node("Shape", &["/Add_output_0"], &["tf/shape"], vec![]),
            node("Gather", &["tf/shape", "lead_axes"], &["tf/lead"], vec![]),
            node("ReduceProd", &["tf/lead"], &["tf/rows"], vec![]),
            node(
                "Concat",
                &["tf/rows", "width"],
                &["tf/target"],
                vec![ntl_patch::onnx::int_attr("axis", 0)],
            ),
            node(
                "Reshape",
                &["/Add_output_0", "tf/target"],
                &["tf/flat"],
                vec![],
            ),
        ];
        g.node.splice(at..at, tf_reshape);
        let fc1 = g
            .node
            .iter_mut()
            .find(|n| n.name() == "/fc1/MatMul")
            .unwrap();
        fc1.input[0] = "tf/flat".into();
        let residual = g
            .node
            .iter()
            .position(|n| n.input.iter().any(|i| i == "/fc2/Add_output_0"))
            .unwrap();
        g.node.insert(
            residual,
            node(
                "Reshape",
                &["/fc2/Add_output_0", "tf/shape"],
                &["tf/back"],
                vec![],
            ),
        );
        for i in &mut g.node[residual + 1].input {
            if i == "/fc2/Add_output_0" {
                *i = "tf/back".into();
            }
        }
    });
    let report = step_and_validate(&m, &[]);
    assert_eq!(report["passed"], true, "{report}");
}

/// The optimizer's products that read only state (`v·β2`, `p·(1 − lr·wd)`, SGD's `buf·μ` and
/// `wd·p`) wait for their parameter's gradient: an order that runs ready nodes early
/// (onnxruntime's PRIORITY_BASED, which recompute graphs run with) would otherwise compute
/// them in the forward and hold each, the size of its parameter, until the update.
#[test]
fn the_update_never_runs_before_the_batch_is_read() {
    let cases: [&[&str]; 3] = [
        &["--weight-decay", "0.1"],
        &[
            "--optimizer",
            "sgd",
            "--momentum",
            "0.9",
            "--weight-decay",
            "0.1",
        ],
        &["--weight-decay", "0.1", "--max-grad-norm", "1.0"],
    ];
    for args in cases {
        let (dir, m) = case(&model("lm_flat"), |_| {});
        bin().arg("step").arg(&m).args(args).assert().success();
        let out = read_model(&dir.path().join("model.step.onnx"));
        let g = out.graph.as_ref().unwrap();
        let state: Vec<(String, String)> =
            serde_json::from_value(step_metadata(&out)["state"].clone()).unwrap();
        let tensors: std::collections::HashSet<&str> = state
            .iter()
            .map(|(i, _)| i.as_str())
            .filter(|i| *i != "ntl/state/step")
            .collect();
        // what depends on the batch, in node order (the graph is topologically sorted)
        let mut batch: std::collections::HashSet<&str> = ["input_ids", "labels"].into();
        for n in &g.node {
            if n.input.iter().any(|i| batch.contains(i.as_str())) {
                batch.extend(n.output.iter().map(|o| o.as_str()));
            }
        }
        // what the losses need: the forward (and its own reads of the parameters)
        let mut needed: std::collections::HashSet<&str> = ["loss", "ce_loss", "number_loss"].into();
        for n in g.node.iter().rev() {
            if n.output.iter().any(|o| needed.contains(o.as_str())) {
                needed.extend(n.input.iter().map(|i| i.as_str()));
            }
        }
        let early: Vec<String> = g
            .node
            .iter()
            .filter(|n| !n.output.iter().any(|o| needed.contains(o.as_str())))
            .filter(|n| {
                let update = |o: &String| o.starts_with("ntl/opt/") || o.starts_with("ntl/next/");
                n.output.iter().any(update)
            })
            .filter(|n| n.input.iter().any(|i| tensors.contains(i.as_str())))
            .filter(|n| !n.output.iter().any(|o| batch.contains(o.as_str())))
            .map(|n| format!("{} {}", n.op_type(), n.output[0]))
            .collect();
        assert!(
            early.is_empty(),
            "{args:?}: update nodes ready before the batch: {early:?}"
        );
    }
}

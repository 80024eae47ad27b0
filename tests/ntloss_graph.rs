//! The patched graph itself (run by tract through `validate --reference`) against every
//! recorded ntloss 0.3.2 case and setting: `fixtures/reference/ntloss_cases.json`, forward
//! values within 1e-5 relative. The graph's only input besides the labels is the logits, so
//! the recorded logits are fed straight in.

mod common;

use common::*;
use ntl_patch::onnx::proto::tensor_proto::DataType;
use ntl_patch::onnx::{f32_tensor, i64_tensor, GraphProto, TensorProto};
use prost::Message;

/// logits [B, T, V] and labels [B, T] as inputs; Reshape to [B·T, V] / [B·T]; SCE → loss.
fn logits_model(b: i64, t: i64, v: i64) -> ntl_patch::onnx::ModelProto {
    model_proto(
        GraphProto {
            name: Some("logits_input".into()),
            node: vec![
                node("Reshape", &["logits", "shape_nv"], &["scores"], vec![]),
                node("Reshape", &["labels", "shape_n"], &["labels_flat"], vec![]),
                sce("scores", "labels_flat", "loss"),
            ],
            initializer: vec![
                i64_tensor("shape_nv", &[2], &[-1, v]),
                i64_tensor("shape_n", &[1], &[-1]),
            ],
            input: vec![
                value("logits", DataType::Float, &[Some(b), Some(t), Some(v)]),
                value("labels", DataType::Int64, &[Some(b), Some(t)]),
            ],
            output: vec![value("loss", DataType::Float, &[])],
            ..Default::default()
        },
        17,
    )
}

fn scalar(name: &str, x: f64) -> TensorProto {
    f32_tensor(name, &[], &[x as f32])
}

#[test]
fn patched_graph_matches_ntloss_on_every_case() {
    let text = std::fs::read_to_string(fixture("reference/ntloss_cases.json")).unwrap();
    let cases: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut checked = 0;
    for case in cases["cases"].as_array().unwrap() {
        let (b, t) = (case["B"].as_i64().unwrap(), case["T"].as_i64().unwrap());
        let logits = json_f32_matrix(&case["logits"]);
        let v = logits.len() as i64 / (b * t);
        let labels: Vec<i64> = case["labels"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect();
        for r in case["results"].as_array().unwrap() {
            let dir = tempfile::tempdir().unwrap();
            let src = dir.path().join("model.onnx");
            std::fs::write(&src, logits_model(b, t, v).encode_to_vec()).unwrap();
            let mut args = vec![
                "--loss".to_string(),
                r["loss"].as_str().unwrap().to_string(),
            ];
            if r["reweigh"].as_bool().unwrap() {
                args.push("--reweigh".into());
            }
            if let Some(s) = r["squash"].as_f64() {
                args.extend(["--squash".into(), s.to_string()]);
            }
            if !r["digit_level"].as_bool().unwrap() {
                args.push("--all-numbers".into());
            }
            let out = patch(
                &src,
                dir.path(),
                &args.iter().map(String::as_str).collect::<Vec<_>>(),
            );

            let data = dir.path().join("test_data");
            std::fs::create_dir(&data).unwrap();
            let files = [
                ("input_0.pb", f32_tensor("logits", &[b, t, v], &logits)),
                ("input_1.pb", i64_tensor("labels", &[b, t], &labels)),
                ("output_0.pb", scalar("loss", r["total"].as_f64().unwrap())),
                ("output_1.pb", scalar("ce_loss", r["ce"].as_f64().unwrap())),
                (
                    "output_2.pb",
                    scalar("number_loss", r["ntl"].as_f64().unwrap()),
                ),
            ];
            for (name, tensor) in files {
                std::fs::write(data.join(name), tensor.encode_to_vec()).unwrap();
            }
            let run = bin()
                .arg("validate")
                .arg(&out)
                .arg("--tokenizer")
                .arg(tokenizer())
                .arg("--reference")
                .arg(&data)
                .args(["--rtol", "1e-5", "--atol", "1e-7"])
                .output()
                .unwrap();
            assert!(
                run.status.success(),
                "{} {args:?}:\n{}{}",
                case["name"],
                String::from_utf8_lossy(&run.stdout),
                String::from_utf8_lossy(&run.stderr)
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 60, "every recorded case and setting");
}

//! transformers GPT-2 and Llama exported with their own (shifted) loss by the TorchScript and
//! the dynamo exporter: patched, validated with tract against the independent reference, and
//! trained by the step graph in tract like in ONNX Runtime (needs ORT_DYLIB_PATH, as
//! scripts/test.sh sets).

mod common;

use common::*;

fn validate_json(path: &std::path::Path) -> serde_json::Value {
    validate_report(path, &["--tokenizer", tokenizer().to_str().unwrap()])
}

const MODELS: [&str; 4] = ["gpt2_ts", "llama_ts", "gpt2_dynamo", "llama_dynamo"];

/// `ntl-patch step` of a fixture into `dir/<name>.step.onnx`.
fn step_graph(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    step_graph_with(dir, name, &[])
}

fn step_graph_with(dir: &std::path::Path, name: &str, extra: &[&str]) -> std::path::PathBuf {
    let out = dir.join(format!("{name}{}.step.onnx", extra.join("")));
    bin()
        .arg("step")
        .arg(model(name))
        .arg("--tokenizer")
        .arg(tokenizer())
        .args(extra)
        .arg("-o")
        .arg(&out)
        .assert()
        .success();
    out
}

/// The report has `count` checks and every one passed.
fn all_passed(report: &serde_json::Value, count: usize, what: &str) {
    let checks = report["checks"].as_array().unwrap();
    assert_eq!(checks.len(), count, "{what}: {report}");
    assert!(
        checks.iter().all(|c| c["passed"] == true),
        "{what}: {report}"
    );
}

#[test]
fn transformers_graphs_validate_for_every_loss_family() {
    let dir = tempfile::tempdir().unwrap();
    // the dynamo exports need the validation copy's tract rewrites (INT64_MAX slice ends, the
    // position ids' cumsum of a cast mask)
    for name in MODELS {
        for loss in ["wasserstein", "ntil"] {
            let out = dir.path().join(format!("{name}-{loss}.onnx"));
            bin()
                .arg(model(name))
                .args(["--loss", loss, "--tokenizer"])
                .arg(tokenizer())
                .arg("-o")
                .arg(&out)
                .assert()
                .success();
            all_passed(&validate_json(&out), 3, &format!("{name}/{loss}"));
        }
    }
}

#[test]
fn transformers_step_graphs_train_in_tract_like_onnxruntime() {
    let dir = tempfile::tempdir().unwrap();
    for name in MODELS {
        let out = step_graph(dir.path(), name);
        all_passed(&validate_json(&out), 3 + 3 * 3 + 1, name);
    }
}

/// The Hugging Face step graphs run whole on the GPU kernel tables of onnxruntime-gpu 1.31.1
/// (CUDA) and onnxruntime-rocm 1.22.2 and are taken whole by the onnxruntime-migraphx 1.27.1
/// model: their label shift's integer `Pad` runs on float64, `CastLike` becomes `Cast`, and the
/// Slice/ReduceMean gradients need no `Size`/`Range` (docs/GPU.md, "Step graphs"). MIGraphX
/// takes no `Scan`: for it the attention stays as exported (`--attention eager`), as the docs say;
/// the default blockwise attention's `Scan`s and bodies run whole on CUDA and ROCm.
#[test]
fn transformers_step_graphs_have_no_gpu_fallback() {
    let dir = tempfile::tempdir().unwrap();
    for name in MODELS {
        let blockwise = step_graph(dir.path(), name);
        let eager = step_graph_with(dir.path(), name, &["--attention", "eager"]);
        for (target, out) in [
            ("cuda", &blockwise),
            ("rocm", &blockwise),
            ("migraphx", &eager),
        ] {
            let o = bin()
                .arg("inspect")
                .arg(out)
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

/// Slices' gradients cost the backward no `Pad`: a Slice that keeps every element (the dynamo
/// exporter writes `x[:, :, :d]` as one Slice an axis, the whole ones included) passes its
/// gradient on as it is, and slices that tile an axis (Llama's `rotate_half` halves of q and k,
/// GPT-2's q/k/v thirds in the dynamo export) have their gradients joined by one `Concat`
/// instead of each padded back with zeros and summed. Can fail: on the code before, Llama's
/// dynamo step graph had 27 gradient `Pad`s (19 by zeros), GPT-2's 9 (3 by zeros).
#[test]
fn slices_cost_the_backward_no_pad() {
    let dir = tempfile::tempdir().unwrap();
    for (name, joined) in [("gpt2_dynamo", 2), ("llama_ts", 4), ("llama_dynamo", 4)] {
        let m = read_model(&step_graph(dir.path(), name));
        let g = m.graph.as_ref().unwrap();
        let made = |op: &str, prefix: &str| {
            g.node
                .iter()
                .filter(|n| n.op_type() == op && n.output[0].starts_with(prefix))
                .count()
        };
        assert_eq!(made("Pad", "ntl/grad/"), 0, "{name}: gradient Pads");
        let concats = made("Concat", "ntl/grad/slices_joined");
        assert_eq!(concats, joined, "{name}: slices joined");
    }
}

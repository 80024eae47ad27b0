//! `ntl-patch step --recompute`: the recomputing step graph trains in tract like in
//! onnxruntime (`validate`), is deterministic, and its refusals are one line that write nothing.
//! Gradients against the graph without recomputation and torch: tests/python/test_recompute.py.

mod common;

use common::*;

#[test]
fn validate_trains_a_recomputing_step_graph_in_tract_like_onnxruntime() {
    // Needs ORT_DYLIB_PATH (scripts/test.sh sets it), as tests/step.rs
    for fixture in ["llama_ts", "gpt2_dynamo"] {
        let (_dir, m) = case(&model(fixture), |_| {});
        let out = m.with_file_name("model.step.onnx");
        bin()
            .arg("step")
            .arg(&m)
            .args(["--loss", "wasserstein", "--recompute", "layers"])
            .assert()
            .success();
        let recompute = &step_metadata(&read_model(&out))["recompute"];
        assert_eq!(recompute["blocks"], 2, "{fixture}: {recompute}");
        assert!(recompute["recomputed_nodes"].as_u64().unwrap() > 50);
        let report = validate_report(&out, &[]);
        assert!(
            passed_checks_against_onnxruntime(&report, fixture) >= 3,
            "{fixture}: {report}"
        );
    }
}

#[test]
fn recomputing_step_graph_is_deterministic() {
    let (dir, m) = case(&model("llama_dynamo"), |_| {});
    let outputs: Vec<Vec<u8>> = ["a.onnx", "b.onnx"]
        .iter()
        .map(|name| {
            let out = dir.path().join(name);
            bin()
                .arg("step")
                .arg(&m)
                .args(["--recompute", "layers", "-o"])
                .arg(&out)
                .assert()
                .success();
            std::fs::read(out).unwrap()
        })
        .collect();
    assert_eq!(outputs[0], outputs[1]);
}

#[test]
fn refusals_are_one_line_and_write_nothing() {
    let cases: [(&str, &[&str], &str); 3] = [
        (
            "lm_flat",
            &["--recompute", "layers"],
            "found no repeated blocks",
        ),
        ("llama_ts", &["--batch", "4"], "add --recompute auto"),
        ("llama_ts", &["--recompute", "sometimes"], "--recompute"),
    ];
    for (fixture, args, needle) in cases {
        let (dir, m) = case(&model(fixture), |_| {});
        let before = listing(dir.path());
        let out = bin().arg("step").arg(&m).args(args).assert().failure();
        let stderr = String::from_utf8_lossy(&out.get_output().stderr).to_string();
        assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
        assert!(stderr.contains(needle), "expected '{needle}' in: {stderr}");
        assert_eq!(listing(dir.path()), before, "no output, no temp file left");
    }
}

//! `ntl-patch step --lora-r`: which layers get adapters in each exporter's spelling, what
//! trains, the metadata the runners read, determinism, `validate`, and every refusal (one
//! line, exit 1, nothing written). The numbers against torch + PEFT are in
//! tests/python/test_lora.py, the float16 base in tests/python/test_lora_half.py.

mod common;

use std::path::Path;

use common::*;
use ntl_patch::onnx::ModelProto;

/// `ntl-patch [command] MODEL args` fails in one line naming `needle`, writing nothing.
fn fails(command: Option<&str>, model: &Path, args: &[&str], needle: &str) {
    let dir = model.parent().unwrap();
    let before = std::fs::read(model).unwrap();
    let files = listing(dir);
    let out = bin().args(command).arg(model).args(args).assert().code(1);
    let stderr = String::from_utf8_lossy(&out.get_output().stderr).to_string();
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert!(stderr.contains(needle), "expected '{needle}' in: {stderr}");
    assert_eq!(std::fs::read(model).unwrap(), before, "input untouched");
    assert_eq!(listing(dir), files, "no output, no temp file left");
}

/// Runs `step` with `args`; the step graph and the JSON summary.
fn step(model: &Path, args: &[&str]) -> (ModelProto, serde_json::Value) {
    let out_path = model.with_file_name("model.step.onnx");
    let out = bin()
        .arg("step")
        .arg(model)
        .args(args)
        .arg("-o")
        .arg(&out_path)
        .arg("--json")
        .assert()
        .success();
    let summary = serde_json::from_slice(&out.get_output().stdout).unwrap();
    (read_model(&out_path), summary)
}

fn floats(m: &ModelProto, name: &str) -> Vec<f32> {
    let t = m
        .graph
        .as_ref()
        .unwrap()
        .initializer
        .iter()
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("no initializer {name}"));
    match t.raw_data.as_deref().filter(|r| !r.is_empty()) {
        Some(raw) => raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        None => t.float_data.clone(),
    }
}

#[test]
fn each_exporters_linear_layers_get_peft_adapters() {
    // (fixture, targets by default, layers, module of the first, its layout, fan_in_fan_out, in, out)
    let cases = [
        (
            "gpt2_ts",
            "c_attn",
            2,
            "transformer.h.0.attn.c_attn",
            "in_out",
            true,
            32,
            96,
        ),
        (
            "gpt2_dynamo",
            "c_attn",
            2,
            "transformer.h.0.attn.c_attn",
            "in_out",
            true,
            32,
            96,
        ),
        (
            "llama_ts",
            "q_proj,v_proj",
            4,
            "model.layers.0.self_attn.q_proj",
            "out_in",
            false,
            32,
            32,
        ),
        (
            "llama_dynamo",
            "q_proj,v_proj",
            4,
            "model.layers.0.self_attn.q_proj",
            "out_in",
            false,
            32,
            32,
        ),
    ];
    for (fixture, targets, n, module, layout, fifo, inf, outf) in cases {
        let (_d, m) = case(&model(fixture), |_| {});
        let (g, summary) = step(&m, &["--lora-r", "4"]);
        let meta = step_metadata(&g);
        let lora = &meta["lora"];
        assert_eq!(
            lora["target_modules"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_str().unwrap())
                .collect::<Vec<_>>()
                .join(","),
            targets,
            "{fixture}"
        );
        assert_eq!(lora["r"], 4);
        assert_eq!(lora["lora_alpha"], 8.0);
        assert_eq!(lora["scaling"], 2.0);
        let layers = lora["layers"].as_array().unwrap();
        assert_eq!(layers.len(), n, "{fixture}: {lora}");
        let first = &layers[0];
        assert_eq!(first["module"], module, "{fixture}");
        assert_eq!(first["weight"], format!("{module}.weight"), "{fixture}");
        assert_eq!(first["weight_layout"], layout, "{fixture}");
        assert_eq!(first["fan_in_fan_out"], fifo, "{fixture}");
        assert_eq!(
            (
                first["in_features"].as_i64().unwrap(),
                first["out_features"].as_i64().unwrap()
            ),
            (inf, outf)
        );
        // only A and B train, and only they have optimizer state
        let params: Vec<&str> = meta["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        let mut want: Vec<String> = layers
            .iter()
            .flat_map(|l| {
                [
                    l["lora_A"].as_str().unwrap().to_string(),
                    l["lora_B"].as_str().unwrap().to_string(),
                ]
            })
            .collect();
        want.sort();
        let mut got: Vec<String> = params.iter().map(|p| p.to_string()).collect();
        got.sort();
        assert_eq!(got, want, "{fixture}");
        assert_eq!(summary["parameters"].as_array().unwrap().len(), 2 * n);
        for (input, _) in meta["state"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_str().unwrap(), p[1].as_str().unwrap()))
        {
            assert!(
                input.starts_with("ntl/lora/")
                    || input.starts_with("ntl/state/ntl/lora/")
                    || input == "ntl/state/step",
                "{fixture}: state {input}"
            );
        }
        // A: nn.Linear's init, within ±1/√in; B: zeros
        let a = floats(&g, first["lora_A"].as_str().unwrap());
        let b = floats(&g, first["lora_B"].as_str().unwrap());
        assert_eq!((a.len(), b.len()), (4 * inf as usize, 4 * outf as usize));
        let bound = 1.0 / (inf as f32).sqrt();
        assert!(a.iter().all(|v| v.abs() <= bound) && a.iter().any(|v| v.abs() > bound / 2.0));
        assert!(b.iter().all(|&v| v == 0.0));
    }
}

#[test]
fn lora_step_graphs_are_deterministic_and_seeded() {
    let (dir, m) = case(&model("llama_dynamo"), |_| {});
    let run = |name: &str, seed: &str| {
        let out = dir.path().join(name);
        bin()
            .arg("step")
            .arg(&m)
            .args(["--lora-r", "2", "--seed", seed, "-o"])
            .arg(&out)
            .assert()
            .success();
        std::fs::read(out).unwrap()
    };
    let (a, b, c) = (run("a.onnx", "1"), run("b.onnx", "1"), run("c.onnx", "2"));
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn train_and_freeze_change_what_trains() {
    let (_d, m) = case(&model("llama_dynamo"), |_| {});
    let (g, _) = step(
        &m,
        &[
            "--lora-r",
            "2",
            "--train",
            "lm_head",
            "--freeze",
            "ntl/lora/model.layers.1.",
        ],
    );
    let meta = step_metadata(&g);
    let params: Vec<&str> = meta["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert!(params.contains(&"lm_head.weight"), "{params:?}");
    assert!(
        params
            .iter()
            .all(|p| !p.starts_with("ntl/lora/model.layers.1.")),
        "{params:?}"
    );
    assert_eq!(params.len(), 1 + 4, "{params:?}");
}

#[test]
fn lora_on_every_linear_layer_with_rslora() {
    let (_d, m) = case(&model("llama_ts"), |_| {});
    let targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";
    let (g, _) = step(
        &m,
        &[
            "--lora-r",
            "4",
            "--lora-alpha",
            "16",
            "--use-rslora",
            "--lora-targets",
            targets,
        ],
    );
    let lora = &step_metadata(&g)["lora"];
    assert_eq!(lora["layers"].as_array().unwrap().len(), 14);
    assert_eq!(lora["scaling"], 8.0); // 16 / √4
    assert_eq!(lora["use_rslora"], true);
}

#[test]
fn a_weight_without_a_module_path_is_adapted_and_warned_about() {
    // TorchScript's constant folding renames a transposed nn.Linear weight onnx::MatMul_*
    let (_d, m) = case(&model("llama_dynamo"), |m| {
        let g = m.graph.as_mut().unwrap();
        let old = "model.layers.0.self_attn.q_proj.weight";
        for t in g.initializer.iter_mut().filter(|t| t.name() == old) {
            t.name = Some("onnx::MatMul_99".into());
        }
        for n in &mut g.node {
            for i in n.input.iter_mut().filter(|i| *i == old) {
                *i = "onnx::MatMul_99".into();
            }
        }
    });
    let out = bin()
        .arg("step")
        .arg(&m)
        .args([
            "--lora-r",
            "2",
            "--lora-targets",
            "onnx::MatMul_99,v_proj",
            "--json",
        ])
        .assert()
        .success();
    let stderr = String::from_utf8_lossy(&out.get_output().stderr).to_string();
    assert!(
        stderr.contains("no module path") && stderr.contains("onnx::MatMul_99"),
        "{stderr}"
    );
    let g = read_model(&m.with_file_name("model.step.onnx"));
    let layers = step_metadata(&g)["lora"]["layers"]
        .as_array()
        .unwrap()
        .clone();
    let unnamed = layers
        .iter()
        .find(|l| l["weight"] == "onnx::MatMul_99")
        .unwrap();
    assert!(unnamed["module"].is_null(), "{unnamed}");
}

#[test]
fn validate_trains_a_lora_step_graph_in_tract_like_onnxruntime() {
    // Needs ORT_DYLIB_PATH (scripts/test.sh sets it), as tests/step.rs's validate test.
    for (fixture, args) in [
        (
            "lm_flat",
            vec!["--lora-r", "3", "--lora-targets", "q,v,fc1,head"],
        ),
        (
            "llama_dynamo",
            vec!["--lora-r", "2", "--max-grad-norm", "1"],
        ),
        ("gpt2_ts", vec!["--lora-r", "2"]),
        (
            "llama_ts",
            vec![
                "--lora-r",
                "2",
                "--fused-head",
                "on",
                "--head-chunk-tokens",
                "3",
            ],
        ),
    ] {
        let (_dir, m) = case(&model(fixture), |_| {});
        bin().arg("step").arg(&m).args(&args).assert().success();
        let report = validate_report(&m.with_file_name("model.step.onnx"), &[]);
        assert!(
            passed_checks_against_onnxruntime(&report, fixture) >= 1,
            "{fixture}: {report}"
        );
    }
}

#[test]
fn lora_refusals_are_one_line_and_write_nothing() {
    let (_d, flat) = case(&model("lm_flat"), |_| {});
    let (_e, llama) = case(&model("llama_dynamo"), |_| {});
    let step_cases: &[(&[&str], &str)] = &[
        (&["--lora-r", "0"], "--lora-r must be"),
        (&["--lora-r", "-2"], "--lora-r must be"),
        (&["--lora-r", "99999999999"], "--lora-r must be"),
        (
            &["--lora-r", "86"],
            "--lora-r 86 makes the adapter of 'model.layers.0.self_attn.v_proj' (32 -> 16) over 8x the size of its weight; use --lora-r 85 or less",
        ),
        (&["--lora-r", "4", "--lora-alpha", "-1"], "--lora-alpha must be"),
        (&["--lora-r", "4", "--lora-alpha", "0"], "--lora-alpha must be"),
        (&["--lora-r", "4", "--lora-alpha", "NaN"], "--lora-alpha must be"),
        (&["--lora-r", "4", "--lora-dropout", "0.1"], "--lora-dropout > 0 is not built"),
        (&["--lora-r", "4", "--lora-dropout", "1"], "--lora-dropout must be"),
        (
            &["--lora-r", "4", "--lora-targets", "no_such_proj"],
            "--lora-targets 'no_such_proj' matches no linear layer",
        ),
        (&["--lora-r", "4", "--lora-targets", "q_proj,"], "--lora-targets must name modules"),
        (
            &["--lora-r", "4", "--lora-targets", "input_layernorm"],
            "which no linear layer reads",
        ),
        (&["--lora-r", "4", "--train", "no.such."], "--train 'no.such.' matches no weight"),
        (&["--train", "lm_head"], "--train adds base weights to what LoRA trains"),
        (&["--lora-alpha", "16"], "add --lora-r R"),
    ];
    for (args, needle) in step_cases {
        fails(Some("step"), &llama, args, needle);
    }
    fails(
        Some("step"),
        &flat,
        &["--lora-r", "4"],
        "name them with --lora-targets",
    );
    // the patch and artifacts commands have no LoRA
    fails(None, &llama, &["--lora-r", "4"], "--lora-r");
    fails(Some("artifacts"), &llama, &["--lora-r", "4"], "--lora-r");
}

#[test]
fn inspect_lists_the_adapted_layers_and_the_target_names() {
    let (_d, m) = case(&model("llama_ts"), |_| {});
    let out = bin().arg("inspect").arg(&m).assert().success();
    let text = String::from_utf8_lossy(&out.get_output().stdout).to_string();
    assert!(
        text.contains("LoRA targets (its linear layers, for --lora-targets): q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"),
        "{text}"
    );
    step(&m, &["--lora-r", "2"]);
    let out = bin()
        .arg("inspect")
        .arg(m.with_file_name("model.step.onnx"))
        .assert()
        .success();
    let text = String::from_utf8_lossy(&out.get_output().stdout).to_string();
    assert!(
        text.contains("LoRA: r=2 alpha=8.0 scaling=4.0, 4 adapted layer(s):"),
        "{text}"
    );
    assert!(
        text.contains("  model.layers.1.self_attn.v_proj <- model.layers.1.self_attn.v_proj.weight [32 -> 16]"),
        "{text}"
    );
    let out = bin()
        .arg("inspect")
        .arg(m.with_file_name("model.step.onnx"))
        .arg("--json")
        .assert()
        .success();
    let v: serde_json::Value = serde_json::from_slice(&out.get_output().stdout).unwrap();
    assert_eq!(v["lora"]["layers"].as_array().unwrap().len(), 4);
}

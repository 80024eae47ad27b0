//! The step graph's `ntl_step` metadata is one typed contract (`passes::contract`): every key
//! a step, gradient or update graph carries is a field of `StepMetadata` (read back and written
//! again, the text is the same bytes), the names it gives are tensors of that graph, and
//! metadata of older graphs (fewer keys) and newer ones (unknown keys) still reads. The Python
//! mirror is pinned by tests/python/test_contract.py.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use ntl_patch::onnx::ModelProto;
use ntl_patch::passes::contract::{StepMetadata, STEP_METADATA_KEY};

/// Writes the step graph (or `--split`'s pair) of fixture `name` with `args` into `dir`:
/// the written graphs.
fn step(dir: &Path, name: &str, args: &[&str]) -> Vec<PathBuf> {
    let out = dir.join(format!("{name}.step.onnx"));
    bin()
        .arg("step")
        .arg(fixture(&format!("models/{name}.onnx")))
        .arg("--tokenizer")
        .arg(tokenizer())
        .args(args)
        .arg("-o")
        .arg(&out)
        .assert()
        .success();
    let update = dir.join(format!("{name}.step.update.onnx"));
    [out, update].into_iter().filter(|p| p.exists()).collect()
}

fn metadata_text(m: &ModelProto) -> &str {
    m.metadata_props
        .iter()
        .find(|p| p.key() == STEP_METADATA_KEY)
        .expect("ntl_step metadata")
        .value()
}

/// Graphs whose metadata holds every key: LoRA, QLoRA, the fused head, recomputation,
/// blockwise attention, fp16's loss scaling and clipping; and the `--split` pair.
fn every_kind(dir: &Path) -> Vec<PathBuf> {
    let all = [
        "--lora-r",
        "2",
        "--quantize-base",
        "nf4",
        "--quant-block",
        "16",
        "--fused-head",
        "on",
        "--recompute",
        "layers",
        "--attention",
        "chunked",
        "--precision",
        "fp16",
        "--max-grad-norm",
        "1",
    ];
    let mut graphs = step(dir, "gpt2_ts", &all);
    graphs.extend(step(
        dir,
        "lm_flat",
        &["--split", "--precision", "fp16", "--max-grad-norm", "1"],
    ));
    graphs.extend(step(dir, "lm_nll", &["--optimizer", "sgd"]));
    graphs
}

#[test]
fn every_key_written_is_a_field_and_reads_back_to_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let graphs = every_kind(dir.path());
    assert_eq!(graphs.len(), 4, "{graphs:?}");
    for path in graphs {
        let m = read_model(&path);
        let text = metadata_text(&m);
        let meta = StepMetadata::of(&m).unwrap().unwrap();
        // the same text: a key the struct did not hold would be missing, one it adds extra,
        // a value it changed different (compared as text: serde_json's Value parses the
        // code table's floats to the nearest-but-one f64)
        assert_eq!(meta.to_json_text(), text, "{}", path.display());
    }
}

#[test]
fn the_names_it_gives_are_tensors_of_the_graph() {
    let dir = tempfile::tempdir().unwrap();
    let graphs = every_kind(dir.path());
    let (step_graph, grad, update, sgd) = (&graphs[0], &graphs[1], &graphs[2], &graphs[3]);
    let produced_by = |m: &ModelProto, name: &str| -> String {
        let g = m.graph.as_ref().unwrap();
        g.node
            .iter()
            .find(|n| n.output.iter().any(|o| o == name))
            .map(|n| n.op_type().to_string())
            .unwrap_or_else(|| panic!("no node writes '{name}'"))
    };
    let inputs = |m: &ModelProto| -> Vec<String> {
        let g = m.graph.as_ref().unwrap();
        g.input.iter().map(|i| i.name().to_string()).collect()
    };
    for path in [step_graph, update] {
        let m = read_model(path);
        let meta = StepMetadata::of(&m).unwrap().unwrap();
        let what = path.display();
        // the clipping norm and the overflow flag read every gradient: a sharded trainer
        // feeds the global values in their place
        let norm = meta.grad_norm_sq.as_deref().expect("grad_norm_sq");
        assert_eq!(produced_by(&m, norm), "Sum", "{what}");
        let found = meta.found_inf.as_deref().expect("found_inf");
        assert_eq!(produced_by(&m, found), "Or", "{what}");
        let ins = inputs(&m);
        let step_input = meta.step_input.clone().expect("step_input");
        let scale = meta.loss_scale_input.clone().expect("loss_scale_input");
        for name in [&step_input, &scale, &meta.lr_input] {
            assert!(ins.contains(name), "{what}: '{name}' is no input");
        }
        let states: Vec<&str> = meta.state.iter().map(|(i, _)| i.as_str()).collect();
        assert!(states.contains(&step_input.as_str()) && states.contains(&scale.as_str()));
        let outs: Vec<&str> = m
            .graph
            .as_ref()
            .unwrap()
            .output
            .iter()
            .map(|o| o.name())
            .collect();
        assert!(
            outs.contains(&meta.skip_output.as_deref().unwrap()),
            "{what}"
        );
    }
    // the gradient graph holds no optimizer: it names neither tensor
    let meta = StepMetadata::of(&read_model(grad)).unwrap().unwrap();
    assert!(meta.split && meta.grad_norm_sq.is_none() && meta.found_inf.is_none());
    assert_eq!(meta.step_input.as_deref(), Some("ntl/state/step"));
    // without clipping and loss scaling there is neither
    let meta = StepMetadata::of(&read_model(sgd)).unwrap().unwrap();
    assert_eq!(
        (meta.grad_norm_sq, meta.found_inf, meta.loss_scale_input),
        (None, None, None)
    );
    assert_eq!(meta.step_input.as_deref(), Some("ntl/state/step"));
}

#[test]
fn metadata_of_older_and_newer_graphs_reads() {
    // the first version's keys only (no optimizer, precision or any later key) ...
    let old = r#"{"state": [["w", "ntl/next/w"], ["ntl/state/step", "ntl/next/ntl/state/step"]],
        "parameters": ["w"], "lr_input": "ntl/lr", "losses": ["loss", "ce_loss", "number_loss"],
        "data_inputs": ["input_ids", "labels"]}"#;
    let meta: StepMetadata = serde_json::from_str(old).unwrap();
    assert_eq!(meta.precision, "fp32");
    assert_eq!((meta.step_input, meta.grad_norm_sq), (None, None));
    assert!(meta.optimizer.is_none() && !meta.split && meta.in_place.is_none());
    // ... and a key a later version may add
    let newer = old.replacen('{', r#"{"a_later_key": {"x": 1}, "#, 1);
    assert!(serde_json::from_str::<StepMetadata>(&newer).is_ok());
    // but not one without the state
    let broken = old.replacen("\"state\"", "\"stat\"", 1);
    let err = serde_json::from_str::<StepMetadata>(&broken).unwrap_err();
    assert!(err.to_string().contains("state"), "{err}");
}

//! `ntl-patch validate`: patched fixtures pass on tract and ONNX Runtime, recorded torch/ntloss
//! outputs agree, the independent reference matches ntloss 0.3.2 on every setting, and a
//! tampered graph fails.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use ntl_patch::onnx::ModelProto;
use ntl_patch::tools::validate::reference::{self, Batch, CeReduction, NtlKind, NtlSettings};
use ntl_patch::vocab::number_table::{NumberSet, Vocab};
use prost::Message;
use serde_json::Value;

/// Patches `model` with `args` into a fresh folder (with the tokenizer beside the output, so
/// validate finds it by default).
fn patched(model: &str, args: &[&str]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let out = patch(&common::model(model), dir.path(), args);
    std::fs::copy(tokenizer(), dir.path().join("tokenizer.json")).unwrap();
    (dir, out)
}

/// Runs `validate --json` and returns (exit code, report).
fn validate_json(model: &Path, args: &[&str], envs: &[(&str, &Path)]) -> (i32, Value) {
    let mut cmd = bin();
    cmd.arg("validate").arg(model).arg("--json").args(args);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report = serde_json::from_str(&stdout).unwrap_or_else(|_| {
        panic!(
            "no JSON report on stdout (exit {:?}): {stdout}\nstderr: {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap(), report)
}

fn assert_passes(report: &Value, code: i32) {
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(report["passed"], true, "{report:#}");
    for c in report["checks"].as_array().unwrap() {
        assert_eq!(c["passed"], true, "{c:#}");
    }
}

fn check<'a>(report: &'a Value, output: &str, against: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["output"] == output && c["against"] == against)
        .unwrap_or_else(|| panic!("no {output}/{against} check in {report:#}"))
}

// ------------------------------------------------------------------ tract, every model and loss

fn tract_passes(model: &str, args: &[&str]) {
    let (_dir, out) = patched(model, args);
    let (code, report) = validate_json(&out, &[], &[]);
    assert_passes(&report, code);
    assert_eq!(report["runtime"], "tract");
    // lm_two_ce reports CE(z) + CE(2z): ce_loss is that reported value, which validate takes
    // as given (no independent check), and the total is checked as ce_loss + the number loss
    let outputs: &[&str] = if model == "lm_two_ce" {
        &["loss", "number_loss"]
    } else {
        &["loss", "ce_loss", "number_loss"]
    };
    assert_eq!(report["checks"].as_array().unwrap().len(), outputs.len());
    for output in outputs {
        check(&report, output, "independent");
    }
    // the generated labels exercise number labels, other labels and the ignore index
    let positions = report["positions"].as_u64().unwrap();
    let numbers = report["number_positions"].as_u64().unwrap();
    let ignored = report["ignored_positions"].as_u64().unwrap();
    assert!(
        numbers > 0 && ignored > 0 && numbers + ignored < positions,
        "{report:#}"
    );
}

macro_rules! tract_cases {
    ($($name:ident: $model:literal $args:expr;)*) => {$(
        #[test]
        fn $name() {
            tract_passes($model, $args);
        }
    )*};
}

tract_cases! {
    tract_lm_flat_wasserstein: "lm_flat" &["--loss", "wasserstein"];
    tract_lm_flat_mse: "lm_flat" &["--loss", "mse"];
    tract_lm_flat_l1: "lm_flat" &["--loss", "l1"];
    tract_lm_flat_huber: "lm_flat" &["--loss", "huber"];
    tract_lm_flat_reweigh: "lm_flat" &["--reweigh"];
    tract_lm_flat_squash: "lm_flat" &["--squash", "3"];
    tract_lm_flat_all_numbers: "lm_flat" &["--all-numbers"];
    tract_lm_flat_mse_reweigh_all_numbers: "lm_flat" &["--loss", "mse", "--reweigh", "--all-numbers"];
    tract_lm_flat_combine_scaled: "lm_flat" &["--combine", "scaled"];
    // the other CE of the graph runs in its primitive form too
    tract_lm_two_ce_second: "lm_two_ce" &["--ce-node", "/SoftmaxCrossEntropyLoss_1"];
    tract_lm_bvt_wasserstein: "lm_bvt" &["--loss", "wasserstein"];
    tract_lm_bvt_mse: "lm_bvt" &["--loss", "mse"];
    tract_lm_bvt_l1: "lm_bvt" &["--loss", "l1"];
    tract_lm_bvt_huber: "lm_bvt" &["--loss", "huber"];
    tract_lm_nll_wasserstein: "lm_nll" &["--loss", "wasserstein"];
    tract_lm_nll_mse: "lm_nll" &["--loss", "mse"];
    tract_lm_nll_l1: "lm_nll" &["--loss", "l1"];
    tract_lm_nll_huber: "lm_nll" &["--loss", "huber"];
    // labels[N] beside input_ids[B, T]: generated with B·T positions
    tract_lm_flat_labels: "lm_flat_labels" &[];
    tract_lm_flat_label_smoothing: "lm_flat" &["--label-smoothing", "0.1"];
    tract_lm_bvt_label_smoothing: "lm_bvt" &["--label-smoothing", "0.2", "--loss", "mse"];
    // SMMD over the fixture's integer tokens (0..9 and "12"), per position like the NTL family
    tract_lm_flat_smmd: "lm_flat" &["--loss", "smmd"];
    tract_lm_bvt_smmd_laplace: "lm_bvt" &["--loss", "smmd", "--kernel", "laplace", "--sigma", "1",
        "--sigma", "4", "--squash", "1", "--smmd-alpha", "0.5"];
    tract_lm_nll_smmd_mmd: "lm_nll" &["--loss", "smmd", "--smmd-terms", "mmd", "--max-value", "9"];
    tract_lm_flat_smmd_smooth: "lm_flat" &["--loss", "smmd", "--smmd-terms", "smooth"];
}

#[test]
fn text_report_is_a_table_and_exit_zero() {
    let (_dir, out) = patched("lm_flat", &[]);
    let assert = bin().arg("validate").arg(&out).assert().success();
    let stdout = String::from_utf8_lossy(&assert.get_output().stdout).to_string();
    for needle in ["loss", "ce_loss", "number_loss", "independent", "passed"] {
        assert!(stdout.contains(needle), "{stdout}");
    }
}

#[test]
fn generated_inputs_follow_the_seed() {
    let (_dir, out) = patched("lm_flat", &[]);
    let value = |seed: &str| {
        let (code, r) = validate_json(&out, &["--seed", seed, "--batch", "3", "--seq", "5"], &[]);
        assert_passes(&r, code);
        assert_eq!(r["positions"], 15);
        check(&r, "loss", "independent")["runtime"]
            .as_f64()
            .unwrap()
    };
    assert_eq!(value("7"), value("7"));
    assert_ne!(value("7"), value("8"));
}

#[test]
fn total_is_found_without_the_loss_output_metadata() {
    // patches written before the metadata recorded `loss_output`
    let (_dir, out) = patched("lm_bvt", &["--loss", "l1"]);
    let mut m = read_model(&out);
    let meta = m
        .metadata_props
        .iter_mut()
        .find(|p| p.key() == "ntl_patch")
        .unwrap();
    let mut v: Value = serde_json::from_str(meta.value()).unwrap();
    v.as_object_mut().unwrap().remove("loss_output");
    meta.value = Some(v.to_string());
    let old = out.with_file_name("old_meta.onnx");
    std::fs::write(&old, m.encode_to_vec()).unwrap();
    let (code, report) = validate_json(&old, &[], &[]);
    assert_passes(&report, code);
    check(&report, "loss", "independent");
}

// ------------------------------------------------------------------ recorded torch + ntloss outputs

fn reference_passes(model: &str, loss: &str, runtime_args: &[&str], envs: &[(&str, &Path)]) {
    let (_dir, out) = patched(model, &["--loss", loss]);
    let dir = fixture(&format!("reference/lm_flat_{loss}"));
    let mut args = vec!["--reference", dir.to_str().unwrap()];
    args.extend_from_slice(runtime_args);
    let (code, report) = validate_json(&out, &args, envs);
    assert_passes(&report, code);
    for output in ["loss", "ce_loss", "number_loss"] {
        check(&report, output, "independent");
        check(&report, output, "recorded");
    }
    // the recorded batch: 14 positions, 2 ignored
    assert_eq!(report["positions"], 14);
    assert_eq!(report["ignored_positions"], 2);
}

#[test]
fn lm_flat_wasserstein_matches_recorded_reference() {
    reference_passes("lm_flat", "wasserstein", &[], &[]);
}

#[test]
fn lm_flat_mse_matches_recorded_reference() {
    reference_passes("lm_flat", "mse", &[], &[]);
}

#[test]
fn other_ce_forms_match_the_same_recorded_reference() {
    // all three CE variants compute the same function (fixtures/README.md)
    reference_passes("lm_bvt", "wasserstein", &[], &[]);
    reference_passes("lm_nll", "mse", &[], &[]);
}

// ------------------------------------------------------------------ the reference vs ntloss 0.3.2

#[test]
fn reference_matches_every_ntloss_setting() {
    let cases: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("reference/ntloss_cases.json")).unwrap(),
    )
    .unwrap();
    let width = cases["vocab_size"].as_u64().unwrap() as usize;
    let vocab = Vocab::from_file(&tokenizer()).unwrap();
    let tables = [
        (
            true,
            vocab.number_table(NumberSet::DigitLevel, width).unwrap(),
        ),
        (
            false,
            vocab.number_table(NumberSet::AllNumbers, width).unwrap(),
        ),
    ];
    // the tables rebuilt from the tokenizer are ntloss's
    for (digit_level, table) in &tables {
        let key = if *digit_level {
            "digit_level"
        } else {
            "all_numbers"
        };
        let want = cases["number_values"][key].as_array().unwrap();
        for (id, v) in want.iter().enumerate() {
            assert_eq!(table.value_of(id as i64), v.as_f64(), "{key} id {id}");
        }
    }

    let weight = cases["weight"].as_f64().unwrap();
    let mut compared = 0;
    // (worst relative error without, with a squash factor)
    let mut worst = (0f64, 0f64);
    for case in cases["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let logits: Vec<f64> = case["logits"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()))
            .collect();
        let labels: Vec<i64> = case["labels"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect();
        let batch = Batch::new(&logits, &labels, width).unwrap();
        let ce =
            reference::cross_entropy(&batch, Some(-100), CeReduction::Mean, None, 0.0).unwrap();
        for r in case["results"].as_array().unwrap() {
            let settings = NtlSettings {
                kind: NtlKind::parse(r["loss"].as_str().unwrap()).unwrap(),
                reweigh: r["reweigh"].as_bool().unwrap(),
                squash: r["squash"].as_f64(),
            };
            let digit_level = r["digit_level"].as_bool().unwrap();
            let table = &tables.iter().find(|(d, _)| *d == digit_level).unwrap().1;
            let ntl = reference::number_token_loss(&batch, table, &settings, Some(-100))
                .unwrap()
                .value;
            let what = format!("{name} {settings:?} digit_level={digit_level}");
            for (label, got, want) in [
                ("ntl", ntl, r["ntl"].as_f64().unwrap()),
                ("ce", ce, r["ce"].as_f64().unwrap()),
                ("total", ce + weight * ntl, r["total"].as_f64().unwrap()),
            ] {
                if want == 0.0 {
                    assert_eq!(got, 0.0, "{what} {label}");
                    continue;
                }
                let rel = (got - want).abs() / want.abs();
                if settings.squash.is_some() {
                    worst.1 = worst.1.max(rel);
                } else {
                    worst.0 = worst.0.max(rel);
                }
                assert!(
                    rel <= 1e-5,
                    "{what} {label}: {got} vs ntloss {want} (rel {rel:e})"
                );
            }
            compared += 1;
        }
    }
    assert_eq!(compared, 60, "3 cases x 20 settings");
    // The references are float64, so agreement is far tighter than 1e-5, except that ntloss
    // builds its squashed distance table in float32 (relative error ~1e-8).
    assert!(
        worst.0 < 1e-9 && worst.1 < 1e-7,
        "worst relative errors {worst:?}"
    );
}

// ------------------------------------------------------------------ validation can fail

/// Writes a copy of `model` with `edit` applied to its initializer `name`.
fn tampered(model: &Path, name: &str, edit: impl FnOnce(&mut Vec<f32>)) -> PathBuf {
    let mut m: ModelProto = read_model(model);
    let graph = m.graph.as_mut().unwrap();
    let names: Vec<String> = graph
        .initializer
        .iter()
        .map(|t| t.name().to_string())
        .collect();
    let init = graph
        .initializer
        .iter_mut()
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("no initializer '{name}' in {names:?}"));
    let mut values: Vec<f32> = if init.float_data.is_empty() {
        init.raw_data
            .as_ref()
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    } else {
        init.float_data.clone()
    };
    edit(&mut values);
    init.raw_data = None;
    init.float_data = values;
    let out = model.with_file_name("tampered.onnx");
    std::fs::write(&out, m.encode_to_vec()).unwrap();
    out
}

fn assert_fails_on(report: &Value, code: i32, failing: &[&str]) {
    assert_eq!(code, 1, "{report:#}");
    assert_eq!(report["passed"], false);
    for c in report["checks"].as_array().unwrap() {
        let should_fail = failing.contains(&c["output"].as_str().unwrap());
        assert_eq!(c["passed"], !should_fail, "{c:#}");
    }
}

#[test]
fn tampered_weight_fails_the_total() {
    let (_dir, out) = patched("lm_flat", &[]);
    let bad = tampered(&out, "ntl/weight", |v| v[0] = 0.5);
    let (code, report) = validate_json(&bad, &[], &[]);
    assert_fails_on(&report, code, &["loss"]);

    // the text report goes to stdout too, and names the failing output
    let assert = bin().arg("validate").arg(&bad).assert().code(1);
    let stdout = String::from_utf8_lossy(&assert.get_output().stdout).to_string();
    assert!(
        stdout.contains("FAILED") && stdout.contains("(loss)"),
        "{stdout}"
    );
    // and one error line on stderr, as every exit 1 of the binary
    let stderr = String::from_utf8_lossy(&assert.get_output().stderr).to_string();
    assert!(
        stderr.starts_with("error: validation failed: loss (1 of ")
            && stderr.trim_end().lines().count() == 1,
        "{stderr}"
    );
}

#[test]
fn tampered_number_values_fail_the_number_loss() {
    let (_dir, out) = patched("lm_flat", &["--loss", "mse"]);
    let bad = tampered(&out, "ntl/number_values", |v| v.swap(0, 1));
    let (code, report) = validate_json(&bad, &[], &[]);
    assert_fails_on(&report, code, &["loss", "number_loss"]);
}

#[test]
fn tampered_graph_fails_against_the_recording_too() {
    let (_dir, out) = patched("lm_flat", &["--loss", "wasserstein"]);
    let bad = tampered(&out, "ntl/weight", |v| v[0] = 0.31);
    let dir = fixture("reference/lm_flat_wasserstein");
    let (code, report) = validate_json(&bad, &["--reference", dir.to_str().unwrap()], &[]);
    assert_eq!(code, 1);
    assert_eq!(check(&report, "loss", "recorded")["passed"], false);
    assert_eq!(check(&report, "ce_loss", "recorded")["passed"], true);
}

/// A copy of `model` in `dir` whose float initializers live in `weights.bin` beside it.
fn with_external_data(model: &Path, dir: &Path) -> PathBuf {
    use ntl_patch::onnx::proto::tensor_proto::DataLocation;
    use ntl_patch::onnx::StringStringEntryProto;
    let mut m = read_model(model);
    let mut blob = Vec::new();
    for t in &mut m.graph.as_mut().unwrap().initializer {
        let bytes: Vec<u8> = match (&t.raw_data, t.float_data.is_empty()) {
            (Some(raw), _) if !raw.is_empty() => raw.to_vec(),
            (_, false) => t.float_data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            _ => continue,
        };
        let entry = |k: &str, v: String| StringStringEntryProto {
            key: Some(k.into()),
            value: Some(v),
        };
        t.external_data = vec![
            entry("location", "weights.bin".into()),
            entry("offset", blob.len().to_string()),
            entry("length", bytes.len().to_string()),
        ];
        t.data_location = Some(DataLocation::External as i32);
        t.raw_data = None;
        t.float_data.clear();
        blob.extend(bytes);
    }
    std::fs::write(dir.join("weights.bin"), blob).unwrap();
    let out = dir.join("external.onnx");
    std::fs::write(&out, m.encode_to_vec()).unwrap();
    out
}

#[test]
fn external_data_is_read_from_the_model_folder() {
    let (dir, out) = patched("lm_flat", &[]);
    let ext = with_external_data(&out, dir.path());
    let (code, report) = validate_json(&ext, &[], &[]);
    assert_passes(&report, code);
    let lib = ort_library();
    let (code, report) = validate_json(&ext, &["--runtime", "ort"], &[("ORT_DYLIB_PATH", &lib)]);
    assert_passes(&report, code);
}

// ------------------------------------------------------------------ errors

fn fails_with(args: &[&std::ffi::OsStr], envs: &[(&str, Option<&Path>)], needle: &str) {
    let mut cmd = bin();
    cmd.arg("validate").args(args);
    for (k, v) in envs {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let assert = cmd.assert().code(1);
    let out = assert.get_output();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.starts_with("error: ") && stderr.contains(needle),
        "expected '{needle}' in: {stderr}"
    );
    assert!(out.stdout.is_empty(), "no report on an error");
}

#[test]
fn unpatched_model_is_refused() {
    let m = model("lm_flat");
    fails_with(
        &[m.as_os_str()],
        &[],
        "not patched by ntl-patch; run ntl-patch MODEL first",
    );
}

#[test]
fn op_tract_lacks_is_named() {
    let (_dir, out) = patched("lm_flat", &[]);
    let mut m = read_model(&out);
    let node = m
        .graph
        .as_mut()
        .unwrap()
        .node
        .iter_mut()
        .find(|n| n.op_type() == "Tanh")
        .unwrap();
    node.domain = Some("com.example".into());
    let bad = out.with_file_name("custom_op.onnx");
    std::fs::write(&bad, m.encode_to_vec()).unwrap();
    fails_with(
        &[bad.as_os_str()],
        &[],
        "tract cannot run op 'com.example.Tanh'",
    );
    fails_with(&[bad.as_os_str()], &[], "--runtime ort");
}

#[test]
fn missing_ort_library_says_how_to_install_it() {
    let (_dir, out) = patched("lm_flat", &[]);
    fails_with(
        &[out.as_os_str(), "--runtime".as_ref(), "ort".as_ref()],
        &[("ORT_DYLIB_PATH", None), ("NTL_PATCH_ORT_SITE", None)],
        "ORT_DYLIB_PATH",
    );
}

// ------------------------------------------------------------------ ONNX Runtime

#[test]
fn ort_library_is_found_in_a_site_packages_folder() {
    let lib = ort_library();
    // .../site/onnxruntime/capi/libonnxruntime.so.X -> .../site
    let site = lib
        .parent()
        .and_then(Path::parent)
        .and_then(Path::parent)
        .unwrap();
    let (_dir, out) = patched("lm_flat", &[]);
    let out_report = bin()
        .arg("validate")
        .arg(&out)
        .args(["--runtime", "ort", "--json"])
        .env_remove("ORT_DYLIB_PATH")
        .env("NTL_PATCH_ORT_SITE", site)
        .output()
        .unwrap();
    let report: Value = serde_json::from_slice(&out_report.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out_report.stderr)));
    assert_passes(&report, out_report.status.code().unwrap());
}

#[test]
fn ort_catches_a_tampered_graph() {
    let lib = ort_library();
    let (_dir, out) = patched("lm_bvt", &[]);
    let bad = tampered(&out, "ntl/weight", |v| v[0] = 0.5);
    let (code, report) = validate_json(&bad, &["--runtime", "ort"], &[("ORT_DYLIB_PATH", &lib)]);
    assert_fails_on(&report, code, &["loss"]);
}

// ------------------------------------------------------------------ the per-sequence reference vs the official code and ntloss

mod sequence_reference {
    use super::*;
    use ntl_patch::tools::validate::reference_ntil::{
        self as seq, DigitTokens, NtilSettings, NumberLevelSettings, SeqLoss, Sequences,
    };

    fn load(name: &str) -> Value {
        serde_json::from_str(&std::fs::read_to_string(fixture(name)).unwrap()).unwrap()
    }

    /// The fixture tokenizer's digit and dot ids, checked against the file's.
    fn tokens(cases: &Value) -> DigitTokens {
        let vocab = Vocab::from_file(&tokenizer()).unwrap();
        let tokens = DigitTokens::from_vocab(&vocab).unwrap();
        let want: Vec<i64> = cases["digit_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect();
        assert_eq!(tokens.digits.to_vec(), want);
        assert_eq!(tokens.dot, cases["dot_id"].as_i64());
        tokens
    }

    /// (name, B, flat logits [B*T*V], labels [B*T] row-major). The logits are float32 values
    /// written with 9 significant digits: rounding to float32 recovers them exactly.
    fn case_data(case: &Value) -> (String, usize, Vec<f64>, Vec<i64>) {
        let logits = common::json_f32_matrix(&case["logits"])
            .into_iter()
            .map(f64::from)
            .collect();
        let labels = case["labels"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()))
            .collect();
        (
            case["name"].as_str().unwrap().to_string(),
            case["B"].as_u64().unwrap() as usize,
            logits,
            labels,
        )
    }

    /// Relative error (exact zero where the reference value is zero).
    fn rel(got: f64, want: f64, what: &str) -> f64 {
        if want == 0.0 {
            assert_eq!(got, 0.0, "{what}: {got} vs 0");
            return 0.0;
        }
        let r = (got - want).abs() / want.abs();
        assert!(r <= 1e-5, "{what}: {got} vs {want} (rel {r:e})");
        r
    }

    #[test]
    fn reference_matches_the_official_ntil_and_emd_code() {
        let cases = load("reference/ntil_cases.json");
        assert_eq!(cases["official"]["gumbel_noise"], 0.0);
        let width = cases["vocab_size"].as_u64().unwrap() as usize;
        let tokens = tokens(&cases);
        let (mut compared, mut worst_raw, mut worst_total) = (0, 0f64, 0f64);
        for case in cases["cases"].as_array().unwrap() {
            let (name, b, logits, labels) = case_data(case);
            let seqs = Sequences::new(&logits, &labels, b, width).unwrap();
            assert_eq!(seqs.seq, case["T"].as_u64().unwrap() as usize);
            let batch = Batch::new(&logits, &labels, width).unwrap();
            let ce =
                reference::cross_entropy(&batch, Some(-100), CeReduction::Mean, None, 0.0).unwrap();
            for r in case["results"].as_array().unwrap() {
                let f = |k: &str| r[k].as_f64().unwrap();
                let loss = match r["loss"].as_str().unwrap() {
                    "ntil" => SeqLoss::Ntil(NtilSettings {
                        digit_exp: f("digit_exp"),
                        abs_alpha: f("abs_alpha"),
                        mag_alpha: f("mag_alpha"),
                        digit_alpha: f("digit_alpha"),
                        tau: f("tau"),
                    }),
                    "emd" => SeqLoss::Emd {
                        digit_exp: f("digit_exp"),
                    },
                    other => panic!("unknown loss {other}"),
                };
                let raw = seq::sequence_loss(&seqs, &tokens, &loss).unwrap().value;
                let what = format!("{name} {} {}", r["loss"], r["name"]);
                let w = f("weight");
                worst_raw = worst_raw.max(rel(raw, f("raw"), &format!("{what} raw")));
                rel(ce, f("ce"), &format!("{what} ce"));
                let scaled = ce + ce / (raw + 1e-10) * w * raw;
                let add = ce + w * raw;
                worst_total = worst_total
                    .max(rel(scaled, f("scaled"), &format!("{what} scaled")))
                    .max(rel(add, f("add"), &format!("{what} add")));
                compared += 1;
            }
        }
        assert_eq!(compared, 16, "4 cases x 4 settings");
        // the official values are float32 computations (measured 1.1e-7 relative at worst,
        // twenty_digits with digit_exp 1.5); this reference is f64
        assert!(worst_raw < 1e-6, "worst relative error {worst_raw:e}");
        eprintln!(
            "NTIL/EMD vs official: worst relative error raw {worst_raw:e}, totals {worst_total:e}"
        );
    }

    #[test]
    fn reference_matches_ntloss_number_level_loss() {
        let cases = load("reference/number_level_cases.json");
        assert_eq!(cases["ntloss_version"], "0.3.2");
        let width = cases["vocab_size"].as_u64().unwrap() as usize;
        let tokens = tokens(&cases);
        let (mut compared, mut worst_raw, mut worst_total) = (0, 0f64, 0f64);
        for case in cases["cases"].as_array().unwrap() {
            let (name, b, logits, labels) = case_data(case);
            let seqs = Sequences::new(&logits, &labels, b, width).unwrap();
            let batch = Batch::new(&logits, &labels, width).unwrap();
            let ce =
                reference::cross_entropy(&batch, Some(-100), CeReduction::Mean, None, 0.0).unwrap();
            for r in case["results"].as_array().unwrap() {
                let settings = NumberLevelSettings {
                    float_level: r["float_level"].as_bool().unwrap(),
                    reweigh: r["reweigh"].as_bool().unwrap(),
                };
                let what = format!("{name} {settings:?}");
                let v =
                    seq::sequence_loss(&seqs, &tokens, &SeqLoss::NumberLevel(settings)).unwrap();
                let f = |k: &str| r[k].as_f64().unwrap();
                let e = rel(v.value, f("raw"), &format!("{what} raw"));
                worst_raw = worst_raw.max(e);
                rel(ce, f("ce"), &format!("{what} ce"));
                worst_total = worst_total.max(rel(
                    ce + f("weight") * v.value,
                    f("total"),
                    &format!("{what} total"),
                ));
                compared += 1;
            }
        }
        assert_eq!(compared, 16, "4 cases x 4 settings");
        // both float64 (ntloss keeps float32 label values and powers of ten, which the
        // reference follows; the values are written with 12 digits): measured 1.4e-12
        assert!(worst_raw < 1e-10, "worst relative error {worst_raw:e}");
        eprintln!("number-level vs ntloss: worst relative error raw {worst_raw:e}, totals {worst_total:e}");
    }
}

// ------------------------------------------------------------------ NTIL, EMD, number-level on both runtimes

/// Patches `model` with `args`, validates with tract and ORT (same generated inputs) and
/// returns both reports. Both must pass; the independent values agree between the runtimes.
fn sequence_loss_passes(model: &str, args: &[&str], validate_args: &[&str]) -> [Value; 2] {
    let (_dir, out) = patched(model, args);
    let lib = ort_library();
    let (code, tract) = validate_json(&out, validate_args, &[]);
    assert_passes(&tract, code);
    assert_eq!(tract["runtime"], "tract");
    let mut ort_args = vec!["--runtime", "ort"];
    ort_args.extend_from_slice(validate_args);
    let (code, ort) = validate_json(&out, &ort_args, &[("ORT_DYLIB_PATH", &lib)]);
    assert_passes(&ort, code);
    assert_eq!(ort["runtime"], "onnxruntime");
    for report in [&tract, &ort] {
        assert_eq!(report["checks"].as_array().unwrap().len(), 3, "{report:#}");
        for output in ["loss", "ce_loss", "number_loss"] {
            check(report, output, "independent");
        }
        // the generated labels hold digits (numbers), other ids and the ignore index
        let positions = report["positions"].as_u64().unwrap();
        let digits = report["number_positions"].as_u64().unwrap();
        let ignored = report["ignored_positions"].as_u64().unwrap();
        assert!(
            digits > 1 && ignored > 0 && digits + ignored < positions,
            "{report:#}"
        );
        let notes = report["notes"].as_array().unwrap();
        assert!(
            notes
                .iter()
                .any(|n| n.as_str().unwrap().starts_with("per-sequence loss")),
            "{report:#}"
        );
        // noise is in the graph exactly when patched with a scale > 0 (ntil's default 0.01)
        let noise = args
            .iter()
            .position(|a| *a == "--gumbel-noise")
            .map_or("0.01", |i| args[i + 1]);
        let noisy = args.contains(&"ntil") && noise.parse::<f64>().unwrap() > 0.0;
        let disabled = notes
            .iter()
            .any(|n| n.as_str().unwrap().starts_with("Gumbel noise disabled"));
        assert_eq!(noisy, disabled, "{report:#}");
    }
    // the same inputs: the independent values of both runs agree to float32 precision
    for output in ["loss", "ce_loss", "number_loss"] {
        let a = check(&tract, output, "independent")["expected"]
            .as_f64()
            .unwrap();
        let b = check(&ort, output, "independent")["expected"]
            .as_f64()
            .unwrap();
        assert!(
            (a - b).abs() <= 1e-6 * a.abs().max(1.0),
            "{output}: {a} vs {b}"
        );
    }
    [tract, ort]
}

macro_rules! sequence_cases {
    ($($name:ident: $args:expr;)*) => {$(
        #[test]
        fn $name() {
            for model in MODELS {
                for combine in ["add", "scaled"] {
                    let mut args: Vec<&str> = $args.to_vec();
                    args.extend(["--combine", combine]);
                    sequence_loss_passes(model, &args, &[]);
                }
            }
        }
    )*};
}

sequence_cases! {
    validate_ntil_noise_0: ["--loss", "ntil", "--gumbel-noise", "0"];
    validate_ntil_default_noise: ["--loss", "ntil"];
    validate_ntil_custom: ["--loss", "ntil", "--digit-exp", "1.5", "--abs-alpha", "0.5",
        "--mag-alpha", "0.3", "--digit-alpha", "0.8", "--gumbel-tau", "0.5", "--gumbel-noise", "0.05"];
    validate_emd: ["--loss", "emd"];
    validate_number_level: ["--loss", "number-level"];
    validate_number_level_float_reweigh: ["--loss", "number-level", "--float-level", "--reweigh"];
    validate_dist2: ["--loss", "dist2"];
    validate_dist2_tau: ["--loss", "dist2", "--dist2-tau", "2.5"];
    validate_del: ["--loss", "del"];
}

#[test]
fn longer_sequences_and_other_seeds_pass() {
    for (args, seed) in [
        (&["--loss", "ntil"][..], "1"),
        (&["--loss", "emd", "--digit-exp", "1.2"], "2"),
        (&["--loss", "number-level", "--float-level"], "3"),
        (&["--loss", "del"], "4"),
        (&["--loss", "dist2"], "5"),
    ] {
        let [tract, _] = sequence_loss_passes(
            "lm_flat",
            args,
            &["--batch", "3", "--seq", "24", "--seed", seed],
        );
        assert_eq!(tract["positions"], 72);
    }
}

/// The decimal_exact labels of the reference cases (`12 . 34 = x` / `x 907 is 5 .`), recorded
/// as inputs in the test-data layout (no recorded outputs).
fn decimal_inputs(dir: &Path) -> PathBuf {
    use ntl_patch::onnx::TensorProto;
    let folder = dir.join("decimal_inputs");
    std::fs::create_dir_all(&folder).unwrap();
    let labels = [29, 25, 6, 36, 35, 24, 20, 20, 38, 18, 21, 5, 7, 6];
    let ids = [2, 29, 25, 6, 36, 35, 24, 2, 20, 38, 18, 21, 5, 7];
    for (k, (name, data)) in [("input_ids", ids), ("labels", labels)]
        .into_iter()
        .enumerate()
    {
        let t = TensorProto {
            name: Some(name.into()),
            dims: vec![2, 7],
            data_type: Some(7), // INT64
            int64_data: data.to_vec(),
            ..Default::default()
        };
        std::fs::write(folder.join(format!("input_{k}.pb")), t.encode_to_vec()).unwrap();
    }
    folder
}

#[test]
fn float_level_joins_a_decimal_through_the_runtime() {
    let lib = ort_library();
    let numbers = |report: &Value| -> String {
        let notes = report["notes"].as_array().unwrap();
        let note = notes
            .iter()
            .map(|n| n.as_str().unwrap())
            .find(|n| n.starts_with("per-sequence loss"))
            .unwrap();
        note.rsplit(", ").next().unwrap().to_string()
    };
    for (float_level, want) in [(false, "4 number(s)"), (true, "3 number(s)")] {
        let mut args = vec!["--loss", "number-level"];
        if float_level {
            args.push("--float-level");
        }
        for model in MODELS {
            let (dir, out) = patched(model, &args);
            let inputs = decimal_inputs(dir.path());
            let inputs = inputs.to_str().unwrap();
            for (runtime, envs) in [
                ("tract", vec![]),
                ("ort", vec![("ORT_DYLIB_PATH", lib.as_path())]),
            ] {
                let (code, report) =
                    validate_json(&out, &["--runtime", runtime, "--reference", inputs], &envs);
                assert_passes(&report, code);
                assert_eq!(report["positions"], 14);
                assert_eq!(numbers(&report), want, "{report:#}");
            }
        }
    }
}

#[test]
fn tampered_digit_exp_fails_validation() {
    // add: the number loss and the total differ; scaled: the total is (1+λ)·CE whatever the
    // number loss, so only number_loss differs
    for (combine, failing) in [
        ("add", &["loss", "number_loss"][..]),
        ("scaled", &["number_loss"][..]),
    ] {
        for loss in ["ntil", "emd"] {
            let (_dir, out) = patched("lm_flat", &["--loss", loss, "--combine", combine]);
            let bad = tampered(&out, "ntl/digit_exp", |v| v[0] = 1.35);
            let (code, report) = validate_json(&bad, &[], &[]);
            assert_fails_on(&report, code, failing);
        }
    }
    // ONNX Runtime too, and the text report names the failure
    let lib = ort_library();
    let (_dir, out) = patched("lm_bvt", &["--loss", "ntil", "--combine", "add"]);
    let bad = tampered(&out, "ntl/digit_exp", |v| v[0] = 1.0);
    let (code, report) = validate_json(&bad, &["--runtime", "ort"], &[("ORT_DYLIB_PATH", &lib)]);
    assert_fails_on(&report, code, &["loss", "number_loss"]);
    let assert = bin().arg("validate").arg(&bad).assert().code(1);
    let stdout = String::from_utf8_lossy(&assert.get_output().stdout).to_string();
    assert!(
        stdout.contains("FAILED") && stdout.contains("number_loss"),
        "{stdout}"
    );
}

#[test]
fn tampered_ntil_alphas_and_place_values_fail_validation() {
    for (args, init, edit) in [
        // a wrong abs weight changes NTIL
        (
            &["--loss", "ntil", "--combine", "add"][..],
            "ntl/ntil_abs_weighted_factor",
            0.5f32,
        ),
        (
            &["--loss", "ntil", "--combine", "add"],
            "ntl/ntil_mag_weighted_factor",
            0.5,
        ),
        (
            &["--loss", "number-level", "--combine", "add"],
            "ntl/number_eps",
            0.5,
        ),
    ] {
        let (_dir, out) = patched("lm_nll", args);
        let bad = tampered(&out, init, |v| v[0] = edit);
        let (code, report) = validate_json(&bad, &["--seq", "16"], &[]);
        assert_fails_on(&report, code, &["loss", "number_loss"]);
    }
    // place values 10^r: swapping 10^0 and 10^1 breaks multi-digit numbers
    let (_dir, out) = patched("lm_flat", &["--loss", "number-level", "--combine", "add"]);
    let bad = tampered(&out, "ntl/place_table", |v| v.swap(0, 1));
    let (code, report) = validate_json(&bad, &["--seq", "16"], &[]);
    assert_fails_on(&report, code, &["loss", "number_loss"]);
}

/// A float16 LM `[B, T] ids → Gather(emb) → MatMul(head) → SCE(mean)`, weights seeded.
fn half_lm() -> ModelProto {
    use ntl_patch::onnx::proto::tensor_proto::DataType;
    use ntl_patch::onnx::{i64_tensor, GraphProto, TensorProto};
    let f16_tensor = |name: &str, dims: &[i64], seed: u32| {
        let n: i64 = dims.iter().product();
        let raw = (0..n as u32)
            .flat_map(|i| {
                let x = ((i.wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0;
                half::f16::from_f32(x).to_le_bytes()
            })
            .collect();
        TensorProto {
            name: Some(name.into()),
            dims: dims.to_vec(),
            data_type: Some(DataType::Float16 as i32),
            raw_data: Some(raw),
            ..Default::default()
        }
    };
    let graph = GraphProto {
        name: Some("half_lm".into()),
        node: vec![
            node("Gather", &["emb", "input_ids"], &["h"], vec![]),
            node("MatMul", &["h", "head"], &["z"], vec![]),
            node("Reshape", &["z", "flat_shape"], &["z_flat"], vec![]),
            node("Reshape", &["labels", "minus_one"], &["y_flat"], vec![]),
            sce("z_flat", "y_flat", "loss"),
        ],
        initializer: vec![
            f16_tensor("emb", &[48, 16], 7),
            f16_tensor("head", &[16, 48], 11),
            i64_tensor("flat_shape", &[2], &[-1, 48]),
            i64_tensor("minus_one", &[1], &[-1]),
        ],
        input: vec![
            value("input_ids", DataType::Int64, &[None, None]),
            value("labels", DataType::Int64, &[None, None]),
        ],
        output: vec![value("loss", DataType::Float16, &[])],
        ..Default::default()
    };
    model_proto(graph, 17)
}

#[test]
fn half_precision_graphs_validate_at_their_precision() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("half.onnx");
    std::fs::write(&input, half_lm().encode_to_vec()).unwrap();
    std::fs::copy(tokenizer(), dir.path().join("tokenizer.json")).unwrap();
    let out = patch(&input, dir.path(), &["--loss", "wasserstein"]);
    let lib = ort_library();
    for runtime in ["tract", "ort"] {
        let (code, report) =
            validate_json(&out, &["--runtime", runtime], &[("ORT_DYLIB_PATH", &lib)]);
        assert_passes(&report, code);
        // the number loss is float32 in the graph: held to the requested tolerance
        let nl = check(&report, "number_loss", "independent");
        assert!(nl["rel_err"].as_f64().unwrap() < 1e-5, "{report}");
        let notes = report["notes"].to_string();
        assert!(notes.contains("loss (float16)"), "{notes}");
    }
    // a wrong total still fails at float16's tolerance
    let bad = tampered(&out, "ntl/weight", |v| v[0] = 0.33);
    let (code, report) = validate_json(&bad, &[], &[]);
    assert_fails_on(&report, code, &["loss"]);
}

/// The fixture vocabulary as a one-token-per-line file, with tokens replaced at given ids.
fn vocab_with(dir: &Path, replace: &[(usize, &str)]) -> PathBuf {
    let text = std::fs::read_to_string(fixture("vocab.txt")).unwrap();
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    for (id, token) in replace {
        lines[*id] = token.to_string();
    }
    let path = dir.join("vocab.txt");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// `--all-numbers` with tokens whose values float64 holds but the float32 number loss cannot
/// (inf in float32, or distances and squares that overflow): they are left out with a warning,
/// and the loss stays finite — validate compares it with the float64 reference, which would
/// fail on the inf/NaN the graph computed before.
#[test]
fn number_tokens_too_large_for_the_loss_are_left_out() {
    let nines = "9".repeat(300); // 1e300: finite in float64, inf in float32
    let nines_inf = "9".repeat(400); // inf in float64 too: never a number token
    let flat = model("lm_flat");
    let half_dir = tempfile::tempdir().unwrap();
    let half_path = half_dir.path().join("half.onnx");
    std::fs::write(&half_path, half_lm().encode_to_vec()).unwrap();
    // (model, loss, replaced tokens by id, tokens left out, tokens kept of the replaced)
    type Case<'a> = (PathBuf, &'a str, Vec<(usize, &'a str)>, usize, usize);
    let cases: Vec<Case> = vec![
        (
            flat.clone(),
            "wasserstein",
            vec![
                (4, "1e308"),
                (5, "-1e308"),
                (8, nines.as_str()),
                (9, nines_inf.as_str()),
                (11, "1e38"),
                (14, "5e17"),
            ],
            4,
            1,
        ),
        (
            flat,
            "mse",
            vec![(4, "1e308"), (5, "1e12"), (8, "-3e8")],
            2,
            1,
        ),
        // the total of a float16 graph is float16 (largest value 65504)
        (
            half_path.clone(),
            "wasserstein",
            vec![(4, "100000"), (5, "-9000")],
            1,
            1,
        ),
    ];
    let all_numbers_in_fixture = 14;
    for (input, loss, replace, left_out, kept) in cases {
        let dir = tempfile::tempdir().unwrap();
        let vocab = vocab_with(dir.path(), &replace);
        let out = dir.path().join("out.onnx");
        let o = bin()
            .arg(&input)
            .args(["--all-numbers", "--loss", loss, "--json", "--tokenizer"])
            .arg(&vocab)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{loss}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "warning: {left_out} token(s) that parse as numbers are left out"
            )),
            "{loss}: {stderr}"
        );
        let summary: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(
            summary["number_tokens"],
            all_numbers_in_fixture + kept,
            "{loss} {replace:?}"
        );
        let (code, report) = validate_json(&out, &["--tokenizer", vocab.to_str().unwrap()], &[]);
        assert_passes(&report, code);
    }
}

/// Logits fed as a graph input whose width is symbolic (patched with `--vocab-size`): validate
/// gives that dim the vocabulary width, not `--seq` — with narrower logits than the number
/// table, tract panicked ("index out of bounds") and ONNX Runtime failed.
#[test]
fn a_symbolic_vocabulary_dim_gets_the_vocabulary_width() {
    use ntl_patch::onnx::proto::tensor_proto::DataType;
    use ntl_patch::onnx::{i64_tensor, int_attr, GraphProto};
    let graph = GraphProto {
        name: Some("logits_input".into()),
        node: vec![
            node("Shape", &["logits"], &["shape"], vec![]),
            node("Slice", &["shape", "minus_one", "big"], &["width"], vec![]),
            node(
                "Concat",
                &["minus_one", "width"],
                &["flat_shape"],
                vec![int_attr("axis", 0)],
            ),
            node("Reshape", &["logits", "flat_shape"], &["scores"], vec![]),
            node(
                "Reshape",
                &["labels", "minus_one"],
                &["labels_flat"],
                vec![],
            ),
            sce("scores", "labels_flat", "loss"),
        ],
        initializer: vec![
            i64_tensor("minus_one", &[1], &[-1]),
            i64_tensor("big", &[1], &[i64::MAX]),
        ],
        // [d0, d1, d2] and [d0, d1]: batch, sequence, vocabulary
        input: vec![
            value("logits", DataType::Float, &[None, None, None]),
            value("labels", DataType::Int64, &[None, None]),
        ],
        output: vec![value("loss", DataType::Float, &[])],
        ..Default::default()
    };
    patches_and_validates_with_48_classes(graph);
}

/// The minimal graph — one SoftmaxCrossEntropyLoss over a scores input — with a symbolic class
/// dim, patched with `--vocab-size 48`, validates in tract for every spelling of the scores'
/// shape: the class dim gets the table width whatever its name (or none), and the positions
/// get the same sizes in the scores and the labels. tract used to panic ("index out of
/// bounds") or fail to broadcast: `[N, V]` scores got N = batch, their `[N]` labels batch × seq.
#[test]
fn every_symbolic_spelling_of_the_scores_shape_validates_in_tract() {
    use ntl_patch::onnx::proto::tensor_proto::DataType;
    use ntl_patch::onnx::proto::tensor_shape_proto::{dimension, Dimension};
    use ntl_patch::onnx::GraphProto;
    // a value info whose dims are named (Some) or unnamed (None)
    let declared = |name: &str, elem: DataType, dims: &[Option<&str>]| {
        let mut v = value(name, elem, &vec![None; dims.len()]);
        let Some(ntl_patch::onnx::proto::type_proto::Value::TensorType(t)) =
            v.r#type.as_mut().and_then(|t| t.value.as_mut())
        else {
            unreachable!()
        };
        for (d, n) in t.shape.as_mut().unwrap().dim.iter_mut().zip(dims) {
            *d = Dimension {
                value: n.map(|n| dimension::Value::DimParam(n.into())),
                ..Default::default()
            };
        }
        v
    };
    // (scores dims, labels dims, scores transposed [B, T, V] → [B, V, T] before the CE)
    type Dims<'a> = &'a [Option<&'a str>];
    let cases: [(Dims, Dims, bool); 8] = [
        (&[Some("N"), Some("V")], &[Some("N")], false),
        (
            &[Some("positions"), Some("classes")],
            &[Some("positions")],
            false,
        ),
        (
            &[Some("B"), Some("V"), Some("T")],
            &[Some("B"), Some("T")],
            false,
        ),
        (
            &[Some("B"), Some("T"), Some("V")],
            &[Some("B"), Some("T")],
            true,
        ),
        (&[None, None], &[None], false),
        (&[None, None, None], &[None, None], false),
        (&[None, None, None], &[None, None], true),
        (&[Some("N"), None], &[Some("N")], false),
    ];
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(tokenizer(), dir.path().join("tokenizer.json")).unwrap();
    for (k, (scores, labels, transposed)) in cases.into_iter().enumerate() {
        let mut nodes = Vec::new();
        let ce_scores = if transposed {
            let perm = ntl_patch::onnx::ints_attr("perm", &[0, 2, 1]);
            nodes.push(node("Transpose", &["scores"], &["scores_bvt"], vec![perm]));
            "scores_bvt"
        } else {
            "scores"
        };
        nodes.push(sce(ce_scores, "labels", "loss"));
        let graph = GraphProto {
            name: Some("scores_input".into()),
            node: nodes,
            input: vec![
                declared("scores", DataType::Float, scores),
                declared("labels", DataType::Int64, labels),
            ],
            output: vec![value("loss", DataType::Float, &[])],
            ..Default::default()
        };
        let input = dir.path().join(format!("scores_{k}.onnx"));
        std::fs::write(&input, model_proto(graph, 17).encode_to_vec()).unwrap();
        let out = patch(&input, dir.path(), &["--vocab-size", "48"]);
        let (code, report) = validate_json(&out, &["--runtime", "tract"], &[]);
        assert!(code == 0, "scores {scores:?}, labels {labels:?}: {report}");
        assert_passes(&report, code);
    }
}

/// Token ids that index a table narrower than the class width (a 16-row embedding under 48
/// classes): validate draws the ids below the table's rows. It drew them from [0, 48), and
/// tract panicked ("range start index … out of range") gathering rows the table has not.
#[test]
fn generated_ids_stay_inside_the_embedding_they_index() {
    use ntl_patch::onnx::proto::tensor_proto::DataType;
    use ntl_patch::onnx::{f32_tensor, ints_attr, GraphProto};
    let (rows, dim, classes) = (16usize, 4usize, 48usize);
    let table: Vec<f32> = (0..rows * dim).map(|i| (i as f32 * 0.37).sin()).collect();
    let w: Vec<f32> = (0..dim * classes)
        .map(|i| (i as f32 * 0.11).cos())
        .collect();
    let graph = GraphProto {
        name: Some("narrow_embedding".into()),
        node: vec![
            node("Gather", &["emb", "input_ids"], &["hidden"], vec![]),
            node("MatMul", &["hidden", "w"], &["logits"], vec![]),
            node(
                "Transpose",
                &["logits"],
                &["scores"],
                vec![ints_attr("perm", &[0, 2, 1])],
            ),
            sce("scores", "labels", "loss"),
        ],
        initializer: vec![
            f32_tensor("emb", &[rows as i64, dim as i64], &table),
            f32_tensor("w", &[dim as i64, classes as i64], &w),
        ],
        input: vec![
            value("input_ids", DataType::Int64, &[None, None]),
            value("labels", DataType::Int64, &[None, None]),
        ],
        output: vec![value("loss", DataType::Float, &[])],
        ..Default::default()
    };
    patches_and_validates_with_48_classes(graph);
}

/// A symbolic feature axis the graph pins (the inner dim of a `MatMul` with a static weight):
/// validate gives it the weight's rows. It gave it `--seq` (8), and tract refused the product
/// ("Inconsistent matmul … 8 · 4 …").
#[test]
fn a_symbolic_axis_a_matmul_pins_gets_the_weights_rows() {
    use ntl_patch::onnx::proto::tensor_proto::DataType;
    use ntl_patch::onnx::{f32_tensor, ints_attr, GraphProto};
    let (features, classes) = (4usize, 48usize);
    let w: Vec<f32> = (0..features * classes)
        .map(|i| (i as f32 * 0.11).cos())
        .collect();
    let graph = GraphProto {
        name: Some("pinned_features".into()),
        node: vec![
            node("MatMul", &["x", "w"], &["logits"], vec![]),
            node(
                "Transpose",
                &["logits"],
                &["scores"],
                vec![ints_attr("perm", &[0, 2, 1])],
            ),
            sce("scores", "labels", "loss"),
        ],
        initializer: vec![f32_tensor("w", &[features as i64, classes as i64], &w)],
        input: vec![
            value("x", DataType::Float, &[None, None, None]),
            value("labels", DataType::Int64, &[None, None]),
        ],
        output: vec![value("loss", DataType::Float, &[])],
        ..Default::default()
    };
    patches_and_validates_with_48_classes(graph);
}

/// Writes `graph` (opset 17), patches it with `--vocab-size 48` and the fixture tokenizer, and
/// asserts that validate passes in tract and in ONNX Runtime.
fn patches_and_validates_with_48_classes(graph: ntl_patch::onnx::GraphProto) {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("model.onnx");
    std::fs::write(&input, model_proto(graph, 17).encode_to_vec()).unwrap();
    std::fs::copy(tokenizer(), dir.path().join("tokenizer.json")).unwrap();
    let out = patch(&input, dir.path(), &["--vocab-size", "48"]);
    let lib = ort_library();
    for runtime in ["tract", "ort"] {
        let (code, report) =
            validate_json(&out, &["--runtime", runtime], &[("ORT_DYLIB_PATH", &lib)]);
        assert_passes(&report, code);
    }
}

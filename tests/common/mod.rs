//! Helpers shared by the integration tests: running the binary, reading models back.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use ntl_patch::onnx::ModelProto;
use prost::Message;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixture(rel: &str) -> PathBuf {
    root().join("fixtures").join(rel)
}

pub fn tokenizer() -> PathBuf {
    fixture("tokenizer.json")
}

pub fn bin() -> Command {
    Command::cargo_bin("ntl-patch").expect("binary built")
}

pub fn read_model(path: &Path) -> ModelProto {
    ModelProto::decode(std::fs::read(path).expect("read model").as_slice()).expect("decode model")
}

/// Patches `model` with `args` into `dir/out.onnx` and returns the output path.
pub fn patch(model: &Path, dir: &Path, args: &[&str]) -> PathBuf {
    let out = dir.join("out.onnx");
    bin()
        .arg(model)
        .arg("--tokenizer")
        .arg(tokenizer())
        .args(args)
        .arg("-o")
        .arg(&out)
        .assert()
        .success();
    out
}

pub const MODELS: [&str; 3] = ["lm_flat", "lm_bvt", "lm_nll"];

pub fn model(name: &str) -> PathBuf {
    fixture(&format!("models/{name}.onnx"))
}

//! `ntl-patch validate`: run a patched graph and compare its losses with an independent
//! implementation (and, optionally, recorded reference outputs).

use std::path::PathBuf;

use crate::error::Error;

#[derive(Debug, Clone, Copy)]
pub enum Runtime {
    Tract,
    Ort,
}

pub struct ValidateRequest {
    pub model: PathBuf,
    pub runtime: Runtime,
    pub reference: Option<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub rtol: f64,
    pub atol: f64,
    pub batch: usize,
    pub seq: usize,
    pub seed: u64,
}

pub struct Report {}

impl Report {
    pub fn passed(&self) -> bool {
        false
    }
    pub fn to_text(&self) -> String {
        String::new()
    }
    pub fn to_json(&self) -> String {
        String::new()
    }
}

pub fn run(_req: &ValidateRequest) -> Result<Report, Error> {
    Err(Error::Validation("not implemented".into()))
}

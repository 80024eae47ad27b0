//! The `ntl_patch` metadata a patched model carries: which loss, which options, and which
//! tensors hold the flat logits and labels. Validation reads everything about the patch from
//! here (and from the tokenizer), never from the patch's own initializers.

use crate::error::Error;
use crate::number_table::NumberSet;
use crate::onnx::ModelProto;
use crate::patch::METADATA_KEY;
use crate::validate::reference::{NtlKind, NtlSettings};

#[derive(Debug, Clone)]
pub struct PatchMeta {
    pub ntl: NtlSettings,
    /// λ in `CE + λ·NTL`.
    pub weight: f64,
    pub numbers: NumberSet,
    pub ignore_index: Option<i64>,
    /// The cross-entropy's reduction: "mean" or "sum".
    pub reduction: String,
    /// Float logits flattened to `[M, V]`.
    pub flat_logits: String,
    /// int64 labels `[M]`.
    pub flat_labels: String,
    pub vocab_width: usize,
    pub ce_node: String,
}

impl PatchMeta {
    pub fn from_model(model: &ModelProto) -> Result<PatchMeta, Error> {
        let text = model
            .metadata_props
            .iter()
            .find(|p| p.key() == METADATA_KEY)
            .map(|p| p.value().to_string())
            .ok_or_else(|| {
                Error::Validation("not patched by ntl-patch; run ntl-patch MODEL first".into())
            })?;
        Self::parse(&text)
    }

    pub fn parse(text: &str) -> Result<PatchMeta, Error> {
        let bad = |what: &str| {
            Error::Validation(format!(
                "the '{METADATA_KEY}' metadata is unreadable ({what}); re-patch the original model with this ntl-patch"
            ))
        };
        let v: serde_json::Value = serde_json::from_str(text).map_err(|_| bad("not JSON"))?;
        let s = |k: &str| v[k].as_str().map(str::to_string).ok_or_else(|| bad(k));
        let kind = match s("loss")?.as_str() {
            "wasserstein" => NtlKind::Wasserstein,
            "mse" => NtlKind::Mse,
            "l1" => NtlKind::L1,
            "huber" => NtlKind::Huber,
            _ => return Err(bad("unknown loss")),
        };
        let numbers = match s("numbers")?.as_str() {
            "digit-level" => NumberSet::DigitLevel,
            "all-numbers" => NumberSet::AllNumbers,
            _ => return Err(bad("numbers")),
        };
        let vocab_width = v["vocab_width"].as_u64().ok_or_else(|| bad("vocab_width"))? as usize;
        Ok(PatchMeta {
            ntl: NtlSettings {
                kind,
                reweigh: v["reweigh"].as_bool().unwrap_or(false),
                squash: v["squash"].as_f64(),
            },
            weight: v["weight"].as_f64().ok_or_else(|| bad("weight"))?,
            numbers,
            ignore_index: v["ignore_index"].as_i64(),
            reduction: s("reduction")?,
            flat_logits: s("flat_logits")?,
            flat_labels: s("flat_labels")?,
            vocab_width,
            ce_node: v["ce_node"].as_str().unwrap_or_default().to_string(),
        })
    }

    /// A short description for the report.
    pub fn describe(&self) -> String {
        let mut parts = vec![self.ntl.kind.name().to_string()];
        if self.ntl.reweigh {
            parts.push("reweigh".into());
        }
        if let Some(s) = self.ntl.squash {
            parts.push(format!("squash {s}"));
        }
        parts.push(
            match self.numbers {
                NumberSet::DigitLevel => "digit-level",
                NumberSet::AllNumbers => "all-numbers",
            }
            .into(),
        );
        parts.push(format!("λ = {}", self.weight));
        parts.join(", ")
    }
}

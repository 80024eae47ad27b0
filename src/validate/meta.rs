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
    /// How the number loss joins the CE in the total.
    pub combine: Combine,
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
    /// The tensor holding the total (the original loss output's name); older patches did not
    /// record it.
    pub loss_output: Option<String>,
}

/// `add`: `CE + λ·L`; `scaled`: `CE + stopgrad(CE / (L + 1e-10))·λ·L` (value `(1+λ)·CE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Combine {
    Add,
    Scaled,
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
        let loss = s("loss")?;
        let kind = NtlKind::parse(&loss).ok_or_else(|| {
            Error::Validation(format!(
                "validate checks the NTL losses (wasserstein, mse, l1, huber); this graph's loss '{loss}' has no independent reference here yet"
            ))
        })?;
        let combine = match v["combine"].as_str().unwrap_or("add") {
            "add" => Combine::Add,
            "scaled" => Combine::Scaled,
            _ => return Err(bad("combine")),
        };
        let numbers = match s("numbers")?.as_str() {
            "digit-level" => NumberSet::DigitLevel,
            "all-numbers" => NumberSet::AllNumbers,
            _ => return Err(bad("numbers")),
        };
        let vocab_width = v["vocab_width"]
            .as_u64()
            .ok_or_else(|| bad("vocab_width"))? as usize;
        Ok(PatchMeta {
            ntl: NtlSettings {
                kind,
                reweigh: v["reweigh"].as_bool().unwrap_or(false),
                squash: v["squash"].as_f64(),
            },
            weight: v["weight"].as_f64().ok_or_else(|| bad("weight"))?,
            combine,
            numbers,
            ignore_index: v["ignore_index"].as_i64(),
            reduction: s("reduction")?,
            flat_logits: s("flat_logits")?,
            flat_labels: s("flat_labels")?,
            vocab_width,
            ce_node: v["ce_node"].as_str().unwrap_or_default().to_string(),
            loss_output: v["loss_output"].as_str().map(str::to_string),
        })
    }

    /// The total the graph should output, from independent CE and number-loss values.
    pub fn total(&self, ce: f64, number_loss: f64) -> f64 {
        match self.combine {
            Combine::Add => ce + self.weight * number_loss,
            // the stop-gradient changes no value: CE + (CE / (L + 1e-10))·λ·L
            Combine::Scaled => ce + ce / (number_loss + 1e-10) * self.weight * number_loss,
        }
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
        if self.combine == Combine::Scaled {
            parts.push("combine scaled".into());
        }
        parts.join(", ")
    }
}

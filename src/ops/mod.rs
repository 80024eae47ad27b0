//! The loss subgraph library. Each loss is a pure function of the cross-entropy site, the
//! number table and the options: it emits nodes through a [`Builder`] and never touches the
//! model. `crate::rewrite` turns what they emit into a [`crate::patch::Patch`].

pub mod builder;
pub mod ce;
pub mod ntl;

pub use builder::Builder;

use crate::number_table::NumberSet;

/// The number losses ntl-patch can splice in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossKind {
    /// NTL-WAS: `Σ_j p_j |v_j − y|` (Zausinger et al., ICML 2025).
    Wasserstein,
    /// NTL-MSE: `(Σ_j p_j v_j − y)²`.
    Mse,
    /// NTL-L1: `|Σ_j p_j v_j − y|`.
    L1,
    /// NTL-Huber (δ = 1) on `Σ_j p_j v_j − y`.
    Huber,
}

impl LossKind {
    pub fn name(self) -> &'static str {
        match self {
            LossKind::Wasserstein => "wasserstein",
            LossKind::Mse => "mse",
            LossKind::L1 => "l1",
            LossKind::Huber => "huber",
        }
    }
}

/// Everything a user chooses about the number loss.
#[derive(Debug, Clone)]
pub struct LossOptions {
    pub kind: LossKind,
    /// λ in `CE + λ·loss`.
    pub weight: f64,
    /// ntloss `reweigh`: scale by the softmax mass on number tokens (off by default, as in the paper).
    pub reweigh: bool,
    /// ntloss `squash_factor` (Wasserstein only), > 1.
    pub squash: Option<f64>,
    pub number_set: NumberSet,
}

impl LossOptions {
    /// The options as JSON, recorded in the patched model's metadata.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "loss": self.kind.name(),
            "weight": self.weight,
            "reweigh": self.reweigh,
            "squash": self.squash,
            "numbers": match self.number_set {
                NumberSet::DigitLevel => "digit-level",
                NumberSet::AllNumbers => "all-numbers",
            },
        })
    }
}

/// The tensors a number loss reads: logits flattened to `[M, V]` float32 and labels `[M]` int64.
pub struct FlatInputs {
    pub logits: String,
    pub labels: String,
    pub ignore_index: Option<i64>,
}

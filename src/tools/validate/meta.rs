//! The `ntl_patch` metadata a patched model carries: which loss, which options, and which
//! tensors hold the flat logits and labels. Validation reads everything about the patch from
//! here (and from the tokenizer), never from the patch's own initializers.

use crate::error::Error;
use crate::graph::patch::METADATA_KEY;
use crate::onnx::ModelProto;
use crate::tools::validate::reference::{NtlKind, NtlSettings};
use crate::tools::validate::reference_del::DigitLoss;
use crate::tools::validate::reference_ntil::{NtilSettings, NumberLevelSettings, SeqLoss};
use crate::tools::validate::reference_smmd::SmmdSettings;
use crate::vocab::number_table::NumberSet;

/// The number loss a patch computes, as the independent references name it.
#[derive(Debug, Clone, PartialEq)]
pub enum LossSpec {
    /// ntloss `NTLoss` / `NTLossDotProduct`, per position over the flat batch (`reference`).
    Ntl(NtlSettings),
    /// NTIL, EMD, number-level: per sequence (`reference_ntil`).
    Sequence(SeqLoss),
    /// DIST2, DEL: per digit label, numbers grouped per sequence (`reference_del`).
    Digits(DigitLoss),
    /// SMMD, per position over the flat batch (`reference_smmd`).
    Smmd(SmmdSettings),
}

#[derive(Debug, Clone)]
pub struct PatchMeta {
    pub loss: LossSpec,
    /// NTIL's Gumbel noise scale as patched (0 when none; validation always runs at 0).
    pub gumbel_noise: f64,
    /// λ in `CE + λ·NTL`.
    pub weight: f64,
    /// How the number loss joins the CE in the total.
    pub combine: Combine,
    pub numbers: NumberSet,
    pub ignore_index: Option<i64>,
    /// ε of the cross-entropy's label smoothing (0: none).
    pub label_smoothing: f64,
    /// The cross-entropy's reduction: "mean" or "sum".
    pub reduction: String,
    /// Float logits flattened to `[M, V]`.
    pub flat_logits: String,
    /// int64 labels `[M]`.
    pub flat_labels: String,
    /// The labels the number loss reads where the graph's masks drop positions (`flat_labels`
    /// with those positions set to -100); None where it reads `flat_labels`.
    pub number_labels: Option<String>,
    /// The `[M, V]` logits the number loss reads where they are not `flat_logits` (DEL on a
    /// cross-entropy of log-probabilities reads the logits before the LogSoftmax).
    pub number_logits: Option<String>,
    pub vocab_width: usize,
    pub ce_node: String,
    /// The tensor holding the total (the original loss output's name); older patches did not
    /// record it.
    pub loss_output: Option<String>,
    /// Ops between the cross-entropy and the reported loss (e.g. `Div` by the number of
    /// items); empty when the CE's value is reported as is.
    pub rescaled_by: Vec<String>,
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
        let loss_name = s("loss")?;
        let f = |x: &serde_json::Value, k: &str| x[k].as_f64().ok_or_else(|| bad(k));
        let reweigh = v["reweigh"].as_bool().unwrap_or(false);
        let mut gumbel_noise = 0.0;
        let loss = match loss_name.as_str() {
            "ntil" | "emd" => {
                let n = &v["ntil"];
                if !n.is_object() {
                    return Err(bad("ntil"));
                }
                gumbel_noise = n["gumbel_noise"].as_f64().unwrap_or(0.0);
                LossSpec::Sequence(if loss_name == "emd" {
                    SeqLoss::Emd {
                        digit_exp: f(n, "digit_exp")?,
                    }
                } else {
                    SeqLoss::Ntil(NtilSettings {
                        digit_exp: f(n, "digit_exp")?,
                        abs_alpha: f(n, "abs_alpha")?,
                        mag_alpha: f(n, "mag_alpha")?,
                        digit_alpha: f(n, "digit_alpha")?,
                        tau: f(n, "gumbel_tau")?,
                    })
                })
            }
            "number-level" => LossSpec::Sequence(SeqLoss::NumberLevel(NumberLevelSettings {
                float_level: v["float_level"].as_bool().unwrap_or(false),
                reweigh,
            })),
            "dist2" => LossSpec::Digits(DigitLoss::Dist2 {
                tau: f(&v["dist2"], "tau")?,
            }),
            "del" => LossSpec::Digits(DigitLoss::Del),
            "smmd" => {
                let m = &v["smmd"];
                let max_value = m["max_value"]
                    .as_u64()
                    .filter(|&x| x <= ntl_ops::options::MAX_SMMD_VALUE as u64)
                    .ok_or_else(|| bad("smmd.max_value"))? as u32;
                let sigmas: Vec<f64> = m["sigmas"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
                    .filter(|s: &Vec<f64>| !s.is_empty())
                    .ok_or_else(|| bad("smmd.sigmas"))?;
                LossSpec::Smmd(SmmdSettings {
                    max_value,
                    laplace: match m["kernel"].as_str() {
                        Some("gaussian") => false,
                        Some("laplace") => true,
                        _ => return Err(bad("smmd.kernel")),
                    },
                    sigmas,
                    squash: f(m, "squash")?,
                    alpha: m["alpha"].as_f64(),
                    terms: match m["terms"].as_str() {
                        Some(t @ ("smmd" | "mmd" | "smooth")) => t.to_string(),
                        _ => return Err(bad("smmd.terms")),
                    },
                })
            }
            name => LossSpec::Ntl(NtlSettings {
                kind: NtlKind::parse(name).ok_or_else(|| {
                    Error::Validation(format!(
                        "this graph's loss '{name}' is not one validate knows (wasserstein, mse, l1, huber, ntil, emd, number-level, dist2, smmd, del); validate it with the ntl-patch that wrote it"
                    ))
                })?,
                reweigh,
                squash: v["squash"].as_f64(),
            }),
        };
        let combine = match v["combine"].as_str().unwrap_or("add") {
            "add" => Combine::Add,
            "scaled" => Combine::Scaled,
            _ => return Err(bad("combine")),
        };
        let numbers = match (s("numbers")?.as_str(), &loss) {
            ("digit-level", _) => NumberSet::DigitLevel,
            ("all-numbers", _) => NumberSet::AllNumbers,
            ("integers", LossSpec::Smmd(m)) => NumberSet::Integers { max: m.max_value },
            _ => return Err(bad("numbers")),
        };
        let vocab_width = v["vocab_width"]
            .as_u64()
            .filter(|&w| (1..=crate::io::limits::MAX_VOCAB).contains(&w))
            .ok_or_else(|| bad("vocab_width"))? as usize;
        Ok(PatchMeta {
            loss,
            gumbel_noise,
            weight: v["weight"].as_f64().ok_or_else(|| bad("weight"))?,
            combine,
            numbers,
            ignore_index: v["ignore_index"].as_i64(),
            label_smoothing: v["label_smoothing"].as_f64().unwrap_or(0.0),
            reduction: s("reduction")?,
            flat_logits: s("flat_logits")?,
            flat_labels: s("flat_labels")?,
            number_labels: v["number_labels"]
                .as_str()
                .filter(|n| Some(*n) != v["flat_labels"].as_str())
                .map(str::to_string),
            number_logits: v["number_logits"].as_str().map(str::to_string),
            vocab_width,
            ce_node: v["ce_node"].as_str().unwrap_or_default().to_string(),
            loss_output: v["loss_output"].as_str().map(str::to_string),
            rescaled_by: v["rescaled_by"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default(),
        })
    }

    /// DIST2, DEL and SMMD drop labels equal to the ignore index before looking them up (the
    /// NTL family masks it itself; NTIL and number-level read it as any other label).
    pub fn skips_ignore_index(&self) -> bool {
        matches!(self.loss, LossSpec::Smmd(_) | LossSpec::Digits(_))
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
        let mut parts = Vec::new();
        match &self.loss {
            LossSpec::Ntl(ntl) => {
                parts.push(ntl.kind.name().to_string());
                if ntl.reweigh {
                    parts.push("reweigh".into());
                }
                if let Some(s) = ntl.squash {
                    parts.push(format!("squash {s}"));
                }
            }
            LossSpec::Sequence(SeqLoss::Ntil(n)) => {
                parts.push(format!(
                    "ntil (digit_exp {}, abs_alpha {}, mag_alpha {}, digit_alpha {}, gumbel_tau {}, gumbel_noise {})",
                    n.digit_exp, n.abs_alpha, n.mag_alpha, n.digit_alpha, n.tau, self.gumbel_noise
                ));
            }
            LossSpec::Sequence(SeqLoss::Emd { digit_exp }) => {
                parts.push(format!("emd (digit_exp {digit_exp})"));
            }
            LossSpec::Sequence(SeqLoss::NumberLevel(n)) => {
                parts.push("number-level".into());
                if n.float_level {
                    parts.push("float-level".into());
                }
                if n.reweigh {
                    parts.push("reweigh".into());
                }
            }
            LossSpec::Digits(d) => parts.push(d.describe()),
            LossSpec::Smmd(m) => parts.push(m.describe()),
        }
        parts.push(match self.numbers {
            NumberSet::Integers { max } => format!("integers 0..{max}"),
            set => set.name().into(),
        });
        parts.push(format!("λ = {}", self.weight));
        if self.combine == Combine::Scaled {
            parts.push("combine scaled".into());
        }
        parts.join(", ")
    }
}

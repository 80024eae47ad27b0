//! What a user chooses about the number loss: which loss, its weight and how it joins the
//! cross-entropy, and each loss's knobs with its reference's defaults.

use crate::numbers::NumberSet;

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
    /// NTIL (Fei et al., ACL 2025): place-weighted digit EMD + whole-number abs/mag terms.
    Ntil,
    /// The token-level part of NTIL alone (the reference's `EMD` class).
    Emd,
    /// ntloss `NumberLevelLoss`: symmetric relative error of whole numbers built from digits.
    NumberLevel,
    /// DIST2Loss (Chung et al., ICLR 2026) as PolyU-VCLab/DEL's `DIST2loss`: place-weighted
    /// KL(softmax(−(y−k)²/τ) ‖ q) over the ten digits.
    Dist2,
    /// SMMD (Smooth MMD, ICML 2026; Zuozhuo/smmd-loss `SMMDLoss`): `rᵀKr + α·rᵀ(D−K)r` over
    /// the integer tokens, r = p − onehot(y).
    Smmd,
    /// DEL (Digit Entropy Loss; PolyU-VCLab/DEL `DEL`): place-weighted BCE-with-logits of the
    /// ten digit logits times their softmax, `0.01·mean`.
    Del,
}

impl LossKind {
    pub fn name(self) -> &'static str {
        match self {
            LossKind::Wasserstein => "wasserstein",
            LossKind::Mse => "mse",
            LossKind::L1 => "l1",
            LossKind::Huber => "huber",
            LossKind::Ntil => "ntil",
            LossKind::Emd => "emd",
            LossKind::NumberLevel => "number-level",
            LossKind::Dist2 => "dist2",
            LossKind::Smmd => "smmd",
            LossKind::Del => "del",
        }
    }

    /// Losses that read digits per sequence (need the `[B, T]` grouping and the digit ids).
    pub fn is_sequence_level(self) -> bool {
        matches!(
            self,
            LossKind::Ntil
                | LossKind::Emd
                | LossKind::NumberLevel
                | LossKind::Dist2
                | LossKind::Del
        )
    }

    /// Losses that skip labels equal to the ignore index even where it is a token id (their
    /// references drop -100 labels before they look; the NTL family masks it itself).
    pub fn skips_ignore_index(self) -> bool {
        matches!(self, LossKind::Dist2 | LossKind::Del | LossKind::Smmd)
    }

    /// λ when `--weight` is not given: each paper's own weight where it has one.
    pub fn default_weight(self) -> f64 {
        match self {
            // DEL's training adds its loss (0.01 included in it) to the CE with weight 1
            LossKind::Del => 1.0,
            // DIST2Loss: the paper's α
            LossKind::Dist2 => 0.1,
            // SMMD: docs/LOSSES.md says why (the NTL weight; the paper's could not be read)
            _ => 0.3,
        }
    }

    /// How the loss joins the CE when `--combine` is not given: the NTIL reference's scaled
    /// form for NTIL/EMD, a plain sum for every other paper.
    pub fn default_combine(self) -> Combine {
        match self {
            LossKind::Ntil | LossKind::Emd => Combine::Scaled,
            _ => Combine::Add,
        }
    }
}

/// How the number loss joins the cross-entropy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Combine {
    /// `CE + λ·L`.
    Add,
    /// The NTIL reference: `CE + stopgrad(CE / (L + 1e-10))·λ·L` — the value is `(1+λ)·CE`,
    /// the number loss only reshapes the gradient.
    Scaled,
}

/// NTIL's knobs, with the reference's defaults.
#[derive(Debug, Clone)]
pub struct NtilOptions {
    pub digit_exp: f64,
    pub abs_alpha: f64,
    pub mag_alpha: f64,
    pub digit_alpha: f64,
    pub gumbel_tau: f64,
    pub gumbel_noise: f64,
}

impl Default for NtilOptions {
    fn default() -> Self {
        NtilOptions {
            digit_exp: 1.2,
            abs_alpha: 0.2,
            mag_alpha: 0.2,
            digit_alpha: 1.0,
            gumbel_tau: 0.1,
            gumbel_noise: 0.01,
        }
    }
}

/// DIST2Loss's knob: the target is `softmax(−(y − k)²/τ)` over the digits k (the DEL
/// repository's `DIST2loss` has τ = 1 written in; the paper's τ).
#[derive(Debug, Clone)]
pub struct Dist2Options {
    pub tau: f64,
}

impl Default for Dist2Options {
    fn default() -> Self {
        Dist2Options { tau: 1.0 }
    }
}

/// SMMD's distance kernel κ(d) (`kernels.py` `DistanceKernelType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmmdKernel {
    /// `exp(−d²/(2σ²))`, the paper's.
    Gaussian,
    /// `exp(−|d|/σ)`.
    Laplace,
}

/// Which terms of SMMD (`loss.py` `LossMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmmdTerms {
    /// `rᵀKr + α·rᵀ(D−K)r`.
    Smmd,
    /// `rᵀKr` alone.
    Mmd,
    /// `α·rᵀ(D−K)r` alone.
    Smooth,
}

impl SmmdKernel {
    pub fn name(self) -> &'static str {
        match self {
            SmmdKernel::Gaussian => "gaussian",
            SmmdKernel::Laplace => "laplace",
        }
    }
}

impl SmmdTerms {
    pub fn name(self) -> &'static str {
        match self {
            SmmdTerms::Smmd => "smmd",
            SmmdTerms::Mmd => "mmd",
            SmmdTerms::Smooth => "smooth",
        }
    }
}

/// SMMD's knobs, with the reference's defaults (`SMMDLoss.__init__`).
#[derive(Debug, Clone)]
pub struct SmmdOptions {
    /// Number tokens are the integers 0..=max_value that are a token of their own.
    pub max_value: u32,
    pub kernel: SmmdKernel,
    /// Bandwidths σ; the kernel is the mean over them.
    pub sigmas: Vec<f64>,
    /// Distances are mapped linearly onto [1, squash] (0 stays 0); 1 leaves them raw.
    pub squash: f64,
    /// α of the smoothness term; None: `1/(2·mean degree)` (the reference's `tau_mode="auto"`).
    pub alpha: Option<f64>,
    pub terms: SmmdTerms,
}

impl Default for SmmdOptions {
    fn default() -> Self {
        SmmdOptions {
            max_value: 999,
            kernel: SmmdKernel::Gaussian,
            sigmas: vec![2.0],
            squash: 9.0,
            alpha: None,
            terms: SmmdTerms::Smmd,
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
    pub combine: Combine,
    pub ntil: NtilOptions,
    /// ntloss `NumberLevelLoss(float_level=True)`: a `"."` between digits joins one number.
    pub float_level: bool,
    /// ε of the cross-entropy ntl-patch writes (torch's `label_smoothing`); 0 = none.
    pub label_smoothing: f64,
    pub dist2: Dist2Options,
    pub smmd: SmmdOptions,
}

/// The largest `--max-value`: SMMD's integer values stay exact in float32.
pub const MAX_SMMD_VALUE: u32 = 1 << 24;

/// A numeric option in `[lo, hi]`, finite, and still within range once converted to the
/// float32 the graph stores (so `1e39` is refused rather than written as inf).
fn check_range(flag: &str, value: f64, lo: f64, hi: f64, why: &str) -> Result<(), String> {
    let as_f32 = value as f32;
    let fine = value.is_finite()
        && as_f32.is_finite()
        && (lo..=hi).contains(&value)
        && (lo..=hi).contains(&(as_f32 as f64))
        && (value == 0.0 || as_f32 != 0.0);
    if fine {
        return Ok(());
    }
    Err(format!(
        "{flag} {value} is out of range: it takes a number from {lo} to {hi} ({why})"
    ))
}

impl LossOptions {
    /// Refuses option values that are not finite, not representable in float32, or outside
    /// what each loss needs to stay finite (so the patched graph never holds a constant that
    /// turns the loss into NaN or inf). The error is the one-line message for the user.
    // `!(s > 1.0)` on purpose: NaN must be refused too.
    #[allow(clippy::neg_cmp_op_on_partial_ord)]
    pub fn check(&self) -> Result<(), String> {
        check_range("--weight", self.weight, 0.0, 1e6, "λ in CE + λ·L")?;
        check_range(
            "--label-smoothing",
            self.label_smoothing,
            0.0,
            1.0,
            "ε of the cross-entropy, as torch's label_smoothing",
        )?;
        if let Some(s) = self.squash {
            if self.kind != LossKind::Wasserstein {
                return Err(
                    "--squash takes a factor > 1 and applies to --loss wasserstein and smmd only"
                        .into(),
                );
            }
            if !(s > 1.0) {
                return Err(format!(
                    "--squash {s}: it takes a factor > 1 (and applies to --loss wasserstein only)"
                ));
            }
            check_range("--squash", s, 1.0, 1e6, "the largest squashed distance")?;
        }
        let n = &self.ntil;
        check_range(
            "--digit-exp",
            n.digit_exp,
            1e-3,
            10.0,
            "place weights digit_exp^r, r up to 30, must stay finite in float32",
        )?;
        for (flag, v) in [
            ("--abs-alpha", n.abs_alpha),
            ("--mag-alpha", n.mag_alpha),
            ("--digit-alpha", n.digit_alpha),
        ] {
            check_range(flag, v, 0.0, 1e6, "a term weight")?;
        }
        check_range(
            "--gumbel-tau",
            n.gumbel_tau,
            1e-4,
            1e4,
            "logits are divided by it; smaller values overflow float32 and give NaN",
        )?;
        check_range(
            "--gumbel-noise",
            n.gumbel_noise,
            0.0,
            1e3,
            "the scale of Gumbel noise added to logits",
        )?;
        check_range(
            "--dist2-tau",
            self.dist2.tau,
            1e-3,
            1e3,
            "the target is softmax(−(y−k)²/τ); smaller values underflow float32",
        )?;
        self.check_smmd()
    }

    fn check_smmd(&self) -> Result<(), String> {
        let m = &self.smmd;
        if m.max_value > MAX_SMMD_VALUE {
            return Err(format!(
                "--max-value {}: it takes an integer from 0 to {MAX_SMMD_VALUE} (values stay exact in float32)",
                m.max_value
            ));
        }
        if m.sigmas.is_empty() {
            return Err("--sigma: SMMD needs at least one kernel bandwidth".into());
        }
        for &s in &m.sigmas {
            check_range(
                "--sigma",
                s,
                1e-3,
                1e6,
                "a kernel bandwidth: distances are divided by it",
            )?;
        }
        check_range(
            "--squash",
            m.squash,
            1.0,
            1e6,
            "SMMD maps distances onto [1, S]; 1 leaves them raw",
        )?;
        if let Some(a) = m.alpha {
            check_range(
                "--smmd-alpha",
                a,
                0.0,
                1e6,
                "the weight of the smoothness term",
            )?;
        }
        Ok(())
    }

    /// The number tokens the loss reads: SMMD's integers whatever `number_set` says.
    pub fn numbers(&self) -> NumberSet {
        match self.kind {
            LossKind::Smmd => NumberSet::Integers {
                max: self.smmd.max_value,
            },
            _ => self.number_set,
        }
    }

    /// The options as JSON, recorded in the patched model's metadata.
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "loss": self.kind.name(),
            "weight": self.weight,
            "reweigh": self.reweigh,
            "squash": self.squash,
            "numbers": self.numbers().name(),
            "combine": match self.combine {
                Combine::Add => "add",
                Combine::Scaled => "scaled",
            },
        });
        if matches!(self.kind, LossKind::Ntil | LossKind::Emd) {
            let n = &self.ntil;
            v["ntil"] = serde_json::json!({
                "digit_exp": n.digit_exp, "abs_alpha": n.abs_alpha, "mag_alpha": n.mag_alpha,
                "digit_alpha": n.digit_alpha, "gumbel_tau": n.gumbel_tau, "gumbel_noise": n.gumbel_noise,
            });
        }
        if self.kind == LossKind::NumberLevel {
            v["float_level"] = self.float_level.into();
        }
        if self.kind == LossKind::Dist2 {
            v["dist2"] = serde_json::json!({ "tau": self.dist2.tau });
        }
        if self.kind == LossKind::Smmd {
            let m = &self.smmd;
            v["smmd"] = serde_json::json!({
                "max_value": m.max_value, "kernel": m.kernel.name(), "sigmas": m.sigmas,
                "squash": m.squash, "alpha": m.alpha, "terms": m.terms.name(),
            });
        }
        if self.label_smoothing > 0.0 {
            v["label_smoothing"] = self.label_smoothing.into();
        }
        v
    }
}

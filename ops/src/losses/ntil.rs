//! NTIL (Numerical Token Integrity Loss, Fei et al., ACL 2025) and its token-level part EMD,
//! with the semantics of the official code (xfey/NTIL `NTIL`, `EMD`).
//!
//! Per sequence b: `ℓ_b = α_d·EMD_b + α_abs·abs_b + α_mag·mag_b`, NTIL = mean over sequences.
//! - `EMD_b`: mean over digit positions of `digit_exp^r_t · Σ_k |k − y_t| q_tk`, q = softmax of
//!   the ten digit logits, r_t = digits after t in its number.
//! - `abs_b`, `mag_b`: mean over the sequence's numbers of `|X̂−X|/(max+1)` (0 when equal) and
//!   `ln((max+1)/(min+1))`, X̂ built from straight-through hard Gumbel-softmax digits.
//!
//! The straight-through estimator `onehot − stopgrad(y_soft) + y_soft` needs a tensor
//! stop-gradient, which ONNX lacks. ORT's gradient builder does not differentiate through a
//! Cast to an integer type (`GetStopGradientEdges`: Cast to a non-float type is a stop edge),
//! so `stopgrad(s) = Cast(Cast(s·2^62, INT64), FLOAT)·2^-62`: for s in [0, 1] the scaling is
//! by a power of two (exact) and the integer holds all 24 mantissa bits, so the value is
//! bit-identical for s ≥ 2^-38 and off by < 2^-62 below. This is ORT behaviour, not ONNX
//! semantics; `tests/python/test_ort_training_ntil.py` checks the gradient.

use crate::losses::runs::{self, Digits, Runs};
use crate::losses::SeqInputs;
use crate::numbers::NumberTokens;
use crate::onnx::{int_attr, FLOAT, INT64};
use crate::options::{LossKind, LossOptions};
use crate::Builder;

/// Place exponents are clamped here so `10^r` and sums of up to millions of digits stay
/// finite in float32 (max 3.4e38); numbers of more than 31 digits lose their leading places.
pub const MAX_PLACE_EXPONENT: i64 = 30;

/// The largest exponent r of the token-level place weight `digit_exp^r` (None: no bound is
/// needed, `digit_exp ≤ 1`). The official code takes the power unbounded, which is inf in
/// float32 from a run of 488 digits on (1.2^487) and so makes the loss NaN; clamping r where
/// the weight would pass `10^MAX_PLACE_EXPONENT` keeps the official weights wherever they are
/// at most 1e30 (every run up to 379 digits at the default 1.2) and the loss finite beyond.
pub fn max_weight_exponent(digit_exp: f64) -> Option<i64> {
    let base = digit_exp as f32 as f64; // the graph's (and the official code's) float32 base
    (base > 1.0).then(|| (MAX_PLACE_EXPONENT as f64 * 10f64.ln() / base.ln()).floor() as i64)
}

pub fn build(
    b: &mut Builder,
    seq: &SeqInputs,
    tokens: &NumberTokens,
    opts: &LossOptions,
) -> String {
    let digit_ids = tokens.digits.expect("digit ids resolved for NTIL");
    let n = &opts.ntil;
    let z = runs::digit_logits_btk(b, seq, &digit_ids, "ntil");

    let digits = runs::digits(b, seq, &digit_ids);
    let runs = runs::runs(b, seq, &digits, None);
    let emd = token_level(b, &z, &digits, &runs.digits_after, n.digit_exp);
    let per_sequence = if opts.kind == LossKind::Emd {
        emd
    } else {
        let place = runs::place_values(b, &runs.digits_after, MAX_PLACE_EXPONENT);
        let place = b.binary("Mul", &place, &digits.is_digit, "digit_place");
        let target = number_targets(b, &runs, &digits, &place);
        // The reference draws fresh Gumbel noise for each of the two terms.
        let abs_estimate = number_estimate(
            b,
            &z,
            &digits,
            &runs,
            &place,
            n.gumbel_tau,
            n.gumbel_noise,
            "abs",
        );
        let mag_estimate = if n.gumbel_noise > 0.0 {
            number_estimate(
                b,
                &z,
                &digits,
                &runs,
                &place,
                n.gumbel_tau,
                n.gumbel_noise,
                "mag",
            )
        } else {
            abs_estimate.clone()
        };
        let magnitude = runs::magnitude_scale(b, &runs, MAX_PLACE_EXPONENT);
        let abs = abs_term(b, &abs_estimate, &target, &magnitude, &runs.count);
        let mag = mag_term(b, &mag_estimate, &target, &runs.count);
        let emd = scale(b, &emd, n.digit_alpha, "ntil_emd_weighted");
        let abs = scale(b, &abs, n.abs_alpha, "ntil_abs_weighted");
        let mag = scale(b, &mag, n.mag_alpha, "ntil_mag_weighted");
        let sum = b.binary("Add", &emd, &abs, "ntil_emd_abs");
        b.binary("Add", &sum, &mag, "ntil_per_sequence")
    };
    // Mean over all B sequences; sequences without digits count as 0. (ReduceSum / B: ORT
    // 1.19's ROCm provider has no ReduceMean from opset 18.)
    let total = b.reduce_sum(&per_sequence, &[], false, "ntil_sum");
    let batch = b.cast(&seq.batch, FLOAT, "ntil_batch_f");
    let batch = b.reshape(&batch, &[], "ntil_batch");
    b.binary("Div", &total, &batch, "ntil")
}

fn scale(b: &mut Builder, x: &str, factor: f64, hint: &str) -> String {
    let c = b.scalar_f32(&format!("{hint}_factor"), factor as f32);
    b.binary("Mul", x, &c, hint)
}

/// `[B]`: per sequence, the plain mean over digit positions of `digit_exp^r · EMD_t`.
fn token_level(
    b: &mut Builder,
    z: &str,
    digits: &Digits,
    digits_after: &str,
    digit_exp: f64,
) -> String {
    let q = b.softmax(z, -1, "digit_probs");
    let y = b.unsqueeze(&digits.value, &[2], "label_digit_col");
    let delta = b.binary("Sub", &digits.arange, &y, "digit_delta");
    let dist = b.unary("Abs", &delta, "digit_distance");
    let weighted = b.binary("Mul", &q, &dist, "digit_emd_parts");
    let emd = b.reduce_sum(&weighted, &[2], false, "digit_emd");
    let base = b.scalar_f32("digit_exp", digit_exp as f32);
    let exponent = match max_weight_exponent(digit_exp) {
        Some(max) => {
            let max = b.scalar_f32("digit_exp_max_power", max as f32);
            b.binary("Min", digits_after, &max, "digit_weight_exponent")
        }
        None => digits_after.to_string(),
    };
    let w = b.binary("Pow", &base, &exponent, "digit_place_weight");
    let w = b.binary("Mul", &w, &digits.is_digit, "digit_weight");
    let emd = b.binary("Mul", &emd, &w, "digit_emd_weighted");
    let total = b.reduce_sum(&emd, &[1], false, "digit_emd_sum");
    let count = b.reduce_sum(&digits.is_digit, &[1], false, "digit_count");
    let one = b.scalar_f32("digit_count_floor", 1.0);
    let count = b.binary("Max", &count, &one, "digit_count_at_least_1");
    b.binary("Div", &total, &count, "digit_emd_mean")
}

/// `[B, R]` label numbers X.
fn number_targets(b: &mut Builder, runs: &Runs, digits: &Digits, place: &str) -> String {
    let parts = b.binary("Mul", &digits.value, place, "label_number_parts");
    let parts = b.unsqueeze(&parts, &[1], "label_number_parts_row");
    let spread = b.binary("Mul", &runs.membership, &parts, "label_number_spread");
    b.reduce_sum(&spread, &[2], false, "label_number")
}

/// `[B, R]` predicted numbers X̂ from straight-through hard Gumbel-softmax digits.
#[allow(clippy::too_many_arguments)]
fn number_estimate(
    b: &mut Builder,
    z: &str,
    digits: &Digits,
    runs: &Runs,
    place: &str,
    tau: f64,
    noise: f64,
    hint: &str,
) -> String {
    let noisy = if noise > 0.0 {
        // Gumbel(0,1) = −log(−log U); RandomUniformLike on a label-side tensor (ORT cannot
        // differentiate it on a trainable one). U is floored away from 0 so logs stay finite.
        let u = b.node(
            "RandomUniformLike",
            &[&digits.onehot],
            &format!("{hint}_uniform"),
            vec![int_attr("dtype", FLOAT as i64)],
        );
        let tiny = b.scalar_f32(&format!("{hint}_uniform_floor"), 1e-30);
        let u = b.binary("Max", &u, &tiny, &format!("{hint}_uniform_safe"));
        let e = b.unary("Log", &u, &format!("{hint}_log_u"));
        let e = b.unary("Neg", &e, &format!("{hint}_exponential"));
        let g = b.unary("Log", &e, &format!("{hint}_log_e"));
        let g = b.unary("Neg", &g, &format!("{hint}_gumbel"));
        let g = scale(b, &g, noise, &format!("{hint}_gumbel_scaled"));
        b.binary("Add", z, &g, &format!("{hint}_noisy_logits"))
    } else {
        z.to_string()
    };
    let tau = b.scalar_f32(&format!("{hint}_tau"), tau as f32);
    let tempered = b.binary("Div", &noisy, &tau, &format!("{hint}_tempered"));
    let soft = b.softmax(&tempered, -1, &format!("{hint}_soft_digits"));
    let index = b.argmax_last(&soft, &format!("{hint}_argmax"));
    let depth = b.const_i64(&format!("{hint}_depth"), &[], &[10]);
    let onoff = b.const_f32(&format!("{hint}_onoff"), &[2], &[0.0, 1.0]);
    let hard = b.node(
        "OneHot",
        &[&index, &depth, &onoff],
        &format!("{hint}_hard_digits"),
        vec![int_attr("axis", -1)],
    );
    let frozen = stop_gradient_unit(b, &soft, &format!("{hint}_soft_frozen"));
    let st = b.binary("Sub", &hard, &frozen, &format!("{hint}_st_delta"));
    let st = b.binary("Add", &st, &soft, &format!("{hint}_st_digits"));
    let value = b.binary(
        "Mul",
        &st,
        &digits.arange,
        &format!("{hint}_digit_value_parts"),
    );
    let value = b.reduce_sum(&value, &[2], false, &format!("{hint}_digit_value"));
    let contrib = b.binary("Mul", &value, place, &format!("{hint}_number_parts"));
    let contrib = b.unsqueeze(&contrib, &[2], &format!("{hint}_number_parts_col"));
    let number = b.binary(
        "MatMul",
        &runs.membership,
        &contrib,
        &format!("{hint}_number_col"),
    );
    b.squeeze(&number, &[2], &format!("{hint}_number"))
}

/// Value-preserving, gradient-stopping copy of a tensor with values in [0, 1] (see module doc).
fn stop_gradient_unit(b: &mut Builder, x: &str, hint: &str) -> String {
    let up = b.scalar_f32(&format!("{hint}_up"), 2f32.powi(62));
    let down = b.scalar_f32(&format!("{hint}_down"), 2f32.powi(-62));
    let scaled = b.binary("Mul", x, &up, &format!("{hint}_scaled"));
    let int = b.cast(&scaled, INT64, &format!("{hint}_int"));
    let back = b.cast(&int, FLOAT, &format!("{hint}_float"));
    b.binary("Mul", &back, &down, hint)
}

/// `[B]`: mean over numbers of `|X̂−X| / (max(X̂,X) + 1)`, 0 where X̂ = X. Numerator and
/// denominator are multiplied by `scale` (see `runs::magnitude_scale`).
fn abs_term(b: &mut Builder, est: &str, target: &str, scale: &str, count: &str) -> String {
    let one = b.scalar_f32("abs_one", 1.0);
    let zero = b.scalar_f32("abs_zero", 0.0);
    let diff = b.binary("Sub", est, target, "abs_diff");
    let diff = b.unary("Abs", &diff, "abs_diff_abs");
    let hi = b.binary("Max", est, target, "abs_max");
    let hi = b.binary("Add", &hi, &one, "abs_max_plus_1");
    let diff = b.binary("Mul", &diff, scale, "abs_diff_scaled");
    let hi = b.binary("Mul", &hi, scale, "abs_max_scaled");
    let rel = b.binary("Div", &diff, &hi, "abs_relative");
    let same = b.equal(est, target, "abs_exact");
    let rel = b.where_(&same, &zero, &rel, "abs_per_number");
    mean_over_numbers(b, &rel, count, "abs")
}

/// `[B]`: mean over numbers of `ln((max(X̂,X)+1) / (min(X̂,X)+1))`, taken as
/// `ln(max+1) − ln(min+1)`: a ratio's `DivGrad` forms `hi/lo²`, which overflows (to NaN after
/// Min's gradient mask) once a prediction of 31 digits meets a label of zeros (`lo` = 1, scaled
/// to 10^-15.5); each logarithm's gradient is at most 1.
fn mag_term(b: &mut Builder, est: &str, target: &str, count: &str) -> String {
    let one = b.scalar_f32("mag_one", 1.0);
    let hi = b.binary("Max", est, target, "mag_max");
    let hi = b.binary("Add", &hi, &one, "mag_max_plus_1");
    let lo = b.binary("Min", est, target, "mag_min");
    let lo = b.binary("Add", &lo, &one, "mag_min_plus_1");
    let hi = b.unary("Log", &hi, "mag_log_max");
    let lo = b.unary("Log", &lo, "mag_log_min");
    let mag = b.binary("Sub", &hi, &lo, "mag_per_number");
    mean_over_numbers(b, &mag, count, "mag")
}

/// Padding runs (beyond a sequence's count) have X̂ = X = 0 and contribute exactly 0.
fn mean_over_numbers(b: &mut Builder, per_number: &str, count: &str, hint: &str) -> String {
    let total = b.reduce_sum(per_number, &[1], false, &format!("{hint}_sum"));
    let one = b.scalar_f32(&format!("{hint}_count_floor"), 1.0);
    let count = b.binary("Max", count, &one, &format!("{hint}_count_at_least_1"));
    b.binary("Div", &total, &count, &format!("{hint}_mean"))
}

//! NTL (Number Token Loss, Zausinger et al., ICML 2025) as standard ONNX ops, with the
//! semantics of PyPI `ntloss` 0.3.2 (`NTLoss`, `NTLossDotProduct`, reduction `mean`).
//!
//! Only ops ONNX Runtime Training differentiates sit between the logits and the loss
//! (Gather, Softmax, Mul, Sub, Abs, Pow, Where, ReduceSum, Add, Div, Max); the label side
//! (Equal, Cast, Not) carries no gradient.

use crate::losses::FlatInputs;
use crate::numbers::NumberTable;
use crate::onnx::FLOAT;
use crate::options::{LossKind, LossOptions};
use crate::Builder;

/// `torch.finfo(torch.float32).eps`, ntloss's floor for the mean's denominator.
const F32_EPS: f32 = f32::EPSILON;

/// Emits the unweighted number loss (a float32 scalar) and returns its tensor name.
pub fn build(b: &mut Builder, inp: &FlatInputs, table: &NumberTable, opts: &LossOptions) -> String {
    let values: Vec<f32> = table.values().iter().map(|&v| v as f32).collect();
    let k = values.len() as i64;
    let ids = b.const_i64("number_ids", &[k], table.ids());
    let vals = b.const_f32("number_values", &[1, k], &values);

    // p = softmax over the number-token logits only (renormalised), [M, K].
    let number_logits = b.gather(&inp.logits, &ids, 1, "number_logits");
    let p = b.softmax(&number_logits, 1, "number_probs");

    let labels = LabelSide::build(b, inp, &ids, &vals);

    let per_position = match opts.kind {
        LossKind::Wasserstein => {
            let dist = b.binary("Sub", &vals, &labels.value_col, "label_delta");
            let mut dist = b.unary("Abs", &dist, "label_distance");
            if let Some(s) = opts.squash {
                dist = squash(b, &dist, &values, s);
            }
            let weighted = b.binary("Mul", &p, &dist, "weighted_distance");
            b.reduce_sum(&weighted, &[1], false, "wasserstein")
        }
        LossKind::Mse | LossKind::L1 | LossKind::Huber => {
            let weighted = b.binary("Mul", &p, &vals, "weighted_values");
            let predicted = b.reduce_sum(&weighted, &[1], true, "expected_value");
            let diff = b.binary("Sub", &predicted, &labels.value_col, "prediction_error");
            let err = match opts.kind {
                LossKind::Mse => squared(b, &diff),
                LossKind::L1 => b.unary("Abs", &diff, "absolute_error"),
                _ => huber(b, &diff),
            };
            b.reduce_sum(&err, &[1], false, "position_loss")
        }
        _ => {
            unreachable!("built in their own modules")
        }
    };

    let per_position = if opts.reweigh {
        reweigh(b, inp, &ids, &per_position, max_distance(opts, &values))
    } else {
        per_position
    };

    // mean over number positions: Σ w ℓ / max(Σ w, eps) — exactly 0 when no label is a number.
    let masked = b.binary("Mul", &per_position, &labels.is_number, "masked_loss");
    let total = b.reduce_sum(&masked, &[], false, "loss_sum");
    let count = b.reduce_sum(&labels.is_number, &[], false, "number_count");
    let eps = b.scalar_f32("eps", F32_EPS);
    let count = b.binary("Max", &count, &eps, "number_count_floor");
    b.binary("Div", &total, &count, "number_loss_mean")
}

/// Label-side tensors: which positions are number labels and their values.
struct LabelSide {
    /// `[M]` float: 1 where the label is a number token (and not the ignore index), else 0.
    is_number: String,
    /// `[M, 1]` float: the label's value (0 where it is not a number).
    value_col: String,
}

impl LabelSide {
    fn build(b: &mut Builder, inp: &FlatInputs, ids: &str, vals: &str) -> LabelSide {
        let labels_col = b.unsqueeze(&inp.labels, &[1], "labels_col");
        let onehot = b.equal(&labels_col, ids, "label_is_token");
        let onehot = b.cast(&onehot, FLOAT, "label_onehot");
        let mut is_number = b.reduce_sum(&onehot, &[1], false, "label_is_number");
        if let Some(ignore) = inp.ignore_index.filter(|&i| i >= 0) {
            // ntloss masks the ignore index before the lookup; only a non-negative one can hit a token.
            let ignore = b.const_i64("ignore_index", &[], &[ignore]);
            let ignored = b.equal(&inp.labels, &ignore, "label_ignored");
            let kept = b.unary("Not", &ignored, "label_kept");
            let kept = b.cast(&kept, FLOAT, "label_kept_f");
            is_number = b.binary("Mul", &is_number, &kept, "label_is_counted");
        }
        let value = b.binary("Mul", &onehot, vals, "label_value_parts");
        let value_col = b.reduce_sum(&value, &[1], true, "label_value");
        LabelSide {
            is_number,
            value_col,
        }
    }
}

fn squared(b: &mut Builder, x: &str) -> String {
    let two = b.scalar_f32("two", 2.0);
    b.binary("Pow", x, &two, "squared_error")
}

/// Huber with δ = 1 (torch's default): ½d² where |d| < 1, else |d| − ½.
fn huber(b: &mut Builder, diff: &str) -> String {
    let abs = b.unary("Abs", diff, "absolute_error");
    let one = b.scalar_f32("one", 1.0);
    let half = b.scalar_f32("half", 0.5);
    let small = b.binary("Less", &abs, &one, "huber_is_quadratic");
    let sq = squared(b, diff);
    let quadratic = b.binary("Mul", &sq, &half, "huber_quadratic");
    let linear = b.binary("Sub", &abs, &half, "huber_linear");
    b.where_(&small, &quadratic, &linear, "huber_error")
}

/// ntloss `squash_factor`: non-zero distances map linearly onto [1, s].
fn squash(b: &mut Builder, dist: &str, values: &[f32], s: f64) -> String {
    let (min_nz, max) = distance_range(values);
    // one distinct non-zero distance (or none): every non-zero distance maps to 1, as a
    // zero-width range would otherwise divide by zero and write inf (0·inf = NaN)
    let scale = if max > min_nz {
        (s as f32 - 1.0) / (max - min_nz)
    } else {
        0.0
    };
    let scale = if scale.is_finite() { scale } else { 0.0 };
    let min_c = b.scalar_f32("squash_min", min_nz);
    let scale_c = b.scalar_f32("squash_scale", scale);
    let one = b.scalar_f32("squash_one", 1.0);
    let zero = b.scalar_f32("squash_zero", 0.0);
    let shifted = b.binary("Sub", dist, &min_c, "squash_shifted");
    let scaled = b.binary("Mul", &shifted, &scale_c, "squash_scaled");
    let squashed = b.binary("Add", &scaled, &one, "squash_value");
    let exact = b.equal(dist, &zero, "squash_exact");
    b.where_(&exact, &zero, &squashed, "squashed_distance")
}

/// The largest magnitude a number token's value may have for this loss; larger ones are left
/// out of the number set (`NumberTable::build_within`). The graph holds the values in float32
/// and forms distances `|v − y|` (up to 2c for |v| ≤ c) or, for MSE, squared errors (up to 4c²),
/// times 1.01 with `--reweigh` and λ in the total. That largest loss, times max(λ, 1), is kept
/// below 2^60 in float32 and bfloat16 graphs, so the loss, its sum over any batch and its
/// square (AdamW's second moment, a gradient norm) stay finite in float32, and below 2^15 where
/// the total is float16 (whose largest value is 65504).
pub fn value_limit(kind: LossKind, weight: f64, total_type: i32) -> f64 {
    let largest_loss = if total_type == crate::onnx::FLOAT16 {
        2f64.powi(15)
    } else {
        2f64.powi(60)
    } / (1.01 * weight.max(1.0));
    match kind {
        LossKind::Mse => (largest_loss / 4.0).sqrt(),
        // Huber is linear beyond 1; the per-sequence losses read the digits 0..9 only
        _ => largest_loss / 2.0,
    }
}

/// Smallest non-zero and largest pairwise distance between number values, in float32 as ntloss.
pub fn distance_range(values: &[f32]) -> (f32, f32) {
    let mut min_nz = f32::MAX;
    let mut max = 0f32;
    for a in values {
        for c in values {
            let d = (a - c).abs();
            if d > 0.0 {
                min_nz = min_nz.min(d);
            }
            max = max.max(d);
        }
    }
    (min_nz, max)
}

/// ntloss `max_dist`: the largest value the per-position loss can take.
pub fn max_distance(opts: &LossOptions, values: &[f32]) -> f32 {
    let lo = values.iter().cloned().fold(f32::INFINITY, f32::min);
    let hi = values.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let d = hi - lo;
    match opts.kind {
        LossKind::Wasserstein => opts.squash.map_or(d, |s| s as f32),
        LossKind::Mse => d * d,
        LossKind::L1 => d,
        LossKind::Huber if d < 1.0 => 0.5 * d * d,
        LossKind::Huber => d - 0.5,
        _ => unreachable!("not an NTL loss"),
    }
}

/// ntloss `reweigh`: `ℓ·m + 1.01·max_dist·(1 − m)`, m = full-softmax mass on number tokens.
fn reweigh(b: &mut Builder, inp: &FlatInputs, ids: &str, loss: &str, max_dist: f32) -> String {
    let probs = b.softmax(&inp.logits, 1, "vocab_probs");
    let number_probs = b.gather(&probs, ids, 1, "vocab_number_probs");
    let mass = b.reduce_sum(&number_probs, &[1], false, "number_mass");
    let one = b.scalar_f32("reweigh_one", 1.0);
    let penalty = b.scalar_f32("reweigh_penalty", 1.01 * max_dist);
    let scaled = b.binary("Mul", loss, &mass, "reweigh_scaled");
    let rest = b.binary("Sub", &one, &mass, "non_number_mass");
    let extra = b.binary("Mul", &rest, &penalty, "reweigh_extra");
    b.binary("Add", &scaled, &extra, "reweighed_loss")
}

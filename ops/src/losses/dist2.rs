//! DIST2Loss (Chung et al., "Teaching Metric Distance to Discrete Autoregressive Language
//! Models", ICLR 2026) as the implementation the DEL authors compare against computes it:
//! `DIST2loss` in GitHub PolyU-VCLab/DEL `train-qwen-deepseek.py` (commit 68c3d4d).
//!
//! Per digit label y_t (one of the ten tokens "0".."9"), with `q_t = softmax(z_t[digits])`:
//! `ℓ_t = place_t · KL(T_y ‖ q_t)`, `T_y = softmax_k(−(y − k)²/τ)`, place_t = the digit's place
//! counted from the right within its number (units 1, tens 2, ...; a number is a maximal run
//! of digit labels of one sequence, so "." splits "3.14" into 3 and 14). The loss is the mean
//! of ℓ_t over the digit labels of the batch, 0 without any.
//!
//! `KL(T ‖ q) = Σ_k T_k ln T_k − Σ_k T_k ln q_k`: the first sum is a label-side constant per
//! digit, the second reads `LogSoftmax` of the ten gathered logits (one sparse gradient).

use crate::losses::runs::{self, Digits};
use crate::losses::SeqInputs;
use crate::numbers::NumberTokens;
use crate::onnx::INT64;
use crate::options::LossOptions;
use crate::Builder;

pub fn build(
    b: &mut Builder,
    seq: &SeqInputs,
    tokens: &NumberTokens,
    opts: &LossOptions,
) -> String {
    let digit_ids = tokens.digits.expect("digit ids resolved for dist2");
    let z = runs::digit_logits_btk(b, seq, &digit_ids, "dist2");
    let log_q = b.node(
        "LogSoftmax",
        &[&z],
        "digit_log_probs",
        vec![crate::onnx::int_attr("axis", -1)],
    );

    let digits = runs::digits(b, seq, &digit_ids);
    let place = integer_places(b, &digits);

    // The target row of each label digit and its Σ T ln T, picked by the label one-hot.
    let (table, neg_entropy) = targets(opts.dist2.tau);
    let table = b.const_f32("dist2_targets", &[10, 10], &table);
    let neg_entropy = b.const_f32("dist2_target_neg_entropy", &[10, 1], &neg_entropy);
    let target = b.binary("MatMul", &digits.onehot, &table, "dist2_target");
    let constant = b.binary("MatMul", &digits.onehot, &neg_entropy, "dist2_target_term");
    let constant = b.squeeze(&constant, &[2], "dist2_target_term_bt");
    let cross = b.binary("Mul", &target, &log_q, "dist2_cross_parts");
    let cross = b.reduce_sum(&cross, &[2], false, "dist2_cross");
    let kl = b.binary("Sub", &constant, &cross, "dist2_kl");
    let weighted = b.binary("Mul", &kl, &place, "dist2_weighted");
    mean_over_digits(b, &weighted, &digits, "dist2")
}

/// `[B, T]` float: the place of each digit label within its run, counted from the right
/// (units 1, tens 2, ...), 0 elsewhere.
fn integer_places(b: &mut Builder, digits: &Digits) -> String {
    let member = b.cast(&digits.is_digit, INT64, "dist2_member");
    let groups = runs::groups(b, &member);
    let last = groups.last_pos(b, "dist2_last");
    let after = b.binary("Sub", &last, &groups.pos_f, "dist2_digits_after");
    let one = b.scalar_f32("dist2_one", 1.0);
    let place = b.binary("Add", &after, &one, "dist2_place_raw");
    b.binary("Mul", &place, &digits.is_digit, "dist2_place")
}

/// `Σ x / max(#digit labels, 1)`: 0 when no label is a digit.
pub fn mean_over_digits(b: &mut Builder, x: &str, digits: &Digits, hint: &str) -> String {
    let total = b.reduce_sum(x, &[], false, &format!("{hint}_sum"));
    let count = b.reduce_sum(&digits.is_digit, &[], false, &format!("{hint}_count"));
    let one = b.scalar_f32(&format!("{hint}_count_floor"), 1.0);
    let count = b.binary("Max", &count, &one, &format!("{hint}_count_at_least_1"));
    b.binary("Div", &total, &count, hint)
}

/// Row y: the target `softmax_k(−(y − k)²/τ)` as float32 (the reference computes it in
/// float32); and `Σ_k T_yk ln T_yk` of those float32 values (its KL promotes them to the
/// logits' type), with `0 ln 0 = 0`.
pub fn targets(tau: f64) -> (Vec<f32>, Vec<f32>) {
    let mut table = Vec::with_capacity(100);
    let mut neg_entropy = Vec::with_capacity(10);
    for y in 0..10i32 {
        let e: Vec<f64> = (0..10i32)
            .map(|k| (-((y - k) as f64).powi(2) / tau).exp())
            .collect();
        let z: f64 = e.iter().sum();
        let row: Vec<f32> = e.iter().map(|v| (v / z) as f32).collect();
        let h: f64 = row
            .iter()
            .filter(|&&t| t > 0.0)
            .map(|&t| t as f64 * (t as f64).ln())
            .sum();
        table.extend(row);
        neg_entropy.push(h as f32);
    }
    (table, neg_entropy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_distributions_peaked_at_the_label() {
        let (t, h) = targets(1.0);
        for y in 0..10 {
            let row = &t[y * 10..(y + 1) * 10];
            let s: f32 = row.iter().sum();
            assert!((s - 1.0).abs() < 1e-6);
            let best = (0..10).max_by(|&a, &c| row[a].total_cmp(&row[c])).unwrap();
            assert_eq!(best, y);
            assert!(h[y] < 0.0);
        }
        // softmax(-d²) at d = 0 for an interior digit: 1 / (1 + 2e^-1 + 2e^-4 + ...)
        let z: f64 = (-9i32..=0).map(|d| (-(d * d) as f64).exp()).sum::<f64>()
            + (1..=4).map(|d: i32| (-(d * d) as f64).exp()).sum::<f64>();
        assert!((t[5 * 10 + 5] as f64 - 1.0 / z).abs() < 1e-7);
        // a tiny τ underflows the far entries to exactly 0, which count as 0 ln 0 = 0
        let (t, h) = targets(1e-3);
        assert_eq!(t[0], 1.0);
        assert!(h.iter().all(|v| v.is_finite()));
    }
}

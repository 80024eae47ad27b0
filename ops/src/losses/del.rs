//! DEL (Zheng et al., "DEL: Digit Entropy Loss for Numerical Learning of Large Language
//! Models", 2026) as its authors' code computes it: `DEL` in GitHub PolyU-VCLab/DEL
//! `train-qwen-deepseek.py` (commit 68c3d4d).
//!
//! Per digit label y_t, with z_t the ten digit logits and `p_t = softmax(z_t)`:
//! `c_t = Σ_k BCEWithLogits(z_tk, [k = y_t]) · p_tk` (the softmax is not detached), and
//! `DEL = 0.01 · Σ_t place_t·c_t / (10 · #digit labels)` (the reference's `.mean()` over
//! `[#digits, 10]`), 0 without digit labels. Places (`generate_place`): a number is a maximal
//! run of digit and `"."` labels of one sequence; before its first `"."` a digit weighs
//! `2 · (positions up to that dot)` (units 2, tens 4, ...), after it `1.02^−(m+1)` for the
//! m-th position after the dot; a number without a dot (or starting with one) weighs
//! `2 · (positions up to its end)`.
//!
//! `BCEWithLogits(x, t) = −[t·ln σ(x) + (1−t)·ln σ(−x)]`, and `(ln σ(x), ln σ(−x))` is
//! `LogSoftmax` of the pair `(x, 0)`: exact, finite for every x, smooth at 0, and made of ops
//! ONNX Runtime Training differentiates (Softplus is not among them).

use crate::losses::dist2::mean_over_digits;
use crate::losses::runs::{self, Digits};
use crate::losses::SeqInputs;
use crate::numbers::NumberTokens;
use crate::onnx::{int_attr, FLOAT, INT64};
use crate::Builder;

/// The reference's factor in front of the mean, and the base of the fraction weights.
const SCALE: f32 = 0.01;
const FRACTION_BASE: f32 = 1.02;

pub fn build(b: &mut Builder, seq: &SeqInputs, tokens: &NumberTokens) -> String {
    let digit_ids = tokens.digits.expect("digit ids resolved for del");
    let z = runs::digit_logits_btk(b, seq, &digit_ids, "del");
    let p = b.softmax(&z, -1, "digit_probs");

    let digits = runs::digits(b, seq, &digit_ids);
    let bce = bce_with_logits(b, &z, &digits);
    let criterion = b.binary("Mul", &bce, &p, "del_criterion");
    let per_position = b.reduce_sum(&criterion, &[2], false, "del_per_position");
    let place = places(b, seq, &digits, tokens.dot);
    let weighted = b.binary("Mul", &per_position, &place, "del_weighted");
    let mean = mean_over_digits(b, &weighted, &digits, "del_position_mean");
    // .mean() over [#digits, 10] and the factor 0.01
    let scale = b.scalar_f32("del_scale", SCALE / 10.0);
    b.binary("Mul", &mean, &scale, "del")
}

/// `[B, T, 10]`: `BCEWithLogits(z, onehot(y))` elementwise, as `−Σ_j w_j·LogSoftmax(z, 0)_j`
/// with `w = (onehot, 1 − onehot)`.
fn bce_with_logits(b: &mut Builder, z: &str, digits: &Digits) -> String {
    let target = b.unsqueeze(&digits.onehot, &[3], "del_target");
    let zero = b.scalar_f32("del_zero", 0.0);
    let zeros = b.binary("Mul", &target, &zero, "del_pair_zeros");
    let z = b.unsqueeze(z, &[3], "del_logit_col");
    let pair = b.concat(&[&z, &zeros], 3, "del_logit_pair");
    let log_sigmoid = b.node(
        "LogSoftmax",
        &[&pair],
        "del_log_sigmoid_pair",
        vec![int_attr("axis", 3)],
    );
    let one = b.scalar_f32("del_one", 1.0);
    let other = b.binary("Sub", &one, &target, "del_target_other");
    let weights = b.concat(&[&target, &other], 3, "del_target_pair");
    let picked = b.binary("Mul", &log_sigmoid, &weights, "del_log_likelihood_parts");
    let log_likelihood = b.reduce_sum(&picked, &[3], false, "del_log_likelihood");
    b.unary("Neg", &log_likelihood, "del_bce")
}

/// `[B, T]` float: `generate_place`'s weight of each digit label (0 elsewhere).
fn places(b: &mut Builder, seq: &SeqInputs, digits: &Digits, dot: Option<i64>) -> String {
    let is_digit = b.cast(&digits.is_digit, INT64, "del_is_digit");
    let Some(dot) = dot else {
        // no "." token: every number is a digit run
        let groups = runs::groups(b, &is_digit);
        let whole = to_end(b, &groups, "del_whole");
        return b.binary("Mul", &whole, &digits.is_digit, "del_place");
    };
    let dot = b.const_i64("del_dot_id", &[], &[dot]);
    let is_dot = b.equal(&seq.labels, &dot, "del_is_dot_b");
    let is_dot = b.cast(&is_dot, INT64, "del_is_dot");
    let member = b.binary("Add", &is_digit, &is_dot, "del_member");
    let groups = runs::groups(b, &member);

    // The group's first dot: a dot with no dot of its group before it.
    let axis = b.const_i64("del_axis", &[], &[1]);
    let dots = b.node("CumSum", &[&is_dot, &axis], "del_dots_through", vec![]);
    let before = b.binary("Sub", &dots, &is_dot, "del_dots_before");
    let before = b.cast(&before, FLOAT, "del_dots_before_f");
    let before_group = groups.spread(b, &before, &groups.first, "del_dots_before_group");
    let none_before = b.equal(&before, &before_group, "del_first_dot_of_group_b");
    let none_before = b.cast(&none_before, INT64, "del_first_dot_of_group_i");
    let first_dot = b.binary("Mul", &is_dot, &none_before, "del_first_dot");
    let dot_pos = groups.spread(b, &groups.pos_f, &first_dot, "del_dot_pos");
    let one = b.scalar_f32("del_place_one", 1.0);
    let zero = b.scalar_f32("del_place_zero", 0.0);
    let ones = b.binary("Mul", &digits.is_digit, &zero, "del_zeros");
    let ones = b.binary("Add", &ones, &one, "del_ones");
    let has_dot = groups.spread(b, &ones, &first_dot, "del_has_dot");
    let start = groups.spread(b, &groups.pos_f, &groups.first, "del_start");

    // A dot at the group's start counts as none (the reference's argmax is then 0).
    let inner = b.binary("Greater", &dot_pos, &start, "del_dot_inside_b");
    let inner = b.cast(&inner, FLOAT, "del_dot_inside");
    let split = b.binary("Mul", &has_dot, &inner, "del_split");
    let before_dot = b.binary("Less", &groups.pos_f, &dot_pos, "del_before_dot_b");
    let before_dot = b.cast(&before_dot, FLOAT, "del_before_dot_f");
    let before_dot = b.binary("Mul", &before_dot, &split, "del_before_dot");
    let after_dot = b.binary("Greater", &groups.pos_f, &dot_pos, "del_after_dot_b");
    let after_dot = b.cast(&after_dot, FLOAT, "del_after_dot_f");
    let after_dot = b.binary("Mul", &after_dot, &split, "del_after_dot");

    let whole = to_end(b, &groups, "del_whole");
    let unsplit = b.binary("Sub", &one, &split, "del_unsplit");
    let whole = b.binary("Mul", &whole, &unsplit, "del_whole_numbers");
    let two = b.scalar_f32("del_two", 2.0);
    let integer = b.binary("Sub", &dot_pos, &groups.pos_f, "del_to_dot");
    let integer = b.binary("Mul", &integer, &two, "del_integer_place");
    let integer = b.binary("Mul", &integer, &before_dot, "del_integer_digits");
    // m-th position after the dot: 1.02^−(m+1); exponent 0 elsewhere keeps Pow finite
    let m = b.binary("Sub", &groups.pos_f, &dot_pos, "del_after");
    let m = b.binary("Add", &m, &one, "del_after_plus_1");
    let m = b.binary("Mul", &m, &after_dot, "del_fraction_exponent");
    let m = b.unary("Neg", &m, "del_fraction_neg_exponent");
    let base = b.scalar_f32("del_fraction_base", FRACTION_BASE);
    let fraction = b.binary("Pow", &base, &m, "del_fraction_place");
    let fraction = b.binary("Mul", &fraction, &after_dot, "del_fraction_digits");
    let place = b.binary("Add", &whole, &integer, "del_place_whole_integer");
    let place = b.binary("Add", &place, &fraction, "del_place_all");
    b.binary("Mul", &place, &digits.is_digit, "del_place")
}

/// `[B, T]` float: `2 · (positions from t to its group's end)`.
fn to_end(b: &mut Builder, groups: &runs::Groups, hint: &str) -> String {
    let last = groups.last_pos(b, &format!("{hint}_last"));
    let after = b.binary("Sub", &last, &groups.pos_f, &format!("{hint}_after"));
    let one = b.scalar_f32(&format!("{hint}_one"), 1.0);
    let count = b.binary("Add", &after, &one, &format!("{hint}_count"));
    let two = b.scalar_f32(&format!("{hint}_two"), 2.0);
    b.binary("Mul", &count, &two, hint)
}

//! ntloss 0.3.2 `NumberLevelLoss`: whole numbers from expected digits.
//!
//! Per position `ŷ_t = Σ_k p_tk·k` (p = softmax over the ten digit logits). Each number (a
//! maximal digit run; with `float_level` a `"."` between digits joins) gives
//! `Ŷ = Σ ŷ_t·10^e_t`, `Y` likewise from the labels, and `ℓ = |Ŷ−Y| / (|Ŷ|+|Y|+eps)`; the loss
//! is the mean over all numbers of the batch (0 when there is none). Exponents are clamped
//! at 19, ntloss's `max_number_length − 1`.

use crate::losses::{runs, SeqInputs};
use crate::numbers::NumberTokens;
use crate::options::LossOptions;
use crate::Builder;

const MAX_EXPONENT: i64 = 19;

pub fn build(
    b: &mut Builder,
    seq: &SeqInputs,
    tokens: &NumberTokens,
    opts: &LossOptions,
) -> String {
    let digit_ids = tokens.digits.expect("digit ids resolved for number-level");
    let digit_logits = runs::digit_logits(b, seq, &digit_ids, "nl");
    let p = b.softmax(&digit_logits, 1, "digit_probs");

    let digits = runs::digits(b, seq, &digit_ids);
    let dot = if opts.float_level { tokens.dot } else { None };
    let runs = runs::runs(b, seq, &digits, dot);
    let place = runs::place_values(b, &runs.digits_after, MAX_EXPONENT);
    let place = b.binary("Mul", &place, &digits.is_digit, "digit_place");

    // Expected digit per position, regrouped to [B, T].
    let expected = b.binary("Mul", &p, &digits.arange, "expected_digit_parts");
    let expected = b.reduce_sum(&expected, &[1], false, "expected_digit");
    let shape = b.const_i64("minus_one", &[1], &[-1]);
    let shape = b.concat(&[&seq.batch, &shape], 0, "bt_shape");
    let expected = b.node("Reshape", &[&expected, &shape], "expected_digit_bt", vec![]);

    let predicted = group(b, &runs.membership, &expected, &place, "predicted_number");
    let target = group(b, &runs.membership, &digits.value, &place, "label_number");

    let diff = b.binary("Sub", &predicted, &target, "number_diff");
    let diff = b.unary("Abs", &diff, "number_abs_diff");
    let a = b.unary("Abs", &predicted, "predicted_abs");
    let c = b.unary("Abs", &target, "label_abs");
    let denom = b.binary("Add", &a, &c, "number_scale");
    let eps = b.scalar_f32("number_eps", f32::EPSILON);
    let denom = b.binary("Add", &denom, &eps, "number_scale_eps");
    // Keep the denominator's square finite for ORT's DivGrad (see runs::magnitude_scale).
    let scale = runs::magnitude_scale(b, &runs, MAX_EXPONENT);
    let diff = b.binary("Mul", &diff, &scale, "number_diff_scaled");
    let denom = b.binary("Mul", &denom, &scale, "number_scale_scaled");
    let mut per_number = b.binary("Div", &diff, &denom, "number_smape");

    if opts.reweigh {
        per_number = reweigh(b, seq, tokens, &runs, &per_number);
    }

    let masked = b.binary("Mul", &per_number, &runs.exists, "number_loss_masked");
    let total = b.reduce_sum(&masked, &[], false, "number_loss_sum");
    let count = b.reduce_sum(&runs.exists, &[], false, "number_count");
    let floor = b.scalar_f32("number_count_floor", f32::EPSILON);
    let count = b.binary("Max", &count, &floor, "number_count_safe");
    b.binary("Div", &total, &count, "number_level")
}

/// `[B, R]`: `Σ_t membership[b, r, t]·x[b, t]·place[b, t]` (differentiable in x).
fn group(b: &mut Builder, membership: &str, x: &str, place: &str, hint: &str) -> String {
    let parts = b.binary("Mul", x, place, &format!("{hint}_parts"));
    let parts = b.unsqueeze(&parts, &[2], &format!("{hint}_parts_col"));
    let grouped = b.binary("MatMul", membership, &parts, &format!("{hint}_col"));
    b.squeeze(&grouped, &[2], hint)
}

/// ntloss `reweigh` with `max_dist = 1`: the mass on number tokens at each number's first digit.
fn reweigh(
    b: &mut Builder,
    seq: &SeqInputs,
    tokens: &NumberTokens,
    runs: &runs::Runs,
    loss: &str,
) -> String {
    let ids = b.const_i64(
        "nl_number_ids",
        &[tokens.table.len() as i64],
        tokens.table.ids(),
    );
    let probs = b.softmax(&seq.logits, 1, "vocab_probs");
    let number_probs = b.gather(&probs, &ids, 1, "vocab_number_probs");
    let mass = b.reduce_sum(&number_probs, &[1], false, "number_mass");
    let shape = b.const_i64("mass_minus_one", &[1], &[-1]);
    let shape = b.concat(&[&seq.batch, &shape], 0, "mass_bt_shape");
    let mass = b.node("Reshape", &[&mass, &shape], "number_mass_bt", vec![]);
    let at_start = b.binary("Mul", &mass, &runs.first_digit, "number_mass_at_start");
    let at_start = b.unsqueeze(&at_start, &[2], "number_mass_col");
    // Only each run's first digit carries mass, so the run sum picks exactly that position.
    let m = b.binary("MatMul", &runs.membership, &at_start, "run_mass_col");
    let m = b.squeeze(&m, &[2], "run_mass");
    let one = b.scalar_f32("reweigh_one", 1.0);
    let penalty = b.scalar_f32("reweigh_penalty", 1.01);
    let scaled = b.binary("Mul", loss, &m, "reweigh_scaled");
    let rest = b.binary("Sub", &one, &m, "non_number_mass");
    let extra = b.binary("Mul", &rest, &penalty, "reweigh_extra");
    b.binary("Add", &scaled, &extra, "reweighed_loss")
}

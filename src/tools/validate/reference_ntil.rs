//! An independent implementation of the per-sequence losses: plain loops in f64 over the flat
//! logits `[B·T, V]` (row `b·T + t`) and the labels regrouped as `[B, T]`.
//!
//! - NTIL and EMD as the official code computes them (github.com/xfey/NTIL, commit `864abaa`,
//!   `ntil.py` `NTIL.compute_emd_with_tokenizer`, `emd.py` `EMD`), with the Gumbel noise at 0:
//!   the straight-through digits are then the one-hot argmax (first maximum on ties).
//! - ntloss 0.3.2 `NumberLevelLoss.forward(logits, labels, reduction="mean")`
//!   (`ntloss/core.py`: `_prepare_number_token_targets`, `_get_dot_product`,
//!   `convert_digits_to_numbers`, `reweigh_fn`, `_apply_reduction`).
//!
//! Like `reference.rs`, it shares no code with `ntl_ops`: a bug there must show up as a
//! mismatch here. It takes the digit token ids from the tokenizer (the caller's `Vocab`).
//!
//! Where the references compute in float32, this module follows their float32 *constants*
//! and keeps everything else in f64:
//! - NTIL's place weight `digit_exp ** r` is float32 in the official code (`1.2 ** int
//!   tensor`): the base is the float32 `digit_exp` (1.2 is 1.2000000477), which is what makes
//!   `1.2^19` 7.8e-7 relative high there; the power itself is taken in f64 here.
//! - NTIL's place values `10.0 ** i` are a float32 tensor: the float32-rounded powers of ten
//!   are used here. Exponents are clamped at [`NTIL_MAX_PLACE_EXPONENT`] = 30 as ntl-patch
//!   documents (the official code overflows float32 from 10^39 on, so numbers of more than 31
//!   digits have no finite official value anyway).
//! - ntloss keeps its label values and powers of ten in float32 (`number_values`,
//!   `powers_of_10`), so the label number `Y` is a float32 sum of float32 products, and the
//!   `eps` of `|Ŷ−Y| / (|Ŷ|+|Y|+eps)` is float32's; `Ŷ` and the rest are f64 (ntloss runs in
//!   the logits' dtype). Exponents are clamped at `max_number_length − 1` = 19.

use crate::vocab::number_table::Vocab;

/// NTIL place exponents are clamped here (ntl-patch's documented bound: `10^30` keeps sums
/// finite in float32).
pub const NTIL_MAX_PLACE_EXPONENT: usize = 30;
/// NTIL's token-level weight `digit_exp^r` (float32 base): r is clamped where the weight
/// would pass `10^30` (ntl-patch's documented bound; the official power is unbounded and inf
/// in float32 from 1.2^487 on, which makes its loss NaN).
fn weight_exponent_limit(base: f64) -> usize {
    if base <= 1.0 {
        return usize::MAX;
    }
    (NTIL_MAX_PLACE_EXPONENT as f64 * std::f64::consts::LN_10 / base.ln()).floor() as usize
}

/// ntloss `NumberLevelLoss(max_number_length=20)`: exponents are clamped at 19.
pub const NUMBER_LEVEL_MAX_EXPONENT: usize = 19;

/// The losses this module implements, with their settings.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqLoss {
    Ntil(NtilSettings),
    /// The official token-level-only `EMD` class.
    Emd {
        digit_exp: f64,
    },
    NumberLevel(NumberLevelSettings),
}

impl SeqLoss {
    pub fn name(&self) -> &'static str {
        match self {
            SeqLoss::Ntil(_) => "ntil",
            SeqLoss::Emd { .. } => "emd",
            SeqLoss::NumberLevel(_) => "number-level",
        }
    }
}

/// The official `NTIL.__init__` knobs (and `gumbel_softmax`'s `tau`).
#[derive(Debug, Clone, PartialEq)]
pub struct NtilSettings {
    pub digit_exp: f64,
    pub abs_alpha: f64,
    pub mag_alpha: f64,
    pub digit_alpha: f64,
    /// Temperature of the Gumbel-softmax; with noise 0 it changes no forward value (the
    /// argmax of `softmax(z / tau)` is the argmax of `z`), kept for completeness.
    pub tau: f64,
}

/// ntloss `NumberLevelLoss(float_level=…, reweigh=…)`.
#[derive(Debug, Clone, PartialEq)]
pub struct NumberLevelSettings {
    pub float_level: bool,
    pub reweigh: bool,
}

/// Token ids of `"0"`..`"9"` (index = digit value) and of `"."`, as the references look them
/// up (`tokenizer.convert_tokens_to_ids`).
#[derive(Debug, Clone, PartialEq)]
pub struct DigitTokens {
    pub digits: [i64; 10],
    pub dot: Option<i64>,
}

impl DigitTokens {
    pub fn from_vocab(vocab: &Vocab) -> Result<DigitTokens, String> {
        let mut digits = [0i64; 10];
        for (d, slot) in digits.iter_mut().enumerate() {
            *slot = vocab
                .id_of(&d.to_string())
                .ok_or_else(|| format!("the tokenizer has no token \"{d}\""))?;
        }
        Ok(DigitTokens {
            digits,
            dot: vocab.id_of("."),
        })
    }

    /// The digit a label stands for (None for every other label, the ignore index included).
    pub(super) fn digit_of(&self, label: i64) -> Option<usize> {
        self.digits.iter().position(|&id| id == label)
    }
}

/// Flat logits regrouped by sequence: row `b·T + t` of `[B·T, width]` belongs to position t
/// of sequence b (the layout the cross-entropy node sees, and the official code's `view`).
#[derive(Debug, Clone, Copy)]
pub struct Sequences<'a> {
    pub logits: &'a [f64],
    /// `[B, T]` row-major.
    pub labels: &'a [i64],
    pub batch: usize,
    pub seq: usize,
    pub width: usize,
}

impl<'a> Sequences<'a> {
    pub fn new(
        logits: &'a [f64],
        labels: &'a [i64],
        batch: usize,
        width: usize,
    ) -> Result<Self, String> {
        if batch == 0 || !labels.len().is_multiple_of(batch) {
            return Err(format!(
                "{} labels do not make {batch} sequences of equal length",
                labels.len()
            ));
        }
        if width == 0 || logits.len() != labels.len() * width {
            return Err(format!(
                "{} logits do not make {} rows of width {width}",
                logits.len(),
                labels.len()
            ));
        }
        Ok(Sequences {
            logits,
            labels,
            batch,
            seq: labels.len() / batch,
            width,
        })
    }

    pub(super) fn labels_of(&self, b: usize) -> &'a [i64] {
        &self.labels[b * self.seq..(b + 1) * self.seq]
    }

    pub(super) fn row(&self, b: usize, t: usize) -> &'a [f64] {
        let i = b * self.seq + t;
        &self.logits[i * self.width..(i + 1) * self.width]
    }
}

/// A per-sequence loss's value and what it counted.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqValue {
    pub value: f64,
    /// Positions whose label is a digit.
    pub digit_positions: usize,
    /// Numbers (maximal digit runs; joined across `"."` with `float_level`).
    pub numbers: usize,
    /// NTIL/EMD: each sequence's loss (their mean is `value`); number-level: each number's.
    pub parts: Vec<f64>,
}

/// Errors unless every digit id lies inside the logits width.
pub fn check_digit_ids(seqs: &Sequences, tokens: &DigitTokens) -> Result<(), String> {
    match tokens
        .digits
        .iter()
        .find(|&&id| id < 0 || id as usize >= seqs.width)
    {
        Some(id) => Err(format!(
            "digit token id {id} is outside the logits width {}",
            seqs.width
        )),
        None => Ok(()),
    }
}

pub fn sequence_loss(
    seqs: &Sequences,
    tokens: &DigitTokens,
    loss: &SeqLoss,
) -> Result<SeqValue, String> {
    check_digit_ids(seqs, tokens)?;
    match loss {
        SeqLoss::Ntil(s) => Ok(ntil(seqs, tokens, s, true)),
        SeqLoss::Emd { digit_exp } => {
            let s = NtilSettings {
                digit_exp: *digit_exp,
                abs_alpha: 0.0,
                mag_alpha: 0.0,
                digit_alpha: 1.0,
                tau: 1.0,
            };
            Ok(ntil(seqs, tokens, &s, false))
        }
        SeqLoss::NumberLevel(s) => {
            let dot = match (s.float_level, tokens.dot) {
                (false, _) => None,
                (true, Some(dot)) => Some(dot),
                (true, None) => {
                    return Err("float_level needs a \".\" token and the tokenizer has none".into())
                }
            };
            Ok(number_level(seqs, tokens, dot, s.reweigh))
        }
    }
}

// ---------------------------------------------------------------------------------- NTIL / EMD

/// `NTIL.compute_emd_with_tokenizer` (`sequence_terms`) or `EMD.compute_emd_with_tokenizer`
/// (token level only): the mean over the B sequences of each sequence's mixed loss.
fn ntil(
    seqs: &Sequences,
    tokens: &DigitTokens,
    s: &NtilSettings,
    sequence_terms: bool,
) -> SeqValue {
    let mut parts = Vec::with_capacity(seqs.batch);
    let (mut digit_positions, mut numbers) = (0, 0);
    // float32(digit_exp): the official weight is `digit_exp ** int_tensor`, a float32 power
    let base = s.digit_exp as f32 as f64;
    for b in 0..seqs.batch {
        let labels = seqs.labels_of(b);
        let digit: Vec<Option<usize>> = labels.iter().map(|&l| tokens.digit_of(l)).collect();

        // compute_digit_wdist_loss: r = digit labels still to come in the run, right to left
        let mut r = vec![0usize; labels.len()];
        let mut after = 0;
        for t in (0..labels.len()).rev() {
            if digit[t].is_some() {
                r[t] = after;
                after += 1;
            } else {
                after = 0;
            }
        }
        let (mut emd_sum, mut count) = (0.0, 0usize);
        for (t, d) in digit.iter().enumerate() {
            let Some(y) = *d else { continue };
            let q = digit_softmax(seqs.row(b, t), &tokens.digits);
            let emd: f64 = (0..10).map(|k| (k as f64 - y as f64).abs() * q[k]).sum();
            emd_sum += emd * base.powi(r[t].min(weight_exponent_limit(base)) as i32);
            count += 1;
        }
        // torch.mean over the digit positions; zero_tensor when there is none
        let emd = if count == 0 {
            0.0
        } else {
            emd_sum / count as f64
        };
        digit_positions += count;

        let mut mixed = s.digit_alpha * emd;
        if sequence_terms {
            // split_data_sequences: maximal runs of digit labels (any other label ends one)
            let runs = digit_runs(&digit);
            let (mut abs_sum, mut mag_sum) = (0.0, 0.0);
            for run in &runs {
                let (predicted, target) = run_numbers(seqs, tokens, b, run, &digit);
                let hi = predicted.max(target);
                let lo = predicted.min(target);
                // compute_abs_numerical_loss: |X̂−X| / (max + 1), exactly 0 where X̂ = X
                abs_sum += if predicted == target {
                    0.0
                } else {
                    (predicted - target).abs() / (hi + 1.0)
                };
                // compute_order_magnitude_loss: ln((max + 1) / (min + 1))
                mag_sum += ((hi + 1.0) / (lo + 1.0)).ln();
            }
            let n = runs.len();
            numbers += n;
            // torch.stack(...).mean() over the numbers; zero_tensor when there is none
            let (abs, mag) = if n == 0 {
                (0.0, 0.0)
            } else {
                (abs_sum / n as f64, mag_sum / n as f64)
            };
            mixed += s.abs_alpha * abs + s.mag_alpha * mag;
        } else {
            numbers += digit_runs(&digit).len();
        }
        parts.push(mixed);
    }
    // torch.stack(batch_losses).mean(): sequences without digits count as 0
    let value = parts.iter().sum::<f64>() / seqs.batch as f64;
    SeqValue {
        value,
        digit_positions,
        numbers,
        parts,
    }
}

/// Half-open position ranges of the maximal runs of digit labels.
fn digit_runs(digit: &[Option<usize>]) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let mut start = None;
    for t in 0..=digit.len() {
        match (digit.get(t).copied().flatten(), start) {
            (Some(_), None) => start = Some(t),
            (None, Some(s)) => {
                runs.push(s..t);
                start = None;
            }
            _ => {}
        }
    }
    runs
}

/// `get_abs_values`: the predicted number X̂ (argmax digits, the straight-through forward
/// with the noise at 0) and the label number X of one run, with float32 place values
/// `10^(n−1−k)` (exponent clamped at 30).
fn run_numbers(
    seqs: &Sequences,
    tokens: &DigitTokens,
    b: usize,
    run: &std::ops::Range<usize>,
    digit: &[Option<usize>],
) -> (f64, f64) {
    let n = run.len();
    let (mut predicted, mut target) = (0.0, 0.0);
    for (k, t) in run.clone().enumerate() {
        let exponent = (n - 1 - k).min(NTIL_MAX_PLACE_EXPONENT);
        let place = pow10_f32(exponent);
        let row = seqs.row(b, t);
        predicted += argmax_digit(row, &tokens.digits) as f64 * place;
        target += digit[t].expect("a run holds digits") as f64 * place;
    }
    (predicted, target)
}

/// The index of the largest of the ten digit logits, the first on ties (torch's `max(dim)`,
/// ONNX ArgMax with `select_last_index=0`). `softmax(z / tau)` keeps the order of z.
fn argmax_digit(row: &[f64], digits: &[i64; 10]) -> usize {
    let mut best = 0;
    for k in 1..10 {
        if row[digits[k] as usize] > row[digits[best] as usize] {
            best = k;
        }
    }
    best
}

/// Softmax over the ten digit logits, in digit-value order.
fn digit_softmax(row: &[f64], digits: &[i64; 10]) -> [f64; 10] {
    let z: Vec<f64> = digits.iter().map(|&id| row[id as usize]).collect();
    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = z.iter().map(|x| (x - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    let mut q = [0.0; 10];
    for k in 0..10 {
        q[k] = e[k] / sum;
    }
    q
}

/// `10^e` rounded to float32 (the references' float32 tables), widened to f64.
fn pow10_f32(e: usize) -> f64 {
    10f64.powi(e as i32) as f32 as f64
}

// ---------------------------------------------------------------------------------- number level

/// ntloss 0.3.2 `NumberLevelLoss.forward(..., reduction="mean")`.
fn number_level(
    seqs: &Sequences,
    tokens: &DigitTokens,
    dot: Option<i64>,
    reweigh: bool,
) -> SeqValue {
    let mut parts = Vec::new();
    let mut digit_positions = 0;
    for b in 0..seqs.batch {
        let labels = seqs.labels_of(b);
        let digit: Vec<Option<usize>> = labels.iter().map(|&l| tokens.digit_of(l)).collect();
        digit_positions += digit.iter().filter(|d| d.is_some()).count();
        for span in number_spans(labels, &digit, dot) {
            // only digits contribute (a joining "." is in the span but adds nothing)
            let members: Vec<usize> = span.filter(|&t| digit[t].is_some()).collect();
            let n = members.len();
            // Y: float32 label values times float32 powers, summed in float32 in order
            let mut target = 0f32;
            // Ŷ: expected digit (softmax over the digit tokens · values) times the same powers
            let mut predicted = 0f64;
            for (k, &t) in members.iter().enumerate() {
                let exponent = (n - 1 - k).min(NUMBER_LEVEL_MAX_EXPONENT);
                let place = 10f64.powi(exponent as i32) as f32;
                target += digit[t].expect("digit") as f32 * place;
                predicted += expected_digit(seqs.row(b, t), &tokens.digits) * place as f64;
            }
            let target = target as f64;
            let mut loss =
                (predicted - target).abs() / (predicted.abs() + target.abs() + f32::EPSILON as f64);
            if reweigh {
                // reweigh_fn at the number's first digit, max_dist = 1
                let mass = number_mass(seqs.row(b, members[0]), &tokens.digits);
                loss = loss * mass + 1.01 * 1.0 * (1.0 - mass);
            }
            parts.push(loss);
        }
    }
    // _apply_reduction("mean") with unit weights: Σ ℓ / max(count, eps); exactly 0 when no
    // label is a digit
    let numbers = parts.len();
    let value = if numbers == 0 {
        0.0
    } else {
        parts.iter().sum::<f64>() / numbers as f64
    };
    SeqValue {
        value,
        digit_positions,
        numbers,
        parts,
    }
}

/// `convert_digits_to_numbers`' spans: maximal runs of digits; with `dot` (float_level) a dot
/// with a digit on both sides belongs to the span and the digit after it continues it.
fn number_spans(
    labels: &[i64],
    digit: &[Option<usize>],
    dot: Option<i64>,
) -> Vec<std::ops::Range<usize>> {
    let n = labels.len();
    let is_digit = |t: usize| digit[t].is_some();
    let is_dot = |t: usize| dot.is_some_and(|d| labels[t] == d);
    let in_number = |t: usize| {
        is_digit(t) || (is_dot(t) && t >= 1 && is_digit(t - 1) && t + 1 < n && is_digit(t + 1))
    };
    let continues = |t: usize| {
        (t >= 1 && is_digit(t - 1)) || (dot.is_some() && t >= 2 && is_dot(t - 1) && is_digit(t - 2))
    };
    let mut spans: Vec<std::ops::Range<usize>> = Vec::new();
    for t in 0..n {
        if !in_number(t) {
            continue;
        }
        if continues(t) {
            if let Some(last) = spans.last_mut().filter(|s| s.end == t) {
                last.end = t + 1;
                continue;
            }
        }
        spans.push(t..t + 1);
    }
    spans
}

/// `_get_dot_product`: Σ_k softmax(z[digit ids])_k · k. The digit-level number table holds
/// exactly the ten digits, so the sum over number tokens is the sum over digits.
fn expected_digit(row: &[f64], digits: &[i64; 10]) -> f64 {
    let q = digit_softmax(row, digits);
    (0..10).map(|k| q[k] * k as f64).sum()
}

/// Full-vocabulary softmax mass on the digit tokens.
fn number_mass(row: &[f64], digits: &[i64; 10]) -> f64 {
    let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    digits
        .iter()
        .map(|&id| (row[id as usize] - lse).exp())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens() -> DigitTokens {
        // ids 0..9 are the digits, 10 is ".", 11 is a word
        DigitTokens {
            digits: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
            dot: Some(10),
        }
    }

    #[test]
    fn spans_join_across_a_dot_only_with_float_level() {
        let labels = [1, 2, 10, 3, 4, 11, 5, 10, 11, 10, 6];
        let t = tokens();
        let digit: Vec<Option<usize>> = labels.iter().map(|&l| t.digit_of(l)).collect();
        assert_eq!(
            number_spans(&labels, &digit, None),
            vec![0..2, 3..5, 6..7, 10..11]
        );
        assert_eq!(
            number_spans(&labels, &digit, Some(10)),
            vec![0..5, 6..7, 10..11]
        );
    }

    #[test]
    fn exact_argmax_number_has_no_abs_or_mag_term() {
        // one sequence "42": logits favour 4 then 2 strongly; uniform elsewhere
        let width = 12;
        let mut logits = vec![0.0; 2 * width];
        logits[4] = 50.0;
        logits[width + 2] = 50.0;
        let labels = [4, 2];
        let seqs = Sequences::new(&logits, &labels, 1, width).unwrap();
        let s = NtilSettings {
            digit_exp: 1.2,
            abs_alpha: 0.2,
            mag_alpha: 0.2,
            digit_alpha: 1.0,
            tau: 0.1,
        };
        let v = sequence_loss(&seqs, &tokens(), &SeqLoss::Ntil(s)).unwrap();
        assert!(v.value < 1e-15, "{v:?}");
        assert_eq!((v.digit_positions, v.numbers), (2, 1));
    }

    #[test]
    fn no_digit_gives_exactly_zero() {
        let width = 12;
        let logits = vec![0.3; 3 * width];
        let labels = [11, -100, 10];
        let seqs = Sequences::new(&logits, &labels, 1, width).unwrap();
        for loss in [
            SeqLoss::Emd { digit_exp: 1.0 },
            SeqLoss::NumberLevel(NumberLevelSettings {
                float_level: true,
                reweigh: true,
            }),
        ] {
            assert_eq!(sequence_loss(&seqs, &tokens(), &loss).unwrap().value, 0.0);
        }
    }
}

//! An independent implementation of DIST2Loss and DEL: plain loops in f64, written from their
//! authors' code (GitHub PolyU-VCLab/DEL, commit 68c3d4d, `train-qwen-deepseek.py`:
//! `DIST2loss`, `DEL`, `generate_integer_place`, `generate_place`), with one difference the
//! docs name: numbers are grouped per sequence (the labels regrouped as `[B, T]`), where the
//! authors group consecutive positions of the flattened batch with the ignored ones removed.
//!
//! It shares no code with `ntl_ops`: the places follow `generate_place`'s own arithmetic
//! (powers of 1.02 and their logarithms, here as exact integer exponents), and the binary
//! cross-entropy is torch's `max(x, 0) − x·t + ln(1 + e^−|x|)`.

use super::reference_ntil::{check_digit_ids, DigitTokens, SeqValue, Sequences};

/// The two losses of the DEL repository.
#[derive(Debug, Clone, PartialEq)]
pub enum DigitLoss {
    /// `DIST2loss`, with the target temperature (1 there).
    Dist2 { tau: f64 },
    /// `DEL`.
    Del,
}

impl DigitLoss {
    pub fn describe(&self) -> String {
        match self {
            DigitLoss::Dist2 { tau } => format!("dist2 (tau {tau})"),
            DigitLoss::Del => "del".into(),
        }
    }
}

/// The loss's value over the batch regrouped by sequence.
pub fn digit_loss(
    seqs: &Sequences,
    tokens: &DigitTokens,
    loss: &DigitLoss,
) -> Result<SeqValue, String> {
    check_digit_ids(seqs, tokens)?;
    Ok(match loss {
        DigitLoss::Dist2 { tau } => dist2(seqs, tokens, *tau),
        DigitLoss::Del => del(seqs, tokens),
    })
}

/// `.` in the authors' value table (digits are 0..9).
const DOT: usize = 10;

/// The mean over digit labels of `DIST2loss`'s per-position values.
pub fn dist2(seqs: &Sequences, tokens: &DigitTokens, tau: f64) -> SeqValue {
    let mut parts = Vec::new();
    let mut numbers = 0;
    for b in 0..seqs.batch {
        let values = label_values(seqs.labels_of(b), tokens, false);
        for group in groups(&values) {
            numbers += 1;
            let n = group.len();
            for (j, t) in group.enumerate() {
                // generate_integer_place: units 1, tens 2, ...
                let place = (n - j) as f64;
                let y = values[t].expect("a group holds digits");
                let q = softmax(&digit_logits(seqs.row(b, t), tokens));
                parts.push(place * kl(&target(y, tau), &q));
            }
        }
    }
    let value = if parts.is_empty() {
        0.0
    } else {
        parts.iter().sum::<f64>() / parts.len() as f64
    };
    SeqValue {
        value,
        digit_positions: parts.len(),
        numbers,
        parts,
    }
}

/// `DEL(logits, labels, tokenizer)`: `0.01 · mean over [#digits, 10]` of
/// `BCEWithLogits(z, onehot(y)) · softmax(z) · place`.
pub fn del(seqs: &Sequences, tokens: &DigitTokens) -> SeqValue {
    let mut parts = Vec::new();
    let mut numbers = 0;
    for b in 0..seqs.batch {
        let values = label_values(seqs.labels_of(b), tokens, true);
        for group in groups(&values) {
            let places = generate_place(&values[group.clone()]);
            numbers += usize::from(places.iter().any(Option::is_some));
            for (t, place) in group.zip(places) {
                let Some(place) = place else { continue };
                let y = values[t].expect("a group holds digits and dots");
                let z = digit_logits(seqs.row(b, t), tokens);
                let p = softmax(&z);
                let criterion: f64 = (0..10)
                    .map(|k| bce_with_logits(z[k], (k == y) as u8 as f64) * p[k])
                    .sum();
                parts.push(place * criterion);
            }
        }
    }
    let value = if parts.is_empty() {
        0.0
    } else {
        0.01 * parts.iter().sum::<f64>() / (10 * parts.len()) as f64
    };
    SeqValue {
        value,
        digit_positions: parts.len(),
        numbers,
        parts,
    }
}

/// Per position: the digit (0..9), `DOT` for `"."` when `with_dot`, None otherwise.
fn label_values(labels: &[i64], tokens: &DigitTokens, with_dot: bool) -> Vec<Option<usize>> {
    labels
        .iter()
        .map(|&l| {
            tokens
                .digit_of(l)
                .or_else(|| (with_dot && tokens.dot == Some(l)).then_some(DOT))
        })
        .collect()
}

/// Maximal runs of consecutive positions with a value (the authors' `groups`, per sequence).
fn groups(values: &[Option<usize>]) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    for (t, v) in values.iter().enumerate() {
        if v.is_none() {
            continue;
        }
        match out.last_mut() {
            Some(g) if g.end == t => g.end = t + 1,
            _ => out.push(t..t + 1),
        }
    }
    out
}

/// `generate_place` on one group (digits 0..9 and dots): each digit's weight, None for dots.
/// With `ind` the index of the group's first dot (argmax, so 0 when there is none or the
/// group starts with one), a position j has the power `1.02^e`, `e = ind − 1 − j` when
/// `ind > 0`, else `n − 1 − j`; a digit's place is then `log_1.02(power) + 1 = e + 1`, doubled
/// when positive, and the power itself when negative (digits after the dot).
fn generate_place(group: &[Option<usize>]) -> Vec<Option<f64>> {
    let n = group.len() as i64;
    let ind = group.iter().position(|&v| v == Some(DOT)).unwrap_or(0) as i64;
    group
        .iter()
        .enumerate()
        .map(|(j, &v)| {
            if v == Some(DOT) {
                return None;
            }
            let e = if ind > 0 {
                ind - 1 - j as i64
            } else {
                n - 1 - j as i64
            };
            let place = e + 1;
            Some(if place > 0 {
                2.0 * place as f64
            } else {
                1.02f64.powi(e as i32)
            })
        })
        .collect()
}

fn digit_logits(row: &[f64], tokens: &DigitTokens) -> [f64; 10] {
    let mut z = [0.0; 10];
    for (k, &id) in tokens.digits.iter().enumerate() {
        z[k] = row[id as usize];
    }
    z
}

fn softmax(z: &[f64; 10]) -> [f64; 10] {
    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = z.iter().map(|x| (x - max).exp()).collect();
    let s: f64 = e.iter().sum();
    std::array::from_fn(|k| e[k] / s)
}

/// `F.softmax(−(y − k)²)` over k (with the temperature τ).
fn target(y: usize, tau: f64) -> [f64; 10] {
    let scores: [f64; 10] = std::array::from_fn(|k| -((y as f64 - k as f64).powi(2)) / tau);
    softmax(&scores)
}

/// `KLDivLoss(reduction="none")(log q, T).sum(-1)`: `Σ T (ln T − ln q)`, 0 where T = 0.
fn kl(t: &[f64; 10], q: &[f64; 10]) -> f64 {
    (0..10)
        .filter(|&k| t[k] > 0.0)
        .map(|k| t[k] * (t[k].ln() - q[k].ln()))
        .sum()
}

/// torch's `binary_cross_entropy_with_logits`: `max(x, 0) − x·t + ln(1 + e^−|x|)`.
fn bce_with_logits(x: f64, t: f64) -> f64 {
    x.max(0.0) - x * t + (-x.abs()).exp().ln_1p()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(s: &str) -> Vec<Option<usize>> {
        s.chars()
            .map(|c| match c {
                '.' => Some(DOT),
                d => d.to_digit(10).map(|d| d as usize),
            })
            .collect()
    }

    #[test]
    fn places_follow_generate_place() {
        let p = |s: &str| -> Vec<Option<f64>> { generate_place(&g(s)) };
        assert_eq!(p("123"), vec![Some(6.0), Some(4.0), Some(2.0)]);
        assert_eq!(
            p("12.34"),
            vec![
                Some(4.0),
                Some(2.0),
                None,
                Some(1.02f64.powi(-2)),
                Some(1.02f64.powi(-3))
            ]
        );
        // a trailing dot changes nothing; a leading one counts as no dot (and as a position)
        assert_eq!(p("7."), vec![Some(2.0), None]);
        assert_eq!(p(".5"), vec![None, Some(2.0)]);
        assert_eq!(p(".5.3"), vec![None, Some(6.0), None, Some(2.0)]);
        // later dots are positions after the first one
        assert_eq!(
            p("1.2.3"),
            vec![
                Some(2.0),
                None,
                Some(1.02f64.powi(-2)),
                None,
                Some(1.02f64.powi(-4))
            ]
        );
    }

    #[test]
    fn groups_are_maximal_runs() {
        let v = vec![
            Some(1),
            None,
            Some(2),
            Some(DOT),
            Some(3),
            None,
            None,
            Some(4),
        ];
        assert_eq!(groups(&v), vec![0..1, 2..5, 7..8]);
    }

    #[test]
    fn bce_is_torchs() {
        for (x, t) in [(0.0f64, 1.0f64), (3.0, 0.0), (-40.0, 1.0), (25.0, 1.0)] {
            let sig = 1.0 / (1.0 + (-x).exp());
            let want = -(t * sig.ln() + (1.0 - t) * (1.0 - sig).ln());
            assert!((bce_with_logits(x, t) - want).abs() < 1e-9 * want.abs().max(1.0));
        }
    }
}

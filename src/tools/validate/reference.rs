//! An independent implementation of the patched losses: plain loops in f64 over the flat
//! logits `[M, V]` and labels `[M]`, written from PyPI `ntloss` 0.3.2 (`ntloss/core.py`:
//! `NTLoss`, `NTLossDotProduct`, `reweigh_fn`, `_apply_reduction`) and torch's cross-entropy.
//!
//! It shares no code with `ntl_ops` on purpose: a bug there must show up as a mismatch here,
//! not be repeated. The only input it takes from the crate is the number table, rebuilt from
//! the tokenizer by the caller.

use crate::vocab::number_table::NumberTable;

/// The number losses, as ntloss names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NtlKind {
    /// `NTLoss`: `Σ_j p_j·d(v_j, y)`, d = |v_j − y| (optionally squashed).
    Wasserstein,
    /// `NTLossDotProduct(loss_function=F.mse_loss)`.
    Mse,
    /// `NTLossDotProduct(loss_function=F.l1_loss)`.
    L1,
    /// `NTLossDotProduct(loss_function=F.huber_loss)`, δ = 1.
    Huber,
}

impl NtlKind {
    pub fn name(self) -> &'static str {
        match self {
            NtlKind::Wasserstein => "wasserstein",
            NtlKind::Mse => "mse",
            NtlKind::L1 => "l1",
            NtlKind::Huber => "huber",
        }
    }

    pub fn parse(name: &str) -> Option<NtlKind> {
        [
            NtlKind::Wasserstein,
            NtlKind::Mse,
            NtlKind::L1,
            NtlKind::Huber,
        ]
        .into_iter()
        .find(|k| k.name() == name)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct NtlSettings {
    pub kind: NtlKind,
    /// ntloss `reweigh`.
    pub reweigh: bool,
    /// ntloss `squash_factor` (Wasserstein only).
    pub squash: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CeReduction {
    Mean,
    Sum,
}

/// Flat logits (row-major `[M, width]`) and their labels `[M]`.
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    pub logits: &'a [f64],
    pub labels: &'a [i64],
    pub width: usize,
}

impl<'a> Batch<'a> {
    pub fn new(logits: &'a [f64], labels: &'a [i64], width: usize) -> Result<Self, String> {
        if width == 0 || logits.len() != labels.len() * width {
            return Err(format!(
                "{} logits do not make {} rows of width {width}",
                logits.len(),
                labels.len()
            ));
        }
        Ok(Batch {
            logits,
            labels,
            width,
        })
    }

    fn row(&self, i: usize) -> &'a [f64] {
        &self.logits[i * self.width..(i + 1) * self.width]
    }
}

/// `log Σ_j exp(x_j)`, shifted by the maximum so it cannot overflow.
fn log_sum_exp(xs: impl Iterator<Item = f64> + Clone) -> f64 {
    let max = xs.clone().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return max;
    }
    max + xs.map(|x| (x - max).exp()).sum::<f64>().ln()
}

/// torch `F.cross_entropy` / ONNX `SoftmaxCrossEntropyLoss`: `−log softmax(z)[y]` per kept
/// position (optionally times the class weight `w[y]`); mean = Σ w·nll / Σ w. A mean over no
/// kept position is NaN, as in torch and ONNX.
pub fn cross_entropy(
    batch: &Batch,
    ignore_index: Option<i64>,
    reduction: CeReduction,
    class_weights: Option<&[f64]>,
    label_smoothing: f64,
) -> Result<f64, String> {
    let (mut total, mut weight_sum) = (0.0, 0.0);
    for (i, &label) in batch.labels.iter().enumerate() {
        if Some(label) == ignore_index {
            continue;
        }
        if label < 0 || label as usize >= batch.width {
            return Err(format!(
                "label {label} at position {i} is outside 0..{}",
                batch.width
            ));
        }
        let row = batch.row(i);
        let lse = log_sum_exp(row.iter().copied());
        let mean_row = row.iter().sum::<f64>() / row.len() as f64;
        // torch's label smoothing: (1−ε)·nll + ε·mean_c(−log p_c), and −log p_c = lse − z_c
        let nll = (1.0 - label_smoothing) * (lse - row[label as usize])
            + label_smoothing * (lse - mean_row);
        let w = match class_weights {
            None => 1.0,
            Some(w) => *w.get(label as usize).ok_or_else(|| {
                format!(
                    "the class weights have {} entries, label {label} needs more",
                    w.len()
                )
            })?,
        };
        total += w * nll;
        weight_sum += w;
    }
    Ok(match reduction {
        CeReduction::Sum => total,
        CeReduction::Mean => total / weight_sum,
    })
}

/// The number loss and how many positions it averaged over.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NtlValue {
    pub value: f64,
    pub positions: usize,
}

/// ntloss `forward(logits, labels, reduction="mean")` for one setting.
pub fn number_token_loss(
    batch: &Batch,
    table: &NumberTable,
    settings: &NtlSettings,
    ignore_index: Option<i64>,
) -> Result<NtlValue, String> {
    let ids = table.ids();
    let values = table.values();
    if let Some(&id) = ids.iter().find(|&&id| id < 0 || id as usize >= batch.width) {
        return Err(format!(
            "number token id {id} is outside the logits width {}",
            batch.width
        ));
    }
    let squash = settings.squash.map(|s| Squash::new(values, s));
    let max_dist = max_dist(settings, values, squash.as_ref());

    let (mut sum, mut positions) = (0.0, 0usize);
    for (i, &label) in batch.labels.iter().enumerate() {
        // ntloss replaces the ignore index by a non-number id before the lookup.
        if Some(label) == ignore_index {
            continue;
        }
        let Some(y) = table.value_of(label) else {
            continue;
        };
        let row = batch.row(i);
        let p = number_softmax(row, ids);
        let mut loss = match settings.kind {
            NtlKind::Wasserstein => p
                .iter()
                .zip(values)
                .map(|(p, v)| {
                    let d = (v - y).abs();
                    p * squash.as_ref().map_or(d, |s| s.apply(d))
                })
                .sum(),
            kind => {
                let predicted: f64 = p.iter().zip(values).map(|(p, v)| p * v).sum();
                pointwise(kind, predicted - y)
            }
        };
        if settings.reweigh {
            // m = full-vocabulary softmax mass on the number tokens.
            let lse = log_sum_exp(row.iter().copied());
            let mass: f64 = ids.iter().map(|&id| (row[id as usize] - lse).exp()).sum();
            loss = loss * mass + 1.01 * max_dist * (1.0 - mass);
        }
        sum += loss;
        positions += 1;
    }
    // mean = Σ w·ℓ / max(Σ w, eps) with w = 1; no number label gives exactly 0.
    let value = if positions == 0 {
        0.0
    } else {
        sum / positions as f64
    };
    Ok(NtlValue { value, positions })
}

/// Softmax over the number-token logits only (renormalised), in table order.
fn number_softmax(row: &[f64], ids: &[i64]) -> Vec<f64> {
    let lse = log_sum_exp(ids.iter().map(|&id| row[id as usize]));
    ids.iter()
        .map(|&id| (row[id as usize] - lse).exp())
        .collect()
}

/// `F.mse_loss`, `F.l1_loss`, `F.huber_loss(delta=1)` of a difference.
fn pointwise(kind: NtlKind, d: f64) -> f64 {
    match kind {
        NtlKind::Mse => d * d,
        NtlKind::L1 => d.abs(),
        NtlKind::Huber if d.abs() < 1.0 => 0.5 * d * d,
        NtlKind::Huber => d.abs() - 0.5,
        NtlKind::Wasserstein => unreachable!("not a dot-product loss"),
    }
}

/// ntloss `setup_distance_lookup` with a squash factor: non-zero distances map linearly from
/// [smallest non-zero, largest] onto [1, s]; zero stays zero.
struct Squash {
    min_nonzero: f64,
    scale: f64,
}

impl Squash {
    fn new(values: &[f64], s: f64) -> Squash {
        let (mut min_nonzero, mut max) = (f64::INFINITY, 0.0f64);
        for a in values {
            for b in values {
                let d = (a - b).abs();
                if d > 0.0 {
                    min_nonzero = min_nonzero.min(d);
                }
                max = max.max(d);
            }
        }
        Squash {
            min_nonzero,
            scale: (s - 1.0) / (max - min_nonzero),
        }
    }

    fn apply(&self, d: f64) -> f64 {
        if d == 0.0 {
            0.0
        } else {
            1.0 + (d - self.min_nonzero) * self.scale
        }
    }
}

/// ntloss `max_dist`: the largest value a position's loss can take (used by `reweigh`).
fn max_dist(settings: &NtlSettings, values: &[f64], squash: Option<&Squash>) -> f64 {
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let span = hi - lo;
    match settings.kind {
        // the largest entry of the (squashed) distance lookup table
        NtlKind::Wasserstein => squash.map_or(span, |s| s.apply(span)),
        // max(|f(min, max)|, |f(max, min)|) of the symmetric loss functions
        kind => pointwise(kind, span),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cross_entropy_of_uniform_logits_is_log_width() {
        let logits = [0.0; 8];
        let batch = Batch::new(&logits, &[1, -100], 4).unwrap();
        let ce = cross_entropy(&batch, Some(-100), CeReduction::Mean, None, 0.0).unwrap();
        assert!((ce - 4f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn squash_maps_extremes_onto_one_and_s() {
        let s = Squash::new(&[0.0, 1.0, 9.0], 3.0);
        assert_eq!(s.apply(0.0), 0.0);
        assert!((s.apply(1.0) - 1.0).abs() < 1e-12);
        assert!((s.apply(9.0) - 3.0).abs() < 1e-12);
    }
}

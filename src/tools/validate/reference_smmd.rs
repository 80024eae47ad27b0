//! An independent implementation of SMMD in f64, written from its authors' code (GitHub
//! Zuozhuo/smmd-loss, commit 581fde6: `smmd/loss.py` `SMMDLoss.forward`, `smmd/kernels.py`
//! `build_kernel_matrix` and `squash_distances`): the kernel, its degrees and α from the
//! integer values, and per number position the reference's expansion around the one-hot
//! target (`pᵀKp + K_tt − 2·K_t·p`, `Σ deg_i p_i² + deg_t(1 − 2p_t)`), then the mean of the
//! ReLU over the number positions. Shares no code with `ntl_ops` (the op library).

use super::reference::Batch;
use crate::vocab::number_table::NumberTable;

#[derive(Debug, Clone, PartialEq)]
pub struct SmmdSettings {
    pub max_value: u32,
    /// `kernel_type="laplace"` (else Gaussian).
    pub laplace: bool,
    pub sigmas: Vec<f64>,
    pub squash: f64,
    /// `tau_mode="fixed"` with this value; None: `0.5 / mean(degree)`.
    pub alpha: Option<f64>,
    /// `loss_mode`: "smmd", "mmd" or "smooth".
    pub terms: String,
}

impl SmmdSettings {
    pub fn describe(&self) -> String {
        let alpha = self.alpha.map_or("auto".to_string(), |a| a.to_string());
        format!(
            "smmd ({} terms, {} kernel, sigmas {:?}, squash {}, alpha {alpha}, max value {})",
            self.terms,
            if self.laplace { "laplace" } else { "gaussian" },
            self.sigmas,
            self.squash,
            self.max_value
        )
    }
}

pub struct SmmdValue {
    pub value: f64,
    pub positions: usize,
}

/// `SMMDLoss.forward` over the flat batch; the table holds the integer tokens (ids, values).
pub fn smmd(batch: &Batch, table: &NumberTable, s: &SmmdSettings) -> Result<SmmdValue, String> {
    let values = table.values();
    let n = values.len();
    if let Some(&id) = table.ids().iter().find(|&&id| id as usize >= batch.width) {
        return Err(format!(
            "number token id {id} is outside the logits width {}",
            batch.width
        ));
    }
    let k = kernel(values, s);
    let deg: Vec<f64> = k.iter().map(|row| row.iter().sum()).collect();
    let alpha = s
        .alpha
        .unwrap_or_else(|| 0.5 / (deg.iter().sum::<f64>() / n as f64).max(1e-12));
    let (mut total, mut positions) = (0.0, 0usize);
    for (i, &label) in batch.labels.iter().enumerate() {
        let Ok(t) = table.ids().binary_search(&label) else {
            continue;
        };
        let row = &batch.logits[i * batch.width..(i + 1) * batch.width];
        let z: Vec<f64> = table.ids().iter().map(|&id| row[id as usize]).collect();
        let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = z.iter().map(|x| (x - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        let p: Vec<f64> = e.iter().map(|x| x / sum).collect();

        let pkp: f64 = (0..n)
            .map(|a| p[a] * (0..n).map(|c| p[c] * k[c][a]).sum::<f64>())
            .sum();
        let ktp: f64 = (0..n).map(|a| k[t][a] * p[a]).sum();
        let mmd = pkp + k[t][t] - 2.0 * ktp;
        let dr = (0..n).map(|a| deg[a] * p[a] * p[a]).sum::<f64>() + deg[t] * (1.0 - 2.0 * p[t]);
        let smooth = dr - mmd;
        let raw = match s.terms.as_str() {
            "mmd" => mmd,
            "smooth" => alpha * smooth,
            _ => mmd + alpha * smooth,
        };
        total += raw.max(0.0);
        positions += 1;
    }
    Ok(SmmdValue {
        value: if positions == 0 {
            0.0
        } else {
            total / positions as f64
        },
        positions,
    })
}

/// `build_kernel_matrix(values, VALUE_DISTANCE, KernelSpec(...))`.
fn kernel(values: &[f64], s: &SmmdSettings) -> Vec<Vec<f64>> {
    let mut d: Vec<Vec<f64>> = values
        .iter()
        .map(|a| values.iter().map(|c| (a - c).abs()).collect())
        .collect();
    if s.squash > 1.0 {
        let flat = d.iter().flatten().copied();
        let min_nz = flat
            .clone()
            .filter(|&x| x > 0.0)
            .fold(f64::INFINITY, f64::min);
        let max = flat.fold(0.0, f64::max);
        if values.len() > 1 && min_nz.is_finite() && max > min_nz {
            let scale = (s.squash - 1.0) / (max - min_nz + 1e-10);
            for x in d.iter_mut().flatten() {
                if *x != 0.0 {
                    *x = 1.0 + (*x - min_nz) * scale;
                }
            }
        }
    }
    d.iter()
        .map(|row| {
            row.iter()
                .map(|&x| {
                    let sum: f64 = s
                        .sigmas
                        .iter()
                        .map(|&sg| {
                            if s.laplace {
                                (-x.abs() / sg).exp()
                            } else {
                                (-(x * x) / (2.0 * sg * sg)).exp()
                            }
                        })
                        .sum();
                    (sum / s.sigmas.len() as f64).clamp(0.0, 1.0)
                })
                .collect()
        })
        .collect()
}

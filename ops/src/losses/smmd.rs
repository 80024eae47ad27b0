//! SMMD ("Enhancing Numerical Prediction in LLMs via Smooth MMD Alignment", ICML 2026) as its
//! authors' code computes it: GitHub Zuozhuo/smmd-loss (commit 581fde6), `smmd/loss.py`
//! `SMMDLoss.forward`, `smmd/kernels.py` `build_kernel_matrix`, `smmd/digit_tokens.py`.
//!
//! Over the N integer tokens (values v_i), per position whose label is one of them:
//! `p = softmax(z[ids])`, `r = p − onehot(y)`, and with the kernel K (`K_ij = κ(d'_ij)`, d' the
//! value distances mapped linearly onto [1, squash]) and its degrees `D = diag(Σ_j K_ij)`:
//! `raw = rᵀKr + α·rᵀ(D − K)r = rᵀAr`, `A = (1 − α)K + αD`; the loss is the mean of
//! `relu(raw)` over those positions, 0 without any. The reference expands the quadratic forms
//! around the one-hot target; ntl-patch multiplies `r` by the constant A directly (the same
//! value, without the expansion's cancellation in float32).

use crate::losses::FlatInputs;
use crate::numbers::NumberTable;
use crate::onnx::FLOAT;
use crate::options::{SmmdKernel, SmmdOptions, SmmdTerms};
use crate::Builder;

/// Most integer tokens SMMD takes: its `[N, N]` matrix is a float32 initializer (64 MiB here).
pub const MAX_TOKENS: usize = 4096;

pub fn build(b: &mut Builder, inp: &FlatInputs, table: &NumberTable, opts: &SmmdOptions) -> String {
    let values: Vec<f64> = table.values().to_vec();
    let n = values.len() as i64;
    let a = quadratic_form(&values, opts);
    let ids = b.const_i64("smmd_ids", &[n], table.ids());
    let a = b.const_f32("smmd_form", &[n, n], &a);

    let number_logits = b.gather(&inp.logits, &ids, 1, "smmd_logits");
    let p = b.softmax(&number_logits, 1, "smmd_probs");
    let labels = b.unsqueeze(&inp.labels, &[1], "smmd_labels_col");
    let target = b.equal(&labels, &ids, "smmd_target_b");
    let target = b.cast(&target, FLOAT, "smmd_target");
    let counted = b.reduce_sum(&target, &[1], false, "smmd_is_number");

    let r = b.binary("Sub", &p, &target, "smmd_residual");
    let ra = b.binary("MatMul", &r, &a, "smmd_residual_form");
    let raw = b.binary("Mul", &ra, &r, "smmd_quadratic_parts");
    let raw = b.reduce_sum(&raw, &[1], false, "smmd_raw");
    let loss = b.unary("Relu", &raw, "smmd_position_loss");

    let masked = b.binary("Mul", &loss, &counted, "smmd_masked");
    let total = b.reduce_sum(&masked, &[], false, "smmd_sum");
    let count = b.reduce_sum(&counted, &[], false, "smmd_count");
    let one = b.scalar_f32("smmd_count_floor", 1.0);
    let count = b.binary("Max", &count, &one, "smmd_count_at_least_1");
    b.binary("Div", &total, &count, "smmd")
}

/// The kernel matrix K (float32, as `build_kernel_matrix` computes it), row-major `[N, N]`.
pub fn kernel(values: &[f64], opts: &SmmdOptions) -> Vec<f32> {
    let n = values.len();
    let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
    let mut dist: Vec<f32> = (0..n * n).map(|k| (v[k / n] - v[k % n]).abs()).collect();
    if opts.squash > 1.0 {
        squash(&mut dist, opts.squash as f32);
    }
    let sigmas = &opts.sigmas;
    dist.iter()
        .map(|&d| {
            let sum: f32 = sigmas
                .iter()
                .map(|&s| match opts.kernel {
                    SmmdKernel::Gaussian => (-(d * d) / (2.0 * s * s) as f32).exp(),
                    SmmdKernel::Laplace => (-d.abs() / s as f32).exp(),
                })
                .sum();
            (sum / sigmas.len() as f32).clamp(0.0, 1.0)
        })
        .collect()
}

/// `kernels.py` `squash_distances`: non-zero distances mapped linearly onto [1, s], in float32.
fn squash(dist: &mut [f32], s: f32) {
    let min_nz = dist
        .iter()
        .copied()
        .filter(|&d| d > 0.0)
        .fold(f32::INFINITY, f32::min);
    let max = dist.iter().copied().fold(0.0f32, f32::max);
    if dist.len() <= 1 || !min_nz.is_finite() || max <= min_nz {
        return;
    }
    let scale = (s - 1.0) / (max - min_nz + 1e-10);
    for d in dist.iter_mut() {
        if *d != 0.0 {
            *d = 1.0 + (*d - min_nz) * scale;
        }
    }
}

/// The smoothness weight α: `--smmd-alpha`, or the reference's `0.5 / mean(degree)`
/// (`tau_mode="auto"`), in float32.
pub fn alpha(k: &[f32], n: usize, opts: &SmmdOptions) -> f32 {
    match opts.alpha {
        Some(a) => a as f32,
        None => {
            let degrees: f32 = degrees(k, n).iter().sum();
            0.5 / (degrees / n as f32).max(1e-12)
        }
    }
}

fn degrees(k: &[f32], n: usize) -> Vec<f32> {
    k.chunks(n).map(|row| row.iter().sum()).collect()
}

/// A of `raw = rᵀAr` for the chosen terms, float32 `[N, N]` (computed in f64 from the float32
/// K, degrees and α the reference holds).
pub fn quadratic_form(values: &[f64], opts: &SmmdOptions) -> Vec<f32> {
    let n = values.len();
    let k = kernel(values, opts);
    let deg = degrees(&k, n);
    let a = alpha(&k, n, opts) as f64;
    let (wk, wd) = match opts.terms {
        SmmdTerms::Smmd => (1.0 - a, a),
        SmmdTerms::Mmd => (1.0, 0.0),
        SmmdTerms::Smooth => (-a, a),
    };
    (0..n * n)
        .map(|idx| {
            let (i, j) = (idx / n, idx % n);
            let d = if i == j { deg[i] as f64 } else { 0.0 };
            (wk * k[idx] as f64 + wd * d) as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digit_kernel_is_the_reference_one() {
        // digits 0..9, squash 9 leaves distances 1..9 as they are (min 1, max 9)
        let values: Vec<f64> = (0..10).map(f64::from).collect();
        let opts = SmmdOptions::default();
        let k = kernel(&values, &opts);
        assert_eq!(k[0], 1.0);
        assert!((k[1] as f64 - (-1.0f64 / 8.0).exp()).abs() < 1e-7);
        assert!((k[9] as f64 - (-81.0f64 / 8.0).exp()).abs() < 1e-9);
        let a = alpha(&k, 10, &opts) as f64;
        let deg: f64 = degrees(&k, 10).iter().map(|&d| d as f64).sum::<f64>() / 10.0;
        assert!((a - 0.5 / deg).abs() < 1e-7);
    }

    #[test]
    fn wide_values_are_squashed_onto_one_to_nine() {
        let values = [0.0, 1.0, 500.0, 999.0];
        let opts = SmmdOptions::default();
        let k = kernel(&values, &opts);
        // 0 and 999 are 999 apart, squashed to 9; 0 and 1 are the closest, squashed to 1
        assert!((k[3] as f64 - (-81.0f64 / 8.0).exp()).abs() < 1e-8);
        assert!((k[1] as f64 - (-1.0f64 / 8.0).exp()).abs() < 1e-7);
    }

    #[test]
    fn the_form_is_mmd_plus_alpha_smoothness() {
        // r = p − e_t: rᵀAr = rᵀKr + α·rᵀ(D−K)r for any r
        let values = [0.0, 1.0, 2.0, 7.0];
        let opts = SmmdOptions::default();
        let k = kernel(&values, &opts);
        let a = quadratic_form(&values, &opts);
        let al = alpha(&k, 4, &opts) as f64;
        let deg = degrees(&k, 4);
        let r = [0.2, -0.7, 0.4, 0.1];
        let form = |m: &dyn Fn(usize, usize) -> f64| -> f64 {
            (0..16).map(|x| r[x / 4] * m(x / 4, x % 4) * r[x % 4]).sum()
        };
        let mmd = form(&|i, j| k[i * 4 + j] as f64);
        let smooth = form(&|i, j| (if i == j { deg[i] as f64 } else { 0.0 }) - k[i * 4 + j] as f64);
        let got = form(&|i, j| a[i * 4 + j] as f64);
        assert!(
            (got - (mmd + al * smooth)).abs() < 1e-6,
            "{got} vs {}",
            mmd + al * smooth
        );
    }
}

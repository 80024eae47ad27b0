//! Symmetric per-block integer quantisation (`--quantize-base int8|int4`), what
//! `DequantizeLinear` undoes:
//! - per block of `block` values, `scale = absmax / qmax` in float32 (qmax 127 for int8, 7 for
//!   int4), 0 where the block is all zero;
//! - each value `round_half_to_even(x / scale)` (a float32 division), clipped to
//!   `[-qmax, qmax]`; 0 in an all-zero block;
//! - dequantised, a value is `q · scale` (float32), exactly as `DequantizeLinear` computes it
//!   with no zero point.

/// The integer values and per-block scales of one weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    /// One value per element, in `[-qmax, qmax]`.
    pub q: Vec<i8>,
    /// One float32 per block.
    pub scales: Vec<f32>,
}

/// Quantises `values` (torch's flattened `[out, in]` order) in blocks of `block` to
/// `[-qmax, qmax]`. The caller guarantees `block` divides the length and every value is finite.
pub fn quantize(values: &[f32], block: usize, qmax: i8) -> Quantized {
    debug_assert!(block > 0 && values.len().is_multiple_of(block) && qmax > 0);
    let limit = qmax as f32;
    let mut scales = Vec::with_capacity(values.len() / block);
    let mut q = Vec::with_capacity(values.len());
    for chunk in values.chunks_exact(block) {
        let am = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = am / limit;
        scales.push(scale);
        // a block so small its scale underflows to 0 dequantises to 0, as an all-zero one
        if scale == 0.0 {
            q.extend(std::iter::repeat_n(0i8, chunk.len()));
            continue;
        }
        q.extend(
            chunk
                .iter()
                .map(|&v| (v / scale).round_ties_even().clamp(-limit, limit) as i8),
        );
    }
    Quantized { q, scales }
}

/// int4 values as ONNX stores them: two per byte, the first element in the low nibble.
pub fn pack_int4(q: &[i8]) -> Vec<u8> {
    q.chunks(2)
        .map(|p| (p[0] as u8 & 0x0F) | ((p.get(1).copied().unwrap_or(0) as u8 & 0x0F) << 4))
        .collect()
}

/// int8 values as raw bytes (two's complement).
pub fn int8_bytes(q: &[i8]) -> Vec<u8> {
    q.iter().map(|&v| v as u8).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absmax_maps_to_qmax_and_halves_round_to_even() {
        // scale 1: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2 (ties to even), 7 -> 7
        let mut v = vec![0f32; 16];
        v[..5].copy_from_slice(&[7.0, 2.5, 3.5, -2.5, -7.0]);
        let got = quantize(&v, 16, 7);
        assert_eq!(got.scales, vec![1.0]);
        assert_eq!(&got.q[..5], &[7, 2, 4, -2, -7]);
    }

    #[test]
    fn all_zero_block_has_zero_scale_and_zero_values() {
        let got = quantize(&[0f32; 32], 16, 127);
        assert_eq!(got.scales, vec![0.0, 0.0]);
        assert!(got.q.iter().all(|&x| x == 0));
    }

    #[test]
    fn int4_packs_low_nibble_first() {
        assert_eq!(pack_int4(&[1, -1, -8, 7]), vec![0xF1, 0x78]);
        assert_eq!(int8_bytes(&[-1, 127]), vec![0xFF, 0x7F]);
    }
}

//! NF4 block quantisation, bit for bit as bitsandbytes 0.50's `quantize_4bit(quant_type="nf4")`
//! (its CPU path, `backends/default/ops.py`):
//! - per block of `block` values, `absmax = max |x|` (float32);
//! - each value scaled as `clamp(x · (1 / max(absmax, 1e-38)), −1, 1)` in float32 (a reciprocal
//!   times the value, not a division: the two round differently);
//! - its code is `torch.bucketize` over the midpoints of the 16 code values: the number of
//!   midpoints strictly below the scaled value, so an exact midpoint takes the lower code;
//! - two codes per byte, the first element in the high nibble.
//!
//! Dequantised, a value is `NF4[code] · absmax` (float32), as `dequantize_4bit`.

/// bitsandbytes' NF4 code values (`backends/utils.py` `_NF4_QUANT_TABLE`), as float32.
pub const NF4: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// The packed codes and per-block scales of one weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    /// Two codes per byte, `numel / 2` bytes.
    pub codes: Vec<u8>,
    /// One float32 per block.
    pub absmax: Vec<f32>,
}

/// The midpoints between neighbouring code values, in float32 as torch computes them.
fn midpoints() -> [f32; 15] {
    let mut m = [0f32; 15];
    for (k, v) in m.iter_mut().enumerate() {
        *v = (NF4[k] + NF4[k + 1]) / 2.0;
    }
    m
}

/// The code of a scaled value: the midpoints strictly below it (`torch.bucketize`, right=False).
fn code_of(scaled: f32, mids: &[f32; 15]) -> u8 {
    mids.iter().filter(|&&m| m < scaled).count() as u8
}

/// Quantises `values` (torch's flattened `[out, in]` order) in blocks of `block`. The caller
/// guarantees `block` divides the length, the length is even, and every value is finite.
pub fn quantize(values: &[f32], block: usize) -> Quantized {
    debug_assert!(
        block > 0 && values.len().is_multiple_of(block) && values.len().is_multiple_of(2)
    );
    let mids = midpoints();
    let mut absmax = Vec::with_capacity(values.len() / block);
    let mut codes = Vec::with_capacity(values.len() / 2);
    let mut pending: Option<u8> = None;
    for chunk in values.chunks_exact(block) {
        let am = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        absmax.push(am);
        let inv = 1.0f32 / am.max(1e-38);
        for &v in chunk {
            let q = code_of((v * inv).clamp(-1.0, 1.0), &mids);
            match pending.take() {
                None => pending = Some(q),
                Some(hi) => codes.push((hi << 4) | q),
            }
        }
    }
    Quantized { codes, absmax }
}

/// The float32 values `quantize` stands for (`dequantize_4bit`).
#[cfg(test)]
pub fn dequantize(q: &Quantized, block: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(q.codes.len() * 2);
    for (i, byte) in q.codes.iter().enumerate() {
        let am = q.absmax[2 * i / block];
        out.push(NF4[(byte >> 4) as usize] * am);
        out.push(NF4[(byte & 15) as usize] * am);
    }
    out
}

/// Each byte's two code values (high nibble first), the `[256, 2]` table the graph gathers
/// from.
pub fn pair_table() -> Vec<f32> {
    (0..256usize)
        .flat_map(|b| [NF4[b >> 4], NF4[b & 15]])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_matches_bitsandbytes_digits() {
        // bitsandbytes' literals, as written there (float64), rounded to float32
        let lit: [f64; 16] = [
            -1.0,
            -0.6961928009986877,
            -0.5250730514526367,
            -0.39491748809814453,
            -0.28444138169288635,
            -0.18477343022823334,
            -0.09105003625154495,
            0.0,
            0.07958029955625534,
            0.16093020141124725,
            0.24611230194568634,
            0.33791524171829224,
            0.44070982933044434,
            0.5626170039176941,
            0.7229568362236023,
            1.0,
        ];
        for (a, b) in NF4.iter().zip(lit) {
            assert_eq!(*a, b as f32);
        }
    }

    #[test]
    fn midpoint_takes_the_lower_code_and_zero_is_code_7() {
        let mids = midpoints();
        for (k, &m) in mids.iter().enumerate() {
            assert_eq!(code_of(m, &mids), k as u8);
            assert_eq!(code_of(m.next_up(), &mids), k as u8 + 1);
        }
        assert_eq!(code_of(0.0, &mids), 7);
        assert_eq!(code_of(-0.0, &mids), 7);
    }

    #[test]
    fn packs_high_nibble_first_and_round_trips_the_codes() {
        let mut v = vec![0f32; 64];
        v[0] = -1.0;
        v[1] = 1.0;
        let q = quantize(&v, 64);
        assert_eq!(q.codes[0], 0x0F);
        assert_eq!(q.absmax, vec![1.0]);
        let d = dequantize(&q, 64);
        assert_eq!(&d[..2], &[-1.0, 1.0]);
        assert!(d[2..].iter().all(|&x| x == 0.0));
    }

    #[test]
    fn all_zero_block_is_code_7_with_zero_scale() {
        let q = quantize(&[0f32; 32], 16);
        assert!(q.codes.iter().all(|&b| b == 0x77));
        assert_eq!(q.absmax, vec![0.0, 0.0]);
    }

    #[test]
    fn pair_table_is_high_nibble_first() {
        let t = pair_table();
        assert_eq!(t.len(), 512);
        assert_eq!((t[2 * 0x3A], t[2 * 0x3A + 1]), (NF4[3], NF4[10]));
    }
}

//! Parameters that hold the same values: a weight the exporter stored twice (tf2onnx's
//! constant folding keeps a reshaped and a transposed copy of an attention kernel; the dynamo
//! exporter's optimizer a transposed copy of a tied embedding). Each copy then trains as a
//! tensor of its own, and the model drifts from the framework's.

use crate::onnx::TensorProto;

/// Pairs of parameters whose values are equal as multisets (any layout), among those stored
/// inline and not constant (a zero or ones initialisation is shared legitimately).
pub fn same_values(params: &[&TensorProto]) -> Vec<(String, String)> {
    // an order-independent fingerprint of each tensor (no copy of the values kept), then an
    // exact comparison of sorted values only where fingerprints meet
    let mut groups: std::collections::BTreeMap<(usize, u64), Vec<&TensorProto>> =
        std::collections::BTreeMap::new();
    for &t in params {
        let Some(bits) = inline_bits(t) else {
            continue;
        };
        if bits.len() < 2 || bits.iter().all(|&b| b == bits[0]) {
            continue;
        }
        let key = (
            bits.len(),
            bits.iter().fold(0u64, |s, &b| s.wrapping_add(mix(b))),
        );
        groups.entry(key).or_default().push(t);
    }
    let mut pairs = Vec::new();
    for group in groups.into_values().filter(|g| g.len() > 1) {
        let mut sorted: Vec<(&TensorProto, Vec<u32>)> = Vec::new();
        for t in group {
            let mut bits = inline_bits(t).expect("read above");
            bits.sort_unstable();
            match sorted.iter().find(|(_, other)| *other == bits) {
                Some((first, _)) => pairs.push((first.name().to_string(), t.name().to_string())),
                None => sorted.push((t, bits)),
            }
        }
    }
    pairs
}

/// The float32 values' bit patterns, where they are in the model file (not external data).
fn inline_bits(t: &TensorProto) -> Option<Vec<u32>> {
    if !t.float_data.is_empty() {
        return Some(t.float_data.iter().map(|v| v.to_bits()).collect());
    }
    let raw = t.raw_data.as_ref()?;
    Some(
        raw.chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    )
}

/// splitmix64's finaliser: spreads each value so that sums of different multisets differ.
fn mix(v: u32) -> u64 {
    let mut z = u64::from(v).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::same_values;
    use crate::onnx::f32_tensor;

    #[test]
    fn copies_in_any_layout_are_paired_and_constants_are_not() {
        let w = f32_tensor("w", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let w_t = f32_tensor("w_t", &[3, 2], &[1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        let other = f32_tensor("other", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 7.0]);
        let ones = f32_tensor("ones", &[3], &[1.0; 3]);
        let ones2 = f32_tensor("ones2", &[3], &[1.0; 3]);
        let pairs = same_values(&[&w, &other, &ones, &w_t, &ones2]);
        assert_eq!(pairs, [("w".to_string(), "w_t".to_string())]);
    }
}

//! `--double-quant`: NF4's per-block absmax quantised again, bit for bit as bitsandbytes 0.50's
//! `quantize_4bit(..., compress_statistics=True)` on the CPU:
//! - `offset = absmax.mean()` in float32, summed in torch's order (`torch_sum`);
//! - `absmax − offset` (float32) through `quantize_blockwise(blocksize=256)` with the signed
//!   dynamic code map (`create_dynamic_map()`, 256 values): per block of 256 the float32
//!   `scale = max |v|`; an all-zero block stores codes 0; otherwise each value times
//!   `1 / scale`, clamped to ±1, and looked up in the CPU kernel's table of 65536 bins
//!   (`csrc/cpu_ops.cpp` `build_quantize_lut` / `norm_to_lut_index`): the nearest code to the
//!   bin's centre, not to the value itself, so small values can take a code next to theirs;
//! - the last block is as short as the count leaves it (no padding is stored).
//!
//! Dequantised (`dequantize_blockwise` + offset): `code[q] · scale + offset`, float32, a
//! product then a sum.

/// Values per nested block (bitsandbytes' fixed `blocksize=256` for the statistics).
pub const NESTED_BLOCK: usize = 256;

/// `create_dynamic_map()` (signed, 8 bits) as float32 bits: the `code` of bitsandbytes' nested
/// state (fixtures/reference/nf4/*.npz `dq/code`).
const DYNAMIC_MAP_BITS: [u32; 256] = [
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
];

/// bitsandbytes' signed dynamic code map (sorted, `−0.99297 … 1`).
pub fn dynamic_map() -> [f32; 256] {
    DYNAMIC_MAP_BITS.map(f32::from_bits)
}

/// The nested quantisation of one weight's absmax.
#[derive(Debug, Clone, PartialEq)]
pub struct Nested {
    /// One code a first-level block (bitsandbytes' `quant_state.absmax` when nested).
    pub codes: Vec<u8>,
    /// One float32 per 256 codes, the last block possibly short (`state2.absmax`).
    pub scales: Vec<f32>,
    /// The mean of the absmax (`quant_state.offset`).
    pub offset: f32,
}

/// Quantises the absmax of `nf4::quantize` (see the module doc).
pub fn quantize(absmax: &[f32]) -> Nested {
    let offset = torch_sum(absmax) / absmax.len() as f32;
    let centred: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
    let map = dynamic_map();
    let lut = lookup_table(&map);
    let mut codes = Vec::with_capacity(centred.len());
    let mut scales = Vec::with_capacity(centred.len().div_ceil(NESTED_BLOCK));
    for block in centred.chunks(NESTED_BLOCK) {
        let scale = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        scales.push(scale);
        if scale == 0.0 {
            // the kernel's early exit: an all-zero block stores code 0 (−0.99297 · 0)
            codes.extend(std::iter::repeat_n(0u8, block.len()));
            continue;
        }
        let inv = 1.0f32 / scale;
        codes.extend(block.iter().map(|v| lut[lut_index(v * inv)]));
    }
    Nested {
        codes,
        scales,
        offset,
    }
}

/// The float32 absmax `nested` stands for: `code[q] · scale + offset` (`dequantize_blockwise`,
/// then `absmax += offset`), what the graph's chain computes.
#[cfg(test)]
pub fn dequantize(nested: &Nested) -> Vec<f32> {
    let map = dynamic_map();
    nested
        .codes
        .iter()
        .enumerate()
        .map(|(i, &q)| map[q as usize] * nested.scales[i / NESTED_BLOCK] + nested.offset)
        .collect()
}

/// The CPU kernel's 65536-bin table: bin `i` stands for `2i / 65535 − 1` and holds the code
/// whose midpoints enclose it (a midpoint itself takes the lower code).
fn lookup_table(map: &[f32; 256]) -> Vec<u8> {
    let mids: Vec<f32> = map.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
    let mut code = 0usize;
    (0..65536u32)
        .map(|i| {
            let centre = (i as f32 + i as f32) / 65535.0 - 1.0;
            while code < mids.len() && mids[code] < centre {
                code += 1;
            }
            code as u8
        })
        .collect()
}

/// A scaled value's bin: `trunc(fma((v + 1) · 0.5, 65535, 0.5))`, the kernel's arithmetic as
/// compiled (its last multiply-add is fused).
fn lut_index(scaled: f32) -> usize {
    let v = scaled.clamp(-1.0, 1.0);
    let half = (v + 1.0) * 0.5;
    (half.mul_add(65535.0, 0.5) as i32 as usize) & 0xFFFF
}

/// torch's float32 `sum` of a contiguous vector on the CPU (`SumKernel.cpp` `cascade_sum`
/// with AVX2's 8 lanes, 4 rows of them at a time and a 4-level cascade), run in one thread: torch
/// splits vectors of 32768 values and more across its threads, where its result depends on
/// their count.
fn torch_sum(x: &[f32]) -> f32 {
    const LANES: usize = 8;
    if x.len() < LANES {
        return 0.0 + row_sum::<1>(x, x.len())[0];
    }
    let vectors = x.len() / LANES;
    let lanes = row_sum::<LANES>(x, vectors);
    let mut total = 0f32;
    for v in &x[vectors * LANES..] {
        total += v;
    }
    for l in lanes {
        total += l;
    }
    0.0 + total
}

/// `row_sum` over `count` vectors of `L` lanes (`x[k·L..k·L + L]` the k-th): four rows summed
/// by `multi_row_sum`, the rest onto the first, then the four folded in order.
fn row_sum<const L: usize>(x: &[f32], count: usize) -> [f32; L] {
    const ROWS: usize = 4;
    let groups = count / ROWS;
    let mut partial = multi_row_sum::<L>(x, groups);
    for k in groups * ROWS..count {
        add(&mut partial[0], &x[k * L..k * L + L]);
    }
    for k in 1..ROWS {
        let p = partial[k];
        add(&mut partial[0], &p);
    }
    partial[0]
}

/// `multi_row_sum` of `groups` groups of four vectors: each of the four rows into level 0,
/// carried up a level after every `2^power` groups while the group count's bits say so.
fn multi_row_sum<const L: usize>(x: &[f32], groups: usize) -> [[f32; L]; 4] {
    const LEVELS: usize = 4;
    let power = 4.max(ceil_log2(groups) / LEVELS);
    let step = 1usize << power;
    let mask = step - 1;
    let mut acc = [[[0f32; L]; 4]; LEVELS];
    let vector = |g: usize, k: usize| &x[(g * 4 + k) * L..(g * 4 + k + 1) * L];
    let mut i = 0;
    while i + step <= groups {
        for _ in 0..step {
            for (k, row) in acc[0].iter_mut().enumerate() {
                add(row, vector(i, k));
            }
            i += 1;
        }
        for j in 1..LEVELS {
            let (lower, upper) = acc.split_at_mut(j);
            for (up, below) in upper[0].iter_mut().zip(lower[j - 1].iter_mut()) {
                add(up, below);
                *below = [0.0; L];
            }
            if i & (mask << (j * power)) != 0 {
                break;
            }
        }
    }
    while i < groups {
        for (k, row) in acc[0].iter_mut().enumerate() {
            add(row, vector(i, k));
        }
        i += 1;
    }
    let (first, above) = acc.split_at_mut(1);
    for level in above.iter() {
        for (to, from) in first[0].iter_mut().zip(level) {
            add(to, from);
        }
    }
    acc[0]
}

fn add<const L: usize>(to: &mut [f32; L], v: &[f32]) {
    for (t, v) in to.iter_mut().zip(v) {
        *t += v;
    }
}

/// ATen's `CeilLog2` (1 for 0, 1 and 2).
fn ceil_log2(x: usize) -> usize {
    if x <= 2 {
        1
    } else {
        (usize::BITS - (x - 1).leading_zeros()) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// fixtures/generate_nf4.py `synthetic`: integers only, so numpy and Rust agree.
    fn synthetic(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| {
                let u = ((i as u64 * 2_654_435_761 + 12_345) % (1u64 << 32)) as f32;
                let x = u * 2f32.powi(-32) - 0.5;
                x * 2f32.powi(-((i / cols % 7) as i32))
            })
            .collect()
    }

    fn bits(v: &serde_json::Value) -> Vec<u32> {
        v.as_array()
            .expect("a list")
            .iter()
            .map(|b| b.as_u64().expect("bits") as u32)
            .collect()
    }

    #[test]
    fn equals_bitsandbytes_on_600_blocks() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/fixtures/reference/nf4/double_quant_synthetic.json"
        );
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).expect("the reference")).unwrap();
        let (rows, cols) = (r["rows"].as_u64().unwrap(), r["cols"].as_u64().unwrap());
        let w = synthetic(rows as usize, cols as usize);
        let absmax = super::super::nf4::quantize(&w, 64).absmax;
        let n = quantize(&absmax);
        let hex: String = n.codes.iter().map(|c| format!("{c:02x}")).collect();
        assert_eq!(hex, r["absmax_codes"].as_str().unwrap());
        assert_eq!(n.scales.len(), 3, "600 codes: blocks of 256, 256 and 88");
        let scales: Vec<u32> = n.scales.iter().map(|s| s.to_bits()).collect();
        assert_eq!(scales, bits(&r["absmax_scales"]));
        assert_eq!(n.offset.to_bits(), r["offset"].as_u64().unwrap() as u32);
        let back: Vec<u32> = dequantize(&n).iter().map(|a| a.to_bits()).collect();
        assert_eq!(back, bits(&r["absmax"]));
    }

    #[test]
    fn torch_sum_orders_the_additions_as_torch() {
        // 1e8 + 1 + 1 + ... : a plain running sum loses every 1, the lanes keep some
        let mut x = vec![1f32; 40];
        x[0] = 1e8;
        let running = x.iter().fold(0f32, |s, v| s + v);
        assert_eq!(running, 1e8);
        // lane 0 keeps 1e8 (its four ones lost), lanes 1..8 five ones each, added one lane at a
        // time: torch.ones(40) with x[0] = 1e8 sums to 100000056
        assert_eq!(torch_sum(&x), 1e8 + 56.0);
        assert_eq!(torch_sum(&[1.0, 2.0, 3.0]), 6.0);
    }

    #[test]
    fn equal_absmax_give_zero_scales_and_the_offset_back() {
        let n = quantize(&[0.25f32; 300]);
        assert_eq!(n.offset, 0.25);
        assert_eq!(n.scales, vec![0.0, 0.0]);
        assert!(n.codes.iter().all(|&c| c == 0));
        assert!(dequantize(&n).iter().all(|&a| a == 0.25));
    }

    #[test]
    fn bins_cover_the_range_and_zero_takes_the_code_beside_it() {
        let map = dynamic_map();
        assert_eq!((map[0], map[127], map[255]), (-0.992_968_75, 0.0, 1.0));
        assert!(map.windows(2).all(|w| w[0] < w[1]));
        let lut = lookup_table(&map);
        assert_eq!((lut_index(-1.0), lut_index(1.0)), (0, 65535));
        assert_eq!((lut[0], lut[65535]), (0, 255));
        // 0 lands in bin 32768 (centre 1.5e-5), nearer 2.125e-5 (code 131) than 0 (code 127)
        assert_eq!(lut_index(0.0), 32768);
        assert_eq!(lut[32768], 131);
    }
}

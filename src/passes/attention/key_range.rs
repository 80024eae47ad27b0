//! The keys a block of query rows can see. Where the masks leave every key from some column
//! `end` on at −∞ or below −1e30 (torch's `finfo.min`) for each row of the block, those keys'
//! probabilities are exactly 0, so the block's products need only the first `end` keys: under a
//! causal mask, the rows `[i, i + C)` read `i + C` keys instead of `Tk`, about half the passes
//! over the scores of a long sequence. `end` is computed per block at run time from the masks
//! themselves (no mask is assumed causal): the masks are applied to a score of 0, and a key
//! stays while any row of the block, in any batch, leaves it above −1e30. A block with a row
//! whose every key is masked keeps all keys: its softmax spreads over all of them, as exported.
//! The block's shapes then depend on data inside the `Scan`, which tract cannot type: `lower`
//! cuts the keys only in the backward of an attention whose forward is the fused operator (a
//! graph for onnxruntime already).

use ntl_ops::Builder;

use super::node::{additive_mask, Attn, MASKED_AT};
use crate::onnx::{FLOAT, INT64};

/// The outer graph's keys: their `[Tk]` float positions 1..=Tk, and Tk (`[1]` float and int64).
pub struct Keys {
    positions: String,
    count_f: String,
    count: String,
}

/// The keys' positions, where a mask can cut them (one has a key axis: rank 1 or more).
pub fn keys(b: &mut Builder, a: &Attn) -> Option<Keys> {
    if !a.terms.iter().any(|t| t.ranks.iter().any(|&r| r >= 1)) {
        return None;
    }
    let shape = b.node("Shape", &[&a.kt], "attention/kt_shape", vec![]);
    let r = a.kt_rank as i64;
    let count = b.slice(&shape, r - 1, r, 0, "attention/keys");
    let count_f = b.cast(&count, FLOAT, "attention/keys_f");
    let last = b.squeeze(&count, &[0], "attention/keys_s");
    let one = b.const_i64("attention/key_step", &[], &[1]);
    let stop = b.binary("Add", &last, &one, "attention/keys_stop");
    let positions = b.node("Range", &[&one, &stop, &one], "attention/key_index", vec![]);
    let positions = b.cast(&positions, FLOAT, "attention/key_positions");
    Some(Keys {
        positions,
        count_f,
        count,
    })
}

/// A block's keys: `end` (`[1]` int64), the number of leading keys any row of the block can
/// see, and `left_out` (`[1]`), the keys after them; `mask`, the block's masks as one additive
/// mask over all keys.
pub struct KeyCut {
    pub end: String,
    left_out: String,
    pub mask: String,
}

/// In a block's body: the keys the block reads, from the terms' inputs with the block's rows
/// (`terms[k]` for `a.terms[k]`).
pub fn block_end(b: &mut Builder, a: &Attn, terms: &[Vec<String>], keys: &Keys) -> KeyCut {
    let m = additive_mask(b, a, terms).expect("a block cuts keys only under masks");
    let rank = a.terms.iter().flat_map(|t| t.ranks.iter().copied()).max();
    let rank = rank.unwrap_or(0);
    // strictly below: a key at the bound itself is read (reading a key more is always exact)
    let bound = b.scalar_f32("attention/masked_below", MASKED_AT as f32);
    let masked = b.binary("Less", &m, &bound, "attention/key_masked");
    let masked = b.cast(&masked, FLOAT, "attention/key_masked_f");
    let r = rank as i64;
    // a key is cut when every row masks it; a row that masks every key keeps them all
    let all_but_keys: Vec<i64> = (0..r - 1).collect();
    let cut = if all_but_keys.is_empty() {
        masked.clone()
    } else {
        b.reduce(
            "ReduceMin",
            &masked,
            &all_but_keys,
            false,
            "attention/key_masked_everywhere",
        )
    };
    let one = b.scalar_f32("attention/key_one", 1.0);
    let seen = b.binary("Sub", &one, &cut, "attention/key_seen");
    let at = b.binary("Mul", &seen, &keys.positions, "attention/key_seen_at");
    let end = b.reduce("ReduceMax", &at, &[], false, "attention/keys_seen");
    let blind = b.reduce("ReduceMin", &masked, &[r - 1], false, "attention/row_blind");
    let blind = b.reduce("ReduceMax", &blind, &[], false, "attention/any_row_blind");
    let all = b.binary("Mul", &blind, &keys.count_f, "attention/all_keys");
    let end = b.binary("Max", &end, &all, "attention/block_keys_f");
    let end = b.cast(&end, INT64, "attention/block_keys_s");
    let end = b.reshape(&end, &[1], "attention/block_keys");
    let left_out = b.binary("Sub", &keys.count, &end, "attention/keys_left_out");
    KeyCut {
        end,
        left_out,
        mask: m,
    }
}

/// `x`'s first `end` entries along `axis` (all where that axis has one entry).
pub fn first(b: &mut Builder, x: &str, end: &str, axis: i64) -> String {
    let zero = b.const_i64("attention/key_start", &[1], &[0]);
    let axis = b.const_i64("attention/key_axis", &[1], &[axis]);
    b.node(
        "Slice",
        &[x, &zero, end, &axis],
        "attention/key_cut",
        vec![],
    )
}

/// A gradient over the block's keys along `axis` (of `rank`), padded with zeros to all keys.
pub fn padded(b: &mut Builder, g: &str, rank: usize, axis: usize, cut: &KeyCut) -> String {
    // ONNX pads: every axis's leading pads, then every axis's trailing pads
    let before = b.const_i64(
        "attention/no_pad",
        &[(rank + axis) as i64],
        &vec![0; rank + axis],
    );
    let mut parts = vec![before, cut.left_out.clone()];
    let after = rank - axis - 1;
    if after > 0 {
        parts.push(b.const_i64("attention/no_pad", &[after as i64], &vec![0; after]));
    }
    let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
    let pads = b.concat(&refs, 0, "attention/key_pads");
    b.node("Pad", &[g, &pads], "attention/key_padded", vec![])
}

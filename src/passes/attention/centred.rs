//! The blockwise backward's `dp − δ` as one matrix product. The softmax's gradient needs each
//! block's `dp = do·vᵀ` less its row's `δ = Σ p∘dp`; computed as written, `δ` and the
//! difference are three passes over the block's `[.., C, Tk]` scores (a product, a row sum, a
//! difference), which on a GPU cost more than the products themselves. Here `δ = do·o` (each
//! row's output, `o = p·v`, recomputed by one product over `[.., C, d]`), and the difference
//! comes out of the product that makes `dp`: `[do, δ, 0…]·[v, −1, 0…]ᵀ`, the values widened by
//! a row of −1 and the output's gradient by a column of `δ` (both padded with zeros to a
//! multiple of 8 columns, the width tensor-core kernels take). Under `--precision` the product
//! runs in the half type and rounds the difference once, where the written form rounds `dp`.

use ntl_ops::Builder;

use crate::onnx::FLOAT;

/// The values' `[.., d, Tk]` transpose with `w` rows after its `d` (`w = 8 − d mod 8`): the
/// first −1, the rest zeros; and the `[w]` row `1, 0…` that widens a block's `δ` alike.
pub struct Widened {
    pub vt: String,
    unit: String,
}

/// `vt` (`[.., d, Tk]` of `rank`, in the compute type `half` or float32) widened.
pub fn widen(b: &mut Builder, vt: &str, rank: usize, half: Option<i32>) -> Widened {
    let r = rank as i64;
    let shape = b.node("Shape", &[vt], "attention/vt_shape", vec![]);
    let d = b.slice(&shape, r - 2, r - 1, 0, "attention/head_size");
    let eight = b.const_i64("attention/lane", &[1], &[8]);
    let rem = b.binary("Mod", &d, &eight, "attention/head_size_rem");
    let w = b.binary("Sub", &eight, &rem, "attention/widening");
    let zero = b.const_i64("attention/unit_start", &[1], &[0]);
    let axis = b.const_i64("attention/unit_axis", &[1], &[0]);
    let units = b.const_f32("attention/units", &[8], &[1., 0., 0., 0., 0., 0., 0., 0.]);
    let unit = b.node(
        "Slice",
        &[&units, &zero, &w, &axis],
        "attention/unit",
        vec![],
    );
    let unit = match half {
        Some(h) => b.cast(&unit, h, "attention/unit_h"),
        None => unit,
    };
    let minus = b.unary("Neg", &unit, "attention/minus_unit");
    let column = b.unsqueeze(&minus, &[1], "attention/minus_unit_column");
    let batch = b.slice(&shape, 0, r - 2, 0, "attention/vt_batch");
    let keys = b.slice(&shape, r - 1, r, 0, "attention/vt_keys");
    let target = b.concat(&[&batch, &w, &keys], 0, "attention/widening_shape");
    let rows = b.node(
        "Expand",
        &[&column, &target],
        "attention/minus_ones_row",
        vec![],
    );
    let vt = b.concat(&[vt, &rows], r - 2, "attention/vt_widened");
    Widened { vt, unit }
}

/// In a block: `dp − δ` (float32, `[.., C, keys]`) from the block's probabilities `p_c`, values
/// `v_b` and widened transpose `vt_b` (its keys), and the output's gradient `g_c`, all in the
/// compute type.
pub fn centred(
    b: &mut Builder,
    w: &Widened,
    p_c: &str,
    v_b: &str,
    vt_b: &str,
    g_c: &str,
    half: Option<i32>,
) -> String {
    let to_float = |b: &mut Builder, x: &str| match half {
        Some(_) => b.cast(x, FLOAT, "attention/f"),
        None => x.to_string(),
    };
    let o = b.binary("MatMul", p_c, v_b, "attention/out_again");
    let o = to_float(b, &o);
    // δ from the rounded gradient the product reads, as `dp` is made of it
    let g = to_float(b, g_c);
    let go = b.binary("Mul", &g, &o, "attention/g_out");
    let delta = b.reduce_sum(&go, &[-1], true, "attention/delta");
    let delta = match half {
        Some(h) => b.cast(&delta, h, "attention/delta_h"),
        None => delta,
    };
    let columns = b.binary("Mul", &delta, &w.unit, "attention/delta_columns");
    let g_w = b.concat(&[g_c, &columns], -1, "attention/g_widened");
    let c = b.binary("MatMul", &g_w, vt_b, "attention/dp_centred");
    to_float(b, &c)
}

//! Operands both forms of the attention's forward (`lower`'s `Scan`, `fused`'s operator) and
//! the blockwise backward prepare alike.

use ntl_ops::Builder;

use super::node::Attn;
use crate::onnx::FLOAT;

pub fn scale_op(a: &Attn) -> &'static str {
    if a.scale_divides {
        "Div"
    } else {
        "Mul"
    }
}

/// `[.., 1, 1]` slices of the products' operands added: their broadcast batch shape `[..]`.
pub fn batch_shape(b: &mut Builder, a: &Attn) -> String {
    let corner = |b: &mut Builder, x: &str| {
        let zeros = b.const_i64("attention/corner_start", &[2], &[0, 0]);
        let ones = b.const_i64("attention/corner_end", &[2], &[1, 1]);
        let axes = b.const_i64("attention/corner_axes", &[2], &[-2, -1]);
        let c = b.node(
            "Slice",
            &[x, &zeros, &ones, &axes],
            "attention/corner",
            vec![],
        );
        // q, kt and v may differ in type (a half one arrives as it is)
        b.cast(&c, FLOAT, "attention/corner_f")
    };
    let q = corner(b, &a.q);
    let k = corner(b, &a.kt);
    let v = corner(b, &a.v);
    let qk = b.binary("Add", &q, &k, "attention/corner_qk");
    let all = b.binary("Add", &qk, &v, "attention/corner_all");
    let shape = b.node("Shape", &[&all], "attention/corner_shape", vec![]);
    b.slice(&shape, 0, a.rank as i64 - 2, 0, "attention/batch")
}

pub fn swap_last_two(b: &mut Builder, x: &str, rank: usize, hint: &str) -> String {
    let mut perm: Vec<i64> = (0..rank as i64).collect();
    perm.swap(rank - 2, rank - 1);
    b.transpose(x, &perm, hint)
}

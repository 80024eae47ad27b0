//! How many rows of a large 2-D weight a loop body reads at a time, and its product over them.
//!
//! A loop body that reads a frozen weight whole from the outer graph makes the runtime keep its
//! float32 copy through the whole loop. Above [`BLOCK_BYTES`] the body reads it in row blocks
//! instead (a half weight widened block by block, a quantised one dequantised block by block),
//! so one block's copy exists at a time.

use crate::onnx::{int_attr, NodeProto};
use crate::Builder;

/// The most bytes of one block's float32 copy; weights up to this size keep one copy before
/// the loop (cheaper than one per iteration, and no bigger).
pub const BLOCK_BYTES: i64 = 32 << 20;
/// Blocks of a weight over `BLOCK_BYTES` at least: each block's copies stay well under what
/// reading in blocks saves.
pub const MIN_BLOCKS: i64 = 8;

/// A `[rows, cols]` weight's rows and rows per block, where it is over `BLOCK_BYTES` as float32.
pub fn plan(shape: &[i64]) -> Option<(i64, i64)> {
    let [rows, cols] = shape[..] else { return None };
    let bytes = rows * cols * 4;
    let blocks = MIN_BLOCKS
        .max((bytes + BLOCK_BYTES - 1) / BLOCK_BYTES)
        .min(rows);
    (bytes > BLOCK_BYTES && blocks > 1).then(|| (rows, (rows + blocks - 1) / blocks))
}

/// The weight W of a plain `Gemm(a, W[, transB])` (no `C`, `transA`, `alpha`, `beta`): the
/// products [`product_in_blocks`] can write over W's row blocks.
pub fn plain_gemm_weight(node: &NodeProto) -> Option<&str> {
    if node.op_type() != "Gemm" || !node.domain().is_empty() || node.input.len() != 2 {
        return None;
    }
    let plain = node.attribute.iter().all(|a| a.name() == "transB");
    plain.then(|| node.input[1].as_str())
}

/// `Gemm(a, W[, transB])` written to `out` over W's `rows` in blocks of `per`: `block(b, start,
/// end)` emits the float32 rows `start..end` of W. The blocks' products are concatenated on
/// axis 1 (`trans_b`: W's rows are output columns) or summed with `a`'s matching columns
/// (W's rows are the contraction). `hint`: the name prefix of the nodes (e.g. `amp`).
pub fn product_in_blocks(
    b: &mut Builder,
    a: &str,
    trans_b: bool,
    (rows, per): (i64, i64),
    out: &str,
    hint: &str,
    mut block: impl FnMut(&mut Builder, i64, i64) -> String,
) {
    let mut parts = Vec::new();
    let mut start = 0;
    while start < rows {
        let end = (start + per).min(rows);
        let w = block(b, start, end);
        let a = if trans_b {
            a.to_string()
        } else {
            b.slice(a, start, end, 1, &format!("{hint}/block_rows"))
        };
        let attrs = vec![int_attr("transB", trans_b as i64)];
        let product = format!("{hint}/block_product");
        parts.push(b.node("Gemm", &[&a, &w], &product, attrs));
        start = end;
    }
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    let (op, attrs) = if trans_b {
        ("Concat", vec![int_attr("axis", 1)])
    } else {
        ("Sum", vec![])
    };
    b.node_to(op, &parts, &[out], attrs);
}

//! A loop body's `Gemm` that reads a large frozen half weight whole (the fused head's `h·Wᵀ`
//! and `dz·W` in its `Scan`s, W the `[V, d]` head or tied embedding) reads it in row blocks:
//! per block a `Slice` of the half weight (sliced no earlier than the product's activation,
//! `Builder::after`), widened by its own `Cast`, and a `Gemm` of its own; the blocks' products
//! are concatenated (`transB`: the rows are output columns) or summed (the rows are the
//! contraction).
//!
//! Without it the body reads the widened weight from the outer graph, so `cast_per_use` widens
//! all of it before the `Scan` and that float32 copy lives through the whole loop: at the
//! Qwen2 vocabulary (151 936 × 1536) 890 MiB, more than the half base saves on the head
//! (bench/README.md, "Half base: where the float copies are"). Blocked, one block's float16
//! and float32 copies exist at a time. The logits are the same products; `dz·W` sums the
//! blocks' partial products in float32 (a different order of the same sum: float32 rounding).

use std::collections::HashMap;

use crate::graph::patch::rewrite_bodies;
use crate::onnx::{attr_i, NodeProto, FLOAT};
use ntl_ops::row_blocks::{plain_gemm_weight, plan, product_in_blocks};
use ntl_ops::Builder;

use super::widened::Widened;

/// Rewrites, in each body of `node`, the Gemms that read a widened weight of `widened` from
/// the outer graph whole (`dims`: the half tensors' shapes where known).
pub fn block_bodies(
    node: &mut NodeProto,
    widened: &HashMap<String, Widened>,
    dims: &HashMap<String, Vec<i64>>,
    b: &mut Builder,
) {
    rewrite_bodies(node, |n| {
        let (half, rows, per) = blocks_of(n, widened, dims)?;
        let before = b.nodes.len();
        emit_blocked(b, n, half, rows, per);
        Some(b.nodes.drain(before..).collect())
    });
}

/// The half weight a body's plain `Gemm(a, W)` reads whole, its rows and the rows per block,
/// where W is widened, 2-D and over `BLOCK_BYTES` as float32.
fn blocks_of<'a>(
    node: &NodeProto,
    widened: &'a HashMap<String, Widened>,
    dims: &HashMap<String, Vec<i64>>,
) -> Option<(&'a str, i64, i64)> {
    let w = widened.get(plain_gemm_weight(node)?)?;
    let (rows, per) = plan(dims.get(&w.half)?)?;
    Some((w.half.as_str(), rows, per))
}

/// `node`'s product over row blocks of `half` (module doc), writing `node`'s output.
fn emit_blocked(b: &mut Builder, node: &NodeProto, half: &str, rows: i64, per: i64) {
    let trans_b = attr_i(node, "transB").unwrap_or(0) == 1;
    // the two uses in one body (z's recomputation and dh) slice with differently written
    // axes, so onnxruntime's constant sharing and CSE cannot merge their slices into blocks
    // that live from the first use to the second
    let axis = if trans_b { 0 } else { -2 };
    // the blocks are sliced no earlier than the activation (see `Builder::after`)
    let half = b.after(half, &node.input[0], "amp/frozen_after");
    let a = &node.input[0];
    product_in_blocks(
        b,
        a,
        trans_b,
        (rows, per),
        &node.output[0],
        "amp",
        |b, start, end| {
            let block = b.slice(&half, start, end, axis, "amp/frozen_block");
            b.cast(&block, FLOAT, "amp/frozen_block_f32")
        },
    );
}

#[cfg(test)]
mod tests {
    use super::block_bodies;
    use crate::onnx::{attr_i, FLOAT};
    use crate::onnx::{graph_attr, int_attr, GraphProto, NodeProto};
    use crate::passes::step::precision::widened::Widened;
    use ntl_ops::row_blocks::MIN_BLOCKS;
    use ntl_ops::Builder;
    use std::collections::{HashMap, HashSet};

    fn gemm(a: &str, w: &str, out: &str, trans_b: i64) -> NodeProto {
        NodeProto {
            op_type: Some("Gemm".into()),
            input: vec![a.into(), w.into()],
            output: vec![out.into()],
            attribute: vec![int_attr("transB", trans_b)],
            ..Default::default()
        }
    }

    /// A Scan whose body multiplies by the widened weight both ways, as the fused head's
    /// backward does; the half weight is `[rows, 1024]`.
    fn blocked(rows: i64) -> GraphProto {
        let body = GraphProto {
            node: vec![gemm("h", "w_f32", "z", 1), gemm("dz", "w_f32", "dh", 0)],
            ..Default::default()
        };
        let mut scan = NodeProto {
            op_type: Some("Scan".into()),
            attribute: vec![graph_attr("body", body)],
            ..Default::default()
        };
        let widened = HashMap::from([(
            "w_f32".to_string(),
            Widened {
                half: "w".into(),
                half_type: 10,
            },
        )]);
        let dims = HashMap::from([("w".to_string(), vec![rows, 1024])]);
        let mut b = Builder::new("ntl", 17, HashSet::new());
        block_bodies(&mut scan, &widened, &dims, &mut b);
        scan.attribute[0].g.clone().unwrap()
    }

    fn count(g: &GraphProto, op: &str) -> usize {
        g.node.iter().filter(|n| n.op_type() == op).count()
    }

    #[test]
    fn a_large_weight_is_read_in_blocks_each_widened_in_the_body() {
        let body = blocked(65536); // 256 MiB as float32: 8 blocks per use
        let blocks = MIN_BLOCKS as usize;
        assert_eq!(count(&body, "Gemm"), 2 * blocks);
        let widening = body
            .node
            .iter()
            .filter(|n| n.op_type() == "Cast" && attr_i(n, "to") == Some(FLOAT as i64))
            .count();
        assert_eq!(widening, 2 * blocks);
        // each use reads the half weight once, through a wait for its activation, then slices
        let waits: Vec<&str> = body
            .node
            .iter()
            .filter(|n| n.op_type() == "Reshape" && n.input[0] == "w")
            .map(|n| n.output[0].as_str())
            .collect();
        assert_eq!(waits.len(), 2);
        let reads_half = body
            .node
            .iter()
            .filter(|n| n.op_type() == "Slice" && waits.contains(&n.input[0].as_str()))
            .count();
        assert_eq!(reads_half, 2 * blocks);
        assert!(body
            .node
            .iter()
            .all(|n| !n.input.iter().any(|i| i == "w_f32")));
        // the logits' blocks are concatenated, dz·W's summed, into the same outputs
        let concat = body.node.iter().find(|n| n.op_type() == "Concat").unwrap();
        assert_eq!(
            (concat.output[0].as_str(), concat.input.len()),
            ("z", blocks)
        );
        let sum = body.node.iter().find(|n| n.op_type() == "Sum").unwrap();
        assert_eq!((sum.output[0].as_str(), sum.input.len()), ("dh", blocks));
    }

    #[test]
    fn a_weight_within_one_block_keeps_its_widening_before_the_loop() {
        let body = blocked(8192); // 32 MiB as float32
        assert_eq!(count(&body, "Gemm"), 2);
        assert!(body.node.iter().all(|n| n.input[1] == "w_f32"));
    }
}

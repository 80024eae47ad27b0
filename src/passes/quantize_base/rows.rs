//! Reading some rows of a quantised weight without dequantising the rest.
//!
//! Two readers need only part of a large `[rows, cols]` weight at a time:
//! - a `Gather` of rows (an LM head's number rows, which the fused head gathers);
//! - a loop body's product with the whole weight (the fused head's `h·Wᵀ` and `dz·W` in its
//!   `Scan`).
//!
//! A per-use copy of the whole chain would make a float32 copy of the weight, 8× its NF4
//! bytes: 2.2 GB for a 152 064 × 3 584 head. The loop's copy would live through the whole loop.
//! Instead the stored tensors are viewed as rows:
//! - NF4 codes as `[rows, cols/2]`, the absmax as `[rows, cols/block]`;
//! - int8 codes as `[rows, cols]`, the scales as `[rows, cols/block]`.
//!
//! A row then holds whole blocks, as long as the block divides `cols`. The wanted rows are
//! taken (`Gather`, or a `Slice` per block of rows in the loop body, as the half base's
//! blocked reads do), and only those are dequantised. The factors are the same float32 values,
//! so the rows are bit-equal to the whole chain's.
//!
//! Not read by rows, so the whole per-use copy stays:
//! - weights stored `[in, out]`, whose rows are not torch's;
//! - blocks that do not divide `cols`;
//! - int4 (not every runtime reshapes or slices int4 tensors).

use ntl_ops::row_blocks::{plain_gemm_weight, plan, product_in_blocks};
use ntl_ops::Builder;

use super::{per_use::instantiate, QuantizedBase, QuantizedWeight, Scheme};
use crate::graph::patch::rewrite_bodies;
use crate::onnx::{attr_i, int_attr, NodeProto, INT32};
use crate::passes::lora::linear::Layout;

/// A quantised weight whose rows can be read alone.
pub struct Rows<'a> {
    w: &'a QuantizedWeight,
    scheme: Scheme,
    block: i64,
    /// NF4's byte → code-pair table.
    table: Option<&'a str>,
    /// The nodes that dequantise a `--double-quant` absmax (empty otherwise).
    factors_recipe: Vec<NodeProto>,
}

impl<'a> Rows<'a> {
    /// `w` read by rows, where it can be (module doc); `recipe`: its whole chain's nodes.
    pub fn of(q: &'a QuantizedBase, w: &'a QuantizedWeight, recipe: &[NodeProto]) -> Option<Self> {
        let block = q.options.block;
        let fits = w.layout == Layout::OutIn && w.in_features % block == 0;
        if !fits || q.options.scheme == Scheme::Int4 {
            return None;
        }
        let factors_recipe = match &w.nested {
            None => Vec::new(),
            Some(_) => {
                let end = recipe
                    .iter()
                    .position(|n| n.output.first() == Some(&w.factors))?;
                recipe[..=end].to_vec()
            }
        };
        Some(Rows {
            w,
            scheme: q.options.scheme,
            block,
            table: q.pair_table.as_deref(),
            factors_recipe,
        })
    }

    fn cols(&self) -> i64 {
        self.w.in_features
    }

    /// The stored codes (read no earlier than `like`) and the factors, each viewed as rows.
    fn views(&self, b: &mut Builder, like: &str) -> (String, String) {
        let rows = self.w.out_features;
        let codes = b.after(&self.w.codes, like, "qlora/rows_after");
        let code_cols = match self.scheme {
            Scheme::Nf4 => self.cols() / 2,
            Scheme::Int4 | Scheme::Int8 => self.cols(),
        };
        let codes = b.reshape(&codes, &[rows, code_cols], "qlora/code_rows");
        let factors = if self.factors_recipe.is_empty() {
            self.w.factors.clone()
        } else {
            let (mut nodes, last) = instantiate(&self.factors_recipe, Some(like), b);
            b.nodes.append(&mut nodes);
            last
        };
        let factors = b.reshape(
            &factors,
            &[rows, self.cols() / self.block],
            "qlora/factor_rows",
        );
        (codes, factors)
    }

    /// The float32 rows of the taken `codes` and `factors` rows, reshaped to `shape`.
    fn dequantize(&self, b: &mut Builder, codes: &str, factors: &str, shape: &str, out: &str) {
        let block = self.block;
        let blocks = match self.scheme {
            Scheme::Nf4 => {
                let table = self.table.expect("NF4 has its pair table");
                let idx = b.cast(codes, INT32, "qlora/rows_idx");
                let pairs = b.gather(table, &idx, 0, "qlora/rows_pairs");
                let in_blocks = b.reshape(&pairs, &[-1, block], "qlora/rows_blocks");
                let column = b.reshape(factors, &[-1, 1], "qlora/rows_factors");
                b.binary("Mul", &in_blocks, &column, "qlora/rows_scaled")
            }
            Scheme::Int4 | Scheme::Int8 => {
                let in_blocks = b.reshape(codes, &[-1, block], "qlora/rows_blocks");
                let flat = b.reshape(factors, &[-1], "qlora/rows_factors");
                b.node(
                    "DequantizeLinear",
                    &[&in_blocks, &flat],
                    "qlora/rows_scaled",
                    vec![int_attr("axis", 0)],
                )
            }
        };
        b.node_to("Reshape", &[&blocks, shape], &[out], vec![]);
    }

    /// `Gather(W, ids)` on axis 0, writing `out`: the ids' rows alone dequantised.
    pub fn gather(&self, b: &mut Builder, ids: &str, out: &str) {
        let (codes, factors) = self.views(b, ids);
        let codes = b.gather(&codes, ids, 0, "qlora/gathered_codes");
        let factors = b.gather(&factors, ids, 0, "qlora/gathered_factors");
        let ids_shape = b.unary("Shape", ids, "qlora/ids_shape");
        let width = b.const_i64("qlora/row_width", &[1], &[self.cols()]);
        let shape = b.concat(&[&ids_shape, &width], 0, "qlora/gathered_shape");
        self.dequantize(b, &codes, &factors, &shape, out);
    }

    /// `gemm` = `Gemm(a, W[, transB])` over blocks of W's rows, each dequantised on its own,
    /// writing `gemm`'s output: the blocks' products concatenated (`transB`: the rows are
    /// output columns) or summed (the rows are the contraction).
    fn blocked_product(&self, b: &mut Builder, gemm: &NodeProto, per: i64) {
        let rows = self.w.out_features;
        let trans_b = attr_i(gemm, "transB").unwrap_or(0) == 1;
        let a = &gemm.input[0];
        let (codes, factors) = self.views(b, a);
        let shape = b.const_i64("qlora/block_shape", &[2], &[-1, self.cols()]);
        let out = &gemm.output[0];
        product_in_blocks(b, a, trans_b, (rows, per), out, "qlora", |b, start, end| {
            let c = b.slice(&codes, start, end, 0, "qlora/block_codes");
            let f = b.slice(&factors, start, end, 0, "qlora/block_factors");
            let w = b.fresh("qlora/block_w");
            self.dequantize(b, &c, &f, &shape, &w);
            w
        });
    }
}

/// A top-level reader that takes rows of a weight: `Gather(W, ids)` on axis 0.
pub fn gathered_weight(node: &NodeProto) -> Option<&str> {
    let gather = node.op_type() == "Gather" && node.domain().is_empty() && node.input.len() == 2;
    (gather && attr_i(node, "axis").unwrap_or(0) == 0).then(|| node.input[0].as_str())
}

/// Rewrites, in each body of `node`, the plain `Gemm`s that read a large weight `rows_of` can
/// read by rows (and that weight whole) into products over row blocks. Returns whether any
/// changed.
pub fn block_bodies<'a>(
    node: &mut NodeProto,
    rows_of: &dyn Fn(&str) -> Option<&'a Rows<'a>>,
    b: &mut Builder,
) -> bool {
    rewrite_bodies(node, |n| {
        let rows = rows_of(plain_gemm_weight(n)?)?;
        let (_, per) = plan(&[rows.w.out_features, rows.w.in_features])?;
        let before = b.nodes.len();
        rows.blocked_product(b, n, per);
        Some(b.nodes.drain(before..).collect())
    })
}

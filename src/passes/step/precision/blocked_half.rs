//! `--precision`'s half products with a large frozen half weight in a loop body (the fused
//! head's `h·Wᵀ` and `dz·W` in its `Scan`s, read through the outer `Identity` of the weight)
//! run over row blocks of the weight, as `blocked_reads` does for float32 products: per block
//! a `Slice` of the half weight and a half `MatMul` (after a `Transpose` of the block for
//! `Wᵀ`); the logits' blocks are concatenated, `dz·W`'s partial products summed in float32
//! and rounded back to the half type once.
//!
//! Why: onnxruntime's CPU provider has no float16 `MatMul`; it casts each float16 input of one
//! to float32 itself, in a body per iteration, so reading the whole `[V, d]` head made a
//! `Transpose` and up to two float32 copies of all of it per iteration (2.2 GiB at the Qwen2
//! vocabulary), and its arena kept more (bench/README.md, "Half base: where the float copies
//! are"). Blocked, its casts are of one block. A GPU runs the same half products, in blocks.

use std::collections::{HashMap, HashSet};

use crate::graph::patch::{splice, Splice};
use crate::graph::reads::outer_reads;
use crate::onnx::{attr_ints, int_attr, GraphProto, NodeProto, FLOAT};
use ntl_ops::row_blocks::plan;
use ntl_ops::Builder;

/// An outer half tensor that is a kept half weight itself: the weight, its type, its shape.
#[derive(Debug, Clone)]
pub struct HalfAlias {
    pub half: String,
    pub half_type: i32,
    pub dims: Vec<i64>,
}

/// Rewrites, in each body of `node`, the half `MatMul`s that read an aliased weight whole,
/// directly (`a·W`) or through a `Transpose` only they read (`a·Wᵀ`).
pub fn block_half_bodies(
    node: &mut NodeProto,
    aliases: &HashMap<String, HalfAlias>,
    b: &mut Builder,
) {
    for a in &mut node.attribute {
        for g in a.g.iter_mut().chain(a.graphs.iter_mut()) {
            block_body(g, aliases, b);
        }
    }
}

fn block_body(body: &mut GraphProto, aliases: &HashMap<String, HalfAlias>, b: &mut Builder) {
    let transposed = transposes_read_once(body, aliases);
    // each blocked product (and the transposes it now reads past) replaced
    let mut replace = std::collections::BTreeMap::new();
    for (at, node) in body.node.iter().enumerate() {
        if transposed.contains_key(node.output.first().map(String::as_str).unwrap_or("")) {
            replace.insert(at, Vec::new()); // read blocked by its MatMul below
            continue;
        }
        let read =
            (node.op_type() == "MatMul" && node.domain().is_empty() && node.input.len() == 2)
                .then(|| &node.input[1])
                .and_then(|w| match transposed.get(w.as_str()) {
                    Some(x) => Some((&aliases[x], true)),
                    None => aliases.get(w).map(|x| (x, false)),
                });
        let Some((alias, trans)) = read else {
            continue;
        };
        if let Some((rows, per)) = plan(&alias.dims) {
            let before = b.nodes.len();
            emit_blocked(b, node, alias, trans, rows, per);
            replace.insert(at, b.nodes.drain(before..).collect());
        }
    }
    splice(body, Splice::replace(replace));
}

/// Body `Transpose(X, perm [1, 0])` of an aliased X large enough to block, whose output only
/// one `MatMul` reads, as its second input: output -> X.
fn transposes_read_once(
    body: &GraphProto,
    aliases: &HashMap<String, HalfAlias>,
) -> HashMap<String, String> {
    let mut reads: HashMap<&str, Vec<(&NodeProto, usize)>> = HashMap::new();
    for n in &body.node {
        for (i, x) in n.input.iter().enumerate() {
            reads.entry(x.as_str()).or_default().push((n, i));
        }
    }
    // read elsewhere: the body's outputs, a nested body
    let mut outputs: HashSet<String> = body.output.iter().map(|o| o.name().to_string()).collect();
    outputs.extend(
        body.node
            .iter()
            .flat_map(|n| outer_reads(n).into_iter().map(str::to_string)),
    );
    body.node
        .iter()
        .filter(|n| n.op_type() == "Transpose" && n.domain().is_empty() && n.output.len() == 1)
        .filter(|n| {
            n.input
                .first()
                .and_then(|x| aliases.get(x))
                .is_some_and(|x| plan(&x.dims).is_some())
        })
        .filter(|n| attr_ints(n, "perm").as_deref() == Some(&[1, 0][..]))
        .filter(|n| !outputs.contains(&n.output[0]))
        .filter(|n| {
            matches!(reads.get(n.output[0].as_str()).map(Vec::as_slice),
                Some([(m, 1)]) if m.op_type() == "MatMul" && m.domain().is_empty())
        })
        .map(|n| (n.output[0].clone(), n.input[0].clone()))
        .collect()
}

/// `node`'s half product over row blocks of the weight (module doc), writing its output.
fn emit_blocked(
    b: &mut Builder,
    node: &NodeProto,
    alias: &HalfAlias,
    trans: bool,
    rows: i64,
    per: i64,
) {
    // differently written axes per use: onnxruntime cannot merge the two uses' slices (as
    // blocked_reads)
    let axis = if trans { 0 } else { -2 };
    let mut parts = Vec::new();
    let mut start = 0;
    while start < rows {
        let end = (start + per).min(rows);
        let block = b.slice(&alias.half, start, end, axis, "amp/frozen_block");
        let part = if trans {
            let t = b.transpose(&block, &[1, 0], "amp/frozen_block_t");
            b.node("MatMul", &[&node.input[0], &t], "amp/block_product", vec![])
        } else {
            let a = b.slice(&node.input[0], start, end, -1, "amp/block_rows");
            let p = b.node("MatMul", &[&a, &block], "amp/block_product", vec![]);
            b.cast(&p, FLOAT, "amp/block_product_f32")
        };
        parts.push(part);
        start = end;
    }
    let parts: Vec<&str> = parts.iter().map(String::as_str).collect();
    if trans {
        b.node_to(
            "Concat",
            &parts,
            &[&node.output[0]],
            vec![int_attr("axis", -1)],
        );
    } else {
        let sum = b.node("Sum", &parts, "amp/block_sum", vec![]);
        b.node_to(
            "Cast",
            &[&sum],
            &[&node.output[0]],
            vec![int_attr("to", alias.half_type as i64)],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{block_half_bodies, HalfAlias};
    use crate::onnx::{attr_i, graph_attr, ints_attr, GraphProto, NodeProto};
    use ntl_ops::row_blocks::MIN_BLOCKS;
    use ntl_ops::Builder;
    use std::collections::{HashMap, HashSet};

    fn node(op: &str, inputs: &[&str], out: &str) -> NodeProto {
        NodeProto {
            op_type: Some(op.into()),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: vec![out.into()],
            ..Default::default()
        }
    }

    /// The fused head's backward body under `--precision fp16`: `z = h·Wᵀ`, `dh = dz·W`, W
    /// read through the outer `w_half` (an Identity of the `[rows, 1024]` weight `w`).
    fn blocked(rows: i64) -> GraphProto {
        let mut t = node("Transpose", &["w_half"], "t");
        t.attribute.push(ints_attr("perm", &[1, 0]));
        let body = GraphProto {
            node: vec![
                t,
                node("MatMul", &["h", "t"], "z"),
                node("MatMul", &["dz", "w_half"], "dh"),
            ],
            ..Default::default()
        };
        let mut scan = NodeProto {
            op_type: Some("Scan".into()),
            attribute: vec![graph_attr("body", body)],
            ..Default::default()
        };
        let alias = HalfAlias {
            half: "w".into(),
            half_type: 10,
            dims: vec![rows, 1024],
        };
        let aliases = HashMap::from([("w_half".to_string(), alias)]);
        let mut b = Builder::new("ntl", 17, HashSet::new());
        block_half_bodies(&mut scan, &aliases, &mut b);
        scan.attribute[0].g.clone().unwrap()
    }

    fn count(g: &GraphProto, op: &str) -> usize {
        g.node.iter().filter(|n| n.op_type() == op).count()
    }

    #[test]
    fn half_products_with_a_large_weight_run_over_its_blocks() {
        let body = blocked(65536);
        let blocks = MIN_BLOCKS as usize;
        assert_eq!(count(&body, "MatMul"), 2 * blocks);
        assert!(body
            .node
            .iter()
            .all(|n| !n.input.iter().any(|i| i == "w_half" || i == "t")));
        let concat = body.node.iter().find(|n| n.op_type() == "Concat").unwrap();
        assert_eq!(concat.output[0], "z");
        // dz·W: float32 sum of the blocks, rounded back to float16 once
        let back = body.node.iter().find(|n| n.output[0] == "dh").unwrap();
        assert_eq!((back.op_type(), attr_i(back, "to")), ("Cast", Some(10)));
    }

    #[test]
    fn a_small_weight_keeps_its_products() {
        let body = blocked(8192);
        assert_eq!(count(&body, "MatMul"), 2);
        assert_eq!(count(&body, "Transpose"), 1);
    }
}

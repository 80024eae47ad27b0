//! `Transpose(Gemm(a, b, transA=1))` → `Gemm(b, a, transA=1)`: a weight stored `[out, in]`
//! and read through a `Transpose` (torch's `Linear` exported as `MatMul(x, Transpose(W))`)
//! gets its gradient `(xᵀ·dy)ᵀ` as one product `dyᵀ·x` — the same products, summed in the
//! same order. Left as a pair, onnxruntime fuses it into a new `Gemm`, and a node it adds gets
//! the highest index: its PRIORITY_BASED order (recompute graphs) then runs every weight
//! gradient at the end of the backward and keeps the activations it reads alive until then.

use std::collections::HashMap;

use crate::graph::reads::outer_reads;
use crate::onnx::{attr_i, attr_ints, NodeProto};

/// Folds each such pair among `nodes[from..]` (the backward just emitted) whose product has
/// no reader but the `Transpose` and is not one of the `kept` gradients; `gradient_of` entries
/// naming a folded product are dropped.
pub fn fold(
    nodes: &mut Vec<NodeProto>,
    from: usize,
    kept: &[String],
    gradient_of: &mut HashMap<String, String>,
) {
    let mut readers: HashMap<String, usize> = kept.iter().map(|g| (g.clone(), 1)).collect();
    for n in &nodes[from..] {
        for i in &n.input {
            *readers.entry(i.clone()).or_default() += 1;
        }
        for i in outer_reads(n) {
            // a product a subgraph reads is never folded
            *readers.entry(i.to_string()).or_default() += 2;
        }
    }
    let producer: HashMap<&str, usize> = nodes[from..]
        .iter()
        .enumerate()
        .flat_map(|(k, n)| n.output.iter().map(move |o| (o.as_str(), from + k)))
        .collect();
    let mut folds: Vec<(usize, usize)> = Vec::new(); // (Gemm, Transpose)
    for (k, n) in nodes.iter().enumerate().skip(from) {
        if n.op_type() != "Transpose" || attr_ints(n, "perm").as_deref() != Some(&[1, 0][..]) {
            continue;
        }
        let Some(&p) = producer.get(n.input[0].as_str()) else {
            continue;
        };
        if is_transposed_product(&nodes[p]) && readers.get(&n.input[0]) == Some(&1) {
            folds.push((p, k));
        }
    }
    if folds.is_empty() {
        return;
    }
    let mut dropped = Vec::new();
    for &(p, k) in &folds {
        let out = nodes[k].output[0].clone();
        let gemm = &mut nodes[p];
        dropped.push(std::mem::replace(&mut gemm.output[0], out));
        gemm.input.swap(0, 1);
    }
    gradient_of.retain(|_, g| !dropped.contains(g));
    let transposes: std::collections::HashSet<usize> = folds.iter().map(|&(_, k)| k).collect();
    let mut index = 0..;
    nodes.retain(|_| !transposes.contains(&index.next().expect("unbounded")));
}

/// `Gemm(a, b)` with `transA=1` and nothing else: `aᵀ·b`.
fn is_transposed_product(n: &NodeProto) -> bool {
    n.op_type() == "Gemm"
        && n.input.len() == 2
        && attr_i(n, "transA") == Some(1)
        && n.attribute.len() == 1
}

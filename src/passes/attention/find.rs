//! Finding attention in an exported forward graph: `MatMul(q, kt)`, then identity casts, at
//! most one scale (`Mul`, or `Div` by it), at most one soft-cap (`÷ c`, `Tanh`, `× c`: Gemma
//! 2's) and any number of masks (`Add` of a bias, `Where` with a fill value) in the graph's
//! order, a `Softmax` over the last axis, identity casts or inference-mode `Dropout`s, and
//! `MatMul(p, v)`. That covers the exporters' spellings: eager
//! and SDPA attention of both torch exporters (the scale on the scores, or split over q and k —
//! then it belongs to q and kt), GQA's repeated keys (they arrive as `kt`), GPT-2's `Where` on a
//! causal buffer, padding masks, bidirectional encoders (no mask at all).
//!
//! Every tensor between the two products must be read only by the next step, and nothing that
//! shapes the scores (scale, masks) may depend on a weight: its gradient would need the scores.

use crate::graph::ranks::Ranks;
use crate::graph::GraphIndex;
use crate::onnx::{attr_i, NodeProto};
use ntl_ops::names::PREFIX;

use super::node::{Attn, Term, TermKind};
use crate::passes::contract::MapStep;
use crate::passes::pointwise_map::{self, PointwiseMap};

/// One recognised attention.
pub struct Site {
    /// The nodes it replaces (the score product, everything between, the value product).
    pub nodes: Vec<usize>,
    /// The value product: the attention node takes its place and its output.
    pub value_product: usize,
    pub attn: Attn,
}

/// An attention-like `Softmax` left as exported, and why.
pub struct Left {
    pub softmax: String,
    pub why: String,
}

/// Layout ops an attention may put between its products and its softmax (BLOOM's `view`s):
/// such an attention is reported as left, not rewritten.
const LAYOUT: &[&str] = &["Reshape", "Squeeze", "Unsqueeze", "Transpose", "Expand"];

/// How deep the search from the softmax back to the score product goes.
const MAX_CHAIN: usize = 12;

pub struct Finder<'a, 'g> {
    pub index: &'a GraphIndex<'g>,
    pub ranks: &'a Ranks,
    pub types: &'a crate::graph::elem_types::ElemTypes,
    pub opset: i64,
    /// Tensors computed from weights (float initializers of two or more elements).
    pub weight_derived: &'a std::collections::HashSet<String>,
}

impl Finder<'_, '_> {
    /// Every attention-like softmax of the graph: recognised, or left with the reason.
    pub fn find(&self) -> (Vec<Site>, Vec<Left>) {
        let mut sites = Vec::new();
        let mut left = Vec::new();
        for (i, node) in self.index.graph.node.iter().enumerate() {
            if node.op_type() != "Softmax" || !node.domain().is_empty() {
                continue;
            }
            // the number losses' own softmaxes are ntl-patch's, never attention
            if node.name().starts_with(&format!("{PREFIX}/")) {
                continue;
            }
            if !self.attention_like(node) {
                continue;
            }
            match self.site(i, node) {
                Ok(site) => sites.push(site),
                Err(why) => left.push(Left {
                    softmax: node.name().to_string(),
                    why,
                }),
            }
        }
        (sites, left)
    }

    /// A softmax between two products: its scores come from a `MatMul` through elementwise
    /// steps, and its probabilities reach one.
    fn attention_like(&self, softmax: &NodeProto) -> bool {
        let from_product = self
            .chain_to_product(&softmax.input[0], MAX_CHAIN, false)
            .is_ok();
        from_product && self.reaches_product(&softmax.output[0], MAX_CHAIN)
    }

    /// Whether a reader of `x`, through pass-through and layout steps, is a `MatMul`.
    fn reaches_product(&self, x: &str, depth: usize) -> bool {
        depth > 0
            && self.index.consumers(x).iter().any(|&c| {
                let reader = &self.index.graph.node[c];
                match reader.op_type() {
                    "MatMul" => true,
                    "Cast" | "Identity" | "Dropout" | "Where" | "IsNaN" => {
                        self.reaches_product(&reader.output[0], depth - 1)
                    }
                    op if LAYOUT.contains(&op) => {
                        self.reaches_product(&reader.output[0], depth - 1)
                    }
                    _ => false,
                }
            })
    }

    fn single_reader(&self, t: &str) -> bool {
        self.index.consumers(t).len() == 1 && !self.index.is_graph_output(t)
    }

    /// The path from the score product to `x`: (node, position of the chain's input) from the
    /// product on. `strict`: every tensor on the way has one reader.
    fn chain_to_product(
        &self,
        x: &str,
        depth: usize,
        strict: bool,
    ) -> Result<Vec<(usize, usize)>, String> {
        let Some((i, node)) = self.index.producer(x) else {
            return Err("the scores are not computed by a MatMul".into());
        };
        if node.op_type() == "MatMul" && node.domain().is_empty() {
            return Ok(vec![(i, 0)]);
        }
        if depth == 0 {
            return Err("the scores are not computed by a MatMul within a few steps".into());
        }
        let positions: &[usize] = match node.op_type() {
            "Cast" | "Identity" | "Tanh" => &[0],
            // seen through to tell attention from other softmaxes, not rewritten
            op if LAYOUT.contains(&op) && !strict => &[0],
            "Add" | "Mul" => &[0, 1],
            "Div" | "Sub" => &[0],
            "Where" => &[1, 2],
            op => return Err(format!("the scores pass through a {op} node")),
        };
        let mut found: Vec<Vec<(usize, usize)>> = Vec::new();
        let mut first_why = None;
        for &p in positions {
            let input = &node.input[p];
            match self.chain_to_product(input, depth - 1, strict) {
                Ok(mut path) => {
                    if strict && !self.single_reader(input) {
                        return Err(format!(
                            "the scores '{input}' are read elsewhere too (they would have to be stored)"
                        ));
                    }
                    path.push((i, p));
                    found.push(path);
                }
                // the reason of the scores' own operand (the first), not of a mask's
                Err(why) => {
                    first_why.get_or_insert(why);
                }
            }
        }
        match found.len() {
            1 => Ok(found.pop().expect("one")),
            0 => Err(first_why.unwrap_or_else(|| "the scores are not computed by a MatMul".into())),
            _ => Err(format!(
                "both inputs of {} node '{}' come from products",
                node.op_type(),
                node.name()
            )),
        }
    }

    fn rank(&self, t: &str) -> Result<usize, String> {
        self.ranks
            .get(t)
            .ok_or_else(|| format!("the rank of '{t}' is not known"))
    }

    /// A tensor that shapes the scores: not computed from weights, of rank at most the scores'.
    fn shaping(&self, t: &str, rank: usize) -> Result<usize, String> {
        if self.weight_derived.contains(t) {
            return Err(format!(
                "'{t}' (a scale or mask of the scores) is computed from weights, and its gradient would need the scores"
            ));
        }
        let r = self.rank(t)?;
        if r > rank {
            return Err(format!("'{t}' has more axes than the scores"));
        }
        Ok(r)
    }

    fn identity_cast(&self, node: &NodeProto) -> Result<(), String> {
        if node.op_type() != "Cast" {
            return Ok(());
        }
        let from = self.types.get(&node.input[0]);
        let to = attr_i(node, "to").map(|t| t as i32);
        if from.is_some() && from == to {
            Ok(())
        } else {
            Err(format!(
                "Cast node '{}' changes the type of the scores",
                node.name()
            ))
        }
    }

    fn site(&self, softmax_at: usize, softmax: &NodeProto) -> Result<Site, String> {
        let s_final = &softmax.input[0];
        if !self.single_reader(s_final) {
            return Err(format!("the scores '{s_final}' are read elsewhere too"));
        }
        let path = self.chain_to_product(s_final, MAX_CHAIN, true)?;
        let graph = &self.index.graph.node;
        let (product_at, _) = path[0];
        let product = &graph[product_at];
        let (q, kt) = (&product.input[0], &product.input[1]);
        let rank = self.rank(&product.output[0])?;
        let (q_rank, kt_rank) = (self.rank(q)?, self.rank(kt)?);
        if q_rank < 2 || kt_rank < 2 {
            return Err("a query or key of rank 1".into());
        }
        if self.rank(s_final)? != rank {
            return Err("a mask has more axes than the scores".into());
        }
        let axis = attr_i(softmax, "axis").unwrap_or(if self.opset < 13 { 1 } else { -1 });
        if axis != -1 && axis != rank as i64 - 1 {
            return Err(format!("the softmax is over axis {axis}, not the last"));
        }
        // the scores' steps, in the graph's order
        let mut scale: Option<(String, bool, usize)> = None;
        let mut softcap: Option<PointwiseMap> = None;
        let mut terms: Vec<Term> = Vec::new();
        let mut steps = path[1..].iter().peekable();
        while let Some(&(at, p)) = steps.next() {
            let node = &graph[at];
            let other = |k: usize| node.input[k].clone();
            let tanh_next = steps
                .peek()
                .is_some_and(|&&(next, _)| graph[next].op_type() == "Tanh");
            match node.op_type() {
                "Cast" | "Identity" => self.identity_cast(node)?,
                "Mul" | "Div" if tanh_next => {
                    if softcap.is_some() || !terms.is_empty() {
                        return Err("a second soft-cap, or a soft-cap after a mask".into());
                    }
                    let (_, tanh) = steps.next().copied().expect("peeked");
                    let out = steps.next().map(|&(at, p)| (&graph[at], p));
                    softcap = Some(self.softcap(node, p, &graph[tanh], out)?);
                }
                "Tanh" => {
                    return Err(
                        "the scores pass through a Tanh that is not a soft-cap (÷ c, Tanh, × c)"
                            .into(),
                    )
                }
                "Mul" | "Div" => {
                    if scale.is_some() || softcap.is_some() || !terms.is_empty() {
                        return Err("a second scale, or a scale after a soft-cap or a mask".into());
                    }
                    let s = other(1 - p);
                    let r = self.shaping(&s, rank)?;
                    scale = Some((s, node.op_type() == "Div", r));
                }
                "Add" | "Sub" => {
                    let bias = other(1 - p);
                    let r = self.shaping(&bias, rank)?;
                    let kind = if node.op_type() == "Add" {
                        TermKind::Add
                    } else {
                        TermKind::Sub
                    };
                    terms.push(Term {
                        kind,
                        inputs: vec![bias],
                        ranks: vec![r],
                    });
                }
                "Where" => {
                    let (cond, value) = (other(0), other(3 - p));
                    let ranks = vec![self.shaping(&cond, rank)?, self.shaping(&value, rank)?];
                    let kind = if p == 1 {
                        TermKind::Keep
                    } else {
                        TermKind::Fill
                    };
                    terms.push(Term {
                        kind,
                        inputs: vec![cond, value],
                        ranks,
                    });
                }
                op => return Err(format!("the scores pass through a {op} node")),
            }
        }
        // the probabilities' steps up to the value product
        let mut nodes: Vec<usize> = path.iter().map(|&(at, _)| at).collect();
        nodes.push(softmax_at);
        let mut p = softmax.output[0].as_str();
        let mut nan_to_zero = false;
        let value_product = loop {
            if let Some((isnan, fill)) = self.nan_to_zero(p) {
                nodes.extend([isnan, fill]);
                nan_to_zero = true;
                p = graph[fill].output[0].as_str();
                continue;
            }
            if !self.single_reader(p) {
                return Err(format!(
                    "the probabilities '{p}' are read elsewhere too (e.g. returned as attention weights)"
                ));
            }
            let at = self.index.consumers(p)[0];
            let node = &graph[at];
            match node.op_type() {
                "MatMul" if node.input[0] == p => break at,
                "MatMul" => {
                    return Err("the probabilities are the right factor of the product".into())
                }
                "Cast" | "Identity" => self.identity_cast(node)?,
                "Dropout" => self.inference_dropout(node)?,
                op => return Err(format!("the probabilities pass through a {op} node")),
            }
            nodes.push(at);
            p = node.output[0].as_str();
        };
        let pv = &graph[value_product];
        let v = &pv.input[1];
        let v_rank = self.rank(v)?;
        if v_rank < 2 {
            return Err("a value of rank 1".into());
        }
        if self.rank(&pv.output[0])? != rank {
            return Err("the values have more axes than the scores".into());
        }
        nodes.push(value_product);
        let (scale, scale_divides, scale_rank) = scale.unwrap_or_default();
        Ok(Site {
            nodes,
            value_product,
            attn: Attn {
                q: q.clone(),
                kt: kt.clone(),
                v: v.clone(),
                scale,
                scale_divides,
                score_map: softcap.unwrap_or_default(),
                nan_to_zero,
                terms,
                q_rank,
                kt_rank,
                v_rank,
                scale_rank,
                rank,
                block: 0,
                declared_here: false,
                fused: false,
                same_batch: false,
            },
        })
    }

    /// `into = s (÷ or ×) c`, `t = Tanh(into)`, `out = t (× or ÷) c'` with constant scalars `c`
    /// and `c'` (`out` is None where the scores end at the `Tanh`), `p`: the scores' input of
    /// `into`.
    fn softcap(
        &self,
        into: &NodeProto,
        p: usize,
        tanh: &NodeProto,
        out: Option<(&NodeProto, usize)>,
    ) -> Result<PointwiseMap, String> {
        let not_a_cap = || {
            format!(
                "the scores pass through Tanh node '{}', not as a soft-cap c·tanh(s / c) with a constant c",
                tanh.name()
            )
        };
        // a product or quotient by a constant, whose other input is the scores
        let by_constant =
            |node: &NodeProto, p: usize| match pointwise_map::step_of(self.index, node) {
                Some((step, x)) if x == p && node.op_type() != "Tanh" => Ok(step),
                _ => Err(not_a_cap()),
            };
        let (out, out_p) = out.ok_or_else(not_a_cap)?;
        Ok(PointwiseMap {
            steps: vec![
                by_constant(into, p)?,
                MapStep::Tanh,
                by_constant(out, out_p)?,
            ],
        })
    }

    /// `Where(IsNaN(p), 0, p)` (optimum's export zeroes fully masked rows so): the two nodes,
    /// where `p` is read by them alone.
    fn nan_to_zero(&self, p: &str) -> Option<(usize, usize)> {
        let readers = self.index.consumers(p);
        if readers.len() != 2 || self.index.is_graph_output(p) {
            return None;
        }
        let graph = &self.index.graph.node;
        let isnan = *readers.iter().find(|&&c| graph[c].op_type() == "IsNaN")?;
        let fill = *readers.iter().find(|&&c| graph[c].op_type() == "Where")?;
        let w = &graph[fill];
        let zero = self.index.is_zero_constant(&w.input[1]);
        let shape = w.input[0] == graph[isnan].output[0] && w.input[2] == p && zero;
        (shape && self.single_reader(&graph[isnan].output[0])).then_some((isnan, fill))
    }

    /// A `Dropout` that passes its input through: not in training mode, its mask unread.
    fn inference_dropout(&self, node: &NodeProto) -> Result<(), String> {
        let mask_unread = node
            .output
            .get(1)
            .is_none_or(|m| m.is_empty() || self.index.consumers(m).is_empty());
        if self.index.dropout_passes_through(node) && mask_unread {
            Ok(())
        } else {
            Err(format!(
                "Dropout node '{}' drops probabilities in training mode",
                node.name()
            ))
        }
    }
}

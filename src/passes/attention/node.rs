//! Attention as one node while the step graph is built: `BlockAttention` reads the query, the
//! transposed keys, the values and what sits between the scores and the softmax (a scale, masks),
//! and writes the output; its gradient is one `BlockAttentionGrad` node
//! (`grad/rules/attention.rs`), which reads the same inputs and recomputes the probabilities.
//! Both are internal: `lower` expands them into `Scan`s over blocks of query rows before the
//! graph is written.
//!
//! `BlockAttention(q [.., Tq, D], kt [.., D, Tk], v [.., Tk, Dv], scale?, term inputs…)` →
//! `o [.., Tq, Dv]`, with the scores
//! `s = q·kt (× or ÷ scale) (map) (+ bias | − bias | where(cond, s, value) | where(cond, value,
//! s))…`, the map a soft-cap `c·tanh(s / c)` (Gemma 2's) and each term applied in the graph's
//! order, `p = softmax(s)` (with `nan_to_zero`, `where(isnan(p), 0, p)`, as optimum's SDPA
//! export writes it) and `o = p·v`.
//!
//! `BlockAttentionGrad(q, kt, v, scale?, term inputs…, g_o)` → `(g_q, g_kt, g_v)`, each in the
//! broadcast shape of the scores' batch axes (the rule sums them down to the inputs').

use ntl_ops::Builder;

use crate::graph::GraphIndex;
use crate::onnx::{attr_i, attr_ints, int_attr, ints_attr, NodeProto};
use crate::passes::pointwise_map::PointwiseMap;

pub use crate::passes::fused_head::node::DOMAIN;
pub const FORWARD: &str = "BlockAttention";
pub const BACKWARD: &str = "BlockAttentionGrad";

/// A mask value at or below this is −∞ to the softmax: `s + fill` rounds to `fill` for any
/// score below 1e22 in magnitude (float32's spacing at 1e30 is 2^76), so `exp` of it less any
/// kept key's score is 0 (torch's `finfo.min` is one such value).
pub const MASKED_AT: f64 = -1e30;

/// What happens to the scores between the product and the softmax, after the scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TermKind {
    /// `s + bias` (one input).
    Add = 1,
    /// `s − bias` (one input).
    Sub = 4,
    /// `where(cond, s, value)` (two inputs: cond, value).
    Keep = 2,
    /// `where(cond, value, s)` (two inputs: cond, value).
    Fill = 3,
}

impl TermKind {
    fn from_code(c: i64) -> Option<TermKind> {
        match c {
            1 => Some(TermKind::Add),
            2 => Some(TermKind::Keep),
            3 => Some(TermKind::Fill),
            4 => Some(TermKind::Sub),
            _ => None,
        }
    }

    pub fn arity(self) -> usize {
        match self {
            TermKind::Add | TermKind::Sub => 1,
            TermKind::Keep | TermKind::Fill => 2,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Term {
    pub kind: TermKind,
    /// The bias, or (cond, value).
    pub inputs: Vec<String>,
    /// Each input's rank (rows are read along axis `rank − 2` where the rank is 2 or more).
    pub ranks: Vec<usize>,
}

impl Term {
    /// The values a `Where` fills the scores with, where the graph holds them as a constant
    /// (None for a bias, a computed value or an empty one).
    pub fn fill_values(&self, index: &GraphIndex) -> Option<Vec<f64>> {
        if !matches!(self.kind, TermKind::Keep | TermKind::Fill) {
            return None;
        }
        crate::ce::forms::constant_numbers(index, &self.inputs[1]).filter(|v| !v.is_empty())
    }
}

/// What both nodes share.
#[derive(Debug, Clone, PartialEq)]
pub struct Attn {
    pub q: String,
    pub kt: String,
    pub v: String,
    /// Empty without a scale.
    pub scale: String,
    /// The scale divides (`s / scale`) rather than multiplies.
    pub scale_divides: bool,
    /// A soft-cap between the scale and the masks (empty without one).
    pub score_map: PointwiseMap,
    pub terms: Vec<Term>,
    /// `where(isnan(p), 0, p)` on the probabilities.
    pub nan_to_zero: bool,
    /// Ranks of q, kt, v and the scale (0 without one).
    pub q_rank: usize,
    pub kt_rank: usize,
    pub v_rank: usize,
    pub scale_rank: usize,
    /// The rank of the scores and of the output.
    pub rank: usize,
    /// Query rows per block.
    pub block: i64,
    /// The output's shape was declared by the pass, for the backward only: its symbols are the
    /// graph inputs' names, which a runtime given concrete shapes cannot unify (tract).
    pub declared_here: bool,
    /// The forward is the ONNX `Attention` operator (`--attention onnx`'s, `fused`, or an
    /// exported one), not a `Scan`: the graph is onnxruntime's, and the backward reads only the
    /// keys the masks leave each block (`key_range`).
    pub fused: bool,
    /// The query, keys and values provably share their batch and head axes (`fused` needs no
    /// `Expand` to the scores' batch shape).
    pub same_batch: bool,
}

impl Attn {
    pub fn inputs(&self) -> Vec<String> {
        let mut v = vec![
            self.q.clone(),
            self.kt.clone(),
            self.v.clone(),
            self.scale.clone(),
        ];
        for t in &self.terms {
            v.extend(t.inputs.iter().cloned());
        }
        v
    }

    fn attributes(&self) -> Vec<crate::onnx::AttributeProto> {
        let kinds: Vec<i64> = self.terms.iter().map(|t| t.kind as i64).collect();
        let term_ranks: Vec<i64> = self
            .terms
            .iter()
            .flat_map(|t| t.ranks.iter().map(|&r| r as i64))
            .collect();
        let mut attrs = vec![
            int_attr("scale_divides", self.scale_divides as i64),
            int_attr("nan_to_zero", self.nan_to_zero as i64),
            ints_attr("terms", &kinds),
            ints_attr("term_ranks", &term_ranks),
            ints_attr(
                "ranks",
                &[
                    self.q_rank as i64,
                    self.kt_rank as i64,
                    self.v_rank as i64,
                    self.scale_rank as i64,
                    self.rank as i64,
                ],
            ),
            int_attr("block", self.block),
            int_attr("declared_here", self.declared_here as i64),
            int_attr("fused", self.fused as i64),
            int_attr("same_batch", self.same_batch as i64),
        ];
        attrs.extend(self.score_map.attributes());
        attrs
    }

    /// Reads the attention back from either node.
    pub fn of(node: &NodeProto) -> Attn {
        let kinds = attr_ints(node, "terms").unwrap_or_default();
        let term_ranks = attr_ints(node, "term_ranks").unwrap_or_default();
        let ranks = attr_ints(node, "ranks").unwrap_or_default();
        let rank = |i: usize| ranks.get(i).copied().unwrap_or(0) as usize;
        let mut next = 4;
        let mut next_rank = 0;
        let mut terms = Vec::new();
        for kind in kinds.iter().filter_map(|&c| TermKind::from_code(c)) {
            let n = kind.arity();
            terms.push(Term {
                kind,
                inputs: node.input[next..next + n].to_vec(),
                ranks: term_ranks[next_rank..next_rank + n]
                    .iter()
                    .map(|&r| r as usize)
                    .collect(),
            });
            next += n;
            next_rank += n;
        }
        Attn {
            q: node.input[0].clone(),
            kt: node.input[1].clone(),
            v: node.input[2].clone(),
            scale: node.input[3].clone(),
            scale_divides: attr_i(node, "scale_divides") == Some(1),
            score_map: PointwiseMap::of(node),
            nan_to_zero: attr_i(node, "nan_to_zero") == Some(1),
            terms,
            q_rank: rank(0),
            kt_rank: rank(1),
            v_rank: rank(2),
            scale_rank: rank(3),
            rank: rank(4),
            block: attr_i(node, "block").unwrap_or(1024),
            declared_here: attr_i(node, "declared_here") == Some(1),
            fused: attr_i(node, "fused") == Some(1),
            same_batch: attr_i(node, "same_batch") == Some(1),
        }
    }

    /// Whether the query, keys and values provably share their batch axes (all but the last two).
    pub fn proven_same_batch(&self, shapes: &crate::graph::shapes::Shapes) -> bool {
        let r = self.rank;
        r >= 2 && shapes.same_axes(&[&self.q, &self.kt, &self.v], r, 0..r - 2)
    }

    /// The number of inputs the forward node has.
    pub fn forward_inputs(&self) -> usize {
        4 + self.terms.iter().map(|t| t.inputs.len()).sum::<usize>()
    }

    pub fn forward_node(&self, name: &str, output: &str) -> NodeProto {
        NodeProto {
            name: Some(name.to_string()),
            op_type: Some(FORWARD.into()),
            domain: Some(DOMAIN.into()),
            input: self.inputs(),
            output: vec![output.to_string()],
            attribute: self.attributes(),
            ..Default::default()
        }
    }

    /// `g_out`: the output's gradient (the forward's output is not read: nothing of the
    /// forward is kept for the backward but its inputs).
    pub fn backward_node(&self, name: &str, g_out: &str, outputs: [&str; 3]) -> NodeProto {
        let mut input = self.inputs();
        input.push(g_out.to_string());
        NodeProto {
            name: Some(name.to_string()),
            op_type: Some(BACKWARD.into()),
            domain: Some(DOMAIN.into()),
            input,
            output: outputs.iter().map(|s| s.to_string()).collect(),
            attribute: self.attributes(),
            ..Default::default()
        }
    }
}

/// Whether `node` is one of the two internal nodes.
pub fn is_attention(node: &NodeProto) -> bool {
    node.domain() == DOMAIN && matches!(node.op_type(), FORWARD | BACKWARD)
}

/// The terms applied to a score of 0, in the graph's order: the masks as one float32 mask to
/// add to the scores (None without terms). `inputs[k]` are the inputs of `a.terms[k]` (the
/// terms' own, or their rows of a block).
pub fn additive_mask(b: &mut Builder, a: &Attn, inputs: &[Vec<String>]) -> Option<String> {
    let mut mask: Option<String> = None;
    for (t, x) in a.terms.iter().zip(inputs) {
        let so_far = |b: &mut Builder, m: &Option<String>| match m {
            Some(m) => m.clone(),
            None => b.scalar_f32("attention/mask_zero", 0.0),
        };
        mask = Some(match (t.kind, &mask) {
            (TermKind::Add, None) => x[0].clone(),
            (TermKind::Add, Some(m)) => b.binary("Add", m, &x[0], "attention/mask"),
            (TermKind::Sub, None) => b.unary("Neg", &x[0], "attention/mask"),
            (TermKind::Sub, Some(m)) => b.binary("Sub", m, &x[0], "attention/mask"),
            (TermKind::Keep, m) => {
                let m = so_far(b, m);
                b.where_(&x[0], &m, &x[1], "attention/mask")
            }
            (TermKind::Fill, m) => {
                let m = so_far(b, m);
                b.where_(&x[0], &x[1], &m, "attention/mask")
            }
        });
    }
    mask
}

/// Each row's largest value of an additive `mask` (`[.., T, 1]`), and the rows where it is −∞:
/// those the mask fills with −∞ at every key (the export's softmax gives them NaN).
pub struct RowHighs {
    pub high: String,
    pub minus_inf: String,
}

pub fn row_highs(b: &mut Builder, mask: &str) -> RowHighs {
    let high = b.reduce("ReduceMax", mask, &[-1], true, "attention/row_high");
    let attrs = vec![int_attr("detect_positive", 0)];
    let minus_inf = b.node("IsInf", &[&high], "attention/row_minus_inf", attrs);
    RowHighs { high, minus_inf }
}

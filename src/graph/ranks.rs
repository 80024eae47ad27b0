//! Tensor ranks, inferred forward through the graph: the gradient rules that swap or
//! normalise axes (MatMul, Transpose without `perm`, LayerNormalization) need them, and
//! exporters often write no `value_info`. Dimensions themselves stay symbolic: rules read
//! them at run time with `Shape`.

use crate::graph::hash::HashMap;

use crate::onnx::{attr_i, attr_ints, GraphProto, NodeProto};

/// What rank inference asks of the graph besides its nodes: who produces a tensor, and the
/// value of a small int64 constant. `GraphIndex` answers it; declared here so that ranks need
/// not know the index (which caches the ranks it infers).
pub trait Lookup {
    fn graph(&self) -> &GraphProto;
    fn producer(&self, tensor: &str) -> Option<(usize, &NodeProto)>;
    fn constant_i64(&self, tensor: &str) -> Option<Vec<i64>>;
}

#[derive(Debug, Default)]
pub struct Ranks {
    rank: HashMap<String, usize>,
    /// Static length of 1-D int64 tensors (shape vectors): a Reshape's output rank.
    len1d: HashMap<String, usize>,
}

impl Ranks {
    pub fn get(&self, tensor: &str) -> Option<usize> {
        self.rank.get(tensor).copied()
    }

    /// The static length of a 1-D int64 tensor (a shape vector, a Slice's starts).
    pub fn len1d(&self, tensor: &str) -> Option<usize> {
        self.len1d.get(tensor).copied()
    }

    /// Records the rank of a tensor the gradient emitter creates.
    pub fn set(&mut self, tensor: &str, rank: usize) {
        self.rank.insert(tensor.to_string(), rank);
    }

    pub fn infer(index: &impl Lookup) -> Ranks {
        let g: &GraphProto = index.graph();
        let mut r = Ranks::default();
        for t in &g.initializer {
            r.rank.insert(t.name().to_string(), t.dims.len());
            if t.dims.len() == 1 {
                r.len1d
                    .insert(t.name().to_string(), t.dims[0].max(0) as usize);
            }
        }
        for v in g.input.iter().chain(&g.value_info).chain(&g.output) {
            if let Some((_, Some(dims))) = crate::onnx::value_info_shape(v) {
                r.rank.entry(v.name().to_string()).or_insert(dims.len());
                if let [Some(n)] = dims.as_slice() {
                    r.len1d.entry(v.name().to_string()).or_insert(*n as usize);
                }
            }
        }
        for node in &g.node {
            r.infer_node(index, node);
        }
        r
    }

    fn infer_node(&mut self, index: &impl Lookup, node: &NodeProto) {
        // what the node's inputs are known to be; what it tells of its outputs is written after
        // the match: the length of output 0 where it is a vector, the rank of the outputs after
        // the first where the op fixes them (how many: `usize::MAX` for all)
        let rk = |i: usize| node.input.get(i).and_then(|n| self.get(n));
        let len = |i: usize| node.input.get(i).and_then(|n| self.len1d(n));
        let mut len_out = None;
        let mut rest_rank: Option<(usize, usize)> = None;
        let axes_len = |i: usize| -> Option<usize> {
            attr_ints(node, "axes").map(|a| a.len()).or_else(|| {
                node.input
                    .get(i)
                    .filter(|n| !n.is_empty())
                    .and_then(|n| index.constant_i64(n).map(|v| v.len()).or(len(i)))
            })
        };
        let out = match node.op_type() {
            "Constant" => crate::graph::constant_dims(node).map(|dims| {
                if let [n] = dims[..] {
                    len_out = Some(n.max(0) as usize);
                }
                dims.len()
            }),
            "Shape" => {
                let full = rk(0);
                let start = attr_i(node, "start");
                let end = attr_i(node, "end");
                if let (Some(n), None, None) = (full, start, end) {
                    len_out = Some(n);
                } else if let Some(n) = full {
                    let norm = |a: i64| {
                        if a < 0 {
                            (a + n as i64).max(0)
                        } else {
                            a.min(n as i64)
                        }
                    };
                    let s = norm(start.unwrap_or(0));
                    let e = norm(end.unwrap_or(n as i64));
                    len_out = Some((e - s).max(0) as usize);
                }
                Some(1)
            }
            "Size" => Some(0),
            "Range" => Some(1),
            "NonZero" => Some(2),
            "Concat" => {
                if rk(0) == Some(1) {
                    let total: Option<usize> = (0..node.input.len()).map(len).sum();
                    if let Some(t) = total {
                        len_out = Some(t);
                    }
                }
                rk(0)
            }
            "Unsqueeze" => {
                let out = rk(0).zip(axes_len(1)).map(|(a, b)| a + b);
                if out == Some(1) {
                    len_out = Some(1);
                }
                out
            }
            "Squeeze" => match axes_len(1) {
                Some(n) => rk(0).map(|r| r.saturating_sub(n)),
                None => None,
            },
            "Reshape" => {
                let target = node.input.get(1).and_then(|s| index.constant_i64(s));
                // A 1-D vector reshaped to [-1] keeps its length.
                if let (Some(t), Some(1), Some(l)) = (&target, rk(0), len(0)) {
                    if t.as_slice() == [-1] {
                        len_out = Some(l);
                    }
                }
                len(1).or(target.map(|v| v.len()))
            }
            "Expand" => {
                let l = len(1);
                rk(0).zip(l).map(|(a, b)| a.max(b))
            }
            "ConstantOfShape" => {
                // ConstantOfShape(Shape(v)) of a 1-D v is a vector as long as v.
                let of_vector = node
                    .input
                    .first()
                    .and_then(|shape| index.producer(shape))
                    .and_then(|(_, p)| (p.op_type() == "Shape").then(|| p.input.first()).flatten());
                if let Some(v) = of_vector {
                    if let (Some(1), Some(l)) = (self.get(v), self.len1d.get(v).copied()) {
                        len_out = Some(l);
                    }
                }
                len(0)
            }
            "MatMul" => match (rk(0), rk(1)) {
                // a scalar operand is invalid ONNX: no rank to infer
                (Some(0), _) | (_, Some(0)) => None,
                (Some(1), Some(1)) => Some(0),
                (Some(1), Some(b)) => Some(b - 1),
                (Some(a), Some(1)) => Some(a - 1),
                (Some(a), Some(b)) => Some(a.max(b)),
                _ => None,
            },
            "Gemm" | "Flatten" => Some(2),
            "Gather" => {
                // entries picked from a shape vector (tf2onnx's Gather(Shape(x), free))
                if let (Some(1), Some(1), Some(k)) = (rk(0), rk(1), len(1)) {
                    len_out = Some(k);
                }
                rk(0).zip(rk(1)).map(|(a, b)| (a + b).saturating_sub(1))
            }
            "GatherElements" => rk(1),
            "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceProd"
            | "ReduceLogSumExp" | "ReduceSumSquare" | "ReduceL2" | "ArgMax" | "ArgMin" => {
                let keep = attr_i(node, "keepdims").unwrap_or(1) != 0;
                if keep {
                    // a vector reduced keeps one entry (tf2onnx's ReduceProd of shape entries)
                    let noop = attr_i(node, "noop_with_empty_axes").unwrap_or(0) != 0
                        && axes_len(1).unwrap_or(0) == 0;
                    if rk(0) == Some(1) && !noop {
                        len_out = Some(1);
                    }
                    rk(0)
                } else if node.op_type().starts_with("Arg") {
                    rk(0).map(|r| r.saturating_sub(1))
                } else {
                    match axes_len(1) {
                        Some(0) | None
                            if node.input.get(1).is_none_or(|a| a.is_empty())
                                && attr_ints(node, "axes").is_none() =>
                        {
                            Some(0)
                        }
                        Some(n) => rk(0).map(|r| r.saturating_sub(n)),
                        None => None,
                    }
                }
            }
            "SoftmaxCrossEntropyLoss" | "NegativeLogLikelihoodLoss" => {
                rest_rank = rk(0).map(|s| (s, 1));
                if crate::onnx::attr_s(node, "reduction").as_deref() == Some("none") {
                    rk(1)
                } else {
                    Some(0)
                }
            }
            "LayerNormalization" => {
                rest_rank = rk(0).map(|r| (r, usize::MAX));
                rk(0)
            }
            "OneHot" => rk(0).map(|r| r + 1),
            "TopK" | "Split" | "Dropout" => {
                rest_rank = rk(0).map(|r| (r, usize::MAX));
                rk(0)
            }
            "Add" | "Sub" | "Mul" | "Div" | "Pow" | "Equal" | "Less" | "Greater"
            | "LessOrEqual" | "GreaterOrEqual" | "And" | "Or" | "Xor" | "Max" | "Min" | "Mod"
            | "Sum" | "Mean" | "PRelu" | "Where" => {
                // Broadcasting: the largest input rank, known only when every rank is.
                let ranks: Option<Vec<usize>> = (0..node.input.len()).map(rk).collect();
                let out = ranks.and_then(|r| r.into_iter().max());
                if out == Some(1) {
                    if let Some(l) = (0..node.input.len()).filter_map(len).max() {
                        len_out = Some(l);
                    }
                }
                out
            }
            "Slice" => {
                if let (Some(1), Some(n)) = (rk(0), len(0)) {
                    if let Some(l) = slice_len(index, node, n) {
                        len_out = Some(l);
                    }
                }
                rk(0)
            }
            "Cast" | "CastLike" | "Identity" => {
                if let (Some(1), Some(l)) = (rk(0), len(0)) {
                    len_out = Some(l);
                }
                rk(0)
            }
            // Everything else used on a training path keeps its first input's rank.
            _ => rk(0),
        };
        if let Some(l) = len_out {
            self.len1d.insert(node.output[0].clone(), l);
        }
        if let Some((r, count)) = rest_rank {
            for o in node.output.iter().skip(1).take(count) {
                self.rank.insert(o.clone(), r);
            }
        }
        if let (Some(r), Some(o)) = (out, node.output.first()) {
            if !o.is_empty() {
                self.rank.entry(o.clone()).or_insert(r);
            }
        }
    }
}

/// Length of a constant-bounds, unit-step Slice of a 1-D tensor of length `n`.
fn slice_len(index: &impl Lookup, node: &NodeProto, n: usize) -> Option<usize> {
    let one = |i: usize| -> Option<i64> {
        match node.input.get(i).filter(|s| !s.is_empty()) {
            Some(t) => index.constant_i64(t).filter(|v| v.len() == 1).map(|v| v[0]),
            None => None,
        }
    };
    let (start, end) = (one(1)?, one(2)?);
    if node.input.get(3).is_some_and(|a| !a.is_empty()) && !matches!(one(3), Some(0) | Some(-1)) {
        return None;
    }
    if node.input.get(4).is_some_and(|s| !s.is_empty()) && one(4) != Some(1) {
        return None;
    }
    let n = n as i64;
    let clamp = |v: i64| if v < 0 { (v + n).max(0) } else { v.min(n) };
    Some((clamp(end) - clamp(start)).max(0) as usize)
}

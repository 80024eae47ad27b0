//! Recognising the pieces a cross-entropy is written from, by what they compute: the
//! log-softmax and log-sum-exp of a tensor over its last axis, and "the entry of the label's
//! class" of a tensor (gather, one-hot product).

use crate::graph::{static_rank, GraphIndex};
use crate::onnx::{attr_i, attr_ints, NodeProto};

/// `t = x[..., labels]` along x's last axis.
#[derive(Debug, Clone)]
pub struct Pick {
    pub source: String,
    /// Integer class ids, one per position (possibly with a trailing axis of 1).
    pub labels: String,
    /// The picked value's shape.
    pub shape: ValueShape,
    /// Negative labels count from the end (ONNX Gather*/OneHot); else they pick nothing.
    pub wraps: bool,
    /// Which spelling: 0 GatherElements, 1 GatherND, 2 × OneHot + ReduceSum,
    /// 3 × Equal(labels, Range) + ReduceSum.
    pub kind: usize,
    pub nodes: Vec<usize>,
    /// The one-hot is label-smoothed (one-hot picks only).
    pub smoothing: Option<Smoothing>,
}

/// A label-smoothed one-hot `keep·onehot + spread` with `keep = 1 − ε` and `spread = ε/V`, so
/// each row sums to 1 (Keras `CategoricalCrossentropy(label_smoothing=ε)`, optax
/// `smooth_labels`, `OneHot` with values `[ε/V, 1 − ε + ε/V]`). Picking with it gives
/// `keep·x[y] + spread·Σ_c x[c]`.
#[derive(Debug, Clone)]
pub struct Smoothing {
    pub keep: Scalar,
    pub spread: Scalar,
    pub epsilon: f64,
}

/// A scalar of the smoothing: the graph's own tensor (its exact value, in its type), or a
/// value derived from the graph's constants.
#[derive(Debug, Clone)]
pub enum Scalar {
    Tensor(String),
    Value(f64),
}

/// The shape of a picked value, in terms the rewrite can compute at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueShape {
    /// The logits' shape without the class axis.
    Positions,
    /// ... with a class axis of size 1 kept.
    PositionsAndOne,
    /// The gather index's shape (`GatherElements`).
    Index,
    /// The gather index's shape without its last axis (`GatherND`).
    IndexButLast,
}

impl ValueShape {
    pub fn keeps_last(self) -> bool {
        matches!(self, ValueShape::PositionsAndOne | ValueShape::Index)
    }
}

/// Looks through ops that pass a value on unchanged.
pub fn through_identity<'a>(index: &GraphIndex<'a>, mut t: &'a str) -> &'a str {
    for _ in 0..8 {
        match index.producer(t) {
            Some((_, n)) if n.op_type() == "Identity" && !n.input.is_empty() => {
                t = n.input[0].as_str()
            }
            _ => break,
        }
    }
    t
}

fn producer<'g>(index: &GraphIndex<'g>, t: &str, op: &str) -> Option<(usize, &'g NodeProto)> {
    index.producer(t).filter(|(_, n)| n.op_type() == op)
}

/// The reduction axes of a Reduce* node (attribute before opset 18, input from 18).
fn reduce_axes(index: &GraphIndex, node: &NodeProto) -> Option<Vec<i64>> {
    if let Some(a) = attr_ints(node, "axes") {
        return Some(a);
    }
    node.input
        .get(1)
        .filter(|a| !a.is_empty())
        .and_then(|a| constant_ints(index, a))
}

/// A small integer constant, also where the exporter casts or reshapes it first (the dynamo
/// exporter's `Reshape(Cast(Constant))` axes and slice bounds).
fn constant_ints(index: &GraphIndex, t: &str) -> Option<Vec<i64>> {
    constant_numbers(index, t)?
        .into_iter()
        // `as` saturates: INT64_MAX slice ends (2^63 as f64) come back as i64::MAX
        .map(|v| (v.fract() == 0.0).then_some(v as i64))
        .collect()
}

/// Whether `axes` is exactly the last axis of `x`.
fn is_last_axis(index: &GraphIndex, x: &str, axes: &[i64]) -> bool {
    match axes {
        [-1] => true,
        [a] => static_rank(index, x).is_some_and(|r| *a == r as i64 - 1),
        _ => false,
    }
}

fn keepdims(node: &NodeProto) -> bool {
    attr_i(node, "keepdims").unwrap_or(1) != 0
}

/// `Reduce<op>(x)` over x's last axis: (x, keepdims).
fn reduce_last(index: &GraphIndex, t: &str, op: &str) -> Option<(String, bool, usize)> {
    let (i, n) = producer(index, t, op)?;
    let x = n.input.first()?;
    let axes = reduce_axes(index, n)?;
    is_last_axis(index, x, &axes).then(|| (x.clone(), keepdims(n), i))
}

/// `t = log Σ_j exp(z_j)` over z's last axis: (z, keepdims, nodes). Forms:
/// `ReduceLogSumExp(z)`, `Log(ReduceSum(Exp(z)))`, and the stabilised
/// `m + Log(ReduceSum(Exp(z − m)))` with `m = ReduceMax(z)`.
pub fn log_sum_exp(index: &GraphIndex, t: &str) -> Option<(String, bool, Vec<usize>)> {
    let t = through_identity(index, t);
    if let Some((z, keep, i)) = reduce_last(index, t, "ReduceLogSumExp") {
        return Some((z, keep, vec![i]));
    }
    if let Some((i, log)) = producer(index, t, "Log") {
        let (e, keep, j) = reduce_last(index, log.input.first()?, "ReduceSum")?;
        let (k, exp) = producer(index, &e, "Exp")?;
        let x = exp.input.first()?;
        if shifted_by_max(index, x).is_some() {
            // log Σ exp(z − m) alone is lse(z) − m: only the full form below is lse(z)
            return None;
        }
        return Some((x.clone(), keep, vec![i, j, k]));
    }
    if let Some((i, add)) = producer(index, t, "Add") {
        for (a, b) in [(0, 1), (1, 0)] {
            let (m, l) = (add.input.get(a)?, add.input.get(b)?);
            let Some((j, log)) = producer(index, l, "Log") else {
                continue;
            };
            let Some((e, keep, k)) = reduce_last(index, log.input.first()?, "ReduceSum") else {
                continue;
            };
            let Some((x, exp)) = producer(index, &e, "Exp") else {
                continue;
            };
            let Some((z, mut nodes)) = shifted_by_max(index, exp.input.first()?) else {
                continue;
            };
            // the m added back is the row maximum of the same z
            let Some(max_nodes) = row_max_of(index, m, &z) else {
                continue;
            };
            nodes.extend(max_nodes);
            nodes.extend([i, j, k, x]);
            return Some((z, keep, nodes));
        }
    }
    None
}

/// `x = z − m` with `m` the row maximum of z (kept dims): (z, nodes).
fn shifted_by_max(index: &GraphIndex, x: &str) -> Option<(String, Vec<usize>)> {
    let (i, sub) = producer(index, through_identity(index, x), "Sub")?;
    let z = sub.input.first()?;
    let mut nodes = row_max_of(index, sub.input.get(1)?, z)?;
    nodes.push(i);
    Some((z.clone(), nodes))
}

/// `m` is `ReduceMax(z)` over the last axis (through Identity, Squeeze/Unsqueeze/Reshape of
/// it, or the exporters' stop-gradient spellings): the nodes from m back to the ReduceMax.
fn row_max_of(index: &GraphIndex, m: &str, z: &str) -> Option<Vec<usize>> {
    let mut t = m;
    let mut nodes = Vec::new();
    for _ in 0..8 {
        t = through_identity(index, t);
        if let Some((x, _, i)) = reduce_last(index, t, "ReduceMax") {
            nodes.push(i);
            return (through_identity(index, &x) == through_identity(index, z)).then_some(nodes);
        }
        match index.producer(t) {
            Some((i, n))
                if matches!(
                    n.op_type(),
                    "Squeeze" | "Unsqueeze" | "Reshape" | "StopGradient"
                ) && !n.input.is_empty() =>
            {
                nodes.push(i);
                t = n.input[0].as_str()
            }
            _ => return None,
        }
    }
    None
}

/// `t = log_softmax(z)` over z's last axis: (z, nodes). Forms: `LogSoftmax(z)`,
/// `Log(Softmax(z))`, `z − lse(z)`, and the stabilised `(z − m) − Log(ReduceSum(Exp(z − m)))`.
pub fn log_softmax(index: &GraphIndex, t: &str) -> Option<(String, Vec<usize>)> {
    let t = through_identity(index, t);
    let (i, node) = index.producer(t)?;
    match node.op_type() {
        "LogSoftmax" => {
            let z = node.input.first()?;
            last_axis_attr(index, node, z).then(|| (z.clone(), vec![i]))
        }
        "Log" => {
            let (j, sm) = producer(index, node.input.first()?, "Softmax")?;
            let z = sm.input.first()?;
            last_axis_attr(index, sm, z).then(|| (z.clone(), vec![i, j]))
        }
        "Sub" => {
            let (a, b) = (node.input.first()?, node.input.get(1)?);
            if let Some((z, true, mut nodes)) = log_sum_exp(index, b) {
                if through_identity(index, a) == through_identity(index, &z) {
                    nodes.push(i);
                    return Some((z, nodes));
                }
            }
            // (z − m) − log Σ exp(z − m)
            let (z, mut nodes) = shifted_by_max(index, a)?;
            let (j, log) = producer(index, through_identity(index, b), "Log")?;
            let (e, keep, k) = reduce_last(index, log.input.first()?, "ReduceSum")?;
            if !keep {
                return None;
            }
            let (l, exp) = producer(index, &e, "Exp")?;
            (through_identity(index, exp.input.first()?) == through_identity(index, a)).then(|| {
                nodes.extend([i, j, k, l]);
                (z, nodes)
            })
        }
        _ => None,
    }
}

/// Softmax/LogSoftmax `axis` is the last one (the default from opset 13 on).
fn last_axis_attr(index: &GraphIndex, node: &NodeProto, x: &str) -> bool {
    let axis = attr_i(node, "axis").unwrap_or(-1);
    is_last_axis(index, x, &[axis])
}

/// `t = log(softmax(z)[..., labels])`, written `Log(pick(Exp(s)) / ReduceSum(Exp(s)))` with `s`
/// z or z shifted by its row maximum (tf2onnx's sparse cross-entropy), or
/// `Log(pick(Softmax(z)))`: (z, pick, nodes).
pub fn log_of_picked_softmax(index: &GraphIndex, t: &str) -> Option<(String, Pick, Vec<usize>)> {
    let (i, log) = producer(index, through_identity(index, t), "Log")?;
    let x = through_identity(index, log.input.first()?);
    if let Some(p) = pick(index, x) {
        let (j, sm) = producer(index, through_identity(index, &p.source), "Softmax")?;
        let z = sm.input.first()?.clone();
        if !last_axis_attr(index, sm, &z) {
            return None;
        }
        let mut nodes = p.nodes.clone();
        nodes.extend([i, j]);
        return Some((z, p, nodes));
    }
    let (j, div) = producer(index, x, "Div")?;
    let p = pick(index, div.input.first()?)?;
    let (sum_of, keep, k) = reduce_last(index, div.input.get(1)?, "ReduceSum")?;
    let e = through_identity(index, &p.source);
    if keep != p.shape.keeps_last() || through_identity(index, &sum_of) != e {
        return None;
    }
    let (l, exp) = producer(index, e, "Exp")?;
    let s = exp.input.first()?;
    let mut nodes = p.nodes.clone();
    nodes.extend([i, j, k, l]);
    let z = match shifted_by_max(index, s) {
        Some((z, shift_nodes)) => {
            nodes.extend(shift_nodes);
            z
        }
        None => s.clone(),
    };
    Some((z, p, nodes))
}

/// `t = x[..., labels]`: `GatherElements(x, idx, axis=last)` with idx `[..., 1]`,
/// `GatherND(x, idx, batch_dims=rank−1)` with idx `[..., 1]`, or
/// `ReduceSum(x · onehot(labels), last axis)`.
pub fn pick(index: &GraphIndex, t: &str) -> Option<Pick> {
    let t = through_identity(index, t);
    let (i, node) = index.producer(t)?;
    match node.op_type() {
        "GatherElements" => {
            let (x, idx) = (node.input.first()?, node.input.get(1)?);
            let axis = attr_i(node, "axis").unwrap_or(0);
            if !is_last_axis(index, x, &[axis]) || !trailing_one(index, idx) {
                return None;
            }
            Some(Pick {
                source: x.clone(),
                labels: idx.clone(),
                shape: ValueShape::Index,
                wraps: true,
                kind: 0,
                nodes: vec![i],
                smoothing: None,
            })
        }
        "GatherND" => {
            let (x, idx) = (node.input.first()?, node.input.get(1)?);
            let rank = static_rank(index, x)?;
            // batch_dims = rank − 1 leaves one axis to index: the index's last dim is 1
            let batch_dims = attr_i(node, "batch_dims").unwrap_or(0);
            if batch_dims != rank as i64 - 1 {
                return None;
            }
            Some(Pick {
                source: x.clone(),
                labels: idx.clone(),
                shape: ValueShape::IndexButLast,
                wraps: true,
                kind: 1,
                nodes: vec![i],
                smoothing: None,
            })
        }
        // the picked value with its kept last axis squeezed away
        "Squeeze" => {
            let mut p = pick(index, node.input.first()?)?;
            let axes = attr_ints(node, "axes")
                .or_else(|| node.input.get(1).and_then(|a| constant_ints(index, a)))?;
            let rank = static_rank(index, node.input.first()?)?;
            if !(axes == [-1] || axes == [rank as i64 - 1]) {
                return None;
            }
            p.shape = match p.shape {
                ValueShape::PositionsAndOne => ValueShape::Positions,
                ValueShape::Index => ValueShape::IndexButLast,
                _ => return None,
            };
            p.nodes.push(i);
            Some(p)
        }
        "ReduceSum" => {
            let (prod, keep, _) = reduce_last(index, t, "ReduceSum")?;
            let (j, mul) = producer(index, through_identity(index, &prod), "Mul")?;
            for (a, b) in [(0, 1), (1, 0)] {
                let (x, h) = (mul.input.get(a)?, mul.input.get(b)?);
                if let Some(mut p) = one_hot(index, h, x) {
                    p.shape = if keep {
                        ValueShape::PositionsAndOne
                    } else {
                        ValueShape::Positions
                    };
                    p.nodes.extend([i, j]);
                    return Some(p);
                }
            }
            None
        }
        _ => None,
    }
}

/// A pick under ops that only move its values (the jax2onnx spelling of
/// `take_along_axis(...)[..., 0]`: `Transpose`, a `Gather` of index 0, a `Where` that fills
/// out-of-range picks): the pick, with the moving nodes added. The value's shape is the
/// caller's to establish.
pub fn pick_through_moves(index: &GraphIndex, t: &str) -> Option<Pick> {
    let mut t = through_identity(index, t);
    let mut moved = Vec::new();
    for _ in 0..12 {
        if let Some(mut p) = pick(index, t) {
            p.nodes.extend(moved);
            return Some(p);
        }
        let (i, n) = index.producer(t)?;
        let next = match n.op_type() {
            "Transpose" | "Reshape" | "Squeeze" | "Unsqueeze" | "Gather" => n.input.first()?,
            "Slice" if slice_keeps_all(index, n) => n.input.first()?,
            "Where" => {
                let computed = |k: usize| {
                    n.input.get(k).filter(|x| {
                        index
                            .producer(x)
                            .is_some_and(|(_, p)| p.op_type() != "Constant")
                    })
                };
                match (computed(1), computed(2)) {
                    (Some(x), None) | (None, Some(x)) => x,
                    _ => return None,
                }
            }
            _ => return None,
        };
        moved.push(i);
        t = through_identity(index, next);
    }
    None
}

/// A `Slice` that keeps every element (the dynamo exporter's `x[:, 0:1]` of an axis of 1, or
/// `x[:]`): starts 0, steps 1, every end at or past the axis' end.
fn slice_keeps_all(index: &GraphIndex, n: &NodeProto) -> bool {
    let Some(x) = n.input.first() else {
        return false;
    };
    let input = |k: usize| n.input.get(k).filter(|t| !t.is_empty());
    let (Some(starts), Some(ends)) = (
        input(1).and_then(|t| constant_ints(index, t)),
        input(2).and_then(|t| constant_ints(index, t)),
    ) else {
        return false;
    };
    let axes = match input(3) {
        Some(t) => constant_ints(index, t),
        None => Some((0..starts.len() as i64).collect()),
    };
    let steps_one = input(4)
        .map(|t| constant_ints(index, t).is_some_and(|s| s.iter().all(|&v| v == 1)))
        .unwrap_or(true);
    let Some(axes) = axes.filter(|a| a.len() == starts.len() && a.len() == ends.len()) else {
        return false;
    };
    steps_one
        && starts.iter().all(|&s| s == 0)
        && axes.iter().zip(&ends).all(|(&axis, &end)| {
            end >= i32::MAX as i64 || index.static_dim(x, axis, 0).is_some_and(|size| end >= size)
        })
}

/// `h = onehot(labels)` over `x`'s classes (float 0/1): `OneHot(labels, depth, [0, 1])` on the
/// last axis, or `Cast(Equal(labels[..., None], Range(0, V, 1)))`; or that one-hot
/// label-smoothed (see [`Smoothing`]): `keep·onehot + spread` (Mul and Add in either operand
/// order), or `OneHot` with values `[spread, keep + spread]`.
fn one_hot(index: &GraphIndex, h: &str, x: &str) -> Option<Pick> {
    let mut t = through_identity(index, h);
    let mut nodes = Vec::new();
    // a cast to the logits' type, a reshape alongside the logits' (`[B, T, V]` → `[B·T, V]`),
    // the smoothing's Add and Mul (in that order from the outside)
    let (mut keep, mut spread) = (None, None);
    for _ in 0..6 {
        let Some((i, n)) = index.producer(t) else {
            break;
        };
        match n.op_type() {
            "Cast" | "Reshape" if !n.input.is_empty() => t = through_identity(index, &n.input[0]),
            "Add" if spread.is_none() && keep.is_none() => {
                let (u, s) = scalar_operand(index, n)?;
                spread = Some(s);
                t = through_identity(index, u);
            }
            "Mul" if keep.is_none() && spread.is_some() => {
                let (u, k) = scalar_operand(index, n)?;
                keep = Some(k);
                t = through_identity(index, u);
            }
            _ => break,
        }
        nodes.push(i);
    }
    let (i, node) = index.producer(t)?;
    nodes.push(i);
    let width = index.static_last_dim(x);
    let mut pick = match node.op_type() {
        "OneHot" => {
            let (labels, depth, values) =
                (node.input.first()?, node.input.get(1)?, node.input.get(2)?);
            if attr_i(node, "axis").unwrap_or(-1) != -1 {
                return None;
            }
            let depth_value = match constant_numbers(index, depth) {
                Some(d) if d.len() == 1 && width.is_none_or(|w| d[0] == w as f64) => Some(d[0]),
                Some(_) => return None,
                None if is_run_time_width(index, depth, width) => None,
                None => return None,
            };
            let smoothing = match constant_numbers(index, values)?.as_slice() {
                [off, on] if *off == 0.0 && *on == 1.0 => None,
                // OneHot(values = [ε/V, 1 − ε + ε/V]): a smoothed one-hot in one node
                [off, on] if spread.is_none() => {
                    let v = depth_value.or(width.map(|w| w as f64))?;
                    Some(smoothing(on - off, *off, v)?)
                }
                _ => return None,
            };
            Pick {
                source: x.to_string(),
                labels: labels.clone(),
                shape: ValueShape::Positions,
                wraps: true,
                kind: 2,
                nodes,
                smoothing,
            }
        }
        "Equal" => {
            let found = [(0, 1), (1, 0)].into_iter().find_map(|(a, b)| {
                let (labels, range) = (node.input.get(a)?, node.input.get(b)?);
                (is_class_range(index, range, width) && trailing_one(index, labels))
                    .then(|| labels.clone())
            });
            Pick {
                source: x.to_string(),
                labels: found?,
                shape: ValueShape::Positions,
                wraps: false,
                kind: 3,
                nodes,
                smoothing: None,
            }
        }
        _ => return None,
    };
    match (keep, spread) {
        (None, None) => Some(pick),
        (Some(keep), Some(spread)) if pick.smoothing.is_none() => {
            pick.smoothing = Some(smoothing_of(index, keep, spread, width)?);
            Some(pick)
        }
        _ => None,
    }
}

/// The non-one-hot operand of the smoothing's `Add`/`Mul`, where it may be a scalar of the
/// smoothing: a constant of one value, or `Div(constant, ·)` (checked by [`smoothing_of`]).
/// Returns (the other operand, the scalar).
fn scalar_operand<'g>(index: &GraphIndex<'g>, n: &'g NodeProto) -> Option<(&'g str, String)> {
    let (a, b) = (n.input.first()?, n.input.get(1)?);
    let is_scalar = |t: &str| {
        single_constant(index, t).is_some()
            || producer(index, through_identity(index, t), "Div").is_some_and(|(_, d)| {
                d.input
                    .first()
                    .and_then(|e| single_constant(index, e))
                    .is_some()
            })
    };
    match (is_scalar(a), is_scalar(b)) {
        (false, true) => Some((a, b.clone())),
        (true, false) => Some((b, a.clone())),
        _ => None,
    }
}

fn single_constant(index: &GraphIndex, t: &str) -> Option<f64> {
    match constant_numbers(index, t)?.as_slice() {
        [v] => Some(*v),
        _ => None,
    }
}

/// `keep·onehot + spread` is label smoothing: `keep = 1 − ε` with 0 ≤ ε < 1 and `spread = ε/V`:
/// a constant (V the classes' width, where the graph fixes it), `ε / V` with V a constant, or
/// `ε / V` with V the width read at run time (the class count of `tf.shape(y)[-1]`, optax's
/// `labels.shape[-1]` under symbolic shapes).
fn smoothing_of(
    index: &GraphIndex,
    keep: String,
    spread: String,
    width: Option<i64>,
) -> Option<Smoothing> {
    let k = single_constant(index, &keep)?;
    let epsilon = match single_constant(index, &spread) {
        Some(s) => smoothing(k, s, width? as f64)?.epsilon,
        None => {
            let (_, div) = producer(index, through_identity(index, &spread), "Div")?;
            let eps = single_constant(index, div.input.first()?)?;
            let classes = div.input.get(1)?;
            match single_constant(index, classes) {
                Some(v) if width.is_none_or(|w| w as f64 == v) => smoothing(k, eps / v, v)?,
                Some(_) => return None,
                None if is_run_time_width(index, classes, width) => smoothing(k, eps, 1.0)?,
                None => return None,
            }
            .epsilon
        }
    };
    Some(Smoothing {
        keep: Scalar::Tensor(keep),
        spread: Scalar::Tensor(spread),
        epsilon,
    })
}

/// `keep·onehot + spread` with constants, rows summing to 1 over `v` classes (float32 rounding
/// allowed): ε = 1 − keep.
fn smoothing(keep: f64, spread: f64, v: f64) -> Option<Smoothing> {
    let epsilon = 1.0 - keep;
    let sums_to_one = (keep + v * spread - 1.0).abs() <= 1e-5;
    ((0.0..1.0).contains(&epsilon) && spread >= 0.0 && sums_to_one).then_some(Smoothing {
        keep: Scalar::Value(keep),
        spread: Scalar::Value(spread),
        epsilon,
    })
}

/// `t` is the last entry of a tensor's run-time shape (`Gather(Shape(y), −1)`, `Shape(y,
/// start=−1)`), possibly cast or reshaped, of a `y` whose width, where the graph fixes it,
/// is `width`.
fn is_run_time_width(index: &GraphIndex, t: &str, width: Option<i64>) -> bool {
    let mut t = through_identity(index, t);
    for _ in 0..8 {
        let Some((_, n)) = index.producer(t) else {
            return false;
        };
        let shape_of = |s: &str| {
            let (_, shape) = producer(index, through_identity(index, s), "Shape")?;
            let y = shape.input.first()?;
            let y_width = index.static_last_dim(y);
            (width.is_none() || y_width.is_none() || width == y_width).then_some((shape, y))
        };
        match n.op_type() {
            "Gather" => {
                let (Some(s), Some(k)) = (n.input.first(), n.input.get(1)) else {
                    return false;
                };
                let Some((shape, y)) = shape_of(s) else {
                    return false;
                };
                // a Shape with start/end attributes is only part of y's shape
                if shape
                    .attribute
                    .iter()
                    .any(|a| a.name() == "start" || a.name() == "end")
                {
                    return false;
                }
                let last = static_rank(index, y).map(|r| r as i64 - 1);
                return matches!(constant_ints(index, k).as_deref(), Some([k]) if *k == -1 || Some(*k) == last);
            }
            "Shape" => {
                return attr_i(n, "start") == Some(-1)
                    && attr_i(n, "end").is_none()
                    && shape_of(t).is_some();
            }
            "Cast" | "Reshape" | "Squeeze" | "Unsqueeze" if !n.input.is_empty() => {
                t = through_identity(index, &n.input[0])
            }
            _ => return false,
        }
    }
    false
}

/// `Range(0, V, 1)` (or a constant 0..V), V the classes' width where the graph fixes it.
fn is_class_range(index: &GraphIndex, t: &str, width: Option<i64>) -> bool {
    let t = through_identity(index, t);
    if let Some(values) = constant_numbers(index, t) {
        return values.iter().enumerate().all(|(k, v)| *v == k as f64)
            && width.is_none_or(|w| values.len() as i64 == w);
    }
    let Some((_, r)) = producer(index, t, "Range") else {
        return false;
    };
    let num = |k: usize| {
        r.input
            .get(k)
            .and_then(|x| constant_numbers(index, x))
            .filter(|v| v.len() == 1)
            .map(|v| v[0])
    };
    num(0) == Some(0.0)
        && num(2) == Some(1.0)
        && match (num(1), width) {
            (Some(limit), Some(w)) => limit == w as f64,
            (Some(_), None) => true,
            // a run-time limit: the width read from the tensor's shape
            (None, _) => true,
        }
}

/// The index tensor ends in an axis of size 1 (declared, or an `Unsqueeze` at the end).
fn trailing_one(index: &GraphIndex, idx: &str) -> bool {
    if let Some((_, dims)) = index.declared_shape(idx) {
        return dims.last() == Some(&Some(1));
    }
    match index.producer(idx) {
        Some((_, n)) if n.op_type() == "Unsqueeze" => {
            let axes = attr_ints(n, "axes")
                .or_else(|| n.input.get(1).and_then(|a| constant_ints(index, a)));
            let out_rank = static_rank(index, idx);
            matches!(axes.as_deref(), Some([-1]))
                || matches!((axes.as_deref(), out_rank), (Some([a]), Some(r)) if *a == r as i64 - 1)
        }
        Some((_, n)) if matches!(n.op_type(), "Cast" | "Identity") => {
            n.input.first().is_some_and(|x| trailing_one(index, x))
        }
        _ => false,
    }
}

/// Looks through the ops exporters put between a constant and its use that keep its values:
/// `Identity`, `Cast`/`CastLike` (rounded toward zero to integer types, as ONNX casts),
/// `Reshape`, `Squeeze`, `Unsqueeze`, `Flatten`.
pub fn constant_numbers(index: &GraphIndex, t: &str) -> Option<Vec<f64>> {
    use crate::onnx::proto::tensor_proto::DataType;
    let mut t = t;
    let mut to_int = false;
    for _ in 0..8 {
        let (_, n) = match index.producer(t) {
            Some((_, n)) if n.op_type() == "Constant" => break,
            Some(p) if index.constant_tensor(t).is_none() => p,
            _ => break,
        };
        match n.op_type() {
            "Identity" | "Reshape" | "Squeeze" | "Unsqueeze" | "Flatten" => {}
            "Cast" => {
                let to = DataType::try_from(attr_i(n, "to")? as i32).ok()?;
                if to == DataType::Bool {
                    return None;
                }
                to_int |= !matches!(
                    to,
                    DataType::Float | DataType::Double | DataType::Float16 | DataType::Bfloat16
                );
            }
            // CastLike(constant, like): the constant in like's type
            "CastLike" => {
                let like = n.input.get(1).and_then(|l| index.elem_type(l));
                let float_like = like.is_some_and(|e| {
                    [
                        DataType::Float,
                        DataType::Double,
                        DataType::Float16,
                        DataType::Bfloat16,
                    ]
                    .iter()
                    .any(|d| *d as i32 == e)
                });
                if like == Some(DataType::Bool as i32) {
                    return None;
                }
                to_int |= !float_like;
            }
            _ => return None,
        }
        t = n.input.first()?;
    }
    let values = constant_values(index, t)?;
    Some(if to_int {
        values.into_iter().map(f64::trunc).collect()
    } else {
        values
    })
}

/// The values of a small numeric constant (initializer or Constant node), as f64.
fn constant_values(index: &GraphIndex, t: &str) -> Option<Vec<f64>> {
    use crate::onnx::proto::tensor_proto::DataType;
    // Constant(value_int(s)/value_float(s)), as the dynamo exporter writes small ones
    if let Some((_, n)) = producer(index, t, "Constant") {
        for a in &n.attribute {
            match a.name() {
                "value_int" => return Some(vec![a.i() as f64]),
                "value_ints" if a.ints.len() <= 4096 => {
                    return Some(a.ints.iter().map(|&v| v as f64).collect())
                }
                "value_float" => return Some(vec![a.f() as f64]),
                "value_floats" if a.floats.len() <= 4096 => {
                    return Some(a.floats.iter().map(|&v| v as f64).collect())
                }
                _ => {}
            }
        }
    }
    let tensor = index.constant_tensor(t)?;
    let count: i64 = tensor.dims.iter().product();
    if !(0..=4096).contains(&count) {
        return None;
    }
    let raw = tensor.raw_data.as_deref().unwrap_or(&[]);
    let from_raw = |size: usize, f: &dyn Fn(&[u8]) -> f64| -> Vec<f64> {
        raw.chunks_exact(size).map(f).collect()
    };
    let dt = DataType::try_from(tensor.data_type()).ok()?;
    let values: Vec<f64> = match dt {
        DataType::Float if raw.is_empty() => tensor.float_data.iter().map(|&x| x as f64).collect(),
        DataType::Float => from_raw(4, &|c| f32::from_le_bytes(c.try_into().unwrap()) as f64),
        DataType::Double if raw.is_empty() => tensor.double_data.clone(),
        DataType::Double => from_raw(8, &|c| f64::from_le_bytes(c.try_into().unwrap())),
        DataType::Int64 if raw.is_empty() => tensor.int64_data.iter().map(|&x| x as f64).collect(),
        DataType::Int64 => from_raw(8, &|c| i64::from_le_bytes(c.try_into().unwrap()) as f64),
        DataType::Int32 if raw.is_empty() => tensor.int32_data.iter().map(|&x| x as f64).collect(),
        DataType::Int32 => from_raw(4, &|c| i32::from_le_bytes(c.try_into().unwrap()) as f64),
        _ => return None,
    };
    (values.len() as i64 == count.max(1) || (count == 0 && values.is_empty())).then_some(values)
}

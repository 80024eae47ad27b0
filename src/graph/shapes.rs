//! Symbolic shapes, inferred forward where the graph proves them: known sizes, named symbolic
//! dims (`B`, `T` of the graph inputs), or unknown. The backward uses them for one question —
//! "does this operand already have the output's shape?" — to skip the run-time reduction of a
//! broadcast gradient where nothing was broadcast. Only proven equalities count: an unknown
//! dim never equals anything, so a wrong answer is impossible, only a missed one.
//!
//! Shape vectors (`Shape` → `Gather` → `Unsqueeze` → `Concat` → `Reshape`, how exporters write
//! reshapes) are followed by value, so reshapes to run-time shapes keep their dims.

use crate::graph::hash::HashMap;

use crate::graph::GraphIndex;
use crate::onnx::proto::tensor_shape_proto::dimension;
use crate::onnx::proto::type_proto;
use crate::onnx::{attr, attr_i, attr_ints, NodeProto};

/// A Slice end at or beyond this means "to the end of the axis" (exporters write `INT64_MAX`,
/// some `2^63 − 2`).
pub const SLICE_TO_THE_END: i64 = 1 << 62;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Dim {
    Known(i64),
    Sym(String),
    Unknown,
}

impl Dim {
    fn proven_eq(&self, other: &Dim) -> bool {
        *self != Dim::Unknown && self == other
    }
}

type Shape = Vec<Dim>;

#[derive(Debug, Default)]
pub struct Shapes {
    shape: HashMap<String, Shape>,
    /// Values of small 1-D / scalar int64 tensors, element by element (shape vectors).
    value: HashMap<String, Vec<Dim>>,
    /// For shapes ntl-patch declares with its own symbols (`ntl/...`, the fused head's
    /// positions): the first tensor declared with that shape, whose `Shape` the backward reads
    /// instead of a later tensor's of the same shape.
    source: HashMap<Shape, String>,
}

/// A symbolic dim ntl-patch declared itself.
fn is_own_symbol(d: &Dim) -> bool {
    matches!(d, Dim::Sym(s) if s.starts_with("ntl/"))
}

impl Shapes {
    /// True when `a` and `b` provably have the same shape.
    pub fn same(&self, a: &str, b: &str) -> bool {
        match (self.shape.get(a), self.shape.get(b)) {
            (Some(x), Some(y)) => {
                x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.proven_eq(q))
            }
            _ => false,
        }
    }

    /// True when every tensor of `xs` provably has rank `rank` and, on `axes`, the first one's
    /// dims (each known or symbolic).
    pub fn same_axes(&self, xs: &[&str], rank: usize, axes: std::ops::Range<usize>) -> bool {
        let shapes: Option<Vec<&Shape>> = xs.iter().map(|x| self.shape.get(*x)).collect();
        let Some(shapes) = shapes.filter(|s| s.iter().all(|s| s.len() == rank)) else {
            return false;
        };
        axes.into_iter()
            .all(|i| shapes.iter().all(|s| s[i].proven_eq(&shapes[0][i])))
    }

    /// The axes of `y` (the output of a broadcasting op) that the operand `x` was broadcast
    /// along, where the shapes prove them: the leading axes `x` lacks, and the axes where `x`
    /// has size 1 and `y` may not. None where any axis is in doubt.
    pub fn broadcast_axes(&self, x: &str, y: &str) -> Option<Vec<i64>> {
        let (xs, ys) = (self.shape.get(x)?, self.shape.get(y)?);
        let lead = ys.len().checked_sub(xs.len())?;
        let mut axes: Vec<i64> = (0..lead as i64).collect();
        for (k, (d, e)) in xs.iter().zip(&ys[lead..]).enumerate() {
            match d {
                Dim::Known(1) if *e != Dim::Known(1) => axes.push((lead + k) as i64),
                Dim::Known(1) => {}
                Dim::Known(_) => {}
                _ if d.proven_eq(e) => {}
                _ => return None,
            }
        }
        Some(axes)
    }

    pub fn get(&self, t: &str) -> Option<&Shape> {
        self.shape.get(t)
    }

    /// The tensor whose `Shape` stands for `t`'s: the first tensor ntl-patch declared with the
    /// same shape, where there is one, else `t`. The fused head declares its labels that way, so
    /// the gradient of a per-position loss reads the labels' shape, not the loss's, and does
    /// not wait for the forward.
    pub fn shape_source<'a>(&'a self, t: &'a str) -> &'a str {
        self.shape
            .get(t)
            .and_then(|s| self.source.get(s))
            .map_or(t, String::as_str)
    }

    /// The value of a small int64 vector (a shape vector, a Slice's starts), where followed.
    pub fn value(&self, t: &str) -> Option<&[Dim]> {
        self.value.get(t).map(Vec::as_slice)
    }

    /// The value of a small int64 vector when every element is a known number.
    pub fn known_ints(&self, t: &str) -> Option<Vec<i64>> {
        self.value(t)?
            .iter()
            .map(|d| match d {
                Dim::Known(v) => Some(*v),
                _ => None,
            })
            .collect()
    }

    /// Elementwise arithmetic on shape vectors, as exporters write `expand(-1, ...)` and
    /// `masked_fill` shapes: `Where(Equal(v, -1), ones, v)`, `ConstantOfShape(...) * -1`.
    fn value_op(&self, index: &GraphIndex, node: &NodeProto) -> Option<Vec<Dim>> {
        let value = |i: usize| -> Option<Vec<Dim>> {
            let n = node.input.get(i).filter(|n| !n.is_empty())?;
            self.value.get(n).cloned().or_else(|| {
                index
                    .constant_i64(n)
                    .map(|v| v.into_iter().map(Dim::Known).collect())
            })
        };
        let zip = |a: Vec<Dim>, b: Vec<Dim>, f: &dyn Fn(&Dim, &Dim) -> Dim| -> Option<Vec<Dim>> {
            let n = a.len().max(b.len());
            let at = |v: &Vec<Dim>, k: usize| {
                if v.len() == 1 {
                    v[0].clone()
                } else {
                    v[k].clone()
                }
            };
            (a.len() == n || a.len() == 1)
                .then_some(())
                .filter(|_| b.len() == n || b.len() == 1)?;
            Some((0..n).map(|k| f(&at(&a, k), &at(&b, k))).collect())
        };
        match node.op_type() {
            "ConstantOfShape" => {
                let len = match value(0)?.as_slice() {
                    [Dim::Known(n)] if (0..=64).contains(n) => *n as usize,
                    _ => return None,
                };
                let fill = attr(node, "value")
                    .and_then(|a| a.t.as_ref())
                    .and_then(|t| {
                        if t.data_type() != crate::onnx::INT64 {
                            return None;
                        }
                        t.int64_data.first().copied().or_else(|| {
                            t.raw_data
                                .as_ref()
                                .and_then(|r| r.get(..8))
                                .map(|b| i64::from_le_bytes(b.try_into().expect("8")))
                        })
                    })
                    .unwrap_or(0);
                Some(vec![Dim::Known(fill); len])
            }
            "Mul" | "Add" | "Sub" | "Div" => {
                let op = node.op_type().to_string();
                zip(value(0)?, value(1)?, &move |a, b| match (a, b) {
                    // integer Div truncates toward zero, as Rust's `/`
                    (Dim::Known(x), Dim::Known(y)) if op == "Div" && *y != 0 => Dim::Known(x / y),
                    (_, _) if op == "Div" => match (a, b) {
                        (d, Dim::Known(1)) => d.clone(),
                        _ => Dim::Unknown,
                    },
                    (Dim::Known(x), Dim::Known(y)) => Dim::Known(match op.as_str() {
                        "Mul" => x.saturating_mul(*y),
                        "Add" => x.saturating_add(*y),
                        _ => x.saturating_sub(*y),
                    }),
                    (d, Dim::Known(1)) | (Dim::Known(1), d) if op == "Mul" => d.clone(),
                    (d, Dim::Known(0)) if op != "Mul" => d.clone(),
                    _ => Dim::Unknown,
                })
            }
            "Equal" => zip(value(0)?, value(1)?, &|a, b| match (a, b) {
                (Dim::Known(x), Dim::Known(y)) => Dim::Known((x == y) as i64),
                (a, b) if a.proven_eq(b) => Dim::Known(1),
                // a symbolic size is never negative: it is not -1
                (Dim::Sym(_), Dim::Known(y)) | (Dim::Known(y), Dim::Sym(_)) if *y < 0 => {
                    Dim::Known(0)
                }
                _ => Dim::Unknown,
            }),
            "Where" => {
                let c = value(0)?;
                let ab = zip(value(1)?, value(2)?, &|a, b| {
                    // pairs, encoded: kept only when equal
                    if a.proven_eq(b) {
                        a.clone()
                    } else {
                        Dim::Unknown
                    }
                })?;
                let (a, b) = (value(1)?, value(2)?);
                let n = ab.len().max(c.len());
                let at = |v: &Vec<Dim>, k: usize| {
                    if v.len() == 1 {
                        v[0].clone()
                    } else {
                        v.get(k).cloned().unwrap_or(Dim::Unknown)
                    }
                };
                Some(
                    (0..n)
                        .map(|k| match at(&c, k) {
                            Dim::Known(0) => at(&b, k),
                            Dim::Known(_) => at(&a, k),
                            _ => at(&ab, k),
                        })
                        .collect(),
                )
            }
            // the same elements in another layout (dynamo writes a Slice's bounds as Reshape(const))
            "Reshape" | "Squeeze" | "Unsqueeze" | "Identity" => value(0),
            "Cast" if attr_i(node, "to") == Some(crate::onnx::INT64 as i64) => value(0),
            _ => None,
        }
    }

    pub fn infer(index: &GraphIndex) -> Shapes {
        let g = index.graph;
        let mut s = Shapes::default();
        for t in &g.initializer {
            s.shape.insert(
                t.name().into(),
                t.dims.iter().map(|&d| Dim::Known(d)).collect(),
            );
            // small int64 constants (a Slice's starts and axes) by value
            if let Some(v) = index.constant_i64(t.name()) {
                s.value
                    .insert(t.name().into(), v.into_iter().map(Dim::Known).collect());
            }
        }
        for v in g.input.iter().chain(&g.value_info) {
            if s.shape.contains_key(v.name()) {
                continue;
            }
            let Some(type_proto::Value::TensorType(t)) =
                v.r#type.as_ref().and_then(|t| t.value.as_ref())
            else {
                continue;
            };
            let Some(shape) = &t.shape else { continue };
            let dims: Shape = shape
                .dim
                .iter()
                .map(|d| match &d.value {
                    Some(dimension::Value::DimValue(v)) if *v >= 0 => Dim::Known(*v),
                    Some(dimension::Value::DimParam(p)) if !p.is_empty() => Dim::Sym(p.clone()),
                    _ => Dim::Unknown,
                })
                .collect();
            if dims.iter().any(is_own_symbol) && !dims.contains(&Dim::Unknown) {
                s.source
                    .entry(dims.clone())
                    .or_insert_with(|| v.name().into());
            }
            s.shape.insert(v.name().into(), dims);
        }
        for node in &g.node {
            s.infer_node(index, node);
        }
        s
    }

    fn infer_node(&mut self, index: &GraphIndex, node: &NodeProto) {
        if let (Some(v), Some(o)) = (self.value_op(index, node), node.output.first()) {
            self.value.insert(o.clone(), v);
        }
        if let (true, Some(o)) = (node.op_type() == "Constant", node.output.first()) {
            if let Some(v) = index.constant_i64(o) {
                self.value
                    .entry(o.clone())
                    .or_insert_with(|| v.into_iter().map(Dim::Known).collect());
            }
        }
        let shape = |i: usize| {
            node.input
                .get(i)
                .filter(|n| !n.is_empty())
                .and_then(|n| self.shape.get(n))
                .cloned()
        };
        let value = |i: usize| -> Option<Vec<Dim>> {
            let n = node.input.get(i).filter(|n| !n.is_empty())?;
            self.value.get(n).cloned().or_else(|| {
                index
                    .constant_i64(n)
                    .map(|v| v.into_iter().map(Dim::Known).collect())
            })
        };
        let out = node.output.first().cloned().unwrap_or_default();
        let op = node.op_type();
        let result: Option<Shape> = match op {
            "Constant" => {
                crate::graph::constant_dims(node).map(|d| d.into_iter().map(Dim::Known).collect())
            }
            "Shape" => {
                // the dims from `start` to `end` (the dynamo exporter writes `start=0`)
                if let Some(x) = shape(0) {
                    let n = x.len() as i64;
                    let at = |a: i64| (if a < 0 { (a + n).max(0) } else { a.min(n) }) as usize;
                    let start = at(attr_i(node, "start").unwrap_or(0));
                    let end = at(attr_i(node, "end").unwrap_or(n)).max(start);
                    let dims = x[start..end].to_vec();
                    let len = dims.len() as i64;
                    self.value.insert(out.clone(), dims);
                    Some(vec![Dim::Known(len)])
                } else {
                    None
                }
            }
            "Gather" => {
                let (data, idx) = (shape(0), shape(1));
                if let (Some(v), Some(k)) = (
                    value(0),
                    node.input.get(1).and_then(|n| index.constant_i64(n)),
                ) {
                    // an element of a shape vector
                    let picked: Option<Vec<Dim>> = k
                        .iter()
                        .map(|&i| {
                            let i = if i < 0 { i + v.len() as i64 } else { i };
                            v.get(usize::try_from(i).ok()?).cloned()
                        })
                        .collect();
                    if let Some(p) = picked {
                        self.value.insert(out.clone(), p);
                    }
                }
                let axis = attr_i(node, "axis").unwrap_or(0);
                data.zip(idx).and_then(|(d, i)| {
                    let a = if axis < 0 {
                        axis + d.len() as i64
                    } else {
                        axis
                    } as usize;
                    (a < d.len()).then(|| [&d[..a], &i[..], &d[a + 1..]].concat())
                })
            }
            "Unsqueeze" => {
                let axes = attr_ints(node, "axes")
                    .or_else(|| node.input.get(1).and_then(|n| index.constant_i64(n)));
                if let (Some(v), Some(x)) = (value(0), shape(0)) {
                    if x.is_empty() {
                        self.value.insert(out.clone(), v);
                    }
                }
                shape(0).zip(axes).and_then(|(x, axes)| {
                    let r = (x.len() + axes.len()) as i64;
                    let mut norm: Vec<i64> = axes
                        .iter()
                        .map(|&a| if a < 0 { a + r } else { a })
                        .collect();
                    norm.sort();
                    let mut out = Vec::new();
                    let mut it = x.into_iter();
                    for k in 0..r {
                        if norm.contains(&k) {
                            out.push(Dim::Known(1));
                        } else {
                            out.push(it.next()?);
                        }
                    }
                    Some(out)
                })
            }
            "Slice" => {
                // starts/ends may be computed from shapes (x[..., : x.shape[-1] // 2])
                let consts = |i: usize| -> Option<Vec<i64>> {
                    value(i)?
                        .into_iter()
                        .map(|d| match d {
                            Dim::Known(k) => Some(k),
                            _ => None,
                        })
                        .collect()
                };
                let (starts, ends) = (consts(1), consts(2));
                let axes = consts(3);
                let steps = consts(4);
                let unit = steps.as_ref().is_none_or(|s| s.iter().all(|&x| x == 1));
                match (shape(0), starts, ends) {
                    (Some(x), Some(st), Some(en)) if unit && st.len() == en.len() => {
                        let axes: Vec<i64> = axes.unwrap_or_else(|| (0..st.len() as i64).collect());
                        let r = x.len() as i64;
                        let mut out = x.clone();
                        let mut ok = axes.len() == st.len();
                        for ((&a, &s0), &e0) in axes.iter().zip(&st).zip(&en) {
                            let a = if a < 0 { a + r } else { a };
                            let Some(d) = usize::try_from(a).ok().and_then(|a| out.get_mut(a))
                            else {
                                ok = false;
                                break;
                            };
                            *d = match (&*d, s0, e0) {
                                (_, 0, e) if e >= i32::MAX as i64 => d.clone(),
                                (Dim::Known(n), s, e) => {
                                    let n = *n;
                                    let c = |v: i64| if v < 0 { (v + n).max(0) } else { v.min(n) };
                                    Dim::Known((c(e) - c(s)).max(0))
                                }
                                _ => Dim::Unknown,
                            };
                        }
                        if ok && x.len() == 1 {
                            if let (Some(v), [a], [s0], [e0]) =
                                (value(0), axes.as_slice(), st.as_slice(), en.as_slice())
                            {
                                if *a == 0 || *a == -1 {
                                    let n = v.len() as i64;
                                    let c = |q: i64| if q < 0 { (q + n).max(0) } else { q.min(n) };
                                    let (lo, hi) = (c(*s0) as usize, c(*e0) as usize);
                                    if lo <= hi {
                                        self.value.insert(out_name(node), v[lo..hi].to_vec());
                                    }
                                }
                            }
                        }
                        ok.then_some(out)
                    }
                    _ => None,
                }
            }
            "Split" => {
                if let Some(x) = shape(0) {
                    let axis = attr_i(node, "axis").unwrap_or(0);
                    let r = x.len() as i64;
                    let a = if axis < 0 { axis + r } else { axis } as usize;
                    let sizes = attr_ints(node, "split").or_else(|| {
                        node.input
                            .get(1)
                            .filter(|n| !n.is_empty())
                            .and_then(|n| index.constant_i64(n))
                    });
                    let n = node.output.len() as i64;
                    let sizes = sizes.or_else(|| match x.get(a) {
                        Some(Dim::Known(d)) if n > 0 && d % n == 0 => Some(vec![d / n; n as usize]),
                        _ => None,
                    });
                    for (k, o) in node.output.iter().enumerate() {
                        let mut s = x.clone();
                        if let Some(d) = s.get_mut(a) {
                            *d = sizes
                                .as_ref()
                                .and_then(|v| v.get(k))
                                .map_or(Dim::Unknown, |&v| Dim::Known(v));
                        }
                        self.shape.insert(o.clone(), s);
                    }
                }
                None
            }
            "Squeeze" => {
                if let (Some(v), Some(x)) = (value(0), shape(0)) {
                    if x.len() == 1 {
                        self.value.insert(out.clone(), v);
                    }
                }
                let axes = attr_ints(node, "axes")
                    .or_else(|| node.input.get(1).and_then(|n| index.constant_i64(n)));
                shape(0).zip(axes).map(|(x, axes)| {
                    let r = x.len() as i64;
                    let norm: Vec<i64> = axes
                        .iter()
                        .map(|&a| if a < 0 { a + r } else { a })
                        .collect();
                    x.into_iter()
                        .enumerate()
                        .filter(|(k, _)| !norm.contains(&(*k as i64)))
                        .map(|(_, d)| d)
                        .collect()
                })
            }
            "Concat" => {
                let parts: Option<Vec<Vec<Dim>>> = (0..node.input.len()).map(value).collect();
                if let Some(p) = parts {
                    if shape(0).is_some_and(|s| s.len() == 1) {
                        self.value.insert(out.clone(), p.concat());
                    }
                }
                let shapes: Option<Vec<Shape>> = (0..node.input.len()).map(shape).collect();
                let axis = attr_i(node, "axis").unwrap_or(0);
                shapes.and_then(|ss| {
                    let r = ss.first()?.len();
                    let a = crate::graph::normalize_axis(axis, r)?;
                    let mut out = ss[0].clone();
                    let mut total: Option<i64> = Some(0);
                    for s in &ss {
                        if s.len() != r {
                            return None;
                        }
                        total = match (total, &s[a]) {
                            (Some(t), Dim::Known(k)) => t.checked_add(*k),
                            _ => None,
                        };
                    }
                    out[a] = total.map_or(Dim::Unknown, Dim::Known);
                    Some(out)
                })
            }
            "Reshape" => {
                let target = value(1);
                let allowzero = attr_i(node, "allowzero").unwrap_or(0) != 0;
                let x = shape(0);
                if let (Some(v), Some(t)) = (value(0), target.as_ref()) {
                    if t.len() == 1 {
                        self.value.insert(out.clone(), v);
                    }
                }
                target.map(|t| {
                    let mut dims: Vec<Dim> = t
                        .iter()
                        .enumerate()
                        .map(|(k, d)| match d {
                            Dim::Known(0) if !allowzero => x
                                .as_ref()
                                .and_then(|x| x.get(k).cloned())
                                .unwrap_or(Dim::Unknown),
                            other => other.clone(),
                        })
                        .collect();
                    if let Some(k) = dims.iter().position(|d| *d == Dim::Known(-1)) {
                        dims[k] = x
                            .as_ref()
                            .map_or(Dim::Unknown, |x| inferred_dim(x, &dims, k));
                    }
                    dims
                })
            }
            "Expand" => {
                let target = value(1);
                shape(0).zip(target).map(|(x, t)| broadcast(&[x, t]))
            }
            "ConstantOfShape" => value(0),
            "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceProd"
            | "ReduceSumSquare" | "ReduceL2" | "ReduceLogSumExp" => shape(0).and_then(|x| {
                let keep = attr_i(node, "keepdims").unwrap_or(1) != 0;
                let axes = attr_ints(node, "axes").or_else(|| {
                    match node.input.get(1).filter(|n| !n.is_empty()) {
                        Some(n) => index.constant_i64(n),
                        None => Some(vec![]),
                    }
                })?;
                let r = x.len() as i64;
                let noop = attr_i(node, "noop_with_empty_axes").unwrap_or(0) != 0;
                if axes.is_empty() && noop {
                    return Some(x);
                }
                let all = axes.is_empty();
                let norm: Vec<i64> = axes
                    .iter()
                    .map(|&a| if a < 0 { a + r } else { a })
                    .collect();
                Some(
                    x.into_iter()
                        .enumerate()
                        .filter_map(|(k, d)| {
                            let reduced = all || norm.contains(&(k as i64));
                            match (reduced, keep) {
                                (false, _) => Some(d),
                                (true, true) => Some(Dim::Known(1)),
                                (true, false) => None,
                            }
                        })
                        .collect(),
                )
            }),
            "Range" => match (value(0), value(1), value(2)) {
                (Some(s), Some(l), Some(d))
                    if s == [Dim::Known(0)] && d == [Dim::Known(1)] && l.len() == 1 =>
                {
                    Some(l)
                }
                _ => None,
            },
            "Transpose" => shape(0).and_then(|x| {
                let perm =
                    attr_ints(node, "perm").unwrap_or_else(|| (0..x.len() as i64).rev().collect());
                perm.iter()
                    .map(|&p| x.get(usize::try_from(p).ok()?).cloned())
                    .collect()
            }),
            "MatMul" => match (shape(0), shape(1)) {
                (Some(a), Some(b)) if a.len() >= 2 && b.len() >= 2 => {
                    let batch = broadcast(&[a[..a.len() - 2].to_vec(), b[..b.len() - 2].to_vec()]);
                    Some([batch, vec![a[a.len() - 2].clone(), b[b.len() - 1].clone()]].concat())
                }
                _ => None,
            },
            "Gemm" => match (shape(0), shape(1)) {
                (Some(a), Some(b)) if a.len() == 2 && b.len() == 2 => {
                    let m = if attr_i(node, "transA").unwrap_or(0) != 0 {
                        &a[1]
                    } else {
                        &a[0]
                    };
                    let n = if attr_i(node, "transB").unwrap_or(0) != 0 {
                        &b[0]
                    } else {
                        &b[1]
                    };
                    Some(vec![m.clone(), n.clone()])
                }
                _ => None,
            },
            "Add" | "Sub" | "Mul" | "Div" | "Pow" | "Equal" | "Less" | "Greater"
            | "LessOrEqual" | "GreaterOrEqual" | "And" | "Or" | "Xor" | "Max" | "Min" | "Where"
            | "Sum" => {
                let all: Option<Vec<Shape>> = (0..node.input.len()).map(shape).collect();
                all.map(|s| broadcast(&s))
            }
            "Neg" | "Exp" | "Log" | "Sqrt" | "Tanh" | "Sigmoid" | "Erf" | "Relu" | "Abs"
            | "Reciprocal" | "Identity" | "Cast" | "CastLike" | "Softmax" | "LogSoftmax"
            | "Dropout" | "LayerNormalization" | "Clip" | "Not" | "Sin" | "Cos" | "Sign"
            // a scatter writes into a copy of its data (T5's and BART's labels shifted right)
            | "ScatterND" | "ScatterElements" => {
                if matches!(op, "Cast" | "Identity" | "CastLike") {
                    if let Some(v) = value(0) {
                        self.value.insert(out.clone(), v);
                    }
                }
                shape(0)
            }
            _ => None,
        };
        if let Some(mut r) = result {
            if !out.is_empty() {
                // a dim the walk cannot tell keeps ntl-patch's own declaration of it
                if let Some(declared) = self.shape.get(&out).filter(|d| d.len() == r.len()) {
                    for (dim, known) in r.iter_mut().zip(declared) {
                        if *dim == Dim::Unknown && is_own_symbol(known) {
                            *dim = known.clone();
                        }
                    }
                }
                self.shape.insert(out, r);
            }
        }
    }
}

fn out_name(node: &NodeProto) -> String {
    node.output.first().cloned().unwrap_or_default()
}

/// Numpy broadcasting of proven shapes: a dim is kept where the operands provably agree or
/// the others are 1; a known size other than 1 wins (a valid graph broadcasts to it).
fn broadcast(shapes: &[Shape]) -> Shape {
    let r = shapes.iter().map(|s| s.len()).max().unwrap_or(0);
    (0..r)
        .map(|k| {
            let dims: Vec<&Dim> = shapes
                .iter()
                .filter_map(|s| (k + s.len()).checked_sub(r).map(|i| &s[i]))
                .collect();
            let not_one: Vec<&&Dim> = dims.iter().filter(|d| ***d != Dim::Known(1)).collect();
            if not_one.is_empty() {
                return Dim::Known(1);
            }
            if let Some(known) = not_one.iter().find(|d| matches!(**d, Dim::Known(_))) {
                return (**known).clone();
            }
            let first = not_one[0];
            if not_one.iter().all(|d| d.proven_eq(first))
                && !not_one.iter().any(|d| ***d == Dim::Unknown)
            {
                (*first).clone()
            } else {
                Dim::Unknown
            }
        })
        .collect()
}

/// The `-1` of a reshape: the input's dims, less the target's other dims matched by proven
/// equality, must leave exactly one dim, or known sizes whose product the target's unmatched
/// known sizes divide.
fn inferred_dim(input: &[Dim], target: &[Dim], minus_one: usize) -> Dim {
    let mut left: Vec<&Dim> = input.iter().filter(|d| **d != Dim::Known(1)).collect();
    let mut unmatched: Vec<i64> = Vec::new();
    for (k, d) in target.iter().enumerate() {
        if k == minus_one || *d == Dim::Known(1) {
            continue;
        }
        if let Some(i) = left.iter().position(|l| l.proven_eq(d)) {
            left.remove(i);
            continue;
        }
        match d {
            Dim::Known(n) if *n > 0 => unmatched.push(*n),
            _ => return Dim::Unknown,
        }
    }
    if unmatched.is_empty() {
        return match left.as_slice() {
            [only] => (*only).clone(),
            [] => Dim::Known(1),
            _ => Dim::Unknown,
        };
    }
    let mut known: i64 = 1;
    for d in left {
        match d {
            Dim::Known(n) => known = known.saturating_mul(*n),
            _ => return Dim::Unknown,
        }
    }
    let divisor: i64 = unmatched.iter().product();
    if divisor > 0 && known % divisor == 0 {
        Dim::Known(known / divisor)
    } else {
        Dim::Unknown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sym(s: &str) -> Dim {
        Dim::Sym(s.into())
    }

    #[test]
    fn broadcast_keeps_only_what_is_proven() {
        use Dim::*;
        assert_eq!(
            broadcast(&[vec![sym("B"), Known(4)], vec![Known(4)]]),
            vec![sym("B"), Known(4)]
        );
        assert_eq!(broadcast(&[vec![sym("B")], vec![Known(1)]]), vec![sym("B")]);
        // two different symbols, or an unknown beside a symbol: nothing proven
        assert_eq!(broadcast(&[vec![sym("B")], vec![sym("T")]]), vec![Unknown]);
        assert_eq!(broadcast(&[vec![Unknown], vec![sym("T")]]), vec![Unknown]);
        // a known size other than 1 is what a valid graph broadcasts to
        assert_eq!(broadcast(&[vec![Unknown], vec![Known(7)]]), vec![Known(7)]);
    }

    /// `Shape(start, end)` gives the dims between (the dynamo exporter writes `start=0`), and a
    /// `Constant(value_ints=…)` has the shape of its list.
    #[test]
    fn shape_ranges_and_value_ints_constants() {
        use crate::graph::test_node as node;
        use crate::onnx::{int_attr, ints_attr, GraphProto};
        let graph = GraphProto {
            node: vec![
                node("Reshape", &["x", "dims"], "x4", vec![]),
                node("Shape", &["x4"], "all", vec![int_attr("start", 0)]),
                node(
                    "Shape",
                    &["x4"],
                    "mid",
                    vec![int_attr("start", 1), int_attr("end", -1)],
                ),
                node(
                    "Constant",
                    &[],
                    "c",
                    vec![ints_attr("value_ints", &[7, 8, 9])],
                ),
            ],
            initializer: vec![crate::onnx::i64_tensor("dims", &[4], &[2, 3, 4, 5])],
            ..Default::default()
        };
        let s = Shapes::infer(&GraphIndex::new(&graph));
        assert_eq!(s.known_ints("all"), Some(vec![2, 3, 4, 5]));
        assert_eq!(s.known_ints("mid"), Some(vec![3, 4]));
        assert_eq!(s.get("mid"), Some(&vec![Dim::Known(2)]));
        assert_eq!(s.get("c"), Some(&vec![Dim::Known(3)]));
        assert_eq!(s.known_ints("c"), Some(vec![7, 8, 9]));
    }

    /// A scatter's output is its data's shape: T5's labels shifted right (a `ScatterND` into
    /// zeros of the labels' shape) keep `[B, T]`, and with it the logits' width that
    /// `logits.view(-1, logits.size(-1))` reads.
    #[test]
    fn a_scatter_has_its_datas_shape() {
        use crate::graph::test_node as node;
        use crate::onnx::GraphProto;
        let graph = GraphProto {
            node: vec![
                node("Reshape", &["x", "dims"], "x2", vec![]),
                node("ScatterND", &["x2", "at", "u"], "nd", vec![]),
                node("ScatterElements", &["x2", "at", "u"], "el", vec![]),
            ],
            initializer: vec![crate::onnx::i64_tensor("dims", &[2], &[3, 5])],
            ..Default::default()
        };
        let s = Shapes::infer(&GraphIndex::new(&graph));
        for out in ["nd", "el"] {
            assert_eq!(
                s.get(out),
                Some(&vec![Dim::Known(3), Dim::Known(5)]),
                "{out}"
            );
        }
    }

    #[test]
    fn unknown_never_equals_unknown() {
        assert!(!Dim::Unknown.proven_eq(&Dim::Unknown));
        assert!(sym("B").proven_eq(&sym("B")));
    }

    #[test]
    fn reshape_minus_one_is_inferred_only_when_proven() {
        use Dim::*;
        let x = [sym("B"), sym("T"), Known(32)];
        assert_eq!(
            inferred_dim(&x, &[sym("B"), sym("T"), Known(-1), Known(16)], 2),
            Known(2)
        );
        assert_eq!(
            inferred_dim(&x, &[Known(-1), Known(32)], 0),
            Unknown,
            "B·T is no single dim"
        );
        assert_eq!(
            inferred_dim(&[sym("B"), sym("T")], &[Known(-1), sym("T")], 0),
            sym("B")
        );
        assert_eq!(
            inferred_dim(&x, &[sym("B"), Known(-1), Known(5)], 1),
            Unknown
        );
    }

    #[test]
    fn broadcast_axes_need_every_axis_proven() {
        let mut s = Shapes::default();
        s.shape.insert("bias".into(), vec![Dim::Known(32)]);
        s.shape
            .insert("y".into(), vec![sym("B"), sym("T"), Dim::Known(32)]);
        s.shape.insert(
            "mask".into(),
            vec![sym("B"), Dim::Known(1), Dim::Known(1), sym("T")],
        );
        s.shape.insert(
            "scores".into(),
            vec![sym("B"), Dim::Known(2), sym("T"), sym("T")],
        );
        s.shape
            .insert("half".into(), vec![Dim::Unknown, Dim::Known(32)]);
        assert_eq!(s.broadcast_axes("bias", "y"), Some(vec![0, 1]));
        assert_eq!(s.broadcast_axes("mask", "scores"), Some(vec![1, 2]));
        assert_eq!(s.broadcast_axes("half", "y"), None);
        assert!(s.same("y", "y") && !s.same("half", "half"));
    }
}

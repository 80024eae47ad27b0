//! Symbolic shapes, inferred forward where the graph proves them: known sizes, named symbolic
//! dims (`B`, `T` of the graph inputs), or unknown. The backward uses them for one question —
//! "does this operand already have the output's shape?" — to skip the run-time reduction of a
//! broadcast gradient where nothing was broadcast. Only proven equalities count: an unknown
//! dim never equals anything, so a wrong answer is impossible, only a missed one.
//!
//! Shape vectors (`Shape` → `Gather` → `Unsqueeze` → `Concat` → `Reshape`, how exporters write
//! reshapes) are followed by value, so reshapes to run-time shapes keep their dims.

use std::collections::HashMap;

use crate::graph::GraphIndex;
use crate::onnx::proto::tensor_shape_proto::dimension;
use crate::onnx::proto::type_proto;
use crate::onnx::{attr, attr_i, attr_ints, NodeProto};

#[derive(Debug, Clone, PartialEq, Eq)]
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

    pub fn get(&self, t: &str) -> Option<&Shape> {
        self.shape.get(t)
    }

    pub fn infer(index: &GraphIndex) -> Shapes {
        let g = index.graph;
        let mut s = Shapes::default();
        for t in &g.initializer {
            s.shape.insert(
                t.name().into(),
                t.dims.iter().map(|&d| Dim::Known(d)).collect(),
            );
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
            let dims = shape
                .dim
                .iter()
                .map(|d| match &d.value {
                    Some(dimension::Value::DimValue(v)) if *v >= 0 => Dim::Known(*v),
                    Some(dimension::Value::DimParam(p)) if !p.is_empty() => Dim::Sym(p.clone()),
                    _ => Dim::Unknown,
                })
                .collect();
            s.shape.insert(v.name().into(), dims);
        }
        for node in &g.node {
            s.infer_node(index, node);
        }
        s
    }

    fn infer_node(&mut self, index: &GraphIndex, node: &NodeProto) {
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
            "Constant" => attr(node, "value").and_then(|a| a.t.as_ref()).map(|t| {
                if let Some(v) = index.constant_i64(&out) {
                    self.value
                        .insert(out.clone(), v.into_iter().map(Dim::Known).collect());
                }
                t.dims.iter().map(|&d| Dim::Known(d)).collect()
            }),
            "Shape" if attr_i(node, "start").is_none() && attr_i(node, "end").is_none() => {
                if let Some(x) = shape(0) {
                    let n = x.len() as i64;
                    self.value.insert(out.clone(), x);
                    Some(vec![Dim::Known(n)])
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
                let consts = |i: usize| {
                    node.input
                        .get(i)
                        .filter(|n| !n.is_empty())
                        .and_then(|n| index.constant_i64(n))
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
                    let a = if axis < 0 { axis + r as i64 } else { axis } as usize;
                    let mut out = ss[0].clone();
                    let mut total: Option<i64> = Some(0);
                    for s in &ss {
                        if s.len() != r {
                            return None;
                        }
                        total = match (total, &s[a]) {
                            (Some(t), Dim::Known(k)) => Some(t + k),
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
            | "Dropout" | "LayerNormalization" | "Clip" | "Not" | "Sin" | "Cos" | "Sign" => {
                if matches!(op, "Cast" | "Identity" | "CastLike") {
                    if let Some(v) = value(0) {
                        self.value.insert(out.clone(), v);
                    }
                }
                shape(0)
            }
            _ => None,
        };
        if let Some(r) = result {
            if !out.is_empty() {
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

/// The `-1` of a reshape: proven only when the input's dims, less the target's other dims
/// (matched by proven equality, 1s ignored), leave exactly one dim.
fn inferred_dim(input: &[Dim], target: &[Dim], minus_one: usize) -> Dim {
    let mut left: Vec<&Dim> = input.iter().filter(|d| **d != Dim::Known(1)).collect();
    for (k, d) in target.iter().enumerate() {
        if k == minus_one || *d == Dim::Known(1) {
            continue;
        }
        match left.iter().position(|l| l.proven_eq(d)) {
            Some(i) => {
                left.remove(i);
            }
            None => return Dim::Unknown,
        }
    }
    match left.as_slice() {
        [only] => (*only).clone(),
        [] => Dim::Known(1),
        _ => Dim::Unknown,
    }
}

//! Whole-graph reverse-mode differentiation in default-domain ONNX ops, for the step graph.
//!
//! `differentiate` walks the forward nodes backwards from the loss and emits, for each node
//! on a path from a trained parameter to the loss, the nodes of its vector-Jacobian product
//! (`rules/`: one rule per op family, registered by op type in `rules::rule`). Gradients of a
//! tensor used several times are summed. Shapes stay symbolic: rules read dimensions at run
//! time (`Shape`), and broadcasting is undone by summing over the axes the forward op
//! broadcast (`Ctx::unbroadcast`). Which inputs carry a gradient follows ONNX Runtime's
//! gradient builder (Clip's bounds, Where's condition, integer casts stop it), so graphs that
//! rely on those stop edges (the `scaled` combination, NTIL's straight-through estimator)
//! mean the same here.

pub mod canonical;
pub mod rules;
mod slice_parts;
mod transposed_products;

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::error::Error;
use crate::graph::ranks::Ranks;
use crate::graph::shapes::Shapes;
use crate::onnx::{int_attr, NodeProto};
use ntl_ops::Builder;

/// What a rule emits with: the node builder, ranks, the opset, and small cached constants.
pub struct Ctx<'a> {
    pub b: &'a mut Builder,
    pub ranks: &'a mut Ranks,
    /// Proven forward shapes: where an operand already has the output's shape, its gradient
    /// needs no run-time reduction.
    pub shapes: &'a Shapes,
    /// Element types through the forward graph (a Cast's gradient casts back to its input's).
    pub types: &'a crate::graph::elem_types::ElemTypes,
    pub opset: i64,
    scalars: HashMap<(u32, &'static str), String>,
    /// The loss being differentiated (a run-time value), and the float32 zero read from it.
    loss: Option<String>,
    runtime_zero: Option<String>,
    /// Sparse contributions a rule hands back instead of a dense gradient (see `Scatter`).
    scatters: Vec<(String, Scatter)>,
    /// Forward tensor → its summed gradient, for every node output the walk passed
    /// (recomputation reads a block's incoming gradient from it).
    pub gradient_of: HashMap<String, String>,
    /// The tensors whose rows a `Gather` (axis 0) reads that get the gathered rows' gradient as
    /// a sparse contribution: the trained parameters of `differentiate` (an embedding).
    sparse_rows: HashSet<String>,
    /// A weight's gradient as `Gemm(x, dy, transA=1)` rather than `MatMul(Transpose(x), dy)`;
    /// off where autocast will make it half (onnxruntime's CPU Gemm loses precision in
    /// float16 that its MatMul keeps).
    pub weight_grads_by_gemm: bool,
    /// Query rows per block of an exported `Attention` operator's blockwise gradient.
    pub attention_block: i64,
    /// Slices' gradients padded back by `Pad`: joined where they tile an axis.
    slice_parts: slice_parts::SliceParts,
    /// Softmax outputs whose NaN rows the forward fills (`Where(IsNaN(p), 0, p)`, as optimum's
    /// export of SDPA): the filled tensor, which the Softmax's gradient reads in their place.
    pub nan_filled: HashMap<String, String>,
}

/// A gradient that is zero except at a few places along one axis: `updates` belong at
/// `indices` (same shape) of the tensor's gradient. Added into the dense gradient with one
/// `ScatterElements(reduction="add")` instead of building zeros, scattering and summing —
/// the number loss reads K of the V logits columns, so its gradient touches `[N, K]` values.
pub struct Scatter {
    pub indices: String,
    pub updates: String,
    pub axis: i64,
}

impl<'a> Ctx<'a> {
    pub fn new(
        b: &'a mut Builder,
        ranks: &'a mut Ranks,
        shapes: &'a Shapes,
        types: &'a crate::graph::elem_types::ElemTypes,
        opset: i64,
    ) -> Self {
        Ctx {
            b,
            ranks,
            shapes,
            types,
            opset,
            scalars: HashMap::new(),
            loss: None,
            runtime_zero: None,
            scatters: Vec::new(),
            gradient_of: HashMap::new(),
            sparse_rows: HashSet::new(),
            weight_grads_by_gemm: true,
            attention_block: crate::passes::attention::DEFAULT_BLOCK,
            slice_parts: Default::default(),
            nan_filled: HashMap::new(),
        }
    }

    /// Records a sparse gradient contribution to `tensor` (a rule then returns None for it).
    pub fn scatter_into(&mut self, tensor: &str, scatter: Scatter) {
        self.scatters.push((tensor.to_string(), scatter));
    }

    /// Whether the rows a `Gather` (axis 0) reads from `tensor` may come back as a sparse
    /// contribution rather than a dense `ScatterND` into zeros.
    pub fn sparse_rows(&self, tensor: &str) -> bool {
        self.sparse_rows.contains(tensor)
    }

    /// A float32 scalar constant, shared by every rule that asks for the same value.
    pub fn f32(&mut self, v: f32) -> String {
        if let Some(n) = self.scalars.get(&(v.to_bits(), "f32")) {
            return n.clone();
        }
        let n = self.b.scalar_f32("grad/c", v);
        self.ranks.set(&n, 0);
        self.scalars.insert((v.to_bits(), "f32"), n.clone());
        n
    }

    /// A 1-D int64 constant.
    pub fn i64s(&mut self, v: &[i64]) -> String {
        let n = self.b.const_i64("grad/c", &[v.len() as i64], v);
        self.ranks.set(&n, 1);
        n
    }

    pub fn op(&mut self, op: &str, inputs: &[&str], hint: &str) -> String {
        self.b.node(op, inputs, hint, vec![])
    }

    /// `Shape(x)`, read from an earlier tensor of the same proven shape where ntl-patch
    /// declared one (`Shapes::shape_source`).
    pub fn shape(&mut self, x: &str) -> String {
        let source = self.shapes.shape_source(x).to_string();
        self.op("Shape", &[&source], "grad/shape")
    }

    /// Zeros of `x`'s shape (float32).
    pub fn zeros_like(&mut self, x: &str) -> String {
        let s = self.shape(x);
        self.zeros(&s)
    }

    /// Zeros of a run-time shape (float32). Expand of a scalar rather than ConstantOfShape:
    /// onnxruntime-rocm 1.22 registers no ConstantOfShape for opsets 20 and 21. The scalar is
    /// read from the loss, so a runtime cannot fold the zeros into a constant where the shape
    /// is static: onnxruntime would keep the embedding gradient's [V, d] base as an initializer
    /// for the session's life (545 MB at Qwen2-0.5B's shape).
    pub fn zeros(&mut self, shape: &str) -> String {
        let zero = self.zero_from_loss();
        self.op("Expand", &[&zero, shape], "grad/zeros")
    }

    /// 0.0 as `Less(l, l)` of the loss's first element, cast to float: no constant, never NaN
    /// (every comparison with NaN is false), and no empty tensor (tract cannot run those).
    fn zero_from_loss(&mut self) -> String {
        if let Some(z) = &self.runtime_zero {
            return z.clone();
        }
        let Some(loss) = self.loss.clone() else {
            return self.f32(0.0);
        };
        let minus_one = self.i64s(&[-1]);
        let flat = self.op("Reshape", &[&loss, &minus_one], "grad/loss_flat");
        let first = self.b.const_i64("grad/c", &[], &[0]);
        let l = self.op("Gather", &[&flat, &first], "grad/loss_first");
        let never = self.op("Less", &[&l, &l], "grad/never");
        let zero = self.b.cast(&never, crate::onnx::FLOAT, "grad/zero");
        self.ranks.set(&zero, 0);
        self.runtime_zero = Some(zero.clone());
        zero
    }

    /// The gradient `g` of the forward output `y`, summed down to the shape of its operand `x`:
    /// nothing to do where the shapes provably agree.
    pub fn unbroadcast_to(&mut self, g: &str, x: &str, y: &str) -> String {
        if self.shapes.same(x, y) {
            return g.to_string();
        }
        if let Some(axes) = self.shapes.broadcast_axes(x, y) {
            // The reduced axes are known: one ReduceSum with constant axes, no run-time search.
            let axes = self.i64s(&axes);
            let xs = self.shape(x);
            return self.sum_to(g, &axes, x, &xs);
        }
        let rank = self.ranks.get(y);
        self.unbroadcast(g, x, rank)
    }

    /// Sums `g` (the gradient of a broadcasting op's output) down to the shape of its input `x`:
    /// over the leading axes `x` lacks and the axes where `x` has size 1. Computed at run time,
    /// so symbolic dimensions work.
    pub fn unbroadcast(&mut self, g: &str, x: &str, out_rank: Option<usize>) -> String {
        let xr = self.ranks.get(x);
        // A scalar operand is broadcast everywhere; the sum over all axes is its gradient.
        if xr == Some(0) {
            let s = self.b.node(
                "ReduceSum",
                &[g],
                "grad/unbroadcast",
                vec![int_attr("keepdims", 0)],
            );
            self.ranks.set(&s, 0);
            return s;
        }
        let xs = self.shape(x);
        let gs = self.shape(g);
        let padded = match (xr, out_rank) {
            (Some(a), Some(b)) if a == b => xs.clone(),
            (Some(a), Some(b)) if a < b => {
                let ones = self.i64s(&vec![1; b - a]);
                self.b.concat(&[&ones, &xs], 0, "grad/padded_shape")
            }
            _ => {
                // rank(g) − rank(x) ones, then x's shape
                let gn = self.op("Size", &[&gs], "grad/grank");
                let xn = self.op("Size", &[&xs], "grad/xrank");
                let d = self.op("Sub", &[&gn, &xn], "grad/rank_diff");
                let one = self.i64s(&[1]);
                let d = self.op("Reshape", &[&d, &one], "grad/rank_diff_1d");
                let one = self.b.const_i64("grad/c", &[], &[1]);
                let ones = self.op("Expand", &[&one, &d], "grad/ones");
                self.b.concat(&[&ones, &xs], 0, "grad/padded_shape")
            }
        };
        // Axes where the padded input is 1 but the gradient is not.
        let one = self.i64s(&[1]);
        let is_one = self.b.equal(&padded, &one, "grad/is_one");
        let g_one = self.b.equal(&gs, &one, "grad/g_is_one");
        let g_not_one = self.op("Not", &[&g_one], "grad/g_not_one");
        let reduce = self.op("And", &[&is_one, &g_not_one], "grad/reduced");
        let axes = self.op("NonZero", &[&reduce], "grad/axes_2d");
        let flat = self.i64s(&[-1]);
        let axes = self.op("Reshape", &[&axes, &flat], "grad/axes");
        self.sum_to(g, &axes, x, &xs)
    }

    /// `g` summed over `axes` (none: unchanged) and reshaped to `x`'s shape `xs`.
    fn sum_to(&mut self, g: &str, axes: &str, x: &str, xs: &str) -> String {
        let summed = self.b.node(
            "ReduceSum",
            &[g, axes],
            "grad/unbroadcast_sum",
            vec![int_attr("keepdims", 1), int_attr("noop_with_empty_axes", 1)],
        );
        let out = self.op("Reshape", &[&summed, xs], "grad/unbroadcast");
        if let Some(r) = self.ranks.get(x) {
            self.ranks.set(&out, r);
        }
        out
    }

    /// `x` reshaped to `[-1, last dim]`.
    pub fn flatten_to_2d(&mut self, x: &str) -> String {
        let s = self.shape(x);
        let last = self.b.slice(&s, -1, i64::MAX, 0, "grad/last_dim");
        let minus_one = self.i64s(&[-1]);
        let shape = self.b.concat(&[&minus_one, &last], 0, "grad/flat_shape");
        let out = self.op("Reshape", &[x, &shape], "grad/flat");
        self.ranks.set(&out, 2);
        out
    }

    /// `x` with its last two axes swapped.
    pub fn swap_last_two(&mut self, x: &str, rank: usize) -> String {
        let mut perm: Vec<i64> = (0..rank as i64).collect();
        perm.swap(rank - 2, rank - 1);
        let out = self.b.transpose(x, &perm, "grad/transposed");
        self.ranks.set(&out, rank);
        out
    }

    pub fn rank(&self, tensor: &str, node: &NodeProto) -> Result<usize, Error> {
        self.ranks.get(tensor).ok_or_else(|| Error::Usage(format!(
            "cannot tell the rank of '{tensor}' (input of {} node '{}') from the graph; run onnx shape inference on the model (onnx.shape_inference.infer_shapes) and retry",
            node.op_type(),
            node.name()
        )))
    }
}

/// Positions of `node`'s inputs that carry a gradient: the rule's, none for ops known to be
/// piecewise constant or integer-valued, and `None` for ops with no rule (an error if a
/// gradient ever reaches them).
fn gradient_inputs(node: &NodeProto) -> Option<Vec<usize>> {
    if rules::non_differentiable(node.op_type()) {
        return Some(vec![]);
    }
    rules::rule(node.op_type()).map(|r| (r.inputs)(node))
}

/// Trained parameters among `candidates`: those the loss depends on through differentiable
/// edges. Ordered as `candidates`.
pub fn reaching_loss(nodes: &[NodeProto], loss: &str, candidates: &[String]) -> Vec<String> {
    let live = live_tensors(nodes, candidates);
    let needed = needed_tensors(nodes, loss, &live);
    candidates
        .iter()
        .filter(|c| needed.contains(c.as_str()))
        .cloned()
        .collect()
}

/// Tensors that depend on one of `params` through differentiable edges, `params` included.
pub fn depending_on(nodes: &[NodeProto], params: &[String]) -> std::collections::HashSet<String> {
    live_tensors(nodes, params)
        .into_keys()
        .map(str::to_string)
        .collect()
}

/// Tensors that depend on a parameter, with one parameter that reaches each (for errors).
fn live_tensors<'a>(nodes: &'a [NodeProto], params: &'a [String]) -> HashMap<&'a str, &'a str> {
    let mut live: HashMap<&str, &str> = params.iter().map(|p| (p.as_str(), p.as_str())).collect();
    for node in nodes {
        let positions = gradient_inputs(node).unwrap_or_else(|| (0..node.input.len()).collect());
        let source = positions
            .iter()
            .filter_map(|&i| node.input.get(i))
            .find_map(|n| live.get(n.as_str()).copied());
        if let Some(p) = source {
            for o in node.output.iter().filter(|o| !o.is_empty()) {
                live.insert(o.as_str(), p);
            }
        }
    }
    live
}

/// Live tensors the loss depends on through differentiable edges.
fn needed_tensors<'a>(
    nodes: &'a [NodeProto],
    loss: &'a str,
    live: &HashMap<&str, &str>,
) -> HashSet<&'a str> {
    let mut needed = HashSet::from([loss]);
    for node in nodes.iter().rev() {
        if !node.output.iter().any(|o| needed.contains(o.as_str())) {
            continue;
        }
        let positions = gradient_inputs(node).unwrap_or_else(|| (0..node.input.len()).collect());
        for i in positions {
            if let Some(x) = node.input.get(i).filter(|x| live.contains_key(x.as_str())) {
                needed.insert(x.as_str());
            }
        }
    }
    needed
}

/// Emits `d loss / d p` for every parameter in `params`; returns the gradient tensor names in
/// the same order. `loss` must be a float32 scalar; `seed` (a float32 scalar, default 1) scales
/// every gradient (a loss scale).
pub fn differentiate(
    ctx: &mut Ctx,
    nodes: &[NodeProto],
    loss: &str,
    params: &[String],
    seed: Option<&str>,
) -> Result<Vec<String>, Error> {
    let seed = match seed {
        Some(s) => s.to_string(),
        None => ctx.f32(1.0),
    };
    // An embedding's gradient: its rows added into the other contributions (a tied LM head's)
    // in place, not a [V, d] ScatterND into zeros then a Sum of two [V, d] tensors: two [V, d]
    // temporaries fewer at the end of the backward, where every gradient exists.
    ctx.sparse_rows = params.iter().cloned().collect();
    let from = ctx.b.nodes.len();
    let grads = backward(ctx, nodes, loss, seed, params);
    ctx.sparse_rows.clear();
    let mut grads = grads?;
    let totals: Vec<String> = params
        .iter()
        .map(|p| match grads.remove(p) {
            Some(parts) => parts.total(ctx, p),
            None => ctx.zeros_like(p),
        })
        .collect();
    transposed_products::fold(&mut ctx.b.nodes, from, &totals, &mut ctx.gradient_of);
    Ok(totals)
}

/// The gradient of `loss` (seeded with `seed`, a float32 scalar) at one tensor `wrt`, as the
/// contributions the rules handed back — dense tensors of `wrt`'s shape and sparse
/// [`Scatter`]s — not summed: artifacts mode adds each into a gradient ONNX Runtime already
/// computed, in that gradient's layout, without building another dense tensor.
pub fn gradient_parts(
    ctx: &mut Ctx,
    nodes: &[NodeProto],
    loss: &str,
    seed: &str,
    wrt: &str,
) -> Result<Parts, Error> {
    let wrt = [wrt.to_string()];
    let mut grads = backward(ctx, nodes, loss, seed.to_string(), &wrt)?;
    Ok(grads.remove(&wrt[0]).unwrap_or_default())
}

/// The reverse walk: every node on a differentiable path from `params` to `loss`, last first,
/// gets its rule's vector-Jacobian product. Returns the gradient contributions of the tensors
/// the walk reached and did not consume — `params` among them.
fn backward(
    ctx: &mut Ctx,
    nodes: &[NodeProto],
    loss: &str,
    seed: String,
    params: &[String],
) -> Result<BTreeMap<String, Parts>, Error> {
    if ctx.loss.as_deref() != Some(loss) {
        ctx.loss = Some(loss.to_string());
        ctx.runtime_zero = None;
    }
    let live = live_tensors(nodes, params);
    let needed = needed_tensors(nodes, loss, &live);
    ctx.nan_filled = rules::nan_filled(nodes, ctx.shapes);
    let mut grads: BTreeMap<String, Parts> = BTreeMap::new();
    grads.entry(loss.to_string()).or_default().dense.push(seed);

    for node in nodes.iter().rev() {
        if !node.output.iter().any(|o| grads.contains_key(o)) {
            continue;
        }
        let wants: Vec<bool> = (0..node.input.len())
            .map(|i| needed.contains(node.input[i].as_str()) && !node.input[i].is_empty())
            .collect();
        if !wants.iter().any(|w| *w) {
            // no gradient flows on (the producer of a tensor the walk started from): the
            // gradient stays with its tensor
            continue;
        }
        let gy: Vec<Option<String>> = node
            .output
            .iter()
            .map(|o| grads.remove(o).map(|parts| parts.total(ctx, o)))
            .collect();
        for (o, g) in node.output.iter().zip(&gy) {
            if let Some(g) = g {
                ctx.gradient_of.insert(o.clone(), g.clone());
            }
        }
        let positions = gradient_inputs(node);
        let Some(rule) = rules::rule(node.op_type()).filter(|_| positions.is_some()) else {
            let param = node
                .input
                .iter()
                .find_map(|i| live.get(i.as_str()))
                .map(|p| p.to_string())
                .unwrap_or_default();
            return Err(Error::NoGradientRule {
                op: node.op_type().to_string(),
                node: node.name().to_string(),
                param,
            });
        };
        let positions = positions.unwrap_or_default();
        let wants: Vec<bool> = wants
            .iter()
            .enumerate()
            .map(|(i, w)| *w && positions.contains(&i))
            .collect();
        if !wants.iter().any(|w| *w) {
            continue;
        }
        let gx = (rule.vjp)(ctx, node, &gy, &wants)?;
        for (i, g) in gx.into_iter().enumerate() {
            if let (Some(g), true) = (g, wants.get(i).copied().unwrap_or(false)) {
                grads
                    .entry(node.input[i].clone())
                    .or_default()
                    .dense
                    .push(g);
            }
        }
        for (tensor, scatter) in std::mem::take(&mut ctx.scatters) {
            grads.entry(tensor).or_default().sparse.push(scatter);
        }
    }
    Ok(grads)
}

/// The contributions to one tensor's gradient.
#[derive(Default)]
pub struct Parts {
    /// Tensors of the tensor's shape, to be summed.
    pub dense: Vec<String>,
    /// Values to add in place (`ScatterElements` with `reduction="add"`).
    pub sparse: Vec<Scatter>,
}

impl Parts {
    /// The gradient of `tensor`: the dense parts summed, the sparse ones added in place.
    fn total(self, ctx: &mut Ctx, tensor: &str) -> String {
        let mut g = if self.dense.is_empty() {
            ctx.zeros_like(tensor)
        } else {
            sum(ctx, self.dense)
        };
        for s in self.sparse {
            g = ctx.b.node(
                "ScatterElements",
                &[&g, &s.indices, &s.updates],
                "grad/scatter_add",
                vec![
                    int_attr("axis", s.axis),
                    crate::onnx::string_attr("reduction", "add"),
                ],
            );
        }
        if let Some(r) = ctx.ranks.get(tensor) {
            ctx.ranks.set(&g, r);
        }
        g
    }
}

fn sum(ctx: &mut Ctx, mut parts: Vec<String>) -> String {
    if parts.len() == 1 {
        return parts.remove(0);
    }
    if let Some(joined) = join_slices(ctx, &mut parts) {
        if parts.is_empty() {
            return joined;
        }
        parts.push(joined);
    }
    let refs: Vec<&str> = parts.iter().map(|s| s.as_str()).collect();
    let out = ctx.op("Sum", &refs, "grad/sum");
    if let Some(r) = parts.iter().filter_map(|p| ctx.ranks.get(p)).max() {
        ctx.ranks.set(&out, r);
    }
    out
}

/// Among `parts`, the slices' gradients, where they tile an axis: concatenated in its order
/// instead of padded back and summed (`slice_parts`). They leave `parts` (the rest is still to
/// be summed with the result), and their `Pad` nodes and pads constants are dropped.
fn join_slices(ctx: &mut Ctx, parts: &mut Vec<String>) -> Option<String> {
    let (slices, rest): (Vec<String>, Vec<String>) = parts
        .iter()
        .cloned()
        .partition(|p| ctx.slice_parts.contains(p));
    if slices.len() < 2 {
        return None;
    }
    let pieces = ctx.slice_parts.tiling(&slices)?;
    let axis = pieces[0].axis as i64;
    let inputs: Vec<String> = pieces.iter().map(|p| p.of.clone()).collect();
    let pads: HashSet<String> = pieces.iter().map(|p| p.pads.clone()).collect();
    let rank = slices.iter().filter_map(|p| ctx.ranks.get(p)).max();
    ctx.b.nodes.retain(|n| !slices.contains(&n.output[0]));
    ctx.b.initializers.retain(|t| !pads.contains(t.name()));
    let refs: Vec<&str> = inputs.iter().map(String::as_str).collect();
    let out = ctx.b.concat(&refs, axis, "grad/slices_joined");
    if let Some(r) = rank {
        ctx.ranks.set(&out, r);
    }
    *parts = rest;
    Some(out)
}

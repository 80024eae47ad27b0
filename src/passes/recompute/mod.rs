//! `--recompute layers`: activation recomputation in the step graph, as torch's
//! `gradient_checkpointing_enable()` does it. The forward keeps only what each repeated block
//! (a transformer layer, [`blocks`]) reads from outside; just before the backward of a block
//! needs the block's inner activations, a copy of the block's forward computes them again.
//!
//! Runs on the finished step (or gradient) graph, once, from `step::build`. A recomputed
//! block reads its outside float inputs through a barrier (`Where(c, x, x)`, or `Expand(x,
//! [1])` for the half types onnxruntime's CPU `Where` lacks) whose condition `c` is computed from the
//! gradient arriving at the block. That dependency is the design: the copy cannot run before
//! the backward reaches the block (a runtime orders nodes by their inputs, not by their place
//! in the file), and no runtime can merge the copy back into the stored forward, because
//! common-subexpression elimination merges only nodes with the same inputs and the barrier's
//! value is not known before the step runs.

pub mod blocks;
mod estimate;
mod structure;

use std::collections::{BTreeMap, BTreeSet};

use crate::error::Error;
use crate::graph::hash::{HashMap, HashSet};
use crate::graph::patch;
use crate::graph::ranks::Ranks;
use crate::graph::reads::outer_reads;
use crate::graph::GraphIndex;
use crate::onnx::{GraphProto, NodeProto, ValueInfoProto, BOOL, DOUBLE, FLOAT, FLOAT16, INT64};
use crate::passes::contract;
const BFLOAT16: i32 = crate::onnx::proto::tensor_proto::DataType::Bfloat16 as i32;
use ntl_ops::Builder;

pub use estimate::Hints;

/// `--recompute`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    #[default]
    Off,
    Layers,
    /// `layers` where the activations the forward keeps would exceed the state's size.
    Auto,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::Layers => "layers",
            Mode::Auto => "auto",
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct RecomputeOptions {
    pub mode: Mode,
    /// The batch size and sequence length `auto` estimates the activations at, where the
    /// graph's shapes are symbolic.
    pub hints: Hints,
}

/// What the pass did, for the summary and the metadata.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Blocks whose forward the backward recomputes (0: recomputation is off).
    pub blocks: usize,
    /// The names the blocks were found by (`model.layers`).
    pub layers: Option<String>,
    /// Forward nodes computed again in the backward.
    pub recomputed_nodes: usize,
    /// Why `auto` chose what it chose.
    pub reason: Option<String>,
    pub warnings: Vec<String>,
}

impl Outcome {
    /// The metadata's and the summary's `recompute`.
    pub fn to_meta(&self, mode: Mode) -> contract::Recompute {
        contract::Recompute {
            mode: mode.name().into(),
            blocks: self.blocks,
            layers: self.layers.clone(),
            recomputed_nodes: self.recomputed_nodes,
            reason: self.reason.clone(),
        }
    }
}

/// What the pass needs to know of the step graph besides its nodes.
pub struct StepFacts<'a> {
    /// The forward's outputs (the losses): the forward is what computes them.
    pub losses: &'a [&'a str],
    /// The graph inputs that carry the batch.
    pub data_inputs: &'a [String],
    /// Forward tensor → the tensor holding its gradient, as the backward emitted them.
    pub gradient_of: &'a std::collections::HashMap<String, String>,
    /// Bytes of the parameters and optimizer state (what `auto` compares with).
    pub state_bytes: u64,
}

/// Rewrites `graph` to recompute its blocks in the backward, as `options` ask.
pub fn recompute(
    graph: &mut GraphProto,
    b: &mut Builder,
    options: &RecomputeOptions,
    facts: &StepFacts,
) -> Result<Outcome, Error> {
    if options.mode == Mode::Off {
        return Ok(Outcome::default());
    }
    let view = View::new(graph, facts);
    let index = GraphIndex::new(graph);
    let found = blocks::find(
        &view.forward_nodes(),
        &|t| view.is_weight(t),
        &|t| view.data.contains(t),
        &|t| weight_kind(&index, t),
    );
    let Some(found) = found else {
        let what = "repeated blocks to recompute: no two layer indices in the weights' or nodes' names (such as model.layers.N., h.N., layers_N), and no chain of blocks that read their weights alike (op, weight type and shape)";
        return match options.mode {
            Mode::Auto => Ok(Outcome {
                reason: Some(format!("off: found no {what}")),
                warnings: vec![format!("--recompute auto found no {what}; recomputation stays off")],
                ..Outcome::default()
            }),
            _ => Err(Error::Usage(format!(
                "--recompute layers found no {what}; drop --recompute or export the model with its module names (torch.onnx.export keeps them)"
            ))),
        };
    };
    let reason = match options.mode {
        Mode::Auto => match estimate::decide(&view, &index, &options.hints, facts.state_bytes) {
            (true, why) => Some(why),
            (false, why) => {
                return Ok(Outcome {
                    reason: Some(why),
                    ..Outcome::default()
                })
            }
        },
        _ => None,
    };
    let plan = view.plan(&found, &index);
    drop(index);
    if plan.blocks.is_empty() && options.mode == Mode::Layers {
        return Err(Error::Usage("--recompute layers found layers, but the backward reads none of their inner activations (nothing to recompute); drop --recompute".into()));
    }
    let layers = found.container.clone();
    let mut outcome = apply(graph, b, plan)?;
    outcome.reason = reason;
    outcome.layers = Some(layers);
    Ok(outcome)
}

/// A weight's element type and shape, for the structure search: float tensors of two or more
/// elements only (scalars and integer constants are shared between layers by exporters).
fn weight_kind(index: &GraphIndex, t: &str) -> Option<String> {
    let (elem, dims) = index.declared_shape(t)?;
    let elem = elem.filter(|&e| is_float(Some(e)))?;
    let size: Option<i64> = dims
        .iter()
        .try_fold(1i64, |n, d| d.map(|d| n.saturating_mul(d)));
    (size.is_none_or(|n| n >= 2) && !dims.is_empty()).then(|| format!("{elem}{dims:?}"))
}

/// The step graph as the pass sees it: which nodes are the forward, which tensors carry data.
pub(crate) struct View<'g> {
    graph: &'g GraphProto,
    /// Positions of the forward's nodes, in order.
    forward: Vec<usize>,
    is_forward: Vec<bool>,
    /// Tensors that depend on the batch (data inputs and what is computed from them).
    data: HashSet<String>,
    initializers: HashSet<&'g str>,
    produced: HashSet<&'g str>,
    gradient_of: &'g std::collections::HashMap<String, String>,
}

impl<'g> View<'g> {
    fn new(graph: &'g GraphProto, facts: &StepFacts<'g>) -> View<'g> {
        // the forward: every node the losses depend on
        let mut is_forward = vec![false; graph.node.len()];
        let mut needed: HashSet<&str> = facts.losses.iter().copied().collect();
        for (p, n) in graph.node.iter().enumerate().rev() {
            if n.output.iter().any(|o| needed.contains(o.as_str())) {
                is_forward[p] = true;
                needed.extend(n.input.iter().map(String::as_str));
            }
        }
        let forward: Vec<usize> = (0..graph.node.len()).filter(|&p| is_forward[p]).collect();
        let mut data: HashSet<String> = facts.data_inputs.iter().cloned().collect();
        for n in &graph.node {
            if n.input.iter().any(|i| data.contains(i)) {
                data.extend(n.output.iter().filter(|o| !o.is_empty()).cloned());
            }
        }
        View {
            graph,
            forward,
            is_forward,
            data,
            initializers: graph.initializer.iter().map(|t| t.name()).collect(),
            produced: graph
                .node
                .iter()
                .flat_map(|n| n.output.iter().map(String::as_str))
                .collect(),
            gradient_of: facts.gradient_of,
        }
    }

    fn forward_nodes(&self) -> Vec<&'g NodeProto> {
        self.forward.iter().map(|&p| &self.graph.node[p]).collect()
    }

    /// An input no node produces that is not data: a weight, a frozen weight, a constant.
    fn is_weight(&self, t: &str) -> bool {
        !t.is_empty() && !self.produced.contains(t) && !self.data.contains(t)
            || self.initializers.contains(t)
    }

    /// Where each forward tensor of a block is read: by forward nodes of other blocks (it is
    /// kept), and its first non-forward reader.
    fn block_readers(
        &self,
        producer: &HashMap<&'g str, usize>,
        block_at: &HashMap<usize, u32>,
    ) -> (HashSet<&'g str>, HashMap<&'g str, usize>) {
        let mut read_elsewhere: HashSet<&str> = HashSet::default();
        let mut first_backward_read: HashMap<&str, usize> = HashMap::default();
        for (p, n) in self.graph.node.iter().enumerate() {
            for i in n.input.iter().filter(|i| !i.is_empty()) {
                let Some(&q) = producer.get(i.as_str()) else {
                    continue;
                };
                let Some(&k) = block_at.get(&q) else { continue };
                if !self.is_forward[p] {
                    first_backward_read.entry(i.as_str()).or_insert(p);
                } else if block_at.get(&p) != Some(&k) {
                    read_elsewhere.insert(i.as_str());
                }
            }
        }
        (read_elsewhere, first_backward_read)
    }

    /// Every copied node must depend on a barrier, or a runtime merges it with the original
    /// (and all that follows it): a node that reads no float activation from outside and no
    /// copied output (an embedding's Gather of the ids, shape arithmetic) is left out of `copy`;
    /// its outputs are read as they are, floats through the barrier. The copied outputs, and
    /// the float activations read through the barrier.
    fn anchor_to_barrier(
        &self,
        copy: &mut Vec<usize>,
        types: &crate::graph::elem_types::ElemTypes,
    ) -> (HashSet<&'g str>, Vec<String>) {
        let graph = self.graph;
        let mut copied: HashSet<&str> = HashSet::default();
        let mut outside: Vec<String> = Vec::new();
        copy.retain(|&p| {
            let n = &graph.node[p];
            let through_barrier = |i: &String| {
                self.data.contains(i) && !copied.contains(i.as_str()) && is_float(types.get(i))
            };
            let anchored = n
                .input
                .iter()
                .any(|i| copied.contains(i.as_str()) || through_barrier(i));
            if anchored {
                for i in n.input.iter().filter(|i| through_barrier(i)) {
                    if !outside.contains(i) {
                        outside.push(i.clone());
                    }
                }
                copied.extend(
                    n.output
                        .iter()
                        .filter(|o| !o.is_empty())
                        .map(String::as_str),
                );
            }
            anchored
        });
        (copied, outside)
    }

    /// Which blocks to recompute and how.
    fn plan(&self, found: &blocks::Blocks, index: &GraphIndex) -> Plan {
        let graph = self.graph;
        let block_at: HashMap<usize, u32> = self
            .forward
            .iter()
            .zip(&found.of_node)
            .filter_map(|(&p, b)| b.map(|b| (p, b)))
            .collect();
        let mut producer: HashMap<&str, usize> = HashMap::default();
        for (p, n) in graph.node.iter().enumerate() {
            for o in n.output.iter().filter(|o| !o.is_empty()) {
                producer.insert(o.as_str(), p);
            }
        }
        let outputs: HashSet<&str> = graph.output.iter().map(|o| o.name()).collect();
        let clonable = |n: &NodeProto| clonable(n, index);
        let types = crate::graph::elem_types::ElemTypes::infer(graph);
        // outer-scope reads keep their tensors as they are
        let in_subgraphs: HashSet<&str> = graph.node.iter().flat_map(outer_reads).collect();
        let (read_elsewhere, first_backward_read) = self.block_readers(&producer, &block_at);
        let mut per_block: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for &p in &self.forward {
            if let Some(&k) = block_at.get(&p) {
                per_block.entry(k).or_default().push(p);
            }
        }
        let mut blocks = Vec::new();
        for (k, members) in per_block {
            // inner activations: computed again rather than kept
            let inner: BTreeSet<&str> = members
                .iter()
                .filter(|&&p| clonable(&graph.node[p]))
                .flat_map(|&p| graph.node[p].output.iter().map(String::as_str))
                .filter(|o| {
                    !o.is_empty()
                        && self.data.contains(*o)
                        && !read_elsewhere.contains(o)
                        && !outputs.contains(o)
                        && !in_subgraphs.contains(o)
                        && first_backward_read.contains_key(o)
                })
                .collect();
            if inner.is_empty() {
                continue;
            }
            // the copy: the members the inner activations need, through other inner ones
            let member_set: HashSet<usize> = members.iter().copied().collect();
            let mut needed: HashSet<&str> = inner.iter().copied().collect();
            let mut copy: Vec<usize> = Vec::new();
            for &p in members.iter().rev() {
                let n = &graph.node[p];
                if !clonable(n) || !n.output.iter().any(|o| needed.contains(o.as_str())) {
                    continue;
                }
                copy.push(p);
                for i in &n.input {
                    if self.data.contains(i)
                        && producer
                            .get(i.as_str())
                            .is_some_and(|q| member_set.contains(q))
                        && !read_elsewhere.contains(i.as_str())
                    {
                        needed.insert(i.as_str());
                    }
                }
            }
            copy.reverse();
            let (copied, outside) = self.anchor_to_barrier(&mut copy, &types);
            if copy.is_empty() {
                continue;
            }
            let redirected: BTreeSet<String> = copied
                .iter()
                .filter(|o| first_backward_read.contains_key(*o) && inner.contains(*o))
                .map(|o| o.to_string())
                .collect();
            let first_read = redirected
                .iter()
                .filter_map(|o| first_backward_read.get(o.as_str()).copied())
                .min();
            let Some(first_read) = first_read else {
                continue;
            };
            // the gradient arriving at the block: of the block's outputs read elsewhere
            let gradient = members
                .iter()
                .flat_map(|&p| graph.node[p].output.iter())
                .filter(|o| read_elsewhere.contains(o.as_str()) && self.data.contains(*o))
                .filter_map(|o| self.gradient_of.get(o))
                .filter_map(|g| producer.get(g.as_str()).map(|&q| (q, g)))
                .min();
            let Some((at, gradient)) = gradient else {
                continue;
            };
            blocks.push(BlockPlan {
                index: k,
                copy,
                outside,
                redirected,
                gradient: gradient.clone(),
                // backward nodes that need no gradient (a Shape) may come before the gradient
                // exists: they move after the copy (`topological_sort`)
                insert_at: first_read.max(at + 1),
            });
        }
        Plan {
            blocks,
            is_forward: self.is_forward.clone(),
            types,
        }
    }
}

/// Nodes that can be computed a second time with the same result: not random (their bits
/// would differ; a Dropout is not random outside training mode or with ratio 0, as exporters
/// write it for models without dropout), and without subgraphs (their inner names would be
/// defined twice).
fn clonable(n: &NodeProto, index: &GraphIndex) -> bool {
    if n.op_type() == "Dropout" {
        return index.dropout_passes_through(n);
    }
    const RANDOM: &[&str] = &[
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
    ];
    !RANDOM.contains(&n.op_type())
        && n.attribute
            .iter()
            .all(|a| a.g.is_none() && a.graphs.is_empty())
}

/// Activations read through the barrier: floats. Integers (shape vectors, positions) and
/// masks are read as they are: a runtime must still see a shape's value.
fn is_float(t: Option<i32>) -> bool {
    matches!(t, Some(FLOAT | DOUBLE | FLOAT16 | BFLOAT16))
}

pub(crate) struct Plan {
    blocks: Vec<BlockPlan>,
    is_forward: Vec<bool>,
    /// Element types of the graph's tensors (the barrier's op depends on them).
    types: crate::graph::elem_types::ElemTypes,
}

struct BlockPlan {
    index: u32,
    /// Positions of the forward nodes to compute again, in order.
    copy: Vec<usize>,
    /// Data the copy reads from outside the block.
    outside: Vec<String>,
    /// Copied tensors the backward reads: it reads the copies instead.
    redirected: BTreeSet<String>,
    /// A gradient the backward computes before it needs the block: the barrier's condition.
    gradient: String,
    /// Where the copy goes: before the first backward node that reads the block, unless that
    /// node comes before the gradient.
    insert_at: usize,
}

fn apply(graph: &mut GraphProto, b: &mut Builder, plan: Plan) -> Result<Outcome, Error> {
    let types = &plan.types;
    let ranks = Ranks::infer(&GraphIndex::new(graph));
    let declared: HashMap<String, ValueInfoProto> = graph
        .value_info
        .iter()
        .map(|v| (v.name().to_string(), v.clone()))
        .collect();
    let mut inserts: BTreeMap<usize, Vec<NodeProto>> = BTreeMap::new();
    let mut renamed: HashMap<String, String> = HashMap::default();
    let mut new_values = Vec::new();
    let mut outcome = Outcome::default();
    for block in &plan.blocks {
        let emitted_before = b.nodes.len();
        let hint = format!("recompute/{}", block.index);
        // the barrier's condition: read from the gradient arriving at the block
        let minus_one = b.const_i64(&format!("{hint}/c"), &[1], &[-1]);
        let flat = b.node(
            "Reshape",
            &[&block.gradient, &minus_one],
            &format!("{hint}/grad_flat"),
            vec![],
        );
        let first = b.const_i64(&format!("{hint}/c"), &[1], &[0]);
        let one_value = b.node(
            "Gather",
            &[&flat, &first],
            &format!("{hint}/grad_first"),
            vec![],
        );
        let cond_1d = b.cast(&one_value, BOOL, &format!("{hint}/cond_1d"));
        let cond = b.node("Squeeze", &[&cond_1d], &format!("{hint}/cond"), vec![]);
        let mut ones: Option<String> = None;
        let mut through: HashMap<&str, String> = HashMap::default();
        for x in &block.outside {
            let barrier = match types.get(x) {
                Some(FLOAT | DOUBLE) => b.where_(&cond, x, x, &format!("{hint}/in")),
                Some(FLOAT16 | BFLOAT16) if ranks.get(x).is_some_and(|r| r >= 1) => {
                    let ones = ones.get_or_insert_with(|| {
                        let as_int = b.cast(&cond_1d, INT64, &format!("{hint}/cond_int"));
                        let one = b.const_i64(&format!("{hint}/c"), &[1], &[1]);
                        b.node("Max", &[&as_int, &one], &format!("{hint}/ones"), vec![])
                    });
                    let ones = ones.clone();
                    b.node("Expand", &[x, &ones], &format!("{hint}/in"), vec![])
                }
                _ => {
                    return Err(Error::Usage(format!(
                        "--recompute cannot read '{x}' (layer {}) through a barrier: its rank is unknown; run onnx shape inference on the model and retry",
                        block.index
                    )))
                }
            };
            through.insert(x.as_str(), barrier);
        }
        let mut local: HashMap<String, String> = HashMap::default();
        for &p in &block.copy {
            let mut n = graph.node[p].clone();
            for i in n.input.iter_mut() {
                if let Some(x) = through.get(i.as_str()).or_else(|| local.get(i.as_str())) {
                    *i = x.clone();
                }
            }
            for o in n.output.iter_mut().filter(|o| !o.is_empty()) {
                let copy = b.fresh(&format!("{hint}/{o}"));
                if let Some(v) = declared.get(o.as_str()) {
                    let mut v = v.clone();
                    v.name = Some(copy.clone());
                    new_values.push(v);
                }
                local.insert(o.clone(), copy.clone());
                *o = copy;
            }
            n.name = Some(b.fresh(&format!("{hint}/{}", n.name())));
            b.nodes.push(n);
        }
        for o in &block.redirected {
            renamed.insert(o.clone(), local[o].clone());
        }
        outcome.blocks += 1;
        outcome.recomputed_nodes += block.copy.len();
        let emitted: Vec<NodeProto> = b.nodes.drain(emitted_before..).collect();
        inserts.entry(block.insert_at).or_default().extend(emitted);
    }
    // the backward reads the copies; the forward keeps reading what it computed
    let mut replace = BTreeMap::new();
    for (p, n) in graph.node.iter().enumerate() {
        if plan.is_forward[p] || !n.input.iter().any(|i| renamed.contains_key(i.as_str())) {
            continue;
        }
        let mut n = n.clone();
        for i in n.input.iter_mut() {
            if let Some(r) = renamed.get(i.as_str()) {
                *i = r.clone();
            }
        }
        replace.insert(p, vec![n]);
    }
    let edits = patch::Splice {
        replace,
        before: inserts,
        ..Default::default()
    };
    patch::splice(graph, edits);
    graph.value_info.extend(new_values);
    graph.initializer.append(&mut b.initializers);
    patch::topological_sort(graph);
    Ok(outcome)
}

//! `--attention`: attention that never stores the `[.., T, T]` scores. The exported attention
//! (`find`) becomes one internal node ([`node::FORWARD`]) before the graph is differentiated;
//! its gradient is one internal node too, and [`lower::lower`] expands both into `Scan`s over
//! blocks of query rows: nothing of the forward is kept for the backward but its inputs, and the
//! backward recomputes each block's probabilities, as flash attention's backward does, in
//! standard ONNX ops.

mod centred;
mod find;
mod fused;
mod key_range;
pub mod lower;
pub mod node;
mod operands;

use std::collections::HashSet;

use ntl_ops::Builder;

use crate::error::Error;
use crate::graph::patch::{apply, Patch};
use crate::graph::GraphIndex;
use crate::onnx::{default_opset, ModelProto, FLOAT};
use crate::passes::contract;
use crate::passes::fused_head::node::{tensor_info, Dim};

/// `--attention`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Blockwise where the attention is recognised; others stay as exported (listed).
    #[default]
    Auto,
    /// Blockwise everywhere: an attention-like softmax that cannot be is an error.
    Chunked,
    /// As `Auto`, the forward written as the ONNX `Attention` operator (opset 23) where the
    /// attention has its form (others keep the blockwise forward, listed); the backward blockwise.
    Onnx,
    /// As exported.
    Eager,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Auto => "auto",
            Mode::Chunked => "chunked",
            Mode::Onnx => "onnx",
            Mode::Eager => "eager",
        }
    }
}

/// Query rows per block by default: the scores of one block of one head at 4096 keys are
/// 16 MiB in float32, few enough launches per layer on a GPU.
pub const DEFAULT_BLOCK: i64 = 1024;

#[derive(Debug, Clone, Default)]
pub struct AttentionOptions {
    pub mode: Mode,
    /// Query rows per block (None: [`DEFAULT_BLOCK`]).
    pub block: Option<i64>,
}

impl AttentionOptions {
    pub fn check(&self) -> Result<(), Error> {
        match self.block {
            Some(b) if !(1..=1 << 20).contains(&b) => Err(Error::Usage(
                "--attention-block must be between 1 and 1048576 query rows (e.g. 1024)".into(),
            )),
            _ => Ok(()),
        }
    }

    fn block(&self) -> i64 {
        self.block.unwrap_or(DEFAULT_BLOCK)
    }
}

/// What the pass did (the metadata's and the summary's `attention`).
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub replaced: usize,
    /// Attention-like softmaxes left as exported: (node, why).
    pub left: Vec<(String, String)>,
    /// Why `auto` left every attention as exported without looking (a step option).
    pub reason: Option<String>,
    /// `--attention onnx`: how many forwards are the `Attention` operator.
    pub fused: usize,
    /// `--attention onnx`: replaced attentions whose forward stays blockwise: (node, why).
    pub blockwise: Vec<(String, String)>,
}

impl Outcome {
    /// Nothing replaced, for `reason`.
    pub fn kept(reason: &str) -> Outcome {
        Outcome {
            reason: Some(reason.to_string()),
            ..Outcome::default()
        }
    }

    /// The metadata's and the summary's `attention`.
    pub fn to_meta(&self, opts: &AttentionOptions) -> contract::Attention {
        let left = self
            .left
            .iter()
            .map(|(node, why)| contract::LeftAttention {
                node: node.clone(),
                why: why.clone(),
            })
            .collect();
        let onnx = opts.mode == Mode::Onnx;
        contract::Attention {
            mode: opts.mode.name().into(),
            block: opts.block(),
            replaced: self.replaced,
            left,
            reason: self.reason.clone(),
            fused: onnx.then_some(self.fused),
            blockwise_forward: self
                .blockwise
                .iter()
                .map(|(node, why)| contract::LeftAttention {
                    node: node.clone(),
                    why: why.clone(),
                })
                .collect(),
        }
    }
}

/// Replaces each recognised attention of the forward graph by one [`node::FORWARD`] node.
/// `b` names what is added (it is the step graph's builder, so later names never collide);
/// `weight_derived`: the tensors that depend on weights through differentiable edges (a
/// scale or mask among them keeps its attention as exported).
pub fn replace(
    model: &mut ModelProto,
    opts: &AttentionOptions,
    b: &mut Builder,
    weight_derived: &HashSet<String>,
) -> Result<Outcome, Error> {
    if opts.mode == Mode::Eager {
        return Ok(Outcome::default());
    }
    let opset = default_opset(model).unwrap_or(ntl_ops::builder::MIN_OPSET);
    if opts.mode == Mode::Onnx && opset < fused::MIN_OPSET {
        return Err(Error::Usage(format!(
            "--attention onnx writes the ONNX Attention operator (opset {m}), but the model's default opset is {opset}: re-export it with opset_version={m} or newer, or use --attention chunked (the same blockwise attention in standard ops of any opset)",
            m = fused::MIN_OPSET
        )));
    }
    let graph = model.graph.as_ref().expect("loaded models have a graph");
    let index = GraphIndex::new(graph);
    let types = crate::graph::elem_types::ElemTypes::infer(graph);
    let shapes = crate::graph::shapes::Shapes::infer(&index);
    let finder = find::Finder {
        index: &index,
        ranks: index.inferred_ranks(),
        types: &types,
        opset,
        weight_derived,
    };
    let (sites, left) = finder.find();
    if opts.mode == Mode::Chunked {
        if let Some(l) = left.first() {
            return Err(Error::Usage(format!(
                "--attention chunked: the attention at Softmax node '{}' cannot be computed blockwise: {}; use --attention auto to leave it as exported",
                l.softmax, l.why
            )));
        }
    }
    let mut patch = Patch::default();
    let mut infos = Vec::new();
    let mut blockwise = Vec::new();
    let exact_types = (opts.mode == Mode::Onnx).then(|| fused::types(model));
    for site in &sites {
        let mut attn = site.attn.clone();
        attn.block = opts.block();
        if let Some(exact) = &exact_types {
            match fused::check(&attn, &index, &shapes, exact) {
                Ok(same_batch) => (attn.fused, attn.same_batch) = (true, same_batch),
                Err(why) => blockwise.push((softmax_of(graph, site), why)),
            }
        }
        let out = graph.node[site.value_product].output[0].clone();
        let name = b.fresh(node::FORWARD);
        // the product's proven shape, declared while the step is built: the backward then knows
        // what was broadcast (`lower` takes the declaration away again)
        if index.declared_shape(&out).is_none() {
            attn.declared_here = true;
            let elem = types.get(&out).unwrap_or(FLOAT);
            infos.push(tensor_info(
                &out,
                elem,
                &proven_dims(&shapes, &out, attn.rank),
            ));
        }
        for &at in &site.nodes {
            let nodes = if at == site.value_product {
                vec![attn.forward_node(&name, &out)]
            } else {
                Vec::new()
            };
            patch.replacements.push((at, nodes));
        }
    }
    let outcome = Outcome {
        replaced: sites.len(),
        left: left.into_iter().map(|l| (l.softmax, l.why)).collect(),
        reason: None,
        fused: sites.len() - blockwise.len(),
        blockwise,
    };
    drop(index);
    if outcome.replaced > 0 {
        model
            .graph
            .as_mut()
            .expect("graph")
            .value_info
            .extend(infos);
        apply(model, patch)?;
    }
    Ok(outcome)
}

/// The name of a site's Softmax node.
fn softmax_of(graph: &crate::onnx::GraphProto, site: &find::Site) -> String {
    site.nodes
        .iter()
        .map(|&at| &graph.node[at])
        .find(|n| n.op_type() == "Softmax")
        .map_or_else(String::new, |n| n.name().to_string())
}

/// `t`'s dims as the graph proves them (symbols kept), unknown where it does not.
fn proven_dims(shapes: &crate::graph::shapes::Shapes, t: &str, rank: usize) -> Vec<Dim> {
    use crate::graph::shapes::Dim as Proven;
    match shapes.get(t) {
        Some(dims) if dims.len() == rank => dims
            .iter()
            .map(|d| match d {
                Proven::Known(n) => Dim::from(*n),
                Proven::Sym(s) => Dim::from(s.as_str()),
                Proven::Unknown => Dim::from(None),
            })
            .collect(),
        _ => vec![Dim::from(None); rank],
    }
}

//! Turning off the random Gumbel noise of a graph patched with `--loss ntil --gumbel-noise
//! c > 0`, in the validation copy only, so its forward is the deterministic argmax path the
//! independent reference computes (noise scale 0).
//!
//! The patch draws the noise with `RandomUniformLike`, turns it into `c·g` and adds it to the
//! clean digit logits: `noisy = z + c·g`. Here every random node ntl-patch wrote (its outputs
//! under `ntl/`) taints what it reaches; each `Add` of one tainted and one clean input is
//! where the noise enters, and becomes `Identity(clean)` — the value `z + 0·g` has for any
//! finite g. The noise path, then unused, is removed, so a runtime need not run it (and no
//! `inf·0` can appear as it could with a zeroed scale). Names are not relied on beyond the
//! `ntl/` prefix.

use std::collections::HashSet;

use crate::error::Error;
use crate::graph::patch::{splice, Splice};
use crate::onnx::{GraphProto, NodeProto};
use ntl_ops::names::PREFIX;

/// ONNX's random generators.
const RANDOM_OPS: [&str; 6] = [
    "RandomUniformLike",
    "RandomUniform",
    "RandomNormalLike",
    "RandomNormal",
    "Multinomial",
    "Bernoulli",
];

/// What was removed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Removed {
    /// The random nodes (by name).
    pub random_nodes: Vec<String>,
    /// The tensors that now carry the clean logits instead of the noisy ones.
    pub noisy_tensors: Vec<String>,
}

impl Removed {
    pub fn is_empty(&self) -> bool {
        self.random_nodes.is_empty()
    }
}

/// Rewrites `graph` in place (a copy's graph; nodes in topological order).
pub fn remove_patch_noise(graph: &mut GraphProto) -> Result<Removed, Error> {
    let ours = format!("{PREFIX}/");
    let is_ours =
        |n: &NodeProto| !n.output.is_empty() && n.output.iter().all(|o| o.starts_with(&ours));
    let mut tainted: HashSet<String> = HashSet::new();
    let mut removed = Removed::default();
    for node in &graph.node {
        if RANDOM_OPS.contains(&node.op_type()) && is_ours(node) {
            tainted.extend(node.output.iter().cloned());
            removed.random_nodes.push(node.name().to_string());
        }
    }
    if removed.is_empty() {
        return Ok(removed);
    }

    let mut noise_path = vec![false; graph.node.len()];
    for (i, node) in graph.node.iter_mut().enumerate() {
        if RANDOM_OPS.contains(&node.op_type())
            && node.output.first().is_some_and(|o| tainted.contains(o))
        {
            noise_path[i] = true;
            continue;
        }
        let hit: Vec<bool> = node.input.iter().map(|x| tainted.contains(x)).collect();
        if !hit.contains(&true) {
            continue;
        }
        let clean: Vec<&String> = node
            .input
            .iter()
            .zip(&hit)
            .filter(|(x, h)| !**h && !x.is_empty())
            .map(|(x, _)| x)
            .collect();
        if node.op_type() == "Add"
            && node.input.len() == 2
            && clean.len() == 1
            && node.output.first().is_some_and(|o| !o.is_empty())
        {
            // noisy = clean + c·g  ->  noisy = clean
            let clean = clean[0].clone();
            removed.noisy_tensors.push(node.output[0].clone());
            node.op_type = Some("Identity".into());
            node.input = vec![clean];
            node.attribute.clear();
        } else {
            noise_path[i] = true;
            tainted.extend(node.output.iter().cloned());
        }
    }
    if let Some(out) = graph.output.iter().find(|o| tainted.contains(o.name())) {
        return Err(Error::Validation(format!(
            "the graph output '{}' depends on random noise that validate cannot separate from the loss; validate a graph patched with --gumbel-noise 0",
            out.name()
        )));
    }
    if removed.noisy_tensors.is_empty() {
        return Err(Error::Validation(
            "the graph draws random numbers but validate finds no place where noise is added to the logits; validate a graph patched with --gumbel-noise 0".into(),
        ));
    }
    let noisy = noise_path.iter().enumerate().filter(|(_, &noise)| noise);
    splice(graph, Splice::replace(noisy.map(|(i, _)| (i, Vec::new()))));
    Ok(removed)
}

//! The repeated blocks of a forward graph (a transformer's layers), from the layer index in
//! the names the exporter kept: the weights' (`model.layers.3.mlp.up_proj.weight`,
//! `transformer.h.3.attn.c_attn.weight`, tf2onnx's `h_._3`, flax's `layers_3`), else the node's
//! own scope (TorchScript's `/model/layers.3/mlp/up_proj/MatMul`, where constant folding
//! renamed the weight).
//!
//! A node that reads a weight of layer k anchors block k. Every other forward node lies after
//! the anchors of some layers and before those of others: `after` (the highest anchor among
//! its ancestors) and `before` (the lowest among its descendants). Where the two agree the
//! node is inside that block; between two blocks (a residual `Add`, the next layer's norm
//! statistics, the embedding, the masks) the nodes are split at the one tensor through which
//! the fewest activations cross (the residual stream), so each block keeps one input.

use std::collections::{BTreeMap, BTreeSet};

use crate::graph::hash::{HashMap, HashSet};
use crate::onnx::NodeProto;
use ntl_ops::names::PREFIX;

/// Between-block regions larger than this are not searched for a cut (it is quadratic): their
/// nodes all join the later block.
const MAX_CUT_REGION: usize = 64;

/// Words that name a list of layers in `<word>_<index>` tokens (flax `layers_3`, Keras
/// `block_3`); a bare number token (`layers.3`) needs no word.
const LIST_WORDS: &[&str] = &["layer", "layers", "block", "blocks", "h"];

/// The block each forward node belongs to (None: before the first block's input, after the
/// last block, or in no block).
pub struct Blocks {
    /// The names' common prefix, e.g. `model.layers`.
    pub container: String,
    pub of_node: Vec<Option<u32>>,
}

/// `(container, index)` of the first layer index in `name`: `model.layers.3.mlp` → (`model.layers`, 3).
pub fn layer_index(name: &str) -> Option<(String, u32)> {
    let tokens: Vec<&str> = name
        .split(['.', '/', ':'])
        .filter(|t| !t.is_empty())
        .collect();
    for (i, t) in tokens.iter().enumerate() {
        let digits = t.strip_prefix('_').unwrap_or(t);
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) && i > 0 {
            return Some((tokens[..i].join("."), digits.parse().ok()?));
        }
        if let Some((word, digits)) = t.rsplit_once('_') {
            let listed = LIST_WORDS
                .iter()
                .any(|w| word == *w || word.strip_suffix(w).is_some_and(|r| r.ends_with('_')));
            if listed && !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
                let mut container = tokens[..i].to_vec();
                container.push(word);
                return Some((container.join("."), digits.parse().ok()?));
            }
        }
    }
    None
}

/// What a forward node reads and is called, for anchoring: the weights (inputs that no node
/// produces and that are not data) and the node's name.
struct Anchors<'a> {
    weights: Vec<&'a str>,
    name: &'a str,
}

/// Finds the blocks of `forward` (nodes in topological order; `is_weight` says which inputs
/// are weights, `is_data` which tensors depend on the batch). None where fewer than two layer
/// indices appear.
pub fn find(
    forward: &[&NodeProto],
    is_weight: &dyn Fn(&str) -> bool,
    is_data: &dyn Fn(&str) -> bool,
) -> Option<Blocks> {
    let anchors: Vec<Anchors> = forward
        .iter()
        .map(|n| Anchors {
            weights: n
                .input
                .iter()
                .map(String::as_str)
                .filter(|i| is_weight(i) && !i.starts_with(&format!("{PREFIX}/")))
                .collect(),
            name: n.name(),
        })
        .collect();
    let container = choose_container(&anchors)?;
    let index_in = |name: &str| -> Option<u32> {
        layer_index(name)
            .filter(|(c, _)| *c == container)
            .map(|(_, i)| i)
    };
    // the layer each node anchors: from its weights (all agreeing) and what was computed
    // from them alone (the Transpose or Cast of a layer's weight), else from its name
    let mut weight_layer: HashMap<&str, u32> = HashMap::default();
    let mut anchor: Vec<Option<u32>> = Vec::with_capacity(forward.len());
    for (n, a) in forward.iter().zip(&anchors) {
        let mut from_weights: BTreeSet<u32> =
            a.weights.iter().filter_map(|w| index_in(w)).collect();
        from_weights.extend(n.input.iter().filter_map(|i| weight_layer.get(i.as_str())));
        let reads_data = n.input.iter().any(|i| is_data(i));
        let own = match from_weights.len() {
            1 => from_weights.first().copied(),
            // a name counts on a node that computes on the batch (not on a constant, which
            // exporters share between layers)
            0 if reads_data && !a.name.starts_with(&format!("{PREFIX}/")) => index_in(a.name),
            _ => None,
        };
        if let (Some(k), false) = (own.filter(|_| from_weights.len() == 1), reads_data) {
            for o in n.output.iter().filter(|o| !o.is_empty()) {
                weight_layer.insert(o.as_str(), k);
            }
        }
        anchor.push(own);
    }
    let count = anchor.iter().flatten().collect::<BTreeSet<_>>().len();
    if count < 2 {
        return None;
    }
    let mut producer: HashMap<&str, usize> = HashMap::default();
    for (p, n) in forward.iter().enumerate() {
        for o in n.output.iter().filter(|o| !o.is_empty()) {
            producer.insert(o.as_str(), p);
        }
    }
    let preds = |p: usize| -> Vec<usize> {
        forward[p]
            .input
            .iter()
            .filter_map(|i| producer.get(i.as_str()).copied())
            .collect()
    };
    let none_after = -1i64;
    let mut after = vec![none_after; forward.len()];
    for p in 0..forward.len() {
        let own = anchor[p].map_or(none_after, i64::from);
        after[p] = preds(p).into_iter().map(|q| after[q]).fold(own, i64::max);
    }
    let mut before = vec![i64::MAX; forward.len()];
    for p in (0..forward.len()).rev() {
        if let Some(a) = anchor[p] {
            before[p] = before[p].min(i64::from(a));
        }
        for q in preds(p) {
            before[q] = before[q].min(before[p]);
        }
    }
    let mut of_node: Vec<Option<u32>> = vec![None; forward.len()];
    let mut regions: BTreeMap<i64, Vec<usize>> = BTreeMap::new();
    for p in 0..forward.len() {
        if after[p] == before[p] && after[p] >= 0 {
            of_node[p] = Some(after[p] as u32);
        } else if after[p] < before[p] && before[p] != i64::MAX {
            regions.entry(before[p]).or_default().push(p);
        }
    }
    let mut members: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (p, b) in of_node.iter().enumerate() {
        if let Some(b) = b {
            members.entry(*b).or_default().push(p);
        }
    }
    for (&d, region) in &regions {
        let block = members
            .get(&(d as u32))
            .map(Vec::as_slice)
            .unwrap_or_default();
        let cut = best_cut(forward, &producer, block, region, is_data);
        for &p in region {
            of_node[p] = if cut.contains(&p) {
                (after[p] >= 0).then_some(after[p] as u32)
            } else {
                Some(d as u32)
            };
        }
    }
    Some(Blocks { container, of_node })
}

/// The container whose names carry the most distinct layer indices (ties: the first by name):
/// among the weights' names, else among the nodes' (names a user chose before an exporter's).
fn choose_container(anchors: &[Anchors]) -> Option<String> {
    let best = |names: &mut dyn Iterator<Item = &str>| -> Option<String> {
        let mut indices: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
        for (c, i) in names.filter_map(layer_index) {
            indices.entry(c).or_default().insert(i);
        }
        let best = indices
            .iter()
            .max_by(|a, b| a.1.len().cmp(&b.1.len()).then(b.0.cmp(a.0)))?;
        (best.1.len() >= 2).then(|| best.0.clone())
    };
    let own = format!("{PREFIX}/");
    best(&mut anchors.iter().flat_map(|a| a.weights.iter().copied())).or_else(|| {
        best(
            &mut anchors
                .iter()
                .map(|a| a.name)
                .filter(|n| !n.starts_with(&own)),
        )
    })
}

/// The nodes of a between-block region (before block `d`) that stay with the blocks before:
/// the ancestors (within the region) of the one region node whose output, taken as block
/// `d`'s input, leaves the fewest activations crossing into block `d`; none where keeping the
/// whole region in block `d` is as good.
fn best_cut(
    forward: &[&NodeProto],
    producer: &HashMap<&str, usize>,
    block: &[usize],
    region: &[usize],
    is_data: &dyn Fn(&str) -> bool,
) -> HashSet<usize> {
    let crossing = |kept_before: &HashSet<usize>| -> usize {
        let later: HashSet<usize> = block
            .iter()
            .chain(region.iter().filter(|p| !kept_before.contains(p)))
            .copied()
            .collect();
        let inside = |p: usize| later.contains(&p);
        let mut crossing: HashSet<&str> = HashSet::default();
        for &p in &later {
            for i in forward[p].input.iter().filter(|i| is_data(i)) {
                if producer.get(i.as_str()).is_some_and(|&q| !inside(q)) {
                    crossing.insert(i.as_str());
                }
            }
        }
        crossing.len()
    };
    let mut best = HashSet::default();
    if region.len() > MAX_CUT_REGION {
        return best;
    }
    let mut best_score = crossing(&best);
    for &p in region {
        // p and its ancestors within the region
        let mut side: HashSet<usize> = HashSet::from_iter([p]);
        for &q in region.iter().rev().filter(|&&q| q <= p) {
            if side.contains(&q) {
                for i in &forward[q].input {
                    if let Some(&r) = producer.get(i.as_str()) {
                        if region.contains(&r) {
                            side.insert(r);
                        }
                    }
                }
            }
        }
        let score = crossing(&side);
        if score < best_score {
            best_score = score;
            best = side;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::layer_index;

    #[test]
    fn layer_indices_of_exporters_names() {
        let cases = [
            (
                "model.layers.3.mlp.up_proj.weight",
                Some(("model.layers", 3)),
            ),
            (
                "/model/layers.12/self_attn/q_proj/MatMul",
                Some(("model.layers", 12)),
            ),
            (
                "transformer.h.0.attn.c_attn.weight",
                Some(("transformer.h", 0)),
            ),
            (
                "tf_gpt2/transformer/h_._7/attn/c_attn",
                Some(("tf_gpt2.transformer.h_", 7)),
            ),
            ("params/layers_2/dense/kernel", Some(("params.layers", 2))),
            ("fc1.weight", None),
            ("dense_1/kernel", None),
            ("node_MatMul_12", None),
            ("node_Tanh_310", None),
            (
                "encoder/transformer_block_2/dense",
                Some(("encoder.transformer_block", 2)),
            ),
            ("12.weight", None),
        ];
        for (name, want) in cases {
            let got = layer_index(name);
            assert_eq!(got.as_ref().map(|(c, i)| (c.as_str(), *i)), want, "{name}");
        }
    }
}

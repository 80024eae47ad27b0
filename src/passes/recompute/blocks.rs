//! The repeated blocks of a forward graph (a transformer's layers), from the layer index in
//! the names the exporter kept: the weights' (`model.layers.3.mlp.up_proj.weight`,
//! `transformer.h.3.attn.c_attn.weight`, tf2onnx's `h_._3`, flax's `layers_3`), else the node's
//! own scope (TorchScript's `/model/layers.3/mlp/up_proj/MatMul`, where constant folding
//! renamed the weight); where no name has one, from the graph's repeated structure
//! ([`structure`]).
//!
//! A node that reads a weight of layer k anchors block k. Every other forward node lies after
//! the anchors of some layers and before those of others: `after` (the highest anchor among
//! its ancestors) and `before` (the lowest among its descendants). Where the two agree the
//! node is inside that block; between two blocks (a residual `Add`, the next layer's norm
//! statistics, the embedding, the masks) the nodes are split at the one tensor through which
//! the fewest activations cross (the residual stream), so each block keeps one input.

use std::collections::{BTreeMap, BTreeSet};

use super::structure;
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

/// What a forward node reads and is called, for anchoring: the weights (float inputs of two
/// or more elements that no node produces and that are not data; not the scalars and shape
/// vectors exporters share and number apart) and the node's name.
struct Anchors<'a> {
    weights: Vec<&'a str>,
    name: &'a str,
}

/// Where the layer indices come from.
enum Source<'a> {
    /// The names of the weights or nodes under this container (`model.layers`).
    Names(String),
    /// The repeated structure of the weight reads ([`structure`]).
    Structure(structure::Layers<'a>),
}

impl Source<'_> {
    fn weight_layer(&self, weight: &str) -> Option<u32> {
        match self {
            Source::Names(container) => layer_index(weight)
                .filter(|(c, _)| c == container)
                .map(|(_, i)| i),
            Source::Structure(layers) => layers.of_weight.get(weight).copied(),
        }
    }

    fn name_layer(&self, name: &str) -> Option<u32> {
        match self {
            Source::Names(_) => self.weight_layer(name),
            Source::Structure(_) => None,
        }
    }

    fn label(&self) -> String {
        match self {
            Source::Names(container) => container.clone(),
            Source::Structure(layers) => format!(
                "(graph structure: {} weight reads repeated per layer)",
                layers.period
            ),
        }
    }
}

/// Finds the blocks of `forward` (nodes in topological order; `is_weight` says which inputs
/// are weights, `is_data` which tensors depend on the batch, `weight_kind` a weight's element
/// type and shape): from the layer indices in names, else from the graph's repeated structure.
/// None where neither gives two layers.
pub fn find(
    forward: &[&NodeProto],
    is_weight: &dyn Fn(&str) -> bool,
    is_data: &dyn Fn(&str) -> bool,
    weight_kind: &dyn Fn(&str) -> Option<String>,
) -> Option<Blocks> {
    let anchors: Vec<Anchors> = forward
        .iter()
        .map(|n| Anchors {
            weights: n
                .input
                .iter()
                .map(String::as_str)
                .filter(|i| {
                    is_weight(i)
                        && !i.starts_with(&format!("{PREFIX}/"))
                        && weight_kind(i).is_some()
                })
                .collect(),
            name: n.name(),
        })
        .collect();
    if let Some(container) = choose_container(&anchors) {
        let found = blocks_of(forward, &anchors, Source::Names(container), is_data);
        if found.is_some() {
            return found;
        }
    }
    let weights: Vec<&[&str]> = anchors.iter().map(|a| a.weights.as_slice()).collect();
    let layers = structure::layers(forward, &weights, is_data, weight_kind)?;
    blocks_of(forward, &anchors, Source::Structure(layers), is_data)
}

/// The layer each node anchors: from its weights (all agreeing) and what was computed from
/// them alone (the Transpose or Cast of a layer's weight), else from its name; and the tensors
/// computed from weights alone, of any layer or none (a tied head's Transpose).
fn anchor_layers<'f>(
    forward: &[&'f NodeProto],
    anchors: &[Anchors],
    source: &Source,
    is_data: &dyn Fn(&str) -> bool,
) -> (Vec<Option<u32>>, HashSet<&'f str>) {
    let mut weight_layer: HashMap<&str, u32> = HashMap::default();
    let mut weight_made: HashSet<&str> = HashSet::default();
    let mut anchor: Vec<Option<u32>> = Vec::with_capacity(forward.len());
    for (n, a) in forward.iter().zip(anchors) {
        let mut from_weights: BTreeSet<u32> = a
            .weights
            .iter()
            .filter_map(|w| source.weight_layer(w))
            .collect();
        from_weights.extend(n.input.iter().filter_map(|i| weight_layer.get(i.as_str())));
        let reads_data = n.input.iter().any(|i| is_data(i));
        let own = match from_weights.len() {
            1 => from_weights.first().copied(),
            // a name counts on a node that computes on the batch (not on a constant, which
            // exporters share between layers)
            0 if reads_data && !a.name.starts_with(&format!("{PREFIX}/")) => {
                source.name_layer(a.name)
            }
            _ => None,
        };
        if let (Some(k), false) = (own.filter(|_| from_weights.len() == 1), reads_data) {
            for o in n.output.iter().filter(|o| !o.is_empty()) {
                weight_layer.insert(o.as_str(), k);
            }
        }
        if !reads_data
            && (!a.weights.is_empty() || n.input.iter().any(|i| weight_made.contains(i.as_str())))
        {
            weight_made.extend(n.output.iter().map(String::as_str));
        }
        anchor.push(own);
    }
    (anchor, weight_made)
}

/// The blocks of `forward` with the layer indices of `source`; None where they do not make
/// a chain of two or more blocks.
fn blocks_of(
    forward: &[&NodeProto],
    anchors: &[Anchors],
    source: Source,
    is_data: &dyn Fn(&str) -> bool,
) -> Option<Blocks> {
    let (anchor, weight_made) = anchor_layers(forward, anchors, &source, is_data);
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
    if !chained(forward, &anchor, &after, &producer, is_data) {
        return None;
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
            if forward[p].output.iter().any(|o| is_data(o)) {
                regions.entry(before[p]).or_default().push(p);
            } else {
                // constants and shape arithmetic on them: no activation crosses through
                // them, so they take no part in the cut (and are never copied)
                of_node[p] = Some(before[p] as u32);
            }
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
    // After the last block (the final norm, the head, the loss): the nodes that end the last
    // layer (its residual Add) read no weight, so no anchor places them. They are found by
    // the same cut, among the nodes before the next read of a weight (the final norm's, the
    // head's) and before the loss.
    let last = after.iter().copied().max().unwrap_or(none_after);
    let read_in_forward: HashSet<&str> = forward
        .iter()
        .flat_map(|n| n.input.iter().map(String::as_str))
        .collect();
    let ends_window = |p: usize| {
        let n = forward[p];
        !anchors[p].weights.is_empty()
            || n.input.iter().any(|i| weight_made.contains(i.as_str()))
            || !n
                .output
                .iter()
                .any(|o| read_in_forward.contains(o.as_str()))
    };
    let mut window: Vec<usize> = Vec::new();
    let mut rest: Vec<usize> = Vec::new();
    let mut window_open = true;
    for p in 0..forward.len() {
        if before[p] != i64::MAX || after[p] < 0 || !forward[p].output.iter().any(|o| is_data(o)) {
            continue;
        }
        window_open &= after[p] != last || !ends_window(p);
        window_open &= window.len() < MAX_CUT_REGION;
        if window_open && after[p] == last {
            window.push(p);
        } else {
            rest.push(p);
        }
    }
    for p in best_cut(forward, &producer, &rest, &window, is_data) {
        of_node[p] = Some(last as u32);
    }
    Some(Blocks {
        container: source.label(),
        of_node,
    })
}

/// Whether each block reads what the block before it computed, as layers on a residual stream
/// do: some node anchored to block k reads an activation computed after block k - 1's anchors
/// and before block k's. Otherwise the "blocks" are siblings side by side (the q, k and v
/// projections repeat alike) or names that number something else (Paddle's
/// `helper.constant.N`), and recomputing them gains nothing.
fn chained(
    forward: &[&NodeProto],
    anchor: &[Option<u32>],
    after: &[i64],
    producer: &HashMap<&str, usize>,
    is_data: &dyn Fn(&str) -> bool,
) -> bool {
    let layers: BTreeSet<u32> = anchor.iter().flatten().copied().collect();
    let previous: HashMap<u32, i64> = layers
        .iter()
        .zip(layers.iter().skip(1))
        .map(|(&before, &k)| (k, i64::from(before)))
        .collect();
    let mut reached: HashSet<u32> = HashSet::default();
    for (p, n) in forward.iter().enumerate() {
        let Some(k) = anchor[p] else { continue };
        let Some(&before) = previous.get(&k) else {
            continue;
        };
        if n.input
            .iter()
            .filter(|i| is_data(i))
            .filter_map(|i| producer.get(i.as_str()))
            .any(|&q| after[q] == before)
        {
            reached.insert(k);
        }
    }
    reached.len() == previous.len()
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
    use super::{find, layer_index};
    use crate::onnx::NodeProto;

    fn node(name: &str, op: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
        NodeProto {
            name: Some(name.into()),
            op_type: Some(op.into()),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    /// Two layers `x + MatMul(x * (1 + g_k), W_k)` on an embedding, then a norm whose scale is
    /// `1 + g` and a head tied to the embedding (`MatMul(h, Transpose(E))`): no name has a layer
    /// index. Returns the block of each node by output name.
    fn blocks_of(siblings: bool) -> Option<Vec<(String, Option<u32>)>> {
        let mut nodes = vec![node("emb", "Gather", &["E", "ids"], &["x0"])];
        for k in 0..2 {
            let x = if siblings {
                "x0".to_string()
            } else {
                format!("x{k}")
            };
            let (g, w, s, n, m, y) = (
                format!("g{k}"),
                format!("w{k}"),
                format!("s{k}"),
                format!("n{k}"),
                format!("m{k}"),
                format!("x{}", k + 1),
            );
            nodes.push(node("", "Add", &["one", &g], &[&s]));
            nodes.push(node("", "Mul", &[&x, &s], &[&n]));
            nodes.push(node("", "MatMul", &[&n, &w], &[&m]));
            nodes.push(node("", "Add", &[&x, &m], &[&y]));
        }
        let last = if siblings { "x1" } else { "x2" };
        nodes.push(node("", "Add", &["one", "g"], &["s"]));
        nodes.push(node("", "Mul", &[last, "s"], &["h"]));
        nodes.push(node("", "Transpose", &["E"], &["Et"]));
        nodes.push(node("", "MatMul", &["h", "Et"], &["logits"]));
        nodes.push(node("", "ReduceSum", &["logits"], &["loss"]));
        let forward: Vec<&NodeProto> = nodes.iter().collect();
        let weights = ["E", "one", "g", "g0", "g1", "w0", "w1"];
        let is_data = |t: &str| !weights.contains(&t);
        let kind = |t: &str| match t {
            "E" => Some("f[48,8]".to_string()),
            "one" => None,
            w if w.starts_with('w') => Some("f[8,8]".to_string()),
            _ => Some("f[8]".to_string()),
        };
        let found = find(&forward, &|t| weights.contains(&t), &is_data, &kind)?;
        assert!(
            found.container.starts_with("(graph structure"),
            "{}",
            found.container
        );
        Some(
            nodes
                .iter()
                .zip(found.of_node)
                .map(|(n, b)| (n.output[0].clone(), b))
                .collect(),
        )
    }

    #[test]
    fn layers_from_structure_end_at_the_residual_add_before_a_tied_head() {
        let blocks = blocks_of(false).expect("two layers");
        let block = |t: &str| blocks.iter().find(|(o, _)| o == t).unwrap().1;
        assert_eq!(block("x1"), Some(0), "{blocks:?}");
        assert_eq!(
            (block("n1"), block("m1"), block("x2")),
            (Some(1), Some(1), Some(1))
        );
        // the final norm, the head and the loss belong to no block
        assert_eq!(
            (block("h"), block("logits"), block("loss")),
            (None, None, None)
        );
    }

    #[test]
    fn repeats_side_by_side_are_no_layers() {
        assert!(blocks_of(true).is_none());
    }

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

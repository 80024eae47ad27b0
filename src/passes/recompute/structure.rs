//! The layers of a forward graph from its structure alone, where no name carries a layer index
//! (an export that renamed every weight and node). The forward reads its weights layer after
//! layer, so the sequence of weight reads — which op reads which kind of weight (element type
//! and shape) in which input — repeats once per layer. The longest periodic run of that sequence
//! gives the layers: the weights read in its k-th period are layer k's. Reads before the first
//! period (the embedding) and after the last (the final norm, the head) belong to no layer.

use crate::graph::hash::HashMap;
use crate::onnx::NodeProto;

/// At most this many comparisons in the search for the period (a run with P reads a period
/// costs one pass over the sequence per candidate P): enough for every P up to half the
/// sequence up to ~7 000 reads (a 500-layer model), and for the short periods of longer ones.
const COMPARISONS: usize = 25_000_000;

/// Weights a derived tensor may come from and still belong to one layer.
const MAX_WEIGHTS_PER_TENSOR: usize = 16;

/// How the layers were found from the structure.
pub struct Layers<'a> {
    /// Weight → its layer.
    pub of_weight: HashMap<&'a str, u32>,
    /// Weight reads per layer.
    pub period: usize,
}

/// The layer of each weight the repeated part of `forward` reads; None where the reads repeat
/// fewer than twice. `weights` holds the weights each node of `forward` reads (those `blocks`
/// anchors by), `weight_kind` names a weight's element type and shape.
pub fn layers<'a>(
    forward: &[&'a NodeProto],
    weights: &[&[&'a str]],
    is_data: &dyn Fn(&str) -> bool,
    weight_kind: &dyn Fn(&str) -> Option<String>,
) -> Option<Layers<'a>> {
    let mut ids: HashMap<String, u32> = HashMap::default();
    let mut intern = |key: String| -> u32 {
        let next = ids.len() as u32;
        *ids.entry(key).or_insert(next)
    };
    // tensors computed from weights alone (dynamo's Transpose(W), a Cast): their kind and the
    // weights they come from
    let mut derived: HashMap<&str, (u32, Vec<&'a str>)> = HashMap::default();
    // the reads: (kind of read, the weights read)
    let mut reads: Vec<(u32, Vec<&'a str>)> = Vec::new();
    for (n, node_weights) in forward.iter().zip(weights) {
        let of_input = |i: &'a str,
                        derived: &HashMap<&str, (u32, Vec<&'a str>)>,
                        intern: &mut dyn FnMut(String) -> u32|
         -> Option<(u32, Vec<&'a str>)> {
            if let Some(d) = derived.get(i) {
                return Some(d.clone());
            }
            node_weights
                .contains(&i)
                .then(|| weight_kind(i))
                .flatten()
                .map(|kind| (intern(format!("w {kind}")), vec![i]))
        };
        let inputs: Vec<Option<(u32, Vec<&'a str>)>> = n
            .input
            .iter()
            .map(|i| of_input(i.as_str(), &derived, &mut intern))
            .collect();
        if inputs.iter().all(Option::is_none) {
            continue;
        }
        if n.input.iter().any(|i| is_data(i)) {
            for (slot, read) in inputs.into_iter().enumerate() {
                if let Some((kind, weights)) = read {
                    reads.push((intern(format!("r {} {slot} {kind}", n.op_type())), weights));
                }
            }
        } else {
            let kinds: Vec<String> = inputs
                .iter()
                .map(|r| r.as_ref().map_or("-".into(), |(k, _)| k.to_string()))
                .collect();
            let mut weights: Vec<&'a str> =
                inputs.into_iter().flatten().flat_map(|(_, w)| w).collect();
            // a tensor made of many weights (a concatenation of all of them) is no one
            // layer's: it anchors none, and chains of them stay linear in size
            if weights.len() > MAX_WEIGHTS_PER_TENSOR {
                weights.clear();
            }
            for (k, o) in n.output.iter().enumerate().filter(|(_, o)| !o.is_empty()) {
                let kind = intern(format!("d {} {k} {}", n.op_type(), kinds.join(",")));
                derived.insert(o.as_str(), (kind, weights.clone()));
            }
        }
    }
    let sequence: Vec<u32> = reads.iter().map(|(k, _)| *k).collect();
    let (start, period, count) = periodic_run(&sequence)?;
    let mut of_weight: HashMap<&'a str, u32> = HashMap::default();
    let mut shared: Vec<&'a str> = Vec::new();
    for (r, (_, weights)) in reads.iter().enumerate().skip(start).take(period * count) {
        let layer = ((r - start) / period) as u32;
        for &w in weights {
            if *of_weight.entry(w).or_insert(layer) != layer {
                shared.push(w);
            }
        }
    }
    // a weight read by several layers (shared between them) anchors none
    for w in shared {
        of_weight.remove(w);
    }
    let layers: std::collections::BTreeSet<u32> = of_weight.values().copied().collect();
    (layers.len() >= 2).then_some(Layers { of_weight, period })
}

/// `(start, period, count)` of the periodic run of `sequence` that covers the most elements
/// (`period * count`, count ≥ 2); ties: the shorter period, then the earlier start.
fn periodic_run(sequence: &[u32]) -> Option<(usize, usize, usize)> {
    let n = sequence.len();
    let max_period = (n / 2).min(COMPARISONS / n.max(1));
    let mut best: Option<(usize, usize, usize)> = None;
    let mut consider = |start: usize, period: usize, matched: usize| {
        let count = (matched + period) / period;
        if count < 2 {
            return;
        }
        let better = match best {
            None => true,
            Some((s, p, c)) => {
                (
                    period * count,
                    std::cmp::Reverse(period),
                    std::cmp::Reverse(start),
                ) > (p * c, std::cmp::Reverse(p), std::cmp::Reverse(s))
            }
        };
        if better {
            best = Some((start, period, count));
        }
    };
    for period in 1..=max_period {
        // a run of positions j with sequence[j] == sequence[j + period]: the elements from
        // its first j to its last j + period repeat with that period
        let mut matched = 0;
        for j in 0..n - period {
            if sequence[j] == sequence[j + period] {
                matched += 1;
            } else {
                if matched > 0 {
                    consider(j - matched, period, matched);
                }
                matched = 0;
            }
        }
        if matched > 0 {
            consider(n - period - matched, period, matched);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::periodic_run;

    #[test]
    fn finds_the_layers_period_between_a_head_and_a_tail() {
        // embedding 9, three layers of [1 2 3 3 4], final norm 1 and head 8
        let seq = [9, 1, 2, 3, 3, 4, 1, 2, 3, 3, 4, 1, 2, 3, 3, 4, 1, 8];
        assert_eq!(periodic_run(&seq), Some((1, 5, 3)));
    }

    #[test]
    fn prefers_the_shorter_period_when_both_cover_as_much() {
        let seq = [1, 2, 1, 2, 1, 2, 1, 2];
        assert_eq!(periodic_run(&seq), Some((0, 2, 4)));
    }

    #[test]
    fn a_repeat_inside_a_layer_loses_to_the_layers() {
        // q, k, v read the same kind of weight (7 7 7); the layer [5 7 7 7 6] repeats twice
        let seq = [5, 7, 7, 7, 6, 5, 7, 7, 7, 6];
        assert_eq!(periodic_run(&seq), Some((0, 5, 2)));
    }

    #[test]
    fn nothing_repeats() {
        assert_eq!(periodic_run(&[1, 2, 3, 4]), None);
        assert_eq!(periodic_run(&[1]), None);
        assert_eq!(periodic_run(&[]), None);
    }
}

//! Where a per-position cross-entropy goes: the scalar loss the graph reports, and the masks
//! or weights on the way that drop positions.
//!
//! A `SoftmaxCrossEntropyLoss(reduction='none')` (torch masked losses, Paddle, and every
//! hand-written form after `ce_forms` rewrote it) leaves the reduction to the graph:
//! `Mul(mask) → ReduceSum → Div(ReduceSum(mask))`, `Where(valid, loss, 0) → ReduceMean`, ...
//! That arithmetic stays as it is. The number loss is added to the reported scalar, and it skips
//! the positions a mask or weight zeroes, as the cross-entropy does.

use std::collections::{HashMap, VecDeque};

use crate::graph::{static_rank, GraphIndex};

/// A tensor that says, position by position, whether the cross-entropy counts a position.
#[derive(Debug, Clone)]
pub struct PositionMask {
    /// The mask or weight as the graph applies it.
    pub tensor: String,
    /// The per-position loss it is applied to (the mask broadcasts to this tensor's shape).
    pub applied_to: String,
    pub keep: Keep,
    /// The layout ops (node indices, in order) between the cross-entropy's output and
    /// `applied_to`: replayed on position indices, they say which position each element is.
    pub layout: Vec<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// `Mul(loss, w)`: positions with `w == 0` are dropped.
    NonZero,
    /// `Where(c, loss, other)`: positions with `c` false are dropped.
    True,
    /// `Where(c, other, loss)`: positions with `c` true are dropped.
    False,
}

/// The scalar graph output a per-position loss ends in.
#[derive(Debug, Clone)]
pub struct Reported {
    pub output: String,
    /// The node that writes `output`.
    pub producer: usize,
    /// Op types on the way from the per-position loss to `output`, for the metadata.
    pub path: Vec<String>,
    pub masks: Vec<PositionMask>,
}

/// Ops that change values, not positions.
const VALUE_ONLY: &[&str] = &["Neg", "Identity", "Cast"];
/// Ops that move positions without mixing them.
const LAYOUT: &[&str] = &["Squeeze", "Unsqueeze", "Reshape", "Flatten", "Transpose"];

/// Follows `per_position` to the first scalar graph output it reaches (in graph output order)
/// and collects the masks applied before anything mixes positions. None when no scalar graph
/// output depends on it.
pub fn reported_loss(index: &GraphIndex, per_position: &str) -> Option<Reported> {
    // breadth-first over consumers; parent[t] = the node that made t from an earlier tensor
    let mut parent: HashMap<String, usize> = HashMap::new();
    let mut queue = VecDeque::from([per_position.to_string()]);
    let mut seen = std::collections::HashSet::from([per_position.to_string()]);
    while let Some(t) = queue.pop_front() {
        for &c in index.consumers(&t) {
            for out in index.graph.node[c].output.iter().filter(|o| !o.is_empty()) {
                if seen.insert(out.clone()) {
                    parent.insert(out.clone(), c);
                    queue.push_back(out.clone());
                }
            }
        }
    }
    let output = index
        .graph
        .output
        .iter()
        .map(|o| o.name())
        .find(|o| seen.contains(*o) && *o != per_position && static_rank(index, o) == Some(0))?
        .to_string();
    let producer = *parent.get(&output)?;
    let mut path = Vec::new();
    let mut t = output.clone();
    while let Some(&n) = parent.get(&t) {
        let node = &index.graph.node[n];
        path.push(node.op_type().to_string());
        // the input that came from the per-position loss
        match node
            .input
            .iter()
            .find(|i| *i == per_position || parent.contains_key(*i))
        {
            Some(i) if path.len() < 64 => t = i.clone(),
            _ => break,
        }
    }
    path.reverse();
    Some(Reported {
        output,
        producer,
        path,
        masks: masks(index, per_position),
    })
}

/// Masks along the single-consumer chain from the per-position loss, up to the first op that
/// mixes positions (a reduction, or anything not listed here).
fn masks(index: &GraphIndex, per_position: &str) -> Vec<PositionMask> {
    let mut found = Vec::new();
    let mut layout = Vec::new();
    let mut t = per_position.to_string();
    for _ in 0..32 {
        let [c] = index.consumers(&t) else { break };
        let node = &index.graph.node[*c];
        let Some(out) = node.output.first().filter(|o| !o.is_empty()) else {
            break;
        };
        let other = |k: usize| node.input.get(k).filter(|x| !x.is_empty()).cloned();
        match node.op_type() {
            op if VALUE_ONLY.contains(&op) && node.input.first() == Some(&t) => {}
            op if LAYOUT.contains(&op) && node.input.first() == Some(&t) => layout.push(*c),
            "Mul" if node.input.len() == 2 => {
                let w = if node.input[0] == t {
                    other(1)
                } else {
                    other(0)
                };
                let Some(w) = w.filter(|w| *w != t) else {
                    break;
                };
                if !is_scalar_constant(index, &w) {
                    found.push(PositionMask {
                        tensor: w,
                        applied_to: t.clone(),
                        keep: Keep::NonZero,
                        layout: layout.clone(),
                    });
                }
            }
            "Div" if node.input.first() == Some(&t) => {}
            // a smoothed form's uniform term, added per position by the rewrite
            "Add" if node.input.len() == 2 && node.input.iter().any(|x| is_smoothing_term(x)) => {}
            "Where" if node.input.len() == 3 && node.input[0] != t => {
                let keep = if node.input[1] == t {
                    Keep::True
                } else {
                    Keep::False
                };
                found.push(PositionMask {
                    tensor: node.input[0].clone(),
                    applied_to: t.clone(),
                    keep,
                    layout: layout.clone(),
                });
            }
            _ => break,
        }
        t = out.clone();
    }
    found
}

fn is_smoothing_term(t: &str) -> bool {
    let name = format!(
        "{}/{}",
        ntl_ops::names::PREFIX,
        crate::ce::forms::SMOOTHING_TERM
    );
    t.strip_prefix(&name)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('_'))
}

fn is_scalar_constant(index: &GraphIndex, t: &str) -> bool {
    index
        .constant_tensor(t)
        .is_some_and(|c| c.dims.iter().all(|&x| x == 1))
}

//! Structural checks every command runs before it walks a graph: each standard node has the
//! inputs and outputs its operator schema requires (ONNX 1.16's schemas,
//! `ntl_ops::schema`), with non-empty names in the required slots; the training ops
//! artifacts mode reads have theirs; initializer dims are not negative.
//!
//! The graph walks index only slots these checks guarantee, and read everything else with
//! `get`, so a malformed model is refused with one line instead of a panic.

use crate::error::Error;
use crate::onnx::{default_opset, GraphProto, ModelProto, NodeProto};
use ntl_ops::schema::{schemas, Param};

/// The largest tensor rank an axis attribute may refer to.
const MAX_RANK: u64 = 64;

/// Microsoft-domain training ops ntl-patch reads: (op, required inputs, required outputs).
const TRAINING_OPS: [(&str, usize, usize); 1] = [("SoftmaxCrossEntropyLossGrad", 3, 1)];

/// Inputs and outputs a node must have, from its schema at `opset` (None: unknown op).
pub fn required_arity(node: &NodeProto, opset: i64) -> Option<(usize, usize)> {
    match node.domain() {
        "" | "ai.onnx" => {
            let schema = schemas().schema("ai.onnx", node.op_type(), opset)?;
            let required = |params: &[Param]| {
                params
                    .iter()
                    .rposition(|p| !p.optional && !p.variadic)
                    .map_or(0, |i| i + 1)
            };
            Some((required(&schema.inputs), required(&schema.outputs)))
        }
        "com.microsoft" => TRAINING_OPS
            .iter()
            .find(|(op, _, _)| *op == node.op_type())
            .map(|&(_, i, o)| (i, o)),
        _ => None,
    }
}

/// Why a node lacks a required input or output, if it does.
pub fn arity_problem(node: &NodeProto, opset: i64) -> Option<String> {
    let (inputs, outputs) = required_arity(node, opset)?;
    let missing =
        |slots: &[String], n: usize| slots.len() < n || slots[..n].iter().any(String::is_empty);
    if missing(&node.input, inputs) || missing(&node.output, outputs) {
        return Some(format!(
            "node '{}' ({}) has {} input(s) and {} output(s), its op needs at least {inputs} and {outputs} (with names)",
            node.name(),
            node.op_type(),
            node.input.len(),
            node.output.len()
        ));
    }
    None
}

/// Attributes the graph walks and the runtimes interpret: `axis`/`axes` within any rank, a
/// Transpose `perm` a permutation of `0..n` (tract loops forever, allocating, on `[1, 1]`,
/// and allocates from an axis of -4e18).
pub fn attribute_problem(node: &NodeProto) -> Option<String> {
    if !matches!(node.domain(), "" | "ai.onnx") {
        return None;
    }
    // axes index tensors of rank <= MAX_RANK (tract allocates from huge ones)
    for a in node
        .attribute
        .iter()
        .filter(|a| matches!(a.name(), "axis" | "axes"))
    {
        let values = a.i.iter().chain(a.ints.iter());
        if let Some(v) = values.into_iter().find(|v| v.unsigned_abs() > MAX_RANK) {
            return Some(format!(
                "{} node '{}' has {} {v}, beyond any tensor rank (at most {MAX_RANK})",
                node.op_type(),
                node.name(),
                a.name()
            ));
        }
    }
    if node.op_type() != "Transpose" {
        return None;
    }
    let perm = crate::onnx::attr_ints(node, "perm")?;
    let mut seen = vec![false; perm.len()];
    let ok = perm.iter().all(|&p| {
        usize::try_from(p)
            .ok()
            .and_then(|p| seen.get_mut(p))
            .is_some_and(|s| !std::mem::replace(s, true))
    });
    (!ok).then(|| {
        format!(
            "Transpose node '{}' has perm {perm:?}, which is not a permutation of 0..{}",
            node.name(),
            perm.len()
        )
    })
}

/// The checks for the main graph of `model` (see the module doc).
pub fn check_model(model: &ModelProto) -> Result<(), Error> {
    let Some(graph) = &model.graph else {
        return Ok(());
    };
    let opset = default_opset(model).unwrap_or(i64::MAX);
    check_graph(graph, opset).map_err(Error::MalformedGraph)
}

fn check_graph(graph: &GraphProto, opset: i64) -> Result<(), String> {
    if let Some(why) = graph.node.iter().find_map(|n| arity_problem(n, opset)) {
        return Err(why);
    }
    if let Some(why) = graph.node.iter().find_map(attribute_problem) {
        return Err(why);
    }
    for t in &graph.initializer {
        if let Some(d) = t.dims.iter().find(|&&d| d < 0) {
            return Err(format!(
                "initializer '{}' has a negative dimension ({d})",
                t.name()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arity_from_schemas() {
        let node = |op: &str, inputs: usize, outputs: usize| NodeProto {
            op_type: Some(op.into()),
            input: (0..inputs).map(|i| format!("i{i}")).collect(),
            output: (0..outputs).map(|i| format!("o{i}")).collect(),
            ..Default::default()
        };
        assert_eq!(required_arity(&node("Transpose", 1, 1), 17), Some((1, 1)));
        assert_eq!(required_arity(&node("Reshape", 2, 1), 17), Some((2, 1)));
        assert_eq!(
            required_arity(&node("SoftmaxCrossEntropyLoss", 2, 1), 17),
            Some((2, 1))
        );
        assert!(arity_problem(&node("Transpose", 0, 1), 17).is_some());
        assert!(arity_problem(&node("Reshape", 1, 1), 17).is_some());
        assert!(arity_problem(&node("Reshape", 2, 0), 17).is_some());
        assert!(arity_problem(&node("Concat", 0, 1), 17).is_none());
        assert!(arity_problem(&node("NoSuchOp", 0, 0), 17).is_none());
        let mut t = node("Transpose", 1, 1);
        t.attribute = vec![crate::onnx::ints_attr("perm", &[1, 1])];
        assert!(attribute_problem(&t).is_some());
        t.attribute = vec![crate::onnx::ints_attr("perm", &[1, 0, 2])];
        assert!(attribute_problem(&t).is_none());
        t.attribute = vec![crate::onnx::ints_attr("perm", &[0, -1])];
        assert!(attribute_problem(&t).is_some());
        let mut grad = node("SoftmaxCrossEntropyLossGrad", 3, 0);
        grad.domain = Some("com.microsoft".into());
        assert!(arity_problem(&grad, 17).is_some());
    }
}

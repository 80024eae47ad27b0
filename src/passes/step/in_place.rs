//! Which state inputs a runtime may update in place: write the next value (`ntl/next/...`)
//! into the memory of the input itself, so the old and the new value never both exist
//! (metadata `in_place`, docs/STEP_GRAPH.md).
//!
//! That is safe when every node that reads the input (or a view of it: runtimes alias the
//! outputs of Identity, Reshape and their kind to their input) has run before the next value is
//! written: it is an ancestor of the node producing the next value, or that node itself, an
//! elementwise op reading each element before it writes the same one (`Sub(p, delta)`; fp16's
//! `Where(skipped, m, m_new)`). The optimizer's moments and step count pass in every graph; a
//! parameter passes in the update graph of `--split`, where only the optimizer reads it, and not
//! in the step graph, whose backward pass reads it too.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::onnx::{GraphProto, NodeProto};

/// Ops whose output a runtime may make a view of their first input.
const VIEW_OPS: &[&str] = &["Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"];
/// Elementwise ops that may write their output over an input of the output's shape.
const ELEMENTWISE_OPS: &[&str] = &["Add", "Sub", "Mul", "Div", "Where"];

/// The inputs of `pairs` (state input, its next-value output) that may be updated in place,
/// in the order given.
pub fn in_place_inputs(graph: &GraphProto, pairs: &[(&str, &str)]) -> Vec<String> {
    let reads: Vec<Vec<&str>> = graph.node.iter().map(read_names).collect();
    let mut producer: HashMap<&str, usize> = HashMap::new();
    let mut readers: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, node) in graph.node.iter().enumerate() {
        for out in node.output.iter().filter(|o| !o.is_empty()) {
            producer.insert(out.as_str(), i);
        }
        for &name in &reads[i] {
            readers.entry(name).or_default().push(i);
        }
    }
    pairs
        .iter()
        .filter(|(input, output)| {
            producer.get(output).is_some_and(|&p| {
                let reading = readers_through_views(graph, &readers, input);
                safe(graph, &reads, &producer, p, &reading)
            })
        })
        .map(|(input, _)| input.to_string())
        .collect()
}

/// Every name a node reads: its inputs and the outer names its subgraphs use.
fn read_names(node: &NodeProto) -> Vec<&str> {
    let mut names: Vec<&str> = node
        .input
        .iter()
        .map(String::as_str)
        .filter(|s| !s.is_empty())
        .collect();
    let mut stack: Vec<&GraphProto> = node
        .attribute
        .iter()
        .flat_map(|a| a.g.iter().chain(a.graphs.iter()))
        .collect();
    while let Some(sub) = stack.pop() {
        for n in &sub.node {
            names.extend(n.input.iter().map(String::as_str).filter(|s| !s.is_empty()));
            stack.extend(
                n.attribute
                    .iter()
                    .flat_map(|a| a.g.iter().chain(a.graphs.iter())),
            );
        }
    }
    names
}

/// The nodes reading `input` or a view of it.
fn readers_through_views(
    graph: &GraphProto,
    readers: &HashMap<&str, Vec<usize>>,
    input: &str,
) -> HashSet<usize> {
    let mut found = HashSet::new();
    let mut names = vec![input.to_string()];
    while let Some(name) = names.pop() {
        for &r in readers.get(name.as_str()).into_iter().flatten() {
            let node = &graph.node[r];
            if found.insert(r) && VIEW_OPS.contains(&node.op_type()) && node.input[0] == name {
                names.extend(node.output.iter().filter(|o| !o.is_empty()).cloned());
            }
        }
    }
    found
}

/// Every reader is the producer itself (elementwise) or one of its ancestors. The walk up from
/// the producer stops once every reader is found.
fn safe(
    graph: &GraphProto,
    reads: &[Vec<&str>],
    producer: &HashMap<&str, usize>,
    p: usize,
    reading: &HashSet<usize>,
) -> bool {
    if reading.contains(&p) && !ELEMENTWISE_OPS.contains(&graph.node[p].op_type()) {
        return false;
    }
    let mut missing: HashSet<usize> = reading.iter().copied().filter(|&r| r != p).collect();
    let mut seen: HashSet<usize> = HashSet::from([p]);
    let mut queue: VecDeque<usize> = VecDeque::from([p]);
    while let Some(n) = queue.pop_front() {
        if missing.is_empty() {
            return true;
        }
        for name in &reads[n] {
            if let Some(&up) = producer.get(name) {
                if seen.insert(up) {
                    missing.remove(&up);
                    queue.push_back(up);
                }
            }
        }
    }
    missing.is_empty()
}

#[cfg(test)]
mod tests {
    use super::in_place_inputs;
    use crate::onnx::{GraphProto, NodeProto};

    fn node(op: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
        NodeProto {
            op_type: Some(op.into()),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn graph(nodes: Vec<NodeProto>) -> GraphProto {
        GraphProto {
            node: nodes,
            ..Default::default()
        }
    }

    #[test]
    fn readers_before_the_write_pass_and_later_readers_do_not() {
        let g = graph(vec![
            // the moment: read once, by an ancestor of its next value
            node("Mul", &["m", "b1"], &["m1"]),
            node("Add", &["m1", "g"], &["m_next"]),
            // the step count: read by the producer itself, elementwise, first operand
            node("Add", &["step", "one"], &["step_next"]),
            // a weight read by the update and by a node that is no ancestor of it
            node("Mul", &["w", "d"], &["wd"]),
            node("Sub", &["wd", "g"], &["w_next"]),
            node("MatMul", &["x", "w"], &["late"]),
            // read through a view, by an ancestor and by a node after the write
            node("Reshape", &["v", "shape"], &["v_view"]),
            node("Mul", &["v_view", "c"], &["v1"]),
            node("Identity", &["v1"], &["v_next"]),
            node("Neg", &["v_view"], &["v_late"]),
            // the same without the late reader passes
            node("Reshape", &["q", "shape"], &["q_view"]),
            node("Mul", &["q_view", "c"], &["q1"]),
            node("Identity", &["q1"], &["q_next"]),
            // kept by fp16's Where, read by the Where itself and by an ancestor
            node("Mul", &["s", "c"], &["s1"]),
            node("Where", &["skip", "s", "s1"], &["s_next"]),
            // read by a producer that is not elementwise
            node("MatMul", &["y", "u"], &["u_next"]),
        ]);
        let pairs = [
            ("m", "m_next"),
            ("step", "step_next"),
            ("w", "w_next"),
            ("v", "v_next"),
            ("q", "q_next"),
            ("s", "s_next"),
            ("u", "u_next"),
        ];
        assert_eq!(in_place_inputs(&g, &pairs), ["m", "step", "q", "s"]);
    }

    #[test]
    fn a_subgraph_reading_the_input_counts_as_a_reader() {
        let body = graph(vec![node("Neg", &["m"], &["inner"])]);
        let mut looped = node("Loop", &["n", ""], &["out"]);
        looped.attribute.push(crate::onnx::proto::AttributeProto {
            name: Some("body".into()),
            g: Some(body),
            ..Default::default()
        });
        let g = graph(vec![node("Mul", &["m", "b1"], &["m_next"]), looped]);
        assert!(in_place_inputs(&g, &[("m", "m_next")]).is_empty());
    }
}

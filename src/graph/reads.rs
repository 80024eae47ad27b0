//! What a node reads from the graph around it: its inputs, and the names its subgraphs
//! (`If`, `Loop`, `Scan` bodies, nested ones included) read from enclosing scopes. Every pass
//! that asks "who reads this tensor" or renames a reader goes through here, so a subgraph's
//! read is never forgotten by one of them.

use std::collections::{HashMap, HashSet};

use crate::onnx::{GraphProto, NodeProto};

/// The enclosing scopes' tensors a node's subgraphs read: names their nodes use, and body
/// outputs, that the bodies do not define themselves (a body may output an outer tensor as
/// it is). Empty, without allocating, for a node with no subgraph.
pub fn outer_reads(node: &NodeProto) -> Vec<&str> {
    let mut outer = Vec::new();
    for sub in subgraphs(node) {
        body_reads(sub, &mut outer);
    }
    outer
}

fn subgraphs(node: &NodeProto) -> impl Iterator<Item = &GraphProto> {
    node.attribute
        .iter()
        .flat_map(|a| a.g.iter().chain(&a.graphs))
}

/// The names `g` reads that it does not define, into `outer`.
fn body_reads<'g>(g: &'g GraphProto, outer: &mut Vec<&'g str>) {
    let own: HashSet<&str> = g
        .input
        .iter()
        .map(|v| v.name())
        .chain(g.initializer.iter().map(|t| t.name()))
        .chain(
            g.node
                .iter()
                .flat_map(|n| n.output.iter().map(String::as_str)),
        )
        .collect();
    for n in &g.node {
        let used = n.input.iter().map(String::as_str).chain(outer_reads(n));
        outer.extend(used.filter(|i| !i.is_empty() && !own.contains(i)));
    }
    let passed = g.output.iter().map(|o| o.name());
    outer.extend(passed.filter(|o| !o.is_empty() && !own.contains(o)));
}

/// Renames what `node` reads, its inputs and its subgraphs' reads of enclosing scopes:
/// a read of a key reads the value instead. Names a body defines itself are left alone.
pub fn rename_reads(node: &mut NodeProto, renames: &HashMap<String, String>) {
    for i in &mut node.input {
        if let Some(w) = renames.get(i.as_str()) {
            *i = w.clone();
        }
    }
    for a in &mut node.attribute {
        for g in a.g.iter_mut().chain(a.graphs.iter_mut()) {
            rename_body_reads(g, renames);
        }
    }
}

fn rename_body_reads(g: &mut GraphProto, renames: &HashMap<String, String>) {
    let own: HashSet<String> = g
        .input
        .iter()
        .map(|v| v.name().to_string())
        .chain(g.initializer.iter().map(|t| t.name().to_string()))
        .chain(g.node.iter().flat_map(|n| n.output.iter().cloned()))
        .collect();
    // what the body defines shadows nothing outside (ONNX names are unique across scopes),
    // but a rename never reaches a name the body owns
    let outer: HashMap<String, String> = renames
        .iter()
        .filter(|(k, _)| !own.contains(k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if outer.is_empty() {
        return;
    }
    for n in &mut g.node {
        rename_reads(n, &outer);
    }
    for o in &mut g.output {
        if let Some(w) = outer.get(o.name()) {
            o.name = Some(w.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::onnx::proto::AttributeProto;
    use crate::onnx::ValueInfoProto;

    fn node(op: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
        NodeProto {
            op_type: Some(op.into()),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn value(name: &str) -> ValueInfoProto {
        ValueInfoProto {
            name: Some(name.into()),
            ..Default::default()
        }
    }

    /// `If(c)` whose branch reads `x` (two levels down), defines `t`, outputs `t` and the outer
    /// `y` as it is.
    fn if_node() -> NodeProto {
        let inner = GraphProto {
            node: vec![node("Neg", &["x"], &["u"])],
            output: vec![value("u")],
            ..Default::default()
        };
        let mut nested = node("If", &["c"], &["v"]);
        nested.attribute.push(AttributeProto {
            name: Some("then_branch".into()),
            g: Some(inner),
            ..Default::default()
        });
        let branch = GraphProto {
            node: vec![nested, node("Add", &["v", "z"], &["t"])],
            output: vec![value("t"), value("y")],
            ..Default::default()
        };
        let mut n = node("If", &["c"], &["o", "p"]);
        n.attribute.push(AttributeProto {
            name: Some("then_branch".into()),
            g: Some(branch),
            ..Default::default()
        });
        n
    }

    #[test]
    fn outer_reads_are_what_the_bodies_do_not_define() {
        let n = if_node();
        let mut reads = outer_reads(&n);
        reads.sort();
        assert_eq!(reads, ["c", "x", "y", "z"]);
        assert!(outer_reads(&node("Add", &["a", "b"], &["c"])).is_empty());
    }

    #[test]
    fn renames_reach_into_subgraphs_but_not_their_own_names() {
        let mut n = if_node();
        let renames: HashMap<String, String> = [("x", "X"), ("y", "Y"), ("c", "C"), ("t", "T")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        rename_reads(&mut n, &renames);
        let mut reads = outer_reads(&n);
        reads.sort();
        assert_eq!(reads, ["C", "X", "Y", "z"]);
        // `t` is the branch's own: its output keeps the name
        let branch = n.attribute[0].g.as_ref().unwrap();
        assert_eq!(branch.output[0].name(), "t");
    }
}

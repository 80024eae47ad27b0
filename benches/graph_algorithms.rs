//! Does petgraph make ntl-patch's graph algorithms shorter and no slower? Measured on the
//! hostile-input sizes: a 1 000 000-node Identity chain, and 250 000 initializers each feeding
//! one node of a chain to the loss. Both sides answer the same questions:
//! - order and cycle check: every input defined before use, every tensor produced once
//!   (`graph::patch::check_consistency`, one pass over ONNX's topologically sorted node list)
//!   against `petgraph::algo::toposort` over the producer → consumer graph;
//! - reachability: which parameters the loss depends on (`passes::grad::reaching_loss`: a
//!   forward and a backward pass over the node list) against petgraph `Dfs` from the
//!   parameters and from the loss on the reversed graph.
//!
//! `cargo bench --bench graph_algorithms` (release build). Results: ARCHITECTURE.md.

use std::collections::HashMap;
use std::time::Instant;

use ntl_patch::onnx::{GraphProto, ModelProto, NodeProto, TensorProto, ValueInfoProto, FLOAT};
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::{Dfs, Reversed};

fn node(op: &str, inputs: Vec<String>, output: String) -> NodeProto {
    NodeProto {
        op_type: Some(op.into()),
        input: inputs,
        output: vec![output],
        ..Default::default()
    }
}

fn value(name: &str) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        ..Default::default()
    }
}

/// x → Identity → … → Identity (n nodes) → loss.
fn identity_chain(n: usize) -> ModelProto {
    let nodes = (0..n)
        .map(|i| {
            let input = if i == 0 {
                "x".to_string()
            } else {
                format!("t{}", i - 1)
            };
            node("Identity", vec![input], format!("t{i}"))
        })
        .collect();
    model(nodes, vec![], "x", &format!("t{}", n - 1))
}

/// x, then `acc_i = Add(acc_{i-1}, p_i)` for 250 000 one-element initializers p_i.
fn many_parameters(n: usize) -> ModelProto {
    let params: Vec<TensorProto> = (0..n)
        .map(|i| TensorProto {
            name: Some(format!("p{i}")),
            dims: vec![1],
            data_type: Some(FLOAT),
            float_data: vec![0.5],
            ..Default::default()
        })
        .collect();
    let nodes = (0..n)
        .map(|i| {
            let acc = if i == 0 {
                "x".to_string()
            } else {
                format!("a{}", i - 1)
            };
            node("Add", vec![acc, format!("p{i}")], format!("a{i}"))
        })
        .collect();
    model(nodes, params, "x", &format!("a{}", n - 1))
}

fn model(nodes: Vec<NodeProto>, init: Vec<TensorProto>, input: &str, out: &str) -> ModelProto {
    ModelProto {
        graph: Some(GraphProto {
            node: nodes,
            initializer: init,
            input: vec![value(input)],
            output: vec![value(out)],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The producer → consumer graph of a node list (one graph node per ONNX node).
fn petgraph_of(g: &GraphProto) -> (DiGraph<(), ()>, Vec<NodeIndex>) {
    let mut pg = DiGraph::with_capacity(g.node.len(), g.node.len());
    let ids: Vec<NodeIndex> = g.node.iter().map(|_| pg.add_node(())).collect();
    let mut producer: HashMap<&str, NodeIndex> = HashMap::with_capacity(g.node.len());
    for (n, id) in g.node.iter().zip(&ids) {
        for o in &n.output {
            producer.insert(o.as_str(), *id);
        }
    }
    for (n, id) in g.node.iter().zip(&ids) {
        for i in &n.input {
            if let Some(&p) = producer.get(i.as_str()) {
                pg.add_edge(p, *id, ());
            }
        }
    }
    (pg, ids)
}

fn petgraph_order(m: &ModelProto) -> bool {
    let (pg, _) = petgraph_of(m.graph.as_ref().unwrap());
    petgraph::algo::toposort(&pg, None).is_ok()
}

/// Parameters the loss depends on: nodes reachable from each parameter's consumers and
/// reaching the loss's producer.
fn petgraph_reaching(m: &ModelProto, loss: &str, params: &[String]) -> usize {
    let g = m.graph.as_ref().unwrap();
    let (pg, ids) = petgraph_of(g);
    let mut consumers: HashMap<&str, Vec<NodeIndex>> = HashMap::new();
    for (n, id) in g.node.iter().zip(&ids) {
        for i in &n.input {
            consumers.entry(i.as_str()).or_default().push(*id);
        }
    }
    let loss_node = g
        .node
        .iter()
        .zip(&ids)
        .find(|(n, _)| n.output.iter().any(|o| o == loss))
        .map(|(_, id)| *id)
        .unwrap();
    let mut reaches_loss = vec![false; pg.node_count()];
    let rev = Reversed(&pg);
    let mut dfs = Dfs::new(rev, loss_node);
    while let Some(n) = dfs.next(rev) {
        reaches_loss[n.index()] = true;
    }
    params
        .iter()
        .filter(|p| {
            consumers
                .get(p.as_str())
                .is_some_and(|c| c.iter().any(|n| reaches_loss[n.index()]))
        })
        .count()
}

fn time<T>(what: &str, f: impl Fn() -> T) -> T {
    let mut best = f64::INFINITY;
    let mut out = None;
    for _ in 0..5 {
        let t = Instant::now();
        out = Some(f());
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!("  {what:<46} {:>9.1} ms (best of 5)", best * 1e3);
    out.unwrap()
}

fn main() {
    for (label, m) in [
        ("1 000 000-node Identity chain", identity_chain(1_000_000)),
        ("250 000 initializers", many_parameters(250_000)),
    ] {
        println!("{label}:");
        let g = m.graph.as_ref().unwrap();
        let loss = g.output[0].name().to_string();
        let params: Vec<String> = g.initializer.iter().map(|t| t.name().to_string()).collect();
        let ours = time("order/cycle: check_consistency (one pass)", || {
            ntl_patch::graph::patch::check_consistency(&m).is_ok()
        });
        let theirs = time("order/cycle: petgraph build + toposort", || {
            petgraph_order(&m)
        });
        assert!(ours && theirs);
        let ours = time("reachability: grad::reaching_loss", || {
            ntl_patch::passes::grad::reaching_loss(&g.node, &loss, &params).len()
        });
        let theirs = time("reachability: petgraph build + Dfs", || {
            petgraph_reaching(&m, &loss, &params)
        });
        assert_eq!(ours, theirs);
    }
}

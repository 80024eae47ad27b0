//! The nodes ORT moves to the CPU by its own choice although they have GPU kernels: cheap
//! shape arithmetic fed from CPU memory (not a fallback, reported apart).

use std::collections::{BTreeSet, HashMap, HashSet};

use super::matching::Placement;
use super::nodes::{is_constant, node_label};
use crate::graph::elem_types::TypeNames;
use crate::onnx::{GraphProto, NodeProto};

/// Initializers up to this many elements count as CPU-resident for GetCpuPreferredNodes.
const SMALL_INITIALIZER: i64 = 100;

/// ORT's `GetCpuPreferredNodes` (onnxruntime/core/framework/fallback_cpu_capability.cc) on the
/// graph as written: starting from the outputs GPU kernels keep in CPU memory (`Shape`, ...) and
/// the outputs of CPU-fallback nodes, a GPU-capable node moves to the CPU when every input is
/// such a CPU value, a graph input, or an initializer of at most 100 elements, no input is a
/// 16-bit or 8-bit float, and the kernel does not itself read that input from CPU memory.
pub(super) fn cpu_preferred_nodes(
    graph: &GraphProto,
    placed: &[Placement],
    types: &TypeNames,
) -> Vec<String> {
    let mut consumers: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, n) in graph.node.iter().enumerate() {
        for inp in n.input.iter().filter(|s| !s.is_empty()) {
            consumers.entry(inp.as_str()).or_default().push(i);
        }
    }
    let graph_inputs: HashSet<&str> = graph.input.iter().map(|v| v.name()).collect();
    let mut small_init: HashSet<&str> = graph
        .initializer
        .iter()
        .filter(|t| t.dims.iter().fold(1i64, |n, &d| n.saturating_mul(d)) <= SMALL_INITIALIZER)
        .map(|t| t.name())
        .collect();
    // Constant nodes are initializers by the time ORT partitions the graph
    for node in graph.node.iter().filter(|n| is_constant(n)) {
        if constant_size(node) <= SMALL_INITIALIZER {
            small_init.extend(node.output.first().map(String::as_str));
        }
    }
    let mut cpu_args: HashSet<&str> = HashSet::new();
    let mut candidates: BTreeSet<usize> = BTreeSet::new();
    for (i, (node, p)) in graph.node.iter().zip(placed).enumerate() {
        let _ = i;
        if let Placement::Gpu { kernel, .. } = p {
            for &o in &kernel.cpu_outputs {
                if let Some(out) = node.output.get(o).filter(|s| !s.is_empty()) {
                    cpu_args.insert(out);
                    candidates.extend(consumers.get(out.as_str()).into_iter().flatten());
                }
            }
        }
    }
    let mut visited: HashSet<usize> = HashSet::new();
    let mut cpu_nodes: BTreeSet<usize> = BTreeSet::new();
    while let Some(cur) = candidates.pop_first() {
        if !visited.insert(cur) {
            continue;
        }
        let node = &graph.node[cur];
        let Placement::Gpu { kernel, .. } = &placed[cur] else {
            if !matches!(placed[cur], Placement::Fallback { .. }) {
                continue; // inlined, not checked: where it runs is not known here
            }
            // a CPU node: its outputs are CPU values
            for out in node.output.iter().filter(|s| !s.is_empty()) {
                cpu_args.insert(out);
                candidates.extend(consumers.get(out.as_str()).into_iter().flatten());
            }
            continue;
        };
        let mut place_in_cpu = true;
        for (i, inp) in node.input.iter().enumerate() {
            let ty = types.get(inp);
            if matches!(
                ty,
                Some(
                    "float16"
                        | "bfloat16"
                        | "float8e4m3fn"
                        | "float8e4m3fnuz"
                        | "float8e5m2"
                        | "float8e5m2fnuz"
                )
            ) {
                place_in_cpu = false;
                break;
            }
            if small_init.contains(inp.as_str()) || graph_inputs.contains(inp.as_str()) {
                continue;
            }
            if !cpu_args.contains(inp.as_str()) || kernel.cpu_inputs.contains(&i) {
                place_in_cpu = false;
                break;
            }
        }
        if place_in_cpu {
            cpu_nodes.insert(cur);
            for out in node.output.iter().filter(|s| !s.is_empty()) {
                cpu_args.insert(out);
                candidates.extend(consumers.get(out.as_str()).into_iter().flatten());
            }
        }
    }
    cpu_nodes
        .into_iter()
        .map(|i| node_label(&graph.node[i], i))
        .collect()
}

/// Elements of a Constant's value.
fn constant_size(node: &NodeProto) -> i64 {
    node.attribute
        .iter()
        .map(|a| match a.name() {
            "value" => {
                a.t.as_ref()
                    .map_or(1, |t| t.dims.iter().fold(1i64, |n, &d| n.saturating_mul(d)))
            }
            "value_floats" => a.floats.len() as i64,
            "value_ints" => a.ints.len() as i64,
            "value_strings" => a.strings.len() as i64,
            _ => 1,
        })
        .next()
        .unwrap_or(1)
}

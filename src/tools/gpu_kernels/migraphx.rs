//! The MIGraphX execution provider (onnxruntime-migraphx 1.27.1) registers no kernels: its
//! `GetCapability` (`migraphx_execution_provider.cc`) takes a node when every input and output
//! has a supported element type (`IsTypeSupported`), the op's name is on its supported-op list
//! (any version, any domain), and, for default-domain ops, `IsUnsupportedOpMode` has no objection
//! (mostly: inputs MIGraphX needs as constants, such as Reshape's shape, must be computable from
//! initializers and `Shape` outputs alone). Then, over the graph: with more than 10 unsupported
//! nodes it takes nothing; otherwise the graph is cut at the unsupported nodes and a piece is
//! handed back unless it holds an RNN or a MatMul/Gemm/Conv/... with an input of more than 300
//! elements (`SubgraphPostProcessing`). All of that is modelled here, on the graph as written
//! (node order as the topological order, declared shapes only).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::OnceLock;

use super::matching::{bound_types, match_kernels, Missing, Placed, Placement};
use super::nodes::is_constant;
use super::tables::{Kernel, Tables, MIGRAPHX_OP_TABLE};
use crate::graph::elem_types::TypeNames;
use crate::onnx::{attr_i, attr_ints, attr_s, GraphProto, NodeProto};
use ntl_ops::schema::{canonical_domain, tsv_rows};

/// The file the rules come from.
pub const SOURCE: &str = "onnxruntime/core/providers/migraphx/migraphx_execution_provider.cc";

/// Added to every migraphx report.
pub const NOTE: &str = "migraphx: modelled on migraphx_execution_provider.cc of ORT 1.27 (supported-op list, element types, IsUnsupportedOpMode, no node taken when more than 10 are unsupported, SubgraphPostProcessing); node order is taken as the topological order and only declared shapes are known, and an op MIGraphX takes may still fail to compile (not checked)";

/// The ops `IsUnsupportedOpMode` has a rule for, each modelled by [`unsupported_mode`]. The
/// table's `mode_check` column must name exactly these (a test checks it).
pub const MODE_CHECKED: [&str; 21] = [
    "ArgMax",
    "ArgMin",
    "ConstantOfShape",
    "ConvInteger",
    "Expand",
    "MatMulInteger",
    "MaxPool",
    "NonZero",
    "OneHot",
    "Pad",
    "Range",
    "ReduceSum",
    "Reshape",
    "Resize",
    "Slice",
    "Split",
    "Squeeze",
    "Tile",
    "TopK",
    "Unsqueeze",
    "Upsample",
];

/// The parsed op table.
#[derive(Debug, Clone)]
pub struct Ops {
    /// op name -> `IsUnsupportedOpMode` has a rule for it
    pub ops: BTreeMap<String, bool>,
    /// element types `IsTypeSupported` accepts
    pub types: Vec<String>,
    /// more unsupported nodes than this and the provider takes none
    pub max_unsupported: usize,
    /// the header comment (version and commit)
    pub provenance: String,
}

impl Ops {
    pub fn parse(tsv: &str) -> Result<Ops, String> {
        let mut types = Vec::new();
        let mut max_unsupported = None;
        let mut provenance = Vec::new();
        for c in tsv.lines().filter_map(|l| l.strip_prefix('#')) {
            let c = c.trim();
            if let Some(t) = c.strip_prefix("types:") {
                types = t.trim().split(',').map(str::to_string).collect();
            } else if let Some(n) = c.strip_prefix("max_unsupported_nodes:") {
                max_unsupported = n.trim().parse().ok();
            } else {
                provenance.push(c.to_string());
            }
        }
        let mut ops = BTreeMap::new();
        for row in tsv_rows(tsv, "op\t", 2, "migraphx") {
            let (_, f) = row?;
            ops.insert(f[0].to_string(), f[1] == "y");
        }
        if ops.is_empty() || types.is_empty() {
            return Err("migraphx table: no ops or no types".into());
        }
        Ok(Ops {
            ops,
            types,
            max_unsupported: max_unsupported
                .ok_or("migraphx table: no max_unsupported_nodes line")?,
            provenance: provenance.join(" "),
        })
    }
}

/// The embedded op table (parsed on first use).
pub fn ops() -> &'static Ops {
    static OPS: OnceLock<Ops> = OnceLock::new();
    OPS.get_or_init(|| Ops::parse(MIGRAPHX_OP_TABLE).expect("embedded migraphx table parses"))
}

/// What the provider's rules need to know about the graph.
struct View<'a> {
    nodes: &'a [NodeProto],
    initializers: HashSet<&'a str>,
    inputs: HashSet<&'a str>,
    producer: HashMap<&'a str, usize>,
    /// declared shapes: `None` for a symbolic dimension
    shapes: HashMap<&'a str, Vec<Option<i64>>>,
}

impl<'a> View<'a> {
    fn new(graph: &'a GraphProto) -> View<'a> {
        let mut initializers: HashSet<&str> = graph.initializer.iter().map(|t| t.name()).collect();
        // Constant nodes are initializers by the time ORT partitions the graph
        for n in graph.node.iter().filter(|n| is_constant(n)) {
            initializers.extend(n.output.first().map(String::as_str));
        }
        let inputs = graph
            .input
            .iter()
            .map(|v| v.name())
            .filter(|n| !initializers.contains(n))
            .collect();
        let mut producer = HashMap::new();
        for (i, n) in graph.node.iter().enumerate() {
            if is_constant(n) {
                continue;
            }
            for o in n.output.iter().filter(|o| !o.is_empty()) {
                producer.insert(o.as_str(), i);
            }
        }
        let mut shapes = HashMap::new();
        for vi in graph
            .input
            .iter()
            .chain(&graph.output)
            .chain(&graph.value_info)
        {
            if let Some((_, Some(dims))) = crate::onnx::value_info_shape(vi) {
                shapes.insert(vi.name(), dims);
            }
        }
        for t in &graph.initializer {
            shapes.insert(t.name(), t.dims.iter().map(|&d| Some(d)).collect());
        }
        View {
            nodes: &graph.node,
            initializers,
            inputs,
            producer,
            shapes,
        }
    }

    /// `canEvalShapeGeneral`: node `n`'s value can be computed from initializers and `Shape`
    /// outputs alone; adds the nodes used to `used`. `memo` avoids revisiting.
    fn eval_node(
        &self,
        n: usize,
        used: &mut BTreeSet<usize>,
        memo: &mut HashMap<usize, bool>,
    ) -> bool {
        if let Some(&r) = memo.get(&n) {
            return r;
        }
        memo.insert(n, false); // a cycle (invalid graph) cannot be evaluated
        let node = &self.nodes[n];
        let ok = node.op_type() == "Shape"
            || node.input.iter().all(|inp| {
                if self.initializers.contains(inp.as_str()) {
                    return true;
                }
                if self.inputs.contains(inp.as_str()) {
                    return false;
                }
                match self.producer.get(inp.as_str()) {
                    None => false,
                    Some(&p) if self.nodes[p].op_type() == "Shape" => true,
                    Some(&p) => self.eval_node(p, used, memo),
                }
            });
        if ok {
            used.insert(n);
        }
        memo.insert(n, ok);
        ok
    }

    /// `canEvalNodeArgument`: the node's inputs at `indices` can be computed statically;
    /// adds the nodes used to `used`.
    fn eval_args(&self, node: &NodeProto, indices: &[usize], used: &mut BTreeSet<usize>) -> bool {
        let mut memo = HashMap::new();
        indices.iter().all(|&i| {
            let name = node.input.get(i).map_or("", String::as_str);
            if self.initializers.contains(name) {
                return true;
            }
            if self.inputs.contains(name) {
                return false;
            }
            match self.producer.get(name) {
                None => false,
                Some(&p) => self.eval_node(p, used, &mut memo),
            }
        })
    }

    fn constant(&self, node: &NodeProto, indices: &[usize]) -> bool {
        self.eval_args(node, indices, &mut BTreeSet::new())
    }

    fn elements_over(&self, name: &str, limit: u64) -> bool {
        self.shapes.get(name).is_some_and(|dims| {
            dims.iter()
                .map(|d| d.unwrap_or(1).max(0) as u64)
                .product::<u64>()
                > limit
        })
    }
}

/// `IsUnsupportedOpMode` for a default-domain node: why the provider refuses it, if it does.
fn unsupported_mode(v: &View, node: &NodeProto, types: &TypeNames) -> Option<String> {
    let n_in = node.input.len();
    let first_type = || node.input.first().and_then(|i| types.get(i));
    let not_const = |what: &str| {
        Some(format!(
            "{what} must be computable from initializers and Shape outputs (it is not)"
        ))
    };
    match node.op_type() {
        "ArgMax" | "ArgMin" => (attr_i(node, "select_last_index").unwrap_or(0) != 0)
            .then(|| "select_last_index=1 is not supported".to_string()),
        "ConstantOfShape" if !v.constant(node, &[0]) => not_const("the shape input"),
        "ConvInteger" | "MatMulInteger"
            if first_type().is_some_and(|t| t != "int8" && t != "uint8") =>
        {
            Some("only int8 and uint8 inputs are supported".into())
        }
        "Expand" if !v.constant(node, &[1]) => not_const("the shape input"),
        "MaxPool" => {
            if node.output.len() > 1 {
                Some("the Indices output is not supported".into())
            } else if attr_ints(node, "dilations").is_some_and(|d| d.iter().any(|&x| x != 1)) {
                Some("dilations other than 1 are not supported".into())
            } else if attr_i(node, "storage_order").unwrap_or(0) != 0 {
                Some("storage_order=1 is not supported".into())
            } else if first_type().is_some_and(|t| t == "int8" || t == "uint8") {
                Some("int8 and uint8 inputs are not supported".into())
            } else {
                None
            }
        }
        "NonZero" if !v.constant(node, &[0]) => not_const("the input"),
        "OneHot" if !v.constant(node, &[1]) => not_const("the depth input"),
        "Pad" => {
            let mode = attr_s(node, "mode").unwrap_or_else(|| "constant".into());
            if n_in >= 2 && !v.constant(node, &[1]) {
                not_const("the pads input")
            } else if mode != "constant" && mode != "reflect" {
                Some(format!(
                    "mode={mode} is not supported (constant and reflect are)"
                ))
            } else if mode == "constant" && n_in == 3 && !v.constant(node, &[2]) {
                not_const("the constant_value input")
            } else {
                None
            }
        }
        "Range" if !v.constant(node, &(0..n_in).collect::<Vec<_>>()) => not_const("every input"),
        "Reshape" if n_in == 2 && !v.constant(node, &[1]) => not_const("the shape input"),
        "Resize" | "Upsample" => {
            if attr_s(node, "coordinate_transformation_mode").as_deref()
                == Some("tf_crop_and_resize")
            {
                Some("coordinate_transformation_mode=tf_crop_and_resize is not supported".into())
            } else if attr_s(node, "mode").as_deref() == Some("cubic") {
                Some("mode=cubic is not supported".into())
            } else {
                None
            }
        }
        "ReduceSum" if n_in == 2 && !v.constant(node, &[1]) => not_const("the axes input"),
        "Slice" => {
            if !v.constant(node, &(1..n_in).collect::<Vec<_>>()) {
                return not_const("every input but the data");
            }
            let (starts, ends) = (attr_ints(node, "starts"), attr_ints(node, "ends"));
            match (starts, ends) {
                (Some(s), Some(e)) if s.iter().zip(&e).any(|(a, b)| a > b) => {
                    Some("a start beyond its end is not supported".into())
                }
                _ => None,
            }
        }
        "Split" => {
            let empty_1d = node
                .input
                .first()
                .and_then(|i| v.shapes.get(i.as_str()))
                .is_some_and(|d| d.len() == 1 && d[0].unwrap_or(0) == 0);
            if empty_1d {
                Some("a 1-D input of size 0 (or of symbolic size) is not supported".into())
            } else if n_in == 2 && !v.constant(node, &[1]) {
                not_const("the split input")
            } else {
                None
            }
        }
        "Tile" if !v.constant(node, &[1]) => not_const("the repeats input"),
        "TopK" if !v.constant(node, &[1]) => not_const("the K input"),
        "Squeeze" | "Unsqueeze" if n_in == 2 && !v.constant(node, &[1]) => {
            not_const("the axes input")
        }
        _ => None,
    }
}

/// `SubgraphPostProcessing`: whether the provider keeps a piece of the graph (node indices)
/// or hands it back to the CPU.
fn keeps_cluster(v: &View, cluster: &[usize]) -> bool {
    let members: HashSet<usize> = cluster.iter().copied().collect();
    for &i in cluster {
        let node = &v.nodes[i];
        if node.op_type() == "Reshape" && node.input.len() == 2 {
            let mut used = BTreeSet::new();
            if !v.eval_args(node, &[1], &mut used) || !used.iter().all(|u| members.contains(u)) {
                return false;
            }
        }
    }
    if cluster
        .iter()
        .any(|&i| matches!(v.nodes[i].op_type(), "RNN" | "GRU" | "LSTM"))
    {
        return true;
    }
    cluster.iter().any(|&i| {
        let node = &v.nodes[i];
        matches!(
            node.op_type(),
            "AveragePool" | "Conv" | "Gemm" | "LRN" | "MatMul" | "MaxPool"
        ) && node.input.iter().any(|inp| v.elements_over(inp, 300))
    })
}

fn claimed(version: Option<i64>) -> Kernel {
    Kernel {
        since: version.unwrap_or(0),
        end: version,
        class_type: None,
        constraints: Vec::new(),
        cpu_inputs: Vec::new(),
        cpu_outputs: Vec::new(),
        condition: None,
        source: SOURCE.to_string(),
    }
}

/// The placement of every top-level node of `graph` on the MIGraphX provider.
pub(super) fn place_graph(
    graph: &GraphProto,
    opsets: &HashMap<String, i64>,
    types: &TypeNames,
    tables: &Tables,
    ops: &Ops,
) -> Vec<Placed> {
    let v = View::new(graph);
    let mut out: Vec<Placed> = Vec::with_capacity(graph.node.len());
    // per node: None = taken, Some(why) = refused
    let mut refused: Vec<Option<Missing>> = Vec::with_capacity(graph.node.len());
    for node in &graph.node {
        let domain = canonical_domain(node.domain()).to_string();
        let op = node.op_type();
        let opset = opsets.get(&domain).copied();
        let version = opset.and_then(|o| tables.op_version(&domain, op, o));
        let schema = opset.and_then(|o| tables.schema(&domain, op, o));
        let bound = schema
            .map(|s| bound_types(node, s, types))
            .unwrap_or_default();
        if is_constant(node) {
            out.push((None, bound, Placement::Folded));
            refused.push(None);
            continue;
        }
        let bad_type = node
            .input
            .iter()
            .map(|n| ("input", n))
            .chain(node.output.iter().map(|n| ("output", n)))
            .filter(|(_, n)| !n.is_empty())
            .find_map(|(kind, n)| {
                types
                    .get(n)
                    .filter(|t| !ops.types.iter().any(|ok| ok == t))
                    .map(|t| (format!("{kind} {n}"), t.to_string()))
            });
        let why = if let Some((param, actual)) = bad_type {
            Some(Missing::Type {
                param,
                actual,
                accepted: ops.types.clone(),
            })
        } else if !ops.ops.contains_key(op) {
            Some(Missing::NoKernel)
        } else if domain == "ai.onnx" {
            unsupported_mode(&v, node, types)
                .map(|r| Missing::Refused(format!("migraphx: {op}: {r} (IsUnsupportedOpMode)")))
        } else {
            None
        };
        out.push((
            version,
            bound,
            Placement::Gpu {
                kernel: claimed(version),
                unchecked: Vec::new(),
            },
        ));
        refused.push(why);
    }
    let unsupported: Vec<usize> = (0..graph.node.len())
        .filter(|&i| refused[i].is_some())
        .collect();
    let count = unsupported.len();
    let mut handed_back: HashSet<usize> = HashSet::new();
    if count > ops.max_unsupported {
        handed_back.extend(
            (0..graph.node.len()).filter(|&i| refused[i].is_none() && !is_constant(&graph.node[i])),
        );
    } else if count > 0 {
        // the pieces between unsupported nodes (a final cut closes the last one)
        let mut cluster = Vec::new();
        let cuts = refused.iter().map(Option::is_some).chain([true]);
        for (i, cut) in cuts.enumerate() {
            if !cut {
                if !is_constant(&graph.node[i]) {
                    cluster.push(i);
                }
                continue;
            }
            if !cluster.is_empty() && !keeps_cluster(&v, &cluster) {
                handed_back.extend(cluster.iter().copied());
            }
            cluster.clear();
        }
    }
    for (i, node) in graph.node.iter().enumerate() {
        let why = match refused[i].take() {
            Some(why) => why,
            None if handed_back.contains(&i) => Missing::Refused(if count > ops.max_unsupported {
                format!("migraphx: {count} nodes of the graph are unsupported, more than {}, so the provider takes none (GetCapability)", ops.max_unsupported)
            } else {
                "migraphx: handed back with its partition, which holds no RNN and no MatMul/Gemm/Conv/pool/LRN with an input of more than 300 elements (SubgraphPostProcessing)".to_string()
            }),
            None => continue,
        };
        let (version, bound, _) = &out[i];
        let cpu_kernels = tables.kernels("cpu", node.domain(), node.op_type());
        let cpu = match version {
            Some(ver) => match_kernels(cpu_kernels, *ver, bound, true).is_ok(),
            None => !cpu_kernels.is_empty(),
        };
        out[i].2 = Placement::Fallback { why, cpu };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_op_table_parses() {
        assert!(ops().ops.contains_key("MatMul"));
    }
}

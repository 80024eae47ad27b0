//! Read-only questions about a graph: who produces and consumes a tensor, which names are
//! taken, and what static shape a tensor has where the graph says so.

use std::collections::HashSet;

use super::hash::{map_with_capacity, HashMap};
use super::names::NameIds;

use super::elem_types::ElemTypes;
use super::ranks::{self, Ranks};
use crate::onnx::{value_info_shape, GraphProto, NodeProto};

pub struct GraphIndex<'g> {
    pub graph: &'g GraphProto,
    /// The tensors the nodes read and write, numbered (`names.rs`: the tables below are
    /// plain vectors by that number, compact enough to stay in cache at a million nodes).
    tensors: NameIds<'g>,
    /// Per tensor the node writing it (`NO_NODE`: none).
    producer: Vec<u32>,
    /// Per tensor its readers: `readers[reader_start[t]..reader_start[t + 1]]`, in node order
    /// (a node once per input it reads the tensor as).
    reader_start: Vec<usize>,
    readers: Vec<usize>,
    /// Initializers and value infos (`value_info`, inputs, outputs) by name: walks back through
    /// a long chain ask at every step, so this is a map, not a search of the lists.
    declared: HashMap<&'g str, Declared<'g>>,
    /// Ranks inferred through the whole graph, computed on first use.
    ranks: std::cell::OnceCell<Ranks>,
    /// Element types followed forward through the whole graph, computed on first use.
    types: std::cell::OnceCell<ElemTypes>,
    /// What [`GraphIndex::elem_type_backward`] found past each node it walked through: a
    /// chain of type-keeping nodes is walked once, not once per question.
    /// Indexed by node (`None`: not walked yet), allocated on first use: a dense vector, as a
    /// walk can pass every node of the graph.
    backward_types: std::cell::RefCell<Vec<Option<Option<i32>>>>,
    /// For each Identity node [`GraphIndex::through_identities`] passed, the first node of its
    /// run (indexed by node, `usize::MAX`: not walked yet; allocated on first use).
    identity_runs: std::cell::RefCell<Vec<usize>>,
}

impl<'g> GraphIndex<'g> {
    pub fn new(graph: &'g GraphProto) -> Self {
        // sized once: growing the table of a million names renumbers every one several times
        let written = graph.node.iter().map(|n| n.output.len()).sum();
        let mut tensors = NameIds::with_capacity(written);
        let mut producer = Vec::with_capacity(written);
        // (tensor number, reading node) of each input read, in node order
        let mut reads = Vec::with_capacity(graph.node.iter().map(|n| n.input.len()).sum());
        for (i, node) in graph.node.iter().enumerate() {
            for inp in node.input.iter().filter(|i| !i.is_empty()) {
                reads.push((tensors.intern(inp) as u32, i));
            }
            for out in node.output.iter().filter(|o| !o.is_empty()) {
                let t = tensors.intern(out);
                producer.resize(tensors.len(), NO_NODE);
                producer[t] = i as u32;
            }
        }
        producer.resize(tensors.len(), NO_NODE);
        let (reader_start, readers) = readers_by_tensor(&reads, tensors.len());
        GraphIndex {
            graph,
            tensors,
            producer,
            reader_start,
            readers,
            declared: declarations(graph),
            ranks: std::cell::OnceCell::new(),
            types: std::cell::OnceCell::new(),
            backward_types: Default::default(),
            identity_runs: Default::default(),
        }
    }

    /// Ranks inferred forward through the graph (`super::ranks`), once per index.
    pub fn inferred_ranks(&self) -> &Ranks {
        self.ranks.get_or_init(|| Ranks::infer(self))
    }

    pub fn producer(&self, tensor: &str) -> Option<(usize, &'g NodeProto)> {
        let t = self.tensors.get(tensor)?;
        let i = self.producer[t];
        (i != NO_NODE).then(|| (i as usize, &self.graph.node[i as usize]))
    }

    pub fn consumers(&self, tensor: &str) -> &[usize] {
        self.tensors.get(tensor).map_or(&[], |t| {
            &self.readers[self.reader_start[t]..self.reader_start[t + 1]]
        })
    }

    pub fn is_graph_output(&self, tensor: &str) -> bool {
        self.graph.output.iter().any(|o| o.name() == tensor)
    }

    pub fn is_graph_input(&self, tensor: &str) -> bool {
        self.graph.input.iter().any(|o| o.name() == tensor)
    }

    /// The names in use that a [`ntl_ops::Builder`] under `prefix` could collide with: every
    /// name under `prefix/` (all that its `fresh` makes) and those of `claims` (the exact names
    /// outside the prefix it will `claim`). Names are node names and tensor names (inputs,
    /// outputs, initializers, value infos, node inputs and outputs), subgraphs' included. A copy
    /// of every name would cost one string per tensor; this set holds the few that matter.
    pub fn taken_names(&self, prefix: &str, claims: &[&str]) -> HashSet<String> {
        let under = format!("{prefix}/");
        let mut names = HashSet::new();
        let mut take = |name: &str| {
            if name.starts_with(&under) || claims.contains(&name) {
                names.insert(name.to_string());
            }
        };
        let g = self.graph;
        for n in &g.node {
            take(n.name());
            n.output.iter().chain(&n.input).for_each(|t| take(t));
        }
        let declared = g.input.iter().chain(&g.output).chain(&g.value_info);
        declared.for_each(|v| take(v.name()));
        g.initializer.iter().for_each(|t| take(t.name()));
        g.sparse_initializer
            .iter()
            .flat_map(|s| s.values.iter().chain(s.indices.iter()))
            .for_each(|t| take(t.name()));
        // names inside subgraphs (If/Loop/Scan bodies) too: a new name must not shadow one
        let mut stack: Vec<&GraphProto> = g
            .node
            .iter()
            .flat_map(|n| n.attribute.iter())
            .flat_map(|a| a.g.iter().chain(a.graphs.iter()))
            .collect();
        while let Some(sub) = stack.pop() {
            for n in &sub.node {
                take(n.name());
                n.output.iter().for_each(|t| take(t));
                for a in &n.attribute {
                    stack.extend(a.g.iter().chain(a.graphs.iter()));
                }
            }
            sub.input.iter().for_each(|v| take(v.name()));
            sub.initializer.iter().for_each(|t| take(t.name()));
        }
        names
    }

    fn declared(&self, tensor: &str) -> Option<Declared<'g>> {
        self.declared.get(tensor).copied()
    }

    /// Declared element type and dims of a tensor (value_info, inputs, outputs, initializers).
    pub fn declared_shape(&self, tensor: &str) -> Option<(Option<i32>, Vec<Option<i64>>)> {
        match self.declared(tensor)? {
            Declared::Initializer(init) => Some((
                Some(init.data_type()),
                init.dims.iter().map(|&d| Some(d)).collect(),
            )),
            Declared::Info(vi) => {
                let (elem, dims) = value_info_shape(vi)?;
                Some((Some(elem).filter(|&e| e != 0), dims?))
            }
        }
    }

    /// Element type of a tensor where the graph declares it, or where it follows from the
    /// producers before it.
    pub fn elem_type(&self, tensor: &str) -> Option<i32> {
        self.elem_type_backward(tensor)
            // an op the walk does not know (Gather of an embedding, LayerNorm...): follow the
            // types forward from the initializers and inputs
            .or_else(|| {
                self.types
                    .get_or_init(|| ElemTypes::infer(self.graph))
                    .get(tensor)
            })
    }

    /// The start of the run of Identity nodes that ends in `tensor`: back through Identity
    /// nodes while the tensor is not declared, to the first tensor that is declared or not
    /// written by an Identity (`tensor` itself if it is). The walks back (element types,
    /// static dims, static ranks) pass Identity nodes alike and ask of the same chains, so a
    /// run is walked once: each Identity node passed remembers where its run starts.
    fn through_identities<'a>(&'a self, tensor: &'a str) -> &'a str {
        let mut runs = self.identity_runs.borrow_mut();
        let mut passed = Vec::new();
        let mut tensor = tensor;
        let mut first = None;
        for _ in 0..=self.graph.node.len() {
            if self.declared.contains_key(tensor) {
                break;
            }
            let Some((i, node)) = self.producer(tensor) else {
                break;
            };
            let Some(input) = node.input.first().filter(|t| !t.is_empty()) else {
                break;
            };
            if node.op_type() != "Identity" {
                break;
            }
            if let Some(&known) = runs.get(i).filter(|&&k| k != usize::MAX) {
                first = Some(known);
                tensor = &self.graph.node[known].input[0];
                break;
            }
            passed.push(i);
            first = Some(i);
            tensor = input;
        }
        if let Some(first) = first.filter(|_| !passed.is_empty()) {
            if runs.is_empty() {
                runs.resize(self.graph.node.len(), usize::MAX);
            }
            for i in passed {
                runs[i] = first;
            }
        }
        tensor
    }

    /// Back through producers that keep their input's type, to a declared type.
    fn elem_type_backward(&self, tensor: &str) -> Option<i32> {
        // every tensor on the way has the answer of the walk's end
        let mut walked = Vec::new();
        let found = self.walk_types_back(tensor, &mut walked);
        let mut memo = self.backward_types.borrow_mut();
        if memo.is_empty() && !walked.is_empty() {
            memo.resize(self.graph.node.len(), None);
        }
        for i in walked {
            memo[i] = Some(found);
        }
        found
    }

    fn walk_types_back(&self, tensor: &str, walked: &mut Vec<usize>) -> Option<i32> {
        // iterative, and bounded: a chain of type-keeping nodes can be as long as the graph
        let mut tensor = tensor;
        for _ in 0..=self.graph.node.len() {
            tensor = self.through_identities(tensor);
            if let Some((Some(t), _)) = self.declared_shape(tensor) {
                return Some(t);
            }
            let (i, node) = self.producer(tensor)?;
            if let Some(&Some(found)) = self.backward_types.borrow().get(i) {
                return found;
            }
            walked.push(i);
            let keeps_type = matches!(
                node.op_type(),
                "Reshape"
                    | "Transpose"
                    | "Add"
                    | "MatMul"
                    | "Gemm"
                    | "LogSoftmax"
                    | "Softmax"
                    | "Identity"
                    | "Squeeze"
                    | "Unsqueeze"
                    | "Flatten"
            );
            if !keeps_type {
                return None;
            }
            tensor = node.input.first().filter(|i| !i.is_empty())?;
        }
        None
    }

    /// The size of the last axis of `tensor`, where the graph fixes it: declared shapes,
    /// a constant Reshape target, or a weight matrix of the MatMul/Gemm that produced it.
    pub fn static_last_dim(&self, tensor: &str) -> Option<i64> {
        self.static_dim(tensor, -1, 0)
    }

    /// The size of axis `axis` (negative counts from the end) of `tensor`.
    pub fn static_dim(&self, tensor: &str, axis: i64, depth: usize) -> Option<i64> {
        if depth > 32 {
            return None;
        }
        // back through ops that keep their input's shape in a loop, not counted as depth: a
        // chain of them can be as long as the graph
        let mut tensor = tensor;
        let mut steps = 0;
        let node = loop {
            tensor = self.through_identities(tensor);
            if let Some((_, dims)) = self.declared_shape(tensor) {
                let i = normalize_axis(axis, dims.len())?;
                // a declared size below 1 (malformed, or -1 for "unknown") tells nothing
                if let Some(d) = dims[i].filter(|&d| d > 0) {
                    return Some(d);
                }
            }
            let (_, node) = self.producer(tensor)?;
            let keeps_shape = matches!(
                node.op_type(),
                "Identity"
                    | "Cast"
                    | "LogSoftmax"
                    | "Softmax"
                    | "Relu"
                    | "Dropout"
                    | "Tanh"
                    | "Sigmoid"
                    | "Gelu"
                    | "Erf"
                    | "Neg"
                    | "Exp"
                    | "Log"
                    | "Abs"
                    | "Sqrt"
            );
            if !keeps_shape || steps > self.graph.node.len() {
                break node;
            }
            tensor = node
                .input
                .first()
                .map(String::as_str)
                .filter(|s| !s.is_empty())?;
            steps += 1;
        };
        let input = |k: usize| {
            node.input
                .get(k)
                .map(String::as_str)
                .filter(|s| !s.is_empty())
        };
        match node.op_type() {
            "Add" | "Sub" | "Mul" | "Div" if axis == -1 => input(0)
                .and_then(|a| self.static_dim(a, -1, depth + 1).filter(|&d| d > 1))
                .or_else(|| input(1).and_then(|b| self.static_dim(b, -1, depth + 1))),
            "MatMul" if axis == -1 => self.static_dim(input(1)?, -1, depth + 1),
            "Gemm" if axis == -1 => {
                let trans_b = crate::onnx::attr_i(node, "transB").unwrap_or(0) != 0;
                self.static_dim(input(1)?, if trans_b { 0 } else { 1 }, depth + 1)
            }
            "Transpose" => {
                let perm = crate::onnx::attr_ints(node, "perm")?;
                let i = normalize_axis(axis, perm.len())?;
                self.static_dim(input(0)?, perm[i], depth + 1)
            }
            "Reshape" => match self.constant_i64(input(1)?) {
                Some(shape) => {
                    let i = normalize_axis(axis, shape.len())?;
                    Some(shape[i]).filter(|&d| d > 0)
                }
                None if axis == -1 => self.last_shape_entry(input(1)?, depth + 1),
                None => None,
            },
            _ => None,
        }
    }

    /// The last entry of a run-time shape vector whose tail is constant: tf2onnx's Dense
    /// reshapes to `Concat(Gather(Shape(x), free), [V])`, possibly cast.
    fn last_shape_entry(&self, shape: &str, depth: usize) -> Option<i64> {
        if depth > 32 {
            return None;
        }
        if let Some(t) = self.constant_tensor(shape) {
            return last_int(t).filter(|&d| d > 0);
        }
        let (_, node) = self.producer(shape)?;
        let first = node.input.first()?;
        match node.op_type() {
            "Cast" | "Identity" => self.last_shape_entry(first, depth + 1),
            "Concat" => self.last_shape_entry(node.input.last()?, depth + 1),
            _ => None,
        }
    }

    /// The tensor holding a constant: an initializer, or a Constant node's `value` (its
    /// payload is not read here).
    pub fn constant_tensor(&self, tensor: &str) -> Option<&'g crate::onnx::TensorProto> {
        if let Some(Declared::Initializer(t)) = self.declared(tensor) {
            return Some(t);
        }
        let (_, node) = self.producer(tensor)?;
        if node.op_type() != "Constant" {
            return None;
        }
        crate::onnx::attr(node, "value")?.t.as_ref()
    }

    /// A `Constant(value_ints=…)` or `Constant(value_int=…)`'s values (the dynamo exporter
    /// writes small int64 constants so; a list in the node itself, never a weight).
    fn constant_ints_attr(&self, tensor: &str) -> Option<Vec<i64>> {
        let (_, node) = self.producer(tensor)?;
        if node.op_type() != "Constant" {
            return None;
        }
        let a = node.attribute.first()?;
        match a.name() {
            "value_ints" => Some(a.ints.clone()),
            "value_int" => Some(vec![a.i()]),
            _ => None,
        }
    }

    /// Whether `tensor` (empty: absent) is a constant of one value, zero (0.0, false).
    pub fn is_zero_constant(&self, tensor: &str) -> bool {
        if tensor.is_empty() {
            return false;
        }
        if let Some((_, n)) = self
            .producer(tensor)
            .filter(|(_, n)| n.op_type() == "Constant")
        {
            match n.attribute.first().map(|a| (a.name(), a)) {
                Some(("value_float", a)) => return a.f() == 0.0,
                Some(("value_int", a)) => return a.i() == 0,
                _ => {}
            }
        }
        self.constant_tensor(tensor).is_some_and(one_zero)
    }

    /// Whether a `Dropout` passes its input through: not in training mode (no `training_mode`
    /// input, or a constant false) or a constant ratio of 0, as exporters write it for models
    /// without dropout.
    pub fn dropout_passes_through(&self, node: &NodeProto) -> bool {
        let input = |i: usize| node.input.get(i).map_or("", String::as_str);
        input(2).is_empty() || self.is_zero_constant(input(2)) || self.is_zero_constant(input(1))
    }

    /// The values of a small constant int64 tensor (an initializer or a Constant node), such as
    /// a Reshape target. Larger tensors are not read: weights are never touched.
    pub fn constant_i64(&self, tensor: &str) -> Option<Vec<i64>> {
        if let Some(ints) = self.constant_ints_attr(tensor) {
            return Some(ints);
        }
        let t = self.constant_tensor(tensor)?;
        let count = t
            .dims
            .iter()
            .try_fold(1i64, |n, &d| (d >= 0).then(|| n.checked_mul(d)).flatten());
        if t.data_type() != crate::onnx::INT64 || count.is_none_or(|n| n > 16) {
            return None;
        }
        if !t.int64_data.is_empty() {
            return Some(t.int64_data.clone());
        }
        let raw = t.raw_data.as_ref()?;
        Some(
            raw.chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
        )
    }
}

/// What the graph declares each tensor to be: its initializer, else its first value info
/// (`value_info`, then inputs, then outputs).
fn declarations(g: &GraphProto) -> HashMap<&str, Declared<'_>> {
    let infos = g.value_info.len() + g.input.len() + g.output.len();
    let mut map = map_with_capacity(g.initializer.len() + infos);
    for t in &g.initializer {
        map.entry(t.name()).or_insert(Declared::Initializer(t));
    }
    for v in g.value_info.iter().chain(&g.input).chain(&g.output) {
        map.entry(v.name()).or_insert(Declared::Info(v));
    }
    map
}

/// A declaration of a tensor: an initializer or a value info.
#[derive(Clone, Copy)]
enum Declared<'g> {
    Initializer(&'g crate::onnx::TensorProto),
    Info(&'g crate::onnx::ValueInfoProto),
}

/// No node writes the tensor.
const NO_NODE: u32 = u32::MAX;

/// The readers of each of `count` tensors in one vector, tensor by tensor in node order
/// (`reads`: the tensor number and reading node of every non-empty input, in node order).
fn readers_by_tensor(reads: &[(u32, usize)], count: usize) -> (Vec<usize>, Vec<usize>) {
    let mut start = vec![0usize; count + 1];
    for &(t, _) in reads {
        start[t as usize + 1] += 1;
    }
    for t in 0..count {
        start[t + 1] += start[t];
    }
    let mut next = start[..count].to_vec();
    let mut readers = vec![0usize; reads.len()];
    for &(t, node) in reads {
        readers[next[t as usize]] = node;
        next[t as usize] += 1;
    }
    (start, readers)
}

/// The last value of a small int64 or int32 constant (tf2onnx builds shapes in int32).
fn last_int(t: &crate::onnx::TensorProto) -> Option<i64> {
    let raw = t.raw_data.as_deref().unwrap_or(&[]);
    match t.data_type() {
        crate::onnx::INT64 if raw.is_empty() => t.int64_data.last().copied(),
        crate::onnx::INT64 => raw
            .rchunks_exact(8)
            .next()
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))),
        crate::onnx::INT32 if raw.is_empty() => t.int32_data.last().map(|&v| v as i64),
        crate::onnx::INT32 => raw
            .rchunks_exact(4)
            .next()
            .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64),
        _ => None,
    }
}

impl ranks::Lookup for GraphIndex<'_> {
    fn graph(&self) -> &GraphProto {
        self.graph
    }
    fn producer(&self, tensor: &str) -> Option<(usize, &NodeProto)> {
        GraphIndex::producer(self, tensor)
    }
    fn constant_i64(&self, tensor: &str) -> Option<Vec<i64>> {
        GraphIndex::constant_i64(self, tensor)
    }
}

/// A constant of one value, zero (0.0, false).
fn one_zero(t: &crate::onnx::TensorProto) -> bool {
    if t.dims.iter().product::<i64>() != 1 {
        return false;
    }
    t.float_data.iter().all(|&v| v == 0.0)
        && t.int32_data.iter().all(|&v| v == 0)
        && t.int64_data.iter().all(|&v| v == 0)
        && t.double_data.iter().all(|&v| v == 0.0)
        && t.raw_data().iter().all(|&b| b == 0)
}

/// A `Constant` node's dims, whichever form holds its value: the tensor `value`'s, `[n]` for a
/// list (`value_ints`, `value_floats`, `value_strings`: the dynamo exporter's small constants),
/// `[]` for one number or string.
pub fn constant_dims(node: &NodeProto) -> Option<Vec<i64>> {
    let a = node.attribute.first()?;
    match a.name() {
        "value" => a.t.as_ref().map(|t| t.dims.clone()),
        "value_ints" => Some(vec![a.ints.len() as i64]),
        "value_floats" => Some(vec![a.floats.len() as i64]),
        "value_strings" => Some(vec![a.strings.len() as i64]),
        "value_int" | "value_float" | "value_string" => Some(vec![]),
        _ => None,
    }
}

pub fn normalize_axis(axis: i64, rank: usize) -> Option<usize> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    (0..r).contains(&a).then_some(a as usize)
}

/// The rank of a tensor where the graph fixes it: declared, or inferred through the graph
/// (`super::ranks`, which follows reshapes to run-time shapes).
pub fn static_rank(index: &GraphIndex, tensor: &str) -> Option<usize> {
    fixed_rank(index, tensor).or_else(|| index.inferred_ranks().get(tensor))
}

/// The rank a declaration, a constant Reshape target or a Transpose fixes, found back through
/// rank-keeping ops in a loop (a chain of them can be as long as the graph), without inferring
/// the ranks of the whole graph.
fn fixed_rank(index: &GraphIndex, tensor: &str) -> Option<usize> {
    let mut tensor = tensor;
    for _ in 0..=index.graph.node.len() {
        tensor = index.through_identities(tensor);
        if let Some((_, dims)) = index.declared_shape(tensor) {
            return Some(dims.len());
        }
        let (_, node) = index.producer(tensor)?;
        match node.op_type() {
            "Reshape" => return index.constant_i64(node.input.get(1)?).map(|s| s.len()),
            "Transpose" => return crate::onnx::attr_ints(node, "perm").map(|p| p.len()),
            "Identity" | "Cast" | "LogSoftmax" | "Softmax" | "Relu" | "Dropout" => {
                tensor = node.input.first()?;
            }
            _ => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x -> t0 -> t1 -> ... -> t{n-1}`, node i of op `op(i)`.
    fn chain(n: usize, op: impl Fn(usize) -> &'static str) -> Vec<NodeProto> {
        (0..n)
            .map(|i| NodeProto {
                op_type: Some(op(i).into()),
                input: vec![if i == 0 {
                    "x".into()
                } else {
                    format!("t{}", i - 1)
                }],
                output: vec![format!("t{i}")],
                ..Default::default()
            })
            .collect()
    }

    /// Taken names: those under the prefix (subgraphs' included) and the claimed exact names
    /// the graph uses, nothing else.
    #[test]
    fn taken_names_are_the_prefixed_and_the_claimed() {
        use crate::onnx::proto::{attribute_proto::AttributeType, AttributeProto};
        let body = GraphProto {
            node: vec![NodeProto {
                output: vec!["ntl/inner".into(), "inner".into()],
                ..Default::default()
            }],
            ..Default::default()
        };
        let graph = GraphProto {
            node: vec![NodeProto {
                name: Some("ntl/node".into()),
                input: vec!["x".into(), "ntlx".into()],
                output: vec!["ce_loss".into(), "number".into()],
                attribute: vec![AttributeProto {
                    name: Some("body".into()),
                    r#type: Some(AttributeType::Graph as i32),
                    g: Some(body),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            initializer: vec![crate::onnx::i64_tensor("ntl/w", &[1], &[1])],
            ..Default::default()
        };
        let index = GraphIndex::new(&graph);
        let mut taken: Vec<String> = index
            .taken_names("ntl", &["ce_loss", "labels"])
            .into_iter()
            .collect();
        taken.sort();
        assert_eq!(taken, ["ce_loss", "ntl/inner", "ntl/node", "ntl/w"]);
    }

    /// A run of Identity nodes is jumped over to its start, which is the first declared tensor
    /// on the way back (a declaration inside a chain stops the jump), and a long chain's rank
    /// is found from the Reshape before it without inferring the whole graph's ranks.
    #[test]
    fn identity_runs_stop_at_declarations() {
        let n = 1000;
        let mut node = chain(n, |i| if i == 0 { "Reshape" } else { "Identity" });
        node[0].input.push("target".into());
        let graph = GraphProto {
            node,
            initializer: vec![crate::onnx::i64_tensor("target", &[3], &[2, -1, 48])],
            value_info: vec![crate::onnx::ValueInfoProto {
                name: Some("t500".into()),
                ..Default::default()
            }],
            ..Default::default()
        };
        let index = GraphIndex::new(&graph);
        let last = format!("t{}", n - 1);
        assert_eq!(index.through_identities(&last), "t500");
        assert_eq!(index.through_identities("t700"), "t500");
        assert_eq!(index.through_identities("t500"), "t500");
        assert_eq!(index.through_identities("t400"), "t0");
        assert_eq!(static_rank(&index, &last), Some(3));
        assert_eq!(index.static_last_dim(&last), Some(48));
        assert!(index.ranks.get().is_none(), "no whole-graph rank inference");
    }

    /// `Constant(value_ints=…)` (the dynamo exporter's small constants) is read as its values:
    /// a Slice of a shape with such bounds has a known length, so the Reshape it builds has a
    /// known rank (the dynamo export of SDPA builds its key reshape so).
    #[test]
    fn value_ints_constants_bound_slices_of_shapes() {
        use crate::graph::test_node as node;
        use crate::onnx::{int_attr, ints_attr};
        let graph = GraphProto {
            node: vec![
                node("Reshape", &["x", "four"], "x4", vec![]),
                node("Shape", &["x4"], "shape", vec![int_attr("start", 0)]),
                node(
                    "Constant",
                    &[],
                    "lo",
                    vec![ints_attr("value_ints", &[i64::MIN])],
                ),
                node("Constant", &[], "hi", vec![ints_attr("value_ints", &[-2])]),
                node(
                    "Constant",
                    &[],
                    "minus_one",
                    vec![ints_attr("value_ints", &[-1])],
                ),
                node("Constant", &[], "one", vec![int_attr("value_int", 1)]),
                node("Slice", &["shape", "lo", "hi"], "lead", vec![]),
                node(
                    "Concat",
                    &["lead", "minus_one"],
                    "target",
                    vec![int_attr("axis", 0)],
                ),
                node("Reshape", &["x4", "target"], "y", vec![]),
            ],
            initializer: vec![crate::onnx::i64_tensor("four", &[4], &[2, 3, 4, 5])],
            ..Default::default()
        };
        let index = GraphIndex::new(&graph);
        assert_eq!(index.constant_i64("lo"), Some(vec![i64::MIN]));
        assert_eq!(index.constant_i64("one"), Some(vec![1]));
        let ranks = Ranks::infer(&index);
        assert_eq!(ranks.len1d("lead"), Some(2));
        assert_eq!(ranks.get("y"), Some(3));
        assert_eq!((ranks.get("one"), ranks.get("lo")), (Some(0), Some(1)));
        assert!(!index.is_zero_constant("one"));
    }

    /// A Dropout's ratio or training flag written as `Constant(value_float=0.0)` /
    /// `Constant(value_int=0)` passes its input through.
    #[test]
    fn scalar_attribute_constants_of_zero_are_zero() {
        use crate::onnx::{float_attr, int_attr};
        let constant = |out: &str, a| NodeProto {
            op_type: Some("Constant".into()),
            output: vec![out.into()],
            attribute: vec![a],
            ..Default::default()
        };
        let graph = GraphProto {
            node: vec![
                constant("ratio", float_attr("value_float", 0.0)),
                constant("half", float_attr("value_float", 0.5)),
                constant("off", int_attr("value_int", 0)),
            ],
            ..Default::default()
        };
        let index = GraphIndex::new(&graph);
        assert!(index.is_zero_constant("ratio") && index.is_zero_constant("off"));
        assert!(!index.is_zero_constant("half"));
    }

    /// The element type of every tensor of a long Identity chain, asked one by one, costs one
    /// walk in all: each walk back stops where an earlier one passed (quadratic before).
    #[test]
    fn element_types_along_a_chain_are_walked_once() {
        let n = 20_000;
        let graph = GraphProto {
            node: chain(n, |_| "Identity"),
            ..Default::default()
        };
        let index = GraphIndex::new(&graph);
        let started = std::time::Instant::now();
        for i in (0..n).rev() {
            assert_eq!(index.elem_type_backward(&format!("t{i}")), None);
        }
        let took = started.elapsed();
        assert!(took < std::time::Duration::from_secs(5), "{took:?}");
    }

    /// A width declared before a chain of shape-keeping nodes longer than the recursion depth
    /// is still found statically (no whole-graph shape inference needed).
    #[test]
    fn static_dims_pass_long_shape_keeping_chains() {
        use crate::onnx::proto::tensor_shape_proto::{dimension, Dimension};
        use crate::onnx::proto::{type_proto, TensorShapeProto, TypeProto};
        let n = 1000;
        let dims = [2, 48].map(|d| Dimension {
            value: Some(dimension::Value::DimValue(d)),
            ..Default::default()
        });
        let graph = GraphProto {
            node: chain(n, |i| if i % 2 == 0 { "Identity" } else { "Relu" }),
            input: vec![crate::onnx::ValueInfoProto {
                name: Some("x".into()),
                r#type: Some(TypeProto {
                    value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                        elem_type: Some(1),
                        shape: Some(TensorShapeProto { dim: dims.to_vec() }),
                    })),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        };
        let index = GraphIndex::new(&graph);
        assert_eq!(index.static_last_dim(&format!("t{}", n - 1)), Some(48));
        assert_eq!(index.static_dim(&format!("t{}", n - 1), 0, 0), Some(2));
    }
}

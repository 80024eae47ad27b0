//! The inputs a validation run feeds: which graph inputs need values, which of them carries
//! the labels, and deterministic values for them (from a seed), so every branch of the loss is
//! exercised: number labels, other labels and the ignore index.

use std::collections::{BTreeSet, HashMap, HashSet};

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::Error;
use crate::graph::GraphIndex;
use crate::onnx::proto::tensor_proto::DataType;
use crate::onnx::{value_info_shape, GraphProto};
use crate::tools::validate::tensor::{Data, HostTensor};
use crate::vocab::number_table::NumberTable;

/// A graph input that needs a value (not backed by an initializer).
#[derive(Debug, Clone)]
pub struct InputSpec {
    pub name: String,
    pub elem_type: i32,
    /// Declared dims; None where symbolic.
    pub dims: Vec<Option<i64>>,
    /// The symbolic dims' names (`dim_param`), where declared.
    pub dim_names: Vec<Option<String>>,
    /// For integer inputs: the fewest rows of a table the graph gathers with them (an
    /// embedding), so generated ids stay inside it whatever the class width.
    pub index_rows: Option<usize>,
    /// Sizes the graph pins for symbolic axes (the last axis of a `MatMul`'s left operand is
    /// its static right operand's rows), by axis.
    pub pinned: Vec<Option<usize>>,
}

/// The sizes the graph pins for `input`'s axes: where it (directly or through Cast/Identity/
/// unary ops that keep the shape) is the left operand of a `MatMul` whose right operand is an
/// initializer, its last axis has the initializer's rows.
fn pinned_dims(graph: &GraphProto, input: &str, rank: usize) -> Vec<Option<usize>> {
    let rows: HashMap<&str, usize> = graph
        .initializer
        .iter()
        .filter(|t| t.dims.len() >= 2)
        .filter_map(|t| Some((t.name(), usize::try_from(t.dims[t.dims.len() - 2]).ok()?)))
        .collect();
    let mut pinned = vec![None; rank];
    let mut names: HashSet<&str> = HashSet::from([input]);
    for n in &graph.node {
        let reads0 = n.input.first().is_some_and(|i| names.contains(i.as_str()));
        match n.op_type() {
            "MatMul" if reads0 && rank > 0 => {
                if let Some(&r) = n.input.get(1).and_then(|b| rows.get(b.as_str())) {
                    pinned[rank - 1].get_or_insert(r);
                }
            }
            "Cast" | "Identity" | "Neg" | "Relu" | "Tanh" | "Sigmoid" | "Exp" | "Log" if reads0 => {
                names.extend(n.output.iter().map(String::as_str));
            }
            _ => {}
        }
    }
    pinned
}

/// The fewest rows (axis-0 size) among the initializer tables `Gather` reads with `input` as
/// its indices, directly or through shape-only ops (Cast, Identity, Reshape, (Un)squeeze,
/// Flatten): None where no such table is known.
fn gathered_rows(graph: &GraphProto, input: &str) -> Option<usize> {
    let rows: HashMap<&str, usize> = graph
        .initializer
        .iter()
        .filter_map(|t| Some((t.name(), usize::try_from(*t.dims.first()?).ok()?)))
        .collect();
    let mut names: HashSet<&str> = HashSet::from([input]);
    let mut fewest: Option<usize> = None;
    // one pass in node order: a graph is topologically sorted (checked on load)
    for n in &graph.node {
        let reads = |k: usize| n.input.get(k).is_some_and(|i| names.contains(i.as_str()));
        match n.op_type() {
            "Gather" if n.domain().is_empty() && reads(1) => {
                let axis0 = crate::onnx::attr_i(n, "axis").unwrap_or(0) == 0;
                if let Some(&r) = n
                    .input
                    .first()
                    .and_then(|t| rows.get(t.as_str()))
                    .filter(|_| axis0)
                {
                    fewest = Some(fewest.map_or(r, |f| f.min(r)));
                }
            }
            "Cast" | "Identity" | "Reshape" | "Squeeze" | "Unsqueeze" | "Flatten" if reads(0) => {
                names.extend(n.output.iter().map(String::as_str));
            }
            _ => {}
        }
    }
    fewest
}

/// The `dim_param` names of a value's declared dims (None where fixed or unnamed).
fn dim_names(vi: &crate::onnx::ValueInfoProto) -> Vec<Option<String>> {
    use crate::onnx::proto::tensor_shape_proto::dimension;
    use crate::onnx::proto::type_proto;
    let Some(type_proto::Value::TensorType(t)) = vi.r#type.as_ref().and_then(|t| t.value.as_ref())
    else {
        return Vec::new();
    };
    t.shape
        .iter()
        .flat_map(|s| &s.dim)
        .map(|d| match &d.value {
            Some(dimension::Value::DimParam(p)) if !p.is_empty() => Some(p.clone()),
            _ => None,
        })
        .collect()
}

pub fn feedable_inputs(graph: &GraphProto) -> Result<Vec<InputSpec>, Error> {
    let initialized: HashSet<&str> = graph.initializer.iter().map(|t| t.name()).collect();
    graph
        .input
        .iter()
        .filter(|vi| !initialized.contains(vi.name()))
        .map(|vi| {
            let no_type = || {
                Error::Validation(format!(
                    "graph input '{}' declares no tensor type and rank; pass its values with --reference DIR",
                    vi.name()
                ))
            };
            let (elem_type, dims) = value_info_shape(vi).ok_or_else(no_type)?;
            let dims = dims.ok_or_else(no_type)?;
            Ok(InputSpec {
                name: vi.name().to_string(),
                elem_type,
                pinned: pinned_dims(graph, vi.name(), dims.len()),
                dims,
                dim_names: dim_names(vi),
                index_rows: gathered_rows(graph, vi.name()),
            })
        })
        .collect()
}

/// The graph input the cross-entropy's labels are computed from (e.g. through Reshape): walks
/// producers back from `labels`, breadth first, and takes the first integer graph input.
pub fn labels_source(graph: &GraphProto, labels: &str) -> Option<String> {
    let index = GraphIndex::new(graph);
    let initialized: HashSet<&str> = graph.initializer.iter().map(|t| t.name()).collect();
    let mut queue = std::collections::VecDeque::from([labels.to_string()]);
    let mut seen = BTreeSet::new();
    while let Some(t) = queue.pop_front() {
        if !seen.insert(t.clone()) || initialized.contains(t.as_str()) {
            continue;
        }
        if let Some(vi) = graph.input.iter().find(|vi| vi.name() == t) {
            if value_info_shape(vi).is_some_and(|(e, _)| is_int(e)) {
                return Some(t);
            }
            continue;
        }
        if let Some((_, node)) = index.producer(&t) {
            queue.extend(node.input.iter().filter(|i| !i.is_empty()).cloned());
        }
    }
    None
}

/// What the generator needs to know about the labels.
pub struct LabelPlan<'a> {
    pub input: &'a str,
    pub table: &'a NumberTable,
    pub ignore_index: Option<i64>,
    pub style: LabelStyle,
}

/// How labels are drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LabelStyle {
    /// Each position on its own: number ids, other ids, the ignore index (the NTL losses).
    Tokens,
    /// Along the last axis (a sequence): runs of digits of several lengths (multi-digit
    /// numbers), sometimes joined by `dot` (`"."`, decimals), between other ids and the ignore
    /// index (the per-sequence losses; the table's numbers are the ten digits).
    DigitRuns { dot: Option<i64> },
}

pub struct Shape {
    pub batch: usize,
    pub seq: usize,
    /// The cross-entropy's class axis: an input dim that is it (logits fed as an input) gets
    /// the logits' width.
    pub class: Option<ClassDim>,
}

/// The class axis of the scores, and the logits' width (`--vocab-size` where the graph
/// leaves it symbolic).
pub struct ClassDim {
    pub width: usize,
    /// Its symbol, where the graph names one: any input dim of that name is the class dim.
    pub symbol: Option<String>,
    /// The graph input axis the scores' class axis comes from, named or not.
    pub input_axis: Option<(String, usize)>,
}

impl ClassDim {
    fn is(&self, spec: &InputSpec, axis: usize) -> bool {
        let named = spec.dim_names.get(axis).and_then(Option::as_deref);
        (self.symbol.is_some() && named == self.symbol.as_deref())
            || self
                .input_axis
                .as_ref()
                .is_some_and(|(name, a)| *name == spec.name && *a == axis)
    }
}

/// The graph input axis that `tensor`'s axis `axis` is, followed back through ops that keep
/// or permute axes (Identity, Cast, elementwise unary ops, Transpose).
pub fn input_axis(index: &GraphIndex, tensor: &str, axis: usize) -> Option<(String, usize)> {
    let (mut tensor, mut axis) = (tensor, axis);
    // iterative and bounded: a chain of such nodes can be as long as the graph
    for _ in 0..=index.graph.node.len() {
        if index.is_graph_input(tensor) {
            return Some((tensor.to_string(), axis));
        }
        let (_, node) = index.producer(tensor)?;
        match node.op_type() {
            "Identity" | "Cast" | "Neg" | "Relu" | "Tanh" | "Sigmoid" | "Exp" | "Log" => {}
            "Transpose" => {
                let perm = crate::onnx::attr_ints(node, "perm")?;
                axis = usize::try_from(*perm.get(axis)?).ok()?;
            }
            _ => return None,
        }
        tensor = node.input.first().filter(|i| !i.is_empty())?;
    }
    None
}

/// Values for every input, deterministic in `seed`: symbolic dims become `batch` (first axis)
/// or `seq` (others), `batch × seq` for rank-1 inputs; integer inputs are token ids in `[0, width)`, the labels a mix of
/// number ids, other ids and the ignore index; floats uniform in [-1, 1). Integer inputs named
/// like a mask are all ones and like positions count along the last axis, so an attention
/// mask or a position table sees values it was exported for.
pub fn generate(
    specs: &[InputSpec],
    labels: Option<&LabelPlan>,
    width: usize,
    shape: &Shape,
    seed: u64,
) -> Result<Vec<HostTensor>, Error> {
    // a symbol gets one size in every input: the first input that has it decides
    let mut named = HashMap::new();
    specs
        .iter()
        .enumerate()
        .map(|(k, spec)| {
            // one ChaCha stream per input: adding an input does not change the others' values
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            rng.set_stream(k as u64);
            let dims = concrete_dims(spec, shape, &mut named)?;
            let data = match labels.filter(|l| l.input == spec.name) {
                Some(plan) => {
                    let n = dims.iter().product();
                    let ids = match plan.style {
                        LabelStyle::Tokens => label_values(&mut rng, n, width, plan),
                        LabelStyle::DigitRuns { dot } => {
                            let seq = dims.last().copied().unwrap_or(1).max(1);
                            digit_run_values(&mut rng, n, seq, width, plan, dot)
                        }
                    };
                    int_data(spec.elem_type, ids)
                }
                None => values(spec, &dims, width, &mut rng)?,
            };
            Ok(HostTensor {
                name: spec.name.clone(),
                shape: dims,
                data,
            })
        })
        .collect()
}

fn concrete_dims(
    spec: &InputSpec,
    shape: &Shape,
    named: &mut HashMap<String, usize>,
) -> Result<Vec<usize>, Error> {
    let is_class = |axis| shape.class.as_ref().is_some_and(|c| c.is(spec, axis));
    // the positions are the dims besides the class axis: `[N, V]` scores are N positions
    // like their `[N]` labels, `[B, V, T]` ones B × T like `[B, T]` labels
    let class_axis = (0..spec.dims.len()).find(|&a| is_class(a));
    let positions = spec.dims.len() - usize::from(class_axis.is_some());
    let dims: Vec<usize> = spec
        .dims
        .iter()
        .enumerate()
        .map(|(axis, d)| {
            if let Some(v) = d.filter(|v| *v >= 0) {
                return v as usize;
            }
            let size = if let Some(p) = spec.pinned.get(axis).copied().flatten() {
                p // the graph fixes it (a MatMul's inner dim)
            } else if Some(axis) == class_axis {
                shape.class.as_ref().map_or(0, |c| c.width)
            } else {
                let k = axis - usize::from(class_axis.is_some_and(|c| c < axis));
                // a rank-1 symbolic input is a flat run of positions (`labels[N]` of `[N, V]`
                // logits, beside `[B, T]` ids): batch × seq of them
                match k {
                    _ if positions == 1 => shape.batch * shape.seq,
                    0 => shape.batch,
                    _ => shape.seq,
                }
            };
            match spec.dim_names.get(axis).and_then(Option::as_ref) {
                Some(name) => *named.entry(name.clone()).or_insert(size),
                None => size,
            }
        })
        .collect();
    let count = dims
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
        .filter(|&n| n <= crate::io::limits::MAX_GENERATED_ELEMENTS);
    if count.is_none() {
        return Err(Error::Usage(format!(
            "graph input '{}' would get shape {dims:?}, more than the {} values validate generates; lower --batch/--seq or pass --reference DIR",
            spec.name,
            crate::io::limits::MAX_GENERATED_ELEMENTS
        )));
    }
    Ok(dims)
}

/// Values for an input that is not the labels.
fn values(
    spec: &InputSpec,
    dims: &[usize],
    width: usize,
    rng: &mut ChaCha8Rng,
) -> Result<Data, Error> {
    let n: usize = dims.iter().product();
    let name = spec.name.to_ascii_lowercase();
    let t = spec.elem_type;
    Ok(match DataType::try_from(t).unwrap_or(DataType::Undefined) {
        DataType::Int64 | DataType::Int32 if name.contains("mask") => int_data(t, vec![1; n]),
        DataType::Int64 | DataType::Int32 if name.contains("position") => {
            let last = dims.last().copied().unwrap_or(1).max(1);
            int_data(t, (0..n).map(|i| (i % last) as i64).collect())
        }
        DataType::Int64 | DataType::Int32 => {
            // ids index the embedding they feed: never past its rows, whatever the class width
            let top = spec.index_rows.map_or(width, |r| r.min(width)).max(1) as i64;
            int_data(t, (0..n).map(|_| rng.gen_range(0..top)).collect())
        }
        DataType::Float => Data::F32((0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()),
        DataType::Double => Data::F64((0..n).map(|_| rng.gen_range(-1.0f64..1.0)).collect()),
        DataType::Bool => Data::Bool(vec![true; n]),
        other => {
            return Err(Error::Validation(format!(
                "graph input '{}' has element type {}, which validate cannot generate; pass its values with --reference DIR",
                spec.name,
                other.as_str_name()
            )))
        }
    })
}

/// About 40% number ids, 40% other ids, 20% ignore index; with three or more positions each
/// kind occurs at least once.
fn label_values(rng: &mut ChaCha8Rng, n: usize, width: usize, plan: &LabelPlan) -> Vec<i64> {
    let numbers = plan.table.ids();
    let others: Vec<i64> = (0..width as i64)
        .filter(|&id| plan.table.value_of(id).is_none() && Some(id) != plan.ignore_index)
        .collect();
    let pick = |rng: &mut ChaCha8Rng, kind: u32| -> i64 {
        match (kind, plan.ignore_index) {
            (0, Some(ignore)) => ignore,
            (0 | 1, _) if !others.is_empty() => *others.choose(rng).expect("non-empty"),
            _ => *numbers.choose(rng).expect("a number table is never empty"),
        }
    };
    let mut ids: Vec<i64> = (0..n)
        .map(|_| {
            let r = rng.gen_range(0..10u32);
            let kind = match r {
                0 | 1 => 0,
                2..=5 => 1,
                _ => 2,
            };
            pick(rng, kind)
        })
        .collect();
    if n >= 3 {
        for (slot, kind) in [0u32, 1, 2].into_iter().enumerate() {
            ids[slot] = pick(rng, kind);
        }
        ids.shuffle(rng);
    }
    ids
}

/// Labels for the per-sequence losses, sequence by sequence (rows of `seq`): after a digit,
/// 50% another digit (numbers of one to several digits) and 15% `dot` when there is one;
/// after a dot 70% a digit (a decimal `d.d`); else 40% digit. The rest are other ids and the
/// ignore index. Redrawn (same stream) until there is a multi-digit number, a decimal (with a
/// dot), an other id and the ignore index, where the size allows.
fn digit_run_values(
    rng: &mut ChaCha8Rng,
    n: usize,
    seq: usize,
    width: usize,
    plan: &LabelPlan,
    dot: Option<i64>,
) -> Vec<i64> {
    let digits = plan.table.ids();
    let others: Vec<i64> = (0..width as i64)
        .filter(|&id| {
            plan.table.value_of(id).is_none() && Some(id) != plan.ignore_index && Some(id) != dot
        })
        .collect();
    let is_digit = |id: i64| plan.table.value_of(id).is_some();
    let draw = |rng: &mut ChaCha8Rng| -> Vec<i64> {
        let mut ids: Vec<i64> = Vec::with_capacity(n);
        for i in 0..n {
            let prev = (i % seq != 0).then(|| ids[i - 1]);
            let r = rng.gen_range(0..100u32);
            // (digit below, dot below, other below); the rest is the ignore index
            let (digit, dot_to, other) = match prev {
                Some(p) if is_digit(p) => (50, 65, 85),
                Some(p) if Some(p) == dot => (70, 70, 85),
                _ => (40, 40, 75),
            };
            let dot_to = if dot.is_some() { dot_to } else { digit };
            ids.push(if r < digit {
                *digits.choose(rng).expect("a number table is never empty")
            } else if r < dot_to {
                dot.expect("checked")
            } else {
                match (plan.ignore_index, others.choose(rng)) {
                    (Some(ignore), _) if r >= other => ignore,
                    (_, Some(&id)) => id,
                    (_, None) => *digits.choose(rng).expect("never empty"),
                }
            });
        }
        ids
    };
    let complete = |ids: &[i64]| {
        let rows = || ids.chunks(seq);
        let long_number =
            seq < 2 || rows().any(|row| row.windows(2).any(|w| is_digit(w[0]) && is_digit(w[1])));
        let decimal = seq < 3
            || dot.is_none()
            || rows().any(|row| {
                row.windows(3)
                    .any(|w| is_digit(w[0]) && Some(w[1]) == dot && is_digit(w[2]))
            });
        let other = others.is_empty()
            || ids
                .iter()
                .any(|&id| !is_digit(id) && Some(id) != plan.ignore_index && Some(id) != dot);
        let ignored = plan.ignore_index.is_none_or(|ig| ids.contains(&ig));
        n < 4 || (long_number && decimal && other && ignored)
    };
    let mut ids = draw(rng);
    for _ in 0..1000 {
        if complete(&ids) {
            break;
        }
        ids = draw(rng);
    }
    ids
}

fn int_data(elem_type: i32, v: Vec<i64>) -> Data {
    if elem_type == DataType::Int32 as i32 {
        Data::I32(v.into_iter().map(|x| x as i32).collect())
    } else {
        Data::I64(v)
    }
}

fn is_int(elem_type: i32) -> bool {
    [DataType::Int64, DataType::Int32]
        .iter()
        .any(|t| *t as i32 == elem_type)
}

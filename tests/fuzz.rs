//! Hostile inputs: mutated fixture bytes (bit flips, inserts, deletes, truncations) and mutated
//! graphs (dropped nodes, renamed or duplicated tensors, changed attributes, op types, opsets,
//! shapes) go through load → find CE → patch → save, and through the other commands: `inspect`
//! (text, JSON, GPU targets), `validate` (mutated patched graphs, tract) and `artifacts`
//! (mutated training graphs). Whatever the input: no panic, no hang, errors in one line, and on
//! error no output file and no temporary file is left.
//!
//! Bounded and deterministic (fixed seed); `PROPTEST_RNG_SEED=N` explores other inputs and
//! `NTL_FUZZ_CASES=N` runs more of them. Each test prints how many inputs it executed.
//! `NTL_FUZZ_LOG=FILE` makes the validate fuzz write each case there before running it, to
//! find an input that kills the process (run under `ulimit -v` to turn runaway allocation
//! into an abort).

mod common;

use std::cell::Cell;
use std::io::Write;
use std::sync::mpsc;
use std::time::Duration;

use common::*;
use ntl_ops::options::{Combine, LossKind, LossOptions, NtilOptions};
use ntl_patch::jobs::patch::{run_patch, PatchRequest};
use ntl_patch::onnx::proto::attribute_proto::AttributeType;
use ntl_patch::onnx::proto::tensor_shape_proto::dimension;
use ntl_patch::onnx::proto::type_proto;
use ntl_patch::onnx::{AttributeProto, GraphProto, ModelProto, NodeProto, ValueInfoProto};
use ntl_patch::Error;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};
use prost::Message;

const FIXTURES: [&str; 5] = ["lm_flat", "lm_bvt", "lm_nll", "lm_two_ce", "lm_no_ce"];
/// Cross-entropies spelled out of primitive ops (`fixtures/exporters/`), for the form matcher.
const SPELLED_OUT: [&str; 6] = [
    "tf_sparse_ignore",
    "tf_gather_nd",
    "jax_int_masked",
    "torch_gather",
    "torch_onehot",
    "paddle_ce_masked",
];

/// The graph fuzz seeds: the tiny LM's loss forms and the exporters' spelled-out ones.
fn graph_seeds() -> Vec<ModelProto> {
    let models = FIXTURES.iter().map(|n| model(n));
    let exporters = SPELLED_OUT
        .iter()
        .map(|n| fixture(&format!("exporters/{n}.onnx")));
    models.chain(exporters).map(|p| read_model(&p)).collect()
}
const LOSSES: [LossKind; 10] = [
    LossKind::Wasserstein,
    LossKind::Mse,
    LossKind::L1,
    LossKind::Huber,
    LossKind::Ntil,
    LossKind::Emd,
    LossKind::NumberLevel,
    LossKind::Dist2,
    LossKind::Smmd,
    LossKind::Del,
];
/// One patch of a 20 kB model takes milliseconds; this long means it hangs.
const HANG: Duration = Duration::from_secs(30);

fn cases(default: u32) -> u32 {
    std::env::var("NTL_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn runner(cases: u32) -> TestRunner {
    let mut config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 256,
        ..Config::default()
    };
    if std::env::var_os("PROPTEST_RNG_SEED").is_none() {
        config.rng_seed = RngSeed::Fixed(0x6e74_6c70);
    }
    TestRunner::new(config)
}

/// A line in the test output even when cargo captures it (written past the capture).
fn report(what: &str, outcome: &Outcomes) {
    let line = format!(
        "fuzz {what}: {} inputs executed ({} patched, {} refused, {} unreadable)\n",
        outcome.ok.get() + outcome.refused.get() + outcome.unreadable.get(),
        outcome.ok.get(),
        outcome.refused.get(),
        outcome.unreadable.get()
    );
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

#[derive(Default)]
struct Outcomes {
    ok: Cell<usize>,
    refused: Cell<usize>,
    unreadable: Cell<usize>,
}

fn bump(c: &Cell<usize>) {
    c.set(c.get() + 1);
}

/// Patches `bytes` (as `model.onnx` in a fresh folder) through the library and checks the
/// outcome; a panic or a hang fails the case.
fn patch_bytes(bytes: &[u8], loss: LossKind, outcomes: &Outcomes) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("model.onnx");
    std::fs::write(&input, bytes).unwrap();
    let out = dir.path().join("out.onnx");
    let req = PatchRequest {
        model: input.clone(),
        output: Some(out.clone()),
        tokenizer: Some(tokenizer()),
        vocab_size: None,
        ce_node: None,
        add_loss: false,
        shift: true,
        copy_external_data: false,
        loss: LossOptions {
            kind: loss,
            weight: 0.3,
            reweigh: false,
            squash: None,
            number_set: ntl_patch::vocab::number_table::NumberSet::DigitLevel,
            combine: if matches!(loss, LossKind::Ntil | LossKind::Emd) {
                Combine::Scaled
            } else {
                Combine::Add
            },
            ntil: NtilOptions::default(),
            float_level: false,
            label_smoothing: 0.0,
            dist2: Default::default(),
            smmd: Default::default(),
        },
    };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(run_patch(&req).map(|_| ()));
    });
    let result = match rx.recv_timeout(HANG) {
        Ok(result) => result,
        Err(mpsc::RecvTimeoutError::Timeout) => return Err(TestCaseError::fail("hangs")),
        Err(mpsc::RecvTimeoutError::Disconnected) => return Err(TestCaseError::fail("panicked")),
    };
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    match result {
        Ok(()) => {
            prop_assert!(out.exists());
            let patched = ModelProto::decode(std::fs::read(&out).unwrap().as_slice());
            prop_assert!(patched.is_ok(), "the output decodes");
            prop_assert_eq!(left.len(), 2, "model and output only: {:?}", left);
            bump(&outcomes.ok);
        }
        Err(e) => {
            let message = e.one_line();
            prop_assert!(
                !matches!(e, Error::Inconsistent(_)),
                "internal error: {}",
                message
            );
            prop_assert!(!out.exists(), "no output on error: {}", message);
            prop_assert_eq!(
                left,
                vec!["model.onnx".to_string()],
                "nothing written on error: {}",
                message
            );
            prop_assert!(!message.contains('\n'), "one line: {}", message);
            match e {
                Error::NotOnnx { .. } => bump(&outcomes.unreadable),
                _ => bump(&outcomes.refused),
            }
        }
    }
    Ok(())
}

// ------------------------------------------------------------------ byte mutations

#[derive(Clone, Debug)]
enum ByteEdit {
    Flip(usize, u8),
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    Truncate(usize),
    /// A maximal varint (a huge length or tag) at a position.
    Varint(usize),
}

fn byte_edit() -> impl Strategy<Value = ByteEdit> {
    prop_oneof![
        6 => (any::<usize>(), 0u8..8).prop_map(|(p, b)| ByteEdit::Flip(p, b)),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(p, v)| ByteEdit::Set(p, v)),
        2 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..12)).prop_map(|(p, v)| ByteEdit::Insert(p, v)),
        2 => (any::<usize>(), 1usize..64).prop_map(|(p, n)| ByteEdit::Delete(p, n)),
        1 => any::<usize>().prop_map(ByteEdit::Truncate),
        1 => any::<usize>().prop_map(ByteEdit::Varint),
    ]
}

fn apply_bytes(bytes: &mut Vec<u8>, edit: &ByteEdit) {
    let at = |p: usize, len: usize| if len == 0 { 0 } else { p % len };
    match edit {
        ByteEdit::Flip(p, b) if !bytes.is_empty() => {
            let i = at(*p, bytes.len());
            bytes[i] ^= 1 << b;
        }
        ByteEdit::Set(p, v) if !bytes.is_empty() => {
            let i = at(*p, bytes.len());
            bytes[i] = *v;
        }
        ByteEdit::Insert(p, v) => {
            let i = at(*p, bytes.len() + 1);
            bytes.splice(i..i, v.iter().copied());
        }
        ByteEdit::Delete(p, n) if !bytes.is_empty() => {
            let i = at(*p, bytes.len());
            let end = (i + n).min(bytes.len());
            bytes.drain(i..end);
        }
        ByteEdit::Truncate(p) => {
            let i = at(*p, bytes.len() + 1);
            bytes.truncate(i);
        }
        ByteEdit::Varint(p) => {
            let i = at(*p, bytes.len() + 1);
            let big = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01];
            let end = (i + big.len()).min(bytes.len());
            bytes.splice(i..end, big);
        }
        _ => {}
    }
}

#[test]
fn mutated_bytes_never_panic_and_leave_nothing() {
    let fixtures: Vec<Vec<u8>> = FIXTURES
        .iter()
        .map(|n| std::fs::read(model(n)).unwrap())
        .collect();
    let outcomes = Outcomes::default();
    let strategy = (
        0..FIXTURES.len(),
        0..LOSSES.len(),
        prop::collection::vec(byte_edit(), 1..4),
    );
    let result = runner(cases(300)).run(&strategy, |(f, l, edits)| {
        let mut bytes = fixtures[f].clone();
        edits.iter().for_each(|e| apply_bytes(&mut bytes, e));
        patch_bytes(&bytes, LOSSES[l], &outcomes)
    });
    report("bytes", &outcomes);
    result.unwrap();
}

// ------------------------------------------------------------------ graph mutations

#[derive(Clone, Debug)]
enum GraphEdit {
    DropNode(usize),
    SwapNodes(usize, usize),
    DropInitializer(usize),
    DropInput(usize),
    DropOutput(usize),
    /// Renames one use or definition of a tensor (left dangling).
    RenameSlot(usize, usize, bool, String),
    /// Renames a tensor everywhere.
    RenameEverywhere(usize, String),
    /// Node b produces what node a produces.
    DuplicateOutput(usize, usize),
    DuplicateNodeName(usize, usize),
    AddInput(usize, String),
    SetAttrInt(usize, usize, i64),
    SetAttrString(usize, usize, String),
    SetAttrType(usize, usize, i32),
    DropAttr(usize, usize),
    AddAttr(usize, String, i64),
    SetOpType(usize, String),
    SetDomain(usize, String),
    SetOpset(i64),
    SetIrVersion(i64),
    SetDim(usize, usize, Option<i64>),
    SetElemType(usize, i32),
    ClearTypes,
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[a-z_/.0-9]{0,8}",
        1 => Just(String::new()),
        1 => Just("ntl/x".to_string()),
        1 => Just("ce_loss".to_string()),
        1 => Just("number_loss".to_string()),
        1 => Just("loss".to_string()),
        1 => Just("labels".to_string()),
    ]
}

fn op_type() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "SoftmaxCrossEntropyLoss",
        "NegativeLogLikelihoodLoss",
        "LogSoftmax",
        "Softmax",
        "Reshape",
        "Transpose",
        "Gather",
        "MatMul",
        "Add",
        "Identity",
        "Constant",
        "Flatten",
        "If",
        "Loop",
        // gradient rules with inputs or attributes of their own
        "Einsum",
        "Tile",
        "CumSum",
        "PRelu",
        "GlobalAveragePool",
        "",
        "Bogus",
    ])
    .prop_map(String::from)
}

fn graph_edit() -> impl Strategy<Value = GraphEdit> {
    let i = any::<usize>;
    prop_oneof![
        3 => i().prop_map(GraphEdit::DropNode),
        1 => (i(), i()).prop_map(|(a, b)| GraphEdit::SwapNodes(a, b)),
        1 => i().prop_map(GraphEdit::DropInitializer),
        1 => i().prop_map(GraphEdit::DropInput),
        1 => i().prop_map(GraphEdit::DropOutput),
        2 => (i(), i(), any::<bool>(), name()).prop_map(|(a, b, o, n)| GraphEdit::RenameSlot(a, b, o, n)),
        2 => (i(), name()).prop_map(|(a, n)| GraphEdit::RenameEverywhere(a, n)),
        2 => (i(), i()).prop_map(|(a, b)| GraphEdit::DuplicateOutput(a, b)),
        1 => (i(), i()).prop_map(|(a, b)| GraphEdit::DuplicateNodeName(a, b)),
        1 => (i(), name()).prop_map(|(a, n)| GraphEdit::AddInput(a, n)),
        3 => (i(), i(), prop_oneof![-3i64..5, any::<i64>()]).prop_map(|(a, b, v)| GraphEdit::SetAttrInt(a, b, v)),
        1 => (i(), i(), "[a-z]{0,6}").prop_map(|(a, b, s)| GraphEdit::SetAttrString(a, b, s)),
        1 => (i(), i(), 0i32..16).prop_map(|(a, b, t)| GraphEdit::SetAttrType(a, b, t)),
        2 => (i(), i()).prop_map(|(a, b)| GraphEdit::DropAttr(a, b)),
        1 => (i(), prop::sample::select(vec!["axis", "reduction", "ignore_index", "perm", "to", "x"]), -2i64..3)
            .prop_map(|(a, n, v)| GraphEdit::AddAttr(a, n.to_string(), v)),
        2 => (i(), op_type()).prop_map(|(a, o)| GraphEdit::SetOpType(a, o)),
        1 => (i(), prop::sample::select(vec!["", "ai.onnx", "com.microsoft", "x"])).prop_map(|(a, d)| GraphEdit::SetDomain(a, d.to_string())),
        1 => prop_oneof![-1i64..30, any::<i64>()].prop_map(GraphEdit::SetOpset),
        1 => prop_oneof![-1i64..12, any::<i64>()].prop_map(GraphEdit::SetIrVersion),
        2 => (i(), i(), prop::option::of(prop_oneof![-2i64..4, Just(48), any::<i64>()])).prop_map(|(a, b, d)| GraphEdit::SetDim(a, b, d)),
        1 => (i(), -1i32..20).prop_map(|(a, t)| GraphEdit::SetElemType(a, t)),
        1 => Just(GraphEdit::ClearTypes),
    ]
}

/// Every tensor name the graph mentions, in a fixed order.
fn tensor_names(m: &ModelProto) -> Vec<String> {
    let g = m.graph.as_ref().unwrap();
    let mut names: Vec<String> = g
        .node
        .iter()
        .flat_map(|n| n.input.iter().chain(n.output.iter()).cloned())
        .chain(g.input.iter().map(|v| v.name().to_string()))
        .chain(g.output.iter().map(|v| v.name().to_string()))
        .chain(g.initializer.iter().map(|t| t.name().to_string()))
        .collect();
    names.sort();
    names.dedup();
    names
}

fn pick<T>(v: &mut [T], i: usize) -> Option<&mut T> {
    let n = v.len();
    (n > 0).then(|| &mut v[i % n])
}

fn attr_mut(nodes: &mut [NodeProto], a: usize, b: usize) -> Option<&mut AttributeProto> {
    pick(nodes, a).and_then(|n| pick(&mut n.attribute, b))
}

fn value_info_mut(g: &mut GraphProto, a: usize) -> Option<&mut ValueInfoProto> {
    let n = g.input.len() + g.output.len() + g.value_info.len();
    let mut all = g
        .input
        .iter_mut()
        .chain(g.output.iter_mut())
        .chain(g.value_info.iter_mut());
    (n > 0).then(|| all.nth(a % n)).flatten()
}

fn apply_graph(m: &mut ModelProto, edit: &GraphEdit) {
    let names = tensor_names(m);
    let g = m.graph.as_mut().unwrap();
    match edit {
        GraphEdit::DropNode(i) if !g.node.is_empty() => {
            let n = g.node.len();
            g.node.remove(i % n);
        }
        GraphEdit::SwapNodes(a, b) if !g.node.is_empty() => {
            let n = g.node.len();
            g.node.swap(a % n, b % n);
        }
        GraphEdit::DropInitializer(i) if !g.initializer.is_empty() => {
            let n = g.initializer.len();
            g.initializer.remove(i % n);
        }
        GraphEdit::DropInput(i) if !g.input.is_empty() => {
            let n = g.input.len();
            g.input.remove(i % n);
        }
        GraphEdit::DropOutput(i) if !g.output.is_empty() => {
            let n = g.output.len();
            g.output.remove(i % n);
        }
        GraphEdit::RenameSlot(a, b, output, new) => {
            if let Some(node) = pick(&mut g.node, *a) {
                let slots = if *output {
                    &mut node.output
                } else {
                    &mut node.input
                };
                if let Some(s) = pick(slots, *b) {
                    *s = new.clone();
                }
            }
        }
        GraphEdit::RenameEverywhere(a, new) if !names.is_empty() => {
            let old = &names[a % names.len()];
            let swap = |s: &mut String| {
                if s == old {
                    *s = new.clone();
                }
            };
            for n in &mut g.node {
                n.input.iter_mut().chain(n.output.iter_mut()).for_each(swap);
            }
            for v in g
                .input
                .iter_mut()
                .chain(g.output.iter_mut())
                .chain(g.value_info.iter_mut())
            {
                if v.name() == old {
                    v.name = Some(new.clone());
                }
            }
            for t in &mut g.initializer {
                if t.name() == old {
                    t.name = Some(new.clone());
                }
            }
        }
        GraphEdit::DuplicateOutput(a, b) if !g.node.is_empty() => {
            let n = g.node.len();
            if let Some(o) = g.node[a % n].output.first().cloned() {
                if let Some(slot) = g.node[b % n].output.first_mut() {
                    *slot = o;
                }
            }
        }
        GraphEdit::DuplicateNodeName(a, b) if !g.node.is_empty() => {
            let n = g.node.len();
            g.node[b % n].name = g.node[a % n].name.clone();
        }
        GraphEdit::AddInput(a, new) => {
            if let Some(node) = pick(&mut g.node, *a) {
                node.input.push(new.clone());
            }
        }
        GraphEdit::SetAttrInt(a, b, v) => {
            if let Some(x) = attr_mut(&mut g.node, *a, *b) {
                x.i = Some(*v);
                x.ints.iter_mut().for_each(|i| *i = *v);
                x.f = Some(*v as f32);
            }
        }
        GraphEdit::SetAttrString(a, b, s) => {
            if let Some(x) = attr_mut(&mut g.node, *a, *b) {
                x.s = Some(s.clone().into_bytes().into());
            }
        }
        GraphEdit::SetAttrType(a, b, t) => {
            if let Some(x) = attr_mut(&mut g.node, *a, *b) {
                x.r#type = Some(*t);
                if *t == AttributeType::Tensor as i32 && x.t.is_none() {
                    x.t = Some(ntl_patch::onnx::i64_tensor("", &[2], &[1, 2]));
                }
            }
        }
        GraphEdit::DropAttr(a, b) => {
            if let Some(node) = pick(&mut g.node, *a) {
                if !node.attribute.is_empty() {
                    let n = node.attribute.len();
                    node.attribute.remove(b % n);
                }
            }
        }
        GraphEdit::AddAttr(a, name, v) => {
            if let Some(node) = pick(&mut g.node, *a) {
                node.attribute.push(ntl_patch::onnx::int_attr(name, *v));
            }
        }
        GraphEdit::SetOpType(a, op) => {
            if let Some(node) = pick(&mut g.node, *a) {
                node.op_type = Some(op.clone());
            }
        }
        GraphEdit::SetDomain(a, d) => {
            if let Some(node) = pick(&mut g.node, *a) {
                node.domain = Some(d.clone());
            }
        }
        GraphEdit::SetOpset(v) => {
            if let Some(o) = m.opset_import.first_mut() {
                o.version = Some(*v);
            }
        }
        GraphEdit::SetIrVersion(v) => m.ir_version = Some(*v),
        GraphEdit::SetDim(a, b, d) => {
            if let Some(vi) = value_info_mut(g, *a) {
                if let Some(type_proto::Value::TensorType(t)) =
                    vi.r#type.as_mut().and_then(|t| t.value.as_mut())
                {
                    if let Some(s) = t.shape.as_mut() {
                        if let Some(dim) = pick(&mut s.dim, *b) {
                            dim.value = Some(match d {
                                Some(v) => dimension::Value::DimValue(*v),
                                None => dimension::Value::DimParam("S".into()),
                            });
                        }
                    }
                }
            }
        }
        GraphEdit::SetElemType(a, e) => {
            if let Some(vi) = value_info_mut(g, *a) {
                if let Some(type_proto::Value::TensorType(t)) =
                    vi.r#type.as_mut().and_then(|t| t.value.as_mut())
                {
                    t.elem_type = Some(*e);
                }
            }
        }
        GraphEdit::ClearTypes => {
            g.value_info.clear();
            for v in g.input.iter_mut().chain(g.output.iter_mut()) {
                v.r#type = None;
            }
        }
        _ => {}
    }
}

#[test]
fn mutated_graphs_never_panic_and_leave_nothing() {
    let fixtures = graph_seeds();
    let outcomes = Outcomes::default();
    let strategy = (
        0..fixtures.len(),
        0..LOSSES.len(),
        prop::collection::vec(graph_edit(), 1..5),
    );
    let result = runner(cases(600)).run(&strategy, |(f, l, edits)| {
        let mut m = fixtures[f].clone();
        edits.iter().for_each(|e| apply_graph(&mut m, e));
        patch_bytes(&m.encode_to_vec(), LOSSES[l], &outcomes)
    });
    report("graphs", &outcomes);
    result.unwrap();
}

/// The binary on a few mutated inputs: exit 0 or 1 with one error line, never a panic.
#[test]
fn the_binary_fails_cleanly_on_mutated_graphs() {
    let fixture = read_model(&model("lm_flat"));
    let executed = Cell::new(0usize);
    let result = runner(cases(24)).run(&prop::collection::vec(graph_edit(), 1..4), |edits| {
        let mut m = fixture.clone();
        edits.iter().for_each(|e| apply_graph(&mut m, e));
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("model.onnx");
        std::fs::write(&input, m.encode_to_vec()).unwrap();
        let out = dir.path().join("out.onnx");
        let output = bin()
            .arg(&input)
            .arg("--tokenizer")
            .arg(tokenizer())
            .arg("-o")
            .arg(&out)
            .timeout(HANG)
            .output()
            .unwrap();
        bump(&executed);
        let stderr = String::from_utf8_lossy(&output.stderr);
        match output.status.code() {
            Some(0) => prop_assert!(out.exists()),
            Some(1) => {
                prop_assert!(!out.exists());
                prop_assert!(
                    stderr.starts_with("error: ") && stderr.trim_end().lines().count() == 1,
                    "{}",
                    stderr
                );
            }
            other => return Err(TestCaseError::fail(format!("exit {other:?}: {stderr}"))),
        }
        prop_assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1 + usize::from(out.exists())
        );
        Ok(())
    });
    let _ = std::io::stderr()
        .lock()
        .write_all(format!("fuzz binary: {} inputs executed\n", executed.get()).as_bytes());
    result.unwrap();
}

// ------------------------------------------------------------------ the other commands

/// Runs `f` on its own thread: a panic or a hang fails the case.
fn in_thread<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, TestCaseError> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(HANG) {
        Ok(v) => Ok(v),
        Err(mpsc::RecvTimeoutError::Timeout) => Err(TestCaseError::fail("hangs")),
        Err(mpsc::RecvTimeoutError::Disconnected) => Err(TestCaseError::fail("panicked")),
    }
}

fn one_line_error(e: &Error) -> Result<(), TestCaseError> {
    let message = e.one_line();
    prop_assert!(!message.contains('\n'), "one line: {}", message);
    prop_assert!(
        !matches!(e, Error::Inconsistent(_)),
        "internal error: {}",
        message
    );
    Ok(())
}

/// `inspect` (text, JSON, GPU targets) on mutated graphs and mutated bytes.
#[test]
fn inspect_never_panics_on_mutated_input() {
    let fixtures = graph_seeds();
    let executed = Cell::new(0usize);
    let strategy = (
        0..fixtures.len(),
        prop::collection::vec(graph_edit(), 1..5),
        prop::collection::vec(byte_edit(), 0..2),
        any::<bool>(),
    );
    let result = runner(cases(150)).run(&strategy, |(f, edits, bytes_edits, json)| {
        let mut m = fixtures[f].clone();
        edits.iter().for_each(|e| apply_graph(&mut m, e));
        let mut bytes = m.encode_to_vec();
        bytes_edits.iter().for_each(|e| apply_bytes(&mut bytes, e));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.onnx");
        std::fs::write(&path, bytes).unwrap();
        let targets = [
            ntl_patch::tools::gpu_kernels::Target::Cuda,
            ntl_patch::tools::gpu_kernels::Target::Rocm,
        ];
        let result =
            in_thread(move || ntl_patch::tools::inspect::inspect_targets(&path, json, &targets))?;
        bump(&executed);
        if let Err(e) = result {
            one_line_error(&e)?;
        }
        Ok(())
    });
    let _ = std::io::stderr()
        .lock()
        .write_all(format!("fuzz inspect: {} inputs executed\n", executed.get()).as_bytes());
    result.unwrap();
}

/// `validate` (tract) on mutated patched graphs.
#[test]
fn validate_never_panics_on_mutated_patched_graphs() {
    let dir = tempfile::tempdir().unwrap();
    let mut patched = Vec::new();
    for (name, loss) in [
        ("lm_flat", LossKind::Wasserstein),
        ("lm_bvt", LossKind::Ntil),
        ("lm_nll", LossKind::Mse),
    ] {
        let out = dir.path().join(format!("{name}.ntl.onnx"));
        let req = PatchRequest {
            model: model(name),
            output: Some(out.clone()),
            tokenizer: Some(tokenizer()),
            vocab_size: None,
            ce_node: None,
            add_loss: false,
            shift: true,
            copy_external_data: false,
            loss: LossOptions {
                kind: loss,
                weight: 0.3,
                reweigh: false,
                squash: None,
                number_set: ntl_patch::vocab::number_table::NumberSet::DigitLevel,
                combine: Combine::Add,
                ntil: NtilOptions::default(),
                float_level: false,
                label_smoothing: 0.0,
                dist2: Default::default(),
                smmd: Default::default(),
            },
        };
        run_patch(&req).unwrap();
        patched.push(read_model(&out));
    }
    let executed = Cell::new(0usize);
    let strategy = (0..patched.len(), prop::collection::vec(graph_edit(), 1..4));
    let result = runner(cases(60)).run(&strategy, |(f, edits)| {
        if let Ok(log) = std::env::var("NTL_FUZZ_LOG") {
            let _ = std::fs::write(log, format!("{f} {edits:?}"));
        }
        let mut m = patched[f].clone();
        edits.iter().for_each(|e| apply_graph(&mut m, e));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.onnx");
        std::fs::write(&path, m.encode_to_vec()).unwrap();
        let req = ntl_patch::tools::validate::ValidateRequest {
            model: path,
            runtime: ntl_patch::tools::validate::Runtime::Tract,
            reference: None,
            tokenizer: Some(tokenizer()),
            rtol: 1e-5,
            atol: 1e-6,
            batch: 2,
            seq: 8,
            seed: 0,
        };
        let result = in_thread(move || ntl_patch::tools::validate::run(&req).map(|_| ()))?;
        bump(&executed);
        if let Err(e) = result {
            one_line_error(&e)?;
        }
        Ok(())
    });
    let _ = std::io::stderr()
        .lock()
        .write_all(format!("fuzz validate: {} inputs executed\n", executed.get()).as_bytes());
    result.unwrap();
}

/// `artifacts` on mutated training graphs: no panic, and on error no output folder and no
/// temporary left.
#[test]
fn artifacts_never_panics_and_leaves_nothing_on_error() {
    let base = training_graph(&["scores_grad"]);
    let executed = Cell::new(0usize);
    let strategy = (prop::collection::vec(graph_edit(), 1..4), 0..LOSSES.len());
    let result = runner(cases(120)).run(&strategy, |(edits, l)| {
        let mut m = base.clone();
        edits.iter().for_each(|e| apply_graph(&mut m, e));
        let root = tempfile::tempdir().unwrap();
        let dir = artifacts_folder_with(root.path(), &m);
        let req = ntl_patch::jobs::artifacts::ArtifactsRequest {
            dir: dir.clone(),
            output: None,
            tokenizer: None,
            vocab_size: None,
            ce_node: None,
            loss: LossOptions {
                kind: LOSSES[l],
                weight: 0.3,
                reweigh: false,
                squash: None,
                number_set: ntl_patch::vocab::number_table::NumberSet::DigitLevel,
                combine: Combine::Add,
                ntil: NtilOptions::default(),
                float_level: false,
                label_smoothing: 0.0,
                dist2: Default::default(),
                smmd: Default::default(),
            },
        };
        let result =
            in_thread(move || ntl_patch::jobs::artifacts::run_artifacts(&req).map(|_| ()))?;
        bump(&executed);
        let mut left: Vec<String> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        match result {
            Ok(()) => prop_assert_eq!(left, vec!["art".to_string(), "art-ntl".to_string()]),
            Err(e) => {
                one_line_error(&e)?;
                prop_assert_eq!(left, vec!["art".to_string()], "{}", e.one_line());
            }
        }
        Ok(())
    });
    let _ = std::io::stderr()
        .lock()
        .write_all(format!("fuzz artifacts: {} inputs executed\n", executed.get()).as_bytes());
    result.unwrap();
}

/// Exit 0, or exit 1 with one error line.
fn clean_exit(
    args: &[&std::ffi::OsStr],
    output: &std::process::Output,
) -> Result<(), TestCaseError> {
    let stderr = String::from_utf8_lossy(&output.stderr);
    match output.status.code() {
        Some(0) => Ok(()),
        Some(1) => {
            prop_assert!(
                stderr.starts_with("error: ") && stderr.trim_end().lines().count() == 1,
                "{:?}: {}",
                args,
                stderr
            );
            Ok(())
        }
        other => Err(TestCaseError::fail(format!(
            "{args:?}: exit {other:?}: {stderr}"
        ))),
    }
}

/// Seeds of the all-commands fuzz: a few small runs over different inputs rather than one long
/// run (each case runs up to nine commands; `PROPTEST_RNG_SEED` replaces them with one).
const COMMAND_SEEDS: [u64; 3] = [0x6e74_6c70, 21, 0x5eed];

/// Every command of the binary on mutated inputs — patch, `inspect` (text and GPU JSON),
/// `artifacts`, `step`, and `validate` on tract and ONNX Runtime of what patch and step wrote
/// (of the mutated input itself where they refused it): exit 0 or 1 with one error line, no
/// temporary left.
#[test]
fn every_command_of_the_binary_fails_cleanly() {
    let fixtures = graph_seeds();
    let ort = ort_library();
    let executed = Cell::new(0usize);
    let strategy = (0..fixtures.len(), prop::collection::vec(graph_edit(), 1..4));
    let seeds: Vec<Option<u64>> = if std::env::var_os("PROPTEST_RNG_SEED").is_some() {
        vec![None]
    } else {
        COMMAND_SEEDS.iter().copied().map(Some).collect()
    };
    for seed in seeds {
        let mut runner = runner(cases(5));
        if let Some(seed) = seed {
            let mut config = runner.config().clone();
            config.rng_seed = RngSeed::Fixed(seed);
            runner = TestRunner::new(config);
        }
        let result = runner.run(&strategy, |(f, edits)| {
            let mut m = fixtures[f].clone();
            edits.iter().for_each(|e| apply_graph(&mut m, e));
            let root = tempfile::tempdir().unwrap();
            let input = root.path().join("model.onnx");
            std::fs::write(&input, m.encode_to_vec()).unwrap();
            let art = artifacts_folder_with(root.path(), &m);
            let t = tokenizer();
            let patched = root.path().join("model.ntl.onnx");
            let step_out = root.path().join("model.step.onnx");
            let run = |args: &[&std::ffi::OsStr]| -> Result<bool, TestCaseError> {
                let output = bin()
                    .args(args)
                    .env("ORT_DYLIB_PATH", &ort)
                    .timeout(HANG)
                    .output()
                    .unwrap();
                bump(&executed);
                clean_exit(args, &output)?;
                Ok(output.status.success())
            };
            let validate = |model: &std::path::Path| -> Result<(), TestCaseError> {
                for runtime in ["tract", "ort"] {
                    run(&[
                        "validate".as_ref(),
                        model.as_os_str(),
                        "--tokenizer".as_ref(),
                        t.as_os_str(),
                        "--runtime".as_ref(),
                        runtime.as_ref(),
                    ])?;
                }
                Ok(())
            };
            run(&["inspect".as_ref(), input.as_os_str()])?;
            run(&[
                "inspect".as_ref(),
                input.as_os_str(),
                "--json".as_ref(),
                "--target".as_ref(),
                "cuda".as_ref(),
            ])?;
            run(&["artifacts".as_ref(), art.as_os_str()])?;
            let patch_args: [&std::ffi::OsStr; 5] = [
                input.as_os_str(),
                "--tokenizer".as_ref(),
                t.as_os_str(),
                "-o".as_ref(),
                patched.as_os_str(),
            ];
            let step_args: [&std::ffi::OsStr; 6] = [
                "step".as_ref(),
                input.as_os_str(),
                "--tokenizer".as_ref(),
                t.as_os_str(),
                "-o".as_ref(),
                step_out.as_os_str(),
            ];
            let patched_ok = run(&patch_args)?;
            validate(if patched_ok { &patched } else { &input })?;
            if run(&step_args)? {
                validate(&step_out)?;
            }
            let left: Vec<String> = std::fs::read_dir(root.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".ntl-patch-"))
                .collect();
            prop_assert!(left.is_empty(), "{:?}", left);
            Ok(())
        });
        result.unwrap();
    }
    let _ = std::io::stderr()
        .lock()
        .write_all(format!("fuzz binary, all commands: {} runs\n", executed.get()).as_bytes());
}

//! Hostile input, by kind, on every command (`ntl-patch MODEL`, `inspect`, `validate`,
//! `artifacts`): malformed nodes, huge or non-finite numbers, files that are not regular
//! files, deep chains and nesting, usage errors, output paths that are not regular files,
//! external data tricks, terminal control characters, interrupted runs. Each run must end with
//! exit 0, or exit 1 and one `error: ` line — never a panic, abort, hang or leftover file.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use common::*;
use ntl_patch::onnx::proto::tensor_proto::DataLocation;
use ntl_patch::onnx::{ModelProto, NodeProto, StringStringEntryProto};
use prost::Message;

const HANG: Duration = Duration::from_secs(60);

/// A folder with `model.onnx` (the given model) and the fixture tokenizer.
fn folder(m: &ModelProto) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.onnx");
    std::fs::write(&path, m.encode_to_vec()).unwrap();
    std::fs::copy(tokenizer(), dir.path().join("tokenizer.json")).unwrap();
    (dir, path)
}

fn run(args: &[&std::ffi::OsStr]) -> Output {
    bin().args(args).timeout(HANG).output().unwrap()
}

fn os<S: AsRef<std::ffi::OsStr> + ?Sized>(s: &S) -> &std::ffi::OsStr {
    s.as_ref()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

/// Exit 1 and exactly one line `error: ...` containing `needle`.
fn refused(out: &Output, needle: &str) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "exit 1 expected: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.contains(needle), "expected '{needle}' in: {err}");
}

/// Exit 0, or exit 1 with one error line: never a panic (101), abort or internal error (2).
fn clean(out: &Output) {
    let err = stderr(out);
    match out.status.code() {
        Some(0) => {}
        Some(1) => {
            assert!(err.starts_with("error: "), "{err}");
            assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        }
        other => panic!("exit {other:?}: {err}"),
    }
}

fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn no_temp_left(dir: &Path) {
    let left: Vec<String> = listing(dir)
        .into_iter()
        .filter(|n| n.starts_with(".ntl-patch-"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
}

fn node_mut<'a>(m: &'a mut ModelProto, name: &str) -> &'a mut NodeProto {
    m.graph
        .as_mut()
        .unwrap()
        .node
        .iter_mut()
        .find(|n| n.name() == name)
        .unwrap_or_else(|| panic!("no node {name}"))
}

/// A patched copy of a fixture, with its tokenizer beside it.
fn patched(name: &str, args: &[&str]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let out = patch(&model(name), dir.path(), args);
    std::fs::copy(tokenizer(), dir.path().join("tokenizer.json")).unwrap();
    (dir, out)
}

// ------------------------------------------------------------------ malformed nodes

#[test]
fn nodes_without_inputs_or_outputs_are_refused_on_every_command() {
    let cases: Vec<(&str, &str, bool)> = vec![
        // (fixture, node, clear outputs instead of inputs)
        ("lm_bvt", "/Transpose_1", false),
        ("lm_nll", "node_Reshape_50", false),
        ("lm_nll", "node_LogSoftmax_47", false),
        ("lm_flat", "/Reshape", false),
        ("lm_flat", "/head/MatMul", false),
        ("lm_flat", "/SoftmaxCrossEntropyLoss", true),
        ("lm_bvt", "/SoftmaxCrossEntropyLoss", false),
    ];
    for (fixture, name, outputs) in cases {
        let mut m = read_model(&model(fixture));
        let n = node_mut(&mut m, name);
        if outputs {
            n.output.clear();
        } else {
            n.input.clear();
        }
        let (dir, path) = folder(&m);
        let out = run(&[os(&path)]);
        refused(&out, "malformed");
        no_temp_left(dir.path());
        clean(&run(&[os("inspect"), os(&path)]));
        clean(&run(&[os("inspect"), os(&path), os("--json")]));
        clean(&run(&[
            os("inspect"),
            os(&path),
            os("--target"),
            os("cuda"),
        ]));
        assert_eq!(listing(dir.path()), ["model.onnx", "tokenizer.json"]);
    }
}

#[test]
fn validate_refuses_malformed_patched_graphs() {
    let (dir, out) = patched("lm_bvt", &[]);
    let m = read_model(&out);
    // nodes of the model and of the patch lose their inputs, then their outputs
    let count = m.graph.as_ref().unwrap().node.len();
    for k in [0, count / 2, count - 3, count - 2, count - 1] {
        let mut m = m.clone();
        let broken = dir.path().join("broken.onnx");
        m.graph.as_mut().unwrap().node[k].input.clear();
        std::fs::write(&broken, m.encode_to_vec()).unwrap();
        clean(&run(&[os("validate"), os(&broken)]));
        m.graph.as_mut().unwrap().node[k].output.clear();
        std::fs::write(&broken, m.encode_to_vec()).unwrap();
        clean(&run(&[os("validate"), os(&broken)]));
    }
}

/// Attributes tract would allocate without bound for (found by the validate fuzz).
#[test]
fn validate_refuses_runaway_attributes() {
    let (dir, out) = patched("lm_bvt", &["--loss", "ntil"]);
    let m = read_model(&out);
    let broken = dir.path().join("broken.onnx");
    let cases: Vec<(&str, ntl_patch::onnx::AttributeProto)> = vec![
        ("Transpose", ntl_patch::onnx::ints_attr("perm", &[1, 1, 0])),
        (
            "OneHot",
            ntl_patch::onnx::int_attr("axis", -4319540435425949101),
        ),
    ];
    for (op, attr) in cases {
        let mut m = m.clone();
        let n = m
            .graph
            .as_mut()
            .unwrap()
            .node
            .iter_mut()
            .find(|n| n.op_type() == op)
            .unwrap();
        n.attribute = vec![attr];
        std::fs::write(&broken, m.encode_to_vec()).unwrap();
        refused(&run(&[os("validate"), os(&broken)]), "malformed");
        refused(&run(&[os(&broken)]), "");
    }
}

#[test]
fn artifacts_refuses_a_gradient_node_without_outputs() {
    let root = artifacts_folder(&[]);
    let dir = root.path().join("art");
    refused(&run(&[os("artifacts"), os(&dir)]), "malformed");
    assert_eq!(listing(root.path()), ["art"]);
}

#[test]
fn artifacts_writes_a_folder_and_leaves_nothing_else() {
    let root = artifacts_folder(&["scores_grad"]);
    let dir = root.path().join("art");
    let out = run(&[os("artifacts"), os(&dir)]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(listing(root.path()), ["art", "art-ntl"]);
    assert_eq!(
        std::fs::read(root.path().join("art-ntl/checkpoint")).unwrap(),
        b"ckpt"
    );
}

#[test]
fn artifacts_does_not_follow_symlinks_out_of_the_folder() {
    let root = artifacts_folder(&["scores_grad"]);
    let dir = root.path().join("art");
    let secret = root.path().join("secret");
    std::fs::write(&secret, b"outside").unwrap();
    for f in ["checkpoint", "optimizer_model.onnx", "training_model.onnx"] {
        let saved = root.path().join("saved");
        std::fs::rename(dir.join(f), &saved).unwrap();
        std::os::unix::fs::symlink("../secret", dir.join(f)).unwrap();
        refused(&run(&[os("artifacts"), os(&dir)]), "outside the folder");
        assert!(!root.path().join("art-ntl").exists());
        std::fs::remove_file(dir.join(f)).unwrap();
        std::fs::rename(&saved, dir.join(f)).unwrap();
    }
    // a symlink that stays inside is fine
    std::fs::rename(dir.join("checkpoint"), dir.join("ckpt.bin")).unwrap();
    std::os::unix::fs::symlink("ckpt.bin", dir.join("checkpoint")).unwrap();
    let out = run(&[os("artifacts"), os(&dir)]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

// ------------------------------------------------------------------ numbers

#[test]
fn numeric_options_are_finite_float32_and_in_range() {
    let (dir, path) = folder(&read_model(&model("lm_flat")));
    for (args, needle) in [
        (&["--weight", "1e39"][..], "--weight"),
        (&["--weight", "-1"], "--weight -1 is out of range"),
        (&["--weight=-1"], "--weight"),
        (&["--weight", "nan"], "--weight"),
        (&["--weight", "inf"], "--weight"),
        (&["--squash", "inf"], "--squash"),
        (&["--squash", "-3"], "--squash"),
        (&["--squash", "1e300"], "--squash"),
        (
            &["--loss", "ntil", "--gumbel-tau", "1e-300"],
            "--gumbel-tau",
        ),
        (&["--loss", "ntil", "--gumbel-tau", "0"], "--gumbel-tau"),
        (&["--loss", "ntil", "--gumbel-tau", "nan"], "--gumbel-tau"),
        (
            &["--loss", "ntil", "--gumbel-noise", "-0.5"],
            "--gumbel-noise",
        ),
        (
            &["--loss", "ntil", "--gumbel-noise", "inf"],
            "--gumbel-noise",
        ),
        (&["--loss", "ntil", "--digit-exp", "1e30"], "--digit-exp"),
        (&["--loss", "ntil", "--abs-alpha", "nan"], "--abs-alpha"),
        (&["--loss", "ntil", "--mag-alpha", "-1"], "--mag-alpha"),
        (
            &["--loss", "ntil", "--digit-alpha", "1e39"],
            "--digit-alpha",
        ),
        (&["--vocab-size", "4611686018427387904"], "--vocab-size"),
        (&["--vocab-size", "18446744073709551615"], "--vocab-size"),
        (&["--vocab-size", "18446744073709551616"], "--vocab-size"),
        (&["--vocab-size", "-1"], "--vocab-size"),
        (&["--vocab-size", "0"], "--vocab-size"),
    ] {
        let mut argv = vec![os(&path)];
        argv.extend(args.iter().map(os));
        refused(&run(&argv), needle);
        assert_eq!(listing(dir.path()), ["model.onnx", "tokenizer.json"]);
    }
    // negative numbers parse as values (then validated), and valid ones work
    let out = run(&[
        os(&path),
        os("--weight"),
        os("0.5"),
        os("-o"),
        os(&dir.path().join("o.onnx")),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

/// Sets every declared dim of the logits path to `width`.
fn with_declared_width(width: i64) -> ModelProto {
    let mut m = read_model(&model("lm_flat"));
    let g = m.graph.as_mut().unwrap();
    g.value_info.push(value(
        "/Reshape_output_0",
        ntl_patch::onnx::proto::tensor_proto::DataType::Float,
        &[None, Some(width)],
    ));
    m
}

#[test]
fn implausible_declared_widths_and_dims_are_refused() {
    for width in [1i64 << 62, -1, 0, i64::MAX] {
        let (_dir, path) = folder(&with_declared_width(width));
        let out = run(&[os(&path)]);
        if width > 0 {
            refused(&out, "not a plausible vocabulary size");
        } else {
            // -1 and 0 declare nothing: the width comes from the graph (48) or is refused
            clean(&out);
        }
        clean(&run(&[os("inspect"), os(&path)]));
    }
    let mut m = read_model(&model("lm_flat"));
    m.graph.as_mut().unwrap().initializer[0].dims[0] = -1;
    let (_dir, path) = folder(&m);
    refused(&run(&[os(&path)]), "negative dimension");
    // dims whose product overflows (the GPU check multiplies them)
    let mut m = read_model(&model("lm_flat"));
    m.graph.as_mut().unwrap().initializer[0].dims = vec![1 << 40, 1 << 40, 1 << 40];
    let (_dir, path) = folder(&m);
    clean(&run(&[
        os("inspect"),
        os(&path),
        os("--target"),
        os("cuda"),
    ]));
    clean(&run(&[os(&path)]));
}

#[test]
fn integer_logits_are_refused() {
    let (_dir, path) = folder(&with_declared_width(48));
    let mut m = read_model(&path);
    let vi = &mut m.graph.as_mut().unwrap().value_info[0];
    if let Some(ntl_patch::onnx::proto::type_proto::Value::TensorType(t)) =
        vi.r#type.as_mut().and_then(|t| t.value.as_mut())
    {
        t.elem_type = Some(7); // INT64
    }
    let (_dir2, path) = folder(&m);
    refused(&run(&[os(&path)]), "not a float type");
}

#[test]
fn validate_caps_batch_and_sequence() {
    let (_dir, out) = patched("lm_flat", &[]);
    for args in [
        &["--batch", "18446744073709551615"][..],
        &["--batch", "1000000", "--seq", "1000000"],
        &["--seq", "4294967296"],
        &["--batch", "-1"],
        &["--rtol", "nan"],
    ] {
        let mut argv = vec![os("validate"), os(&out)];
        argv.extend(args.iter().map(os));
        let o = run(&argv);
        refused(&o, "--");
    }
}

#[test]
fn validate_a_symbolic_vocabulary_patched_with_vocab_size() {
    // no declared shapes, no constant reshape target: the width comes from a shape vector
    let mut m = read_model(&model("lm_flat"));
    let g = m.graph.as_mut().unwrap();
    g.value_info.clear();
    // the Reshape to [-1, V] takes V from the logits' shape at run time
    let reshape = g.node.iter_mut().find(|n| n.name() == "/Reshape").unwrap();
    reshape.input[1] = "flat_shape".into();
    let at = g.node.iter().position(|n| n.name() == "/Reshape").unwrap();
    let int = ntl_patch::onnx::i64_tensor;
    g.initializer
        .extend([int("minus_one", &[1], &[-1]), int("big", &[1], &[i64::MAX])]);
    // logits through an op the width analysis does not look through
    let logits = "neg_logits";
    g.node.splice(
        at..at,
        [node("Neg", &["/head/Add_output_0"], &[logits], vec![])],
    );
    g.node[at + 1].input[0] = logits.into();
    let at = at + 1;
    g.value_info.push(value(
        "/Reshape_output_0",
        ntl_patch::onnx::proto::tensor_proto::DataType::Float,
        &[None, None],
    ));
    g.node.splice(
        at..at,
        [
            node("Shape", &[logits], &["logits_shape"], vec![]),
            node(
                "Slice",
                &["logits_shape", "minus_one", "big"],
                &["width"],
                vec![],
            ),
            node(
                "Concat",
                &["minus_one", "width"],
                &["flat_shape"],
                vec![ntl_patch::onnx::int_attr("axis", 0)],
            ),
        ],
    );
    let (dir, path) = folder(&m);
    let out_path = dir.path().join("out.onnx");
    // the width is proven through the shape vector (Shape → Slice → Concat, crate::graph::shapes):
    // a wrong --vocab-size is refused, the right one agrees
    let out = run(&[
        os(&path),
        os("--vocab-size"),
        os("47"),
        os("-o"),
        os(&out_path),
    ]);
    refused(&out, "--vocab-size");
    let out = run(&[
        os(&path),
        os("--vocab-size"),
        os("48"),
        os("-o"),
        os(&out_path),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let v = run(&[os("validate"), os(&out_path)]);
    assert_eq!(v.status.code(), Some(0), "{}", stderr(&v));
    clean(&run(&[os("inspect"), os(&out_path)]));
}

// ------------------------------------------------------------------ files that are not files

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

#[test]
fn fifos_devices_and_folders_are_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.onnx");
    mkfifo(&fifo);
    let folder_path = dir.path().join("folder.onnx");
    std::fs::create_dir(&folder_path).unwrap();
    std::fs::copy(tokenizer(), dir.path().join("tokenizer.json")).unwrap();
    let (_keep, patched_model) = patched("lm_flat", &[]);
    for (input, kind) in [
        (fifo.as_path(), "FIFO"),
        (folder_path.as_path(), "a directory"),
        (Path::new("/dev/null"), "character device"),
        (Path::new("/dev/zero"), "character device"),
        // regular by their mode, but with no content of their own size
        (
            Path::new("/proc/self/status"),
            "pseudo file of the kernel (procfs)",
        ),
        (Path::new("/sys/devices/system/cpu/online"), "(sysfs)"),
    ] {
        refused(&run(&[os(input)]), kind);
        refused(&run(&[os("inspect"), os(input)]), kind);
        refused(&run(&[os("validate"), os(input)]), kind);
        refused(
            &run(&[
                os(&model("lm_flat")),
                os("--tokenizer"),
                os(input),
                os("-o"),
                os(&dir.path().join("o.onnx")),
            ]),
            kind,
        );
        refused(
            &run(&[
                os("validate"),
                os(&patched_model),
                os("--tokenizer"),
                os(input),
            ]),
            kind,
        );
    }
    assert!(!dir.path().join("o.onnx").exists());
    // a random-bytes device as --tokenizer is refused, not read until memory runs out
    refused(
        &run(&[
            os(&model("lm_flat")),
            os("--tokenizer"),
            os("/dev/urandom"),
            os("-o"),
            os(&dir.path().join("o.onnx")),
        ]),
        "character device",
    );
}

#[test]
fn huge_tokenizer_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("tokenizer.json");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len(ntl_patch::io::limits::MAX_TOKENIZER_BYTES + 1)
        .unwrap(); // sparse
    refused(
        &run(&[
            os(&model("lm_flat")),
            os("--tokenizer"),
            os(&big),
            os("-o"),
            os(&dir.path().join("o.onnx")),
        ]),
        "MiB",
    );
}

// ------------------------------------------------------------------ depth

#[test]
fn long_identity_chains_do_not_overflow_the_stack() {
    let mut m = read_model(&model("lm_flat"));
    let g = m.graph.as_mut().unwrap();
    g.value_info.clear();
    let ce = g
        .node
        .iter()
        .position(|n| n.op_type() == "SoftmaxCrossEntropyLoss")
        .unwrap();
    let scores = g.node[ce].input[0].clone();
    let n = 110_000;
    let chain: Vec<NodeProto> = (0..n)
        .map(|i| {
            let input = if i == 0 {
                scores.clone()
            } else {
                format!("id{}", i - 1)
            };
            NodeProto {
                op_type: Some("Identity".into()),
                input: vec![input],
                output: vec![format!("id{i}")],
                ..Default::default()
            }
        })
        .collect();
    g.node[ce].input[0] = format!("id{}", n - 1);
    g.node.splice(ce..ce, chain);
    let (dir, path) = folder(&m);
    let out_path = dir.path().join("out.onnx");
    // the width is 48 by the graph only through the chain: refused or patched, never a crash
    clean(&run(&[os(&path), os("-o"), os(&out_path)]));
    clean(&run(&[
        os(&path),
        os("--vocab-size"),
        os("48"),
        os("-o"),
        os(&out_path),
    ]));
    clean(&run(&[os("inspect"), os(&path)]));
    if out_path.exists() {
        clean(&run(&[os("validate"), os(&out_path)]));
    }
}

#[test]
fn deep_nesting_is_one_short_line() {
    // a graph attribute holding a graph holding ... 200 deep: prost's recursion limit
    let mut g = ntl_patch::onnx::GraphProto::default();
    for _ in 0..200 {
        g = ntl_patch::onnx::GraphProto {
            node: vec![NodeProto {
                op_type: Some("If".into()),
                attribute: vec![ntl_patch::onnx::AttributeProto {
                    name: Some("then_branch".into()),
                    r#type: Some(5),
                    g: Some(g),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        };
    }
    let mut m = read_model(&model("lm_flat"));
    m.graph.as_mut().unwrap().node[0]
        .attribute
        .push(ntl_patch::onnx::AttributeProto {
            name: Some("x".into()),
            r#type: Some(5),
            g: Some(g),
            ..Default::default()
        });
    let (_dir, path) = folder(&m);
    for cmd in [vec![], vec!["inspect"], vec!["validate"]] {
        let mut argv: Vec<&std::ffi::OsStr> = cmd.iter().map(os).collect();
        argv.push(os(&path));
        let out = run(&argv);
        refused(&out, "nested too deeply");
        assert!(stderr(&out).len() < 400, "short: {}", stderr(&out));
    }
}

#[test]
fn selecting_among_many_cross_entropies_is_fast() {
    let mut m = read_model(&model("lm_flat"));
    let g = m.graph.as_mut().unwrap();
    let ce = g
        .node
        .iter()
        .find(|n| n.op_type() == "SoftmaxCrossEntropyLoss")
        .unwrap()
        .clone();
    for i in 0..10_000 {
        let mut c = ce.clone();
        c.name = Some(format!("ce{i}"));
        c.output = vec![format!("loss{i}")];
        g.node.push(c);
    }
    let (dir, path) = folder(&m);
    let started = std::time::Instant::now();
    let out = run(&[
        os(&path),
        os("--ce-node"),
        os("ce9999"),
        os("-o"),
        os(&dir.path().join("o.onnx")),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
}

// ------------------------------------------------------------------ usage errors

#[test]
fn usage_errors_are_one_line_exit_1() {
    // what clap says on the lines after its first (the missing argument's name, the
    // possible values) stays in the one line
    for (args, needle) in [
        (&["--bogus"][..], "--bogus"),
        (&[], "provided: <MODEL>"),
        (&["inspect"], "provided: <MODEL>"),
        (&["validate"], "provided: <MODEL>"),
        (&["step"], "provided: <MODEL>"),
        (&["artifacts"], "provided: <DIR>"),
        (
            &["model.onnx", "--loss", "nope"],
            "[possible values: wasserstein, mse",
        ),
        (&["model.onnx", "--weight"], "--weight"),
        (&["model.onnx", "--weight", "abc"], "abc"),
    ] {
        let argv: Vec<&std::ffi::OsStr> = args.iter().map(os).collect();
        let out = run(&argv);
        refused(&out, needle);
        assert!(stderr(&out).contains("--help"), "{}", stderr(&out));
    }
    let help = run(&[os("--help")]);
    assert_eq!(help.status.code(), Some(0));
}

// ------------------------------------------------------------------ output paths

#[test]
fn outputs_that_are_not_regular_files_are_refused() {
    let (dir, path) = folder(&read_model(&model("lm_flat")));
    let fifo = dir.path().join("fifo.onnx");
    mkfifo(&fifo);
    let sub = dir.path().join("sub.onnx");
    std::fs::create_dir(&sub).unwrap();
    let target = dir.path().join("target.onnx");
    std::fs::write(&target, b"keep").unwrap();
    let link = dir.path().join("link.onnx");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    for (out, kind) in [
        (&fifo, "FIFO"),
        (&sub, "a directory"),
        (&link, "a symbolic link"),
    ] {
        refused(&run(&[os(&path), os("-o"), os(out)]), kind);
    }
    let missing = dir.path().join("no_such_folder").join("out.onnx");
    refused(&run(&[os(&path), os("-o"), os(&missing)]), "the folder '");
    let meta = std::fs::symlink_metadata(&fifo).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(&meta.file_type()));
    assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    no_temp_left(dir.path());
    // an existing regular file is replaced
    let out = run(&[os(&path), os("-o"), os(&target)]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_ne!(std::fs::read(&target).unwrap(), b"keep");
}

#[test]
fn an_append_only_folder_is_refused_and_left_clean() {
    let (dir, path) = folder(&read_model(&model("lm_flat")));
    let out_dir = dir.path().join("appendonly");
    std::fs::create_dir(&out_dir).unwrap();
    let ok = std::process::Command::new("chattr")
        .arg("+a")
        .arg(&out_dir)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!(
            "chattr +a not available here (needs root and a supporting file system): skipped"
        );
        return;
    }
    let out = run(&[os(&path), os("-o"), os(&out_dir.join("o.onnx"))]);
    let left = listing(&out_dir);
    let _ = std::process::Command::new("chattr")
        .arg("-a")
        .arg(&out_dir)
        .status();
    refused(&out, "append-only");
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn stale_temporaries_of_killed_runs_are_removed() {
    let (dir, path) = folder(&read_model(&model("lm_flat")));
    let old = std::time::SystemTime::now() - Duration::from_secs(600);
    let stale = dir.path().join(".ntl-patch-Ab12Cd.tmp");
    let unrelated = dir.path().join(".ntl-patch-notours.tmp");
    let stale_dir = dir.path().join(".ntl-patch-Zz99Yy.tmp");
    for f in [&stale, &unrelated] {
        std::fs::File::create(f).unwrap().set_modified(old).unwrap();
    }
    std::fs::create_dir(&stale_dir).unwrap();
    std::fs::File::open(&stale_dir)
        .unwrap()
        .set_modified(old)
        .unwrap();
    let out = run(&[os(&path), os("-o"), os(&dir.path().join("o.onnx"))]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(!stale.exists() && !stale_dir.exists());
    assert!(unrelated.exists());
}

// ------------------------------------------------------------------ signals

/// A model with a large extra initializer, so writing it takes a while.
fn big_model(dir: &Path, bytes: usize) -> PathBuf {
    let mut m = read_model(&model("lm_flat"));
    let mut t = ntl_patch::onnx::f32_tensor("big", &[(bytes / 4) as i64], &[]);
    t.raw_data = Some(vec![1u8; bytes].into());
    m.graph.as_mut().unwrap().initializer.push(t);
    let path = dir.join("model.onnx");
    std::fs::write(&path, m.encode_to_vec()).unwrap();
    std::fs::copy(tokenizer(), dir.join("tokenizer.json")).unwrap();
    path
}

/// True when process `pid` has a file in `dir` open (named or not: an unnamed `O_TMPFILE`
/// shows as `dir/#inode (deleted)`).
fn writes_into(pid: u32, dir: &Path) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|fds| {
        fds.flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t.starts_with(dir)))
    })
}

#[test]
fn interrupted_writes_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = big_model(dir.path(), 512 << 20);
    let out_dir = dir.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let mut caught = 0;
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("ntl-patch"))
            .arg(&path)
            .arg("-o")
            .arg(out_dir.join("o.onnx"))
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        // wait for the output to be written (an unnamed file in the folder), then interrupt
        while !writes_into(child.id(), &out_dir)
            && started.elapsed() < Duration::from_secs(60)
            && child.try_wait().unwrap().is_none()
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        unsafe { libc::kill(child.id() as i32, sig) };
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        if status.signal() == Some(sig) {
            caught += 1;
        }
        let left: Vec<String> = listing(&out_dir)
            .into_iter()
            .filter(|n| n != "o.onnx")
            .collect();
        assert!(left.is_empty(), "signal {sig}: left {left:?}");
        let _ = std::fs::remove_file(out_dir.join("o.onnx"));
    }
    assert!(caught >= 1, "no run was interrupted mid-write");
}

// ------------------------------------------------------------------ external data

fn external(location: &str, extra: &[(&str, &str)]) -> Vec<StringStringEntryProto> {
    std::iter::once(("location", location))
        .chain(extra.iter().copied())
        .map(|(k, v)| StringStringEntryProto {
            key: Some(k.into()),
            value: Some(v.into()),
        })
        .collect()
}

#[test]
fn every_external_data_key_and_tensor_is_checked() {
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("secret.bin"), vec![0u8; 64]).unwrap();
    let base = read_model(&model("lm_flat"));
    let mut cases: Vec<(ModelProto, &str)> = Vec::new();
    // duplicate location keys: onnx and ORT read the last one
    let mut m = base.clone();
    let t = &mut m.graph.as_mut().unwrap().initializer[0];
    t.raw_data = None;
    t.data_location = Some(DataLocation::External as i32);
    t.external_data = external("data.bin", &[("location", "../secret.bin")]);
    cases.push((m, "more than one 'location'"));
    // a tensor inside a model-local function
    let mut m = base.clone();
    let mut c = ntl_patch::onnx::f32_tensor("c", &[1], &[]);
    c.data_location = Some(DataLocation::External as i32);
    c.external_data = external("/etc/passwd", &[]);
    m.functions.push(ntl_patch::onnx::proto::FunctionProto {
        name: Some("f".into()),
        domain: Some("local".into()),
        node: vec![NodeProto {
            op_type: Some("Constant".into()),
            output: vec!["y".into()],
            attribute: vec![ntl_patch::onnx::tensor_attr("value", c.clone())],
            ..Default::default()
        }],
        ..Default::default()
    });
    cases.push((m, "'/etc/passwd'"));
    // a sparse initializer
    let mut m = base.clone();
    c.name = Some("sparse_values".into());
    c.external_data = external("../secret.bin", &[]);
    m.graph
        .as_mut()
        .unwrap()
        .sparse_initializer
        .push(ntl_patch::onnx::proto::SparseTensorProto {
            values: Some(c.clone()),
            ..Default::default()
        });
    cases.push((m, "'../secret.bin'"));
    // offsets past the end of the file
    let mut m = base.clone();
    let t = &mut m.graph.as_mut().unwrap().initializer[0];
    t.raw_data = None;
    t.data_location = Some(DataLocation::External as i32);
    t.external_data = external("data.bin", &[("offset", "999999")]);
    cases.push((m, "past the end"));
    for (m, needle) in cases {
        let dir = root.path().join("m");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("data.bin"), vec![0u8; 4096]).unwrap();
        std::fs::write(dir.join("model.onnx"), m.encode_to_vec()).unwrap();
        std::fs::copy(tokenizer(), dir.join("tokenizer.json")).unwrap();
        for out in [dir.join("o.onnx"), root.path().join("o.onnx")] {
            refused(
                &run(&[os(&dir.join("model.onnx")), os("-o"), os(&out)]),
                needle,
            );
            assert!(!out.exists());
        }
        assert!(!root.path().join("secret.bin.copy").exists());
    }
    // validate's runtimes open external data themselves: the same checks run first
    let (dir, out) = patched("lm_flat", &[]);
    let mut m = read_model(&out);
    let t = &mut m.graph.as_mut().unwrap().initializer[0];
    t.raw_data = None;
    t.data_location = Some(DataLocation::External as i32);
    t.external_data = external("../secret.bin", &[]);
    std::fs::write(dir.path().join("escape.onnx"), m.encode_to_vec()).unwrap();
    refused(
        &run(&[os("validate"), os(&dir.path().join("escape.onnx"))]),
        "external data location '../secret.bin'",
    );
}

// ------------------------------------------------------------------ terminal output

#[test]
fn control_and_bidi_characters_are_escaped_in_every_output() {
    let mut m = read_model(&model("lm_flat"));
    let g = m.graph.as_mut().unwrap();
    let ce = g
        .node
        .iter_mut()
        .find(|n| n.op_type() == "SoftmaxCrossEntropyLoss")
        .unwrap();
    ce.name = Some("ce\u{202e}xnn.\x1b[31mred\nline".into());
    // a node of an op no GPU provider knows, so the GPU report lists its name
    g.node.push(NodeProto {
        name: Some("odd\u{202e}\nnode".into()),
        op_type: Some("Bogus\u{2066}Op".into()),
        domain: Some("x\u{202e}y".into()),
        ..Default::default()
    });
    let (dir, path) = folder(&m);
    let out_path = dir.path().join("o\u{202e}\u{1b}.onnx");
    let outputs = [
        run(&[os(&path), os("-o"), os(&out_path)]),
        run(&[os("inspect"), os(&path)]),
        run(&[os("inspect"), os(&path), os("--json")]),
        run(&[os("inspect"), os(&path), os("--target"), os("cuda")]),
        run(&[
            os(&path),
            os("--ce-node"),
            os("nope"),
            os("-o"),
            os(&out_path),
        ]),
        run(&[os("validate"), os(&out_path)]),
    ];
    assert_eq!(outputs[0].status.code(), Some(0), "{}", stderr(&outputs[0]));
    for out in &outputs {
        for text in [
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        ] {
            assert!(
                !text.contains('\u{202e}') && !text.contains('\x1b'),
                "raw: {text:?}"
            );
            assert!(
                !text.contains("\nline") && !text.contains("\nnode"),
                "raw newline: {text:?}"
            );
        }
    }
    assert!(String::from_utf8_lossy(&outputs[0].stdout).contains("\\u{202e}"));
    let v: serde_json::Value = serde_json::from_slice(&outputs[2].stdout).unwrap();
    assert_eq!(
        v["cross_entropy"][0]["node"].as_str().unwrap(),
        "ce\u{202e}xnn.\x1b[31mred\nline"
    );
}

#[test]
fn sparse_initializer_names_are_taken() {
    let mut m = read_model(&model("lm_flat"));
    let g = m.graph.as_mut().unwrap();
    for name in ["ntl/weight", "ntl/weight_1", "ntl/values"] {
        g.sparse_initializer
            .push(ntl_patch::onnx::proto::SparseTensorProto {
                values: Some(ntl_patch::onnx::f32_tensor(name, &[1], &[0.0])),
                indices: Some(ntl_patch::onnx::i64_tensor(
                    &format!("{name}_i"),
                    &[1, 1],
                    &[0],
                )),
                dims: vec![4],
            });
    }
    let (dir, path) = folder(&m);
    let out_path = dir.path().join("o.onnx");
    let out = run(&[os(&path), os("-o"), os(&out_path)]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let p = read_model(&out_path);
    let g = p.graph.as_ref().unwrap();
    let mut names: Vec<&str> = g
        .initializer
        .iter()
        .map(|t| t.name())
        .chain(
            g.sparse_initializer
                .iter()
                .filter_map(|s| s.values.as_ref().map(|v| v.name())),
        )
        .chain(
            g.node
                .iter()
                .flat_map(|n| n.output.iter().map(String::as_str)),
        )
        .collect();
    let n = names.len();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), n, "every tensor name is unique");
}

// ------------------------------------------------------------------ memory

/// A sparse file of zeros is no protobuf from its first byte (key 0): every command refuses it
/// at once, however big (the pre-pass stops where the decoder will; `prescan`'s unit test
/// checks it reads nothing further).
#[test]
fn a_huge_file_of_zeros_is_refused_at_its_first_byte() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("zeros.onnx");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(16 << 30)
        .unwrap(); // sparse: no disk blocks
    for args in [
        vec![os(&path), os("--tokenizer"), os(&tokenizer())],
        vec![os("inspect"), os(&path)],
        vec![os("validate"), os(&path)],
        vec![os("step"), os(&path), os("--tokenizer"), os(&tokenizer())],
    ] {
        refused(&run(&args), "is not an ONNX model (protobuf decode failed");
    }
    no_temp_left(dir.path());
}

#[test]
fn small_files_of_many_empty_messages_are_refused_before_decoding() {
    // lm_flat plus a second `graph` field (protobuf merges it into the first) holding one node
    // with 2.5 million empty attributes: 5 MB on disk, gigabytes decoded
    let mut node = Vec::new();
    for _ in 0..2_500_000 {
        node.extend_from_slice(&[0x2a, 0x00]); // NodeProto.attribute (5), length 0
    }
    let mut graph = vec![0x0a]; // GraphProto.node (1)
    prost::encoding::encode_varint(node.len() as u64, &mut graph);
    graph.extend_from_slice(&node);
    let mut bytes = std::fs::read(model("lm_flat")).unwrap();
    bytes.push(0x3a); // ModelProto.graph (7)
    prost::encoding::encode_varint(graph.len() as u64, &mut bytes);
    bytes.extend_from_slice(&graph);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.onnx");
    std::fs::write(&path, &bytes).unwrap();
    std::fs::copy(tokenizer(), dir.path().join("tokenizer.json")).unwrap();
    for cmd in [vec![], vec!["inspect"], vec!["validate"]] {
        let mut argv: Vec<&std::ffi::OsStr> = cmd.iter().map(os).collect();
        argv.push(os(&path));
        refused(&run(&argv), "MiB of memory to decode");
    }
}

/// Another process truncates the (memory-mapped) input while it is written out: the run
/// either finished first, or stops with one line (SIGBUS or a short copy), leaving nothing.
#[test]
fn an_input_truncated_mid_run_is_one_error_line_and_no_leftover() {
    // lm_flat plus a merged second `graph` field of 100 000 small initializers (2 kB each,
    // encoded from the map on save, so the truncated pages are touched)
    let mut extra = Vec::new();
    for i in 0..100_000 {
        let mut t = ntl_patch::onnx::f32_tensor(&format!("small.{i}"), &[512], &[]);
        t.raw_data = Some(vec![7u8; 2048].into());
        let bytes = t.encode_to_vec();
        extra.push(0x2a); // GraphProto.initializer (5)
        prost::encoding::encode_varint(bytes.len() as u64, &mut extra);
        extra.extend_from_slice(&bytes);
    }
    let mut bytes = std::fs::read(model("lm_flat")).unwrap();
    bytes.push(0x3a); // ModelProto.graph (7)
    prost::encoding::encode_varint(extra.len() as u64, &mut bytes);
    bytes.extend_from_slice(&extra);
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(tokenizer(), dir.path().join("tokenizer.json")).unwrap();
    let input = dir.path().join("model.onnx");
    let out = dir.path().join("out.onnx");
    for delay_ms in [50u64, 150, 400] {
        std::fs::write(&input, &bytes).unwrap();
        let _ = std::fs::remove_file(&out);
        let child = std::process::Command::new(assert_cmd::cargo::cargo_bin("ntl-patch"))
            .arg(&input)
            .arg("-o")
            .arg(&out)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        std::fs::OpenOptions::new()
            .write(true)
            .open(&input)
            .unwrap()
            .set_len(bytes.len() as u64 / 3)
            .unwrap();
        let result = child.wait_with_output().unwrap();
        match result.status.code() {
            Some(0) => assert!(read_model(&out).graph.is_some()),
            _ => {
                refused(&result, "");
                assert!(!out.exists());
            }
        }
        no_temp_left(dir.path());
    }
}

#[test]
fn an_interrupted_artifacts_run_leaves_no_folder() {
    let root = tempfile::tempdir().unwrap();
    let mut training = training_graph(&["scores_grad"]);
    let mut t = ntl_patch::onnx::f32_tensor("big", &[(256 << 20) / 4], &[]);
    t.raw_data = Some(vec![1u8; 256 << 20].into());
    training.graph.as_mut().unwrap().initializer.push(t);
    let dir = artifacts_folder_with(root.path(), &training);
    let mut interrupted = 0;
    for sig in [libc::SIGINT, libc::SIGTERM] {
        let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("ntl-patch"))
            .arg("artifacts")
            .arg(&dir)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        while !listing(root.path())
            .iter()
            .any(|n| n.starts_with(".ntl-patch-"))
            && started.elapsed() < Duration::from_secs(60)
            && child.try_wait().unwrap().is_none()
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        unsafe { libc::kill(child.id() as i32, sig) };
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        if status.signal() == Some(sig) {
            interrupted += 1;
            assert_eq!(listing(root.path()), ["art"], "signal {sig}");
        }
        let _ = std::fs::remove_dir_all(root.path().join("art-ntl"));
    }
    assert!(interrupted >= 1, "no run was interrupted mid-write");
}

/// Issue 35: a signal late in an artifacts run (the training graph's large external data
/// written, the eval graph being written) must leave neither the output folder
/// nor its temporary. It used to leave `art-ntl/` with the files written while the signal
/// thread was still removing the temporary folder (the rename carried them into place), or
/// the temporary folder itself (its removal failed on the files created meanwhile).
#[test]
fn a_late_interrupted_artifacts_run_with_external_data_leaves_no_folder() {
    let root = tempfile::tempdir().unwrap();
    let art = root.path().join("art");
    std::fs::create_dir_all(&art).unwrap();
    let big = 768usize << 20;
    std::fs::write(art.join("training.bin"), vec![1u8; big]).unwrap();
    let mut training = training_graph(&["scores_grad"]);
    let mut t = ntl_patch::onnx::f32_tensor("big", &[(big / 4) as i64], &[]);
    t.data_location = Some(DataLocation::External as i32);
    t.external_data = external("training.bin", &[("length", &big.to_string())]);
    training.graph.as_mut().unwrap().initializer.push(t);
    let dir = artifacts_folder_with(root.path(), &training);
    let mut interrupted = 0;
    for round in 0..4 {
        let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("ntl-patch"))
            .arg("artifacts")
            .arg(&dir)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        // wait for the training graph to be complete in the temporary folder (over 90 % of
        // the bytes written): the rest is the eval graph, two small copies and the rename
        let tmp_holds = |name: &str| {
            listing(root.path())
                .iter()
                .filter(|n| n.starts_with(".ntl-patch-"))
                .any(|t| root.path().join(t).join(name).exists())
        };
        while !tmp_holds("training_model.onnx")
            && started.elapsed() < Duration::from_secs(120)
            && child.try_wait().unwrap().is_none()
        {}
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        let out = root.path().join("art-ntl");
        let complete = [
            "checkpoint",
            "eval_model.onnx",
            "optimizer_model.onnx",
            "training.bin",
            "training_model.onnx",
        ];
        if out.exists() {
            // renamed into place before the signal was handled: all of it
            let left = listing(&out);
            assert_eq!(left, complete, "round {round}: a partial output folder");
            assert_eq!(
                std::fs::metadata(out.join("training.bin")).unwrap().len(),
                big as u64
            );
        }
        if !status.success() {
            interrupted += 1;
        }
        let names = listing(root.path());
        assert!(
            names == ["art"] || names == ["art", "art-ntl"],
            "round {round}: exit {:?} signal {:?}, left {names:?}",
            status.code(),
            status.signal()
        );
        let _ = std::fs::remove_dir_all(root.path().join("art-ntl"));
    }
    assert!(interrupted >= 1, "no run was interrupted mid-write");
}

/// External data copied next to an output in another folder is part of the output: an
/// interrupted run removes the copies it already finished too.
#[test]
fn an_interrupted_copy_of_external_data_leaves_nothing() {
    let root = tempfile::tempdir().unwrap();
    let src = root.path().join("src");
    let dst = root.path().join("dst");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(&dst).unwrap();
    let size = 256usize << 20;
    let mut m = read_model(&model("lm_flat"));
    for (k, file) in ["a.bin", "b.bin"].iter().enumerate() {
        std::fs::write(src.join(file), vec![k as u8 + 1; size]).unwrap();
        let mut t = ntl_patch::onnx::f32_tensor(&format!("ext{k}"), &[(size / 4) as i64], &[]);
        t.data_location = Some(DataLocation::External as i32);
        t.external_data = external(file, &[("length", &size.to_string())]);
        m.graph.as_mut().unwrap().initializer.push(t);
    }
    std::fs::write(src.join("model.onnx"), m.encode_to_vec()).unwrap();
    std::fs::copy(tokenizer(), src.join("tokenizer.json")).unwrap();
    let mut interrupted = 0;
    for _ in 0..3 {
        let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("ntl-patch"))
            .arg(src.join("model.onnx"))
            .arg("-o")
            .arg(dst.join("o.onnx"))
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        // wait for the first copy to be in place, then interrupt the second
        while !dst.join("a.bin").exists()
            && started.elapsed() < Duration::from_secs(60)
            && child.try_wait().unwrap().is_none()
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        if status.signal() == Some(libc::SIGINT) {
            interrupted += 1;
            assert!(listing(&dst).is_empty(), "left: {:?}", listing(&dst));
        } else {
            for f in listing(&dst) {
                std::fs::remove_file(dst.join(f)).unwrap();
            }
        }
    }
    assert!(interrupted >= 1, "no run was interrupted mid-copy");
}

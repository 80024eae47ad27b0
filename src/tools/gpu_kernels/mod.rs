//! GPU readiness: does an ONNX Runtime GPU execution provider take every node of a graph, or
//! would some node fall back to the CPU? Targets ([`Target`]): `cuda` (onnxruntime-gpu 1.31.1),
//! `rocm` (onnxruntime-rocm 1.22.2), `migraphx` (onnxruntime-migraphx 1.27.1), `cuda-1.19` and
//! `rocm-1.19` (onnxruntime-training 1.19.2). [`fallback_nodes`] lists the nodes that would not
//! run on the provider.
//!
//! Committed tables, embedded at build time (`data/README.md`):
//! - `data/ort-1.19-kernels.tsv`, `data/ort-1.31.1-cuda-kernels.tsv`,
//!   `data/ort-1.22.2-rocm-kernels.tsv`: every kernel the providers (and the CPU provider) of
//!   those releases register (op, domain, version range, type constraints, CPU-memory
//!   inputs/outputs), extracted from ORT's source by `scripts/gen/gen_kernel_table.py`;
//! - `data/ort-1.27.1-migraphx-ops.tsv`: the MIGraphX provider's supported-op list (it registers
//!   no kernels; its rules are modelled in the [`migraphx`] module);
//! - `data/onnx-1.16-schemas.tsv`: the version history and type parameters of every ONNX
//!   operator up to opset 21 (ONNX 1.16.1, the ONNX that ORT 1.19.2 is built with), written by
//!   `scripts/gen/gen_onnx_schemas.py` from the onnx wheel.
//!
//! A node is matched the way ORT's kernel registry matches it (`kernel_registry.cc`):
//! 1. its op version is the latest version of the op at or below the model's opset for its
//!    domain;
//! 2. a kernel's version range fits when it STARTS at that version, or when it has an end
//!    version and spans it: an open-ended kernel registered at 13 does not serve a version-14
//!    node (ORT cannot know that version 14 did not change the op);
//! 3. for each type constraint of the kernel, the first present input (then output) that the
//!    op's schema binds to that type parameter must have one of the kernel's types.
//!
//! Besides missing kernels, the CUDA provider refuses `Cast` to string, and both providers hand
//! cheap shape arithmetic to the CPU on purpose (`GetCpuPreferredNodes`,
//! `fallback_cpu_capability.cc`): nodes whose every input comes from CPU memory (a `Shape`
//! output, a graph input, an initializer of at most 100 elements). That placement is simulated
//! and reported apart: it is not a missing kernel. ORT runs it after its own graph optimizations,
//! so on a real session the set can differ (constant folding removes shape arithmetic on static
//! shapes).

//! The modules, one job each, lowest first: [`target`] (the providers and releases), [`tables`]
//! (the embedded kernel and schema tables), [`nodes`] (what the checks ask of a node),
//! [`matching`] (one node against a provider's kernels), [`migraphx`] (the MIGraphX provider's
//! rules, in place of kernels), [`cpu_preferred`] (ORT's own CPU placement of shape arithmetic),
//! [`report`] (the report's groups, text and JSON) and [`check`] (a whole model: every node
//! placed, grouped and reported). Element types come from `graph::elem_types::TypeNames`.

pub mod check;
pub mod cpu_preferred;
pub mod matching;
pub mod migraphx;
pub mod nodes;
pub mod report;
pub mod tables;
pub mod target;

pub use check::{check_model, check_model_with, fallback_nodes, FallbackNode};
pub use matching::{place_node, Missing, Placement};
pub use nodes::{is_ntl_node, model_opsets};
pub use ntl_ops::schema::{canonical_domain, Param, Schema, SCHEMA_TABLE};
pub use report::{GpuReport, OpGroup};
pub use tables::{
    tables, tables_for, Kernel, Tables, CUDA_KERNEL_TABLE, KERNEL_TABLE, MIGRAPHX_OP_TABLE,
    ROCM_KERNEL_TABLE,
};
pub use target::{Target, MAX_ONNX_OPSET, ORT_VERSION};

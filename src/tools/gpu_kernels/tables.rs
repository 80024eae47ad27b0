//! The embedded kernel tables (`data/`), parsed once: each provider's kernels by op, and the
//! ONNX operator schemas they are matched against.

use std::collections::HashMap;
use std::sync::OnceLock;

use super::target::Target;
use ntl_ops::schema::{canonical_domain, tsv_rows, Schema, Schemas, SCHEMA_TABLE};

/// The ONNX Runtime Training 1.19.2 kernel table (CUDA, ROCm and CPU registrations).
pub const KERNEL_TABLE: &str = include_str!("../../../data/ort-1.19-kernels.tsv");
/// onnxruntime-gpu 1.31.1: CUDA and CPU registrations.
pub const CUDA_KERNEL_TABLE: &str = include_str!("../../../data/ort-1.31.1-cuda-kernels.tsv");
/// onnxruntime-rocm 1.22.2: ROCm and CPU registrations.
pub const ROCM_KERNEL_TABLE: &str = include_str!("../../../data/ort-1.22.2-rocm-kernels.tsv");
/// onnxruntime-migraphx 1.27.1: the MIGraphX provider's supported-op list.
pub const MIGRAPHX_OP_TABLE: &str = include_str!("../../../data/ort-1.27.1-migraphx-ops.tsv");

/// One registered kernel.
#[derive(Debug, Clone)]
pub struct Kernel {
    pub since: i64,
    /// Last version, `None` for an open-ended kernel.
    pub end: Option<i64>,
    /// The type in the kernel's class name (`float`, `int64_t_float_int64_t`), if any.
    pub class_type: Option<String>,
    /// Type parameter -> accepted ONNX types; `None` for a parameter whose types the generator
    /// could not resolve (not checked). Empty when the kernel declares no constraint.
    pub constraints: Vec<(String, Option<Vec<String>>)>,
    /// Inputs and outputs the kernel keeps in CPU memory.
    pub cpu_inputs: Vec<usize>,
    pub cpu_outputs: Vec<usize>,
    /// Preprocessor condition of the registration, if any.
    pub condition: Option<String>,
    /// The ORT source file that defines the kernel.
    pub source: String,
}

impl Kernel {
    /// ORT's `VerifyVersion`: exact start, or a closed range that spans the version.
    pub fn serves_version(&self, version: i64) -> bool {
        self.since == version
            || matches!(self.end, Some(end) if self.since <= version && version <= end)
    }

    /// `13` (open-ended kernels serve their start version only), `13-18`.
    pub fn range(&self) -> String {
        match self.end {
            Some(e) if e != self.since => format!("{}-{}", self.since, e),
            _ => format!("{}", self.since),
        }
    }
}

/// The embedded tables, parsed once.
pub struct Tables {
    /// (provider, domain, op) -> kernels
    kernels: HashMap<(String, String, String), Vec<Kernel>>,
    /// The ONNX operator schemas the kernels are matched against.
    schemas: Schemas,
    /// The header comment of the kernel table (version and commit).
    pub kernel_provenance: String,
}

fn parse_indices(s: &str, key: &str) -> Vec<usize> {
    s.split(';')
        .filter_map(|part| part.strip_prefix(key))
        .flat_map(|list| list.split(',').filter_map(|i| i.parse().ok()))
        .collect()
}

impl Tables {
    pub fn parse(kernel_tsv: &str, schema_tsv: &str) -> Result<Tables, String> {
        let mut kernels: HashMap<(String, String, String), Vec<Kernel>> = HashMap::new();
        let provenance: Vec<String> = kernel_tsv
            .lines()
            .filter_map(|l| l.strip_prefix('#'))
            .map(|c| c.trim().to_string())
            .collect();
        for row in tsv_rows(kernel_tsv, "provider\t", 10, "kernel") {
            let (no, f) = row?;
            if !matches!(f[0], "cuda" | "rocm" | "cpu") {
                return Err(format!("kernel table line {}: provider '{}'", no + 1, f[0]));
            }
            let num = |s: &str| {
                s.parse::<i64>()
                    .map_err(|_| format!("kernel table line {}: version '{s}'", no + 1))
            };
            let constraints = if f[6] == "-" || f[6] == "?" {
                Vec::new()
            } else {
                f[6].split(';')
                    .map(|c| {
                        let (name, types) = c.split_once('=').unwrap_or((c, "?"));
                        let types =
                            (types != "?").then(|| types.split(',').map(str::to_string).collect());
                        (name.to_string(), types)
                    })
                    .collect()
            };
            let kernel = Kernel {
                since: num(f[3])?,
                end: if f[4] == "-" { None } else { Some(num(f[4])?) },
                class_type: (f[5] != "-").then(|| f[5].to_string()),
                constraints: if f[6] == "?" {
                    vec![("?".to_string(), None)]
                } else {
                    constraints
                },
                cpu_inputs: parse_indices(f[7], "in:"),
                cpu_outputs: parse_indices(f[7], "out:"),
                condition: (f[8] != "-").then(|| f[8].to_string()),
                source: f[9].to_string(),
            };
            kernels
                .entry((f[0].to_string(), f[1].to_string(), f[2].to_string()))
                .or_default()
                .push(kernel);
        }
        let schemas = Schemas::parse(schema_tsv)?;
        Ok(Tables {
            kernels,
            schemas,
            kernel_provenance: provenance.join(" "),
        })
    }

    /// The kernels a provider (`cuda`, `rocm`, `cpu`) registers for an op (any version).
    pub fn kernels(&self, provider: &str, domain: &str, op: &str) -> &[Kernel] {
        self.kernels
            .get(&(
                provider.to_string(),
                canonical_domain(domain).to_string(),
                op.to_string(),
            ))
            .map_or(&[], Vec::as_slice)
    }

    /// The schema in effect for `op` at `opset` of its domain: the latest version <= opset.
    pub fn schema(&self, domain: &str, op: &str, opset: i64) -> Option<&Schema> {
        self.schemas.schema(domain, op, opset)
    }

    /// The ONNX operator schemas.
    pub fn schemas(&self) -> &Schemas {
        &self.schemas
    }

    /// Whether the schema table knows the op at all (any version).
    pub fn knows_op(&self, domain: &str, op: &str) -> bool {
        self.schemas.knows_op(domain, op)
    }

    /// The version of `op` in effect at `opset`: from the ONNX schemas for ONNX domains; ORT's
    /// own operators (`com.microsoft`: contrib and training ops) all have version 1 in 1.19.
    pub fn op_version(&self, domain: &str, op: &str, opset: i64) -> Option<i64> {
        if let Some(s) = self.schema(domain, op, opset) {
            return Some(s.since);
        }
        (canonical_domain(domain) == "com.microsoft" && opset >= 1).then_some(1)
    }
}

/// The embedded ONNX Runtime 1.19.2 tables (parsed on first use).
pub fn tables() -> &'static Tables {
    tables_for(Target::Cuda119)
}

/// The embedded tables a target is checked against (parsed on first use). `migraphx` has no
/// kernel table: it gets the onnxruntime-gpu 1.31.1 table, whose CPU rows stand for the CPU
/// provider a node the MIGraphX provider does not take falls back to.
pub fn tables_for(target: Target) -> &'static Tables {
    static ORT119: OnceLock<Tables> = OnceLock::new();
    static CUDA: OnceLock<Tables> = OnceLock::new();
    static ROCM: OnceLock<Tables> = OnceLock::new();
    let (cell, text) = match target {
        Target::Cuda119 | Target::Rocm119 => (&ORT119, KERNEL_TABLE),
        Target::Cuda | Target::Migraphx => (&CUDA, CUDA_KERNEL_TABLE),
        Target::Rocm => (&ROCM, ROCM_KERNEL_TABLE),
    };
    cell.get_or_init(|| Tables::parse(text, SCHEMA_TABLE).expect("embedded kernel tables parse"))
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_tables_parse_and_cover_both_providers() {
        let t = tables();
        for target in [Target::Cuda119, Target::Rocm119] {
            assert!(!t.kernels(target.ep(), "", "MatMul").is_empty());
            assert!(!t
                .kernels(target.ep(), "ai.onnx", "SoftmaxCrossEntropyLoss")
                .is_empty());
        }
        assert!(t.kernel_provenance.contains("1.19.2"));
        for target in [Target::Cuda, Target::Rocm] {
            let t = tables_for(target);
            assert!(!t.kernels(target.ep(), "", "MatMul").is_empty());
            assert!(!t.kernels("cpu", "", "MatMul").is_empty());
            assert!(t.kernel_provenance.contains(target.package()));
            // the inference tables hold their provider and the CPU only
            assert!(t.kernels("cuda", "", "MatMul").is_empty() != (target == Target::Cuda));
        }
    }

    #[test]
    fn version_in_effect_is_the_latest_at_or_below_the_opset() {
        let t = tables();
        assert_eq!(t.op_version("", "ReduceMax", 17), Some(13));
        assert_eq!(t.op_version("", "ReduceMax", 18), Some(18));
        assert_eq!(t.op_version("", "ArgMax", 17), Some(13));
        assert_eq!(t.op_version("", "Softmax", 12), Some(11));
        assert_eq!(
            t.op_version("com.microsoft", "SoftmaxCrossEntropyLossGrad", 1),
            Some(1)
        );
        assert_eq!(t.op_version("", "NoSuchOp", 17), None);
    }

    #[test]
    fn open_ended_kernels_serve_only_their_start_version() {
        let k = Kernel {
            since: 13,
            end: None,
            class_type: None,
            constraints: vec![],
            cpu_inputs: vec![],
            cpu_outputs: vec![],
            condition: None,
            source: String::new(),
        };
        assert!(k.serves_version(13));
        assert!(!k.serves_version(14));
        let closed = Kernel { end: Some(15), ..k };
        assert!(
            closed.serves_version(14) && closed.serves_version(13) && !closed.serves_version(16)
        );
    }
}

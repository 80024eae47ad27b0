//! The GPU execution providers checked, each of one ONNX Runtime release: names, packages and
//! the committed table each is checked against.

/// The ONNX Runtime release of the 1.19 kernel table (`cuda-1.19`, `rocm-1.19`).
pub const ORT_VERSION: &str = "1.19.2";
/// The highest default-domain opset ONNX Runtime 1.19 knows, and the newest the schema table
/// (ONNX 1.16) describes.
pub const MAX_ONNX_OPSET: i64 = 21;

/// A GPU execution provider of one ONNX Runtime release, with its kernel (or op) table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    /// CUDAExecutionProvider of onnxruntime-gpu 1.31.1.
    Cuda,
    /// ROCMExecutionProvider of onnxruntime-rocm 1.22.2 (ORT removed the ROCm provider in 1.23).
    Rocm,
    /// MIGraphXExecutionProvider of onnxruntime-migraphx 1.27.1.
    Migraphx,
    /// CUDAExecutionProvider of onnxruntime-training 1.19.2.
    Cuda119,
    /// ROCMExecutionProvider of onnxruntime-training 1.19.2.
    Rocm119,
}

impl Target {
    /// Every target, in `--target` order.
    pub const ALL: [Target; 5] = [
        Target::Cuda,
        Target::Rocm,
        Target::Migraphx,
        Target::Cuda119,
        Target::Rocm119,
    ];

    /// The `--target` value.
    pub fn name(self) -> &'static str {
        match self {
            Target::Cuda => "cuda",
            Target::Rocm => "rocm",
            Target::Migraphx => "migraphx",
            Target::Cuda119 => "cuda-1.19",
            Target::Rocm119 => "rocm-1.19",
        }
    }

    /// The provider's name in ONNX Runtime's API.
    pub fn provider(self) -> &'static str {
        match self {
            Target::Cuda | Target::Cuda119 => "CUDAExecutionProvider",
            Target::Rocm | Target::Rocm119 => "ROCMExecutionProvider",
            Target::Migraphx => "MIGraphXExecutionProvider",
        }
    }

    /// The provider's column value in the kernel tables (`cuda`, `rocm`; `migraphx` has no
    /// kernels).
    pub fn ep(self) -> &'static str {
        match self {
            Target::Cuda | Target::Cuda119 => "cuda",
            Target::Rocm | Target::Rocm119 => "rocm",
            Target::Migraphx => "migraphx",
        }
    }

    /// The Python package whose provider the table describes.
    pub fn package(self) -> &'static str {
        match self {
            Target::Cuda => "onnxruntime-gpu",
            Target::Rocm => "onnxruntime-rocm",
            Target::Migraphx => "onnxruntime-migraphx",
            Target::Cuda119 | Target::Rocm119 => "onnxruntime-training",
        }
    }

    /// The ONNX Runtime release.
    pub fn ort_version(self) -> &'static str {
        match self {
            Target::Cuda => "1.31.1",
            Target::Rocm => "1.22.2",
            Target::Migraphx => "1.27.1",
            Target::Cuda119 | Target::Rocm119 => ORT_VERSION,
        }
    }

    /// The committed table the target is checked against.
    pub fn table_file(self) -> &'static str {
        match self {
            Target::Cuda => "data/ort-1.31.1-cuda-kernels.tsv",
            Target::Rocm => "data/ort-1.22.2-rocm-kernels.tsv",
            Target::Migraphx => "data/ort-1.27.1-migraphx-ops.tsv",
            Target::Cuda119 | Target::Rocm119 => "data/ort-1.19-kernels.tsv",
        }
    }

    pub fn parse(s: &str) -> Option<Target> {
        let s = s.to_ascii_lowercase();
        Target::ALL.into_iter().find(|t| t.name() == s)
    }
}

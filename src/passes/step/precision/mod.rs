//! The step graph's precision passes, one entry point each, in the order `step::build` runs
//! them:
//! - `upcast::widen_half_export` — a float16/bfloat16 export widened to float32 before
//!   anything reads the graph: trained weights get float32 master copies, frozen ones stay
//!   half behind widening Casts (`frozen_half::keep_half`);
//! - `autocast::autocast` — `--precision fp16|bf16`: the float32 forward and backward retyped
//!   node by node, as torch's autocast would;
//! - `loss_scale::emit_scaled_update` — fp16's GradScaler around the optimizer update;
//! - `frozen_half::cast_per_use` — on the finished step graph, each reader of a frozen half
//!   weight gets a widening Cast of its own (a loop body's product with a large one reads it
//!   in blocks: `blocked_reads`, `blocked_half`).

mod autocast;
mod blocked_half;
mod blocked_reads;
pub(super) mod frozen_half;
pub mod loss_scale;
pub(super) mod upcast;
mod widened;

use crate::onnx::proto::tensor_proto::DataType;

pub use autocast::{
    autocast, no_gpu_kernel, Inputs, Mixed, FLOAT32_OPS, HALF_OPS, NO_GPU_BFLOAT16, NO_GPU_FLOAT16,
};

pub const FLOAT16: i32 = DataType::Float16 as i32;
pub const BFLOAT16: i32 = DataType::Bfloat16 as i32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    Fp32,
    Fp16,
    Bf16,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
        }
    }

    /// The element type of the half-precision computation (None: all float32).
    pub fn half_type(self) -> Option<i32> {
        match self {
            Precision::Fp32 => None,
            Precision::Fp16 => Some(FLOAT16),
            Precision::Bf16 => Some(BFLOAT16),
        }
    }

    /// fp16 needs dynamic loss scaling (its range ends at 65504 and its normals at 6e-5);
    /// bf16 has float32's range and trains without it, as with torch.
    pub fn scales_loss(self) -> bool {
        self == Precision::Fp16
    }
}

//! The passes that turn a model into another, in memory: the number-loss patch ([`rewrite`],
//! driven by [`pipeline`]), whole-model differentiation ([`grad`]), the training step
//! ([`step`]) and ONNX Runtime Training artifacts ([`artifacts`]); [`contract`] is the step graph's
//! metadata, which the step writes and tools read. No pass reads or writes a
//! file: the jobs (`crate::jobs`) load, call them and save.

pub mod artifacts;
pub mod attention;
pub mod contract;
pub mod fused_head;
pub mod grad;
pub mod lora;
pub mod loss_inputs;
pub mod pipeline;
pub mod pointwise_map;
pub mod quantize_base;
pub mod recompute;
pub mod rewrite;
pub mod step;

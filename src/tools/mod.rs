//! The tools that check what the passes wrote: `validate` (run the graph in tract or ONNX
//! Runtime against an independent reference), `inspect` (what ntl-patch sees), and the GPU
//! kernel tables `inspect --target` checks placement against.

pub mod gpu_kernels;
pub mod inspect;
pub mod validate;

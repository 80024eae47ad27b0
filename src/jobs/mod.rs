//! The jobs: what reads and writes files. Each loads its inputs (`crate::io`), calls the passes
//! (`crate::passes`, graph → graph), and writes its outputs all or nothing: the number-loss
//! patch ([`patch`]), the training step ([`step`]), ONNX Runtime Training artifacts
//! ([`artifacts`]) and the LoRA serving model ([`lora_model`]).

pub mod artifacts;
pub mod lora_model;
pub mod patch;
pub mod step;

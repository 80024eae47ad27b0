//! ntl-ops: the op library of ntl-patch — what it knows about ONNX ops, with no files, no
//! command line and no graph analysis:
//! - [`onnx`]: the ONNX protobuf types and small constructors; [`schema`]: the operator schemas;
//! - [`builder`]: the node emitter every subgraph is written through (unique `ntl/` names,
//!   opset-aware op forms); [`names`]: the names every patched graph has;
//! - [`numbers`]: the number tokens a loss reads; [`options`]: what a user chooses;
//!   [`row_blocks`]: a loop body's product with a large weight, a block of rows at a time;
//! - [`ce`]: the trainable cross-entropy node and label smoothing; [`losses`]: the number
//!   losses, one module each; [`combine`]: how the number loss joins the reported loss.
//!
//! The compiler (`ntl-patch`) reads the graph, decides what to emit and applies it; this crate
//! only emits.

pub mod builder;
pub mod ce;
pub mod combine;
pub mod losses;
pub mod names;
pub mod numbers;
pub mod onnx;
pub mod options;
pub mod row_blocks;
pub mod schema;

pub use builder::Builder;

//! ntl-patch: splice number-aware losses (NTL) into exported ONNX training graphs.
//! See ARCHITECTURE.md for the code map and the invariants.

pub mod add_loss;
pub mod artifacts;
pub mod autodiff;
pub mod ce_forms;
pub mod ce_reported;
pub mod ce_site;
pub mod elem_types;
pub mod error;
pub mod fsio;
pub mod gpu_kernels;
pub mod grad;
pub mod graph;
pub mod inspect;
pub mod limits;
pub mod model_io;
pub mod number_table;
pub mod onnx;
pub mod ops;
pub mod patch;
pub mod pipeline;
pub mod prescan;
pub mod progress;
mod python_float;
pub mod ranks;
pub mod rewrite;
pub mod shapes;
pub mod step;
pub mod structure;
pub mod temp;
pub mod text;
mod unicode_digits;
pub mod validate;

pub use error::Error;

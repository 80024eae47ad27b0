//! ntl-patch: splice number-aware losses (NTL) into exported ONNX training graphs.
//! See ARCHITECTURE.md for the code map, the layers and the invariants.
//!
//! The stages, lowest first; a module imports only its own stage and the ones below it
//! (`tests/layers.rs` checks this):
//! [`error`]/[`text`] → [`io`] → [`graph`] → [`ce`] → [`vocab`] → [`passes`] → [`jobs`] →
//! [`tools`];
//! the op library `ntl_ops` (the `ops/` crate) is below them all, the command line
//! (`src/cli/`) above.

pub mod error;
pub mod text;

pub mod io;

pub mod graph;

pub mod ce;

pub mod vocab;

pub mod passes;

pub mod jobs;

pub mod tools;

pub use error::Error;
/// The ONNX types, from the op library: every stage reads and writes them.
pub use ntl_ops::onnx;

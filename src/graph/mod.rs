//! Questions about a graph, asked without changing it — producers and consumers, static
//! shapes, ranks and element types followed through the nodes, what a node's subgraphs read
//! from outside ([`reads`]), the structural checks every command runs first — and [`patch`],
//! the one place a node list changes.

pub mod elem_types;
pub mod hash;
pub mod index;
pub mod names;
pub mod patch;
pub mod ranks;
pub mod reads;
pub mod shapes;
pub mod structure;

pub use index::{normalize_axis, static_rank, GraphIndex};

//! The names every patched graph has: the prefix of every node and tensor ntl-patch creates,
//! and the outputs it adds.

/// Prefix of every node and tensor ntl-patch creates.
pub const PREFIX: &str = "ntl";
/// The cross-entropy as the graph reports it.
pub const CE_OUTPUT: &str = "ce_loss";
/// The unweighted number loss.
pub const NUMBER_OUTPUT: &str = "number_loss";

//! What `frozen_half` and the blocked reads of its loop bodies share: a widened half tensor.

/// A float32 tensor of the step graph that is a kept half tensor, widened.
#[derive(Debug, Clone)]
pub struct Widened {
    pub half: String,
    pub half_type: i32,
}

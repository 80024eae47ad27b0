//! Finding the cross-entropy: spelled-out forms rewritten into one `SoftmaxCrossEntropyLoss`
//! ([`forms`]), the sites a number loss can join ([`site`]), the scalar a per-position loss is
//! reported as and the masks on the way ([`reported`]), and a loss for logits-only exports
//! ([`add_loss`]).

pub mod add_loss;
pub mod forms;
pub mod reported;
pub mod site;

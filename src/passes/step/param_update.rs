//! What the optimizer update reads and writes for one trained parameter.

/// One trained parameter as the update sees it: its tensor, its gradient, its state inputs
/// (in `slots()` order) and the names its next values must be written to.
#[derive(Clone)]
pub struct ParamUpdate {
    pub param: String,
    /// The parameter's dims (its gradient's and state's too).
    pub dims: Vec<i64>,
    pub grad: String,
    pub slots: Vec<String>,
    pub next_param: String,
    pub next_slots: Vec<String>,
}

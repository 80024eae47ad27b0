//! The vocabulary: tokenizer files read into a [`Vocab`], and the id → value number table with
//! ntloss's rules (Python `float()` semantics).

pub mod number_table;
mod python_float;
mod unicode_digits;

pub use number_table::{number_value, NumberSet, NumberTable, TableError, Vocab};

/// A logits width (`what` names where it comes from, `fix` how to mend it), checked to be
/// between 1 and [`MAX_VOCAB`](crate::io::limits::MAX_VOCAB).
pub fn check_width(width: i64, what: &str, fix: &str) -> Result<usize, crate::Error> {
    use crate::io::limits::MAX_VOCAB;
    if width < 1 || width as u64 > MAX_VOCAB {
        return Err(crate::Error::Usage(format!(
            "{what} ({width}) is not a plausible vocabulary size (1 to {MAX_VOCAB}); {fix}"
        )));
    }
    Ok(width as usize)
}

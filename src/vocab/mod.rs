//! The vocabulary: tokenizer files read into a [`Vocab`], and the id → value number table with
//! ntloss's rules (Python `float()` semantics).

pub mod number_table;
mod python_float;
mod unicode_digits;

pub use number_table::{number_value, NumberSet, NumberTable, TableError, Vocab};

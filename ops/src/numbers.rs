//! The number tokens a loss reads: which tokens count as numbers, the id → value table over the
//! logits width, and the token ids of the digits. Built from a tokenizer by the compiler's
//! vocabulary stage (`ntl_patch::vocab`); here they are plain values.

use std::fmt;

/// Which tokens count as number tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NumberSet {
    /// ntloss `digit_level=True`: only the single-character tokens "0".."9".
    #[default]
    DigitLevel,
    /// ntloss `digit_level=False`: every token Python's float() parses to a
    /// finite value ("12", " 3", "-1", "1.5", "1e3", "٣", ...).
    AllNumbers,
    /// SMMD's numeric vocabulary: the integers 0..=max whose decimal string (Python's
    /// `str(v)`: no sign, no leading zero) is a token of its own.
    Integers { max: u32 },
}

impl NumberSet {
    /// The name recorded in a patched model's metadata.
    pub fn name(self) -> &'static str {
        match self {
            NumberSet::DigitLevel => "digit-level",
            NumberSet::AllNumbers => "all-numbers",
            NumberSet::Integers { .. } => "integers",
        }
    }
}

impl fmt::Display for NumberSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NumberSet::DigitLevel => f.write_str("digit-level set (tokens \"0\"..\"9\")"),
            NumberSet::AllNumbers => f.write_str("all-numbers set (--all-numbers)"),
            NumberSet::Integers { max } => {
                write!(
                    f,
                    "integer set (tokens \"0\"..\"{max}\", SMMD's --max-value)"
                )
            }
        }
    }
}

/// The number tokens of a vocab, as a dense table over the model's logits
/// width: `ids[k]` has value `values[k]`, ids strictly ascending. Ids in
/// `0..width` not listed (including padding ids past the tokenizer) are
/// non-numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct NumberTable {
    width: usize,
    ids: Vec<i64>,
    values: Vec<f64>,
}

impl NumberTable {
    /// A table over logits width `width`. The caller guarantees what the vocabulary stage
    /// checks: `ids` strictly ascending inside `0..width`, as many values, at least one id and
    /// fewer ids than `width`.
    pub fn new(width: usize, ids: Vec<i64>, values: Vec<f64>) -> NumberTable {
        debug_assert!(ids.len() == values.len() && !ids.is_empty() && ids.len() < width);
        debug_assert!(ids.windows(2).all(|w| w[0] < w[1]));
        NumberTable { width, ids, values }
    }

    /// The logits width V the table covers.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Ids of the number tokens, ascending.
    pub fn ids(&self) -> &[i64] {
        &self.ids
    }

    /// Values of the number tokens, in the order of [`Self::ids`].
    pub fn values(&self) -> &[f64] {
        &self.values
    }

    /// Number of number tokens.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Always false for a built table (the vocabulary stage refuses a table without numbers).
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The value of id `id`, or None if it is not a number token.
    pub fn value_of(&self, id: i64) -> Option<f64> {
        self.ids.binary_search(&id).ok().map(|k| self.values[k])
    }

    /// The smallest id that is not a number token (ntloss's `nan_id`).
    pub fn first_non_number_id(&self) -> i64 {
        // ids is ascending and distinct, so the first gap is the answer;
        // new() requires ids.len() < width, so it lies inside the width.
        (0..)
            .zip(&self.ids)
            .find(|(k, id)| k != *id)
            .map_or(self.ids.len() as i64, |(k, _)| k)
    }
}

/// The token ids a loss needs, resolved from the tokenizer.
pub struct NumberTokens {
    /// The NTL number table (ids by id order, values).
    pub table: NumberTable,
    /// Ids of `"0"`..`"9"`, by digit value (NTIL, number-level).
    pub digits: Option<[i64; 10]>,
    /// Id of `"."` (number-level `--float-level`; DEL, where the tokenizer has one).
    pub dot: Option<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_non_number_id_finds_the_first_gap() {
        let t = |ids: Vec<i64>| NumberTable::new(20, ids.clone(), vec![0.0; ids.len()]);
        assert_eq!(t(vec![3, 4]).first_non_number_id(), 0);
        assert_eq!(t(vec![0, 1, 2, 5]).first_non_number_id(), 3);
        assert_eq!(t(vec![0, 1, 2]).first_non_number_id(), 3);
    }
}

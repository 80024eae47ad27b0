//! The vocab-id → numeric-value table that Number Token Loss needs, built
//! from a tokenizer file.
//!
//! Semantics follow PyPI `ntloss` 0.3.2, `AbstractNTLoss.setup_number_tokens`:
//! it walks `tokenizer.get_vocab()` (token → id, added tokens included) and
//! marks a token as a number iff Python's `float(token)` succeeds and is
//! finite; with `digit_level` (the default) it further requires
//! `token.isascii() and -1 <= float(token) <= 9 and len(token) == 1`, which
//! leaves exactly the ten tokens "0".."9". Token strings are used exactly as
//! stored in the vocab: nothing is decoded, so "Ġ3" or "▁3" are not numbers
//! while " 3" is (float() strips whitespace).
//!
//! Two things ntloss does that we deliberately do not: it *adds* missing
//! digit tokens to the tokenizer (we cannot grow a trained model, so we
//! report the missing digits instead), and its dict iteration order decides
//! which value wins when two number tokens share an id (we pick the smallest
//! token string, so the result never depends on hash order).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

pub use ntl_ops::numbers::{NumberSet, NumberTable};

use crate::vocab::python_float::parse_python_float;

/// The numeric value of `token` if it is a number token of `set`.
pub fn number_value(set: NumberSet, token: &str) -> Option<f64> {
    if let NumberSet::Integers { max } = set {
        return integer_value(token, max);
    }
    let x = parse_python_float(token)?;
    match set {
        NumberSet::AllNumbers => Some(x),
        // ntloss's exact test; after a successful float() it only
        // admits the ASCII digits, but we keep its form on purpose.
        NumberSet::DigitLevel => {
            let ok = token.is_ascii() && (-1.0..=9.0).contains(&x) && token.len() == 1;
            ok.then_some(x)
        }
        NumberSet::Integers { .. } => unreachable!("handled above"),
    }
}

/// `v` when `token` is exactly Python's `str(v)` for an integer `0 <= v <= max` (SMMD).
fn integer_value(token: &str, max: u32) -> Option<f64> {
    let canonical = !token.is_empty()
        && token.len() <= 10
        && token.bytes().all(|c| c.is_ascii_digit())
        && (token == "0" || !token.starts_with('0'));
    let v: u64 = token.parse().ok().filter(|_| canonical)?;
    (v <= max as u64).then_some(v as f64)
}

/// Errors building a vocab or a number table. Each message is one line that
/// names the tokenizer (its path where known) and how to fix the problem.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error("cannot read tokenizer file {path}: {source}; check the tokenizer path")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error(
        "{tokenizer}: not a UTF-8 text file, so not a tokenizer; pass the model's \
         tokenizer.json or a vocab file with one token per line (for a SentencePiece \
         .model, use the tokenizer.json saved next to it)"
    )]
    NotUtf8 { tokenizer: String },

    #[error(
        "{tokenizer}: not a tokenizer ({detail}); expected a Hugging Face tokenizer.json \
         (model.vocab as a token->id map, or a Unigram list of [piece, score]) or a plain \
         vocab file with one token per line"
    )]
    NotATokenizer { tokenizer: String, detail: String },

    #[error(
        "{tokenizer}: token id {max_id} ({token:?}) does not fit the model's logits width \
         {width} (ids must be < {width}), so this tokenizer does not belong to this model; \
         pass the model's own tokenizer, or set --vocab-size if the logits width is wrong"
    )]
    IdExceedsWidth {
        tokenizer: String,
        max_id: i64,
        token: String,
        width: usize,
    },

    #[error("{tokenizer}: no number token found with the {set}{}; {}", left_out_note(*.left_out), no_number_fix(*.set, *.all_numbers_found))]
    NoNumberTokens {
        tokenizer: String,
        set: NumberSet,
        /// How many tokens the all-numbers set would find (for the hint).
        all_numbers_found: usize,
        /// Number tokens left out for values too large for the loss.
        left_out: usize,
    },

    #[error(
        "{tokenizer}: all {width} logits ids are number tokens with the {set}, but NTL \
         needs at least one non-number id (as ntloss does); {}",
        all_numbers_fix(*.set)
    )]
    AllTokensAreNumbers {
        tokenizer: String,
        set: NumberSet,
        width: usize,
    },

    #[error(
        "{tokenizer}: digit token(s) {missing} missing from the vocab, but this loss needs \
         all of \"0\"..\"9\" as single tokens; use a tokenizer that has them, or a loss \
         that works with --all-numbers"
    )]
    MissingDigits { tokenizer: String, missing: String },
}

fn left_out_note(left_out: usize) -> String {
    match left_out {
        0 => String::new(),
        n => format!(" ({n} left out: their values are too large for the number loss in float32)"),
    }
}

fn no_number_fix(set: NumberSet, all_numbers_found: usize) -> String {
    match set {
        NumberSet::Integers { .. } => "SMMD needs integer tokens (\"0\", \"1\", ..., each its own token); pass the model's own tokenizer or raise --max-value".to_string(),
        NumberSet::DigitLevel if all_numbers_found > 0 => format!(
            "the tokenizer has {all_numbers_found} other number token(s) (e.g. multi-digit \
             or space-prefixed), so try --all-numbers"
        ),
        _ => "NTL needs number tokens; pass the model's own tokenizer".to_string(),
    }
}

fn all_numbers_fix(set: NumberSet) -> &'static str {
    match set {
        NumberSet::AllNumbers => "use the digit-level set (drop --all-numbers)",
        NumberSet::DigitLevel | NumberSet::Integers { .. } => {
            "check --vocab-size and the tokenizer"
        }
    }
}

impl From<TableError> for crate::error::Error {
    fn from(e: TableError) -> Self {
        crate::error::Error::Table(e.to_string())
    }
}

/// A tokenizer vocabulary: token → id, as transformers' `get_vocab()` gives
/// it (model vocab, then added tokens overriding same-content entries).
#[derive(Debug, Clone)]
pub struct Vocab {
    /// Names the tokenizer in error messages: its path, or a placeholder.
    source: String,
    by_token: HashMap<String, i64>,
    /// (id, token) sorted by id then token: the only order we iterate in.
    entries: Vec<(i64, String)>,
    distinct_ids: usize,
}

impl Vocab {
    fn from_map(by_token: HashMap<String, i64>, source: String) -> Vocab {
        let mut entries: Vec<(i64, String)> =
            by_token.iter().map(|(t, &id)| (id, t.clone())).collect();
        entries.sort();
        let mut distinct_ids = entries.len();
        distinct_ids -= entries.windows(2).filter(|w| w[0].0 == w[1].0).count();
        Vocab {
            source,
            by_token,
            entries,
            distinct_ids,
        }
    }

    /// Reads a tokenizer file, detecting the format by content: JSON (a Hugging
    /// Face tokenizer.json) if it starts with `{`, else a plain vocab file.
    pub fn from_file(path: &Path) -> Result<Vocab, TableError> {
        let label = path.display().to_string();
        let bytes = crate::io::fsio::read_regular(path, crate::io::limits::MAX_TOKENIZER_BYTES)
            .map_err(|source| TableError::Read {
                path: path.to_path_buf(),
                source,
            })?;
        let text = String::from_utf8(bytes).map_err(|_| TableError::NotUtf8 {
            tokenizer: label.clone(),
        })?;
        if text.is_empty() {
            return Err(TableError::NotATokenizer {
                tokenizer: label,
                detail: "the file is empty".to_string(),
            });
        }
        if looks_like_json(&text) {
            Self::parse_json(&text, label)
        } else {
            Ok(Self::lines(&text, label))
        }
    }

    /// Parses the text of a Hugging Face tokenizer.json.
    pub fn from_json_str(text: &str) -> Result<Vocab, TableError> {
        Self::parse_json(text, "<tokenizer json>".to_string())
    }

    /// Parses a plain vocab file: one token per line, id = 0-based line
    /// index. Only the line terminator (`\n` or `\r\n`) is removed, so a
    /// line " 3" is the token " 3". A final terminator does not start a
    /// new (empty) token. A repeated token keeps its last line's id, as
    /// transformers' `load_vocab` does.
    pub fn from_lines(text: &str) -> Vocab {
        Self::lines(text, "<vocab lines>".to_string())
    }

    fn lines(text: &str, source: String) -> Vocab {
        let mut by_token = HashMap::new();
        // `lines()` splits on "\n" and strips one "\r" before it, and does
        // not yield an empty last line after a final terminator.
        for (i, line) in text.lines().enumerate() {
            by_token.insert(line.to_string(), i as i64);
        }
        Self::from_map(by_token, source)
    }

    fn parse_json(text: &str, source: String) -> Result<Vocab, TableError> {
        let not_tok = |detail: String| TableError::NotATokenizer {
            tokenizer: source.clone(),
            detail,
        };
        let root: Value = serde_json::from_str(text.trim_start_matches('\u{feff}'))
            .map_err(|e| not_tok(format!("invalid JSON: {e}")))?;
        let by_token = hf_vocab(&root).map_err(not_tok)?;
        Ok(Self::from_map(by_token, source))
    }

    /// The id of `token`, compared exactly (no normalisation).
    pub fn id_of(&self, token: &str) -> Option<i64> {
        self.by_token.get(token).copied()
    }

    /// Number of distinct ids (several tokens may share an id).
    pub fn len(&self) -> usize {
        self.distinct_ids
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn max_id(&self) -> Option<i64> {
        self.entries.last().map(|(id, _)| *id)
    }

    /// All (id, token) pairs, sorted by id then token.
    pub fn entries(&self) -> impl Iterator<Item = (i64, &str)> + '_ {
        self.entries.iter().map(|(id, t)| (*id, t.as_str()))
    }

    /// The file path (or placeholder) used to name this vocab in messages.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Errors unless every id is below the logits width.
    fn check_width(&self, width: usize) -> Result<(), TableError> {
        match self.entries.last() {
            Some((id, token)) if *id as u64 >= width as u64 => Err(TableError::IdExceedsWidth {
                tokenizer: self.source.clone(),
                max_id: *id,
                token: token.clone(),
                width,
            }),
            _ => Ok(()),
        }
    }
}

/// A JSON file is a tokenizer.json candidate if it starts with `{` (after an
/// optional BOM and whitespace). A vocab file may well start with `[`
/// ("[PAD]"), so `[` only counts when the whole text is valid JSON.
fn looks_like_json(text: &str) -> bool {
    let t = text.trim_start_matches('\u{feff}').trim_start();
    t.starts_with('{') || (t.starts_with('[') && serde_json::from_str::<Value>(t).is_ok())
}

/// Token → id of a Hugging Face tokenizer.json, like `get_vocab()`: the model
/// vocab, then `added_tokens` (which win for the same content). Errors are
/// the detail for [`TableError::NotATokenizer`].
fn hf_vocab(root: &Value) -> Result<HashMap<String, i64>, String> {
    let Some(obj) = root.as_object() else {
        return Err(format!("top-level JSON is {}, not an object", kind(root)));
    };
    let Some(model) = obj.get("model").filter(|m| m.is_object()) else {
        // A bare GPT-2 style vocab.json maps tokens straight to ids.
        if !obj.is_empty() && obj.values().all(Value::is_i64) {
            return Err(
                "this looks like a bare vocab.json; pass the tokenizer.json instead".to_string(),
            );
        }
        return Err("no \"model\" object".to_string());
    };
    let vocab = model.get("vocab").unwrap_or(&Value::Null);
    let ty = model.get("type").and_then(Value::as_str);
    // model.type, when present and known, must agree with the vocab's
    // shape; when absent (or unknown) the shape alone decides.
    let map_type = matches!(ty, Some("WordLevel" | "BPE" | "WordPiece"));
    let mut map = HashMap::new();
    match vocab {
        Value::Object(m) if ty != Some("Unigram") => {
            for (token, id) in m {
                map.insert(token.clone(), json_id(id, token)?);
            }
        }
        Value::Array(pieces) if !map_type => {
            // Unigram: id = position; later duplicates win, as in tokenizers.
            for (i, piece) in pieces.iter().enumerate() {
                let token = piece
                    .get(0)
                    .and_then(Value::as_str)
                    .ok_or_else(|| format!("model.vocab[{i}] is not a [piece, score] pair"))?;
                map.insert(token.to_string(), i as i64);
            }
        }
        _ => {
            return Err(format!(
                "model.type {} with model.vocab being {}",
                ty.map_or("absent".to_string(), |t| format!("{t:?}")),
                kind(vocab)
            ))
        }
    }
    match obj.get("added_tokens") {
        None | Some(Value::Null) => {}
        Some(Value::Array(added)) => {
            for (i, tok) in added.iter().enumerate() {
                let content = tok.get("content").and_then(Value::as_str);
                let Some(content) = content else {
                    return Err(format!("added_tokens[{i}] has no string \"content\""));
                };
                let id = json_id(tok.get("id").unwrap_or(&Value::Null), content)?;
                map.insert(content.to_string(), id);
            }
        }
        Some(other) => return Err(format!("added_tokens is {}, not a list", kind(other))),
    }
    Ok(map)
}

fn json_id(v: &Value, token: &str) -> Result<i64, String> {
    v.as_i64()
        .filter(|id| *id >= 0)
        .ok_or_else(|| format!("id of token {token:?} is {v}, not a non-negative integer"))
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "missing or null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

impl Vocab {
    /// The number table of this vocab for logits width `width` (which may exceed the
    /// tokenizer size; it may not be smaller than its largest id + 1), with every value finite
    /// in float32, the type the graph holds them in: `"1e308"` parses to a finite float64 but
    /// is inf there, so it is left out.
    pub fn number_table(&self, set: NumberSet, width: usize) -> Result<NumberTable, TableError> {
        Ok(self.number_table_within(set, width, f32::MAX as f64)?.0)
    }

    /// [`Self::number_table`], leaving out every token whose value exceeds `max_abs` in
    /// magnitude (a loss squares or sums what it reads, so its limit may be lower than
    /// float32's largest value: `ntl_ops::losses::ntl::value_limit`); the tokens left out come
    /// back beside the table as (token, value), by id.
    pub fn number_table_within(
        &self,
        set: NumberSet,
        width: usize,
        max_abs: f64,
    ) -> Result<(NumberTable, Vec<(String, f64)>), TableError> {
        self.check_width(width)?;
        let (mut ids, mut values, mut left_out) = (Vec::new(), Vec::new(), Vec::new());
        for (id, token) in self.entries() {
            // Entries are sorted by (id, token): if several number tokens
            // share an id, the smallest token string gives the value.
            if ids.last() == Some(&id) {
                continue;
            }
            match number_value(set, token) {
                Some(x) if x.abs() <= max_abs => {
                    ids.push(id);
                    values.push(x);
                }
                Some(x) => left_out.push((token.to_string(), x)),
                None => {}
            }
        }
        if ids.is_empty() {
            let all_numbers_found = self
                .entries()
                .filter(|(_, t)| number_value(NumberSet::AllNumbers, t).is_some())
                .count();
            return Err(TableError::NoNumberTokens {
                tokenizer: self.source.clone(),
                set,
                all_numbers_found,
                left_out: left_out.len(),
            });
        }
        if ids.len() == width {
            return Err(TableError::AllTokensAreNumbers {
                tokenizer: self.source.clone(),
                set,
                width,
            });
        }
        Ok((NumberTable::new(width, ids, values), left_out))
    }

    /// The ids of the tokens "0", "1", .., "9", in that (value) order, for
    /// losses that need the digits individually (NTIL).
    pub fn digit_ids(&self, width: usize) -> Result<[i64; 10], TableError> {
        self.check_width(width)?;
        let mut ids = [0i64; 10];
        let mut missing = Vec::new();
        for (d, slot) in ids.iter_mut().enumerate() {
            match self.id_of(&d.to_string()) {
                Some(id) => *slot = id,
                None => missing.push(format!("\"{d}\"")),
            }
        }
        if !missing.is_empty() {
            return Err(TableError::MissingDigits {
                tokenizer: self.source.clone(),
                missing: missing.join(", "),
            });
        }
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digit_level_test_is_ntloss_test() {
        for t in ["0", "5", "9"] {
            assert!(number_value(NumberSet::DigitLevel, t).is_some(), "{t}");
        }
        for t in [" 3", "12", "-1", "٣", "３", "1.", ".5", "+2", "a", ""] {
            assert_eq!(number_value(NumberSet::DigitLevel, t), None, "{t}");
        }
    }

    #[test]
    fn integer_set_takes_exactly_str_v() {
        let set = NumberSet::Integers { max: 999 };
        for (t, v) in [("0", 0.0), ("7", 7.0), ("12", 12.0), ("999", 999.0)] {
            assert_eq!(number_value(set, t), Some(v), "{t}");
        }
        for t in [
            "1000", "007", "00", " 3", "-1", "+2", "1.5", "1e3", "1_0", "٣", "", "12a", "Ġ3",
        ] {
            assert_eq!(number_value(set, t), None, "{t}");
        }
        assert_eq!(number_value(NumberSet::Integers { max: 9 }, "10"), None);
        assert_eq!(
            number_value(NumberSet::Integers { max: 1 << 24 }, "99999999999"),
            None
        );
    }

    #[test]
    fn json_detection() {
        assert!(looks_like_json("{\"model\":{}}"));
        assert!(looks_like_json("\u{feff} \n{"));
        assert!(!looks_like_json("[PAD]\n[UNK]\n"));
        assert!(looks_like_json("[1, 2]"));
    }
}

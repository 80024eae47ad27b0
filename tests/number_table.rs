//! Integration tests of the vocab-id → value table (src/number_table.rs).
//!
//! Expected tables were computed with the ntloss 0.3.2 rule in CPython 3.11
//! (`float(token)` finite; digit-level also `token.isascii() and
//! -1 <= float(token) <= 9 and len(token) == 1`) over each fixture's
//! `get_vocab()`-equivalent map (model vocab, then added_tokens).

use std::path::{Path, PathBuf};

use ntl_patch::vocab::number_table::*;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/tokenizers/unit")
        .join(name)
}

fn vocab(name: &str) -> Vocab {
    Vocab::from_file(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// (id, value) pairs of a table, for compact comparisons.
fn pairs(t: &NumberTable) -> Vec<(i64, f64)> {
    t.ids()
        .iter()
        .copied()
        .zip(t.values().iter().copied())
        .collect()
}

fn build(name: &str, set: NumberSet, width: usize) -> NumberTable {
    vocab(name)
        .number_table(set, width)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The WordLevel fixture has 39 ids (0..=38).
const WL_WIDTH: usize = 39;

#[test]
fn digit_level_picks_exactly_the_ten_digits_sorted_by_id() {
    let t = build("wordlevel.json", NumberSet::DigitLevel, WL_WIDTH);
    let expected = [
        (2, 7.0),
        (4, 2.0),
        (6, 9.0),
        (8, 0.0),
        (10, 5.0),
        (13, 3.0),
        (16, 1.0),
        (17, 8.0),
        (18, 4.0),
        (19, 6.0),
    ];
    assert_eq!(pairs(&t), expected);
    assert_eq!(t.len(), 10);
    assert_eq!(t.width(), WL_WIDTH);
    assert_eq!(NumberSet::default(), NumberSet::DigitLevel);
}

#[test]
fn all_numbers_is_the_python_float_set() {
    let t = build("wordlevel.json", NumberSet::AllNumbers, WL_WIDTH);
    let expected = [
        (2, 7.0),     // "7"
        (3, 3.0),     // " 3": float() strips whitespace
        (4, 2.0),     // "2"
        (6, 9.0),     // "9"
        (7, 12.0),    // "12"
        (8, 0.0),     // "0"
        (9, -1.0),    // "-1"
        (10, 5.0),    // "5"
        (11, 1.5),    // "1.5"
        (13, 3.0),    // "3"
        (15, 3.0),    // "٣" (Arabic-Indic three)
        (16, 1.0),    // "1"
        (17, 8.0),    // "8"
        (18, 4.0),    // "4"
        (19, 6.0),    // "6"
        (21, 1000.0), // "1e3"
        (22, 1000.0), // "1_000"
        (23, 2.0),    // "+2"
        (24, 0.5),    // ".5"
        (25, 5.0),    // "5."
        (26, 3.0),    // "３" (full-width three)
        (35, 3.0),    // "3 "
        (36, -0.0),   // "-0"
        (38, 0.001),  // "1e-3"
    ];
    assert_eq!(pairs(&t), expected);
    // Not numbers: "▁3" (5), "Ġ7" (12), "##4" (14), "." (20), "inf" (27),
    // "nan" (28), "1e400" (29, overflows), "1__0" (30), "_1" (31), "1_" (32),
    // "0x10" (33), "" (34), "NaN" (37).
    for id in [5, 12, 14, 20, 27, 28, 29, 30, 31, 32, 33, 34, 37] {
        assert_eq!(t.value_of(id), None, "id {id}");
    }
    assert!(
        t.values()[22].is_sign_negative(),
        "\"-0\" is -0.0 as in Python"
    );
}

#[test]
fn token_values_follow_python_float() {
    let all = NumberSet::AllNumbers;
    let yes = [
        (" 3", 3.0),
        ("12", 12.0),
        ("-1", -1.0),
        ("1.5", 1.5),
        ("1e3", 1000.0),
        ("1_000", 1000.0),
        ("+2", 2.0),
        (".5", 0.5),
        ("5.", 5.0),
        ("٣", 3.0),
        ("３", 3.0),
    ];
    for (tok, v) in yes {
        assert_eq!(number_value(all, tok), Some(v), "{tok:?}");
    }
    let no = [
        "▁3", "Ġ3", "##3", "inf", "nan", "1e400", "1__0", "_1", "1_", "0x10", "",
    ];
    for tok in no {
        assert_eq!(number_value(all, tok), None, "{tok:?}");
    }
}

#[test]
fn padded_width_keeps_ids_and_marks_padding_non_number() {
    let exact = build("wordlevel.json", NumberSet::DigitLevel, WL_WIDTH);
    let padded = build("wordlevel.json", NumberSet::DigitLevel, WL_WIDTH + 25);
    assert_eq!(padded.width(), WL_WIDTH + 25);
    assert_eq!(padded.ids(), exact.ids());
    assert_eq!(padded.values(), exact.values());
    assert_eq!(padded.value_of(WL_WIDTH as i64 + 3), None);
}

#[test]
fn id_beyond_width_is_an_error_naming_id_width_and_fix() {
    let err = vocab("wordlevel.json")
        .number_table(NumberSet::DigitLevel, WL_WIDTH - 1)
        .unwrap_err();
    assert!(matches!(
        err,
        TableError::IdExceedsWidth {
            max_id: 38,
            width: 38,
            ..
        }
    ));
    let msg = err.to_string();
    for part in ["wordlevel.json", "38", "--vocab-size", "tokenizer"] {
        assert!(msg.contains(part), "{msg}");
    }
    assert!(!msg.contains('\n'));
    // Also when the offending token is not a number, and for digit_ids.
    let v = Vocab::from_lines("0\n1\n2\n3\n4\n5\n6\n7\n8\n9\nx\n");
    assert!(v.number_table(NumberSet::DigitLevel, 10).is_err());
    assert!(v.digit_ids(10).is_err());
    assert!(v.digit_ids(11).is_ok());
}

#[test]
fn no_digit_tokens_suggests_all_numbers() {
    let v = vocab("no_digits.json");
    let err = v.number_table(NumberSet::DigitLevel, 5).unwrap_err();
    assert!(matches!(
        err,
        TableError::NoNumberTokens {
            all_numbers_found: 2,
            ..
        }
    ));
    let msg = err.to_string();
    assert!(msg.contains("no_digits.json"), "{msg}");
    assert!(msg.contains("digit-level"), "{msg}");
    assert!(msg.contains("--all-numbers"), "{msg}");
    // With all numbers, "12" and "1.5" are found ("Ġ3" is not).
    let t = v.number_table(NumberSet::AllNumbers, 5).unwrap();
    assert_eq!(pairs(&t), [(2, 12.0), (3, 1.5)]);
}

#[test]
fn no_numbers_at_all_is_an_error_without_the_all_numbers_hint() {
    let v = Vocab::from_lines("a\nb\nĠ3\n");
    for set in [NumberSet::DigitLevel, NumberSet::AllNumbers] {
        let msg = v.number_table(set, 3).unwrap_err().to_string();
        assert!(msg.contains("no number token"), "{msg}");
        assert!(!msg.contains("try --all-numbers"), "{msg}");
    }
}

#[test]
fn all_ids_numbers_is_an_error_like_ntloss() {
    let v = Vocab::from_lines("0\n1\n2\n");
    let err = v.number_table(NumberSet::DigitLevel, 3).unwrap_err();
    assert!(
        matches!(err, TableError::AllTokensAreNumbers { .. }),
        "{err}"
    );
    // A padded width leaves non-number ids, which is fine.
    let t = v.number_table(NumberSet::DigitLevel, 4).unwrap();
    assert_eq!(t.first_non_number_id(), 3);
}

#[test]
fn bpe_parses() {
    let v = vocab("bpe.json");
    assert_eq!(v.len(), 19);
    assert_eq!(v.id_of("Ġ3"), Some(13));
    assert_eq!(v.id_of("<|endoftext|>"), Some(18));
    assert_eq!(v.id_of("."), Some(1));
    let t = build("bpe.json", NumberSet::AllNumbers, 19);
    // Byte-level "Ġ3"/"Ġ12" are not decoded, so they are not numbers.
    let mut expected: Vec<(i64, f64)> = (0..10).map(|d| (d + 2, d as f64)).collect();
    expected.push((14, 12.0));
    assert_eq!(pairs(&t), expected);
    assert_eq!(t.first_non_number_id(), 0);
}

#[test]
fn wordpiece_parses() {
    let v = vocab("wordpiece.json");
    assert_eq!((v.len(), v.max_id()), (20, Some(19)));
    assert_eq!(v.id_of("[MASK]"), Some(4));
    assert_eq!(v.id_of("."), Some(5));
    let digits = v.digit_ids(20).unwrap();
    assert_eq!(digits, [6, 7, 8, 9, 10, 11, 12, 13, 14, 15]);
    let t = build("wordpiece.json", NumberSet::AllNumbers, 20);
    assert_eq!(t.len(), 11); // ten digits and "12"; "##4" is not a number
    assert_eq!(t.value_of(19), Some(12.0));
}

#[test]
fn unigram_ids_are_positions_and_digit_ids_are_by_value() {
    let v = vocab("unigram.json");
    assert_eq!((v.len(), v.max_id()), (17, Some(16)));
    assert_eq!(v.id_of("▁3"), Some(4));
    assert_eq!(v.id_of("."), Some(15));
    // "9" has id 5 and "0" id 14: the dense table is by id...
    let t = build("unigram.json", NumberSet::DigitLevel, 17);
    assert_eq!(t.ids(), [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]);
    assert_eq!(
        t.values(),
        [9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0]
    );
    // ...while digit_ids is by digit value.
    let digits = v.digit_ids(17).unwrap();
    assert_eq!(digits, [14, 13, 12, 11, 10, 9, 8, 7, 6, 5]);
}

#[test]
fn unigram_and_map_shapes_are_inferred_without_model_type() {
    let unigram = r#"{"model": {"vocab": [["<unk>", 0.0], ["▁", -1.0], ["4", -2.0]]}}"#;
    let v = Vocab::from_json_str(unigram).unwrap();
    assert_eq!(v.id_of("4"), Some(2));
    let map = r#"{"model": {"vocab": {"<unk>": 0, "4": 1}}}"#;
    let v = Vocab::from_json_str(map).unwrap();
    assert_eq!(v.id_of("4"), Some(1));
}

#[test]
fn plain_vocab_file_keeps_whitespace_and_uses_line_index() {
    let v = vocab("vocab.txt");
    assert_eq!((v.len(), v.max_id()), (17, Some(16)));
    assert_eq!(v.id_of(" 3"), Some(2));
    assert_eq!(v.id_of("3 "), Some(3));
    assert_eq!(v.id_of("3"), Some(7));
    assert_eq!(v.id_of("."), Some(16));
    assert_eq!(v.id_of(""), None, "the final newline does not add a token");
    let t = build("vocab.txt", NumberSet::AllNumbers, 17);
    assert_eq!(t.ids(), [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15]);
    assert_eq!(t.value_of(2), Some(3.0));
    assert_eq!(t.value_of(15), Some(12.0));
}

#[test]
fn from_lines_strips_only_the_terminator() {
    let v = Vocab::from_lines("a\r\n 3\r\n\t4 \n\nlast");
    assert_eq!(v.id_of("a"), Some(0));
    assert_eq!(v.id_of(" 3"), Some(1));
    assert_eq!(v.id_of("\t4 "), Some(2));
    assert_eq!(v.id_of(""), Some(3));
    assert_eq!(v.id_of("last"), Some(4));
    assert_eq!(v.len(), 5);
}

#[test]
fn added_tokens_count_and_override_the_model_vocab() {
    let v = vocab("added_tokens.json");
    // The added "7" (id 12) replaces the model's "7" (id 3) in get_vocab(),
    // so id 3 has no token left.
    assert_eq!(v.id_of("7"), Some(12));
    assert_eq!((v.len(), v.max_id()), (14, Some(14)));
    let t = build("added_tokens.json", NumberSet::DigitLevel, 15);
    assert_eq!(t.ids(), [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]);
    assert_eq!(t.value_of(3), None);
    assert_eq!(
        v.digit_ids(15).unwrap(),
        [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    );
}

#[test]
fn missing_digits_are_named() {
    let v = Vocab::from_lines("0\n1\n2\n3\n4\n6\n7\n8\nx\n");
    let msg = v.digit_ids(9).unwrap_err().to_string();
    assert!(msg.contains("\"5\"") && msg.contains("\"9\""), "{msg}");
    assert!(!msg.contains("\"4\""), "{msg}");
}

#[test]
fn shared_ids_are_accepted_and_resolved_deterministically() {
    // Two tokens with one id: both are kept in the vocab; the table holds
    // the id once, valued by the smallest token string.
    let json = r#"{"model": {"type": "WordLevel", "vocab": {"x": 0, "7": 1, " 7": 1, "12": 1}}}"#;
    let v = Vocab::from_json_str(json).unwrap();
    assert_eq!(v.len(), 2);
    assert_eq!((v.id_of("7"), v.id_of(" 7")), (Some(1), Some(1)));
    let t = v.number_table(NumberSet::AllNumbers, 2).unwrap();
    assert_eq!(pairs(&t), [(1, 7.0)]);
    let t = v.number_table(NumberSet::DigitLevel, 2).unwrap();
    assert_eq!(pairs(&t), [(1, 7.0)]);
}

#[test]
fn results_do_not_depend_on_input_order() {
    let forward =
        r#"{"model": {"type": "WordLevel", "vocab": {"a": 0, "3": 1, " 4": 2, "2": 3, "b": 4}}}"#;
    let backward =
        r#"{"model": {"type": "WordLevel", "vocab": {"b": 4, "2": 3, " 4": 2, "3": 1, "a": 0}}}"#;
    let (f, b) = (
        Vocab::from_json_str(forward).unwrap(),
        Vocab::from_json_str(backward).unwrap(),
    );
    assert!(f.entries().eq(b.entries()));
    for set in [NumberSet::DigitLevel, NumberSet::AllNumbers] {
        let tf = f.number_table(set, 8).unwrap();
        let tb = b.number_table(set, 8).unwrap();
        assert_eq!(tf, tb);
    }
    // And repeated loads of a file give the same table.
    let first = build("wordlevel.json", NumberSet::AllNumbers, WL_WIDTH);
    for _ in 0..5 {
        assert_eq!(
            build("wordlevel.json", NumberSet::AllNumbers, WL_WIDTH),
            first
        );
    }
    // entries() is sorted by id, then token.
    let wl = vocab("wordlevel.json");
    let e: Vec<(i64, &str)> = wl.entries().collect();
    assert!(e.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn missing_file_is_an_error_naming_the_path() {
    let path = fixture("does_not_exist.json");
    let err = Vocab::from_file(&path).unwrap_err();
    assert!(matches!(err, TableError::Read { .. }));
    assert!(err.to_string().contains("does_not_exist.json"), "{err}");
}

#[test]
fn non_tokenizer_json_is_an_error_saying_what_was_expected() {
    let err = Vocab::from_file(&fixture("not_a_tokenizer.json")).unwrap_err();
    assert!(matches!(err, TableError::NotATokenizer { .. }));
    let msg = err.to_string();
    assert!(msg.contains("not_a_tokenizer.json"), "{msg}");
    assert!(msg.contains("tokenizer.json") && msg.contains("one token per line"));
    assert!(!msg.contains('\n'));

    for bad in [
        "[1, 2, 3]",
        r#"{"a": 1, "b": 2}"#,
        r#"{"model": {"type": "BPE", "vocab": [["a", 0.0]]}}"#,
        r#"{"model": {"type": "Unigram", "vocab": {"a": 0}}}"#,
        r#"{"model": {"type": "WordLevel"}}"#,
        r#"{"model": {"vocab": {"a": -1}}}"#,
        r#"{"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": 1}]}"#,
        r#"{"model": {"vocab": {"a": 0}"#,
    ] {
        let err = Vocab::from_json_str(bad).unwrap_err();
        assert!(
            matches!(err, TableError::NotATokenizer { .. }),
            "{bad}: {err}"
        );
    }
}

#[test]
fn binary_file_is_not_a_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("spm.model");
    std::fs::write(&path, [0x0a, 0xff, 0xfe, 0x00, 0x80]).unwrap();
    let err = Vocab::from_file(&path).unwrap_err();
    assert!(matches!(err, TableError::NotUtf8 { .. }), "{err}");
    assert!(err.to_string().contains("spm.model"));
}

//! Python's `float(str)`, reimplemented so that "is this token a number?"
//! gets the same answer as in ntloss (`ntloss.utils.is_number`, which calls
//! `float(token)` and keeps finite results).
//!
//! CPython (`PyFloat_FromString`, 3.11) does, in order:
//! 1. if the string is not pure ASCII, rewrite it: every non-ASCII
//!    whitespace char becomes `' '`, every Unicode decimal digit (Nd) becomes
//!    its ASCII digit, and any other non-ASCII char makes parsing fail;
//! 2. check and drop underscores (each must sit between two ASCII digits);
//! 3. strip ASCII whitespace `' ' \t \n \v \f \r` from both ends. Note that
//!    `\x1c`..`\x1f` are `str.isspace()` but are *not* stripped here;
//! 4. parse `[sign] (digits [. [digits]] | . digits) [(e|E) [sign] digits]`
//!    (or inf/nan spellings, which are never finite so we never accept them).
//!
//! Steps 2 and 3 commute for the inputs that succeed, so we strip first and
//! check underscores inside the grammar, which is simpler.

use crate::vocab::unicode_digits::{decimal_value, is_non_ascii_space};

/// `Some(x)` iff Python's `float(s)` succeeds and gives a finite `x`.
pub fn parse_python_float(s: &str) -> Option<f64> {
    let ascii = to_ascii(s)?;
    let body = ascii.trim_matches(|c| matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r'));
    let cleaned = check_grammar(body.as_bytes())?;
    // The grammar above is a subset of what Rust's parser accepts, and both
    // round correctly, so the value is the one Python computes. Overflow
    // gives inf (as in Python), which we reject.
    let x: f64 = cleaned.parse().ok()?;
    x.is_finite().then_some(x)
}

/// Step 1: the ASCII rewrite of a non-ASCII string, or None if some char
/// is neither ASCII, whitespace nor a decimal digit.
fn to_ascii(s: &str) -> Option<String> {
    s.chars()
        .map(|c| {
            if c.is_ascii() {
                Some(c)
            } else if is_non_ascii_space(c) {
                Some(' ')
            } else {
                decimal_value(c).map(|d| char::from(b'0' + d as u8))
            }
        })
        .collect()
}

/// Steps 2 and 4: checks the decimal grammar (with underscores allowed
/// only between digits) and returns the text without underscores.
fn check_grammar(b: &[u8]) -> Option<String> {
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    if matches!(b.first(), Some(b'+' | b'-')) {
        out.push(b[0] as char);
        i = 1;
    }
    let int_digits = digits(b, &mut i, &mut out);
    let mut frac_digits = 0;
    if b.get(i) == Some(&b'.') {
        out.push('.');
        i += 1;
        frac_digits = digits(b, &mut i, &mut out);
    }
    // "." alone, "+" alone and "" are not numbers.
    if int_digits + frac_digits == 0 {
        return None;
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        out.push('e');
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            out.push(b[i] as char);
            i += 1;
        }
        if digits(b, &mut i, &mut out) == 0 {
            return None;
        }
    }
    // Anything left over (a second '.', a stray '_', letters, inner
    // whitespace, ...) makes Python raise ValueError.
    (i == b.len()).then_some(out)
}

/// Consumes `digit (('_')? digit)*` at `*i`, pushing the digits to `out`;
/// returns how many digits it took (0 if none). An underscore not followed
/// by a digit is left unconsumed, so the caller fails on it.
fn digits(b: &[u8], i: &mut usize, out: &mut String) -> usize {
    let mut n = 0;
    while *i < b.len() {
        let c = b[*i];
        if c.is_ascii_digit() {
            out.push(c as char);
            *i += 1;
            n += 1;
        } else if c == b'_' && n > 0 && b.get(*i + 1).is_some_and(u8::is_ascii_digit) {
            *i += 1;
        } else {
            break;
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::parse_python_float;

    /// (input, what Python's float() gives, None for ValueError or a
    /// non-finite result). Expected values were produced by running
    /// `float(s)` in CPython 3.11.7 (Unicode 14.0.0) on each input.
    #[rustfmt::skip]
    const CASES: &[(&str, Option<f64>)] = &[
        ("0", Some(0.0)),
        ("9", Some(9.0)),
        ("3", Some(3.0)),
        (" 3", Some(3.0)),
        ("3 ", Some(3.0)),
        ("\t3\n", Some(3.0)),
        ("\r\n3\r\n", Some(3.0)),
        ("\u{b}3\u{c}", Some(3.0)),
        ("\u{1c}3", None),
        ("3\u{1f}", None),
        ("\u{85}3", Some(3.0)),
        ("\u{a0}3", Some(3.0)),
        ("3\u{3000}", Some(3.0)),
        ("\u{2028}3\u{2029}", Some(3.0)),
        ("\u{200b}3", None),
        ("\u{feff}3", None),
        ("\u{180e}3", None),
        ("12", Some(12.0)),
        ("-1", Some(-1.0)),
        ("+2", Some(2.0)),
        ("-0", Some(-0.0)),
        ("+0", Some(0.0)),
        ("00012", Some(12.0)),
        ("1.5", Some(1.5)),
        ("-1.5", Some(-1.5)),
        (".5", Some(0.5)),
        ("5.", Some(5.0)),
        ("-.5e-3", Some(-0.0005)),
        ("1e3", Some(1000.0)),
        ("1E3", Some(1000.0)),
        ("1e+3", Some(1000.0)),
        ("1e-3", Some(0.001)),
        ("1.5E3", Some(1500.0)),
        ("1e0_1", Some(10.0)),
        ("1_000", Some(1000.0)),
        ("1_000.000_1", Some(1000.0001)),
        ("1e1_0", Some(10000000000.0)),
        ("1__0", None),
        ("_1", None),
        ("1_", None),
        ("1_.5", None),
        ("1._5", None),
        ("1e_5", None),
        ("1_e5", None),
        ("+_1", None),
        ("1e", None),
        ("1e+", None),
        ("e3", None),
        (".e3", None),
        ("1.e3", Some(1000.0)),
        (".", None),
        ("+", None),
        ("-", None),
        ("", None),
        ("  ", None),
        ("+ 1", None),
        ("1 2", None),
        ("1..2", None),
        ("1.2.3", None),
        ("--1", None),
        ("+-1", None),
        ("0x10", None),
        ("0b1", None),
        ("0o7", None),
        ("1j", None),
        ("1f", None),
        ("1d", None),
        ("1.0L", None),
        ("inf", None),
        ("-inf", None),
        ("Infinity", None),
        ("nan", None),
        ("NaN", None),
        ("+nan", None),
        ("1e400", None),
        ("-1e400", None),
        ("1e-400", Some(0.0)),
        ("1e308", Some(1e+308)),
        ("1.7976931348623157e308", Some(1.7976931348623157e+308)),
        ("1.7976931348623159e308", None),
        ("4.9e-324", Some(5e-324)),
        ("2e-324", Some(0.0)),
        ("0.1", Some(0.1)),
        ("0.30000000000000004", Some(0.30000000000000004)),
        ("123456789012345678901234567890", Some(1.2345678901234568e+29)),
        ("9007199254740993", Some(9007199254740992.0)),
        ("\u{663}", Some(3.0)),
        ("\u{663}_\u{663}", Some(33.0)),
        ("\u{663}.\u{665}", Some(3.5)),
        ("\u{ff11}\u{ff12}", Some(12.0)),
        ("\u{ff13}", Some(3.0)),
        ("\u{1d7d8}", Some(0.0)),
        ("\u{1d7d7}", Some(9.0)),
        ("\u{ed3}", Some(3.0)),
        ("\u{a9d0}", Some(0.0)),
        ("\u{661}e\u{662}", Some(100.0)),
        ("1\u{a0}", Some(1.0)),
        ("\u{a0} \u{2003}", None),
        ("\u{2581}3", None),
        ("\u{120}7", None),
        ("##4", None),
        ("3%", None),
        ("$3", None),
        ("1,000", None),
        ("\u{bd}", None),
        ("\u{b2}", None),
        ("\u{216b}", None),
        ("\u{2460}", None),
        ("\u{0}1", None),
        ("1\u{0}", None),
        ("\u{7f}1", None),
        ("\u{4e00}", None),
        ("1e-5", Some(1e-05)),
        ("1e5", Some(100000.0)),
        ("0.000001", Some(1e-06)),
        ("1e16", Some(1e+16)),
        ("-0.0", Some(-0.0)),
        ("9.", Some(9.0)),
        ("\u{663}\u{1c}", None),
        ("\u{85}\u{663}", Some(3.0)),
    ];

    #[test]
    fn matches_cpython_float() {
        for &(input, expected) in CASES {
            let got = parse_python_float(input);
            // Compare bits so that -0.0 and 0.0 are told apart.
            assert_eq!(
                got.map(f64::to_bits),
                expected.map(f64::to_bits),
                "float({input:?}): got {got:?}, Python gives {expected:?}"
            );
        }
    }

    #[test]
    fn every_unicode_digit_maps_like_python() {
        // Each run of ten Nd digits parses to 0..9, as Python's
        // unicodedata.decimal() says (checked by the generator script).
        for &zero in crate::vocab::unicode_digits::DIGIT_ZEROS.iter() {
            for k in 0..10u32 {
                let c = char::from_u32(zero + k).unwrap();
                assert_eq!(parse_python_float(&c.to_string()), Some(k as f64), "{c:?}");
            }
        }
    }
}

//! Text for the terminal: names taken from a model (node, tensor, file names) may hold
//! control characters or Unicode bidirectional controls (U+202E RIGHT-TO-LEFT OVERRIDE
//! makes `evil\u{202e}xnn.onnx` display as `evilnnx.onnx`). Everything printed goes through
//! [`escape`] (one-line text) or [`escape_lines`] (multi-line reports), and JSON through
//! [`escape_json`].

use std::borrow::Cow;

/// Characters that change how the terminal shows the rest of the line: C0 and C1 controls,
/// DEL, the bidirectional embeddings, overrides, isolates and marks, and the invisible
/// zero-width characters and line/paragraph separators.
pub fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061C}'
                | '\u{200B}'..='\u{200F}'
                | '\u{2028}'..='\u{202E}'
                | '\u{2060}'..='\u{2069}'
                | '\u{FEFF}'
                | '\u{FFF9}'..='\u{FFFB}'
        )
}

/// One line: every unsafe character (newlines included) as `\n`, `\t`, `\u{202e}`, ...
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_unsafe) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if is_unsafe(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// A multi-line report: each line escaped, the line breaks kept.
pub fn escape_lines(s: &str) -> String {
    s.split('\n').map(escape).collect::<Vec<_>>().join("\n")
}

/// serde_json escapes C0 controls but writes DEL, C1 controls and bidi controls raw: write
/// those as `\uXXXX` too (still valid JSON, same value).
pub fn escape_json(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if is_unsafe(c) && c != '\n' {
            let mut buf = [0u16; 2];
            for unit in c.encode_utf16(&mut buf) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_controls_and_bidi() {
        assert_eq!(escape("plain name/ok"), "plain name/ok");
        assert_eq!(escape("a\u{202e}b"), "a\\u{202e}b");
        assert_eq!(escape("a\nb\x1b[31m"), "a\\nb\\u{1b}[31m");
        assert_eq!(escape_lines("x\u{2066}\ny"), "x\\u{2066}\ny");
        let v: serde_json::Value = serde_json::from_str(&escape_json(
            &serde_json::json!({"n": "a\u{202e}\u{85}b"}).to_string(),
        ))
        .unwrap();
        assert_eq!(v["n"], "a\u{202e}\u{85}b");
    }
}

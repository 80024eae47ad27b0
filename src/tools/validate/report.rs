//! The validation report: one check per compared output, rendered as a small table or JSON.

use std::path::PathBuf;

use crate::text::escape as esc;

/// What a runtime output was compared against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Against {
    /// The independent f64 implementation (`reference.rs`).
    Independent,
    /// A recorded output from `--reference DIR`.
    Recorded,
    /// The same training steps run by the other runtime (step graphs).
    OtherRuntime(&'static str),
}

impl Against {
    pub fn name(self) -> &'static str {
        match self {
            Against::Independent => "independent",
            Against::Recorded => "recorded",
            Against::OtherRuntime(name) => name,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Check {
    pub output: String,
    pub against: Against,
    /// The runtime's value and the expected one, at the element with the largest error.
    pub runtime: f64,
    pub expected: f64,
    /// Largest absolute and relative error over the elements.
    pub abs_err: f64,
    pub rel_err: f64,
    pub elements: usize,
    pub passed: bool,
    /// Why a check failed other than by value (shape mismatch, missing output).
    pub note: Option<String>,
}

impl Check {
    /// Elementwise `|a − b| ≤ atol + rtol·|b|`; NaN matches NaN (an empty CE mean is NaN in
    /// every implementation).
    pub fn compare(
        output: &str,
        against: Against,
        got: &[f64],
        want: &[f64],
        rtol: f64,
        atol: f64,
    ) -> Check {
        let mut check = Check {
            output: output.to_string(),
            against,
            runtime: got.first().copied().unwrap_or(f64::NAN),
            expected: want.first().copied().unwrap_or(f64::NAN),
            abs_err: 0.0,
            rel_err: 0.0,
            elements: want.len(),
            passed: true,
            note: None,
        };
        if got.len() != want.len() {
            return check.failed(format!("{} values, expected {}", got.len(), want.len()));
        }
        for (&a, &b) in got.iter().zip(want) {
            let (abs, ok) = if a.is_nan() && b.is_nan() || a == b {
                (0.0, true)
            } else {
                let d = (a - b).abs();
                (
                    if d.is_nan() { f64::INFINITY } else { d },
                    d <= atol + rtol * b.abs(),
                )
            };
            let rel = if abs == 0.0 { 0.0 } else { abs / b.abs() };
            if abs > check.abs_err || (!ok && check.passed) {
                check.runtime = a;
                check.expected = b;
            }
            check.abs_err = check.abs_err.max(abs);
            check.rel_err = check.rel_err.max(rel);
            check.passed &= ok;
        }
        check
    }

    pub fn missing(output: &str, against: Against, why: String) -> Check {
        Check::compare(output, against, &[], &[], 0.0, 0.0).failed(why)
    }

    /// Norm-relative comparison of two whole vectors: `‖got − want‖ / ‖want‖ ≤ rtol`.
    pub fn compare_norm(
        output: &str,
        against: Against,
        got: &[f64],
        want: &[f64],
        rtol: f64,
    ) -> Check {
        let mut check = Check::compare(output, against, &[], &[], 0.0, 0.0);
        check.elements = want.len();
        if got.len() != want.len() {
            return check.failed(format!("{} values, expected {}", got.len(), want.len()));
        }
        let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
        let diff = norm(&mut got.iter().zip(want).map(|(a, b)| a - b));
        let scale = norm(&mut want.iter().copied());
        check.runtime = norm(&mut got.iter().copied());
        check.expected = scale;
        check.abs_err = diff;
        check.rel_err = if scale > 0.0 { diff / scale } else { diff };
        if check.rel_err.is_nan() || check.rel_err > rtol {
            return check.failed(format!("norm-relative error above {rtol:e}"));
        }
        check
    }

    fn failed(mut self, why: String) -> Check {
        self.passed = false;
        self.note = Some(why);
        self
    }
}

#[derive(Debug, Clone)]
pub struct Report {
    pub model: PathBuf,
    pub runtime: &'static str,
    /// The patch's settings, from its metadata.
    pub settings: String,
    /// Where the inputs came from.
    pub inputs: String,
    pub positions: usize,
    pub number_positions: usize,
    pub ignored_positions: usize,
    pub rtol: f64,
    pub atol: f64,
    pub checks: Vec<Check>,
    /// What the reader should know about how the run was made (e.g. noise disabled).
    pub notes: Vec<String>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.passed)
    }

    /// The check of `output` against `against`, if made.
    pub fn check(&self, output: &str, against: Against) -> Option<&Check> {
        self.checks
            .iter()
            .find(|c| c.output == output && c.against == against)
    }

    pub fn to_text(&self) -> String {
        let mut s = format!(
            "validate {} on {}\n  patch: {}\n  inputs: {}; {} positions, {} with number labels, {} ignored\n  tolerance: |a - b| <= {:e} + {:e}*|b|\n\n",
            esc(&self.model.display().to_string()),
            self.runtime,
            esc(&self.settings),
            self.inputs,
            self.positions,
            self.number_positions,
            self.ignored_positions,
            self.atol,
            self.rtol,
        );
        if !self.notes.is_empty() {
            let notes: Vec<String> = self
                .notes
                .iter()
                .map(|n| format!("  note: {}\n", esc(n)))
                .collect();
            s.insert_str(s.len() - 1, &notes.concat());
        }
        let width = self
            .checks
            .iter()
            .map(|c| esc(&c.output).chars().count())
            .max()
            .unwrap_or(6)
            .max(6);
        s += &format!(
            "  {:<width$}  {:<11}  {:>20}  {:>20}  {:>9}  {:>9}  result\n",
            "output", "against", "runtime", "expected", "abs err", "rel err"
        );
        for c in &self.checks {
            s += &format!(
                "  {:<width$}  {:<11}  {:>20.12e}  {:>20.12e}  {:>9.2e}  {:>9.2e}  {}{}\n",
                esc(&c.output),
                c.against.name(),
                c.runtime,
                c.expected,
                c.abs_err,
                c.rel_err,
                if c.passed { "ok" } else { "FAIL" },
                c.note
                    .as_ref()
                    .map(|n| format!(" ({})", esc(n)))
                    .unwrap_or_default(),
            );
        }
        let failed: Vec<&str> = self
            .checks
            .iter()
            .filter(|c| !c.passed)
            .map(|c| c.output.as_str())
            .collect();
        s += &if failed.is_empty() {
            format!("\npassed: all {} checks agree", self.checks.len())
        } else {
            format!(
                "\nFAILED: {} of {} checks differ ({})",
                failed.len(),
                self.checks.len(),
                esc(&failed.join(", "))
            )
        };
        s
    }

    pub fn to_json(&self) -> String {
        let num = |x: f64| {
            if x.is_finite() {
                serde_json::json!(x)
            } else {
                serde_json::json!(x.to_string())
            }
        };
        let checks: Vec<serde_json::Value> = self
            .checks
            .iter()
            .map(|c| {
                serde_json::json!({
                    "output": c.output,
                    "against": c.against.name(),
                    "runtime": num(c.runtime),
                    "expected": num(c.expected),
                    "abs_err": num(c.abs_err),
                    "rel_err": num(c.rel_err),
                    "elements": c.elements,
                    "passed": c.passed,
                    "note": c.note,
                })
            })
            .collect();
        serde_json::json!({
            "model": self.model.display().to_string(),
            "runtime": self.runtime,
            "settings": self.settings,
            "inputs": self.inputs,
            "positions": self.positions,
            "number_positions": self.number_positions,
            "ignored_positions": self.ignored_positions,
            "rtol": self.rtol,
            "atol": self.atol,
            "passed": self.passed(),
            "checks": checks,
            "notes": self.notes,
        })
        .to_string()
    }
}

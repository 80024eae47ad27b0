//! The binary's side of errors: clap's usage errors as one line with exit code 1, the exit
//! codes, and a last-resort panic handler that reports an internal error in one line (exit 2).
//!
//! Exit codes: 0 success; 1 input or usage error (bad arguments, a model or option ntl-patch
//! refuses, `validate` checks that fail); 2 internal error (a bug: please report it); a run
//! ended by SIGINT/SIGTERM/SIGHUP dies of that signal (shells show 128 + the signal number).

use std::process::ExitCode;

pub const EXIT_INPUT: u8 = 1;
pub const EXIT_INTERNAL: u8 = 2;

/// Prints a clap error: help and version on stdout (exit 0); any usage error as one line
/// on stderr naming the problem, with clap's tip and where to find the usage (exit 1).
pub fn clap_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        let _ = e.print();
        return ExitCode::SUCCESS;
    }
    eprintln!("{}", one_line(&e));
    ExitCode::from(EXIT_INPUT)
}

fn one_line(e: &clap::Error) -> String {
    let rendered = e.render().to_string();
    let mut problem: Option<String> = None;
    let mut tips = Vec::new();
    // clap continues the problem on indented lines right after it (the missing `<MODEL>`,
    // the possible values): they are part of the problem, not decoration
    let mut continued = 0;
    for raw in rendered.lines() {
        let line = raw.trim();
        if let Some(p) = line.strip_prefix("error: ") {
            if problem.is_none() {
                problem = Some(p.to_string());
                continued = 1;
            }
        } else if let Some(t) = line.strip_prefix("tip: ") {
            tips.push(t.to_string());
            continued = 0;
        } else if continued > 0 && !line.is_empty() && raw.starts_with(char::is_whitespace) {
            let p = problem.as_mut().expect("set with `continued`");
            p.push_str(if continued == 1 { " " } else { ", " });
            p.push_str(line);
            continued += 1;
        } else {
            continued = 0;
        }
    }
    let problem = problem.unwrap_or_else(|| match e.kind() {
        clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            "no MODEL or command given".into()
        }
        _ => rendered
            .lines()
            .next()
            .unwrap_or("invalid arguments")
            .to_string(),
    });
    let mut line = format!("error: {problem}");
    for t in tips {
        line.push_str(&format!("; tip: {t}"));
    }
    line.push_str("; see 'ntl-patch --help' for usage");
    ntl_patch::text::escape(&line).into_owned()
}

/// Runs `body`, turning a panic into one line on stderr and exit code 2 (temporary files are
/// removed while unwinding).
pub fn guard(body: impl FnOnce() -> ExitCode) -> ExitCode {
    std::panic::set_hook(Box::new(|info| {
        if ntl_patch::error::panic_is_caught() {
            return; // reported as an error by the code that caught it
        }
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let line = format!("error: internal error ({message}{at}); please report this with the input that caused it");
        eprintln!("{}", ntl_patch::text::escape(&line));
    }));
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(body))
        .unwrap_or_else(|_| ExitCode::from(EXIT_INTERNAL))
}

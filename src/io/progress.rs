//! Progress on stderr for the slow steps (loading, saving and copying big models): shown only
//! when stderr is a terminal and only once a step has run for a second; silent otherwise, so
//! pipes, logs and tests never see it.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How long a step runs before its progress appears.
const DELAY: Duration = Duration::from_secs(1);
/// How often a shown bar redraws.
const TICK: Duration = Duration::from_millis(100);

/// One step's progress: a byte bar when the total is known, else a spinner. Dropping it ends the
/// step and clears the line.
pub struct Progress {
    shared: Option<Arc<Shared>>,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    position: AtomicU64,
    done: Mutex<bool>,
    wake: Condvar,
}

impl Progress {
    /// Starts a step named `label` of `total` bytes (None: a spinner). Nothing is drawn unless
    /// stderr is a terminal and the step is still running after a second.
    pub fn start(label: &str, total: Option<u64>) -> Progress {
        if !std::io::stderr().is_terminal() {
            return Progress::silent();
        }
        let shared = Arc::new(Shared {
            position: AtomicU64::new(0),
            done: Mutex::new(false),
            wake: Condvar::new(),
        });
        let label = label.to_string();
        let worker = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("ntl-patch-progress".into())
            .spawn(move || show(&worker, &label, total))
            .ok();
        Progress {
            shared: thread.as_ref().map(|_| shared),
            thread,
        }
    }

    /// A progress that never draws.
    pub fn silent() -> Progress {
        Progress {
            shared: None,
            thread: None,
        }
    }

    /// Bytes done so far.
    pub fn set(&self, position: u64) {
        if let Some(s) = &self.shared {
            s.position.store(position, Ordering::Relaxed);
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(s) = &self.shared {
            *s.done.lock().unwrap_or_else(|e| e.into_inner()) = true;
            s.wake.notify_all();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits out the delay, then draws until the step is done.
fn show(shared: &Shared, label: &str, total: Option<u64>) {
    let wait = |timeout| {
        let done = shared.done.lock().unwrap_or_else(|e| e.into_inner());
        let (done, _) = shared
            .wake
            .wait_timeout_while(done, timeout, |d| !*d)
            .unwrap_or_else(|e| e.into_inner());
        *done
    };
    if wait(DELAY) {
        return;
    }
    let bar = match total {
        Some(total) => {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr())
                .with_position(shared.position.load(Ordering::Relaxed));
            if let Ok(style) = ProgressStyle::with_template(
                "[{bar:25}] {binary_bytes}/{binary_total_bytes} {wide_msg}",
            ) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar
        }
        None => {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template("{spinner} {elapsed} {wide_msg}") {
                bar.set_style(style);
            }
            bar
        }
    };
    bar.set_message(label.to_string());
    loop {
        bar.set_position(shared.position.load(Ordering::Relaxed));
        bar.tick();
        if wait(TICK) {
            break;
        }
    }
    bar.finish_and_clear();
}

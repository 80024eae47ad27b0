//! Temporary files and folders that never outlive the run.
//!
//! Every output is written to an unnamed file in its target folder (`O_TMPFILE`, see
//! [`TempFile`]) and linked into place when complete; nothing of it exists for a killed run
//! to leave behind. Where the file system refuses unnamed files, and for temporary folders,
//! it is a temporary name (`.ntl-patch-XXXXXX.tmp`, six random letters or digits) renamed
//! into place. Each live temporary path is kept in a registry and holds an exclusive `flock`
//! while it exists:
//! - errors: the temporary is removed when its guard drops (also after a failed rename);
//! - SIGINT, SIGTERM, SIGHUP: the binary (`install_signal_handlers`) removes every registered
//!   path, then dies of the same signal; SIGBUS (a memory-mapped input truncated by another
//!   process) removes them, says so in one line and exits 1;
//! - SIGKILL or a power cut cannot be caught: the next run that writes into the same folder
//!   removes leftovers it recognises ([`sweep_stale`]): entries whose name matches the
//!   pattern exactly, owned by the same user, last modified before that run started, and not
//!   locked (a live run holds its lock, so a concurrent run's files are never touched).

use std::ffi::CString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::SystemTime;

use tempfile::NamedTempFile;

use crate::io::unnamed;

pub const PREFIX: &str = ".ntl-patch-";
pub const SUFFIX: &str = ".tmp";
const RAND_LEN: usize = 6;

struct Entry {
    id: u64,
    path: PathBuf,
    c_path: CString,
    dir: bool,
}

static LIVE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
static START: OnceLock<SystemTime> = OnceLock::new();

/// When this process started (first use of this module, or the signal setup in `main`).
fn start_time() -> SystemTime {
    *START.get_or_init(SystemTime::now)
}

fn live() -> std::sync::MutexGuard<'static, Vec<Entry>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes its path from the registry when dropped.
struct Registered(u64);

impl Registered {
    /// Creates a temporary with `make` while holding the registry, and registers it: the
    /// signal thread, which takes the registry before removing, sees either nothing created
    /// yet or the created path, never a path created but not yet registered.
    fn create<T>(
        dir: bool,
        make: impl FnOnce() -> std::io::Result<(T, PathBuf)>,
    ) -> std::io::Result<(T, Registered)> {
        use std::os::unix::ffi::OsStrExt;
        let mut registry = live();
        let (made, path) = make()?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let c_path = CString::new(path.as_os_str().as_bytes()).unwrap_or_default();
        registry.push(Entry {
            id,
            path,
            c_path,
            dir,
        });
        Ok((made, Registered(id)))
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        live().retain(|e| e.id != self.0);
    }
}

#[cfg(unix)]
fn try_lock(file: &File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid descriptor.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

#[cfg(not(unix))]
fn try_lock(_: &File) -> bool {
    true
}

/// A temporary file in the target folder, removed unless [`TempFile::persist`]ed.
///
/// Where the file system allows, the file has no name until it is complete ([`unnamed`]):
/// a run killed at any moment, by SIGKILL too, leaves no temporary behind. Elsewhere it is
/// `.ntl-patch-XXXXXX.tmp`, registered and swept as above.
pub struct TempFile {
    // drop order: the file is removed first, then the registry entry
    file: Option<Kind>,
    _registered: Option<Registered>,
}

enum Kind {
    Unnamed(File),
    Named(NamedTempFile),
}

impl TempFile {
    /// Creates an unnamed file in `dir`, or where `O_TMPFILE` is refused
    /// `.ntl-patch-XXXXXX.tmp`; first removes stale temporaries left there by killed runs.
    pub fn new_in(dir: &Path) -> std::io::Result<TempFile> {
        crate::io::fsio::check_writable_folder(dir)?;
        sweep_stale(dir);
        // without /proc an unnamed file may not be linkable later (AT_EMPTY_PATH needs a
        // capability): a named one then
        let linkable = Path::new("/proc/self/fd").is_dir();
        match unnamed::create_in(dir).and_then(|f| {
            linkable
                .then_some(f)
                .ok_or_else(|| std::io::ErrorKind::Unsupported.into())
        }) {
            Ok(file) => {
                // the lock covers the name it may get in `persist` (see there)
                try_lock(&file);
                Ok(TempFile {
                    file: Some(Kind::Unnamed(file)),
                    _registered: None,
                })
            }
            Err(_) => Self::named_in(dir),
        }
    }

    /// `.ntl-patch-XXXXXX.tmp` in `dir`, registered (the fallback of [`TempFile::new_in`]).
    pub fn named_in(dir: &Path) -> std::io::Result<TempFile> {
        let (file, registered) = Registered::create(false, || {
            let file = tempfile::Builder::new()
                .prefix(PREFIX)
                .suffix(SUFFIX)
                .rand_bytes(RAND_LEN)
                .tempfile_in(dir)?;
            let path = file.path().to_path_buf();
            Ok((file, path))
        })?;
        try_lock(file.as_file());
        Ok(TempFile {
            file: Some(Kind::Named(file)),
            _registered: Some(registered),
        })
    }

    /// True when the file has no name (`O_TMPFILE`).
    pub fn is_unnamed(&self) -> bool {
        matches!(self.file, Some(Kind::Unnamed(_)))
    }

    pub fn as_file(&self) -> &File {
        match self.file.as_ref().expect("present until persisted") {
            Kind::Unnamed(f) => f,
            Kind::Named(f) => f.as_file(),
        }
    }

    pub fn as_file_mut(&mut self) -> &mut File {
        match self.file.as_mut().expect("present until persisted") {
            Kind::Unnamed(f) => f,
            Kind::Named(f) => f.as_file_mut(),
        }
    }

    /// Puts the file at `dest`, replacing a regular file there (nothing else). On error the
    /// temporary file is removed.
    ///
    /// An unnamed file is linked to `dest` when nothing is there: one step, all or nothing.
    /// `linkat` cannot replace, so over an existing `dest` it is linked to a fresh
    /// `.ntl-patch-XXXXXX.tmp` and that is renamed over `dest` (atomic: `dest` is the old
    /// file or the new one, never part of one). Between those two calls a SIGKILL leaves the
    /// complete file under the temporary name and `dest` untouched; the name is registered
    /// (removed on SIGINT/SIGTERM/SIGHUP) and still `flock`ed by this process (a concurrent
    /// run's sweep keeps it), and the next run in the folder sweeps it. No work happens in
    /// that window: it is two system calls long.
    pub fn persist(mut self, dest: &Path) -> std::io::Result<()> {
        crate::io::fsio::check_output_path(dest)?;
        match self.file.take().expect("present until persisted") {
            Kind::Named(file) => file.persist(dest).map(drop).map_err(|e| e.error),
            Kind::Unnamed(file) => match unnamed::link(&file, dest) {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    replace_with(&file, dest)
                }
                other => other,
            },
        }
    }

    /// Puts the file at `dest` unless something exists there (`AlreadyExists`). On error
    /// the temporary file is removed. `dest` stays registered (removed on a signal) until
    /// the returned guard drops: a file that is only useful once the whole output exists
    /// (an external data copy) does not outlive an interrupted run either.
    pub fn persist_noclobber(mut self, dest: &Path) -> std::io::Result<Tracked> {
        let file = self.file.take().expect("present until persisted");
        let ((), registered) = Registered::create(false, || {
            match file {
                Kind::Unnamed(f) => unnamed::link(&f, dest)?,
                Kind::Named(f) => drop(f.persist_noclobber(dest).map_err(|e| e.error)?),
            }
            Ok(((), dest.to_path_buf()))
        })?;
        Ok(Tracked {
            _registered: registered,
        })
    }
}

/// Links the unnamed `file` to a fresh temporary name beside `dest`, then renames that over
/// `dest` (see [`TempFile::persist`]). The name is registered while it exists.
fn replace_with(file: &File, dest: &Path) -> std::io::Result<()> {
    use rand::distributions::{Alphanumeric, DistString};
    let dir = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    for _ in 0..100 {
        let name = format!(
            "{PREFIX}{}{SUFFIX}",
            Alphanumeric.sample_string(&mut rand::thread_rng(), RAND_LEN)
        );
        let tmp = dir.join(name);
        let linked = Registered::create(false, || {
            unnamed::link(file, &tmp)?;
            Ok(((), tmp.clone()))
        });
        let ((), _registered) = match linked {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            other => other?,
        };
        return std::fs::rename(&tmp, dest).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        });
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AlreadyExists,
        "no free temporary name beside the output",
    ))
}

/// A finished file still removed on a signal until this guard drops.
pub struct Tracked {
    _registered: Registered,
}

/// A temporary folder beside the target, removed (with its contents) unless persisted.
pub struct TempDir {
    path: Option<PathBuf>,
    _lock: Option<File>,
    _registered: Registered,
}

impl TempDir {
    pub fn new_in(parent: &Path) -> std::io::Result<TempDir> {
        crate::io::fsio::check_writable_folder(parent)?;
        sweep_stale(parent);
        let (path, registered) = Registered::create(true, || {
            let dir = tempfile::Builder::new()
                .prefix(PREFIX)
                .suffix(SUFFIX)
                .rand_bytes(RAND_LEN)
                .tempdir_in(parent)?;
            let path = dir.keep();
            Ok((path.clone(), path))
        })?;
        let lock = File::open(&path).ok();
        if let Some(l) = &lock {
            try_lock(l);
        }
        Ok(TempDir {
            path: Some(path),
            _lock: lock,
            _registered: registered,
        })
    }

    pub fn path(&self) -> &Path {
        self.path.as_deref().expect("present until persisted")
    }

    /// Renames the folder to `dest` (which must not exist); on error it is removed.
    ///
    /// The rename happens while holding the registry, which the signal thread takes and
    /// keeps until the process dies: a folder is either renamed complete before a signal is
    /// handled, or never (this call then waits for the process to end). Without that, a
    /// signal that came while the folder was being removed let the rename carry the files
    /// written after the removal began into place: a partial output folder.
    pub fn persist(mut self, dest: &Path) -> std::io::Result<()> {
        let path = self.path.take().expect("present until persisted");
        let held = live();
        if let Ok(meta) = std::fs::symlink_metadata(dest) {
            drop(held);
            let _ = std::fs::remove_dir_all(&path);
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("it already exists ({})", crate::io::fsio::kind_of(&meta)),
            ));
        }
        let renamed = std::fs::rename(&path, dest);
        drop(held);
        renamed.inspect_err(|_| {
            let _ = std::fs::remove_dir_all(&path);
        })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

/// True for names `.ntl-patch-XXXXXX.tmp` (X: ASCII letter or digit), exactly.
pub fn is_temp_name(name: &str) -> bool {
    name.strip_prefix(PREFIX)
        .and_then(|rest| rest.strip_suffix(SUFFIX))
        .is_some_and(|mid| mid.len() == RAND_LEN && mid.bytes().all(|b| b.is_ascii_alphanumeric()))
}

/// Removes temporaries a killed run left in `dir`: names matching [`is_temp_name`], regular
/// files or folders (not symlinks) owned by this user, modified before this process started,
/// and not locked by a live run. Returns how many were removed; never fails.
pub fn sweep_stale(dir: &Path) -> usize {
    let start = start_time();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_str().is_some_and(is_temp_name) {
            continue;
        }
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let t = meta.file_type();
        if !(t.is_file() || t.is_dir()) || meta.modified().map_or(true, |m| m >= start) {
            continue;
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
            // SAFETY: no arguments, cannot fail.
            if meta.uid() != unsafe { libc::geteuid() } {
                continue;
            }
            let Ok(f) = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .open(&path)
            else {
                continue;
            };
            if !try_lock(&f) {
                continue; // a live run holds it
            }
        }
        let gone = if t.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        removed += usize::from(gone.is_ok());
    }
    removed
}

/// Removes every registered temporary path. Returns the registry still locked, so that no
/// new temporary is registered before the process ends.
fn remove_registered() -> Option<std::sync::MutexGuard<'static, Vec<Entry>>> {
    let guard = live();
    for e in guard.iter() {
        if e.dir {
            remove_folder_being_written(&e.path);
        } else {
            // SAFETY: a NUL-terminated path.
            unsafe { libc::unlink(e.c_path.as_ptr()) };
        }
    }
    Some(guard)
}

/// Removes a folder another thread may still be writing into: a file linked in after the
/// removal listed the folder makes the last step (rmdir) fail, so it is tried again until the
/// folder is gone. The writer cannot outlast it: it has finitely many files to write, and
/// cannot rename the folder into place while the registry is held (`TempDir::persist`).
fn remove_folder_being_written(path: &Path) {
    for _ in 0..10_000 {
        match std::fs::remove_dir_all(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => continue,
            _ => return,
        }
    }
}

/// For the binary, before any other thread starts: SIGINT, SIGTERM and SIGHUP are handled by
/// a thread that removes the registered temporaries and then lets the signal end the process
/// (exit status 128 + signal); SIGBUS (the memory-mapped input was truncated by another
/// process) removes them too, prints one line and exits 1.
#[cfg(unix)]
pub fn install_signal_handlers() {
    start_time();
    // SAFETY: plain libc signal-mask and sigaction calls on locally owned structs.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("ntl-patch-signals".into())
            .spawn(move || loop {
                let mut sig: libc::c_int = 0;
                if libc::sigwait(&set, &mut sig) != 0 {
                    continue;
                }
                let _held = remove_registered();
                let name = match sig {
                    libc::SIGINT => "SIGINT",
                    libc::SIGTERM => "SIGTERM",
                    _ => "SIGHUP",
                };
                let line = format!("\nntl-patch: interrupted ({name}); temporary files removed, no output written\n");
                libc::write(2, line.as_ptr().cast(), line.len());
                // die of the same signal, so the parent sees what happened
                libc::signal(sig, libc::SIG_DFL);
                let mut one: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut one);
                libc::sigaddset(&mut one, sig);
                libc::pthread_sigmask(libc::SIG_UNBLOCK, &one, std::ptr::null_mut());
                libc::raise(sig);
                libc::_exit(128 + sig);
            });
        if spawned.is_err() {
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        }

        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
        action.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
    }
}

#[cfg(not(unix))]
pub fn install_signal_handlers() {}

/// The faulting thread was reading the memory-mapped input (never inside the allocator), so
/// the registry can be emptied here; `try_lock` avoids waiting on a lock this thread holds.
#[cfg(unix)]
extern "C" fn on_sigbus(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    if let Ok(guard) = LIVE.try_lock() {
        for e in guard.iter() {
            if e.dir {
                let _ = std::fs::remove_dir_all(&e.path);
            } else {
                // SAFETY: a NUL-terminated path.
                unsafe { libc::unlink(e.c_path.as_ptr()) };
            }
        }
    }
    let line = b"error: an input file changed (it was truncated) while ntl-patch read it; run again when no other process writes it (no output written)\n";
    // SAFETY: write(2) and _exit(2) are async-signal-safe.
    unsafe {
        libc::write(2, line.as_ptr().cast(), line.len());
        libc::_exit(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_names() {
        assert!(is_temp_name(".ntl-patch-a1B2c3.tmp"));
        assert!(!is_temp_name(".ntl-patch-a1B2c.tmp"));
        assert!(!is_temp_name(".ntl-patch-a1B2c3d.tmp"));
        assert!(!is_temp_name(".ntl-patch-a1B2-3.tmp"));
        assert!(!is_temp_name("ntl-patch-a1B2c3.tmp"));
        assert!(!is_temp_name(".ntl-patch-a1B2c3.tmpx"));
    }

    #[test]
    fn stale_entries_are_swept_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        start_time();
        let old = SystemTime::now() - std::time::Duration::from_secs(3600);
        let stale = dir.path().join(".ntl-patch-AbC123.tmp");
        let other = dir.path().join(".ntl-patch-AbC12.tmp");
        for p in [&stale, &other] {
            let f = File::create(p).unwrap();
            f.set_modified(old).unwrap();
        }
        let stale_dir = dir.path().join(".ntl-patch-dIr456.tmp");
        std::fs::create_dir(&stale_dir).unwrap();
        std::fs::write(stale_dir.join("x"), b"x").unwrap();
        File::open(&stale_dir).unwrap().set_modified(old).unwrap();
        // a live one (locked by this process through another descriptor)
        let live_path = dir.path().join(".ntl-patch-LiVe00.tmp");
        let held = File::create(&live_path).unwrap();
        held.set_modified(old).unwrap();
        assert!(try_lock(&held));
        assert_eq!(sweep_stale(dir.path()), 2);
        assert!(!stale.exists() && !stale_dir.exists());
        assert!(other.exists() && live_path.exists());
    }

    #[test]
    fn a_named_temp_file_is_removed_unless_persisted() {
        let dir = tempfile::tempdir().unwrap();
        let t = TempFile::named_in(dir.path()).unwrap();
        let Some(Kind::Named(f)) = &t.file else {
            panic!("named")
        };
        let path = f.path().to_path_buf();
        assert!(path.exists() && live().iter().any(|e| e.path == path));
        drop(t);
        assert!(!path.exists() && !live().iter().any(|e| e.path == path));
        let t = TempFile::named_in(dir.path()).unwrap();
        t.persist(&dir.path().join("out")).unwrap();
        assert!(dir.path().join("out").exists());
        assert!(live().is_empty() || !live().iter().any(|e| e.path.starts_with(dir.path())));
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    fn written(dir: &Path, bytes: &[u8]) -> TempFile {
        use std::io::Write;
        let mut t = TempFile::new_in(dir).unwrap();
        assert!(t.is_unnamed(), "this file system takes O_TMPFILE");
        t.as_file_mut().write_all(bytes).unwrap();
        t
    }

    /// An unnamed file is invisible until persisted: as a new file, over an existing one (via
    /// a temporary name that is gone afterwards), and refused over one by `persist_noclobber`.
    #[test]
    fn an_unnamed_temp_file_has_no_name_until_persisted() {
        let dir = tempfile::tempdir().unwrap();
        let t = written(dir.path(), b"new");
        assert!(names(dir.path()).is_empty());
        drop(t);
        assert!(names(dir.path()).is_empty());

        let out = dir.path().join("out");
        written(dir.path(), b"first").persist(&out).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"first");
        written(dir.path(), b"second").persist(&out).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"second");
        assert_eq!(names(dir.path()), ["out"]);

        let err = written(dir.path(), b"third")
            .persist_noclobber(&out)
            .err()
            .unwrap();
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&out).unwrap(), b"second");
        let data = dir.path().join("data");
        let guard = written(dir.path(), b"data")
            .persist_noclobber(&data)
            .unwrap();
        assert!(live().iter().any(|e| e.path == data));
        drop(guard);
        assert_eq!(std::fs::read(&data).unwrap(), b"data");
        assert_eq!(names(dir.path()), ["data", "out"]);
        assert!(!live().iter().any(|e| e.path.starts_with(dir.path())));
    }
}

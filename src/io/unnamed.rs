//! Files without a name (Linux `O_TMPFILE`): created in a folder, invisible there until
//! linked, and freed by the kernel when the last descriptor closes. A run killed by any signal,
//! SIGKILL included, leaves nothing of them behind.

use std::fs::File;
use std::path::Path;

/// An unnamed regular file (mode 0600) in `dir`. Fails where the kernel or the file system
/// has no `O_TMPFILE` (EOPNOTSUPP, EISDIR on kernels before 3.11, ...); callers fall back to
/// a named temporary then.
#[cfg(target_os = "linux")]
pub fn create_in(dir: &Path) -> std::io::Result<File> {
    use std::os::fd::FromRawFd;
    let c_dir = c_path(dir)?;
    // no O_EXCL: it would forbid the linkat that gives the file its name
    // SAFETY: a NUL-terminated path; the descriptor returned is owned by the File.
    let fd = unsafe {
        libc::open(
            c_dir.as_ptr(),
            libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC,
            0o600 as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor just opened and owned by nobody else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

#[cfg(not(target_os = "linux"))]
pub fn create_in(_dir: &Path) -> std::io::Result<File> {
    Err(std::io::ErrorKind::Unsupported.into())
}

/// Gives the unnamed `file` the name `dest`: all its bytes appear at once. Never replaces
/// anything: `AlreadyExists` when `dest` exists.
#[cfg(target_os = "linux")]
pub fn link(file: &File, dest: &Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let c_dest = c_path(dest)?;
    // `/proc/self/fd/N` with AT_SYMLINK_FOLLOW works unprivileged; AT_EMPTY_PATH needs
    // CAP_DAC_READ_SEARCH, but works where /proc is not mounted.
    let proc_path = std::ffi::CString::new(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .expect("no NUL in a number");
    // SAFETY: NUL-terminated paths and a valid descriptor.
    let rc = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            proc_path.as_ptr(),
            libc::AT_FDCWD,
            c_dest.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.kind() == std::io::ErrorKind::AlreadyExists {
        return Err(err);
    }
    // SAFETY: as above; the empty path names the descriptor itself.
    let rc = unsafe {
        libc::linkat(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            c_dest.as_ptr(),
            libc::AT_EMPTY_PATH,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        // the first error says more (EXDEV, ENOSPC, EACCES) than AT_EMPTY_PATH's EPERM/ENOENT
        let second = std::io::Error::last_os_error();
        Err(if second.kind() == std::io::ErrorKind::AlreadyExists {
            second
        } else {
            err
        })
    }
}

#[cfg(not(target_os = "linux"))]
pub fn link(_file: &File, _dest: &Path) -> std::io::Result<()> {
    Err(std::io::ErrorKind::Unsupported.into())
}

#[cfg(target_os = "linux")]
fn c_path(p: &Path) -> std::io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "a NUL byte in the path")
    })
}

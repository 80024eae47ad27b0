//! Opening what the user names, safely: only regular files are read (a FIFO, a device or a
//! directory is refused with a message that says what it is, and opening never blocks),
//! files inside a folder are opened without following symlinks out of it, and output paths
//! never replace anything but a regular file.
//!
//! The functions return `std::io::Error`s whose text names the problem, so every caller's
//! existing "cannot read 'PATH': ..." message reads well.

use std::fs::{File, Metadata, OpenOptions};
use std::io::{Error as IoError, ErrorKind, Read};
use std::path::{Component, Path};

#[cfg(unix)]
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};

/// What a non-regular file is, in words ("a directory", "a FIFO (named pipe)", ...).
pub fn kind_of(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        return "a directory";
    }
    if t.is_symlink() {
        return "a symbolic link";
    }
    #[cfg(unix)]
    {
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if t.is_file() {
        "a regular file"
    } else {
        "not a regular file"
    }
}

fn not_regular(meta: &Metadata) -> IoError {
    IoError::new(
        ErrorKind::InvalidInput,
        format!("it is {}, not a regular file", kind_of(meta)),
    )
}

/// Opens `path` for reading if it is a regular file. A FIFO or device is never opened in
/// blocking mode: the path is checked first, the open is non-blocking, and the opened
/// descriptor is checked again (the path may have been swapped in between).
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    let mut options = OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    options.custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
    let file = options.open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    Ok(file)
}

/// Reads a whole regular file of at most `max` bytes.
pub fn read_regular(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let file = open_regular(path)?;
    let len = file.metadata()?.len();
    if len > max {
        return Err(too_large(len, max));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    // the file may grow meanwhile: never read past the cap
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(too_large(bytes.len() as u64, max));
    }
    Ok(bytes)
}

fn too_large(len: u64, max: u64) -> IoError {
    IoError::new(
        ErrorKind::InvalidInput,
        format!(
            "it is {len} bytes, more than the {} MiB this file may have",
            max >> 20
        ),
    )
}

/// Opens `rel` (a relative path) inside the folder `dir` for reading, resolving it the way
/// the kernel does but never leaving `dir`: `..` above it, absolute symlinks and symlinks
/// that point outside are refused (Linux `openat2` with `RESOLVE_BENEATH`; elsewhere, a
/// check of the opened file's real path). The file must be regular. Copies made from the
/// returned descriptor cannot be redirected by a later swap of the path.
pub fn open_beneath(dir: &Path, rel: &Path) -> std::io::Result<File> {
    if rel.is_absolute()
        || rel
            .components()
            .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return Err(IoError::new(
            ErrorKind::PermissionDenied,
            "it is absolute or climbs out of the folder",
        ));
    }
    let file = open_beneath_os(dir, rel)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    Ok(file)
}

#[cfg(target_os = "linux")]
fn open_beneath_os(dir: &Path, rel: &Path) -> std::io::Result<File> {
    use std::ffi::CString;
    use std::os::fd::{AsRawFd, FromRawFd};
    use std::os::unix::ffi::OsStrExt;

    let base = File::open(dir)?;
    let c_rel = CString::new(rel.as_os_str().as_bytes())
        .map_err(|_| IoError::new(ErrorKind::InvalidInput, "it contains a NUL byte"))?;
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: valid fd, NUL-terminated path, `how` sized as passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            base.as_raw_fd(),
            c_rel.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd >= 0 {
        // SAFETY: a fresh descriptor we own.
        return Ok(unsafe { File::from_raw_fd(fd as i32) });
    }
    let err = IoError::last_os_error();
    match err.raw_os_error() {
        Some(libc::EXDEV) => Err(IoError::new(
            ErrorKind::PermissionDenied,
            "it resolves (through a symlink) outside the folder",
        )),
        // kernels before 5.6, or seccomp filters: open, then check where the file really is
        Some(libc::ENOSYS) | Some(libc::EPERM) => open_then_check(dir, rel),
        _ => Err(err),
    }
}

#[cfg(not(target_os = "linux"))]
fn open_beneath_os(dir: &Path, rel: &Path) -> std::io::Result<File> {
    open_then_check(dir, rel)
}

/// Opens `dir/rel`, then checks that the file opened is the one the resolved path inside
/// `dir` names (same device and inode), so a swap between the two steps is caught.
fn open_then_check(dir: &Path, rel: &Path) -> std::io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    options.custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
    let file = options.open(dir.join(rel))?;
    let base = dir.canonicalize()?;
    let real = dir.join(rel).canonicalize()?;
    let escape = || {
        IoError::new(
            ErrorKind::PermissionDenied,
            "it resolves (through a symlink) outside the folder",
        )
    };
    if !real.starts_with(&base) {
        return Err(escape());
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let (opened, named) = (file.metadata()?, std::fs::metadata(&real)?);
        if opened.dev() != named.dev() || opened.ino() != named.ino() {
            return Err(escape());
        }
    }
    Ok(file)
}

/// Checks an output path before any work: it may not exist yet, or be a regular file
/// (which is then replaced). Devices, FIFOs, directories, sockets and symlinks are refused,
/// so writing never turns one of them into a regular file.
pub fn check_output_path(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_file() => Ok(()),
        Ok(meta) => Err(IoError::new(
            ErrorKind::InvalidInput,
            format!(
                "it is {}; ntl-patch only replaces regular files, choose another -o",
                kind_of(&meta)
            ),
        )),
        Err(e) if e.kind() == ErrorKind::NotFound => check_output_folder(path),
        Err(e) => Err(e),
    }
}

/// A new output's folder must exist: said plainly, not as the temporary file's path.
fn check_output_folder(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    match std::fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(_) => Err(IoError::new(
            ErrorKind::InvalidInput,
            format!("'{}' is not a folder", dir.display()),
        )),
        Err(e) if e.kind() == ErrorKind::NotFound => Err(IoError::new(
            ErrorKind::NotFound,
            format!("the folder '{}' does not exist", dir.display()),
        )),
        Err(e) => Err(e),
    }
}

/// Refuses a folder where a temporary file could be created but never renamed or removed
/// (an append-only or immutable folder, `chattr +a`/`+i`).
pub fn check_writable_folder(dir: &Path) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        const FS_IMMUTABLE_FL: libc::c_long = 0x10;
        const FS_APPEND_FL: libc::c_long = 0x20;
        let Ok(d) = File::open(dir) else {
            return Ok(()); // the create that follows reports the real problem
        };
        let mut flags: libc::c_long = 0;
        // SAFETY: FS_IOC_GETFLAGS writes one long into `flags`.
        let rc = unsafe { libc::ioctl(d.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) };
        if rc == 0 && flags & (FS_APPEND_FL | FS_IMMUTABLE_FL) != 0 {
            return Err(IoError::new(
                ErrorKind::PermissionDenied,
                "the folder is append-only or immutable (chattr +a/+i), so a temporary file could be neither renamed into place nor removed; write to another folder",
            ));
        }
    }
    let _ = dir;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_and_fifos_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = open_regular(dir.path()).unwrap_err();
        assert!(err.to_string().contains("a directory"), "{err}");
        #[cfg(unix)]
        {
            let fifo = dir.path().join("fifo");
            let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            let err = open_regular(&fifo).unwrap_err();
            assert!(err.to_string().contains("FIFO"), "{err}");
        }
    }

    #[test]
    fn beneath_refuses_escapes() {
        let root = tempfile::tempdir().unwrap();
        let inside = root.path().join("in");
        std::fs::create_dir(&inside).unwrap();
        std::fs::write(root.path().join("secret.bin"), b"s").unwrap();
        std::fs::write(inside.join("ok.bin"), b"o").unwrap();
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink("../secret.bin", inside.join("out.bin")).unwrap();
            std::os::unix::fs::symlink("ok.bin", inside.join("alias.bin")).unwrap();
            assert!(open_beneath(&inside, Path::new("out.bin")).is_err());
            assert!(open_beneath(&inside, Path::new("alias.bin")).is_ok());
        }
        assert!(open_beneath(&inside, Path::new("ok.bin")).is_ok());
        assert!(open_beneath(&inside, Path::new("../secret.bin")).is_err());
    }
}

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

/// Kernel file systems whose files are regular by their mode but have no content of their
/// own size: `/proc/self/status` says 0 bytes (sysfs files 4096) and reading it gives what the
/// kernel writes at that moment; such files cannot be memory-mapped either.
#[cfg(target_os = "linux")]
const PSEUDO_FILE_SYSTEMS: &[(u32, &str)] = &[
    (0x0000_9fa0, "procfs"),
    (0x6265_6572, "sysfs"),
    (0x6462_6720, "debugfs"),
    (0x7472_6163, "tracefs"),
    (0x7363_6673, "securityfs"),
    (0x0027_e0eb, "cgroup"),
    (0x6367_7270, "cgroup2"),
    (0xcafe_4a11, "bpf"),
    (0x6165_676c, "pstore"),
    (0xde5e_81e4, "efivarfs"),
    (0x4249_4e4d, "binfmt_misc"),
    (0x6265_6570, "configfs"),
    (0xf97c_ff8c, "selinuxfs"),
    (0x6573_5543, "fusectl"),
];

/// The pseudo file system `file` lives on, if any (see [`PSEUDO_FILE_SYSTEMS`]).
#[cfg(target_os = "linux")]
fn pseudo_file_system(file: &File) -> Option<&'static str> {
    use std::os::fd::AsRawFd;
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and a statfs buffer of the right size.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } != 0 {
        return None;
    }
    let magic = st.f_type as u32;
    PSEUDO_FILE_SYSTEMS
        .iter()
        .find(|(m, _)| *m == magic)
        .map(|(_, name)| *name)
}

#[cfg(not(target_os = "linux"))]
fn pseudo_file_system(_: &File) -> Option<&'static str> {
    None
}

/// Refuses a regular file of a pseudo file system, saying what it is.
fn check_has_content(file: &File, meta: &Metadata) -> std::io::Result<()> {
    match pseudo_file_system(file) {
        Some(fs) => Err(IoError::new(
            ErrorKind::InvalidInput,
            format!(
                "it is a pseudo file of the kernel ({fs}), not a regular file: it has no content \
                 of its own size ({} bytes), reading it gives what the kernel makes at that \
                 moment; copy the content into a regular file first",
                meta.len()
            ),
        )),
        None => Ok(()),
    }
}

/// A failed memory map, in words: ENODEV ("No such device") means the file's file system
/// cannot map files (a pseudo or special one that [`PSEUDO_FILE_SYSTEMS`] does not list).
pub fn map_problem(e: IoError) -> IoError {
    #[cfg(unix)]
    if e.raw_os_error() == Some(libc::ENODEV) {
        return IoError::new(
            ErrorKind::InvalidInput,
            "it is on a file system that cannot memory-map files (a pseudo or special file \
             system, so maybe no content of its own size); copy it into a regular file first",
        );
    }
    e
}

/// Opens `path` for reading if it is a regular file. A FIFO or device is never opened in
/// blocking mode: the path is checked first, the open is non-blocking, and the opened
/// descriptor is checked again (the path may have been swapped in between). Files of the
/// kernel's pseudo file systems (`/proc`, `/sys`, ...) are refused too.
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
    check_has_content(&file, &meta)?;
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
/// the kernel does but never ending outside `dir`: `..` and absolute paths are refused as
/// written, and symlinks may lead anywhere on the way as long as the file they end at lies
/// inside `dir` — or, for a folder inside a Hugging Face hub cache snapshot
/// (`models--org--name/snapshots/<rev>/`), in that same repository's `blobs/` (the hub's own
/// layout: `model.onnx_data → ../../blobs/<sha256>`). The file must be regular. The check is
/// made on the opened descriptor, and copies read that descriptor, so a later swap of the path
/// changes nothing.
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
    check_has_content(&file, &meta)?;
    Ok(file)
}

fn escapes() -> IoError {
    IoError::new(
        ErrorKind::PermissionDenied,
        "it resolves (through a symlink) outside the folder",
    )
}

/// Whether a file whose real path is `target` may be read for a model whose folder's real path
/// is `folder`: inside the folder, or the hub cache's blob of the same repository.
fn target_allowed(folder: &Path, target: &Path) -> bool {
    (target.starts_with(folder) && target != folder) || hub_blob_of(folder, target)
}

/// `target` is `<repo>/blobs/<hash>` and `folder` lies in `<repo>/snapshots/<rev>/`, where
/// `<repo>` is a hub cache folder `models--<org>--<name>` and `<hash>` the blob's git (40) or
/// sha256 (64) lowercase hex digest: how `huggingface_hub` stores every downloaded file.
fn hub_blob_of(folder: &Path, target: &Path) -> bool {
    let name = target.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let is_digest = matches!(name.len(), 40 | 64)
        && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    let Some(blobs) = target
        .parent()
        .filter(|b| b.file_name() == Some("blobs".as_ref()))
    else {
        return false;
    };
    let Some(repo) = blobs.parent() else {
        return false;
    };
    let is_repo = repo
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("models--") && n.len() > "models--".len());
    let in_snapshot = folder
        .strip_prefix(repo.join("snapshots"))
        .is_ok_and(|rest| rest.components().next().is_some());
    is_digest && is_repo && in_snapshot
}

#[cfg(target_os = "linux")]
fn openat2(base: &File, rel: &std::ffi::CStr, flags: i32, resolve: u64) -> std::io::Result<File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = flags as u64;
    how.resolve = resolve;
    // SAFETY: valid fd, NUL-terminated path, `how` sized as passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            base.as_raw_fd(),
            rel.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        return Err(IoError::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { File::from_raw_fd(fd as i32) })
}

#[cfg(target_os = "linux")]
fn open_beneath_os(dir: &Path, rel: &Path) -> std::io::Result<File> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;

    let base = File::open(dir)?;
    let c_rel = CString::new(rel.as_os_str().as_bytes())
        .map_err(|_| IoError::new(ErrorKind::InvalidInput, "it contains a NUL byte"))?;
    let read = libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;
    let beneath = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS;
    match openat2(&base, &c_rel, read, beneath) {
        Ok(file) => Ok(file),
        // a symlink on the way leaves the folder (or is absolute): see where it ends
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => open_resolved(&base, &c_rel),
        // kernels before 5.6, or seccomp filters: open, then check where the file really is
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS) | Some(libc::EPERM)) => {
            open_then_check(dir, rel)
        }
        Err(e) => Err(e),
    }
}

/// `rel` resolved without `RESOLVE_BENEATH`: the path is resolved into an `O_PATH` descriptor
/// (which opens nothing: no device or FIFO is touched), its real path is read from the kernel
/// (`/proc/self/fd`) and checked with [`target_allowed`], and that same inode is then reopened
/// for reading through the descriptor, never through the path again.
#[cfg(target_os = "linux")]
fn open_resolved(base: &File, rel: &std::ffi::CStr) -> std::io::Result<File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;

    let fd_path = |f: &File| std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd()));
    let located = openat2(
        base,
        rel,
        libc::O_PATH | libc::O_CLOEXEC,
        libc::RESOLVE_NO_MAGICLINKS,
    )?;
    let meta = located.metadata()?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    let (Ok(folder), Ok(target)) = (fd_path(base), fd_path(&located)) else {
        return Err(escapes()); // no /proc: where the file is cannot be known
    };
    if !target_allowed(&folder, &target) {
        return Err(escapes());
    }
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(format!("/proc/self/fd/{}", located.as_raw_fd()))?;
    let opened = file.metadata()?;
    if opened.dev() != meta.dev() || opened.ino() != meta.ino() {
        return Err(escapes());
    }
    Ok(file)
}

#[cfg(not(target_os = "linux"))]
fn open_beneath_os(dir: &Path, rel: &Path) -> std::io::Result<File> {
    open_then_check(dir, rel)
}

/// Opens `dir/rel`, then checks that the file opened is the one the resolved path names (same
/// device and inode) and that it may be read ([`target_allowed`]), so a swap between the two
/// steps is caught.
fn open_then_check(dir: &Path, rel: &Path) -> std::io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    options.custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
    let file = options.open(dir.join(rel))?;
    let base = dir.canonicalize()?;
    let real = dir.join(rel).canonicalize()?;
    if !target_allowed(&base, &real) {
        return Err(escapes());
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let (opened, named) = (file.metadata()?, std::fs::metadata(&real)?);
        if opened.dev() != named.dev() || opened.ino() != named.ino() {
            return Err(escapes());
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

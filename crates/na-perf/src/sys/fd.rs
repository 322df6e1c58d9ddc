//! Taking ownership of descriptors inherited from the parent process.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Takes ownership of descriptor `fd`, inherited across `exec`, after
/// checking that it is open ([fcntl(2)] `F_GETFD`) and that
/// `/proc/self/fd/<fd>` names an object whose link target starts with
/// `kind` (e.g. `"anon_inode:[eventfd]"`, `"/memfd:"`). Marks it
/// close-on-exec so that it is not passed further.
///
/// Call at most once per descriptor number: the returned [`OwnedFd`] closes
/// it on drop.
///
/// [fcntl(2)]: https://man7.org/linux/man-pages/man2/fcntl.2.html
pub fn take_inherited(fd: RawFd, kind: &str) -> io::Result<OwnedFd> {
    if fd < 3 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("descriptor {fd} is a standard stream, not an inherited {kind}"),
        ));
    }
    // SAFETY: F_GETFD takes no pointer argument; an invalid fd gives EBADF.
    let flags = unsafe { na_core::syscall!(fcntl(fd, libc::F_GETFD))? };
    let target = std::fs::read_link(format!("/proc/self/fd/{fd}"))?;
    if !target.to_string_lossy().starts_with(kind) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("descriptor {fd} is {target:?}, expected {kind}"),
        ));
    }
    // SAFETY: F_SETFD with an int flag word takes no pointer; fd is open.
    unsafe { na_core::syscall!(fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC))? };
    // SAFETY: the descriptor is open (checked above), was inherited from the
    // parent and is owned by nothing else in this process: the caller takes
    // each inherited number once (it comes from our own command line).
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

//! memfds and the file changes that drop their pages from every
//! mapping: [memfd_create(2)], [fallocate(2)], [ftruncate(2)].
//!
//! [memfd_create(2)]: https://man7.org/linux/man-pages/man2/memfd_create.2.html
//! [fallocate(2)]: https://man7.org/linux/man-pages/man2/fallocate.2.html
//! [ftruncate(2)]: https://man7.org/linux/man-pages/man2/ftruncate.2.html

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A memfd of `len` bytes.
pub fn memfd(len: usize) -> io::Result<OwnedFd> {
    // SAFETY: the name is a NUL-terminated literal.
    let fd = unsafe { libc::memfd_create(c"qs-regcache-test".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: new descriptor owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain ftruncate on our descriptor.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// fallocate(2) `PUNCH_HOLE|KEEP_SIZE` of `[offset, offset+len)` in `fd`:
/// the file's pages there are dropped (from every mapping of it).
pub fn punch_hole(fd: &OwnedFd, offset: usize, len: usize) -> io::Result<()> {
    // SAFETY: plain fallocate on our descriptor; mappings of the range lose
    // their pages, which no Rust reference observes.
    let r = unsafe {
        libc::fallocate(
            fd.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// ftruncate(2) of `fd` to `len` bytes (shrinking drops the file's pages
/// beyond `len` from every mapping of it).
pub fn truncate(fd: &OwnedFd, len: usize) -> io::Result<()> {
    // SAFETY: plain ftruncate on our descriptor; the scenario touches no
    // mapping of the dropped range before it grows the file again.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

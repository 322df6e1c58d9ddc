//! A thin owner of an eventfd ([eventfd(2)]), used for the wake-up floor.
//!
//! [eventfd(2)]: https://man7.org/linux/man-pages/man2/eventfd.2.html

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// A non-blocking eventfd counter.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// [eventfd(2)] with `EFD_NONBLOCK`. With `inheritable` the descriptor is
    /// *not* close-on-exec, so that a child started next inherits it.
    ///
    /// [eventfd(2)]: https://man7.org/linux/man-pages/man2/eventfd.2.html
    pub fn new(inheritable: bool) -> io::Result<Self> {
        let flags = libc::EFD_NONBLOCK | if inheritable { 0 } else { libc::EFD_CLOEXEC };
        // SAFETY: eventfd takes no pointers; on success the returned
        // descriptor is new and owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(na_core::syscall!(eventfd(0, flags))?) };
        Ok(EventFd { fd })
    }

    /// Wraps an already owned eventfd descriptor (see
    /// [`super::fd::take_inherited`]).
    pub fn from_owned(fd: OwnedFd) -> Self {
        EventFd { fd }
    }

    /// Adds `value` to the counter ([write(2)] of 8 bytes).
    ///
    /// [write(2)]: https://man7.org/linux/man-pages/man2/write.2.html
    pub fn write(&self, value: u64) -> io::Result<()> {
        let buf = value.to_ne_bytes();
        // SAFETY: `buf` is 8 readable bytes for the duration of the call.
        let n = unsafe { na_core::syscall!(write(self.fd.as_raw_fd(), buf.as_ptr().cast(), 8))? };
        short(n)
    }

    /// Reads and resets the counter; `Ok(None)` if it is zero ([read(2)]).
    ///
    /// [read(2)]: https://man7.org/linux/man-pages/man2/read.2.html
    pub fn read(&self) -> io::Result<Option<u64>> {
        let mut buf = [0u8; 8];
        // SAFETY: `buf` is 8 writable bytes for the duration of the call.
        let res = unsafe { na_core::syscall!(read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), 8)) };
        match res {
            Ok(n) => short(n).map(|()| Some(u64::from_ne_bytes(buf))),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }
}

fn short(n: isize) -> io::Result<()> {
    if n == 8 {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("eventfd moved {n} of 8 bytes"),
        ))
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

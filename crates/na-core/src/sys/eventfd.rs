//! An event counter ([eventfd(2)]) that ends a sleep on an epoll set from
//! any thread: the endpoint's [`Waker`](crate::Waker).
//!
//! [eventfd(2)]: https://man7.org/linux/man-pages/man2/eventfd.2.html

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// A non-blocking, close-on-exec eventfd, readable while its counter is
/// not 0. Only this process holds it (it is never passed to a peer).
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// [eventfd(2)] with a counter of 0 and `EFD_NONBLOCK | EFD_CLOEXEC`.
    ///
    /// [eventfd(2)]: https://man7.org/linux/man-pages/man2/eventfd.2.html
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes no pointers; a successful return is a fresh
        // descriptor owned by nobody else, so OwnedFd may take it.
        #[allow(unsafe_code)]
        let fd = unsafe {
            let fd = crate::syscall!(eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC))?;
            OwnedFd::from_raw_fd(fd)
        };
        Ok(EventFd { fd })
    }

    /// Adds 1 to the counter ([write(2)] of 8 bytes), which makes the
    /// descriptor readable and wakes whoever polls it. Never blocks (the
    /// descriptor is non-blocking): it fails with `EAGAIN` only if the
    /// counter is at its maximum (0xfffffffffffffffe), which
    /// [`drain`](Self::drain) keeps it far from; any failure is returned.
    ///
    /// [write(2)]: https://man7.org/linux/man-pages/man2/write.2.html
    pub fn signal(&self) -> io::Result<()> {
        let one: u64 = 1;
        // SAFETY: a pointer to an 8-byte u64 that lives across the call,
        // and its exact size, as eventfd requires.
        #[allow(unsafe_code)]
        let r = unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        match r {
            8 => Ok(()),
            -1 => Err(io::Error::last_os_error()),
            n => Err(io::Error::other(format!("eventfd write wrote {n} bytes, not 8"))),
        }
    }

    /// Reads the counter back to 0 ([read(2)]), so the descriptor is no
    /// longer readable; true if it was not 0 (a [`signal`](Self::signal)
    /// came since the last drain). An empty counter is no error.
    ///
    /// [read(2)]: https://man7.org/linux/man-pages/man2/read.2.html
    pub fn drain(&self) -> io::Result<bool> {
        let mut n: u64 = 0;
        // SAFETY: reads at most 8 bytes into the 8-byte u64, which lives
        // across the call.
        #[allow(unsafe_code)]
        let r = unsafe { libc::read(self.fd.as_raw_fd(), (&mut n as *mut u64).cast(), 8) };
        match r {
            8 => Ok(n > 0),
            -1 => {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::WouldBlock {
                    Ok(false)
                } else {
                    Err(err)
                }
            }
            n => Err(io::Error::other(format!("eventfd read read {n} bytes, not 8"))),
        }
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_add_up_and_one_drain_takes_them_all() {
        let e = EventFd::new().unwrap();
        assert!(!e.drain().unwrap(), "a new counter is 0");
        for _ in 0..3 {
            e.signal().unwrap();
        }
        assert!(e.drain().unwrap(), "signalled");
        assert!(!e.drain().unwrap(), "drained: nothing left");
    }
}

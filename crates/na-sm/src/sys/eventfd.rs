//! Event counters ([eventfd(2)]) used to wake a sleeping peer.
//!
//! [eventfd(2)]: https://man7.org/linux/man-pages/man2/eventfd.2.html

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// An eventfd. Ours are created non-blocking and close-on-exec; one received
/// from a peer is checked with [`EventFd::from_peer`].
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// [eventfd(2)] with `EFD_NONBLOCK | EFD_CLOEXEC`.
    ///
    /// [eventfd(2)]: https://man7.org/linux/man-pages/man2/eventfd.2.html
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes no pointers; a successful return is a fresh
        // descriptor owned by nobody else, so OwnedFd may take it.
        let fd = unsafe {
            let fd = super::syscall!(eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC))?;
            OwnedFd::from_raw_fd(fd)
        };
        Ok(EventFd { fd })
    }

    /// Wraps a descriptor received from a peer after checking that it really
    /// is an eventfd (`/proc/self/fd/N` names `anon_inode:[eventfd]`), so a
    /// peer cannot make us write into a file or a pipe.
    pub fn from_peer(fd: OwnedFd) -> io::Result<Self> {
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
        if link.as_os_str() != "anon_inode:[eventfd]" {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("descriptor is {} (expected an eventfd)", link.display()),
            ));
        }
        Ok(EventFd { fd })
    }

    /// Adds 1 to the counter: wakes whoever polls the fd.
    ///
    /// The descriptor's file status flags are shared with the peer that holds
    /// the other end, so first check that it is still non-blocking (a write
    /// that would overflow the counter then fails with `EAGAIN` instead of
    /// blocking us). `EAGAIN` means the counter is huge: the reader is
    /// certainly awake-able already, so it counts as success.
    ///
    /// The check and the write are two calls: a hostile peer that brought
    /// its counter to the brink and clears the flag between them blocks
    /// this write. An eventfd cannot be reopened as our own description
    /// (as the pipe wake-up is, `QS_SM_WAKE=pipe`); a peer of the same uid
    /// could stop or ptrace us anyway.
    pub fn signal(&self) -> io::Result<()> {
        let raw = self.fd.as_raw_fd();
        // SAFETY: F_GETFL takes no pointer argument.
        let flags = unsafe { super::syscall!(fcntl(raw, libc::F_GETFL))? };
        if flags & libc::O_NONBLOCK == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "peer cleared O_NONBLOCK on the wake-up eventfd",
            ));
        }
        let one: u64 = 1;
        // SAFETY: we pass a pointer to an 8-byte u64 that lives across the
        // call and its exact size, as eventfd requires.
        let r = unsafe { libc::write(raw, (&one as *const u64).cast(), 8) };
        if r == 8 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() == io::ErrorKind::WouldBlock {
            return Ok(());
        }
        Err(err)
    }

    /// Resets the counter to zero; returns whether it was non-zero.
    pub fn drain(&self) -> io::Result<bool> {
        let mut v: u64 = 0;
        // SAFETY: `v` is a writable 8-byte buffer for the duration of the call.
        let r = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        if r == 8 {
            return Ok(true);
        }
        let err = io::Error::last_os_error();
        if err.kind() == io::ErrorKind::WouldBlock {
            return Ok(false);
        }
        Err(err)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_and_drain() {
        let e = EventFd::new().unwrap();
        assert!(!e.drain().unwrap());
        e.signal().unwrap();
        e.signal().unwrap();
        assert!(e.drain().unwrap());
        assert!(!e.drain().unwrap());
        let dup = e.fd.try_clone().unwrap();
        assert!(EventFd::from_peer(dup).is_ok());
        let file = OwnedFd::from(std::fs::File::open("/proc/self/stat").unwrap());
        assert!(EventFd::from_peer(file).is_err());
    }
}

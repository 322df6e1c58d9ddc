//! A thin owner of an epoll instance ([epoll(7)]).
//!
//! [epoll(7)]: https://man7.org/linux/man-pages/man7/epoll.7.html

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// The most events one [`Epoll::wait`] returns.
pub const WAIT_BATCH: usize = 32;

/// An epoll set. Level-triggered, close-on-exec.
#[derive(Debug)]
pub struct Epoll {
    fd: OwnedFd,
}

impl Epoll {
    /// [epoll_create1(2)](https://man7.org/linux/man-pages/man2/epoll_create1.2.html)
    /// with `EPOLL_CLOEXEC`.
    pub fn new() -> io::Result<Self> {
        // SAFETY: epoll_create1 takes no pointers; on success it returns a new
        // descriptor that nothing else owns, so OwnedFd may take it.
        #[allow(unsafe_code)]
        let fd = unsafe {
            let fd = crate::syscall!(epoll_create1(libc::EPOLL_CLOEXEC))?;
            OwnedFd::from_raw_fd(fd)
        };
        Ok(Epoll { fd })
    }

    /// Adds `fd` for readability, tagging its events with `token`.
    /// [epoll_ctl(2)](https://man7.org/linux/man-pages/man2/epoll_ctl.2.html)
    ///
    /// The set holds the open file, not the number: borrowing the
    /// descriptor makes the caller name one it owns, open now.
    pub fn add(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd.as_raw_fd(), token, libc::EPOLLIN as u32)
    }

    /// Adds `fd` for readability, edge-triggered (`EPOLLET`): one event per
    /// change, so the caller need not drain the fd. For an eventfd every
    /// write is such a change, which lets a wake-up cost no `read(2)`.
    pub fn add_edge_triggered(&self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        self.ctl(
            libc::EPOLL_CTL_ADD,
            fd.as_raw_fd(),
            token,
            (libc::EPOLLIN | libc::EPOLLET) as u32,
        )
    }

    /// Removes `fd` from the set (before it is closed: a closed
    /// descriptor leaves the set by itself only once no duplicate of it
    /// stays open).
    pub fn delete(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_DEL, fd.as_raw_fd(), 0, 0)
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, token: u64, events: u32) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: `ev` is a valid epoll_event for the duration of the call;
        // the kernel validates `fd` and reports EBADF for a bad one.
        #[allow(unsafe_code)]
        unsafe {
            crate::syscall!(epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut ev))?;
        }
        Ok(())
    }

    /// Waits up to `timeout` (`None`: forever) for events and appends their
    /// tokens to `tokens`. Returns the number of events; 0 on timeout or
    /// when interrupted by a signal. At most [`WAIT_BATCH`] events per
    /// call: a full batch means more may be ready.
    /// [epoll_wait(2)](https://man7.org/linux/man-pages/man2/epoll_wait.2.html)
    pub fn wait(&self, tokens: &mut Vec<u64>, timeout: Option<Duration>) -> io::Result<usize> {
        const MAX: usize = WAIT_BATCH;
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; MAX];
        let ms = match timeout {
            None => -1,
            // Round up so that a sub-millisecond wait still sleeps.
            Some(t) => t.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as i32,
        };
        // SAFETY: `evs` is a writable array of MAX epoll_event structs and we
        // pass MAX as its length.
        #[allow(unsafe_code)]
        let n = unsafe { libc::epoll_wait(self.fd.as_raw_fd(), evs.as_mut_ptr(), MAX as i32, ms) };
        if n < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                return Ok(0);
            }
            return Err(err);
        }
        tokens.extend(evs[..n as usize].iter().map(|e| e.u64));
        Ok(n as usize)
    }
}

impl AsFd for Epoll {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Epoll {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

//! What a descriptor reports right now: [poll(2)] with a zero timeout.
//!
//! [poll(2)]: https://man7.org/linux/man-pages/man2/poll.2.html

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// [poll(2)] of `fd` for `events`, without waiting: the `revents` the
/// kernel reports now (`POLLHUP` and `POLLERR` come whether asked or not;
/// zero: nothing). Retried on `EINTR`.
///
/// [poll(2)]: https://man7.org/linux/man-pages/man2/poll.2.html
pub fn revents_now(fd: BorrowedFd<'_>, events: libc::c_short) -> io::Result<libc::c_short> {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events,
        revents: 0,
    };
    loop {
        // SAFETY: `p` is one live, writable pollfd and the count says one;
        // a zero timeout never blocks.
        match unsafe { super::syscall!(poll(&mut p, 1, 0)) } {
            Ok(0) => return Ok(0),
            Ok(_) => return Ok(p.revents),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn reports_readable_and_hung_up_now() {
        let (a, mut b) = UnixStream::pair().unwrap();
        assert_eq!(revents_now(a.as_fd(), libc::POLLIN).unwrap(), 0, "nothing yet");
        b.write_all(b"x").unwrap();
        assert_eq!(revents_now(a.as_fd(), libc::POLLIN).unwrap(), libc::POLLIN);
        drop(b);
        let r = revents_now(a.as_fd(), 0).unwrap();
        assert_ne!(r & libc::POLLHUP, 0, "the other end closed: {r:#x}");
    }
}

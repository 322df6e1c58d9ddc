//! A one-shot timer as a descriptor ([timerfd_create(2)]), so deadlines
//! (handshakes, a paused listener) are kept while the plugin sleeps on its
//! epoll set.
//!
//! [timerfd_create(2)]: https://man7.org/linux/man-pages/man2/timerfd_create.2.html

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// A non-blocking `CLOCK_MONOTONIC` timerfd.
#[derive(Debug)]
pub struct Timer {
    fd: OwnedFd,
    /// What it is armed for (`None`: disarmed), to skip redundant settimes.
    armed: Option<Instant>,
}

impl Timer {
    /// [timerfd_create(2)] with `TFD_NONBLOCK | TFD_CLOEXEC`.
    ///
    /// [timerfd_create(2)]: https://man7.org/linux/man-pages/man2/timerfd_create.2.html
    pub fn new() -> io::Result<Self> {
        // SAFETY: integer arguments only; a successful return is a fresh
        // descriptor owned by nobody else, so OwnedFd may take it.
        let fd = unsafe {
            let fd = crate::syscall!(timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC
            ))?;
            OwnedFd::from_raw_fd(fd)
        };
        Ok(Timer { fd, armed: None })
    }

    /// Makes the descriptor readable at `at` (`None` disarms it), with
    /// [timerfd_settime(2)]. A time already past fires at once.
    ///
    /// [timerfd_settime(2)]: https://man7.org/linux/man-pages/man2/timerfd_settime.2.html
    pub fn set(&mut self, at: Option<Instant>) -> io::Result<()> {
        if at == self.armed {
            return Ok(());
        }
        // A zero it_value disarms, so a due time is at least 1 ns away.
        let value = at.map_or(Duration::ZERO, |t| {
            t.saturating_duration_since(Instant::now())
                .max(Duration::from_nanos(1))
        });
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: value.as_secs().min(i64::MAX as u64) as libc::time_t,
                tv_nsec: libc::c_long::from(value.subsec_nanos() as i32),
            },
        };
        // SAFETY: `spec` is a valid itimerspec for the call; the old-value
        // pointer may be null.
        unsafe {
            crate::syscall!(timerfd_settime(
                self.fd.as_raw_fd(),
                0,
                &spec,
                std::ptr::null_mut()
            ))?;
        }
        self.armed = at;
        Ok(())
    }

    /// What it is armed for (`None`: disarmed or already fired).
    pub fn armed(&self) -> Option<Instant> {
        self.armed
    }

    /// Reads the expiry count ([read(2)]), so a level-triggered epoll stops
    /// reporting it; not having expired is no error.
    ///
    /// [read(2)]: https://man7.org/linux/man-pages/man2/read.2.html
    pub fn clear(&mut self) {
        let mut n = [0u8; 8];
        // SAFETY: reads at most 8 bytes into the 8-byte buffer.
        let r = unsafe { libc::read(self.fd.as_raw_fd(), n.as_mut_ptr().cast(), n.len()) };
        if r == 8 {
            self.armed = None;
        }
    }
}

impl AsFd for Timer {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(t: &Timer) -> bool {
        let mut p = libc::pollfd {
            fd: t.as_fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY (test): one valid pollfd.
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    }

    #[test]
    fn fires_at_its_time_and_clears() {
        let mut t = Timer::new().unwrap();
        assert!(!readable(&t));
        t.set(Some(Instant::now() + Duration::from_millis(20))).unwrap();
        assert!(!readable(&t), "not yet");
        std::thread::sleep(Duration::from_millis(40));
        assert!(readable(&t), "fired");
        t.clear();
        assert!(!readable(&t), "cleared");
        // A time already past fires at once; disarming stops a pending one.
        t.set(Some(Instant::now() - Duration::from_millis(1))).unwrap();
        assert!(readable(&t));
        t.clear();
        t.set(Some(Instant::now() + Duration::from_millis(10))).unwrap();
        t.set(None).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(!readable(&t), "disarmed");
    }
}

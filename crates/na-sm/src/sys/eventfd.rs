//! Event counters ([eventfd(2)]) used to wake a sleeping peer: na-sm's
//! rules (a counter made at 1, a wake-up that is a write of 0, a check of
//! one a peer passed) over na-core's wrapper of the system calls,
//! [`na_core::sys::eventfd::EventFd`].
//!
//! [eventfd(2)]: https://man7.org/linux/man-pages/man2/eventfd.2.html

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use na_core::sys::eventfd::EventFd as RawEventFd;

/// An eventfd. Ours are created non-blocking and close-on-exec; one received
/// from a peer is checked with [`EventFd::from_peer`].
#[derive(Debug)]
pub struct EventFd {
    fd: RawEventFd,
}

impl EventFd {
    /// [eventfd(2)] with `EFD_NONBLOCK | EFD_CLOEXEC` and a counter of 1
    /// from the start: a wake-up is a write of 0 (see [`signal`](Self::signal)),
    /// which makes the descriptor report itself readable only while the
    /// counter is not 0. Ours are never read (polled edge-triggered), so
    /// the counter stays above 0 unless whoever holds the other copy, the
    /// one peer that wakes us on it, reads it: it then loses its own
    /// wake-ups of us, nobody else's.
    ///
    /// [eventfd(2)]: https://man7.org/linux/man-pages/man2/eventfd.2.html
    pub fn new() -> io::Result<Self> {
        let fd = RawEventFd::with_counter(1, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)?;
        Ok(EventFd { fd })
    }

    /// Wraps a descriptor received from a peer after checking that it really
    /// is an eventfd (`/proc/self/fd/N` names `anon_inode:[eventfd]`), so a
    /// peer cannot make us write into a file or a pipe.
    pub fn from_peer(fd: OwnedFd) -> io::Result<Self> {
        Ok(EventFd {
            fd: RawEventFd::from_checked(fd)?,
        })
    }

    /// Wakes whoever polls the fd: writes **0** to the counter.
    ///
    /// The descriptor is the peer's (its open file description, shared
    /// with it: the peer may clear `O_NONBLOCK` on it at any time, and
    /// bring its counter to the maximum, 0xfffffffffffffffe). A write of
    /// `n` blocks (or fails with `EAGAIN`) only while the counter plus `n`
    /// would pass that maximum; a write of 0 never does, whatever the
    /// flags and the counter, so no peer can block this call (a write of
    /// 1, checked for `O_NONBLOCK` first, could be blocked by a peer that
    /// cleared the flag between the check and the write). The kernel
    /// wakes the fd's pollers on every successful write, 0 included, and
    /// an epoll set then reports it readable as the counter is not 0:
    /// the waiter creates it at 1 and never reads it ([`EventFd::new`]).
    ///
    /// (`EAGAIN` cannot come of a write of 0; were it to, the counter is
    /// at its maximum and the fd readable already: success.)
    #[inline]
    pub fn signal(&self) -> io::Result<()> {
        match self.fd.write(0) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
            Err(e) => Err(e),
        }
    }

    #[cfg(any(test, feature = "test-hooks"))]
    /// Resets the counter to zero; returns whether it was non-zero.
    pub fn drain(&self) -> io::Result<bool> {
        self.fd.read().map(|counter| counter.is_some())
    }
}

/// What a hostile peer may do to a wake-up eventfd it holds a copy of
/// (its open file description is shared): for tests, through
/// [`EventFd::tamper`] and `SmPlugin::debug_tamper_peer_wake` /
/// `debug_tamper_own_wake`. Only with the `test-hooks` feature (and in
/// the crate's unit tests).
#[cfg(any(test, feature = "test-hooks"))]
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WakeTamper {
    /// Brings the counter to its maximum, 0xfffffffffffffffe: a write of
    /// 1 or more then fails with `EAGAIN` (or blocks, without
    /// `O_NONBLOCK`) until the counter is read.
    Saturate,
    /// Reads the counter down to 0: the fd stops reporting readable.
    Empty,
    /// Clears `O_NONBLOCK` on the shared description.
    Blocking,
    /// Adds 1 (ignoring `EAGAIN`): one write of a storm.
    Pulse,
}

#[cfg(any(test, feature = "test-hooks"))]
impl EventFd {
    /// Does `t` to this eventfd (tests only: what a peer holding it may
    /// do). [`WakeTamper::Saturate`] reads the counter first: call it
    /// before [`WakeTamper::Blocking`], or the read may block.
    #[doc(hidden)]
    pub fn tamper(&self, t: WakeTamper) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let raw = self.fd.as_raw_fd();
        let write = |v: u64| -> io::Result<()> {
            match self.fd.write(v) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && v == 1 => Ok(()),
                r => r,
            }
        };
        match t {
            WakeTamper::Saturate => {
                self.drain()?;
                write(u64::MAX - 1)
            }
            WakeTamper::Empty => self.drain().map(|_| ()),
            WakeTamper::Blocking => {
                // SAFETY: F_GETFL / F_SETFL take an int and no pointer.
                unsafe {
                    let flags = super::syscall!(fcntl(raw, libc::F_GETFL))?;
                    super::syscall!(fcntl(raw, libc::F_SETFL, flags & !libc::O_NONBLOCK))?;
                }
                Ok(())
            }
            WakeTamper::Pulse => write(1),
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

    impl EventFd {
        /// A second descriptor of the same eventfd (the copy a peer holds).
        fn dup(&self) -> OwnedFd {
            self.fd.as_fd().try_clone_to_owned().unwrap()
        }
    }

    /// What a peer passes is checked: an eventfd is taken (and is the
    /// peer's counter), a pipe or a file is refused with the text the
    /// handshake reports.
    #[test]
    fn from_peer_takes_only_an_eventfd() {
        let theirs = EventFd::new().unwrap();
        let ours = EventFd::from_peer(theirs.dup()).unwrap();
        assert!(theirs.drain().unwrap(), "created at 1");
        ours.tamper(WakeTamper::Pulse).unwrap();
        assert!(theirs.drain().unwrap(), "one counter behind both copies");

        let (read_end, write_end) = std::io::pipe().unwrap();
        for fd in [OwnedFd::from(read_end), OwnedFd::from(write_end)] {
            let err = EventFd::from_peer(fd).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
            assert!(err.to_string().starts_with("descriptor is pipe:["), "{err}");
            assert!(err.to_string().ends_with("(expected an eventfd)"), "{err}");
        }
    }

    #[test]
    fn signal_and_drain() {
        let e = EventFd::new().unwrap();
        // Created at 1 (readable), and a signal adds nothing.
        assert!(e.drain().unwrap());
        assert!(!e.drain().unwrap());
        e.signal().unwrap();
        e.signal().unwrap();
        assert!(!e.drain().unwrap());
        let dup = e.dup();
        assert!(EventFd::from_peer(dup).is_ok());
        let file = OwnedFd::from(std::fs::File::open("/proc/self/stat").unwrap());
        assert!(EventFd::from_peer(file).is_err());
    }

    /// A peer holding our copy brings the counter to its maximum and
    /// clears `O_NONBLOCK` on the description it shares with us: a
    /// wake-up write of 1 would block for good (the flag checked first
    /// or not: the peer may clear it between the check and the write).
    /// A signal still returns, at once, and still wakes the peer's
    /// edge-triggered epoll set, every time.
    #[test]
    fn a_peer_saturating_and_blocking_its_eventfd_cannot_block_a_signal() {
        use na_core::sys::epoll::Epoll;
        let theirs = EventFd::new().unwrap();
        let epoll = Epoll::new().unwrap();
        epoll.add_edge_triggered(theirs.as_fd(), 7).unwrap();
        let mut tokens = Vec::new();
        // Created at 1: the first harvest reports it once.
        assert_eq!(
            epoll.wait(&mut tokens, Some(std::time::Duration::ZERO)).unwrap(),
            1
        );
        let ours = EventFd::from_peer(theirs.dup()).unwrap();
        theirs.tamper(WakeTamper::Saturate).unwrap();
        theirs.tamper(WakeTamper::Blocking).unwrap();
        assert_eq!(
            epoll.wait(&mut tokens, Some(std::time::Duration::ZERO)).unwrap(),
            1
        );
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let r = (0..3)
                .map(|_| ours.signal().map_err(|e| e.to_string()))
                .collect::<Vec<_>>();
            let _ = tx.send(r);
        });
        let r = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("a signal blocked on a saturated, blocking eventfd");
        assert_eq!(r, vec![Ok(()), Ok(()), Ok(())]);
        // Each write woke the set (coalesced into one report: edge-triggered).
        assert_eq!(
            epoll.wait(&mut tokens, Some(std::time::Duration::ZERO)).unwrap(),
            1
        );
        assert_eq!(
            epoll.wait(&mut tokens, Some(std::time::Duration::ZERO)).unwrap(),
            0
        );
    }

    /// A signal (a write of 0) wakes an edge-triggered epoll set once per
    /// write while the counter is above 0, as the waiter keeps it.
    #[test]
    fn every_signal_is_an_edge() {
        use na_core::sys::epoll::Epoll;
        let theirs = EventFd::new().unwrap();
        let ours = EventFd::from_peer(theirs.dup()).unwrap();
        let epoll = Epoll::new().unwrap();
        epoll.add_edge_triggered(theirs.as_fd(), 7).unwrap();
        let mut tokens = Vec::new();
        let zero = Some(std::time::Duration::ZERO);
        assert_eq!(epoll.wait(&mut tokens, zero).unwrap(), 1);
        for _ in 0..3 {
            assert_eq!(epoll.wait(&mut tokens, zero).unwrap(), 0, "no write, no edge");
            ours.signal().unwrap();
            assert_eq!(epoll.wait(&mut tokens, zero).unwrap(), 1, "a signal made no edge");
        }
    }
}

//! Wake-up descriptors: an eventfd, or a pipe where eventfd is missing
//! (or where the user asks for one, `QS_SM_WAKE=pipe`).
//!
//! Each side of a connection creates the descriptor it is woken on
//! ([`OwnWake`]), polls it, and hands the peer the end to write
//! ([`OwnWake::fd_for_peer`]). The peer wraps what it received in a
//! [`PeerWake`] after checking what it is. The two sides need not use the
//! same kind.
//!
//! Neither write can be made to block by the peer: an eventfd wake-up is
//! a write of 0, which never blocks ([`EventFd::signal`]), and the write
//! end of a peer's pipe is reopened as our own open file description
//! ([`PeerWake::from_peer`]), whose `O_NONBLOCK` the peer cannot clear.
//! Writing to a pipe whose
//! reader is gone raises `SIGPIPE`; the write is made with `SIGPIPE`
//! blocked in the calling thread and a signal it raised is consumed, so a
//! peer's death is an `EPIPE` error, never a killed process (the embedding
//! program may not ignore `SIGPIPE`, as Rust binaries do).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;

use super::eventfd::EventFd;
#[cfg(any(test, feature = "test-hooks"))]
use super::eventfd::WakeTamper;

/// Which primitive wakes a sleeping process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WakeKind {
    /// [eventfd(2)]: one descriptor, an 8-byte counter.
    ///
    /// [eventfd(2)]: https://man7.org/linux/man-pages/man2/eventfd.2.html
    EventFd,
    /// [pipe(2)]: the peer writes one byte per wake-up, we read them.
    ///
    /// [pipe(2)]: https://man7.org/linux/man-pages/man2/pipe.2.html
    Pipe,
}

impl WakeKind {
    /// Parses `eventfd` or `pipe`.
    pub fn parse(s: &str) -> Option<WakeKind> {
        match s.trim().to_ascii_lowercase().as_str() {
            "eventfd" => Some(WakeKind::EventFd),
            "pipe" => Some(WakeKind::Pipe),
            _ => None,
        }
    }

    /// The name [`WakeKind::parse`] accepts.
    pub fn name(self) -> &'static str {
        match self {
            WakeKind::EventFd => "eventfd",
            WakeKind::Pipe => "pipe",
        }
    }
}

/// The descriptor we are woken on.
#[derive(Debug)]
pub enum OwnWake {
    /// Polled, and written by the peer through its copy.
    EventFd(EventFd),
    /// We poll and drain `read`; the peer writes `write`, which we keep so
    /// the read end never turns into a permanent end-of-file.
    Pipe {
        /// Our end.
        read: OwnedFd,
        /// The end the peer gets.
        write: OwnedFd,
    },
}

impl OwnWake {
    /// Creates one of `kind`; an eventfd falls back to a pipe when the
    /// kernel has no eventfd (`ENOSYS`).
    pub fn new(kind: WakeKind) -> io::Result<OwnWake> {
        match kind {
            WakeKind::EventFd => match EventFd::new() {
                Ok(e) => Ok(OwnWake::EventFd(e)),
                Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                    tracing::warn!("eventfd unavailable: sm wake-ups use pipes");
                    Self::new(WakeKind::Pipe)
                }
                Err(e) => Err(e),
            },
            WakeKind::Pipe => {
                let (read, write) = pipe()?;
                Ok(OwnWake::Pipe { read, write })
            }
        }
    }

    /// The descriptor to put in the poll set.
    pub fn poll_fd(&self) -> BorrowedFd<'_> {
        match self {
            OwnWake::EventFd(e) => e.as_fd(),
            OwnWake::Pipe { read, .. } => read.as_fd(),
        }
    }

    /// Whether it is readable from the start, before any peer wrote (an
    /// eventfd, made with a counter of 1): the epoll set reports it once
    /// when it is added.
    pub fn starts_ready(&self) -> bool {
        matches!(self, OwnWake::EventFd(_))
    }

    /// The descriptor to send to the peer.
    pub fn fd_for_peer(&self) -> BorrowedFd<'_> {
        match self {
            OwnWake::EventFd(e) => e.as_fd(),
            OwnWake::Pipe { write, .. } => write.as_fd(),
        }
    }

    /// Empties a pipe after a wake-up (an eventfd is left alone: it is
    /// polled edge-triggered and its counter cannot fill up in practice).
    /// Returns whether anything was read. Reads at most
    /// [`PIPE_DRAIN_MAX`] bytes: a peer that writes as fast as we read
    /// cannot keep us here (what it leaves only fills its own pipe).
    pub fn drain(&self) -> io::Result<bool> {
        let OwnWake::Pipe { read, .. } = self else {
            return Ok(false);
        };
        let mut any = false;
        let mut buf = [0u8; 4096];
        for _ in 0..PIPE_DRAIN_MAX / buf.len() {
            // SAFETY: `buf` is writable for its full length during the call.
            let r = unsafe { libc::read(read.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            match r {
                n if n > 0 => {
                    any = true;
                    if (n as usize) < buf.len() {
                        return Ok(true);
                    }
                }
                0 => return Ok(any),
                _ => {
                    let e = io::Error::last_os_error();
                    match e.kind() {
                        io::ErrorKind::WouldBlock => return Ok(any),
                        io::ErrorKind::Interrupted => continue,
                        _ => return Err(e),
                    }
                }
            }
        }
        Ok(any)
    }
}

#[cfg(any(test, feature = "test-hooks"))]
impl OwnWake {
    /// Tests only: does `t` to our eventfd, as the peer holding its other
    /// copy may (an error for a pipe).
    #[doc(hidden)]
    pub fn tamper(&self, t: WakeTamper) -> io::Result<()> {
        match self {
            OwnWake::EventFd(e) => e.tamper(t),
            OwnWake::Pipe { .. } => Err(not_an_eventfd()),
        }
    }
}

#[cfg(any(test, feature = "test-hooks"))]
impl PeerWake {
    /// Tests only: does `t` to the peer's eventfd, as we hold a copy of
    /// it (an error for a pipe).
    #[doc(hidden)]
    pub fn tamper(&self, t: WakeTamper) -> io::Result<()> {
        match self {
            PeerWake::EventFd(e) => e.tamper(t),
            PeerWake::Pipe(_) => Err(not_an_eventfd()),
        }
    }
}

#[cfg(any(test, feature = "test-hooks"))]
fn not_an_eventfd() -> io::Error {
    io::Error::other("wake-up tampering needs eventfd wake-ups (SmConfig::wake)")
}

/// Most bytes one [`OwnWake::drain`] reads: a default pipe's capacity.
pub const PIPE_DRAIN_MAX: usize = 64 * 1024;

/// The descriptor we write to wake the peer.
#[derive(Debug)]
pub enum PeerWake {
    /// The peer's eventfd.
    EventFd(EventFd),
    /// The write end of the peer's pipe.
    Pipe(OwnedFd),
}

impl PeerWake {
    /// Wraps a descriptor received from a peer after checking what it is
    /// (`/proc/self/fd/N`): an eventfd, or the write-only end of a pipe. A
    /// peer cannot make us write into a file, a socket or a pipe's read end.
    pub fn from_peer(fd: OwnedFd) -> io::Result<PeerWake> {
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
        let name = link.to_string_lossy();
        if name == na_core::sys::eventfd::PROC_LINK {
            return EventFd::from_peer(fd).map(PeerWake::EventFd);
        }
        if name.starts_with("pipe:[") {
            let flags = getfl(fd.as_fd())?;
            if flags & libc::O_ACCMODE != libc::O_WRONLY {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "descriptor is a pipe but not its write-only end",
                ));
            }
            // Our own open file description of the pipe (opening it through
            // /proc makes a new one): on the one the peer passed, which it
            // shares, it could clear O_NONBLOCK between a check and our
            // write and so block us in `signal`; on ours it cannot.
            let own = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                .map_err(|e| match e.raw_os_error() {
                    Some(libc::ENXIO) => io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        "the peer closed its wake-up pipe's read end",
                    ),
                    _ => e,
                })?;
            return Ok(PeerWake::Pipe(OwnedFd::from(own)));
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("descriptor is {name} (expected an eventfd or a pipe's write end)"),
        ))
    }

    #[cfg(any(test, feature = "test-hooks"))]
    /// What this is.
    pub fn kind(&self) -> WakeKind {
        match self {
            PeerWake::EventFd(_) => WakeKind::EventFd,
            PeerWake::Pipe(_) => WakeKind::Pipe,
        }
    }

    /// Wakes the peer. A full pipe already holds a wake-up: success.
    pub fn signal(&self) -> io::Result<()> {
        match self {
            PeerWake::EventFd(e) => e.signal(),
            // Non-blocking on a description only we hold (see `from_peer`).
            PeerWake::Pipe(fd) => match write_without_sigpipe(fd.as_fd(), &[1]) {
                Ok(_) => Ok(()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
                Err(e) => Err(e),
            },
        }
    }
}

/// [pipe2(2)] with `O_NONBLOCK | O_CLOEXEC`: (read end, write end).
///
/// [pipe2(2)]: https://man7.org/linux/man-pages/man2/pipe2.2.html
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [-1 as libc::c_int; 2];
    // SAFETY: pipe2 writes two descriptors into the array we pass; on
    // success both are fresh and owned by nobody else.
    unsafe {
        super::syscall!(pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC))?;
        Ok((OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])))
    }
}

/// [fcntl(2)] `F_GETFL`.
///
/// [fcntl(2)]: https://man7.org/linux/man-pages/man2/fcntl.2.html
fn getfl(fd: BorrowedFd<'_>) -> io::Result<libc::c_int> {
    // SAFETY: F_GETFL takes no pointer argument.
    unsafe { super::syscall!(fcntl(fd.as_raw_fd(), libc::F_GETFL)) }
}

/// [write(2)] with `SIGPIPE` blocked in this thread; a `SIGPIPE` the write
/// raised is consumed ([sigtimedwait(2)] with a zero timeout), one that was
/// pending before is left alone.
///
/// [write(2)]: https://man7.org/linux/man-pages/man2/write.2.html
/// [sigtimedwait(2)]: https://man7.org/linux/man-pages/man2/sigtimedwait.2.html
fn write_without_sigpipe(fd: BorrowedFd<'_>, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: every sigset_t is initialised by sigemptyset before use; the
    // mask calls read/write sigset_t values we own; write reads `buf` for
    // its length; sigtimedwait reads the set and a zero timespec we own.
    unsafe {
        let mut pipe_set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut pipe_set);
        libc::sigaddset(&mut pipe_set, libc::SIGPIPE);
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut old);
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &pipe_set, &mut old);
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        let mut pending: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut pending);
        let was_pending =
            libc::sigpending(&mut pending) == 0 && libc::sigismember(&pending, libc::SIGPIPE) == 1;
        let r = libc::write(fd.as_raw_fd(), buf.as_ptr().cast(), buf.len());
        let result = if r >= 0 {
            Ok(r as usize)
        } else {
            Err(io::Error::last_os_error())
        };
        if matches!(&result, Err(e) if e.raw_os_error() == Some(libc::EPIPE)) && !was_pending {
            let zero = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            libc::sigtimedwait(&pipe_set, std::ptr::null_mut(), &zero);
        }
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dup(fd: BorrowedFd<'_>) -> OwnedFd {
        fd.try_clone_to_owned().expect("F_DUPFD_CLOEXEC")
    }

    #[test]
    fn pipe_wake_round_trip() {
        let own = OwnWake::new(WakeKind::Pipe).unwrap();
        let peer = PeerWake::from_peer(dup(own.fd_for_peer())).unwrap();
        assert_eq!(peer.kind(), WakeKind::Pipe);
        assert!(!own.drain().unwrap());
        peer.signal().unwrap();
        peer.signal().unwrap();
        assert!(own.drain().unwrap());
        assert!(!own.drain().unwrap());
        // A full pipe already holds a wake-up.
        for _ in 0..70_000 {
            peer.signal().unwrap();
        }
        assert!(own.drain().unwrap());
        assert!(!own.drain().unwrap());
    }

    /// `drain` reads at most `PIPE_DRAIN_MAX` bytes a call, whatever the
    /// pipe holds: a peer shares the pipe, may enlarge it (`F_SETPIPE_SZ`)
    /// and refill it as fast as it is read, and would keep a drain that
    /// reads until the pipe is empty reading (the bytes left only keep
    /// that peer's own wake-ups from adding to it).
    #[test]
    fn drain_reads_at_most_its_bound_per_call() {
        use std::io::Write;
        let own = OwnWake::new(WakeKind::Pipe).unwrap();
        let w = dup(own.fd_for_peer());
        // SAFETY: F_SETPIPE_SZ takes an int and no pointer.
        let size = unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
        assert!(
            size >= 0 && size as usize >= 4 * PIPE_DRAIN_MAX,
            "F_SETPIPE_SZ: {}",
            io::Error::last_os_error()
        );
        let mut f = std::fs::File::from(w);
        f.write_all(&vec![1u8; size as usize]).unwrap();
        assert!(own.drain().unwrap());
        let mut left: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int into `left`, which outlives the call.
        let r = unsafe { libc::ioctl(own.poll_fd().as_raw_fd(), libc::FIONREAD, &mut left) };
        assert_eq!(r, 0, "FIONREAD: {}", io::Error::last_os_error());
        assert_eq!(left as usize, size as usize - PIPE_DRAIN_MAX);
    }

    #[test]
    fn eventfd_wake_round_trip() {
        let own = OwnWake::new(WakeKind::EventFd).unwrap();
        let peer = PeerWake::from_peer(dup(own.fd_for_peer())).unwrap();
        assert_eq!(peer.kind(), WakeKind::EventFd);
        peer.signal().unwrap();
    }

    #[test]
    fn from_peer_refuses_other_descriptors() {
        let own = OwnWake::new(WakeKind::Pipe).unwrap();
        // The read end of a pipe.
        let read_end = own.poll_fd();
        let err = PeerWake::from_peer(dup(read_end)).unwrap_err();
        assert!(err.to_string().contains("write-only end"), "{err}");
        let file = OwnedFd::from(std::fs::File::open("/proc/self/stat").unwrap());
        let err = PeerWake::from_peer(file).unwrap_err();
        assert!(err.to_string().contains("expected an eventfd"), "{err}");
    }

    #[test]
    fn a_peer_clearing_o_nonblock_cannot_block_a_pipe_signal() {
        let own = OwnWake::new(WakeKind::Pipe).unwrap();
        let peer = PeerWake::from_peer(dup(own.fd_for_peer())).unwrap();
        // The peer clears O_NONBLOCK on the description it passed us.
        // SAFETY: F_SETFL on a descriptor we own, no pointers.
        unsafe { libc::fcntl(own.fd_for_peer().as_raw_fd(), libc::F_SETFL, 0) };
        // Filling the pipe and signalling on: a write on a blocking
        // description would block here, forever.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let r = (0..70_000).try_for_each(|_| peer.signal());
            let _ = tx.send(r.map_err(|e| e.to_string()));
        });
        let r = rx.recv_timeout(std::time::Duration::from_secs(10));
        assert_eq!(r.expect("signal blocked on a full pipe"), Ok(()));
        assert!(own.drain().unwrap());
    }

    #[test]
    fn dead_reader_is_epipe_not_a_signal() {
        let own = OwnWake::new(WakeKind::Pipe).unwrap();
        let peer = PeerWake::from_peer(dup(own.fd_for_peer())).unwrap();
        drop(own);
        // Rust's runtime ignores SIGPIPE; a C program embedding us may not.
        // Restore the default action (kill the process) so that only the
        // mask can save this test.
        // SAFETY: setting a signal's disposition to SIG_DFL is always valid.
        let prev = unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        let r = peer.signal();
        // SAFETY: restores the previous disposition returned above.
        unsafe { libc::signal(libc::SIGPIPE, prev) };
        let err = r.unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPIPE), "{err}");
    }
}

//! The system calls the integration tests make themselves, each behind a
//! small safe wrapper (all the tests' `unsafe` lives here). The workspace
//! has no safe system-call crate among its dependencies (`rustix` and
//! `nix` are not), so these call `libc`.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// The C convention: a negative result is a failure, described by `errno`.
fn check<T: Into<i64> + Copy>(r: T) -> io::Result<T> {
    if r.into() < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Marks socket `fd` as accepting connections with a queue of `backlog`
/// ([listen(2)](https://man7.org/linux/man-pages/man2/listen.2.html)).
/// The tests' "stuck owner" uses a backlog of 0, so that one pending
/// connection fills the queue.
pub fn listen(fd: BorrowedFd<'_>, backlog: i32) -> io::Result<()> {
    // SAFETY: `fd` is borrowed, so it is open for the whole call; listen
    // reads and writes no memory of ours.
    check(unsafe { libc::listen(fd.as_raw_fd(), backlog) }).map(drop)
}

/// This process's resource usage, all its threads
/// ([getrusage(2)](https://man7.org/linux/man-pages/man2/getrusage.2.html),
/// `RUSAGE_SELF`).
pub fn getrusage_self() -> io::Result<libc::rusage> {
    // SAFETY: `rusage` is plain old data, for which all-zero bytes are a
    // valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes only into the struct we pass, which is
    // ours, exclusively borrowed, and lives across the call.
    check(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) })?;
    Ok(ru)
}

/// A new descriptor, owned by the caller, for the open file `fd` names
/// ([dup(2)](https://man7.org/linux/man-pages/man2/dup.2.html)). `fd` may
/// be a descriptor something else owns (a plugin's epoll set, to keep it
/// open past a test's tampering): dup only reads it (a closed one is
/// `EBADF`).
pub fn dup(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: dup reads and writes no memory of ours, and creates nothing
    // when it fails.
    let new = check(unsafe { libc::dup(fd) })?;
    // SAFETY: on success `new` is a descriptor dup just opened, so nothing
    // else owns it: the `OwnedFd` is its only owner and closes it once.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// Makes descriptor `target` name the open file `src` names, closing what
/// it named before, and returns `target`
/// ([dup2(2)](https://man7.org/linux/man-pages/man2/dup2.2.html)). For a
/// test that breaks a descriptor it does not own on purpose (as a program
/// that reuses a descriptor it does not own would): `target` stays open,
/// so its owner's later use and close still find an open descriptor.
pub fn dup2(src: BorrowedFd<'_>, target: RawFd) -> io::Result<RawFd> {
    // SAFETY: `src` is borrowed, so open for the call; dup2 reads and
    // writes no memory of ours, and leaves `target` open (naming `src`'s
    // file), so no owner of `target` is left holding a closed number.
    check(unsafe { libc::dup2(src.as_raw_fd(), target) })
}

/// Sends signal `sig` to process `pid`
/// ([kill(2)](https://man7.org/linux/man-pages/man2/kill.2.html)).
pub fn kill(pid: u32, sig: libc::c_int) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: kill reads and writes no memory of ours.
    check(unsafe { libc::kill(pid, sig) }).map(drop)
}

/// A configuration value of the system, such as `_SC_CLK_TCK`
/// ([sysconf(3)](https://man7.org/linux/man-pages/man3/sysconf.3.html)).
pub fn sysconf(name: libc::c_int) -> io::Result<libc::c_long> {
    // SAFETY: sysconf only reads a value of the system; it touches no
    // memory of ours.
    check(unsafe { libc::sysconf(name) })
}

/// Waits until `fd` is readable or `timeout` passes (none: no bound),
/// and says whether it is readable
/// ([poll(2)](https://man7.org/linux/man-pages/man2/poll.2.html)): the
/// sleep of an event loop of the user's own on an engine's fd. A wait cut
/// short by a signal (`EINTR`) returns false, like a timeout.
pub fn poll_readable(fd: BorrowedFd<'_>, timeout: Option<std::time::Duration>) -> io::Result<bool> {
    let ms = timeout.map_or(-1, |t| {
        // Rounded up: a deadline a microsecond ahead is no busy loop.
        let ms = t.as_nanos().div_ceil(1_000_000);
        libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
    });
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `pfd` is ours, exclusively borrowed, and lives across the
    // call; the count of 1 matches it; `fd` is borrowed, so open meanwhile.
    match check(unsafe { libc::poll(&mut pfd, 1, ms) }) {
        Ok(n) => Ok(n > 0 && pfd.revents & libc::POLLIN != 0),
        Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(false),
        Err(e) => Err(e),
    }
}

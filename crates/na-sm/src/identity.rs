//! Which process a connection's peer is, and the pidfd that watches its
//! exit (see `SmPlugin::watch_process`).
//!
//! The kernel names the peer by pid (`SO_PEERCRED`, recorded as it
//! connected, or listened for the listener), and that pid is what RMA
//! targets (`process_vm_readv`/`writev`). Pids are reused, so the pidfd
//! that ends the connection when the peer exits must name that very
//! process, never one that took its pid after it:
//!
//! 1. `SO_PEERPIDFD` (Linux 6.5) is the kernel's pidfd of that process:
//!    exact. Kernels before 6.18 refuse it (`EINVAL`) for a peer that has
//!    been reaped already; then, and where the option is missing, 2.
//! 2. `pidfd_open(pid)` names whoever has the pid *now*, so it is checked
//!    against the peer's start time (field 22 of `/proc/<pid>/stat`): a
//!    pid and a start time name one process for all time. After the
//!    pidfd is opened, the pid's start time is read, then the pidfd is
//!    polled: not exited means its process held the pid throughout, so
//!    the start time read is its own. Equal to the peer's: it is the
//!    peer. Otherwise, or if it has exited, the peer has exited: it is
//!    gone ([`SmError::PidReused`] names the other process), never
//!    watched through another process's pidfd.
//!
//! The peer's start time is read by us, not said by the peer (nothing a
//! peer says is trusted; and `/proc` gives start times relative to the
//! reader's time namespace, which the peer's may not be): as soon as the
//! connection is there (right after `accept`, right after `connect`),
//! then the socket is polled. Its other end still open means the process
//! that connected had not exited when `/proc` was read (an exiting process
//! closes its descriptors before it can be reaped and its pid reused), so
//! the start time read is its own ([`PeerStart::read`]).
//!
//! What is left, on kernels where step 2 runs: that argument needs the
//! peer's end of the socket to be held by the peer alone. A peer that
//! handed it on (a child it forked, a descriptor sent over another
//! socket), then exited and was reaped, its pid taken by a new process,
//! all between its `connect` and our read, would be taken for that
//! process. Pids are handed out in turn, so its pid can only come round
//! again after the whole pid space (`pid_max`, 32,768 at least) has been
//! used in that window. The window is not always short: on the listener
//! side it runs from the peer's `connect` to our `accept`, which waits
//! while accepts are paused or nobody calls `progress`, and a process
//! that forks fast can go round 32,768 pids in about a second. The peer
//! cannot choose which process takes its pid, and a same-uid process can
//! already trace ours. The same holds for a listener that exited
//! while a child it forked held its listening socket. Start times count
//! clock ticks (10 ms): two processes with one pid within one tick would
//! need the pid space to go round in 10 ms.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use crate::error::{SmError, SmResult};
use crate::sys::{proc, socket};

/// How a plugin watches its peers' exits (see `SmConfig::debug`'s
/// `pidfd_by_pid` and `exits_by_eof_only`, and `PIDFD_ENV`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExitWatch {
    /// `SO_PEERPIDFD`, else (or where it fails) `pidfd_open` checked
    /// against the start time: the default.
    Socket,
    /// `pidfd_open` checked against the start time (kernels before 6.5).
    ByPid,
    /// No pidfd: the socket's end-of-file is the only sign of an exit
    /// (kernels without pidfds). The start time is still read, and a peer
    /// that cannot be identified is still gone.
    EofOnly,
}

/// What we learned of a peer's process when its connection was made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PeerStart {
    /// Its start time, in clock ticks since boot.
    Known(u64),
    /// Why it could not be learned: the peer is gone.
    Unknown(String),
    /// Why it could not be learned: a failure of ours (out of
    /// descriptors or memory, `/proc` unreadable), which says nothing of
    /// the peer. Its exit is then watched by end-of-file only, as where
    /// the kernel has no pidfds; it is not taken as gone.
    Unreadable(String),
}

/// Whether `e`, from reading `/proc/<pid>/...`, says the process is gone
/// (rather than that the read failed on our side).
fn says_gone(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH))
}

impl PeerStart {
    /// The start time of `pid`, the process at the other end of `sock`
    /// (its `SO_PEERCRED`): read from `/proc`, then proved to be that
    /// process's by the other end of `sock` being open still (see the
    /// module docs).
    pub(crate) fn read(sock: BorrowedFd<'_>, pid: u32) -> PeerStart {
        let start = match proc::start_time(pid) {
            Ok(t) => t,
            Err(e) if says_gone(&e) => return PeerStart::Unknown(format!("reading /proc/{pid}/stat: {e}")),
            Err(e) => return PeerStart::Unreadable(format!("reading /proc/{pid}/stat: {e}")),
        };
        match socket::peer_closed(sock) {
            Ok(false) => PeerStart::Known(start),
            Ok(true) => PeerStart::Unknown("it closed the connection before it could be identified".into()),
            Err(e) => PeerStart::Unreadable(format!("polling its socket: {e}")),
        }
    }
}

/// A pidfd of process `pid` (`peer` in errors), at the other end of
/// `sock`, which started at `start`: `SO_PEERPIDFD` if `watch` is
/// [`ExitWatch::Socket`], else or where that fails, [`open_checked`].
/// `Ok(None)` where there is no pidfd to be had (no `pidfd_open`, out of
/// descriptors, [`ExitWatch::EofOnly`]): then the socket's end-of-file is
/// the only sign of its exit. An error if the peer is gone, or cannot be
/// told from another process.
pub(crate) fn peer_pidfd(
    sock: BorrowedFd<'_>,
    pid: u32,
    start: &PeerStart,
    watch: ExitWatch,
    peer: &str,
) -> SmResult<Option<OwnedFd>> {
    if watch == ExitWatch::Socket {
        match socket::peer_pidfd(sock) {
            Ok(fd) => return Ok(Some(fd)),
            Err(e) => {
                tracing::debug!(pid, error = %na_core::ErrorChain(&e), "sm: no SO_PEERPIDFD; the peer's pid is opened and checked")
            }
        }
    }
    match start {
        PeerStart::Known(_) if watch == ExitWatch::EofOnly => Ok(None),
        PeerStart::Known(t) => open_checked(pid, *t, peer),
        PeerStart::Unreadable(why) => {
            tracing::warn!(%peer, pid, %why, "sm: a peer's start time could not be read; its exit is seen by end-of-file only");
            Ok(None)
        }
        PeerStart::Unknown(why) => {
            tracing::warn!(%peer, pid, %why, "sm: a peer could not be identified beyond its pid; taken as gone");
            Err(SmError::PeerGone {
                peer: peer.to_owned(),
                reason: format!("process {pid} could not be identified when it connected ({why})"),
            })
        }
    }
}

/// `pidfd_open(pid)`, checked to name the process that started at
/// `expected` (see the module docs). Errors: [`SmError::PeerGone`] if
/// that process has exited, [`SmError::PidReused`] if the pid names
/// another, [`SmError::Sys`] if the check itself fails.
pub(crate) fn open_checked(pid: u32, expected: u64, peer: &str) -> SmResult<Option<OwnedFd>> {
    let exited = || SmError::PeerGone {
        peer: peer.to_owned(),
        reason: format!("process {pid} exited"),
    };
    let fd = match proc::pidfd_open(pid) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Err(exited()),
        Err(e) => {
            tracing::debug!(pid, error = %na_core::ErrorChain(&e), "sm: no pidfd for a peer (its exit is seen by end-of-file only)");
            return Ok(None);
        }
    };
    // In this order: the read describes the pidfd's process only if that
    // has not exited after it (a zombie still holds its pid).
    let found = proc::start_time(pid);
    if proc::pidfd_exited(fd.as_fd()).map_err(|e| SmError::sys("poll(2) of a peer's pidfd", e))? {
        return Err(exited());
    }
    let found = match found {
        Ok(t) => t,
        Err(e) if says_gone(&e) => return Err(exited()),
        // Our failure (out of descriptors: `pidfd_open` may have taken
        // the last), not the peer's: unchecked, the pidfd is not used.
        Err(e) => {
            tracing::warn!(%peer, pid, error = %na_core::ErrorChain(&e), "sm: a peer's pidfd could not be checked; its exit is seen by end-of-file only");
            return Ok(None);
        }
    };
    if found != expected {
        tracing::warn!(%peer, pid, expected, found, "sm: the peer's pid names another process now; taken as gone");
        return Err(SmError::PidReused {
            peer: peer.to_owned(),
            pid,
            expected,
            found,
        });
    }
    Ok(Some(fd))
}

#[cfg(test)]
mod tests;

//! Reading out a UNIX socket a peer passed us before closing it.
//!
//! Messages queued on a UNIX socket can carry descriptors (`SCM_RIGHTS`)
//! that nobody has received yet: they are in flight, and the socket's
//! last close releases them. A peer that passes us such a socket with a
//! lingering TCP socket in flight inside it (or another such UNIX socket,
//! and so on) would make our close of the outer socket wait out the
//! linger time, holding a closing thread: [`abort_at_close`] never
//! reaches a socket it cannot see. So, on the closing thread, before a
//! passed UNIX socket is closed, it is shut for reading (nothing more can
//! be queued) and its queued messages are read out without blocking
//! (`MSG_DONTWAIT`, `MSG_CMSG_CLOEXEC`); the descriptors they carry are
//! disposed of the same way: sockets set to abort at their close, UNIX
//! sockets read out in turn.
//!
//! Strictly bounded, so a hostile peer can neither keep a closing thread
//! reading for ever nor fill our descriptor table: sockets are read out
//! down to [`MAX_NESTED_DEPTH`] levels, at most [`MAX_NESTED_FDS`]
//! descriptors are taken out and at most [`MAX_NESTED_READS`] messages
//! read per passed descriptor (all levels together). Past a bound, what
//! is left is closed as it is (it may still block that close: logged,
//! at the 1st, 2nd, 4th... time). A listening socket is closed as it is
//! too: the connections in its queue are not accepted and read.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::sys::socket::{abort_at_close, recv_with_fds, shutdown_read, unix_socket_kind};

/// Levels of UNIX sockets read out before their close: the passed socket
/// is level 1, one in flight inside it level 2, and so on. A UNIX socket
/// found at the level below the last is closed as it is.
pub const MAX_NESTED_DEPTH: usize = 4;

/// Most descriptors taken out of passed UNIX sockets (at every level)
/// for one passed descriptor. Each is closed as soon as it is disposed
/// of, so our table holds at most one message's (`SCM_MAX_FD`, 253) per
/// level at a time.
pub const MAX_NESTED_FDS: usize = 1024;

/// Most messages read out of passed UNIX sockets (at every level) for one
/// passed descriptor.
pub const MAX_NESTED_READS: usize = 4096;

/// How many read-outs stopped at a bound (for the log).
static BOUND_HITS: AtomicU64 = AtomicU64::new(0);

/// What one read-out may still do.
#[derive(Default)]
struct Budget {
    fds: usize,
    reads: usize,
    /// A bound was reached: something was closed without being read out.
    hit: bool,
}

impl Budget {
    fn spent(&self) -> bool {
        self.fds >= MAX_NESTED_FDS || self.reads >= MAX_NESTED_READS
    }
}

/// Closes `fd`, a descriptor a peer passed us, here (on a closing
/// thread): a socket is set to abort at its close, and a UNIX socket is
/// first read out, within the bounds above.
pub(super) fn dispose(fd: OwnedFd) {
    let mut budget = Budget::default();
    dispose_at(fd, 1, &mut budget);
    if budget.hit {
        let n = BOUND_HITS.fetch_add(1, Ordering::Relaxed) + 1;
        if na_core::logged_at(n) {
            tracing::warn!(
                times = n,
                depth = MAX_NESTED_DEPTH,
                fds = MAX_NESTED_FDS,
                reads = MAX_NESTED_READS,
                "sm: a passed socket held more in flight than is read out before its close: the rest \
                 was closed as it is (its close may hold a closing thread)"
            );
        }
    }
}

/// [`dispose`] of a descriptor found at `depth`.
fn dispose_at(fd: OwnedFd, depth: usize, budget: &mut Budget) {
    abort_at_close(fd.as_fd());
    if let Some((ty, listening)) = unix_socket_kind(fd.as_fd()) {
        if listening || depth > MAX_NESTED_DEPTH || budget.spent() {
            budget.hit = true;
        } else {
            read_out(fd.as_fd(), ty, depth, budget);
        }
    }
    drop(fd);
}

/// Shuts UNIX socket `sock` (of type `ty`, found at `depth`) for reading
/// and reads out what is queued on it, disposing of the descriptors the
/// messages carry, until it is empty or the budget is spent.
fn read_out(sock: BorrowedFd<'_>, ty: libc::c_int, depth: usize, budget: &mut Budget) {
    // Nothing more can be queued (a peer keeping the other end cannot
    // feed it while we read); a failure only means it may be.
    let _ = shutdown_read(sock);
    let mut buf = [0u8; 4096];
    loop {
        if budget.spent() {
            budget.hit = true;
            return;
        }
        budget.reads += 1;
        match recv_with_fds(sock, &mut buf) {
            Ok(r) => {
                // A stream shut for reading reads 0 once empty (a datagram
                // may be empty: those end with EAGAIN).
                if r.len == 0 && r.fds.is_empty() && ty == libc::SOCK_STREAM {
                    return;
                }
                budget.fds += r.fds.len();
                for fd in r.fds {
                    dispose_at(fd, depth + 1, budget);
                }
            }
            Err(e)
                if e.kind() == io::ErrorKind::Interrupted || e.raw_os_error() == Some(libc::ECONNRESET) => {}
            // Empty (EAGAIN), or nothing to read on it.
            Err(_) => return,
        }
    }
}

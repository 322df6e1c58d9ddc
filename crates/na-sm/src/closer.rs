//! Closing what a peer handed us, without waiting on it.
//!
//! Closing a descriptor runs its file's release when ours is the last
//! reference, and some releases wait for as long as someone else decides:
//! a TCP socket with `SO_LINGER` and unsent data, a file on a FUSE mount
//! whose daemon never answers the flush. A hostile peer can pass us such
//! a descriptor (`SCM_RIGHTS`) in place of a memfd or eventfd, or leave it
//! queued on its connection's socket, whose close then releases it.
//!
//! * Descriptors of a kind we did not check go to a background closing
//!   thread ([`pool`]), and are counted while they wait. There, a socket
//!   is first set to abort at its close (`SO_LINGER` {on, 0}: see
//!   [`abort_at_close`]), so a lingering one waits for nothing, and a
//!   UNIX socket is read out first ([`nested`]): the descriptors in
//!   flight inside it, which its close would release, are disposed of
//!   the same way, down to [`MAX_NESTED_DEPTH`] levels and
//!   [`MAX_NESTED_FDS`] descriptors. What can still block: a file on a
//!   FUSE mount; a socket in flight past those bounds (or in the queue
//!   of a passed listening socket, which is not read); a socket whose
//!   linger the peer, holding a copy, puts back between our `setsockopt`
//!   and our close. A release that never ends holds its thread; once
//!   every closing thread has been stuck for [`CLOSE_STALL`], another is
//!   started, up to [`MAX_CLOSING_THREADS`]. With all of them stuck, the
//!   descriptors queued behind stay open: past [`MAX_PENDING_FDS`] the
//!   plugin takes no more in ([`congested`]).
//!
//! [`abort_at_close`]: crate::sys::socket::abort_at_close
//! * A socket a peer is (or was) connected through ([`PeerSocket`]), and
//!   the listener, are closed in place once nothing can be queued to them
//!   any more and what was queued has been read out and screened: their
//!   own close then releases nothing of the peer's. (They went to the
//!   thread too, uncounted, until a jammed thread was seen to hold every
//!   departed connection's socket open: a descriptor leak per connection.)
//!
//! The engine's threads never wait.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::sys::fork;
use crate::sys::screen::harmless_to_close;
use crate::sys::socket::{recv_with_fds, shutdown_read, Received};

mod nested;
mod pool;

pub use nested::{MAX_NESTED_DEPTH, MAX_NESTED_FDS, MAX_NESTED_READS};
use pool::send;
pub(crate) use pool::{hold_across_fork, release_after_fork, reset_spawn_failing_in_child};
#[cfg(feature = "test-hooks")]
pub use pool::{probe as debug_closing_threads, ClosingThreads};
#[cfg(test)]
pub(crate) use pool::{set_spawn_failing, spawn_failing};
pub use pool::{CLOSE_STALL, MAX_CLOSING_THREADS};

/// Something to drop, and how many descriptors of our table it holds
/// (counted in `PENDING_FDS` until it is dropped).
type Item = (Box<dyn Send>, usize);

/// Peer-passed descriptors waiting in the closing threads' queue.
static PENDING_FDS: AtomicUsize = AtomicUsize::new(0);

/// Past this many descriptors waiting to be closed (releases that never
/// end hold every closing thread), the plugin takes no more in: it stops
/// accepting and reading hellos until the queue moves. Otherwise a peer that jammed the threads could fill
/// our descriptor table, and the kernel would then close what does not
/// fit inside `recvmsg`, on the caller's thread.
pub const MAX_PENDING_FDS: usize = 256;

/// In a forked child: the parent's queued descriptors belong to its
/// closing threads, which the child does not have (it starts its own
/// pool), so they are not the child's to count. Without this, a child
/// forked while its parent was congested would stay congested (every
/// listener's accepts paused) for good.
pub(crate) fn reset_count_in_child() {
    PENDING_FDS.store(0, Ordering::Relaxed);
    pool::reset_items_in_child();
}

/// True while more than [`MAX_PENDING_FDS`] peer-passed descriptors wait
/// to be closed: take no more in. Then, if every closing thread is stuck,
/// another is started first (see [`pool`]), so the queue moves again
/// unless all [`MAX_CLOSING_THREADS`] are.
pub(crate) fn congested() -> bool {
    if PENDING_FDS.load(Ordering::Relaxed) <= MAX_PENDING_FDS {
        return false;
    }
    pool::relieve();
    true
}

/// Drops `item` on a closing thread (or here, if no thread can be
/// started).
pub(crate) fn close_later<T: Send + 'static>(item: T) {
    send((Box::new(item), 0));
}

/// [`close_later`] for descriptors a peer passed us (counted while they
/// wait: see [`congested`]).
pub(crate) fn close_fds_later(fds: Vec<OwnedFd>) {
    if fds.is_empty() {
        return;
    }
    let n = fds.len();
    send_counted(PeerFds(fds), n);
}

/// Descriptors a peer passed us, on their way to be closed. Dropped (on a
/// closing thread), each socket among them is set to abort at its close
/// ([`abort_at_close`](crate::sys::socket::abort_at_close)): a lingering TCP socket, the cheapest way to make
/// a close wait, then holds no thread; a UNIX socket is read out first,
/// so one in flight inside it does not either ([`nested`], bounded).
struct PeerFds(Vec<OwnedFd>);

impl Drop for PeerFds {
    fn drop(&mut self) {
        for fd in self.0.drain(..) {
            nested::dispose(fd);
        }
    }
}

/// Hands `item`, which holds `fds` descriptors of our table, to the
/// closing thread, counted in `PENDING_FDS` until it is dropped.
fn send_counted<T: Send + 'static>(item: T, fds: usize) {
    PENDING_FDS.fetch_add(fds, Ordering::Relaxed);
    send((Box::new(item), fds));
}

/// [`recv_with_fds`], keeping only descriptors whose close cannot wait
/// (`harmless_to_close`: what a hello or acknowledgement may carry); the
/// others go to the closing threads, counted in the second value.
pub(crate) fn recv_screened(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(Received, usize)> {
    let mut r = recv_with_fds(sock, buf)?;
    let (keep, odd): (Vec<_>, Vec<_>) = r.fds.into_iter().partition(|fd| harmless_to_close(fd.as_fd()));
    let refused = odd.len();
    close_fds_later(odd);
    r.fds = keep;
    Ok((r, refused))
}

/// A socket a peer is (or was) connected through. Its drop shuts it for
/// reading, reads out and screens what the peer had queued (the
/// descriptors that could wait at their close go to the closing threads),
/// then closes it in place (see the module docs).
#[derive(Debug)]
pub(crate) struct PeerSocket {
    sock: Option<UnixStream>,
    /// The fork generation it was made in: a forked child's copy shares
    /// the socket with its parent, which a shutdown would cut off.
    generation: u64,
}

impl PeerSocket {
    pub(crate) fn new(sock: UnixStream) -> Self {
        PeerSocket {
            sock: Some(sock),
            generation: fork::generation(),
        }
    }
}

impl std::ops::Deref for PeerSocket {
    type Target = UnixStream;

    fn deref(&self) -> &UnixStream {
        // Some until the drop.
        self.sock
            .as_ref()
            .unwrap_or_else(|| unreachable!("a PeerSocket is only emptied by its drop"))
    }
}

impl Drop for PeerSocket {
    fn drop(&mut self) {
        let Some(sock) = self.sock.take() else { return };
        if self.generation != fork::generation() {
            // Inherited: the parent may still use the socket.
            close_later(sock);
            return;
        }
        close_drained(sock);
    }
}

/// Closes the listener of a plugin made in this process: it refuses
/// connections from now on, each one it had not accepted yet is accepted
/// and closed as a [`PeerSocket`], then the listener itself goes here.
/// (A forked child's copy is [`close_later`]'s: the socket is the parent's.)
pub(crate) fn close_listener(listener: UnixListener) {
    if shutdown_read(listener.as_fd()).is_err() || listener.set_nonblocking(true).is_err() {
        close_later(listener);
        return;
    }
    // At most the accept queue (bounded by the listen backlog): the
    // shutdown stops it from growing.
    for _ in 0..MAX_DRAIN {
        match listener.accept() {
            Ok((s, _)) => drop(PeerSocket::new(s)),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return drop(listener),
            Err(_) => break,
        }
    }
    close_later(listener);
}

/// Reads (at most this many times) from a socket or listener being
/// closed; past it, a closing thread closes it.
const MAX_DRAIN: usize = 65_536;

/// Closes `sock` here once [`drained`], else on a closing thread,
/// counted as the one descriptor of ours it holds (see [`congested`]).
fn close_drained(sock: UnixStream) {
    if drained(sock.as_fd()) {
        drop(sock);
    } else {
        send_counted(sock, 1);
    }
}

/// Shuts `sock` for reading and reads out what is queued on it, screening
/// the descriptors; true if it got to the end (its close then releases
/// nothing of the peer's).
fn drained(sock: BorrowedFd<'_>) -> bool {
    if shutdown_read(sock).is_err() {
        return false;
    }
    let mut buf = [0u8; 4096];
    for _ in 0..MAX_DRAIN {
        // Past the bound, what is left stays in the socket, which the
        // closing thread closes whole (counted): reading on would bring a
        // hostile peer's descriptors into our table whatever the bound
        // (a refused connection's queued hellos carry up to 253 each).
        if congested() {
            return false;
        }
        match recv_screened(sock, &mut buf) {
            // End of file: the queue is empty, and stays so.
            Ok((r, _)) if r.len == 0 && r.fds.is_empty() => return true,
            // Descriptors that passed the screen are closed here at once.
            Ok(_) => {}
            // A peer that closed without reading what we sent leaves its
            // error on our socket, reported (once) when the queue is
            // empty: read on, the end of file follows.
            Err(e)
                if e.kind() == io::ErrorKind::Interrupted || e.raw_os_error() == Some(libc::ECONNRESET) => {}
            Err(_) => return false,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    struct Report(std::sync::mpsc::Sender<std::thread::ThreadId>);

    impl Drop for Report {
        fn drop(&mut self) {
            let _ = self.0.send(std::thread::current().id());
        }
    }

    /// A peer that closed without reading what we sent leaves ECONNRESET
    /// on our socket, reported once its queue is empty: the drain reads on
    /// to the end of file (it gave up there, and the socket went to the
    /// closing thread).
    #[test]
    fn a_reset_left_by_a_peer_that_did_not_read_ends_no_drain() {
        use std::io::Write;
        let (mut ours, mut theirs) = UnixStream::pair().unwrap();
        theirs.write_all(b"queued").unwrap();
        ours.write_all(b"never read").unwrap();
        drop(theirs);
        assert!(drained(ours.as_fd()), "the drain stopped at the peer's reset");
    }

    /// Every item handed over is dropped, none on the caller's thread
    /// (which of the closing threads drops which, and in what order, is
    /// not fixed once there are several).
    #[test]
    fn items_are_dropped_off_the_callers_thread() {
        let (tx, rx) = channel();
        for _ in 0..3 {
            close_later(Report(tx.clone()));
        }
        let here = std::thread::current().id();
        for _ in 0..3 {
            let there = rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
            assert_ne!(there, here, "dropped on the caller's thread");
        }
    }
}

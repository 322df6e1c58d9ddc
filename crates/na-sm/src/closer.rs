//! Closing what a peer handed us, off the caller's thread.
//!
//! Closing a descriptor runs its file's release when ours is the last
//! reference, and some releases wait for as long as someone else decides:
//! a TCP socket with `SO_LINGER` and unsent data, a file on a FUSE mount
//! whose daemon never answers the flush. A hostile peer can pass us such
//! a descriptor (`SCM_RIGHTS`) in place of a memfd or eventfd, or leave it
//! queued on its connection's socket, whose close then releases it. So
//! descriptors of a kind we did not check, and every socket a peer was
//! connected through, are closed here: on one background thread, started
//! on first use (again in a forked child). A release that never ends holds
//! that thread, and what comes after it waits in its queue (their
//! descriptors stay open): the engine's threads never wait.

use std::cell::RefCell;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::sys::fork;
use crate::sys::socket::{harmless_to_close, recv_with_fds, Received};

/// Something to drop, and how many descriptors of our table it holds
/// (counted in `PENDING_FDS` until it is dropped).
type Item = (Box<dyn Send>, usize);

/// Peer-passed descriptors waiting in the closing thread's queue.
static PENDING_FDS: AtomicUsize = AtomicUsize::new(0);

/// Past this many descriptors waiting to be closed (a release that never
/// ends holds the thread), the plugin takes no more in: it stops
/// accepting and reading hellos until the queue moves (see
/// [`congested`]). Otherwise a peer that jammed the thread could fill our
/// descriptor table, and the kernel would then close what does not fit
/// inside `recvmsg`, on the caller's thread.
pub(crate) const MAX_PENDING_FDS: usize = 256;

/// The closing thread's queue, and the fork generation it was started in.
type Queue = Option<(u64, Sender<Item>)>;

static CLOSER: Mutex<Queue> = Mutex::new(None);

fn lock() -> MutexGuard<'static, Queue> {
    CLOSER.lock().unwrap_or_else(PoisonError::into_inner)
}

/// True while more than [`MAX_PENDING_FDS`] peer-passed descriptors wait
/// to be closed: take no more in.
pub(crate) fn congested() -> bool {
    PENDING_FDS.load(Ordering::Relaxed) > MAX_PENDING_FDS
}

/// Drops `item` on the closing thread (or here, if no thread can be
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
    PENDING_FDS.fetch_add(n, Ordering::Relaxed);
    send((Box::new(fds), n));
}

fn send(item: Item) {
    let generation = fork::generation();
    let mut closer = lock();
    if closer.as_ref().is_none_or(|(g, _)| *g != generation) {
        // Inherited through a fork: the thread is the parent's. Its
        // sender is forgotten, not dropped (dropping touches the
        // channel's state, which that thread may have held at the fork).
        if let Some(old) = closer.take() {
            std::mem::forget(old);
        }
        *closer = start().map(|tx| (generation, tx));
    }
    let Some((_, tx)) = closer.as_ref() else {
        drop(closer);
        close_now(item);
        return;
    };
    if let Err(returned) = tx.send(item) {
        // The thread is gone (it cannot end by itself: only a panic in a
        // drop ends it). Close here, and start another next time.
        *closer = None;
        drop(closer);
        close_now(returned.0);
    }
}

fn close_now((item, fds): Item) {
    drop(item);
    PENDING_FDS.fetch_sub(fds, Ordering::Relaxed);
}

/// [`recv_with_fds`], keeping only descriptors whose close cannot wait
/// (`harmless_to_close`: what a hello or acknowledgement may carry); the
/// others go to the closing thread, counted in the second value.
pub(crate) fn recv_screened(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(Received, usize)> {
    let mut r = recv_with_fds(sock, buf)?;
    let (keep, odd): (Vec<_>, Vec<_>) = r.fds.into_iter().partition(|fd| harmless_to_close(fd.as_fd()));
    let refused = odd.len();
    close_fds_later(odd);
    r.fds = keep;
    Ok((r, refused))
}

/// A socket a peer is (or was) connected through: closed on the closing
/// thread, since messages still queued on it may hold descriptors whose
/// release the close runs.
#[derive(Debug)]
pub(crate) struct PeerSocket(Option<UnixStream>);

impl PeerSocket {
    pub(crate) fn new(sock: UnixStream) -> Self {
        PeerSocket(Some(sock))
    }
}

impl std::ops::Deref for PeerSocket {
    type Target = UnixStream;

    fn deref(&self) -> &UnixStream {
        // Some until the drop.
        self.0
            .as_ref()
            .unwrap_or_else(|| unreachable!("a PeerSocket is only emptied by its drop"))
    }
}

impl Drop for PeerSocket {
    fn drop(&mut self) {
        if let Some(sock) = self.0.take() {
            close_later(sock);
        }
    }
}

fn start() -> Option<Sender<Item>> {
    let (tx, rx) = channel::<Item>();
    let spawned = std::thread::Builder::new()
        .name("qs-sm-closer".into())
        .spawn(move || {
            for item in rx {
                close_now(item);
            }
        });
    match spawned {
        Ok(_) => Some(tx),
        Err(e) => {
            tracing::warn!(error = %e, "sm: cannot start the closing thread; closing peers' descriptors in place");
            None
        }
    }
}

thread_local! {
    /// The queue's lock, held by the thread that forks from just before
    /// to just after (see `sys::fork`).
    static HELD_FOR_FORK: RefCell<Option<MutexGuard<'static, Queue>>> = const { RefCell::new(None) };
}

/// Takes the queue's lock before a fork (`pthread_atfork`'s prepare
/// handler), so a child never finds it held by a thread it does not have.
pub(crate) fn hold_across_fork() {
    let guard = lock();
    let _ = HELD_FOR_FORK.try_with(|h| *h.borrow_mut() = Some(guard));
}

/// Lets the lock go after a fork, in the parent and in the child.
pub(crate) fn release_after_fork() {
    let _ = HELD_FOR_FORK.try_with(|h| h.borrow_mut().take());
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Report(std::sync::mpsc::Sender<std::thread::ThreadId>);

    impl Drop for Report {
        fn drop(&mut self) {
            let _ = self.0.send(std::thread::current().id());
        }
    }

    #[test]
    fn items_are_dropped_on_another_thread_in_order_of_arrival() {
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

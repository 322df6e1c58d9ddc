//! [`Waker`]: ends an [`Endpoint`](crate::Endpoint)'s sleep from any
//! thread.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::error::{NaError, Result};
use crate::sys::eventfd::EventFd;

/// Ends the sleep of the [`Endpoint`](crate::Endpoint) it came from
/// ([`Endpoint::waker`](crate::Endpoint::waker)), from any thread: a
/// [`progress`](crate::Endpoint::progress) call that sleeps (or spins, in
/// busy or adaptive mode) returns, and a sleep of your own on the
/// endpoint's fd ends, as it becomes readable.
///
/// A wake-up is never lost: one posted while nobody sleeps ends the next
/// sleep before it begins (the next `progress` call that would wait
/// returns, the next [`try_wait`](crate::Endpoint::try_wait) says no).
/// Wake-ups coalesce: however many come before the sleeper looks, it
/// looks once, and its sleep after that sleeps. So a thread that changes
/// what the sleeper waits for changes it first, then wakes: the sleeper,
/// woken, sees the change.
///
/// Cheap to clone (an `Arc`), `Send` and `Sync`. Clones share one
/// eventfd, registered in the endpoint's epoll set; it stays open while
/// any clone lives, and waking an endpoint dropped since does nothing.
#[derive(Clone, Debug)]
pub struct Waker {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    fd: EventFd,
    /// Raised by [`Waker::wake`], lowered by the endpoint as it takes the
    /// wake-up: a spinning endpoint reads it instead of the eventfd, and a
    /// wake-up while it is raised (one posted, not yet taken) costs no
    /// system call.
    woken: AtomicBool,
}

impl Waker {
    /// A waker with its own eventfd (for [`Endpoint::waker`](crate::Endpoint::waker),
    /// which registers it).
    pub(crate) fn new() -> Result<Self> {
        Ok(Waker {
            inner: Arc::new(Inner {
                // Counter 0: not readable until a wake-up adds 1.
                fd: EventFd::with_counter(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
                    .map_err(|e| NaError::sys("eventfd", e))?,
                woken: AtomicBool::new(false),
            }),
        })
    }

    /// Wakes the endpoint: its current sleep ends, or else its next one
    /// (see [`Waker`]). Never blocks. The first wake-up since the
    /// endpoint last took one writes the eventfd (one system call); those
    /// after it, until the endpoint takes them, only read a flag. A
    /// failed write is returned (it cannot fail in practice: the counter
    /// never nears its limit), and a later call writes again.
    pub fn wake(&self) -> Result<()> {
        // AcqRel: the endpoint that lowers the flag (`take`) sees what
        // this thread did before it woke.
        if self.inner.woken.swap(true, Ordering::AcqRel) {
            // A write since the last take is in, or on its way: the sleep
            // it ends looks after this call's changes too (`take`).
            return Ok(());
        }
        // Adds 1: readable until `take` reads it back to 0. Never blocks
        // (non-blocking; `EAGAIN` only at the counter's maximum, which
        // `take` keeps it far from).
        self.inner.fd.write(1).map_err(|e| {
            // Not written: let the next call try again.
            self.inner.woken.store(false, Ordering::Release);
            NaError::sys("eventfd write (Waker::wake)", e)
        })
    }

    /// The eventfd (readable while a wake-up waits to be taken), for the
    /// endpoint's epoll set.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.inner.fd.as_fd()
    }

    /// True if a wake-up was posted and not yet taken: a flag read, for
    /// the endpoint's spin loop.
    #[inline]
    pub(crate) fn posted(&self) -> bool {
        self.inner.woken.load(Ordering::Relaxed)
    }

    /// Takes the wake-ups posted since the last take (the flag lowered,
    /// the eventfd drained): true if there were any. Called by the
    /// endpoint before it sleeps and after its sleep, never on the busy
    /// path. The flag goes first: a wake-up posted after it is lowered
    /// writes the eventfd again, so the next sleep ends; one posted
    /// before was written by the call that raised it, which this drain
    /// takes (or, not in yet, the next drain or sleep does).
    pub(crate) fn take(&self) -> Result<bool> {
        let flagged = self.inner.woken.swap(false, Ordering::AcqRel);
        let counted = self
            .inner
            .fd
            .read()
            .map(|counter| counter.is_some())
            .map_err(|e| NaError::sys("eventfd read (Waker)", e))?;
        Ok(flagged || counted)
    }
}

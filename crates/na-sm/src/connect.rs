//! Lookup, connection set-up and the accept side of the handshake (see
//! [`crate::conn`] for the protocol).
//!
//! Split by side: `dial` is the connector's (lookup, connect, the
//! acknowledgement), `accept` the listener's accepting and its pauses,
//! `hello` the listener's handling of a connector's hello; here are the
//! bounds they share, the peer entries and epoll registrations of new
//! connections, and the handshake deadlines.

mod accept;
mod dial;
mod hello;
mod hooks;

pub(crate) use hooks::ListenerHooks;
#[cfg(feature = "test-hooks")]
pub use hooks::ListenerProbe;

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::addr::SmName;
use crate::conn::Conn;
use crate::error::{SmError, SmResult};
use crate::identity::{self, PeerStart};
use crate::peer_failure::Failure;
use crate::plugin::{SmPlugin, PIDFD_BIT};
use crate::sys::wake::OwnWake;

/// Accepted connections that may wait for their hello at once (each holds
/// a descriptor until its hello or the handshake timeout); with this many
/// waiting, the listener stops accepting until one is done.
pub const MAX_PENDING_HANDSHAKES: usize = 128;

/// Of those, how many one process (by kernel-reported pid) may have
/// waiting at once: its connections past it are refused as they are
/// accepted (with the reason), so that one process that connects and
/// stays silent cannot fill [`MAX_PENDING_HANDSHAKES`] and pause the
/// listener for everyone. An honest connector sends its hello right
/// after connecting, so its handshakes hardly ever wait.
pub const MAX_PENDING_PER_PROCESS: usize = 16;

/// Most connections one pass over the listener accepts (or refuses); a
/// progress call makes a few such passes at most. A pass that reaches the
/// bound leaves the rest queued in the kernel and owes the next call an
/// event poll (the plugin will not sleep until then: a caller that waits
/// on its fd edge-triggered, as tokio does, would get no new edge for a
/// listener that stayed readable). Without a bound, processes that keep
/// connecting at least as fast as we accept could hold one progress call
/// (and every peer's messages behind it) for as long as they go on.
pub const MAX_ACCEPTS_PER_CALL: usize = 32;

/// How long accepting pauses after it failed for want of descriptors or
/// memory.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// Why the listener is out of the epoll set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AcceptPause {
    /// [`MAX_PENDING_HANDSHAKES`] are waiting for their hello.
    Handshakes,
    /// Accepting failed (no descriptors, no memory): retry then.
    Until(Instant),
    /// [`SmConfig::max_queued_total`](crate::SmConfig::max_queued_total)
    /// messages of departed peers are queued: until the application takes
    /// some.
    Queued,
}

/// How a lookup that connects waits for a listener whose accept queue is
/// full (a peer that is hung, overloaded or hostile and does not accept).
#[derive(Clone, Copy, Debug)]
pub(crate) enum ConnectWait {
    /// In connect(2), at most `SmConfig::handshake_timeout` (`lookup`).
    Bounded,
    /// Not at all (`try_lookup`): [`SmError::WouldBlock`] at once, or,
    /// once `handshake_timeout` has passed since `since` (the caller's
    /// first attempt), the error the bounded wait gives when it runs out.
    Never {
        /// When the caller's first attempt was made.
        since: Instant,
    },
}

impl SmPlugin {
    /// The peer entry a new connection to or from process `pid`, named
    /// `name` and started at `start`, joins: the entry of that name if it
    /// may be the same process. An entry whose process started at another
    /// time is a process that exited, and whose pid (so name) a new one
    /// has now, before its departure was seen here: it is failed as gone
    /// first (its calls, its outputs), and the new process gets an entry
    /// of its own (a new token), never the dead one's. An entry whose
    /// start time was not read (our failure, at its first connection)
    /// takes this connection's, where known.
    fn peer_entry(&mut self, name: &SmName, pid: u32, start: &PeerStart) -> u64 {
        let start = match start {
            PeerStart::Known(t) => Some(*t),
            PeerStart::Unknown(_) | PeerStart::Unreadable(_) => None,
        };
        if let Some(old) = self.peers.by_name(&name.key()) {
            if self.peers.may_join(old, start) {
                return old;
            }
            self.fail_peer(
                old,
                Failure::Gone,
                "exited: its pid and name are now another process's",
            );
        }
        self.peers.insert(self.id, name.clone(), pid, start, false)
    }

    /// A pidfd of process `pid` (`peer` in errors), at the other end of
    /// `sock` and started at `start`, in our epoll set under `serial |
    /// PIDFD_BIT` (edge-triggered: it becomes readable once, when the
    /// process exits). `None` for our own process, and where pidfds are
    /// missing (a debug event says why): then the socket's end-of-file is
    /// the only sign of an exit. An error if the peer is gone, or its pid
    /// names another process now (see `identity`): never that process's.
    fn watch_process(
        &self,
        sock: BorrowedFd<'_>,
        pid: u32,
        start: &PeerStart,
        peer: &str,
        serial: u64,
    ) -> SmResult<Option<OwnedFd>> {
        if pid == self.name.pid {
            return Ok(None);
        }
        let Some(fd) = identity::peer_pidfd(sock, pid, start, self.exit_watch, peer)? else {
            return Ok(None);
        };
        match self.poll.add_edge_triggered(fd.as_fd(), serial | PIDFD_BIT) {
            Ok(()) => Ok(Some(fd)),
            Err(e) => {
                tracing::debug!(pid, error = %na_core::ErrorChain(&e), "sm: cannot watch a peer's pidfd");
                Ok(None)
            }
        }
    }

    fn poll_add(&self, fd: BorrowedFd<'_>, token: u64) -> SmResult<()> {
        self.poll
            .add(fd, token)
            .map_err(|e| SmError::sys("epoll_ctl add", e))
    }

    /// Our wake-up eventfd goes in edge-triggered: each peer write is one
    /// event and the fd is never read (no syscall beyond the wait). It
    /// was made with a counter of 1 and a wake-up is a write of 0, so the
    /// counter stays 1 (unless the peer that holds the other copy changes
    /// it: see `EventFd::signal`). A pipe is edge-triggered too and
    /// drained on each event.
    ///
    /// An eventfd is readable from the start (its counter is 1: a write of
    /// 0 is reported only while it is above 0), and epoll reports a ready
    /// descriptor once when it is added, edge-triggered or not: the set's
    /// next wait returns it though no peer wrote. That report cannot be
    /// avoided (the counter must be above 0 before the peer's first write,
    /// and raising it after the add is itself an edge), only taken where
    /// it costs nothing: `wake_primed` makes `sleep` harvest it before it
    /// blocks, as `try_wait` always does, instead of being woken by it.
    fn poll_add_wake(&mut self, wake: &OwnWake, token: u64) -> SmResult<()> {
        self.poll
            .add_edge_triggered(wake.poll_fd(), token)
            .map_err(|e| SmError::sys("epoll_ctl add (eventfd)", e))?;
        if wake.starts_ready() {
            self.wake_primed = true;
        }
        Ok(())
    }

    /// Ends handshakes past their deadline (both sides) and resumes a
    /// paused listener when it may go on; then sets the timer to the next
    /// deadline, so all of this happens on time while the plugin sleeps.
    pub(crate) fn sweep_deadlines(&mut self) {
        // First: what departed peers left may make room for the listener.
        self.drop_departed_held();
        let now = Instant::now();
        if !self.pending.is_empty() {
            let late: Vec<u64> = self
                .pending
                .iter()
                .filter(|(_, p)| p.deadline <= now)
                .map(|(s, _)| *s)
                .collect();
            for s in late {
                if let Some(p) = self.pending.remove(&s) {
                    let _ = self.poll.delete(p.sock.as_fd());
                    if self.stats.refuse_handshake() {
                        tracing::warn!(pid = p.cred.pid, "sm handshake timed out");
                    }
                }
            }
        }
        if self.awaiting_ack > 0 {
            let late: Vec<u64> = self
                .peers
                .iter()
                .filter(|p| p.conns.iter().any(|c| c.ack_deadline.is_some_and(|d| d <= now)))
                .map(|p| p.addr.token())
                .collect();
            for tok in late {
                if let Some((failure, reason)) = self.ack_overdue(tok, now) {
                    self.fail_peer(tok, failure, &reason);
                }
            }
        }
        let resume = match self.accept_pause {
            Some(AcceptPause::Handshakes) => self.pending.len() < MAX_PENDING_HANDSHAKES,
            Some(AcceptPause::Queued) => self.held_by_departed() < self.cfg.max_queued_total,
            Some(AcceptPause::Until(t)) => t <= now,
            None => false,
        };
        if resume {
            self.resume_accepts();
        }
        self.update_timer();
    }

    /// Why peer `tok`, with a connection past its acknowledgement deadline,
    /// fails; `None` if the acknowledgement was there after all. It is read
    /// first: it may wait unread (for a connection to ourselves it is made
    /// in the same batch of events whose end runs this sweep).
    fn ack_overdue(&mut self, tok: u64, now: Instant) -> Option<(Failure, String)> {
        let overdue = |c: &Conn| c.ack_deadline.is_some_and(|d| d <= now);
        let late: Vec<usize> = self
            .peers
            .get(tok)?
            .conns
            .iter()
            .enumerate()
            .filter(|(_, c)| overdue(c))
            .map(|(i, _)| i)
            .collect();
        for ci in late {
            if let Err(failure) = self.handle_ack(tok, ci) {
                return Some(failure);
            }
        }
        self.peers.get(tok)?.conns.iter().any(overdue).then(|| {
            let reason = format!(
                "no acknowledgement of the connection within {:?} (the listener is not serving)",
                self.cfg.handshake_timeout.saturating_mul(2)
            );
            (Failure::Gone, reason)
        })
    }

    /// Arms the timer for the earliest deadline: a pending handshake, an
    /// acknowledgement we wait for, the end of an accept pause, the drop
    /// of messages a departed peer left.
    pub(crate) fn update_timer(&mut self) {
        let mut next = self.pending.values().map(|p| p.deadline).min();
        let mut earliest = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        if let Some(AcceptPause::Until(t)) = self.accept_pause {
            earliest(t);
        }
        if let Some(t) = self.matcher.next_departure(self.cfg.departed_hold) {
            earliest(t);
        }
        if self.awaiting_ack > 0 {
            for p in self.peers.iter() {
                for d in p.conns.iter().filter_map(|c| c.ack_deadline) {
                    earliest(d);
                }
            }
        }
        // A wake-up of the owner not seen yet stays due now.
        if self.owner_woken {
            earliest(Instant::now());
        }
        if let Err(e) = self.timer.set(next) {
            tracing::warn!(error = %na_core::ErrorChain(&e), "sm: setting the deadline timer failed");
        }
    }
}

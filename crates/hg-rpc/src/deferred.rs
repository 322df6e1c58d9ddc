//! How many requests wait for (or run in) asynchronous handlers, per
//! origin and in all, so that the bound on them holds.
//!
//! A request for a deferred handler is queued for the executor (the tokio
//! front end starts one task per request) and stays until it is answered
//! or dropped. Without a bound a caller could queue requests as fast as the
//! transport carries them, and a handler that waits on I/O would let them
//! (and their tasks) pile up without limit. Each queued request holds a
//! [`DeferredTicket`]; taking one past either bound
//! ([`Engine::set_max_deferred`](crate::Engine::set_max_deferred)) fails,
//! and the request is answered "busy" instead of queued.

use std::sync::{Arc, Mutex, MutexGuard};

use na_core::fasthash::FastMap;

use crate::origin::Origin;

/// Default bound of requests one origin may have waiting for deferred
/// handlers (4 times the 1,000 calls in flight a client is expected to
/// keep up).
pub const DEFAULT_MAX_DEFERRED_PER_PEER: usize = 4096;

/// Default bound of requests waiting for deferred handlers in all.
pub const DEFAULT_MAX_DEFERRED_TOTAL: usize = 8 * DEFAULT_MAX_DEFERRED_PER_PEER;

#[derive(Default, Debug)]
struct Counts {
    by_peer: FastMap<Origin, usize>,
    total: usize,
    /// Bytes of pulled inputs the requests of each origin hold (see
    /// [`DeferredLedger::hold_bytes`]).
    bytes_by_peer: FastMap<Origin, u64>,
}

/// The counts, shared with the tickets (which may be dropped on any thread).
#[derive(Clone, Default, Debug)]
pub(crate) struct DeferredLedger(Arc<Mutex<Counts>>);

impl DeferredLedger {
    fn counts(&self) -> MutexGuard<'_, Counts> {
        // A panic while the lock was held left the counts consistent (each
        // update is one statement pair): go on with them.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A ticket for one more request from origin `peer` (a process, where
    /// the transport names it: see [`Origin`]), if that keeps it within
    /// `per_peer` and everyone within `total`; else why not.
    pub fn admit(&self, peer: Origin, per_peer: usize, total: usize) -> Result<DeferredTicket, String> {
        let mut c = self.counts();
        let mine = c.by_peer.get(&peer).copied().unwrap_or(0);
        if mine >= per_peer {
            return Err(format!(
                "target busy: {mine} requests from this caller wait for asynchronous handlers \
                 (at most {per_peer}); try again later"
            ));
        }
        if c.total >= total {
            return Err(format!(
                "target busy: {} requests wait for asynchronous handlers (at most {total}); \
                 try again later",
                c.total
            ));
        }
        *c.by_peer.entry(peer).or_insert(0) += 1;
        c.total += 1;
        Ok(DeferredTicket {
            peer,
            ledger: self.clone(),
        })
    }

    /// Requests holding a ticket now.
    pub fn total(&self) -> usize {
        self.counts().total
    }

    /// Counts `bytes` more of pulled inputs held by origin `peer`'s
    /// requests (its share of the pull budget, see
    /// `Engine::set_max_pull_bytes_per_peer`), until
    /// [`release_bytes`](Self::release_bytes).
    pub fn hold_bytes(&self, peer: Origin, bytes: u64) {
        *self.counts().bytes_by_peer.entry(peer).or_insert(0) += bytes;
    }

    /// Gives back `bytes` that [`hold_bytes`](Self::hold_bytes) counted.
    pub fn release_bytes(&self, peer: Origin, bytes: u64) {
        let mut c = self.counts();
        if let Some(n) = c.bytes_by_peer.get_mut(&peer) {
            *n = n.saturating_sub(bytes);
            if *n == 0 {
                c.bytes_by_peer.remove(&peer);
            }
        }
    }

    /// Bytes of pulled inputs origin `peer`'s requests hold now.
    pub fn bytes_of(&self, peer: Origin) -> u64 {
        self.counts().bytes_by_peer.get(&peer).copied().unwrap_or(0)
    }
}

/// One request's place under the bound; given back when dropped (the
/// request was answered, or dropped unanswered).
#[derive(Debug)]
pub(crate) struct DeferredTicket {
    peer: Origin,
    ledger: DeferredLedger,
}

impl Drop for DeferredTicket {
    fn drop(&mut self) {
        let mut c = self.ledger.counts();
        c.total -= 1;
        if let Some(n) = c.by_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                c.by_peer.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Origin `n` (an address token).
    fn o(n: u64) -> Origin {
        Origin::Addr(n)
    }

    #[test]
    fn bounds_per_origin_and_in_all_and_tickets_give_back_on_drop() {
        let l = DeferredLedger::default();
        let a: Vec<_> = (0..2).map(|_| l.admit(o(1), 2, 3).unwrap()).collect();
        assert!(l
            .admit(o(1), 2, 3)
            .unwrap_err()
            .contains("2 requests from this caller"));
        let b = l.admit(o(2), 2, 3).unwrap();
        assert!(l.admit(o(3), 2, 3).unwrap_err().contains("3 requests wait"));
        assert_eq!(l.total(), 3);
        drop(a);
        assert_eq!(l.total(), 1);
        let again = std::thread::spawn({
            let l = l.clone();
            move || l.admit(o(1), 2, 3).map(drop).is_ok()
        });
        assert!(again.join().unwrap());
        drop(b);
        assert_eq!(l.total(), 0);
        assert!(l.counts().by_peer.is_empty());
    }

    #[test]
    fn bytes_held_are_counted_per_origin_and_given_back() {
        let l = DeferredLedger::default();
        l.hold_bytes(o(1), 10);
        l.hold_bytes(o(1), 5);
        l.hold_bytes(o(2), 7);
        assert_eq!((l.bytes_of(o(1)), l.bytes_of(o(2)), l.bytes_of(o(3))), (15, 7, 0));
        let other = std::thread::spawn({
            let l = l.clone();
            move || l.release_bytes(o(1), 10)
        });
        other.join().unwrap();
        assert_eq!(l.bytes_of(o(1)), 5);
        l.release_bytes(o(1), 5);
        l.release_bytes(o(2), 7);
        assert!(l.counts().bytes_by_peer.is_empty());
    }
}

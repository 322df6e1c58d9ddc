//! [`SendBacklog`]: the sends waiting for room at one peer, in order, and
//! bounded in bytes.
//!
//! A plugin copies a message it cannot hand to the transport at once (the
//! peer's ring or receive queue is full) into a backlog and retries it
//! later. Without a bound that copy is the peer's to grow: a client that
//! sends requests but never reads the responses makes a server queue every
//! response, until the server runs out of memory. Each plugin's backlogs
//! are therefore bounded per peer and in all ([`SendBacklog::admit`]; the
//! backlogs of one plugin share a [`BacklogTotal`], so that a process
//! posing as many peers cannot multiply the per-peer bound); a send past a
//! bound fails at once with [`NaError::SendBacklogFull`] and nothing is
//! queued, so the caller learns of it while it still holds the message.
//!
//! Every queued send is charged its payload plus [`QUEUED_SEND_OVERHEAD`],
//! so that a flood of empty messages is bounded too.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::NaError;

/// Bytes charged per queued send on top of its payload (about what the
/// queue entry and its allocation cost).
pub const QUEUED_SEND_OVERHEAD: usize = 64;

/// Default per-peer bound of the plugins' send backlogs, in bytes: room
/// for thousands of calls in flight to one peer with arguments of a few
/// KiB, far below what would hurt a server.
pub const DEFAULT_MAX_BACKLOG_BYTES: usize = 64 << 20;

/// What any peer may queue whatever the other peers hold (capped at a
/// quarter of the per-peer bound): peers that stopped reading and filled
/// the total must not make sends to the peers that read fail whenever
/// their ring is briefly full. The total can thus be passed by at most
/// this much per peer.
pub const BACKLOG_FLOOR: usize = 1 << 20;

/// Default bound of all of one plugin's send backlogs together, in bytes.
pub const DEFAULT_MAX_BACKLOG_TOTAL: usize = 4 * DEFAULT_MAX_BACKLOG_BYTES;

/// The bytes charged in all the backlogs that share it (one per plugin).
#[derive(Clone, Debug, Default)]
pub struct BacklogTotal(Arc<AtomicUsize>);

impl BacklogTotal {
    /// Bytes charged now.
    pub fn bytes(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// The sends queued for one peer, oldest first, with their charged bytes.
#[derive(Debug)]
pub struct SendBacklog<T> {
    items: VecDeque<(T, usize)>,
    bytes: usize,
    total: BacklogTotal,
}

impl<T> Drop for SendBacklog<T> {
    fn drop(&mut self) {
        self.total.0.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// What a send of `len` payload bytes is charged.
fn charge(len: usize) -> usize {
    len.saturating_add(QUEUED_SEND_OVERHEAD)
}

impl<T> SendBacklog<T> {
    /// An empty backlog whose charges also count in `total`.
    pub fn new(total: &BacklogTotal) -> Self {
        SendBacklog {
            items: VecDeque::new(),
            bytes: 0,
            total: total.clone(),
        }
    }

    /// Checks that a send of `len` payload bytes fits under `max` bytes for
    /// this peer and `max_total` for all the backlogs sharing its total
    /// (what [`push_back`](Self::push_back) will charge). The error names
    /// `peer`, the bound and how much is queued: the send must not be
    /// queued. An empty backlog admits any one send, so that no bound stops
    /// a peer that reads, and the total is checked only once this backlog
    /// holds [`BACKLOG_FLOOR`] (or a quarter of `max`, if less): peers that
    /// stopped reading cannot make sends to the others fail.
    pub fn admit(
        &self,
        len: usize,
        max: usize,
        max_total: usize,
        peer: &dyn std::fmt::Display,
    ) -> Result<(), NaError> {
        if self.items.is_empty() {
            return Ok(());
        }
        let c = charge(len);
        let floor = BACKLOG_FLOOR.min(max / 4);
        let (bytes, bound, scope) = if self.bytes.saturating_add(c) > max {
            (self.bytes, max, "to this peer")
        } else if self.bytes.saturating_add(c) > floor && self.total.bytes().saturating_add(c) > max_total {
            (self.total.bytes(), max_total, "to all peers")
        } else {
            return Ok(());
        };
        Err(NaError::SendBacklogFull {
            peer: peer.to_string(),
            queued: self.items.len(),
            bytes,
            max: bound,
            scope,
        })
    }

    /// Queues `item`, a send of `len` payload bytes, last. Call
    /// [`admit`](Self::admit) first: this one does not check the bounds.
    pub fn push_back(&mut self, item: T, len: usize) {
        let c = charge(len);
        self.bytes += c;
        self.total.0.fetch_add(c, Ordering::Relaxed);
        self.items.push_back((item, c));
    }

    /// The oldest queued send.
    pub fn front(&self) -> Option<&T> {
        self.items.front().map(|(t, _)| t)
    }

    /// Takes the oldest queued send out.
    pub fn pop_front(&mut self) -> Option<T> {
        let (t, c) = self.items.pop_front()?;
        self.uncharge(c);
        Some(t)
    }

    fn uncharge(&mut self, c: usize) {
        self.bytes -= c;
        self.total.0.fetch_sub(c, Ordering::Relaxed);
    }

    /// Takes out the first queued send for which `is` holds (a cancel).
    pub fn remove_first(&mut self, mut is: impl FnMut(&T) -> bool) -> Option<T> {
        let i = self.items.iter().position(|(t, _)| is(t))?;
        let (t, c) = self.items.remove(i)?;
        self.uncharge(c);
        Some(t)
    }

    /// Takes every queued send out, oldest first (a failed peer).
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        let all = self.bytes;
        self.uncharge(all);
        self.items.drain(..).map(|(t, _)| t)
    }

    /// True if nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Number of queued sends.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Bytes charged for the queued sends.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl<T> IntoIterator for SendBacklog<T> {
    type Item = T;
    type IntoIter = std::iter::Map<std::collections::vec_deque::IntoIter<(T, usize)>, fn((T, usize)) -> T>;

    /// Every queued send, oldest first.
    fn into_iter(mut self) -> Self::IntoIter {
        let all = self.bytes;
        self.uncharge(all);
        std::mem::take(&mut self.items).into_iter().map(|(t, _)| t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_payload_and_overhead_and_refunds_on_every_exit() {
        let total = BacklogTotal::default();
        let mut b = SendBacklog::new(&total);
        b.push_back(1u32, 100);
        b.push_back(2, 0);
        b.push_back(3, 10);
        assert_eq!(b.bytes(), 110 + 3 * QUEUED_SEND_OVERHEAD);
        assert_eq!(b.remove_first(|&t| t == 2), Some(2));
        assert_eq!(b.bytes(), 110 + 2 * QUEUED_SEND_OVERHEAD);
        assert_eq!(b.pop_front(), Some(1));
        assert_eq!(b.bytes(), 10 + QUEUED_SEND_OVERHEAD);
        assert_eq!(b.front(), Some(&3));
        assert_eq!(b.drain().collect::<Vec<_>>(), vec![3]);
        assert_eq!((b.bytes(), b.len()), (0, 0));
        assert!(b.remove_first(|_| true).is_none());
        assert_eq!(total.bytes(), 0);
        // Dropping or consuming a backlog refunds the total too.
        let mut c = SendBacklog::new(&total);
        c.push_back(4u32, 36);
        b.push_back(5, 0);
        assert_eq!(total.bytes(), (36 + QUEUED_SEND_OVERHEAD) + QUEUED_SEND_OVERHEAD);
        drop(c);
        assert_eq!(total.bytes(), QUEUED_SEND_OVERHEAD);
        assert_eq!(b.into_iter().collect::<Vec<_>>(), vec![5]);
        assert_eq!(total.bytes(), 0);
    }

    #[test]
    fn admit_refuses_past_the_bound_but_always_takes_one() {
        let (max, all) = (1000, usize::MAX);
        let total = BacklogTotal::default();
        let mut b = SendBacklog::new(&total);
        // One send larger than the bound still goes when nothing waits.
        assert!(b.admit(5000, max, all, &"p").is_ok());
        b.push_back((), 500);
        // 564 charged; 400 more is charged 464, and 1028 > 1000: refused.
        let full = b.admit(400, max, all, &"sm://1-x").unwrap_err();
        match full {
            NaError::SendBacklogFull {
                peer,
                queued,
                bytes,
                max: m,
                scope,
            } => {
                assert_eq!(
                    (peer.as_str(), queued, bytes, m, scope),
                    ("sm://1-x", 1, 564, max, "to this peer")
                );
            }
            other => panic!("wrong error {other:?}"),
        }
        // Exactly at the bound is admitted.
        assert!(b.admit(max - 564 - QUEUED_SEND_OVERHEAD, max, all, &"p").is_ok());
        assert!(b
            .admit(max - 564 - QUEUED_SEND_OVERHEAD + 1, max, all, &"p")
            .is_err());
        b.pop_front();
        assert!(b.admit(400, max, all, &"p").is_ok());
    }

    #[test]
    fn the_total_bounds_all_backlogs_sharing_it_but_not_one_below_its_floor() {
        let total = BacklogTotal::default();
        let (mut a, mut b, mut c) = (
            SendBacklog::new(&total),
            SendBacklog::new(&total),
            SendBacklog::<()>::new(&total),
        );
        a.push_back((), 436); // 500 charged
        b.push_back((), 436);
        // Within b's own bound (1000), past the total of 1200.
        let e = b.admit(300, 1000, 1200, &"p").unwrap_err();
        assert!(
            matches!(
                e,
                NaError::SendBacklogFull {
                    bytes: 1000,
                    max: 1200,
                    scope: "to all peers",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("to all peers"), "{e}");
        // An empty backlog still gets one send, and one below its floor
        // (a quarter of 1000 here) more, whatever the total holds.
        assert!(c.admit(300, 1000, 1200, &"p").is_ok());
        c.push_back((), 100); // 164
        assert!(c.admit(22, 1000, 1200, &"p").is_ok(), "250 <= floor 250");
        assert!(c.admit(23, 1000, 1200, &"p").is_err(), "251 > floor, total full");
        a.pop_front();
        assert!(b.admit(300, 1000, 1200, &"p").is_ok());
    }
}

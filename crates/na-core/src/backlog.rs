//! [`SendBacklog`]: the sends waiting for room at one peer, in order, and
//! bounded in bytes.
//!
//! A plugin copies a message it cannot hand to the transport at once (the
//! peer's ring or receive queue is full) into a backlog and retries it
//! later. Without a bound that copy is the peer's to grow: a client that
//! sends requests but never reads the responses makes a server queue every
//! response, until the server runs out of memory. Each plugin's backlog
//! is therefore bounded per peer ([`SendBacklog::admit`]); a send past the
//! bound fails at once with [`NaError::SendBacklogFull`] and nothing is
//! queued, so the caller learns of it while it still holds the message.
//!
//! Every queued send is charged its payload plus [`QUEUED_SEND_OVERHEAD`],
//! so that a flood of empty messages is bounded too.

use std::collections::VecDeque;

use crate::NaError;

/// Bytes charged per queued send on top of its payload (about what the
/// queue entry and its allocation cost).
pub const QUEUED_SEND_OVERHEAD: usize = 64;

/// Default per-peer bound of the plugins' send backlogs, in bytes: room
/// for thousands of calls in flight to one peer with arguments of a few
/// KiB, far below what would hurt a server.
pub const DEFAULT_MAX_BACKLOG_BYTES: usize = 64 << 20;

/// The sends queued for one peer, oldest first, with their charged bytes.
#[derive(Debug)]
pub struct SendBacklog<T> {
    items: VecDeque<(T, usize)>,
    bytes: usize,
}

impl<T> Default for SendBacklog<T> {
    fn default() -> Self {
        SendBacklog {
            items: VecDeque::new(),
            bytes: 0,
        }
    }
}

/// What a send of `len` payload bytes is charged.
fn charge(len: usize) -> usize {
    len.saturating_add(QUEUED_SEND_OVERHEAD)
}

impl<T> SendBacklog<T> {
    /// An empty backlog.
    pub fn new() -> Self {
        Self::default()
    }

    /// Checks that a send of `len` payload bytes fits under `max` bytes
    /// (what [`push_back`](Self::push_back) will charge). The error names
    /// `peer` and says how much is queued: the send must not be queued.
    /// An empty backlog admits any one send, so that a bound smaller than
    /// a message never stops a peer that reads.
    pub fn admit(&self, len: usize, max: usize, peer: &dyn std::fmt::Display) -> Result<(), NaError> {
        if self.items.is_empty() || self.bytes.saturating_add(charge(len)) <= max {
            return Ok(());
        }
        Err(NaError::SendBacklogFull {
            peer: peer.to_string(),
            queued: self.items.len(),
            bytes: self.bytes,
            max,
        })
    }

    /// Queues `item`, a send of `len` payload bytes, last. Call
    /// [`admit`](Self::admit) first: this one does not check the bound.
    pub fn push_back(&mut self, item: T, len: usize) {
        let c = charge(len);
        self.bytes += c;
        self.items.push_back((item, c));
    }

    /// The oldest queued send.
    pub fn front(&self) -> Option<&T> {
        self.items.front().map(|(t, _)| t)
    }

    /// Takes the oldest queued send out.
    pub fn pop_front(&mut self) -> Option<T> {
        let (t, c) = self.items.pop_front()?;
        self.bytes -= c;
        Some(t)
    }

    /// Takes out the first queued send for which `is` holds (a cancel).
    pub fn remove_first(&mut self, mut is: impl FnMut(&T) -> bool) -> Option<T> {
        let i = self.items.iter().position(|(t, _)| is(t))?;
        let (t, c) = self.items.remove(i)?;
        self.bytes -= c;
        Some(t)
    }

    /// Takes every queued send out, oldest first (a failed peer).
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.bytes = 0;
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
    fn into_iter(self) -> Self::IntoIter {
        self.items.into_iter().map(|(t, _)| t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_payload_and_overhead_and_refunds_on_every_exit() {
        let mut b = SendBacklog::new();
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
    }

    #[test]
    fn admit_refuses_past_the_bound_but_always_takes_one() {
        let max = 1000;
        let mut b = SendBacklog::new();
        // One send larger than the bound still goes when nothing waits.
        assert!(b.admit(5000, max, &"p").is_ok());
        b.push_back((), 500);
        // 564 charged; 400 more is charged 464, and 1028 > 1000: refused.
        let full = b.admit(400, max, &"sm://1-x").unwrap_err();
        match full {
            NaError::SendBacklogFull {
                peer,
                queued,
                bytes,
                max: m,
            } => {
                assert_eq!((peer.as_str(), queued, bytes, m), ("sm://1-x", 1, 564, max));
            }
            other => panic!("wrong error {other:?}"),
        }
        // Exactly at the bound is admitted.
        assert!(b.admit(max - 564 - QUEUED_SEND_OVERHEAD, max, &"p").is_ok());
        assert!(b.admit(max - 564 - QUEUED_SEND_OVERHEAD + 1, max, &"p").is_err());
        b.pop_front();
        assert!(b.admit(400, max, &"p").is_ok());
    }
}

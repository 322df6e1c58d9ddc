//! Matching of arrived messages with posted receives. No I/O.
//!
//! Unexpected messages go to the oldest posted unexpected receive, or wait
//! in arrival order for the next one. Expected messages are matched on
//! (source, tag): they go to the oldest receive posted for that pair, or
//! wait (copied out of shared memory, so the sender's buffer is free again)
//! until one is posted. Nothing is ever dropped.

use std::collections::hash_map::Entry;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

use na_core::fasthash::FastMap;

use na_core::{Addr, Completion, NaError, OpId, OpKind, Tag};

use crate::id_filter::IdFilter;

/// Where a posted (not yet completed) operation waits; used by cancel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpPlace {
    /// In the posted unexpected receives. Not kept in the plugin's table
    /// of ops (see `Matcher::posted_ids`): cancel looks there for an id
    /// the table lacks.
    RecvUnexpected,
    /// In the posted expected receives under (peer token, tag).
    RecvExpected(u64, Tag),
    /// In the send backlog of the peer with this token.
    Send(u64),
    /// Handed to the RMA transfer threads, for the peer with this token
    /// (see `rma::offload`).
    Rma(u64),
}

type Key = (u64, Tag);

/// How many emptied posted-receive queues stay in the map (see `parked`).
const PARKED: usize = 4;
/// Queues kept for reuse after their key was removed.
const MAX_SPARE: usize = 64;

/// Posted receives and early arrivals.
#[derive(Default)]
pub(crate) struct Matcher {
    posted_unexpected: VecDeque<(OpId, Vec<u8>)>,
    /// The ids in `posted_unexpected`, for duplicate checks: an RPC layer
    /// posts and completes one unexpected receive per message, and a
    /// hash-table entry for each cost two table operations per message.
    posted_ids: IdFilter,
    arrived_unexpected: VecDeque<(Addr, Tag, Vec<u8>)>,
    posted_expected: FastMap<Key, VecDeque<(OpId, Vec<u8>)>>,
    arrived_expected: FastMap<Key, VecDeque<(Addr, Vec<u8>)>>,
    /// The last [`PARKED`] keys whose queue in `posted_expected` became
    /// empty, oldest first. Every empty queue in the map is parked: a key
    /// used again soon (a ping tag) costs no removal and insertion, and one
    /// used once (an RPC cookie) is removed when it falls out of here, so
    /// the map holds at most `PARKED` empty queues.
    parked: VecDeque<Key>,
    /// Queues whose key was removed, kept so that posting an expected
    /// receive under a new key allocates nothing in steady state.
    spare: Vec<VecDeque<(OpId, Vec<u8>)>>,
    /// Messages waiting for a receive (both kinds).
    pub queued_arrivals: usize,
    /// The same, per sending peer (token), for the flood bound.
    queued_by_peer: FastMap<u64, usize>,
    /// Peers that went away with expected messages waiting, oldest first,
    /// and when (see [`Matcher::drop_departed`]).
    departed: VecDeque<(u64, Instant)>,
}

impl Matcher {
    /// A message arrived from `source`; `fill` copies its payload into a
    /// buffer (replacing its contents). Returns the id of the posted
    /// expected receive it completed (pushed onto `out`), if any: that id
    /// leaves the plugin's table of ops. (A completed unexpected receive is
    /// pushed onto `out` too, but those are not in that table.)
    pub fn deliver(
        &mut self,
        source: &Addr,
        expected: bool,
        tag: Tag,
        fill: impl FnOnce(&mut Vec<u8>),
        out: &mut VecDeque<Completion>,
    ) -> Option<OpId> {
        if !expected {
            if let Some((op, mut buf)) = self.posted_unexpected.pop_front() {
                self.posted_ids.remove(op);
                fill(&mut buf);
                out.push_back(Completion::received(
                    op,
                    OpKind::RecvUnexpected,
                    buf,
                    source.clone(),
                    tag,
                ));
                return None;
            }
            let mut v = Vec::new();
            fill(&mut v);
            self.arrived_unexpected.push_back((source.clone(), tag, v));
        } else {
            let key = (source.token(), tag);
            if let Some(q) = self.posted_expected.get_mut(&key) {
                if let Some((op, mut buf)) = q.pop_front() {
                    if q.is_empty() {
                        self.park(key);
                    }
                    fill(&mut buf);
                    out.push_back(Completion::received(
                        op,
                        OpKind::RecvExpected,
                        buf,
                        source.clone(),
                        tag,
                    ));
                    return Some(op);
                }
            }
            let mut v = Vec::new();
            fill(&mut v);
            self.arrived_expected
                .entry(key)
                .or_default()
                .push_back((source.clone(), v));
        }
        self.queued_arrivals += 1;
        *self.queued_by_peer.entry(source.token()).or_insert(0) += 1;
        None
    }

    /// True if a message of this kind and tag from `token` would find no
    /// posted receive (and so be queued).
    pub fn would_queue(&self, token: u64, expected: bool, tag: Tag) -> bool {
        if expected {
            self.posted_expected
                .get(&(token, tag))
                .is_none_or(|q| q.is_empty())
        } else {
            self.posted_unexpected.is_empty()
        }
    }

    /// True if `op` names a posted unexpected receive.
    pub fn has_posted_unexpected(&self, op: OpId) -> bool {
        self.posted_ids.may_contain(op) && self.posted_unexpected.iter().any(|(o, _)| *o == op)
    }

    /// True if unexpected messages wait for a receive.
    pub fn has_arrived_unexpected(&self) -> bool {
        !self.arrived_unexpected.is_empty()
    }

    /// Unexpected receives posted and not yet completed.
    pub fn posted_unexpected(&self) -> usize {
        self.posted_unexpected.len()
    }

    /// Messages from `token` waiting for a receive.
    pub fn queued_from(&self, token: u64) -> usize {
        self.queued_by_peer.get(&token).copied().unwrap_or(0)
    }

    /// (peer token, messages from it waiting for a receive), for each peer
    /// with some.
    pub fn queued_by_peer(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        self.queued_by_peer.iter().map(|(&t, &n)| (t, n))
    }

    fn dequeued(&mut self, token: u64) {
        self.queued_arrivals -= 1;
        if let Some(n) = self.queued_by_peer.get_mut(&token) {
            *n -= 1;
            if *n == 0 {
                self.queued_by_peer.remove(&token);
            }
        }
    }

    /// Posts an unexpected receive; completes it at once (into `out`) if a
    /// message is waiting. Returns true if it was posted (not completed).
    pub fn post_unexpected(&mut self, op: OpId, mut buf: Vec<u8>, out: &mut VecDeque<Completion>) -> bool {
        if let Some((src, tag, data)) = self.arrived_unexpected.pop_front() {
            self.dequeued(src.token());
            replace(&mut buf, &data);
            out.push_back(Completion::received(op, OpKind::RecvUnexpected, buf, src, tag));
            return false;
        }
        self.posted_unexpected.push_back((op, buf));
        self.posted_ids.insert(op);
        true
    }

    /// Posts an expected receive for (source, tag); see
    /// [`post_unexpected`](Self::post_unexpected).
    pub fn post_expected(
        &mut self,
        source: &Addr,
        tag: Tag,
        op: OpId,
        mut buf: Vec<u8>,
        out: &mut VecDeque<Completion>,
    ) -> bool {
        let key = (source.token(), tag);
        // Usually nothing waits: skip the lookup then.
        let waiting = if self.arrived_expected.is_empty() {
            None
        } else {
            self.arrived_expected.get_mut(&key)
        };
        if let Some(q) = waiting {
            if let Some((src, data)) = q.pop_front() {
                if q.is_empty() {
                    self.arrived_expected.remove(&key);
                }
                self.dequeued(src.token());
                replace(&mut buf, &data);
                out.push_back(Completion::received(op, OpKind::RecvExpected, buf, src, tag));
                return false;
            }
        }
        match self.posted_expected.entry(key) {
            Entry::Occupied(o) => {
                let q = o.into_mut();
                if q.is_empty() {
                    self.parked.retain(|k| *k != key);
                }
                q.push_back((op, buf));
            }
            Entry::Vacant(v) => v
                .insert(self.spare.pop().unwrap_or_default())
                .push_back((op, buf)),
        }
        true
    }

    /// The queue of `key` became empty: park it, and remove the oldest
    /// parked key's queue if that makes more than [`PARKED`].
    fn park(&mut self, key: Key) {
        if self.parked.len() == PARKED {
            if let Some(old) = self.parked.pop_front() {
                if let Some(q) = self.posted_expected.remove(&old) {
                    debug_assert!(q.is_empty(), "a parked queue is empty");
                    if self.spare.len() < MAX_SPARE && q.capacity() <= 16 {
                        self.spare.push(q);
                    }
                }
            }
        }
        self.parked.push_back(key);
    }

    /// True if a message from `token` waits for an expected receive with `tag`.
    pub fn has_arrived_expected(&self, token: u64, tag: Tag) -> bool {
        self.arrived_expected.contains_key(&(token, tag))
    }

    /// Removes a posted receive (cancel); gives its buffer back.
    pub fn take_posted(&mut self, op: OpId, place: OpPlace) -> Option<Vec<u8>> {
        match place {
            OpPlace::RecvUnexpected => {
                if !self.posted_ids.may_contain(op) {
                    return None;
                }
                let i = self.posted_unexpected.iter().position(|(o, _)| *o == op)?;
                self.posted_ids.remove(op);
                self.posted_unexpected.remove(i).map(|(_, b)| b)
            }
            OpPlace::RecvExpected(tok, tag) => {
                let q = self.posted_expected.get_mut(&(tok, tag))?;
                let i = q.iter().position(|(o, _)| *o == op)?;
                let b = q.remove(i).map(|(_, b)| b);
                if q.is_empty() {
                    self.park((tok, tag));
                }
                b
            }
            OpPlace::Send(_) | OpPlace::Rma(_) => None,
        }
    }

    /// Fails every expected receive posted for peer `token` with `err()`.
    /// Returns the failed op ids.
    pub fn fail_peer(
        &mut self,
        token: u64,
        stays: bool,
        err: impl Fn() -> NaError,
        out: &mut VecDeque<Completion>,
    ) -> Vec<OpId> {
        let keys: Vec<Key> = self
            .posted_expected
            .keys()
            .filter(|k| k.0 == token)
            .copied()
            .collect();
        self.parked.retain(|k| k.0 != token);
        // A token that stays in use (our own: its connection is made again)
        // never departs: its later messages would be dropped with it.
        if !stays && !self.arrived_expected.is_empty() && self.arrived_expected.keys().any(|k| k.0 == token) {
            self.departed.push_back((token, Instant::now()));
        }
        let mut failed = Vec::new();
        for k in keys {
            for (op, buf) in self.posted_expected.remove(&k).unwrap_or_default() {
                out.push_back(Completion::failed(op, OpKind::RecvExpected, err(), Some(buf)));
                failed.push(op);
            }
        }
        failed
    }
}

impl Matcher {
    /// When [`drop_departed`](Self::drop_departed) with `hold` has
    /// something to drop next, if any peer left messages (`None` too when
    /// that is beyond the clock's range: a hold meant as "never").
    pub fn next_departure(&self, hold: Duration) -> Option<Instant> {
        self.departed
            .front()
            .and_then(|&(_, since)| since.checked_add(hold))
    }

    /// Drops the expected messages of peers that went away more than
    /// `hold` ago: only a receive naming such a peer could take them, and
    /// a peer that comes and goes would otherwise pile them up. Returns
    /// how many went. One comparison when no peer left any.
    pub fn drop_departed(&mut self, hold: Duration) -> usize {
        let mut dropped = 0;
        while let Some(&(token, since)) = self.departed.front() {
            if since.elapsed() < hold {
                break;
            }
            self.departed.pop_front();
            let keys: Vec<Key> = self
                .arrived_expected
                .keys()
                .filter(|k| k.0 == token)
                .copied()
                .collect();
            for k in keys {
                for _ in self.arrived_expected.remove(&k).unwrap_or_default() {
                    self.dequeued(token);
                    dropped += 1;
                }
            }
        }
        dropped
    }
}

fn replace(buf: &mut Vec<u8>, data: &[u8]) {
    buf.clear();
    buf.extend_from_slice(data);
}

#[cfg(test)]
mod tests {
    use super::*;
    use na_core::PluginId;

    #[test]
    fn early_expected_and_out_of_order_tags() {
        let a = Addr::new("sm://1-a", PluginId(0), 1, false);
        let b = Addr::new("sm://2-a", PluginId(0), 2, false);
        let mut m = Matcher::default();
        let mut out = VecDeque::new();
        // Arrives before its receive: kept.
        assert!(m
            .deliver(&a, true, 7, |v| v.extend_from_slice(b"x"), &mut out)
            .is_none());
        assert!(
            m.post_expected(&b, 7, OpId(1), Vec::new(), &mut out),
            "other source must not match"
        );
        assert!(!m.post_expected(&a, 7, OpId(2), Vec::new(), &mut out));
        assert_eq!(out.pop_front().unwrap().buf.unwrap(), b"x");
        assert!(m.post_expected(&a, 9, OpId(3), Vec::new(), &mut out));
        assert!(m.post_expected(&a, 8, OpId(4), Vec::new(), &mut out));
        assert_eq!(m.deliver(&a, true, 8, |_| {}, &mut out), Some(OpId(4)));
        assert_eq!(m.deliver(&a, true, 9, |_| {}, &mut out), Some(OpId(3)));
        assert_eq!(
            m.take_posted(OpId(1), OpPlace::RecvExpected(2, 7)),
            Some(Vec::new())
        );
        assert_eq!(m.queued_arrivals, 0);
        // Unexpected without receive waits, in order.
        m.deliver(&a, false, 1, |v| v.push(1), &mut out);
        m.deliver(&b, false, 2, |v| v.push(2), &mut out);
        out.clear();
        assert!(!m.post_unexpected(OpId(5), vec![9; 100], &mut out));
        let c = out.pop_front().unwrap();
        assert_eq!(
            (c.buf.unwrap(), c.source.unwrap(), c.tag),
            (vec![1], a.clone(), 1)
        );
        assert!(m.post_expected(&b, 3, OpId(6), Vec::new(), &mut out));
        let failed = m.fail_peer(2, false, || NaError::Canceled, &mut out);
        assert_eq!(failed, vec![OpId(6)]);
    }

    /// Emptied queues stay for reuse, a few at most: a tag per call (as
    /// the RPC layer uses) does not grow the map, a ping tag is not removed
    /// and inserted per message, and an empty queue never counts as a
    /// posted receive.
    #[test]
    fn emptied_queues_are_parked_then_removed() {
        let a = Addr::new("sm://1-a", PluginId(0), 1, false);
        let mut m = Matcher::default();
        let mut out = VecDeque::new();
        let empties = |m: &Matcher| m.posted_expected.values().filter(|q| q.is_empty()).count();
        for round in 0..3 {
            assert!(m.post_expected(&a, 7, OpId(round), Vec::new(), &mut out));
            assert!(!m.would_queue(1, true, 7));
            assert_eq!(m.deliver(&a, true, 7, |_| {}, &mut out), Some(OpId(round)));
            assert!(m.would_queue(1, true, 7), "an empty queue is no receive");
            assert_eq!((m.posted_expected.len(), m.parked.len()), (1, 1));
        }
        for tag in 0..1000u32 {
            let op = OpId(u64::from(tag));
            assert!(m.post_expected(&a, 100 + tag, op, Vec::new(), &mut out));
            assert_eq!(m.deliver(&a, true, 100 + tag, |_| {}, &mut out), Some(op));
            assert_eq!(empties(&m), m.parked.len());
            assert!(m.posted_expected.len() <= PARKED);
        }
        assert!(m.spare.len() <= MAX_SPARE && !m.spare.is_empty());
        assert!(m.post_expected(&a, 5, OpId(1), Vec::new(), &mut out));
        assert_eq!(
            m.take_posted(OpId(1), OpPlace::RecvExpected(1, 5)),
            Some(Vec::new())
        );
        assert_eq!(empties(&m), m.parked.len());
        assert!(m.post_expected(&a, 6, OpId(2), Vec::new(), &mut out));
        assert_eq!(
            m.fail_peer(1, false, || NaError::Canceled, &mut out),
            vec![OpId(2)]
        );
        assert_eq!((m.posted_expected.len(), m.parked.len()), (0, 0));
    }

    /// A departed peer's early expected messages go after the hold; our own
    /// token's (whose connection is made again) never do.
    #[test]
    fn only_departed_peers_lose_their_early_expected_messages() {
        let other = Addr::new("sm://1-a", PluginId(0), 1, false);
        let me = Addr::new("sm://2-a", PluginId(0), 2, true);
        let mut m = Matcher::default();
        let mut out = VecDeque::new();
        m.deliver(&other, true, 7, |v| v.push(1), &mut out);
        m.deliver(&me, true, 7, |v| v.push(2), &mut out);
        m.fail_peer(1, false, || NaError::Canceled, &mut out);
        m.fail_peer(2, true, || NaError::Canceled, &mut out);
        // A message from ourselves after our connection was made again.
        m.deliver(&me, true, 8, |v| v.push(3), &mut out);
        assert_eq!(m.drop_departed(Duration::ZERO), 1);
        assert!(!m.has_arrived_expected(1, 7));
        assert!(m.has_arrived_expected(2, 7) && m.has_arrived_expected(2, 8));
    }
}

//! Cancel, and its bound. An operation still queued in the plugin ends at
//! once as `Canceled`. One the device already has (an RDMA read or write,
//! or a message on the wire) cannot be recalled: a cancel marks it, and it
//! ends when the device completes it. A device or peer that never does
//! would make that wait endless, so each such cancel has a deadline,
//! `VerbsConfig::cancel_timeout` after it. When it comes, a connection
//! whose send queue completed nothing since (the device is stuck, not
//! busy) is torn down: its QP goes to the error state, which flushes every
//! work request on it, so the cancel ends. A connection still completing
//! work gets another `cancel_timeout` (a canceled transfer behind others
//! that move is not a stuck one).

use std::time::Instant;

use na_core::{Completion, NaError, OpId, OpKind, Result};

use crate::conn::{ConnRef, ConnState};
use crate::plugin::{OpLoc, VerbsPlugin};

/// A canceled operation the device has, and when to look at it again.
pub(crate) struct CancelDeadline {
    due: Instant,
    op: OpId,
    /// When it was canceled: an id reused since is another operation.
    at: Instant,
    /// `Conn::sq_done` summed over the connections holding it, when the
    /// deadline was set.
    seen: u64,
}

impl VerbsPlugin {
    /// See [`na_core::Plugin::cancel`].
    pub(crate) fn cancel_op(&mut self, op: OpId) -> Result<()> {
        let Some(loc) = self.ops.get(&op) else {
            return Err(NaError::UnknownOp(op.0));
        };
        match *loc {
            OpLoc::RecvUnexpected => {
                let q = &mut self.matching.posted_unexpected;
                if let Some(i) = q.iter().position(|(o, _)| *o == op) {
                    let (_, buf) = q.remove(i).expect("index from position");
                    self.cancel_done(op, OpKind::RecvUnexpected, Some(buf));
                }
            }
            OpLoc::RecvExpected(peer, tag) => {
                let key = (peer, tag);
                if let Some(q) = self.matching.posted_expected.get_mut(&key) {
                    if let Some(i) = q.iter().position(|(o, _)| *o == op) {
                        let (_, buf) = q.remove(i).expect("index from position");
                        if q.is_empty() {
                            self.matching.posted_expected.remove(&key);
                        }
                        self.cancel_done(op, OpKind::RecvExpected, Some(buf));
                    }
                }
            }
            OpLoc::Send(cref) => {
                let queued = self
                    .conn_mut(cref)
                    .and_then(|c| c.msg_backlog.remove_first(|m| m.op == op));
                match queued {
                    Some(m) => {
                        self.cancel_done(op, m.kind, None);
                        self.drop_outgoing(m.body);
                    }
                    // A second cancel keeps the first one's deadline.
                    None if self.canceled_sends.contains_key(&op) => {}
                    // Already on the wire: it completes (as canceled) when
                    // the device is done, or its connection goes at the
                    // cancel deadline.
                    None => {
                        let now = Instant::now();
                        self.canceled_sends.insert(op, now);
                        self.add_cancel_deadline(op, now);
                    }
                }
            }
            // Work requests still queued go now; posted ones complete when
            // the device is done, or at the cancel deadline.
            OpLoc::Rma(idx) => {
                let now = Instant::now();
                match self.rma.get_mut(idx as usize) {
                    Some(Some(r)) if r.canceled.is_none() => r.canceled = Some(now),
                    _ => return Ok(()),
                }
                self.drop_queued_rma(idx);
                if self.ops.contains_key(&op) {
                    self.add_cancel_deadline(op, now);
                }
            }
        }
        Ok(())
    }

    fn cancel_done(&mut self, op: OpId, kind: OpKind, buf: Option<Vec<u8>>) {
        self.ops.remove(&op);
        self.stats.in_flight = self.stats.in_flight.saturating_sub(1);
        self.completions
            .push_back(Completion::failed(op, kind, NaError::Canceled, buf));
    }

    /// Drops the work requests of RMA operation `idx` that wait in the
    /// connections' queues (the operation ends if none was posted).
    fn drop_queued_rma(&mut self, idx: u32) {
        let mut dropped = 0;
        for slot in &mut self.conns {
            if let Some(c) = slot.conn.as_mut() {
                let before = c.rma_backlog.len();
                c.rma_backlog.retain(|w| w.rma != idx);
                dropped += before - c.rma_backlog.len();
            }
        }
        for _ in 0..dropped {
            self.rma_piece_done(idx, None);
        }
    }

    /// Records the deadline of `op`, canceled at `at` while the device
    /// has it, and arms the timer for it if it is the earliest.
    fn add_cancel_deadline(&mut self, op: OpId, at: Instant) {
        // A timeout beyond the clock's range is no deadline.
        let Some(due) = at.checked_add(self.cfg.cancel_timeout) else {
            return;
        };
        let seen = self.sq_done_of(&self.conns_holding_canceled(op, at));
        self.cancel_deadlines
            .push_back(CancelDeadline { due, op, at, seen });
        self.arm_deadline(due);
    }

    /// Acts on the cancel deadlines that have come: tears down the
    /// connections holding a canceled operation that completed nothing
    /// since the deadline was set, gives the others another
    /// `cancel_timeout`, and forgets operations that ended. Returns the
    /// next deadline. (Deadlines stay in order: each is set
    /// `cancel_timeout` after the moment it is set.)
    pub(crate) fn sweep_cancels(&mut self, now: Instant) -> Option<Instant> {
        let limit = self.cfg.cancel_timeout;
        while let Some(d) = self.cancel_deadlines.front() {
            if d.due > now {
                return Some(d.due);
            }
            let d = self.cancel_deadlines.pop_front().expect("checked above");
            let mut holding = self.conns_holding_canceled(d.op, d.at);
            if holding.is_empty() {
                continue;
            }
            let mut seen = self.sq_done_of(&holding);
            if seen == d.seen {
                // Not read yet is not stuck: `progress` reads a bounded
                // number of completions per call.
                if let Err(e) = self.poll_cq() {
                    tracing::warn!(error = %na_core::ErrorChain(&e), "verbs: polling the CQ before a cancel deadline failed");
                }
                holding = self.conns_holding_canceled(d.op, d.at);
                if holding.is_empty() {
                    continue;
                }
                seen = self.sq_done_of(&holding);
            }
            if seen != d.seen {
                if let Some(due) = now.checked_add(limit) {
                    self.cancel_deadlines.push_back(CancelDeadline { due, seen, ..d });
                }
                continue;
            }
            for cref in holding {
                let peer = self.peer_uri_of(cref);
                self.stats.cancels_forced += 1;
                tracing::warn!(%peer, op = ?d.op, timeout = ?limit,
                    "verbs: a canceled operation did not end and its connection completed nothing; tearing the connection down");
                self.kill_conn(
                    cref,
                    format!(
                        "an operation canceled on the connection did not end, and the connection completed \
                         nothing, within {limit:?} (VerbsConfig::cancel_timeout); torn down to flush it"
                    ),
                );
            }
        }
        None
    }

    /// Send-queue completions of `conns`, summed.
    fn sq_done_of(&self, conns: &[ConnRef]) -> u64 {
        conns
            .iter()
            .filter_map(|&c| self.conn(c))
            .fold(0u64, |n, c| n.wrapping_add(c.sq_done))
    }

    /// The live connections that hold posted work of `op` if it is still
    /// the operation canceled at `at`.
    fn conns_holding_canceled(&self, op: OpId, at: Instant) -> Vec<ConnRef> {
        let live = |c: ConnRef| self.conn(c).is_some_and(|c| c.state != ConnState::Dead);
        match self.ops.get(&op) {
            Some(&OpLoc::Send(cref)) if self.canceled_sends.get(&op) == Some(&at) && live(cref) => vec![cref],
            Some(&OpLoc::Rma(idx)) => {
                let canceled = self
                    .rma
                    .get(idx as usize)
                    .and_then(|r| r.as_ref())
                    .and_then(|r| r.canceled);
                if canceled != Some(at) {
                    return Vec::new();
                }
                self.conns_with_refs()
                    .filter_map(|(r, c)| {
                        (c.state != ConnState::Dead && c.rma_posted.contains_key(&idx)).then_some(r)
                    })
                    .collect()
            }
            _ => Vec::new(),
        }
    }
}

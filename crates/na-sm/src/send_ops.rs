//! Sending: a message goes into the peer's ring at once when there is
//! room and nothing queued before it, else into its backlog, which
//! progress retries in order (see `flush_backlogs`).

use na_core::fasthash::FastMap;
use na_core::hint::cold_path;
use na_core::{Completion, NaError, OpId, OpKind, Report, Result, Tag};

use crate::channel::{Channel, MsgKind};
use crate::conn::{QueuedSend, Role};
use crate::matching::{Matcher, OpPlace};
use crate::peer_failure::wake_failure;
use crate::plugin::{SmPlugin, SIDE_BACKLOG};

pub(crate) fn kind_of(k: MsgKind) -> OpKind {
    match k {
        MsgKind::Unexpected => OpKind::SendUnexpected,
        MsgKind::Expected => OpKind::SendExpected,
    }
}

impl SmPlugin {
    /// Retries queued sends in order.
    pub(crate) fn flush_backlogs(&mut self) {
        let mut violations = Vec::new();
        let mut left = false;
        let Self {
            peers,
            completions,
            ops,
            stats,
            ..
        } = self;
        for peer in peers.iter_mut() {
            let Some(conn) = peer.conns.first_mut() else {
                continue;
            };
            if conn.backlog.is_empty() {
                continue;
            }
            let tx = if conn.role == Role::Connector { 0 } else { 1 };
            let ch = Channel::new(&conn.region, tx);
            let mut sent = false;
            while let Some(q) = conn.backlog.front() {
                // One part: its length is the message's.
                if !ch.try_send_len(&mut conn.tx_cur, q.kind, q.tag, &[&q.data], q.data.len()) {
                    break;
                }
                stats.msgs_sent += 1;
                stats.msg_bytes_sent += q.data.len() as u64;
                ops.remove(&q.op);
                completions.push_back(Completion::done(q.op, kind_of(q.kind)));
                conn.backlog.pop_front();
                sent = true;
            }
            left |= !conn.backlog.is_empty();
            if sent && ch.receiver_needs_wake() {
                match conn.wake_peer() {
                    Ok(true) => stats.signals_sent += 1,
                    Ok(false) => {}
                    Err(e) => {
                        let (f, reason) = wake_failure(&e);
                        violations.push((peer.addr.token(), f, reason));
                    }
                }
            }
        }
        if left {
            self.side_work |= SIDE_BACKLOG;
        } else {
            self.side_work &= !SIDE_BACKLOG;
        }
        for (tok, f, reason) in violations {
            self.fail_peer(tok, f, &reason);
        }
    }

    /// Sends `msg` on the peer's first connection, or queues it; `None` if
    /// the peer is gone. A send that goes out at once completes only if
    /// `report` asks for successes; a queued one always completes.
    ///
    /// (Inline: it is on the path of every message; the queueing is out
    /// of line, and so is a send that reports its success: the RPC layer
    /// sends with `Report::FailuresOnly`, and its busy path runs straight
    /// through.)
    #[inline(always)]
    pub(crate) fn send_on(
        &mut self,
        tok: u64,
        msg: Outgoing<'_>,
        op: OpId,
        report: Report,
    ) -> Option<Result<()>> {
        if report == Report::All {
            cold_path();
            return self.send_on_reported(tok, msg, op);
        }
        // A send that reports failures only and goes out at once is never
        // tracked (it completes inside this call and reports nothing), so
        // its id is checked only if it has to wait (`queue_send`): no
        // lookup on this path.
        if self.try_send_now(tok, msg, None)? {
            return Some(Ok(()));
        }
        self.queue_send(tok, msg, op, report)
    }

    /// [`send_on`](Self::send_on) of a send that completes: its id may not
    /// be one in flight, and a success goes to the completion queue.
    #[inline(never)]
    fn send_on_reported(&mut self, tok: u64, msg: Outgoing<'_>, op: OpId) -> Option<Result<()>> {
        if op_in_flight(&self.ops, &self.matcher, op) {
            cold_path();
            return Some(Err(dup(op)));
        }
        if self.try_send_now(tok, msg, Some(op))? {
            // Its completion is queued: an owner asleep must look.
            self.wake_owner_if_work();
            return Some(Ok(()));
        }
        self.queue_send(tok, msg, op, Report::All)
    }

    /// Publishes `msg` in the peer's ring now if nothing is queued before
    /// it and there is room, completes `complete` if given (before the
    /// wake-up, whose failure fails the peer's other operations), and
    /// wakes the peer if it sleeps: `Some(true)` if it went out,
    /// `Some(false)` if it must be queued, `None` if the peer is gone.
    #[inline(always)]
    fn try_send_now(&mut self, tok: u64, msg: Outgoing<'_>, complete: Option<OpId>) -> Option<bool> {
        let Some(peer) = self.peers.get_mut(tok) else {
            cold_path();
            return None;
        };
        let Some(conn) = peer.conns.first_mut() else {
            cold_path();
            return None;
        };
        let tx = if conn.role == Role::Connector { 0 } else { 1 };
        let ch = Channel::new(&conn.region, tx);
        if !conn.backlog.is_empty()
            || !ch.try_send_len(&mut conn.tx_cur, msg.kind, msg.tag, msg.parts, msg.len)
        {
            cold_path();
            return Some(false);
        }
        self.stats.msgs_sent += 1;
        self.stats.msg_bytes_sent += msg.len as u64;
        if let Some(op) = complete {
            self.completions
                .push_back(Completion::done(op, kind_of(msg.kind)));
        }
        if ch.receiver_needs_wake() {
            match conn.wake_peer() {
                Ok(true) => self.stats.signals_sent += 1,
                Ok(false) => {}
                Err(e) => {
                    cold_path();
                    let (f, reason) = wake_failure(&e);
                    self.fail_peer(tok, f, &reason);
                }
            }
        }
        Some(true)
    }

    /// [`send_on`](Self::send_on) when the message cannot go out at once
    /// (no ring slot or buffer, or sends already queued): queues it.
    #[inline(never)]
    fn queue_send(&mut self, tok: u64, msg: Outgoing<'_>, op: OpId, report: Report) -> Option<Result<()>> {
        let peer = self.peers.get_mut(tok)?;
        let conn = peer.conns.first_mut()?;
        // (A send that completes was checked in `send_on_reported`.)
        if report != Report::All && op_in_flight(&self.ops, &self.matcher, op) {
            cold_path();
            return Some(Err(dup(op)));
        }
        let (max, max_total) = (self.cfg.max_backlog_bytes, self.cfg.max_backlog_total);
        if let Err(e) = conn.backlog.admit(msg.len, max, max_total, &peer.addr) {
            cold_path();
            self.stats.sends_refused += 1;
            tracing::debug!(peer = %peer.addr, error = %na_core::ErrorChain(&e), "sm: send refused");
            return Some(Err(e));
        }
        self.side_work |= SIDE_BACKLOG;
        conn.backlog.push_back(
            QueuedSend {
                op,
                kind: msg.kind,
                tag: msg.tag,
                data: msg.parts.concat(),
            },
            msg.len,
        );
        self.ops.insert(op, OpPlace::Send(tok));
        self.stats.sends_queued += 1;
        // Armed: the owner may be asleep, and this send came from another
        // thread (a task answering, a caller) after `arm` looked at the
        // backlogs. Do for this one what `arm` does for those it finds:
        // ask the receiver to signal when room frees; or, if there is room
        // already, send it now. Otherwise it waits for an unrelated wake-up.
        if self.armed && conn.backlog.len() == 1 {
            conn.armed = true;
            if !conn.arm_backlog() {
                self.flush_backlogs();
                // Sends the flush completed (this one, or others).
                self.wake_owner_if_work();
            }
        }
        Some(Ok(()))
    }
}

/// A message to send: its kind and tag, and its bytes in parts (a
/// header and a payload, say) of `len` bytes in all, written in place
/// one after the other.
#[derive(Clone, Copy)]
pub(crate) struct Outgoing<'a> {
    pub kind: MsgKind,
    pub tag: Tag,
    pub parts: &'a [&'a [u8]],
    pub len: usize,
}

/// True if `op` names an operation in flight, so a new one may not take
/// the id: one in `ops`, or a posted unexpected receive (those are kept
/// out of `ops`; see `post_recv_unexpected`).
pub(crate) fn op_in_flight(ops: &FastMap<OpId, OpPlace>, matcher: &Matcher, op: OpId) -> bool {
    ops.contains_key(&op) || matcher.has_posted_unexpected(op)
}

/// The error for an operation started under an id in flight.
pub(crate) fn dup(op: OpId) -> NaError {
    NaError::OpInFlight(op.0)
}

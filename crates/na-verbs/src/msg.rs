//! Messages: sends (straight into a registered send slot, or queued until
//! the connection exists and has credits), posted receives, and matching
//! of arrivals against them (unexpected: first posted; expected: source
//! peer and tag). Arrivals nobody waits for are held, bounded per
//! connection by credit withholding (see `credits.rs`). Expected
//! arrivals of a peer that died stay takeable for [`DEAD_HELD_GRACE`],
//! then go.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use na_core::{Addr, Completion, MsgBuf, NaError, OpId, OpKind, Result, Tag};

use crate::conn::{ConnRef, ConnState, Outgoing, PendingSend};
use crate::error::VerbsError;
use crate::held::{release_for_total, HeldBounds, HeldTotal};
use crate::plugin::{OpLoc, VerbsPlugin};
use crate::wire::MsgKind;

/// How long expected messages of a dead peer stay held for a receive
/// naming that peer (what it sent before it went is not lost at once).
pub const DEAD_HELD_GRACE: Duration = Duration::from_secs(10);

/// A message that arrived before a receive for it was posted.
pub(crate) struct Held {
    pub conn: ConnRef,
    /// `Conn::serial` of `conn`: a slot reused since is another connection.
    pub conn_serial: u64,
    pub peer: usize,
    pub tag: Tag,
    pub data: Vec<u8>,
}

/// Receives posted for one (peer, tag), oldest first.
pub(crate) type PostedQueue = VecDeque<(OpId, Vec<u8>)>;

/// Posted receives and held arrivals.
#[derive(Default)]
pub(crate) struct Matching {
    pub posted_unexpected: PostedQueue,
    pub posted_expected: HashMap<(usize, Tag), PostedQueue>,
    pub held_unexpected: VecDeque<Held>,
    pub held_expected: HashMap<(usize, Tag), VecDeque<Held>>,
    /// When held expected messages of dead peers are next looked at.
    pub held_sweep_at: Option<Instant>,
    /// Messages in `held_unexpected` and `held_expected` together, kept
    /// as they come and go (`max_held_total`), and whether connections
    /// withhold credits for their total (see `held.rs`).
    pub held: HeldTotal,
}

impl Matching {
    /// Messages held for the application.
    pub fn held_count(&self) -> usize {
        debug_assert_eq!(
            self.held.count(),
            self.held_unexpected.len() + self.held_expected.values().map(VecDeque::len).sum::<usize>()
        );
        self.held.count()
    }
}

impl VerbsPlugin {
    pub(crate) fn send_msg(
        &mut self,
        dest: &Addr,
        kind: OpKind,
        tag: Tag,
        msg: Outgoing<'_>,
        op: OpId,
    ) -> Result<()> {
        let len = msg.bytes().len();
        let (cref, direct, established) = match self.admit_send(dest, kind, len, op) {
            Ok(admitted) => admitted,
            Err(e) => {
                // A plugin buffer goes back to the pool, not away with the
                // error.
                if let Outgoing::Buf(b) = msg {
                    self.recycle_buf(b);
                }
                return Err(e);
            }
        };
        self.ops.insert(op, OpLoc::Send(cref));
        self.stats.in_flight += 1;
        if self.cfg.debug.fail_send(len) {
            // Test hook (`VerbsConfig::debug`, `fail_msgs_over`, `_count`).
            let e = VerbsError::Post {
                op: "ibv_post_send (debug.fail_msgs_over)",
                qpn: 0,
                wr_id: op.0,
                source: std::io::Error::from_raw_os_error(libc::ENOMEM),
            };
            self.fail_unsent(cref, op, kind, msg, e.into());
            return Ok(());
        }
        if direct {
            if let Err((e, msg)) = self.post_outgoing(cref, kind, tag, msg, op) {
                self.drop_outgoing(msg);
                self.ops.remove(&op);
                self.stats.in_flight -= 1;
                return Err(e.into());
            }
        } else {
            if established {
                self.stats.sends_queued += 1;
            }
            let body = msg.into_owned();
            let conn = self.conn_mut(cref).expect("checked by admit_send");
            conn.msg_backlog
                .push_back(PendingSend { op, kind, tag, body }, len);
        }
        Ok(())
    }

    /// Checks a send of `len` bytes as operation `op` and finds its
    /// connection (connecting if need be): the connection, whether the
    /// send can be posted now, and whether the connection is established.
    /// A send that must wait was checked against the backlog bounds.
    fn admit_send(
        &mut self,
        dest: &Addr,
        kind: OpKind,
        len: usize,
        op: OpId,
    ) -> Result<(ConnRef, bool, bool)> {
        self.check_new_op(op)?;
        let max = self.cfg.max_msg_size;
        if len > max {
            return Err(NaError::MessageTooLarge {
                len,
                max,
                kind: if kind == OpKind::SendUnexpected {
                    "unexpected"
                } else {
                    "expected"
                },
            });
        }
        let peer = self.live_peer(dest)?;
        let cref = self.ensure_conn(peer)?;
        let conn = self.conn(cref).expect("ensure_conn returned a live connection");
        if let Some(max) = conn.peer_max_msg.filter(|&max| len > max) {
            return Err(NaError::MessageTooLarge {
                len,
                max,
                kind: "peer's buffer",
            });
        }
        let direct = conn.msg_backlog.is_empty() && conn.can_post_msg(false);
        let established = conn.state == ConnState::Established;
        if !direct {
            let admitted = conn.msg_backlog.admit(
                len,
                self.cfg.max_backlog_bytes,
                self.cfg.max_backlog_total,
                &self.peers[peer].uri,
            );
            if let Err(e) = admitted {
                self.stats.sends_refused += 1;
                tracing::debug!(error = %na_core::ErrorChain(&e), "verbs: send refused");
                return Err(e);
            }
        }
        Ok((cref, direct, established))
    }

    /// Posts `msg` as operation `op` on `cref` (the caller checked
    /// `can_post_msg`), from a registered buffer without a copy where it
    /// can. A buffer the device gathers from stays with its send slot; any
    /// other goes back to the pool. On error the message comes back with
    /// it, unsent (see [`fail_unsent`](Self::fail_unsent)).
    fn post_outgoing<'m>(
        &mut self,
        cref: ConnRef,
        kind: OpKind,
        tag: Tag,
        msg: Outgoing<'m>,
        op: OpId,
    ) -> std::result::Result<(), (VerbsError, Outgoing<'m>)> {
        let gather = match &msg {
            Outgoing::Buf(b) => self.registered_sge(b),
            _ => None,
        };
        let len = msg.bytes().len();
        let conn = self.conn_mut(cref).expect("caller checked the connection");
        let posted = conn.post_msg(cref, msg_kind(kind), tag, msg.bytes(), gather, Some((op, kind)));
        match (posted, msg) {
            (Ok(slot), Outgoing::Buf(b)) => {
                self.count_sent(len);
                self.hold_or_recycle(cref, slot, b, gather.is_some());
                Ok(())
            }
            (Ok(_), _) => {
                self.count_sent(len);
                Ok(())
            }
            (Err(e), msg) => Err((e, msg)),
        }
    }

    /// Send `op` (message `body`, on `cref`) failed before it reached the
    /// wire, for a reason of its own (too large for the peer's buffer, a
    /// post error): its connection stays up. Its completion gives back
    /// the message ([`Completion::buf`]) and its destination
    /// ([`Completion::source`]), so that the sender can tell the peer it
    /// was for that it will not come (hg-rpc answers the call whose
    /// response it was with an error in its place). Cold: failures only.
    #[cold]
    #[inline(never)]
    fn fail_unsent(&mut self, cref: ConnRef, op: OpId, kind: OpKind, body: Outgoing<'_>, e: NaError) {
        let msg = body.bytes().to_vec();
        self.drop_outgoing(body);
        let dest = self
            .conn(cref)
            .and_then(|c| self.peers.get(c.peer))
            .map(|p| p.addr.clone());
        if self.ops.remove(&op).is_none() {
            return;
        }
        self.stats.in_flight = self.stats.in_flight.saturating_sub(1);
        let e = if self.canceled_sends.remove(&op).is_some() {
            NaError::Canceled
        } else {
            e
        };
        let mut c = Completion::failed(op, kind, e, Some(msg));
        c.source = dest;
        self.completions.push_back(c);
    }

    /// After posting from send slot `slot`: a buffer the device gathers
    /// from stays with the slot until its completion; a copied one goes back.
    fn hold_or_recycle(&mut self, cref: ConnRef, slot: u32, buf: MsgBuf, gathered: bool) {
        if gathered {
            self.stats.sends_zero_copy += 1;
            if let Some(s) = self
                .conn_mut(cref)
                .and_then(|c| c.send_bufs.get_mut(slot as usize))
            {
                *s = Some(buf);
                return;
            }
        }
        self.recycle_buf(buf);
    }

    /// A message that will not be sent: its buffer goes back.
    pub(crate) fn drop_outgoing(&mut self, msg: Outgoing<'_>) {
        if let Outgoing::Buf(b) = msg {
            self.recycle_buf(b);
        }
    }

    fn count_sent(&mut self, len: usize) {
        self.stats.msgs_sent += 1;
        self.stats.msg_bytes_sent += len as u64;
    }

    /// Posts queued messages while credits, send slots and queue space
    /// last; then sends a credit update if one is due and nothing carried it.
    pub(crate) fn drain_msgs(&mut self, cref: ConnRef) {
        loop {
            let Some(conn) = self.conn_mut(cref) else { return };
            if conn.msg_backlog.is_empty() || !conn.can_post_msg(false) {
                break;
            }
            let m = conn.msg_backlog.pop_front().expect("checked non-empty");
            let max = conn.peer_max_msg;
            // A queued message that is canceled leaves the backlog at once
            // (`cancel_op`); only sends on the wire are in `canceled_sends`.
            debug_assert!(!self.canceled_sends.contains_key(&m.op));
            // Queued before the connection told us the peer's buffer size
            // (`send_msg` could not check it then): too large fails alone,
            // instead of breaking the peer's receive and the connection.
            let len = m.body.bytes().len();
            if let Some(max) = max.filter(|&max| len > max) {
                let e = NaError::MessageTooLarge {
                    len,
                    max,
                    kind: "peer's buffer",
                };
                self.fail_unsent(cref, m.op, m.kind, m.body, e);
                continue;
            }
            if let Err((e, body)) = self.post_outgoing(cref, m.kind, m.tag, m.body, m.op) {
                self.fail_unsent(cref, m.op, m.kind, body, e.into());
            }
        }
        let Some(conn) = self.conn_mut(cref) else { return };
        if conn.credits.wants_update() && conn.can_post_msg(true) {
            if let Err(e) = conn.post_msg(cref, MsgKind::Credit, 0, &[], None, None) {
                tracing::warn!(error = %na_core::ErrorChain(&e), "posting a credit update failed");
            }
        }
    }

    /// Completes a send operation.
    pub(crate) fn finish_send(&mut self, op: OpId, kind: OpKind, status: Result<()>) {
        if self.ops.remove(&op).is_none() {
            return;
        }
        self.stats.in_flight = self.stats.in_flight.saturating_sub(1);
        let status = if self.canceled_sends.remove(&op).is_some() {
            Err(NaError::Canceled)
        } else {
            status
        };
        self.completions.push_back(match status {
            Ok(()) => Completion::done(op, kind),
            Err(e) => Completion::failed(op, kind, e, None),
        });
    }

    /// Refuses an operation id that names one in flight: its completion
    /// could not be told from the other's, and the record of the one in
    /// flight would be lost (it would then never complete).
    pub(crate) fn check_new_op(&self, op: OpId) -> Result<()> {
        if self.ops.contains_key(&op) {
            return Err(NaError::OpInFlight(op.0));
        }
        Ok(())
    }

    pub(crate) fn recv_unexpected(&mut self, buf: Vec<u8>, op: OpId) -> Result<()> {
        self.check_new_op(op)?;
        if let Some(h) = self.matching.held_unexpected.pop_front() {
            self.deliver_held(h, buf, op, OpKind::RecvUnexpected);
            return Ok(());
        }
        self.matching.posted_unexpected.push_back((op, buf));
        self.ops.insert(op, OpLoc::RecvUnexpected);
        self.stats.in_flight += 1;
        Ok(())
    }

    pub(crate) fn recv_expected(&mut self, source: &Addr, tag: Tag, buf: Vec<u8>, op: OpId) -> Result<()> {
        self.check_new_op(op)?;
        let peer = self.peer_of(source)?;
        let key = (peer, tag);
        if let Some(q) = self.matching.held_expected.get_mut(&key) {
            let h = q.pop_front().expect("held queues are never left empty");
            if q.is_empty() {
                self.matching.held_expected.remove(&key);
            }
            self.deliver_held(h, buf, op, OpKind::RecvExpected);
            return Ok(());
        }
        self.live_peer(source)?;
        self.matching
            .posted_expected
            .entry(key)
            .or_default()
            .push_back((op, buf));
        self.ops.insert(op, OpLoc::RecvExpected(peer, tag));
        self.stats.in_flight += 1;
        Ok(())
    }

    /// Hands held message `h` (just taken out of `matching`) to receive
    /// `op`, and gives back the credits holding it withheld.
    fn deliver_held(&mut self, h: Held, mut buf: Vec<u8>, op: OpId, kind: OpKind) {
        buf.clear();
        buf.extend_from_slice(&h.data);
        let source = self.peers[h.peer].addr.clone();
        self.peers.release(h.peer);
        self.completions
            .push_back(Completion::received(op, kind, buf, source, h.tag));
        let b = self.held_bounds();
        let (conn, total) = self.conn_and_held(h.conn);
        let conn = conn.filter(|c| c.serial == h.conn_serial);
        let live = conn.is_some();
        total.taken(conn.map(|c| (&mut c.held, &mut c.credits)), b);
        if live {
            self.drain_msgs(h.conn);
        }
        self.release_total_withheld();
    }

    /// The bounds on held messages, from the configuration.
    pub(crate) fn held_bounds(&self) -> HeldBounds {
        HeldBounds {
            per_conn: self.cfg.max_held,
            total: self.cfg.max_held_total as usize,
        }
    }

    /// Connection `c` (if it is still there) and the held messages'
    /// total, borrowed together.
    pub(crate) fn conn_and_held(&mut self, c: ConnRef) -> (Option<&mut crate::conn::Conn>, &mut HeldTotal) {
        let conn = self
            .conns
            .get_mut(c.idx as usize)
            .filter(|s| s.gen == c.gen)
            .and_then(|s| s.conn.as_mut());
        (conn, &mut self.matching.held)
    }

    /// Once the messages held over all connections are under
    /// `max_held_total` again, every connection that withheld credits for
    /// that bound (and is under its own `max_held`) gets them all back,
    /// not only the one whose message was taken: the others' peers may
    /// have no credit left, and nothing else would ever return them.
    pub(crate) fn release_total_withheld(&mut self) {
        let b = self.held_bounds();
        if !self.matching.held.release_due(b) {
            return;
        }
        let released: Vec<ConnRef> = self
            .conns
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| {
                let gen = s.gen;
                let c = s.conn.as_mut().filter(|c| c.state != ConnState::Dead)?;
                release_for_total(c.held, &mut c.credits, b).then_some(ConnRef { idx: i as u16, gen })
            })
            .collect();
        for cref in released {
            self.drain_msgs(cref);
        }
    }

    /// A message arrived in receive slot `slot` of `cref` (header checked).
    pub(crate) fn on_message(&mut self, cref: ConnRef, slot: u32, kind: MsgKind, tag: Tag, len: usize) {
        let Some(conn) = self.conn(cref) else { return };
        let peer = conn.peer;
        if kind != MsgKind::Credit {
            self.stats.msgs_received += 1;
            self.stats.msg_bytes_received += len as u64;
        }
        let posted = match kind {
            MsgKind::Unexpected => self.matching.posted_unexpected.pop_front(),
            MsgKind::Expected => {
                let key = (peer, tag);
                let q = self.matching.posted_expected.get_mut(&key);
                let r = q.and_then(|q| q.pop_front());
                if self
                    .matching
                    .posted_expected
                    .get(&key)
                    .is_some_and(VecDeque::is_empty)
                {
                    self.matching.posted_expected.remove(&key);
                }
                r
            }
            MsgKind::Credit => return,
        };
        let op_kind = if kind == MsgKind::Unexpected {
            OpKind::RecvUnexpected
        } else {
            OpKind::RecvExpected
        };
        let conn = self.conn(cref).expect("checked above");
        match posted {
            Some((op, mut buf)) => {
                let res = conn.read_payload(slot, len, &mut buf);
                self.ops.remove(&op);
                self.stats.in_flight = self.stats.in_flight.saturating_sub(1);
                let c = match res {
                    Ok(()) => Completion::received(op, op_kind, buf, self.peers[peer].addr.clone(), tag),
                    Err(e) => Completion::failed(op, op_kind, e.into(), Some(buf)),
                };
                self.completions.push_back(c);
            }
            None => {
                let mut data = Vec::new();
                if conn.read_payload(slot, len, &mut data).is_err() {
                    return;
                }
                let h = Held {
                    conn: cref,
                    conn_serial: conn.serial,
                    peer,
                    tag,
                    data,
                };
                if kind == MsgKind::Unexpected {
                    self.matching.held_unexpected.push_back(h);
                } else {
                    self.matching
                        .held_expected
                        .entry((peer, tag))
                        .or_default()
                        .push_back(h);
                    if self.peers[peer].dead.is_some() {
                        // Arrived after the death (completions drained
                        // late): it goes with the others after the grace.
                        self.schedule_held_sweep();
                    }
                }
                self.peers.acquire(peer);
                // Counted here, not at the repost: a connection that died
                // meanwhile holds its messages without reposting.
                let b = self.held_bounds();
                self.matching.held.held(b);
                if let Some(conn) = self.conn_mut(cref) {
                    conn.held += 1;
                }
            }
        }
    }

    /// Plans a sweep of held expected messages once a dead peer's grace ends.
    pub(crate) fn schedule_held_sweep(&mut self) {
        if self.matching.held_expected.is_empty() {
            return;
        }
        let at = Instant::now() + DEAD_HELD_GRACE;
        let next = self.matching.held_sweep_at.map_or(at, |t| t.min(at));
        self.matching.held_sweep_at = Some(next);
        // Kept by the deadline timer too: an idle process drops them on
        // time, not at its next wake-up.
        self.arm_deadline(next);
    }

    /// Drops expected messages held for peers dead longer than
    /// [`DEAD_HELD_GRACE`]: only a receive naming the peer could take them,
    /// and a peer that reconnects and dies again and again would otherwise
    /// grow them without bound.
    pub(crate) fn sweep_dead_held(&mut self) {
        let Some(at) = self.matching.held_sweep_at else {
            return;
        };
        let now = Instant::now();
        if now < at {
            return;
        }
        let peers = &self.peers;
        let expired = |peer: usize| {
            peers[peer]
                .dead_since
                .is_some_and(|t| now.duration_since(t) >= DEAD_HELD_GRACE)
        };
        let (mut dropped, mut next) = (Vec::new(), None::<Instant>);
        self.matching.held_expected.retain(|&(peer, _), q| {
            if expired(peer) {
                dropped.extend(q.iter().map(|h| h.peer));
                return false;
            }
            if let Some(t) = peers[peer].dead_since {
                let due = t + DEAD_HELD_GRACE;
                next = Some(next.map_or(due, |n| n.min(due)));
            }
            true
        });
        for &peer in &dropped {
            self.peers.release(peer);
        }
        let dropped = dropped.len();
        self.matching.held.dropped(dropped);
        self.matching.held_sweep_at = next;
        self.release_total_withheld();
        if dropped > 0 {
            tracing::warn!(
                dropped,
                grace = ?DEAD_HELD_GRACE,
                "verbs: dropped expected messages of dead peers that no receive took"
            );
        }
    }

    /// Fails the receives posted for `peer` (it is gone).
    pub(crate) fn fail_peer_recvs(&mut self, peer: usize, reason: &str) {
        let keys: Vec<(usize, Tag)> = self
            .matching
            .posted_expected
            .keys()
            .filter(|k| k.0 == peer)
            .copied()
            .collect();
        for k in keys {
            for (op, buf) in self.matching.posted_expected.remove(&k).unwrap_or_default() {
                self.ops.remove(&op);
                self.stats.in_flight = self.stats.in_flight.saturating_sub(1);
                let e = NaError::PeerGone {
                    peer: self.peers[peer].uri.clone(),
                    reason: reason.to_owned(),
                };
                self.completions
                    .push_back(Completion::failed(op, OpKind::RecvExpected, e, Some(buf)));
            }
        }
    }
}

fn msg_kind(k: OpKind) -> MsgKind {
    if k == OpKind::SendUnexpected {
        MsgKind::Unexpected
    } else {
        MsgKind::Expected
    }
}
